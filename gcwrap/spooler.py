"""The agent's spool writer: the only owner of the spool's write connection.

It creates the spool lazily (a full disk at start must not stop the job),
decides how many bytes may be spooled now (carrier sense: the spool's size
limit, and free disk space minus a reserve left for the job itself), and runs
every transaction in one worker thread. A failure of any kind is described
in plain words and reported as `SpoolError`; the caller keeps the bytes in
memory and tries again later.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import trio

from .spool import Chunk, JobRecord, Spool, SpoolError

DEFAULT_RESERVE_CAP = 256 << 20  # keep at most this much free for the job...
DEFAULT_RESERVE_FRACTION = 0.05  # ...or this fraction of the file system, if smaller


def lock_spool(path: Path) -> int:
    """An exclusive flock on the spool file: one gcwrap per spool at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


class Spooler:
    def __init__(
        self,
        path: Path,
        job: JobRecord,
        streams: list[tuple[int, str, str]],
        *,
        limit: int = 0,
        min_free: int | None = None,
        spool: Spool | None = None,
        lock_fd: int | None = None,
    ) -> None:
        self.path = path
        self.job = job
        self.streams = streams
        self.limit = limit  # 0: no limit but the disk's
        self.min_free = min_free  # None: the default reserve
        self.spool = spool
        self.lock_fd = lock_fd
        self.reader: Spool | None = None
        self.write_limiter = trio.CapacityLimiter(1)
        self.read_limiter = trio.CapacityLimiter(1)
        self.full_reason = ""

    # -- creating --------------------------------------------------------

    def _create(self) -> None:
        if self.path.exists():
            # A previous try died half-way (disk full while creating): start over.
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        spool = Spool.create(self.path, self.job, self.streams)
        try:
            self.lock_fd = lock_spool(self.path)
        except OSError as e:
            spool.remove()
            raise SpoolError(f"cannot lock spool {self.path}: {e.strerror}") from None
        self.spool = spool

    async def ensure(self) -> Spool:
        """The spool, created on first use; SpoolError while that fails."""
        if self.spool is None:
            try:
                await trio.to_thread.run_sync(self._create, limiter=self.write_limiter)
            except OSError as e:
                raise SpoolError(f"cannot create spool {self.path}: {e.strerror or e}") from None
            assert self.spool is not None
        return self.spool

    # -- carrier sense ---------------------------------------------------

    def reserve(self, total: int) -> int:
        if self.min_free is not None:
            return self.min_free
        return min(DEFAULT_RESERVE_CAP, int(total * DEFAULT_RESERVE_FRACTION))

    def room(self, pending: int) -> int:
        """Bytes that may be added to the spool now, given `pending` bytes
        already there; sets `full_reason` when that is none."""
        rooms = []
        if self.limit:
            rooms.append(self.limit - pending)
            if rooms[-1] <= 0:
                self.full_reason = f"spool limit of {self.limit} bytes reached"
                return 0
        try:
            st = os.statvfs(self.path.parent)
        except OSError as e:
            self.full_reason = f"cannot check free space in {self.path.parent}: {e.strerror}"
            return 0
        free = st.f_bavail * st.f_frsize
        keep = self.reserve(st.f_blocks * st.f_frsize)
        # A byte is written twice (WAL, then the database at checkpoint).
        disk_room = (free - keep) // 2
        if disk_room <= 0:
            self.full_reason = f"disk nearly full: {free} bytes free in {self.path.parent}, {keep} kept for the job"
            return 0
        rooms.append(disk_room)
        self.full_reason = ""
        return max(0, min(rooms))

    # -- transactions ----------------------------------------------------

    async def commit(
        self, chunks: list[Chunk], acked: dict[int, int], eof: list[int], updates: dict[str, Any]
    ) -> None:
        spool = await self.ensure()
        await trio.to_thread.run_sync(spool.commit, chunks, acked, eof, updates, limiter=self.write_limiter)

    async def read(self, stream: int, offset: int, limit: int) -> list[Chunk]:
        """Chunks evicted from memory, read back through a second connection."""
        if self.reader is None:
            self.reader = await trio.to_thread.run_sync(Spool.open, self.path, limiter=self.read_limiter)
        return await trio.to_thread.run_sync(self.reader.read, stream, offset, limit, limiter=self.read_limiter)

    # -- ending ----------------------------------------------------------

    def close(self, *, remove: bool = False) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.spool is not None:
            if remove:
                self.spool.remove()
            else:
                self.spool.close()
            self.spool = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
