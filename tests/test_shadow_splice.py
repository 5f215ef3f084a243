"""DATA payloads spliced from the socket into their file (gcwrap/shadow/splicer.py).

The pipe in between, over real loopback TCP sockets; its fallback where the
file takes no splice (EINVAL, injected) and its state after a failed write;
the protocol's hand-over of a payload still in the socket; and a real
gcshadow fed large frames in odd pieces and cut mid-payload.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import ShadowProc, file_size, wait_until
from rawagent import RawAgent

from gcwrap.shadow.splicer import Splicer
from gcwrap.wire.events import Ack, Data, DataPiece, Hello, StreamSpec, Welcome
from gcwrap.wire.protocol import MAGIC, Connection, Role, encode


@pytest.fixture
def tcp() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected loopback TCP pair: (sending end, non-blocking receiving end)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    b.setblocking(False)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _take_all(sp: Splicer, sock: socket.socket, fd: int, at: int, n: int) -> None:
    """Splice n bytes from the socket into fd at `at`, waiting for them to arrive."""
    while n:
        try:
            got = sp.take(sock.fileno(), n)
        except BlockingIOError:
            select.select([sock], [], [], 5)  # (nothing yet: wait for the socket)
            continue
        assert got > 0
        sp.put(fd, at, got)
        at += got
        n -= got


@pytest.mark.timeout(30)
def test_socket_bytes_land_at_their_offset_through_the_pipe(tmp_path: Path,
                                                            tcp: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp
    data = os.urandom(3 << 20)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    sp = Splicer()
    try:
        os.pwrite(fd, b"head", 0)
        a.sendall(data)
        _take_all(sp, b, fd, 4, len(data))
        assert os.pread(fd, len(data) + 10, 0) == b"head" + data
        assert sp.pipe is not None and not sp.refused
        with pytest.raises(BlockingIOError):
            os.read(sp.pipe[0], 1)  # left empty for the next connection
        a.close()
        assert sp.take(b.fileno(), 1 << 20) == 0  # the connection's end
    finally:
        sp.close()
        os.close(fd)


@pytest.mark.timeout(30)
def test_where_files_take_no_splice_the_pipe_is_read_out_and_written(
        tmp_path: Path, tcp: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """EINVAL from splice into the file (a file system without it): the bytes
    already in the pipe are read out and pwritten, none lost, and the
    splicer says it is refused (the shadow then reads payloads as before)."""
    real = os.splice

    def no_file_splice(src: int, dst: int, count: int, **kw: Any) -> int:
        if "offset_dst" in kw:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(src, dst, count, **kw)

    monkeypatch.setattr(os, "splice", no_file_splice)
    a, b = tcp
    data = os.urandom(1 << 20)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    sp = Splicer()
    try:
        a.sendall(data)
        _take_all(sp, b, fd, 0, len(data))
        assert sp.refused
        assert os.pread(fd, len(data) + 1, 0) == data
    finally:
        sp.close()
        os.close(fd)


@pytest.mark.timeout(30)
def test_a_failed_write_closes_the_pipe_with_what_it_held(
        tmp_path: Path, tcp: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC: the error is the caller's, and the bytes left in the pipe are
    not written later at another connection's offset."""
    real = os.splice
    full = [True]

    def disk_full(src: int, dst: int, count: int, **kw: Any) -> int:
        if "offset_dst" in kw and full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, count, **kw)

    monkeypatch.setattr(os, "splice", disk_full)
    a, b = tcp
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    sp = Splicer()
    try:
        a.sendall(b"x" * 100_000)
        select.select([b], [], [], 5)
        n = sp.take(b.fileno(), 100_000)
        with pytest.raises(OSError) as e:
            sp.put(fd, 0, n)
        assert e.value.errno == errno.ENOSPC and sp.pipe is None and not sp.refused
        full[0] = False
        a.sendall(b"y" * 10)
        _take_all(sp, b, fd, 0, 100_000 - n + 10)
        assert os.pread(fd, 1 << 20, 0) == b"x" * (100_000 - n) + b"y" * 10
    finally:
        sp.close()
        os.close(fd)


def _streaming() -> Connection:
    conn = Connection(Role.SHADOW, pieces=True)
    conn.receive_data(MAGIC + encode(Hello("j", "i", (StreamSpec(1, "stdout", "o"),))))
    assert isinstance(conn.next_event(), Hello)
    conn.send(Welcome(1, 1, ((1, 0),), 10.0))
    return conn


def test_a_payload_still_in_the_socket_is_named_and_handed_over() -> None:
    """After a DATA frame's head, `payload_due` names the payload's rest;
    bytes the caller took from the socket (`took_payload`) are skipped, and
    what is received after comes out at its own offset."""
    conn = _streaming()
    frame = encode(Data(1, 100, bytes(range(200))))
    head = len(frame) - 200
    for i in range(head):  # the head byte by byte
        assert conn.payload_due() is None
        conn.receive_data(frame[i:i + 1])
        assert conn.events() == []
    assert conn.payload_due() == (1, 100, 100, 300)
    conn.took_payload(150)
    assert conn.payload_due() == (1, 250, 100, 300)
    conn.receive_data(frame[head + 150:head + 160])
    assert conn.payload_due() is None  # (bytes held here: they come out first)
    [piece] = conn.events()
    assert isinstance(piece, DataPiece) and (piece.offset, bytes(piece.payload)) == (250, bytes(range(150, 160)))
    assert conn.payload_due() == (1, 260, 100, 300)
    conn.took_payload(40)
    assert conn.payload_due() is None
    conn.receive_data(encode(Data(1, 300, b"z")))
    [whole] = conn.events()
    assert isinstance(whole, DataPiece) and (whole.offset, whole.start, whole.end) == (300, 300, 301)


def _hello(job: str, out: str) -> Hello:
    return Hello(job_id=job, instance="i1", streams=(StreamSpec(1, "stdout", out),), host="test")


@pytest.mark.timeout(90)
def test_large_frames_in_odd_pieces_land_and_a_cut_frame_leaves_what_arrived(shadow: ShadowProc,
                                                                            home: Path) -> None:
    """A real gcshadow: 1 MiB frames whose heads come byte by byte and whose
    payloads come in pieces, each piece in the file at its offset before the
    next is sent; a frame cut mid-payload leaves exactly what arrived, and
    only whole frames are acknowledged."""
    a = RawAgent(shadow.port)
    a.send(_hello("splice", "s.out"))
    assert isinstance(a.until(Welcome), Welcome)
    a.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = home / "s.out"
    one, two = os.urandom(1 << 20), os.urandom(1 << 20)
    frame = encode(Data(1, 0, one))
    head = len(frame) - len(one)
    for i in range(head):
        a.sock.sendall(frame[i:i + 1])
    at = 0
    for cut in (1, 70_000, 300_000, 700_000, 1 << 20):  # payload bytes sent so far
        a.sock.sendall(frame[head + at:head + cut])
        at = cut
        wait_until(lambda n=at: file_size(out) >= n, 30, f"{at} bytes in the file")  # type: ignore[misc]
    assert a.until(Ack) == Ack(1, 1 << 20)
    frame = encode(Data(1, 1 << 20, two))
    a.sock.sendall(frame[:head + 200_000])
    wait_until(lambda: file_size(out) >= (1 << 20) + 200_000, 30, "the cut frame's first bytes")
    a.sock.sendall(frame[head + 200_000:head + 456_789])
    wait_until(lambda: file_size(out) >= (1 << 20) + 456_789, 30, "the cut frame's second piece")
    a.close()
    assert out.read_bytes() == one + two[:456_789]
    b = RawAgent(shadow.port)
    b.send(_hello("splice", "s.out"))
    w = b.until(Welcome)
    assert isinstance(w, Welcome) and w.durable == ((1, 1 << 20),)
    b.close()
