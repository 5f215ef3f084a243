#!/usr/bin/env python3
"""Take the screenshots of the web view in README.md (docs/web-jobs.png,
docs/web-job.png, docs/web-phone.png).

Runs a gcshadow (with a token), `gcshadow web` and a few real gcwrap jobs on
loopback in a temporary directory (streaming, quiet, disconnected, failed,
done, and one with a wrong token, refused), then photographs the pages in
headless Chromium (the chromium and chromium-driver packages, with
selenium): the jobs page, a job's page with its timeline open and a search
in its output, and the jobs page in a phone's width. Every process is
stopped by pid at the end. It takes about 80 s: a job counts as quiet after
a minute without output.

    python docs/screenshots.py [--out docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = r"""
import sys, time, random
name, rate = sys.argv[1], float(sys.argv[3])
rng = random.Random(name)
loss = 2.5
for step in range(1, 100000):
    loss *= 0.995 + rng.random() * 0.004
    print(f"step {step:6d}  loss {loss:.4f}  lr 3.0e-4  {rng.randint(900, 1100)} samples/s", flush=True)
    if step % 25 == 0:
        print(f"checkpoint {step // 25} written", file=sys.stderr, flush=True)
    time.sleep(1 / rate)
"""
SWEEP = "import os, sys; os.write(1, b'result row\\n' * int(sys.argv[2])); print('done', file=sys.stderr)\n"
ANALYZE = ("import sys\nprint('reading input.h5')\nprint('Traceback (most recent call last):', file=sys.stderr)\n"
           "print('  File \"analyze.py\", line 42, in <module>', file=sys.stderr)\n"
           "print('KeyError: \\'energy\\'', file=sys.stderr)\nsys.exit(1)\n")
SIMULATE = "import os, signal, time\nprint('simulating', flush=True)\ntime.sleep(0.5)\nos.kill(os.getpid(), signal.SIGKILL)\n"
WAIT = "import time\nprint('waiting for the licence server', flush=True)\ntime.sleep(600)\n"
SCRIPTS = {"train.py": TRAIN, "sweep.py": SWEEP, "analyze.py": ANALYZE, "simulate.py": SIMULATE, "wait.py": WAIT}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise SystemExit(f"screenshots: timed out waiting for {what}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    work = Path(tempfile.mkdtemp(prefix="gcwrap-screenshots-"))
    home, spool = work / "results", work / "spool"
    procs: list[subprocess.Popen[bytes]] = []
    driver = None

    def start(*cmd: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True, cwd=work)
        procs.append(p)
        return p

    port = free_port()
    token, wrong = work / "token", work / "wrong-token"

    def job(job_id: str, stdout: str, *command: str, stderr: str | None = None,
            token_file: Path = token) -> subprocess.Popen[bytes]:
        streams = ["--stdout", stdout] + (["--stderr", stderr] if stderr else [])
        return start("gcwrap", "--shadow", f"127.0.0.1:{port}", "--token-file", str(token_file), *streams,
                     "--job-id", job_id, "--spool", str(spool), "--", "python3", *command)

    try:
        home.mkdir()
        for name, text in SCRIPTS.items():
            (work / name).write_text(text)
        for path, secret in ((token, "the-token-of-this-shadow-0123456789"), (wrong, "an-old-token-0123456789abcdef")):
            path.write_text(secret + "\n")
            path.chmod(0o600)
        # Started before its shadow: its first connection attempts fail, as a job's do while home is down.
        early = job("slurm-4240", "sweep/4240.out", "sweep.py", "--rows", "20000", stderr="sweep/4240.err")
        time.sleep(2)
        start("gcshadow", "serve", "--port", str(port), "--root", str(home), "--token-file", str(token))
        wait(lambda: early.poll() is not None, 60, "the first job to end")
        job("slurm-4241", "sweep/4241.out", "sweep.py", "--rows", "1300000", stderr="sweep/4241.err").wait(60)
        job("slurm-4244", "ana/4244.out", "analyze.py", "run7.h5", stderr="ana/4244.err").wait(60)
        job("condor-1234.5", "sim/1234.5.out", "simulate.py").wait(60)
        job("slurm-4245", "ana/4245.out", "analyze.py", "run8.h5", token_file=wrong)  # refused: runs on into its spool
        job("slurm-4246", "train/4246.log", "wait.py")
        gone = job("pbs-77.3", "sim/77.3.out", "train.py", "pbs", "--rate", "20", stderr="sim/77.3.err")
        time.sleep(3)
        os.killpg(gone.pid, signal.SIGKILL)  # the wrapper and its job vanish: the shadow sees it disconnect
        job("slurm-4247_0", "train/4247_0.log", "train.py", "a", "--rate", "40", stderr="train/4247_0.err")
        job("slurm-4247_1", "train/4247_1.log", "train.py", "b", "--rate", "12", stderr="train/4247_1.err")
        web_port = free_port()
        start("gcshadow", "web", "--root", str(home), "--port", str(web_port))
        time.sleep(64)  # slurm-4246 becomes quiet
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium") or "chromium"
        for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={work / 'profile'}", "--window-size=1440,800", "--hide-scrollbars"):
            options.add_argument(arg)
        driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
        driver.get(f"http://127.0.0.1:{web_port}/")
        time.sleep(3)
        driver.save_screenshot(str(args.out / "web-jobs.png"))
        driver.set_window_size(1440, 1000)
        driver.get(f"http://127.0.0.1:{web_port}/jobs/slurm-4247_0")
        time.sleep(3)
        driver.execute_script("const t = document.getElementById('timeline'); t.open = true;")
        find = driver.find_element("id", "find")
        find.send_keys("checkpoint")
        time.sleep(1)
        driver.save_screenshot(str(args.out / "web-job.png"))
        driver.set_window_size(390, 1100)
        driver.get(f"http://127.0.0.1:{web_port}/")
        time.sleep(3)
        driver.save_screenshot(str(args.out / "web-phone.png"))
        print(f"wrote {args.out / 'web-jobs.png'}, {args.out / 'web-job.png'} and {args.out / 'web-phone.png'}")
    finally:
        if driver is not None:
            driver.quit()
        for p in reversed(procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
