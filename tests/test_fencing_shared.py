"""Sessions of one job racing at two shadows that share their state in a
real PostgreSQL and their root, through interleavings the scheduler of
test_fencing.py chooses.

Two real `Shadow`s, each over its own `PgStore` (its own connections) on
one database and one root, in one process: their thread hops run inline at
the scheduler's word, and so do each one's durability batches and its
look at the state (`sharing.check_holders`). Agents come to either shadow
and, told BUSY (another shadow's session still holds the files), come
back, a bounded number of times.

At every step: at most one session, of either shadow, has the job's file
open; no file is cut back while a session of either shadow has it open.
At the end: every file closed, the file holds the job's bytes exactly
once, every agent saw its job done, and the state records the job
finished with all of its bytes durable.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fencing import CONTENT, JOB, WHO, Invariant, Scheduler, SteppedShadow, SteppedStream, _fd_path, agent, tasks

from gcwrap.shadow.admission import ShadowOptions
from gcwrap.shadow.connection import AgentConnection
from gcwrap.shadow.durability import LiveJob
from gcwrap.shadow.sharing import check_holders
from gcwrap.sync import leaves

T = TypeVar("T")
ATTEMPTS = 10  # connections an agent makes before it gives up


def _fresh(url: str) -> None:
    """An empty state for one run (the schema stays; each run has a new root, which the state then serves)."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'gcshadow'").fetchone():
            conn.execute("TRUNCATE gcshadow.jobs, gcshadow.streams, gcshadow.instances")
            conn.execute("DELETE FROM gcshadow.meta WHERE key IN ('root_id', 'root')")


def _open_sessions(shadows: list[SteppedShadow]) -> list[LiveJob]:
    return [j for sh in shadows for j in sh.claimed if any(sf.fd >= 0 for sf in j.files.outputs.values())]


@contextlib.contextmanager
def watched(shadows: list[SteppedShadow], out: Path, violations: list[str]) -> Iterator[None]:
    """No cut back of the job's file while any session of either shadow has it open."""
    real_ftruncate = os.ftruncate

    def ftruncate(fd: int, length: int) -> None:
        if _fd_path(fd) == str(out):
            others = [j for j in _open_sessions(shadows) if all(sf.fd != fd for sf in j.files.outputs.values())]
            if others:
                violations.append(f"cut back to {length} while another session had the file open")
        real_ftruncate(fd, length)

    os.ftruncate = ftruncate  # type: ignore[assignment]
    try:
        yield
    finally:
        os.ftruncate = real_ftruncate  # type: ignore[assignment]


def run_race(url: str, n: int, choose: Callable[[int], int], gate_all: bool) -> list[str]:
    """Race n agents of one job, agent i at shadow i % 2. Raises Invariant on any violation."""
    from gcwrap.shadow.pgstate import PgStore

    _fresh(url)
    with tempfile.TemporaryDirectory(prefix="gcw-fence-pg-") as tmp:
        root = Path(tmp)
        fds_before = len(os.listdir("/proc/self/fd"))
        stores = [PgStore(root, url), PgStore(root, url)]
        sched = Scheduler(choose, gate_all)
        shadows = [SteppedShadow(ShadowOptions(root=root, min_free=0, idle_timeout=30), s, sched) for s in stores]
        outcomes: list[list[str]] = [[] for _ in range(n)]
        try:
            with watched(shadows, root / "out", sched.violations):
                try:
                    trio.run(_race, shadows, sched, outcomes)
                except BaseExceptionGroup as group:
                    errors = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
                    raise next((e for e in errors if isinstance(e, Invariant)), errors[0]) from None
            _check_end(shadows, sched, outcomes, root, url)
            return sched.trace
        finally:
            for s in stores:
                s.close()
            fds_after = len(os.listdir("/proc/self/fd"))
            assert fds_after == fds_before, f"{fds_after - fds_before} descriptors leaked"


def _check_end(shadows: list[SteppedShadow], sched: Scheduler, outcomes: list[list[str]], root: Path,
               url: str) -> None:
    import psycopg

    schedule = sched.trace
    if sched.violations:
        raise Invariant(f"{sched.violations[0]}; schedule: {schedule}")
    if _open_sessions(shadows) or any(sh.live or sh.sessions or len(sh.fds.files) for sh in shadows):
        raise Invariant(f"files left open; schedule: {schedule}")
    if not all(o and o[-1] == "done" for o in outcomes):
        raise Invariant(f"outcomes {outcomes}; schedule: {schedule}")
    if (root / "out").read_bytes() != CONTENT:
        raise Invariant(f"the file is not the job's bytes exactly once; schedule: {schedule}")
    with psycopg.connect(url) as conn:
        state = conn.execute("SELECT state FROM gcshadow.jobs WHERE job_id = %s", [JOB]).fetchone()
        durable = conn.execute("SELECT durable FROM gcshadow.streams WHERE job_id = %s", [JOB]).fetchone()
    if state != ("finished",) or durable != (len(CONTENT),):
        raise Invariant(f"state {state}, durable {durable}; schedule: {schedule}")


async def _race(shadows: list[SteppedShadow], sched: Scheduler, outcomes: list[list[str]]) -> None:
    async with trio.open_nursery() as nursery:
        for i in range(len(outcomes)):
            shadow = shadows[i % 2]

            async def connect(i: int = i, shadow: SteppedShadow = shadow) -> trio.abc.Stream:
                client, server = trio.testing.memory_stream_pair()

                async def session() -> None:
                    WHO.set(i)
                    stream = SteppedStream(server, sched, shadow)
                    try:
                        await AgentConnection(shadow, stream, f"agent{i}", "test").serve()
                    finally:
                        await trio.aclose_forcefully(stream)

                nursery.start_soon(session)
                return client

            async def time_passes(i: int = i) -> None:
                WHO.set(i)
                await sched.point("backoff")  # only once nothing else can go on: time passes
                for sh in shadows:
                    await check_holders(sh.store, sh.live, _inline)

            nursery.start_soon(_retrying_agent, connect, outcomes[i], time_passes)
        inflight: list[list[Any]] = [[], []]
        with trio.move_on_after(60) as deadline:
            try:
                await _schedule(shadows, sched, inflight)
            except BaseException:
                sched.abort("")
                raise
        if deadline.cancelled_caught:
            raise sched.abort(f"no end after 60 s: {tasks()}")
        if not all(outcomes) or nursery.child_tasks:
            raise sched.abort(f"a session hung: {outcomes}; {tasks()}")


async def _retrying_agent(connect: Callable[[], Awaitable[trio.abc.Stream]], outcome: list[str],
                          time_passes: Callable[[], Awaitable[None]]) -> None:
    """test_fencing's honest agent, coming back until its job is done (a
    new connection, to the same shadow). Its second and later returns come
    after its backoff has grown long: after everything else that could go
    on did, and every shadow has looked at the state (`time_passes`); the
    first may come at once."""
    for attempt in range(ATTEMPTS):
        if attempt >= 2:
            await time_passes()
        await agent(await connect(), outcome)
        if outcome[-1] == "done":
            return


async def _inline(fn: Callable[[], T]) -> T:
    return fn()


async def _schedule(shadows: list[SteppedShadow], sched: Scheduler, inflight: list[list[Any]]) -> None:
    """Let one waiting session, durability step or look at the state go on
    at a time, once nothing else can run, until nothing waits."""
    while True:
        with trio.move_on_after(10) as spinning:
            await trio.testing.wait_all_tasks_blocked()
        if spinning.cancelled_caught:
            raise sched.abort(f"a task never blocks: {tasks()}")
        if len(_open_sessions(shadows)) > 1:
            raise sched.abort("two sessions have the job's file open at once")
        steps: list[tuple[str, Callable[[], Any]]] = []
        for k, shadow in enumerate(shadows):
            d, queue = shadow.durability, inflight[k]
            if d.pending:
                steps.append((f"{k}: sync and record", lambda d=d, q=queue: q.append(d.run_batch())))
            if queue:
                steps.append((f"{k}: apply", lambda d=d, q=queue: d.apply(*q.pop(0))))
        if steps and not sched.gate_all:
            steps[0][1]()  # batches run as soon as they can
            continue
        for k, shadow in enumerate(shadows):
            if any(j.files.session for j in shadow.live.values()):
                steps.append((f"{k}: look at the state",
                              lambda s=shadow: check_holders(s.store, s.live, _inline)))
        gates = [g for g in sched.options() if g.who in sched.started or g.who == len(sched.started)]
        busy = [g for g in gates if g.what != "backoff"] or [s for s in steps if not s[0].endswith("the state")]
        if busy:  # an agent's backoff is long: whatever else can go on, goes first
            gates = [g for g in gates if g.what != "backoff"]
        choices = [(f"{g.who}:{g.what}", g.go.set, g.who) for g in gates] + [(n, go, -1) for n, go in steps]
        if not gates and not [s for s in steps if not s[0].endswith("look at the state")]:
            return  # only looks at the state are left: nothing waits
        if sched.steps > 3000:
            raise sched.abort(f"no end after {sched.steps} steps")
        name, go, who = choices[sched.choose(len(choices))]
        if who >= 0:
            sched.started.add(who)
        sched.trace.append(name)
        sched.steps += 1
        result = go()
        if isinstance(result, Awaitable):
            await result


@pytest.mark.timeout(600)
@pytest.mark.parametrize("gate_all", [False, True], ids=["admission", "every-step"])
def test_interleavings_of_two_agents_at_two_shadows(pg_url: str, gate_all: bool) -> None:
    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def race(data: st.DataObject) -> None:
        run_race(pg_url, 2, lambda n: data.draw(st.integers(0, n - 1)), gate_all)

    race()


@pytest.mark.slow  # (two agents at two shadows run by default)
@pytest.mark.timeout(900)
def test_interleavings_of_three_agents_at_two_shadows(pg_url: str) -> None:
    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def race(data: st.DataObject) -> None:
        run_race(pg_url, 3, lambda n: data.draw(st.integers(0, n - 1)), True)

    race()
