"""The frames of the files a job writes ("files" feature): events to bytes and back.

FILE_OPEN and FILE_COMMIT carry a JSON object; FILE_DATA, FILE_COPY and
FILE_ACK are fixed binary structs, as DATA and ACK are. The members WELCOME
and EXIT gain (`files`) are checked here too. Which frame is legal when is
gcwrap.wire.protocol's business (only where the handshake agreed on the
"files" feature).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any

from .codec import (
    MAX_OFFSET,
    MAX_PAYLOAD,
    FrameType,
    LocalProtocolError,
    RemoteProtocolError,
    bad,
    check_offset,
    fixed,
    frame,
    get,
    is_int,
    json_body,
    load_json,
    text,
)
from .events import ErrorCode, Event, FileAck, FileCommit, FileCopy, FileData, FileHeld, FileOpen

MAX_HANDLE = (1 << 32) - 1  # file handles and versions are u32, from 1
MAX_FILES = 1000  # files in one WELCOME or EXIT (each ~40 bytes of JSON: well inside a control frame)
MAX_NAME = 4096
_FILE_DATA = struct.Struct("!IIQ")  # file, version, offset; the payload follows
_FILE_DATA_HEAD = struct.Struct("!IBIIQ")  # the frame's header and the struct above
_FILE_COPY = struct.Struct("!IIQQQ")  # file, version, offset, source, length
_FILE_ACK = struct.Struct("!IIQB")  # file, version, offset, flags (1: committed)
_SHA256_RE = re.compile(r"[0-9a-f]{64}\Z")

FRAMES = frozenset({FrameType.FILE_OPEN, FrameType.FILE_DATA, FrameType.FILE_COPY, FrameType.FILE_COMMIT,
                    FrameType.FILE_ACK})


def _handles(file: int, version: int) -> None:
    """Refuse to send a file or version handle the peer would refuse."""
    for what, value in (("file", file), ("version", version)):
        if not 1 <= value <= MAX_HANDLE:
            raise LocalProtocolError(f"{what} {value} out of range (1..{MAX_HANDLE})")


def _range(offset: int, length: int) -> None:
    check_offset(offset, "offset")
    check_offset(offset + length, "end offset")


# -- encoding -------------------------------------------------------------------------


def _encode_open(e: FileOpen) -> bytes:
    _handles(e.file, e.version)
    if e.base is not None and not 1 <= e.base < e.version:
        raise LocalProtocolError(f"FILE_OPEN: base {e.base} must be an earlier version than {e.version}")
    if not e.name or len(e.name) > MAX_NAME or "\x00" in e.name:
        raise LocalProtocolError("FILE_OPEN: the name must be 1 to 4096 characters without NUL")
    return frame(FrameType.FILE_OPEN, json_body({"file": e.file, "name": e.name, "version": e.version,
                                                 "base": e.base}))


def file_data_head(e: FileData) -> bytes:
    """The bytes of `e`'s frame before its payload, checked (a sender may
    write the payload after them without joining the two, as DATA's)."""
    _handles(e.file, e.version)
    _range(e.offset, len(e.payload))
    if len(e.payload) > MAX_PAYLOAD:
        raise LocalProtocolError("FILE_DATA payload too large")
    return _FILE_DATA_HEAD.pack(1 + _FILE_DATA.size + len(e.payload), FrameType.FILE_DATA, e.file, e.version,
                                e.offset)


def _encode_data(e: FileData) -> bytes:
    return b"".join((file_data_head(e), e.payload))


def _encode_copy(e: FileCopy) -> bytes:
    _handles(e.file, e.version)
    if e.length <= 0:
        raise LocalProtocolError("FILE_COPY copies at least a byte")
    _range(e.offset, e.length)
    _range(e.source, e.length)
    return frame(FrameType.FILE_COPY, _FILE_COPY.pack(e.file, e.version, e.offset, e.source, e.length))


def _encode_commit(e: FileCommit) -> bytes:
    _handles(e.file, e.version)
    check_offset(e.size, "size")
    if not isinstance(e.sha256, str) or not _SHA256_RE.match(e.sha256):
        raise LocalProtocolError("FILE_COMMIT: sha256 must be 64 lowercase hex digits")
    return frame(FrameType.FILE_COMMIT, json_body({"file": e.file, "version": e.version, "size": e.size,
                                                   "sha256": e.sha256}))


def _encode_ack(e: FileAck) -> bytes:
    _handles(e.file, e.version)
    check_offset(e.offset, "offset")
    return frame(FrameType.FILE_ACK, _FILE_ACK.pack(e.file, e.version, e.offset, int(e.committed)))


ENCODERS: dict[type[Event], Callable[[Any], bytes]] = {
    FileOpen: _encode_open,
    FileData: _encode_data,
    FileCopy: _encode_copy,
    FileCommit: _encode_commit,
    FileAck: _encode_ack,
}


def held_member(files: tuple[FileHeld, ...]) -> dict[str, Any]:
    """WELCOME's `files` member, left out when there are none (a WELCOME
    without files is byte for byte what older shadows sent)."""
    if len(files) > MAX_FILES:
        raise LocalProtocolError(f"WELCOME: at most {MAX_FILES} files")
    for f in files:
        _handles(f.file, f.version)
        check_offset(f.durable, "durable")
        if not -1 <= f.committed <= f.durable:
            raise LocalProtocolError(f"WELCOME: file {f.file} committed at {f.committed}, past its durable bytes")
    return {"files": [[f.file, f.version, f.durable, f.committed] for f in files]} if files else {}


def final_member(files: tuple[tuple[int, int, int], ...]) -> dict[str, Any]:
    """EXIT's `files` member (file, version, size), left out when there are none."""
    if len(files) > MAX_FILES:
        raise LocalProtocolError(f"EXIT: at most {MAX_FILES} files")
    for file, version, size in files:
        _handles(file, version)
        check_offset(size, "size")
    if len({f for f, _, _ in files}) != len(files):
        raise LocalProtocolError("EXIT: a file is listed twice")
    return {"files": [list(f) for f in files]} if files else {}


# -- decoding -------------------------------------------------------------------------


def _is_handle(value: Any) -> bool:
    return is_int(value) and 1 <= value <= MAX_HANDLE


def _is_offset(value: Any) -> bool:
    return is_int(value) and 0 <= value <= MAX_OFFSET


def _rows(obj: dict[str, Any], ftype: FrameType, width: int) -> list[list[Any]]:
    rows = obj.get("files", [])
    if not isinstance(rows, list) or len(rows) > MAX_FILES:
        raise bad(f"{ftype.name}: 'files' must list at most {MAX_FILES} files")
    for row in rows:
        if not isinstance(row, list) or len(row) != width or not (_is_handle(row[0]) and _is_handle(row[1])):
            raise bad(f"{ftype.name}: 'files' holds a malformed row")
    if len({row[0] for row in rows}) != len(rows):
        raise bad(f"{ftype.name}: a file is listed twice")
    return rows


def decode_held(obj: dict[str, Any], ftype: FrameType) -> tuple[FileHeld, ...]:
    """WELCOME's `files`: [[file, version, durable, committed]]."""
    out = []
    for file, version, durable, committed in _rows(obj, ftype, 4):
        if not _is_offset(durable) or not is_int(committed) or not -1 <= committed <= durable:
            raise bad(f"{ftype.name}: file {file}: durable and committed must be offsets, committed <= durable")
        out.append(FileHeld(file, version, durable, committed))
    return tuple(out)


def decode_final(obj: dict[str, Any], ftype: FrameType) -> tuple[tuple[int, int, int], ...]:
    """EXIT's `files`: [[file, version, size]]."""
    out = []
    for file, version, size in _rows(obj, ftype, 3):
        if not _is_offset(size):
            raise bad(f"{ftype.name}: file {file}: size must be an offset")
        out.append((file, version, size))
    return tuple(out)


def _decode_open(obj: dict[str, Any]) -> FileOpen:
    f = FrameType.FILE_OPEN
    file: Any = obj.get("file")
    version: Any = obj.get("version")
    base: Any = obj.get("base")
    if not _is_handle(file) or not _is_handle(version):
        raise bad("FILE_OPEN: 'file' and 'version' must be integers 1..2**32-1")
    if base is not None and not (is_int(base) and 1 <= base < version):
        raise bad("FILE_OPEN: 'base' must be null or an earlier version")
    name = text(obj.get("name"), MAX_NAME, f, "name")
    if not name:
        raise bad("FILE_OPEN: 'name' must not be empty")
    return FileOpen(file, name, version, base)


def _decode_commit(obj: dict[str, Any]) -> FileCommit:
    f = FrameType.FILE_COMMIT
    file: Any = obj.get("file")
    version: Any = obj.get("version")
    size: Any = obj.get("size")
    if not _is_handle(file) or not _is_handle(version) or not _is_offset(size):
        raise bad("FILE_COMMIT: 'file', 'version' and 'size' must be integers in range")
    sha256 = get(obj, "sha256", str, f)
    if not _SHA256_RE.match(sha256):
        raise bad("FILE_COMMIT: 'sha256' must be 64 lowercase hex digits")
    return FileCommit(file, version, size, sha256)


def _check_handles(ftype: FrameType, file: int, version: int) -> None:
    if file == 0 or version == 0:
        raise bad(f"{ftype.name}: file and version count from 1")


def decode(ftype: FrameType, body: bytes | memoryview) -> Event:
    """The event of one file frame's body, or RemoteProtocolError."""
    if ftype is FrameType.FILE_OPEN:
        return _decode_open(load_json(body, ftype))
    if ftype is FrameType.FILE_COMMIT:
        return _decode_commit(load_json(body, ftype))
    if ftype is FrameType.FILE_DATA:
        file, version, offset = fixed(_FILE_DATA, body, ftype, exact=False)
        _check_handles(ftype, file, version)
        payload = bytes(body[_FILE_DATA.size:])
        if len(payload) > MAX_PAYLOAD:
            raise RemoteProtocolError("FILE_DATA payload too large", ErrorCode.FRAME_TOO_LARGE)
        if offset + len(payload) > MAX_OFFSET:
            raise bad("FILE_DATA runs past the largest offset")
        return FileData(file, version, offset, payload)
    if ftype is FrameType.FILE_COPY:
        file, version, offset, source, length = fixed(_FILE_COPY, body, ftype, exact=True)
        _check_handles(ftype, file, version)
        if length == 0 or offset + length > MAX_OFFSET or source + length > MAX_OFFSET:
            raise bad("FILE_COPY: the length must be at least 1 and both ranges within the largest offset")
        return FileCopy(file, version, offset, source, length)
    file, version, offset, flags = fixed(_FILE_ACK, body, ftype, exact=True)
    _check_handles(ftype, file, version)
    if offset > MAX_OFFSET or flags not in (0, 1):
        raise bad("FILE_ACK: offset past the largest offset, or unknown flags")
    return FileAck(file, version, offset, bool(flags))
