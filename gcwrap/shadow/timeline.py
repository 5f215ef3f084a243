"""A job's timeline, the refused connections and the shadows' own state, as
the shadow's state keeps them (the same statements for SQLite and PostgreSQL).

- Events: each job's, in time order, from both ends: what the shadow saw
  itself (`session_opened`, `session_ended`, `refused`, `exit`; source
  "shadow") and the notes its agent sent (NOTES; source "agent"). A note
  sent twice (delivery is at least once) is kept once: an event is unique
  by its job and `digest` (time, kind, source and details). The newest
  EVENTS_KEPT of a job are kept. An event is kept only for a job the state
  knows: a flood of refused connections naming made-up jobs adds nothing.
- Refusals: the newest REFUSALS_KEPT refused connections (time, peer,
  identity, the job id its handshake announced, code and words).
- Shadows: a row per shadow serving the root, with the root's free space
  and its --min-free, refreshed every few seconds: readers tell a home
  short of disk (`why`).
- `heard`: when each streaming job's agent last sent anything (a heartbeat
  will do), stamped every few seconds: quiet and stalled look alike otherwise.

Synchronous: the stores write a `Batch` in one transaction of their own
(`write`), the readers attach `events`, `why` and `home` to each job (`attach`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from .why import why

EVENTS_KEPT = 1000  # the newest events of each job kept
REFUSALS_KEPT = 1000  # the newest refused connections kept
HOME_FRESH = 60.0  # seconds: a shadow's row not refreshed for this long is of a shadow gone
HOME_FORGET = 86400.0  # ...and one this old is deleted


@dataclass(frozen=True)
class JobEvent:
    """One event of a job's timeline (a connection, a disconnection, a fault...), by who saw it."""

    job_id: str
    time: float
    kind: str
    source: str  # "shadow" or "agent"
    details: dict[str, Any] = field(default_factory=dict)

    def row(self) -> tuple[Any, ...]:
        """Its columns; the digest is of its details in any order (the row keeps theirs)."""
        canonical = json.dumps(self.details, sort_keys=True, separators=(",", ":"))
        key = json.dumps([repr(self.time), self.kind, self.source, canonical])
        digest = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        details = json.dumps(self.details, separators=(",", ":"))
        return (self.job_id, self.time, self.kind, self.source, details, digest, self.job_id)


@dataclass(frozen=True)
class Refusal:
    """A connection the shadow refused: when, from whom, for which job, and why."""

    time: float
    peer: str
    identity: str
    job_id: str
    code: str
    message: str


@dataclass(frozen=True)
class Home:
    """One shadow's own state: its root's free space, and the --min-free below which it tells agents BUSY."""

    shadow: str
    root: str
    started: float
    checked: float
    free: int
    min_free: int


@dataclass
class Batch:
    """What one transaction records."""

    events: list[JobEvent] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    heard: list[tuple[float, str, int]] = field(default_factory=list)  # (time, job, session)
    home: Home | None = None

    def __bool__(self) -> bool:
        return bool(self.events or self.refusals or self.heard or self.home)


@dataclass(frozen=True)
class Dialect:
    """How one database spells the statements: its tables' schema and its placeholder."""

    schema: str
    param: str

    def sql(self, text: str) -> str:
        return text.replace("{s}", self.schema).replace("?", self.param)


SQLITE = Dialect("", "?")
POSTGRES = Dialect("gcshadow.", "%s")


def write(conn: Any, d: Dialect, batch: Batch) -> None:
    """Record a batch, inside the caller's transaction."""
    cur = conn.cursor()
    if batch.events:
        cur.executemany(d.sql(
            "INSERT INTO {s}events (job_id, time, kind, source, details, digest) SELECT ?, ?, ?, ?, ?, ? "
            "WHERE EXISTS (SELECT 1 FROM {s}jobs WHERE job_id = ?) ON CONFLICT DO NOTHING"),
            [e.row() for e in batch.events])
        for job_id in sorted({e.job_id for e in batch.events}):
            (n,) = cur.execute(d.sql("SELECT count(*) FROM {s}events WHERE job_id = ?"), [job_id]).fetchone()
            if n > EVENTS_KEPT:
                cur.execute(d.sql(
                    "DELETE FROM {s}events WHERE job_id = ? AND id NOT IN (SELECT id FROM {s}events "
                    "WHERE job_id = ? ORDER BY time DESC, id DESC LIMIT ?)"), [job_id, job_id, EVENTS_KEPT])
    if batch.refusals:
        cur.executemany(d.sql(
            "INSERT INTO {s}refusals (time, peer, identity, job_id, code, message) VALUES (?, ?, ?, ?, ?, ?)"),
            [(r.time, r.peer, r.identity, r.job_id, r.code, r.message) for r in batch.refusals])
        cur.execute(d.sql("DELETE FROM {s}refusals WHERE id <= (SELECT max(id) FROM {s}refusals) - ?"),
                    [REFUSALS_KEPT])
    if batch.heard:
        cur.executemany(d.sql("UPDATE {s}jobs SET heard = ? WHERE job_id = ? AND session = ?"), batch.heard)
    if batch.home is not None:
        h = batch.home
        cur.execute(d.sql(
            "INSERT INTO {s}shadows (shadow, root, started, checked, free, min_free) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (shadow) DO UPDATE SET checked = excluded.checked, free = excluded.free, "
            "min_free = excluded.min_free"), [h.shadow, h.root, h.started, h.checked, h.free, h.min_free])
        cur.execute(d.sql("DELETE FROM {s}shadows WHERE checked < ?"), [h.checked - HOME_FORGET])


# -- reading --------------------------------------------------------------------------


def read_events(conn: Any, d: Dialect, job_id: str | None = None,
                limit: int | None = None) -> dict[str, list[dict[str, Any]]]:
    """The events of every job (or of `job_id`), oldest first; with
    `limit`, the newest `limit` of each."""
    where = "WHERE job_id = ?" if job_id is not None else ""
    args: list[Any] = [job_id] if job_id is not None else []
    if limit is None:
        sql = f"SELECT job_id, time, kind, source, details FROM {{s}}events {where} ORDER BY job_id, time, id"
    else:
        sql = ("SELECT job_id, time, kind, source, details FROM (SELECT job_id, time, kind, source, details, id, "
               f"row_number() OVER (PARTITION BY job_id ORDER BY time DESC, id DESC) AS n FROM {{s}}events {where}) "
               "AS e WHERE n <= ? ORDER BY job_id, time, id")
        args.append(limit)
    found: dict[str, list[dict[str, Any]]] = {}
    for job, t, kind, source, details in conn.cursor().execute(d.sql(sql), args).fetchall():
        found.setdefault(job, []).append({"time": t, "kind": kind, "source": source, "details": json.loads(details)})
    return found


def read_refusals(conn: Any, d: Dialect, limit: int) -> list[dict[str, Any]]:
    """The newest refused connections first."""
    rows = conn.cursor().execute(d.sql(
        "SELECT time, peer, identity, job_id, code, message FROM {s}refusals ORDER BY id DESC LIMIT ?"),
        [limit]).fetchall()
    return [{"time": r[0], "peer": r[1], "identity": r[2], "job_id": r[3], "code": r[4], "message": r[5]}
            for r in rows]


def read_homes(conn: Any, d: Dialect, now: float) -> list[dict[str, Any]]:
    """The shadows that serve the root now (their row is fresh), each with its root's free space."""
    rows = conn.cursor().execute(d.sql(
        "SELECT shadow, root, started, checked, free, min_free FROM {s}shadows WHERE checked >= ? ORDER BY shadow"),
        [now - HOME_FRESH]).fetchall()
    return [dict(zip(("shadow", "root", "started", "checked", "free", "min_free"), r)) for r in rows]


def short_of_disk(homes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A shadow whose root has less room than its --min-free (its agents are told BUSY), if any."""
    return next((h for h in homes if h["min_free"] and h["free"] < h["min_free"]), None)


def attach(jobs: list[dict[str, Any]], events: dict[str, list[dict[str, Any]]], homes: list[dict[str, Any]],
           now: float) -> list[dict[str, Any]]:
    """Each job with its `events`, the shadow short of disk at home (`home`, or None) and `why`."""
    short = short_of_disk(homes)
    for job in jobs:
        job["events"] = events.get(job["job_id"], [])
        job["home"] = short
        job["why"] = why(job, now)
    return jobs
