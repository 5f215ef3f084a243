"""What an operator sees: gcwrap status, gcshadow jobs / tail, summaries.

Real spools and a real shadow in each state; rich output rendered to a
fixed-width console and checked cell by cell.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from faults import Tmpfs, need_tmpfs
from helpers import (
    ShadowProc,
    Wrapper,
    as_user,
    expected,
    file_size,
    genjob,
    sha256_file,
    spool_status,
    tool,
    wait_until,
)
from rich.console import Console

from gcwrap.cli import main as gcwrap_main
from gcwrap.render import (
    UNLIMITED,
    job_detail,
    jobs_table,
    jobs_view,
    print_view,
    status_details,
    status_table,
    status_view,
)
from gcwrap.shadow_cli import main as gcshadow_main

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
        # Nothing could be spooled: what the job wrote is lost, and gcwrap says so.
        assert w.wait(60) == 121, w.err.decode()
        (st,) = spool_status(fs.path)
        assert st["job_id"] == "lastword" and not st["active"]
        assert st["state"] == "gave-up, job killed by signal 15", st
        assert "retry limit" in str(st["reason"]) and "retry limit" in str(st["last_error"])
        # The loss, which the spool could not record either, comes from the live file.
        (out,) = st["streams"]  # type: ignore[misc]
        assert out["lost"] > 0 and out["lost_from"] == 0 and out["written"] == out["lost"], out
        assert f"LOST: the last {out['lost']:,} bytes of stdout (offsets 0 to {out['lost']:,})" in w.err.decode()


@pytest.mark.timeout(120)
def test_status_in_every_state(home: Path, shadow_down: ShadowProc, tmp_path: Path) -> None:
    need_tmpfs()
    port = shadow_down.port  # home is down for the whole test
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
        assert killed.wait(60) == 121, killed.err.decode()  # (the tail held in memory is lost)
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
        text = render(status_table(list(states.values())))
        assert row_of(text, "ended")[1:6] == ["gave-up, job exited 3", "stdout e.out", "5 B", "0 B", "5 B"]
        assert row_of(text, "running")[1:6] == ["running", "stdout r.out", "3 B", "0 B", "3 B"]
        assert row_of(text, "paused")[1] == "paused"
        details = "\n".join(status_details(states.values()))
        assert f"ended: shadow 127.0.0.1:{port} (not connected)" in details
        assert "connection refused" in details
        # SIGTERM reaches the whole job (a shell's children too); a second
        # one stops delivery at once and keeps the spool.
        for w in (running, paused):
            w.proc.terminate()
        for w, spool_at in ((running, spools), (paused, fs.path)):
            job_id = "running" if w is running else "paused"
            wait_until(lambda job_id=job_id, spool_at=spool_at: any(
                s["job_id"] == job_id and str(s["state"]).startswith("killed") for s in spool_status(spool_at)),
                30, f"{job_id} to end")
            w.proc.terminate()
            # (the paused job's output, held in memory, is lost: 121 comes first)
            assert w.wait(30) == (122 if w is running else 121), w.err.decode()
            assert b"SIGTERM received: delivery stopped after a second signal; not yet home: " in w.err
        assert b"gcwrap resume --spool" in running.err and b"LOST" not in running.err
        # the paused job never had room for its output: gcwrap says what was lost
        assert b"LOST: the last " in paused.err and b"bytes of stdout (offsets " in paused.err


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
    res = subprocess.run([*tool("gcshadow"), "tail", "--all", "--root", str(home)], capture_output=True, timeout=30,
                         check=False)
    lines = set(res.stdout.decode().splitlines())
    assert {f"[j{i} stdout] out {i}" for i in range(3)} <= lines
    assert {f"[j{i} stderr] err {i}" for i in range(3)} <= lines


@pytest.mark.timeout(120)
def test_jobs_table_and_detail(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "done-7", "--stdout", "d.out",
                 "--", "sh", "-c", "echo 123456789; exit 7"])
    assert w.wait(30) == 7
    data = json.loads(CliRunner().invoke(gcshadow_main, ["jobs", "--json", "--root", str(home)]).output)
    text = render(jobs_table(data))
    cells = row_of(text, "done-7")
    assert cells[2] == "finished with status 7" and cells[3] == "10 B"
    res = CliRunner().invoke(gcshadow_main, ["jobs", "--root", str(home), "done-7"])
    assert res.exit_code == 0
    assert "finished with status 7" in res.output
    # The I/O summary in words, not as the agent's keys.
    assert "stdout written: 10 B (10 bytes)" in res.output and "failed connection attempts: 0" in res.output
    summary = res.output.split("I/O summary")[1].split("timeline:")[0]  # (the timeline's kinds are keys)
    assert "summary" not in res.output.replace("I/O summary", "") and "_" not in summary
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["--spool, absent", "--spool, empty", "GCWRAP_SPOOL", "default"])
@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_status_with_no_spools(tmp_path: Path, where: str, terminal: bool) -> None:
    """No spool: one line saying so and where gcwrap looked, exit 0 (before:
    an empty table, captioned "no spools", and no directory named);
    `--json` prints an empty list."""
    directory = tmp_path / "none" if where == "--spool, absent" else tmp_path / f"gcwrap-{os.getuid()}"
    if where != "--spool, absent":
        directory.mkdir()
    args = ["--spool", str(directory)] if where.startswith("--spool") else []
    env = {k: v for k, v in os.environ.items() if k not in ("GCWRAP_SPOOL", "_CONDOR_SCRATCH_DIR", "SLURM_TMPDIR")}
    env.update(TMPDIR=str(tmp_path), COLUMNS="100" if terminal else "", **(
        {"GCWRAP_SPOOL": str(directory)} if where == "GCWRAP_SPOOL" else {}))
    res = subprocess.run([*tool("gcwrap"), "status", *args], capture_output=True, text=True, timeout=30, env=env)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout == f"no spools in {directory}\n", res.stdout
    res = subprocess.run([*tool("gcwrap"), "status", "--json", *args], capture_output=True, text=True, timeout=30,
                         env=env)
    assert res.returncode == 0 and json.loads(res.stdout) == [], res.stdout


@pytest.mark.timeout(60)
def test_status_and_resume_of_spools_that_cannot_be_read(tmp_path: Path) -> None:
    """A spool damaged inside (its streams' page), a file that is no
    database, a `*.spool` that is a directory: `gcwrap status` lists each as
    unreadable with the reason, `gcwrap resume` says one line for each and
    exits 125; never a traceback."""
    spools = tmp_path / "spools"
    ok = Wrapper(["--shadow", "127.0.0.1:9", "--spool", str(spools), "--job-id", "dmg", "--retry-limit", "1",
                  "--retry-timeout", "0.1", "--stdout", "d.out", "--stderr", "d.err", "--", "sh", "-c",
                  "echo out; echo err >&2"])
    assert ok.wait(30) == 122, ok.err.decode()
    (damaged,) = spools.glob("*.spool")
    data = bytearray(damaged.read_bytes())
    page = 3  # the streams table's (schema, _migrations and job come first)
    data[page * 4096 + 8 : (page + 1) * 4096] = bytes((i * 7919) % 256 for i in range(4096 - 8))
    damaged.write_bytes(bytes(data))
    (spools / "garbage.spool").write_bytes(b"not a database " * 300)
    (spools / "folder.spool").mkdir()
    status = subprocess.run([*tool("gcwrap"), "status", "--json", "--spool", str(spools)], capture_output=True,
                            text=True, timeout=30)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    listed = {Path(s["spool"]).name: s for s in json.loads(status.stdout)}
    assert set(listed) == {damaged.name, "garbage.spool", "folder.spool"}
    for name, spool in listed.items():
        assert spool["state"] == "unreadable", spool
        assert str(spools / name) in spool["last_error"], spool
    assert "damaged" in listed[damaged.name]["last_error"]
    text = subprocess.run([*tool("gcwrap"), "status", "--spool", str(spools)], capture_output=True, text=True,
                          timeout=30)
    assert text.returncode == 0 and "Traceback" not in text.stderr and text.stdout.count("unreadable") == 3
    resume = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spools), "--retry-limit", "1",
                             "--retry-timeout", "0.1"], capture_output=True, text=True, timeout=60)
    assert resume.returncode == 125, resume.stderr
    assert "Traceback" not in resume.stderr
    lines = resume.stderr.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("gcwrap: ") for line in lines), lines
    for name in (damaged.name, "garbage.spool", "folder.spool"):
        assert sum(name in line for line in lines) == 1, (name, lines)


# -- 80 columns and pipes: no field broken, fewer columns when narrow ----------------------------------------

NOW = 1_800_000_000.0
SPOOLS = [
    {"job_id": "slurm-4242_17", "state": "wrapper gone",
     "spool": "/var/tmp/gcwrap/slurm-4242_17-0123456789abcdef.spool",
     "shadow": "home.example.org:50000", "connected": False, "retries": 12, "spool_bytes": 123 << 20,
     "disk_free": 40 << 30, "last_error": "connection refused by the shadow home.example.org:50000",
     "streams": [{"kind": "stdout", "name": "results/cased2/out.txt", "appended": 123456789, "acked": 12345678,
                  "pending": 111111111, "oldest_pending_s": 33.0},
                 {"kind": "stderr", "name": "results/cased2/err.txt", "appended": 1234, "acked": 1234, "pending": 0,
                  "oldest_pending_s": None}]},
    {"job_id": "example-5", "state": "gave-up, job exited 0", "spool": "/tmp/gcwrap-0/example-5-8bbff00b7be44662.spool",
     "shadow": "127.0.0.1:50000", "connected": False, "retries": 4, "spool_bytes": 64 << 10, "disk_free": None,
     "last_error": "", "streams": [{"kind": "stdout", "name": "late/out.5", "appended": 6, "acked": 0, "pending": 6,
                                    "oldest_pending_s": 3.0}]},
]
JOBS = [
    {"job_id": "slurm-4242_17", "host": "node017.cluster", "state": "finished", "reason": "", "exit_code": 0,
     "exit_signal": None, "first_seen": NOW - 100, "last_seen": NOW - 5, "ended": NOW - 5,
     "summary": {"job_started": str(NOW - 110), "job_ended": str(NOW - 10)}, "command": ["sim", "--steps", "9"],
     "user": "alice", "peer": "10.0.0.17:40312", "instance": "0123456789abcdef",
     "streams": [{"kind": "stdout", "name": "results/cased2/out.txt", "durable": 123456789},
                 {"kind": "stderr", "name": "results/cased2/err.txt", "durable": 1234}]},
    {"job_id": "example-5", "host": "vm", "state": "finished", "reason": "retry limit reached", "exit_code": None,
     "exit_signal": 15, "first_seen": NOW - 100, "last_seen": NOW - 5, "ended": NOW - 5, "summary": {},
     "streams": [{"kind": "stdout", "name": "late/out.5", "durable": 6}]},
    {"job_id": "live-1", "host": "vm", "state": "disconnected", "reason": "", "exit_code": None, "exit_signal": None,
     "first_seen": NOW - 60, "last_seen": NOW - 30, "ended": None, "summary": {},
     "streams": [{"kind": "stdout", "name": "a/very/long/directory/name/for/the/output/of/this/job.out",
                  "durable": 2 << 20}]},
]
# Fields that must each stay whole on one line, whatever the width.
STATUS_FIELDS = ["slurm-4242_17", "wrapper gone", "results/cased2/out.txt", "117.7 MiB", "106.0 MiB", "11.8 MiB",
                 "gave-up, job exited 0", "late/out.5", "33s", "home.example.org:50000",
                 "/var/tmp/gcwrap/slurm-4242_17-0123456789abcdef.spool",
                 "/tmp/gcwrap-0/example-5-8bbff00b7be44662.spool"]
JOBS_FIELDS = ["slurm-4242_17", "finished with status 0", "results/cased2/out.txt", "117.7 MiB", "1.2 MiB/s",
               "killed by retry limit (signal 15)", "node017.cluster", "disconnected since 30s ago",
               "a/very/long/directory/name/for/the/output/of/this/job.out", "5s ago", "2.0 MiB"]


def rendered(view: object, width: int | None, terminal: bool = True) -> list[str]:
    buf = io.StringIO()
    console = Console(file=buf, width=width or UNLIMITED, force_terminal=terminal, color_system=None)
    print_view(console, view)  # type: ignore[arg-type]
    return [line.rstrip() for line in buf.getvalue().splitlines()]


@pytest.mark.parametrize("width", [40, 60, 80, 100, 120, 200, None])
@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_status_and_jobs_keep_every_field_whole_at_any_width(width: int | None, terminal: bool) -> None:
    """Every name, size and state is on one line; no line is wider than the
    screen; at 80 columns a job takes at most 3 lines. (Before: a table
    folded at any width, "cased2/out.\\ntxt", "wrapper\\ngone", 6-7 lines a job.)"""
    views = [(status_view(SPOOLS, width), STATUS_FIELDS, SPOOLS),
             (jobs_view(JOBS, None, NOW, width), JOBS_FIELDS, JOBS)]
    for view, fields, items in views:
        lines = rendered(view, width, terminal)
        text = "\n".join(lines)
        # (Narrower layouts leave the written and acknowledged figures out: those must be whole where shown.)
        shown = [f for f in fields if f not in ("117.7 MiB", "11.8 MiB") or "written" in text]
        broken = [f for f in shown if not any(f in line for line in lines)]
        assert not broken, f"broken across lines at width {width}: {broken}\n{text}"
        if width is not None:  # (a field wider than the screen has a line of its own, and overflows it)
            assert all(len(line) <= width or line.strip() in fields for line in lines), text
        if items is JOBS and width is not None and width >= 80:
            body = [line for line in lines if line.strip() and not set(line.strip()) <= set("┏┳━┓┡╇┩└┴─┘")
                    and "gcshadow jobs" not in line and "┃ job" not in line]
            most = sum(2 + len(j["streams"]) for j in JOBS)  # type: ignore[arg-type]
            assert len(body) <= most, f"{len(body)} lines for {len(JOBS)} jobs at {width}:\n{text}"
        if width is None:  # through a pipe: one line per stream row, for grep
            assert any("slurm-4242_17" in line and "results/cased2/out.txt" in line for line in lines), text


def test_narrow_screens_get_fewer_columns_then_a_line_per_job() -> None:
    wide = "\n".join(rendered(status_view(SPOOLS, 200), 200))
    assert "written" in wide and "acked" in wide
    middle = "\n".join(rendered(status_view(SPOOLS[1:], 80), 80))
    assert "pending" in middle and "written" not in middle and "┃ job" in middle, middle
    narrow = rendered(jobs_view(JOBS, None, NOW, 60), 60)
    assert not any(c in "\n".join(narrow) for c in "┃│"), "a line per job below the narrowest table"
    assert narrow[0].startswith("slurm-4242_17: finished with status 0;"), narrow
    assert "  stdout results/cased2/out.txt 117.7 MiB" in narrow


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_job_detail_keeps_fields_whole(width: int) -> None:
    lines = rendered(job_detail(JOBS[0], None, NOW, width), width)
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= width, text
    for field in ("results/cased2/out.txt", "117.7 MiB", "finished with status 0", "node017.cluster"):
        assert any(field in line for line in lines), f"{field!r} broken at {width}:\n{text}"


@pytest.mark.timeout(120)
def test_status_and_jobs_through_a_pipe(shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """The real commands, their stdout a pipe: a row per line (for grep), as
    wide as it takes; with COLUMNS=60, the narrow layout, names whole.
    `gcshadow jobs` through a pipe gives tab-separated rows a script can cut
    (a header line, then a row per job; no box drawing), whatever COLUMNS says."""
    name = "results/a-rather-long-directory/cased2/out.txt"
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "piped-job-with-a-long-id",
                 "--stdout", name, "--", "sh", "-c", "echo hello; exit 3"])
    assert w.wait(30) == 3
    left = tmp_path / "left"  # a spool left behind: its shadow never answered
    w = Wrapper(["--shadow", "127.0.0.1:9", "--spool", str(left), "--job-id", "left-behind", "--retry-limit", "1",
                 "--retry-timeout", "0.1", "--stdout", name, "--", "echo", "hi"])
    assert w.wait(30) == 122
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    for columns in ("", "60"):
        rows = subprocess.run([*tool("gcshadow"), "jobs", "--root", str(home)], capture_output=True, text=True,
                              timeout=60, env={**env, "COLUMNS": columns} if columns else env, check=True).stdout
        head, *body = [line.split("\t") for line in rows.splitlines()]
        assert head == ["job", "host", "state", "bytes", "rate", "last_seen", "streams"] and len(body) == 1, rows
        job, _host, state, size, rate, _seen, streams = body[0]
        assert (job, state, size, streams) == ("piped-job-with-a-long-id", "finished with status 3", "6",
                                               f"stdout {name} 6"), rows
        assert float(rate) > 0 and not set(rows) & set("│┃━─"), rows
    for argv, key in (([*tool("gcwrap"), "status", "--spool", str(left)], "left-behind"),):
        wide = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=True).stdout
        row = [line for line in wide.splitlines() if key in line and "│" in line]
        assert len(row) == 1 and name in row[0] and ("status 3" in row[0] or "gave-up" in row[0]), wide
        narrow = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**env, "COLUMNS": "60"},
                                check=True).stdout
        # (A path longer than the screen has a line of its own.)
        assert all(len(line) <= 60 or " " not in line.strip() for line in narrow.splitlines()), narrow
        assert any(name in line for line in narrow.splitlines()) and any(key in line for line in narrow.splitlines())


# -- gcshadow names a root it cannot use, and tells root errors from address errors ---------------------------


def serve_fails(args: list[str], user: int | None = None, timeout: float = 30) -> str:
    """gcshadow serve exits 1 at once; its error line."""
    # As an unprivileged user, the way a home machine runs it.
    prefix = as_user(user) if user is not None else []
    res = subprocess.run([*prefix, *tool("gcshadow"), "serve", "--port", "0", *args], capture_output=True,
                         text=True, timeout=timeout, check=False)
    assert res.returncode == 1, (res.returncode, res.stderr)
    (error,) = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    return error


@pytest.mark.timeout(60)
def test_unwritable_root_is_named_not_the_address(tmp_path: Path) -> None:
    """Before: `cannot serve on 127.0.0.1:0: Permission denied`."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run gcshadow as another user")
    nobody = 65534
    # (Not under tmp_path: pytest keeps that closed to other users.)
    top = Path(tempfile.mkdtemp(prefix="gcshadow-root-test-", dir="/tmp"))
    try:
        top.chmod(0o755)
        locked = top / "locked"
        locked.mkdir()
        error = serve_fails(["--root", str(locked)], user=nobody)
        assert error == f"Error: the root {locked} is not writable by this user (nobody, uid {nobody})", error
        error = serve_fails(["--root", str(locked / "sub")], user=nobody)
        assert error == (f"Error: cannot create the root {locked / 'sub'}: no permission to create it in {locked} "
                         f"(as nobody, uid {nobody})"), error
        error = serve_fails(["--root", str(tmp_path / "home")], user=nobody)
        assert error.startswith(f"Error: cannot reach the root {tmp_path / 'home'}: ") and "is closed to this user" \
            in error, error
    finally:
        shutil.rmtree(top)


@pytest.mark.timeout(60)
def test_root_on_a_read_only_file_system_is_named(tmp_path: Path) -> None:
    need_tmpfs()
    with Tmpfs(tmp_path / "ro", "1m") as fs:
        fs.remount(readonly=True)
        error = serve_fails(["--root", str(fs.path)])
    assert error == f"Error: the root {fs.path} is on a read-only file system", error


def test_root_under_proc_sys_is_named() -> None:
    """Before: `cannot serve on 127.0.0.1:0: No such file or directory`."""
    error = serve_fails(["--root", "/proc/sys/gcshadow-root"])
    assert error == ("Error: cannot create the root /proc/sys/gcshadow-root: /proc/sys does not take new "
                     "directories (No such file or directory)"), error
    error = serve_fails(["--root", "/proc/sys"])
    assert error.startswith("Error: the root /proc/sys is not writable") or "/proc/sys" in error, error
    assert "127.0.0.1" not in error


def test_root_that_is_a_file_is_named(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = subprocess.run([*tool("gcshadow"), "serve", "--port", "0", "--root", str(afile)], capture_output=True,
                         text=True, timeout=30, check=False)
    assert res.returncode == 2 and f"'{afile}' is a file" in res.stderr, res.stderr
    error = serve_fails(["--root", str(afile / "below")])
    assert error == f"Error: cannot reach the root {afile / 'below'}: {afile} is not a directory", error


def test_port_in_use_is_named_with_what_to_do(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        error = serve_fails(["--port", str(port), "--root", str(tmp_path / "r")])
    assert error == (f"Error: cannot listen on 127.0.0.1:{port}: Address already in use (another program has it: "
                     "choose another --port, or --port 0 for any free one)"), error


def state_commands() -> list[str]:
    """Every gcshadow command that takes --state."""
    assert isinstance(gcshadow_main, click.Group)
    return sorted(name for name, cmd in gcshadow_main.commands.items()
                  if any("--state" in getattr(p, "opts", ()) for p in cmd.params))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("url", ["mysql://x", "bogus", "mysql://gc:s3cret@db/x"])
@pytest.mark.parametrize("command", state_commands())
def test_every_command_refuses_a_state_it_cannot_use(home: Path, command: str, url: str) -> None:
    """A --state that names no state gcshadow knows is refused in one line,
    exit 1, by every command that takes --state, as `serve` does (before:
    `jobs` and `tail` read the root's own state instead and exited 0), its
    password never shown."""
    assert {"serve", "jobs", "tail", "web"} <= set(state_commands())
    args = {"serve": ["--port", "0"], "tail": ["somejob"], "web": ["--port", "0"]}.get(command, [])
    for how in ("option", "environment"):
        state = ["--state", url] if how == "option" else []
        env = {**os.environ, "GCSHADOW_STATE": url} if how == "environment" else None
        res = subprocess.run([*tool("gcshadow"), command, "--root", str(home), *args, *state], capture_output=True,
                             text=True, timeout=60, env=env)
        shown = url.replace(":s3cret", "")
        assert res.stderr.splitlines() == [(f"Error: --state {shown}: not a state this shadow knows "
                                            "(postgresql://HOST/DATABASE, or sqlite for the root's own)")], res.stderr
        assert res.returncode == 1 and res.stdout == "", (how, res.stdout)


def test_port_errors_say_the_valid_range() -> None:
    """Before: `'abc' is not a valid integer range`."""
    for value in ("abc", "70000", "-1"):
        res = CliRunner().invoke(gcshadow_main, ["serve", "--port", value])
        assert res.exit_code == 2 and "is not a port number: give 0-65535 (0: any free port)" in res.output, res.output
    res = CliRunner().invoke(gcwrap_main, ["--shadow", "h:abc", "--", "true"])
    assert res.exit_code == 2 and "the port must be a number, 1-65535" in res.output, res.output


@pytest.mark.timeout(60)
def test_the_shadows_log_lines_have_timestamps(shadow: ShadowProc, spool_dir: Path) -> None:
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "stamped", "--stdout", "s.out",
                 "--", "echo", "hi"])
    assert w.wait(30) == 0
    shadow.stop()
    lines = [line for line in shadow.log().splitlines() if line.strip()]
    assert any("job stamped finished with status 0" in line for line in lines)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} gcshadow: "
    assert all(re.match(stamp, line) for line in lines), lines
    first = time.mktime(time.strptime(lines[0][:19], "%Y-%m-%d %H:%M:%S"))
    assert abs(first - time.time()) < 120, "local time, now"


# -- -v and -vv, watching one job, the resume bar, the demo through a pipe ------------------------------------


@pytest.mark.timeout(60)
def test_verbose_shows_connections_offsets_and_commits(shadow: ShadowProc, spool_dir: Path) -> None:
    """On a normal run: nothing but the summary by default; -v adds the job's
    start and end, the connection (addresses, time), what home held when it
    welcomed us, the connection's end and the delivery; -vv adds each commit.
    (Before, -v and -vv added nothing on a normal run.)"""
    job = ["--", "sh", "-c", "echo out; echo err >&2; sleep 0.2; echo more"]
    runs = {}
    for flags in ([], ["-v"], ["-vv"]):
        w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", f"verbose{len(flags)}",
                     "--stdout", f"v{len(flags)}.out", "--stderr", f"v{len(flags)}.err", *flags, *job])
        assert w.wait(30) == 0
        runs[len(flags) and len(flags[0]) - 1] = w.err.decode().splitlines()
    quiet, v, vv = runs[0], runs[1], runs[2]
    assert [line for line in quiet if not line.startswith("gcwrap:   ")] == [
        "gcwrap: job verbose0 ended with status 0; " + quiet[0].split("; ", 1)[1]]
    text = "\n".join(v)
    assert re.search(r"job verbose1 started: pid \d+, spool \S+\.spool", text), text
    assert re.search(rf"connected to {re.escape(shadow.address)} from 127\.0\.0\.1:\d+ in \d\.\d{{3}} s \(attempt 1\)",
                     text), text
    assert re.search(r"welcomed by the shadow \(connection 1\): it holds 0 of \d+ bytes of stdout \(v1.out\), "
                     r"0 of \d+ bytes of stderr \(v1.err\); sending from there", text), text
    assert re.search(r"the job ended with status 0 after \d+\.\d s; \d+ bytes not yet home", text), text
    assert re.search(rf"connection to {re.escape(shadow.address)} closed after \d+\.\d s", text), text
    assert "the shadow holds every byte and the exit status: stdout 9 bytes, stderr 4 bytes" in text, text
    assert not any("spool commit" in line for line in v)
    commits = [line for line in vv if "spool commit in" in line]
    assert any("bytes in" in line and "row(s)" in line for line in commits), vv
    assert any("acknowledged up to stdout" in line for line in commits), vv
    assert any("the end of stdout" in line or "the end of stderr, stdout" in line for line in commits), vv


@pytest.mark.timeout(60)
def test_verbose_says_why_it_reconnects(home: Path, shadow_down: ShadowProc, spool_dir: Path, tmp_path: Path) -> None:
    sh, port = shadow_down, shadow_down.port
    w = Wrapper(["-v", "--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir), "--job-id", "why",
                 "--retry-timeout", "0.3", "--stdout", "w.out", "--", "sh", "-c", "echo a; sleep 1.5; echo b"])
    time.sleep(1)
    try:
        sh.start(port)
        assert w.wait(30) == 0
    finally:
        sh.stop()
    text = w.err.decode()
    assert "connection refused by the shadow" in text and re.search(r"next attempt in \d+\.\d s", text), text
    assert re.search(r"\(attempt [2-9]\d*\)", text), text
    # the first connection after an outage is not "again"
    assert re.search(r"connected to the shadow for the first time after \d+\.\d s; delivering the backlog", text), text
    assert "again" not in text


@pytest.mark.timeout(60)
def test_jobs_watch_one_job(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    """`gcshadow jobs -w JOB` keeps showing that job (before: -w was ignored
    and it exited at once), with the rate its bytes arrive at."""
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "watched", "--stdout", "w.out",
                 "--", *genjob(3 * MB, 0, seed=7, rate=1 * MB)])
    wait_until(lambda: file_size(home / "w.out") > 0, 30, "output at home")
    watch = subprocess.Popen([*tool("gcshadow"), "jobs", "--root", str(home), "-w", "--interval", "0.3", "watched"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.5)
        assert watch.poll() is None, "it keeps watching"
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=10)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    assert watch.returncode == 0, err
    views = out.count("job watched")
    assert views >= 4, out  # one view per refresh (a pipe gets them one after another)
    rates = [float(m) for m in re.findall(r"([\d.]+) KiB/s now", out)] + \
        [float(m) * 1024 for m in re.findall(r"([\d.]+) MiB/s now", out)]
    assert rates and max(rates) > 200, out  # 1 MB/s written: KiB/s now, not an average from the start
    assert "slurm" not in out and "state" in out
    assert w.wait(30) == 0


@pytest.mark.timeout(90)
def test_resume_shows_a_bar_on_a_terminal_only(home: Path, shadow_down: ShadowProc, tmp_path: Path) -> None:
    """Through a pipe: no bar, no "?" rate, just the outcome (before: a bar
    with rate "?" in every log). On a terminal: the bar."""
    import pty

    sh, port = shadow_down, shadow_down.port
    outputs = []
    for terminal in (False, True):
        spool = tmp_path / f"spool-{terminal}"
        w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool), "--job-id", f"bar-{terminal}",
                     "--retry-limit", "1", "--retry-timeout", "0.1", "--stdout", f"bar-{terminal}.out", "--",
                     "echo", "hello"])
        assert w.wait(30) == 122
        sh.start(port)
        try:
            if terminal:
                leader, follower = pty.openpty()
                res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool)], stdout=subprocess.PIPE,
                                     stderr=follower, timeout=60, check=False)
                os.close(follower)
                chunks = []
                while True:
                    try:
                        data = os.read(leader, 65536)
                    except OSError:
                        break
                    if not data:
                        break
                    chunks.append(data)
                os.close(leader)
                err = b"".join(chunks).decode(errors="replace")
            else:
                res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool)], capture_output=True,
                                     timeout=60, check=False)
                err = res.stderr.decode()
        finally:
            sh.stop()
        assert res.returncode == 0, err
        outputs.append(err)
    piped, terminal_err = outputs
    assert piped == f"gcwrap: job bar-False: all output delivered to 127.0.0.1:{port}\n", piped
    assert "━" in terminal_err and "bar-True" in terminal_err, terminal_err
    assert "6/6 bytes" in terminal_err, "the bar reached the end"
    assert " ? " not in terminal_err and "all output delivered" in terminal_err


@pytest.mark.timeout(120)
def test_demo_through_a_pipe_keeps_its_lines_whole() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    res = subprocess.run([*tool("gcwrap"), "demo", "--size", "1MiB"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=100, env=env, check=False)
    assert res.returncode == 0, res.stdout
    lines = res.stdout.splitlines()
    sums = [line for line in lines if "sha256" in line]
    assert len(sums) == 2 and all(re.search(r": +[0-9a-f]{64}$", line) for line in sums), res.stdout
    assert not any("━" in line for line in lines), "no progress bar in a pipe"
    assert any(re.fullmatch(r"arrived at home: 1,048,576 of 1,048,576 bytes in \d+\.\d s \(\d+\.\d MB/s\)", line)
               for line in lines), res.stdout


@pytest.mark.timeout(120)
def test_a_full_spool_is_said_once_not_at_every_commit(shadow: ShadowProc, home: Path, tmp_path: Path) -> None:
    """A spool on a nearly full tmpfs, the network up, a job faster than
    delivery: the spool takes a little each time acknowledgements free some.
    gcwrap says "cannot take more bytes" once and does not flip back and forth
    (before: 20 such lines and 2 "takes output again" in 0.4 s), and says
    nothing of pauses that are mere flow control while home is reachable."""
    need_tmpfs()
    with Tmpfs(tmp_path / "spool", "8m") as fs:
        fs.fill(leave=2 << 20)
        w = Wrapper(["--shadow", shadow.address, "--spool", str(fs.path), "--job-id", "hyst", "--memory-limit",
                     "1MiB", "--stdout", "h.out", "--stderr", "h.err", "--", *genjob(12 * MB, 12 * MB, seed=9)])
        assert w.wait(90) == 0, w.err.decode()
    text = w.err.decode()
    said = [line for line in text.splitlines() if not line.startswith("gcwrap:   ")]
    assert len([line for line in said if "output goes home from memory" in line]) == 1, text
    assert len([line for line in said if "the spool takes output again" in line]) <= 1, text
    assert not [line for line in said if "paused" in line or "resumes" in line], text
    assert sha256_file(home / "h.out") == expected(12 * MB, 9) and sha256_file(home / "h.err") == expected(12 * MB, 10)


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


def test_status_counts_output_held_only_in_memory_in_the_oldest_pending(tmp_path: Path) -> None:
    """A full spool keeps a stream's output in memory, where the spool's rows
    cannot date it: the running gcwrap's live file says when its oldest byte
    held only in memory was read, and `gcwrap status` takes the older of that
    and the spool's oldest row (before: no age at all for such a stream)."""
    import fcntl

    from gcwrap.agent.records import JobRecord
    from gcwrap.agent.spool import Spool
    from gcwrap.status import read_spool

    path = tmp_path / "j.spool"
    Spool.create(path, JobRecord("j", "1", ["true"]), [(1, "stdout", "out"), (2, "stderr", "err")]).close()
    now = time.time()
    live = {"t": now, "state": "paused", "streams": {
        "1": {"written": 5000, "acked": 0, "memory_only": 5000, "memory_since": now - 30.0, "lost": 0},
        "2": {"written": 0, "acked": 0, "memory_only": 0, "memory_since": None, "lost": 0}}}
    Path(f"{path}.live").write_text(json.dumps(live))
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a running gcwrap holds it
        info = read_spool(path)
    finally:
        os.close(fd)
    by_kind = {s["kind"]: s for s in info["streams"]}
    assert by_kind["stdout"]["pending"] == 5000 and by_kind["stdout"]["memory_only"] == 5000
    assert 30.0 <= by_kind["stdout"]["oldest_pending_s"] <= 31.0, by_kind["stdout"]
    assert by_kind["stderr"]["oldest_pending_s"] is None, "nothing pending"
