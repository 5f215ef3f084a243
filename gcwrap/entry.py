"""The `gcwrap` command's entry point (the console script calls `gcwrap`).

Its first act is to catch the stop signals (see agent/stopsignals.py):
loading click and the command line takes tens of milliseconds, and a
Ctrl-C meanwhile must neither print a traceback nor end gcwrap half-way.
Only then is the command line loaded.
"""

from __future__ import annotations


def gcwrap() -> None:
    from .agent.stopsignals import EarlySignals, stop_signals

    caught = EarlySignals(stop_signals())
    from .cli import main

    main(obj=caught)
