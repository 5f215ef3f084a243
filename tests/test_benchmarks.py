"""The benchmarks' own measuring logic: what would silently mis-measure if it were wrong.

The ACK capture (benchlib.AckSniffer) is checked against a real TCP
connection on loopback carrying real protocol frames; the line diagnosis,
the order of overhead.py's pairs and fanin.py's ceiling search against
inputs whose answer is known.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import benchlib
import fanin
import latency
import lines
import overhead

from gcwrap.wire.events import Ack, Pong, Welcome
from gcwrap.wire.protocol import encode


def _can_capture() -> bool:
    try:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(benchlib.ETH_P_IP))
    except (OSError, AttributeError):
        return False
    s.close()
    return True


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _can_capture(), reason="needs a packet socket (root or CAP_NET_RAW)")
def test_ack_sniffer_sees_every_ack_before_the_agent_reads_it() -> None:
    """ACK frames split across segments, coalesced with other frames, on a real loopback connection: the
    capture decodes every ACK with its offset, and timestamps it no later than the reader's receipt."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sniffer = benchlib.AckSniffer(port, 1)
    sniffer.start()
    frames = [encode(Welcome(version=1, session=1, durable=((1, 0),)))]
    offsets = [29 * (k + 1) for k in range(200)]
    for k, off in enumerate(offsets):
        frames.append(encode(Ack(1, off)))
        if k % 7 == 0:
            frames.append(encode(Ack(2, off)))  # another stream: not counted
            frames.append(encode(Pong(k)))
    wire = b"".join(frames)
    received: list[tuple[int, bytes]] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pos = 0
            step = 3  # odd sizes: frames span segments, several frames share one
            while pos < len(wire):
                conn.sendall(wire[pos:pos + step])
                pos += step
                step = 1 + (step * 7) % 23
                time.sleep(0.0005)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with socket.create_connection(("127.0.0.1", port)) as client:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                received.append((time.monotonic_ns(), data))
        t.join(10)
        # The capture runs behind the reader (a loaded machine: far behind): wait for its last ACK, bounded.
        deadline = time.monotonic() + 20
        while len(sniffer.acks) < len(offsets) and time.monotonic() < deadline and sniffer.error is None:
            time.sleep(0.01)
    finally:
        drops = sniffer.close()
        server.close()
    assert b"".join(d for _, d in received) == wire
    assert drops == 0 and not sniffer.problem and sniffer.error is None
    assert [off for off, _ in sniffer.acks] == offsets
    # The capture's (kernel) time of each ACK precedes the time the reader had all of its bytes.
    ends: list[tuple[int, int]] = []
    total = 0
    for stamp, data in received:
        total += len(data)
        ends.append((total, stamp))
    pos = len(frames[0])
    k = 0
    for frame in frames[1:]:
        pos += len(frame)
        if frame == encode(Ack(1, offsets[k])):
            got = next(stamp for end, stamp in ends if end >= pos)
            assert sniffer.acks[k][1] <= got + 1000  # 1 µs of slack for the clock conversion
            k += 1
    assert k == len(offsets)


def test_ack_latencies_take_the_first_ack_that_covers_each_line() -> None:
    """Line i ends at 29 (i+1); its latency runs from its own timestamp to the first ACK covering that end,
    whatever order the ACKs were captured in (they are sorted by arrival)."""
    ts = [1_000, 2_000, 3_000, 4_000]
    content = b"".join(b"%08d %019d\n" % (i, t) for i, t in enumerate(ts))
    acks = [(29 * 4, 9_000), (29 * 1, 5_000), (29 * 3, 6_000)]
    got = latency.ack_latencies(content, acks)
    assert got.count == 4
    assert got.latencies == [5_000 - 1_000, 6_000 - 2_000, 6_000 - 3_000, 9_000 - 4_000]
    partial = latency.ack_latencies(content, [(29 * 2 + 5, 7_000)])
    assert partial.count == 2  # a line half covered is not acknowledged


def test_lines_diagnosis_names_what_is_wrong(tmp_path: Path) -> None:
    src = tmp_path / "src"
    lines.make_source(src, 50, 40)
    data = src.read_bytes()
    rows = [data[i * 40:(i + 1) * 40] for i in range(50)]
    assert all(len(r) == 40 and r.endswith(b"\n") and r[:9] == b"%09d" % i for i, r in enumerate(rows))
    landed = tmp_path / "landed"
    landed.write_bytes(b"".join(rows))
    assert lines.diagnose(landed, src, 40, 50)[0]
    swapped = [*rows[:10], rows[11], rows[10], *rows[12:]]
    landed.write_bytes(b"".join(swapped))
    complete, text = lines.diagnose(landed, src, 40, 50)
    assert complete and text.startswith("0 missing, 0 duplicated, 0 altered") and "3 out of order" in text
    broken = rows[:5] + rows[6:] + [rows[7]]
    broken[0] = broken[0][:20] + b"!" + broken[0][21:]  # not a base64 character: altered for sure
    landed.write_bytes(b"".join(broken))
    complete, text = lines.diagnose(landed, src, 40, 50)
    assert not complete
    assert text.startswith("1 missing, 1 duplicated, 1 altered")


def test_overhead_pairs_alternate_or_follow_the_seed() -> None:
    abba = overhead.pair_orders(4, "abba", None)
    assert [o[0] for o in abba] == ["unwrapped", "wrapped", "unwrapped", "wrapped"]
    assert all(sorted(o) == ["unwrapped", "wrapped"] for o in abba)
    drawn = overhead.pair_orders(40, "random", 17)
    assert drawn == overhead.pair_orders(40, "random", 17)
    firsts = {o[0] for o in drawn}
    assert firsts == {"unwrapped", "wrapped"}


class _Probes:
    """Stands in for fanin.SimBench: a shadow that holds exactly `limit` agents."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.asked: list[int] = []

    def run(self, n: int, path: str, index: int) -> fanin.Result:
        self.asked.append(n)
        p99 = 100.0 if n <= self.limit else 400.0
        notes = dict.fromkeys(("connect_p50_ms", "connect_p99_ms", "connect_max_ms", "lag_p99_ms", "load_cpu_s",
                               "offered_mb_s", "acked_bytes"), 0.0)
        return fanin.Result("sim", path, index, n, n, 1, 1.0, 1.0, 0.0, 0.0, 0, latencies_ms=[p99] * 100,
                            notes=notes)


@pytest.mark.parametrize("limit", [1, 700, 1500, 1880, 5000, 40000])
def test_ceiling_search_brackets_the_limit(limit: int, capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(ceiling_start=1000, ceiling_max=32000, ceiling_resolution=0.1, ceiling_budget=600.0,
                              ceiling_p99=250.0, frames=8, frame=16384, interval=1.0)
    probes = _Probes(limit)
    _, text = fanin.ceiling(probes, args)
    held = [n for n in probes.asked if n <= limit]
    failed = [n for n in probes.asked if n > limit]
    if limit >= args.ceiling_max:
        assert not failed and max(held) == args.ceiling_max
        return
    best, worst = max(held), min(failed)
    assert best <= limit < worst
    assert worst <= best * 1.1 or worst - best <= 1
    assert f"{best} agents held" in text and f"{worst} did not" in text
    assert len(probes.asked) <= 20


def test_ceiling_search_stops_within_its_budget() -> None:
    args = argparse.Namespace(ceiling_start=1000, ceiling_max=32000, ceiling_resolution=0.1, ceiling_budget=0.5,
                              ceiling_p99=250.0, frames=8, frame=16384, interval=1.0)

    class Slow(_Probes):
        def run(self, n: int, path: str, index: int) -> fanin.Result:
            time.sleep(0.2)
            return super().run(n, path, index)

    probes = Slow(10**6)
    _, text = fanin.ceiling(probes, args)
    assert "would overrun --ceiling-budget" in text
    assert len(probes.asked) <= 3


def test_pyspy_summary_shares(tmp_path: Path) -> None:
    raw = tmp_path / "p.raw"
    raw.write_text(
        "thread (1): MainThread;<module> (app.py:1);work (app.py:5);os_write (posixmodule.c:10) 6\n"
        "thread (1);<module> (app.py:1);wait (app.py:9) 2\n"
        "thread (2): worker;run (threading.py:1);commit (db.py:3);0x7f00 (libsqlite3.so.0) 2\n"
    )
    text = benchlib.pyspy_summary(raw, title="t")
    assert "t: 10 samples" in text
    assert "60.0%  os_write (posixmodule.c)" in text
    assert "80.0%  MainThread" in text and "20.0%  worker" in text
    assert "60.0%  work (app.py:5)" in text  # the native frame counted under its Python line
    assert "20.0%  commit (db.py:3)" in text
    assert math.isclose(sum(float(line.split("%")[0]) for line in text.split("by thread:")[1].split("self")[0]
                            .strip().splitlines()), 100.0)


def test_tcp_filter_is_well_formed() -> None:
    prog = benchlib.tcp_from_port_filter(4242)
    assert len(prog) == 9 * 8
    assert prog[6 * 8 + 4:6 * 8 + 8] == (4242).to_bytes(4, sys.byteorder)
    assert os.path.basename(lines.__file__) == "lines.py"


@pytest.mark.timeout(120)
def test_sim_agents_exit_only_once_every_agent_is_acknowledged(tmp_path: Path) -> None:
    """fanin.py's data phase holds no EXIT: agents staggered over the
    interval each wait at the exit barrier for the last one's ACKs; the
    steady p99 covers every frame but each agent's first."""
    import argparse
    import math

    args = argparse.Namespace(frame=1024, frames=2, interval=0.5, connect_concurrency=64, barrier_timeout=30.0,
                              timeout=60.0, keep=False, idle=0.0, load_nice=0, shadow_nofile=0)
    r = fanin.SimBench(args, tmp_path).run(20, "fan-in", 1)
    assert (r.ok, r.errors) == (20, {})
    assert r.notes["exits_in_data_phase"] == 0
    assert len(r.latencies_ms) == 40
    assert not math.isnan(r.notes["steady_p99_ms"]) and not math.isnan(r.notes["data_cpu_s"])


def test_sim_scenarios_may_each_have_an_interval_and_10000_agents_a_100_ms_target() -> None:
    """fanin.py --sim N@SECONDS: N agents at an interval of their own, named
    so in the figures; from 10,000 agents on, the ack p99 target is 100 ms."""
    assert fanin.sim_spec("10000@4", 1.0) == (10000, 4.0, True)
    assert fanin.sim_spec(" 500 ", 1.0) == (500, 1.0, False)
    for bad in ("x", "0", "10@", "10@-1", "@4"):
        with pytest.raises(ValueError):
            fanin.sim_spec(bad, 1.0)
    assert fanin.target_of("sim 10000 every 4 s", "ack latency (ms) p99") == "<= 100 ms"
    assert fanin.target_of("sim 1000", "ack latency (ms) p99") == "<= 250 ms"
    assert fanin.target_of("real 100", "ack latency (ms) p99") == ""


def test_the_shadow_s_own_p99_is_read_from_its_histogram_s_buckets() -> None:
    """fanin.py reads the shadow's ack latency (and its groups' sync and
    record) from /metrics: the p99 is the upper bound of the first bucket
    holding 99 % of the observations; NaN for a histogram with none."""
    import math

    text = ("# TYPE gcshadow_ack_latency_seconds histogram\n"
            'gcshadow_ack_latency_seconds_bucket{le="0.005"} 900.0\n'
            'gcshadow_ack_latency_seconds_bucket{le="0.05"} 989.0\n'
            'gcshadow_ack_latency_seconds_bucket{le="0.5"} 1000.0\n'
            'gcshadow_ack_latency_seconds_bucket{le="+Inf"} 1000.0\n'
            'gcshadow_fsync_seconds_bucket{le="0.005"} 0.0\n'
            'gcshadow_fsync_seconds_bucket{le="+Inf"} 0.0\n')
    assert fanin.bucket_p99(text, "gcshadow_ack_latency_seconds") == 500.0
    assert math.isnan(fanin.bucket_p99(text, "gcshadow_fsync_seconds"))
    assert math.isnan(fanin.bucket_p99(text, "gcshadow_commit_seconds"))


@pytest.mark.timeout(180)
def test_files_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/files.py, small: the scattered writes cost on the wire the
    64 KiB blocks they touched and the extension, not the file again; the
    appended file and stdout both land whole (each run checks the SHA-256)."""
    import files

    args = argparse.Namespace(scattered_size="2MiB", blocks=6, steps=2, extend="100000", size="8MiB", runs=1,
                              timeout=120.0)
    rows = {r[0]: r[1] for r in files.scattered(args, tmp_path)}
    sent = int(rows["gcwrap sent for them (files_sent less the first version)"].replace(",", ""))
    assert 0 < sent <= 6 * (64 << 10) + 100000, rows
    assert float(rows["sent / baseline"]) < 0.25, rows
    table = files.appended(args, tmp_path)
    assert table[1][0] == "wall time (s)" and table[1][-1].endswith("x"), table  # (CPU rows: "-" when too short)


def test_results_json_holds_runs_medians_and_ratios(tmp_path: Path) -> None:
    """benchlib.Results: the invocation's context, every run, each figure's medians and the ratio of the
    medians; NaN (a figure a run could not take) becomes null, so the file is strict JSON."""
    import json

    path = tmp_path / "r" / "x.json"
    results = benchlib.Results("x", path)
    results.command("gcwrap", ["gcwrap", "--shadow", "127.0.0.1:1", "--", "true"])
    results.run(path="gcwrap", wall_s=2.0)
    results.figure("wall (s)", "s", [2.0, 4.0, 3.0, math.nan], [1.0, 2.0], "socat", "<= 1.05x")
    results.figure("context", "", [1.0])
    assert results.write() == path
    data = json.loads(path.read_text())
    assert data["benchmark"] == "x" and len(data["commit"]) >= 7 and isinstance(data["dirty"], bool)
    assert set(data["machine"]) == {"cpu", "cores", "kernel", "python"}
    assert len(data["load_before"]) == 3 and len(data["load_after"]) == 3
    assert data["commands"] == {"gcwrap": "gcwrap --shadow 127.0.0.1:1 -- true"}
    assert data["runs"] == [{"path": "gcwrap", "wall_s": 2.0}]
    wall, context = data["figures"]
    assert wall["gcwrap"] == {"runs": [2.0, 4.0, 3.0], "median": 3.0, "min": 2.0, "max": 4.0}
    assert wall["baseline"]["name"] == "socat" and wall["baseline"]["median"] == 1.5
    assert wall["ratio"] == 2.0 and wall["key"] and wall["target"] == "<= 1.05x"
    assert context["baseline"] is None and context["ratio"] is None and not context["key"]
    assert benchlib.Results("x", None).write() is None


def test_every_benchmark_writes_its_results() -> None:
    """Each script takes --json/--no-json and writes through benchlib.Results (one shared writer)."""
    import report

    names = report.benchmarks()
    assert "throughput" in names and "benchlib" not in names and "report" not in names
    for name in names:
        text = (report.HERE / f"{name}.py").read_text()
        assert 'results_option(' in text and f'"{name}")' in text, name
        assert "Results(" in text and ".write()" in text, name


def test_benchlib_imports_no_benchmark_script() -> None:
    """benchlib is imported by the scripts, never the other way (throughput.py and benchlib.py used to import
    each other)."""
    import ast

    here = Path(benchlib.__file__).parent
    scripts = {p.stem for p in here.glob("*.py")} - {"benchlib"}
    tree = ast.parse((here / "benchlib.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & scripts


def test_readme_table_is_what_report_makes() -> None:
    """The results table in benchmarks/README.md is exactly what report.py makes from the committed JSON
    (run `python benchmarks/report.py` after a benchmark round), and the README stays within 30 KB."""
    import report

    readme = report.README.read_text()
    assert readme == report.rewrite(readme, report.table(report.load(), report.benchmarks())), (
        "benchmarks/README.md's table is stale: run python benchmarks/report.py")
    assert len(readme.encode()) <= 30 * 1024
