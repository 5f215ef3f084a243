"""Why a job looks the way it does, in one line, from what the state holds
of it: pure functions of a job (as `backends.read_jobs` gives it, with its
`events` and `home`) and the time now.

`status` sorts a job into one of STATUSES (what `gcshadow jobs --status`
filters on); `why` says it in words:

    streaming
    quiet: connected, heartbeats answered, the job writes nothing for 12 s
    stalled: nothing acknowledged for 12 s (nothing heard from the agent)
    disconnected since 14:02:03 (connection lost: reset by peer); the agent last said: paused (...)
    refused: authentication failed: wrong token [AUTH_FAILED]
    home short of disk: 10.0 MiB free, --min-free 64.0 MiB
    finished with status 0
"""

from __future__ import annotations

import time
from typing import Any

from ..units import human_bytes, span

STATUSES = ("streaming", "quiet", "stalled", "disconnected", "refused", "finished", "failed")
QUIET_AFTER = 5.0  # seconds without new output before a connected job counts as quiet
# Seconds without a word from a connected agent (it sends a heartbeat every
# 5 s by default, and the shadow stamps `heard` every HEARD_EVERY) before its job counts as stalled.
STALLED_AFTER = 20.0


def status(job: dict[str, Any], now: float) -> str:
    """One of STATUSES."""
    state = job.get("state")
    if state == "finished":
        return "finished" if job.get("exit_code") == 0 and not job.get("exit_signal") else "failed"
    if state == "streaming":
        data = job.get("last_seen") or 0.0
        if now - data < QUIET_AFTER:
            return "streaming"
        return "quiet" if now - max(data, job.get("heard") or 0.0) < STALLED_AFTER else "stalled"
    return "refused" if _refusal(job) is not None else "disconnected"


def why(job: dict[str, Any], now: float) -> str:
    """One line: why the job looks the way it does (see the module's examples)."""
    kind = status(job, now)
    if kind in ("finished", "failed"):
        return _ended(job)
    data = job.get("last_seen") or now
    if kind == "streaming":
        return "streaming"
    if kind == "quiet":
        return f"quiet: connected, heartbeats answered, the job writes nothing for {span(now - data)}"
    if kind == "stalled":
        heard = max(data, job.get("heard") or 0.0)
        return (f"stalled: nothing acknowledged for {span(now - data)} "
                f"(nothing heard from the agent for {span(now - heard)})")
    home = job.get("home")
    if home:
        return f"home short of disk: {human_bytes(home['free'])} free, --min-free {human_bytes(home['min_free'])}"
    refusal = _refusal(job)
    if refusal is not None:
        d = refusal["details"]
        return f"refused: {d.get('message', '')} [{d.get('code', '')}]"
    return _disconnected(job, now)


def _ended(job: dict[str, Any]) -> str:
    reason = f" ({job['reason']})" if job.get("reason") else ""
    if job.get("exit_signal"):
        return f"killed by signal {job['exit_signal']}{reason}"
    if job.get("exit_code") is None:
        return f"finished, status unknown{reason}"
    return f"finished with status {job['exit_code']}{reason}"


def _refusal(job: dict[str, Any]) -> dict[str, Any] | None:
    """The job's latest event, when it is a refusal at home (no session since)."""
    mine = [e for e in job.get("events") or () if e["source"] == "shadow"]
    return mine[-1] if mine and mine[-1]["kind"] == "refused" else None


def _disconnected(job: dict[str, Any], now: float) -> str:
    """Since when the connection last worked, how it ended, and what the agent said last."""
    events = job.get("events") or ()
    ended = next((e for e in reversed(events) if e["kind"] == "session_ended"), None)
    since = job.get("last_seen") or now
    how = ""
    if ended is not None:
        since = ended["details"].get("heard") or ended["time"]
        how = f" ({ended['details'].get('reason', '')})" if ended["details"].get("reason") else ""
    text = f"disconnected since {clock(since, now)}{how}"
    said = next((e for e in reversed(events) if e["source"] == "agent"), None)
    if said is not None:
        words = said["details"].get("reason") or said["details"].get("message") or ""
        text += f"; the agent last said: {said['kind']}" + (f" ({words})" if words else "")
    return text


def clock(t: float, now: float) -> str:
    """A time of day, with its date when it is not today."""
    day = "%Y-%m-%d " if time.localtime(t)[:3] != time.localtime(now)[:3] else ""
    return time.strftime(f"{day}%H:%M:%S", time.localtime(t))
