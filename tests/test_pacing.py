"""The pacing of durable groups under bulk output (gcwrap.shadow.pacing): a
pure object, told the time, shared by the streams' batches and the files' groups."""

from __future__ import annotations

import pytest

from gcwrap.shadow.pacing import GroupOptions, Pacing

pytestmark = pytest.mark.timeout(10)

OPTS = GroupOptions(bulk=100, full=1000, interval=2.0, idle=0.5)


def test_a_group_after_a_small_one_never_waits() -> None:
    p = Pacing(OPTS)
    p.mark(10, now=0.0)
    assert p.take(now=0.0) == 10
    p.mark(10, now=0.1)
    assert p.wait(now=0.1) == 0.0


def test_after_a_bulk_group_the_next_waits_for_the_first_bound() -> None:
    p = Pacing(OPTS)
    p.mark(100, now=0.0)
    assert p.take(now=1.0) == 100  # bulk: the next group waits to fill
    assert p.wait(now=1.0) == 0.0  # no frame since 0.0: the idle bound (0.0 + 0.5) has passed
    assert not p.mark(10, now=1.2)
    assert p.wait(now=1.2) == pytest.approx(0.5)  # a frame at 1.2: idle until 1.7
    for t in (1.4, 1.8, 2.2, 2.6):  # frames keep coming: the interval since the take (1.0 + 2.0) ends the wait
        p.mark(10, now=t)
    assert p.wait(now=2.8) == pytest.approx(0.2)
    assert p.wait(now=3.0) == 0.0


def test_a_full_group_goes_at_once() -> None:
    p = Pacing(OPTS)
    p.mark(500, now=0.0)
    p.take(now=0.0)
    assert not p.mark(999, now=0.1) and p.wait(now=0.1) > 0
    assert p.mark(1, now=0.1) and p.wait(now=0.1) == 0.0
    assert p.take(now=0.2) == 1000 and p.pending == 0
