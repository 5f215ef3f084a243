"""All terminal output of gcwrap and gcshadow goes through here.

Logic modules never print: they log, or return data that these functions
render on an injected `rich.console.Console`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Literal

from .agent.records import loss_text
from .logs import setup_logging as setup_logging  # (re-exported: where it was)
from .units import ago, human_bytes

if TYPE_CHECKING:  # rich is imported where tables are drawn: `gcwrap run` never needs it
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table


def stderr_console() -> Console:
    from rich.console import Console

    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


def say_on_stderr(text: str, program: str = "gcshadow") -> None:
    """One line on stderr, beside what a command prints on stdout (`gcshadow tail`'s notices)."""
    sys.stderr.write(f"{program}: {text}\n")
    sys.stderr.flush()


# -- tables that fit ----------------------------------------------------------
#
# A table is drawn only at a width where every cell is whole: a name, a size
# or a state is never broken across lines. Where a layout does not fit, a
# narrower one is tried (fewer columns), then a compact form: a line per job
# (and per stream), wrapped between whole fields. Through a pipe there is no
# width limit (unless COLUMNS says one): every row is one line, for grep.

TABLE_EDGES = 1  # a heavy-head table: one rule before each column, one after the last...
TABLE_PER_COLUMN = 3  # ...and one space of padding each side of every column


@dataclass
class Column:
    """A column of a table; each cell is whole ("\n" starts another line of it)."""

    header: str
    cells: list[str] = field(default_factory=list)
    justify: Literal["left", "right"] = "left"

    @property
    def width(self) -> int:
        from rich.cells import cell_len

        return max(cell_len(line) for text in (self.header, *self.cells) for line in text.split("\n"))


def fit_table(title: str, columns: list[Column], width: int | None, caption: str = "") -> Table | None:
    """The columns as a table no wider than `width` (None: any width), or
    None when it would not fit without breaking a cell."""
    from rich.table import Table

    widths = [c.width for c in columns]
    if width is not None and sum(widths) + TABLE_EDGES + TABLE_PER_COLUMN * len(columns) > width:
        return None
    table = Table(title=title, caption=caption or None)
    for c, w in zip(columns, widths):
        table.add_column(c.header, width=w, no_wrap=True, justify=c.justify)
    for row in zip(*(c.cells for c in columns)):
        table.add_row(*row)
    return table


def wrap_fields(fields: list[str], width: int | None, indent: str = "    ") -> list[str]:
    """Fields joined by spaces into lines of at most `width` cells, breaking
    only between fields; later lines are indented. A field wider than a line
    stays whole on a line of its own."""
    from rich.cells import cell_len

    lines: list[str] = []
    line = ""
    for f in fields:
        if not f:
            continue
        if line and width is not None and cell_len(line) + 1 + cell_len(f) > width:
            lines.append(line)
            line = indent + f
        else:
            line = f"{line} {f}" if line else f
    if line:
        lines.append(line)
    return lines


def _lines(lines: list[str]) -> Any:
    from rich.text import Text

    # no_wrap: the lines are already wrapped at field boundaries (a field wider
    # than the screen is left for the terminal, never split by us).
    return [Text(line, no_wrap=True, overflow="ignore") for line in lines]


def stdout_console() -> Console:
    """The console for tables on stdout: through a pipe (and no COLUMNS), as
    wide as any row (see `output_width`)."""
    from rich.console import Console

    console = Console(highlight=False)
    if output_width(console) is None:
        console = Console(highlight=False, width=UNLIMITED)
    return console


UNLIMITED = 1 << 16  # a console this wide never wraps a line of ours


def output_width(console: Console) -> int | None:
    """The width to lay tables out for: the terminal's, or COLUMNS; through a
    pipe with no COLUMNS, none (a row stays one line)."""
    if console.width >= UNLIMITED:
        return None
    if console.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return console.width
    return None


def print_view(console: Console, view: Any) -> None:
    """Print what a *_view function made (its lines are wrapped already)."""
    console.print(view, crop=False)


# -- gcwrap status -------------------------------------------------------------


def _stream_rows(sp: dict[str, Any]) -> list[dict[str, Any]]:
    # (What the job wrote: more than the spool holds when output was lost; older spools record no more.)
    return [{**st, "written": st.get("written", st["appended"])} for st in sp["streams"]] or [
        {"kind": "-", "name": "", "appended": 0, "written": 0, "acked": 0, "pending": 0}]


def _oldest(st: dict[str, Any]) -> str:
    oldest = st.get("oldest_pending_s")
    return f"{oldest:.0f}s" if oldest is not None else "-"


def status_table(spools: list[dict[str, Any]], width: int | None = None) -> Table | None:
    """`gcwrap status`: one row per stream of every spool, in the widest
    layout that fits `width` (None when none does: see `status_view`). The
    long fields (shadow, retries, spool size, last error) are in `status_details`."""
    rows = [(sp, i, st) for sp in spools for i, st in enumerate(_stream_rows(sp))]
    job = Column("job", [sp["job_id"] if i == 0 else "" for sp, i, _ in rows])
    state = Column("state", [sp["state"] if i == 0 else "" for sp, i, _ in rows])
    stream = Column("stream", [f"{st['kind']} {st['name']}".strip() for _, _, st in rows])

    def figure(header: str, key: str) -> Column:
        return Column(header, [human_bytes(st[key]) for _, _, st in rows], justify="right")

    oldest = Column("oldest", [_oldest(st) for _, _, st in rows], justify="right")
    caption = "" if spools else "no spools"
    layouts = [
        [job, state, stream, figure("written", "written"), figure("acked", "acked"), figure("pending", "pending"),
         oldest],
        [job, state, stream, figure("pending", "pending"), oldest],
    ]
    for columns in layouts:
        table = fit_table("gcwrap spools", columns, width, caption)
        if table is not None:
            return table
    return None


def status_compact(spools: list[dict[str, Any]], width: int | None) -> list[str]:
    """`gcwrap status` on a narrow screen: a line per job, one per stream."""
    lines: list[str] = []
    for sp in spools:
        lines += wrap_fields([f"{sp['job_id']}:", sp["state"]], width)
        for st in _stream_rows(sp):
            fields = [f"{st['kind']} {st['name']}:".strip(), f"{human_bytes(st['written'])} written,",
                      f"{human_bytes(st['acked'])} acked,", f"{human_bytes(st['pending'])} pending"]
            if st.get("oldest_pending_s") is not None:
                fields[-1] += ","
                fields.append(f"the oldest {_oldest(st)}")
            lines += wrap_fields(["  " + fields[0], *fields[1:]], width, indent="      ")
    return lines or ["no spools"]


def _committed(f: dict[str, Any]) -> str:
    return human_bytes(f["committed"]) if f["committed"] >= 0 else "-"


def status_files_table(spools: list[dict[str, Any]], width: int | None = None) -> Table | None:
    """`gcwrap status`: a row per file (--file) of every spool, None when
    there is none or no layout fits `width` (then `status_files_compact`)."""
    rows = [(sp, i, f) for sp in spools for i, f in enumerate(sp.get("files") or ())]
    if not rows:
        return None
    job = Column("job", [sp["job_id"] if i == 0 else "" for sp, i, _ in rows])
    name = Column("file", [f["name"] for _, _, f in rows])
    version = Column("version", [str(f["version"]) for _, _, f in rows], justify="right")
    state = Column("state", [f["state"] for _, _, f in rows])

    def figure(header: str, key: str) -> Column:
        return Column(header, [human_bytes(f[key]) for _, _, f in rows], justify="right")

    committed = Column("committed", [_committed(f) for _, _, f in rows], justify="right")
    for columns in ([job, name, version, figure("size", "size"), figure("sent", "sent"), figure("acked", "acked"),
                     committed, state], [job, name, version, figure("acked", "acked"), state]):
        table = fit_table("files", columns, width)
        if table is not None:
            return table
    return None


def status_files_compact(spools: list[dict[str, Any]], width: int | None) -> list[str]:
    """`gcwrap status`'s files on a narrow screen: a line per file."""
    lines: list[str] = []
    for sp in spools:
        for f in sp.get("files") or ():
            lines += wrap_fields([f"  {sp['job_id']}", f"file {f['name']}", f"version {f['version']}:",
                                  f"{human_bytes(f['size'])},", f"{human_bytes(f['sent'])} sent,",
                                  f"{human_bytes(f['acked'])} acked,", f"{_committed(f)} committed,", f["state"]],
                                 width, indent="      ")
    return lines


# `gcwrap status` says how long output has waited with nothing acknowledged
# once it is this long (seconds): less is a round trip, or the live view's age.
ACK_AGE_SHOWN = 1.0


def status_details(spools: Iterable[dict[str, Any]], width: int | None = None) -> list[str]:
    """Lines per spool: where it delivers, how it goes, why it waits."""
    lines = []
    for sp in spools:
        conn = "connected" if sp.get("connected") else "not connected"
        if (in_use := sp.get("shadow_in_use")) and in_use != sp.get("shadow"):  # (one of several)
            conn = f"{conn} {'to' if sp.get('connected') else '; last on'} {in_use}"
        if failovers := sp.get("failovers"):
            conn += f", {failovers} failover(s)"
        free = sp.get("disk_free")
        size = human_bytes(sp.get("spool_bytes") or 0) + (f", {human_bytes(free)} free" if free is not None else "")
        fields = [f"{sp['job_id']}:", "shadow", sp.get("shadow") or "-", f"({conn}),",
                  f"{sp.get('retries', 0)} failed attempts,", "spool", sp["spool"], f"({size})"]
        age = sp.get("last_ack_age_s")
        if age is not None and age >= ACK_AGE_SHOWN:
            fields[-1] += ";"
            fields += ["nothing", "acknowledged", "for", f"{age:.0f} s"]
        if sp.get("last_error"):
            fields[-1] += ";"
            fields += ["last error:", *str(sp["last_error"]).split()]
        lost = loss_text((st["kind"], st["lost_from"], st["lost_from"] + st["lost"])
                         for st in sp.get("streams", ()) if st.get("lost"))
        if lost:
            fields[-1] += ";"
            fields += ["LOST", *lost.split()]
        wire = sp.get("wire") or {}
        if wire.get("compressed_bytes") and wire.get("wire_bytes"):
            fields[-1] += ";"
            fields += ["sent", human_bytes(wire["job_bytes"]), "of", "output", "as",
                       human_bytes(wire["wire_bytes"]), "on", "the", "wire",
                       f"({ratio_text(wire['job_bytes'], wire['wire_bytes'])})"]
        lines += wrap_fields(fields, width)
    return lines


def status_view(spools: list[dict[str, Any]], width: int | None, directory: Path | None = None) -> Any:
    """Everything `gcwrap status` prints, laid out for `width` (None: no
    limit); with no spool, one line that says so and names the `directory`
    it looked in."""
    from rich.console import Group

    if not spools and directory is not None:
        return Group(*_lines([f"no spools in {directory}"]))
    table = status_table(spools, width)
    head = [table] if table is not None else _lines(status_compact(spools, width))
    files = status_files_table(spools, width)
    head += [files] if files is not None else _lines(status_files_compact(spools, width))
    return Group(*head, *_lines(status_details(spools, width)))


# -- gcshadow jobs -------------------------------------------------------------


def job_state_text(job: dict[str, Any], now: float | None = None) -> str:
    """A job's state in words: streaming, disconnected since T, finished..."""
    state = str(job["state"])
    if state == "disconnected":
        return f"disconnected since {ago(job['last_seen'], now)}"
    if state != "finished":
        return state
    reason = job.get("reason") or ""
    if job["exit_signal"]:
        if "retry limit" in reason:  # (gcwrap ended the job: its reason says so)
            return f"killed by retry limit (signal {job['exit_signal']})"
        return f"killed by signal {job['exit_signal']}"
    if job["exit_code"] is None:
        return "finished, status unknown"
    return f"finished with status {job['exit_code']}"


def job_bytes(job: dict[str, Any]) -> int:
    return sum(s["durable"] for s in job["streams"] if s["kind"] != "stdin")


def number(value: Any) -> float | None:
    """A figure of an agent's I/O summary (the wire carries them as text)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def job_duration(job: dict[str, Any], now: float | None = None) -> float:
    """Seconds from the job's start to its end, or to now while it runs. Its
    gcwrap says when the job started and ended (in the I/O summary at the
    end); until then the start is when the shadow first heard of the job."""
    summary = job.get("summary") or {}
    started, ended = number(summary.get("job_started")), number(summary.get("job_ended"))
    if job["state"] == "finished" and started and ended:
        return max(0.0, ended - started)
    end = (job.get("ended") if job["state"] == "finished" else None) or now or time.time()
    seen = max(0.0, end - (job.get("first_seen") or end))
    # (An older gcwrap's summary has only its own wall time: the job ran at least that long.)
    return max(seen, number(summary.get("wall_s")) or 0.0) if job["state"] == "finished" else seen


def job_rate(job: dict[str, Any], now: float | None = None) -> float:
    """Bytes per second over the job's run time (`job_duration`)."""
    span = job_duration(job, now)
    return job_bytes(job) / span if span > 0 else 0.0


def job_figures(job: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """What `gcshadow jobs` shows of a job, for --json: its fields and the figures derived from them."""
    return {**job, "bytes": job_bytes(job), "duration_s": round(job_duration(job, now), 3),
            "rate_bytes_s": round(job_rate(job, now), 1), "state_text": job_state_text(job, now)}


def _streams(job: dict[str, Any]) -> list[str]:
    return [f"{s['kind']} {s['name']} {human_bytes(s['durable'])}" for s in job["streams"] if s["kind"] != "stdin"] + [
        file_text(f, human_bytes) for f in job.get("files") or ()]


def file_text(f: dict[str, Any], size: Callable[[int], str]) -> str:
    """A file the job writes, as the listings show it beside the streams:
    `file NAME SIZE vVERSION`, and its state unless it is committed."""
    text = f"file {f['name']} {size(f['bytes'])} v{f['version']}"
    if f.get("next"):
        text += f" (v{f['next']['version']} arriving: {size(f['next']['bytes'])})"
    return text if f["state"] == "committed" else f"{text} {f['state']}"


def jobs_table(
    jobs: list[dict[str, Any]], rates: dict[str, float] | None = None, now: float | None = None,
    width: int | None = None,
) -> Table | None:
    """`gcshadow jobs`: a row per job, in the widest layout that fits `width`
    (None when none does: see `jobs_view`). `rates` (bytes/s) come from
    --watch; without them a job's rate is its average (`job_rate`)."""
    rate_of = {j["job_id"]: rates[j["job_id"]] if rates and j["job_id"] in rates else job_rate(j, now) for j in jobs}
    job = Column("job", [j["job_id"] for j in jobs])
    host = Column("host", [j["host"] or "-" for j in jobs])
    state = Column("state", [job_state_text(j, now) for j in jobs])
    size = Column("bytes", [human_bytes(job_bytes(j)) for j in jobs], justify="right")
    rate = Column("rate", [f"{human_bytes(rate_of[j['job_id']])}/s" for j in jobs], justify="right")
    seen = Column("last seen", [ago(j["last_seen"], now) for j in jobs], justify="right")
    inline = Column("streams", [", ".join(_streams(j)) for j in jobs])
    stacked = Column("streams", ["\n".join(_streams(j)) for j in jobs])
    caption = "" if jobs else "no jobs"
    for columns in ([job, host, state, size, rate, seen, inline], [job, host, state, size, rate, seen, stacked],
                    [job, state, size, rate, seen, stacked]):
        table = fit_table("gcshadow jobs", columns, width, caption)
        if table is not None:
            return table
    return None


def jobs_compact(
    jobs: list[dict[str, Any]], rates: dict[str, float] | None = None, now: float | None = None,
    width: int | None = None,
) -> list[str]:
    """`gcshadow jobs` on a narrow screen: a line per job, one per stream."""
    lines: list[str] = []
    for j in jobs:
        rate = rates[j["job_id"]] if rates and j["job_id"] in rates else job_rate(j, now)
        lines += wrap_fields([f"{j['job_id']}:", f"{job_state_text(j, now)};",
                              f"{human_bytes(job_bytes(j))}", f"at {human_bytes(rate)}/s;",
                              f"last seen {ago(j['last_seen'], now)};", f"host {j['host'] or '-'}"], width)
        for st in j["streams"]:
            if st["kind"] != "stdin":
                lines += wrap_fields([f"  {st['kind']}", st["name"], human_bytes(st["durable"])], width)
        for f in j.get("files") or ():
            lines += wrap_fields(["  " + file_text(f, human_bytes)], width)
    return lines or ["no jobs"]


def jobs_view(
    jobs: list[dict[str, Any]], rates: dict[str, float] | None = None, now: float | None = None,
    width: int | None = None,
) -> Any:
    table = jobs_table(jobs, rates, now, width)
    return table if table is not None else _group(_lines(jobs_compact(jobs, rates, now, width)))


def _group(items: list[Any]) -> Any:
    from rich.console import Group

    return Group(*items)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# The I/O summary's keys, as `gcshadow jobs JOB` shows them.
SUMMARY_LABELS: dict[str, tuple[str, Callable[[float], str]]] = {
    "job_started": ("job started", _clock),
    "job_ended": ("job ended", _clock),
    "wall_s": ("gcwrap's wall time", lambda v: f"{v:.1f} s"),
    "throughput_mb_s": ("throughput", lambda v: f"{v:.1f} MB/s"),
    "connected_s": ("connected", lambda v: f"{v:.1f} s"),
    "stalled_s": ("stalled (connected, nothing acknowledged)", lambda v: f"{v:.1f} s"),
    "disconnected_s": ("disconnected", lambda v: f"{v:.1f} s"),
    "paused_s": ("job paused", lambda v: f"{v:.1f} s"),
    "connections": ("connections", lambda v: f"{v:.0f}"),
    "reconnects": ("reconnects", lambda v: f"{v:.0f}"),
    "failed_attempts": ("failed connection attempts", lambda v: f"{v:.0f}"),
    "failovers": ("failovers to another shadow", lambda v: f"{v:.0f}"),
    "zero_copy_pct": ("spliced (zero-copy)", lambda v: f"{v:.0f}% of the output"),
    "wire_bytes": ("on the wire", lambda v: f"{human_bytes(v)} ({v:,.0f} bytes)"),
    "compressed_pct": ("sent compressed", lambda v: f"{v:.0f}% of the output"),
}


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The agent's I/O summary as (label, value) rows in words."""
    rows = []
    for key, value in summary.items():
        n = number(value)
        if key.endswith("_bytes") and key not in SUMMARY_LABELS and n is not None:
            rows.append((f"{key[:-6]} written", f"{human_bytes(n)} ({n:,.0f} bytes)"))
        elif key in SUMMARY_LABELS and n is not None:
            label, show = SUMMARY_LABELS[key]
            rows.append((label, show(n)))
        else:
            rows.append((key.replace("_", " "), str(value)))
    return rows


def job_detail(job: dict[str, Any], rate: float | None = None, now: float | None = None,
               width: int | None = None) -> Any:
    """`gcshadow jobs JOB`: everything the shadow knows of one job (`rate`:
    from --watch). A two-column table, its values wrapped between whole
    fields; where even that does not fit, `field: value` lines."""
    import shlex

    from rich.cells import cell_len
    from rich.table import Table

    def when(t: float | None) -> list[str]:
        return [_clock(t), f"({ago(t, now)})"] if t else ["-"]

    rows: list[tuple[str, list[str]]] = [("state", [job_state_text(job, now)])]
    rows += [(key, [str(job.get(key) or "-")]) for key in ("host", "user", "peer", "instance")]
    rows += [("command", [shlex.quote(a) for a in job["command"]] or ["-"]),
             ("first seen", when(job["first_seen"])), ("last seen", when(job["last_seen"]))]
    if job["state"] == "finished":
        rows.append(("ended", when(job.get("ended"))))
    if job.get("reason"):
        rows.append(("reason", str(job["reason"]).split()))
    total = job_bytes(job)
    shown = rate if rate is not None else job_rate(job, now)
    how = ["now"] if rate is not None else ["average over", f"{job_duration(job, now):.1f} s"]
    rows.append(("bytes", [human_bytes(total), f"({total:,} bytes),", f"{human_bytes(shown)}/s", *how]))
    for st in job["streams"]:
        held = ["served from"] if st["kind"] == "stdin" else [human_bytes(st["durable"]), f"({st['durable']:,} bytes)",
                                                              "in"]
        wire = st.get("wire")
        if wire and st["kind"] != "stdin" and wire < st["durable"]:  # some of it came compressed
            held[-1:] = [f"({human_bytes(wire)} on the wire, {ratio_text(st['durable'], wire)})", "in"]
        rows.append((st["kind"], [*held, st["name"]]))
    for f in job.get("files") or ():
        rows.append(("file", file_detail(f)))
    rows += [("I/O summary" if i == 0 else "", [f"{label}:", value])
             for i, (label, value) in enumerate(summary_rows(job.get("summary") or {}))]
    keys = max(cell_len(k) for k, _ in rows)
    room = None if width is None else width - keys - TABLE_EDGES - 2 * TABLE_PER_COLUMN
    if room is not None and room < max(cell_len(f) for _, fields in rows for f in fields):
        lines = [f"job {job['job_id']}"]
        for k, fields in rows:
            lines += wrap_fields([f"{k}:" if k else " ", *fields], width)
        return _group(_lines(lines))
    table = Table(title=f"job {job['job_id']}", show_header=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", no_wrap=True)
    for k, fields in rows:
        table.add_row(k, "\n".join(wrap_fields(fields, room, indent="")))
    return table


def file_detail(f: dict[str, Any]) -> list[str]:
    """A file the job writes, in words, for `gcshadow jobs JOB` (fields wrapped whole)."""
    fields = [human_bytes(f["bytes"]), f"({f['bytes']:,} bytes)", "in", f["name"] + ",", f"version {f['version']}"]
    if f["committed"] >= 0:
        fields[-1] += ","
        fields += ["committed", "at", f"{f['committed']:,}", "bytes", f"(SHA-256 {str(f['sha256'])[:12]}...)"]
    if f.get("next"):
        fields[-1] += ";"
        fields += [f"version {f['next']['version']}", "arriving:", human_bytes(f["next"]["bytes"])]
    if f["state"] != "committed":
        fields[-1] += ";"
        fields += [f["state"]]
    return fields


def ratio_text(job: float, wire: float) -> str:
    """How much smaller the wire's bytes are than the job's: "4.2x smaller"."""
    return f"{job / wire:.1f}x smaller" if wire else "-"


def _on_the_wire(summary: dict[str, Any]) -> list[str]:
    """A line on compression, when some output went compressed."""
    wire, pct = number(summary.get("wire_bytes")), number(summary.get("compressed_pct"))
    if not wire or not pct:
        return []
    return [f"  on the wire {human_bytes(wire)} ({wire:,.0f} bytes); {pct:g}% of the output sent compressed"]


SUMMARY_FILES = 20  # files the I/O summary names at most (the rest are counted)

# What the I/O summary and `gcwrap status` add to a file's figures, by its state.
FILE_STATES = {"live": "not all home", "committed": "", "gone": "deleted by the job: home keeps what it had",
               "unreadable": "gcwrap cannot read it: home keeps what it had"}


def file_words(f: dict[str, Any]) -> str:
    """A file the job wrote (--file), for the I/O summary: its PATH (and the
    NAME it lands at, where another), size, version and what became of it."""
    where = f["path"] if f["name"] == f["path"] else f"{f['path']} as {f['name']}"
    said = [f"version {f['version']}"] if f["version"] > 1 else []
    if FILE_STATES.get(f["state"]):
        said.append(FILE_STATES[f["state"]])
    return f"{where} {human_bytes(f['size'])}" + (f" ({'; '.join(said)})" if said else "")


def _files_line(files: list[dict[str, Any]]) -> list[str]:
    if not files:
        return []
    more = f", and {len(files) - SUMMARY_FILES} more" if len(files) > SUMMARY_FILES else ""
    return ["  files: " + ", ".join(file_words(f) for f in files[:SUMMARY_FILES]) + more]


def summary_lines(job_id: str, job_status: int | None, summary: dict[str, Any],
                  files: list[dict[str, Any]] | None = None) -> list[str]:
    """The I/O summary gcwrap prints on its own stderr when it exits (`files`:
    the job's files, --file, as `FileSender.listing` gives them)."""
    status = "unknown status" if job_status is None else f"status {job_status}"
    streams = [
        f"{key[:-6]} {human_bytes(value)}" for key, value in summary.items()
        if key.endswith("_bytes") and key != "wire_bytes"
    ]
    lost = int(summary.get("lost", 0))
    return [
        f"job {job_id} ended with {status}; wall {summary.get('wall_s', 0):.1f} s",
        "  output: " + (", ".join(streams) or "none") + f"; {summary.get('throughput_mb_s', 0):.1f} MB/s",
        (f"  connected {summary.get('connected_s', 0):.1f} s{_stalled(summary)}, "
         f"disconnected {summary.get('disconnected_s', 0):.1f} s, job paused {summary.get('paused_s', 0):.1f} s"),
        (f"  {summary.get('connections', 0)} connection(s), {summary.get('reconnects', 0)} reconnect(s), "
         f"{summary.get('failed_attempts', 0)} failed connection attempt(s) in all"),
    ] + _files_line(files or []) + _shadow_in_use(summary) + _on_the_wire(summary) + (
        [f"  LOST: {human_bytes(lost)} ({lost:,} bytes) of output reached neither the spool nor home"] if lost else [])


def _stalled(summary: dict[str, Any]) -> str:
    """Of the time connected, the stalls (output waiting, nothing acknowledged), when there were any."""
    stalled = number(summary.get("stalled_s")) or 0.0
    return f" (stalled {stalled:.1f} s)" if stalled >= 0.05 else ""


def _shadow_in_use(summary: dict[str, Any]) -> list[str]:
    """The shadow that took the output last, and how often gcwrap moved to another."""
    if not summary.get("shadow"):
        return []
    failovers = int(number(summary.get("failovers")) or 0)
    return [f"  shadow in use: {summary['shadow']}; {failovers} failover(s) to another shadow"]


class Reporter:
    """gcwrap's closing words on stderr: text lines, or JSON lines with --log-format json."""

    def __init__(self, out: IO[str] | None = None, fmt: str = "text") -> None:
        self.out = out or sys.stderr
        self.fmt = fmt

    def say(self, message: str, level: str = "error", **fields: Any) -> None:
        if self.fmt == "json":
            record = {"time": round(time.time(), 3), "level": level, "logger": "gcwrap", "message": message, **fields}
            line = json.dumps(record)
        else:
            line = f"gcwrap: {message}"
        self.out.write(line + "\n")
        self.out.flush()

    def summary(self, job_id: str, job_status: int | None, summary: dict[str, Any],
                files: list[dict[str, Any]] | None = None) -> None:
        if self.fmt == "json":
            extra = {"files": files} if files else {}
            self.say("I/O summary", "info", job_id=job_id, job_status=job_status, summary=summary, **extra)
        else:
            for line in summary_lines(job_id, job_status, summary, files):
                self.say(line)
