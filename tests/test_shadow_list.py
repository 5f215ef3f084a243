"""Several shadows on the agent's side: the address list, its parsing, and
the rounds it counts (gcwrap.agent.shadows). Pure: no I/O, no clock."""

from __future__ import annotations

import random

import click
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcwrap.agent.policy import RetryPolicy
from gcwrap.agent.shadows import (
    AddressError,
    Round,
    ShadowList,
    env_addresses,
    given_up,
    parse_address,
    parse_addresses,
    recorded_addresses,
    show,
    show_all,
)
from gcwrap.cli import shadow_addresses

pytestmark = pytest.mark.timeout(60)


# -- parsing -----------------------------------------------------------------


def test_one_address_and_a_list() -> None:
    assert parse_addresses(["a:50000"]) == [("a", 50000)]
    assert parse_addresses(["a:50000,b:50001"]) == [("a", 50000), ("b", 50001)]
    assert parse_addresses(["a:50000", "b:50001,c:1"]) == [("a", 50000), ("b", 50001), ("c", 1)]
    assert parse_addresses([" a:50000 , b:50001 "]) == [("a", 50000), ("b", 50001)]
    assert parse_addresses(["a:1,a:1", "a:1"]) == [("a", 1)]  # the same shadow twice is one shadow


def test_ipv6_in_brackets() -> None:
    assert parse_addresses(["[::1]:50000,[fe80::1]:2"]) == [("::1", 50000), ("fe80::1", 2)]
    assert show(("::1", 50000)) == "[::1]:50000"
    assert show_all([("::1", 1), ("h", 2)]) == "[::1]:1,h:2"


@pytest.mark.parametrize("value, says", [
    ("a", "is not HOST:PORT"),
    (":50000", "is not HOST:PORT"),
    ("a:0", "1-65535"),
    ("a:65536", "1-65535"),
    ("a:http", "1-65535"),
    ("::1:50000", "in brackets"),
    ("[::1:50000", "in brackets"),
    ("[]:50000", "in brackets"),
    ("a:1,", "empty address"),
    (",a:1", "empty address"),
    ("a:1,,b:2", "empty address"),
    ("a b:1", "no host name"),
])
def test_bad_addresses_say_why(value: str, says: str) -> None:
    with pytest.raises(AddressError, match=says):
        parse_addresses([value])


def test_the_seeds_environment_may_hold_a_list() -> None:
    assert env_addresses("home", "50000") == [("home", 50000)]
    assert env_addresses("a,b", "50000") == [("a", 50000), ("b", 50000)]
    assert env_addresses("a,b:50001", "50000") == [("a", 50000), ("b", 50001)]
    assert env_addresses("a:1,b:2", None) == [("a", 1), ("b", 2)]
    assert env_addresses("::1", "50000") == [("::1", 50000)]  # (the seed's bare IPv6 host)
    assert env_addresses("[::1],[::2]:7", "50000") == [("::1", 50000), ("::2", 7)]
    with pytest.raises(AddressError, match="set both"):
        env_addresses("a,b", None)
    with pytest.raises(AddressError, match="not a port"):
        env_addresses("a", "x")
    with pytest.raises(AddressError, match="empty entry"):
        env_addresses("a,,b", "1")


def test_cli_reads_option_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BYPASS_SHADOW_HOST", "x,y")
    monkeypatch.setenv("BYPASS_SHADOW_PORT", "9")
    assert shadow_addresses(("a:1", "b:2")) == (("a", 1), ("b", 2))
    assert shadow_addresses(()) == (("x", 9), ("y", 9))
    monkeypatch.delenv("BYPASS_SHADOW_PORT")
    with pytest.raises(click.UsageError, match="set both"):
        shadow_addresses(())
    monkeypatch.delenv("BYPASS_SHADOW_HOST")
    assert shadow_addresses(()) == ()
    with pytest.raises(click.BadParameter, match="empty address"):
        shadow_addresses(("a:1,",))


def test_a_spool_records_the_list_and_an_older_one_a_bare_ipv6_address() -> None:
    addresses = [("a", 1), ("::1", 2)]
    assert recorded_addresses(show_all(addresses)) == addresses
    assert recorded_addresses("::1:50000") == [("::1", 50000)]
    assert recorded_addresses("home:50000") == [("home", 50000)]
    with pytest.raises(AddressError):
        recorded_addresses("")


def test_a_round_trip_of_any_list() -> None:
    @given(st.lists(st.tuples(st.sampled_from(["a", "b.example.org", "10.0.0.1", "::1", "fe80::2"]),
                              st.integers(1, 65535)), min_size=1, max_size=6, unique=True))
    @settings(max_examples=200, deadline=None)
    def check(addresses: list[tuple[str, int]]) -> None:
        assert parse_addresses([show_all(addresses)]) == addresses
        assert [parse_address(show(a)) for a in addresses] == addresses

    check()


# -- the order and the rounds -------------------------------------------------


def test_order_is_shuffled_per_agent() -> None:
    addresses = [(f"h{i}", 1) for i in range(6)]
    firsts = {ShadowList.shuffled(addresses, random.Random(seed)).current for seed in range(60)}
    assert len(firsts) > 3  # (not every agent starts on the first)
    for seed in range(20):
        assert sorted(ShadowList.shuffled(addresses, random.Random(seed)).order) == sorted(addresses)
    with pytest.raises(AddressError):
        ShadowList.shuffled([]).current  # noqa: B018 - (the property raises)


def test_a_jobs_order_follows_its_id_and_jobs_spread() -> None:
    addresses = [(f"h{i}", 1) for i in range(3)]
    assert ShadowList.for_job(addresses, "job-1").order == ShadowList.for_job(addresses, "job-1").order
    firsts = [ShadowList.for_job(addresses, f"job-{i}").current for i in range(300)]
    assert all(60 < firsts.count(a) < 140 for a in addresses), "jobs do not spread over the shadows"


def test_one_address_every_failure_is_a_round() -> None:
    shadows = ShadowList([("a", 1)])
    for n in range(1, 5):
        assert shadows.failed() == Round(0.0, False)
        assert shadows.current == ("a", 1) and shadows.rounds == n
    assert shadows.failovers == 0
    assert shadows.failed(retry_after=3.0, shutting_down=True) == Round(3.0, True)


def test_two_addresses_the_next_at_once_then_a_round() -> None:
    shadows = ShadowList([("a", 1), ("b", 2)])
    assert shadows.failed() is None and shadows.current == ("b", 2)
    assert shadows.failed() == Round(0.0, False) and shadows.current == ("a", 1)
    shadows.welcomed()
    shadows.succeeded()
    assert shadows.in_use == ("a", 1) and shadows.current == ("a", 1)  # the working one is kept
    assert shadows.failed(retry_after=2.0) is None
    assert shadows.failed(shutting_down=True) == Round(2.0, False)  # (not every shadow was shutting down)
    assert shadows.failed(shutting_down=True) is None
    assert shadows.failed(shutting_down=True) == Round(0.0, True)
    assert shadows.failovers == 6


def test_a_refusal_for_good_ends_the_round_and_moves_on() -> None:
    shadows = ShadowList([("a", 1), ("b", 2), ("c", 3)])
    assert shadows.failed() is None
    shadows.failed_for_good()
    assert shadows.current == ("c", 3) and shadows.failures_in_round == 0
    assert shadows.failed() is None and shadows.failed() is None and shadows.failed() is not None


Event = tuple[str, float, bool]  # ("fail", retry_after, shutting_down) | ("ok", 0, False) | ("refused", 0, False)


@given(
    n=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    events=st.lists(st.one_of(
        st.tuples(st.just("fail"), st.sampled_from([0.0, 1.0, 7.0]), st.booleans()),
        st.tuples(st.just("ok"), st.just(0.0), st.just(False)),
        st.tuples(st.just("refused"), st.just(0.0), st.just(False)),
    ), max_size=60),
)
@settings(max_examples=300, deadline=None)
def test_any_sequence_counts_rounds_keeps_the_working_one_tries_each_once_a_round(
    n: int, seed: int, events: list[Event]
) -> None:
    """A model of the rules beside the object: a round is every address
    tried once without success since the last success or round; the
    addresses of a round are all different; after a success the same
    address is tried again; the round carries the longest pause asked and
    whether every one of its shadows was shutting down."""
    addresses = [(f"h{i}", 1000 + i) for i in range(n)]
    shadows = ShadowList.shuffled(addresses, random.Random(seed))
    rounds = 0
    in_round: list[tuple[tuple[str, int], float, bool]] = []
    for kind, retry_after, shutting_down in events:
        at = shadows.current
        if kind == "ok":
            shadows.welcomed()
            shadows.succeeded()
            in_round = []
            assert shadows.current == at and shadows.in_use == at
            continue
        if kind == "refused":
            shadows.failed_for_good()
            in_round = []
            assert shadows.current != at or n == 1
            continue
        in_round.append((at, retry_after, shutting_down))
        ended = shadows.failed(retry_after, shutting_down)
        tried = [a for a, _, _ in in_round]
        assert len(set(tried)) == len(tried), "an address tried twice in one round"
        if len(in_round) == n:
            rounds += 1
            assert set(tried) == set(addresses), "a round left an address out"
            assert ended == Round(max(r for _, r, _ in in_round), all(s for _, _, s in in_round))
            in_round = []
        else:
            assert ended is None, "a round ended before every address was tried"
            assert shadows.current != at, "a failed shadow was tried again at once"
        assert shadows.rounds == rounds


@given(n=st.integers(1, 4), limit=st.integers(1, 6))
@settings(max_examples=100, deadline=None)
def test_the_retry_limit_counts_rounds_not_addresses(n: int, limit: int) -> None:
    """With the deliver loop's rule (the policy hears only of a finished
    round), giving up takes `limit` rounds: n * limit failed attempts."""
    shadows = ShadowList([(f"h{i}", 1) for i in range(n)])
    policy = RetryPolicy(limit=limit, retry_timeout=1.0)
    attempts = 0
    while True:
        attempts += 1
        ended = shadows.failed()
        if ended is None:
            continue
        if policy.failed(blocked=True, refused=False, retry_after=ended.retry_after).give_up:
            break
        assert attempts < 1000
    assert attempts == n * limit and shadows.rounds == limit


def test_the_give_up_message() -> None:
    one = given_up(5, [("a", 1)], False, "connection refused")
    assert one == ("retry limit reached: 5 consecutive failed attempts while the job's output could go nowhere "
                   "(last: connection refused)")
    two = given_up(3, [("a", 1), ("::1", 2)], True, "why")
    assert "3 consecutive rounds of failed attempts over the shadows a:1,[::1]:2" in two
    assert "after the job ended" in two
