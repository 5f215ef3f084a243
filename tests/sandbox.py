"""Run documented commands as written, in a sandbox of their own.

The documentation's commands use fixed places: port 50000, /tmp/rd/results,
the default spool directory /tmp/gcwrap-0, host names such as
home.example.org. To run them unchanged without touching anything else on
the machine, this script runs inside `unshare --mount --net` (see `run`):
its own loopback (port 50000 is free), a fresh tmpfs on /tmp, an /etc/hosts
that points the documentation's host names at 127.0.0.1, a HOME of its own,
and its own PID namespace: nothing it starts outlives it. What runs the
commands stays as it was, wherever it lies: the clone, the interpreter and
its venv, and the installed gcwrap and gcshadow are bound back onto the
fresh /tmp when they were under it (a newcomer's clone in /tmp), and the
sandbox checks that the commands it runs are those the tests run.

It reads a list of steps (JSON) on stdin and writes one result per step
(JSON) on stdout:

    {"sh": CMD, "timeout": S}          run `bash -c CMD` in the work directory; output is stdout and
                                       stderr merged, as a terminal shows them
    {"serve": CMD, "name": N, "port": P}   start CMD in the background; wait until P accepts connections
    {"start": CMD, "name": N}          start CMD in the background
    {"wait": N, "timeout": S}          wait for a background command to end
    {"stop": N}                        SIGTERM a background command (its own session), then wait
    {"sleep": S}
    {"until": CMD, "timeout": S}       run `bash -c CMD` every 50 ms until it exits 0 (error: not within S)
    {"file": PATH, "text": T, "mode": M}   write a file (relative to the work directory)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HOSTS = ["home", "home.example.org"]
HOME = Path("/tmp/sandbox-home")
WORK = HOME / "work"
TOOLS = ("gcwrap", "gcshadow")
CLONE = Path(__file__).resolve().parent.parent


def run(steps: list[dict[str, Any]], env: dict[str, str] | None = None, timeout: float = 240) -> list[dict[str, Any]]:
    """Run `steps` in a fresh sandbox (needs root and unshare); one result per step."""
    proc = subprocess.run(
        # --pid: the script is process 1 of its own PID namespace, so whatever
        # it started dies with it, even when a timeout kills it.
        ["unshare", "--mount", "--net", "--pid", "--fork", "--mount-proc", "--kill-child", "--", sys.executable,
         __file__],
        input=json.dumps({"steps": steps, "env": env or {}, "tools": {name: shutil.which(name) for name in TOOLS}}),
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the sandbox failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    results = json.loads(proc.stdout)
    assert isinstance(results, list)
    return results


def kept_under_tmp(tools: dict[str, str | None]) -> list[Path]:
    """What must stay visible though a fresh tmpfs covers /tmp: the clone,
    the interpreter's venv and installation, the directories of the
    installed commands, those of them that lie under /tmp (and none inside
    another)."""
    wanted = {CLONE, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
              Path(sys.executable).resolve().parent,
              *(Path(path).resolve().parent for path in tools.values() if path)}
    under = sorted(p for p in wanted if p.is_relative_to("/tmp") and p != Path("/tmp"))
    return [p for p in under if not any(p != q and p.is_relative_to(q) for q in under)]


def _setup(tools: dict[str, str | None]) -> None:
    # Each directory to keep is held open (O_PATH) before the tmpfs hides it,
    # then bound from its descriptor onto the same path in the fresh /tmp.
    kept = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in kept_under_tmp(tools)]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", "/tmp"], check=True)
    for path, fd in kept:
        path.mkdir(parents=True, exist_ok=True)
        # (-c: mount must not resolve /proc/self/fd/N to the path it names, which the tmpfs hides.)
        subprocess.run(["mount", "-c", "--bind", f"/proc/self/fd/{fd}", str(path)], check=True, pass_fds=(fd,))
        os.close(fd)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    hosts = Path("/tmp/.hosts")
    hosts.write_text("127.0.0.1 localhost " + " ".join(HOSTS) + "\n::1 localhost\n")
    subprocess.run(["mount", "--bind", str(hosts), "/etc/hosts"], check=True)
    WORK.mkdir(parents=True)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _main() -> int:
    request = json.load(sys.stdin)
    _setup(request["tools"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GCWRAP_", "GCSHADOW_", "GRID_CONSOLE_",
                                                                      "BYPASS_SHADOW_", "SLURM_", "PBS_"))}
    env.update(HOME=str(HOME), TMPDIR="/tmp", **request["env"])
    for name in ("_CONDOR_SCRATCH_DIR", "SLURM_TMPDIR", "COLUMNS", "LINES"):  # (no width: tables as through a pipe)
        env.pop(name, None)
    for name, path in request["tools"].items():
        found = shutil.which(name, path=env.get("PATH"))
        if found != path:
            print(f"in the sandbox {name} is {found}, not {path} as for the tests", file=sys.stderr)
            return 1
    background: dict[str, tuple[subprocess.Popen[bytes], Any]] = {}
    results: list[dict[str, Any]] = []

    def output(name: str) -> str:
        log = WORK / f".{name}.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def start(cmd: str, name: str) -> subprocess.Popen[bytes]:
        log = open(WORK / f".{name}.log", "wb")  # noqa: SIM115 - open while the command runs, closed at the end
        p = subprocess.Popen(["bash", "-c", cmd], cwd=WORK, env=env, stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        background[name] = (p, log)
        return p

    try:
        for step in request["steps"]:
            t0 = time.monotonic()
            result: dict[str, Any] = {"step": step}
            if "sh" in step:
                p = subprocess.run(["bash", "-c", step["sh"]], cwd=WORK, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=step.get("timeout", 60),
                                   check=False)
                result.update(rc=p.returncode, output=p.stdout.decode(errors="replace"))
            elif "serve" in step or "start" in step:
                p = start(step.get("serve") or step["start"], step["name"])
                if "serve" in step:
                    deadline = time.monotonic() + step.get("timeout", 30)
                    while not _listening(step["port"]):
                        if p.poll() is not None or time.monotonic() > deadline:
                            result.update(rc=p.poll(), output=output(step["name"]), error="did not listen")
                            break
                        time.sleep(0.05)
            elif "wait" in step:
                p = background[step["wait"]][0]
                p.wait(step.get("timeout", 60))
                result.update(rc=p.returncode, output=output(step["wait"]))
            elif "stop" in step:
                p = background[step["stop"]][0]
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(20)
                result.update(rc=p.returncode, output=output(step["stop"]))
            elif "sleep" in step:
                time.sleep(step["sleep"])
            elif "until" in step:
                deadline = time.monotonic() + step.get("timeout", 30)
                while subprocess.run(["bash", "-c", step["until"]], cwd=WORK, env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, timeout=30,
                                     check=False).returncode != 0:
                    if time.monotonic() > deadline:
                        result.update(error=f"not true within {step.get('timeout', 30)} s")
                        break
                    time.sleep(0.05)
            elif "file" in step:
                path = WORK / step["file"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(step["text"])
                path.chmod(int(step.get("mode", "644"), 8))
            result["elapsed"] = round(time.monotonic() - t0, 3)
            results.append(result)
    finally:
        for p, log in background.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(20)
            log.close()
        shutil.rmtree(HOME, ignore_errors=True)
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
