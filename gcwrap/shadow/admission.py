"""Who the shadow serves: its options, and the checks a connection passes
before its session (allow-list, TLS, the token and the identity's rights,
free space at home). A refusal here is a `Refused` with the wire code its
agent is told.
"""

from __future__ import annotations

import logging
import os
import random
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ..ranks import Rank, ranked
from ..wire.auth import AllowList, SubjectMap, identity_problem, match_token, new_nonce, shadow_proof, subject_cn
from ..wire.events import Auth, Challenge, ErrorCode, Event, Hello
from ..wire.protocol import Connection
from .handshakes import HandshakeMemory, await_event, refuse
from .pacing import GroupOptions

log = logging.getLogger("gcshadow")


@dataclass
class ShadowOptions:
    """Everything `gcshadow serve` is told: where it listens, its root, its limits and who may connect."""

    root: Path
    host: str = "127.0.0.1"
    port: int = 50000
    handshake_timeout: float = 10.0
    idle_timeout: float = 60.0
    max_connections: int = 20000
    min_free: int = 64 << 20  # below this much free space at home, new sessions get BUSY
    port_file: Path | None = None
    token: bytes | None = None  # require the token challenge-response (gcwrap.wire.auth)
    tokens: dict[str, bytes] = field(default_factory=dict)  # identity -> its own token (wire.auth.load_token_dir)
    tls: ssl.SSLContext | None = None  # TLS (mutual when it requires client certificates)
    allow: AllowList = field(default_factory=AllowList)  # who may connect at all
    subjects: SubjectMap = field(default_factory=SubjectMap)  # certificate CN -> job ids it may write
    quota: int = 0  # bytes one job may write in all (0: no limit)
    max_jobs_per_identity: int = 0  # live jobs per certificate CN, or per host without one (0: no limit)
    handshake_memory: int = 16 << 20  # bytes all unauthenticated connections together may make the shadow hold
    grouping: GroupOptions = field(default_factory=GroupOptions)  # durable groups under bulk output (no option)

    @property
    def tenancy(self) -> bool:
        """With identities (per-identity tokens, or client certificates), each
        identity's files are under ROOT/<identity>/; without, under ROOT."""
        return bool(self.tokens) or (self.tls is not None and self.tls.verify_mode == ssl.CERT_REQUIRED)


@ranked(Rank.PROTOCOL)
class Refused(Exception):
    """The shadow will not serve this connection (authentication, rights,
    its limits), with the wire code its agent is told."""

    def __init__(self, code: ErrorCode, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


async def admit(opts: ShadowOptions, tcp: trio.SocketStream, conn: Connection, peer: str, ip: str,
                refused: Callable[[str, str], None]) -> tuple[trio.abc.Stream, str] | None:
    """Allow-list (before a single byte is read), then TLS. Returns the
    stream to speak on and the client certificate's CN, or None (refused:
    logged, told why when it can be, and `refused(code, message)`)."""
    allow = opts.allow
    if allow:
        if allow.hosts or allow.suffixes:
            why = await trio.to_thread.run_sync(allow.check, ip)
        else:
            why = allow.check(ip)
        if why:
            log.warning("%s [unauthenticated]: refused before reading: %s", peer, why,
                        extra={"peer": peer, "code": ErrorCode.AUTH_FAILED.name})
            refused(ErrorCode.AUTH_FAILED.name, f"not allowed to connect: {why}")
            if opts.tls is None:
                await refuse(tcp, conn, ErrorCode.AUTH_FAILED, f"not allowed to connect: {why}")
            return None
    if opts.tls is None:
        return tcp, ""
    tls = trio.SSLStream(tcp, opts.tls, server_side=True)
    try:
        with trio.fail_after(opts.handshake_timeout):
            await tls.do_handshake()
    except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError, OSError) as e:
        cause = e.__cause__ or e
        said = str(cause) if str(cause) else type(cause).__name__
        log.warning("%s [unauthenticated]: TLS handshake failed: %s", peer, said, extra={"peer": peer, "code": "TLS"})
        refused("TLS", f"TLS handshake failed: {said}")
        return None
    return tls, subject_cn(tls.getpeercert())



async def authenticate(
    opts: ShadowOptions, stream: trio.abc.Stream, conn: Connection, hello: Hello, cn: str,
    pending: list[Event], memory: HandshakeMemory,
) -> tuple[str, str] | None:
    """The token challenge-response and the identity's rights; returns
    the shadow's proof for WELCOME and the identity (its certificate's
    CN, or the name of its token; "" if none), or None if the agent went away."""
    proof = ""
    identity = cn
    tokens = opts.tokens or ({"": opts.token} if opts.token is not None else {})
    if tokens:
        if not hello.nonce:
            raise Refused(ErrorCode.AUTH_FAILED,
                          "this shadow requires token authentication: start gcwrap with --token-file")
        nonce = new_nonce()
        await stream.send_all(conn.send(Challenge(nonce)))
        auth = await await_event(stream, conn, Auth, pending, memory)
        if auth is None:
            return None
        assert isinstance(auth, Auth)
        found = match_token(tokens, auth.mac, hello.nonce, nonce, hello.job_id, hello.instance)
        if found is None:
            raise Refused(ErrorCode.AUTH_FAILED, "authentication failed: wrong token")
        name, token = found
        if name:  # a token of its own names the identity; a certificate must name the same one
            if cn and cn != name:
                raise Refused(ErrorCode.AUTH_FAILED,
                              f"authentication failed: the token of {name} came with the certificate of CN={cn}")
            identity = name
        proof = shadow_proof(token, hello.nonce, nonce)
    if opts.tenancy:
        why = identity_problem(identity) if identity else "the client certificate names no subject CN"
        if why:
            raise Refused(ErrorCode.AUTH_FAILED, f"authentication failed: {why}")
    if identity and not opts.subjects.allows(identity, hello.job_id):
        what = f"certificate CN={identity}" if identity == cn else f"identity {identity}"
        raise Refused(ErrorCode.AUTH_FAILED, f"{what} may not write job {hello.job_id}")
    return proof, identity



def disk_busy(opts: ShadowOptions) -> str:
    """Why the shadow cannot take a session now (carrier sense), or ""."""
    if opts.min_free:
        try:
            st = os.statvfs(opts.root)
        except OSError as e:
            return f"cannot check free space at home: {e.strerror}"
        free = st.f_bavail * st.f_frsize
        if free < opts.min_free:
            return f"disk low at home: {free} bytes free, {opts.min_free} needed"
    return ""



def retry_after() -> float:
    """When a refused agent should come back: spread, so they do not return together."""
    return round(random.uniform(1.0, 4.0), 2)



GROUP_MAX = 128  # job handshakes committed together at most: the state lock is held for one group at a time


class _Waiting:
    """One request in `GroupCommit`'s queue."""

    __slots__ = ("done", "request", "result", "taken", "woken")

    def __init__(self, request: Any) -> None:
        self.request = request
        self.taken = False  # in a group that went to the worker: its result will come
        self.done = False
        self.result: Any = None
        self.woken = trio.Event()  # its own: set when its result came, or when it may lead the next group

    async def wait(self) -> None:
        """Until woken (the caller checks again why: no wake-up is lost, as
        nothing awaits between its check and this)."""
        self.woken = trio.Event()
        await self.woken.wait()


class GroupCommit:
    """Requests that share one worker, served in groups: whoever finds no
    group in flight runs everything queued meanwhile as one call of `run`
    (a list of requests -> a list of results, each a value or an exception),
    through `worker` (the shadow's one state thread). A thousand agents
    connecting at once cost a few state transactions, not a thousand.

    Cancellation is what `trio.to_thread.run_sync` gives one request: a
    waiter cancelled before its group started leaves the queue, and nothing
    was done for it; once its group started, its result is waited for
    (shielded) and returned, so that whatever it opened is in its caller's
    hands (to be closed). A group whose leader is cancelled before `run`
    started goes back to the queue, for another waiter to lead.

    A finished group wakes its own waiters and the first one queued (who
    leads the next group), not every waiter: ten thousand agents exiting
    at once cost O(n) task wake-ups, not O(n^2 / group size)."""

    def __init__(self, run: Callable[[list[Any]], list[Any]],
                 worker: Callable[[Callable[[], list[Any]]], Awaitable[list[Any]]], limit: int = GROUP_MAX) -> None:
        self.run = run
        self.worker = worker
        self.limit = limit
        self.queue: list[_Waiting] = []
        self.busy = False  # a group is in flight
        self.groups = 0  # groups run
        self.requests = 0  # requests served in them

    async def submit(self, request: Any) -> Any:
        """The result of `request`, or its exception raised."""
        me = _Waiting(request)
        self.queue.append(me)
        try:
            while not me.done:
                if self.busy or me.taken:
                    await me.wait()
                else:
                    await self._lead()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):  # its group is in flight: its result will come...
                while me.taken and not me.done:
                    await me.wait()
            if not me.done:  # ...unless the group went back to the queue before it ran
                if me in self.queue:
                    self.queue.remove(me)
                self._next()  # (it may have been the one woken to lead)
                raise
        if isinstance(me.result, BaseException):
            raise me.result
        return me.result

    async def _lead(self) -> None:
        group, self.queue = self.queue[: self.limit], self.queue[self.limit:]
        for w in group:
            w.taken = True
        self.busy = True
        started = False

        def call() -> list[Any]:
            nonlocal started
            started = True
            return self.run([w.request for w in group])

        try:
            results = await self.worker(call)
        except BaseException as e:
            if not started:  # cancelled before it ran: nothing was done, the group waits for another leader
                for w in group:
                    w.taken = False
                self.queue[:0] = group
            else:
                for w in group:
                    w.done, w.result = True, RuntimeError(f"a group of job handshakes failed: {e!r}")
            raise
        finally:
            self.busy = False
            for w in group:
                w.woken.set()
            self._next()
        self.groups += 1
        self.requests += len(group)
        for w, r in zip(group, results, strict=True):
            w.done, w.result = True, r

    def _next(self) -> None:
        """Wake the first waiter queued, to lead the next group (none in flight)."""
        if self.queue and not self.busy:
            self.queue[0].woken.set()
