"""What `gcwrap status` reports: every spool in a directory, read-only."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from .agent.spool import Spool, SpoolError, spool_files
from .agent.spoolfiles import SpoolFiles


def in_use(path: Path) -> bool:
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


FINAL_STATES = ("exited", "delivered", "gave-up", "refused")


def state_text(state: str, exit_code: int | None, exit_signal: int | None, active: bool) -> str:
    """running / paused / exited N / killed by signal N / gave-up, job ... / wrapper gone."""
    if not active and state in ("running", "paused", "starting"):
        return "wrapper gone"
    if state in FINAL_STATES and (exit_code is not None or exit_signal):
        how = f"killed by signal {exit_signal}" if exit_signal else f"exited {exit_code}"
        return how if state in ("exited", "delivered") else f"{state}, job {how}"
    return state


def read_live(path: Path) -> dict[str, Any] | None:
    """The agent's live status file beside the spool, if readable."""
    try:
        data = Path(f"{path}.live").read_bytes().strip(b" \0")
        live = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return live if isinstance(live, dict) else None


def ack_age(live: dict[str, Any], now: float) -> float | None:
    """Seconds for which output has waited with nothing acknowledged by home
    (the age of the last acknowledgement while output is pending), as the
    live view tells it; None when nothing waits."""
    since = live.get("waiting_since")
    if not isinstance(since, (int, float)) or isinstance(since, bool):
        return None
    return round(max(0.0, now - since), 3)


def _overlay(info: dict[str, Any], live: dict[str, Any]) -> None:
    """A live wrapper knows better than its last commit (which a full disk
    may have refused): take its state, connection, errors and counts."""
    info["connected"] = bool(live.get("connected"))
    info["last_error"] = live.get("last_error") or live.get("disk_error") or info["last_error"]
    info["retries"] = max(int(live.get("retries") or 0), int(info.get("retries") or 0))
    info["live_at"] = live.get("t")
    info["last_ack_age_s"] = ack_age(live, time.time())
    info["shadow_in_use"] = live.get("shadow") or info["shadow_in_use"]
    info["failovers"] = max(int(live.get("failovers") or 0), int(info["failovers"]))
    if isinstance(live.get("wire"), dict):
        info["wire"] = live["wire"]  # this run's output on the wire: job bytes, wire bytes, compressed
    by_id = {str(s["id"]): s for s in info["streams"]}
    for sid, ls in (live.get("streams") or {}).items():
        st = by_id.get(sid)
        if st is None or not isinstance(ls, dict):
            continue
        st["appended"] = max(st["appended"], int(ls.get("written", 0)))
        st["written"] = max(st["written"], st["appended"])
        st["acked"] = max(st["acked"], int(ls.get("acked", 0)))
        st["pending"] = st["appended"] - st["acked"]
        st["memory_only"] = int(ls.get("memory_only", 0))
        since = ls.get("memory_since")  # output the spool could not take is pending too
        if isinstance(since, (int, float)) and st["pending"] and st["memory_only"]:
            age = round(time.time() - since, 3)
            st["oldest_pending_s"] = max(age, st["oldest_pending_s"] or 0.0)


def read_spool(path: Path) -> dict[str, Any]:
    spool = Spool.open(path, readonly=True)
    try:
        job = spool.job()
        streams = spool.streams()
        size = spool.file_size()
        oldest = spool.oldest_pending()
        files = spool_files_view(SpoolFiles(spool))
    finally:
        spool.close()
    active = in_use(path)
    live = read_live(path) if active else None
    final = None
    if not active and job.state in ("running", "paused", "starting"):
        # The wrapper is gone without its final commit: on a full disk it may
        # have been refused. The live file (rewritten in place, no new blocks)
        # got the final state just before: trust it when it has one.
        last = read_live(path)
        if last and last.get("state") in FINAL_STATES:
            final = last
    # A live wrapper's view is newer than its last commit (which a full disk may refuse).
    newer = live or final or {}
    exit_code = job.exit_code if job.exit_code is not None else newer.get("exit_code")
    exit_signal = job.exit_signal or newer.get("exit_signal")
    shown = newer.get("state", job.state) if newer else job.state
    state = state_text(shown, exit_code, exit_signal, active)
    now = time.time()
    try:
        st = os.statvfs(path.parent)
        free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    info = {
        "spool": str(path),
        "job_id": job.job_id,
        "instance": job.instance,
        "command": job.command,
        "host": job.host,
        "shadow": job.shadow,
        # Of several shadows, the one that took the output last, and how often gcwrap moved to another.
        "shadow_in_use": str(job.summary.get("shadow") or ""),
        "failovers": int(job.summary.get("failovers") or 0),
        "state": state,
        "active": active,
        "wrapper_pid": job.wrapper_pid,
        "child_pid": job.child_pid,
        "started": job.started,
        "ended": job.ended,
        "exit_code": exit_code,
        "exit_signal": exit_signal,
        "connected": job.connected and active,
        "last_error": (final or {}).get("last_error") or job.last_error,
        "retries": max(job.retries, int((final or {}).get("retries") or 0)),
        "reason": (final or {}).get("reason") or job.reason,
        "spool_bytes": size,
        "disk_free": free,
        "last_ack_age_s": None,  # (a running wrapper's live view tells it)
        "streams": [
            {"id": s.id, "kind": s.kind, "name": s.name, "appended": s.appended, "acked": s.acked,
             "pending": s.pending, "eof": s.eof,
             "oldest_pending_s": round(now - oldest[s.id], 3) if s.id in oldest and s.pending else None,
             # What the job wrote past what the spool holds, held only in memory when the run ended.
             "written": s.written if s.written is not None else s.appended,
             "lost": s.lost, "lost_from": s.appended}
            for s in streams.values() if s.kind != "stdin"
        ],
    }
    info["files"] = _live_files(files, read_live(path) or {}) if files else []
    if live:
        _overlay(info, live)
    elif final:
        # The spool refused the final record, which says what was lost: the live file has it.
        _final_loss(info, final)
    return info


def spool_files_view(recorded: SpoolFiles) -> list[dict[str, Any]]:
    """The job's files (--file) as the spool records them: for each, its
    newest version, how far it was sent and acknowledged, and the size home
    holds committed (-1: none). The spool records how far a version went at
    its commits, and knows nothing of a file deleted or unreadable: the
    live status file says more (`_live_files`)."""
    out = []
    for handle, f in recorded.files().items():
        versions = recorded.versions(handle)
        newest = versions[-1] if versions else None
        done = [v for v in versions if v.committed is not None]
        committed = done[-1].committed if done and done[-1].committed is not None else -1
        size = max(newest.sent, newest.size or 0) if newest else 0
        state = "committed" if newest is not None and newest.committed == size else "live"
        out.append({"file": handle, "path": f.path, "name": f.name, "version": newest.version if newest else 0,
                    "size": size, "sent": newest.sent if newest else 0, "acked": newest.acked if newest else 0,
                    "committed": committed, "state": state})
    return out


def _live_files(files: list[dict[str, Any]], live: dict[str, Any]) -> list[dict[str, Any]]:
    """The spool's view of the files, with what the agent's live status file
    says of them (`FileSender.live`: figures as of its last look, whether a
    file is gone or unreadable), where it tells of the same version or a newer one."""
    by_handle = {f["file"]: f for f in files}
    for row in live.get("files") or ():
        if not isinstance(row, list) or len(row) != 7 or not all(isinstance(x, int) for x in row[:6]):
            continue
        f = by_handle.get(row[0])
        if f is not None and row[1] >= f["version"]:
            f.update(version=row[1], size=row[2], sent=row[3], acked=row[4], state=str(row[6]))
            if row[5] >= 0:  # (-1: this version is not committed yet; home holds the one the spool says)
                f["committed"] = row[5]
    return files


def _final_loss(info: dict[str, Any], final: dict[str, Any]) -> None:
    by_id = {str(s["id"]): s for s in info["streams"]}
    for sid, ls in (final.get("streams") or {}).items():
        st = by_id.get(sid)
        if st is not None and isinstance(ls, dict) and int(ls.get("lost") or 0) and not st["lost"]:
            st["written"] = int(ls.get("written", 0))
            st["lost"] = int(ls["lost"])
            st["lost_from"] = st["written"] - st["lost"]


def read_spools(directory: Path) -> list[dict[str, Any]]:
    out = []
    paths = spool_files(directory)
    for live_path in sorted(directory.glob("*.spool.live")) if directory.is_dir() else []:
        spool_path = live_path.with_name(live_path.name[: -len(".live")])
        if spool_path.exists():
            continue
        # The disk refused even the spool: only the live view tells of this job.
        live = read_live(spool_path)
        if live:
            active = in_use(live_path)
            state = state_text(live.get("state", "?"), live.get("exit_code"), live.get("exit_signal"), active)
            out.append({"spool": str(spool_path), "job_id": live_path.name.rsplit("-", 1)[0], "state": state,
                        "active": active, "reason": live.get("reason", ""), "exit_code": live.get("exit_code"),
                        "exit_signal": live.get("exit_signal"), "connected": bool(live.get("connected")), "shadow": "",
                        "last_ack_age_s": ack_age(live, time.time()) if active else None,
                "last_error": live.get("disk_error") or live.get("last_error", ""), "retries": live.get("retries", 0),
                "streams": [{"id": int(k), "kind": {"1": "stdout", "2": "stderr"}.get(k, k), "name": "",
                             "appended": v.get("written", 0), "acked": v.get("acked", 0),
                             "pending": v.get("written", 0) - v.get("acked", 0),
                             "memory_only": v.get("memory_only", 0), "written": v.get("written", 0),
                             "lost": v.get("lost", 0), "lost_from": v.get("written", 0) - v.get("lost", 0)}
                            for k, v in live.get("streams", {}).items()]})
    for path in paths:
        try:
            out.append(read_spool(path))
        except (SpoolError, OSError) as e:
            error = str(e) if isinstance(e, SpoolError) else f"spool {path}: cannot be read ({e.strerror or e})"
            out.append({"spool": str(path), "job_id": "?", "state": "unreadable", "last_error": error,
                        "streams": [], "shadow": "", "connected": False})
    return out
