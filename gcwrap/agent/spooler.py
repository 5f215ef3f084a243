"""The agent's spool writer: the only owner of the spool's write connection.

It creates the spool lazily (a full disk at start must not stop the job),
says how many bytes may be spooled now (`room`, a query: carrier sense from
the spool's size limit and the free disk space minus a reserve left for the
job itself), and runs the transactions one at a time: inline when small,
else in a worker thread (see SpoolTuning). For the sender it is
the `ByteSource`: bytes read back, and the descriptor and position of bytes
in place (the sender sends them, and maps the socket's errors). A failure
of the disk of any kind is described in plain words and reported as
`SpoolError`; the caller keeps the bytes in memory and tries again later.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from .launch import LIVE_SIZE, SpoolFiles, create_spool, make_live
from .launch import lock_spool as lock_spool  # (re-exported: where it was)
from .options import SpoolTuning
from .records import Chunk, Extent, JobRecord
from .spool import Spool, SpoolError
from .spoolfiles import SpoolFiles as FileTables

log = logging.getLogger("gcwrap")
T = TypeVar("T")

DEFAULT_RESERVE_CAP = 256 << 20  # keep at most this much free for the job...
DEFAULT_RESERVE_FRACTION = 0.05  # ...or this fraction of the file system, if smaller



@dataclass(frozen=True)
class Room:
    """What the spool may take now: `bytes` (0: nothing, and `reason` says
    why in words), and whether a spare segment is worth its blocks."""

    bytes: int
    reason: str = ""
    spares: bool = True
    bound: str = ""  # what limits `bytes`, in words (said when the spool takes less than waits)


class Spooler:
    """The only writer of one job's spool (and its reader for the sender):
    creation, carrier sense, commits, reading back, the live status file,
    the ballast that keeps room for the last commit, and the lock."""

    def __init__(
        self,
        path: Path,
        job: JobRecord,
        streams: list[tuple[int, str, str]],
        *,
        limit: int = 0,
        min_free: int | None = None,
        spool: Spool | None = None,
        lock_fd: int | None = None,
        tuning: SpoolTuning | None = None,
    ) -> None:
        self.path = path
        self.tuning = tuning or SpoolTuning()  # (the defaults, unless the run's options say)
        self.job = job
        self.streams = streams
        self.limit = limit  # 0: no limit but the disk's
        self.min_free = min_free  # None: the default reserve
        self.spool = spool
        self.lock_fd = lock_fd
        self.reader: Spool | None = None
        self.write_limiter = trio.CapacityLimiter(1)
        self.read_limiter = trio.CapacityLimiter(1)
        self.ballast = Path(f"{path}.ballast")
        self.live = Path(f"{path}.live")
        self.live_fd: int | None = None
        self.created = False  # this run made the spool (not a resume)
        self.slow_until = -1.0  # zero-copy I/O goes to a worker thread until then (trio clock)
        self.no_splice = False  # splice into the segments is not supported here
        self.no_sendfile = False  # sendfile from them is not: pread and send instead
        self._statvfs: tuple[float, os.statvfs_result] | None = None  # (when, what): see SpoolTuning.room_ttl
        self.file_tables: FileTables | None = None  # (the job's files' record, made at the first)

    # -- creating --------------------------------------------------------

    def _create(self) -> None:
        self.adopt(create_spool(self.path, self.job, self.streams, self._make_live, self.tuning.segment_size))

    def adopt(self, files: SpoolFiles) -> None:
        """Take a new spool (one the command line created before the job started: `launch`)."""
        self.spool, self.lock_fd = files.spool, files.lock_fd
        self.created = True

    async def ensure(self) -> Spool:
        """The spool, created on first use; SpoolError while that fails."""
        if self.spool is None:
            await trio.to_thread.run_sync(self._create, limiter=self.write_limiter)
            assert self.spool is not None
        return self.spool

    async def record_files(self, fn: Callable[[FileTables], object]) -> None:
        """Record in the spool what became of the job's files (gcwrap.agent.spoolfiles),
        in turn with the commits. A spool that fails to: logged, and delivery goes on
        (the record is for `gcwrap resume`)."""
        if self.spool is None:
            return
        if self.file_tables is None:
            self.file_tables = FileTables(self.spool)
        tables = self.file_tables
        try:
            await trio.to_thread.run_sync(fn, tables, limiter=self.write_limiter)
        except (SpoolError, ValueError) as e:
            log.warning("the spool cannot record the job's files: %s", e)

    # -- carrier sense ---------------------------------------------------

    def reserve(self, total: int) -> int:
        if self.min_free is not None:
            return self.min_free
        return min(DEFAULT_RESERVE_CAP, int(total * DEFAULT_RESERVE_FRACTION))

    def room(self, pending: int) -> Room:
        """What may be added to the spool now, given `pending` bytes already
        there. A query: it changes nothing (but the remembered statvfs)."""
        limit_room = self.limit - pending if self.limit else None
        if limit_room is not None and limit_room <= 0:
            return Room(0, f"spool limit of {self.limit} bytes reached")
        when = time.monotonic()
        if self._statvfs is not None and when - self._statvfs[0] < self.tuning.room_ttl:
            when, st = self._statvfs
        else:
            try:
                st = os.statvfs(self.path.parent)
            except OSError as e:
                return Room(0, f"cannot check free space in {self.path.parent}: {e.strerror}")
        free = st.f_bavail * st.f_frsize
        keep = self.reserve(st.f_blocks * st.f_frsize)
        # Spool into at most half of what is free above the reserve: the WAL
        # and the index grow with it, and so may the job between two checks.
        disk_room = (free - keep) // 2
        # (Remembered only while plenty: a tight disk is looked at every time.)
        self._statvfs = (when, st) if disk_room >= self.tuning.room_plenty else None
        disk_full = f"disk nearly full: {free} bytes free in {self.path.parent}, {keep} kept for the job"
        if disk_room <= 0:
            return Room(0, disk_full)
        segments = self.spool.segments if self.spool is not None else None
        # A spare segment is worth its blocks only while the disk has plenty.
        spares = segments is None or disk_room > 8 * segments.segment_size
        if limit_room is not None and limit_room < disk_room:
            return Room(limit_room, "", spares, f"spool limit of {self.limit} bytes reached")
        return Room(disk_room, "", spares, disk_full)

    def keep_spares(self, keep: bool) -> None:
        """Whether delivered segments are kept as spares (see Room.spares)."""
        if self.spool is not None and self.spool.segments is not None:
            self.spool.segments.keep_spares = keep

    def free_space(self) -> int:
        """Free bytes on the spool's file system, the reserve included (0 if unknown)."""
        try:
            st = os.statvfs(self.path.parent)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    # -- transactions ----------------------------------------------------

    def _make_live(self) -> None:
        if self.live_fd is None:
            self.live_fd = make_live(self.live)

    def write_live(self, snapshot: dict[str, Any]) -> None:
        """Rewrite the live status in place (no new blocks: works on a full disk)."""
        if self.live_fd is None:
            self._make_live()
            if self.live_fd is None:
                return
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        if len(data) > LIVE_SIZE:
            snapshot = dict(snapshot, last_error=str(snapshot.get("last_error", ""))[:200])
            data = json.dumps(snapshot, separators=(",", ":")).encode()[:LIVE_SIZE]
        try:
            os.pwrite(self.live_fd, data.ljust(LIVE_SIZE, b" "), 0)
        except OSError:
            pass  # the live view is a convenience; never a reason to fail

    def last_commit(
        self, updates: dict[str, Any], acked: dict[int, int] | None = None, written: dict[int, int] | None = None
    ) -> bool:
        """Record the final job fields, acknowledgements and what the job
        wrote (so a loss is on record); on a full disk, give up the ballast
        to make room. Synchronous: called once everything else has stopped."""
        if self.spool is None:
            return False
        for attempt in range(2):
            try:
                self.spool.commit(acked=acked, job=updates, written=written)
                return True
            except SpoolError as e:
                if attempt or not self.ballast.exists():
                    log.error("%s", e)
                    return False
                self.ballast.unlink(missing_ok=True)
        return False

    async def commit(
        self, chunks: list[Chunk | Extent], acked: dict[int, int], eof: list[int], updates: dict[str, Any]
    ) -> None:
        spool = await self.ensure()
        if (self.zero_copy and trio.current_time() >= self.slow_until
                and sum(c.size for c in chunks if not isinstance(c, Extent)) <= self.tuning.inline_commit):
            try:
                self.write_limiter.acquire_nowait()
            except trio.WouldBlock:
                pass
            else:
                try:
                    self._timed(lambda: spool.commit(chunks, acked, eof, updates))
                finally:
                    self.write_limiter.release()
                await trio.lowlevel.checkpoint()
                return
        await trio.to_thread.run_sync(spool.commit, chunks, acked, eof, updates, limiter=self.write_limiter)

    # -- bytes in place (natural layout) ---------------------------------

    @property
    def zero_copy(self) -> bool:
        """Bytes are found by offset (natural layout), and this run made the
        spool, so its in-memory offsets say which bytes are in place. (A
        resumed spool is read through its rows, which show any gap.)"""
        return self.created and self.spool is not None and self.spool.natural

    def placed_size(self, offset: int, end: int) -> int:
        """How many of the placed bytes [offset, end) one frame may take: up
        to the end of their segment."""
        assert self.spool is not None and self.spool.segments is not None
        return min(end - offset, self.spool.segments.where(offset)[2])

    async def _io(self, fn: Callable[[], int], limiter: trio.CapacityLimiter) -> int:
        """Run a zero-copy operation inline, or in a worker thread while the
        disk has lately been slow."""
        if trio.current_time() < self.slow_until:
            return await trio.to_thread.run_sync(fn, limiter=limiter)
        return self._timed(fn)

    def _timed(self, fn: Callable[[], T]) -> T:
        """fn() in the event loop's thread; slower than `tuning.slow_io`, and disk
        operations go to worker threads for `tuning.slow_hold` seconds."""
        start = trio.current_time()
        try:
            return fn()
        finally:
            took = trio.current_time() - start
            if took > self.tuning.slow_io:
                log.debug("a disk operation took %.3f s: worker threads for %g s", took, self.tuning.slow_hold)
                self.slow_until = start + took + self.tuning.slow_hold

    async def splice(self, stream: int, pipe: int, start: int, size: int, limiter: trio.CapacityLimiter) -> int:
        """Move what the pipe holds (up to `size`) into the stream's segment
        at offset `start`; see Segments.splice_in. OSError is the disk's (on
        ENOSPC the spares' blocks are given back first)."""
        segments = self.spool.segments  # type: ignore[union-attr]
        assert segments is not None
        try:
            return await self._io(lambda: segments.splice_in(stream, pipe, start, size), limiter)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                segments.drop_spares()
            raise

    async def read_placed(self, stream: int, offset: int, size: int) -> bytes:
        """Placed bytes read into memory (for TLS, which cannot sendfile)."""
        segments = self.spool.segments  # type: ignore[union-attr]
        assert segments is not None
        try:
            return await trio.to_thread.run_sync(segments.read_at, stream, offset, size, limiter=self.read_limiter)
        except OSError as e:
            raise SpoolError(f"spool {self.path}: cannot read bytes {offset}..{offset + size} of stream {stream}: "
                             f"{e.strerror or e}") from None

    async def with_placed(self, stream: int, offset: int, fn: Callable[[int, int], int]) -> int:
        """fn(descriptor, position) on the segment holding stream byte
        `offset` (natural layout), inline or in a worker thread while the
        disk is slow. fn's OSError propagates as it is: only the caller
        knows whether it was the disk's or (sending) the network's."""
        segments = self.spool.segments  # type: ignore[union-attr]
        assert segments is not None

        def run() -> int:
            with segments.opened_at(stream, offset) as (fd, pos, _):
                return fn(fd, pos)

        return await self._io(run, self.read_limiter)

    async def read(self, stream: int, offset: int, limit: int) -> list[Chunk]:
        """Chunks evicted from memory, read back through a second connection
        (which shares the spool's segments: the writer's releases close
        the descriptors it reads through). SpoolError if the spool cannot."""
        spool = self.spool
        if spool is None:
            raise SpoolError(f"spool {self.path}: nothing to read back, no spool was made")
        try:
            if self.reader is None:
                self.reader = await trio.to_thread.run_sync(
                    lambda: Spool.open(self.path, segments=spool.segments), limiter=self.read_limiter
                )
            return await trio.to_thread.run_sync(self.reader.read, stream, offset, limit, limiter=self.read_limiter)
        except OSError as e:
            raise SpoolError(f"spool {self.path}: cannot read back stream {stream} from byte {offset}: "
                             f"{e.strerror or e}") from None

    # -- ending ----------------------------------------------------------

    def close(self, *, remove: bool = False) -> None:
        if remove or self.spool is None:
            with contextlib.suppress(OSError):  # (a read-only disk: there is none)
                self.ballast.unlink(missing_ok=True)  # (no spool: nothing to record at the end)
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.spool is not None:
            if remove:
                self.spool.remove()
            else:
                self.spool.close()
            self.spool = None
        if self.live_fd is not None:
            os.close(self.live_fd)
            self.live_fd = None
        if remove:
            with contextlib.suppress(OSError):
                self.live.unlink(missing_ok=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
