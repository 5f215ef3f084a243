"""Shared helpers of the benchmarks in this directory (not a benchmark itself).

The process helpers (timeouts, CPU and RSS readings from /proc, stopping by
pid) are throughput.py's, imported from it so that every script measures the
same way. This module adds what the other scripts share: the output header,
a gcshadow started in its own session and stopped by pid, and percentiles.
"""

from __future__ import annotations

import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import (
    CLK_TCK,
    MB,
    BenchError,
    GiB,
    Outcome,
    PeakRss,
    Reaped,
    free_port,
    guarded,
    listening,
    parse_size,
    proc_times,
    compile_bytecode,
    settings_line,
    sha256_file,
    signal_tree,
    stop,
    vm_hwm_kib,
    wait_measured,
)

__all__ = [
    "CLK_TCK",
    "MB",
    "REPO",
    "BenchError",
    "GiB",
    "Outcome",
    "PeakRss",
    "Reaped",
    "ShadowProc",
    "fmt",
    "free_port",
    "guarded",
    "header",
    "install_signal_handlers",
    "listening",
    "parse_size",
    "percentile",
    "compile_bytecode",
    "settings_line",
    "proc_times",
    "raise_nofile",
    "render_table",
    "sha256_file",
    "signal_tree",
    "stop",
    "summary",
    "tools",
    "vm_hwm_kib",
    "wait_for_port_file",
    "wait_measured",
]

REPO = Path(__file__).resolve().parent.parent


def tools() -> tuple[list[str], list[str]]:
    """The gcwrap and gcshadow commands: the installed scripts, else `python -m`."""
    found_wrap, found_shadow = shutil.which("gcwrap"), shutil.which("gcshadow")
    gcwrap = [found_wrap] if found_wrap else [sys.executable, "-m", "gcwrap"]
    gcshadow = [found_shadow] if found_shadow else [sys.executable, "-c", "from gcwrap.shadow_cli import main; main()"]
    return gcwrap, gcshadow


def git_state() -> tuple[str, bool]:
    """(short HEAD, whether `git status --porcelain gcwrap` is empty)."""
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30, check=False).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "gcwrap"],
                               capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?", False
    return head or "?", not dirty


def header(name: str) -> str:
    """The lines every script prints first: command, date, machine, code under test."""
    bytecode = compile_bytecode()
    gcwrap, _ = tools()
    try:
        version = subprocess.run([*gcwrap, "--version"], capture_output=True, text=True, timeout=30,
                                 check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        version = "?"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "?"
    head, clean = git_state()
    return "\n".join([
        f"benchmark: {name}",
        "command: " + shlex.join([Path(sys.executable).name, *sys.argv]),
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"machine: {os.cpu_count()} CPUs ({cpu}); Linux {platform.release()}; Python {platform.python_version()}; "
        "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()),
        f"code: {version}; git HEAD {head}; `git status --porcelain gcwrap` "
        + ("empty (gcwrap/ as committed)" if clean else "NOT empty (uncommitted changes in gcwrap/)"),
        settings_line(),
        f"bytecode: {bytecode}",
    ])



def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP unwind through the finally clauses like Ctrl-C does."""

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)


def raise_nofile() -> tuple[int, int]:
    """Raise this process's RLIMIT_NOFILE soft limit to the hard limit; children inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def wait_for_port_file(proc: subprocess.Popen[bytes], portfile: Path, log: Path | None, timeout: float = 30) -> int:
    ready_by = time.monotonic() + timeout
    port = ""
    while not port.isdigit():
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.exists() else ""
            raise BenchError(f"gcshadow exited with {proc.returncode}: {tail}")
        if time.monotonic() > ready_by:
            raise BenchError(f"gcshadow did not write its port file within {timeout:.0f} s")
        time.sleep(0.02)
        port = portfile.read_text().strip() if portfile.exists() else ""
    return int(port)


class ShadowProc:
    """`gcshadow serve --port 0 --min-free 0` in its own session; `stop()` by pid (use in a finally).

    With `port`, it listens on that port instead (a restart on the same address).
    """

    def __init__(self, root: Path, rundir: Path, extra: Sequence[str] = (), port: int = 0, tag: str = "") -> None:
        _, gcshadow = tools()
        rundir.mkdir(parents=True, exist_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.portfile = rundir / f"port{tag}"
        self.portfile.unlink(missing_ok=True)
        self.log = rundir / f"gcshadow{tag}.log"
        self.cmd = [*gcshadow, "serve", "--port", str(port), "--root", str(root), "--port-file", str(self.portfile),
                    "--min-free", "0", *extra]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        self.port = 0

    def wait_ready(self, timeout: float = 30) -> int:
        self.port = wait_for_port_file(self.proc, self.portfile, self.log, timeout)
        return self.port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu(self) -> float:
        return proc_times(self.proc.pid)[0]

    def hwm_mib(self) -> float:
        return (vm_hwm_kib(self.proc.pid) or 0) / 1024

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        stop(self.proc)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- statistics and tables ----------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), nearest rank on the sorted values (no interpolation)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summary(values: Iterable[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan, math.nan
    return statistics.median(vals), min(vals), max(vals)


def fmt(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}g}" if abs(x) < 0.01 and x != 0 else f"{x:.{digits - 1}f}" if abs(x) < 1 else f"{x:.2f}"


def render_table(rows: list[list[str]]) -> str:
    """Left-aligned first column, right-aligned others, a rule under the header row."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
