"""SQLite helpers shared by the spool and the shadow's state."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import urllib.parse
from collections.abc import Iterator
from pathlib import Path


def uri(path: Path | str, **params: str) -> str:
    """A `file:` URI that SQLite reads back as exactly `path`.

    In a URI "?" starts the query, "#" the fragment and "%" an escape, so an
    unquoted /srv/C#1/state.db names /srv/C (which SQLite then creates). Every
    byte but "/" and the unreserved ones is percent-encoded; the path is made
    absolute, so that a leading "//" cannot be read as an authority."""
    quoted = urllib.parse.quote(os.fsencode(os.path.abspath(path)), safe="/")
    query = urllib.parse.urlencode(params)
    return f"file://{quoted}" + (f"?{query}" if query else "")


@contextlib.contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN ... COMMIT, or ROLLBACK on any error (autocommit connections)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
