"""The files a job writes, at home: one session's versions of them ("files" feature).

A file handle of the job's run names one NAME (checked as a stream's NAME
is). Its content arrives as versions (FILE_OPEN), each an append-only byte
sequence like a stream's (FILE_DATA, or FILE_COPY from the version home
holds committed: its base), that ends in a commit (FILE_COMMIT: its size
and SHA-256).

Where a version's bytes go: the first version of a handle (no base, nothing
committed) is written in place, into NAME, tail-able while the job runs.
Any other is staged beside NAME, `.<basename>.gcwrap-<file>-<version>` (the
same directory: the rename is atomic), until its commit. A newer version
abandons one not committed (its staging file is removed).

Durable, then acknowledged, in groups (gcwrap.shadow.filesession): the versions
written to are synced (fdatasync; their directory once, for the entry
made), their lengths recorded in the state (`fileversions`, fenced by the
session), then FILE_ACK. A group is what arrived while the last one was
made durable; the reads go on meanwhile, as the streams' do
(gcwrap.shadow.durability): a sync per read held the session's reads up
for as long as the sync took. Groups, commits and the EXIT take turns
(`SessionFiles.lock`). A commit is checked (every byte durable, the SHA-256 of the
version's bytes), recorded, then made NAME's content (a staged version:
renamed over NAME, the directory synced), then acknowledged. A commit
recorded whose rename a crash prevented is completed when the job's next
session loads its files (`SessionFiles.load`): the staging file of a
committed version is renamed over NAME then; staging files of abandoned
versions are removed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio

from ..sync import Signal
from ..wire.codec import ProtocolError
from ..wire.events import ErrorCode, Event, FileAck, FileCommit, FileCopy, FileData, FileHeld, FileOpen
from ..wire.names import NameError_, split_name, staged_like
from . import fileversions
from .admission import Refused
from .backends import StateBackend
from .files import Problem, StoreError, lock_file, open_confined, open_dir
from .pacing import GroupOptions, Pacing

FILE_EVENTS = (FileOpen, FileData, FileCopy, FileCommit)
_CHUNK = 1 << 20
OPEN_PER_SESSION = 8  # a session's files kept open (a job may write thousands): `SessionFiles.trim`


Said = Callable[..., None]  # (kind, **details): an event of the job's timeline
COMMITS_SAID_EVERY = 60.0  # seconds: a file's commits said in the timeline at most this often (its last always)


def _unsaid(kind: str, **details: Any) -> None:
    pass


async def _no_wait(n: int) -> None:
    pass


class OpenFiles:
    """The versions' files open in every session, for the shadow's
    descriptor budget (`descriptors.Descriptors`): `freed` is called when one closes.
    Shared by every session: it also counts, for the metrics, the FILE_DATA
    frames taken and the bytes they added, and the bytes made durable."""

    def __init__(self, freed: Callable[[], None] = lambda: None) -> None:
        self.count = 0
        self.freed = freed
        self.frames = self.received = self.durable = 0


class Fencing(Exception):
    """A record of the session's versions was refused: a newer session holds the job."""


@dataclass(eq=False)
class Version:
    """One version of a file, as this session holds it."""

    file: int
    name: str  # NAME under the root
    version: int
    base: int | None
    staged: bool  # its bytes are in the staging file, not yet NAME's
    written: int = 0
    durable: int = 0
    acked: int = -1  # what FILE_ACK said last
    committed: int = -1
    sha256: str | None = None
    fd: int = -1
    dev: int = 0  # the file's identity, once opened: opened again, it must be the same file
    ino: int = 0
    entry_synced: bool = True  # False: its file's directory entry was made and is not yet durable
    # The SHA-256 of its first `hashed` bytes, kept up as FILE_DATA appends
    # (None: not known, read back at the commit): a commit reads back only
    # what was not hashed as it came (FILE_COPY's bytes, a resumed version's).
    hasher: Any = None
    hashed: int = 0
    used: int = 0  # when last written to (`SessionFiles.trim`)
    pins: int = 0  # groups syncing its descriptor now: it is not closed under them (`flush`)
    doomed: bool = False  # abandoned while pinned: closed once the last group lets go

    @property
    def path(self) -> str:
        """Where its bytes are: NAME, or its staging file."""
        return staging_name(self.name, self.file, self.version) if self.staged else self.name


def staging_name(name: str, file: int, version: int) -> str:
    """A staged version's file, beside NAME."""
    head, _, base = name.rpartition("/")
    return f"{head}/" * bool(head) + f".{base}.gcwrap-{file}-{version}"


class FileNotes:
    """What the job's timeline is told of its files: refusals, and commits,
    those of a busy file thinned out (`commit`)."""

    def __init__(self, said: Said) -> None:
        self.said = said  # an event for the job's timeline (the shadow's `EventLog.event`)
        self.told: dict[int, tuple[int, float, int]] = {}  # handle -> (version, when) last said committed, skipped

    def commit(self, v: Version, size: int, final: bool = False) -> None:
        """A version's commit, for the job's timeline: its first, at most
        one a file every COMMITS_SAID_EVERY seconds (those between counted
        as `skipped`), and at the job's end (`final`) the one not said yet."""
        version, at, skipped = self.told.get(v.file, (0, -COMMITS_SAID_EVERY, 0))
        now = time.monotonic()
        if version == v.version or (not final and now - at < COMMITS_SAID_EVERY):
            if version != v.version:
                self.told[v.file] = (version, at, skipped + 1)
            return
        self.told[v.file] = (v.version, now, 0)
        self.said("file_committed", file=v.file, name=v.name, version=v.version, size=size,
                  sha256=(v.sha256 or "")[:16], skipped=skipped or None)


class SessionFiles:
    """The versions of the files a job writes, for one session of it.

    Blocking methods (`load`, `sync_and_record`, `digest`, `commit_file`)
    run in worker threads; the others in the event loop, between frames."""

    def __init__(self, store: StateBackend, job_id: str, instance: str, session: int, tenant: str,
                 stream_names: Iterable[str], *, quota: int = 0, streams: Callable[[], int] = lambda: 0,
                 said: Said | None = None, open_files: OpenFiles | None = None,
                 room: Callable[[int], Awaitable[None]] = _no_wait, grouping: GroupOptions | None = None) -> None:
        self.store = store
        self.notes = FileNotes(said or _unsaid)  # what the job's timeline is told of its files
        self.open_files = open_files or OpenFiles()  # (the shadow's, shared by its sessions)
        self.room = room  # waits until the shadow's descriptor budget has room for n more
        self.lock = trio.Lock()  # durable groups, commits and the EXIT's check take turns
        self.flushing = False  # a task makes groups durable (`keep_durable`)
        # Groups under bulk output, as the streams' (pacing.py, on trio's clock), and a signal fired once the
        # next group is full.
        self.pacing = Pacing(grouping or GroupOptions())
        self.filled = Signal()
        self.quota = quota  # bytes the job may write at home, its streams' and its files' (0: no limit)
        self.streams = streams  # bytes its streams hold now
        self.job_id = job_id
        self.instance = instance
        self.session = session
        self.tenant = tenant
        self.stream_names = set(stream_names)
        self.names: dict[int, str] = {}  # handle -> NAME, fixed for the run
        self.current: dict[int, Version] = {}  # handle -> its newest version
        self.bases: dict[int, tuple[int, int]] = {}  # handle -> (version, bytes NAME holds of it) committed
        self.dirty: set[Version] = set()  # written to (or new) since the last record
        self.clock = 0  # counts uses of the versions (`Version.used`: `trim`)

    # -- a session's start ---------------------------------------------------------

    def load(self) -> tuple[FileHeld, ...]:
        """What home holds of the run's files (for WELCOME), the files made
        consistent with the state: a committed version's rename completed,
        abandoned staging files removed, torn tails cut back."""
        rows = self.store.read_files(self.job_id, self.instance)
        for row in rows:
            self.names[row.file] = row.name
            if row.committed >= 0:
                self.bases[row.file] = (row.version, row.durable)
        newest: dict[int, fileversions.VersionRow] = {r.file: r for r in rows}  # (ordered by file, version)
        for file, row in newest.items():
            staged = row.committed < 0 and (row.base is not None or file in self.bases)
            v = Version(file, row.name, row.version, row.base, staged, row.durable, row.durable, row.durable,
                        row.committed, row.sha256)
            self.current[file] = v
            try:
                if file in self.bases:
                    self._complete_rename(row.name, file, self.bases[file][0])
                self._remove_staging(row.name, file, keep=row.version if staged else 0)
                self._open(v, create=False)
            except FileNotFoundError:
                raise StoreError(Problem.CHANGED_AT_HOME, f"{v.path!r} was removed at home") from None
            except OSError as e:
                raise StoreError(Problem.IO, f"cannot open {v.path!r}: {e.strerror}") from None
            size = os.fstat(v.fd).st_size
            if size < v.durable:
                raise StoreError(Problem.CHANGED_AT_HOME, f"{v.path!r} holds {size} bytes but {v.durable} were "
                                                          "acknowledged: it was truncated or replaced at home")
            if size > v.durable:
                os.ftruncate(v.fd, v.durable)  # a torn or unacknowledged tail: it will be resent
            self._close(v)  # (opened again when the agent writes to it: a descriptor per file written, not held)
        return fileversions.held(rows)

    def _dir(self, name: str) -> tuple[int, str]:
        """A descriptor of NAME's directory, and NAME's last component."""
        parts = split_name(name)
        return open_dir(self.root_fd, parts[:-1], create=False), parts[-1]

    @property
    def root_fd(self) -> int:
        return self.store.root_fd

    def _complete_rename(self, name: str, file: int, version: int) -> None:
        """A committed version whose staging file is still there: a crash came
        between the commit's record and its rename. Complete it."""
        dfd, base = self._dir(name)
        try:
            staged = staging_name(base, file, version)
            try:
                os.rename(staged, base, src_dir_fd=dfd, dst_dir_fd=dfd)
            except FileNotFoundError:
                return
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _remove_staging(self, name: str, file: int, keep: int) -> None:
        """Remove the staging files of the handle's versions other than `keep`."""
        dfd, base = self._dir(name)
        try:
            prefix = f".{base}.gcwrap-{file}-"
            gone = [e for e in os.listdir(dfd) if e.startswith(prefix) and e != f"{prefix}{keep}"]
            for entry in gone:
                os.unlink(entry, dir_fd=dfd)
            if gone:
                os.fsync(dfd)
        finally:
            os.close(dfd)

    def _open(self, v: Version, *, create: bool) -> None:
        made: list[str] = []
        try:
            v.fd = open_confined(self.root_fd, v.path, write=True, create=create, made=made)
        except NameError_ as e:
            raise StoreError(Problem.FORBIDDEN_NAME, str(e)) from None
        self.open_files.count += 1
        if made:
            v.entry_synced = False
        if self.store.shared and not lock_file(v.fd):  # (as a stream's file is: `pgstate`)
            self._close(v)
            raise StoreError(Problem.HELD, f"job {self.job_id}: another shadow's session still has {v.path!r} open; "
                                           "it was told to let go of it: come back shortly")
        st = os.fstat(v.fd)
        if v.ino and (st.st_dev, st.st_ino) != (v.dev, v.ino):
            self._close(v)
            raise StoreError(Problem.CHANGED_AT_HOME, f"{v.path!r} was replaced at home while in use")
        v.dev, v.ino = st.st_dev, st.st_ino

    def _close(self, v: Version) -> None:
        """Close the version's file, unless a group syncs it now (then the group's end does)."""
        if v.fd < 0:
            return
        if v.pins:
            v.doomed = True
            return
        os.close(v.fd)
        v.fd = -1
        v.doomed = False
        self.open_files.count -= 1
        self.open_files.freed()

    def fds_wanted(self, ev: Event) -> int:
        """Descriptors the frame may open that the budget does not hold yet (`room`)."""
        if isinstance(ev, FileOpen):
            return 1
        v = self.current.get(getattr(ev, "file", 0))
        return 1 if v is not None and v.fd < 0 else 0

    def _reopen(self, v: Version) -> None:
        """The version's file, opened again (never made): the same file, as long as what was written."""
        try:
            self._open(v, create=False)
        except FileNotFoundError:
            raise StoreError(Problem.CHANGED_AT_HOME, f"{v.path!r} was removed at home") from None
        except OSError as e:
            raise StoreError(Problem.IO, f"cannot open {v.path!r}: {e.strerror}") from None
        if os.fstat(v.fd).st_size < v.written:
            raise StoreError(Problem.CHANGED_AT_HOME, f"{v.path!r} was truncated at home while in use")

    # -- frames ------------------------------------------------------------------------

    def opened(self, ev: FileOpen) -> None:
        """FILE_OPEN: a new version (or the one in progress, again after a reconnection)."""
        norm = self.name_of(ev)
        cur = self.current.get(ev.file)
        if cur is not None and cur.version == ev.version:
            if cur.base != ev.base:
                raise ProtocolError(f"version {ev.version} of file {ev.file} was opened with base {cur.base}",
                                    ErrorCode.UNEXPECTED)
            return
        if cur is not None and ev.version < cur.version:
            raise ProtocolError(f"file {ev.file}: version {ev.version} after version {cur.version}",
                                ErrorCode.UNEXPECTED)
        committed = self.bases.get(ev.file)
        if ev.base != (committed[0] if committed else None):
            holds = f"version {committed[0]}" if committed else "no version"
            raise ProtocolError(f"file {ev.file}: base {ev.base}, but home holds {holds} of it committed",
                                ErrorCode.UNEXPECTED)
        v = Version(ev.file, norm, ev.version, ev.base, staged=committed is not None, hasher=hashlib.sha256())
        try:
            if cur is not None:
                self._abandon(cur)
            self._open(v, create=True)
            os.ftruncate(v.fd, 0)  # (a new version starts empty: whatever the file held was never this one's)
        except OSError as e:
            raise StoreError(Problem.IO, f"cannot open {v.path!r}: {e.strerror}") from None
        v.entry_synced = False
        self.names[ev.file] = norm
        self.current[ev.file] = v
        self.dirty.add(v)

    def name_of(self, ev: FileOpen) -> str:
        """The NAME under the root FILE_OPEN gives its handle, checked (StoreError, ProtocolError)."""
        try:
            norm = "/".join(split_name(ev.name))
        except NameError_ as e:
            raise StoreError(Problem.FORBIDDEN_NAME, str(e)) from None
        if staged_like(norm):
            raise StoreError(Problem.FORBIDDEN_NAME, f"{norm!r} is named as home names a version of a file it stages")
        if self.tenant:
            norm = f"{self.tenant}/{norm}"
        known = self.names.get(ev.file)
        if known is not None and known != norm:
            raise ProtocolError(f"file {ev.file} is {known!r}, not {norm!r}", ErrorCode.UNEXPECTED)
        if known is None and (norm in self.stream_names or norm in self.names.values()):
            raise StoreError(Problem.FORBIDDEN_NAME, f"two files or streams of the job name {norm!r}")
        return norm

    def _abandon(self, v: Version) -> None:
        """A newer version supersedes `v`: close it; a staged one's file goes."""
        self.dirty.discard(v)
        self._close(v)
        if v.staged and v.committed < 0:
            dfd, base = self._dir(v.name)
            try:
                os.unlink(staging_name(base, v.file, v.version), dir_fd=dfd)
            except FileNotFoundError:
                pass
            finally:
                os.close(dfd)

    def _version(self, file: int, version: int, what: str) -> Version:
        v = self.current.get(file)
        if v is None or v.version != version:
            raise ProtocolError(f"{what} for version {version} of file {file}, which is not the one open",
                                ErrorCode.UNEXPECTED)
        if v.fd < 0:
            self._reopen(v)
        self.clock += 1
        v.used = self.clock
        return v

    def _check_offset(self, v: Version, offset: int, what: str) -> None:
        if offset > v.written:
            raise ProtocolError(f"{what} at offset {offset} of {v.name!r} would leave a gap after byte {v.written}",
                                ErrorCode.OFFSET_GAP)

    def written(self) -> int:
        """Bytes the versions in progress hold (what the job's quota counts of its files)."""
        return sum(v.written for v in self.current.values())

    def _charge(self, v: Version, end: int) -> None:
        """Refuse bytes past the job's quota (QUOTA), its streams' bytes counted with its files'."""
        if self.quota and end > v.written and self.streams() + self.written() + end - v.written > self.quota:
            raise Refused(ErrorCode.QUOTA, f"job {self.job_id} would exceed its quota of {self.quota} bytes with "
                                           f"its file {v.name!r} ({end} bytes of it)")

    def data(self, ev: FileData) -> None:
        """FILE_DATA: appended at its offset, less what the version holds (a resend)."""
        v = self._version(ev.file, ev.version, "FILE_DATA")
        self._check_offset(v, ev.offset, "FILE_DATA")
        self._charge(v, ev.offset + len(ev.payload))
        skip = v.written - ev.offset
        if skip >= len(ev.payload):
            return
        view = new = memoryview(ev.payload)[max(skip, 0):]
        at = v.written
        try:
            while view:
                n = os.pwrite(v.fd, view, at)
                at += n
                view = view[n:]
        except OSError as e:
            raise StoreError(Problem.IO, f"cannot write {v.path!r}: {e.strerror}") from None
        if v.hasher is not None and v.hashed == v.written:
            v.hasher.update(new)
            v.hashed = at
        self._mark(at - v.written)
        self.open_files.frames += 1
        self.open_files.received += at - v.written
        v.written = at
        self.dirty.add(v)

    def copy(self, ev: FileCopy) -> None:
        """FILE_COPY: the base's bytes (NAME's), appended at the offset, less what the version holds."""
        v = self._version(ev.file, ev.version, "FILE_COPY")
        base = self.bases.get(ev.file)
        if v.base is None or base is None or base[0] != v.base:
            raise ProtocolError(f"FILE_COPY for version {v.version} of file {v.file}, which has no base",
                                ErrorCode.UNEXPECTED)
        if ev.source + ev.length > base[1]:
            raise ProtocolError(f"FILE_COPY of bytes {ev.source}..{ev.source + ev.length} of version {base[0]} "
                                f"of {v.name!r}, which has {base[1]}", ErrorCode.UNEXPECTED)
        self._check_offset(v, ev.offset, "FILE_COPY")
        self._charge(v, ev.offset + ev.length)
        skip = max(v.written - ev.offset, 0)
        if skip >= ev.length:
            return
        try:
            src = open_confined(self.root_fd, v.name, write=False)
        except (NameError_, OSError) as e:
            raise StoreError(Problem.CHANGED_AT_HOME, f"cannot read {v.name!r} to copy from it: {e}") from None
        try:
            _copy(src, v.fd, ev.source + skip, v.written, ev.length - skip)
        except OSError as e:
            raise StoreError(Problem.IO, f"cannot copy into {v.path!r}: {e.strerror}") from None
        finally:
            os.close(src)
        self._mark(ev.offset + ev.length - v.written)
        v.written = ev.offset + ev.length
        self.dirty.add(v)

    def _mark(self, n: int) -> None:
        if self.pacing.mark(n, trio.current_time()):
            self.filled.fire()

    async def fill(self) -> None:
        """Under bulk output, wait for the next group to fill (pacing.py)."""
        while (wait := self.pacing.wait(trio.current_time())) > 0:
            with trio.move_on_after(wait):
                await self.filled.wait()

    # -- durability ----------------------------------------------------------------------

    def trim(self, keep: int = OPEN_PER_SESSION) -> None:
        """Keep at most `keep` of the versions' files open: the least
        recently used of those all durable are closed (opened again when
        written to; a dirty one stays open until its sync). The shadow
        asks for none when its descriptor budget is short (`Descriptors.room`)."""
        opened = [v for v in self.current.values() if v.fd >= 0 and not v.doomed]
        if len(opened) <= keep:
            return
        clean = sorted((v for v in opened if v not in self.dirty and v.durable == v.written and not v.pins),
                       key=lambda v: v.used)
        for v in clean[: len(opened) - keep]:
            self._close(v)

    def take_dirty(self) -> list[tuple[Version, int]]:
        """The versions to make durable, each with its length now (in the event loop)."""
        taken = [(v, v.written) for v in self.dirty]
        self.dirty.clear()
        self.pacing.take(trio.current_time())
        return taken

    def pin(self, taken: list[tuple[Version, int]], by: int) -> None:
        """A group syncs these versions' descriptors (1), or is done with them (-1)."""
        for v, _ in taken:
            v.pins += by
            if v.doomed and not v.pins:
                self._close(v)

    def sync_and_record(self, taken: list[tuple[Version, int]], commit: tuple[Version, int, str] | None = None
                        ) -> None:
        """Sync the versions up to their lengths and record them (and a
        commit), fenced by the session (blocking: in a worker thread).
        Fencing if a newer session holds the job; StateUnavailable if the
        state failed (the record's outcome unknown: nothing is acknowledged)."""
        for v, _ in taken:
            try:
                os.fdatasync(v.fd)
                if not v.entry_synced:
                    dfd, _base = self._dir(v.path)
                    try:
                        os.fsync(dfd)
                    finally:
                        os.close(dfd)
                    v.entry_synced = True
            except OSError as e:
                raise StoreError(Problem.IO, f"cannot sync {v.path!r}: {e.strerror}") from None
        records = [self._record(v, n) for v, n in taken]
        if commit is not None:
            v, size, sha = commit
            records.append(self._record(v, max(size, v.durable), size, sha))
        if self.store.record_files(records):
            raise Fencing(f"a newer session holds job {self.job_id}")

    def _record(self, v: Version, durable: int, committed: int = -1, sha: str | None = None
                ) -> fileversions.VersionRecord:
        return fileversions.VersionRecord(self.job_id, self.session, self.instance, v.file, v.name, v.version,
                                          v.base, durable, committed, sha)

    def made_durable(self, taken: list[tuple[Version, int]]) -> list[Event]:
        """After `sync_and_record`: the lengths are durable; the FILE_ACKs due."""
        for v, n in taken:
            if n > v.durable:
                self.open_files.durable += n - v.durable
                v.durable = n
        acks: list[Event] = []
        for v, _ in taken:
            if v.durable > v.acked and self.current.get(v.file) is v:
                v.acked = v.durable
                acks.append(FileAck(v.file, v.version, v.durable))
        return acks

    # -- commits -------------------------------------------------------------------------

    def to_commit(self, ev: FileCommit) -> Version:
        """The version FILE_COMMIT commits, once every byte written is durable."""
        v = self._version(ev.file, ev.version, "FILE_COMMIT")
        if v.durable != ev.size or v.written != ev.size:
            raise ProtocolError(f"FILE_COMMIT says version {v.version} of {v.name!r} has {ev.size} bytes, "
                                f"home holds {v.written}", ErrorCode.LENGTH_MISMATCH)
        return v

    def digest(self, v: Version, size: int) -> str:
        """The SHA-256 of the version's first `size` bytes: what was hashed as
        it came, and the rest read back (blocking)."""
        try:
            fd = open_confined(self.root_fd, v.path, write=False)
        except (NameError_, OSError) as e:
            raise StoreError(Problem.CHANGED_AT_HOME, f"cannot read {v.path!r} back: {e}") from None
        try:
            if os.fstat(fd)[1:3] != os.fstat(v.fd)[1:3]:
                raise StoreError(Problem.CHANGED_AT_HOME, f"{v.path!r} was replaced at home while in use")
            known = v.hasher is not None and v.hashed <= size
            h = v.hasher.copy() if known else hashlib.sha256()
            at = v.hashed if known else 0
            while at < size:
                chunk = os.pread(fd, min(_CHUNK, size - at), at)
                if not chunk:
                    break
                h.update(chunk)
                at += len(chunk)
        finally:
            os.close(fd)
        if at == size and at <= v.written:  # (kept: the next commit of an appended version reads on from here)
            v.hasher, v.hashed = h.copy(), at
        return str(h.hexdigest())

    def commit_file(self, v: Version, size: int, sha: str) -> None:
        """Record the commit, then make NAME the version (blocking)."""
        self.sync_and_record([], (v, size, sha))
        if v.staged:
            dfd, base = self._dir(v.name)
            try:
                os.rename(staging_name(base, v.file, v.version), base, src_dir_fd=dfd, dst_dir_fd=dfd)
                os.fsync(dfd)
            except OSError as e:
                raise StoreError(Problem.IO, f"cannot rename the new version of {v.name!r} over it: "
                                             f"{e.strerror}") from None
            finally:
                os.close(dfd)
            v.staged = False
        v.committed, v.sha256 = size, sha
        self.bases[v.file] = (v.version, max(v.durable, size))

    def check_exit(self, files: Iterable[tuple[int, int, int]]) -> None:
        """EXIT's final versions: each committed at its size, or LENGTH_MISMATCH;
        then the commits of the final versions not said yet, said (in the event loop)."""
        for file, version, size in files:
            base = self.bases.get(file)
            v = self.current.get(file)
            if base is None or base[0] != version or v is None or v.version != version or v.committed != size:
                held = f"version {base[0]} at {v.committed if v else -1} bytes" if base else "nothing committed"
                raise ProtocolError(f"EXIT says file {file} is version {version} at {size} bytes, home holds "
                                    f"{held}", ErrorCode.LENGTH_MISMATCH)
        for file, (version, _) in self.bases.items():  # (each file's final version is in the timeline)
            if (v := self.current.get(file)) is not None and v.version == version:
                self.notes.commit(v, v.committed, final=True)

    def finish(self) -> None:
        """The job ended (its EXIT checked): staged versions never committed go (blocking)."""
        for v in self.current.values():
            if v.staged and v.committed < 0:
                self._abandon(v)

    def close(self) -> None:
        """The session is over (no group syncs any more: `keep_durable` ran in its nursery)."""
        for v in self.current.values():
            v.pins = 0
            self._close(v)
        self.dirty.clear()


def _copy(src: int, dst: int, at: int, to: int, length: int) -> None:
    """Copy `length` bytes of `src` at `at` into `dst` at `to` (copy_file_range where it can)."""
    while length > 0:
        try:
            n = os.copy_file_range(src, dst, min(length, 1 << 30), at, to)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = 0
        if n == 0:
            chunk = os.pread(src, min(length, _CHUNK), at)
            if not chunk:
                raise OSError(errno.EIO, "the base is shorter than home recorded")
            n = os.pwrite(dst, chunk, to)
        at += n
        to += n
        length -= n
