"""End to end: the files a job writes (--file) come home, live and exact.

The installed gcwrap and gcshadow, real processes, loopback TCP; every test
compares the SHA-256 of each file the job left with home's copy.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ShadowProc, Wrapper, python_job, sha256_bytes, tool, wait_until

pytestmark = pytest.mark.timeout(120)




def _run(shadow: ShadowProc, spool_dir: Path, job_id: str, files: list[str], code: str) -> Wrapper:
    args = ["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", job_id, "--retry-timeout", "1",
            "--stdout", f"{job_id}.out"]
    for f in files:
        args += ["--file", f]
    return Wrapper([*args, "--", *python_job(code)])


def _summary(home: Path, job_id: str) -> dict[str, str]:
    """The I/O summary home recorded for the job (its EXIT's)."""
    jobs = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True, check=True,
                          timeout=60)
    (rec,) = [r for r in json.loads(jobs.stdout) if r["job_id"] == job_id]
    return dict(rec["summary"])


def _same(home: Path, work: Path, *paths: str) -> None:
    for path in paths:
        assert (home / path).exists(), f"{path} is not at home"
        assert sha256_bytes((home / path).read_bytes()) == sha256_bytes((work / path).read_bytes()), path


def test_an_appended_log_is_at_home_while_the_job_runs(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                       work: Path) -> None:
    w = _run(shadow, spool_dir, "applog", ["train.log"], """
        with open("train.log", "a") as f:
            for i in range(2000):
                f.write(f"step {i} loss {1 / (i + 1):.6f}\\n")
            f.flush()
            gate("go")
            for i in range(2000, 5000):
                f.write(f"step {i} loss {1 / (i + 1):.6f}\\n")
    """)
    first = b"".join(f"step {i} loss {1 / (i + 1):.6f}\n".encode() for i in range(2000))
    log = home / "train.log"
    wait_until(lambda: log.exists() and log.read_bytes().startswith(first), 30, "the log's first lines at home")
    (work / "go").touch()
    assert w.wait(60) == 0, w.err.decode()
    _same(home, work, "train.log")
    assert (work / "train.log").stat().st_size > len(first)


def test_a_json_rewritten_by_rename_every_step_lands_as_its_last_version(
        shadow: ShadowProc, home: Path, spool_dir: Path, work: Path) -> None:
    w = _run(shadow, spool_dir, "renames", ["status.json=state/status.json"], """
        for step in range(40):
            with open(".status.json.tmp", "w") as f:
                json.dump({"step": step, "values": [step * k for k in range(20000)]}, f)
            os.replace(".status.json.tmp", "status.json")
            time.sleep(0.05)
    """)
    assert w.wait(60) == 0, w.err.decode()
    assert sha256_bytes((home / "state/status.json").read_bytes()) == sha256_bytes(
        (work / "status.json").read_bytes())
    assert '"step": 39' in (home / "state/status.json").read_text()


def test_a_binary_written_at_random_offsets_then_extended(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                          work: Path) -> None:
    w = _run(shadow, spool_dir, "pwrites", ["data.bin"], """
        rng = random.Random(5)
        fd = os.open("data.bin", os.O_RDWR | os.O_CREAT, 0o644)
        os.write(fd, rng.randbytes(3 << 20))
        gate("go")
        for _ in range(30):
            os.pwrite(fd, rng.randbytes(rng.randrange(1, 5000)), rng.randrange(0, 3 << 20))
        time.sleep(1.5)
        for _ in range(30):
            os.pwrite(fd, rng.randbytes(100), rng.randrange(0, 3 << 20))
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, rng.randbytes(1 << 20))
        os.close(fd)
    """)
    wait_until(lambda: (home / "data.bin").exists() and (home / "data.bin").stat().st_size == 3 << 20, 30,
               "the first content at home")
    (work / "go").touch()
    assert w.wait(60) == 0, w.err.decode()
    _same(home, work, "data.bin")
    assert (home / "data.bin").stat().st_size == 4 << 20
    # The writes in place cost the blocks they touched (60 writes: at most 60 blocks of 64 KiB), not the
    # whole file again at every version (3 + 3 + 4 MiB at least): the 3 MiB written first, the 1 MiB
    # appended (twice where a stat pass saw it grow before the digests found the writes below it), and
    # those blocks; the rest home copied from the version it held.
    figures = _summary(home, "pwrites")
    sent, copied = int(figures["files_sent"]), int(figures["files_copied"])
    assert (4 << 20) <= sent <= (5 << 20) + 60 * (64 << 10) < 10 << 20, figures
    assert copied >= 1 << 20, figures


def test_files_created_late_that_match_a_glob_come_home(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                        work: Path) -> None:
    w = _run(shadow, spool_dir, "globbed", ["out/*.csv", "never.txt"], """
        time.sleep(1.2)
        os.makedirs("out/sub", exist_ok=True)
        for name in ("a", "b"):
            with open(f"out/{name}.csv", "w") as f:
                f.writelines(f"{name},{i},{i * i}\\n" for i in range(10000))
        open("out/empty.csv", "w").close()
        with open("out/sub/c.csv", "w") as f:
            f.write("not matched\\n")
        with open("out/.draft.csv", "w") as f:
            f.write("a dot-draft\\n")
    """)
    assert w.wait(60) == 0, w.err.decode()
    _same(home, work, "out/a.csv", "out/b.csv", "out/empty.csv")
    assert not (home / "out/sub").exists() and not (home / "out/.draft.csv").exists()
    assert not (home / "never.txt").exists()


def test_a_deleted_file_keeps_its_last_content_at_home(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                       work: Path) -> None:
    w = _run(shadow, spool_dir, "deleted", ["scratch.txt"], """
        with open("scratch.txt", "w") as f:
            f.write("kept\\n" * 1000)
        time.sleep(1.5)
        os.unlink("scratch.txt")
    """)
    assert w.wait(60) == 0, w.err.decode()
    assert (home / "scratch.txt").read_bytes() == b"kept\n" * 1000


def test_the_shadow_killed_mid_run_and_restarted(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                 work: Path) -> None:
    w = _run(shadow, spool_dir, "killed", ["log.txt", "state.json"], """
        rng = random.Random(9)
        with open("log.txt", "a") as log:
            for step in range(60):
                log.write(f"step {step} " + "x" * rng.randrange(100, 5000) + "\\n")
                log.flush()
                with open(".state.tmp", "w") as f:
                    json.dump({"step": step, "blob": "y" * 100000}, f)
                os.replace(".state.tmp", "state.json")
                if step == 20:
                    gate("go")
                time.sleep(0.05)
    """)
    log = home / "log.txt"
    wait_until(lambda: log.exists() and b"step 20 " in log.read_bytes(), 30, "the log's first steps at home")
    shadow.kill9()
    (work / "go").touch()
    wait_until(lambda: w.proc.poll() is not None or b"step 40 " in (work / "log.txt").read_bytes(), 30,
               "the job to go on")
    shadow.start()
    assert w.wait(90) == 0, w.err.decode()
    _same(home, work, "log.txt", "state.json")
    assert b"the spool cannot record" not in w.err  # (a log committed, appended to, committed again)


def test_the_spool_records_the_files_while_home_is_out_of_reach(tmp_path: Path, spool_dir: Path, work: Path) -> None:
    import socket
    import sqlite3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed: nothing listens there)
    w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir), "--job-id", "away", "--retry-timeout",
                 "0.2", "--retry-limit", "3", "--stdout", "away.out", "--file", "result.txt=r/result.txt", "--",
                 *python_job('open("result.txt", "w").write("done\\n")')])
    assert w.wait(60) == 122, w.err.decode()
    (spool,) = spool_dir.glob("*.spool")
    with sqlite3.connect(spool) as db:
        assert db.execute("SELECT handle, path, name FROM files").fetchall() == [(1, "result.txt", "r/result.txt")]
        assert db.execute("SELECT file, version, base FROM file_versions").fetchall() == [(1, 1, None)]


def test_a_file_written_by_a_job_that_ends_at_once(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                   work: Path) -> None:
    w = _run(shadow, spool_dir, "quick", ["quick.txt"], 'open("quick.txt", "w").write("at once\\n")')
    assert w.wait(60) == 0, w.err.decode()
    assert (home / "quick.txt").read_bytes() == b"at once\n"


@pytest.mark.timeout(180)
def test_a_network_cut_for_ten_seconds(shadow: ShadowProc, home: Path, spool_dir: Path, work: Path) -> None:
    """A relay black-holes every byte for 10 s (the heartbeat is 2 s: the connection is declared dead and
    attempted again meanwhile), then delivers what it held, stale attempts' bytes too."""
    from faults import Relay

    with Relay(("127.0.0.1", shadow.port)) as relay:
        w = Wrapper(["--shadow", f"127.0.0.1:{relay.port}", "--spool", str(spool_dir), "--job-id", "cut",
                     "--heartbeat", "2", "--retry-timeout", "1", "--stdout", "cut.out", "--file", "log.txt",
                     "--file", "state.json", "--", *python_job("""
            rng = random.Random(3)
            step = 0
            with open("log.txt", "a") as log:
                while not os.path.exists("stop") or step < 5:
                    log.write(f"step {step} " + "x" * rng.randrange(100, 3000) + "\\n")
                    log.flush()
                    with open(".state.tmp", "w") as f:
                        json.dump({"step": step, "blob": "y" * 200000}, f)
                    os.replace(".state.tmp", "state.json")
                    step += 1
                    time.sleep(0.05)
        """)])
        log = home / "log.txt"
        wait_until(lambda: log.exists() and b"step 3 " in log.read_bytes(), 30, "the log's first steps at home")
        relay.hole()
        time.sleep(10)
        relay.heal()
        (work / "stop").touch()
        assert w.wait(90) == 0, w.err.decode()
    _same(home, work, "log.txt", "state.json")
    assert int(_summary(home, "cut")["reconnects"]) >= 1  # (the cut was one)
