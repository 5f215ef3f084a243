"""Tests of the spool's record of the job's files (gcwrap.agent.spoolfiles):
a file's versions from the first to the committed, what is kept and what is
deleted, the refusals, reopening, and a model of random histories."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from gcwrap.agent.filedelta import Scan, digests_of
from gcwrap.agent.filespecs import FileSpec
from gcwrap.agent.records import JobRecord
from gcwrap.agent.spool import MIGRATIONS, SPOOL_SUFFIX, Spool, SpoolError
from gcwrap.agent.spoolfiles import FILE_MIGRATIONS, FileRecord, SpoolFiles, VersionRecord

pytestmark = pytest.mark.timeout(120)

STREAMS = [(1, "stdout", "out.log"), (2, "stderr", "err.log")]
LOG = FileRecord(1, "train.log", "train.log", "train.log")
CSV = FileRecord(2, "out/a.csv", "out/a.csv", "out/*.csv")


def job() -> JobRecord:
    return JobRecord(job_id="files", instance="0123456789abcdef", command=["true"])


def scan_of(content: bytes) -> Scan:
    return Scan(hashlib.sha256(content).hexdigest(), digests_of(content))


@pytest.fixture(params=["memory", "disk"])
def spool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Spool]:
    path = None if request.param == "memory" else tmp_path / f"j{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    yield s
    s.close()


def test_a_new_spool_records_no_file(spool: Spool) -> None:
    files = SpoolFiles(spool)
    assert files.files() == {} and files.versions() == []


def test_the_tables_are_made_at_the_first_file(tmp_path: Path) -> None:
    """A spool without files takes no page for them (it must fit where little
    is left); the first file recorded makes them, once."""
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    try:
        def tables() -> set[str]:
            return {r[0] for r in s.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        pages = s.db.execute("PRAGMA page_count").fetchone()[0]
        assert SpoolFiles(s).files() == {} and SpoolFiles(s).versions() == [] and SpoolFiles(s).newest(1) is None
        assert not {"files", "file_versions"} & tables()
        assert s.db.execute("PRAGMA page_count").fetchone()[0] == pages
        SpoolFiles(s).add_file(LOG)
        SpoolFiles(s).add_file(CSV)
        assert {"files", "file_versions"} <= tables()
        migrations = [r[0] for r in s.db.execute("SELECT id FROM _migrations ORDER BY id")]
        assert migrations == [n for n, _, _ in MIGRATIONS] + [n for n, _, _ in FILE_MIGRATIONS]
    finally:
        s.close()
    r = Spool.open(path)  # the spool's own migrations leave them alone
    try:
        assert SpoolFiles(r).files() == {1: LOG, 2: CSV}
    finally:
        r.close()


def test_a_files_versions_from_the_first_to_committed(spool: Spool) -> None:
    files = SpoolFiles(spool)
    files.add_file(LOG)
    assert files.new_version(1, 1, dev=5, ino=10, base=None) == VersionRecord(1, 1, None)
    assert files.files()[1] == dataclasses.replace(LOG, dev=5, ino=10)
    files.progress(1, 1, sent=100)
    files.progress(1, 1, acked=60)
    files.progress(1, 1, acked=40)  # an older acknowledgement changes nothing
    files.progress(1, 1, sent=50)  # a resend goes back, never below what is acknowledged
    assert (files.newest(1).sent, files.newest(1).acked) == (60, 60)  # type: ignore[union-attr]
    content = b"step\n" * 30
    files.scanned(1, 1, scan_of(content))
    assert files.committed(1) is None
    files.commit_acked(1, 1, len(content))
    v1 = files.committed(1)
    assert v1 is not None and (v1.committed, v1.acked, v1.sent, v1.sha256) == (
        150, 150, 150, hashlib.sha256(content).hexdigest())
    assert v1.digests() == digests_of(content)
    with pytest.raises(ValueError):
        files.scanned(1, 1, scan_of(content))  # committed: its content is settled


def test_a_commit_deletes_the_versions_before_it_and_a_new_version_abandons(spool: Spool) -> None:
    files = SpoolFiles(spool)
    files.add_file(LOG)
    files.add_file(CSV)
    files.new_version(2, 1, 5, 20, None)
    files.scanned(2, 1, scan_of(b"a"))
    files.commit_acked(2, 1, 1)
    files.new_version(2, 2, 5, 21, base=1)
    files.new_version(2, 3, 5, 22, base=1)  # supersedes version 2 (never committed): abandoned
    assert [v.version for v in files.versions(2)] == [1, 3]
    files.scanned(2, 3, scan_of(b"abc"))
    # Its FILE_COMMIT sent, the job rewrites again: version 4 is built from 3,
    # which home holds committed by the time it reads version 4's FILE_OPEN.
    files.new_version(2, 4, 5, 23, base=3)
    assert [(v.version, v.base) for v in files.versions(2)] == [(1, None), (3, 1), (4, 3)]
    files.commit_acked(2, 3, 3)
    assert [v.version for v in files.versions(2)] == [3, 4]
    assert files.committed(2).version == 3  # type: ignore[union-attr]
    assert files.versions(1) == []  # the other file is untouched
    assert [v.version for v in files.versions()] == [3, 4]


def test_a_version_committed_then_appended_to_is_scanned_at_each_commit(spool: Spool) -> None:
    """A log committed, appended to, committed again: the spool keeps the newest commit's scan (a resume
    builds the next version on it, not on the first commit's), and its acknowledgement."""
    files = SpoolFiles(spool)
    files.add_file(LOG)
    files.new_version(1, 1, 5, 10, None)
    first, grown = b"line\n" * 10, b"line\n" * 30_000
    files.scanned(1, 1, scan_of(first))
    files.commit_acked(1, 1, len(first))
    files.scanned(1, 1, scan_of(grown))
    assert files.newest(1).digests() == digests_of(grown)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="scanned at"):
        files.commit_acked(1, 1, len(first))  # (the first commit's acknowledgement, late: not the scan's)
    files.commit_acked(1, 1, len(grown))
    assert files.committed(1).committed == len(grown)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="committed already"):
        files.scanned(1, 1, scan_of(first))  # (what it committed is settled: never shorter)


def test_versions_whose_commit_went_are_kept_until_one_is_acknowledged(spool: Spool) -> None:
    """Home acknowledged version 4's commit, but the acknowledgement was lost (the connection broke,
    gcwrap was killed) while versions 5 and 6 followed: the spool keeps version 4's scan, for a resume
    told by home that it holds version 4 committed (or a version 5 built on it) builds on it."""
    files = SpoolFiles(spool)
    files.add_file(LOG)
    files.new_version(1, 3, 5, 10, None)
    files.scanned(1, 3, scan_of(b"three"))
    files.commit_acked(1, 3, 5)
    files.new_version(1, 4, 5, 11, base=3)
    files.scanned(1, 4, scan_of(b"four"))  # (its FILE_COMMIT went)
    files.new_version(1, 5, 5, 12, base=4)
    files.scanned(1, 5, scan_of(b"five!"))
    files.new_version(1, 6, 5, 13, base=5)
    files.new_version(1, 7, 5, 14, base=5)  # (6 never scanned: abandoned)
    assert [(v.version, v.base) for v in files.versions(1)] == [(3, None), (4, 3), (5, 4), (7, 5)]
    assert files.versions(1)[1].digests() == digests_of(b"four")
    files.commit_acked(1, 5, 5)
    assert [v.version for v in files.versions(1)] == [5, 7]


def test_refusals(spool: Spool) -> None:
    files = SpoolFiles(spool)
    files.add_file(LOG)
    with pytest.raises(ValueError, match="already"):
        files.add_file(LOG)
    with pytest.raises(ValueError, match="already"):
        files.add_file(dataclasses.replace(LOG, handle=9))  # another handle for the same path
    with pytest.raises(ValueError, match="no file"):
        files.new_version(7, 1, 0, 0, None)
    files.new_version(1, 2, 0, 0, None)
    with pytest.raises(ValueError, match="after version 2"):
        files.new_version(1, 2, 0, 0, None)
    with pytest.raises(ValueError, match="not scanned"):
        files.new_version(1, 3, 0, 0, base=2)
    with pytest.raises(ValueError, match="no version"):
        files.progress(1, 1, acked=1)
    files.scanned(1, 2, scan_of(b"12345"))
    with pytest.raises(ValueError, match="scanned at 5"):
        files.commit_acked(1, 2, 4)


def test_records_survive_reopening(tmp_path: Path) -> None:
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    files = SpoolFiles(s)
    files.add_file(LOG)
    files.new_version(1, 1, 5, 10, None)
    files.scanned(1, 1, scan_of(b"x" * 70_000))
    files.progress(1, 1, sent=70_000, acked=65_536)
    before = (files.files(), files.versions())
    s.close()
    for readonly in (True, False):
        r = Spool.open(path, readonly=readonly)
        assert (SpoolFiles(r).files(), SpoolFiles(r).versions()) == before
        r.close()


def test_the_specs_and_the_working_directory_for_a_resume(tmp_path: Path) -> None:
    """`gcwrap resume` needs the --file specs (NAMEs as expanded) and the job's working directory: a
    spool keeps them, across reopening, a path that is not UTF-8 too; one that recorded none has none."""
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    s = Spool.create(path, job(), STREAMS)
    assert SpoolFiles(s).specs() is None
    workdir = Path(os.fsdecode(b"/scratch/run-\xff/w"))
    specs = (FileSpec("train.log"), FileSpec("status.json", "state/j42.json"), FileSpec("out/*.csv"))
    SpoolFiles(s).record_specs(workdir, specs)
    SpoolFiles(s).record_specs(workdir, specs)  # (again: the same, once)
    assert SpoolFiles(s).specs() == (workdir, specs)
    assert SpoolFiles(s).files() == {}  # (no file matched yet)
    s.close()
    r = Spool.open(path, readonly=True)
    try:
        assert SpoolFiles(r).specs() == (workdir, specs)
    finally:
        r.close()


def test_a_write_refused_is_a_spool_error(tmp_path: Path) -> None:
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    Spool.create(path, job(), STREAMS).close()
    r = Spool.open(path, readonly=True)
    try:
        with pytest.raises(SpoolError):
            SpoolFiles(r).add_file(LOG)
    finally:
        r.close()


# -- the model: random histories of two files' versions -------------------------------


class FilesModel(RuleBasedStateMachine):
    """New versions (abandoning), progress, scans and acknowledged commits of
    two files, checked against the versions a model keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="gcwrap-spoolfiles-test-")
        self.path = Path(self.dir, f"j{SPOOL_SUFFIX}")
        self.spool = Spool.create(self.path, job(), STREAMS)
        self.files = SpoolFiles(self.spool)
        for record in (LOG, CSV):
            self.files.add_file(record)
        self.kept: dict[tuple[int, int], VersionRecord] = {}
        self.next = {1: 1, 2: 1}

    def teardown(self) -> None:
        self.spool.close()
        shutil.rmtree(self.dir)

    def _of(self, file: int) -> list[VersionRecord]:
        return [v for k, v in sorted(self.kept.items()) if k[0] == file]

    @rule(file=st.sampled_from([1, 2]), skip=st.integers(0, 2), choice=st.integers(0, 10))
    def new_version(self, file: int, skip: int, choice: int) -> None:
        bases = [v.version for v in self._of(file) if v.size is not None]
        base = None if not bases or choice == 0 else bases[choice % len(bases)]
        version = self.next[file] + skip
        self.files.new_version(file, version, 1, version, base)
        self.kept = {k: v for k, v in self.kept.items()
                     if k[0] != file or v.committed is not None or v.size is not None or k[1] == base}
        self.kept[file, version] = VersionRecord(file, version, base)
        self.next[file] = version + 1

    @precondition(lambda self: self.kept)
    @rule(pick=st.integers(0, 100), sent=st.integers(0, 1000), acked=st.integers(0, 1000))
    def progress(self, pick: int, sent: int, acked: int) -> None:
        key = sorted(self.kept)[pick % len(self.kept)]
        self.files.progress(*key, sent=sent, acked=acked)
        old = self.kept[key]
        new_acked = max(old.acked, acked)
        self.kept[key] = dataclasses.replace(old, acked=new_acked, sent=max(new_acked, sent))

    @precondition(lambda self: any(v.committed is None for v in self.kept.values()))
    @rule(pick=st.integers(0, 100), content=st.binary(max_size=300))
    def scan(self, pick: int, content: bytes) -> None:
        open_ = sorted(k for k, v in self.kept.items() if v.committed is None)
        key = open_[pick % len(open_)]
        scan = scan_of(content)
        self.files.scanned(*key, scan)
        self.kept[key] = dataclasses.replace(self.kept[key], size=len(content), sha256=scan.sha256,
                                             blocks=scan.digests.blob())

    @precondition(lambda self: any(v.size is not None and v.committed is None for v in self.kept.values()))
    @rule(pick=st.integers(0, 100))
    def commit_acked(self, pick: int) -> None:
        ready = sorted(k for k, v in self.kept.items() if v.size is not None and v.committed is None)
        file, version = ready[pick % len(ready)]
        size = self.kept[file, version].size
        assert size is not None
        self.files.commit_acked(file, version, size)
        old = self.kept[file, version]
        self.kept[file, version] = dataclasses.replace(old, committed=size, acked=size, sent=max(old.sent, size))
        self.kept = {k: v for k, v in self.kept.items() if k[0] != file or k[1] >= version}

    @rule()
    def reopen(self) -> None:
        self.spool.close()
        self.spool = Spool.open(self.path)
        self.files = SpoolFiles(self.spool)

    @invariant()
    def same_as_the_model(self) -> None:
        assert self.files.versions() == [v for _, v in sorted(self.kept.items())]
        for file in (1, 2):
            committed = [v for v in self._of(file) if v.committed is not None]
            assert len(committed) <= 1  # a commit deletes the versions before it
            assert self.files.committed(file) == (committed[-1] if committed else None)


def test_random_histories_of_file_versions() -> None:
    run_state_machine_as_test(FilesModel, settings=settings(
        max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)))
