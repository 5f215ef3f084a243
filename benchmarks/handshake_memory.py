#!/usr/bin/env python3
"""Memory before authentication: what 1,000 unauthenticated connections make a token-protected shadow hold.

Rounds, each on N fresh connections (default 1,000) to one `gcshadow --token-file`:

    oversized   MAGIC, a HELLO header announcing 1 MiB + 64 bytes, then 1 MiB of body
                (the attack in the report: before, a frame was bounded only by the largest DATA frame)
    partial     MAGIC, a header announcing the largest control frame, and all of it but 64 bytes,
                then nothing (each connection holds as much as the protocol allows before WELCOME)

Each kind runs twice in a row: the second shows whether the first one's
memory was given back or reused (not kept and added to). Per round: the
shadow's RSS (VmRSS) before, its peak while the connections send (sampled),
and after they are closed and the shadow has closed its side.

With `--rev REV`, the same rounds run against gcshadow as of that git
revision too (its gcwrap/ extracted with `git archive` into a temporary
directory, first on PYTHONPATH), one shadow per code, one after the other.
A round stops sending once the shadow's RSS passes `--limit-mib` above where
it started (the old code would take the machine's memory).

Usage:
  python benchmarks/handshake_memory.py
  python benchmarks/handshake_memory.py --rev 4b0a388 --connections 1000
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

MIB = 1 << 20
MAGIC = b"GCWRAP\r\n"
HEADER = struct.Struct("!IB")
OVERSIZED = (1 << 20) + 64  # the largest DATA frame: what an unauthenticated peer could announce before
CONTROL_FRAME = (64 << 10) + 1  # the largest control frame: what it may announce now


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


def sockets(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            n += os.readlink(fd).startswith("socket:")
        except OSError:
            pass
    return n


def flood(port: int, pid: int, payload: bytes, n: int, seconds: float, limit: int) -> tuple[int, int, int]:
    """(RSS before, peak, after) of one round."""
    idle = sockets(pid)
    before = peak = rss(pid)
    socks: list[socket.socket] = []
    left: dict[int, tuple[socket.socket, memoryview]] = {}
    poll = select.poll()
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.setblocking(False)
            socks.append(s)
            left[s.fileno()] = s, memoryview(payload)
            poll.register(s, select.POLLOUT)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and peak - before <= limit:
            for fd, _ in poll.poll(50) if left else []:
                s, rest = left[fd]
                try:
                    rest = rest[s.send(rest[:65536]):]
                except OSError:  # refused and closed by the shadow
                    rest = rest[:0]
                left[fd] = s, rest
                if not rest:
                    del left[fd]
                    poll.unregister(fd)
            if not left:
                time.sleep(0.05)
            peak = max(peak, rss(pid))
    finally:
        for s in socks:
            s.close()
    ends = time.monotonic() + 60
    while sockets(pid) > idle and time.monotonic() < ends:
        time.sleep(0.1)
    time.sleep(1.5)  # a refused connection's lingering reads end within a second
    return before, peak, rss(pid)


def extract(rev: str, into: Path) -> Path:
    """gcwrap/ as of `rev`, in a directory to put first on PYTHONPATH."""
    archive = subprocess.run(["git", "-C", str(benchlib.REPO), "archive", rev, "gcwrap"], capture_output=True,
                             timeout=60, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, timeout=60, check=True)
    return into


def run_code(label: str, pythonpath: str | None, args: argparse.Namespace, work: Path,
             record: benchlib.Results | None = None) -> list[list[str]]:
    rows = []
    measured: dict[str, list[tuple[float, float, float]]] = {"oversized": [], "partial": []}
    token = work / f"token-{label}"
    token.write_text(os.urandom(32).hex() + "\n")
    token.chmod(0o600)
    saved = os.environ.get("PYTHONPATH")
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        shadow = benchlib.ShadowProc(work / f"root-{label}", work / f"run-{label}",
                                     extra=["--token-file", str(token), "--handshake-timeout", "60"])
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    with shadow:
        port = shadow.wait_ready()
        time.sleep(0.5)
        oversized = MAGIC + HEADER.pack(OVERSIZED, 1) + os.urandom(MIB)
        partial = MAGIC + HEADER.pack(CONTROL_FRAME, 1) + os.urandom(CONTROL_FRAME - 64)
        for kind, payload in (("oversized", oversized), ("oversized", oversized), ("partial", partial),
                              ("partial", partial)):
            before, peak, after = flood(port, shadow.pid, payload, args.connections, args.seconds,
                                        args.limit_mib * MIB)
            row = [label, kind, str(args.connections), f"{before / MIB:.1f}", f"{peak / MIB:.1f}",
                   f"{after / MIB:.1f}", f"{(after - before) / MIB:+.1f}"]
            print("  ".join(row), flush=True)
            rows.append(row)
            measured[kind].append((before / MIB, peak / MIB, after / MIB))
        if record is not None:
            record.command(f"gcshadow ({label})", shadow.cmd)
    if record is not None:
        for kind, values in measured.items():
            for before, peak, after in values:
                record.run(code=label, round=kind, connections=args.connections, before_mib=before, peak_mib=peak,
                           after_mib=after)
            record.figure(f"before authentication ({label}): peak RSS (MiB), {args.connections:,} connections "
                          f"sending {kind} frames", "MiB",
                          [v[1] for v in values], [v[0] for v in values], "RSS before", key=True)
            record.figure(f"before authentication ({label}): RSS after the {kind} connections close (MiB)", "MiB",
                          [v[2] for v in values], [v[0] for v in values], "RSS before")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=8.0, help="how long each round's connections send")
    ap.add_argument("--rev", action="append", default=[], help="also measure gcshadow as of this git revision")
    ap.add_argument("--limit-mib", type=int, default=2048, help="stop a round's sending past this much growth")
    benchlib.results_option(ap, "handshake_memory")
    args = ap.parse_args()
    benchlib.install_signal_handlers()
    benchlib.raise_nofile()
    record = benchlib.Results("handshake_memory", args.json)
    print(benchlib.header("handshake_memory"))
    rows = [["code", "round", "connections", "RSS before MiB", "peak MiB", "after MiB", "after - before"]]
    with tempfile.TemporaryDirectory(prefix="gcwrap-bench-") as tmp:
        work = Path(tmp)
        rows += run_code("HEAD" + ("" if benchlib.git_state()[1] else "+changes"), None, args, work, record)
        for rev in args.rev:
            code = work / f"code-{rev}"
            code.mkdir()
            rows += run_code(rev, str(extract(rev, code)), args, work, record)
    print(benchlib.render_table(rows))
    record.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
