"""What happened to a job's delivery, timed: the link's clock and the notes
the agent sends home for the job's timeline.

`LinkClock` is the one owner of the time on and off the link: how long
connections were up (from their connect to the moment they last worked:
their last frame from the shadow, an ACK, a PONG...), how long output waited
on a connection that was up but acknowledged nothing for more than a
heartbeat (a *stall*, counted whole once it is one), and since when the
output now pending has waited with nothing acknowledged. The time off the
link (`disconnected_s` in the I/O summary) is the rest of the wall time, so
it counts from the moment a connection last worked, not from when its
death was noticed: a 20 s cut is about 20 s of stall and disconnection
together, however long the watchdog took to see it.

`Timeline` keeps the notes (`gcwrap.wire.events.Note`) the agent takes of
moments the shadow may not see itself (a connection lost and when it last
worked, a stall, a reconnection, a pause, a refusal, compression on or off,
the disk full or back), the newest NOTES_KEPT of them, until the shadow
surely has them: sent on a connection, then answered on it after them
(the PONG to a PING sent behind them, or DONE). A note sent on a connection
that broke first is sent again on the next one: at least once (the shadow
drops a duplicate).

`Journal` is what the agent and its sessions tell of the delivery: it
drives the clock and takes the notes. All three are driven by times passed
in (`trio.current_time()` in the agent), so tests run them under trio's
autojump clock; `unix` turns such a time into a Unix time for a note.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..wire import compress as zc
from ..wire.events import Note, Notes, NoteValue, Ping
from ..wire.frames import MAX_CONTROL, MAX_NOTES

NOTES_KEPT = 300  # notes held for home at most: the oldest go first
NOTE_TEXT = 512  # characters of a note's text detail (the protocol's limit)
_FRAME_BUDGET = MAX_CONTROL - 256  # JSON bytes of notes per NOTES frame (its wrapper takes a few)


def process_started() -> float:
    """When this process started, on `time.monotonic()`'s clock: gcwrap
    starts the job before its event loop is even loaded, and its wall time
    runs from its own start (the kernel's record of it, to 10 ms). The
    present moment where /proc cannot tell."""
    now = time.monotonic()
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime (the name may hold spaces)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - min(max(age, 0.0), now)


@dataclass(frozen=True)
class Stall:
    """Output waited `seconds` from `since`, nothing acknowledged, on a connection that was up."""

    since: float
    seconds: float


class LinkClock:
    """Time on and off the link, for a `heartbeat` (a stall is a wait longer
    than one). A pure policy: every method takes `now`."""

    def __init__(self, heartbeat: float) -> None:
        self.heartbeat = heartbeat
        self.connected_s = 0.0  # closed connections, each from its connect to when it last worked
        self.stalled_s = 0.0  # stalls that ended
        self.stalls = 0
        self.up_since: float | None = None  # the connection now up: when it was made
        self.worked_at: float | None = None  # ...and when it last worked
        self.waiting_since: float | None = None  # output pending since then, nothing acknowledged
        self.busy_at: float | None = None  # when bytes last moved on the connection up (`busy`)
        self.last_worked: float | None = None  # when the last connection to end had last worked

    def output(self, now: float) -> None:
        """Output was read (it waits to go home)."""
        if self.waiting_since is None:
            self.waiting_since = now

    def connected(self, now: float) -> None:
        self.up_since = self.worked_at = now
        self.busy_at = None

    def busy(self, now: float) -> None:
        """Bytes of ours are moving (the shadow's TCP acknowledged some: the
        kernel's send queue shrank): a slow link, not a stall. A stall is a
        wait with nothing moving (`liveness` tells the two apart alike)."""
        if self.up_since is not None:
            self.busy_at = now

    def send_queue(self, now: float, before: int, queued: int) -> None:
        """The kernel's send queue of the connection, at the watchdog's look
        (`queued`) and at its last (`before`). Bytes still queued and fewer
        than before are moving on a slow link (`busy`). A queue that emptied
        is not: its bytes are at the peer, which acknowledges nothing (a
        relay, a firewall or a proxy that accepts and holds them, or a
        shadow that cannot write), so the wait goes on counting as a stall."""
        if 0 < queued < before:
            self.busy(now)

    def worked(self, now: float) -> None:
        """Something came from the shadow on the connection that is up."""
        if self.up_since is not None:
            self.worked_at = now

    def _stall_start(self) -> float | None:
        if self.up_since is None or self.waiting_since is None:
            return None
        return max(self.waiting_since, self.up_since, self.busy_at or self.up_since)

    def _stall_until(self, end: float) -> Stall | None:
        """The stall that ends at `end`, if the wait up to then was one."""
        start = self._stall_start()
        if start is None or end - start <= self.heartbeat:
            return None
        self.stalled_s += end - start
        self.stalls += 1
        return Stall(start, end - start)

    def acked(self, now: float, pending: bool) -> Stall | None:
        """Home acknowledged more (`pending`: output still waits): the stall it
        ends, if the wait was one."""
        self.worked(now)
        stall = self._stall_until(now)
        self.waiting_since = now if pending else None
        return stall

    def welcomed(self, now: float, moved: bool, pending: bool) -> None:
        """Home welcomed the connection, holding more than was acknowledged
        (`moved`) or not."""
        self.worked(now)
        if not pending:
            self.waiting_since = None
        elif moved:
            self.waiting_since = now

    def closed(self, now: float) -> Stall | None:
        """The connection ended (noticed at `now`). It was up until it last
        worked; a stall it was in lasted until then."""
        if self.up_since is None or self.worked_at is None:
            return None
        worked = min(self.worked_at, now)
        stall = self._stall_until(worked)
        self.connected_s += worked - self.up_since
        self.last_worked = worked
        self.up_since = self.worked_at = None
        return stall

    def stalled_since(self, now: float) -> float | None:
        """When the stall going on now began (None: none is)."""
        start = self._stall_start()
        return start if start is not None and now - start > self.heartbeat else None

    def figures(self, now: float) -> tuple[float, float]:
        """Seconds connected and, of those, stalled, as of `now` (a connection
        up now counts as working until it is found dead)."""
        connected, stalled = self.connected_s, self.stalled_s
        if self.up_since is not None:
            connected += now - self.up_since
            start = self.stalled_since(now)
            if start is not None:
                stalled += now - start
        return connected, stalled


def note_text(text: str) -> str:
    """Text a note can carry: Unicode without NUL, at most NOTE_TEXT characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\0")
    return text if len(text) <= NOTE_TEXT else text[: NOTE_TEXT - 3] + "..."


def make_note(at: float, kind: str, **details: NoteValue) -> Note:
    return Note(round(at, 3), kind, tuple((k, note_text(v) if isinstance(v, str) else v) for k, v in details.items()))


def note_frames(notes: list[Note]) -> list[Notes]:
    """NOTES frames holding `notes` in order, each within the protocol's
    bounds (MAX_NOTES notes, a JSON body under MAX_CONTROL)."""
    frames: list[Notes] = []
    batch: list[Note] = []
    size = 0
    for note in notes:
        n = len(json.dumps([note.time, note.kind, dict(note.details)], separators=(",", ":"),
                           ensure_ascii=False).encode()) + 1
        if batch and (len(batch) == MAX_NOTES or size + n > _FRAME_BUDGET):
            frames.append(Notes(tuple(batch)))
            batch, size = [], 0
        batch.append(note)
        size += n
    if batch:
        frames.append(Notes(tuple(batch)))
    return frames


def compression_why(policy: zc.Policy) -> str:
    """Why the sender compresses output now, or does not, in words."""
    if policy.active:
        if policy.mode is zc.Mode.ZSTD:
            return "--compress zstd: every frame that gets smaller"
        return (f"the link is the bottleneck ({policy.link_rate / 1e6:.2f} MB/s) and the output compresses "
                f"to {policy.ratio:.0%} of its size")
    if not policy.history:
        return "a new connection starts uncompressed"
    if policy.ratio > zc.GOOD_RATIO:
        return f"the output no longer compresses well (to {policy.ratio:.0%} of its size)"
    return "the job's output fits the link uncompressed, or compressing costs too much CPU"


class Timeline:
    """The notes for home, the newest `kept`, each numbered; the sessions
    take the ones they have not sent (`unsent`) and say which ones the
    shadow surely has (`confirmed`)."""

    def __init__(self, kept: int = NOTES_KEPT) -> None:
        self.items: deque[tuple[int, Note]] = deque(maxlen=kept)
        self.last = 0  # the number of the newest note
        self.dropped = 0  # notes dropped unsent for want of room

    def add(self, note: Note) -> None:
        if len(self.items) == self.items.maxlen:
            self.dropped += 1
        self.last += 1
        self.items.append((self.last, note))

    def has_unsent(self, after: int) -> bool:
        return bool(self.items) and self.items[-1][0] > after

    def unsent(self, after: int) -> list[Note]:
        """The notes numbered past `after`, oldest first."""
        return [note for seq, note in self.items if seq > after]

    def confirmed(self, upto: int) -> None:
        """The shadow has every note numbered up to `upto`: they go."""
        while self.items and self.items[0][0] <= upto:
            self.items.popleft()



class NoteCourier:
    """The timeline's notes on one connection: the last one sent on it, and
    the PINGs that followed them; a PONG to one says the shadow has every
    note sent before it (`Timeline.confirmed`). It numbers the connection's
    PINGs, the heartbeat's too."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.accepted = False  # the WELCOME accepted notes
        self.sent = 0  # the number of the last note sent on this connection
        self.unconfirmed: deque[tuple[int, int]] = deque()  # (PING nonce, last note sent before it)
        self.nonces = itertools.count(1)

    def due(self) -> bool:
        """Notes wait that this connection may send."""
        return self.accepted and self.timeline.has_unsent(self.sent)

    def take(self) -> list[Notes | Ping]:
        """The notes not yet sent on this connection, then a PING: its PONG
        says the shadow has them."""
        last = self.timeline.last
        frames: list[Notes | Ping] = [*note_frames(self.timeline.unsent(self.sent))]
        self.sent = last
        nonce = next(self.nonces)
        self.unconfirmed.append((nonce, last))
        return [*frames, Ping(nonce)]

    def ping(self) -> Ping:
        return Ping(next(self.nonces))

    def pong(self, nonce: int) -> None:
        while self.unconfirmed and self.unconfirmed[0][0] <= nonce:
            self.timeline.confirmed(self.unconfirmed.popleft()[1])

    def done(self) -> None:
        """DONE: the shadow has every note sent (they went before the EXIT)."""
        self.timeline.confirmed(self.sent)

class Journal:
    """What the agent and its sessions tell of the delivery: it drives the
    `link` clock and takes the `notes` for home. `unix(t)` turns a time of
    the clock into a Unix time."""

    def __init__(self, heartbeat: float, unix: Callable[[float], float]) -> None:
        self.link = LinkClock(heartbeat)
        self.notes = Timeline()
        self.unix = unix
        self.compressing = False  # as last noted
        self.lost_at: float | None = None  # a streaming connection was lost, and had last worked then
        self.lost_attempts = 0  # ...after this many attempts in all
        self.refusal: tuple[str, str] = ("", "")  # the last refusal noted, since the last welcome

    def note(self, at: float, kind: str, **details: NoteValue) -> None:
        self.notes.add(make_note(self.unix(at), kind, **details))

    def _stall(self, stall: Stall | None, where: str) -> None:
        if stall is not None:
            self.note(stall.since + stall.seconds, "stalled", since=round(self.unix(stall.since), 3),
                      seconds=round(stall.seconds, 3), shadow=where)

    def acked(self, now: float, pending: bool, where: str) -> None:
        self._stall(self.link.acked(now, pending), where)

    def session_ended(self, now: float, where: str, lost: bool, reason: str, attempts: int) -> None:
        """A connection ended, noticed at `now`. `lost`: it had been welcomed
        and failed (after `attempts` attempts in all); `reason`: why, in
        words ("" for a refusal, which `refused` notes)."""
        self._stall(self.link.closed(now), where)
        if not lost:
            return
        worked = self.link.last_worked if self.link.last_worked is not None else now
        self.lost_at, self.lost_attempts = worked, attempts
        if reason:
            self.note(now, "connection_lost", reason=reason, worked_at=round(self.unix(worked), 3), shadow=where)

    def welcomed(self, now: float, where: str, attempts: int, first: bool, since_start: float) -> None:
        """Home welcomed connection `attempts` (counted from gcwrap's start);
        `first`: the first ever, `since_start` seconds after gcwrap started."""
        self.refusal = ("", "")
        if self.lost_at is not None:
            self.note(now, "reconnected", after_s=round(now - self.lost_at, 3), shadow=where,
                      attempts=attempts - self.lost_attempts)
            self.lost_at = None
        elif first and attempts > 1:
            self.note(now, "connected", after_s=round(since_start, 3), shadow=where, attempts=attempts)

    def refused(self, now: float, code: str, message: str, where: str) -> None:
        """The shadow refused the job (said once until it changes its words or welcomes it)."""
        if (code, message) != self.refusal:
            self.refusal = (code, message)
            self.note(now, "refused", code=code, message=message, shadow=where)

    def compression(self, now: float, on: bool, why: str) -> None:
        if on != self.compressing:
            self.compressing = on
            self.note(now, "compression", on=on, why=why)
