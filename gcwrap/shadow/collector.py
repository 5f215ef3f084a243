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
seconds they are handed back to the collector (`gc.unfreeze`) and one full
collection frees such cycles, one long pause per THAW_EVERY instead of one
every few seconds.

Between two freezes, what survived the young generations waits in the
oldest one; Python walks all of it in a full collection every ten
collections of the middle one once it has grown by a quarter of what it
held at the last full collection, which the freezes keep small (frozen
objects leave it). While agents connected, that was a
full collection of up to a million objects every second or two, a tenth of
the shadow's CPU for 10 000 agents (benchmarks/README.md, issue 17,
connections). So the shadow makes no full collection of its own accord
(`NO_FULL`): young garbage cycles are still collected in the young
generations, the rest waits for the freeze and the next thaw, as frozen
objects' cycles already do.
"""

from __future__ import annotations

import gc

import trio

FREEZE_EVERY = 5.0  # seconds between freezes
THAW_EVERY = 600.0  # seconds between thaws: the cycles frozen objects left behind are freed after each
NO_FULL = 1 << 30  # collections of the middle generation before a full one: never, but at the thaws


async def keep_collections_short(freeze_every: float = FREEZE_EVERY, thaw_every: float = THAW_EVERY) -> None:
    """Freeze what survived, every `freeze_every` seconds; thaw every
    `thaw_every` seconds. Runs until cancelled, and thaws then."""
    thawed = trio.current_time()
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, NO_FULL)
    try:
        while True:
            await trio.sleep(freeze_every)
            if trio.current_time() - thawed >= thaw_every:
                gc.unfreeze()
                gc.collect()  # the cycles that waited, frozen or not
                thawed = trio.current_time()
            else:
                gc.collect(1)  # the young garbage first: frozen, a cycle of it would wait for the thaw
                gc.freeze()
    finally:
        gc.set_threshold(young, middle, full)
        gc.unfreeze()
