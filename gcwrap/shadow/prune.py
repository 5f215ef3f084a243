"""`gcshadow prune`: forget the jobs that finished long enough ago (their
rows in the state: the job, its streams, the versions of its files, its
timeline), and with `files` remove their output files at home.

Which jobs: finished (their EXIT recorded) before the cutoff, and not seen
since they finished: a job whose agent came back (to send its EXIT again
after a lost DONE) has been seen since and is left alone. Never a
streaming or disconnected job.

Beside a running shadow: jobs go in batches of BATCH, each in a transaction
of its own that reads the jobs again and forgets them. With the root's own
SQLite state the transaction holds the database's write lock (the shadow's
claims and records wait for it, briefly: a batch is small); with
PostgreSQL it locks the jobs' rows, skipping any a claim holds (that job is
back). A job's attempts are remembered (one short row each): an agent of
a forgotten attempt that comes back is refused for good (STALE_ATTEMPT),
rather than welcomed as a new job whose files would start afresh over the
ones kept at home.

Files are removed in the batch's transaction, so no claim takes their
names meanwhile: a job's outputs (never its stdin) and the files it wrote
with their staging leftovers (`.NAME.gcwrap-F-V`), never through a link;
not a file another job's state names, one changed after the job ended, or
one a session holds locked (`files.lock_file`): someone writes it now.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..db import transaction
from ..wire.names import STATE_DIR, NameError_, split_name
from .files import Problem, StoreError, lock_file, open_dir
from .stateurl import check_state, is_shared, shown
from .timeline import POSTGRES, SQLITE, Dialect

BATCH = 100  # jobs forgotten in one transaction
CHANGED_SLACK = 2.0  # seconds: a file modified later than this after its job ended is someone else's now


@dataclass
class Pruned:
    """A job forgotten (or that would be), and what became of its files."""

    job_id: str
    ended: float
    removed: list[str] = field(default_factory=list)  # files removed under the root (or that would be)
    kept: list[str] = field(default_factory=list)  # its files left: another job's now, or written since

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def prune(state: str, root: Path, before: float, *, files: bool = False, dry_run: bool = False) -> list[Pruned]:
    """Forget the jobs that finished before `before` (a Unix time); with
    `files`, remove their files; with `dry_run`, change nothing and say what
    would go. StoreError if the state or the root cannot be used."""
    try:
        return _prune(state, root, before, files, dry_run)
    except sqlite3.Error as e:
        raise StoreError(Problem.STATE, f"cannot prune the state under {root}: {e}") from None
    except OSError as e:
        raise StoreError(Problem.ROOT, f"cannot use the root {root}: {e.strerror or e}") from None


def _prune(state: str, root: Path, before: float, files: bool, dry_run: bool) -> list[Pruned]:
    with _state(state, root) as (txn, d):
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if files else -1
        try:
            with txn() as conn:
                ids = [str(j) for (j,) in conn.execute(d.sql(
                    "SELECT job_id FROM {s}jobs WHERE state = 'finished' AND ended < ? ORDER BY ended, job_id"),
                    [before]).fetchall()]
                tables = {t for t in ("file_versions", "events") if _has(conn, d, t)}
            found: list[Pruned] = []
            for i in range(0, len(ids), BATCH):
                with txn() as conn:
                    found += _batch(conn, d, tables, ids[i:i + BATCH], before, root_fd, dry_run)
            return found
        finally:
            if root_fd >= 0:
                os.close(root_fd)


Transaction = Any  # a callable giving a context manager of a connection in a transaction


@contextlib.contextmanager
def _state(state: str, root: Path) -> Iterator[tuple[Transaction, Dialect]]:
    """How to open a transaction on the state of `root`, and its dialect."""
    if is_shared(state):
        from .pgconn import Health, PgConnection

        pg = PgConnection(check_state(state), Health(shown(state)))
        pg.health.failed = lambda why: None  # type: ignore[method-assign]  # (said once, by the command)
        try:
            yield pg.transaction, POSTGRES
        finally:
            pg.close()
        return
    path = root / STATE_DIR / "state.db"
    if not path.is_file():
        raise StoreError(Problem.ROOT, f"no shadow state under {root} ({path} does not exist)")
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA busy_timeout = 10000")
        conn.execute("PRAGMA synchronous = FULL")

        @contextlib.contextmanager
        def txn() -> Iterator[sqlite3.Connection]:
            with transaction(conn):
                yield conn

        yield txn, SQLITE
    finally:
        conn.close()


def _has(conn: Any, d: Dialect, table: str) -> bool:
    """Whether the state has `table` (a shadow of an older version made it)."""
    sql = (f"SELECT to_regclass('gcshadow.{table}') IS NOT NULL" if d is POSTGRES
           else f"SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = '{table}'")
    row = conn.execute(sql).fetchone()
    return bool(row and row[0])


def _batch(conn: Any, d: Dialect, tables: set[str], ids: list[str], before: float, root_fd: int,
           dry_run: bool) -> list[Pruned]:
    """Forget the jobs of `ids` that still may be, in the caller's transaction."""
    lock = " FOR UPDATE SKIP LOCKED" if d is POSTGRES else ""
    rows = conn.execute(d.sql(
        f"SELECT job_id, ended, last_seen, heard FROM {{s}}jobs WHERE job_id IN ({_marks(ids)}) "
        f"AND state = 'finished' AND ended < ?{lock}"), [*ids, before]).fetchall()
    # (Seen since it finished: its agent came back, and may be streaming now.)
    gone = [Pruned(str(j), float(ended)) for j, ended, seen, heard in rows if max(seen or 0, heard or 0) <= ended]
    if not gone:
        return []
    ids = [p.job_id for p in gone]
    if root_fd >= 0:
        _files(conn, d, tables, gone, root_fd, dry_run)
    if not dry_run:
        for table in ("streams", *sorted(tables), "jobs"):
            conn.execute(d.sql(f"DELETE FROM {{s}}{table} WHERE job_id IN ({_marks(ids)})"), ids)
    return gone


def _marks(values: list[Any]) -> str:
    return ", ".join("?" * len(values))


def _files(conn: Any, d: Dialect, tables: set[str], gone: list[Pruned], root_fd: int, dry_run: bool) -> None:
    """Remove the files of the jobs `gone` (see the module's docstring)."""
    ids = [p.job_id for p in gone]
    marks = _marks(ids)
    sql = f"SELECT job_id, name, -1 FROM {{s}}streams WHERE job_id IN ({marks}) AND kind != 'stdin'"
    if "file_versions" in tables:
        sql += f" UNION SELECT job_id, name, file FROM {{s}}file_versions WHERE job_id IN ({marks})"
    named: dict[str, dict[str, set[int]]] = {}  # job -> NAME -> its file numbers (staging files' names)
    for job_id, name, file in conn.execute(d.sql(sql), ids * (1 + ("file_versions" in tables))).fetchall():
        named.setdefault(str(job_id), {}).setdefault(str(name), set()).add(int(file))
    names = sorted({n for by_name in named.values() for n in by_name})
    if not names:
        return
    sql = (f"SELECT name FROM {{s}}streams WHERE name IN ({_marks(names)}) AND job_id NOT IN ({marks})")
    args = [*names, *ids]
    if "file_versions" in tables:
        sql += f" UNION SELECT name FROM {{s}}file_versions WHERE name IN ({_marks(names)}) AND job_id NOT IN ({marks})"
        args *= 2
    others = {str(n) for (n,) in conn.execute(d.sql(sql), args).fetchall()}
    for p in gone:
        for name, numbers in sorted(named.get(p.job_id, {}).items()):
            if name in others:
                p.kept.append(name)
                continue
            _remove(root_fd, name, numbers, p, dry_run)


def _remove(root_fd: int, name: str, numbers: set[int], p: Pruned, dry_run: bool) -> None:
    """Remove NAME and the staging files of its versions, unless changed
    since the job ended or locked by a session; say which went in `p`."""
    try:
        parts = split_name(name)
        dfd = open_dir(root_fd, parts[:-1], create=False)
    except (NameError_, OSError):
        return  # (its directory is gone, or is a link: nothing of it to remove)
    try:
        head = "/".join(parts[:-1]) + "/" * (len(parts) > 1)
        staged = re.compile(rf"\.{re.escape(parts[-1])}\.gcwrap-(\d+)-\d+")
        leftovers = sorted(e for e in os.listdir(dfd) if (m := staged.fullmatch(e)) and int(m[1]) in numbers)
        entries = [parts[-1], *leftovers]
        for entry in entries:
            try:
                fd = os.open(entry, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                continue
            except OSError:  # a link, or not ours to write: left
                p.kept.append(head + entry)
                continue
            try:
                st = os.fstat(fd)
                mine = stat.S_ISREG(st.st_mode) and st.st_mtime <= p.ended + CHANGED_SLACK
                if not mine or not (dry_run or lock_file(fd)):
                    p.kept.append(head + entry)
                    continue
                if not dry_run:
                    os.unlink(entry, dir_fd=dfd)  # (while locked: no session of another shadow writes it)
                p.removed.append(head + entry)
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
