"""DATA payloads from a plain socket into their file through a pipe.

Once a DATA frame's head has been read and checked, the rest of its payload
is still in the socket (`Connection.payload_due`): splice(2) moves it into a
pipe (the socket's pages, no copy) and from the pipe into the file at its
offset (the page cache's one copy, as pwrite's), instead of a read into a
buffer and a write out of it. Each chunk is written at its offset as soon as
it arrives, as a read's piece is: a frame cut mid-payload leaves exactly
what arrived.

The pipe is the shadow's, one for every connection: nothing awaits between
filling it and emptying it, so it is empty whenever another connection
takes it. A write that fails (a full disk) leaves bytes in it: it is closed,
and the next splice opens another. Where the files' file system takes no
splice (EINVAL), what the pipe holds is read out and written with pwrite,
and from then on the shadow reads its payloads into buffers as before.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

log = logging.getLogger("gcshadow")

SPLICE_MIN = 64 << 10  # payload still due from which two splices beat a read and a write
PIPE_SIZE = 1 << 20  # asked of the kernel (F_SETPIPE_SZ): a splice moves at most this much
UNSUPPORTED_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


class Splicer:
    """The shadow's pipe between sockets and files, and whether splice works here."""

    def __init__(self) -> None:
        self.pipe: tuple[int, int] | None = None  # (read end, write end): opened on first use
        self.refused = False  # the files' file system takes no splice: payloads are read, then written

    def take(self, sock: int, size: int) -> int:
        """Move up to `size` bytes from the (non-blocking) socket into the
        empty pipe: the bytes moved, 0 at the connection's end;
        BlockingIOError when the socket has none."""
        _, w = self._opened()
        return os.splice(sock, w, min(size, PIPE_SIZE), flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)

    def put(self, fd: int, at: int, n: int) -> None:
        """Write the n bytes the pipe holds into file `fd` at offset `at`,
        leaving the pipe empty; an OSError is the disk's (the pipe is then
        closed, with what it still held)."""
        assert self.pipe is not None
        r = self.pipe[0]
        try:
            while n:
                if self.refused:
                    moved = _copy(r, fd, at, n)
                else:
                    try:
                        moved = os.splice(r, fd, n, offset_dst=at)
                    except OSError as e:
                        if e.errno not in UNSUPPORTED_ERRNOS:
                            raise
                        log.info("splice into the files at home is not supported here (%s): reading instead",
                                 e.strerror)
                        self.refused = True
                        continue
                if moved <= 0:
                    raise OSError(errno.EIO, "splice wrote nothing")
                at += moved
                n -= moved
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the pipe (another is opened when next needed)."""
        if self.pipe is not None:
            for fd in self.pipe:
                os.close(fd)
            self.pipe = None

    def _opened(self) -> tuple[int, int]:
        if self.pipe is None:
            r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
            except OSError:
                pass  # (a smaller pipe: smaller splices)
            self.pipe = (r, w)
        return self.pipe


def _copy(r: int, fd: int, at: int, n: int) -> int:
    """Read up to n bytes out of the pipe and write them at `at`: the bytes written."""
    data = memoryview(os.read(r, n))
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], at + done)
    return done
