"""`gcshadow tail`: print jobs' output from the shadow's files, and follow it.

Like tail(1) and condor_tail, it may start at the last N lines (`lines`) or
bytes (`nbytes`) of each stream rather than at its first byte: found
by reading the file backwards from its end, a block at a time.

Following polls the files' sizes every POLL seconds (20 ms: far below what a
person notices, and cheap: one fstat per file) and the shadow's state every
STATE_POLL seconds to learn which jobs have ended. A job's stream is done when
the job is finished and every byte up to its final length has been printed.

A file the job writes (--file) is followed by its NAME, as `tail -F`
follows a name: a new version of the file is renamed over NAME at its
commit, so when NAME is another file than the one being read, what is left
of the old one is printed, `notice` says so (on stderr), and the new
version is printed from its first byte. It is done when the job is finished
and NAME's committed content is printed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .backends import read_jobs

POLL = 0.02
STATE_POLL = 0.25


@dataclass
class Followed:
    """One output `gcshadow tail` follows: its file, how far it was read, and its unfinished line."""

    job_id: str
    kind: str
    path: Path
    prefix: bytes = b""
    offset: int = 0
    fd: int | None = None
    pending_line: bytes = b""
    done: bool = False
    final_length: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    lines: int | None = None  # start at the last `lines` lines, or...
    nbytes: int | None = None  # ...the last `nbytes` bytes (when the file is first opened)
    by_name: bool = False  # a file the job writes: NAME may be replaced by a new version (followed)


STREAMS = ("stdout", "stderr", "all")


def _file_named(job: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The job's file (--file) at NAME, as the job named it (under its identity's directory, where there is one)."""
    owner = job.get("owner") or ""
    return next((f for f in job.get("files") or () if f["name"] in (name, f"{owner}/{name}")), None)


def _select(jobs: list[dict[str, Any]], job: str | None, stream: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out = []
    for j in jobs:
        if job is not None and j["job_id"] != job:
            continue
        if stream not in STREAMS:
            if (f := _file_named(j, stream)) is not None:
                out.append((j, {"kind": stream, "name": f["name"], "durable": f["bytes"], "file": True}))
            continue
        for st in j["streams"]:
            if st["kind"] == "stdin":
                continue
            if stream == "all" or st["kind"] == stream:
                out.append((j, st))
    return out


def _emit(f: Followed, data: bytes, write: Callable[[bytes], None]) -> None:
    if not f.prefix:
        write(data)
        return
    # Prefix whole lines; keep a partial last line until it ends.
    data = f.pending_line + data
    lines = data.split(b"\n")
    f.pending_line = lines.pop()
    if lines:
        write(b"".join(f.prefix + line + b"\n" for line in lines))


BACK_READ = 1 << 16  # bytes read at a time, backwards, to find where the last lines start


def start_offset(fd: int, lines: int | None, nbytes: int | None, step: int = BACK_READ) -> int:
    """Where the last `lines` lines (a last line without its newline counts)
    or the last `nbytes` bytes of the file begin; 0 for neither. `step`:
    bytes read at a time, backwards."""
    size = os.fstat(fd).st_size
    if nbytes is not None:
        return max(0, size - nbytes)
    if lines is None:
        return 0
    if lines == 0:
        return size
    end = size - 1 if size and os.pread(fd, 1, size - 1) == b"\n" else size  # (the last line's own newline)
    need = lines
    while end > 0:
        start = max(0, end - step)
        block = os.pread(fd, end - start, start)
        at = len(block)
        while need:
            at = block.rfind(b"\n", 0, at)
            if at < 0:
                break
            need -= 1
        if not need:
            return start + at + 1
        end = start
    return 0


def _replaced(f: Followed) -> bool:
    """Whether NAME is now another file than the one read (a new version renamed over it)."""
    try:
        st = os.stat(f.path)
    except OSError:
        return False
    return f.fd is not None and not os.path.samestat(st, os.fstat(f.fd))


def _drain(f: Followed, write: Callable[[bytes], None], notice: Callable[[str], None]) -> None:
    if f.by_name and _replaced(f):
        _drain_fd(f, write)  # (what is left of the old version)
        assert f.fd is not None
        os.close(f.fd)
        f.fd, f.offset = None, 0
        if f.pending_line:
            write(f.prefix + f.pending_line + b"\n")
            f.pending_line = b""
        notice(f"{f.kind} of job {f.job_id} was replaced by a new version: following it from its start")
        f.lines = f.nbytes = None  # (the new version is printed whole)
    if f.fd is None:
        try:
            f.fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        if f.lines is not None or f.nbytes is not None:
            f.offset = start_offset(f.fd, f.lines, f.nbytes)
    if os.fstat(f.fd).st_size < f.offset:
        # A new attempt of the job started the file afresh: follow it from the top.
        write(f.prefix + b"--- file restarted by a new attempt of the job ---\n")
        f.offset, f.pending_line = 0, b""
    _drain_fd(f, write)


def _drain_fd(f: Followed, write: Callable[[bytes], None]) -> None:
    assert f.fd is not None
    while True:
        data = os.pread(f.fd, 1 << 16, f.offset)
        if not data:
            return
        f.offset += len(data)
        _emit(f, data, write)


def tail(
    root: Path,
    job: str | None,
    stream: str,
    out: IO[bytes],
    *,
    follow: bool,
    prefix: bool,
    timeout: float | None = None,
    state_url: str = "",
    lines: int | None = None,
    nbytes: int | None = None,
    notice: Callable[[str], None] = lambda text: None,
) -> int:
    """Print (and with `follow`, follow) the selected streams (`state_url`: the
    --state URL, "" for the root's own), each from its last `lines` lines or
    `nbytes` bytes if given; `stream` is stdout, stderr, all, or the NAME of
    a file the job writes (followed by name: `notice` says when a new
    version replaced it). Returns the number of streams printed; raises
    LookupError when nothing matches."""
    state = {j["job_id"]: j for j in read_jobs(state_url, root, job=job, events=0)}
    selected = _select(list(state.values()), job, stream)
    if not selected and not (follow and job is None):
        what = f"a {stream} stream" if stream in STREAMS else f"a stream or file named {stream!r}"
        raise LookupError(f"no job {job!r} with {what} at this shadow" if job else "no jobs at this shadow")

    def write(data: bytes) -> None:
        out.write(data)
        out.flush()

    followed: dict[tuple[str, str], Followed] = {}

    def refresh(jobs: dict[str, dict[str, Any]]) -> None:
        for j, st in _select(list(jobs.values()), job, stream):
            key = (j["job_id"], st["kind"])
            if key not in followed:
                tag = f"[{j['job_id']} {st['kind']}] ".encode() if prefix else b""
                followed[key] = Followed(j["job_id"], st["kind"], root / st["name"], tag, lines=lines, nbytes=nbytes,
                                         by_name=bool(st.get("file")))
            f = followed[key]
            if j["state"] == "finished":
                f.final_length = st["durable"]

    refresh(state)
    deadline = None if timeout is None else time.monotonic() + timeout
    next_state = time.monotonic() + STATE_POLL
    try:
        while True:
            for f in followed.values():
                if not f.done:
                    _drain(f, write, notice)
                    if not follow or (f.final_length is not None and f.offset >= f.final_length
                                      and not (f.by_name and _replaced(f))):
                        f.done = True
                        if f.pending_line:
                            write(f.prefix + f.pending_line + b"\n")
                            f.pending_line = b""
            if not follow:
                break
            if followed and all(f.done for f in followed.values()) and job is not None:
                break
            now = time.monotonic()
            if deadline is not None and now > deadline:
                break
            if now >= next_state:
                refresh({j["job_id"]: j for j in read_jobs(state_url, root, job=job, events=0)})
                next_state = now + STATE_POLL
            time.sleep(POLL)
    finally:
        for f in followed.values():
            if f.fd is not None:
                os.close(f.fd)
    return len(followed)
