"""`gcshadow --log-format json`: every line of a real shadow's stderr is a
JSON object (time, level, message), with the fields a collector filters on
(peer, identity, job, stream, code) where the shadow knows them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import ShadowProc, Wrapper

pytestmark = pytest.mark.timeout(60)


def _token(path: Path) -> Path:
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


def _lines(shadow: ShadowProc) -> list[dict[str, Any]]:
    """Every line the shadow wrote, each parsed as JSON (a line that is not one fails the test)."""
    found = []
    for line in shadow.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(record, dict), line
        assert {"time", "level", "message"} <= record.keys(), record
        found.append(record)
    return found


def test_json_log_lines_name_the_peer_identity_job_and_code(tmp_path: Path) -> None:
    home, logs, tokens = tmp_path / "home", tmp_path / "logs", tmp_path / "tokens"
    home.mkdir()
    logs.mkdir()
    tokens.mkdir(mode=0o700)
    alice = _token(tokens / "alice")
    sh = ShadowProc(home, logs, extra=["--token-dir", str(tokens), "-v", "--log-format", "json"])
    sh.start()
    try:
        common = ["--shadow", sh.address, "--spool", str(tmp_path / "spool"), "--retry-timeout", "0.2",
                  "--retry-limit", "2"]
        good = Wrapper([*common, "--job-id", "j-good", "--token-file", str(alice), "--stdout", "good.out", "--",
                        "echo", "hello"])
        assert good.wait(30) == 0, good.err
        wrong = Wrapper([*common, "--job-id", "j-wrong", "--token-file", str(_token(tmp_path / "other")),
                         "--stdout", "wrong.out", "--", "echo", "no"])
        assert wrong.wait(30) != 0
    finally:
        sh.stop()
    lines = _lines(sh)
    session = [r for r in lines if r.get("job") == "j-good" and "session 1" in r["message"]]
    assert session, lines
    assert session[0]["identity"] == "alice" and session[0]["peer"].startswith("127.0.0.1:"), session
    assert session[0]["level"] == "info" and isinstance(session[0]["time"], float)
    finished = [r for r in lines if r.get("job") == "j-good" and "finished" in r["message"]]
    assert finished and finished[0]["identity"] == "alice", lines
    refused = [r for r in lines if r.get("job") == "j-wrong"]
    assert refused and refused[0]["code"] == "AUTH_FAILED" and refused[0]["level"] == "warning", lines
    assert refused[0]["peer"].startswith("127.0.0.1:") and "wrong token" in refused[0]["message"], refused
    assert "code" not in session[0], "a field the record does not have is left out"


def test_gcshadow_log_format_from_the_environment(tmp_path: Path) -> None:
    home, logs = tmp_path / "home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["-v"], env={**os.environ, "GCSHADOW_LOG_FORMAT": "json"})
    sh.start()
    sh.stop()
    lines = _lines(sh)
    assert any("serving" in r["message"] for r in lines), lines
