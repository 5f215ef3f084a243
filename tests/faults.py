"""Real faults from the kernel: a network namespace for the shadow's host,
iptables for black holes, resets and loss, tmpfs for full disks, and a small
delaying TCP proxy (this kernel has no netem).

Only addresses of the namespace this module creates (10.200.N.0/30) and
loopback are ever used. Every fixture deletes before it creates and cleans
up in `finally`, so a crashed run does not break the next.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from stages import net_number

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from middleboxes import BufferingRelay as BufferingRelay  # (shared with benchmarks/slowlink.py)
from middleboxes import Middlebox, accept_until

# GCWRAP_TEST_NET=N (0-63) gives a run its own namespace, veth pair and /30,
# so that several test runs on one machine do not tear down each other's
# (and each xdist worker of a run its own: stages.net_number).
_NET = net_number()
NS = f"gcwtest{_NET}"
VETH_HOST, VETH_NS = f"gcw{_NET}v0", f"gcw{_NET}v1"
HOST_IP, NS_IP = f"10.200.{_NET}.1", f"10.200.{_NET}.2"


PACKAGES = {"ip": "iproute2", "iptables": "iptables", "mount": "mount", "umount": "mount", "tc": "iproute2"}


def need_root(*tools: str) -> None:
    """Skip unless running as root with these commands installed."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, iptables, tmpfs mounts)")
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"needs the {tool} command (apt-get install {PACKAGES.get(tool, tool)})")


def need_netns() -> None:
    """What NetNS and its faults use: network namespaces, veth pairs, iptables."""
    need_root("ip", "iptables")


def need_tmpfs() -> None:
    """What Tmpfs uses: mount and umount, nothing of the network."""
    need_root("mount", "umount")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(list(args), capture_output=True, timeout=30, check=check)


class NetNS:
    """A second host: namespace NS joined to this one by a veth pair."""

    def __init__(self) -> None:
        self.faults = 0

    def __enter__(self) -> NetNS:
        self.cleanup()
        sh("ip", "netns", "add", NS)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
        sh("ip", "link", "set", VETH_NS, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", VETH_HOST)
        sh("ip", "link", "set", VETH_HOST, "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/30", "dev", VETH_NS)
        sh("ip", "netns", "exec", NS, "ip", "link", "set", VETH_NS, "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    @staticmethod
    def cleanup() -> None:
        sh("ip", "link", "del", VETH_HOST, check=False)
        sh("ip", "netns", "del", NS, check=False)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", NS]

    def iptables(self, *rule: str) -> None:
        sh(*self.prefix(), "iptables", *rule)

    def blackhole(self, port: int) -> None:
        """Packets to the shadow vanish: no RST, no ICMP."""
        self.faults += 1
        self.iptables("-I", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP")

    def reset(self, port: int) -> None:
        """Every packet to the shadow is answered with a TCP reset."""
        self.faults += 1
        self.iptables("-I", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "REJECT", "--reject-with", "tcp-reset")

    def loss(self, port: int, probability: float) -> None:
        """Random loss both ways on the shadow's port."""
        self.faults += 1
        for chain, flag in (("INPUT", "--dport"), ("OUTPUT", "--sport")):
            self.iptables("-I", chain, "-p", "tcp", flag, str(port), "-m", "statistic", "--mode", "random",
                          "--probability", str(probability), "-j", "DROP")

    def heal(self) -> None:
        self.iptables("-F", "INPUT")
        self.iptables("-F", "OUTPUT")

    def link(self, up: bool) -> None:
        if not up:
            self.faults += 1
        sh("ip", "link", "set", VETH_HOST, "up" if up else "down")


class Tmpfs:
    """A small file system that fills up for real."""

    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        self.size = size

    def __enter__(self) -> Tmpfs:
        self.path.mkdir(parents=True, exist_ok=True)
        sh("umount", "-l", str(self.path), check=False)
        sh("mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path))
        return self

    def __exit__(self, *exc: object) -> None:
        sh("umount", "-l", str(self.path), check=False)

    def fill(self, leave: int = 0) -> Path:
        """Fill the file system, leaving about `leave` bytes free."""
        filler = self.path / "filler"
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        # Unbuffered: a buffered file would flush its rest on close, and that
        # raises ENOSPC out of the `with` when the disk filled mid-write.
        with open(filler, "ab", buffering=0) as f:
            want = max(0, free - leave)
            block = b"\0" * (64 << 10)
            try:
                while want > 0:
                    n = f.write(block[: min(len(block), want)])
                    if not n:
                        break
                    want -= n
            except OSError:
                pass
        return filler

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def remount(self, readonly: bool) -> None:
        sh("mount", "-o", f"remount,{'ro' if readonly else 'rw'}", str(self.path))


class DelayProxy(Middlebox):
    """A TCP proxy on loopback that delays every chunk by `delay` seconds,
    both ways, keeping order (what netem would do, in user space)."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        super().__init__(target)
        self.delay = delay

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        import queue

        q: queue.Queue[tuple[float, bytes]] = queue.Queue()

        def writer() -> None:
            while True:
                due, data = q.get()
                if not data:
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                try:
                    dst.sendall(data)
                except OSError:
                    return

        w = threading.Thread(target=writer, daemon=True)
        w.start()
        src.settimeout(None)
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            q.put((time.monotonic() + self.delay, data))
            if not data:
                break
        w.join(30)


class Relay:
    """A TCP relay on loopback that misbehaves as relays and middleboxes do
    with connection attempts.

    - It duplicates them: the first, then each with probability `duplicate`,
      goes to two upstream connections, and every byte the client sends goes to both
      (which copy first is drawn per connection); only one upstream's replies
      go back to the client, the other's are read and dropped.
    - It black-holes (`hole()` until `heal()`): it keeps accepting and
      reading, and forwards nothing either way. A connection the client
      gives up on meanwhile is abandoned, not forgotten: at `heal()` its
      bytes (a HELLO, maybe DATA) are delivered upstream together with those
      of the connections still alive, and its upstream is held open a while,
      as a stale attempt's would be.

    `duplicated` and `stale` count what it did, so a test can tell the fault
    happened. Each link has a lock per direction: a direction blocked on a
    full socket never holds up the other one."""

    def __init__(self, target: tuple[str, int], *, duplicate: float = 0.0, seed: int = 0,
                 stale_hold: float = 2.0) -> None:
        import random

        self.target = target
        self.duplicate = duplicate
        self.stale_hold = stale_hold
        self.rng = random.Random(seed)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.forwarding = True
        self.lock = threading.Lock()  # guards `links`, `rng` and the counters
        self.links: list[_Link] = []
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.attempts = 0
        self.duplicated = 0
        self.stale = 0

    def __enter__(self) -> Relay:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.listener.close()
        with self.lock:
            links = list(self.links)
        for link in links:
            link.close()
        for t in self.threads:
            t.join(5)
        for link in links:
            for sock in link.socks:
                sock.close()

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def hole(self) -> None:
        self.forwarding = False

    def heal(self) -> None:
        """Forward again: what was held back goes now, abandoned attempts too, in random order."""
        self.forwarding = True
        with self.lock:
            links = list(self.links)
            self.rng.shuffle(links)
        for link in links:
            with link.up_lock:
                self._connect(link)
                link.flush_up()
            with link.down_lock:
                link.flush_down()

    def _accept(self) -> None:
        for client in accept_until(self.listener, self.stopping):
            link = _Link(client)
            with self.lock:
                self.links.append(link)
            if self.forwarding:
                with link.up_lock:
                    self._connect(link)
            self._spawn(self._from_client, link)

    def _connect(self, link: _Link) -> None:
        """Open the link's upstream connection(s), once (its up_lock held)."""
        if link.upstreams or link.closed:
            return
        with self.lock:
            # The first attempt is duplicated whenever any may be: every run meets the fault at least once.
            n = 2 if self.duplicate and (not self.attempts or self.rng.random() < self.duplicate) else 1
            self.attempts += 1
            first = self.rng.randrange(n)
        try:
            ups = [socket.create_connection(self.target, timeout=5) for _ in range(n)]
        except OSError:
            link.close()
            return
        for up in ups:
            up.settimeout(None)
        link.socks += ups
        with link.down_lock:
            link.primary = ups[-1]  # the one whose replies reach the client
        link.upstreams = ups[first:] + ups[:first]  # the order each chunk is sent in
        with self.lock:
            self.duplicated += n - 1
            self.stale += link.client_gone
        if link.client_gone:
            self._spawn(self._close_later, link)
        for up in ups:
            self._spawn(self._from_upstream, link, up)

    def _close_later(self, link: _Link) -> None:
        with self.lock:
            hold = self.rng.uniform(0, self.stale_hold)
        self.stopping.wait(hold)
        link.close()

    HOLD = 1 << 20  # bytes held back per connection in a black hole; then TCP pushes back, as on a full path

    def _from_client(self, link: _Link) -> None:
        while True:
            while not self.forwarding and len(link.to_upstream) >= self.HOLD and not self.stopping.is_set():
                self.stopping.wait(0.05)
            try:
                data = link.client.recv(65536)
            except OSError:
                data = b""
            with link.up_lock:
                if not data:
                    link.client_gone = True
                    if self.forwarding:
                        link.flush_up()
                        link.close()  # a working relay passes the close on
                    return  # held back: delivered at heal(), as an abandoned attempt
                link.to_upstream += data
                if self.forwarding:
                    link.flush_up()

    def _from_upstream(self, link: _Link, up: socket.socket) -> None:
        while True:
            try:
                data = up.recv(65536)
            except OSError:
                data = b""
            with link.down_lock:
                if up is not link.primary:
                    if not data:
                        return
                    continue  # a duplicate's replies: dropped
                if not data:
                    link.close()
                    return
                link.to_client += data
                if self.forwarding:
                    link.flush_down()


class _Link:
    """One client connection of a Relay and its upstream connection(s)."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.up_lock = threading.Lock()  # client -> upstreams: `upstreams`, `to_upstream`, `client_gone`
        self.down_lock = threading.Lock()  # primary -> client: `primary`, `to_client`
        self.upstreams: list[socket.socket] = []
        self.primary: socket.socket | None = None
        self.to_upstream = bytearray()
        self.to_client = bytearray()
        self.client_gone = False
        self.closed = False
        self.socks = [client]  # every socket it opened, closed when the relay stops

    def flush_up(self) -> None:
        if self.to_upstream and self.upstreams:
            for up in list(self.upstreams):
                try:
                    up.sendall(self.to_upstream)
                except OSError:
                    self.upstreams.remove(up)
            self.to_upstream.clear()

    def flush_down(self) -> None:
        if self.to_client:
            try:
                self.client.sendall(self.to_client)
            except OSError:
                pass
            self.to_client.clear()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in self.socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def shadow_in_ns(ns: NetNS, root: Path, logdir: Path, port: int = 0, extra: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """Start gcshadow inside the namespace; return (process, port)."""
    gcshadow = shutil.which("gcshadow")
    assert gcshadow
    port_file = logdir / f"ns-port-{time.monotonic_ns()}"
    with open(logdir / "ns-shadow.log", "ab") as log:  # (the child keeps its own copy)
        proc = subprocess.Popen(
            # --insecure: a test host inside a namespace this test made, reachable from nowhere else.
            [*ns.prefix(), gcshadow, "serve", "--host", NS_IP, "--port", str(port), "--root", str(root),
             "--port-file", str(port_file), "--insecure", *extra],
            stdout=log, stderr=log, start_new_session=True, env=env,
        )
    NS_SHADOWS.append(proc)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"gcshadow in the namespace did not start: {(logdir / 'ns-shadow.log').read_text()}")
        time.sleep(0.02)
    return proc, int(port_file.read_text())


NS_SHADOWS: list[subprocess.Popen[bytes]] = []


def kill_ns_shadows() -> None:
    """Stop, by PID, every shadow `shadow_in_ns` started that its test left
    running (a test that failed before its own stop): none outlives its test."""
    for proc in NS_SHADOWS:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the shadow and anything it started
            except ProcessLookupError:
                pass
            proc.wait(10)
    NS_SHADOWS.clear()


class StallRelay(Middlebox):
    """A middlebox on loopback: relays TCP both ways, and while stalled keeps
    reading both directions but forwards nothing, then forwards again.

    The peers see a live connection throughout (every byte sent to the relay
    is taken, TCP-acknowledged, at once); what was read during a stall is
    gone. With `frames=True` the relay drops whole gcwrap frames (`u32 length
    | u8 type | body`; the agent's side starts with an 8-byte magic), so what follows a stall still
    parses: the peers see frames vanish, not garbage. `only` limits a stall
    to frames of those types (say, DONE), to make one kind of answer vanish.
    With `frames=False` it drops raw bytes, as a byte-level middlebox would.
    """

    MAGIC = 8
    HEADER = 5

    def __init__(self, target: tuple[str, int], frames: bool = True) -> None:
        super().__init__(target)
        self.frames = frames
        self.lock = threading.Lock()
        self.until = 0.0
        self.only: frozenset[int] = frozenset()
        self.dropped = 0  # frames (or reads) dropped

    def stall(self, seconds: float, only: Sequence[int] = ()) -> None:
        """Forward nothing (or no frame of the types `only`) for `seconds`, from now."""
        with self.lock:
            self.only = frozenset(only)
            self.until = time.monotonic() + seconds

    def _stalled(self, frame_type: int | None) -> bool:
        with self.lock:
            if time.monotonic() >= self.until:
                return False
            return not self.only or frame_type in self.only

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        """One direction; from the agent, its magic precedes the first frame."""
        magic = self.MAGIC if upstream else 0
        buf = b""
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            if not self.frames:
                if self._stalled(None):
                    self.dropped += 1
                    continue
                out = data
            else:
                buf += data
                out = b""
                if magic:
                    take = min(magic, len(buf))
                    out, buf, magic = buf[:take], buf[take:], magic - take
                while len(buf) >= self.HEADER:
                    end = 4 + int.from_bytes(buf[:4], "big")
                    if len(buf) < end:
                        break
                    frame, buf = buf[:end], buf[end:]
                    if self._stalled(frame[4]):
                        self.dropped += 1
                    else:
                        out += frame
            try:
                if out:
                    dst.sendall(out)
            except OSError:
                break
        for s in (dst, src):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
