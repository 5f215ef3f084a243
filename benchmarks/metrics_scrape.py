#!/usr/bin/env python3
"""What scraping `gcshadow serve --metrics` costs the ACK latency.

One shadow (`gcshadow serve --port 0 --min-free 0 --metrics 127.0.0.1:0`)
serves the runs. Each run is latency.py's protocol client: one connection
speaking the wire protocol, timestamped 29-byte lines at a fixed rate (1 000
lines/s by default) in DATA frames as they fall due, send -> durable ACK
measured for every line. Runs come in pairs, interleaved (ABBA: plain,
scraped, scraped, plain, ...) so that drift of the machine falls on both
alike: "scraped" runs have a scraper in this process GET /metrics every
`--interval` seconds (1 s, as a busy Prometheus) over a new connection
each time, as Prometheus does without keep-alive; "plain" ones have none.

Prints per mode the p50 and p99 of every line pooled (and the median of the
runs' own), the scrapes made and their duration, and the ratio scraped /
plain. Every line must be acknowledged (else the run fails).

Usage:
  python benchmarks/metrics_scrape.py                      # 6 pairs of 5 s runs at 1 000 lines/s
  python benchmarks/metrics_scrape.py --pairs 1 --seconds 1   # smoke
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    BenchError,
    Results,
    ShadowProc,
    header,
    install_signal_handlers,
    percentile,
    render_table,
    results_option,
)
from latency import protocol_client


async def scrape_once(port: int) -> tuple[float, int]:
    """One GET /metrics over a new connection: (seconds, bytes of the answer)."""
    import trio

    began = time.monotonic()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        got = bytearray()
        while chunk := await stream.receive_some(65536):
            got += chunk
    if not got.startswith(b"HTTP/1.1 200"):
        raise BenchError(f"GET /metrics: {bytes(got[:200])!r}")
    return time.monotonic() - began, len(got)


async def one_run(port: int, metrics_port: int, job_id: str, rate: float, seconds: float, interval: float,
                  scrapes: list[float] | None) -> list[int]:
    """One protocol run (with a scraper when `scrapes` is a list): every line's latency, ns."""
    import trio

    count = int(rate * seconds)
    async with trio.open_nursery() as nursery:
        if scrapes is not None:
            async def scraper() -> None:
                while True:
                    scrapes.append((await scrape_once(metrics_port))[0])
                    await trio.sleep(interval)

            nursery.start_soon(scraper)
        lines = await protocol_client(port, job_id, f"{job_id}.out", rate, count, 0.2, seconds * 4 + 30)
        nursery.cancel_scope.cancel()
    if lines.count != count:
        raise BenchError(f"{job_id}: {lines.count} of {count} lines acknowledged")
    return lines.latencies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=6, help="pairs of runs (plain, scraped), interleaved")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of each run")
    ap.add_argument("--rate", type=float, default=1000.0, help="lines per second")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    results_option(ap, "metrics_scrape")
    args = ap.parse_args(argv)
    install_signal_handlers()
    import trio

    record = Results("metrics_scrape", args.json)
    print(header("metrics_scrape"))
    latencies: dict[str, list[int]] = {"plain": [], "scraped": []}
    per_run: dict[str, list[tuple[float, float]]] = {"plain": [], "scraped": []}
    scrapes: list[float] = []
    size = 0
    with tempfile.TemporaryDirectory(prefix="gcwrap-metrics-") as tmp, \
            ShadowProc(Path(tmp) / "home", Path(tmp) / "run", extra=["--metrics", "127.0.0.1:0"]) as shadow:
        port = shadow.wait_ready()  # (the metrics listen, and say where, before the port file is written)
        record.command("gcshadow", shadow.cmd)
        found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", shadow.log_tail())
        if found is None:
            raise BenchError(f"gcshadow did not say where its metrics are: {shadow.log_tail()}")
        metrics_port = int(found[1])
        size = trio.run(scrape_once, metrics_port)[1]
        order = [m for i in range(args.pairs) for m in (("plain", "scraped") if i % 2 == 0 else ("scraped", "plain"))]
        for n, mode in enumerate(order):
            got = trio.run(one_run, port, metrics_port, f"run{n}", args.rate, args.seconds, args.interval,
                           scrapes if mode == "scraped" else None)
            latencies[mode] += got
            per_run[mode].append((percentile(got, 50) / 1e6, percentile(got, 99) / 1e6))
            print(f"  run {n + 1}/{len(order)} {mode:8s} p50 {per_run[mode][-1][0]:.3f} ms  "
                  f"p99 {per_run[mode][-1][1]:.3f} ms", flush=True)
            record.run(run=n + 1, mode=mode, p50_ms=per_run[mode][-1][0], p99_ms=per_run[mode][-1][1], lines=len(got))
    rows = [["mode", "lines", "p50 ms (pooled)", "p99 ms (pooled)", "p50 ms (median of runs)",
             "p99 ms (median of runs)"]]
    pooled = {}
    for mode, got in latencies.items():
        pooled[mode] = (percentile(got, 50) / 1e6, percentile(got, 99) / 1e6)
        rows.append([mode, str(len(got)), f"{pooled[mode][0]:.3f}", f"{pooled[mode][1]:.3f}",
                     f"{statistics.median(r[0] for r in per_run[mode]):.3f}",
                     f"{statistics.median(r[1] for r in per_run[mode]):.3f}"])
    print(render_table(rows))
    print(f"scrapes: {len(scrapes)}, every {args.interval} s, {size} bytes each; duration p50 "
          f"{percentile(scrapes, 50) * 1e3:.2f} ms, max {max(scrapes) * 1e3:.2f} ms")
    print(f"ratio scraped / plain: p50 {pooled['scraped'][0] / pooled['plain'][0]:.3f}, "
          f"p99 {pooled['scraped'][1] / pooled['plain'][1]:.3f}")
    record.command("scraper", f"GET http://127.0.0.1:PORT/metrics every {args.interval:g} s, a new connection each")
    for i, q in enumerate(("p50", "p99")):
        record.figure(f"metrics: ack latency {q} (ms), scraped every {args.interval:g} s, {args.rate:g} lines/s", "ms",
                      [r[i] for r in per_run["scraped"]], [r[i] for r in per_run["plain"]], "not scraped", key=True)
    record.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
