"""Shared helpers of the benchmarks in this directory (not a benchmark itself).

Every script measures the same way through it: the process helpers
(timeouts, CPU and RSS readings from /proc, stopping by pid), the output
header, a gcshadow started in its own session and stopped by pid,
percentiles, profiles, and the results each script writes as JSON for
report.py. It imports no benchmark script: they import it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

__all__ = [
    "CLK_TCK",
    "MB",
    "REPO",
    "AckSniffer",
    "BenchError",
    "GiB",
    "Outcome",
    "PeakRss",
    "PerfRecord",
    "PySpy",
    "Reaped",
    "Results",
    "ShadowProc",
    "child_pid",
    "compile_bytecode",
    "fmt",
    "free_port",
    "guarded",
    "header",
    "install_signal_handlers",
    "interrupt_and_reap",
    "listening",
    "parse_size",
    "percentile",
    "perf_summary",
    "proc_times",
    "profiled_run",
    "pyspy_summary",
    "raise_nofile",
    "render_table",
    "results_option",
    "settings_line",
    "sha256_file",
    "signal_tree",
    "stop",
    "summary",
    "thread_cpu",
    "thread_cpu_summary",
    "tools",
    "vm_hwm_kib",
    "wait_for_port_file",
    "wait_listening",
    "wait_measured",
]

REPO = Path(__file__).resolve().parent.parent

GiB = 1 << 30
MB = 10**6
CLK_TCK = os.sysconf("SC_CLK_TCK")

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": MB, "mb": MB, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": GiB}


class BenchError(Exception):
    """A run failed: wrong bytes, a bad exit status, a timeout."""


@dataclass
class Outcome:
    status: int = 0  # the script's exit status


@contextlib.contextmanager
def guarded(name: str, workdir: Path, keep: bool = False,
            cleanup: Callable[[], object] | None = None) -> Iterator[Outcome]:
    """A benchmark's body: a BenchError (exit status 1) or Ctrl-C (130) is
    reported in one line; then `cleanup`, and the work directory is deleted
    (kept with --keep)."""
    outcome = Outcome()
    try:
        yield outcome
    except BenchError as e:
        print(f"{name}: FAILED: {e}", file=sys.stderr)
        outcome.status = 1
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        outcome.status = 130
    finally:
        if cleanup is not None:
            cleanup()
        if keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def compile_bytecode() -> str:
    """Byte-compile the gcwrap package under test, as `pip install` does for a
    regular install. An editable install under PYTHONDONTWRITEBYTECODE (set
    on some machines) would otherwise compile every module from source at
    each start of gcwrap and gcshadow: some 80 ms of CPU per process that no
    installed copy pays."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("gcwrap")
    if spec is None or not spec.submodule_search_locations:
        return "gcwrap not importable here: bytecode left as it is"
    package = next(iter(spec.submodule_search_locations))
    try:
        ok = compileall.compile_dir(package, quiet=1, workers=1)
    except OSError as e:
        return f"could not byte-compile {package}: {e}"
    return f"byte-compiled {package} (as a regular install is)" if ok else f"byte-compiling {package} failed"


def settings_line() -> str:
    """The GCWRAP_* variables in the environment: they reach every gcwrap the
    benchmark runs (GCWRAP_WRITE_BEHIND=0.05 measures the relaxed mode)."""
    found = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("GCWRAP_", "GCSHADOW_"))}
    shown = " ".join(f"{k}={v}" for k, v in found.items())
    return "settings: " + (shown or "defaults (no GCWRAP_* variables)")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1GB, 300MB or 64MiB")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return n


# -- /proc and wait helpers ------------------------------------------------


def proc_times(pid: int) -> tuple[float, float]:
    """(own user+sys of all threads, user+sys of waited-for children) in seconds, from /proc/PID/stat.

    Readable for a zombie too: its counters are final until it is reaped.
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2:].split()  # fields[0] is field 3 (state)
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / CLK_TCK, (cutime + cstime) / CLK_TCK


def vm_hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


@dataclass
class Reaped:
    returncode: int
    end: float  # time.monotonic() when the process was seen to exit
    own_cpu: float | None  # own user+sys from the zombie's /proc/PID/stat (None if unreadable)
    children_cpu: float | None  # user+sys of its waited-for descendants, same source
    rusage_cpu: float  # wait4: own + waited-for descendants
    peak_rss_kib: int  # VmHWM polled by a PeakRss (0 if not watched)
    timed_out: bool


def signal_tree(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal a process started with start_new_session=True, and its process group, by id."""
    for kill in (os.kill, os.killpg):
        try:
            kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_measured(proc: subprocess.Popen[bytes], deadline: float, rss: PeakRss | None = None,
                  grace: float = 5.0) -> Reaped:
    """Wait for `proc` (never waited by anyone else) until `deadline`, then SIGTERM, then SIGKILL.

    The exit is observed with waitid(WNOWAIT) in a thread, so the zombie's
    /proc/PID/stat can be read (own CPU vs children's CPU) before wait4 reaps
    it and returns its rusage.
    """
    exited: dict[str, float] = {}

    def waiter() -> None:
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        exited["t"] = time.monotonic()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    timed_out = False
    kill_at = None
    while thread.is_alive():
        thread.join(0.2)
        now = time.monotonic()
        if thread.is_alive() and now > deadline and not timed_out:
            timed_out = True
            signal_tree(proc, signal.SIGTERM)
            kill_at = now + grace
        if thread.is_alive() and kill_at is not None and now > kill_at:
            signal_tree(proc, signal.SIGKILL)
            kill_at = None
    own: float | None = None
    children: float | None = None
    try:
        own, children = proc_times(proc.pid)
    except (OSError, ValueError, IndexError):
        pass
    peak = rss.forget(proc) if rss is not None else 0
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Reaped(
        returncode=proc.returncode, end=exited["t"], own_cpu=own, children_cpu=children,
        rusage_cpu=ru.ru_utime + ru.ru_stime, peak_rss_kib=peak, timed_out=timed_out,
    )


class PeakRss:
    """Polls VmHWM (peak RSS of the current address space) of some processes every `interval` seconds.

    ru_maxrss from wait4 is no good for a child of this script: at exec the
    kernel folds the high-water mark of the address space it replaces (this
    Python process's, shared by vfork) into the child's maxrss. VmHWM belongs
    to the exec'd program alone; it is monotonic, and polling misses at most
    the last `interval` before the process exits.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak: dict[int, int] = {}
        self.live: set[int] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def watch(self, proc: subprocess.Popen[bytes]) -> None:
        """Popen returns once the child has exec'd, so its VmHWM is the new program's from now on."""
        with self.lock:
            self.live.add(proc.pid)
        self._sample(proc.pid)

    def _sample(self, pid: int) -> None:
        hwm = vm_hwm_kib(pid)
        with self.lock:
            if hwm is None:
                self.live.discard(pid)  # a zombie has no address space: its last sample stands
            elif pid in self.live:
                self.peak[pid] = max(self.peak.get(pid, 0), hwm)

    def _poll(self) -> None:
        while not self.stopping.wait(self.interval):
            with self.lock:
                pids = list(self.live)
            for pid in pids:
                self._sample(pid)

    def forget(self, proc: subprocess.Popen[bytes]) -> int:
        """Stop watching (call before reaping, so a recycled pid is never sampled); the peak in KiB."""
        with self.lock:
            self.live.discard(proc.pid)
            return self.peak.pop(proc.pid, 0)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM by pid, then SIGKILL; always reaps."""
    if proc.returncode is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_tree(proc, signal.SIGKILL)
        proc.wait(timeout)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    """Is something listening on 127.0.0.1:port (or any address)? Without connecting to it."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            addr, lport = parts[1].split(":")
            if int(lport, 16) == port and parts[3] == "0A" and addr in ("0100007F", "00000000"):
                return True
    return False


def wait_listening(proc: subprocess.Popen[bytes], port: int, name: str, timeout: float = 10.0,
                   why: Callable[[], str] = lambda: "") -> None:
    """Wait until `proc` (a receiver just started) listens on `port`;
    BenchError if it exits first or does not listen within `timeout` s
    (`why()` adds what its log says)."""
    ready_by = time.monotonic() + timeout
    while not listening(port):
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with {proc.returncode} before listening on {port}{why()}")
        if time.monotonic() > ready_by:
            raise BenchError(f"{name} is not listening on {port} after {timeout:g} s{why()}")
        time.sleep(0.01)


def interrupt_and_reap(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGINT to a recorder (py-spy, perf) so it writes its output and exits;
    SIGKILL to its tree if it has not within `timeout` s. Always reaps it."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_tree(proc, signal.SIGKILL)
        proc.wait(timeout)


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


# -- results as JSON ------------------------------------------------------------

RESULTS_DIR = REPO / "benchmarks" / "results"


def results_option(parser: argparse.ArgumentParser, name: str) -> None:
    """--json PATH (default benchmarks/results/NAME.json, what report.py reads) and --no-json."""
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / f"{name}.json",
                        help=f"write the results here as JSON (default: benchmarks/results/{name}.json, "
                             "which benchmarks/report.py turns into the table of benchmarks/README.md)")
    parser.add_argument("--no-json", dest="json", action="store_const", const=None,
                        help="write no JSON (a smoke run that must not replace the committed results)")


def machine() -> dict[str, object]:
    """CPU model, cores, kernel and Python of this machine."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or "?"
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version()}


def _stats(values: Sequence[float]) -> dict[str, object]:
    kept = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not kept:
        return {"runs": [], "median": None, "min": None, "max": None}
    return {"runs": kept, "median": statistics.median(kept), "min": min(kept), "max": max(kept)}


def _plain(value: object) -> object:
    """JSON has no NaN or infinity: they become null; tuples and paths become lists and strings."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


class Results:
    """What one invocation of a benchmark measured, for benchmarks/results/NAME.json.

    Made when the script starts (the date, the code under test, the machine,
    the load average before), filled as it runs (`command`, `run`, `figure`),
    written at the end (`write`: the load average after). A figure holds the
    per-run values of gcwrap and of the baseline measured in the same
    invocation, their medians, and the ratio of the medians; report.py makes
    the README's table from these files and nothing else.
    """

    def __init__(self, name: str, path: Path | None) -> None:
        head, clean = git_state()
        self.path = path
        self.data: dict[str, object] = {
            "benchmark": name,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": head,
            "dirty": not clean,
            "machine": machine(),
            "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("GCWRAP_", "GCSHADOW_"))
                         and not k.startswith(("GCWRAP_TEST_", "GCWRAP_BENCH_"))},
            "command": shlex.join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
            "load_before": list(os.getloadavg()),
            "commands": {},
            "runs": [],
            "figures": [],
        }

    def command(self, label: str, cmd: Sequence[str] | str) -> None:
        """The exact command of one side (the first run's, when runs differ only in paths)."""
        commands = self.data["commands"]
        assert isinstance(commands, dict)
        commands.setdefault(label, cmd if isinstance(cmd, str) else shlex.join(cmd))

    def run(self, **values: object) -> None:
        """One run's figures, as the script measured them."""
        runs = self.data["runs"]
        assert isinstance(runs, list)
        runs.append(values)

    def figure(self, name: str, unit: str, gcwrap: Sequence[float], baseline: Sequence[float] = (),
               baseline_name: str = "", target: str = "", key: bool = False) -> None:
        """One figure: gcwrap's per-run values, the baseline's of the same invocation, the ratio of the medians
        (gcwrap / baseline), and the target an issue set for it, if any ("<= 1.05x", ">= 0.35x"). `key`
        figures go in the README's table; the others stay in the JSON."""
        ours, theirs = _stats(gcwrap), _stats(baseline)
        ratio = None
        if isinstance(ours["median"], float) and isinstance(theirs["median"], float) and theirs["median"]:
            ratio = ours["median"] / theirs["median"]
        figures = self.data["figures"]
        assert isinstance(figures, list)
        figures.append({"name": name, "unit": unit, "gcwrap": ours,
                        "baseline": {"name": baseline_name, **theirs} if baseline else None,
                        "ratio": ratio, "target": target, "key": key or bool(target)})

    def write(self) -> Path | None:
        """Write the JSON (unless --no-json); returns where."""
        self.data["load_after"] = list(os.getloadavg())
        self.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if self.path is None:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(_plain(self.data), indent=1, allow_nan=False) + "\n")
        print(f"results: {self.path}", flush=True)
        return self.path



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


def _nofile(n: int) -> Callable[[], None]:
    """For preexec_fn: RLIMIT_NOFILE soft and hard at `n` (a shadow held to
    a descriptor limit below this machine's)."""

    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return limit


class ShadowProc:
    """`gcshadow serve --port 0 --min-free 0` in its own session; `stop()` by pid (use in a finally).

    With `port`, it listens on that port instead (a restart on the same address);
    with `nofile`, under that descriptor limit (soft and hard).
    """

    def __init__(self, root: Path, rundir: Path, extra: Sequence[str] = (), port: int = 0, tag: str = "",
                 nofile: int = 0) -> None:
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
                                         start_new_session=True, preexec_fn=_nofile(nofile) if nofile else None)
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



# -- profiles ---------------------------------------------------------------------


class PySpy:
    """`py-spy record` of one process, writing raw collapsed stacks (one line per stack and its count).

    Either attached to a running `pid`, or launching `cmd` under it (then the
    profiled program is py-spy's child and the profile covers its start-up).
    Only active samples are kept (no --idle), so a share of the samples is a
    share of the CPU the process's threads used. Started in its own session;
    `stop()` sends SIGINT by pid (py-spy writes its output then), SIGKILL after
    `timeout`. Profiled runs are never timed: sampling slows the target.
    """

    def __init__(self, out: Path, pid: int | None = None, cmd: Sequence[str] = (), rate: int = 250,
                 native: bool = False, log: Path | None = None) -> None:
        exe = shutil.which("py-spy")
        if exe is None:
            raise BenchError("py-spy is not installed (pip install py-spy)")
        self.out = out
        self.command = [exe, "record", "--rate", str(rate), "--threads", "--format", "raw", "--output", str(out)]
        # --native reads the target's native stacks, which needs it paused; otherwise do not pause it.
        self.command += ["--native"] if native else ["--nonblocking"]
        self.command += ["--pid", str(pid)] if pid is not None else ["--", *cmd]
        self.log = log or out.with_suffix(".log")
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                         start_new_session=True)

    def stop(self, timeout: float = 30.0) -> None:
        """Make py-spy write its output and exit (by pid); always reaps it."""
        interrupt_and_reap(self.proc, timeout)

    def wait(self, timeout: float) -> int:
        """Wait for py-spy to exit by itself (the program it launched has exited); SIGKILL on timeout."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            signal_tree(self.proc, signal.SIGKILL)
            self.proc.wait(10)
            raise BenchError(f"py-spy ({shlex.join(self.command)}) did not finish within {timeout:.0f} s") from None


_FRAME_LINE = re.compile(r":\d+\)$")
_NATIVE_FRAME = re.compile(r"\((?:[^()]*\.(?:c|h|cc|cpp|rs)(?::\d+)?|[^()]*\.so[.\d]*)\)$")


def _frame_key(frame: str, by_line: bool) -> str:
    """A frame of py-spy's raw output, `func (file.py:LINE)` or a native `0x7f.. (lib.so)`, as a key."""
    if frame.startswith("0x"):
        lib = frame.partition(" ")[2]
        return f"[native] {lib}"
    return frame if by_line else _FRAME_LINE.sub(")", frame)


def pyspy_summary(raw: Path, top: int = 15, title: str = "") -> str:
    """Where the samples of one py-spy raw profile went: by thread, then the functions
    with the most self samples (the innermost frame, by line too) and the most
    inclusive samples (anywhere on the stack), as percentages of all samples."""
    threads: collections.Counter[str] = collections.Counter()
    names: dict[str, str] = {}
    self_fn: collections.Counter[str] = collections.Counter()
    self_line: collections.Counter[str] = collections.Counter()
    self_py: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    stacks: list[tuple[str, list[str], int]] = []
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        tid, _, name = frames[0].partition(": ")
        if name:
            names[tid] = name
        stacks.append((tid, frames[1:], n))
        total += n
    if not total:
        return f"{title}: no samples in {raw}"
    for tid, frames, n in stacks:
        threads[names.get(tid, tid)] += n
        if frames:
            self_fn[_frame_key(frames[-1], False)] += n
            self_line[_frame_key(frames[-1], True)] += n
            py = next((f for f in reversed(frames) if not f.startswith("0x") and not _NATIVE_FRAME.search(f)),
                      "(no Python frame)")
            self_py[py] += n
        for key in {_frame_key(f, False) for f in frames}:
            incl[key] += n

    def block(head: str, counter: collections.Counter[str]) -> list[str]:
        return [head] + [f"  {100 * c / total:5.1f}%  {k}" for k, c in counter.most_common(top)]

    out = [f"{title or raw.name}: {total} samples (active threads only)"]
    out += block("by thread:", threads)
    out += block("self, by function (innermost frame):", self_fn)
    out += block("self, by line:", self_line)
    if self_py != self_line:  # native frames were recorded: which Python line they run under
        out += block("self, by innermost Python line (native frames below it counted there):", self_py)
    out += block("inclusive, by function (anywhere on the stack):", incl)
    for thread, n in threads.most_common(3):
        mine: collections.Counter[str] = collections.Counter()
        for tid, frames, c in stacks:
            if names.get(tid, tid) == thread and frames:
                mine[next((f for f in reversed(frames) if not f.startswith("0x") and not _NATIVE_FRAME.search(f)),
                          "(no Python frame)")] += c
        out += block(f"thread {thread} ({100 * n / total:.1f}% of the samples), self by innermost Python line:",
                     collections.Counter(dict(mine.most_common(8))))
    return "\n".join(out)


def thread_cpu(pid: int) -> dict[int, tuple[str, float, float]]:
    """{tid: (thread name, user s, sys s)} of every thread of `pid`, from /proc/PID/task/*/stat."""
    out: dict[int, tuple[str, float, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        name = data[data.index(b"(") + 1:data.rindex(b")")].decode(errors="replace")
        fields = data[data.rindex(b")") + 2:].split()
        out[int(tid)] = (name, int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK)
    return out


def thread_cpu_summary(before: dict[int, tuple[str, float, float]], after: dict[int, tuple[str, float, float]]) -> str:
    """The CPU each thread used between two thread_cpu() readings, user and sys apart."""
    rows = []
    tu = ts = 0.0
    for tid, (name, u, s) in sorted(after.items()):
        _, u0, s0 = before.get(tid, (name, 0.0, 0.0))
        du, ds = u - u0, s - s0
        tu, ts = tu + du, ts + ds
        if du + ds > 0:
            rows.append(f"  {name} ({tid}): user {du:.2f} s, sys {ds:.2f} s")
    return "\n".join([f"CPU by thread: user {tu:.2f} s + sys {ts:.2f} s", *rows])


def child_pid(pid: int, timeout: float = 10.0) -> int | None:
    """The first child of `pid` (say the program py-spy launched), once it exists; None after `timeout`."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        if kids:
            return int(kids[0])
        time.sleep(0.005)
    return None


class PerfRecord:
    """`perf record` (cpu-clock samples, on-CPU only) of one running process, all its threads; `stop()` by pid.

    Where py-spy gives the Python stack, perf gives what is on the CPU in the
    kernel, the interpreter and the C libraries (sqlite, libc): a sample is
    taken only while a thread runs, so its shares are shares of CPU time.
    """

    def __init__(self, out: Path, pid: int, freq: int = 499) -> None:
        exe = shutil.which("perf")
        if exe is None:
            raise BenchError("perf is not installed")
        self.out = out
        # -g: kernel call chains, to add the kernel's time up by system call
        self.command = [exe, "record", "-F", str(freq), "-e", "cpu-clock", "-g", "-p", str(pid), "-o", str(out)]
        with open(out.with_suffix(".log"), "wb") as f:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                         start_new_session=True)

    def stop(self, timeout: float = 60.0) -> None:
        """Make perf write its output and exit (by pid); always reaps it."""
        interrupt_and_reap(self.proc, timeout)


# Kernel functions that stand for one system call in a call chain (the __x64_sys_ wrappers are often
# tail calls, absent from the chains; these are not).
_SYSCALL_SYMBOLS = {
    "ksys_read": "read", "ksys_write": "write", "ksys_pread64": "pread64", "ksys_pwrite64": "pwrite64",
    "do_readv": "readv", "do_writev": "writev", "__sys_recvfrom": "recvfrom", "__sys_sendto": "sendto",
    "___sys_sendmsg": "sendmsg", "___sys_recvmsg": "recvmsg", "do_sendfile": "sendfile64", "do_splice": "splice",
    "do_fsync": "fsync/fdatasync", "sync_filesystem": "syncfs", "do_epoll_wait": "epoll_wait",
    "do_epoll_ctl": "epoll_ctl", "do_futex": "futex", "do_sys_openat2": "openat", "do_unlinkat": "unlinkat",
    "vfs_fallocate": "fallocate", "do_sys_ftruncate": "ftruncate", "do_pipe2": "pipe2",
    "__do_sys_clone3": "clone3", "do_group_exit": "exit_group", "do_sys_poll": "poll", "do_select": "select",
    "__sys_accept4": "accept4", "__sys_connect": "connect", "do_mmap": "mmap", "__vm_munmap": "munmap",
}
_SYSCALL_ALIASES = {"unlink": "unlinkat", "fsync": "fsync/fdatasync", "fdatasync": "fsync/fdatasync",
                    "recv": "recvfrom", "send": "sendto", "sendfile": "sendfile64", "pread": "pread64",
                    "pwrite": "pwrite64"}


def perf_summary(data: Path, top: int = 15, title: str = "", exclude: Sequence[str] = ()) -> str:
    """The CPU samples of one `perf record` by thread, by binary (kernel, libpython, sqlite, ...), by symbol,
    and the kernel's time by system call.

    perf follows the children a process forks after it attached (a job that
    gcwrap starts): the threads named in `exclude` (comm) are left out, and
    percentages are of the samples that remain."""
    exe = shutil.which("perf") or "perf"

    def report(sort: str, children: bool = False, comms: Sequence[str] = ()) -> list[tuple[float, str]]:
        """(percent, key) rows; `sort` after a leading comm key, which is summed over (perf applies --comms
        to the entries only when comm is a sort key)."""
        cmd = [exe, "report", "-i", str(data), "--children" if children else "--no-children", "--stdio",
               "-g", "none", "-t", "|", "--sort", f"comm,{sort}"]
        if comms:
            cmd += ["--comms", ",".join(comms), "--percentage", "relative"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        sums: dict[str, float] = collections.defaultdict(float)
        for line in r.stdout.splitlines():
            if line.startswith("#") or "|" not in line:
                continue
            cells = [c.strip() for c in line.split("|")]
            try:
                pct = float(cells[0].rstrip("%"))
            except ValueError:
                continue
            key = " ".join(cells[3 if children else 2:])
            sums[key] += pct
        return sorted(((pct, key) for key, pct in sums.items()), reverse=True)

    out = [f"{title or data.name}: perf, on-CPU samples"]
    try:
        r = subprocess.run([exe, "report", "-i", str(data), "--no-children", "--stdio", "-g", "none", "-t", "|",
                            "--sort", "comm"],
                           capture_output=True, text=True, timeout=300, check=False)
        total = next((line[2:].strip() for line in r.stdout.splitlines() if line.startswith("# Samples:")), "")
        by_comm = [(float(c[0].strip().rstrip("%")), c[1].strip()) for c in
                   (line.split("|") for line in r.stdout.splitlines() if "|" in line and not line.startswith("#"))]
        out.append(f"by thread (comm), all samples ({total}):")
        out += [f"  {pct:6.2f}% {comm}" for pct, comm in by_comm[:top]]
        keep = [comm for _, comm in by_comm if comm not in exclude]
        comms = keep if len(keep) < len(by_comm) and keep else []
        if comms:
            out.append(f"(below: without {', '.join(c for _, c in by_comm if c in exclude)}; percentages of the rest)")
        for sort, head in (("dso", "by binary"), ("dso,sym", "by symbol")):
            out.append(f"{head}:")
            out += [f"  {pct:6.2f}% {key}" for pct, key in report(sort, comms=comms)[:top]]
        # Inclusive time of each system call's kernel entry point (needs the call chains of -g).
        calls: dict[str, float] = {}
        for pct, key in report("sym", children=True, comms=comms):
            m = re.fullmatch(r"\[k\] (\w+)", key)
            if m is None:
                continue
            sym = m.group(1)
            name = _SYSCALL_SYMBOLS.get(sym) or (sym[len("__x64_sys_"):] if sym.startswith("__x64_sys_") else None)
            if name is not None:
                name = _SYSCALL_ALIASES.get(name, name)
                calls[name] = max(calls.get(name, 0.0), pct)
        if calls:
            out.append("kernel time by system call (inclusive; % of the samples above):")
            out += [f"  {pct:6.2f}% {name}" for name, pct in sorted(calls.items(), key=lambda c: -c[1])[:top]]
    except subprocess.TimeoutExpired:
        out.append("perf report timed out")
    return "\n".join(out)


def profiled_run(outdir: Path, tag: str, shadow_pid: int, cmd: Sequence[str], log: Path,
                 timeout: float) -> tuple[float, str]:
    """Run `cmd` (a gcwrap) under py-spy while py-spy samples the shadow by pid, and perf records both (when
    installed). Writes OUTDIR/{gcshadow,gcwrap}-TAG.{raw,perf.data,txt}; returns (wall seconds, the summaries).
    Not a timed run: the samplers take CPU from both programs."""
    outdir.mkdir(parents=True, exist_ok=True)
    perf_ok = shutil.which("perf") is not None
    threads0 = thread_cpu(shadow_pid)
    cpu0 = proc_times(shadow_pid)[0]
    spies: list[PySpy] = []
    perfs: list[PerfRecord] = []
    try:
        spies.append(PySpy(outdir / f"gcshadow-{tag}.raw", pid=shadow_pid))
        if perf_ok:
            perfs.append(PerfRecord(outdir / f"gcshadow-{tag}.perf.data", shadow_pid))
        time.sleep(1.0)  # the samplers attach
        t0 = time.monotonic()
        spy = PySpy(outdir / f"gcwrap-{tag}.raw", cmd=cmd, log=log)
        spies.append(spy)
        kid = child_pid(spy.proc.pid) if perf_ok else None
        if kid is not None:
            perfs.append(PerfRecord(outdir / f"gcwrap-{tag}.perf.data", kid))
        if spy.wait(timeout) != 0:
            raise BenchError(f"gcwrap under py-spy ({tag}) failed:\n{log.read_text(errors='replace')[-2000:]}")
        wall = time.monotonic() - t0
        time.sleep(0.25)
        cpu = proc_times(shadow_pid)[0] - cpu0
        threads = thread_cpu_summary(threads0, thread_cpu(shadow_pid))
    finally:
        for spy in spies:
            spy.stop()
        for perf in perfs:
            perf.stop()
    texts = []
    for who in ("gcshadow", "gcwrap"):
        text = pyspy_summary(outdir / f"{who}-{tag}.raw", title=f"{who}, {tag}: py-spy")
        if who == "gcshadow":
            text += f"\nshadow CPU during the run: {cpu:.2f} s\n{threads}"
        data = outdir / f"{who}-{tag}.perf.data"
        if data.exists():
            job = list(cmd)[list(cmd).index("--") + 1] if "--" in cmd else ""
            text += "\n" + perf_summary(data, title=f"{who}, {tag}", exclude=[Path(job).name[:15]] if job else [])
        elif not perf_ok:
            text += "\n(perf is not installed: no on-CPU samples)"
        (outdir / f"{who}-{tag}.txt").write_text(text + "\n")
        texts.append(text)
    return wall, "\n\n".join(texts)


# -- ACKs seen on the wire ---------------------------------------------------------

ETH_P_IP = 0x0800
SO_ATTACH_FILTER, SO_TIMESTAMPNS, SO_RCVBUFFORCE = 26, 35, 33
SOL_PACKET, PACKET_STATISTICS = 263, 6
TCP_SYN = 0x02


def tcp_from_port_filter(port: int) -> bytes:
    """A classic BPF program for a SOCK_DGRAM packet socket (packets start at the IP header):
    accept IPv4 TCP segments (unfragmented) whose source port is `port`, drop the rest."""
    insns = [
        (0x30, 0, 0, 9),  # ldb [9]: protocol
        (0x15, 0, 6, 6),  # jeq #6 (TCP), else drop
        (0x28, 0, 0, 6),  # ldh [6]: flags and fragment offset
        (0x45, 4, 0, 0x1FFF),  # jset #0x1fff: a fragment -> drop
        (0xB1, 0, 0, 0),  # ldxb 4*([0]&0xf): IP header length
        (0x48, 0, 0, 0),  # ldh [x+0]: TCP source port
        (0x15, 0, 1, port),  # jeq #port, else drop
        (0x06, 0, 0, 0x40000),  # ret: accept (up to 256 KiB)
        (0x06, 0, 0, 0),  # ret 0: drop
    ]
    return b"".join(struct.pack("HBBI", *i) for i in insns)


class AckSniffer(threading.Thread):
    """Times the ACKs a shadow on 127.0.0.1:`port` sends, as they arrive at the agent's end.

    A packet socket on `lo` with a BPF filter (TCP from `port`) and kernel
    receive timestamps (SO_TIMESTAMPNS, CLOCK_REALTIME, turned into
    CLOCK_MONOTONIC with the two clocks' offset read at each packet, so a
    slewing clock cannot shift them by more than a few microseconds).
    Each connection's shadow -> agent byte stream is reassembled from the SYN
    on (start this before the agent connects), cut into frames and decoded
    with gcwrap.wire.protocol; `acks` gets (offset, arrival ns) of every ACK of
    `stream`. `problem` is set if a segment was missed.
    """

    def __init__(self, port: int, stream: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stream = stream
        self.acks: list[tuple[int, int]] = []
        self.frames = 0
        self.segments = 0
        self.problem = ""
        self.error: BaseException | None = None
        self.stopping = threading.Event()
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_IP))
        except PermissionError:
            raise BenchError("capturing ACKs on loopback needs a packet socket: run as root (or with "
                             "CAP_NET_RAW)") from None
        try:
            prog = tcp_from_port_filter(port)
            self._prog = ctypes.create_string_buffer(prog)
            fprog = struct.pack("HL", len(prog) // 8, ctypes.addressof(self._prog))
            self.sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
            self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self.sock.bind(("lo", ETH_P_IP))
            self.sock.settimeout(0.05)
        except OSError:
            self.sock.close()
            raise
        # state per connection (the agent's port): next sequence number, bytes not yet framed
        self.conns: dict[int, tuple[int, bytearray]] = {}

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e

    def _run(self) -> None:
        from gcwrap.wire.events import Ack
        from gcwrap.wire.protocol import decode

        anc = socket.CMSG_SPACE(16)
        while not self.stopping.is_set():
            try:
                pkt, ancdata, _, _ = self.sock.recvmsg(1 << 18, anc)
            except TimeoutError:
                continue
            offset = time.time_ns() - time.monotonic_ns()
            stamp = next((struct.unpack("qq", d[:16]) for lvl, typ, d in ancdata
                          if lvl == socket.SOL_SOCKET and typ == SO_TIMESTAMPNS), None)
            arrival = (stamp[0] * 1_000_000_000 + stamp[1] - offset) if stamp else time.monotonic_ns()
            ihl = (pkt[0] & 0x0F) * 4
            total = struct.unpack_from("!H", pkt, 2)[0]
            sport, dport, seq, _ack, off_flags = struct.unpack_from("!HHIIH", pkt, ihl)
            if sport != self.port:
                continue
            self.segments += 1
            flags = off_flags & 0x3F
            payload = pkt[ihl + (off_flags >> 12) * 4:total]
            if flags & TCP_SYN:
                self.conns[dport] = ((seq + 1) & 0xFFFFFFFF, bytearray())
                continue
            if not payload:
                continue
            if dport not in self.conns:
                self.problem = f"data on a connection (agent port {dport}) whose SYN was not seen"
                continue
            nxt, buf = self.conns[dport]
            ahead = (seq - nxt) & 0xFFFFFFFF
            if 0 < ahead < 1 << 31:
                self.problem = f"missed {ahead} bytes of the shadow's stream to port {dport}"
                continue
            behind = (nxt - seq) & 0xFFFFFFFF
            if behind >= len(payload):
                continue  # a retransmission of bytes already seen
            buf += payload[behind:]
            self.conns[dport] = ((nxt + len(payload) - behind) & 0xFFFFFFFF, buf)
            while len(buf) >= 5:
                length = struct.unpack_from("!I", buf, 0)[0]
                if len(buf) < 4 + length:
                    break
                ev = decode(buf[4], bytes(buf[5:4 + length]))
                del buf[:4 + length]
                self.frames += 1
                if isinstance(ev, Ack) and ev.stream == self.stream:
                    self.acks.append((ev.offset, arrival))

    def close(self) -> int:
        """Stop, close the socket, and return the packets the kernel dropped for want of room in it."""
        self.stopping.set()
        if self.is_alive():
            self.join(5)
        if self.sock.fileno() < 0:
            return 0
        raw = self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)
        self.sock.close()
        return int(struct.unpack("II", raw)[1])
