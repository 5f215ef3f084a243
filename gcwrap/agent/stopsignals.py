"""The stop signals (SIGTERM, SIGINT, SIGHUP) from gcwrap's first instant.

A batch system's walltime, `timeout` and Ctrl-C may come at any moment,
also while gcwrap is still loading itself. The console script's entry point
(gcwrap.entry) catches them before anything else is imported; one that
comes before the event loop's receiver is open is kept (`EarlySignals`)
and handed to it, so that it reaches the job (started meanwhile) and starts
gcwrap's own end, as one that came later would. A command that starts no
job gets them back, each as if it came then (`release`).

One Ctrl-C can come before even that, and be lost by Python itself: the
interpreter's own handler turns it into a KeyboardInterrupt, and where that
happens while Python checks its argv[0] (after `site`, before the console
script runs), it prints "Failed checking if argv[0] is an import path entry"
and the traceback, and goes on to run gcwrap as if nothing had come. Only
`sys.last_value` (set by the report) remembers it: EarlySignals counts it as
a SIGINT caught (`swallowed_interrupt`), or gcwrap would start the job and
wait for it, the Ctrl-C gone. Python can lose one without a trace, too: the
KeyboardInterrupt raised in a weakref callback of its import system (a
module lock's, as `site` or the console script imports) is reported as
"Exception ignored" and dropped (CPython #95959). Nothing is left for gcwrap
to count then: the job starts, and a second Ctrl-C stops it.

This module imports nothing of gcwrap, and little else: it runs first.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # forwarded to the job; gcwrap ends (StopClock)


def stop_signals() -> tuple[int, ...]:
    """STOP_SIGNALS, less SIGHUP if it was ignored when gcwrap started
    (`nohup gcwrap ...`): a hangup then ends neither gcwrap nor its job."""
    return tuple(s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN)


def swallowed_interrupt() -> bool:
    """Whether a Ctrl-C came while the interpreter started, and Python
    reported it and went on (see above): the report left it in
    `sys.last_value`, which is then cleared, so that it counts once."""
    if not isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        return False
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    return True


class EarlySignals:
    """Catches the stop signals until the event loop's receiver takes over
    (`take`): a signal that came in between is kept, not lost, and does not
    end gcwrap at once (which would orphan the job)."""

    def __init__(self, signums: tuple[int, ...]) -> None:
        self.pending: list[int] = []
        self.previous = {s: signal.signal(s, self._catch) for s in signums}
        if signal.SIGINT in signums and swallowed_interrupt():
            self.pending.append(signal.SIGINT)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)

    def take(self) -> list[int]:
        """The signals caught so far (the receiver now owns the handlers)."""
        pending, self.pending = self.pending, []
        return pending

    def restore(self) -> None:
        """Give the signals back to their former handlers."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def release(self) -> None:
        """Give the signals back (no job is started), and deliver those caught
        so far, as if they came now: Ctrl-C during `gcwrap status` still
        interrupts it."""
        self.restore()
        for signum in self.take():
            signal.raise_signal(signum)
