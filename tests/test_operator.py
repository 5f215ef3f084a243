"""What an operator sees: gcwrap status, gcshadow jobs / tail, summaries.

Real spools and a real shadow in each state; rich output rendered to a
fixed-width console and checked cell by cell.
"""

from __future__ import annotations

import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from faults import Tmpfs, need_tmpfs
from gcwrap.cli import main as gcwrap_main
from gcwrap.render import jobs_table, status_details, status_table
from gcwrap.shadow_cli import main as gcshadow_main
from helpers import ShadowProc, Wrapper, file_size, genjob, spool_status, tool, wait_until

MB = 1_000_000


def render(table: object, width: int = 200) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=True, color_system=None).print(table)
    return buf.getvalue()


def row_of(text: str, key: str) -> list[str]:
    """The cells of the table row that starts with `key`."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0] == key:
            return cells
    raise AssertionError(f"no row {key!r} in:\n{text}")


@pytest.mark.timeout(120)
def test_status_tells_the_final_state_when_the_disk_refused_the_last_commit(home: Path, tmp_path: Path) -> None:
    """64 KiB free: the spool is made, but there is no room for its ballast or
    its final commit. The live file (preallocated, rewritten in place) still
    gets the final state, and `gcwrap status` reports it, not "wrapper gone"."""
    need_tmpfs()
    with Tmpfs(tmp_path / "tiny", "4m") as fs:
        fs.fill(leave=64 << 10)
        w = Wrapper(["--shadow", "127.0.0.1:9", "--spool", str(fs.path), "--job-id", "lastword",
                     "--retry-limit", "3", "--retry-timeout", "0.1", "--memory-limit", "1MiB",
                     "--stdout", "k.out", "--", *genjob(20 * MB, 0, seed=5)])
        assert w.wait(60) == 124, w.err.decode()
        (st,) = spool_status(fs.path)
        assert st["job_id"] == "lastword" and not st["active"]
        assert st["state"] == "gave-up, job killed by signal 15", st
        assert "retry limit" in str(st["reason"]) and "retry limit" in str(st["last_error"])


@pytest.mark.timeout(120)
def test_status_in_every_state(home: Path, tmp_path: Path) -> None:
    need_tmpfs()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    port = sh.start()
    sh.stop()  # home is down for the whole test
    spools = tmp_path / "spools"
    # exited with pending bytes (gave up at the end)
    ended = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spools), "--job-id", "ended",
                     "--retry-limit", "2", "--retry-timeout", "0.1", "--stdout", "e.out", "--", "sh", "-c",
                     "printf 12345; exit 3"])
    assert ended.wait(30) == 122
    # running: a job that sleeps with some output spooled
    running = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spools), "--job-id", "running",
                       "--retry-limit", "0", "--retry-timeout", "0.2", "--stdout", "r.out", "--", "sh", "-c",
                       "printf abc; sleep 60"])
    with Tmpfs(tmp_path / "small", "4m") as fs:
        # Room for both jobs' spool skeletons (live file, ballast, database, WAL), not for their output.
        fs.fill(leave=512 << 10)
        # paused: the disk is full and home is down, so backpressure holds the job
        paused = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(fs.path), "--job-id", "paused",
                          "--retry-limit", "0", "--retry-timeout", "0.2", "--memory-limit", "1MiB",
                          "--stdout", "p.out", "--", *genjob(20 * MB, 0, seed=3)])
        # killed by the retry limit with both paths failing
        killed = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(fs.path), "--job-id", "killed",
                          "--retry-limit", "3", "--retry-timeout", "0.1", "--memory-limit", "1MiB",
                          "--stdout", "k.out", "--", *genjob(20 * MB, 0, seed=4)])
        assert killed.wait(60) == 124
        wait_until(lambda: any(s["job_id"] == "paused" and s["state"] == "paused" for s in spool_status(fs.path)),
                   30, "the paused state")
        wait_until(lambda: any(s["job_id"] == "running" and s["streams"][0]["appended"] == 3  # type: ignore[index]
                               for s in spool_status(spools)), 30, "the running job's spool")
        states = {s["job_id"]: s for s in spool_status(spools) + spool_status(fs.path)}
        assert states["ended"]["state"] == "gave-up, job exited 3"
        assert states["ended"]["streams"][0]["pending"] == 5  # type: ignore[index]
        assert states["running"]["state"] == "running" and states["running"]["active"]
        assert states["running"]["streams"][0]["pending"] == 3  # type: ignore[index]
        assert states["paused"]["state"] == "paused" and states["paused"]["active"]
        assert "disk" in str(states["paused"]["last_error"]) or "refused" in str(states["paused"]["last_error"])
        assert states["killed"]["state"] == "gave-up, job killed by signal 15"
        assert "retry limit" in str(states["killed"]["reason"])
        # the table says the same
        text = render(status_table(Console(), list(states.values())))
        assert row_of(text, "ended")[1:6] == ["gave-up, job exited 3", "stdout e.out", "5 B", "0 B", "5 B"]
        assert row_of(text, "running")[1:6] == ["running", "stdout r.out", "3 B", "0 B", "3 B"]
        assert row_of(text, "paused")[1] == "paused"
        details = "\n".join(status_details(states.values()))
        assert f"ended: shadow 127.0.0.1:{port} (not connected)" in details
        assert "connection refused" in details
        # SIGTERM reaches the whole job (a shell's children too); a second
        # one, once the job has ended, stops delivery and keeps the spool.
        for w in (running, paused):
            w.proc.terminate()
        for w, spool_at in ((running, spools), (paused, fs.path)):
            job_id = "running" if w is running else "paused"
            wait_until(lambda: any(s["job_id"] == job_id and str(s["state"]).startswith("killed")
                                   for s in spool_status(spool_at)), 30, f"{job_id} to end")
            w.proc.terminate()
            assert w.wait(30) == 122
            assert b"received after the job ended: delivery stopped" in w.err
        assert b"gcwrap resume --spool" in running.err
        # the paused job never had room for a spool: gcwrap says what was lost
        assert b"could neither be spooled nor delivered and are lost" in paused.err


@pytest.mark.timeout(120)
def test_tail_follows_a_live_job_quickly_and_ends_with_it(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    script = ("import sys, time\n"
              "for i in range(60):\n"
              "    print(f'{time.time():.6f} line {i}', flush=True)\n"
              "    time.sleep(0.05)\n")
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "live", "--stdout", "live.out",
                 "--", sys.executable, "-c", script])
    wait_until(lambda: file_size(home / "live.out") > 0, 30, "the first line at home")
    tail = subprocess.Popen([*tool("gcshadow"), "tail", "-f", "--root", str(home), "live"], stdout=subprocess.PIPE)
    delays = []
    assert tail.stdout is not None
    try:
        for line in tail.stdout:
            stamp, _, rest = line.decode().partition(" ")
            delays.append(time.time() - float(stamp))
            if rest.strip() == "line 59":
                break
        tail.wait(30)  # it ends by itself when the job ends
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
        tail.stdout.close()
    assert w.wait(30) == 0
    assert tail.returncode == 0
    live = delays[5:]  # lines written after tail started
    assert statistics.median(live) < 0.1, f"median delay {statistics.median(live):.3f} s"


@pytest.mark.timeout(120)
def test_tail_all_prefixes_each_job(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    for i in range(3):
        w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", f"j{i}",
                     "--stdout", f"j{i}.out", "--stderr", f"j{i}.err", "--", "sh", "-c",
                     f"echo out {i}; echo err {i} >&2"])
        assert w.wait(30) == 0
    res = subprocess.run([*tool("gcshadow"), "tail", "--all", "--root", str(home)], capture_output=True, timeout=30)
    lines = set(res.stdout.decode().splitlines())
    assert {f"[j{i} stdout] out {i}" for i in range(3)} <= lines
    assert {f"[j{i} stderr] err {i}" for i in range(3)} <= lines


@pytest.mark.timeout(120)
def test_jobs_table_and_detail(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "done-7", "--stdout", "d.out",
                 "--", "sh", "-c", "echo 123456789; exit 7"])
    assert w.wait(30) == 7
    data = json.loads(CliRunner().invoke(gcshadow_main, ["jobs", "--json", "--root", str(home)]).output)
    text = render(jobs_table(Console(), data))
    cells = row_of(text, "done-7")
    assert cells[2] == "finished with status 7" and cells[3] == "10 B"
    res = CliRunner().invoke(gcshadow_main, ["jobs", "--root", str(home), "done-7"])
    assert res.exit_code == 0
    assert "finished with status 7" in res.output and "summary stdout_bytes" in res.output
    res = CliRunner().invoke(gcshadow_main, ["jobs", "--root", str(home), "nope"])
    assert res.exit_code == 1 and "no job 'nope'" in res.output


def test_every_command_has_help_with_an_example() -> None:
    runner = CliRunner()
    for main, commands in ((gcwrap_main, ["run", "status", "resume", "demo"]),
                           (gcshadow_main, ["serve", "jobs", "tail"])):
        res = runner.invoke(main, ["--help"])
        assert res.exit_code == 0 and "Example" in res.output
        for name in commands:
            for flag in ("--help", "-h"):
                res = runner.invoke(main, [name, flag])
                assert res.exit_code == 0, (name, res.output)
                assert "Example" in res.output, name


def test_cli_usage_errors_are_clear() -> None:
    runner = CliRunner()
    res = runner.invoke(gcwrap_main, ["--stdout", "x", "--", "true"], env={"BYPASS_SHADOW_HOST": ""})
    assert res.exit_code == 2 and "needs a shadow" in res.output
    res = runner.invoke(gcwrap_main, ["--shadow", "nocolon", "--", "true"])
    assert res.exit_code == 2 and "is not HOST:PORT" in res.output
    res = runner.invoke(gcwrap_main, ["--shadow", "h:1", "--spool-limit", "lots", "--", "true"])
    assert res.exit_code == 2 and "is not a size" in res.output
    res = runner.invoke(gcwrap_main, ["--shadow", "h:1"])
    assert res.exit_code == 2 and "Missing argument" in res.output
    res = runner.invoke(gcwrap_main, ["--", "true"], env={"BYPASS_SHADOW_HOST": "h", "BYPASS_SHADOW_PORT": "x"})
    assert res.exit_code == 2 and "BYPASS_SHADOW_PORT" in res.output
    res = runner.invoke(gcshadow_main, ["tail", "--root", "."])
    assert res.exit_code == 2 and "name a JOB, or use --all" in res.output
    res = runner.invoke(gcwrap_main, ["--version"])
    assert res.exit_code == 0 and "gcwrap" in res.output


def test_status_with_no_spools(tmp_path: Path) -> None:
    res = CliRunner().invoke(gcwrap_main, ["status", "--spool", str(tmp_path / "none")])
    assert res.exit_code == 0 and "no spools" in res.output
    res = CliRunner().invoke(gcwrap_main, ["status", "--json", "--spool", str(tmp_path / "none")])
    assert json.loads(res.output) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dirname", ["C#1", "a?b", "50%", "%41", "two words"])
def test_jobs_and_tail_under_a_root_with_uri_characters(tmp_path: Path, dirname: str) -> None:
    """The shadow's state is read through a SQLite URI: "#", "?" and "%" in
    the root's path must not cut it short (for a root ".../C#1", `gcshadow
    jobs` opened, and created, ".../C" and found no jobs table)."""
    root, logs = tmp_path / dirname, tmp_path / "logs"
    root.mkdir()
    logs.mkdir()
    sh = ShadowProc(root, logs)
    sh.start()
    try:
        w = Wrapper(["--shadow", sh.address, "--spool", str(tmp_path / "spool"), "--job-id", "odd-root",
                     "--stdout", "odd.out", "--", "echo", "hello from an odd root"])
        assert w.wait(30) == 0, w.err.decode()
    finally:
        sh.stop()
    res = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(root)], capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr.decode()
    (job,) = json.loads(res.stdout)
    assert job["job_id"] == "odd-root" and job["state"] == "finished"
    res = subprocess.run([*tool("gcshadow"), "tail", "--root", str(root), "odd-root"], capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout == b"hello from an odd root\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dirname, "logs", "spool"]), "no stray database"
