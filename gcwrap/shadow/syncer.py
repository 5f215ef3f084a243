"""Making a batch of the shadow's files durable: one syncfs() of the
root's file system when several are dirty and that is cheaper, fdatasync()
of each otherwise (in parallel threads when there are several); the
directories holding names the shadow made are fsynced first.

Synchronous code, called from the shadow's durability thread.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..wire.names import NameError_, split_name
from .files import StreamFile, open_dir
from .tally import SECONDS, Tally

SYNCFS_MIN = 4  # dirty files on the root's file system from which one syncfs() replaces their fdatasync()s
PARALLEL_MIN = 4  # dirty files from which fdatasync()s run in parallel threads
SYNC_THREADS = 16


def _load_syncfs() -> Callable[[int], None] | None:
    """syncfs(2) (Python has no os.syncfs), or None where it is missing or,
    before Linux 5.8, does not report writeback errors."""
    import platform
    import re

    if platform.system() != "Linux":
        return None
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    if not m or (int(m.group(1)), int(m.group(2))) < (5, 8):
        return None
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        func = libc.syncfs
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int]
    func.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if func(fd) != 0:  # ctypes releases the GIL for the call
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return syncfs


class Syncer:
    """Makes files durable: syncfs() or fdatasync(), whichever is cheaper.

    syncfs(ROOT) flushes the whole file system that holds the root in one
    journal commit; since Linux 5.8 it reports any writeback error on that
    file system since its last call on the same descriptor, so an error is
    never lost even for a file whose descriptor was closed meanwhile. An
    error fails every file of the batch. Files on other file systems (a
    mount below the root), and batches of few files, are fdatasync()ed
    each, in parallel threads when there are several.

    syncfs also flushes what others wrote to that file system, so it is
    used only while it costs less than the fdatasync()s it replaces, as
    measured (moving averages); every PROBE-th batch that could use it does,
    so that its estimate follows the file system's load.
    """

    PROBE = 64
    PARALLEL_GAIN = 2.5  # fdatasync()s in parallel threads: 2.3-4x faster than one after another, measured

    def __init__(self, root_fd: int, use_syncfs: bool = True) -> None:
        self.root_fd = root_fd
        self.root_dev = os.fstat(root_fd).st_dev
        self.syncfs = _load_syncfs() if use_syncfs else None
        self.pool: ThreadPoolExecutor | None = None
        self.stats = {"syncfs": 0, "fdatasync": 0, "dirsync": 0}
        self.per_file = 0.0005  # seconds per fdatasync() (a moving average)
        self.per_syncfs = 0.0005  # seconds per syncfs()
        self.skipped = 0
        self.syncing: list[str] = []  # the names of the files a sync is making durable now
        self.since = 0.0  # when it began (time.monotonic)
        self.took = 0.0  # how long the last one took
        self.seconds = Tally(SECONDS)  # ...and every one (the metrics' fsync latency)

    def _prefer_syncfs(self, n: int) -> bool:
        if n < SYNCFS_MIN:
            return False
        instead = self.per_file * n / (self.PARALLEL_GAIN if n >= PARALLEL_MIN else 1)
        if self.per_syncfs <= instead:
            return True
        self.skipped += 1
        return self.skipped % self.PROBE == 0

    def sync(self, files: list[tuple[StreamFile, int]]) -> list[tuple[StreamFile, int, OSError | None]]:
        """(file, length, error) for each (file, length)."""
        self.since, self.syncing = time.monotonic(), [sf.name for sf, _ in files]  # (for a log: what hangs)
        try:
            return self._sync(files)
        finally:
            self.syncing = []
            self.took = time.monotonic() - self.since
            self.seconds.observe(self.took)

    def _sync(self, files: list[tuple[StreamFile, int]]) -> list[tuple[StreamFile, int, OSError | None]]:
        out: list[tuple[StreamFile, int, OSError | None]] = []
        rest = files
        if self.syncfs is not None:
            mine = [f for f in files if f[0].dev == self.root_dev]
            if self._prefer_syncfs(len(mine)):
                err: OSError | None = None
                started = time.monotonic()
                try:
                    self.syncfs(self.root_fd)
                    self.stats["syncfs"] += 1
                except OSError as e:
                    if e.errno in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL):
                        self.syncfs = None  # not allowed here (seccomp, odd file system): fdatasync from now on
                        return self._sync(files)
                    err = e
                self.per_syncfs += (time.monotonic() - started - self.per_syncfs) / 4
                out = [(sf, n, err) for sf, n in mine]
                if err is None:
                    for sf, _ in mine:
                        sf.new_entries = ()  # (syncfs wrote the directories too)
                rest = [f for f in files if f[0].dev != self.root_dev]
        if rest:
            rest, failed = self._sync_entries(rest)
            out.extend(failed)
        if rest:
            started = time.monotonic()
            if len(rest) >= PARALLEL_MIN:
                if self.pool is None:
                    self.pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="gcshadow-sync")
                out.extend(self.pool.map(_fdatasync, rest))
                took = (time.monotonic() - started) * self.PARALLEL_GAIN / len(rest)
            else:
                out.extend(_fdatasync(f) for f in rest)
                took = (time.monotonic() - started) / len(rest)
            self.per_file += (took - self.per_file) / 16
            self.stats["fdatasync"] += len(rest)
        return out

    def _sync_entries(self, files: list[tuple[StreamFile, int]]) -> tuple[
            list[tuple[StreamFile, int]], list[tuple[StreamFile, int, OSError | None]]]:
        """fsync() the directories holding names the shadow made for these
        files (once each, however many files they hold: a hundred agents
        starting together cost one sync of their directory): the files
        whose entries are durable now, and the others with the error."""
        dirs = {d for sf, _ in files for d in sf.new_entries}
        if not dirs:
            return files, []
        errors: dict[str, OSError] = {}
        for d in sorted(dirs):
            try:
                fd = open_dir(self.root_fd, split_name(d) if d else (), create=False)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self.stats["dirsync"] += 1
            except (OSError, NameError_) as e:
                errors[d] = e if isinstance(e, OSError) else OSError(errno.EIO, str(e))
        ok: list[tuple[StreamFile, int]] = []
        failed: list[tuple[StreamFile, int, OSError | None]] = []
        for sf, n in files:
            err = next((errors[d] for d in sf.new_entries if d in errors), None)
            if err is None:
                ok.append((sf, n))
            else:
                failed.append((sf, n, err))
        for sf, _ in ok:
            sf.new_entries = ()
        return ok, failed

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=not self.syncing)  # (a sync that hangs is not waited for: see Durability._join)
            self.pool = None


def _fdatasync(item: tuple[StreamFile, int]) -> tuple[StreamFile, int, OSError | None]:
    sf, length = item
    try:
        os.fdatasync(sf.fd)
    except OSError as e:
        return sf, length, e
    return sf, length, None
