"""What the shadow says when a session ends in failure: to its log, and to
the agent in an ERROR frame. The one place where the shadow's failures
become wire codes.

Three kinds of trouble are kept apart (`durability.Trouble`), each with its
own code and log line: a job taken over by a newer session (FENCED), the
state database unavailable or a record's outcome unknown (BUSY with a
retry-after: the agent comes back, nothing is refused for good), and a
sync that failed on disk (IO_ERROR). A refusal for good (a code below 100)
is only ever for damage or a mistake that is real.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from ..ranks import Rank, ranked
from ..wire.events import ErrorCode
from ..wire.protocol import ProtocolError, TruncatedFrame
from .admission import Refused, retry_after
from .descriptors import FD_ERRNOS
from .durability import Fenced, Trouble
from .files import Problem, StoreError
from .handshakes import HandshakeBusy

# After SHUTTING_DOWN the agents come back after this long, without counting a failure (a restart).
STOP_RETRY_AFTER = 3.0
ROOT_RETRY_AFTER = 10.0  # ...and after BUSY for a root gone (the shadow must be restarted) or short of space

# What the agent is told when storage refuses.
WIRE_CODES: dict[Problem, ErrorCode] = {
    Problem.ROOT: ErrorCode.IO_ERROR,
    Problem.FORBIDDEN_NAME: ErrorCode.PATH_FORBIDDEN,
    Problem.NAME_IN_USE: ErrorCode.PATH_OWNED,
    Problem.MISSING: ErrorCode.NOT_FOUND,
    Problem.IO: ErrorCode.IO_ERROR,
    Problem.CHANGED_AT_HOME: ErrorCode.LENGTH_MISMATCH,
    Problem.NOT_OWNER: ErrorCode.AUTH_FAILED,
    Problem.STALE_ATTEMPT: ErrorCode.STALE_ATTEMPT,
    Problem.OTHER_STREAMS: ErrorCode.UNEXPECTED,
    Problem.HELD: ErrorCode.BUSY,  # another shadow's session lets go of the files: come back
    Problem.STATE: ErrorCode.BUSY,  # the state database is lost for now: try another shadow, or later
}


@ranked(Rank.PROTOCOL)
class ShuttingDown(Exception):
    """The shadow is stopping: its agent is told SHUTTING_DOWN, and comes back."""


def come_back_soon() -> float:
    """When an agent whose session stopped for the state database should come
    back: soon (the shadow serves again within a second of its return), spread."""
    return round(retry_after() / 2.5, 2)


@dataclass(frozen=True)
class Reply:
    """A failed session's log line (`level`, `said`) and ERROR frame (none
    when `code` is None: the peer is gone)."""

    level: int
    said: str
    code: ErrorCode | None = None
    message: str = ""
    retry_after: float = 0.0
    refused: bool = False  # counted as a refusal in the shadow's statistics
    traceback: bool = False


def reply_to(e: Exception) -> Reply:
    """What to say of `e`, which ended a session."""
    if isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, TruncatedFrame)):
        return Reply(logging.INFO, f"connection lost ({e})")
    if isinstance(e, ProtocolError):
        return Reply(logging.WARNING, f"protocol error: {e}", e.code, str(e))
    if isinstance(e, Refused):
        return Reply(logging.WARNING, f"refused: {e}", e.code, str(e), e.retry_after, refused=True)
    if isinstance(e, HandshakeBusy):
        return Reply(logging.WARNING, f"refused: {e}", ErrorCode.BUSY, str(e), refused=True)
    if isinstance(e, StoreError):
        code = WIRE_CODES[e.problem]
        if code is ErrorCode.BUSY:
            return Reply(logging.WARNING, f"told to come back: {e}", code, str(e), come_back_soon(), refused=True)
        return Reply(logging.WARNING, f"refused: {e}", code, str(e), refused=True)
    if isinstance(e, trio.TooSlowError):
        return Reply(logging.WARNING, "timed out", ErrorCode.TIMEOUT, "timed out waiting for the agent")
    if isinstance(e, Fenced):
        return _stopped(e)
    if isinstance(e, ShuttingDown):
        return Reply(logging.INFO, str(e), ErrorCode.SHUTTING_DOWN, str(e), STOP_RETRY_AFTER)
    if isinstance(e, OSError):
        if e.errno in FD_ERRNOS:  # outside our budget (another process, the system's file table): back off
            return Reply(logging.WARNING, f"out of descriptors: {e.strerror}", ErrorCode.BUSY,
                         "the shadow is out of file descriptors", retry_after())
        return Reply(logging.ERROR, f"I/O error: {e}", ErrorCode.IO_ERROR, f"shadow I/O error: {e.strerror or e}")
    # One bad connection must not stop the shadow.
    return Reply(logging.ERROR, "internal error", ErrorCode.INTERNAL, f"shadow internal error: {type(e).__name__}",
                 traceback=True)


def _stopped(e: Fenced) -> Reply:
    """A session stopped, by the kind of trouble (`Trouble`)."""
    if e.trouble is Trouble.STATE:
        return Reply(logging.WARNING, f"connection stopped (the state database is unavailable): {e}", ErrorCode.BUSY,
                     str(e), come_back_soon())
    if e.trouble is Trouble.ROOT:  # (said once as an error, by the root's watch)
        return Reply(logging.INFO, f"connection stopped (the root is gone): {e}", ErrorCode.BUSY, str(e),
                     ROOT_RETRY_AFTER)
    if e.trouble is Trouble.SYNC:
        return Reply(logging.ERROR, f"connection stopped (a sync failed on disk): {e}", ErrorCode.IO_ERROR, str(e))
    return Reply(logging.INFO, f"connection stopped (fenced): {e}", ErrorCode.FENCED, str(e))
