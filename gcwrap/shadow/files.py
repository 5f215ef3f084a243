"""The shadow's files: the root, confinement under it, the job's files.

Every name a job writes or reads is opened under the root one directory at a
time, never following a link (`open_confined`), and checked on each reopen
to be the same file. Descriptors are bounded (`FileCache`): a connected
job's files are closed when they are clean and others need the
descriptors, and opened again when next used. `Syncer` makes a batch of
dirty files durable: one syncfs() of the root's file system when several
are dirty and that is cheaper, fdatasync() of each otherwise.

Synchronous code, called from the shadow's worker threads or inline (small
pwrite/pread calls on files already open).
"""

from __future__ import annotations

import enum
import errno
import fcntl
import os
import random
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..ranks import Rank, ranked
from ..wire.names import STATE_DIR, NameError_, split_name


class Problem(enum.Enum):
    """What storage refuses or cannot do, in its own terms (the server says
    it to the agent with a wire code of its choosing)."""

    ROOT = "the root cannot be used"
    FORBIDDEN_NAME = "a name escapes the root, or is not a plain file"
    NAME_IN_USE = "another active job holds the name"
    MISSING = "a file to read is not there"
    IO = "an I/O error"
    CHANGED_AT_HOME = "a file was removed, replaced or shortened at home"
    NOT_OWNER = "the job belongs to another identity"
    STALE_ATTEMPT = "a newer attempt of the job replaced this one"
    OTHER_STREAMS = "the job resumed with different streams"
    HELD = "another shadow's session still holds the job's files"
    STATE = "the shadow cannot reach its state database"


@ranked(Rank.LOCAL)
class StoreError(Exception):
    """A refusal or failure of the shadow's storage, and its `problem`."""

    def __init__(self, problem: Problem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


class StateUnavailable(StoreError):
    """The state database cannot be reached, or failed: nothing recorded
    (or, for a write, nothing known of whether it was). Retryable: agents
    are told BUSY and come back."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(Problem.STATE, message)
        self.reason = reason or message  # what failed, in a few words


def check_root(root: Path) -> None:
    """Make sure the shadow can work under `root` (creating it if missing),
    before anything listens; StoreError naming the path and what is wrong
    with it otherwise."""
    try:
        st: os.stat_result | None = os.stat(root)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise StoreError(Problem.ROOT, f"cannot reach the root {root}: {_why_not(e, root)}") from None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise StoreError(Problem.ROOT, f"the root {root} is not a directory")
    else:
        try:
            root.mkdir(parents=True)
        except OSError as e:
            raise StoreError(Problem.ROOT, f"cannot create the root {root}: {_why_not(e, root)}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        if os.access(root, os.F_OK) and _read_only(root):
            raise StoreError(Problem.ROOT, f"the root {root} is on a read-only file system")
        if os.geteuid() == 0:
            raise StoreError(Problem.ROOT,
                             f"the root {root} is not writable, not even by root (a special file system?)")
        raise StoreError(Problem.ROOT, f"the root {root} is not writable by this user ({_user()})")
    # Root may write where permissions say no, and some file systems (/proc,
    # /sys) refuse all the same: try for real what serving needs.
    probe = root / f".gcshadow-probe-{os.getpid()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
    except OSError as e:
        raise StoreError(Problem.ROOT, f"cannot create files in the root {root}: {e.strerror}") from None
    state = root / STATE_DIR
    try:
        state.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise StoreError(Problem.ROOT, f"cannot create the shadow's state directory {state}: {e.strerror}") from None


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


def lock_root(root: Path, *, shared: bool = False) -> int:
    """One shadow per root (an exclusive flock held for the shadow's life),
    or, with `shared` (several shadows keeping their state in one shared
    database), a shared one: a shadow of the other kind is refused."""
    path = root / STATE_DIR / "lock"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        if shared:
            raise StoreError(Problem.ROOT, f"a gcshadow with the embedded state is serving {root}: "
                                           "shadows with a shared --state cannot serve it beside that one") from None
        raise StoreError(Problem.ROOT, f"another gcshadow is already serving {root}") from None
    if not shared:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    return fd


ROOT_STATE = "state-of-root"  # under STATE_DIR: which state the root belongs to


def claim_root(root: Path, state_id: str, shown: str) -> None:
    """Record which state the root's files belong to (`state_id`: "sqlite",
    or "postgresql <the database's id>"), or refuse a root that belongs to
    another: a durable length is only true of the files it was recorded for.
    `shown` names the state in the message (never with a password). A root
    without the record that has an embedded state database belongs to it."""
    path = root / STATE_DIR / ROOT_STATE
    try:
        recorded = path.read_text().split("\n")[0]
    except FileNotFoundError:
        recorded = "sqlite" if (root / STATE_DIR / "state.db").exists() else ""
    except OSError as e:
        raise StoreError(Problem.ROOT, f"cannot read {path}: {e.strerror}") from None
    if recorded and recorded != state_id:
        theirs = "the embedded state (ROOT/.gcshadow/state.db)" if recorded == "sqlite" else (
            "another shared state database" if state_id != "sqlite" else f"a shared state database ({recorded})")
        raise StoreError(Problem.ROOT, f"{root} belongs to {theirs}, not to {shown}: "
                                       "serve it with the state it was served with")
    if not recorded or not path.exists():
        tmp = path.with_name(f"{ROOT_STATE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(f"{state_id}\n")
            tmp.replace(path)
        except OSError as e:
            raise StoreError(Problem.ROOT, f"cannot write {path}: {e.strerror}") from None


ROOT_ID = "root-id"  # under STATE_DIR: the root's identity, made once (`root_identity`)


def root_identity(root: Path) -> str:
    """The root's identity: a random id made by the first shadow that serves
    it, the same for every shadow that mounts it, wherever (a path is not an
    identity: one file system may be mounted at several)."""
    path = root / STATE_DIR / ROOT_ID
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        made = path.read_text().strip()
    except FileNotFoundError:
        made = ""
    except OSError as e:
        raise StoreError(Problem.ROOT, f"cannot read {path}: {e.strerror}") from None
    if made:
        return made
    tmp = path.with_name(f"{ROOT_ID}.{os.getpid()}.tmp")
    try:
        tmp.write_text(os.urandom(16).hex() + "\n")
        try:
            os.link(tmp, path)  # (two shadows starting at once: one id wins, both read it)
        except FileExistsError:
            pass
        tmp.unlink()
        return path.read_text().strip()
    except OSError as e:
        raise StoreError(Problem.ROOT, f"cannot write {path}: {e.strerror}") from None


_OFD_LOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid


def lock_file(fd: int) -> bool:
    """Take an exclusive lock on the whole file, held by this open file
    description until its last descriptor is closed (an OFD lock: it
    conflicts with another description's lock in this process too, the
    kernel drops it when the process dies, and NFS, Lustre and CephFS honour
    it across machines). False if another description holds one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _OFD_LOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


# -- confined file access -------------------------------------------------------


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir(root_fd: int, parts: tuple[str, ...], create: bool, made: list[str] | None = None) -> int:
    """A new descriptor of the directory `parts` under the root, one
    directory at a time, never through a link; with `create`, the missing
    ones are made (a directory is made only where opening it found nothing:
    the common case, a directory that exists, costs one open per part), and
    their names appended to `made`."""
    if not parts:
        return os.dup(root_fd)
    fd = root_fd
    try:
        for i, part in enumerate(parts):
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if made is not None:
                        made.append("/".join(parts[: i + 1]))
                except FileExistsError:
                    pass
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = nfd
    except OSError:
        if fd != root_fd:
            os.close(fd)
        raise
    return fd


def open_confined(root_fd: int, name: str, *, write: bool, create: bool = True, made: list[str] | None = None,
                  stats: list[os.stat_result] | None = None) -> int:
    """Open NAME under the root without following any symlink; only regular
    files with one link (a hard link made in the root could lead to any file
    of the file system, or to another identity's). With `write` and
    `create`, missing directories and the file are made (their names
    appended to `made`). The file's fstat is appended to `stats`. Raises
    NameError_ for a refused name, OSError for I/O failures."""
    parts = split_name(name)
    make = write and create
    try:
        # (a name at the top of the root is opened from the root's own descriptor)
        dfd = open_dir(root_fd, parts[:-1], create=make, made=made) if len(parts) > 1 else root_fd
    except NotADirectoryError:
        raise NameError_(f"{name!r}: a parent is not a directory") from None
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
        if dfd != root_fd:
            os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NameError_(f"{name!r} is not a regular file")
    if st.st_nlink > 1:
        os.close(fd)
        raise NameError_(f"{name!r} has {st.st_nlink} links (hard links lead to other files): refused, as a symlink is")
    # Blocking again: of the status flags F_SETFL sets, the file was opened with O_NONBLOCK alone.
    fcntl.fcntl(fd, fcntl.F_SETFL, 0)
    if stats is not None:
        stats.append(st)
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
    synced: int = -1  # bytes a sync covered (recorded or not: a record's outcome may be unknown); -1: `durable`
    write: bool = True  # an output; False: the job's stdin, read only
    session: int = 0  # the session that opened it: only while it holds the job are its lengths recorded
    dev: int = 0  # the file's identity when first opened: a reopened file must be the same
    ino: int = 0
    pins: int = 0  # syncs and stdin reads in flight that use `fd`: it must not be closed (its number reused)
    orphaned: bool = False  # its session let go of it while pinned: the last `unpin` closes it
    sync_failed: bool = False  # a sync reported an error: nothing more of it may be called durable
    cut_back: bool = False  # the shadow has cut it back to `durable` after that error
    wire: int = 0  # bytes of its frames' payloads received (compressed or not), in every session
    locked: bool = False  # holds the file's lock (lock_file): kept open until its session closes it
    # Directories (under the root, "" for the root) holding entries this
    # shadow made for the file (its name, directories on its path), not yet
    # synced: a file's fdatasync() does not make its name durable (POSIX),
    # so none of its bytes is durable before they are (Syncer.sync).
    new_entries: tuple[str, ...] = ()
    partial: bool = False  # holds bytes past `written` of a DATA frame not yet whole

    def __post_init__(self) -> None:
        if self.synced < 0:
            self.synced = self.durable

    def identify(self) -> None:
        st = os.fstat(self.fd)
        self.dev, self.ino = st.st_dev, st.st_ino

    @property
    def closable(self) -> bool:
        """Open, clean (everything written is durable, no frame half
        written) and not being synced."""
        return self.fd >= 0 and not self.pins and self.written == self.durable and not self.locked and not self.partial

    def reopen(self, root_fd: int) -> None:
        """Open the file again after the cache closed it: confined as the
        first time, never created, and it must be the same file, at least as
        long as what was written. StoreError if not; OSError on I/O errors."""
        try:
            fd = open_confined(root_fd, self.name, write=self.write, create=False)
        except NameError_ as e:
            raise StoreError(Problem.FORBIDDEN_NAME, str(e)) from None
        except FileNotFoundError:
            raise StoreError(Problem.CHANGED_AT_HOME, f"{self.name!r} was removed at home while in use") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (self.dev, self.ino):
                raise StoreError(Problem.CHANGED_AT_HOME, f"{self.name!r} was replaced at home while in use")
            if self.write and st.st_size < self.written:
                raise StoreError(
                    Problem.CHANGED_AT_HOME,
                    f"{self.name!r} holds {st.st_size} bytes but {self.written} were written: "
                    "it was truncated at home while in use",
                )
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def unpin(self) -> None:
        """A sync or read that used `fd` is over (holding the cache's lock):
        the last one closes a file its session let go of meanwhile."""
        self.pins -= 1
        if not self.pins and self.orphaned:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def entry_dirs(name: str, made: list[str]) -> tuple[str, ...]:
    """The directories to sync for `name`'s entries that this open made
    (`made`: names made, files and directories): each made name's parent."""
    mine = [m for m in made if m == name or name.startswith(m + "/")]
    return tuple(sorted({m.rpartition("/")[0] for m in mine}))


@dataclass
class JobFiles:
    """The open files of one job's session at home: its outputs, its stdin, and the cuts its claim
    makes once committed."""

    job_id: str
    instance: str
    session: int
    outputs: dict[int, StreamFile] = field(default_factory=dict)
    stdin: StreamFile | None = None
    stdin_stream: int | None = None
    # Outputs to cut back once the claim is committed (file, its size when
    # opened): never before, as a claim whose commit fails must leave every
    # byte the state may still count on.
    cuts: list[tuple[StreamFile, int]] = field(default_factory=list)
    fresh: bool = False  # a new attempt: its outputs start afresh

    def cut_back(self) -> None:
        """Cut each output back to its durable length (a new attempt's to
        nothing, made durable): what lies beyond was never acknowledged."""
        while self.cuts:
            sf, size = self.cuts.pop()
            if self.fresh:
                if size:  # (a new, empty file has no old bytes whose removal must be durable)
                    os.ftruncate(sf.fd, 0)
                    os.fsync(sf.fd)
            elif size > sf.durable:
                os.ftruncate(sf.fd, sf.durable)  # a torn or unacknowledged tail: it will be resent

    def all(self) -> list[StreamFile]:
        return [*self.outputs.values(), *([self.stdin] if self.stdin is not None else [])]

    def close(self) -> None:
        """Close the files (holding the cache's lock): one that a sync or a
        read still uses (pinned) is closed by it when it is over (`unpin`)."""
        for sf in self.all():
            if sf.pins:
                sf.orphaned = True
            else:
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

    A file unused for a while is closed too, whatever the pressure
    (`close_idle`): an idle job costs the shadow its socket alone. A file
    written often stays open, so a steady writer does not reopen it for
    every frame; a slow one reopens it at most once per frame.
    """

    SAMPLE = 5

    def __init__(self, root_fd: int, lock: threading.Lock | None = None) -> None:
        self.root_fd = root_fd
        self.lock = lock or threading.Lock()  # held to check `closable` and close: pins change under it
        self.slots: list[StreamFile] = []  # the open files, in no order
        self.where: dict[StreamFile, int] = {}  # each one's index in `slots`
        self.used: dict[StreamFile, int] = {}  # ...and `clock` at its last use
        self.clock = 0
        self.at: dict[StreamFile, float] = {}  # ...and when (time.monotonic())
        self.reopened = 0
        self.evicted = 0
        self.rng = random.Random()

    def __len__(self) -> int:
        return len(self.slots)

    def _insert(self, sf: StreamFile) -> None:
        if sf not in self.where:
            self.where[sf] = len(self.slots)
            self.slots.append(sf)

    def _remove(self, sf: StreamFile) -> None:
        i = self.where.pop(sf, -1)
        if i < 0:
            return
        self.used.pop(sf, None)
        self.at.pop(sf, None)
        last = self.slots.pop()
        if last is not sf:
            self.slots[i] = last
            self.where[last] = i

    def add(self, sf: StreamFile) -> None:
        """A file opened elsewhere (Store.open_job) joins the cache."""
        if sf.fd >= 0:
            self._insert(sf)
            self._touch(sf)

    def use(self, sf: StreamFile) -> int:
        """The file's descriptor, opened again if the cache had closed it
        (confined and checked to be the same file: `StreamFile.reopen`)."""
        if sf.fd < 0:
            sf.reopen(self.root_fd)
            self.reopened += 1
        self._insert(sf)
        self._touch(sf)
        return sf.fd

    def _touch(self, sf: StreamFile) -> None:
        self.clock += 1
        self.used[sf] = self.clock
        self.at[sf] = time.monotonic()

    def close_idle(self, now: float, idle: float) -> int:
        """Close the closable files (clean, unpinned) unused since `now -
        idle` (time.monotonic()); how many were closed. A file made clean later than its last
        use is closed at the next call after it is."""
        before = now - idle
        closed = 0
        with self.lock:
            for sf in [sf for sf, t in self.at.items() if t < before]:
                if sf.closable:
                    self._remove(sf)
                    sf.close()
                    closed += 1
        self.evicted += closed
        return closed

    def forget(self, sf: StreamFile) -> None:
        self._remove(sf)

    def trim(self, target: int) -> None:
        """Close clean files until at most `target` are open, or until a
        bounded search finds no more closable ones."""
        excess = len(self.slots) - max(target, 0)
        if excess <= 0:
            return
        slots, used, rng = self.slots, self.used, self.rng
        with self.lock:
            for _ in range(4 * excess + 16):
                if excess <= 0 or not slots:
                    break
                best = None
                for _ in range(self.SAMPLE):
                    sf = slots[rng.randrange(len(slots))]
                    if sf.closable and (best is None or used[sf] < used[best]):
                        best = sf
                if best is None:
                    continue
                self._remove(best)
                best.close()
                self.evicted += 1
                excess -= 1
