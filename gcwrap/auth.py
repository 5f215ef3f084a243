"""Authentication: a shared token proven by challenge-response, TLS contexts,
and host allow-lists. No I/O here but reading files and name lookups.

Token handshake (the token never crosses the wire; a captured exchange is
useless because both sides bring a fresh nonce to every connection):

    agent  -> HELLO(nonce_a, job, instance)
    shadow -> CHALLENGE(nonce_s)
    agent  -> AUTH(HMAC(token, "gcwrap agent v1" | nonce_a | nonce_s | job | instance))
    shadow -> WELCOME(proof = HMAC(token, "gcwrap shadow v1" | nonce_a | nonce_s))

The shadow's proof lets the agent refuse an impostor before it sends a byte
of output. The MACs are bound to the job and attempt, and both nonces.

Identities: a shadow may hold one token per identity (`load_token_dir`: a
directory of files, each named after the identity whose token it holds).
The agent does not say who it is (the wire format is unchanged): the shadow
finds the one token whose MAC matches (`match_token`). A client
certificate's identity is its subject CN. An identity names a directory
under the shadow's root, so it must be a safe one (`identity_problem`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import socket
import ssl
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

MIN_TOKEN = 16  # bytes: shorter secrets are too easy to guess
_AGENT = b"gcwrap agent v1"
_SHADOW = b"gcwrap shadow v1"


class AuthError(Exception):
    """A configuration or authentication failure, in plain words."""


def load_token(path: Path, *, private: bool) -> bytes:
    """The token in `path` (surrounding whitespace removed). With `private`,
    refuse a file that others can read: the shadow's secret must be its own."""
    try:
        st = os.stat(path)
        data = path.read_bytes().strip()
    except OSError as e:
        raise AuthError(f"cannot read token file {path}: {e.strerror}") from None
    if private and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthError(
            f"token file {path} is readable by others (mode {stat.S_IMODE(st.st_mode):04o}): run chmod 600 {path}"
        )
    if len(data) < MIN_TOKEN:
        raise AuthError(f"token in {path} is too short: use at least {MIN_TOKEN} bytes (e.g. openssl rand -hex 32)")
    return data


# An identity is a directory name under the root: one path component, no
# leading dot (no hidden or state directory, no "." or ".."), no controls.
_IDENTITY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}\Z")


def identity_problem(identity: str) -> str:
    """Why `identity` cannot name a part of the root ("" if it can)."""
    if not _IDENTITY_RE.match(identity):
        return (f"{identity!r} is not usable as an identity: 1-64 characters of A-Z a-z 0-9 . _ @ + -, "
                "starting with a letter or digit")
    return ""


def load_token_dir(path: Path) -> dict[str, bytes]:
    """identity -> token, from a directory holding one private token file per
    identity, named after it (hidden files are ignored). The directory must
    not be writable by others (whoever adds a file adds an identity), and no
    two identities may share a token (it would not say who is who)."""
    try:
        st = os.stat(path)
        entries = sorted(os.listdir(path))
    except OSError as e:
        raise AuthError(f"cannot read token directory {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise AuthError(f"token directory {path} is writable by others "
                        f"(mode {stat.S_IMODE(st.st_mode):04o}): run chmod go-w {path}")
    tokens: dict[str, bytes] = {}
    owners: dict[bytes, str] = {}
    for name in entries:
        if name.startswith("."):
            continue
        why = identity_problem(name)
        if why:
            raise AuthError(f"token file {path / name}: {why}")
        if not (path / name).is_file():
            raise AuthError(f"{path / name} is not a token file (every entry of {path} names an identity)")
        token = load_token(path / name, private=True)
        if token in owners:
            raise AuthError(f"token files {owners[token]} and {name} in {path} hold the same token: "
                            "each identity needs a token of its own")
        owners[token] = name
        tokens[name] = token
    if not tokens:
        raise AuthError(f"token directory {path} holds no token files (one per identity, named after it)")
    return tokens


def match_token(tokens: dict[str, bytes], mac: str, nonce_a: str, nonce_s: str, job_id: str,
                instance: str) -> tuple[str, bytes] | None:
    """The identity and token whose MAC the agent sent, or None. Every token
    is tried (no early exit): how long this takes says nothing of who matched."""
    found = None
    for identity, token in tokens.items():
        if same(mac, agent_mac(token, nonce_a, nonce_s, job_id, instance)) and found is None:
            found = identity, token
    return found


def new_nonce() -> str:
    return secrets.token_hex(32)


def _mac(token: bytes, *parts: bytes) -> str:
    return hmac.new(token, b"\0".join(parts), hashlib.sha256).hexdigest()


def agent_mac(token: bytes, nonce_a: str, nonce_s: str, job_id: str, instance: str) -> str:
    return _mac(token, _AGENT, nonce_a.encode(), nonce_s.encode(), job_id.encode(), instance.encode())


def shadow_proof(token: bytes, nonce_a: str, nonce_s: str) -> str:
    return _mac(token, _SHADOW, nonce_a.encode(), nonce_s.encode())


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


# -- TLS ------------------------------------------------------------------------


def client_context(ca: Path | None, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    """The agent's TLS: verify the shadow (against `ca`, or the system's CAs),
    and present a client certificate when given one."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca) if ca else None)
        if cert:
            ctx.load_cert_chain(str(cert), str(key) if key else None)
    except (OSError, ssl.SSLError) as e:
        raise AuthError(f"cannot set up TLS: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def server_context(cert: Path, key: Path | None, client_ca: Path | None) -> ssl.SSLContext:
    """The shadow's TLS; with `client_ca`, clients must present a certificate
    signed by it (mutual TLS)."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(str(cert), str(key) if key else None)
        if client_ca:
            ctx.load_verify_locations(cafile=str(client_ca))
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise AuthError(f"cannot set up TLS: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def subject_cn(peercert: dict[str, object] | None) -> str:
    """The common name of a verified peer certificate ("" if none)."""
    if not peercert:
        return ""
    subject = cast("tuple[tuple[tuple[str, str], ...], ...]", peercert.get("subject", ()))
    for rdn in subject:
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


@dataclass
class SubjectMap:
    """Which certificate subjects (CN) may write which job ids (globs)."""

    rules: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def parse(cls, entries: list[str]) -> SubjectMap:
        rules = []
        for entry in entries:
            cn, sep, pattern = entry.partition(":")
            if not sep or not cn or not pattern:
                raise AuthError(f"--allow-subject {entry!r}: expected CN:JOB-GLOB, e.g. alice:alice-*")
            rules.append((cn, pattern))
        return cls(rules)

    def allows(self, cn: str, job_id: str) -> bool:
        if not self.rules:
            return True
        return any(cn == rule_cn and fnmatch.fnmatchcase(job_id, pattern) for rule_cn, pattern in self.rules)


# -- allow-lists --------------------------------------------------------------------


@dataclass
class AllowList:
    """Hosts, domain suffixes (".example.org") and CIDR ranges allowed to connect.
    Names are checked by reverse-then-forward lookup, so a forged PTR record
    alone does not get anyone in. Empty: everyone may connect."""

    networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    suffixes: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, entries: list[str]) -> AllowList:
        out = cls()
        for raw in entries:
            for entry in filter(None, (e.strip() for e in raw.split(","))):
                try:
                    out.networks.append(ipaddress.ip_network(entry, strict=False))
                    continue
                except ValueError:
                    pass
                if entry.startswith("."):
                    out.suffixes.append(entry.lower())
                elif all(c.isalnum() or c in "-._" for c in entry):
                    out.hosts.append(entry.lower().rstrip("."))
                else:
                    raise AuthError(f"--allow {entry!r} is neither a host, a .domain suffix nor a CIDR range")
        return out

    def __bool__(self) -> bool:
        return bool(self.networks or self.hosts or self.suffixes)

    def check(self, address: str) -> str:
        """"" if `address` may connect, else why not. Blocking (DNS): run in a thread."""
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return f"{address} is not an IP address"
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            ip = ip.ipv4_mapped
        if any(ip in net for net in self.networks):
            return ""
        for host in self.hosts:
            if str(ip) in _forward(host):
                return ""
        if self.suffixes:
            name = _reverse(str(ip))
            if name and any(name.endswith(s) or "." + name == s for s in self.suffixes):
                if str(ip) in _forward(name):
                    return ""
                return f"{ip} claims the name {name}, which does not resolve back to it"
        return f"{ip} is not in the allow-list"


def _forward(name: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except OSError:
        return set()


def _reverse(ip: str) -> str:
    try:
        return socket.gethostbyaddr(ip)[0].lower().rstrip(".")
    except OSError:
        return ""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in ("localhost", "localhost.localdomain")
