"""The agent's delivery: connect to a shadow, run a session, back off,
repeat, until home holds every byte and the exit status (DONE), the retry
limit is reached, or the job ended while home refuses it. Which shadow is
next is the ShadowList's decision, how long to wait the RetryPolicy's; the
link's state, which the pipe readers and the spool writer read, is kept in
`HomeHealth`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from .. import exitcodes
from ..wire.compress import WireStats, offered
from ..wire.events import FILES_FEATURE, NOTES_FEATURE, ErrorCode, Exit, Hello
from .addresses import Address, show
from .jobstate import JobState
from .options import AgentOptions
from .outbox import Outbox
from .policy import HomeHealth, RetryPolicy, StopClock
from .records import Outcome
from .retry import SessionEnd, ShadowRefused, describe
from .shadows import ShadowList, connect, given_up, local_address
from .spooler import Spooler
from .timeline import Journal

if TYPE_CHECKING:  # (loaded by the first session: a run with nothing to deliver needs neither)
    from .filesender import FileSender
    from .sender import Session

log = logging.getLogger("gcwrap")


@dataclass
class Attempts:
    """Connection attempts so far, those that were welcomed (`connects`),
    and those that failed and count as failures (not a shadow shutting down)."""

    attempts: int = 0
    connects: int = 0
    failures: int = 0


class Delivery:
    """One job's delivery home, one session at a time, and its outcome:
    `delivered` once home holds everything, else `give_up` (the retry limit,
    or an interruption) or `refusal` (refused for good). `blocked()` says
    whether the job's output can go nowhere (failed attempts count only
    then); `exit_frame()` is the EXIT to send, with the summary as of then."""

    def __init__(self, opts: AgentOptions, outbox: Outbox, spooler: Spooler, job: JobState, journal: Journal,
                 home: HomeHealth, hello: Hello, stop: StopClock, *, files: FileSender | None,
                 blocked: Callable[[], bool], exit_frame: Callable[[], Exit]) -> None:
        self.opts = opts
        self.outbox = outbox
        self.spooler = spooler  # (the sessions' byte source)
        self.job = job
        self.journal = journal
        self.home = home
        self.hello = hello  # (its features are each session's: see `_session`)
        self.stop = stop
        self.files = files  # the job's files (--file), where there are
        self.blocked = blocked
        self.exit_frame = exit_frame
        self.retry = RetryPolicy(limit=opts.retry_limit, retry_timeout=opts.retry_timeout)
        self.shadows = ShadowList.for_job(opts.shadows, hello.job_id)
        self.counts = Attempts()
        self.wire = WireStats()  # output sent by this run, on the wire
        self.acked_at_welcome: int | None = None  # a resume's first welcome: bytes home held then
        self.scope: trio.CancelScope | None = None  # the deliver loop's, while it runs
        self.delivered = trio.Event()
        self.give_up: Outcome | None = None
        self.refusal: ShadowRefused | None = None

    @property
    def running(self) -> bool:
        """The deliver loop runs (see `deliver`)."""
        return self.scope is not None

    async def deliver(self) -> bool:
        """Run the deliver loop until it ends, or until `interrupt` or the
        deadline (`until`) cuts it short; True: it was cut short."""
        scope = self.scope = trio.CancelScope()
        try:
            with scope:
                await self.deliver_loop()
        finally:
            self.scope = None
        return scope.cancelled_caught

    def until(self, deadline: float) -> None:
        """Stop delivering at `deadline` (trio's clock)."""
        if self.scope is not None:
            self.scope.deadline = deadline

    def _session(self, where: str) -> Session:
        """A session that speaks for this job, through the outbox and the spool."""
        opts = self.opts
        from .sender import Session, SessionConfig

        config = SessionConfig(opts.heartbeat, opts.token, opts.tls is not None, opts.compress)
        features = (*offered(opts.compress), NOTES_FEATURE, *((FILES_FEATURE,) if self.files else ()))
        hello = dataclasses.replace(self.hello, features=features)
        return Session(self.outbox, self.spooler, hello, config, where, on_welcome=self.on_welcome,
                       exit_frame=self.exit_frame, wire=self.wire, journal=self.journal, files=self.files)

    async def _attempt(self, session: Session, address: Address) -> None:
        """Connect and run one session until it ends (SessionEnd: all is home) or fails."""
        where, link = session.where, self.journal.link
        dialled = trio.current_time()
        stream, tcp = await connect(address, self.opts.connect_timeout or 3 * self.opts.heartbeat, self.opts.tls)
        link.connected(up := trio.current_time())
        log.info("connected to %s from %s in %.3f s (attempt %d)", where, local_address(tcp), up - dialled,
                 self.counts.attempts)
        failure: Exception | None = None
        try:
            await session.run(stream, tcp.socket)
        except SessionEnd:
            raise
        except Exception as e:
            failure = e
            raise
        finally:
            self.home.streaming = False
            now = trio.current_time()
            # A welcomed connection that failed is lost (a refusal is noted as one, by `_failed`).
            reason = "" if failure is None or isinstance(failure, ShadowRefused) else describe(failure, where)
            self.journal.session_ended(now, where, session.welcomed and failure is not None, reason,
                                       self.counts.attempts)
            log.info("connection to %s closed after %.1f s", where, now - up)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(tcp)
            self.job.note(connected=False)

    async def deliver_loop(self) -> None:
        """Connect, run a session, back off, repeat, until the shadow said DONE,
        the retry limit is reached, or the job ended while the shadow refuses it."""
        shadows = self.shadows
        while True:
            address = shadows.current
            where = show(address)
            self.counts.attempts += 1
            seen = (self.stop.signals, self.outbox.exit is not None)
            session = self._session(where)
            try:
                await self._attempt(session, address)
            except SessionEnd:
                log.info("the shadow holds every byte and the exit status: %s",
                         ", ".join(f"{o.kind} {o.acked} bytes" for o in self.outbox.streams.values()) or "no output")
                self.delivered.set()
                self.outbox.changed.fire()
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
                    await self.outbox.changed.wait()

    def _failed(self, error: Exception, where: str) -> float | None:
        """Say why an attempt failed, and decide (RetryPolicy) how long to wait
        before the next; None: no next attempt (given up, or refused for good
        after the job's end)."""
        reason = describe(error, where)
        self.home.failed(reason)
        shutting_down = isinstance(error, ShadowRefused) and error.code is ErrorCode.SHUTTING_DOWN
        if not shutting_down:
            self.counts.failures += 1
        self.job.note(last_error=reason, retries=self.counts.failures)  # (a paused reader then says why)
        refused = isinstance(error, ShadowRefused) and error.permanent
        if refused and self.outbox.stdin_starved and not self.job.exited:
            # A job whose stdin can never be fed must not wait for it (nor
            # compute from missing input): end it, as a batch system would
            # not have started it. Its output so far stays in the spool.
            log.info("%s; ending the job, its stdin can never be fed", reason)
            self.job.end_job(f"the job's stdin {self.opts.stdin!r} can never be fed ({reason}): the job was ended")
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
        elif self.home.outage(time.monotonic()):
            where_now = f"the spool {self.spooler.path}" if self.spooler.spool else "memory (no spool)"
            log.warning("%s; output waits in %s, retrying", reason, where_now)
        else:
            log.info("%s (attempt %d)", reason, self.counts.attempts)
        retry_after = error.retry_after if isinstance(error, ShadowRefused) else 0.0
        if refused:
            self.shadows.failed_for_good()  # (paced as ever: another shadow would refuse it too)
        elif (ended_round := self.shadows.failed(retry_after, shutting_down)) is None:
            log.info("trying the shadow %s now (failover %d)", show(self.shadows.current), self.shadows.failovers)
            self.job.note_live(failovers=self.shadows.failovers)
            return 0.0
        else:
            retry_after, shutting_down = ended_round.retry_after, ended_round.shutting_down
        nxt = self.retry.failed(blocked=self.blocked(), refused=refused, retry_after=retry_after,
                                shutting_down=shutting_down)
        self.job.note_live(failovers=self.shadows.failovers)
        if nxt.give_up:
            ended = self.outbox.exit is not None
            self.give_up = Outcome(exitcodes.UNDELIVERED if ended else exitcodes.RETRY_LIMIT,
                                   message=given_up(self.retry.failures_blocked, self.shadows.order, ended, reason))
            return None
        if self.blocked() and (limit := self.retry.limit) and nxt.counted:
            log.info("next attempt in %.1f s (%d of --retry-limit %d used)", nxt.delay, self.retry.failures_blocked,
                     limit)
        else:
            log.info("next attempt in %.1f s", nxt.delay)
        return nxt.delay

    def delivered_here(self) -> int:
        """Bytes home acknowledged since this run's first welcome."""
        acked = sum(o.acked for o in self.outbox.streams.values())
        return acked - self.acked_at_welcome if self.acked_at_welcome is not None else 0

    def interrupt(self, reason: str) -> None:
        """Stop delivering now; what is not home stays in the spool."""
        if self.give_up is None and not self.delivered.is_set():
            self.give_up = Outcome(exitcodes.UNDELIVERED, message=reason)
        if self.scope is not None:
            self.scope.cancel()

    def _hurry(self, seen: tuple[int, bool]) -> bool:
        """A signal came (or the job ended after one) since the attempt that
        saw `seen`: make the last attempt now, not after the backoff."""
        now = (self.stop.signals, self.outbox.exit is not None)
        return bool(self.stop.signals) and now[1] and now != seen

    def on_welcome(self) -> None:
        first = not self.counts.connects
        self.counts.connects += 1
        if self.acked_at_welcome is None:
            self.acked_at_welcome = sum(o.acked for o in self.outbox.streams.values())
        self.journal.welcomed(trio.current_time(), show(self.shadows.current), self.counts.attempts, first,
                              time.monotonic() - self.job.started)
        outage = self.home.welcomed(time.monotonic())
        if outage is not None:
            # "Again" only if there was a connection before this outage.
            log.warning("connected to the shadow %s after %.1f s; delivering the backlog",
                        "for the first time" if first else "again", outage)
        if log.isEnabledFor(logging.INFO):
            held = ", ".join(f"{o.acked} of {o.read_end} bytes of {o.kind} ({o.name})"
                             for o in self.outbox.streams.values())
            log.info("welcomed by the shadow (connection %d): it holds %s; sending from there",
                     self.counts.connects, held or "no output stream")
        self.refusal = None
        self.shadows.welcomed()
        self.job.note_live(shadow=show(self.shadows.current), failovers=self.shadows.failovers)
        self.job.note(connected=True, last_error="")
