#!/usr/bin/env python3
"""Does the web view slow the shadow? Ack latency with and without 100 open job pages.

Each run measures two conditions, in alternating order (run 1: without, with;
run 2: with, without; ...), each on a fresh gcshadow and root:

  both     gcshadow serve --port 0 --root HOME --port-file F --min-free 0
           JOBS background jobs stream lines through real gcwraps, for the whole measurement:
           gcwrap --shadow 127.0.0.1:PORT --stdout bg-K.out --stderr bg-K.err --job-id bg-K -- python -c BG_JOB
           and the probe: latency.py's protocol client (HELLO, DATA frames of timestamped lines at RATE
           lines/s, EXIT) measures send -> durable ACK for every line: the shadow's own ack latency.
  with     gcshadow web --root HOME --port 0 --port-file F2 (a process of its own), and CLIENTS event
           streams open on the background jobs' pages (/api/jobs/bg-K/events, spread evenly), held by a
           client process of its own (this script with --sse-clients) that counts what arrives. Every
           client must receive output events during the measurement, else the run fails.
  without  neither.

The figure is the ack latency's p99 (and p50, max) per run; the table gives
the medians over runs, their min-max, and the ratio with/without of the
medians. CPU seconds of the shadow and of the web view during the probe are
printed too.

Usage:
  python benchmarks/web_load.py --runs 5
  python benchmarks/web_load.py --runs 1 --seconds 3      # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    BenchError,
    Results,
    ShadowProc,
    guarded,
    header,
    install_signal_handlers,
    percentile,
    proc_times,
    raise_nofile,
    render_table,
    results_option,
    signal_tree,
    stop,
    summary,
    tools,
    wait_for_port_file,
)
from latency import protocol_client

BG_JOB = r"""
import sys, time
rate, seconds, k = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
t0, i = time.monotonic(), 0
while time.monotonic() - t0 < seconds:
    due = t0 + i / rate
    if due > time.monotonic():
        time.sleep(due - time.monotonic())
    print(f"job {k} line {i:08d}: the quick brown fox jumps over the lazy dog", flush=True)
    if i % 10 == 0:
        print(f"job {k} progress {i}", file=sys.stderr, flush=True)
    i += 1
"""


# -- the client process: CLIENTS event streams, counted -----------------------------------


async def sse_clients(port: int, job_ids: list[str], clients: int, seconds: float) -> dict[str, object]:
    import trio

    received = [0] * clients
    data_events = [0] * clients
    connected = 0
    ready = trio.Event()

    async def one(i: int) -> None:
        nonlocal connected
        job = job_ids[i % len(job_ids)]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(f"GET /api/jobs/{job}/events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                                  "Accept: text/event-stream\r\n\r\n".encode())
            first = await stream.receive_some(65536)
            if b" 200 " not in first.split(b"\r\n", 1)[0]:
                raise RuntimeError(f"client {i}: {first[:200]!r}")
            connected += 1
            if connected == clients:
                ready.set()
            data = first
            while True:
                received[i] += len(data)
                data_events[i] += data.count(b"event: data")
                data = await stream.receive_some(65536)
                if not data:
                    return

    async with trio.open_nursery() as nursery:
        for i in range(clients):
            nursery.start_soon(one, i)
        with trio.fail_after(30):
            await ready.wait()
        print("ready", flush=True)
        start_bytes, start_events = sum(received), sum(data_events)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    return {"clients": clients, "bytes": sum(received) - start_bytes, "data_events": sum(data_events) - start_events,
            "clients_without_data": sum(1 for n in data_events if n == 0)}


def client_main(argv: list[str]) -> int:
    import trio

    port, jobs, clients, seconds = int(argv[0]), argv[1].split(","), int(argv[2]), float(argv[3])
    result = trio.run(sse_clients, port, jobs, clients, seconds)
    print(json.dumps(result), flush=True)
    return 0


# -- one condition --------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.gcwrap, self.gcshadow = tools()
        self.commands: dict[str, str] = {}

    def run(self, run: int, with_web: bool) -> dict[str, float]:
        import trio

        a = self.args
        tag = f"{run}-{'web' if with_web else 'bare'}"
        rundir = self.workdir / tag
        home = rundir / "home"
        shadow = ShadowProc(home, rundir)
        procs: list[subprocess.Popen[bytes]] = []
        web = clients = None
        try:
            port = shadow.wait_ready()
            self.commands.setdefault("gcshadow", shlex.join(shadow.cmd))
            jobs = [f"bg-{k}" for k in range(a.jobs)]
            span = a.seconds + 30  # the background jobs outlast the measurement; stopped after it
            for k, job in enumerate(jobs):
                cmd = [*self.gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", f"{job}.out", "--stderr",
                       f"{job}.err", "--job-id", job, "--spool", str(rundir / "spool"), "--",
                       sys.executable, "-c", BG_JOB, repr(a.bg_rate), repr(span), str(k)]
                self.commands.setdefault("background job", shlex.join(cmd).replace(shlex.quote(BG_JOB), "BG_JOB"))
                with open(rundir / f"{job}.log", "wb") as log:
                    procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                  stderr=log, start_new_session=True))
            self._wait_streaming(home, jobs)
            if with_web:
                port_file = rundir / "web-port"
                cmd = [*self.gcshadow, "web", "--root", str(home), "--port", "0", "--port-file", str(port_file)]
                self.commands.setdefault("gcshadow web", shlex.join(cmd))
                with open(rundir / "web.log", "wb") as log:
                    web = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                           start_new_session=True)
                web_port = wait_for_port_file(web, port_file, rundir / "web.log")
                cmd = [sys.executable, __file__, "--sse-clients", str(web_port), ",".join(jobs), str(a.clients),
                       repr(a.seconds + 2 * WARM + 2)]
                self.commands.setdefault("clients", shlex.join(cmd))
                clients = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, start_new_session=True)
                assert clients.stdout is not None
                line = clients.stdout.readline()  # "ready" once every client's stream is open
                if line.strip() != b"ready":
                    raise BenchError(f"the clients did not connect: {line!r} {clients.stderr.read()[-2000:]!r}")
            cpu_shadow = proc_times(shadow.pid)[0]
            cpu_web = proc_times(web.pid)[0] if web else 0.0
            count = round(a.rate * a.seconds)
            lines = trio.run(protocol_client, port, f"probe-{tag}", "probe.out", a.rate, count, WARM,
                             60.0 + 3 * a.seconds)
            cpu_shadow = proc_times(shadow.pid)[0] - cpu_shadow
            cpu_web = (proc_times(web.pid)[0] - cpu_web) if web else 0.0
            result = {"cpu_shadow": cpu_shadow, "cpu_web": cpu_web}
            if clients is not None:
                try:
                    out, err = clients.communicate(timeout=60)
                except subprocess.TimeoutExpired:
                    raise BenchError("the client process did not end") from None
                if clients.returncode != 0:
                    raise BenchError(f"the client process failed: {err.decode(errors='replace')[-2000:]}")
                got = json.loads(out.decode().strip().splitlines()[-1])
                if got["clients_without_data"]:
                    raise BenchError(f"{got['clients_without_data']} of {a.clients} clients received no output")
                result.update(client_bytes=got["bytes"], client_events=got["data_events"])
            ms = [x / 1e6 for x in lines.latencies]
            if len(ms) != count:
                raise BenchError(f"the probe saw {len(ms)} of {count} lines acknowledged")
            result.update(p50=percentile(ms, 50), p99=percentile(ms, 99), max=max(ms), lines=len(ms))
            return result
        except trio.TooSlowError:
            raise BenchError(f"the probe timed out\n{shadow.log_tail()}") from None
        finally:
            for p in [*([clients] if clients else []), *([web] if web else [])]:
                stop(p)
            for p in procs:  # the background gcwraps, with their jobs
                if p.poll() is None:
                    signal_tree(p, signal.SIGKILL)
                    p.wait(10)
            shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    def _wait_streaming(self, home: Path, jobs: list[str]) -> None:
        """Until every background job's output is arriving at home."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all((home / f"{job}.out").exists() and (home / f"{job}.out").stat().st_size > 0 for job in jobs):
                return
            time.sleep(0.05)
        raise BenchError("the background jobs' output did not arrive at home within 30 s")


WARM = 0.5


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--sse-clients"]:
        return client_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each condition (default 5)")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of the probe per condition (default 8)")
    parser.add_argument("--rate", type=float, default=1000.0, help="the probe's lines per second (default 1000)")
    parser.add_argument("--jobs", type=int, default=4, help="background jobs the pages show (default 4)")
    parser.add_argument("--bg-rate", type=float, default=200.0,
                        help="lines per second of each background job (default 200, ~14 KB/s)")
    parser.add_argument("--clients", type=int, default=100, help="open job pages (event streams; default 100)")
    parser.add_argument("--tmpdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    results_option(parser, "web_load")
    args = parser.parse_args(argv)
    install_signal_handlers()
    raise_nofile()
    record = Results("web_load", args.json)
    print(header("web_load"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-web-", dir=args.tmpdir))
    bench = Bench(args, workdir)
    results: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    with guarded("web_load", workdir, args.keep) as outcome:
        print(f"probe: {args.rate:g} lines/s for {args.seconds:g} s; {args.jobs} background jobs at "
              f"{args.bg_rate:g} lines/s each; {args.clients} event streams; {args.runs} runs; work dir {workdir}",
              flush=True)
        for run in range(1, args.runs + 1):
            order = [False, True] if run % 2 else [True, False]
            for with_web in order:
                r = bench.run(run, with_web)
                key = "with" if with_web else "without"
                results[key].append(r)
                record.run(run=run, condition=key, **r)
                extra = (f"; clients got {r['client_events']:.0f} output events, {r['client_bytes'] / 1e6:.1f} MB"
                         if with_web else "")
                print(f"run {run} {key:>7} web: ack p50 {r['p50']:.2f} ms, p99 {r['p99']:.2f} ms, "
                      f"max {r['max']:.1f} ms; CPU shadow {r['cpu_shadow']:.2f} s, web {r['cpu_web']:.2f} s{extra}",
                      flush=True)
        print("\ncommands (first run):")
        for name, cmd in bench.commands.items():
            print(f"  {name}: {cmd}")
        print("\nload average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        rows = [["condition", "p50 ms median", "(min-max)", "p99 ms median", "(min-max)", "max ms median",
                 "shadow CPU s", "web CPU s"]]
        for key in ("without", "with"):
            rs = results[key]
            p50, p99, mx = (summary(r[f] for r in rs) for f in ("p50", "p99", "max"))
            rows.append([f"{key} web view", f"{p50[0]:.2f}", f"{p50[1]:.2f}-{p50[2]:.2f}", f"{p99[0]:.2f}",
                         f"{p99[1]:.2f}-{p99[2]:.2f}", f"{mx[0]:.1f}",
                         f"{summary(r['cpu_shadow'] for r in rs)[0]:.2f}",
                         f"{summary(r['cpu_web'] for r in rs)[0]:.2f}"])
        print(render_table(rows))
        p99 = {k: summary(r["p99"] for r in results[k])[0] for k in results}
        p50 = {k: summary(r["p50"] for r in results[k])[0] for k in results}
        print(f"\nratio with/without web view (medians over {args.runs} runs): "
              f"p99 {p99['with'] / p99['without']:.2f}x, "
              f"p50 {p50['with'] / p50['without']:.2f}x")
        # Each run measures both conditions back to back: its own ratio cancels most of the machine's drift.
        pairs = [w["p99"] / b["p99"] for w, b in zip(results["with"], results["without"], strict=True)]
        higher = sum(1 for r in pairs if r > 1)
        print(f"p99 with/without within each run: median {summary(pairs)[0]:.2f}x (min {min(pairs):.2f}x, "
              f"max {max(pairs):.2f}x); higher with the web view in {higher} of {len(pairs)} runs")
        for name, cmd in bench.commands.items():
            record.command(name, cmd)
        for q in ("p50", "p99"):
            record.figure(f"web view: ack latency {q} (ms), {args.clients} open job pages, {args.rate:g} lines/s",
                          "ms", [r[q] for r in results["with"]],
                          [r[q] for r in results["without"]], "no web view", key=True)
        record.write()
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
