"""The agent's pure policies (gcwrap.agent.policy), driven the way the agent drives
them: `now` from trio.current_time(), under trio's autojump clock, so the
waits they ask for pass in virtual time and nothing sleeps for real."""

from __future__ import annotations

import math
import random
import ssl

import pytest
import trio
import trio.testing

from gcwrap.agent.policy import (
    ACK_COMMIT_INTERVAL,
    COME_BACK,
    COMMIT_PACE,
    DISK_CALM,
    IDLE_LOOK,
    CommitPlan,
    DiskHealth,
    HomeHealth,
    RetryPolicy,
)
from gcwrap.agent.retry import Backoff, ConnectionLost, HeartbeatTimeout, ShadowRefused, Stalled, describe

pytestmark = pytest.mark.timeout(60)


# -- CommitPlan ---------------------------------------------------------------------


async def test_write_behind_spools_only_what_home_did_not_acknowledge_in_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    plan = CommitPlan(mem_limit=1000, cache_limit=0, write_behind=3.0)
    read_at = trio.current_time()
    due = plan.behind_wait(trio.current_time(), may_ack=True, unsafe=10, oldest=read_at)
    assert due == pytest.approx(3.0)
    await trio.sleep(due)  # (virtual: the autojump clock)
    assert plan.behind_wait(trio.current_time(), True, 10, read_at) <= 0, "due now"
    # Not while home cannot acknowledge, with half the memory limit unrecorded, nor with nothing in memory.
    assert plan.behind_wait(trio.current_time(), False, 10, trio.current_time()) == 0
    assert plan.behind_wait(trio.current_time(), True, 500, trio.current_time()) == 0
    assert plan.behind_wait(trio.current_time(), True, 0, None) == 0
    assert CommitPlan(mem_limit=1000, cache_limit=0).behind_wait(0.0, True, 10, 0.0) == 0, "off by default"


def test_home_may_acknowledge_while_a_session_streams_or_the_first_is_being_made() -> None:
    """Write-behind holds output while home may still acknowledge it in
    time: before the first session (the job starts before the connection;
    its first output does not go to the disk for that alone), and while one
    streams; not once an attempt failed or a session ended, until the next
    is welcomed. (Before: output read before the first WELCOME was spooled
    at once, so a job that wrote at once spooled its first bytes.)"""
    home = HomeHealth()
    assert home.may_ack, "the first connection is still being made"
    home.failed("connection refused")
    assert not home.may_ack
    home.welcomed(1.0)
    assert home.may_ack
    home.streaming = False  # (the session ended: delivery.py)
    assert not home.may_ack, "a lost session: home cannot acknowledge until the next is welcomed"
    fresh = HomeHealth()
    fresh.welcomed(0.0)
    fresh.streaming = False
    assert not fresh.may_ack, "a clean end of the first session counts as tried too"


async def test_acknowledgements_alone_wait_unless_the_disk_is_tight(autojump_clock: trio.testing.MockClock) -> None:
    plan = CommitPlan(mem_limit=1000, cache_limit=0)
    assert plan.ack_wait(trio.current_time(), tight=False) <= 0, "the first ones go at once"
    plan.acks_recorded(trio.current_time())
    assert plan.ack_wait(trio.current_time(), tight=False) == pytest.approx(ACK_COMMIT_INTERVAL)
    assert plan.ack_wait(trio.current_time(), tight=True) <= 0, "recording them frees the spool's space"
    await trio.sleep(ACK_COMMIT_INTERVAL / 2)
    assert plan.ack_wait(trio.current_time(), tight=False) == pytest.approx(ACK_COMMIT_INTERVAL / 2)
    await trio.sleep(ACK_COMMIT_INTERVAL / 2)
    assert plan.ack_wait(trio.current_time(), tight=False) <= 0


def test_group_commit_gathers_only_after_writing_output_while_the_job_runs_and_the_disk_has_room() -> None:
    plan = CommitPlan(mem_limit=1000, cache_limit=0)
    assert plan.gather(wrote=True, ended=False, tight=False) == COMMIT_PACE
    assert plan.gather(wrote=False, ended=False, tight=False) == 0
    assert plan.gather(wrote=True, ended=True, tight=False) == 0
    assert plan.gather(wrote=True, ended=False, tight=True) == 0
    assert plan.idle_wait(waiting=True) == IDLE_LOOK and plan.idle_wait(waiting=False) == math.inf


def test_the_cache_is_evicted_to_an_equal_share_per_stream_past_its_limit() -> None:
    plan = CommitPlan(mem_limit=1000, cache_limit=100)
    assert plan.eviction_share(held=100, streams=2) is None
    assert plan.eviction_share(held=101, streams=2) == 50
    assert plan.eviction_share(held=101, streams=0) == 100


# -- RetryPolicy --------------------------------------------------------------------


def policy(limit: int = 3, retry_timeout: float = 60.0) -> RetryPolicy:
    return RetryPolicy(limit=limit, retry_timeout=retry_timeout, backoff=Backoff(rng=random.Random(7)))


def test_only_attempts_while_output_can_go_nowhere_count_toward_the_limit() -> None:
    retry = policy(limit=3)
    for _ in range(10):
        assert not retry.failed(blocked=False, refused=False).give_up
    assert retry.failures_blocked == 0
    assert not retry.failed(blocked=True, refused=False).give_up
    assert not retry.failed(blocked=True, refused=False).give_up
    assert retry.failed(blocked=True, refused=False).give_up
    assert retry.failures_blocked == 3


def test_a_session_that_moved_bytes_resets_the_count_and_the_backoff() -> None:
    retry = policy(limit=3)
    delays = [retry.failed(blocked=True, refused=False).delay for _ in range(2)]
    assert delays[1] > 0 and retry.backoff.failures == 2
    retry.succeeded()
    assert retry.failures_blocked == 0 and retry.backoff.failures == 0
    assert not retry.failed(blocked=True, refused=False).give_up


def test_refusals_wait_the_retry_timeout_and_a_shadow_may_ask_for_longer_up_to_it() -> None:
    retry = policy(limit=0, retry_timeout=30.0)
    assert retry.failed(blocked=True, refused=True).delay == 30.0
    assert retry.failed(blocked=False, refused=False, retry_after=20.0).delay >= 20.0
    assert retry.failed(blocked=False, refused=False, retry_after=500.0).delay == 30.0
    assert not any(retry.failed(blocked=True, refused=False).give_up for _ in range(50)), "0: no limit"


def test_a_shadow_shutting_down_is_tried_again_soon_and_costs_no_attempt() -> None:
    retry = policy(limit=2)
    retry.failed(blocked=True, refused=False)
    for _ in range(5):
        nxt = retry.failed(blocked=True, refused=False, shutting_down=True)
        assert nxt.delay == COME_BACK and not nxt.counted and not nxt.give_up
    assert retry.failed(blocked=True, refused=False, retry_after=3.0, shutting_down=True).delay == 3.0
    short = policy(retry_timeout=2.0)
    assert short.failed(blocked=True, refused=False, retry_after=3.0, shutting_down=True).delay == 2.0
    assert retry.failures_blocked == 1
    assert retry.failed(blocked=True, refused=False).give_up


async def test_backoff_delays_grow_and_are_capped(autojump_clock: trio.testing.MockClock) -> None:
    retry = policy(limit=0, retry_timeout=5.0)
    start = trio.current_time()
    delays = []
    for _ in range(8):
        delay = retry.failed(blocked=False, refused=False).delay
        delays.append(delay)
        await trio.sleep(delay)
    assert all(0 < d <= 5.0 for d in delays) and delays[-1] > delays[0]
    assert trio.current_time() - start == pytest.approx(sum(delays))


# -- DiskHealth --------------------------------------------------------------------


async def test_a_disk_failure_is_said_once_and_its_end_only_after_a_calm_spell(
    autojump_clock: trio.testing.MockClock,
) -> None:
    disk = DiskHealth()
    assert disk.failed(trio.current_time(), "disk full") == (True, "warning")
    assert disk.failed(trio.current_time(), "disk full") == (False, "")
    assert disk.failed(trio.current_time(), "I/O error") == (False, "info")
    disk.took()
    assert disk.error == ""
    assert not disk.recovered(trio.current_time(), caught_up=True), "too soon after the last failure"
    await trio.sleep(DISK_CALM)
    assert not disk.recovered(trio.current_time(), caught_up=False), "output still waits in memory"
    assert disk.recovered(trio.current_time(), caught_up=True)
    assert not disk.recovered(trio.current_time(), caught_up=True), "said once"
    assert disk.failed(trio.current_time(), "disk full") == (True, "warning"), "a new episode"


async def test_a_spool_taking_less_than_waits_is_one_episode_and_refuses_only_when_it_takes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A nearly full disk gives room in ever smaller pieces: each commit
    takes part of what waits (`partial`) and clears the error; the episode
    is said once, the spool counts as refusing (the job's pause is said, and
    failed connections count against the retry limit) only once it takes
    nothing, and its end is said only after it has caught up."""
    disk = DiskHealth()
    assert disk.failed(trio.current_time(), "disk nearly full", partial=True) == (True, "warning")
    assert disk.error and not disk.refusing
    for _ in range(5):  # each commit takes a smaller piece
        disk.took()
        assert disk.failed(trio.current_time(), "disk nearly full", partial=True) == (True, "")
        assert not disk.refusing
    assert disk.failed(trio.current_time(), "disk nearly full") == (True, ""), "from taking some to taking none"
    assert disk.refusing
    assert disk.failed(trio.current_time(), "disk nearly full") == (False, "")
    disk.took()
    await trio.sleep(DISK_CALM)
    assert not disk.recovered(trio.current_time(), caught_up=False)
    assert disk.recovered(trio.current_time(), caught_up=True)


# -- describe: by class, not by name -------------------------------------------------


def test_failures_are_described_by_their_class() -> None:
    assert describe(ConnectionLost("the shadow closed the connection"), "h:1") == (
        "the shadow closed the connection (h:1)")
    assert describe(ConnectionLost(), "h:1") == "connection to the shadow h:1 was lost"
    assert describe(trio.BrokenResourceError(), "h:1") == "connection to the shadow h:1 was lost"
    assert describe(trio.ClosedResourceError(), "") == "connection to the shadow was lost"
    assert describe(trio.TooSlowError(), "h:1") == "connecting to the shadow h:1 timed out"
    tls = trio.BrokenResourceError()
    tls.__cause__ = ssl.SSLError(1, "bad certificate")
    assert describe(tls, "h:1").startswith("TLS failure with the shadow h:1")
    assert describe(HeartbeatTimeout("x"), "h:1") == "no answer from the shadow h:1: x"
    assert describe(Stalled("x"), "h:1") == "the connection to the shadow h:1 stalled: x"
    assert describe(ShadowRefused(7, "no", True), "h:1") == "shadow h:1 refused: no [7]"

    class Odd(Exception):
        pass

    assert describe(Odd("what"), "h:1").endswith("Odd h:1: what")
