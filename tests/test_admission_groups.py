"""Job handshakes admitted in groups: one state transaction for many.

`GroupCommit` (gcwrap/shadow/admission.py) runs every request queued while
a group is in flight as the next group; `Store.open_jobs` opens them in one
transaction, each job in a savepoint of its own. Tested here: every order of
arrivals, group steps and cancellations hypothesis chooses (no request runs
twice, none is lost, a cancelled waiter's request either never ran or its
result reaches it, one group at a time); a refused job in a group changes
nothing for the others; a failed commit opens no job; and a real gcshadow
admitting a few hundred connections at once, byte-exact, in far fewer
transactions than connections.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_shadow_perf import LimitedShadow, SimAgent, no_descriptor_trouble

from gcwrap.shadow.admission import GroupCommit
from gcwrap.shadow.files import JobFiles, Problem, StoreError
from gcwrap.shadow.state import Store
from gcwrap.wire.events import StreamSpec

# -- every order of arrivals, steps and cancellations -----------------------------------------------


class Stepped:
    """A worker whose start (cancellable, like waiting for the thread) and
    result (shielded, like a running thread) are steps someone else allows."""

    def __init__(self) -> None:
        self.gates: list[tuple[str, trio.Event]] = []
        self.in_flight = 0
        self.groups: list[list[int]] = []
        self.ran: list[int] = []
        self.closing = False  # the run is over: no gate holds anyone

    def release(self) -> None:
        """Let every gate go (a shielded one would hold the run forever)."""
        self.closing = True
        for _, go in self.gates:
            go.set()

    async def point(self, what: str, shield: bool = False) -> None:
        if self.closing:
            return
        go = trio.Event()
        entry = (what, go)
        self.gates.append(entry)
        try:
            with trio.CancelScope(shield=shield):
                await go.wait()
        finally:
            if entry in self.gates:
                self.gates.remove(entry)

    async def worker(self, fn: Any) -> Any:
        await self.point("start")
        result = fn()
        await self.point("result", shield=True)
        return result

    def run(self, requests: list[int]) -> list[Any]:
        assert self.in_flight == 0, "two groups at once"
        self.in_flight += 1
        self.groups.append(list(requests))
        self.ran.extend(requests)
        self.in_flight -= 1
        return [ValueError(f"refused {r}") if r % 5 == 4 else f"opened {r}" for r in requests]


async def _race(n: int, limit: int, choose: Any) -> tuple[Stepped, dict[int, str]]:
    stepped = Stepped()
    group = GroupCommit(stepped.run, stepped.worker, limit=limit)
    outcome: dict[int, str] = {}
    scopes: dict[int, trio.CancelScope] = {}

    async def waiter(i: int) -> None:
        with trio.CancelScope() as scope:
            scopes[i] = scope
            try:
                outcome[i] = await group.submit(i)
            except ValueError as e:
                outcome[i] = f"error {e}"
            await trio.lowlevel.checkpoint()  # a cancellation that came with the result is delivered here
        if scope.cancelled_caught and i not in outcome:
            outcome[i] = "cancelled"

    async with trio.open_nursery() as nursery:
        try:
            await _drive(n, stepped, scopes, outcome, choose, nursery, waiter)
        except BaseException:  # hypothesis' StopTest too
            stepped.release()
            raise
    return stepped, outcome


async def _drive(n: int, stepped: Stepped, scopes: dict[int, trio.CancelScope], outcome: dict[int, str], choose: Any,
                 nursery: trio.Nursery, waiter: Any) -> None:
    """Arrivals, group steps and cancellations, one at a time, in the order `choose` picks."""
    arrived = 0
    for _ in range(40 * n):
        await trio.testing.wait_all_tasks_blocked()
        options: list[tuple[str, Any]] = []
        if arrived < n:
            options.append(("arrive", None))
        options += [("step", g) for g in stepped.gates]
        options += [("cancel", i) for i, s in scopes.items() if i not in outcome and not s.cancel_called]
        if not options:
            break
        kind, what = options[choose(len(options))]
        if kind == "arrive":
            nursery.start_soon(waiter, arrived)
            arrived += 1
        elif kind == "step":
            what[1].set()
        else:
            scopes[what].cancel()
    else:
        raise AssertionError(f"no end: {stepped.gates}, {outcome}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("limit", [2, 128])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(n=st.integers(1, 6), data=st.data())
def test_every_request_runs_at_most_once_and_its_result_reaches_its_waiter(limit: int, n: int,
                                                                          data: st.DataObject) -> None:
    stepped, outcome = trio.run(_race, n, limit, lambda k: data.draw(st.integers(0, k - 1)))
    assert sorted(outcome) == list(range(n)), outcome  # every waiter came back
    assert len(stepped.ran) == len(set(stepped.ran)), f"a request ran twice: {stepped.groups}"
    assert all(len(g) <= limit for g in stepped.groups), stepped.groups
    for i in range(n):
        if i in stepped.ran:  # what was done for it is in its hands (files are never left open)
            want = f"error refused {i}" if i % 5 == 4 else f"opened {i}"
            assert outcome[i] == want, (i, outcome, stepped.groups)
        else:
            assert outcome[i] == "cancelled", (i, outcome, stepped.groups)


@pytest.mark.timeout(30)
def test_requests_that_arrive_while_a_group_is_in_flight_go_together() -> None:
    async def main() -> list[list[int]]:
        stepped = Stepped()
        group = GroupCommit(stepped.run, stepped.worker)
        async def one(i: int) -> None:
            with contextlib.suppress(ValueError):  # (the refused ones)
                await group.submit(i)

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(one, i)
            while sorted(stepped.ran) != list(range(10)) or stepped.gates:
                await trio.testing.wait_all_tasks_blocked()
                if stepped.gates:
                    stepped.gates[0][1].set()
                else:
                    await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
        return stepped.groups

    groups = trio.run(main)
    # The first arrival leads alone; the nine that queued meanwhile are one group.
    assert [len(g) for g in groups] == [1, 9] and sorted(groups[0] + groups[1]) == list(range(10)), groups


class _Wakeups(trio.abc.Instrument):
    def __init__(self) -> None:
        self.scheduled = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        self.scheduled += 1


@pytest.mark.timeout(30)
def test_a_finished_group_wakes_its_own_waiters_and_the_next_leader_not_every_waiter() -> None:
    """Many requests queued behind small groups (ten thousand agents exiting
    at once): each group wakes its waiters and the next leader, so the task
    wake-ups grow with the requests, not with requests x groups."""
    n = 400

    go = [trio.Event()]  # (made in the run below)

    async def worker(fn: Any) -> Any:
        await go[0].wait()  # the first group waits until every request is queued; then like a thread hop
        return fn()

    async def main() -> tuple[int, list[Any]]:
        go[0] = trio.Event()
        group = GroupCommit(lambda requests: [f"done {r}" for r in requests], worker, limit=4)
        results: list[Any] = []
        wakeups = _Wakeups()

        async def one(i: int) -> None:
            results.append(await group.submit(i))

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
            assert not results and len(group.queue) == n - 1  # one group in flight, the rest queued
            trio.lowlevel.add_instrument(wakeups)
            go[0].set()
        trio.lowlevel.remove_instrument(wakeups)
        return wakeups.scheduled, results

    scheduled, results = trio.run(main)
    assert sorted(results) == sorted(f"done {i}" for i in range(n))
    # Every waiter wakes about once (its result) and each group's leader a
    # few times; waking every waiter per group would be ~n^2 / 8 = 20 000.
    assert scheduled < 6 * n, scheduled


# -- Store.open_jobs: one transaction, each job atomic -------------------------------------------------


def _request(job: str, name: str, instance: str = "i1") -> dict[str, Any]:
    return {"job_id": job, "instance": instance, "streams": [StreamSpec(1, "stdout", name)], "host": "h",
            "user": "u", "command": ["c"], "peer": "p", "tenant": ""}


@pytest.mark.timeout(30)
def test_a_refused_job_in_a_group_changes_nothing_and_the_others_open(tmp_path: Path) -> None:
    store = Store(tmp_path)
    try:
        results = store.open_jobs([_request("a", "a.out"), _request("b", "a.out"), _request("c", "../c.out"),
                                   _request("d", "d.out")])
        assert isinstance(results[0], JobFiles) and isinstance(results[3], JobFiles), results
        assert isinstance(results[1], StoreError) and results[1].problem is Problem.NAME_IN_USE, results
        assert isinstance(results[2], StoreError) and results[2].problem is Problem.FORBIDDEN_NAME, results
        jobs = {r[0] for r in store.db.execute("SELECT job_id FROM jobs").fetchall()}
        streams = {r[0] for r in store.db.execute("SELECT job_id FROM streams").fetchall()}
        assert jobs == streams == {"a", "d"}
        assert not store.db.conn.in_transaction
        for r in results:
            if isinstance(r, JobFiles):
                r.close()
        # Committed: another connection to the database sees them.
        other = sqlite3.connect(tmp_path / ".gcshadow" / "state.db")
        assert {r[0] for r in other.execute("SELECT job_id FROM jobs")} == {"a", "d"}
        other.close()
    finally:
        store.close()


class _FailingCommit:
    """The state connection, whose COMMIT fails (a full or failing state disk)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, *args: Any) -> Any:
        if sql == "COMMIT":
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.timeout(30)
def test_a_failed_commit_opens_no_job_of_the_group(tmp_path: Path) -> None:
    store = Store(tmp_path)
    real = store.db.conn
    fds = len(list(Path("/proc/self/fd").iterdir()))
    try:
        store.db.conn = _FailingCommit(real)  # type: ignore[assignment]
        results = store.open_jobs([_request("a", "a.out"), _request("b", "b.out")])
        store.db.conn = real
        # The state database failed: retryable (BUSY), never a refusal for good.
        assert all(isinstance(r, StoreError) and r.problem is Problem.STATE for r in results), results
        assert "disk I/O error" in str(results[0])
        assert not real.in_transaction
        assert real.execute("SELECT count(*) FROM jobs").fetchone()[0] == 0
        assert len(list(Path("/proc/self/fd").iterdir())) == fds, "a failed group left files open"
        # And the store goes on: the same jobs open afterwards.
        again = store.open_jobs([_request("a", "a.out"), _request("b", "b.out")])
        assert all(isinstance(r, JobFiles) for r in again), again
        for r in again:
            assert isinstance(r, JobFiles)
            r.close()
    finally:
        store.db.conn = real
        store.close()


@pytest.mark.timeout(30)
def test_exits_and_handshakes_share_a_group_and_a_stale_exit_records_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path)
    try:
        (a,) = store.open_jobs([_request("a", "a.out")])
        assert isinstance(a, JobFiles)
        results = store.grouped([
            lambda: store.record_finished("a", a.session + 1, code=0, signal=None, reason="", summary={}),
            lambda: store.open_job(**_request("b", "../b.out")),
            lambda: store.record_finished("a", a.session, code=3, signal=None, reason="", summary={}),
            lambda: store.open_job(**_request("c", "c.out")),
        ])
        assert results[0] is False and results[2] is True, results  # only the session that holds it records
        assert isinstance(results[1], StoreError) and isinstance(results[3], JobFiles), results
        row = store.db.execute("SELECT state, exit_code FROM jobs WHERE job_id = 'a'").fetchone()
        assert tuple(row) == ("finished", 3)
        for r in (a, results[3]):
            r.close()
    finally:
        store.close()


# -- a real gcshadow admitting a few hundred connections at once ------------------------------------------


@pytest.mark.timeout(240)
def test_hundreds_of_connections_at_once_land_byte_exact_in_few_state_transactions(
    home: Path, tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    shadow = LimitedShadow(home, logs, 4096)
    jobs = 300
    try:
        agents = [SimAgent(shadow.port, j, size=8 << 10, frames=2, pause=0.3) for j in range(jobs)]

        async def main() -> None:
            with trio.fail_after(180):
                async with trio.open_nursery() as nursery:
                    for a in agents:
                        nursery.start_soon(a.run)

        trio.run(main)
    finally:
        shadow.stop()
    for a in agents:
        for sid, data in a.data.items():
            landed = (home / "fan" / f"{a.job}.{'out' if sid == 1 else 'err'}").read_bytes()
            assert landed == data, f"job {a.job} stream {sid}: {len(landed)} bytes landed, {len(data)} sent"
    text = shadow.log()
    no_descriptor_trouble(text)
    assert sum(a.busy for a in agents) == 0
    m = re.search(r"(\d+) job handshakes, exits and disconnections in (\d+) state transactions", text)
    assert m, text[-2000:]
    records, groups = int(m[1]), int(m[2])
    assert records == 2 * jobs, text[-2000:]  # a handshake and an exit each
    assert groups <= jobs // 2, f"{records} state changes took {groups} state transactions: they were not grouped"
