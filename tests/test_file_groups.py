"""The files a job writes, at home: their bytes made durable in groups while
the reads go on, acknowledged only once durable; their descriptors counted
in the shadow's budget.

A real gcshadow spoken to by a scripted agent over a real socket; a sync
that hangs is a real one (a FUSE file system that holds fsync: tests/fusefs.py),
a short descriptor limit a real RLIMIT_NOFILE.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from fusefs import SlowFS, available
from helpers import ShadowProc, wait_until
from rawagent import RawAgent
from test_shadow_perf import NOFILE, LimitedShadow, budget

from gcwrap.wire.events import (
    FILES_FEATURE,
    Error,
    Event,
    FileAck,
    FileCommit,
    FileData,
    FileOpen,
    Hello,
    Ping,
    Pong,
    Welcome,
)


def _agent(port: int, job: str) -> RawAgent:
    a = RawAgent(port)
    a.send(Hello(job_id=job, instance="i1", streams=(), host="test", features=(FILES_FEATURE,)))
    w = a.next()
    assert isinstance(w, Welcome) and FILES_FEATURE in w.features, w
    return a


def _until_pong(a: RawAgent, nonce: int) -> list[Event]:
    """What the shadow sent before its PONG to `nonce`."""
    seen: list[Event] = []
    while True:
        ev = a.next()
        if isinstance(ev, Pong) and ev.nonce == nonce:
            return seen
        assert not isinstance(ev, Error), ev
        seen.append(ev)


def _file_ack(a: RawAgent, file: int, offset: int, committed: bool = False) -> None:
    while True:
        ev = a.until(FileAck)
        assert isinstance(ev, FileAck), ev
        if ev.file == file and ev.offset >= offset and ev.committed == committed:
            return


@pytest.mark.timeout(60)
@pytest.mark.skipif(bool(available()), reason=f"FUSE: {available()}")
def test_a_file_is_acknowledged_only_once_synced_and_the_reads_go_on_while_it_syncs(home: Path,
                                                                                 tmp_path: Path) -> None:
    """While the sync of a version's bytes hangs, the session still reads
    and answers (a PING) and acknowledges none of those bytes; once the sync
    returns, one FILE_ACK covers them all."""
    mnt = home / "nfs"
    mnt.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    with SlowFS(mnt, {}) as fs:
        sh = ShadowProc(home, logs, extra=["--min-free", "0"])
        sh.start()
        try:
            a = _agent(sh.port, "hung")
            a.sock.settimeout(15)
            a.send(FileOpen(1, "nfs/f.bin", 1))
            _file_ack(a, 1, 0)
            # From now on its syncs hang (and so would a write to it: the kernel holds the file's lock
            # while FUSE holds the sync, so nothing more is written to it until they are let go).
            with fs.lock:
                fs.syncs.open = False
            a.send(FileData(1, 1, 0, b"x" * 1000))
            wait_until(lambda: fs.waiting(fs.syncs) >= 1, 30, "the shadow to sync the file")
            a.send(Ping(1))
            try:
                before = _until_pong(a, 1)
            except TimeoutError:
                raise AssertionError("the session read nothing more while the file's sync hung") from None
            a.send(Ping(2))
            before += _until_pong(a, 2)
            assert not any(isinstance(ev, FileAck) for ev in before), before  # (nothing of it synced yet)
            assert fs.waiting(fs.syncs) >= 1
            fs.release()
            ev = a.until(FileAck)
            assert ev == FileAck(1, 1, 1000), ev
            a.send(FileCommit(1, 1, 1000, hashlib.sha256(b"x" * 1000).hexdigest()))
            _file_ack(a, 1, 1000, committed=True)
            assert (mnt / "f.bin").read_bytes() == b"x" * 1000
        finally:
            sh.stop()


@pytest.mark.timeout(90)
def test_many_jobs_with_files_stay_within_the_descriptor_budget(home: Path, tmp_path: Path) -> None:
    """More versions' files than the descriptor limit leaves room for, kept
    by every job at once: the shadow closes those all durable (and opens
    them again when written to) rather than run out of descriptors."""
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = LimitedShadow(home, logs, NOFILE)
    try:
        b = budget(sh.log())
        jobs = b["served"]
        per_job = 8  # (what one session keeps open: filestore.OPEN_PER_SESSION)
        assert jobs * (per_job + 1) > NOFILE, (b, "no test: the limit holds every file")
        agents = [_agent(sh.port, f"j{k}") for k in range(jobs)]
        for k, a in enumerate(agents):
            for f in range(1, per_job + 1):
                a.send(FileOpen(f, f"d{k}/{f}.txt", 1))
                a.send(FileData(f, 1, 0, b"a" * f))
                _file_ack(a, f, f)
                sh.sample_fds()
        for a in agents:  # (each opened again where it was closed)
            for f in range(1, per_job + 1):
                a.send(FileData(f, 1, f, b"b"))
                a.send(FileCommit(f, 1, f + 1, hashlib.sha256(b"a" * f + b"b").hexdigest()))
                _file_ack(a, f, f + 1, committed=True)
                sh.sample_fds()
        for k in range(jobs):
            for f in range(1, per_job + 1):
                assert (home / f"d{k}/{f}.txt").read_bytes() == b"a" * f + b"b"
        assert sh.max_fds <= NOFILE
        assert "out of" not in sh.log() and "cannot accept" not in sh.log(), sh.log()
    finally:
        sh.stop()


@pytest.mark.timeout(30)
async def test_a_stale_event_of_a_growing_file_makes_no_new_version(tmp_path: Path) -> None:
    """The watcher's events wait their turn while the job appends: one that
    reports a size the version has already passed (planned from a later
    look) is no rewrite. Taken for one, every such event started the file
    over, scanned and sent whole again (a 400 MiB append made 29 versions)."""
    from gcwrap.agent.filesender import FileSender
    from gcwrap.agent.filespecs import FileStat, parse_file_spec
    from gcwrap.agent.filewatch import Change, FileEvent
    from gcwrap.sync import Signal

    path = tmp_path / "log.bin"
    path.write_bytes(b"a" * 1000)
    spec = parse_file_spec("log.bin")
    sender = FileSender(tmp_path, (spec,), Signal())
    try:
        early = FileStat.of(path.stat())
        await sender.take(FileEvent("log.bin", spec, Change.APPEARED, early))
        with open(path, "ab") as f:
            f.write(b"b" * 5000)
        await sender.take(FileEvent("log.bin", spec, Change.GREW, FileStat.of(path.stat())))
        tracked = sender.files["log.bin"]
        assert tracked.current is not None and (tracked.current.number, tracked.current.planned) == (1, 6000)
        stale = FileStat(early.dev, early.ino, 3000, early.mtime_ns)  # (a look between the two)
        await sender.take(FileEvent("log.bin", spec, Change.GREW, stale))
        assert (tracked.current.number, tracked.current.planned) == (1, 6000)
    finally:
        sender.close()
