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
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ..wire.auth import AllowList, SubjectMap, identity_problem, match_token, new_nonce, shadow_proof, subject_cn
from ..wire.events import Auth, Challenge, ErrorCode, Event, Hello
from ..wire.protocol import Connection
from .handshakes import HandshakeMemory, await_event, refuse

log = logging.getLogger("gcshadow")


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
    token: bytes | None = None  # require the token challenge-response (gcwrap.wire.auth)
    tokens: dict[str, bytes] = field(default_factory=dict)  # identity -> its own token (wire.auth.load_token_dir)
    tls: ssl.SSLContext | None = None  # TLS (mutual when it requires client certificates)
    allow: AllowList = field(default_factory=AllowList)  # who may connect at all
    subjects: SubjectMap = field(default_factory=SubjectMap)  # certificate CN -> job ids it may write
    quota: int = 0  # bytes one job may write in all (0: no limit)
    max_jobs_per_identity: int = 0  # live jobs per certificate CN, or per host without one (0: no limit)
    handshake_memory: int = 16 << 20  # bytes all unauthenticated connections together may make the shadow hold


class Refused(Exception):
    """The shadow will not serve this connection (authentication, rights,
    its limits), with the wire code its agent is told."""

    def __init__(self, code: ErrorCode, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after


async def admit(opts: ShadowOptions, tcp: trio.SocketStream, conn: Connection, peer: str,
                ip: str) -> tuple[trio.abc.Stream, str] | None:
    """Allow-list (before a single byte is read), then TLS. Returns the
    stream to speak on and the client certificate's CN, or None (refused:
    logged, and told why when it can be)."""
    allow = opts.allow
    if allow:
        if allow.hosts or allow.suffixes:
            why = await trio.to_thread.run_sync(allow.check, ip)
        else:
            why = allow.check(ip)
        if why:
            log.warning("%s [unauthenticated]: refused before reading: %s", peer, why)
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
        log.warning("%s [unauthenticated]: TLS handshake failed: %s", peer,
                    cause if str(cause) else type(cause).__name__)
        return None
    return tls, subject_cn(tls.getpeercert())



async def authenticate(
    opts: ShadowOptions, tenancy: bool, stream: trio.abc.Stream, conn: Connection, hello: Hello, cn: str,
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
    if tenancy:
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

