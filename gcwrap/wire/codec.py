"""The envelope of every gcwrap frame and the checks its fields share.

A frame is `u32 length | u8 type | body`, the length counting type and
body. This module holds the frame types, the protocol's errors, the bounds
(payloads, control frames, offsets) and the helpers that build a frame and
check a decoded field; gcwrap.wire.frames (the core frames) and
gcwrap.wire.fileframes (the files a job writes) are built on it.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any

from .events import ErrorCode

MAX_PAYLOAD = 1 << 20  # largest DATA / STDIN_DATA payload either side sends
MAX_CONTROL = 64 << 10  # largest JSON control frame body
DEFAULT_MAX_FRAME = MAX_PAYLOAD + 64

# Offsets and lengths travel as u64 but are file offsets (off_t) at both
# ends: no file holds more than 2**63 - 1 bytes, and pread/pwrite refuse a
# range that ends past it. So every offset, and every offset plus length,
# is at most MAX_OFFSET, else the frame is malformed (BAD_FRAME), never left
# to fail later at the receiver as an error of its own.
MAX_OFFSET = (1 << 63) - 1
HEADER = struct.Struct("!IB")  # length, type: every frame starts so


class FrameType(enum.IntEnum):
    """The type byte of a frame's header."""

    HELLO = 1
    WELCOME = 2
    DATA = 3
    ACK = 4
    EXIT = 5
    DONE = 6
    STDIN_READ = 7
    STDIN_DATA = 8
    PING = 9
    PONG = 10
    ERROR = 11
    CHALLENGE = 12
    AUTH = 13
    ZDATA = 14  # DATA as one zstd frame, once the handshake agreed on the "zstd" feature
    NOTES = 15  # moments of the job's life for its timeline, once the handshake agreed on "notes"
    # The files the job writes, once the handshake agreed on "files" (gcwrap.wire.fileframes):
    FILE_OPEN = 16
    FILE_DATA = 17
    FILE_COPY = 18
    FILE_COMMIT = 19
    FILE_ACK = 20


class ProtocolError(Exception):
    """A violation of the protocol. `code` is what the peer is told."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.BAD_FRAME) -> None:
        super().__init__(message)
        self.code = code


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol does not allow: our bug."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class TruncatedFrame(RemoteProtocolError):
    """The peer closed the connection in the middle of a frame. Nothing it
    sent was malformed: it hung up (or its host or the path died) mid-send,
    and the side serving it reports a lost connection, not a protocol
    error."""


def frame(ftype: FrameType, body: bytes) -> bytes:
    return HEADER.pack(len(body) + 1, ftype) + body


def json_body(obj: dict[str, Any]) -> bytes:
    try:
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        # A lone surrogate (say an undecodable argv byte under surrogateescape)
        # is not Unicode text: the peer would refuse it, so we never send it.
        raise LocalProtocolError(f"control frame holds text that is not valid Unicode: {e}") from None
    if len(body) > MAX_CONTROL:
        raise LocalProtocolError(f"control frame of {len(body)} bytes is too large")
    return body


def check_offset(value: int, what: str) -> None:
    if not 0 <= value <= MAX_OFFSET:
        raise LocalProtocolError(f"{what} {value} out of range (0..{MAX_OFFSET})")


def bad(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(message, ErrorCode.BAD_FRAME)


def load_json(body: bytes | memoryview, ftype: FrameType) -> dict[str, Any]:
    if len(body) > MAX_CONTROL:
        raise RemoteProtocolError(f"{ftype.name} frame too large", ErrorCode.FRAME_TOO_LARGE)
    try:
        obj = json.loads(str(body, "utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"{ftype.name} frame is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad(f"{ftype.name} frame is not a JSON object")
    return obj


def get(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], ftype: FrameType) -> Any:
    value = obj.get(key)
    # bool is an int in Python; never accept it where a number is wanted.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in as_tuple(kind)):
        raise bad(f"{ftype.name}: field {key!r} missing or of the wrong type")
    return value


def as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_unicode(value: str) -> bool:
    """False for a string holding a lone surrogate (JSON's "\\udce9"): such a
    string cannot be encoded, and would crash whatever stores or prints it."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def text(value: Any, limit: int, ftype: FrameType, key: str) -> str:
    if not isinstance(value, str) or len(value) > limit or "\x00" in value or not is_unicode(value):
        raise bad(f"{ftype.name}: {key!r} must be Unicode text of at most {limit} characters, without NUL")
    return value


def fixed(st: struct.Struct, body: bytes | memoryview, ftype: FrameType, exact: bool) -> tuple[Any, ...]:
    if len(body) < st.size or (exact and len(body) != st.size):
        raise bad(f"{ftype.name} frame has the wrong length ({len(body)} bytes)")
    return st.unpack_from(body)
