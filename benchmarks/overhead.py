#!/usr/bin/env python3
"""Overhead on the job: a CPU-bound job that writes 500 MB, unwrapped against wrapped by gcwrap.

The job (an inline Python script, below as JOB) computes a sha256 chain
(WORK hashes of a 32-byte digest per block) and writes its output in 64 KiB
blocks interleaved with the computing: each block carries the latest digest
in its first 32 bytes. It writes BLOCKS blocks (500 MB by default) and spends
most of its time computing: WORK is calibrated once per invocation so that the
compute alone takes about --target-seconds (default 15 s). The output is
deterministic.

Runs come in pairs, one of each; the order within a pair alternates (--order
abba, the default: pair 1 unwrapped first, pair 2 wrapped first, ...: U W W U
U W ...), or is drawn at random per pair (--order random, with --seed; the
seed is printed), so that neither always runs first (after a pause, with a
cooler page cache or a quieter neighbour):

  unwrapped  python -c JOB BLOCKS WORK > FILE            (a local file on the same file system)
  wrapped    gcshadow serve --port 0 --root HOME --port-file F --min-free 0      (started before the clock)
             gcwrap --shadow 127.0.0.1:PORT --stdout overhead.out --spool SPOOL --job-id ID -- python -c JOB BLOCKS WORK

Wall time is from spawn to exit: for the wrapped job that is until gcwrap
exits, i.e. every byte acknowledged (durable at home), gcwrap's start-up
included. The job also reports its own run time (first line to last write, on
stderr); its ratio shows how much the job itself is slowed down. Every output
must have the same sha256 as the first run's, else the benchmark fails.
Before every run: sync(), 0.2 s pause. The wall ratio of each pair is also
given by which of the two ran first, to show an order effect if there is one.

Usage:
  python benchmarks/overhead.py --runs 5
  python benchmarks/overhead.py --runs 6 --order random --seed 17
  python benchmarks/overhead.py --runs 1 --size 50MB --target-seconds 2     # smoke
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    MB,
    BenchError,
    GiB,
    Results,
    ShadowProc,
    fmt,
    guarded,
    header,
    install_signal_handlers,
    parse_size,
    render_table,
    results_option,
    sha256_file,
    signal_tree,
    summary,
    tools,
    wait_measured,
)

BLOCK = 64 << 10
OUT_NAME = "overhead.out"

JOB = r"""
import hashlib, os, sys, time
blocks, work = int(sys.argv[1]), int(sys.argv[2])
t0 = time.monotonic()
sha = hashlib.sha256
h = sha(b"gcwrap-overhead").digest()
block = bytearray(h * 2048)
view = memoryview(block)
write = os.write
for i in range(blocks):
    for _ in range(work):
        h = sha(h).digest()
    block[0:32] = h
    out = view
    while out:
        out = out[write(1, out):]
sys.stderr.write("job-seconds %.6f\n" % (time.monotonic() - t0))
"""


def calibrate(target: float, blocks: int) -> int:
    """Hashes per block so that the job's compute takes about `target` seconds here, now."""
    sha = hashlib.sha256
    h = b"x" * 32
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        h = sha(h).digest()
    per_hash = (time.perf_counter() - t0) / n
    return max(1, round(target / blocks / per_hash))


@dataclass
class Run:
    path: str
    index: int
    wall_s: float
    job_s: float
    wrapper_cpu_s: float = 0.0
    shadow_cpu_s: float = 0.0
    job_cpu_s: float = 0.0
    first: bool = False  # ran first in its pair


def job_seconds(stderr: str) -> float:
    m = re.search(r"job-seconds ([0-9.]+)", stderr)
    if not m:
        raise BenchError(f"the job did not report its run time; stderr: {stderr[-2000:]}")
    return float(m.group(1))


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path, work: int) -> None:
        self.args = args
        self.workdir = workdir
        self.blocks = -(-args.size // BLOCK)
        self.size = self.blocks * BLOCK
        self.work = work
        self.gcwrap, _ = tools()
        self.expected = ""
        self.commands: dict[str, str] = {}

    @property
    def job(self) -> list[str]:
        return [sys.executable, "-c", JOB, str(self.blocks), str(self.work)]

    def deadline(self) -> float:
        return time.monotonic() + self.args.timeout

    def verify(self, path: Path, what: str) -> None:
        size = path.stat().st_size if path.exists() else -1
        if size != self.size:
            raise BenchError(f"{what}: {path} holds {size} bytes, expected {self.size}")
        digest = sha256_file(path)
        if not self.expected:
            self.expected = digest
        elif digest != self.expected:
            raise BenchError(f"{what}: sha256 {digest} differs from the first run's {self.expected}")

    def run_unwrapped(self, index: int) -> Run:
        rundir = self.workdir / f"plain-{index}"
        rundir.mkdir()
        out, err = rundir / "out", rundir / "err"
        self.commands.setdefault("unwrapped", shlex.join(self.job).replace(shlex.quote(JOB), "JOB") + " > FILE")
        try:
            os.sync()
            time.sleep(0.2)
            with open(out, "wb") as fo, open(err, "wb") as fe:
                t0 = time.monotonic()
                proc = subprocess.Popen(self.job, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                        start_new_session=True)
            r = wait_measured(proc, self.deadline())
            wall = r.end - t0
            if r.timed_out or r.returncode != 0:
                raise BenchError(f"unwrapped run {index}: exit {r.returncode}, timed out {r.timed_out}")
            self.verify(out, f"unwrapped run {index}")
            return Run("unwrapped", index, wall, job_seconds(err.read_text()), job_cpu_s=r.rusage_cpu)
        finally:
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    def run_wrapped(self, index: int) -> Run:
        rundir = self.workdir / f"gcwrap-{index}"
        home, spool = rundir / "home", rundir / "spool"
        shadow = ShadowProc(home, rundir)
        wrapper: subprocess.Popen[bytes] | None = None
        try:
            port = shadow.wait_ready()
            cmd = [*self.gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", OUT_NAME, "--spool", str(spool),
                   "--job-id", f"overhead-{os.getpid()}-{index}", "--", *self.job]
            self.commands.setdefault("gcshadow", shlex.join(shadow.cmd))
            self.commands.setdefault("wrapped", shlex.join(cmd).replace(shlex.quote(JOB), "JOB"))
            os.sync()
            time.sleep(0.2)
            shadow0 = shadow.cpu()
            log = rundir / "gcwrap.log"
            with open(log, "wb") as err:
                t0 = time.monotonic()
                wrapper = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                           start_new_session=True)
            r = wait_measured(wrapper, self.deadline())
            wall = r.end - t0
            time.sleep(0.25)
            shadow_cpu = shadow.cpu() - shadow0
            text = log.read_text(errors="replace")
            if r.timed_out or r.returncode != 0:
                raise BenchError(f"wrapped run {index}: exit {r.returncode}, timed out {r.timed_out}\n{text[-2000:]}")
            self.verify(home / OUT_NAME, f"wrapped run {index}")
            return Run("wrapped", index, wall, job_seconds(text), wrapper_cpu_s=r.own_cpu or 0.0,
                       shadow_cpu_s=shadow_cpu, job_cpu_s=r.children_cpu or 0.0)
        finally:
            if wrapper is not None and wrapper.returncode is None:
                signal_tree(wrapper, 9)
                wrapper.wait(10)
            shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=500 * MB, help="bytes the job writes (default 500MB)")
    parser.add_argument("--target-seconds", type=float, default=15.0,
                        help="compute time of the job the calibration aims at (default 15)")
    parser.add_argument("--work", type=int, default=None, help="hashes per block (default: calibrated)")
    parser.add_argument("--runs", type=int, default=5, help="pairs of runs, one of each (default 5)")
    parser.add_argument("--order", choices=("abba", "random"), default="abba",
                        help="order within each pair: abba (alternating, the default) or random (--seed)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of --order random (default: drawn from the clock, and printed)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default 120 + 10 x target)")
    parser.add_argument("--tmpdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    results_option(parser, "overhead")
    args = parser.parse_args(argv)
    if args.timeout is None:
        args.timeout = 120 + 10 * args.target_seconds
    install_signal_handlers()
    record = Results("overhead", args.json)
    print(header("overhead"), flush=True)
    blocks = -(-args.size // BLOCK)
    work = args.work or calibrate(args.target_seconds, blocks)
    if args.order == "random" and args.seed is None:
        args.seed = int(time.time() * 1000) % 1_000_000
    print("order within each pair: " + ("ABBA (pair i runs unwrapped first when i is odd)" if args.order == "abba"
                                         else f"random, --seed {args.seed}"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-overhead-", dir=args.tmpdir))
    bench = Bench(args, workdir, work)
    runs: list[Run] = []
    with guarded("overhead", workdir, args.keep) as outcome:
        print(f"job: {bench.blocks} blocks of 64 KiB = {bench.size:,} bytes; {work} sha256 per block "
              f"({'calibrated for ~' + str(args.target_seconds) + ' s of compute' if not args.work else '--work'}); "
              f"runs: {args.runs} of each; work dir {workdir}", flush=True)
        orders = pair_orders(args.runs, args.order, args.seed)
        for i, order in enumerate(orders, 1):
            for k, path in enumerate(order):
                run = bench.run_unwrapped(i) if path == "unwrapped" else bench.run_wrapped(i)
                run.first = k == 0
                runs.append(run)
                record.run(**asdict(run))
                extra = (f"  gcwrap CPU {run.wrapper_cpu_s:5.2f} s  gcshadow CPU {run.shadow_cpu_s:5.2f} s"
                         if path == "wrapped" else "")
                print(f"run {i}{'ab'[k]} {path:9}  wall {run.wall_s:7.2f} s  job's own time {run.job_s:7.2f} s  "
                      f"job CPU {run.job_cpu_s:6.2f} s{extra}  sha256 OK", flush=True)
        print()
        print("commands (first run):")
        for name, cmd in bench.commands.items():
            print(f"  {name}: {cmd}")
        print(f"  JOB = {JOB.strip()!r}")
        print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))

        def vals(path: str, key: str) -> list[float]:
            return [getattr(r, key) for r in runs if r.path == path]

        rows = [["figure", "unwrapped median", "min", "max", "wrapped median", "min", "max", "wrapped/unwrapped"]]
        for key, label in (("wall_s", "wall time (s)"), ("job_s", "job's own run time (s)"),
                           ("job_cpu_s", "job CPU (s)")):
            u, w = summary(vals("unwrapped", key)), summary(vals("wrapped", key))
            rows.append([label, fmt(u[0]), fmt(u[1]), fmt(u[2]), fmt(w[0]), fmt(w[1]), fmt(w[2]),
                         f"{w[0] / u[0]:.3f}x"])
        for key, label in (("wrapper_cpu_s", "gcwrap's own CPU (s)"), ("shadow_cpu_s", "gcshadow CPU (s)")):
            w = summary(vals("wrapped", key))
            rows.append([label, "-", "-", "-", fmt(w[0]), fmt(w[1]), fmt(w[2]),
                         f"{w[0] / (bench.size / GiB):.2f} CPU-s/GiB"])
        pairs = list(zip(vals_runs(runs, "unwrapped"), vals_runs(runs, "wrapped")))
        p = summary(w.wall_s / u.wall_s for u, w in pairs)
        rows.append(["wall ratio of each pair (run i)", "", "", "", fmt(p[0]), fmt(p[1]), fmt(p[2]), ""])
        for label, first in (("... pairs run unwrapped first", "unwrapped"),
                             ("... pairs run wrapped first", "wrapped")):
            sel = [w.wall_s / u.wall_s for u, w in pairs if (u.first if first == "unwrapped" else w.first)]
            q = summary(sel)
            rows.append([f"{label} ({len(sel)})", "", "", "", fmt(q[0]), fmt(q[1]), fmt(q[2]), ""])
        print(render_table(rows))
        ratio = summary(vals("wrapped", "wall_s"))[0] / summary(vals("unwrapped", "wall_s"))[0]
        print(f"\noverhead on the job (wall, median wrapped / median unwrapped): {ratio:.3f}x "
              f"(target <= 1.05x: {'met' if ratio <= 1.05 else 'NOT met'})")
        for name, cmd in bench.commands.items():
            record.command(name, cmd)
        record.command("JOB", JOB.strip())
        mb = f"{bench.size / MB:,.0f} MB"
        record.figure(f"overhead, CPU-bound job writing {mb}: wall time (s)", "s", vals("wrapped", "wall_s"),
                      vals("unwrapped", "wall_s"), "unwrapped", "<= 1.05x")
        record.figure(f"overhead, CPU-bound job writing {mb}: the job's own run time (s)", "s",
                      vals("wrapped", "job_s"), vals("unwrapped", "job_s"), "unwrapped")
        record.figure(f"overhead, CPU-bound job writing {mb}: gcwrap's own CPU-s per GiB", "CPU-s/GiB",
                      [c / (bench.size / GiB) for c in vals("wrapped", "wrapper_cpu_s")], key=True)
        record.write()
    return outcome.status


def pair_orders(pairs: int, order: str, seed: int | None) -> list[tuple[str, str]]:
    """The order of the two runs of each pair: ABBA (unwrapped first in odd pairs), or drawn with `seed`."""
    if order == "abba":
        return [("unwrapped", "wrapped") if i % 2 else ("wrapped", "unwrapped") for i in range(1, pairs + 1)]
    rng = random.Random(seed)
    return [("unwrapped", "wrapped") if rng.random() < 0.5 else ("wrapped", "unwrapped") for _ in range(pairs)]


def vals_runs(runs: list[Run], path: str) -> list[Run]:
    return sorted((r for r in runs if r.path == path), key=lambda r: r.index)


if __name__ == "__main__":
    sys.exit(main())
