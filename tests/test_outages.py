"""Stalls and cuts counted whole, and the notes gcwrap sends home of them.

Real gcwrap processes and real faults: a relay on loopback that holds every
byte back for a while and then delivers it (a stall: the connection stays
up, nothing is acknowledged), the link to a shadow in a network namespace
taken down (a cut), and a shadow spoken to by hand (`RawShadow`, the
protocol's own Connection) that goes silent when told and records every
frame gcwrap sends it, the NOTES among them. The figures are checked
against the outage the test made, within a second; the notes against what
the shadow saw and when.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faults import NS_IP, NetNS, Relay, Tmpfs, need_netns, need_tmpfs, shadow_in_ns
from helpers import ShadowProc, Wrapper, file_size, spool_status_both, tool, wait_until
from middleboxes import accept_until

from gcwrap.wire.events import PROTOCOL_VERSION, Ack, Data, Done, Event, Exit, Hello, Notes, Ping, Pong, Welcome
from gcwrap.wire.protocol import NEED_DATA, Connection, Role

# A job that writes a line every 50 ms until the file given exists (at most 60 s).
LINES = """
import os, sys, time
i, end = 0, time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < end:
    print(f"line {i} {time.time():.3f}", flush=True)
    i += 1
    time.sleep(0.05)
"""


def lines_job(gate: Path) -> list[str]:
    return [sys.executable, "-c", LINES, str(gate)]


def summary(err: bytes) -> dict[str, Any]:
    """The I/O summary of a gcwrap run with --log-format json."""
    for line in err.decode().splitlines():
        record = json.loads(line)
        if record.get("message") == "I/O summary":
            assert isinstance(record["summary"], dict)
            return record["summary"]
    raise AssertionError(f"no I/O summary in: {err.decode()}")



def numbers_only(figures: dict[str, Any]) -> None:
    """The summary's figures are JSON numbers (the shadow in use, of several, is a name)."""
    for key, value in figures.items():
        if key != "shadow":
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)


# -- a stall: the connection stays up, nothing is acknowledged -------------------------------------------------


@pytest.mark.timeout(90)
def test_a_stall_is_counted_whole_and_shown_while_it_lasts(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                          tmp_path: Path) -> None:
    """A relay holds every byte back for 4 s, both ways, then delivers them:
    the connection survives (the heartbeat is 2 s: the watchdog would wait
    6 s). Before, that left no trace: connected throughout, no stall."""
    gate, hold = tmp_path / "gate", 4.0
    with Relay(("127.0.0.1", shadow.port)) as relay:
        w = Wrapper(["--shadow", f"127.0.0.1:{relay.port}", "--spool", str(spool_dir), "--job-id", "stall-4",
                     "--heartbeat", "2", "--log-format", "json", "--stdout", "s.out", "--", *lines_job(gate)])
        wait_until(lambda: file_size(home / "s.out") > 0, 30, "the first line at home")
        time.sleep(1.0)  # (streaming for a second: every line acknowledged within milliseconds)
        first, _ = spool_status_both(spool_dir)
        relay.hole()
        held = time.monotonic()
        time.sleep(1.5)
        early, _ = spool_status_both(spool_dir)
        time.sleep(max(0.0, held + hold - 0.8 - time.monotonic()))
        late, text = spool_status_both(spool_dir)
        time.sleep(max(0.0, held + hold - time.monotonic()))
        relay.heal()
        healed = time.monotonic()
        size = file_size(home / "s.out")
        wait_until(lambda: file_size(home / "s.out") > size, 10, "the held lines at home")
        time.sleep(1.0)
        gate.touch()
        rc = w.wait(30)
    assert rc == 0, w.err.decode()
    outage = healed - held  # (the relay delivers what it held at once)
    # gcwrap status: the age of the last acknowledgement while output waits, growing.
    assert first["last_ack_age_s"] is None or first["last_ack_age_s"] < 1.0, first
    assert first["connected"] and late["connected"]
    assert 1.0 <= early["last_ack_age_s"] <= 2.5, early
    assert late["last_ack_age_s"] >= early["last_ack_age_s"] + 1.0, (early, late)
    assert late["last_ack_age_s"] <= outage + 0.5, late
    shown = re.search(r"nothing acknowledged for (\d+) s", text)  # (the text is taken a moment after the JSON)
    assert shown and late["last_ack_age_s"] - 0.5 <= int(shown.group(1)) <= late["last_ack_age_s"] + 1.5, text
    figures = summary(w.err)
    numbers_only(figures)
    assert abs(figures["stalled_s"] - outage) <= 1.0, (figures, outage)
    assert figures["stalled_s"] <= figures["connected_s"]
    assert figures["reconnects"] == 0 and figures["disconnected_s"] < 1.0, figures  # (gcwrap's start-up)
    assert abs(figures["connected_s"] + figures["disconnected_s"] - figures["wall_s"]) <= 0.002


# -- a cut: the link is down ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("heartbeat", [1.0, 5.0], ids=["connection-dies", "connection-survives"])
def test_a_cut_is_counted_from_when_the_connection_last_worked(tmp_path: Path, heartbeat: float) -> None:
    """The link to home goes down for 6 s. With a heartbeat of 1 s the
    watchdog gives the connection up after 3 s and gcwrap reconnects once the
    link is back; with 5 s the connection lives through it (TCP resends).
    Either way the output waited from the cut until home acknowledged again:
    stalled + disconnected is that long (before, the time from the cut to
    its detection was counted as connected)."""
    need_netns()
    home, logs, spool, gate = tmp_path / "home", tmp_path / "logs", tmp_path / "spool", tmp_path / "gate"
    home.mkdir()
    logs.mkdir()
    with NetNS() as ns:
        proc, port = shadow_in_ns(ns, home, logs)
        try:
            spawned = time.monotonic()
            w = Wrapper(["--shadow", f"{NS_IP}:{port}", "--spool", str(spool), "--job-id", "cut-6",
                         "--heartbeat", str(heartbeat), "--retry-timeout", "0.3", "--log-format", "json",
                         "--stdout", "c.out", "--", *lines_job(gate)])
            wait_until(lambda: file_size(home / "c.out") > 0, 30, "the first line at home")
            first_line = time.monotonic()
            time.sleep(1.0)
            ns.link(False)
            cut = time.monotonic()
            time.sleep(6.0)
            size = file_size(home / "c.out")
            ns.link(True)
            # Home has output again: the outage's end (lines come every 50 ms; polled every 20 ms).
            wait_until(lambda: file_size(home / "c.out") > size, 30, "output at home after the cut")
            back = time.monotonic()
            time.sleep(1.0)
            gate.touch()
            rc = w.wait(30)
        finally:
            proc.terminate()
            proc.wait(10)
    assert rc == 0, w.err.decode()
    figures = summary(w.err)
    numbers_only(figures)
    outage = back - cut
    startup = first_line - spawned  # (off the link too: gcwrap had not connected yet)
    off = figures.get("stalled_s", 0.0) + figures["disconnected_s"]  # (no stalled_s before: none counted)
    assert outage - 1.0 <= off - startup <= outage + 1.0 or outage - 1.0 <= off <= outage + 1.0 + startup, \
        (figures, outage, startup)
    if heartbeat == 1.0:
        assert figures["reconnects"] == 1 and figures["disconnected_s"] >= 6.0 - 1.0, figures
    else:
        assert figures["reconnects"] == 0 and figures["stalled_s"] >= 6.0 - 1.0, figures


# -- the notes gcwrap sends home ------------------------------------------------------------------------------


class RawShadow:
    """A shadow spoken by hand, one connection at a time: it welcomes the job
    (accepting "notes" or not), keeps and acknowledges its DATA at once,
    answers PINGs, and says DONE to its EXIT, except while `silent(n, t)`
    says so for connection n at t seconds after its welcome: then it reads
    and keeps all, and answers nothing (as behind a link that holds the
    answers back); a new connection is welcomed with all it kept. Every frame it
    gets is recorded with its Unix time of arrival, per connection; so is
    the time of the last frame it sent on each."""

    def __init__(self, notes: bool, silent: Callable[[int, float], bool], listening: bool = True) -> None:
        self.accept_notes = notes
        self.silent = silent
        # Bound, and listening only once `listen()` is called: till then a connection is refused.
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        if listening:
            self.listen()
        self.port = self.server.getsockname()[1]
        self.received: list[list[tuple[float, Event]]] = []
        self.welcomed: list[float] = []
        self.last_sent: list[float] = []
        self.data = bytearray()  # stdout as kept: acknowledged, in order
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def listen(self) -> None:
        self.server.listen()

    def __enter__(self) -> RawShadow:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.server.close()
        self.thread.join(10)

    def _serve(self) -> None:
        for sock in accept_until(self.server, self.stop, timeout=0.1):  # (not listening yet: tried again)
            try:
                with sock:
                    self._connection(sock, len(self.received))
            except Exception as e:  # noqa: BLE001 - any failure of the fake shadow, reported by the test
                self.errors.append(e)

    def _send(self, sock: socket.socket, n: int, proto: Connection, event: Event) -> None:
        sock.sendall(proto.send(event))
        self.last_sent[n] = time.time()

    def _connection(self, sock: socket.socket, n: int) -> None:
        proto = Connection(Role.SHADOW)
        got: list[tuple[float, Event]] = []
        self.received.append(got)
        self.last_sent.append(0.0)
        sock.settimeout(0.02)
        pongs: list[int] = []
        acked = len(self.data)
        while not self.stop.is_set():
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                chunk = None
            except OSError:
                return
            if chunk == b"":
                return
            if chunk:
                proto.receive_data(chunk)
            now = time.time()
            quiet = bool(self.welcomed[n:]) and self.silent(n, now - self.welcomed[n])
            while (ev := proto.next_event()) is not NEED_DATA:
                assert isinstance(ev, Event)
                got.append((now, ev))
                if isinstance(ev, Hello):
                    features = ("notes",) if self.accept_notes else ()
                    self._send(sock, n, proto, Welcome(PROTOCOL_VERSION, n + 1,
                                                       tuple((s.id, len(self.data)) for s in ev.streams),
                                                       features=features))
                    self.welcomed.append(time.time())
                elif isinstance(ev, Data):
                    assert ev.offset <= len(self.data), (ev.offset, len(self.data))
                    self.data += ev.payload[len(self.data) - ev.offset:]
                elif isinstance(ev, Ping):
                    pongs.append(ev.nonce)
                elif isinstance(ev, Exit) and not quiet:
                    self._send(sock, n, proto, Done())
                    return
            if quiet:
                pongs.clear()
                continue
            for nonce in pongs:
                self._send(sock, n, proto, Pong(nonce))
            pongs.clear()
            if len(self.data) > acked:
                acked = len(self.data)
                self._send(sock, n, proto, Ack(1, acked))

    def notes(self, n: int) -> list[tuple[float, Any]]:
        """The notes connection n got: (when they came, the note)."""
        return [(t, note) for t, ev in self.received[n] if isinstance(ev, Notes) for note in ev.notes]


def expected_lines(data: bytes) -> None:
    """The job's lines, each once, in order, none missing."""
    lines = data.decode().splitlines()
    assert [line.split()[1] for line in lines] == [str(i) for i in range(len(lines))]


@pytest.mark.timeout(90)
def test_the_notes_of_a_stall_a_lost_connection_and_a_reconnection(spool_dir: Path, tmp_path: Path) -> None:
    """Connection 1 goes silent for 1.5 s (a stall: the heartbeat is 1 s),
    answers again for a second, then for good: gcwrap gives it up after 3
    heartbeats and connects again. What it sends home, in NOTES frames: the
    stall on connection 1, once (answered there: not sent again), and the
    lost connection (with when it last worked) and the reconnection on
    connection 2, before the EXIT. Before: no NOTES at all."""
    gate = tmp_path / "gate"

    def silent(n: int, t: float) -> bool:
        return n == 0 and (1.0 <= t < 2.5 or t >= 3.5)

    with RawShadow(notes=True, silent=silent) as raw:
        w = Wrapper(["--shadow", f"127.0.0.1:{raw.port}", "--spool", str(spool_dir), "--job-id", "noted",
                     "--heartbeat", "1", "--retry-timeout", "0.3", "--stdout", "n.out", "--", *lines_job(gate)])
        wait_until(lambda: len(raw.welcomed) >= 2, 30, "a second connection")
        wait_until(lambda: time.time() - raw.welcomed[1] > 1.0, 10, "a second on it")
        gate.touch()
        rc = w.wait(30)
    assert not raw.errors, raw.errors
    assert rc == 0, w.err.decode()
    expected_lines(bytes(raw.data))
    where = f"127.0.0.1:{raw.port}"
    first, second = raw.notes(0), raw.notes(1)
    assert [n.kind for _, n in first] == ["stalled"], first
    assert [n.kind for _, n in second] == ["connection_lost", "reconnected"], second
    notes = [n for _, n in first + second]
    assert [n.time for n in notes] == sorted(n.time for n in notes), notes
    for arrived, note in first + second:
        assert note.time <= arrived + 0.01, (note, arrived)  # (one clock: the test's machine)
    stalled, lost, again = (dict(n.details) for n in notes)
    welcome0 = raw.welcomed[0]
    assert stalled["shadow"] == lost["shadow"] == again["shadow"] == where
    assert abs(stalled["since"] - (welcome0 + 1.0)) <= 0.3, (stalled, welcome0)
    assert abs(stalled["seconds"] - 1.5) <= 0.3, stalled
    assert abs(notes[0].time - (stalled["since"] + stalled["seconds"])) <= 0.01
    # Lost: it last worked when the shadow last sent it something (about 3.5 s after its welcome).
    assert abs(lost["worked_at"] - raw.last_sent[0]) <= 0.2, (lost, raw.last_sent)
    # (The watchdog's words: silent for 3 heartbeats, or output unanswered that long: see liveness.py.)
    assert str(lost["reason"]).startswith(("no answer from the shadow", "the connection to the shadow")), lost
    assert "3 s" in str(lost["reason"]), lost
    assert 2.0 <= notes[1].time - lost["worked_at"] <= 4.5, (notes[1], lost)  # (3 heartbeats, counted as sampled)
    assert abs(again["after_s"] - (raw.welcomed[1] - lost["worked_at"])) <= 0.2, (again, raw.welcomed, lost)
    assert again["attempts"] == 1 and isinstance(again["attempts"], int)
    # On connection 2 the notes came before the EXIT.
    kinds = [type(ev).__name__ for _, ev in raw.received[1]]
    assert kinds.index("Notes") < kinds.index("Exit"), kinds


@pytest.mark.timeout(60)
def test_a_shadow_that_does_not_accept_notes_gets_none(spool_dir: Path, tmp_path: Path) -> None:
    """The same stall, with a shadow whose WELCOME does not accept "notes": no
    NOTES frame (its protocol would refuse one), the job delivered as ever."""
    gate = tmp_path / "gate"
    with RawShadow(notes=False, silent=lambda n, t: n == 0 and 1.0 <= t < 2.5) as raw:
        w = Wrapper(["--shadow", f"127.0.0.1:{raw.port}", "--spool", str(spool_dir), "--job-id", "unnoted",
                     "--heartbeat", "1", "--stdout", "u.out", "--", *lines_job(gate)])
        wait_until(lambda: bool(raw.welcomed) and time.time() - raw.welcomed[0] > 3.5, 30, "the stall to pass")
        gate.touch()
        rc = w.wait(30)
    assert not raw.errors, raw.errors
    assert rc == 0, w.err.decode()
    assert len(raw.received) == 1 and not raw.notes(0)
    hello = raw.received[0][0][1]
    assert isinstance(hello, Hello) and "notes" in hello.features  # offered, not taken
    expected_lines(bytes(raw.data))


@pytest.mark.timeout(90)
def test_the_notes_of_a_full_disk_and_a_pause(tmp_path: Path) -> None:
    """The spool's disk is full and home refuses connections: the job is
    paused. Home then listens. What gcwrap sends home: the disk full, the
    pause (with both reasons), its first connection (after how many
    attempts), and the job resumed, in that order."""
    need_tmpfs()
    with Tmpfs(tmp_path / "spool", "8m") as fs, RawShadow(notes=True, silent=lambda n, t: False,
                                                          listening=False) as raw:
        fs.fill(leave=2 << 20)
        spawned = time.time()
        w = Wrapper(["--shadow", f"127.0.0.1:{raw.port}", "--spool", str(fs.path), "--job-id", "full",
                     "--retry-limit", "0", "--retry-timeout", "0.3", "--memory-limit", "1MiB", "--stdout", "f.out",
                     "--", sys.executable, "-c", "import os\nfor i in range(100): os.write(1, b'x' * 60_000)"],
                    err_file=tmp_path / "err")
        wait_until(lambda: "the job is paused" in w.err_so_far(), 30, "the job to be paused")
        time.sleep(0.5)
        raw.listen()
        listened = time.time()
        rc = w.wait(60)
    assert not raw.errors, raw.errors
    assert rc == 0, w.err.decode()
    assert bytes(raw.data) == b"x" * 6_000_000
    notes = [n for _, n in raw.notes(0)]
    kinds = [n.kind for n in notes]
    assert [k for k in kinds if k != "disk"] == ["paused", "connected", "resumed"], kinds
    assert kinds[0] == "disk" and dict(notes[0].details)["full"] is True, notes
    assert [n.time for n in notes] == sorted(n.time for n in notes)
    full = dict(notes[0].details)
    paused, connected, resumed = (dict(n.details) for n in notes if n.kind != "disk")
    assert "spool" in str(full["reason"]) or "disk" in str(full["reason"]), full
    assert str(paused["reason"]).startswith("disk: ") and "; home: connection refused" in str(paused["reason"])
    assert connected["attempts"] >= 2 and connected["shadow"] == f"127.0.0.1:{raw.port}"
    assert listened - spawned - 1.0 <= connected["after_s"] <= raw.welcomed[0] - spawned + 0.1, connected
    assert resumed["reason"] == "home takes the output again" and resumed["paused_s"] > 0.4, resumed


# -- true figures at the edges -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_wall_time_runs_from_gcwraps_own_start(shadow: ShadowProc, spool_dir: Path) -> None:
    """gcwrap starts the job before its event loop is loaded: a job of 2 s
    takes at least 2 s of gcwrap's wall time (before: "wall 1.9 s")."""
    spawned = time.monotonic()
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "sleep-2",
                 "--log-format", "json", "--stdout", "z.out", "--", "sleep", "2"])
    rc = w.wait(30)
    ended = time.monotonic()
    assert rc == 0, w.err.decode()
    figures = summary(w.err)
    numbers_only(figures)
    # (The kernel keeps a process's start in 10 ms ticks, rounded down.)
    assert 2.0 <= figures["wall_s"] <= ended - spawned + 0.01, (figures, ended - spawned)


@pytest.mark.timeout(90)
def test_a_resumed_spools_rate_is_its_delivery_rate(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """A job writes 4 MB that go home, the shadow goes away (kill -9), the job
    writes 1 MB more over 2 s and ends; gcwrap keeps it in its spool
    (SIGTERM). `gcwrap resume` delivers what home does not hold: the rate it
    sends home is those bytes over its own time, not the job's 5 MB (before:
    5 MB over the resume's time)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    sh.start()
    gate = tmp_path / "gate"
    job = ("import os, sys, time\n"
           "os.write(1, b'a' * 4_000_000)\n"
           "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
           "for i in range(20):\n    os.write(1, b'b' * 50_000); time.sleep(0.1)\n")
    try:
        w = Wrapper(["--shadow", sh.address, "--spool", str(spool_dir), "--job-id", "resumed", "--retry-timeout",
                     "0.3", "--retry-limit", "0", "--stdout", "r.out", "--", sys.executable, "-c", job, str(gate)])
        wait_until(lambda: file_size(home / "r.out") == 4_000_000, 30, "the first 4 MB at home")
        sh.kill9()
        gate.touch()
        wait_until(lambda: spool_status_bytes(spool_dir) == 5_000_000, 30, "the job's last byte read")
        w.proc.terminate()
        assert w.wait(30) == 122, w.err.decode()
        sh.start()
        # What home holds for good (its file may hold more: the shadow was killed before it synced them).
        (before,) = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)],
                                              capture_output=True, check=True, timeout=60).stdout)
        (held,) = [s["durable"] for s in before["streams"] if s["kind"] == "stdout"]
        res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir)], capture_output=True,
                             timeout=60)
        assert res.returncode == 0, res.stderr.decode()
        jobs = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)],
                                         capture_output=True, check=True, timeout=60).stdout)
    finally:
        sh.stop()
    assert file_size(home / "r.out") == 5_000_000
    (rec,) = jobs
    figures = {k: float(v) for k, v in rec["summary"].items() if k in ("wall_s", "throughput_mb_s")}
    delivered = 5_000_000 - held
    assert delivered >= 1_000_000
    # (Both rounded to the millisecond and the kB/s.)
    low, high = delivered / (figures["wall_s"] + 0.0005) / 1e6, delivered / max(figures["wall_s"] - 0.0005, 1e-6) / 1e6
    assert low - 0.001 <= figures["throughput_mb_s"] <= high + 0.001, (figures, delivered)


def spool_status_bytes(spool: Path) -> int:
    try:
        (one,) = json.loads(subprocess.run([*tool("gcwrap"), "status", "--json", "--spool", str(spool)],
                                           capture_output=True, timeout=60, check=True).stdout)
    except ValueError:
        return -1
    return sum(int(s["appended"]) for s in one["streams"])
