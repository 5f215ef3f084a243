"""HTTP/1.1 serving for the shadow's two listeners: `gcshadow web` (web.py)
and `gcshadow serve --metrics` (metrics.py). h11 (sans-I/O) over trio
streams, TLS from trio when asked for.

Theory of operation: one task per connection (`HttpServer.connection`).
Past the server's cap on connections at once, it is handed to `crowded`.
With TLS, the handshake must end within `first_request` seconds. Then the
request loop (`requests`): the first request within `first_request`
seconds of the connection, each next one on a kept-alive connection within
`idle`; a body of at most `max_body` bytes, whole within `first_request`
seconds; each answered by the server's `handle`. An `HttpError` (raised by
`handle`, or for a request h11 cannot parse) is answered with its status,
when no answer is under way yet; the connection is kept for the next
request while h11 says it may be. A client that goes away or stops
reading ends its connection quietly; an internal error is logged and ends
only that connection.

h11 is imported where it is used: the shadow imports this module with
metrics.py whether it serves metrics or not, and h11 comes with an extra.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlsplit

import trio

if TYPE_CHECKING:
    import h11

log = logging.getLogger("gcshadow")


@dataclass(frozen=True)
class Limits:
    """How long and how much one client may take of a listener."""

    first_request: float = 30.0  # seconds a new connection has to send its request (TLS handshake included)
    idle: float = 60.0  # seconds a kept-alive connection may wait for its next request
    send_timeout: float = 60.0  # seconds one write to a client may block before the client is dropped
    max_body: int = 4096  # bytes of a request body
    max_clients: int = 1024  # connections at once; more go to `HttpServer.crowded`
    max_head: int = 16 * 1024  # bytes of a request line and headers
    chunk: int = 64 * 1024  # bytes read from a client at once


class HttpError(Exception):
    """An answer other than success: its status, the message said, and more headers."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or []


@dataclass
class Request:
    """One request, decoded: its method, path, query and headers."""

    method: str
    path: str  # as sent (still percent-encoded)
    parts: list[str]  # path segments, each decoded
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value

    @classmethod
    def parse(cls, ev: h11.Request) -> Request:
        """(UnicodeDecodeError for a path whose percent-encoding is not UTF-8.)"""
        target = ev.target.decode("ascii", "replace")
        split = urlsplit(target)
        parts = [unquote(p, errors="strict") for p in split.path.split("/")[1:]]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in ev.headers}
        return cls(ev.method.decode("ascii", "replace"), split.path, parts, dict(parse_qsl(split.query)), headers)

    def cookie(self, name: str) -> str:
        for item in self.headers.get("cookie", "").split(";"):
            key, _, value = item.strip().partition("=")
            if key == name:
                return value
        return ""

    def bearer(self) -> bytes:
        """The token of an `Authorization: Bearer TOKEN` header, or b""."""
        auth = self.headers.get("authorization", "")
        return auth[7:].strip().encode("latin-1") if auth[:7].lower() == "bearer " else b""


class Http:
    """One HTTP/1.1 connection: h11 driven over a trio stream."""

    def __init__(self, stream: trio.abc.Stream, limits: Limits) -> None:
        import h11

        self.stream = stream
        self.limits = limits
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head)

    async def next_event(self) -> Any:
        import h11

        while True:
            ev = self.conn.next_event()
            if ev is not h11.NEED_DATA:
                return ev
            try:
                data = await self.stream.receive_some(self.limits.chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            self.conn.receive_data(bytes(data))

    async def send(self, *events: Any) -> None:
        data = b"".join(self.conn.send(ev) or b"" for ev in events)
        with trio.fail_after(self.limits.send_timeout):
            await self.stream.send_all(data)

    def can_answer(self) -> bool:
        """No response is under way (once one is, all that is left on an error is to close)."""
        import h11

        return self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE)


def reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class HttpServer:
    """A listener's connections and requests; a server says what to answer
    (`handle`, and `error_body`, `crowded` where its own differ)."""

    name: ClassVar[str] = "http"  # in log lines
    quiet: ClassVar[bool] = False  # failed accepts and TLS handshakes logged at debug only
    always: ClassVar[list[tuple[bytes, bytes]]] = []  # headers of every response

    def __init__(self, limits: Limits, tls: ssl.SSLContext | None) -> None:
        self.limits = limits
        self.tls = tls
        self.clients = 0

    # -- what a server says -------------------------------------------------------

    async def handle(self, http: Http, req: Request, body: bytes) -> None:
        """Answer one request (or raise HttpError)."""
        raise NotImplementedError

    def error_body(self, e: HttpError, req: Request | None) -> tuple[bytes, str]:
        """The body of an error's answer, and its content type (req: None when unparsed)."""
        return f"{e}\n".encode(), "text/plain; charset=utf-8"

    async def crowded(self, tcp: trio.SocketStream) -> None:
        """A connection past `max_clients`: closed at once, unless a server answers it."""

    # -- answers --------------------------------------------------------------------

    def headers(self, content_type: str, length: int | None = None, extra: list[tuple[bytes, bytes]] | None = None,
                cache: bytes = b"no-store") -> list[tuple[bytes, bytes]]:
        out = [(b"Content-Type", content_type.encode()), (b"Cache-Control", cache), *self.always, *(extra or [])]
        if length is not None:
            out.append((b"Content-Length", str(length).encode()))
        return out

    async def respond(self, http: Http, status: int, body: bytes, content_type: str,
                      extra: list[tuple[bytes, bytes]] | None = None, head: bool = False,
                      cache: bytes = b"no-store") -> None:
        import h11

        response = h11.Response(status_code=status, headers=self.headers(content_type, len(body), extra, cache),
                                reason=reason(status))
        await http.send(response, *([] if head else [h11.Data(data=body)]), h11.EndOfMessage())

    async def error(self, http: Http, e: HttpError, req: Request | None = None) -> None:
        import h11

        if not http.can_answer():
            return  # a response is under way: all we can do is close
        body, content_type = self.error_body(e, req)
        try:
            await self.respond(http, e.status, body, content_type, e.headers,
                               head=req is not None and req.method == "HEAD")
        except (h11.LocalProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            pass

    # -- connections ---------------------------------------------------------------

    async def accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as e:  # out of descriptors: wait for some to close
                    log.log(logging.DEBUG if self.quiet else logging.WARNING,
                            "%s: cannot accept connections for now: %s", self.name, e.strerror or e)
                    await trio.sleep(0.5)
                    continue
                nursery.start_soon(self.connection, stream)

    async def connection(self, tcp: trio.SocketStream) -> None:
        self.clients += 1
        stream: trio.abc.Stream = tcp
        try:
            if self.clients > self.limits.max_clients:
                await self.crowded(tcp)
                return
            if self.tls is not None:
                stream = trio.SSLStream(tcp, self.tls, server_side=True)
                try:
                    with trio.fail_after(self.limits.first_request):
                        await stream.do_handshake()
                except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError, OSError) as e:
                    log.log(logging.DEBUG if self.quiet else logging.INFO, "%s: TLS handshake failed: %s",
                            self.name, e.__cause__ or e)
                    return
            await self.requests(Http(stream, self.limits))
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, ConnectionError,
                ssl.SSLError):
            pass  # the client went away, or stopped reading
        except Exception:  # one bad connection (an I/O error on a file...) must not stop the listener
            log.exception("%s: internal error", self.name)
        finally:
            self.clients -= 1
            await trio.aclose_forcefully(stream)

    async def requests(self, http: Http) -> None:
        import h11

        wait = self.limits.first_request
        while True:
            with trio.move_on_after(wait):
                try:
                    ev = await http.next_event()
                except h11.RemoteProtocolError as e:
                    await self.error(http, HttpError(e.error_status_hint, str(e)))
                    return
            if not isinstance(ev, h11.Request):  # ConnectionClosed, or the wait ran out
                return
            req: Request | None = None
            try:
                req = Request.parse(ev)
                body = await self._body(http)
                await self.handle(http, req, body)
            except HttpError as e:
                await self.error(http, e, req)
            except (h11.RemoteProtocolError, UnicodeDecodeError) as e:
                await self.error(http, HttpError(400, f"bad request: {e}"))
            if http.conn.our_state is h11.MUST_CLOSE:
                return
            try:
                http.conn.start_next_cycle()
            except h11.ProtocolError:
                return
            wait = self.limits.idle

    async def _body(self, http: Http) -> bytes:
        import h11

        body = b""
        with trio.fail_after(self.limits.first_request):
            while True:
                ev = await http.next_event()
                if isinstance(ev, h11.EndOfMessage):
                    return body
                if isinstance(ev, h11.Data):
                    body += ev.data
                    if len(body) > self.limits.max_body:
                        raise HttpError(413, "request body too large")
                else:
                    raise HttpError(400, "the request ended early")
