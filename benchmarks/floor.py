#!/usr/bin/env python3
"""Floor: what the wrapper's bulk path costs with nothing of gcwrap in it.

Bare loops, each in a fresh process, move SIZE bytes from a job's pipe
(`head -c SIZE /dev/zero`, pipe grown to 1 MiB) to a loopback TCP receiver
(a process that reads and discards), and report their own CPU (user+sys,
RUSAGE_SELF around the loop) per GiB. They are what the throughput target
("wrapper <= 1.5 CPU-s/GiB") is up against on this machine:

    read             read the pipe, 1 MiB at a time, and drop it (no spool, no network)
    copy             read, pwrite to a fresh file, send: a copying spool-then-send wrapper
    zero-copy        splice the pipe into a fresh file, sendfile it: gcwrap's bulk path
    zero-copy-reuse  the same, over the same 64 MiB of file again and again: gcwrap's bulk
                     path when delivery keeps up, so delivered segments are reused
    zero-copy-segments  zero-copy into 16 MiB segment files, each unlinked once the loop is
                     two segments past it: a spool that gives back what was delivered, so
                     freeing the page cache and blocks is paid inside the loop too (in
                     `zero-copy` it falls after the measurement, when the file is removed)

A job that outruns delivery (the throughput benchmark's does: head writes ~900
MB/s, delivery takes ~250) leaves a backlog that must be stored, so every
byte lands in new page-cache pages: the `zero-copy` row is its floor, the
`zero-copy-reuse` row the floor of a job the network keeps up with.

Then the CPU of `gcwrap --shadow ... --stdout NAME -- true` (start-up, spool,
handshake, EXIT, exit) against a live gcshadow: every job pays it once, so
1 GiB of output pays it per GiB.

The loops run in rotating order, RUNS times each; medians, min and max.
Every process has a timeout and is killed by pid; the shadow is stopped in a
finally.

Usage:
  python benchmarks/floor.py --runs 5
  python benchmarks/floor.py --runs 1 --size 64MiB       # smoke
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
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
    summary,
    tools,
)

LOOPS = ("read", "copy", "zero-copy", "zero-copy-reuse", "zero-copy-segments")
SEGMENT = 16 << 20
BLOCK = 1 << 20
RING = 64 << 20
F_SETPIPE_SZ = 1031


def loop(name: str, size: int, port: int, spill: Path) -> float:
    """One bare loop in this process; its CPU seconds."""
    sock = socket.create_connection(("127.0.0.1", port))
    job = subprocess.Popen(["head", "-c", str(size), "/dev/zero"], stdout=subprocess.PIPE)
    assert job.stdout is not None
    pipe = job.stdout.fileno()
    try:
        os.set_blocking(pipe, True)
        try:
            import fcntl

            fcntl.fcntl(pipe, F_SETPIPE_SZ, BLOCK)
        except OSError:
            pass
        fd = os.open(spill, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        segments = [spill]
        before = resource.getrusage(resource.RUSAGE_SELF)
        moved = pos = 0
        while True:
            if name == "zero-copy-segments" and pos == SEGMENT:
                # The next segment: a new file; the one two back is delivered.
                os.close(fd)
                segments.append(spill.with_name(f"{spill.name}.{moved // SEGMENT}"))
                fd = os.open(segments[-1], os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                if len(segments) > 2:
                    segments.pop(0).unlink()
                pos = 0
            if name == "read":
                n = len(os.read(pipe, BLOCK))
            elif name == "copy":
                data = os.read(pipe, BLOCK)
                n = len(data)
                os.pwrite(fd, data, pos)
                sock.sendall(data)
            else:
                n = os.splice(pipe, fd, min(BLOCK, SEGMENT - pos) if name == "zero-copy-segments" else BLOCK,
                              offset_dst=pos)
                sent = 0
                while sent < n:
                    sent += os.sendfile(sock.fileno(), fd, pos + sent, n - sent)
            if not n:
                break
            moved += n
            pos += n
            if name == "zero-copy-reuse" and pos >= RING:
                pos = 0
        os.close(fd)
        if name == "zero-copy-segments":
            for segment in segments:  # (all delivered now)
                segment.unlink()
        after = resource.getrusage(resource.RUSAGE_SELF)
        if moved != size:
            raise BenchError(f"{name}: moved {moved} bytes, expected {size}")
        return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    finally:
        sock.close()
        job.kill()
        job.wait(10)


RECEIVER = """
import socket, sys
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
buf = memoryview(bytearray(1 << 20))
while conn.recv_into(buf):
    pass
"""


def run_loop(name: str, size: int, workdir: Path, timeout: float) -> float:
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        done = subprocess.run([sys.executable, __file__, "--loop", name, "--size", str(size), "--port", str(port),
                               "--spill", str(workdir / f"spill-{name}")], capture_output=True, text=True,
                              timeout=timeout, check=False)
        if done.returncode:
            raise BenchError(f"loop {name} failed: {done.stderr.strip()[-500:]}")
        receiver.wait(timeout)
        return float(done.stdout.split()[-1])
    except subprocess.TimeoutExpired:
        raise BenchError(f"loop {name} took more than {timeout:.0f} s") from None
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(10)
        (workdir / f"spill-{name}").unlink(missing_ok=True)


def process_cpu(argv: list[str], timeout: float) -> float:
    """CPU seconds (user+sys) of one process run to its end."""
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + timeout
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode:
                raise BenchError(f"{argv} exited {proc.returncode}")
            return ru.ru_utime + ru.ru_stime
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise BenchError(f"{argv} timed out")
        time.sleep(0.005)


def startup_cpu(workdir: Path, runs: int, timeout: float) -> list[float]:
    gcwrap, _ = tools()
    out = []
    with ShadowProc(workdir / "home", workdir / "run") as shadow:
        port = shadow.wait_ready()
        for i in range(runs):
            out.append(process_cpu([*gcwrap, "-q", "--shadow", f"127.0.0.1:{port}", "--stdout", f"startup-{i}.out",
                                    "--spool", str(workdir / "spool"), "--job-id", f"floor-{i}", "--", "true"],
                                   timeout))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=parse_size, default=GiB, help="bytes per loop (default 1GiB)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each loop, rotated (default 5)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds allowed per loop (default 120)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--loop", choices=LOOPS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spill", type=Path, help=argparse.SUPPRESS)
    results_option(parser, "floor")
    args = parser.parse_args(argv)
    if args.loop:  # a child: run one loop, print its CPU seconds
        print(f"{loop(args.loop, args.size, args.port, args.spill):.6f}")
        return 0
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    install_signal_handlers()
    results = Results("floor", args.json)
    print(header("floor"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-floor-"))
    with guarded("floor", workdir, args.keep) as outcome:
        cpu: dict[str, list[float]] = {name: [] for name in LOOPS}
        for i in range(args.runs):
            order = LOOPS[i % len(LOOPS):] + LOOPS[: i % len(LOOPS)]
            for name in order:
                cpu[name].append(run_loop(name, args.size, workdir, args.timeout) * GiB / args.size)
                print(f"run {i + 1} {name:16} {cpu[name][-1]:.3f} CPU-s/GiB", flush=True)
                results.run(round=i + 1, loop=name, cpu_s_per_gib=cpu[name][-1])
        start = startup_cpu(workdir, max(3, args.runs), args.timeout)
        trio_cpu = [process_cpu([sys.executable, "-c", "import trio"], args.timeout) for _ in range(max(3, args.runs))]
        print()
        rows = [["loop", "CPU-s/GiB median", "min", "max"]]
        for name in LOOPS:
            rows.append([name, *map(fmt, summary(cpu[name]))])
        rows.append(["gcwrap -- true (CPU-s per job)", *map(fmt, summary(start))])
        rows.append(["python -c 'import trio' (CPU-s per process)", *map(fmt, summary(trio_cpu))])
        print(render_table(rows))
        fresh, reuse, segs = (summary(cpu[k])[0] for k in ("zero-copy", "zero-copy-reuse", "zero-copy-segments"))
        once, bare = summary(start)[0], summary(trio_cpu)[0]
        print()
        print(f"floor of a 1 GiB job that outruns delivery (zero-copy + start-up): {fresh + once:.2f} CPU-s/GiB")
        print(f"  the same, paying to free what was delivered (zero-copy-segments + start-up): {segs + once:.2f}; "
              f"with a bare trio start-up instead of gcwrap's: {segs + bare:.2f}")
        print(f"floor of a 1 GiB job delivery keeps up with (zero-copy-reuse + start-up): {reuse + once:.2f} CPU-s/GiB")
        results.command("loop", f"python benchmarks/floor.py --loop LOOP --size {args.size} --port PORT --spill FILE")
        results.command("start-up", "gcwrap --shadow 127.0.0.1:PORT --stdout NAME -- true")
        results.command("bare import", "python -c 'import trio'")
        for name in LOOPS:
            results.figure(f"floor: bare `{name}` loop, CPU-s/GiB (no gcwrap in it)", "CPU-s/GiB", cpu[name],
                           key=name in ("zero-copy", "zero-copy-reuse"))
        results.figure("floor: `gcwrap -- true` with a shadow, CPU-s per job, vs `python -c 'import trio'`", "CPU-s",
                       start, trio_cpu, "import trio", key=True)
        results.write()
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
