"""Where the shadow keeps its state: what the server needs of it, and how
a `--state` option (environment GCSHADOW_STATE) names it.

The default is the embedded SQLite database of the root (`state.Store`,
one shadow per root). `postgresql://...` keeps jobs, fencing epochs,
durable lengths and exit statuses in PostgreSQL (`pgstate.PgStore`), shared
by any number of shadows serving one root on a shared file system.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..wire.events import StreamSpec
from .files import JobFiles, StreamFile
from .stateurl import check_state, is_shared, shown
from .syncer import Syncer

if TYPE_CHECKING:
    from .fileversions import VersionRecord, VersionRow
    from .state import Attempt
    from .timeline import Batch

log = logging.getLogger("gcshadow")


class StateBackend(Protocol):
    """What the server and the durability thread need of the state.

    Synchronous: called from the shadow's worker thread (claims, records)
    and its durability thread (`make_durable`). Every record that a later
    claim must not be overtaken by is conditional on the session (the
    fencing epoch) still holding the job, checked in the same transaction."""

    root: Path
    root_fd: int
    syncer: Syncer
    shared: bool  # other processes may claim jobs of this root (several shadows)

    def open_job(self, *, job_id: str, instance: str, streams: Iterable[StreamSpec], host: str, user: str,
                 command: list[str], peer: str, tenant: str = "") -> JobFiles: ...

    def owner(self, job_id: str) -> str | None: ...

    def attempt(self, job_id: str, instance: str) -> Attempt:
        """"new", "current", or "replaced" (by a newer attempt of the job: refused for good)."""
        ...

    def make_durable(
        self, files: list[tuple[StreamFile, int]]
    ) -> tuple[list[tuple[StreamFile, int, OSError | None]], str]: ...

    def record_files(self, records: list[VersionRecord]) -> set[tuple[str, int, int]]:
        """Versions of the files jobs write, fenced as durable lengths are: the (job, file, version) refused."""
        ...

    def read_files(self, job_id: str, instance: str) -> list[VersionRow]: ...

    def name_holder(self, name: str, job_id: str) -> str | None:
        """The other job still active that writes `name` (a stream, or a file), if any."""
        ...

    def record_disconnected(self, job_id: str, session: int) -> bool: ...

    def record_finished(self, job_id: str, session: int, *, code: int | None, signal: int | None, reason: str,
                        summary: dict[str, Any]) -> bool: ...

    def superseded(self, held: dict[str, int]) -> set[str]: ...

    def grouped(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Several of `open_job`, `record_finished`, `record_disconnected`:
        the result of each, or its exception in its place."""
        ...

    def mark_disconnected(self) -> None: ...

    def record_timeline(self, batch: Batch) -> None:
        """Jobs' events, refused connections, when agents were last heard from, the root's free space."""
        ...

    def close(self) -> None: ...


def open_store(state: str, root: Path) -> StateBackend:
    """The state of the shadow serving `root` (blocking: from a worker thread)."""
    if is_shared(state):
        from .pgstate import PgStore

        store = PgStore(root, check_state(state))
        log.info("state in %s, shared with the other shadows serving %s", shown(state), root)
        return store
    from .state import Store

    return Store(root)


def read_jobs(state: str, root: Path, *, job: str | None = None, events: int | None = None) -> list[dict[str, Any]]:
    """Every job the state knows (or `job` alone), with its streams, its
    timeline (`events`, oldest first: the newest `events` of each, None for
    all kept, 0 for none), the shadow short of disk at home (`home`) and
    `why` (`gcshadow jobs`, `tail`)."""
    if is_shared(state):
        from .pgstate import list_jobs as list_pg

        return list_pg(check_state(state), job, events)
    from .listing import list_jobs

    return list_jobs(root, job, events)


def read_refusals(state: str, root: Path, limit: int = 200) -> list[dict[str, Any]]:
    """The newest refused connections first: time, peer, identity ("" if
    none was established), job_id ("" if the handshake did not get that far), code, message."""
    if is_shared(state):
        from .pgstate import list_refusals as pg_refusals

        return pg_refusals(check_state(state), limit)
    from .listing import list_refusals

    return list_refusals(root, limit)


def read_homes(state: str, root: Path) -> list[dict[str, Any]]:
    """The shadows serving the root now, each with its root's free space and --min-free."""
    if is_shared(state):
        from .pgstate import list_homes as pg_homes

        return pg_homes(check_state(state))
    from .listing import list_homes

    return list_homes(root)
