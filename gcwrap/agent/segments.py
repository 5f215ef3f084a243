"""Segment files that hold the spool's bytes.

Why not blobs in SQLite: a 1 MiB blob is sixteen 64 KiB pages written to the
WAL, read back and written again at checkpoint; that is about four times the
bytes and most of gcwrap's CPU (see benchmarks/README.md). Here every byte is
written once into `<spool>.seg/<stream>-<n>`; the SQLite spool stays the
database of record: a chunk exists when its row (stream, offsets, segment,
position) is committed.

Layout. In a spool made by this version the layout is *natural*: byte `o`
of a stream lives in segment `o // segment_size` at position
`o % segment_size`, whatever path it took there. So the bytes of a stream's
unacknowledged range can be found without asking the database, which is
what lets gcwrap move bulk output without copying it through user space:

- the reader `splice()`s the job's pipe straight into the segment file (the
  kernel copies pipe pages into the page cache; nothing enters Python), and
- the sender `sendfile()`s from the segment to the socket.

Spools of earlier versions appended each chunk after the previous one; their
rows say where. gcwrap only delivers them (`gcwrap resume`, through the
rows), so nothing here writes in that layout any more.

Reuse. A segment whose bytes are all acknowledged is renamed to the stream's
spare and becomes its next segment: writing over pages already in the page
cache, and blocks already allocated, costs about half as much as filling new
ones (benchmarks/README.md). At most one spare per stream, and none when the
disk is tight.

Bytes written past the last committed row (a crash, a failed commit) are
garbage nobody points to; after a restart they are simply written over.

Durability is the spool's: the page cache survives a killed wrapper; after a
power loss the job is gone too, and the shadow's offsets make resends exact.

One `Segments` per spool. The spool's writer and the connection that reads
rows back for the sender share it, so a released segment's one descriptor
is closed and its blocks go back to the disk. (A second table of
descriptors kept deleted segments allocated, one descriptor each.)

Descriptors. At most MAX_OPEN are kept open between uses, least recently
used closed first, so a backlog of any number of segments needs a handful:
each stream's write head and read head, and what is being read or written
this instant. A descriptor is pinned while used (`_open`), and only an
unpinned one is ever closed.

Threads: commits (inline in the event loop's thread, or in a worker thread
when large or the disk is slow) write and release, splices and sendfiles run
the same way, the read-back connection reads in a worker thread; the
descriptor table is guarded by a lock. A
segment is released only once every byte in it is acknowledged, and nobody
reads or writes acknowledged bytes; a descriptor still pinned when its
segment goes is closed by its last user all the same.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

DEFAULT_SEGMENT = 16 << 20
MIN_SEGMENT = 64 << 10
SPARE = "spare"
MAX_OPEN = 16  # segment descriptors kept open between uses (see "Descriptors")


class Segments:
    """One spool's segment files: where each stream byte lives (natural
    layout: by its offset), and the descriptors to write, splice, read and
    sendfile them, bounded and shared by the spool's connections."""

    def __init__(
        self, directory: Path, segment_size: int = DEFAULT_SEGMENT, *, readonly: bool = False, natural: bool = False,
        max_open: int = MAX_OPEN,
    ) -> None:
        self.dir = directory
        self.max_open = max_open  # descriptors kept open between uses (see "Descriptors")
        self.readonly = readonly
        self.segment_size = segment_size
        self.natural = natural
        self.keep_spares = True  # the spooler turns this off when the disk is tight
        self.lock = threading.Lock()
        self.fds: OrderedDict[tuple[int, int], int] = OrderedDict()  # open descriptors, least recently used first
        self.pins: dict[int, int] = {}  # descriptor -> its users at this instant
        self.orphans: set[int] = set()  # pinned descriptors of segments gone: the last user closes them
        self.known: dict[int, set[int]] = {}  # stream -> segment numbers on disk
        self.spares: dict[int, int] = {}  # stream -> descriptor of its spare segment

    def path(self, stream: int, seg: int) -> Path:
        return self.dir / f"{stream}-{seg}"

    def spare_path(self, stream: int) -> Path:
        return self.dir / f"{stream}-{SPARE}"

    @contextlib.contextmanager
    def _open(self, stream: int, seg: int, create: bool) -> Iterator[int]:
        """The segment's descriptor, pinned (never closed) while in use."""
        fd = self._pin(stream, seg, create)
        try:
            yield fd
        finally:
            with self.lock:
                left = self.pins[fd] - 1
                if left:
                    self.pins[fd] = left
                else:
                    del self.pins[fd]
                    if fd in self.orphans:
                        self.orphans.discard(fd)
                        os.close(fd)
                self._trim()

    def _pin(self, stream: int, seg: int, create: bool) -> int:
        key = (stream, seg)
        with self.lock:
            fd = self.fds.get(key)
            if fd is None:
                fd = self._open_file(stream, seg, create)
                self.fds[key] = fd
            else:
                self.fds.move_to_end(key)
            self.pins[fd] = self.pins.get(fd, 0) + 1
            self._trim()
            return fd

    def _open_file(self, stream: int, seg: int, create: bool) -> int:
        fd: int | None = None
        if create and seg not in self.known.get(stream, ()):
            self.dir.mkdir(mode=0o700, exist_ok=True)
            # (Only for a new segment: one whose descriptor was closed holds bytes.)
            spare = self.spares.pop(stream, None)
            if spare is not None:
                try:
                    os.rename(self.spare_path(stream), self.path(stream, seg))
                    fd = spare
                except OSError:
                    os.close(spare)
            if fd is None:
                fd = os.open(self.path(stream, seg), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self.known.setdefault(stream, set()).add(seg)
        else:
            # A writer's read may later be followed by writes on the same fd.
            mode = os.O_RDONLY if self.readonly else os.O_RDWR
            fd = os.open(self.path(stream, seg), mode | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
        return fd

    def _trim(self) -> None:
        """Close least recently used descriptors not in use, down to max_open (lock held)."""
        if len(self.fds) <= self.max_open:
            return
        for key in [k for k, fd in self.fds.items() if fd not in self.pins][: len(self.fds) - self.max_open]:
            os.close(self.fds.pop(key))

    def where(self, offset: int) -> tuple[int, int, int]:
        """Natural layout: the (segment, position) of stream byte `offset`,
        and how many bytes fit from there to the segment's end."""
        seg, pos = divmod(offset, self.segment_size)
        return seg, pos, self.segment_size - pos

    # -- writing (natural layout) ------------------------------------------

    def place_at(self, stream: int, start: int, data: bytes | memoryview) -> list[tuple[int, int, int, int]]:
        """Write stream bytes [start, start+len(data)) where they belong;
        one (segment, position, start, end) per segment touched. OSError
        (ENOSPC...) propagates: the caller reports the disk."""
        out = []
        view = memoryview(data)
        at = start
        while view:
            seg, pos, room = self.where(at)
            piece = view[:room]
            with self._open(stream, seg, create=True) as fd:
                p = pos
                while piece:
                    n = os.pwrite(fd, piece, p)
                    piece, p = piece[n:], p + n
            size = min(room, len(view))
            out.append((seg, pos, at, at + size))
            view, at = view[size:], at + size
        return out

    def splice_in(self, stream: int, pipe: int, start: int, size: int) -> int:
        """Move up to `size` bytes from the pipe into the segment file at
        stream offset `start`, never across a segment's end, without copying
        them through user space. Returns the bytes moved (0: end of file);
        BlockingIOError when the (non-blocking) pipe is empty; other OSErrors
        (ENOSPC...) are the disk's."""
        seg, pos, room = self.where(start)
        with self._open(stream, seg, create=True) as fd:
            return os.splice(pipe, fd, min(size, room), offset_dst=pos)

    @contextlib.contextmanager
    def opened_at(self, stream: int, offset: int) -> Iterator[tuple[int, int, int]]:
        """Natural layout: (descriptor, position, bytes to the segment's end)
        for reading stream byte `offset`; the descriptor stays open while
        the `with` block runs."""
        seg, pos, room = self.where(offset)
        with self._open(stream, seg, create=False) as fd:
            yield fd, pos, room

    def release_below(self, stream: int, acked: int) -> None:
        """Natural layout: drop the segments whose every byte is acknowledged;
        keep one as the stream's spare for reuse."""
        first_needed = acked // self.segment_size
        for n in sorted(self.known.get(stream, ())):
            if n < first_needed:
                self._drop(stream, n, reuse=True)

    def drop_spares(self) -> None:
        """Give the spares' blocks back (the disk is tight)."""
        with self.lock:
            spares, self.spares = self.spares, {}
        for stream, fd in spares.items():
            os.close(fd)
            try:
                os.unlink(self.spare_path(stream))
            except FileNotFoundError:
                pass

    # -- spools of earlier versions (appending layout) ----------------------

    def release(self, stream: int, oldest: int | None) -> None:
        """Delete the stream's segments below `oldest`, the oldest one still
        referenced by a chunk (None: none is, everything was delivered)."""
        for n in sorted(self.known.get(stream, ())):
            if oldest is None or n < oldest:
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

    def _drop(self, stream: int, seg: int, reuse: bool = False) -> None:
        with self.lock:
            fd = self.fds.pop((stream, seg), None)
            self.known.get(stream, set()).discard(seg)
            if fd is not None and fd in self.pins:
                self.orphans.add(fd)  # (its last user closes it)
                fd = None
            if reuse and fd is not None and self.keep_spares and stream not in self.spares:
                try:
                    os.rename(self.path(stream, seg), self.spare_path(stream))
                    self.spares[stream] = fd
                    return
                except OSError:
                    pass
            if fd is not None:
                os.close(fd)
            try:
                os.unlink(self.path(stream, seg))
            except FileNotFoundError:
                pass

    # -- reading ---------------------------------------------------------

    def read(self, stream: int, seg: int, pos: int, size: int) -> bytes:
        with self._open(stream, seg, create=False) as fd:
            data = os.pread(fd, size, pos)
        if len(data) != size:
            raise OSError(f"segment {self.path(stream, seg)} ends before byte {pos + size}")
        return data

    def read_at(self, stream: int, offset: int, size: int) -> bytes:
        """Natural layout: stream bytes from `offset`, at most to the segment's end."""
        seg, pos, room = self.where(offset)
        return self.read(stream, seg, pos, min(size, room))

    # -- the end ---------------------------------------------------------

    def close(self) -> None:
        self.drop_spares()  # a kept spool holds only what is undelivered
        with self.lock:
            for fd in self.fds.values():
                if fd in self.pins:
                    self.orphans.add(fd)
                else:
                    os.close(fd)
            self.fds.clear()

    def size(self) -> int:
        """Disk space the segments take (blocks: a natural segment may be sparse)."""
        total = 0
        try:
            for entry in os.scandir(self.dir):
                total += entry.stat().st_blocks * 512
        except FileNotFoundError:
            pass
        return total

    def remove(self) -> None:
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
