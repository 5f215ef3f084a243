"""A session's reads: into buffers the sessions share, cut into events.

A streaming session's connection gives DATA out in pieces as they arrive
(`DataPiece`, see gcwrap.wire.protocol): the shadow writes each piece at its
offset, so no DATA frame is gathered or joined, and what a connection holds
between reads is at most a frame's head or one control frame.

On a plain socket the bytes are read (`readv`) straight into a buffer taken
from `Buffers` once the socket has bytes, and the buffer goes back once that
read's events are acted on: no buffer is allocated per read, and a
connection waiting for its agent, or for the CPU, holds none (a read's
scheduling point comes before it takes a buffer). At most `Buffers.cap` are
lent at once (sessions acting on a read's events may wait: an EXIT for its
flush); past that a read gets a buffer of its own, sized to what it read,
as a stream's read does. A buffer something still views (a payload kept
past its read) is never lent again: it is left to be freed. Over TLS, or
any other stream, a read is `receive_some`. Under bulk output a read takes
a DATA frame's head alone, and its payload is spliced into its file
(splicer.py), never read into a buffer.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator

import trio

from ..wire import compress
from ..wire.events import Data, ErrorCode, Event, StdinData, StdinRead, ZData
from ..wire.protocol import Connection, ProtocolError
from .files import FileCache, JobFiles, Problem, StoreError
from .splicer import Splicer

# Up to a DATA frame and its head in one read: a bulk frame is written in
# one or two pieces, with a read and a wake-up each.
READ_SIZE = (1 << 20) + 64
CAP = 8  # buffers lent at once, at most: 10 000 sessions at an EXIT each must not hold 10 000 of them
OWN_READ = 120 << 10  # a read past the cap: its own buffer (below glibc's mmap threshold)


class Buffers:
    """Read buffers lent to one read and its events at a time."""

    def __init__(self, size: int = READ_SIZE, cap: int = CAP) -> None:
        self.size = size
        self.cap = cap
        self.free: list[bytearray] = []
        self.lent = 0
        self.made = 0  # buffers allocated (for tests and the debug log)
        self.splicer = Splicer()  # payloads still in the socket go through its pipe into their file

    def take(self) -> bytearray | None:
        """A buffer for one read, or None while `cap` are lent."""
        if self.lent >= self.cap:
            return None
        self.lent += 1
        if self.free:
            return self.free.pop()
        self.made += 1
        return bytearray(self.size)

    def give(self, buf: bytearray) -> None:
        """`buf` is no longer used by its read: keep it for another, unless a
        view of it is still alive somewhere (then it cannot be resized)."""
        self.lent -= 1
        if len(self.free) < self.cap:
            try:
                buf.append(0)  # (in place once it has had room to grow: bytearrays over-allocate)
            except BufferError:
                return
            del buf[-1]
            self.free.append(buf)

    @contextlib.contextmanager
    def lending(self, lent: Callable[[], bytearray | None]) -> Iterator[None]:
        """Give back, when the block ends however it ends, the buffer `lent()` names then."""
        try:
            yield
        finally:
            buf = lent()
            if buf is not None:
                self.give(buf)


async def read_into(fd: int, conn: Connection, buffers: Buffers, size: int = READ_SIZE
                    ) -> tuple[list[Event], bytearray | None]:
    """The events of the next read of socket `fd`, at most `size` bytes,
    made from a lent buffer (`buffers.give` it back once they are acted on;
    None when the read had a buffer of its own, or at EOF). Raises
    trio.BrokenResourceError when the connection fails, as a stream would."""
    await trio.lowlevel.checkpoint()  # (a read is a scheduling point, as a stream's: taken before any buffer is)
    while True:
        buf = buffers.take()
        try:
            if buf is None:
                data = os.read(fd, min(size, OWN_READ))
                conn.receive_data(data)
                return conn.events(), None
            n = os.readv(fd, [buf] if size >= len(buf) else [memoryview(buf)[:size]])
            if n:
                conn.receive_data(memoryview(buf)[:n], borrowed=True)
                return conn.events(), buf
            buffers.give(buf)
            buf = None
            conn.receive_data(b"")
            return conn.events(), None
        except BlockingIOError:
            if buf is not None:
                buffers.give(buf)
                del buf
            await trio.lowlevel.wait_readable(fd)
        except OSError as e:
            if buf is not None:
                buffers.give(buf)
            if e.errno == errno.EBADF:
                raise trio.ClosedResourceError("the connection was closed") from e
            raise trio.BrokenResourceError(f"socket connection broken: {e}") from e
        except BaseException:
            if buf is not None:
                buffers.give(buf)  # (a protocol error: a view of it may live on in its traceback; then it is dropped)
            raise


async def read_some(stream: trio.abc.Stream, conn: Connection, size: int = OWN_READ) -> list[Event]:
    """The events of the next read of `stream` (`receive_some`, into a new buffer)."""
    conn.receive_data(await stream.receive_some(size))
    return conn.events()


def inflate(ev: ZData) -> Data:
    """The DATA a ZDATA frame carries; a frame that does not decode to
    exactly the bytes it announced is malformed (nothing of it is written)."""
    try:
        return Data(ev.stream, ev.offset, compress.codec().decompress(ev.payload, ev.size))
    except compress.CodecError as e:
        raise ProtocolError(f"ZDATA for stream {ev.stream} at offset {ev.offset}: {e}", ErrorCode.BAD_FRAME) from None


# A job's stdin file is read off the event loop (it is often on NFS, whose
# reads can hang for as long as the server is away), each read bounded: past
# STDIN_WAIT the session is refused with a retryable code, and its agent
# asks again later. A read that hangs holds its thread until it returns:
# at most STDIN_READERS at once, so a dead server costs threads, not the shadow.
STDIN_WAIT = 10.0
STDIN_READERS = 16


class StdinReader:
    """The reads of the jobs' stdin files, in threads, bounded in time.

    While a thread reads, the file is pinned (`StreamFile.pins`, under the
    cache's lock, as a durability batch pins what it syncs): the cache does
    not close it, and its session's end leaves it to the read to close
    (`StreamFile.unpin`), so its descriptor's number is never reused under
    the read."""

    def __init__(self, cache: FileCache) -> None:
        self.cache = cache
        self.limiter = trio.CapacityLimiter(STDIN_READERS)

    async def read(self, files: JobFiles, ev: StdinRead) -> StdinData:
        """What a STDIN_READ asks for, from the job's stdin file."""
        sf = files.stdin
        if sf is None or ev.stream != files.stdin_stream:
            raise ProtocolError(f"STDIN_READ for stream {ev.stream}, which is not the job's stdin",
                                ErrorCode.UNKNOWN_STREAM)
        lock = self.cache.lock
        fd = self.cache.use(sf)
        with lock:
            sf.pins += 1
        began = [False]  # the read began (it unpins the file); once given up on first, it never does

        def read() -> tuple[bytes, int]:
            with lock:
                if began[0]:
                    return b"", 0
                began[0] = True
            try:
                return os.pread(fd, ev.max_bytes, ev.offset), os.fstat(fd).st_size
            finally:
                with lock:
                    sf.unpin()

        try:
            with trio.move_on_after(STDIN_WAIT) as waited:
                data, size = await trio.to_thread.run_sync(read, limiter=self.limiter, abandon_on_cancel=True)
        finally:
            with lock:
                if not began[0]:  # (still waiting for a thread: the read never happens)
                    began[0] = True
                    sf.unpin()
        if waited.cancelled_caught:
            raise StoreError(Problem.IO, f"a read of the stdin file {sf.name!r} did not return within "
                                         f"{STDIN_WAIT:g} s (its file system at home hangs?)")
        return StdinData(ev.stream, ev.offset, data, ev.offset + len(data) >= size)
