"""The files a job writes (--file) under faults, identities and permissions.

Real gcwrap and gcshadow processes; real faults from the kernel (a tmpfs
that fills, kill -9, an iptables black hole, a file the job's user made
unreadable). Each test checks that every file that can be saved is home
exactly (SHA-256), the streams too, and that what cannot be is said in one
clear line.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faults import NS_IP, NetNS, Tmpfs, need_netns, need_tmpfs, shadow_in_ns
from helpers import ShadowProc, Wrapper, as_user, file_size, python_job, sha256_file, tool, wait_until

from gcwrap.wire.auth import agent_mac, new_nonce
from gcwrap.wire.events import (
    FILES_FEATURE,
    Auth,
    Challenge,
    Error,
    ErrorCode,
    FileOpen,
    Hello,
    StreamSpec,
    Welcome,
)
from gcwrap.wire.protocol import NEED_DATA, Connection, Role

pytestmark = pytest.mark.timeout(120)

MB = 1 << 20



def _args(address: str, spool: Path, job_id: str, files: list[str], *extra: str) -> list[str]:
    args = ["--shadow", address, "--spool", str(spool), "--job-id", job_id, "--retry-timeout", "0.5",
            "--stdout", f"{job_id}.out", *extra]
    for f in files:
        args += ["--file", f]
    return args


def _same(home: Path, work: Path, *paths: str) -> None:
    for path in paths:
        assert (home / path).exists(), f"{path} is not at home"
        assert sha256_file(home / path) == sha256_file(work / path), f"{path} differs at home"


def _staging(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob(".*.gcwrap-*"))


def _one_line(err: bytes, *words: str) -> str:
    """The one line of gcwrap's stderr that holds every word (no traceback anywhere)."""
    text = err.decode(errors="replace")
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if all(w in line for w in words)]
    assert lines, f"no line with {words} in: {text}"
    return lines[0]


# -- 1. two identities ------------------------------------------------------------------------------


@pytest.fixture
def tokens(tmp_path: Path) -> dict[str, Path]:
    d = tmp_path / "tokens"
    d.mkdir(mode=0o700)
    out = {}
    for who in ("alice", "bob"):
        (d / who).write_text(os.urandom(32).hex() + "\n")
        (d / who).chmod(0o600)
        out[who] = d / who
    return out


@pytest.fixture
def shared(home: Path, tmp_path: Path, tokens: dict[str, Path]) -> Iterator[ShadowProc]:
    """One shadow, an identity for each of alice and bob (a token each)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["--token-dir", str(tokens["alice"].parent)])
    sh.start()
    try:
        yield sh
    finally:
        sh.stop()


def test_two_identities_each_get_their_own_file_under_the_same_name(
        shared: ShadowProc, home: Path, tmp_path: Path, tokens: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    runs = {}
    for who in ("alice", "bob"):
        work = tmp_path / f"work-{who}"
        work.mkdir()
        monkeypatch.chdir(work)  # (the job's working directory: gcwrap's, as it starts)
        runs[who] = Wrapper([*_args(shared.address, tmp_path / f"spool-{who}", f"{who}-1",
                                    ["result.txt", "state.json", f"log.txt={who}-logs/%j.log", "bob/note.txt"],
                                    "--token-file", str(tokens[who])), "--", *python_job(f"""
            rng = random.Random({len(who)})
            os.makedirs("bob", exist_ok=True)
            with open("log.txt", "a") as log:
                for step in range(20):
                    log.write("{who} " * rng.randrange(1, 2000) + "\\n")
                    log.flush()
                    with open(".state.tmp", "w") as f:
                        json.dump({{"who": "{who}", "step": step, "pad": "{who}" * 20000}}, f)
                    os.replace(".state.tmp", "state.json")
                    time.sleep(0.05)
            with open("result.txt", "w") as f:
                f.write("{who}'s result\\n" * 1000)
            with open("bob/note.txt", "w") as f:
                f.write("written by {who}\\n")
        """)])
    for w in runs.values():
        assert w.wait(60) == 0, w.err.decode()
    for who in ("alice", "bob"):
        work = tmp_path / f"work-{who}"
        _same(home / who, work, "result.txt", "state.json", "bob/note.txt")
        assert sha256_file(home / who / f"{who}-logs/{who}-1.log") == sha256_file(work / "log.txt")
        assert (home / who / "result.txt").read_text().startswith(f"{who}'s result")
    # Nothing outside each identity's directory: no file of one in the other's, none at the root.
    assert sorted(p.name for p in home.iterdir() if p.name != ".gcshadow") == ["alice", "bob"]
    assert (home / "bob" / "bob" / "note.txt").read_text() == "written by bob\n"
    assert (home / "alice" / "bob" / "note.txt").read_text() == "written by alice\n"
    assert not (home / "alice" / "bob-logs").exists() and not (home / "bob" / "alice-logs").exists()
    assert _staging(home) == []


@pytest.mark.parametrize("spec", ["r.txt=../r.txt", "r.txt=/tmp/r.txt", "r.txt=x/../../bob/r.txt", "../r.txt",
                                  "/etc/hostname", "r.txt=.gcshadow/r.txt"])
def test_a_name_that_leaves_the_identitys_directory_is_refused_before_the_job_starts(
        shared: ShadowProc, home: Path, tmp_path: Path, tokens: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        spec: str) -> None:
    monkeypatch.chdir(tmp_path)
    ran = tmp_path / "ran"
    w = Wrapper([*_args(shared.address, tmp_path / "spool", "alice-2", [spec], "--token-file", str(tokens["alice"])),
                 "--", "touch", str(ran)])
    assert w.wait(30) == 2, w.err.decode()
    line = _one_line(w.err, "--file")
    assert len(w.err.decode().split()) and len([x for x in w.err.decode().splitlines() if x.strip()]) <= 3, \
        w.err.decode()  # (click's usage line, its hint, the error)
    assert spec.partition("=")[2 if "=" in spec else 0] in line or spec in line, line
    assert not ran.exists(), "the job is not started"
    assert sorted(p.name for p in home.iterdir() if p.name != ".gcshadow") == []


def _raw_alice(port: int, token: bytes, job: str) -> tuple[socket.socket, Connection]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn = Connection(Role.AGENT)
    nonce = new_nonce()
    sock.sendall(conn.send(Hello(job_id=job, instance="i1", streams=(StreamSpec(1, "stdout", f"{job}.out"),),
                                 host="test", features=(FILES_FEATURE,), nonce=nonce)))
    challenge = _next(sock, conn)
    assert isinstance(challenge, Challenge), challenge
    sock.sendall(conn.send(Auth(agent_mac(token, nonce, challenge.nonce, job, "i1"))))
    assert isinstance(_next(sock, conn), Welcome)
    return sock, conn


def _next(sock: socket.socket, conn: Connection) -> object:
    while True:
        ev = conn.next_event()
        if ev is not NEED_DATA:
            return ev
        conn.receive_data(sock.recv(65536))


@pytest.mark.parametrize("name", ["../bob/result.txt", "/etc/passwd", "x/../../bob/result.txt",
                                  ".result.txt.gcwrap-1-2"])
def test_the_shadow_refuses_a_file_name_that_leaves_the_identitys_directory(
        shared: ShadowProc, home: Path, tokens: dict[str, Path], name: str) -> None:
    """What gcwrap refuses on its command line, the shadow refuses again (it trusts no agent)."""
    (home / "bob").mkdir()
    (home / "bob" / "result.txt").write_bytes(b"bob's\n")
    sock, conn = _raw_alice(shared.port, tokens["alice"].read_text().strip().encode(), "alice-3")
    with sock:
        sock.sendall(conn.send(FileOpen(1, name, 1)))
        ev = _next(sock, conn)
    assert isinstance(ev, Error), ev
    assert ev.code is ErrorCode.PATH_FORBIDDEN, ev
    assert (home / "bob" / "result.txt").read_bytes() == b"bob's\n"
    assert not (home / "alice" / "bob").exists()
    assert "alice-3" in shared.log() and name in shared.log()


# -- 2. permissions -------------------------------------------------------------------------------------


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can reach and write (its parents are world-searchable)."""
    d = Path(tempfile.mkdtemp(prefix="gcwrap-files-", dir="/var/tmp"))
    os.chmod(d, 0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.timeout(90)
def test_a_file_gcwrap_cannot_read_is_named_and_the_rest_delivered(shadow: ShadowProc, home: Path,
                                                                  open_dir: Path) -> None:
    """gcwrap and its job run as nobody; the job makes one file no one but
    root may read (mode 000 from its creation), and replaces another,
    already home, by one of mode 000. gcwrap says which file and why, home
    keeps what it had of the second, and the streams and the other files
    are home exactly."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    work = open_dir / "work"
    work.mkdir(mode=0o777)
    os.chmod(work, 0o777)
    w = subprocess.Popen(
        [*as_user(65534), *tool("gcwrap"), *_args(shadow.address, open_dir / "spool", "perm",
                                                  ["secret.bin", "state.json", "log.txt"], "--stderr", "perm.err"),
         "--", *python_job("""
            fd = os.open("secret.bin", os.O_WRONLY | os.O_CREAT, 0o000)
            os.write(fd, b"s" * 100000)
            os.close(fd)
            with open("state.json", "w") as f:
                f.write('{"step": 0}')
            with open("log.txt", "a") as log:
                for i in range(30):
                    log.write(f"line {i}\\n" * 100)
                    log.flush()
                    print(f"out {i}", flush=True)
                    print(f"err {i}", file=sys.stderr, flush=True)
                    time.sleep(0.1)
            gate("home-has-v1")
            fd = os.open(".state.tmp", os.O_WRONLY | os.O_CREAT, 0o000)
            os.write(fd, b'{"step": 1}')
            os.close(fd)
            os.replace(".state.tmp", "state.json")
            time.sleep(1.5)
        """)], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HOME": "/nonexistent"},
        start_new_session=True)
    try:
        wait_until(lambda: (home / "state.json").exists() and (home / "state.json").read_bytes() == b'{"step": 0}',
                   30, "the first state.json at home")
        (work / "home-has-v1").touch()
        _, err = w.communicate(timeout=60)
    finally:
        if w.poll() is None:
            os.killpg(w.pid, 9)
            w.wait(10)
    text = err.decode(errors="replace")
    assert "Traceback" not in text, text
    # One line for each, said once (not again at the job's end), saying what home holds of it.
    assert _one_line(err, "secret.bin") == ("gcwrap: cannot read the job's file secret.bin (Permission denied): "
                                            "home gets none of it"), text
    assert _one_line(err, "state.json") == ("gcwrap: cannot read the job's file state.json (Permission denied): "
                                            "home keeps the last version gcwrap could read"), text
    said = "\n".join(line for line in text.splitlines() if not line.startswith("gcwrap:   files:"))  # (the summary)
    assert said.count("secret.bin") == 1 and said.count("state.json") == 1, text
    assert "secret.bin 0 B (gcwrap cannot read it: home keeps what it had)" in text, text
    assert "state.json 11 B (gcwrap cannot read it: home keeps what it had)" in text, text  # (its first version)
    assert w.returncode == 0, text
    assert not (home / "secret.bin").exists()
    assert (home / "state.json").read_bytes() == b'{"step": 0}'  # (what home had: the last it could read)
    assert (home / "log.txt").read_bytes() == b"".join(f"line {i}\n".encode() * 100 for i in range(30))
    assert (home / "perm.out").read_bytes() == b"".join(f"out {i}\n".encode() for i in range(30))
    assert (home / "perm.err").read_bytes() == b"".join(f"err {i}\n".encode() for i in range(30))
    assert _staging(home) == []



@pytest.mark.timeout(90)
def test_a_file_in_a_directory_gcwrap_cannot_reach_is_named(shadow: ShadowProc, home: Path, open_dir: Path) -> None:
    """The job (as nobody, as gcwrap) closes the directories its files lie
    in: one it makes unsearchable (a named --file in it cannot be stat'ed),
    one it makes unreadable (a glob cannot list it). Each is said in a
    line, once, naming the path and why; the rest is home exactly (before:
    nothing was said, the files were taken as absent)."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    work = open_dir / "work"
    work.mkdir()
    os.chmod(work, 0o777)
    w = subprocess.Popen(
        [*as_user(65534), *tool("gcwrap"), *_args(shadow.address, open_dir / "spool", "dirs",
                                                  ["priv/x.txt", "locked/*.csv", "ok.txt"]),
         "--", *python_job("""
            os.makedirs("priv")
            os.makedirs("locked")
            open("priv/x.txt", "w").write("x\\n")
            open("locked/a.csv", "w").write("a,1\\n")
            os.chmod("priv", 0o600)  # (no search: its files cannot be stat'ed)
            os.chmod("locked", 0o300)  # (no read: it cannot be listed)
            with open("ok.txt", "w") as f:
                f.write("ok\\n" * 1000)
            time.sleep(2.5)
            print("done", flush=True)
        """)], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "HOME": "/nonexistent"},
        start_new_session=True)
    try:
        _, err = w.communicate(timeout=60)
    finally:
        if w.poll() is None:
            os.killpg(w.pid, 9)
            w.wait(10)
    text = err.decode(errors="replace")
    assert w.returncode == 0, text
    assert _one_line(err, "priv/x.txt") == ("gcwrap: cannot reach the job's file priv/x.txt (Permission denied): "
                                            "home gets what gcwrap could read of it before, if anything"), text
    assert _one_line(err, "locked") == ("gcwrap: cannot list the directory locked of --file 'locked/*.csv' "
                                        "(Permission denied): its files there are not seen"), text
    assert [sum(word in line for line in text.splitlines()) for word in ("priv", "locked")] == [1, 1], text
    assert (home / "ok.txt").read_bytes() == b"ok\n" * 1000
    assert (home / "dirs.out").read_bytes() == b"done\n"
    for d in ("priv", "locked"):
        os.chmod(work / d, 0o700)  # (for the clean-up)


# -- 3. the home disk full; a file larger than the quota ---------------------------------------------------


@pytest.mark.timeout(120)
def test_home_disk_full_while_a_file_streams(spool_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shadow's root (a 24 MB tmpfs) fills while the job appends a log
    and rewrites a file by rename: the job never waits, the files wait, and
    once space is back every file lands exactly, no staging file left."""
    need_tmpfs()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with Tmpfs(tmp_path / "root", "24m") as fs:
        logs = tmp_path / "logs"
        logs.mkdir()
        sh = ShadowProc(fs.path, logs, extra=["--min-free", "0"])
        sh.start()
        try:
            w = Wrapper([*_args(sh.address, spool_dir, "full", ["big.log", "state.bin"]), "--", *python_job("""
                rng = random.Random(7)
                stamps = open("stamps", "w")
                with open("big.log", "ab") as log:
                    for step in range(80):
                        log.write(rng.randbytes(100_000))
                        log.flush()
                        if step % 10 == 0:
                            with open(".state.tmp", "wb") as f:
                                f.write(rng.randbytes(1_000_000))
                            os.replace(".state.tmp", "state.bin")
                        print(f"step {step}", flush=True)
                        stamps.write(f"{time.monotonic()}\\n")
                        stamps.flush()
                        if step in (20, 50):
                            gate("filled" if step == 20 else "freed")
                            stamps.write("gate\\n")  # (its wait is the test's, not a gap)
                        time.sleep(0.05)
            """)])
            wait_until(lambda: file_size(fs.path / "big.log") >= 2_000_000, 30, "the log's first steps at home")
            filler = fs.fill()
            (work / "filled").touch()
            wait_until(lambda: (work / "stamps").read_text().count("\n") >= 52, 30, "the job to go on, home full")
            time.sleep(1)  # (the agent is refused meanwhile, and backs off)
            filler.unlink()
            (work / "freed").touch()
            assert w.wait(90) == 0, w.err.decode()
        finally:
            sh.stop()
        _same(fs.path, work, "big.log", "state.bin")
        assert (fs.path / "full.out").read_bytes() == b"".join(f"step {i}\n".encode() for i in range(80))
        assert _staging(fs.path) == []
        runs = [[float(x) for x in run.split()] for run in (work / "stamps").read_text().split("gate\n")]
        gaps = [b - a for stamps in runs for a, b in itertools.pairwise(stamps)]
        assert max(gaps) < 1.0, ("the job does not wait for home's disk",
                                 [(i, g) for i, g in enumerate(gaps) if g > 0.2])
        assert b"No space left" in w.err or b"disk is full" in w.err, w.err.decode()


@pytest.mark.timeout(90)
def test_a_file_larger_than_the_quota_is_refused_by_name_and_the_streams_delivered(
        home: Path, tmp_path: Path, spool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["--quota", "1MB"])
    sh.start()
    try:
        w = Wrapper([*_args(sh.address, spool_dir, "over", ["small.txt", "huge.bin"], "--stderr", "over.err"),
                     "--", *python_job("""
            for i in range(100):
                print(f"before {i}", flush=True)
            with open("small.txt", "w") as f:
                f.write("small\\n" * 1000)
            time.sleep(1.5)
            with open("huge.bin", "wb") as f:
                f.write(os.urandom(3_000_000))
            time.sleep(1.5)
            for i in range(100):
                print(f"after {i}", flush=True)
                print(f"err {i}", file=sys.stderr, flush=True)
        """)])
        code = w.wait(60)
    finally:
        sh.stop()
    text = w.err.decode(errors="replace")
    # The shadow refuses the job as it refuses a stream past the quota, naming the file: the job goes
    # on, what home took before is home exactly, the rest stays in the spool (123: see --quota).
    line = _one_line(w.err, "huge.bin", "quota of 1000000 bytes", "[QUOTA]")
    assert "refused" in line, line
    assert code == 123, text
    # The streams: home exactly (their bytes are within the quota, and sent between the file's refusals).
    assert (home / "over.out").read_bytes() == b"".join(f"before {i}\n".encode() for i in range(100)) + b"".join(
        f"after {i}\n".encode() for i in range(100)), text
    assert (home / "over.err").read_bytes() == b"".join(f"err {i}\n".encode() for i in range(100)), text
    assert (home / "small.txt").read_bytes() == b"small\n" * 1000
    assert file_size(home / "huge.bin") <= 1_000_000
    # (a staged version of it may stay at home: the job is refused, not ended; `gcwrap resume` goes on from it)


# -- 4. the shadow killed -9 mid-file -----------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_the_shadow_killed_mid_file_three_times(shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 while a large file is on its way: mid-way through a first
    version written in place, while a staged rewrite is, while blocks
    written in place are; every file exact at the end, no staging file
    left, no byte twice in the appended one."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    w = Wrapper([*_args(shadow.address, spool_dir, "k9", ["big.log", "model.bin", "data.bin"]), "--", *python_job("""
        rng = random.Random(11)
        with open("big.log", "ab") as log:
            for i in range(60):  # 30 MB, 0.5 MB every 20 ms
                log.write(rng.randbytes(500_000))
                log.flush()
                time.sleep(0.02)
        gate("go1")
        end = time.monotonic() + 60
        while not os.path.exists("go2") and time.monotonic() < end:  # 20 MB rewrites by rename, until the kill
            with open(".model.tmp", "wb") as f:
                for _ in range(40):
                    f.write(rng.randbytes(500_000))
            os.replace(".model.tmp", "model.bin")
            time.sleep(0.3)
        fd = os.open("data.bin", os.O_RDWR | os.O_CREAT, 0o644)
        os.write(fd, rng.randbytes(16 << 20))
        time.sleep(1.5)
        for _ in range(200):
            os.pwrite(fd, rng.randbytes(rng.randrange(1, 20000)), rng.randrange(0, 16 << 20))
        os.close(fd)
        with open("big.log", "ab") as log:
            log.write(rng.randbytes(3_000_000))
    """)])

    def kill_when(cond: object, what: str) -> None:
        wait_until(cond, 30, what, interval=0.005)  # type: ignore[arg-type]
        shadow.kill9()
        time.sleep(0.5)
        shadow.start()

    kill_when(lambda: 1_000_000 < file_size(home / "big.log") < 29_000_000, "big.log half home")
    (work / "go1").touch()
    kill_when(lambda: any(file_size(p) > 0 for p in home.glob(".model.bin.gcwrap-*")),
              "a rewrite of model.bin on its way home")
    (work / "go2").touch()
    kill_when(lambda: (file_size(home / "data.bin") >= 16 << 20 and (work / "data.bin").stat().st_mtime > 0
              and any(home.glob(".data.bin.gcwrap-*"))) or w.proc.poll() is not None, "data.bin's writes in place")
    assert w.wait(120) == 0, w.err.decode()
    _same(home, work, "big.log", "model.bin", "data.bin")
    assert _staging(home) == []
    assert shadow.starts == 4


# -- 5. the network down while a large file waits -----------------------------------------------------------


@pytest.fixture
def netns() -> Iterator[NetNS]:
    need_netns()
    with NetNS() as ns:
        yield ns


def _rss(pid: int) -> int:
    """The resident set of a process, in bytes (/proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.timeout(180)
def test_gcwraps_memory_stays_bounded_while_a_large_file_waits_behind_a_cut(
        netns: NetNS, home: Path, spool_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packets to the shadow vanish (iptables DROP) while the job writes a
    200 MiB file: gcwrap's resident memory stays within 32 MiB of what it
    was before (the file is read from the job's disk as it goes, never held
    in memory), and the file is home exactly after the heal."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    logs = tmp_path / "logs"
    logs.mkdir()
    proc, port = shadow_in_ns(netns, home, logs)
    try:
        w = Wrapper([*_args(f"{NS_IP}:{port}", spool_dir, "cut200", ["big.bin", "log.txt"], "--heartbeat", "1"),
                     "--", *python_job("""
            with open("log.txt", "a") as log:
                log.write("started\\n")
            gate("cut")
            rng = random.Random(13)
            with open("big.bin", "wb") as f:
                for _ in range(200):
                    f.write(rng.randbytes(1 << 20))
            with open("log.txt", "a") as log:
                log.write("written\\n")
            gate("healed")
            print("done", flush=True)
        """)])
        wait_until(lambda: (home / "log.txt").exists() and (home / "log.txt").read_bytes() == b"started\n", 30,
                   "the log at home")
        time.sleep(0.5)
        before = _rss(w.proc.pid)
        netns.blackhole(port)
        (work / "cut").touch()
        wait_until(lambda: b"written" in (work / "log.txt").read_bytes(), 60, "the 200 MiB file written")
        peak = before
        end = time.monotonic() + 8  # (several heartbeats: the connection declared dead, tried again into the cut)
        while time.monotonic() < end:
            peak = max(peak, _rss(w.proc.pid))
            time.sleep(0.05)
        assert file_size(home / "big.bin") < 200 * MB, "the cut let the file through"
        netns.heal()
        (work / "healed").touch()
        assert w.wait(120) == 0, w.err.decode()
    finally:
        proc.terminate()
        proc.wait(10)
    _same(home, work, "big.bin", "log.txt")
    assert peak - before < 32 * MB, (before, peak)  # (measured: 2 MiB)


# -- a NAME named as home names its staged versions ----------------------------------------------------------


def test_a_stream_named_as_a_staged_version_is_refused(shadow: ShadowProc, home: Path, tmp_path: Path) -> None:
    """Home stages a file's new version as `.BASENAME.gcwrap-F-V` beside it,
    and removes those it abandons: a stream of that name could be taken
    for one and removed, so gcwrap refuses it (2), and the shadow too."""
    ran = tmp_path / "ran"
    for option in ("--stdout", "--stderr", "--file"):
        value = "r.txt=.r.txt.gcwrap-1-2" if option == "--file" else "d/.r.txt.gcwrap-1-2"
        w = Wrapper(["--shadow", shadow.address, "--spool", str(tmp_path / "spool"), "--job-id", "staged",
                     option, value, "--", "touch", str(ran)])
        assert w.wait(30) == 2, w.err.decode()
        _one_line(w.err, f"Invalid value for {option}", "stages")
    assert not ran.exists()
    sock = socket.create_connection(("127.0.0.1", shadow.port), timeout=10)
    with sock:
        conn = Connection(Role.AGENT)
        sock.sendall(conn.send(Hello(job_id="staged", instance="i1", host="test",
                                     streams=(StreamSpec(1, "stdout", "d/.r.txt.gcwrap-1-2"),))))
        ev = _next(sock, conn)
    assert isinstance(ev, Error) and ev.code is ErrorCode.PATH_FORBIDDEN, ev
    assert not (home / "d").exists()


def test_a_glob_match_home_would_refuse_is_named_and_the_rest_delivered(
        shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A glob matches a file whose path cannot be a NAME (a control
    character in it; one named as home stages versions): gcwrap says so
    once and leaves that one out, rather than have the shadow refuse the
    whole job for it (before: every session refused, 123)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    w = Wrapper([*_args(shadow.address, spool_dir, "globbad", ["out/*.csv", "out/.*"]), "--", *python_job("""
        os.makedirs("out")
        open("out/a.csv", "w").write("a,1\\n")
        open("out/b\\x07.csv", "w").write("bell\\n")
        open("out/.a.csv.gcwrap-1-2", "w").write("staged-like\\n")
        time.sleep(1.5)
        print("done", flush=True)
    """)])
    assert w.wait(60) == 0, w.err.decode()
    _one_line(w.err, "out/b\\x07.csv", "control character")
    _one_line(w.err, "out/.a.csv.gcwrap-1-2", "stages")
    assert (home / "out" / "a.csv").read_bytes() == b"a,1\n"
    assert (home / "globbad.out").read_bytes() == b"done\n"
    assert sorted(p.name for p in (home / "out").iterdir()) == ["a.csv"]


@pytest.mark.parametrize("args", [("--file", "a=x", "--file", "b=./x"), ("--stdout", "r/out", "--file", "r/out"),
                                  ("--stderr", "e", "--file", "x.txt=e")])
def test_two_outputs_of_one_name_are_a_usage_error(shadow: ShadowProc, tmp_path: Path, args: tuple[str, ...]) -> None:
    """Two files, or a file and a stream, landing at one NAME: refused before
    the job starts (2), not by the shadow once it runs (before: 123)."""
    ran = tmp_path / "ran"
    w = Wrapper(["--shadow", shadow.address, "--spool", str(tmp_path / "spool"), "--job-id", "twice", *args, "--",
                 "touch", str(ran)])
    assert w.wait(30) == 2, w.err.decode()
    _one_line(w.err, "Invalid value for --file", "lands at", "too")
    assert not ran.exists()
