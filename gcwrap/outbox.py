"""The agent's in-memory view of its output streams (no I/O, no trio).

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
memory: the bulk path, see gcwrap.segments). An extent is unsafe too until
its row is committed, but it takes no memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .spool import Chunk, Extent

MAX_ROW = 256 << 10  # coalesce small pipe reads into spool rows / DATA frames up to this
JOIN_BELOW = MAX_ROW  # from memory, chunks smaller than this are joined into one frame


@dataclass
class OutStream:
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

    def ack(self, offset: int) -> bool:
        """Record the shadow's durable offset; True if it moved forward."""
        if offset > self.read_end:
            raise ValueError(
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
        for i in range(self._first_after(self.safe_end), len(mem)):
            chunk = mem[i]
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
