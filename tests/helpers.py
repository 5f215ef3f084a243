"""Helpers for the end-to-end tests: real gcshadow and gcwrap processes.

Every process is started by the test, bounded in time, and stopped by PID.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).parent
GENJOB = [sys.executable, str(HERE / "jobs" / "genjob.py")]


def tool(name: str) -> list[str]:
    """The installed console script, as a user runs it."""
    path = shutil.which(name)
    assert path, f"{name} is not installed: pip install -e '.[test]'"
    return [path]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def expected(n: int, seed: int) -> str:
    """sha256 of the bytes genjob.py writes for a stream of n bytes."""
    return sha256_bytes(random.Random(seed).randbytes(n))


def wait_until(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s; reaped either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class ShadowProc:
    """A gcshadow serving `root`; restartable on the same port."""

    def __init__(self, root: Path, logdir: Path, extra: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.root = root
        self.logdir = logdir
        self.extra = list(extra)
        self.env = env  # (None: this process's)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, port: int | None = None, timeout: float = 30) -> int:
        port_file = self.logdir / f"shadow-port-{self.starts}"
        port_file.unlink(missing_ok=True)
        want = self.port if port is None else port
        with open(self.logdir / f"shadow-{self.starts}.log", "wb") as log:  # (the child keeps its own copy)
            self.proc = subprocess.Popen(
                [*tool("gcshadow"), "serve", "--port", str(want), "--root", str(self.root),
                 "--port-file", str(port_file), *self.extra],
                stdout=log, stderr=log, start_new_session=True, env=self.env,
            )
        self.starts += 1
        proc = self.proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"gcshadow exited with {proc.returncode}: {self.log()}")
            return port_file.exists()

        wait_until(ready, timeout, "gcshadow to listen")
        self.port = int(port_file.read_text())
        return self.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.logdir.glob("shadow-*.log")))


class Wrapper:
    """A gcwrap process running a job. Every one still alive when its test
    ends is killed, with its job (see `kill_leftovers`)."""

    started: ClassVar[list[Wrapper]] = []

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, stdin: int | None = None,
                 err_file: Path | None = None) -> None:
        """`err_file`: stderr goes there, readable while it runs (`err_so_far`)."""
        self.args = [*tool("gcwrap"), *args]
        self.err_file = err_file
        err = open(err_file, "wb") if err_file is not None else subprocess.PIPE  # noqa: SIM115 - closed below
        try:
            self.proc = subprocess.Popen(
                self.args, stdout=subprocess.PIPE, stderr=err, env=env, stdin=stdin or subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            if err_file is not None:
                err.close()  # type: ignore[union-attr]
        self.out = b""
        self.err = b""
        Wrapper.started.append(self)

    def err_so_far(self) -> str:
        """What it wrote to stderr so far (with `err_file`)."""
        assert self.err_file is not None
        return self.err_file.read_text(errors="replace")

    @classmethod
    def kill_leftovers(cls) -> None:
        for w in cls.started:
            if w.proc.poll() is None:
                job_pids = _children(w.proc.pid)
                os.killpg(w.proc.pid, signal.SIGKILL)
                for pid in job_pids:  # the job runs in a process group of its own
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            try:
                w.proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                for pipe in (w.proc.stdout, w.proc.stderr):  # (held open by a process that outlived the kill)
                    if pipe is not None:
                        pipe.close()
        cls.started.clear()

    def wait(self, timeout: float) -> int:
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            Wrapper.kill_leftovers()
            self.out, self.err = self.proc.communicate()
            if self.err_file is not None:
                self.err = self.err_file.read_bytes()
            raise AssertionError(
                f"gcwrap did not finish in {timeout} s; stderr: {self.err.decode(errors='replace')}") from e
        if self.err_file is not None:
            self.err = self.err_file.read_bytes()
        return self.proc.returncode

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.out, self.err = self.proc.communicate(timeout=10)
        if self.err_file is not None:
            self.err = self.err_file.read_bytes()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def python_job(code: str) -> list[str]:
    """A job of Python `code` (dedented), with os, sys, time, json and random
    imported and `gate(path)`: wait (60 s at most) until `path` exists."""
    prelude = ("import os, sys, time, json, random\n"
               "def gate(path):\n"
               "    end = time.monotonic() + 60\n"
               "    while not os.path.exists(path) and time.monotonic() < end:\n"
               "        time.sleep(0.02)\n")
    return [sys.executable, "-c", prelude + textwrap.dedent(code)]


def genjob(out: int, err: int = 0, seed: int = 1, **opts: object) -> list[str]:
    args = [*GENJOB, "--out", str(out), "--err", str(err), "--seed", str(seed)]
    for key, value in opts.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def spool_status(spool_dir: Path) -> list[dict[str, object]]:
    res = subprocess.run(
        [*tool("gcwrap"), "status", "--json", "--spool", str(spool_dir)], capture_output=True, timeout=60, check=True
    )
    data = json.loads(res.stdout)
    assert isinstance(data, list)
    return data


def spool_status_both(spool_dir: Path) -> tuple[dict[str, Any], str]:
    """The one job of `gcwrap status --json` and its text table (columns wide
    enough for every cell), a moment apart."""
    js = subprocess.run([*tool("gcwrap"), "status", "--json", "--spool", str(spool_dir)], capture_output=True,
                        text=True, timeout=60, check=True).stdout
    text = subprocess.run([*tool("gcwrap"), "status", "--spool", str(spool_dir)], capture_output=True, text=True,
                          timeout=60, check=True, env={"PATH": "/usr/bin:/bin", "COLUMNS": "250"}).stdout
    (one,) = json.loads(js)
    assert isinstance(one, dict)
    return one, text


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def drop_cap_sys_resource() -> None:
    """Drop CAP_SYS_RESOURCE from the bounding set (for the program exec'd
    next: root then may not raise a hard limit)."""
    import ctypes
    import errno

    pr_capbset_drop, cap_sys_resource = 24, 24
    failed = ctypes.CDLL(None, use_errno=True).prctl(pr_capbset_drop, cap_sys_resource, 0, 0, 0) != 0
    if failed and ctypes.get_errno() != errno.EPERM:  # (EPERM: not root, so it cannot raise it anyway)
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def as_user(uid: int, gid: int | None = None) -> list[str]:
    """A command prefix that runs a command as `uid`:`gid` (setpriv, no
    supplementary groups, no capabilities) with this Python still reachable.

    Where the interpreter or the installed commands lie under a directory
    closed to other users (/root, mode 0700), the command runs in a private
    mount namespace in which that directory is a small tmpfs laid open,
    holding only the subtree they need (bound from a descriptor opened
    before). Nothing else changes for the user: every other path, and every
    permission check on it, is the real one."""
    gid = uid if gid is None else gid
    drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    needed = {Path(sys.executable).resolve(), Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(),
              *(Path(tool(name)[0]).resolve() for name in ("gcwrap", "gcshadow"))}
    pairs: dict[Path, Path] = {}  # exposed subtree -> its closed parent
    for path in needed:
        for parent, child in zip(path.parents[::-1], [*path.parents[::-1][1:], path]):
            if not parent.stat().st_mode & 0o001:
                pairs[child] = parent
                break
    if not pairs:
        return drop
    steps = [f"exec {3 + i}<'{exposed}'" for i, exposed in enumerate(pairs)]
    steps += [f"mount -t tmpfs -o mode=0755,size=64k tmpfs '{closed}'" for closed in sorted(set(pairs.values()))]
    for i, exposed in enumerate(pairs):
        # (-c: mount must not resolve /proc/self/fd/N to the path it names, which the tmpfs now hides.)
        steps += [f"mkdir -p '{exposed}'", f"mount -c --bind /proc/self/fd/{3 + i} '{exposed}'", f"exec {3 + i}<&-"]
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join([*steps, 'exec "$@"']), "sh",
            *drop]
