"""Descriptor limits: gcwrap and gcshadow under every small `ulimit -n`.

At any limit either command does its work, or it says in one line that it
is out of file descriptors and exits with its documented status (gcwrap:
126, the job never started; gcshadow: 1, it never listened). No traceback
at any limit (before: gcwrap at 5 to 8, `OSError: [Errno 24]` from the
event loop's set-up, exit 1; gcshadow at 10 to 13, `sqlite3.OperationalError`
from its state, and at 16 to 64 a shadow that listened but could serve no
job).

Below some limit the Python interpreter itself cannot start (the dynamic
loader cannot open libpython, or `site` cannot import what a .pth file
names): nothing of gcwrap runs there, so those limits are skipped, saying so.
"""

from __future__ import annotations

import resource
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ShadowProc, drop_cap_sys_resource, tool, wait_until

LIMITS = list(range(3, 33))


def limited(n: int, may_raise: bool = True) -> Callable[[], None]:
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
        if not may_raise:  # (as root, gcshadow would raise its hard limit: as a user, it may not)
            drop_cap_sys_resource()

    return set_limit


def interpreter(name: str) -> str:
    """The Python interpreter the installed console script runs with."""
    first = Path(tool(name)[0]).read_bytes().split(b"\n", 1)[0]
    assert first.startswith(b"#!"), first
    return first[2:].decode().split()[0]


def skip_unless_python_starts(limit: int) -> None:
    proc = subprocess.run([interpreter("gcwrap"), "-c", "pass"], capture_output=True, timeout=30,
                          preexec_fn=limited(limit))
    if proc.returncode != 0:
        said = proc.stderr.decode(errors="replace").strip().splitlines()
        pytest.skip(f"at ulimit -n {limit} the Python interpreter itself cannot start: {said[-1] if said else ''}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("streams", ["stdout", "pass-through"])
@pytest.mark.parametrize("limit", LIMITS)
def test_gcwrap_at_any_descriptor_limit(shadow: ShadowProc, home: Path, spool_dir: Path, limit: int,
                                        streams: str) -> None:
    """The job runs and its output lands, or it never starts and gcwrap
    says so in one line naming descriptors, exit 126, no spool left."""
    skip_unless_python_starts(limit)
    named = ["--stdout", f"fd{limit}.out"] if streams == "stdout" else []
    proc = subprocess.run([*tool("gcwrap"), "--shadow", shadow.address, "--spool", str(spool_dir), "--job-id",
                           f"fd{limit}", "--retry-limit", "2", "--retry-timeout", "0.2", *named, "--", "echo", "ran"],
                          capture_output=True, timeout=50, preexec_fn=limited(limit))
    text = proc.stderr.decode(errors="replace")
    assert "Traceback" not in text, text
    if proc.returncode == 0:
        assert "descriptor" not in text, text
        if streams == "stdout":
            assert (home / f"fd{limit}.out").read_bytes() == b"ran\n"
        else:
            assert proc.stdout == b"ran\n"
        return
    assert proc.returncode == 126, text
    assert text.splitlines() == ["gcwrap: cannot run echo: out of file descriptors (raise `ulimit -n`)"], text
    assert proc.stdout == b"" and not (home / f"fd{limit}.out").exists()
    left = list(spool_dir.iterdir()) if spool_dir.exists() else []
    assert left == [], "nothing is left in the spool directory for a job that never ran"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limit", [*LIMITS, 64, 96])
def test_gcshadow_at_any_descriptor_limit(home: Path, tmp_path: Path, spool_dir: Path, limit: int) -> None:
    """The shadow serves, and a job's output (two streams) lands; or it
    never listens and says so in one line naming descriptors, exit 1."""
    skip_unless_python_starts(limit)
    port_file = tmp_path / "port"
    log = tmp_path / "shadow.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*tool("gcshadow"), "serve", "--port", "0", "--root", str(home), "--port-file",
                                 str(port_file)], stdout=out, stderr=out, start_new_session=True,
                                preexec_fn=limited(limit, may_raise=False))
    try:
        wait_until(lambda: proc.poll() is not None or port_file.exists(), 30, "gcshadow to listen or to exit")
        if proc.poll() is not None:
            text = log.read_text(errors="replace")
            assert "Traceback" not in text, text
            assert proc.returncode == 1, text
            (line,) = text.splitlines()
            assert line.startswith("Error: out of file descriptors") and "ulimit -n" in line, text
            return
        port = int(port_file.read_text())
        job = subprocess.run([*tool("gcwrap"), "--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir),
                              "--heartbeat", "1", "--retry-limit", "3", "--retry-timeout", "0.2", "--stdout",
                              "served.out", "--stderr", "served.err", "--", "sh", "-c", "echo out; echo err >&2"],
                             capture_output=True, timeout=60)
        assert job.returncode == 0, (job.stderr.decode(errors="replace"), log.read_text(errors="replace"))
        assert (home / "served.out").read_bytes() == b"out\n" and (home / "served.err").read_bytes() == b"err\n"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert proc.returncode == 0, log.read_text(errors="replace")
    assert "Traceback" not in log.read_text(errors="replace")
