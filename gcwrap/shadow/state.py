"""The shadow's state database: jobs, their streams and durable lengths.

The state lives in `ROOT/.gcshadow/state.db` (SQLite WAL, synchronous=FULL:
a durable offset recorded there is acknowledged to the agent, so it must
survive power loss). Synchronous code, called from the shadow's worker
threads.

Every output file has a `durable` length in the state database: what was
fsynced and acknowledged. On reopening, a file longer than that holds a torn
or unacknowledged tail (the shadow died between write and sync): it is cut
back to `durable` and the agent sends those bytes again. A file shorter than
`durable` lost acknowledged bytes behind the shadow's back, which is refused.

Durability (`Store.make_durable`, one call per batch in the shadow's
durability thread): sync the dirty files (`syncer.Syncer`), then
commit their new lengths to the state database.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ..db import migrate as db_migrate
from ..db import transaction, uri
from ..wire.events import StreamSpec
from ..wire.names import STATE_DIR, NameError_, split_name, staged_like
from . import fileversions, timeline
from .files import (
    JobFiles,
    Problem,
    StateUnavailable,
    StoreError,
    StreamFile,
    claim_root,
    entry_dirs,
    lock_root,
    open_confined,
    open_dir,
)
from .syncer import Syncer

if TYPE_CHECKING:
    import sqlite_utils

log = logging.getLogger("gcshadow")
T = TypeVar("T")

LAST_SEEN_EVERY = 1.0  # seconds: how stale a streaming job's last_seen may get (it is shown in whole seconds)
LAST_SEEN_JOBS = 4096  # jobs whose stamp times are kept before the quiet ones are forgotten


class Superseded(OSError):
    """A durable length not recorded: a newer session holds the job."""

    def __init__(self, job_id: str) -> None:
        super().__init__(errno.ESTALE, f"a newer session of job {job_id} holds it")


class RecordUnknown(OSError):
    """A durable length whose record failed part-way (the state database
    failed, or its connection was lost during COMMIT): it may or may not
    have been recorded. Nothing is acknowledged, and nothing that synced is
    cut back: the next session of the job reads what the state holds."""

    def __init__(self, why: str) -> None:
        super().__init__(errno.EIO, why)


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


def _m002_owner(db: sqlite_utils.Database) -> None:
    # The identity a job belongs to ("" on a shadow without identities).
    db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''")


def _m003_wire(db: sqlite_utils.Database) -> None:
    # Bytes that crossed the wire for a stream (compressed or not); NULL for
    # streams recorded before it was counted.
    db.execute("ALTER TABLE streams ADD COLUMN wire INTEGER")


def _m004_settled(db: sqlite_utils.Database) -> None:
    # One row written after a failed commit (`Store._settle`): see there.
    db.execute("CREATE TABLE settled (id INTEGER PRIMARY KEY CHECK (id = 1), at REAL, why TEXT)")


def _m005_timeline(db: sqlite_utils.Database) -> None:
    # Each job's events, the refused connections, the shadow's own state (`timeline`).
    db.execute(
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL,
            source TEXT NOT NULL, details TEXT NOT NULL, digest TEXT NOT NULL)"""
    )
    db.execute("CREATE UNIQUE INDEX events_digest ON events (job_id, digest)")
    db.execute("CREATE INDEX events_time ON events (job_id, time)")
    db.execute(
        """CREATE TABLE refusals (
            id INTEGER PRIMARY KEY, time REAL NOT NULL, peer TEXT NOT NULL, identity TEXT NOT NULL,
            job_id TEXT NOT NULL, code TEXT NOT NULL, message TEXT NOT NULL)"""
    )
    db.execute(
        """CREATE TABLE shadows (
            shadow TEXT PRIMARY KEY, root TEXT NOT NULL, started REAL, checked REAL NOT NULL,
            free INTEGER NOT NULL, min_free INTEGER NOT NULL)"""
    )
    db.execute("ALTER TABLE jobs ADD COLUMN heard REAL")


MIGRATIONS: list[tuple[int, str, Callable[[sqlite_utils.Database], None]]] = [
    (1, "initial", _m001_initial),
    (2, "owner", _m002_owner),
    (3, "wire", _m003_wire),
    (4, "settled", _m004_settled),
    (5, "timeline", _m005_timeline),
    (6, "file_versions", fileversions.migrate_sqlite),
]


def migrate(db: sqlite_utils.Database) -> None:
    db_migrate(db, MIGRATIONS)


def _database(conn: sqlite3.Connection) -> sqlite_utils.Database:
    # The shadow's state goes through sqlite-utils (a long-running server does
    # not mind its import time; the job's spool uses plain sqlite3 for that).
    import sqlite_utils

    return sqlite_utils.Database(conn)


def open_state(root: Path, *, readonly: bool = False) -> sqlite_utils.Database:
    path = root / STATE_DIR / "state.db"
    if readonly:
        conn = sqlite3.connect(uri(path, mode="ro"), uri=True, isolation_level=None, check_same_thread=False)
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



class Store:
    """The shadow's state and files. One instance per root.

    Called from worker threads: one opens jobs and records their state, the
    other makes bytes durable. `db_lock` keeps their transactions apart on
    the one state connection; each holds it only for its own transaction."""

    shared = False  # one shadow per root: no other process changes who holds a job

    def __init__(self, root: Path, *, use_syncfs: bool = True) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.lock_fd = lock_root(root)
        self.path = root / STATE_DIR / "state.db"
        try:
            claim_root(root, "sqlite", "the embedded state")
            self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            os.close(self.lock_fd)
            raise
        try:
            self.db = open_state(root)
        except BaseException as e:
            os.close(self.root_fd)
            os.close(self.lock_fd)
            if isinstance(e, sqlite3.Error):
                raise StoreError(Problem.ROOT, f"cannot open the shadow's state {self.path}: {e}") from None
            raise
        self.db_lock = threading.RLock()  # (re-entered by the calls of a group)
        self.syncer = Syncer(self.root_fd, use_syncfs)
        self.last_seen: dict[str, float] = {}  # job -> when its last_seen was last stamped (record_durable)
        self._grouped = False  # inside `open_jobs`' transaction: each job opens in a savepoint
        self.unsettled = ""  # why the last write failed, until `_settle` has fixed its outcome

    def close(self) -> None:
        self.syncer.close()
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
        tenant: str = "",
    ) -> JobFiles:
        """Claim or resume a job's files. A new instance (attempt) of a job
        starts its files afresh; a known one resumes at the durable lengths.
        With a `tenant` (an identity), the job's names are under ROOT/tenant/
        and the job id is that identity's: another identity's is refused."""
        with self.db_lock:
            if self._grouped:  # (the group settles, commits, then cuts back)
                return self._open_job(job_id, instance, list(streams), host, user, command, peer, tenant)
            self._settle()
            try:
                files = self._open_job(job_id, instance, list(streams), host, user, command, peer, tenant)
            except sqlite3.Error as e:
                raise self._failed(e) from None
            cut = _cut_or_refuse(files)
            if isinstance(cut, StoreError):
                raise cut
            return cut

    def open_jobs(self, requests: list[dict[str, Any]]) -> list[JobFiles | Exception]:
        """`open_job` for several jobs in one state transaction (`grouped`)."""
        return self.grouped([functools.partial(self.open_job, **r) for r in requests])

    def grouped(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Several of `open_job`, `record_finished` and `record_disconnected`
        in one state transaction (group commit: one sync of the database for
        all of them): the result of each, or its exception in its place.
        Each is still atomic on its own, in a savepoint: a refused one
        changes nothing. If the commit fails, every one does (the files of
        the jobs opened are closed)."""
        results: list[Any] = []
        with self.db_lock:
            try:
                self._settle()
            except StateUnavailable as e:
                return [e for _ in calls]
            conn = self.db.conn
            self._grouped = True
            try:
                conn.execute("BEGIN IMMEDIATE")
                for call in calls:
                    try:
                        results.append(call())
                    except sqlite3.Error:
                        raise  # the state database failed: the whole group does
                    except Exception as e:  # noqa: BLE001 - this one's refusal: the others go on
                        results.append(e)
                conn.execute("COMMIT")
            except sqlite3.Error as e:
                # The state database failed; if in the COMMIT, the group may
                # or may not stand: nothing was cut back, nothing is served.
                _close_opened(results)
                results = [self._failed(e) for _ in calls]
            except BaseException:
                _close_opened(results)
                self._rollback()
                raise
            finally:
                self._grouped = False
        return [_cut_or_refuse(r) if isinstance(r, JobFiles) else r for r in results]

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        """One call's changes: a transaction of its own, or a savepoint inside a group (`grouped`)."""
        if not self._grouped:
            with self._transaction():
                yield
            return
        conn = self.db.conn  # (an error of the database itself fails the whole group: `grouped`)
        conn.execute("SAVEPOINT one")
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK TO one")
            conn.execute("RELEASE one")
            raise
        conn.execute("RELEASE one")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """A write transaction of its own, on a settled state (`_settle`):
        StateUnavailable if the state database fails (and it is settled
        again before the next one)."""
        with self.db_lock:
            self._settle()
            try:
                with transaction(self.db.conn):
                    yield
            except sqlite3.Error as e:
                raise self._failed(e) from None

    def _failed(self, e: sqlite3.Error) -> StateUnavailable:
        """The state database failed a write: its outcome is unknown until settled."""
        self._rollback()
        if not self.unsettled:
            log.error("the state database %s failed: %s; whether its last write applied is unknown: "
                      "acknowledging nothing and refusing sessions until a write succeeds", self.path, e)
        self.unsettled = str(e) or type(e).__name__
        return StateUnavailable(f"the state database failed ({self.unsettled}): come back shortly", self.unsettled)

    def _rollback(self) -> None:
        if self.db.conn.in_transaction:
            try:
                self.db.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    def _settle(self) -> None:
        """After a failed write, fix its outcome before anything reads the
        state. A COMMIT that raised may still have written its frames to the
        WAL: this connection does not see them, but a restart's recovery
        would, and the job's length would grow back after a session had
        trusted the old one. A write that succeeds overwrites those frames
        for good: from then on what this connection reads is what every
        later reader reads. StateUnavailable while the database still fails."""
        if not self.unsettled:
            return
        self._rollback()
        try:
            with transaction(self.db.conn):
                self.db.conn.execute("INSERT OR REPLACE INTO settled VALUES (1, ?, ?)", [time.time(), self.unsettled])
        except sqlite3.Error as e:
            self._rollback()
            raise StateUnavailable(f"the state database still fails ({e or type(e).__name__}): "
                                   "come back shortly") from None
        log.warning("the state database %s answers again: serving", self.path)
        self.unsettled = ""

    def owner(self, job_id: str) -> str | None:
        """The identity a job belongs to ("" on a shadow without identities), or None if it is new."""
        with self.db_lock:
            self._settle()
            try:
                row = self.db.conn.execute("SELECT owner FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            except sqlite3.Error as e:
                raise self._failed(e) from None
        return None if row is None else str(row[0])

    def attempt(self, job_id: str, instance: str) -> Attempt:
        """Whether `instance` is a new attempt of the job, its current one,
        or one a newer attempt replaced (refused for good, before it may
        take the job from anyone)."""
        with self.db_lock:
            self._settle()
            try:
                row = self.db.conn.execute(
                    "SELECT (SELECT instance FROM jobs WHERE job_id = ?), "
                    "EXISTS (SELECT 1 FROM instances WHERE job_id = ? AND instance = ?)",
                    (job_id, job_id, instance)).fetchone()
            except sqlite3.Error as e:
                raise self._failed(e) from None
        return _attempt(row[0], bool(row[1]), instance)

    def _open_job(
        self, job_id: str, instance: str, streams: list[StreamSpec], host: str, user: str, command: list[str],
        peer: str, tenant: str = "",
    ) -> JobFiles:
        # (Plain statements on the connection: sqlite-utils' table objects
        # look the schema up on every use, three queries more per job.)
        db = self.db.conn
        now = time.time()
        row = db.execute("SELECT instance, session, owner FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if row is not None and row[2] != tenant:
            if not row[2]:
                raise StoreError(Problem.NOT_OWNER, f"job {job_id} was streamed here before this shadow had "
                                                    "identities: give the job another id")
            raise StoreError(Problem.NOT_OWNER, f"job {job_id} belongs to another identity")
        fresh = row is None or row[0] != instance
        if fresh and db.execute("SELECT 1 FROM instances WHERE job_id = ? AND instance = ?",
                                (job_id, instance)).fetchone() is not None:
            raise StoreError(Problem.STALE_ATTEMPT, f"job {job_id}: a newer attempt has replaced attempt {instance}")
        # (A finished job that comes back is resending EXIT after a lost DONE:
        # welcomed, its lengths will match.)
        named = self._names(job_id, streams, tenant)
        # Every file is opened (and refused) before any is cut back or
        # recorded: nothing is written for a refused job, and files it made
        # are removed again.
        made: list[str] = []
        fds: list[int] = []
        stats: list[os.stat_result] = []  # each file's fstat when opened
        try:
            for spec, norm in named:
                fds.append(self._open_fd(spec, norm, made, stats))
        except BaseException:
            for fd in fds:
                os.close(fd)
            self._unmake(made)
            raise
        files = JobFiles(job_id, instance, session=(row[1] if row else 0) + 1, fresh=fresh)
        try:
            with self._atomic():
                if fresh:
                    db.execute("DELETE FROM streams WHERE job_id = ?", [job_id])
                    db.execute(
                        """INSERT OR REPLACE INTO jobs (job_id, instance, host, user, command, peer, state,
                           session, first_seen, last_seen, owner) VALUES (?, ?, ?, ?, ?, ?, 'streaming', ?, ?, ?, ?)""",
                        [job_id, instance, host, user, json.dumps(command), peer, files.session, now, now, tenant],
                    )
                    db.execute("INSERT OR IGNORE INTO instances VALUES (?, ?, ?)", [job_id, instance, now])
                else:
                    db.execute(
                        "UPDATE jobs SET session = ?, peer = ?, last_seen = ?, state = CASE state WHEN 'finished' "
                        "THEN 'finished' ELSE 'streaming' END WHERE job_id = ?",
                        [files.session, peer, now, job_id],
                    )
                while fds:
                    (spec, norm), fd, st = named.pop(0), fds.pop(0), stats.pop(0)
                    self._open_stream(files, spec, norm, fd, st, fresh)
        except BaseException:
            for fd in fds:
                os.close(fd)
            files.close()
            self._unmake(made)
            raise
        if made:
            for sf in files.outputs.values():
                sf.new_entries = entry_dirs(sf.name, made)
        return files

    def _names(self, job_id: str, streams: list[StreamSpec], tenant: str) -> list[tuple[StreamSpec, str]]:
        """Each stream with its name under the root, refusing names that
        escape it, two outputs of one name, and outputs another active job holds."""
        names: dict[str, int] = {}
        named: list[tuple[StreamSpec, str]] = []
        for spec in streams:
            try:
                norm = "/".join(split_name(spec.name))
            except NameError_ as e:
                raise StoreError(Problem.FORBIDDEN_NAME, str(e)) from None
            if tenant:  # the identity's part of the root: opened from the root, one directory at a time
                norm = f"{tenant}/{norm}"
            named.append((spec, norm))
            if spec.kind != "stdin":
                if staged_like(norm):  # (a file's version staged at home is named so: `filestore`)
                    raise StoreError(Problem.FORBIDDEN_NAME, f"{norm!r} is named as home names a version of a "
                                                             "file it stages")
                if norm in names:
                    raise StoreError(Problem.FORBIDDEN_NAME, f"two streams of the job name {norm!r}")
                names[norm] = spec.id
                holder = self._name_holder(norm, job_id)
                if holder:
                    raise StoreError(Problem.NAME_IN_USE, f"{norm!r} belongs to job {holder}, which is still active")
        return named

    def _name_holder(self, name: str, job_id: str) -> str | None:
        """The other job still active that writes `name` (a stream, or a file), if any."""
        return fileversions.holder(self.db.conn, fileversions.SQLITE, name, job_id)

    def _open_fd(self, spec: StreamSpec, norm: str, made: list[str], stats: list[os.stat_result] | None = None) -> int:
        try:
            return open_confined(self.root_fd, norm, write=spec.kind != "stdin", made=made, stats=stats)
        except NameError_ as e:
            raise StoreError(Problem.FORBIDDEN_NAME, str(e)) from None
        except FileNotFoundError:
            if spec.kind == "stdin":
                raise StoreError(Problem.MISSING, f"stdin file {norm!r} does not exist at the shadow") from None
            # An output is made where it is missing: its directory vanished while it was made.
            raise StoreError(Problem.IO, f"cannot create {norm!r}: a directory of its path vanished at home") from None
        except OSError as e:
            raise StoreError(Problem.IO, f"cannot open {norm!r}: {e.strerror}") from None

    def _unmake(self, made: list[str]) -> None:
        """Remove the (still empty) files a refused job made."""
        for name in made:
            parts = split_name(name)
            try:
                dfd = open_dir(self.root_fd, parts[:-1], create=False)
            except OSError:
                continue
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_size == 0:
                    os.unlink(parts[-1], dir_fd=dfd)
            except OSError:
                pass
            finally:
                os.close(dfd)

    def _open_stream(self, files: JobFiles, spec: StreamSpec, norm: str, fd: int, st: os.stat_result,
                     fresh: bool) -> None:
        """Record one stream of a job whose file is open (`fd`, its fstat `st`)."""
        db = self.db.conn
        if spec.kind == "stdin":
            files.stdin = StreamFile(files.job_id, spec.id, norm, fd, 0, 0, write=False, session=files.session,
                                     dev=st.st_dev, ino=st.st_ino)
            files.stdin_stream = spec.id
            db.execute(
                "INSERT OR REPLACE INTO streams (job_id, stream, kind, name, durable) VALUES (?, ?, ?, ?, 0)",
                [files.job_id, spec.id, spec.kind, norm],
            )
            return
        try:
            if fresh:
                durable = wire = 0
                db.execute(
                    "INSERT INTO streams (job_id, stream, kind, name, durable, wire) VALUES (?, ?, ?, ?, 0, 0)",
                    [files.job_id, spec.id, spec.kind, norm],
                )
            else:
                row = db.execute("SELECT durable, name, wire FROM streams WHERE job_id = ? AND stream = ?",
                                 (files.job_id, spec.id)).fetchone()
                if row is None or row[1] != norm:
                    raise StoreError(Problem.OTHER_STREAMS, f"job {files.job_id} resumed with different streams")
                durable, wire = row[0], row[2] or 0
                size = st.st_size
                if size < durable:
                    raise StoreError(
                        Problem.CHANGED_AT_HOME,
                        f"{norm!r} holds {size} bytes but {durable} were acknowledged: "
                        "it was truncated or replaced at home",
                    )
        except BaseException:
            os.close(fd)
            raise
        sf = StreamFile(files.job_id, spec.id, norm, fd, durable, durable, session=files.session, wire=wire,
                        dev=st.st_dev, ino=st.st_ino)
        files.outputs[spec.id] = sf
        files.cuts.append((sf, st.st_size))  # once the claim is committed

    def make_durable(
        self, files: list[tuple[StreamFile, int]]
    ) -> tuple[list[tuple[StreamFile, int, OSError | None]], str]:
        """Sync the files up to their lengths, then commit the lengths of the
        ones that synced: (file, length, error) for each, and why the commit
        failed ("" if it did not). Only a length with no error may be
        acknowledged. A file whose session no longer holds its job gets
        `Superseded`: its length is not recorded. When the record fails, the
        files that synced get `RecordUnknown`: it may have applied."""
        results = self.syncer.sync(files)
        good = [(sf.job_id, sf.stream, n, sf.session, sf.wire) for sf, n, err in results if err is None]
        if good:
            try:
                stale = self.record_durable(good)
            except StoreError as e:  # the state database failed (StateUnavailable): acknowledge nothing
                unknown = RecordUnknown(getattr(e, "reason", str(e)))
                return [(sf, n, err or unknown) for sf, n, err in results], str(e)
            if stale:
                results = [(sf, n, Superseded(sf.job_id) if err is None and (sf.job_id, sf.stream) in stale else err)
                           for sf, n, err in results]
        return results, ""

    _RECORD_DURABLE = (
        "UPDATE streams SET durable = max(durable, ?), wire = max(coalesce(wire, 0), ?) "
        "WHERE job_id = ? AND stream = ? AND (SELECT session FROM jobs WHERE jobs.job_id = streams.job_id) = ?"
    )

    def record_durable(self, lengths: Iterable[tuple[str, int, int, int, int]]) -> set[tuple[str, int]]:
        """Record (job, stream, length, session, wire bytes) tuples, each only while that
        session holds the job in the state database (in the same transaction
        as the check). Returns the (job, stream) pairs not recorded. A job's
        "last seen" follows its data: stamped in the same transaction, at most
        once per LAST_SEEN_EVERY."""
        rows = [(n, wire, j, s, session) for j, s, n, session, wire in lengths]
        now = time.time()
        stamped = self.last_seen
        refused: set[tuple[str, int]] = set()
        with self._transaction():
            conn = self.db.conn
            if conn.executemany(self._RECORD_DURABLE, rows).rowcount != len(rows):
                # Some session was superseded (rare): find which rows did not apply.
                # Recording a length again is harmless (max).
                refused = {(j, s) for n, wire, j, s, session in rows
                           if conn.execute(self._RECORD_DURABLE, (n, wire, j, s, session)).rowcount == 0}
            stale = {j for _, _, j, s, _ in rows
                     if (j, s) not in refused and now - stamped.get(j, 0.0) >= LAST_SEEN_EVERY}
            if stale:
                conn.executemany("UPDATE jobs SET last_seen = ? WHERE job_id = ?", [(now, j) for j in stale])
        if len(stamped) > 4 * LAST_SEEN_JOBS:  # (bounded: forget the jobs that went quiet)
            for j in [j for j, t in stamped.items() if now - t >= LAST_SEEN_EVERY]:
                del stamped[j]
        stamped.update(dict.fromkeys(stale, now))
        return refused

    def record_files(self, records: list[fileversions.VersionRecord]) -> set[tuple[str, int, int]]:
        """Versions of the files jobs write, each only while its session holds
        its job: the (job, file, version) not recorded (`fileversions.record`)."""
        with self._transaction():
            return fileversions.record(self.db.conn, fileversions.SQLITE, records)

    def read_files(self, job_id: str, instance: str) -> list[fileversions.VersionRow]:
        """The versions home holds of the files of a run of a job."""
        return self._read(lambda: fileversions.read(self.db.conn, fileversions.SQLITE, job_id, instance))

    def name_holder(self, name: str, job_id: str) -> str | None:
        """The other job still active that writes `name`, if any (a file's NAME, before it is recorded)."""
        return self._read(lambda: self._name_holder(name, job_id))

    def _read(self, fn: Callable[[], T]) -> T:
        with self.db_lock:
            self._settle()
            try:
                return fn()
            except sqlite3.Error as e:
                raise self._failed(e) from None

    def record_disconnected(self, job_id: str, session: int) -> bool:
        """The job's session `session` is gone, recorded only while that
        session holds the job. Whether it was recorded."""
        with self.db_lock, self._atomic():
            cur = self.db.conn.execute(
                "UPDATE jobs SET state = 'disconnected', last_seen = ? WHERE job_id = ? AND session = ?",
                [time.time(), job_id, session],
            )
            return cur.rowcount > 0

    def record_finished(
        self, job_id: str, session: int, *, code: int | None, signal: int | None, reason: str,
        summary: dict[str, Any],
    ) -> bool:
        """The job ended (its EXIT), recorded only while session `session`
        holds the job. Whether it was recorded."""
        now = time.time()
        with self.db_lock, self._atomic():
            cur = self.db.conn.execute(
                "UPDATE jobs SET state = 'finished', ended = ?, last_seen = ?, exit_code = ?, exit_signal = ?, "
                "reason = ?, summary = ? WHERE job_id = ? AND session = ?",
                [now, now, code, signal, reason, json.dumps(summary), job_id, session],
            )
            return cur.rowcount > 0

    def superseded(self, held: dict[str, int]) -> set[str]:
        """Which of the jobs held here (job -> session) another shadow has
        taken since: none, with the root's state this shadow's alone."""
        return set()

    def record_timeline(self, batch: timeline.Batch) -> None:
        """Jobs' events, refused connections, when agents were last heard
        from, the root's free space (`timeline`): in a transaction of their
        own, or a savepoint of a group."""
        with self.db_lock, self._atomic():
            timeline.write(self.db.conn, timeline.SQLITE, batch)

    def mark_disconnected(self) -> None:
        """At start-up: no job is connected to a shadow that just started
        (nor is any other shadow serving the root)."""
        with self._transaction():
            self.db.execute("UPDATE jobs SET state = 'disconnected' WHERE state = 'streaming'")
            self.db.execute("DELETE FROM shadows")


def _close_opened(results: list[Any]) -> None:
    for r in results:
        if isinstance(r, JobFiles):
            r.close()


def _cut_or_refuse(files: JobFiles) -> JobFiles | StoreError:
    """A committed claim's outputs cut back (`JobFiles.cut_back`); one whose
    files cannot be is refused, for now (its next claim cuts them)."""
    try:
        files.cut_back()
    except OSError as e:
        files.close()
        return StoreError(Problem.IO, f"cannot cut back the files of job {files.job_id}: {e.strerror}")
    return files


Attempt = Literal["new", "current", "replaced"]


def _attempt(current: str | None, known: bool, instance: str) -> Attempt:
    """What `instance` is to a job whose current attempt is `current`
    (None: no such job), `known` if it was ever seen."""
    if current == instance:
        return "current"
    return "replaced" if known else "new"
