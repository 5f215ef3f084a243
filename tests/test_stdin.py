"""A job's stdin that the shadow refuses for good (a missing file, a symlink):
the job can never get its input, so it must not wait for it. gcwrap ends it
(SIGTERM to its process group, SIGKILL after the grace), says why in one
line naming the stdin NAME and the shadow's reason, keeps whatever the job
wrote in the spool, and exits 123. A refusal that may pass (BUSY) ends
nothing; nor does one that comes after the job has had all its stdin.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
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
