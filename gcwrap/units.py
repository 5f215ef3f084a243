"""Sizes as people write them (8MiB, 100MB, 4096) and as they read them
(1.5 MiB); durations and times past in words (14 min, 3m ago).

Both sides use these: logic in its log lines and messages (the agent, the
shadow's why.py), the face in its tables (render.py). It imports nothing of
the package, so any module may import it.
"""

from __future__ import annotations

import re
import time

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """The bytes a size says: 4096, 8MiB, 100MB, 1.5G (ValueError if none)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size like 4096, 8MiB or 100MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_bytes(n: float) -> str:
    """A size as people read it, in binary units: 512 B, 1.5 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def span(seconds: float) -> str:
    """A duration as people say it: 12 s, 14 min, 3.2 h."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def ago(t: float | None, now: float | None = None) -> str:
    """How long ago `t` was, in a table's few letters: 42s ago, 14m ago, 3.2h ago ("-": never)."""
    if not t:
        return "-"
    s = max(0.0, (now or time.time()) - t)
    if s < 60:
        return f"{s:.0f}s ago"
    if s < 3600:
        return f"{s / 60:.0f}m ago"
    return f"{s / 3600:.1f}h ago"
