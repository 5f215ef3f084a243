"""The shadow's state in PostgreSQL, shared by several shadows on one root.

`gcshadow serve --state postgresql://...` keeps jobs, fencing epochs
(`session`), durable lengths and exit statuses in the schema `gcshadow` of
that database (numbered migrations, applied under an advisory lock), while
the files are on the root, a directory on the site's shared file system.

Who may act for a job, across processes:

- The claim is one transaction: the job's row is locked (`FOR UPDATE`), its
  epoch bumped, its streams' durable lengths read. A durable-length record
  locks the rows of its jobs too (`FOR NO KEY UPDATE`, in job order) and
  records only the lengths of sessions that still hold their job: a claim
  and a record of one job never interleave, so a length recorded (and then
  acknowledged) by a session that just lost the job is one the new session
  reads, and no file is cut back below it.
- The epoch fences the record and so the ACKs; a lock fences the bytes. A
  session that writes a job's files holds an exclusive OFD lock on each
  (`files.lock_file`) from open to close; a new owner takes them before it
  cuts a file back or writes to it. A session of another shadow that still
  holds them (frozen, partitioned, or not yet told) makes the claim fail
  with HELD (the agent is told BUSY and comes back) after bumping the epoch
  in the state: the holder records and acknowledges nothing more, and lets
  go of the files when it learns (`Shadow` asks the state about its jobs
  every WATCH_EVERY seconds) or dies (the kernel drops the locks; a file
  server drops a dead client's once its lease expires).

A lost database (refused, reset, or a failing query) makes every call raise
`StateUnavailable` (a StoreError, told to agents as BUSY): nothing is
acknowledged; it says so once in the log. While it is lost no call waits
for it: a prober thread tries to connect every PROBE_EVERY seconds, and the
first that succeeds lets every call through again at once.

A record whose connection was lost during its COMMIT may have applied:
its bytes stay as they are (`durability`), and the next claim of the job
reads the truth under the job's row lock, which waits for a transaction in
doubt to end (committed or rolled back: the server ends it when it sees its
client gone, or, unheard from, after IDLE_IN_TRANSACTION). A claim waits at
most LOCK_TIMEOUT for that lock, then is told to come back.

One state serves one root: the root's identity (`files.root_identity`) is
recorded in the database by the first shadow, and a shadow of another root
is refused (two roots would share job names, and a durable length is only
true of the files it was recorded for).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..wire.events import StreamSpec
from . import fileversions, timeline
from .files import (
    JobFiles,
    Problem,
    StateUnavailable,
    StoreError,
    StreamFile,
    claim_root,
    entry_dirs,
    lock_file,
    lock_root,
    root_identity,
)
from .pgconn import Health, PgConnection, Prober
from .state import LAST_SEEN_EVERY, LAST_SEEN_JOBS, Attempt, Store, _attempt
from .stateurl import shown
from .syncer import Syncer

log = logging.getLogger("gcshadow")

MIGRATION_LOCK = 0x6763736864  # the advisory lock two shadows starting at once migrate under

# -- the schema ---------------------------------------------------------------------


def _m001_initial(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE SCHEMA IF NOT EXISTS gcshadow")
    conn.execute(
        """CREATE TABLE gcshadow.jobs (
            job_id TEXT PRIMARY KEY, instance TEXT NOT NULL, host TEXT, "user" TEXT,
            command TEXT, peer TEXT, state TEXT NOT NULL, session BIGINT NOT NULL DEFAULT 0,
            first_seen DOUBLE PRECISION, last_seen DOUBLE PRECISION, ended DOUBLE PRECISION,
            exit_code INTEGER, exit_signal INTEGER, reason TEXT, summary TEXT,
            owner TEXT NOT NULL DEFAULT '', shadow TEXT)"""
    )
    conn.execute(
        """CREATE TABLE gcshadow.streams (
            job_id TEXT NOT NULL, stream INTEGER NOT NULL, kind TEXT NOT NULL,
            name TEXT NOT NULL, durable BIGINT NOT NULL DEFAULT 0, wire BIGINT,
            PRIMARY KEY (job_id, stream))"""
    )
    conn.execute("CREATE INDEX streams_name ON gcshadow.streams (name)")
    conn.execute(
        """CREATE TABLE gcshadow.instances (
            job_id TEXT NOT NULL, instance TEXT NOT NULL, seen DOUBLE PRECISION,
            PRIMARY KEY (job_id, instance))"""
    )
    # What the roots served with this state record (files.claim_root): a root is this database's alone.
    conn.execute("CREATE TABLE gcshadow.meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO gcshadow.meta VALUES ('state_id', md5(random()::text || clock_timestamp()::text))")


def _m002_timeline(conn: psycopg.Connection[Any]) -> None:
    # Each job's events, the refused connections, each shadow's own state (`timeline`).
    conn.execute(
        """CREATE TABLE gcshadow.events (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, job_id TEXT NOT NULL,
            time DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL, source TEXT NOT NULL, details TEXT NOT NULL,
            digest TEXT NOT NULL)"""
    )
    conn.execute("CREATE UNIQUE INDEX events_digest ON gcshadow.events (job_id, digest)")
    conn.execute("CREATE INDEX events_time ON gcshadow.events (job_id, time)")
    conn.execute(
        """CREATE TABLE gcshadow.refusals (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, time DOUBLE PRECISION NOT NULL,
            peer TEXT NOT NULL, identity TEXT NOT NULL, job_id TEXT NOT NULL, code TEXT NOT NULL,
            message TEXT NOT NULL)"""
    )
    conn.execute(
        """CREATE TABLE gcshadow.shadows (
            shadow TEXT PRIMARY KEY, root TEXT NOT NULL, started DOUBLE PRECISION,
            checked DOUBLE PRECISION NOT NULL, free BIGINT NOT NULL, min_free BIGINT NOT NULL)"""
    )
    conn.execute("ALTER TABLE gcshadow.jobs ADD COLUMN heard DOUBLE PRECISION")


MIGRATIONS: list[tuple[int, str, Callable[[psycopg.Connection[Any]], None]]] = [
    (1, "initial", _m001_initial),
    (2, "timeline", _m002_timeline),
    (3, "file_versions", fileversions.migrate_postgres),
]


def migrate(conn: psycopg.Connection[Any]) -> None:
    """Apply the migrations not yet recorded, in one transaction under an
    advisory lock (shadows starting together migrate one after the other)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [MIGRATION_LOCK])
        conn.execute("CREATE SCHEMA IF NOT EXISTS gcshadow")
        conn.execute("CREATE TABLE IF NOT EXISTS gcshadow.migrations "
                     "(id INTEGER PRIMARY KEY, name TEXT NOT NULL, applied DOUBLE PRECISION)")
        done = {row[0] for row in conn.execute("SELECT id FROM gcshadow.migrations").fetchall()}
        for number, name, fn in MIGRATIONS:
            if number not in done:
                fn(conn)
                conn.execute("INSERT INTO gcshadow.migrations VALUES (%s, %s, %s)", [number, name, time.time()])


# -- the store ----------------------------------------------------------------------------


class PgStore(Store):
    """The state of a root shared by several shadows, in PostgreSQL; the
    files as `Store` keeps them, each output also locked by its session.

    Two connections: one for claims and records (the shadow's worker
    thread), one for the durability thread, each used by one at a time."""

    shared = True

    def __init__(self, root: Path, url: str, *, use_syncfs: bool = True) -> None:
        self.root = root
        self.url = url
        self.health = Health(shown(url))
        self.pg = PgConnection(url, self.health)
        self.pg_durable = PgConnection(url, self.health)
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self.last_seen: dict[str, float] = {}
        self.unsettled = ""
        self._grouped = False  # (claims commit one by one here: `grouped`)
        root.mkdir(parents=True, exist_ok=True)
        try:
            with self.pg.lock:
                migrate(self.pg._connected())
            with self.pg.transaction() as conn:
                row = conn.execute("SELECT value FROM gcshadow.meta WHERE key = 'state_id'").fetchone()
        except psycopg.Error as e:
            self.close_connections()
            raise StateUnavailable(f"cannot set up the state database {self.health.name}: {self.pg._say(e)}") \
                from None
        except BaseException:
            self.close_connections()
            raise
        try:
            self.lock_fd = lock_root(root, shared=True)
        except BaseException:
            self.close_connections()
            raise
        assert row is not None
        try:
            claim_root(root, f"postgresql {row[0]}", self.health.name)
            self._bind_root(root)
            self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except BaseException:
            os.close(self.lock_fd)
            self.close_connections()
            raise
        self.db_lock = threading.RLock()
        self.syncer = Syncer(self.root_fd, use_syncfs)
        self._conn: psycopg.Connection[Any] | None = None  # the claim's, while `_names` asks it
        self.prober = Prober(url, self.health)

    def _bind_root(self, root: Path) -> None:
        """Record this root as the state's (the first shadow does), or refuse
        a root that is not the one the state serves."""
        mine = root_identity(root)
        where = f"{root} on {socket.gethostname()}"
        with self.pg.transaction() as conn:
            conn.execute("INSERT INTO gcshadow.meta VALUES ('root_id', %s), ('root', %s) ON CONFLICT DO NOTHING",
                         [mine, where])
            meta = dict(conn.execute("SELECT key, value FROM gcshadow.meta").fetchall())
        if meta["root_id"] != mine:
            raise StoreError(Problem.ROOT, f"the state database {self.health.name} serves another root "
                                           f"({meta.get('root', '?')}), not {root}: a shared state serves one root "
                                           "(job names would collide); give this root a database of its own")

    def close_connections(self) -> None:
        self.pg.close()
        self.pg_durable.close()

    def close(self) -> None:
        self.prober.stop()
        self.syncer.close()
        self.close_connections()
        os.close(self.root_fd)
        os.close(self.lock_fd)

    def _settle(self) -> None:
        """Nothing to do here: a claim reads a job's lengths under its row
        lock, which a transaction in doubt holds until the server has ended
        it (committed or rolled back), so what it reads is settled."""

    def attempt(self, job_id: str, instance: str) -> Attempt:
        with self.pg.transaction() as conn:
            row = conn.execute(
                "SELECT (SELECT instance FROM gcshadow.jobs WHERE job_id = %s AND state != 'new'), "
                "EXISTS (SELECT 1 FROM gcshadow.instances WHERE job_id = %s AND instance = %s)",
                [job_id, job_id, instance]).fetchone()
        assert row is not None
        return _attempt(row[0], bool(row[1]), instance)

    def grouped(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Each call in a transaction of its own (the embedded state commits
        a group as one): a claim here commits before its files are cut back,
        and a claim that meets a holder commits its epoch bump and still
        refuses, which one shared transaction would not allow."""
        results: list[Any] = []
        for call in calls:
            try:
                results.append(call())
            except Exception as e:  # noqa: BLE001 - this one's refusal: the others go on
                results.append(e)
        return results

    # -- claims -----------------------------------------------------------------

    def owner(self, job_id: str) -> str | None:
        with self.pg.transaction() as conn:
            row = conn.execute("SELECT owner FROM gcshadow.jobs WHERE job_id = %s", [job_id]).fetchone()
        return None if row is None else str(row[0])

    def _name_holder(self, name: str, job_id: str) -> str | None:
        assert self._conn is not None
        return fileversions.holder(self._conn, fileversions.POSTGRES, name, job_id)

    def name_holder(self, name: str, job_id: str) -> str | None:
        with self.pg.transaction() as conn:
            return fileversions.holder(conn, fileversions.POSTGRES, name, job_id)

    def _open_job(
        self, job_id: str, instance: str, streams: list[StreamSpec], host: str, user: str, command: list[str],
        peer: str, tenant: str = "",
    ) -> JobFiles:
        """The claim, in one transaction: lock the job's row, check who may
        have it, open and lock its files, bump the epoch, read the durable
        lengths. Files are cut back only after the commit (still locked:
        nobody else writes them meanwhile)."""
        made: list[str] = []
        fds: list[int] = []
        held = ""
        try:
            with self.pg.transaction() as conn:
                self._conn = conn
                try:
                    session, fresh, created = self._claim_row(conn, job_id, instance, tenant)
                    named = self._names(job_id, streams, tenant)
                    for spec, norm in named:
                        fds.append(self._open_fd(spec, norm, made))
                        if spec.kind != "stdin" and not lock_file(fds[-1]):
                            held = norm
                            break
                    if held and created:
                        raise StoreError(Problem.HELD, f"{held!r} is locked by another shadow's session")
                    if held:
                        # Take the job from the session that holds the files: it
                        # records and acknowledges nothing more, and lets go of them.
                        conn.execute("UPDATE gcshadow.jobs SET session = session + 1 WHERE job_id = %s", [job_id])
                    else:
                        lengths = self._record_claim(conn, job_id, instance, fresh, session, named, fds,
                                                     (host, user, command, peer, tenant))
                finally:
                    self._conn = None
        except BaseException:
            for fd in fds:
                os.close(fd)
            self._unmake(made)
            raise
        if held:
            for fd in fds:
                os.close(fd)
            raise StoreError(Problem.HELD, f"job {job_id}: another shadow's session still has {held!r} open; "
                                           "it was told to let go of it: come back shortly")
        files = self._cut_back(JobFiles(job_id, instance, session), named, fds, lengths, fresh)
        if made:
            for sf in files.outputs.values():
                sf.new_entries = entry_dirs(sf.name, made)
        return files

    def _claim_row(self, conn: psycopg.Connection[Any], job_id: str, instance: str,
                   tenant: str) -> tuple[int, bool, bool]:
        """Lock the job's row (made if new): the new session's number,
        whether the attempt is new, whether the job is."""
        now = time.time()
        created = conn.execute(
            """INSERT INTO gcshadow.jobs (job_id, instance, state, session, owner, first_seen, last_seen)
               VALUES (%s, %s, 'new', 0, %s, %s, %s) ON CONFLICT (job_id) DO NOTHING RETURNING job_id""",
            [job_id, instance, tenant, now, now],
        ).fetchone() is not None
        row = conn.execute("SELECT instance, session, owner FROM gcshadow.jobs WHERE job_id = %s FOR UPDATE",
                           [job_id]).fetchone()
        assert row is not None
        if row[2] != tenant:
            if not row[2]:
                raise StoreError(Problem.NOT_OWNER, f"job {job_id} was streamed here before this shadow had "
                                                    "identities: give the job another id")
            raise StoreError(Problem.NOT_OWNER, f"job {job_id} belongs to another identity")
        fresh = created or row[0] != instance
        if fresh and conn.execute("SELECT 1 FROM gcshadow.instances WHERE job_id = %s AND instance = %s",
                                  [job_id, instance]).fetchone():
            raise StoreError(Problem.STALE_ATTEMPT, f"job {job_id}: a newer attempt has replaced attempt {instance}")
        return int(row[1]) + 1, fresh, created

    def _record_claim(self, conn: psycopg.Connection[Any], job_id: str, instance: str, fresh: bool, session: int,
                      named: list[tuple[StreamSpec, str]], fds: list[int],
                      about: tuple[str, str, list[str], str, str]) -> list[tuple[int, int]]:
        """The new session in the job's row and its streams' rows: each
        stream's (durable, wire) lengths."""
        host, user, command, peer, tenant = about
        now = time.time()
        if fresh:
            conn.execute("DELETE FROM gcshadow.streams WHERE job_id = %s", [job_id])
            conn.execute(
                """UPDATE gcshadow.jobs SET instance = %s, host = %s, "user" = %s, command = %s, peer = %s,
                   state = 'streaming', session = %s, first_seen = %s, last_seen = %s, owner = %s, shadow = %s,
                   ended = NULL, exit_code = NULL, exit_signal = NULL, reason = NULL, summary = NULL
                   WHERE job_id = %s""",
                [instance, host, user, json.dumps(command), peer, session, now, now, tenant, self.holder, job_id],
            )
            conn.execute("INSERT INTO gcshadow.instances VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                         [job_id, instance, now])
        else:
            conn.execute(
                """UPDATE gcshadow.jobs SET session = %s, peer = %s, last_seen = %s, shadow = %s,
                   state = CASE state WHEN 'finished' THEN 'finished' ELSE 'streaming' END WHERE job_id = %s""",
                [session, peer, now, self.holder, job_id],
            )
        lengths: list[tuple[int, int]] = []
        for (spec, norm), fd in zip(named, fds):
            if spec.kind == "stdin" or fresh:
                conn.execute(
                    """INSERT INTO gcshadow.streams (job_id, stream, kind, name, durable, wire)
                       VALUES (%s, %s, %s, %s, 0, 0) ON CONFLICT (job_id, stream)
                       DO UPDATE SET kind = excluded.kind, name = excluded.name, durable = 0""",
                    [job_id, spec.id, spec.kind, norm],
                )
                lengths.append((0, 0))
                continue
            row = conn.execute("SELECT durable, name, wire FROM gcshadow.streams WHERE job_id = %s AND stream = %s",
                               [job_id, spec.id]).fetchone()
            if row is None or row[1] != norm:
                raise StoreError(Problem.OTHER_STREAMS, f"job {job_id} resumed with different streams")
            durable = int(row[0])
            size = os.fstat(fd).st_size
            if size < durable:
                raise StoreError(Problem.CHANGED_AT_HOME, f"{norm!r} holds {size} bytes but {durable} were "
                                                          "acknowledged: it was truncated or replaced at home")
            lengths.append((durable, int(row[2] or 0)))
        return lengths

    def _cut_back(self, files: JobFiles, named: list[tuple[StreamSpec, str]], fds: list[int],
                  lengths: list[tuple[int, int]], fresh: bool) -> JobFiles:
        """The claimed job's files, each cut back to its durable length (a
        new attempt's to nothing): what lies beyond was never acknowledged."""
        try:
            while fds:
                (spec, norm), fd, (durable, wire) = named.pop(0), fds.pop(0), lengths.pop(0)
                if spec.kind == "stdin":
                    files.stdin = StreamFile(files.job_id, spec.id, norm, fd, 0, 0, write=False,
                                             session=files.session)
                    files.stdin.identify()
                    files.stdin_stream = spec.id
                    continue
                sf = StreamFile(files.job_id, spec.id, norm, fd, durable, durable, session=files.session,
                                wire=wire, locked=True)
                files.outputs[spec.id] = sf
                sf.identify()
                if fresh:
                    os.ftruncate(fd, 0)
                    os.fsync(fd)
                elif os.fstat(fd).st_size > durable:
                    os.ftruncate(fd, durable)  # a torn or unacknowledged tail: it will be resent
        except BaseException:
            for fd in fds:
                os.close(fd)
            files.close()
            raise
        return files

    # -- records ------------------------------------------------------------------

    def record_durable(self, lengths: Iterable[tuple[str, int, int, int, int]]) -> set[tuple[str, int]]:
        """Record (job, stream, length, session, wire bytes) tuples, each only
        while that session holds the job, in one transaction that locks the
        jobs' rows (a claim of one of them waits for it, or it for the
        claim). Returns the (job, stream) pairs not recorded."""
        rows = list(lengths)
        now = time.time()
        stamped = self.last_seen
        with self.pg_durable.transaction() as conn:
            current = dict(conn.execute(
                "SELECT job_id, session FROM gcshadow.jobs WHERE job_id = ANY(%s) ORDER BY job_id FOR NO KEY UPDATE",
                [sorted({j for j, *_ in rows})],
            ).fetchall())
            good = [r for r in rows if current.get(r[0]) == r[3]]
            refused = {(j, s) for j, s, _, session, _ in rows if current.get(j) != session}
            if good:
                conn.execute(
                    """UPDATE gcshadow.streams s SET durable = GREATEST(s.durable, v.n),
                       wire = GREATEST(COALESCE(s.wire, 0), v.w)
                       FROM unnest(%s::text[], %s::int[], %s::bigint[], %s::bigint[]) AS v(job_id, stream, n, w)
                       WHERE s.job_id = v.job_id AND s.stream = v.stream""",
                    [[r[0] for r in good], [r[1] for r in good], [r[2] for r in good], [r[4] for r in good]],
                )
            stale = sorted({j for j, *_ in good if now - stamped.get(j, 0.0) >= LAST_SEEN_EVERY})
            if stale:
                conn.execute("UPDATE gcshadow.jobs SET last_seen = %s WHERE job_id = ANY(%s)", [now, stale])
        if len(stamped) > 4 * LAST_SEEN_JOBS:
            for j in [j for j, t in stamped.items() if now - t >= LAST_SEEN_EVERY]:
                del stamped[j]
        stamped.update(dict.fromkeys(stale, now))
        return refused

    def record_files(self, records: list[fileversions.VersionRecord]) -> set[tuple[str, int, int]]:
        """As `Store.record_files`; the jobs' rows locked as `record_durable` locks them."""
        with self.pg_durable.transaction() as conn:
            return fileversions.record(conn, fileversions.POSTGRES, records)

    def read_files(self, job_id: str, instance: str) -> list[fileversions.VersionRow]:
        with self.pg.transaction() as conn:
            return fileversions.read(conn, fileversions.POSTGRES, job_id, instance)

    def record_disconnected(self, job_id: str, session: int) -> bool:
        with self.pg.transaction() as conn:
            cur = conn.execute("UPDATE gcshadow.jobs SET state = 'disconnected', last_seen = %s "
                               "WHERE job_id = %s AND session = %s", [time.time(), job_id, session])
            return cur.rowcount > 0

    def record_finished(
        self, job_id: str, session: int, *, code: int | None, signal: int | None, reason: str,
        summary: dict[str, Any],
    ) -> bool:
        now = time.time()
        with self.pg.transaction() as conn:
            cur = conn.execute(
                "UPDATE gcshadow.jobs SET state = 'finished', ended = %s, last_seen = %s, exit_code = %s, "
                "exit_signal = %s, reason = %s, summary = %s WHERE job_id = %s AND session = %s",
                [now, now, code, signal, reason, json.dumps(summary), job_id, session],
            )
            return cur.rowcount > 0

    def superseded(self, held: dict[str, int]) -> set[str]:
        """Which of the jobs held here (job -> session) another shadow has
        claimed since (StateUnavailable if the state cannot say)."""
        if not held:
            with self.pg.transaction() as conn:
                conn.execute("SELECT 1")
            return set()
        with self.pg.transaction() as conn:
            current = dict(conn.execute("SELECT job_id, session FROM gcshadow.jobs WHERE job_id = ANY(%s)",
                                        [list(held)]).fetchall())
        return {j for j, s in held.items() if current.get(j) != s}

    def mark_disconnected(self) -> None:
        """At start-up: the jobs that shadows of this machine held when they
        died (their process is gone) are no longer connected. Other shadows'
        jobs are theirs to record (a job a shadow elsewhere held when it died
        is 'streaming' until its agent reconnects somewhere)."""
        host = self.holder.rsplit(":", 1)[0]
        with self.pg.transaction() as conn:
            rows = conn.execute("SELECT job_id, shadow FROM gcshadow.jobs WHERE state = 'streaming' AND shadow LIKE %s",
                                [host.replace("%", r"\%").replace("_", r"\_") + ":%"]).fetchall()
            dead = [(job_id, shadow) for job_id, shadow in rows if not _alive(int(shadow.rsplit(":", 1)[1]))]
            for job_id, shadow in dead:
                conn.execute("UPDATE gcshadow.jobs SET state = 'disconnected' "
                             "WHERE job_id = %s AND shadow = %s AND state = 'streaming'", [job_id, shadow])
            rows = conn.execute("SELECT shadow FROM gcshadow.shadows WHERE shadow LIKE %s",
                                [host.replace("%", r"\%").replace("_", r"\_") + ":%"]).fetchall()
            gone = [shadow for (shadow,) in rows if not _alive(int(shadow.rsplit(":", 1)[1]))]
            conn.execute("DELETE FROM gcshadow.shadows WHERE shadow = ANY(%s)", [gone])

    def record_timeline(self, batch: timeline.Batch) -> None:
        """Jobs' events, refused connections, when agents were last heard
        from, the root's free space (`timeline`), in a transaction of their own."""
        with self.pg.transaction() as conn:
            timeline.write(conn, timeline.POSTGRES, batch)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's: alive
    return pid != os.getpid()


def _jobs(conn: psycopg.Connection[Any], job: str | None = None, events: int | None = None) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=dict_row)
    one, args = (" AND job_id = %s", [job]) if job is not None else ("", [])
    jobs = cur.execute(f"SELECT * FROM gcshadow.jobs WHERE state != 'new'{one} ORDER BY first_seen", args).fetchall()
    streams = cur.execute(f"SELECT job_id, stream, kind, name, durable, wire FROM gcshadow.streams "
                          f"WHERE true{one} ORDER BY job_id, stream", args).fetchall()
    by_job: dict[str, list[dict[str, Any]]] = {}
    for s in streams:
        by_job.setdefault(s.pop("job_id"), []).append(s)
    for j in jobs:
        j.pop("shadow", None)
        j["streams"] = by_job.get(j["job_id"], [])
        j["command"] = json.loads(j["command"] or "[]")
        j["summary"] = json.loads(j["summary"] or "{}")
    files = fileversions.listing(conn, fileversions.POSTGRES, job) if fileversions.has_table(
        conn, fileversions.POSTGRES) else {}
    for j in jobs:
        j["files"] = files.get(j["job_id"], [])
    now = time.time()
    if not _has_timeline(conn):
        return timeline.attach(jobs, {}, [], now)
    found = timeline.read_events(conn, timeline.POSTGRES, job, events) if events != 0 else {}
    return timeline.attach(jobs, found, timeline.read_homes(conn, timeline.POSTGRES, now), now)


def _has_timeline(conn: psycopg.Connection[Any]) -> bool:
    """Whether the state has the timeline's tables (its shadows may all be of an older version)."""
    row = conn.execute("SELECT to_regclass('gcshadow.events') IS NOT NULL").fetchone()
    return bool(row and row[0])


def list_jobs(url: str, job: str | None = None, events: int | None = None) -> list[dict[str, Any]]:
    """Every job the state at `url` knows (or `job` alone), with its streams
    and timeline (the newest `events` of each), for `gcshadow jobs`."""
    return JobsReader(url).read(close=True, job=job, events=events)


def list_refusals(url: str, limit: int) -> list[dict[str, Any]]:
    """The newest refused connections first, of every shadow of the state at `url`."""
    reader = JobsReader(url)
    try:
        with reader.pg.transaction() as conn:
            return timeline.read_refusals(conn, timeline.POSTGRES, limit) if _has_timeline(conn) else []
    finally:
        reader.close()


def list_homes(url: str) -> list[dict[str, Any]]:
    """The shadows serving with the state at `url`, each with its root's free space."""
    reader = JobsReader(url)
    try:
        with reader.pg.transaction() as conn:
            return timeline.read_homes(conn, timeline.POSTGRES, time.time()) if _has_timeline(conn) else []
    finally:
        reader.close()


class JobsReader:
    """Reads every job of a shared state again and again (the web view), on one connection."""

    def __init__(self, url: str) -> None:
        self.pg = PgConnection(url, Health(shown(url)))
        self.pg.health.failed = lambda why: None  # type: ignore[method-assign]  # a reader logs nothing

    def read(self, *, close: bool = False, job: str | None = None, events: int | None = None) -> list[dict[str, Any]]:
        """The jobs (or `job` alone), with their streams and timelines (the
        newest `events` of each; None: all kept); StateUnavailable if the state cannot be read."""
        try:
            with self.pg.transaction() as conn:
                return _jobs(conn, job, events)
        finally:
            if close:
                self.pg.close()

    def close(self) -> None:
        self.pg.close()
