"""The agent's spool: one SQLite file per job run, holding what home lacks.

The spool records the job (id, attempt, command, pids, times, exit status),
each stream's appended and acknowledged offsets, and the chunks not yet
acknowledged by the shadow. Acknowledged chunks are deleted, so its size
tracks the undelivered backlog.

Storage code here is synchronous and takes a `Database` (gcwrap.db; an
`sqlite_utils.Database` does as well). The agent's spooler is the only
writer: it runs each commit inline in the event loop's thread when it is
small (zero-copy rows), else in a worker thread, one at a time; a second,
read-only connection reads evicted bytes back. Tests call it directly (in
memory too). Schema changes are numbered migrations (gcwrap.db.migrate).

Durability: WAL with synchronous=NORMAL. A commit survives the wrapper being
killed (kill -9), which is what the spool is for; after a power loss the last
commits may roll back, but the job dies with the machine then anyway, and the
shadow's offsets make any resend exactly-once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import resource
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from .. import db as sqlitedb
from ..db import AnyDatabase, Database, Migration, configure, connect, migrate, reader, transaction
from .records import Chunk, Extent, JobRecord, SourceError, StreamState
from .segments import DEFAULT_SEGMENT, Segments

SPOOL_SUFFIX = ".spool"
# The bytes live in segment files: the database holds only small rows, and a
# commit writes every page it touches to the WAL. With the 64 KiB pages of
# the blob days, a 64 KiB pipe read cost about 200 KiB of WAL writes.
PAGE_SIZE = 4096


# -- migrations --------------------------------------------------------------


def _m001_initial(db: AnyDatabase) -> None:
    db.execute(
        """CREATE TABLE job (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            job_id TEXT NOT NULL, instance TEXT NOT NULL, command TEXT NOT NULL,
            host TEXT, user TEXT, shadow TEXT, started REAL,
            wrapper_pid INTEGER, child_pid INTEGER, ended REAL,
            exit_code INTEGER, exit_signal INTEGER,
            state TEXT NOT NULL, reason TEXT, last_error TEXT,
            retries INTEGER NOT NULL DEFAULT 0, connected INTEGER NOT NULL DEFAULT 0,
            delivered INTEGER NOT NULL DEFAULT 0, summary TEXT)"""
    )
    db.execute(
        """CREATE TABLE streams (
            id INTEGER PRIMARY KEY, kind TEXT NOT NULL, name TEXT NOT NULL,
            appended INTEGER NOT NULL DEFAULT 0, acked INTEGER NOT NULL DEFAULT 0,
            eof INTEGER NOT NULL DEFAULT 0)"""
    )
    # AUTOINCREMENT: a plain INTEGER PRIMARY KEY may hand out a deleted row's
    # key again once the table empties; `seq` must only ever grow.
    db.execute(
        """CREATE TABLE chunks (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            stream INTEGER NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL,
            data BLOB NOT NULL, UNIQUE (stream, start))"""
    )


def _m002_chunk_time(db: AnyDatabase) -> None:
    # When each chunk was spooled: `gcwrap status` shows the oldest pending age.
    db.execute("ALTER TABLE chunks ADD COLUMN t REAL")


def _m003_segments(db: AnyDatabase) -> None:
    # Bytes move to segment files (gcwrap.agent.segments): a row names its segment
    # and position; `data` stays for the chunks of older spools (and in memory).
    db.execute("ALTER TABLE chunks ADD COLUMN seg INTEGER")
    db.execute("ALTER TABLE chunks ADD COLUMN pos INTEGER")


def _m004_layout(db: AnyDatabase) -> None:
    # The segments' layout: a segment size means natural (byte o of a stream
    # at o // segment_size, o % segment_size); NULL, the appending layout of
    # spools made before it. (A column, not a table: a spool must fit where
    # little is left, and a table takes a page of its own.)
    db.execute("ALTER TABLE job ADD COLUMN segment_size INTEGER")


def _m005_written(db: AnyDatabase) -> None:
    # What the job wrote to each stream, recorded when the run ends. Bytes
    # from `appended` to `written` were held only in memory and never reached
    # the spool nor home: they are lost (always a stream's tail). NULL: not
    # recorded (the run has not ended, or gcwrap was killed).
    db.execute("ALTER TABLE streams ADD COLUMN written INTEGER")


MIGRATIONS: list[Migration] = [
    (1, "initial", _m001_initial),
    (2, "chunk-time", _m002_chunk_time),
    (3, "segments", _m003_segments),
    (4, "layout", _m004_layout),
    (5, "written", _m005_written),
]

JOURNAL_SIZE_LIMIT = 8 << 20  # bound the WAL file: checkpoints reset it, and this truncates what stays


def _configure(conn: sqlite3.Connection) -> None:
    """The spool's pragmas: WAL, synchronous=NORMAL (see the module's docstring)."""
    configure(conn, synchronous="NORMAL", journal_size_limit=JOURNAL_SIZE_LIMIT)


# -- naming ------------------------------------------------------------------


def safe_filename(job_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", job_id)[:96] or "job"


def new_instance() -> str:
    return uuid.uuid4().hex[:16]


SCRATCH_VARIABLES = ("_CONDOR_SCRATCH_DIR", "SLURM_TMPDIR", "TMPDIR")


def default_spool_dir(env: Mapping[str, str] | None = None) -> Path:
    """`gcwrap-UID` in the batch system's scratch directory when there is one
    (HTCondor's, then Slurm's, then $TMPDIR), else in /tmp."""
    env = os.environ if env is None else env
    base = next((env[v] for v in SCRATCH_VARIABLES if env.get(v)), "/tmp")
    return Path(base) / f"gcwrap-{os.getuid()}"


def spool_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.endswith(SPOOL_SUFFIX))


# -- the spool ---------------------------------------------------------------

_JOB_FIELDS = [
    "job_id", "instance", "command", "host", "user", "shadow", "started", "wrapper_pid", "child_pid", "ended",
    "exit_code", "exit_signal", "state", "reason", "last_error", "retries", "connected", "delivered", "summary",
]


def _job_values(job: dict[str, Any]) -> dict[str, Any]:
    """Job fields as the job table stores them (JSON, 0/1); ValueError for
    a field it does not have."""
    values = dict(job)
    for key in ("command", "summary"):
        if key in values:
            values[key] = json.dumps(values[key])
    for key in ("connected", "delivered"):
        if key in values:
            values[key] = int(values[key])
    bad = set(values) - set(_JOB_FIELDS)
    if bad:
        raise ValueError(f"unknown job fields {sorted(bad)}")
    return values


class SpoolError(SourceError):
    """The spool could not be read or written (disk full, I/O error, corrupt)."""


F = TypeVar("F", bound=Callable[..., Any])


def _reads(fn: F) -> F:
    """A read of the spool: a damaged database (or record) is a SpoolError
    that says so, like every other failure of the spool."""
    @functools.wraps(fn)
    def read(self: Spool, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (sqlite3.DatabaseError, ValueError, TypeError, KeyError) as e:
            raise SpoolError(f"spool {self.path}: cannot be read, it is damaged ({e})") from None
    return read  # type: ignore[return-value]


class Spool:
    """Read and write one job's spool. Not thread-safe: one owner thread."""

    def __init__(
        self, db: AnyDatabase, path: Path | None = None, *, readonly: bool = False, segments: Segments | None = None
    ) -> None:
        self.db = db
        self.path = path
        # On disk the bytes live in segment files; in memory (tests) in the rows.
        # A second connection to a spool borrows the first one's segments (one
        # `Segments` per spool: see gcwrap.agent.segments), and leaves them to it.
        self.owns_segments = segments is None
        if segments is None and path is not None:
            segments = Segments(Path(f"{path}.seg"), readonly=readonly)
        self.segments = segments

    # -- opening ---------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: Path | None,
        job: JobRecord,
        streams: Iterable[tuple[int, str, str]],
        segment_size: int = DEFAULT_SEGMENT,
    ) -> Spool:
        """A new spool for one run of a job. `path=None` makes one in memory.
        On disk it appears whole or not at all: built under a temporary name
        and renamed into place, so a wrapper killed meanwhile leaves no
        half-made spool. Raises SpoolError (disk full, unwritable...)."""
        if path is None:
            return cls._build(sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False),
                              None, job, streams, segment_size)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise SpoolError(f"cannot create the spool directory {path.parent}: {e.strerror}") from None
        if path.exists():
            raise SpoolError(f"spool {path} already exists")
        draft = path.with_name(path.name + ".new")

        def discard_draft() -> None:
            for suffix in ("", "-journal"):
                with contextlib.suppress(OSError):
                    Path(f"{draft}{suffix}").unlink(missing_ok=True)

        try:
            discard_draft()
            # Made here, not by SQLite, whose "unable to open database file"
            # does not say why (a directory not writable, read-only, full...).
            os.close(os.open(draft, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
            conn = sqlite3.connect(str(draft), isolation_level=None, check_same_thread=False)
            # The draft is thrown away on any failure, so its transactions
            # need no syncs of their own (one per migration, about 30 in all,
            # each a disk flush before the job may start): one fsync of the
            # whole draft, before it is renamed into place, does it.
            conn.execute("PRAGMA synchronous = OFF")
            conn.execute("PRAGMA journal_mode = MEMORY")
            cls._build(conn, None, job, streams, segment_size, where=path).close()
            fd = os.open(draft, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(draft, path)
        except OSError as e:
            discard_draft()
            raise SpoolError(describe_os_error(e, path)) from None
        except sqlite3.Error as e:
            discard_draft()
            raise SpoolError(describe_sqlite_error(e, path)) from None
        except SpoolError:
            discard_draft()
            raise
        try:
            return cls.open(path)
        except (OSError, SpoolError) as e:
            # In place but unusable (no descriptor left, the disk...): not a
            # spool anyone could resume, so none at all.
            sqlitedb.remove(path)
            if isinstance(e, OSError):
                raise SpoolError(describe_os_error(e, path)) from None
            raise

    @classmethod
    def _build(
        cls,
        conn: sqlite3.Connection,
        path: Path | None,
        job: JobRecord,
        streams: Iterable[tuple[int, str, str]],
        segment_size: int,
        where: Path | None = None,
    ) -> Spool:
        """Schema, job record and streams, in a fresh database (rollback
        journal until the spool is in place; `open` switches to WAL).
        `where`: the spool's path, for messages."""
        try:
            conn.execute(f"PRAGMA page_size = {PAGE_SIZE}")
            db = Database(conn)
            migrate(db, MIGRATIONS)
            spool = cls(db, path)
            with transaction(db.conn):
                row = spool._job_row(job)
                db.execute(
                    f"INSERT INTO job (id, {', '.join(_JOB_FIELDS)}) VALUES (1, {', '.join('?' * len(_JOB_FIELDS))})",
                    [row[k] for k in _JOB_FIELDS],
                )
                for sid, kind, name in streams:
                    db.execute("INSERT INTO streams (id, kind, name) VALUES (?, ?, ?)", [sid, kind, name])
                db.execute("UPDATE job SET segment_size = ? WHERE id = 1", [segment_size])
            if path is None:
                _configure(conn)
        except sqlite3.Error as e:
            conn.close()
            raise SpoolError(describe_sqlite_error(e, path or where)) from None
        return spool

    @classmethod
    def open(cls, path: Path, *, readonly: bool = False, segments: Segments | None = None) -> Spool:
        """Open a spool on disk; with `segments`, a second connection to an
        open one, sharing its segments (the spooler's reader)."""
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))  # (SQLite would say "unable to open database file")
        except FileNotFoundError:
            pass  # (said below)
        except OSError as e:
            why = os_reason(e) if e.errno in (errno.EMFILE, errno.ENFILE) else e.strerror
            raise SpoolError(f"spool {path}: cannot be read ({why})") from None
        if not path.exists():
            raise SpoolError(f"no spool at {path}")
        try:
            conn = connect(path, readonly=readonly)
            if not readonly:
                _configure(conn)
            # The read side (`gcwrap status`, a resume's first look) reads through
            # sqlite-utils; the job's own connections through the same subset of it.
            db: AnyDatabase = reader(conn) if readonly else Database(conn)
            if not readonly:
                migrate(db, MIGRATIONS)
            conn.execute("SELECT 1 FROM job").fetchall()
        except sqlite3.DatabaseError as e:
            if "conn" in locals():
                conn.close()
            # A schema not as migrations left it: another database, or a damaged spool.
            damaged = ("no such table", "no such column", "already exists")
            if isinstance(e, sqlite3.OperationalError) and not any(d in str(e) for d in damaged):
                raise SpoolError(describe_sqlite_error(e, path)) from None  # the disk, the descriptors, the permissions
            raise SpoolError(f"{path} is not a gcwrap spool, or is damaged: {e}") from None
        spool = cls(db, path, readonly=readonly, segments=segments)
        if spool.owns_segments:
            try:
                spool._resume_segments()
            except (OSError, sqlite3.Error) as e:
                conn.close()
                if isinstance(e, OSError):
                    raise SpoolError(describe_os_error(e, path)) from None
                raise SpoolError(describe_sqlite_error(e, path)) from None
        return spool

    @property
    def natural(self) -> bool:
        """Segments in the natural layout: stream bytes found by offset alone."""
        return self.segments is not None and self.segments.natural

    def _resume_segments(self) -> None:
        """The segments' layout, and which are on disk."""
        if self.segments is None:
            return
        try:
            row = self.db.execute("SELECT segment_size FROM job WHERE id = 1").fetchone()
        except sqlite3.OperationalError:
            row = None  # a spool from before migration 4, opened read-only
        if row is not None and row[0]:
            self.segments.natural = True
            self.segments.segment_size = int(row[0])
        self.segments.scan()

    def close(self) -> None:
        self.db.conn.close()
        if self.segments is not None and self.owns_segments:
            self.segments.close()

    # -- job and streams -------------------------------------------------

    @staticmethod
    def _job_row(job: JobRecord) -> dict[str, Any]:
        row = {k: getattr(job, k) for k in _JOB_FIELDS}
        row["command"] = json.dumps(job.command)
        row["summary"] = json.dumps(job.summary)
        row["connected"] = int(job.connected)
        row["delivered"] = int(job.delivered)
        return row

    @_reads
    def job(self) -> JobRecord:
        row = next(iter(self.db["job"].rows_where("id = 1")), None)
        if row is None:
            raise SpoolError(f"{self.path}: spool has no job record")
        values = {k: row[k] for k in _JOB_FIELDS}
        values["command"] = json.loads(values["command"])
        values["summary"] = json.loads(values["summary"] or "{}")
        values["connected"] = bool(values["connected"])
        values["delivered"] = bool(values["delivered"])
        values["retries"] = values["retries"] or 0
        for key in ("host", "user", "shadow", "reason", "last_error"):
            values[key] = values[key] or ""
        return JobRecord(**values)

    @_reads
    def streams(self) -> dict[int, StreamState]:
        # (`written` is missing from a spool before migration 5, opened read-only.)
        return {r["id"]: StreamState(r["id"], r["kind"], r["name"], r["appended"], r["acked"], bool(r["eof"]),
                                     r.get("written"))
                for r in self.db["streams"].rows_where(order_by="id")}

    # -- the hot path ----------------------------------------------------

    def commit(
        self,
        chunks: Iterable[Chunk | Extent] = (),
        acked: dict[int, int] | None = None,
        eof: Iterable[int] = (),
        job: dict[str, Any] | None = None,
        written: dict[int, int] | None = None,
    ) -> None:
        """One transaction: append `chunks`, record `acked` offsets (deleting
        every chunk that lies wholly below them), mark streams ended, update
        job fields, record what the job `written` to each stream (at the end
        of a run). Group commit: callers batch many pipe reads into one call.
        Raises SpoolError (with the OS reason) when the disk refuses."""
        chunks = list(chunks)
        acked = acked or {}
        if self.natural:
            self._check_unspooled(chunks)
        try:
            rows, ends = self._place(chunks)
        except OSError as e:
            raise SpoolError(describe_os_error(e, self.path)) from e
        try:
            with transaction(self.db.conn):
                self._record(rows, ends, acked, eof, written or {}, _job_values(job or {}))
        except sqlite3.Error as e:
            raise SpoolError(describe_sqlite_error(e, self.path)) from e
        self._release(acked)

    def _check_unspooled(self, chunks: list[Chunk | Extent]) -> None:
        """Natural layout: a byte's place is fixed by its offset, so a chunk
        over bytes already spooled would write over them before the
        transaction could fail."""
        floor = {sid: st.appended for sid, st in self.streams().items()}
        for c in chunks:
            if c.size and c.start < floor.get(c.stream, 0):
                raise SpoolError(
                    f"spool {self.path}: bytes {c.start}..{c.end} of stream {c.stream} are already spooled"
                )
            floor[c.stream] = max(floor.get(c.stream, 0), c.end)

    def _place(self, chunks: list[Chunk | Extent]) -> tuple[list[tuple[Any, ...]], dict[int, int]]:
        """The chunks' bytes put in place (natural layout: in their segments),
        and the rows that record them; each stream's new end."""
        segments, natural, now = self.segments, self.natural, time.time()
        rows: list[tuple[Any, ...]] = []
        ends: dict[int, int] = {}
        for c in chunks:
            if not c.size:
                # Nothing to keep, and a row would take (stream, start)
                # from the chunk that really holds the bytes there.
                continue
            if isinstance(c, Extent):
                # Spliced: the bytes are in place already, at most to a segment's end.
                if not natural:
                    raise ValueError("spliced bytes need a spool of natural layout")
                assert segments is not None
                seg, pos, room = segments.where(c.start)
                if c.size > room:
                    raise ValueError(f"extent {c.start}..{c.end} crosses the end of segment {seg}")
                rows.append((c.stream, c.start, c.end, b"", now, seg, pos))
            elif natural:
                # The bytes first; they count once their row is committed.
                assert segments is not None
                for seg, pos, start, end in segments.place_at(c.stream, c.start, c.data):
                    rows.append((c.stream, start, end, b"", now, seg, pos))
            elif segments is not None:
                # Made by an earlier version: gcwrap only ever delivers it
                # (`gcwrap resume`), which appends nothing.
                raise ValueError("a spool of the appending layout takes no new bytes")
            else:
                rows.append((c.stream, c.start, c.end, bytes(c.data), now, None, None))
            ends[c.stream] = max(ends.get(c.stream, 0), c.end)
        return rows, ends

    def _record(self, rows: list[tuple[Any, ...]], ends: dict[int, int], acked: dict[int, int], eof: Iterable[int],
                written: dict[int, int], job: dict[str, Any]) -> None:
        """The statements of one commit (inside its transaction)."""
        conn = self.db.conn
        if rows:
            conn.executemany(
                'INSERT INTO chunks (stream, start, "end", data, t, seg, pos) VALUES (?, ?, ?, ?, ?, ?, ?)', rows
            )
        for sid, end in ends.items():
            conn.execute("UPDATE streams SET appended = max(appended, ?) WHERE id = ?", (end, sid))
        for sid, offset in acked.items():
            conn.execute(
                "UPDATE streams SET acked = max(acked, ?), appended = max(appended, ?) WHERE id = ?",
                (offset, offset, sid),
            )
            conn.execute('DELETE FROM chunks WHERE stream = ? AND start < ? AND "end" <= ?', (sid, offset, offset))
        for sid in eof:
            conn.execute("UPDATE streams SET eof = 1 WHERE id = ?", (sid,))
        for sid, end in written.items():
            conn.execute("UPDATE streams SET written = ? WHERE id = ?", (end, sid))
        if job:
            sets = ", ".join(f"{k} = ?" for k in job)
            conn.execute(f"UPDATE job SET {sets} WHERE id = 1", list(job.values()))

    def _release(self, acked: dict[int, int]) -> None:
        """Segments whose every byte is acknowledged are given back."""
        segments = self.segments
        if segments is None:
            return
        for sid, offset in acked.items():
            if self.natural:
                segments.release_below(sid, offset)
                continue
            (oldest,) = self.db.conn.execute("SELECT min(seg) FROM chunks WHERE stream = ?", (sid,)).fetchone()
            segments.release(sid, oldest)

    def _bytes(self, stream: int, start: int, end: int, data: bytes, seg: int | None, pos: int | None) -> bytes:
        if seg is None or self.segments is None:
            return bytes(data)
        try:
            return self.segments.read(stream, seg, pos or 0, end - start)
        except OSError as e:
            raise SpoolError(f"spool {self.path}: cannot read bytes {start}..{end} of stream {stream}: {e}") from None

    @_reads
    def read(self, stream: int, offset: int, max_bytes: int) -> list[Chunk]:
        """Chunks of `stream` holding bytes at or after `offset`, in order,
        about `max_bytes` in all (at least one chunk if any)."""
        cur = self.db.conn.execute(
            'SELECT start, "end", data, seg, pos FROM chunks WHERE stream = ? AND "end" > ? ORDER BY start',
            (stream, offset),
        )
        out: list[Chunk] = []
        total = 0
        for start, end, data, seg, pos in cur:
            out.append(Chunk(stream, start, self._bytes(stream, start, end, data, seg, pos)))
            total += end - start
            if total >= max_bytes:
                break
        cur.close()
        return out

    def iter_all(self) -> Iterator[Chunk]:
        for stream, start, end, data, seg, pos in self.db.conn.execute(
            'SELECT stream, start, "end", data, seg, pos FROM chunks ORDER BY seq'
        ).fetchall():
            yield Chunk(stream, start, self._bytes(stream, start, end, data, seg, pos))

    @_reads
    def oldest_pending(self) -> dict[int, float]:
        """Per stream, when its oldest chunk still in the spool was spooled."""
        try:
            rows = self.db.execute("SELECT stream, min(t) FROM chunks GROUP BY stream").fetchall()
        except sqlite3.OperationalError:
            return {}  # a spool from before migration 2, opened read-only
        return {r[0]: r[1] for r in rows if r[1] is not None}

    @_reads
    def pending_bytes(self) -> int:
        row = self.db.execute('SELECT coalesce(sum("end" - start), 0) FROM chunks').fetchone()
        return int(row[0])

    def file_size(self) -> int:
        if self.path is None:
            return 0
        return sqlitedb.size(self.path) + (self.segments.size() if self.segments is not None else 0)

    def remove(self) -> None:
        """Close and delete the spool files (everything was delivered)."""
        self.close()
        if self.path is not None:
            sqlitedb.remove(self.path)
        if self.segments is not None and self.owns_segments:
            self.segments.remove()


def describe_os_error(e: OSError, path: Path | None) -> str:
    return f"spool {path}: {os_reason(e)}" if path else f"spool: {os_reason(e)}"


def os_reason(e: OSError) -> str:
    """Why the disk refused, in words."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full ({e.strerror})"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"not writable ({e.strerror})"
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return "out of file descriptors (raise `ulimit -n`)"
    if e.errno == errno.EEXIST and e.filename is not None:
        return f"{e.filename} exists and is not a directory"
    if e.errno == errno.ENOTDIR and e.filename is not None:
        return f"{e.filename}: a part of the path is a file, not a directory"
    return str(e.strerror or e)


def describe_sqlite_error(e: sqlite3.Error, path: Path | None) -> str:
    return f"spool {path}: {sqlite_reason(e, path)}" if path else f"spool: {sqlite_reason(e, path)}"


def sqlite_reason(e: sqlite3.Error, path: Path | None) -> str:
    """Why SQLite refused, in words."""
    text = str(e)
    if "full" in text:
        return f"disk full ({text})"
    if "readonly" in text or "read-only" in text:
        return f"not writable ({text})"
    if "disk I/O" in text:
        # What SQLite says when it cannot grow its shared-memory file, or a
        # write fails, on a file system that is full.
        if path is not None and _nearly_full(path.parent):
            return f"disk full ({text})"
        return f"I/O error ({text})"
    if "unable to open" in text and _out_of_descriptors():
        return "out of file descriptors (raise `ulimit -n`)"
    return text


def _nearly_full(directory: Path) -> bool:
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < max(1 << 20, st.f_blocks * st.f_frsize // 100)


def _out_of_descriptors() -> bool:
    """SQLite's "unable to open database file" hides errno. By the time it
    is raised SQLite has closed what it had opened: so count what is left
    (SQLite needs up to three descriptors: database, journal, shared memory)."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        used = len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
    except OSError as e:
        return e.errno in (errno.EMFILE, errno.ENFILE)
    return soft != resource.RLIM_INFINITY and soft - used < 4
