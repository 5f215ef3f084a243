"""The shadow trusts no one it has not authenticated; bad input gets a clear
refusal, nothing is written, and the shadow keeps serving everyone else.

Real processes over loopback; real certificates made at test time (trustme).
"""

from __future__ import annotations

import datetime
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ShadowProc, Wrapper, expected, genjob, sha256_file, tool, wait_until

from gcwrap.wire.events import Auth, Challenge, Data, Error, ErrorCode, Hello, StreamSpec
from gcwrap.wire.protocol import MAGIC, NEED_DATA, Connection, FrameType, Role, encode

trustme = pytest.importorskip("trustme", reason="needs trustme (pip install -e '.[test]')")

MB = 1_000_000


def token_file(path: Path, secret: str | None = None, mode: int = 0o600) -> Path:
    path.write_text((secret or os.urandom(32).hex()) + "\n")
    path.chmod(mode)
    return path


def start_shadow(home: Path, tmp_path: Path, *extra: str) -> ShadowProc:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    sh = ShadowProc(home, logs, extra=list(extra))
    sh.start()
    return sh


def run(shadow: ShadowProc, tmp_path: Path, job_id: str, *extra: str, job: list[str] | None = None,
        name: str | None = None) -> Wrapper:
    w = Wrapper(["--shadow", shadow.address, "--spool", str(tmp_path / "spool"), "--job-id", job_id,
                 "--retry-timeout", "0.2", "--retry-limit", "3", "--stdout", name or f"{job_id}.out", *extra, "--",
                 *(job or ["echo", "hello"])])
    return w


def nothing_written(home: Path, name: str) -> bool:
    return not (home / name).exists()


# -- 1. tokens -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_token_right_wrong_missing(home: Path, tmp_path: Path, shadows: list[ShadowProc]) -> None:
    tok = token_file(tmp_path / "token")
    sh = start_shadow(home, tmp_path, "--token-file", str(tok))
    shadows.append(sh)
    good = run(sh, tmp_path, "good", "--token-file", str(tok))
    assert good.wait(30) == 0, good.err.decode()
    assert (home / "good.out").read_bytes() == b"hello\n"
    wrong = run(sh, tmp_path, "wrong", "--token-file", str(token_file(tmp_path / "other")))
    assert wrong.wait(30) == 123
    assert b"authentication failed: wrong token" in wrong.err
    none = run(sh, tmp_path, "none")
    assert none.wait(30) == 123
    assert b"this shadow requires token authentication" in none.err
    assert nothing_written(home, "wrong.out") and nothing_written(home, "none.out")
    again = run(sh, tmp_path, "after", "--token-file", str(tok))
    assert again.wait(30) == 0, "the shadow keeps serving the others"
    log = sh.log()
    assert "refused: authentication failed: wrong token" in log and "127.0.0.1:" in log


@pytest.mark.timeout(60)
def test_agent_refuses_a_shadow_that_does_not_know_the_token(home: Path, tmp_path: Path,
                                                           shadows: list[ShadowProc]) -> None:
    impostor = start_shadow(home, tmp_path)  # no token: could be anyone
    shadows.append(impostor)
    w = run(impostor, tmp_path, "careful", "--token-file", str(token_file(tmp_path / "t")))
    assert w.wait(30) == 123
    assert b"did not ask for the token" in w.err
    out = home / "careful.out"  # the impostor may create the file; not one byte of output reaches it
    assert not out.exists() or out.stat().st_size == 0, "no output goes to a shadow that cannot prove the token"


def test_token_file_readable_by_others_is_refused(home: Path, tmp_path: Path) -> None:
    tok = token_file(tmp_path / "open", mode=0o644)
    res = subprocess.run([*tool("gcshadow"), "serve", "--port", "0", "--root", str(home), "--token-file", str(tok)],
                         capture_output=True, timeout=30)
    assert res.returncode == 2
    assert b"readable by others" in res.stderr and b"chmod 600" in res.stderr


class RecordingProxy:
    """Forwards loopback TCP to `port`, recording what the client sent."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.port))

        def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
            while data := src.recv(65536):
                if record:
                    self.sent.extend(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(upstream, client, False), daemon=True)
        back.start()
        try:
            pump(client, upstream, True)
            back.join(10)
        except OSError:
            pass
        finally:
            client.close()
            upstream.close()
            self.listener.close()


@pytest.mark.timeout(60)
def test_replayed_handshake_is_refused(home: Path, tmp_path: Path, shadows: list[ShadowProc]) -> None:
    tok = token_file(tmp_path / "token")
    sh = start_shadow(home, tmp_path, "--token-file", str(tok))
    shadows.append(sh)
    proxy = RecordingProxy(sh.port)
    w = Wrapper(["--shadow", proxy.address, "--spool", str(tmp_path / "spool"), "--job-id", "victim",
                 "--token-file", str(tok), "--stdout", "victim.out", "--", "echo", "secret"])
    assert w.wait(30) == 0, w.err.decode()
    proxy.thread.join(10)
    captured = bytes(proxy.sent)
    assert captured.startswith(MAGIC) and tok.read_text().strip().encode() not in captured, "the token never crosses"
    (home / "victim.out").unlink()
    hello_end = len(MAGIC) + 4 + int.from_bytes(captured[len(MAGIC) : len(MAGIC) + 4], "big")
    auth_end = hello_end + 4 + int.from_bytes(captured[hello_end : hello_end + 4], "big")
    for patient in (False, True):
        # An attacker replays the captured exchange: blindly, or waiting for the
        # new challenge before it sends the captured AUTH. Both are refused.
        with socket.create_connection(("127.0.0.1", sh.port), timeout=10) as s:
            got = b""
            if patient:
                s.sendall(captured[:hello_end])
                got = until_challenge(s)  # the fresh CHALLENGE is out: the AUTH answers it
                s.sendall(captured[hello_end:auth_end])
            else:
                s.sendall(captured)
            while chunk := s.recv(65536):
                got += chunk
        assert not has_welcome(got), (patient, got)
        # A blind replay is refused as UNEXPECTED when its AUTH arrives with the
        # HELLO (before the CHALLENGE went out), as AUTH_FAILED when it arrives
        # after: which, TCP decides. Waiting for the CHALLENGE, only the MAC can tell.
        want = {ErrorCode.AUTH_FAILED} if patient else {ErrorCode.AUTH_FAILED, ErrorCode.UNEXPECTED}
        assert worst_error(got) in want, (patient, got)
    assert nothing_written(home, "victim.out"), "the replays wrote nothing"


def until_challenge(s: socket.socket) -> bytes:
    """Read until a whole CHALLENGE frame has arrived (what was read, for the record)."""
    conn = Connection(Role.AGENT)
    conn.send(Hello("x", "y", (), nonce="00"))
    got = b""
    while True:
        ev = conn.next_event()
        if isinstance(ev, Challenge):
            return got
        assert ev is NEED_DATA, f"expected a CHALLENGE, got {ev}"
        chunk = s.recv(65536)
        assert chunk, "the shadow closed before its CHALLENGE"
        got += chunk
        conn.receive_data(chunk)


def has_welcome(reply: bytes) -> bool:
    """Whether the reply holds a WELCOME frame (frames walked by their headers)."""
    pos = 0
    while pos + 5 <= len(reply):
        length, ftype = struct.unpack_from("!IB", reply, pos)
        if ftype == FrameType.WELCOME:
            return True
        pos += 4 + length
    return False


def worst_error(reply: bytes) -> ErrorCode | None:
    """The code of the ERROR in a shadow's reply (CHALLENGE frames skipped)."""
    conn = Connection(Role.AGENT)
    conn.send(Hello("x", "y", (), nonce="00"))
    conn.receive_data(reply)
    conn.receive_data(b"")
    while (ev := conn.next_event()) is not NEED_DATA:
        if isinstance(ev, Error):
            return ev.code
        if not isinstance(ev, Challenge):
            return None
        conn.send(Auth("00"))  # keep our parser in step with the shadow's state
    return None


# -- 2. TLS ------------------------------------------------------------------------------


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca, other_ca = trustme.CA(), trustme.CA()
    d = tmp_path / "pki"
    d.mkdir()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    other_ca.cert_pem.write_to_path(str(d / "other-ca.pem"))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(str(d / "server.pem"))
    ca.issue_cert("alice@grid", common_name="alice").private_key_and_cert_chain_pem.write_to_path(str(d / "alice.pem"))
    other_ca.issue_cert("mallory@grid", common_name="mallory").private_key_and_cert_chain_pem.write_to_path(
        str(d / "mallory.pem"))
    past = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    ca.issue_cert("old@grid", common_name="old", not_before=past,
                  not_after=past + datetime.timedelta(days=1)).private_key_and_cert_chain_pem.write_to_path(
        str(d / "expired.pem"))
    return {p.stem: p for p in d.iterdir()}


@pytest.mark.timeout(120)
def test_tls_and_verified_server(home: Path, tmp_path: Path, shadows: list[ShadowProc], pki: dict[str, Path]) -> None:
    sh = start_shadow(home, tmp_path, "--tls-cert", str(pki["server"]))
    shadows.append(sh)
    w = run(sh, tmp_path, "tls-ok", "--tls-ca", str(pki["ca"]), job=genjob(2 * MB, 0, seed=3))
    assert w.wait(60) == 0, w.err.decode()
    assert sha256_file(home / "tls-ok.out") == expected(2 * MB, 3)
    wrong = run(sh, tmp_path, "tls-wrong-ca", "--tls-ca", str(pki["other-ca"]))
    assert wrong.wait(30) == 123
    assert b"certificate failed verification" in wrong.err
    assert nothing_written(home, "tls-wrong-ca.out")


@pytest.mark.timeout(120)
def test_mutual_tls_and_subject_map(home: Path, tmp_path: Path, shadows: list[ShadowProc],
                                    pki: dict[str, Path]) -> None:
    sh = start_shadow(home, tmp_path, "--tls-cert", str(pki["server"]), "--tls-ca", str(pki["ca"]),
                      "--allow-subject", "alice:alice-*")
    shadows.append(sh)
    tls = ["--tls-ca", str(pki["ca"])]
    ok = run(sh, tmp_path, "alice-1", *tls, "--tls-cert", str(pki["alice"]))
    assert ok.wait(30) == 0, ok.err.decode()
    assert (home / "alice" / "alice-1.out").read_bytes() == b"hello\n", "a certificate's files are under ROOT/CN/"
    cases = {
        "alice-no-cert": [],
        "mallory-1": ["--tls-cert", str(pki["mallory"])],  # a certificate from another CA
        "old-1": ["--tls-cert", str(pki["expired"])],  # an expired certificate
        "bob-1": ["--tls-cert", str(pki["alice"])],  # alice may only write alice-*
    }
    for job_id, extra in cases.items():
        w = run(sh, tmp_path, job_id, *tls, *extra)
        assert w.wait(30) in (122, 123), (job_id, w.err.decode())
        assert nothing_written(home, f"{job_id}.out") and nothing_written(home, f"alice/{job_id}.out"), job_id
        assert (b"TLS failure" in w.err or b"rejected our client certificate" in w.err
                or b"may not write job" in w.err), (job_id, w.err.decode())
    log = sh.log()
    assert "certificate CN=alice may not write job bob-1" in log
    assert log.count("TLS handshake failed") >= 3, log
    assert "expired" in log and ("unknown ca" in log.lower() or "certificate verify failed" in log)
    again = run(sh, tmp_path, "alice-2", *tls, "--tls-cert", str(pki["alice"]))
    assert again.wait(30) == 0, "the shadow keeps serving"


# -- 3. allow-lists and the default posture -----------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("allow", "admitted"), [("10.0.0.0/8", False), ("127.0.0.0/8", True), ("localhost", True),
                                                 (".example.invalid", False)])
def test_allow_list(home: Path, tmp_path: Path, shadows: list[ShadowProc], allow: str, admitted: bool) -> None:
    sh = start_shadow(home, tmp_path, "--allow", allow)
    shadows.append(sh)
    w = run(sh, tmp_path, "host-check")
    if admitted:
        assert w.wait(30) == 0, w.err.decode()
    else:
        assert w.wait(30) == 123
        assert b"not allowed to connect" in w.err
        assert nothing_written(home, "host-check.out")
        assert "refused before reading" in sh.log()


def test_public_address_needs_authentication_or_insecure(home: Path) -> None:
    res = subprocess.run([*tool("gcshadow"), "serve", "--host", "0.0.0.0", "--port", "0", "--root", str(home)],
                         capture_output=True, timeout=30)
    assert res.returncode == 2 and b"without authentication" in res.stderr and b"--insecure" in res.stderr


@pytest.mark.timeout(60)
def test_insecure_public_address_warns(home: Path, tmp_path: Path, shadows: list[ShadowProc]) -> None:
    sh = start_shadow(home, tmp_path, "--host", "0.0.0.0", "--insecure")
    shadows.append(sh)
    assert "WITHOUT authentication" in sh.log()


# -- 4. slowloris and oversized frames ----------------------------------------------------------


@pytest.mark.timeout(120)
def test_slowloris_and_oversized_frames_while_a_job_streams(home: Path, tmp_path: Path,
                                                            shadows: list[ShadowProc]) -> None:
    sh = start_shadow(home, tmp_path, "--handshake-timeout", "2")
    shadows.append(sh)
    w = run(sh, tmp_path, "legit", job=genjob(8 * MB, 0, seed=5, rate=4 * MB))
    idle = [socket.create_connection(("127.0.0.1", sh.port), timeout=10) for _ in range(200)]
    for i, s in enumerate(idle):
        s.sendall(MAGIC[: i % len(MAGIC)])  # never finish the handshake
    try:
        big = socket.create_connection(("127.0.0.1", sh.port), timeout=10)
        big.sendall(MAGIC + (100 << 20).to_bytes(4, "big") + b"\x03")
        reply = big.recv(65536)
        big.close()
        conn = Connection(Role.AGENT)
        conn.send(Hello("x", "y", ()))
        conn.receive_data(reply)
        ev = conn.next_event()
        assert isinstance(ev, Error) and ev.code is ErrorCode.FRAME_TOO_LARGE, ev
        started = time.monotonic()
        for s in idle:  # each is closed by the shadow within its handshake timeout
            s.settimeout(10)
            while s.recv(65536):
                pass
        assert time.monotonic() - started < 8
    finally:
        for s in idle:
            s.close()
    assert w.wait(60) == 0, w.err.decode()
    assert sha256_file(home / "legit.out") == expected(8 * MB, 5)


# -- 5. quotas ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_quota(home: Path, tmp_path: Path, shadows: list[ShadowProc]) -> None:
    sh = start_shadow(home, tmp_path, "--quota", "1MB")
    shadows.append(sh)
    big = run(sh, tmp_path, "greedy", job=genjob(3 * MB, 0, seed=9))
    small = run(sh, tmp_path, "modest", job=genjob(500_000, 0, seed=10))
    assert big.wait(40) == 123
    assert b"would exceed its quota of 1000000 bytes" in big.err
    assert (home / "greedy.out").stat().st_size <= MB
    assert small.wait(40) == 0, "other jobs are unaffected"
    assert sha256_file(home / "modest.out") == expected(500_000, 10)


@pytest.mark.timeout(60)
def test_jobs_per_identity_cap(home: Path, tmp_path: Path, shadows: list[ShadowProc]) -> None:
    sh = start_shadow(home, tmp_path, "--max-jobs-per-identity", "1")
    shadows.append(sh)
    first = run(sh, tmp_path, "first", job=["sh", "-c", "echo one; sleep 3"])
    wait_until(lambda: (home / "first.out").exists() and (home / "first.out").read_bytes() == b"one\n", 30, "first")
    second = run(sh, tmp_path, "second", "--retry-limit", "0")
    assert first.wait(30) == 0
    assert second.wait(40) == 0, "told BUSY, it came back once the first job was done"
    assert b"already has 1 jobs streaming here" in second.err
    assert (home / "second.out").read_bytes() == b"hello\n"


# -- 6. a live shadow fed random and mutated frames --------------------------------------------------


def _mutants(seed: int, n: int) -> Iterator[bytes]:
    import random

    rng = random.Random(seed)
    valid = MAGIC + encode(Hello("fuzz", "f1", (StreamSpec(1, "stdout", "fuzz.out"),))) + encode(Data(1, 0, b"x" * 40))
    for _ in range(n):
        kind = rng.random()
        if kind < 0.3:
            yield rng.randbytes(rng.randint(0, 300))
        elif kind < 0.6:
            yield MAGIC + rng.randbytes(rng.randint(0, 300))
        else:
            b = bytearray(valid)
            for _ in range(rng.randint(1, 6)):
                op = rng.random()
                i = rng.randrange(len(b)) if b else 0
                if op < 0.5 and b:
                    b[i] = rng.randrange(256)
                elif op < 0.75:
                    del b[i : i + rng.randint(1, 8)]
                else:
                    b[i:i] = rng.randbytes(rng.randint(1, 8))
            yield bytes(b)


def fuzz_live_shadow(shadow: ShadowProc, n: int) -> int:
    tried = 0
    for data in _mutants(1234, n):
        with socket.create_connection(("127.0.0.1", shadow.port), timeout=10) as s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):  # the shadow answers and closes, in bounded time
                    pass
            except ConnectionResetError:
                pass
        tried += 1
        assert shadow.proc is not None and shadow.proc.poll() is None, f"the shadow died on input {tried}: {data!r}"
    return tried


@pytest.mark.timeout(300)
def test_live_shadow_survives_random_and_mutated_frames(home: Path, tmp_path: Path,
                                                        shadows: list[ShadowProc],
                                                        request: pytest.FixtureRequest) -> None:
    sh = start_shadow(home, tmp_path, "--handshake-timeout", "2")
    shadows.append(sh)
    n = 20000 if request.config.getoption("--run-slow") else 600
    tried = fuzz_live_shadow(sh, n)
    assert tried == n
    log = sh.log()
    assert "internal error" not in log and "Traceback" not in log, log[-2000:]
    ok = run(sh, tmp_path, "after-fuzz")
    assert ok.wait(30) == 0, "and it still serves"
    print(f"live fuzz: {tried} inputs sent to a live shadow")
