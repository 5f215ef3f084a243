from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import stages
from faults import kill_ns_shadows
from helpers import ShadowProc, Wrapper
from pgserver import pg_url, postgres, postgres_url  # noqa: F401 - fixtures
from rawagent import close_all
from statefaults import failsync  # noqa: F401 - a fixture


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run long soaks and many-seed chaos runs")
    parser.addoption("--seeds", type=int, default=None, help="number of seeds for randomized chaos runs")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(stages, "gcwrap-stages")
    # (for what test modules size at import: a randomized search's examples)
    if config.getoption("--run-slow"):
        os.environ["GCWRAP_TEST_SLOW"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long run: use --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_leftover_wrappers() -> Iterator[None]:
    yield
    Wrapper.kill_leftovers()
    kill_ns_shadows()
    close_all()  # (the sockets of scripted agents: rawagent.py)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    root = tmp_path / "home"
    root.mkdir()
    return root


@pytest.fixture
def shadow(home: Path, tmp_path: Path) -> Iterator[ShadowProc]:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    sh = ShadowProc(home, logs)
    sh.start()
    try:
        yield sh
    finally:
        sh.stop()


@pytest.fixture
def shadow_down(home: Path, tmp_path: Path) -> Iterator[ShadowProc]:
    """A shadow that is down: it listened once, so its port is known (`port`,
    `address`), and nothing listens there until the test starts it again
    (`start()`: the same port). Stopped when the test ends."""
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    sh = ShadowProc(home, logs)
    sh.start()
    sh.stop()
    try:
        yield sh
    finally:
        sh.stop()


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def shadows() -> Iterator[list[ShadowProc]]:
    """Shadows a test starts itself (each its own root, options...): each stopped when it ends."""
    started: list[ShadowProc] = []
    yield started
    for sh in started:
        sh.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # What this process's chaos runs counted, for the summary (a worker's goes to the controller).
    import sys

    chaos = sys.modules.get("test_chaos")
    if chaos is not None:
        stages.publish("chaos", chaos.CHAOS_TOTALS)
        stages.publish("chaos kinds", chaos.CHAOS_KINDS)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    totals = stages.WORKER_TOTALS.get("chaos", Counter())
    if totals["seeds"]:
        terminalreporter.write_line(
            "chaos schedule: {seeds} seeds, {bytes} bytes moved, {faults} faults injected, "
            "{lost} bytes lost, {duplicated} bytes duplicated, {corrupt} bytes corrupt, {hung} hung, "
            "{refused} refused for good".format_map(totals)
        )
        kinds = stages.WORKER_TOTALS.get("chaos kinds")
        if kinds:
            by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
            terminalreporter.write_line("chaos faults by kind: " + by_kind)


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The job's working directory (gcwrap's: its --file PATHs are relative to it)."""
    d = tmp_path / "work"
    d.mkdir()
    monkeypatch.chdir(d)
    return d
