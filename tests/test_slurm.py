"""gcwrap as the job wrapper under a real single-node Slurm cluster.

tests/slurm/start-slurm.sh starts slurmctld, slurmd and a private munged (all
state in a temporary directory, on free ports); tests/slurm/stop-slurm.sh
stops them by PID. The jobs stream to a gcshadow on loopback, and every check
compares sha256 of what a job wrote with what landed at home:

- a 3-task array job lands byte-exact under its templated names while it runs,
  and `gcshadow jobs` shows the Slurm job ids and exit statuses;
- `scancel`: the output up to the cancellation is at home, the job is recorded
  as killed by SIGTERM;
- `scontrol requeue`: the new attempt starts afresh, as documented; with %n in
  a NAME each attempt has its own file, without it the file holds exactly the
  last attempt's stream;
- the one-file bundle (`gcwrap bundle`) shipped to the node with sbcast and
  run by a Python with no packages lands byte-exact.

Needs root; installs the Debian packages (slurmctld slurmd slurm-client munge)
when they are missing, and skips with the reason when it cannot.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import GENJOB, ShadowProc, file_size, sha256_bytes, sha256_file, tool, wait_until

pytestmark = pytest.mark.root

SCRIPTS = Path(__file__).parent / "slurm"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED",
         "DEADLINE"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def installed(name: str) -> str:
    """The console script itself (not a version manager's shim), for a job's clean environment."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else tool(name)[0]


@dataclass
class Slurm:
    dir: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}: {done.stderr}\n{self.logs()}"
        return done.stdout

    def sbatch(self, script: Path, *options: str) -> str:
        return self.run("sbatch", "--parsable", *options, str(script)).strip().split(";")[0]

    def tasks(self, job: str) -> dict[str, dict[str, str]]:
        """Task id ("-" for a job that is no array) -> JobState, ExitCode, Restarts, JobId."""
        out: dict[str, dict[str, str]] = {}
        for line in self.run("scontrol", "-o", "show", "job", job).splitlines():
            fields = dict(re.findall(r"(?:^| )(JobId|ArrayTaskId|JobState|ExitCode|Restarts)=(\S*)", line))
            task = fields.get("ArrayTaskId", "-")
            if task == "-" or task.isdigit():
                out[task] = fields
        return out

    def state(self, job: str, task: str = "-") -> str:
        return self.tasks(job).get(task, {}).get("JobState", "")

    def logs(self) -> str:
        text = []
        for log in sorted((self.dir / "log").glob("*.log")):
            last = log.read_text(errors="replace").splitlines()[-15:]
            text.append(f"--- {log.name} (last lines)\n" + "\n".join(last))
        return "\n".join(text)


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    if os.geteuid() != 0:
        pytest.skip("needs root: starts slurmctld, slurmd and munged (and installs them with apt-get if missing)")
    # Not under pytest's tmp_path: munged wants every directory on the way to its socket searchable by all.
    base = Path(tempfile.mkdtemp(prefix="gcwrap-slurm-", dir="/tmp"))
    env = {**os.environ, "SLURM_DIR": str(base), "SLURM_CONF_FILE": str(base / "slurm.conf"),
           "SLURM_CONF": str(base / "slurm.conf"), "SLURMCTLD_PORT": str(free_port()),
           "SLURMD_PORT": str(free_port())}
    try:
        started = time.monotonic()
        try:
            done = subprocess.run(["bash", str(SCRIPTS / "start-slurm.sh")], env=env, capture_output=True, text=True,
                                  timeout=600, check=False)
        except subprocess.TimeoutExpired:
            pytest.fail("tests/slurm/start-slurm.sh did not finish in 600 s")
        if done.returncode == 3:
            pytest.skip(f"Slurm is not installed and could not be installed: {done.stderr.strip()}")
        assert done.returncode == 0, f"start-slurm.sh exited {done.returncode}:\n{done.stdout}{done.stderr}"
        print(f"Slurm cluster up in {time.monotonic() - started:.1f} s")
        yield Slurm(base, env)
    finally:
        subprocess.run(["bash", str(SCRIPTS / "stop-slurm.sh")], env=env, capture_output=True, timeout=120,
                       check=False)
        shutil.rmtree(base, ignore_errors=True)


def write_script(path: Path, *lines: str) -> Path:
    path.write_text("#!/bin/bash\nset -u\n" + "\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def gcwrap_line(shadow: ShadowProc, names: list[str], job: str) -> str:
    """`exec gcwrap ... -- JOB`: exec, so gcwrap is the batch step's own process and Slurm waits for it."""
    quoted = " ".join(shlex.quote(n) for n in names)
    return f"exec {installed('gcwrap')} --shadow {shadow.address} --retry-timeout 1 {quoted} -- {job}"


def genjob_line(out: int, err: int, seed: str, rate: int, *extra: str) -> str:
    args = [*GENJOB, "--out", str(out), "--err", str(err), "--rate", str(rate)]
    return " ".join(shlex.quote(a) for a in args) + f" --seed {seed} " + " ".join(extra)


def stream(n: int, seed: int) -> bytes:
    """The bytes tests/jobs/genjob.py writes to a stream of n bytes with this seed."""
    return random.Random(seed).randbytes(n)


def stdout_after_each_write(total: int, seed: int) -> list[int]:
    """Bytes genjob.py --out TOTAL --err 0 has written to stdout after each write (its chunk sizes)."""
    sizes = random.Random(seed + 2)
    pos, out = 0, []
    while pos < total:
        pos += min(total - pos, sizes.choice((1, 100, 4096, 65536, 200000)))
        out.append(pos)
    return out


def submit(slurm: Slurm, script: Path, tmp_path: Path, *options: str) -> str:
    """sbatch with the job's Slurm output and its spools ($SLURM_TMPDIR, the default spool's parent) in tmp_path."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    return slurm.sbatch(script, *options, f"--chdir={tmp_path}", f"--export=ALL,SLURM_TMPDIR={scratch}")


def shadow_jobs(home: Path) -> dict[str, dict[str, object]]:
    done = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True, text=True,
                          timeout=60, check=True)
    return {j["job_id"]: j for j in json.loads(done.stdout)}


def slurm_out(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(tmp_path.glob("slurm-*.out")))


# -- a 3-task array job --------------------------------------------------------------------------------


OUT, ERR, RATE = 300_000, 30_000, 100_000  # about 3.3 s per task


@pytest.mark.timeout(240)
def test_array_job_streams_each_task_under_its_templated_name(
    slurm: Slurm, shadow: ShadowProc, home: Path, tmp_path: Path
) -> None:
    script = write_script(
        tmp_path / "array.sh",
        "task=$SLURM_ARRAY_TASK_ID",
        gcwrap_line(shadow, ["--stdout", "slurm/%j.%a.out", "--stderr", "slurm/%j.%a.err"],
                    genjob_line(OUT, ERR, "$((1000 + 10 * task))", RATE, "--exit", "$task",
                                "--done-file", f"{tmp_path}/done.$task")),
    )
    started = time.monotonic()
    job = submit(slurm, script, tmp_path, "--array=0-2", f"--output={tmp_path}/slurm-%A_%a.out")
    spool_dir = tmp_path / "scratch" / f"gcwrap-{os.getuid()}"  # $SLURM_TMPDIR/gcwrap-UID, the default

    # While the tasks run: bytes at home before the job has finished writing them all, and the spools in
    # $SLURM_TMPDIR/gcwrap-UID.
    early: set[int] = set()
    spooled: set[str] = set()

    def all_ended() -> bool:
        for task in range(3):
            if task not in early:
                size = file_size(home / f"slurm/{job}.{task}.out")
                if size > 0 and not (tmp_path / f"done.{task}").exists():
                    early.add(task)  # read before the done-file: these bytes were home while the job wrote
        if spool_dir.is_dir():
            spooled.update(p.name for p in spool_dir.glob("*.spool"))
        tasks = slurm.tasks(job)
        return len(tasks) == 3 and all(t["JobState"] in ENDED for t in tasks.values())

    wait_until(all_ended, 150, f"array job {job} to end", interval=0.05)
    elapsed = time.monotonic() - started
    tasks = slurm.tasks(job)
    states = {t: tasks[t]["JobState"] for t in tasks}
    assert states == {"0": "COMPLETED", "1": "FAILED", "2": "FAILED"}, slurm_out(tmp_path)
    # gcwrap passes the job's status through to Slurm
    assert {t: tasks[t]["ExitCode"] for t in tasks} == {"0": "0:0", "1": "1:0", "2": "2:0"}
    assert early == {0, 1, 2}, f"no bytes seen at home while tasks {sorted({0, 1, 2} - early)} were writing"
    assert any(name.startswith(f"slurm-{job}_") for name in spooled), f"no spool in $SLURM_TMPDIR: {spooled}"
    assert list(spool_dir.glob("*.spool")) == [], "delivered spools are removed"

    jobs = shadow_jobs(home)
    for task in range(3):
        seed = 1000 + 10 * task
        assert sha256_file(home / f"slurm/{job}.{task}.out") == sha256_bytes(stream(OUT, seed)), slurm_out(tmp_path)
        assert sha256_file(home / f"slurm/{job}.{task}.err") == sha256_bytes(stream(ERR, seed + 1))
        rec = jobs[f"slurm-{job}_{task}"]
        assert rec["state"] == "finished" and rec["exit_code"] == task and rec["exit_signal"] is None
        names = {s["kind"]: (s["name"], s["durable"]) for s in rec["streams"]}  # type: ignore[attr-defined]
        assert names == {"stdout": (f"slurm/{job}.{task}.out", OUT), "stderr": (f"slurm/{job}.{task}.err", ERR)}
    assert sorted(p.name for p in (home / "slurm").iterdir()) == sorted(
        f"{job}.{t}.{s}" for t in range(3) for s in ("out", "err"))
    print(f"array job {job}: 3 tasks byte-exact at home in {elapsed:.1f} s")


# -- scancel --------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_scancel_keeps_output_up_to_the_cancellation(
    slurm: Slurm, shadow: ShadowProc, home: Path, tmp_path: Path
) -> None:
    total, seed = 5_000_000, 77  # 50 s at this rate: cancelled long before the end
    stamps = tmp_path / "writes"
    script = write_script(
        tmp_path / "cancel.sh",
        gcwrap_line(shadow, ["--stdout", "cancel/%j.out"],
                    genjob_line(total, 0, str(seed), 100_000, "--timestamps", str(stamps))),
    )
    job = submit(slurm, script, tmp_path, f"--output={tmp_path}/slurm-%j.out")
    out = home / f"cancel/{job}.out"
    wait_until(lambda: file_size(out) >= 100_000, 60, "100 kB of the job at home")
    assert slurm.state(job) == "RUNNING"
    slurm.run("scancel", job)
    wait_until(lambda: slurm.state(job) in ENDED, 60, f"job {job} to end after scancel")
    assert slurm.state(job) == "CANCELLED"

    def recorded() -> bool:
        rec = shadow_jobs(home).get(f"slurm-{job}", {})
        return rec.get("state") == "finished"

    wait_until(recorded, 10, "the shadow to record the job's end")
    rec = shadow_jobs(home)[f"slurm-{job}"]
    assert rec["exit_signal"] == signal.SIGTERM and rec["exit_code"] is None, rec
    got = out.read_bytes()
    # everything gcwrap read from the job is home, byte-exact: a prefix of the job's stream ...
    assert got == stream(total, seed)[: len(got)], "the file at home is not a prefix of the job's stream"
    assert len(got) == int(rec["summary"]["stdout_bytes"]), rec["summary"]  # type: ignore[index]
    # ... and it holds at least every write the job had finished before it was killed
    writes = len(stamps.read_text().splitlines())
    after = stdout_after_each_write(total, seed)
    assert writes >= 1 and after[writes - 1] <= len(got) < total, (writes, len(got))
    assert b"ended with status 143" in (tmp_path / f"slurm-{job}.out").read_bytes(), slurm_out(tmp_path)


# -- scontrol requeue -------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_requeue_starts_a_fresh_attempt_without_mixing_bytes(
    slurm: Slurm, shadow: ShadowProc, home: Path, tmp_path: Path
) -> None:
    out_n, err_n = 400_000, 40_000
    # Each attempt writes other bytes (its seed depends on the attempt), so mixed bytes would show.
    script = write_script(
        tmp_path / "requeue.sh",
        "attempt=${SLURM_RESTART_COUNT:-0}",
        gcwrap_line(shadow, ["--stdout", "requeue/%j.%n.out", "--stderr", "requeue/%j.err"],
                    genjob_line(out_n, err_n, "$((100 + 100 * attempt))", 100_000)),
    )
    job = submit(slurm, script, tmp_path, "--requeue", f"--output={tmp_path}/slurm-%j.out", "--open-mode=append")
    first, err = home / f"requeue/{job}.0.out", home / f"requeue/{job}.err"
    wait_until(lambda: file_size(first) > 0 and file_size(err) > 0, 60, "attempt 0's stdout and stderr at home")
    assert slurm.state(job) == "RUNNING"
    slurm.run("scontrol", "requeue", job)

    # Slurm holds a requeued job back until its old credential expires (cred_expire=5 in start-slurm.sh).
    def restarted() -> bool:
        task = slurm.tasks(job)["-"]
        return task["Restarts"] == "1" and task["JobState"] in ENDED

    wait_until(restarted, 90, f"job {job} to be requeued, run again and end", interval=0.2)
    assert slurm.state(job) == "COMPLETED", "\n".join(
        [slurm_out(tmp_path), slurm.run("scontrol", "show", "job", job), slurm.logs()])

    # attempt 0 (%n = 0): a clean prefix of its own stream, cut short by the requeue
    got = first.read_bytes()
    assert 0 < len(got) < out_n and got == stream(out_n, 100)[: len(got)]
    # attempt 1 (%n = 1): its whole stream in a file of its own
    assert sha256_file(home / f"requeue/{job}.1.out") == sha256_bytes(stream(out_n, 200))
    # no %n: the new attempt replaced the old one's bytes; the file is exactly attempt 1's stderr
    assert sha256_file(err) == sha256_bytes(stream(err_n, 201)), "stderr mixes two attempts"
    rec = shadow_jobs(home)[f"slurm-{job}"]
    assert rec["state"] == "finished" and rec["exit_code"] == 0
    names = {s["kind"]: (s["name"], s["durable"]) for s in rec["streams"]}  # type: ignore[attr-defined]
    assert names == {"stdout": (f"requeue/{job}.1.out", out_n), "stderr": (f"requeue/{job}.err", err_n)}
    # attempt 0 ended by Slurm's SIGTERM and delivered all it had read before it exited (no spool left), then
    # attempt 1 ran to its end. (A spool an old attempt leaves behind is refused: see test_batch.py.)
    log = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert "ended with status 143" in log and "ended with status 0" in log, log
    assert f"job slurm-{job} finished with signal 15" in shadow.log()
    assert list((tmp_path / "scratch" / f"gcwrap-{os.getuid()}").glob("*.spool")) == []


# -- the one-file bundle shipped with the job -----------------------------------------------------------


@pytest.mark.timeout(180)
def test_bundle_shipped_with_the_job_by_sbcast(slurm: Slurm, shadow: ShadowProc, home: Path, tmp_path: Path) -> None:
    """`gcwrap bundle`'s file, copied to the node by sbcast and run by a Python with no packages (`-I`, a venv
    without pip or the system's packages), instead of the installed gcwrap."""
    pyz = tmp_path / "gcwrap.pyz"
    subprocess.run([installed("gcwrap"), "bundle", "-o", str(pyz)], check=True, capture_output=True, timeout=120)
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    out_n, err_n = 300_000, 30_000
    shipped = "/tmp/gcwrap-$SLURM_JOB_ID.pyz"
    script = write_script(
        tmp_path / "bundle.sh",
        f"export XDG_CACHE_HOME={shlex.quote(str(tmp_path / 'cache'))}",
        f'sbcast --force {shlex.quote(str(pyz))} "{shipped}" || exit 99',
        f'trap \'rm -f "{shipped}"\' EXIT',
        f'{venv}/bin/python3 -I "{shipped}" --shadow {shadow.address} --retry-timeout 1 '
        f"--stdout 'bundle/%j.out' --stderr 'bundle/%j.err' -- {genjob_line(out_n, err_n, '77', 200_000)}",
    )
    job = submit(slurm, script, tmp_path, f"--output={tmp_path}/slurm-%j.out")
    wait_until(lambda: slurm.state(job) in ENDED, 120, f"job {job} to end", interval=0.2)
    assert slurm.state(job) == "COMPLETED", "\n".join([slurm_out(tmp_path), slurm.logs()])
    assert sha256_file(home / f"bundle/{job}.out") == sha256_bytes(stream(out_n, 77)), slurm_out(tmp_path)
    assert sha256_file(home / f"bundle/{job}.err") == sha256_bytes(stream(err_n, 78))
    rec = shadow_jobs(home)[f"slurm-{job}"]
    assert rec["state"] == "finished" and rec["exit_code"] == 0
    assert not Path(f"/tmp/gcwrap-{job}.pyz").exists()
