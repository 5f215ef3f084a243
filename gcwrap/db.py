"""The one SQLite module: connections, pragmas, transactions, numbered
migrations and the database's files, for the spool and the shadow's state.

Plain sqlite3 underneath. The job's spool stays on it (and on the small
`Database` below): `import sqlite_utils` costs 37-47 ms of import time on
top of trio (measured with -X importtime on the 2-core machine of
benchmarks/startup.py, where `gcwrap -- true` takes about 240 ms and a bare
`import trio` 150-200 ms), which every job would pay at start-up against a
target of 1.3x `import trio`. The shadow's state and the read-only views
may hand the same connection to `sqlite_utils.Database`; migrations take
either.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import sqlite_utils

WAL_FILES = ("", "-wal", "-shm")  # a WAL database is these files side by side
BUSY_TIMEOUT_MS = 10000


class Database:
    """What the storage code needs of a database: `execute`, `conn` and
    `db[table].rows_where(...)`, the subset of `sqlite_utils.Database` it
    uses, with the same names and meaning: code written against it runs on
    either (the job on this one, the read-only views on sqlite-utils)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def execute(self, sql: str, parameters: Any = None) -> sqlite3.Cursor:
        return self.conn.execute(sql, parameters) if parameters is not None else self.conn.execute(sql)

    def __getitem__(self, table: str) -> Table:
        return Table(self, table)


class Table:
    """`sqlite_utils.db.Table.rows_where`, and nothing else of it."""

    def __init__(self, db: Database, name: str) -> None:
        self.db = db
        self.name = name

    def rows_where(self, where: str | None = None, where_args: Sequence[Any] | None = None, *,
                   order_by: str | None = None) -> Iterator[dict[str, Any]]:
        """The rows (as dicts of the columns the table has) matching `where`."""
        sql = f"SELECT * FROM [{self.name}]" + (f" WHERE {where}" if where else "")
        cur = self.db.execute(sql + (f" ORDER BY {order_by}" if order_by else ""), list(where_args or []))
        columns = [d[0] for d in cur.description]
        for row in cur:
            yield dict(zip(columns, row))


def reader(conn: sqlite3.Connection) -> sqlite_utils.Database:
    """A read-only view's database: sqlite-utils over the connection (its
    import cost is paid by `gcwrap status`, never by a job's start)."""
    import sqlite_utils

    return sqlite_utils.Database(conn)


AnyDatabase = Union[Database, "sqlite_utils.Database"]
Migration = tuple[int, str, Callable[[Any], None]]  # (number, name, fn(db))


def uri(path: Path | str, **params: str) -> str:
    """A `file:` URI that SQLite reads back as exactly `path`.

    In a URI "?" starts the query, "#" the fragment and "%" an escape, so an
    unquoted /srv/C#1/state.db names /srv/C (which SQLite then creates). Every
    byte but "/" and the unreserved ones is percent-encoded; the path is made
    absolute, so that a leading "//" cannot be read as an authority."""
    quoted = urllib.parse.quote(os.fsencode(os.path.abspath(path)), safe="/")
    query = urllib.parse.urlencode(params)
    return f"file://{quoted}" + (f"?{query}" if query else "")


def connect(path: Path | str, *, readonly: bool = False) -> sqlite3.Connection:
    """An autocommit connection (transactions are explicit: `transaction`),
    usable from worker threads; read-only connections wait for writers."""
    conn = sqlite3.connect(uri(path, **({"mode": "ro"} if readonly else {})), uri=True, isolation_level=None,
                           check_same_thread=False)
    if readonly:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return conn


def configure(conn: sqlite3.Connection, *, synchronous: str = "NORMAL", journal_size_limit: int | None = None,
              page_size: int | None = None) -> None:
    """The pragmas of a writer: WAL, the given durability, a busy timeout;
    `page_size` only takes effect on a database with no table yet, and
    `journal_size_limit` truncates what a checkpoint leaves of the WAL."""
    if page_size is not None:
        conn.execute(f"PRAGMA page_size = {int(page_size)}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {synchronous}")
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    if journal_size_limit is not None:
        conn.execute(f"PRAGMA journal_size_limit = {int(journal_size_limit)}")


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


# -- migrations ---------------------------------------------------------------
#
# Kept here, not taken from sqlite-utils' ecosystem (sqlite-migrate 0.1b0, the
# one library for it), because it would replace these ten lines and no more:
# - the same numbered migrations run on PostgreSQL too (shadow/pgstate.migrate:
#   psycopg, an advisory lock so shadows starting together migrate in turn),
#   which sqlite-migrate does not touch: two runners would remain either way;
# - it needs a `sqlite_utils.Database` (insert, exists, transform), and the
#   job's spool migrates on the small `Database` above so that no job pays
#   sqlite-utils' import at start-up (the module docstring);
# - it records a migration after it ran, outside any transaction: a crash in
#   between leaves it done but unrecorded, run again at the next start. Here a
#   migration and its record commit together or not at all;
# - every spool and state made so far records numbers in `_migrations`; it keys
#   `_sqlite_migrations` by name, so adopting it would itself need a migration.
# A dependency in beta for none of that is no gain; reconsider if it grows a
# transaction per migration and a runner for other databases.


def migrate(db: AnyDatabase, migrations: list[Migration]) -> None:
    """Apply every migration not yet recorded in `_migrations`, in order,
    each in its own transaction with its record."""
    db.execute("CREATE TABLE IF NOT EXISTS _migrations (id INTEGER PRIMARY KEY, name TEXT, applied REAL)")
    done = {row[0] for row in db.execute("SELECT id FROM _migrations").fetchall()}
    for number, name, fn in migrations:
        if number in done:
            continue
        with transaction(db.conn):
            fn(db)
            db.execute("INSERT INTO _migrations VALUES (?, ?, ?)", [number, name, time.time()])


def files(path: Path | str) -> list[Path]:
    """The database's files: itself, its WAL and its shared-memory index."""
    return [Path(f"{path}{suffix}") for suffix in WAL_FILES]


def remove(path: Path | str) -> None:
    """Delete a database with its WAL files (those missing are no error)."""
    for p in files(path):
        p.unlink(missing_ok=True)


def size(path: Path | str) -> int:
    """Bytes the database and its WAL files take."""
    total = 0
    for p in files(path):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total
