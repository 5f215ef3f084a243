"""Python's cyclic garbage collector under thousands of connections.

Each connection holds a few hundred objects for its whole life (its task,
cancel scopes, protocol state, files). With 10 000 connections a full
collection walks millions of them, and stops the event loop for one to
three seconds on a busy machine, every few seconds while agents connect
and every ten or twenty seconds while they only stream: no ACK goes out
meanwhile (measured: benchmarks/README.md, issue 17, fan-in at 10 000).

`keep_collections_short` takes what has lived for FREEZE_EVERY seconds out
of the collector's sight (`gc.freeze`): collections then walk only what
is newer, and stay short. Reference counting still frees frozen objects;
only a reference cycle among them, once garbage, waits: every THAW_EVERY
seconds they are handed back to the collector (`gc.unfreeze`), and the
next full collection frees such cycles, one long pause per THAW_EVERY
instead of one every few seconds.
"""

from __future__ import annotations

import gc

import trio

FREEZE_EVERY = 5.0  # seconds between freezes
THAW_EVERY = 600.0  # seconds between thaws: the cycles frozen objects left behind are freed after each


async def keep_collections_short(freeze_every: float = FREEZE_EVERY, thaw_every: float = THAW_EVERY) -> None:
    """Freeze what survived, every `freeze_every` seconds; thaw every
    `thaw_every` seconds. Runs until cancelled, and thaws then."""
    thawed = trio.current_time()
    try:
        while True:
            await trio.sleep(freeze_every)
            if trio.current_time() - thawed >= thaw_every:
                gc.unfreeze()
                thawed = trio.current_time()
            else:
                gc.collect(1)  # the young garbage first: frozen, a cycle of it would wait for the thaw
                gc.freeze()
    finally:
        gc.unfreeze()
