"""The job as the agent's tasks share it, beyond its streams (the outbox's):
when this run began, whether the job's process has ended, whether gcwrap
must end it and why, and the fields noted of it for the spool's job record
and for the live view. One object, passed to each task that needs it.
"""

from __future__ import annotations

from typing import Any

import trio

from ..sync import Signal


class JobState:
    """What the pipe readers, the spool writer and delivery know of the job
    itself. `note` wakes every task (the outbox's `changed` signal): a
    paused reader then says why, the commit loop records the fields."""

    def __init__(self, changed: Signal, started: float) -> None:
        self.changed = changed  # (the outbox's: the one signal the tasks share)
        self.started = started  # when this run began (time.monotonic()'s clock)
        self.exited = False  # the job's process has ended (its pipes may still hold output)
        self.kill_reason = ""  # why gcwrap ended the job, when it did
        self.must_end = trio.Event()  # set: end the job now (see `end_job`)
        self.updates: dict[str, Any] = {}  # for the spool's job record at the next commit
        self.live: dict[str, Any] = {}  # for the live view (`gcwrap status`)

    def note(self, **fields: Any) -> None:
        """Fields for the spool's job record at the next commit, and the live view."""
        self.updates.update(fields)
        self.live.update(fields)
        self.changed.fire()

    def note_live(self, **fields: Any) -> None:
        """Fields for the live view only (the spool's job record has no place for them)."""
        self.live.update(fields)

    def take_updates(self) -> dict[str, Any]:
        """The fields noted since the last commit, for the next one."""
        updates, self.updates = self.updates, {}
        return updates

    def put_back(self, updates: dict[str, Any]) -> None:
        """A commit that did not record `updates`: they go in the next (newer ones win)."""
        self.updates = {**updates, **self.updates}

    def end_job(self, reason: str) -> None:
        """End the running job (SIGTERM to its process group, SIGKILL after
        KILL_GRACE), recording why: in the spool, the live status, the EXIT."""
        if self.exited or self.must_end.is_set():
            return
        self.kill_reason = reason
        self.note(reason=reason)
        self.must_end.set()
