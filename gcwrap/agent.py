"""The agent: runs the job, spools its output, delivers it home.

    child stdout/stderr --pipe--> read_pipe --> OutStream.mem --commit_loop--> spool
                                      |              |                           |
                                      | splice       +---- sender (session) <----+
                                      v                        | DATA      ^ ACK
                                  segment file --sendfile----->|           |
                                                               v           |
                                                             shadow -------+

Bulk output takes the zero-copy path: a pipe holding at least SPLICE_MIN
bytes is spliced into the spool's segment file (an `Extent` in
OutStream.mem, spooled once the commit loop records its row), and the sender
sendfile()s it from there. Line output, and everything while the spool
cannot take it (disk full, failing, --write-behind), is read into memory.

Tasks, all in one nursery: one `read_pipe` per output stream, `commit_loop`
(the only writer of the spool, group commit in a worker thread),
`deliver_loop` (connect, run a session, back off, repeat), `write_stdin`,
and `forward_signals`. They share state through `OutStream`s and wake each
other with one `Signal`.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import errno
import fcntl
import logging
import math
import os
import signal
import ssl
import subprocess
import termios
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import trio

from . import exitcodes
from .events import STDERR, STDIN, STDOUT, ErrorCode, Exit, StreamSpec
from .outbox import OutStream, cached
from .retry import Backoff, ShadowRefused, describe
from .sender import Session, SessionEnd, StdinFeeder
from .spool import Chunk, Extent, JobRecord, Spool, SpoolError, describe_os_error, loss_text
from .spooler import UNSUPPORTED_ERRNOS, Spooler, lock_spool
from .sync import Signal, first_error

log = logging.getLogger("gcwrap")

READ_SIZE = 1 << 20  # a read returns what the pipe holds: large reads cost no latency
PIPE_SIZE = 1 << 20  # ask the kernel for a pipe this large (F_SETPIPE_SZ), so reads can be
COMMIT_BATCH = 8 << 20  # at most this many bytes per spool transaction
# Bulk output: a reader that wakes for every write of a fast job reads a few
# KiB at a time, and every wake-up costs a trip through the event loop, the
# spool and the sender. After a large read, let the pipe fill for a moment.
BULK_READ = 64 << 10  # a read at least this large means the job writes in bulk...
BULK_NAP_MAX = 0.02  # ...so wait up to this long (seconds) before reading again,
BULK_FILL = 0.5  # until the pipe is about this full at the job's recent rate
BULK_MIN_PIPE = 512 << 10  # only with a pipe this large (it must not fill during the nap)
SPLICE_MIN = 64 << 10  # a pipe holding at least this much is spliced into the spool, not read
ACK_COMMIT_INTERVAL = 0.2  # seconds an acknowledgement alone may wait to be recorded in the spool
# Group commit: after a transaction, let the next one gather for this long
# (each costs a worker-thread hop and a WAL append); never while the job has
# ended, the disk is tight, or a quarter of --memory-limit waits unrecorded.
COMMIT_PACE = 0.01
KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL when gcwrap ends the job
SIGNAL_GRACE = 5.0  # seconds gcwrap goes on delivering after SIGTERM, SIGINT or SIGHUP (see StopClock)
LAST_TRY = 1.0  # ...and after the job's end, for a job that outlives that grace
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # forwarded to the job; gcwrap ends (StopClock)
LIVE_INTERVAL = 0.5  # seconds between rewrites of the live status file
# The final flush (see Agent.final_flush) leaves this much free for the rows
# and WAL pages that record its pieces, and gives up on pieces smaller than
# FLUSH_MIN that the disk still refuses.
FLUSH_MARGIN = 64 << 10
FLUSH_MIN = 4 << 10
DRAIN_GRACE = 2.0  # seconds to read what a job's pipes still hold after gcwrap ended it
# "The spool takes output again" is said only once the spool has taken every
# byte that waited in memory, and no write failed for this long: a full disk
# that frees a little at a time must not flip the message back and forth.
DISK_CALM = 2.0


@dataclass
class AgentOptions:
    shadow: tuple[str, int] | None
    stdout: str | None = None
    stderr: str | None = None
    stdin: str | None = None
    merge_stderr: bool = False  # stderr goes into the stdout stream (2>&1)
    retry_limit: int = 20
    retry_timeout: float = 60.0
    heartbeat: float = 5.0
    connect_timeout: float | None = None  # None: three heartbeats
    mem_limit: int = 32 << 20  # bytes held only in memory before the job is paused
    spool_limit: int = 0  # most bytes the spool may hold (0: only the disk limits it)
    min_free: int | None = None  # free disk space left to the job (None: the default reserve)
    cache_limit: int = 64 << 20  # bytes of already-spooled output kept in memory for the sender
    token: bytes | None = None  # shared secret for the challenge-response (gcwrap.auth)
    tls: ssl.SSLContext | None = None  # TLS to the shadow, when set
    write_behind: float = 0.0  # seconds output may wait in memory for home's ack before it is spooled


@dataclass
class Outcome:
    """How a run or a resume ended, for the CLI to report."""

    status: int
    job_status: int | None = None
    message: str = ""
    spool: Path | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    lost: str = ""  # what output is lost, in words (then status is LOST)
    pending: int = 0  # bytes of output the spool keeps for `gcwrap resume`
    refused: bool = False  # the shadow refused the job for good
    signalled: str = ""  # the signal that stopped a resume ("SIGTERM"): resume no further spool


class StopClock:
    """When gcwrap stops delivering after SIGTERM, SIGINT or SIGHUP (a batch
    system's walltime, `timeout`, Ctrl-C): a pure policy, times passed in.

    The first signal leaves `grace` seconds, counted from the signal whether
    the job had ended or not (the job gets the signal too, and usually ends
    at once). A job that ends later than that gets `last_try` seconds after
    its end: one short last attempt. A second signal means stop now. What is
    not home by then waits in the spool for `gcwrap resume`."""

    def __init__(self, grace: float = SIGNAL_GRACE, last_try: float = LAST_TRY) -> None:
        self.grace = grace
        self.last_try = last_try
        self.signals = 0
        self.name = ""  # the first signal's name
        self.deadline = math.inf

    def signal(self, now: float, name: str) -> None:
        self.signals += 1
        if self.signals == 1:
            self.name = name
            self.deadline = now + self.grace
        else:
            self.deadline = min(self.deadline, now)

    def job_ended(self, now: float) -> None:
        if self.signals == 1:
            self.deadline = max(self.deadline, now + self.last_try)


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def stream_specs(opts: AgentOptions) -> list[StreamSpec]:
    specs = []
    for sid, kind, name in ((STDOUT, "stdout", opts.stdout), (STDERR, "stderr", opts.stderr), (STDIN, "stdin", opts.stdin)):
        if name is not None:
            specs.append(StreamSpec(sid, kind, name))
    return specs


class Agent:
    def __init__(self, opts: AgentOptions, spooler: Spooler, job: JobRecord, specs: list[StreamSpec]) -> None:
        self.opts = opts
        self.spooler = spooler
        self.job = job
        self.specs = specs
        self.changed = Signal()
        self.out: dict[int, OutStream] = {
            s.id: OutStream(s.id, s.kind, s.name) for s in specs if s.kind != "stdin"
        }
        self.stdin = StdinFeeder(STDIN) if any(s.kind == "stdin" for s in specs) else None
        self.job_updates: dict[str, Any] = {}
        self.live_fields: dict[str, Any] = {}
        self.committed_acked: dict[int, int] = {}
        self.committed_eof: set[int] = set()
        self.exit_event: Exit | None = None  # set once the job has ended
        self.delivered = trio.Event()
        self.commit_soon = trio.Event()  # set: the commit loop stops gathering (see COMMIT_PACE)
        self.failures_blocked = 0  # consecutive failed attempts while output could go nowhere
        self.blocked_since: float | None = None  # when the job's current pause began (None: not paused)
        self.readers_paused = 0  # pipe readers held by backpressure now: the job is paused while any is
        self.pause_said = False  # the current pause was announced (the disk had failed)
        self.disk_error = ""
        self.net_error = ""
        self.outage_reported = False
        self.outage_since = 0.0  # when the outage that was reported began
        self.disk_said = False  # "the spool cannot take..." was said, and its recovery not yet
        self.disk_failed_at = 0.0  # the last time the spool refused bytes
        self.give_up: Outcome | None = None
        self.refusal: ShadowRefused | None = None
        self.kill_reason = ""  # why gcwrap ended the job, when it did
        self.lost: dict[int, tuple[int, int]] = {}  # stream -> [start, end) that nothing holds (see final_flush)
        self.must_end = trio.Event()  # set: end the job now (see `end_job`)
        self.stats: dict[str, float] = {
            "connects": 0, "attempts": 0, "failures": 0, "paused": 0.0, "connected_s": 0.0, "spliced": 0,
        }
        self.started = time.monotonic()
        self.connected_since: float | None = None
        self.delivery_scope: trio.CancelScope | None = None
        self.stop = StopClock()
        self.delivering = False  # the deliver loop runs
        self.child_exited = False
        self.job_group: int | None = None  # the job's own process group, if it has one
        self.pipes_scope: trio.CancelScope | None = None  # reading the job's pipes once its process has ended
        self.streaming = False  # a session is welcomed and running
        self.resuming = False  # delivering a spool left behind (gcwrap resume), not running a job

    # -- shared state helpers ---------------------------------------------

    def note(self, **fields: Any) -> None:
        """Record job fields in the spool with the next commit (and the live view)."""
        self.job_updates.update(fields)
        self.live_fields.update(fields)
        self.changed.fire()

    def live_snapshot(self) -> dict[str, Any]:
        f = self.live_fields
        return {
            "t": round(time.time(), 3),
            "state": f.get("state", "starting"),
            "connected": bool(f.get("connected", False)),
            "last_error": f.get("last_error", ""),
            "retries": f.get("retries", 0),
            "disk_error": self.disk_error,
            "exit_code": f.get("exit_code"),
            "exit_signal": f.get("exit_signal"),
            "reason": f.get("reason", ""),
            "streams": {
                str(sid): {"written": o.read_end, "acked": o.acked, "memory_only": o.unsafe_bytes,
                           "lost": self.lost[sid][1] - self.lost[sid][0] if sid in self.lost else 0}
                for sid, o in self.out.items()
            },
        }

    async def live_loop(self) -> None:
        """Keep the live status file current for `gcwrap status`."""
        while True:
            self.spooler.write_live(self.live_snapshot())
            await trio.sleep(LIVE_INTERVAL)

    @property
    def unsafe_bytes(self) -> int:
        return sum(o.unsafe_bytes for o in self.out.values())

    @property
    def all_delivered(self) -> bool:
        return self.exit_event is not None and all(o.delivered for o in self.out.values())

    @property
    def stdin_starved(self) -> bool:
        """The job has a --stdin and has not had all of it (nor closed its stdin)."""
        feeder = self.stdin
        return feeder is not None and not feeder.closed and not (feeder.eof and feeder.written >= feeder.fetched)

    def end_job(self, reason: str) -> None:
        """End the running job (SIGTERM to its process group, SIGKILL after
        KILL_GRACE), recording why: in the spool, the live status, the EXIT."""
        if self.child_exited or self.must_end.is_set():
            return
        self.kill_reason = reason
        self.note(reason=reason)
        self.must_end.set()

    @property
    def blocked(self) -> bool:
        """The job's output can go nowhere: paused with the disk failing, or
        ended with output undelivered. Failed attempts count only then."""
        paused = self.blocked_since is not None and bool(self.disk_error)
        return paused or self.exit_event is not None

    # -- the pipe readers ------------------------------------------------

    async def read_pipe(self, out: OutStream, pipe: trio.lowlevel.FdStream) -> None:
        fd = pipe.fileno()
        capacity = grow_pipe(fd)
        fill = BULK_FILL * capacity if capacity >= BULK_MIN_PIPE else 0
        last = trio.current_time()
        limiter = trio.CapacityLimiter(1)
        async with pipe:
            while True:
                if self.unsafe_bytes > self.opts.mem_limit and not self.child_exited:
                    await self._wait_for_room()
                size = 0
                if self._may_splice():
                    await trio.lowlevel.wait_readable(fd)
                    # (Line output stops at the first test: no statvfs per line.)
                    if pipe_bytes(fd) >= SPLICE_MIN and self._spool_has_room(capacity):
                        size = await self._splice(out, fd, limiter)
                now = trio.current_time()
                if size:
                    out.append_extent(size, now)
                    self.stats["spliced"] += size
                else:
                    data = await pipe.receive_some(READ_SIZE)
                    if not data:
                        break
                    now = trio.current_time()
                    out.append(data, now)
                    size = len(data)
                self.changed.fire()
                if self.unsafe_bytes >= self.opts.mem_limit // 4:
                    self.commit_soon.set()  # (group commit: no more waiting)
                if fill and BULK_READ <= size < 1.5 * fill:  # (a full pipe: read again at once)
                    # Bulk output: let the pipe fill to about `fill` at the
                    # job's recent rate (a fast job: a fraction of a ms; a
                    # slow one: BULK_NAP_MAX), so each read, commit and frame
                    # carries more. The job never waits for it: the pipe has
                    # room for twice that. Line output never gets here.
                    rate = size / max(now - last, 1e-6)
                    await trio.sleep(min(BULK_NAP_MAX, fill / rate))
                last = now
        out.eof = True
        self.changed.fire()

    def _may_splice(self) -> bool:
        """The bulk path is open: a spool of natural layout, made by this
        run, that splice works on and that takes bytes; and no
        --write-behind (which keeps acknowledged-in-time output off the disk)."""
        return (self.spooler.zero_copy and not self.spooler.no_splice and not self.disk_error
                and not self.opts.write_behind)

    def _spool_has_room(self, capacity: int) -> bool:
        """Room for two pipefuls beyond what the spool holds (or will)."""
        return self.spooler.room(self.spooled_pending + self.unsafe_bytes) >= 2 * max(capacity, SPLICE_MIN)

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
            self._disk_failed(describe_os_error(e, self.spooler.path))
            return 0

    async def _wait_for_room(self) -> None:
        """Backpressure: stop reading so the job blocks in write().

        The job is paused while any of its readers waits here: the pause is
        one wall-clock interval, from the first reader that stops to the
        last that goes on (two streams paused together are one pause)."""
        self.readers_paused += 1
        if self.readers_paused == 1:
            self.blocked_since = time.monotonic()
            self.pause_said = False
            self.note(state="paused")
        finished = False
        took = 0.0
        try:
            # Once the job has ended, what is left in its pipes is bounded by
            # the pipe buffer: read it to EOF so the end can be recorded.
            while self.unsafe_bytes > self.opts.mem_limit and not self.child_exited:
                # A slow disk, or a network slower than the job, pauses the job
                # for moments: that is ordinary flow control. Say so only when
                # the disk has failed and home is out of reach, and when it ends.
                if self.disk_error and not self.streaming and not self.pause_said:
                    self.pause_said = True
                    log.warning(
                        "output can go neither to disk (%s) nor home (%s): the job is paused until one recovers",
                        self.disk_error, self.net_error or "sending slowly",
                    )
                await self.changed.wait()
            finished = True
        finally:
            self.readers_paused -= 1
            last = self.readers_paused == 0
            if last and self.blocked_since is not None:
                took = time.monotonic() - self.blocked_since
                self.stats["paused"] += took
                self.blocked_since = None
        if finished and last:
            self.note(state="running")
            if self.pause_said:
                log.warning("the job resumes after %.1f s paused", took)

    # -- the spool writer ------------------------------------------------

    @property
    def spooled_pending(self) -> int:
        return sum(max(0, o.spooled_end - o.acked) for o in self.out.values())

    def _unspooled(self, room: int) -> list[Chunk | Extent]:
        """Chunks not yet safe, in order per stream, that fit in `room` bytes."""
        chunks: list[Chunk | Extent] = []
        for out in self.out.values():
            for c in out.unspooled(room):
                if cached(c) > room:  # (an extent is on disk already)
                    break
                chunks.append(c)
                room -= cached(c)
        return chunks

    async def commit_loop(self) -> None:
        """Group commit: whatever piled up while the last transaction ran goes
        in the next one. When the spool cannot take bytes (disk full, limit,
        I/O error) they stay in memory and go home from there."""
        backoff = Backoff(base=0.1, cap=5.0)
        spooler = self.spooler
        last_acks = -ACK_COMMIT_INTERVAL
        while True:
            behind = self.opts.write_behind
            if behind and self.streaming and self.unsafe_bytes < self.opts.mem_limit // 2:
                # Write-behind: what home acknowledges within `behind` seconds
                # never touches the disk. Spool only what is older.
                times = [t for t in (o.oldest_unsafe() for o in self.out.values()) if t is not None]
                due = min(times) + behind - trio.current_time() if times else 0.0
                if due > 0:
                    with trio.move_on_after(due):
                        await self.changed.wait()
                    continue
            room = min(COMMIT_BATCH, spooler.room(self.spooled_pending)) if spooler.spool else COMMIT_BATCH
            chunks = self._unspooled(room)
            waiting = any(o.unsafe_bytes for o in self.out.values())
            took_all = sum(c.size for c in chunks) >= self.unsafe_bytes  # (this commit catches the spool up)
            if waiting and not chunks:
                self._disk_failed(spooler.full_reason or "the spool cannot take more bytes")
            acked = {s: o.acked for s, o in self.out.items() if o.acked > self.committed_acked.get(s, 0)}
            eof = [s for s, o in self.out.items() if o.eof and s not in self.committed_eof and o.safe_end >= o.read_end]
            if acked and not (chunks or eof or self.job_updates):
                # Acknowledgements alone can wait: recorded late, they only
                # mean a resume resends bytes the shadow then trims. Unless
                # the disk is tight: recording them frees the spool's space.
                due = last_acks + ACK_COMMIT_INTERVAL - trio.current_time()
                if due > 0 and not (spooler.full_reason or self.disk_error):
                    with trio.move_on_after(due):
                        await self.changed.wait()
                    continue
            updates, self.job_updates = self.job_updates, {}
            if not (chunks or acked or eof or updates):
                # A full disk frees up by itself (the job deletes files): look again soon.
                with trio.move_on_after(1.0 if waiting else float("inf")):
                    await self.changed.wait()
                continue
            if acked:
                last_acks = trio.current_time()
            started = time.monotonic()
            try:
                await spooler.commit(chunks, acked, eof, updates)
            except BaseException as e:
                # Not recorded: keep the job fields for the next try (or for
                # the final commit, when this one was cancelled).
                self.job_updates = {**updates, **self.job_updates}
                if not isinstance(e, SpoolError):
                    raise
                self._disk_failed(str(e))
                await trio.sleep(backoff.next_delay())
                continue
            backoff.reset()
            if chunks and self.disk_error:
                self.disk_error = ""
            for c in chunks:
                self.out[c.stream].mark_spooled(c.end)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("spool commit in %.1f ms: %s", (time.monotonic() - started) * 1000,
                          self._commit_text(chunks, acked, eof, updates))
            if chunks and took_all and self.disk_said and not self.disk_error and (
                    time.monotonic() - self.disk_failed_at >= DISK_CALM):
                log.warning("the spool takes output again")
                self.disk_said = False
            self.committed_acked.update(acked)
            self.committed_eof.update(eof)
            held = sum(o.mem_bytes for o in self.out.values())
            if held > self.opts.cache_limit:
                share = self.opts.cache_limit // max(1, len(self.out))
                for o in self.out.values():
                    o.evict(share)
            self.changed.fire()
            if chunks and not (self.child_exited or spooler.full_reason or self.disk_error):
                self.commit_soon = trio.Event()
                with trio.move_on_after(COMMIT_PACE):
                    await self.commit_soon.wait()

    def _commit_text(self, chunks: list[Chunk | Extent], acked: dict[int, int], eof: list[int],
                     updates: dict[str, Any]) -> str:
        """What a commit recorded, for -vv."""
        parts = []
        if chunks:
            parts.append(f"{sum(c.size for c in chunks)} bytes in {len(chunks)} row(s)")
        if acked:
            parts.append("acknowledged up to " + ", ".join(f"{self.out[s].kind} {n}" for s, n in acked.items()))
        if eof:
            parts.append("the end of " + ", ".join(self.out[s].kind for s in eof))
        if updates:
            parts.append("job fields " + ", ".join(sorted(updates)))
        return "; ".join(parts)

    def _disk_failed(self, reason: str) -> None:
        self.disk_failed_at = time.monotonic()
        if not self.disk_error:
            self.note(last_error=reason)
        if not self.disk_said:
            # Once per episode (see DISK_CALM): not at every commit a full disk refuses.
            log.warning("%s; output goes home from memory until the spool takes it again", reason)
            self.disk_said = True
        elif reason != self.disk_error:
            log.info("the spool still cannot take output: %s", reason)
        self.disk_error = reason

    async def final_flush(self) -> None:
        """Last chance at the end: spool what is still only in memory,
        ignoring the reserve (the job no longer needs the disk), as much of
        each stream as the disk takes, in order, in pieces that fit its free
        space. What does not fit is the tail of its stream, and lost: its
        range goes to `self.lost`."""
        spooler = self.spooler
        if spooler.spool is not None and spooler.spool.segments is not None:
            spooler.spool.segments.drop_spares()  # their blocks can hold output now
        error = ""
        for out in self.out.values():
            piece = COMMIT_BATCH
            while out.unsafe_bytes and piece >= FLUSH_MIN and not (error and spooler.spool is None):
                budget = min(piece, spooler.free_space() - FLUSH_MARGIN)
                chunks = _fit(out.unspooled(max(budget, 1)), budget)
                if not chunks:
                    break
                try:
                    await spooler.commit(chunks, {}, [], {})
                except SpoolError as e:
                    if not error:
                        log.error("%s", e)
                    error = str(e)
                    piece = sum(cached(c) for c in chunks) // 2
                    continue
                out.mark_spooled(chunks[-1].end)
        eof = [s for s, o in self.out.items() if o.eof and s not in self.committed_eof]
        if eof and spooler.spool is not None:
            try:
                await spooler.commit([], {}, eof, {})
            except SpoolError:
                pass  # (the final record says what the job wrote; EOF only saves a resume a question)
        self.lost = {s: (o.safe_end, o.read_end) for s, o in self.out.items() if o.unsafe_bytes}

    def loss(self) -> str:
        """What is lost, in words ("" if nothing)."""
        return loss_text((self.out[s].kind, start, end) for s, (start, end) in sorted(self.lost.items()))

    # -- delivery --------------------------------------------------------

    async def _connect(self, host: str, port: int) -> tuple[trio.abc.Stream, trio.SocketStream]:
        """A connection to the shadow: TCP, and TLS over it when configured."""
        with trio.fail_after(self.opts.connect_timeout or 3 * self.opts.heartbeat):
            tcp = await trio.open_tcp_stream(host, port)
            if self.opts.tls is None:
                return tcp, tcp
            tls = trio.SSLStream(tcp, self.opts.tls, server_hostname=host)
            try:
                await tls.do_handshake()
            except BaseException as e:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(tcp)
                if isinstance(e.__cause__, ssl.SSLCertVerificationError):
                    raise ShadowRefused(
                        ErrorCode.AUTH_FAILED,
                        f"the shadow's certificate failed verification: {e.__cause__.verify_message}",
                        permanent=True,
                    ) from None
                raise
            return tls, tcp

    async def deliver_loop(self) -> None:
        """Connect, run a session, back off, repeat, until the shadow said DONE,
        the retry limit is reached, or the job ended while the shadow refuses it."""
        assert self.opts.shadow is not None
        host, port = self.opts.shadow
        where = f"{host}:{port}"
        backoff = Backoff(cap=self.opts.retry_timeout)
        while True:
            self.stats["attempts"] += 1
            seen = (self.stop.signals, self.exit_event is not None)
            session = Session(self, where)
            error: BaseException
            try:
                dialled = time.monotonic()
                stream, tcp = await self._connect(host, port)
                self.connected_since = time.monotonic()
                log.info("connected to %s from %s in %.3f s (attempt %d)", where, _local_address(tcp),
                         self.connected_since - dialled, int(self.stats["attempts"]))
                try:
                    await session.run(stream, tcp.socket)
                finally:
                    self.streaming = False
                    up = time.monotonic() - self.connected_since
                    self.stats["connected_s"] += up
                    self.connected_since = None
                    log.info("connection to %s closed after %.1f s", where, up)
                    with trio.CancelScope(shield=True):
                        await trio.aclose_forcefully(tcp)
                    self.note(connected=False)
            except SessionEnd:
                log.info("the shadow holds every byte and the exit status: %s",
                         ", ".join(f"{o.kind} {o.acked} bytes" for o in self.out.values()) or "no output")
                self.delivered.set()
                self.changed.fire()
                return
            except Exception as e:  # noqa: BLE001 - every failure is classified and retried
                log.debug("session failed", exc_info=True)
                error = e
            if session.welcomed and session.progressed:
                # Only a session that moved bytes counts as success: one that is
                # welcomed and then fails every time must not retry forever.
                backoff.reset()
                self.failures_blocked = 0
            reason = describe(error, where)
            self.net_error = reason
            if self.blocked:
                self.failures_blocked += 1
            self.stats["failures"] += 1
            self.note(last_error=reason, retries=int(self.stats["failures"]))
            refused = isinstance(error, ShadowRefused) and error.permanent
            if refused and self.stdin_starved and not self.child_exited:
                # A job whose stdin can never be fed must not wait for it (nor
                # compute from missing input): end it, as a batch system would
                # not have started it. Its output so far stays in the spool.
                log.info("%s; ending the job, its stdin can never be fed", reason)
                self.end_job(f"the job's stdin {self.opts.stdin!r} can never be fed ({reason}): the job was ended")
            elif refused:
                # Refused for good (token, name, owner...): something to fix at
                # home. The job keeps running into its spool; say so now, loudly.
                if self.refusal is None or str(self.refusal) != str(error):
                    log.error("%s; the job goes on, its output is kept in the spool", reason)
            if refused:
                self.refusal = error  # type: ignore[assignment]
                if self.exit_event is not None:
                    return  # the job has ended: retrying now changes nothing
            elif not self.outage_reported:
                where_now = f"the spool {self.spooler.path}" if self.spooler.spool else "memory (no spool)"
                log.warning("%s; output waits in %s, retrying", reason, where_now)
                self.outage_reported = True
                self.outage_since = time.monotonic()
            else:
                log.info("%s (attempt %d)", reason, int(self.stats["attempts"]))
            limit = self.opts.retry_limit
            if limit and self.failures_blocked >= limit:
                ended = self.exit_event is not None
                self.give_up = Outcome(
                    exitcodes.UNDELIVERED if ended else exitcodes.RETRY_LIMIT,
                    message=(
                        f"retry limit reached: {self.failures_blocked} consecutive failed attempts "
                        + ("after the job ended" if ended else "while the job's output could go nowhere")
                        + f" (last: {reason})"
                    ),
                )
                return
            delay = self.opts.retry_timeout if refused else backoff.next_delay()
            if isinstance(error, ShadowRefused) and error.retry_after:
                delay = max(delay, min(error.retry_after, self.opts.retry_timeout))
            if self.blocked and limit:
                log.info("next attempt in %.1f s (%d of --retry-limit %d used)", delay, self.failures_blocked, limit)
            else:
                log.info("next attempt in %.1f s", delay)
            with trio.move_on_after(delay):
                # ...but a refused job that ends gets its last try at once, and
                # so does one told to stop by a signal (see StopClock).
                while not (refused and self.exit_event is not None) and not self._hurry(seen):
                    await self.changed.wait()

    def summary(self) -> dict[str, Any]:
        """The I/O summary, in the spirit of Condor's: what moved, how, how long."""
        wall = max(time.monotonic() - self.started, 1e-6)
        total = sum(o.read_end for o in self.out.values())
        out: dict[str, Any] = {f"{o.kind}_bytes": o.read_end for o in self.out.values()}
        live = time.monotonic() - self.connected_since if self.connected_since is not None else 0.0
        connected = min(self.stats["connected_s"] + live, wall)
        paused = self.stats["paused"] + (time.monotonic() - self.blocked_since if self.blocked_since is not None else 0)
        out.update(
            wall_s=round(wall, 3),
            throughput_mb_s=round(total / wall / 1e6, 3),
            connected_s=round(connected, 3),
            disconnected_s=round(wall - connected, 3),
            paused_s=round(min(paused, wall), 3),
            connections=int(self.stats["connects"]),
            reconnects=max(0, int(self.stats["connects"]) - 1),
            # Attempts that never got a session; a session lost later is a reconnect.
            failed_attempts=int(self.stats["attempts"] - self.stats["connects"]),
            zero_copy_pct=round(100 * self.stats["spliced"] / total, 1) if total else 0.0,
            job_started=round(self.job.started, 3),  # (a resume's summary tells the job's times, not its own)
        )
        if self.lost:
            out["lost"] = sum(end - start for start, end in self.lost.values())
        ended = self.live_fields.get("ended") or self.job.ended
        if ended:
            out["job_ended"] = round(ended, 3)
        return out

    def interrupt(self, reason: str) -> None:
        """Stop delivering now; what is not home stays in the spool."""
        if self.give_up is None and not self.delivered.is_set():
            self.give_up = Outcome(exitcodes.UNDELIVERED, message=reason)
        if self.delivery_scope is not None:
            self.delivery_scope.cancel()

    def not_home(self) -> str:
        """Per stream, the bytes home has not acknowledged, in words."""
        return ", ".join(f"{o.read_end - o.acked:,} bytes of {o.kind} ({o.name})" for o in self.out.values())

    def _hurry(self, seen: tuple[int, bool]) -> bool:
        """A signal came (or the job ended after one) since the attempt that
        saw `seen`: make the last attempt now, not after the backoff."""
        now = (self.stop.signals, self.exit_event is not None)
        return bool(self.stop.signals) and now[1] and now != seen

    def exit_frame(self) -> Exit:
        """The EXIT to send, with the summary as of now."""
        assert self.exit_event is not None
        pairs = tuple((k, str(v)) for k, v in self.summary().items())
        # (The lengths as of now: a resume may learn that home holds more than its spool.)
        lengths = tuple((s, o.read_end) for s, o in self.out.items())
        return dataclasses.replace(self.exit_event, summary=pairs, lengths=lengths)

    def on_welcome(self) -> None:
        first = not self.stats["connects"]
        self.stats["connects"] += 1
        if self.outage_reported:
            # "Again" only if there was a connection before this outage.
            log.warning("connected to the shadow %s after %.1f s; delivering the backlog",
                        "for the first time" if first else "again", time.monotonic() - self.outage_since)
            self.outage_reported = False
        if log.isEnabledFor(logging.INFO):
            held = ", ".join(f"{o.acked} of {o.read_end} bytes of {o.kind} ({o.name})" for o in self.out.values())
            log.info("welcomed by the shadow (connection %d): it holds %s; sending from there",
                     int(self.stats["connects"]), held or "no output stream")
        self.net_error = ""
        self.refusal = None
        self.streaming = True
        self.note(connected=True, last_error="")


# -- running a job ------------------------------------------------------------


def _fit(chunks: list[Chunk | Extent], budget: int) -> list[Chunk | Extent]:
    """The first of a stream's unspooled chunks, holding at most `budget`
    bytes of memory (the last one cut to fit); extents, already on disk,
    cost nothing."""
    out: list[Chunk | Extent] = []
    for c in chunks:
        if isinstance(c, Extent):
            out.append(c)
            continue
        if budget <= 0:
            break
        if c.size > budget:
            out.append(Chunk(c.stream, c.start, bytes(c.data[:budget])))
            break
        out.append(c)
        budget -= c.size
    return out
def _local_address(tcp: trio.SocketStream) -> str:
    try:
        host, port = tcp.socket.getsockname()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def grow_pipe(fd: int) -> int:
    """Fewer, larger reads: a 1 MiB pipe instead of the default 64 KiB (the
    kernel may refuse above /proc/sys/fs/pipe-max-size: then keep its size).
    Returns the pipe's capacity in bytes (0 if unknown)."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
    except OSError:
        pass
    try:
        return fcntl.fcntl(fd, getattr(fcntl, "F_GETPIPE_SZ", 1032))
    except OSError:
        return 0


def pipe_bytes(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD); 0 if unknown."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return buf[0]


def _interactive() -> bool:
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _signal_job(proc: trio.Process, signum: int) -> None:
    """Signal the job's whole process group when it has its own (a shell
    script's children must get the batch system's SIGTERM too)."""
    if proc.returncode is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signum)
            return
    except ProcessLookupError:
        return
    proc.send_signal(signum)


async def _forward_signals(proc: trio.Process, agent: Agent, signals: AsyncIterator[int]) -> None:
    """SIGTERM, SIGINT and SIGHUP go to the job while it runs, and start
    gcwrap's own end: it delivers for a bounded grace (see StopClock), then
    keeps the rest in the spool. A batch system signals the job and gcwrap
    together: the job may well die before gcwrap reads its copy, so the
    first signal still leaves time to deliver; a second one stops at once."""
    async for signum in signals:
        name = signal.Signals(signum).name
        agent.stop.signal(trio.current_time(), name)
        agent.changed.fire()
        if proc.returncode is None:
            log.info("forwarding %s to the job", name)
            _signal_job(proc, signum)
        elif agent.job_group is not None and agent.exit_event is None:
            # The job's process has ended; what it started in the background holds its pipes: it gets the signal
            # (as from a batch system), and gcwrap reads them until the stop clock's deadline at most.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.job_group, signum)
        if agent.pipes_scope is not None:
            agent.pipes_scope.deadline = min(agent.pipes_scope.deadline, agent.stop.deadline)
        if proc.returncode is not None and agent.stop.signals == 1 and agent.delivering:
            log.warning("%s received: delivering for at most %g s more (again to stop now)", name, agent.stop.grace)


async def _obey_signals(agent: Agent, signals: AsyncIterator[int]) -> None:
    """`gcwrap resume`: each signal moves the end of delivery to the stop clock's deadline."""
    async for signum in signals:
        agent.stop.signal(trio.current_time(), signal.Signals(signum).name)
        if agent.stop.signals == 1:
            log.warning("%s received: delivering for at most %g s more (again to stop now)", agent.stop.name,
                        agent.stop.grace)
        if agent.delivery_scope is not None:
            agent.delivery_scope.deadline = agent.stop.deadline
        agent.changed.fire()


async def _stop_delivery(agent: Agent, delivery_done: trio.Event) -> None:
    """The stop clock ran out: stop delivering, and say what waits in the spool."""
    stop = agent.stop
    how = "a second signal" if stop.signals > 1 else f"the {stop.grace:g} s grace"
    agent.interrupt(f"{stop.name} received: delivery stopped after {how}")
    await delivery_done.wait()
    if agent.give_up is not None and not agent.delivered.is_set():
        agent.give_up.message += f"; not yet home: {agent.not_home()}"


async def _write_stdin(agent: Agent, pipe: trio.abc.SendStream) -> None:
    feeder = agent.stdin
    assert feeder is not None
    async with pipe:
        while True:
            data = feeder.take()
            if data is None:
                if feeder.eof:
                    return
                await agent.changed.wait()
                continue
            try:
                await pipe.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                feeder.closed = True  # the job closed its stdin: stop fetching
                return
            agent.changed.fire()


async def _end_job(proc: trio.Process, grace: float) -> None:
    if proc.returncode is None:
        _signal_job(proc, signal.SIGTERM)
        with trio.move_on_after(grace):
            await proc.wait()
        if proc.returncode is None:
            _signal_job(proc, signal.SIGKILL)
            await proc.wait()


def stop_signals() -> tuple[int, ...]:
    """STOP_SIGNALS, less SIGHUP if it was ignored when gcwrap started
    (`nohup gcwrap ...`): a hangup then ends neither gcwrap nor its job."""
    return tuple(s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN)


async def run_job(
    opts: AgentOptions, command: list[str], job: JobRecord, spool_path: Path
) -> Outcome:
    # SIGTERM, SIGINT and SIGHUP are ours from before the job starts to
    # gcwrap's last word: one that came before `_forward_signals` runs would
    # otherwise end gcwrap at once (and orphan the job), one that comes
    # during the last commit, before it prints what happened.
    with trio.open_signal_receiver(*stop_signals()) as signals:
        return await _run_job(opts, command, job, spool_path, signals)


async def _run_job(
    opts: AgentOptions, command: list[str], job: JobRecord, spool_path: Path, signals: AsyncIterator[int]
) -> Outcome:
    specs = stream_specs(opts)
    if not specs and opts.shadow is not None:
        # Nothing to deliver: every stream passes through. No spool, no
        # session, no retries: the shadow's state cannot hold the job up.
        log.info("no stream is named (--stdout, --stderr, --stdin): nothing goes to the shadow at %s:%d, "
                 "the job's streams pass through", *opts.shadow)
        opts = dataclasses.replace(opts, shadow=None)
    spooler = Spooler(
        spool_path, job, [(s.id, s.kind, s.name) for s in specs], limit=opts.spool_limit, min_free=opts.min_free
    )
    spool_error = ""
    if specs:
        # The spool exists before the job writes a byte: a wrapper killed in
        # the first instant must not lose what the job wrote. If the disk
        # refuses, the job runs anyway and the commit loop keeps trying.
        try:
            await spooler.ensure()
        except SpoolError as e:
            log.warning("%s; the job runs anyway, its output goes home from memory", e)
            spool_error = str(e)
    agent = Agent(opts, spooler, job, specs)
    if specs and spooler.spool is None:
        agent.disk_error = spool_error
    pipe = subprocess.PIPE
    try:
        proc = await trio.lowlevel.open_process(
            command,
            stdin=pipe if opts.stdin is not None else None,
            stdout=pipe if opts.stdout is not None else None,
            stderr=subprocess.STDOUT if opts.merge_stderr else pipe if opts.stderr is not None else None,
            # Its own process group, so signals reach the whole job; not at an
            # interactive terminal, where the job must stay in the foreground.
            process_group=None if _interactive() else 0,
        )
    except OSError as e:
        spooler.close(remove=True)
        code = exitcodes.NOT_FOUND if e.errno == errno.ENOENT else exitcodes.CANNOT_EXECUTE
        why = e.strerror
        if e.errno in (errno.EMFILE, errno.ENFILE):
            why = "out of file descriptors (raise `ulimit -n`)"
        return Outcome(code, message=f"cannot run {command[0]}: {why}")
    agent.note(child_pid=proc.pid, state="running")
    agent.job_group = None if _interactive() else proc.pid
    log.info("job %s started: pid %d, spool %s", job.job_id, proc.pid, spool_path if specs else "none (nothing to spool)")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_forward_signals, proc, agent, signals)
        with first_error():
            status = await _supervise(agent, proc)
        if not agent.delivered.is_set():
            await agent.final_flush()
        outcome = _finish(agent, status)
        outcome.stats = agent.summary()
        nursery.cancel_scope.cancel()
    return outcome


async def _supervise(agent: Agent, proc: trio.Process) -> int:
    """Run the job's tasks until the job has ended and its output is home
    (or can never get there); return the job's exit status."""
    delivery_done = trio.Event()

    async def deliver() -> None:
        try:
            if agent.opts.shadow is not None:
                with trio.CancelScope() as agent.delivery_scope:
                    agent.delivering = True
                    await agent.deliver_loop()
        finally:
            agent.delivering = False
            delivery_done.set()
            agent.changed.fire()
            if agent.give_up is not None and agent.exit_event is None:
                # Past the retry limit with nowhere to put the output: end the job, and say why.
                agent.kill_reason = agent.give_up.message
                with trio.CancelScope(shield=True):
                    await _end_job(proc, KILL_GRACE)

    async def end_when_asked() -> None:
        await agent.must_end.wait()
        with trio.CancelScope(shield=True):
            await _end_job(proc, KILL_GRACE)

    async with trio.open_nursery() as nursery:
        if agent.specs:  # with no stream named there is nothing to spool
            nursery.start_soon(agent.commit_loop)
            nursery.start_soon(agent.live_loop)
        nursery.start_soon(end_when_asked)
        if proc.stdin is not None:
            nursery.start_soon(_write_stdin, agent, proc.stdin)
        nursery.start_soon(deliver)
        async with trio.open_nursery() as readers:
            if proc.stdout is not None:
                readers.start_soon(agent.read_pipe, agent.out[STDOUT], proc.stdout)
            if proc.stderr is not None:
                readers.start_soon(agent.read_pipe, agent.out[STDERR], proc.stderr)
            await proc.wait()
            agent.pipes_scope = readers.cancel_scope
            stop = agent.stop  # a signal came while it ran: the pipes are read as long as delivery goes on (StopClock)
            readers.cancel_scope.deadline = (
                max(stop.deadline, trio.current_time() + stop.last_try) if stop.signals == 1 else stop.deadline)
            agent.child_exited = True
            agent.commit_soon.set()
            agent.changed.fire()
            if delivery_done.is_set() and not agent.delivered.is_set():
                # gcwrap gave up and ended the job. What its pipes still hold
                # is read (so it is counted: kept if the disk takes it, else
                # reported lost), but a process that outlived the job and
                # keeps a pipe open must not hold gcwrap for long.
                readers.cancel_scope.deadline = trio.current_time() + DRAIN_GRACE
        returncode = proc.returncode
        assert returncode is not None
        log.info("the job ended with %s after %.1f s; %d bytes not yet home",
                 f"signal {-returncode}" if returncode < 0 else f"status {returncode}",
                 time.monotonic() - agent.started, sum(o.read_end - o.acked for o in agent.out.values()))
        agent.exit_event = Exit(
            code=returncode if returncode >= 0 else None,
            signal=-returncode if returncode < 0 else None,
            lengths=tuple((s, o.read_end) for s, o in agent.out.items()),
            reason=agent.kill_reason,
        )
        agent.note(
            state="exited", ended=time.time(), exit_code=agent.exit_event.code,
            exit_signal=agent.exit_event.signal, reason=agent.kill_reason,
        )
        if agent.opts.shadow is None:
            agent.delivered.set()
        agent.stop.job_ended(trio.current_time())
        while not (agent.delivered.is_set() or delivery_done.is_set()):
            if trio.current_time() >= agent.stop.deadline:
                await _stop_delivery(agent, delivery_done)
                break
            with trio.move_on_at(agent.stop.deadline):
                await agent.changed.wait()
        nursery.cancel_scope.cancel()
    return exit_status(returncode)


async def _report_progress(agent: Agent, progress: Callable[[int, int], None], start: dict[int, int]) -> None:
    total = sum(o.read_end - start[sid] for sid, o in agent.out.items())
    try:
        while True:
            progress(sum(o.acked - start[sid] for sid, o in agent.out.items()), total)
            await trio.sleep(0.2)
    finally:
        progress(sum(o.acked - start[sid] for sid, o in agent.out.items()), total)


def _finish(agent: Agent, job_status: int | None) -> Outcome:
    """Delete a delivered spool; keep one that still holds output and say
    why; say what is lost (`agent.lost`), which comes first in the status."""
    spooler = agent.spooler
    if agent.delivered.is_set() and not agent.lost:
        spooler.close(remove=True)
        return Outcome(job_status if job_status is not None else 0, job_status)
    path = spooler.path if spooler.spool is not None else None
    loss = agent.loss()
    if agent.delivered.is_set():
        # (A resumed spool whose run lost its tail: what it held is home.)
        spooler.close(remove=True)
        where = f"{agent.opts.shadow[0]}:{agent.opts.shadow[1]}" if agent.opts.shadow else "home"
        return Outcome(exitcodes.LOST, job_status, f"what the spool held is delivered to {where}; lost when the "
                                                   f"job ran: {loss}")
    final = dict(agent.job_updates, connected=False, summary=agent.summary())
    if agent.give_up is not None:
        final.update(state="gave-up", last_error=agent.give_up.message)
        if agent.kill_reason:
            final.update(reason=agent.kill_reason)
    elif agent.refusal is not None:
        final.update(state="refused", last_error=describe(agent.refusal))
    agent.live_fields.update({k: v for k, v in final.items() if k != "summary"})
    spooler.write_live(agent.live_snapshot())
    acked = {s: o.acked for s, o in agent.out.items()}
    # What the job wrote: bytes past what the spool holds are on record as lost.
    # (A resume knows only what its spool holds, and keeps the record it found.)
    written = None if agent.resuming else {s: o.read_end for s, o in agent.out.items()}
    if not spooler.last_commit(final, acked, written) and path is not None:
        log.error("could not record the job's final state in %s", path)
    spooler.close()
    if agent.refusal is not None:
        outcome = Outcome(exitcodes.REFUSED, job_status, agent.kill_reason or describe(agent.refusal), path,
                          refused=True)
    elif agent.give_up is not None:
        outcome = agent.give_up
        outcome.job_status, outcome.spool = job_status, path
    else:
        outcome = Outcome(exitcodes.UNDELIVERED, job_status, "output was not delivered", path)
    outcome.pending = sum(max(0, o.safe_end - o.acked) for o in agent.out.values()) if path is not None else 0
    if loss:
        outcome.status = exitcodes.LOST
        outcome.lost = (f"LOST: {loss}: held only in memory, and neither the disk nor home could take them"
                        if not agent.resuming else f"lost when the job ran: {loss}")
    return outcome


async def resume_spool(
    opts: AgentOptions, path: Path, progress: Callable[[int, int], None] | None = None
) -> Outcome:
    """Deliver what a spool left behind (a killed wrapper, an outage at job end).
    `progress(done, total)` is called as bytes are acknowledged."""
    try:
        lock_fd = lock_spool(path)
    except BlockingIOError:
        return Outcome(exitcodes.INTERNAL, message=f"spool {path} is in use by a running gcwrap")
    except OSError as e:
        return Outcome(exitcodes.INTERNAL, message=f"cannot open spool {path}: {e.strerror}")
    try:
        spool = await trio.to_thread.run_sync(Spool.open, path)
        job = spool.job()
        states = spool.streams()
    except SpoolError as e:
        os.close(lock_fd)
        return Outcome(exitcodes.INTERNAL, message=str(e))
    specs = [StreamSpec(s.id, s.kind, s.name) for s in states.values() if s.kind != "stdin"]
    spooler = Spooler(path, job, [], spool=spool, lock_fd=lock_fd)
    agent = Agent(opts, spooler, job, specs)
    agent.resuming = True
    for sid, out in agent.out.items():
        st = states[sid]
        out.read_end = out.spooled_end = st.appended
        out.acked = st.acked
        out.eof = True
        agent.committed_acked[sid] = st.acked
        agent.committed_eof.add(sid)
        if st.lost:
            agent.lost[sid] = (st.appended, st.appended + st.lost)
    lengths = tuple((sid, o.read_end) for sid, o in agent.out.items())
    # Home is told what the run lost, with why the job ended.
    loss = f"lost: {agent.loss()}" if agent.lost else ""
    if job.exit_code is None and job.exit_signal is None:
        reason = "gcwrap ended before the job did; the job's exit status is unknown"
        agent.exit_event = Exit(None, None, lengths, reason="; ".join(filter(None, (reason, loss))))
    else:
        agent.exit_event = Exit(job.exit_code, job.exit_signal, lengths,
                                reason="; ".join(filter(None, (job.reason, loss))))
    # SIGTERM, SIGINT and SIGHUP are obeyed as by a run whose job has ended:
    # delivery goes on for the grace (none after a second one), the rest stays in the spool.
    with first_error(), trio.open_signal_receiver(*stop_signals()) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.commit_loop)
            nursery.start_soon(agent.live_loop)
            nursery.start_soon(_obey_signals, agent, signals)
            start = {sid: o.acked for sid, o in agent.out.items()}
            if progress is not None:
                nursery.start_soon(_report_progress, agent, progress, start)
            with trio.CancelScope() as agent.delivery_scope:
                await agent.deliver_loop()
            if agent.delivery_scope.cancelled_caught and not agent.delivered.is_set():
                how = "a second signal" if agent.stop.signals > 1 else f"the {agent.stop.grace:g} s grace"
                agent.interrupt(f"{agent.stop.name} received: delivery stopped after {how}")
                assert agent.give_up is not None
                agent.give_up.message += f"; not yet home: {agent.not_home()}"
            nursery.cancel_scope.cancel()
    job_status = None
    if job.exit_signal is not None:
        job_status = 128 + job.exit_signal
    elif job.exit_code is not None:
        job_status = job.exit_code
    outcome = _finish(agent, job_status)
    if agent.delivered.is_set() and not agent.lost:
        outcome.status = 0
    outcome.stats = agent.summary()
    outcome.signalled = agent.stop.name
    return outcome
