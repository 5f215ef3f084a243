"""What the commands read of the root's own state (SQLite), read-only,
also while a shadow serves it: the jobs with their streams, files and
timelines (`gcshadow jobs`, `tail`), the refused connections, the shadow's own row."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from . import fileversions, timeline
from .state import open_state


def list_jobs(root: Path, job: str | None = None, events: int | None = None) -> list[dict[str, Any]]:
    """Every job the shadow at `root` knows (or `job` alone), with its
    streams, the files it writes (`fileversions.listing`) and timeline (the
    newest `events` of each; None: all kept), for `gcshadow jobs`."""
    db = open_state(root, readonly=True)
    try:
        where: tuple[str | None, list[str] | None] = ("job_id = ?", [job]) if job is not None else (None, None)
        jobs = list(db["jobs"].rows_where(*where, order_by="first_seen"))
        for j in jobs:
            j["streams"] = list(db["streams"].rows_where(
                "job_id = ?", [j["job_id"]], select="stream, kind, name, durable, wire", order_by="stream"))
            j["command"] = json.loads(j["command"] or "[]")
            j["summary"] = json.loads(j["summary"] or "{}")
        files = fileversions.listing(db.conn, fileversions.SQLITE, job) if fileversions.has_table(
            db.conn, fileversions.SQLITE) else {}
        for j in jobs:
            j["files"] = files.get(j["job_id"], [])
        now = time.time()
        if not _has_timeline(db.conn):
            return timeline.attach(jobs, {}, [], now)
        found = timeline.read_events(db.conn, timeline.SQLITE, job, events) if events != 0 else {}
        return timeline.attach(jobs, found, timeline.read_homes(db.conn, timeline.SQLITE, now), now)
    finally:
        db.conn.close()


def list_refusals(root: Path, limit: int) -> list[dict[str, Any]]:
    """The newest refused connections first (`gcshadow jobs --refused`)."""
    db = open_state(root, readonly=True)
    try:
        return timeline.read_refusals(db.conn, timeline.SQLITE, limit) if _has_timeline(db.conn) else []
    finally:
        db.conn.close()


def list_homes(root: Path) -> list[dict[str, Any]]:
    """The shadow serving `root`, with its root's free space (none if it is not serving)."""
    db = open_state(root, readonly=True)
    try:
        return timeline.read_homes(db.conn, timeline.SQLITE, time.time()) if _has_timeline(db.conn) else []
    finally:
        db.conn.close()


def _has_timeline(conn: sqlite3.Connection) -> bool:
    """Whether the state has the timeline's tables (a shadow of an older version made it, and serves it still)."""
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'events'").fetchone() is not None
