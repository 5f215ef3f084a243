"""What a run loads: a plain `gcwrap -- true` and a run with a shadow load
only what they need, before the job starts and up to the exit.

Every module is paid for at every start (benchmarks/startup.py measures
it); these pin the heavy ones out, so that an import added at the top of a
module cannot bring their cost back unnoticed. gcwrap runs in a Python
process of its own, with an audit hook that lists sys.modules when gcwrap
starts the job (the audit event of subprocess.Popen) and again at exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import ShadowProc

# Runs gcwrap's command line (sys.argv[2:]) in this process and writes the
# modules loaded at the job's start and at exit, and whether the cyclic
# garbage collector ran then (it is off while gcwrap loads), to sys.argv[1].
PROBE = r"""
import atexit, gc, json, sys

report, args = sys.argv[1], sys.argv[2:]
job = args[args.index("--") + 1] if "--" in args else None
seen = {}

def hook(event, event_args):
    if event == "subprocess.Popen" and event_args[0] == job and "start" not in seen:
        seen["start"] = sorted(sys.modules)
        seen["collector at start"] = gc.isenabled()

def at_exit():
    with open(report, "w") as f:
        json.dump({**seen, "exit": sorted(sys.modules), "collector at exit": gc.isenabled()}, f)

sys.addaudithook(hook)
atexit.register(at_exit)
sys.argv = ["gcwrap", *args]
from gcwrap.entry import gcwrap
gcwrap()
"""

# Never loaded by a run that has no use for them.
NEVER = ("rich", "sqlite_utils", "zstandard", "gcwrap.shadow", "gcwrap.status", "gcwrap.bundle",
         # --file: its sender, block digests (hashlib), watcher, and a resume's restore
         "gcwrap.agent.filesender", "gcwrap.agent.filedelta", "gcwrap.agent.filewatch", "gcwrap.agent.fileresume")
# Not before the job starts: the event loop, TLS, the delivery side.
NOT_AT_START = (*NEVER, "trio", "ssl", "hashlib", "gcwrap.agent.run", "gcwrap.agent.agent", "gcwrap.agent.sender",
                "gcwrap.sync", "gcwrap.render", "gcwrap.wire.frames", "gcwrap.wire.protocol", "gcwrap.wire.auth",
                "gcwrap.wire.events")  # (events: two dozen dataclasses, 15 ms to make: wire.streams names the streams)
# Not at all in a pass-through (nothing to deliver): no session, no authentication.
PASS_THROUGH_NEVER = (*NEVER, "gcwrap.agent.sender", "gcwrap.wire.protocol", "gcwrap.wire.auth",
                      "gcwrap.agent.liveness")


def loaded(tmp_path: Path, args: list[str]) -> dict[str, Any]:
    report = tmp_path / "modules.json"
    res = subprocess.run([sys.executable, "-c", PROBE, str(report), *args], capture_output=True, timeout=50,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr.decode()
    seen: dict[str, Any] = json.loads(report.read_text())
    return seen


def heavy(modules: list[str], names: tuple[str, ...]) -> list[str]:
    """The `names` found among `modules`, a package by any of its modules."""
    return sorted({n for n in names for m in modules if m == n or m.startswith(n + ".")})


@pytest.mark.timeout(60)
def test_a_plain_run_loads_nothing_heavy_before_the_job_starts_nor_anything_it_does_not_use(tmp_path: Path) -> None:
    seen = loaded(tmp_path, ["--", "true"])
    assert heavy(seen["start"], NOT_AT_START) == []
    assert heavy(seen["exit"], PASS_THROUGH_NEVER) == []
    assert "trio" in seen["exit"]  # (the probe saw the run itself: the event loop ran)
    assert seen["collector at start"] is False  # (nothing of gcwrap's loading is walked by it)
    assert seen["collector at exit"] is True  # (but the run itself has it)
    # ...and every other command from its start (`status --watch`, `resume` run long).
    assert loaded(tmp_path, ["status", "--spool", str(tmp_path / "spools")])["collector at exit"] is True


@pytest.mark.timeout(60)
def test_a_run_with_a_shadow_loads_no_compression_tls_or_file_machinery_it_does_not_use(
        shadow: ShadowProc, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    seen = loaded(tmp_path, ["--shadow", shadow.address, "--stdout", "small.out", "--spool", str(spool_dir),
                             "--job-id", "small", "--", "sh", "-c", "echo small"])
    assert (home / "small.out").read_bytes() == b"small\n"
    assert heavy(seen["start"], NOT_AT_START) == []
    assert heavy(seen["exit"], NEVER) == []  # (a few bytes: no codec is loaded for them)
    assert "gcwrap.agent.sender" in seen["exit"]

