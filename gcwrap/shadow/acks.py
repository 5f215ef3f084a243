"""The ACKs of one connection: sent inline where possible, else by a task.

When a durability batch is applied (in the event loop), every session it
covers is told (`LiveJob.acks`). An `Acks` sends the ACKs of its connection
right there, with one non-blocking write of every stream's ACK together,
when nothing else is being sent on the connection (its send lock is free)
and the connection is a plain socket: no task wakes up, no lock is taken,
no send_all is awaited. Otherwise (a send in flight, TLS, a full socket
buffer) it wakes its task (`run`), which sends them under the lock.

Every ACK, inline or not, is for a length the batch made durable (synced
and recorded), and is sent only while the session still holds its job
(`holds`, checked right before the write). Every other frame of the
connection goes through `send`, after the rest of an inline write the
socket took only in part, so frames never interleave.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import trio

from ..sync import Signal
from ..wire.events import Ack
from ..wire.protocol import Connection
from .durability import LiveJob


class Acks:
    """One connection's ACKs and its send lock (see the module's docstring)."""

    def __init__(self, stream: trio.abc.Stream, conn: Connection, job: LiveJob, check: Callable[[LiveJob], None],
                 holds: Callable[[LiveJob], bool], stats: dict[str, int]) -> None:
        self.stream = stream
        self.conn = conn
        self.job = job
        self.check = check  # raises Fenced unless the session holds its job
        self.holds = holds
        self.stats = stats
        self.lock = trio.Lock()
        self.acked = {sid: sf.durable for sid, sf in job.files.outputs.items()}
        self.fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        self.rest = b""  # what the socket did not take of an inline write: sent before anything else
        self.kick = Signal()  # the task has ACKs to send

    def _due(self) -> bytes:
        """The ACK frames of every stream with more durable than acknowledged (marked acknowledged)."""
        out = b""
        for sid, sf in self.job.files.outputs.items():
            if sf.durable > self.acked[sid]:
                self.acked[sid] = sf.durable
                out += self.conn.send(Ack(sid, sf.durable))
        return out

    def durable(self) -> None:
        """A batch made more of the session's bytes durable (called in the event loop, synchronously)."""
        if self.fd < 0 or self.rest or self.lock.locked() or not self.holds(self.job):
            self.kick.fire()  # the task sends them (or, fenced, stops)
            return
        data = self._due()
        if not data:
            return
        try:
            n = os.write(self.fd, data)
        except BlockingIOError:
            n = 0
        except OSError:
            n = 0  # (the task's send_all meets the error and reports it)
        self.stats["acks_inline"] += 1
        if n < len(data):
            self.rest = data[n:]
            self.kick.fire()

    async def send(self, frame: Callable[[], bytes], *, check: bool = False) -> None:
        """Send one frame (made under the lock) after whatever an inline write left."""
        async with self.lock:
            if check:
                self.check(self.job)
            data, self.rest = self.rest + frame(), b""
            await self.stream.send_all(data)

    async def run(self) -> None:
        """Send what the inline path could not; until cancelled."""
        self.job.acks = self
        try:
            while True:
                if self.rest or any(sf.durable > self.acked[sid] for sid, sf in self.job.files.outputs.items()):
                    # A fenced session acknowledges nothing, not even what it made durable.
                    await self.send(self._due, check=True)
                else:
                    await self.kick.wait()
        finally:
            self.job.acks = None

    async def finish(self) -> None:
        """Complete a frame an inline write left in part, so that whatever the
        connection says next (an ERROR) is read whole. Shielded, bounded."""
        if self.rest:
            with trio.move_on_after(2, shield=True):
                data, self.rest = self.rest, b""
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
