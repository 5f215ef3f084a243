"""The shadow: receives the output of any number of jobs and serves their stdin.

One trio task per connection (no process per job). A connection's handler
writes DATA inline with pwrite at the frame's offset (a page-cache write is
cheaper than a thread hop), trims bytes it already has and refuses gaps. One
`Durability` task makes the bytes of every job durable in groups: fdatasync
each dirty file, record the new lengths in the state database, then wake the
handlers so they send ACKs. Nothing is acknowledged before that.

A job id has one active connection at a time: a newer connection of the same
job fences the older one off (it writes nothing more, its handler is
cancelled and its files closed before the newer one reopens them at their
durable length), so two sessions never write one file.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import resource
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from .auth import AllowList, SubjectMap, agent_mac, new_nonce, same, shadow_proof, subject_cn
from .events import (
    Ack,
    Auth,
    Challenge,
    ConnectionClosed,
    Data,
    Done,
    Error,
    ErrorCode,
    Event,
    Exit,
    Hello,
    Ping,
    Pong,
    StdinData,
    StdinRead,
    Welcome,
)
from .protocol import NEED_DATA, PROTOCOL_VERSION, SUPPORTED_VERSIONS, Connection, ProtocolError, Role
from .shadow_store import JobFiles, Store, StoreError, StreamFile, sync_files
from .sync import Signal, first_error

log = logging.getLogger("gcshadow")

# Below glibc's mmap threshold: a larger buffer costs an mmap/munmap per read.
RECEIVE_SIZE = 120 << 10


@dataclass
class ShadowOptions:
    root: Path
    host: str = "127.0.0.1"
    port: int = 50000
    handshake_timeout: float = 10.0
    idle_timeout: float = 60.0
    max_connections: int = 20000
    min_free: int = 64 << 20  # below this much free space at home, new sessions get BUSY
    port_file: Path | None = None
    token: bytes | None = None  # require the token challenge-response (gcwrap.auth)
    tls: ssl.SSLContext | None = None  # TLS (mutual when it requires client certificates)
    allow: AllowList = field(default_factory=AllowList)  # who may connect at all
    subjects: SubjectMap = field(default_factory=SubjectMap)  # certificate CN -> job ids it may write
    quota: int = 0  # bytes one job may write in all (0: no limit)
    max_jobs_per_identity: int = 0  # live jobs per certificate CN, or per host without one (0: no limit)


class Fenced(Exception):
    """This connection must stop: replaced by a newer one, or its files failed."""


@dataclass
class LiveJob:
    """A job with an open connection (or a recent one): its files and waiters."""

    files: JobFiles
    identity: str = ""
    scope: trio.CancelScope | None = None
    durable_changed: Signal = field(default_factory=Signal)
    gone: trio.Event = field(default_factory=trio.Event)
    fenced: str = ""  # why this connection must stop writing, once it must
    finished: bool = False

    def fence(self, why: str) -> None:
        """Stop this connection: no write after this, its handler is cancelled."""
        self.fenced = self.fenced or why
        if self.scope is not None:
            self.scope.cancel()


class Durability:
    """Group commit for every job: sync dirty files, record, then wake ackers."""

    def __init__(self, store: Store, limiter: trio.CapacityLimiter) -> None:
        self.store = store
        self.limiter = limiter
        self.dirty: dict[tuple[str, int], StreamFile] = {}
        self.waiters: dict[str, LiveJob] = {}
        self.wake = Signal()
        self.lock = trio.Lock()  # held while a sync runs: no fd may close under it
        self.batches = 0

    def mark(self, sf: StreamFile, job: LiveJob) -> None:
        self.dirty[(sf.job_id, sf.stream)] = sf
        self.waiters[sf.job_id] = job
        self.wake.fire()

    async def run(self) -> None:
        while True:
            if not self.dirty:
                await self.wake.wait()
                continue
            batch, self.dirty = self.dirty, {}
            jobs, self.waiters = self.waiters, {}
            snapshot = [(sf, sf.written) for sf in batch.values()]
            async with self.lock:
                results = await trio.to_thread.run_sync(sync_files, snapshot, limiter=self.limiter)
                good = [(sf, n) for sf, n, err in results if err is None]
                try:
                    await trio.to_thread.run_sync(
                        self.store.record_durable,
                        [(sf.job_id, sf.stream, n) for sf, n in good],
                        limiter=self.limiter,
                    )
                except Exception as e:  # noqa: BLE001 - the state disk failed: acknowledge nothing
                    log.error("cannot record durable lengths in the state database: %s", e)
                    good = []
                    results = [(sf, n, OSError(errno.EIO, str(e))) for sf, n, _ in results]
            self.batches += 1
            for sf, n in good:
                sf.durable = max(sf.durable, n)
            for sf, n, err in results:
                if err is not None:
                    # After a failed fsync the kernel may have dropped the dirty
                    # pages: nothing past `durable` can be trusted. Cut back and
                    # make the agent resend from there.
                    log.error("cannot sync %s: %s", sf.name, err.strerror)
                    sf.written = sf.durable
                    try:
                        os.ftruncate(sf.fd, sf.durable)
                    except OSError:
                        pass
                    job = jobs.get(sf.job_id)
                    if job:
                        job.fence(f"the shadow could not sync {sf.name}: {err.strerror}")
            for job in jobs.values():
                job.durable_changed.fire()

    async def flush(self, job: LiveJob) -> None:
        """Wait until every byte written for `job` so far is durable."""
        while any(sf.durable < sf.written for sf in job.files.outputs.values()):
            await job.durable_changed.wait()


class Shadow:
    def __init__(self, opts: ShadowOptions, store: Store) -> None:
        self.opts = opts
        self.store = store
        self.limiter = trio.CapacityLimiter(1)
        self.durability = Durability(store, self.limiter)
        self.live: dict[str, LiveJob] = {}
        self.connections = 0
        self.stats = {"accepted": 0, "refused": 0, "bytes": 0}

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        raise_fd_limit()
        await trio.to_thread.run_sync(self.store.mark_disconnected, limiter=self.limiter)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.durability.run)
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, self._handle, self.opts.port, host=self.opts.host)
            )
            port = listeners[0].socket.getsockname()[1]
            log.info("serving %s on %s:%d", self.opts.root, self.opts.host, port)
            if self.opts.port_file is not None:
                tmp = self.opts.port_file.with_name(self.opts.port_file.name + ".tmp")
                tmp.write_text(f"{port}\n")
                tmp.replace(self.opts.port_file)
            task_status.started(port)

    # -- one connection ----------------------------------------------------

    async def _admit(self, tcp: trio.SocketStream, conn: Connection, peer: str, ip: str) -> tuple[
            trio.abc.Stream, str] | None:
        """Allow-list (before a single byte is read), then TLS. Returns the
        stream to speak on and the client certificate's CN, or None."""
        allow = self.opts.allow
        if allow:
            if allow.hosts or allow.suffixes:
                why = await trio.to_thread.run_sync(allow.check, ip)
            else:
                why = allow.check(ip)
            if why:
                self.stats["refused"] += 1
                log.warning("%s: refused before reading: %s", peer, why)
                if self.opts.tls is None:
                    await self._refuse(tcp, conn, ErrorCode.AUTH_FAILED, f"not allowed to connect: {why}", peer)
                return None
        if self.opts.tls is None:
            return tcp, ""
        tls = trio.SSLStream(tcp, self.opts.tls, server_side=True)
        try:
            with trio.fail_after(self.opts.handshake_timeout):
                await tls.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError, OSError) as e:
            self.stats["refused"] += 1
            cause = e.__cause__ or e
            log.warning("%s: TLS handshake failed: %s", peer, cause if str(cause) else type(cause).__name__)
            return None
        return tls, subject_cn(tls.getpeercert())

    async def _handle(self, tcp: trio.SocketStream) -> None:
        try:
            ip, port = tcp.socket.getpeername()[:2]
            peer = f"{ip}:{port}"
        except OSError:
            ip, peer = "", "?"
        conn = Connection(Role.SHADOW)
        self.connections += 1
        stream: trio.abc.Stream = tcp
        try:
            if self.connections > self.opts.max_connections:
                log.warning("%s: too many connections (%d)", peer, self.connections)
                await self._refuse(stream, conn, ErrorCode.BUSY, "too many connections at the shadow", peer,
                                   retry_after=5)
                return
            admitted = await self._admit(tcp, conn, peer, ip)
            if admitted is None:
                return
            stream, cn = admitted
            with first_error():
                await self._serve_connection(stream, conn, peer, cn or ip, cn)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError) as e:
            log.info("%s: connection lost (%s)", peer, e)
        except ProtocolError as e:
            log.warning("%s: protocol error: %s", peer, e)
            await self._refuse(stream, conn, e.code, str(e), peer)
        except StoreError as e:
            self.stats["refused"] += 1
            log.warning("%s: refused: %s", peer, e)
            await self._refuse(stream, conn, e.code, str(e), peer)
        except trio.TooSlowError:
            log.warning("%s: timed out", peer)
            await self._refuse(stream, conn, ErrorCode.TIMEOUT, "timed out waiting for the agent", peer)
        except Fenced as e:
            log.info("%s: connection stopped: %s", peer, e)
            await self._refuse(stream, conn, ErrorCode.FENCED, str(e), peer)
        except OSError as e:
            log.error("%s: I/O error: %s", peer, e)
            await self._refuse(stream, conn, ErrorCode.IO_ERROR, f"shadow I/O error: {e.strerror or e}", peer)
        except Exception as e:  # noqa: BLE001 - one bad connection must not stop the shadow
            log.exception("%s: internal error", peer)
            await self._refuse(stream, conn, ErrorCode.INTERNAL, f"shadow internal error: {type(e).__name__}", peer)
        finally:
            self.connections -= 1
            await trio.aclose_forcefully(stream)
            if stream is not tcp:
                await trio.aclose_forcefully(tcp)

    async def _refuse(
        self, stream: trio.abc.Stream, conn: Connection, code: ErrorCode, message: str, peer: str,
        retry_after: float = 0.0,
    ) -> None:
        with trio.move_on_after(2) as scope:
            scope.shield = True
            try:
                await stream.send_all(conn.send(Error(code, message, retry_after)))
            except Exception:  # noqa: BLE001 - best effort: the peer may be gone
                pass

    async def _next_events(self, stream: trio.abc.Stream, conn: Connection) -> list[Event]:
        data = await stream.receive_some(RECEIVE_SIZE)
        conn.receive_data(data)
        events: list[Event] = []
        while True:
            ev = conn.next_event()
            if ev is NEED_DATA:
                return events
            assert isinstance(ev, Event)
            events.append(ev)
            if isinstance(ev, (ConnectionClosed, Error)):
                return events

    async def _await(
        self, stream: trio.abc.Stream, conn: Connection, kind: type[Event], pending: list[Event]
    ) -> Event | None:
        """The next event, which must be a `kind` (else the agent breaks the
        protocol); None if it closed or gave up. Events that arrived in the
        same read stay in `pending`, in order, for whoever reads next."""
        while not pending:
            pending.extend(await self._next_events(stream, conn))
        ev = pending.pop(0)
        if isinstance(ev, kind):
            return ev
        if isinstance(ev, (ConnectionClosed, Error)):
            return None
        raise ProtocolError(f"expected {kind.__name__}, got {type(ev).__name__}", ErrorCode.UNEXPECTED)

    async def _authenticate(
        self, stream: trio.abc.Stream, conn: Connection, hello: Hello, cn: str, pending: list[Event]
    ) -> str | None:
        """The token challenge-response and the certificate's rights; returns
        the shadow's proof for WELCOME, or None if the agent went away."""
        proof = ""
        token = self.opts.token
        if token is not None:
            if not hello.nonce:
                raise StoreError(ErrorCode.AUTH_FAILED,
                                 "this shadow requires token authentication: start gcwrap with --token-file")
            nonce = new_nonce()
            await stream.send_all(conn.send(Challenge(nonce)))
            auth = await self._await(stream, conn, Auth, pending)
            if auth is None:
                return None
            assert isinstance(auth, Auth)
            if not same(auth.mac, agent_mac(token, hello.nonce, nonce, hello.job_id, hello.instance)):
                raise StoreError(ErrorCode.AUTH_FAILED, "authentication failed: wrong token")
            proof = shadow_proof(token, hello.nonce, nonce)
        if cn and not self.opts.subjects.allows(cn, hello.job_id):
            raise StoreError(ErrorCode.AUTH_FAILED, f"certificate CN={cn} may not write job {hello.job_id}")
        return proof

    async def _serve_connection(
        self, stream: trio.abc.Stream, conn: Connection, peer: str, identity: str, cn: str
    ) -> None:
        pending: list[Event] = []
        with trio.fail_after(self.opts.handshake_timeout):  # the whole handshake: slowloris gets nowhere
            hello = await self._await(stream, conn, Hello, pending)
            if hello is None:
                return
            assert isinstance(hello, Hello)
            proof = await self._authenticate(stream, conn, hello, cn, pending)
            if proof is None:
                return
        busy = self._busy()
        if busy:
            log.warning("%s: job %s told to come back later: %s", peer, hello.job_id, busy)
            await self._refuse(stream, conn, ErrorCode.BUSY, busy, peer, retry_after=10)
            return
        if PROTOCOL_VERSION not in hello.versions:
            raise ProtocolError(
                f"no common protocol version: agent speaks {list(hello.versions)}, shadow {list(SUPPORTED_VERSIONS)}",
                ErrorCode.VERSION_MISMATCH,
            )
        job = await self._claim(hello, peer, identity)
        files = job.files
        session = files.session
        try:
            with trio.CancelScope() as scope:
                job.scope = scope
                durable = tuple((sid, sf.durable) for sid, sf in files.outputs.items())
                welcome = Welcome(PROTOCOL_VERSION, session, durable, self.opts.idle_timeout, proof)
                await stream.send_all(conn.send(welcome))
                log.info("%s: job %s session %d (%s)", peer, files.job_id, session, hello.host or "?")
                send_lock = trio.Lock()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._acker, stream, conn, job, send_lock)
                    await self._receive(stream, conn, job, send_lock, peer, pending)
                    nursery.cancel_scope.cancel()
            if scope.cancelled_caught:
                raise Fenced(job.fenced or "stopped")
        finally:
            if self.live.get(files.job_id) is job:
                del self.live[files.job_id]
                await self._release(job)
            job.gone.set()

    def _busy(self) -> str:
        """Why the shadow cannot take a session now (carrier sense), or ""."""
        if self.opts.min_free:
            try:
                st = os.statvfs(self.opts.root)
            except OSError as e:
                return f"cannot check free space at home: {e.strerror}"
            free = st.f_bavail * st.f_frsize
            if free < self.opts.min_free:
                return f"disk low at home: {free} bytes free, {self.opts.min_free} needed"
        return ""

    async def _claim(self, hello: Hello, peer: str, identity: str) -> LiveJob:
        cap = self.opts.max_jobs_per_identity
        if cap and hello.job_id not in self.live:
            mine = sum(1 for j in self.live.values() if j.identity == identity)
            if mine >= cap:
                raise StoreError(ErrorCode.BUSY, f"{identity} already has {mine} jobs streaming here (the cap is {cap})")
        old = self.live.get(hello.job_id)
        if old is not None:
            # Fence: the older connection writes nothing more (every write
            # checks `fenced`), its handler is cancelled, and its files are
            # closed before this one opens them again.
            old.fence("a newer connection of this job took over")
            with trio.fail_after(10):
                await old.gone.wait()
        files = await trio.to_thread.run_sync(
            lambda: self.store.open_job(
                job_id=hello.job_id,
                instance=hello.instance,
                streams=hello.streams,
                host=hello.host,
                user=hello.user,
                command=list(hello.command),
                peer=peer,
                codes=ErrorCode,
            ),
            limiter=self.limiter,
        )
        job = LiveJob(files, identity)
        self.live[hello.job_id] = job
        self.stats["accepted"] += 1
        return job

    async def _release(self, job: LiveJob) -> None:
        """Close a job's files once nothing can sync them any more."""
        with trio.CancelScope(shield=True):
            async with self.durability.lock:
                self.durability.dirty = {
                    k: v for k, v in self.durability.dirty.items() if v.job_id != job.files.job_id
                }
                state = "finished" if job.finished else "disconnected"
                job.files.close()
            if state == "disconnected":
                try:
                    await trio.to_thread.run_sync(
                        lambda: self.store.record_state(job.files.job_id, state="disconnected", last_seen=time.time()),
                        limiter=self.limiter,
                    )
                except Exception as e:  # noqa: BLE001
                    log.error("cannot record job state: %s", e)

    async def _acker(self, stream: trio.abc.Stream, conn: Connection, job: LiveJob, lock: trio.Lock) -> None:
        acked = {sid: sf.durable for sid, sf in job.files.outputs.items()}
        while True:
            for sid, sf in job.files.outputs.items():
                if sf.durable > acked[sid]:
                    acked[sid] = sf.durable
                    async with lock:
                        await stream.send_all(conn.send(Ack(sid, sf.durable)))
            await job.durable_changed.wait()

    async def _receive(
        self, stream: trio.abc.Stream, conn: Connection, job: LiveJob, lock: trio.Lock, peer: str,
        pending: list[Event],
    ) -> None:
        files = job.files
        while True:
            if pending:  # what arrived with the handshake
                events, pending[:] = list(pending), []
            else:
                with trio.fail_after(self.opts.idle_timeout):
                    events = await self._next_events(stream, conn)
            for ev in events:
                if job.fenced:
                    raise Fenced(job.fenced)
                if isinstance(ev, Data):
                    self._write(job, ev)
                elif isinstance(ev, StdinRead):
                    reply = self._read_stdin(files, ev)
                    async with lock:
                        await stream.send_all(conn.send(reply))
                elif isinstance(ev, Ping):
                    async with lock:
                        await stream.send_all(conn.send(Pong(ev.nonce)))
                elif isinstance(ev, Exit):
                    await self._finish(stream, conn, job, ev, lock, peer)
                    return
                elif isinstance(ev, Error):
                    log.warning("%s: agent reported %s: %s", peer, ev.code.name, ev.message)
                    return
                elif isinstance(ev, ConnectionClosed):
                    return
                elif isinstance(ev, Pong):
                    pass

    def _write(self, job: LiveJob, ev: Data) -> None:
        sf = job.files.outputs.get(ev.stream)
        if sf is None:
            raise ProtocolError(f"DATA for stream {ev.stream}, which the handshake did not declare", ErrorCode.UNKNOWN_STREAM)
        if ev.offset > sf.written:
            raise ProtocolError(
                f"DATA at offset {ev.offset} of {sf.name!r} would leave a gap after byte {sf.written}",
                ErrorCode.OFFSET_GAP,
            )
        skip = sf.written - ev.offset
        if skip >= len(ev.payload):
            return  # a resend of bytes we hold: trimmed, not written twice
        quota = self.opts.quota
        if quota:
            total = sum(f.written for f in job.files.outputs.values())
            if total + len(ev.payload) - skip > quota:
                raise StoreError(ErrorCode.QUOTA, f"job {job.files.job_id} would exceed its quota of {quota} bytes")
        payload = memoryview(ev.payload)[skip:] if skip else ev.payload
        offset = sf.written
        while payload:
            n = os.pwrite(sf.fd, payload, offset)
            offset += n
            sf.written = offset
            payload = payload[n:]
        self.stats["bytes"] += len(ev.payload) - skip
        self.durability.mark(sf, job)

    def _read_stdin(self, files: JobFiles, ev: StdinRead) -> StdinData:
        if files.stdin_fd is None or ev.stream != files.stdin_stream:
            raise ProtocolError(f"STDIN_READ for stream {ev.stream}, which is not the job's stdin", ErrorCode.UNKNOWN_STREAM)
        data = os.pread(files.stdin_fd, ev.max_bytes, ev.offset)
        size = os.fstat(files.stdin_fd).st_size
        return StdinData(ev.stream, ev.offset, data, ev.offset + len(data) >= size)

    async def _finish(
        self, stream: trio.abc.Stream, conn: Connection, job: LiveJob, ev: Exit, lock: trio.Lock, peer: str
    ) -> None:
        files = job.files
        await self.durability.flush(job)
        for sid, length in ev.lengths:
            sf = files.outputs.get(sid)
            if sf is None or sf.durable != length:
                held = sf.durable if sf else 0
                raise ProtocolError(
                    f"EXIT says stream {sid} has {length} bytes, the shadow holds {held}", ErrorCode.LENGTH_MISMATCH
                )
        summary = dict(ev.summary)
        await trio.to_thread.run_sync(
            lambda: self.store.record_state(
                files.job_id, state="finished", ended=time.time(), last_seen=time.time(),
                exit_code=ev.code, exit_signal=ev.signal, reason=ev.reason, summary=summary,
            ),
            limiter=self.limiter,
        )
        status = f"signal {ev.signal}" if ev.signal else f"status {ev.code}" if ev.code is not None else "unknown status"
        log.info("%s: job %s finished with %s", peer, files.job_id, status)
        job.finished = True
        async with lock:
            await stream.send_all(conn.send(Done()))


def raise_fd_limit() -> None:
    """Many jobs hold many files: use the hard descriptor limit, not the soft one."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


async def run_shadow(opts: ShadowOptions, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    store = await trio.to_thread.run_sync(Store, opts.root)
    try:
        with first_error():
            await Shadow(opts, store).serve(task_status=task_status)
    finally:
        store.close()
