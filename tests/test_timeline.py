"""A job's timeline at home, refused connections and the shadow's own
state, as both states keep them (the root's SQLite and PostgreSQL), and
`why` a job looks the way it does.

The states are real (a real PostgreSQL: tests/pgserver.py); the shadow's
side of the recording (what it queues, how it batches and bounds) is in
tests/test_timeline_e2e.py, with real processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gcwrap.shadow import timeline
from gcwrap.shadow.backends import read_homes, read_jobs, read_refusals
from gcwrap.shadow.state import Store
from gcwrap.shadow.timeline import EVENTS_KEPT, REFUSALS_KEPT, Batch, Home, JobEvent, Refusal
from gcwrap.shadow.why import status, why
from gcwrap.wire.events import StreamSpec

pytestmark = pytest.mark.timeout(120)

STREAMS = (StreamSpec(1, "stdout", "out.txt"),)


@pytest.fixture(params=["sqlite", "postgresql"])
def state(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, str]]:
    """A store of each kind, and the --state its readers are given."""
    if request.param == "sqlite":
        store, url = Store(tmp_path), ""
    else:
        from gcwrap.shadow.pgstate import PgStore

        url = request.getfixturevalue("pg_url")
        store = PgStore(tmp_path, url)
    try:
        yield store, url
    finally:
        store.close()


def _open(store: Store, job: str = "j1") -> int:
    files = store.open_job(job_id=job, instance="a1", streams=STREAMS, host="h", user="u", command=["c"], peer="p")
    files.close()
    return files.session


def test_events_are_kept_once_in_time_order_for_known_jobs_only(state: tuple[Store, str], tmp_path: Path) -> None:
    store, url = state
    _open(store)
    t = time.time()
    note = JobEvent("j1", t - 5, "stalled", "agent", {"since": t - 17, "seconds": 12.0, "shadow": "h:1"})
    store.record_timeline(Batch(events=[
        JobEvent("j1", t, "session_opened", "shadow", {"session": 1, "peer": "p", "host": "h"}),
        note, note,  # (at least once: the same note twice is kept once)
        JobEvent("nobody", t, "refused", "shadow", {"code": "AUTH_FAILED", "message": "m", "peer": "p"}),
    ]))
    store.record_timeline(Batch(events=[note, JobEvent("j1", t - 5, "stalled", "agent", {"seconds": 12.0})]))
    [job] = read_jobs(url, tmp_path)
    assert [(e["kind"], e["source"]) for e in job["events"]] == [
        ("stalled", "agent"), ("stalled", "agent"), ("session_opened", "shadow")]
    assert job["events"][-1] == {"time": t, "kind": "session_opened", "source": "shadow",
                                 "details": {"session": 1, "peer": "p", "host": "h"}}
    assert {"since": t - 17, "seconds": 12.0, "shadow": "h:1"} in [e["details"] for e in job["events"]]
    assert [j["job_id"] for j in read_jobs(url, tmp_path)] == ["j1"]  # (no job made for a refusal)
    assert read_jobs(url, tmp_path, job="j1", events=1)[0]["events"] == job["events"][-1:]
    assert read_jobs(url, tmp_path, events=0)[0]["events"] == []


def test_a_jobs_events_are_bounded_the_newest_kept(state: tuple[Store, str], tmp_path: Path) -> None:
    store, url = state
    _open(store)
    t = time.time()
    for start in (0, 700):
        store.record_timeline(Batch(events=[JobEvent("j1", t + i, "compression", "agent", {"on": i % 2 == 0})
                                            for i in range(start, start + 700)]))
    [job] = read_jobs(url, tmp_path)
    assert len(job["events"]) == EVENTS_KEPT
    assert job["events"][0]["time"] == t + 1400 - EVENTS_KEPT and job["events"][-1]["time"] == t + 1399


def test_refusals_are_bounded_newest_first(state: tuple[Store, str], tmp_path: Path) -> None:
    store, url = state
    t = time.time()
    for start in (0, 600):
        store.record_timeline(Batch(refusals=[Refusal(t + i, f"10.0.0.1:{i}", "", "j9" if i % 2 else "",
                                                      "AUTH_FAILED", "authentication failed: wrong token")
                                              for i in range(start, start + 600)]))
    found = read_refusals(url, tmp_path, limit=5000)
    assert len(found) == REFUSALS_KEPT
    assert found[0] == {"time": t + 1199, "peer": "10.0.0.1:1199", "identity": "", "job_id": "j9",
                        "code": "AUTH_FAILED", "message": "authentication failed: wrong token"}
    assert [r["time"] for r in read_refusals(url, tmp_path, limit=3)] == [t + 1199, t + 1198, t + 1197]


def test_heard_and_home(state: tuple[Store, str], tmp_path: Path) -> None:
    store, url = state
    session = _open(store)
    t = time.time()
    store.record_timeline(Batch(heard=[(t, "j1", session), (t + 1, "j1", session + 1)],
                                home=Home("h:1", str(tmp_path), t - 10, t, 5 << 20, 64 << 20)))
    [job] = read_jobs(url, tmp_path)
    assert job["heard"] == t  # (only the session that holds the job stamps it)
    assert job["home"] is not None and job["home"]["free"] == 5 << 20
    assert read_homes(url, tmp_path) == [{"shadow": "h:1", "root": str(tmp_path), "started": t - 10, "checked": t,
                                          "free": 5 << 20, "min_free": 64 << 20}]
    store.record_timeline(Batch(home=Home("h:1", str(tmp_path), t - 10, t + 1, 100 << 20, 64 << 20)))
    assert read_jobs(url, tmp_path)[0]["home"] is None


# -- why ------------------------------------------------------------------------------------------

NOW = 1_800_000_000.0


def _job(**fields: Any) -> dict[str, Any]:
    job = {"job_id": "j", "state": "streaming", "last_seen": NOW - 1, "heard": None, "exit_code": None,
           "exit_signal": None, "reason": "", "events": [], "home": None}
    return {**job, **fields}


def _event(t: float, kind: str, source: str = "shadow", **details: Any) -> dict[str, Any]:
    return {"time": t, "kind": kind, "source": source, "details": details}


def test_why_streaming_quiet_stalled() -> None:
    assert (status(_job(), NOW), why(_job(), NOW)) == ("streaming", "streaming")
    quiet = _job(last_seen=NOW - 12, heard=NOW - 3)
    assert status(quiet, NOW) == "quiet"
    assert why(quiet, NOW) == "quiet: connected, heartbeats answered, the job writes nothing for 12 s"
    stalled = _job(last_seen=NOW - 40, heard=NOW - 30)
    assert status(stalled, NOW) == "stalled"
    assert why(stalled, NOW) == "stalled: nothing acknowledged for 40 s (nothing heard from the agent for 30 s)"


def test_why_disconnected_refused_short_of_disk_finished() -> None:
    t = time.mktime((2026, 5, 1, 14, 2, 3, 0, 0, -1))
    events = [_event(t - 60, "session_opened", session=1, peer="p", host="h"),
              _event(t - 50, "paused", "agent", reason="disk and network both failed"),
              _event(t + 15, "session_ended", session=1, reason="timed out", code="TIMEOUT", heard=t)]
    gone = _job(state="disconnected", events=events, last_seen=t + 15)
    assert status(gone, t + 100) == "disconnected"
    assert why(gone, t + 100) == ("disconnected since 14:02:03 (timed out); the agent last said: paused "
                                  "(disk and network both failed)")
    refused = {**gone, "events": [*events, _event(t + 20, "refused", code="AUTH_FAILED", peer="p",
                                                  message="authentication failed: wrong token")]}
    assert status(refused, t + 100) == "refused"
    assert why(refused, t + 100) == "refused: authentication failed: wrong token [AUTH_FAILED]"
    short = {**refused, "home": {"free": 10 << 20, "min_free": 64 << 20}}
    assert why(short, t + 100) == "home short of disk: 10.0 MiB free, --min-free 64.0 MiB"
    assert why(_job(state="finished", exit_code=0), NOW) == "finished with status 0"
    assert status(_job(state="finished", exit_code=3), NOW) == "failed"
    assert why(_job(state="finished", exit_signal=15, reason="retry limit reached"), NOW) == \
        "killed by signal 15 (retry limit reached)"


def test_timeline_statements_spell_the_same_for_both() -> None:
    assert timeline.SQLITE.sql("SELECT ? FROM {s}events") == "SELECT ? FROM events"
    assert timeline.POSTGRES.sql("SELECT ? FROM {s}events") == "SELECT %s FROM gcshadow.events"


# -- the shadow's side: queued, batched, bounded, never in the way --------------------------------------------


class _Failing:
    """A state that cannot take a batch now (lost, say): what the event log must survive."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.failing = True

    def record_timeline(self, batch: Batch) -> None:
        if self.failing:
            from gcwrap.shadow.files import StateUnavailable

            raise StateUnavailable("the state database failed: come back shortly", "gone")
        self.batches.append(batch)


async def _worker(fn: Any) -> Any:
    import trio

    return await trio.to_thread.run_sync(fn)


async def test_a_batch_the_state_cannot_take_is_dropped_and_the_next_one_goes(tmp_path: Path) -> None:
    from gcwrap.shadow.admission import ShadowOptions
    from gcwrap.shadow.eventlog import Caller, EventLog

    state = _Failing()
    events = EventLog(ShadowOptions(root=tmp_path), state, {}, _worker)  # type: ignore[arg-type]
    caller = Caller("10.0.0.1:5", "token", job_id="j1")
    events.opened(caller, 3, "node7")
    await events.flush()  # (raises nothing: logged and dropped)
    assert events.dropped["batches"] == 1 and not state.batches
    state.failing = False
    events.ended(caller, "timed out", "TIMEOUT", 12.5)
    await events.flush()
    [batch] = state.batches
    assert [(e.kind, e.details) for e in batch.events] == [
        ("session_ended", {"session": 3, "reason": "timed out", "code": "TIMEOUT", "heard": 12.5})]


async def test_refusals_are_rate_limited_and_notes_bounded_per_session(tmp_path: Path) -> None:
    from gcwrap.shadow import eventlog
    from gcwrap.shadow.admission import ShadowOptions
    from gcwrap.shadow.durability import LiveJob
    from gcwrap.shadow.eventlog import Caller, EventLog
    from gcwrap.wire.events import Note

    state = _Failing()
    state.failing = False
    events = EventLog(ShadowOptions(root=tmp_path), state, {}, _worker)  # type: ignore[arg-type]
    for i in range(10_000):  # a flood, faster than any rate: the burst is taken, the rest counted
        events.refused(Caller(f"10.0.0.1:{i}", ""), "BAD_FRAME", "x" * 5000)
    assert eventlog.REFUSALS_BURST <= len(events.batch.refusals) <= eventlog.REFUSALS_BURST + 5
    assert events.dropped["refusals"] >= 10_000 - eventlog.REFUSALS_BURST - 5
    assert max(len(r.message) for r in events.batch.refusals) == eventlog.MESSAGE_MOST
    assert not events.batch.events  # (no job named: no timeline touched)
    job = LiveJob("j1")
    note = Note(1.0, "stalled", (("seconds", 12.0),))
    for _ in range(eventlog.NOTES_PER_SESSION // 64 + 2):
        events.notes(job, (note,) * 64)
    assert len(events.batch.events) == eventlog.NOTES_PER_SESSION
    await events.flush()  # (what was queued goes in one batch)
    [batch] = state.batches
    assert len(batch.refusals) <= eventlog.REFUSALS_BURST + 5 and len(batch.events) == eventlog.NOTES_PER_SESSION
