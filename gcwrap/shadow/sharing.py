"""Several shadows on one root: a session learns that another shadow took
its job over, or that the shared state is lost, and lets go."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import trio

from .backends import StateBackend
from .durability import LiveJob, Trouble
from .files import StoreError

WATCH_EVERY = 1.0  # seconds: how often a shadow sharing its state asks whether its jobs were taken over


async def watch_state(store: StateBackend, live: dict[str, LiveJob],
                      worker: Callable[[Callable[[], set[str]]], Awaitable[set[str]]]) -> None:
    """With a state other shadows share: every WATCH_EVERY seconds, fence
    the sessions here (`live`: job -> the session holding it) whose job
    another shadow claimed since: they let go of its files, which that one
    waits for. While the state cannot be reached, fence every session: none
    can prove it still holds its job (nothing is acknowledged meanwhile)."""
    while True:
        await trio.sleep(WATCH_EVERY)
        await check_holders(store, live, worker)


async def check_holders(store: StateBackend, live: dict[str, LiveJob],
                        worker: Callable[[Callable[[], set[str]]], Awaitable[set[str]]]) -> None:
    """One look at the state (see `watch_state`)."""
    held = {j: job.files.session for j, job in live.items() if job.files.session}
    try:
        taken = await worker(functools.partial(store.superseded, held))
    except StoreError as e:
        taken, why, trouble = set(held), f"the shadow lost its state database: {e}", Trouble.STATE
    else:
        why, trouble = "another shadow took this job over", Trouble.TAKEN_OVER
    for job_id in taken:
        job = live.get(job_id)
        if job is not None and job.files.session == held[job_id]:
            job.fence(why, trouble)
