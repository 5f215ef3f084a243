"""A job's streams as the wire protocol names them: ids, kinds, `StreamSpec`.

Apart from events.py (which re-exports them) so that a run can name its
streams before its job starts without making every event's dataclass first.
"""

from __future__ import annotations

from dataclasses import dataclass

# Stream ids the agent uses. The protocol carries any id 0..255; these are the
# conventional ones so logs and state read the same everywhere.
STDOUT, STDERR, STDIN = 1, 2, 0

STREAM_KINDS = ("stdout", "stderr", "stdin")


@dataclass(frozen=True)
class StreamSpec:
    """One stream of a job: its id on the wire, its kind and its NAME at home."""

    id: int
    kind: str  # one of STREAM_KINDS
    name: str
