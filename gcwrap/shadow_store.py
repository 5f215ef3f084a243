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

Descriptors are bounded (`FileCache`): a connected job's files are closed
when they are clean and others need the descriptors, and opened again,
confined as the first time and checked to be the same file, when next used.
Durability (`Store.make_durable`, one call per batch in the shadow's
durability thread): sync the dirty files (`Syncer`: one syncfs() of the
root's file system when several are dirty and that is cheaper, fdatasync()
of each otherwise), then commit their new lengths to the state database.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .events import ErrorCode, StreamSpec

if TYPE_CHECKING:
    import sqlite_utils
from .db import migrate as db_migrate
from .db import transaction, uri
from .names import STATE_DIR, NameError_, split_name

LAST_SEEN_EVERY = 1.0  # seconds: how stale a streaming job's last_seen may get (it is shown in whole seconds)
LAST_SEEN_JOBS = 4096  # jobs whose stamp times are kept before the quiet ones are forgotten


class StoreError(Exception):
    """A refusal or failure, with the protocol error code to send."""

    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code = code


class Superseded(OSError):
    """A durable length not recorded: a newer session holds the job."""

    def __init__(self, job_id: str) -> None:
        super().__init__(errno.ESTALE, f"a newer session of job {job_id} holds it")


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


MIGRATIONS: list[tuple[int, str, Callable[[sqlite_utils.Database], None]]] = [
    (1, "initial", _m001_initial),
    (2, "owner", _m002_owner),
    (3, "wire", _m003_wire),
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


def check_root(root: Path) -> None:
    """Make sure the shadow can work under `root` (creating it if missing),
    before anything listens; StoreError naming the path and what is wrong
    with it otherwise."""
    try:
        st: os.stat_result | None = os.stat(root)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise StoreError(None, f"cannot reach the root {root}: {_why_not(e, root)}") from None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise StoreError(None, f"the root {root} is not a directory")
    else:
        try:
            root.mkdir(parents=True)
        except OSError as e:
            raise StoreError(None, f"cannot create the root {root}: {_why_not(e, root)}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        if os.access(root, os.F_OK) and _read_only(root):
            raise StoreError(None, f"the root {root} is on a read-only file system")
        if os.geteuid() == 0:
            raise StoreError(None, f"the root {root} is not writable, not even by root (a special file system?)")
        raise StoreError(None, f"the root {root} is not writable by this user ({_user()})")
    # Root may write where permissions say no, and some file systems (/proc,
    # /sys) refuse all the same: try for real what serving needs.
    probe = root / f".gcshadow-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise StoreError(None, f"cannot create files in the root {root}: {e.strerror}") from None
    state = root / STATE_DIR
    try:
        state.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise StoreError(None, f"cannot create the shadow's state directory {state}: {e.strerror}") from None


def _why_not(e: OSError, path: Path) -> str:
    """Why `path` cannot be reached or created, in terms of the nearest
    directory above it that this user can see."""
    parent = path.parent
    while parent != parent.parent:
        try:
            os.stat(parent)
            break
        except OSError:
            parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if e.errno == errno.EACCES:
        if not os.access(parent, os.X_OK):
            return f"{parent} is closed to this user ({_user()})"
        return f"no permission to create it in {parent} (as {_user()})"
    if e.errno == errno.EROFS:
        return f"{parent} is on a read-only file system"
    return f"{parent} does not take new directories ({e.strerror})"


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _user() -> str:
    import pwd

    uid = os.geteuid()
    try:
        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:
        return f"uid {uid}"


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


def open_confined(root_fd: int, name: str, *, write: bool, create: bool = True, made: list[str] | None = None) -> int:
    """Open NAME under the root without following any symlink; only regular
    files with one link (a hard link made in the root could lead to any file
    of the file system, or to another identity's). With `write` and
    `create`, missing directories and the file are made (the file's name
    appended to `made`). Raises NameError_ for a refused name, OSError for
    I/O failures."""
    parts = split_name(name)
    make = write and create
    try:
        dfd = _open_dir(root_fd, parts[:-1], create=make)
    except (NotADirectoryError, FileNotFoundError) as e:
        if make or isinstance(e, NotADirectoryError):
            raise NameError_(f"{name!r}: a parent is not a directory") from None
        raise
    except OSError as e:
        if e.errno in (40,):  # ELOOP: a symlink in the path
            raise NameError_(f"{name!r}: the path goes through a symlink") from None
        raise
    try:
        flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        flags |= (os.O_WRONLY | (os.O_CREAT if create else 0)) if write else os.O_RDONLY
        try:
            if made is not None and flags & os.O_CREAT:
                try:  # which files a refused job made, to remove them again
                    fd = os.open(parts[-1], flags | os.O_EXCL, 0o644, dir_fd=dfd)
                    made.append(name)
                except FileExistsError:
                    fd = os.open(parts[-1], flags, 0o644, dir_fd=dfd)
            else:
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
    if st.st_nlink > 1:
        os.close(fd)
        raise NameError_(f"{name!r} has {st.st_nlink} links (hard links lead to other files): refused, as a symlink is")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


@dataclass(eq=False)
class StreamFile:
    """One file of a job (an output, or its stdin), open or not (fd -1)."""

    job_id: str
    stream: int
    name: str
    fd: int
    written: int  # bytes in the file (the end of the last write)
    durable: int  # bytes fsynced and recorded: safe to acknowledge
    write: bool = True  # an output; False: the job's stdin, read only
    session: int = 0  # the session that opened it: only while it holds the job are its lengths recorded
    dev: int = 0  # the file's identity when first opened: a reopened file must be the same
    ino: int = 0
    pins: int = 0  # syncs in flight that use `fd`: it must not be closed (its number reused)
    sync_failed: bool = False  # a sync reported an error: nothing more of it may be called durable
    cut_back: bool = False  # the shadow has cut it back to `durable` after that error
    wire: int = 0  # bytes of its frames' payloads received (compressed or not), in every session
    slot: int = -1  # where FileCache holds it while open
    used: int = 0  # FileCache's clock at its last use

    def identify(self) -> None:
        st = os.fstat(self.fd)
        self.dev, self.ino = st.st_dev, st.st_ino

    @property
    def closable(self) -> bool:
        """Open, clean (everything written is durable) and not being synced."""
        return self.fd >= 0 and not self.pins and self.written == self.durable

    def reopen(self, root_fd: int) -> None:
        """Open the file again after the cache closed it: confined as the
        first time, never created, and it must be the same file, at least as
        long as what was written. StoreError if not; OSError on I/O errors."""
        try:
            fd = open_confined(root_fd, self.name, write=self.write, create=False)
        except NameError_ as e:
            raise StoreError(ErrorCode.PATH_FORBIDDEN, str(e)) from None
        except FileNotFoundError:
            raise StoreError(ErrorCode.LENGTH_MISMATCH, f"{self.name!r} was removed at home while in use") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (self.dev, self.ino):
                raise StoreError(ErrorCode.LENGTH_MISMATCH, f"{self.name!r} was replaced at home while in use")
            if self.write and st.st_size < self.written:
                raise StoreError(
                    ErrorCode.LENGTH_MISMATCH,
                    f"{self.name!r} holds {st.st_size} bytes but {self.written} were written: "
                    "it was truncated at home while in use",
                )
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


@dataclass
class JobFiles:
    job_id: str
    instance: str
    session: int
    outputs: dict[int, StreamFile] = field(default_factory=dict)
    stdin: StreamFile | None = None
    stdin_stream: int | None = None

    def all(self) -> list[StreamFile]:
        return [*self.outputs.values(), *([self.stdin] if self.stdin is not None else [])]

    def close(self) -> None:
        for sf in self.all():
            sf.close()
        self.outputs.clear()
        self.stdin = None


class FileCache:
    """The open descriptors of the connected jobs' files, bounded.

    Owned by the event loop. When over its target, the cache closes files
    that are clean and not being synced (`StreamFile.closable`): a dirty
    file's own sync must see its writeback errors, and a pinned descriptor's
    number must not be reused under a sync. So the cache runs over its target
    while more files than that are dirty, until the next durability batch.

    The victim is the least recently used of a few files drawn at random
    (sampled LRU): idle jobs' files go first, and when every job writes in
    turn (a cycle longer than the cache, where exact LRU would miss every
    time) most files still stay open.
    """

    SAMPLE = 5

    def __init__(self, root_fd: int, lock: threading.Lock | None = None) -> None:
        self.root_fd = root_fd
        self.lock = lock or threading.Lock()  # held to check `closable` and close: pins change under it
        self.slots: list[StreamFile] = []  # the open files, in no order
        self.clock = 0
        self.reopened = 0
        self.evicted = 0
        self.rng = random.Random()

    def __len__(self) -> int:
        return len(self.slots)

    def _insert(self, sf: StreamFile) -> None:
        if sf.slot < 0:
            sf.slot = len(self.slots)
            self.slots.append(sf)

    def _remove(self, sf: StreamFile) -> None:
        i = sf.slot
        if i < 0:
            return
        last = self.slots.pop()
        if last is not sf:
            self.slots[i] = last
            last.slot = i
        sf.slot = -1

    def add(self, sf: StreamFile) -> None:
        """A file opened elsewhere (Store.open_job) joins the cache."""
        if sf.fd >= 0:
            self._insert(sf)
            self.clock += 1
            sf.used = self.clock

    def use(self, sf: StreamFile) -> int:
        """The file's descriptor, opened again if the cache had closed it."""
        if sf.fd < 0:
            sf.reopen(self.root_fd)
            self.reopened += 1
        self._insert(sf)
        self.clock += 1
        sf.used = self.clock
        return sf.fd

    def forget(self, sf: StreamFile) -> None:
        self._remove(sf)

    def trim(self, target: int) -> None:
        """Close clean files until at most `target` are open, or until a
        bounded search finds no more closable ones."""
        excess = len(self.slots) - max(target, 0)
        if excess <= 0:
            return
        slots, rng = self.slots, self.rng
        with self.lock:
            for _ in range(4 * excess + 16):
                if excess <= 0 or not slots:
                    break
                best = None
                for _ in range(self.SAMPLE):
                    sf = slots[rng.randrange(len(slots))]
                    if sf.closable and (best is None or sf.used < best.used):
                        best = sf
                if best is None:
                    continue
                self._remove(best)
                best.close()
                self.evicted += 1
                excess -= 1


# -- durability -------------------------------------------------------------------

SYNCFS_MIN = 4  # dirty files on the root's file system from which one syncfs() replaces their fdatasync()s
PARALLEL_MIN = 4  # dirty files from which fdatasync()s run in parallel threads
SYNC_THREADS = 16


def _load_syncfs() -> Callable[[int], None] | None:
    """syncfs(2) (Python has no os.syncfs), or None where it is missing or,
    before Linux 5.8, does not report writeback errors."""
    import platform
    import re

    if platform.system() != "Linux":
        return None
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    if not m or (int(m.group(1)), int(m.group(2))) < (5, 8):
        return None
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        func = libc.syncfs
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int]
    func.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if func(fd) != 0:  # ctypes releases the GIL for the call
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return syncfs


class Syncer:
    """Makes files durable: syncfs() or fdatasync(), whichever is cheaper.

    syncfs(ROOT) flushes the whole file system that holds the root in one
    journal commit; since Linux 5.8 it reports any writeback error on that
    file system since its last call on the same descriptor, so an error is
    never lost even for a file whose descriptor was closed meanwhile. An
    error fails every file of the batch. Files on other file systems (a
    mount below the root), and batches of few files, are fdatasync()ed
    each, in parallel threads when there are several.

    syncfs also flushes what others wrote to that file system, so it is
    used only while it costs less than the fdatasync()s it replaces, as
    measured (moving averages); every PROBE-th batch that could use it does,
    so that its estimate follows the file system's load.
    """

    PROBE = 64
    PARALLEL_GAIN = 2.5  # fdatasync()s in parallel threads: 2.3-4x faster than one after another, measured

    def __init__(self, root_fd: int, use_syncfs: bool = True) -> None:
        self.root_fd = root_fd
        self.root_dev = os.fstat(root_fd).st_dev
        self.syncfs = _load_syncfs() if use_syncfs else None
        self.pool: ThreadPoolExecutor | None = None
        self.stats = {"syncfs": 0, "fdatasync": 0}
        self.per_file = 0.0005  # seconds per fdatasync() (a moving average)
        self.per_syncfs = 0.0005  # seconds per syncfs()
        self.skipped = 0

    def _prefer_syncfs(self, n: int) -> bool:
        if n < SYNCFS_MIN:
            return False
        instead = self.per_file * n / (self.PARALLEL_GAIN if n >= PARALLEL_MIN else 1)
        if self.per_syncfs <= instead:
            return True
        self.skipped += 1
        return self.skipped % self.PROBE == 0

    def sync(self, files: list[tuple[StreamFile, int]]) -> list[tuple[StreamFile, int, OSError | None]]:
        """(file, length, error) for each (file, length)."""
        out: list[tuple[StreamFile, int, OSError | None]] = []
        rest = files
        if self.syncfs is not None:
            mine = [f for f in files if f[0].dev == self.root_dev]
            if self._prefer_syncfs(len(mine)):
                err: OSError | None = None
                started = time.monotonic()
                try:
                    self.syncfs(self.root_fd)
                    self.stats["syncfs"] += 1
                except OSError as e:
                    if e.errno in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL):
                        self.syncfs = None  # not allowed here (seccomp, odd file system): fdatasync from now on
                        return self.sync(files)
                    err = e
                self.per_syncfs += (time.monotonic() - started - self.per_syncfs) / 4
                out = [(sf, n, err) for sf, n in mine]
                rest = [f for f in files if f[0].dev != self.root_dev]
        if rest:
            started = time.monotonic()
            if len(rest) >= PARALLEL_MIN:
                if self.pool is None:
                    self.pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="gcshadow-sync")
                out.extend(self.pool.map(_fdatasync, rest))
                took = (time.monotonic() - started) * self.PARALLEL_GAIN / len(rest)
            else:
                out.extend(_fdatasync(f) for f in rest)
                took = (time.monotonic() - started) / len(rest)
            self.per_file += (took - self.per_file) / 16
            self.stats["fdatasync"] += len(rest)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def _fdatasync(item: tuple[StreamFile, int]) -> tuple[StreamFile, int, OSError | None]:
    sf, length = item
    try:
        os.fdatasync(sf.fd)
    except OSError as e:
        return sf, length, e
    return sf, length, None


class Store:
    """The shadow's state and files. One instance per root.

    Called from worker threads: one opens jobs and records their state, the
    other makes bytes durable. `db_lock` keeps their transactions apart on
    the one state connection; each holds it only for its own transaction."""

    def __init__(self, root: Path, *, use_syncfs: bool = True) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.lock_fd = lock_root(root)
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.db = open_state(root)
        self.db_lock = threading.Lock()
        self.syncer = Syncer(self.root_fd, use_syncfs)
        self.last_seen: dict[str, float] = {}  # job -> when its last_seen was last stamped (record_durable)

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
        codes: Any,
        tenant: str = "",
    ) -> JobFiles:
        """Claim or resume a job's files. A new instance (attempt) of a job
        starts its files afresh; a known one resumes at the durable lengths.
        With a `tenant` (an identity), the job's names are under ROOT/tenant/
        and the job id is that identity's: another identity's is refused."""
        with self.db_lock:
            return self._open_job(job_id, instance, list(streams), host, user, command, peer, codes, tenant)

    def owner(self, job_id: str) -> str | None:
        """The identity a job belongs to ("" on a shadow without identities), or None if it is new."""
        with self.db_lock:
            row = self.db.execute("SELECT owner FROM jobs WHERE job_id = ?", [job_id]).fetchone()
        return None if row is None else str(row[0])

    def _open_job(
        self, job_id: str, instance: str, streams: list[StreamSpec], host: str, user: str, command: list[str],
        peer: str, codes: Any, tenant: str = "",
    ) -> JobFiles:
        db = self.db
        now = time.time()
        row = db.execute("SELECT instance, session, state, owner FROM jobs WHERE job_id = ?", [job_id]).fetchone()
        if row is not None and row[3] != tenant:
            if not row[3]:
                raise StoreError(codes.AUTH_FAILED, f"job {job_id} was streamed here before this shadow had "
                                                    "identities: give the job another id")
            raise StoreError(codes.AUTH_FAILED, f"job {job_id} belongs to another identity")
        seen = db.execute(
            "SELECT 1 FROM instances WHERE job_id = ? AND instance = ?", [job_id, instance]
        ).fetchone()
        fresh = row is None or row[0] != instance
        if fresh and seen:
            raise StoreError(codes.STALE_ATTEMPT, f"job {job_id}: a newer attempt has replaced attempt {instance}")
        if not fresh and row[2] == "finished":
            pass  # resending EXIT after a lost DONE: welcome it, the lengths will match
        named = self._names(job_id, streams, tenant, codes)
        # Every file is opened (and refused) before any is cut back or
        # recorded: nothing is written for a refused job, and files it made
        # are removed again.
        made: list[str] = []
        fds: list[int] = []
        try:
            for spec, norm in named:
                fds.append(self._open_fd(spec, norm, codes, made))
        except BaseException:
            for fd in fds:
                os.close(fd)
            self._unmake(made)
            raise
        files = JobFiles(job_id, instance, session=(row[1] if row else 0) + 1)
        try:
            with transaction(db.conn):
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
                    (spec, norm), fd = named.pop(0), fds.pop(0)
                    self._open_stream(files, spec, norm, fd, fresh, codes)
        except BaseException:
            for fd in fds:
                os.close(fd)
            files.close()
            self._unmake(made)
            raise
        return files

    def _names(self, job_id: str, streams: list[StreamSpec], tenant: str, codes: Any) -> list[tuple[StreamSpec, str]]:
        """Each stream with its name under the root, refusing names that
        escape it, two outputs of one name, and outputs another active job holds."""
        names: dict[str, int] = {}
        named: list[tuple[StreamSpec, str]] = []
        for spec in streams:
            try:
                norm = "/".join(split_name(spec.name))
            except NameError_ as e:
                raise StoreError(codes.PATH_FORBIDDEN, str(e)) from None
            if tenant:  # the identity's part of the root: opened from the root, one directory at a time
                norm = f"{tenant}/{norm}"
            named.append((spec, norm))
            if spec.kind != "stdin":
                if norm in names:
                    raise StoreError(codes.PATH_FORBIDDEN, f"two streams of the job name {norm!r}")
                names[norm] = spec.id
                owner = self.db.execute(
                    """SELECT s.job_id FROM streams s JOIN jobs j USING (job_id)
                       WHERE s.name = ? AND s.kind != 'stdin' AND s.job_id != ? AND j.state != 'finished'""",
                    [norm, job_id],
                ).fetchone()
                if owner:
                    raise StoreError(codes.PATH_OWNED, f"{norm!r} belongs to job {owner[0]}, which is still active")
        return named

    def _open_fd(self, spec: StreamSpec, norm: str, codes: Any, made: list[str]) -> int:
        try:
            return open_confined(self.root_fd, norm, write=spec.kind != "stdin", made=made)
        except NameError_ as e:
            raise StoreError(codes.PATH_FORBIDDEN, str(e)) from None
        except FileNotFoundError:
            raise StoreError(codes.NOT_FOUND, f"stdin file {norm!r} does not exist at the shadow") from None
        except OSError as e:
            raise StoreError(codes.IO_ERROR, f"cannot open {norm!r}: {e.strerror}") from None

    def _unmake(self, made: list[str]) -> None:
        """Remove the (still empty) files a refused job made."""
        for name in made:
            parts = split_name(name)
            try:
                dfd = _open_dir(self.root_fd, parts[:-1], create=False)
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

    def _open_stream(self, files: JobFiles, spec: StreamSpec, norm: str, fd: int, fresh: bool, codes: Any) -> None:
        db = self.db
        if spec.kind == "stdin":
            files.stdin = StreamFile(files.job_id, spec.id, norm, fd, 0, 0, write=False, session=files.session)
            files.stdin.identify()
            files.stdin_stream = spec.id
            db.execute(
                "INSERT OR REPLACE INTO streams (job_id, stream, kind, name, durable) VALUES (?, ?, ?, ?, 0)",
                [files.job_id, spec.id, spec.kind, norm],
            )
            return
        try:
            if fresh:
                os.ftruncate(fd, 0)
                os.fsync(fd)
                durable = wire = 0
                db.execute(
                    "INSERT INTO streams (job_id, stream, kind, name, durable, wire) VALUES (?, ?, ?, ?, 0, 0)",
                    [files.job_id, spec.id, spec.kind, norm],
                )
            else:
                row = db.execute(
                    "SELECT durable, name, wire FROM streams WHERE job_id = ? AND stream = ?", [files.job_id, spec.id]
                ).fetchone()
                if row is None or row[1] != norm:
                    raise StoreError(codes.UNEXPECTED, f"job {files.job_id} resumed with different streams")
                durable, wire = row[0], row[2] or 0
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
        sf = StreamFile(files.job_id, spec.id, norm, fd, durable, durable, session=files.session, wire=wire)
        sf.identify()
        files.outputs[spec.id] = sf

    def make_durable(
        self, files: list[tuple[StreamFile, int]]
    ) -> tuple[list[tuple[StreamFile, int, OSError | None]], str]:
        """Sync the files up to their lengths, then commit the lengths of the
        ones that synced: (file, length, error) for each, and why the commit
        failed ("" if it did not). Only a length with no error, and no commit
        failure, may be acknowledged. A file whose session no longer holds
        its job gets `Superseded`: its length is not recorded."""
        results = self.syncer.sync(files)
        good = [(sf.job_id, sf.stream, n, sf.session, sf.wire) for sf, n, err in results if err is None]
        if good:
            try:
                stale = self.record_durable(good)
            except Exception as e:  # noqa: BLE001 - the state disk failed: acknowledge nothing
                failed = OSError(errno.EIO, f"cannot record durable lengths in the state database: {e}")
                return [(sf, n, err or failed) for sf, n, err in results], str(e) or type(e).__name__
            if stale:
                results = [(sf, n, Superseded(sf.job_id) if err is None and (sf.job_id, sf.stream) in stale else err)
                           for sf, n, err in results]
        return results, ""

    _RECORD_DURABLE = (
        "UPDATE streams SET durable = max(durable, ?), wire = max(coalesce(wire, 0), ?) WHERE job_id = ? AND stream = ? "
        "AND (SELECT session FROM jobs WHERE jobs.job_id = streams.job_id) = ?"
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
        with self.db_lock, transaction(self.db.conn):
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

    def record_state(self, job_id: str, *, if_session: int | None = None, **fields: Any) -> bool:
        """Update a job's row; with `if_session`, only while that session
        holds the job. Whether a row was updated."""
        if "summary" in fields:
            fields["summary"] = json.dumps(fields["summary"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        args: list[object] = [job_id]
        where = "job_id = ?"
        if if_session is not None:
            where, args = "job_id = ? AND session = ?", [job_id, if_session]
        with self.db_lock, transaction(self.db.conn):
            cur = self.db.execute(f"UPDATE jobs SET {sets} WHERE {where}", [*fields.values(), *args])
            return cur.rowcount > 0

    def mark_disconnected(self) -> None:
        """At start-up: no job is connected to a shadow that just started."""
        with self.db_lock, transaction(self.db.conn):
            self.db.execute("UPDATE jobs SET state = 'disconnected' WHERE state = 'streaming'")


def sync_files(files: list[tuple[StreamFile, int]]) -> list[tuple[StreamFile, int, OSError | None]]:
    """fdatasync each file; returns (file, length, error) for each."""
    return [_fdatasync(f) for f in files]


def list_jobs(root: Path) -> list[dict[str, Any]]:
    """Every job the shadow at `root` knows, with its streams (for `gcshadow jobs`)."""
    db = open_state(root, readonly=True)
    try:
        jobs = [dict(zip([d[0] for d in cur.description], r)) for cur in [db.execute("SELECT * FROM jobs ORDER BY first_seen")] for r in cur.fetchall()]
        for job in jobs:
            job["streams"] = [
                {"stream": s, "kind": k, "name": n, "durable": d, "wire": w}
                for s, k, n, d, w in db.execute(
                    "SELECT stream, kind, name, durable, wire FROM streams WHERE job_id = ? ORDER BY stream",
                    [job["job_id"]]
                ).fetchall()
            ]
            job["command"] = json.loads(job["command"] or "[]")
            job["summary"] = json.loads(job["summary"] or "{}")
        return jobs
    finally:
        db.conn.close()

