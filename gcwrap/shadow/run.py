"""Run a shadow until it is stopped: open its state, serve, and stop in
order on SIGTERM or SIGINT (`Shadow.stop`; a second signal stops it at once)."""

from __future__ import annotations

import logging
import signal
from typing import Any

import trio

from ..sync import worst_error
from .admission import ShadowOptions
from .backends import open_store
from .files import Problem, StoreError
from .metrics import MetricsOptions, serve_metrics
from .server import Shadow

log = logging.getLogger("gcshadow")


async def run_shadow(opts: ShadowOptions, *, state: str = "", metrics: MetricsOptions | None = None,
                     task_status: Any = trio.TASK_STATUS_IGNORED) -> bool:
    """Serve until stopped (and the metrics, if asked for: metrics.py). True
    if a sync that hangs was left behind (the process must not wait for it)."""
    try:
        store = await trio.to_thread.run_sync(open_store, state, opts.root)
    except OSError as e:
        raise StoreError(Problem.ROOT, f"cannot use the root {opts.root}: {e.strerror or e}") from None
    shadow = Shadow(opts, store)
    try:
        with worst_error(), trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signals, shadow, signals)
                if metrics is not None:
                    await nursery.start(serve_metrics, shadow, metrics)
                await shadow.serve(task_status=task_status)  # (until `stop` ends it)
                nursery.cancel_scope.cancel()
    finally:
        store.close()
    return shadow.durability.abandoned


async def _stop_on_signals(shadow: Shadow, signals: Any) -> None:
    """The first SIGTERM or SIGINT stops the shadow in order (`Shadow.stop`),
    a second one at once."""
    async with trio.open_nursery() as nursery:
        async for signum in signals:
            if shadow.stopping:
                log.warning("%s received again: stopping now", signal.Signals(signum).name)
                if shadow.serving is not None:
                    shadow.serving.cancel()
                return
            nursery.start_soon(shadow.stop, f"{signal.Signals(signum).name} received")

