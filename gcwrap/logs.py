"""Logging to stderr, for gcwrap and gcshadow: a module of its own, light,
so that gcwrap sets it up before it starts the job (see agent/launch.py)
without loading the rest of the rendering code.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


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


# The fields a log record may carry (`log.warning(..., extra={"peer": ...})`),
# each a key of its JSON line when it has a value: what a collector filters on.
FIELDS = ("peer", "identity", "job", "stream", "code")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"time": round(record.created, 3), "level": record.levelname.lower(),
                                "logger": record.name, "message": record.getMessage()}
        for name in FIELDS:
            value = getattr(record, name, None)
            if value not in (None, ""):
                line[name] = value
        if record.exc_info:  # (one line still: the traceback is a field of it)
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line)


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
