"""The job's files (--file) on their way home: versions, frames, commits.

The watcher (gcwrap.agent.filewatch) says when a file changed; this module
decides what home must get. A file that grows on the same inode gets
FILE_DATA of its new bytes on the version in progress. Anything else (a
rename over it, a truncation, a rewrite in place) starts a new version whose
base is the last version a FILE_COMMIT was sent for (home takes frames in
order, so it holds that one committed when it reads the FILE_OPEN), built
by the block plan of gcwrap.agent.filedelta: FILE_COPY for the blocks home
holds, FILE_DATA for the rest.

A version's bytes are read from a descriptor kept open on its inode, never
copied: the descriptor keeps a deleted or renamed-over file's bytes alive.
stat cannot see every rewrite, so a commit first scans the version's
content and compares its block digests with those of what was sent
(`SentBlocks`): a difference is a rewrite, and a new version. While the job
runs, a commit reads only the bytes added since the version was last read
(filedelta.Scanner): a log appended to for hours costs its appends, and
what home commits is what was sent either way; at the job's end each
version is read whole once more, so a write below what was read before is
found there at the latest. Commits come when a file has been quiet a
moment, at least every COMMIT_EVERY seconds while it changes, and always at
the job's end after a last stat pass; the EXIT goes (with each file's final
version) only once every file's final content is committed at home.

A session (gcwrap.agent.sender) calls `welcomed` with home's WELCOME.files,
`send_some` to send the next frames, and `ack` with home's FILE_ACKs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ..sync import Signal
from ..wire.events import Event, FileAck, FileCommit, FileCopy, FileData, FileHeld, FileOpen
from ..wire.fileframes import MAX_FILES
from ..wire.names import NameError_, normalize
from ..wire.protocol import MAX_PAYLOAD
from . import filedelta
from .filedelta import BLOCK_SIZE, Copy, Digests, Literal, Op, block_digest
from .filespecs import FileSpec
from .filewatch import Change, FileEvent, FileWatcher
from .spoolfiles import FileRecord

if TYPE_CHECKING:
    from .spoolfiles import SpoolFiles

log = logging.getLogger("gcwrap")

QUIET = 1.0  # seconds without a change before a file's version is committed
COMMIT_EVERY = 5.0  # seconds: a file that keeps changing is committed at least this often
TICK = 0.5  # seconds between looks at commits due while nothing else happens
# A large file is committed less often while it changes (once a commit read the version whole; now a
# checkpoint reads what was added, and only the job's end reads it whole again).
SCAN_SHARE = 20 / 1e9  # seconds between commits per byte of the file
FRAMES_PER_TURN = 16  # file frames sent per call of `send_some` (the streams get their turn between)

Send = Callable[[Event], Awaitable[None]]
Record = Callable[[Callable[["SpoolFiles"], object]], Awaitable[None]]
Note = Callable[..., None]  # (now, kind, **details): a note for the job's timeline at home (`Journal.note`)
LIVE_FILES = 16  # files the live status file tells of at most (4 KiB in all, ~75 bytes each): not committed first


def _no_note(at: float, kind: str, **details: object) -> None:
    pass


async def _no_record(fn: Callable[[SpoolFiles], object]) -> None:
    pass


def _commit_acked(file: int, version: int, size: int) -> Callable[[SpoolFiles], object]:
    return lambda t: t.commit_acked(file, version, size)


class SentBlocks:
    """The block digests of what was sent of a version, in order: literal
    bytes as they are read, copied blocks by the base's digests."""

    def __init__(self) -> None:
        self.blocks: list[bytes] = []
        self.tail = b""  # the bytes of the last block while it is short

    @property
    def size(self) -> int:
        return len(self.blocks) * BLOCK_SIZE + len(self.tail)

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data)  # (digested in place: `data` may be a read buffer, used again after)
        if self.tail:
            need = BLOCK_SIZE - len(self.tail)
            self.tail += view[:need]
            view = view[need:]
            if len(self.tail) < BLOCK_SIZE:
                return
            self.blocks.append(block_digest(self.tail))
            self.tail = b""
        whole = len(view) - len(view) % BLOCK_SIZE
        self.blocks.extend(block_digest(view[i : i + BLOCK_SIZE]) for i in range(0, whole, BLOCK_SIZE))
        self.tail = bytes(view[whole:])

    def copied(self, digests: Sequence[bytes]) -> None:
        assert not self.tail, "copies are of whole blocks"
        self.blocks.extend(digests)

    def truncate(self, size: int) -> bool:
        """Forget what was sent from `size` on; False where that reaches into
        a whole block (its bytes are not kept: the version cannot go on)."""
        whole = len(self.blocks) * BLOCK_SIZE
        if size < whole:
            return False
        self.tail = self.tail[: size - whole]
        return True

    def digests(self) -> tuple[bytes, ...]:
        return (*self.blocks, block_digest(self.tail)) if self.tail else tuple(self.blocks)


@dataclass
class Version:
    """One version of a file: its content is `ops` over [0, planned), read
    from `fd` (literals) or copied from its base at home."""

    number: int
    base: int | None
    fd: int
    ops: list[Op]
    planned: int
    sent: int = 0
    acked: int = 0
    opened: bool = False  # its FILE_OPEN went on this connection
    sent_blocks: SentBlocks = field(default_factory=SentBlocks)
    scanned: filedelta.Scan | None = None  # its content as scanned for its plan (None: not scanned, or grown since)
    scanner: filedelta.Scanner = field(default_factory=filedelta.Scanner)  # (its content as read so far)
    final: bool = False  # read whole since the job ended: its commit at `planned` says the file's final content
    commit_sha: str = ""  # the SHA-256 its last FILE_COMMIT said
    commit_sent: int = -1  # the size its last FILE_COMMIT said
    committed: int = -1  # the size home acknowledged a commit at
    recorded: int = -1  # the size of the scan the spool keeps (its latest commit's)


@dataclass
class TrackedFile:
    """One file the job writes, as the sender follows it: its handle on the wire, the version being
    sent, and what home holds committed."""

    handle: int
    path: str
    name: str
    current: Version | None = None
    commits: dict[int, Digests] = field(default_factory=dict)  # version -> digests its last FILE_COMMIT said
    # The version home holds committed when it reads our next FILE_OPEN: the last a FILE_COMMIT went for
    # (home takes frames in order), or after a reconnection the one its WELCOME says (`_home_base`).
    base: int | None = None
    bases: dict[int, int | None] = field(default_factory=dict)  # version -> the base its FILE_OPEN said
    changed_at: float = 0.0  # when the watcher last reported a change
    committed_at: float = 0.0  # when its last FILE_COMMIT went
    base_digests: Digests | None = None  # (of the current version's base: what its copies copy)
    numbered: int = 0  # the newest version number given (versions only grow)
    trouble: str = ""  # "gone" (the job deleted it) or "unreadable" (gcwrap cannot read it): said once each
    unreadable: str = ""  # why it could not be read, as last said ("": it could): said once, not at every try

    def state(self) -> str:
        """live, committed, gone or unreadable (`gcwrap status`, the I/O summary)."""
        v = self.current
        if self.trouble or v is None:
            return self.trouble or "unreadable"
        return "committed" if v.committed == v.planned and v.sent == v.planned else "live"

    def view(self) -> dict[str, object]:
        v = self.current
        if v is not None:
            return {"file": self.handle, "path": self.path, "name": self.name, "version": v.number,
                    "size": v.planned, "sent": v.sent, "acked": v.acked, "committed": v.committed,
                    "state": self.state()}
        # (none in progress: gone or unreadable; what home holds is the version committed last, if any)
        held = self.commits.get(self.base) if self.base is not None else None
        size = held.size if held is not None else 0
        return {"file": self.handle, "path": self.path, "name": self.name, "version": self.base or 0,
                "size": size, "sent": size, "acked": size, "committed": size if held is not None else -1,
                "state": self.state()}


class FileSender:
    """The job's files: watched, versioned, sent, committed."""

    def __init__(self, workdir: Path, specs: tuple[FileSpec, ...], changed: Signal,
                 record: Record = _no_record, note: Note = _no_note) -> None:
        self.workdir = workdir
        self.note = note
        self.record = record  # into the spool: its files, versions, scans and commits (gcwrap.agent.spoolfiles)
        self.acks: list[tuple[int, int, int]] = []  # (file, version, size) commits acknowledged, to record
        self.watcher = FileWatcher(workdir, specs)
        self.changed = changed
        self.files: dict[str, TrackedFile] = {}  # by path
        self.by_handle: dict[int, TrackedFile] = {}
        self.ending = False  # the job ended and the last stat pass was made
        self.restart: list[TrackedFile] = []  # files whose version a reconnection cannot continue
        self.lock = trio.Lock()  # (the watcher's changes and a session's sends take turns)
        self.events: trio.MemoryReceiveChannel[FileEvent] | None = None
        self.literal = 0  # bytes of the files sent on the wire (FILE_DATA), resends included
        self.copied = 0  # bytes home copied from a version it held (FILE_COPY)
        # `gcwrap resume` (gcwrap.agent.fileresume): the job has ended; the last pass is made once the first
        # WELCOME says what home holds (each new version's base).
        self.resuming = False
        self.pass_due = False
        self.job_over = False  # the last pass began: the job has ended
        self.left_out: set[str] = set()  # paths matched whose NAME home would refuse (said once)
        self.buffer = memoryview(bytearray(MAX_PAYLOAD))  # what FILE_DATA's bytes are read into (`_send_bytes`)

    # -- what the watcher says -------------------------------------------------

    async def run(self, ended: Callable[[], bool]) -> None:
        """Watch the files until the job has ended (`ended()`, asked when
        `changed` fires), waking the sender when something changed or a
        commit comes due; then `job_ended`."""
        send, self.events = trio.open_memory_channel[FileEvent](4096)
        specs = self.watcher.specs
        await self.record(lambda t: t.record_specs(self.workdir, specs))  # (for `gcwrap resume`)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watcher.run, send)
            nursery.start_soon(self._take_events, self.events)
            while not ended():
                await self.changed.wait()
            nursery.cancel_scope.cancel()
        await self.job_ended()

    async def _take_events(self, events: trio.MemoryReceiveChannel[FileEvent]) -> None:
        while True:
            event: FileEvent | None = None
            with trio.move_on_after(TICK):
                event = await events.receive()
            if event is not None:
                with trio.CancelScope(shield=True):  # (an event received is not lost to the job's end)
                    await self.take(event)
            self.changed.fire()

    async def job_ended(self) -> None:
        """The job ended: what the watcher saw, a last stat pass, and from
        now on every file's content is final (its commit lets the EXIT go)."""
        pending = []
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            while self.events is not None:
                pending.append(self.events.receive_nowait())
        async with self.lock:
            await self._last_pass(pending)

    async def _last_pass(self, pending: list[FileEvent]) -> None:
        self.job_over = True  # (versions made from now on are read after the job's end: final)
        # Every file as the last pass finds it, as if new: an event the watcher made as it was
        # cancelled is lost, and one for a file as it was is an append, at most (`_take`).
        self.watcher.files.clear()
        for event in [*pending, *self.watcher.check()]:
            await self._take(event)
        if self.resuming:
            for tracked in self.files.values():
                if tracked.current is None:
                    log.warning("the job's file %s is gone (or cannot be read): home keeps what it had of it (%s)",
                                tracked.path, tracked.name)
        self.ending = True
        self.changed.fire()

    async def take(self, event: FileEvent) -> None:
        async with self.lock:
            await self._take(event)

    async def _take(self, event: FileEvent) -> None:
        tracked = self.files.get(event.path)
        now = trio.current_time()
        if tracked is None:
            if event.stat is None:
                return
            name = event.spec.name if event.spec.name is not None and not event.spec.is_glob else event.path
            if not self._can_land(event.path, name):
                return
            handle = max(self.by_handle, default=0) + 1  # (after those a resumed spool keeps)
            tracked = self.files[event.path] = self.by_handle[handle] = TrackedFile(handle, event.path, name)
            record = FileRecord(handle, event.path, name, event.spec.pattern, event.stat.dev, event.stat.ino)
            await self.record(lambda t: t.add_file(record))
        tracked.changed_at = now
        current = tracked.current
        if event.change is Change.DELETED:
            self._trouble(tracked, "gone")  # (the descriptor keeps its last content: that is what home gets)
            return
        if tracked.trouble == "gone":
            tracked.trouble = ""  # (there again)
        if event.change in (Change.GREW, Change.APPEARED) and current is not None and event.stat is not None \
                and _same_inode(current.fd, event.stat):
            # An event waits its turn while the file grows on: one smaller than the version already
            # planned (from a later look, `_commit`) is stale, not a rewrite, where the file is as long now.
            size = event.stat.size if event.stat.size >= current.planned else os.fstat(current.fd).st_size
            if size >= current.planned:
                _extend(current, size)  # (writes below the old size: the commit's scan finds them)
                return
        await self.new_version(tracked)

    def _can_land(self, path: str, name: str) -> bool:
        """Whether home would take NAME (a glob's match is named by its path):
        one it would refuse is said once and left out, rather than have home
        refuse the whole job for it."""
        try:
            normalize(name)
        except NameError_ as e:
            if path not in self.left_out:
                log.warning("a file the job writes cannot come home: %s; it is left out", e)
                self.left_out.add(path)
            return False
        if len(self.by_handle) >= MAX_FILES:  # (what one WELCOME or EXIT can list)
            if not self.left_out:
                log.warning("the job's file %s cannot come home: at most %d files a job; it and any later "
                            "are left out", path, MAX_FILES)
            self.left_out.add(path)
            return False
        return True

    # -- versions --------------------------------------------------------------

    async def new_version(self, tracked: TrackedFile, fd: int | None = None) -> None:
        """Start the next version of the file from its content now (at its
        path, or on `fd`), built from `tracked.base` (all of it literal
        where its digests are not known)."""
        old = tracked.current
        if old is not None:
            tracked.current = None
            os.close(old.fd)
        base = tracked.base
        digests = tracked.commits.get(base) if base is not None else None
        try:
            if fd is None:
                fd = os.open(self.workdir / tracked.path, os.O_RDONLY | os.O_CLOEXEC)
            st = os.fstat(fd)
            # Scanned whole: the plan needs its digests, and a version sent as scanned commits at once.
            scanner = filedelta.Scanner()
            scanned = await trio.to_thread.run_sync(scanner.advance, fd, st.st_size)
        except OSError as e:
            # (no version in progress now: home keeps its committed one, and the EXIT does not list it)
            reason = e.strerror or str(e)
            if tracked.unreadable != reason:
                log.warning("cannot read the job's file %s (%s): %s", tracked.path, reason,
                            "home keeps the last version gcwrap could read" if tracked.numbered
                            else "home gets none of it")
            tracked.unreadable = reason
            if fd is not None:
                os.close(fd)
            self._trouble(tracked, "gone" if e.errno == errno.ENOENT else "unreadable", e.strerror or str(e))
            return
        if tracked.trouble == "unreadable":
            tracked.trouble = ""
        tracked.unreadable = ""
        size = scanned.digests.size
        ops = _whole_copies(filedelta.plan(digests, scanned.digests))
        number = tracked.numbered = tracked.numbered + 1
        tracked.current = Version(number, base, fd, ops, size, scanned=scanned, scanner=scanner, final=self.job_over)
        tracked.bases[number] = base
        tracked.base_digests = digests
        await self.record(lambda t: t.new_version(tracked.handle, number, st.st_dev, st.st_ino, base))
        log.debug("file %s: version %d of %d bytes (base %s)", tracked.path, number, size, base)

    def _trouble(self, tracked: TrackedFile, trouble: str, error: str = "") -> None:
        """The file is gone or unreadable: a note for home's timeline, once
        until it is there (or readable) again. Home keeps what it has of it."""
        if tracked.trouble == trouble:
            return
        tracked.trouble = trouble
        v = tracked.current
        details: dict[str, object] = {"name": tracked.name, "path": tracked.path}
        if v is not None:
            details.update(version=v.number, size=v.planned)
        if error:
            details["error"] = error
        self.note(trio.current_time(), f"file_{trouble}", **details)

    def listing(self) -> list[dict[str, object]]:
        """Each file as `gcwrap status` and the I/O summary show it (`TrackedFile.view`)."""
        return [t.view() for t in self.by_handle.values()]

    def live(self) -> list[list[object]]:
        """For the live status file: [file, version, size, sent, acked,
        committed, state] of LIVE_FILES files at most, those not committed first."""
        shown = sorted(self.by_handle.values(), key=lambda t: (t.state() == "committed", t.handle))[:LIVE_FILES]
        return [[(v := t.view())["file"], v["version"], v["size"], v["sent"], v["acked"], v["committed"], v["state"]]
                for t in shown]

    # -- a connection ------------------------------------------------------------

    def welcomed(self, held: Sequence[FileHeld]) -> None:
        """Home's WELCOME: continue each version where home holds it, or
        start a new one from the version home holds committed."""
        by_file = {h.file: h for h in held}
        for tracked in self.files.values():
            v = tracked.current
            h = by_file.get(tracked.handle)
            tracked.base = _home_base(tracked, h)
            for number in [n for n in tracked.commits if n != tracked.base]:
                del tracked.commits[number]  # (never committed at home, or no longer its committed one)
            if h is not None and tracked.base == h.version and (d := tracked.commits.get(h.version)) is not None:
                # A commit home never read (sent as the connection broke): what it holds is less.
                tracked.commits[h.version] = d.prefix(h.committed)
            if v is None:  # (a file resumed, or one that could not be read: its next version is built on that base)
                tracked.numbered = max(tracked.numbered, h.version if h is not None else 0)
                continue
            v.opened = False
            same = h.version == v.number if h is not None else v.base is None
            durable = h.durable if h is not None else 0
            if same and v.acked <= durable <= v.sent and v.sent_blocks.truncate(durable):
                v.sent = v.acked = durable
                v.committed = h.committed if h is not None else -1
                v.commit_sent = min(v.commit_sent, v.committed)
                continue
            tracked.numbered = max(tracked.numbered, h.version if h is not None else 0)
            self.restart.append(tracked)
        if self.resuming and not self.ending:
            self.pass_due = True
        self.changed.fire()

    @property
    def done(self) -> bool:
        """Every file's final content is committed at home (after the job's end)."""
        return self.ending and not self.restart and all(
            (v := t.current) is None or (v.final and v.committed == v.planned and v.sent == v.planned)
            for t in self.files.values())

    @property
    def waiting(self) -> bool:
        """Bytes or a commit sent that home has not acknowledged (the session's watchdog asks)."""
        return any((v := t.current) is not None and v.opened and (v.sent > v.acked or v.commit_sent > v.committed)
                   for t in self.files.values())

    def figures(self) -> dict[str, int]:
        """For the I/O summary: the files' final sizes, and their bytes on
        the wire against those home copied."""
        return {"files": len(self.files), "files_size": sum(v.planned for t in self.files.values()
                                                             if (v := t.current) is not None),
                "files_sent": self.literal, "files_copied": self.copied}

    def exit_files(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((t.handle, v.number, v.committed) for t in self.by_handle.values()
                     if (v := t.current) is not None)

    def ack(self, ev: FileAck) -> bool:
        """Home's FILE_ACK: True if it moved something forward."""
        tracked = self.by_handle.get(ev.file)
        v = tracked.current if tracked is not None else None
        if v is None or ev.version != v.number:
            return False  # (of a version since abandoned)
        moved = ev.offset > v.acked
        v.acked = max(v.acked, min(ev.offset, v.sent))
        if ev.committed and ev.offset > v.committed:
            v.committed = ev.offset
            if ev.offset == v.recorded:
                self.acks.append((ev.file, ev.version, ev.offset))
            moved = True
        if moved:
            self.changed.fire()
        return moved

    async def send_some(self, send: Send) -> bool:
        """Send the next frames of the files; False when none is due."""
        async with self.lock:
            acks, self.acks = self.acks, []
            for file, version, size in acks:
                await self.record(_commit_acked(file, version, size))
            if self.pass_due:
                self.pass_due = False
                await self._last_pass([])
            while self.restart:
                tracked = self.restart.pop()
                v = tracked.current
                if v is not None:  # (the same inode's content now: the path may name another, the watcher says)
                    await self.new_version(tracked, os.dup(v.fd))
            sent = 0
            for tracked in list(self.files.values()):
                while sent < FRAMES_PER_TURN and await self._send_next(tracked, send):
                    sent += 1
            return sent > 0

    async def _send_next(self, tracked: TrackedFile, send: Send) -> bool:
        v = tracked.current
        if v is None:
            return False
        if not v.opened:
            await send(FileOpen(tracked.handle, tracked.name, v.number, v.base))
            v.opened = True
            return True
        if v.sent < v.planned:
            return await self._send_bytes(tracked, v, send)
        if v.commit_sent < v.planned and (scan := v.scanned) is not None \
                and scan.digests.blocks == v.sent_blocks.digests():
            # What was sent is what was scanned for the plan: committed at once, with no scan again
            # (so that the next rewrite is built from it, not from an older version).
            return await self._send_commit(tracked, v, scan, send)
        now = trio.current_time()
        due = self.ending or (now - tracked.committed_at >= v.planned * SCAN_SHARE and (
            now - tracked.changed_at >= QUIET or now - tracked.committed_at >= COMMIT_EVERY))
        if not due or (v.commit_sent == v.planned and (v.final or not self.ending)):
            return False
        return await self._commit(tracked, v, send)

    async def _send_bytes(self, tracked: TrackedFile, v: Version, send: Send) -> bool:
        op = next(op for op in v.ops if op.offset <= v.sent < op.offset + op.length)
        end = op.offset + op.length
        if isinstance(op, Copy):
            length = end - v.sent
            assert tracked.base_digests is not None and v.sent % BLOCK_SIZE == 0
            first = v.sent // BLOCK_SIZE
            if v.sent >= v.sent_blocks.size:
                v.sent_blocks.copied(tracked.base_digests.blocks[first : first + -(-length // BLOCK_SIZE)])
            offset, v.sent = v.sent, end  # (first: the ACK may come before the send returns)
            self.copied += length
            await send(FileCopy(tracked.handle, v.number, offset, op.source + offset - op.offset, length))
            return True
        want = min(end - v.sent, MAX_PAYLOAD)
        try:  # (into a buffer used again: the frame is in the kernel's hands before the next read)
            data = self.buffer[: os.preadv(v.fd, [self.buffer[:want]], v.sent)]
        except OSError as e:
            log.warning("cannot read the job's file %s (%s): reading it again", tracked.path, e.strerror)
            data = self.buffer[:0]
        if len(data) < want:  # truncated since it was planned (or unreadable): a version of what is there now
            await self.new_version(tracked)
            return True
        if v.sent >= v.sent_blocks.size:
            v.sent_blocks.feed(data)
        offset = v.sent
        v.sent += len(data)
        self.literal += len(data)
        await send(FileData(tracked.handle, v.number, offset, data))
        return True

    async def _commit(self, tracked: TrackedFile, v: Version, send: Send) -> bool:
        """Scan the version's content: what was sent, unchanged, is committed;
        a change under it (or more bytes) makes a new version or an append."""
        size = os.fstat(v.fd).st_size
        if size > v.planned:
            _extend(v, size)
            return True
        whole = self.ending or v.scanner.size > v.planned
        if whole:
            scan = await trio.to_thread.run_sync(filedelta.scan, v.fd, v.planned)
        else:  # (a checkpoint: what was read before is trusted, see the module's docstring)
            scan = await trio.to_thread.run_sync(v.scanner.advance, v.fd, v.planned)
        if tracked.current is not v:
            return True
        if scan.digests.size != v.planned or scan.digests.blocks != v.sent_blocks.digests():
            log.debug("file %s: version %d changed under its sending: a new version", tracked.path, v.number)
            await self.new_version(tracked)
            return True
        v.final = self.ending  # (read whole after the job's end: nothing can change it now)
        if v.commit_sent == v.planned and v.commit_sha == scan.sha256:
            return True  # (its commit said this content already: nothing to send)
        return await self._send_commit(tracked, v, scan, send)

    async def _send_commit(self, tracked: TrackedFile, v: Version, scan: filedelta.Scan, send: Send) -> bool:
        if v.planned > v.recorded:  # (each commit's scan: a resume builds on the newest home holds)
            await self.record(lambda t: t.scanned(tracked.handle, v.number, scan))
            v.recorded = v.planned
        await send(FileCommit(tracked.handle, v.number, v.planned, scan.sha256))
        v.commit_sent, v.commit_sha = v.planned, scan.sha256
        tracked.commits = {n: d for n, d in tracked.commits.items() if n == tracked.base}  # (the older ones: useless)
        tracked.commits[v.number] = scan.digests
        tracked.base = v.number
        tracked.committed_at = trio.current_time()
        return True

    def close(self) -> None:
        for tracked in self.files.values():
            if tracked.current is not None:
                with contextlib.suppress(OSError):
                    os.close(tracked.current.fd)


def _same_inode(fd: int, stat: object) -> bool:
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (getattr(stat, "dev", None), getattr(stat, "ino", None))


def _extend(v: Version, size: int) -> None:
    """More bytes appended to the version's content: a literal to `size`."""
    if size <= v.planned:
        return
    last = v.ops[-1] if v.ops else None
    if isinstance(last, Literal):
        v.ops[-1] = Literal(last.offset, size - last.offset)
    else:
        v.ops.append(Literal(v.planned, size - v.planned))
    v.planned = size
    v.scanned = None
    v.final = False


def _whole_copies(ops: list[Op]) -> list[Op]:
    """The plan with a copy of a short last block sent as a literal instead
    (what was sent is digested by whole blocks: appends may follow it)."""
    if ops and isinstance(last := ops[-1], Copy) and (end := last.offset + last.length) % BLOCK_SIZE:
        cut = end - end % BLOCK_SIZE
        head = [Copy(last.offset, last.source, cut - last.offset)] if cut > last.offset else []
        return [*ops[:-1], *head, Literal(cut, end - cut)]
    return ops


def _home_base(tracked: TrackedFile, held: FileHeld | None) -> int | None:
    """The version home holds committed, by its WELCOME row: none without
    a row; the row's version where it is committed; else the base that
    version was opened with (home commits nothing but the version open).
    The row names the newest version home holds, which a resumed spool
    may no longer keep: one abandoned for a newer whose FILE_OPEN never
    reached home. That newer one was built on the same committed version
    (nothing else was committed meanwhile), its base is the answer."""
    if held is None:
        return None
    if held.committed >= 0:
        return held.version
    if held.version in tracked.bases:
        return tracked.bases[held.version]
    newer = [n for n in tracked.bases if n > held.version]
    return tracked.bases[max(newer)] if newer else None
