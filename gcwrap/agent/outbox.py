"""The outbox: the agent's in-memory view of its streams, the one owner of
their progress (no I/O, no SQLite; trio only for the "changed" signal).

`Outbox` holds every output stream's `OutStream`, the stdin feeder, the
job's end (the EXIT, once the job has ended) and the `changed` signal that
wakes the tasks sharing them. Figures shown to users (the summary, the
live view, the EXIT's lengths) are read from here, never kept twice.

For every output stream the agent tracks four offsets, always ordered

    acked <= read_end,   safe_end = max(spooled_end, acked) <= read_end

- `read_end`: bytes read from the job's pipe so far;
- `spooled_end`: every byte below it is committed to the spool (or acked);
- `acked`: every byte below it is durable at home;
- the sender's cursor, per connection, lives in the sender.

Bytes in [safe_end, read_end) are not yet recorded in the spool: they are
the bytes a full disk and a dead network together would lose, so the reader
stops reading the pipe when they exceed the memory limit (backpressure).
Bytes below safe_end may also be cached in memory so the sender need not
read them back from the spool; the cache is evicted first when memory is
tight.

`mem` holds, in stream order, `Chunk`s (bytes read into memory) and
`Extent`s (bytes spliced straight into their segment file, never in
memory: the bulk path, see gcwrap.agent.segments). An extent is unsafe too until
its row is committed, but it takes no memory.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..sync import Signal
from ..wire.events import Exit, StdinData, StreamSpec
from .records import Chunk, Extent

MAX_ROW = 256 << 10  # coalesce small pipe reads into spool rows / DATA frames up to this
JOIN_BELOW = MAX_ROW  # from memory, chunks smaller than this are joined into one frame
STDIN_PREFETCH = 1 << 20  # bytes of stdin fetched ahead of the job


class Mismatch(ValueError):
    """What home says contradicts what was read or sent: an ACK past the
    bytes sent to it (never from a sound shadow; and bytes acknowledged are
    bytes whose segment may be reused), or a WELCOME holding fewer bytes
    than it acknowledged or more than were written."""


@dataclass
class OutStream:
    """One output stream's bytes and offsets. `read_end` is written here
    only: by the pipe reader's `append`/`append_extent`, and by `restore`
    and `adopt` (a resumed spool, and what home holds beyond it)."""

    id: int
    kind: str
    name: str
    read_end: int = 0
    spooled_end: int = 0
    acked: int = 0
    eof: bool = False
    mem: deque[Chunk | Extent] = field(default_factory=deque)
    mem_bytes: int = 0
    arrivals: deque[tuple[int, float]] = field(default_factory=deque)  # (end offset, when read)
    ack_recorded: int = 0  # the acknowledgement the spool holds
    eof_recorded: bool = False  # the spool holds the stream's end

    @property
    def safe_end(self) -> int:
        return max(self.spooled_end, self.acked)

    @property
    def unsafe_bytes(self) -> int:
        """Bytes held only in memory (not spooled, not acked)."""
        return self.read_end - self.safe_end

    @property
    def delivered(self) -> bool:
        return self.eof and self.acked >= self.read_end

    # -- mutations -------------------------------------------------------

    def append(self, data: bytes, now: float = 0.0) -> Chunk:
        chunk = Chunk(self.id, self.read_end, data)
        self.mem.append(chunk)
        self.mem_bytes += len(data)
        self.read_end += len(data)
        self.arrivals.append((self.read_end, now))
        return chunk

    def append_extent(self, size: int, now: float = 0.0) -> Extent:
        """`size` bytes were spliced into the segment file at read_end."""
        extent = Extent(self.id, self.read_end, self.read_end + size)
        self.mem.append(extent)
        self.read_end += size
        self.arrivals.append((self.read_end, now))
        return extent

    def oldest_unsafe(self) -> float | None:
        """When the oldest byte held only in memory was read (None: there is none)."""
        return self.arrivals[0][1] if self.arrivals else None

    def _forget_safe(self) -> None:
        """Drop the read times of chunks now safe: `arrivals` holds only the
        unsafe ones, so it is bounded by the memory limit, not the job's life."""
        safe = self.safe_end
        arrivals = self.arrivals
        while arrivals and arrivals[0][0] <= safe:
            arrivals.popleft()

    def restore(self, appended: int, acked: int) -> None:
        """The offsets a spool left behind (gcwrap resume): every byte is in
        the spool, the stream has ended, and the spool holds both."""
        self.read_end = self.spooled_end = appended
        self.acked = self.ack_recorded = acked
        self.eof = self.eof_recorded = True

    def adopt(self, durable: int) -> None:
        """Home holds more than a resumed spool knows of (a wrapper killed
        between sending bytes and recording them): all of it is written and
        safe."""
        self.read_end = self.spooled_end = max(self.read_end, durable)

    def ack(self, offset: int, sent: int | None = None) -> bool:
        """Record the shadow's durable offset; True if it moved forward.
        Past `sent` (what this connection sent; default: every byte read)
        is Mismatch: the one check of it."""
        if sent is not None and offset > sent:
            raise Mismatch(f"the shadow acknowledged {offset} bytes of {self.kind}, but only {sent} were sent to it")
        if sent is None and offset > self.read_end:
            raise Mismatch(
                f"stream {self.kind}: shadow acknowledged {offset} bytes but only {self.read_end} were written"
            )
        if offset <= self.acked:
            return False
        self.acked = offset
        while self.mem and self.mem[0].end <= offset:
            self.mem_bytes -= cached(self.mem.popleft())
        self._forget_safe()
        return True

    def unspooled(self, limit: int) -> list[Chunk | Extent]:
        """Chunks holding bytes at or past safe_end, coalesced, about `limit`
        bytes of them (extents, already on disk, do not count)."""
        out: list[Chunk | Extent] = []
        total = 0
        mem = self.mem
        spooled = self.spooled_end
        for i in range(self._first_after(self.safe_end), len(mem)):
            chunk = mem[i]
            if chunk.start < spooled and isinstance(chunk, Chunk):  # its head is spooled (see Agent._unspooled)
                chunk = Chunk(chunk.stream, spooled, chunk.data[spooled - chunk.start:])
            out.append(chunk)
            total += cached(chunk)
            if total >= limit:
                break
        return coalesce(out, MAX_ROW)

    def _first_after(self, offset: int) -> int:
        """Index in `mem` of the first chunk that ends past `offset`, found
        from whichever end is nearer: the spooler and the sender mostly want
        the newest chunks, a sender catching up the oldest ones."""
        mem = self.mem
        n = len(mem)
        if not n or mem[0].end > offset:
            return 0
        if offset - mem[0].start < mem[-1].end - offset:
            i = 1
            while i < n and mem[i].end <= offset:
                i += 1
            return i
        i = n
        while i > 0 and mem[i - 1].end > offset:
            i -= 1
        return i

    def mark_spooled(self, end: int) -> None:
        self.spooled_end = max(self.spooled_end, end)
        self._forget_safe()

    def evict(self, keep: int) -> None:
        """Drop cached (already safe) chunks from memory down to `keep` bytes."""
        safe = self.safe_end
        while self.mem and self.mem_bytes > keep and self.mem[0].end <= safe:
            self.mem_bytes -= cached(self.mem.popleft())

    def from_memory(self, offset: int, limit: int) -> Chunk | None:
        """Bytes from `offset` on, if memory holds them, up to `limit`. A large
        chunk is returned as a view of itself (no copy); only small ones are
        joined, so a job writing lines still makes frames of a useful size.
        None when memory does not hold the bytes at `offset` (evicted, or
        spliced: see `placed_end`)."""
        if not self.mem or self.mem[0].start > offset or offset >= self.read_end:
            return None
        parts: list[bytes | memoryview] = []
        total = 0
        mem = self.mem
        for i in range(self._first_after(offset), len(mem)):
            chunk = mem[i]
            if isinstance(chunk, Extent):
                break  # in the segment file: the sender sends it from there
            data: bytes | memoryview = chunk.data
            if chunk.start < offset:
                data = memoryview(data)[offset - chunk.start :]
            if len(data) > limit - total:
                data = memoryview(data)[: limit - total]
            if parts and len(data) >= JOIN_BELOW:
                break  # send the small ones gathered so far; this one goes whole next
            parts.append(data)
            total += len(data)
            if total >= limit or total >= JOIN_BELOW:
                break
        if not parts:
            return None
        return Chunk(self.id, offset, parts[0] if len(parts) == 1 else b"".join(parts))  # type: ignore[arg-type]


    def placed_end(self, offset: int) -> int:
        """Where the bytes from `offset` on that sit in their segment files
        end (natural layout): the spooled ones, and the spliced extents that
        follow them. `offset` itself when there are none there."""
        end = offset
        if self.acked <= offset < self.spooled_end:
            end = self.spooled_end
        mem = self.mem
        for i in range(self._first_after(end), len(mem)):
            chunk = mem[i]
            if not isinstance(chunk, Extent) or chunk.start > end:
                break
            end = chunk.end
        return end


class StdinFeeder:
    """Stdin bytes fetched from the shadow, waiting to be written to the job."""

    def __init__(self, stream: int) -> None:
        self.stream = stream
        self.fetched = 0  # bytes received from the shadow
        self.written = 0  # bytes handed to the job's pipe
        self.buffer: deque[bytes] = deque()
        self.buffered = 0
        self.eof = False  # the shadow's file ended at `fetched`
        self.closed = False  # the job closed its stdin
        self.in_flight = False

    def wants(self) -> bool:
        return not (self.eof or self.closed or self.in_flight) and self.buffered < STDIN_PREFETCH

    @property
    def starved(self) -> bool:
        """The job has not had all of its stdin (nor closed it)."""
        return not self.closed and not (self.eof and self.written >= self.fetched)

    def receive(self, ev: StdinData) -> None:
        self.in_flight = False
        if ev.offset != self.fetched:
            return  # an answer to a request of an older session: ask again
        if ev.payload:
            self.buffer.append(ev.payload)
            self.buffered += len(ev.payload)
            self.fetched += len(ev.payload)
        self.eof = ev.eof

    def take(self) -> bytes | None:
        if not self.buffer:
            return None
        data = self.buffer.popleft()
        self.buffered -= len(data)
        self.written += len(data)
        return data


class Outbox:
    """The one owner of the job's stream progress: each output stream's
    offsets and bytes (`streams`), the stdin fetched for the job (`stdin`),
    the job's end (`exit`), and `changed`, the signal every task sharing
    them waits on. The pipe readers append, the commit loop marks bytes
    spooled, a session acknowledges; everyone else reads."""

    def __init__(self, specs: Iterable[StreamSpec], *, resuming: bool = False) -> None:
        specs = list(specs)
        self.streams: dict[int, OutStream] = {
            s.id: OutStream(s.id, s.kind, s.name) for s in specs if s.kind != "stdin"
        }
        stdin = [s.id for s in specs if s.kind == "stdin"]
        self.stdin = StdinFeeder(stdin[0]) if stdin else None
        self.changed = Signal()
        self.exit: Exit | None = None  # the job's end (lengths as of then), once it has ended
        self.resuming = resuming  # the offsets come from a spool left behind (gcwrap resume)

    # -- figures (derived, never kept twice) -------------------------------

    @property
    def unsafe_bytes(self) -> int:
        return sum(o.unsafe_bytes for o in self.streams.values())

    @property
    def spooled_pending(self) -> int:
        """Bytes the spool holds that home has not acknowledged."""
        return sum(max(0, o.spooled_end - o.acked) for o in self.streams.values())

    @property
    def pending(self) -> bool:
        """Output read from the job waits for home's acknowledgement."""
        return any(o.acked < o.read_end for o in self.streams.values())

    @property
    def all_delivered(self) -> bool:
        return self.exit is not None and all(o.delivered for o in self.streams.values())

    @property
    def stdin_starved(self) -> bool:
        """The job has a --stdin and has not had all of it (nor closed its stdin)."""
        return self.stdin is not None and self.stdin.starved

    def to_spool(self, room: int, least: int) -> tuple[list[Chunk | Extent], bool]:
        """Chunks not yet safe, in order per stream, that fit in `room` bytes,
        and whether some were left out for want of room. A chunk larger than
        what is left of the room goes in part, its head (at least `least`):
        on a nearly full disk the first read can be a whole pipeful (a job
        that started while gcwrap was loading fills it), and the spool must
        still take what it has room for."""
        chunks: list[Chunk | Extent] = []
        short = False
        for out in self.streams.values():
            for c in out.unspooled(room):
                if cached(c) > room:  # (an extent is on disk already)
                    short = True
                    if isinstance(c, Chunk) and room >= least:
                        chunks.append(Chunk(c.stream, c.start, c.data[:room]))
                        room = 0
                    break
                chunks.append(c)
                room -= cached(c)
        return chunks, short

    def lengths(self) -> tuple[tuple[int, int], ...]:
        """What the job wrote per stream, as of now (the EXIT's lengths)."""
        return tuple((s, o.read_end) for s, o in self.streams.items())

    def exit_frame(self, summary: tuple[tuple[str, str], ...]) -> Exit:
        """The EXIT to send: the job's end, with the lengths as of now (a
        resume may learn that home holds more than its spool)."""
        assert self.exit is not None
        return dataclasses.replace(self.exit, summary=summary, lengths=self.lengths())

    # -- what home says ------------------------------------------------------

    def welcomed(self, durable: Iterable[tuple[int, int]]) -> None:
        """Home's durable offsets at the start of a session: acknowledged.
        Mismatch when home holds fewer bytes than it acknowledged, or more
        than were written (beyond a resumed spool: adopted, see `adopt`)."""
        for sid, offset in durable:
            out = self.streams.get(sid)
            if out is None:
                continue
            if self.resuming and offset > out.read_end:
                out.adopt(offset)
            if offset < out.acked or offset > out.read_end:
                raise Mismatch(f"the shadow holds {offset} bytes of {out.kind} ({out.name}), "
                               f"but {out.acked} were acknowledged and {out.read_end} written")
            out.ack(offset)
        if self.stdin is not None:
            self.stdin.in_flight = False
        self.changed.fire()

    def ack(self, sid: int, offset: int, sent: int) -> bool:
        """An ACK of this session (which sent `sent` bytes of the stream):
        True if it moved forward. KeyError for a stream we do not have,
        Mismatch past what was sent."""
        moved = self.streams[sid].ack(offset, sent)
        if moved:
            self.changed.fire()
        return moved

    def stdin_data(self, ev: StdinData) -> bool:
        """Stdin bytes from home; False if the job has no such stream."""
        if self.stdin is None or ev.stream != self.stdin.stream:
            return False
        self.stdin.receive(ev)
        self.changed.fire()
        return True


def cached(chunk: Chunk | Extent) -> int:
    """Bytes of memory a chunk holds (an extent: none)."""
    return 0 if isinstance(chunk, Extent) else len(chunk.data)


def coalesce(chunks: list[Chunk | Extent], limit: int) -> list[Chunk | Extent]:
    """Join consecutive chunks of one stream into chunks of at most `limit`
    bytes (a single chunk larger than `limit` stays whole). Extents pass as
    they are: each is one row already."""
    out: list[Chunk | Extent] = []
    parts: list[bytes] = []
    start = size = 0
    stream = -1

    def flush() -> None:
        if parts:
            out.append(Chunk(stream, start, parts[0] if len(parts) == 1 else b"".join(parts)))

    for c in chunks:
        if isinstance(c, Extent):
            flush()
            parts, size = [], 0
            out.append(c)
            continue
        if parts and c.stream == stream and c.start == start + size and size + len(c.data) <= limit:
            parts.append(c.data)
            size += len(c.data)
            continue
        flush()
        parts, stream, start, size = [c.data], c.stream, c.start, len(c.data)
    flush()
    return out


def fit(chunks: list[Chunk | Extent], budget: int) -> list[Chunk | Extent]:
    """The first of a stream's unspooled chunks, holding at most `budget`
    bytes of memory (the last one cut to fit); extents, already on disk,
    cost nothing."""
    out: list[Chunk | Extent] = []
    for c in chunks:
        if isinstance(c, Extent):
            out.append(c)
            continue
        if budget <= 0:
            break
        if c.size > budget:
            out.append(Chunk(c.stream, c.start, bytes(c.data[:budget])))
            break
        out.append(c)
        budget -= c.size
    return out
