#!/usr/bin/env python3
"""Fan-in: many agents on one shadow, each scenario against one agent moving the same bytes.

Scenarios (each run --runs times, alternated with its baseline; a fresh
gcshadow for every run, so its peak RSS is that run's):

  real N     N real gcwrap processes started at once (--real, default 100), each running
             `cat INPUT_i` (--real-bytes each, default 4MB, distinct random content):
               gcshadow serve --port 0 --root HOME --port-file F --min-free 0
               gcwrap --shadow 127.0.0.1:PORT --stdout fanin/real-i.out --spool SPOOL --job-id ID-i -- cat INPUT_i
             baseline: ONE gcwrap running `cat INPUT_1 ... INPUT_N` (the same bytes, one connection).
  sim N      N simulated agents (--sim, default 1000,10000) from a load process of their own (this script
             run with --load-worker: one trio run, N connections, speaking gcwrap.wire.protocol), so that the load
             does not share this script's process with the measurement; in a session of its own and niced
             (--load-nice, default 10), so that it does not starve the shadow. Each agent: connect, HELLO,
             WELCOME; wait until every agent is connected (a barrier, PINGs every 5 s while waiting); then
             send --frames DATA frames of --frame bytes, frame k at t0 + (i/N + k) x --interval (paced;
             with --interval 0 all at once); wait for the ACKs covering them; wait until every agent has
             all of its bytes acknowledged (a second barrier: no EXIT, state record or close overlaps the
             data phase of another agent); stay idle --idle seconds (default 5), when the shadow's
             descriptors are counted; EXIT; wait for DONE.
             baseline: ONE simulated agent sending the same frames on the same schedule (N frames per
             interval) over one connection.
  --ceiling  then the most simulated agents one shadow holds, every agent byte-exact at p99 ack <=
             --ceiling-p99 (250 ms): probes double the count from --ceiling-start, then bisect, each a
             fresh shadow, within --ceiling-budget seconds.

Figures: throughput. sim: the offered rate (N x frame / interval while
sending) and what was ACHIEVED: payload bytes acknowledged, counted from the
ACKs by the load process, over the time from the first DATA sent to the last
ACK; a shadow that keeps up achieves the offered rate (1.00x), one that falls
behind less. real gcwrap: the byte-exact bytes over spawn -> last exit.
Ack latency p50/p99/max (sim: from just before send_all of a DATA frame to
the ACK covering it, over every frame, and the p99 "steady" over every frame
but each agent's first; real gcwrap: not observable from outside, the per-job
wall time is given instead); connect + handshake p50/p99/max (connect() to
WELCOME, at most --connect-concurrency at once) and when the last agent was
connected; how late the load process sent frames against their schedule
(send lag) and its CPU, which say whether the load process kept up; the
shadow's CPU-seconds (user+sys of all its threads, /proc/PID/stat, over the
scenario, and in the data phase alone: from the first DATA frame sent to
the last byte acknowledged, which the two barriers keep free of connects,
handshakes and exits) and peak RSS (VmHWM), and its largest number of open descriptors
(sampled every 0.5 s). Every landed file's sha256 is compared with the bytes
sent. RLIMIT_NOFILE is raised to the hard limit in this process before the
shadow and the load process are started; the shadow raises its own soft
limit to its hard limit too (gcwrap.shadow.descriptors.raise_fd_limit).

Failures are reported, not hidden: every agent that did not finish is counted
by the phase it failed in and the error, the shadow's warnings and errors
are summarized, and the run is marked FAILED (exit status 1 at the end) if
any agent failed or a byte differs.

Usage:
  python benchmarks/fanin.py                                  # real 100, sim 1000 and 10000, 5 runs each
  python benchmarks/fanin.py --real 100 --sim 1000 --runs 5
  python benchmarks/fanin.py --real 10 --real-bytes 1MB --sim 100 --runs 1     # smoke
  python benchmarks/fanin.py --real 0 --sim '' --ceiling                       # the ceiling alone
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import json
import math
import os
import random
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    percentile,
    proc_times,
    raise_nofile,
    render_table,
    results_option,
    sha256_file,
    signal_tree,
    summary,
    tools,
    wait_measured,
)

SEED = 6
SRC_SPAN = 4 << 20  # agents' payloads are slices of SRC_SPAN + per-agent random bytes


# -- watching the shadow ----------------------------------------------------------


class ShadowWatch(threading.Thread):
    """Samples the shadow's open descriptors, RSS and threads every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval = interval
        self.max_fds = 0
        self.max_rss_kib = 0
        self.max_threads = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.interval):
            try:
                self.max_fds = max(self.max_fds, len(os.listdir(f"/proc/{self.pid}/fd")))
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            self.max_rss_kib = max(self.max_rss_kib, int(line.split()[1]))
                        elif line.startswith("Threads:"):
                            self.max_threads = max(self.max_threads, int(line.split()[1]))
            except OSError:
                return


def nofile_limit(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return f"{soft}/{hard}"
    except OSError:
        pass
    return "?"


def log_problems(text: str, limit: int = 8) -> list[str]:
    """The shadow's WARNING/ERROR lines, grouped after digits and addresses are blanked out."""
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        low = line.lower()
        if not any(w in low for w in ("warning", "error", "traceback", "too many", "refused", "timed out", "lost",
                                      "busy", "cannot")):
            continue
        key = re.sub(r"\d+", "#", line)
        key = re.sub(r"^\S+ \S+ ", "", key)  # a timestamp
        counts[key[:200]] += 1
    return [f"{n} x {k}" for k, n in counts.most_common(limit)]


# -- the scenarios' results ---------------------------------------------------------


@dataclass
class Result:
    scenario: str  # "real 100", "sim 1000"
    path: str  # "fan-in" or "baseline"
    index: int
    agents: int
    ok: int
    nbytes: int  # payload bytes acknowledged (byte-exact checked)
    seconds: float  # the interval throughput is computed over
    total_s: float  # from the first connect/spawn to the last DONE/exit
    shadow_cpu_s: float
    shadow_hwm_mib: float
    shadow_max_fds: int
    latencies_ms: list[float] = field(default_factory=list)  # ack latencies (sim) or per-job wall (real)
    errors: dict[str, int] = field(default_factory=dict)
    shadow_problems: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def mb_s(self) -> float:
        """Achieved: payload bytes acknowledged per second (sim: counted from the ACKs by the load process, from
        the first DATA sent to the last ACK; real: the byte-exact bytes over spawn -> last exit)."""
        acked = self.notes.get("acked_bytes", self.nbytes)
        return acked / self.seconds / MB if self.seconds > 0 else 0.0

    @property
    def offered(self) -> float:
        return float(self.notes.get("offered_mb_s", math.nan))

    def held(self, p99_ms: float) -> bool:
        """Every agent finished byte-exact, nothing went wrong, and p99 ack <= p99_ms."""
        return self.ok == self.agents and not self.errors and percentile(self.latencies_ms, 99) <= p99_ms


# -- real gcwrap processes -----------------------------------------------------------


def wait_many(procs: list[subprocess.Popen[bytes]], deadline: float) -> list[tuple[float, float, int, bool]]:
    """Wait for every process (each in a thread, waitid WNOWAIT): (end, own CPU, exit status, timed out)."""
    ends: dict[int, float] = {}

    def waiter(pid: int) -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        ends[pid] = time.monotonic()

    threads = [threading.Thread(target=waiter, args=(p.pid,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    timed_out: set[int] = set()
    for t, p in zip(threads, procs):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            timed_out.add(p.pid)
            signal_tree(p, 15)
            t.join(5)
            if t.is_alive():
                signal_tree(p, 9)
                t.join(5)
    out = []
    for p in procs:
        try:
            cpu = proc_times(p.pid)[0]
        except (OSError, ValueError, IndexError):
            cpu = float("nan")
        _, status, _ = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.append((ends.get(p.pid, time.monotonic()), cpu, p.returncode, p.pid in timed_out))
    return out


class RealBench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.gcwrap, _ = tools()
        self.inputs: list[Path] = []
        self.hashes: list[str] = []
        self.commands: dict[str, str] = {}

    def prepare(self) -> None:
        rng = random.Random(SEED)
        indir = self.workdir / "inputs"
        indir.mkdir()
        for i in range(self.args.real):
            data = rng.randbytes(self.args.real_bytes)
            path = indir / f"in-{i:04d}"
            path.write_bytes(data)
            self.inputs.append(path)
            self.hashes.append(hashlib.sha256(data).hexdigest())

    def run(self, path: str, index: int) -> Result:
        fan = path == "fan-in"
        n = self.args.real
        rundir = self.workdir / f"real-{path}-{index}"
        home, spool = rundir / "home", rundir / "spool"
        shadow = ShadowProc(home, rundir)
        procs: list[subprocess.Popen[bytes]] = []
        watch: ShadowWatch | None = None
        try:
            port = shadow.wait_ready()
            tag = f"{os.getpid()}-{index}-{'f' if fan else 'b'}"
            jobs = ([[f"fanin/real-{i:04d}.out", ["cat", str(self.inputs[i])]] for i in range(n)] if fan
                    else [["fanin/real-all.out", ["cat", *map(str, self.inputs)]]])
            cmds = [[*self.gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", name, "--spool", str(spool),
                     "--job-id", f"real-{tag}-{k}", "--", *job] for k, (name, job) in enumerate(jobs)]
            self.commands.setdefault("gcshadow", shlex.join(shadow.cmd))
            self.commands.setdefault(f"gcwrap ({path}, first of {len(cmds)})",
                                     shlex.join(cmds[0]) if fan else shlex.join(cmds[0][:-n]) + " ... (all inputs)")
            watch = ShadowWatch(shadow.pid)
            watch.start()
            os.sync()
            time.sleep(0.2)
            cpu0 = shadow.cpu()
            logs = []
            t0 = time.monotonic()
            for k, cmd in enumerate(cmds):
                log = open(rundir / f"gcwrap-{k}.log", "wb")  # noqa: SIM115 - closed below
                logs.append(log)
                procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                              start_new_session=True))
            spawned = time.monotonic() - t0
            outcomes = wait_many(procs, t0 + self.args.timeout)
            for log in logs:
                log.close()
            end = max(o[0] for o in outcomes)
            time.sleep(0.25)
            cpu = shadow.cpu() - cpu0
            hwm = shadow.hwm_mib()
            watch.stopping.set()
            errors: collections.Counter[str] = collections.Counter()
            ok = 0
            nbytes = 0
            for k, (_end, _cpu, rc, timed_out) in enumerate(outcomes):
                if timed_out or rc != 0:
                    text = (rundir / f"gcwrap-{k}.log").read_text(errors="replace").strip().splitlines()
                    errors[f"gcwrap exit {rc}{' (timed out)' if timed_out else ''}: "
                           f"{re.sub(r'[0-9]+', '#', text[-1]) if text else ''}"] += 1
                    continue
                name = jobs[k][0]
                landed = home / name
                want = self.hashes[k] if fan else None
                if not fan:
                    h = hashlib.sha256()
                    for p in self.inputs:
                        h.update(p.read_bytes())
                    want = h.hexdigest()
                size = self.args.real_bytes * (1 if fan else n)
                if not landed.exists() or landed.stat().st_size != size or sha256_file(landed) != want:
                    errors["landed file differs from the job's output"] += 1
                    continue
                ok += 1
                nbytes += size
            walls = [(o[0] - t0) * 1000 for o in outcomes]
            own = [o[1] for o in outcomes]
            return Result(
                scenario=f"real {n}", path=path, index=index, agents=len(cmds), ok=ok, nbytes=nbytes,
                seconds=end - t0, total_s=end - t0, shadow_cpu_s=cpu, shadow_hwm_mib=hwm,
                shadow_max_fds=watch.max_fds, latencies_ms=walls, errors=dict(errors),
                shadow_problems=log_problems(shadow.log_tail(10**7)),
                notes={"spawn_s": spawned, "gcwrap_cpu_s_total": sum(own), "shadow_nofile": nofile_limit(shadow.pid)},
            )
        finally:
            if watch is not None:
                watch.stopping.set()
            for p in procs:
                if p.returncode is None:
                    signal_tree(p, 9)
                    p.wait(10)
            shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)


# -- the load generator ---------------------------------------------------------------


def leaf(e: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups that is not a cancellation."""
    import trio

    while isinstance(e, BaseExceptionGroup):
        inner = [x for x in e.exceptions if not isinstance(x, trio.Cancelled)] or list(e.exceptions)
        e = inner[0]
    return e


class Generator:
    """N simulated agents in one trio run, or one agent sending all of their frames (the baseline)."""

    def __init__(self, args: argparse.Namespace, n: int, src: bytes) -> None:
        self.args = args
        self.n = n
        self.src = memoryview(src)
        self.frame = args.frame
        self.frames = args.frames
        self.per_agent = self.frame * self.frames
        self.latencies: list[float] = []
        self.steady: list[float] = []  # the latencies of every frame but each agent's first
        self.errors: collections.Counter[str] = collections.Counter()
        self.connected = 0
        self.failed = 0
        self.arrived_failed = 0  # agents that failed before their WELCOME
        self.through = 0  # agents with every byte acknowledged, or failed (the exit barrier)
        self.idle_fds = -1  # the shadow's open descriptors after --idle seconds with every agent idle
        self.finished = 0
        self.acked_bytes = 0
        self.first_send: float | None = None
        self.last_ack = 0.0
        self.exits: list[float] = []  # when each agent sent its EXIT
        self.connect_s: list[float] = []
        self.lags: list[float] = []  # seconds each DATA frame was sent after its due time (paced only)
        self.ack_bins: collections.Counter[int] = collections.Counter()  # bytes acked per second since t_start
        self.all_connected_at = math.nan  # seconds from the start until every agent had its WELCOME (or failed)
        self.shadow_pid = 0  # the shadow's CPU, read at the first DATA frame sent and when every byte is acked:
        self.cpu_first_send = math.nan  # what the data phase cost it, without connections coming and going
        self.cpu_all_acked = math.nan

    def _shadow_cpu(self) -> float:
        try:
            return proc_times(self.shadow_pid)[0] if self.shadow_pid else math.nan
        except (OSError, ValueError, IndexError):
            return math.nan

    def results(self, t_start: float, t_end: float) -> dict[str, Any]:
        """What the parent process needs, as JSON: durations only (trio's clock has an arbitrary origin)."""
        first = self.first_send if self.first_send is not None else t_start
        return {
            "latencies_ms": self.latencies, "steady_ms": self.steady, "errors": dict(self.errors),
            "connected": self.connected,
            "failed": self.failed, "finished": self.finished, "acked_bytes": self.acked_bytes,
            "data_s": max(1e-9, self.last_ack - first) if self.last_ack else math.nan,
            "total_s": t_end - t_start, "first_send_s": first - t_start, "connect_s": self.connect_s,
            "lags_s": self.lags, "all_connected_s": self.all_connected_at,
            "ack_bins": sorted(self.ack_bins.items()),
            "data_cpu_s": self.cpu_all_acked - self.cpu_first_send,
            # EXITs sent before the last ACK of the data phase arrived: 0 with the exit barrier
            "exits_in_data_phase": sum(1 for t in self.exits if t < self.last_ack),
            "idle_fds": self.idle_fds,
        }

    def payload(self, i: int) -> memoryview:
        start = (i * 7919) % SRC_SPAN
        return self.src[start:start + self.per_agent]

    def schedule(self, agents: list[int]) -> Iterator[tuple[float, memoryview]]:
        """(due offset in seconds, frame) in sending order for these agents: frame k of agent i at
        (i/N + k) x interval."""
        iv = self.args.interval
        for k in range(self.frames):
            for i in agents:
                yield (i / self.n + k) * iv, self.payload(i)[k * self.frame:(k + 1) * self.frame]

    async def run(self, baseline: bool, port: int, tag: str) -> tuple[float, float]:
        import trio

        self.all_connected = trio.Event()
        self.all_through = trio.Event()
        self.all_acked = trio.Event()
        self.expect = 1 if baseline else self.n
        self.connect_limit = trio.Semaphore(self.args.connect_concurrency)
        self.t_start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._idle)
            if baseline:
                nursery.start_soon(self.agent, 0, list(range(self.n)), port, f"sim-{tag}-all", "fanin/sim-all.out")
            else:
                for i in range(self.n):
                    nursery.start_soon(self.agent, i, [i], port, f"sim-{tag}-{i}", f"fanin/sim-{i:05d}.out")
            with trio.move_on_after(self.args.barrier_timeout):
                await self.all_connected.wait()
            self.all_connected_at = trio.current_time() - self.t_start
            if not self.all_connected.is_set():
                self.errors[f"barrier: only {self.connected} of {self.expect} agents connected after "
                            f"{self.args.barrier_timeout:g} s; the others went on anyway"] += 1
                self._start_data()
        return self.t_start, trio.current_time()

    def _arrived(self) -> None:
        if self.connected + self.arrived_failed >= self.expect:
            self._start_data()

    def _start_data(self) -> None:
        """The connect barrier opens: the data phase starts."""
        if not self.all_connected.is_set():
            # What every agent holds is long-lived from here on: out of the
            # collector's sight, so that a full collection (seconds with
            # 10 000 agents' objects) never stops the load process in the
            # data phase, where its pauses would count as the shadow's ack
            # latency and as send lag.
            gc.freeze()
            gc.enable()
        self.all_connected.set()

    def _through(self) -> None:
        """One more agent has every byte acknowledged (or failed): the exit barrier."""
        self.through += 1
        if self.through >= self.expect:
            self.all_acked.set()

    async def _idle(self) -> None:
        """Every agent connected and idle for --idle seconds: count the shadow's descriptors, then let them exit."""
        import trio

        await self.all_acked.wait()
        if self.args.idle > 0:
            await trio.sleep(self.args.idle)
            try:
                self.idle_fds = len(os.listdir(f"/proc/{self.shadow_pid}/fd"))
            except OSError:
                pass
        self.all_through.set()

    async def agent(self, i: int, owners: list[int], port: int, job_id: str, name: str) -> None:
        import trio

        from gcwrap.wire.events import Ack, Done, Error, Exit, Hello, Ping, Pong, StreamSpec, Welcome
        from gcwrap.wire.events import Data as DataEv
        from gcwrap.wire.protocol import NEED_DATA, Connection, Role

        phase = "connect"
        counted = False
        conn = Connection(Role.AGENT)
        sent: collections.deque[tuple[int, float, bool]] = collections.deque()  # (end offset, send time, first)
        through = [False]  # counted at the exit barrier
        total = self.per_agent * len(owners)
        try:
            with trio.fail_after(self.args.timeout):
                # The semaphore bounds the agents connecting and handshaking at once (a SYN
                # flood would overflow the listen backlog); it is released at WELCOME, so every
                # agent stays connected at the same time.
                async with self.connect_limit:
                    t0 = trio.current_time()
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    try:
                        phase = "handshake"
                        hello = Hello(job_id=job_id, instance=f"b{os.getpid()}", host="loadgen", user="bench",
                                      streams=(StreamSpec(1, "stdout", name),), command=("fanin-sim",))
                        await stream.send_all(conn.send(hello))
                        ev = await self._next(stream, conn, NEED_DATA)
                        if isinstance(ev, Error):
                            raise BenchError(f"ERROR {ev.code.name}: {ev.message}")
                        if not isinstance(ev, Welcome):
                            raise BenchError(f"expected WELCOME, got {type(ev).__name__}")
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
                    self.connect_s.append(trio.current_time() - t0)
                async with stream:
                    self.connected += 1
                    counted = True
                    self._arrived()
                    await self._session(stream, conn, owners, sent, total, trio, Ack, Done, Error, Exit, Ping,
                                        Pong, DataEv, NEED_DATA, through)
                    self.finished += 1
        except BaseException as caught:  # every failure is counted by phase and kind
            if isinstance(caught, (KeyboardInterrupt, SystemExit, trio.Cancelled)):
                raise
            e = leaf(caught)
            msg = str(e) or type(e).__name__
            if isinstance(e, trio.TooSlowError):
                msg = f"no progress within {self.args.timeout:g} s"
            if isinstance(e, OSError) and e.errno is not None:
                msg = f"{type(e).__name__} [errno {e.errno}] {os.strerror(e.errno)}"
            if hasattr(e, "phase"):
                phase = e.phase
            brief = re.sub(r"[0-9]{3,}", "#", msg)[:160]
            self.errors[f"{getattr(e, 'phase', phase)}: {type(e).__name__}: {brief}"] += 1
            self.failed += 1
            if not through[0]:
                through[0] = True
                self._through()
            if not counted:
                self.arrived_failed += 1
                self._arrived()

    async def _next(self, stream: Any, conn: Any, need: Any) -> Any:
        while True:
            ev = conn.next_event()
            if ev is not need:
                return ev
            data = await stream.receive_some(65536)
            conn.receive_data(data)
            if not data:
                return conn.next_event()

    async def _session(self, stream: Any, conn: Any, owners: list[int], sent: Any, total: int, trio: Any, Ack: Any,
                       Done: Any, Error: Any, Exit: Any, Ping: Any, Pong: Any, DataEv: Any, NEED: Any,
                       through: list[bool]) -> None:
        acked = 0
        done = trio.Event()
        all_acked = trio.Event()
        send_lock = trio.Lock()
        phase = {"name": "barrier"}

        async def receiver() -> None:
            nonlocal acked
            while True:
                ev = await self._next(stream, conn, NEED)
                now = trio.current_time()
                if isinstance(ev, Ack):
                    while sent and sent[0][0] <= ev.offset:
                        _, t_sent, first = sent.popleft()
                        self.latencies.append((now - t_sent) * 1000)
                        if not first:
                            self.steady.append((now - t_sent) * 1000)
                    self.acked_bytes += ev.offset - acked
                    if self.acked_bytes >= self.n * self.per_agent and math.isnan(self.cpu_all_acked):
                        self.cpu_all_acked = self._shadow_cpu()
                    self.ack_bins[int(now - self.t_start)] += ev.offset - acked
                    acked = ev.offset
                    self.last_ack = max(self.last_ack, now)
                    if acked >= total:
                        all_acked.set()
                elif isinstance(ev, Done):
                    done.set()
                    return
                elif isinstance(ev, Pong):
                    continue
                elif isinstance(ev, Error):
                    err = BenchError(f"ERROR {ev.code.name}: {re.sub(r'[0-9]{3,}', '#', ev.message)}")
                    err.phase = phase["name"]  # type: ignore[attr-defined]
                    raise err
                else:
                    err = BenchError(f"unexpected {type(ev).__name__}")
                    err.phase = phase["name"]  # type: ignore[attr-defined]
                    raise err

        async def send(frame: bytes) -> None:
            async with send_lock:
                await stream.send_all(frame)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver)
            nonce = 0
            while not self.all_connected.is_set():
                with trio.move_on_after(5):
                    await self.all_connected.wait()
                if not self.all_connected.is_set():
                    nonce += 1
                    await send(conn.send(Ping(nonce)))
            phase["name"] = "data"
            t0 = trio.current_time()
            offset = 0
            for due, payload in self.schedule(owners):
                if self.args.interval > 0:
                    await trio.sleep_until(t0 + due)
                now = trio.current_time()
                if self.args.interval > 0:
                    self.lags.append(now - t0 - due)
                if self.first_send is None:
                    self.first_send = now
                    self.cpu_first_send = self._shadow_cpu()
                frame = conn.send(DataEv(1, offset, bytes(payload)))
                offset += len(payload)
                sent.append((offset, now, offset == len(payload)))
                await send(frame)
            phase["name"] = "ack wait"
            await all_acked.wait()
            through[0] = True
            self._through()
            phase["name"] = "exit barrier"
            await self.all_through.wait()
            phase["name"] = "exit"
            self.exits.append(trio.current_time())
            await send(conn.send(Exit(code=0, signal=None, lengths=((1, total),))))
            await done.wait()


def source(args: argparse.Namespace) -> bytes:
    """The bytes the simulated agents' payloads are cut from (the same in the parent and the load process)."""
    return random.Random(SEED + 1).randbytes(SRC_SPAN + args.frame * args.frames)


LOAD_ARGS = ("frame", "frames", "interval", "connect_concurrency", "barrier_timeout", "timeout", "idle")


def load_worker(params_file: Path, result_file: Path) -> int:
    """The load process: run the simulated agents (one trio run), write what happened to `result_file`."""
    import trio

    gc.disable()  # until every agent is connected (Generator._arrived): no full collections while they connect
    params = json.loads(params_file.read_text())
    args = argparse.Namespace(**params["args"])
    raise_nofile()
    gen = Generator(args, params["n"], source(args))
    gen.shadow_pid = int(params.get("shadow_pid", 0))
    try:
        t_start, t_end = trio.run(gen.run, params["baseline"], params["port"], params["tag"])
    except BaseException as e:  # counted, and reported by the parent
        if isinstance(e, KeyboardInterrupt):
            raise
        gen.errors[f"generator crashed: {type(e).__name__}: {e}"[:200]] += 1
        t_start = t_end = 0.0
    tmp = result_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(gen.results(t_start, t_end)))
    tmp.rename(result_file)
    return 0


class SimBench:
    def __init__(self, args: argparse.Namespace, workdir: Path, name: str = "") -> None:
        self.args = args
        self.workdir = workdir
        self.name = name  # the scenario's name in the figures ("sim N" if empty)
        self.src = source(args)
        self.commands: dict[str, str] = {}

    def run(self, n: int, path: str, index: int) -> Result:
        baseline = path == "baseline"
        rundir = self.workdir / f"sim{n}-{self.args.interval:g}-{path}-{index}"
        home = rundir / "home"
        mport = free_port() if HAVE_METRICS else 0  # (the shadow's own latency figures, from its histograms)
        shadow = ShadowProc(home, rundir, extra=["--metrics", f"127.0.0.1:{mport}"] if mport else [],
                            nofile=self.args.shadow_nofile)
        watch: ShadowWatch | None = None
        gen = Generator(self.args, n, self.src)  # for the payloads and the schedule: the load runs elsewhere
        load: subprocess.Popen[bytes] | None = None
        try:
            port = shadow.wait_ready()
            self.commands.setdefault("gcshadow", shlex.join(shadow.cmd))
            tag = f"{os.getpid()}-{n}-{index}-{'b' if baseline else 'f'}"
            params, result_file = rundir / "load.json", rundir / "load-result.json"
            params.write_text(json.dumps({"n": n, "baseline": baseline, "port": port, "tag": tag,
                                          "shadow_pid": shadow.pid,
                                          "args": {k: getattr(self.args, k) for k in LOAD_ARGS}}))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--load-worker", str(params), str(result_file)]
            if self.args.load_nice:  # (a session of its own already: niced too, it cannot starve the shadow)
                cmd = ["nice", "-n", str(self.args.load_nice), *cmd]
            self.commands.setdefault("load process", shlex.join(cmd))
            watch = ShadowWatch(shadow.pid)
            watch.start()
            os.sync()
            time.sleep(0.2)
            cpu0 = shadow.cpu()
            with open(rundir / "load.log", "wb") as log:
                t0 = time.monotonic()
                load = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
            r = wait_measured(load, t0 + self.args.timeout + self.args.barrier_timeout + 60)
            load_wall = r.end - t0
            time.sleep(0.25)
            cpu = shadow.cpu() - cpu0
            hwm = shadow.hwm_mib()
            watch.stopping.set()
            inside = shadow_histograms(mport) if mport else {}
            if r.timed_out or r.returncode != 0 or not result_file.exists():
                tail = (rundir / "load.log").read_text(errors="replace")[-1500:]
                raise BenchError(f"sim {n} {path} run {index}: the load process exited {r.returncode}"
                                 f"{' (timed out)' if r.timed_out else ''}\n{tail}")
            res = json.loads(result_file.read_text())
            errors: collections.Counter[str] = collections.Counter(res["errors"])
            finished = res["finished"]
            alive = shadow.proc.poll() is None
            if not alive:
                errors[f"the shadow exited with status {shadow.proc.returncode}"] += 1
            # byte-exactness of every finished agent's file
            ok = 0
            nbytes = 0
            mismatch = 0
            if baseline:
                h = hashlib.sha256()
                for _, frame in gen.schedule(list(range(n))):
                    h.update(frame)
                landed = home / "fanin/sim-all.out"
                if finished == 1:
                    whole = landed.exists() and landed.stat().st_size == n * gen.per_agent
                    if whole and sha256_file(landed) == h.hexdigest():
                        ok, nbytes = 1, n * gen.per_agent
                    else:
                        mismatch += 1
            else:
                for i in range(n):
                    landed = home / f"fanin/sim-{i:05d}.out"
                    if not landed.exists():
                        continue
                    want = hashlib.sha256(gen.payload(i)).hexdigest()
                    if landed.stat().st_size == gen.per_agent and sha256_file(landed) == want:
                        ok += 1
                        nbytes += gen.per_agent
                    elif finished == n:
                        mismatch += 1
                ok = min(ok, finished)
            if mismatch:
                errors[f"{mismatch} landed file(s) differ from the bytes sent"] += 1
            connect = res["connect_s"]
            lags = res["lags_s"]
            return Result(
                scenario=self.name or f"sim {n}", path=path, index=index, agents=1 if baseline else n, ok=ok,
                nbytes=nbytes,
                seconds=res["data_s"], total_s=res["total_s"], shadow_cpu_s=cpu, shadow_hwm_mib=hwm,
                shadow_max_fds=watch.max_fds, latencies_ms=res["latencies_ms"], errors=dict(errors),
                shadow_problems=log_problems(shadow.log_tail(10**8)),
                notes={"steady_p99_ms": percentile(res.get("steady_ms", []), 99) if res.get("steady_ms")
                       else math.nan,
                       "frames": len(res["latencies_ms"]),
                       "connect_p50_ms": percentile(connect, 50) * 1000 if connect else math.nan,
                       "connect_p99_ms": percentile(connect, 99) * 1000 if connect else math.nan,
                       "connect_max_ms": max(connect) * 1000 if connect else math.nan,
                       "all_connected_s": res["all_connected_s"],
                       "data_cpu_s": res.get("data_cpu_s", math.nan),
                       "exits_in_data_phase": res.get("exits_in_data_phase", -1),
                       "idle_fds": res.get("idle_fds", -1),
                       "acked_bytes": res["acked_bytes"],
                       "offered_mb_s": (n * self.args.frame / self.args.interval / MB) if self.args.interval > 0
                       else math.nan,
                       "lag_p99_ms": percentile(lags, 99) * 1000 if lags else math.nan,
                       "lag_max_ms": max(lags) * 1000 if lags else math.nan,
                       "load_cpu_s": r.rusage_cpu, "load_wall_s": load_wall,
                       **inside,
                       "shadow_nofile": nofile_limit(shadow.pid), "shadow_max_rss_mib": watch.max_rss_kib / 1024,
                       "shadow_threads": watch.max_threads, "connected": res["connected"]},
            )
        finally:
            if watch is not None:
                watch.stopping.set()
            if load is not None and load.returncode is None:
                signal_tree(load, 9)
                load.wait(10)
            shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)


# -- reporting -------------------------------------------------------------------------


try:
    import prometheus_client  # noqa: F401  (the shadow's metrics extra: without it, no figures from inside)

    HAVE_METRICS = True
except ImportError:
    HAVE_METRICS = False

# The shadow's histograms (gcshadow serve --metrics) read after a run: its
# own latency from a frame whole at home to the ACK of its durable group,
# and the group's sync and record, each as p99 (the upper bound of the
# bucket that holds it) in ms.
INSIDE = {"ack_inside_p99_ms": "gcshadow_ack_latency_seconds", "fsync_p99_ms": "gcshadow_fsync_seconds",
          "commit_p99_ms": "gcshadow_commit_seconds"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shadow_histograms(port: int) -> dict[str, float]:
    """INSIDE's p99s from the shadow's /metrics (NaN where it cannot be read)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return dict.fromkeys(INSIDE, math.nan)
    return {key: bucket_p99(text, name) for key, name in INSIDE.items()}


def bucket_p99(text: str, name: str) -> float:
    """The p99 of a Prometheus histogram in exposition `text`, in ms: the
    upper bound of the first bucket holding 99 % of the observations."""
    buckets = []
    for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M):
        buckets.append((math.inf if m.group(1) == "+Inf" else float(m.group(1)), float(m.group(2))))
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    return next(le for le, count in sorted(buckets) if count >= 0.99 * total) * 1000


def sim_spec(text: str, interval: float) -> tuple[int, float, bool]:
    """A --sim item: N agents at --interval, or N@SECONDS at an interval of
    its own (then named in its figures: "sim 10000 every 4 s")."""
    n, at, own = text.strip().partition("@")
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"{text!r}: a number of agents, or N@SECONDS")
    if not at:
        return int(n), interval, False
    seconds = float(own)
    if not seconds >= 0:
        raise ValueError(f"{text!r}: SECONDS must be 0 or more")
    return int(n), seconds, True


def per_agent_rate(args: argparse.Namespace) -> str:
    """The rate each simulated agent offers (--frame every --interval), said in every report."""
    if args.interval <= 0:
        return f"per agent: {args.frames} frames of {args.frame} B at once (unpaced)"
    return (f"per agent: {args.frame} B every {args.interval:g} s = {args.frame / args.interval / 1024:.1f} KiB/s, "
            f"{args.frames} frames")


def sim_line(r: Result) -> str:
    """One simulated run in one line."""
    return (f"{r.ok}/{r.agents} ok  achieved {r.mb_s:6.1f} of {r.offered:.1f} MB/s offered  {r.total_s:6.1f} s  "
            f"ack p50/p99/max {percentile(r.latencies_ms, 50):.1f}/{percentile(r.latencies_ms, 99):.1f}/"
            f"{max(r.latencies_ms, default=math.nan):.0f} ms "
            f"(steady p99 {r.notes.get('steady_p99_ms', math.nan):.1f}; inside the shadow p99 <= "
            f"{r.notes.get('ack_inside_p99_ms', math.nan):g}, sync <= {r.notes.get('fsync_p99_ms', math.nan):g}, "
            f"record <= {r.notes.get('commit_p99_ms', math.nan):g})  "
            f"shadow CPU {r.shadow_cpu_s:.2f} s (data phase {float(r.notes.get('data_cpu_s', math.nan)):.2f})  "
            f"RSS {r.shadow_hwm_mib:.0f} MiB  fds {r.shadow_max_fds} (idle {r.notes.get('idle_fds', -1)})  "
            "connect p50/p99/max "
            f"{r.notes['connect_p50_ms']:.0f}/{r.notes['connect_p99_ms']:.0f}/{r.notes['connect_max_ms']:.0f} ms  "
            f"send lag p99 {r.notes['lag_p99_ms']:.0f} ms  load CPU {r.notes['load_cpu_s']:.1f} s"
            + (f"  ERRORS {dict(list(r.errors.items())[:3])}" if r.errors else ""))


FANIN_TARGETS = {"ack latency (ms) p99": "<= 250 ms", "shadow peak RSS, VmHWM (MiB)": "<= 200 MB",
                 "shadow CPU-s per GB, data phase only": "<= 1.5x (at 10 000)",
                 "shadow open fds, every agent idle --idle s": "1 per agent"}


def target_of(scenario: str, label: str) -> str:
    """A sim scenario's target for a figure: FANIN_TARGETS, and from 10,000
    agents on an ack p99 of 100 ms at most (issue 31)."""
    if not scenario.startswith("sim"):
        return ""
    if label == "ack latency (ms) p99" and int(scenario.split()[1]) >= 10_000:
        return "<= 100 ms"
    return FANIN_TARGETS.get(label, "")


def is_key(scenario: str, label: str) -> bool:
    """Whether a figure goes in the README's table: FANIN_KEY's for the
    scenarios at --interval; for one at an interval of its own ("every 4 s")
    its ack latency, the agents' and the shadow's own, and past 10,000
    agents its descriptors."""
    if " every " not in scenario:
        return label in FANIN_KEY or bool(target_of(scenario, label))
    if label in (ACK_P99, INSIDE_P99):
        return True
    return int(scenario.split()[1]) > 10_000 and label == "shadow open fds, every agent idle --idle s"


ACK_P99 = "ack latency (ms) p99"
INSIDE_P99 = "ack p99 in the shadow (ms, bucket)"
FANIN_KEY = {ACK_P99, INSIDE_P99, "throughput (MB/s), spawn -> last exit", "achieved / offered",
             "connect+handshake p99 (ms)", "shadow open fds, max sampled", "shadow open fds, every agent idle --idle s"}


def report(results: list[Result], args: argparse.Namespace, record: Results | None = None) -> bool:
    ok_all = True
    scenarios = list(dict.fromkeys(r.scenario for r in results))
    for sc in scenarios:
        rs = [r for r in results if r.scenario == sc]
        real = sc.startswith("real")
        lat_label = "per-job wall (ms)" if real else "ack latency (ms)"
        n_runs = len([r for r in rs if r.path == "fan-in"])
        print(f"\n== {sc}: fan-in vs one agent moving the same bytes ({n_runs} runs) ==")
        rows = [["figure", "fan-in median", "min", "max", "baseline median", "min", "max", "fan-in/baseline"]]

        def line(label: str, key: Any, rs: list[Result] = rs, rows: list[list[str]] = rows, sc: str = sc) -> None:
            runs = {p: [float(key(r)) for r in rs if r.path == p] for p in ("fan-in", "baseline")}
            vals = {p: summary(runs[p]) for p in runs}
            if record is not None:
                key = is_key(sc, label)
                record.figure(f"fan-in, {sc}: {label}", "", runs["fan-in"], runs["baseline"], "one agent",
                              target_of(sc, label) if key else "", key=key)
            f, b = vals["fan-in"], vals["baseline"]
            ratio = f"{f[0] / b[0]:.2f}x" if b[0] and b[0] == b[0] and f[0] == f[0] else "-"
            rows.append([label, fmt(f[0]), fmt(f[1]), fmt(f[2]), fmt(b[0]), fmt(b[1]), fmt(b[2]), ratio])

        line("agents finished byte-exact", lambda r: r.ok)
        if real:
            line("throughput (MB/s), spawn -> last exit", lambda r: r.mb_s)
        else:
            line("offered (MB/s) while sending", lambda r: r.offered)
            line("achieved (MB/s): acked / (last ACK - first send)", lambda r: r.mb_s)
            line("achieved / offered", lambda r: r.mb_s / r.offered)
        line("total time (s)", lambda r: r.total_s)
        line(f"{lat_label} p50", lambda r: percentile(r.latencies_ms, 50))
        line(f"{lat_label} p99", lambda r: percentile(r.latencies_ms, 99))
        line(f"{lat_label} max", lambda r: max(r.latencies_ms) if r.latencies_ms else float("nan"))
        if not real:
            line("ack latency p99, steady: every frame but each agent's first (ms)",
                 lambda r: r.notes.get("steady_p99_ms", math.nan))
            line(INSIDE_P99, lambda r: r.notes.get("ack_inside_p99_ms", math.nan))
            line("durable group's sync p99 (ms, bucket bound)", lambda r: r.notes.get("fsync_p99_ms", math.nan))
            line("durable group's record p99 (ms, bucket bound)", lambda r: r.notes.get("commit_p99_ms", math.nan))
        line("shadow CPU (s)", lambda r: r.shadow_cpu_s)
        line("shadow CPU-s per GB", lambda r: r.shadow_cpu_s / (r.nbytes / 1e9) if r.nbytes else float("nan"))
        if not real:
            line("shadow CPU-s per GB, data phase only", lambda r: float(r.notes.get("data_cpu_s", math.nan))
                 / (r.nbytes / 1e9) if r.nbytes else float("nan"))
            line("shadow CPU per frame, data phase (ms)", lambda r: float(r.notes.get("data_cpu_s", math.nan))
                 * 1000 / r.notes["frames"] if r.notes.get("frames") else float("nan"))
        line("shadow peak RSS, VmHWM (MiB)", lambda r: r.shadow_hwm_mib)
        line("shadow open fds, max sampled", lambda r: r.shadow_max_fds)
        if not real:
            line("shadow open fds, every agent idle --idle s", lambda r: r.notes.get("idle_fds", -1))
        if real:
            line("gcwrap CPU, all processes (s)", lambda r: r.notes["gcwrap_cpu_s_total"])
        else:
            line("connect+handshake p50 (ms)", lambda r: r.notes["connect_p50_ms"])
            line("connect+handshake p99 (ms)", lambda r: r.notes["connect_p99_ms"])
            line("connect+handshake max (ms)", lambda r: r.notes["connect_max_ms"])
            line("all connected after (s)", lambda r: r.notes["all_connected_s"])
            line("send lag p99 (ms): frames sent late", lambda r: r.notes["lag_p99_ms"])
            line("load process CPU (s)", lambda r: r.notes["load_cpu_s"])
            line("load process CPU / its wall", lambda r: r.notes["load_cpu_s"] / r.notes["load_wall_s"])
        print(render_table(rows))
        if not real:
            print("  (the baseline is paced on the same schedule, so its achieved rate is the offered rate too; "
                  "fan-in/baseline compares latency and CPU, not capacity: see --ceiling)")
        fan = [r for r in rs if r.path == "fan-in"]
        print(f"shadow RLIMIT_NOFILE soft/hard: {fan[0].notes.get('shadow_nofile')}")
        failed = [r for r in rs if r.errors or r.ok != r.agents]
        for r in failed:
            ok_all = False
            print(f"  FAILED {r.path} run {r.index}: {r.ok} of {r.agents} agents finished byte-exact")
            for k, v in sorted(r.errors.items(), key=lambda kv: -kv[1]):
                print(f"    {v} x {k}")
            for p in r.shadow_problems:
                print(f"    shadow log: {p}")
        if not failed:
            print("  every agent of every run finished, every landed file byte-exact")
        if sc == "sim 1000" or (not real and args.check_targets):
            f_hwm = summary(r.shadow_hwm_mib for r in fan)[0]
            f_p99 = summary(percentile(r.latencies_ms, 99) for r in fan)[0]
            exact = all(r.ok == r.agents and not r.errors for r in fan)
            print(f"  targets ({sc}): byte-exact {'met' if exact else 'NOT met'}; shadow RSS {f_hwm:.0f} MiB <= 200: "
                  f"{'met' if f_hwm <= 200 else 'NOT met'}; p99 ack {f_p99:.0f} ms <= 250: "
                  f"{'met' if f_p99 <= 250 else 'NOT met'}")
    return ok_all


def ceiling(sb: SimBench, args: argparse.Namespace) -> tuple[list[Result], str]:
    """The most simulated agents one shadow holds: every agent byte-exact and p99 ack <= --ceiling-p99.

    Doubles the agent count from --ceiling-start until a probe fails (or
    --ceiling-max holds), halves it while the first probes fail, then bisects
    between the most that held and the fewest that did not until they are
    within --ceiling-resolution of each other. A probe is one run on a fresh
    shadow; the next probe starts only if its estimated time (the last probe's,
    scaled by the agent count) fits in what is left of --ceiling-budget.
    """
    started = time.monotonic()
    held: int | None = None
    failed: int | None = None
    probes: list[Result] = []
    n = args.ceiling_start
    last_s, last_n = 0.0, 1
    why = ""
    while True:
        estimate = last_s * max(1.0, n / last_n)
        if time.monotonic() - started + estimate > args.ceiling_budget:
            why = f"stopped: the next probe ({n} agents, about {estimate:.0f} s) would overrun --ceiling-budget"
            break
        t0 = time.monotonic()
        try:
            r: Result | None = sb.run(n, "fan-in", len(probes) + 1)
        except BenchError as e:  # the load process failed or timed out: this many did not hold
            r = None
            print(f"ceiling probe {len(probes) + 1}: {n:6} agents not held: {e}", flush=True)
        last_s, last_n = time.monotonic() - t0, n
        ok = r is not None and r.held(args.ceiling_p99)
        if r is not None:
            r.scenario = "ceiling"
            probes.append(r)
            print(f"ceiling probe {len(probes)}: {n:6} agents {'HELD' if ok else 'not held'}  " + sim_line(r),
                  flush=True)
        if ok:
            held = n if held is None else max(held, n)
        else:
            failed = n if failed is None else min(failed, n)
        if failed is None:
            if n >= args.ceiling_max:
                why = f"--ceiling-max ({args.ceiling_max}) held"
                break
            n = min(args.ceiling_max, 2 * n)
        elif held is None:
            if n <= 1:
                why = "not even one agent held"
                break
            n = max(1, n // 2)
        else:
            if failed <= held * (1 + args.ceiling_resolution) or failed - held <= 1:
                why = f"resolution reached (within {100 * args.ceiling_resolution:.0f}%)"
                break
            n = (held + failed) // 2
            step = 10 ** max(0, len(str(failed - held)) - 2)  # round to 2 significant digits of the gap
            n = max(held + 1, min(failed - 1, round(n / step) * step))
    text = (f"ceiling (p99 ack <= {args.ceiling_p99:g} ms, every agent byte-exact, {args.frames} frames x "
            f"{args.frame:,} B per agent every {args.interval:g} s): "
            + (f"{held} agents held" if held is not None else "no probe held")
            + (f"; {failed} did not" if failed is not None else "")
            + f" ({len(probes)} probes in {time.monotonic() - started:.0f} s; {why})")
    return probes, text


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--load-worker":
        return load_worker(Path(sys.argv[2]), Path(sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", type=int, default=100, help="real gcwrap processes (0: skip; default 100)")
    parser.add_argument("--real-bytes", type=parse_size, default=4 * MB, help="bytes per real job (default 4MB)")
    parser.add_argument("--sim", default="1000,10000",
                        help="simulated agent counts, comma-separated ('' to skip); N@SECONDS: N agents sending "
                             "every SECONDS instead of --interval (10000@4: a quarter of the rate)")
    parser.add_argument("--frame", type=parse_size, default=16 << 10, help="DATA payload bytes (default 16KiB)")
    parser.add_argument("--frames", type=int, default=8, help="DATA frames per simulated agent (default 8)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between an agent's frames (default 1; 0: all at once). Each agent's rate is "
                             "--frame per --interval (16 KiB/s by default; a batch job's console is more like "
                             "--frame 1KiB), printed with every scenario")
    parser.add_argument("--connect-concurrency", type=int, default=512,
                        help="simulated agents connecting/handshaking at once (default 512)")
    parser.add_argument("--barrier-timeout", type=float, default=120.0,
                        help="seconds to wait for every agent to connect before sending anyway (default 120)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each scenario and of its baseline (default 5)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run / per agent (600)")
    parser.add_argument("--check-targets", action="store_true", help="print the targets for every sim scenario")
    parser.add_argument("--ceiling", action="store_true",
                        help="after the scenarios, find the most simulated agents one shadow holds at p99 ack <= "
                             "--ceiling-p99 (doubling, then bisecting; one run per probe)")
    parser.add_argument("--ceiling-p99", type=float, default=250.0, help="p99 ack latency a probe must hold (ms)")
    parser.add_argument("--ceiling-start", type=int, default=1000, help="agents in the first probe (default 1000)")
    parser.add_argument("--ceiling-max", type=int, default=32000, help="most agents probed (default 32000)")
    parser.add_argument("--ceiling-resolution", type=float, default=0.1,
                        help="stop when the fewest that failed are within this fraction of the most that held (0.1)")
    parser.add_argument("--ceiling-budget", type=float, default=1500.0,
                        help="seconds the search may take (default 1500); a probe that would overrun is not started")
    parser.add_argument("--idle", type=float, default=5.0,
                        help="seconds every simulated agent stays connected and idle after its last ACK, before "
                             "the shadow's descriptors are counted and the agents exit (default 5; 0: no pause)")
    parser.add_argument("--load-nice", type=int, default=10,
                        help="niceness of the load process, which runs in a session of its own (default 10; 0: none)")
    parser.add_argument("--shadow-nofile", type=int, default=0,
                        help="the simulated agents' shadow under this descriptor limit (soft and hard) instead "
                             "of this machine's hard limit: 10000 agents in 16384 are as 20000 in 32768")
    parser.add_argument("--tmpdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    results_option(parser, "fanin")
    args = parser.parse_args(argv)
    try:
        sims = [sim_spec(x, args.interval) for x in args.sim.split(",") if x.strip()]
    except ValueError as e:
        parser.error(f"--sim: {e}")
    install_signal_handlers()
    soft, hard = raise_nofile()
    record = Results("fanin", args.json)
    print(header("fanin"), flush=True)
    print(f"RLIMIT_NOFILE of this process and the load processes it starts, raised to the hard limit: "
          f"{soft}/{hard}")
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-fanin-", dir=args.tmpdir))
    results: list[Result] = []
    commands: dict[str, str] = {}
    with guarded("fanin", workdir, args.keep) as outcome:
        print(f"real: {args.real} x {args.real_bytes:,} bytes; sim: {[n for n, _, _ in sims]} agents x "
              f"{args.frames} frames x "
              f"{args.frame:,} bytes, one frame per agent every {args.interval:g} s; runs: {args.runs}; "
              f"work dir {workdir}", flush=True)
        if args.real:
            rb = RealBench(args, workdir)
            rb.prepare()
            for i in range(1, args.runs + 1):
                for path in ("fan-in", "baseline"):
                    r = rb.run(path, i)
                    results.append(r)
                    print(f"real {args.real:5} {path:8} run {i}: {r.ok}/{r.agents} ok  {r.mb_s:7.1f} MB/s  "
                          f"{r.total_s:6.1f} s  per-job wall p50/p99 {percentile(r.latencies_ms, 50):.0f}/"
                          f"{percentile(r.latencies_ms, 99):.0f} ms  shadow CPU {r.shadow_cpu_s:.2f} s  "
                          f"RSS {r.shadow_hwm_mib:.0f} MiB  fds {r.shadow_max_fds}"
                          + (f"  ERRORS {r.errors}" if r.errors else ""), flush=True)
            commands.update(rb.commands)
        for n, interval, named in sims:
            sargs = argparse.Namespace(**{**vars(args), "interval": interval})
            sb = SimBench(sargs, workdir, f"sim {n}" + (f" every {interval:g} s" if named else ""))
            offered = n * args.frame / interval / MB if interval > 0 else float("inf")
            print(f"{sb.name}: {n * args.frame * args.frames / MB:.0f} MB in all, offered "
                  f"{offered:.1f} MB/s while sending; {per_agent_rate(sargs)}", flush=True)
            for i in range(1, args.runs + 1):
                for path in ("fan-in", "baseline"):
                    r = sb.run(n, path, i)
                    results.append(r)
                    print(f"{sb.name} {path:8} run {i}: " + sim_line(r), flush=True)
            commands.update(sb.commands)
        ceiling_text = ""
        if args.ceiling:
            sb = SimBench(args, workdir)
            print(f"ceiling search: from {args.ceiling_start} agents, at most {args.ceiling_max}, budget "
                  f"{args.ceiling_budget:.0f} s; {per_agent_rate(args)}", flush=True)
            _probes, ceiling_text = ceiling(sb, args)
            commands.update(sb.commands)
        print("\ncommands (first run):")
        for name, cmd in commands.items():
            print(f"  {name}: {cmd}")
        if sims:
            print("  load generator: a process of its own (trio), one TCP connection per simulated agent")
        print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        for name, cmd in commands.items():
            record.command(name, cmd)
        for r in results:
            record.run(scenario=r.scenario, path=r.path, index=r.index, agents=r.agents, ok=r.ok,
                       mb_s=r.mb_s, total_s=r.total_s, shadow_cpu_s=r.shadow_cpu_s, shadow_hwm_mib=r.shadow_hwm_mib,
                       ack_p50_ms=percentile(r.latencies_ms, 50), ack_p99_ms=percentile(r.latencies_ms, 99),
                       errors=r.errors, notes=r.notes)
        if results and not report(results, args, record):
            outcome.status = 1
        if ceiling_text:
            print("\n" + ceiling_text)
            record.data["ceiling"] = ceiling_text
        if outcome.status == 0:
            record.write()
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
