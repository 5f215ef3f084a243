"""When a connection that looks alive is dead: the rules of a session's watchdog.

`Liveness` is a pure policy: no I/O, no clock of its own. The session feeds
it what happened (`heard`, `answered`) and `watch` asks it, every quarter
heartbeat, what it makes of what the session sees (the kernel's send queue,
the requests unanswered), with `now` from `trio.current_time()`: tests run
both under trio's autojump clock.

Rule 1, the black hole: for three heartbeats nothing came in *and* the
peer's TCP acknowledged none of our bytes (the send queue did not shrink).
A slow shadow behind a thin link still drains the send queue, so it stays
alive even while one large frame takes longer than that and our PING waits
behind it.

Rule 2, the stall: a request of ours (the DATA of one stream, a STDIN_READ,
the EXIT) has had no answer (an ACK that moves that stream forward,
STDIN_DATA, DONE) for three heartbeats *counted only while the kernel's send
queue is empty*, that is while everything we sent has left this host and
been acknowledged by the peer's TCP. Heartbeats may be answered all along:
a middlebox that read and dropped our bytes (or the peer's answers) passes
PINGs and PONGs again afterwards as if nothing had happened. A slow link is not a stall: its
send queue is not empty, so the clock does not run while our bytes are
still on their way; and a slow but alive shadow answers within moments of
receiving the bytes (it acknowledges them as it makes them durable). Each
request has its own clock, so a stream whose bytes vanished is noticed even
while another stream's ACKs keep coming. The clock counts only sampled time
with the queue empty: a PING or a new frame briefly in the queue pauses it,
never resets it; only an answer does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import trio

Verdict = tuple[str, Hashable | None]  # ("silent", None) or ("stalled", the request)


class Liveness:
    """The two rules of a session's watchdog, for `heartbeat` seconds between PINGs."""

    def __init__(self, heartbeat: float, now: float) -> None:
        self.limit = 3 * heartbeat
        self.last_in = now  # something came in
        self.last_out = now  # the peer's TCP acknowledged some of our bytes
        self.queued: int | None = None  # the send queue at the last check
        self.last_check = now
        self.waited: dict[Hashable, float] = {}  # per request: seconds without an answer, queue empty

    def heard(self, now: float) -> None:
        """Bytes came in from the peer."""
        self.last_in = now

    def answered(self, request: Hashable) -> None:
        """The peer answered `request` (or moved it forward): its clock starts over."""
        self.waited.pop(request, None)

    def check(self, now: float, queued: int, waiting: Iterable[Hashable]) -> Verdict | None:
        """Look at the connection at `now`: `queued` bytes in the kernel's send
        queue, `waiting` the requests sent and not yet answered. Returns None
        while it is alive; ("silent", None) for a black hole; ("stalled",
        request) for a request unanswered too long."""
        elapsed = max(0.0, now - self.last_check)
        self.last_check = now
        if self.queued is not None and queued < self.queued:
            self.last_out = now
        self.queued = queued
        waiting = set(waiting)
        for request in list(self.waited):
            if request not in waiting:
                del self.waited[request]  # answered in full: nothing outstanding
        for request in waiting:
            before = self.waited.get(request)
            # A request first seen now starts at 0; one seen before gains the
            # time since the last check if everything we sent has left the host.
            self.waited[request] = 0.0 if before is None else before + (elapsed if queued == 0 else 0.0)
        if now - self.last_in > self.limit and now - self.last_out > self.limit:
            return ("silent", None)
        for request, waited in self.waited.items():
            if waited >= self.limit:
                return ("stalled", request)
        return None


async def watch(liveness: Liveness, heartbeat: float, probe: Callable[[], tuple[int, Iterable[Hashable]]]) -> Verdict:
    """Check every quarter heartbeat until the connection is dead; return the
    verdict. `probe()` gives the send queue's length and the requests waiting."""
    while True:
        await trio.sleep(heartbeat / 4)
        verdict = liveness.check(trio.current_time(), *probe())
        if verdict is not None:
            return verdict
