"""contrib/systemd: the units for gcshadow and its daily prune pass
`systemd-analyze verify` without a warning, and keep their hardening."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import tool

pytestmark = pytest.mark.timeout(120)

UNITS = Path(__file__).parent.parent / "contrib" / "systemd"
NAMES = ("gcshadow.service", "gcshadow-prune.service", "gcshadow-prune.timer")


def _settings(name: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify wants the executable to exist: the installed gcshadow stands in for /usr/local/bin's.
    gcshadow = tool("gcshadow")[0]
    for name in NAMES:
        text = (UNITS / name).read_text()
        (tmp_path / name).write_text(text.replace("/usr/local/bin/gcshadow", gcshadow))
    out = subprocess.run([analyze, "verify", "--man=no", *NAMES], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    ours = [line for line in out.stderr.splitlines() if any(n in line for n in NAMES)]
    assert out.returncode == 0 and not ours, out.stderr


def test_units_are_hardened_and_stop_as_the_shadow_does() -> None:
    for name in NAMES[:2]:
        s = _settings(name)
        assert s["User"] == ["gcshadow"] and s["ProtectSystem"] == ["strict"], name
        assert s["NoNewPrivileges"] == ["yes"] and s["PrivateTmp"] == ["yes"] and s["ProtectHome"] == ["yes"], name
        assert s["ReadWritePaths"] == ["/var/lib/gcshadow"] and s["StateDirectory"] == ["gcshadow"], name
        assert s["EnvironmentFile"] == ["-/etc/gcshadow/gcshadow.env"], name
        assert "GCSHADOW_ROOT=/var/lib/gcshadow" in s["Environment"][0], name
        assert "StandardError" not in s, "stderr goes to the journal (the default)"
    s = _settings("gcshadow.service")
    assert s["KillSignal"] == ["SIGTERM"] and s["Restart"] == ["on-failure"]
    from gcwrap.shadow.server import STOP_GRACE

    stop = re.fullmatch(r"(\d+)s", s["TimeoutStopSec"][0])
    # SIGKILL only well after the shadow's own orderly stop (every session's output made durable).
    assert stop is not None and int(stop[1]) >= 2 * STOP_GRACE, s["TimeoutStopSec"]
    assert s["ExecStart"] == ["/usr/local/bin/gcshadow serve $GCSHADOW_ARGS"]
    prune = _settings("gcshadow-prune.service")
    assert prune["ExecStart"][0].startswith("/usr/local/bin/gcshadow prune --finished-before ")
    assert _settings("gcshadow-prune.timer")["Persistent"] == ["true"]
