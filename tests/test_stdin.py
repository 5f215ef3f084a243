"""A job's stdin that the shadow refuses for good (a missing file, a symlink):
the job can never get its input, so it must not wait for it. gcwrap ends it
(SIGTERM to its process group, SIGKILL after the grace), says why in one
line naming the stdin NAME and the shadow's reason, keeps whatever the job
wrote in the spool, and exits 123. A refusal that may pass (BUSY) ends
nothing; nor does one that comes after the job has had all its stdin.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults import Tmpfs
from helpers import ShadowProc, Wrapper, spool_status, tool, wait_until

ENDED_WITHIN = 8.0  # seconds: the job dies of SIGTERM at once; gcwrap needs a connection attempt and its exit


def wrap(shadow: ShadowProc, spool_dir: Path, job_id: str, *args: str) -> list[str]:
    return ["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", job_id, "--retry-timeout", "1", *args]


@pytest.mark.timeout(60)
def test_missing_stdin_ends_the_job(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    """`cat` would wait for its stdin forever (the issue's case)."""
    started = time.monotonic()
    w = Wrapper([*wrap(shadow, spool_dir, "no-input"), "--stdout", "out.txt", "--stdin", "missing.txt", "--", "cat"])
    rc = w.wait(30)
    assert time.monotonic() - started < ENDED_WITHIN, w.err.decode()
    assert rc == 123, w.err.decode()
    text = w.err.decode()
    line = next((x for x in text.splitlines() if "stdin 'missing.txt'" in x), "")
    assert "can never be fed" in line and "does not exist at the shadow" in line and "[NOT_FOUND]" in line, text
    assert "the job was ended" in line, text
    (st,) = spool_status(spool_dir)
    assert st["state"] == "refused, job killed by signal 15", st
    assert "stdin 'missing.txt'" in str(st["reason"]), st


@pytest.mark.timeout(60)
def test_symlinked_stdin_ends_the_job(shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    (home / "real.txt").write_text("data\n")
    (home / "link.txt").symlink_to(home / "real.txt")  # inside the root, and still refused: links are never followed
    started = time.monotonic()
    w = Wrapper([*wrap(shadow, spool_dir, "linked-input"), "--stdout", "out.txt", "--stdin", "link.txt", "--",
                 "cat"])
    rc = w.wait(30)
    assert time.monotonic() - started < ENDED_WITHIN, w.err.decode()
    assert rc == 123, w.err.decode()
    text = w.err.decode()
    line = next((x for x in text.splitlines() if "stdin 'link.txt'" in x), "")
    assert "can never be fed" in line and "[PATH_FORBIDDEN]" in line, text


@pytest.mark.timeout(90)
def test_a_job_that_never_reads_stdin_is_ended_and_its_output_kept(shadow: ShadowProc, home: Path,
                                                                   spool_dir: Path) -> None:
    """The job writes and sleeps, never touching stdin: it is ended all the
    same (its input is missing: what it computes is not what was asked), and
    what it wrote waits in the spool, delivered by `resume --include-refused`."""
    started = time.monotonic()
    w = Wrapper([*wrap(shadow, spool_dir, "no-read"), "--stdout", "nr.out", "--stderr", "nr.err",
                 "--stdin", "missing.txt", "--", "sh", "-c", "echo before; echo warn >&2; exec sleep 60"])
    rc = w.wait(30)
    assert time.monotonic() - started < ENDED_WITHIN, w.err.decode()
    assert rc == 123, w.err.decode()
    assert b"the job itself exited with status 143" in w.err, w.err.decode()
    assert b"gcwrap resume --include-refused" in w.err
    (st,) = spool_status(spool_dir)
    pending = {s["kind"]: s["pending"] for s in st["streams"]}  # type: ignore[index]
    assert pending == {"stdout": len(b"before\n"), "stderr": len(b"warn\n")}, st
    assert not (home / "nr.out").exists() or (home / "nr.out").read_bytes() == b""
    res = subprocess.run([*tool("gcwrap"), "resume", "--include-refused", "--spool", str(spool_dir),
                          "--retry-timeout", "1"], capture_output=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr.decode()
    assert (home / "nr.out").read_bytes() == b"before\n" and (home / "nr.err").read_bytes() == b"warn\n"
    jobs = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                                     check=True, timeout=30).stdout)
    assert jobs[0]["exit_signal"] == signal.SIGTERM and "stdin 'missing.txt'" in jobs[0]["reason"], jobs


@pytest.mark.timeout(90)
def test_a_busy_shadow_does_not_end_a_job_waiting_for_stdin(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """BUSY may pass: the job waits for its stdin, and gets it once the shadow takes it."""
    (home / "in.txt").write_bytes(b"input line\n" * 1000)
    logs = tmp_path / "logs"
    logs.mkdir()
    busy = ShadowProc(home, logs, extra=["--min-free", "1000TB"])  # "disk low at home": BUSY
    port = busy.start()
    try:
        w = Wrapper(["--shadow", busy.address, "--spool", str(spool_dir), "--job-id", "patient-input",
                     "--retry-timeout", "0.5", "--stdin", "in.txt", "--stdout", "cat.out", "--", "cat"])
        wait_until(lambda: "disk low at home" in busy.log(), 30, "a BUSY answer")
        time.sleep(2)  # several BUSY answers: the job must still be there
        assert w.proc.poll() is None, w.proc.communicate()[1].decode()
    finally:
        busy.stop()
    ok = ShadowProc(home, logs)
    ok.start(port)
    try:
        assert w.wait(60) == 0, w.err.decode()
    finally:
        ok.stop()
    assert (home / "cat.out").read_bytes() == b"input line\n" * 1000
    assert b"BUSY" in w.err and b"can never be fed" not in w.err


@pytest.mark.timeout(90)
def test_a_refusal_after_the_job_had_all_its_stdin_ends_nothing(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """The job has read all its stdin; then the shadow refuses for good (it
    now requires a token). The job needs nothing more from home: it runs to
    its end, and gcwrap exits 123 with its output in the spool, as for any
    refusal."""
    (home / "in.txt").write_bytes(b"all of it\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    port = sh.start()
    gate = tmp_path / "gate"
    w = Wrapper(["--shadow", sh.address, "--spool", str(spool_dir), "--job-id", "had-it-all", "--retry-timeout", "0.5",
                 "--stdin", "in.txt", "--stdout", "h.out", "--", "sh", "-c",
                 f"cat; while [ ! -e {gate} ]; do sleep 0.05; done; echo after"])
    try:

        def echoed_and_acknowledged() -> bool:
            spools = spool_status(spool_dir)
            return bool(spools) and spools[0]["streams"][0]["acked"] == len(b"all of it\n")  # type: ignore[index]

        wait_until(echoed_and_acknowledged, 30, "the job's stdin, echoed, acknowledged by home")
        sh.stop()
        token = tmp_path / "token"
        token.write_text(os.urandom(32).hex() + "\n")
        token.chmod(0o600)
        sh.extra = ["--token-file", str(token)]
        sh.start(port)
        wait_until(lambda: "requires token authentication" in sh.log(), 30, "the refusal")
        time.sleep(1)
        assert w.proc.poll() is None, "the job goes on"
        gate.touch()
        rc = w.wait(30)
    finally:
        sh.stop()
    assert rc == 123, w.err.decode()
    assert b"can never be fed" not in w.err
    assert b"the job itself exited with status 0" in w.err, w.err.decode()
    (st,) = spool_status(spool_dir)
    assert st["state"] == "refused, job exited 0", st
    assert {s["kind"]: s["pending"] for s in st["streams"]} == {"stdout": len(b"after\n")}  # type: ignore[index]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def refused_with_the_disk_full(home: Path, tmp_path: Path, job_id: str, size: int,
                               *limits: str) -> Iterator[tuple[Wrapper, Tmpfs, Path]]:
    """A job refused for good (its stdin is missing at home) whose output
    the spool could not take: the spool's file system is full from the
    moment the job writes, which is before home answers (nothing listens at
    first). Gives the wrapper, the file system and its filler."""
    with Tmpfs(tmp_path / "small", "8m") as fs:
        spool_dir = fs.path / "spool"
        port = free_port()
        gate = tmp_path / "gate"
        job = ("import os, random, sys, time\n"
               f"while not os.path.exists({str(gate)!r}): time.sleep(0.01)\n"
               f"os.write(1, random.Random(5).randbytes({size}))\n"
               "time.sleep(60)\n")
        w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir), "--job-id", job_id,
                     "--retry-timeout", "0.3", *limits, "--stdin", "missing.bin", "--stdout", "kept.out", "--",
                     sys.executable, "-c", job], err_file=tmp_path / "gcwrap.err")
        wait_until(lambda: any(spool_dir.glob("*.spool")), 30, "the spool")
        filler = fs.fill(leave=0)
        gate.touch()
        wait_until(lambda: "disk full" in w.err_so_far(), 30, "the spool to refuse the job's output")
        logs = tmp_path / "logs"
        logs.mkdir()
        sh = ShadowProc(home, logs)
        try:
            sh.start(port)
            yield w, fs, filler
        finally:
            sh.stop()


@pytest.mark.timeout(120)
def test_refused_with_the_disk_full_the_output_waits_for_room(home: Path, tmp_path: Path) -> None:
    """Home refuses the job for good and the disk took none of what the job
    wrote: memory holds the only copy. gcwrap does not end with it lost: it
    tries the spool again until it takes it (the disk freed), exits 123 as
    for any refusal, and `resume --include-refused` delivers it byte-exact."""
    size = 300_000
    with refused_with_the_disk_full(home, tmp_path, "kept-when-refused", size) as (w, fs, filler):
        wait_until(lambda: "trying the spool again until it does" in w.err_so_far(), 30, "gcwrap to wait for room")
        assert w.proc.poll() is None
        filler.unlink()
        rc = w.wait(60)
        err = w.err.decode()
        assert rc == 123, err
        assert "the spool took the output held in memory" in err and "LOST" not in err, err
        (st,) = spool_status(fs.path / "spool")
        assert {s["kind"]: s["pending"] for s in st["streams"]} == {"stdout": size}, st  # type: ignore[index]
        res = subprocess.run([*tool("gcwrap"), "resume", "--include-refused", "--spool", str(fs.path / "spool"),
                              "--retry-timeout", "1"], capture_output=True, timeout=60, check=False)
        assert res.returncode == 0, res.stderr.decode()
        assert (home / "kept.out").read_bytes() == random.Random(5).randbytes(size)


@pytest.mark.timeout(120)
def test_refused_with_the_disk_full_for_good_the_loss_is_said_past_the_retry_limit(home: Path,
                                                                                  tmp_path: Path) -> None:
    """The same, and the disk never frees: past --retry-limit tries gcwrap
    gives up, says what is lost and exits 121 (not waiting forever)."""
    with refused_with_the_disk_full(home, tmp_path, "lost-when-refused", 300_000, "--retry-limit", "3") as (w, _, _):
        rc = w.wait(60)
        err = w.err.decode()
        assert rc == 121, err
        assert "trying the spool again until it does (at most 3 tries in all, --retry-limit)" in err, err
        assert "held only in memory in 3 tries: giving up" in err, err
        assert "LOST: the last 300,000 bytes of stdout" in err, err


@pytest.mark.timeout(120)
def test_refused_with_the_disk_full_and_no_retry_limit_a_second_signal_ends_the_wait(home: Path,
                                                                                    tmp_path: Path) -> None:
    """With --retry-limit 0 gcwrap would wait for the disk for ever: a
    SIGTERM bounds the wait (by the grace a signal leaves), a second one
    ends it at once, and the loss is said."""
    with refused_with_the_disk_full(home, tmp_path, "signalled-when-refused", 300_000,
                                    "--retry-limit", "0") as (w, _, _):
        wait_until(lambda: "trying the spool again until it does (no --retry-limit)" in w.err_so_far(), 30,
                   "gcwrap to wait for room")
        os.kill(w.proc.pid, signal.SIGTERM)
        wait_until(lambda: "SIGTERM received: trying the spool for at most 5 s more (again to stop now)"
                   in w.err_so_far(), 10, "gcwrap to say the signal bounds the wait")
        os.kill(w.proc.pid, signal.SIGTERM)
        started = time.monotonic()
        rc = w.wait(30)
        err = w.err.decode()
        assert time.monotonic() - started < 3, err  # (the first signal's grace is 5 s)
        assert rc == 121, err
        assert "SIGTERM received: keeping no more of the output held in memory" in err, err
        assert "LOST: the last 300,000 bytes of stdout" in err, err
