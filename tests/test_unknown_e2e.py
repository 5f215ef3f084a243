"""Outcomes that cannot be known, through real processes: gcshadow with its
state in a real PostgreSQL reached through a relay that cuts connections
at COMMIT (after forwarding it: the commit applied; before: it did not),
or with its embedded SQLite state whose WAL syncs fail after writing; real
gcwrap jobs checked byte for byte, never refused for good. Also: the
shadow serves again within a second of its state database's return; a
replaced attempt coming back after a restart fences nobody; a shared state
serves one root.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ShadowProc, Wrapper, expected, file_size, genjob, sha256_file, tool, wait_until
from pgserver import PgServer
from rawagent import RawAgent
from statefaults import FailingStateSync, PgRelay

from gcwrap.wire.events import Data, Error, ErrorCode, Ping, Pong, Welcome

MB = 1_000_000


def refused_for_good(err: str) -> list[str]:
    """The permanent codes gcwrap said it was refused with ("[LENGTH_MISMATCH]"...)."""
    return [c for c in re.findall(r"\[([A-Z_]+)\]", err) if c in ErrorCode.__members__ and ErrorCode[c].permanent]


@pytest.fixture
def relay(postgres: PgServer) -> Iterator[PgRelay]:
    with PgRelay(("127.0.0.1", postgres.port)) as r:
        yield r


def _job(shadow: ShadowProc, spool: Path, job_id: str, name: str, size: int, seed: int) -> Wrapper:
    return Wrapper(["--shadow", shadow.address, "--spool", str(spool), "--job-id", job_id, "--retry-timeout", "0.5",
                    "--retry-limit", "0", "--heartbeat", "1", "-v", "--stdout", name, "--",
                    *genjob(size, 0, seed=seed, rate=2 * MB)])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["after", "before"])
def test_postgresql_connections_cut_at_commit_cost_no_output(tmp_path: Path, pg_url: str, relay: PgRelay,
                                                             mode: str) -> None:
    """Three COMMITs cut in a few seconds while a job streams (the issue's
    case: before, the first cut after a COMMIT that applied ended the job's
    output at home for good, LENGTH_MISMATCH). Now: byte-exact, exit 0, the
    agent told BUSY (the state database), never refused or fenced."""
    home, logs = tmp_path / "home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    shadow = ShadowProc(home, logs, ["--state", relay.url(pg_url)])
    shadow.start()
    size = 10 * MB
    try:
        w = _job(shadow, tmp_path / "spool", "amb", "amb/out.bin", size, seed=26)
        out = home / "amb" / "out.bin"
        for i in range(3):
            at = file_size(out)
            wait_until(lambda at=at: file_size(out) >= at + MB or w.proc.poll() is not None, 30, "output to grow")
            relay.arm(mode)
            wait_until(lambda i=i: relay.cuts[mode] > i or w.proc.poll() is not None, 30, "a COMMIT to be cut")
        assert w.wait(120) == 0, w.err.decode()
    finally:
        shadow.stop()
    err = w.err.decode()
    assert relay.cuts[mode] == 3, (relay.cuts, relay.commits)
    assert sha256_file(out) == expected(size, 26), err
    assert not refused_for_good(err) and "[FENCED]" not in err, err
    assert "[BUSY]" in err, err
    log = shadow.log()
    assert "the state database is unavailable" in log or "told to come back" in log, log
    assert "cannot sync" not in log, log


def _lost_then_back(shadow: ShadowProc, relay: PgRelay, lost: float, n: int) -> float:
    """The database lost for `lost` seconds while an agent knocks every
    0.25 s (told BUSY), then back: how long until a HELLO is welcomed."""
    relay.down()
    until = time.monotonic() + lost
    while time.monotonic() < until:
        a = RawAgent(shadow.port)
        ev = a.hello("back", f"i{n}-lost")
        a.close()
        assert isinstance(ev, Error) and ev.code is ErrorCode.BUSY, ev
        time.sleep(0.25)
    relay.up()
    back = time.monotonic()
    while time.monotonic() - back < 15:
        a = RawAgent(shadow.port)
        ev = a.hello("back", f"i{n}")
        a.close()
        if isinstance(ev, Welcome):
            return time.monotonic() - back
        assert isinstance(ev, Error) and ev.code is ErrorCode.BUSY, ev
        time.sleep(0.05)
    raise AssertionError("not served again within 15 s of the state database's return")


@pytest.mark.timeout(180)
def test_the_shadow_serves_again_within_a_second_of_its_state_database(tmp_path: Path, pg_url: str,
                                                                       relay: PgRelay) -> None:
    """Three times: the database lost for 6 s while agents keep knocking
    (told BUSY), then back: the first HELLO after that is welcomed within a
    second (before: the reconnection backoff had grown to seconds, up to 7.5 s)."""
    home, logs = tmp_path / "home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    shadow = ShadowProc(home, logs, ["--state", relay.url(pg_url)])
    shadow.start()
    try:
        took = sorted(_lost_then_back(shadow, relay, 6.0, n) for n in range(3))
    finally:
        shadow.stop()
    print(f"served again {', '.join(f'{t:.3f}' for t in took)} s after the state database returned")
    assert took[1] < 1.0 and took[2] < 2.0, took  # (the median within a second; the worst on a busy machine)
    log = shadow.log()
    assert log.count("lost the state database") == 3 and log.count("is back: serving again") == 3, log


@pytest.mark.timeout(180)
def test_embedded_state_commits_that_fail_after_writing_then_kill_9(tmp_path: Path, failsync: Path) -> None:
    """The embedded state's WAL syncs fail after writing (its COMMITs may
    have applied: a restart's recovery finds them), and the shadow is
    killed -9 right after, twice: byte-exact, never refused for good."""
    faults = FailingStateSync(failsync, tmp_path / "control")
    home, logs = tmp_path / "home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    shadow = ShadowProc(home, logs, env=faults.env())
    shadow.start()
    size = 8 * MB
    try:
        w = _job(shadow, tmp_path / "spool", "wal", "wal.bin", size, seed=27)
        out = home / "wal.bin"
        for _ in range(2):
            at = file_size(out)
            wait_until(lambda at=at: file_size(out) >= at + MB or w.proc.poll() is not None, 30, "output to grow")
            faults.arm(2)
            wait_until(lambda: faults.left() == 0 or w.proc.poll() is not None, 30, "the state's syncs to fail")
            shadow.kill9()
            shadow.start()
        assert w.wait(120) == 0, w.err.decode()
    finally:
        shadow.stop()
    err = w.err.decode()
    assert sha256_file(out) == expected(size, 27), err
    assert not refused_for_good(err) and "[BUSY]" in err, err


@pytest.mark.timeout(60)
def test_a_replaced_attempt_after_a_restart_fences_nobody(tmp_path: Path) -> None:
    """Attempt a1 of a job, replaced by a2; the shadow restarts; a2 streams
    again, then a1 comes back: it is refused for good (STALE_ATTEMPT) and
    a2's session goes on (before: a1's first connection after every
    restart fenced a2's live session first)."""
    home, logs = tmp_path / "home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    shadow = ShadowProc(home, logs)
    shadow.start()
    try:
        old = RawAgent(shadow.port)
        assert isinstance(old.hello("att", "a1"), Welcome)
        old.close()
        new = RawAgent(shadow.port)
        assert isinstance(new.hello("att", "a2"), Welcome)
        new.close()
        shadow.kill9()
        shadow.start()
        new = RawAgent(shadow.port)
        assert isinstance(new.hello("att", "a2"), Welcome)
        new.send(Data(1, 0, b"the newer attempt's output\n"))
        stale = RawAgent(shadow.port)
        ev = stale.hello("att", "a1")
        stale.close()
        assert isinstance(ev, Error) and ev.code is ErrorCode.STALE_ATTEMPT, ev
        new.send(Ping(7))
        for _ in range(10):  # (an ACK of the DATA comes first)
            if isinstance(ev := new.next(), (Pong, Error)):
                break
        assert ev == Pong(7), f"the live session of the newer attempt was stopped: {ev}"
        new.close()
    finally:
        shadow.stop()


@pytest.mark.timeout(60)
def test_a_shared_state_serves_one_root(tmp_path: Path, pg_url: str) -> None:
    """Two roots on one database would share job names ('out' belongs to
    job race4242-0 in a root with no such file): the second is refused
    with one line, at start-up."""
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    first = ShadowProc(tmp_path / "one", logs, ["--state", pg_url])
    first.start()
    try:
        proc = subprocess.run([*tool("gcshadow"), "serve", "--port", "0", "--root", str(tmp_path / "two"),
                               "--state", pg_url], capture_output=True, text=True, timeout=30, check=False)
    finally:
        first.stop()
    assert proc.returncode == 1, proc
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "serves another root" in errors[0] and str(tmp_path / "one") in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    # The first root is served again by a new shadow: it is that state's.
    again = ShadowProc(tmp_path / "one", logs, ["--state", pg_url])
    again.start()
    again.stop()
    assert os.path.exists(tmp_path / "one" / ".gcshadow" / "root-id")
