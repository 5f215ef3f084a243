"""What the shadow sends on one connection: ACKs inline where it can, and every other frame in order.

When a durability batch is applied (in the event loop), every session it
covers is told (`LiveJob.on_durable`). A `Sender` writes its connection's
ACKs right there, every stream's ACK in one non-blocking write, when
nothing else is being sent on the connection (the send lock is free) and
the connection is a plain socket: no task wakes up, no lock is taken, no
send_all is awaited. Otherwise (a send in flight, TLS, the rest of a write
the socket took only in part) it wakes its task (`run`), which sends them,
coalesced, under the lock.

The task is started the first time it is needed (`attach`; over TLS at
once), and ends without a cancellation when the session does, if it only
waited (`close`): most connections never start it, and a task per
connection, started and cancelled, was a tenth of the shadow's CPU for an
agent's connection (benchmarks/README.md, issue 17, connections).

Every ACK, on either path, is for a length the batch made durable (synced
and recorded), and is sent only while the session still holds its job
(`holds`, checked right before the write). Every other frame goes through
`send`, after whatever an inline write left, so frames never interleave.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import trio

from ..sync import Signal
from ..wire.events import Ack
from ..wire.frames import LocalProtocolError
from ..wire.protocol import Connection
from .durability import LiveJob

FENCED = "a newer connection of this job took over"


class Sender:
    """One connection's ACKs and its send lock (see the module's docstring)."""

    def __init__(self, stream: trio.abc.Stream, conn: Connection, job: LiveJob, holds: Callable[[], bool]) -> None:
        self.stream = stream
        self.conn = conn
        self.job = job
        self.holds = holds  # whether the session still holds its job (the fencing epoch)
        self.lock = trio.Lock()
        self.acked = {sid: sf.durable for sid, sf in job.files.outputs.items()}
        self.fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        self.rest = b""  # what the socket did not take of an inline write: sent before anything else
        self.kick = Signal()  # the task has something to send
        self.sync_acks = 0  # inline writes of ACKs
        self.task_acks = 0  # sends of ACKs by the task
        self.nursery: trio.Nursery | None = None  # where `attach` starts the task when it is needed
        self.started = False  # the task was started (`run`)
        self.waiting = False  # ...and waits for something to send
        self.closing = False  # the session is over: the task ends (`close`)

    def attach(self, nursery: trio.Nursery) -> None:
        """Take the session's ACKs from now on: inline while they can be, by
        the task (`run`, started in `nursery` when first needed) otherwise."""
        self.nursery = nursery
        self.job.on_durable = self.durable
        if self.fd < 0 or self._owed():
            self._wake()

    def close(self) -> None:
        """The session is over: no ACK more. The task ends: by itself if it
        waits for something to send, else cancelled (a send in flight)."""
        self.closing = True
        if self.job.on_durable == self.durable:
            self.job.on_durable = None
        if self.started and not self.waiting and self.nursery is not None:
            self.nursery.cancel_scope.cancel()
        self.kick.fire()

    def _wake(self) -> None:
        """Have the task send what is due, starting it if it is not running."""
        if not self.started and self.nursery is not None and not self.closing:
            self.started = True
            self.nursery.start_soon(self.run)
        self.kick.fire()

    def _owed(self) -> bool:
        """Whether a stream has more durable than acknowledged."""
        return any(sf.durable > self.acked.get(sid, 0) for sid, sf in self.job.files.outputs.items())

    def _check(self) -> None:
        if not self.holds():
            self.job.fence(FENCED)
            self.job.check()

    def _due(self) -> bytes:
        """The ACK frames of every stream with more durable than acknowledged, marked acknowledged."""
        out = b""
        for sid, sf in self.job.files.outputs.items():
            if sf.durable > self.acked.get(sid, 0):
                self.acked[sid] = sf.durable
                out += self.conn.send(Ack(sid, sf.durable))
        return out

    def durable(self) -> None:
        """A batch made more of the session's bytes durable (in the event loop, synchronously)."""
        if self.fd < 0 or self.rest or self.lock.locked() or not self.holds():
            self._wake()  # the task sends them (or, fenced, stops the session)
            return
        try:
            data = self._due()
        except LocalProtocolError:  # (no ACK may follow what was sent: the task reports it, not the batch)
            self._wake()
            return
        if not data:
            return
        try:
            n = os.write(self.fd, data)
        except OSError:  # (a full buffer; or a broken connection, which the task's send_all reports)
            n = 0
        self.sync_acks += 1
        if n < len(data):
            self.rest = data[n:]
            self._wake()

    async def send(self, frame: bytes | Callable[[], bytes], *, check: bool = False) -> None:
        """Send one frame (or what `frame()` makes, under the lock), after
        whatever an inline write left; with `check`, only while the session
        holds its job (checked under the lock, right before the frame is made).

        On a plain socket with nothing else being sent (the lock free,
        nothing left of an earlier write) the frame is written at once, as
        inline ACKs are: no lock, no task switch; what the socket does not
        take goes the usual way, first."""
        if self.fd >= 0 and not self.rest and not self.lock.locked():
            if check:
                self._check()
            data = frame if isinstance(frame, bytes) else frame()
            try:
                n = os.write(self.fd, data)
            except OSError:  # (a full buffer; or a broken connection, which send_all reports)
                n = 0
            if n == len(data):
                return
            self.rest, frame, check = data[n:], b"", False
        async with self.lock:
            if check:
                self._check()
            data, self.rest = self.rest + (frame if isinstance(frame, bytes) else frame()), b""
            await self.stream.send_all(data)

    async def run(self) -> None:
        """Send what the inline path could not, until cancelled or closed;
        the batches call `durable` while this runs."""
        self.started = True
        if not self.closing:
            self.job.on_durable = self.durable
        try:
            while not self.closing:
                due = self._owed()
                if self.rest or due:
                    async with self.lock:
                        # A fenced session acknowledges nothing, not even what it made durable.
                        self._check()
                        data, self.rest = self.rest + self._due(), b""
                        if due:
                            self.task_acks += 1
                        await self.stream.send_all(data)
                elif not self.holds():
                    self._check()
                else:
                    self.waiting = True
                    try:
                        await self.kick.wait()
                    finally:
                        self.waiting = False
        finally:
            self.job.on_durable = None

    async def finish(self) -> None:
        """Complete a frame an inline write left in part, so that whatever
        is said next on the connection (an ERROR) is read whole."""
        if self.rest:
            data, self.rest = self.rest, b""
            with trio.move_on_after(2, shield=True):
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
