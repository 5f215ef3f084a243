#!/usr/bin/env python3
"""Throughput of gcwrap -> gcshadow on loopback against a naive socat pipe.

Both paths move the same N bytes of incompressible data, written to stdout by
the same job (`head -c N SOURCE`, SOURCE being a 64 MiB random block
concatenated with itself), over loopback TCP into a file on the same
filesystem:

    gcwrap:  gcshadow serve --port 0 --root HOME --port-file PORTFILE
             gcwrap --shadow 127.0.0.1:PORT --stdout throughput.out --spool SPOOL --job-id ID -- head -c N SOURCE
    socat:   socat -u -b 1048576 TCP-LISTEN:PORT,reuseaddr,bind=127.0.0.1 OPEN:FILE,creat,trunc
             head -c N SOURCE | socat -u -b 1048576 - TCP:127.0.0.1:PORT
    floor:   head -c N SOURCE | dd of=FILE bs=1M iflag=fullblock conv=fdatasync status=none
             the disk's floor: one pipe, the page cache and one fdatasync, no network, nothing of
             gcwrap (what any durable path must at least spend here).

Runs rotate (gcwrap, socat, floor; socat, floor, gcwrap; ...). Every landed file is
checked against the sha256 of the source bytes; a mismatch, a short file, a
non-zero exit status or a timeout fails the benchmark (exit status 1).

Measures, per run (see benchmarks/README.md for the method):
  wall time       gcwrap: from spawning gcwrap until gcwrap exits (every byte acked, durable at home);
                  socat: from spawning the job and the sending socat until the receiving socat exits.
  CPU-s per GiB   sender side: gcwrap's own user+sys (all its threads, NOT the job), read from
                  /proc/PID/stat while gcwrap is a zombie (waitid WNOWAIT), before it is reaped;
                  socat: the sending socat's rusage from wait4.
                  receiver side: gcshadow's user+sys from /proc/PID/stat (all threads), after minus
                  before the run; socat: the receiving socat's rusage from wait4.
  peak RSS        VmHWM from /proc/PID/status: polled every 20 ms for gcwrap and the socats (not
                  ru_maxrss, which a child inherits from this script's address space at exec);
                  read once for gcshadow after the run, before it is stopped.

Usage:
  python benchmarks/throughput.py --size 1GB --runs 5
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    MB,
    BenchError,
    GiB,
    PeakRss,
    Results,
    free_port,
    guarded,
    header,
    install_signal_handlers,
    parse_size,
    proc_times,
    profiled_run,
    results_option,
    sha256_file,
    signal_tree,
    stop,
    vm_hwm_kib,
    wait_listening,
    wait_measured,
)

BLOCK = 64 << 20  # the random block the source is made of
# --rate: the same bytes as `head -c N SOURCE`, in 256 KiB writes, no faster than RATE bytes/s.
PACER = """
import os, sys, time
fd, size, rate = os.open(sys.argv[1], os.O_RDONLY), int(sys.argv[2]), float(sys.argv[3])
done, start = 0, time.monotonic()
while done < size:
    data = memoryview(os.pread(fd, min(256 << 10, size - done), done))
    while data:
        data = data[os.write(1, data):]
    done += 256 << 10
    ahead = start + min(done, size) / rate - time.monotonic()
    if ahead > 0:
        time.sleep(ahead)
"""
OUT_NAME = "throughput.out"

PERF_EVENTS = ("page-faults", "task-clock", "syscalls:sys_enter_fdatasync", "syscalls:sys_enter_syncfs",
               "syscalls:sys_enter_pwrite64", "syscalls:sys_enter_recvfrom", "syscalls:sys_enter_readv")


def perf_counts(perf: subprocess.Popen[bytes], out: Path) -> dict[str, float]:
    """Stop a `perf stat` (SIGINT) and read its counts: {event: count}, task-clock in ms."""
    perf.send_signal(signal.SIGINT)
    try:
        perf.wait(10)
    except subprocess.TimeoutExpired:
        signal_tree(perf, signal.SIGKILL)
        perf.wait(10)
    counts: dict[str, float] = {}
    for line in out.read_text().splitlines():
        fields = line.split(",")
        if len(fields) >= 3 and not line.startswith("#"):
            try:
                counts[fields[2].removeprefix("syscalls:sys_enter_")] = float(fields[0])
            except ValueError:
                pass  # "<not counted>"
    return counts




# -- the benchmark -----------------------------------------------------------


@dataclass
class Run:
    path: str  # "gcwrap" or "socat"
    index: int
    wall_s: float
    mb_s: float
    sender_cpu_s: float  # gcwrap's own CPU, or the sending socat's
    receiver_cpu_s: float  # gcshadow's CPU during the run, or the receiving socat's
    sender_rss_mib: float
    receiver_rss_mib: float
    job_cpu_s: float  # the job's own CPU (head), for context
    notes: dict[str, object] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.size: int = args.size
        self.workdir = workdir
        self.source = workdir / "source.bin"
        found_wrap, found_shadow = shutil.which("gcwrap"), shutil.which("gcshadow")
        self.gcwrap = [found_wrap] if found_wrap else [sys.executable, "-m", "gcwrap"]
        self.gcshadow = [found_shadow] if found_shadow else [
            sys.executable, "-c", "from gcwrap.shadow_cli import main; main()"]
        self.socat = shutil.which("socat")
        self.expected = ""
        self.commands: dict[str, list[str]] = {}
        self.rss = PeakRss()

    @property
    def job(self) -> list[str]:
        if self.args.rate:
            return [sys.executable, "-c", PACER, str(self.source), str(self.size), str(self.args.rate)]
        return ["head", "-c", str(self.size), str(self.source)]

    def deadline(self) -> float:
        return time.monotonic() + float(self.args.timeout)

    def prepare(self) -> None:
        """The source file (whole copies of one random block) and the expected sha256 of N bytes of it."""
        block = os.urandom(BLOCK)
        copies = -(-self.size // BLOCK)
        with open(self.source, "wb") as f:
            f.writelines(block for _ in range(copies))
        h = hashlib.sha256()
        view = memoryview(block)
        full, rest = divmod(self.size, BLOCK)
        for _ in range(full):
            h.update(view)
        h.update(view[:rest])
        self.expected = h.hexdigest()

    def generator_ceiling(self) -> float:
        """MB/s of the job alone into a pipe read by cat > /dev/null: the ceiling for both paths."""
        os.sync()
        t0 = time.monotonic()
        job = subprocess.Popen(self.job, stdout=subprocess.PIPE, start_new_session=True)
        sink = subprocess.Popen(["cat"], stdin=job.stdout, stdout=subprocess.DEVNULL, start_new_session=True)
        assert job.stdout is not None
        job.stdout.close()
        try:
            r = wait_measured(sink, self.deadline())
            wait_measured(job, self.deadline())
        finally:
            stop(job)
            stop(sink)
        if r.returncode != 0:
            raise BenchError(f"generator check failed: cat exited {r.returncode}")
        return self.size / (r.end - t0) / MB

    def verify(self, path: Path, what: str) -> None:
        if not path.exists():
            raise BenchError(f"{what}: {path} was not written")
        size = path.stat().st_size
        if size != self.size:
            raise BenchError(f"{what}: {path} holds {size} bytes, expected {self.size}")
        got = sha256_file(path)
        if got != self.expected:
            raise BenchError(f"{what}: sha256 {got} != expected {self.expected}")

    def run_gcwrap(self, index: int, profile: Path | None = None) -> Run:
        """One timed gcwrap run; with `profile`, an untimed one under py-spy (see --profile)."""
        rundir = self.workdir / f"gcwrap-{index}"
        home, spool = rundir / "home", rundir / "spool"
        home.mkdir(parents=True)
        portfile, shadow_log, wrap_log = rundir / "port", rundir / "gcshadow.log", rundir / "gcwrap.log"
        shadow_cmd = [*self.gcshadow, "serve", "--port", "0", "--root", str(home), "--port-file", str(portfile)]
        with open(shadow_log, "wb") as log:
            shadow = subprocess.Popen(shadow_cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                      start_new_session=True)
        wrapper: subprocess.Popen[bytes] | None = None
        try:
            ready_by = time.monotonic() + 30
            port = ""
            while not port.isdigit():
                if shadow.poll() is not None:
                    raise BenchError(f"gcshadow exited with {shadow.returncode}: {shadow_log.read_text()[-2000:]}")
                if time.monotonic() > ready_by:
                    raise BenchError("gcshadow did not write its port file within 30 s")
                time.sleep(0.02)
                port = portfile.read_text().strip() if portfile.exists() else ""
            wrap_cmd = [*self.gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", OUT_NAME, "--spool", str(spool),
                        "--job-id", f"bench-{os.getpid()}-{index}", "--", *self.job]
            self.commands.setdefault("gcshadow", shadow_cmd)
            self.commands.setdefault("gcwrap", wrap_cmd)
            os.sync()  # start every run with no dirty pages left by the previous one
            time.sleep(0.2)
            if profile is not None:
                return self._profiled(index, shadow, wrap_cmd, wrap_log, home, profile)
            perf = self._perf_stat(shadow.pid, rundir / "perf.csv") if self.args.perf_stat else None
            shadow_cpu0, _ = proc_times(shadow.pid)
            with open(wrap_log, "wb") as log:
                t0 = time.monotonic()
                wrapper = subprocess.Popen(wrap_cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                           stderr=log, start_new_session=True)
            self.rss.watch(wrapper)
            r = wait_measured(wrapper, self.deadline(), self.rss)
            wall = r.end - t0
            time.sleep(0.25)  # let the shadow finish its book-keeping for the job
            shadow_cpu1, _ = proc_times(shadow.pid)
            counts = perf_counts(perf, rundir / "perf.csv") if perf is not None else {}
            shadow_hwm = vm_hwm_kib(shadow.pid) or 0
            log_text = wrap_log.read_text(errors="replace")
            if r.timed_out:
                raise BenchError(f"gcwrap run {index} timed out after {self.args.timeout:.0f} s\n{log_text[-2000:]}")
            if r.returncode != 0:
                raise BenchError(f"gcwrap run {index} exited {r.returncode}\n{log_text[-2000:]}")
            if r.own_cpu is None or r.children_cpu is None:
                raise BenchError("could not read gcwrap's /proc/PID/stat before reaping it")
            self.verify(home / OUT_NAME, f"gcwrap run {index}")
            leftover = sorted(p.name for p in spool.glob("*")) if spool.exists() else []
            return Run(
                path="gcwrap", index=index, wall_s=wall, mb_s=self.size / wall / MB,
                sender_cpu_s=r.own_cpu, receiver_cpu_s=shadow_cpu1 - shadow_cpu0,
                sender_rss_mib=r.peak_rss_kib / 1024, receiver_rss_mib=shadow_hwm / 1024,
                job_cpu_s=r.children_cpu,
                notes={"stderr_lines": len(log_text.splitlines()), "spool_leftover": leftover,
                       "wrapper_rusage_cpu_s": r.rusage_cpu, "shadow_perf": counts},
            )
        finally:
            if wrapper is not None and wrapper.returncode is None:
                signal_tree(wrapper, signal.SIGKILL)
                wrapper.wait(10)
            stop(shadow)
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    @staticmethod
    def _perf_stat(pid: int, out: Path) -> subprocess.Popen[bytes]:
        """`perf stat` counting PERF_EVENTS of gcshadow (all its threads) until perf_counts stops it."""
        perf = subprocess.Popen(["perf", "stat", "-x", ",", "-o", str(out), "-e", ",".join(PERF_EVENTS),
                                 "-p", str(pid)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        ready_by = time.monotonic() + 10
        while not out.exists():  # (perf opens its output file first, then attaches: give it a moment)
            if perf.poll() is not None or time.monotonic() > ready_by:
                raise BenchError(f"perf stat did not start (status {perf.poll()})")
            time.sleep(0.01)
        time.sleep(0.3)
        return perf

    def _profiled(self, index: int, shadow: subprocess.Popen[bytes], wrap_cmd: list[str], wrap_log: Path,
                  home: Path, profile: Path) -> Run:
        """gcwrap launched by py-spy, gcshadow sampled by pid, perf on both (benchlib.profiled_run). Not
        timed (sampling slows both); the bytes are checked all the same."""
        wall, text = profiled_run(profile, "bulk", shadow.pid, wrap_cmd, wrap_log, float(self.args.timeout))
        self.verify(home / OUT_NAME, f"gcwrap run {index} (profiled)")
        print(f"\n-- profile of gcwrap -> gcshadow, bulk {self.size:,} bytes ({wall:.1f} s under the samplers; "
              f"files in {profile}) --\n{text}", flush=True)
        return Run(path="gcwrap", index=index, wall_s=wall, mb_s=self.size / wall / MB, sender_cpu_s=math.nan,
                   receiver_cpu_s=math.nan, sender_rss_mib=math.nan, receiver_rss_mib=math.nan, job_cpu_s=math.nan)

    def run_socat(self, index: int) -> Run:
        """The naive pipe: the job into a sending socat, a receiving socat into a file (no sync)."""
        rundir = self.workdir / f"socat-{index}"
        rundir.mkdir()
        out = rundir / "socat.out"
        port = free_port()
        recv_cmd = [self.socat or "socat", "-u", "-b", str(SOCAT_BLOCK), f"TCP-LISTEN:{port},reuseaddr,bind=127.0.0.1",
                    f"OPEN:{out},creat,trunc"]
        send_cmd = [self.socat or "socat", "-u", "-b", str(SOCAT_BLOCK), "-", f"TCP:127.0.0.1:{port}"]
        self.commands.setdefault("socat receiver", recv_cmd)
        self.commands.setdefault("socat sender", [*self.job, "|", *send_cmd])
        return self._piped("socat", index, rundir, out, ("sending socat", send_cmd),
                           server=("receiving socat", recv_cmd, port))

    def run_floor(self, index: int) -> Run:
        """The disk's floor: the job into a file through one pipe, then fdatasync (dd)."""
        rundir = self.workdir / f"floor-{index}"
        rundir.mkdir()
        out = rundir / "floor.out"
        dd_cmd = ["dd", f"of={out}", "bs=1M", "iflag=fullblock", "conv=fdatasync", "status=none"]
        self.commands.setdefault("disk floor", [*self.job, "|", *dd_cmd])
        return self._piped("floor", index, rundir, out, ("dd", dd_cmd))

    def _piped(self, path: str, index: int, rundir: Path, out: Path, consumer: tuple[str, list[str]],
               server: tuple[str, list[str], int] | None = None) -> Run:
        """One timed run of a baseline: the job piped into `consumer`, which
        writes `out` itself or sends to `server` (started first and waited
        for on its port). The receiver is the server, or the consumer."""
        procs: list[subprocess.Popen[bytes]] = []
        names: list[str] = []
        try:
            if server is not None:
                name, cmd, port = server
                recv = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
                procs.append(recv)
                names.append(name)
                wait_listening(recv, port, name)
            os.sync()
            time.sleep(0.2)
            t0 = time.monotonic()
            job = subprocess.Popen(self.job, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
            procs.append(job)
            names.append("job")
            sink = subprocess.Popen(consumer[1], stdin=job.stdout, start_new_session=True)
            procs.append(sink)
            names.append(consumer[0])
            assert job.stdout is not None
            job.stdout.close()
            for p in procs:
                self.rss.watch(p)
            deadline = self.deadline()
            last = names[0] if server is not None else consumer[0]  # (whose exit ends the run: waited first)
            order = sorted(zip(names, procs), key=lambda np: np[0] != last)
            waited = {name: wait_measured(p, deadline, self.rss) for name, p in order}
            for name, r in waited.items():
                if r.timed_out:
                    raise BenchError(f"{path} run {index}: {name} timed out after {self.args.timeout:.0f} s")
                if r.returncode != 0:
                    raise BenchError(f"{path} run {index}: {name} exited {r.returncode}")
            self.verify(out, f"{path} run {index}")
            receiver = waited[last]
            sender = waited[consumer[0]] if server is not None else None
            return Run(
                path=path, index=index, wall_s=receiver.end - t0, mb_s=self.size / (receiver.end - t0) / MB,
                sender_cpu_s=sender.rusage_cpu if sender else 0.0, receiver_cpu_s=receiver.rusage_cpu,
                sender_rss_mib=sender.peak_rss_kib / 1024 if sender else 0.0,
                receiver_rss_mib=receiver.peak_rss_kib / 1024, job_cpu_s=waited["job"].rusage_cpu,
            )
        finally:
            for p in procs:
                if p.returncode is None:
                    signal_tree(p, signal.SIGKILL)
                    p.wait(10)
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)


# -- reporting ---------------------------------------------------------------

SOCAT_BLOCK = 1 << 20  # socat -b: its largest transfer per read and write (issue 31's baseline)
PATHS = ("gcwrap", "socat", "floor")

FIGURES = [
    # key, label, per GiB?
    ("wall_s", "wall time (s)", False),
    ("mb_s", "throughput (MB/s, 10^6 B/s)", False),
    ("sender_cpu_s", "sender CPU-s/GiB (gcwrap | socat -)", True),
    ("receiver_cpu_s", "receiver CPU-s/GiB (gcshadow | socat LISTEN)", True),
    ("total_cpu_s", "sender+receiver CPU-s/GiB", True),
    ("sender_rss_mib", "sender peak RSS (MiB)", False),
    ("receiver_rss_mib", "receiver peak RSS (MiB)", False),
    ("job_cpu_s", "job (head) CPU-s/GiB, context", True),
]


def figure(run: Run, key: str, size: int, per_gib: bool) -> float:
    value = run.sender_cpu_s + run.receiver_cpu_s if key == "total_cpu_s" else getattr(run, key)
    return value / (size / GiB) if per_gib else value


def fmt(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def table(runs: list[Run], size: int) -> str:
    header = ["figure", "gcwrap median", "min", "max", "socat median", "min", "max", "gcwrap/socat"]
    rows = [header]
    for key, label, per_gib in FIGURES:
        row = [label]
        medians = []
        for path in ("gcwrap", "socat"):
            values = [figure(r, key, size, per_gib) for r in runs if r.path == path]
            med = statistics.median(values)
            medians.append(med)
            row += [fmt(med), fmt(min(values)), fmt(max(values))]
        row.append(f"{medians[0] / medians[1]:.2f}x" if medians[1] else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


TARGETS = {"mb_s": ">= 1.0x", "sender_cpu_s": "<= 1.2x", "receiver_cpu_s": "<= 1.0x"}  # (issue 31 raised them)
FLOOR_TARGET = ">= 0.85x"


def record(results: Results, bench: Bench, runs: list[Run], size: int) -> None:
    """Every run and every figure of the table, for the JSON."""
    for name, cmd in bench.commands.items():
        results.command(name, shlex.join(cmd).replace(shlex.quote("|"), "|"))
    for run in runs:
        results.run(**asdict(run))
    for key, label, per_gib in FIGURES:
        values = {path: [figure(r, key, size, per_gib) for r in runs if r.path == path] for path in ("gcwrap", "socat")}
        results.figure(f"bulk {size / MB:,.0f} MB: {label}", "", values["gcwrap"], values["socat"], "socat",
                       TARGETS.get(key, ""))
    floor = [r.mb_s for r in runs if r.path == "floor"]
    if floor:
        results.figure(f"bulk {size / MB:,.0f} MB: throughput vs the disk's floor",
                       "MB/s", [r.mb_s for r in runs if r.path == "gcwrap"], floor, "disk floor", FLOOR_TARGET)


def floor_line(runs: list[Run]) -> str:
    """The disk floor's throughput and gcwrap's against it, medians."""
    floor = [r.mb_s for r in runs if r.path == "floor"]
    ours = [r.mb_s for r in runs if r.path == "gcwrap"]
    if not floor or not ours:
        return ""
    f, g = statistics.median(floor), statistics.median(ours)
    return (f"disk floor (head | dd conv=fdatasync): {f:.1f} MB/s median ({min(floor):.1f}-{max(floor):.1f}); "
            f"gcwrap {g:.1f} MB/s = {g / f:.2f}x the floor (target {FLOOR_TARGET})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=10**9,
                        help="bytes the job writes (1GB = 10^9, 64MiB, ...; default 1GB)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each path, alternated (default 5)")
    parser.add_argument("--rate", type=parse_size, default=0,
                        help="the job writes at most this many bytes/s (a paced Python writer instead of head; "
                             "0: as fast as it can, the default)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds allowed per run (default: 60 + 1 s per 2 MB)")
    parser.add_argument("--tmpdir", type=Path, default=None,
                        help="where the source, spool, and landed files go (default: the system temp dir)")
    results_option(parser, "throughput")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (and the landed files)")
    parser.add_argument("--perf-stat", action="store_true",
                        help="count gcshadow's page faults, syncs, writes and reads in each timed gcwrap run "
                             "(perf stat -p; needs perf and tracepoint access); printed under each run")
    parser.add_argument("--profile", type=Path, default=None,
                        help="after the timed runs, one more gcwrap run under py-spy (gcshadow attached by pid, "
                             "gcwrap launched by it): raw stacks and summaries go to this directory; not timed")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.timeout is None:
        args.timeout = 60 + args.size / 2e6
    if not shutil.which("socat"):
        print("throughput: socat is not installed (apt-get install socat)", file=sys.stderr)
        return 2
    if not shutil.which("head"):
        print("throughput: head (coreutils) is not installed", file=sys.stderr)
        return 2

    install_signal_handlers()
    results = Results("throughput", args.json)
    print(header("throughput"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-", dir=args.tmpdir))
    bench = Bench(args, workdir)
    runs: list[Run] = []
    with guarded("throughput", workdir, args.keep, cleanup=bench.rss.close) as outcome:
        print(f"size: {args.size:,} bytes ({args.size / GiB:.3f} GiB); runs: {args.runs} of each; "
              f"timeout per run: {args.timeout:.0f} s; work dir: {workdir}", flush=True)
        bench.prepare()
        print(f"source: {bench.source} ({bench.source.stat().st_size:,} bytes, whole copies of a "
              f"{BLOCK >> 20} MiB random block); expected sha256 {bench.expected}")
        print(f"generator ceiling (job | cat > /dev/null): {bench.generator_ceiling():.0f} MB/s", flush=True)
        for i in range(1, args.runs + 1):
            for path in PATHS[(i - 1) % 3:] + PATHS[:(i - 1) % 3]:  # (each round starts with another path)
                run = (bench.run_gcwrap(i) if path == "gcwrap" else bench.run_socat(i) if path == "socat"
                       else bench.run_floor(i))
                runs.append(run)
                extra = ""
                if run.path == "gcwrap" and run.notes["spool_leftover"]:
                    extra = f"  (spool directory not empty: {run.notes['spool_leftover']})"
                print(f"run {i} {path:6}  {run.wall_s:8.2f} s  {run.mb_s:8.1f} MB/s  "
                      f"sender CPU {run.sender_cpu_s:6.2f} s  receiver CPU {run.receiver_cpu_s:6.2f} s  "
                      f"RSS {run.sender_rss_mib:6.1f} / {run.receiver_rss_mib:6.1f} MiB  sha256 OK{extra}",
                      flush=True)
                if run.notes.get("shadow_perf"):
                    print("        gcshadow (perf stat): " + ", ".join(
                        f"{k} {v:,.0f}" for k, v in run.notes["shadow_perf"].items()), flush=True)  # type: ignore[union-attr]
        print()
        print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        print("commands (first run):")
        for name, cmd in bench.commands.items():
            print(f"  {name}: {shlex.join(cmd).replace(shlex.quote('|'), '|')}")
        print()
        print(table(runs, args.size))
        print(floor_line(runs))
        record(results, bench, runs, args.size)
        print("\nCPU-s/GiB = CPU seconds (user+sys) per 2^30 bytes moved; ratio = gcwrap median / socat median.")
        if args.profile is not None:
            bench.run_gcwrap(args.runs + 1, profile=args.profile)
    if outcome.status == 0 and runs:
        results.write()
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
