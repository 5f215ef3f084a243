"""`gcshadow prune`: finished jobs are forgotten (and with --files their
files removed), never a running or disconnected one, nor a file another job
writes now; --dry-run changes nothing. Real processes, beside a running
shadow, with the root's own state and with PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import ShadowProc, Wrapper, _children, tool, wait_until

from gcwrap.wire.events import Error, ErrorCode, Event, Hello, StreamSpec, Welcome
from gcwrap.wire.protocol import NEED_DATA, Connection, Role

pytestmark = pytest.mark.timeout(120)

HOLD = [sys.executable, "-c", "import sys, time; print('started', flush=True); time.sleep(60)"]


@pytest.fixture
def site(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Site]:
    state = request.getfixturevalue("pg_url") if request.param == "postgresql" else ""
    s = Site(tmp_path, state)
    try:
        yield s
    finally:
        Wrapper.kill_leftovers()
        s.shadow.stop()


class Site:
    """A shadow serving a root, and the commands run on it."""

    def __init__(self, tmp: Path, state: str) -> None:
        self.tmp, self.state = tmp, state
        self.home = tmp / "home"
        self.home.mkdir()
        (tmp / "logs").mkdir()
        self.shadow = ShadowProc(self.home, tmp / "logs", extra=["--state", state] if state else [])
        self.shadow.start()

    def args(self) -> list[str]:
        return ["--root", str(self.home), *(["--state", self.state] if self.state else [])]

    def run(self, job_id: str, name: str, job: list[str] | None = None) -> Wrapper:
        return Wrapper(["--shadow", self.shadow.address, "--spool", str(self.tmp / "spool"), "--job-id", job_id,
                        "--retry-timeout", "0.2", "--retry-limit", "2", "--stdout", name, "--",
                        *(job or ["echo", f"output of {job_id}"])])

    def jobs(self) -> dict[str, dict[str, Any]]:
        out = subprocess.run([*tool("gcshadow"), "jobs", *self.args(), "--json"], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        return {j["job_id"]: j for j in json.loads(out.stdout)}

    def prune(self, *extra: str) -> dict[str, Any]:
        out = subprocess.run([*tool("gcshadow"), "prune", *self.args(), "--json", *extra], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        found: dict[str, Any] = json.loads(out.stdout)
        return found

    def pruned(self, *extra: str) -> dict[str, dict[str, Any]]:
        return {p["job_id"]: p for p in self.prune(*extra)["jobs"]}

    def wait_state(self, job_id: str, state: str) -> None:
        wait_until(lambda: self.jobs().get(job_id, {}).get("state") == state, 30, f"job {job_id} {state}")


def _finished(site: Site, job_id: str, name: str) -> None:
    w = site.run(job_id, name)
    assert w.wait(30) == 0, w.err
    assert (site.home / name).read_text() == f"output of {job_id}\n"


@pytest.mark.parametrize("site", ["sqlite", "postgresql"], indirect=True)
def test_prune_forgets_finished_jobs_only(site: Site) -> None:
    _finished(site, "old", "old.out")
    _finished(site, "gone", "gone.out")
    _finished(site, "shared", "shared.out")
    site.run("running", "running.out", HOLD)  # (killed when the test ends)
    site.wait_state("running", "streaming")
    # A disconnected job: its agent killed mid-job (the shadow records the connection lost).
    lost = site.run("lost", "lost.out", HOLD)
    site.wait_state("lost", "streaming")
    job_pids = _children(lost.proc.pid)
    os.kill(lost.proc.pid, signal.SIGKILL)
    for pid in job_pids:  # (the job runs in a process group of its own, and holds gcwrap's pipes)
        os.killpg(pid, signal.SIGKILL)
    lost.proc.communicate(timeout=10)
    site.wait_state("lost", "disconnected")
    # Another job writes shared.out now: it is that job's file.
    site.run("owner", "shared.out", HOLD)
    site.wait_state("owner", "streaming")
    before = site.jobs()

    # Nothing finished an hour ago; --dry-run says what would go, and changes nothing.
    assert site.pruned("--finished-before", "1h", "--files") == {}
    dry = site.prune("--finished-before", "0s", "--files", "--dry-run")
    assert dry["dry_run"] is True
    would = {p["job_id"]: p for p in dry["jobs"]}
    assert set(would) == {"old", "gone", "shared"}, would
    assert would["gone"]["removed"] == ["gone.out"] and would["shared"]["kept"] == ["shared.out"], would
    assert site.jobs().keys() == before.keys()
    assert all((site.home / n).exists() for n in ("old.out", "gone.out", "shared.out"))

    # Without --files: the state forgets the job, its file stays.
    assert set(site.pruned("--finished-before", "0s", "--files", "--dry-run")) == {"old", "gone", "shared"}
    pruned = site.pruned("--finished-before", "0s")
    assert set(pruned) == {"old", "gone", "shared"} and pruned["old"]["removed"] == [], pruned
    listed = site.jobs()
    assert set(listed) == {"running", "lost", "owner"}, listed
    assert listed["running"]["state"] == "streaming" and listed["lost"]["state"] == "disconnected"
    assert (site.home / "old.out").read_text() == "output of old\n"

    # With --files: a finished job's file goes; one another job writes now stays.
    _finished(site, "done", "done.out")
    _finished(site, "again", "shared2.out")
    pruned = site.pruned("--finished-before", "0s", "--files")
    assert set(pruned) == {"done", "again"}, pruned
    assert pruned["done"]["removed"] == ["done.out"] and not (site.home / "done.out").exists()
    assert not (site.home / "shared2.out").exists()
    assert (site.home / "running.out").read_text() == "started\n", "a running job's file is never touched"
    assert (site.home / "shared.out").exists() and (site.home / "lost.out").exists()
    assert set(site.jobs()) == {"running", "lost", "owner"}
    assert site.pruned("--finished-before", "0s", "--files") == {}, "nothing left to forget"


@pytest.mark.parametrize("site", ["sqlite"], indirect=True)
def test_prune_leaves_a_job_seen_since_it_finished_and_reads_durations(site: Site) -> None:
    """A finished job whose agent came back (seen since it ended) is left
    alone; --finished-before 1h takes jobs that ended more than an hour
    ago, and leaves a file written after its job ended (someone else's)."""
    _finished(site, "back", "back.out")
    _finished(site, "aged", "aged.out")
    _finished(site, "touched", "touched.out")
    db = sqlite3.connect(site.home / ".gcshadow" / "state.db", timeout=10)
    with db:
        db.execute("UPDATE jobs SET last_seen = ended + 5 WHERE job_id = 'back'")
        db.execute("UPDATE jobs SET ended = ended - 7200, last_seen = last_seen - 7200 WHERE job_id != 'back'")
    db.close()
    st = (site.home / "aged.out").stat()
    os.utime(site.home / "aged.out", (st.st_atime - 7200, st.st_mtime - 7200))
    out = subprocess.run([*tool("gcshadow"), "prune", *site.args(), "--finished-before", "1h", "--files"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "forgot job aged" in out.stdout and "removed aged.out" in out.stdout, out.stdout
    assert "kept touched.out" in out.stdout, out.stdout
    assert "2 job(s) forgotten, 1 file(s) removed" in out.stdout, out.stdout
    assert not (site.home / "aged.out").exists() and (site.home / "touched.out").exists()
    assert site.pruned("--finished-before", "0s") == {}, "the job seen since it finished stays"
    assert set(site.jobs()) == {"back"}


def _hello(port: int, job_id: str, instance: str, name: str) -> Event:
    """What the shadow answers a HELLO of this job and attempt (an agent come back)."""
    conn = Connection(Role.AGENT)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(conn.send(Hello(job_id, instance, (StreamSpec(1, "stdout", name),))))
        while True:
            data = sock.recv(65536)
            conn.receive_data(data)
            ev = conn.next_event()
            if ev is not NEED_DATA or not data:
                assert isinstance(ev, Event), ev
                return ev


@pytest.mark.parametrize("site", ["sqlite"], indirect=True)
def test_prune_files_a_job_wrote_and_an_attempt_forgotten_comes_back(site: Site,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    work = site.tmp / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (site.home / "in.txt").write_text("input\n")
    w = Wrapper(["--shadow", site.shadow.address, "--spool", str(site.tmp / "spool"), "--job-id", "files",
                 "--retry-timeout", "0.2", "--retry-limit", "2", "--stdout", "files.out", "--stdin", "in.txt",
                 "--file", "res.txt=res/res.txt", "--", "sh", "-c", "cat; echo result > res.txt"])
    assert w.wait(30) == 0, w.err
    assert (site.home / "res" / "res.txt").read_text() == "result\n"
    leftover = site.home / "res" / ".res.txt.gcwrap-1-2"  # (a staging file a crash left behind)
    leftover.write_text("partial")
    unrelated = site.home / "res" / ".res.txt.gcwrap-9-1"  # (not a file number of the job's)
    unrelated.write_text("other")
    instance = site.jobs()["files"]["instance"]
    pruned = site.pruned("--finished-before", "0s", "--files")
    assert sorted(pruned["files"]["removed"]) == ["files.out", "res/.res.txt.gcwrap-1-2", "res/res.txt"], pruned
    assert not leftover.exists() and unrelated.exists()
    assert (site.home / "in.txt").read_text() == "input\n", "a job's stdin is never removed"
    # The forgotten attempt's agent comes back: refused for good, nothing started afresh.
    (site.home / "files.out").write_text("kept at home\n")
    ev = _hello(site.shadow.port, "files", instance, "files.out")
    assert isinstance(ev, Error) and ev.code is ErrorCode.STALE_ATTEMPT, ev
    assert (site.home / "files.out").read_text() == "kept at home\n"
    assert "files" not in site.jobs()


@pytest.mark.parametrize("site", ["sqlite", "postgresql"], indirect=True)
def test_prune_leaves_a_finished_job_whose_agent_is_back(site: Site) -> None:
    """A finished job's agent reconnects (its EXIT's answer was lost): while
    it is connected, and after, prune leaves the job alone."""
    _finished(site, "back", "back.out")
    instance = site.jobs()["back"]["instance"]
    conn = Connection(Role.AGENT)
    with socket.create_connection(("127.0.0.1", site.shadow.port), timeout=10) as sock:
        sock.sendall(conn.send(Hello("back", instance, (StreamSpec(1, "stdout", "back.out"),))))
        ev: Any = NEED_DATA
        while ev is NEED_DATA:
            data = sock.recv(65536)
            assert data, "the shadow closed the connection"
            conn.receive_data(data)
            ev = conn.next_event()
        assert isinstance(ev, Welcome), ev
        assert site.pruned("--finished-before", "0s", "--files") == {}
    assert site.pruned("--finished-before", "0s", "--files") == {}
    assert (site.home / "back.out").read_text() == "output of back\n"
    assert "back" in site.jobs()
