"""All terminal output of gcwrap and gcshadow goes through here.

Logic modules never print: they log, or return data that these functions
render on an injected `rich.console.Console`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # rich is imported where tables are drawn: `gcwrap run` never needs it
    from rich.console import Console
    from rich.table import Table


def stderr_console() -> Console:
    from rich.console import Console

    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


class _PlainFormatter(logging.Formatter):
    """`prog: message`, after the local time to the millisecond when the lines
    are a server's log (read later, next to other logs)."""

    def __init__(self, prog: str, timestamps: bool = False) -> None:
        super().__init__()
        self.prog = prog
        self.timestamps = timestamps

    def format(self, record: logging.LogRecord) -> str:
        line = f"{self.prog}: {record.getMessage()}"
        if self.timestamps:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
            line = f"{stamp}.{int(record.msecs):03d} {line}"
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {"time": round(record.created, 3), "level": record.levelname.lower(),
             "logger": record.name, "message": record.getMessage()}
        )


def setup_logging(prog: str, verbose: int, fmt: str = "text", timestamps: bool = False) -> None:
    """Log to stderr: warnings by default, -v info, -vv debug, -1 (quiet) errors only."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _PlainFormatter(prog, timestamps))
    level = (
        logging.ERROR if verbose < 0 else logging.WARNING if verbose == 0 else logging.INFO if verbose == 1
        else logging.DEBUG
    )
    for name in ("gcwrap", "gcshadow"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ago(t: float | None, now: float | None = None) -> str:
    if not t:
        return "-"
    s = max(0.0, (now or time.time()) - t)
    if s < 60:
        return f"{s:.0f}s ago"
    if s < 3600:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"


def exit_text(code: int | None, signal: int | None) -> str:
    if signal:
        return f"signal {signal}"
    if code is not None:
        return f"status {code}"
    return "unknown"


def status_table(console: Console, spools: Iterable[dict[str, Any]]) -> Table:
    """`gcwrap status`: one row per stream of every spool; the long fields
    (shadow, retries, spool size, last error) go in `status_details`."""
    from rich.table import Table

    table = Table(title="gcwrap spools")
    for col in ("job", "state", "stream", "written", "acked", "pending", "oldest"):
        table.add_column(col, overflow="fold")
    rows = 0
    for sp in spools:
        rows += 1
        streams = sp["streams"] or [{"kind": "-", "name": "", "appended": 0, "acked": 0, "pending": 0}]
        for i, st in enumerate(streams):
            oldest = st.get("oldest_pending_s")
            table.add_row(
                sp["job_id"] if i == 0 else "",
                sp["state"] if i == 0 else "",
                f"{st['kind']} {st['name']}".strip(),
                human_bytes(st["appended"]),
                human_bytes(st["acked"]),
                human_bytes(st["pending"]),
                f"{oldest:.0f}s" if oldest is not None else "-",
            )
    if not rows:
        table.caption = "no spools"
    return table


def status_details(spools: Iterable[dict[str, Any]]) -> list[str]:
    """One line per spool: where it delivers, how it goes, why it waits."""
    lines = []
    for sp in spools:
        conn = "connected" if sp.get("connected") else "not connected"
        free = sp.get("disk_free")
        size = human_bytes(sp.get("spool_bytes") or 0) + (f", {human_bytes(free)} free" if free is not None else "")
        line = f"{sp['job_id']}: shadow {sp.get('shadow') or '-'} ({conn}), {sp.get('retries', 0)} failed attempts, "
        line += f"spool {sp['spool']} ({size})"
        if sp.get("last_error"):
            line += f"; last error: {sp['last_error']}"
        lines.append(line)
    return lines


def job_state_text(job: dict[str, Any], now: float | None = None) -> str:
    """A job's state in words: streaming, disconnected since T, finished..."""
    state = job["state"]
    if state == "disconnected":
        return f"disconnected since {ago(job['last_seen'], now)}"
    if state != "finished":
        return state
    reason = job.get("reason") or ""
    if "retry limit" in reason:
        return f"killed by retry limit ({exit_text(job['exit_code'], job['exit_signal'])})"
    if job["exit_signal"]:
        return f"killed by signal {job['exit_signal']}"
    if job["exit_code"] is None:
        return "finished, status unknown"
    return f"finished with status {job['exit_code']}"


def job_bytes(job: dict[str, Any]) -> int:
    return sum(s["durable"] for s in job["streams"] if s["kind"] != "stdin")


def jobs_table(
    console: Console, jobs: Iterable[dict[str, Any]], rates: dict[str, float] | None = None,
    now: float | None = None,
) -> Table:
    """`gcshadow jobs`: one row per job the shadow knows. `rates` (bytes/s)
    come from --watch; without them the rate is the average since the start."""
    from rich.table import Table

    table = Table(title="gcshadow jobs")
    for col in ("job", "host", "state", "bytes", "rate", "last seen", "streams"):
        table.add_column(col, overflow="fold")
    rows = 0
    for job in jobs:
        rows += 1
        total = job_bytes(job)
        if rates is not None and job["job_id"] in rates:
            rate = rates[job["job_id"]]
        else:
            span = (job["last_seen"] or 0) - (job["first_seen"] or 0)
            rate = total / span if span > 0 else 0.0
        streams = ", ".join(
            f"{s['kind']} {s['name']} {human_bytes(s['durable'])}" for s in job["streams"] if s["kind"] != "stdin"
        )
        table.add_row(job["job_id"], job["host"] or "-", job_state_text(job, now), human_bytes(total),
                      f"{human_bytes(rate)}/s", ago(job["last_seen"], now), streams)
    if not rows:
        table.caption = "no jobs"
    return table


def job_detail(console: Console, job: dict[str, Any]) -> None:
    """`gcshadow jobs JOB`: everything the shadow knows of one job."""
    from rich.table import Table

    table = Table(title=f"job {job['job_id']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("state", job_state_text(job))
    for key in ("host", "user", "peer", "instance"):
        table.add_row(key, str(job.get(key) or "-"))
    table.add_row("command", " ".join(job["command"]) or "-")
    table.add_row("first seen", ago(job["first_seen"]))
    table.add_row("last seen", ago(job["last_seen"]))
    if job.get("reason"):
        table.add_row("reason", job["reason"])
    for s in job["streams"]:
        table.add_row(s["kind"], f"{s['name']}  {s['durable']} bytes")
    for key, value in (job.get("summary") or {}).items():
        table.add_row(f"summary {key}", str(value))
    console.print(table)


def summary_lines(job_id: str, job_status: int | None, summary: dict[str, Any]) -> list[str]:
    """The I/O summary gcwrap prints on its own stderr when it exits."""
    status = "unknown status" if job_status is None else f"status {job_status}"
    streams = [
        f"{key[:-6]} {human_bytes(value)}" for key, value in summary.items() if key.endswith("_bytes")
    ]
    return [
        f"job {job_id} ended with {status}; wall {summary.get('wall_s', 0):.1f} s",
        "  output: " + (", ".join(streams) or "none") + f"; {summary.get('throughput_mb_s', 0):.1f} MB/s",
        f"  connected {summary.get('connected_s', 0):.1f} s, disconnected {summary.get('disconnected_s', 0):.1f} s, "
        f"job paused {summary.get('paused_s', 0):.1f} s",
        f"  {summary.get('connections', 0)} connection(s), {summary.get('reconnects', 0)} reconnect(s), "
        f"{summary.get('failed_attempts', 0)} failed connection attempt(s) in all",
    ]


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

    def summary(self, job_id: str, job_status: int | None, summary: dict[str, Any]) -> None:
        if self.fmt == "json":
            self.say("I/O summary", "info", job_id=job_id, job_status=job_status, summary=summary)
        else:
            for line in summary_lines(job_id, job_status, summary):
                self.say(line)
