"""End to end: the installed gcwrap and gcshadow, real processes, loopback TCP.

Every test compares sha256 of what the job wrote with what landed at home.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    ShadowProc,
    Wrapper,
    expected,
    file_size,
    genjob,
    sha256_bytes,
    sha256_file,
    spool_status,
    tool,
    wait_until,
)

MB = 1_000_000


def wrap_args(shadow: ShadowProc, spool_dir: Path, job_id: str, *extra: str) -> list[str]:
    return ["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", job_id, "--retry-timeout", "1", *extra]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("how", "status"),
    [("exit", 0), ("exit", 3), ("signal", signal.SIGKILL)],
    ids=["status-0", "status-3", "sigkill-137"],
)
def test_bulk_byte_exact_with_job_status(
    shadow: ShadowProc, home: Path, spool_dir: Path, how: str, status: int
) -> None:
    job = genjob(100 * MB, 20 * MB, seed=7, **{how: status})
    w = Wrapper([*wrap_args(shadow, spool_dir, f"bulk-{status}"), "--stdout", "out/job.out", "--stderr", "out/job.err",
                 "--", *job])
    rc = w.wait(200)
    want = 128 + status if how == "signal" else status
    assert rc == want, w.err.decode()
    assert sha256_file(home / "out/job.out") == expected(100 * MB, 7)
    assert sha256_file(home / "out/job.err") == expected(20 * MB, 8)
    assert list(spool_dir.glob("*.spool")) == [], "a delivered spool is removed"
    jobs = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True, check=True,
                          timeout=60)
    import json

    (rec,) = json.loads(jobs.stdout)
    assert rec["state"] == "finished"
    if how == "signal":
        assert rec["exit_signal"] == status and rec["exit_code"] is None
    else:
        assert rec["exit_code"] == status and rec["exit_signal"] is None
    # the I/O summary: on gcwrap's stderr, and recorded at the shadow
    assert rec["summary"]["stdout_bytes"] == 100 * MB and rec["summary"]["stderr_bytes"] == 20 * MB  # (numbers)
    assert int(rec["summary"]["connections"]) >= 1 and float(rec["summary"]["connected_s"]) > 0
    assert f"job bulk-{status} ended with status {want}".encode() in w.err
    assert b"output: stdout 95.4 MiB, stderr 19.1 MiB" in w.err


@pytest.mark.timeout(300)
def test_fifty_jobs_at_once(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    wrappers = []
    for i in range(50):
        job = genjob(400_000 + i * 1000, 50_000 + i, seed=100 + 2 * i)
        wrappers.append(Wrapper([*wrap_args(shadow, spool_dir, f"many-{i}"), "--stdout", f"many/{i}.out",
                                 "--stderr", f"many/{i}.err", "--", *job]))
    for w in wrappers:
        assert w.wait(240) == 0, w.err.decode()
    for i in range(50):
        assert sha256_file(home / f"many/{i}.out") == expected(400_000 + i * 1000, 100 + 2 * i), i
        assert sha256_file(home / f"many/{i}.err") == expected(50_000 + i, 101 + 2 * i), i


@pytest.mark.timeout(240)
def test_shadow_killed_twice_mid_stream(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    size = 100 * MB
    job = genjob(size, 2 * MB, seed=21, rate=25 * MB)
    w = Wrapper([*wrap_args(shadow, spool_dir, "crashy", "--heartbeat", "1"), "--stdout", "crash.out",
                 "--stderr", "crash.err", "--", *job])
    out = home / "crash.out"
    for threshold in (15 * MB, 50 * MB):
        wait_until(lambda threshold=threshold: file_size(out) > threshold, 120, f"{threshold} bytes at home")
        shadow.kill9()
        shadow.start()  # same port
    assert w.wait(200) == 0, w.err.decode() + shadow.log()
    assert file_size(out) == size, "no byte lost, none written twice"
    assert sha256_file(out) == expected(size, 21)
    assert sha256_file(home / "crash.err") == expected(2 * MB, 22)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_shadow_down_when_job_starts(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    done = tmp_path / "job-done"
    job = genjob(5 * MB, 1 * MB, seed=31, done_file=done)
    w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir), "--job-id", "late", "--retry-timeout",
                 "1", "--retry-limit", "0", "--stdout", "late.out", "--stderr", "late.err", "--", *job])
    wait_until(done.exists, 60, "the job to finish without a shadow")

    def all_spooled() -> bool:
        st = spool_status(spool_dir)
        return bool(st) and str(st[0]["state"]).startswith("exited")

    wait_until(all_spooled, 30, "the spool to record the job's end")
    (st,) = spool_status(spool_dir)
    pending = {s["kind"]: s["pending"] for s in st["streams"]}  # type: ignore[index]
    assert pending == {"stdout": 5 * MB, "stderr": 1 * MB}, "the output waits in the spool"
    assert "refused" in str(st["last_error"])
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    sh.start(port)
    try:
        assert w.wait(60) == 0, w.err.decode()
    finally:
        sh.stop()
    assert sha256_file(home / "late.out") == expected(5 * MB, 31)
    assert sha256_file(home / "late.err") == expected(1 * MB, 32)
    assert b"refused" in w.err, "the outage was reported on gcwrap's stderr"


@pytest.mark.timeout(120)
def test_stdin_served_from_the_shadow(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    data = random.Random(5).randbytes(3 * MB + 17)
    (home / "inputs").mkdir()
    (home / "inputs/in.5").write_bytes(data)
    checksum = "import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"
    w = Wrapper([*wrap_args(shadow, spool_dir, "stdin-sum"), "--stdin", "inputs/in.5", "--stdout", "sum.out", "--",
                 sys.executable, "-c", checksum])
    assert w.wait(60) == 0, w.err.decode()
    assert (home / "sum.out").read_text().strip() == sha256_bytes(data)
    # and a job that echoes its stdin: byte-exact round trip
    w = Wrapper([*wrap_args(shadow, spool_dir, "stdin-cat"), "--stdin", "inputs/in.5", "--stdout", "cat.out", "--",
                 "cat"])
    assert w.wait(60) == 0, w.err.decode()
    assert sha256_file(home / "cat.out") == sha256_bytes(data)


@pytest.mark.timeout(120)
def test_seed_environment_variables_only(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    data = random.Random(6).randbytes(MB)
    (home / "infile.5").write_bytes(data)
    env = {
        **os.environ,
        "BYPASS_SHADOW_HOST": "127.0.0.1",
        "BYPASS_SHADOW_PORT": str(shadow.port),
        "GRID_CONSOLE_STDOUT": "outfile.5",
        "GRID_CONSOLE_STDERR": "errfile.5",
        "GRID_CONSOLE_STDIN": "infile.5",
        "GRID_CONSOLE_RETRY_LIMIT": "5",
        "GRID_CONSOLE_RETRY_TIMEOUT": "1",
        "GCWRAP_SPOOL": str(spool_dir),
    }
    w = Wrapper(["--", "sh", "-c", "cat; echo to-stderr >&2; exit 4"], env=env)
    assert w.wait(60) == 4, w.err.decode()
    assert sha256_file(home / "outfile.5") == sha256_bytes(data)
    assert (home / "errfile.5").read_bytes() == b"to-stderr\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["../x", "/etc/x", "a/../../x", "a/..", ".gcshadow/state.db"])
def test_bad_name_refused_by_the_agent(shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path,
                                       name: str) -> None:
    marker = tmp_path / "ran"
    w = Wrapper([*wrap_args(shadow, spool_dir, "bad"), "--stdout", name, "--", "touch", str(marker)])
    assert w.wait(30) == 2
    assert b"--stdout" in w.err and (b".." in w.err or b"absolute" in w.err or b"state directory" in w.err)
    assert not marker.exists(), "the job does not start with a bad NAME"
    assert not (tmp_path / "x").exists() and not Path("/etc/x").exists()


@pytest.mark.timeout(60)
def test_symlink_out_of_root_refused_by_the_shadow(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                   tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (home / "link").symlink_to(outside)
    (home / "file-link").symlink_to(outside / "target")
    for name in ("link/x", "file-link"):
        w = Wrapper([*wrap_args(shadow, spool_dir, f"sym-{name}"), "--stdout", name, "--", "echo", "hello"])
        assert w.wait(30) == 123, w.err.decode()
        assert b"symlink" in w.err and b"PATH_FORBIDDEN" in w.err
    assert list(outside.iterdir()) == [], "nothing written outside the root"


@pytest.mark.timeout(60)
def test_file_owned_by_an_active_job_is_refused(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                tmp_path: Path) -> None:
    started = tmp_path / "started"
    a = Wrapper([*wrap_args(shadow, spool_dir, "owner"), "--stdout", "shared.out", "--", "sh", "-c",
                 f"echo first; touch {started}; sleep 30"])
    wait_until(lambda: started.exists() and file_size(home / "shared.out") > 0, 30, "job A to write")
    b = Wrapper([*wrap_args(shadow, spool_dir, "intruder"), "--stdout", "shared.out", "--", "echo", "second"])
    assert b.wait(40) == 123
    assert b"belongs to job owner" in b.err
    assert (home / "shared.out").read_bytes() == b"first\n"
    os.killpg(a.proc.pid, signal.SIGTERM)
    assert a.wait(30) == 128 + signal.SIGTERM, "SIGTERM was forwarded to the job"


@pytest.mark.timeout(60)
def test_unnamed_streams_pass_through(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    w = Wrapper([*wrap_args(shadow, spool_dir, "pass"), "--stdout", "p.out", "--", "sh", "-c",
                 "echo out; echo err >&2"])
    assert w.wait(30) == 0
    assert (home / "p.out").read_bytes() == b"out\n"
    assert w.err.startswith(b"err\n"), "stderr with no NAME goes to gcwrap's own stderr"


@pytest.mark.timeout(60)
def test_same_name_merges_stdout_and_stderr(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    w = Wrapper([*wrap_args(shadow, spool_dir, "merged"), "--stdout", "both", "--stderr", "both", "--", "sh", "-c",
                 "echo one; echo two >&2; echo three"])
    assert w.wait(30) == 0, w.err.decode()
    assert (home / "both").read_bytes() == b"one\ntwo\nthree\n"


@pytest.mark.timeout(60)
def test_command_not_found(shadow: ShadowProc, spool_dir: Path) -> None:
    w = Wrapper([*wrap_args(shadow, spool_dir, "nf"), "--stdout", "nf.out", "--", "/nonexistent/program"])
    assert w.wait(30) == 127
    assert b"cannot run /nonexistent/program" in w.err
    assert list(spool_dir.glob("*.spool")) == []


@pytest.mark.timeout(120)
def test_resume_after_wrapper_killed(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    port = _free_port()
    done = tmp_path / "done"
    job = genjob(3 * MB, 500_000, seed=41, done_file=done)
    w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir), "--job-id", "orphan",
                 "--retry-timeout", "1", "--stdout", "orphan.out", "--stderr", "orphan.err", "--", *job])
    wait_until(done.exists, 60, "the job to finish")
    wait_until(lambda: str(spool_status(spool_dir)[0]["state"]).startswith("exited"), 30,
               "the spool to record the exit")
    w.kill9()
    (st,) = spool_status(spool_dir)
    assert st["state"] == "exited 0" and not st["active"]
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    sh.start(port)
    try:
        res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--retry-timeout", "1"],
                             capture_output=True, timeout=60)
    finally:
        sh.stop()
    assert res.returncode == 0, res.stderr.decode()
    assert b"all output delivered" in res.stderr
    # Through a pipe: no progress bar (test_operator.py checks the bar on a terminal).
    assert res.stderr.decode() == f"gcwrap: job orphan: all output delivered to 127.0.0.1:{port}\n", res.stderr
    assert sha256_file(home / "orphan.out") == expected(3 * MB, 41)
    assert sha256_file(home / "orphan.err") == expected(500_000, 42)
    assert list(spool_dir.glob("*.spool")) == []


@pytest.mark.timeout(60)
def test_gives_up_after_retry_limit_at_job_end(home: Path, spool_dir: Path) -> None:
    port = _free_port()
    started = time.monotonic()
    w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir), "--job-id", "nohome",
                 "--retry-timeout", "0.2", "--retry-limit", "3", "--stdout", "x.out", "--", "echo", "lost?"])
    assert w.wait(30) == 122
    assert time.monotonic() - started < 20
    text = w.err.decode()
    assert "retry limit reached" in text and "gcwrap resume --spool" in text and "status 0" in text
    (st,) = spool_status(spool_dir)
    assert st["streams"][0]["pending"] == len(b"lost?\n")  # type: ignore[index]


@pytest.mark.timeout(60)
def test_quiet_prints_nothing_on_success(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    w = Wrapper([*wrap_args(shadow, spool_dir, "hush"), "-q", "--stdout", "q.out", "--stderr", "q.err", "--",
                 "sh", "-c", "echo out; echo err >&2"])
    assert w.wait(30) == 0
    assert w.err == b"" and w.out == b""
    assert (home / "q.out").read_bytes() == b"out\n" and (home / "q.err").read_bytes() == b"err\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_spool_directory_that_is_a_file(shadow: ShadowProc, home: Path, tmp_path: Path, where: str) -> None:
    """`--spool` names a file, or a path through one: no spool can be made
    there, so, as for any directory that cannot be used, the job runs and
    its output goes home from memory (before: for a file, a usage error,
    exit 2, and the job never ran). It is said once (before: twice, the
    second time when the commit loop first tried the spool again)."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory\n")
    spool = afile if where == "a file" else afile / "sub"
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool), "--job-id", "filespool", "--stdout", "f.out",
                 "--", *genjob(2 * MB, 0, seed=43)])
    assert w.wait(60) == 0, w.err.decode()
    text = w.err.decode()
    why = f"{afile} exists and is not a directory" if where == "a file" else "a part of the path is a file"
    assert why in text and "the job runs anyway, its output goes home from memory" in text, text
    assert text.count(why) == 1 and text.count("cannot create spool") == 1, text
    assert "Traceback" not in text
    assert sha256_file(home / "f.out") == expected(2 * MB, 43)
    assert afile.read_text() == "not a directory\n"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["--shadow", "BYPASS_SHADOW_HOST/PORT"])
@pytest.mark.parametrize("home_is", ["down", "up"])
def test_a_shadow_with_no_stream_named_is_a_plain_pass_through(home: Path, spool_dir: Path, tmp_path: Path,
                                                               how: str, home_is: str) -> None:
    """A shadow is known (the batch environment's BYPASS_SHADOW_HOST/PORT,
    or --shadow) but no stream is named: nothing is to be delivered. The
    job's streams pass through, gcwrap makes no spool nor live file, never
    waits for the shadow (up or down: it never connects), and exits with the
    job's status; at -v it says once that nothing goes to the shadow (before:
    "output waits in memory (no spool)", retries up to the retry limit,
    exit 122, a `.spool.live` file left behind)."""
    spool_dir.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    port = sh.start()
    if home_is == "down":
        sh.stop()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRID_CONSOLE_", "GCWRAP_", "BYPASS_"))}
    args = ["--spool", str(spool_dir), "--retry-timeout", "5"]
    if how == "--shadow":
        args += ["--shadow", f"127.0.0.1:{port}"]
    else:
        env.update(BYPASS_SHADOW_HOST="127.0.0.1", BYPASS_SHADOW_PORT=str(port))
    try:
        started = time.monotonic()
        quiet = Wrapper([*args, "--", "sh", "-c", "echo out; echo err >&2; exit 3"], env=env)
        assert quiet.wait(30) == 3, quiet.err.decode()
        assert time.monotonic() - started < 10, "never waits for the shadow"
        assert quiet.out == b"out\n" and quiet.err == b"err\n", quiet.err.decode()
        told = Wrapper(["-v", *args, "--", "sh", "-c", "echo out; echo err >&2"], env=env)
        assert told.wait(30) == 0, told.err.decode()
        assert told.out == b"out\n"
        lines = told.err.decode().splitlines()
        assert "err" in lines
        said = [line for line in lines if "nothing goes to the shadow" in line]
        assert said == [(f"gcwrap: no stream is named (--stdout, --stderr, --stdin): nothing goes to the shadow at "
                         f"127.0.0.1:{port}, the job's streams pass through")], lines
        assert not any("retrying" in line or "refused" in line for line in lines), lines
    finally:
        sh.stop()
    assert list(spool_dir.iterdir()) == [], "no spool, no live file"
    if home_is == "up":
        jobs = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                              text=True, timeout=30)
        assert jobs.returncode == 0 and json.loads(jobs.stdout) == [], "no job at home: gcwrap never said HELLO"
