"""Compression of output on slow links: the codec, and the policy that decides.

A DATA frame may travel compressed (a ZDATA frame) once both sides said so in
the handshake. Each frame is one complete zstd frame of the job's bytes
[offset, offset + size): offsets, ACKs, resumes and the spool are all counted
in the job's own bytes, so nothing about exactly-once changes, and any frame
can be decoded alone (a reconnection starts anywhere).

Compression pays only when the path, not the CPU, is what holds the output
back, and only when the output compresses. `Policy` decides from what the
sender sees: how long a byte waits between leaving the agent and being
acknowledged while output waits to be sent (`gcwrap.agent.pathwindow`: the
whole path, middleboxes that buffer included), how full the socket's send
queue is (a full queue means the first hop drains slower than we fill it),
the rate the path drains at, the ratio recent frames compressed to, and how
fast compressing runs on this CPU. It
is pure: the sender tells it what happened and when (`now` from
`trio.current_time()`), and asks it before each frame.
"""

from __future__ import annotations

import enum
import importlib.util
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

FEATURE = "zstd"  # the name both sides use for it in HELLO and WELCOME
LEVEL = 1  # zstd's fastest levels compress log text 5-6x at ~700 MB/s per core here
MIN_SIZE = 1024  # frames smaller than this are not worth a compressor's call
FIRST_PROBE = 64 << 10  # the first frame at least this large is compressed to learn the ratio early


class Mode(enum.Enum):
    """`--compress`: when the agent compresses output on the wire."""

    AUTO = "auto"  # when the link is the bottleneck and the output compresses
    ZSTD = "zstd"  # every frame that gets smaller
    NONE = "none"  # never (and the handshake does not offer it)


class CodecError(Exception):
    """A compressed frame that does not decode to exactly what it announced."""


def available() -> bool:
    """Whether this Python can compress (the `zstandard` package is
    installed), without importing it: start-up pays nothing for it."""
    return importlib.util.find_spec("zstandard") is not None


class Codec:
    """zstd, one complete frame per DATA frame. Decoding is bounded: a frame
    must announce its size, and that size must be the one the wire header
    gave, so a small frame cannot make the receiver allocate a large one."""

    def __init__(self, level: int = LEVEL) -> None:
        import zstandard  # here, not at module level: only a compressing run loads it

        self._zstd: Any = zstandard
        self._c = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        self._d = zstandard.ZstdDecompressor()

    def compress(self, data: bytes | memoryview) -> bytes:
        return bytes(self._c.compress(data))

    def decompress(self, blob: bytes | memoryview, size: int) -> bytes:
        """The `size` bytes `blob` holds, or CodecError."""
        zstd = self._zstd
        try:
            announced = zstd.frame_content_size(blob)
        except zstd.ZstdError as e:
            raise CodecError(f"not a zstd frame: {e}") from None
        if announced != size:
            raise CodecError(f"the zstd frame holds {announced} bytes, the frame header says {size}")
        d = self._d.decompressobj()
        try:
            out = d.decompress(blob)
        except zstd.ZstdError as e:
            raise CodecError(f"corrupt zstd frame: {e}") from None
        if len(out) != size or not d.eof or d.unused_data:
            raise CodecError("the zstd frame is truncated or followed by other bytes")
        return bytes(out)


_codec: Codec | None = None


def codec() -> Codec:
    """The process's codec (made on first use)."""
    global _codec
    if _codec is None:
        _codec = Codec()
    return _codec


def timed_compress(data: bytes | memoryview) -> tuple[bytes, float]:
    """`data` compressed, and the CPU seconds it took this thread."""
    start = time.thread_time()
    blob = codec().compress(data)
    return blob, time.thread_time() - start


@dataclass
class WireStats:
    """What a run sent: job bytes (resends included), the bytes they took on
    the wire, and the job bytes that went compressed. One per run, shared by
    its sessions."""

    job_bytes: int = 0
    wire_bytes: int = 0
    compressed_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"job_bytes": self.job_bytes, "wire_bytes": self.wire_bytes, "compressed_bytes": self.compressed_bytes}

    def summary(self, total: int) -> dict[str, float]:
        """The I/O summary's figures, for a job that wrote `total` bytes."""
        return {"wire_bytes": self.wire_bytes,  # what this run sent, compressed or not, resends included
                "compressed_pct": round(100 * self.compressed_bytes / total, 1) if total else 0.0}


def offered(mode: Mode) -> tuple[str, ...]:
    """The features a HELLO offers for `--compress mode`."""
    return (FEATURE,) if mode is not Mode.NONE and available() else ()


# -- the policy ---------------------------------------------------------------

WINDOW = 0.5  # seconds of sends a verdict on the link is made from
FULL_QUEUE = 0.5  # a send that leaves the socket's queue this full waited on the link
SLOW_PATH = 0.5  # a send made while bytes wait this long to be acknowledged (and more wait to go) waited on the path
BOUND_SHARE = 0.5  # the link is the bottleneck when this share of a window's sends found it full
GOOD_RATIO = 0.8  # compress only what shrinks to this or less
CPU_BUDGET = 0.25  # keeping up with the link may take at most this share of a core
PROBE_EVERY = 2.0  # seconds between trial compressions while not compressing
QUIET_OFF = 5.0  # seconds the raw output must fit the link before compression stops
_SMOOTH = 0.3  # weight of the newest sample in the running averages


@dataclass
class _Window:
    """What one window of a Policy saw of the sends and the path (reset at each window's end)."""

    start: float
    sends: int = 0
    full_sends: int = 0  # sends that found the socket's queue full, or the path slow
    wire: int = 0
    raw: int = 0
    backlog_start: int = 0  # job bytes waiting to be sent, as the window began
    backlog: int = 0  # ...and at the latest report
    slow_time: float = 0.0  # seconds of this window the path was slow (`SLOW_PATH`) with output waiting
    slow: bool = False  # whether it was at the latest look (carried into the next window)
    looked: float = 0.0  # when that was

    def look(self, now: float, wait: float, backlog: int) -> bool:
        """Count the time since the last look as slow if it was, and note whether it is now."""
        if self.slow:
            self.slow_time += max(0.0, now - max(self.looked, self.start))
        self.looked = now
        self.slow = wait >= SLOW_PATH and backlog > 0
        return self.slow

    def next(self, now: float) -> _Window:
        """The window that begins as this one ends."""
        return _Window(now, backlog_start=self.backlog, backlog=self.backlog, slow=self.slow, looked=self.looked)


@dataclass
class Policy:
    """When the sender compresses: a pure object fed by the sender.

    `auto` compresses while (1) the link is the bottleneck: most sends of the
    last window left the socket's send queue at least half full, or the path
    was slow for most of it (a byte waited `SLOW_PATH` or more to be
    acknowledged while output waited to be sent), (2) the
    output compresses: recent frames shrank to `GOOD_RATIO` or less, and
    (3) compressing at the link's rate costs at most `CPU_BUDGET` of a core,
    so a fast link (loopback, a LAN) never pays for it. While it is off and
    the link is the bottleneck it compresses one frame every `PROBE_EVERY`
    seconds to learn (2) and (3). It stops when the output turns
    incompressible, or when the job's raw output would have fitted the link
    for `QUIET_OFF` seconds.
    """

    mode: Mode
    now: float
    active: bool = False
    ratio: float = 1.0  # running average of wire bytes / job bytes of compressed frames
    speed: float = 0.0  # running average of job bytes compressed per CPU second
    link_rate: float = 0.0  # wire bytes per second the link drained while it was the bottleneck
    _window_start: float = 0.0
    _sends: int = 0
    _full_sends: int = 0
    _wire: int = 0
    _raw: int = 0
    _backlog_start: int = 0
    _backlog: int = 0
    produced_rate: float = 0.0  # job bytes per second the job wrote, last window
    _bound: bool = False
    _last_probe: float = float("-inf")
    _fits_since: float | None = None
    _w: _Window = field(init=False)  # what the current window saw
    # (when, active): the latest decisions, for logs and tests (bounded: a long job may switch often)
    history: deque[tuple[float, bool]] = field(default_factory=lambda: deque(maxlen=64))

    def __post_init__(self) -> None:
        self._w = _Window(self.now)
        self.active = self.mode is Mode.ZSTD

    def wants(self, now: float, size: int) -> bool:
        """Whether the next frame of `size` job bytes should be compressed."""
        if self.mode is Mode.NONE or size < MIN_SIZE:
            return False
        if self.mode is Mode.ZSTD or self.active:
            return True
        # Probe the first frame (so the ratio and the speed are known when the
        # first window tells whether the link is the bottleneck), then only
        # while it is.
        first = self._last_probe == float("-inf") and size >= FIRST_PROBE
        if (first or self._bound) and now - self._last_probe >= PROBE_EVERY:
            self._last_probe = now
            return True
        return False

    def compressed(self, now: float, size: int, wire: int, cpu: float) -> None:
        """A frame of `size` job bytes compressed to `wire` bytes in `cpu` seconds."""
        r = wire / size
        self.ratio = r if self.ratio >= 1.0 and not self.active else self.ratio + _SMOOTH * (r - self.ratio)
        if cpu > 0:
            s = size / cpu
            self.speed = s if not self.speed else self.speed + _SMOOTH * (s - self.speed)
        self._decide(now)

    def sent(self, now: float, raw: int, wire: int, queue_fill: float, backlog: int, wait: float = 0.0) -> None:
        """A frame went out: `raw` job bytes as `wire` bytes, after which the
        socket's send queue was `queue_fill` (0..1) full, `backlog` job
        bytes were still waiting to be sent, and a byte waited `wait`
        seconds in the path to be acknowledged (`PathWindow.wait`)."""
        w = self._w
        w.backlog = backlog
        w.sends += 1
        slow = w.look(now, wait, backlog)
        w.full_sends += queue_fill >= FULL_QUEUE or slow
        w.wire += wire
        w.raw += raw
        if now - w.start >= WINDOW:
            self._close_window(now)

    def waited(self, now: float, wait: float, backlog: int) -> None:
        """An ACK came: a byte now waits `wait` seconds in the path, and
        `backlog` job bytes wait to be sent. While the sender is held back
        (`PathWindow.cap`) only ACKs tell how long the path stays slow."""
        self._w.look(now, wait, backlog)

    def may_compress(self) -> bool:
        """Whether output held back could still go compressed: not yet
        probed, or it shrinks to `GOOD_RATIO` or less. Output that does not
        compress (random bytes, compressed files) is never held back for it:
        the path takes it as fast as it drains."""
        return self._last_probe == float("-inf") or self.ratio <= GOOD_RATIO

    def window_ends(self, now: float) -> bool:
        """Whether the next report closes the current window."""
        return now - self._w.start >= WINDOW

    def tick(self, now: float, backlog: int = 0) -> None:
        """Time passes with nothing sent: the link is not the bottleneck."""
        self._w.backlog = backlog
        if now - self._w.start >= WINDOW:
            self._close_window(now)

    def _close_window(self, now: float) -> None:
        w = self._w
        span = now - w.start
        self._bound = ((w.sends > 0 and w.full_sends >= BOUND_SHARE * w.sends)
                       or w.slow_time >= BOUND_SHARE * span)
        raw_rate = w.raw / span
        self.produced_rate = max(0.0, (w.raw + w.backlog - w.backlog_start) / span)
        if self._bound:
            rate = w.wire / span
            self.link_rate = rate if not self.link_rate else self.link_rate + _SMOOTH * (rate - self.link_rate)
        # The raw output fits the link when it would not fill it uncompressed.
        fits = not self._bound and (not self.link_rate or raw_rate < 0.8 * self.link_rate)
        if not fits:
            self._fits_since = None
        elif self._fits_since is None:
            self._fits_since = now
        self._w = w.next(now)
        self._decide(now)

    def _decide(self, now: float) -> None:
        if self.mode is not Mode.AUTO:
            return
        # Compressed, the link carries link_rate / ratio job bytes a second,
        # or what the job writes if that is less: the CPU must keep up with it.
        need = min(self.link_rate / max(self.ratio, 1e-3), max(self.produced_rate, self.link_rate))
        pays = (
            self.ratio <= GOOD_RATIO
            and self.speed > 0
            and self.link_rate > 0
            and need <= CPU_BUDGET * self.speed
        )
        if not self.active:
            on = self._bound and pays
        else:
            quiet = self._fits_since is not None and now - self._fits_since >= QUIET_OFF
            on = pays and not quiet
        if on != self.active:
            self.active = on
            self.history.append((now, on))
