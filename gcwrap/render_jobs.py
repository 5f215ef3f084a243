"""`gcshadow jobs` for people and for scripts (render.py's section on it,
continued here): chosen columns (-o), tab-separated rows a script can cut,
JSON whose figures are numbers, a job's timeline, the refused connections.

Cells for people are words and sizes (1.2 MiB, 5s ago); cells for scripts
(`*_tsv`) are plain: bytes as integers, rates in bytes per second, times as
ISO 8601 local times, tabs and line ends in values turned into spaces.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .render import (
    Column,
    _group,
    _lines,
    file_text,
    fit_table,
    job_bytes,
    job_duration,
    job_figures,
    job_rate,
    job_state_text,
    jobs_view,
    wrap_fields,
)
from .shadow.why import clock, status
from .units import ago, human_bytes

Rates = dict[str, float] | None


@dataclass(frozen=True)
class JobColumn:
    """A column -o may choose: its cell for people, and for scripts."""

    header: str
    human: Callable[[dict[str, Any], float, Rates], str]
    plain: Callable[[dict[str, Any], float, Rates], Any]
    justify: Literal["left", "right"] = "left"


def _rate(j: dict[str, Any], now: float, rates: Rates) -> float:
    return rates[j["job_id"]] if rates and j["job_id"] in rates else job_rate(j, now)


def _iso(t: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) if t else ""


def _streams(j: dict[str, Any], size: Callable[[int], str]) -> str:
    return ", ".join([f"{s['kind']} {s['name']} {size(s['durable'])}" for s in j["streams"] if s["kind"] != "stdin"]
                     + [file_text(f, size) for f in j.get("files") or ()])


def _text(key: str) -> JobColumn:
    return JobColumn(key, lambda j, now, r: str(j.get(key) or "-"), lambda j, now, r: j.get(key) or "")


def _when(key: str, header: str) -> JobColumn:
    return JobColumn(header, lambda j, now, r: ago(j.get(key), now), lambda j, now, r: _iso(j.get(key)), "right")


COLUMNS: dict[str, JobColumn] = {
    "job": JobColumn("job", lambda j, now, r: j["job_id"], lambda j, now, r: j["job_id"]),
    "host": _text("host"),
    "user": _text("user"),
    "state": JobColumn("state", lambda j, now, r: job_state_text(j, now), lambda j, now, r: job_state_text(j, now)),
    "status": JobColumn("status", lambda j, now, r: status(j, now), lambda j, now, r: status(j, now)),
    "why": JobColumn("why", lambda j, now, r: j.get("why") or "-", lambda j, now, r: j.get("why") or ""),
    "bytes": JobColumn("bytes", lambda j, now, r: human_bytes(job_bytes(j)), lambda j, now, r: job_bytes(j), "right"),
    "rate": JobColumn("rate", lambda j, now, r: f"{human_bytes(_rate(j, now, r))}/s",
                      lambda j, now, r: round(_rate(j, now, r), 1), "right"),
    "duration": JobColumn("duration", lambda j, now, r: f"{job_duration(j, now):.1f} s",
                          lambda j, now, r: round(job_duration(j, now), 1), "right"),
    "first_seen": _when("first_seen", "first seen"),
    "last_seen": _when("last_seen", "last seen"),
    "ended": _when("ended", "ended"),
    "exit": JobColumn("exit", lambda j, now, r: "-" if j.get("exit_code") is None else str(j["exit_code"]),
                      lambda j, now, r: "" if j.get("exit_code") is None else j["exit_code"], "right"),
    "signal": JobColumn("signal", lambda j, now, r: str(j.get("exit_signal") or "-"),
                        lambda j, now, r: j.get("exit_signal") or "", "right"),
    "streams": JobColumn("streams", lambda j, now, r: _streams(j, human_bytes), lambda j, now, r: _streams(j, str)),
    "peer": _text("peer"),
    "instance": _text("instance"),
    "session": JobColumn("session", lambda j, now, r: str(j.get("session") or 0),
                         lambda j, now, r: j.get("session") or 0, "right"),
    "command": JobColumn("command", lambda j, now, r: shlex.join(j.get("command") or []) or "-",
                         lambda j, now, r: shlex.join(j.get("command") or [])),
}
DEFAULT_COLUMNS = ("job", "host", "state", "bytes", "rate", "last_seen", "streams")


def parse_columns(text: str) -> list[str]:
    """-o's comma-separated column names (any case, - or _); ValueError names the unknown ones."""
    names = [n.strip().lower().replace("-", "_") for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in COLUMNS]
    if unknown or not names:
        raise ValueError(f"unknown column(s) {', '.join(unknown) or '(none given)'}: choose from "
                         f"{', '.join(COLUMNS)}")
    return names


def _plain(value: Any) -> str:
    return re.sub(r"[\t\r\n]", " ", str(value))


def jobs_tsv(jobs: list[dict[str, Any]], columns: list[str], now: float, rates: Rates = None,
             header: bool = True) -> str:
    """A row per job, tab-separated, for `cut` and `awk -F'\\t'`: the column names first unless not `header`."""
    rows = [columns] if header else []
    rows += [[COLUMNS[c].plain(j, now, rates) for c in columns] for j in jobs]
    return "".join("\t".join(_plain(v) for v in row) + "\n" for row in rows)


def columns_view(jobs: list[dict[str, Any]], columns: list[str], now: float, rates: Rates = None,
                 width: int | None = None) -> Any:
    """The chosen columns as a table, the default ones as `render.jobs_view` lays them
    out; where a table does not fit `width`, a line per job of `column: value` fields."""
    if tuple(columns) == DEFAULT_COLUMNS:
        return jobs_view(jobs, rates, now, width)
    cols = [Column(COLUMNS[c].header, [COLUMNS[c].human(j, now, rates) for j in jobs], COLUMNS[c].justify)
            for c in columns]
    table = fit_table("gcshadow jobs", cols, width, "" if jobs else "no jobs")
    if table is not None:
        return table
    lines: list[str] = []
    for i in range(len(jobs)):
        lines += wrap_fields([f"{c.header}: {c.cells[i]};" for c in cols], width)
    return _group(_lines(lines or ["no jobs"]))


# -- JSON -----------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")


def as_number(value: Any) -> Any:
    """A figure the wire carried as text ("7", "0.017") as the number it is; anything else as it is."""
    if isinstance(value, str) and _NUMBER.fullmatch(value):
        n = float(value)
        return int(n) if n.is_integer() and "." not in value and "e" not in value.lower() else n
    return value


def job_json(job: dict[str, Any], now: float, events: bool) -> dict[str, Any]:
    """A job for --json: its fields, the listing's figures, `status` and `why`,
    the I/O summary's figures as numbers; its `events` if asked for."""
    out = {**job_figures(job, now), "status": status(job, now)}
    out["summary"] = {k: as_number(v) for k, v in (job.get("summary") or {}).items()}
    if not events:
        out.pop("events", None)
    return out


# -- a job's timeline -----------------------------------------------------------------------------

_TIMES = ("since", "worked_at", "heard")  # details that are Unix times: shown as clock times
# What an event of a job's file means, said after its details.
_WORDS = {"file_gone": "(the job deleted it: home keeps what it had)",
          "file_unreadable": "(gcwrap cannot read it: home keeps what it had)",
          "file_refused": "(home refused the file's NAME)"}


def _detail(key: str, value: Any, now: float) -> str:
    if key in _TIMES and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{key}={clock(value, now)}"
    if isinstance(value, float):
        return f"{key}={value:.3f}".rstrip("0").rstrip(".")
    if value is None or value == "":
        return ""
    return f"{key}={value}"


def timeline_lines(events: list[dict[str, Any]], now: float, width: int | None = None) -> list[str]:
    """A job's events, oldest first: when, who saw it (home or agent), what, its details."""
    lines = ["timeline:" if events else "timeline: nothing recorded"]
    for e in events:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"])) + f".{int(e['time'] * 1000) % 1000:03d}"
        who = "home " if e["source"] == "shadow" else "agent"
        details = [_detail(k, v, now) for k, v in e["details"].items()]
        words = _WORDS.get(e["kind"], "").split()
        lines += wrap_fields([f"  {stamp}", who, e["kind"], *[d for d in details if d], *words], width,
                             indent="      ")
    return lines


def job_timeline(job: dict[str, Any], now: float, width: int | None = None) -> Any:
    """The lines after `gcshadow jobs JOB`'s table: why, then the timeline."""
    return _group(_lines(wrap_fields(["why:", job.get("why") or "-"], width)
                         + timeline_lines(job.get("events") or [], now, width)))


# -- refusals and home -----------------------------------------------------------------------------

REFUSAL_COLUMNS = ("time", "peer", "identity", "job", "code", "message")


def _refusal_cells(r: dict[str, Any]) -> list[Any]:
    return [r["peer"], r["identity"], r["job_id"], r["code"], r["message"]]


def refusals_tsv(refusals: list[dict[str, Any]], header: bool = True) -> str:
    rows: list[list[Any]] = [list(REFUSAL_COLUMNS)] if header else []
    rows += [[_iso(r["time"]), *_refusal_cells(r)] for r in refusals]
    return "".join("\t".join(_plain(v) for v in row) + "\n" for row in rows)


def refusals_view(refusals: list[dict[str, Any]], now: float, width: int | None = None) -> Any:
    """The refused connections, newest first: a table, or a line each where it does not fit."""
    cells = [[clock(r["time"], now), *[str(c or "-") for c in _refusal_cells(r)]] for r in refusals]
    cols = [Column(h, [row[i] for row in cells]) for i, h in enumerate(REFUSAL_COLUMNS)]
    table = fit_table("refused connections", cols, width, "" if refusals else "no refused connections")
    if table is not None:
        return table
    lines: list[str] = []
    for r in refusals:
        who = [f"[{r['identity']}]"] if r["identity"] else []
        job = [f"job {r['job_id']}:"] if r["job_id"] else []
        lines += wrap_fields([clock(r["time"], now), f"{r['peer']}", *who, *job, *r["message"].split(),
                              f"[{r['code']}]"], width)
    return _group(_lines(lines or ["no refused connections"]))


def home_warning(homes: list[dict[str, Any]]) -> list[str]:
    """A line per shadow whose root has less room than its --min-free (its agents are told BUSY)."""
    return [f"home short of disk: the shadow {h['shadow']} has {human_bytes(h['free'])} free under {h['root']}, "
            f"--min-free {human_bytes(h['min_free'])}: its jobs are told to come back later"
            for h in homes if h["min_free"] and h["free"] < h["min_free"]]


def prune_lines(pruned: list[Any], now: float, dry_run: bool) -> list[str]:
    """What `gcshadow prune` forgot (or would): a line per job and per file
    removed or kept, then a summary."""
    forget, remove = ("would forget", "would remove") if dry_run else ("forgot", "removed")
    lines: list[str] = []
    for p in pruned:
        lines.append(f"{forget} job {p.job_id} (finished {ago(p.ended, now)}, {_iso(p.ended)})")
        lines += [f"  {remove} {name}" for name in p.removed]
        lines += [f"  kept {name} (another job's now, or written since)" for name in p.kept]
    files = sum(len(p.removed) for p in pruned)
    lines.append(f"{len(pruned)} job(s) {'would be ' if dry_run else ''}forgotten, {files} file(s) {remove}"
                 + (" (dry run: nothing changed)" if dry_run else ""))
    return lines
