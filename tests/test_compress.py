"""Compression: the codec (bounded, exact) and the policy that decides when
compressing pays, driven through a simulated link under trio's autojump clock."""

from __future__ import annotations

import os
import random
from collections import deque
from dataclasses import dataclass

import pytest
import trio
import trio.testing
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from gcwrap.agent.pathwindow import FLOOR, PathWindow
from gcwrap.wire.codec import MAX_PAYLOAD
from gcwrap.wire.compress import (
    MIN_SIZE,
    PROBE_EVERY,
    QUIET_OFF,
    Codec,
    CodecError,
    Mode,
    Policy,
)

pytestmark = pytest.mark.timeout(60)

CODEC = Codec()


def log_text(n: int, seed: int = 1) -> bytes:
    """Log-like output: repetitive lines with changing numbers."""
    rnd = random.Random(seed)
    out = bytearray()
    i = 0
    while len(out) < n:
        out += (f"2026-11-23T18:{i % 60:02d}:{i % 60:02d}.{i:06d} INFO worker[{i % 16}] step {i} "
                f"loss={rnd.random():.6f} lr=0.0003 grad_norm={rnd.random() * 10:.4f}\n").encode()
        i += 1
    return bytes(out[:n])


# -- the codec -----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=70000) | st.builds(log_text, st.integers(1, 300000)))
def test_the_codec_gives_back_exactly_what_it_took(data: bytes) -> None:
    blob = CODEC.compress(data)
    assert CODEC.decompress(blob, len(data)) == data
    assert CODEC.decompress(memoryview(blob), len(data)) == data


def test_log_text_compresses_well_and_random_bytes_do_not() -> None:
    text, noise = log_text(1 << 20), os.urandom(1 << 20)
    assert len(CODEC.compress(text)) < 0.3 * len(text)
    assert len(CODEC.compress(noise)) > 0.99 * len(noise)


def test_a_frame_that_announces_more_than_the_header_is_refused_before_it_is_inflated() -> None:
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (64 << 20))  # 64 MiB in ~2 KiB
    assert len(bomb) < 8192
    with pytest.raises(CodecError, match="holds 67108864 bytes"):
        CODEC.decompress(bomb, 1 << 20)


def test_a_frame_that_does_not_announce_its_size_is_refused() -> None:
    blob = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\0" * (64 << 20))
    with pytest.raises(CodecError):
        CODEC.decompress(blob, 1 << 20)


@pytest.mark.parametrize("damage", ["truncated", "trailing bytes", "two frames", "not zstd", "flipped"])
def test_a_damaged_frame_is_refused(damage: str) -> None:
    data = log_text(100000)
    blob = CODEC.compress(data)
    size = len(data)
    if damage == "truncated":
        blob = blob[:-10]
    elif damage == "trailing bytes":
        blob += b"junk"
    elif damage == "two frames":
        blob += CODEC.compress(b"more")
    elif damage == "not zstd":
        blob = b"plain text, no magic number" * 10
    else:
        middle = len(blob) // 2
        blob = blob[:middle] + bytes([blob[middle] ^ 0xFF]) + blob[middle + 1:]
    try:
        out = CODEC.decompress(blob, size)
    except CodecError:
        return
    # zstd without checksums may decode a flipped literal: never to a wrong length.
    assert damage == "flipped" and len(out) == size and out != data


# -- the policy, through a simulated link ----------------------------------------


@dataclass
class Link:
    """A socket's send queue of `queue` bytes, drained at `rate` bytes/s."""

    rate: float
    queue: int = 4 << 20  # the kernel grows a TCP send buffer to 4 MiB by default
    held: float = 0.0
    at: float = 0.0

    def drain(self, now: float) -> None:
        self.held = max(0.0, self.held - (now - self.at) * self.rate)
        self.at = now

    def fill(self) -> float:
        return self.held / self.queue


@dataclass
class Run:
    job_bytes: int = 0
    wire_bytes: int = 0
    cpu: float = 0.0
    compressed_frames: int = 0
    frames: int = 0
    small_frames: int = 0  # under MIN_SIZE
    finished: float = 0.0


async def simulate(
    mode: Mode,
    link_rate: float,
    job_rate: float,
    seconds: float,
    ratio: float | list[tuple[float, float]] = 0.18,
    speed: float = 700e6,
    frame: int = 256 << 10,
) -> tuple[Run, Policy]:
    """A job writing `job_rate` bytes/s for `seconds`, its output compressing
    to `ratio` (or a schedule of (from time, ratio)), sent through a link of
    `link_rate`; the sender asks the policy before every frame, as gcwrap's does."""
    now = trio.current_time
    start = now()
    policy = Policy(mode, now())
    link = Link(link_rate, at=now())
    run = Run()
    produced = 0.0
    sent = 0

    def ratio_at(t: float) -> float:
        if isinstance(ratio, float):
            return ratio
        return [r for since, r in ratio if t - start >= since][-1]

    while True:
        t = now()
        produced = min(job_rate * min(t - start, seconds), job_rate * seconds)
        backlog = int(produced) - sent
        if backlog <= 0:
            if t - start >= seconds:
                break
            policy.tick(t, 0)
            await trio.sleep(0.001)  # gcwrap's sender wakes at every pipe read
            continue
        size = min(backlog, frame)
        wire = size
        if policy.wants(t, size):
            r = ratio_at(t)
            cpu = size / speed
            wire = max(1, int(size * r))
            run.cpu += cpu
            await trio.sleep(cpu)
            policy.compressed(now(), size, wire, cpu)
            if wire >= size:
                wire = size  # sent as it is
            else:
                run.compressed_frames += 1
        link.drain(now())
        while link.held + wire > link.queue:  # wait until the kernel takes it
            await trio.sleep((link.held + wire - link.queue) / link.rate + 1e-6)
            link.drain(now())
        link.held += wire
        sent += size
        run.frames += 1
        run.small_frames += size < MIN_SIZE
        run.job_bytes += size
        run.wire_bytes += wire
        policy.sent(now(), size, wire, link.fill(), int(produced) - sent)
    await trio.sleep(link.held / link.rate)
    run.finished = now() - start
    return run, policy


async def test_a_slow_link_and_log_output_turn_compression_on(autojump_clock: trio.testing.MockClock) -> None:
    none, _ = await simulate(Mode.NONE, 2e6, 20e6, 20)
    started = trio.current_time()
    auto, policy = await simulate(Mode.AUTO, 2e6, 20e6, 20)
    assert none.compressed_frames == 0
    assert policy.active and policy.history[0][1] is True
    assert policy.history[0][0] - started < 5.0, "it took too long to notice the link is the bottleneck"
    assert auto.finished * 3 <= none.finished, (auto.finished, none.finished)
    assert auto.job_bytes == none.job_bytes == 400_000_000


async def test_a_fast_link_never_pays_for_compression(autojump_clock: trio.testing.MockClock) -> None:
    # Loopback: the link drains 1 GB/s; the job writes 600 MB/s of log text.
    run, policy = await simulate(Mode.AUTO, 1e9, 600e6, 10)
    assert not policy.history and run.compressed_frames <= 1  # the first frame is a probe
    # ... and a shadow that drains slower than the job writes, but fast: still
    # not worth a core. Only the probes compress, and they cost next to nothing.
    run, policy = await simulate(Mode.AUTO, 400e6, 600e6, 10)
    assert not policy.history and run.compressed_frames <= run.finished / PROBE_EVERY + 1
    assert run.cpu <= 0.001 * run.finished


async def test_incompressible_output_is_only_probed(autojump_clock: trio.testing.MockClock) -> None:
    run, policy = await simulate(Mode.AUTO, 2e6, 20e6, 30, ratio=1.0)
    assert not policy.active and run.compressed_frames == 0
    seconds = run.finished
    probes = run.cpu / ((256 << 10) / 700e6)
    assert probes <= seconds / PROBE_EVERY + 1


async def test_output_that_stops_compressing_turns_it_off(autojump_clock: trio.testing.MockClock) -> None:
    _, policy = await simulate(Mode.AUTO, 2e6, 20e6, 20, ratio=[(0.0, 0.18), (8.0, 1.0)])
    assert [on for _, on in policy.history] == [True, False]


async def test_a_job_that_quiets_down_turns_it_off(autojump_clock: trio.testing.MockClock) -> None:
    # 30 MB at 20 MB/s, then nothing: once the backlog is gone, the link is idle.
    _, policy = await simulate(Mode.AUTO, 2e6, 20e6, 1.5)
    assert policy.active
    for _ in range(int(QUIET_OFF * 100) + 200):
        policy.tick(trio.current_time(), 0)
        await trio.sleep(0.01)
    assert not policy.active and [on for _, on in policy.history] == [True, False]


async def test_output_that_fits_the_link_is_not_compressed(autojump_clock: trio.testing.MockClock) -> None:
    run, policy = await simulate(Mode.AUTO, 10e6, 2e6, 20)
    assert not policy.history and run.compressed_frames <= 1  # the probe


async def test_zstd_compresses_every_frame_that_shrinks_and_none_none(
        autojump_clock: trio.testing.MockClock) -> None:
    run, _ = await simulate(Mode.ZSTD, 1e9, 100e6, 2, frame=64 << 10)
    assert run.compressed_frames == run.frames - run.small_frames > 0
    run, _ = await simulate(Mode.ZSTD, 1e9, 100e6, 2, ratio=1.0)
    assert run.compressed_frames == 0 and run.cpu > 0
    run, _ = await simulate(Mode.NONE, 2e6, 20e6, 5)
    assert run.compressed_frames == 0 and run.cpu == 0


def test_small_frames_are_never_compressed() -> None:
    for mode in Mode:
        policy = Policy(mode, 0.0)
        assert not policy.wants(0.0, MIN_SIZE - 1)


# -- the whole path: a cap on what it holds, and how long a byte waits in it -------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "ack", "late", "time"]), st.integers(0, 1 << 20),
                          st.floats(0.0, 2.0)), max_size=120))
def test_the_path_never_holds_more_than_its_cap_and_a_frame(steps: list[tuple[str, int, float]]) -> None:
    # A sender that sends only while there is room, and a shadow that
    # acknowledges any prefix of what it got, at any time; "late": the ACK
    # of a frame comes before the sender reports the frame sent.
    now, path = 0.0, PathWindow(0.0)
    frames: list[tuple[int, int]] = []  # (end, wire) sent
    acked = end = 0
    for kind, n, dt in steps:
        if kind == "time":
            now += dt
        elif kind in ("send", "late") and path.room() > 0:
            size = max(1, min(n, MAX_PAYLOAD))
            end += size
            wire = max(1, size // (1 + n % 5))
            frames.append((end, wire))
            if kind == "late":
                acked = end
                path.acked(now, 0, acked)
            path.sent(now, 0, end, wire)
            assert path.in_flight <= path.cap() + MAX_PAYLOAD
        elif kind == "ack" and end > acked:
            acked = min(end, acked + n)
            path.acked(now, 0, acked)
        # What it counts in flight is exactly the frames not yet covered by an ACK.
        assert path.in_flight == sum(w for e, w in frames if e > acked) >= 0
        assert path.wait(now) >= 0 and path.cap() >= FLOOR
    path.acked(now, 0, end)
    assert path.in_flight == 0 and path.room() > 0  # never stuck: once all is acknowledged there is room


@dataclass
class Relayed:
    finished: float = 0.0
    wire_bytes: int = 0
    compressed_frames: int = 0
    most: int = 0  # the most the relay held
    turned_on: float | None = None


def through_relay(mode: Mode, rate: float, job_rate: float, total: int, ratio: float = 0.2,
                  latency: float = 0.005, frame: int = 1 << 20, speed: float = 700e6) -> Relayed:
    """`total` job bytes written at `job_rate` through a relay that takes
    everything at once and forwards `rate` bytes/s (the agent's socket queue
    stays empty), acknowledged `latency` after they land; the sender keeps
    to the path's cap (with auto) and asks the policy before every frame."""
    dt = 0.001
    t, sent, held = 0.0, 0, 0
    policy = Policy(mode, t)
    path = PathWindow(t) if mode is Mode.AUTO else None
    relay: deque[list[int]] = deque()  # [end, wire bytes left]
    acks: deque[tuple[float, int]] = deque()
    run = Relayed()
    while sent < total or relay or acks:
        produced = min(int(job_rate * t), total)
        budget = rate * dt
        while relay and budget > 0:
            take = min(budget, relay[0][1])
            relay[0][1] -= int(take) if take < relay[0][1] else relay[0][1]
            budget -= take
            held -= int(take)
            if relay[0][1] <= 0:
                acks.append((t + latency, relay.popleft()[0]))
        while acks and acks[0][0] <= t:
            _, end = acks.popleft()
            if path is not None:
                path.acked(t, 0, end)
                policy.waited(t, path.wait(t), produced - sent)
        while produced > sent and (path is None or path.room() > 0):
            size = min(produced - sent, frame)
            wire = size
            if policy.wants(t, size):
                compressed = int(size * ratio)
                policy.compressed(t, size, compressed, size / speed)
                if compressed < size:
                    wire = compressed
                    run.compressed_frames += 1
            sent += size
            relay.append([sent, wire])
            held += wire
            run.most = max(run.most, held)
            run.wire_bytes += wire
            wait = 0.0
            if path is not None:
                path.sent(t, 0, sent, wire)
                wait = path.wait(t)
            policy.sent(t, size, wire, 0.0, produced - sent, wait)
            if policy.active and run.turned_on is None:
                run.turned_on = t
        t += dt
    run.finished = t
    return run


def test_a_buffering_relay_and_log_output_turn_compression_on() -> None:
    none = through_relay(Mode.NONE, 2e6, 20e6, 40_000_000)
    auto = through_relay(Mode.AUTO, 2e6, 20e6, 40_000_000)
    assert none.compressed_frames == 0 and none.most > 30_000_000  # the relay took it all
    assert auto.turned_on is not None and auto.turned_on < 2.0, auto
    assert auto.most <= FLOOR + MAX_PAYLOAD
    assert auto.finished * 2.5 <= none.finished, (auto.finished, none.finished)


def test_a_buffering_relay_and_random_bytes_leave_it_off() -> None:
    none = through_relay(Mode.NONE, 2e6, 20e6, 8_000_000, ratio=1.0)
    auto = through_relay(Mode.AUTO, 2e6, 20e6, 8_000_000, ratio=1.0)
    assert auto.turned_on is None and auto.compressed_frames == 0
    assert auto.finished <= none.finished / 0.95, (auto.finished, none.finished)


def test_a_fast_path_is_neither_capped_nor_compressed() -> None:
    # Loopback: 1 GB/s, acknowledged within 5 ms; the job writes 600 MB/s of log text.
    none = through_relay(Mode.NONE, 1e9, 600e6, 1_200_000_000)
    auto = through_relay(Mode.AUTO, 1e9, 600e6, 1_200_000_000)
    assert auto.turned_on is None and auto.compressed_frames <= 1  # the first frame is a probe
    assert auto.finished <= none.finished + 0.01, (auto.finished, none.finished)


def test_output_that_does_not_compress_is_never_held_back_for_it() -> None:
    """The path's cap holds output back only while it may still go compressed:
    before the first probe, or while probes shrink it; random bytes go as fast
    as the path drains (a write-behind or a loaded shadow is not slowed for them)."""
    p = Policy(Mode.AUTO, 0.0)
    assert p.may_compress()  # (not yet probed)
    assert p.wants(0.0, 128 << 10)  # the first large frame is a probe
    p.compressed(0.0, 128 << 10, 128 << 10, 0.001)  # ...and did not shrink
    assert not p.may_compress()
    q = Policy(Mode.AUTO, 0.0)
    assert q.wants(0.0, 128 << 10)
    q.compressed(0.0, 128 << 10, 32 << 10, 0.001)  # log text: a quarter
    assert q.may_compress()
