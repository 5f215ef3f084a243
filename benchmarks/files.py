#!/usr/bin/env python3
"""The files a job writes (`--file`): what they cost on the wire and in time.

Two measurements, each against its baseline in the same run:

1. **Scattered writes** (bytes on the wire against the file's size). A job
   writes a binary of `--scattered-size` (random bytes), then, in `--steps`
   steps while gcwrap watches, pwrites `--blocks` blocks of 4 KiB at random
   offsets, then extends the file by `--extend` bytes and ends. Each step
   waits until home holds the previous content committed (read from the
   shadow's state: a version committed with that SHA-256), so that every
   step is a rewrite of a version home holds. Reported: the bytes gcwrap
   sent for the file (its own counters, `files_sent`: FILE_DATA payloads,
   resends included; `files_copied`: what home copied from the version it
   held) past the first version, against the bytes the job changed and
   against what sending each new version whole would cost (its size, once
   per step). Home's file is checked by SHA-256.

2. **An appended file against stdout of the same bytes**, end to end
   durable (gcwrap exits once every byte is acknowledged and, for the file,
   committed). The job is the same C process for both,
   `head -c N SOURCE`, its stdout either the file (`--file big.bin`) or
   gcwrap's pipe (`--stdout`), in pairs whose order alternates (file
   first, then stdout first, ...). Each run gets a fresh shadow, a `sync`
   and a pause before it; the landed file is checked by SHA-256. Reported:
   wall time (gcwrap's start to its exit), gcwrap's own CPU (without the
   job's) and the shadow's, medians with min and max, and the ratio of the
   medians and the median of the pairs' ratios.

Usage:
  python benchmarks/files.py [--size 1GiB] [--runs 3] [--scattered-size 64MiB] [--blocks 100] [--steps 5]
  python benchmarks/files.py --size 32MiB --runs 1 --scattered-size 4MiB --blocks 10 --steps 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import statistics
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
    tools,
    wait_measured,
)

BLOCK = 4096
SCATTERED_NAME = "data.bin"
APPENDED_NAME = "big.bin"

# The scattered job: argv = size, blocks, steps, extend, seed. After each step it waits for the
# gate file go-K (made by this script once home holds that step's content committed).
SCATTERED_JOB = r"""
import os, random, sys, time
size, blocks, steps, extend, seed = map(int, sys.argv[1:])
rnd = random.Random(seed)
def gate(k):
    end = time.monotonic() + 300
    while not os.path.exists(f"go-{k}"):
        if time.monotonic() > end:
            sys.exit(f"no go-{k} within 300 s")
        time.sleep(0.02)
fd = os.open("data.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
left = size
while left:
    n = min(left, 1 << 20)
    os.write(fd, rnd.randbytes(n))
    left -= n
gate(0)
for k in range(steps):
    for _ in range(blocks // steps + (k < blocks % steps)):
        os.pwrite(fd, rnd.randbytes(4096), rnd.randrange(size // 4096) * 4096)
    gate(k + 1)
os.pwrite(fd, rnd.randbytes(extend), size)
os.close(fd)
"""


def scattered_contents(size: int, blocks: int, steps: int, extend: int, seed: int) -> list[bytes]:
    """The file's content after each step of SCATTERED_JOB (the same draws), and its final one."""
    rnd = random.Random(seed)
    data = bytearray()
    while len(data) < size:
        data += rnd.randbytes(min(size - len(data), 1 << 20))
    out = [bytes(data)]
    for k in range(steps):
        for _ in range(blocks // steps + (k < blocks % steps)):
            block = rnd.randbytes(BLOCK)
            at = rnd.randrange(size // BLOCK) * BLOCK
            data[at:at + BLOCK] = block
        out.append(bytes(data))
    data += rnd.randbytes(extend)
    out.append(bytes(data))
    return out


def summary_of(root: Path, job_id: str) -> dict[str, str]:
    """gcwrap's I/O summary of the job, as home recorded it from its EXIT (`gcshadow jobs --json`)."""
    _, gcshadow = tools()
    out = subprocess.run([*gcshadow, "jobs", "--json", "--root", str(root)], capture_output=True, timeout=60,
                         check=False)
    try:
        jobs = json.loads(out.stdout)
    except ValueError:
        raise BenchError(f"gcshadow jobs --json: {out.stderr.decode(errors='replace')[-500:]}") from None
    rec = next((j for j in jobs if j.get("job_id") == job_id), None)
    if rec is None:
        raise BenchError(f"home has no record of job {job_id}")
    return {str(k): str(v) for k, v in (rec.get("summary") or {}).items()}


def committed_with(root: Path, job_id: str, sha: str) -> bool:
    """Whether the shadow's state holds a version of the job's file committed with this SHA-256."""
    try:
        db = sqlite3.connect(f"file:{root / '.gcshadow' / 'state.db'}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return False
    try:
        row = db.execute("SELECT 1 FROM file_versions WHERE job_id = ? AND sha256 = ? AND committed >= 0",
                         (job_id, sha)).fetchone()
    except sqlite3.Error:
        return False
    finally:
        db.close()
    return row is not None


def scattered(args: argparse.Namespace, work: Path, record: Results | None = None) -> list[list[str]]:
    import hashlib

    gcwrap, _ = tools()
    size, blocks, steps, extend = parse_size(args.scattered_size), args.blocks, args.steps, parse_size(args.extend)
    if size % BLOCK or size < BLOCK:
        raise BenchError("--scattered-size must be a positive multiple of 4 KiB")
    contents = scattered_contents(size, blocks, steps, extend, seed=7)
    shas = [hashlib.sha256(c).hexdigest() for c in contents]
    root, jobdir = work / "home-scattered", work / "job-scattered"
    jobdir.mkdir()
    with ShadowProc(root, work / "run-scattered") as shadow:
        shadow.wait_ready()
        log = work / "gcwrap-scattered.log"
        cmd = [*gcwrap, "--shadow", f"127.0.0.1:{shadow.port}", "--spool", str(work / "spool-scattered"),
               "--job-id", "scattered", "--file", SCATTERED_NAME, "--",
               sys.executable, "-c", SCATTERED_JOB, str(size), str(blocks), str(steps), str(extend), "7"]
        print("scattered: " + " ".join(cmd[:cmd.index("-c") + 1]) + " SCATTERED_JOB " + " ".join(cmd[-5:]),
              flush=True)
        start = time.monotonic()
        with open(log, "wb") as lf:
            proc = subprocess.Popen(cmd, cwd=jobdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=lf, start_new_session=True)
        try:
            for k in range(steps + 1):  # home commits step k's content: the job may go on
                deadline = time.monotonic() + args.timeout
                while not committed_with(root, "scattered", shas[k]):
                    if proc.poll() is not None:
                        raise BenchError(f"gcwrap exited with {proc.returncode} at step {k}:\n"
                                         + log.read_text(errors="replace")[-3000:])
                    if time.monotonic() > deadline:
                        raise BenchError(f"home did not commit step {k} within {args.timeout:.0f} s")
                    time.sleep(0.05)
                (jobdir / f"go-{k}").touch()
        finally:
            r = wait_measured(proc, time.monotonic() + args.timeout)
        if r.returncode != 0 or r.timed_out:
            raise BenchError(f"gcwrap exited {r.returncode} (timed out: {r.timed_out}):\n"
                             + log.read_text(errors="replace")[-3000:])
        if sha256_file(root / SCATTERED_NAME) != shas[-1]:
            raise BenchError(f"home's {SCATTERED_NAME} differs from what the job left")
        s = summary_of(root, "scattered")
    sent, copied = int(s.get("files_sent", "0")), int(s.get("files_copied", "0"))
    later = sent - size  # (the first version is sent whole: nothing at home to build it from)
    changed = blocks * BLOCK + extend
    whole = steps * size + (size + extend)  # each rewrite sent whole, as a copy of the file would be
    print(f"scattered: {r.end - start:.1f} s; files_sent {sent:,} B, files_copied {copied:,} B", flush=True)
    if record is not None:
        record.command("scattered", " ".join(cmd[:cmd.index("-c") + 1]) + " SCATTERED_JOB " + " ".join(cmd[-5:]))
        record.run(part="scattered", seconds=r.end - start, files_sent=sent, files_copied=copied, size=size,
                   changed=changed, whole=whole)
        record.figure(f"files: bytes sent for {blocks} scattered 4 KiB blocks in {steps} steps and +{extend:,} B "
                      f"of a {size / (1 << 20):g} MiB file", "bytes", [later], [whole],
                      "each version whole", key=True)
    return [
        ["scattered writes", "bytes"],
        ["file size (first version, sent whole)", f"{size:,}"],
        [f"bytes the job changed after it ({blocks} x 4 KiB in {steps} steps, then +{extend:,})", f"{changed:,}"],
        ["gcwrap sent for them (files_sent less the first version)", f"{later:,}"],
        ["home copied from the version it held (files_copied)", f"{copied:,}"],
        ["each new version sent whole (the baseline)", f"{whole:,}"],
        ["sent / file size (per step)", f"{later / (steps + 1) / size:.3f}"],
        ["sent / changed bytes", f"{later / changed:.1f}"],
        ["sent / baseline", f"{later / whole:.4f}"],
    ]


@dataclass
class AppendRun:
    kind: str
    index: int
    seconds: float
    gcwrap_cpu: float
    shadow_cpu: float


def append_run(args: argparse.Namespace, work: Path, source: Path, want: str, kind: str, index: int,
               size: int) -> AppendRun:
    gcwrap, _ = tools()
    root, rundir, jobdir = work / f"home-{kind}-{index}", work / f"run-{kind}-{index}", work / f"job-{kind}-{index}"
    jobdir.mkdir()
    job = ["head", "-c", str(size), str(source)]
    log = work / f"gcwrap-{kind}-{index}.log"
    with ShadowProc(root, rundir) as shadow:
        shadow.wait_ready()
        common = [*gcwrap, "--shadow", f"127.0.0.1:{shadow.port}", "--spool", str(work / f"spool-{kind}-{index}"),
                  "--job-id", f"{kind}-{index}"]
        if kind == "file":
            cmd = [*common, "--file", APPENDED_NAME, "--", "sh", "-c", f'exec "$@" > {APPENDED_NAME}', "job", *job]
            landed = root / APPENDED_NAME
        else:
            cmd = [*common, "--stdout", APPENDED_NAME, "--", *job]
            landed = root / APPENDED_NAME
        if index == 0:
            print(f"{kind}: {' '.join(cmd)}", flush=True)
        os.sync()
        time.sleep(0.2)
        cpu0 = shadow.cpu()
        start = time.monotonic()
        with open(log, "wb") as lf:
            proc = subprocess.Popen(cmd, cwd=jobdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=lf, start_new_session=True)
        r = wait_measured(proc, start + args.timeout)
        seconds = r.end - start
        time.sleep(0.25)
        shadow_cpu = shadow.cpu() - cpu0
        if r.returncode != 0 or r.timed_out:
            raise BenchError(f"gcwrap ({kind}) exited {r.returncode} (timed out: {r.timed_out}):\n"
                             + log.read_text(errors="replace")[-3000:])
        if sha256_file(landed) != want:
            raise BenchError(f"{landed} differs from what the job wrote")
    for path in (landed, jobdir / APPENDED_NAME):
        path.unlink(missing_ok=True)
    return AppendRun(kind, index, seconds, r.own_cpu or 0.0, shadow_cpu)


def _ratio(a: float, b: float) -> str:
    """a/b as "1.23x"; "-" where b is nothing to divide by (a CPU time too short to count)."""
    return f"{a / b:.2f}x" if b > 0 else "-"


def appended(args: argparse.Namespace, work: Path, record: Results | None = None) -> list[list[str]]:
    size = parse_size(args.size)
    source = work / "source"
    with open(source, "wb") as f:
        left = size
        block = os.urandom(min(size, 64 << 20))
        while left:
            left -= f.write(block[:left])
    want = sha256_file(source)
    runs: dict[str, list[AppendRun]] = {"file": [], "stdout": []}
    for i in range(args.runs):
        for kind in (("file", "stdout") if i % 2 == 0 else ("stdout", "file")):
            r = append_run(args, work, source, want, kind, i, size)
            runs[kind].append(r)
            if record is not None:
                record.run(part="appended", **asdict(r))
            print(f"{kind:>6} run {i}: {r.seconds:.2f} s ({size / r.seconds / MB:.0f} MB/s), gcwrap CPU "
                  f"{r.gcwrap_cpu:.2f} s, shadow CPU {r.shadow_cpu:.2f} s", flush=True)
    rows = [[f"appended {size:,} B ({args.runs} pairs)", "--file median", "min", "max", "--stdout median", "min",
             "max", "file/stdout"]]
    for label, key in (("wall time (s)", "seconds"), ("gcwrap CPU (s)", "gcwrap_cpu"),
                       ("shadow CPU (s)", "shadow_cpu")):
        f = [getattr(r, key) for r in runs["file"]]
        s = [getattr(r, key) for r in runs["stdout"]]
        rows.append([label, fmt(statistics.median(f)), fmt(min(f)), fmt(max(f)), fmt(statistics.median(s)),
                     fmt(min(s)), fmt(max(s)), _ratio(statistics.median(f), statistics.median(s))])
    pairs = [f.seconds / s.seconds for f, s in zip(runs["file"], runs["stdout"])]
    if record is not None:
        record.command("appended", "gcwrap --shadow ... --file big.bin -- sh -c 'exec \"$@\" > big.bin' job head -c N "
                       "SOURCE (against --stdout big.bin -- head -c N SOURCE)")
        for label, key, target in (("wall time (s)", "seconds", "<= 1.5x"), ("gcwrap CPU (s)", "gcwrap_cpu", ""),
                                   ("shadow CPU (s)", "shadow_cpu", "")):
            record.figure(f"files: appended {size / (1 << 20):g} MiB --file vs --stdout, {label}", "",
                          [getattr(r, key) for r in runs["file"]], [getattr(r, key) for r in runs["stdout"]],
                          "--stdout", target)
    rows.append(["wall time, median of the pairs' ratios", "", "", "", "", "", "", f"{statistics.median(pairs):.2f}x"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="the appended file's size (and stdout's)")
    ap.add_argument("--runs", type=int, default=3, help="pairs of appended runs (file, stdout)")
    ap.add_argument("--scattered-size", default="64MiB")
    ap.add_argument("--blocks", type=int, default=100, help="4 KiB blocks written in place, in all")
    ap.add_argument("--steps", type=int, default=5, help="steps the blocks are written in")
    ap.add_argument("--extend", default="1MiB", help="bytes appended at the end")
    ap.add_argument("--skip", choices=("scattered", "appended"), default=None)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds any one run may take")
    ap.add_argument("--tmpdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    results_option(ap, "files")
    args = ap.parse_args()
    install_signal_handlers()
    record = Results("files", args.json)
    print(header("files"), flush=True)
    work = Path(tempfile.mkdtemp(prefix="gcwrap-files-", dir=args.tmpdir))
    with guarded("files.py", work, args.keep) as outcome:
        tables = []
        if args.skip != "scattered":
            tables.append(scattered(args, work, record))
        if args.skip != "appended":
            tables.append(appended(args, work, record))
        for rows in tables:
            print()
            print(render_table(rows))
        record.write()
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
