"""The job starts before the rest of gcwrap loads (gcwrap.agent.launch).

The spool and the job's pipes are made, and the job started, before the
event loop (trio), the sender or TLS are imported: the job's own start-up
runs alongside gcwrap's. These run gcwrap in a Python process with an audit
hook that looks at gcwrap from inside at the moment it starts the job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ShadowProc

# Runs gcwrap's command line (sys.argv[3:]) in this process; when it starts
# the job (the audit event of subprocess.Popen, before the fork), the hook
# writes what was loaded and whether the spool was there to sys.argv[1], and,
# if sys.argv[2] is "signal", sends gcwrap a SIGTERM at that very moment.
PROBE = r"""
import json, os, signal, sys
from pathlib import Path

report, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
spool_dir = Path(args[args.index("--spool") + 1])
job = args[args.index("--") + 1]

def hook(event, event_args):
    if event == "subprocess.Popen" and event_args[0] == job and not Path(report).exists():
        Path(report).write_text(json.dumps({
            "loaded": sorted(m for m in ("trio", "ssl", "gcwrap.agent.sender", "gcwrap.agent.agent")
                             if m in sys.modules),
            "spools": [p.name for p in spool_dir.glob("*.spool")],
        }))
        if mode == "signal":
            os.kill(os.getpid(), signal.SIGTERM)

sys.addaudithook(hook)
sys.argv = ["gcwrap", *args]
from gcwrap.cli import main
main()
"""


def probe(tmp_path: Path, mode: str, args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess[bytes],
                                                                              dict[str, list[str]]]:
    report = tmp_path / "at-start.json"
    res = subprocess.run([sys.executable, "-c", PROBE, str(report), mode, *args], capture_output=True,
                         timeout=timeout, cwd=tmp_path)
    assert report.exists(), res.stderr.decode()
    return res, json.loads(report.read_text())


@pytest.mark.timeout(60)
def test_the_job_starts_with_its_spool_ready_before_the_event_loop_is_loaded(
        shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    res, seen = probe(tmp_path, "plain", ["--shadow", shadow.address, "--stdout", "early.out", "--spool",
                                          str(spool_dir), "--job-id", "early", "--", "sh", "-c", "echo early"],
                      timeout=50)
    assert res.returncode == 0, res.stderr.decode()
    assert seen["loaded"] == [], seen  # neither trio, TLS nor the sender before the job starts
    assert len(seen["spools"]) == 1, seen  # its output can already be kept
    assert (home / "early.out").read_bytes() == b"early\n"


@pytest.mark.timeout(60)
def test_a_signal_that_comes_as_the_job_starts_is_forwarded_to_it(
        shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """SIGTERM before the event loop's signal receiver is open: kept, then
    forwarded to the job (which would otherwise sleep for 30 s) and obeyed."""
    started = time.monotonic()
    res, _ = probe(tmp_path, "signal", ["--shadow", shadow.address, "--stdout", "sig.out", "--spool",
                                         str(spool_dir), "--job-id", "sig", "--", "sleep", "30"], timeout=50)
    took = time.monotonic() - started
    assert took < 20, (took, res.stderr.decode())
    assert res.returncode == 128 + 15, res.stderr.decode()  # the job's status: ended by SIGTERM
    assert (home / "sig.out").read_bytes() == b""


def test_a_new_spool_reaches_the_disk_in_one_sync_before_it_is_renamed_into_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft is built without a sync per transaction (about 30 disk
    flushes before the job could start), then synced once, whole, and only
    then renamed into place: what appears under the spool's name is on disk."""
    import os

    from gcwrap.agent import spool as spool_mod
    from gcwrap.agent.records import JobRecord
    from gcwrap.agent.spool import SPOOL_SUFFIX, Spool

    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(f"fsync {os.readlink(f'/proc/self/fd/{fd}')}")
        real_fsync(fd)

    def rename(src: str | Path, dst: str | Path) -> None:
        events.append(f"rename {src} {dst}")
        real_rename(src, dst)

    monkeypatch.setattr(spool_mod.os, "fsync", fsync)
    monkeypatch.setattr(spool_mod.os, "rename", rename)
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    draft = f"{path}.new"
    Spool.create(path, JobRecord("j", "1", ["true"]), [(1, "stdout", "out")]).close()
    assert events == [f"fsync {draft}", f"rename {draft} {path}"], events
    check = Spool.open(path, readonly=True)
    try:
        assert check.job().job_id == "j" and list(check.streams()) == [1]
    finally:
        check.close()
