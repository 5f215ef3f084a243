"""Durable groups under bulk output: how long the next group waits to fill.

Once a group covered `GroupOptions.bulk` bytes or more, bulk output is
arriving: the next group waits for `full` bytes, or until `interval` has
passed since the last group was taken, or until no frame has become whole
for `idle`, whichever comes first. On a busy machine a group would
otherwise be synced for each frame on its own as it becomes whole (a sync
per MiB, each with its writeback). Smaller groups (line output, many small
agents) never wait: their ACKs go out as before.

The streams' groups (`durability.Durability`, in a thread, on
time.monotonic) and each session's files' (`filestore.SessionFiles`, in
the event loop, on trio's clock) follow the same `Pacing`: a pure object,
told the time by its caller.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupOptions:
    """The bounds of a durable group under bulk output (see the module's docstring)."""

    bulk: int = 1 << 20  # bytes of a group past which the next one waits to fill
    full: int = 16 << 20  # bytes that fill it
    interval: float = 0.02  # seconds since the last group was taken that end the wait
    idle: float = 0.005  # seconds without a frame that end it


class Pacing:
    """What arrived since the last group was taken, and how long the next one waits."""

    def __init__(self, opts: GroupOptions) -> None:
        self.opts = opts
        self.pending = 0  # bytes whose frames became whole since the last group was taken
        self.last = 0  # ...and those the last group took
        self.began = 0.0  # when the last group was taken
        self.marked = 0.0  # when a frame last became whole

    @property
    def full(self) -> bool:
        return self.pending >= self.opts.full

    @property
    def after_bulk(self) -> bool:
        """The last group was bulk: the next one may wait to fill."""
        return self.last >= self.opts.bulk

    def mark(self, n: int, now: float) -> bool:
        """A frame of `n` bytes became whole; whether the group is full now."""
        self.pending += n
        self.marked = now
        return self.full

    def take(self, now: float) -> int:
        """The next group is taken: the bytes it covers."""
        self.last, self.pending, self.began = self.pending, 0, now
        return self.last

    def wait(self, now: float) -> float:
        """Seconds the next group still waits to fill (0: it goes now)."""
        if not self.after_bulk or self.full:
            return 0.0
        o = self.opts
        return max(0.0, min(self.began + o.interval, self.marked + o.idle) - now)
