#!/usr/bin/env python3
"""Spool size: the spool on disk stays bounded by the unacknowledged output during a long run.

Two scenarios, each run --runs times:

  flat     A job writes --size bytes (5 GB by default) to stdout as fast as gcwrap takes them:
             gcshadow serve --port 0 --root HOME --port-file F --min-free 0
             gcwrap --shadow 127.0.0.1:PORT --stdout spool.out --spool SPOOL --job-id ID -- python -c JOB SIZE 0
           The spool holds what is not acknowledged yet: when the job writes faster than the
           shadow acknowledges, that backlog (and the spool) grows; its largest size is compared
           with the bytes streamed and with the backlog gcwrap reports in its live status file.
  paced    As flat, but the job writes at --paced-rate (50 MB/s), below what delivery sustains here.
  outage   A job writes --outage-size bytes (1 GB) at --outage-rate (50 MB/s). --outage-at seconds
           (5) after gcwrap starts, the shadow is stopped (SIGTERM by pid); --outage-seconds (5)
           later a new shadow starts on the same port and root. The spool grows by the backlog
           (about the rate times the time no shadow took bytes) and must shrink back once the
           backlog is delivered.

A thread samples every --interval seconds (0.5) the spool directory: the
database (*.spool), its WAL (*.spool-wal) and shared memory (*.spool-shm),
and the segment files (*.spool.seg/*) where newer gcwrap versions keep the
bytes, as allocated on disk (st_blocks x 512) and as apparent size, plus
gcwrap's other files there (ballast, live status), and the length of the
landed file. "spool size" below is db + wal + shm + segments, allocated.

The job's bytes are SIZE bytes of a 64 MiB block from random.Random(SEED)
repeated; the landed file is compared with them byte for byte after each run
(a mismatch, a non-zero exit or a timeout fails the benchmark). The shadow(s)
are stopped by pid in a finally.

Usage:
  python benchmarks/spool_size.py                          # 5 GB flat + outage, 5 runs each
  python benchmarks/spool_size.py --size 300MB --runs 1 --outage-size 200MB   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    MB,
    BenchError,
    Results,
    ShadowProc,
    fmt,
    guarded,
    header,
    install_signal_handlers,
    parse_size,
    render_table,
    results_option,
    signal_tree,
    summary,
    tools,
    wait_measured,
)

BLOCK = 64 << 20
SEED = 20261121
OUT_NAME = "spool.out"
MiB = 1 << 20

JOB = r"""
import os, random, sys, time
size, rate = int(sys.argv[1]), float(sys.argv[2])
block = memoryview(random.Random(int(sys.argv[3])).randbytes(64 << 20))
step = 1 << 20
t0 = time.monotonic()
done = 0
while done < size:
    if rate > 0:
        delay = t0 + done / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    start = done % len(block)
    piece = block[start:start + min(step, size - done, len(block) - start)]
    while piece:
        n = os.write(1, piece)
        piece = piece[n:]
        done += n
"""


@dataclass
class Sample:
    t: float  # seconds since gcwrap was spawned
    db: int  # allocated bytes: database, WAL, shared memory, segment files (SPOOL.seg/*)
    wal: int
    shm: int
    seg: int
    apparent: int  # st_size of db + wal + shm + segments
    other: int  # allocated bytes of gcwrap's other files in the spool directory (ballast, live status)
    landed: int  # length of the landed file at home
    backlog: int | None = None  # written - acked, from gcwrap's live status file (SPOOL.live, every 0.5 s)

    @property
    def spool(self) -> int:
        return self.db + self.wal + self.shm + self.seg


class Sampler(threading.Thread):
    def __init__(self, spool_dir: Path, landed: Path, interval: float, t0: float) -> None:
        super().__init__(daemon=True)
        self.spool_dir = spool_dir
        self.landed = landed
        self.interval = interval
        self.t0 = t0
        self.samples: list[Sample] = []
        self.stopping = threading.Event()

    def sample(self) -> Sample:
        db = wal = shm = seg = apparent = other = 0
        backlog: int | None = None
        try:
            entries = list(os.scandir(self.spool_dir))
        except FileNotFoundError:
            entries = []
        for e in entries:
            if e.name.endswith(".spool.seg") and e.is_dir(follow_symlinks=False):
                # gcwrap may keep a spool's bytes in segment files beside the database
                try:
                    segs = list(os.scandir(e.path))
                except FileNotFoundError:
                    segs = []
                for f in segs:
                    try:
                        st = f.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    seg += st.st_blocks * 512
                    apparent += st.st_size
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            alloc = st.st_blocks * 512
            if e.name.endswith(".spool.live"):
                backlog = self._backlog(e.path)
            if e.name.endswith(".spool"):
                db += alloc
                apparent += st.st_size
            elif e.name.endswith(".spool-wal"):
                wal += alloc
                apparent += st.st_size
            elif e.name.endswith(".spool-shm"):
                shm += alloc
                apparent += st.st_size
            else:
                other += alloc
        try:
            landed = self.landed.stat().st_size
        except FileNotFoundError:
            landed = 0
        return Sample(time.monotonic() - self.t0, db, wal, shm, seg, apparent, other, landed, backlog)

    @staticmethod
    def _backlog(path: str) -> int | None:
        """Bytes the job wrote that the shadow has not acknowledged, as gcwrap last reported them."""
        try:
            with open(path, "rb") as f:
                live = json.loads(f.read().strip(b" \0") or b"{}")
            return sum(int(st["written"]) - int(st["acked"]) for st in live.get("streams", {}).values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def run(self) -> None:
        next_t = time.monotonic()
        while not self.stopping.is_set():
            self.samples.append(self.sample())
            next_t += self.interval
            self.stopping.wait(max(0.0, next_t - time.monotonic()))


@dataclass
class Result:
    scenario: str
    index: int
    size: int
    wall_s: float
    samples: list[Sample]
    events: dict[str, float] = field(default_factory=dict)  # outage: stop/restart times (s since spawn)

    @property
    def mb_s(self) -> float:
        return self.size / self.wall_s / MB

    def streaming(self) -> list[Sample]:
        """Samples taken while bytes were still on their way (not the start-up or the end)."""
        return [s for s in self.samples if 0 < s.landed < self.size]


def check_landed(path: Path, size: int, block: bytes, what: str) -> None:
    """The landed file must be exactly `size` bytes of `block` repeated."""
    got = path.stat().st_size if path.exists() else -1
    if got != size:
        raise BenchError(f"{what}: {path} holds {got} bytes, expected {size}")
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        offset = 0
        while offset < size:
            n = min(len(block), size - offset)
            data = f.read(n)
            if data != view[:n]:
                raise BenchError(f"{what}: bytes differ in the {len(block) >> 20} MiB block at offset {offset}")
            offset += n


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.gcwrap, _ = tools()
        self.block = random.Random(SEED).randbytes(BLOCK)
        self.commands: dict[str, str] = {}

    def job(self, size: int, rate: float) -> list[str]:
        return [sys.executable, "-c", JOB, str(size), repr(rate), str(SEED)]

    def run(self, scenario: str, index: int) -> Result:
        outage = scenario == "outage"
        size = self.args.outage_size if outage else self.args.size
        rate = {"outage": self.args.outage_rate, "paced": self.args.paced_rate}.get(scenario, 0.0)
        rundir = self.workdir / f"{scenario}-{index}"
        home, spool = rundir / "home", rundir / "spool"
        shadows = [ShadowProc(home, rundir)]
        wrapper: subprocess.Popen[bytes] | None = None
        sampler: Sampler | None = None
        events: dict[str, float] = {}
        try:
            port = shadows[0].wait_ready()
            cmd = [*self.gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", OUT_NAME, "--spool", str(spool),
                   "--job-id", f"spool-{os.getpid()}-{scenario}-{index}", "--", *self.job(size, rate)]
            self.commands.setdefault("gcshadow", shlex.join(shadows[0].cmd))
            self.commands.setdefault(f"gcwrap ({scenario})", shlex.join(cmd).replace(shlex.quote(JOB), "JOB"))
            timeout = 120 + size / min(20e6, rate or 20e6) * 1.5 + (self.args.outage_seconds if outage else 0)
            os.sync()
            time.sleep(0.2)
            log = rundir / "gcwrap.log"
            with open(log, "wb") as err:
                t0 = time.monotonic()
                wrapper = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                           start_new_session=True)
            sampler = Sampler(spool, home / OUT_NAME, self.args.interval, t0)
            sampler.start()
            if outage:
                stop_at = t0 + self.args.outage_at
                while time.monotonic() < stop_at and wrapper.poll() is None:
                    time.sleep(0.05)
                if wrapper.poll() is not None:
                    raise BenchError("the job ended before the outage began: use a larger --outage-size")
                events["shadow stopped"] = time.monotonic() - t0
                shadows[0].stop()
                time.sleep(self.args.outage_seconds)
                shadows.append(ShadowProc(home, rundir, port=port, tag="-2"))
                shadows[-1].wait_ready()
                events["shadow restarted"] = time.monotonic() - t0
                self.commands.setdefault("gcshadow (restart)", shlex.join(shadows[-1].cmd))
            r = wait_measured(wrapper, t0 + timeout)
            wall = r.end - t0
            sampler.stopping.set()
            sampler.join(5)
            text = log.read_text(errors="replace")
            if r.timed_out or r.returncode != 0:
                raise BenchError(f"{scenario} run {index}: gcwrap exit {r.returncode}, timed out {r.timed_out}\n"
                                 f"{text[-2000:]}")
            check_landed(home / OUT_NAME, size, self.block, f"{scenario} run {index}")
            if outage:
                first = next((s.t for s in sampler.samples
                              if s.t > events["shadow restarted"] and s.landed > max(
                                  (x.landed for x in sampler.samples if x.t <= events["shadow restarted"]), default=0)),
                             float("nan"))
                events["landed file grows again"] = first
            return Result(scenario, index, size, wall, sampler.samples, events)
        finally:
            if sampler is not None:
                sampler.stopping.set()
            if wrapper is not None and wrapper.returncode is None:
                signal_tree(wrapper, 9)
                wrapper.wait(10)
            for shadow in shadows:
                shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)


def timeline(result: Result, rows: int = 24) -> str:
    samples = result.samples
    step = max(1, len(samples) // rows)
    picked = samples[::step]
    if samples and picked[-1] is not samples[-1]:
        picked.append(samples[-1])
    table = [["t (s)", "landed (MB)", "backlog (MiB)", "spool (MiB)", "db", "wal", "shm", "segments",
              "apparent (MiB)", "other (KiB)"]]
    for s in picked:
        table.append([f"{s.t:.1f}", f"{s.landed / MB:.0f}", "-" if s.backlog is None else f"{s.backlog / MiB:.1f}",
                      f"{s.spool / MiB:.1f}", f"{s.db / MiB:.1f}",
                      f"{s.wal / MiB:.1f}", f"{s.shm / MiB:.2f}", f"{s.seg / MiB:.1f}", f"{s.apparent / MiB:.1f}",
                      f"{s.other / 1024:.0f}"])
    return render_table(table)


SPOOL_KEY = {"spool size: max over the run (MiB)", "spool - backlog: max over samples (MiB)",
             "min spool after the peak (MiB)"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=5 * 10**9, help="bytes of the flat run (default 5GB)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each scenario (default 5)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default 0.5)")
    parser.add_argument("--outage-size", type=parse_size, default=10**9, help="bytes of the outage run (1GB)")
    parser.add_argument("--outage-rate", type=parse_size, default=50 * MB, help="job's rate in the outage run, "
                        "bytes/s (default 50MB)")
    parser.add_argument("--outage-at", type=float, default=5.0, help="seconds after spawn the shadow stops (5)")
    parser.add_argument("--outage-seconds", type=float, default=5.0, help="seconds without a shadow (5)")
    parser.add_argument("--paced-rate", type=parse_size, default=50 * MB,
                        help="job's rate in the paced run, bytes/s (default 50MB): --size bytes at this rate")
    parser.add_argument("--scenarios", default="flat,outage,paced",
                        help="comma-separated: flat (full speed), outage, paced (default: all three)")
    parser.add_argument("--tmpdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    results_option(parser, "spool_size")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    install_signal_handlers()
    record = Results("spool_size", args.json)
    print(header("spool_size"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-spool-", dir=args.tmpdir))
    free = shutil.disk_usage(workdir).free
    need = max(args.size, args.outage_size) * 1.2
    results: list[Result] = []
    with guarded("spool_size", workdir, args.keep) as outcome:
        if free < need:
            raise BenchError(f"{free / 1e9:.1f} GB free in {workdir}, about {need / 1e9:.1f} GB needed")
        bench = Bench(args, workdir)
        print(f"flat: {args.size:,} bytes at full speed; outage: {args.outage_size:,} bytes at "
              f"{args.outage_rate / MB:g} MB/s, shadow down from t={args.outage_at:g} s for {args.outage_seconds:g} s; "
              f"{args.runs} run(s) each; sample every {args.interval:g} s; work dir {workdir}", flush=True)
        for i in range(1, args.runs + 1):
            for scenario in scenarios:
                res = bench.run(scenario, i)
                results.append(res)
                record.run(scenario=scenario, index=i, size=res.size, wall_s=res.wall_s, mb_s=res.mb_s,
                           events=res.events, spool_max=max(s.spool for s in res.samples),
                           samples=len(res.samples))
                sp = [s.spool for s in res.streaming()] or [s.spool for s in res.samples]
                ev = "".join(f"; {k} at {v:.1f} s" for k, v in res.events.items())
                print(f"run {i} {scenario:6}  {res.wall_s:7.1f} s  {res.mb_s:6.1f} MB/s  {len(res.samples)} samples  "
                      f"spool min/median/max {min(sp) / MiB:.1f}/{statistics.median(sp) / MiB:.1f}/"
                      f"{max(sp) / MiB:.1f} MiB{ev}  bytes OK", flush=True)
        print()
        print("commands (first run):")
        for name, cmd in bench.commands.items():
            print(f"  {name}: {cmd}")
        print(f"  JOB = {JOB.strip()!r}")
        for name, cmd in bench.commands.items():
            record.command(name, cmd)
        record.command("JOB", JOB.strip())
        print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))

        for scenario in scenarios:
            rs = [r for r in results if r.scenario == scenario]
            if not rs:
                continue
            print(f"\n== {scenario} ({len(rs)} runs of {rs[0].size:,} bytes) ==")
            rows = [["figure", "median", "min", "max"]]

            def add(label: str, values: list[float], scale: float = 1.0, rows: list[list[str]] = rows,
                    scenario: str = scenario, size: int = rs[0].size) -> None:
                m = summary(v / scale for v in values)
                record.figure(f"spool, {scenario} {size / MB:,.0f} MB: {label.strip()}", "",
                              [v / scale for v in values], key=label in SPOOL_KEY)
                rows.append([label, fmt(m[0]), fmt(m[1]), fmt(m[2])])

            add("throughput (MB/s)", [r.mb_s for r in rs])
            add("wall time (s)", [r.wall_s for r in rs])
            add("samples per run", [len(r.samples) for r in rs])
            add("spool size while streaming: min (MiB)", [min(s.spool for s in r.streaming() or r.samples) for r in rs],
                MiB)
            add("spool size while streaming: median (MiB)",
                [statistics.median(s.spool for s in r.streaming() or r.samples) for r in rs], MiB)
            add("spool size: max over the run (MiB)", [max(s.spool for s in r.samples) for r in rs], MiB)
            add("  of which WAL at that moment (MiB)", [max(r.samples, key=lambda s: s.spool).wal for r in rs], MiB)
            add("  of which segment files at that moment (MiB)",
                [max(r.samples, key=lambda s: s.spool).seg for r in rs], MiB)
            add("max spool size / bytes streamed (%)", [100 * max(s.spool for s in r.samples) / r.size for r in rs])
            add("other spool-dir files: max (KiB)", [max(s.other for s in r.samples) for r in rs], 1024)
            add("backlog (written - acked): max (MiB)",
                [max((s.backlog for s in r.samples if s.backlog is not None), default=float("nan")) for r in rs], MiB)
            add("spool - backlog: max over samples (MiB)",
                [max((s.spool - s.backlog for s in r.samples if s.backlog is not None), default=float("nan"))
                 for r in rs], MiB)
            add("spool size in the last sample (MiB)", [r.samples[-1].spool for r in rs], MiB)
            if scenario == "outage":
                def before(r: Result) -> list[Sample]:
                    return [s for s in r.samples if s.landed > 0 and s.t < r.events["shadow stopped"]]

                def after(r: Result) -> list[Sample]:
                    peak_t = max(r.samples, key=lambda s: s.spool).t
                    return [s for s in r.samples if s.t > peak_t]

                add("median spool before the outage (MiB)",
                    [statistics.median(s.spool for s in before(r)) if before(r) else float("nan") for r in rs], MiB)
                add("peak spool after the outage began (MiB)",
                    [max((s.spool for s in r.samples if s.t >= r.events["shadow stopped"]), default=0) for r in rs],
                    MiB)
                add("backlog: job rate x (landed file grows again - stop) (MB)",
                    [args.outage_rate * (r.events["landed file grows again"] - r.events["shadow stopped"]) for r in rs],
                    MB)
                add("seconds from restart until the landed file grows",
                    [r.events["landed file grows again"] - r.events["shadow restarted"] for r in rs])
                add("min spool after the peak (MiB)", [min((s.spool for s in after(r)), default=0) for r in rs], MiB)
            print(render_table(rows))
            best = min(rs, key=lambda r: r.index)
            print(f"\ntimeline of {scenario} run {best.index}"
                  + "".join(f"; {k} at t={v:.1f} s" for k, v in best.events.items()) + ":")
            print(timeline(best))
        record.write()
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
