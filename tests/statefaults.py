"""Faults of the shadow's state database whose outcome is unknown.

- `PgRelay`: a relay between gcshadow and PostgreSQL that reads the
  protocol's messages and, when armed, cuts a connection at a COMMIT:
  `after` forwards the COMMIT, waits until the server has answered (so the
  transaction did commit) and cuts the connection without passing the
  answer on; `before` cuts it without forwarding the COMMIT (the server
  rolls the transaction back when it sees its client gone). `down()` resets
  every connection and every new one (a restart, a failover), `up()` ends
  that. The URL it gives asks for no TLS, so every message can be read.
- `failsync`: an LD_PRELOAD library (tests/native/failsync.c, built with
  the system's C compiler) with which the embedded SQLite state's COMMIT
  writes its frames and then fails: a restart may find it applied.

Only loopback, or the address of a test host this suite made itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import threading
import urllib.parse
from pathlib import Path
from typing import Self

import pytest

NATIVE = Path(__file__).parent / "native"
SSL_REQUEST, GSS_REQUEST, CANCEL_REQUEST = 80877103, 80877104, 80877102


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return bytes(out)


def _reset(sock: socket.socket) -> None:
    """Cut the connection, as a server that died would. (shutdown first: a
    close alone does nothing while another thread is blocked reading it.)"""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class _PgLink:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.swallow = False  # the COMMIT went through: drop the answer, then cut
        self.closed = False
        self.lock = threading.Lock()

    def cut(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        _reset(self.client)
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.server.close()


class PgRelay:
    """A PostgreSQL relay that cuts connections at COMMIT on demand (see the module)."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self.listener = socket.create_server((host, 0))
        self.host, self.port = host, self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.armed: list[str] = []  # modes of the next COMMITs to cut, in order
        self.is_down = False
        self.cuts = {"after": 0, "before": 0}
        self.commits = 0
        self.links: list[_PgLink] = []
        self.threads: list[threading.Thread] = []
        self.stopping = False

    def url(self, url: str) -> str:
        """`url` (a PostgreSQL URL of the target) through this relay, without TLS."""
        parts = urllib.parse.urlsplit(url)
        user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        query = [*urllib.parse.parse_qsl(parts.query), ("sslmode", "disable"), ("gssencmode", "disable")]
        return urllib.parse.urlunsplit((parts.scheme, f"{user}{self.host}:{self.port}", parts.path,
                                        urllib.parse.urlencode(query), ""))

    def __enter__(self) -> Self:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for link in list(self.links):
            link.cut()
        for t in self.threads:
            t.join(5)

    def _spawn(self, fn: object, *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)  # type: ignore[arg-type]
        t.start()
        self.threads.append(t)

    # -- control ------------------------------------------------------------------

    def arm(self, mode: str, n: int = 1) -> None:
        """Cut the next `n` COMMITs, `after` or `before` forwarding them."""
        assert mode in ("after", "before")
        with self.lock:
            self.armed += [mode] * n

    def disarm(self) -> None:
        with self.lock:
            self.armed.clear()

    def down(self) -> None:
        """Reset every connection, and every new one until `up()`."""
        with self.lock:
            self.is_down = True
            links = list(self.links)
        for link in links:
            link.cut()

    def up(self) -> None:
        with self.lock:
            self.is_down = False

    # -- the relay ---------------------------------------------------------------

    def _accept(self) -> None:
        while not self.stopping:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_down:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for sock in (client, server):  # (message by message: no Nagle delay on each)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _PgLink(client, server)
            with self.lock:
                self.links.append(link)
            self._spawn(self._upstream, link)
            self._spawn(self._downstream, link)

    def _take_cut(self) -> str:
        with self.lock:
            self.commits += 1
            return self.armed.pop(0) if self.armed else ""

    def _upstream(self, link: _PgLink) -> None:
        """Client to server: untyped start-up packets, then typed messages."""
        try:
            while True:  # start-up: length, code (SSL/GSS requests are answered by one byte: refused by the URL)
                head = _recv_exact(link.client, 8)
                length, code = struct.unpack("!ii", head)
                body = _recv_exact(link.client, length - 8)
                link.server.sendall(head + body)
                if code not in (SSL_REQUEST, GSS_REQUEST):
                    break
            if code == CANCEL_REQUEST:
                return
            while True:
                kind = _recv_exact(link.client, 1)
                (length,) = struct.unpack("!i", _recv_exact(link.client, 4))
                body = _recv_exact(link.client, length - 4)
                if kind == b"Q" and body.rstrip(b"\0;").strip().upper() == b"COMMIT":
                    mode = self._take_cut()
                    if mode == "before":
                        self.cuts["before"] += 1
                        link.cut()
                        return
                    if mode == "after":
                        self.cuts["after"] += 1
                        link.swallow = True
                link.server.sendall(kind + struct.pack("!i", length) + body)
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            if not link.swallow:
                link.cut()
            self._forget(link)

    def _downstream(self, link: _PgLink) -> None:
        """Server to client, message by message: after a swallowed COMMIT,
        nothing more reaches the client; at its ReadyForQuery, the cut."""
        try:
            while True:
                kind = _recv_exact(link.server, 1)
                (length,) = struct.unpack("!i", _recv_exact(link.server, 4))
                body = _recv_exact(link.server, length - 4)
                if link.swallow:
                    if kind == b"Z":  # the COMMIT is done at the server; the client never hears of it
                        return
                    continue
                link.client.sendall(kind + struct.pack("!i", length) + body)
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            link.cut()
            self._forget(link)

    def _forget(self, link: _PgLink) -> None:
        with self.lock, contextlib.suppress(ValueError):
            self.links.remove(link)


# -- a COMMIT of the embedded state that writes and then fails ------------------------------------


@pytest.fixture(scope="session")
def failsync(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The LD_PRELOAD library (built once per test session; skips without a C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler (apt-get install gcc) for the failing-sync library")
    out = tmp_path_factory.mktemp("native") / "failsync.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(NATIVE / "failsync.c"), "-ldl"], check=True,
                   capture_output=True, timeout=120)
    return out


class FailingStateSync:
    """The environment that makes a gcshadow's state commits fail on demand
    (`arm(n)`: the next n syncs of its WAL report EIO after writing)."""

    def __init__(self, library: Path, control: Path) -> None:
        self.library = library
        self.control = control
        control.write_text("0\n")

    def env(self) -> dict[str, str]:
        preload = " ".join(filter(None, [str(self.library), os.environ.get("LD_PRELOAD", "")]))
        return {**os.environ, "LD_PRELOAD": preload, "FAILSYNC_CONTROL": str(self.control),
                "FAILSYNC_SUFFIX": "/.gcshadow/state.db-wal"}

    def arm(self, n: int) -> None:
        with open(self.control, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # (as the library takes one)
            f.truncate(0)
            f.write(f"{n}\n")

    def left(self) -> int:
        with open(self.control) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            return int(f.read() or 0)
