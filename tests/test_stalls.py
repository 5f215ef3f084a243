"""Answers that vanish on a live connection: a middlebox keeps reading both
directions (so TCP acknowledges everything, and heartbeats pass before and
after) but forwards nothing for a while, then forwards again. Whatever was
outstanding then (DATA not acknowledged, a request for stdin, the EXIT) is
never answered on that connection: gcwrap must replace it and resend from
the durable offsets, within a bound, and say why.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import StallRelay
from helpers import ShadowProc, Wrapper, expected, file_size, genjob, sha256_bytes, sha256_file, tool, wait_until

from gcwrap.wire.protocol import FrameType

HEARTBEAT = 2.0  # a stall of STALL s is shorter than the 3 heartbeats of silence the black-hole rule waits for
STALL = 3.0
BOUND = 3 * HEARTBEAT  # the rule under test: outstanding bytes unanswered this long replace the connection

# A job that writes known bytes in phases: phase i's bytes go out, then it
# waits until the file `gate.i` exists (the test opens the gate).
PHASED = """
import os, random, sys, time
gates, sizes = sys.argv[1], [int(n) for n in sys.argv[2:]]
data = random.Random(7).randbytes(sum(sizes))
pos = 0
for i, n in enumerate(sizes):
    for k in range(pos, pos + n, 4096):
        os.write(1, data[k : min(k + 4096, pos + n)])
    pos += n
    if i < len(sizes) - 1:
        while not os.path.exists(f"{gates}.{i}"):
            time.sleep(0.02)
"""


def phased_job(gates: Path, *sizes: int) -> list[str]:
    return [sys.executable, "-c", PHASED, str(gates), *map(str, sizes)]


def phased_bytes(*sizes: int) -> bytes:
    return random.Random(7).randbytes(sum(sizes))


def wrap(relay: StallRelay, spool: Path, job_id: str, *args: str) -> list[str]:
    return ["--shadow", f"127.0.0.1:{relay.port}", "--spool", str(spool), "--job-id", job_id,
            "--heartbeat", str(HEARTBEAT), "--retry-timeout", "1", "--retry-limit", "0", *args]


@pytest.mark.timeout(90)
def test_data_vanishes_after_the_job_ended(shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """The job's last bytes go out during a stall and vanish; the job ends;
    heartbeats pass again. Before: gcwrap waited for their ACK forever."""
    gate = tmp_path / "gate"
    with StallRelay(("127.0.0.1", shadow.port)) as relay:
        w = Wrapper([*wrap(relay, spool_dir, "stall-end"), "--stdout", "end.out", "--",
                     *phased_job(gate, 100_000, 150_000)])
        wait_until(lambda: file_size(home / "end.out") == 100_000, 30, "the first phase at home")
        relay.stall(STALL)
        started = time.monotonic()
        (tmp_path / "gate.0").touch()  # the job writes its last 150,000 bytes, and ends
        rc = w.wait(STALL + 4 * BOUND)
        took = time.monotonic() - started
        assert relay.dropped > 0, "the stall dropped frames"
    assert rc == 0, w.err.decode()
    assert sha256_file(home / "end.out") == sha256_bytes(phased_bytes(100_000, 150_000))
    assert took < STALL + 2 * BOUND, took
    assert b"stalled" in w.err and b"never acknowledged" in w.err, w.err.decode()


@pytest.mark.timeout(90)
def test_data_vanishes_while_the_job_runs_and_then_writes_nothing(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A burst goes out during a stall and vanishes; the job goes on but writes
    nothing more for a while (no later DATA reveals the gap). Before: the
    burst reached home only with the job's next write, whenever that came."""
    gate = tmp_path / "gate"
    with StallRelay(("127.0.0.1", shadow.port)) as relay:
        w = Wrapper([*wrap(relay, spool_dir, "stall-run"), "--stdout", "run.out", "--",
                     *phased_job(gate, 100_000, 150_000, 50_000)])
        wait_until(lambda: file_size(home / "run.out") == 100_000, 30, "the first phase at home")
        relay.stall(STALL)
        (tmp_path / "gate.0").touch()  # a burst of 150,000 bytes, then the job waits at gate.1
        wait_until(lambda: file_size(home / "run.out") == 250_000, STALL + 2 * BOUND, "the burst at home")
        assert w.proc.poll() is None, "the job still runs"
        (tmp_path / "gate.1").touch()
        rc = w.wait(30)
    assert rc == 0, w.err.decode()
    assert sha256_file(home / "run.out") == sha256_bytes(phased_bytes(100_000, 150_000, 50_000))
    assert b"stalled" in w.err and b"never acknowledged" in w.err, w.err.decode()


@pytest.mark.timeout(120)
def test_bytes_vanish_mid_frame_while_the_job_runs(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    """A byte-level middlebox: what follows a stall is the middle of a frame.
    The shadow sees garbage (or a gap) and says so; that is a fault of this
    connection, not a refusal of the job: gcwrap reconnects and resends."""
    out, err = 2_400_000, 300_000
    with StallRelay(("127.0.0.1", shadow.port), frames=False) as relay:
        w = Wrapper([*wrap(relay, spool_dir, "stall-bytes"), "--stdout", "b.out", "--stderr", "b.err", "--",
                     *genjob(out, err, seed=33, rate=400_000)])
        wait_until(lambda: file_size(home / "b.out") > 300_000, 30, "output at home")
        relay.stall(STALL)
        rc = w.wait(60)
        assert relay.dropped > 0
    assert rc == 0, w.err.decode()
    assert sha256_file(home / "b.out") == expected(out, 33)
    assert sha256_file(home / "b.err") == expected(err, 34)
    assert b"refused" not in w.err, w.err.decode()
    assert b"lost on the way to the shadow" in w.err or b"stalled" in w.err, w.err.decode()


@pytest.mark.timeout(90)
def test_stdin_answer_vanishes(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    """The shadow's answers to STDIN_READ vanish while heartbeats pass: the
    request is never answered on that connection. Before: the job waited for
    its stdin forever."""
    data = random.Random(9).randbytes(3_000_000)
    (home / "in.dat").write_bytes(data)
    digest = "import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"
    with StallRelay(("127.0.0.1", shadow.port)) as relay:
        relay.stall(STALL, only=[FrameType.STDIN_DATA])
        started = time.monotonic()
        w = Wrapper([*wrap(relay, spool_dir, "stall-stdin"), "--stdin", "in.dat", "--stdout", "sum.out", "--",
                     sys.executable, "-c", digest])
        rc = w.wait(STALL + 4 * BOUND)
        took = time.monotonic() - started
        assert relay.dropped > 0
    assert rc == 0, w.err.decode()
    assert (home / "sum.out").read_text().strip() == sha256_bytes(data)
    assert took < STALL + 2 * BOUND, took
    assert b"stalled" in w.err and b"stdin" in w.err, w.err.decode()


@pytest.mark.timeout(90)
def test_exit_vanishes(shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """The job's EXIT vanishes on its way while heartbeats pass: the shadow
    never answers it with DONE. Before: gcwrap waited for DONE forever. (A
    DONE that vanishes needs nothing: the shadow closes the connection after
    it, and gcwrap sends EXIT again on a new one.)"""
    gate = tmp_path / "gate"
    with StallRelay(("127.0.0.1", shadow.port)) as relay:
        w = Wrapper([*wrap(relay, spool_dir, "stall-exit"), "--stdout", "done.out", "--",
                     *phased_job(gate, 50_000, 10_000)])
        wait_until(lambda: file_size(home / "done.out") == 50_000, 30, "the first phase at home")
        relay.stall(STALL, only=[FrameType.EXIT])
        started = time.monotonic()
        (tmp_path / "gate.0").touch()
        rc = w.wait(STALL + 4 * BOUND)
        took = time.monotonic() - started
        assert relay.dropped == 1, "the EXIT vanished"
    assert rc == 0, w.err.decode()
    assert sha256_file(home / "done.out") == sha256_bytes(phased_bytes(50_000, 10_000))
    assert took < STALL + 2 * BOUND, took
    assert b"stalled" in w.err and b"EXIT" in w.err, w.err.decode()
    jobs = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                                     check=True, timeout=30).stdout)
    assert jobs[0]["state"] == "finished" and jobs[0]["exit_code"] == 0


@pytest.mark.timeout(90)
def test_welcome_vanishes_after_auth(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """The shadow's WELCOME (its answer to AUTH) vanishes: the handshake is
    bounded by three heartbeats, and gcwrap says which answer never came."""
    token = tmp_path / "token"
    token.write_text(os.urandom(32).hex() + "\n")
    token.chmod(0o600)
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["--token-file", str(token)])
    sh.start()
    heartbeat = 1.0
    try:
        with StallRelay(("127.0.0.1", sh.port)) as relay:
            relay.stall(2 * heartbeat, only=[FrameType.WELCOME])
            started = time.monotonic()
            w = Wrapper(["--shadow", f"127.0.0.1:{relay.port}", "--spool", str(spool_dir), "--job-id", "stall-welcome",
                         "--heartbeat", str(heartbeat), "--retry-timeout", "1", "--token-file", str(token),
                         "--stdout", "w.out", "--", "echo", "welcome"])
            rc = w.wait(30)
            took = time.monotonic() - started
            assert relay.dropped >= 1 and relay.connections >= 2
    finally:
        sh.stop()
    assert rc == 0, w.err.decode()
    assert (home / "w.out").read_bytes() == b"welcome\n"
    assert took < 3 * heartbeat + 5, took
    assert b"did not answer AUTH" in w.err, w.err.decode()
