"""Tests of the sans-I/O wire protocol: codec round trips, framing, garbage, states.

Two `Connection`s, an agent and a shadow, are joined in memory: whatever one
`send()`s is fed to the other's `receive_data()`, whole, one byte at a time or
in random pieces, and the events that come out must be the events that went in.
Garbage (random bytes, mutated valid frames, JSON of the wrong shape) must only
ever yield events or `RemoteProtocolError`, and must never make the receiver
loop without consuming bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcwrap.wire.events import (
    PROTOCOL_VERSION,
    STREAM_KINDS,
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
    FileHeld,
    FileOpen,
    Hello,
    Note,
    Notes,
    Ping,
    Pong,
    StdinData,
    StdinRead,
    StreamSpec,
    Welcome,
    ZData,
)
from gcwrap.wire.protocol import (
    DEFAULT_MAX_FRAME,
    MAGIC,
    MAX_CONTROL,
    MAX_OFFSET,
    MAX_PAYLOAD,
    NEED_DATA,
    Connection,
    FrameType,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    Role,
    State,
    decode,
    encode,
)

U64 = (1 << 64) - 1
HEADER = struct.Struct("!IB")

# Hypothesis budgets. The whole file must stay well under a minute on a slow
# two-core machine; these take a few seconds in all on a fast one.
ROUND_TRIP_EXAMPLES = 120
GARBAGE_EXAMPLES = 600
COMMON = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def budget(max_examples: int) -> settings:
    return settings(COMMON, max_examples=max_examples)


# -- plumbing ------------------------------------------------------------------


Chunker = Callable[[bytes], Iterable[bytes]]


def whole(data: bytes) -> list[bytes]:
    return [data]


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def drain(conn: Connection) -> list[Event]:
    """Every event `conn` can produce from what it holds (stops at ConnectionClosed)."""
    events: list[Event] = []
    # Each event consumes at least one header, so more iterations than
    # buffered bytes would mean next_event() returns events out of nothing.
    for _ in range(conn.buffered + 2):
        ev = conn.next_event()
        if ev is NEED_DATA:
            return events
        assert isinstance(ev, Event)
        events.append(ev)
        if isinstance(ev, ConnectionClosed):
            return events
    raise AssertionError("next_event() produced events without consuming bytes")


def pipe(data: bytes, dst: Connection, chunker: Chunker = whole) -> list[Event]:
    events: list[Event] = []
    for piece in chunker(data):
        dst.receive_data(piece)
        events += drain(dst)
    return events


class Pair:
    """An agent and a shadow Connection joined in memory."""

    def __init__(self, chunker: Chunker = whole) -> None:
        self.agent = Connection(Role.AGENT)
        self.shadow = Connection(Role.SHADOW)
        self.chunker = chunker
        self.wire: dict[Role, bytearray] = {Role.AGENT: bytearray(), Role.SHADOW: bytearray()}

    def conn(self, role: Role) -> Connection:
        return self.agent if role is Role.AGENT else self.shadow

    def peer(self, role: Role) -> Connection:
        return self.shadow if role is Role.AGENT else self.agent

    def send(self, role: Role, event: Event) -> list[Event]:
        data = self.conn(role).send(event)
        self.wire[role] += data
        return pipe(data, self.peer(role), self.chunker)

    def run(self, script: Iterable[tuple[Role, Event]]) -> list[Event]:
        received: list[Event] = []
        for role, event in script:
            received += self.send(role, event)
        return received

    def states(self) -> tuple[State, State]:
        return self.agent.state, self.shadow.state


A, S = Role.AGENT, Role.SHADOW

HELLO = Hello(
    job_id="job-42 (nightly)",
    instance="a1b2c3d4e5f60718",
    streams=(
        StreamSpec(1, "stdout", "runs/42/out.log"),
        StreamSpec(2, "stderr", "runs/42/err.log"),
        StreamSpec(0, "stdin", "inputs/42.txt"),
    ),
    host="node17.cluster",
    user="alice",
    command=("python3", "-c", "print('héllo wörld ✓')"),
    nonce="0123456789abcdef" * 2,
    features=("zstd", "notes", "files", "a-newer-feature-2"),
)
WELCOME = Welcome(version=PROTOCOL_VERSION, session=3, durable=((1, 100), (2, 0)), heartbeat=15.5,
                  proof="fe" * 32, features=("zstd", "notes", "files"), files=(FileHeld(1, 2, 300, 120),))
EXIT = Exit(
    code=0, signal=None, lengths=((1, 106), (2, 9)), reason="", summary=(("cpu", "1.5 s"), ("rss", "12 MiB"))
)

# A whole legal conversation using every event type but Error.
CONVERSATION: list[tuple[Role, Event]] = [
    (A, HELLO),
    (S, Challenge("9a" * 16)),
    (A, Auth("5c" * 32)),
    (S, WELCOME),
    (A, Data(1, 100, b"hello\n")),
    (A, Data(2, 0, b"\x00\xffbinary")),
    (A, Data(1, 106, b"")),
    (A, ZData(2, 9, 4096, b"(a zstd frame: the protocol carries it, the codec reads it)")),
    (A, Notes((Note(1764000000.5, "reconnected", (("after_s", 12.5), ("reason", "connection reset"))),))),
    (A, FileOpen(1, "runs/42/status.json", 3, base=2)),
    (A, FileCopy(1, 3, 0, 0, 4096)),
    (A, FileData(1, 3, 4096, b'{"step": 7}\n')),
    (A, FileCommit(1, 3, 4108, "ab" * 32)),
    (S, FileAck(1, 3, 4108, committed=True)),
    (A, FileOpen(2, "runs/42/train.log", 1)),
    (A, FileData(2, 1, 0, b"epoch 1\n")),
    (A, StdinRead(0, 0, 65536)),
    (S, Ack(1, 106)),
    (S, StdinData(0, 0, b"input bytes", False)),
    (S, StdinData(0, 11, b"", True)),
    (A, Ping(7)),
    (S, Pong(7)),
    (S, Ping(U64)),
    (A, Pong(U64)),
    (A, Exit(code=None, signal=9, lengths=((1, 106), (2, 9)), reason="killed: memory limit",
             files=((1, 3, 4108), (2, 1, 8)))),
    (S, Ack(2, 9)),  # sent before the EXIT arrived: crosses it
    (S, FileAck(2, 1, 8)),  # so may a file's
    (A, StdinRead(0, 11, 1)),
    (S, Done()),
]


STREAMING_AT = 4  # CONVERSATION[:STREAMING_AT] reaches the streaming state
EXITING_AT = next(i for i, (_, ev) in enumerate(CONVERSATION) if isinstance(ev, Exit)) + 1


def states_after(script: list[tuple[Role, Event]]) -> tuple[State, State]:
    pair = Pair()
    pair.run(script)
    return pair.states()


def frames_of(wire: bytes, magic: bool) -> list[tuple[int, int]]:
    """(start, end) of every frame in `wire`."""
    pos = len(MAGIC) if magic else 0
    out = []
    while pos < len(wire):
        length, _ = HEADER.unpack_from(wire, pos)
        out.append((pos, pos + 4 + length))
        pos += 4 + length
    assert pos == len(wire)
    return out


def valid_wires() -> dict[Role, bytes]:
    pair = Pair()
    pair.run(CONVERSATION)
    return {role: bytes(w) for role, w in pair.wire.items()}


WIRES = valid_wires()
AGENT_FRAMES = frames_of(WIRES[A], magic=True)
SHADOW_FRAMES = frames_of(WIRES[S], magic=False)


# -- (a) every event type round-trips ----------------------------------------


def test_conversation_round_trips_every_event_type() -> None:
    pair = Pair()
    expected_states = {
        0: (State.AWAIT_WELCOME, State.AWAIT_WELCOME),
        1: (State.AWAIT_AUTH, State.AWAIT_AUTH),
        2: (State.AWAIT_WELCOME, State.AWAIT_WELCOME),
        3: (State.STREAMING, State.STREAMING),
        EXITING_AT - 1: (State.EXITING, State.EXITING),
        len(CONVERSATION) - 1: (State.CLOSED, State.CLOSED),
    }
    for i, (role, event) in enumerate(CONVERSATION):
        received = pair.send(role, event)
        assert received == [event], f"step {i}: sent {event!r}"
        assert type(received[0]) is type(event)
        if i in expected_states:
            assert pair.states() == expected_states[i], f"after step {i}"
    # Only the agent opens with the magic, and only once.
    assert bytes(pair.wire[A]).startswith(MAGIC)
    assert bytes(pair.wire[A]).count(MAGIC) == 1
    assert not bytes(pair.wire[S]).startswith(MAGIC)
    # Clean EOF after DONE: both see ConnectionClosed, and nothing is buffered.
    for conn in (pair.agent, pair.shadow):
        assert conn.buffered == 0
        conn.receive_data(b"")
        assert conn.next_event() == ConnectionClosed()
        assert conn.next_event() == ConnectionClosed()  # stays closed


def test_conversation_covers_every_event_class() -> None:
    # (DataPiece is a DATA frame as a shadow receives it in pieces: section (b2).)
    sent = {type(ev) for _, ev in CONVERSATION} | {Error, ConnectionClosed, DataPiece}
    assert sent == set(Event.__subclasses__())


@pytest.mark.parametrize("refuser", [A, S])
@pytest.mark.parametrize("after", [0, 1, 2, 3, STREAMING_AT, EXITING_AT])
def test_error_round_trips_and_closes(refuser: Role, after: int) -> None:
    pair = Pair()
    pair.run(CONVERSATION[:after])
    error = Error(ErrorCode.BUSY, "too many connections: 20000 ‼", retry_after=5.25)
    assert pair.send(refuser, error) == [error]
    assert pair.states() == (State.CLOSED, State.CLOSED)
    # A closed connection sends nothing more, not even a PING or an ERROR.
    for role in (A, S):
        for ev in (Ping(1), Error(ErrorCode.INTERNAL, "again"), Data(1, 0, b"x"), Ack(1, 0)):
            with pytest.raises(LocalProtocolError):
                pair.conn(role).send(ev)
    # ...and receives only the end of the connection.
    pair.agent.receive_data(b"")
    assert pair.agent.next_event() == ConnectionClosed()


def test_events_gives_what_is_complete_and_stops_at_an_error() -> None:
    """Connection.events(), the read loops' one drain: every complete event
    in order, a frame cut short left for the next read, and nothing past an
    ERROR (the connection is over)."""
    agent, shadow = Connection(Role.AGENT), Connection(Role.SHADOW)
    hello = agent.send(HELLO)
    shadow.receive_data(hello[:-3])
    assert shadow.events() == []
    shadow.receive_data(hello[-3:])
    assert shadow.events() == [HELLO]
    error = Error(ErrorCode.TIMEOUT, "bye")
    shadow.receive_data(agent.send(error) + b"\x00\x00\x00\x05\x09more")
    assert shadow.events() == [error]
    assert shadow.state is State.CLOSED


def test_error_before_hello_from_the_shadow() -> None:
    """The shadow refuses (BUSY) before reading anything from the agent."""
    pair = Pair()
    error = Error(ErrorCode.BUSY, "too many connections", 5.0)
    assert pair.send(S, error) == [error]
    assert pair.states() == (State.CLOSED, State.CLOSED)
    assert error.code.permanent is False
    assert ErrorCode.PATH_FORBIDDEN.permanent is True


def test_unknown_error_code_from_a_newer_peer_keeps_the_message() -> None:
    body = json.dumps({"code": 4242, "message": "something new", "retry_after": 1}).encode()
    ev = decode(FrameType.ERROR, body)
    assert ev == Error(ErrorCode.INTERNAL, "something new", 1.0)
    assert isinstance(ev, Error) and isinstance(ev.retry_after, float)


def test_welcome_heartbeat_integer_becomes_float() -> None:
    ev = decode(FrameType.WELCOME, b'{"version":1,"session":0,"durable":[],"heartbeat":10}')
    assert isinstance(ev, Welcome) and ev.heartbeat == 10.0 and isinstance(ev.heartbeat, float)


def test_largest_payloads_round_trip() -> None:
    pair = Pair()
    pair.run(CONVERSATION[:STREAMING_AT])
    big = bytes(range(256)) * (MAX_PAYLOAD // 256)
    assert len(big) == MAX_PAYLOAD
    last = MAX_OFFSET - MAX_PAYLOAD  # the payload ends at the largest offset
    assert pair.send(A, Data(1, last, big)) == [Data(1, last, big)]
    assert pair.send(S, StdinData(0, last, big, True)) == [StdinData(0, last, big, True)]
    assert pair.send(A, StdinRead(255, last, MAX_PAYLOAD)) == [StdinRead(255, last, MAX_PAYLOAD)]
    assert pair.send(S, Ack(1, MAX_OFFSET)) == [Ack(1, MAX_OFFSET)]


def test_largest_control_frame_round_trips() -> None:
    """A HELLO just under MAX_CONTROL passes; one byte more is refused locally."""
    base = Hello(job_id="j", instance="i", streams=(), command=("",))
    overhead = len(encode(base)) - 5
    fits = Hello(job_id="j", instance="i", streams=(), command=("x" * (MAX_CONTROL - overhead),))
    assert len(encode(fits)) - 5 == MAX_CONTROL
    pair = Pair()
    assert pair.send(A, fits) == [fits]
    too_big = Hello(job_id="j", instance="i", streams=(), command=("x" * (MAX_CONTROL - overhead + 1),))
    agent = Connection(Role.AGENT)
    with pytest.raises(LocalProtocolError, match="too large"):
        agent.send(too_big)
    assert agent.state is State.AWAIT_HELLO


# -- (b) one byte at a time ---------------------------------------------------


def test_conversation_one_byte_at_a_time_gives_identical_events() -> None:
    whole_pair, byte_pair = Pair(), Pair(bytewise)
    assert byte_pair.run(CONVERSATION) == whole_pair.run(CONVERSATION) == [ev for _, ev in CONVERSATION]
    assert byte_pair.wire == whole_pair.wire
    assert byte_pair.states() == whole_pair.states() == (State.CLOSED, State.CLOSED)


def test_each_event_appears_exactly_when_its_last_byte_arrives() -> None:
    agent, shadow = Connection(Role.AGENT), Connection(Role.SHADOW)
    for role, event in CONVERSATION:
        src, dst = (agent, shadow) if role is A else (shadow, agent)
        data = src.send(event)
        for i, byte in enumerate(data):
            dst.receive_data(bytes([byte]))
            ev = dst.next_event()
            if i < len(data) - 1:
                assert ev is NEED_DATA, f"{event!r}: an event after {i + 1} of {len(data)} bytes"
                # The shadow drops the magic as soon as it is whole; the rest waits.
                magic = len(MAGIC) if dst is shadow and data.startswith(MAGIC) and i >= len(MAGIC) - 1 else 0
                assert dst.buffered == i + 1 - magic
            else:
                assert ev == event
                assert dst.next_event() is NEED_DATA
                assert dst.buffered == 0


@budget(100)
@given(cuts=st.lists(st.integers(1, 64), min_size=1, max_size=40))
def test_conversation_in_random_pieces_gives_identical_events(cuts: list[int]) -> None:
    def chunker(data: bytes) -> list[bytes]:
        pieces, pos, i = [], 0, 0
        while pos < len(data):
            n = cuts[i % len(cuts)]
            pieces.append(data[pos : pos + n])
            pos += n
            i += 1
        return pieces

    pair = Pair(chunker)
    assert pair.run(CONVERSATION) == [ev for _, ev in CONVERSATION]
    assert pair.states() == (State.CLOSED, State.CLOSED)


def test_whole_agent_side_in_one_buffer() -> None:
    """Many frames arriving in one read come out as many events, in order."""
    agent_events = [ev for role, ev in CONVERSATION if role is A]
    shadow = Connection(Role.SHADOW)
    hello_end = len(MAGIC) + len(encode(HELLO))
    auth = CONVERSATION[2][1]
    auth_end = hello_end + len(encode(auth))
    shadow.receive_data(WIRES[A][:hello_end])
    assert drain(shadow) == [HELLO]
    shadow.send(CONVERSATION[1][1])  # the CHALLENGE
    shadow.receive_data(WIRES[A][hello_end:auth_end])
    assert drain(shadow) == [auth]
    shadow.send(WELCOME)
    shadow.receive_data(WIRES[A][auth_end:])
    assert drain(shadow) == agent_events[2:]
    assert shadow.state is State.EXITING
    assert shadow.buffered == 0


# -- (b2) DATA in pieces ------------------------------------------------------


def streaming_shadow(pieces: bool = True) -> Connection:
    """A shadow connection past its handshake (it sent WELCOME)."""
    shadow = Connection(Role.SHADOW, pieces=pieces)
    shadow.receive_data(MAGIC + encode(HELLO))
    assert shadow.next_event() == HELLO
    shadow.send(WELCOME)
    return shadow


def feed_pieces(shadow: Connection, wire: bytes, cuts: list[int]) -> list[Event]:
    """Feed `wire` cut at `cuts` (sizes, cycled) from one reused buffer;
    the events, each DATA piece's payload copied as it comes. After every
    read the connection holds no payload bytes: at most a frame's head."""
    events: list[Event] = []
    buffer = bytearray(max(cuts))
    pos, i = 0, 0
    while pos < len(wire):
        chunk = wire[pos : pos + cuts[i % len(cuts)]]
        pos, i = pos + len(chunk), i + 1
        buffer[: len(chunk)] = chunk
        shadow.receive_data(memoryview(buffer)[: len(chunk)], borrowed=True)
        while (ev := shadow.next_event()) is not NEED_DATA:
            assert isinstance(ev, Event)
            events.append(replace(ev, payload=bytes(ev.payload)) if isinstance(ev, DataPiece) else ev)
        assert shadow.buffered < 14, "a read's payload bytes were kept"
        buffer[:] = b"\xee" * len(buffer)
    return events


data_frames = st.lists(
    st.tuples(st.sampled_from([1, 2]), st.binary(max_size=300) | st.sampled_from([b"", bytes(range(256)) * 20])),
    min_size=1, max_size=6,
)


@budget(ROUND_TRIP_EXAMPLES)
@given(frames=data_frames, cuts=st.lists(st.integers(1, 700), min_size=1, max_size=20), ping=st.booleans())
def test_data_pieces_at_their_offsets_are_the_payload_for_any_split(
    frames: list[tuple[int, bytes]], cuts: list[int], ping: bool,
) -> None:
    """Whatever the reads, concatenating a frame's pieces at their offsets
    gives its payload: every piece lies inside its frame, the first at its
    start, the next where the last ended, the last at its end."""
    sent: list[Event] = []
    offsets = {1: 100, 2: 0}
    for sid, payload in frames:
        sent.append(Data(sid, offsets[sid], payload))
        offsets[sid] += len(payload)
        if ping:
            sent.append(Ping(len(sent)))
    wire = b"".join(encode(ev) for ev in sent)
    events = feed_pieces(streaming_shadow(), wire, cuts)
    assert folded(events) == sent
    for ev in sent:
        if isinstance(ev, Data):
            got = bytearray(len(ev.payload))
            for piece in events:
                if isinstance(piece, DataPiece) and (piece.stream, piece.start, piece.end) == (
                        ev.stream, ev.offset, ev.offset + len(ev.payload)):
                    got[piece.offset - piece.start : piece.offset - piece.start + len(piece.payload)] = piece.payload
            assert got == ev.payload


def test_data_pieces_byte_by_byte() -> None:
    payload = bytes(range(200))
    wire = encode(Data(1, 7, payload)) + encode(Data(1, 207, b"")) + encode(Ping(1))
    events = feed_pieces(streaming_shadow(), wire, [1])
    assert events[0] == DataPiece(1, 7, payload[:1], 7, 207)  # the first byte of the payload, at once
    assert len(events) == 200 + 2
    assert events[-2] == DataPiece(1, 207, b"", 207, 207)  # an empty frame is one empty piece
    assert events[-1] == Ping(1)
    assert folded(events) == [Data(1, 7, payload), Data(1, 207, b""), Ping(1)]


def test_a_data_frame_head_is_checked_before_its_first_piece() -> None:
    """Too large, or running past the largest offset: refused from the
    head, before any payload byte is given out."""
    for head, code in (
        (HEADER.pack(1 + 9 + MAX_PAYLOAD + 1, FrameType.DATA) + struct.pack("!BQ", 1, 0), ErrorCode.FRAME_TOO_LARGE),
        (HEADER.pack(1 + 9 + 10, FrameType.DATA) + struct.pack("!BQ", 1, MAX_OFFSET - 9), ErrorCode.BAD_FRAME),
    ):
        shadow = streaming_shadow()
        shadow.max_frame = 1 << 30
        shadow.receive_data(head[:13])
        assert shadow.next_event() is NEED_DATA
        shadow.receive_data(head[13:] + bytes(10))
        with pytest.raises(RemoteProtocolError) as info:
            shadow.next_event()
        assert info.value.code is code


def test_eof_in_the_middle_of_data_pieces_is_an_error() -> None:
    shadow = streaming_shadow()
    frame = encode(Data(1, 0, bytes(100)))
    shadow.receive_data(frame[:50])
    assert isinstance(shadow.next_event(), DataPiece)
    assert shadow.next_event() is NEED_DATA
    assert shadow.buffered == 0
    shadow.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a frame"):
        shadow.next_event()


def test_data_pieces_only_where_data_is_legal() -> None:
    """Before the handshake is over, or after EXIT, a DATA frame is not cut
    into pieces: it is refused as before."""
    early = Connection(Role.SHADOW, pieces=True)
    early.receive_data(MAGIC + encode(Data(1, 0, b"x")))
    with pytest.raises(RemoteProtocolError) as info:
        early.next_event()
    assert info.value.code is ErrorCode.UNEXPECTED
    late = streaming_shadow()
    late.receive_data(encode(EXIT) + encode(Data(1, 0, b"x")))
    assert late.next_event() == EXIT
    with pytest.raises(RemoteProtocolError) as info:
        late.next_event()
    assert info.value.code is ErrorCode.UNEXPECTED


def test_pieces_of_bytes_kept_from_an_earlier_read() -> None:
    """receive_data twice without next_event in between: the first read's
    bytes are kept (copied, for a borrowed buffer) and come out in order."""
    shadow = streaming_shadow()
    payload = bytes(range(256)) * 40
    wire = encode(Data(1, 0, payload))
    buffer = bytearray(wire[:6000])
    shadow.receive_data(memoryview(buffer), borrowed=True)
    shadow.receive_data(wire[6000:])
    buffer[:] = bytes(len(buffer))
    events = []
    while (ev := shadow.next_event()) is not NEED_DATA:
        events.append(ev)
    assert folded(events) == [Data(1, 0, payload)]


def streaming_agent() -> Connection:
    agent = agent_after_hello()
    agent.receive_data(encode(WELCOME))
    assert agent.next_event() == WELCOME
    return agent


@budget(ROUND_TRIP_EXAMPLES)
@given(stream=st.sampled_from([0, 1, 255, 256, -1]),
       offset=st.sampled_from([0, 1, MAX_OFFSET - MAX_PAYLOAD, MAX_OFFSET - 1, MAX_OFFSET, MAX_OFFSET + 1, -1]),
       size=st.sampled_from([0, 1, 4096, MAX_PAYLOAD, MAX_PAYLOAD + 1]))
def test_send_data_head_checks_what_send_checks(stream: int, offset: int, size: int) -> None:
    """The head of a DATA frame whose payload the sender passes through
    (sendmsg, sendfile) is legal exactly when the whole frame would be, and
    with the payload after it is the frame `send` makes."""
    payload = bytes(size)
    try:
        frame = streaming_agent().send(Data(stream, offset, payload))
    except LocalProtocolError:
        frame = None
    agent = streaming_agent()
    if frame is None:
        with pytest.raises(LocalProtocolError):
            agent.send_data_head(stream, offset, size)
    else:
        assert agent.send_data_head(stream, offset, size) + payload == frame
    assert agent.state is State.STREAMING


def test_send_data_head_only_where_data_is_legal() -> None:
    with pytest.raises(LocalProtocolError):
        agent_after_hello().send_data_head(1, 0, 1)  # before WELCOME
    exiting = streaming_agent()
    exiting.send(EXIT)
    with pytest.raises(LocalProtocolError):
        exiting.send_data_head(1, 0, 1)
    with pytest.raises(LocalProtocolError):
        streaming_shadow().send_data_head(1, 0, 1)  # the shadow sends no DATA


# -- (c) hypothesis round trips ----------------------------------------------

u8 = st.integers(0, 255)
u64 = st.integers(0, U64)
offsets = st.integers(0, MAX_OFFSET)


def text(max_size: int, min_size: int = 0) -> st.SearchStrategy[str]:
    """Unicode text the codec accepts in a string field: no NUL, no lone surrogate."""
    return st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=min_size,
                   max_size=max_size)


PRINTABLE = st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")) | st.just(" ")
job_ids = st.text(PRINTABLE, min_size=1, max_size=256).filter(str.isprintable)
instances = st.text(
    st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-"), min_size=1, max_size=64
)
payloads = st.binary(max_size=4096)
seconds = st.floats(0, 86400, exclude_max=True, allow_nan=False)
pairs = st.lists(st.tuples(u8, offsets), max_size=16).map(tuple)


@st.composite
def stream_specs(draw: st.DrawFn) -> tuple[StreamSpec, ...]:
    ids = draw(st.lists(u8, unique=True, max_size=16))
    return tuple(StreamSpec(i, draw(st.sampled_from(STREAM_KINDS)), draw(text(60))) for i in ids)


hellos = st.builds(
    Hello,
    job_id=job_ids,
    instance=instances,
    streams=stream_specs(),
    host=text(255),
    user=text(255),
    command=st.lists(st.text(st.characters(codec="utf-8"), max_size=80), max_size=12).map(tuple),
    versions=st.lists(st.integers(1, 65535), min_size=1, max_size=16).map(tuple),
    nonce=st.from_regex(r"[0-9a-f]{0,128}", fullmatch=True),
    features=st.lists(st.from_regex(r"[a-z0-9-]{1,32}", fullmatch=True), max_size=16).map(tuple),
)
welcomes = st.builds(
    Welcome,
    version=st.integers(0, 1 << 31),
    session=offsets,
    durable=pairs,
    heartbeat=st.floats(0, 86400, exclude_min=True, exclude_max=True, allow_nan=False),
    proof=st.from_regex(r"[0-9a-f]{0,128}", fullmatch=True),
    features=st.sampled_from([(), ("zstd",), ("zstd", "later-1"), ("notes",), ("zstd", "notes")]),
)
challenges = st.builds(Challenge, nonce=st.from_regex(r"[0-9a-f]{32,128}", fullmatch=True))
auths = st.builds(Auth, mac=st.from_regex(r"[0-9a-f]{0,128}", fullmatch=True))


@st.composite
def datas(draw: st.DrawFn) -> Data:
    payload = draw(payloads)
    offset = draw(st.integers(0, MAX_OFFSET - len(payload)) | st.just(MAX_OFFSET - len(payload)))
    return Data(draw(u8), offset, payload)


acks = st.builds(Ack, stream=u8, offset=offsets)


@st.composite
def zdatas(draw: st.DrawFn) -> ZData:
    size = draw(st.integers(1, MAX_PAYLOAD))
    offset = draw(st.integers(0, MAX_OFFSET - size) | st.just(MAX_OFFSET - size))
    return ZData(draw(u8), offset, size, draw(st.binary(min_size=1, max_size=512)))


@st.composite
def stdin_reads_(draw: st.DrawFn) -> StdinRead:
    max_bytes = draw(st.integers(1, MAX_PAYLOAD))
    return StdinRead(draw(u8), draw(st.integers(0, MAX_OFFSET - max_bytes)), max_bytes)


stdin_reads = stdin_reads_()


@st.composite
def stdin_datas(draw: st.DrawFn) -> StdinData:
    payload = draw(payloads)
    return StdinData(draw(u8), draw(st.integers(0, MAX_OFFSET - len(payload))), payload, draw(st.booleans()))


exits = st.builds(
    Exit,
    code=st.none() | u8,
    signal=st.none() | st.integers(1, 127),
    lengths=pairs,
    reason=text(4096),
    summary=st.lists(st.tuples(text(64), text(200)), max_size=8).map(tuple),
)
note_names = st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True)
note_values = (st.none() | st.booleans() | st.integers(-MAX_OFFSET, MAX_OFFSET)
               | st.floats(allow_nan=False, allow_infinity=False) | text(512))
notes = st.builds(
    Notes,
    notes=st.lists(st.builds(
        Note,
        time=st.floats(0, 4e9, allow_nan=False),
        kind=note_names,
        details=st.dictionaries(note_names, note_values, max_size=4).map(lambda d: tuple(d.items())),
    ), min_size=1, max_size=8).map(tuple),
)
pings = st.builds(Ping, nonce=u64)
pongs = st.builds(Pong, nonce=u64)
errors = st.builds(Error, code=st.sampled_from(ErrorCode), message=text(2000), retry_after=seconds)
any_event = st.one_of(
    hellos, welcomes, datas(), zdatas(), acks, stdin_reads, stdin_datas(), exits, st.just(Done()), pings, pongs, errors,
    notes,
)

agent_streaming = st.one_of(datas(), stdin_reads, pings, pongs).map(lambda e: (A, e))
shadow_streaming = st.one_of(acks, stdin_datas(), pings, pongs).map(lambda e: (S, e))
agent_exiting = st.one_of(stdin_reads, pings, pongs).map(lambda e: (A, e))
shadow_exiting = st.one_of(acks, stdin_datas(), pings, pongs).map(lambda e: (S, e))


@st.composite
def conversations(draw: st.DrawFn) -> list[tuple[Role, Event]]:
    """A legal conversation of random valid events, ended by DONE or by an ERROR anywhere."""
    script: list[tuple[Role, Event]] = [(A, draw(hellos))]
    if draw(st.booleans()):  # token authentication
        script += [(S, draw(challenges)), (A, draw(auths))]
    welcome = draw(welcomes)
    script.append((S, welcome))
    agent_sends = agent_streaming
    if "zstd" in welcome.features:
        agent_sends = agent_sends | zdatas().map(lambda e: (A, e))
    if "notes" in welcome.features:
        agent_sends = agent_sends | notes.map(lambda e: (A, e))
    script += draw(st.lists(agent_sends | shadow_streaming, max_size=8))
    script.append((A, draw(exits)))
    script += draw(st.lists(agent_exiting | shadow_exiting, max_size=4))
    script.append((S, Done()))
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(script) - 1))
        script = [*script[:cut], (draw(st.sampled_from([A, S])), draw(errors))]
    return script


@budget(ROUND_TRIP_EXAMPLES)
@given(script=conversations(), piece=st.sampled_from([0, 1, 3, 7, 1000]))
def test_random_conversations_round_trip(script: list[tuple[Role, Event]], piece: int) -> None:
    chunker: Chunker = whole if piece == 0 else (lambda d: [d[i : i + piece] for i in range(0, len(d), piece)])
    pair = Pair(chunker)
    for role, event in script:
        assert pair.send(role, event) == [event]
    assert pair.states() == (State.CLOSED, State.CLOSED)
    assert pair.agent.buffered == pair.shadow.buffered == 0


@budget(ROUND_TRIP_EXAMPLES)
@given(event=any_event)
def test_codec_round_trip(event: Event) -> None:
    frame = encode(event)
    length, ftype = HEADER.unpack_from(frame)
    assert length == len(frame) - 4 <= DEFAULT_MAX_FRAME
    assert decode(ftype, frame[5:]) == event


# -- encoder refuses what the peer would refuse --------------------------------


@pytest.mark.parametrize(
    "event",
    [
        Data(256, 0, b""),
        Data(-1, 0, b""),
        Data(1, -1, b""),
        Data(1, U64 + 1, b""),
        Data(1, U64, b"x"),  # runs past the largest offset
        Data(1, MAX_OFFSET + 1, b""),  # no file is that long
        Data(1, MAX_OFFSET, b"x"),
        Data(1, 0, bytes(MAX_PAYLOAD + 1)),
        Ack(256, 0),
        Ack(1, U64 + 1),
        Ack(1, MAX_OFFSET + 1),
        Ack(1, -1),
        StdinRead(1, MAX_OFFSET + 1, 1),
        StdinRead(1, MAX_OFFSET, 1),  # reads past the largest offset
        StdinData(1, MAX_OFFSET + 1, b"", False),
        StdinData(1, MAX_OFFSET, b"x", False),
        Welcome(1, MAX_OFFSET + 1, ()),
        Welcome(1, 1, ((1, MAX_OFFSET + 1),)),
        Welcome(1, 1, ((256, 0),)),
        Exit(0, None, ((1, MAX_OFFSET + 1),)),
        Exit(0, None, tuple((i, 0) for i in range(17))),
        StdinRead(1, 0, 0),
        StdinRead(1, 0, MAX_PAYLOAD + 1),
        StdinRead(1, 0, 1 << 32),
        StdinRead(300, 0, 1),
        StdinData(999, 0, b"", False),
        StdinData(1, 0, bytes(MAX_PAYLOAD + 1), False),
        Ping(-1),
        Pong(1 << 64),
        Hello("j", "i", (), command=("cat", "caf\udce9.txt")),  # undecodable argv byte
        Error(ErrorCode.INTERNAL, "x" * (MAX_CONTROL + 1)),
    ],
    ids=lambda e: repr(e)[:50],
)
def test_encode_refuses_invalid_fields_with_local_protocol_error(event: Event) -> None:
    """Not a struct.error or UnicodeEncodeError, and not a frame the peer must refuse."""
    with pytest.raises(LocalProtocolError) as info:
        encode(event)
    assert info.value.code is ErrorCode.BAD_FRAME


@pytest.mark.parametrize("bad", [Data(256, 0, b"x"), Data(1, U64, b"xy"), Ping(-5)], ids=lambda e: repr(e)[:50])
def test_failed_send_changes_nothing(bad: Event) -> None:
    pair = Pair()
    pair.run(CONVERSATION[:STREAMING_AT])
    with pytest.raises(LocalProtocolError):
        pair.agent.send(bad)
    assert pair.states() == (State.STREAMING, State.STREAMING)
    assert pair.send(A, Data(1, 100, b"ok")) == [Data(1, 100, b"ok")]


def test_a_refused_first_send_does_not_use_up_the_magic() -> None:
    agent = Connection(Role.AGENT)
    with pytest.raises(LocalProtocolError):
        agent.send(Data(1, 0, b"early"))
    with pytest.raises(LocalProtocolError):
        agent.send(Hello("j", "i", (), command=("\udcff",)))
    assert agent.send(HELLO).startswith(MAGIC)


wide_int = st.integers(-2, (1 << 64) + 2) | st.integers(-2, 300) | st.integers((1 << 32) - 2, (1 << 32) + 2)


@budget(ROUND_TRIP_EXAMPLES)
@given(
    event=st.one_of(
        st.builds(Data, wide_int, wide_int, st.binary(max_size=16)),
        st.builds(Ack, wide_int, wide_int),
        st.builds(StdinRead, wide_int, wide_int, wide_int | st.just(MAX_PAYLOAD + 1)),
        st.builds(StdinData, wide_int, wide_int, st.binary(max_size=16), st.booleans()),
        st.builds(Ping, wide_int),
        st.builds(Pong, wide_int),
    )
)
def test_whatever_send_accepts_the_peer_decodes_unchanged(event: Event) -> None:
    pair = Pair()
    pair.run(CONVERSATION[:STREAMING_AT])
    role = A if isinstance(event, (Data, StdinRead, Ping, Pong)) else S
    try:
        data = pair.conn(role).send(event)
    except LocalProtocolError:
        assert pair.states() == (State.STREAMING, State.STREAMING)
        return
    assert pipe(data, pair.peer(role)) == [event]


# -- decoder: text must be Unicode ---------------------------------------------


def hello_obj(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "versions": [1],
        "job_id": "j",
        "instance": "i",
        "host": "h",
        "user": "u",
        "command": ["cat"],
        "streams": [[1, "stdout", "out"]],
    }
    obj.update(changes)
    return obj


def welcome_obj(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"version": 1, "session": 1, "durable": [[1, 0]], "heartbeat": 10.0}
    obj.update(changes)
    return obj


def exit_obj(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"code": 0, "signal": None, "lengths": [[1, 5]], "reason": "", "summary": [["k", "v"]]}
    obj.update(changes)
    return obj


def error_obj(**changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"code": 1, "message": "m", "retry_after": 0.0}
    obj.update(changes)
    return obj


SURROGATE = "\udce9"  # json.dumps writes it as the escape \udce9


@pytest.mark.parametrize(
    "ftype, obj",
    [
        (FrameType.HELLO, hello_obj(host=SURROGATE)),
        (FrameType.HELLO, hello_obj(user="a" + SURROGATE)),
        (FrameType.HELLO, hello_obj(job_id=SURROGATE)),
        (FrameType.HELLO, hello_obj(command=["cat", "caf" + SURROGATE])),
        (FrameType.HELLO, hello_obj(streams=[[1, "stdout", "out" + SURROGATE]])),
        (FrameType.HELLO, hello_obj(streams=[[1, "stdout", "\ud800"]])),
        (FrameType.EXIT, exit_obj(reason=SURROGATE)),
        (FrameType.EXIT, exit_obj(summary=[["k", SURROGATE]])),
        (FrameType.ERROR, error_obj(message=SURROGATE)),
    ],
    ids=lambda x: x.name if isinstance(x, FrameType) else None,
)
def test_lone_surrogates_are_refused(ftype: FrameType, obj: dict[str, Any]) -> None:
    """A string holding a lone surrogate cannot be encoded as UTF-8: storing it
    in SQLite raises UnicodeEncodeError, which used to escape the shadow's
    connection handler and stop the whole server. The codec refuses it."""
    body = json.dumps(obj).encode()
    assert b"\\ud" in body
    with pytest.raises(RemoteProtocolError) as info:
        decode(ftype, body)
    assert info.value.code is ErrorCode.BAD_FRAME


def test_escaped_surrogate_pairs_are_fine() -> None:
    body = json.dumps(hello_obj(host="😀", command=["echo", "😀"])).encode()  # ensure_ascii: \ud83d\ude00
    assert b"\\ud83d\\ude00" in body
    ev = decode(FrameType.HELLO, body)
    assert isinstance(ev, Hello) and ev.host == "😀" and ev.command == ("echo", "😀")


# -- (d) garbage ----------------------------------------------------------------

EXPECTED_CODES = {ErrorCode.BAD_FRAME, ErrorCode.UNEXPECTED, ErrorCode.FRAME_TOO_LARGE}


def play(conn: Connection, data: bytes, pieces: list[int] | None = None,
         borrowed: bool = False) -> tuple[list[Event], ProtocolError | None]:
    """Feed `data` then EOF to `conn`, answering like the real peer would
    (CHALLENGE to HELLO, WELCOME to AUTH, AUTH to CHALLENGE, EXIT to WELCOME, PONG to PING). Returns the events and the
    RemoteProtocolError, if any; any other exception propagates. With
    `borrowed`, each chunk is fed from one reused buffer, overwritten once
    the connection asks for more; DATA pieces are copied as they come."""
    chunks: list[bytes] = []
    if pieces:
        pos, i = 0, 0
        while pos < len(data):
            chunks.append(data[pos : pos + pieces[i % len(pieces)]])
            pos += pieces[i % len(pieces)]
            i += 1
    else:
        chunks = [data]
    events: list[Event] = []
    buffer = bytearray(max(map(len, chunks), default=0))
    try:
        for chunk in [*chunks, b""]:
            if borrowed and chunk:
                buffer[: len(chunk)] = chunk
                conn.receive_data(memoryview(buffer)[: len(chunk)], borrowed=True)
            else:
                conn.receive_data(chunk)
            # Each event consumes at least a header: more rounds than bytes would be a loop.
            for _ in range(conn.buffered + 2):
                ev = conn.next_event()
                if ev is NEED_DATA:
                    buffer[:] = b"\xee" * len(buffer)  # what the connection kept must not be the caller's buffer
                    break
                assert isinstance(ev, Event)
                if isinstance(ev, DataPiece):
                    ev = replace(ev, payload=bytes(ev.payload))
                events.append(ev)
                if isinstance(ev, ConnectionClosed):
                    assert chunk == b"", "ConnectionClosed before EOF"
                    return events, None
                if isinstance(ev, Hello) and conn.role is Role.SHADOW and conn.state is State.AWAIT_WELCOME:
                    conn.send(Challenge("ab" * 16))
                elif isinstance(ev, Auth) and conn.role is Role.SHADOW and conn.state is State.AWAIT_WELCOME:
                    conn.send(Welcome(PROTOCOL_VERSION, 1, (), features=("zstd", "notes", "files")))
                elif isinstance(ev, Challenge) and conn.state is State.AWAIT_AUTH:
                    conn.send(Auth("cd" * 32))
                elif isinstance(ev, Welcome) and conn.state is State.STREAMING:
                    conn.send(EXIT)
                elif isinstance(ev, Ping) and conn.state is not State.CLOSED:
                    conn.send(Pong(ev.nonce))
            else:
                raise AssertionError("next_event() produced events without consuming bytes")
    except RemoteProtocolError as e:
        assert isinstance(e, ProtocolError)
        assert e.code in EXPECTED_CODES, e.code
        assert str(e)
        return events, e
    raise AssertionError("EOF was fed but neither ConnectionClosed nor an error came out")


def agent_after_hello() -> Connection:
    conn = Connection(Role.AGENT)
    conn.send(HELLO)
    return conn


def test_valid_wires_play_cleanly() -> None:
    events, error = play(Connection(Role.SHADOW), WIRES[A])
    assert error is None and events[-1] == ConnectionClosed()
    assert events[:-1] == [ev for role, ev in CONVERSATION if role is A]
    events, error = play(agent_after_hello(), WIRES[S])
    assert error is None and events[:-1] == [ev for role, ev in CONVERSATION if role is S]


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["stdout", "stderr", "stdin", "\udce9", "\x00", ""]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _mutate_json(body: bytes, key: str, value: Any, mode: str) -> bytes:
    obj = json.loads(body)
    if mode == "drop":
        obj.pop(key, None)
    elif mode == "replace":
        obj[key] = value
    elif mode == "whole":
        obj = value
    return json.dumps(obj, allow_nan=True).encode()


@st.composite
def mutated_wires(draw: st.DrawFn) -> tuple[Role, bytes]:
    """A valid byte stream of one side with 1-3 mutations applied."""
    role = draw(st.sampled_from([A, S]))
    wire = bytearray(WIRES[role])
    frames = AGENT_FRAMES if role is A else SHADOW_FRAMES
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(
            st.sampled_from(
                ["flip", "truncate", "type", "length", "insert", "delete", "duplicate", "json", "huge", "bool"]
            )
        )
        start, end = draw(st.sampled_from(frames))
        if end > len(wire):  # an earlier mutation shortened the stream
            kind = "flip"
        if kind == "flip" and wire:
            i = draw(st.integers(0, len(wire) - 1))
            wire[i] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del wire[draw(st.integers(0, len(wire))) :]
        elif kind == "type":
            wire[start + 4] = draw(st.integers(0, 255))
        elif kind == "length":
            n = draw(st.sampled_from([0, 1, 2, 4, 8, 9, 10, 17]) | st.integers(0, (1 << 32) - 1))
            struct.pack_into("!I", wire, start, n)
        elif kind == "huge":
            struct.pack_into("!I", wire, start, draw(st.sampled_from([DEFAULT_MAX_FRAME + 1, 1 << 30, (1 << 32) - 1])))
        elif kind == "insert":
            i = draw(st.integers(0, len(wire)))
            wire[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete" and wire:
            i = draw(st.integers(0, len(wire) - 1))
            del wire[i : i + draw(st.integers(1, 16))]
        elif kind == "duplicate":
            wire[end:end] = wire[start:end]
        elif kind in ("json", "bool"):
            ftype = wire[start + 4]
            body = bytes(wire[start + 5 : end])
            if ftype not in (FrameType.HELLO, FrameType.WELCOME, FrameType.EXIT, FrameType.ERROR, FrameType.DONE):
                continue
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):
                continue
            if not isinstance(obj, dict):
                continue
            keys = sorted(obj) or ["x"]
            if kind == "bool":
                new_body = _mutate_json(body, draw(st.sampled_from(keys)), draw(st.booleans()), "replace")
            else:
                mode = draw(st.sampled_from(["drop", "replace", "whole", "raw"]))
                if mode == "raw":
                    new_body = draw(
                        st.binary(max_size=64)
                        | st.sampled_from([b"", b"{", b"[" * 5000, b'{"a":' * 3000, b"\xff\xfe{}", b"nul"])
                    )
                else:
                    new_body = _mutate_json(body, draw(st.sampled_from(keys)), draw(json_values), mode)
            wire[start:end] = HEADER.pack(len(new_body) + 1, ftype) + new_body
    return role, bytes(wire)


def folded(events: list[Event]) -> list[Event]:
    """`events` with every DATA frame's pieces joined into the DATA event
    (checked to be in order, gapless, each at its own offset); the pieces
    of a frame that never completed are left out."""
    out: list[Event] = []
    frame: list[DataPiece] = []
    for ev in events:
        if not isinstance(ev, DataPiece):
            assert not frame or isinstance(ev, ConnectionClosed), f"{ev!r} in the middle of a DATA frame"
            out.append(ev)
            continue
        prev = frame[-1] if frame else None
        if prev is None:
            assert ev.first, ev
        else:
            assert (ev.stream, ev.start, ev.end) == (prev.stream, prev.start, prev.end)
            assert ev.offset == prev.offset + len(prev.payload) and ev.payload
        assert ev.start <= ev.offset <= ev.offset + len(ev.payload) <= ev.end
        frame.append(ev)
        if ev.last:
            out.append(Data(ev.stream, ev.start, b"".join(bytes(p.payload) for p in frame)))
            frame = []
    return out


def play_both(wire: bytes, pieces: list[int] | None) -> tuple[list[Event], ProtocolError | None]:
    """Play `wire` into a shadow that gathers DATA frames and one that gives
    them out in pieces (into a buffer it reuses, scribbled over after every
    read): the same events come out, DATA whole or in pieces, and both
    refuse the input or neither does. Returns the whole-frame shadow's play."""
    events, error = play(Connection(Role.SHADOW), wire, pieces)
    piece_events, piece_error = play(Connection(Role.SHADOW, pieces=True), wire, pieces, borrowed=True)
    assert (error is None) == (piece_error is None), (error, piece_error)
    assert folded(piece_events) == events
    return events, error


def receiver(role: Role) -> Connection:
    """The connection that receives what `role` sent."""
    return Connection(Role.SHADOW) if role is A else agent_after_hello()


def test_garbage_random_bytes() -> None:
    tried = 0

    @budget(GARBAGE_EXAMPLES)
    @given(
        data=st.binary(max_size=600),
        magic=st.booleans(),
        to=st.sampled_from([A, S]),
        pieces=st.none() | st.lists(st.integers(1, 50), min_size=1, max_size=5),
    )
    def run(data: bytes, magic: bool, to: Role, pieces: list[int] | None) -> None:
        nonlocal tried
        tried += 1
        wire = (MAGIC if magic and to is S else b"") + data
        if to is S:
            play_both(wire, pieces)
        else:
            play(agent_after_hello(), wire, pieces)

    run()
    assert tried >= GARBAGE_EXAMPLES // 2, tried
    print(f"random garbage: {tried} inputs")


def test_garbage_mutated_frames() -> None:
    tried = 0
    refused = 0

    @budget(GARBAGE_EXAMPLES)
    @given(mutated=mutated_wires(), pieces=st.none() | st.lists(st.integers(1, 40), min_size=1, max_size=5))
    def run(mutated: tuple[Role, bytes], pieces: list[int] | None) -> None:
        nonlocal tried, refused
        tried += 1
        role, wire = mutated
        _, error = play_both(wire, pieces) if role is A else play(receiver(role), wire, pieces)
        refused += error is not None

    run()
    assert tried >= GARBAGE_EXAMPLES // 2, tried
    # The mutations are mostly fatal: the receivers really were exercised.
    assert refused > tried // 2, (refused, tried)
    print(f"mutated frames: {tried} inputs, {refused} refused")


# Boundary values for every numeric field: either side of each limit the
# codec knows (field widths, MAX_PAYLOAD, MAX_OFFSET) and of the ones it
# must not forget (2**31, 2**32, 2**63, 2**64).
EDGES = sorted({
    *(e + d for e in (0, 128, 256, 1 << 16, 1 << 31, 1 << 32, MAX_PAYLOAD, 1 << 63, 1 << 64) for d in (-1, 0, 1)),
    MAX_OFFSET - MAX_PAYLOAD, MAX_OFFSET - 1, -(1 << 63), -(1 << 64), 10**30,
})
edge_int = st.sampled_from(EDGES)
json_edge = (edge_int | st.sampled_from([10**400, -(10**400), 0.5, -0.0, 1e308, float("inf"), float("-inf"),
                                         float("nan"), True, False, None, "1", [1]]))
u8_edge, u32_edge = st.sampled_from([0, 1, 2, 255]), st.sampled_from([e for e in EDGES if 0 <= e < 1 << 32])
u64_edge = st.sampled_from([e for e in EDGES if 0 <= e < 1 << 64])
payload_edge = st.sampled_from([0, 1, 2, MAX_PAYLOAD, MAX_PAYLOAD + 1]).map(bytes)


@st.composite
def edge_frames(draw: st.DrawFn) -> tuple[int, bytes]:
    """One frame body of any type, a boundary value in one or more of its numeric fields."""
    ftype = draw(st.sampled_from(list(FrameType)))
    if ftype is FrameType.DATA:
        return ftype, struct.pack("!BQ", draw(u8_edge), draw(u64_edge)) + draw(payload_edge)
    if ftype is FrameType.ACK:
        return ftype, struct.pack("!BQ", draw(u8_edge), draw(u64_edge))
    if ftype is FrameType.STDIN_READ:
        return ftype, struct.pack("!BQI", draw(u8_edge), draw(u64_edge), draw(u32_edge))
    if ftype is FrameType.STDIN_DATA:
        return ftype, struct.pack("!BQB", draw(u8_edge), draw(u64_edge), draw(u8_edge)) + draw(payload_edge)
    if ftype in (FrameType.PING, FrameType.PONG):
        return ftype, struct.pack("!Q", draw(u64_edge))
    obj: dict[str, Any]
    if ftype is FrameType.HELLO:
        obj = hello_obj(versions=[draw(json_edge)], streams=[[draw(json_edge), "stdout", "o"]])
    elif ftype is FrameType.WELCOME:
        obj = welcome_obj(version=draw(json_edge), session=draw(json_edge), heartbeat=draw(json_edge),
                          durable=[[draw(json_edge), draw(json_edge)]])
    elif ftype is FrameType.EXIT:
        obj = exit_obj(code=draw(json_edge), signal=draw(json_edge), lengths=[[draw(json_edge), draw(json_edge)]])
    elif ftype is FrameType.ERROR:
        obj = error_obj(code=draw(json_edge), retry_after=draw(json_edge))
    else:  # CHALLENGE, AUTH, DONE: no numbers; a number where text goes
        obj = {"nonce": draw(json_edge), "mac": draw(json_edge)}
    # Usually one field at its edge and the others valid, so that each edge is what decides.
    if draw(st.booleans()):
        valid = {FrameType.HELLO: hello_obj, FrameType.WELCOME: welcome_obj, FrameType.EXIT: exit_obj,
                 FrameType.ERROR: error_obj}.get(ftype, dict)()
        keep = draw(st.sampled_from(sorted(obj)))
        obj = {**valid, keep: obj[keep]}
    return ftype, json.dumps(obj, allow_nan=True).encode()


@budget(GARBAGE_EXAMPLES)
@given(frame=edge_frames())
def test_boundary_values_in_every_numeric_field_decode_or_are_bad_frames(frame: tuple[int, bytes]) -> None:
    """The decoder's whole contract: a valid event, one that can be sent on
    unchanged, or RemoteProtocolError BAD_FRAME / FRAME_TOO_LARGE. Never
    another exception, and never an event whose numbers a receiver cannot
    use (STDIN_READ at 2**63 was decoded, then crashed the shadow's pread)."""
    ftype, body = frame
    try:
        ev = decode(ftype, body)
    except RemoteProtocolError as e:
        assert e.code in (ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE), e.code
        return
    again = encode(ev)  # LocalProtocolError here: the decoder let through what no sender may send
    assert decode(again[4], again[5:]) == ev
    for name in ("offset", "session"):
        assert 0 <= getattr(ev, name, 0) <= MAX_OFFSET
    for _, length in getattr(ev, "durable", ()) + getattr(ev, "lengths", ()):
        assert 0 <= length <= MAX_OFFSET
    end = getattr(ev, "offset", 0) + len(getattr(ev, "payload", b"")) + getattr(ev, "max_bytes", 0)
    assert end <= MAX_OFFSET


@pytest.mark.parametrize(
    "ftype, make",
    [(FrameType.HELLO, hello_obj), (FrameType.WELCOME, welcome_obj), (FrameType.EXIT, exit_obj),
     (FrameType.ERROR, error_obj)],
    ids=["HELLO", "WELCOME", "EXIT", "ERROR"],
)
def test_garbage_json_fields(ftype: FrameType, make: Callable[..., dict[str, Any]]) -> None:
    tried = 0
    keys = sorted(make())

    @budget(GARBAGE_EXAMPLES // 5)
    @given(key=st.sampled_from([*keys, "unknown"]), value=json_values, drop=st.booleans())
    def run(key: str, value: Any, drop: bool) -> None:
        nonlocal tried
        tried += 1
        obj = make()
        if drop:
            obj.pop(key, None)
        else:
            obj[key] = value
        try:
            ev = decode(ftype, json.dumps(obj).encode())
        except RemoteProtocolError as e:
            assert e.code in EXPECTED_CODES
            return
        # Accepted: then it must survive a round trip unchanged.
        assert decode(ftype, encode(ev)[5:]) == ev

    run()
    assert tried >= GARBAGE_EXAMPLES // 10, tried
    print(f"{ftype.name} JSON fields: {tried} inputs")


BOOL_FOR_INT = [
    (FrameType.HELLO, hello_obj(versions=[True])),
    (FrameType.HELLO, hello_obj(streams=[[True, "stdout", "x"]])),
    (FrameType.WELCOME, welcome_obj(version=True)),
    (FrameType.WELCOME, welcome_obj(session=False)),
    (FrameType.WELCOME, welcome_obj(heartbeat=True)),
    (FrameType.WELCOME, welcome_obj(durable=[[1, True]])),
    (FrameType.WELCOME, welcome_obj(durable=[[False, 1]])),
    (FrameType.EXIT, exit_obj(code=True)),
    (FrameType.EXIT, exit_obj(code=None, signal=True)),
    (FrameType.EXIT, exit_obj(lengths=[[1, True]])),
    (FrameType.ERROR, error_obj(code=True)),
    (FrameType.ERROR, error_obj(retry_after=True)),
]
WRONG_TYPES = [
    (FrameType.HELLO, hello_obj(versions=1)),
    (FrameType.HELLO, hello_obj(versions=[])),
    (FrameType.HELLO, hello_obj(versions=[1.0])),
    (FrameType.HELLO, hello_obj(versions=[0])),
    (FrameType.HELLO, hello_obj(versions=[65536])),
    (FrameType.HELLO, hello_obj(job_id="")),
    (FrameType.HELLO, hello_obj(job_id="a\nb")),
    (FrameType.HELLO, hello_obj(job_id="x" * 257)),
    (FrameType.HELLO, hello_obj(job_id=5)),
    (FrameType.HELLO, hello_obj(instance="a/b")),
    (FrameType.HELLO, hello_obj(instance="x" * 65)),
    (FrameType.HELLO, hello_obj(instance="")),
    (FrameType.HELLO, hello_obj(instance="abc\n")),
    (FrameType.HELLO, hello_obj(instance=None)),
    (FrameType.HELLO, hello_obj(host=None)),
    (FrameType.HELLO, hello_obj(host="h" * 256)),
    (FrameType.HELLO, hello_obj(user="a\x00b")),
    (FrameType.HELLO, hello_obj(command="cat")),
    (FrameType.HELLO, hello_obj(command=[1])),
    (FrameType.HELLO, hello_obj(command=None)),
    (FrameType.HELLO, hello_obj(streams={})),
    (FrameType.HELLO, hello_obj(streams=[[1, "stdout"]])),
    (FrameType.HELLO, hello_obj(streams=[[256, "stdout", "x"]])),
    (FrameType.HELLO, hello_obj(streams=[[-1, "stdout", "x"]])),
    (FrameType.HELLO, hello_obj(streams=[[1, "stdout", "x"], [1, "stderr", "y"]])),
    (FrameType.HELLO, hello_obj(streams=[[1, "tty", "x"]])),
    (FrameType.HELLO, hello_obj(streams=[[1, ["stdout"], "x"]])),
    (FrameType.HELLO, hello_obj(streams=[[1, "stdout", None]])),
    (FrameType.HELLO, hello_obj(streams=[[i, "stdout", str(i)] for i in range(17)])),
    (FrameType.WELCOME, welcome_obj(version="1")),
    (FrameType.WELCOME, welcome_obj(session=-1)),
    (FrameType.WELCOME, welcome_obj(session=1 << 64)),
    (FrameType.WELCOME, welcome_obj(session=1 << 63)),
    (FrameType.WELCOME, welcome_obj(heartbeat=0)),
    (FrameType.WELCOME, welcome_obj(heartbeat=86400)),
    (FrameType.WELCOME, welcome_obj(heartbeat=float("nan"))),
    (FrameType.WELCOME, welcome_obj(heartbeat=float("inf"))),
    (FrameType.WELCOME, welcome_obj(durable=None)),
    (FrameType.WELCOME, welcome_obj(durable=[[1, 2, 3]])),
    (FrameType.WELCOME, welcome_obj(durable=[[256, 0]])),
    (FrameType.WELCOME, welcome_obj(durable=[[1, 1 << 64]])),
    (FrameType.WELCOME, welcome_obj(durable=[[1, 1 << 63]])),
    (FrameType.WELCOME, welcome_obj(durable=[[1, 1.5]])),
    (FrameType.WELCOME, welcome_obj(durable=[[i, 0] for i in range(17)])),
    (FrameType.EXIT, exit_obj(code=256)),
    (FrameType.EXIT, exit_obj(code=-1)),
    (FrameType.EXIT, exit_obj(code="0")),
    (FrameType.EXIT, exit_obj(code=None, signal=0)),
    (FrameType.EXIT, exit_obj(code=None, signal=128)),
    (FrameType.EXIT, exit_obj(lengths=None)),
    (FrameType.EXIT, exit_obj(lengths=[[1, 1 << 63]])),
    (FrameType.EXIT, exit_obj(lengths=[[1, -1]])),
    (FrameType.EXIT, exit_obj(reason=None)),
    (FrameType.EXIT, exit_obj(reason="r" * 4097)),
    (FrameType.EXIT, exit_obj(summary={"k": "v"})),
    (FrameType.EXIT, exit_obj(summary=[["k"]])),
    (FrameType.EXIT, exit_obj(summary=[["k", 1]])),
    (FrameType.EXIT, exit_obj(summary=[["k" * 65, "v"]])),
    (FrameType.EXIT, exit_obj(summary=[["k", "v"]] * 65)),
    (FrameType.ERROR, error_obj(code="1")),
    (FrameType.ERROR, error_obj(code=1.0)),
    (FrameType.ERROR, error_obj(retry_after=-1)),
    (FrameType.ERROR, error_obj(retry_after=86400)),
    (FrameType.ERROR, error_obj(retry_after=float("nan"))),
    (FrameType.ERROR, error_obj(message=None)),
    (FrameType.ERROR, error_obj(message="a\x00")),
]


@pytest.mark.parametrize(
    "ftype, obj", BOOL_FOR_INT + WRONG_TYPES, ids=lambda x: x.name if isinstance(x, FrameType) else repr(x)[:60]
)
def test_malformed_control_frames_are_refused(ftype: FrameType, obj: dict[str, Any]) -> None:
    body = json.dumps(obj, allow_nan=True).encode()
    # The unmodified object is valid: the change alone is what is refused.
    with pytest.raises(RemoteProtocolError) as info:
        decode(ftype, body)
    assert info.value.code is ErrorCode.BAD_FRAME
    # And through a Connection in the right state, not just the bare codec.
    conn = Connection(Role.SHADOW) if ftype in (FrameType.HELLO, FrameType.EXIT) else agent_after_hello()
    if ftype is FrameType.EXIT:
        conn.receive_data(MAGIC + encode(HELLO))
        assert conn.next_event() == HELLO
        conn.send(WELCOME)
    conn.receive_data((MAGIC if ftype is FrameType.HELLO else b"") + HEADER.pack(len(body) + 1, ftype) + body)
    with pytest.raises(RemoteProtocolError):
        conn.next_event()


@pytest.mark.parametrize("make", [hello_obj, welcome_obj, exit_obj, error_obj])
def test_malformed_fixtures_are_valid_before_mutation(make: Callable[..., dict[str, Any]]) -> None:
    ftype = {hello_obj: FrameType.HELLO, welcome_obj: FrameType.WELCOME, exit_obj: FrameType.EXIT,
             error_obj: FrameType.ERROR}[make]
    assert isinstance(decode(ftype, json.dumps(make()).encode()), Event)


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"[]", b"null", b"1", b'"str"', b"\xff\xfe", b"{\"a\":1}}", b"{}" + b"\x00",
     b"[" * 60000, b'{"versions":' + b"1" * 5000 + b"}", b"{'single':1}"],
    ids=lambda b: repr(b[:20]),
)
@pytest.mark.parametrize("ftype", [FrameType.HELLO, FrameType.WELCOME, FrameType.EXIT, FrameType.ERROR])
def test_invalid_json_is_refused(ftype: FrameType, body: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode(ftype, body)
    assert info.value.code is ErrorCode.BAD_FRAME


def test_done_takes_any_json_object_but_nothing_else() -> None:
    assert decode(FrameType.DONE, b"{}") == Done()
    assert decode(FrameType.DONE, b'{"future":[1,2]}') == Done()
    for body in (b"", b"[]", b"x"):
        with pytest.raises(RemoteProtocolError):
            decode(FrameType.DONE, body)


@pytest.mark.parametrize(
    "ftype, body",
    [
        (FrameType.DATA, b""),
        (FrameType.DATA, b"\x01" * 8),  # shorter than stream + offset
        (FrameType.DATA, b"\x01" + b"\xff" * 8 + b"x"),  # runs past 2**64 - 1
        (FrameType.DATA, b"\x01" + struct.pack("!Q", 1 << 63)),  # past the largest file offset
        (FrameType.DATA, b"\x01" + struct.pack("!Q", MAX_OFFSET) + b"x"),
        (FrameType.ACK, b"\x01" + struct.pack("!Q", 1 << 63)),
        (FrameType.STDIN_READ, b"\x01" + struct.pack("!QI", 1 << 63, 1)),  # was answered INTERNAL by the shadow
        (FrameType.STDIN_READ, b"\x01" + struct.pack("!QI", U64, 1)),
        (FrameType.STDIN_READ, b"\x01" + struct.pack("!QI", MAX_OFFSET, 1)),  # pread refuses: EINVAL
        (FrameType.STDIN_DATA, b"\x01" + struct.pack("!QB", 1 << 63, 0)),
        (FrameType.STDIN_DATA, b"\x01" + struct.pack("!QB", MAX_OFFSET, 0) + b"x"),
        (FrameType.ACK, b"\x01" * 8),
        (FrameType.ACK, b"\x01" * 10),
        (FrameType.STDIN_READ, b"\x01" * 12),
        (FrameType.STDIN_READ, b"\x01" + bytes(8) + bytes(4)),  # max_bytes 0
        (FrameType.STDIN_READ, b"\x01" + bytes(8) + struct.pack("!I", MAX_PAYLOAD + 1)),
        (FrameType.STDIN_DATA, b"\x01" * 9),
        (FrameType.STDIN_DATA, b"\x01" + bytes(8) + b"\x02"),  # eof flag 2
        (FrameType.PING, b"\x00" * 7),
        (FrameType.PONG, b"\x00" * 9),
        (0, b"{}"),
        (12, b"{}"),
        (255, b""),
    ],
)
def test_malformed_binary_frames_are_refused(ftype: int, body: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        decode(ftype, body)
    assert info.value.code is ErrorCode.BAD_FRAME


def test_oversized_bodies_within_the_frame_limit() -> None:
    """A receiver with a larger max_frame still caps payloads and JSON bodies."""
    big = Connection(Role.AGENT, max_frame=4 * MAX_PAYLOAD)
    big.send(HELLO)
    body = json.dumps(welcome_obj(pad="x" * MAX_CONTROL)).encode()
    big.receive_data(HEADER.pack(len(body) + 1, FrameType.WELCOME) + body)
    with pytest.raises(RemoteProtocolError) as info:
        big.next_event()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    for ftype, head in ((FrameType.DATA, b"\x01" + bytes(8)), (FrameType.STDIN_DATA, b"\x01" + bytes(9))):
        with pytest.raises(RemoteProtocolError) as info:
            decode(ftype, head + bytes(MAX_PAYLOAD + 1))
        assert info.value.code is ErrorCode.FRAME_TOO_LARGE


@pytest.mark.parametrize("length", [1 << 30, (1 << 32) - 1, DEFAULT_MAX_FRAME + 1])
@pytest.mark.parametrize("role", [Role.SHADOW, Role.AGENT])
def test_frame_limit_enforced_from_the_header_alone(role: Role, length: int) -> None:
    conn = Connection(role) if role is Role.SHADOW else agent_after_hello()
    if role is Role.SHADOW:
        conn.receive_data(MAGIC)
        assert conn.next_event() is NEED_DATA
    header = HEADER.pack(length, FrameType.DATA)
    for i in range(4):
        conn.receive_data(header[i : i + 1])
        assert conn.next_event() is NEED_DATA
    conn.receive_data(header[4:])
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_event()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert conn.buffered == 5  # nothing of the body was needed, or held


def test_frame_of_exactly_the_limit_is_accepted() -> None:
    conn = Connection(Role.SHADOW, max_frame=120)
    conn.receive_data(MAGIC)
    conn.receive_data(HEADER.pack(120, FrameType.PING))
    assert conn.next_event() is NEED_DATA  # waits for the body rather than refusing
    small = Connection(Role.SHADOW, max_frame=120)
    small.receive_data(MAGIC + encode(Hello("j", "i", ())))
    assert isinstance(small.next_event(), Hello)
    small.send(WELCOME)
    small.receive_data(encode(Data(1, 0, bytes(110))))  # 1 + 9 + 110 = 120
    assert small.next_event() == Data(1, 0, bytes(110))
    small.receive_data(encode(Data(1, 110, bytes(111))))
    with pytest.raises(RemoteProtocolError) as info:
        small.next_event()
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_zero_length_frame_is_refused() -> None:
    conn = Connection(Role.SHADOW)
    conn.receive_data(MAGIC + HEADER.pack(0, FrameType.PING))
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_event()
    assert info.value.code is ErrorCode.BAD_FRAME


@pytest.mark.parametrize("junk", [b"G", b"GCWRAP\r\r", b"HTTP/1.1 200 OK\r\n", b"\x16\x03\x01\x02\x00", b"\x00" * 8])
def test_bad_magic_is_refused_at_the_first_wrong_byte(junk: bytes) -> None:
    conn = Connection(Role.SHADOW)
    bad_at = next((i for i, (a, b) in enumerate(zip(junk, MAGIC)) if a != b), None)
    for i in range(len(junk)):
        conn.receive_data(junk[i : i + 1])
        if bad_at is None or i < bad_at:
            assert conn.next_event() is NEED_DATA
        else:
            with pytest.raises(RemoteProtocolError, match="magic"):
                conn.next_event()
            return
    assert bad_at is None and junk == MAGIC[: len(junk)]


def test_eof_at_every_point_of_a_frame() -> None:
    stream = MAGIC + encode(HELLO)
    for cut in range(len(stream) + 1):
        conn = Connection(Role.SHADOW)
        conn.receive_data(stream[:cut])
        conn.receive_data(b"")
        if cut in (0, len(MAGIC)):  # nothing, or the magic alone: a clean end between frames
            assert conn.next_event() == ConnectionClosed()
        elif cut == len(stream):
            assert conn.next_event() == HELLO
            assert conn.next_event() == ConnectionClosed()
        else:
            with pytest.raises(RemoteProtocolError) as info:
                conn.next_event()
            assert info.value.code is ErrorCode.BAD_FRAME


def test_eof_mid_frame_on_the_agent_side() -> None:
    agent = agent_after_hello()
    frame = encode(WELCOME)
    agent.receive_data(frame[:-1])
    assert agent.next_event() is NEED_DATA
    agent.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a frame"):
        agent.next_event()


def test_data_after_eof_is_a_local_error() -> None:
    conn = Connection(Role.SHADOW)
    conn.receive_data(b"")
    conn.receive_data(b"")  # a second EOF is harmless
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"x")
    assert conn.next_event() == ConnectionClosed()


# -- (e) the state machine -------------------------------------------------------

# What each role may send in each state and where that leads, written out
# from the protocol's description rather than imported from it.
ALWAYS = {Ping: None, Pong: None, Error: State.CLOSED}  # None: the state stays
LEGAL: dict[Role, dict[State, dict[type[Event], State | None]]] = {
    A: {
        State.AWAIT_HELLO: {Hello: State.AWAIT_WELCOME, **ALWAYS},
        State.AWAIT_WELCOME: {**ALWAYS},
        State.AWAIT_AUTH: {Auth: State.AWAIT_WELCOME, **ALWAYS},
        State.STREAMING: {Data: None, StdinRead: None, Exit: State.EXITING, **ALWAYS},
        State.EXITING: {StdinRead: None, **ALWAYS},
        State.CLOSED: {},
    },
    S: {
        State.AWAIT_HELLO: {**ALWAYS},
        State.AWAIT_WELCOME: {Welcome: State.STREAMING, Challenge: State.AWAIT_AUTH, **ALWAYS},
        State.AWAIT_AUTH: {**ALWAYS},
        State.STREAMING: {Ack: None, StdinData: None, **ALWAYS},
        State.EXITING: {Ack: None, StdinData: None, Done: State.CLOSED, **ALWAYS},
        State.CLOSED: {},
    },
}
SAMPLES: list[Event] = [
    HELLO,
    Challenge("ab" * 16),
    Auth("cd" * 32),
    WELCOME,
    Data(1, 5, b"abc"),
    Ack(1, 3),
    StdinRead(0, 0, 10),
    StdinData(0, 0, b"in", False),
    EXIT,
    Done(),
    Ping(1),
    Pong(1),
    Error(ErrorCode.TIMEOUT, "bye"),
]
# A legal prefix of CONVERSATION that leaves both sides in each state.
PREFIX = {
    State.AWAIT_HELLO: 0, State.AWAIT_WELCOME: 1, State.AWAIT_AUTH: 2, State.STREAMING: STREAMING_AT,
    State.EXITING: EXITING_AT, State.CLOSED: len(CONVERSATION),
}


def test_prefixes_reach_their_states() -> None:
    for state, n in PREFIX.items():
        assert states_after(CONVERSATION[:n]) == (state, state)


@pytest.mark.parametrize("state", list(PREFIX))
@pytest.mark.parametrize("role", [A, S])
@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_send_in_every_state(role: Role, state: State, event: Event) -> None:
    pair = Pair()
    pair.run(CONVERSATION[: PREFIX[state]])
    conn = pair.conn(role)
    legal = LEGAL[role][state]
    if type(event) in legal:
        data = conn.send(event)
        assert data
        assert conn.state is (legal[type(event)] or state)
        assert pipe(data, pair.peer(role)) == [event]
        assert pair.peer(role).state is conn.state
    else:
        with pytest.raises(LocalProtocolError) as info:
            conn.send(event)
        assert info.value.code is ErrorCode.UNEXPECTED
        assert conn.state is state


@pytest.mark.parametrize("state", list(PREFIX))
@pytest.mark.parametrize("role", [A, S])
@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_receive_in_every_state(role: Role, state: State, event: Event) -> None:
    """`role` receives `event` from a peer that ignores the rules."""
    pair = Pair()
    pair.run(CONVERSATION[: PREFIX[state]])
    conn = pair.conn(role)
    peer_role = S if role is A else A
    legal = LEGAL[peer_role][state]
    frame = encode(event)
    if role is S and state is State.AWAIT_HELLO:
        frame = MAGIC + frame
    conn.receive_data(frame)
    if type(event) in legal:
        assert conn.next_event() == event
        assert conn.state is (legal[type(event)] or state)
    else:
        with pytest.raises(RemoteProtocolError) as info:
            conn.next_event()
        assert info.value.code is ErrorCode.UNEXPECTED
        assert conn.state is state


def test_data_before_hello() -> None:
    with pytest.raises(LocalProtocolError):
        Connection(Role.AGENT).send(Data(1, 0, b"x"))
    shadow = Connection(Role.SHADOW)
    shadow.receive_data(MAGIC + encode(Data(1, 0, b"x")))
    with pytest.raises(RemoteProtocolError) as info:
        shadow.next_event()
    assert info.value.code is ErrorCode.UNEXPECTED


def test_welcome_from_the_agent_and_hello_from_the_shadow() -> None:
    agent = Connection(Role.AGENT)
    agent.send(HELLO)
    with pytest.raises(LocalProtocolError):
        agent.send(WELCOME)
    shadow = Connection(Role.SHADOW)
    with pytest.raises(LocalProtocolError):
        shadow.send(HELLO)
    # A second HELLO is as wrong as a WELCOME from the agent.
    shadow.receive_data(MAGIC + encode(HELLO) + encode(HELLO))
    assert shadow.next_event() == HELLO
    with pytest.raises(RemoteProtocolError) as info:
        shadow.next_event()
    assert info.value.code is ErrorCode.UNEXPECTED


def test_ack_crosses_exit() -> None:
    """The shadow acknowledges bytes while the agent's EXIT is in flight."""
    pair = Pair()
    pair.run(CONVERSATION[:STREAMING_AT])
    exit_bytes = pair.agent.send(EXIT)
    assert pair.agent.state is State.EXITING
    ack_bytes = pair.shadow.send(Ack(1, 106))  # the shadow has not seen EXIT yet
    stdin_bytes = pair.shadow.send(StdinData(0, 0, b"late", True))
    assert pipe(ack_bytes + stdin_bytes, pair.agent) == [Ack(1, 106), StdinData(0, 0, b"late", True)]
    assert pipe(exit_bytes, pair.shadow) == [EXIT]
    assert pair.states() == (State.EXITING, State.EXITING)
    assert pair.send(S, Ack(2, 9)) == [Ack(2, 9)]
    assert pair.send(S, Done()) == [Done()]
    assert pair.states() == (State.CLOSED, State.CLOSED)
    with pytest.raises(LocalProtocolError):
        pair.agent.send(Data(1, 106, b"too late"))


@pytest.mark.parametrize("state", [s for s in PREFIX if s is not State.CLOSED])
def test_ping_pong_in_every_open_state(state: State) -> None:
    pair = Pair()
    pair.run(CONVERSATION[: PREFIX[state]])
    for role in (A, S):
        assert pair.send(role, Ping(99)) == [Ping(99)]
        other = S if role is A else A
        assert pair.send(other, Pong(99)) == [Pong(99)]
    assert pair.states() == (state, state)


def test_events_after_close_are_unexpected() -> None:
    pair = Pair()
    pair.run(CONVERSATION)
    pair.shadow.receive_data(encode(Ping(1)))
    with pytest.raises(RemoteProtocolError) as info:
        pair.shadow.next_event()
    assert info.value.code is ErrorCode.UNEXPECTED
    # Nothing buffered and no EOF yet: a closed connection just waits.
    assert pair.agent.next_event() is NEED_DATA


def test_error_hierarchy() -> None:
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert issubclass(LocalProtocolError, ProtocolError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)
    assert ProtocolError("x").code is ErrorCode.BAD_FRAME


# -- the "zstd" feature: ZDATA only where the handshake agreed on it ---------


def test_a_handshake_without_features_is_what_older_peers_sent() -> None:
    for event in (replace(HELLO, features=()), replace(WELCOME, features=(), files=())):
        assert b"features" not in encode(event)
    older_hello = encode(replace(HELLO, features=()))
    assert decode(older_hello[4], older_hello[5:]) == replace(HELLO, features=())


FEATURE_FRAMES = [
    ("zstd", ZData(1, 100, 10, b"zstd frame")),
    ("notes", Notes((Note(1.5e9, "stalled", (("seconds", 12.5),)),))),
    ("files", FileOpen(1, "a.json", 1)),
    ("files", FileData(1, 1, 0, b"x")),
    ("files", FileCopy(1, 2, 0, 0, 10)),
    ("files", FileCommit(1, 1, 1, "0" * 64)),
]


@pytest.mark.parametrize("feature, event", FEATURE_FRAMES,
                         ids=lambda v: type(v).__name__ if isinstance(v, Event) else v)
@pytest.mark.parametrize("welcomed", [(), ("later-1",), ("zstd", "notes", "files")])
def test_a_feature_s_frames_without_the_feature_are_refused_by_both_ends(feature: str, event: Event,
                                                                         welcomed: tuple[str, ...]) -> None:
    """ZDATA, NOTES and the file frames only where the WELCOME accepted
    their feature (offered by the agent, so only the WELCOME decides)."""
    welcomed = tuple(f for f in welcomed if f != feature)
    pair = Pair()
    pair.run([(A, replace(HELLO, features=("zstd", "notes", "files"))),
              (S, replace(WELCOME, features=welcomed, files=()))])
    with pytest.raises(LocalProtocolError) as sent:
        pair.agent.send(event)
    assert sent.value.code is ErrorCode.UNEXPECTED
    pair.shadow.receive_data(encode(event))
    with pytest.raises(RemoteProtocolError) as received:
        pair.shadow.next_event()
    assert received.value.code is ErrorCode.UNEXPECTED


@pytest.mark.parametrize(
    "body, why",
    [
        (struct.pack("!BQI", 1, 0, 0) + b"z", "size 0"),
        (struct.pack("!BQI", 1, 0, MAX_PAYLOAD + 1) + b"z", "size past the largest payload"),
        (struct.pack("!BQI", 1, 0, 10), "no zstd frame"),
        (struct.pack("!BQI", 1, MAX_OFFSET - 5, 10) + b"z", "past the largest offset"),
        (struct.pack("!BQ", 1, 0), "a short header"),
    ],
)
def test_malformed_zdata_is_a_bad_frame(body: bytes, why: str) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode(FrameType.ZDATA, body)
    assert e.value.code is ErrorCode.BAD_FRAME, why


@pytest.mark.parametrize("features", [["ZSTD"], ["a b"], "zstd", [1], ["x"] * 17, ["y" * 33]])
def test_malformed_features_are_a_bad_frame(features: Any) -> None:
    body = json.loads(encode(HELLO)[5:])
    body["features"] = features
    with pytest.raises(RemoteProtocolError) as e:
        decode(FrameType.HELLO, json.dumps(body).encode())
    assert e.value.code is ErrorCode.BAD_FRAME


# -- the "notes" feature: NOTES for the job's timeline, only where agreed ------


def test_notes_with_the_feature_cross_byte_by_byte_and_keep_their_types() -> None:
    pair = Pair(lambda d: [d[i : i + 1] for i in range(len(d))])
    pair.run([(A, replace(HELLO, features=("notes",))), (S, replace(WELCOME, features=("notes",), files=()))])
    sent = Notes((Note(1764000000.25, "connection_lost", (("reason", "reset"), ("after_s", 3), ("tls", False),
                                                         ("shadow", None), ("rate", 0.5))),
                  Note(1764000003.0, "reconnected", ())))
    (got,) = pair.send(A, sent)
    assert got == sent
    assert isinstance(got, Notes)
    assert [type(v) for _, v in got.notes[0].details] == [str, int, bool, type(None), float]


@pytest.mark.parametrize(
    "bad, why",
    [
        (Notes(()), "no note"),
        (Notes(tuple(Note(1.0, "x") for _ in range(65))), "too many"),
        (Notes((Note(float("nan"), "x"),)), "a time that is not a number"),
        (Notes((Note(-1.0, "x"),)), "a negative time"),
        (Notes((Note(1.0, "Stalled"),)), "a kind that is not an identifier"),
        (Notes((Note(1.0, "x" * 33),)), "a kind too long"),
        (Notes((Note(1.0, "x", (("k", float("inf")),)),)), "an infinite number"),
        (Notes((Note(1.0, "x", (("k", "v" * 513),)),)), "text too long"),
        (Notes((Note(1.0, "x", (("k", "a\x00b"),)),)), "a NUL"),
        (Notes((Note(1.0, "x", (("k", [1]),)),)), "a list"),  # type: ignore[arg-type]
        (Notes((Note(1.0, "x", (("k", 1), ("k", 2))),)), "a name twice"),
        (Notes((Note(1.0, "x", tuple((f"k{i}", i) for i in range(17))),)), "too many details"),
    ],
)
def test_the_encoder_refuses_notes_the_peer_would_refuse(bad: Notes, why: str) -> None:
    with pytest.raises(LocalProtocolError):
        encode(bad)
    if why == "a name twice":
        return  # (a JSON object names a member once: the peer cannot even receive it)
    body = json.dumps({"notes": [[n.time, n.kind, dict(n.details)] for n in bad.notes]}).encode()
    with pytest.raises(RemoteProtocolError) as e:
        decode(FrameType.NOTES, body)
    assert e.value.code in (ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE), why


@pytest.mark.parametrize("body", [b"{}", b'{"notes": 1}', b'{"notes": [[1, "x"]]}', b'{"notes": [[1, "x", []]]}',
                                  b'{"notes": [["1", "x", {}]]}', b'{"notes": [[true, "x", {}]]}',
                                  b'{"notes": [[1, "x", {"k": {"a": 1}}]]}', b"[]", b"\xff"])
def test_malformed_notes_are_a_bad_frame(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode(FrameType.NOTES, body)
    assert e.value.code is ErrorCode.BAD_FRAME
