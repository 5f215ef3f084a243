"""What `gcwrap status` reports: every spool in a directory, read-only."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

from .spool import Spool, SpoolError, spool_files


def _in_use(path: Path) -> bool:
    """True while a gcwrap holds the spool's lock (running or resuming)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def read_spool(path: Path) -> dict[str, Any]:
    spool = Spool.open(path, readonly=True)
    try:
        job = spool.job()
        streams = spool.streams()
        size = spool.file_size()
    finally:
        spool.close()
    active = _in_use(path)
    state = job.state
    if not active and state in ("running", "paused", "starting"):
        state = "wrapper gone"
    return {
        "spool": str(path),
        "job_id": job.job_id,
        "instance": job.instance,
        "command": job.command,
        "host": job.host,
        "shadow": job.shadow,
        "state": state,
        "active": active,
        "wrapper_pid": job.wrapper_pid,
        "child_pid": job.child_pid,
        "started": job.started,
        "ended": job.ended,
        "exit_code": job.exit_code,
        "exit_signal": job.exit_signal,
        "connected": job.connected and active,
        "last_error": job.last_error,
        "retries": job.retries,
        "reason": job.reason,
        "spool_bytes": size,
        "streams": [
            {"id": s.id, "kind": s.kind, "name": s.name, "appended": s.appended, "acked": s.acked,
             "pending": s.pending, "eof": s.eof}
            for s in streams.values() if s.kind != "stdin"
        ],
    }


def read_spools(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in spool_files(directory):
        try:
            out.append(read_spool(path))
        except SpoolError as e:
            out.append({"spool": str(path), "job_id": "?", "state": "unreadable", "last_error": str(e),
                        "streams": [], "shadow": "", "connected": False})
    return out
