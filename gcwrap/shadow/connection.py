"""One agent's connection to the shadow, from its accept to its close.

`AgentConnection` owns the whole life of one connection, as hypercorn's
connection objects do: the limits checked before a byte is read, the
admission (allow-list, TLS), the handshake and authentication, the claim
of its job (through the shadow, the registry of jobs and sessions), the
session's files, the reads and what each frame asks (`_process`, `_write`
pwrites DATA inline, each piece at its offset as it arrives; on a plain
socket `_splice` moves a large payload still in the socket into its file
through a pipe, also at its offset as it arrives), the EXIT's
record and the DONE, and its end: an ERROR to the agent, a log line and a
record in the job's timeline, the session's files closed.

What it uses of the shadow that accepted it is `Host` (the shadow's
server, gcwrap.shadow.server.Shadow): its options and state, the
durability thread, the descriptor budget, the registry (`claim`, `holds`,
`check`, `release`) and the one state worker.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import trio

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
from ..wire.frames import DATA_HEAD
from ..wire.protocol import SUPPORTED_VERSIONS, Connection, ProtocolError, Role
from .acks import Sender
from .admission import GroupCommit, Refused, ShadowOptions, admit, authenticate, disk_busy, retry_after
from .backends import StateBackend
from .descriptors import Descriptors
from .durability import Durability, Fenced, LiveJob
from .eventlog import Caller, EventLog
from .files import Problem, StoreError, StreamFile
from .filesession import flush, keep_durable, on_event
from .filestore import FILE_EVENTS, SessionFiles
from .handshakes import HandshakeMemory, await_event, refuse
from .receive import READ_SIZE, Buffers, StdinReader, inflate, read_into, read_some
from .replies import ROOT_RETRY_AFTER, ShuttingDown, reply_to
from .rootwatch import RootWatch
from .splicer import SPLICE_MIN, UNSUPPORTED_ERRNOS, Splicer

log = logging.getLogger("gcshadow")
T = TypeVar("T")

# Compressed DATA is accepted from agents that offer it, when this Python can decode it; NOTES and files always.
FEATURES = ((compress.FEATURE,) if compress.available() else ()) + (NOTES_FEATURE, FILES_FEATURE)


class Host(Protocol):
    """What a connection uses of the shadow that accepted it."""

    opts: ShadowOptions
    store: StateBackend
    durability: Durability
    fds: Descriptors
    stdin: StdinReader
    live: dict[str, LiveJob]
    root_watch: RootWatch
    handshakes: HandshakeMemory
    records: GroupCommit
    buffers: Buffers
    events: EventLog
    stats: dict[str, int]
    stopping: str

    def claim(self, job_id: str, instance: str, identity: str, tenant: str = "", *, known: bool = False
              ) -> LiveJob: ...
    def holds(self, job: LiveJob) -> bool: ...
    def check(self, job: LiveJob) -> None: ...
    async def wait_closed(self, job: LiveJob) -> None: ...
    async def release(self, job: LiveJob) -> None: ...
    async def worker(self, fn: Callable[[], T]) -> T: ...


class AgentConnection:
    """The shadow's end of one agent's connection (see the module's docstring)."""

    def __init__(self, shadow: Host, stream: trio.abc.Stream, peer: str, ip: str = "") -> None:
        self.shadow = shadow
        self.stream = stream  # what it speaks on: the socket, then TLS over it once admitted
        self.conn = Connection(Role.SHADOW)
        self.peer = peer
        self.ip = ip  # who it is without a certificate (what --max-jobs-per-identity counts then)
        self.caller = Caller(peer, "unauthenticated")  # (who it is, once the handshake has established it)
        self.pending: list[Event] = []  # what arrived with the handshake, not acted on yet
        self.job: LiveJob | None = None  # its session, once WELCOME told the agent
        self.versions: SessionFiles | None = None  # the files the job writes ("files" feature)
        self.sender: Sender | None = None  # its ACKs and its send lock, once it holds its job

    @classmethod
    def accepted(cls, shadow: Host, tcp: trio.SocketStream) -> AgentConnection:
        try:
            ip, port = tcp.socket.getpeername()[:2]
            return cls(shadow, tcp, f"{ip}:{port}", ip)
        except OSError:
            return cls(shadow, tcp, "?")

    async def run(self) -> None:
        """An accepted connection: told BUSY past the budget, admitted (or
        refused), served, closed; the shadow counted it when it accepted it."""
        shadow, conn, peer = self.shadow, self.conn, self.peer
        tcp = self.stream
        assert isinstance(tcp, trio.SocketStream)
        fds = shadow.fds
        shadow.handshakes.arrived(conn)
        try:
            if fds.connections > fds.budget.max_served:
                shadow.stats["busy"] += 1
                log.warning("%s [unauthenticated]: too many connections (%d; this shadow serves %d at once)", peer,
                            fds.connections, fds.budget.max_served, extra={"peer": peer, "code": "BUSY"})
                shadow.events.refused(Caller(peer, ""), ErrorCode.BUSY.name, "too many connections at the shadow")
                await refuse(tcp, conn, ErrorCode.BUSY, "too many connections at the shadow",
                             retry_after=retry_after())
                return
            admitted = await admit(shadow.opts, tcp, conn, peer, self.ip,
                                   lambda code, said: shadow.events.refused(Caller(peer, ""), code, said))
            if admitted is None:
                shadow.stats["refused"] += 1
                return
            self.stream, cn = admitted
            await self.serve(cn)
        finally:
            if self.stream is tcp:  # what aclose_forcefully does to it, without a cancelled checkpoint per connection
                tcp.socket.close()
            else:
                await trio.aclose_forcefully(self.stream)
                await trio.aclose_forcefully(tcp)
            fds.connections -= 1
            fds.freed.fire()
            shadow.handshakes.gone(conn)

    async def serve(self, cn: str = "") -> None:
        """Serve the admitted connection (`cn`: its client certificate's);
        every failure ends in an ERROR to the peer, a log line naming the
        peer, its identity and its job, and a record: the session's end in
        the job's timeline, and a refusal."""
        caller = self.caller = Caller(self.peer, cn or "unauthenticated", cn)
        events = self.shadow.events
        try:
            with worst_error():
                await self._session(cn)
        except Exception as e:  # (every failure of one connection ends there: `replies`)
            said = reply_to(e)
            if said.refused:
                self.shadow.stats["refused"] += 1
            name = f" (job {caller.job_id})" if caller.job_id else ""  # (what the line names)
            code = said.code.name if said.code is not None else ""
            log.log(said.level, "%s: %s%s", caller, said.said, name, exc_info=said.traceback, extra=caller.fields(code))
            events.ended(caller, said.said, code, self.job.heard if self.job else 0.0)
            if said.refused or (not caller.session and isinstance(e, (ProtocolError, trio.TooSlowError))):
                events.refused(caller, code, said.message)
            if said.code is not None:
                await refuse(self.stream, self.conn, said.code, said.message, retry_after=said.retry_after)
        else:
            if self.job is not None:
                events.ended(caller, self.job.ended or "connection closed", "", self.job.heard)

    # -- the session ---------------------------------------------------------

    async def _session(self, cn: str) -> None:
        """The handshake, the claim of its job, then the session until it ends."""
        shadow, caller = self.shadow, self.caller
        introduced = await self._handshake(cn)
        if introduced is None:
            return
        hello, proof, named = introduced
        tenant = named if shadow.opts.tenancy else ""
        identity = named or cn or self.ip  # what --max-jobs-per-identity counts: the identity, else the host
        busy = shadow.root_watch.check() or disk_busy(shadow.opts)
        if busy:  # (a root that is gone was said once, by its watch)
            log.log(logging.DEBUG if shadow.root_watch.gone else logging.WARNING, "%s [%s]: job %s told to come "
                    "back later: %s", self.peer, caller.who, hello.job_id, busy,
                    extra=caller.fields(ErrorCode.BUSY.name))
            shadow.events.refused(caller, ErrorCode.BUSY.name, busy)
            await refuse(self.stream, self.conn, ErrorCode.BUSY, busy, retry_after=ROOT_RETRY_AFTER)
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
            owner = await shadow.worker(lambda: shadow.store.owner(hello.job_id))
            if owner is not None and owner != tenant:
                why = "belongs to another identity" if owner else "was streamed here before this shadow had identities"
                raise Refused(ErrorCode.AUTH_FAILED, f"job {hello.job_id} {why}")
        if shadow.stopping:
            raise ShuttingDown(f"the shadow is stopping ({shadow.stopping}): come back soon")
        # (no await since the handshake was read, or since the state said what the attempt is)
        job = shadow.claim(hello.job_id, hello.instance, identity, tenant, known=known)
        try:
            with trio.CancelScope() as scope:
                job.scope = scope  # before the first await: a later claim cancels this one wherever it waits
                await self._open_job(job, hello, tenant)
                await self._welcome(job, hello, proof)
                await self._stream()
            if scope.cancelled_caught and shadow.stopping and not job.fenced:
                await shadow.durability.flush(job)  # what it wrote is durable before the agent is told
                raise ShuttingDown(f"the shadow is stopping ({shadow.stopping}): come back soon")
            if scope.cancelled_caught:
                raise Fenced(job.fenced or "stopped", job.trouble)
        finally:
            if shadow.live.get(job.job_id) is job:
                del shadow.live[job.job_id]
            if self.versions is not None:
                shadow.fds.versions.discard(self.versions)
                self.versions.close()
            await shadow.release(job)

    async def _handshake(self, cn: str) -> tuple[Hello, str, str] | None:
        """HELLO and authentication, within the handshake timeout (slowloris
        gets nowhere): the HELLO, the proof for WELCOME and the identity, or
        None if the agent went away. `caller` learns the job and the identity."""
        shadow, stream, conn, caller = self.shadow, self.stream, self.conn, self.caller
        try:
            with trio.fail_after(shadow.opts.handshake_timeout):
                hello = await await_event(stream, conn, Hello, self.pending, shadow.handshakes)
                if hello is None:
                    return None
                assert isinstance(hello, Hello)
                caller.job_id = hello.job_id
                authenticated = await authenticate(shadow.opts, stream, conn, hello, cn, self.pending,
                                                   shadow.handshakes)
                if authenticated is None:
                    return None
        finally:
            shadow.handshakes.over(conn)
        shadow.handshakes.gone(conn)
        proof, named = authenticated
        caller.who = named or ("token" if shadow.opts.token is not None else "anonymous")
        caller.identity = named
        return hello, proof, named

    async def _known_attempt(self, hello: Hello) -> bool:
        """Whether the state knew this attempt of the job already, when a
        session of another attempt holds the job here: the older of the two
        must not fence the newer. The state says which is which, for every
        shadow; a replaced attempt is refused for good (STALE_ATTEMPT)."""
        shadow = self.shadow
        held = shadow.live.get(hello.job_id)
        if held is None or held.instance == hello.instance:
            return False  # (nothing to ask: the claim fences no other attempt)
        attempt = await shadow.worker(lambda: shadow.store.attempt(hello.job_id, hello.instance))
        if attempt == "replaced":
            raise StoreError(Problem.STALE_ATTEMPT,
                             f"job {hello.job_id}: a newer attempt has replaced attempt {hello.instance}")
        return attempt != "new"

    async def _open_job(self, job: LiveJob, hello: Hello, tenant: str) -> None:
        """Open the files of a claimed job at their durable lengths, once no
        earlier session of the job can write them: every one is fenced and
        is waited for until its files are closed. After every await, the
        session checks that it still holds the job (a later claim cancels it)."""
        shadow = self.shadow
        with trio.move_on_after(10) as waited:
            for prev in job.prev:
                await shadow.wait_closed(prev)
                shadow.check(job)
        if waited.cancelled_caught:
            raise Refused(ErrorCode.BUSY, f"an earlier connection of job {job.job_id} is still closing its files")
        job.prev = []
        await shadow.fds.room(len(hello.streams) + 2)  # the files it opens, and two directories at a time
        shadow.check(job)
        files = await shadow.records.submit(lambda: shadow.store.open_job(
            job_id=hello.job_id, instance=hello.instance, streams=hello.streams, host=hello.host,
            user=hello.user, command=list(hello.command), peer=self.peer, tenant=tenant,
        ))
        job.files = files  # before any other await: whatever happens next, `release` closes them
        for sf in files.all():
            shadow.fds.files.add(sf)
        shadow.fds.trim_files()
        shadow.check(job)
        shadow.stats["accepted"] += 1
        features = tuple(f for f in FEATURES if f in hello.features)
        if FILES_FEATURE in features:  # (what home holds of the files the job writes)
            self.versions = SessionFiles(
                shadow.store, job.job_id, hello.instance, files.session, tenant, [sf.name for sf in files.all()],
                quota=shadow.opts.quota, streams=lambda: sum(f.written for f in files.outputs.values()),
                said=lambda kind, **details: shadow.events.event(job.job_id, kind, **details),
                open_files=shadow.fds.open_files, room=shadow.fds.room, grouping=shadow.opts.grouping)
            shadow.fds.versions.add(self.versions)

    async def _welcome(self, job: LiveJob, hello: Hello, proof: str) -> None:
        """WELCOME: the durable lengths, the features both speak, what home holds of the job's files."""
        shadow, files, conn = self.shadow, job.files, self.conn
        durable = tuple((sid, sf.durable) for sid, sf in files.outputs.items())
        features = tuple(f for f in FEATURES if f in hello.features)
        held_files = await shadow.worker(self.versions.load) if self.versions is not None else ()
        welcome = Welcome(PROTOCOL_VERSION, files.session, durable, shadow.opts.idle_timeout, proof, features,
                          held_files)
        shadow.check(job)
        self.sender = Sender(self.stream, conn, job, lambda: shadow.holds(job))
        await self.sender.send(conn.send(welcome))
        log.info("%s [%s]: job %s session %d (%s)", self.peer, self.caller.who, files.job_id, files.session,
                 hello.host or "?", extra=self.caller.fields())
        self.job = job
        job.heard = time.time()
        shadow.events.opened(self.caller, files.session, hello.host)

    async def _stream(self) -> None:
        """Receive until the session is over, its ACKs sent by its `Sender`."""
        sender = self.sender
        assert sender is not None
        try:
            async with trio.open_nursery() as nursery:
                sender.attach(nursery)  # (its task, started when first needed)
                try:
                    await self._receive()
                finally:
                    sender.close()  # (before the nursery closes: no batch starts the task after)
        finally:
            await sender.finish()  # an ACK an inline write left in part, before an ERROR follows

    # -- receiving and processing ------------------------------------------------

    async def _receive(self) -> None:
        conn, job, buffers = self.conn, self.job, self.shadow.buffers
        assert job is not None
        conn.pieces = True  # DATA as it arrives, each piece written at its offset
        stream = self.stream
        fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        idle_timeout = self.shadow.opts.idle_timeout
        buf: bytearray | None = None
        size = READ_SIZE  # a DATA frame's head alone after a spliced frame: its payload is spliced too
        with trio.CancelScope() as idle, buffers.lending(lambda: buf):  # (one scope, its deadline moved)
            while True:
                if self.pending:  # what arrived with the handshake
                    events, self.pending = self.pending, []
                else:
                    idle.deadline = trio.current_time() + idle_timeout
                    if fd >= 0:
                        events, buf = await read_into(fd, conn, buffers, size)
                    else:
                        events = await read_some(stream, conn)
                    idle.deadline = math.inf
                    job.heard = time.time()
                over = await self._process(events)
                # DATA payloads are views of the read's buffer: keep none of
                # them while waiting for the next read, and lend the buffer on.
                del events
                if buf is not None:
                    buffers.give(buf)
                    buf = None
                if over:
                    return
                if fd >= 0 and not buffers.splicer.refused:
                    idle.deadline = trio.current_time() + idle_timeout
                    size = DATA_HEAD if await self._splice(fd, buffers.splicer) else READ_SIZE
                    idle.deadline = math.inf
        if idle.cancelled_caught:
            raise trio.TooSlowError

    async def _process(self, events: list[Event]) -> bool:
        """Act on the events of one read; True when the session is over."""
        shadow, job, sender, caller = self.shadow, self.job, self.sender, self.caller
        assert job is not None and sender is not None
        files = job.files
        for ev in events:
            shadow.check(job)
            if type(ev) is DataPiece:
                sf = files.outputs.get(ev.stream)
                if sf is not None and sf.fd < 0:
                    await shadow.fds.open(sf)
                self._write(job, ev.stream, ev.offset, ev.payload, ev.start, ev.end)
            elif isinstance(ev, (Data, ZData)):
                sf = files.outputs.get(ev.stream)
                if sf is not None and sf.fd < 0:
                    await shadow.fds.open(sf)
                data = ev if isinstance(ev, Data) else inflate(ev)
                self._write(job, ev.stream, ev.offset, data.payload, ev.offset, ev.offset + len(data.payload),
                            len(ev.payload))
            elif isinstance(ev, StdinRead):
                if files.stdin is not None and files.stdin.fd < 0 and ev.stream == files.stdin_stream:
                    await shadow.fds.open(files.stdin)
                shadow.check(job)
                await sender.send(self.conn.send(await shadow.stdin.read(files, ev)))
            elif isinstance(ev, FILE_EVENTS):
                # (file frames are refused unless WELCOME accepted the feature: the session has its files)
                assert self.versions is not None
                await on_event(self.versions, ev, sender)
            elif isinstance(ev, Ping):
                await sender.send(self.conn.send(Pong(ev.nonce)))
            elif isinstance(ev, Notes):
                shadow.events.notes(job, ev.notes)
            elif isinstance(ev, Exit):
                await self._finish(job, ev)
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
        if self.versions is not None:
            keep_durable(self.versions, sender)  # (in groups, as the reads go on)
        return False  # (a PONG asks nothing)

    def _write(self, job: LiveJob, stream: int, offset: int, payload: bytes, start: int, end: int,
               wire: int = -1) -> None:
        """Write the piece at `offset` of a DATA frame covering start..end,
        less what the file holds. The frame is checked at its first piece;
        `written` moves to its end at its last, so nothing of a frame becomes
        durable before all of it is in. `wire`: its size on the wire, if compressed."""
        shadow = self.shadow
        sf = self._output(job, stream)
        if offset == start:
            self._check_start(job, sf, start, end)
        skip = sf.written - offset  # (`written` holds still until the frame's end)
        if skip < len(payload):
            view = memoryview(payload)[skip:] if skip > 0 else payload
            at = offset + max(skip, 0)
            shadow.check(job)  # the fencing epoch, checked where the bytes are written (no await from here on)
            if sf.fd < 0:  # (closed while idle, or for room: the cache kept within its budget, then reopened)
                shadow.fds.trim_files()
            shadow.fds.files.use(sf)
            while view:
                n = os.pwrite(sf.fd, view, at)
                at += n
                view = view[n:]
            sf.partial = offset + len(payload) < end  # (bytes of a frame not yet whole: the cache keeps it open)
        if offset + len(payload) == end:
            self._landed(job, sf, end - start if wire < 0 else wire, end)

    async def _splice(self, fd: int, splicer: Splicer) -> bool:
        """While the payload of the DATA frame arriving is still in the
        socket, and large, move it from there into its file through the
        shadow's pipe (`Splicer`), each chunk at its offset as it arrives,
        as `_write` writes a read's piece; the rest is read as usual.
        True when a frame's payload ended here (bulk: another may follow)."""
        conn, job, shadow = self.conn, self.job, self.shadow
        assert job is not None
        ended = False
        while not splicer.refused and (due := conn.payload_due()) is not None:
            stream, offset, start, end = due
            sf = job.files.outputs.get(stream)
            if sf is None or end - offset < SPLICE_MIN or offset < sf.written:
                return False  # (an unknown stream, a small rest, bytes the file holds: `_write` sees to them)
            if sf.fd < 0:
                await shadow.fds.open(sf)
            if offset == start:
                self._check_start(job, sf, start, end)
            shadow.check(job)  # the fencing epoch, checked where the bytes are written (no await from here on)
            try:
                n = splicer.take(fd, end - offset)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(fd)
                continue
            except OSError as e:
                if e.errno in UNSUPPORTED_ERRNOS:  # (a socket that takes no splice: read as usual)
                    return False
                raise trio.BrokenResourceError(f"socket connection broken: {e}") from e
            if n == 0:
                return False  # (the connection's end: the next read says so, a frame cut short)
            shadow.fds.files.use(sf)
            splicer.put(sf.fd, offset, n)
            conn.took_payload(n)
            job.heard = time.time()
            sf.partial = offset + n < end
            if offset + n == end:
                self._landed(job, sf, end - start, end)
                ended = True
        return ended

    def _output(self, job: LiveJob, stream: int) -> StreamFile:
        sf = job.files.outputs.get(stream)
        if sf is None:
            raise ProtocolError(f"DATA for stream {stream}, which the handshake did not declare",
                                ErrorCode.UNKNOWN_STREAM)
        return sf

    def _check_start(self, job: LiveJob, sf: StreamFile, start: int, end: int) -> None:
        """A DATA frame start..end, at its first piece: no gap, within the quota."""
        if start > sf.written:
            raise ProtocolError(
                f"DATA at offset {start} of {sf.name!r} would leave a gap after byte {sf.written}",
                ErrorCode.OFFSET_GAP,
            )
        quota = self.shadow.opts.quota
        if quota and end > sf.written:
            total = sum(f.written for f in job.files.outputs.values()) + (
                self.versions.written() if self.versions is not None else 0)
            if total + end - sf.written > quota:
                raise Refused(ErrorCode.QUOTA, f"job {job.files.job_id} would exceed its quota of {quota} bytes")

    def _landed(self, job: LiveJob, sf: StreamFile, wire: int, end: int) -> None:
        """A DATA frame ending at `end` is whole in its file: `written` moves
        to its end and the durability batch is told."""
        shadow = self.shadow
        sf.wire += wire
        shadow.stats["wire"] += wire
        if end > sf.written:
            grown, sf.written = end - sf.written, end  # (before the mark: a batch takes `written` as it is)
            shadow.stats["bytes"] += grown
            shadow.durability.mark(sf, job, grown)

    # -- finishing -----------------------------------------------------------------

    async def _finish(self, job: LiveJob, ev: Exit) -> None:
        """EXIT: every byte durable and as long as it says, recorded, then DONE."""
        shadow, files, sender, caller = self.shadow, job.files, self.sender, self.caller
        assert sender is not None
        await shadow.durability.flush(job)
        if self.versions is not None:
            await flush(self.versions, sender)
            self.versions.check_exit(ev.files)
            await trio.to_thread.run_sync(self.versions.finish)
        for sid, length in ev.lengths:
            sf = files.outputs.get(sid)
            if sf is None or sf.durable != length:
                held = sf.durable if sf else 0
                raise ProtocolError(
                    f"EXIT says stream {sid} has {length} bytes, the shadow holds {held}", ErrorCode.LENGTH_MISMATCH
                )
        summary = dict(ev.summary)
        shadow.check(job)
        recorded = await shadow.records.submit(
            lambda: shadow.store.record_finished(
                files.job_id, files.session, code=ev.code, signal=ev.signal, reason=ev.reason, summary=summary,
            )
        )
        if not recorded:
            job.fence("a newer connection of this job took over")
            job.check()
        job.finished = True  # recorded: the exit stands whoever holds the job next
        shadow.events.event(files.job_id, "exit", code=ev.code, signal=ev.signal, reason=ev.reason)
        shadow.check(job)
        status = (f"signal {ev.signal}" if ev.signal else f"status {ev.code}" if ev.code is not None
                  else "unknown status")
        log.info("%s: job %s finished with %s", caller, files.job_id, status, extra=caller.fields())
        await sender.send(lambda: self.conn.send(Done()), check=True)  # (checked under the send lock)
