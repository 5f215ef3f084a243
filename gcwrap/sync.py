"""Small trio helpers shared by the agent and the shadow, and how much an
error matters when several fail together (`Rank`, `worst_error`)."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import trio

from .ranks import Rank, rank_of, ranked
from .wire.compress import CodecError
from .wire.frames import LocalProtocolError, ProtocolError, TruncatedFrame

log = logging.getLogger("gcwrap.sync")  # (under "gcwrap": both programs' logs show it)


class Signal:
    """Wake every task waiting for "something changed".

    Waiters re-check their own condition after waking. Because trio only
    switches tasks at awaits, checking a condition and then calling `wait()`
    with no await in between cannot miss a `fire()`.
    """

    def __init__(self) -> None:
        self._event: trio.Event | None = None  # made by the first waiter since the last fire

    def fire(self) -> None:
        """Wake the waiters; with none, nothing to do (no event is made per fire)."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = trio.Event()
        await self._event.wait()


def leaves(exc: BaseException) -> list[BaseException]:
    """The plain exceptions inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for inner in exc.exceptions:
            out.extend(leaves(inner))
        return out
    return [exc]


# The libraries' failures (the program's own classes rank themselves, with `ranked`).
for _cls, _rank in {
    trio.BrokenResourceError: Rank.NETWORK,
    trio.ClosedResourceError: Rank.NETWORK,
    trio.TooSlowError: Rank.NETWORK,
    socket.gaierror: Rank.NETWORK,  # (a name that does not resolve)
    TruncatedFrame: Rank.NETWORK,
    ProtocolError: Rank.PROTOCOL,
    CodecError: Rank.PROTOCOL,
    ssl.SSLError: Rank.PROTOCOL,
    LocalProtocolError: Rank.BUG,
}.items():
    ranked(_rank)(_cls)


_LEVELS = {Rank.NETWORK: logging.DEBUG, Rank.PROTOCOL: logging.INFO, Rank.LOCAL: logging.WARNING,
           Rank.BUG: logging.ERROR, Rank.ABORT: logging.ERROR}


def worst(errors: list[BaseException]) -> BaseException:
    """The error of the highest rank (the first of them), each other one
    logged at a level that fits its rank (a bug with its traceback)."""
    chosen = max(errors, key=rank_of)  # (max keeps the first of equal ranks)
    for e in errors:
        if e is not chosen:
            rank = rank_of(e)
            bug = rank >= Rank.BUG
            log.log(_LEVELS[rank], "%salso failed, not raised (%s was): %s: %s", "a bug " if bug else "",
                    type(chosen).__name__, type(e).__name__, e, exc_info=(type(e), e, e.__traceback__) if bug else None)
    return chosen


@contextlib.contextmanager
def worst_error() -> Iterator[None]:
    """Turn the exception group of a failed nursery into one error, so
    callers can catch concrete types (several tasks of a connection often
    fail together when it breaks): the one that matters most (`Rank`: a bug
    over a local failure (storage) over a protocol error or refusal over a broken
    connection), every other one logged (`worst`). Groups holding Cancelled
    pass unchanged: the enclosing cancel scope must see them."""
    try:
        yield
    except BaseExceptionGroup as group:
        flat = leaves(group)
        if any(isinstance(e, trio.Cancelled) for e in flat):
            raise
        raise worst(flat) from None
