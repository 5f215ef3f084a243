"""Errors that fail together are never dropped (gcwrap/sync.py `worst_error`).

A nursery whose tasks fail together raises one exception group; the
agent's and the shadow's connections turn it into one error their callers
can catch. The one raised is the one that matters most: a bug over a
failure of this machine's storage over a protocol error or refusal over a
broken connection, whatever the order in which the tasks failed and however
the groups nest. Every other one is logged (a bug at ERROR, with its
traceback), and a group holding Cancelled passes unchanged to the enclosing
cancel scope.
"""

from __future__ import annotations

import errno
import itertools
import logging
from collections.abc import Callable, Iterator

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gcwrap.agent.retry import ConnectionLost, HeartbeatTimeout, ShadowRefused, Stalled
from gcwrap.agent.spool import SpoolError
from gcwrap.shadow.admission import Refused
from gcwrap.shadow.durability import Fenced
from gcwrap.shadow.files import Problem, StoreError
from gcwrap.sync import worst_error
from gcwrap.wire.events import ErrorCode
from gcwrap.wire.protocol import LocalProtocolError, ProtocolError, TruncatedFrame

pytestmark = pytest.mark.timeout(120)

# What the test expects of each kind of error, from the least to the most
# important (the code's own table is not consulted: this is the contract).
NETWORK, PROTOCOL, STORAGE, BUG = range(4)
MAKERS: dict[int, list[Callable[[str], BaseException]]] = {
    NETWORK: [
        lambda m: trio.BrokenResourceError(m),
        lambda m: trio.ClosedResourceError(m),
        lambda m: trio.TooSlowError(m),
        lambda m: ConnectionResetError(errno.ECONNRESET, m),
        lambda m: OSError(errno.EPIPE, m),
        lambda m: TruncatedFrame(m),
        lambda m: ConnectionLost(m),
        lambda m: HeartbeatTimeout(m),
        lambda m: Stalled(m),
    ],
    PROTOCOL: [
        lambda m: ProtocolError(m, ErrorCode.OFFSET_GAP),
        lambda m: ShadowRefused(ErrorCode.PATH_OWNED, m, permanent=True),
        lambda m: Refused(ErrorCode.BUSY, m),
        lambda m: Fenced(m),
    ],
    STORAGE: [
        lambda m: SpoolError(m),
        lambda m: StoreError(Problem.IO, m),
        lambda m: OSError(errno.EIO, m),
        lambda m: OSError(errno.ENOSPC, m),
    ],
    BUG: [
        lambda m: KeyError(m),
        lambda m: AssertionError(m),
        lambda m: ZeroDivisionError(m),
        lambda m: LocalProtocolError(m),
        lambda m: TypeError(m),
    ],
}
RANK: dict[int, int] = {}  # id of each error made for an example -> its rank
_ids = itertools.count()


@st.composite
def errors(draw: st.DrawFn) -> BaseException:
    rank = draw(st.sampled_from(sorted(MAKERS)))
    make = draw(st.sampled_from(MAKERS[rank]))
    e = make(f"<failure {next(_ids)}>")
    RANK[id(e)] = rank
    return e


def groups(leaf: st.SearchStrategy[BaseException]) -> st.SearchStrategy[BaseExceptionGroup[BaseException]]:
    """Groups of these errors, nested in any way (a nursery inside a nursery)."""
    tree = st.recursive(leaf, lambda inner: st.lists(inner, min_size=1, max_size=4).map(
        lambda xs: BaseExceptionGroup("inner nursery", xs)), max_leaves=12)
    return st.lists(tree, min_size=1, max_size=5).map(lambda xs: BaseExceptionGroup("nursery", xs))


def flat(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in flat(inner)]
    return [exc]


class Records(logging.Handler):
    """What gcwrap.sync logs, whatever the program's logging set-up did to propagation."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def sync_log() -> Iterator[Records]:
    logger = logging.getLogger("gcwrap.sync")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def logged(records: list[logging.LogRecord], e: BaseException) -> list[logging.LogRecord]:
    """The records that tell of `e` (by its unique message, or as their traceback)."""
    return [r for r in records if str(e.args[-1] if e.args else e) in r.getMessage()
            or (r.exc_info is not None and r.exc_info[1] is e)]


def test_the_error_that_matters_most_is_raised_and_every_other_one_is_logged(sync_log: Records) -> None:
    seen_ranks: set[int] = set()

    @settings(max_examples=400, deadline=None)
    @given(group=groups(errors()))
    def run(group: BaseExceptionGroup[BaseException]) -> None:
        sync_log.records.clear()
        leaves = flat(group)
        with pytest.raises(BaseException) as raised, worst_error():
            raise group
        got = raised.value
        assert any(got is e for e in leaves), f"raised {got!r}, which is none of the group's errors"
        top = max(RANK[id(e)] for e in leaves)
        assert RANK[id(got)] == top, f"raised {got!r} (rank {RANK[id(got)]}) from {leaves!r}"
        seen_ranks.add(top)
        records = sync_log.records
        for e in leaves:
            if e is got:
                assert not logged(records, e), f"{e!r} was raised and logged too"
                continue
            told = logged(records, e)
            assert len(told) == 1, f"{e!r} not raised, and logged {len(told)} times: {records}"
            if RANK[id(e)] == BUG:
                assert told[0].levelno == logging.ERROR
                assert told[0].exc_info is not None and told[0].exc_info[1] is e, "a bug's traceback"
            else:
                assert told[0].levelno < logging.ERROR, f"{e!r} is no bug: {told[0].levelname}"

    run()
    assert seen_ranks == set(MAKERS)


def test_a_group_holding_cancelled_passes_unchanged() -> None:
    @settings(max_examples=200, deadline=None)
    @given(group=groups(st.one_of(errors(), st.builds(trio.Cancelled._create))))
    def run(group: BaseExceptionGroup[BaseException]) -> None:
        if not any(isinstance(e, trio.Cancelled) for e in flat(group)):
            group = BaseExceptionGroup("nursery", [*group.exceptions, trio.Cancelled._create()])
        with pytest.raises(BaseExceptionGroup) as raised, worst_error():
            raise group
        assert raised.value is group

    run()


async def test_a_bug_in_one_task_is_not_hidden_by_the_connection_another_task_lost(sync_log: Records) -> None:
    """One task's connection breaks (a real socket whose peer is gone), and
    the other task, cancelled by that, fails in its cleanup with a bug: the
    group lists the broken connection first; the bug is what is raised."""
    ours, theirs = trio.socket.socketpair()
    theirs.close()
    stream = trio.SocketStream(ours)
    state: dict[str, int] = {}

    async def sender() -> None:
        while True:
            await stream.send_all(b"x" * 65536)

    async def bookkeeper() -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0)
                state["acked"] += 1  # the bug: a count never set

    try:
        with trio.fail_after(10), pytest.raises(KeyError), worst_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(bookkeeper)
                await trio.sleep(0.01)
                nursery.start_soon(sender)
    finally:
        await stream.aclose()
    told = sync_log.records
    assert len(told) == 1 and "BrokenResourceError" in told[0].getMessage(), told
    assert told[0].levelno == logging.DEBUG
