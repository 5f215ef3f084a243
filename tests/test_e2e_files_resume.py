"""End to end: gcwrap killed -9 while the job writes its files (--file),
then `gcwrap resume` brings every file home exactly, from the files
themselves: the spool keeps the specs, the working directory and how far
home took each version, never the bytes.

The installed gcwrap and gcshadow, real processes, loopback TCP; the SHA-256
of each file the job left is compared with home's copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import ShadowProc, Wrapper, sha256_bytes, spool_status, tool, wait_until

pytestmark = pytest.mark.timeout(120)

# The job: a log appended to, a JSON renamed over at every step, a binary written in place at random
# offsets, a scratch file; once gcwrap is gone (the file `go`): more of each, the binary extended, the
# scratch file deleted and a CSV created that matches a glob; then `done`.
JOB = """
import json, os, random, sys, time

def gate(path):
    end = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.02)

rng = random.Random(7)
open("pid", "w").write(str(os.getpid()))
fd = os.open("data.bin", os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, rng.randbytes(3 << 20))
with open("scratch.txt", "w") as f:
    f.write("scratch\\n" * 5000)
os.makedirs("out", exist_ok=True)
with open("out/early.csv", "w") as f:
    f.writelines(f"early,{i}\\n" for i in range(3000))
log = open("log.txt", "a")

def step(n):
    log.write(f"step {n} " + "x" * rng.randrange(100, 4000) + "\\n")
    log.flush()
    with open(".status.tmp", "w") as f:
        json.dump({"step": n, "values": [n * k for k in range(5000)]}, f)
    os.replace(".status.tmp", "status.json")
    time.sleep(0.02)

n = 0
while not os.path.exists("go"):
    step(n)
    n += 1
for i in range(40):
    if i % 4 == 0:
        os.pwrite(fd, rng.randbytes(rng.randrange(1, 3000)), rng.randrange(0, 3 << 20))
    step(n)
    n += 1
os.lseek(fd, 0, os.SEEK_END)
os.write(fd, rng.randbytes(1 << 20))
os.close(fd)
os.unlink("scratch.txt")
with open("out/late.csv", "w") as f:
    f.writelines(f"late,{i},{i * i}\\n" for i in range(20000))
log.close()
open("done", "w").close()
"""

FILES = ["log.txt", "status.json=state/status.json", "data.bin", "scratch.txt", "out/*.csv"]
AT_HOME = {"log.txt": "log.txt", "status.json": "state/status.json", "data.bin": "data.bin",
           "out/early.csv": "out/early.csv", "out/late.csv": "out/late.csv"}


def _committed(spool_dir: Path, path: str) -> bool:
    """The spool records a commit home acknowledged for the file at `path`."""
    spools = list(spool_dir.glob("*.spool"))
    if not spools:
        return False
    try:
        with sqlite3.connect(f"file:{spools[0]}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT 1 FROM files JOIN file_versions ON file = handle WHERE path = ? AND "
                              "committed IS NOT NULL", [path]).fetchone() is not None
    except sqlite3.Error:
        return False  # (no table yet)


def _summary(home: Path, job_id: str, status_known: bool = False) -> dict[str, str]:
    """The I/O summary home recorded for the job (its EXIT's: the resume's); the job's exit status
    unknown unless gcwrap recorded it before it was killed."""
    jobs = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True, check=True,
                          timeout=60)
    (rec,) = [r for r in json.loads(jobs.stdout) if r["job_id"] == job_id]
    assert ("exit status is unknown" in rec["reason"]) != status_known, rec
    return dict(rec["summary"])


def _recorded(spool_dir: Path, path: str) -> bool:
    """The spool records a version of the file at `path`."""
    (spool,) = spool_dir.glob("*.spool")
    try:
        with sqlite3.connect(f"file:{spool}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("SELECT 1 FROM files JOIN file_versions ON file = handle WHERE path = ?",
                              [path]).fetchone() is not None
    except sqlite3.Error:
        return False


def _resume(spool_dir: Path) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--retry-timeout", "1"],
                          capture_output=True, timeout=90)


@pytest.mark.parametrize("job_after", ["keeps running", "killed too", "ends while home is away"])
def test_gcwrap_killed_mid_run_then_resume_brings_every_file_home(
        shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        job_after: str) -> None:
    """gcwrap killed -9 while the job writes; the job either goes on to its end alone (its files change
    after gcwrap is gone) or dies with it (the files as it left them); or home goes away, the job ends,
    gcwrap records new versions home never sees, and is killed then. The resume makes home hold each
    file's content as the job left it, built from what home held."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # (gcwrap's working directory is the job's: its --file PATHs are relative to it)
    args = ["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "orphan", "--retry-timeout", "1",
            "--stdout", "orphan.out", "--stderr", "orphan.err"]  # (so the job holds no pipe of the test's)
    for f in FILES:
        args += ["--file", f]
    w = Wrapper([*args, "--", sys.executable, "-c", textwrap.dedent(JOB)])
    # Mid-run: the binary and the scratch file committed at home (quiet since they were written), the
    # log and the JSON changing.
    wait_until(lambda: _committed(spool_dir, "data.bin") and _committed(spool_dir, "scratch.txt")
               and _committed(spool_dir, "out/early.csv"), 60, "the quiet files committed at home")
    wait_until(lambda: (home / "log.txt").exists() and b"step 20 " in (home / "log.txt").read_bytes(), 30,
               "the log's first steps at home")
    try:
        if job_after == "ends while home is away":
            shadow.stop()
            (work / "go").touch()
            wait_until((work / "done").exists, 60, "the job to finish")
            wait_until(lambda: _recorded(spool_dir, "out/late.csv"), 30, "gcwrap to take the file made last")
            wait_until(lambda: str(spool_status(spool_dir)[0]["state"]).startswith("exited"), 30,
                       "the spool to record the job's exit")
            w.kill9()
            shadow.start()
        else:
            w.kill9()
            _after(work, job_after)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int((work / "pid").read_text()), signal.SIGKILL)  # (a job a failure left alone)
    res = _resume(spool_dir)
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert "all output delivered" in err, err
    paths = [p for p in AT_HOME if (work / p).exists()]
    for path in paths:
        assert sha256_bytes((home / AT_HOME[path]).read_bytes()) == sha256_bytes((work / path).read_bytes()), path
    if job_after != "killed too":
        assert len(paths) == 5 and (work / "data.bin").stat().st_size == 4 << 20
        # Deleted after gcwrap was gone: home keeps what it had, and the resume says so.
        assert (home / "scratch.txt").read_bytes() == b"scratch\n" * 5000
        assert "scratch.txt is gone" in err, err
    else:
        assert sha256_bytes((home / "scratch.txt").read_bytes()) == sha256_bytes((work / "scratch.txt").read_bytes())
    assert list(spool_dir.glob("*.spool")) == []
    # The resume built each file from what home held by the block digests: the binary's 3 MiB committed
    # before the kill are copied at home, less the few blocks written in place since.
    figures = _summary(home, "orphan", status_known=job_after == "ends while home is away")
    assert int(figures["files_copied"]) >= (2 << 20), figures
    assert "the spool cannot record" not in err and "cannot read" not in err, err


def _after(work: Path, job_after: str) -> None:
    """The job once gcwrap is gone: it goes on alone to its end, or it dies too."""
    pid = int((work / "pid").read_text())
    if job_after == "killed too":
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(),
                   10, "the job dead")
    else:
        (work / "go").touch()
        wait_until((work / "done").exists, 60, "the job to finish alone")


@pytest.mark.parametrize("spool_newest", [2, 3])
def test_resume_where_home_holds_an_older_version_committed_and_a_newer_in_progress(
        shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path, spool_newest: int) -> None:
    """Home's WELCOME names the newest version it holds of a file (2, not committed); NAME holds an
    older one committed (1). The resume builds the file's content on version 1, by its block digests
    the spool kept, whether the spool still keeps version 2 or dropped it for a version 3 whose
    FILE_OPEN home never read (gcwrap killed just after recording it)."""
    from rawagent import RawAgent

    from gcwrap.agent.filedelta import BLOCK_SIZE, Scan, digests_of
    from gcwrap.agent.filespecs import FileSpec
    from gcwrap.agent.records import JobRecord
    from gcwrap.agent.spool import SPOOL_SUFFIX, Spool
    from gcwrap.agent.spoolfiles import FileRecord, SpoolFiles
    from gcwrap.wire.events import FILES_FEATURE, FileAck, FileCommit, FileData, FileOpen, Hello, StreamSpec, Welcome

    rng = random.Random(spool_newest)
    first = rng.randbytes(5 * BLOCK_SIZE)
    second = rng.randbytes(2 * BLOCK_SIZE)  # (what home holds of version 2: its start)
    final = first[:BLOCK_SIZE] + rng.randbytes(BLOCK_SIZE) + first[2 * BLOCK_SIZE :] + rng.randbytes(70_000)
    # Home: version 1 committed, version 2 (on base 1) begun, by a run whose gcwrap was killed.
    raw = RawAgent(shadow.port)
    try:
        raw.send(Hello(job_id="based", instance="i1", streams=(StreamSpec(1, "stdout", "based.out"),), host="test",
                       features=(FILES_FEATURE,)))
        assert isinstance(raw.next(), Welcome)
        raw.send(FileOpen(1, "data.bin", 1))
        raw.send(FileData(1, 1, 0, first))
        raw.send(FileCommit(1, 1, len(first), hashlib.sha256(first).hexdigest()))
        _acked(raw, FileAck(1, 1, len(first), True))
        raw.send(FileOpen(1, "data.bin", 2, base=1))
        raw.send(FileData(1, 2, 0, second))
        _acked(raw, FileAck(1, 2, len(second)))
    finally:
        raw.close()
    # The spool that run left: the specs, the file, version 1 scanned and committed, the newest on base 1.
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.bin").write_bytes(final)
    st = (work / "data.bin").stat()
    spool_dir.mkdir()
    spool = Spool.create(spool_dir / f"based{SPOOL_SUFFIX}", JobRecord("based", "i1", ["job"]),
                         [(1, "stdout", "based.out")])
    try:
        files = SpoolFiles(spool)
        files.record_specs(work, (FileSpec("data.bin"),))
        files.add_file(FileRecord(1, "data.bin", "data.bin", "data.bin", st.st_dev, st.st_ino))
        files.new_version(1, 1, st.st_dev, st.st_ino, None)
        files.scanned(1, 1, Scan(hashlib.sha256(first).hexdigest(), digests_of(first)))
        files.commit_acked(1, 1, len(first))
        for version in range(2, spool_newest + 1):
            files.new_version(1, version, st.st_dev, st.st_ino, base=1)
    finally:
        spool.close()
    res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--shadow", shadow.address,
                          "--retry-timeout", "1"], capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr.decode()
    assert sha256_bytes((home / "data.bin").read_bytes()) == sha256_bytes(final)
    figures = _summary(home, "based")
    assert int(figures["files_copied"]) >= len(first) - BLOCK_SIZE, figures  # (built on version 1)
    assert int(figures["files_sent"]) <= BLOCK_SIZE + 70_000, figures


def _acked(raw: Any, ack: Any) -> None:
    """Read until home acknowledged as far as `ack` (an ERROR fails the test)."""
    from gcwrap.wire.events import FileAck

    while True:
        ev = raw.until(FileAck)
        assert isinstance(ev, FileAck), ev
        if ev == ack:
            return


def test_a_job_with_files_alone_leaves_a_spool_that_resume_delivers(
        shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No stream named, only --file, and home out of reach: the spool keeps the files' record (made
    before the job starts, as for streams), and `gcwrap resume` delivers them from the files."""
    import socket

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed: nothing listens there)
    w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir), "--job-id", "alone", "--retry-timeout",
                 "0.2", "--retry-limit", "2", "--file", "result.txt=r/result.txt", "--", sys.executable, "-c",
                 "open('result.txt', 'w').write('done\\n' * 1000)"])
    assert w.wait(60) == 122, w.err.decode()
    assert b"gcwrap resume --spool" in w.err
    res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--shadow", shadow.address,
                          "--retry-timeout", "1"], capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr.decode()
    assert (home / "r/result.txt").read_bytes() == b"done\n" * 1000
    assert list(spool_dir.glob("*.spool")) == []


def _home_committed(home: Path, name: str) -> int:
    """The size home holds the file at `name` committed at (its newest commit), or -1."""
    try:
        with sqlite3.connect(f"file:{home / '.gcshadow/state.db'}?mode=ro", uri=True, timeout=1) as db:
            row = db.execute("SELECT MAX(committed) FROM file_versions WHERE name = ?", [name]).fetchone()
    except sqlite3.Error:
        return -1
    return -1 if row is None or row[0] is None else int(row[0])


def test_a_log_committed_again_as_it_grew_is_not_sent_again_by_the_resume(
        shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A log appended to and committed at checkpoints (quiet moments) as it grew to 3 MiB, then gcwrap
    and the job killed -9: the resume builds the log on what home holds committed, its newest
    commit's, not its first's: the 3 MiB are copied at home, not sent again."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    code = textwrap.dedent("""
        import os, time
        open("pid", "w").write(str(os.getpid()))
        with open("train.log", "ab") as log:
            log.write(b"first line\\n")
            log.flush()
            time.sleep(1.5)  # (quiet: its first commit, at 11 bytes)
            for i in range(3 * 1024):
                log.write(os.urandom(512).hex().encode()[:1023] + b"\\n")
            log.flush()
            time.sleep(60)  # (quiet: committed at 3 MiB and more; killed meanwhile)
    """)
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "grown", "--retry-timeout", "1",
                 "--stdout", "grown.out", "--stderr", "grown.err", "--file", "train.log", "--",
                 sys.executable, "-c", code])
    size = 11 + 3 * 1024 * 1024
    try:
        wait_until(lambda: _home_committed(home, "train.log") == size, 30, "the grown log committed at home")
        w.kill9()
    finally:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.kill(int((work / "pid").read_text()), signal.SIGKILL)
    res = _resume(spool_dir)
    assert res.returncode == 0, res.stderr.decode()
    assert sha256_bytes((home / "train.log").read_bytes()) == sha256_bytes((work / "train.log").read_bytes())
    figures = _summary(home, "grown")
    assert int(figures["files_sent"]) < 64 << 10 and int(figures["files_copied"]) >= size - (64 << 10), figures
