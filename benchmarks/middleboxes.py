"""Middleboxes on loopback for the tests and the benchmarks: TCP relays
that stand between gcwrap and its shadow and behave as the network in
between does (a buffering tunnel, a slow link).

The tests (tests/faults.py) and the benchmarks (slowlink.py) use the same
ones, so that a benchmark measures what a test shows. Threads, not trio: a
middlebox is not gcwrap's and must not share its event loop's assumptions.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Self


def accept_until(listener: socket.socket, stopping: threading.Event, timeout: float = 0.2) -> Iterator[socket.socket]:
    """The connections `listener` accepts until `stopping` is set (looked at
    every `timeout` s), each in blocking mode. A listener not listening yet,
    or closed, fails at once: it is tried again 20 ms later."""
    listener.settimeout(timeout)
    while not stopping.is_set():
        try:
            client, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            stopping.wait(0.02)
            continue
        client.settimeout(None)  # (blocking whatever socket.setdefaulttimeout says)
        yield client


class Middlebox:
    """A TCP middlebox on loopback: accepts, connects each client to
    `target`, and runs `_pump(src, dst, upstream)` in a thread per direction
    (`upstream`: from the client). Stopped, with every socket closed, when
    the `with` block ends."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        self.connections = 0

    def __enter__(self) -> Self:
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.listener.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self.threads:
            t.join(5)

    def _accept(self) -> None:
        for client in accept_until(self.listener, self.stopping):
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self.connections += 1
            self.socks += [client, upstream]
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pump, args=(a, b, up), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        raise NotImplementedError


class BufferingRelay(Middlebox):
    """A TCP relay on loopback that buffers what the client sends without
    bound and forwards it at `rate` bytes a second (a token bucket), as an
    SSH tunnel or a TCP balancer in front of a slower link does: the
    client's socket queue stays empty while megabytes wait in the relay.
    Replies go back as they come. `most` is the largest buffer it held."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        super().__init__(target)
        self.rate = rate
        self.most = 0

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        if not upstream:
            forward(src, dst)
            return
        buf = bytearray()
        cond = threading.Condition()
        done = False

        def writer() -> None:
            tokens, at = 0.0, time.monotonic()
            while True:
                with cond:
                    while not buf and not done:
                        cond.wait()
                    if not buf:
                        break
                    now = time.monotonic()
                    tokens = min(tokens + (now - at) * self.rate, self.rate / 50)  # a burst of 20 ms at most
                    at = now
                    n = min(len(buf), int(tokens), 65536)
                    data = bytes(buf[:n])
                    del buf[:n]
                    tokens -= n
                if not data:
                    time.sleep(0.005)
                    continue
                try:
                    dst.sendall(data)
                except OSError:
                    return
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        w = threading.Thread(target=writer, daemon=True)
        w.start()
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            with cond:
                if not data:
                    done = True
                else:
                    buf += data
                    self.most = max(self.most, len(buf))
                cond.notify()
            if not data:
                break
        w.join(60)


def forward(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until either ends."""
    while True:
        try:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
        except OSError:
            break
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
