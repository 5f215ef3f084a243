"""What the shadow saw, on its way to the state: each job's events (its
sessions opened and ended, refusals, its exit, the notes its agent sent),
the refused connections, when each streaming job's agent was last heard
from, and the root's free space (`timeline` says how the state keeps them).

Nothing here waits for the state. A call only queues (bounded), and one
task writes what is queued in batches, at most every FLUSH_EVERY seconds,
in a transaction of their own in the shadow's state thread: a thousand
agents connecting at once cost a few transactions, and a batch that fails
fails no claim with it (as it would inside the group commit of handshakes).
A batch the state cannot take (it is lost for now, say) is logged and
dropped: a session goes on whatever happens here, and no byte of output
depends on it.

Refusals are rate-limited (a token bucket: REFUSALS_PER_S, bursts of
REFUSALS_BURST): a flood of garbage connections costs the shadow a counter,
not a write each, and the table keeps its newest rows only.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from ..wire.events import Note
from .admission import ShadowOptions
from .backends import StateBackend
from .durability import LiveJob
from .timeline import Batch, Home, JobEvent, Refusal

log = logging.getLogger("gcshadow")

FLUSH_EVERY = 0.2  # seconds: what is queued meanwhile goes in one batch
HEARD_EVERY = 5.0  # seconds between stamps of when each streaming job's agent was last heard from
HOME_EVERY = 10.0  # seconds between looks at the root's free space
QUEUED_MOST = 20000  # events queued at most (past it, dropped and counted: the state is slower than the shadow)
NOTES_PER_SESSION = 1000  # notes one session may add (the timeline keeps as many per job)
REFUSALS_PER_S = 20.0
REFUSALS_BURST = 200.0
SAY_DROPPED_EVERY = 60.0  # seconds between log lines about what was not recorded
MESSAGE_MOST = 1000  # characters of a refusal's words kept


@dataclass
class Caller:
    """One connection as the log and the records name it: its peer, who it
    is for the log (`who`), its identity once authenticated, and its job
    and session once its handshake got that far."""

    peer: str
    who: str
    identity: str = ""
    job_id: str = ""
    session: int = 0

    def job_text(self) -> str:
        return f"job {self.job_id}: " if self.job_id else ""

    def __str__(self) -> str:  # (as a log line names it)
        return f"{self.peer} [{self.who}]"

    def fields(self, code: str = "") -> dict[str, str]:
        """Its log records' fields (`extra=`: keys of --log-format json's lines)."""
        return {"peer": self.peer, "identity": self.who, "job": self.job_id, "code": code}


class EventLog:
    """The queue of records, and the task that writes it (`run`)."""

    def __init__(self, opts: ShadowOptions, store: StateBackend, live: dict[str, LiveJob],
                 submit: Callable[[Callable[[], Any]], Awaitable[Any]]) -> None:
        self.opts = opts
        self.store = store
        self.live = live
        self.submit = submit
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.started = time.time()
        self.batch = Batch()
        self.queued = trio.Event()
        self.tokens = REFUSALS_BURST
        self.filled = time.monotonic()
        self.dropped = {"refusals": 0, "events": 0, "batches": 0}
        # For the metrics: connections refused, and sessions ended with an ERROR, by its code (every one,
        # recorded or not).
        self.refusals: dict[str, int] = {}
        self.stopped: dict[str, int] = {}
        self.said_dropped = 0.0
        self.heard: dict[str, float] = {}  # job -> the `heard` last recorded for it
        self.next_heard = self.next_home = 0.0  # (time.monotonic)

    # -- what happened (no await, nothing blocks) -----------------------------------

    def event(self, job_id: str, kind: str, **details: Any) -> None:
        """Something the shadow saw of a job."""
        self._add(JobEvent(job_id, time.time(), kind, "shadow", details))

    def notes(self, job: LiveJob, notes: tuple[Note, ...]) -> None:
        """The notes an agent sent (NOTES), each kept once however often it comes."""
        room = NOTES_PER_SESSION - job.notes
        if room < len(notes):
            if room > 0:
                log.warning("job %s: its agent sent more than %d notes in one session: the rest are dropped",
                            job.job_id, NOTES_PER_SESSION, extra={"job": job.job_id})
            self.dropped["events"] += len(notes) - max(room, 0)
            notes = notes[:max(room, 0)]
        job.notes += len(notes)
        for n in notes:
            self._add(JobEvent(job.job_id, n.time, n.kind, "agent", dict(n.details)))

    def opened(self, caller: Caller, session: int, host: str) -> None:
        caller.session = session
        self.event(caller.job_id, "session_opened", session=session, peer=caller.peer, host=host)

    def ended(self, caller: Caller, reason: str, code: str = "", heard: float = 0.0) -> None:
        """A session ended (`reason` as the log says it; `code` the ERROR its agent was told, if any)."""
        if code:
            self.stopped[code] = self.stopped.get(code, 0) + 1
        if caller.session:
            self.event(caller.job_id, "session_ended", session=caller.session, reason=reason, code=code,
                       heard=heard or None)

    def refused(self, caller: Caller, code: str, message: str) -> None:
        """A connection refused: in the list of refusals and, before its
        session (if it names a job the state knows), in that job's timeline."""
        self.refusals[code] = self.refusals.get(code, 0) + 1
        now = time.monotonic()
        self.tokens = min(REFUSALS_BURST, self.tokens + (now - self.filled) * REFUSALS_PER_S)
        self.filled = now
        if self.tokens < 1:
            self.dropped["refusals"] += 1
            return
        self.tokens -= 1
        t = time.time()
        message = message[:MESSAGE_MOST].replace("\x00", "")  # (a state's text holds no NUL)
        self.batch.refusals.append(Refusal(t, caller.peer, caller.identity, caller.job_id, code, message))
        if caller.job_id and not caller.session:
            self._add(JobEvent(caller.job_id, t, "refused", "shadow", {"code": code, "message": message,
                                                                         "peer": caller.peer}))
        self.queued.set()

    def _add(self, event: JobEvent) -> None:
        if len(self.batch.events) >= QUEUED_MOST:
            self.dropped["events"] += 1
            return
        self.batch.events.append(event)
        self.queued.set()

    # -- writing ------------------------------------------------------------------------

    async def run(self) -> None:
        """Write what is queued, in batches, until cancelled; look at the
        root's free space and stamp when agents were heard from, now and then."""
        while True:
            with trio.move_on_after(min(HEARD_EVERY, HOME_EVERY)):
                await self.queued.wait()
            await trio.sleep(FLUSH_EVERY)  # (what comes meanwhile joins the batch)
            await self.flush()

    async def flush(self) -> None:
        """Write what is queued now (and the periodic stamps that are due)."""
        now = time.monotonic()
        batch, self.batch, self.queued = self.batch, Batch(), trio.Event()
        if now >= self.next_heard:
            self.next_heard = now + HEARD_EVERY
            batch.heard = self._heard()
        look = now >= self.next_home
        if look:
            self.next_home = now + HOME_EVERY
        self._say_dropped()
        if not batch and not look:
            return
        try:
            await self.submit(lambda: self.store.record_timeline(self._with_home(batch) if look else batch))
        except Exception as e:  # noqa: BLE001 - the state may be down: what it could not take is dropped
            self.dropped["batches"] += 1
            log.debug("the job timelines and refusals of one batch were not recorded: %s", e)

    def _heard(self) -> list[tuple[float, str, int]]:
        """When each session holding a job last heard from its agent, where that changed."""
        rows = []
        for job_id, job in self.live.items():
            if job.files.session and job.heard > self.heard.get(job_id, 0.0):
                rows.append((job.heard, job_id, job.files.session))
        self.heard = {job_id: job.heard for job_id, job in self.live.items()}
        return rows

    def _with_home(self, batch: Batch) -> Batch:
        """The batch with the root's free space (in the state's thread: statvfs may block on a network file system)."""
        try:
            st = os.statvfs(self.opts.root)
        except OSError:
            return batch
        batch.home = Home(self.name, str(self.opts.root), self.started, time.time(), st.f_bavail * st.f_frsize,
                          self.opts.min_free)
        return batch

    def _say_dropped(self) -> None:
        now = time.monotonic()
        if now - self.said_dropped < SAY_DROPPED_EVERY or not any(self.dropped.values()):
            return
        self.said_dropped = now
        d, self.dropped = self.dropped, dict.fromkeys(self.dropped, 0)
        log.warning("not recorded in the state (too many, or the state could not take them): %d refused "
                    "connection(s), %d event(s) of jobs, %d batch(es)", d["refusals"], d["events"], d["batches"])
