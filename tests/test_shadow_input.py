"""No frame an agent sends makes the shadow answer INTERNAL (or any transient code).

A transient code tells the agent to back off and try again; for a frame that
is simply malformed the agent would retry forever. So every frame, with
boundary values in every numeric field, sent to a connected session of the
real shadow (`Shadow` over a real `Store`, its durability thread running)
is either accepted or refused with a permanent code.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from test_protocol import HEADER, edge_frames

from gcwrap.shadow.admission import ShadowOptions
from gcwrap.shadow.connection import AgentConnection
from gcwrap.shadow.server import Shadow
from gcwrap.shadow.state import Store
from gcwrap.wire.events import Data, Error, ErrorCode, Event, Exit, Hello, StreamSpec, Welcome
from gcwrap.wire.protocol import NEED_DATA, Connection, Role, decode, encode


async def one_session(shadow: Shadow, job: str, frame: tuple[int, bytes]) -> list[Event]:
    """HELLO, three bytes of stdout, the frame, then EXIT: what the shadow said
    (read to the end, frame by frame, with no state machine in the way)."""
    client, server = trio.testing.memory_stream_pair()
    conn = Connection(Role.AGENT)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                try:
                    await AgentConnection(shadow, server, "fuzz", "fuzz").serve()
                finally:
                    await trio.aclose_forcefully(server)  # as AgentConnection.run does

            nursery.start_soon(serve)
            streams = (StreamSpec(1, "stdout", f"{job}.out"), StreamSpec(2, "stderr", f"{job}.err"),
                       StreamSpec(0, "stdin", "in.txt"))
            await client.send_all(conn.send(Hello(job_id=job, instance="i", streams=streams, host="h")))
            while (welcome := conn.next_event()) is NEED_DATA:
                conn.receive_data(await client.receive_some(65536))
            assert isinstance(welcome, Welcome), welcome
            ftype, body = frame
            # Past our own state machine: the frame as any peer could send it.
            try:
                await client.send_all(encode(Data(1, 0, b"abc")) + HEADER.pack(len(body) + 1, ftype) + body
                                      + encode(Exit(0, None, ((1, 3), (2, 0)))))
                await client.send_eof()  # nothing more: a refusing shadow need not linger for us
            except trio.BrokenResourceError:
                pass
            received = bytearray()
            while chunk := await client.receive_some(65536):
                received += chunk
            await client.aclose()
    got: list[Event] = []
    pos = 0
    while pos + HEADER.size <= len(received):
        length, ftype = HEADER.unpack_from(received, pos)
        got.append(decode(ftype, bytes(received[pos + HEADER.size : pos + 4 + length])))
        pos += 4 + length
    assert pos == len(received), "the shadow sent a partial frame"
    return got


@pytest.mark.timeout(300)
def test_no_input_frame_is_answered_with_a_transient_code() -> None:
    with tempfile.TemporaryDirectory(prefix="gcw-input-") as tmp:
        root = Path(tmp)
        (root / "in.txt").write_bytes(b"0123456789" * 100)
        store = Store(root)
        count = 0
        try:

            @settings(max_examples=1000, deadline=None)
            @given(frame=edge_frames())
            def run(frame: tuple[int, bytes]) -> None:
                nonlocal count
                count += 1
                shadow = Shadow(ShadowOptions(root=root, min_free=0), store)

                async def main() -> list[Event]:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(shadow.durability.run)
                        got = await one_session(shadow, f"fuzz{count}", frame)
                        nursery.cancel_scope.cancel()
                    return got

                got = trio.run(main)
                errors = [ev for ev in got if isinstance(ev, Error)]
                for ev in errors:
                    assert ev.code.permanent, f"{frame}: answered {ev.code.name}: {ev.message}"
                    assert ev.code is not ErrorCode.INTERNAL

            run()
        finally:
            store.close()
    assert count >= 100


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("offset", "max_bytes"), [(1 << 63, 1), ((1 << 64) - 1, 1), ((1 << 63) - 1, 1),
                                                   ((1 << 63) - 100, 1 << 20)])
def test_stdin_read_past_the_largest_offset_is_a_bad_frame(offset: int, max_bytes: int) -> None:
    """It was answered INTERNAL (pread: OverflowError), or IO_ERROR (EINVAL):
    transient codes, so the agent would have retried it forever."""
    import struct

    from gcwrap.wire.protocol import FrameType

    with tempfile.TemporaryDirectory(prefix="gcw-input-") as tmp:
        root = Path(tmp)
        (root / "in.txt").write_bytes(b"stdin")
        store = Store(root)
        try:
            shadow = Shadow(ShadowOptions(root=root, min_free=0), store)
            frame = (FrameType.STDIN_READ, struct.pack("!BQI", 0, offset, max_bytes))

            async def main() -> list[Event]:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(shadow.durability.run)
                    got = await one_session(shadow, "reader", frame)
                    nursery.cancel_scope.cancel()
                return got

            got = trio.run(main)
        finally:
            store.close()
    errors = [ev for ev in got if isinstance(ev, Error)]
    assert errors and errors[0].code is ErrorCode.BAD_FRAME, got


def test_edge_frames_cover_every_frame_type() -> None:
    """The fuzz above can reach every frame type. Asked per type with `find`
    (a search until one is drawn), not by counting what 200 random draws
    happened to hold: a type missing from that sample was chance, not a gap."""
    from hypothesis import find
    from hypothesis.errors import NoSuchExample

    from gcwrap.wire.protocol import FrameType

    missing = []
    for ftype in FrameType:
        try:
            find(edge_frames(), lambda frame, t=int(ftype): frame[0] == t,
                 settings=settings(max_examples=2000, deadline=None, database=None))
        except NoSuchExample:
            missing.append(ftype)
    assert not missing, f"edge_frames() never draws {missing}"
