"""The agent's options (the command line's): a module of its own, with no
event loop in it, so that the command line can build them before the job
starts and the rest of gcwrap loads (see `launch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..wire.compress import Mode

if TYPE_CHECKING:
    import ssl

    from .addresses import Address
    from .filespecs import FileSpec


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
