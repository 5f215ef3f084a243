"""The watchdog's rules (gcwrap.agent.liveness), under trio's autojump clock: no
test here sleeps. A small model of a link drives `watch` the way a session
does: it queues bytes, drains them at the link's rate, and answers (or not).
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import trio
import trio.testing

from gcwrap.agent.liveness import Liveness, Verdict, watch

HB = 0.5  # seconds between heartbeats (the slow-link chaos test's --heartbeat)
LIMIT = 3 * HB


class Link:
    """The agent's side of one connection, as the watchdog sees it: a send
    queue that drains at `rate` bytes/s, what the peer acknowledged, PONGs."""

    def __init__(self, liveness: Liveness, rate: float) -> None:
        self.liveness = liveness
        self.rate = rate
        self.queued = 0  # bytes in the kernel's send queue (not yet acknowledged by the peer's TCP)
        self.handed: dict[int, int] = {}  # per stream: bytes handed to the kernel
        self.acked: dict[int, int] = {}  # per stream: bytes the shadow acknowledged
        self.stdin_asked = False

    def probe(self) -> tuple[int, list[Hashable]]:
        waiting: list[Hashable] = [("data", s) for s, n in self.handed.items() if n > self.acked.get(s, 0)]
        if self.stdin_asked:
            waiting.append("stdin")
        return self.queued, waiting

    def send(self, stream: int, n: int) -> None:
        self.handed[stream] = self.handed.get(stream, 0) + n
        self.queued += n

    def ack(self, stream: int, offset: int) -> None:
        if offset > self.acked.get(stream, 0):
            self.acked[stream] = offset
            self.liveness.answered(("data", stream))

    async def drain(self) -> None:
        """The link carries the queue away at its rate (in steps of 10 ms)."""
        while True:
            await trio.sleep(0.01)
            self.queued = max(0, self.queued - int(self.rate * 0.01))

    async def pongs(self) -> None:
        """The peer answers every heartbeat (a middlebox passes these)."""
        while True:
            await trio.sleep(HB)
            self.liveness.heard(trio.current_time())


async def run_watch(liveness: Liveness, link: Link, bound: float) -> tuple[Verdict, float] | None:
    """`watch` until it gives a verdict (and when), or None after `bound` seconds."""
    with trio.move_on_after(bound):
        verdict = await watch(liveness, HB, link.probe)
        return verdict, trio.current_time()
    return None


async def test_a_slow_link_is_neither_silent_nor_stalled(autojump_clock: trio.testing.MockClock) -> None:
    """1.5 MB through 1 Mbit/s (12 s, eight times the limit): the queue is never
    empty until the end, and the shadow acknowledges what reaches it."""
    liveness = Liveness(HB, trio.current_time())
    link = Link(liveness, rate=125_000)
    total = 1_500_000

    async def shadow() -> None:
        # Acknowledges what went through, 50 ms after it did (a sync), in 64 KiB steps.
        while True:
            await trio.sleep(0.05)
            through = link.handed.get(1, 0) - link.queued
            link.ack(1, through - through % 65536 if through < total else total)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.drain)
        nursery.start_soon(link.pongs)
        nursery.start_soon(shadow)
        for _ in range(total // 100_000):
            link.send(1, 100_000)  # the job writes faster than the link carries it
        assert await run_watch(liveness, link, 40) is None
        assert link.acked[1] == total
        nursery.cancel_scope.cancel()


async def test_a_slow_shadow_that_answers_within_the_limit_is_alive(autojump_clock: trio.testing.MockClock) -> None:
    """Bytes leave at once (the queue is empty), and each ACK comes 2.5
    heartbeats later (a slow disk at home): slow, not stalled."""
    liveness = Liveness(HB, trio.current_time())
    link = Link(liveness, rate=1e9)

    async def job_and_shadow() -> None:
        for i in range(1, 20):
            link.send(1, 1000)
            await trio.sleep(2.5 * HB)
            link.ack(1, 1000 * i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.drain)
        nursery.start_soon(link.pongs)
        nursery.start_soon(job_and_shadow)
        assert await run_watch(liveness, link, 20 * 2.5 * HB) is None
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("streams", [[1], [1, 2]])
async def test_bytes_that_vanish_are_stalled_within_the_limit(autojump_clock: trio.testing.MockClock,
                                                              streams: list[int]) -> None:
    """A middlebox takes the bytes (the queue empties at once) and drops them;
    PONGs pass. With two streams, the other one's ACKs keep coming all along:
    stream 1 is noticed all the same."""
    liveness = Liveness(HB, trio.current_time())
    link = Link(liveness, rate=1e9)

    async def other_stream() -> None:
        while True:
            link.send(2, 500)
            await trio.sleep(0.1)
            link.ack(2, link.handed[2])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.drain)
        nursery.start_soon(link.pongs)
        if 2 in streams:
            nursery.start_soon(other_stream)
        start = trio.current_time()
        link.send(1, 150_000)
        result = await run_watch(liveness, link, 100)
        nursery.cancel_scope.cancel()
    assert result is not None
    verdict, when = result
    assert verdict == ("stalled", ("data", 1))
    # Counted from the first check that saw the request, and only at checks
    # that find the queue empty (the other stream's frames are in it at some).
    assert LIMIT <= when - start <= LIMIT + HB


async def test_the_clock_runs_only_while_the_queue_is_empty(autojump_clock: trio.testing.MockClock) -> None:
    """Queue empty half the time (a PING, a new frame in it the other half):
    the unanswered request takes twice the limit, not forever and not less."""
    liveness = Liveness(HB, trio.current_time())
    link = Link(liveness, rate=0)
    link.send(1, 10)  # (never drains by itself: the task below empties and fills the queue)

    async def flapping_queue() -> None:
        await trio.sleep(HB / 8)  # (flips between the checks, so no check races a flip)
        while True:
            link.queued = 0
            await trio.sleep(HB)
            link.queued = 100
            await trio.sleep(HB)
            link.liveness.heard(trio.current_time())  # (keeps the black-hole rule out of it)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(flapping_queue)
        start = trio.current_time()
        result = await run_watch(liveness, link, 100)
        nursery.cancel_scope.cancel()
    assert result is not None
    verdict, when = result
    assert verdict == ("stalled", ("data", 1))
    assert 2 * LIMIT - HB <= when - start <= 2 * LIMIT + HB


async def test_an_unanswered_request_for_stdin_is_stalled(autojump_clock: trio.testing.MockClock) -> None:
    liveness = Liveness(HB, trio.current_time())
    link = Link(liveness, rate=1e9)
    link.stdin_asked = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.pongs)
        result = await run_watch(liveness, link, 100)
        nursery.cancel_scope.cancel()
    assert result is not None and result[0] == ("stalled", "stdin")


async def test_an_answer_starts_the_clock_over(autojump_clock: trio.testing.MockClock) -> None:
    """An ACK that moves a stream forward, short of all it was sent, restarts
    that stream's clock: the rest then has the whole limit again."""
    liveness = Liveness(HB, trio.current_time())
    link = Link(liveness, rate=1e9)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.drain)
        nursery.start_soon(link.pongs)
        link.send(1, 2000)

        async def half_ack() -> None:
            await trio.sleep(LIMIT - HB)
            link.ack(1, 1000)

        nursery.start_soon(half_ack)
        start = trio.current_time()
        result = await run_watch(liveness, link, 100)
        nursery.cancel_scope.cancel()
    assert result is not None
    verdict, when = result
    assert verdict == ("stalled", ("data", 1))
    assert 2 * LIMIT - HB <= when - start <= 2 * LIMIT - HB + 2 * HB / 4


async def test_a_black_hole_is_silent(autojump_clock: trio.testing.MockClock) -> None:
    """Nothing comes in and the queue does not shrink: dead after the limit,
    whether or not anything waits for an answer."""
    liveness = Liveness(HB, trio.current_time())
    link = Link(liveness, rate=0)
    link.send(1, 5000)
    start = trio.current_time()
    result = await run_watch(liveness, link, 100)
    assert result is not None
    verdict, when = result
    assert verdict == ("silent", None)
    assert LIMIT < when - start <= LIMIT + HB / 4


def test_pure_rules_by_hand() -> None:
    """The same rules with the time passed in, step by step."""
    lv = Liveness(1.0, now=0.0)
    assert lv.check(0.25, 0, [("data", 1)]) is None  # first seen: its clock starts at 0
    assert lv.check(2.0, 0, [("data", 1)]) is None  # 1.75 s with the queue empty
    assert lv.check(2.5, 10, [("data", 1)]) is None  # queue busy: paused
    lv.heard(2.5)
    assert lv.check(3.5, 0, [("data", 1)]) is None  # 2.75 s
    assert lv.check(3.75, 0, [("data", 1)]) == ("stalled", ("data", 1))  # 3 s
    lv.answered(("data", 1))
    assert lv.check(4.0, 0, [("data", 1)]) is None  # over again from 0
    assert lv.check(4.25, 0, []) is None  # all answered: forgotten
    lv.heard(6.5)
    assert lv.check(7.0, 0, [("data", 1)]) is None  # a new request, first seen now
    assert lv.check(9.5, 0, [("data", 1)]) is None  # 2.5 s
    lv.heard(9.0)
    assert lv.check(9.6, 0, []) is None  # answered
    assert lv.check(9.7, 5, []) is None
    assert lv.check(12.0, 5, []) is None
    assert lv.check(12.1, 5, []) == ("silent", None)  # nothing heard since 9.0, no TCP progress since 3.5
