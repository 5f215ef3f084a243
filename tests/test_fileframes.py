"""The frames of the files a job writes ("files" feature): FILE_OPEN,
FILE_DATA, FILE_COPY, FILE_COMMIT, FILE_ACK, and the `files` members of
WELCOME and EXIT. Round trips (hypothesis, whole and byte by byte, in random
orders), the encoder refuses what the peer would, malformed and random
bodies are a BAD_FRAME (or a frame too large), never anything else, and
neither end takes them where the handshake did not agree on the feature."""

from __future__ import annotations

import json
import struct
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_protocol import EXIT, HELLO, WELCOME, A, Pair, S

from gcwrap.wire.codec import MAX_OFFSET, MAX_PAYLOAD
from gcwrap.wire.events import (
    ErrorCode,
    Event,
    Exit,
    FileAck,
    FileCommit,
    FileCopy,
    FileData,
    FileHeld,
    FileOpen,
    Welcome,
)
from gcwrap.wire.fileframes import MAX_FILES, MAX_HANDLE
from gcwrap.wire.frames import FrameType, LocalProtocolError, RemoteProtocolError, decode, encode
from gcwrap.wire.protocol import Connection, Role, State

HANDLES = st.integers(1, MAX_HANDLE)
OFFSETS = st.integers(0, MAX_OFFSET)
NAMES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=60)


def _opens() -> st.SearchStrategy[FileOpen]:
    return st.builds(
        lambda f, v, name, base: FileOpen(f, name, v, base if base is None or base < v else None),
        HANDLES, HANDLES, NAMES, st.none() | HANDLES)


def _datas() -> st.SearchStrategy[FileData]:
    return st.builds(lambda f, v, off, payload: FileData(f, v, min(off, MAX_OFFSET - len(payload)), payload),
                     HANDLES, HANDLES, OFFSETS, st.binary(max_size=300))


def _copies() -> st.SearchStrategy[FileCopy]:
    def build(f: int, v: int, off: int, src: int, length: int) -> FileCopy:
        return FileCopy(f, v, min(off, MAX_OFFSET - length), min(src, MAX_OFFSET - length), length)
    return st.builds(build, HANDLES, HANDLES, OFFSETS, OFFSETS, st.integers(1, 1 << 40))


def _commits() -> st.SearchStrategy[FileCommit]:
    return st.builds(FileCommit, HANDLES, HANDLES, OFFSETS, st.text("0123456789abcdef", min_size=64, max_size=64))


def _acks() -> st.SearchStrategy[FileAck]:
    return st.builds(FileAck, HANDLES, HANDLES, OFFSETS, st.booleans())


AGENT_EVENTS = st.one_of(_opens(), _datas(), _copies(), _commits())


def _streaming(chunker: object = None) -> Pair:
    pair = Pair(chunker) if chunker else Pair()  # type: ignore[arg-type]
    pair.run([(A, replace(HELLO, features=("files",))), (S, replace(WELCOME, features=("files",)))])
    return pair


@settings(max_examples=150, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from([A, S]), st.data()), min_size=1, max_size=12),
       byte_by_byte=st.booleans())
def test_file_frames_cross_in_any_order_whole_or_byte_by_byte(events: list[tuple[Role, st.DataObject]],
                                                            byte_by_byte: bool) -> None:
    pair = _streaming((lambda d: [d[i : i + 1] for i in range(len(d))]) if byte_by_byte else None)
    for role, data in events:
        event: Event = data.draw(AGENT_EVENTS if role is A else _acks())
        assert pair.send(role, event) == [event]
    assert pair.states() == (State.STREAMING, State.STREAMING)


@settings(max_examples=100, deadline=None)
@given(held=st.lists(st.builds(lambda f, v, d, c: FileHeld(f, v, d, min(c, d) if c >= 0 else -1),
                               HANDLES, HANDLES, OFFSETS, st.integers(-1, MAX_OFFSET)),
                     max_size=20, unique_by=lambda h: h.file),
       final=st.lists(st.tuples(HANDLES, HANDLES, OFFSETS), max_size=20, unique_by=lambda t: t[0]))
def test_what_home_holds_and_the_final_versions_round_trip(held: list[FileHeld],
                                                           final: list[tuple[int, int, int]]) -> None:
    pair = Pair()
    welcome = replace(WELCOME, features=("files",), files=tuple(held))
    exit_ = replace(EXIT, files=tuple(final))
    hello = replace(HELLO, features=("files",))
    assert pair.run([(A, hello), (S, welcome), (A, exit_)]) == [hello, welcome, exit_]


def test_a_handshake_without_files_is_what_older_peers_sent() -> None:
    for event in (replace(WELCOME, files=()), replace(EXIT, files=())):
        assert b'"files":' not in encode(event)
    old = encode(replace(EXIT, files=()))
    assert decode(old[4], old[5:]) == replace(EXIT, files=())


def test_an_exit_listing_files_and_a_file_ack_need_the_feature_too() -> None:
    pair = Pair()
    pair.run([(A, replace(HELLO, features=())), (S, replace(WELCOME, features=(), files=()))])
    with pytest.raises(LocalProtocolError):
        pair.shadow.send(FileAck(1, 1, 5))
    agent = Connection(Role.AGENT)
    agent.send(replace(HELLO, features=()))
    agent.receive_data(encode(replace(WELCOME, features=(), files=())))
    agent.next_event()
    agent.receive_data(encode(FileAck(1, 1, 5)))
    with pytest.raises(RemoteProtocolError):
        agent.next_event()
    exit_ = replace(EXIT, files=((1, 1, 5),))
    with pytest.raises(LocalProtocolError):
        pair.agent.send(exit_)
    pair.shadow.receive_data(encode(exit_))
    with pytest.raises(RemoteProtocolError):
        pair.shadow.next_event()


def test_a_welcome_holding_files_without_the_feature_is_malformed() -> None:
    welcome = replace(WELCOME, features=("zstd",), files=(FileHeld(1, 1, 10, 10),))
    with pytest.raises(LocalProtocolError):
        encode(welcome)
    body = json.loads(encode(replace(welcome, files=()))[5:])
    body["files"] = [[1, 1, 10, 10]]
    with pytest.raises(RemoteProtocolError) as e:
        decode(FrameType.WELCOME, json.dumps(body).encode())
    assert e.value.code is ErrorCode.BAD_FRAME


def _open_body(e: FileOpen) -> dict[str, object]:
    return {"file": e.file, "name": e.name, "version": e.version, "base": e.base}


@pytest.mark.parametrize("bad, body", [
    (FileOpen(0, "a", 1), None),
    (FileOpen(1, "a", 0), None),
    (FileOpen(MAX_HANDLE + 1, "a", 1), None),
    (FileOpen(1, "a", 2, base=2), None),
    (FileOpen(1, "a", 2, base=0), None),
    (FileOpen(1, "", 1), None),
    (FileOpen(1, "a\x00b", 1), None),
    (FileOpen(1, "a" * 4097, 1), None),
    (FileData(0, 1, 0, b"x"), struct.pack("!IIQ", 0, 1, 0) + b"x"),
    (FileData(1, 1, MAX_OFFSET, b"x"), struct.pack("!IIQ", 1, 1, MAX_OFFSET) + b"x"),
    (FileData(1, 1, 0, b"x" * (MAX_PAYLOAD + 1)), None),
    (FileCopy(1, 1, 0, 0, 0), struct.pack("!IIQQQ", 1, 1, 0, 0, 0)),
    (FileCopy(1, 1, MAX_OFFSET, 0, 1), struct.pack("!IIQQQ", 1, 1, MAX_OFFSET, 0, 1)),
    (FileCopy(1, 1, 0, MAX_OFFSET, 1), struct.pack("!IIQQQ", 1, 1, 0, MAX_OFFSET, 1)),
    (FileCommit(1, 1, 5, "AB" * 32), None),
    (FileCommit(1, 1, 5, "ab" * 31), None),
    (FileCommit(1, 1, MAX_OFFSET + 1, "ab" * 32), None),
    (FileAck(1, 0, 5), struct.pack("!IIQB", 1, 0, 5, 0)),
    (FileAck(1, 1, MAX_OFFSET + 1), struct.pack("!IIQB", 1, 1, MAX_OFFSET + 1, 0)),
])
def test_the_encoder_refuses_what_the_peer_would(bad: Event, body: bytes | None) -> None:
    with pytest.raises(LocalProtocolError):
        encode(bad)
    if isinstance(bad, FileOpen):
        body = json.dumps(_open_body(bad)).encode()
        ftype = FrameType.FILE_OPEN
    elif isinstance(bad, FileCommit):
        body = json.dumps({"file": bad.file, "version": bad.version, "size": bad.size, "sha256": bad.sha256}).encode()
        ftype = FrameType.FILE_COMMIT
    elif body is None:
        body = struct.pack("!IIQ", 1, 1, 0) + b"x" * (MAX_PAYLOAD + 1)
        ftype = FrameType.FILE_DATA
    else:
        ftype = {FileData: FrameType.FILE_DATA, FileCopy: FrameType.FILE_COPY, FileAck: FrameType.FILE_ACK}[type(bad)]
    with pytest.raises(RemoteProtocolError) as e:
        decode(ftype, body)
    assert e.value.code in (ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE)


@pytest.mark.parametrize("ftype, body", [
    (FrameType.FILE_OPEN, b"{}"),
    (FrameType.FILE_OPEN, b'{"file": 1, "name": "a", "version": true, "base": null}'),
    (FrameType.FILE_OPEN, b'{"file": 1.0, "name": "a", "version": 1, "base": null}'),
    (FrameType.FILE_OPEN, b'{"file": 1, "name": "a", "version": 2, "base": "1"}'),
    (FrameType.FILE_OPEN, b'{"file": 1, "name": 7, "version": 1}'),
    (FrameType.FILE_OPEN, b'{"file": 1, "name": "\\udce9", "version": 1}'),
    (FrameType.FILE_COMMIT, b'{"file": 1, "version": 1, "size": -1, "sha256": "' + b"a" * 64 + b'"}'),
    (FrameType.FILE_COMMIT, b'{"file": 1, "version": 1, "size": 1}'),
    (FrameType.FILE_COMMIT, b"[]"),
    (FrameType.FILE_DATA, b"\x00" * 15),
    (FrameType.FILE_COPY, b"\x00" * 31),
    (FrameType.FILE_COPY, struct.pack("!IIQQQ", 1, 1, 0, 0, 1) + b"\x00"),
    (FrameType.FILE_ACK, struct.pack("!IIQB", 1, 1, 0, 2)),
    (FrameType.FILE_ACK, b"\xff"),
])
def test_malformed_file_frames_are_a_bad_frame(ftype: FrameType, body: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as e:
        decode(ftype, body)
    assert e.value.code is ErrorCode.BAD_FRAME


@pytest.mark.parametrize("key, value", [
    ("files", [[1, 1, 10, 11]]),  # committed past durable
    ("files", [[1, 1, 10, -2]]),
    ("files", [[1, 1, 10, 5], [1, 2, 10, 5]]),  # a file twice
    ("files", [[0, 1, 10, 5]]),
    ("files", [[1, 1, 10]]),
    ("files", {"1": 1}),
    ("files", [[1, 1, 10, 5]] * (MAX_FILES + 1)),
])
def test_malformed_files_in_a_welcome_are_a_bad_frame(key: str, value: object) -> None:
    body = json.loads(encode(replace(WELCOME, files=()))[5:])
    body[key] = value
    with pytest.raises(RemoteProtocolError) as e:
        decode(FrameType.WELCOME, json.dumps(body).encode())
    assert e.value.code in (ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE)


@pytest.mark.parametrize("value", [[[1, 1, -1]], [[1, 1, 5], [1, 2, 6]], [[1, 0, 5]], [[1, 1]], "x"])
def test_malformed_files_in_an_exit_are_a_bad_frame(value: object) -> None:
    body = json.loads(encode(EXIT)[5:])
    body["files"] = value
    with pytest.raises(RemoteProtocolError) as e:
        decode(FrameType.EXIT, json.dumps(body).encode())
    assert e.value.code is ErrorCode.BAD_FRAME


def test_the_encoder_refuses_a_file_listed_twice_or_committed_past_its_bytes() -> None:
    with pytest.raises(LocalProtocolError):
        encode(replace(EXIT, files=((1, 1, 5), (1, 2, 6))))
    with pytest.raises(LocalProtocolError):
        encode(Welcome(1, 1, (), features=("files",), files=(FileHeld(1, 1, 5, 6),)))
    with pytest.raises(LocalProtocolError):
        encode(replace(EXIT, files=tuple((i, 1, 0) for i in range(1, MAX_FILES + 2))))


@settings(max_examples=400, deadline=None)
@given(ftype=st.sampled_from([FrameType.FILE_OPEN, FrameType.FILE_DATA, FrameType.FILE_COPY,
                              FrameType.FILE_COMMIT, FrameType.FILE_ACK]),
       body=st.binary(max_size=80))
def test_random_bodies_are_refused_or_decode_to_what_encodes_back(ftype: FrameType, body: bytes) -> None:
    """Garbage: a BAD_FRAME, or (a binary frame) an event whose frame is the
    same bytes; never another exception."""
    try:
        event = decode(ftype, body)
    except RemoteProtocolError as e:
        assert e.code in (ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE)
        return
    if ftype in (FrameType.FILE_DATA, FrameType.FILE_COPY, FrameType.FILE_ACK):
        assert encode(event)[5:] == body
    else:
        assert decode(ftype, encode(event)[5:]) == event


def test_an_exit_with_files_crosses_file_acks_sent_before_it() -> None:
    pair = _streaming()
    pair.run([(A, FileOpen(3, "t.log", 1)), (A, FileData(3, 1, 0, b"abc"))])
    exit_ = replace(EXIT, files=((3, 1, 3),))
    assert pair.send(A, exit_) == [exit_]
    assert pair.send(S, FileAck(3, 1, 3, committed=True)) == [FileAck(3, 1, 3, True)]
    assert pair.states() == (State.EXITING, State.EXITING)
    with pytest.raises(LocalProtocolError):
        pair.agent.send(FileData(3, 1, 3, b"late"))


def test_events_compare_by_value_for_exits_without_files() -> None:
    # (an EXIT that lists no files is the EXIT older agents sent)
    assert Exit(0, None, ((1, 5),)) == replace(Exit(0, None, ((1, 5),)), files=())
