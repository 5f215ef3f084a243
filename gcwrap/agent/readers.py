"""The agent's pipe readers: one task per output stream reads the job's
pipe into the outbox, or splices it into the spool's segment file when the
pipe holds bulk output and the spool takes it (the zero-copy path: an
`Extent` in OutStream.mem, spooled once the commit loop records its row).
Line output, and everything while the spool cannot take it (disk full,
failing, --write-behind), is read into memory. When memory holds more than
--memory-limit that only it holds, the readers stop and the job blocks in
write(): the job is paused (backpressure).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import trio

from .jobstate import JobState
from .options import AgentOptions
from .outbox import Outbox, OutStream
from .pipes import grow_pipe, pipe_bytes
from .policy import HomeHealth
from .records import UNSUPPORTED_ERRNOS
from .spool import describe_os_error
from .spooler import Spooler
from .spoolwriter import SpoolWriter
from .timeline import Journal

log = logging.getLogger("gcwrap")

READ_SIZE = 1 << 20  # a read returns what the pipe holds: large reads cost no latency
# Bulk output: a reader that wakes for every write of a fast job reads a few
# KiB at a time, and every wake-up costs a trip through the event loop, the
# spool and the sender. After a large read, let the pipe fill for a moment.
BULK_READ = 64 << 10  # a read at least this large means the job writes in bulk...
BULK_NAP_MAX = 0.02  # ...so wait up to this long (seconds) before reading again,
BULK_FILL = 0.5  # until the pipe is about this full at the job's recent rate,
BULK_NAP_MIN = 0.002  # but only when that takes this long (a job below ~250 MB/s with a 1 MiB pipe)
RATE_WINDOW = 0.05  # seconds over which the job's recent rate is measured
BULK_MIN_PIPE = 512 << 10  # only with a pipe this large (it must not fill during the nap)
SPLICE_MIN = 64 << 10  # a pipe holding at least this much is spliced into the spool, not read
SMALL_READ = 64 << 10  # a read into memory asks for at least this much (see read_size)
LINE_RATE = 1 << 20  # bytes/s: small reads coming at least this fast are from a fast line writer...
LINE_GAP = 0.001  # ...whose lines then gather in the pipe this long (seconds) before the next read


def read_size(held: int) -> int:
    """How much one read into memory asks for: what the pipe holds (FIONREAD)
    and room for what comes meanwhile, at most READ_SIZE. Python allocates
    all it asks for before the read and gives the rest back after it: a
    1 MiB buffer per read is an mmap, page faults, an mremap and a munmap
    (line output at a moderate rate reads a few KiB a time, thousands of
    times a second); SMALL_READ comes from the heap, without a system call."""
    return min(READ_SIZE, max(held, SMALL_READ))


@dataclass
class BulkPacer:
    """How long a bulk reader lets the pipe fill before its next read.

    Each read wakes the commit loop and the sender and makes a frame and a
    spool row: a job writing 64 KiB blocks at 30 MB/s, read at every block,
    costs about twice the CPU per byte of one read each time the pipe is
    half full (`fill`). So after a bulk read that left the pipe far from
    full, the reader naps until about `fill` has come at the job's rate,
    measured over RATE_WINDOW: single reads of a fast job come in every
    size, and one small read made a long nap.

    A nap must not hold back a job that writes as fast as it is read: a
    timer wakes a millisecond late, and meanwhile such a job fills the pipe
    and waits. Naps of a millisecond or two, at every other read, cost
    1 GB at full speed 40 % of its throughput (2.2 s instead of 1.3 s). So
    no nap is shorter than BULK_NAP_MIN: a job faster than `fill` per
    BULK_NAP_MIN (about 250 MB/s) is read as it comes; one slower than
    that is the one that saved CPU from the naps."""

    fill: float  # bytes: about half the pipe (0: the pipe is too small to nap on)
    window_start: float
    window_bytes: int = 0
    rate: float = 0.0  # the job's bytes/s over the last whole window (0: none yet)

    def nap(self, size: int, now: float) -> float:
        """Seconds to wait after a read of `size` bytes at `now` (0: read again at once)."""
        self.window_bytes += size
        if now - self.window_start >= RATE_WINDOW:
            self.rate = self.window_bytes / (now - self.window_start)
            self.window_start, self.window_bytes = now, 0
        if not (self.fill and self.rate and BULK_READ <= size < 1.5 * self.fill):  # (a full pipe: read at once)
            return 0.0
        nap = self.fill / self.rate
        return min(BULK_NAP_MAX, nap) if nap >= BULK_NAP_MIN else 0.0


class PipeReaders:
    """The job's pipes read into the outbox, and the pause they impose on
    the job when memory is full: its one account (`blocked_since`), so a
    pause of two streams together is one pause."""

    def __init__(self, opts: AgentOptions, outbox: Outbox, spooler: Spooler, writer: SpoolWriter, job: JobState,
                 journal: Journal, home: HomeHealth) -> None:
        self.mem_limit = opts.mem_limit
        self.write_behind = opts.write_behind  # (keeps acknowledged-in-time output off the disk: no splice)
        self.outbox = outbox
        self.spooler = spooler
        self.writer = writer
        self.job = job
        self.journal = journal
        self.home = home
        self.blocked_since: float | None = None  # when the job's current pause began (None: not paused)
        self.paused_now = 0  # readers held by backpressure now: the job is paused while any is
        self.pause_said = False  # the current pause was announced (the disk had failed)
        self.paused_s = 0.0  # the pauses that ended, in seconds
        self.spliced = 0  # bytes spliced into the spool (the zero-copy path)

    def paused(self) -> float:
        """Seconds the job has been paused so far, the current pause included."""
        now = time.monotonic()
        return self.paused_s + (now - self.blocked_since if self.blocked_since is not None else 0)

    def blocked(self) -> bool:
        """The job's output can go nowhere: paused with the disk failing, or
        ended with output undelivered. Failed attempts count only then."""
        paused = self.blocked_since is not None and self.writer.disk.refusing
        return paused or self.outbox.exit is not None

    async def read_pipe(self, out: OutStream, pipe: trio.abc.ReceiveStream) -> None:
        assert isinstance(pipe, trio.lowlevel.FdStream)  # (a child's pipe, on Unix)
        fd = pipe.fileno()
        capacity = grow_pipe(fd)
        last = trio.current_time()
        pacer = BulkPacer(BULK_FILL * capacity if capacity >= BULK_MIN_PIPE else 0, last)
        limiter = trio.CapacityLimiter(1)
        async with pipe:
            while True:
                if self.outbox.unsafe_bytes > self.mem_limit and not self.job.exited:
                    await self._wait_for_room()
                size = 0
                await trio.lowlevel.wait_readable(fd)
                held = pipe_bytes(fd)
                # (Line output stops at the first test: no statvfs per line.)
                if held >= SPLICE_MIN and self._may_splice() and self._spool_has_room(capacity):
                    size = await self._splice(out, fd, limiter)
                now = trio.current_time()
                if size:
                    out.append_extent(size, now)
                    self.spliced += size
                else:
                    data = await pipe.receive_some(read_size(held))
                    if not data:
                        break
                    now = trio.current_time()
                    out.append(data, now)
                    size = len(data)
                self.journal.link.output(now)
                self.outbox.changed.fire()
                if self.outbox.unsafe_bytes >= self.mem_limit // 4:
                    self.writer.commit_soon.set()  # (group commit: no more waiting)
                nap = pacer.nap(size, now)
                if nap:
                    await trio.sleep(nap)  # (bulk output from a moderate writer: see BulkPacer)
                elif size < BULK_READ and size >= LINE_RATE * (now - last):
                    # Line output from a fast writer (at least LINE_RATE
                    # since the last read): wait LINE_GAP, so the next read
                    # gathers what it writes meanwhile. Each read wakes the
                    # commit loop and the sender and makes a frame and a
                    # spool row: a job logging 100 000 lines/s was read
                    # 2 000-4 000 times a second, a few lines a time. A job
                    # that writes now and then (1 000 lines/s of 100 B: a
                    # line a millisecond, 100 kB/s) is read at once, as before.
                    await trio.sleep(LINE_GAP)
                last = now
        out.eof = True
        self.outbox.changed.fire()

    def _may_splice(self) -> bool:
        """The bulk path is open: a spool of natural layout, made by this
        run, that splice works on and that takes bytes; and no
        --write-behind (which keeps acknowledged-in-time output off the disk)."""
        return (self.spooler.zero_copy and not self.spooler.no_splice and not self.writer.disk.error
                and not self.write_behind)

    def _spool_has_room(self, capacity: int) -> bool:
        """Room for two pipefuls beyond what the spool holds (or will)."""
        room = self.spooler.room(self.outbox.spooled_pending + self.outbox.unsafe_bytes)
        return room.bytes >= 2 * max(capacity, SPLICE_MIN)

    async def _splice(self, out: OutStream, fd: int, limiter: trio.CapacityLimiter) -> int:
        """Splice what the pipe holds into the stream's segment file. 0 when
        nothing moved: the caller reads into memory instead."""
        try:
            return await self.spooler.splice(out.id, fd, out.read_end, READ_SIZE, limiter)
        except BlockingIOError:
            return 0
        except OSError as e:
            if e.errno in UNSUPPORTED_ERRNOS:
                log.info("splice into the spool is not supported here (%s): reading into memory", e.strerror)
                self.spooler.no_splice = True
                return 0
            self.writer.disk_failed(describe_os_error(e, self.spooler.path))
            return 0

    async def _wait_for_room(self) -> None:
        """Backpressure: stop reading so the job blocks in write().

        The job is paused while any of its readers waits here: the pause is
        one wall-clock interval, from the first reader that stops to the
        last that goes on (two streams paused together are one pause)."""
        self.paused_now += 1
        if self.paused_now == 1:
            self.blocked_since = time.monotonic()
            self.pause_said = False
            self.job.note(state="paused")
        finished = False
        took = 0.0
        try:
            # Once the job has ended, what is left in its pipes is bounded by
            # the pipe buffer: read it to EOF so the end can be recorded.
            while self.outbox.unsafe_bytes > self.mem_limit and not self.job.exited:
                # A slow disk, or a network slower than the job, pauses the job
                # for moments: that is ordinary flow control. Say so only when
                # the disk has failed and home is out of reach (an attempt
                # failed: not while the first connects), and when it ends.
                if self.writer.disk.refusing and not self.home.streaming and self.home.error and not self.pause_said:
                    self.pause_said = True
                    log.warning(
                        "output can go neither to disk (%s) nor home (%s): the job is paused until one recovers",
                        self.writer.disk.error, self.home.error,
                    )
                    self.journal.note(trio.current_time(), "paused",
                                      reason=f"disk: {self.writer.disk.error}; home: {self.home.error}")
                await self.outbox.changed.wait()
            finished = True
        finally:
            self.paused_now -= 1
            last = self.paused_now == 0
            if last and self.blocked_since is not None:
                took = time.monotonic() - self.blocked_since
                self.paused_s += took
                self.blocked_since = None
        if finished and last:
            self.job.note(state="running")
            if self.pause_said:
                log.warning("the job resumes after %.1f s paused", took)
                why = "home takes the output again" if self.home.streaming else "the spool takes output again"
                self.journal.note(trio.current_time(), "resumed", reason=why, paused_s=round(took, 3))
