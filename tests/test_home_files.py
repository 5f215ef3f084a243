"""The files a job writes, at home: the versions both states keep (the
root's SQLite and PostgreSQL, real: tests/pgserver.py), fenced by the
session as the streams' durable lengths are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gcwrap.shadow.fileversions import VersionRecord, held
from gcwrap.shadow.state import Store
from gcwrap.wire.events import FileHeld, StreamSpec

pytestmark = pytest.mark.timeout(120)

STREAMS = (StreamSpec(1, "stdout", "out.txt"),)
SHA = "ab" * 32


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        s = Store(tmp_path)
    else:
        from gcwrap.shadow.pgstate import PgStore

        s = PgStore(tmp_path, request.getfixturevalue("pg_url"))
    try:
        yield s
    finally:
        s.close()


def _open(store: Store, instance: str = "a1", job: str = "j1") -> int:
    files = store.open_job(job_id=job, instance=instance, streams=STREAMS, host="h", user="u", command=["c"],
                           peer="p")
    files.close()
    return files.session


def _v(session: int, file: int, version: int, durable: int, *, base: int | None = None, committed: int = -1,
       instance: str = "a1", job: str = "j1") -> VersionRecord:
    return VersionRecord(job, session, instance, file, f"f{file}.txt", version, base, durable, committed,
                         SHA if committed >= 0 else None)


def test_durable_lengths_grow_and_commits_stand(store: Store) -> None:
    s = _open(store)
    assert store.read_files("j1", "a1") == []
    assert store.record_files([_v(s, 1, 1, 100), _v(s, 2, 1, 7)]) == set()
    assert store.record_files([_v(s, 1, 1, 40)]) == set()  # (a length recorded late: never shrinks)
    assert held(store.read_files("j1", "a1")) == (FileHeld(1, 1, 100), FileHeld(2, 1, 7))
    store.record_files([_v(s, 1, 1, 100, committed=100)])
    store.record_files([_v(s, 1, 1, 150)])  # (appends after a commit: the commit stands)
    [row, _] = store.read_files("j1", "a1")
    assert (row.name, row.version, row.durable, row.committed, row.sha256) == ("f1.txt", 1, 150, 100, SHA)


def test_a_fenced_session_records_nothing(store: Store) -> None:
    old = _open(store)
    new = _open(store)
    assert new == old + 1
    assert store.record_files([_v(old, 1, 1, 10), _v(new, 2, 1, 5)]) == {("j1", 1, 1)}
    assert held(store.read_files("j1", "a1")) == (FileHeld(2, 1, 5),)


def test_versions_no_longer_needed_are_forgotten(store: Store) -> None:
    s = _open(store)
    store.record_files([_v(s, 1, 1, 10, committed=10)])
    store.record_files([_v(s, 1, 2, 4, base=1)])
    # The committed version is the base of the one in progress: both are kept.
    assert [(r.version, r.committed) for r in store.read_files("j1", "a1")] == [(1, 10), (2, -1)]
    assert held(store.read_files("j1", "a1")) == (FileHeld(1, 2, 4),)
    store.record_files([_v(s, 1, 3, 2, base=1)])  # version 2 abandoned
    assert [r.version for r in store.read_files("j1", "a1")] == [1, 3]
    store.record_files([_v(s, 1, 3, 9, base=1, committed=9)])  # version 1 superseded
    assert [(r.version, r.base, r.committed) for r in store.read_files("j1", "a1")] == [(3, 1, 9)]


def test_a_new_attempt_starts_afresh(store: Store) -> None:
    s = _open(store)
    store.record_files([_v(s, 1, 1, 10, committed=10)])
    s = _open(store, "a2")
    assert store.read_files("j1", "a2") == []
    store.record_files([_v(s, 1, 1, 3, instance="a2")])
    assert store.read_files("j1", "a1") == []
    assert held(store.read_files("j1", "a2")) == (FileHeld(1, 1, 3),)


def test_versions_survive_reopening_the_state(tmp_path: Path) -> None:
    store = Store(tmp_path)
    s = _open(store)
    store.record_files([_v(s, 1, 1, 10, committed=10), _v(s, 1, 2, 4, base=1)])
    store.close()
    store = Store(tmp_path)
    try:
        assert held(store.read_files("j1", "a1")) == (FileHeld(1, 2, 4),)
    finally:
        store.close()
