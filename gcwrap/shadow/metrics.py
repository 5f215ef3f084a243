"""`gcshadow serve --metrics HOST:PORT`: the shadow's figures for Prometheus
(`/metrics`), and its health for a balancer (`/healthz`), on a listener of
its own in the shadow's process.

The figures are what the shadow counts anyway (durability.py, syncer.py,
eventlog.py, filestore.OpenFiles, handshakes.py, its connections and
sessions), read when scraped by one collector (`ShadowCollector`) into a
private registry of the official client library: nothing is updated on a
frame's way for them but a few integer additions and, once per durable
group, the histograms of `tally.Tally`. What needs a system call (the free
space under the root, the descriptors open) is looked at once per request,
in a worker thread (a root on NFS may block). HTTP/1.1 is served as
`gcshadow web` serves it (httpserve.py: h11 over trio streams, one task per
connection, TLS from trio when asked for). `/metrics` requires the token when there is one (a bearer
header, as Prometheus' `authorization` sends it); `/healthz` does not (a
balancer's check), and says no more than healthy or why not.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from .admission import disk_busy
from .descriptors import nofile, open_fds
from .httpserve import Http, HttpServer, Limits, Request

if TYPE_CHECKING:
    from .server import Shadow

log = logging.getLogger("gcshadow")

# A request within 10 s of connecting (TLS included), the next within 60 s; 64 connections at once
# (a scraper or two, a balancer's checks), more are closed at once.
LIMITS = Limits(first_request=10.0, idle=60.0, max_clients=64)
LOOK_TIMEOUT = 5.0  # seconds a look at the root may take before the answer says it could not be made
KINDS = {1: "stdout", 2: "stderr"}
# Why connections were refused, by the code their agents were told.
REASONS = {"AUTH_FAILED": "authentication", "BUSY": "busy", "QUOTA": "quota", "TLS": "tls", "FENCED": "fenced"}


@dataclass
class MetricsOptions:
    """Where `--metrics` listens, and the token and TLS it asks of clients."""

    host: str
    port: int
    token: bytes | None = None  # required of /metrics (Authorization: Bearer TOKEN)
    tls: ssl.SSLContext | None = None  # HTTPS; client certificates when it requires them
    limits: Limits = field(default=LIMITS)  # what one client may take


@dataclass
class Look:
    """What a request needs a system call for, looked at in a worker thread."""

    free: int = -1  # bytes free under the root for an unprivileged user (-1: unknown)
    short: str = ""  # why new sessions are told BUSY for the root's space, or ""
    fds: int = 0  # descriptors open
    gone: str = ""  # why the root is no longer the one served (before its watch says so), or ""


def look(shadow: Shadow) -> Look:
    """(blocking) The root's free space and the descriptors open."""
    out = Look(fds=open_fds(), gone=shadow.root_watch.look())
    try:
        st = os.statvfs(shadow.opts.root)
        out.free = st.f_bavail * st.f_frsize
    except OSError:
        pass
    out.short = disk_busy(shadow.opts)
    return out


def state_down(shadow: Shadow) -> str:
    """Why the state database is lost, or "" (a shared state says so when a
    call fails, and when its prober finds it back; the embedded one is
    lost only with the root)."""
    health = getattr(shadow.store, "health", None)  # (pgconn.Health; the embedded state has none)
    down = getattr(health, "down", "")
    return f"the state database is lost: {down}" if down else ""


def unhealthy(shadow: Shadow, seen: Look) -> str:
    """Why the shadow cannot take jobs now, or "" (it can)."""
    if shadow.stopping:
        return f"stopping: {shadow.stopping}"
    if shadow.accepting is None:
        return "not serving yet"
    if shadow.root_watch.gone or seen.gone:
        return shadow.root_watch.refusal or f"{seen.gone} under the shadow: it takes no job until it is restarted"
    return state_down(shadow) or seen.short


class ShadowCollector:
    """Every figure of one shadow, as metric families, read when scraped."""

    def __init__(self, shadow: Shadow) -> None:
        self.shadow = shadow
        self.seen = Look()  # (set before each scrape: `Metrics.scrape`)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, d, f = self.shadow, self.shadow.durability.stats, self.shadow.fds.open_files
        received = CounterMetricFamily("gcshadow_received_bytes", "Bytes of output received whole, by stream kind "
                                       "(stdout, stderr, files)", labels=["kind"])
        durable = CounterMetricFamily("gcshadow_durable_bytes", "Bytes of output made durable (synced and "
                                      "recorded: acknowledged), by stream kind", labels=["kind"])
        for sid, kind in KINDS.items():
            received.add_metric([kind], d.received.get(sid, 0))
            durable.add_metric([kind], d.made_durable.get(sid, 0))
        received.add_metric(["files"], f.received)
        durable.add_metric(["files"], f.durable)
        yield received
        yield durable
        yield CounterMetricFamily("gcshadow_frames", "DATA and FILE_DATA frames that added output (a frame "
                                  "resent whole adds none)", d.frames + f.frames)
        yield from self._refusals()
        yield GaugeMetricFamily("gcshadow_connections", "Connections open", s.fds.connections)
        yield GaugeMetricFamily("gcshadow_sessions_open", "Sessions of jobs whose files are open",
                                sum(len(v) for v in s.sessions.values()))
        yield GaugeMetricFamily("gcshadow_jobs_streaming", "Jobs a session holds here", len(s.live))
        yield GaugeMetricFamily("gcshadow_handshakes_in_flight", "Connections not authenticated yet",
                                len(s.handshakes.unauthenticated))
        yield GaugeMetricFamily("gcshadow_handshake_memory_bytes", "Bytes the connections not authenticated yet "
                                "hold", s.handshakes.total)
        yield GaugeMetricFamily("gcshadow_handshake_memory_limit_bytes", "What they may hold in all",
                                s.handshakes.limit)
        yield from self._histograms()
        yield from self._resources()

    def _refusals(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        events = self.shadow.events
        refused = CounterMetricFamily("gcshadow_connections_refused", "Connections refused, by reason "
                                      "(authentication, busy, quota, tls, fenced, ...)", labels=["reason"])
        counts: dict[str, int] = dict.fromkeys(REASONS.values(), 0)
        for code, n in [*events.refusals.items(), ("FENCED", events.stopped.get("FENCED", 0))]:
            reason = REASONS.get(code, code.lower() or "other")
            counts[reason] = counts.get(reason, 0) + n
        for reason, n in sorted(counts.items()):
            refused.add_metric([reason], n)
        yield refused
        ended = CounterMetricFamily("gcshadow_sessions_failed", "Connections ended with an ERROR to the agent, "
                                    "by its code", labels=["code"])
        for code, n in sorted(events.stopped.items()):
            ended.add_metric([code], n)
        yield ended

    def _histograms(self) -> Iterator[Any]:
        from prometheus_client.core import HistogramMetricFamily

        d = self.shadow.durability.stats
        for name, what, tally in (
            ("gcshadow_ack_latency_seconds", "From a frame whole at home to its ACK (each durable group's oldest)",
             d.ack_seconds),
            ("gcshadow_fsync_seconds", "Syncs of a durable group's files", self.shadow.store.syncer.seconds),
            ("gcshadow_commit_seconds", "Records of a durable group's lengths in the state", d.commit_seconds),
            ("gcshadow_durable_group_bytes", "Bytes of output each durable group made durable", d.group_bytes),
        ):
            yield HistogramMetricFamily(name, what, buckets=tally.buckets(), sum_value=tally.sum)

    def _resources(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        s, seen = self.shadow, self.seen
        yield GaugeMetricFamily("gcshadow_state_up", "Whether the state database answers (1) or is lost (0)",
                                0 if state_down(s) or s.root_watch.gone else 1)
        yield GaugeMetricFamily("gcshadow_root_free_bytes", "Bytes free under the root (-1: unknown)", seen.free)
        yield GaugeMetricFamily("gcshadow_min_free_bytes", "--min-free: below it, new sessions are told BUSY",
                                s.opts.min_free)
        yield GaugeMetricFamily("gcshadow_descriptors_open", "File descriptors open", seen.fds)
        yield GaugeMetricFamily("gcshadow_descriptors_limit", "The descriptor limit (RLIMIT_NOFILE)", nofile())
        yield GaugeMetricFamily("gcshadow_healthy", "Whether the shadow takes jobs (1), as /healthz says",
                                0 if unhealthy(s, seen) else 1)


class Metrics(HttpServer):
    """The listener: /metrics and /healthz (see the module's docstring)."""

    name = "metrics"
    quiet = True  # (a failed accept or handshake here: the shadow's own connections come first in its log)

    def __init__(self, shadow: Shadow, opts: MetricsOptions) -> None:
        from prometheus_client import CollectorRegistry

        super().__init__(opts.limits, opts.tls)
        self.shadow = shadow
        self.opts = opts
        self.collector = ShadowCollector(shadow)
        self.registry = CollectorRegistry(auto_describe=False)  # (its own: never the library's global one)
        self.registry.register(self.collector)

    async def look(self) -> Look:
        with trio.move_on_after(LOOK_TIMEOUT):
            return await trio.to_thread.run_sync(look, self.shadow, abandon_on_cancel=True)
        return Look(short="cannot look at the root: it did not answer within "
                          f"{LOOK_TIMEOUT:.0f} s")

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        from .server import ListenError

        try:
            listeners = await trio.open_tcp_listeners(self.opts.port, host=self.opts.host)
        except OSError as e:
            raise ListenError(f"cannot serve the metrics on {self.opts.host}:{self.opts.port}: "
                              f"{e.strerror or e}") from None
        port = listeners[0].socket.getsockname()[1]
        host = f"[{self.opts.host}]" if ":" in self.opts.host else self.opts.host
        log.info("metrics on %s://%s:%d/metrics, health on /healthz", "https" if self.opts.tls else "http", host,
                 port)
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self.accept, listener, nursery)
            task_status.started(port)

    async def handle(self, http: Http, req: Request, body: bytes) -> None:
        status, answer, content_type, extra = await self._answer(req)
        await self.respond(http, status, answer, content_type, extra, head=req.method == "HEAD")

    async def _answer(self, req: Request) -> tuple[int, bytes, str, list[tuple[bytes, bytes]]]:
        """Status, body, its type and more headers for one request."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        path = req.path
        text = "text/plain; charset=utf-8"
        if req.method not in ("GET", "HEAD"):
            return 405, b"only GET and HEAD here\n", text, [(b"Allow", b"GET, HEAD")]
        if path == "/healthz":
            why = unhealthy(self.shadow, await self.look())
            return (503, f"{why}\n".encode(), text, []) if why else (200, b"ok\n", text, [])
        if path != "/metrics":
            return 404, b"no such page: /metrics and /healthz are here\n", text, []
        if not self._authorized(req):
            return 401, b"authentication required: send 'Authorization: Bearer TOKEN'\n", text, [
                (b"WWW-Authenticate", b'Bearer realm="gcshadow metrics"')]
        self.collector.seen = await self.look()
        return 200, generate_latest(self.registry), CONTENT_TYPE_LATEST, []

    def _authorized(self, req: Request) -> bool:
        """Client certificates were checked by the TLS handshake; a token here."""
        return self.opts.token is None or hmac.compare_digest(req.bearer(), self.opts.token)


async def serve_metrics(shadow: Shadow, opts: MetricsOptions, *,
                        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the shadow's metrics and health until cancelled; reports the port."""
    await Metrics(shadow, opts).serve(task_status=task_status)
