"""End to end: `gcshadow serve --metrics` — Prometheus text at /metrics,
parsed with the client library's own parser, whose counters match the bytes
that landed and the refusals made; /healthz, which turns 503 while the root
is short of space or the state database is stopped, and 200 again after."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from faults import Tmpfs
from helpers import ShadowProc, Wrapper, tool, wait_until
from pgserver import PgServer

parser = pytest.importorskip("prometheus_client.parser", reason="needs the metrics extra: pip install -e '.[metrics]'")

OUT, ERR, FILE = 300_000, 20_000, 50_000


def start(shadows: list[ShadowProc], root: Path, logs: Path, *extra: str) -> tuple[ShadowProc, str]:
    """A shadow serving its metrics on a free loopback port; that port's URL."""
    logs.mkdir(exist_ok=True)
    sh = ShadowProc(root, logs, extra=["--metrics", "127.0.0.1:0", *extra])
    shadows.append(sh)
    sh.start()
    found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", sh.log())
    assert found, sh.log()
    return sh, f"http://127.0.0.1:{found[1]}"


def get(url: str, token: str = "") -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(base: str, token: str = "") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics by name and labels, parsed by prometheus_client's own parser."""
    status, text = get(base + "/metrics", token)
    assert status == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def token_file(path: Path, secret: str) -> Path:
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path


def job(tmp_path: Path, sh: ShadowProc, job_id: str, *extra: str, code: str = "print('hi')") -> Wrapper:
    return Wrapper(["--shadow", sh.address, "--spool", str(tmp_path / "spool"), "--job-id", job_id, "--retry-timeout",
                    "0.2", "--retry-limit", "2", "--stdout", f"{job_id}.out", "--stderr", f"{job_id}.err", *extra,
                    "--", sys.executable, "-c", textwrap.dedent(code)])


def test_metrics_count_the_bytes_landed_and_the_refusals_made(tmp_path: Path, shadows: list[ShadowProc],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.chdir(work)
    tok = token_file(tmp_path / "token", "a" * 64)
    scraper = token_file(tmp_path / "scraper", "s" * 64)
    sh, base = start(shadows, home, tmp_path / "logs", "--token-file", str(tok), "--quota", "1000000",
                     "--metrics-token-file", str(scraper))
    assert get(base + "/metrics")[0] == 401  # (the scrapers' token is asked for, on loopback too)
    assert get(base + "/metrics", "wrong")[0] == 401
    before = scrape(base, "s" * 64)
    assert value(before, "gcshadow_received_bytes_total", kind="stdout") == 0
    assert value(before, "gcshadow_connections_refused_total", reason="authentication") == 0

    gate = tmp_path / "gate"
    w = job(tmp_path, sh, "counted", "--token-file", str(tok), "--file", "result.bin", code=f"""
        import os, sys, time
        sys.stdout.buffer.write(b"o" * {OUT}); sys.stdout.flush()
        sys.stderr.buffer.write(b"e" * {ERR}); sys.stderr.flush()
        with open("result.bin", "wb") as f:
            f.write(b"f" * {FILE})
        end = time.monotonic() + 60
        while not os.path.exists({str(gate)!r}) and time.monotonic() < end:
            time.sleep(0.02)
        """)

    def streaming() -> bool:  # during the job: its session is counted, its output on its way
        s = scrape(base, "s" * 64)
        return (value(s, "gcshadow_jobs_streaming") == 1 and value(s, "gcshadow_sessions_open") == 1
                and value(s, "gcshadow_durable_bytes_total", kind="stdout") == OUT)

    wait_until(streaming, 30, "the job streaming, and its stdout durable, in the metrics")
    gate.touch()
    assert w.wait(60) == 0, w.err
    wrong = job(tmp_path, sh, "wrong", "--token-file", str(token_file(tmp_path / "other", "b" * 64)))
    assert wrong.wait(30) != 0
    over = job(tmp_path, sh, "over", "--token-file", str(tok),
               code="import sys; sys.stdout.buffer.write(b'x' * 2000000)")
    assert over.wait(60) != 0

    after = scrape(base, "s" * 64)
    landed = {"stdout": (home / "counted.out").stat().st_size, "stderr": (home / "counted.err").stat().st_size,
              "files": (home / "result.bin").stat().st_size}
    assert landed == {"stdout": OUT, "stderr": ERR, "files": FILE}
    over_bytes = (home / "over.out").stat().st_size if (home / "over.out").exists() else 0
    for kind, n in landed.items():
        extra = over_bytes if kind == "stdout" else 0
        assert value(after, "gcshadow_durable_bytes_total", kind=kind) == n + extra, kind
        assert value(after, "gcshadow_received_bytes_total", kind=kind) >= n + extra, kind
    log = sh.log()
    assert value(after, "gcshadow_connections_refused_total", reason="authentication") == \
        log.count("authentication failed: wrong token") >= 1
    assert value(after, "gcshadow_connections_refused_total", reason="quota") == \
        log.count("would exceed its quota") >= 1
    assert value(after, "gcshadow_jobs_streaming") == 0
    assert value(after, "gcshadow_frames_total") >= 3
    assert value(after, "gcshadow_ack_latency_seconds_count") >= 1
    assert value(after, "gcshadow_fsync_seconds_count") >= 1
    assert value(after, "gcshadow_durable_group_bytes_sum") >= OUT + ERR
    assert value(after, "gcshadow_state_up") == 1
    assert 0 < value(after, "gcshadow_descriptors_open") < value(after, "gcshadow_descriptors_limit")
    assert value(after, "gcshadow_root_free_bytes") > 0
    assert get(base + "/healthz") == (200, "ok\n")  # (no token: a balancer's check)


@pytest.mark.root
def test_healthz_turns_503_while_the_root_is_short_of_space_and_back(tmp_path: Path,
                                                                      shadows: list[ShadowProc]) -> None:
    with Tmpfs(tmp_path / "small", "8m") as fs:
        _, base = start(shadows, fs.path, tmp_path / "logs", "--min-free", "2MiB")
        assert get(base + "/healthz") == (200, "ok\n")
        filler = fs.fill(leave=512 << 10)
        status, said = get(base + "/healthz")
        assert status == 503 and "disk low at home" in said and "2097152 needed" in said, said
        assert value(scrape(base), "gcshadow_healthy") == 0
        assert value(scrape(base), "gcshadow_root_free_bytes") < 2 << 20
        filler.unlink()
        assert get(base + "/healthz") == (200, "ok\n")
        shadows.pop().stop()  # (before the tmpfs goes)


def test_healthz_turns_503_while_the_state_database_is_stopped_and_back(
        tmp_path: Path, shadows: list[ShadowProc], postgres: PgServer, pg_url: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    _, base = start(shadows, home, tmp_path / "logs", "--state", pg_url)
    assert get(base + "/healthz") == (200, "ok\n")
    postgres.ctl("stop")
    try:
        # (the shadow finds it lost at its next call: its look at the root's space, every 10 s, at the latest)
        wait_until(lambda: get(base + "/healthz")[0] == 503, 30, "/healthz to say 503")
        status, said = get(base + "/healthz")
        assert status == 503 and "the state database is lost" in said, said
        assert value(scrape(base), "gcshadow_state_up") == 0
    finally:
        postgres.ctl("start")
    wait_until(lambda: get(base + "/healthz") == (200, "ok\n"), 30, "/healthz to say 200 again")
    assert value(scrape(base), "gcshadow_state_up") == 1


def test_metrics_without_the_library_is_one_line(tmp_path: Path) -> None:
    # A clean interpreter (-I) in which importing the library fails, as where it is not installed.
    code = ("import sys; sys.modules['prometheus_client'] = None; from gcwrap.shadow_cli import main; "
            "sys.argv = ['gcshadow']+sys.argv[1:]; main()")
    proc = subprocess.run([sys.executable, "-I", "-c", code, "serve", "--port", "0", "--root", str(tmp_path),
                           "--metrics", "9100"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "Error: --metrics needs the 'metrics' extra: pip install 'gcwrap[metrics]' (it adds prometheus-client and h11)"]


def test_metrics_off_loopback_without_authentication_is_refused(tmp_path: Path, shadows: list[ShadowProc]) -> None:
    proc = subprocess.run([*tool("gcshadow"), "serve", "--port", "0", "--root", str(tmp_path), "--metrics",
                           "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to serve 0.0.0.0 without authentication" in proc.stderr
    assert "--metrics-token-file" in proc.stderr and "Traceback" not in proc.stderr
    bad = subprocess.run([*tool("gcshadow"), "serve", "--root", str(tmp_path), "--metrics", "host:port"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not [HOST:]PORT" in bad.stderr, bad.stderr
    # ...unless asked for: then it serves, and says so.
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(tmp_path, logs, extra=["--metrics", "0.0.0.0:0", "--metrics-insecure"])
    shadows.append(sh)
    sh.start()
    assert "serving 0.0.0.0 WITHOUT authentication (--metrics-insecure)" in sh.log()
    found = re.search(r"metrics on http://0\.0\.0\.0:(\d+)/metrics", sh.log())
    assert found, sh.log()
    assert value(scrape(f"http://127.0.0.1:{found[1]}"), "gcshadow_state_up") == 1


def test_healthz_turns_503_once_the_root_is_gone(tmp_path: Path, shadows: list[ShadowProc]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    _, base = start(shadows, home, tmp_path / "logs")
    assert get(base + "/healthz") == (200, "ok\n")
    home.rename(tmp_path / "moved")  # (the shadow takes no job until restarted: its root is not where it was)
    wait_until(lambda: get(base + "/healthz")[0] == 503, 10, "/healthz to say 503")
    status, said = get(base + "/healthz")
    assert status == 503 and f"the root {home} is gone" in said, said


def _exchange(port: int, request: bytes) -> bytes:
    """What the listener answers one raw request with, until it closes (bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def test_the_metrics_listener_answers_as_the_web_view_does(tmp_path: Path, shadows: list[ShadowProc]) -> None:
    # One HTTP base serves both (gcwrap.shadow.httpserve): a request h11 cannot parse is told 400 and why,
    # a body past the limit 413, and a kept-alive connection answers each request in turn.
    _, base = start(shadows, tmp_path, tmp_path / "logs")
    port = int(base.rpartition(":")[2])
    garbage = _exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400 Bad Request\r\n"), garbage
    big = _exchange(port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
    assert big.startswith(b"HTTP/1.1 413 "), big
    two = _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                          b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert two.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\n\r\nok\n" in two, two
    assert b"HTTP/1.1 404 Not Found\r\n" in two and two.endswith(b"/metrics and /healthz are here\n"), two
