#!/usr/bin/env python3
"""Several shadows on one root and one PostgreSQL state, against one shadow.

Four set-ups, run in a rotating order so that each sees the same machine:

    sqlite-1   one gcshadow, its embedded SQLite state (the default; the baseline)
    pg-1       one gcshadow, --state postgresql://...
    pg-2       two gcshadows on one root, one PostgreSQL state
    pg-3       three

In each, two workloads through real gcwrap agents that list every shadow
(`--shadow a,b,c`, each job meeting them in its own shuffled order):

    bulk       JOBS jobs at once, SIZE bytes each as fast as they can write
               (tests/jobs/genjob.py): aggregate throughput from the first
               spawn to the last exit (every byte durable at home), the
               shadows' CPU, and how many jobs each shadow carried
    small      SMALL jobs of 20 KB, PARALLEL at a time: jobs carried per second

Then the cost of the state per durable group, on one shadow each:

    ack        a raw protocol client sends a 100-byte DATA frame and waits
               for its ACK (the shadow fdatasyncs the file and records the
               durable length in its state before acknowledging), ACKS
               times, SQLite state against PostgreSQL state; and for
               context the bare PostgreSQL round trip of a one-row UPDATE
               committed (synchronous_commit on) from psycopg.

PostgreSQL is the throwaway cluster the tests use (tests/postgres/: the
operating system's package, on loopback, a fresh database per set-up).
Every landed file is checked by sha256; any failure fails the benchmark.

Usage:
  python benchmarks/shadows.py --jobs 6 --size 32MB --small 60 --parallel 12 --acks 300 --runs 2
"""

from __future__ import annotations

import argparse
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    MB,
    REPO,
    BenchError,
    Results,
    ShadowProc,
    fmt,
    free_port,
    guarded,
    header,
    install_signal_handlers,
    parse_size,
    percentile,
    render_table,
    results_option,
    sha256_file,
    summary,
    tools,
)

from gcwrap.wire.events import Ack, Data, Done, Error, Event, Exit, Hello, StreamSpec, Welcome
from gcwrap.wire.protocol import NEED_DATA, Connection, Role

GENJOB = REPO / "tests" / "jobs" / "genjob.py"
PG_SCRIPTS = REPO / "tests" / "postgres"
SETUPS = [("sqlite-1", 1, False), ("pg-1", 1, True), ("pg-2", 2, True), ("pg-3", 3, True)]


class Postgres:
    """The tests' throwaway PostgreSQL cluster, started and stopped by its scripts."""

    def __init__(self) -> None:
        # (Not under the work directory: as root the cluster belongs to the postgres user, who must reach it.)
        self.dir = Path(tempfile.gettempdir()) / f"gcwrap-bench-pg-{os.getpid()}"
        self.env = {**os.environ, "PG_DIR": str(self.dir)}
        port = free_port()
        proc = subprocess.run([str(PG_SCRIPTS / "start-postgres.sh"), str(port)], env=self.env, capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            raise BenchError(f"cannot start PostgreSQL (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
        self.url = proc.stdout.strip().splitlines()[-1]

    def database(self) -> str:
        import psycopg

        name = f"bench_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url.rsplit("/", 1)[0] + "/" + name

    def stop(self) -> None:
        subprocess.run([str(PG_SCRIPTS / "stop-postgres.sh")], env=self.env, timeout=120, check=False)


@dataclass
class Cluster:
    """`n` shadows on one root, with the state given (None: each its root's SQLite)."""

    workdir: Path
    n: int
    state: str | None
    shadows: list[ShadowProc] = field(default_factory=list)

    def __enter__(self) -> Cluster:
        self.root = self.workdir / "root"
        extra = ["--state", self.state] if self.state else []
        try:
            for i in range(self.n):
                self.shadows.append(ShadowProc(self.root, self.workdir / f"run{i}", extra, tag=str(i)))
            for s in self.shadows:
                s.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.shadows:
            s.stop()

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{s.port}" for s in self.shadows)

    def cpu(self) -> float:
        return sum(s.cpu() for s in self.shadows)

    def carried(self) -> list[int]:
        """Per shadow, the jobs it opened a session for (from its log)."""
        return [len(set(re.findall(r"job (\S+) session", s.log.read_text(errors="replace")))) for s in self.shadows]


def expected_sha(n: int, seed: int) -> str:
    import hashlib

    return hashlib.sha256(random.Random(seed).randbytes(n)).hexdigest()


def run_jobs(cluster: Cluster, spool: Path, jobs: list[tuple[str, int, int]], parallel: int,
             timeout: float) -> float:
    """Run (job id, bytes, seed) jobs through gcwrap, `parallel` at a time;
    the wall time; every file checked."""
    gcwrap, _ = tools()
    waiting = list(jobs)
    running: list[tuple[subprocess.Popen[bytes], str]] = []
    start = time.monotonic()
    deadline = start + timeout
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                job_id, size, seed = waiting.pop(0)
                cmd = [*gcwrap, "--shadow", cluster.addresses, "--spool", str(spool), "--job-id", job_id, "-q",
                       "--retry-limit", "3", "--stdout", f"{job_id}.out", "--", sys.executable, str(GENJOB),
                       "--out", str(size), "--seed", str(seed)]
                running.append((subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE), job_id))
            for proc, job_id in list(running):
                if proc.poll() is not None:
                    if proc.returncode != 0:
                        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                        raise BenchError(f"gcwrap for {job_id} exited {proc.returncode}: {err[-500:]}")
                    if proc.stderr:
                        proc.stderr.close()
                    running.remove((proc, job_id))
            if time.monotonic() > deadline:
                raise BenchError(f"the jobs did not finish within {timeout:.0f} s")
            time.sleep(0.005)
    finally:
        for proc, _ in running:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - start
    for job_id, size, seed in jobs:
        if sha256_file(cluster.root / f"{job_id}.out") != expected_sha(size, seed):
            raise BenchError(f"{job_id}: the landed file differs from what the job wrote")
    return wall


@dataclass
class Result:
    setup: str
    bulk_mb_s: float
    shadow_cpu_s_per_gb: float
    carried: list[int]
    small_jobs_s: float


def one_setup(workdir: Path, name: str, n: int, state: str | None, args: argparse.Namespace, run: int) -> Result:
    with Cluster(workdir, n, state) as cluster:
        bulk = [(f"bulk-{run}-{i}", args.size, 1000 * run + 2 * i) for i in range(args.jobs)]
        before = cluster.cpu()
        wall = run_jobs(cluster, workdir / "spool", bulk, len(bulk), args.timeout)
        cpu = cluster.cpu() - before
        total = args.size * args.jobs
        small = [(f"small-{run}-{i}", 20_000, 7 + i) for i in range(args.small)]
        small_wall = run_jobs(cluster, workdir / "spool", small, args.parallel, args.timeout)
        carried = cluster.carried()
    result = Result(name, total / wall / MB, cpu / (total / 1e9), carried, args.small / small_wall)
    print(f"run {run} {name}: bulk {fmt(result.bulk_mb_s)} MB/s aggregate ({args.jobs} x {args.size / MB:g} MB in "
          f"{wall:.2f} s), shadows' CPU {fmt(result.shadow_cpu_s_per_gb)} s/GB; small {fmt(result.small_jobs_s)} "
          f"jobs/s; jobs carried per shadow {carried}", flush=True)
    return result


class RawAgent:
    """A protocol client on a blocking socket: every ACK seen as it comes."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = Connection(Role.AGENT)

    def send(self, event: Event) -> None:
        self.sock.sendall(self.conn.send(event))

    def next(self) -> Event:
        while True:
            ev = self.conn.next_event()
            if ev is not NEED_DATA:
                assert isinstance(ev, Event)
                if isinstance(ev, Error):
                    raise BenchError(f"the shadow refused: {ev.message}")
                return ev
            data = self.sock.recv(65536)
            if not data:
                raise BenchError("the shadow closed the connection")
            self.conn.receive_data(data)


def ack_latencies(workdir: Path, state: str | None, count: int) -> list[float]:
    """Seconds from sending a 100-byte DATA frame to its ACK, `count` times in turn."""
    with Cluster(workdir, 1, state) as cluster:
        agent = RawAgent(cluster.shadows[0].port)
        try:
            agent.send(Hello(job_id="ack-latency", instance=uuid.uuid4().hex[:16],
                             streams=(StreamSpec(1, "stdout", "ack.out"),), host="bench"))
            if not isinstance(agent.next(), Welcome):
                raise BenchError("no WELCOME")
            out: list[float] = []
            offset = 0
            payload = b"x" * 99 + b"\n"
            for _ in range(count):
                t0 = time.perf_counter()
                agent.send(Data(1, offset, payload))
                offset += len(payload)
                while True:
                    ev = agent.next()
                    if isinstance(ev, Ack) and ev.offset >= offset:
                        break
                out.append(time.perf_counter() - t0)
            agent.send(Exit(code=0, signal=None, lengths=((1, offset),)))
            while not isinstance(agent.next(), Done):
                pass
        finally:
            agent.sock.close()
    return out


def pg_commit_latencies(url: str, count: int) -> list[float]:
    """A one-row UPDATE committed from psycopg: the bare round trip a durable group adds."""
    import psycopg

    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE bench_len (id int PRIMARY KEY, n bigint)")
        conn.execute("INSERT INTO bench_len VALUES (1, 0)")
        conn.commit()
        out = []
        for i in range(count):
            t0 = time.perf_counter()
            conn.execute("UPDATE bench_len SET n = %s WHERE id = 1", (i,))
            conn.commit()
            out.append(time.perf_counter() - t0)
    return out


def record_all(record: Results, results: list[Result], acks: dict[str, list[float]]) -> None:
    """Every set-up's figures against one shadow with its SQLite state, and the durable group's cost."""
    for r in results:
        record.run(**asdict(r))
    base = [r for r in results if r.setup == "sqlite-1"]
    for name, _, _ in SETUPS[1:]:
        mine = [r for r in results if r.setup == name]
        record.figure(f"several shadows, {name}: bulk MB/s", "MB/s", [r.bulk_mb_s for r in mine],
                      [r.bulk_mb_s for r in base], "sqlite-1", key=True)
        record.figure(f"several shadows, {name}: shadows' CPU-s per GB", "CPU-s/GB",
                      [r.shadow_cpu_s_per_gb for r in mine], [r.shadow_cpu_s_per_gb for r in base], "sqlite-1")
        record.figure(f"several shadows, {name}: small jobs/s", "jobs/s", [r.small_jobs_s for r in mine],
                      [r.small_jobs_s for r in base], "sqlite-1", key=name == "pg-3")
    record.figure("durable group, 100 B DATA -> ACK (ms, median = p50), PostgreSQL state", "ms",
                  [1000 * v for v in acks["PostgreSQL state"]], [1000 * v for v in acks["SQLite state"]],
                  "SQLite state", key=True)
    record.figure("bare PostgreSQL UPDATE + COMMIT from psycopg (ms, median = p50)", "ms",
                  [1000 * v for v in acks["bare PostgreSQL UPDATE + COMMIT"]])


def report(results: list[Result], acks: dict[str, list[float]], args: argparse.Namespace) -> None:
    rows = [["setup", "bulk MB/s (median, min-max)", "vs sqlite-1", "shadows' CPU s/GB", "small jobs/s",
             "vs sqlite-1", "jobs carried per shadow (last run)"]]
    base = {k: summary(r.bulk_mb_s for r in results if r.setup == "sqlite-1")[0] for k in ("bulk",)}
    base_small = summary(r.small_jobs_s for r in results if r.setup == "sqlite-1")[0]
    for name, _, _ in SETUPS:
        mine = [r for r in results if r.setup == name]
        med, lo, hi = summary(r.bulk_mb_s for r in mine)
        small = summary(r.small_jobs_s for r in mine)[0]
        rows.append([name, f"{fmt(med)} ({fmt(lo)}-{fmt(hi)})", f"{med / base['bulk']:.2f}x",
                     fmt(summary(r.shadow_cpu_s_per_gb for r in mine)[0]), fmt(small), f"{small / base_small:.2f}x",
                     " ".join(str(c) for c in mine[-1].carried)])
    print()
    print(render_table(rows))
    rows = [["durable group (100 B DATA -> ACK)", "p50 ms", "p90 ms", "p99 ms", "n"]]
    for name, values in acks.items():
        rows.append([name, *(fmt(1000 * percentile(values, p)) for p in (50, 90, 99)), str(len(values))])
    print()
    print(render_table(rows))
    pg, lite = percentile(acks["PostgreSQL state"], 50), percentile(acks["SQLite state"], 50)
    print(f"\nPostgreSQL's cost per durable group (p50 difference): {1000 * (pg - lite):.2f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=6, help="bulk jobs at once")
    p.add_argument("--size", type=parse_size, default=32 * MB, help="bytes per bulk job")
    p.add_argument("--small", type=int, default=60, help="small jobs (20 KB each)")
    p.add_argument("--parallel", type=int, default=12, help="small jobs at a time")
    p.add_argument("--acks", type=int, default=300, help="DATA -> ACK round trips per state")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--keep", action="store_true")
    results_option(p, "shadows")
    args = p.parse_args(argv)
    install_signal_handlers()
    record = Results("shadows", args.json)
    print(header("shadows"))
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-shadows-"))
    pg: Postgres | None = None

    def cleanup() -> None:
        if pg is not None:
            pg.stop()

    with guarded("shadows", workdir, args.keep, cleanup) as outcome:
        pg = Postgres()
        print(f"PostgreSQL: {subprocess.run(['postgres', '--version'], capture_output=True, text=True).stdout.strip()}"
              f" at {pg.url} (a fresh database per set-up)", flush=True)
        results: list[Result] = []
        for run in range(args.runs):
            order = SETUPS[run % len(SETUPS):] + SETUPS[: run % len(SETUPS)]  # (rotated: each sees the machine)
            for name, n, shared in order:
                where = workdir / f"{name}-{run}"
                results.append(one_setup(where, name, n, pg.database() if shared else None, args, run))
        acks = {"SQLite state": ack_latencies(workdir / "ack-sqlite", None, args.acks),
                "PostgreSQL state": ack_latencies(workdir / "ack-pg", pg.database(), args.acks),
                "bare PostgreSQL UPDATE + COMMIT": pg_commit_latencies(pg.database(), args.acks)}
        report(results, acks, args)
        record.command("gcshadow (each)", "gcshadow serve --port 0 --root ROOT --port-file F --min-free 0 "
                       "[--state postgresql://...]")
        record.command("gcwrap (each job)", "gcwrap --shadow 127.0.0.1:A,127.0.0.1:B --spool SPOOL --job-id ID -q "
                       "--retry-limit 3 --stdout ID.out -- python tests/jobs/genjob.py --out SIZE --seed SEED")
        record_all(record, results, acks)
        record.write()
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
