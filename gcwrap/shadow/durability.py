"""Durability for every job: group commit of their files, in a thread.

`Durability` makes the bytes of every job durable in groups, in a thread of
its own: sync the dirty files (one syncfs of the root's file system when
that is cheaper than their fdatasyncs), record the new lengths in the state
database, then wake the handlers so they send ACKs. Nothing is acknowledged
before both. `LiveJob` is one session of a job, as the server and the
batches see it (a session a newer claim fenced records nothing).
"""

from __future__ import annotations

import collections
import enum
import errno
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..ranks import Rank, ranked
from ..sync import Signal
from .backends import StateBackend
from .files import FileCache, JobFiles, StreamFile
from .pacing import GroupOptions, Pacing
from .state import RecordUnknown, Superseded
from .tally import BYTES, SECONDS, Tally

log = logging.getLogger("gcshadow")

# Batches under bulk output wait to fill: see pacing.py (`GroupOptions`).
JOIN_GRACE = 10.0  # seconds the thread may take to end its batch once the shadow ends (see `_join`)


class Trouble(enum.Enum):
    """Why a session must stop: three kinds of trouble, kept apart in code,
    in the log and on the wire (the server says each with its own code)."""

    TAKEN_OVER = "taken over"  # another session holds the job: FENCED
    STATE = "state database unavailable"  # retryable: BUSY, with a retry-after
    SYNC = "sync failed"  # the disk failed a sync: the file was cut back to what synced; IO_ERROR
    ROOT = "root gone"  # the root was deleted or replaced under the shadow (rootwatch): BUSY until it is restarted


@ranked(Rank.PROTOCOL)
class Fenced(Exception):
    """This connection must stop (`trouble` says why: taken over, the state
    database lost, a failed sync)."""

    def __init__(self, why: str, trouble: Trouble = Trouble.TAKEN_OVER) -> None:
        super().__init__(why)
        self.trouble = trouble


@dataclass(eq=False)
class LiveJob:
    """One session of a job, from its claim until its files are closed.

    `files` is empty (session 0) until the session has opened them. `prev`
    are the sessions of the job claimed before this one whose files may
    still be open: this one opens the files only once they are all `gone`."""

    job_id: str
    identity: str = ""
    tenant: str = ""  # the identity whose part of the root the job's files are in ("": the root itself)
    files: JobFiles = field(init=False)
    prev: list[LiveJob] = field(default_factory=list)
    instance: str = ""  # the attempt this session is of
    scope: trio.CancelScope | None = None
    durable_changed: Signal = field(default_factory=Signal)  # for `Durability.flush`
    on_durable: Callable[[], None] | None = None  # a batch made some of its bytes durable: its ACKs (acks.Sender)
    gone: trio.Event = field(default_factory=trio.Event)  # set once its files are closed
    fenced: str = ""  # why this session must stop, once it must
    trouble: Trouble = Trouble.TAKEN_OVER  # ...and which kind of trouble that is
    finished: bool = False
    heard: float = 0.0  # when its agent last sent anything (time.time(): for the timeline at home)
    ended: str = ""  # how it ended, when not in failure (the agent's EXIT, ERROR or close)
    notes: int = 0  # the agent's notes it took (`eventlog.NOTES_PER_SESSION`)

    def __post_init__(self) -> None:
        self.files = JobFiles(self.job_id, "", session=0)

    def fence(self, why: str, trouble: Trouble = Trouble.TAKEN_OVER) -> None:
        """Stop this session: no write, record or ACK after this; its handler
        is cancelled. The first reason stands."""
        if not self.fenced:
            self.fenced, self.trouble = why, trouble
        if self.scope is not None:
            self.scope.cancel()

    def check(self) -> None:
        """Raise Fenced unless this session may still act for its job."""
        if self.fenced:
            raise Fenced(self.fenced, self.trouble)


@dataclass
class DurabilityStats:
    """What the batches did, for the metrics (metrics.py): bytes by stream
    (1 stdout, 2 stderr) whose frames became whole, and made durable;
    frames that became whole; the batches' latencies and sizes."""

    received: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    made_durable: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    frames: int = 0
    first_marked: float = 0.0  # when the first frame of the pending batch became whole (time.monotonic)
    batch_first: float = 0.0  # ...and of the batch being made durable
    ack_seconds: Tally = field(default_factory=lambda: Tally(SECONDS))  # oldest frame whole to its ACKs (`apply`)
    commit_seconds: Tally = field(default_factory=lambda: Tally(SECONDS))  # a batch's record (its sync: `Syncer`)
    group_bytes: Tally = field(default_factory=lambda: Tally(BYTES))  # bytes a batch made durable


class Durability:
    """Group commit for every job: sync dirty files, record, then wake ackers.

    A thread of its own loops over batches: take every file marked dirty
    since the last batch, sync them (`Store.make_durable`: syncfs or
    fdatasync), commit their new lengths to the state database, hand the
    results to the event loop, and start the next batch at once, while the
    loop applies the results: the lengths become `durable`, which is what
    the ackers send. Nothing is acknowledged before both sync and commit.

    `mutex` guards `pending` and every file's `pins` (a pinned file is in a
    batch: its descriptor must not be closed, so its number is not reused
    under a sync). A file whose sync failed is never synced or recorded
    again in its session: after a reported writeback error a later sync can
    succeed although the bytes are gone. A length is recorded only while
    the file's session still holds its job (`Store.record_durable`): a
    batch of a fenced session that lands late records and acknowledges
    nothing, and cuts nothing back."""

    def __init__(self, store: StateBackend, grouping: GroupOptions | None = None) -> None:
        self.store = store
        self.mutex = threading.Lock()
        self.cond = threading.Condition(self.mutex)
        self.pending: dict[StreamFile, LiveJob] = {}
        self.pacing = Pacing(grouping or GroupOptions())  # (under `mutex`, on time.monotonic)
        self.filling = False  # the thread waits for a bulk batch to fill
        self.hurried = False  # someone waits for a flush: no batch waits to fill
        self.thread_idle = False
        self.stopping = False
        self.inbox: collections.deque[Any] = collections.deque()
        self.arrived = Signal()
        self.done = Signal()  # fired after every batch is applied: files became clean, pins dropped
        self.batches = 0
        self.token: trio.lowlevel.TrioToken | None = None
        self.abandoned = False  # the thread was left stuck (see `_join`)
        self.stop_by = math.inf  # (trio time) the shadow stops by then: nothing waits for a hung sync past it
        self.stats = DurabilityStats()

    def mark(self, sf: StreamFile, job: LiveJob, n: int = 0) -> None:
        """`sf` of `job` has `n` more bytes to make durable (a frame became whole)."""
        stats = self.stats
        with self.mutex:
            now = time.monotonic()
            if not self.pending:
                stats.first_marked = now
            self.pending[sf] = job
            full = self.pacing.mark(n, now)
            stats.frames += 1
            stats.received[sf.stream] = stats.received.get(sf.stream, 0) + n
            if self.thread_idle:
                self.thread_idle = False
                self.cond.notify()
            elif self.filling and full:
                self.cond.notify()

    def hurry(self) -> None:
        """Someone waits for what is pending: take the next batch without waiting for it to fill."""
        with self.mutex:
            self.hurried = True
            if self.filling:
                self.cond.notify()

    def drop(self, job: LiveJob) -> None:
        """Forget the files of one session that wait for a batch (it is leaving)."""
        with self.mutex:
            for sf in [sf for sf, owner in self.pending.items() if owner is job]:
                del self.pending[sf]

    # -- the durability thread ---------------------------------------------------

    def _thread(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.pending and not self.stopping:
                        self.thread_idle = True
                        self.cond.wait()
                    self.thread_idle = False
                    if self.pacing.after_bulk:
                        self._fill()
                    if self.stopping:
                        return
                self._post((*self.run_batch(), self.stats.batch_first))
        except BaseException as e:  # noqa: BLE001 - a bug: handed to the event loop, which re-raises it
            self._post(e)

    def _fill(self) -> None:
        """Under bulk output, wait (holding `cond`) for the pending batch to
        fill: see pacing.py."""
        self.filling = True
        try:
            while not (self.stopping or self.hurried) and (wait := self.pacing.wait(time.monotonic())) > 0:
                self.cond.wait(wait)
        finally:
            self.filling = False

    def run_batch(self) -> tuple[dict[StreamFile, LiveJob], list[tuple[StreamFile, int, OSError | None]], str]:
        """One batch (blocking): take every file marked so far, sync and
        record them. The result is for `apply`, in the event loop."""
        with self.mutex:
            batch, self.pending = self.pending, {}
            began = time.monotonic()
            took = self.pacing.take(began)
            self.hurried = False
            self.stats.batch_first = self.stats.first_marked
            snapshot = []
            for sf in batch:
                sf.pins += 1
                snapshot.append((sf, sf.written))  # bytes pwritten before this are covered
        try:
            todo = [(sf, n) for sf, n in snapshot if not sf.sync_failed]
            results, db_error = self.store.make_durable(todo) if todo else ([], "")
            if todo:  # (the sync's share is the syncer's: what is left is the record's)
                self.stats.commit_seconds.observe(max(time.monotonic() - began - self.store.syncer.took, 0.0))
                self.stats.group_bytes.observe(took)
            failed = OSError(errno.EIO, "an earlier sync of this file failed")
            results += [(sf, n, failed) for sf, n in snapshot if sf.sync_failed]
            for sf, _, err in results:
                if err is not None and not isinstance(err, (Superseded, RecordUnknown)):
                    sf.sync_failed = True  # before the next batch can pick it up
        finally:
            with self.mutex:
                for sf, _ in snapshot:
                    sf.unpin()
        return batch, results, db_error

    def _post(self, item: Any) -> None:
        self.inbox.append(item)
        assert self.token is not None
        try:
            self.token.run_sync_soon(self.arrived.fire)
        except trio.RunFinishedError:
            pass

    # -- in the event loop -------------------------------------------------------------

    async def run(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        thread = threading.Thread(target=self._thread, name="gcshadow-durability", daemon=True)
        thread.start()
        try:
            while True:
                while not self.inbox:
                    await self.arrived.wait()
                item = self.inbox.popleft()
                if isinstance(item, BaseException):
                    raise RuntimeError("the durability thread failed") from item
                self.apply(*item)
        finally:
            with self.cond:
                self.stopping = True
                self.cond.notify()
            await self._join(thread)
            # The last batch dropped its pins but is never applied: wake who
            # waits for pins to drop (a session closing its files), or it
            # waits forever and the shadow never stops.
            self.done.fire()

    async def _join(self, thread: threading.Thread) -> None:
        """Wait for the thread to end its batch, but not past the shadow's
        stop (`stop_by`), nor JOIN_GRACE without one: a sync that hangs (a
        dead NFS server) must not hang the shadow. Nothing of what a batch
        makes durable is acknowledged before it ends: nothing is lost."""
        now = trio.current_time()
        with trio.CancelScope(deadline=min(max(self.stop_by, now + 1.0), now + JOIN_GRACE), shield=True) as scope:
            await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
        if scope.cancelled_caught:
            self.abandoned = True
            syncer = self.store.syncer
            what = (f"the sync of {', '.join(map(repr, syncer.syncing))}" if syncer.syncing
                    else "its record of durable lengths in the state database")
            log.error("the durability thread is stuck in %s, for %.0f s now; exiting anyway (none of it was "
                      "acknowledged)", what, time.monotonic() - (syncer.since if syncer.syncing else self.pacing.began))

    def apply(
        self, batch: dict[StreamFile, LiveJob], results: list[tuple[StreamFile, int, OSError | None]], db_error: str,
        first: float = 0.0,
    ) -> None:
        """A batch's results: lengths become durable (what the ackers send).
        The three kinds of trouble stop a session each in its own way
        (`Trouble`): a record refused because a newer session holds the job;
        a record whose outcome is unknown (the state database failed: it may
        have applied), where nothing is cut back; a failed sync, where the
        file is cut back to what synced before. `first`: when the batch's
        first frame became whole (time.monotonic), for the ACK latency."""
        self.batches += 1
        made = self.stats.made_durable
        unknown: set[LiveJob] = set()
        for sf, n, err in results:
            job = batch.get(sf)
            if err is None or isinstance(err, RecordUnknown):
                sf.synced = max(sf.synced, n)  # on disk, whatever the state database says
            if err is None:
                if n > sf.durable:
                    made[sf.stream] = made.get(sf.stream, 0) + n - sf.durable
                    sf.durable = n
                continue
            if isinstance(err, Superseded):
                # A newer session holds the job: this one's bytes are not its
                # to record. Nothing is cut back: the file may be the newer
                # session's by now.
                if job is not None:
                    job.fence(str(err))
                continue
            if isinstance(err, RecordUnknown):
                # The length may or may not be recorded: the bytes it covers
                # stay (they synced), nothing is acknowledged, and the
                # session stops; the next one reads what the state holds.
                if job is not None:
                    job.fence(f"the state database failed while recording this job's output ({err.strerror}): "
                              "nothing more is acknowledged until it answers; come back shortly", Trouble.STATE)
                    unknown.add(job)
                continue
            self._cut_back(sf, job, err)
        if db_error:
            log.error("%d session(s) stopped: whether their last durable lengths were recorded is unknown (%s); "
                      "nothing that synced is cut back, and they resume from what the state holds",
                      len(unknown), db_error)
        for job in set(batch.values()):
            if job.on_durable is not None:
                job.on_durable()  # its ACKs, right here when nothing else is being sent (acks.Sender)
            job.durable_changed.fire()  # (nothing to do when no flush waits)
        if first:
            self.stats.ack_seconds.observe(time.monotonic() - first)
        self.done.fire()

    def _cut_back(self, sf: StreamFile, job: LiveJob | None, err: OSError) -> None:
        """After a failed fsync the kernel may have dropped the dirty pages:
        nothing past what synced before can be trusted. Cut back there and
        make the agent resend from what was acknowledged (in a new session).
        Never below `synced`: a length recorded with an unknown outcome may
        be that long, and bytes that synced are on disk."""
        if sf.cut_back:
            return
        sf.cut_back = True
        log.error("cannot sync %s: %s; cut back to the %d bytes that synced before", sf.name, err.strerror,
                  sf.synced, extra={"job": sf.job_id, "stream": sf.name})
        sf.written = sf.synced
        if sf.fd >= 0:  # a closed one is cut back when it is next opened (Store.open_job)
            try:
                os.ftruncate(sf.fd, sf.synced)
            except OSError:
                pass
        if job is not None:
            job.fence(f"the shadow could not sync {sf.name}: {err.strerror}", Trouble.SYNC)

    async def let_go(self, files: JobFiles, cache: FileCache, grace: float) -> None:
        """Close a session's files once no batch syncs them, waiting no
        longer than `grace` (nor past `stop_by`): a sync that hangs (a dead
        NFS server) keeps what it syncs open, and closes it once it returns
        (`StreamFile.unpin`). A stdin read in flight does the same, unwaited."""
        began = trio.current_time()
        every = files.all()
        with trio.move_on_at(min(began + grace, self.stop_by)):
            while any(sf.pins for sf in every if sf.write):
                await self.done.wait()
        with self.mutex:
            stuck = [repr(sf.name) for sf in every if sf.pins and sf.write]
            for sf in every:
                cache.forget(sf)
            files.close()
        if stuck:
            syncer = self.store.syncer
            took = time.monotonic() - syncer.since if syncer.syncing else trio.current_time() - began
            log.warning("job %s: the sync of %s has not returned for %.0f s: its session ends without it",
                        files.job_id, ", ".join(stuck), took, extra={"job": files.job_id})

    async def flush(self, job: LiveJob) -> None:
        """Wait until every byte written for `job` so far is durable (Fenced
        if the session is stopped meanwhile)."""
        while any(sf.durable < sf.written for sf in job.files.outputs.values()):
            job.check()
            self.hurry()
            await job.durable_changed.wait()

