"""How long a bulk reader lets the job's pipe fill (readers.BulkPacer).

The pacer saves CPU on a job writing bulk at a moderate rate (one read per
half pipe instead of one per block) and must never hold back a job that
writes as fast as it is read: naps of a millisecond or two, which a timer
makes longer, cost 1 GB at full speed 40 % of its throughput. Fed here with
the reads a job at a given rate makes (the clock is the test's).
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gcwrap.agent.readers import BULK_NAP_MAX, BULK_NAP_MIN, BULK_READ, RATE_WINDOW, BulkPacer

PIPE = 1 << 20
FILL = PIPE / 2


def naps_at(rate: float, seconds: float, block: int, seed: int = 1) -> list[float]:
    """The naps after each read of a job writing `block`-byte writes at
    `rate` bytes/s, each read taking what came since the last (the reader
    itself takes 0.1-0.6 ms a read, and sleeps what the pacer says)."""
    rng = random.Random(seed)
    now, pacer, naps = 0.0, BulkPacer(FILL, 0.0), []
    written = taken = 0.0
    while now < seconds:
        now += rng.uniform(0.0001, 0.0006)  # the reader's own work
        written = min(rate * now, taken + PIPE)  # (the pipe holds at most PIPE: then the job waits)
        size = int((written - taken) // block * block)
        if size <= 0:
            now = (taken + block) / rate  # (waits for the next write)
            continue
        taken += size
        nap = pacer.nap(size, now)
        naps.append(nap)
        now += nap
    return naps


def test_a_job_faster_than_a_half_pipe_per_min_nap_is_read_as_it_comes() -> None:
    """1.4 GB/s (head from the page cache) or 300 MB/s: no nap at all, not even
    for one small read after a large one (which once measured a slow rate)."""
    for rate in (1.4e9, 300e6):
        naps = naps_at(rate, 1.0, 4096)
        assert len(naps) > 500, len(naps)
        assert not any(naps), (rate, [n for n in naps if n][:5])


def test_a_moderate_bulk_writer_is_read_once_a_half_pipe() -> None:
    """64 KiB blocks at 30 MB/s: after the first window, a nap of about
    fill/rate (17 ms) after each read, so each read takes about half the
    pipe instead of one block."""
    naps = naps_at(30e6, 2.0, 64 << 10)
    later = naps[len(naps) // 4:]
    assert sum(1 for n in later if n) >= len(later) * 0.9, later[:20]
    expected = FILL / 30e6
    assert all(abs(n - expected) < expected * 0.3 for n in later if n), (expected, later[:20])
    assert len(naps) < 2.0 * 30e6 / (FILL * 0.5), len(naps)  # (one read per block would be ~900)


def test_a_slow_writer_naps_at_most_nap_max_and_a_full_pipe_never() -> None:
    pacer = BulkPacer(FILL, 0.0)
    assert pacer.nap(100_000, 0.01) == 0.0  # (no rate yet: the first window is not over)
    assert pacer.nap(100_000, RATE_WINDOW + 0.01) == BULK_NAP_MAX  # (200 kB in 60 ms: 3 MB/s, 150 ms to fill)
    assert pacer.nap(int(1.5 * FILL), RATE_WINDOW + 0.02) == 0.0  # (the pipe was 3/4 full: read again at once)
    assert pacer.nap(BULK_READ - 1, RATE_WINDOW + 0.03) == 0.0  # (not bulk: line output has its own gap)
    assert BulkPacer(0, 0.0).nap(100_000, 1.0) == 0.0  # (a small pipe: no naps)


@settings(max_examples=200, deadline=None)
@given(reads=st.lists(st.tuples(st.integers(0, PIPE), st.floats(0.0, 0.05)), min_size=1, max_size=200))
def test_a_nap_is_none_or_between_min_and_max_and_never_for_a_fast_job(reads: list[tuple[int, float]]) -> None:
    """Any reads at any moments: a nap is 0 or within [BULK_NAP_MIN,
    BULK_NAP_MAX], and none while the last whole window measured a job fast
    enough to fill `fill` within BULK_NAP_MIN."""
    pacer, now = BulkPacer(FILL, 0.0), 0.0
    for size, gap in reads:
        now += gap
        nap = pacer.nap(size, now)
        assert nap == 0.0 or BULK_NAP_MIN <= nap <= BULK_NAP_MAX, nap
        if pacer.rate * BULK_NAP_MIN >= FILL:
            assert nap == 0.0, (pacer.rate, nap)
        now += nap
