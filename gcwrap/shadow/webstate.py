"""What `gcshadow web` shows: the shadow's state read from outside, and its files.

A reader, never a participant: the state database is opened read-only (the
shadow owns it), and output files are opened read-only, confined to the root
as the shadow confines them. Synchronous code, run in the web server's one
worker thread (the state) or inline (small preads).

The state is read again only when the shadow has committed something since
the last look (`PRAGMA data_version`), so a quiet shadow costs one tiny query
per poll. Rates and the age of each stream's last byte are derived here from
the durable lengths seen over time: the shadow does not record them, and
shows only durable bytes (what it acknowledged): bytes past that may still be
cut back and sent again after a crash of the shadow, and a viewer must never
see a byte twice.

Beyond jobs and streams, the shadow records each job's timeline and a
one-line "why", and the connections it refused; those are read through
`backends` (as `gcshadow jobs` reads them), only while a client looks, at
most once a second while the state changes and every few seconds while it
does not (a "why" says how long something has lasted). A shadow that
records none of them shows none.

Line numbers: the count of newlines before a byte, from checkpoints kept
per file as pages ask (`Lines`), so a page that opens at a file's tail or
at one of its lines numbers its lines as the file does, without reading
the whole file again for every page.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import sqlite3
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlite_utils

from ..wire.names import STATE_DIR, NameError_
from . import backends, fileversions
from .files import StoreError, open_confined

log = logging.getLogger("gcshadow")

RATE_WINDOW = 5.0  # seconds over which a live rate is measured
EXTRAS_EVERY = 1.0  # seconds between reads of the timelines and refusals while the state changes
WHY_EVERY = 3.0  # ... and while it does not
LOOKED = 10.0  # seconds since a client last looked during which they are read
REFUSALS = 200  # refused connections shown, the newest
TIMELINE = 200  # events of a job's timeline shown, the newest


@dataclass(frozen=True)
class LineOptions:
    """How line numbers are counted (`Lines`)."""

    mark: int = 4 << 20  # bytes between two checkpoints of a file's line count
    most: int = 256 << 20  # bytes read at most to number one place in a file; further, lines are not numbered


class Refused(Exception):
    """A file the web view will not serve, with the reason in plain words."""


class Unservable(Exception):
    """A job's file the web view cannot serve: an HTTP status and the words a page shows."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class StreamSeen:
    """A stream's durable lengths over the last RATE_WINDOW seconds, and when it last grew."""

    instance: str
    samples: deque[tuple[float, int]] = field(default_factory=deque)  # (monotonic time, durable)
    last_byte_at: float | None = None  # wall-clock time the durable length last grew

    def add(self, now: float, durable: int, wall: float) -> None:
        if self.samples and durable > self.samples[-1][1]:
            self.last_byte_at = wall
        self.samples.append((now, durable))
        # Keep one sample at or before the window's start: the length then.
        while len(self.samples) > 2 and self.samples[1][0] <= now - RATE_WINDOW:
            self.samples.popleft()

    def rate(self, now: float) -> float | None:
        """Bytes per second over the window ending now; None until there is a window."""
        if not self.samples:
            return None
        first_t, first_n = self.samples[0]
        span = min(now - first_t, RATE_WINDOW)
        if span < 0.5:
            return None
        start = now - span
        before = first_n
        for t, n in self.samples:  # the length at the window's start (a step function)
            if t > start:
                break
            before = n
        return max(0.0, (self.samples[-1][1] - before) / span)


def job_url(job_id: str) -> str:
    return "/jobs/" + quote(job_id, safe="")


def api_url(job_id: str) -> str:
    return "/api/jobs/" + quote(job_id, safe="")


class Unreadable(Exception):
    """The state cannot be read now (why, for the page's banner)."""


class JobRows:
    """Where the web view reads the jobs' rows: the root's own state
    database (read-only, again only when the shadow committed since the
    last read: `PRAGMA data_version`), or a shared state (--state: a full
    query, at most every SHARED_EVERY seconds)."""

    SHARED_EVERY = 1.0  # seconds between reads of a shared state

    def __init__(self, root: Path, state_url: str = "") -> None:
        self.state_url = state_url  # a shared state (--state), read instead of the root's own
        self.shared: Any = None  # its reader (pgstate.JobsReader), once opened
        self.shared_at = 0.0
        self.path = root / STATE_DIR / "state.db"
        self.conn: sqlite3.Connection | None = None
        self.data_version: int | None = None

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def read(self, known: dict[str, dict[str, Any]], failing: bool) -> dict[str, dict[str, Any]] | None:
        """The rows by job id (each with its "streams" and "files"), or None
        while they are as `known` (and the last read did not fail); Unreadable."""
        return self._read_shared(known, failing) if self.state_url else self._read_own(failing)

    def _connect(self) -> sqlite3.Connection:
        if self.conn is None:
            if not self.path.exists():
                raise FileNotFoundError(f"no shadow state at {self.path} yet (has gcshadow served this root?)")
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, isolation_level=None,
                                   check_same_thread=False)
            conn.execute("PRAGMA busy_timeout = 2000")
            self.conn = conn
        return self.conn

    def _read_own(self, failing: bool) -> dict[str, dict[str, Any]] | None:
        try:
            conn = self._connect()
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            if version == self.data_version and not failing:
                return None
            db = sqlite_utils.Database(conn)
            jobs = {row["job_id"]: row for row in db["jobs"].rows_where(order_by="first_seen")}
            for job in jobs.values():
                job["streams"] = []
            for stream in db["streams"].rows_where(select="job_id, stream, kind, name, durable",
                                                   order_by="job_id, stream"):
                job_id = stream.pop("job_id")
                if job_id in jobs:
                    jobs[job_id]["streams"].append(stream)
            files = fileversions.listing(conn, fileversions.SQLITE) if fileversions.has_table(
                conn, fileversions.SQLITE) else {}
            for job_id, job in jobs.items():
                job["files"] = files.get(job_id, [])
        except (sqlite3.Error, OSError) as e:
            self.close()
            self.data_version = None
            raise Unreadable(str(e)) from None
        self.data_version = version
        return jobs

    def _read_shared(self, known: dict[str, dict[str, Any]], failing: bool) -> dict[str, dict[str, Any]] | None:
        from .pgstate import JobsReader

        if time.monotonic() - self.shared_at < self.SHARED_EVERY:
            return None
        self.shared_at = time.monotonic()
        try:
            if self.shared is None:
                self.shared = JobsReader(self.state_url)
            jobs = {row["job_id"]: row for row in self.shared.read()}
        except StoreError as e:
            raise Unreadable(str(e)) from None
        return None if jobs == known and not failing else jobs


class StateReader:
    """The jobs the shadow at ROOT knows, as the web view shows them.

    `read()` (in a worker thread) looks at the state when it changed, and
    returns whether it did; `jobs` then holds the raw rows (`JobRows`).
    `view()` derives what pages and scripts see, cached for a moment: every
    client of one poll shares one list and one encoding of it.
    """

    def __init__(self, root: Path, root_fd: int, state_url: str = "", lines: LineOptions | None = None) -> None:
        self.root = root
        self.root_fd = root_fd
        self.state_url = state_url  # a shared state (--state), read instead of the root's own (timelines too)
        self.rows = JobRows(root, state_url)
        self.jobs: dict[str, dict[str, Any]] = {}  # job_id -> row, with "streams"
        self.generation = 0  # bumped whenever `jobs` changes
        self.error = ""  # why the state cannot be read, for the page's banner
        self.seen: dict[tuple[str, int], StreamSeen] = {}
        self.extras: dict[str, dict[str, Any]] = {}  # job_id -> {"events": [...], "why": "..."}
        self.refusals: list[dict[str, Any]] = []  # the newest first
        self.extras_at = -LOOKED  # monotonic time of their last read
        self.extras_generation = -1  # `generation` they were read at
        self.looked = -LOOKED  # monotonic time a client last looked (`view`)
        self.watching = 0  # job pages open (each holds an event stream): they look all the time
        self.line_options = lines or LineOptions()
        self.lines: dict[tuple[str, str], tuple[str, Lines]] = {}  # (job, kind) -> (instance, its line counts)
        self._view: tuple[tuple[int, int], dict[str, dict[str, Any]], bytes] | None = None
        self._encoded: dict[str, bytes] = {}

    def close(self) -> None:
        self.rows.close()

    def read(self) -> bool:
        """Read the state again if the shadow committed since the last read
        (and the timelines and refusals when they are due): whether anything changed."""
        changed = self._read_jobs()
        now = time.monotonic()
        if (self.watching or now - self.looked < LOOKED) and (now - self.extras_at >= WHY_EVERY or (
                self.generation != self.extras_generation and now - self.extras_at >= EXTRAS_EVERY)):
            changed |= self._read_extras(now)
        return changed

    def _read_jobs(self) -> bool:
        try:
            jobs = self.rows.read(self.jobs, bool(self.error))
        except Unreadable as e:
            changed = str(e) != self.error
            self.error = str(e)
            if changed:
                self.generation += 1
            return changed
        if jobs is None:
            self._sample()
            return False
        self.error, self.jobs = "", jobs
        self.generation += 1
        self._sample()
        return True

    def extras_due(self) -> bool:
        """Whether the timelines and refusals are older than a client should see (nobody looked for a while)."""
        return time.monotonic() - self.extras_at >= WHY_EVERY

    def read_extras(self) -> bool:
        """Read the timelines and refusals now (in the worker thread): whether they changed."""
        return self._read_extras(time.monotonic())

    def _read_extras(self, now: float) -> bool:
        """Read the jobs' timelines and "why"s and the refused connections: whether they changed."""
        self.extras_at, self.extras_generation = now, self.generation
        try:
            extras = read_timelines(self.state_url, self.root)
            refusals = read_refusals(self.state_url, self.root)
        except (sqlite3.Error, OSError, StoreError, ValueError) as e:
            log.debug("web: cannot read the timelines and refusals for now: %s", e)
            return False  # shown as they were; a state that cannot be read is reported by the jobs' read
        if extras == self.extras and refusals == self.refusals:
            return False
        self.extras, self.refusals = extras, refusals
        self.generation += 1
        self.extras_generation = self.generation
        return True

    def _sample(self) -> None:
        """Note every stream's durable length now, for rates and last-byte ages."""
        now, wall = time.monotonic(), time.time()
        alive = set()
        for job in self.jobs.values():
            for st in job["streams"]:
                if st["kind"] == "stdin":
                    continue
                key = (job["job_id"], st["stream"])
                alive.add(key)
                seen = self.seen.get(key)
                if seen is None or seen.instance != job["instance"] or (
                        seen.samples and st["durable"] < seen.samples[-1][1]):
                    seen = self.seen[key] = StreamSeen(job["instance"])
                    seen.last_byte_at = self._mtime(st["name"]) if st["durable"] else None
                seen.add(now, st["durable"], wall)
        for key in set(self.seen) - alive:
            del self.seen[key]
        for gone in [key for key in self.lines if key[0] not in self.jobs]:
            del self.lines[gone]

    def _mtime(self, name: str) -> float | None:
        """When the file was last written: the last byte's time of a stream first seen."""
        try:
            fd = open_output(self.root_fd, name)
        except (Refused, OSError):
            return None
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)

    # -- what clients see -----------------------------------------------------

    def view(self) -> tuple[dict[str, dict[str, Any]], bytes]:
        """Every job as a dict for JSON (by job id), and the encoded /api/jobs answer."""
        now = time.monotonic()
        self.looked = now
        key = (self.generation, int(now * 2))  # derived again at most twice a second: ages and rates move
        if self._view is None or self._view[0] != key:
            wall = time.time()
            jobs = {job_id: self.job_view(job, now, wall) for job_id, job in self.jobs.items()}
            body = json.dumps({"root": str(self.root), "now": round(wall, 3), "error": self.error,
                               "jobs": list(jobs.values())})
            self._view = (key, jobs, body.encode())
            self._encoded = {}
        return self._view[1], self._view[2]

    def job_json(self, job_id: str, timeline: bool = True) -> bytes:
        """One job's view (with its timeline, `events`, unless told not to), encoded once for
        every page that shows it."""
        jobs, _ = self.view()
        key = f"{int(timeline)}{job_id}"
        if key not in self._encoded:
            job = {**jobs[job_id], "events": self.timeline(job_id)} if timeline else jobs[job_id]
            self._encoded[key] = json.dumps(job, separators=(",", ":")).encode()
        return self._encoded[key]

    def timeline(self, job_id: str) -> list[dict[str, Any]]:
        """The job's events, oldest first; [] from a shadow that records none."""
        events = self.extras.get(job_id, {}).get("events")
        if events is None:  # a shared state's reader may give them with the job
            events = (self.jobs.get(job_id) or {}).get("events")
        return list(events) if isinstance(events, list) else []

    def why(self, job_id: str) -> str:
        """Why the job looks the way it does, in one line; "" from a shadow that does not say."""
        why = self.extras.get(job_id, {}).get("why")
        if why is None:
            why = (self.jobs.get(job_id) or {}).get("why")
        return why if isinstance(why, str) else ""

    def refusals_json(self) -> bytes:
        self.looked = time.monotonic()
        return json.dumps({"error": self.error, "refusals": self.refusals}).encode()

    def job_view(self, job: dict[str, Any], now: float | None = None, wall: float | None = None) -> dict[str, Any]:
        """One job as the pages and scripts see it (see README, "The web view")."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        command, summary = _decoded(job.get("command"), []), _decoded(job.get("summary"), {})
        streams, stdin = [], None
        for st in job["streams"]:
            if st["kind"] == "stdin":
                stdin = st["name"]
                continue
            seen = self.seen.get((job["job_id"], st["stream"]))
            rate = seen.rate(now) if seen else None
            last = seen.last_byte_at if seen else None
            streams.append({
                "stream": st["stream"], "kind": st["kind"], "name": st["name"], "bytes": st["durable"],
                "rate": None if rate is None else round(rate, 1),
                "last_byte_at": None if last is None else round(last, 3),
                "idle_s": None if last is None else round(max(0.0, wall - last), 1),
                "download": f"{api_url(job['job_id'])}/files/{quote(st['kind'], safe='')}",
            })
        total = sum(s["bytes"] for s in streams)
        rates = [s["rate"] for s in streams if s["rate"] is not None]
        lasts = [s["last_byte_at"] for s in streams if s["last_byte_at"] is not None]
        first, end = job.get("first_seen"), job.get("ended") or wall
        span = (end - first) if first else 0.0
        try:
            failed = int(float(summary.get("failed_attempts", 0)))
        except (TypeError, ValueError):
            failed = 0
        finished = job["state"] == "finished"
        return {
            "job_id": job["job_id"], "instance": job["instance"], "state": job["state"],
            "host": job.get("host"), "user": job.get("user"), "peer": job.get("peer"), "command": command,
            "first_seen": job.get("first_seen"), "last_seen": job.get("last_seen"), "ended": job.get("ended"),
            "duration_s": round(job_duration(job, summary, wall), 1),
            "exit_code": job.get("exit_code"), "exit_signal": job.get("exit_signal"),
            "exit": exit_words(job) if finished else None,
            "failed": finished and bool(job.get("exit_signal") or job.get("exit_code") or job.get("exit_code") is None),
            "reason": job.get("reason") or "", "why": self.why(job["job_id"]),
            "failed_attempts": failed, "summary": summary,
            "bytes": total,
            "rate": round(sum(rates), 1) if rates else None,
            "avg_rate": round(total / span, 1) if span > 0 else None,
            "last_byte_at": max(lasts) if lasts else None,
            "idle_s": round(max(0.0, wall - max(lasts)), 1) if lasts else None,
            "stdin": stdin, "streams": streams,
            # The files the job writes (--file): NAME, its bytes, version, committed size, state (`fileversions`).
            "files": [{k: f[k] for k in ("name", "bytes", "version", "committed", "sha256", "next", "state")}
                      for f in job.get("files") or ()],
            "page": job_url(job["job_id"]), "url": api_url(job["job_id"]),
            "live": api_url(job["job_id"]) + "/events",
        }

    # -- line numbers ---------------------------------------------------------

    def lines_of(self, job_id: str, kind: str, instance: str) -> Lines:
        """The line counts of one stream's file (of this attempt of the job)."""
        held = self.lines.get((job_id, kind))
        if held is None or held[0] != instance:
            held = self.lines[(job_id, kind)] = (instance, Lines(self.line_options))
        return held[1]


def _decoded(value: Any, default: Any) -> Any:
    """A JSON column: as the state holds it (text), or already decoded (a shared state's reader)."""
    if isinstance(value, type(default)):
        return value
    try:
        decoded = json.loads(value or "null")
    except (TypeError, ValueError):
        return default
    return decoded if isinstance(decoded, type(default)) else default


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def job_duration(job: dict[str, Any], summary: dict[str, Any], wall: float) -> float:
    """Seconds from the job's start to its end, or to now while it runs, as `gcshadow jobs` counts
    them: its gcwrap says when the job started and ended (in the summary); until then, from when
    the shadow first heard of it."""
    started, ended = _number(summary.get("job_started")), _number(summary.get("job_ended"))
    finished = job["state"] == "finished"
    if finished and started and ended:
        return max(0.0, ended - started)
    end = (job.get("ended") if finished else None) or wall
    seen = max(0.0, end - (job.get("first_seen") or end))
    return max(seen, _number(summary.get("wall_s")) or 0.0) if finished else seen


# -- what the shadow records beyond jobs and streams -----------------------------------


def read_timelines(state: str, root: Path) -> dict[str, dict[str, Any]]:
    """Each job's timeline (`events`, the newest TIMELINE of them) and "why", by job id, as `gcshadow jobs`
    reads them."""
    return {job["job_id"]: {"events": list(job.get("events") or []), "why": str(job.get("why") or "")}
            for job in backends.read_jobs(state, root, events=TIMELINE)}


def read_refusals(state: str, root: Path) -> list[dict[str, Any]]:
    """The connections the shadow refused, the newest first."""
    return backends.read_refusals(state, root, limit=REFUSALS)


def exit_words(job: dict[str, Any]) -> str:
    """How a finished job ended: "status 0", "signal 9", "unknown"."""
    if job.get("exit_signal"):
        return f"signal {job['exit_signal']}"
    if job.get("exit_code") is not None:
        return f"status {job['exit_code']}"
    return "unknown"


# -- files ---------------------------------------------------------------------------


def open_output(root_fd: int, name: str) -> int:
    """Open a job's output file NAME (from the state, never from a URL) for
    reading, under the shadow's rules: relative, no '..', nothing in the
    shadow's state directory, no symlink anywhere on the path, a regular file,
    and one link only (a hard link made in the root could name a file outside
    it). Refused says why; OSError (FileNotFoundError...) passes through."""
    try:
        fd = open_confined(root_fd, name, write=False, create=False)
    except NameError_ as e:
        raise Refused(str(e)) from None
    links = os.fstat(fd).st_nlink
    if links != 1:
        os.close(fd)
        raise Refused(f"{name!r} has {links} hard links: a linked file may be someone else's")
    return fd


def open_served(root_fd: int, name: str) -> int:
    """`open_output` for a client: Unservable says why not, with its HTTP status."""
    try:
        return open_output(root_fd, name)
    except Refused as e:
        log.warning("web: refused to serve %r: %s", name, e)
        raise Unservable(403, f"refused: {e}") from None
    except FileNotFoundError:
        raise Unservable(404, f"{name!r} is not at the shadow (yet)") from None
    except OSError as e:
        raise Unservable(500, f"cannot open {name!r}: {e.strerror or e}") from None


class Lines:
    """How many lines a file holds before a place in it, from checkpoints
    (offset, newlines before it) every `LineOptions.mark` bytes, made as
    places are asked for: numbering a place costs reading from the
    checkpoint before it. Used by one thread at a time (the web view's line
    limiter)."""

    def __init__(self, opts: LineOptions | None = None) -> None:
        self.opts = opts or LineOptions()
        self.marks: list[tuple[int, int]] = [(0, 0)]

    def cut(self, end: int) -> None:
        """The file holds only `end` bytes now (cut back): forget what was counted past it."""
        while self.marks[-1][0] > end:
            self.marks.pop()

    def line_at(self, fd: int, offset: int) -> int | None:
        """The number (from 1) of the line that holds byte `offset`; None when
        that takes reading more than `LineOptions.most` bytes, or the file is shorter."""
        at, before = self.marks[bisect.bisect_right(self.marks, (offset, float("inf"))) - 1]
        if offset - at > self.opts.most:
            return None
        while at < offset:
            data = os.pread(fd, min(1 << 20, offset - at), at)
            if not data:
                return None
            at, before = at + len(data), before + data.count(b"\n")
            self._mark(at, before)
        return before + 1

    def offset_of(self, fd: int, line: int, end: int) -> int | None:
        """Where line `line` (from 1) starts, in the first `end` bytes; None
        when it is not there yet, or finding it takes reading too much."""
        if line <= 1:
            return 0
        at, before = self.marks[bisect.bisect_left(self.marks, line - 1, key=lambda m: m[1]) - 1]
        limit = min(end, at + self.opts.most)
        while at < limit:
            data = os.pread(fd, min(1 << 20, limit - at), at)
            if not data:
                return None
            found = before + data.count(b"\n")
            if found >= line - 1:  # the newline before our line is in this block
                pos = -1
                for _ in range(line - 1 - before):
                    pos = data.index(b"\n", pos + 1)
                return at + pos + 1
            at, before = at + len(data), found
            self._mark(at, before)
        return None

    def _mark(self, at: int, before: int) -> None:
        if at - self.marks[-1][0] >= self.opts.mark:
            self.marks.append((at, before))


def tail_start(fd: int, end: int, tail: int) -> int:
    """Where to start showing a file that holds `end` bytes so that at most
    about `tail` bytes show: at a line's start where one is near, so the first
    line shown is whole."""
    if end <= tail:
        return 0
    start = end - tail
    head = os.pread(fd, min(4096, end - start), start - 1)
    nl = head.find(b"\n")  # head[0] is the byte before `start`: a newline there means start is a line's start
    return start + nl if nl >= 0 else start
