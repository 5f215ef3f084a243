"""The files a job writes, at home: the versions both states keep (the
root's SQLite and PostgreSQL, real: tests/pgserver.py), fenced by the
session as the streams' durable lengths are.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ShadowProc
from pgserver import PgServer
from rawagent import RawAgent
from statefaults import PgRelay

from gcwrap.shadow.filestore import OPEN_PER_SESSION
from gcwrap.shadow.fileversions import VersionRecord, held
from gcwrap.shadow.state import Store
from gcwrap.wire.auth import agent_mac, new_nonce
from gcwrap.wire.events import (
    FILES_FEATURE,
    Auth,
    Challenge,
    ConnectionClosed,
    Data,
    Done,
    Error,
    ErrorCode,
    Exit,
    FileAck,
    FileCommit,
    FileCopy,
    FileData,
    FileHeld,
    FileOpen,
    Hello,
    StreamSpec,
    Welcome,
)
from gcwrap.wire.names import STATE_DIR

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


# -- a real gcshadow, spoken to by a scripted agent over a real socket ----------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def either(request: pytest.FixtureRequest, home: Path, tmp_path: Path) -> Iterator[ShadowProc]:
    """A gcshadow with each kind of state."""
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    state = ["--state", request.getfixturevalue("pg_url")] if request.param == "postgresql" else []
    sh = ShadowProc(home, logs, extra=state)
    sh.start()
    try:
        yield sh
    finally:
        sh.stop()


def _agent(shadow: ShadowProc, job: str = "fj", instance: str = "i1",
           streams: tuple[StreamSpec, ...] | None = None) -> tuple[RawAgent, Welcome]:
    a = RawAgent(shadow.port)
    streams = (StreamSpec(1, "stdout", f"{job}.out"),) if streams is None else streams
    a.send(Hello(job_id=job, instance=instance, streams=streams, host="test", features=(FILES_FEATURE,)))
    w = a.next()
    assert isinstance(w, Welcome), w
    assert FILES_FEATURE in w.features
    return a, w


def _file_ack(a: RawAgent, file: int, version: int, offset: int, committed: bool = False) -> FileAck:
    """Read until the FILE_ACK that covers `offset` (an ERROR fails the test)."""
    while True:
        ev = a.until(FileAck)
        assert isinstance(ev, FileAck), ev
        if (ev.file, ev.version) == (file, version) and ev.offset >= offset and ev.committed == committed:
            return ev


def _error(a: RawAgent) -> ErrorCode:
    ev = a.until(Error)
    assert isinstance(ev, Error), ev
    return ev.code


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _commit(a: RawAgent, file: int, version: int, content: bytes) -> None:
    """FILE_COMMIT of a version whose whole content is `content`, and home's committed FILE_ACK."""
    a.send(FileCommit(file, version, len(content), _sha(content)))
    _file_ack(a, file, version, len(content), committed=True)


def _land(a: RawAgent, file: int, name: str, version: int, data: bytes) -> None:
    """A first version written whole and committed: FILE_OPEN, FILE_DATA, FILE_COMMIT, and its ACK."""
    a.send(FileOpen(file, name, version))
    a.send(FileData(file, version, 0, data))
    _commit(a, file, version, data)


def _staging(home: Path) -> list[str]:
    return sorted(p.name for p in home.rglob(".*gcwrap-*"))


@pytest.mark.timeout(60)
def test_a_file_appended_in_place_lands_in_name_and_is_acknowledged(shadow: ShadowProc, home: Path) -> None:
    a, _ = _agent(shadow)
    a.send(FileOpen(1, "res/log.txt", 1))
    a.send(FileData(1, 1, 0, b"first "))
    assert _file_ack(a, 1, 1, 6) == FileAck(1, 1, 6)
    assert (home / "res/log.txt").read_bytes() == b"first "  # live, before any commit
    a.send(FileData(1, 1, 3, b"st line"))  # (a resend overlapping what home holds)
    assert _file_ack(a, 1, 1, 10).offset == 10
    a.send(FileCommit(1, 1, 10, _sha(b"first line")))
    assert _file_ack(a, 1, 1, 10, committed=True) == FileAck(1, 1, 10, True)
    assert (home / "res/log.txt").read_bytes() == b"first line"
    a.send(FileData(1, 1, 10, b", second"))  # appended after a commit: committed again at a checkpoint
    a.send(FileCommit(1, 1, 18, _sha(b"first line, second")))
    assert _file_ack(a, 1, 1, 18, committed=True) == FileAck(1, 1, 18, True)
    a.send(FileData(1, 1, 20, b"gap"))
    assert _error(a) is ErrorCode.OFFSET_GAP


@pytest.mark.timeout(60)
def test_a_rewrite_is_a_new_version_built_from_the_committed_one(either: ShadowProc, home: Path) -> None:
    shadow = either
    old = bytes(range(256)) * 1024  # 256 KiB
    new = old[:65536] + b"X" * 65536 + old[131072:] + b"tail"
    a, _ = _agent(shadow)
    _land(a, 1, "data.bin", 1, old)
    a.send(FileOpen(1, "data.bin", 2, base=1))
    a.send(FileCopy(1, 2, 0, 0, 65536))
    a.send(FileData(1, 2, 65536, b"X" * 65536))
    a.send(FileCopy(1, 2, 131072, 131072, len(old) - 131072))
    a.send(FileData(1, 2, len(old), b"tail"))
    _file_ack(a, 1, 2, len(new))
    assert (home / "data.bin").read_bytes() == old  # staged: NAME holds version 1 until the commit
    assert _staging(home) == [".data.bin.gcwrap-1-2"]
    a.send(FileCommit(1, 2, len(new), _sha(new)))
    assert _file_ack(a, 1, 2, len(new), committed=True) == FileAck(1, 2, len(new), True)
    assert _sha((home / "data.bin").read_bytes()) == _sha(new)
    assert _staging(home) == []


@pytest.mark.timeout(60)
def test_a_commit_with_a_wrong_digest_is_refused(shadow: ShadowProc, home: Path) -> None:
    a, _ = _agent(shadow)
    a.send(FileOpen(1, "f.txt", 1))
    a.send(FileData(1, 1, 0, b"content"))
    a.send(FileCommit(1, 1, 7, _sha(b"CONTENT")))
    assert _error(a) is ErrorCode.LENGTH_MISMATCH
    b, w = _agent(shadow)
    assert w.files == (FileHeld(1, 1, 7, -1),)  # not committed
    b.send(FileCommit(1, 1, 8, _sha(b"content")))  # (and a size home does not hold)
    assert _error(b) is ErrorCode.LENGTH_MISMATCH


@pytest.mark.timeout(60)
def test_a_reconnection_mid_version_resumes_from_welcome(shadow: ShadowProc, home: Path) -> None:
    a, w = _agent(shadow)
    assert w.files == ()
    _land(a, 1, "v.txt", 1, b"one")
    a.send(FileOpen(1, "v.txt", 2, base=1))
    a.send(FileData(1, 2, 0, b"two, and "))
    _file_ack(a, 1, 2, 9)
    a.close()
    b, w = _agent(shadow)
    assert w.files == (FileHeld(1, 2, 9, -1),)
    b.send(FileOpen(1, "v.txt", 2, base=1))  # (the version in progress, opened again: legal)
    b.send(FileData(1, 2, 9, b"more"))
    _commit(b, 1, 2, b"two, and more")
    assert (home / "v.txt").read_bytes() == b"two, and more"
    b.send(FileOpen(1, "other.txt", 3, base=2))  # another NAME for the handle
    assert _error(b) is ErrorCode.UNEXPECTED
    c, w = _agent(shadow)
    c.send(FileOpen(1, "v.txt", 3, base=1))  # a base home no longer holds committed
    assert _error(c) is ErrorCode.UNEXPECTED


@pytest.mark.timeout(60)
def test_exit_lists_the_files_each_committed_at_its_size(shadow: ShadowProc, home: Path) -> None:
    a, _ = _agent(shadow)
    _land(a, 1, "a.txt", 1, b"aaaa")
    a.send(FileOpen(2, "b.txt", 1))
    a.send(FileData(2, 1, 0, b"bb"))
    _file_ack(a, 2, 1, 2)
    a.send(Exit(0, None, ((1, 0),), files=((1, 1, 4), (2, 1, 2))))
    assert _error(a) is ErrorCode.LENGTH_MISMATCH  # b.txt is not committed
    b, w = _agent(shadow)
    assert w.files == (FileHeld(1, 1, 4, 4), FileHeld(2, 1, 2, -1))
    _commit(b, 2, 1, b"bb")
    b.send(Exit(0, None, ((1, 0),), files=((1, 1, 4), (2, 1, 2))))
    assert isinstance(b.until(Done), Done)


@pytest.mark.parametrize("name", ["../escape.txt", "/etc/passwd", "a/../../b", "fj.out"])
@pytest.mark.timeout(60)
def test_a_name_escaping_the_root_is_refused_as_a_streams_would_be(shadow: ShadowProc, home: Path,
                                                                   tmp_path: Path, name: str) -> None:
    a, _ = _agent(shadow)
    a.send(FileOpen(1, name, 1))
    assert _error(a) is ErrorCode.PATH_FORBIDDEN
    assert not (tmp_path / "escape.txt").exists()
    assert (home / "fj.out").read_bytes() == b""


@pytest.mark.timeout(90)
def test_kill_9_mid_version_loses_nothing_acknowledged(either: ShadowProc, home: Path) -> None:
    shadow = either
    a, _ = _agent(shadow)
    _land(a, 1, "k.txt", 1, b"committed")
    a.send(FileOpen(1, "k.txt", 2, base=1))
    a.send(FileData(1, 2, 0, b"acknowledged"))
    _file_ack(a, 1, 2, 12)
    a.send(FileOpen(1, "k.txt", 3, base=1))  # version 2 abandoned
    a.send(FileData(1, 3, 0, b"version three"))
    _file_ack(a, 1, 3, 13)
    shadow.kill9()
    a.close()
    with open(home / ".k.txt.gcwrap-1-3", "ab") as f:
        f.write(b" never acknowledged")  # a torn tail
    (home / ".k.txt.gcwrap-1-2").write_bytes(b"abandoned")  # (as if its removal had not happened)
    shadow.start()
    b, w = _agent(shadow)
    assert w.files == (FileHeld(1, 3, 13, -1),)
    assert (home / "k.txt").read_bytes() == b"committed"
    assert _staging(home) == [".k.txt.gcwrap-1-3"]
    assert (home / ".k.txt.gcwrap-1-3").read_bytes() == b"version three"
    b.send(FileOpen(1, "k.txt", 3, base=1))
    b.send(FileCopy(1, 3, 13, 0, 9))
    _commit(b, 1, 3, b"version threecommitted")
    assert (home / "k.txt").read_bytes() == b"version threecommitted"
    assert _staging(home) == []


@pytest.mark.timeout(60)
def test_the_quota_counts_the_files_bytes_with_the_streams(home: Path, tmp_path: Path) -> None:
    sh = ShadowProc(home, tmp_path, extra=["--quota", "100"])
    sh.start()
    try:
        a, _ = _agent(sh)
        a.send(Data(1, 0, b"s" * 60))
        a.send(FileOpen(1, "q.txt", 1))
        a.send(FileData(1, 1, 0, b"f" * 40))
        _file_ack(a, 1, 1, 40)  # 100 bytes: within the quota
        a.send(FileData(1, 1, 40, b"!"))
        assert _error(a) is ErrorCode.QUOTA
        b, w = _agent(sh)
        assert w.files == (FileHeld(1, 1, 40, -1),)
        b.send(Data(1, 60, b"?"))  # (a stream's byte counts the files' too)
        assert _error(b) is ErrorCode.QUOTA
    finally:
        sh.stop()


@pytest.mark.timeout(60)
def test_a_fenced_session_writes_and_acknowledges_no_more_of_a_file(shadow: ShadowProc, home: Path) -> None:
    a, _ = _agent(shadow)
    a.send(FileOpen(1, "fenced.txt", 1))
    a.send(FileData(1, 1, 0, b"mine"))
    _file_ack(a, 1, 1, 4)
    b, w = _agent(shadow)  # a newer connection of the job takes it over
    assert w.files == (FileHeld(1, 1, 4, -1),)
    try:
        a.send(FileData(1, 1, 4, b" and late"))
        ev = a.until(FileAck)
        assert isinstance(ev, (Error, ConnectionClosed)), ev
    except OSError:
        pass  # (the shadow closed it first)
    b.send(FileOpen(1, "fenced.txt", 1))
    b.send(FileData(1, 1, 4, b", then b"))
    _file_ack(b, 1, 1, 12)
    assert (home / "fenced.txt").read_bytes() == b"mine, then b"


@pytest.mark.timeout(60)
def test_a_commit_recorded_but_not_renamed_is_completed_at_the_next_session(shadow: ShadowProc,
                                                                            home: Path) -> None:
    a, _ = _agent(shadow)
    _land(a, 1, "r.txt", 1, b"old")
    a.send(FileOpen(1, "r.txt", 2, base=1))
    a.send(FileData(1, 2, 0, b"new content"))
    _file_ack(a, 1, 2, 11)
    shadow.kill9()
    a.close()
    # As if the shadow had died between the commit's record and its rename.
    with sqlite3.connect(home / STATE_DIR / "state.db") as db:
        db.execute("UPDATE file_versions SET committed = 11, sha256 = ? WHERE version = 2", [_sha(b"new content")])
    shadow.start()
    _, w = _agent(shadow)
    assert w.files == (FileHeld(1, 2, 11, 11),)
    assert (home / "r.txt").read_bytes() == b"new content"
    assert _staging(home) == []


@pytest.mark.timeout(60)
def test_a_name_home_would_take_for_a_staging_file_is_refused(shadow: ShadowProc, home: Path) -> None:
    a, _ = _agent(shadow)
    a.send(FileOpen(1, "x.txt", 1))
    a.send(FileOpen(2, "d/.x.txt.gcwrap-1-7", 1))
    assert _error(a) is ErrorCode.PATH_FORBIDDEN


@pytest.mark.timeout(60)
def test_a_staged_version_never_committed_goes_when_the_job_ends(shadow: ShadowProc, home: Path) -> None:
    a, _ = _agent(shadow)
    _land(a, 1, "s.txt", 1, b"kept")
    _land(a, 2, "t.txt", 1, b"t")
    a.send(FileOpen(2, "t.txt", 2, base=1))
    a.send(FileData(2, 2, 0, b"half"))
    _file_ack(a, 2, 2, 4)
    assert _staging(home) == [".t.txt.gcwrap-2-2"]
    a.send(Exit(0, None, ((1, 0),), files=((1, 1, 4),)))
    assert isinstance(a.until(Done), Done)
    assert _staging(home) == []
    assert (home / "s.txt").read_bytes() == b"kept"
    assert (home / "t.txt").read_bytes() == b"t"


@pytest.mark.timeout(60)
def test_a_name_another_active_job_writes_is_refused_both_ways(shadow: ShadowProc, home: Path) -> None:
    a, _ = _agent(shadow, "ja")
    a.send(FileOpen(1, "shared.txt", 1))
    a.send(FileData(1, 1, 0, b"a's"))
    _file_ack(a, 1, 1, 3)
    b, _ = _agent(shadow, "jb")
    b.send(FileOpen(1, "shared.txt", 1))  # a file of another job
    assert _error(b) is ErrorCode.PATH_OWNED
    c, _ = _agent(shadow, "jc")
    c.send(FileOpen(1, "ja.out", 1))  # another job's stream
    assert _error(c) is ErrorCode.PATH_OWNED
    d = RawAgent(shadow.port)
    d.send(Hello(job_id="jd", instance="i1", streams=(StreamSpec(1, "stdout", "shared.txt"),), host="test"))
    assert _error(d) is ErrorCode.PATH_OWNED  # a stream named as another job's file
    assert (home / "shared.txt").read_bytes() == b"a's"


@pytest.mark.timeout(90)
def test_a_state_lost_acknowledges_nothing_and_the_next_session_resumes(home: Path, tmp_path: Path,
                                                                         postgres: PgServer, pg_url: str) -> None:
    with PgRelay(("127.0.0.1", postgres.port)) as relay:
        sh = ShadowProc(home, tmp_path, extra=["--state", relay.url(pg_url)])
        sh.start()
        try:
            a, _ = _agent(sh)
            a.send(FileOpen(1, "lost.txt", 1))
            a.send(FileData(1, 1, 0, b"kept"))
            _file_ack(a, 1, 1, 4)
            relay.down()
            a.send(FileData(1, 1, 4, b", lost"))
            ev = a.until(FileAck)
            assert isinstance(ev, Error) and ev.code is ErrorCode.BUSY, ev  # (never a FILE_ACK for them)
            relay.up()
            for _ in range(100):  # (told BUSY while the state comes back)
                b = RawAgent(sh.port)
                b.send(Hello(job_id="fj", instance="i1", streams=(StreamSpec(1, "stdout", "fj.out"),), host="test",
                             features=(FILES_FEATURE,)))
                w = b.next()
                if isinstance(w, Welcome):
                    break
                assert isinstance(w, Error) and w.code is ErrorCode.BUSY, w
                time.sleep(0.2)
            assert isinstance(w, Welcome), w
            assert w.files == (FileHeld(1, 1, 4, -1),)
            assert (home / "lost.txt").read_bytes() == b"kept"
            b.send(FileData(1, 1, 4, b", again"))
            _commit(b, 1, 1, b"kept, again")
            assert (home / "lost.txt").read_bytes() == b"kept, again"
        finally:
            sh.stop()


@pytest.mark.timeout(60)
def test_a_file_replaced_at_home_while_in_use_is_refused(shadow: ShadowProc, home: Path) -> None:
    a, _ = _agent(shadow)
    a.send(FileOpen(1, "rep.txt", 1))
    a.send(FileData(1, 1, 0, b"home's"))
    _file_ack(a, 1, 1, 6)
    a.close()
    b, w = _agent(shadow)
    assert w.files == (FileHeld(1, 1, 6, -1),)
    (home / "other.txt").write_bytes(b"home's")
    (home / "other.txt").replace(home / "rep.txt")  # another file, the same bytes
    b.send(FileData(1, 1, 6, b" more"))
    assert _error(b) is ErrorCode.LENGTH_MISMATCH
    assert (home / "rep.txt").read_bytes() == b"home's"


@pytest.mark.timeout(90)
def test_a_file_another_shadows_session_has_open_is_not_touched(home: Path, tmp_path: Path, pg_url: str) -> None:
    (tmp_path / "l1").mkdir()
    (tmp_path / "l2").mkdir()
    first = ShadowProc(home, tmp_path / "l1", extra=["--state", pg_url])
    second = ShadowProc(home, tmp_path / "l2", extra=["--state", pg_url])
    first.start()
    second.start()
    try:
        a, _ = _agent(first, streams=())
        a.send(FileOpen(1, "shared.bin", 1))
        a.send(FileData(1, 1, 0, b"acknowledged"))
        _file_ack(a, 1, 1, 12)
        with open(home / "shared.bin", "ab") as f:
            f.write(b" and more")  # (as if written, not yet acknowledged)
        assert first.proc is not None
        os.kill(first.proc.pid, signal.SIGSTOP)  # frozen with the file open
        try:
            b = RawAgent(second.port)
            b.send(Hello(job_id="fj", instance="i1", streams=(), host="test",
                         features=(FILES_FEATURE,)))
            ev = b.next()
            assert isinstance(ev, Error) and ev.code is ErrorCode.BUSY, ev
            assert (home / "shared.bin").read_bytes() == b"acknowledged and more"  # not cut back under it
        finally:
            os.kill(first.proc.pid, signal.SIGCONT)
        for _ in range(100):  # the frozen one learns it was taken over, and lets go
            c = RawAgent(second.port)
            c.send(Hello(job_id="fj", instance="i1", streams=(), host="test",
                         features=(FILES_FEATURE,)))
            w = c.next()
            if isinstance(w, Welcome):
                break
            assert isinstance(w, Error) and w.code is ErrorCode.BUSY, w
            time.sleep(0.2)
        assert isinstance(w, Welcome), w
        assert w.files == (FileHeld(1, 1, 12, -1),)
        assert (home / "shared.bin").read_bytes() == b"acknowledged"
    finally:
        first.stop()
        second.stop()


@pytest.mark.timeout(60)
def test_a_job_writing_many_files_holds_few_descriptors(shadow: ShadowProc, home: Path) -> None:
    assert shadow.proc is not None
    a, _ = _agent(shadow)
    before = len(os.listdir(f"/proc/{shadow.proc.pid}/fd"))
    for f in range(1, 41):
        a.send(FileOpen(f, f"many/{f}.txt", 1))
        a.send(FileData(f, 1, 0, b"x" * f))
        _file_ack(a, f, 1, f)
    held_open = len(os.listdir(f"/proc/{shadow.proc.pid}/fd")) - before
    assert held_open <= OPEN_PER_SESSION + 1, held_open
    for f in range(1, 41):  # (each opened again to be written to)
        a.send(FileData(f, 1, f, b"y"))
        _commit(a, f, 1, b"x" * f + b"y")
    assert (home / "many/40.txt").read_bytes() == b"x" * 40 + b"y"


@pytest.mark.timeout(60)
def test_an_identitys_files_land_in_its_part_of_the_root(home: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.mkdir(mode=0o700)
    (tokens / "alice").write_text(os.urandom(32).hex() + "\n")
    (tokens / "alice").chmod(0o600)
    token = (tokens / "alice").read_text().strip().encode()
    sh = ShadowProc(home, tmp_path, extra=["--token-dir", str(tokens)])
    sh.start()
    try:
        a = RawAgent(sh.port)
        nonce = new_nonce()
        a.send(Hello(job_id="tj", instance="i1", streams=(StreamSpec(1, "stdout", "tj.out"),), host="test",
                     features=(FILES_FEATURE,), nonce=nonce))
        challenge = a.next()
        assert isinstance(challenge, Challenge), challenge
        a.send(Auth(agent_mac(token, nonce, challenge.nonce, "tj", "i1")))
        assert isinstance(a.next(), Welcome)
        _land(a, 1, "res/r.txt", 1, b"alice's")
        assert (home / "alice" / "res" / "r.txt").read_bytes() == b"alice's"
        assert not (home / "res").exists()
    finally:
        sh.stop()
