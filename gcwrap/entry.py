"""The `gcwrap` command's entry point (the console script calls `gcwrap`).

Its first act is to catch the stop signals (see agent/stopsignals.py):
loading click and the command line takes tens of milliseconds, and a
Ctrl-C meanwhile must neither print a traceback nor end gcwrap half-way.
Only then is the command line loaded.

The cyclic garbage collector is off while gcwrap loads: the imports make
many objects and free almost none, and its passes over them cost a run
about a tenth of its start. `gcwrap run` turns it on again once what it
loaded is frozen (gcwrap.cli), every other command as it starts.
"""

from __future__ import annotations

import gc


def gcwrap() -> None:
    gc.disable()
    from .agent.stopsignals import EarlySignals, stop_signals

    caught = EarlySignals(stop_signals())
    from .cli import main

    main(obj=caught)
