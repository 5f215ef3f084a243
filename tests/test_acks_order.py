"""A connection's frames stay whole when an inline ACK write is cut short (gcwrap/shadow/acks.py).

An ACK written from a durability batch's apply goes out with one
non-blocking write; when the socket takes only part of it, the rest goes
out before any other frame (a PONG, an ERROR after `finish`), so the agent
reads whole frames in order. And an ACK that may no longer be sent (the
connection is CLOSED after DONE) never raises into the batch's apply. A
frame sent "checked" (DONE) is made only once the send lock is held and the
session still holds its job: a fenced one makes and sends nothing.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import trio
import trio.testing
from test_acks import _pair

from gcwrap.shadow import acks
from gcwrap.shadow.acks import Sender
from gcwrap.shadow.durability import Fenced, LiveJob
from gcwrap.shadow.files import JobFiles, StreamFile
from gcwrap.wire.events import Ack, Done, Event, Exit, Pong
from gcwrap.wire.protocol import NEED_DATA, Connection


def _job(tmp_path: Path) -> tuple[LiveJob, StreamFile]:
    job = LiveJob("j")
    files = JobFiles("j", str(tmp_path), session=1)
    sf = StreamFile.__new__(StreamFile)
    sf.durable = 0
    files.outputs = {1: sf}
    job.files = files
    return job, sf


def _read_all(sock: trio.socket.SocketType, agent: Connection) -> list[Event]:
    data = b""
    while True:
        try:
            chunk = os.read(sock.fileno(), 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    out: list[Event] = []
    if not data:  # (b"" would tell the agent's connection the peer closed)
        return out
    agent.receive_data(data)
    while (ev := agent.next_event()) is not NEED_DATA:
        out.append(ev)
    return out


@pytest.mark.timeout(30)
def test_an_ack_the_socket_took_in_part_is_finished_before_the_next_frame(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[int] = []

    def write(fd: int, data: bytes) -> int:  # the socket takes 5 bytes of the first write, and nothing after
        n = 5 if not written else 0
        written.append(n)
        if not n:
            raise BlockingIOError
        return os.write(fd, data[:n])

    monkeypatch.setattr(acks, "os", types.SimpleNamespace(write=write))
    agent, shadow = _pair()
    job, sf = _job(tmp_path)

    async def main() -> None:
        left, right = trio.socket.socketpair()
        os.set_blocking(right.fileno(), False)
        sender = Sender(trio.SocketStream(left), shadow, job, lambda: True)
        # (no task: what the inline write left must go out with the next frame sent)
        sf.durable = 100
        sender.durable()
        assert written == [5] and sender.sync_acks == 1
        await sender.send(shadow.send(Pong(7)))
        sf.durable = 200
        sender.durable()  # cut to nothing: all of it is left for later
        assert written == [5, 0]
        await sender.finish()
        assert _read_all(right, agent) == [Ack(1, 100), Pong(7), Ack(1, 200)]
        left.close()
        right.close()

    trio.run(main)


@pytest.mark.timeout(30)
def test_an_ack_after_done_does_not_raise_into_the_batch(tmp_path: Path) -> None:
    agent, shadow = _pair()
    job, sf = _job(tmp_path)

    async def main() -> None:
        left, right = trio.socket.socketpair()
        os.set_blocking(right.fileno(), False)
        sender = Sender(trio.SocketStream(left), shadow, job, lambda: True)
        shadow.receive_data(agent.send(Exit(code=0, signal=None, lengths=((1, 0),))))
        assert isinstance(shadow.next_event(), Exit)
        await sender.send(shadow.send(Done()))
        sf.durable = 100
        sender.durable()  # the connection is CLOSED: no ACK, and no exception in the batch's apply
        assert _read_all(right, agent) == [Done()]
        left.close()
        right.close()

    trio.run(main)


@pytest.mark.timeout(30)
def test_a_checked_frame_is_made_under_the_lock_and_never_by_a_fenced_session(tmp_path: Path) -> None:
    agent, shadow = _pair()
    job, _ = _job(tmp_path)
    holding = [True]

    async def main() -> None:
        left, right = trio.socket.socketpair()
        os.set_blocking(right.fileno(), False)
        sender = Sender(trio.SocketStream(left), shadow, job, lambda: holding[0])
        shadow.receive_data(agent.send(Exit(code=0, signal=None, lengths=((1, 0),))))
        assert isinstance(shadow.next_event(), Exit)

        async def done() -> None:
            with pytest.raises(Fenced):
                await sender.send(lambda: shadow.send(Done()), check=True)

        async with trio.open_nursery() as nursery, sender.lock:  # a send in flight: DONE waits for the lock...
            nursery.start_soon(done)
            await trio.testing.wait_all_tasks_blocked()
            holding[0] = False  # ...and the session is fenced meanwhile
        assert job.fenced and _read_all(right, agent) == []
        assert shadow.state.value == "exiting"  # no DONE was even made
        left.close()
        right.close()

    trio.run(main)
