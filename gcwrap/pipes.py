"""The job's pipes as the kernel sees them: their size, and what they hold."""

from __future__ import annotations

import array
import fcntl
import termios

PIPE_SIZE = 1 << 20  # ask the kernel for a pipe this large (F_SETPIPE_SZ): fewer, larger reads


def grow_pipe(fd: int) -> int:
    """Fewer, larger reads: a 1 MiB pipe instead of the default 64 KiB (the
    kernel may refuse above /proc/sys/fs/pipe-max-size: then keep its size).
    Returns the pipe's capacity in bytes (0 if unknown)."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_SIZE)
    except OSError:
        pass
    try:
        return fcntl.fcntl(fd, getattr(fcntl, "F_GETPIPE_SZ", 1032))
    except OSError:
        return 0


def pipe_bytes(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD); 0 if unknown."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return buf[0]
