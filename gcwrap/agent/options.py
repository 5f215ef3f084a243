"""The agent's options (the command line's): a module of its own, with no
event loop in it, so that the command line can build them before the job
starts and the rest of gcwrap loads (see `launch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..wire.compress import Mode
from .segments import DEFAULT_SEGMENT

if TYPE_CHECKING:
    import ssl

    from .addresses import Address
    from .filespecs import FileSpec


@dataclass(frozen=True)
class SpoolTuning:
    """How the spool is sized and how its disk work is paced: defaults for
    real disks, no command-line option; a test passes its own."""

    segment_size: int = DEFAULT_SEGMENT  # a new spool's segments (smaller on a small file system: `create_spool`)
    # The zero-copy path splices and sendfiles in the event loop's own thread: a
    # hop to a worker thread costs about 0.25 ms of CPU on a small VM, more than
    # moving a MiB through the page cache. A disk that makes one of them slower
    # than `slow_io` seconds sends them to a worker thread for `slow_hold`. (Not
    # lower: on a busy 2-core machine a preempted 1 MiB splice takes 20-30 ms
    # of wall time now and then, and each false alarm costs thread hops.)
    slow_io: float = 0.1
    slow_hold: float = 2.0
    # A group commit on the zero-copy path records extents and acknowledgements
    # (rows, no output bytes): it runs in the event loop's thread too, unless it
    # carries more output than this, or the disk has lately been slow.
    inline_commit: int = 256 << 10
    # Free space is looked up (statvfs) at most every `room_ttl` seconds while
    # room() offers at least `room_plenty` bytes (half the free space above the
    # reserve, so a stale figure still leaves a wide margin); every time when less.
    room_ttl: float = 0.05
    room_plenty: int = 1 << 30


@dataclass
class AgentOptions:
    """How the agent runs a job and delivers it (the command line's options)."""

    shadows: tuple[Address, ...]  # where to deliver, in the order given (empty: nowhere, the streams pass through)
    stdout: str | None = None
    stderr: str | None = None
    stdin: str | None = None
    files: tuple[FileSpec, ...] = ()  # --file: the job's files that come home too (NAMEs expanded)
    merge_stderr: bool = False  # stderr goes into the stdout stream (2>&1)
    retry_limit: int = 20
    retry_timeout: float = 60.0
    heartbeat: float = 5.0
    connect_timeout: float | None = None  # None: three heartbeats
    mem_limit: int = 32 << 20  # bytes held only in memory before the job is paused
    spool_limit: int = 0  # most bytes the spool may hold (0: only the disk limits it)
    min_free: int | None = None  # free disk space left to the job (None: the default reserve)
    cache_limit: int = 64 << 20  # bytes of already-spooled output kept in memory for the sender
    token: bytes | None = None  # shared secret for the challenge-response (gcwrap.wire.auth)
    tls: ssl.SSLContext | None = None  # TLS to the shadow, when set
    write_behind: float = 0.0  # seconds output may wait in memory for home's ack before it is spooled
    compress: Mode = Mode.AUTO  # --compress
    tuning: SpoolTuning = field(default_factory=SpoolTuning)  # (not on the command line)
