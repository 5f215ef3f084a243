"""Append-only segment files that hold the spool's bytes.

Why not blobs in SQLite: a 1 MiB blob is sixteen 64 KiB pages written to the
WAL, read back and written again at checkpoint; that is about four times the
bytes and most of gcwrap's CPU (see benchmarks/README.md). Here every byte is
written once, with pwrite, into `<spool>.seg/<stream>-<n>`; the SQLite spool
stays the database of record: a chunk exists when its row (stream, offsets,
segment, position) is committed. Bytes written past the last committed
position (a crash, a failed commit) are simply overwritten by the next write.

Durability is the spool's: the page cache survives a killed wrapper; after a
power loss the job is gone too, and the shadow's offsets make resends exact.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DEFAULT_SEGMENT = 64 << 20


class Segments:
    def __init__(self, directory: Path, segment_size: int = DEFAULT_SEGMENT, *, readonly: bool = False) -> None:
        self.dir = directory
        self.readonly = readonly
        self.segment_size = segment_size
        self.current: dict[int, tuple[int, int]] = {}  # stream -> (segment, committed end)
        self.staged: dict[int, tuple[int, int]] = {}  # stream -> (segment, end) written, not yet committed
        self.fds: dict[tuple[int, int], int] = {}
        self.known: dict[int, set[int]] = {}  # stream -> segment numbers on disk

    def path(self, stream: int, seg: int) -> Path:
        return self.dir / f"{stream}-{seg}"

    def _fd(self, stream: int, seg: int, create: bool) -> int:
        key = (stream, seg)
        fd = self.fds.get(key)
        if fd is None:
            if create:
                self.dir.mkdir(mode=0o700, exist_ok=True)
                fd = os.open(self.path(stream, seg), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                self.known.setdefault(stream, set()).add(seg)
            else:
                # A writer's read may later be followed by writes on the same fd.
                mode = os.O_RDONLY if self.readonly else os.O_RDWR
                fd = os.open(self.path(stream, seg), mode | os.O_CLOEXEC)
            self.fds[key] = fd
        return fd

    # -- writing (one owner) ---------------------------------------------

    def resume(self, stream: int, seg: int, end: int) -> None:
        """After reopening: where the stream's committed bytes end."""
        self.current[stream] = (seg, end)

    def place(self, stream: int, data: bytes) -> tuple[int, int]:
        """Write `data` after the stream's staged end; its (segment, position).
        OSError (ENOSPC...) propagates: the caller reports the disk."""
        seg, pos = self.staged.get(stream) or self.current.get(stream) or (0, 0)
        if pos and pos + len(data) > self.segment_size:
            seg, pos = seg + 1, 0
        fd = self._fd(stream, seg, create=True)
        view = memoryview(data)
        at = pos
        while view:
            n = os.pwrite(fd, view, at)
            view, at = view[n:], at + n
        self.staged[stream] = (seg, pos + len(data))
        return seg, pos

    def commit(self) -> None:
        self.current.update(self.staged)
        self.staged.clear()

    def rollback(self) -> None:
        self.staged.clear()

    def release(self, stream: int, oldest: int | None) -> None:
        """Delete the stream's segments below `oldest`, the oldest one still
        referenced by a chunk (None: none is, everything was delivered)."""
        seg, end = self.current.get(stream, (0, 0))
        if oldest is None:
            if end:
                self.current[stream] = (seg + 1, 0)  # start afresh: the written one can go
            oldest = self.current.get(stream, (seg, 0))[0]
        for n in sorted(self.known.get(stream, ())):
            if n < oldest:
                self._drop(stream, n)

    def scan(self) -> None:
        """Learn the segments on disk (after reopening a spool)."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return
        for name in names:
            stream, _, seg = name.partition("-")
            if stream.isdigit() and seg.isdigit():
                self.known.setdefault(int(stream), set()).add(int(seg))

    def _drop(self, stream: int, seg: int) -> None:
        fd = self.fds.pop((stream, seg), None)
        if fd is not None:
            os.close(fd)
        self.known.get(stream, set()).discard(seg)
        try:
            os.unlink(self.path(stream, seg))
        except FileNotFoundError:
            pass

    # -- reading ---------------------------------------------------------

    def read(self, stream: int, seg: int, pos: int, size: int) -> bytes:
        fd = self._fd(stream, seg, create=False)
        data = os.pread(fd, size, pos)
        if len(data) != size:
            raise OSError(f"segment {self.path(stream, seg)} ends before byte {pos + size}")
        return data

    # -- the end ---------------------------------------------------------

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def size(self) -> int:
        total = 0
        try:
            for entry in os.scandir(self.dir):
                total += entry.stat().st_size
        except FileNotFoundError:
            pass
        return total

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
