"""The frames of the gcwrap wire protocol: events to bytes and back.

Frames are `u32 length | u8 type | body`, length counting type and body.
Control frames (HELLO, WELCOME, EXIT, DONE, ERROR, CHALLENGE, AUTH, NOTES)
carry a JSON object; the hot frames (DATA, ZDATA, ACK, STDIN_*, PING, PONG) are fixed
binary structs. Offsets and lengths are u64 on the wire, and at most
2**63 - 1 (MAX_OFFSET) together with the bytes they cover, as a file offset
is. `encode` turns one event into one frame, `decode` one frame body into
one event, each checking every field; which frames are legal when is
`gcwrap.wire.protocol.Connection`'s business, not theirs.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable
from typing import Any, cast

from . import fileframes
from .codec import DEFAULT_MAX_FRAME as DEFAULT_MAX_FRAME
from .codec import HEADER as HEADER
from .codec import MAX_CONTROL as MAX_CONTROL
from .codec import MAX_OFFSET as MAX_OFFSET
from .codec import MAX_PAYLOAD as MAX_PAYLOAD
from .codec import FrameType as FrameType
from .codec import LocalProtocolError as LocalProtocolError
from .codec import ProtocolError as ProtocolError
from .codec import RemoteProtocolError as RemoteProtocolError
from .codec import TruncatedFrame as TruncatedFrame
from .codec import bad as _bad
from .codec import check_offset as _check_offset
from .codec import fixed as _fixed
from .codec import frame as _frame
from .codec import get as _get
from .codec import is_int as _is_int
from .codec import is_unicode as _is_unicode
from .codec import json_body as _json_body
from .codec import load_json as _load_json
from .codec import text as _text
from .events import (
    FILES_FEATURE,
    STREAM_KINDS,
    Ack,
    Auth,
    Challenge,
    Data,
    Done,
    Error,
    ErrorCode,
    Event,
    Exit,
    Hello,
    Note,
    Notes,
    NoteValue,
    Ping,
    Pong,
    StdinData,
    StdinRead,
    StreamSpec,
    Welcome,
    ZData,
)

_DATA = struct.Struct("!BQ")
_ACK = struct.Struct("!BQ")
_STDIN_READ = struct.Struct("!BQI")
_STDIN_DATA = struct.Struct("!BQB")
_NONCE = struct.Struct("!Q")
_ZDATA = struct.Struct("!BQI")  # stream, offset, size in the job's bytes; the zstd frame follows
_FEATURE_RE = re.compile(r"[a-z0-9-]{1,32}\Z")
_MAX_FEATURES = 16
DATA_TYPE = 3  # FrameType.DATA, as the int the header holds

_INSTANCE_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
MAX_NOTES = 64  # notes in one NOTES frame
_NOTE_KIND_RE = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")  # a note's kind, and its details' names
_MAX_DETAILS = 16
_MAX_DETAIL_TEXT = 512
_MAX_JOB_ID = 256
_MAX_NAME = 4096
_MAX_STREAMS = 16






_DATA_HEADER = struct.Struct("!IBBQ")  # HEADER then _DATA: a DATA frame up to its payload


def data_header(stream: int, offset: int, size: int) -> bytes:
    """The bytes of a DATA frame that come before its `size`-byte payload
    (a sender may write the payload after it without joining the two)."""
    return _DATA_HEADER.pack(1 + _DATA.size + size, DATA_TYPE, stream, offset)


_HEX_RE = re.compile(r"[0-9a-f]{0,128}\Z")


def _hex_field(value: str, what: str) -> str:
    if not isinstance(value, str) or not _HEX_RE.match(value):
        raise LocalProtocolError(f"{what} must be at most 128 lowercase hex digits")
    return value


def _hex(obj: dict[str, Any], key: str, ftype: FrameType) -> str:
    value = obj.get(key, "")
    if not isinstance(value, str) or not _HEX_RE.match(value):
        raise _bad(f"{ftype.name}: {key!r} must be at most 128 lowercase hex digits")
    return value


def _check_pairs(pairs: tuple[tuple[int, int], ...], what: str) -> None:
    if len(pairs) > _MAX_STREAMS:
        raise LocalProtocolError(f"{what}: at most {_MAX_STREAMS} streams")
    for sid, length in pairs:
        if not 0 <= sid <= 255:
            raise LocalProtocolError(f"{what}: stream id {sid} out of range")
        _check_offset(length, f"{what}: length")


def encode(event: Event) -> bytes:
    """One frame for `event` (no state checks; see Connection.send)."""
    try:
        return _encode(event)
    except struct.error as e:  # a stream id, nonce or count out of its field's range
        raise LocalProtocolError(f"cannot encode {type(event).__name__}: {e}") from None


def _encode(event: Event) -> bytes:
    encoder = _ENCODERS.get(type(event))
    if encoder is None:
        raise LocalProtocolError(f"cannot encode {event!r}")
    return encoder(event)


def data_head(stream: int, offset: int, size: int) -> bytes:
    """`data_header`, checked as a DATA frame with a `size`-byte payload is
    (LocalProtocolError if a field is out of range)."""
    _check_offset(offset, "offset")
    _check_offset(offset + size, "end offset")
    if size > MAX_PAYLOAD:
        raise LocalProtocolError("DATA payload too large")
    try:
        return data_header(stream, offset, size)
    except struct.error as e:
        raise LocalProtocolError(f"cannot encode Data: {e}") from None


def _encode_data(event: Data) -> bytes:
    # One copy of the payload, not two (header + body, then frame + body).
    return b"".join((data_head(event.stream, event.offset, len(event.payload)), event.payload))


def _encode_zdata(event: ZData) -> bytes:
    _check_offset(event.offset, "offset")
    _check_offset(event.offset + event.size, "end offset")
    if not 0 < event.size <= MAX_PAYLOAD or not 0 < len(event.payload) <= MAX_PAYLOAD:
        raise LocalProtocolError("ZDATA size or payload out of range")
    return _frame(FrameType.ZDATA, _ZDATA.pack(event.stream, event.offset, event.size) + event.payload)


def _encode_ack(event: Ack) -> bytes:
    _check_offset(event.offset, "offset")
    return _frame(FrameType.ACK, _ACK.pack(event.stream, event.offset))


def _encode_stdin_read(event: StdinRead) -> bytes:
    _check_offset(event.offset, "offset")
    if not 0 < event.max_bytes <= MAX_PAYLOAD:
        raise LocalProtocolError(f"STDIN_READ: max_bytes must be 1..{MAX_PAYLOAD}")
    _check_offset(event.offset + event.max_bytes, "end offset")
    return _frame(FrameType.STDIN_READ, _STDIN_READ.pack(event.stream, event.offset, event.max_bytes))


def _encode_stdin_data(event: StdinData) -> bytes:
    _check_offset(event.offset, "offset")
    _check_offset(event.offset + len(event.payload), "end offset")
    if len(event.payload) > MAX_PAYLOAD:
        raise LocalProtocolError("STDIN_DATA payload too large")
    head = _STDIN_DATA.pack(event.stream, event.offset, int(event.eof))
    return _frame(FrameType.STDIN_DATA, head + event.payload)


def _encode_hello(event: Hello) -> bytes:
    return _frame(FrameType.HELLO, _json_body({
        "versions": list(event.versions),
        "job_id": event.job_id,
        "instance": event.instance,
        "host": event.host,
        "user": event.user,
        "command": list(event.command),
        "streams": [[s.id, s.kind, s.name] for s in event.streams],
        "nonce": event.nonce,
        **_features_field(event.features),
    }))


def _encode_welcome(event: Welcome) -> bytes:
    _check_offset(event.session, "session")
    if event.files and FILES_FEATURE not in event.features:
        raise LocalProtocolError("WELCOME: files held, but the \"files\" feature not accepted")
    _check_pairs(event.durable, "WELCOME")
    return _frame(FrameType.WELCOME, _json_body({
        "version": event.version,
        "session": event.session,
        "durable": [list(p) for p in event.durable],
        "heartbeat": event.heartbeat,
        "proof": event.proof,
        **_features_field(event.features),
        **fileframes.held_member(event.files),
    }))


def _encode_exit(event: Exit) -> bytes:
    _check_pairs(event.lengths, "EXIT")
    return _frame(FrameType.EXIT, _json_body({
        "code": event.code,
        "signal": event.signal,
        "lengths": [list(p) for p in event.lengths],
        "reason": event.reason,
        "summary": [list(p) for p in event.summary],
        **fileframes.final_member(event.files),
    }))


def _encode_notes(event: Notes) -> bytes:
    if not 0 < len(event.notes) <= MAX_NOTES:
        raise LocalProtocolError(f"NOTES holds 1 to {MAX_NOTES} notes, not {len(event.notes)}")
    for note in event.notes:
        _check_note(note, LocalProtocolError)
    return _frame(FrameType.NOTES, _json_body(
        {"notes": [[n.time, n.kind, dict(n.details)] for n in event.notes]}))


def _check_note(note: Note, error: type[ProtocolError]) -> None:
    """Raise `error` unless `note` is one the protocol carries: a finite,
    non-negative time, a kind and detail names that are short identifiers,
    at most _MAX_DETAILS details whose values are null, a boolean, a finite
    number or short text."""
    if not isinstance(note.time, (int, float)) or isinstance(note.time, bool) or not (
            math.isfinite(note.time) and note.time >= 0):
        raise error("NOTES: a note's time must be a finite Unix time", ErrorCode.BAD_FRAME)
    if not isinstance(note.kind, str) or not _NOTE_KIND_RE.match(note.kind):
        raise error("NOTES: a note's kind must be a short identifier", ErrorCode.BAD_FRAME)
    if len(note.details) > _MAX_DETAILS or len({k for k, _ in note.details}) != len(note.details):
        raise error(f"NOTES: a note holds at most {_MAX_DETAILS} details, each named once", ErrorCode.BAD_FRAME)
    for key, value in note.details:
        if not isinstance(key, str) or not _NOTE_KIND_RE.match(key):
            raise error("NOTES: a detail's name must be a short identifier", ErrorCode.BAD_FRAME)
        if not _note_value(value):
            raise error(f"NOTES: detail {key!r} must be null, a boolean, a finite number or text of at most "
                        f"{_MAX_DETAIL_TEXT} characters", ErrorCode.BAD_FRAME)


def _note_value(value: NoteValue) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) <= MAX_OFFSET
    if isinstance(value, float):
        return math.isfinite(value)
    return (isinstance(value, str) and len(value) <= _MAX_DETAIL_TEXT and "\x00" not in value
            and _is_unicode(value))


def _decode_notes(obj: dict[str, Any]) -> Notes:
    raw = obj.get("notes")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_NOTES:
        raise _bad(f"NOTES: 'notes' must list 1 to {MAX_NOTES} notes")
    notes = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[2], dict):
            raise _bad("NOTES: a note is [time, kind, {details}]")
        note = Note(item[0], item[1], tuple(item[2].items()))
        _check_note(note, RemoteProtocolError)
        notes.append(Note(float(note.time), note.kind, note.details))
    return Notes(tuple(notes))


def _encode_error(event: Error) -> bytes:
    return _frame(FrameType.ERROR, _json_body(
        {"code": int(event.code), "message": event.message, "retry_after": event.retry_after}))


# How each event becomes a frame (the type, exactly: events are final).
_ENCODERS: dict[type[Event], Callable[[Any], bytes]] = {
    Data: _encode_data,
    ZData: _encode_zdata,
    Ack: _encode_ack,
    StdinRead: _encode_stdin_read,
    StdinData: _encode_stdin_data,
    Ping: lambda e: _frame(FrameType.PING, _NONCE.pack(e.nonce)),
    Pong: lambda e: _frame(FrameType.PONG, _NONCE.pack(e.nonce)),
    Hello: _encode_hello,
    Welcome: _encode_welcome,
    Exit: _encode_exit,
    Done: lambda e: _frame(FrameType.DONE, b"{}"),
    Challenge: lambda e: _frame(FrameType.CHALLENGE, _json_body({"nonce": _hex_field(e.nonce, "nonce")})),
    Auth: lambda e: _frame(FrameType.AUTH, _json_body({"mac": _hex_field(e.mac, "mac")})),
    Error: _encode_error,
    Notes: _encode_notes,
    **fileframes.ENCODERS,
}


def _features_field(features: tuple[str, ...]) -> dict[str, Any]:
    """`features` as a JSON member, left out when there are none, so a
    handshake without them is byte for byte what older peers sent."""
    for f in features:
        if not _FEATURE_RE.match(f):
            raise LocalProtocolError(f"bad feature name {f!r}")
    if len(features) > _MAX_FEATURES:
        raise LocalProtocolError("too many features")
    return {"features": list(features)} if features else {}


def _features(obj: dict[str, Any], ftype: FrameType) -> tuple[str, ...]:
    """The `features` member: names a newer peer may add and this one does
    not know are kept (and then ignored by whoever acts on them)."""
    value = obj.get("features", [])
    if (
        not isinstance(value, list)
        or len(value) > _MAX_FEATURES
        or not all(isinstance(f, str) and _FEATURE_RE.match(f) for f in value)
    ):
        raise _bad(f"{ftype.name}: 'features' must list at most {_MAX_FEATURES} names of [a-z0-9-]")
    return tuple(value)


def _pairs(value: Any, ftype: FrameType, key: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list) or len(value) > _MAX_STREAMS:
        raise _bad(f"{ftype.name}: {key!r} must be a short list")
    out = []
    for item in value:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not all(_is_int(v) for v in item)
            or not 0 <= item[0] <= 255
            or not 0 <= item[1] <= MAX_OFFSET
        ):
            raise _bad(f"{ftype.name}: {key!r} holds a bad (stream, length) pair")
        out.append((item[0], item[1]))
    return tuple(out)


def _decode_hello(obj: dict[str, Any]) -> Hello:
    f = FrameType.HELLO
    versions = _get(obj, "versions", list, f)
    if not versions or len(versions) > 16 or not all(_is_int(v) and 0 < v < 65536 for v in versions):
        raise _bad("HELLO: 'versions' must list protocol versions")
    job_id = _text(obj.get("job_id"), _MAX_JOB_ID, f, "job_id")
    if not job_id or not job_id.isprintable():
        raise _bad("HELLO: 'job_id' must be non-empty printable text")
    instance = _text(obj.get("instance"), 64, f, "instance")
    if not _INSTANCE_RE.match(instance):
        raise _bad("HELLO: 'instance' must be 1-64 characters of [A-Za-z0-9_.-]")
    command = _get(obj, "command", list, f)
    if len(command) > 4096 or not all(isinstance(a, str) and _is_unicode(a) for a in command):
        raise _bad("HELLO: 'command' must be a list of strings")
    raw_streams = _get(obj, "streams", list, f)
    if len(raw_streams) > _MAX_STREAMS:
        raise _bad(f"HELLO: at most {_MAX_STREAMS} streams")
    streams = []
    seen: set[int] = set()
    for item in raw_streams:
        if not isinstance(item, list) or len(item) != 3:
            raise _bad("HELLO: a stream must be [id, kind, name]")
        sid, kind, name = item
        if not _is_int(sid) or not 0 <= sid <= 255 or sid in seen:
            raise _bad("HELLO: stream ids must be distinct integers 0..255")
        if kind not in STREAM_KINDS:
            raise _bad(f"HELLO: unknown stream kind {kind!r}")
        seen.add(sid)
        streams.append(StreamSpec(sid, kind, _text(name, _MAX_NAME, f, "name")))
    return Hello(
        job_id=job_id,
        instance=instance,
        streams=tuple(streams),
        host=_text(obj.get("host", ""), 255, f, "host"),
        user=_text(obj.get("user", ""), 255, f, "user"),
        command=tuple(command),
        versions=tuple(versions),
        nonce=_hex(obj, "nonce", f),
        features=_features(obj, f),
    )


def _decode_exit(obj: dict[str, Any]) -> Exit:
    f = FrameType.EXIT
    code, sig = obj.get("code"), obj.get("signal")
    if not (code is None or (_is_int(code) and 0 <= code <= 255)):
        raise _bad("EXIT: 'code' must be null or 0..255")
    if not (sig is None or (_is_int(sig) and 0 < sig < 128)):
        raise _bad("EXIT: 'signal' must be null or 1..127")
    summary_raw = obj.get("summary", [])
    if not isinstance(summary_raw, list) or len(summary_raw) > 64:
        raise _bad("EXIT: 'summary' must be a short list")
    summary = []
    for item in summary_raw:
        if not isinstance(item, list) or len(item) != 2:
            raise _bad("EXIT: 'summary' holds [key, value] pairs")
        summary.append((_text(item[0], 64, f, "summary"), _text(item[1], 1024, f, "summary")))
    return Exit(
        code=code,
        signal=sig,
        lengths=_pairs(obj.get("lengths"), f, "lengths"),
        reason=_text(obj.get("reason", ""), 4096, f, "reason"),
        summary=tuple(summary),
        files=fileframes.decode_final(obj, f),
    )


def _decode_json_frame(ftype: FrameType, body: bytes | memoryview) -> Event:
    obj = _load_json(body, ftype)
    if ftype is FrameType.HELLO:
        return _decode_hello(obj)
    if ftype is FrameType.WELCOME:
        version = _get(obj, "version", int, ftype)
        session = _get(obj, "session", int, ftype)
        heartbeat = obj.get("heartbeat", 10.0)
        if not isinstance(heartbeat, (int, float)) or isinstance(heartbeat, bool) or not 0 < heartbeat < 86400:
            raise _bad("WELCOME: 'heartbeat' must be a positive number of seconds")
        if not 0 <= session <= MAX_OFFSET:
            raise _bad("WELCOME: 'session' out of range")
        features = _features(obj, ftype)
        files = fileframes.decode_held(obj, ftype)
        if files and FILES_FEATURE not in features:
            raise _bad("WELCOME: 'files' without the \"files\" feature")
        return Welcome(
            version, session, _pairs(obj.get("durable"), ftype, "durable"), float(heartbeat),
            _hex(obj, "proof", ftype), features, files,
        )
    if ftype is FrameType.CHALLENGE:
        nonce = _hex(obj, "nonce", ftype)
        if len(nonce) < 32:
            raise _bad("CHALLENGE: 'nonce' must have at least 32 hex digits")
        return Challenge(nonce)
    if ftype is FrameType.AUTH:
        return Auth(_hex(obj, "mac", ftype))
    if ftype is FrameType.EXIT:
        return _decode_exit(obj)
    if ftype is FrameType.DONE:
        return Done()
    if ftype is FrameType.NOTES:
        return _decode_notes(obj)
    # ERROR
    raw_code = _get(obj, "code", int, ftype)
    try:
        code = ErrorCode(raw_code)
    except ValueError:
        code = ErrorCode.INTERNAL  # a code from a newer peer: keep the message
    retry_after = obj.get("retry_after", 0.0)
    if not isinstance(retry_after, (int, float)) or isinstance(retry_after, bool) or not 0 <= retry_after < 86400:
        raise _bad("ERROR: 'retry_after' must be a number of seconds")
    return Error(code, _text(obj.get("message", ""), MAX_CONTROL, ftype, "message"), float(retry_after))


DATA_HEAD = HEADER.size + _DATA.size  # the bytes of a DATA frame before its payload


def decode_data_head(body_length: int, head: bytes | memoryview) -> tuple[int, int, int]:
    """(stream, offset, payload size) of a DATA frame whose body is
    `body_length` bytes, from the body's first bytes (`head`, at least
    _DATA.size of them unless the body is shorter), or RemoteProtocolError:
    everything a DATA frame is checked for, known before its payload."""
    if body_length < _DATA.size:
        raise _bad(f"DATA frame has the wrong length ({body_length} bytes)")
    stream, offset = _DATA.unpack_from(head)
    size = body_length - _DATA.size
    if size > MAX_PAYLOAD:
        raise RemoteProtocolError("DATA payload too large", ErrorCode.FRAME_TOO_LARGE)
    if offset + size > MAX_OFFSET:
        raise _bad("DATA runs past the largest offset")
    return stream, offset, size


def decode_data(body: bytes | memoryview) -> Data:
    stream, offset, _ = decode_data_head(len(body), body)
    return Data(stream, offset, cast(bytes, body[_DATA.size :]))  # a memoryview when `body` is one: bytes-like, no copy


def _decode_binary(ftype: FrameType, body: bytes | memoryview) -> Event:
    if ftype is FrameType.DATA:
        return decode_data(body)
    if ftype is FrameType.ZDATA:
        stream, offset, size = _fixed(_ZDATA, body, ftype, exact=False)
        payload = bytes(body[_ZDATA.size :])
        if not 0 < size <= MAX_PAYLOAD or not payload:
            raise _bad(f"ZDATA: size must be 1..{MAX_PAYLOAD} and the payload not empty")
        if len(payload) > MAX_PAYLOAD:
            raise RemoteProtocolError("ZDATA payload too large", ErrorCode.FRAME_TOO_LARGE)
        if offset + size > MAX_OFFSET:
            raise _bad("ZDATA runs past the largest offset")
        return ZData(stream, offset, size, payload)
    if ftype is FrameType.ACK:
        stream, offset = _fixed(_ACK, body, ftype, exact=True)
        if offset > MAX_OFFSET:
            raise _bad("ACK: offset past the largest offset")
        return Ack(stream, offset)
    if ftype is FrameType.STDIN_READ:
        stream, offset, max_bytes = _fixed(_STDIN_READ, body, ftype, exact=True)
        if not 0 < max_bytes <= MAX_PAYLOAD:
            raise _bad(f"STDIN_READ: max_bytes must be 1..{MAX_PAYLOAD}")
        if offset + max_bytes > MAX_OFFSET:
            raise _bad("STDIN_READ runs past the largest offset")
        return StdinRead(stream, offset, max_bytes)
    if ftype is FrameType.STDIN_DATA:
        stream, offset, eof = _fixed(_STDIN_DATA, body, ftype, exact=False)
        if eof not in (0, 1):
            raise _bad("STDIN_DATA: eof flag must be 0 or 1")
        payload = bytes(body[_STDIN_DATA.size :])  # the agent gets bytes it may keep
        if len(payload) > MAX_PAYLOAD:
            raise RemoteProtocolError("STDIN_DATA payload too large", ErrorCode.FRAME_TOO_LARGE)
        if offset + len(payload) > MAX_OFFSET:
            raise _bad("STDIN_DATA runs past the largest offset")
        return StdinData(stream, offset, payload, bool(eof))
    (nonce,) = _fixed(_NONCE, body, ftype, exact=True)
    return Ping(nonce) if ftype is FrameType.PING else Pong(nonce)


_JSON_FRAMES = {
    FrameType.HELLO, FrameType.WELCOME, FrameType.EXIT, FrameType.DONE, FrameType.ERROR, FrameType.CHALLENGE,
    FrameType.AUTH, FrameType.NOTES,
}


def decode(raw_type: int, body: bytes | memoryview) -> Event:
    """The event of one frame body, or RemoteProtocolError. A DATA payload
    is a slice of `body` (a memoryview if `body` is one: no copy)."""
    try:
        ftype = FrameType(raw_type)
    except ValueError:
        raise _bad(f"unknown frame type {raw_type}") from None
    if ftype in fileframes.FRAMES:
        return fileframes.decode(ftype, body)
    if ftype in _JSON_FRAMES:
        return _decode_json_frame(ftype, body)
    return _decode_binary(ftype, body)
