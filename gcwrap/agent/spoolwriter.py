"""The agent's spool writer: the commit loop, the only task that writes the
spool. It records what the outbox holds (output, acknowledgements, ends of
streams, the job's fields), keeps the one account of the disk's health
(`DiskHealth`), and at the end spools what is still only in memory, as far
as the disk takes it (`final_flush`, `keep`); what it cannot take is lost,
and said.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from ..units import human_bytes
from .jobstate import JobState
from .options import AgentOptions
from .outbox import Outbox, cached, fit
from .policy import CommitPlan, DiskHealth, HomeHealth, RetryPolicy, StopClock
from .records import Chunk, Extent, commit_text, loss_text
from .retry import Backoff
from .spool import SpoolError
from .spooler import Spooler
from .timeline import Journal

log = logging.getLogger("gcwrap")

COMMIT_BATCH = 8 << 20  # at most this many bytes per spool transaction
# The final flush (see SpoolWriter.final_flush) leaves this much free for the rows and WAL
# pages that record its pieces, and gives up on pieces smaller than FLUSH_MIN the disk refuses.
FLUSH_MARGIN = 64 << 10
FLUSH_MIN = 4 << 10


class SpoolWriter:
    """Group commit of the outbox into the spool, the disk's health, and
    what is lost at the end (`lost`: stream -> [start, end) that nothing
    holds). When to record what is the CommitPlan's decision."""

    def __init__(self, opts: AgentOptions, outbox: Outbox, spooler: Spooler, job: JobState, journal: Journal,
                 home: HomeHealth) -> None:
        self.outbox = outbox
        self.spooler = spooler
        self.job = job
        self.journal = journal
        self.home = home  # (delivery's: write-behind waits only while a session streams)
        self.plan = CommitPlan(mem_limit=opts.mem_limit, cache_limit=opts.cache_limit, write_behind=opts.write_behind)
        self.disk = DiskHealth()
        self.commit_soon = trio.Event()  # set: the commit loop stops gathering (see COMMIT_PACE)
        self.lost: dict[int, tuple[int, int]] = {}  # stream -> [start, end) that nothing holds (see final_flush)

    async def _wait_changed(self, seconds: float) -> None:
        with trio.move_on_after(seconds):
            await self.outbox.changed.wait()

    async def commit_loop(self) -> None:
        """Group commit: whatever piled up while the last transaction ran goes
        in the next one. When the spool cannot take bytes (disk full, limit,
        I/O error) they stay in memory and go home from there. When to
        record what is the CommitPlan's decision."""
        backoff = Backoff(base=0.1, cap=5.0)
        plan, outbox, spooler = self.plan, self.outbox, self.spooler
        streams = outbox.streams
        while True:
            if plan.write_behind:  # what home acknowledges in time never touches the disk
                oldest = min((t for t in (o.oldest_unsafe() for o in streams.values()) if t is not None), default=None)
                due = plan.behind_wait(trio.current_time(), self.home.may_ack, outbox.unsafe_bytes, oldest)
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
            waiting = any(o.unsafe_bytes for o in streams.values())
            caught_up = sum(c.size for c in chunks) >= outbox.unsafe_bytes  # (this commit catches the spool up)
            full, bound = (room.reason, room.bound) if room is not None else ("", "")
            if waiting and not chunks:
                self.disk_failed(full or bound or "the spool cannot take more bytes")
            acked = {s: o.acked for s, o in streams.items() if o.acked > o.ack_recorded}
            eof = [s for s, o in streams.items() if o.eof and not o.eof_recorded and o.safe_end >= o.read_end]
            tight = bool(full or self.disk.error)
            if acked and not (chunks or eof or self.job.updates):
                due = plan.ack_wait(trio.current_time(), tight)
                if due > 0:
                    await self._wait_changed(due)
                    continue
            updates = self.job.take_updates()
            if not (chunks or acked or eof or updates):
                await self._wait_changed(plan.idle_wait(waiting))
                continue
            if acked:
                plan.acks_recorded(trio.current_time())
            try:
                await self._commit(chunks, acked, eof, updates)
            except SpoolError as e:
                self.disk_failed(str(e))
                await trio.sleep(backoff.next_delay())
                continue
            backoff.reset()
            if short and chunks:
                self.disk_failed(bound, partial=True)
            elif chunks and self.disk.recovered(trio.current_time(), caught_up):
                log.warning("the spool takes output again")
                self.journal.note(trio.current_time(), "disk", full=False, reason="the spool takes output again")
            share = plan.eviction_share(sum(o.mem_bytes for o in streams.values()), len(streams))
            if share is not None:
                for o in streams.values():
                    o.evict(share)
            outbox.changed.fire()
            gather = plan.gather(bool(chunks), self.job.exited, bool(full or self.disk.error))
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
            self.job.put_back(updates)
            raise
        if chunks:
            self.disk.took()
        streams = self.outbox.streams
        for c in chunks:
            streams[c.stream].mark_spooled(c.end)
        for sid, offset in acked.items():
            streams[sid].ack_recorded = max(streams[sid].ack_recorded, offset)
        for sid in eof:
            streams[sid].eof_recorded = True
        if log.isEnabledFor(logging.DEBUG):
            log.debug("spool commit in %.1f ms: %s", (time.monotonic() - started) * 1000,
                      commit_text({s: o.kind for s, o in streams.items()}, chunks, acked, eof, updates))

    def disk_failed(self, reason: str, partial: bool = False) -> None:
        """The spool refused bytes (all, or `partial`ly): say so once an episode."""
        first, say = self.disk.failed(trio.current_time(), reason, partial)
        if first:
            self.job.note(last_error=reason)  # (and wakes a paused reader, to say why)
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
        spooler, streams = self.spooler, self.outbox.streams
        if spooler.spool is not None and spooler.spool.segments is not None:
            spooler.spool.segments.drop_spares()  # their blocks can hold output now
        error = ""
        for out in streams.values():
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
        eof = [s for s, o in streams.items() if o.eof and not o.eof_recorded]
        if eof and spooler.spool is not None:
            try:
                await spooler.commit([], {}, eof, {})
            except SpoolError:
                pass  # (the final record says what the job wrote; EOF only saves a resume a question)
        self.lost = {s: (o.safe_end, o.read_end) for s, o in streams.items() if o.unsafe_bytes}

    def loss(self) -> str:
        """What is lost, in words ("" if nothing)."""
        streams = self.outbox.streams
        return loss_text((streams[s].kind, start, end) for s, (start, end) in sorted(self.lost.items()))

    def held(self) -> int:
        """Bytes held only in memory that the spool did not take (see final_flush)."""
        return sum(end - start for start, end in self.lost.values())

    async def keep(self, retry: RetryPolicy, stop: StopClock) -> None:
        """The end, when home will never take the output (the shadow refused
        the job for good) and the disk took none of what memory holds: that
        copy is the only one, so the spool is tried again until it takes it,
        at the retry policy's pace, each try that takes none of it counted as
        a failed attempt while the output can go nowhere (--retry-limit; 0:
        until it does; a try that takes some starts the count again), and no
        later than a stop signal's deadline. What is still out then is lost,
        and said (`Agent.finish`)."""
        retry.succeeded()  # (the spool's tries count from the last one, not the connection attempts before)
        log.warning("the shadow refused the job for good, and the spool cannot take the %s held only in memory: "
                    "trying the spool again until it does (%s)", human_bytes(self.held()),
                    f"at most {retry.limit} tries in all, --retry-limit" if retry.limit else "no --retry-limit")
        while self.lost:
            before = self.held()
            nxt = retry.failed(blocked=True, refused=False)  # (the last try, the first being the final flush)
            if nxt.give_up:
                log.error("the spool took none of the %s held only in memory in %d tries: giving up",
                          human_bytes(before), retry.failures_blocked)
                return
            until = trio.current_time() + nxt.delay
            while trio.current_time() < min(until, stop.deadline):  # (a signal moves the deadline: look again)
                signals = stop.signals
                with trio.move_on_at(min(until, stop.deadline)):
                    await self.outbox.changed.wait()
                if stop.signals == 1 and not signals:
                    log.warning("%s received: trying the spool for at most %g s more (again to stop now)",
                                stop.name, stop.grace)
            if trio.current_time() >= stop.deadline:
                log.warning("%s received: keeping no more of the output held in memory", stop.name)
                return
            await self.final_flush(quiet=True)
            if not self.lost:
                log.warning("the spool took the output held in memory")
            elif self.held() < before:
                retry.succeeded()  # (it took some: the count starts again)
