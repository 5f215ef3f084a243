"""`gcwrap demo`: the whole path on this machine, verified by checksum.

Starts a gcshadow on a free loopback port in a temporary root, runs a sample
job through gcwrap that writes pseudo-random bytes to stdout and text to
stderr, shows the bytes arriving at home, then compares sha256 sums.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from .units import parse_size  # noqa: F401 - re-exported for the CLI

# The sample job: deterministic bytes from a seed, written in bursts.
JOB = r"""
import random, sys, time
n, seed = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(seed)
left = n
i = 0
while left:
    chunk = rng.randbytes(min(left, 65536))
    sys.stdout.buffer.write(chunk)
    left -= len(chunk)
    i += 1
    if i % 16 == 0:
        sys.stdout.buffer.flush()
        sys.stderr.write(f"wrote {n - left} of {n} bytes\n")
        sys.stderr.flush()
        time.sleep(0.02)
sys.stdout.buffer.flush()
sys.stderr.write("done\n")
"""

def expected_stdout(n: int, seed: int) -> str:
    import random

    rng = random.Random(seed)
    h = hashlib.sha256()
    left = n
    while left:
        chunk = rng.randbytes(min(left, 65536))
        h.update(chunk)
        left -= len(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(1 << 20):
            h.update(data)
    return h.hexdigest()


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError("gcshadow exited before it was ready")
        time.sleep(0.02)
    raise RuntimeError("gcshadow did not start in time")


def run_demo(nbytes: int, keep: bool, console: Console | None = None) -> int:
    # soft_wrap: a line is never broken by us (a checksum stays whole when piped).
    console = console or Console(soft_wrap=True, highlight=False)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-demo-"))
    root, spool = workdir / "home", workdir / "spool"
    root.mkdir()
    seed = 5
    shadow_cmd = [sys.executable, "-c", "from gcwrap.shadow_cli import main; main()"]
    wrap_cmd = [sys.executable, "-m", "gcwrap"]
    console.print(f"[bold]gcwrap demo[/]: {nbytes:,} bytes through a spool and loopback TCP, in {workdir}")
    with open(workdir / "gcshadow.log", "wb") as shadow_log:  # (the child keeps its own copy)
        shadow = subprocess.Popen(
            [*shadow_cmd, "serve", "--port", "0", "--root", str(root), "--port-file", str(workdir / "port")],
            stderr=shadow_log, start_new_session=True,
        )
    try:
        try:
            port = _wait_for(workdir / "port", shadow, 20)
        except RuntimeError as e:
            console.print(f"[bold red]{e}[/]; its log:\n" + (workdir / "gcshadow.log").read_text(errors="replace"))
            return 1
        console.print(f"gcshadow listening on 127.0.0.1:{port}, root {root}")
        job = [sys.executable, "-c", JOB, str(nbytes), str(seed)]
        args = ["--shadow", f"127.0.0.1:{port}", "--stdout", "demo/out.5", "--stderr", "demo/err.5",
                "--job-id", f"demo-{os.getpid()}", "--spool", str(spool)]
        console.print(f"running: gcwrap {' '.join(args)} -- python -c SAMPLE_JOB {nbytes} {seed}", markup=False)
        wrapper = subprocess.Popen([*wrap_cmd, *args, "--", *job])
        out = root / "demo" / "out.5"
        started = time.monotonic()
        if console.is_terminal:
            with Progress(
                TextColumn("[cyan]arrived at home"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                console=console, transient=False,
            ) as progress:
                task = progress.add_task("out", total=nbytes)
                while wrapper.poll() is None:
                    progress.update(task, completed=out.stat().st_size if out.exists() else 0)
                    time.sleep(0.05)
                progress.update(task, completed=out.stat().st_size if out.exists() else 0)
        else:  # no bar in a pipe or a log: one line once it is over
            wrapper.wait()
            took = time.monotonic() - started
            landed = out.stat().st_size if out.exists() else 0
            console.print(f"arrived at home: {landed:,} of {nbytes:,} bytes in {took:.1f} s "
                          f"({landed / max(took, 1e-6) / 1e6:.1f} MB/s)")
        status = wrapper.returncode
        console.print(f"gcwrap exited with status {status} (the job's own)")
        want = expected_stdout(nbytes, seed)
        got = sha256_file(out) if out.exists() else "(missing)"
        err_text = (root / "demo" / "err.5").read_text() if (root / "demo" / "err.5").exists() else ""
        console.print(f"stdout sha256 written by the job: {want}")
        console.print(f"stdout sha256 landed at home:     {got}")
        console.print(f"stderr at home: {len(err_text.splitlines())} lines, last: {err_text.splitlines()[-1:]}")
        leftover = list(spool.glob("*.spool")) if spool.exists() else []
        ok = status == 0 and want == got and err_text.endswith("done\n") and not leftover
        console.print("[bold green]OK: byte-exact, spool emptied[/]" if ok else "[bold red]FAILED[/]")
        return 0 if ok else 1
    finally:
        shadow.send_signal(signal.SIGTERM)
        try:
            shadow.wait(10)
        except subprocess.TimeoutExpired:
            shadow.kill()
            shadow.wait()
        if keep:
            console.print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
