"""`gcshadow web`: the shadow's jobs, live, in a browser; the same as JSON for scripts.

A process of its own that reads the shadow's state and files (webstate.py)
and takes no part in the protocol: it can neither slow nor disturb the
shadow beyond the reads of a `gcshadow jobs`. HTTP/1.1 is h11 (sans-I/O)
over trio streams, with TLS from trio when asked for.

Theory of operation:
- One task polls the state every POLL seconds (in the one worker thread).
  When the shadow committed something, it wakes every open job page at once
  (`changed`, an event replaced after each firing).
- One task per connection reads requests (h11), answers each, and reuses the
  connection (httpserve.py, as the metrics' listener does). Pages and
  static files come from the package (webstatic/); the pages draw
  everything with textContent, so nothing an agent sent (job ids, names,
  commands, output) is ever parsed as HTML.
- A job page holds one server-sent event stream (`/api/jobs/JOB/events`,
  webevents.py): the last `tail` bytes of each output on open (or from the
  line it links to), then the bytes that became durable since, the job's
  record and timeline whenever they change; `end` once the job finished
  and every byte was sent.
- Files are served only by the name the state holds for a job's stream,
  opened confined to the root (no '..', no symlink, one link only).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import logging
import os
import secrets
import ssl
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qsl, quote

import h11
import trio

from ..wire.auth import is_loopback
from .httpserve import Http, HttpError, HttpServer, Limits, Request
from .webevents import LiveStream, Plan
from .webstate import LineOptions, StateReader, Unservable, open_served

log = logging.getLogger("gcshadow")

POLL = 0.2  # seconds between looks at the state (one tiny query when nothing changed)
# A request within 30 s of connecting (TLS included), the next within 60 s; a body (only the login
# form has one) of 4 KiB at most; 1024 connections at once, more are answered 503.
LIMITS = Limits(first_request=30.0, idle=60.0, send_timeout=60.0, max_body=4096, max_clients=1024)
SESSION_DAYS = 7
COOKIE = "gcshadow_web"

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [
    (b"X-Content-Type-Options", b"nosniff"),
    (b"Referrer-Policy", b"no-referrer"),
    (b"X-Frame-Options", b"DENY"),
    (b"Content-Security-Policy", CSP.encode()),
]
TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}


@dataclass
class WebOptions:
    """Everything `gcshadow web` is told: where it listens, the root or state it reads, how clients
    authenticate."""

    root: Path
    host: str = "127.0.0.1"
    port: int = 8080
    port_file: Path | None = None
    token: bytes | None = None  # required of every client (bearer header, or the cookie the login form sets)
    tls: ssl.SSLContext | None = None  # HTTPS; client certificates when it requires them
    client_certs: bool = False  # `tls` requires a client certificate: that authenticates
    insecure: bool = False  # a non-loopback address without authentication, on purpose
    tail: int = 64 * 1024  # bytes of each output a job page shows on open
    state: str = ""  # a shared state to read (--state), instead of the root's own
    limits: Limits = field(default=LIMITS)  # what one client may take
    lines: LineOptions = field(default_factory=LineOptions)  # how line numbers are counted (no option)

    @property
    def authenticated(self) -> bool:
        return self.token is not None or self.client_certs


def _static() -> dict[str, tuple[bytes, str]]:
    """The pages and their scripts and styles, from the package."""
    out = {}
    for item in resources.files("gcwrap.shadow").joinpath("webstatic").iterdir():
        suffix = os.path.splitext(item.name)[1]
        if suffix in TYPES:
            out[item.name] = (item.read_bytes(), TYPES[suffix])
    return out


class WebView(HttpServer):
    """The web view: the state polled, the pages, the JSON API and the live event streams."""

    name = "web"
    always: ClassVar[list[tuple[bytes, bytes]]] = SECURITY_HEADERS

    def __init__(self, opts: WebOptions) -> None:
        super().__init__(opts.limits, opts.tls)
        self.opts = opts
        self.root_fd = os.open(opts.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.state = StateReader(opts.root, self.root_fd, opts.state, opts.lines)
        self.changed = trio.Event()
        self.static = _static()
        self.limiter = trio.CapacityLimiter(1)
        self.line_limiter = trio.CapacityLimiter(1)
        self.stats = {"requests": 0, "event_streams": 0, "bytes_streamed": 0}

    def close(self) -> None:
        self.state.close()
        os.close(self.root_fd)

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.opts.port, host=self.opts.host)
        await trio.to_thread.run_sync(self.state.read, limiter=self.limiter)
        if self.state.error:
            log.warning("%s; showing no jobs until it can be read", self.state.error)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch)
            for listener in listeners:
                nursery.start_soon(self.accept, listener, nursery)
            port = listeners[0].socket.getsockname()[1]
            host = f"[{self.opts.host}]" if ":" in self.opts.host else self.opts.host
            log.info("web view of %s on %s://%s:%d/", self.opts.root, "https" if self.opts.tls else "http", host,
                        port)
            if self.opts.port_file is not None:
                tmp = self.opts.port_file.with_name(self.opts.port_file.name + ".tmp")
                tmp.write_text(f"{port}\n")
                tmp.replace(self.opts.port_file)
            task_status.started(port)

    async def _watch(self) -> None:
        while True:
            if await trio.to_thread.run_sync(self.state.read, limiter=self.limiter):
                self._changed()
            await trio.sleep(POLL)

    def _changed(self) -> None:
        fired, self.changed = self.changed, trio.Event()
        fired.set()

    async def _fresh(self) -> None:
        """The timelines and refusals read, if nobody looked for a while (the
        watcher reads them only while someone looks), before a client sees them."""
        if self.state.extras_due() and await trio.to_thread.run_sync(self.state.read_extras, limiter=self.limiter):
            self._changed()

    # -- what the listener says (httpserve.py) -------------------------------------------

    async def crowded(self, tcp: trio.SocketStream) -> None:
        http = Http(tcp, self.limits)
        with trio.move_on_after(2):
            await http.next_event()
            await self.error(http, HttpError(503, "too many connections to the web view; try again soon"))

    def error_body(self, e: HttpError, req: Request | None) -> tuple[bytes, str]:
        if req is None or req.parts[:1] == ["api"]:
            return json.dumps({"error": str(e), "status": e.status}).encode(), "application/json"
        return self._page("error.html", status=str(e.status), message=str(e)), TYPES[".html"]

    async def handle(self, http: Http, req: Request, body: bytes) -> None:
        self.stats["requests"] += 1
        await self._dispatch(http, req, body)

    def _page(self, name: str, **fields: str) -> bytes:
        """A page from the package, its {{field}}s filled in, escaped."""
        text = self.static[name][0].decode()
        for key, value in fields.items():
            text = text.replace("{{" + key + "}}", html.escape(value, quote=True))
        return text.encode()

    # -- routes -----------------------------------------------------------------

    async def _dispatch(self, http: Http, req: Request, body: bytes) -> None:
        parts, head = req.parts, req.method == "HEAD"
        self._check_host(req)
        if parts[:1] == ["static"] and len(parts) == 2 and req.method in ("GET", "HEAD"):
            found = self.static.get(parts[1])
            if found is None or parts[1].endswith(".html"):
                raise HttpError(404, "no such file")
            await self.respond(http, 200, found[0], found[1], head=head, cache=b"no-cache")
            return
        if parts == ["login"] and self.opts.token is not None:
            await self._login(http, req, body)
            return
        self._authorize(req)
        if req.method not in ("GET", "HEAD"):
            raise HttpError(405, "only GET and HEAD here", [(b"Allow", b"GET, HEAD")])
        if parts[:1] == ["api"]:
            await self._fresh()
        if parts in ([""], ["jobs"], ["jobs", ""]):
            await self.respond(http, 200, self.static["jobs.html"][0], TYPES[".html"], head=head)
        elif parts[:1] == ["jobs"] and len(parts) == 2:
            self._job(parts[1])
            await self.respond(http, 200, self.static["job.html"][0], TYPES[".html"], head=head)
        elif parts == ["api", "jobs"]:
            await self.respond(http, 200, self.state.view()[1], "application/json", head=head)
        elif parts == ["api", "refusals"]:
            await self.respond(http, 200, self.state.refusals_json(), "application/json", head=head)
        elif parts[:2] == ["api", "jobs"] and len(parts) == 3:
            self._job(parts[2])
            await self.respond(http, 200, self.state.job_json(parts[2]), "application/json", head=head)
        elif parts[:2] == ["api", "jobs"] and len(parts) == 4 and parts[3] == "events":
            await self._events(http, req, parts[2])
        elif parts[:2] == ["api", "jobs"] and len(parts) == 5 and parts[3] == "files":
            await self._download(http, req, parts[2], parts[4])
        else:
            raise HttpError(404, "no such page")

    def _job(self, job_id: str) -> dict[str, Any]:
        job = self.state.jobs.get(job_id)
        if job is None:
            raise HttpError(404, f"no job {job_id!r} at this shadow")
        return job

    # -- security ---------------------------------------------------------------

    def _check_host(self, req: Request) -> None:
        """Without authentication, answer only to a loopback name: a web page
        elsewhere cannot then rebind its own name to 127.0.0.1 and read jobs."""
        if self.opts.authenticated or self.opts.insecure:
            return
        host = req.headers.get("host", "")
        name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host
        if not is_loopback(name):
            raise HttpError(403, f"this web view answers to loopback names only, not {host!r}")

    def _authorize(self, req: Request) -> None:
        """Client certificates were checked by the TLS handshake; a token is
        checked here, from the Authorization header or the login cookie."""
        token = self.opts.token
        if token is None:
            return
        if hmac.compare_digest(req.bearer(), token):
            return
        if _valid_session(token, req.cookie(COOKIE)):
            return
        if req.parts[:1] == ["api"]:
            raise HttpError(401, "authentication required: send 'Authorization: Bearer TOKEN'",
                            [(b"WWW-Authenticate", b'Bearer realm="gcshadow"')])
        raise HttpError(303, "log in first", [(b"Location", b"/login?next=" + quote(req.path, safe="/").encode())])

    async def _login(self, http: Http, req: Request, body: bytes) -> None:
        assert self.opts.token is not None
        target = req.query.get("next", "/")
        if req.method in ("GET", "HEAD"):
            page = self._page("login.html", next=target, message="")
            await self.respond(http, 200, page, TYPES[".html"], head=req.method == "HEAD")
            return
        if req.method != "POST":
            raise HttpError(405, "GET or POST here", [(b"Allow", b"GET, HEAD, POST")])
        form = dict(parse_qsl(body.decode("utf-8", "replace")))
        target = form.get("next", target)
        if not target.startswith("/") or target.startswith("//") or "\\" in target:
            target = "/"  # only a page of this site: no redirect elsewhere
        if not hmac.compare_digest(form.get("token", "").strip().encode(), self.opts.token):
            await trio.sleep(1)  # slows guessing (a token is at least 16 bytes anyway)
            page = self._page("login.html", next=target, message="That is not the token. Try again.")
            await self.respond(http, 401, page, TYPES[".html"])
            return
        cookie = (f"{COOKIE}={_new_session(self.opts.token)}; Path=/; HttpOnly; SameSite=Strict; "
                  f"Max-Age={SESSION_DAYS * 86400}") + ("; Secure" if self.opts.tls else "")
        await self.respond(http, 303, b"", "text/plain", [(b"Location", target.encode()),
                                                            (b"Set-Cookie", cookie.encode())])

    # -- files ------------------------------------------------------------------

    def _streams(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in job["streams"] if s["kind"] != "stdin"]

    async def _download(self, http: Http, req: Request, job_id: str, kind: str) -> None:
        job = self._job(job_id)
        st = next((s for s in self._streams(job) if s["kind"] == kind), None)
        if st is None:
            raise HttpError(404, f"job {job_id!r} has no {kind} stream")
        fd = self._open(st["name"])
        try:
            length = st["durable"]
            base = st["name"].rsplit("/", 1)[-1]
            plain = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in base) or "output"
            disposition = f"attachment; filename=\"{plain}\"; filename*=UTF-8''{quote(base, safe='')}"
            headers = self.headers("application/octet-stream", length, [(b"Content-Disposition", disposition.encode())])
            await http.send(h11.Response(status_code=200, headers=headers, reason=b"OK"))
            offset = 0
            while offset < length and req.method != "HEAD":
                data = await trio.to_thread.run_sync(os.pread, fd, min(256 * 1024, length - offset), offset)
                if not data:  # cut short under us: the client sees the connection close early
                    raise trio.BrokenResourceError(f"{st['name']!r} shrank while being sent")
                offset += len(data)
                await http.send(h11.Data(data=data))
            await http.send(h11.EndOfMessage())
        finally:
            os.close(fd)

    def _open(self, name: str) -> int:
        try:
            return open_served(self.root_fd, name)
        except Unservable as e:
            raise HttpError(e.status, str(e)) from None

    # -- the live stream of a job -------------------------------------------

    async def _events(self, http: Http, req: Request, job_id: str) -> None:
        """The job's live event stream (webevents.py)."""
        job = self._job(job_id)
        try:
            plan = Plan.parse(req.query, req.headers.get("last-event-id", ""), self.opts.tail, job["instance"])
        except ValueError:
            raise HttpError(400, "offsets, lines and tail are whole numbers") from None
        headers = self.headers("text/event-stream; charset=utf-8", None, [(b"X-Accel-Buffering", b"no")])
        await http.send(h11.Response(status_code=200, headers=headers, reason=b"OK"))
        if req.method == "HEAD":
            await http.send(h11.EndOfMessage())
            return
        self.stats["event_streams"] += 1

        async def send(chunk: bytes) -> None:
            self.stats["bytes_streamed"] += len(chunk)
            await http.send(h11.Data(data=chunk))

        live = LiveStream(self, job_id, plan, send)
        try:
            await live.run()
            await http.send(h11.EndOfMessage())
        finally:
            live.close()


def _new_session(token: bytes) -> str:
    issued = str(int(time.time()))
    nonce = secrets.token_hex(16)
    return f"{issued}.{nonce}.{_session_mac(token, issued, nonce)}"


def _session_mac(token: bytes, issued: str, nonce: str) -> str:
    return hmac.new(token, b"\0".join([b"gcshadow web session v1", issued.encode(), nonce.encode()]),
                    hashlib.sha256).hexdigest()


def _valid_session(token: bytes, value: str) -> bool:
    """A cookie the login form set: made with the token, and not older than SESSION_DAYS."""
    issued, _, rest = value.partition(".")
    nonce, _, mac = rest.partition(".")
    if not (issued.isdigit() and nonce and mac):
        return False
    if not hmac.compare_digest(mac.encode(), _session_mac(token, issued, nonce).encode()):
        return False
    return 0 <= time.time() - int(issued) <= SESSION_DAYS * 86400


async def run_web(opts: WebOptions, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    view = WebView(opts)
    try:
        await view.serve(task_status=task_status)
    finally:
        view.close()
