"""Tests of the agent's SQLite spool: group commit, acknowledgement, reopening,
and a model-based test of random appends and acks on two streams."""

from __future__ import annotations

import itertools
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gcwrap.agent.records import Chunk, JobRecord, StreamState
from gcwrap.agent.spool import (
    MIGRATIONS,
    SPOOL_SUFFIX,
    Spool,
    SpoolError,
    describe_sqlite_error,
    safe_filename,
    spool_files,
)

OUT, ERR = 1, 2
STREAMS = [(OUT, "stdout", "out.log"), (ERR, "stderr", "err.log"), (0, "stdin", "in.txt")]
BIG = 1 << 40


def job(**changes: object) -> JobRecord:
    record = JobRecord(job_id="job 42/\N{GREEK SMALL LETTER ALPHA}", instance="0123456789abcdef",
                       command=["python3", "-c", "print('hi')"])
    for key, value in changes.items():
        setattr(record, key, value)
    return record


@pytest.fixture(params=["memory", "disk"])
def spool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Spool]:
    path = None if request.param == "memory" else tmp_path / "spools" / f"job{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    yield s
    s.close()


def seqs(spool: Spool) -> list[int]:
    return [row[0] for row in spool.db.execute("SELECT seq FROM chunks ORDER BY seq").fetchall()]


def rows(spool: Spool, stream: int) -> list[tuple[int, int]]:
    return [(c.start, c.end) for c in spool.read(stream, 0, BIG)]


def joined(chunks: list[Chunk], offset: int) -> bytes:
    """The bytes from `offset` on, checking the chunks are contiguous and cover it."""
    if not chunks:
        return b""
    assert chunks[0].start <= offset < chunks[0].end
    for a, b in itertools.pairwise(chunks):
        assert b.start == a.end, f"gap or overlap between {a.start}..{a.end} and {b.start}..{b.end}"
    return b"".join(c.data for c in chunks)[offset - chunks[0].start :]


# -- commit, ack, delete ---------------------------------------------------------


def test_new_spool_is_empty(spool: Spool) -> None:
    assert spool.pending_bytes() == 0
    assert list(spool.iter_all()) == []
    assert spool.read(OUT, 0, BIG) == []
    assert spool.streams() == {
        0: StreamState(0, "stdin", "in.txt"),
        OUT: StreamState(OUT, "stdout", "out.log"),
        ERR: StreamState(ERR, "stderr", "err.log"),
    }
    assert spool.job() == job()


def test_ack_deletes_only_chunks_wholly_below_it(spool: Spool) -> None:
    spool.commit([Chunk(OUT, 0, b"a" * 10), Chunk(OUT, 10, b"b" * 10), Chunk(OUT, 20, b"c" * 10)])
    spool.commit([Chunk(ERR, 0, b"E" * 7)])
    assert spool.pending_bytes() == 37
    assert spool.streams()[OUT].appended == 30

    spool.commit(acked={OUT: 10})  # exactly the end of the first chunk
    assert rows(spool, OUT) == [(10, 20), (20, 30)]
    assert spool.pending_bytes() == 27

    spool.commit(acked={OUT: 15})  # inside the second: it stays whole
    assert rows(spool, OUT) == [(10, 20), (20, 30)]
    assert spool.read(OUT, 15, BIG)[0] == Chunk(OUT, 10, b"b" * 10)
    assert joined(spool.read(OUT, 15, BIG), 15) == b"b" * 5 + b"c" * 10
    st_ = spool.streams()[OUT]
    assert (st_.appended, st_.acked, st_.pending) == (30, 15, 15)

    spool.commit(acked={OUT: 30})
    assert rows(spool, OUT) == []
    assert rows(spool, ERR) == [(0, 7)]  # another stream's chunks are untouched
    assert spool.pending_bytes() == 7
    assert spool.streams()[OUT].pending == 0


def test_acks_never_move_backwards(spool: Spool) -> None:
    spool.commit([Chunk(OUT, 0, b"x" * 100)])
    spool.commit(acked={OUT: 60})
    spool.commit(acked={OUT: 20})
    assert spool.streams()[OUT].acked == 60
    assert rows(spool, OUT) == [(0, 100)]


def test_ack_beyond_appended_moves_appended(spool: Spool) -> None:
    """The shadow may hold more than a fresh spool recorded (a resumed run)."""
    spool.commit(acked={ERR: 500})
    assert (spool.streams()[ERR].appended, spool.streams()[ERR].acked) == (500, 500)


def test_group_commit_of_chunks_acks_eof_and_job(spool: Spool) -> None:
    spool.commit(
        [Chunk(OUT, 0, b"hello "), Chunk(OUT, 6, b"world"), Chunk(ERR, 0, b"oops")],
        acked={OUT: 11},  # acked before the spool got them: deleted in the same transaction
        eof=[OUT],
        job={"state": "exited", "exit_code": 3, "summary": {"cpu": 1.5}, "connected": True},
    )
    assert rows(spool, OUT) == []
    assert [(c.stream, c.data) for c in spool.iter_all()] == [(ERR, b"oops")]
    states = spool.streams()
    assert (states[OUT].appended, states[OUT].acked, states[OUT].eof) == (11, 11, True)
    assert (states[ERR].appended, states[ERR].acked, states[ERR].eof) == (4, 0, False)
    record = spool.job()
    assert (record.state, record.exit_code, record.summary, record.connected) == ("exited", 3, {"cpu": 1.5}, True)


def test_a_failed_commit_changes_nothing(spool: Spool) -> None:
    spool.commit([Chunk(OUT, 0, b"kept")])
    before = (spool.streams(), list(spool.iter_all()), spool.job(), seqs(spool))
    with pytest.raises(ValueError, match="unknown job fields"):
        spool.commit([Chunk(OUT, 4, b"lost")], acked={OUT: 4}, eof=[OUT], job={"no_such_field": 1})
    assert (spool.streams(), list(spool.iter_all()), spool.job(), seqs(spool)) == before
    # The same (stream, start) twice is refused as a whole, as a SpoolError
    # (on disk before a byte is written: there a byte's place is its offset).
    with pytest.raises(SpoolError, match=r"UNIQUE|already spooled"):
        spool.commit([Chunk(OUT, 4, b"new"), Chunk(ERR, 0, b"e"), Chunk(OUT, 0, b"dup")])
    assert (spool.streams(), list(spool.iter_all()), spool.job(), seqs(spool)) == before
    assert not spool.db.conn.in_transaction
    spool.commit([Chunk(OUT, 4, b"next")])  # and the spool still works
    assert joined(spool.read(OUT, 0, BIG), 0) == b"keptnext"


def test_empty_chunks_take_no_row(spool: Spool) -> None:
    """An empty chunk holds no bytes; stored, it would take (stream, start)
    from the chunk that really holds the bytes there."""
    spool.commit([Chunk(OUT, 0, b"")])
    spool.commit([Chunk(OUT, 0, b"abc")])
    assert rows(spool, OUT) == [(0, 3)]
    assert spool.streams()[OUT].appended == 3


def test_read_returns_about_max_bytes_and_at_least_one_chunk(spool: Spool) -> None:
    spool.commit([Chunk(OUT, i * 10, bytes([65 + i]) * 10) for i in range(10)])
    assert len(spool.read(OUT, 0, 0)) == 1
    assert len(spool.read(OUT, 0, 1)) == 1
    assert len(spool.read(OUT, 0, 10)) == 1
    assert len(spool.read(OUT, 0, 11)) == 2
    assert len(spool.read(OUT, 35, 11)) == 2  # counts whole chunks, from the one holding 35
    assert spool.read(OUT, 35, 11)[0].start == 30
    assert spool.read(OUT, 100, BIG) == []
    assert spool.read(ERR, 0, BIG) == []
    assert joined(spool.read(OUT, 0, BIG), 0) == b"".join(bytes([65 + i]) * 10 for i in range(10))


def test_seq_keys_are_never_reused(spool: Spool) -> None:
    spool.commit([Chunk(OUT, 0, b"a" * 10), Chunk(ERR, 0, b"b" * 10)])
    spool.commit([Chunk(OUT, 10, b"c" * 10)])
    first = seqs(spool)
    assert first == sorted(first) and len(set(first)) == 3
    spool.commit(acked={OUT: 20, ERR: 10})
    assert seqs(spool) == [] and spool.pending_bytes() == 0  # the table is empty
    spool.commit([Chunk(OUT, 20, b"d")])
    assert seqs(spool)[0] > max(first)
    if spool.path is not None:
        spool.close()
        spool.db = Spool.open(spool.path).db  # the fixture closes whatever db the spool holds
        high = max(first + seqs(spool))
        spool.commit(acked={OUT: 21})
        spool.commit([Chunk(OUT, 21, b"e")])
        assert seqs(spool)[0] > high


def test_iter_all_is_in_commit_order(spool: Spool) -> None:
    spool.commit([Chunk(ERR, 0, b"1"), Chunk(OUT, 0, b"2")])
    spool.commit([Chunk(ERR, 1, b"3")])
    spool.commit([Chunk(OUT, 1, b"4")])
    assert [c.data for c in spool.iter_all()] == [b"1", b"2", b"3", b"4"]


def test_job_record_round_trips() -> None:
    record = job(
        host="node17",
        user="alice",
        shadow="home:50000",
        started=1700000000.25,
        wrapper_pid=4242,
        child_pid=4243,
        state="running",
        summary={"cpu_s": 1.5, "rss": "12 MiB", "nested": [1, 2]},
    )
    s = Spool.create(None, record, [])
    assert s.job() == record
    s.commit(job={"ended": 1700000100.5, "exit_code": None, "exit_signal": 9, "reason": "killed", "retries": 3,
                  "delivered": True, "last_error": "connection refused", "command": ["x", "y"]})
    got = s.job()
    assert (got.ended, got.exit_code, got.exit_signal, got.reason, got.retries, got.delivered) == (
        1700000100.5, None, 9, "killed", 3, True)
    assert got.command == ["x", "y"] and got.last_error == "connection refused"
    assert got.summary == record.summary
    s.close()


# -- on disk ------------------------------------------------------------------------


def test_reopen_keeps_job_streams_and_pending_chunks(tmp_path: Path) -> None:
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    record = job(host="h", started=12.5, wrapper_pid=10, summary={"k": "v"})
    s = Spool.create(path, record, STREAMS)
    s.commit([Chunk(OUT, 0, b"0123456789"), Chunk(OUT, 10, b"abcdefghij"), Chunk(ERR, 0, b"err!")])
    s.commit(acked={OUT: 15}, eof=[ERR], job={"state": "exited", "exit_code": 0})
    before = (s.streams(), list(s.iter_all()), s.job(), seqs(s), s.pending_bytes())
    s.close()

    for readonly in (True, False):
        r = Spool.open(path, readonly=readonly)
        assert (r.streams(), list(r.iter_all()), r.job(), seqs(r), r.pending_bytes()) == before
        assert r.streams()[OUT] == StreamState(OUT, "stdout", "out.log", appended=20, acked=15)
        assert r.streams()[ERR].eof is True
        assert joined(r.read(OUT, 15, BIG), 15) == b"fghij"
        assert r.job().state == "exited" and r.job().host == "h"
        r.close()
    # Migrations are applied once, not again on every open.
    r = Spool.open(path)
    assert r.db.execute("SELECT id FROM _migrations ORDER BY id").fetchall() == [(n,) for n, _, _ in MIGRATIONS]
    r.close()


def test_readonly_spool_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    Spool.create(path, job(), STREAMS).close()
    r = Spool.open(path, readonly=True)
    with pytest.raises(SpoolError, match="not writable"):
        r.commit([Chunk(OUT, 0, b"x")])
    assert r.pending_bytes() == 0 and not r.db.conn.in_transaction
    r.close()


@pytest.mark.parametrize("dirname", ["C#", "100%", "what?", "two words", "%41", "ü"])
def test_paths_with_uri_characters(tmp_path: Path, dirname: str) -> None:
    """Spool.open goes through a SQLite URI: "#", "?" and "%" in the path must
    not cut it short (which opened, and created, a different database)."""
    path = tmp_path / dirname / f"j{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    s.commit([Chunk(OUT, 0, b"data")])
    s.close()
    for readonly in (False, True):
        r = Spool.open(path, readonly=readonly)
        assert r.job() == job()
        assert joined(r.read(OUT, 0, BIG), 0) == b"data"
        r.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [dirname]  # no stray database beside it


def test_open_refuses_what_is_not_a_spool(tmp_path: Path) -> None:
    with pytest.raises(SpoolError, match="no spool"):
        Spool.open(tmp_path / "missing.spool")
    garbage = tmp_path / "garbage.spool"
    garbage.write_bytes(b"this is not a database " * 100)
    with pytest.raises(SpoolError, match="not a gcwrap spool"):
        Spool.open(garbage)
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    Spool.create(path, job(), STREAMS).close()
    with pytest.raises(SpoolError, match="already exists"):
        Spool.create(path, job(), STREAMS)


def test_remove_deletes_every_file(tmp_path: Path) -> None:
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    s.commit([Chunk(OUT, 0, os.urandom(200_000))])
    assert s.file_size() >= 200_000
    assert spool_files(tmp_path) == [path]
    s.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert os.path.getsize(f"{path}-wal") == 0
    s.remove()
    assert list(tmp_path.iterdir()) == []
    assert spool_files(tmp_path) == [] and spool_files(tmp_path / "nowhere") == []


def test_safe_filename() -> None:
    assert safe_filename("job 42/\N{GREEK SMALL LETTER ALPHA}") == "job_42__"
    assert safe_filename("") == "job"
    assert safe_filename("a" * 200) == "a" * 96
    assert safe_filename("ok-1.2_3") == "ok-1.2_3"


# -- the model: random appends and acks on two streams ---------------------------


class SpoolModel(RuleBasedStateMachine):
    """Random group commits of appends, acks and EOFs on two streams, checked
    against a bytearray per stream and the list of chunks the spool must keep."""

    on_disk = False

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="gcwrap-spool-test-") if self.on_disk else None
        self.path = Path(self.dir, f"j{SPOOL_SUFFIX}") if self.dir else None
        self.spool = Spool.create(self.path, job(), STREAMS)
        self.data = {OUT: bytearray(), ERR: bytearray()}
        self.acked = {OUT: 0, ERR: 0}
        self.eof: set[int] = set()
        self.kept: dict[int, list[tuple[int, int]]] = {OUT: [], ERR: []}  # (start, end) of live chunks
        self.max_seq = 0
        self.alive: set[int] = set()

    def teardown(self) -> None:
        self.spool.close()
        if self.dir:
            shutil.rmtree(self.dir)

    def _chunk(self, stream: int, size: int, fill: int) -> Chunk:
        start = len(self.data[stream])
        payload = bytes((fill + i) % 251 for i in range(size))
        self.data[stream] += payload
        self.kept[stream].append((start, start + size))
        return Chunk(stream, start, payload)

    def _ack(self, stream: int, offset: int) -> None:
        self.acked[stream] = max(self.acked[stream], offset)
        self.kept[stream] = [(s, e) for s, e in self.kept[stream] if e > self.acked[stream]]

    @rule(
        appends=st.lists(st.tuples(st.sampled_from([OUT, ERR]), st.integers(1, 3000)), min_size=1, max_size=4),
        fill=st.integers(0, 250),
    )
    def append(self, appends: list[tuple[int, int]], fill: int) -> None:
        chunks = [self._chunk(stream, size, fill) for stream, size in appends]
        before = len(seqs(self.spool))
        self.spool.commit(chunks)
        assert len(seqs(self.spool)) == before + len(chunks)

    @rule(stream=st.sampled_from([OUT, ERR]), fraction=st.floats(0, 1))
    def ack(self, stream: int, fraction: float) -> None:
        low, high = self.acked[stream], len(self.data[stream])
        offset = low + int((high - low) * fraction)
        self.spool.commit(acked={stream: offset})
        self._ack(stream, offset)

    @rule(stream=st.sampled_from([OUT, ERR]))
    def ack_everything(self, stream: int) -> None:
        self.spool.commit(acked={stream: len(self.data[stream])})
        self._ack(stream, len(self.data[stream]))

    @rule(stream=st.sampled_from([OUT, ERR]), back=st.integers(1, 100))
    def stale_ack(self, stream: int, back: int) -> None:
        self.spool.commit(acked={stream: max(0, self.acked[stream] - back)})

    @rule(
        stream=st.sampled_from([OUT, ERR]),
        size=st.integers(1, 2000),
        fraction=st.floats(0, 1),
        end=st.booleans(),
    )
    def append_and_ack_together(self, stream: int, size: int, fraction: float, end: bool) -> None:
        chunk = self._chunk(stream, size, size)
        offset = self.acked[stream] + int((len(self.data[stream]) - self.acked[stream]) * fraction)
        self.spool.commit([chunk], acked={stream: offset}, eof=[stream] if end else ())
        self._ack(stream, offset)
        if end:
            self.eof.add(stream)

    @precondition(lambda self: self.on_disk)
    @rule(readonly=st.booleans())
    def reopen(self, readonly: bool) -> None:
        self.spool.close()
        assert self.path is not None
        if readonly:
            # A second reader (the status command) sees the same state...
            reader = Spool.open(self.path, readonly=True)
            self.spool = reader
            self.check_model()
            reader.close()
        self.spool = Spool.open(self.path)

    @invariant()
    def check_model(self) -> None:
        spool = self.spool
        states = spool.streams()
        for stream in (OUT, ERR):
            data, acked = self.data[stream], self.acked[stream]
            state = states[stream]
            assert (state.appended, state.acked, state.eof) == (len(data), acked, stream in self.eof)
            chunks = spool.read(stream, acked, BIG)
            assert [(c.start, c.end) for c in chunks] == self.kept[stream]
            assert joined(chunks, acked) == bytes(data[acked:])
            for c in chunks:
                assert c.data == bytes(data[c.start : c.end])
            # Reading from inside or at the end of a chunk starts at the right one.
            for c in chunks[:2] + chunks[-1:]:
                for offset in {max(acked, c.start), c.end - 1, c.end}:
                    assert joined(spool.read(stream, offset, BIG), offset) == bytes(data[offset:])
            # A small read is a prefix of the full one.
            few = spool.read(stream, acked, 1000)
            assert few == chunks[: len(few)]
            if chunks:
                assert sum(len(c.data) for c in few[:-1]) < 1000 <= sum(len(c.data) for c in few) or few == chunks
        assert spool.pending_bytes() == sum(e - s for kept in self.kept.values() for s, e in kept)
        # Seq keys only grow: a row that appeared since the last check has a
        # seq above every seq ever seen, even of rows deleted since.
        alive = set(seqs(spool))
        assert all(q > self.max_seq for q in alive - self.alive), (sorted(alive - self.alive), self.max_seq)
        self.alive = alive
        self.max_seq = max([self.max_seq, *alive])


class SpoolModelOnDisk(SpoolModel):
    on_disk = True


def test_spool_model_in_memory() -> None:
    run_state_machine_as_test(
        SpoolModel,
        settings=settings(max_examples=80, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )


def test_spool_model_on_disk() -> None:
    run_state_machine_as_test(
        SpoolModelOnDisk,
        settings=settings(max_examples=40, stateful_step_count=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow]),
    )


# -- disk full ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "message, expected",
    [
        ("database or disk is full", "disk full (database or disk is full)"),
        ("attempt to write a readonly database", "not writable (attempt to write a readonly database)"),
        ("disk I/O error", "I/O error (disk I/O error)"),
        ("database is locked", "database is locked"),
    ],
)
@pytest.mark.parametrize("path", [None, Path("/var/tmp/j.spool")])
def test_describe_sqlite_error(message: str, expected: str, path: Path | None) -> None:
    text = describe_sqlite_error(sqlite3.OperationalError(message), path)
    where = f"spool {path}" if path else "spool"
    assert text == f"{where}: {expected}"


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, only as root; always unmounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill up needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                          check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.root
def test_disk_full_raises_spool_error_and_recovers(small_tmpfs: Path) -> None:
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (2 << 20))
    path = small_tmpfs / f"j{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    written = bytearray()
    error = None
    for _ in range(100):
        data = os.urandom(100_000)
        try:
            s.commit([Chunk(OUT, len(written), data)])
        except SpoolError as e:
            error = e
            break
        written += data
    assert error is not None, "a 4 MiB tmpfs took 10 MB"
    assert "disk full" in str(error) and str(path) in str(error)
    # The reason is kept: the segment file's write or SQLite's, whichever hit the full disk first
    # (with 4 KiB database pages, the 100 kB of bytes in the segment file do).
    assert isinstance(error.__cause__, (sqlite3.Error, OSError))
    # The failed commit left nothing behind, and what was committed is intact.
    assert not s.db.conn.in_transaction
    assert s.streams()[OUT].appended == len(written)
    assert joined(s.read(OUT, 0, BIG), 0) == bytes(written)
    # Space comes back: the same commit now succeeds.
    filler.unlink()
    data = os.urandom(100_000)
    s.commit([Chunk(OUT, len(written), data)])
    written += data
    s.commit(acked={OUT: 50_000})
    assert joined(s.read(OUT, 50_000, BIG), 50_000) == bytes(written[50_000:])
    s.close()
    r = Spool.open(path)
    assert r.streams()[OUT].appended == len(written)
    assert joined(r.read(OUT, 50_000, BIG), 50_000) == bytes(written[50_000:])
    r.close()


# -- a spool that cannot be made, or read: a SpoolError that says why, never a traceback ---------


async def try_spool(path: Path) -> str:
    """Try to make a spool as a run does; "" if made, else the SpoolError's text."""
    from gcwrap.agent.spooler import Spooler

    spooler = Spooler(path, job(), [(OUT, "stdout", "out.log")])
    try:
        await spooler.ensure()
    except SpoolError as e:
        spooler.close()
        return str(e)
    spooler.close(remove=True)
    return ""


def make_spool(path: Path) -> str:
    import trio

    return trio.run(try_spool, path)


@pytest.mark.root
def test_a_spool_directory_that_exists_but_refuses_writes(small_tmpfs: Path) -> None:
    """EROFS (read-only mount), EPERM (immutable directory, where the file
    system has the attribute), and a spool "directory" that is a file: each
    a SpoolError naming the cause (was: sqlite3.OperationalError, "unable
    to open database file", for a directory that exists)."""
    spools = small_tmpfs / "spools"
    spools.mkdir()
    (small_tmpfs / "file").write_text("")
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True, timeout=30)
    try:
        assert make_spool(spools / f"j{SPOOL_SUFFIX}") == (
            f"spool {spools / f'j{SPOOL_SUFFIX}'}: not writable (Read-only file system)"
        )
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True, timeout=30)
    assert make_spool(small_tmpfs / "file" / f"j{SPOOL_SUFFIX}").endswith(
        f"{small_tmpfs / 'file'} exists and is not a directory")
    immutable = Path(tempfile.mkdtemp(prefix="gcwrap-immutable-", dir="/var/tmp"))
    try:
        if subprocess.run(["chattr", "+i", str(immutable)], capture_output=True, timeout=30).returncode != 0:
            pytest.skip("no immutable attribute here (chattr +i)")
        try:
            assert make_spool(immutable / f"j{SPOOL_SUFFIX}") == (
                f"spool {immutable / f'j{SPOOL_SUFFIX}'}: not writable (Operation not permitted)")
        finally:
            subprocess.run(["chattr", "-i", str(immutable)], check=True, timeout=30)
        assert list(immutable.iterdir()) == []
    finally:
        shutil.rmtree(immutable, ignore_errors=True)


@pytest.mark.root
@pytest.mark.timeout(120)
def test_a_disk_that_fills_while_the_spool_is_made(small_tmpfs: Path) -> None:
    """Free space from 0 to 128 KiB, 4 KiB apart: the spool's database, its
    WAL and shared-memory files, or the live file and the ballast, hit the
    full disk in turn. Each time the spool is made whole, or not at all with
    a SpoolError that says the disk is full."""
    filler = small_tmpfs / "filler"
    outcomes = set()
    for leave in range(0, 132 << 10, 4 << 10):
        filler.unlink(missing_ok=True)
        st = os.statvfs(small_tmpfs)
        with open(filler, "wb", buffering=0) as f:
            try:
                f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
            except OSError:
                pass
        path = small_tmpfs / f"j{SPOOL_SUFFIX}"
        error = make_spool(path)
        assert error == "" or "disk full" in error, (leave, error)
        outcomes.add("made" if not error else "refused")
        assert not path.exists() and not Path(f"{path}.new").exists(), "whole or nothing, and a made one removed"
        for stray in small_tmpfs.iterdir():
            assert stray.name in ("filler", f"j{SPOOL_SUFFIX}.live"), stray
    assert outcomes == {"made", "refused"}


def test_out_of_descriptors_while_the_spool_is_made(tmp_path: Path) -> None:
    """Every limit on descriptors from what is open now to 16 more: the
    spool is made, or a SpoolError says to raise `ulimit -n`; no descriptor
    is left open by a failed attempt."""
    script = f"""
import os, resource, sys
from pathlib import Path
import trio
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_spool import try_spool

async def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    await trio.to_thread.run_sync(lambda: None)  # (the worker thread exists before the limits)
    base = max(int(n) for n in os.listdir("/proc/self/fd")) + 1
    seen = set()
    for extra in range(17):
        resource.setrlimit(resource.RLIMIT_NOFILE, (base + extra, hard))
        try:
            error = await try_spool(Path({str(tmp_path)!r}) / f"j{{extra}}.spool")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert error == "" or "out of file descriptors (raise `ulimit -n`)" in error, (extra, error)
        left = [os.readlink(f"/proc/self/fd/{{n}}") for n in os.listdir("/proc/self/fd") if int(n) >= base]
        assert not left, (extra, error, left)
        seen.add(bool(error))
    assert seen == {{True, False}}, seen
    print("ok")

trio.run(main)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("damage", ["garbage", "zeros"])
def test_a_damaged_spool_is_a_spool_error_wherever_it_is_read(tmp_path: Path, damage: str) -> None:
    """Each page of a spool damaged in turn: opening it, or reading its job,
    streams, chunks or ages, raises SpoolError, never sqlite3's errors."""
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    s.commit([Chunk(OUT, 0, b"x" * 1000), Chunk(ERR, 0, b"y" * 10)])
    s.commit(acked={OUT: 10}, job={"state": "exited", "exit_code": 0})
    s.db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    s.close()
    whole = path.read_bytes()
    pages = len(whole) // 4096
    assert pages >= 5
    failed = 0
    for page in range(1, pages):
        data = bytearray(whole)
        for i in range(page * 4096 + 8, (page + 1) * 4096):
            data[i] = (i * 7919) % 256 if damage == "garbage" else 0
        path.write_bytes(bytes(data))
        for readonly in (True, False):
            try:
                r = Spool.open(path, readonly=readonly)
            except SpoolError:
                failed += 1
                continue
            try:
                r.job(), r.streams(), r.read(OUT, 0, BIG), r.oldest_pending(), r.pending_bytes()
            except SpoolError as e:
                failed += 1
                assert str(path) in str(e)
            finally:
                r.close()
    assert failed, "some damage must show"


def as_nobody(fn: Callable[[], str]) -> str:
    """fn() in a forked child that runs as nobody; its result, or its error.
    (Forked, not run: the interpreter may lie where nobody cannot reach it.)"""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            text = fn()
        except BaseException as e:  # noqa: BLE001 - any failure is the answer
            text = f"{type(e).__name__}: {e}"
        os.write(w, text.encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return data.decode()


@pytest.mark.root
def test_a_spool_its_user_cannot_read() -> None:
    """A spool file another user owns (0600), in a directory anyone may
    read: opening it, and `gcwrap status` over its directory, say it cannot
    be read and why (was: "unable to open database file")."""
    from gcwrap.status import read_spools

    spools = Path(tempfile.mkdtemp(prefix="gcwrap-spools-", dir="/var/tmp"))  # (its parents: world-searchable)
    try:
        os.chmod(spools, 0o755)
        path = spools / f"j{SPOOL_SUFFIX}"
        Spool.create(path, job(), STREAMS).close()
        os.chmod(path, 0o600)
        want = f"spool {path}: cannot be read (Permission denied)"

        def open_it() -> str:
            try:
                Spool.open(path, readonly=True)
            except SpoolError as e:
                return str(e)
            return "opened"

        assert as_nobody(lambda: str(sorted(p.name for p in spools.iterdir()))) == str([path.name])
        assert as_nobody(open_it) == want
        assert as_nobody(lambda: repr([(s["state"], s["last_error"]) for s in read_spools(spools)])) == repr(
            [("unreadable", want)])
    finally:
        shutil.rmtree(spools, ignore_errors=True)
