"""The zero-copy bulk path: segments of natural layout, splice from the job's
pipe, sendfile to the shadow, reuse of delivered segments; and the installed
commands moving bulk output that way, byte-exact, over TCP and TLS."""

from __future__ import annotations

import array
import dataclasses
import errno
import fcntl
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ShadowProc, Wrapper, expected, genjob, sha256_file, tool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcwrap.agent.options import SpoolTuning
from gcwrap.agent.outbox import OutStream, coalesce
from gcwrap.agent.records import Chunk, Extent, JobRecord
from gcwrap.agent.segments import Segments
from gcwrap.agent.sender import sendfile_placed
from gcwrap.agent.sendpath import send_queue
from gcwrap.agent.spool import SPOOL_SUFFIX, Spool, SpoolError

OUT, ERR = 1, 2
STREAMS = [(OUT, "stdout", "out.log"), (ERR, "stderr", "err.log")]
MB = 1_000_000


def job() -> JobRecord:
    return JobRecord(job_id="zc", instance="0123456789abcdef", command=["true"])


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: room for every test's payload
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def fill_pipe(w: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(w, view) :]


# -- segments ------------------------------------------------------------------------


def test_place_at_puts_each_byte_at_its_offset_and_splits_at_segment_ends(tmp_path: Path) -> None:
    seg = Segments(tmp_path / "seg", segment_size=100, natural=True)
    data = bytes(range(250))
    rows = seg.place_at(OUT, 70, data)
    assert rows == [(0, 70, 70, 100), (1, 0, 100, 200), (2, 0, 200, 300), (3, 0, 300, 320)]
    assert seg.read_at(OUT, 70, 1000) == data[:30], "a read stops at its segment's end"
    got = b"".join(seg.read_at(OUT, at, 320 - at) for at in (100, 200, 300))
    assert got == data[30:]
    seg.close()


def test_splice_moves_the_pipe_into_place_and_stops_at_the_segment_end(tmp_path: Path,
                                                                       pipe: tuple[int, int]) -> None:
    r, w = pipe
    seg = Segments(tmp_path / "seg", segment_size=4096, natural=True)
    data = os.urandom(10_000)
    fill_pipe(w, data)
    moved = seg.splice_in(OUT, r, 1000, 1 << 20)
    assert moved == 4096 - 1000, "never across a segment's end"
    at = 1000 + moved
    while at < 11_000:
        at += seg.splice_in(OUT, r, at, 1 << 20)
    assert at == 11_000
    with pytest.raises(BlockingIOError):
        seg.splice_in(OUT, r, at, 1 << 20)
    got = b""
    at = 1000
    while at < 11_000:
        piece = seg.read_at(OUT, at, 11_000 - at)
        got, at = got + piece, at + len(piece)
    assert got == data
    seg.close()


def test_delivered_segments_are_reused_then_freed(tmp_path: Path) -> None:
    seg = Segments(tmp_path / "seg", segment_size=1000, natural=True)
    seg.place_at(OUT, 0, b"a" * 2500)
    first = os.stat(seg.path(OUT, 0)).st_ino
    seg.release_below(OUT, 1999)  # segment 1 still holds an unacknowledged byte
    assert not seg.path(OUT, 0).exists() and seg.path(OUT, 1).exists()
    assert os.stat(seg.spare_path(OUT)).st_ino == first, "the delivered segment waits as the spare"
    seg.release_below(OUT, 2000)
    assert not seg.path(OUT, 1).exists(), "one spare at most: the second is deleted"
    seg.place_at(OUT, 3000, b"b" * 10)
    assert os.stat(seg.path(OUT, 3)).st_ino == first, "a new segment takes the spare's place (and its pages)"
    assert not seg.spare_path(OUT).exists()
    assert seg.read_at(OUT, 3000, 10) == b"b" * 10
    assert seg.read_at(OUT, 2000, 500) == b"a" * 500
    # With the disk tight, no spare is kept; close() gives any spare back.
    seg.keep_spares = False
    seg.release_below(OUT, 3000)
    assert sorted(p.name for p in seg.dir.iterdir()) == [f"{OUT}-3"]
    seg.keep_spares = True
    seg.release_below(OUT, 4000)
    assert seg.spare_path(OUT).exists()
    seg.close()
    assert sorted(p.name for p in seg.dir.iterdir()) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["place", "splice", "ack"]), st.integers(1, 700)),
        min_size=1,
        max_size=40,
    ),
    size=st.sampled_from([64, 256, 1000]),
)
def test_any_mix_of_places_splices_and_acks_reads_back_the_stream(tmp_path_factory: pytest.TempPathFactory,
                                                                 ops: list[tuple[str, int]], size: int) -> None:
    """Model: a stream of random bytes written by memory places and splices
    in any order and sizes, acknowledged at random points; every byte not
    yet acknowledged reads back exactly, whatever segments were reused."""
    directory = tmp_path_factory.mktemp("seg")
    seg = Segments(directory, segment_size=size, natural=True)
    r, w = os.pipe()
    os.set_blocking(r, False)
    fcntl.fcntl(w, 1031, 1 << 20)
    stream = b""
    acked = 0
    try:
        for op, n in ops:
            data = os.urandom(n)
            if op == "place":
                seg.place_at(OUT, len(stream), data)
                stream += data
            elif op == "splice":
                fill_pipe(w, data)
                left = n
                while left:
                    moved = seg.splice_in(OUT, r, len(stream) + n - left, left)
                    assert 0 < moved <= left
                    left -= moved
                stream += data
            else:
                acked = min(len(stream), acked + n)
                seg.release_below(OUT, acked)
            at = acked
            while at < len(stream):
                piece = seg.read_at(OUT, at, len(stream) - at)
                assert piece == stream[at : at + len(piece)] and piece
                at += len(piece)
    finally:
        seg.close()
        os.close(r)
        os.close(w)


@pytest.mark.timeout(60)
@pytest.mark.root
def test_splice_into_a_full_disk_leaves_the_pipe_intact(tmp_path: Path, pipe: tuple[int, int]) -> None:
    """ENOSPC from splice must not eat the job's bytes: they stay in the pipe
    for the memory path to read."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        r, w = pipe
        seg = Segments(mnt / "seg", segment_size=4 << 20, natural=True)
        data = os.urandom(768 << 10)
        fill_pipe(w, data)
        (mnt / "filler").write_bytes(b"\0" * ((1 << 20) - (256 << 10)))  # leaves less than the payload
        spliced = 0
        with pytest.raises(OSError) as caught:
            for _ in range(100):
                spliced += seg.splice_in(OUT, r, spliced, 1 << 20)
        assert caught.value.errno == errno.ENOSPC
        assert 0 <= spliced < len(data)
        rest = b""
        while len(rest) < len(data) - spliced:
            rest += os.read(r, 1 << 20)
        placed = b""
        while len(placed) < spliced:
            placed += seg.read_at(OUT, len(placed), spliced - len(placed))
        assert placed + rest == data, "every byte is either in the segment or still in the pipe"
        seg.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- the spool ------------------------------------------------------------------------


def test_spool_records_extents_and_reads_them_back(tmp_path: Path, pipe: tuple[int, int]) -> None:
    r, w = pipe
    path = tmp_path / f"j{SPOOL_SUFFIX}"
    spool = Spool.create(path, job(), STREAMS, segment_size=64 << 10)
    assert spool.natural
    segments = spool.segments
    assert segments is not None
    head = os.urandom(5000)
    bulk = os.urandom(200_000)
    fill_pipe(w, bulk)
    extents = []
    at = len(head)
    while at < len(head) + len(bulk):
        moved = segments.splice_in(OUT, r, at, 1 << 20)
        extents.append(Extent(OUT, at, at + moved))
        at += moved
    assert len(extents) >= 4, "extents end at segment ends"
    spool.commit([Chunk(OUT, 0, head), *extents, Chunk(ERR, 0, b"err")])
    assert b"".join(c.data for c in spool.read(OUT, 0, 1 << 30)) == head + bulk
    spool.close()
    again = Spool.open(path)
    assert again.natural and again.segments is not None and again.segments.segment_size == 64 << 10
    assert again.streams()[OUT].appended == len(head) + len(bulk)
    assert b"".join(c.data for c in again.read(OUT, 0, 1 << 30)) == head + bulk
    # Nothing may be placed over bytes already spooled: refused before a byte is written.
    with pytest.raises(SpoolError, match="already spooled"):
        again.commit([Chunk(OUT, 100, b"x" * 10)])
    with pytest.raises(SpoolError, match="already spooled"):
        again.commit([Extent(OUT, len(head) + len(bulk), len(head) + len(bulk) + 10), Chunk(OUT, 0, b"x")])
    assert b"".join(c.data for c in again.read(OUT, 0, 1 << 30)) == head + bulk
    # An acknowledged segment goes; the bytes after it stay readable.
    again.commit(acked={OUT: 150_000})
    assert not again.segments.path(OUT, 0).exists()
    assert b"".join(c.data for c in again.read(OUT, 150_000, 1 << 30))[-1000:] == bulk[-1000:]
    again.close()


def test_spool_of_an_earlier_version_is_delivered_through_its_rows(tmp_path: Path) -> None:
    """A spool without a segment size (made before natural layout) placed
    chunk after chunk; its rows say where. It is read through them, its
    segments are freed as acknowledgements come, and it takes no new bytes."""
    path = tmp_path / f"old{SPOOL_SUFFIX}"
    spool = Spool.create(path, job(), STREAMS)
    spool.db.execute("UPDATE job SET segment_size = NULL")
    # As the appending layout left them: b"hello " and b"world" back to back in segment 0, b"!" in segment 1.
    seg_dir = Path(f"{path}.seg")
    seg_dir.mkdir()
    (seg_dir / f"{OUT}-0").write_bytes(b"hello world")
    (seg_dir / f"{OUT}-1").write_bytes(b"!")
    spool.db.conn.executemany(
        'INSERT INTO chunks (stream, start, "end", data, seg, pos) VALUES (?, ?, ?, ?, ?, ?)',
        [(OUT, 0, 6, b"", 0, 0), (OUT, 6, 11, b"", 0, 6), (OUT, 11, 12, b"", 1, 0)],
    )
    spool.db.execute("UPDATE streams SET appended = 12 WHERE id = ?", [OUT])
    spool.close()
    old = Spool.open(path)
    assert not old.natural
    assert b"".join(c.data for c in old.read(OUT, 0, 100)) == b"hello world!"
    with pytest.raises(ValueError, match="natural layout"):
        old.commit([Extent(OUT, 12, 20)])
    with pytest.raises(ValueError, match="takes no new bytes"):
        old.commit([Chunk(OUT, 12, b"more")])
    old.commit(acked={OUT: 11})
    assert sorted(p.name for p in seg_dir.iterdir()) == [f"{OUT}-1"], "segment 0 is all delivered"
    assert b"".join(c.data for c in old.read(OUT, 11, 100)) == b"!"
    old.commit(acked={OUT: 12})
    assert list(seg_dir.iterdir()) == []
    old.close()


def open_descriptors(under: Path) -> tuple[int, int, int]:
    """(descriptors of this process open on files under `under`, of them to
    deleted files, and the bytes those deleted files still hold on disk)."""
    count = deleted = held = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if not target.startswith(str(under)):
                continue
            count += 1
            if target.endswith(" (deleted)"):
                deleted += 1
                held += os.fstat(int(name)).st_blocks * 512
        except OSError:
            continue  # (closed meanwhile: the listing's own descriptor)
    return count, deleted, held


async def test_reading_back_and_acknowledging_many_segments_leaves_no_descriptor_nor_blocks(tmp_path: Path) -> None:
    """The sender reads a backlog back through the spooler's second
    connection while the writer releases what home acknowledged: one
    `Segments` for both, so every released segment's descriptor is closed
    (before: one descriptor per segment read, to a deleted file holding its
    blocks), and the descriptors open at once stay few however long the
    backlog."""
    from gcwrap.agent import segments as segments_mod
    from gcwrap.agent.spooler import Spooler

    size = 64 << 10
    # 200 segments of 64 KiB, not of 16 MiB
    spooler = Spooler(tmp_path / f"j{SPOOL_SUFFIX}", job(), STREAMS, tuning=SpoolTuning(segment_size=size))
    await spooler.ensure()
    assert spooler.spool is not None and spooler.spool.segments is not None
    assert spooler.spool.segments.segment_size == size
    data = os.urandom(200 * size)
    for at in range(0, len(data), 8 * size):
        await spooler.commit([Chunk(OUT, at, data[at : at + 8 * size])], {}, [], {})
    seg_dir = tmp_path / f"j{SPOOL_SUFFIX}.seg"
    assert len(list(seg_dir.iterdir())) == 200
    # Read the whole backlog back (a sender far ahead of home's acknowledgements)...
    got = bytearray()
    most_open = 0
    while len(got) < len(data):
        for c in await spooler.read(OUT, len(got), size):
            got += c.data[len(got) - c.start :]
        most_open = max(most_open, open_descriptors(seg_dir)[0])
    assert bytes(got) == data
    assert most_open <= segments_mod.MAX_OPEN, f"{most_open} segment descriptors open at once"
    # ...then home acknowledges it, a segment at a time, reading on as a resend would.
    for at in range(0, len(data), size):
        await spooler.commit([], {OUT: at + size}, [], {})
        if at + size < len(data):
            assert (await spooler.read(OUT, at + size, 1))[0].start == at + size
    assert [p.name for p in seg_dir.iterdir()] == [f"{OUT}-spare"]
    count, deleted, held = open_descriptors(seg_dir)
    assert (deleted, held) == (0, 0), f"{deleted} descriptors to deleted segments hold {held} bytes"
    assert count <= 1, "only the spare's"
    spooler.close(remove=True)


def test_a_descriptor_in_use_is_never_closed_under_its_user(tmp_path: Path) -> None:
    """Past max_open the least recently used descriptors are closed, but
    never one pinned by a reader or writer; a segment released while one is
    pinned has its descriptor closed by the last user."""
    seg = Segments(tmp_path / "seg", segment_size=100, natural=True, max_open=2)
    seg.place_at(OUT, 0, bytes(range(250)) * 2)  # segments 0..4
    with seg.opened_at(OUT, 0) as (fd0, _, _):
        for at in (100, 200, 300, 400):
            assert seg.read_at(OUT, at, 1) == bytes([(at % 250)])
            assert len(seg.fds) <= 3 and fd0 in seg.fds.values(), "pinned: kept open past max_open"
        assert os.pread(fd0, 3, 0) == b"\x00\x01\x02"
        seg.keep_spares = False
        seg.release_below(OUT, 100)  # (never while in use, but if it were...)
        assert os.pread(fd0, 3, 0) == b"\x00\x01\x02", "...its user can still read"
    with pytest.raises(OSError):
        os.fstat(fd0)  # closed by its last user
    assert len(seg.fds) <= 2
    # A segment whose descriptor was closed is opened again, with its bytes, for writing as for reading.
    seg.place_at(OUT, 150, b"X")
    assert seg.read_at(OUT, 100, 100) == (bytes(range(250)) * 2)[100:150] + b"X" + (bytes(range(250)) * 2)[151:200]
    seg.close()


# -- the spooler's zero-copy I/O ------------------------------------------------------


async def test_spooler_moves_bytes_inline_and_in_threads_when_the_disk_is_slow(
    tmp_path: Path, pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import trio

    from gcwrap.agent.spooler import Spooler

    r, w = pipe
    spooler = Spooler(tmp_path / f"j{SPOOL_SUFFIX}", job(), STREAMS)
    await spooler.ensure()
    assert spooler.zero_copy, "a spool this run made, of natural layout"
    segments = spooler.spool.segments  # type: ignore[union-attr]
    assert segments is not None
    threads: list[int] = []
    splice_in = segments.splice_in

    def traced(*args: int) -> int:
        threads.append(threading.get_ident())
        return splice_in(*args)

    monkeypatch.setattr(segments, "splice_in", traced)
    data = os.urandom(300_000)
    fill_pipe(w, data)
    limiter = trio.CapacityLimiter(1)
    first = await spooler.splice(OUT, r, 0, 100_000, limiter)
    assert first == 100_000 and threads == [threading.get_ident()], "inline: no worker thread"
    # A disk that made one operation slow sends the next ones to a worker thread.
    spooler.tuning = dataclasses.replace(spooler.tuning, slow_io=-1.0)
    second = await spooler.splice(OUT, r, first, 100_000, limiter)
    assert spooler.slow_until > trio.current_time()
    moved = first + second
    while moved < len(data):
        moved += await spooler.splice(OUT, r, moved, 1 << 20, limiter)
    assert threads[2] != threading.get_ident(), "slow disk: in a worker thread"
    # sendfile, in a thread now, then inline again once the hold has passed.
    a, b = socket_pair()
    got = bytearray()
    sent = 0
    for round_ in range(2):
        if round_:
            spooler.slow_until = -1.0
            spooler.tuning = dataclasses.replace(spooler.tuning, slow_io=10.0)
        end = len(data) if round_ else 100_000
        while sent < end:
            sent += await sendfile_placed(spooler, a.fileno(), OUT, sent, end - sent)
            got += b.recv(1 << 20)
    while len(got) < len(data):
        got += b.recv(1 << 20)
    assert bytes(got) == data
    # Where sendfile is not supported the same bytes are copied instead.
    real_sendfile = os.sendfile

    def unsupported(*args: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "sendfile", unsupported)
    got = bytearray()
    sent = 0
    while sent < len(data):
        sent += await sendfile_placed(spooler, a.fileno(), OUT, sent, len(data) - sent)
        got += b.recv(1 << 20)
    while len(got) < len(data):
        got += b.recv(1 << 20)
    assert bytes(got) == data and spooler.no_sendfile
    monkeypatch.setattr(os, "sendfile", real_sendfile)
    # A dead peer is the network's failure, not the disk's.
    b.close()
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(100):
            await sendfile_placed(spooler, a.fileno(), OUT, 0, 100_000)
    a.close()
    # A read of a byte the segments do not hold is the spool's failure.
    with pytest.raises(SpoolError):
        await spooler.read_placed(OUT, 50 << 20, 1000)
    spooler.close(remove=True)


def unsent(sock: socket.socket | int) -> int:
    """Bytes in the socket's send queue the kernel has not sent yet (SIOCOUTQNSD)."""
    buf = array.array("i", [0])
    fcntl.ioctl(sock if isinstance(sock, int) else sock.fileno(), 0x894B, buf)
    return buf[0]


@pytest.mark.timeout(30)
async def test_a_sendfile_cut_short_holds_nothing_back_on_an_idle_connection(tmp_path: Path) -> None:
    """DATA frames from the segment file on a connection with nothing in
    flight, as line output sends them once it has caught up with the job:
    the header goes with MSG_MORE, then sendfile, which the send queue cuts
    short (trio's TCP_NOTSENT_LOWAT of 16 KiB). What it queued must go out
    at once: held back for "more to come" (less than a segment, from a
    position that is not page-aligned), nothing in flight would bring an ACK
    to release it, and the socket does not become writable while it waits:
    the sender would stall until the kernel's probe timer, 200 ms."""
    import trio

    from gcwrap.agent.spooler import Spooler

    spooler = Spooler(tmp_path / f"j{SPOOL_SUFFIX}", job(), STREAMS)
    await spooler.ensure()
    segments = spooler.spool.segments  # type: ignore[union-attr]
    assert segments is not None
    data = os.urandom(4 << 20)
    segments.place_at(OUT, 0, data)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    client = await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1])  # (as the agent's)
    server = await listeners[0].accept()
    sock = client.socket
    raw = socket.socket(fileno=os.dup(sock.fileno()))
    got = bytearray()

    async def receive() -> None:
        while True:
            got.extend(await server.receive_some(1 << 20))

    async def send_frame(offset: int, size: int) -> tuple[int, int, int]:
        """Header and payload as the sender sends them; what the first
        sendfile took, and the send queue's unsent and unacknowledged bytes then."""
        header = b"H" * 14
        assert raw.send(header, socket.MSG_MORE) == len(header)
        first = await sendfile_placed(spooler, sock.fileno(), OUT, offset, size)
        held = (first, unsent(sock), send_queue(sock))
        done = first
        while done < size:
            with trio.fail_after(5):
                await trio.lowlevel.wait_writable(sock)
            done += await sendfile_placed(spooler, sock.fileno(), OUT, offset + done, size - done)
        expect.extend(header + data[offset : offset + size])
        return held

    expect = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        await send_frame(0, 1 << 20)
        # Positions that are not page-aligned: the first piece sendfile
        # queues is then less than a segment (65 483 bytes on loopback).
        for offset in (2328, (1 << 20) + 100, (2 << 20) + 4095):
            with trio.fail_after(5):
                while len(got) < len(expect) or send_queue(sock):
                    await trio.sleep(0.001)
            first, left, queued = await send_frame(offset, 1 << 20)
            assert 0 < first < 1 << 20, "the send queue cut the sendfile short (the case under test)"
            assert not (left and left == queued), f"{left} bytes held back with nothing in flight to release them"
        with trio.fail_after(5):
            while len(got) < len(expect):
                await trio.sleep(0.001)
        nursery.cancel_scope.cancel()
    assert bytes(got) == bytes(expect)
    raw.close()
    for listener in listeners:
        await listener.aclose()
    await client.aclose()
    await server.aclose()
    spooler.close(remove=True)


async def test_zero_copy_commits_run_inline_unless_large_or_the_disk_is_slow(
    tmp_path: Path, pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import trio

    from gcwrap.agent.spooler import Spooler

    r, w = pipe
    spooler = Spooler(tmp_path / f"j{SPOOL_SUFFIX}", job(), STREAMS)
    spool = await spooler.ensure()
    here = threading.get_ident()
    threads: list[int] = []
    commit = spool.commit

    def traced(*args: object, **kwargs: object) -> None:
        threads.append(threading.get_ident())
        commit(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(spool, "commit", traced)
    data = os.urandom(200_000)
    fill_pipe(w, data)
    moved = 0
    while moved < len(data):
        moved += await spooler.splice(OUT, r, moved, 1 << 20, trio.CapacityLimiter(1))
    # Extents and acknowledgements: rows only, in the event loop's thread.
    await spooler.commit([Extent(OUT, 0, moved)], {}, [], {})
    assert threads == [here]
    # More output bytes than inline_commit: a worker thread writes them.
    big = os.urandom(spooler.tuning.inline_commit + 1)
    await spooler.commit([Chunk(ERR, 0, big)], {}, [], {})
    assert threads[-1] != here
    # A commit slower than slow_io sends the next ones to a worker thread too.
    spooler.tuning = dataclasses.replace(spooler.tuning, slow_io=-1.0)
    await spooler.commit([], {OUT: 100_000}, [], {})
    assert threads[-1] == here and spooler.slow_until > trio.current_time()
    await spooler.commit([], {OUT: 150_000}, [], {})
    assert threads[-1] != here
    # A spool this run did not make (a resume) always commits in a thread.
    spooler.slow_until = -1.0
    spooler.created = False
    await spooler.commit([], {OUT: 160_000}, [], {})
    assert threads[-1] != here and len(threads) == 5
    # Every one of them was recorded, wherever it ran.
    again = Spool.open(spooler.path)
    try:
        assert again.streams()[OUT].acked == 160_000
        rows = again.read(OUT, 160_000, 1 << 20)  # (from the row that holds byte 160 000)
        assert b"".join(c.data for c in rows)[160_000 - rows[0].start :] == data[160_000:]
        assert b"".join(c.data for c in again.read(ERR, 0, 1 << 20)) == big
    finally:
        again.close()
    spooler.close(remove=True)


def test_room_looks_up_free_space_at_most_every_ttl_while_the_disk_has_plenty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gcwrap.agent.spooler import Spooler

    looked: list[str] = []
    statvfs = os.statvfs

    def counted(path: str | Path) -> os.statvfs_result:
        looked.append(str(path))
        return statvfs(path)

    monkeypatch.setattr(os, "statvfs", counted)
    spooler = Spooler(tmp_path / f"j{SPOOL_SUFFIX}", job(), STREAMS, min_free=0,
                      tuning=SpoolTuning(room_plenty=1, room_ttl=3600.0))  # (any room is plenty)
    first = spooler.room(0).bytes
    assert first > 0 and spooler.room(0).bytes == first and spooler.room(0).bytes == first
    assert len(looked) == 1, "within the TTL: one statvfs"
    looked_at = spooler._statvfs[0] if spooler._statvfs else None
    spooler.room(0)
    assert spooler._statvfs is not None and spooler._statvfs[0] == looked_at, "the age is the lookup's, not the call's"
    spooler.tuning = dataclasses.replace(spooler.tuning, room_ttl=0.0)
    spooler.room(0)
    assert len(looked) == 2, "past the TTL: looked up again"
    # Tight (less than room_plenty on offer): every call looks.
    spooler.tuning = dataclasses.replace(spooler.tuning, room_ttl=3600.0, room_plenty=1 << 62)
    spooler.room(0)  # (the figure cached above, found tight)
    before = len(looked)
    for _ in range(3):
        spooler.room(0)
    assert len(looked) == before + 3
    # A full disk is never remembered either.
    spooler.min_free = 1 << 62
    room = spooler.room(0)
    assert room.bytes == 0 and "disk nearly full" in room.reason
    spooler.min_free = 0
    spooler.tuning = dataclasses.replace(spooler.tuning, room_plenty=1)
    room = spooler.room(0)
    assert room.bytes > 0 and room.reason == ""
    spooler.close()


def socket_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    return a, b


# -- the agent's view -----------------------------------------------------------------


def test_outstream_with_extents() -> None:
    out = OutStream(OUT, "stdout", "o")
    out.append(b"line\n")
    out.append_extent(1000)
    out.append_extent(500)
    out.append(b"tail")
    assert out.read_end == 5 + 1500 + 4 and out.mem_bytes == 9, "extents take no memory"
    assert out.unsafe_bytes == out.read_end
    assert out.from_memory(0, 1 << 20) == Chunk(OUT, 0, b"line\n"), "memory stops at an extent"
    assert out.from_memory(5, 1 << 20) is None and out.from_memory(700, 1 << 20) is None
    assert out.placed_end(5) == 1505 and out.placed_end(700) == 1505
    assert out.placed_end(0) == 0, "bytes in memory are not placed"
    assert out.from_memory(1505, 1 << 20) == Chunk(OUT, 1505, b"tail")
    kinds = [type(c).__name__ for c in coalesce(out.unspooled(1 << 20), 1 << 20)]
    assert kinds == ["Chunk", "Extent", "Extent", "Chunk"]
    out.mark_spooled(1505)
    assert out.placed_end(5) == 1505 and out.unsafe_bytes == 4
    out.ack(1200)
    assert out.placed_end(1200) == 1505
    assert [type(c).__name__ for c in out.mem] == ["Extent", "Chunk"]
    out.ack(1509)
    assert not out.mem and out.mem_bytes == 0


# -- end to end -----------------------------------------------------------------------


def shadow_summary(home: Path, job_id: str) -> dict[str, str]:
    jobs = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                          check=True, timeout=60)
    (rec,) = [j for j in json.loads(jobs.stdout) if j["job_id"] == job_id]
    return rec["summary"]


@pytest.mark.timeout(180)
def test_bulk_output_goes_zero_copy_and_lines_do_not(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    args = ["--shadow", shadow.address, "--spool", str(spool_dir), "--retry-timeout", "1"]
    bulk = Wrapper([*args, "--job-id", "zc-bulk", "--stdout", "bulk.out", "--stderr", "bulk.err", "--",
                    *genjob(60 * MB, 10 * MB, seed=21)])
    lines = Wrapper([*args, "--job-id", "zc-lines", "--stdout", "lines.out", "--",
                     "python3", "-c", "import sys\nfor i in range(2000): print(i, flush=True)"])
    assert bulk.wait(150) == 0, bulk.err.decode()
    assert lines.wait(60) == 0, lines.err.decode()
    assert sha256_file(home / "bulk.out") == expected(60 * MB, 21)
    assert sha256_file(home / "bulk.err") == expected(10 * MB, 22)
    assert (home / "lines.out").read_text() == "".join(f"{i}\n" for i in range(2000))
    assert float(shadow_summary(home, "zc-bulk")["zero_copy_pct"]) > 50
    assert float(shadow_summary(home, "zc-lines")["zero_copy_pct"]) == 0
    assert list(spool_dir.glob("*")) == [], "delivered: spool, segments and spares are gone"


@pytest.mark.timeout(180)
def test_zero_copy_over_tls(home: Path, tmp_path: Path) -> None:
    """TLS cannot sendfile: spliced bytes are read back and sent through it."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    pem = tmp_path / "server.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["--tls-cert", str(pem)])
    sh.start()
    try:
        w = Wrapper(["--shadow", sh.address, "--spool", str(tmp_path / "spool"), "--job-id", "zc-tls",
                     "--tls-ca", str(tmp_path / "ca.pem"), "--stdout", "tls.out", "--",
                     *genjob(40 * MB, 0, seed=5)])
        assert w.wait(150) == 0, w.err.decode()
        assert sha256_file(home / "tls.out") == expected(40 * MB, 5)
        assert float(shadow_summary(home, "zc-tls")["zero_copy_pct"]) > 50
    finally:
        sh.stop()


@pytest.mark.timeout(120)
def test_resume_when_home_holds_more_than_the_spool_recorded(shadow: ShadowProc, home: Path,
                                                            spool_dir: Path) -> None:
    """A wrapper killed between sending bytes and committing them (commits
    gather for up to 10 ms) leaves a spool that knows less than home holds.
    `gcwrap resume` must accept that, not refuse the job as a length
    mismatch, and land nothing twice."""
    import sqlite3
    import time

    from helpers import file_size, spool_status, wait_until

    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "ahead", "--retry-timeout",
                 "0.5", "--stdout", "ahead.out", "--", "sh", "-c",
                 f"{' '.join(genjob(MB, 0, seed=33))}; exec sleep 60 2>/dev/null"])
    wait_until(lambda: file_size(home / "ahead.out") == MB, 60, "the job's output at home")
    wait_until(lambda: spool_status(spool_dir)[0]["streams"][0]["acked"] == MB, 30,  # type: ignore[index]
               "the acknowledgement recorded")
    w.kill9()
    # As if killed before the last commits: the spool recorded only the first 600 kB.
    (path,) = spool_dir.glob("*.spool")
    db = sqlite3.connect(path)
    db.execute('DELETE FROM chunks WHERE "end" > 600000')
    db.execute("UPDATE streams SET appended = 600000, acked = 0")
    db.commit()
    db.close()
    started = time.monotonic()
    res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--retry-timeout", "0.5",
                          "--retry-limit", "3"], capture_output=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr.decode()
    assert time.monotonic() - started < 30
    assert sha256_file(home / "ahead.out") == expected(MB, 33), "home keeps its bytes, none written twice"
    assert list(spool_dir.glob("*.spool")) == []


async def test_without_splice_support_bulk_output_is_read_into_memory(
    shadow: ShadowProc, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system whose files take no splice (EINVAL): gcwrap reads into
    memory instead, says so once, and calls none of it a disk failure."""
    from gcwrap.agent.agent import AgentOptions
    from gcwrap.agent.run import run_job

    calls = []

    def unsupported(self: Segments, *args: int) -> int:
        calls.append(args)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(Segments, "splice_in", unsupported)
    host, port = shadow.address.rsplit(":", 1)
    opts = AgentOptions(shadows=((host, int(port)),), stdout="nosplice.out", retry_timeout=0.5)
    record = JobRecord(job_id="nosplice", instance="00112233445566ff", command=["genjob"])
    outcome = await run_job(opts, genjob(20 * MB, 0, seed=44), record, tmp_path / f"nosplice{SPOOL_SUFFIX}")
    assert outcome.status == 0, outcome.message
    assert sha256_file(home / "nosplice.out") == expected(20 * MB, 44)
    assert len(calls) == 1, "tried once, then never again"
    assert outcome.stats["zero_copy_pct"] == 0


@pytest.mark.timeout(120)
def test_an_ack_for_bytes_never_sent_is_refused(home: Path, spool_dir: Path) -> None:
    """A shadow that acknowledges bytes the agent has not sent it (a bug, or
    not our shadow) would let gcwrap free segments it still needs: the agent
    refuses it as a length mismatch and keeps the output in the spool."""
    import threading
    import time

    from gcwrap.wire.events import PROTOCOL_VERSION, Ack, Hello, Welcome
    from gcwrap.wire.protocol import NEED_DATA, Connection, Role

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(60)
    port = srv.getsockname()[1]
    stop = threading.Event()

    errors: list[BaseException] = []

    def rogue() -> None:
        try:
            serve()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            proto = Connection(Role.SHADOW)
            hello = None
            while hello is None:
                proto.receive_data(conn.recv(65536))
                while (ev := proto.next_event()) is not NEED_DATA:
                    if isinstance(ev, Hello):
                        hello = ev
            time.sleep(2)  # the job has written its 64 MB by now; none of it was sent yet
            conn.sendall(proto.send(Welcome(PROTOCOL_VERSION, 1, tuple((s.id, 0) for s in hello.streams))))
            conn.sendall(proto.send(Ack(hello.streams[0].id, 50 * MB)))
            stop.wait(30)  # read nothing more: the agent can have sent only what the socket buffers hold

    t = threading.Thread(target=rogue, daemon=True)
    t.start()
    w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool_dir), "--job-id", "rogue",
                 "--retry-timeout", "0.2", "--retry-limit", "1", "--stdout", "r.out", "--",
                 *genjob(64 * MB, 0, seed=3)])
    try:
        rc = w.wait(60)
    finally:
        stop.set()
        srv.close()
        t.join(10)
    assert not errors, errors
    err = w.err.decode()
    assert "the shadow acknowledged 50000000 bytes of stdout, but only" in err and "LENGTH_MISMATCH" in err, err
    assert rc != 0, err
    (spool,) = spool_dir.glob("*.spool")
    assert Spool.open(spool, readonly=True).streams()[OUT].appended == 64 * MB, "the output is kept in the spool"
