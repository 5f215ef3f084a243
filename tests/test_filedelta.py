"""Tests of the block digests and the plan that builds a file's new content
from the version home holds (gcwrap.agent.filedelta)."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcwrap.agent.filedelta import (
    BLOCK_SIZE,
    DIGEST_SIZE,
    Copy,
    Digests,
    Literal,
    Op,
    Scanner,
    apply,
    digests_of,
    literal_bytes,
    plan,
    scan,
)

pytestmark = pytest.mark.timeout(120)

SMALL = 8  # blocks of a few bytes, so that small examples span many blocks


def rebuilt(ops: list[Op], base: bytes, new: bytes) -> bytes:
    return apply(ops, lambda o, n: base[o : o + n], lambda o, n: new[o : o + n])


def check_shape(ops: list[Op], size: int) -> None:
    """In order, contiguous over [0, size), nothing empty, no two mergeable neighbours."""
    offset = 0
    for op in ops:
        assert op.offset == offset and op.length > 0
        offset += op.length
    assert offset == size
    for a, b in itertools.pairwise(ops):
        assert type(a) is not type(b) or (isinstance(a, Copy) and isinstance(b, Copy)
                                          and a.source + a.length != b.source)


@st.composite
def edited(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A base and a new content made from it by the edits jobs make."""
    base = draw(st.binary(max_size=200))
    new = bytearray(base)
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["pwrite", "truncate", "append", "insert"]))
        at = draw(st.integers(0, len(new)))
        data = draw(st.binary(max_size=30))
        if kind == "pwrite":
            new[at : at + len(data)] = data
        elif kind == "truncate":
            del new[at:]
        elif kind == "append":
            new += data
        else:
            new[at:at] = data
    return base, bytes(new)


@settings(max_examples=300, deadline=None)
@given(edited() | st.tuples(st.binary(max_size=100), st.binary(max_size=100)),
       st.sampled_from([1, 3, SMALL, 64]))
def test_the_plan_builds_the_new_content_from_the_base(contents: tuple[bytes, bytes], block_size: int) -> None:
    base, new = contents
    ops = plan(digests_of(base, block_size), digests_of(new, block_size))
    check_shape(ops, len(new))
    assert rebuilt(ops, base, new) == new
    for op in ops:
        if isinstance(op, Copy):  # fixed offsets: a copy never moves bytes
            assert op.source == op.offset
            assert base[op.source : op.source + op.length] == new[op.offset : op.offset + op.length]


@given(st.binary(max_size=100), st.sampled_from([1, SMALL]))
def test_without_a_base_the_whole_content_is_one_literal(new: bytes, block_size: int) -> None:
    ops = plan(None, digests_of(new, block_size))
    assert ops == ([Literal(0, len(new))] if new else [])


@given(st.binary(max_size=100), st.sampled_from([1, SMALL, 64]))
def test_the_same_content_is_one_copy(content: bytes, block_size: int) -> None:
    d = digests_of(content, block_size)
    assert plan(d, d) == ([Copy(0, 0, len(content))] if content else [])


@given(st.binary(min_size=1, max_size=100), st.binary(min_size=1, max_size=100), st.sampled_from([1, SMALL]))
def test_a_pure_append_is_one_copy_and_one_literal(base: bytes, tail: bytes, block_size: int) -> None:
    # A base that ends in a short block sends that block again: it is not a whole block of the new content.
    whole = len(base) - len(base) % block_size
    ops = plan(digests_of(base, block_size), digests_of(base + tail, block_size))
    if whole:
        assert ops == [Copy(0, 0, whole), Literal(whole, len(base) + len(tail) - whole)]
    else:
        assert ops == [Literal(0, len(base) + len(tail))]


@given(st.binary(min_size=1, max_size=100), st.integers(0, 100), st.sampled_from([1, SMALL]))
def test_a_truncation_is_one_copy_and_at_most_one_short_block(base: bytes, keep: int, block_size: int) -> None:
    new = base[: keep % len(base)]
    ops = plan(digests_of(base, block_size), digests_of(new, block_size))
    assert rebuilt(ops, base, new) == new
    assert literal_bytes(ops) == len(new) % block_size
    assert len(ops) <= 2


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_k_changed_blocks_of_a_large_file_send_at_most_k_blocks(data: st.DataObject) -> None:
    blocks = 40
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    base = rng.randbytes(blocks * BLOCK_SIZE + data.draw(st.integers(0, BLOCK_SIZE - 1)))
    new = bytearray(base)
    writes = data.draw(st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(1, 100)), max_size=8))
    touched = set()
    for at, length in writes:
        piece = rng.randbytes(min(length, len(base) - at))
        new[at : at + len(piece)] = piece
        touched |= {i // BLOCK_SIZE for i in (at, at + len(piece) - 1)}
    ops = plan(digests_of(base), digests_of(bytes(new)))
    assert rebuilt(ops, base, bytes(new)) == new
    assert literal_bytes(ops) <= len(touched) * BLOCK_SIZE


def test_scan_reads_through_the_descriptor_without_moving_it(tmp_path: Path) -> None:
    content = random.Random(7).randbytes(3 * BLOCK_SIZE + 123)
    path = tmp_path / "f"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, 5, os.SEEK_SET)
        result = scan(fd, len(content))
        assert os.lseek(fd, 0, os.SEEK_CUR) == 5
    finally:
        os.close(fd)
    assert result.sha256 == hashlib.sha256(content).hexdigest()
    assert result.digests == digests_of(content)
    assert len(result.digests.blocks) == 4 and all(len(b) == DIGEST_SIZE for b in result.digests.blocks)


def test_scan_of_a_file_shorter_than_asked_stops_where_it_ends(tmp_path: Path) -> None:
    content = b"x" * (BLOCK_SIZE + 10)
    path = tmp_path / "f"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        result = scan(fd, 5 * BLOCK_SIZE)
    finally:
        os.close(fd)
    assert result.digests.size == len(content)
    assert result.sha256 == hashlib.sha256(content).hexdigest()


@given(st.binary(max_size=100), st.sampled_from([1, SMALL]))
def test_digests_round_trip_through_the_spools_blob(content: bytes, block_size: int) -> None:
    d = digests_of(content, block_size)
    assert Digests.from_blob(d.size, d.blob(), block_size) == d


def test_digests_that_do_not_fit_the_size_are_refused() -> None:
    with pytest.raises(ValueError):
        Digests(10, (), SMALL)
    with pytest.raises(ValueError):
        Digests.from_blob(0, b"x")
    with pytest.raises(ValueError):
        plan(digests_of(b"a", 1), digests_of(b"a", 2))


def test_apply_refuses_a_plan_with_a_gap() -> None:
    with pytest.raises(ValueError):
        rebuilt([Literal(1, 1)], b"ab", b"ab")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=12), st.sampled_from([1, SMALL, 64]))
def test_a_scanner_reads_only_the_appends_and_agrees_with_a_whole_scan(appends: list[bytes], block_size: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "log")
        path.write_bytes(b"")
        fd = os.open(path, os.O_RDONLY)
        try:
            scanner = Scanner(block_size)
            content = b""
            for piece in appends:
                with path.open("ab") as f:
                    f.write(piece)
                content += piece
                assert scanner.advance(fd, len(content)) == scan(fd, len(content), block_size)
                assert scanner.scan().digests == digests_of(content, block_size)
            # Bytes already read are not read again: a rewrite below them goes unseen (the caller's to find).
            if content:
                os.truncate(path, 0)
                path.write_bytes(b"\0" * len(content))
                assert scanner.advance(fd, len(content)).sha256 == hashlib.sha256(content).hexdigest()
                # A file shorter than asked: scanned as far as it goes.
                assert scanner.advance(fd, len(content) + 100).digests.size == len(content)
        finally:
            os.close(fd)


@given(st.binary(max_size=5 * 16), st.integers(0, 100), st.sampled_from([1, 7, 16]))
def test_a_prefix_of_the_digests_is_the_digests_of_a_prefix_of_whole_blocks(content: bytes, size: int,
                                                                             block_size: int) -> None:
    """A commit home never read: what home holds is shorter than the digests the agent kept; their prefix
    describes bytes home holds, and a plan built on it copies none beyond them."""
    d = digests_of(content, block_size).prefix(size)
    if size >= len(content):
        assert d == digests_of(content, block_size)
    else:
        assert d == digests_of(content[: size - size % block_size], block_size)
    assert all(op.source + op.length <= d.size for op in plan(d, digests_of(content, block_size))
               if isinstance(op, Copy))
