"""The suite in stages: unit, loopback integration, system.

One `python -m pytest -q` runs them all (README.md's test command, which
.ci/run runs as written): the tests are ordered by stage, the stages of a
two-worker run overlap only at their edges, and the summary says what each
stage ran and how long it took, so a slow stage is seen, not guessed.

A test file belongs to the heaviest stage any of its tests needs:

- unit: in the test's own process: no gcwrap or gcshadow process, no
  subprocess at all (a loopback socket within the process is fine);
- loopback: real `gcwrap`/`gcshadow` processes and sockets on loopback;
- system: root and the kernel's faults (network namespaces, iptables, tmpfs
  mounts, descriptor limits, FUSE), or a real PostgreSQL, Slurm, Chromium or
  systemd.

Under pytest-xdist each worker gets a network of its own for the namespace
tests (GCWRAP_TEST_NET, see faults.py: the base, 0 unless set, plus the
worker's number), a test file runs whole on one worker (`--dist loadfile`:
a file's module fixtures start once), and what the workers counted (the chaos
schedule's totals) comes back to the controller's summary.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

STAGE_ORDER = ("unit", "loopback", "system")

UNIT = {
    "test_acks_order.py", "test_compress.py", "test_docs_links.py", "test_filedelta.py",
    "test_fileframes.py", "test_pacing.py", "test_units.py", "test_filecache_interleavings.py", "test_bulk_pacer.py",
    "test_filesender.py", "test_liveness.py", "test_outbox.py", "test_policy.py", "test_protocol.py",
    "test_shadow_input.py", "test_shadow_list.py", "test_spoolfiles.py", "test_stages.py", "test_worst_error.py",
}
LOOPBACK = {
    "test_acks.py", "test_admission_groups.py", "test_agent_timeline.py", "test_architecture.py", "test_benchmarks.py",
    "test_db.py", "test_startup.py",
    "test_docs.py", "test_e2e.py", "test_e2e_files_resume.py", "test_fencing.py", "test_filesender_commits.py",
    "test_launch.py", "test_line_reads.py", "test_root_gone.py", "test_security.py", "test_shadow_logs.py",
    "test_shadow_protocol.py", "test_shutdown.py", "test_signals.py", "test_write_behind.py", "test_zero_copy.py",
}
# Every other test file: system (the default, so a new file is never under-counted).


def stage_of(path: str | os.PathLike[str]) -> str:
    name = Path(path).name
    if name in UNIT:
        return "unit"
    if name in LOOPBACK:
        return "loopback"
    return "system"


def net_number() -> int:
    """This run's network number (0-63): GCWRAP_TEST_NET (0 unless set), plus
    the worker's number under xdist, so two workers never share a namespace,
    a veth pair or a PostgreSQL directory."""
    net = int(os.environ.get("GCWRAP_TEST_NET", "0"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        net += int(worker[2:])
    if not 0 <= net <= 63:
        raise ValueError(f"GCWRAP_TEST_NET plus the worker's number must be 0-63, not {net}")
    return net


@dataclass
class StageTally:
    tests: set[str] = field(default_factory=set)
    outcomes: Counter[str] = field(default_factory=Counter)
    first: float = float("inf")
    last: float = 0.0
    busy: float = 0.0  # the sum of the phases' durations (more than the wall time when workers overlap)


TALLIES: dict[str, StageTally] = {s: StageTally() for s in STAGE_ORDER}
# Totals a worker counted (name -> Counter), merged on the controller at each worker's end.
WORKER_TOTALS: dict[str, Counter[str]] = {}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # By stage; within one, the files with the most tests first (as xdist's own order would put them:
    # the long ones start early and the two workers end together); within a file, its own order.
    # (pyproject.toml's --no-loadscope-reorder keeps xdist to this order.)
    per_file = Counter(item.path for item in items)
    items.sort(key=lambda item: (STAGE_ORDER.index(stage_of(item.path)), -per_file[item.path], str(item.path)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tally = TALLIES[stage_of(report.nodeid.split("::")[0])]
    tally.tests.add(report.nodeid)
    tally.first = min(tally.first, report.start)
    tally.last = max(tally.last, report.stop)
    tally.busy += report.duration
    if report.when == "call" or report.outcome != "passed":
        # (a setup that skips or fails is the test's outcome; a teardown that fails is one more)
        tally.outcomes["error" if report.when != "call" and report.failed else report.outcome] += 1


def publish(name: str, totals: Counter[str] | dict[str, int]) -> None:
    """A worker's totals, for the controller's summary (on a plain run: kept here)."""
    WORKER_TOTALS.setdefault(name, Counter()).update(totals)


def pytest_sessionfinish(session: pytest.Session) -> None:
    output: dict[str, Any] | None = getattr(session.config, "workeroutput", None)
    if output is not None:  # an xdist worker: send its totals home
        output["gcwrap_totals"] = {name: dict(c) for name, c in WORKER_TOTALS.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    for name, totals in getattr(node, "workeroutput", {}).get("gcwrap_totals", {}).items():
        WORKER_TOTALS.setdefault(name, Counter()).update(totals)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not any(t.tests for t in TALLIES.values()):
        return
    terminalreporter.section("stages")
    for name in STAGE_ORDER:
        t = TALLIES[name]
        if not t.tests:
            continue
        outcomes = ", ".join(f"{n} {what}" for what, n in sorted(t.outcomes.items()))
        terminalreporter.write_line(
            f"{name:<9} {len(t.tests):5d} tests ({outcomes}): {t.last - t.first:7.1f} s from its first test's "
            f"start to its last's end, {t.busy:7.1f} s in tests"
        )
