"""An agent that speaks the protocol by hand, over a real socket to a real
gcshadow: the protocol's end-to-end tests script each frame with it. Every
socket opened here is closed when its test ends (conftest.py)."""

from __future__ import annotations

import socket

from gcwrap.wire.events import ConnectionClosed, Error, Event, Hello, StreamSpec
from gcwrap.wire.protocol import NEED_DATA, Connection, Role

OPEN: list[socket.socket] = []


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    """A socket to the shadow on this machine, closed at the test's end."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    OPEN.append(sock)
    return sock


def close_all() -> None:
    while OPEN:
        OPEN.pop().close()


class RawAgent:
    """The agent's end of the protocol (wire.protocol.Connection) on a socket, one frame at a time."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = connect(port, timeout)
        self.conn = Connection(Role.AGENT)

    def send(self, event: Event) -> None:
        self.sock.sendall(self.conn.send(event))

    def next(self) -> Event:
        """The next event from the shadow (ConnectionClosed once it closed)."""
        while (ev := self.conn.next_event()) is NEED_DATA:
            self.conn.receive_data(self.sock.recv(65536))
        assert isinstance(ev, Event)
        return ev

    def until(self, cls: type, limit: int = 1000) -> Event:
        """The next event of class `cls`, or the Error or ConnectionClosed that comes first."""
        for _ in range(limit):
            ev = self.next()
            if isinstance(ev, (cls, Error, ConnectionClosed)):
                return ev
        raise AssertionError(f"no {cls.__name__}")

    def receive(self, cls: type) -> Event:
        """The next event of class `cls`; an Error or the connection's end fails the test."""
        ev = self.until(cls)
        if isinstance(ev, Error) and cls is not Error:
            raise AssertionError(f"the shadow said {ev.code.name}: {ev.message}")
        assert isinstance(ev, cls), ev
        return ev

    def hello(self, job: str, instance: str, name: str = "o.txt") -> Event:
        """HELLO for a job with one stdout stream; the shadow's answer."""
        self.send(Hello(job_id=job, instance=instance, streams=(StreamSpec(1, "stdout", name),), host="test"))
        return self.next()

    def close(self) -> None:
        self.sock.close()
