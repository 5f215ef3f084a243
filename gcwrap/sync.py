"""Small trio helpers shared by the agent and the shadow."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio


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


@contextlib.contextmanager
def first_error() -> Iterator[None]:
    """Turn the exception group of a failed nursery into its first error, so
    callers can catch concrete types (several tasks of a connection often fail
    together when it breaks). Groups holding Cancelled pass unchanged: the
    enclosing cancel scope must see them."""
    try:
        yield
    except BaseExceptionGroup as group:
        flat = leaves(group)
        if any(isinstance(e, trio.Cancelled) for e in flat):
            raise
        raise flat[0] from None
