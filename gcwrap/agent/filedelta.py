"""What of a file's new content home holds already: block digests and the
plan that builds the new content from the version home holds (its base).

This is rsync's idea without its rolling checksum: the file is cut into
fixed 64 KiB blocks at fixed offsets, each block digested (SHA-256 cut to
128 bits: with the SHA instructions of current x86 and ARM CPUs, twice as
fast as BLAKE2b here, and every byte sent is digested), and
a block of the new content whose digest equals the base's block *at the same
offset* is copied from the base at home (FILE_COPY) instead of sent
(FILE_DATA). A job that writes in place at scattered offsets (pwrite, seek)
then costs the blocks it touched; a file that only grows costs its new tail.
Content shifted by an insertion matches nothing past the insertion and is
sent whole: rolling checksums, which find shifted blocks, are left for later.

Pure: the only I/O is reading a file through a descriptor the caller gives
(`scan`), with pread, so the descriptor's offset is left alone.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BLOCK_SIZE = 64 << 10
DIGEST_SIZE = 16  # 16 bytes a block, 256 bytes per MiB of file


def block_digest(block: bytes | memoryview) -> bytes:
    return hashlib.sha256(block).digest()[:DIGEST_SIZE]


@dataclass(frozen=True)
class Digests:
    """A content's size and its blocks' digests (the last block may be short)."""

    size: int
    blocks: tuple[bytes, ...]
    block_size: int = BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if len(self.blocks) != -(-self.size // self.block_size):
            raise ValueError(f"{len(self.blocks)} digests for {self.size} bytes in blocks of {self.block_size}")

    def prefix(self, size: int) -> Digests:
        """The digests of the content's first `size` bytes, as far as these
        tell them: all of them for `size` at least the content's, else its
        whole blocks below `size` (a block cut short has no digest here)."""
        if size >= self.size:
            return self
        whole = max(0, size) // self.block_size
        return Digests(whole * self.block_size, self.blocks[:whole], self.block_size)

    def blob(self) -> bytes:
        """The digests end to end, as the spool keeps them."""
        return b"".join(self.blocks)

    @classmethod
    def from_blob(cls, size: int, blob: bytes, block_size: int = BLOCK_SIZE) -> Digests:
        if len(blob) % DIGEST_SIZE:
            raise ValueError(f"a digest blob of {len(blob)} bytes is not whole digests")
        blocks = tuple(blob[i : i + DIGEST_SIZE] for i in range(0, len(blob), DIGEST_SIZE))
        return cls(size, blocks, block_size)


@dataclass(frozen=True)
class Scan:
    """A content read once: its SHA-256 (FILE_COMMIT's) and its block digests."""

    sha256: str
    digests: Digests


def digests_of(data: bytes, block_size: int = BLOCK_SIZE) -> Digests:
    """The block digests of content held in memory."""
    blocks = tuple(block_digest(data[i : i + block_size]) for i in range(0, len(data), block_size))
    return Digests(len(data), blocks, block_size)


def scan(fd: int, size: int, block_size: int = BLOCK_SIZE) -> Scan:
    """Read [0, size) of the file open at `fd` (pread: the descriptor's offset
    is left alone) and digest it. A file that is shorter than `size` now (the
    job truncated it meanwhile) is scanned as far as it goes: the Scan's size
    says how far, and the caller compares."""
    whole = hashlib.sha256()
    blocks: list[bytes] = []
    offset = 0
    while offset < size:
        block = _read_block(fd, offset, min(block_size, size - offset))
        if not block:
            break
        whole.update(block)
        blocks.append(block_digest(block))
        offset += len(block)
        if len(block) < block_size:
            break  # a short block is the last: the file ends here (or ended while read)
    return Scan(whole.hexdigest(), Digests(offset, tuple(blocks), block_size))


class Scanner:
    """A content scanned as it grows (a log): its Scan at each size, reading
    only the bytes past the last one read, so that a file appended to for
    hours costs its appends, not its size at every commit. It trusts the
    bytes it read to stay as they were: a rewrite below them is for the
    caller to find (a new version, scanned whole)."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.size = 0
        self._sha = hashlib.sha256()
        self._blocks: list[bytes] = []
        self._tail = b""  # the last block's bytes while it is short

    def advance(self, fd: int, size: int) -> Scan:
        """Read [self.size, size) of the file at `fd` (less where the file
        ends sooner) and return the Scan of [0, self.size)."""
        while self.size < size:
            piece = _read_block(fd, self.size, min(self.block_size - len(self._tail), size - self.size))
            if not piece:
                break
            self._sha.update(piece)
            self.size += len(piece)
            self._tail += piece
            if len(self._tail) == self.block_size:
                self._blocks.append(block_digest(self._tail))
                self._tail = b""
        return self.scan()

    def scan(self) -> Scan:
        blocks = (*self._blocks, block_digest(self._tail)) if self._tail else tuple(self._blocks)
        return Scan(self._sha.copy().hexdigest(), Digests(self.size, blocks, self.block_size))


def _read_block(fd: int, offset: int, length: int) -> bytes:
    """One block, reading again after a short read until it is whole or the file ends."""
    parts: list[bytes] = []
    got = 0
    while got < length:
        part = os.pread(fd, length - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


# -- the plan ----------------------------------------------------------------


@dataclass(frozen=True)
class Copy:
    """The new content's [offset, offset+length) is the base's [source, source+length)."""

    offset: int
    source: int
    length: int


@dataclass(frozen=True)
class Literal:
    """The new content's [offset, offset+length) is sent as it is."""

    offset: int
    length: int


Op = Copy | Literal


def plan(base: Digests | None, new: Digests) -> list[Op]:
    """How to build `new` from `base`: operations in order of offset, covering
    [0, new.size) with no gap nor overlap, adjacent copies (and literals)
    merged. Block i of `new` is copied where the base has a block i of the
    same length and digest; with no base, the whole content is one literal."""
    if base is not None and base.block_size != new.block_size:
        raise ValueError(f"blocks of {base.block_size} and {new.block_size} bytes cannot be compared")
    ops: list[Op] = []
    for i, digest in enumerate(new.blocks):
        offset = i * new.block_size
        length = min(new.block_size, new.size - offset)
        if base is not None and _same_block(base, i, length, digest):
            _append(ops, Copy(offset, offset, length))
        else:
            _append(ops, Literal(offset, length))
    return ops


def _same_block(base: Digests, i: int, length: int, digest: bytes) -> bool:
    # The length too: a short last block of the base is not a whole block of the new.
    return i < len(base.blocks) and min(base.block_size, base.size - i * base.block_size) == length \
        and base.blocks[i] == digest


def _append(ops: list[Op], op: Op) -> None:
    """Add `op`, merged into the last operation where they continue each other."""
    last = ops[-1] if ops else None
    if isinstance(op, Copy) and isinstance(last, Copy) and last.source + last.length == op.source:
        ops[-1] = Copy(last.offset, last.source, last.length + op.length)
    elif isinstance(op, Literal) and isinstance(last, Literal):
        ops[-1] = Literal(last.offset, last.length + op.length)
    else:
        ops.append(op)


def literal_bytes(ops: Sequence[Op]) -> int:
    """The bytes a plan sends on the wire (the rest home copies)."""
    return sum(op.length for op in ops if isinstance(op, Literal))


def apply(ops: Sequence[Op], base: Callable[[int, int], bytes], new: Callable[[int, int], bytes]) -> bytes:
    """The content a plan builds, reading the base's bytes and the new
    content's literal bytes through `base(offset, length)` and
    `new(offset, length)` (what home does with FILE_COPY and FILE_DATA)."""
    out = bytearray()
    for op in ops:
        if op.offset != len(out):
            raise ValueError(f"operation at {op.offset} after {len(out)} bytes: a gap or an overlap")
        chunk = base(op.source, op.length) if isinstance(op, Copy) else new(op.offset, op.length)
        if len(chunk) != op.length:
            raise ValueError(f"{len(chunk)} bytes where {op.length} were planned at {op.offset}")
        out += chunk
    return bytes(out)
