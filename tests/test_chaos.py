"""Chaos: real faults from the kernel while a job streams home.

Each scenario runs a job that writes known pseudo-random bytes (stdout and
stderr, in bursts), injects a fault with a real kernel mechanism, and checks
sha256 of what landed against what the job wrote (equal length and hash: no
byte lost, none duplicated). Needs root; skips with a reason elsewhere.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from faults import NS_IP, VETH_HOST, DelayProxy, NetNS, Relay, Tmpfs, need_netns, need_tmpfs, shadow_in_ns
from helpers import (
    ShadowProc,
    Wrapper,
    expected,
    file_size,
    genjob,
    sha256_file,
    spool_status,
    tool,
    wait_until,
)

from gcwrap.render import human_bytes

MB = 1_000_000
pytestmark = pytest.mark.root


def stamps(path: Path) -> list[float]:
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def max_gap(path: Path) -> float:
    ts = stamps(path)
    return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def check_landed(home: Path, name: str, n: int, seed: int) -> None:
    got = file_size(home / name)
    assert got == n, f"{name}: {got} bytes landed, the job wrote {n}"
    assert sha256_file(home / name) == expected(n, seed), f"{name}: bytes differ"


def test_a_tmpfs_needs_no_iptables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that only mount a tmpfs run where iptables is missing; those that
    make a network namespace say what they lack."""
    import faults

    which = shutil.which
    monkeypatch.setattr(faults.shutil, "which", lambda tool: None if tool == "iptables" else which(tool))
    need_tmpfs()  # does not skip
    with pytest.raises(pytest.skip.Exception, match="iptables"):
        need_netns()


@pytest.fixture
def netns() -> object:
    need_netns()
    with NetNS() as ns:
        yield ns


# -- 1. the shadow killed -9 five times ------------------------------------------


@pytest.mark.timeout(240)
def test_shadow_killed_five_times_at_random_moments(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    rng = random.Random(1234)
    out, err = 40 * MB, 4 * MB
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "kill5", "--retry-timeout", "0.5",
                 "--heartbeat", "1", "--stdout", "k.out", "--stderr", "k.err", "--",
                 *genjob(out, err, seed=51, rate=8 * MB)])
    for _ in range(5):
        time.sleep(rng.uniform(0.2, 1.2))
        shadow.kill9()
        time.sleep(rng.uniform(0.0, 0.8))
        shadow.start()
    assert w.wait(180) == 0, w.err.decode()
    check_landed(home, "k.out", out, 51)
    check_landed(home, "k.err", err, 52)


# -- 2. gcwrap killed -9, then resume ----------------------------------------------


@pytest.mark.timeout(180)
def test_wrapper_killed_mid_run_then_resume(shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    progress = tmp_path / "stamps"
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "orphan", "--retry-timeout", "0.5",
                 "--stdout", "o.out", "--stderr", "o.err", "--",
                 *genjob(50 * MB, 5 * MB, seed=61, rate=5 * MB, timestamps=progress)])
    wait_until(lambda: file_size(home / "o.out") > 2 * MB, 60, "output at home")
    shadow.stop()  # a backlog builds up in the spool...
    time.sleep(1.5)
    w.kill9()  # ...and the wrapper dies with it
    (st,) = spool_status(spool_dir)
    assert not st["active"]
    spooled = {s["kind"]: s["appended"] for s in st["streams"]}  # type: ignore[index]
    assert spooled["stdout"] > file_size(home / "o.out"), "part of the output is only in the spool"
    shadow.start()
    res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--retry-timeout", "0.5"],
                         capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr.decode()
    # Everything gcwrap had read from the job is home, byte-exact: a prefix of the job's stream.
    for name, kind, n, seed in (("o.out", "stdout", 50 * MB, 61), ("o.err", "stderr", 5 * MB, 62)):
        landed = (home / name).read_bytes()
        assert len(landed) == spooled[kind]
        assert landed == random.Random(seed).randbytes(n)[: len(landed)]
    assert list(spool_dir.glob("*.spool")) == []
    jobs = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                                     check=True, timeout=30).stdout)
    assert jobs[0]["state"] == "finished" and "exit status is unknown" in jobs[0]["reason"]


# -- 3. partitions: black holes and resets -----------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("kind", "seconds"), [("drop", 2), ("drop", 10), ("reset", 2), ("reset", 10)])
def test_partition(netns: NetNS, home: Path, spool_dir: Path, tmp_path: Path, kind: str, seconds: float) -> None:
    proc, port = shadow_in_ns(netns, home, tmp_path)
    ts = tmp_path / "stamps"
    rate = 2 * MB
    out = int(rate * (seconds + 5))
    try:
        w = Wrapper(["--shadow", f"{NS_IP}:{port}", "--spool", str(spool_dir), "--job-id", f"part-{kind}",
                     "--retry-timeout", "1", "--heartbeat", "1", "--stdout", "p.out", "--stderr", "p.err", "--",
                     *genjob(out, 200_000, seed=71, rate=rate, timestamps=ts)])
        wait_until(lambda: file_size(home / "p.out") > MB, 30, "output at home")
        (netns.blackhole if kind == "drop" else netns.reset)(port)
        before = file_size(home / "p.out")
        time.sleep(seconds)
        during = file_size(home / "p.out")
        netns.heal()
        assert w.wait(120) == 0, w.err.decode()
    finally:
        stop(proc)
    assert during - before < MB, "nothing should cross a partition"
    check_landed(home, "p.out", out, 71)
    check_landed(home, "p.err", 200_000, 72)
    assert max_gap(ts) < 1.5, "the job never waits for the network"
    if seconds > 3:  # longer than the heartbeat timeout (3 heartbeats)
        assert b"no answer from the shadow" in w.err or b"reset" in w.err or b"refused" in w.err, w.err


# -- 4. loss and delay during the whole run ------------------------------------------


@pytest.mark.timeout(240)
def test_loss_and_delay_whole_run(netns: NetNS, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    proc, port = shadow_in_ns(netns, home, tmp_path)
    netns.loss(port, 0.10)
    try:
        with DelayProxy((NS_IP, port), 0.2) as proxy:
            w = Wrapper(["--shadow", f"127.0.0.1:{proxy.port}", "--spool", str(spool_dir), "--job-id", "lossy",
                         "--retry-timeout", "1", "--heartbeat", "2", "--stdout", "l.out", "--stderr", "l.err", "--",
                         *genjob(4 * MB, 400_000, seed=81, rate=1 * MB)])
            assert w.wait(200) == 0, w.err.decode()
    finally:
        stop(proc)
    check_landed(home, "l.out", 4 * MB, 81)
    check_landed(home, "l.err", 400_000, 82)


# -- 5. the spool's disk fills up ------------------------------------------------------


@pytest.mark.timeout(120)
def test_spool_disk_full_network_up_job_never_pauses(shadow: ShadowProc, home: Path, tmp_path: Path) -> None:
    need_tmpfs()
    with Tmpfs(tmp_path / "small", "4m") as fs:
        filler = fs.fill(leave=64 << 10)
        ts = tmp_path / "stamps"
        w = Wrapper(["--shadow", shadow.address, "--spool", str(fs.path), "--job-id", "diskfull",
                     "--memory-limit", "2MiB", "--stdout", "d.out", "--stderr", "d.err", "--",
                     *genjob(20 * MB, 2 * MB, seed=91, rate=5 * MB, timestamps=ts)])
        time.sleep(2)
        filler.unlink()  # the disk recovers: spooling resumes
        assert w.wait(60) == 0, w.err.decode()
    check_landed(home, "d.out", 20 * MB, 91)
    check_landed(home, "d.err", 2 * MB, 92)
    assert max_gap(ts) < 1.0, "a full disk with the network up must not pause the job"
    assert b"disk full" in w.err or b"disk nearly full" in w.err
    assert b"the spool takes output again" in w.err


@pytest.mark.timeout(120)
def test_spool_disk_full_and_network_down_pauses_then_resumes(home: Path, tmp_path: Path) -> None:
    need_tmpfs()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    port = sh.start()
    sh.stop()  # the network is "down": nothing listens
    with Tmpfs(tmp_path / "small", "4m") as fs:
        fs.fill(leave=64 << 10)
        ts = tmp_path / "stamps"
        w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(fs.path), "--job-id", "paused",
                     "--retry-timeout", "0.5", "--retry-limit", "0", "--memory-limit", "1MiB",
                     "--stdout", "q.out", "--stderr", "q.err", "--",
                     *genjob(8 * MB, 500_000, seed=95, rate=4 * MB, timestamps=ts)])
        time.sleep(4)
        assert w.proc.poll() is None, "the job is paused, not killed"
        count = len(stamps(ts))
        time.sleep(1)
        assert len(stamps(ts)) == count, "the job is blocked in write()"
        sh.start(port)
        try:
            assert w.wait(60) == 0, w.err.decode()
        finally:
            sh.stop()
    check_landed(home, "q.out", 8 * MB, 95)
    check_landed(home, "q.err", 500_000, 96)
    assert max_gap(ts) > 2.5, "the job's own timestamps show the pause"
    assert b"the job is paused" in w.err and b"the job resumes" in w.err


# -- 6. the retry limit ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_retry_limit_kills_a_blocked_job(home: Path, tmp_path: Path) -> None:
    """The spool stops at --min-free, the job is paused with output in
    memory, and the retry limit ends it. Then the job no longer needs the
    space kept for it: what memory held (and its pipe) is spooled there,
    nothing is lost (exit 124, not 121), and resume delivers all of it."""
    need_tmpfs()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    port = sh.start()
    sh.stop()
    report = tmp_path / "written"
    with Tmpfs(tmp_path / "small", "16m") as fs:
        fs.fill(leave=10 << 20)  # room for the spool to start and take some output, then the reserve
        started = time.monotonic()
        w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(fs.path), "--job-id", "doomed",
                     "--retry-timeout", "0.2", "--retry-limit", "5", "--memory-limit", "1MiB", "--min-free", "7MiB",
                     "--stdout", "z.out", "--", *genjob(50 * MB, 0, seed=97, rate=10 * MB, term_report=report)])
        rc = w.wait(60)
        elapsed = time.monotonic() - started
        text = w.err.decode()
        assert rc == 124, text
        assert elapsed < 30
        assert "retry limit reached" in text and "5 consecutive failed attempts" in text
        assert "gcwrap resume --spool" in text and "LOST" not in text
        (st,) = spool_status(fs.path)
        assert st["state"] == "gave-up, job killed by signal 15"
        assert st["exit_signal"] == signal.SIGTERM, "killed with SIGTERM"
        assert "retry limit reached" in str(st["reason"])
        (out,) = st["streams"]  # type: ignore[misc]
        written = int(report.read_text().split()[0])
        assert out["pending"] == out["written"] == written and out["lost"] == 0, (out, written)
        sh.start(port)
        try:
            res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(fs.path), "--retry-timeout", "0.5"],
                                 capture_output=True, timeout=60)
        finally:
            sh.stop()
        assert res.returncode == 0, res.stderr.decode()
    assert (home / "z.out").read_bytes() == random.Random(97).randbytes(50 * MB)[:written]


@pytest.mark.timeout(180)
def test_retry_limit_loses_only_the_tail_held_in_memory_and_says_so(home: Path, tmp_path: Path) -> None:
    """A 2 MiB spool disk and home down, with the default --memory-limit
    (32 MiB): the retry limit ends the job with up to 32 MiB held only in
    memory. What the disk can still take is kept; the rest, the tail of
    each stream, is lost, and gcwrap says exactly which bytes (checked
    against what the job itself says it wrote), exits 121, records it in
    the spool for `gcwrap status`, and `gcwrap resume` delivers the rest
    and tells home."""
    need_tmpfs()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    port = sh.start()
    sh.stop()
    report = tmp_path / "written"
    out_n, err_n = 60 * MB, 6 * MB
    with Tmpfs(tmp_path / "small", "2m") as fs:
        w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(fs.path), "--job-id", "tail",
                     "--retry-timeout", "0.2", "--retry-limit", "5", "--stdout", "t.out", "--stderr", "t.err", "--",
                     *genjob(out_n, err_n, seed=31, rate=20 * MB, term_report=report)])
        rc = w.wait(90)
        text = w.err.decode()
        assert rc == 121, text
        assert "Traceback" not in text
        # The job's own count of what it wrote before the SIGTERM: the ground truth.
        truth = dict(zip(("stdout", "stderr"), map(int, report.read_text().split())))
        (st,) = spool_status(fs.path)
        assert st["state"] == "gave-up, job killed by signal 15", st
        streams = {s["kind"]: s for s in st["streams"]}  # type: ignore[union-attr, index]
        lost = {}
        for kind in ("stdout", "stderr"):
            s = streams[kind]
            assert s["written"] == truth[kind], f"{kind}: gcwrap counted {s['written']}, the job wrote {truth[kind]}"
            assert s["lost_from"] == s["appended"] and s["lost"] == truth[kind] - s["appended"]
            if s["lost"]:
                lost[kind] = (s["appended"], truth[kind])
        assert lost, "32 MiB in memory and a 2 MiB disk: something is lost"
        assert sum(e - b for b, e in lost.values()) <= (32 << 20) + 2 * (1 << 20), "at most memory and two pipes"
        said = ", and ".join(f"the last {e - b:,} bytes of {k} (offsets {b:,} to {e:,})" for k, (b, e) in lost.items())
        assert f"LOST: {said}: held only in memory" in text, text
        assert f"LOST: {human_bytes(sum(e - b for b, e in lost.values()))}" in text
        assert "retry limit reached" in text and "gcwrap resume --spool" in text
        status_text = subprocess.run([*tool("gcwrap"), "status", "--spool", str(fs.path)], capture_output=True,
                                     text=True, timeout=60, check=True, env={**os.environ, "COLUMNS": "400"}).stdout
        assert f"LOST {said}" in " ".join(status_text.split()), status_text
        # Later, home is back: resume delivers what the spool kept, says what is lost, and exits 121 again.
        sh.start(port)
        try:
            res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(fs.path), "--retry-timeout", "0.5"],
                                 capture_output=True, text=True, timeout=60)
        finally:
            sh.stop()
        assert res.returncode == 121, res.stderr
        assert f"lost when the job ran: {said}" in res.stderr, res.stderr
        assert list(fs.path.glob("*.spool")) == []
    for kind, name, seed in (("stdout", "t.out", 31), ("stderr", "t.err", 32)):
        landed = (home / name).read_bytes()
        assert len(landed) == streams[kind]["appended"]
        assert landed == random.Random(seed).randbytes(out_n if kind == "stdout" else err_n)[: len(landed)]
    jobs = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                                     check=True, timeout=30).stdout)
    assert jobs[0]["state"] == "finished" and f"lost: {said}" in jobs[0]["reason"], jobs[0]
    assert "retry limit reached" in jobs[0]["reason"]


# -- descriptors and an unwritable root -----------------------------------------------


@pytest.mark.timeout(180)
def test_resume_of_a_backlog_of_more_segments_than_descriptors(home: Path, tmp_path: Path) -> None:
    """A backlog of 300 segments resumed under `ulimit -n 64`: the reader
    must not keep a descriptor per segment (nor the deleted segments'
    blocks). Segments are small because the spool's file system was small
    when the spool was made (fs_size // 64, 64 KiB); it grows afterwards,
    so the backlog spans many of them."""
    need_tmpfs()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh_ = ShadowProc(home, logs)
    port = sh_.start()
    sh_.stop()
    go = tmp_path / "go"
    n = 20 * MB
    with Tmpfs(tmp_path / "spool", "4m") as fs:
        w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(fs.path), "--job-id", "many",
                     "--retry-timeout", "0.1", "--retry-limit", "2", "--stdout", "m.out", "--",
                     "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done; exec \"$@\"", "sh",
                     *genjob(n, 0, seed=23, rate=40 * MB)])
        wait_until(lambda: any(fs.path.glob("*.spool")), 30, "the spool")
        subprocess.run(["mount", "-o", "remount,size=64m", str(fs.path)], check=True, timeout=30)
        go.touch()
        assert w.wait(60) == 122, w.err.decode()
        (seg_dir,) = fs.path.glob("*.spool.seg")
        segments = len(list(seg_dir.iterdir()))
        assert segments >= 300, f"{segments} segments"

        def low_limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

        sh_.start(port)
        try:
            res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(fs.path), "--retry-timeout", "0.5",
                                  "--retry-limit", "3"], capture_output=True, timeout=120, preexec_fn=low_limit)
        finally:
            sh_.stop()
        assert res.returncode == 0, res.stderr.decode()
        assert list(fs.path.glob("*.spool*")) == []
    check_landed(home, "m.out", n, 23)


@pytest.mark.timeout(120)
def test_shadow_disk_full_then_recovers(spool_dir: Path, tmp_path: Path) -> None:
    """The shadow's root stops taking writes (ENOSPC): the agent is told,
    backs off, the job goes on, and everything lands once space is back."""
    need_tmpfs()
    with Tmpfs(tmp_path / "root", "24m") as fs:
        logs = tmp_path / "logs"
        logs.mkdir()
        sh = ShadowProc(fs.path, logs, extra=["--min-free", "0"])
        sh.start()
        try:
            ts = tmp_path / "stamps"
            w = Wrapper(["--shadow", sh.address, "--spool", str(spool_dir), "--job-id", "full-home",
                         "--retry-timeout", "0.5", "--stdout", "r.out", "--",
                         *genjob(8 * MB, 0, seed=99, rate=2 * MB, timestamps=ts)])
            wait_until(lambda: file_size(fs.path / "r.out") > MB, 30, "output at home")
            filler = fs.fill()
            time.sleep(2)
            filler.unlink()
            assert w.wait(60) == 0, w.err.decode()
            check_landed(fs.path, "r.out", 8 * MB, 99)
            # the file write or the state database hits the full disk first, by timing
            assert b"No space left" in w.err or b"disk is full" in w.err, w.err
            assert max_gap(ts) < 1.0, "the job does not wait for the shadow's disk"
        finally:
            sh.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["read-only mount", "unprivileged user"])
def test_a_spool_directory_that_exists_but_cannot_be_written(shadow: ShadowProc, home: Path, tmp_path: Path,
                                                             how: str) -> None:
    """The spool directory exists but refuses new files: a read-only mount
    (EROFS), or a directory owned by root, 0755, with gcwrap run as nobody
    (EACCES). The job runs anyway, its output goes home from memory,
    byte-exact, and gcwrap says why in one line (before: a traceback,
    `sqlite3.OperationalError: unable to open database file`, exit 1, and
    the job never started)."""
    need_tmpfs()
    out_n, err_n = 3 * MB, 300_000
    args = ["--shadow", shadow.address, "--job-id", "nospool", "--stdout", "n.out", "--stderr", "n.err", "--",
            *genjob(out_n, err_n, seed=41, rate=4 * MB)]
    if how == "read-only mount":
        with Tmpfs(tmp_path / "ro", "4m") as fs:
            spools = fs.path / "spools"
            spools.mkdir()
            fs.remount(readonly=True)
            w = Wrapper(["--spool", str(spools), *args])
            rc, err = w.wait(60), w.err
            assert list(spools.iterdir()) == []
        reason = "not writable (Read-only file system)"
    else:
        # nobody, with one capability: to read and search (never to write)
        # what it could not, so it can reach the interpreter under /root (0700).
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv (util-linux)")
        spools = Path(tempfile.mkdtemp(prefix="gcwrap-rootdir-", dir="/var/tmp"))  # (its parents: world-searchable)
        try:
            os.chmod(spools, 0o755)
            as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                         "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
            proc = subprocess.run([*as_nobody, *tool("gcwrap"), "--spool", str(spools), *args], capture_output=True,
                                  timeout=60, env={**os.environ, "HOME": "/nonexistent"})
            err, rc = proc.stderr, proc.returncode
            assert list(spools.iterdir()) == []
        finally:
            shutil.rmtree(spools, ignore_errors=True)
        reason = "not writable (Permission denied)"
    text = err.decode()
    assert rc == 0, text
    assert "Traceback" not in text
    assert f"{reason}; the job runs anyway, its output goes home from memory" in text, text
    check_landed(home, "n.out", out_n, 41)
    check_landed(home, "n.err", err_n, 42)


@pytest.mark.timeout(60)
def test_descriptor_exhaustion_gives_a_clear_error(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (12, 12))

    proc = subprocess.run([*tool("gcwrap"), "--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "fd",
                           "--retry-limit", "2", "--retry-timeout", "0.2", "--stdout", "fd.out", "--", "echo", "hi"],
                          capture_output=True, timeout=50, preexec_fn=low_limit)
    text = proc.stderr.decode()
    assert "Traceback" not in text, text
    assert proc.returncode == 126, text
    assert "cannot run echo: out of file descriptors (raise `ulimit -n`)" in text, text
    assert list(spool_dir.glob("*.spool")) == [], "no spool left for a job that never ran"


@pytest.mark.timeout(60)
def test_sigterm_stops_a_shadow_whose_root_vanished_mid_stream(spool_dir: Path, tmp_path: Path) -> None:
    """The root deleted under a streaming shadow (a cleaner, an operator's
    rm -rf): SIGTERM still stops it at once, without a traceback."""
    home = tmp_path / "doomed"
    home.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    sh.start()
    try:
        w = Wrapper(["--shadow", sh.address, "--spool", str(spool_dir), "--job-id", "vanished",
                     "--retry-timeout", "0.5", "--stdout", "v.out", "--",
                     *genjob(50 * MB, 0, seed=17, rate=5 * MB)])
        wait_until(lambda: file_size(home / "v.out") > MB, 30, "output at home")
        shutil.rmtree(home)
        assert sh.proc is not None
        sh.proc.send_signal(signal.SIGTERM)
        assert sh.proc.wait(5) in (-signal.SIGTERM, 0), "stopped by SIGTERM within 5 s"
        w.proc.kill()
        w.proc.wait(10)
    finally:
        sh.stop()
    text = b"".join(p.read_bytes() for p in logs.glob("shadow-*.log"))
    assert b"Traceback" not in text, text.decode(errors="replace")


# -- 7. a randomized schedule mixing all of the above --------------------------------

CHAOS_TOTALS = {"seeds": 0, "bytes": 0, "faults": 0, "lost": 0, "duplicated": 0}
FAULT_KINDS = ("kill", "drop", "reset", "loss", "link", "diskfull")


def lost_and_duplicated(path: Path, want: bytes) -> tuple[int, int]:
    got = path.read_bytes() if path.exists() else b""
    if got == want:
        return 0, 0
    common = 0
    step = 1 << 16
    while common < min(len(got), len(want)) and got[common : common + step] == want[common : common + step]:
        common += step
    common = min(common, len(got), len(want))
    return len(want) - common, max(0, len(got) - common)


def chaos_seeds(config: pytest.Config) -> list[int]:
    n = config.getoption("--seeds") or 20
    return list(range(n))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "chaos_seed" in metafunc.fixturenames:
        metafunc.parametrize("chaos_seed", chaos_seeds(metafunc.config))
    if "relay_seed" in metafunc.fixturenames:
        metafunc.parametrize("relay_seed", list(range(2, 2 + (metafunc.config.getoption("--seeds") or 30))))


@pytest.mark.timeout(120)
def test_random_fault_schedule(netns: NetNS, tmp_path: Path, chaos_seed: int) -> None:
    need_tmpfs()
    rng = random.Random(chaos_seed)
    home, spool_dir, logs = tmp_path / "home", tmp_path / "spool", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    out_n, err_n = rng.randint(1, 6) * MB, rng.randint(0, 8) * 100_000
    rate = rng.choice((2, 3, 4)) * MB
    out_b, err_b = random.Random(chaos_seed).randbytes(out_n), random.Random(chaos_seed + 1).randbytes(err_n)
    proc, port = shadow_in_ns(netns, home, logs)
    faults = 0
    with Tmpfs(spool_dir, "4m") as fs:
        try:
            w = Wrapper(["--shadow", f"{NS_IP}:{port}", "--spool", str(spool_dir), "--job-id", f"chaos-{chaos_seed}",
                         "--retry-timeout", "0.5", "--retry-limit", "0", "--heartbeat", "0.5",
                         "--memory-limit", "2MiB", "--stdout", "c.out", "--stderr", "c.err", "--",
                         *genjob(out_n, err_n, seed=chaos_seed, rate=rate)])
            for _ in range(rng.randint(2, 4)):
                time.sleep(rng.uniform(0.1, 1.0))
                kind = rng.choice(FAULT_KINDS)
                faults += 1
                filler = None
                if kind == "kill":
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                elif kind == "drop":
                    netns.blackhole(port)
                elif kind == "reset":
                    netns.reset(port)
                elif kind == "loss":
                    netns.loss(port, 0.1)
                elif kind == "link":
                    netns.link(up=False)
                else:
                    filler = fs.fill()
                time.sleep(rng.uniform(0.2, 2.5))
                if kind == "kill":
                    proc, _ = shadow_in_ns(netns, home, logs, port=port)
                elif kind == "link":
                    netns.link(up=True)
                elif filler is not None:
                    filler.unlink()
                else:
                    netns.heal()
            rc = w.wait(90)
        finally:
            stop(proc)
    lost_o, dup_o = lost_and_duplicated(home / "c.out", out_b)
    lost_e, dup_e = lost_and_duplicated(home / "c.err", err_b)
    CHAOS_TOTALS["seeds"] += 1
    CHAOS_TOTALS["bytes"] += out_n + err_n
    CHAOS_TOTALS["faults"] += faults
    CHAOS_TOTALS["lost"] += lost_o + lost_e
    CHAOS_TOTALS["duplicated"] += dup_o + dup_e
    assert rc == 0, w.err.decode()
    assert (lost_o, dup_o, lost_e, dup_e) == (0, 0, 0, 0)


# -- 8. a relay that duplicates connection attempts -----------------------------------------


def relay_schedule(seed: int) -> list[tuple[float, str]]:
    """When the relay black-holes and forwards again. Seed 0 is the schedule
    that left zero-filled holes in 4 of 23 runs (two sessions of the job
    writing at once): black hole at 0.6 s and at 3.7 s, forwarding at 9 s."""
    if seed == 0:
        return [(0.6, "hole"), (2.4, "heal"), (3.7, "hole"), (9.0, "heal")]
    if seed == 1:  # long enough for gcwrap to give up on attempts (3 heartbeats each): delivered late, at once
        return [(1.0, "hole"), (14.0, "heal")]
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(rng.randint(1, 3)):
        t += rng.uniform(0.3, 2.0)
        out.append((t, "hole"))
        t += rng.uniform(0.5, 12.0)
        out.append((t, "heal"))
    return out


def relay_run(home: Path, spool_dir: Path, tmp_path: Path, seed: int) -> Relay:
    """A job streaming ~630 KB/s on each of stdout and stderr through a Relay
    that duplicates half the connection attempts and delivers abandoned ones
    late; every byte lands exactly once and gcwrap exits 0."""
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["--idle-timeout", "10"])
    sh.start()
    n = 7_500_000
    try:
        # Seed 0 duplicates every attempt: the earlier copy of each HELLO races the later one.
        with Relay(("127.0.0.1", sh.port), duplicate=1.0 if seed == 0 else 0.5, seed=seed) as relay:
            w = Wrapper(["--shadow", f"127.0.0.1:{relay.port}", "--spool", str(spool_dir), "--job-id", f"relay-{seed}",
                         "--retry-limit", "0", "--retry-timeout", "1", "--heartbeat", "1",
                         "--stdout", "r.out", "--stderr", "r.err", "--",
                         *genjob(n, n, seed=seed + 300, rate=1_260_000)])
            started = time.monotonic()
            for at, what in relay_schedule(seed):
                time.sleep(max(0.0, started + at - time.monotonic()))
                relay.hole() if what == "hole" else relay.heal()
            rc = w.wait(120)
    finally:
        sh.stop()
    assert rc == 0, w.err.decode()
    # sha256 of what the job wrote: zero-filled holes would pass a size check, not this.
    check_landed(home, "r.out", n, seed + 300)
    check_landed(home, "r.err", n, seed + 301)
    jobs = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                                     check=True, timeout=30).stdout)
    assert jobs[0]["state"] == "finished" and jobs[0]["exit_code"] == 0
    assert [s["durable"] for s in jobs[0]["streams"]] == [n, n]
    assert relay.duplicated + relay.stale > 0, "the relay duplicated nothing: the test tested nothing"
    print(f"relay seed {seed}: {relay.duplicated} attempts duplicated, {relay.stale} abandoned ones delivered late, "
          f"{sh.log().count('took over')} sessions fenced by a newer one")
    return relay


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", [0, 1])
def test_relay_duplicating_connection_attempts(home: Path, spool_dir: Path, tmp_path: Path, seed: int) -> None:
    relay_run(home, spool_dir, tmp_path, seed)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_relay_duplicating_connection_attempts_many_schedules(home: Path, spool_dir: Path, tmp_path: Path,
                                                              relay_seed: int) -> None:
    relay_run(home, spool_dir, tmp_path, relay_seed)


# -- carrier sense and slow shadows ------------------------------------------------------


@pytest.mark.timeout(120)
def test_busy_shadow_makes_the_agent_back_off(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    busy = ShadowProc(home, logs, extra=["--min-free", "1000TB"])  # "disk low at home"
    port = busy.start()
    try:
        w = Wrapper(["--shadow", busy.address, "--spool", str(spool_dir), "--job-id", "patient",
                     "--retry-timeout", "1", "--stdout", "b.out", "--", *genjob(2 * MB, 0, seed=13)])
        wait_until(lambda: b"BUSY" in (busy.log().encode()) or "come back later" in busy.log(), 30, "a BUSY answer")
    finally:
        busy.stop()
    ok = ShadowProc(home, logs)
    ok.start(port)
    try:
        assert w.wait(60) == 0, w.err.decode()
    finally:
        ok.stop()
    check_landed(home, "b.out", 2 * MB, 13)
    assert b"disk low at home" in w.err and b"BUSY" in w.err


@pytest.mark.timeout(120)
def test_slow_shadow_is_not_dead(netns: NetNS, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """A thin link (1 Mbit/s token bucket): one DATA frame takes longer than the
    heartbeat timeout, yet the connection is kept; the spool absorbs the lag."""
    if shutil.which("tc") is None:
        pytest.skip("needs tc (apt-get install iproute2)")
    proc, port = shadow_in_ns(netns, home, tmp_path)
    subprocess.run(["tc", "qdisc", "add", "dev", VETH_HOST, "root", "tbf", "rate", "1mbit", "burst", "32kbit",
                    "latency", "400ms"], check=True, timeout=10)
    try:
        w = Wrapper(["--shadow", f"{NS_IP}:{port}", "--spool", str(spool_dir), "--job-id", "slowpoke", "-v",
                     "--heartbeat", "0.5", "--stdout", "s.out", "--", *genjob(int(1.5 * MB), 0, seed=17)])
        assert w.wait(90) == 0, w.err.decode()
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", VETH_HOST, "root"], timeout=10)
        stop(proc)
    check_landed(home, "s.out", int(1.5 * MB), 17)
    assert b"no answer from the shadow" not in w.err, w.err.decode()
    assert b"stalled" not in w.err, w.err.decode()


# -- preemption ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_preemption_sigterm_forwarded_and_output_pushed_home(shadow: ShadowProc, home: Path,
                                                             spool_dir: Path) -> None:
    """The batch system sends SIGTERM to gcwrap alone: the job gets it, dies,
    and gcwrap pushes everything the job wrote home before it exits."""
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "preempted",
                 "--stdout", "pre.out", "--stderr", "pre.err", "--", *genjob(200 * MB, 5 * MB, seed=23, rate=10 * MB)])
    wait_until(lambda: file_size(home / "pre.out") > 3 * MB, 60, "output at home")
    os.kill(w.proc.pid, signal.SIGTERM)  # not the process group: gcwrap must forward it
    assert w.wait(60) == 128 + signal.SIGTERM, w.err.decode()
    assert list(spool_dir.glob("*.spool")) == [], "everything was acknowledged before gcwrap exited"
    for name, n, seed in (("pre.out", 200 * MB, 23), ("pre.err", 5 * MB, 24)):
        landed = (home / name).read_bytes()
        assert 0 < len(landed) < n
        assert landed == random.Random(seed).randbytes(n)[: len(landed)], f"{name} is a byte-exact prefix"
    jobs = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                                     check=True, timeout=30).stdout)
    assert jobs[0]["exit_signal"] == signal.SIGTERM
