"""Several real gcshadow processes on one root, their state in one real
PostgreSQL: who holds a job, and what a shadow that lost it may still do.

Raw protocol clients play the agents, so that every frame is seen: which
connection gets WELCOME, which bytes are acknowledged, what lands in the
file. A real gcwrap job checks that a restart of PostgreSQL mid-run loses
nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ShadowProc, Wrapper, expected, genjob, sha256_file, tool, wait_until
from pgserver import PgServer
from rawagent import RawAgent
from test_shadow_protocol import hello

from gcwrap.wire.events import Ack, ConnectionClosed, Data, Done, Error, ErrorCode, Event, Exit, Welcome

JOB = "shared-1"
FIRST = b"a" * 4000
MORE = b"b" * 3000


@pytest.fixture
def shadows(tmp_path: Path, pg_url: str) -> Iterator[tuple[ShadowProc, ShadowProc]]:
    """Two shadows serving one root, their state in one database."""
    root = tmp_path / "root"
    root.mkdir()
    procs = []
    for name in ("a", "b"):
        logs = tmp_path / f"logs-{name}"
        logs.mkdir()
        procs.append(ShadowProc(root, logs, ["--state", pg_url, "--idle-timeout", "30"]))
    try:
        for p in procs:
            p.start()
        yield procs[0], procs[1]
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
            p.stop()


def _agent(shadow: ShadowProc) -> RawAgent:
    return RawAgent(shadow.port)


def _hold(shadow: ShadowProc) -> tuple[RawAgent, Welcome]:
    """A connection that holds the job at `shadow`, with FIRST acknowledged."""
    agent = _agent(shadow)
    agent.send(hello(JOB))
    ev = agent.next()
    assert isinstance(ev, Welcome), ev
    agent.send(Data(1, 0, FIRST))
    ack = agent.until(Ack)
    assert ack == Ack(1, len(FIRST)), ack
    return agent, ev


def _claim(shadow: ShadowProc) -> tuple[RawAgent | None, Event]:
    """One HELLO for the job: the connection and WELCOME, or None and the refusal."""
    agent = _agent(shadow)
    agent.send(hello(JOB))
    ev = agent.next()
    if isinstance(ev, Welcome):
        return agent, ev
    agent.close()
    return None, ev


def _claim_within(shadow: ShadowProc, seconds: float) -> tuple[RawAgent, Welcome, list[Event]]:
    """Retry the claim (as an agent does after BUSY) until WELCOME."""
    refusals: list[Event] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        agent, ev = _claim(shadow)
        if agent is not None:
            assert isinstance(ev, Welcome)
            return agent, ev, refusals
        refusals.append(ev)
        time.sleep(0.2)
    raise AssertionError(f"no WELCOME within {seconds} s: {refusals[-3:]}")


def _quiet(agent: RawAgent, seconds: float) -> list[Event]:
    """What the connection receives within `seconds` (until it closes)."""
    agent.sock.settimeout(seconds)
    got: list[Event] = []
    try:
        while True:
            ev = agent.next()
            got.append(ev)
            if isinstance(ev, (Error, ConnectionClosed)):
                break
    except (TimeoutError, OSError):
        pass
    return got


def _finish(agent: RawAgent, durable: int, content: bytes) -> None:
    """Send what the shadow lacks from `durable` on, then EXIT; DONE."""
    agent.send(Data(1, durable, content[durable:]))
    agent.send(Exit(code=0, signal=None, lengths=((1, len(content)),)))
    ev = agent.until(Done)
    assert isinstance(ev, Done), ev


def _jobs(state: str, root: Path) -> list[dict[str, object]]:
    out = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--state", state, "--root", str(root)],
                         capture_output=True, check=True, timeout=60)
    data = json.loads(out.stdout)
    assert isinstance(data, list)
    return data


@pytest.mark.timeout(120)
def test_a_second_shadow_takes_a_job_only_once_the_holder_let_go(
    shadows: tuple[ShadowProc, ShadowProc], pg_url: str,
) -> None:
    a, b = shadows
    first, _ = _hold(a)
    # B cannot take the files A writes: it says why, and takes the job from A in the state.
    agent, refused = _claim(b)
    assert agent is None and isinstance(refused, Error) and refused.code is ErrorCode.BUSY, refused
    assert "another shadow's session" in refused.message
    # A's session records and acknowledges nothing more, and is stopped.
    first.send(Data(1, len(FIRST), MORE))
    got = _quiet(first, 10)
    assert not [ev for ev in got if isinstance(ev, Ack)], got
    assert got and isinstance(got[-1], (Error, ConnectionClosed)), got
    # B then holds the job, at what A acknowledged: nothing of A's unacknowledged bytes is kept.
    second, welcome, _ = _claim_within(b, 15)
    assert dict(welcome.durable) == {1: len(FIRST)}
    content = FIRST + b"c" * 5000
    _finish(second, len(FIRST), content)
    assert (a.root / "o").read_bytes() == content
    [job] = _jobs(pg_url, a.root)
    assert (job["job_id"], job["state"], job["exit_code"]) == (JOB, "finished", 0)


@pytest.mark.timeout(120)
def test_an_idle_holder_lets_go_when_another_shadow_takes_its_job(shadows: tuple[ShadowProc, ShadowProc]) -> None:
    a, b = shadows
    first, _ = _hold(a)  # then silent: no batch of its own would tell it (its idle timeout is 30 s)
    started = time.monotonic()
    second, welcome, refusals = _claim_within(b, 10)
    assert refusals and time.monotonic() - started < 10
    assert dict(welcome.durable) == {1: len(FIRST)}
    got = _quiet(first, 5)
    assert got and isinstance(got[-1], (Error, ConnectionClosed)) and not any(isinstance(e, Ack) for e in got), got
    assert "another shadow took this job over" in a.log()
    content = FIRST + b"f" * 10
    _finish(second, len(FIRST), content)
    assert (a.root / "o").read_bytes() == content


@pytest.mark.timeout(120)
def test_two_connections_racing_for_one_job_at_two_shadows_one_holds_it(
    shadows: tuple[ShadowProc, ShadowProc],
) -> None:
    a, b = shadows
    agents = [_agent(a), _agent(b)]
    for agent in agents:
        agent.send(hello(JOB))
    answers = [agent.next() for agent in agents]
    welcomed = [agent for agent, ev in zip(agents, answers) if isinstance(ev, Welcome)]
    assert len(welcomed) <= 1, answers
    # Whoever got WELCOME writes; at most one connection's bytes are ever acknowledged.
    acked = []
    for i, (agent, ev) in enumerate(zip(agents, answers)):
        if isinstance(ev, Welcome):
            agent.send(Data(1, 0, bytes([65 + i]) * 1000))
            if any(isinstance(e, Ack) for e in _quiet(agent, 3)):
                acked.append(i)
    assert len(acked) <= 1
    data = (a.root / "o").read_bytes() if (a.root / "o").exists() else b""
    if acked:
        assert data[:1000] == bytes([65 + acked[0]]) * 1000


@pytest.mark.timeout(120)
def test_a_frozen_holder_blocks_only_its_job_and_writes_nothing_that_stays(
    shadows: tuple[ShadowProc, ShadowProc],
) -> None:
    a, b = shadows
    first, _ = _hold(a)
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        # Frozen, A still holds the files: B refuses, again and again.
        for _ in range(3):
            agent, refused = _claim(b)
            assert agent is None and isinstance(refused, Error) and refused.code is ErrorCode.BUSY, refused
            time.sleep(0.5)
        # Other jobs are not held up.
        other = _agent(b)
        other.send(hello("another-job", out="other"))
        assert isinstance(other.next(), Welcome)
        first.send(Data(1, len(FIRST), MORE))  # buffered for A, which wakes up to it
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    got = _quiet(first, 10)
    assert not [ev for ev in got if isinstance(ev, Ack)], got  # the stale shadow acknowledges nothing
    second, welcome, _ = _claim_within(b, 15)
    assert dict(welcome.durable) == {1: len(FIRST)}
    assert (a.root / "o").read_bytes() == FIRST  # what A wrote after it lost the job is cut back
    content = FIRST + b"d" * 2500
    _finish(second, len(FIRST), content)
    assert (a.root / "o").read_bytes() == content


@pytest.mark.timeout(120)
def test_kill_9_of_the_holder_the_other_shadow_takes_the_job_at_once(
    shadows: tuple[ShadowProc, ShadowProc],
) -> None:
    a, b = shadows
    first, _ = _hold(a)
    first.send(Data(1, len(FIRST), MORE))  # perhaps written, never acknowledged
    a.kill9()
    agent, ev = _claim(b)
    assert agent is not None and isinstance(ev, Welcome), ev
    assert dict(ev.durable)[1] >= len(FIRST)
    content = FIRST + MORE + b"e" * 100
    _finish(agent, dict(ev.durable)[1], content)
    assert (b.root / "o").read_bytes() == content


@pytest.mark.timeout(180)
def test_losing_postgresql_stops_acks_and_nothing_is_lost_after_it_returns(
    shadows: tuple[ShadowProc, ShadowProc], postgres: PgServer,
) -> None:
    a, _ = shadows
    try:
        _lose_postgresql(a, postgres)
    except AssertionError as e:  # what the shadow said, to tell why
        raise AssertionError(f"{e}\nshadow log:\n{a.log()}") from None


def _lose_postgresql(a: ShadowProc, postgres: PgServer) -> None:
    first, _ = _hold(a)
    postgres.ctl("stop")
    try:
        first.send(Data(1, len(FIRST), MORE))
        got = _quiet(first, 10)
        assert not [ev for ev in got if isinstance(ev, Ack)], got
        agent, refused = _claim(a)
        assert agent is None and isinstance(refused, Error) and refused.code is ErrorCode.BUSY, refused
        assert "state database" in refused.message
    finally:
        postgres.ctl("start")
    second, welcome, _ = _claim_within(a, 30)
    assert dict(welcome.durable) == {1: len(FIRST)}
    content = FIRST + MORE
    _finish(second, len(FIRST), content)
    assert (a.root / "o").read_bytes() == content
    assert a.log().count("lost the state database") == 1, a.log()
    assert "the state database" in a.log() and "is back" in a.log()


@pytest.mark.timeout(240)
def test_a_job_streams_byte_exact_through_a_restart_of_postgresql(
    tmp_path: Path, pg_url: str, postgres: PgServer,
) -> None:
    root = tmp_path / "root"
    logs = tmp_path / "logs"
    logs.mkdir()
    shadow = ShadowProc(root, logs, ["--state", pg_url])
    shadow.start()
    try:
        w = Wrapper(["--shadow", shadow.address, "--spool", str(tmp_path / "spool"), "--job-id", "through",
                     "--retry-timeout", "2", "--stdout", "out.txt", "--", *genjob(3 << 20, seed=5, rate=600_000)])
        wait_until(lambda: (root / "out.txt").exists() and (root / "out.txt").stat().st_size > 200_000, 60,
                   "output to arrive")
        postgres.ctl("restart")
        assert w.wait(120) == 0, w.err.decode(errors="replace")
    finally:
        shadow.stop()
    assert sha256_file(root / "out.txt") == expected(3 << 20, 5)
    [job] = _jobs(pg_url, root)
    assert (job["state"], job["exit_code"]) == ("finished", 0)


@pytest.mark.timeout(60)
def test_a_root_of_the_embedded_state_is_refused_to_a_shared_one(tmp_path: Path, pg_url: str) -> None:
    root = tmp_path / "root"
    logs = tmp_path / "logs"
    logs.mkdir()
    embedded = ShadowProc(root, logs)
    embedded.start()
    try:
        out = subprocess.run([*tool("gcshadow"), "serve", "--port", "0", "--root", str(root), "--state", pg_url],
                             capture_output=True, text=True, timeout=60)
    finally:
        embedded.stop()
    assert out.returncode == 1 and "embedded state" in out.stderr, out.stderr
    out = subprocess.run([*tool("gcshadow"), "serve", "--port", "0", "--root", str(root), "--state", pg_url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "belongs to the embedded state" in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_without_psycopg_a_shared_state_is_refused_in_one_line(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['psycopg'] = None; from gcwrap.shadow_cli import main; "
            "sys.argv = ['gcshadow', 'serve', '--port', '0', '--root', sys.argv[1], '--state', "
            "'postgresql://gc:s3cret@127.0.0.1:1/x']; main()")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "Error: --state postgresql:// needs psycopg: pip install 'gcwrap[postgresql]'")
    assert "Traceback" not in out.stderr
    assert "s3cret" not in out.stderr


@pytest.mark.timeout(120)
def test_the_web_view_shows_the_jobs_of_every_shadow_sharing_the_state(
    shadows: tuple[ShadowProc, ShadowProc], pg_url: str, tmp_path: Path,
) -> None:
    pytest.importorskip("h11")
    from test_web import WebProc

    a, b = shadows
    for shadow, job in ((a, "at-a"), (b, "at-b")):
        agent = _agent(shadow)
        agent.send(hello(job, out=job))
        assert isinstance(agent.next(), Welcome)
        _finish(agent, 0, job.encode() * 10)
    listed_jobs = {j["job_id"]: (j["state"], j["exit_code"]) for j in _jobs(pg_url, b.root)}
    assert listed_jobs == {"at-a": ("finished", 0), "at-b": ("finished", 0)}
    web = WebProc(a.root, tmp_path, ["--state", pg_url])
    try:
        def listed() -> bool:
            jobs = {j["job_id"]: j for j in web.json("/api/jobs")["jobs"]}
            return set(jobs) == {"at-a", "at-b"} and all(j["state"] == "finished" for j in jobs.values())

        wait_until(listed, 20, "both shadows' jobs in the web view")
        status, _, body = web.get("/api/jobs/at-b/files/stdout")
        assert status == 200 and body == b"at-b" * 10
    finally:
        web.stop()


@pytest.mark.timeout(120)
def test_a_shadow_restarted_after_kill_9_marks_its_jobs_disconnected_not_the_others(
    shadows: tuple[ShadowProc, ShadowProc], pg_url: str,
) -> None:
    a, b = shadows
    first, _ = _hold(a)
    other = _agent(b)
    other.send(hello("at-b", out="at-b"))
    assert isinstance(other.next(), Welcome)
    a.kill9()
    first.close()
    assert {j["job_id"]: j["state"] for j in _jobs(pg_url, a.root)} == {JOB: "streaming", "at-b": "streaming"}
    a.start(port=0)
    assert {j["job_id"]: j["state"] for j in _jobs(pg_url, a.root)} == {JOB: "disconnected", "at-b": "streaming"}
