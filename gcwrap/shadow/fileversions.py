"""The versions of the files a job writes, as the shadow's state keeps them
(the same statements for SQLite and PostgreSQL).

A row per version of a file handle of one run (attempt) of a job:
`durable` (every byte below it is synced at home: what may be
acknowledged), `committed` (NAME holds exactly the version's first
`committed` bytes, whose SHA-256 is `sha256`; -1 until its commit) and its
`base` (the committed version it was built from, or NULL).

A record applies only while the session that makes it holds the job (the
fencing epoch, `jobs.session`), checked in the record's own transaction
under the job's row lock (PostgreSQL: `FOR NO KEY UPDATE`, in job order, as
the streams' durable lengths are recorded; SQLite's writers are serialised),
so a claim of the job never reads a version's length short of one
acknowledged by a session it fenced. Lengths only grow (max), and a commit
stands once recorded.

Versions no longer needed are forgotten in the same transaction: every
version older than a committed one (the newest committed is the base of
whatever comes next), an uncommitted one once a newer version of its file
is recorded (it was abandoned), and the versions of the job's earlier
attempts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..wire.events import FileHeld
from .timeline import POSTGRES, SQLITE, Dialect

__all__ = ["POSTGRES", "SQLITE", "VersionRecord", "VersionRow", "file_view", "has_table", "held", "holder",
           "listing", "migrate_postgres", "migrate_sqlite", "read", "record"]

_COLUMNS = """job_id TEXT NOT NULL, instance TEXT NOT NULL, file INTEGER NOT NULL, name TEXT NOT NULL,
    version INTEGER NOT NULL, base INTEGER, durable BIGINT NOT NULL DEFAULT 0,
    committed BIGINT NOT NULL DEFAULT -1, sha256 TEXT,
    PRIMARY KEY (job_id, instance, file, version)"""


def migrate_sqlite(db: Any) -> None:
    """The SQLite state's migration (`state.MIGRATIONS`)."""
    db.execute(f"CREATE TABLE file_versions ({_COLUMNS})")
    db.execute("CREATE INDEX file_versions_name ON file_versions (name)")


def migrate_postgres(conn: Any) -> None:
    """The PostgreSQL state's migration (`pgstate.MIGRATIONS`)."""
    conn.execute(f"CREATE TABLE gcshadow.file_versions ({_COLUMNS})")
    conn.execute("CREATE INDEX file_versions_name ON gcshadow.file_versions (name)")


def holder(conn: Any, d: Dialect, name: str, job_id: str) -> str | None:
    """The other job still active that writes `name` (an output stream, or a
    file of its current attempt), if any: a NAME is one job's at a time."""
    row = conn.execute(d.sql(
        "SELECT s.job_id FROM {s}streams s JOIN {s}jobs j ON j.job_id = s.job_id "
        "WHERE s.name = ? AND s.kind != 'stdin' AND s.job_id != ? AND j.state != 'finished' "
        "UNION ALL SELECT f.job_id FROM {s}file_versions f JOIN {s}jobs j "
        "ON j.job_id = f.job_id AND j.instance = f.instance "
        "WHERE f.name = ? AND f.job_id != ? AND j.state != 'finished' LIMIT 1"),
        [name, job_id, name, job_id]).fetchone()
    return None if row is None else str(row[0])


@dataclass(frozen=True)
class VersionRecord:
    """What one session records of one version: its durable length, and
    its commit once made (`committed` >= 0 with its `sha256`)."""

    job_id: str
    session: int
    instance: str
    file: int
    name: str
    version: int
    base: int | None
    durable: int
    committed: int = -1
    sha256: str | None = None


@dataclass(frozen=True)
class VersionRow:
    """One version home holds, as the state has it."""

    file: int
    name: str
    version: int
    base: int | None
    durable: int
    committed: int
    sha256: str | None


def record(conn: Any, d: Dialect, records: list[VersionRecord]) -> set[tuple[str, int, int]]:
    """Record the versions, inside the caller's transaction, each only while
    its session holds its job: the (job, file, version) of those refused."""
    if not records:
        return set()
    cur = conn.cursor()
    jobs = sorted({r.job_id for r in records})
    lock = " ORDER BY job_id FOR NO KEY UPDATE" if d is POSTGRES else ""
    marks = ", ".join([d.param] * len(jobs))
    current = dict(cur.execute(f"SELECT job_id, session FROM {d.schema}jobs WHERE job_id IN ({marks}){lock}",
                               jobs).fetchall())
    good = [r for r in records if current.get(r.job_id) == r.session]
    # (The row in place is named by its table's bare name in both dialects.)
    cur.executemany(d.sql(
        "INSERT INTO {s}file_versions (job_id, instance, file, name, version, base, durable, committed, sha256) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, instance, file, version) DO UPDATE SET "
        "durable = CASE WHEN excluded.durable > file_versions.durable THEN excluded.durable "
        "ELSE file_versions.durable END, "
        "sha256 = CASE WHEN excluded.committed > file_versions.committed THEN excluded.sha256 "
        "ELSE file_versions.sha256 END, "
        "committed = CASE WHEN excluded.committed > file_versions.committed THEN excluded.committed "
        "ELSE file_versions.committed END"),
        [(r.job_id, r.instance, r.file, r.name, r.version, r.base, r.durable, r.committed, r.sha256)
         for r in good])
    for job_id, instance, file in sorted({(r.job_id, r.instance, r.file) for r in good}):
        _forget(cur, d, job_id, instance, file)
    return {(r.job_id, r.file, r.version) for r in records if current.get(r.job_id) != r.session}


def _forget(cur: Any, d: Dialect, job_id: str, instance: str, file: int) -> None:
    """Forget the versions of a file no longer needed (see the module's
    docstring), and every version of the job's other attempts."""
    cur.execute(d.sql("DELETE FROM {s}file_versions WHERE job_id = ? AND instance != ?"), [job_id, instance])
    cur.execute(d.sql(
        "DELETE FROM {s}file_versions WHERE job_id = ? AND instance = ? AND file = ? AND ("
        "version < (SELECT coalesce(max(version), 0) FROM {s}file_versions "
        "WHERE job_id = ? AND instance = ? AND file = ? AND committed >= 0) "
        "OR (committed < 0 AND version < (SELECT max(version) FROM {s}file_versions "
        "WHERE job_id = ? AND instance = ? AND file = ?)))"),
        [job_id, instance, file] * 3)


def read(conn: Any, d: Dialect, job_id: str, instance: str) -> list[VersionRow]:
    """Every version home holds of a run of a job, by file and version."""
    rows = conn.execute(d.sql(
        "SELECT file, name, version, base, durable, committed, sha256 FROM {s}file_versions "
        "WHERE job_id = ? AND instance = ? ORDER BY file, version"), [job_id, instance]).fetchall()
    return [VersionRow(int(f), str(n), int(v), None if b is None else int(b), int(du), int(c), s)
            for f, n, v, b, du, c, s in rows]


def held(rows: list[VersionRow]) -> tuple[FileHeld, ...]:
    """What WELCOME tells the agent: for each file, the newest version home
    holds bytes of (or committed), its durable length and committed size."""
    newest: dict[int, VersionRow] = {}
    for row in rows:
        if row.file not in newest or row.version > newest[row.file].version:
            newest[row.file] = row
    return tuple(FileHeld(r.file, r.version, r.durable, r.committed) for _, r in sorted(newest.items()))


# -- what the listings show -------------------------------------------------------------


def listing(conn: Any, d: Dialect, job_id: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """The files of each job's current attempt (or of `job_id`'s), as
    `gcshadow jobs`, `tail` and the web view list them (see `file_view`)."""
    one, args = (" AND f.job_id = ?", [job_id]) if job_id is not None else ("", [])
    rows = conn.cursor().execute(d.sql(
        "SELECT f.job_id, f.file, f.name, f.version, f.base, f.durable, f.committed, f.sha256, j.state "
        "FROM {s}file_versions f JOIN {s}jobs j ON j.job_id = f.job_id AND j.instance = f.instance "
        f"WHERE true{one} ORDER BY f.job_id, f.file, f.version"), args).fetchall()
    grouped: dict[tuple[str, int], list[tuple[VersionRow, bool]]] = {}
    for job, file, name, version, base, durable, committed, sha, state in rows:
        row = VersionRow(int(file), str(name), int(version), None if base is None else int(base), int(durable),
                         int(committed), sha)
        grouped.setdefault((str(job), int(file)), []).append((row, state == "finished"))
    found: dict[str, list[dict[str, Any]]] = {}
    for (job, _), versions in grouped.items():
        found.setdefault(job, []).append(file_view([r for r, _ in versions], versions[0][1]))
    return found


def file_view(versions: list[VersionRow], finished: bool) -> dict[str, Any]:
    """One file as the listings show it, from the versions home holds of
    it (oldest first): its NAME; `bytes`, what NAME holds; `version`, the
    version NAME is (the committed one, or the first while it arrives in
    place); `committed`, NAME's committed size (-1: none yet) and its
    `sha256`; `next`, a newer version staged beside NAME and its bytes so
    far (None: none); `state`: "live" while bytes or a commit are to come,
    "committed" when NAME is exactly its committed version, "partial" when
    the job ended without a commit of what NAME holds."""
    newest = versions[-1]
    done = [v for v in versions if v.committed >= 0]
    committed = done[-1] if done else None
    staged = committed is not None and newest is not committed
    named = committed if staged and committed is not None else newest
    whole = named.committed >= 0 and named.durable == named.committed
    state = "committed" if whole and (finished or not staged) else "partial" if finished else "live"
    return {"file": newest.file, "name": newest.name, "version": named.version, "bytes": named.durable,
            "committed": named.committed, "sha256": named.sha256 if named.committed >= 0 else None,
            "next": {"version": newest.version, "bytes": newest.durable} if staged and not finished else None,
            "state": state}


def has_table(conn: Any, d: Dialect) -> bool:
    """Whether the state has the file versions' table (a shadow of an older version made it, and serves it still)."""
    sql = ("SELECT to_regclass('gcshadow.file_versions') IS NOT NULL" if d is POSTGRES
           else "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'file_versions'")
    row = conn.cursor().execute(sql).fetchone()
    return bool(row and row[0])
