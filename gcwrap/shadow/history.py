"""`gcshadow jobs` as sacct: which jobs a listing shows.

`select` keeps the jobs of the given statuses (`why.STATUSES`), active
since a time, of the given users and hosts (shell patterns). `parse_since`
reads --since: a duration back from now (90s, 30m, 2h, 1d, 1w, 1h30m) or a
time (14:00 today, 2026-11-23, 2026-11-23 14:00, ISO 8601).
"""

from __future__ import annotations

import datetime
import fnmatch
import re
from collections.abc import Iterable
from typing import Any

from .why import status

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float) -> float:
    """The Unix time --since names; ValueError if it names none."""
    given = text.strip()
    if re.fullmatch(r"(\d+(\.\d+)?[smhdw])+", given):
        back = sum(float(n) * _UNITS[unit] for n, _, unit in re.findall(r"(\d+(\.\d+)?)([smhdw])", given))
        return now - back
    if re.fullmatch(r"\d{1,2}:\d{2}(:\d{2})?", given):
        today = datetime.datetime.fromtimestamp(now).date().isoformat()
        given = f"{today}T{given}"
    try:
        when = datetime.datetime.fromisoformat(given)
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration (90s, 30m, 2h, 1d, 1h30m) nor a time "
                         "(14:00, 2026-11-23, 2026-11-23 14:00)") from None
    return when.timestamp()  # (a time without a zone is local)


def last_active(job: dict[str, Any]) -> float:
    """When the job was last seen doing anything."""
    return max(job.get(k) or 0.0 for k in ("first_seen", "last_seen", "ended", "heard"))


def select(jobs: Iterable[dict[str, Any]], now: float, *, statuses: Iterable[str] = (), since: float | None = None,
           users: Iterable[str] = (), hosts: Iterable[str] = ()) -> list[dict[str, Any]]:
    """The jobs that pass every filter given (an empty one passes all)."""
    statuses, users, hosts = set(statuses), list(users), list(hosts)
    return [j for j in jobs
            if (not statuses or status(j, now) in statuses)
            and (since is None or last_active(j) >= since)
            and (not users or any(fnmatch.fnmatchcase(j.get("user") or "", u) for u in users))
            and (not hosts or any(fnmatch.fnmatchcase(j.get("host") or "", h) for h in hosts))]
