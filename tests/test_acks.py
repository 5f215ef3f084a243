"""A connection's ACKs (gcwrap/shadow/acks.py), in process, over a socket pair.

When a durability batch is applied and nothing is being sent on the
connection, its ACKs are written right there, with no task woken; while a
send is in flight they wait for it and go out coalesced, one per stream;
and a session that no longer holds its job acknowledges nothing, on either
path. A length is acknowledged only once synced and recorded.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing

from gcwrap.shadow.acks import Sender
from gcwrap.shadow.durability import Durability, Fenced, LiveJob
from gcwrap.shadow.files import JobFiles, StreamFile
from gcwrap.shadow.state import Store
from gcwrap.sync import worst_error
from gcwrap.wire.events import Ack, Event, Hello, Pong, StreamSpec, Welcome
from gcwrap.wire.protocol import Connection, Role


def _pair() -> tuple[Connection, Connection]:
    """An agent's and a shadow's connection, past the handshake."""
    agent, shadow = Connection(Role.AGENT), Connection(Role.SHADOW)
    shadow.receive_data(agent.send(Hello("j", "i", (StreamSpec(1, "stdout", "out"),))))
    assert isinstance(shadow.next_event(), Hello)
    agent.receive_data(shadow.send(Welcome(1, 1, ((1, 0),), 10.0)))
    assert isinstance(agent.next_event(), Welcome)
    return agent, shadow


@dataclass
class Rig:
    """A job with one output open in a Store, an agent's and a shadow's
    connection past the handshake, and the job as the durability batches
    see it."""

    store: Store
    files: JobFiles
    agent: Connection
    shadow: Connection
    job: LiveJob

    @property
    def sf(self) -> StreamFile:
        return self.files.outputs[1]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    store = Store(tmp_path)
    files = store.open_job(job_id="j", instance="i", host="h", user="u", command=[], peer="p",
                           streams=[StreamSpec(1, "stdout", "out")])
    job = LiveJob("j")
    job.files = files
    try:
        yield Rig(store, files, *_pair(), job)
    finally:
        files.close()
        store.close()


@contextlib.contextmanager
def _sockets() -> Iterator[tuple[trio.socket.SocketType, trio.socket.SocketType]]:
    """The shadow's end and the agent's (non-blocking, read by _received)."""
    left, right = trio.socket.socketpair()
    os.set_blocking(right.fileno(), False)
    try:
        yield left, right
    finally:
        left.close()
        right.close()


def _received(sock: trio.socket.SocketType, agent: Connection) -> list[Event]:
    """The frames waiting in the agent's socket, read without waiting."""
    try:
        data = os.read(sock.fileno(), 65536)
    except BlockingIOError:
        return []
    agent.receive_data(data)
    return agent.events()


def _recorded(root: Path) -> int:
    db = sqlite3.connect(f"file:{root / '.gcshadow' / 'state.db'}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT durable FROM streams WHERE job_id = 'j'").fetchone()[0])
    finally:
        db.close()


async def _batch(durability: Durability, sf: StreamFile, job: LiveJob, data: bytes) -> None:
    """Write `data`, mark the file, and wait until a batch covering it is applied."""
    os.pwrite(sf.fd, data, sf.written)
    sf.written += len(data)
    want = durability.batches + 1
    durability.mark(sf, job)
    while durability.batches < want:
        await durability.done.wait()


@pytest.mark.timeout(30)
def test_acks_go_out_at_once_coalesced_and_never_from_a_fenced_session(rig: Rig, tmp_path: Path) -> None:
    sf, agent, job = rig.sf, rig.agent, rig.job
    holding = [True]

    async def main() -> None:
        with _sockets() as (left, right), trio.fail_after(20):
            durability = Durability(rig.store)
            stream = trio.SocketStream(left)
            sender = Sender(stream, rig.shadow, job, lambda: holding[0])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(durability.run)
                with pytest.raises(Fenced), worst_error():
                    async with trio.open_nursery() as connection:
                        connection.start_soon(sender.run)
                        await trio.testing.wait_all_tasks_blocked()

                        # Nothing in flight: the batch's apply writes the ACK itself.
                        await _batch(durability, sf, job, b"a" * 100)
                        assert (sender.sync_acks, sender.task_acks) == (1, 0)
                        assert _received(right, agent) == [Ack(1, 100)]
                        assert _recorded(tmp_path) >= 100

                        # A send in flight (the lock held): no synchronous write; the
                        # ack task sends one ACK for both batches once it is done.
                        async with sender.lock:
                            await _batch(durability, sf, job, b"b" * 100)
                            await _batch(durability, sf, job, b"c" * 100)
                            await trio.testing.wait_all_tasks_blocked()
                            assert _received(right, agent) == []
                            assert sender.sync_acks == 1
                        await trio.testing.wait_all_tasks_blocked()
                        assert _received(right, agent) == [Ack(1, 300)]
                        assert sender.task_acks == 1
                        assert _recorded(tmp_path) >= 300

                        # Fenced: the batch is applied, yet nothing is acknowledged,
                        # and the ack task stops the session.
                        holding[0] = False
                        await _batch(durability, sf, job, b"d" * 100)
                        with trio.fail_after(5):
                            await trio.sleep_forever()
                assert sf.durable == 400
                assert _received(right, agent) == []
                assert (sender.sync_acks, sender.task_acks) == (1, 1)
                assert job.on_durable is None
                nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.timeout(30)
def test_the_ack_task_starts_only_when_needed_and_ends_uncancelled(rig: Rig) -> None:
    """Attached to a session, a Sender acknowledges inline with no task at
    all; the task starts the first time an ACK has to wait (a send in
    flight), and when the session closes it ends by itself, not cancelled."""
    sf, agent, job = rig.sf, rig.agent, rig.job

    async def main() -> None:
        with _sockets() as (left, right), trio.fail_after(20):
            durability = Durability(rig.store)
            sender = Sender(trio.SocketStream(left), rig.shadow, job, lambda: True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(durability.run)
                async with trio.open_nursery() as connection:
                    sender.attach(connection)
                    await _batch(durability, sf, job, b"a" * 100)
                    assert _received(right, agent) == [Ack(1, 100)]
                    assert not sender.started and not connection.child_tasks, "a task for inline ACKs"
                    async with sender.lock:  # a send in flight: the ACK waits for the task
                        await _batch(durability, sf, job, b"b" * 100)
                        assert sender.started
                    await trio.testing.wait_all_tasks_blocked()
                    assert _received(right, agent) == [Ack(1, 200)]
                    assert (sender.sync_acks, sender.task_acks) == (1, 1)
                    sender.close()
                assert not connection.cancel_scope.cancel_called, "the waiting task was cancelled"
                assert job.on_durable is None
                await _batch(durability, sf, job, b"c" * 100)  # after the session: nothing sent, no task
                assert _received(right, agent) == []
                nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.timeout(30)
def test_the_collector_freezes_what_lives_and_thaws_it_again() -> None:
    """What survived is frozen (collections walk only what is newer), young
    garbage cycles are collected before, not frozen; frozen objects go back
    to the collector at every thaw, and when the shadow stops."""
    import gc
    import weakref

    from gcwrap.shadow.collector import keep_collections_short

    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the collector frees it

    async def main() -> None:
        gc.unfreeze()
        garbage = Node()
        gone = weakref.ref(garbage)
        del garbage
        kept = [Node() for _ in range(100)]
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_collections_short, 0.05, 0.3)
                while gc.get_freeze_count() == 0:
                    await trio.sleep(0.01)
                assert gone() is None, "a garbage cycle was frozen instead of collected"
                assert all(gc.is_tracked(k) for k in kept)
                while gc.get_freeze_count() != 0:  # the thaw
                    await trio.sleep(0.01)
                while gc.get_freeze_count() == 0:  # frozen again
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        assert gc.get_freeze_count() == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))  # virtual time: no race with the poll


@pytest.mark.timeout(60)
def test_the_collector_walks_the_old_generation_only_at_the_thaws() -> None:
    """Under the collector no full collection walks what survived the young
    generations, however much of it there is (it waits for the next freeze);
    a garbage cycle that reached the old generation is freed at the thaw."""
    import gc
    import weakref

    from gcwrap.shadow.collector import keep_collections_short

    class Node:
        def __init__(self) -> None:
            self.me = self

    full: list[int] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    async def main() -> None:
        gc.unfreeze()
        with trio.fail_after(10_000):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(keep_collections_short, 1000, 2000)
                await trio.testing.wait_all_tasks_blocked()
                gc.callbacks.append(watch)
                try:
                    old = Node()
                    gone = weakref.ref(old)
                    gc.collect(1)  # it is in the old generation now...
                    del old  # ...and garbage there
                    kept = [[Node()] for _ in range(300_000)]  # many collections of the young generations
                    assert not full, "a full collection walked the old generation between freezes"
                    assert gc.get_count()[2] > 10, "the test made too few collections of the middle generation"
                    while gone() is not None:  # freed at the thaw (virtual time: no race with the poll)
                        await trio.sleep(100)
                    assert len(kept) == 300_000
                finally:
                    gc.callbacks.remove(watch)
                nursery.cancel_scope.cancel()
        assert gc.get_freeze_count() == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.timeout(30)
def test_a_frame_goes_out_at_once_when_nothing_else_is_being_sent(rig: Rig) -> None:
    """On a plain socket with nothing being sent, a frame (a WELCOME, PONG,
    DONE) is written right away, with no lock taken and no task switch;
    while a send is in flight it waits for it, and follows it."""
    agent, shadow = rig.agent, rig.shadow

    async def main() -> None:
        with _sockets() as (left, right), trio.fail_after(10):
            sender = Sender(trio.SocketStream(left), shadow, rig.job, lambda: True)
            with trio.testing.assert_no_checkpoints():
                await sender.send(shadow.send(Pong(1)))
            assert _received(right, agent) == [Pong(1)]
            async with trio.open_nursery() as nursery, sender.lock:  # a send in flight
                nursery.start_soon(sender.send, shadow.send(Pong(2)))
                await trio.testing.wait_all_tasks_blocked()
                assert _received(right, agent) == []
            assert _received(right, agent) == [Pong(2)]

    trio.run(main)


@pytest.mark.timeout(30)
def test_an_ack_the_socket_had_no_room_for_goes_out_whole_before_the_next_frame(rig: Rig) -> None:
    """The synchronous write finds the socket's buffer full: the ack task
    sends the ACK once there is room, and a reply sent meanwhile follows it,
    whole (no frame is interleaved with another)."""
    sf, agent, shadow, job = rig.sf, rig.agent, rig.shadow, rig.job
    got: list[Event] = []

    async def main() -> None:
        with _sockets() as (left, right), trio.fail_after(20):
            junk = 0
            while True:  # fill the shadow's side until the kernel takes no more
                try:
                    junk += os.write(left.fileno(), b"\0" * 4096)
                except BlockingIOError:
                    break
            durability = Durability(rig.store)
            sender = Sender(trio.SocketStream(left), shadow, job, lambda: True)
            both = trio.Event()

            async def read() -> None:
                skip = junk
                while len(got) < 2:
                    await trio.lowlevel.wait_readable(right)
                    data = os.read(right.fileno(), 65536)
                    assert data
                    cut = min(skip, len(data))
                    assert data[:cut] == b"\0" * cut
                    skip -= cut
                    if data[cut:]:  # (an empty read would say the connection ended)
                        agent.receive_data(data[cut:])
                        got.extend(agent.events())
                both.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(durability.run)
                nursery.start_soon(sender.run)
                await trio.testing.wait_all_tasks_blocked()
                await _batch(durability, sf, job, b"a" * 100)
                assert sender.rest, "the socket had room after all"
                nursery.start_soon(read)  # makes room
                await sender.send(shadow.send(Pong(7)))  # behind the ACK, whichever task sends that
                await both.wait()
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert got == [Ack(1, 100), Pong(7)]
