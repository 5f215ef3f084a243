"""The gcwrap wire protocol as a sans-I/O state machine.

Theory of operation
-------------------
The agent opens a TCP connection, writes the 8-byte MAGIC and a HELLO frame
naming the job, its attempt (`instance`) and its streams. When the shadow
requires a token it answers CHALLENGE(nonce) and the agent proves it knows
the token with AUTH (see gcwrap.wire.auth). The shadow then answers WELCOME with
the durable length it holds of each output stream, or ERROR. From
then on the agent sends DATA frames (stream, absolute offset, bytes) in offset
order per stream; the shadow trims bytes it already holds, refuses gaps, and
once the bytes are on stable storage sends ACK(stream, durable offset). The
agent may ask for stdin with STDIN_READ(offset); the shadow answers STDIN_DATA.
When the job has ended and every byte is acknowledged, the agent sends EXIT;
the shadow records it and answers DONE. Either side may send PING (answered by
PONG) at any time, and ERROR, after which the connection is closed.

Frames are `u32 length | u8 type | body`, length counting type and body.
Offsets and lengths are u64 on the wire, and at most 2**63 - 1 (MAX_OFFSET)
together with the bytes they cover, as a file offset is.
Control frames (HELLO, WELCOME, EXIT, DONE, ERROR) carry a JSON object;
the hot frames (DATA, ACK, STDIN_*, PING, PONG) are fixed binary structs.
A frame longer than `max_frame` is refused from its header alone, before the
body is buffered, so a peer cannot make us hold more than one frame.

Nothing here does I/O, reads a clock or imports trio: feed bytes in with
`receive_data()` (b"" for EOF), pull events with `next_event()`, and turn
events into bytes with `send()`.

A shadow's connection with `pieces` set does not gather a DATA frame: once
its head (length, type, stream, offset) has arrived and been checked, each
read's share of its payload comes out as a `DataPiece` at its own offset
(as h11 gives a body's data as it arrives), so what a connection buffers is
bounded by one read, not one frame, and no frame is joined. A receiver that
reuses its read buffer says so (`receive_data(..., borrowed=True)`): what the
connection keeps past the read is then copied, and the events' payloads are
valid until the next `receive_data`.
"""

from __future__ import annotations

import enum

from .compress import FEATURE
from .events import (
    FILES_FEATURE,
    NOTES_FEATURE,
    PROTOCOL_VERSION,
    Ack,
    Auth,
    Challenge,
    ConnectionClosed,
    Data,
    DataPiece,
    Done,
    Error,
    ErrorCode,
    Event,
    Exit,
    FileAck,
    FileCommit,
    FileCopy,
    FileData,
    FileOpen,
    Hello,
    Notes,
    Ping,
    Pong,
    StdinData,
    StdinRead,
    Welcome,
    ZData,
)
from .fileframes import file_data_head
from .frames import (
    DATA_HEAD,
    DATA_TYPE,
    DEFAULT_MAX_FRAME,
    HEADER,
    MAX_CONTROL,
    MAX_OFFSET,
    MAX_PAYLOAD,
    FrameType,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    TruncatedFrame,
    data_head,
    decode,
    decode_data,
    decode_data_head,
    encode,
)

__all__ = [  # the codec's names, for who speaks the protocol through this module
    "DEFAULT_MAX_FRAME", "MAGIC", "MAX_CONTROL", "MAX_OFFSET", "MAX_PAYLOAD", "NEED_DATA", "SUPPORTED_VERSIONS",
    "Connection", "FrameType", "LocalProtocolError", "NeedData", "ProtocolError", "RemoteProtocolError", "Role",
    "State", "TruncatedFrame", "decode", "encode",
]

MAGIC = b"GCWRAP\r\n"
SUPPORTED_VERSIONS = (PROTOCOL_VERSION,)
# Until the handshake is over (WELCOME), only control frames are legal: a
# longer one is refused from its header, so an unauthenticated peer cannot
# make the shadow buffer a DATA-sized frame.
MAX_HANDSHAKE_FRAME = MAX_CONTROL + 1
_SMALL = 4096  # received pieces shorter than this are copied together, not kept one by one


class Role(enum.Enum):
    """Which end of a connection a protocol object speaks for."""

    AGENT = "agent"
    SHADOW = "shadow"


class State(enum.Enum):
    """Where a connection is in its life: the handshake, streaming, the exit, closed."""

    AWAIT_HELLO = "await-hello"
    AWAIT_WELCOME = "await-welcome"
    AWAIT_AUTH = "await-auth"
    STREAMING = "streaming"
    EXITING = "exiting"
    CLOSED = "closed"


class NeedData:
    """Sentinel type: `next_event()` needs more bytes."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData()

# Which role may send which event in which state, and the state it leads to.
# PING, PONG and ERROR are legal from both roles in every open state (ERROR
# closes); everything else must be listed here.
_TRANSITIONS: dict[State, dict[Role, dict[type[Event], State]]] = {
    State.AWAIT_HELLO: {
        Role.AGENT: {Hello: State.AWAIT_WELCOME},
        Role.SHADOW: {},
    },
    State.AWAIT_WELCOME: {
        Role.AGENT: {},
        Role.SHADOW: {Welcome: State.STREAMING, Challenge: State.AWAIT_AUTH},
    },
    State.AWAIT_AUTH: {
        Role.AGENT: {Auth: State.AWAIT_WELCOME},
        Role.SHADOW: {},
    },
    State.STREAMING: {
        Role.AGENT: {Data: State.STREAMING, ZData: State.STREAMING, StdinRead: State.STREAMING, Exit: State.EXITING,
                     Notes: State.STREAMING, FileOpen: State.STREAMING, FileData: State.STREAMING,
                     FileCopy: State.STREAMING, FileCommit: State.STREAMING},
        Role.SHADOW: {Ack: State.STREAMING, StdinData: State.STREAMING, FileAck: State.STREAMING},
    },
    State.EXITING: {
        Role.AGENT: {StdinRead: State.EXITING},
        # An ACK or STDIN_DATA sent before the EXIT arrived may still cross it.
        Role.SHADOW: {Ack: State.EXITING, StdinData: State.EXITING, FileAck: State.EXITING, Done: State.CLOSED},
    },
    State.CLOSED: {Role.AGENT: {}, Role.SHADOW: {}},
}


_FILE_EVENTS = (FileOpen, FileData, FileCopy, FileCommit, FileAck)
_DATA_PROBE = Data(0, 0, b"")  # (what `send_data_head` asks the transitions about)
_HANDSHAKE_STATES = frozenset({State.AWAIT_HELLO, State.AWAIT_WELCOME, State.AWAIT_AUTH})


def _next_state(state: State, role: Role, event: Event, features: frozenset[str]) -> State | None:
    """The state `event` from `role` leads to, or None where it is illegal
    (ZDATA too, unless the handshake accepted compression; NOTES unless it
    accepted them; the files' frames, and an EXIT listing files, unless it
    accepted "files")."""
    if isinstance(event, ZData) and FEATURE not in features:
        return None
    if isinstance(event, Notes) and NOTES_FEATURE not in features:
        return None
    if FILES_FEATURE not in features and (isinstance(event, _FILE_EVENTS) or (isinstance(event, Exit) and event.files)):
        return None
    if state is not State.CLOSED:
        if isinstance(event, (Ping, Pong)):
            return state
        if isinstance(event, Error):
            return State.CLOSED
    return _TRANSITIONS[state][role].get(type(event))


class Connection:
    """One end of a gcwrap connection, agent or shadow."""

    def __init__(self, role: Role, max_frame: int = DEFAULT_MAX_FRAME, *, pieces: bool = False) -> None:
        self.role = role
        self.peer_role = Role.SHADOW if role is Role.AGENT else Role.AGENT
        self.state = State.AWAIT_HELLO
        self.max_frame = max_frame
        # Received bytes not yet turned into events: `_parts` (the start of a
        # frame that spans reads, `_parts_len` bytes) then `_data[_pos:]`, the
        # latest chunk, which frames are cut from without copying.
        self._parts: list[bytes | bytearray | memoryview] = []
        self._parts_len = 0
        self._data = b""
        self._pos = 0
        self._eof = False
        self._borrowed = False  # `_data` is the caller's buffer: what outlives the read is copied
        # DATA as DataPiece events (shadow, streaming); `_body` is the frame
        # whose payload is arriving: (stream, next offset, start, end).
        self.pieces = pieces
        self._body: tuple[int, int, int, int] | None = None
        self._magic_seen = role is Role.AGENT  # only the shadow expects the magic
        self._magic_sent = role is Role.SHADOW
        self.features: frozenset[str] = frozenset()  # what the WELCOME accepted, for this connection

    # -- sending ---------------------------------------------------------

    def send(self, event: Event) -> bytes:
        """Bytes that put `event` on the wire; LocalProtocolError if illegal now."""
        new_state = _next_state(self.state, self.role, event, self.features)
        if new_state is None:
            raise LocalProtocolError(
                f"{self.role.value} may not send {type(event).__name__} in state {self.state.value}",
                ErrorCode.UNEXPECTED,
            )
        frame = encode(event)
        self.state = new_state
        if isinstance(event, Welcome):
            self.features = frozenset(event.features)
        if not self._magic_sent:
            self._magic_sent = True
            return MAGIC + frame
        return frame

    def send_data_head(self, stream: int, offset: int, size: int) -> bytes:
        """The bytes of a DATA frame before its `size`-byte payload, which
        the caller sends right after them, unjoined (sendmsg, sendfile), as
        h11's send_with_data_passthrough lets a body bypass it: the frame is
        checked as `send(Data(...))` checks it, without the payload in hand
        (LocalProtocolError if DATA is illegal now or a field out of range)."""
        if _next_state(self.state, self.role, _DATA_PROBE, self.features) is None:
            raise LocalProtocolError(f"{self.role.value} may not send Data in state {self.state.value}",
                                     ErrorCode.UNEXPECTED)
        return data_head(stream, offset, size)

    def send_file_data_head(self, event: FileData) -> bytes:
        """The bytes of `event`'s FILE_DATA frame before its payload, which
        the caller sends right after them, unjoined, as `send_data_head`'s:
        the event is checked as `send` checks it."""
        if _next_state(self.state, self.role, event, self.features) is None:
            raise LocalProtocolError(f"{self.role.value} may not send FileData in state {self.state.value}",
                                     ErrorCode.UNEXPECTED)
        return file_data_head(event)

    # -- receiving -------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview, *, borrowed: bool = False) -> None:
        """Feed bytes from the peer; b"" means the peer closed (EOF).

        `borrowed`: `data` is the caller's buffer, which it reuses once
        `next_event` has returned NEED_DATA: the events' payloads are views
        of it, valid until then, and whatever the connection keeps longer
        it copies. Otherwise a buffer that is not `bytes` is copied first."""
        if self._eof and data:
            raise LocalProtocolError("data received after EOF")
        if not data:
            self._eof = True
            return
        if type(data) is not bytes and not borrowed:
            data = bytes(data)  # the caller may reuse its buffer: frames are cut from ours
        if self._pos < len(self._data):
            self._stash(memoryview(self._data)[self._pos :])
        self._data = data  # type: ignore[assignment]  # (a bytes-like buffer, sliced only through memoryview)
        self._pos = 0
        self._borrowed = borrowed

    def _stash(self, piece: memoryview) -> None:
        """Keep `piece` of the latest chunk (the start of a frame that goes on
        in a later read). Without copying if it is most of the chunk; a small
        piece is copied, so that it does not keep a large chunk alive (memory
        per idle connection) and a peer sending tiny reads costs no per-read
        objects: small pieces are gathered in one bytearray."""
        n = len(piece)
        if n >= _SMALL and 2 * n >= len(self._data) and not self._borrowed:
            self._parts.append(piece)
        else:
            last = self._parts[-1] if self._parts else None
            if isinstance(last, bytearray):
                last += piece
            elif n >= _SMALL:
                self._parts.append(bytes(piece))
            else:
                self._parts.append(bytearray(piece))
        self._parts_len += n

    def _take(self, n: int) -> None:
        """Move up to n bytes from the latest chunk to the frame being gathered."""
        take = min(n, len(self._data) - self._pos)
        if take > 0:
            self._stash(memoryview(self._data)[self._pos : self._pos + take])
            self._advance(take)

    def _advance(self, n: int) -> None:
        self._pos += n
        if self._pos >= len(self._data):
            self._data = b""
            self._pos = 0

    def _drop_gathered(self, n: int) -> None:
        """Drop the first n bytes gathered in `_parts` (n <= _parts_len)."""
        self._parts_len -= n
        while n:
            first = self._parts[0]
            if len(first) <= n:
                del self._parts[0]
                n -= len(first)
            else:
                self._parts[0] = memoryview(first)[n:]
                n = 0

    def _gathered(self, n: int) -> bytes:
        """The first n bytes gathered in `_parts` (n <= _parts_len)."""
        first = self._parts[0]
        if len(first) >= n:
            return bytes(first[:n])
        return b"".join(self._parts)[:n]

    def _check_magic(self) -> bool:
        """Consume the magic once it is whole; False while it is not."""
        self._take(len(MAGIC) - self._parts_len)
        have = self._gathered(min(len(MAGIC), self._parts_len)) if self._parts_len else b""
        if not MAGIC.startswith(have):
            raise RemoteProtocolError("not a gcwrap agent (bad magic)", ErrorCode.BAD_FRAME)
        if len(have) < len(MAGIC):
            return False
        self._keep_after(b"".join(self._parts), len(MAGIC))
        self._magic_seen = True
        return True

    def _keep_after(self, gathered: bytes, n: int) -> None:
        """`gathered` (all of `_parts`) has been used up to byte n: keep the rest."""
        self._parts.clear()
        self._parts_len = len(gathered) - n
        if self._parts_len:
            self._parts.append(memoryview(gathered)[n:])

    def events(self) -> list[Event]:
        """Every complete event received so far, in order, up to NEED_DATA or
        the connection's end (ConnectionClosed, or an Error frame: nothing
        after it counts). RemoteProtocolError as next_event()."""
        out: list[Event] = []
        while (ev := self.next_event()) is not NEED_DATA:
            assert isinstance(ev, Event)
            out.append(ev)
            if isinstance(ev, (ConnectionClosed, Error)):
                break
        return out

    def next_event(self) -> Event | NeedData:
        """The next complete event, NEED_DATA, or RemoteProtocolError.

        A DATA event's payload received here is a read-only memoryview into
        the received bytes (no copy): bytes-like, equal to the bytes sent."""
        if self.state is State.CLOSED and not self._eof and not self.buffered:
            return NEED_DATA
        if not self._magic_seen and not self._check_magic():
            return self._need_data()
        if self._body is not None:
            return self._piece()
        body: bytes | memoryview
        if not self._parts_len:
            data, pos = self._data, self._pos
            if len(data) - pos < HEADER.size:
                self._take(HEADER.size)
                return self._need_data()
            length, ftype = HEADER.unpack_from(data, pos)
            self._check_length(length)
            if ftype == DATA_TYPE and self._in_pieces(length):
                return self._start_data(length)
            end = pos + 4 + length
            if end > len(data):
                self._take(end - pos)
                return self._need_data()
            body = memoryview(data)[pos + 5 : end]
            if end < len(data):
                self._pos = end
            else:
                self._data = b""
                self._pos = 0
        else:
            if self._parts_len < HEADER.size:
                self._take(HEADER.size - self._parts_len)
                if self._parts_len < HEADER.size:
                    return self._need_data()
            length, ftype = HEADER.unpack(self._gathered(HEADER.size))
            self._check_length(length)
            if ftype == DATA_TYPE and self._in_pieces(length):
                return self._start_data(length)
            total = 4 + length
            if self._parts_len < total:
                self._take(total - self._parts_len)
                if self._parts_len < total:
                    return self._need_data()
            frame = b"".join(self._parts)  # the one copy of a frame that spans reads
            self._keep_after(frame, total)  # more than one frame if receive_data ran twice
            body = memoryview(frame)[5:total]
        if ftype == DATA_TYPE and self.state is State.STREAMING and self.role is Role.SHADOW:
            return decode_data(body)  # the hot path: legal here, and the state stays
        event = decode(ftype, body)
        new_state = _next_state(self.state, self.peer_role, event, self.features)
        if new_state is None:
            raise RemoteProtocolError(
                f"{self.peer_role.value} sent {type(event).__name__} in state {self.state.value}",
                ErrorCode.UNEXPECTED,
            )
        self.state = new_state
        if isinstance(event, Welcome):
            self.features = frozenset(event.features)
        return event

    def _in_pieces(self, length: int) -> bool:
        """Whether a DATA frame of `length` comes out in pieces: legal here,
        and long enough to have a head (a shorter one is refused whole)."""
        return (self.pieces and length >= DATA_HEAD - 4 and self.state is State.STREAMING
                and self.role is Role.SHADOW)

    def _start_data(self, length: int) -> Event | NeedData:
        """A DATA frame's header is here: once its head is whole, check it
        and give out its first piece (NEED_DATA until then)."""
        if self._parts_len:
            self._take(DATA_HEAD - self._parts_len)
            if self._parts_len < DATA_HEAD:
                return self._need_data()
            head: bytes | memoryview = self._gathered(DATA_HEAD)
            self._drop_gathered(DATA_HEAD)
        else:
            if len(self._data) - self._pos < DATA_HEAD:
                self._take(DATA_HEAD)
                return self._need_data()
            head = memoryview(self._data)[self._pos : self._pos + DATA_HEAD]
            self._advance(DATA_HEAD)
        stream, offset, size = decode_data_head(length - 1, head[HEADER.size :])
        self._body = (stream, offset, offset, offset + size)
        return self._piece()

    def _piece(self) -> Event | NeedData:
        """The next piece of the DATA frame whose payload is arriving: what
        is here of it, up to its end, without copying."""
        assert self._body is not None
        stream, offset, start, end = self._body
        want = end - offset
        payload: bytes | memoryview
        if self._parts_len:  # (bytes kept from an earlier read: receive_data ran twice without next_event)
            first = self._parts[0]
            n = min(len(first), want)
            payload = bytes(memoryview(first)[:n]) if isinstance(first, bytearray) else memoryview(first)[:n]
            self._drop_gathered(n)
        else:
            n = min(len(self._data) - self._pos, want)
            if not n and want:
                return self._need_data()
            payload = memoryview(self._data)[self._pos : self._pos + n]
            self._advance(n)
        self._body = None if n == want else (stream, offset + n, start, end)
        return DataPiece(stream, offset, payload, start, end)  # type: ignore[arg-type]  # (bytes-like: a view)

    def payload_due(self) -> tuple[int, int, int, int] | None:
        """The DATA frame whose payload is arriving, (stream, next offset,
        start, end), when none of its bytes are held here: its next bytes
        are still the socket's, and may be moved from there into its file
        (then `took_payload`). None otherwise."""
        if self._body is None or self.buffered or self._eof:
            return None
        return self._body

    def took_payload(self, n: int) -> None:
        """The next n bytes of the payload `payload_due` named were taken
        from the socket by the caller, not given to `receive_data`."""
        assert self._body is not None and not self.buffered
        stream, offset, start, end = self._body
        assert 0 < n <= end - offset
        self._body = None if offset + n == end else (stream, offset + n, start, end)

    def _check_length(self, length: int) -> None:
        if length < 1:
            raise RemoteProtocolError("frame length 0", ErrorCode.BAD_FRAME)
        if length > self.max_frame:
            raise RemoteProtocolError(
                f"frame of {length} bytes exceeds the limit of {self.max_frame}",
                ErrorCode.FRAME_TOO_LARGE,
            )
        if length > MAX_HANDSHAKE_FRAME and self.state in _HANDSHAKE_STATES:
            raise RemoteProtocolError(
                f"frame of {length} bytes during the handshake (the limit is {MAX_HANDSHAKE_FRAME} until WELCOME)",
                ErrorCode.FRAME_TOO_LARGE,
            )

    def _need_data(self) -> Event | NeedData:
        if self._eof:
            if self.buffered or self._body is not None:
                raise TruncatedFrame("connection closed in the middle of a frame")
            return ConnectionClosed()
        return NEED_DATA

    @property
    def buffered(self) -> int:
        """Bytes received but not yet turned into events."""
        return self._parts_len + len(self._data) - self._pos
