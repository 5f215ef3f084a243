"""`gcshadow web`: the JSON endpoints, the live event stream, the refusals and
the authentication, against a real gcshadow, real gcwrap jobs and a real
`gcshadow web` process on loopback (no browser here: see test_web_browser.py).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers import ShadowProc, Wrapper, genjob, sha256_file, stop_process, tool, wait_until

pytestmark = pytest.mark.timeout(120)

# A job that writes what a test asks for, when it asks: a line per file the
# test creates (go-1, go-2, ...), until the file "exit" holds its status.
STEP_JOB = r"""
import os, sys, time
d = sys.argv[1]
print("first line, before any page", flush=True)
print("a line on stderr", file=sys.stderr, flush=True)
deadline = time.monotonic() + 90
n = 1
while time.monotonic() < deadline:
    if os.path.exists(os.path.join(d, f"go-{n}")):
        print(f"line {n}, written when the test said go", flush=True)
        n += 1
        continue
    if os.path.exists(os.path.join(d, "exit")):
        sys.exit(int(open(os.path.join(d, "exit")).read()))
    time.sleep(0.02)
sys.exit(99)
"""


class WebClient:
    """Requests to a `gcshadow web` at host:port."""

    host = "127.0.0.1"
    port = 0

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get(self, path: str, headers: dict[str, str] | None = None, method: str = "GET",
            body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=20)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            res = conn.getresponse()
            return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
        finally:
            conn.close()

    def json(self, path: str, headers: dict[str, str] | None = None) -> Any:
        status, hdrs, body = self.get(path, headers)
        assert status == 200, (status, body)
        assert hdrs["content-type"] == "application/json"
        return json.loads(body)

    def events(self, path: str, until: str, timeout: float = 30,
               headers: dict[str, str] | None = None) -> Iterator[tuple[str, Any, str]]:
        """(event, data, id) of the event stream at `path`, until an `until` event (or the stream ends)."""
        deadline = time.monotonic() + timeout
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{extra}\r\n".encode())
            f = sock.makefile("rb")
            status = f.readline()
            assert b" 200 " in status, status + f.read(2000)
            while f.readline() not in (b"\r\n", b""):
                pass
            name, data, ident = "message", "", ""
            while time.monotonic() < deadline:
                size = f.readline()  # chunked transfer: a size line, the chunk, CRLF
                if not size or int(size, 16) == 0:
                    return
                chunk = f.read(int(size, 16))
                f.readline()
                for line in chunk.decode().split("\n"):
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
                    elif line.startswith("id: "):
                        ident = line[4:]
                    elif line == "" and data:
                        yield name, json.loads(data), ident
                        if name == until:
                            return
                        name, data = "message", ""
            raise AssertionError(f"no {until!r} event within {timeout} s")
        finally:
            sock.close()


class WebProc(WebClient):
    """A `gcshadow web` process on a free port, stopped by pid."""

    def __init__(self, root: Path, logdir: Path, extra: Sequence[str] = (), host: str = "127.0.0.1") -> None:
        self.host = host
        port_file = logdir / f"web-port-{os.getpid()}-{time.monotonic_ns()}"
        self.log_path = logdir / f"{port_file.name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*tool("gcshadow"), "web", "--root", str(root), "--host", host, "--port", "0",
                 "--port-file", str(port_file), *extra],
                stdout=log, stderr=log, start_new_session=True,
            )

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"gcshadow web exited with {self.proc.returncode}: {self.log()}")
            return port_file.exists()

        wait_until(ready, 30, "gcshadow web to listen")
        self.port = int(port_file.read_text())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc)


class InProcessWeb(WebClient):
    """The web view run in this process, in a thread of its own: for tests
    that choose what the state's readers give it (monkeypatched), such as
    a timeline or refused connections."""

    def __init__(self, root: Path) -> None:
        import threading

        import trio

        from gcwrap.shadow.web import WebOptions, run_web

        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.scope: trio.CancelScope | None = None
        self.token: trio.lowlevel.TrioToken | None = None

        async def main() -> None:
            self.token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:
                self.scope = nursery.cancel_scope
                self.port = await nursery.start(run_web, WebOptions(root=root, port=0))
                self.ready.set()

        def thread() -> None:
            try:
                trio.run(main)
            except BaseException as e:  # noqa: BLE001 - reported by the test's thread
                self.failed = e
                self.ready.set()

        self.thread = threading.Thread(target=thread, name="web", daemon=True)
        self.thread.start()
        assert self.ready.wait(30), "the web view did not start within 30 s"
        if self.failed is not None:
            raise AssertionError(f"the web view failed: {self.failed!r}")

    def stop(self) -> None:
        import trio

        if self.scope is not None and self.token is not None and self.thread.is_alive():
            trio.from_thread.run_sync(self.scope.cancel, trio_token=self.token)
        self.thread.join(10)
        assert not self.thread.is_alive(), "the web view did not stop"


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture
def web(home: Path, shadow: ShadowProc, logs: Path) -> Iterator[WebProc]:
    w = WebProc(home, logs)
    try:
        yield w
    finally:
        w.stop()


def step_job(shadow: ShadowProc, steps: Path, job_id: str, spool: Path, stdout: str = "out/step.txt") -> Wrapper:
    steps.mkdir(parents=True, exist_ok=True)
    return Wrapper(["--shadow", shadow.address, "--stdout", stdout, "--stderr", stdout + ".err", "--job-id", job_id,
                    "--spool", str(spool), "--", sys.executable, "-c", STEP_JOB, str(steps)])


def job_state(web: WebProc, job_id: str) -> dict[str, Any] | None:
    return next((j for j in web.json("/api/jobs")["jobs"] if j["job_id"] == job_id), None)


def run_job(shadow: ShadowProc, spool: Path, job_id: str, out: int, err: int = 0, status: int = 0) -> None:

    w = Wrapper(["--shadow", shadow.address, "--stdout", f"out/{job_id}.txt", "--stderr", f"out/{job_id}.err",
                 "--job-id", job_id, "--spool", str(spool), "--", *genjob(out, err, seed=7, exit=status)])
    assert w.wait(60) == status, w.err


# -- the JSON endpoints and the event stream ------------------------------------------------


def test_json_endpoints_describe_jobs_and_serve_whole_files(web: WebProc, shadow: ShadowProc, home: Path,
                                                            spool_dir: Path) -> None:
    run_job(shadow, spool_dir, "done-1", out=300_000, err=5_000, status=3)
    wait_until(lambda: (job_state(web, "done-1") or {}).get("state") == "finished", 20, "the web view to see the end")
    listing = web.json("/api/jobs")
    assert listing["root"] == str(home.resolve()) and listing["error"] == ""
    job = web.json("/api/jobs/done-1")
    assert job["exit_code"] == 3 and job["exit"] == "status 3" and job["failed"] is True
    assert {s["kind"]: s["bytes"] for s in job["streams"]} == {"stdout": 300_000, "stderr": 5_000}
    assert job["bytes"] == 305_000
    assert job["summary"]["stdout_bytes"] == "300000"
    assert job["live"] == "/api/jobs/done-1/events" and job["page"] == "/jobs/done-1"
    assert isinstance(job["events"], list) and isinstance(job["why"], str)  # the timeline: see below
    assert job["duration_s"] >= 0 and isinstance(job["duration_s"], float)
    for kind, name in (("stdout", "out/done-1.txt"), ("stderr", "out/done-1.err")):
        status, headers, body = web.get(f"/api/jobs/done-1/files/{kind}")
        assert status == 200
        assert hashlib.sha256(body).hexdigest() == sha256_file(home / name)
        assert headers["content-type"] == "application/octet-stream"
        assert headers["content-disposition"].startswith("attachment;")
        assert headers["x-content-type-options"] == "nosniff"
    status, headers, body = web.get("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in headers["content-security-policy"] and b"<script>" not in body
    status, headers, _ = web.get("/jobs/done-1", method="HEAD")
    assert status == 200 and headers["content-type"].startswith("text/html")


def test_event_stream_sends_the_tail_then_only_new_bytes_then_the_end(web: WebProc, shadow: ShadowProc, home: Path,
                                                                      tmp_path: Path, spool_dir: Path) -> None:
    steps = tmp_path / "steps"
    job = step_job(shadow, steps, "live-1", spool_dir)
    wait_until(lambda: (job_state(web, "live-1") or {}).get("bytes", 0) > 40, 30, "the job's first lines at home")
    seen: dict[str, str] = {"stdout": "", "stderr": ""}
    ends: dict[str, int] = {"stdout": 0, "stderr": 0}
    asked = 0
    final: dict[str, Any] = {}
    for name, data, ident in web.events("/api/jobs/live-1/events", until="end", timeout=60):
        if name == "data":
            assert data["offset"] == ends[data["stream"]], "a byte sent twice or skipped"
            seen[data["stream"]] += data["text"]
            ends[data["stream"]] = data["end"]
            assert f"stdout={ends['stdout']}" in ident and f"stderr={ends['stderr']}" in ident
        elif name == "job":
            final = data
        # Ask for each next line only once the previous one has come: each is written after the stream opened.
        if asked < 3 and seen["stdout"].count("\n") == asked + 1:
            asked += 1
            (steps / f"go-{asked}").touch()
        elif asked == 3 and "line 3," in seen["stdout"] and not (steps / "exit").exists():
            (steps / "exit").write_text("5")
    assert job.wait(30) == 5
    assert seen["stdout"].encode() == (home / "out/step.txt").read_bytes()
    assert seen["stderr"].encode() == (home / "out/step.txt.err").read_bytes()
    assert "line 3, written when the test said go" in seen["stdout"]
    assert final["state"] == "finished" and final["exit_code"] == 5


def test_event_stream_resumes_at_last_event_id_and_shows_only_the_tail(web: WebProc, shadow: ShadowProc,
                                                                       home: Path, spool_dir: Path) -> None:
    run_job(shadow, spool_dir, "big-1", out=200_000)
    wait_until(lambda: (job_state(web, "big-1") or {}).get("state") == "finished", 20, "the job's end")
    landed = (home / "out/big-1.txt").read_bytes()
    events = list(web.events("/api/jobs/big-1/events?tail=16", until="end"))
    skips = [d for n, d, _ in events if n == "skip" and d["stream"] == "stdout"]
    assert len(skips) == 1 and skips[0]["from"] == 0 and skips[0]["to"] >= 200_000 - 16 * 1024 - 4096
    got = [d for n, d, _ in events if n == "data" and d["stream"] == "stdout"]
    assert got[0]["offset"] == skips[0]["to"] and got[-1]["end"] == 200_000
    # A reconnecting EventSource sends the id of the last event it saw: the stream goes on from there, byte-exact.
    instance = web.json("/api/jobs/big-1")["instance"]
    resumed = list(web.events("/api/jobs/big-1/events", until="end",
                              headers={"Last-Event-ID": f"stdout=150000&stderr=0&instance={instance}"}))
    data = [d for n, d, _ in resumed if n == "data" and d["stream"] == "stdout"]
    assert data[0]["offset"] == 150_000 and data[-1]["end"] == 200_000
    assert not [d for n, d, _ in resumed if n == "skip"]
    text = "".join(d["text"] for d in data)
    assert text == landed[150_000:].decode("utf-8", "replace")


@pytest.mark.parametrize("how", ["query", "option"])
def test_a_tail_larger_than_the_far_behind_limit_is_sent_once(home: Path, shadow: ShadowProc, logs: Path,
                                                                  spool_dir: Path, how: str) -> None:
    # An 8 MiB tail is more than a page may lag before it is skipped ahead (4 MiB): the stream once
    # jumped back to the tail's start after each 1 MiB it sent, the same bytes again and again, forever.
    size = 12 << 20
    run_job(shadow, spool_dir, "huge-1", out=size)
    web = WebProc(home, logs, ["--tail", "8192"] if how == "option" else [])
    try:
        wait_until(lambda: (job_state(web, "huge-1") or {}).get("state") == "finished", 20, "the job's end")
        path = "/api/jobs/huge-1/events" + ("?tail=8192" if how == "query" else "")
        started = time.monotonic()
        sent, ids, skips, data, names = 0, set(), [], [], []
        for name, d, ident in web.events(path, until="end", timeout=60):
            names.append(name)
            if name == "skip":
                skips.append(d)
            elif name == "data" and d["stream"] == "stdout":
                assert d["offset"] == (data[-1]["end"] if data else skips[0]["to"]), "a byte sent twice or skipped"
                data.append({"offset": d["offset"], "end": d["end"]})
                sent += d["end"] - d["offset"]
                ids.add(ident)
                assert sent <= 8 << 20, f"{sent} bytes of an 8 MiB tail sent"
        elapsed = time.monotonic() - started
    finally:
        web.stop()
    assert names[-1] == "end"
    assert len(skips) == 1 and skips[0]["from"] == 0 and size - (8 << 20) <= skips[0]["to"] <= size - (8 << 20) + 4096
    assert data[-1]["end"] == size and sent == size - skips[0]["to"]  # each byte of the tail once
    assert len(ids) == len(data)  # every event moved the stream on
    assert elapsed < 20, f"{elapsed:.1f} s to send 8 MiB"


LINES_JOB = "import sys\nw = sys.stdout.write\nfor i in range(1, int(sys.argv[1]) + 1):\n    w(f'line {i:07d}\\n')\n"


def line_job(shadow: ShadowProc, spool: Path, job_id: str, lines: int) -> None:
    """A job that writes `lines` lines of 13 bytes: "line 0000001"..."""
    w = Wrapper(["--shadow", shadow.address, "--stdout", f"out/{job_id}.txt", "--job-id", job_id,
                 "--spool", str(spool), "--", sys.executable, "-c", LINES_JOB, str(lines)])
    assert w.wait(60) == 0, w.err


def test_lines_are_numbered_as_in_the_file_and_a_page_may_start_at_a_line(web: WebProc, shadow: ShadowProc,
                                                                           home: Path, spool_dir: Path) -> None:
    count = 500_000  # 6.5 MB: more than a page may lag behind, so that a page opened at a line skips to the tail
    line_job(shadow, spool_dir, "lines-1", count)
    wait_until(lambda: (job_state(web, "lines-1") or {}).get("state") == "finished", 30, "the job's end")
    landed = (home / "out/lines-1.txt").read_bytes()
    size = len(landed)

    def number(offset: int) -> int:
        return landed.count(b"\n", 0, offset) + 1

    def check(events: list[tuple[str, Any, str]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Each skip and data event's line is the file's; each byte at most once, in order."""
        skips = [d for n, d, _ in events if n == "skip"]
        data = [d for n, d, _ in events if n == "data"]
        at = 0
        for name, d, _ in events:
            if name == "skip":
                assert d["from"] == at and d["to"] > at and d["line"] == number(d["to"])
                at = d["to"]
            elif name == "data":
                assert d["offset"] == at and d["line"] == number(d["offset"]), (d["offset"], d["line"])
                assert d["text"].encode() == landed[d["offset"]:d["end"]]
                at = d["end"]
        assert at == size and events[-1][0] == "end"
        return skips, data

    # At the tail: its first line has the number it has in the file.
    skips, data = check(list(web.events("/api/jobs/lines-1/events?tail=16", until="end")))
    assert len(skips) == 1 and data[0]["line"] == number(skips[0]["to"]) > count - 16 * 1024 // 13 - 1
    assert data[0]["text"].startswith(f"line {data[0]['line']:07d}\n")
    # At line 120 (a link to it): from that line, `tail` bytes of it, then a skip to the tail.
    skips, data = check(list(web.events("/api/jobs/lines-1/events?tail=16&stdout_line=120", until="end")))
    assert skips[0]["to"] == 119 * 13 and data[0]["line"] == 120 and data[0]["text"].startswith("line 0000120\n")
    assert len(skips) == 2 and skips[1]["from"] >= skips[0]["to"] + 16 * 1024
    # A line past the end: the tail.
    skips, data = check(list(web.events("/api/jobs/lines-1/events?tail=16&stdout_line=9999999", until="end")))
    assert len(skips) == 1 and skips[0]["to"] >= size - 16 * 1024 - 4096
    # A page that reconnects gives its offsets: numbered from there.
    instance = web.json("/api/jobs/lines-1")["instance"]
    resumed = list(web.events("/api/jobs/lines-1/events", until="end",
                              headers={"Last-Event-ID": f"stdout={size - 1300}&instance={instance}"}))
    data = [d for n, d, _ in resumed if n == "data"]
    assert data[0]["line"] == count - 99 and data[0]["text"].startswith(f"line {count - 99:07d}\n")
    status, _, body = web.get("/api/jobs/lines-1/events?stdout_line=x")
    assert status == 400 and b"whole numbers" in body


def test_line_counts_agree_with_the_file_however_they_are_asked(tmp_path: Path) -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from gcwrap.shadow import webstate


    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=300).map(lambda b: b.replace(b"\x00", b"\n")),
           st.lists(st.tuples(st.booleans(), st.integers(0, 400)), max_size=12))
    def agree(content: bytes, asks: list[tuple[bool, int]]) -> None:
        path = tmp_path / "f"
        path.write_bytes(content + b"tail not yet durable\n")
        lines = webstate.Lines(webstate.LineOptions(mark=7))  # many checkpoints in a small file
        fd = os.open(path, os.O_RDONLY)
        try:
            for by_line, n in asks:
                if by_line:  # where line n starts, within the durable bytes
                    starts = [0] + [i + 1 for i, c in enumerate(content) if c == 10]
                    want = starts[n - 1] if 1 <= n <= len(starts) else (0 if n < 1 else None)
                    assert lines.offset_of(fd, n, len(content)) == want, (content, n)
                else:
                    offset = min(n, len(content))
                    assert lines.line_at(fd, offset) == content.count(b"\n", 0, offset) + 1
                assert lines.marks == sorted(lines.marks) and lines.marks[0] == (0, 0)
                for at, before in lines.marks:
                    assert content.count(b"\n", 0, at) == before
        finally:
            os.close(fd)

    agree()


def test_lines_far_from_any_checkpoint_are_not_counted(tmp_path: Path) -> None:
    from gcwrap.shadow import webstate

    path = tmp_path / "f"
    path.write_bytes(b"123456789\n" * 100)  # 1000 bytes, line n at (n - 1) * 10
    fd = os.open(path, os.O_RDONLY)
    try:
        lines = webstate.Lines(webstate.LineOptions(mark=100, most=250))
        assert lines.line_at(fd, 900) is None  # 900 bytes to read from the only checkpoint
        assert lines.offset_of(fd, 91, 1000) is None
        assert lines.line_at(fd, 250) == 26  # ...but step by step the checkpoints come
        assert lines.line_at(fd, 500) == 51 and lines.line_at(fd, 750) == 76 and lines.line_at(fd, 900) == 91
        assert lines.offset_of(fd, 100, 1000) == 990 and lines.offset_of(fd, 101, 1000) == 1000  # (not written yet)
        assert lines.offset_of(fd, 102, 1000) is None
        lines.cut(300)  # the file was cut back: nothing counted past 300 is kept
        assert all(at <= 300 for at, _ in lines.marks) and lines.line_at(fd, 300) == 31
    finally:
        os.close(fd)


def _timeline(t0: float) -> list[dict[str, Any]]:
    return [
        {"time": t0, "kind": "session_opened", "source": "shadow", "details": {"session": 1, "peer": "10.1.2.3:4000",
                                                                            "host": "node7"}},
        {"time": t0 + 5, "kind": "stalled", "source": "agent", "details": {"since": t0 + 1, "seconds": 4.0,
                                                                          "shadow": "home:50000"}},
        {"time": t0 + 9, "kind": "connection_lost", "source": "agent",
         "details": {"reason": "connection reset", "worked_at": t0 + 6, "shadow": "home:50000"}},
    ]


REFUSALS = [
    {"time": 1_700_000_100.0, "peer": "10.9.8.7:5000", "identity": "", "job_id": "wrong-token-job",
     "code": "AUTH_FAILED", "message": "authentication failed: wrong token"},
    {"time": 1_700_000_000.0, "peer": "10.9.8.6:5001", "identity": "cn=alice", "job_id": "",
     "code": "BAD_HELLO", "message": "not a gcwrap"},
]


def record_timeline(monkeypatch: pytest.MonkeyPatch, timelines: dict[str, list[dict[str, Any]]],
                    whys: dict[str, str], refusals: list[dict[str, Any]]) -> None:
    """Make the state's readers give these timelines, "why"s and refusals (as a shadow that records them does)."""
    from gcwrap.shadow import backends

    real = backends.read_jobs

    def read_jobs(state: str, root: Path, **kw: Any) -> list[dict[str, Any]]:
        jobs = real(state, root, **kw)
        for job in jobs:
            if job["job_id"] in timelines:
                job["events"], job["why"] = list(timelines[job["job_id"]]), whys.get(job["job_id"], "")
        return jobs

    monkeypatch.setattr(backends, "read_jobs", read_jobs)
    monkeypatch.setattr(backends, "read_refusals", lambda state, root, limit=200: list(refusals[:limit]))


def test_the_timeline_why_and_refusals_the_state_records_are_served(home: Path, shadow: ShadowProc, tmp_path: Path,
                                                                    spool_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    steps = tmp_path / "steps"
    job = step_job(shadow, steps, "timed-1", spool_dir)
    t0 = time.time() - 60
    timeline = _timeline(t0)
    record_timeline(monkeypatch, {"timed-1": timeline[:2]}, {"timed-1": "stalled: nothing acknowledged for 4 s"},
                    REFUSALS)
    web = InProcessWeb(home)
    try:
        wait_until(lambda: (job_state(web, "timed-1") or {}).get("why", "").startswith("stalled"), 20, "the why")
        listed = job_state(web, "timed-1")
        assert listed is not None and "events" not in listed  # the list stays light: a job's timeline is its own
        one = web.json("/api/jobs/timed-1")
        assert one["events"] == timeline[:2] and one["why"] == "stalled: nothing acknowledged for 4 s"
        assert web.json("/api/refusals") == {"error": "", "refusals": REFUSALS}
        seen: list[list[dict[str, Any]]] = []
        for name, data, _ in web.events("/api/jobs/timed-1/events", until="end", timeout=60):
            if name == "timeline":
                seen.append(data["events"])
                if len(seen) == 1:  # the shadow records one more event while the page is open
                    timeline_now = timeline  # the reader gives all three from now on
                    record_timeline(monkeypatch, {"timed-1": timeline_now}, {"timed-1": "disconnected since 14:02"},
                                    REFUSALS)
                elif not (steps / "exit").exists():
                    (steps / "exit").write_text("0")
            elif name == "job" and len(seen) == 2:
                assert data["why"] == "disconnected since 14:02" and "events" not in data
        assert seen == [timeline[:2], timeline]
        assert job.wait(30) == 0
    finally:
        web.stop()


# -- refusals ---------------------------------------------------------------------------


def _set_name(home: Path, job_id: str, kind: str, name: str) -> None:
    """Change what the state says a stream's file is (as a tampered or hostile state would)."""
    conn = sqlite3.connect(home / ".gcshadow" / "state.db", timeout=10)
    try:
        with conn:
            conn.execute("UPDATE streams SET name = ? WHERE job_id = ? AND kind = ?", [name, job_id, kind])
    finally:
        conn.close()


def test_unknown_jobs_and_paths_outside_the_state_are_not_found(web: WebProc, shadow: ShadowProc,
                                                                spool_dir: Path) -> None:
    run_job(shadow, spool_dir, "known", out=1000)
    wait_until(lambda: job_state(web, "known") is not None, 20, "the job")
    for path in ("/api/jobs/nope", "/api/jobs/nope/events", "/api/jobs/nope/files/stdout", "/jobs/nope",
                 "/api/jobs/known/files/stdin", "/api/jobs/known/files/..%2F..%2Fetc%2Fpasswd",
                 "/api/jobs/..%2F..%2Fetc/files/stdout", "/static/../../etc/passwd",
                 "/static/..%2F..%2F..%2Fetc%2Fpasswd", "/static/jobs.html", "/etc/passwd",
                 "/api/jobs/known/files/stdout/extra"):
        status, _, body = web.get(path)
        assert status == 404, (path, status, body)
        assert b"root:" not in body
    status, _, body = web.get("/jobs/%3Cb%3Eno%3C%2Fb%3E")
    assert status == 404 and b"&lt;b&gt;no&lt;/b&gt;" in body and b"<b>no</b>" not in body
    status, _, _ = web.get("/api/jobs", method="POST", body=b"x")
    assert status == 405


def test_files_are_refused_through_symlinks_hard_links_and_names_leaving_the_root(
        web: WebProc, shadow: ShadowProc, home: Path, tmp_path: Path, spool_dir: Path) -> None:
    run_job(shadow, spool_dir, "victim", out=1000, err=1000)
    wait_until(lambda: (job_state(web, "victim") or {}).get("state") == "finished", 20, "the job's end")
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0 a secret outside the root\n")
    # stdout: the landed file replaced by a symlink to a file outside the root
    (home / "out/victim.txt").unlink()
    (home / "out/victim.txt").symlink_to(secret)
    status, _, body = web.get("/api/jobs/victim/files/stdout")
    assert status == 403 and b"symlink" in body and b"secret" not in body
    # stderr: a second (hard) link to the landed file outside the root
    os.link(home / "out/victim.err", tmp_path / "linked.err")
    status, _, body = web.get("/api/jobs/victim/files/stderr")
    assert status == 403 and b"hard links" in body
    # the event stream says why, per stream, and sends none of those bytes
    events = list(web.events("/api/jobs/victim/events", until="end"))
    refused = {d["stream"]: d["reason"] for n, d, _ in events if n == "refused"}
    assert set(refused) == {"stdout", "stderr"}
    assert not [d for n, d, _ in events if n == "data"]
    # names the shadow itself would refuse, should the state say so
    for name, why in (("../secret.txt", b"'..'"), (str(secret), b"absolute"), (".gcshadow/state.db", b"state"),
                      ("out/../../secret.txt", b"'..'")):
        _set_name(home, "victim", "stdout", name)
        wait_until(lambda name=name: next(s for s in web.json("/api/jobs/victim")["streams"]
                                          if s["kind"] == "stdout")["name"] == name, 10, "the web view to see it")
        status, _, body = web.get("/api/jobs/victim/files/stdout")
        assert status == 403 and why in body, (name, body)
        assert b"a secret" not in body
    assert "refused to serve" in web.log()


# -- who may connect --------------------------------------------------------------------


def test_loopback_view_answers_only_to_loopback_names(web: WebProc) -> None:
    # A page elsewhere that rebinds its own name to 127.0.0.1 must not read the jobs.
    status, _, body = web.get("/api/jobs", headers={"Host": "attacker.example:8080"})
    assert status == 403 and b"loopback" in body
    for host in (f"127.0.0.1:{web.port}", f"localhost:{web.port}", "localhost"):
        assert web.get("/api/jobs", headers={"Host": host})[0] == 200


def test_non_loopback_address_needs_authentication_or_insecure(home: Path) -> None:
    runner = CliRunner()
    from gcwrap.shadow_cli import main

    result = runner.invoke(main, ["web", "--root", str(home), "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 2
    assert "refusing to serve 0.0.0.0 without authentication" in result.output
    assert "--token-file" in result.output and "--insecure" in result.output
    token = home.parent / "token"
    token.write_text("t" * 32)
    token.chmod(0o644)
    result = runner.invoke(main, ["web", "--root", str(home), "--host", "0.0.0.0", "--token-file", str(token)])
    assert result.exit_code == 2 and "chmod 600" in result.output


def test_without_the_web_extra_it_says_what_to_install(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gcwrap.shadow_cli import main

    monkeypatch.setitem(sys.modules, "h11", None)  # as if not installed: importing it raises ImportError
    result = CliRunner().invoke(main, ["web", "--root", str(home)])
    assert result.exit_code == 1
    assert "pip install 'gcwrap[web]'" in result.output


@pytest.mark.root
def test_token_is_required_on_a_non_loopback_address(home: Path, shadow: ShadowProc, logs: Path,
                                                     spool_dir: Path) -> None:
    from faults import HOST_IP, NetNS, need_netns

    need_netns()
    run_job(shadow, spool_dir, "secret-job", out=1000)
    token = logs / "web-token"
    token.write_text("s3cret-token-of-the-web-view-0123456789\n")
    token.chmod(0o600)
    with NetNS():
        web = WebProc(home, logs, ["--token-file", str(token)], host=HOST_IP)
        try:
            for path in ("/api/jobs", "/api/jobs/secret-job", "/api/jobs/secret-job/files/stdout",
                         "/api/jobs/secret-job/events"):
                status, headers, body = web.get(path)
                assert status == 401 and headers["www-authenticate"].startswith("Bearer"), (path, status)
                assert b"secret-job" not in body
                status, _, _ = web.get(path, headers={"Authorization": "Bearer wrong-token-wrong-token-wrong"})
                assert status == 401
            status, headers, _ = web.get("/jobs/secret-job")
            assert status == 303 and headers["location"] == "/login?next=/jobs/secret-job"
            good = {"Authorization": "Bearer s3cret-token-of-the-web-view-0123456789"}
            assert [j["job_id"] for j in web.json("/api/jobs", good)["jobs"]] == ["secret-job"]
            # the login form: a wrong token is refused, the right one sets an HttpOnly session cookie
            status, _, _ = web.get("/login", method="POST", body=b"token=nope&next=/",
                                   headers={"Content-Type": "application/x-www-form-urlencoded"})
            assert status == 401
            status, headers, _ = web.get(
                "/login", method="POST", body=b"token=s3cret-token-of-the-web-view-0123456789&next=//evil.example/",
                headers={"Content-Type": "application/x-www-form-urlencoded"})
            assert status == 303 and headers["location"] == "/"  # never a redirect to another site
            cookie = headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "s3cret" not in cookie
            session = {"Cookie": cookie.split(";")[0]}
            assert web.get("/api/jobs/secret-job", headers=session)[0] == 200
            forged = {"Cookie": cookie.split(";")[0][:-4] + "0000"}
            assert web.get("/api/jobs/secret-job", headers=forged)[0] == 401
        finally:
            web.stop()


# -- the pieces, without processes ------------------------------------------------------------


def test_rate_is_measured_over_the_last_seconds_and_falls_to_zero_when_idle() -> None:
    from gcwrap.shadow.webstate import RATE_WINDOW, StreamSeen

    seen = StreamSeen("i1")
    seen.add(100.0, 0, 1000.0)
    assert seen.rate(100.2) is None  # no window yet
    for k in range(1, 11):  # 1000 bytes/s for 10 s
        seen.add(100.0 + k, 1000 * k, 1000.0 + k)
    assert seen.rate(110.0) == pytest.approx(1000.0)
    assert seen.last_byte_at == 1010.0
    assert len(seen.samples) <= RATE_WINDOW + 2  # old samples are dropped
    seen.add(112.0, 10_000, 1012.0)  # nothing new for 2 s: the rate falls...
    assert seen.rate(112.0) == pytest.approx(3000 / RATE_WINDOW)
    seen.add(120.0, 10_000, 1020.0)  # ...to zero once the window holds no new byte
    assert seen.rate(120.0) == 0.0
    assert seen.last_byte_at == 1010.0


def test_the_tail_starts_at_a_line(tmp_path: Path) -> None:
    from gcwrap.shadow.webstate import tail_start

    path = tmp_path / "f"
    path.write_bytes(b"".join(b"line %04d\n" % i for i in range(1000)))  # 10 bytes a line
    fd = os.open(path, os.O_RDONLY)
    try:
        assert tail_start(fd, 10_000, 20_000) == 0
        assert tail_start(fd, 10_000, 95) == 9_910  # 95 bytes back is mid-line: the next line's start
        assert tail_start(fd, 10_000, 100) == 9_900  # exactly a line's start
        assert tail_start(fd, 5_000, 30) == 4_970
    finally:
        os.close(fd)


def test_a_session_cookie_is_made_with_the_token_and_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    from gcwrap.shadow import web

    token = b"t" * 32
    cookie = web._new_session(token)
    assert web._valid_session(token, cookie)
    assert not web._valid_session(b"u" * 32, cookie)  # another token
    issued, nonce, mac = cookie.split(".")
    assert not web._valid_session(token, f"{issued}.{nonce}.{'0' * len(mac)}")
    assert not web._valid_session(token, f"{int(issued) + 86400}.{nonce}.{mac}")  # the date is signed too
    assert not web._valid_session(token, "")
    now = time.time()
    monkeypatch.setattr(web.time, "time", lambda: now + web.SESSION_DAYS * 86400 + 60)
    assert not web._valid_session(token, cookie)


def test_a_job_is_shown_the_same_from_either_state(tmp_path: Path) -> None:
    # The SQLite state holds a job's command and summary as JSON text; a shared state's reader gives them decoded.
    from gcwrap.shadow.webstate import StateReader

    reader = StateReader(tmp_path, -1)
    base = {"job_id": "j-1", "instance": "i1", "state": "finished", "streams": [], "first_seen": 100.0,
            "ended": 104.0, "exit_code": 0}
    as_text = reader.job_view({**base, "command": '["python3", "x.py"]', "summary": '{"job_started": "100.5", '
                               '"job_ended": "103.0"}'}, wall=200.0)
    decoded = reader.job_view({**base, "command": ["python3", "x.py"], "summary": {"job_started": "100.5",
                                                                                  "job_ended": "103.0"}}, wall=200.0)
    assert as_text == decoded
    assert decoded["command"] == ["python3", "x.py"] and decoded["duration_s"] == 2.5  # the job's own start and end
    running = reader.job_view({**base, "state": "streaming", "ended": None, "command": None, "summary": "{"},
                              wall=130.0)
    assert running["command"] == [] and running["summary"] == {} and running["duration_s"] == 30.0


def test_a_jobs_page_lists_the_files_it_writes_with_their_sizes_and_versions(
        web: WebProc, shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # (gcwrap's --file PATHs are relative to its working directory)
    code = ("import os, time\n"
            "open('log.txt', 'w').write('a line\\n' * 100)\n"
            "for step in range(3):\n"
            "    open('.s.tmp', 'w').write(f'step {step}\\n' * (step + 1))\n"
            "    os.replace('.s.tmp', 'status.txt')\n"
            "    time.sleep(1.3)\n"
            "while not os.path.exists('go'):\n"
            "    time.sleep(0.02)\n")
    w = Wrapper(["--shadow", shadow.address, "--stdout", "out/files.txt", "--job-id", "files-1", "--spool",
                 str(spool_dir), "--file", "log.txt=out/log.txt", "--file", "status.txt=out/status.txt", "--",
                 sys.executable, "-c", code])

    def files() -> dict[str, dict[str, Any]]:
        job = job_state(web, "files-1") or {}
        return {f["name"]: f for f in job.get("files", [])}

    wait_until(lambda: files().get("out/status.txt", {}).get("version", 0) >= 3
               and files()["out/status.txt"]["state"] == "committed", 30, "the third version listed")
    (work / "go").touch()
    assert w.wait(60) == 0, w.err
    wait_until(lambda: (job_state(web, "files-1") or {}).get("state") == "finished", 20, "the web view to see the end")
    job = web.json("/api/jobs/files-1")
    listed = {f["name"]: (f["bytes"], f["version"], f["committed"], f["state"]) for f in job["files"]}
    status = (work / "status.txt").read_bytes()
    assert listed == {"out/log.txt": (700, 1, 700, "committed"),
                      "out/status.txt": (len(status), listed["out/status.txt"][1], len(status), "committed")}
    assert job["files"][0]["sha256"] == hashlib.sha256(b"a line\n" * 100).hexdigest()
    _, _, page = web.get("/jobs/files-1")
    assert b'id="files"' in page and b'id="filerows"' in page
    _, _, script = web.get("/static/job.js")
    assert b"showFiles(j.files" in script
