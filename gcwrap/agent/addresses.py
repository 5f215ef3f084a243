"""Shadow addresses as the user gives them (--shadow, BYPASS_SHADOW_HOST and
_PORT) and as the spool records them. No I/O and no event loop: the command
line parses them before the job starts, while the rest of gcwrap loads
(see `launch`).
"""

from __future__ import annotations

from collections.abc import Iterable

Address = tuple[str, int]


class AddressError(ValueError):
    """A shadow address (or list of them) that cannot be used."""


def parse_address(value: str) -> Address:
    """HOST:PORT, or [IPV6]:PORT."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise AddressError(f"{value!r} is not HOST:PORT")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressError(f"{value!r} is not HOST:PORT: the port must be a number, 1-65535")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise AddressError(f"{value!r} is not HOST:PORT: an IPv6 address goes in brackets, [::1]:50000")
        host = host[1:-1]
    elif ":" in host or "]" in host:
        raise AddressError(f"{value!r} is not HOST:PORT: an IPv6 address goes in brackets, [{host}]:{port}")
    if any(c.isspace() or c in ",/" for c in host):
        raise AddressError(f"{value!r} is not HOST:PORT: {host!r} is no host name")
    return host, int(port)


def parse_addresses(values: Iterable[str]) -> list[Address]:
    """Every address of `values`, each a comma-separated list of HOST:PORT
    (a repeated --shadow, or one list); the same address twice counts once."""
    out: list[Address] = []
    for value in values:
        items = value.split(",")
        if any(not item.strip() for item in items):
            raise AddressError(f"{value!r} holds an empty address: give HOST:PORT[,HOST:PORT...]")
        for item in items:
            address = parse_address(item)
            if address not in out:
                out.append(address)
    return out


def show(address: Address) -> str:
    """An address as a user writes it: host:port, [v6]:port."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def show_all(addresses: Iterable[Address]) -> str:
    """A list of addresses as --shadow takes it (and the spool records it)."""
    return ",".join(show(a) for a in addresses)


def env_addresses(hosts: str, port: str | None) -> list[Address]:
    """The seed's BYPASS_SHADOW_HOST (one host or a comma-separated list;
    an entry may carry its own :PORT, an IPv6 address goes in brackets to
    carry one) with BYPASS_SHADOW_PORT for the entries without a port."""
    if port is not None and (not port.isdigit() or not 0 < int(port) < 65536):
        raise AddressError(f"BYPASS_SHADOW_PORT={port!r} is not a port number (1-65535)")
    out: list[Address] = []
    for item in (i.strip() for i in hosts.split(",")):
        if not item:
            raise AddressError(f"BYPASS_SHADOW_HOST={hosts!r} holds an empty entry")
        own_port = "]:" in item if item.startswith("[") else item.count(":") == 1  # (a bare IPv6 host has none)
        if not own_port:
            if port is None:
                raise AddressError("set both BYPASS_SHADOW_HOST and BYPASS_SHADOW_PORT, or use --shadow HOST:PORT")
            host = item[1:-1] if item.startswith("[") and item.endswith("]") else item
            address = parse_address(show((host, int(port))))
        else:
            address = parse_address(item)
        if address not in out:
            out.append(address)
    return out


def recorded_addresses(text: str) -> list[Address]:
    """The shadows a spool records (as `show_all` wrote them; an older
    gcwrap wrote one IPv6 address without brackets)."""
    try:
        return parse_addresses([text])
    except AddressError:
        host, sep, port = text.rpartition(":")
        if "," in text or not sep or ":" not in host or host.startswith("["):
            raise
        return [parse_address(f"[{host}]:{port}")]
