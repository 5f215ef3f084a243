"""One connection of the agent to the shadow, from HELLO to DONE or failure.

A session runs four tasks: `_send_loop` streams DATA from memory or spool and
asks for stdin, `_recv_loop` dispatches ACK / STDIN_DATA / PING / DONE /
ERROR, `_pinger` sends a PING every heartbeat, and `_watchdog` declares the
connection dead by the rules of `gcwrap.agent.liveness`: a black hole (for three
heartbeats nothing came in and the peer's TCP acknowledged none of our
bytes), or a stall (DATA, a STDIN_READ or the EXIT that left this host and
was acknowledged by the peer's TCP, yet had no answer for three heartbeats,
while PINGs may well be answered). A slow shadow behind a thin link is
neither: it drains the send queue, and answers what reached it. The
handshake is bounded the same way: three heartbeats for each answer. All
sends go through one lock.

A session knows the job only through the `Outbox` (the streams' offsets
and bytes, stdin, the job's end, the "changed" signal) and reads the bytes
memory no longer holds through a `ByteSource` (the spool): it never sees
the agent. It owns its socket, and so the mapping of the socket's errors.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from ..ranks import NETWORK_ERRNOS
from ..sync import worst_error
from ..wire import compress as zc
from ..wire.auth import agent_mac, new_nonce, same, shadow_proof
from ..wire.events import (
    FILES_FEATURE,
    NOTES_FEATURE,
    Ack,
    Auth,
    Challenge,
    ConnectionClosed,
    Done,
    Error,
    ErrorCode,
    Event,
    Exit,
    FileAck,
    FileData,
    Hello,
    Ping,
    Pong,
    StdinData,
    StdinRead,
    Welcome,
    ZData,
)
from ..wire.protocol import MAX_PAYLOAD, Connection, ProtocolError, Role, State, TruncatedFrame
from .liveness import Liveness, watch
from .outbox import Mismatch, Outbox
from .records import UNSUPPORTED_ERRNOS, Chunk, SourceError
from .retry import ConnectionLost, HeartbeatTimeout, SessionEnd, ShadowRefused, Stalled
from .sendpath import SendMeter, SendPath
from .timeline import Journal, NoteCourier

if TYPE_CHECKING:
    from .filesender import FileSender

log = logging.getLogger("gcwrap")

READ_BACK = 8 << 20  # bytes read back from the spool per worker-thread call (a backlog, a resume)
STDIN_REQUEST = 256 << 10
# What the shadow may say, once it has welcomed us, of the bytes it got on
# this connection: a gap, a frame it cannot parse, one out of place. Our
# frames are sound and in order, so the stream was damaged on its way (a
# middlebox that dropped bytes): a fault of this connection, not a refusal
# of the job. A fresh connection resumes from the durable offsets.
DAMAGED_IN_TRANSIT = frozenset({
    ErrorCode.OFFSET_GAP, ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.UNEXPECTED,
    ErrorCode.UNKNOWN_STREAM,
})


class ByteSource(Protocol):
    """What a session needs of the spool: bytes memory no longer holds.
    Failures to read them are `SourceError`s."""

    path: Path
    no_sendfile: bool  # sendfile from its files is not supported here: copy instead

    @property
    def zero_copy(self) -> bool:
        """Bytes are found in place by offset (see `placed_size`)."""
        ...

    def placed_size(self, offset: int, end: int) -> int:
        """How many of the placed bytes [offset, end) are in one file."""
        ...

    async def read_placed(self, stream: int, offset: int, size: int) -> bytes: ...

    async def with_placed(self, stream: int, offset: int, fn: Callable[[int, int], int]) -> int:
        """fn(descriptor, position) on the file holding byte `offset`; its
        OSError propagates as it is (only fn knows what it did)."""
        ...

    async def read(self, stream: int, offset: int, limit: int) -> list[Chunk]: ...


@dataclass(frozen=True)
class SessionConfig:
    """How a session speaks: its heartbeat, the token, whether over TLS."""

    heartbeat: float = 5.0
    token: bytes | None = None
    tls: bool = False
    compress: zc.Mode = zc.Mode.NONE  # --compress: used where the shadow's WELCOME accepts it



class Session:
    """One connection to the shadow, from HELLO to DONE or failure: it
    acknowledges into the outbox, and sends what the outbox and the byte
    source hold. `on_welcome` is called once the shadow has welcomed it;
    `exit_frame()` is the EXIT to send once every byte is home. It tells
    the `journal` when the connection worked and what was acknowledged, and
    sends home the journal's notes (where the WELCOME accepted them)."""

    def __init__(
        self, outbox: Outbox, source: ByteSource, hello: Hello, config: SessionConfig, where: str, *,
        on_welcome: Callable[[], None] = lambda: None, exit_frame: Callable[[], Exit] | None = None,
        wire: zc.WireStats | None = None, journal: Journal | None = None, files: FileSender | None = None,
    ) -> None:
        self.outbox = outbox
        self.files = files  # the job's files (--file), where there are
        self.source = source
        self.hello = hello
        self.config = config
        self.on_welcome = on_welcome
        self.exit_frame = exit_frame or (lambda: outbox.exit_frame(()))
        self.where = where
        self.conn = Connection(Role.AGENT)
        self.welcomed = False
        self.progressed = False  # the shadow acknowledged new bytes in this session
        self.sent: dict[int, int] = {}  # per stream: bytes taken for sending (some may still be on their way out)
        self.handed: dict[int, int] = {}  # per stream: bytes handed to the kernel in full
        self.pending: list[Event] = []  # events received but not yet handled
        self.exit_sent = False
        self.liveness = Liveness(config.heartbeat, trio.current_time())
        self.journal = journal if journal is not None else Journal(config.heartbeat, lambda t: t)
        self.meter = SendMeter(wire if wire is not None else zc.WireStats(), self.journal)
        self.courier = NoteCourier(self.journal.notes)
        self.send_path: SendPath | None = None  # (the connection's, once `run` has it)

    def _open(self) -> None:
        """A send racing the shadow's ERROR (or its hang-up), which closed the
        connection as the send was being made: the connection is lost, which
        is no bug of ours (the ERROR, received, says why)."""
        if self.conn.state is State.CLOSED:
            raise ConnectionLost("the shadow ended the connection")

    async def _send(self, stream: trio.abc.Stream, event: Event) -> None:
        if type(event) is FileData:  # (a file's bytes, as DATA's: `_send_gathered`)
            await self._send_gathered(stream, partial(self.conn.send_file_data_head, event), event.payload)
            return
        async with self._path().lock:
            self._open()
            data = self.conn.send(event)
            await stream.send_all(data)

    async def _send_data(self, stream: trio.abc.Stream, sid: int, offset: int, payload: bytes | memoryview) -> None:
        await self._send_gathered(stream, partial(self.conn.send_data_head, sid, offset, len(payload)), payload)

    async def _send_gathered(self, stream: trio.abc.Stream, head: Callable[[], bytes],
                             payload: bytes | memoryview) -> None:
        """A frame of bytes (DATA, FILE_DATA) without joining header and
        payload: with plain TCP one sendmsg gathers both (the payload is never
        copied in user space). The protocol checks the frame (`head()`:
        `send_data_head`, `send_file_data_head`), as for any other."""
        path = self._path()
        async with path.lock:
            self._open()
            header = head()
            if isinstance(stream, trio.SSLStream):
                await stream.send_all(b"".join((header, payload)))
                return
            sock = path.sock
            parts: list[bytes | memoryview] = [header, payload]
            while parts:
                try:
                    sent = await sock.sendmsg(parts)
                except OSError as e:  # as SocketStream.send_all reports it
                    raise trio.BrokenResourceError(f"socket connection broken: {e}") from e
                while parts and sent >= len(parts[0]):
                    sent -= len(parts.pop(0))
                if sent:
                    parts[0] = memoryview(parts[0])[sent:]


    async def _send_placed(self, stream: trio.abc.Stream, sid: int, offset: int, end: int) -> None:
        """One DATA frame of bytes from the segment file (natural layout),
        [offset, end) or the part of it up to the segment's end; `sent`
        moves past it. Plain TCP: header, then sendfile (no copy in user
        space). TLS: read, then send."""
        source = self.source
        size = min(source.placed_size(offset, end), MAX_PAYLOAD)
        self.sent[sid] = offset + size  # (first: the ACK may arrive before the send returns)
        if isinstance(stream, trio.SSLStream):
            await self._send_data(stream, sid, offset, await source.read_placed(sid, offset, size))
            self.handed[sid] = offset + size
            return
        path = self._path()
        sock = path.sock
        # Every trip through trio's scheduler costs tens of microseconds: take
        # the lock and send the header without one when they are free.
        try:
            path.lock.acquire_nowait()
        except trio.WouldBlock:
            await path.lock.acquire()
        try:
            self._open()
            header = memoryview(self.conn.send_data_head(sid, offset, size))
            try:
                try:
                    header = header[path.raw().send(header, socket.MSG_MORE) :]
                except BlockingIOError:
                    pass
                while header:
                    header = header[await sock.send(header, socket.MSG_MORE) :]
            except OSError as e:  # as SocketStream.send_all reports it
                raise trio.BrokenResourceError(f"socket connection broken: {e}") from e
            done = 0
            while done < size:
                sent = await sendfile_placed(source, sock.fileno(), sid, offset + done, size - done)
                done += sent
                if done < size:
                    # Short: the send buffer is full. Retrying at once would
                    # only fail; wait until the kernel says a third is free.
                    await trio.lowlevel.wait_writable(sock)
            self.handed[sid] = offset + size
        finally:
            path.lock.release()

    def _path(self) -> SendPath:
        assert self.send_path is not None, "sent before `run`"
        return self.send_path

    async def run(self, stream: trio.abc.Stream, sock: trio.socket.SocketType) -> None:
        """Speak the protocol over `stream` (plain TCP, or TLS over it); `sock`
        is the TCP socket underneath, for its options and send queue."""
        outbox = self.outbox
        send_path = self.send_path = SendPath(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        except OSError:
            pass
        token = self.config.token
        hello = dataclasses.replace(self.hello, nonce=new_nonce() if token else "")
        try:
            await self._send(stream, hello)
            welcome = await self._authenticate(stream, hello, token)
        except (ConnectionLost, trio.BrokenResourceError) as e:
            if self.config.tls and not isinstance(e.__cause__, ssl.SSLError):
                raise ConnectionLost(
                    "the shadow closed the TLS connection before welcoming us: it probably rejected our "
                    "client certificate (missing, expired, or from a CA it does not trust; see its log)"
                ) from None
            raise
        acked = sum(out.acked for out in outbox.streams.values())
        try:
            outbox.welcomed(welcome.durable)
        except Mismatch as e:
            raise ShadowRefused(ErrorCode.LENGTH_MISMATCH, str(e), permanent=True) from None
        moved = sum(out.acked for out in outbox.streams.values()) > acked
        self.journal.link.welcomed(trio.current_time(), moved, outbox.pending)
        self.courier.accepted = NOTES_FEATURE in welcome.features
        if self.files is not None:
            if FILES_FEATURE not in welcome.features:
                raise ShadowRefused(ErrorCode.UNEXPECTED, "the shadow does not take the job's files (--file): "
                                    "it is older than this gcwrap", permanent=True)
            self.files.welcomed(welcome.files)
        self.sent = {sid: out.acked for sid, out in outbox.streams.items()}
        self.handed = dict(self.sent)
        if zc.FEATURE in welcome.features and self.config.compress is not zc.Mode.NONE:
            self.meter.compress(self.config.compress, trio.current_time(), sock)
        self.welcomed = True
        self.on_welcome()
        try:
            with worst_error():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._recv_loop, stream)
                    nursery.start_soon(self._send_loop, stream)
                    nursery.start_soon(self._pinger, stream)
                    nursery.start_soon(self._watchdog)
        finally:
            send_path.close()

    async def _receive_events(self, stream: trio.abc.Stream) -> list[Event]:
        if self.pending:  # what came in the same read as the handshake's answer
            held, self.pending = self.pending, []
            return held
        data = await stream.receive_some(65536)
        now = trio.current_time()
        self.liveness.heard(now)
        try:
            self.conn.receive_data(data)
            events = self.conn.events()
            if events:
                self.journal.link.worked(now)  # (a whole frame came: the connection works both ways)
            return events
        except TruncatedFrame:  # the shadow hung up mid-frame: lost, nothing to tell it
            raise ConnectionLost("the shadow closed the connection in the middle of a frame") from None
        except ProtocolError as e:
            with trio.move_on_after(1):
                await self._send(stream, Error(e.code, str(e)))
            raise

    async def _await_handshake(self, stream: trio.abc.Stream, asked: str) -> Welcome | Challenge:
        """The shadow's answer to our HELLO or AUTH, within three heartbeats
        (it may answer PINGs meanwhile: that is no answer)."""
        limit = self.config.heartbeat * 3
        with trio.move_on_after(limit):
            while True:
                events = await self._receive_events(stream)
                for i, ev in enumerate(events):
                    if isinstance(ev, (Welcome, Challenge)):
                        self.pending = events[i + 1 :]
                        return ev
                    self._check_failure(ev)
        raise Stalled(f"the shadow did not answer {asked} within {limit:g} s (3 heartbeats)")

    async def _authenticate(self, stream: trio.abc.Stream, hello: Hello, token: bytes | None) -> Welcome:
        """The token handshake (gcwrap.wire.auth): prove we know the token, and make
        the shadow prove it too before any output goes to it."""
        first = await self._await_handshake(stream, "HELLO")
        if isinstance(first, Welcome):
            if token is not None:
                raise ShadowRefused(
                    ErrorCode.AUTH_FAILED,
                    "the shadow did not ask for the token: it runs without one, or it is not the real shadow; "
                    "no output is sent to it",
                    permanent=True,
                )
            return first
        if token is None:
            raise ShadowRefused(
                ErrorCode.AUTH_FAILED, "the shadow requires a token: give gcwrap --token-file FILE", permanent=True
            )
        mac = agent_mac(token, hello.nonce, first.nonce, hello.job_id, hello.instance)
        await self._send(stream, Auth(mac))
        welcome = await self._await_handshake(stream, "AUTH")
        if not isinstance(welcome, Welcome) or not same(welcome.proof, shadow_proof(token, hello.nonce, first.nonce)):
            raise ShadowRefused(
                ErrorCode.AUTH_FAILED,
                "the shadow could not prove it knows the token: the tokens differ, or it is not the real shadow",
                permanent=True,
            )
        return welcome

    def _check_failure(self, ev: Event) -> None:
        if isinstance(ev, Error):
            if self.welcomed and ev.code in DAMAGED_IN_TRANSIT:
                raise ConnectionLost(f"bytes were lost on the way to the shadow: it says {ev.message} [{ev.code.name}]")
            raise ShadowRefused(ev.code, ev.message, ev.code.permanent, ev.retry_after)
        if isinstance(ev, ConnectionClosed):
            raise ConnectionLost("the shadow closed the connection")

    async def _recv_loop(self, stream: trio.abc.Stream) -> None:
        outbox = self.outbox
        while True:
            for ev in await self._receive_events(stream):
                if isinstance(ev, Ack):
                    if ev.stream not in outbox.streams:
                        raise ShadowRefused(ErrorCode.UNKNOWN_STREAM, f"ACK for unknown stream {ev.stream}", False)
                    try:
                        moved = outbox.ack(ev.stream, ev.offset, self.sent[ev.stream])
                    except Mismatch as e:
                        raise ShadowRefused(ErrorCode.LENGTH_MISMATCH, str(e), True) from None
                    if moved:
                        self.meter.acked(ev.stream, ev.offset, self._backlog)
                        self.progressed = True
                        self.liveness.answered(("data", ev.stream))
                        self.journal.acked(trio.current_time(), outbox.pending, self.where)
                elif isinstance(ev, FileAck) and self.files is not None:
                    if self.files.ack(ev):
                        self.progressed = True
                        self.liveness.answered("files")
                elif isinstance(ev, StdinData):
                    if outbox.stdin_data(ev):
                        self.progressed = self.progressed or bool(ev.payload)
                        self.liveness.answered("stdin")
                elif isinstance(ev, Ping):
                    await self._send(stream, Pong(ev.nonce))
                elif isinstance(ev, Done):
                    self.courier.done()
                    raise SessionEnd()
                elif isinstance(ev, Pong):
                    self.courier.pong(ev.nonce)
                else:
                    self._check_failure(ev)

    def _sent_frame(self, sid: int, end: int, raw: int, wire: int) -> None:
        """Count a frame of `sid` ending at `end` that went out (SendMeter)."""
        self.meter.sent(self._path().sock, sid, end, raw, wire, self._backlog)

    def _backlog(self) -> int:
        """Job bytes waiting to be sent."""
        return sum(out.read_end - self.sent[sid] for sid, out in self.outbox.streams.items())

    async def _send_compressed(self, stream: trio.abc.Stream, sid: int, offset: int, end: int) -> None:
        """One frame of [offset, end) compressed (ZDATA) when that makes it
        smaller, as it is (DATA) when not; `sent` moves past it."""
        policy, source = self.meter.policy, self.source
        assert policy is not None
        out = self.outbox.streams[sid]
        size = min(end - offset, MAX_PAYLOAD)
        data = out.from_memory(offset, size)
        payload: bytes | memoryview
        if data is not None:
            payload = memoryview(data.data)[offset - data.start : offset - data.start + size]
        elif source.zero_copy and out.placed_end(offset) > offset:
            size = min(source.placed_size(offset, out.placed_end(offset)), size)
            payload = await source.read_placed(sid, offset, size)
        else:
            chunks = await source.read(sid, offset, size)
            if not chunks or chunks[0].start > offset:
                raise RuntimeError(f"spool lost bytes from {offset} of {out.kind}")
            c = chunks[0]
            payload = memoryview(c.data)[offset - c.start : offset - c.start + size]
        size = len(payload)
        blob, cpu = zc.timed_compress(payload)
        policy.compressed(trio.current_time(), size, len(blob), cpu)
        self.sent[sid] = offset + size  # (first: the ACK may arrive before the send returns)
        if len(blob) < size:
            await self._send(stream, ZData(sid, offset, size, blob))
            self.meter.wire.compressed_bytes += size
            wire = len(blob)
        else:
            await self._send_data(stream, sid, offset, payload)
            wire = size
        self.handed[sid] = offset + size
        self._sent_frame(sid, offset + size, size, wire)

    async def _send_notes(self, stream: trio.abc.Stream) -> None:
        """The journal's notes this connection has not sent, then a PING:
        its PONG says the shadow has them."""
        for frame in self.courier.take():
            await self._send(stream, frame)

    async def _send_loop(self, stream: trio.abc.Stream) -> None:
        outbox = self.outbox
        while True:
            if not self.exit_sent and self.courier.due():
                await self._send_notes(stream)
            progressed = False
            for sid, out in outbox.streams.items():
                offset = self.sent[sid]
                if offset >= out.read_end:
                    continue
                room = self.meter.room(READ_BACK)
                if room <= 0:
                    continue  # the path holds a second of output: the rest waits here, compressible (an ACK wakes us)
                policy = self.meter.policy
                if policy is not None and policy.wants(trio.current_time(), min(out.read_end - offset, MAX_PAYLOAD)):
                    await self._send_compressed(stream, sid, offset, out.read_end)
                    progressed = True
                    continue
                chunk = out.from_memory(offset, MAX_PAYLOAD)
                if chunk is None and self.source.zero_copy:
                    placed = out.placed_end(offset)
                    if placed > offset:
                        # In the segment file (spliced, or spooled and evicted).
                        await self._send_placed(stream, sid, offset, placed)
                        self._sent_frame(sid, self.sent[sid], self.sent[sid] - offset, self.sent[sid] - offset)
                        progressed = True
                        continue
                chunks = [chunk] if chunk is not None else await self.source.read(sid, offset, min(READ_BACK, room))
                for c in chunks:
                    start = max(c.start, self.sent[sid])
                    if c.start > self.sent[sid]:
                        raise RuntimeError(f"spool lost bytes {self.sent[sid]}..{c.start} of {out.kind}")
                    payload = memoryview(c.data)[start - c.start :] if start > c.start else c.data
                    if payload:  # at most MAX_PAYLOAD: pipe reads and spool rows are no larger
                        # `sent` first: the ACK for a frame may arrive before its send returns.
                        self.sent[sid] = start + len(payload)
                        await self._send_data(stream, sid, start, payload)
                        self.handed[sid] = start + len(payload)
                        self._sent_frame(sid, start + len(payload), len(payload), len(payload))
                progressed = True
            feeder = outbox.stdin
            if feeder is not None and feeder.wants():
                feeder.in_flight = True
                await self._send(stream, StdinRead(feeder.stream, feeder.fetched, STDIN_REQUEST))
                progressed = True
            if self.files is not None and await self.files.send_some(partial(self._send, stream)):
                progressed = True
            if progressed:
                continue
            if outbox.all_delivered and (self.files is None or self.files.done) and not self.exit_sent:
                self.exit_sent = True
                await self._send(stream, self.exit_frame())
                continue
            await outbox.changed.wait()

    async def _pinger(self, stream: trio.abc.Stream) -> None:
        while True:
            await trio.sleep(self.config.heartbeat)
            await self._send(stream, self.courier.ping())

    def _waiting(self) -> list[object]:
        """What this session asked of the shadow and has had no answer to:
        bytes handed to the kernel and not acknowledged, a STDIN_READ, the EXIT."""
        outbox = self.outbox
        waiting: list[object] = [("data", sid) for sid, out in outbox.streams.items() if self.handed[sid] > out.acked]
        if outbox.stdin is not None and outbox.stdin.in_flight:
            waiting.append("stdin")
        if self.files is not None and self.files.waiting:
            waiting.append("files")
        if self.exit_sent:
            waiting.append("exit")
        return waiting

    def _probe(self) -> tuple[int, list[object]]:
        """The send queue and the requests waiting, for the watchdog; the
        link's clock hears of the queue too (a queue shrinking is a slow
        link, no stall: `LinkClock.send_queue`)."""
        return self.meter.probe(self._path().sock), self._waiting()

    async def _watchdog(self) -> None:
        """Replace a connection that is dead by the rules of `Liveness`."""
        rule, request = await watch(self.liveness, self.config.heartbeat, self._probe)
        limit = f"{self.liveness.limit:g} s"
        if rule == "silent":
            raise HeartbeatTimeout(f"nothing received, and nothing acknowledged by TCP, for {limit}")
        if request == "stdin":
            what = "the request for stdin was never answered"
        elif request == "exit":
            what = "the job's end (EXIT) was never answered"
        elif request == "files":
            what = "bytes or commits of the job's files were never acknowledged"
        else:
            out = self.outbox.streams[request[1]]  # type: ignore[index]
            what = f"{self.handed[out.id] - out.acked:,} bytes of {out.kind} were never acknowledged"
        raise Stalled(f"{what} within {limit}, though the bytes left this host and heartbeats are answered")


async def sendfile_placed(source: ByteSource, sock: int, stream: int, offset: int, size: int) -> int:
    """Send placed bytes from their file to the (non-blocking) socket
    without copying them through user space (where sendfile is not
    supported: pread and write); the bytes sent, fewer (0 too) when the
    socket's buffer is full: then nothing queued is held back for more to
    come (see `push_held`). A failing socket raises
    trio.BrokenResourceError, a failing disk SourceError: the error's errno
    says whose it is."""

    def send(fd: int, pos: int) -> int:
        try:
            if source.no_sendfile:
                return copy(fd, pos)
            try:
                return os.sendfile(sock, fd, pos, size)
            except OSError as e:
                if e.errno not in UNSUPPORTED_ERRNOS:
                    raise
                log.info("sendfile from the spool is not supported here (%s): copying instead", e.strerror)
                source.no_sendfile = True
                return copy(fd, pos)
        except BlockingIOError:
            return 0

    def copy(fd: int, pos: int) -> int:
        data = os.pread(fd, min(size, 1 << 20), pos)
        if not data:
            raise OSError(errno.EIO, f"segment ends before byte {offset} of stream {stream}")
        return os.write(sock, data)  # a socket: write(2) is send(2) without flags

    try:
        sent = await source.with_placed(stream, offset, send)
    except OSError as e:
        if e.errno in NETWORK_ERRNOS:
            raise trio.BrokenResourceError(f"socket connection broken: {e}") from e
        raise SourceError(f"spool {source.path}: cannot send bytes {offset}..{offset + size} of stream {stream}: "
                          f"{e.strerror or e}") from None
    if sent < size:
        push_held(sock)  # (the caller now waits for room: what was queued must not wait with it)
    return sent


def push_held(sock: int) -> None:
    """Send at once what the kernel holds back for more to come.

    sendfile(2) queues every piece but its last with MSG_MORE (so does our
    DATA header): one cut short by a full send queue leaves a tail of less
    than a segment held back. With nothing else in flight no ACK comes to
    release it, and unsent bytes over TCP_NOTSENT_LOWAT (trio sets 16 KiB)
    keep the socket from becoming writable: the sender would wait for the
    kernel's probe timer, 200 ms, with the bytes it wants sent in its own
    queue. (Line output met this at nearly every frame once it caught up
    with the job.) Setting TCP_NODELAY pushes the pending frames now."""
    try:
        s = socket.socket(fileno=sock)
    except OSError:
        return  # (not a socket: nothing is held back)
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    except OSError:
        pass  # (not TCP, or the connection is gone: the next send says so)
    finally:
        s.detach()
