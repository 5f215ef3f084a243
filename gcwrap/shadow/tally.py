"""Histograms the shadow keeps for its metrics, counted in place: an
observation is a bisect and two additions, with nothing imported (the
metrics' library is optional). They are read when scraped (`metrics.py`).

Each is observed by one thread only (the durability thread, or the event
loop); a scrape from the event loop may see one observation half counted,
which the next scrape shows whole."""

from __future__ import annotations

from bisect import bisect_left

# Seconds: from 100 µs (a batch on tmpfs) to 10 s (a sync on a struggling file system).
SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Bytes of a durable group: from a line to the largest group (pacing.GroupOptions.full and more).
BYTES = tuple(float(1 << n) for n in range(6, 27, 2))


class Tally:
    """A histogram: how many observations fell at or below each bound (and past the last), and their sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # (the last: past every bound)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative counts by upper bound, "+Inf" last, as Prometheus has them."""
        out, total = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), list(self.counts)):
            total += n
            out.append((bound, total))
        return out
