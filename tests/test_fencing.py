"""Sessions of one job racing at the shadow, through every interleaving.

Two or three connections of one job (a relay delivering an abandoned
attempt with the current one, an agent reconnecting while its old
connection lingers) meet at the shadow's await points: reading the
handshake, waiting for an earlier session to close its files, making room
for descriptors, opening the files in the worker thread, sending WELCOME,
each read, each ACK, recording EXIT, and closing. A scheduler decides which
session goes on at each of them, so every order is tried, not one lucky one:
all of them for the admission path (depth-first, exhaustively: two
sessions here, three behind --run-slow), and orders that hypothesis chooses
when every read, send and durability batch is a step as well.

At every step the test asserts: at most one session holds the job; no file
is cut back (ftruncate) while an earlier session of the job still has it
open; only the holder pwrites; a fenced session sends no WELCOME, ACK or
DONE. At the end: every session's files are closed
(no descriptor left behind), and the file holds the job's bytes exactly once.

The shadow is the real one (`gcwrap.shadow.server.Shadow` over a real `Store` in a
temporary root); only its thread hops run inline, at the scheduler's word.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcwrap.shadow.admission import ShadowOptions
from gcwrap.shadow.connection import AgentConnection
from gcwrap.shadow.durability import LiveJob
from gcwrap.shadow.server import Shadow
from gcwrap.shadow.state import Store
from gcwrap.sync import leaves
from gcwrap.wire.events import Ack, Data, Done, Error, ErrorCode, Event, Exit, Hello, StreamSpec, Welcome
from gcwrap.wire.protocol import MAGIC, NEED_DATA, Connection, FrameType, Role

T = TypeVar("T")
JOB = "racer"
CONTENT = bytes(range(256)) * 12  # 3072 bytes, sent in CHUNK pieces
CHUNK = 1024
WHO: contextvars.ContextVar[int] = contextvars.ContextVar("who", default=-1)


class Invariant(AssertionError):
    pass


# -- the scheduler --------------------------------------------------------------------------


@dataclass
class Gate:
    who: int
    what: str
    seq: int
    go: trio.Event = field(default_factory=trio.Event)


class Scheduler:
    """Holds every session at its await points; `choose(n)` picks which of
    the n waiting ones goes on, once nothing else can run."""

    def __init__(self, choose: Callable[[int], int], gate_all: bool) -> None:
        self.choose = choose
        self.gate_all = gate_all  # every read, send and durability batch too, not only the admission path
        self.waiting: list[Gate] = []
        self.violations: list[str] = []
        self.started: set[int] = set()  # agents that made their first step
        self.closing = False  # the run is over: gates no longer hold anyone
        self.seq = 0
        self.steps = 0
        self.trace: list[str] = []

    async def point(self, what: str, *, shield: bool = False) -> None:
        if self.closing:
            return
        self.seq += 1
        gate = Gate(WHO.get(), what, self.seq)
        self.waiting.append(gate)
        try:
            with trio.CancelScope(shield=shield):
                await gate.go.wait()
        finally:
            if gate in self.waiting:
                self.waiting.remove(gate)

    def abort(self, message: str) -> Invariant:
        """Let every gate go (a shielded one would hold the run forever) and
        return the failure to raise."""
        self.closing = True
        for g in self.waiting:
            g.go.set()
        return Invariant(f"{message}; schedule: {self.trace}")

    def options(self) -> list[Gate]:
        # Sorted by who and what, not by arrival: the same state offers the same choices.
        return sorted(self.waiting, key=lambda g: (g.who, g.what, g.seq))


class SteppedShadow(Shadow):
    """The real shadow, whose thread hops run inline at the scheduler's word."""

    def __init__(self, opts: ShadowOptions, store: Store, sched: Scheduler) -> None:
        super().__init__(opts, store)
        self.sched = sched
        self.claimed: list[LiveJob] = []
        self.mine: dict[int, LiveJob] = {}  # each connection's session
        room = self.fds.room

        async def stepped_room(n: int) -> None:  # (the descriptor budget's wait for room: a step)
            await sched.point("room")
            await room(n)

        self.fds.room = stepped_room  # type: ignore[method-assign]

    def claim(self, job_id: str, instance: str, identity: str, tenant: str = "", *, known: bool = False) -> LiveJob:
        job = super().claim(job_id, instance, identity, tenant, known=known)
        self.claimed.append(job)
        self.mine[WHO.get()] = job
        return job

    async def wait_closed(self, job: LiveJob) -> None:
        await self.sched.point("wait for the earlier session")
        await super().wait_closed(job)

    async def worker(self, fn: Callable[[], T]) -> T:
        # Like trio.to_thread.run_sync: cancellable while it waits for the
        # worker; once the work has started, its result comes back even if
        # the caller was cancelled meanwhile.
        await self.sched.point("worker: start")
        result = fn()
        await self.sched.point("worker: result", shield=True)
        return result


class SteppedStream(trio.abc.Stream):
    """The shadow's end of a memory connection: reads and sends are steps.
    What goes out is checked: a session that no longer holds its job sends
    no WELCOME, ACK or DONE (an ERROR, yes)."""

    def __init__(self, inner: trio.abc.Stream, sched: Scheduler, shadow: SteppedShadow) -> None:
        self.inner = inner
        self.sched = sched
        self.shadow = shadow
        self.reads = 0
        self.sends = 0

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sends += 1
        if self.sched.gate_all or self.sends == 1:  # the first send is the WELCOME (or a refusal)
            await self.sched.point("send")
        job = self.shadow.mine.get(WHO.get())
        if job is not None and (job.fenced or self.shadow.live.get(JOB) is not job):
            kinds = _frame_types(bytes(data))
            if kinds & {FrameType.WELCOME, FrameType.ACK, FrameType.DONE}:
                self.sched.violations.append(f"session {WHO.get()} sent {sorted(k.name for k in kinds)} "
                                             "after it was fenced")
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        self.reads += 1
        if self.sched.gate_all or self.reads == 1:  # the first read holds the HELLO: the claim follows it
            await self.sched.point("read")
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


# -- the agents --------------------------------------------------------------------------------


async def agent(stream: trio.abc.Stream, outcome: list[str]) -> None:
    """An honest agent of the job: HELLO, DATA from the durable offset on,
    EXIT once all is acknowledged. Stops at the first ERROR."""
    conn = Connection(Role.AGENT)

    async def next_event() -> Event:
        while (ev := conn.next_event()) is NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        assert isinstance(ev, Event)
        return ev

    hello = Hello(job_id=JOB, instance="i1", streams=(StreamSpec(1, "stdout", "out"),), host="test")
    try:
        await stream.send_all(conn.send(hello))
        ev = await next_event()
        if isinstance(ev, Welcome):
            outcome.append("welcome")
            pos = dict(ev.durable)[1]
            while pos < len(CONTENT):
                await stream.send_all(conn.send(Data(1, pos, CONTENT[pos : pos + CHUNK])))
                pos = min(len(CONTENT), pos + CHUNK)
            if dict(ev.durable)[1] < len(CONTENT):
                while isinstance(ev := await next_event(), Ack) and ev.offset < len(CONTENT):
                    pass
            if isinstance(ev, (Ack, Welcome)):
                await stream.send_all(conn.send(Exit(0, None, ((1, len(CONTENT)),))))
                ev = await next_event()
        outcome.append("done" if isinstance(ev, Done) else ev.code.name if isinstance(ev, Error) else type(ev).__name__)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        outcome.append("lost")
    finally:
        await stream.aclose()


# -- one run ----------------------------------------------------------------------------------


def _frame_types(data: bytes) -> set[FrameType]:
    """The types of the whole frames in `data` (sends are whole frames)."""
    kinds, pos = set(), 0
    if data.startswith(MAGIC):
        pos = len(MAGIC)
    while pos + 5 <= len(data):
        length, ftype = struct.unpack_from("!IB", data, pos)
        kinds.add(FrameType(ftype))
        pos += 4 + length
    return kinds


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


@contextlib.contextmanager
def watched(shadow: SteppedShadow, out: Path, violations: list[str]) -> Iterator[list[str]]:
    """Check the invariants where they matter: at every ftruncate of the
    job's file and at every pwrite."""
    real_ftruncate, real_pwrite = os.ftruncate, os.pwrite

    def open_elsewhere() -> list[LiveJob]:
        return [j for j in shadow.claimed if any(sf.fd >= 0 for sf in j.files.all())]

    def ftruncate(fd: int, length: int) -> None:
        if _fd_path(fd) == str(out):
            others = open_elsewhere()
            if others:
                violations.append(f"cut back to {length} while session(s) {[shadow.claimed.index(j) for j in others]}"
                                  " still had the file open")
        real_ftruncate(fd, length)

    def pwrite(fd: int, data: Any, offset: int) -> int:
        writers = [j for j in shadow.claimed if any(sf.fd == fd for sf in j.files.outputs.values())]
        for j in writers:
            if j.fenced or shadow.live.get(JOB) is not j:
                violations.append(f"session {shadow.claimed.index(j)} wrote at {offset} without holding the job")
        return real_pwrite(fd, data, offset)

    os.ftruncate, os.pwrite = ftruncate, pwrite  # type: ignore[assignment]
    try:
        yield violations
    finally:
        os.ftruncate, os.pwrite = real_ftruncate, real_pwrite  # type: ignore[assignment]


def holders(shadow: SteppedShadow) -> list[int]:
    """Sessions that could write now: files open and not fenced."""
    return [i for i, j in enumerate(shadow.claimed) if j.files.session and j.files.outputs and not j.fenced]


def run_race(n: int, choose: Callable[[int], int], gate_all: bool) -> list[str]:
    """Race n sessions of one job; return the schedule taken (for messages).
    Raises Invariant on any violation."""
    with tempfile.TemporaryDirectory(prefix="gcw-fence-") as tmp:
        root = Path(tmp)
        store = Store(root)
        # Count this race's descriptors only: an earlier test's garbage (a
        # trio run's epoll and wake-up pair held by a traceback cycle) must
        # not close in the middle of the count.
        gc.collect()
        fds_before = len(os.listdir("/proc/self/fd"))
        sched = Scheduler(choose, gate_all)
        shadow = SteppedShadow(ShadowOptions(root=root, min_free=0, idle_timeout=30), store, sched)
        outcomes: list[list[str]] = [[] for _ in range(n)]
        inflight: list[Any] = []
        try:
            with watched(shadow, root / "out", sched.violations) as violations:
                try:
                    trio.run(_race, shadow, sched, outcomes, inflight)
                except BaseExceptionGroup as group:
                    errors = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
                    raise next((e for e in errors if isinstance(e, Invariant)), errors[0]) from None
            schedule = sched.trace
            if violations:
                raise Invariant(f"{violations[0]}; schedule: {schedule}")
            # Every session's files are closed, none is left registered.
            left = [i for i, j in enumerate(shadow.claimed) if any(sf.fd >= 0 for sf in j.files.all())]
            if left or len(shadow.fds.files) or shadow.live or shadow.sessions:
                raise Invariant(f"files left open by sessions {left}; schedule: {schedule}")
            gc.collect()
            fds_after = len(os.listdir("/proc/self/fd"))
            if fds_after != fds_before:
                raise Invariant(f"{fds_after - fds_before} descriptors leaked; schedule: {schedule}")
            # The last session to claim the job is never fenced, so it finishes;
            # an earlier one finishes too, or is told FENCED, or is cut off
            # when the fence cancelled a send (trio leaves a stream whose
            # send_all was cancelled broken: nothing more is sent on it).
            ends = ("done", "FENCED", "ConnectionClosed", "lost")
            if not any(o[-1] == "done" for o in outcomes) or any(o[-1] not in ends for o in outcomes):
                raise Invariant(f"outcomes {outcomes}; schedule: {schedule}")
            if (root / "out").read_bytes() != CONTENT:
                raise Invariant(f"the file is not the job's bytes exactly once; schedule: {schedule}")
            row = store.db.execute("SELECT state FROM jobs WHERE job_id = ?", [JOB]).fetchone()
            durable = store.db.execute("SELECT durable FROM streams WHERE job_id = ?", [JOB]).fetchone()
            if row[0] != "finished" or durable[0] != len(CONTENT):
                raise Invariant(f"state {row[0]}, durable {durable[0]}; schedule: {schedule}")
            return schedule
        finally:
            store.close()


async def _race(shadow: SteppedShadow, sched: Scheduler, outcomes: list[list[str]], inflight: list[Any]) -> None:
    async with trio.open_nursery() as nursery:
        for i in range(len(outcomes)):
            client, server = trio.testing.memory_stream_pair()

            async def session(i: int = i, server: trio.abc.Stream = server) -> None:
                WHO.set(i)
                stream = SteppedStream(server, sched, shadow)
                try:
                    await AgentConnection(shadow, stream, f"agent{i}", "test").serve()
                finally:
                    await trio.aclose_forcefully(stream)

            nursery.start_soon(agent, client, outcomes[i])
            nursery.start_soon(session)
        with trio.move_on_after(30) as deadline:
            try:
                await _schedule(shadow, sched, inflight)
            except BaseException:  # hypothesis' StopTest too: no gate may hold the run
                sched.abort("")
                raise
        if deadline.cancelled_caught:
            raise sched.abort(f"no end after 30 s: {tasks()}")
        if not all(outcomes) or nursery.child_tasks:
            raise sched.abort(f"a session hung: {outcomes}; {tasks()}")


async def _schedule(shadow: SteppedShadow, sched: Scheduler, inflight: list[Any]) -> None:
    """Let one waiting session (or durability step) go on at a time, once
    nothing else can run, until nothing waits."""
    durability = shadow.durability
    while True:
        with trio.move_on_after(10) as spinning:
            await trio.testing.wait_all_tasks_blocked()
        if spinning.cancelled_caught:
            raise sched.abort(f"a task never blocks: {tasks()}")
        if len(holders(shadow)) > 1:
            raise sched.abort(f"sessions {holders(shadow)} hold the job at once")
        steps: list[tuple[str, Callable[[], None]]] = []
        if durability.pending:
            steps.append(("durability: sync and record", lambda: inflight.append(durability.run_batch())))
        if inflight:
            steps.append(("durability: apply", lambda: durability.apply(*inflight.pop(0))))
        if steps and not sched.gate_all:
            steps[0][1]()  # batches run as soon as they can: only the admission path is scheduled
            continue
        # The agents are alike, so orders that differ only in which agent is
        # which are one order: agent i makes its first step after agent i-1.
        gates = [g for g in sched.options() if g.who in sched.started or g.who == len(sched.started)]
        choices = [(f"{g.who}:{g.what}", g.go.set, g.who) for g in gates] + [(n, go, -1) for n, go in steps]
        if not choices:
            return
        if sched.steps > 2000:
            raise sched.abort(f"no end after {sched.steps} steps")
        name, go, who = choices[sched.choose(len(choices))]
        if who >= 0:
            sched.started.add(who)
        sched.trace.append(name)
        sched.steps += 1
        go()


def tasks() -> list[str]:
    """Where every task waits (for a failure message)."""
    out: list[str] = []

    def walk(task: trio.lowlevel.Task) -> None:
        frames = [f"{f.f_code.co_name}:{line}" for f, line in task.iter_await_frames()]
        out.append(f"{task.name.rsplit('.', 1)[-1]} at {' > '.join(frames[-3:])}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)

    walk(trio.lowlevel.current_root_task())
    return out


# -- every interleaving of the admission path ----------------------------------------------------


class Exhaustive:
    """Depth-first through every sequence of choices: replay a prefix, then
    take the first option; the next run advances the deepest choice left."""

    def __init__(self) -> None:
        self.prefix: list[int] = []
        self.widths: list[int] = []
        self.taken: list[int] = []

    def __call__(self, n: int) -> int:
        depth = len(self.taken)
        if depth < len(self.prefix):
            assert self.widths[depth] == n, "the same choices must lead to the same state"
            pick = self.prefix[depth]
        else:
            self.widths.append(n)
            pick = 0
        self.taken.append(pick)
        return pick

    def advance(self) -> bool:
        """Set up the next sequence; False when every one was run."""
        taken, widths = self.taken, self.widths[: len(self.taken)]
        while taken and taken[-1] + 1 >= widths[-1]:
            taken.pop()
            widths.pop()
        if not taken:
            return False
        taken[-1] += 1
        self.prefix, self.widths, self.taken = taken, widths, []
        return True


def every_interleaving(sessions: int, limit: int) -> int:
    dfs = Exhaustive()
    runs = 0
    while True:
        run_race(sessions, dfs, gate_all=False)
        runs += 1
        if not dfs.advance():
            return runs
        assert runs < limit, "the admission path has more interleavings than expected"


@pytest.mark.timeout(120)
def test_every_interleaving_of_two_sessions() -> None:
    runs = every_interleaving(2, 1000)
    assert runs >= 40, f"only {runs} interleavings: the scheduler steers nothing"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_interleaving_of_three_sessions() -> None:
    """About 8,000 orders (three minutes)."""
    runs = every_interleaving(3, 50_000)
    assert runs >= 5_000, f"only {runs} interleavings: the scheduler steers nothing"


# -- orders hypothesis chooses, every read, send and batch a step ------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sessions", [2, pytest.param(3, marks=pytest.mark.slow)])  # (3: 40 s; --run-slow)
@settings(max_examples=150 if os.environ.get("GCWRAP_TEST_SLOW") else 60, deadline=None,  # (60: 13 s)
          suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(data=st.data())
def test_interleavings_with_every_step_scheduled(sessions: int, data: st.DataObject) -> None:
    run_race(sessions, lambda n: data.draw(st.integers(0, n - 1)), gate_all=True)


# -- the state database: a superseded session records nothing -----------------------------------------


def _open(store: Store, instance: str) -> Any:
    return store.open_job(job_id=JOB, instance=instance, streams=[StreamSpec(1, "stdout", "out")], host="h",
                          user="u", command=[], peer="p")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("instance", ["i1", "i2"], ids=["same attempt", "new attempt"])
def test_a_late_batch_of_a_superseded_session_records_nothing(tmp_path: Path, instance: str) -> None:
    """A durability batch of session 1 that lands after session 2 opened the
    job: its length is not recorded (in the same transaction as the check of
    who holds the job) and comes back Superseded, so it is neither
    acknowledged nor cut back. Unconditionally recorded, a new attempt's
    file (started afresh, 0 bytes) was recorded as holding the old attempt's
    length: acknowledged bytes it never had."""
    from gcwrap.shadow.state import Superseded

    store = Store(tmp_path)
    try:
        old = _open(store, "i1")
        sf = old.outputs[1]
        os.pwrite(sf.fd, b"x" * 5000, 0)
        sf.written = 5000
        old.close()  # (its descriptor closed, as a fenced session's are before the next opens)
        new = _open(store, instance)
        assert new.session == old.session + 1
        sf.fd = os.open(tmp_path / "out", os.O_WRONLY)  # the batch still holds a descriptor of the file
        try:
            results, db_error = store.make_durable([(sf, 5000)])
        finally:
            os.close(sf.fd)
        durable = store.db.execute("SELECT durable FROM streams WHERE job_id = ?", [JOB]).fetchone()[0]
        assert durable == 0, "the superseded session's length was recorded"
        assert db_error == ""
        assert [type(err) for _, _, err in results] == [Superseded]
        # The holder's own batch records as ever.
        mine = new.outputs[1]
        os.pwrite(mine.fd, b"y" * 10, 0)
        mine.written = 10
        results, _ = store.make_durable([(mine, 10)])
        assert [err for _, _, err in results] == [None]
        assert store.db.execute("SELECT durable FROM streams WHERE job_id = ?", [JOB]).fetchone()[0] == 10
        new.close()
    finally:
        store.close()


@pytest.mark.timeout(30)
def test_exit_and_disconnect_are_recorded_only_by_the_holder(tmp_path: Path) -> None:
    """A superseded session's EXIT or "disconnected" must not land on the
    job's row once a newer session holds it."""
    store = Store(tmp_path)
    try:
        old = _open(store, "i1")
        old.close()
        new = _open(store, "i1")
        assert not store.record_disconnected(JOB, old.session)
        assert not store.record_finished(JOB, old.session, code=3, signal=None, reason="", summary={})
        row = store.db.execute("SELECT state, exit_code FROM jobs WHERE job_id = ?", [JOB]).fetchone()
        assert tuple(row) == ("streaming", None)
        assert store.record_finished(JOB, new.session, code=0, signal=None, reason="", summary={})
        new.close()
    finally:
        store.close()


@pytest.mark.timeout(30)
def test_a_session_waits_for_an_earlier_one_a_bounded_time_and_says_why(tmp_path: Path) -> None:
    """An earlier session of the job that cannot close its files (a sync
    stuck on a slow disk) keeps the next one out, not forever: BUSY after
    10 s, saying why, and nothing opened or cut back meanwhile."""
    (tmp_path / "out").write_bytes(b"kept")
    store = Store(tmp_path)
    shadow = Shadow(ShadowOptions(root=tmp_path, min_free=0), store)
    stuck = shadow.claim(JOB, "i1", "test")  # never gone
    got: list[Event] = []

    async def main() -> None:
        client, server = trio.testing.memory_stream_pair()
        conn = Connection(Role.AGENT)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(AgentConnection(shadow, server, "late", "test").serve)
            hello = Hello(job_id=JOB, instance="i1", streams=(StreamSpec(1, "stdout", "out"),))
            await client.send_all(conn.send(hello))
            while not got:
                while (ev := conn.next_event()) is NEED_DATA:
                    conn.receive_data(await client.receive_some(65536))
                got.append(ev)
            await client.aclose()

    try:
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        store.close()
    (ev,) = got
    assert isinstance(ev, Error) and ev.code is ErrorCode.BUSY, ev
    assert "an earlier connection of job racer is still closing its files" in ev.message
    assert stuck.fenced
    assert (tmp_path / "out").read_bytes() == b"kept"


@pytest.mark.timeout(60)
def test_stopping_with_a_batch_in_flight_closes_the_files_and_ends(tmp_path: Path) -> None:
    """SIGTERM (the shadow's nursery cancelled) while a durability batch
    holds a session's files pinned: the batch ends, the files are closed and
    the shadow stops. The session's release waited for the batch's "done",
    which a stopped durability loop never fired: the shadow hung."""
    import threading

    store = Store(tmp_path)
    shadow = Shadow(ShadowOptions(root=tmp_path, min_free=0), store)
    in_sync, let_go = threading.Event(), threading.Event()
    real_sync = store.syncer.sync

    def slow_sync(files: list[Any]) -> list[Any]:
        in_sync.set()
        let_go.wait(20)
        return real_sync(files)

    store.syncer.sync = slow_sync  # type: ignore[method-assign]
    ended = False

    async def main() -> None:
        nonlocal ended
        client, server = trio.testing.memory_stream_pair()
        conn = Connection(Role.AGENT)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(shadow.durability.run)
                nursery.start_soon(AgentConnection(shadow, server, "a", "test").serve)
                hello = Hello(job_id=JOB, instance="i1", streams=(StreamSpec(1, "stdout", "out"),))
                await client.send_all(conn.send(hello))
                while not isinstance(conn.next_event(), Welcome):
                    conn.receive_data(await client.receive_some(65536))
                await client.send_all(conn.send(Data(1, 0, b"x" * 100)))
                await trio.to_thread.run_sync(in_sync.wait, 10)  # the batch is in flight, the file pinned
                nursery.cancel_scope.cancel()  # the shadow stops
                threading.Timer(0.2, let_go.set).start()
        ended = True

    try:
        trio.run(main)
    finally:
        let_go.set()
        store.close()
    assert ended
    assert not shadow.sessions and len(shadow.fds.files) == 0


# -- a stale attempt of the job (end to end) ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_stale_attempt_does_not_take_the_job_from_the_newer_one(tmp_path: Path) -> None:
    """Two attempts of one job at once (a requeued job whose first run still
    lives): the newer one takes the job, the older is refused STALE_ATTEMPT
    and, refused for good, keeps trying every --retry-timeout. Each of those
    tries must be refused without taking the job from the newer attempt.
    Before: each fenced the newer attempt's live session first, then was
    refused (21 sessions of the newer attempt in 10 s)."""
    import re

    from helpers import ShadowProc, Wrapper, expected, genjob, sha256_file, wait_until

    home, logs = tmp_path / "home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    sh = ShadowProc(home, logs)
    sh.start()
    n = 8_000_000

    def attempt(i: int, seed: int) -> Wrapper:
        return Wrapper(["--shadow", sh.address, "--spool", str(tmp_path / f"spool{i}"), "--job-id", "twice",
                        "--retry-limit", "0", "--retry-timeout", "0.2", "--heartbeat", "1", "--stdout", "t.out", "--",
                        *genjob(n, 0, seed=seed, rate=1_000_000)])

    try:
        older = attempt(0, 11)
        wait_until(lambda: "job twice session 1" in sh.log(), 30, "the first attempt's session")
        newer = attempt(1, 12)
        assert newer.wait(60) == 0, newer.err.decode()
        older_rc = older.wait(60)
    finally:
        sh.stop()
    assert older_rc == 123, older.err.decode()
    assert b"STALE_ATTEMPT" in older.err
    assert sha256_file(home / "t.out") == expected(n, 12), "the newer attempt's output, whole"
    reconnects = int(re.search(rb"(\d+) reconnect\(s\)", newer.err).group(1))  # type: ignore[union-attr]
    assert reconnects <= 1, f"the stale attempt took the job from the newer one {reconnects} times"
