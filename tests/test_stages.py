"""The suite's stages (tests/stages.py) say what each test file needs.

A file named a unit file starts no process of ours and touches no kernel
fault; a loopback file needs no root, namespace, PostgreSQL, Slurm or browser.
A file in neither is a system file, so a new file is never under-counted.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import stages

TESTS = Path(__file__).parent
SPAWNS = re.compile(r"\bsubprocess\b|ShadowProc|Wrapper\b|gcshadow|\"gcwrap\"")
SYSTEM = re.compile(
    r"^from faults import|^import faults|pg_url|postgres|slurm|selenium|systemd|fusefs|sandbox|need_root|unshare|"
    r"setrlimit|iptables|failsync",
    re.MULTILINE,
)


def test_every_named_file_exists() -> None:
    for name in sorted(stages.UNIT | stages.LOOPBACK):
        assert (TESTS / name).is_file(), f"tests/stages.py names {name}, which is gone"
    assert not stages.UNIT & stages.LOOPBACK


@pytest.mark.parametrize("name", sorted(stages.UNIT - {Path(__file__).name}))  # (this file holds the patterns)
def test_a_unit_file_starts_no_process_and_makes_no_fault(name: str) -> None:
    text = (TESTS / name).read_text(encoding="utf-8")
    assert not SPAWNS.search(text), f"{name} starts processes: a loopback file, not a unit file"
    assert not SYSTEM.search(text), f"{name} needs the system: a system file"


@pytest.mark.parametrize("name", sorted(stages.LOOPBACK))
def test_a_loopback_file_needs_nothing_of_the_system(name: str) -> None:
    text = (TESTS / name).read_text(encoding="utf-8")
    assert not SYSTEM.search(text), f"{name} needs root, a namespace or a service: a system file"


def test_the_stages_run_in_order_unit_loopback_system() -> None:
    assert [stages.stage_of(TESTS / n) for n in ("test_protocol.py", "test_e2e.py", "test_chaos.py")] == list(
        stages.STAGE_ORDER
    )


def test_each_worker_has_a_network_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GCWRAP_TEST_NET", "40")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert stages.net_number() == 41
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert stages.net_number() == 40
    monkeypatch.setenv("GCWRAP_TEST_NET", "63")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    with pytest.raises(ValueError, match="0-63"):
        stages.net_number()
