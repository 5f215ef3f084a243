"""Tests of which of the job's files come home and when they changed
(gcwrap.agent.filespecs, gcwrap.agent.filewatch): real files in a temporary
directory, changed as jobs change them, with inotify waking the watcher (and
a poll too slow to be what saw the change) and with the poll alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from gcwrap.agent.filespecs import FileSpec, FileSpecError, FileStat, matches, parse_file_spec
from gcwrap.agent.filewatch import Change, FileEvent, FileWatcher, change

pytestmark = pytest.mark.timeout(60)

WAIT = 10.0  # seconds an expected report may take, at most (it takes milliseconds)


# -- specs ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "spec"), [
    ("train.log", FileSpec("train.log")),
    ("./out//status.json", FileSpec("out/status.json")),
    ("out/*.csv", FileSpec("out/*.csv")),
    ("result.bin=results/{job}.bin", FileSpec("result.bin", "results/{job}.bin")),
    ("a=b=c", FileSpec("a", "b=c")),
])
def test_file_specs_parse(text: str, spec: FileSpec) -> None:
    assert parse_file_spec(text) == spec


@pytest.mark.parametrize(("text", "why"), [
    ("/etc/passwd", "relative"),
    ("../x", "leave"),
    ("out/../../x", "leave"),
    ("", "empty"),
    ("=name", "empty"),
    ("x=", "empty"),
    ("out/", "directory"),
    (".", "directory"),
    ("out/*.csv=all.csv", "glob"),
])
def test_file_specs_refused(text: str, why: str) -> None:
    with pytest.raises(FileSpecError, match=why):
        parse_file_spec(text)


def test_fixed_dir_is_where_new_matches_appear() -> None:
    assert FileSpec("x.log").fixed_dir == ""
    assert FileSpec("out/*.csv").fixed_dir == "out"
    assert FileSpec("a/b/*/c/*.csv").fixed_dir == "a/b"


def test_matches_are_regular_files_each_once(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.csv").write_text("a")
    (tmp_path / "out" / "dir.csv").mkdir()
    (tmp_path / "b.csv").write_text("b")
    specs = (FileSpec("out/a.csv", "first"), FileSpec("out/*.csv"), FileSpec("*.csv"), FileSpec("missing"))
    found = matches(tmp_path, specs)
    assert sorted(found) == ["b.csv", "out/a.csv"]
    assert found["out/a.csv"][0].name == "first"


# -- what a stat pass calls a change ------------------------------------------------


def fst(ino: int = 1, size: int = 10, mtime: int = 100, dev: int = 1) -> FileStat:
    return FileStat(dev, ino, size, mtime)


@pytest.mark.parametrize(("old", "new", "what"), [
    (None, None, None),
    (None, fst(), Change.APPEARED),
    (fst(), None, Change.DELETED),
    (fst(), fst(), None),
    (fst(), fst(size=11, mtime=101), Change.GREW),
    (fst(), fst(ino=2), Change.REPLACED),
    (fst(), fst(dev=2), Change.REPLACED),
    (fst(), fst(ino=2, size=5), Change.REPLACED),
    (fst(), fst(size=5), Change.REWRITTEN),
    (fst(), fst(mtime=101), Change.REWRITTEN),
])
def test_change(old: FileStat | None, new: FileStat | None, what: Change | None) -> None:
    assert change(old, new) is what


# -- the watcher, on real files -----------------------------------------------------


@dataclass
class Watch:
    watcher: FileWatcher
    events: trio.MemoryReceiveChannel[FileEvent]
    seen: list[FileEvent]

    async def expect(self, path: str, what: Change) -> FileEvent:
        """The first report of `what` for `path` (others are kept in `seen`)."""
        with trio.fail_after(WAIT):
            async for event in self.events:
                self.seen.append(event)
                if event.path == path and event.change is what:
                    return event
        raise AssertionError("the watcher stopped")

    def changes(self, path: str) -> list[Change]:
        return [e.change for e in self.seen if e.path == path]


@pytest.fixture(params=["inotify", "poll"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def watch(mode: str, tmp_path: Path, *specs: str) -> FileWatcher:
    parsed = tuple(parse_file_spec(s) for s in specs)
    if mode == "inotify":
        # A poll an hour apart: what the test sees, inotify woke.
        return FileWatcher(tmp_path, parsed, interval=3600, settle=0.001)
    return FileWatcher(tmp_path, parsed, interval=0.005, settle=0.001, inotify=False)


async def started(nursery: trio.Nursery, watcher: FileWatcher) -> Watch:
    send, receive = trio.open_memory_channel[FileEvent](100)
    await nursery.start(watcher.run, send)
    if watcher.use_inotify:
        assert watcher.inotify is not None, "this kernel has inotify: the test means to use it"
    return Watch(watcher, receive, [])


async def test_a_log_appended_grows(mode: str, tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("step 0\n")
    async with trio.open_nursery() as nursery:
        w = await started(nursery, watch(mode, tmp_path, "train.log"))
        first = await w.expect("train.log", Change.APPEARED)
        assert first.stat is not None and first.stat.size == 7
        for step in range(1, 4):
            with log.open("a") as f:
                f.write(f"step {step}\n")
            event = await w.expect("train.log", Change.GREW)
            assert event.stat is not None and event.stat.size == 7 * (step + 1)
        nursery.cancel_scope.cancel()
    assert set(w.changes("train.log")) == {Change.APPEARED, Change.GREW}


async def test_a_json_rewritten_by_rename_is_replaced(mode: str, tmp_path: Path) -> None:
    status = tmp_path / "status.json"
    status.write_text('{"step": 0}')
    async with trio.open_nursery() as nursery:
        w = await started(nursery, watch(mode, tmp_path, "status.json"))
        last = await w.expect("status.json", Change.APPEARED)
        for step in range(1, 3):
            draft = tmp_path / ".status.json.tmp"
            draft.write_text(f'{{"step": {step}}}')
            os.rename(draft, status)
            event = await w.expect("status.json", Change.REPLACED)
            assert event.stat is not None and last.stat is not None
            assert event.stat.ino == os.stat(status).st_ino != last.stat.ino
            last = event
        nursery.cancel_scope.cancel()
    assert not [e for e in w.seen if e.path != "status.json"]  # the temporary file is not named


async def test_a_file_truncated_and_rewritten_is_rewritten(mode: str, tmp_path: Path) -> None:
    table = tmp_path / "table.txt"
    table.write_bytes(b"x" * 100)
    async with trio.open_nursery() as nursery:
        w = await started(nursery, watch(mode, tmp_path, "table.txt"))
        first = await w.expect("table.txt", Change.APPEARED)
        with table.open("wb") as f:  # truncates, then writes less
            f.write(b"y" * 10)
        event = await w.expect("table.txt", Change.REWRITTEN)
        assert event.stat is not None and first.stat is not None and event.stat.ino == first.stat.ino
        nursery.cancel_scope.cancel()
    assert Change.REPLACED not in w.changes("table.txt")


async def test_a_file_written_in_place_is_rewritten(mode: str, tmp_path: Path) -> None:
    blob = tmp_path / "model.bin"
    blob.write_bytes(bytes(4096))
    os.utime(blob, ns=(0, 0))  # an old mtime: the write below changes it, whatever the clock's granularity
    async with trio.open_nursery() as nursery:
        w = await started(nursery, watch(mode, tmp_path, "model.bin"))
        await w.expect("model.bin", Change.APPEARED)
        fd = os.open(blob, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff" * 16, 1000)
        finally:
            os.close(fd)
        event = await w.expect("model.bin", Change.REWRITTEN)
        assert event.stat is not None and event.stat.size == 4096
        nursery.cancel_scope.cancel()


async def test_a_file_deleted(mode: str, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch.dat"
    scratch.write_text("gone soon")
    async with trio.open_nursery() as nursery:
        w = await started(nursery, watch(mode, tmp_path, "scratch.dat"))
        await w.expect("scratch.dat", Change.APPEARED)
        scratch.unlink()
        event = await w.expect("scratch.dat", Change.DELETED)
        assert event.stat is None
        scratch.write_text("back")
        await w.expect("scratch.dat", Change.APPEARED)
        nursery.cancel_scope.cancel()


async def test_files_created_late_match_a_glob(mode: str, tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        w = await started(nursery, watch(mode, tmp_path, "out/*.csv", "*.log"))
        assert w.watcher.files == {}
        (tmp_path / "run.log").write_text("x")
        await w.expect("run.log", Change.APPEARED)
        # The directory too appears late: watched through its parent until it does.
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "a.csv").write_text("1,2\n")
        event = await w.expect("out/a.csv", Change.APPEARED)
        assert event.spec == FileSpec("out/*.csv")
        (tmp_path / "out" / "b.csv").write_text("3,4\n")
        (tmp_path / "out" / "c.txt").write_text("not named")
        await w.expect("out/b.csv", Change.APPEARED)
        with (tmp_path / "out" / "a.csv").open("a") as f:
            f.write("5,6\n")
        await w.expect("out/a.csv", Change.GREW)
        nursery.cancel_scope.cancel()
    assert "out/c.txt" not in {e.path for e in w.seen}


async def test_the_first_pass_reports_what_is_there_before_started(mode: str, tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text("a")
    (tmp_path / "b.log").write_text("b")
    send, receive = trio.open_memory_channel[FileEvent](10)
    watcher = watch(mode, tmp_path, "*.log")
    async with trio.open_nursery() as nursery:
        await nursery.start(watcher.run, send)
        assert sorted((e.path, e.change) for e in [receive.receive_nowait(), receive.receive_nowait()]) == [
            ("a.log", Change.APPEARED), ("b.log", Change.APPEARED)]
        fd = watcher.inotify.fd if watcher.inotify else None
        nursery.cancel_scope.cancel()
    assert watcher.inotify is None
    if fd is not None:  # the descriptor is closed when the watcher stops
        with pytest.raises(OSError):
            os.fstat(fd)


def test_check_is_a_stat_pass_on_demand(tmp_path: Path) -> None:
    """The final pass at the job's end: synchronous, no event loop."""
    watcher = FileWatcher(tmp_path, (FileSpec("x"),), inotify=False)
    assert watcher.check() == []
    (tmp_path / "x").write_text("1")
    assert [e.change for e in watcher.check()] == [Change.APPEARED]
    assert watcher.check() == []
    (tmp_path / "x").unlink()
    assert [(e.change, e.stat) for e in watcher.check()] == [(Change.DELETED, None)]


def test_without_inotify_the_poll_alone_reports(tmp_path: Path) -> None:
    """No descriptor left for inotify (a real limit, RLIMIT_NOFILE, in a
    process of its own): the watcher falls back to the poll and still
    reports (stat, truncate and unlink need no descriptor)."""
    (tmp_path / "x.log").write_text("0123456789")
    script = f"""
import os, resource, sys
from pathlib import Path
import trio
from gcwrap.agent.filespecs import FileSpec
from gcwrap.agent.filewatch import Change, FileWatcher

async def main():
    path = Path({str(tmp_path)!r})
    watcher = FileWatcher(path, (FileSpec("x.log"),), interval=0.005, settle=0.001)
    send, receive = trio.open_memory_channel(100)
    lowest = os.dup(0)  # the lowest descriptor free: every new one would be at least this
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    seen = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(watcher.run, send)
            assert watcher.inotify is None, "inotify opened a descriptor beyond the limit"
            for act, what in ((None, Change.APPEARED), (lambda: os.truncate(path / "x.log", 3), Change.REWRITTEN),
                              (lambda: os.unlink(path / "x.log"), Change.DELETED)):
                if act:
                    act()
                while (event := await receive.receive()).change is not what:
                    pass
                seen.append(event.change.value)
            nursery.cancel_scope.cancel()
    print(" ".join(seen))

trio.run(main)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["appeared", "rewritten", "deleted"]


def test_a_glob_skips_the_drafts_a_job_renames_over(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text("{}")
    (tmp_path / ".status.json.tmp").write_text("{")
    (tmp_path / "deep" / "er").mkdir(parents=True)
    (tmp_path / "deep" / "er" / "x.json").write_text("{}")
    assert sorted(matches(tmp_path, (FileSpec("*.json"),))) == ["status.json"]
    assert sorted(matches(tmp_path, (FileSpec("**/*.json"),))) == ["deep/er/x.json", "status.json"]


# -- the model: one change between two passes is reported as what it is ---------------


class WatchModel(RuleBasedStateMachine):
    """Random changes to two files (one named, one matched by a glob), a stat
    pass after each: the pass reports exactly the change made, nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="gcwrap-watch-test-"))
        (self.dir / "out").mkdir()
        self.watcher = FileWatcher(self.dir, (FileSpec("f.bin"), FileSpec("out/*.csv")), inotify=False)
        self.size = {"f.bin": -1, "out/a.csv": -1}  # -1: absent
        self.clock = 10**18  # each change gets an mtime of its own, whatever the clock's granularity

    def teardown(self) -> None:
        shutil.rmtree(self.dir)

    def _stamp(self, rel: str) -> None:
        self.clock += 1
        os.utime(self.dir / rel, ns=(self.clock, self.clock))

    def _expect(self, rel: str, what: Change) -> None:
        events = self.watcher.check()
        assert [(e.path, e.change) for e in events] == [(rel, what)]
        stat = os.stat(self.dir / rel) if what is not Change.DELETED else None
        assert events[0].stat == (stat and FileStat.of(stat))

    files = st.sampled_from(["f.bin", "out/a.csv"])

    @rule(rel=files, data=st.binary(max_size=50))
    def create(self, rel: str, data: bytes) -> None:
        if self.size[rel] >= 0:
            return
        (self.dir / rel).write_bytes(data)
        self.size[rel] = len(data)
        self._expect(rel, Change.APPEARED)

    @rule(rel=files, data=st.binary(min_size=1, max_size=50))
    def append(self, rel: str, data: bytes) -> None:
        if self.size[rel] < 0:
            return
        with (self.dir / rel).open("ab") as f:
            f.write(data)
        self._stamp(rel)
        self.size[rel] += len(data)
        self._expect(rel, Change.GREW)

    @rule(rel=files, data=st.binary(max_size=50))
    def rename_over(self, rel: str, data: bytes) -> None:
        if self.size[rel] < 0:
            return
        draft = self.dir / (rel + ".tmp")
        draft.write_bytes(data)
        os.rename(draft, self.dir / rel)
        self.size[rel] = len(data)
        self._expect(rel, Change.REPLACED)

    @rule(rel=files, keep=st.integers(0, 49))
    def truncate(self, rel: str, keep: int) -> None:
        if self.size[rel] <= 0:
            return
        keep %= self.size[rel]
        os.truncate(self.dir / rel, keep)
        self.size[rel] = keep
        self._expect(rel, Change.REWRITTEN)

    @rule(rel=files, at=st.integers(0, 49), data=st.binary(min_size=1, max_size=8))
    def pwrite_in_place(self, rel: str, at: int, data: bytes) -> None:
        if self.size[rel] < len(data):
            return
        fd = os.open(self.dir / rel, os.O_WRONLY)
        try:
            os.pwrite(fd, data, at % (self.size[rel] - len(data) + 1))
        finally:
            os.close(fd)
        self._stamp(rel)
        self._expect(rel, Change.REWRITTEN)

    @rule(rel=files)
    def delete(self, rel: str) -> None:
        if self.size[rel] < 0:
            return
        os.unlink(self.dir / rel)
        self.size[rel] = -1
        self._expect(rel, Change.DELETED)

    @rule()
    def nothing(self) -> None:
        assert self.watcher.check() == []


def test_random_changes_each_reported_as_what_it_is() -> None:
    run_state_machine_as_test(WatchModel, settings=settings(
        max_examples=50, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)))
