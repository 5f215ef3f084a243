"""Tests of the agent's in-memory output streams (OutStream) and coalesce()."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from gcwrap.agent.outbox import MAX_ROW, Mismatch, Outbox, OutStream, coalesce
from gcwrap.agent.records import Chunk
from gcwrap.wire.events import Exit, StdinData, StreamSpec

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def contiguous(chunks: list[Chunk]) -> bool:
    return all(b.start == a.end and b.stream == a.stream for a, b in itertools.pairwise(chunks))


# -- OutStream, by example ---------------------------------------------------------


def make(*pieces: bytes) -> OutStream:
    out = OutStream(1, "stdout", "out.log")
    for piece in pieces:
        out.append(piece)
    return out


def test_append_tracks_offsets_and_memory() -> None:
    out = make()
    assert out.append(b"hello") == Chunk(1, 0, b"hello")
    assert out.append(b" world") == Chunk(1, 5, b" world")
    assert (out.read_end, out.mem_bytes, out.unsafe_bytes, out.safe_end) == (11, 11, 11, 0)
    assert not out.delivered


def test_ack_moves_forward_only_and_frees_acked_chunks() -> None:
    out = make(b"a" * 10, b"b" * 10, b"c" * 10)
    assert out.ack(15) is True
    assert [c.start for c in out.mem] == [10, 20]  # the partly acked chunk stays
    assert out.mem_bytes == 20 and out.unsafe_bytes == 15
    assert out.ack(15) is False and out.ack(3) is False
    assert out.acked == 15
    assert out.ack(30) is True
    assert not out.mem and out.mem_bytes == 0 and out.unsafe_bytes == 0


def test_ack_past_what_was_read_is_refused() -> None:
    out = make(b"abc")
    with pytest.raises(ValueError, match="acknowledged 4 bytes but only 3"):
        out.ack(4)
    assert out.acked == 0 and out.mem_bytes == 3


def test_delivered_needs_eof_and_every_byte_acked() -> None:
    out = make(b"abc")
    out.ack(3)
    assert not out.delivered
    out.eof = True
    assert out.delivered
    out2 = make(b"abc")
    out2.eof = True
    out2.mark_spooled(3)
    assert not out2.delivered  # spooled is not delivered


def test_unspooled_mark_spooled_evict() -> None:
    out = make(b"a" * 10, b"b" * 10, b"c" * 10)
    got = out.unspooled(15)  # stops once it has at least 15 bytes, then coalesces
    assert got == [Chunk(1, 0, b"a" * 10 + b"b" * 10)]
    out.mark_spooled(got[-1].end)
    assert (out.spooled_end, out.safe_end, out.unsafe_bytes) == (20, 20, 10)
    assert out.unspooled(1 << 20) == [Chunk(1, 20, b"c" * 10)]
    out.mark_spooled(5)  # never backwards
    assert out.spooled_end == 20
    out.evict(0)  # drops the spooled chunks, never the unspooled one
    assert list(out.mem) == [Chunk(1, 20, b"c" * 10)] and out.mem_bytes == 10
    assert out.from_memory(0, 100) is None  # evicted: the sender reads the spool
    assert out.from_memory(25, 100) == Chunk(1, 25, b"c" * 5)
    out.mark_spooled(30)
    assert out.unspooled(100) == []


def test_evict_keeps_the_cache_up_to_keep() -> None:
    out = make(b"a" * 10, b"b" * 10, b"c" * 10)
    out.mark_spooled(30)
    out.evict(20)
    assert [c.start for c in out.mem] == [10, 20] and out.mem_bytes == 20
    out.evict(15)
    assert [c.start for c in out.mem] == [20]
    out.evict(100)
    assert [c.start for c in out.mem] == [20]


def test_unspooled_after_an_ack_inside_a_chunk() -> None:
    """Network ahead of the disk: bytes acked before they were spooled need no row."""
    out = make(b"a" * 10, b"b" * 10)
    out.ack(15)
    assert out.safe_end == 15
    assert out.unspooled(100) == [Chunk(1, 10, b"b" * 10)]  # whole chunk, holding 15..20
    out.ack(20)
    assert out.unspooled(100) == []


def test_unspooled_coalesces_into_rows_of_max_row() -> None:
    piece = 10 << 10
    out = make(*(bytes([i]) * piece for i in range(100)))
    rows = out.unspooled(1 << 30)
    assert [len(r.data) for r in rows] == [25 * piece] * 4  # 26 pieces would pass MAX_ROW
    assert all(len(r.data) <= MAX_ROW for r in rows)
    assert contiguous(rows) and rows[0].start == 0 and rows[-1].end == out.read_end
    assert b"".join(r.data for r in rows) == b"".join(bytes([i]) * piece for i in range(100))


def test_from_memory_edges() -> None:
    out = make(b"0123456789", b"abcdefghij")
    assert out.from_memory(0, 1) == Chunk(1, 0, b"0")
    assert out.from_memory(5, 10) == Chunk(1, 5, b"56789abcde")
    assert out.from_memory(9, 1 << 20) == Chunk(1, 9, b"9abcdefghij")
    assert out.from_memory(20, 10) is None  # nothing there yet
    assert out.from_memory(25, 10) is None
    assert make().from_memory(0, 10) is None


def test_from_memory_sends_a_large_chunk_without_copying_it() -> None:
    big = bytes(range(256)) * 2048  # 512 KiB
    out = make(big, b"tail")
    assert out.from_memory(0, 1 << 20).data is big  # the chunk itself, whole: the small one goes next
    part = out.from_memory(1000, 1 << 20)
    assert isinstance(part.data, memoryview) and part.data.obj is big and part.data == big[1000:]
    assert out.from_memory(0, 100).data == big[:100]


def test_from_memory_joins_small_chunks_up_to_max_row() -> None:
    lines = [b"line %06d\n" % i for i in range(40_000)]
    out = make(*lines)
    got = out.from_memory(0, 1 << 20)
    assert MAX_ROW <= len(got.data) < MAX_ROW + 20 and got.data == b"".join(lines)[: len(got.data)]


def test_oldest_unsafe_is_the_read_time_of_the_oldest_byte_only_in_memory() -> None:
    out = OutStream(1, "stdout", "out.log")
    assert out.oldest_unsafe() is None
    out.append(b"a" * 10, now=1.0)
    out.append(b"b" * 10, now=2.0)
    out.append(b"c" * 10, now=3.0)
    assert out.oldest_unsafe() == 1.0
    out.ack(5)  # part of the first chunk is still only in memory
    assert out.oldest_unsafe() == 1.0
    out.mark_spooled(10)
    assert out.oldest_unsafe() == 2.0
    out.ack(30)
    assert out.oldest_unsafe() is None
    assert not out.arrivals  # the times of safe bytes are not kept: bounded by what is unsafe


def test_read_times_stay_bounded_without_write_behind() -> None:
    """In the default mode nobody asks for oldest_unsafe(): spooling and
    acknowledging alone must keep the read times from piling up."""
    out = OutStream(1, "stdout", "out.log")
    for i in range(10_000):
        out.append(b"x" * 10, now=float(i))
        out.mark_spooled(out.read_end if i % 2 else out.spooled_end)
        if i % 100 == 0:
            out.ack(out.read_end)
    assert len(out.arrivals) <= 1


# -- OutStream, against a model ---------------------------------------------------


class OutStreamModel(RuleBasedStateMachine):
    """Random appends, acks, spool commits, evictions and reads, checked
    against the bytes the job wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.out = OutStream(7, "stderr", "err.log")
        self.data = bytearray()
        self.spooled = 0

    @rule(payload=st.binary(max_size=700))
    def append(self, payload: bytes) -> None:
        chunk = self.out.append(payload)
        assert chunk == Chunk(7, len(self.data), payload)
        self.data += payload

    @rule(fraction=st.floats(0, 1))
    def ack(self, fraction: float) -> None:
        offset = int(len(self.data) * fraction)
        before = self.out.acked
        assert self.out.ack(offset) is (offset > before)
        assert self.out.acked == max(before, offset)

    @rule(extra=st.integers(1, 100))
    def ack_too_far(self, extra: int) -> None:
        before = (self.out.acked, list(self.out.mem), self.out.mem_bytes)
        with pytest.raises(ValueError):
            self.out.ack(len(self.data) + extra)
        assert (self.out.acked, list(self.out.mem), self.out.mem_bytes) == before

    @rule(limit=st.integers(1, 3000), committed=st.integers(0, 10))
    def spool(self, limit: int, committed: int) -> None:
        """Take unspooled chunks; the spool commits the first `committed` rows
        (fewer than returned: the disk failed part way, nothing is marked)."""
        out = self.out
        chunks = out.unspooled(limit)
        safe = out.safe_end
        if out.unsafe_bytes == 0:
            assert chunks == []
            return
        assert chunks, "unsafe bytes in memory but nothing to spool"
        assert chunks[0].start <= safe < chunks[0].end
        assert contiguous(chunks)
        for c in chunks:
            assert c.stream == 7 and c.data == bytes(self.data[c.start : c.end])
            assert len(c.data) <= MAX_ROW
        covered = chunks[-1].end - chunks[0].start
        assert chunks[-1].end == out.read_end or covered >= limit
        if committed and committed <= len(chunks):
            out.mark_spooled(chunks[committed - 1].end)
            self.spooled = max(self.spooled, chunks[committed - 1].end)

    @rule(keep=st.integers(0, 3000))
    def evict(self, keep: int) -> None:
        out = self.out
        out.evict(keep)
        # Either the cache fits, or what is left starts with bytes that are not safe yet.
        assert out.mem_bytes <= keep or out.mem[0].end > out.safe_end

    @rule(fraction=st.floats(0, 1), past=st.integers(0, 3), limit=st.integers(1, 2000))
    def from_memory(self, fraction: float, past: int, limit: int) -> None:
        out = self.out
        offset = int(len(self.data) * fraction) + past
        got = out.from_memory(offset, limit)
        held = bool(out.mem) and out.mem[0].start <= offset < out.read_end
        if not held:
            assert got is None
            return
        assert got is not None
        assert got.stream == 7 and got.start == offset
        assert got.data == bytes(self.data[offset : offset + limit])

    @rule()
    def end(self) -> None:
        self.out.eof = True

    @invariant()
    def offsets_are_ordered(self) -> None:
        out = self.out
        assert out.read_end == len(self.data)
        assert 0 <= out.acked <= out.read_end
        assert out.spooled_end == self.spooled <= out.read_end
        assert out.safe_end == max(out.spooled_end, out.acked) <= out.read_end
        assert out.unsafe_bytes == out.read_end - out.safe_end >= 0
        assert out.delivered == (out.eof and out.acked >= out.read_end)

    @invariant()
    def memory_matches_the_bytes(self) -> None:
        out = self.out
        mem = list(out.mem)
        assert out.mem_bytes == sum(len(c.data) for c in mem)
        assert contiguous(mem)
        if mem:
            assert mem[-1].end == out.read_end
        for c in mem:
            assert c.data == bytes(self.data[c.start : c.end])
        # Acked bytes are freed...
        assert all(c.end > out.acked for c in mem if c.data)
        # ...and unsafe bytes never are: everything past safe_end is in memory.
        if out.unsafe_bytes:
            assert mem and mem[0].start <= out.safe_end


def test_outstream_model() -> None:
    run_state_machine_as_test(OutStreamModel, settings=settings(SETTINGS, max_examples=100, stateful_step_count=40))


# -- coalesce -----------------------------------------------------------------------


@st.composite
def chunk_lists(draw: st.DrawFn, min_size: int = 1) -> list[Chunk]:
    """Chunks of up to three streams, mostly contiguous per stream, sometimes
    with a gap, an overlap or interleaved with another stream."""
    cursor = {1: 0, 2: 0, 3: 0}
    out = []
    for _ in range(draw(st.integers(0, 30))):
        stream = draw(st.sampled_from([1, 1, 1, 2, 3]))
        jump = draw(st.sampled_from([0, 0, 0, 0, 1, 7, -1]))
        start = max(0, cursor[stream] + jump)
        size = draw(st.integers(min_size, 120))
        out.append(Chunk(stream, start, bytes([stream]) * size))
        cursor[stream] = start + size
    return out


@given(chunks=chunk_lists(), limit=st.integers(1, 400))
@settings(SETTINGS, max_examples=200)
def test_coalesce_joins_only_contiguous_runs_within_the_limit(chunks: list[Chunk], limit: int) -> None:
    out = coalesce(chunks, limit)
    # Rebuild which input chunks went into each output chunk (inputs are non-empty).
    runs: list[list[Chunk]] = []
    i = 0
    for o in out:
        run, size = [], 0
        while size < len(o.data):
            run.append(chunks[i])
            size += len(chunks[i].data)
            i += 1
        assert size == len(o.data)
        assert o == Chunk(run[0].stream, run[0].start, b"".join(c.data for c in run))
        # Joined only when of one stream, contiguous, consecutive in the input...
        assert contiguous(run)
        # ...and within the limit (a lone chunk larger than the limit stays whole).
        assert len(run) == 1 or len(o.data) <= limit
        runs.append(run)
    assert i == len(chunks), "chunks were dropped"
    # Greedy: a chunk that could have joined the previous output chunk did.
    for prev, run in zip(out, runs[1:]):
        first = run[0]
        assert not (first.stream == prev.stream and first.start == prev.end
                    and len(prev.data) + len(first.data) <= limit)


def test_coalesce_examples() -> None:
    a, b = Chunk(1, 0, b"a" * 100), Chunk(1, 100, b"b" * 156)
    assert coalesce([], 10) == []
    assert coalesce([a], 10) == [a]  # larger than the limit: stays whole
    assert coalesce([a, b], 256) == [Chunk(1, 0, b"a" * 100 + b"b" * 156)]  # exactly the limit
    assert coalesce([a, b], 255) == [a, b]
    assert coalesce([Chunk(1, 0, b"x" * 300), Chunk(1, 300, b"y")], 256) == [Chunk(1, 0, b"x" * 300),
                                                                             Chunk(1, 300, b"y")]
    assert coalesce([a, Chunk(2, 100, b"z")], 1000) == [a, Chunk(2, 100, b"z")]  # another stream
    assert coalesce([a, Chunk(1, 101, b"z")], 1000) == [a, Chunk(1, 101, b"z")]  # a gap
    assert coalesce([a, Chunk(1, 99, b"z")], 1000) == [a, Chunk(1, 99, b"z")]  # an overlap
    # Contiguous but not consecutive: order is kept, nothing is reordered or joined across.
    c1, c2, c3 = Chunk(1, 0, b"1"), Chunk(2, 0, b"2"), Chunk(1, 1, b"3")
    assert coalesce([c1, c2, c3], 1000) == [c1, c2, c3]
    # Empty chunks join their neighbours harmlessly.
    assert coalesce([Chunk(1, 0, b""), Chunk(1, 0, b"ab"), Chunk(1, 2, b"")], 10) == [Chunk(1, 0, b"ab")]


# -- Outbox: the one owner of stream progress --------------------------------------


def outbox(resuming: bool = False) -> Outbox:
    specs = [StreamSpec(1, "stdout", "out.log"), StreamSpec(2, "stderr", "err.log"), StreamSpec(0, "stdin", "in")]
    return Outbox(specs, resuming=resuming)


def test_an_ack_past_what_the_session_sent_is_a_mismatch_and_changes_nothing() -> None:
    box = outbox()
    box.streams[1].append(b"x" * 100)
    with pytest.raises(Mismatch, match="acknowledged 60 bytes of stdout, but only 50 were sent"):
        box.ack(1, 60, sent=50)
    assert box.streams[1].acked == 0
    assert box.ack(1, 50, sent=50) and not box.ack(1, 40, sent=50)
    assert box.streams[1].acked == 50


async def test_acks_and_stdin_wake_whoever_waits_on_the_outbox() -> None:
    box = outbox()
    box.streams[1].append(b"abc")
    woken = []

    async def waiter() -> None:
        await box.changed.wait()
        woken.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        box.ack(1, 3, sent=3)
    assert woken
    assert box.stdin is not None and box.stdin_starved
    assert box.stdin_data(StdinData(0, 0, b"in", eof=True)) and box.stdin.fetched == 2
    assert not box.stdin_data(StdinData(5, 0, b"", eof=True)), "not the job's stdin"


def test_welcome_acknowledges_and_refuses_what_contradicts_the_streams() -> None:
    box = outbox()
    box.streams[1].append(b"x" * 10)
    box.welcomed([(1, 4), (9, 100)])  # (a stream we do not have: ignored)
    assert box.streams[1].acked == 4
    with pytest.raises(Mismatch, match="holds 11 bytes of stdout"):
        box.welcomed([(1, 11)])
    with pytest.raises(Mismatch, match="holds 2 bytes of stdout"):
        box.welcomed([(1, 2)])


def test_a_resumed_spool_adopts_what_home_holds_beyond_it_and_the_lengths_follow() -> None:
    box = outbox(resuming=True)
    box.streams[1].restore(appended=100, acked=40)
    box.streams[2].restore(appended=0, acked=0)
    out = box.streams[1]
    assert (out.read_end, out.spooled_end, out.acked, out.eof, out.ack_recorded, out.eof_recorded) == (
        100, 100, 40, True, 40, True)
    box.exit = Exit(0, None, box.lengths())
    box.welcomed([(1, 120)])
    assert (out.read_end, out.acked) == (120, 120)
    assert box.lengths() == ((1, 120), (2, 0))
    assert box.exit_frame((("k", "v"),)).lengths == ((1, 120), (2, 0))
    assert box.all_delivered


def test_a_chunk_spooled_in_part_is_offered_from_where_the_spool_ends() -> None:
    """On a nearly full disk the spool takes the head of a large chunk
    (Outbox.to_spool): what is offered next starts where the spool ends,
    never again from the chunk's start."""
    o = make(b"a" * 1000, b"b" * 500)
    o.mark_spooled(300)
    first, *rest = o.unspooled(10_000)
    assert isinstance(first, Chunk) and first.start == 300 and first.data == b"a" * 700 + b"b" * 500, first
    assert rest == []
    o.mark_spooled(1200)
    (tail,) = o.unspooled(10_000)
    assert isinstance(tail, Chunk) and (tail.start, tail.data) == (1200, b"b" * 300)


def test_to_spool_takes_what_fits_and_says_when_room_ran_out() -> None:
    """The commit loop's selection: whole chunks while they fit, the head of
    the first that does not (at least `least` bytes), and `short` whenever
    something waits that the room left out (the spool is full, for now)."""
    box = Outbox([StreamSpec(1, "stdout", "o"), StreamSpec(2, "stderr", "e")])
    out, err = box.streams[1], box.streams[2]
    out.append(b"a" * 100)
    out.append(b"b" * 100)
    err.append(b"c" * 50)
    chunks, short = box.to_spool(1000, 10)
    assert [(c.stream, c.start, c.size) for c in chunks] == [(1, 0, 200), (2, 0, 50)] and not short
    chunks, short = box.to_spool(150, 10)  # the second of stdout's chunks goes in part; stderr has no room left
    assert [(c.stream, c.start, c.size) for c in chunks] == [(1, 0, 150)] and short
    assert isinstance(chunks[0], Chunk) and chunks[0].data == b"a" * 100 + b"b" * 50
    chunks, short = box.to_spool(5, 10)  # less room than the least piece: nothing, and short
    assert chunks == [] and short
    out.mark_spooled(150)
    chunks, short = box.to_spool(1000, 10)
    assert [(c.stream, c.start, c.size) for c in chunks] == [(1, 150, 50), (2, 0, 50)] and not short
