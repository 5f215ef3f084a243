"""Small trio helpers shared by the agent and the shadow."""

from __future__ import annotations

import trio


class Signal:
    """Wake every task waiting for "something changed".

    Waiters re-check their own condition after waking. Because trio only
    switches tasks at awaits, checking a condition and then calling `wait()`
    with no await in between cannot miss a `fire()`.
    """

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()
