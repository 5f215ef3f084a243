"""How much output the path to the shadow holds, and how long a byte waits in it.

The agent's own socket queue tells only of the first hop: behind a buffering
middlebox (an SSH tunnel, a TCP balancer) it stays empty while megabytes
wait in the middle. What the agent alone knows end to end is the shadow's
acknowledged progress against what it sent: `in_flight`, the bytes of DATA
frames sent and not yet acknowledged, and `ack_rate`, the bytes acknowledged
per second while something was in flight. By Little's law a byte waits
`in_flight / ack_rate` seconds between leaving the agent and being
acknowledged, whatever holds it on the way (socket queues, a token bucket, a
relay's buffer, the shadow's durable group).

Both count bytes on the wire (a compressed frame's compressed size): that is
what the path carries, so the rate stays the path's as frames turn from raw
to compressed and back. ACKs speak of job offsets; each frame sent is kept
(its stream, the job offset it ends at, its wire size) until an ACK covers it.

That wait tells whether the path is the bottleneck (`compress.Policy`) only
if the path is not already holding everything: the sender puts no more
DATA into it than `cap()`, about a second of what it drains (never less
than `FLOOR`). The rest waits in the agent, durable in memory or spool,
where it can still be compressed. A second is far more than a fast path
holds (loopback, a LAN: milliseconds), so there the cap never binds.

It is pure: the sender tells it of each DATA frame it sent and each ACK,
and when (`trio.current_time()`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

FLOOR = 4 << 20  # wire bytes the path may always hold: a fast start, before its rate is known
CAP_SECONDS = 1.0  # the path may hold this many seconds of what it drains
RATE_SPAN = 0.05  # seconds of busy time (something in flight) a rate sample covers (or FLOOR bytes)
_SMOOTH = 0.3  # weight of the newest sample in the running average


@dataclass
class PathWindow:
    """One connection's path: what is in flight, the rate it drains at, and
    the cap. A new connection starts a new one (its estimates start over)."""

    now: float
    in_flight: int = 0  # wire bytes of DATA frames sent and not acknowledged
    ack_rate: float = 0.0  # running average of wire bytes acknowledged per busy second
    _frames: dict[int, deque[tuple[int, int]]] = field(default_factory=dict)  # per stream: (end, wire) in flight
    _acked_to: dict[int, int] = field(default_factory=dict)  # per stream: the job offset acknowledged
    _at: float = 0.0  # when busy time was last counted
    _busy: float = 0.0  # busy seconds since the last rate sample
    _acked: int = 0  # wire bytes acknowledged since the last rate sample
    _unanswered: float = 0.0  # busy seconds since the last ACK

    def __post_init__(self) -> None:
        self._at = self.now

    def _advance(self, now: float) -> None:
        if self.in_flight > 0 and now > self._at:
            self._busy += now - self._at
            self._unanswered += now - self._at
        self._at = max(self._at, now)

    def sent(self, now: float, stream: int, end: int, wire: int) -> None:
        """A DATA frame of `stream` ending at job offset `end` went as `wire`
        bytes (an ACK that came before the send returned already covers it)."""
        self._advance(now)
        if end <= self._acked_to.get(stream, 0):
            return
        self._frames.setdefault(stream, deque()).append((end, wire))
        self.in_flight += wire

    def acked(self, now: float, stream: int, offset: int) -> None:
        """The shadow acknowledged `stream` up to job offset `offset`."""
        self._advance(now)
        self._acked_to[stream] = max(offset, self._acked_to.get(stream, 0))
        frames = self._frames.get(stream)
        size = 0
        while frames and frames[0][0] <= offset:
            size += frames.popleft()[1]
        self.in_flight -= size
        self._acked += size
        self._unanswered = 0.0
        # A sample spans RATE_SPAN, or a FLOOR's worth of bytes: a fast path
        # leaves the floor within its first round trip.
        if self._acked and self._busy > 0 and (self._busy >= RATE_SPAN or self._acked >= FLOOR):
            sample = self._acked / self._busy
            self.ack_rate = sample if not self.ack_rate else self.ack_rate + _SMOOTH * (sample - self.ack_rate)
            self._busy, self._acked = 0.0, 0

    def wait(self, now: float) -> float:
        """Seconds a byte sent now waits to be acknowledged (Little's law);
        at least as long as the path has gone without an ACK while busy."""
        silent = self._unanswered + (now - self._at if self.in_flight > 0 else 0.0)
        if not self.ack_rate:
            return silent
        return max(self.in_flight / self.ack_rate, silent)

    def cap(self) -> int:
        """Wire bytes the path may hold: about `CAP_SECONDS` of what it drains."""
        return max(FLOOR, int(self.ack_rate * CAP_SECONDS))

    def room(self) -> int:
        """Bytes the sender may still put in (<= 0: none, wait for an ACK)."""
        return self.cap() - self.in_flight
