"""The shadow: receives the output of any number of jobs and serves their stdin.

`Shadow` is the listener and the registry of jobs and sessions; each
connection is an `AgentConnection` (connection.py), one trio task (no
process per job), that owns the connection's whole life. It pwrites DATA
inline (cheaper than a thread hop), each piece of a frame at its offset as
it arrives (`receive`), trims what it has, refuses gaps; a file's written
length (what can become durable) moves to a frame's end only once the
frame is whole.
`Durability` makes the bytes of every job durable in groups, in a thread of
its own: sync the dirty files (one syncfs of the root's file system when
that is cheaper than their fdatasyncs), record the new lengths in the state
database, then send the ACKs (`acks.Sender`: synchronously, from the
batch's results, when nothing else is being sent). Nothing is acknowledged
before both.

Descriptors are budgeted from RLIMIT_NOFILE (`Descriptors`): one socket
per connection, and a bounded cache of open files (`FileCache`) shares
what is left. Connections beyond what the budget allows are told BUSY
(with a retry_after) before a byte is read, and when no descriptor is left at all the shadow stops
accepting until one is freed: an agent is never refused with EMFILE.

Job handshakes and state updates run in one worker thread and durability
batches in another, so neither waits behind the other.

A job id has one session at a time. A connection claims its job the moment
its handshake is read, with no await between the look-up and the claim
(`Shadow.claim`); a later claim fences every earlier session of the job
off: it writes, records and acknowledges nothing more (each checks that it
still holds the job right where it acts: before the pwrite, in the state
database's update, before the ACK), its handler is cancelled, and the newer
one opens the files, cutting them back to their durable length, only once
every earlier session's files are closed. So two sessions never write one
file, and no file is cut back beneath a session that could still write it.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from ..ranks import Rank, ranked
from ..wire.events import ErrorCode
from .admission import GroupCommit, Refused, ShadowOptions, disk_busy
from .backends import StateBackend
from .collector import keep_collections_short
from .connection import AgentConnection
from .descriptors import ACCEPT_ERRNOS, Descriptors, FdBudget, nofile, open_fds, raise_fd_limit
from .durability import Durability, LiveJob
from .eventlog import EventLog
from .files import FileCache, Problem, StoreError
from .handshakes import HandshakeMemory
from .receive import Buffers, StdinReader
from .rootwatch import RootWatch
from .sharing import watch_state

log = logging.getLogger("gcshadow")
T = TypeVar("T")

# Stopping (SIGTERM, SIGINT): every session makes what it wrote durable and
# tells its agent SHUTTING_DOWN, within STOP_GRACE seconds; the agents come
# back after replies.STOP_RETRY_AFTER, without counting a failure (a restart).
STOP_GRACE = 10.0


@ranked(Rank.LOCAL)
class ListenError(Exception):
    """The shadow cannot listen where it was asked to (or say where it listens)."""


class Shadow:
    """The shadow's server: accepts agents, admits each session of a job
    (fencing the older ones), writes their DATA into the job's files, acks
    what `Durability` made durable, serves stdin, and stops in order
    (`stop`, on SIGTERM or SIGINT)."""

    def __init__(self, opts: ShadowOptions, store: StateBackend) -> None:
        self.opts = opts
        self.store = store
        self.limiter = trio.CapacityLimiter(1)  # job handshakes and state records
        self.durability = Durability(store, opts.grouping)  # a thread of its own
        files = FileCache(store.root_fd, self.durability.mutex)
        self.stdin = StdinReader(files)  # the jobs' stdin files, read in threads (often NFS)
        # Sockets and files against the descriptor budget; freed also when a durability batch makes files clean.
        self.fds = Descriptors(FdBudget(nofile(), open_fds(), opts.max_connections), files, self.durability.done)
        self.live: dict[str, LiveJob] = {}  # the session that holds each job (the latest claim)
        self.root_watch = RootWatch(opts.root, store.root_fd, self.live)  # deleted or replaced: refuse, fence
        self.sessions: dict[str, list[LiveJob]] = {}  # every session of a job whose files may be open, oldest first
        self.stats = {"accepted": 0, "refused": 0, "bytes": 0, "busy": 0, "wire": 0}
        self.stopping = ""  # why the shadow stops, once it does (see `stop`)
        self.accepting: trio.CancelScope | None = None
        self.serving: trio.CancelScope | None = None
        self.handshakes = HandshakeMemory(opts.handshake_memory)  # what unauthenticated connections hold
        # Job handshakes, exits and disconnections recorded in groups, one state transaction each.
        self.records = GroupCommit(store.grouped, self.worker)
        self.buffers = Buffers()  # what streaming sessions read into, lent a read at a time
        self.events = EventLog(opts, store, self.live, self.worker)  # timelines, refusals, free space

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        raise_fd_limit()
        await trio.to_thread.run_sync(self.store.mark_disconnected, limiter=self.limiter)
        try:
            listeners = await trio.open_tcp_listeners(self.opts.port, host=self.opts.host)
        except OSError as e:
            hint = ""
            if e.errno == errno.EADDRINUSE:
                hint = " (another program has it: choose another --port, or --port 0 for any free one)"
            elif e.errno == errno.EACCES and self.opts.port < 1024:
                hint = " (ports below 1024 need privileges: choose --port 1024-65535)"
            raise ListenError(f"cannot listen on {self.opts.host}:{self.opts.port}: {e.strerror or e}{hint}") from None
        b = self.fds.budget = FdBudget(nofile(), open_fds(), self.opts.max_connections)
        log.debug("descriptors: limit %d, %d for sockets and files; up to %d connections served, "
                  "at least %d files kept open", b.limit, b.avail, b.max_served, b.min_files)
        if b.max_served < self.opts.max_connections // 2:  # (a limit that takes more than half of them)
            log.warning("the descriptor limit (%d) lets this shadow serve %d connections at once, not %d: more are "
                        "told BUSY; raise the hard limit (ulimit -Hn, or LimitNOFILE= in a systemd unit) for more",
                        b.limit, b.max_served, self.opts.max_connections)
        async with trio.open_nursery() as nursery:
            self.serving = nursery.cancel_scope
            nursery.start_soon(self.durability.run)
            nursery.start_soon(keep_collections_short)  # no GC pause of seconds under 10 000 connections
            nursery.start_soon(self.root_watch.run)
            nursery.start_soon(self.fds.close_idle)  # an idle job's files closed: it holds its socket alone
            nursery.start_soon(self.events.run)
            if self.store.shared:
                nursery.start_soon(watch_state, self.store, self.live, self.worker)
            accepting = await nursery.start(self._accept_all, listeners, nursery)
            port = listeners[0].socket.getsockname()[1]
            log.info("serving %s on %s:%d", self.opts.root, self.opts.host, port)
            if short := disk_busy(self.opts):
                log.warning("%s: every job is told to come back later (BUSY) until the root has room "
                            "(or give a smaller --min-free)", short)
            if self.opts.port_file is not None:
                tmp = self.opts.port_file.with_name(self.opts.port_file.name + ".tmp")
                try:
                    tmp.write_text(f"{port}\n")
                    tmp.replace(self.opts.port_file)
                except OSError as e:
                    raise ListenError(f"cannot write the port file {self.opts.port_file}: {e.strerror}") from None
            self.accepting = accepting
            task_status.started(port)

    async def _accept_all(self, listeners: list[trio.SocketListener], nursery: trio.Nursery, *,
                          task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        """Accept on every listener until `stop` cancels the scope it reports."""
        async with trio.open_nursery() as accepting:
            for listener in listeners:
                accepting.start_soon(self._accept, listener, nursery)
            task_status.started(accepting.cancel_scope)

    async def stop(self, why: str) -> None:
        """Stop serving: accept no more connections; every session makes what
        it wrote durable and tells its agent SHUTTING_DOWN (it comes back,
        to this shadow restarted); then end, within STOP_GRACE."""
        self.stopping = why
        log.info("%s: stopping; %d connection(s) told to come back", why, self.fds.connections)
        log.info("%d job handshakes, exits and disconnections in %d state transactions", self.records.requests,
                 self.records.groups)
        if self.accepting is not None:
            self.accepting.cancel()
        for job in list(self.live.values()):
            if job.scope is not None:
                job.scope.cancel()
        self.durability.stop_by = trio.current_time() + STOP_GRACE  # (nothing waits for a sync that hangs past it)
        with trio.move_on_at(self.durability.stop_by):
            while self.fds.connections:
                await self.fds.freed.wait()
            await self.events.flush()  # (how the sessions ended)
        if self.serving is not None:
            self.serving.cancel()

    # -- the listener --------------------------------------------------------

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept connections while a descriptor is free for each."""
        warned = 0.0
        async with listener:
            while True:
                await self.fds.room(1)
                try:
                    tcp = await listener.accept()
                except OSError as e:
                    if e.errno not in ACCEPT_ERRNOS:
                        raise
                    if time.monotonic() - warned > 10:  # outside our budget: other processes, or the kernel
                        log.warning("cannot accept connections for now: %s; retrying", e.strerror)
                        warned = time.monotonic()
                    await trio.sleep(0.1)
                    continue
                self.fds.connections += 1
                nursery.start_soon(AgentConnection.accepted(self, tcp).run)

    # -- the registry of jobs and sessions ------------------------------------

    def claim(self, job_id: str, instance: str, identity: str, tenant: str = "", *, known: bool = False) -> LiveJob:
        """A new session takes the job, at once: no await between looking up
        who holds it and taking it, so one session holds a job at any instant.
        The holder until now is fenced: it writes, records and acknowledges
        nothing more, and its handler is cancelled. Only by a session of the
        same identity: a job id another identity is streaming is refused.
        An attempt the state already `known` when asked, meeting a session
        of another attempt here, is older than it (that one was new, or
        current after it): it is refused and fences nobody."""
        held = self.live.get(job_id)
        if held is not None and held.tenant != tenant:
            raise Refused(ErrorCode.AUTH_FAILED, f"job {job_id} belongs to another identity")
        if held is not None and known and held.instance != instance:
            raise StoreError(Problem.STALE_ATTEMPT, f"job {job_id}: a newer attempt has replaced attempt {instance}")
        cap = self.opts.max_jobs_per_identity
        if cap and job_id not in self.live:
            mine = sum(1 for j in self.live.values() if j.identity == identity)
            if mine >= cap:
                raise Refused(ErrorCode.BUSY, f"{identity} already has {mine} jobs streaming here (the cap is {cap})")
        old = self.live.get(job_id)
        if old is not None:
            old.fence("a newer connection of this job took over")
        sessions = self.sessions.setdefault(job_id, [])
        job = LiveJob(job_id, identity, tenant, prev=list(sessions), instance=instance)
        sessions.append(job)
        self.live[job_id] = job
        return job

    def holds(self, job: LiveJob) -> bool:
        """Whether `job` is still the session that holds its job."""
        return not job.fenced and self.live.get(job.job_id) is job

    def check(self, job: LiveJob) -> None:
        """Raise Fenced unless `job` still holds its job (the fencing epoch)."""
        if not self.holds(job):
            job.fence("a newer connection of this job took over")
            job.check()

    async def wait_closed(self, job: LiveJob) -> None:
        """Wait until an earlier session's files are closed (`release`)."""
        await job.gone.wait()

    async def worker(self, fn: Callable[[], T]) -> T:
        """Run blocking state work in the one worker thread for handshakes and state records."""
        return await trio.to_thread.run_sync(fn, limiter=self.limiter)

    async def release(self, job: LiveJob) -> None:
        """Close a session's files once nothing can sync them any more, then
        let a later session of the job open them."""
        with trio.CancelScope(shield=True):
            try:
                if job.files.session:
                    await self._close_files(job)
            finally:
                sessions = self.sessions.get(job.job_id, [])
                if job in sessions:
                    sessions.remove(job)
                if not sessions:
                    self.sessions.pop(job.job_id, None)
                job.gone.set()
                self.fds.freed.fire()

    async def _close_files(self, job: LiveJob) -> None:
        durability = self.durability
        durability.drop(job)
        session = job.files.session
        await durability.let_go(job.files, self.fds.files, STOP_GRACE)
        if log.isEnabledFor(logging.DEBUG):
            sync, fds = self.store.syncer.stats, self.fds
            log.debug("job %s: files closed; %d connections, %d files open (budget %d); the cache reopened %d, "
                      "closed %d; %d batches: %d syncfs, %d fdatasync", job.job_id, fds.connections,
                      len(fds.files), fds.budget.avail, fds.files.reopened, fds.files.evicted,
                      self.durability.batches, sync["syncfs"], sync["fdatasync"])
        if not job.finished:
            try:
                # Only while no later session has taken the job over in the state database.
                await self.records.submit(lambda: self.store.record_disconnected(job.job_id, session))
            except Exception as e:  # noqa: BLE001
                log.error("cannot record job state: %s", e)

