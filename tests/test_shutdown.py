"""gcshadow stopped by SIGTERM or SIGINT: it accepts no more connections,
makes what its sessions wrote durable, tells their agents SHUTTING_DOWN and
exits 0 within a bound; the agents come back to the shadow restarted, and
the shutdown costs them no attempt of --retry-limit.

Real processes: the installed gcshadow and gcwrap, loopback TCP, signals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ShadowProc, Wrapper, expected, file_size, genjob, sha256_file, spool_status, wait_until

from gcwrap.shadow.replies import STOP_RETRY_AFTER
from gcwrap.shadow.server import STOP_GRACE
from gcwrap.wire.events import Challenge, Hello
from gcwrap.wire.protocol import NEED_DATA, Connection, Role

pytestmark = pytest.mark.timeout(180)

SIZE = 3 << 20


def stopped_in_order(sh: ShadowProc, start: float) -> float:
    """How long the shadow took to exit after `start` (asserting it exits 0)."""
    assert sh.proc is not None
    try:
        status = sh.proc.wait(STOP_GRACE + 10)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"gcshadow did not stop within {STOP_GRACE + 10:g} s: {sh.log()}") from None
    assert status == 0, sh.log()
    return time.monotonic() - start


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_shadow_sends_its_ended_job_back_soon_and_the_retry_limit_is_untouched(
    home: Path, tmp_path: Path, spool_dir: Path, signum: int
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    sh.start()
    # --retry-limit 1: after the job's end, one failed attempt ends delivery
    # (exit 122). The shutdown must not be that attempt.
    w = Wrapper(["-v", "--shadow", sh.address, "--stdout", "out.1", "--spool", str(spool_dir), "--retry-limit", "1",
                 "--", *genjob(SIZE, seed=5, rate=SIZE)])
    try:
        wait_until(lambda: file_size(home / "out.1") > 256 << 10, 60, "the first bytes at home")
        # Mid-stream: the shadow takes nothing while the job ends, so output
        # waits at gcwrap when the shadow stops (the job's output can go
        # nowhere: a failed attempt would count now).
        assert sh.proc is not None
        os.kill(sh.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: str(spool_status(spool_dir)[0]["state"]).startswith("exited"), 60, "the job's end")
            assert file_size(home / "out.1") < SIZE, "mid-stream"
            start = time.monotonic()
            sh.proc.send_signal(signum)
        finally:
            os.kill(sh.proc.pid, signal.SIGCONT)
        assert stopped_in_order(sh, start) < STOP_GRACE + 5
        log = sh.log()
        assert f"{signal.Signals(signum).name} received: stopping" in log
        assert "come back soon" in log and "stopping now" not in log
        sh.start()  # the same port
        assert w.wait(120) == 0, w.err.decode(errors="replace")
    finally:
        sh.stop()
    err = w.err.decode(errors="replace")
    assert sha256_file(home / "out.1") == expected(SIZE, 5)
    # What the agent was told, and that it cost no attempt.
    assert "SHUTTING_DOWN" in err and "connecting again soon" in err
    told = err[err.index("SHUTTING_DOWN"):]
    nxt = re.search(r"next attempt in ([0-9.]+) s(.*)", told)
    assert nxt is not None and float(nxt.group(1)) == STOP_RETRY_AFTER and "retry-limit" not in nxt.group(2), told
    assert "retry limit reached" not in err


def test_an_idle_shadow_stops_at_once(home: Path,
                                      tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    sh.start()
    try:
        assert sh.proc is not None
        start = time.monotonic()
        sh.proc.send_signal(signal.SIGTERM)
        assert stopped_in_order(sh, start) < 5, "no session: nothing to wait for"
    finally:
        sh.stop()


def test_a_second_signal_stops_at_once_what_the_first_waits_for(home: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    token = tmp_path / "token"
    token.write_text(os.urandom(16).hex() + "\n")
    token.chmod(0o600)
    sh = ShadowProc(home, logs, ["--token-file", str(token)])
    sh.start()
    assert sh.proc is not None
    # A connection in its handshake that never answers the CHALLENGE: the
    # first signal waits for it (up to the handshake timeout, within STOP_GRACE).
    lingering = socket.create_connection(("127.0.0.1", sh.port), timeout=10)
    try:
        conn = Connection(Role.AGENT)
        lingering.sendall(conn.send(Hello("linger", "1", (), nonce="00")))
        while (ev := conn.next_event()) is NEED_DATA:
            chunk = lingering.recv(65536)
            assert chunk, "the shadow closed before its CHALLENGE"
            conn.receive_data(chunk)
        assert isinstance(ev, Challenge)
        sh.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "1 connection(s) told to come back" in sh.log(), 10, "the stop to begin")
        assert sh.proc.poll() is None, "waiting for the lingering connection"
        start = time.monotonic()
        sh.proc.send_signal(signal.SIGTERM)
        assert stopped_in_order(sh, start) < 5
        assert "SIGTERM received again: stopping now" in sh.log()
    finally:
        lingering.close()
        sh.stop()
