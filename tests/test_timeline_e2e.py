"""What home sees of a job, end to end: its timeline (sessions opened and
cut, the exit, the agent's notes), the refused connections, "why", the
listing's filters and script output, and `gcshadow tail -n/-c`.

Real gcshadow and gcwrap processes on loopback, a relay that cuts
connections (tests/faults.py), an agent speaking the protocol over a real
socket (gcwrap.wire.protocol.Connection), both states (the root's SQLite,
and PostgreSQL through tests/pgserver.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from faults import Relay
from helpers import ShadowProc, Wrapper, tool, wait_until
from rawagent import RawAgent

from gcwrap.shadow.state import Store
from gcwrap.wire.events import (
    NOTES_FEATURE,
    Data,
    Done,
    Exit,
    Hello,
    Note,
    Notes,
    StreamSpec,
    Welcome,
)

# -- helpers ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def state(request: pytest.FixtureRequest) -> str:
    """The --state of a test's shadow and readers ("" for the root's own)."""
    return "" if request.param == "sqlite" else str(request.getfixturevalue("pg_url"))


def start_shadow(home: Path, tmp_path: Path, shadows: list[ShadowProc], state: str, *extra: str) -> ShadowProc:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    sh = ShadowProc(home, logs, extra=[*extra, *(["--state", state] if state else [])])
    sh.start()
    shadows.append(sh)
    return sh


def gcshadow(home: Path, state: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`gcshadow ARGS --root HOME [--state URL]` as a script runs it (its stdout a pipe)."""
    where = ["--root", str(home), *(["--state", state] if state else [])]
    return subprocess.run([*tool("gcshadow"), *args, *where], capture_output=True, text=True, timeout=60)


def jobs_json(home: Path, state: str, *args: str) -> Any:
    res = gcshadow(home, state, "jobs", "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def events_of(home: Path, state: str, job: str, source: str = "shadow") -> list[dict[str, Any]]:
    return [e for e in jobs_json(home, state, job)["events"] if e["source"] == source]


def token_file(path: Path) -> Path:
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


# -- the timeline --------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_cut_connection_shows_in_the_jobs_timeline_in_order(home: Path, tmp_path: Path, state: str,
                                                               shadows: list[ShadowProc]) -> None:
    """A real job through a relay that cuts its connection once: home's
    timeline of the job has both sessions, the cut, and the exit, in the
    order they happened, each with its time. (Before: no timeline at all.)"""
    sh = start_shadow(home, tmp_path, shadows, state)
    script = "i=0; while [ $i -lt 30 ]; do echo line $i; i=$((i+1)); sleep 0.1; done"
    began = time.time()
    with Relay(("127.0.0.1", sh.port)) as relay:
        w = Wrapper(["--shadow", f"127.0.0.1:{relay.port}", "--spool", str(tmp_path / "spool"), "--job-id", "cut-1",
                     "--stdout", "cut.out", "--retry-timeout", "0.2", "--", "sh", "-c", script])
        wait_until(lambda: b"line 3\n" in ((home / "cut.out").read_bytes() if (home / "cut.out").exists() else b""),
                   30, "the job's first lines at home")
        cut = time.time()
        with relay.lock:
            links = list(relay.links)
        for link in links:
            link.close()  # both ends see the connection end: the agent reconnects
        assert w.wait(60) == 0, w.err.decode()
    ended = time.time()
    assert (home / "cut.out").read_bytes() == b"".join(f"line {i}\n".encode() for i in range(30))
    wait_until(lambda: [e["kind"] for e in events_of(home, state, "cut-1")][-1:] == ["session_ended"], 10,
               "the last session's end recorded")
    mine = events_of(home, state, "cut-1")
    assert [(e["kind"], e["details"].get("session")) for e in mine] == [
        ("session_opened", 1), ("session_ended", 1), ("session_opened", 2), ("exit", None), ("session_ended", 2)], mine
    times = [e["time"] for e in mine]
    assert times == sorted(times) and began <= times[0] and times[-1] <= ended, (began, times, ended)
    assert times[0] < cut <= times[1] + 0.05, (cut, times)  # (the cut, as home saw it, at most moments after)
    assert mine[1]["details"]["reason"] and mine[2]["details"]["host"]
    assert mine[3]["details"] == {"code": 0, "signal": None, "reason": ""}
    text = gcshadow(home, state, "jobs", "cut-1").stdout
    assert "why: finished with status 0" in text and "timeline:" in text
    assert [line.split()[3] for line in text.splitlines() if line.startswith("  20") and " home " in line] == [
        "session_opened", "session_ended", "session_opened", "exit", "session_ended"], text


@pytest.mark.timeout(60)
def test_notes_an_agent_sends_twice_are_kept_once(home: Path, tmp_path: Path, state: str,
                                                  shadows: list[ShadowProc]) -> None:
    """NOTES from an agent that offered the feature: WELCOME accepts it, and
    every note lands in the job's timeline once, however often it is sent
    (delivery is at least once). Before: WELCOME did not accept "notes"."""
    sh = start_shadow(home, tmp_path, shadows, state)
    t = time.time()
    lost = Note(t - 30, "connection_lost", (("reason", "reset by peer"), ("worked_at", t - 31.5),
                                            ("shadow", "home:50000")))
    back = Note(t - 10, "reconnected", (("after_s", 21.5), ("shadow", "home:50000"), ("attempts", 4)))
    agent = RawAgent(sh.port, timeout=20)
    try:
        agent.send(Hello("noted-1", "0123456789abcdef", (StreamSpec(1, "stdout", "noted.out"),), host="node7",
                         user="alice", features=(NOTES_FEATURE,)))
        welcome = agent.receive(Welcome)
        assert NOTES_FEATURE in welcome.features
        agent.send(Notes((lost, back)))
        agent.send(Data(1, 0, b"hello\n"))
        agent.send(Notes((back, lost)))  # (sent again, as after another reconnection)
        agent.send(Notes((Note(t - 5, "compression", (("on", True), ("why", "the link is slow"))),)))
        agent.send(Exit(0, None, ((1, 6),)))
        agent.receive(Done)
    finally:
        agent.close()
    wait_until(lambda: len(events_of(home, state, "noted-1", "agent")) >= 3, 10, "the notes recorded")
    time.sleep(0.5)  # (anything recorded late would show now)
    notes = events_of(home, state, "noted-1", "agent")
    assert [(e["time"], e["kind"], e["details"]) for e in notes] == [
        (t - 30, "connection_lost", {"reason": "reset by peer", "worked_at": t - 31.5, "shadow": "home:50000"}),
        (t - 10, "reconnected", {"after_s": 21.5, "shadow": "home:50000", "attempts": 4}),
        (t - 5, "compression", {"on": True, "why": "the link is slow"}),
    ]
    kinds = [e["kind"] for e in jobs_json(home, state, "noted-1")["events"]]
    assert kinds[:3] == ["connection_lost", "reconnected", "compression"] and "session_opened" in kinds


# -- refusals -------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_wrong_token_is_listed_under_refused_with_its_job(home: Path, tmp_path: Path, state: str,
                                                             shadows: list[ShadowProc]) -> None:
    """A job refused for a wrong token shows at home: in `gcshadow jobs
    --refused` (JSON and rows) with its peer, code, words and the job id
    its handshake announced; in the timeline of a job home knows; and the
    shadow's log line names the job. Before: nowhere but an anonymous log line."""
    tok = token_file(tmp_path / "token")
    sh = start_shadow(home, tmp_path, shadows, state, "--token-file", str(tok))

    def run(job: str, token: Path) -> int:
        w = Wrapper(["--shadow", sh.address, "--spool", str(tmp_path / "spool"), "--job-id", job,
                     "--retry-timeout", "0.2", "--retry-limit", "2", "--token-file", str(token),
                     "--stdout", f"{job}.out", "--", "echo", "hello"])
        return w.wait(30)

    assert run("known-1", tok) == 0
    wrong = token_file(tmp_path / "wrong")
    assert run("stranger-1", wrong) == 123
    assert run("known-1", wrong) == 123
    wait_until(lambda: len(jobs_json(home, state, "--refused")) >= 2, 10, "the refusals recorded")
    refused = jobs_json(home, state, "--refused")
    assert [r["job_id"] for r in refused[:2]] == ["known-1", "stranger-1"], refused  # newest first
    for r in refused:
        assert r["code"] == "AUTH_FAILED" and r["message"] == "authentication failed: wrong token", r
        assert r["peer"].startswith("127.0.0.1:") and r["identity"] == "" and r["time"] > time.time() - 60
    rows = gcshadow(home, state, "jobs", "--refused").stdout.splitlines()
    assert rows[0].split("\t") == ["time", "peer", "identity", "job", "code", "message"]
    assert any(row.split("\t")[3:] == ["stranger-1", "AUTH_FAILED", "authentication failed: wrong token"]
               for row in rows[1:]), rows
    assert [r["job_id"] for r in jobs_json(home, state, "--refused", "stranger-1")] == ["stranger-1"] * (
        len(refused) - sum(r["job_id"] == "known-1" for r in refused))
    # A job home does not know gets no timeline; one it knows shows the refusal in its own.
    assert [j["job_id"] for j in jobs_json(home, state)] == ["known-1"]
    [event] = [e for e in events_of(home, state, "known-1") if e["kind"] == "refused"][-1:]
    assert event["details"]["code"] == "AUTH_FAILED" and event["details"]["peer"].startswith("127.0.0.1:")
    assert "refused: authentication failed: wrong token (job stranger-1)" in sh.log()


@pytest.mark.timeout(60)
def test_home_short_of_disk_is_said_at_start_in_jobs_and_in_refusals(home: Path, tmp_path: Path,
                                                                     shadows: list[ShadowProc]) -> None:
    """A shadow whose root has less room than --min-free says so when it
    starts, `gcshadow jobs` says so, and the job it tells to come back is
    listed with why. Before: it started without a word and told every job BUSY."""
    sh = start_shadow(home, tmp_path, shadows, "", "--min-free", "1000TiB")
    assert "every job is told to come back later (BUSY) until the root has room" in sh.log()
    agent = RawAgent(sh.port, timeout=20)
    try:
        agent.send(Hello("busy-1", "0123456789abcdef", (StreamSpec(1, "stdout", "busy.out"),)))
        with pytest.raises(AssertionError, match="said BUSY: disk low at home"):
            agent.receive(Welcome)
    finally:
        agent.close()
    wait_until(lambda: bool(jobs_json(home, "", "--refused")), 10, "the refusal recorded")
    [r] = jobs_json(home, "", "--refused")
    assert (r["job_id"], r["code"]) == ("busy-1", "BUSY") and "disk low at home" in r["message"]
    res = gcshadow(home, "", "jobs")
    assert res.returncode == 0 and "home short of disk" in res.stderr and "--min-free 1000.0 TiB" in res.stderr


@pytest.mark.timeout(120)
def test_a_flood_of_garbage_connections_is_listed_bounded_and_the_shadow_serves_on(
        home: Path, tmp_path: Path, shadows: list[ShadowProc]) -> None:
    """2000 connections that send garbage: the refusals recorded are bounded
    by the rate limit (the rest counted in one log line), and a real job is
    served as before, byte exact."""
    import threading

    sh = start_shadow(home, tmp_path, shadows, "")
    began = time.time()

    def garbage(n: int) -> None:
        for _ in range(n):
            with socket.create_connection(("127.0.0.1", sh.port), timeout=10) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)

    threads = [threading.Thread(target=garbage, args=(250,)) for _ in range(8)]
    for th in threads:
        th.start()
    w = Wrapper(["--shadow", sh.address, "--spool", str(tmp_path / "spool"), "--job-id", "amid-1", "--stdout",
                 "amid.out", "--", "sh", "-c", "seq 1 1000"])
    assert w.wait(60) == 0, w.err.decode()
    for th in threads:
        th.join(60)
    assert (home / "amid.out").read_bytes() == b"".join(f"{i}\n".encode() for i in range(1, 1001))
    wait_until(lambda: "refused connection(s)" in sh.log(), 10, "the refusals not recorded, counted in the log")
    refused = jobs_json(home, "", "--refused")
    from gcwrap.shadow import eventlog

    most = eventlog.REFUSALS_BURST + eventlog.REFUSALS_PER_S * (time.time() - began) + 5
    assert eventlog.REFUSALS_BURST / 2 <= len(refused) <= most, (len(refused), most)
    assert {r["code"] for r in refused} == {"BAD_FRAME"} and all(r["job_id"] == "" for r in refused), refused[:3]
    assert [j["job_id"] for j in jobs_json(home, "")] == ["amid-1"]


# -- the listing: filters, rows for scripts, numbers ------------------------------------------------------


def _made_jobs(home: Path) -> None:
    """A state holding jobs of two users on three hosts, in every state."""
    store = Store(home)
    try:
        for job, host, user in (("ok-1", "node1", "alice"), ("bad-2", "node2", "alice"), ("gone-3", "gpu1", "bob"),
                                ("live-4", "node1", "bob"), ("old-5", "node2", "carol")):
            files = store.open_job(job_id=job, instance="i", streams=(StreamSpec(1, "stdout", f"{job}.out"),),
                                   host=host, user=user, command=["run", job], peer="10.0.0.1:1")
            files.close()
        summary = {"stdout_bytes": "7", "throughput_mb_s": "0.017", "shadow": "home:50000", "connections": "1"}
        store.record_finished("ok-1", 1, code=0, signal=None, reason="", summary=summary)
        store.record_finished("bad-2", 1, code=3, signal=None, reason="", summary=summary)
        store.record_finished("old-5", 1, code=0, signal=None, reason="", summary=summary)
        store.record_disconnected("gone-3", 1)
        long_ago = time.time() - 3 * 86400
        store.db.execute("UPDATE jobs SET first_seen = ?, last_seen = ?, ended = ? WHERE job_id = 'old-5'",
                         [long_ago, long_ago, long_ago])
        # (connected, heartbeats answered, nothing written for a minute: quiet; a state that
        # does not record when agents were heard from has no quiet jobs)
        if "heard" in {row[1] for row in store.db.execute("PRAGMA table_info(jobs)")}:
            store.db.execute("UPDATE jobs SET last_seen = ?, heard = ? WHERE job_id = 'live-4'",
                             [time.time() - 60, time.time()])
    finally:
        store.close()


def _rows(res: subprocess.CompletedProcess[str]) -> list[list[str]]:
    assert res.returncode == 0, res.stderr
    assert not set(res.stdout) & set("│┃━─┏┗"), res.stdout  # no box drawing off a terminal
    return [line.split("\t") for line in res.stdout.splitlines()]


@pytest.mark.timeout(60)
def test_jobs_filters_and_rows_a_script_can_cut(home: Path) -> None:
    _made_jobs(home)
    rows = _rows(gcshadow(home, "", "jobs"))
    assert rows[0] == ["job", "host", "state", "bytes", "rate", "last_seen", "streams"]
    assert [r[0] for r in rows[1:]] == ["old-5", "ok-1", "bad-2", "gone-3", "live-4"]  # (first seen first)
    assert rows[3][2] == "finished with status 3" and rows[3][3] == "0" and rows[3][6] == "stdout bad-2.out 0"

    def jobs(*args: str) -> list[str]:
        return [r[0] for r in _rows(gcshadow(home, "", "jobs", "-o", "job", "--no-header", *args))]

    assert jobs("--status", "finished") == ["old-5", "ok-1"]
    assert jobs("--status", "failed,disconnected") == ["bad-2", "gone-3"]
    assert jobs("--status", "failed", "--status", "quiet") == ["bad-2", "live-4"]  # (connected, writing nothing)
    assert jobs("--user", "alice") == ["ok-1", "bad-2"]
    assert jobs("--host", "node*", "--user", "bob,carol") == ["old-5", "live-4"]
    assert jobs("--since", "1d") == ["ok-1", "bad-2", "gone-3", "live-4"]
    assert jobs("--since", time.strftime("%Y-%m-%d", time.localtime(time.time() - 5 * 86400))) == jobs()
    rows = _rows(gcshadow(home, "", "jobs", "-o", "JOB,status,exit,why,duration", "--status", "failed"))
    assert rows == [["job", "status", "exit", "why", "duration"],
                    ["bad-2", "failed", "3", "finished with status 3", rows[1][4]]]
    float(rows[1][4])
    bad = gcshadow(home, "", "jobs", "--status", "lost")
    assert bad.returncode == 2 and "'lost' is not one of" in bad.stderr
    bad = gcshadow(home, "", "jobs", "-o", "job,colour")
    assert bad.returncode == 2 and "unknown column(s) colour" in bad.stderr
    bad = gcshadow(home, "", "jobs", "--since", "yesterday-ish")
    assert bad.returncode == 2 and "neither a duration" in bad.stderr


@pytest.mark.timeout(60)
def test_jobs_json_gives_numbers_as_numbers(home: Path) -> None:
    """The I/O summary's figures travel as text on the wire; --json gives
    them as numbers ("7" was "7", "0.017" was "0.017"), text as text."""
    _made_jobs(home)
    found = {j["job_id"]: j for j in jobs_json(home, "")}
    summary = found["bad-2"]["summary"]
    assert summary == {"stdout_bytes": 7, "throughput_mb_s": 0.017, "shadow": "home:50000", "connections": 1}
    assert isinstance(summary["stdout_bytes"], int) and isinstance(summary["throughput_mb_s"], float)
    job = found["bad-2"]
    for key, kind in (("bytes", int), ("duration_s", float), ("rate_bytes_s", float), ("exit_code", int),
                      ("first_seen", float), ("session", int), ("why", str), ("status", str)):
        assert isinstance(job[key], kind), (key, job[key])
    assert job["status"] == "failed" and "events" not in job  # (a job's events: `gcshadow jobs JOB --json`)
    one = jobs_json(home, "", "bad-2")
    assert one["summary"] == summary and [e["kind"] for e in one["events"]] == []


# -- tail -n / -c -------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_tail_lines_and_bytes(shadow: ShadowProc, home: Path, tmp_path: Path) -> None:
    script = "i=1; while [ $i -le 50 ]; do echo out $i; i=$((i+1)); done; printf 'e1\\ne2\\nno newline' >&2"
    w = Wrapper(["--shadow", shadow.address, "--spool", str(tmp_path / "spool"), "--job-id", "t-1", "--stdout",
                 "t.out", "--stderr", "t.err", "--", "sh", "-c", script])
    assert w.wait(30) == 0, w.err.decode()

    def tail(*args: str) -> str:
        res = gcshadow(home, "", "tail", *args)
        assert res.returncode == 0, res.stderr
        return res.stdout

    assert tail("-n", "3", "t-1") == "out 48\nout 49\nout 50\n"
    assert tail("--lines", "0", "t-1") == ""
    assert tail("-n", "500", "t-1") == "".join(f"out {i}\n" for i in range(1, 51))
    assert tail("-c", "8", "t-1") == "\nout 50\n"
    assert tail("--bytes", "1KiB", "t-1", "stderr") == "e1\ne2\nno newline"
    assert tail("-n", "2", "t-1", "stderr") == "e2\nno newline"
    assert tail("-n", "1", "t-1", "all").splitlines() == ["[t-1 stdout] out 50", "[t-1 stderr] no newline"]
    assert tail("-n", "1", "-f", "t-1") == "out 50\n"  # (the job has ended: follow stops at its end)
    both = gcshadow(home, "", "tail", "-n", "1", "-c", "1", "t-1")
    assert both.returncode == 2 and "not both" in both.stderr


def test_start_offset_is_where_the_last_lines_begin(tmp_path: Path) -> None:
    """Against the obvious answer, across block boundaries, with and without a last newline."""
    import random

    from gcwrap.shadow.tail import start_offset

    rng = random.Random(7)
    path = tmp_path / "f"
    for case in range(300):
        block = rng.choice([1, 2, 3, 7, 64, 1 << 16])  # bytes read at a time, backwards
        data = bytes(rng.choice(b"ab\n") for _ in range(rng.randrange(0, 40)))
        path.write_bytes(data)
        n = rng.randrange(0, 12)
        fd = os.open(path, os.O_RDONLY)
        try:
            got = data[start_offset(fd, n, None, block):]
            assert got == b"".join(data.splitlines(keepends=True)[-n:] if n else []), (case, data, n)
            assert data[start_offset(fd, None, n, block):] == (data[-n:] if n else b""), (case, data, n)
        finally:
            os.close(fd)
