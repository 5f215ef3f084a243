"""What a stream NAME may be: a relative path that stays inside the shadow's root.

The agent checks NAMEs before it starts the job (a clear usage error); the
shadow checks them again, since it trusts no agent, and then opens them one
directory at a time with O_NOFOLLOW so a symlink cannot lead out.
"""

from __future__ import annotations

import re

STATE_DIR = ".gcshadow"  # the shadow's own files under its root
_STAGED = re.compile(r"\..*\.gcwrap-[0-9]+-[0-9]+")  # `.BASENAME.gcwrap-F-V`: a file's version staged at home


class NameError_(ValueError):
    """A NAME the shadow will not accept, with the reason in plain words."""


def split_name(name: str) -> tuple[str, ...]:
    """The path components of NAME, or NameError_ saying why it is refused."""
    if not name:
        raise NameError_("the name is empty")
    if "\x00" in name:
        raise NameError_("the name contains a NUL byte")
    bad = next((c for c in name if c < " " or c == "\x7f"), None)
    if bad is not None:
        # A newline or escape in a file name breaks every listing, log line
        # and shell loop that shows it: refused, as NUL is.
        raise NameError_(f"{name!r} contains a control character (U+{ord(bad):04X})")
    if name.startswith("/"):
        raise NameError_(f"{name!r} is an absolute path; names are relative to the shadow's root")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if not parts:
        raise NameError_(f"{name!r} names the root itself, not a file")
    if ".." in parts:
        raise NameError_(f"{name!r} contains '..'; names must stay inside the shadow's root")
    if parts[0] == STATE_DIR:
        raise NameError_(f"{name!r} is inside the shadow's own state directory")
    try:
        encoded = [p.encode() for p in parts]
    except UnicodeEncodeError:
        raise NameError_(f"{name!r} is not valid UTF-8") from None
    if any(len(p) > 255 for p in encoded):
        raise NameError_(f"{name!r} has a path component longer than 255 bytes")
    return parts


def staged_like(name: str) -> bool:
    """NAME's last component is named as the shadow names a version of a
    job's file it stages beside it (`.BASENAME.gcwrap-F-V`): refused as an
    output's NAME, since it could be taken for one and removed."""
    return _STAGED.fullmatch(name.rpartition("/")[2]) is not None


def normalize(name: str) -> str:
    """NAME as the shadow will take it (the agent's check), or NameError_."""
    norm = "/".join(split_name(name))
    if staged_like(norm):
        raise NameError_(f"{name!r} is named as home names a version of a file it stages")
    return norm
