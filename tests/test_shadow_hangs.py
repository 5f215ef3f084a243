"""A file system at home that hangs (a dead NFS server) does not hang the shadow.

The job's stdin file is read off the shadow's event loop, bounded: a read
that does not return refuses the session with a retryable error naming the
file and the wait, and the shadow serves every other job meanwhile. A sync
that hangs when the shadow stops does not keep it from stopping: it says
what is stuck, for how long, and exits within its grace (nothing unsynced
was acknowledged: the agent delivers it again to the shadow restarted).

Real processes (the installed gcshadow and gcwrap) and a real hang: the
files are on a FUSE file system served by the test (tests/fusefs.py),
whose reads or fsyncs are not answered until the test says so, so the
shadow waits in pread(2) or fdatasync(2) as it would on NFS.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio
from fusefs import SlowFS, available
from helpers import ShadowProc, Wrapper, expected, genjob, sha256_file, wait_until

from gcwrap.shadow.files import FileCache
from gcwrap.shadow.receive import StdinReader
from gcwrap.shadow.state import Store
from gcwrap.wire.events import StdinData, StdinRead, StreamSpec

pytestmark = pytest.mark.skipif(bool(available()), reason=f"FUSE: {available()}")

STDIN_WAIT = 10.0  # the shadow's bound on one read of a stdin file (gcwrap.shadow.receive.STDIN_WAIT)
STOP_GRACE = 10.0  # the shadow's bound on stopping (gcwrap.shadow.server.STOP_GRACE)
INPUT = b"a line of input, read from a file system that hangs\n" * 2000


@pytest.fixture
def nfs(home: Path) -> Path:
    """A directory under the root for SlowFS to mount on (unmounted by the test's `with`)."""
    mnt = home / "nfs"
    mnt.mkdir()
    return mnt


def wrap(sh: ShadowProc, spool_dir: Path, job_id: str, *args: str) -> list[str]:
    return ["--shadow", sh.address, "--spool", str(spool_dir / job_id), "--job-id", job_id, "--retry-timeout", "1",
            *args]


@pytest.mark.timeout(150)
def test_a_stdin_read_that_hangs_refuses_the_session_for_now_and_stops_no_other_job(
        nfs: Path, home: Path, tmp_path: Path, spool_dir: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    with SlowFS(nfs, {"in.txt": INPUT}, hang_reads=True) as fs:
        sh = ShadowProc(home, logs)
        sh.start()
        try:
            reader = Wrapper([*wrap(sh, spool_dir, "hung-input"), "--stdin", "nfs/in.txt", "--stdout", "cat.out",
                              "--", "cat"], err_file=tmp_path / "reader.err")
            wait_until(lambda: fs.waiting(fs.reads) >= 1, 30, "the shadow to read the stdin file")
            asked = time.monotonic()
            # While that read hangs, another job streams through the same shadow, start to end.
            other = Wrapper([*wrap(sh, spool_dir, "meanwhile"), "--stdout", "other.out", "--",
                             *genjob(1 << 20, seed=3)])
            assert other.wait(STDIN_WAIT - 3) == 0, other.err.decode()
            assert sha256_file(home / "other.out") == expected(1 << 20, 3)
            assert time.monotonic() - asked < STDIN_WAIT, "the read hung for less than its bound: no test"

            # Past the bound the session is refused, retryably, naming the file and the wait.
            wait_until(lambda: "nfs/in.txt" in sh.log(), STDIN_WAIT + 20, "the shadow to give up on the read")
            line = next(x for x in sh.log().splitlines() if "nfs/in.txt" in x)
            assert "refused" in line and f"{STDIN_WAIT:g} s" in line, line
            wait_until(lambda: "[IO_ERROR]" in reader.err_so_far(), 30, "the agent to be told")
            assert reader.proc.poll() is None, reader.err_so_far()  # not refused for good: the job waits
            assert "can never be fed" not in reader.err_so_far()

            # The file system answers again: the job gets its stdin, all of it.
            fs.release()
            assert reader.wait(60) == 0, reader.err.decode()
            assert (home / "cat.out").read_bytes() == INPUT
        finally:
            fs.release()
            sh.stop()


@pytest.mark.timeout(150)
def test_a_sync_that_hangs_does_not_keep_the_shadow_from_stopping(
        nfs: Path, home: Path, tmp_path: Path, spool_dir: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    # One write, one DATA frame, one pwrite: while a sync holds a FUSE file,
    # a write to it waits too (the kernel holds the file's lock), and the
    # shadow writes DATA inline: a second frame would hang it there instead.
    output = bytes(range(256)) * 16
    with SlowFS(nfs, {}, hang_syncs=True) as fs:
        sh = ShadowProc(home, logs)
        port = sh.start()
        try:
            w = Wrapper([*wrap(sh, spool_dir, "hung-sync"), "--retry-limit", "0", "--stdout", "nfs/out.txt", "--",
                         sys.executable, "-c", f"import os; os.write(1, {output!r})"], err_file=tmp_path / "job.err")
            wait_until(lambda: fs.waiting(fs.syncs) >= 1, 30, "the shadow to sync the output")
            time.sleep(0.5)  # (what a session does next: nothing is acknowledged while its sync hangs)
            assert sh.proc is not None
            stopping = time.monotonic()
            sh.proc.send_signal(signal.SIGTERM)
            try:
                status = sh.proc.wait(STOP_GRACE + 8)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"gcshadow did not stop within {STOP_GRACE + 8:g} s: {sh.log()}") from None
            took = time.monotonic() - stopping
            log = sh.log()
            assert status == 0, log
            stuck = [x for x in log.splitlines() if "nfs/out.txt" in x and "sync" in x]
            assert stuck, log
            assert any("exiting anyway" in x for x in stuck), log
            assert took < STOP_GRACE + 5, (took, log)

            # Nothing that sync covered was acknowledged: restarted, the shadow gets it all again.
            fs.release()
            sh.start(port)
            assert w.wait(60) == 0, w.err.decode()
            assert (nfs / "out.txt").read_bytes() == output
        finally:
            fs.release()
            sh.stop()


@pytest.mark.timeout(60)
async def test_a_stdin_file_being_read_is_closed_by_neither_the_cache_nor_its_session(nfs: Path, home: Path) -> None:
    """Its descriptor's number must not be reused under the read: the cache
    leaves it open, and the session that ends leaves it to the read to close."""
    with SlowFS(nfs, {"in.txt": INPUT}, hang_reads=True) as fs:
        store = Store(home)
        try:
            files = store.open_job(job_id="j", instance="i", host="h", user="u", command=[], peer="p",
                                   streams=[StreamSpec(0, "stdin", "nfs/in.txt")])
            sf = files.stdin
            assert sf is not None
            fd = sf.fd
            cache = FileCache(store.root_fd)
            cache.add(sf)
            got: list[StdinData] = []

            async def read() -> None:
                got.append(await StdinReader(cache).read(files, StdinRead(0, 0, 100)))

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read)
                    while not fs.waiting(fs.reads):
                        await trio.sleep(0.01)
                    cache.trim(0)  # (it would close every clean file)
                    assert sf.fd == fd
                    with cache.lock:
                        files.close()  # the session ends
                    assert sf.fd == fd and sf.orphaned
                    fs.release()
            assert got[0].payload == INPUT[:100]
            assert sf.fd == -1  # closed by the read, once it returned
        finally:
            store.close()
