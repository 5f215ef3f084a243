"""The shadow's storage: its state database and the job output files.

Synchronous code, called from the shadow's worker thread (state) or inline
(small pwrite/pread calls on files already open). The state lives in
`ROOT/.gcshadow/state.db` (SQLite WAL, synchronous=FULL: a durable offset
recorded there is acknowledged to the agent, so it must survive power loss).

Every output file has a `durable` length in the state database: what was
fsynced and acknowledged. On reopening, a file longer than that holds a torn
or unacknowledged tail (the shadow died between write and sync): it is cut
back to `durable` and the agent sends those bytes again. A file shorter than
`durable` lost acknowledged bytes behind the shadow's back, which is refused.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .events import StreamSpec

if TYPE_CHECKING:
    import sqlite_utils
from .names import STATE_DIR, NameError_, split_name
from .spool import _database, transaction
from .spool import migrate as spool_migrate


class StoreError(Exception):
    """A refusal or failure, with the protocol error code to send."""

    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code = code


def _m001_initial(db: sqlite_utils.Database) -> None:
    db.execute(
        """CREATE TABLE jobs (
            job_id TEXT PRIMARY KEY, instance TEXT NOT NULL, host TEXT, user TEXT,
            command TEXT, peer TEXT, state TEXT NOT NULL, session INTEGER NOT NULL DEFAULT 0,
            first_seen REAL, last_seen REAL, ended REAL,
            exit_code INTEGER, exit_signal INTEGER, reason TEXT, summary TEXT)"""
    )
    db.execute(
        """CREATE TABLE streams (
            job_id TEXT NOT NULL, stream INTEGER NOT NULL, kind TEXT NOT NULL,
            name TEXT NOT NULL, durable INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (job_id, stream))"""
    )
    db.execute("CREATE INDEX streams_name ON streams (name)")
    db.execute(
        """CREATE TABLE instances (
            job_id TEXT NOT NULL, instance TEXT NOT NULL, seen REAL,
            PRIMARY KEY (job_id, instance))"""
    )


MIGRATIONS: list[tuple[int, str, Callable[[sqlite_utils.Database], None]]] = [
    (1, "initial", _m001_initial),
]


def migrate(db: sqlite_utils.Database) -> None:
    spool_migrate(db, MIGRATIONS)


def open_state(root: Path, *, readonly: bool = False) -> sqlite_utils.Database:
    path = root / STATE_DIR / "state.db"
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 10000")
        return _database(conn)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA busy_timeout = 10000")
    db = _database(conn)
    migrate(db)
    return db


def lock_root(root: Path) -> int:
    """One shadow per root: an exclusive flock held for the shadow's life."""
    path = root / STATE_DIR / "lock"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreError(None, f"another gcshadow is already serving {root}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


# -- confined file access -------------------------------------------------------


def _open_dir(root_fd: int, parts: tuple[str, ...], create: bool) -> int:
    fd = os.dup(root_fd)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except OSError:
        os.close(fd)
        raise
    return fd


def open_confined(root_fd: int, name: str, *, write: bool) -> int:
    """Open NAME under the root without following any symlink; only regular
    files. Raises NameError_ for a refused name, OSError for I/O failures."""
    parts = split_name(name)
    try:
        dfd = _open_dir(root_fd, parts[:-1], create=write)
    except (NotADirectoryError, FileNotFoundError) as e:
        if write or isinstance(e, NotADirectoryError):
            raise NameError_(f"{name!r}: a parent is not a directory") from None
        raise
    except OSError as e:
        if e.errno in (40,):  # ELOOP: a symlink in the path
            raise NameError_(f"{name!r}: the path goes through a symlink") from None
        raise
    try:
        flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        flags |= (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        try:
            fd = os.open(parts[-1], flags, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno == 40:
                raise NameError_(f"{name!r} is a symlink") from None
            if e.errno == 6:  # ENXIO: a FIFO with no reader
                raise NameError_(f"{name!r} is not a regular file") from None
            if e.errno == 21:  # EISDIR
                raise NameError_(f"{name!r} is a directory") from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NameError_(f"{name!r} is not a regular file")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


@dataclass
class StreamFile:
    """One open output file of a job."""

    job_id: str
    stream: int
    name: str
    fd: int
    written: int  # bytes in the file (the end of the last write)
    durable: int  # bytes fsynced and recorded: safe to acknowledge


@dataclass
class JobFiles:
    job_id: str
    instance: str
    session: int
    outputs: dict[int, StreamFile] = field(default_factory=dict)
    stdin_fd: int | None = None
    stdin_stream: int | None = None

    def close(self) -> None:
        for sf in self.outputs.values():
            os.close(sf.fd)
        self.outputs.clear()
        if self.stdin_fd is not None:
            os.close(self.stdin_fd)
            self.stdin_fd = None


class Store:
    """The shadow's state and files. One instance per root, one owner thread."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.lock_fd = lock_root(root)
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.db = open_state(root)

    def close(self) -> None:
        self.db.conn.close()
        os.close(self.root_fd)
        os.close(self.lock_fd)

    # -- jobs -----------------------------------------------------------

    def open_job(
        self,
        *,
        job_id: str,
        instance: str,
        streams: Iterable[StreamSpec],
        host: str,
        user: str,
        command: list[str],
        peer: str,
        codes: Any,
    ) -> JobFiles:
        """Claim or resume a job's files. A new instance (attempt) of a job
        starts its files afresh; a known one resumes at the durable lengths."""
        streams = list(streams)
        db = self.db
        now = time.time()
        row = db.execute("SELECT instance, session, state FROM jobs WHERE job_id = ?", [job_id]).fetchone()
        seen = db.execute(
            "SELECT 1 FROM instances WHERE job_id = ? AND instance = ?", [job_id, instance]
        ).fetchone()
        fresh = row is None or row[0] != instance
        if fresh and seen:
            raise StoreError(codes.STALE_ATTEMPT, f"job {job_id}: a newer attempt has replaced attempt {instance}")
        if not fresh and row[2] == "finished":
            pass  # resending EXIT after a lost DONE: welcome it, the lengths will match
        names: dict[str, int] = {}
        for spec in streams:
            try:
                norm = "/".join(split_name(spec.name))
            except NameError_ as e:
                raise StoreError(codes.PATH_FORBIDDEN, str(e)) from None
            if spec.kind != "stdin":
                if norm in names:
                    raise StoreError(codes.PATH_FORBIDDEN, f"two streams of the job name {norm!r}")
                names[norm] = spec.id
                owner = db.execute(
                    """SELECT s.job_id FROM streams s JOIN jobs j USING (job_id)
                       WHERE s.name = ? AND s.kind != 'stdin' AND s.job_id != ? AND j.state != 'finished'""",
                    [norm, job_id],
                ).fetchone()
                if owner:
                    raise StoreError(codes.PATH_OWNED, f"{norm!r} belongs to job {owner[0]}, which is still active")
        files = JobFiles(job_id, instance, session=(row[1] if row else 0) + 1)
        try:
            with transaction(db.conn):
                if fresh:
                    db.execute("DELETE FROM streams WHERE job_id = ?", [job_id])
                    db.execute(
                        """INSERT OR REPLACE INTO jobs (job_id, instance, host, user, command, peer, state,
                           session, first_seen, last_seen) VALUES (?, ?, ?, ?, ?, ?, 'streaming', ?, ?, ?)""",
                        [job_id, instance, host, user, json.dumps(command), peer, files.session, now, now],
                    )
                    db.execute("INSERT OR IGNORE INTO instances VALUES (?, ?, ?)", [job_id, instance, now])
                else:
                    db.execute(
                        "UPDATE jobs SET session = ?, peer = ?, last_seen = ?, state = CASE state WHEN 'finished' "
                        "THEN 'finished' ELSE 'streaming' END WHERE job_id = ?",
                        [files.session, peer, now, job_id],
                    )
                for spec in streams:
                    norm = "/".join(split_name(spec.name))
                    self._open_stream(files, spec, norm, fresh, codes)
        except BaseException:
            files.close()
            raise
        return files

    def _open_stream(self, files: JobFiles, spec: StreamSpec, norm: str, fresh: bool, codes: Any) -> None:
        db = self.db
        try:
            fd = open_confined(self.root_fd, norm, write=spec.kind != "stdin")
        except NameError_ as e:
            raise StoreError(codes.PATH_FORBIDDEN, str(e)) from None
        except FileNotFoundError:
            raise StoreError(codes.NOT_FOUND, f"stdin file {norm!r} does not exist at the shadow") from None
        except OSError as e:
            raise StoreError(codes.IO_ERROR, f"cannot open {norm!r}: {e.strerror}") from None
        if spec.kind == "stdin":
            files.stdin_fd, files.stdin_stream = fd, spec.id
            db.execute(
                "INSERT OR REPLACE INTO streams (job_id, stream, kind, name, durable) VALUES (?, ?, ?, ?, 0)",
                [files.job_id, spec.id, spec.kind, norm],
            )
            return
        try:
            if fresh:
                os.ftruncate(fd, 0)
                os.fsync(fd)
                durable = 0
                db.execute(
                    "INSERT INTO streams (job_id, stream, kind, name, durable) VALUES (?, ?, ?, ?, 0)",
                    [files.job_id, spec.id, spec.kind, norm],
                )
            else:
                row = db.execute(
                    "SELECT durable, name FROM streams WHERE job_id = ? AND stream = ?", [files.job_id, spec.id]
                ).fetchone()
                if row is None or row[1] != norm:
                    raise StoreError(codes.UNEXPECTED, f"job {files.job_id} resumed with different streams")
                durable = row[0]
                size = os.fstat(fd).st_size
                if size < durable:
                    raise StoreError(
                        codes.LENGTH_MISMATCH,
                        f"{norm!r} holds {size} bytes but {durable} were acknowledged: "
                        "it was truncated or replaced at home",
                    )
                if size > durable:
                    os.ftruncate(fd, durable)  # a torn or unacknowledged tail: it will be resent
        except BaseException:
            os.close(fd)
            raise
        files.outputs[spec.id] = StreamFile(files.job_id, spec.id, norm, fd, durable, durable)

    def record_durable(self, lengths: Iterable[tuple[str, int, int]]) -> None:
        with transaction(self.db.conn):
            self.db.conn.executemany(
                "UPDATE streams SET durable = max(durable, ?) WHERE job_id = ? AND stream = ?",
                [(n, j, s) for j, s, n in lengths],
            )

    def record_state(self, job_id: str, **fields: Any) -> None:
        if "summary" in fields:
            fields["summary"] = json.dumps(fields["summary"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        with transaction(self.db.conn):
            self.db.execute(f"UPDATE jobs SET {sets} WHERE job_id = ?", [*fields.values(), job_id])

    def mark_disconnected(self) -> None:
        """At start-up: no job is connected to a shadow that just started."""
        with transaction(self.db.conn):
            self.db.execute("UPDATE jobs SET state = 'disconnected' WHERE state = 'streaming'")


def sync_files(files: list[tuple[StreamFile, int]]) -> list[tuple[StreamFile, int, OSError | None]]:
    """fdatasync each file; returns (file, length, error) for each."""
    out = []
    for sf, length in files:
        try:
            os.fdatasync(sf.fd)
            out.append((sf, length, None))
        except OSError as e:
            out.append((sf, length, e))
    return out


def list_jobs(root: Path) -> list[dict[str, Any]]:
    """Every job the shadow at `root` knows, with its streams (for `gcshadow jobs`)."""
    db = open_state(root, readonly=True)
    try:
        jobs = [dict(zip([d[0] for d in cur.description], r)) for cur in [db.execute("SELECT * FROM jobs ORDER BY first_seen")] for r in cur.fetchall()]
        for job in jobs:
            job["streams"] = [
                {"stream": s, "kind": k, "name": n, "durable": d}
                for s, k, n, d in db.execute(
                    "SELECT stream, kind, name, durable FROM streams WHERE job_id = ? ORDER BY stream", [job["job_id"]]
                ).fetchall()
            ]
            job["command"] = json.loads(job["command"] or "[]")
            job["summary"] = json.loads(job["summary"] or "{}")
        return jobs
    finally:
        db.conn.close()
