"""The files a job writes (--file), seen everywhere stdout and stderr are:
`gcwrap status`, the I/O summary, `gcshadow jobs` (its table, JSON and a
job's timeline), `gcshadow tail JOB NAME`; and the notes of a file the job
deleted, or gcwrap cannot read.

The installed gcwrap and gcshadow, real processes, loopback TCP, except
where a test says otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import ShadowProc, Wrapper, python_job, tool, wait_until

pytestmark = pytest.mark.timeout(120)




def _run(address: str, spool_dir: Path, job_id: str, files: list[str], code: str, *extra: str) -> Wrapper:
    args = ["--shadow", address, "--spool", str(spool_dir), "--job-id", job_id, "--retry-timeout", "1",
            "--stdout", f"{job_id}.out", *extra]
    for f in files:
        args += ["--file", f]
    return Wrapper([*args, "--", *python_job(code)])


def _gcshadow(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*tool("gcshadow"), *args], capture_output=True, timeout=60, check=check)


def _job_json(home: Path, job_id: str) -> dict[str, Any]:
    return dict(json.loads(_gcshadow("jobs", "--json", "--root", str(home), job_id).stdout))


def _status(spool_dir: Path) -> list[dict[str, Any]]:
    out = subprocess.run([*tool("gcwrap"), "status", "--spool", str(spool_dir), "--json"], capture_output=True,
                         check=True, timeout=60)
    return list(json.loads(out.stdout))


# -- gcwrap status ------------------------------------------------------------------------------


def test_status_lists_each_file_with_its_version_figures_and_state(shadow: ShadowProc, spool_dir: Path,
                                                                   work: Path) -> None:
    w = _run(shadow.address, spool_dir, "st-files", ["log.txt", "scratch.txt=kept/scratch.txt"], """
        with open("scratch.txt", "w") as f:
            f.write("scratch\\n" * 500)
        with open("log.txt", "a") as log:
            log.write("line\\n" * 1000)
            log.flush()
            gate("go")
            os.unlink("scratch.txt")
            gate("end")
    """)

    def files() -> dict[str, dict[str, Any]]:
        spools = _status(spool_dir)  # (none until gcwrap made it)
        return {f["name"]: f for sp in spools for f in sp.get("files", [])}

    wait_until(lambda: files().get("log.txt", {}).get("state") == "committed"
               and files().get("kept/scratch.txt", {}).get("state") == "committed", 30, "both files committed")
    log = files()["log.txt"]
    assert log["path"] == "log.txt" and log["version"] == 1
    assert log["size"] == log["sent"] == log["acked"] == log["committed"] == 5000
    (work / "go").touch()
    wait_until(lambda: files()["kept/scratch.txt"]["state"] == "gone", 30, "the deleted file said gone")
    assert files()["kept/scratch.txt"]["committed"] == 4000  # (home keeps what it had)
    human = subprocess.run([*tool("gcwrap"), "status", "--spool", str(spool_dir)], capture_output=True, text=True,
                           check=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "kept/scratch.txt" in human and "gone" in human and "log.txt" in human, human
    narrow = subprocess.run([*tool("gcwrap"), "status", "--spool", str(spool_dir)], capture_output=True, text=True,
                            check=True, timeout=60, env={**os.environ, "COLUMNS": "50"}).stdout
    assert "file kept/scratch.txt" in narrow and "gone" in narrow, narrow
    (work / "end").touch()
    assert w.wait(60) == 0, w.err.decode()


def test_status_of_a_spool_left_behind_tells_its_files_from_the_spool(tmp_path: Path, spool_dir: Path,
                                                                      work: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed: nothing listens there)
    w = _run(f"127.0.0.1:{port}", spool_dir, "st-away", ["result.txt=r/result.txt"],
             'open("result.txt", "w").write("done\\n")', "--retry-limit", "2", "--retry-timeout", "0.2")
    assert w.wait(60) == 122, w.err.decode()
    (sp,) = _status(spool_dir)
    (f,) = sp["files"]
    assert (f["path"], f["name"], f["version"], f["acked"], f["committed"], f["state"]) == (
        "result.txt", "r/result.txt", 1, 0, -1, "live")


# -- the I/O summary ------------------------------------------------------------------------------


def test_the_io_summary_lists_the_files_beside_the_streams(shadow: ShadowProc, spool_dir: Path, work: Path) -> None:
    w = _run(shadow.address, spool_dir, "sum-files", ["a.txt", "b.json=state/b.json", "gone.txt"], """
        open("a.txt", "w").write("a" * 3000)
        for step in range(3):
            with open(".b.tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(".b.tmp", "b.json")
            time.sleep(1.3)
        open("gone.txt", "w").write("x" * 100)
        time.sleep(1.5)
        os.unlink("gone.txt")
        time.sleep(1.5)
    """)
    assert w.wait(60) == 0, w.err.decode()
    err = w.err.decode()
    (line,) = [x for x in err.splitlines() if x.startswith("gcwrap:   files: ")]
    assert "a.txt 2.9 KiB" in line, line
    assert "b.json as state/b.json" in line and "(version " in line, line
    assert "gone.txt 100 B (deleted by the job: home keeps what it had)" in line, line

    j = _run(shadow.address, spool_dir, "sum-json", ["a.txt"], 'open("a.txt", "w").write("b" * 10)',
             "--log-format", "json")
    assert j.wait(60) == 0, j.err.decode()
    (record,) = [r for r in map(json.loads, j.err.decode().splitlines()) if r["message"] == "I/O summary"]
    assert [(f["path"], f["size"], f["state"]) for f in record["files"]] == [("a.txt", 10, "committed")]

    # A job with files and no stream named gets its summary too.
    only = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "files-only", "--file",
                    "c.txt", "--", *python_job('open("c.txt", "w").write("c" * 20)')])
    assert only.wait(60) == 0, only.err.decode()
    assert "gcwrap:   files: c.txt 20 B" in only.err.decode(), only.err.decode()


# -- gcshadow jobs, its JSON and a job's timeline ----------------------------------------------------


def test_jobs_lists_the_files_and_the_timeline_says_what_became_of_them(shadow: ShadowProc, home: Path,
                                                                         spool_dir: Path, work: Path) -> None:
    w = _run(shadow.address, spool_dir, "jobs-files", ["log.txt", "status.json=s/status.json", "tmp.txt"], """
        open("tmp.txt", "w").write("temporary\\n")
        with open("log.txt", "a") as log:
            for step in range(3):
                log.write(f"step {step}\\n")
                log.flush()
                with open(".st.tmp", "w") as f:
                    json.dump({"step": step}, f)
                os.replace(".st.tmp", "status.json")
                time.sleep(1.3)
        os.unlink("tmp.txt")
        time.sleep(1.5)
    """)
    assert w.wait(60) == 0, w.err.decode()
    job = _job_json(home, "jobs-files")
    files = {f["name"]: f for f in job["files"]}
    assert set(files) == {"log.txt", "s/status.json", "tmp.txt"}
    st = files["s/status.json"]
    assert st["state"] == "committed" and st["version"] >= 2 and st["bytes"] == st["committed"] == (
        work / "status.json").stat().st_size
    assert files["log.txt"]["bytes"] == (work / "log.txt").stat().st_size
    assert files["tmp.txt"]["bytes"] == len("temporary\n")
    kinds = [(e["source"], e["kind"], e["details"].get("name")) for e in job["events"]]
    assert ("agent", "file_gone", "tmp.txt") in kinds, kinds
    committed = [e["details"] for e in job["events"] if e["kind"] == "file_committed"]
    assert {d["name"] for d in committed} == set(files), committed
    # The final version of each file is in the timeline, whatever commits were left out between.
    assert max(d["version"] for d in committed if d["name"] == "s/status.json") == st["version"]

    listing = subprocess.run([*tool("gcshadow"), "jobs", "--root", str(home)], capture_output=True, text=True,
                             timeout=60, check=True, env={**os.environ, "COLUMNS": "250"}).stdout
    assert "file s/status.json" in listing and "file tmp.txt" in listing, listing
    detail = subprocess.run([*tool("gcshadow"), "jobs", "--root", str(home), "jobs-files"], capture_output=True,
                            text=True, timeout=60, check=True, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "s/status.json" in detail and f"version {st['version']}" in detail, detail
    assert "file_gone" in detail and "home keeps what it had" in detail, detail
    tsv = _gcshadow("jobs", "--root", str(home), "-o", "job,streams", "--no-header").stdout.decode()
    assert f"file s/status.json {st['bytes']} v{st['version']}" in tsv, tsv


def test_a_refused_file_name_is_in_the_jobs_timeline(shadow: ShadowProc, home: Path, spool_dir: Path,
                                                     work: Path) -> None:
    # (a NAME another job, still running, writes: gcwrap cannot know it, home refuses it)
    owner = _run(shadow.address, spool_dir, "owner", [], 'print("mine", flush=True); gate("end")',
                 "--stderr", "taken.txt")
    wait_until(lambda: (home / "owner.out").exists() and (home / "owner.out").read_bytes() == b"mine\n", 30,
               "the owner job to hold its NAMEs")
    w = _run(shadow.address, spool_dir, "bad-name", ["x.txt=taken.txt"], 'open("x.txt", "w").write("x")')
    assert w.wait(60) != 0
    Path("end").touch()
    assert owner.wait(60) == 0
    job = _job_json(home, "bad-name")
    refused = [e for e in job["events"] if e["kind"] == "file_refused"]
    assert refused and refused[0]["source"] == "shadow", job["events"]
    assert refused[0]["details"]["name"] == "taken.txt" and refused[0]["details"]["code"] == "PATH_OWNED"


# -- gcshadow tail JOB NAME -------------------------------------------------------------------------


def test_tail_prints_a_file_by_its_name_and_follows_new_versions_as_tail_F(shadow: ShadowProc, home: Path,
                                                                          spool_dir: Path, work: Path,
                                                                          tmp_path: Path) -> None:
    w = _run(shadow.address, spool_dir, "tail-files", ["status.txt=s/status.txt", "log.txt"], """
        with open("log.txt", "w") as log:
            log.write("first line\\n")
        for step in (1, 2, 3):
            with open(".st.tmp", "w") as f:
                f.write(f"version {step}\\n" * step)
            os.replace(".st.tmp", "status.txt")
            if step < 3:
                gate(f"go{step}")
    """)
    status = home / "s/status.txt"
    wait_until(lambda: status.exists() and status.read_bytes() == b"version 1\n", 30, "the first version at home")
    assert _gcshadow("tail", "--root", str(home), "tail-files", "log.txt").stdout == b"first line\n"
    out, err = tmp_path / "tail.out", tmp_path / "tail.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        tail = subprocess.Popen([*tool("gcshadow"), "tail", "-f", "--root", str(home), "tail-files", "s/status.txt"],
                                stdout=o, stderr=e)
    try:
        for step in (1, 2):
            expected = b"".join(f"version {n}\n".encode() * n for n in range(1, step + 1))
            wait_until(lambda expected=expected: out.read_bytes() == expected, 30, f"version {step} followed")
            (work / f"go{step}").touch()
        assert tail.wait(60) == 0, err.read_text()
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait()
    assert w.wait(60) == 0, w.err.decode()
    assert out.read_bytes() == b"version 1\n" + b"version 2\n" * 2 + b"version 3\n" * 3
    notices = err.read_text().splitlines()
    said = "gcshadow: s/status.txt of job tail-files was replaced by a new version: following it from its start"
    assert notices == [said] * 2, notices
    missing = _gcshadow("tail", "--root", str(home), "tail-files", "nothing.txt", check=False)
    assert missing.returncode == 1 and b"no job 'tail-files' with a stream or file named 'nothing.txt'" in \
        missing.stderr, missing.stderr


# -- either state -----------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def state(request: pytest.FixtureRequest) -> list[str]:
    """The --state a shadow and its readers use: the root's own, or a PostgreSQL database."""
    return ["--state", request.getfixturevalue("pg_url")] if request.param == "postgresql" else []


def test_jobs_and_tail_list_the_files_from_either_state(state: list[str], home: Path, tmp_path: Path,
                                                        spool_dir: Path, work: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=state)
    sh.start()
    try:
        w = _run(sh.address, spool_dir, "either-files", ["a.txt=out/a.txt"], """
            for step in range(2):
                open(".a.tmp", "w").write(f"step {step}\\n")
                os.replace(".a.tmp", "a.txt")
                time.sleep(1.3)
        """)
        assert w.wait(60) == 0, w.err.decode()
    finally:
        sh.stop()
    job = json.loads(_gcshadow("jobs", "--json", "--root", str(home), *state, "either-files").stdout)
    (f,) = job["files"]
    assert (f["name"], f["bytes"], f["committed"], f["state"]) == ("out/a.txt", 7, 7, "committed")
    assert f["version"] >= 2 and f["sha256"] == __import__("hashlib").sha256(b"step 1\n").hexdigest()
    tail = _gcshadow("tail", "--root", str(home), *state, "either-files", "out/a.txt")
    assert tail.stdout == b"step 1\n"


# -- without a process: what the listings derive, what the sender notes ---------------------------


def test_a_files_view_from_the_versions_home_holds() -> None:
    from gcwrap.shadow.fileversions import VersionRow, file_view

    appended = VersionRow(1, "log", 1, None, 120, 100, "aa")  # committed at 100, 20 bytes appended since
    assert file_view([appended], finished=False) | {"sha256": None} == {
        "file": 1, "name": "log", "version": 1, "bytes": 120, "committed": 100, "sha256": None, "next": None,
        "state": "live"}
    assert file_view([appended], finished=True)["state"] == "partial"
    whole = VersionRow(2, "s.json", 3, 2, 50, 50, "bb")
    staged = VersionRow(2, "s.json", 4, 3, 10, -1, None)
    view = file_view([whole, staged], finished=False)
    assert (view["version"], view["bytes"], view["committed"], view["next"], view["state"]) == (
        3, 50, 50, {"version": 4, "bytes": 10}, "live")  # (NAME is version 3 until version 4's commit)
    view = file_view([whole, staged], finished=True)  # (the staged one was abandoned at the job's end)
    assert (view["version"], view["next"], view["state"]) == (3, None, "committed")
    first = VersionRow(3, "new", 1, None, 10, -1, None)
    assert file_view([first], finished=False)["state"] == "live"
    assert file_view([first], finished=True)["state"] == "partial"


async def test_the_sender_notes_a_file_gone_or_unreadable_once_until_it_is_back(tmp_path: Path) -> None:
    from gcwrap.agent.filesender import FileSender
    from gcwrap.agent.filespecs import FileSpec, stat_file
    from gcwrap.agent.filewatch import Change, FileEvent
    from gcwrap.sync import Signal

    notes: list[tuple[str, dict[str, object]]] = []
    sender = FileSender(tmp_path, (FileSpec("a.txt", None), FileSpec("d", None)), Signal(),
                        note=lambda at, kind, **details: notes.append((kind, details)))
    (tmp_path / "a.txt").write_bytes(b"x" * 10)
    spec_a, spec_d = sender.watcher.specs
    seen = stat_file(tmp_path / "a.txt")
    await sender.take(FileEvent("a.txt", spec_a, Change.APPEARED, seen))
    (tmp_path / "a.txt").unlink()
    await sender.take(FileEvent("a.txt", spec_a, Change.DELETED, None))
    await sender.take(FileEvent("a.txt", spec_a, Change.DELETED, None))
    assert notes == [("file_gone", {"name": "a.txt", "path": "a.txt", "version": 1, "size": 10})]
    assert [(f["path"], f["state"]) for f in sender.listing()] == [("a.txt", "gone")]
    # A path the kernel will not read as a file (a directory: EISDIR at the first read), said once.
    (tmp_path / "d").mkdir()
    st = os.stat(tmp_path / "d")
    from gcwrap.agent.filespecs import FileStat

    for _ in range(2):
        await sender.take(FileEvent("d", spec_d, Change.APPEARED, FileStat.of(st)))
    assert notes[1:] == [("file_unreadable", {"name": "d", "path": "d", "error": "Is a directory"})]
    assert sender.listing()[1]["state"] == "unreadable" and [r[6] for r in sender.live()] == ["gone", "unreadable"]
    (tmp_path / "a.txt").write_bytes(b"back")
    await sender.take(FileEvent("a.txt", spec_a, Change.APPEARED, stat_file(tmp_path / "a.txt")))
    assert sender.listing()[0]["state"] == "live" and len(notes) == 2
    sender.close()


def test_the_listings_show_files_whole_at_any_width() -> None:
    import io

    from rich.console import Console

    from gcwrap.render import job_detail, jobs_view, status_view

    def shown(view: Any, width: int) -> str:
        out = io.StringIO()
        Console(file=out, width=width, force_terminal=False).print(view, crop=False)
        return out.getvalue()

    f = {"file": 1, "name": "results/a-long-directory/table.csv", "bytes": 5000, "version": 3, "committed": 4000,
         "sha256": "ab" * 32, "next": {"version": 4, "bytes": 10}, "state": "live"}
    job = {"job_id": "j1", "host": "h", "state": "streaming", "last_seen": None, "first_seen": None, "streams": [],
           "files": [f], "command": [], "summary": {}, "user": "", "peer": "", "instance": "i", "exit_code": None,
           "exit_signal": None}
    for width in (200, 60, 30):
        text = shown(jobs_view([job], width=width), width)
        assert "results/a-long-directory/table.csv" in text, text
    detail = shown(job_detail(job, width=200), 200)
    said = ("in results/a-long-directory/table.csv, version 3, committed at 4,000 bytes (SHA-256 abababababab...); "
            "version 4 arriving: 10 B; live")
    assert said in detail, detail
    assert "results/a-long-directory/table.csv," in shown(job_detail(job, width=60), 60)  # (whole, on a line)
    spool = {"job_id": "j1", "state": "running", "spool": "/s", "streams": [], "files": [
        {"file": 1, "path": "t.csv", "name": "results/a-long-directory/table.csv", "version": 2, "size": 5000,
         "sent": 5000, "acked": 4000, "committed": -1, "state": "unreadable"}]}
    for width in (200, 40):
        text = shown(status_view([spool], width), width)
        assert "results/a-long-directory/table.csv" in text and "unreadable" in text, text


def test_a_file_gcwrap_cannot_read_is_noted_home_and_in_the_summary(shadow: ShadowProc, home: Path,
                                                                    spool_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's working directory on a file system whose reads fail (FUSE, answering EIO): gcwrap
    cannot read the job's file, says so home once, and the job ends as it would have."""
    import fusefs

    if why := fusefs.available():
        pytest.skip(why)
    mount = tmp_path / "mnt"
    mount.mkdir()
    with fusefs.SlowFS(mount, {"data.bin": b"x" * 5000}, fail_reads=True):
        monkeypatch.chdir(mount)
        w = _run(shadow.address, spool_dir, "eio-file", ["data.bin"], "time.sleep(2)")
        assert w.wait(60) == 0, w.err.decode()
        monkeypatch.chdir(tmp_path)
    err = w.err.decode()
    assert "cannot read the job's file data.bin (Input/output error)" in err, err
    assert "files: data.bin 0 B (gcwrap cannot read it: home keeps what it had)" in err, err
    job = _job_json(home, "eio-file")
    noted = [e for e in job["events"] if e["kind"] == "file_unreadable"]
    assert len(noted) == 1 and noted[0]["source"] == "agent", job["events"]
    assert noted[0]["details"] == {"name": "data.bin", "path": "data.bin", "error": "Input/output error"}
    assert job["files"] == [] and not (home / "data.bin").exists()  # (home never had any of it)
