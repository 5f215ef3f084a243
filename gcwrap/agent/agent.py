"""The agent: runs one job's delivery beside the job.

    child stdout/stderr --pipe--> PipeReaders --> OutStream.mem --SpoolWriter--> spool
                                      |                |                           |
                                      | splice         +---- Delivery (session) <--+
                                      v                          | DATA      ^ ACK
                                  segment file --sendfile------->|           |
                                                                 v           |
                                                               shadow -------+

Its parts, each the owner of its own state: `PipeReaders` (gcwrap.agent.readers:
a task per stream, and the job's pauses), `SpoolWriter` (gcwrap.agent.spoolwriter:
the commit loop, the only writer of the spool, and the disk's health) and
`Delivery` (gcwrap.agent.delivery: sessions, retries, the link's health). They
share the streams through the `Outbox`, the job's own state through `JobState`.
gcwrap.agent.run talks to the `Agent` alone, through its methods: start the
tasks, feed them the job's pipes, say when the job has ended, finish.
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
from ..wire.compress import Mode, available
from ..wire.events import Exit, Hello, StreamSpec
from .addresses import show, show_all
from .delivery import Delivery
from .jobstate import JobState
from .options import AgentOptions
from .outbox import Outbox
from .policy import HomeHealth, StopClock
from .readers import PipeReaders
from .records import JobRecord, Outcome, StreamState
from .retry import describe
from .spooler import Spooler
from .spoolwriter import SpoolWriter
from .timeline import Journal

if TYPE_CHECKING:  # (a job with --file, and a resume, load these; a plain run does not)
    from . import fileresume

log = logging.getLogger("gcwrap")


@functools.cache  # once a process, however many spools a resume delivers
def say_no_codec() -> None:
    log.info("compression left out: this Python has no zstandard package (pip install zstandard to have it)")


LIVE_INTERVAL = 0.5  # seconds between rewrites of the live status file


class Agent:
    """Runs one job's delivery: reads its pipes into the outbox, records
    what the outbox holds in the spool, delivers it home one session at a
    time, and keeps the live view and the summary. `stop` is the run's stop
    clock (signals: gcwrap.agent.run); the policies are pure objects in
    gcwrap.agent.policy, driven by trio.current_time()."""

    def __init__(
        self, opts: AgentOptions, spooler: Spooler, job: JobRecord, specs: list[StreamSpec], *, resuming: bool = False,
        started: float | None = None, stop: StopClock | None = None, spool_error: str = "",
    ) -> None:
        self.opts = opts
        if opts.compress is not Mode.NONE and not available():
            say_no_codec()
        self.spooler = spooler
        self.job = job
        self.specs = specs
        self.outbox = outbox = Outbox(specs, resuming=resuming)
        self.state = JobState(outbox.changed, time.monotonic() if started is None else started)
        # The link's clock and the notes for home (times on trio's clock).
        self.journal = Journal(opts.heartbeat, lambda t: t + time.time() - trio.current_time())
        home = HomeHealth()
        self.writer = SpoolWriter(opts, outbox, spooler, self.state, self.journal, home)
        if spool_error and specs and spooler.spool is None:  # (said when the job started)
            self.writer.disk.refused_at_start(spool_error)
        self.readers = PipeReaders(opts, outbox, spooler, self.writer, self.state, self.journal, home)
        hello = Hello(job_id=job.job_id, instance=job.instance, streams=tuple(specs), host=job.host, user=job.user,
                      command=tuple(job.command))
        if opts.files:  # (the files' sender, and its delta code, only for a job with --file)
            from .filesender import FileSender
        files = FileSender(Path.cwd(), opts.files, outbox.changed, spooler.record_files,
                           self.journal.note) if opts.files else None
        self.delivery = Delivery(opts, outbox, spooler, self.state, self.journal, home, hello,
                                 stop if stop is not None else StopClock(), files=files,
                                 blocked=self.readers.blocked, exit_frame=self.exit_frame)

    # -- the run's side: start, feed, end ---------------------------------

    def job_started(self, pid: int) -> None:
        self.state.note(child_pid=pid, state="running")

    def start(self, nursery: trio.Nursery, stdin: trio.abc.SendStream | None = None) -> None:
        """Start the agent's tasks beside the job (or, resuming, the spool's
        delivery): the spool writer and the live view (where there is
        something to spool), the job's files' watcher, the job's stdin.
        Delivery is started apart (`deliver`), and the readers (`read_output`)."""
        if self.specs or self.outbox.resuming:
            nursery.start_soon(self.writer.commit_loop)
            nursery.start_soon(self.live_loop)
        files = self.delivery.files
        if files is not None and not self.outbox.resuming:  # (watched until the job ends: then each is final)
            nursery.start_soon(files.run, lambda: self.state.exited)
        if stdin is not None:
            nursery.start_soon(self._write_stdin, stdin)

    async def read_output(self, stream: int, pipe: trio.abc.ReceiveStream) -> None:
        """Read the job's pipe for `stream` until its end (see PipeReaders)."""
        await self.readers.read_pipe(self.outbox.streams[stream], pipe)

    async def _write_stdin(self, pipe: trio.abc.SendStream) -> None:
        feeder = self.outbox.stdin
        assert feeder is not None
        async with pipe:
            while True:
                data = feeder.take()
                if data is None:
                    if feeder.eof:
                        return
                    await self.outbox.changed.wait()
                    continue
                try:
                    await pipe.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    feeder.closed = True  # the job closed its stdin: stop fetching
                    return
                self.outbox.changed.fire()

    async def deliver(self) -> bool:
        """Deliver home (where there is one) until all is home, the retry
        limit, or `interrupt`; True: cut short (interrupted, or `deliver_until`)."""
        try:
            return await self.delivery.deliver() if self.opts.shadows else False
        finally:
            self.outbox.changed.fire()

    @property
    def delivering(self) -> bool:
        return self.delivery.running

    def deliver_until(self, deadline: float) -> None:
        """Stop delivering at `deadline` (trio's clock): a signal's grace."""
        self.delivery.until(deadline)

    def interrupt(self, reason: str) -> None:
        """Stop delivering now; what is not home stays in the spool."""
        self.delivery.interrupt(reason)

    def say_not_home(self) -> None:
        """Delivery was cut short: the outcome says what is not home."""
        give_up = self.delivery.give_up
        if give_up is not None and not self.delivered:
            give_up.message += f"; not yet home: {self.not_home()}"

    def end_for_giving_up(self) -> bool:
        """Delivery gave up (the retry limit) while the job runs: its output
        has nowhere to go. Records why the job is ended; True: end it now."""
        give_up = self.delivery.give_up
        if give_up is None or self.outbox.exit is not None:
            return False
        self.state.kill_reason = give_up.message
        return True

    async def end_requested(self) -> None:
        """Wait until the job must be ended (`JobState.end_job`)."""
        await self.state.must_end.wait()

    def job_exited(self) -> None:
        """The job's process has ended: what its pipes still hold is read,
        and the commit loop stops gathering."""
        self.state.exited = True
        self.writer.commit_soon.set()
        self.outbox.changed.fire()

    def job_ended(self, returncode: int) -> None:
        """The job's end, recorded (its pipes are read): the EXIT home gets,
        the spool's record, the live view."""
        log.info("the job ended with %s after %.1f s; %d bytes not yet home",
                 f"signal {-returncode}" if returncode < 0 else f"status {returncode}",
                 time.monotonic() - self.state.started,
                 sum(o.read_end - o.acked for o in self.outbox.streams.values()))
        reason = self.state.kill_reason
        ended = self.outbox.exit = Exit(
            code=returncode if returncode >= 0 else None,
            signal=-returncode if returncode < 0 else None,
            lengths=self.outbox.lengths(),
            reason=reason,
        )
        self.state.note(state="exited", ended=time.time(), exit_code=ended.code, exit_signal=ended.signal,
                        reason=reason)
        if not self.opts.shadows:
            self.delivery.delivered.set()

    @property
    def ended(self) -> bool:
        """The job's end is recorded (`job_ended`, or a resumed spool's)."""
        return self.outbox.exit is not None

    @property
    def delivered(self) -> bool:
        """Home holds every byte and the exit status (or there is no home)."""
        return self.delivery.delivered.is_set()

    def wake(self) -> None:
        """Wake every task to look again (a signal came)."""
        self.outbox.changed.fire()

    async def wait_changed(self) -> None:
        await self.outbox.changed.wait()

    async def keep_the_rest(self) -> None:
        """The end, undelivered: spool what is still only in memory, and,
        when home refused the job for good, try again while the disk refuses
        it (SpoolWriter.keep): that copy is the only one."""
        await self.writer.final_flush()
        if self.writer.lost and self.delivery.refusal is not None:
            await self.writer.keep(self.delivery.retry, self.delivery.stop)

    def totals(self) -> tuple[int, int]:
        """Bytes home has acknowledged, and bytes the job wrote, over all streams."""
        streams = self.outbox.streams.values()
        return sum(o.acked for o in streams), sum(o.read_end for o in streams)

    def files_listing(self) -> list[dict[str, object]]:
        files = self.delivery.files
        return files.listing() if files is not None else []

    # -- a resume ----------------------------------------------------------

    def resume_from(self, record: JobRecord, states: dict[int, StreamState], files: fileresume.Kept | None) -> None:
        """Take up what a spool left behind: its streams' offsets, what its run
        lost, the job's files (from the files themselves, once home says what
        it holds), and the job's end (with what was lost, for home)."""
        if files is not None:
            from . import fileresume

            self.delivery.files = fileresume.restore(files, self.outbox.changed, self.spooler.record_files)
        for sid, out in self.outbox.streams.items():
            st = states[sid]
            out.restore(st.appended, st.acked)
            if st.lost:
                self.writer.lost[sid] = (st.appended, st.appended + st.lost)
        if self.outbox.pending:
            self.journal.link.output(trio.current_time())  # (what the spool holds waits from now)
        lengths = self.outbox.lengths()
        # Home is told what the run lost, with why the job ended.
        loss = f"lost: {self.writer.loss()}" if self.writer.lost else ""
        if record.exit_code is None and record.exit_signal is None:
            reason = "gcwrap ended before the job did; the job's exit status is unknown"
            self.outbox.exit = Exit(None, None, lengths, reason="; ".join(filter(None, (reason, loss))))
        else:
            self.outbox.exit = Exit(record.exit_code, record.exit_signal, lengths,
                                    reason="; ".join(filter(None, (record.reason, loss))))

    def close_files(self) -> None:
        if self.delivery.files is not None:
            self.delivery.files.close()

    # -- the live view and the summary ---------------------------------------

    def live_snapshot(self) -> dict[str, Any]:
        f, lost, files = self.state.live, self.writer.lost, self.delivery.files
        wall = time.time() - trio.current_time()  # (read times are on trio's clock)
        return {
            "t": round(time.time(), 3),
            "state": f.get("state", "starting"),
            "connected": bool(f.get("connected", False)),
            "last_error": f.get("last_error", ""),
            "retries": f.get("retries", 0),
            "shadow": f.get("shadow", ""),  # the shadow in use (the last to welcome the agent)
            "failovers": f.get("failovers", 0),
            "disk_error": self.writer.disk.error,
            "exit_code": f.get("exit_code"),
            "exit_signal": f.get("exit_signal"),
            "reason": f.get("reason", ""),
            "streams": {
                str(sid): {"written": o.read_end, "acked": o.acked, "memory_only": o.unsafe_bytes,
                           # when the oldest byte held only in memory was read (the spool knows its own)
                           "memory_since": None if (t := o.oldest_unsafe()) is None else round(t + wall, 3),
                           "lost": lost[sid][1] - lost[sid][0] if sid in lost else 0}
                for sid, o in self.outbox.streams.items()
            },
            "wire": self.delivery.wire.as_dict(),
            "files": files.live() if files is not None else [],  # (`FileSender.live`)
            # since when output has waited with nothing acknowledged (None: nothing waits)
            "waiting_since": None if (w := self.journal.link.waiting_since) is None else round(w + wall, 3),
        }

    async def live_loop(self) -> None:
        """Keep the live status file current for `gcwrap status`."""
        while True:
            self.spooler.write_live(self.live_snapshot())
            await trio.sleep(LIVE_INTERVAL)

    def summary(self) -> dict[str, Any]:
        """The I/O summary, in the spirit of Condor's: what moved, how, how long."""
        wall = max(time.monotonic() - self.state.started, 1e-6)
        counts, shadows, files = self.delivery.counts, self.delivery.shadows, self.delivery.files
        total = sum(o.read_end for o in self.outbox.streams.values())
        out: dict[str, Any] = {f"{o.kind}_bytes": o.read_end for o in self.outbox.streams.values()}
        connected, stalled = self.journal.link.figures(trio.current_time())
        connected = min(connected, wall)
        paused = self.readers.paused()
        # A resume's rate is its delivery's: the bytes it delivered over its own time.
        moved = total if not self.outbox.resuming else self.delivery.delivered_here()
        out.update(
            wall_s=round(wall, 3),
            throughput_mb_s=round(moved / wall / 1e6, 3),
            connected_s=round(connected, 3),
            stalled_s=round(min(stalled, connected), 3),  # (of the time connected)
            disconnected_s=round(wall - connected, 3),
            paused_s=round(min(paused, wall), 3),
            connections=counts.connects,
            reconnects=max(0, counts.connects - 1),
            # Attempts that never got a session; a session lost later is a reconnect.
            failed_attempts=counts.attempts - counts.connects,
            zero_copy_pct=round(100 * self.readers.spliced / total, 1) if total else 0.0,
            **self.delivery.wire.summary(total),
            job_started=round(self.job.started, 3),  # (a resume's summary tells the job's times, not its own)
        )
        if len(shadows.order) > 1:  # (of several: which one took the output last)
            in_use = shadows.in_use
            out.update(shadow=show(in_use) if in_use else "", failovers=shadows.failovers)
        out.update(files.figures() if files is not None else {})
        if self.writer.lost:
            out["lost"] = self.writer.held()
        if ended := self.state.live.get("ended") or self.job.ended:
            out["job_ended"] = round(ended, 3)
        return out

    def not_home(self) -> str:
        """Per stream, the bytes home has not acknowledged, in words."""
        return ", ".join(f"{o.read_end - o.acked:,} bytes of {o.kind} ({o.name})" for o in self.outbox.streams.values())

    def exit_frame(self) -> Exit:
        """The EXIT to send, with the summary as of now."""
        files = self.delivery.files.exit_files() if self.delivery.files is not None else ()
        return dataclasses.replace(self.outbox.exit_frame(tuple((k, str(v)) for k, v in self.summary().items())),
                                   files=files)


    # -- the end -------------------------------------------------------------

    def finish(self, job_status: int | None) -> Outcome:
        """Delete a delivered spool; keep one that still holds output and say
        why; say what is lost (`SpoolWriter.lost`), which comes first in the
        status. The outcome carries the summary."""
        outcome = self._outcome(job_status)
        outcome.stats = self.summary()
        return outcome

    @property
    def complete(self) -> bool:
        """Home holds everything, and nothing was lost."""
        return self.delivered and not self.writer.lost

    def _outcome(self, job_status: int | None) -> Outcome:
        spooler, delivery, state, streams = self.spooler, self.delivery, self.state, self.outbox.streams
        if self.complete:
            spooler.close(remove=True)
            return Outcome(job_status if job_status is not None else 0, job_status)
        path = spooler.path if spooler.spool is not None else None
        loss = self.writer.loss()
        if self.delivered:
            # (A resumed spool whose run lost its tail: what it held is home.)
            spooler.close(remove=True)
            in_use = delivery.shadows.in_use
            where = show(in_use) if in_use else show_all(self.opts.shadows) or "home"
            return Outcome(exitcodes.LOST, job_status, f"what the spool held is delivered to {where}; lost when the "
                                                       f"job ran: {loss}")
        final = dict(state.updates, connected=False, summary=self.summary())
        if delivery.give_up is not None:
            final.update(state="gave-up", last_error=delivery.give_up.message)
            if state.kill_reason:
                final.update(reason=state.kill_reason)
        elif delivery.refusal is not None:
            final.update(state="refused", last_error=describe(delivery.refusal))
        state.note_live(**{k: v for k, v in final.items() if k != "summary"})
        spooler.write_live(self.live_snapshot())
        acked = {s: o.acked for s, o in streams.items()}
        # What the job wrote: bytes past what the spool holds are on record as lost.
        # (A resume knows only what its spool holds, and keeps the record it found.)
        written = None if self.outbox.resuming else {s: o.read_end for s, o in streams.items()}
        if not spooler.last_commit(final, acked, written) and path is not None:
            log.error("could not record the job's final state in %s", path)
        spooler.close()
        if delivery.refusal is not None:
            outcome = Outcome(exitcodes.REFUSED, job_status, state.kill_reason or describe(delivery.refusal), path,
                              refused=True)
        elif delivery.give_up is not None:
            outcome = delivery.give_up
            outcome.job_status, outcome.spool = job_status, path
        else:
            outcome = Outcome(exitcodes.UNDELIVERED, job_status, "output was not delivered", path)
        outcome.pending = sum(max(0, o.safe_end - o.acked) for o in streams.values()) if path is not None else 0
        if loss:
            outcome.status = exitcodes.LOST
            outcome.lost = (f"LOST: {loss}: held only in memory, and neither the disk nor home could take them"
                            if not self.outbox.resuming else f"lost when the job ran: {loss}")
        return outcome
