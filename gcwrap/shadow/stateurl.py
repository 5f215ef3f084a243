"""The `--state` option (environment GCSHADOW_STATE): which state a shadow
keeps, named by a URL. A URL's password is never shown: `shown()` is what
logs, errors and listings print (the docs advise PGPASSFILE or PGPASSWORD).
"""

from __future__ import annotations

import urllib.parse

from .files import Problem, StoreError

SCHEMES = ("postgresql", "postgres")
EMBEDDED = ("", "sqlite")  # --state values that mean the root's own SQLite database


def is_shared(state: str) -> bool:
    """Whether `state` names a shared database (not the root's own)."""
    return urllib.parse.urlsplit(state).scheme in SCHEMES


def check_state(state: str) -> str:
    """`state` if it names a state this shadow can use; StoreError saying why not."""
    if state in EMBEDDED:
        return ""
    scheme = urllib.parse.urlsplit(state).scheme
    if scheme not in SCHEMES:
        raise StoreError(Problem.STATE, f"--state {shown(state)}: not a state this shadow knows "
                                        "(postgresql://HOST/DATABASE, or sqlite for the root's own)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        raise StoreError(Problem.STATE, "--state postgresql:// needs psycopg: pip install 'gcwrap[postgresql]'") \
            from None
    return state


def shown(state: str) -> str:
    """The state's name as it may be printed: a URL without its password."""
    if not state or state in EMBEDDED:
        return "the embedded state"
    parts = urllib.parse.urlsplit(state)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}@{host}" if user else host
    query = "&".join(p for p in parts.query.split("&") if p and not p.lower().startswith("password="))
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))
