"""Outcomes that cannot be known: a state record whose COMMIT failed may or
may not have applied, and the shadow is right for both.

Nothing that synced is cut back because a record failed; the session
acknowledges nothing more and stops (BUSY: it comes back); the next session
reads what the state holds and resumes from it, never refused for good.
The three kinds of trouble (taken over, state database, failed sync) are
told apart on the wire and in the log.

Here, in one process: the embedded state's COMMIT that applies and then
raises, the one that writes its frames to the WAL and then fails (a restart
would find it applied), and the wire codes. tests/test_unknown_e2e.py runs
real processes through a relay that cuts PostgreSQL connections at COMMIT,
and an embedded state whose syncs fail.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from statefaults import FailingStateSync

from gcwrap.shadow.admission import ShadowOptions
from gcwrap.shadow.durability import Durability, Fenced, LiveJob, Trouble
from gcwrap.shadow.files import Problem, StateUnavailable, StoreError
from gcwrap.shadow.replies import reply_to
from gcwrap.shadow.state import RecordUnknown, Store
from gcwrap.wire.events import ErrorCode, StreamSpec

STREAMS = (StreamSpec(1, "stdout", "out.bin"),)


def _open(store: Store, instance: str = "a1") -> Any:
    return store.open_job(job_id="j1", instance=instance, streams=STREAMS, host="h", user="u", command=["c"],
                          peer="p")


class _CommitThenRaise:
    """The state connection whose next COMMIT applies and then raises (a
    failure reported after the write: the outcome the caller sees is an
    error, the truth is "applied")."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.armed = 0

    def execute(self, sql: str, *args: Any) -> Any:
        cur = self._conn.execute(sql, *args)
        if sql == "COMMIT" and self.armed:
            self.armed -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return cur

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@dataclass
class Flaky:
    """A store whose COMMITs fail on demand, its durability, and a session
    of job j1 that made 1000 bytes durable."""

    store: Store
    commits: _CommitThenRaise
    durability: Durability
    job: LiveJob


@contextlib.contextmanager
def flaky_store(root: Path) -> Iterator[Flaky]:
    store = Store(root)
    commits = _CommitThenRaise(store.db.conn)
    store.db.conn = commits  # type: ignore[assignment]
    try:
        f = Flaky(store, commits, Durability(store), LiveJob("j1", instance="a1"))
        f.job.files = _open(store)
        _batch(f.durability, f.job, b"A" * 1000)
        yield f
    finally:
        store.db.conn = commits._conn
        store.close()


def _batch(durability: Durability, job: LiveJob, data: bytes) -> None:
    """Write `data` at the end of the job's stdout and run one durability batch (inline)."""
    sf = job.files.outputs[1]
    os.pwrite(sf.fd, data, sf.written)
    sf.written += len(data)
    durability.mark(sf, job, len(data))
    durability.apply(*durability.run_batch())


@pytest.mark.timeout(30)
def test_a_record_that_applied_and_raised_cuts_nothing_back_and_never_refuses_the_job(tmp_path: Path) -> None:
    """Before: the failed record cut the file back to the old durable length
    while the state held the new one, and every later session was refused
    for good (LENGTH_MISMATCH)."""
    with flaky_store(tmp_path) as f:
        store, flaky, durability, job = f.store, f.commits, f.durability, f.job
        assert job.files.outputs[1].durable == 1000 and not job.fenced
        flaky.armed = 1
        _batch(durability, job, b"B" * 500)
        sf = job.files.outputs[1]
        assert (tmp_path / "out.bin").stat().st_size == 1500, "synced bytes were cut back"
        assert sf.durable == 1000 and sf.synced == 1500  # nothing more acknowledged
        assert job.fenced and job.trouble is Trouble.STATE
        with pytest.raises(Fenced) as stopped:
            job.check()
        said = reply_to(stopped.value)
        assert said.code is ErrorCode.BUSY and 0 < said.retry_after <= 2, said
        job.files.close()
        # The next session: the state holds 1500 (the commit applied): resumed there, not refused.
        again = _open(store)
        assert again.outputs[1].durable == 1500
        assert (tmp_path / "out.bin").read_bytes() == b"A" * 1000 + b"B" * 500
        again.close()


@pytest.mark.timeout(30)
def test_a_record_that_failed_unapplied_resumes_from_the_old_length(tmp_path: Path) -> None:
    """The other outcome: the COMMIT did not apply. The next session
    resumes from the old length and cuts back the tail (once its own claim
    is committed): those bytes are sent again."""
    store = Store(tmp_path)
    durability = Durability(store)
    real = store.db.conn
    try:
        job = LiveJob("j1", instance="a1")
        job.files = _open(store)
        _batch(durability, job, b"A" * 1000)

        class _FailingCommit(_CommitThenRaise):
            def execute(self, sql: str, *args: Any) -> Any:
                if sql == "COMMIT" and self.armed:
                    self.armed -= 1
                    raise sqlite3.OperationalError("database or disk is full")
                return self._conn.execute(sql, *args)

        flaky = _FailingCommit(real)
        flaky.armed = 1
        store.db.conn = flaky  # type: ignore[assignment]
        _batch(durability, job, b"B" * 500)
        assert (tmp_path / "out.bin").stat().st_size == 1500 and job.trouble is Trouble.STATE
        job.files.close()
        again = _open(store)
        assert again.outputs[1].durable == 1000
        assert (tmp_path / "out.bin").read_bytes() == b"A" * 1000
        again.close()
    finally:
        store.db.conn = real
        store.close()


@pytest.mark.timeout(30)
def test_a_claim_whose_commit_fails_cuts_nothing_back(tmp_path: Path) -> None:
    """A new attempt's claim empties its files only once committed: before,
    it truncated them inside the transaction, and a claim whose COMMIT
    failed left a file shorter than what the state still recorded for the
    old attempt (refused for good when that one came back)."""
    store = Store(tmp_path)
    durability = Durability(store)
    real = store.db.conn
    try:
        job = LiveJob("j1", instance="a1")
        job.files = _open(store, "a1")
        _batch(durability, job, b"A" * 1000)
        job.files.close()
        flaky = _CommitThenRaise(real)
        store.db.conn = flaky  # type: ignore[assignment]

        def failing_commit(sql: str, *args: Any) -> Any:
            if sql == "COMMIT":
                raise sqlite3.OperationalError("disk I/O error")
            return real.execute(sql, *args)

        flaky.execute = failing_commit  # type: ignore[method-assign]
        (refused,) = store.open_jobs([{"job_id": "j1", "instance": "a2", "streams": STREAMS, "host": "h",
                                       "user": "u", "command": ["c"], "peer": "p"}])
        assert isinstance(refused, StateUnavailable) and refused.problem is Problem.STATE
        assert (tmp_path / "out.bin").stat().st_size == 1000, "a claim that did not commit emptied the file"
        store.db.conn = real
        back = _open(store, "a1")  # the old attempt comes back: its bytes are all there
        assert back.outputs[1].durable == 1000
        back.close()
        fresh = _open(store, "a2")  # and the new one, committed, starts afresh
        assert (tmp_path / "out.bin").stat().st_size == 0 and fresh.outputs[1].durable == 0
        fresh.close()
    finally:
        store.db.conn = real
        store.close()


@pytest.mark.timeout(30)
def test_the_three_kinds_of_trouble_have_three_wire_codes_and_log_lines() -> None:
    taken = reply_to(Fenced("a newer connection of this job took over"))
    state = reply_to(Fenced("the state database failed", Trouble.STATE))
    sync = reply_to(Fenced("the shadow could not sync out.bin: Input/output error", Trouble.SYNC))
    unavailable = reply_to(StateUnavailable("cannot reach the state database"))
    assert (taken.code, state.code, sync.code, unavailable.code) == (
        ErrorCode.FENCED, ErrorCode.BUSY, ErrorCode.IO_ERROR, ErrorCode.BUSY)
    assert state.retry_after > 0 and unavailable.retry_after > 0  # BUSY says when to come back
    assert not any(c.code.permanent for c in (taken, state, sync, unavailable) if c.code is not None)
    assert "(fenced)" in taken.said and "state database is unavailable" in state.said and "sync failed" in sync.said
    assert sync.level == logging.ERROR and state.level == logging.WARNING and taken.level == logging.INFO
    # A refusal for good stays one: damage that is real.
    damaged = reply_to(StoreError(Problem.CHANGED_AT_HOME, "'o' holds 1 bytes but 2 were acknowledged"))
    assert damaged.code is ErrorCode.LENGTH_MISMATCH and damaged.code.permanent


@pytest.mark.timeout(60)
def test_a_failed_sync_cuts_back_to_what_synced_before_never_below_a_record_in_doubt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record in doubt (it may hold 1500), then a sync of the same file
    fails in the batch already under way: the file is cut back to the 1500
    bytes that synced, not to the 1000 acknowledged (the state may hold
    1500: a shorter file would be refused for good)."""
    with flaky_store(tmp_path) as f:
        store, durability, job = f.store, f.durability, f.job
        f.commits.armed = 1
        _batch(durability, job, b"B" * 500)
        sf = job.files.outputs[1]

        def failing(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", failing)  # (the batch under way: its sync fails)
        _batch(durability, job, b"C" * 200)
        monkeypatch.undo()
        assert sf.cut_back and (tmp_path / "out.bin").stat().st_size == 1500
        assert job.trouble is Trouble.STATE  # (the first trouble stands)
        job.files.close()
        again = _open(store)
        assert again.outputs[1].durable == 1500
        again.close()


@pytest.mark.timeout(30)
def test_record_unknown_is_told_apart_from_a_failed_sync(tmp_path: Path) -> None:
    """make_durable: a synced file whose record failed gets RecordUnknown,
    never the error of a failed sync (which would cut it back)."""
    store = Store(tmp_path)
    flaky = _CommitThenRaise(store.db.conn)
    store.db.conn = flaky  # type: ignore[assignment]
    try:
        files = _open(store)
        sf = files.outputs[1]
        os.pwrite(sf.fd, b"x" * 10, 0)
        sf.written = 10
        flaky.armed = 1
        results, why = store.make_durable([(sf, 10)])
        assert why and [type(err) for _, _, err in results] == [RecordUnknown]
        files.close()
    finally:
        store.db.conn = flaky._conn
        store.close()


# -- the WAL's frames of a COMMIT that failed: a restart finds them ---------------------------------

_SCRIPT = r"""
import os, sys
from gcwrap.shadow.durability import Durability, LiveJob
from gcwrap.shadow.state import Store
from gcwrap.wire.events import StreamSpec
root, control, step = sys.argv[1], sys.argv[2], sys.argv[3]
store = Store(__import__("pathlib").Path(root))
streams = (StreamSpec(1, "stdout", "out.bin"),)
def claim():
    return store.open_job(job_id="j1", instance="a1", streams=streams, host="h", user="u", command=[], peer="p")
if step == "write":
    d = Durability(store)
    job = LiveJob("j1", instance="a1")
    job.files = claim()
    sf = job.files.outputs[1]
    for n, byte in ((1000, b"A"), (500, b"B")):
        if byte == b"B":
            open(control, "w").write("1\n")  # the next WAL sync fails, after writing
        os.pwrite(sf.fd, byte * n, sf.written)
        sf.written += n
        d.mark(sf, job, n)
        d.apply(*d.run_batch())
    print(sf.durable, sf.synced, job.trouble.name if job.fenced else "-", flush=True)
    if sys.argv[4] == "claim":  # the next session, in the same process: its read and commit settle the outcome
        job.files.close()
        print(claim().outputs[1].durable, flush=True)
    os._exit(0)  # as kill -9: no checkpoint, no close
print(claim().outputs[1].durable, os.path.getsize(os.path.join(root, "out.bin")), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("then", ["crash", "claim"])
def test_a_commit_whose_wal_sync_failed_is_settled_either_way(tmp_path: Path, failsync: Path, then: str) -> None:
    """Real SQLite, whose WAL sync fails after writing (an LD_PRELOAD
    library): the shadow's connection does not see the commit, but a
    restart's recovery does. Killed at once, the restart finds 1500 (the
    file holds them: never shortened). Settled by the next session first,
    1000 is the truth from then on, for every reader, after any restart."""
    faults = FailingStateSync(failsync, tmp_path / "control")
    root = tmp_path / "root"
    root.mkdir()
    env = faults.env()
    first = subprocess.run([sys.executable, "-c", _SCRIPT, str(root), str(faults.control), "write", then], env=env,
                           capture_output=True, text=True, timeout=30, check=True)
    lines = first.stdout.split()
    assert lines[:3] == ["1000", "1500", "STATE"], first.stdout + first.stderr
    assert faults.left() == 0
    if then == "claim":
        assert lines[3] == "1000"  # settled as not applied: the tail is cut back and sent again
    restart = subprocess.run([sys.executable, "-c", _SCRIPT, str(root), str(faults.control), "reopen"],
                             capture_output=True, text=True, timeout=30, check=True)
    durable, size = map(int, restart.stdout.split())
    assert durable == (1500 if then == "crash" else 1000), restart.stdout + restart.stderr
    assert size == durable  # resumed: not refused (a file shorter than the record would be)


# -- the shadow, in process: a session stopped by the state database is told BUSY -------------------


@pytest.mark.timeout(30)
async def test_the_state_database_lost_mid_session_tells_the_agent_busy_not_fenced(tmp_path: Path) -> None:
    from gcwrap.shadow.connection import AgentConnection
    from gcwrap.shadow.server import Shadow
    from gcwrap.wire.events import Data, Error, Hello, Welcome
    from gcwrap.wire.protocol import NEED_DATA, Connection, Role

    store = Store(tmp_path)
    flaky = _CommitThenRaise(store.db.conn)
    store.db.conn = flaky  # type: ignore[assignment]
    shadow = Shadow(ShadowOptions(root=tmp_path, min_free=0), store)
    got: list[Any] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shadow.durability.run)
            client, server = trio.testing.memory_stream_pair()
            nursery.start_soon(AgentConnection(shadow, server, "agent", "test").serve)
            conn = Connection(Role.AGENT)
            await client.send_all(conn.send(Hello(job_id="j1", instance="a1", streams=STREAMS)))

            async def next_event() -> Any:
                while (ev := conn.next_event()) is NEED_DATA:
                    conn.receive_data(await client.receive_some(65536))
                return ev

            assert isinstance(await next_event(), Welcome)
            flaky.armed = 1
            await client.send_all(conn.send(Data(1, 0, b"x" * 100)))
            with trio.fail_after(10):
                while not isinstance(ev := await next_event(), Error):
                    got.append(ev)
            nursery.cancel_scope.cancel()
    finally:
        store.db.conn = flaky._conn
        store.close()
    assert ev.code is ErrorCode.BUSY and ev.retry_after > 0, ev
    assert "state database" in ev.message
    assert (tmp_path / "out.bin").stat().st_size == 100
