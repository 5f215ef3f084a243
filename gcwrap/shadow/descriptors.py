"""The shadow's descriptors, budgeted from RLIMIT_NOFILE.

One socket per connection, and a bounded cache of open files (`FileCache`,
in files.py) share what is left. Connections beyond what the budget
allows are told BUSY (with a retry_after) before a byte is read, and when no
descriptor is left at all the shadow stops accepting until one is freed: an
agent is never refused with EMFILE. `Descriptors` keeps the count: the
connections, the cached stream files and the versions' files of every
session, and makes room for more. A job's files are open while it writes
them: an idle job holds its socket alone (`Descriptors.close_idle`).
"""

from __future__ import annotations

import errno
import os
import resource
import time

import trio

from ..sync import Signal
from .files import FileCache, StreamFile
from .filestore import OpenFiles, SessionFiles

# Descriptors kept for the shadow itself on top of those open when it starts
# serving: listeners, name lookups, SQLite's temporary files, and the files
# a job handshake opens before the cache can make room (up to 16 streams and
# two directories).
FD_MARGIN = 48
ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
FD_ERRNOS = {errno.EMFILE, errno.ENFILE}
# The descriptor limit the shadow raises itself to when it may: 10,000 agents
# and more, each with a socket and open files, with room to spare.
WANT_NOFILE = 1 << 16
# Descriptors the shadow opens before it serves, on top of those open when
# its command starts: the state (database, WAL, shared memory, or a
# PostgreSQL connection), the root and its lock, the event loop's (epoll,
# wake-up sockets), the listeners.
START_FDS = 16
# The fewest descriptors for sockets and files that serve one job (its
# connection and its files, as the cache keeps them).
MIN_AVAIL = 4
# Seconds a connected job's file stays open unused once everything written
# to it is durable: an idle job costs its socket alone, a job that writes
# more often than this keeps its files open (FileCache.close_idle).
IDLE_CLOSE = 2.0


class FdBudget:
    """How many connections and open files RLIMIT_NOFILE allows.

    `avail` descriptors (the limit, less those open at start and a margin)
    are shared by sockets and cached files. Up to `max_served` connections
    are served; the next `headroom` ones are accepted only to be told BUSY;
    beyond that the shadow stops accepting until a descriptor is freed. The
    file cache always keeps at least `min_files`."""

    def __init__(self, limit: int, in_use: int, max_connections: int) -> None:
        self.limit = limit
        self.avail = max(limit - in_use - FD_MARGIN, MIN_AVAIL)
        self.min_files = min(max(self.avail // 8, 16), 1024)
        self.headroom = min(max(self.avail // 16, 4), 512)
        self.max_served = max(1, min(max_connections, self.avail - self.min_files - self.headroom))


def least_limit(in_use: int) -> int:
    """The lowest descriptor limit under which a shadow, with `in_use`
    descriptors open before it starts, can serve a job: below it the budget
    has no room even for one connection's files (`FdBudget` would pretend
    MIN_AVAIL), and the shadow fails wherever the limit happens to bite."""
    return in_use + START_FDS + FD_MARGIN + MIN_AVAIL


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64


def nofile() -> int:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return 1024
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_fd_limit(want: int = WANT_NOFILE) -> None:
    """Many jobs hold many files: use the hard descriptor limit, not the
    soft one, and raise the hard one to `want` where the shadow may (root,
    or CAP_SYS_RESOURCE; never past the system's fs.nr_open). Without that
    right the hard limit stays, and the shadow serves what it allows
    (see `FdBudget`; `Shadow.serve` says so when it is fewer than asked)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ValueError, OSError):
        return
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                ceiling = int(f.read())
        except (OSError, ValueError):
            ceiling = want
        target = min(want, ceiling)
        if target > hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, target))
                return
            except (ValueError, OSError):  # (EPERM: not ours to raise)
                pass
    try:
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


class Descriptors:
    """The shadow's descriptors in use, against its budget: one socket per
    connection, the connected jobs' stream files (`files`, a cache that
    closes clean ones) and the versions' files of every session's
    `SessionFiles` (`open_files`). `freed` fires when one is closed."""

    def __init__(self, budget: FdBudget, files: FileCache, freed: Signal) -> None:
        self.budget = budget
        self.files = files
        self.freed = freed  # (the durability batches' signal: a batch makes files clean, hence closable)
        self.open_files = OpenFiles(freed.fire)  # (their descriptors, which the budget counts)
        self.versions: set[SessionFiles] = set()  # each session's files the job writes ("files" feature)
        self.connections = 0

    def free(self) -> int:
        return self.budget.avail - self.connections - len(self.files) - self.open_files.count

    async def room(self, n: int) -> None:
        """Wait until n more descriptors fit in the budget, closing clean
        cached files first. Dirty ones become clean with the next batch."""
        while self.free() < n:
            self.files.trim(self.budget.avail - self.connections - self.open_files.count - n)
            for versions in self.versions:  # (and the versions' files all durable: reopened when written)
                if self.free() < n:
                    versions.trim(0)
            if self.free() >= n:
                return
            await self.freed.wait()

    async def close_idle(self, idle: float = IDLE_CLOSE) -> None:
        """Close the files unused for `idle` seconds, looking four times as often."""
        while True:
            await trio.sleep(idle / 4)
            self.files.close_idle(time.monotonic(), idle)

    def trim_files(self) -> None:
        b = self.budget
        self.files.trim(max(b.min_files, b.avail - self.connections - b.headroom))

    async def open(self, sf: StreamFile) -> int:
        """The descriptor of a connected job's file, reopened if the cache closed it."""
        if sf.fd < 0:
            await self.room(1)
            self.files.use(sf)
            self.trim_files()
        else:
            self.files.use(sf)
        return sf.fd
