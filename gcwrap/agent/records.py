"""The records both the agent's memory and its spool speak of: a chunk of
output bytes, an extent already in its segment file, a stream's state, the
job. Plain data: no I/O, no SQLite, no trio, so the pure modules (the
outbox, the sender's view of the bytes) can use them."""

from __future__ import annotations

import errno
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..ranks import Rank, ranked

# A file system or kernel without splice/sendfile for these files: the bytes
# then take the copying path, and that is no failure of the disk.
UNSUPPORTED_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})


@ranked(Rank.LOCAL)
class SourceError(Exception):
    """Bytes could not be read from where they are kept (the spool): the
    message says which and why, in words."""


@dataclass(frozen=True)
class Chunk:
    """Stream bytes [start, start + len(data)) held in memory (a row of the spool once committed)."""

    stream: int
    start: int
    data: bytes

    @property
    def end(self) -> int:
        return self.start + len(self.data)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass(frozen=True)
class Extent:
    """Stream bytes [start, end) already in their segment file (spliced from
    the job's pipe, never in memory); they are spooled once their row is
    committed. Only with a spool of natural layout (gcwrap.agent.segments)."""

    stream: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class StreamState:
    """One stream's counters in the spool: bytes the job wrote, bytes durable at home, its end."""

    id: int
    kind: str
    name: str
    appended: int = 0  # bytes the job wrote (for stdin: bytes fed to the job)
    acked: int = 0  # bytes durable at home
    eof: bool = False
    written: int | None = None  # bytes the job wrote, recorded when the run ended (None: not recorded)

    @property
    def pending(self) -> int:
        return self.appended - self.acked

    @property
    def lost(self) -> int:
        """Bytes the job wrote that neither the spool nor home holds: the
        tail [appended, written), held only in memory when the run ended."""
        return max(0, self.written - self.appended) if self.written is not None else 0


def loss_text(losses: Iterable[tuple[str, int, int]]) -> str:
    """In words, what is lost: (stream kind, first lost offset, end) each,
    e.g. "the last 1,024 bytes of stdout (offsets 4,096 to 5,120)". Lost
    bytes are always a stream's tail: what was held only in memory."""
    parts = [f"the last {end - start:,} bytes of {kind} (offsets {start:,} to {end:,})"
             for kind, start, end in losses if end > start]
    return ", and ".join(parts)


@dataclass
class JobRecord:
    """The job as the spool records it: its command, where and when it ran, how it ended, and
    how its delivery went (`gcwrap status` reads it)."""

    job_id: str
    instance: str
    command: list[str]
    host: str = ""
    user: str = ""
    shadow: str = ""
    started: float = 0.0
    wrapper_pid: int | None = None
    child_pid: int | None = None
    ended: float | None = None
    exit_code: int | None = None
    exit_signal: int | None = None
    state: str = "starting"
    reason: str = ""
    last_error: str = ""
    retries: int = 0
    connected: bool = False
    delivered: bool = False
    summary: dict[str, Any] = field(default_factory=dict)


def commit_text(kinds: dict[int, str], chunks: Iterable[Chunk | Extent], acked: dict[int, int], eof: list[int],
                updates: dict[str, Any]) -> str:
    """What a spool commit recorded, in words (for -vv); `kinds` names the streams."""
    chunks = list(chunks)
    parts = []
    if chunks:
        parts.append(f"{sum(c.size for c in chunks)} bytes in {len(chunks)} row(s)")
    if acked:
        parts.append("acknowledged up to " + ", ".join(f"{kinds[s]} {n}" for s, n in acked.items()))
    if eof:
        parts.append("the end of " + ", ".join(kinds[s] for s in eof))
    if updates:
        parts.append("job fields " + ", ".join(sorted(updates)))
    return "; ".join(parts)


@dataclass
class Outcome:
    """How a run or a resume ended, for the CLI to report."""

    status: int
    job_status: int | None = None
    message: str = ""
    spool: Path | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    lost: str = ""  # what output is lost, in words (then status is LOST)
    pending: int = 0  # bytes of output the spool keeps for `gcwrap resume`
    refused: bool = False  # the shadow refused the job for good
    signalled: str = ""  # the signal that stopped a resume ("SIGTERM"): resume no further spool
    files: list[dict[str, Any]] = field(default_factory=list)  # the job's files (--file), for the I/O summary
