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

The agent's tasks (`read_pipe` per stream, `commit_loop`, the only writer
of the spool, and `deliver_loop`) share the streams through the `Outbox`;
gcwrap.agent.run starts them beside the job.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .. import exitcodes
from ..wire.compress import Mode, WireStats, available, offered
from ..wire.events import FILES_FEATURE, NOTES_FEATURE, ErrorCode, Exit, Hello, StreamSpec
from .addresses import Address, show
from .options import AgentOptions
from .outbox import Outbox, OutStream, cached, fit
from .pipes import grow_pipe, pipe_bytes
from .policy import CommitPlan, DiskHealth, RetryPolicy, StopClock
from .records import UNSUPPORTED_ERRNOS, Chunk, Extent, JobRecord, Outcome, commit_text, loss_text
from .retry import Backoff, SessionEnd, ShadowRefused, describe
from .shadows import ShadowList, connect, given_up, local_address
from .spool import SpoolError, describe_os_error
from .spooler import Spooler
from .timeline import Journal

if TYPE_CHECKING:  # (loaded by the deliver loop: a run with nothing to deliver needs no session)
    from .sender import Session

log = logging.getLogger("gcwrap")


@functools.cache  # once a process, however many spools a resume delivers
def say_no_codec() -> None:
    log.info("compression left out: this Python has no zstandard package (pip install zstandard to have it)")


READ_SIZE = 1 << 20  # a read returns what the pipe holds: large reads cost no latency
COMMIT_BATCH = 8 << 20  # at most this many bytes per spool transaction
# Bulk output: a reader that wakes for every write of a fast job reads a few
# KiB at a time, and every wake-up costs a trip through the event loop, the
# spool and the sender. After a large read, let the pipe fill for a moment.
BULK_READ = 64 << 10  # a read at least this large means the job writes in bulk...
BULK_NAP_MAX = 0.02  # ...so wait up to this long (seconds) before reading again,
BULK_FILL = 0.5  # until the pipe is about this full at the job's recent rate
BULK_MIN_PIPE = 512 << 10  # only with a pipe this large (it must not fill during the nap)
SPLICE_MIN = 64 << 10  # a pipe holding at least this much is spliced into the spool, not read
SMALL_READ = 64 << 10  # a read into memory asks for at least this much (see read_size)
LINE_RATE = 1 << 20  # bytes/s: small reads coming at least this fast are from a fast line writer...
LINE_GAP = 0.001  # ...whose lines then gather in the pipe this long (seconds) before the next read
LIVE_INTERVAL = 0.5  # seconds between rewrites of the live status file
# The final flush (see Agent.final_flush) leaves this much free for the rows and WAL
# pages that record its pieces, and gives up on pieces smaller than FLUSH_MIN the disk refuses.
FLUSH_MARGIN = 64 << 10
FLUSH_MIN = 4 << 10


def read_size(held: int) -> int:
    """How much one read into memory asks for: what the pipe holds (FIONREAD)
    and room for what comes meanwhile, at most READ_SIZE. Python allocates
    all it asks for before the read and gives the rest back after it: a
    1 MiB buffer per read is an mmap, page faults, an mremap and a munmap
    (line output at a moderate rate reads a few KiB a time, thousands of
    times a second); SMALL_READ comes from the heap, without a system call."""
    return min(READ_SIZE, max(held, SMALL_READ))


class Agent:
    """Runs one job's delivery: reads its pipes into the outbox, records
    what the outbox holds in the spool (the commit loop), delivers it home
    one session at a time (the deliver loop), and keeps the live view and
    the summary. Its state of the streams is the outbox's; its policies
    (CommitPlan, RetryPolicy, DiskHealth, StopClock) are pure objects in
    gcwrap.agent.policy, driven by trio.current_time()."""

    def __init__(
        self, opts: AgentOptions, spooler: Spooler, job: JobRecord, specs: list[StreamSpec], *, resuming: bool = False,
        started: float | None = None,
    ) -> None:
        self.opts = opts
        if opts.compress is not Mode.NONE and not available():
            say_no_codec()
        self.spooler = spooler
        self.job = job
        self.specs = specs
        self.outbox = Outbox(specs, resuming=resuming)
        self.out = self.outbox.streams  # (the outbox's, by a shorter name)
        self.changed = self.outbox.changed
        self.job_updates: dict[str, Any] = {}
        self.live_fields: dict[str, Any] = {}
        self.delivered = trio.Event()
        self.commit_soon = trio.Event()  # set: the commit loop stops gathering (see COMMIT_PACE)
        self.plan = CommitPlan(mem_limit=opts.mem_limit, cache_limit=opts.cache_limit, write_behind=opts.write_behind)
        self.retry = RetryPolicy(limit=opts.retry_limit, retry_timeout=opts.retry_timeout)
        self.shadows = ShadowList.for_job(opts.shadows, job.job_id)
        self.disk = DiskHealth()
        self.blocked_since: float | None = None  # when the job's current pause began (None: not paused)
        self.readers_paused = 0  # pipe readers held by backpressure now: the job is paused while any is
        self.pause_said = False  # the current pause was announced (the disk had failed)
        self.net_error = ""
        self.outage_reported = False
        self.outage_since = 0.0  # when the outage that was reported began
        self.give_up: Outcome | None = None
        self.refusal: ShadowRefused | None = None
        self.kill_reason = ""  # why gcwrap ended the job, when it did
        self.lost: dict[int, tuple[int, int]] = {}  # stream -> [start, end) that nothing holds (see final_flush)
        self.must_end = trio.Event()  # set: end the job now (see `end_job`)
        self.stats = dict.fromkeys(("connects", "attempts", "failures", "paused", "spliced"), 0.0)
        self.wire = WireStats()  # output sent by this run, on the wire
        self.started = time.monotonic() if started is None else started  # (time.monotonic()'s clock)
        # The link's clock and the notes for home (times on trio's clock).
        self.journal = Journal(opts.heartbeat, lambda t: t + time.time() - trio.current_time())
        self.acked_at_welcome: int | None = None  # a resume's first welcome: bytes home held then
        self.delivery_scope: trio.CancelScope | None = None
        self.stop = StopClock()
        self.delivering = False  # the deliver loop runs
        self.child_exited = False
        self.streaming = False  # a session is welcomed and running
        if opts.files:  # (the files' sender, and its delta code, only for a job with --file)
            from .filesender import FileSender
        self.files = FileSender(Path.cwd(), opts.files, self.changed, spooler.record_files,
                                self.journal.note) if opts.files else None

    # -- shared state helpers ---------------------------------------------

    def note_live(self, **fields: Any) -> None:  # (fields the spool's job record has no place for)
        self.live_fields.update(fields)

    def note(self, **fields: Any) -> None:  # (fields for the spool's job record at the next commit; the live view)
        self.job_updates.update(fields)
        self.live_fields.update(fields)
        self.changed.fire()

    def live_snapshot(self) -> dict[str, Any]:
        f = self.live_fields
        wall = time.time() - trio.current_time()  # (read times are on trio's clock)
        return {
            "t": round(time.time(), 3),
            "state": f.get("state", "starting"),
            "connected": bool(f.get("connected", False)),
            "last_error": f.get("last_error", ""),
            "retries": f.get("retries", 0),
            "shadow": f.get("shadow", ""),  # the shadow in use (the last to welcome the agent)
            "failovers": f.get("failovers", 0),
            "disk_error": self.disk.error,
            "exit_code": f.get("exit_code"),
            "exit_signal": f.get("exit_signal"),
            "reason": f.get("reason", ""),
            "streams": {
                str(sid): {"written": o.read_end, "acked": o.acked, "memory_only": o.unsafe_bytes,
                           # when the oldest byte held only in memory was read (the spool knows its own)
                           "memory_since": None if (t := o.oldest_unsafe()) is None else round(t + wall, 3),
                           "lost": self.lost[sid][1] - self.lost[sid][0] if sid in self.lost else 0}
                for sid, o in self.out.items()
            },
            "wire": self.wire.as_dict(),
            "files": self.files.live() if self.files is not None else [],  # (`FileSender.live`)
            # since when output has waited with nothing acknowledged (None: nothing waits)
            "waiting_since": None if (w := self.journal.link.waiting_since) is None else round(w + wall, 3),
        }

    async def live_loop(self) -> None:
        """Keep the live status file current for `gcwrap status`."""
        while True:
            self.spooler.write_live(self.live_snapshot())
            await trio.sleep(LIVE_INTERVAL)

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
        paused = self.blocked_since is not None and self.disk.refusing
        return paused or self.outbox.exit is not None

    # -- the pipe readers ------------------------------------------------

    async def read_pipe(self, out: OutStream, pipe: trio.abc.ReceiveStream) -> None:
        assert isinstance(pipe, trio.lowlevel.FdStream)  # (a child's pipe, on Unix)
        fd = pipe.fileno()
        capacity = grow_pipe(fd)
        fill = BULK_FILL * capacity if capacity >= BULK_MIN_PIPE else 0
        last = trio.current_time()
        limiter = trio.CapacityLimiter(1)
        async with pipe:
            while True:
                if self.outbox.unsafe_bytes > self.opts.mem_limit and not self.child_exited:
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
                    self.stats["spliced"] += size
                else:
                    data = await pipe.receive_some(read_size(held))
                    if not data:
                        break
                    now = trio.current_time()
                    out.append(data, now)
                    size = len(data)
                self.journal.link.output(now)
                self.changed.fire()
                if self.outbox.unsafe_bytes >= self.opts.mem_limit // 4:
                    self.commit_soon.set()  # (group commit: no more waiting)
                if fill and BULK_READ <= size < 1.5 * fill:  # (a full pipe: read again at once)
                    # Bulk output: let the pipe fill to about `fill` at the
                    # job's recent rate (a fast job: a fraction of a ms; a
                    # slow one: BULK_NAP_MAX), so each read, commit and frame
                    # carries more. The job never waits for it: the pipe has
                    # room for twice that. Line output never gets here.
                    rate = size / max(now - last, 1e-6)
                    await trio.sleep(min(BULK_NAP_MAX, fill / rate))
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
        self.changed.fire()

    def _may_splice(self) -> bool:
        """The bulk path is open: a spool of natural layout, made by this
        run, that splice works on and that takes bytes; and no
        --write-behind (which keeps acknowledged-in-time output off the disk)."""
        return (self.spooler.zero_copy and not self.spooler.no_splice and not self.disk.error
                and not self.opts.write_behind)

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
            while self.outbox.unsafe_bytes > self.opts.mem_limit and not self.child_exited:
                # A slow disk, or a network slower than the job, pauses the job
                # for moments: that is ordinary flow control. Say so only when
                # the disk has failed and home is out of reach (an attempt
                # failed: not while the first connects), and when it ends.
                if self.disk.refusing and not self.streaming and self.net_error and not self.pause_said:
                    self.pause_said = True
                    log.warning(
                        "output can go neither to disk (%s) nor home (%s): the job is paused until one recovers",
                        self.disk.error, self.net_error,
                    )
                    self.journal.note(trio.current_time(), "paused",
                                      reason=f"disk: {self.disk.error}; home: {self.net_error}")
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
                why = "home takes the output again" if self.streaming else "the spool takes output again"
                self.journal.note(trio.current_time(), "resumed", reason=why, paused_s=round(took, 3))

    # -- the spool writer ------------------------------------------------

    async def _wait_changed(self, seconds: float) -> None:
        with trio.move_on_after(seconds):
            await self.changed.wait()

    async def commit_loop(self) -> None:
        """Group commit: whatever piled up while the last transaction ran goes
        in the next one. When the spool cannot take bytes (disk full, limit,
        I/O error) they stay in memory and go home from there. When to
        record what is the CommitPlan's decision."""
        backoff = Backoff(base=0.1, cap=5.0)
        plan, outbox, spooler = self.plan, self.outbox, self.spooler
        while True:
            if plan.write_behind:  # what home acknowledges in time never touches the disk
                oldest = min((t for t in (o.oldest_unsafe() for o in self.out.values()) if t is not None), default=None)
                due = plan.behind_wait(trio.current_time(), self.streaming, outbox.unsafe_bytes, oldest)
                if due > 0:
                    await self._wait_changed(due)
                    continue
            room = spooler.room(outbox.spooled_pending) if spooler.spool else None
            if room is not None:
                spooler.keep_spares(room.spares)
            batch = min(COMMIT_BATCH, room.bytes) if room is not None else COMMIT_BATCH
            chunks, short = outbox.to_spool(batch, FLUSH_MIN)
            # The spool is full when it cannot take what waits: it takes
            # nothing, or less than waits because its room ran out (not the
            # batch's size). A nearly full disk gives room in ever smaller
            # pieces (half of what is free each time): each is taken, and the
            # episode is one, said once, until the spool catches up again.
            short = short and batch < COMMIT_BATCH
            waiting = any(o.unsafe_bytes for o in self.out.values())
            caught_up = sum(c.size for c in chunks) >= outbox.unsafe_bytes  # (this commit catches the spool up)
            full, bound = (room.reason, room.bound) if room is not None else ("", "")
            if waiting and not chunks:
                self._disk_failed(full or bound or "the spool cannot take more bytes")
            acked = {s: o.acked for s, o in self.out.items() if o.acked > o.ack_recorded}
            eof = [s for s, o in self.out.items() if o.eof and not o.eof_recorded and o.safe_end >= o.read_end]
            tight = bool(full or self.disk.error)
            if acked and not (chunks or eof or self.job_updates):
                due = plan.ack_wait(trio.current_time(), tight)
                if due > 0:
                    await self._wait_changed(due)
                    continue
            updates, self.job_updates = self.job_updates, {}
            if not (chunks or acked or eof or updates):
                await self._wait_changed(plan.idle_wait(waiting))
                continue
            if acked:
                plan.acks_recorded(trio.current_time())
            try:
                await self._commit(chunks, acked, eof, updates)
            except SpoolError as e:
                self._disk_failed(str(e))
                await trio.sleep(backoff.next_delay())
                continue
            backoff.reset()
            if short and chunks:
                self._disk_failed(bound, partial=True)
            elif chunks and self.disk.recovered(trio.current_time(), caught_up):
                log.warning("the spool takes output again")
                self.journal.note(trio.current_time(), "disk", full=False, reason="the spool takes output again")
            share = plan.eviction_share(sum(o.mem_bytes for o in self.out.values()), len(self.out))
            if share is not None:
                for o in self.out.values():
                    o.evict(share)
            self.changed.fire()
            gather = plan.gather(bool(chunks), self.child_exited, bool(full or self.disk.error))
            if gather > 0:
                self.commit_soon = trio.Event()
                with trio.move_on_after(gather):
                    await self.commit_soon.wait()

    async def _commit(self, chunks: list[Chunk | Extent], acked: dict[int, int], eof: list[int],
                      updates: dict[str, Any]) -> None:
        """One spool transaction, and what it made safe marked in the outbox.
        Not recorded: the job fields are kept for the next try (or for the
        final commit, when this one was cancelled)."""
        started = time.monotonic()
        try:
            await self.spooler.commit(chunks, acked, eof, updates)
        except BaseException:
            self.job_updates = {**updates, **self.job_updates}
            raise
        if chunks:
            self.disk.took()
        for c in chunks:
            self.out[c.stream].mark_spooled(c.end)
        for sid, offset in acked.items():
            self.out[sid].ack_recorded = max(self.out[sid].ack_recorded, offset)
        for sid in eof:
            self.out[sid].eof_recorded = True
        if log.isEnabledFor(logging.DEBUG):
            log.debug("spool commit in %.1f ms: %s", (time.monotonic() - started) * 1000,
                      commit_text({s: o.kind for s, o in self.out.items()}, chunks, acked, eof, updates))

    def _disk_failed(self, reason: str, partial: bool = False) -> None:
        first, say = self.disk.failed(trio.current_time(), reason, partial)
        if first:
            self.note(last_error=reason)  # (and wakes a paused reader, to say why)
        if say == "warning":  # once per episode (see DISK_CALM): not at every commit a full disk refuses
            log.warning("%s; output goes home from memory until the spool takes it again", reason)
            self.journal.note(trio.current_time(), "disk", full=True, reason=reason)
        elif say == "info":
            log.info("the spool still cannot take output: %s", reason)

    async def final_flush(self, quiet: bool = False) -> None:
        """Last chance at the end: spool what is still only in memory,
        ignoring the reserve (the job no longer needs the disk), as much of
        each stream as the disk takes, in order, in pieces that fit its free
        space. What does not fit is the tail of its stream, and lost: its
        range goes to `self.lost`. `quiet`: the spool's error was said already."""
        spooler = self.spooler
        if spooler.spool is not None and spooler.spool.segments is not None:
            spooler.spool.segments.drop_spares()  # their blocks can hold output now
        error = ""
        for out in self.out.values():
            piece = COMMIT_BATCH
            while out.unsafe_bytes and piece >= FLUSH_MIN and not (error and spooler.spool is None):
                budget = min(piece, spooler.free_space() - FLUSH_MARGIN)
                chunks = fit(out.unspooled(max(budget, 1)), budget)
                if not chunks:
                    break
                try:
                    await spooler.commit(chunks, {}, [], {})
                except SpoolError as e:
                    if not error and not quiet:
                        log.error("%s", e)
                    error = str(e)
                    piece = sum(cached(c) for c in chunks) // 2
                    continue
                out.mark_spooled(chunks[-1].end)
        eof = [s for s, o in self.out.items() if o.eof and not o.eof_recorded]
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

    def _session(self, where: str) -> Session:
        """A session that speaks for this job, through the outbox and the spool."""
        from .sender import Session, SessionConfig
        job, opts = self.job, self.opts
        hello = Hello(job_id=job.job_id, instance=job.instance, streams=tuple(self.specs), host=job.host,
                      user=job.user, command=tuple(job.command),
                      features=(*offered(opts.compress), NOTES_FEATURE, *((FILES_FEATURE,) if self.files else ())))
        config = SessionConfig(opts.heartbeat, opts.token, opts.tls is not None, opts.compress)
        return Session(self.outbox, self.spooler, hello, config, where, on_welcome=self.on_welcome,
                       exit_frame=self.exit_frame, wire=self.wire, journal=self.journal, files=self.files)

    async def _attempt(self, session: Session, address: Address) -> None:
        """Connect and run one session until it ends (SessionEnd: all is home) or fails."""
        where, link = session.where, self.journal.link
        dialled = trio.current_time()
        stream, tcp = await connect(address, self.opts.connect_timeout or 3 * self.opts.heartbeat, self.opts.tls)
        link.connected(up := trio.current_time())
        log.info("connected to %s from %s in %.3f s (attempt %d)", where, local_address(tcp), up - dialled,
                 int(self.stats["attempts"]))
        failure: Exception | None = None
        try:
            await session.run(stream, tcp.socket)
        except SessionEnd:
            raise
        except Exception as e:
            failure = e
            raise
        finally:
            self.streaming = False
            now = trio.current_time()
            # A welcomed connection that failed is lost (a refusal is noted as one, by `_failed`).
            reason = "" if failure is None or isinstance(failure, ShadowRefused) else describe(failure, where)
            self.journal.session_ended(now, where, session.welcomed and failure is not None, reason,
                                       int(self.stats["attempts"]))
            log.info("connection to %s closed after %.1f s", where, now - up)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(tcp)
            self.note(connected=False)

    async def deliver_loop(self) -> None:
        """Connect, run a session, back off, repeat, until the shadow said DONE,
        the retry limit is reached, or the job ended while the shadow refuses it."""
        shadows = self.shadows
        while True:
            address = shadows.current
            where = show(address)
            self.stats["attempts"] += 1
            seen = (self.stop.signals, self.outbox.exit is not None)
            session = self._session(where)
            try:
                await self._attempt(session, address)
            except SessionEnd:
                log.info("the shadow holds every byte and the exit status: %s",
                         ", ".join(f"{o.kind} {o.acked} bytes" for o in self.out.values()) or "no output")
                self.delivered.set()
                self.changed.fire()
                return
            except Exception as e:
                log.debug("session failed", exc_info=True)
                error = e
            if session.welcomed and session.progressed:
                # Only a session that moved bytes counts as success: one that is
                # welcomed and then fails every time must not retry forever.
                self.retry.succeeded()
                shadows.succeeded()
            delay = self._failed(error, where)
            if delay is None:
                return
            refused = isinstance(error, ShadowRefused) and error.permanent
            with trio.move_on_after(delay):
                # ...but a refused job that ends gets its last try at once, and
                # so does one told to stop by a signal (see StopClock).
                while not (refused and self.outbox.exit is not None) and not self._hurry(seen):
                    await self.changed.wait()

    def _failed(self, error: Exception, where: str) -> float | None:
        """Say why an attempt failed, and decide (RetryPolicy) how long to wait
        before the next; None: no next attempt (given up, or refused for good
        after the job's end)."""
        reason = describe(error, where)
        self.net_error = reason
        shutting_down = isinstance(error, ShadowRefused) and error.code is ErrorCode.SHUTTING_DOWN
        if not shutting_down:
            self.stats["failures"] += 1
        self.note(last_error=reason, retries=int(self.stats["failures"]))  # (a paused reader then says why)
        refused = isinstance(error, ShadowRefused) and error.permanent
        if refused and self.outbox.stdin_starved and not self.child_exited:
            # A job whose stdin can never be fed must not wait for it (nor
            # compute from missing input): end it, as a batch system would
            # not have started it. Its output so far stays in the spool.
            log.info("%s; ending the job, its stdin can never be fed", reason)
            self.end_job(f"the job's stdin {self.opts.stdin!r} can never be fed ({reason}): the job was ended")
        elif refused and (self.refusal is None or str(self.refusal) != str(error)):
            # Refused for good (token, name, owner...): something to fix at
            # home. The job keeps running into its spool; say so now, loudly.
            log.error("%s; the job goes on, its output is kept in the spool", reason)
        if isinstance(error, ShadowRefused):
            self.journal.refused(trio.current_time(), getattr(error.code, "name", str(error.code)), str(error), where)
        if refused:
            assert isinstance(error, ShadowRefused)
            self.refusal = error
            if self.outbox.exit is not None:
                return None  # the job has ended: retrying now changes nothing
        elif shutting_down:
            log.info("%s; connecting again soon", reason)
        elif not self.outage_reported:
            where_now = f"the spool {self.spooler.path}" if self.spooler.spool else "memory (no spool)"
            log.warning("%s; output waits in %s, retrying", reason, where_now)
            self.outage_reported = True
            self.outage_since = time.monotonic()
        else:
            log.info("%s (attempt %d)", reason, int(self.stats["attempts"]))
        retry_after = error.retry_after if isinstance(error, ShadowRefused) else 0.0
        if refused:
            self.shadows.failed_for_good()  # (paced as ever: another shadow would refuse it too)
        elif (ended_round := self.shadows.failed(retry_after, shutting_down)) is None:
            log.info("trying the shadow %s now (failover %d)", show(self.shadows.current), self.shadows.failovers)
            self.note_live(failovers=self.shadows.failovers)
            return 0.0
        else:
            retry_after, shutting_down = ended_round.retry_after, ended_round.shutting_down
        nxt = self.retry.failed(blocked=self.blocked, refused=refused, retry_after=retry_after,
                                shutting_down=shutting_down)
        self.note_live(failovers=self.shadows.failovers)
        if nxt.give_up:
            ended = self.outbox.exit is not None
            self.give_up = Outcome(exitcodes.UNDELIVERED if ended else exitcodes.RETRY_LIMIT,
                                   message=given_up(self.retry.failures_blocked, self.shadows.order, ended, reason))
            return None
        if self.blocked and (limit := self.retry.limit) and nxt.counted:
            log.info("next attempt in %.1f s (%d of --retry-limit %d used)", nxt.delay, self.retry.failures_blocked,
                     limit)
        else:
            log.info("next attempt in %.1f s", nxt.delay)
        return nxt.delay

    def summary(self) -> dict[str, Any]:
        """The I/O summary, in the spirit of Condor's: what moved, how, how long."""
        wall = max(time.monotonic() - self.started, 1e-6)
        total = sum(o.read_end for o in self.out.values())
        out: dict[str, Any] = {f"{o.kind}_bytes": o.read_end for o in self.out.values()}
        connected, stalled = self.journal.link.figures(trio.current_time())
        connected = min(connected, wall)
        paused = self.stats["paused"] + (time.monotonic() - self.blocked_since if self.blocked_since is not None else 0)
        # A resume's rate is its delivery's: the bytes it delivered over its own time.
        moved = total if not self.outbox.resuming else self.delivered_here()
        out.update(
            wall_s=round(wall, 3),
            throughput_mb_s=round(moved / wall / 1e6, 3),
            connected_s=round(connected, 3),
            stalled_s=round(min(stalled, connected), 3),  # (of the time connected)
            disconnected_s=round(wall - connected, 3),
            paused_s=round(min(paused, wall), 3),
            connections=int(self.stats["connects"]),
            reconnects=max(0, int(self.stats["connects"]) - 1),
            # Attempts that never got a session; a session lost later is a reconnect.
            failed_attempts=int(self.stats["attempts"] - self.stats["connects"]),
            zero_copy_pct=round(100 * self.stats["spliced"] / total, 1) if total else 0.0,
            **self.wire.summary(total),
            job_started=round(self.job.started, 3),  # (a resume's summary tells the job's times, not its own)
        )
        if len(self.shadows.order) > 1:  # (of several: which one took the output last)
            in_use = self.shadows.in_use
            out.update(shadow=show(in_use) if in_use else "", failovers=self.shadows.failovers)
        out.update(self.files.figures() if self.files is not None else {})
        if self.lost:
            out["lost"] = sum(end - start for start, end in self.lost.values())
        if ended := self.live_fields.get("ended") or self.job.ended:
            out["job_ended"] = round(ended, 3)
        return out

    def delivered_here(self) -> int:
        """Bytes home acknowledged since this run's first welcome."""
        acked = sum(o.acked for o in self.out.values())
        return acked - self.acked_at_welcome if self.acked_at_welcome is not None else 0

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
        now = (self.stop.signals, self.outbox.exit is not None)
        return bool(self.stop.signals) and now[1] and now != seen

    def exit_frame(self) -> Exit:
        """The EXIT to send, with the summary as of now."""
        files = self.files.exit_files() if self.files is not None else ()
        return dataclasses.replace(self.outbox.exit_frame(tuple((k, str(v)) for k, v in self.summary().items())),
                                   files=files)

    def on_welcome(self) -> None:
        first = not self.stats["connects"]
        self.stats["connects"] += 1
        if self.acked_at_welcome is None:
            self.acked_at_welcome = sum(o.acked for o in self.out.values())
        self.journal.welcomed(trio.current_time(), show(self.shadows.current), int(self.stats["attempts"]), first,
                              time.monotonic() - self.started)
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
        self.shadows.welcomed()
        self.note_live(shadow=show(self.shadows.current), failovers=self.shadows.failovers)
        self.note(connected=True, last_error="")
