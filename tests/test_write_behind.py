"""Write-behind (`gcwrap --write-behind SECONDS`), the relaxed spooling mode,
and the bulk-read path, with real processes: what home acknowledges in time
never touches the disk; what it does not is spooled after the delay, even
while the connection looks alive, and survives a killed wrapper."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import ShadowProc, Wrapper, expected, file_size, genjob, sha256_file, tool, wait_until

from gcwrap.agent.spool import Spool

MB = 1_000_000


def spool_files(spool_dir: Path) -> list[Path]:
    return sorted(spool_dir.glob("*.spool"))


def segment_bytes(spool_dir: Path) -> int:
    total = 0
    for seg in spool_dir.glob("*.spool.seg/*"):
        try:
            total += seg.stat().st_size
        except FileNotFoundError:
            pass
    return total


class SpoolWatcher(threading.Thread):
    """Samples the bytes in the spool's segment files until stopped."""

    def __init__(self, spool_dir: Path) -> None:
        super().__init__(daemon=True)
        self.spool_dir = spool_dir
        self.most = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.most = max(self.most, segment_bytes(self.spool_dir))
            self.samples += 1


def run_watched(spool_dir: Path, args: list[str], timeout: float) -> SpoolWatcher:
    """gcwrap ARGS run to its end (exit 0) while a SpoolWatcher samples the spool."""
    watcher = SpoolWatcher(spool_dir)
    watcher.start()
    w = Wrapper(["--spool", str(spool_dir), *args])
    try:
        assert w.wait(timeout) == 0, w.err.decode()
    finally:
        watcher.done.set()
        watcher.join(10)
    assert watcher.samples > 20, "the spool was watched while the job ran"
    return watcher


@pytest.mark.timeout(120)
def test_write_behind_keeps_output_written_before_the_first_welcome_off_the_disk(
    shadow: ShadowProc, home: Path, spool_dir: Path
) -> None:
    """The job starts before gcwrap has connected: what it writes before the
    first WELCOME (here half a second each way through a delaying proxy) is
    held like the rest, and home acknowledges it in time, so none of it is
    spooled. Before: output read before the first session streamed was
    spooled at once (in CI, 270 KB of a job that wrote at once)."""
    from faults import DelayProxy

    size = 4 * MB
    host, port = shadow.address.rsplit(":", 1)
    with DelayProxy((host, int(port)), delay=0.5) as proxy:
        watcher = run_watched(spool_dir, ["--shadow", f"127.0.0.1:{proxy.port}", "--job-id", "wb-first",
                                          "--write-behind", "10", "--stdout", "first.out", "--",
                                          *genjob(size, seed=73)], 60)
    assert sha256_file(home / "first.out") == expected(size, 73)
    assert watcher.most == 0, f"{watcher.most} bytes were spooled although home acknowledged them in time"


@pytest.mark.timeout(120)
def test_write_behind_keeps_acknowledged_output_off_the_disk(
    shadow: ShadowProc, home: Path, spool_dir: Path
) -> None:
    size = 40 * MB
    watcher = run_watched(spool_dir, ["--shadow", shadow.address, "--job-id", "wb", "--write-behind", "10",
                                      "--stdout", "wb.out", "--stderr", "wb.err", "--",
                                      *genjob(size, 2 * MB, seed=71, rate=20 * MB)], 90)
    assert sha256_file(home / "wb.out") == expected(size, 71)
    assert sha256_file(home / "wb.err") == expected(2 * MB, 72)
    assert watcher.most == 0, f"{watcher.most} bytes were spooled although home acknowledged them in time"
    assert spool_files(spool_dir) == [], "a delivered job leaves no spool"


@pytest.mark.timeout(120)
def test_default_mode_spools_what_it_reads(shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """The contrast: without write-behind, what is read goes to the spool
    at once (here the shadow stops answering, so it stays there)."""
    done = tmp_path / "done"
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "nowb", "--heartbeat", "30",
                 "--stdout", "nowb.out", "--", *genjob(4 * MB, 0, seed=73, rate=2 * MB, done_file=done)])
    wait_until(lambda: file_size(home / "nowb.out") > MB // 2, 60, "output at home")
    assert shadow.proc is not None
    os.kill(shadow.proc.pid, signal.SIGSTOP)
    try:
        wait_until(done.exists, 30, "the job to write everything")
        wait_until(lambda: segment_bytes(spool_dir) >= 3 * MB, 10, "the unacknowledged bytes in the spool")
    finally:
        os.kill(shadow.proc.pid, signal.SIGCONT)
    assert w.wait(60) == 0, w.err.decode()
    assert sha256_file(home / "nowb.out") == expected(4 * MB, 73)


@pytest.mark.timeout(150)
def test_write_behind_spools_unacknowledged_output_that_survives_a_killed_wrapper(
    shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path
) -> None:
    """The shadow stops answering (SIGSTOP: the connection stays up, the kernel
    still takes some bytes, no ACK comes). After the write-behind delay the
    output must be in the spool: kill -9 the wrapper, and resume delivers it all."""
    size = 6 * MB
    done = tmp_path / "done"
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "wb-stop", "--write-behind", "1",
                 "--heartbeat", "30", "--retry-timeout", "0.5", "--stdout", "stop.out", "--",
                 *genjob(size, 0, seed=75, rate=3 * MB, done_file=done)])
    wait_until(lambda: file_size(home / "stop.out") > MB // 2, 60, "output at home")
    assert shadow.proc is not None
    os.kill(shadow.proc.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        wait_until(done.exists, 30, "the job to write everything")
        (path,) = spool_files(spool_dir)

        def spooled() -> int:
            spool = Spool.open(path, readonly=True)
            try:
                return spool.streams()[1].appended
            finally:
                spool.close()

        # Not at once (home might still answer), but within the delay and a margin.
        wait_until(lambda: spooled() == size, 15, "the unacknowledged output in the spool")
        assert time.monotonic() - stopped_at < 30
        w.kill9()
    finally:
        os.kill(shadow.proc.pid, signal.SIGCONT)
    res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--retry-timeout", "0.5"],
                         capture_output=True, timeout=90)
    assert res.returncode == 0, res.stderr.decode() + shadow.log()
    assert file_size(home / "stop.out") == size, "every byte the job wrote is home, once"
    assert sha256_file(home / "stop.out") == expected(size, 75)
