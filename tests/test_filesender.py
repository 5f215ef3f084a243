"""The pieces of gcwrap.agent.filesender that decide without I/O: the digests
of what was sent, the plan's last block, the base a WELCOME implies."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from gcwrap.agent.filedelta import BLOCK_SIZE, Copy, Literal, digests_of
from gcwrap.agent.filesender import SentBlocks, TrackedFile, _home_base, _whole_copies
from gcwrap.wire.events import FileHeld


@given(st.lists(st.integers(0, 3 * BLOCK_SIZE), max_size=6), st.integers(0, 2**32))
def test_sent_blocks_are_the_digests_of_the_bytes_fed(sizes: list[int], seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(sum(sizes))
    sent = SentBlocks()
    at = 0
    for size in sizes:
        sent.feed(data[at : at + size])
        at += size
    assert sent.size == len(data)
    assert sent.digests() == digests_of(data).blocks


def test_copied_blocks_then_literals() -> None:
    base = bytes(range(256)) * (BLOCK_SIZE // 256) * 2  # two whole blocks
    tail = b"appended"
    sent = SentBlocks()
    sent.copied(digests_of(base).blocks)
    sent.feed(tail)
    assert sent.digests() == digests_of(base + tail).blocks


def test_truncate_within_the_tail_only() -> None:
    sent = SentBlocks()
    sent.feed(b"x" * (BLOCK_SIZE + 10))
    assert sent.truncate(BLOCK_SIZE + 4) and sent.size == BLOCK_SIZE + 4
    assert not sent.truncate(BLOCK_SIZE - 1)  # (a whole block's bytes are not kept)


def test_a_short_last_copy_is_sent_as_a_literal() -> None:
    end = 2 * BLOCK_SIZE + 100
    assert _whole_copies([Copy(0, 0, end)]) == [Copy(0, 0, 2 * BLOCK_SIZE), Literal(2 * BLOCK_SIZE, 100)]
    assert _whole_copies([Literal(0, BLOCK_SIZE), Copy(BLOCK_SIZE, BLOCK_SIZE, 100)]) == [
        Literal(0, BLOCK_SIZE), Literal(BLOCK_SIZE, 100)]
    assert _whole_copies([Copy(0, 0, BLOCK_SIZE)]) == [Copy(0, 0, BLOCK_SIZE)]


def test_the_base_home_holds_by_its_welcome() -> None:
    tracked = TrackedFile(1, "f", "f", bases={2: 1, 3: 2})
    assert _home_base(tracked, None) is None
    assert _home_base(tracked, FileHeld(1, 3, 10, 10)) == 3  # (committed)
    assert _home_base(tracked, FileHeld(1, 3, 10)) == 2  # (in progress: its base is what home holds committed)


def test_the_base_home_holds_when_its_newest_version_is_one_the_spool_dropped() -> None:
    """A resumed spool keeps a file's committed version, the newest's base and the newest. Home's
    WELCOME names the newest version it holds: one the spool dropped (abandoned for a newer whose
    FILE_OPEN home never read) was built on what the newer was built on, not on nothing."""
    tracked = TrackedFile(1, "f", "f", bases={2: None, 5: 2})  # (2 committed; 3 and 4 dropped, 5 opened)
    assert _home_base(tracked, FileHeld(1, 4, 100)) == 2
    assert _home_base(tracked, FileHeld(1, 5, 100)) == 2
    assert _home_base(tracked, FileHeld(1, 2, 100, 90)) == 2
