"""A connection before its session: reading its events, the memory all
unauthenticated connections hold, and refusing one.

Before authentication a connection holds at most one control frame (the
protocol refuses a longer one from its header), and all of them together at
most the shadow's `handshake_memory`: `HandshakeMemory` counts it. A refused
connection is told why (`refuse`), then read and dropped for a moment, so
that its agent sees the ERROR rather than a reset.
"""

from __future__ import annotations

from typing import Any

import trio

from ..ranks import Rank, ranked
from ..wire.events import ConnectionClosed, Error, ErrorCode, Event
from ..wire.protocol import Connection, ProtocolError
from .receive import read_some

HANDSHAKE_READ = 4 << 10  # reads before a connection has authenticated: what it holds stays small
LINGER_READ = 16 << 10  # reads of what a refused peer still sends (dropped): a thousand of them hold little
TRIM_AFTER = 4 << 20  # once unauthenticated connections held this much, give it back to the system when they go
TRIM_CONNECTIONS = 512  # ...or once this many connections came and went through their handshake
LINGER_S = 1.0  # after refusing a connection, read and drop what still comes for this long...
LINGER_BYTES = 64 << 20  # ...or this many bytes, so the ERROR is not lost to a reset


@ranked(Rank.PROTOCOL)
class HandshakeBusy(Exception):
    """The unauthenticated connections together hold too much: this one is told BUSY."""


class HandshakeMemory:
    """What the unauthenticated connections hold, each and in all, and when
    to give the heap back once a flood of them is over."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes all unauthenticated connections together may make the shadow hold
        self.held: dict[int, int] = {}  # bytes each unauthenticated connection holds (by its Connection's id)
        self.total = 0  # their sum, at most `limit`
        self.peak = 0  # their largest sum since the memory was last given back
        self.unauthenticated: set[int] = set()  # connections (ids of their Connection) not authenticated yet
        self.seen = 0  # connections accepted since the memory was last given back

    def arrived(self, conn: Connection) -> None:
        """One more connection, not authenticated yet."""
        self.unauthenticated.add(id(conn))
        self.seen += 1

    def charge(self, conn: Connection) -> None:
        """Count what an unauthenticated connection holds (bytes received, not
        yet a whole frame); HandshakeBusy if all of them would hold more than `limit`."""
        key = id(conn)
        held = conn.buffered
        total = self.total - self.held.get(key, 0) + held
        if held and total > self.limit:
            raise HandshakeBusy("the shadow holds too many unfinished handshakes: try again later")
        self.total = total
        self.held[key] = held
        self.peak = max(self.peak, total)

    def over(self, conn: Connection) -> None:
        """The handshake is over: what the connection held is no longer counted."""
        self.total -= self.held.pop(id(conn), 0)

    def gone(self, conn: Connection) -> None:
        """One connection fewer without authentication (it authenticated, or closed)."""
        self.unauthenticated.discard(id(conn))
        many = self.peak >= TRIM_AFTER or self.seen >= TRIM_CONNECTIONS
        if many and not self.unauthenticated:
            # A flood of unauthenticated connections is over (refused ones
            # included, once done lingering): what they held is free, but in
            # small pieces that malloc keeps. Give it back.
            self.peak = self.seen = 0
            _trim_heap()


async def refuse(
    stream: trio.abc.Stream, conn: Connection, code: ErrorCode, message: str,
    retry_after: float = 0.0,
) -> None:
    with trio.move_on_after(2) as scope:
        scope.shield = True
        try:
            await stream.send_all(conn.send(Error(code, message, retry_after)))
        except Exception:  # noqa: BLE001 - best effort: the peer may be gone
            return
    # Linger: an agent streaming bulk output has more bytes in flight.
    # Closing on them now would answer them with a reset, and a reset
    # destroys the ERROR still in the agent's receive queue; it would
    # see only "connection lost". So say we are done, and read (and drop)
    # what comes until the agent closes, for a second at most.
    with trio.move_on_after(LINGER_S) as scope:
        scope.shield = True
        try:
            if isinstance(stream, trio.SocketStream):
                await stream.send_eof()
            drained = 0
            while drained < LINGER_BYTES:
                # (no reference kept to what was read while waiting for more:
                # a thousand refused connections must not hold a read each)
                n = len(await stream.receive_some(LINGER_READ))
                if not n:
                    break
                drained += n
        except Exception:  # noqa: BLE001 - best effort: the peer may be gone
            pass


async def await_event(
    stream: trio.abc.Stream, conn: Connection, kind: type[Event], pending: list[Event], memory: HandshakeMemory,
) -> Event | None:
    """The next event, which must be a `kind` (else the agent breaks the
    protocol); None if it closed or gave up. Events that arrived in the
    same read stay in `pending`, in order, for whoever reads next."""
    while not pending:
        pending.extend(await read_some(stream, conn, HANDSHAKE_READ))
        memory.charge(conn)
    ev = pending.pop(0)
    if isinstance(ev, kind):
        return ev
    if isinstance(ev, (ConnectionClosed, Error)):
        return None
    raise ProtocolError(f"expected {kind.__name__}, got {type(ev).__name__}", ErrorCode.UNEXPECTED)


def _trim_heap() -> None:
    """Return free heap memory to the system (glibc's malloc_trim; elsewhere nothing)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None

