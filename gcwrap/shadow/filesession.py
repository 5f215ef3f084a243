"""The file frames in a session's handler: each taken (`on_event`), and
what the versions hold made durable, then acknowledged, in groups while
the session reads on (`keep_durable`). The versions themselves, their
files and their records: gcwrap.shadow.filestore."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from ..wire.codec import ProtocolError
from ..wire.events import ErrorCode, Event, FileAck, FileCommit, FileCopy, FileData, FileOpen
from .acks import Sender
from .durability import Fenced, Trouble
from .files import Problem, StateUnavailable, StoreError
from .filestore import Fencing, SessionFiles
from .replies import WIRE_CODES


async def on_event(files: SessionFiles, ev: Event, sender: Sender) -> None:
    """One of FILE_OPEN, FILE_DATA, FILE_COPY, FILE_COMMIT."""
    if wanted := files.fds_wanted(ev):
        await files.room(wanted)  # (the budget counts the versions' files: `OpenFiles`)
    if isinstance(ev, FileOpen):
        try:
            name = files.name_of(ev)
            if ev.file not in files.names:  # (a NAME is one job's at a time, as a stream's is)
                holder = await trio.to_thread.run_sync(files.store.name_holder, name, files.job_id)
                if holder:
                    raise StoreError(Problem.NAME_IN_USE, f"{name!r} belongs to job {holder}, which is still active")
            files.opened(ev)
        except StoreError as e:  # (the session ends in an ERROR: the timeline says which file's NAME)
            files.notes.said("file_refused", file=ev.file, name=ev.name, code=WIRE_CODES[e.problem].name,
                             message=str(e))
            raise
    elif isinstance(ev, FileData):
        files.data(ev)
    elif isinstance(ev, FileCopy):
        files.copy(ev)
    elif isinstance(ev, FileCommit):
        async with files.lock:  # (after the group in progress; none starts until the commit is made)
            await _flush(files, sender)
            v = files.to_commit(ev)
            sha = await trio.to_thread.run_sync(files.digest, v, ev.size)
            if sha != ev.sha256:
                raise ProtocolError(f"FILE_COMMIT: version {v.version} of {v.name!r} has SHA-256 {sha} at home, "
                                    f"not {ev.sha256}: it was changed at home", ErrorCode.LENGTH_MISMATCH)
            await _guarded(files.commit_file, v, ev.size, sha)
            files.notes.commit(v, ev.size)
            await sender.send(lambda: sender.conn.send(FileAck(v.file, v.version, ev.size, committed=True)),
                              check=True)


def keep_durable(files: SessionFiles, sender: Sender) -> None:
    """After a read's frames (in the event loop, without waiting): what the
    versions hold is made durable, then acknowledged, by a task of the
    session's (in the nursery of its `Sender`) that makes groups until
    nothing more is dirty. A failure in it ends the session as it would
    have inline (Fenced, StoreError)."""
    if files.dirty and not files.flushing and sender.nursery is not None:
        files.flushing = True
        sender.nursery.start_soon(_keep_flushing, files, sender)


async def _keep_flushing(files: SessionFiles, sender: Sender) -> None:
    try:
        while files.dirty:
            await files.fill()
            await flush(files, sender)
    finally:
        files.flushing = False


async def flush(files: SessionFiles, sender: Sender) -> None:
    """Make what the session's versions hold durable, then acknowledge it
    (after the group in progress: durable lengths are recorded in order)."""
    async with files.lock:
        await _flush(files, sender)


async def _flush(files: SessionFiles, sender: Sender) -> None:
    taken = files.take_dirty()
    if not taken:
        return
    files.pin(taken, 1)  # (a newer FILE_OPEN may abandon one meanwhile: its descriptor stays open for the sync)
    try:
        await _guarded(files.sync_and_record, taken)
    finally:
        files.pin(taken, -1)
    acks = files.made_durable(taken)
    files.trim()
    files.open_files.freed()  # (clean now: the shadow may close them when its budget is short)
    for ack in acks:
        await sender.send(lambda ack=ack: sender.conn.send(ack), check=True)  # type: ignore[misc]


async def _guarded(fn: Callable[..., None], *args: Any) -> None:
    """A blocking record of the session's versions, in a worker thread: the
    session stops if a newer one holds the job, or the state failed."""
    try:
        await trio.to_thread.run_sync(fn, *args)
    except Fencing as e:
        raise Fenced(str(e)) from None
    except StateUnavailable as e:
        raise Fenced(f"the state database failed while recording this job's files ({e}): nothing more is "
                     "acknowledged until it answers; come back shortly", Trouble.STATE) from None
