"""Starting the job as early as gcwrap can.

Most of gcwrap's start-up is loading itself: the event loop (trio), the
sender, TLS, the wire protocol. None of that is needed to start the job,
only where its output goes: the spool (created and locked) and the job's
pipes. So the command line does those first, with this module's few
imports, starts the job, and loads the rest while the job starts up in
parallel; what the job writes meanwhile waits in its pipes (1 MiB each,
`grow_pipe`: the job blocks when one is full, nothing is lost), and the
agent reads it from the first byte on as before.

The stop signals (SIGTERM, SIGINT, SIGHUP) are caught from gcwrap's first
instant (see stopsignals.py): one that comes before the event loop's
receiver is open is kept and handed to it, so it still reaches the job and
starts gcwrap's own end, as one that came later would.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sqlite3
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import exitcodes
from ..wire.streams import STDERR, STDIN, STDOUT, StreamSpec
from .pipes import grow_pipe
from .records import JobRecord
from .segments import DEFAULT_SEGMENT, MIN_SEGMENT
from .spool import PAGE_SIZE, Spool, SpoolError, os_reason, sqlite_reason
from .stopsignals import EarlySignals

if TYPE_CHECKING:
    from .options import AgentOptions

log = logging.getLogger("gcwrap")

BALLAST = 64 << 10  # space held back so the last commit (exit status, state: a few 4 KiB pages) fits on a full disk
WAL_MAX = 16 << 20  # checkpoint before the WAL grows past this (or 1/16 of a small file system)
LIVE_SIZE = 4096  # the live status file: preallocated, rewritten in place, so it works on a full disk


# -- the spool's files -----------------------------------------------------


def lock_spool(path: Path) -> int:
    """An exclusive flock on the spool file: one gcwrap per spool at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def make_ballast(path: Path) -> None:
    if path.exists():
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.posix_fallocate(fd, 0, BALLAST)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)  # no room even for that: do without
        return
    os.close(fd)


def make_live(path: Path) -> int | None:
    """The live status file, preallocated and locked ("in use", even when
    no spool could be made); None if it cannot be had."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, LIVE_SIZE)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass
    return fd


@dataclass
class SpoolFiles:
    """A new spool, as `create_spool` made it, and its lock."""

    spool: Spool
    lock_fd: int


def create_spool(path: Path, job: JobRecord, streams: list[tuple[int, str, str]],
                 make_live_file: Callable[[], None], segment_size: int = DEFAULT_SEGMENT) -> SpoolFiles:
    """Create and lock a new spool at `path` (SpoolError, in plain words, if
    the disk refuses). The live status file is the caller's: it is kept even
    when no spool can be made (`make_live_file` makes it once the directory exists).
    `segment_size`: its segments' (`SpoolTuning`), smaller on a small file system."""
    from .. import db

    try:
        if path.exists():
            # A previous try died half-way (disk full while creating): start over.
            db.remove(path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        make_live_file()
        make_ballast(Path(f"{path}.ballast"))  # first: the final state matters more than any one byte of output
        st = os.statvfs(path.parent)
        fs_size = st.f_blocks * st.f_frsize
        # Segments small enough that a delivered one is freed long before the
        # disk fills: each stream keeps its current one and one spare.
        segment_size = max(MIN_SEGMENT, min(segment_size, fs_size // 64))
        spool = Spool.create(path, job, streams, segment_size)
        try:
            # Checkpoint often enough that the WAL stays a small part of the
            # file system (WAL_MAX, or a 16th of a small one).
            pages = max(16, min(WAL_MAX, fs_size // 16) // PAGE_SIZE)
            spool.db.conn.execute(f"PRAGMA wal_autocheckpoint = {pages}")
            lock_fd = lock_spool(path)
        except OSError as e:
            spool.remove()
            raise SpoolError(f"cannot lock spool {path}: {e.strerror}") from None
    except OSError as e:
        raise SpoolError(f"cannot create spool {path}: {os_reason(e)}") from None
    except sqlite3.Error as e:
        raise SpoolError(f"cannot create spool {path}: {sqlite_reason(e, path)}") from None
    return SpoolFiles(spool, lock_fd)


# -- the job ---------------------------------------------------------------


@dataclass
class Launched:
    """A started job: its process and gcwrap's ends of its pipes (None for a
    stream it does not pipe)."""

    popen: subprocess.Popen[bytes]
    stdin: int | None = None
    stdout: int | None = None
    stderr: int | None = None
    pidfd: int | None = None  # readable once the job has ended (Linux 5.3+), else None
    own_group: bool = False  # the job leads a process group of its own


@dataclass
class Start:
    """What the command line prepared before the event loop: the spool (or
    why there is none), and the job (or the OSError that stopped it)."""

    files: SpoolFiles | None = None
    live_fd: int | None = None  # the live status file (see make_live)
    spool_error: str = ""
    job: Launched | None = None
    error: OSError | None = None
    signals: EarlySignals | None = None  # caught from before the job started until the receiver opens


def _pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_CLOEXEC)
    return r, w


# Descriptors gcwrap opens once the job runs: the event loop's (epoll, its
# wake-up socket pair), the connection, name lookups, the spool's segments.
# They are held while the job is started, so that a limit too low for the
# whole run stops it before the job starts, not after (a job left running
# without its wrapper).
AFTER_START_FDS = 16


def _reserve(n: int) -> list[int]:
    """n descriptors on /dev/null, or OSError (EMFILE) with none left open."""
    held: list[int] = []
    try:
        for _ in range(n):
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
    except OSError:
        for fd in held:
            os.close(fd)
        raise
    return held


def launch(command: list[str], *, stdin: bool, stdout: bool, stderr: bool, merge_stderr: bool,
           own_group: bool) -> Launched:
    """Start the job with a pipe for each stream asked for (1 MiB, grown
    before the job writes a byte); stderr into stdout's pipe with
    `merge_stderr`; in a process group of its own with `own_group`.
    OSError if it cannot be started, or if fewer than AFTER_START_FDS
    descriptors would be left for the rest of the run (nothing is left open
    then)."""
    reserve = _reserve(AFTER_START_FDS)
    try:
        return _launch(command, stdin=stdin, stdout=stdout, stderr=stderr, merge_stderr=merge_stderr,
                       own_group=own_group)
    finally:
        for fd in reserve:
            os.close(fd)


def _launch(command: list[str], *, stdin: bool, stdout: bool, stderr: bool, merge_stderr: bool,
            own_group: bool) -> Launched:
    ours: list[int] = []
    theirs: list[int] = []
    ends: dict[str, int | None] = {"stdin": None, "stdout": None, "stderr": None}
    child: dict[str, int | None] = {"stdin": None, "stdout": None, "stderr": None}
    try:
        for name, wanted in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr and not merge_stderr)):
            if not wanted:
                continue
            r, w = _pipe()
            mine, its = (w, r) if name == "stdin" else (r, w)
            ours.append(mine)
            theirs.append(its)
            ends[name], child[name] = mine, its
            if name != "stdin":
                grow_pipe(r)
        popen = subprocess.Popen(
            command, stdin=child["stdin"], stdout=child["stdout"],
            stderr=subprocess.STDOUT if merge_stderr else child["stderr"],
            process_group=0 if own_group else None,
        )
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    pidfd = None
    try:
        pidfd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        pass
    return Launched(popen, ends["stdin"], ends["stdout"], ends["stderr"], pidfd, own_group)


def interactive() -> bool:
    """At a terminal, in its foreground: the job must stay in the foreground too."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def stream_specs(opts: AgentOptions) -> list[StreamSpec]:
    specs = []
    named = ((STDOUT, "stdout", opts.stdout), (STDERR, "stderr", opts.stderr), (STDIN, "stdin", opts.stdin))
    for sid, kind, name in named:
        if name is not None:
            specs.append(StreamSpec(sid, kind, name))
    return specs


def prepare(opts: AgentOptions, command: list[str], job: JobRecord, spool_path: Path, *,
            signals: EarlySignals | None) -> Start:
    """The spool, then the job: everything a run needs before the agent's
    event loop (and before most of gcwrap is loaded). `signals`: the stop
    signals caught so far, when no signal receiver is open yet."""
    start = Start(signals=signals)
    specs = stream_specs(opts)
    if specs or opts.files:
        # The spool exists before the job writes a byte: a wrapper killed in
        # the first instant must not lose what the job wrote (nor, with files
        # alone, the record `gcwrap resume` needs of them). If the disk
        # refuses, the job runs anyway and the commit loop keeps trying.
        def live() -> None:
            if start.live_fd is None:
                start.live_fd = make_live(Path(f"{spool_path}.live"))

        try:
            start.files = create_spool(spool_path, job, [(s.id, s.kind, s.name) for s in specs], live,
                                       opts.tuning.segment_size)
        except SpoolError as e:
            start.spool_error = str(e)  # (said once the job runs: it may not)
    try:
        start.job = launch(
            command, stdin=opts.stdin is not None, stdout=opts.stdout is not None,
            stderr=opts.stderr is not None, merge_stderr=opts.merge_stderr,
            # Its own process group, so signals reach the whole job; not at an
            # interactive terminal, where the job must stay in the foreground.
            own_group=not interactive(),
        )
    except OSError as e:
        start.error = e
        _discard(start, spool_path)
        return start
    if start.spool_error:
        log.warning("%s; the job runs anyway, its output goes home from memory", start.spool_error)
    return start


def _discard(start: Start, spool_path: Path) -> None:
    """The job never ran: nothing of its spool is kept (the spool, its live
    status file, its ballast), and the descriptors go back."""
    if start.files is not None:
        start.files.spool.remove()
        os.close(start.files.lock_fd)
        start.files = None
    if start.live_fd is not None:
        os.close(start.live_fd)
        start.live_fd = None
    for leftover in (f"{spool_path}.live", f"{spool_path}.ballast"):
        try:
            os.unlink(leftover)
        except OSError:
            pass  # (never made, or a directory that refuses: nothing to undo)


def not_started(command: list[str], error: OSError) -> tuple[int, str]:
    """gcwrap's status and its one line when the job could not be started."""
    if error.errno in (errno.EMFILE, errno.ENFILE):
        return exitcodes.CANNOT_EXECUTE, f"cannot run {command[0]}: out of file descriptors (raise `ulimit -n`)"
    code = exitcodes.NOT_FOUND if error.errno == errno.ENOENT else exitcodes.CANNOT_EXECUTE
    return code, f"cannot run {command[0]}: {error.strerror}"
