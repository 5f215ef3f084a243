"""A job page's live event stream (`/api/jobs/JOB/events` of `gcshadow web`).

One server-sent event stream per open job page: the job's record whenever
it changes, its timeline when it changes, and each output stream's bytes as
they become durable, read from the file at the stream's offset (never the
whole file again). Where a stream starts: the offsets a reconnecting
EventSource sends back (Last-Event-ID), else those of the query, else the
line the page asked for (`stdout_line=120`, then `tail` bytes from there),
else the last `tail` bytes. A page that falls further behind than it could
show is skipped ahead to the tail, once; a tail is sent once, however large.

Each `data` event says the number of the line its first byte is on (when
it can be counted cheaply: see webstate.Lines), so a page numbers lines as
the file does, and its id holds the offsets, so a reconnecting page resumes
byte-exact.
"""

from __future__ import annotations

import codecs
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qsl, quote

import trio

from .webstate import Lines, StateReader, Unservable, open_served, tail_start

HEARTBEAT = 15.0  # seconds between comments on an idle event stream: finds clients that left
CHUNK = 64 * 1024  # bytes per data event
CATCH_UP = 1 << 20  # bytes sent per stream before other work gets a turn
FAR_BEHIND = 4 << 20  # a stream this far (or more than its tail) ahead of a page: skip to its tail
MAX_TAIL = 16 << 20


class Source(Protocol):
    """What a live stream needs of the web view."""

    state: StateReader
    changed: trio.Event  # set (and replaced) whenever the state changed
    root_fd: int
    line_limiter: trio.CapacityLimiter  # counts lines in files, one at a time


def event(name: str, data: Any, event_id: str | None = None) -> bytes:
    lines = [f"event: {name}", f"data: {json.dumps(data, separators=(',', ':'))}"]
    if event_id is not None:
        lines.insert(0, f"id: {event_id}")
    return ("\n".join(lines) + "\n\n").encode()


@dataclass
class Plan:
    """Where a page's streams start, from its request."""

    tail: int  # bytes of each stream shown on open
    offsets: dict[str, int]  # stream kind -> the byte to start at
    lines: dict[str, int]  # stream kind -> the line to start at

    @classmethod
    def parse(cls, query: dict[str, str], last_event_id: str, default_tail: int, instance: str) -> Plan:
        """ValueError if a number is not one."""
        resumed = dict(parse_qsl(last_event_id))
        given = resumed or query
        tail = min(max(int(query.get("tail", default_tail // 1024)), 0) * 1024, MAX_TAIL)
        offsets = {k: max(int(v), 0) for k, v in given.items() if k not in ("tail", "instance")
                   and not k.endswith("_line")}
        lines = {} if resumed else {k[:-5]: max(int(v), 1) for k, v in query.items() if k.endswith("_line")}
        if given.get("instance", instance) != instance:
            offsets = {}  # a new attempt since the page last saw the job: its files started afresh
        return cls(tail, offsets, lines)


@dataclass
class Followed:
    """One output stream as a job page sees it."""

    kind: str
    stream: int
    name: str
    offset: int | None  # the next byte to send; None: where the plan says
    line: int | None = None  # the number of the line `offset` is on, when known
    numbered: bool = False  # `line` was worked out (it may still be None: too far to count)
    wanted_line: int | None = None  # start at this line
    window: int = 0  # not skipped ahead before this offset (what the page asked to see)
    fd: int = -1
    refused: str = ""
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def restart(self, offset: int, line: int | None) -> None:
        self.offset, self.line, self.numbered = offset, line, True
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")


def _streams(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in job["streams"] if s["kind"] != "stdin"]


class LiveStream:
    """One page's event stream, sent through `send` until the job ended and every byte was sent."""

    def __init__(self, src: Source, job_id: str, plan: Plan, send: Callable[[bytes], Awaitable[None]]) -> None:
        self.src, self.job_id, self.tail, self.send = src, job_id, plan.tail, send
        job = src.state.jobs[job_id]
        self.instance: str = job["instance"]
        self.streams = [Followed(s["kind"], s["stream"], s["name"], plan.offsets.get(s["kind"]),
                                 wanted_line=plan.lines.get(s["kind"])) for s in _streams(job)]

    def close(self) -> None:
        for f in self.streams:
            f.close()

    async def run(self) -> None:
        self.src.state.watching += 1
        try:
            await self._run()
        finally:
            self.src.state.watching -= 1

    async def _run(self) -> None:
        state = self.src.state
        await self.send(b"retry: 2000\n\n" + event("hello", {"tail": self.tail}))
        shown: tuple[Any, ...] = ()  # the job's record as last sent
        shown_sizes: dict[str, int] = {}
        shown_at = 0.0
        shown_timeline: list[dict[str, Any]] = []
        while True:
            changed = self.src.changed
            job = state.jobs.get(self.job_id)
            if job is None:
                await self.send(event("gone", {"job_id": self.job_id}))
                return
            if job["instance"] != self.instance:  # a new attempt started the files afresh
                self.instance = job["instance"]
                self.close()
                self.streams[:] = [Followed(s["kind"], s["stream"], s["name"], 0) for s in _streams(job)]
                await self.send(event("reset", {"instance": self.instance}))
            sizes = {s["kind"]: s["durable"] for s in _streams(job)}
            record = (tuple(v for k, v in job.items() if k not in ("streams", "events")), state.why(self.job_id))
            now = time.monotonic()
            # The record when it changes; its byte counts and rates about once a second while they move.
            if record != shown or (sizes != shown_sizes and now - shown_at >= 1):
                shown, shown_sizes, shown_at = record, sizes, now
                # encoded once for every page that shows the job
                await self.send(b"event: job\ndata: " + state.job_json(self.job_id, timeline=False) + b"\n\n")
            timeline = state.timeline(self.job_id)
            if timeline != shown_timeline:
                shown_timeline = timeline
                await self.send(event("timeline", {"events": timeline}))
            more = False
            for f in self.streams:
                more |= await self._send_new(f, sizes.get(f.kind, 0))
            if more:
                await trio.lowlevel.checkpoint()
                continue
            if job["state"] == "finished" and all(f.refused or f.offset == sizes.get(f.kind, 0)
                                                  for f in self.streams):
                await self.send(event("end", {"job_id": self.job_id}, self._event_id()))
                return
            wait = 1.0 if sizes != shown_sizes else HEARTBEAT
            with trio.move_on_after(wait):
                await changed.wait()
                continue
            if wait == HEARTBEAT:
                await self.send(b": ping\n\n")

    async def _send_new(self, f: Followed, durable: int) -> bool:
        """Send what of `f` became durable since its offset (at most CATCH_UP
        bytes); True if more is waiting."""
        if f.refused:
            return False
        if f.fd < 0:
            if durable == 0 and f.offset in (None, 0):
                f.restart(0, 1)
                return False  # nothing to show yet: the file may not exist
            try:
                f.fd = open_served(self.src.root_fd, f.name)
            except Unservable as e:
                f.refused = str(e)
                await self.send(event("refused", {"stream": f.kind, "reason": str(e)}))
                return False
        lines = self.src.state.lines_of(self.job_id, f.kind, self.instance)
        if f.offset is None:
            await self._start(f, lines, durable)
        if f.offset is not None and f.offset > durable:  # cut back (a torn tail after a crash): start afresh
            lines.cut(durable)
            f.restart(0, 1)
            await self.send(event("reset", {"stream": f.kind}))
        if not f.numbered:  # a page that resumes at an offset
            f.restart(f.offset or 0, await self._count(lines.line_at, f.fd, f.offset or 0))
        assert f.offset is not None
        if durable - f.offset > max(FAR_BEHIND, self.tail) and f.offset >= f.window:
            start = tail_start(f.fd, durable, self.tail)
            if start > f.offset:  # only ever forward: a tail is sent once
                await self._skip(f, lines, start)
        budget = CATCH_UP
        stop = durable if f.offset >= f.window else min(durable, f.window)
        while f.offset < stop and budget > 0:
            data = os.pread(f.fd, min(CHUNK, stop - f.offset, budget), f.offset)
            if not data:
                return False  # shorter than the state says (cut at home): nothing more to send
            start, line = f.offset, f.line
            f.offset += len(data)
            budget -= len(data)
            if f.line is not None:
                f.line += data.count(b"\n")
            text = f.decoder.decode(data)
            await self.send(event("data", {"stream": f.kind, "offset": start, "end": f.offset, "line": line,
                                           "text": text}, self._event_id()))
        return f.offset < durable

    async def _start(self, f: Followed, lines: Lines, durable: int) -> None:
        """Where a page that gave no offset starts: at the line it asked for
        (then `tail` bytes from there before any skip ahead), else at the tail."""
        start = None
        if f.wanted_line is not None:
            start = await self._count(lines.offset_of, f.fd, f.wanted_line, durable)
            if start is not None:
                f.window = start + self.tail
        if start is None:
            start = tail_start(f.fd, durable, self.tail)
        f.restart(0, 1)
        if start:
            await self._skip(f, lines, start)

    async def _skip(self, f: Followed, lines: Lines, to: int) -> None:
        line = await self._count(lines.line_at, f.fd, to)
        await self.send(event("skip", {"stream": f.kind, "from": f.offset, "to": to, "line": line}))
        f.restart(to, line)

    async def _count(self, fn: Callable[..., int | None], *args: int) -> int | None:
        """Count lines in a worker thread: a large file takes a while."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self.src.line_limiter)

    def _event_id(self) -> str:
        """Where a job page is: what a reconnecting EventSource sends back as Last-Event-ID."""
        pairs = [(f.kind, str(f.offset or 0)) for f in self.streams]
        return "&".join(f"{quote(k)}={v}" for k, v in [*pairs, ("instance", quote(self.instance, safe=""))])
