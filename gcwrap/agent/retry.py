"""Backoff between attempts, and plain words for why an attempt failed."""

from __future__ import annotations

import errno
import random
import socket
import ssl
from dataclasses import dataclass, field

import trio

from ..ranks import Rank, ranked


@dataclass
class Backoff:
    """Exponential backoff with a random factor, capped by `cap` seconds.

    The n-th consecutive failure waits about base * 2**n, times a random
    factor in [0.5, 1.5), never more than `cap`. `reset()` after success.
    """

    base: float = 0.25
    cap: float = 60.0
    rng: random.Random = field(default_factory=random.Random)
    failures: int = 0

    def next_delay(self) -> float:
        exp = min(self.base * 2.0 ** min(self.failures, 30), self.cap)
        self.failures += 1
        return min(self.cap, exp * self.rng.uniform(0.5, 1.5))

    def reset(self) -> None:
        self.failures = 0


@ranked(Rank.NETWORK)
class HeartbeatTimeout(Exception):
    """The peer sent nothing and took nothing for too long (a black hole)."""


@ranked(Rank.NETWORK)
class Stalled(Exception):
    """The peer answers heartbeats but not what we asked of it (a handshake,
    DATA, a STDIN_READ, the EXIT): the connection is replaced."""


@ranked(Rank.NETWORK)
class ConnectionLost(Exception):
    """The shadow closed the connection (or bytes were lost on the way)."""


@ranked(Rank.PROTOCOL)
class SessionEnd(Exception):
    """The shadow said DONE: everything is home. (Not a failure: it ends the session.)"""


@ranked(Rank.PROTOCOL)
class ShadowRefused(Exception):
    """The shadow answered with an ERROR frame."""

    def __init__(self, code: object, message: str, permanent: bool, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.code = code
        self.permanent = permanent
        self.retry_after = retry_after


def root_cause(exc: BaseException) -> BaseException:
    """trio reports a failed connect as "all attempts to connect failed" with
    the per-address errors as its cause: the last of those is the reason."""
    seen = 0
    while isinstance(exc, OSError) and exc.errno is None and exc.__cause__ is not None and seen < 8:
        cause = exc.__cause__
        inner = getattr(cause, "exceptions", None)
        exc = inner[-1] if inner else cause
        seen += 1
    return exc


def describe(exc: BaseException, where: str = "") -> str:
    """What failed, in plain words, for the user and for `gcwrap status`."""
    exc = root_cause(exc)
    at = f" {where}" if where else ""
    if isinstance(exc, ShadowRefused):
        return f"shadow{at} refused: {exc} [{getattr(exc.code, 'name', exc.code)}]"
    if isinstance(exc, HeartbeatTimeout):
        return f"no answer from the shadow{at}: {exc}"
    if isinstance(exc, Stalled):
        return f"the connection to the shadow{at} stalled: {exc}"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the shadow's host{at}: {exc.strerror or exc}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failure with the shadow{at}: {getattr(exc, 'reason', None) or exc}"
    if isinstance(exc, TimeoutError):
        return f"connecting to the shadow{at} timed out"
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused by the shadow{at} (is gcshadow running there?)"
    if isinstance(exc, ConnectionResetError):
        return f"connection to the shadow{at} was reset"
    if isinstance(exc, OSError):
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return f"out of file descriptors while connecting{at} ({exc.strerror})"
        if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
            return f"no route to the shadow{at} ({exc.strerror})"
        if exc.errno == errno.ETIMEDOUT:
            return f"connection to the shadow{at} timed out"
        return f"network error with the shadow{at}: {exc.strerror or exc}"
    if isinstance(exc, trio.BrokenResourceError) and isinstance(exc.__cause__, ssl.SSLError):
        return describe(exc.__cause__, where)  # e.g. the shadow rejected our client certificate
    if isinstance(exc, trio.TooSlowError):
        return f"connecting to the shadow{at} timed out"
    if isinstance(exc, ConnectionLost) and str(exc):
        return f"{exc}{at and ' (' + where + ')'}"
    if isinstance(exc, (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionLost)):
        return f"connection to the shadow{at} was lost"
    return f"{type(exc).__qualname__}{at}: {exc}"
