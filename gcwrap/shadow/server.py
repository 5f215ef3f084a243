"""The shadow: receives the output of any number of jobs and serves their stdin.

One trio task per connection (no process per job). A connection's handler
pwrites DATA inline (cheaper than a thread hop), each piece of a frame at
its offset as it arrives (`receive`), trims what it has, refuses gaps; a
file's written length (what can become durable) moves to a frame's end
only once the frame is whole.
`Durability` makes the bytes of every job durable in groups, in a thread of
its own: sync the dirty files (one syncfs of the root's file system when
that is cheaper than their fdatasyncs), record the new lengths in the state
database, then send the ACKs (`acks.Sender`: synchronously, from the
batch's results, when nothing else is being sent). Nothing is acknowledged
before both.

Descriptors are budgeted from RLIMIT_NOFILE: one socket per connection, and
a bounded cache of open files (`FileCache`) shares what is left. Connections
beyond what the budget allows are told BUSY (with a retry_after) before a
byte is read, and when no descriptor is left at all the shadow stops
accepting until one is freed: an agent is never refused with EMFILE.

Job handshakes and state updates run in one worker thread and durability
batches in another, so neither waits behind the other.

A job id has one session at a time. A connection claims its job the moment
its handshake is read, with no await between the look-up and the claim
(`Shadow._claim`); a later claim fences every earlier session of the job
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
import math
import os
import ssl
import time
from collections.abc import Callable
from typing import TypeVar

import trio

from ..ranks import Rank, ranked
from ..sync import worst_error
from ..wire import compress
from ..wire.events import (
    FILES_FEATURE,
    NOTES_FEATURE,
    PROTOCOL_VERSION,
    ConnectionClosed,
    Data,
    DataPiece,
    Done,
    Error,
    ErrorCode,
    Event,
    Exit,
    Hello,
    Notes,
    Ping,
    Pong,
    StdinRead,
    Welcome,
    ZData,
)
from ..wire.protocol import SUPPORTED_VERSIONS, Connection, ProtocolError, Role
from .acks import Sender
from .admission import GroupCommit, Refused, ShadowOptions, admit, authenticate, disk_busy, retry_after
from .backends import StateBackend
from .collector import keep_collections_short
from .descriptors import ACCEPT_ERRNOS, FdBudget, nofile, open_fds, raise_fd_limit
from .durability import Durability, Fenced, LiveJob
from .eventlog import Caller, EventLog
from .files import FileCache, Problem, StoreError, StreamFile
from .filesession import flush, keep_durable, on_event
from .filestore import FILE_EVENTS, OpenFiles, SessionFiles
from .handshakes import HandshakeMemory, await_event, refuse
from .receive import Buffers, StdinReader, inflate, read_into, read_some
from .replies import ROOT_RETRY_AFTER, ShuttingDown, reply_to
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
        self.durability = Durability(store)  # a thread of its own
        self.files = FileCache(store.root_fd, self.durability.mutex)
        self.stdin = StdinReader(self.files)  # the jobs' stdin files, read in threads (often NFS)
        self.fds_freed = self.durability.done  # also fired when a connection or a job's files close
        self.budget = FdBudget(nofile(), open_fds(), opts.max_connections)
        self.live: dict[str, LiveJob] = {}  # the session that holds each job (the latest claim)
        self.root_watch = RootWatch(opts.root, store.root_fd, self.live)  # deleted or replaced: refuse, fence
        self.written: dict[LiveJob, SessionFiles] = {}  # each session's files the job writes ("files" feature)
        self.open_files = OpenFiles(self.fds_freed.fire)  # (their descriptors, which the budget counts)
        self.sessions: dict[str, list[LiveJob]] = {}  # every session of a job whose files may be open, oldest first
        self.connections = 0
        self.stats = {"accepted": 0, "refused": 0, "bytes": 0, "busy": 0, "wire": 0}
        self.stopping = ""  # why the shadow stops, once it does (see `stop`)
        self.accepting: trio.CancelScope | None = None
        self.serving: trio.CancelScope | None = None
        # Compressed DATA is accepted from agents that offer it, when this Python can decode it; NOTES and files always.
        self.features = ((compress.FEATURE,) if compress.available() else ()) + (NOTES_FEATURE, FILES_FEATURE)
        # With identities (per-identity tokens, or client certificates), each
        # identity's files are under ROOT/<identity>/; without, under ROOT.
        self.tenancy = bool(opts.tokens) or (opts.tls is not None and opts.tls.verify_mode == ssl.CERT_REQUIRED)
        self.handshakes = HandshakeMemory(opts.handshake_memory)  # what unauthenticated connections hold
        # Job handshakes, exits and disconnections recorded in groups, one state transaction each.
        self.records = GroupCommit(store.grouped, self._worker)
        self.buffers = Buffers()  # what streaming sessions read into, lent a read at a time
        self.events = EventLog(opts, store, self.live, self._worker)  # timelines, refusals, free space

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
        self.budget = FdBudget(nofile(), open_fds(), self.opts.max_connections)
        b = self.budget
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
            nursery.start_soon(self.events.run)
            if self.store.shared:
                nursery.start_soon(watch_state, self.store, self.live, self._worker)
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
        log.info("%s: stopping; %d connection(s) told to come back", why, self.connections)
        log.info("%d job handshakes, exits and disconnections in %d state transactions", self.records.requests,
                 self.records.groups)
        if self.accepting is not None:
            self.accepting.cancel()
        for job in list(self.live.values()):
            if job.scope is not None:
                job.scope.cancel()
        self.durability.stop_by = trio.current_time() + STOP_GRACE  # (nothing waits for a sync that hangs past it)
        with trio.move_on_at(self.durability.stop_by):
            while self.connections:
                await self.fds_freed.wait()
            await self.events.flush()  # (how the sessions ended)
        if self.serving is not None:
            self.serving.cancel()

    # -- descriptors -------------------------------------------------------

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        """Accept connections while a descriptor is free for each."""
        warned = 0.0
        async with listener:
            while True:
                await self._room(1)
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
                self.connections += 1
                nursery.start_soon(self._handle, tcp)

    def _free_fds(self) -> int:
        return self.budget.avail - self.connections - len(self.files) - self.open_files.count

    async def _room(self, n: int) -> None:
        """Wait until n more descriptors fit in the budget, closing clean
        cached files first. Dirty ones become clean with the next batch."""
        while self._free_fds() < n:
            self.files.trim(self.budget.avail - self.connections - self.open_files.count - n)
            for written in self.written.values():  # (and the versions' files all durable: reopened when written)
                if self._free_fds() < n:
                    written.trim(0)
            if self._free_fds() >= n:
                return
            await self.fds_freed.wait()

    def _trim_files(self) -> None:
        b = self.budget
        self.files.trim(max(b.min_files, b.avail - self.connections - b.headroom))

    async def _open(self, sf: StreamFile) -> int:
        """The descriptor of a connected job's file, reopened if the cache closed it."""
        if sf.fd < 0:
            await self._room(1)
            self.files.use(sf)
            self._trim_files()
        else:
            self.files.use(sf)
        return sf.fd

    # -- one connection ----------------------------------------------------

    async def _handle(self, tcp: trio.SocketStream) -> None:
        try:
            ip, port = tcp.socket.getpeername()[:2]
            peer = f"{ip}:{port}"
        except OSError:
            ip, peer = "", "?"
        conn = Connection(Role.SHADOW)
        stream: trio.abc.Stream = tcp
        self.handshakes.arrived(conn)
        try:
            if self.connections > self.budget.max_served:
                self.stats["busy"] += 1
                log.warning("%s [unauthenticated]: too many connections (%d; this shadow serves %d at once)", peer,
                            self.connections, self.budget.max_served, extra={"peer": peer, "code": "BUSY"})
                self.events.refused(Caller(peer, ""), ErrorCode.BUSY.name, "too many connections at the shadow")
                await refuse(stream, conn, ErrorCode.BUSY, "too many connections at the shadow",
                                   retry_after=retry_after())
                return
            admitted = await admit(self.opts, tcp, conn, peer, ip,
                                   lambda code, said: self.events.refused(Caller(peer, ""), code, said))
            if admitted is None:
                self.stats["refused"] += 1
                return
            stream, cn = admitted
            await self._serve_stream(stream, conn, peer, cn or ip, cn)
        finally:
            if stream is tcp:  # what aclose_forcefully does to it, without a cancelled checkpoint per connection
                tcp.socket.close()
            else:
                await trio.aclose_forcefully(stream)
                await trio.aclose_forcefully(tcp)
            self.connections -= 1
            self.fds_freed.fire()
            self.handshakes.gone(conn)

    async def _serve_stream(self, stream: trio.abc.Stream, conn: Connection, peer: str, identity: str,
                            cn: str) -> None:
        """Serve one admitted connection; every failure ends in an ERROR to the
        peer, a log line naming the peer, its identity and its job, and a
        record: the session's end in the job's timeline, and a refusal."""
        caller = Caller(peer, cn or "unauthenticated", cn)  # (who it is, once the handshake has established it)
        job: list[LiveJob] = []  # its session, once it holds its job
        try:
            with worst_error():
                await self._serve_connection(stream, conn, identity, cn, caller, job)
        except Exception as e:  # (every failure of one connection ends there: `replies`)
            said = reply_to(e)
            if said.refused:
                self.stats["refused"] += 1
            name = f" (job {caller.job_id})" if caller.job_id else ""  # (what the line names)
            code = said.code.name if said.code is not None else ""
            log.log(said.level, "%s: %s%s", caller, said.said, name, exc_info=said.traceback, extra=caller.fields(code))
            self.events.ended(caller, said.said, code, job[0].heard if job else 0.0)
            if said.refused or (not caller.session and isinstance(e, (ProtocolError, trio.TooSlowError))):
                self.events.refused(caller, code, said.message)
            if said.code is not None:
                await refuse(stream, conn, said.code, said.message, retry_after=said.retry_after)
        else:
            if job:
                self.events.ended(caller, job[0].ended or "connection closed", "", job[0].heard)

    async def _serve_connection(
        self, stream: trio.abc.Stream, conn: Connection, identity: str, cn: str, caller: Caller, held: list[LiveJob],
    ) -> None:
        pending: list[Event] = []
        peer = caller.peer
        introduced = await self._handshake(stream, conn, cn, caller, pending)
        if introduced is None:
            return
        hello, proof, named = introduced
        tenant = named if self.tenancy else ""
        identity = named or identity  # what --max-jobs-per-identity counts: the identity, else the host
        busy = self.root_watch.check() or disk_busy(self.opts)
        if busy:  # (a root that is gone was said once, by its watch)
            log.log(logging.DEBUG if self.root_watch.gone else logging.WARNING, "%s [%s]: job %s told to come back "
                    "later: %s", peer, caller.who, hello.job_id, busy, extra=caller.fields(ErrorCode.BUSY.name))
            self.events.refused(caller, ErrorCode.BUSY.name, busy)
            await refuse(stream, conn, ErrorCode.BUSY, busy, retry_after=ROOT_RETRY_AFTER)
            return
        if PROTOCOL_VERSION not in hello.versions:
            raise ProtocolError(
                f"no common protocol version: agent speaks {list(hello.versions)}, shadow {list(SUPPORTED_VERSIONS)}",
                ErrorCode.VERSION_MISMATCH,
            )
        known = await self._known_attempt(hello)
        if tenant:
            # Whose the job id is, before claiming it: a claim fences the
            # session holding the job, and no identity may do that to another's.
            owner = await self._worker(lambda: self.store.owner(hello.job_id))
            if owner is not None and owner != tenant:
                why = "belongs to another identity" if owner else "was streamed here before this shadow had identities"
                raise Refused(ErrorCode.AUTH_FAILED, f"job {hello.job_id} {why}")
        if self.stopping:
            raise ShuttingDown(f"the shadow is stopping ({self.stopping}): come back soon")
        # (no await since the handshake was read, or since the state said what the attempt is)
        job = self._claim(hello.job_id, hello.instance, identity, tenant, known=known)
        try:
            with trio.CancelScope() as scope:
                job.scope = scope  # before the first await: a later claim cancels this one wherever it waits
                await self._open_job(job, hello, peer, tenant)
                files = job.files
                durable = tuple((sid, sf.durable) for sid, sf in files.outputs.items())
                features = tuple(f for f in self.features if f in hello.features)
                if FILES_FEATURE in features:  # (what home holds of the files the job writes)
                    self.written[job] = SessionFiles(
                        self.store, job.job_id, hello.instance, files.session, tenant, [sf.name for sf in files.all()],
                        quota=self.opts.quota, streams=lambda: sum(f.written for f in files.outputs.values()),
                        said=lambda kind, **details: self.events.event(job.job_id, kind, **details),
                        open_files=self.open_files, room=self._room)
                held_files = await self._worker(self.written[job].load) if job in self.written else ()
                welcome = Welcome(PROTOCOL_VERSION, files.session, durable, self.opts.idle_timeout, proof, features,
                                  held_files)
                self._check(job)
                sender = Sender(stream, conn, job, lambda: self._holds(job))
                await sender.send(conn.send(welcome))
                log.info("%s [%s]: job %s session %d (%s)", peer, caller.who, files.job_id, files.session,
                         hello.host or "?", extra=caller.fields())
                held.append(job)
                job.heard = time.time()
                self.events.opened(caller, files.session, hello.host)
                try:
                    async with trio.open_nursery() as nursery:
                        sender.attach(nursery)  # (its task, started when first needed)
                        try:
                            await self._receive(stream, conn, job, sender, caller, pending)
                        finally:
                            sender.close()  # (before the nursery closes: no batch starts the task after)
                finally:
                    await sender.finish()  # an ACK an inline write left in part, before an ERROR follows
            if scope.cancelled_caught and self.stopping and not job.fenced:
                await self.durability.flush(job)  # what it wrote is durable before the agent is told
                raise ShuttingDown(f"the shadow is stopping ({self.stopping}): come back soon")
            if scope.cancelled_caught:
                raise Fenced(job.fenced or "stopped", job.trouble)
        finally:
            if self.live.get(job.job_id) is job:
                del self.live[job.job_id]
            if job in self.written:
                self.written.pop(job).close()
            await self._release(job)

    async def _handshake(self, stream: trio.abc.Stream, conn: Connection, cn: str, caller: Caller,
                         pending: list[Event]) -> tuple[Hello, str, str] | None:
        """HELLO and authentication, within the handshake timeout (slowloris
        gets nowhere): the HELLO, the proof for WELCOME and the identity, or
        None if the agent went away. `caller` learns the job and the identity."""
        try:
            with trio.fail_after(self.opts.handshake_timeout):
                hello = await await_event(stream, conn, Hello, pending, self.handshakes)
                if hello is None:
                    return None
                assert isinstance(hello, Hello)
                caller.job_id = hello.job_id
                authenticated = await authenticate(self.opts, self.tenancy, stream, conn, hello, cn, pending,
                                                   self.handshakes)
                if authenticated is None:
                    return None
        finally:
            self.handshakes.over(conn)
        self.handshakes.gone(conn)
        proof, named = authenticated
        caller.who = named or ("token" if self.opts.token is not None else "anonymous")
        caller.identity = named
        return hello, proof, named

    async def _known_attempt(self, hello: Hello) -> bool:
        """Whether the state knew this attempt of the job already, when a
        session of another attempt holds the job here: the older of the two
        must not fence the newer. The state says which is which, for every
        shadow; a replaced attempt is refused for good (STALE_ATTEMPT)."""
        held = self.live.get(hello.job_id)
        if held is None or held.instance == hello.instance:
            return False  # (nothing to ask: the claim fences no other attempt)
        attempt = await self._worker(lambda: self.store.attempt(hello.job_id, hello.instance))
        if attempt == "replaced":
            raise StoreError(Problem.STALE_ATTEMPT,
                             f"job {hello.job_id}: a newer attempt has replaced attempt {hello.instance}")
        return attempt != "new"

    def _claim(self, job_id: str, instance: str, identity: str, tenant: str = "", *, known: bool = False) -> LiveJob:
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

    def _holds(self, job: LiveJob) -> bool:
        """Whether `job` is still the session that holds its job."""
        return not job.fenced and self.live.get(job.job_id) is job

    def _check(self, job: LiveJob) -> None:
        """Raise Fenced unless `job` still holds its job (the fencing epoch)."""
        if not self._holds(job):
            job.fence("a newer connection of this job took over")
            job.check()

    async def _open_job(self, job: LiveJob, hello: Hello, peer: str, tenant: str = "") -> None:
        """Open the files of a claimed job at their durable lengths, once no
        earlier session of the job can write them: every one is fenced and
        is waited for until its files are closed. After every await, the
        session checks that it still holds the job (a later claim cancels it)."""
        with trio.move_on_after(10) as waited:
            for prev in job.prev:
                await self._gone(prev)
                self._check(job)
        if waited.cancelled_caught:
            raise Refused(ErrorCode.BUSY, f"an earlier connection of job {job.job_id} is still closing its files")
        job.prev = []
        await self._room(len(hello.streams) + 2)  # the files it opens, and two directories at a time
        self._check(job)
        files = await self.records.submit(lambda: self.store.open_job(
            job_id=hello.job_id, instance=hello.instance, streams=hello.streams, host=hello.host,
            user=hello.user, command=list(hello.command), peer=peer, tenant=tenant,
        ))
        job.files = files  # before any other await: whatever happens next, _release closes them
        for sf in files.all():
            self.files.add(sf)
        self._trim_files()
        self._check(job)
        self.stats["accepted"] += 1

    async def _gone(self, job: LiveJob) -> None:
        """Wait until an earlier session's files are closed."""
        await job.gone.wait()

    async def _worker(self, fn: Callable[[], T]) -> T:
        """Run blocking state work in the one worker thread for handshakes and state records."""
        return await trio.to_thread.run_sync(fn, limiter=self.limiter)

    async def _release(self, job: LiveJob) -> None:
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
                self.fds_freed.fire()

    async def _close_files(self, job: LiveJob) -> None:
        durability = self.durability
        durability.drop(job)
        session = job.files.session
        await durability.let_go(job.files, self.files, STOP_GRACE)
        if log.isEnabledFor(logging.DEBUG):
            sync = self.store.syncer.stats
            log.debug("job %s: files closed; %d connections, %d files open (budget %d); the cache reopened %d, "
                      "closed %d; %d batches: %d syncfs, %d fdatasync", job.job_id, self.connections,
                      len(self.files), self.budget.avail, self.files.reopened, self.files.evicted,
                      self.durability.batches, sync["syncfs"], sync["fdatasync"])
        if not job.finished:
            try:
                # Only while no later session has taken the job over in the state database.
                await self.records.submit(lambda: self.store.record_disconnected(job.job_id, session))
            except Exception as e:  # noqa: BLE001
                log.error("cannot record job state: %s", e)

    async def _receive(
        self, stream: trio.abc.Stream, conn: Connection, job: LiveJob, sender: Sender, caller: Caller,
        pending: list[Event],
    ) -> None:
        conn.pieces = True  # DATA as it arrives, each piece written at its offset
        fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        buf: bytearray | None = None
        with trio.CancelScope() as idle, self.buffers.lending(lambda: buf):  # (one scope, its deadline moved)
            while True:
                if pending:  # what arrived with the handshake
                    events, pending[:] = list(pending), []
                else:
                    idle.deadline = trio.current_time() + self.opts.idle_timeout
                    if fd >= 0:
                        events, buf = await read_into(fd, conn, self.buffers)
                    else:
                        events = await read_some(stream, conn)
                    idle.deadline = math.inf
                    job.heard = time.time()
                over = await self._process(stream, conn, job, sender, caller, events)
                # DATA payloads are views of the read's buffer: keep none of
                # them while waiting for the next read, and lend the buffer on.
                del events
                if buf is not None:
                    self.buffers.give(buf)
                    buf = None
                if over:
                    return
        if idle.cancelled_caught:
            raise trio.TooSlowError

    async def _process(
        self, stream: trio.abc.Stream, conn: Connection, job: LiveJob, sender: Sender, caller: Caller,
        events: list[Event],
    ) -> bool:
        """Act on the events of one read; True when the session is over."""
        files = job.files
        for ev in events:
            self._check(job)
            if type(ev) is DataPiece:
                sf = files.outputs.get(ev.stream)
                if sf is not None and sf.fd < 0:
                    await self._open(sf)
                self._write(job, ev.stream, ev.offset, ev.payload, ev.start, ev.end)
            elif isinstance(ev, (Data, ZData)):
                sf = files.outputs.get(ev.stream)
                if sf is not None and sf.fd < 0:
                    await self._open(sf)
                data = ev if isinstance(ev, Data) else inflate(ev)
                self._write(job, ev.stream, ev.offset, data.payload, ev.offset, ev.offset + len(data.payload),
                            len(ev.payload))
            elif isinstance(ev, StdinRead):
                if files.stdin is not None and files.stdin.fd < 0 and ev.stream == files.stdin_stream:
                    await self._open(files.stdin)
                self._check(job)
                await sender.send(conn.send(await self.stdin.read(files, ev)))
            elif isinstance(ev, FILE_EVENTS):
                # (file frames are refused unless WELCOME accepted the feature: the session has its files)
                await on_event(self.written[job], ev, sender)
            elif isinstance(ev, Ping):
                await sender.send(conn.send(Pong(ev.nonce)))
            elif isinstance(ev, Notes):
                self.events.notes(job, ev.notes)
            elif isinstance(ev, Exit):
                await self._finish(conn, job, ev, sender, caller)
                job.ended = "the job ended"
                return True
            elif isinstance(ev, Error):
                log.warning("%s: agent reported %s: %s", caller, ev.code.name, ev.message,
                            extra=caller.fields(ev.code.name))
                job.ended = f"the agent reported {ev.code.name}: {ev.message}"
                return True
            elif isinstance(ev, ConnectionClosed):  # between frames, before its EXIT: the agent gave up on it
                log.info("%s: connection lost (closed by the agent)", caller, extra=caller.fields())
                job.ended = "connection lost (closed by the agent)"
                return True
        if job in self.written:
            keep_durable(self.written[job], sender)  # (in groups, as the reads go on)
        return False  # (a PONG asks nothing)

    def _write(self, job: LiveJob, stream: int, offset: int, payload: bytes, start: int, end: int,
               wire: int = -1) -> None:
        """Write the piece at `offset` of a DATA frame covering start..end,
        less what the file holds. The frame is checked at its first piece;
        `written` moves to its end at its last, so nothing of a frame becomes
        durable before all of it is in. `wire`: its size on the wire, if compressed."""
        sf = job.files.outputs.get(stream)
        if sf is None:
            raise ProtocolError(f"DATA for stream {stream}, which the handshake did not declare",
                                ErrorCode.UNKNOWN_STREAM)
        if offset == start:
            if start > sf.written:
                raise ProtocolError(
                    f"DATA at offset {start} of {sf.name!r} would leave a gap after byte {sf.written}",
                    ErrorCode.OFFSET_GAP,
                )
            quota = self.opts.quota
            if quota and end > sf.written:
                total = sum(f.written for f in job.files.outputs.values()) + (self.written[job].written()
                                                                               if job in self.written else 0)
                if total + end - sf.written > quota:
                    raise Refused(ErrorCode.QUOTA, f"job {job.files.job_id} would exceed its quota of {quota} bytes")
        last = offset + len(payload) == end
        skip = sf.written - offset  # (`written` holds still until the frame's end)
        if skip < len(payload):
            view = memoryview(payload)[skip:] if skip > 0 else payload
            at = offset + max(skip, 0)
            self._check(job)  # the fencing epoch, checked where the bytes are written (no await from here on)
            self.files.use(sf)
            while view:
                n = os.pwrite(sf.fd, view, at)
                at += n
                view = view[n:]
            sf.partial = not last  # (a file with bytes of a frame not yet whole is not closed by the cache)
        if last:
            wire = end - start if wire < 0 else wire
            sf.wire += wire
            self.stats["wire"] += wire
            if end > sf.written:
                grown, sf.written = end - sf.written, end  # (before the mark: a batch takes `written` as it is)
                self.stats["bytes"] += grown
                self.durability.mark(sf, job, grown)

    async def _finish(self, conn: Connection, job: LiveJob, ev: Exit, sender: Sender, caller: Caller) -> None:
        files = job.files
        await self.durability.flush(job)
        if job in self.written:
            await flush(self.written[job], sender)
            self.written[job].check_exit(ev.files)
            await trio.to_thread.run_sync(self.written[job].finish)
        for sid, length in ev.lengths:
            sf = files.outputs.get(sid)
            if sf is None or sf.durable != length:
                held = sf.durable if sf else 0
                raise ProtocolError(
                    f"EXIT says stream {sid} has {length} bytes, the shadow holds {held}", ErrorCode.LENGTH_MISMATCH
                )
        summary = dict(ev.summary)
        self._check(job)
        recorded = await self.records.submit(
            lambda: self.store.record_finished(
                files.job_id, files.session, code=ev.code, signal=ev.signal, reason=ev.reason, summary=summary,
            )
        )
        if not recorded:
            job.fence("a newer connection of this job took over")
            job.check()
        job.finished = True  # recorded: the exit stands whoever holds the job next
        self.events.event(files.job_id, "exit", code=ev.code, signal=ev.signal, reason=ev.reason)
        self._check(job)
        status = (f"signal {ev.signal}" if ev.signal else f"status {ev.code}" if ev.code is not None
                  else "unknown status")
        log.info("%s: job %s finished with %s", caller, files.job_id, status, extra=caller.fields())
        await sender.send(lambda: conn.send(Done()), check=True)  # (checked under the send lock)
