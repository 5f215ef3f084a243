#!/usr/bin/env python3
"""Line latency: from a job's write to the durable ACK arriving at the agent, and to the line being visible at home.

A job writes timestamped lines ("SEQ MONOTONIC_NS\\n", 29 bytes, one write(2)
each) at a fixed rate (10, 1 000 and 10 000 lines/s by default), on an
open-loop schedule: line i is due at t0 + i/rate and is written then, or at
once when the job is late. Four paths are measured in every run, one after
the other, at each rate:

  gcwrap   gcshadow serve --port 0 --root HOME --port-file F --min-free 0
           gcwrap --shadow 127.0.0.1:PORT --stdout latency-R.out --spool SPOOL --job-id ID -- python -c JOB R N
           Two figures from the same run:
           * write -> ACK at the agent: when the shadow's ACK covering the line arrives at gcwrap's
             socket. A packet socket on the loopback interface (AF_PACKET, a BPF filter for TCP from the
             shadow's port, kernel receive timestamps) sees each segment the shadow sends to gcwrap as
             the kernel delivers it; the script reassembles that direction of the stream, cuts it into
             frames and decodes them with gcwrap.wire.protocol. An ACK says every byte below its offset is
             durable at home, and its arrival is when gcwrap can rely on that: what the user's
             guarantee is about. Nothing is added to gcwrap's path (no proxy, no polling of the
             shadow); a lost capture (kernel drop counter, a gap in the sequence numbers) fails the run.
           * write -> visible at home (page cache), for context: the line is in HOME/latency-R.out (the
             shadow pwrites it before it syncs), seen by an inotify watcher in this script.
  socat    (baseline for "visible") JOB | socat -u - TCP:127.0.0.1:PORT  ->  socat -u TCP-LISTEN:PORT OPEN:FILE
           write -> visible in FILE, by the same watcher. Nothing is synced.
  protocol (the shadow's own ack latency, without gcwrap) a client in this script speaking the wire protocol
           (gcwrap.wire.protocol, one connection to a fresh gcshadow): HELLO, then at the same rate DATA frames
           holding the lines that are due, then EXIT/DONE. send -> durable ACK: from just before send_all of
           the DATA frame to the arrival of the ACK covering the line.
  fsync    (baseline for "durable": the floor on this disk) a thread writes the same lines at the same
           rate to a file on the same file system, and another fdatasyncs it in a loop (group commit):
           write -> fdatasync returned.

All clocks are CLOCK_MONOTONIC (system-wide on Linux), so the job's timestamp
and the watcher's clock compare directly. Each path reports p50, p99 and max
per run; the table gives the median (and min-max) over the runs of each, and
the percentiles of all runs' lines pooled. Lines are checked: every line must
arrive once, in order, with the bytes the job wrote (the landed file is
compared byte for byte with the expected lines), else the benchmark fails.

Usage:
  python benchmarks/latency.py --runs 5
  python benchmarks/latency.py --runs 1 --seconds 1        # smoke
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import math
import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    AckSniffer,
    BenchError,
    Results,
    ShadowProc,
    free_port,
    guarded,
    header,
    install_signal_handlers,
    percentile,
    render_table,
    results_option,
    signal_tree,
    summary,
    tools,
    wait_listening,
    wait_measured,
)

LINE_LEN = 29  # b"%08d %019d\n"
WARMUP = 0.5  # seconds the job sleeps before its first line (gcwrap connects meanwhile)

JOB = r"""
import os, sys, time
rate, count, warm = float(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
time.sleep(warm)
write, now_ns, mono, sleep = os.write, time.monotonic_ns, time.monotonic, time.sleep
interval = 1.0 / rate
t0 = mono()
for i in range(count):
    delay = t0 + i * interval - mono()
    if delay > 0:
        sleep(delay)
    line = b"%08d %019d\n" % (i, now_ns())
    while line:
        line = line[write(1, line):]
"""

IN_MODIFY, IN_CREATE, IN_MOVED_TO, IN_NONBLOCK, IN_CLOEXEC = 0x2, 0x100, 0x80, 0o4000, 0o2000000


class Inotify:
    """inotify through ctypes: wake up when a file in a watched directory changes."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._libc = libc
        self.fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.poll = select.poll()
        self.poll.register(self.fd, select.POLLIN)

    def watch(self, directory: Path) -> None:
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_MODIFY | IN_CREATE | IN_MOVED_TO)
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory} failed")

    def wait(self, timeout_ms: int) -> None:
        """Block until something changed (or the timeout), then drain the events."""
        if self.poll.poll(timeout_ms):
            try:
                while os.read(self.fd, 65536):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Lines:
    """Latencies (ns) of one path in one run, and the lines seen."""

    latencies: list[int] = field(default_factory=list)
    count: int = 0

    def stats(self) -> tuple[float, float, float]:
        ms = [x / 1e6 for x in self.latencies]
        return percentile(ms, 50), percentile(ms, 99), max(ms) if ms else math.nan


class Watcher(threading.Thread):
    """Reads FILE as it grows (woken by inotify), timing each complete line from its own timestamp."""

    def __init__(self, path: Path, expected: int) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.expected = expected
        self.visible = Lines()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.ino = Inotify()
        self.ino.watch(path.parent)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e

    def _run(self) -> None:
        fd: int | None = None
        partial = b""
        try:
            while not self.stopping.is_set():
                if fd is None:
                    try:
                        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        pass
                if fd is not None:
                    while chunk := os.read(fd, 1 << 20):
                        now = time.monotonic_ns()
                        *lines, partial = (partial + chunk).split(b"\n")
                        for line in lines:
                            self.visible.latencies.append(now - int(line.split(b" ")[1]))
                        self.visible.count += len(lines)
                if self.visible.count >= self.expected:
                    return
                self.ino.wait(50)
        finally:
            if fd is not None:
                os.close(fd)
            self.ino.close()


def ack_latencies(content: bytes, acks: list[tuple[int, int]]) -> Lines:
    """write -> ACK of every line of `content` (the landed bytes): the first ACK whose offset covers its end."""
    result = Lines()
    ordered = sorted(acks, key=lambda a: a[1])
    k = 0
    covered = 0
    for offset, arrival in ordered:
        covered = max(covered, offset)
        while (k + 1) * LINE_LEN <= covered and k * LINE_LEN < len(content):
            ts = int(content[k * LINE_LEN + 9:(k + 1) * LINE_LEN - 1])
            result.latencies.append(arrival - ts)
            k += 1
    result.count = k
    return result


def expected_lines(content: bytes, count: int, what: str) -> None:
    """The landed bytes must be exactly lines 0..count-1 of the job's format, in order."""
    if len(content) != count * LINE_LEN:
        raise BenchError(f"{what}: {len(content)} bytes landed, expected {count * LINE_LEN} ({count} lines)")
    pattern = re.compile(rb"(\d{8}) (\d{19})\n")
    last_ts = 0
    for i in range(count):
        m = pattern.fullmatch(content, i * LINE_LEN, (i + 1) * LINE_LEN)
        if m is None or int(m.group(1)) != i:
            raise BenchError(f"{what}: line {i} is wrong: {content[i * LINE_LEN:(i + 1) * LINE_LEN]!r}")
        ts = int(m.group(2))
        if ts < last_ts:
            raise BenchError(f"{what}: line {i} has a timestamp before the previous line's")
        last_ts = ts


# -- the protocol client ---------------------------------------------------------


async def protocol_client(port: int, job_id: str, name: str, rate: float, count: int, warm: float,
                          timeout: float, receipts: list[tuple[int, int]] | None = None) -> Lines:
    """The shadow's own ack latency; `receipts` gets (offset, ns) of each ACK as the client reads it."""
    import trio

    from gcwrap.wire.events import Ack, Data, Done, Error, Exit, Hello, StreamSpec, Welcome
    from gcwrap.wire.protocol import NEED_DATA, Connection, Role

    result = Lines()
    conn = Connection(Role.AGENT)
    sent: list[tuple[int, int]] = []  # (end offset, send time ns), in offset order
    resolved = 0
    all_acked = trio.Event()
    done = trio.Event()

    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream("127.0.0.1", port)  # trio sets TCP_NODELAY
        async with stream:
            hello = Hello(job_id=job_id, instance=f"i{os.getpid()}{int(time.time() * 1000)}",
                          streams=(StreamSpec(1, "stdout", name),), host="bench", user="bench",
                          command=("latency-protocol-client",))
            await stream.send_all(conn.send(hello))

            async def next_events() -> list[object]:
                while True:
                    ev = conn.next_event()
                    if ev is not NEED_DATA:
                        return [ev]
                    data = await stream.receive_some(65536)
                    conn.receive_data(data)
                    if not data:
                        return [conn.next_event()]

            (welcome,) = await next_events()
            if not isinstance(welcome, Welcome):
                raise BenchError(f"protocol client: expected WELCOME, got {welcome!r}")

            async def receiver() -> None:
                nonlocal resolved
                while True:
                    for ev in await next_events():
                        if isinstance(ev, Ack):
                            now = time.monotonic_ns()
                            if receipts is not None:
                                receipts.append((ev.offset, now))
                            while resolved < len(sent) and sent[resolved][0] <= ev.offset:
                                result.latencies.append(now - sent[resolved][1])
                                resolved += 1
                            result.count = resolved
                            if resolved == count:
                                all_acked.set()
                        elif isinstance(ev, Done):
                            done.set()
                            return
                        elif isinstance(ev, Error):
                            raise BenchError(f"protocol client: the shadow sent ERROR {ev.code.name}: {ev.message}")
                        else:
                            raise BenchError(f"protocol client: unexpected {ev!r}")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                await trio.sleep(warm)
                t0 = trio.current_time()
                interval = 1.0 / rate
                offset = 0
                i = 0
                while i < count:
                    now = trio.current_time()
                    due = min(count, int((now - t0) / interval) + 1)
                    if due <= i:
                        await trio.sleep_until(t0 + i * interval)
                        continue
                    ts = time.monotonic_ns()
                    payload = b"".join(b"%08d %019d\n" % (k, ts) for k in range(i, due))
                    frame = conn.send(Data(1, offset, payload))
                    for k in range(i, due):
                        sent.append((offset + (k - i + 1) * LINE_LEN, ts))
                    offset += len(payload)
                    i = due
                    await stream.send_all(frame)
                await all_acked.wait()
                await stream.send_all(conn.send(Exit(code=0, signal=None, lengths=((1, offset),))))
                await done.wait()
    return result


# -- the fdatasync floor ---------------------------------------------------------


def fsync_floor(path: Path, rate: float, count: int, timeout: float) -> Lines:
    """Write the lines at `rate` in one thread, fdatasync in a loop in another: write -> synced."""
    result = Lines()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    written: list[tuple[int, int]] = []  # (end offset, ts)
    lock = threading.Lock()
    finished = threading.Event()
    deadline = time.monotonic() + timeout

    def syncer() -> None:
        k = 0
        while k < count and time.monotonic() < deadline:
            with lock:
                upto = len(written)
            if upto == k:
                time.sleep(0.0002)
                continue
            os.fdatasync(fd)
            now = time.monotonic_ns()
            for j in range(k, upto):
                result.latencies.append(now - written[j][1])
            k = upto
            result.count = k
        finished.set()

    thread = threading.Thread(target=syncer, daemon=True)
    thread.start()
    try:
        interval = 1.0 / rate
        t0 = time.monotonic()
        offset = 0
        for i in range(count):
            delay = t0 + i * interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            ts = time.monotonic_ns()
            line = b"%08d %019d\n" % (i, ts)
            os.write(fd, line)
            offset += len(line)
            with lock:
                written.append((offset, ts))
        if not finished.wait(max(1.0, deadline - time.monotonic())):
            raise BenchError("fdatasync floor: timed out")
        thread.join(5)
    finally:
        os.close(fd)
    if result.count != count:
        raise BenchError(f"fdatasync floor: {result.count} of {count} lines synced before the timeout")
    return result


# -- the benchmark ---------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.gcwrap, _ = tools()
        self.python = sys.executable
        self.commands: dict[str, str] = {}
        # (ACKs the protocol client read, capture drops, client receipt - wire arrival in µs per ACK matched)
        self.capture_check: list[tuple[int, int, list[float]]] = []

    def job(self, rate: float, count: int) -> list[str]:
        return [self.python, "-c", JOB, repr(rate), str(count), repr(WARMUP)]

    def count(self, rate: float) -> int:
        return max(1, round(rate * self.seconds(rate)))

    def seconds(self, rate: float) -> float:
        if self.args.seconds is not None:
            return self.args.seconds
        return {10.0: 10.0, 1000.0: 5.0, 10000.0: 3.0}.get(rate, 5.0)

    def timeout(self, rate: float) -> float:
        return 60.0 + 3 * self.seconds(rate)

    def run_gcwrap(self, run: int, rate: float) -> tuple[Lines, Lines]:
        """(write -> visible at home, write -> ACK arrival at gcwrap) of one gcwrap run."""
        from gcwrap.wire.events import STDOUT

        rundir = self.workdir / f"gcwrap-{run}-{rate:g}"
        home, spool = rundir / "home", rundir / "spool"
        if self.args.spool_dir is not None:
            spool = self.args.spool_dir / f"latency-{os.getpid()}-{run}-{rate:g}"
        count = self.count(rate)
        name = f"latency-{rate:g}.out"
        job_id = f"latency-{os.getpid()}-{run}-{rate:g}"
        shadow = ShadowProc(home, rundir)
        wrapper: subprocess.Popen[bytes] | None = None
        watcher: Watcher | None = None
        sniffer: AckSniffer | None = None
        try:
            port = shadow.wait_ready()
            (home / name).parent.mkdir(parents=True, exist_ok=True)
            watcher = Watcher(home / name, count)
            watcher.start()
            sniffer = AckSniffer(port, STDOUT)
            sniffer.start()
            cmd = [*self.gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", name, "--spool", str(spool),
                   "--job-id", job_id, "--", *self.job(rate, count)]
            self.commands.setdefault("gcshadow", shlex.join(shadow.cmd))
            self.commands.setdefault("gcwrap", shlex.join(cmd).replace(shlex.quote(JOB), "JOB"))
            log = rundir / "gcwrap.log"
            with open(log, "wb") as err:
                wrapper = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                           start_new_session=True)
            r = wait_measured(wrapper, time.monotonic() + self.timeout(rate))
            if r.timed_out or r.returncode != 0:
                raise BenchError(f"gcwrap at {rate:g} lines/s: exit {r.returncode}, timed out {r.timed_out}\n"
                                 f"{log.read_text(errors='replace')[-2000:]}")
            watcher.join(10)
            if watcher.is_alive():
                raise BenchError(f"gcwrap at {rate:g} lines/s: the watcher saw {watcher.visible.count} lines "
                                 f"of {count} after gcwrap exited")
            if watcher.error:
                raise BenchError(f"watcher failed: {watcher.error!r}")
            time.sleep(0.1)  # gcwrap has exited: every ACK has arrived; let the sniffer read the last ones
            drops = sniffer.close()
            if sniffer.error or sniffer.problem or drops:
                raise BenchError(f"gcwrap at {rate:g} lines/s: the ACK capture failed: {sniffer.error!r} "
                                 f"{sniffer.problem} ({drops} packets dropped by the kernel)")
            content = (home / name).read_bytes()
            expected_lines(content, count, f"gcwrap at {rate:g} lines/s")
            acked = ack_latencies(content, sniffer.acks)
            if acked.count != count:
                raise BenchError(f"gcwrap at {rate:g} lines/s: ACKs seen on the wire cover {acked.count} of "
                                 f"{count} lines ({len(sniffer.acks)} ACKs in {sniffer.frames} frames)")
            return watcher.visible, acked
        finally:
            if sniffer is not None:
                sniffer.close()
            if watcher is not None:
                watcher.stopping.set()
                watcher.join(5)
            if wrapper is not None and wrapper.returncode is None:
                signal_tree(wrapper, 9)
                wrapper.wait(10)
            shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)
                shutil.rmtree(spool, ignore_errors=True)

    def run_socat(self, run: int, rate: float) -> Lines:
        rundir = self.workdir / f"socat-{run}-{rate:g}"
        rundir.mkdir(parents=True)
        out = rundir / "socat.out"
        count = self.count(rate)
        port = free_port()
        socat = shutil.which("socat") or "socat"
        recv_cmd = [socat, "-u", f"TCP-LISTEN:{port},reuseaddr,bind=127.0.0.1", f"OPEN:{out},creat,trunc"]
        send_cmd = [socat, "-u", "-", f"TCP:127.0.0.1:{port}"]
        self.commands.setdefault("socat receiver", shlex.join(recv_cmd))
        self.commands.setdefault("socat sender", "python -c JOB RATE COUNT WARMUP | " + shlex.join(send_cmd))
        procs: list[subprocess.Popen[bytes]] = []
        watcher = Watcher(out, count)
        try:
            recv = subprocess.Popen(recv_cmd, stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(recv)
            wait_listening(recv, port, "the receiving socat")
            watcher.start()
            job = subprocess.Popen(self.job(rate, count), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   start_new_session=True)
            procs.append(job)
            send = subprocess.Popen(send_cmd, stdin=job.stdout, start_new_session=True)
            procs.append(send)
            assert job.stdout is not None
            job.stdout.close()
            deadline = time.monotonic() + self.timeout(rate)
            for p in (recv, send, job):
                r = wait_measured(p, deadline)
                if r.timed_out or r.returncode != 0:
                    raise BenchError(f"socat path at {rate:g} lines/s: {p.args[0]} exit {r.returncode}")
            watcher.join(10)
            if watcher.is_alive() or watcher.error:
                raise BenchError(f"socat path: the watcher saw {watcher.visible.count} of {count} lines "
                                 f"({watcher.error!r})")
            expected_lines(out.read_bytes(), count, f"socat at {rate:g} lines/s")
            return watcher.visible
        finally:
            watcher.stopping.set()
            if watcher.is_alive():
                watcher.join(5)
            for p in procs:
                if p.returncode is None:
                    signal_tree(p, 9)
                    p.wait(10)
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    def run_protocol(self, run: int, rate: float) -> Lines:
        import trio

        rundir = self.workdir / f"proto-{run}-{rate:g}"
        home = rundir / "home"
        count = self.count(rate)
        name = f"latency-proto-{rate:g}.out"
        shadow = ShadowProc(home, rundir)
        sniffer: AckSniffer | None = None
        try:
            port = shadow.wait_ready()
            self.commands.setdefault("protocol client", f"in-process trio client -> 127.0.0.1:{port} "
                                     f"(HELLO, DATA per due batch, wait ACK, EXIT, DONE)")
            # The capture's check: the same ACKs, timed on the wire and by the client that reads them.
            try:
                sniffer = AckSniffer(port, 1)
                sniffer.start()
            except BenchError:
                sniffer = None  # no capture here: no check of it either
            receipts: list[tuple[int, int]] = []
            lines = trio.run(protocol_client, port, f"latency-proto-{os.getpid()}-{run}-{rate:g}", name, rate,
                             count, WARMUP, self.timeout(rate), receipts)
            expected_lines((home / name).read_bytes(), count, f"protocol client at {rate:g} lines/s")
            if sniffer is not None:
                time.sleep(0.1)
                drops = sniffer.close()
                wire = dict(sniffer.acks)
                self.capture_check.append((len(receipts), drops,
                                           [(t - wire[o]) / 1e3 for o, t in receipts if o in wire]))
            return lines
        except trio.TooSlowError:
            raise BenchError(f"protocol client at {rate:g} lines/s timed out\n{shadow.log_tail()}") from None
        finally:
            if sniffer is not None:
                sniffer.close()
            shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    def run_fsync(self, run: int, rate: float) -> Lines:
        rundir = self.workdir / f"fsync-{run}-{rate:g}"
        rundir.mkdir(parents=True)
        try:
            return fsync_floor(rundir / "floor.out", rate, self.count(rate), self.timeout(rate))
        finally:
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)


PATHS = [
    ("gcwrap ack", "gcwrap: write -> durable ACK at the agent"),
    ("gcwrap visible", "gcwrap: write -> visible at home (page cache)"),
    ("socat visible", "socat: write -> visible (baseline)"),
    ("protocol ack", "protocol client: send -> durable ACK"),
    ("fsync floor", "local write -> fdatasync (baseline)"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="10,1000,10000", help="lines per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=None,
                        help="seconds of lines per rate (default: 10 s at 10/s, 5 s at 1000/s, 3 s at 10000/s)")
    parser.add_argument("--runs", type=int, default=5, help="runs of every path at every rate (default 5)")
    parser.add_argument("--paths", default="gcwrap,socat,protocol,fsync",
                        help="which paths to run (default all: gcwrap,socat,protocol,fsync)")
    parser.add_argument("--spool-dir", type=Path, default=None,
                        help="put gcwrap's spool here instead of the work dir (e.g. /dev/shm, to take the "
                             "spool's writes off the shadow's file system)")
    parser.add_argument("--tmpdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    results_option(parser, "latency")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    paths = set(args.paths.split(","))
    if not shutil.which("socat"):
        print("latency: socat is not installed (apt-get install socat)", file=sys.stderr)
        return 2
    install_signal_handlers()
    record = Results("latency", args.json)
    print(header("latency"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-latency-", dir=args.tmpdir))
    bench = Bench(args, workdir)
    # per (rate, path): list of per-run (p50, p99, max) and pooled latencies
    per_run: dict[tuple[float, str], list[tuple[float, float, float]]] = {}
    pooled: dict[tuple[float, str], list[int]] = {}
    with guarded("latency", workdir, args.keep) as outcome:
        print(f"rates: {', '.join(f'{r:g}' for r in rates)} lines/s; lines per rate: "
              + ", ".join(f"{bench.count(r)} ({bench.seconds(r):g} s)" for r in rates)
              + f"; runs: {args.runs}; work dir {workdir}", flush=True)
        for run in range(1, args.runs + 1):
            for rate in rates:
                results: dict[str, Lines] = {}
                if "gcwrap" in paths:
                    results["gcwrap visible"], results["gcwrap ack"] = bench.run_gcwrap(run, rate)
                if "socat" in paths:
                    results["socat visible"] = bench.run_socat(run, rate)
                if "protocol" in paths:
                    results["protocol ack"] = bench.run_protocol(run, rate)
                if "fsync" in paths:
                    results["fsync floor"] = bench.run_fsync(run, rate)
                line = []
                for key, _ in PATHS:
                    if key not in results:
                        continue
                    lines = results[key]
                    st = lines.stats()
                    per_run.setdefault((rate, key), []).append(st)
                    pooled.setdefault((rate, key), []).extend(lines.latencies)
                    line.append(f"{key} {st[0]:.2f}/{st[1]:.2f}/{st[2]:.1f}")
                    record.run(run=run, rate=rate, path=key, p50_ms=st[0], p99_ms=st[1], max_ms=st[2],
                               lines=len(lines.latencies))
                print(f"run {run} {rate:>6g}/s  p50/p99/max ms: " + "  ".join(line), flush=True)
        print()
        print("commands (first run):")
        for name, cmd in bench.commands.items():
            print(f"  {name}: {cmd}")
        print(f"  JOB = {JOB.strip()!r}")
        print("\nload average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        rows = [["rate", "path", "p50 ms median", "(min-max)", "p99 ms median", "(min-max)", "max ms median",
                 "pooled p50", "pooled p99", "pooled max", "lines"]]
        for rate in rates:
            for key, label in PATHS:
                if (rate, key) not in per_run:
                    continue
                stats = per_run[(rate, key)]
                p50 = summary(s[0] for s in stats)
                p99 = summary(s[1] for s in stats)
                mx = summary(s[2] for s in stats)
                ms = [x / 1e6 for x in pooled[(rate, key)]]
                rows.append([f"{rate:g}/s", label, f"{p50[0]:.2f}", f"{p50[1]:.2f}-{p50[2]:.2f}", f"{p99[0]:.2f}",
                             f"{p99[1]:.2f}-{p99[2]:.2f}", f"{mx[0]:.1f}", f"{percentile(ms, 50):.2f}",
                             f"{percentile(ms, 99):.2f}", f"{max(ms):.1f}", str(len(ms))])
        print(render_table(rows))
        print("\nratios (median of per-run figures):")
        for rate in rates:
            def med(key: str, i: int, rate: float = rate) -> float:
                return summary(s[i] for s in per_run[(rate, key)])[0]

            parts = []
            for num, den in (("gcwrap visible", "socat visible"), ("gcwrap ack", "fsync floor"),
                             ("protocol ack", "fsync floor")):
                if (rate, num) not in per_run or (rate, den) not in per_run:
                    continue
                parts.append(f"{num} / {den}: p50 {med(num, 0) / med(den, 0):.1f}x, "
                             f"p99 {med(num, 1) / med(den, 1):.1f}x")
            if parts:
                print(f"  {rate:>6g}/s  " + ";  ".join(parts))
        if bench.capture_check:
            read = sum(c[0] for c in bench.capture_check)
            diffs = [d for c in bench.capture_check for d in c[2]]
            print(f"\ncheck of the ACK capture, on the protocol client's connections: {len(diffs)} of the {read} "
                  f"ACKs the client read were seen on the wire ({sum(c[1] for c in bench.capture_check)} packets "
                  f"dropped); the client read them after their capture by p50 {percentile(diffs, 50):.0f} µs, "
                  f"p99 {percentile(diffs, 99):.0f} µs, min {min(diffs, default=math.nan):.0f} µs"
                  " (negative: the capture's clock is late)")
        if 1000.0 in rates:
            print("\ntargets at 1000 lines/s (p50 <= 5 ms, p99 <= 50 ms, medians over runs):")
            for key in ("gcwrap ack", "protocol ack"):
                if (1000.0, key) not in per_run:
                    continue
                p50 = summary(s[0] for s in per_run[(1000.0, key)])[0]
                p99 = summary(s[1] for s in per_run[(1000.0, key)])[0]
                ok = "met" if p50 <= 5 and p99 <= 50 else "NOT met"
                print(f"  {dict(PATHS)[key]}: p50 {p50:.2f} ms, p99 {p99:.2f} ms: {ok}")
        for name, cmd in bench.commands.items():
            record.command(name, cmd)
        record.command("JOB", JOB.strip())
        record_figures(record, rates, per_run)
        record.write()
    return outcome.status


def record_figures(record: Results, rates: list[float],
                   per_run: dict[tuple[float, str], list[tuple[float, float, float]]]) -> None:
    """p50 and p99 of gcwrap's paths at every rate against the baseline of each, for the JSON."""
    for rate in rates:
        for num, den, what in (("gcwrap ack", "fsync floor", "write -> durable ACK at gcwrap"),
                               ("gcwrap visible", "socat visible", "write -> visible at home"),
                               ("protocol ack", "fsync floor", "protocol client send -> ACK (the shadow alone)")):
            if (rate, num) not in per_run:
                continue
            base = per_run.get((rate, den), [])
            for i, q in ((0, "p50"), (1, "p99")):
                target = ""
                if num == "gcwrap ack" and rate == 1000.0:
                    target = "<= 5 ms" if q == "p50" else "<= 50 ms"
                record.figure(f"latency at {rate:g} lines/s, {what}, {q}", "ms", [s[i] for s in per_run[(rate, num)]],
                              [s[i] for s in base], den if base else "", target,
                              key=rate == 1000.0 and num == "gcwrap visible" and q == "p50")


if __name__ == "__main__":
    sys.exit(main())
