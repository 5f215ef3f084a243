"""A session's connection as its sends see it: the one send path (the TCP
socket, a plain duplicate for sends that need no wait, the lock every send
holds), and the meter of what its frames cost and how full its send queue
is (which paces compression, and tells the link's clock of a slow link).
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import termios
from collections.abc import Callable

import trio

from ..wire import compress as zc
from .pathwindow import PathWindow
from .timeline import Journal, compression_why


class SendPath:
    """The connection's one send path: the TCP socket, a plain duplicate of
    it for sends that need no wait (`raw`), and the lock every send holds."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.lock = trio.Lock()
        self._raw: socket.socket | None = None

    def raw(self) -> socket.socket:
        """A plain (non-blocking) socket object on a duplicate of the TCP
        socket's descriptor, for sends that need no wait."""
        if self._raw is None:
            self._raw = socket.socket(fileno=os.dup(self.sock.fileno()))
        return self._raw

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None


class SendMeter:
    """What the connection's frames cost on the wire (the run's `WireStats`),
    and how full its send queue is: the compression policy is told after each
    frame (full: the link sets the pace), the link's clock at each of the
    watchdog's looks (a queue shrinking is a slow link, no stall)."""

    def __init__(self, wire: zc.WireStats, journal: Journal) -> None:
        self.wire = wire
        self.journal = journal
        self.policy: zc.Policy | None = None  # when the shadow accepted compressed DATA
        self.path: PathWindow | None = None  # with --compress auto: what the path holds, and a cap on it
        self.sndbuf = 1  # the socket's send buffer, in bytes (the kernel grows it)
        self.queued_before = 0  # the send queue at the watchdog's last look (`probe`)

    def compress(self, mode: zc.Mode, now: float, sock: trio.socket.SocketType) -> None:
        """The shadow accepts compressed DATA: pace it by `mode`."""
        self.policy = zc.Policy(mode, now)
        if mode is zc.Mode.AUTO:
            self.path = PathWindow(now)
        self._measure(sock)

    def _measure(self, sock: trio.socket.SocketType) -> None:
        try:
            self.sndbuf = max(1, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        except OSError:
            self.sndbuf = 1 << 20

    def sent(self, sock: trio.socket.SocketType, sid: int, end: int, raw: int, wire: int,
             backlog: Callable[[], int]) -> None:
        """Count a frame of stream `sid` ending at `end` that went out, and
        tell the compression policy how full the socket's send queue is now
        and how long the path makes a byte wait; `backlog()`: bytes not yet sent."""
        self.wire.job_bytes += raw
        self.wire.wire_bytes += wire
        policy = self.policy
        if policy is None:
            return
        now = trio.current_time()
        if policy.window_ends(now):
            self._measure(sock)  # (the kernel grows it as the connection goes)
        path, wait = self.path, 0.0
        if path is not None:
            path.sent(now, sid, end, wire)
            wait = path.wait(now)
        policy.sent(now, raw, wire, send_queue(sock) / self.sndbuf, backlog(), wait)
        if policy.active != self.journal.compressing:
            self.journal.compression(now, policy.active, compression_why(policy))

    def acked(self, sid: int, offset: int, backlog: Callable[[], int]) -> None:
        """An ACK moved: the path holds less, and says how slow it is (`PathWindow`)."""
        path, policy = self.path, self.policy
        if path is not None and policy is not None:
            now = trio.current_time()
            path.acked(now, sid, offset)
            policy.waited(now, path.wait(now), backlog())

    def room(self, most: int) -> int:
        """Bytes the path may still take: `most` without a cap (`PathWindow.cap`),
        or while holding output back cannot pay (it does not compress)."""
        path, policy = self.path, self.policy
        if path is None or policy is None or not policy.may_compress():
            return most
        return path.room()

    def probe(self, sock: trio.socket.SocketType) -> int:
        """The send queue now, for the watchdog; the link's clock hears of it too."""
        queued = send_queue(sock)
        self.journal.link.send_queue(trio.current_time(), self.queued_before, queued)
        self.queued_before = queued
        return queued


def send_queue(sock: socket.socket | trio.socket.SocketType) -> int:
    """Bytes in the kernel's send queue not yet acknowledged by the peer."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)  # SIOCOUTQ
    except OSError:
        return 0
    return buf[0]
