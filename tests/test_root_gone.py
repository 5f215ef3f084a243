"""The shadow's root deleted and made again under a running shadow.

The shadow works under its root through the descriptor it opened at start:
after `rm -rf ROOT; mkdir ROOT` that descriptor names a deleted directory.
Going on would acknowledge bytes written where nobody will find them, and
refusing jobs as if their names were wrong (NOT_FOUND, "a parent is not a
directory", exit 123) blames the jobs. The shadow notices (the directory's
identity, not its path), says so once naming the root, fences its live
sessions (nothing more is acknowledged) and refuses every job with a
retryable code naming the root, until it is restarted. The agents keep
their output in their spools meanwhile.

Restarted on the new, empty root, the shadow holds none of what it
acknowledged before: a job that had output acknowledged is refused for good
(LENGTH_MISMATCH, exit 123: that output was deleted at home, and gcwrap no
longer has it), and a job that had none delivers all of it, byte-exact.

Real processes: the installed gcshadow and gcwrap, and `rm -rf`.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import ShadowProc, Wrapper, expected, file_size, genjob, sha256_file, wait_until

from gcwrap.shadow.files import Problem, StoreError
from gcwrap.shadow.rootwatch import RootWatch
from gcwrap.shadow.state import Store
from gcwrap.wire.events import StreamSpec

pytestmark = pytest.mark.timeout(120)

FOR_GOOD = ("[NOT_FOUND]", "[LENGTH_MISMATCH]", "[PATH_FORBIDDEN]", "a parent is not a directory",
            "stdin file", "can never be fed")
DETECTED = "it acknowledges nothing more"  # in the shadow's one line saying its root is gone


def test_a_root_deleted_and_made_again_is_noticed_said_once_and_refused_for_now(
        home: Path, tmp_path: Path, spool_dir: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    stop = tmp_path / "stop-writing"
    sh = ShadowProc(home, logs)
    port = sh.start()
    try:
        ticking = Wrapper(["-v", "--shadow", sh.address, "--spool", str(spool_dir / "a"), "--job-id", "ticking",
                           "--retry-timeout", "1", "--retry-limit", "0", "--stdout", "out.txt",
                           "--stderr", "d/err.txt", "--", "sh", "-c",
                           f"while [ ! -e {stop} ]; do echo tick; echo tock >&2; sleep 0.05; done"],
                          err_file=tmp_path / "ticking.err")
        wait_until(lambda: file_size(home / "out.txt") > 100 and file_size(home / "d" / "err.txt") > 100, 30,
                   "the first output at home")

        subprocess.run(["rm", "-rf", str(home)], check=True, timeout=30)
        home.mkdir()
        # A job that starts now: named at the top of the root and in a directory.
        late = Wrapper(["-v", "--shadow", sh.address, "--spool", str(spool_dir / "b"), "--job-id", "late",
                        "--retry-timeout", "1", "--retry-limit", "0", "--stdout", "late.txt", "--stderr", "e/late.err",
                        "--", *genjob(50_000, 5_000, seed=4)], err_file=tmp_path / "late.err")

        wait_until(lambda: DETECTED in sh.log(), 10, "the shadow to notice its root is gone")
        wait_until(lambda: str(home) in late.err_so_far() and str(home) in ticking.err_so_far(), 20,
                   "both agents to be told, naming the root")
        time.sleep(4)  # several tries each: refused every time, never for good
        for w in (ticking, late):
            text = w.err_so_far()
            assert w.proc.poll() is None, text
            assert not [x for x in FOR_GOOD if x in text], text
        log = sh.log()
        told = [x for x in log.splitlines() if DETECTED in x]
        assert len(told) == 1 and str(home) in told[0] and "deleted" in told[0], log
        assert not [x for x in FOR_GOOD if x in log], log
        assert list(home.iterdir()) == [], "the shadow wrote into the new root"

        # Restarted: it serves the new root. What it acknowledged before was
        # deleted with the old one: the job that had output acknowledged is
        # refused for good; the one that had none delivers all of it.
        sh.stop()
        sh.start(port)
        assert late.wait(60) == 0, late.err.decode()
        assert sha256_file(home / "late.txt") == expected(50_000, 4)
        assert sha256_file(home / "e" / "late.err") == expected(5_000, 5)
        stop.touch()
        assert ticking.wait(60) == 123, ticking.err.decode()
        assert "[LENGTH_MISMATCH]" in ticking.err.decode() and "were acknowledged" in ticking.err.decode()
    finally:
        stop.touch()
        sh.stop()


@pytest.mark.parametrize("name", ["out.txt", "d/out.txt"])
def test_an_output_that_cannot_be_made_for_a_directory_that_vanished_is_no_missing_stdin(
        tmp_path: Path, name: str) -> None:
    """It was "stdin file 'out.txt' does not exist at the shadow [NOT_FOUND]",
    and "'d/out.txt': a parent is not a directory": permanent refusals."""
    root = tmp_path / "root"
    root.mkdir()
    store = Store(root)
    try:
        subprocess.run(["rm", "-rf", str(root)], check=True, timeout=30)
        with pytest.raises(StoreError) as refused:
            store.open_job(job_id="j", instance="i", host="h", user="u", command=[], peer="p",
                           streams=[StreamSpec(1, "stdout", name)])
    finally:
        store.close()
    assert refused.value.problem is Problem.IO, refused.value
    assert name in str(refused.value) and "stdin" not in str(refused.value), refused.value


def test_the_root_is_known_by_its_identity_not_its_name(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        watch = RootWatch(root, fd, {})
        assert watch.look() == ""
        root.rename(tmp_path / "old")
        assert "is gone" in watch.look()
        root.mkdir()
        assert "was replaced" in watch.look()
        (tmp_path / "old").rmdir()
        assert "was deleted" in watch.look()
        assert watch.gone == "" and watch.check() and watch.gone  # (the looks above changed nothing; check does)
    finally:
        os.close(fd)
