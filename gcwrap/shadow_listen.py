"""The command line of the shadow's HTTP listeners (`gcshadow web`, `gcshadow
serve --metrics`): where they listen, and their security posture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


def host_port(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, int] | None:
    """[HOST:]PORT ([::1]:PORT for IPv6); HOST is 127.0.0.1 unless given."""
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not (port.isdigit() and int(port) <= 65535) or (":" in host and not value.startswith("[")):
        raise click.BadParameter(f"{value!r} is not [HOST:]PORT (PORT 0-65535; [ADDRESS]:PORT for IPv6)")
    return host or "127.0.0.1", int(port)


METRICS_OPTIONS = [
    click.option("--metrics", metavar="[HOST:]PORT", callback=host_port, envvar="GCSHADOW_METRICS", show_envvar=True,
                 help="Serve Prometheus metrics (/metrics) and a health check (/healthz) there (HOST: 127.0.0.1 "
                      "unless given); needs the 'metrics' extra."),
    click.option("--metrics-token-file", type=click.Path(dir_okay=False, path_type=Path),
                 envvar="GCSHADOW_METRICS_TOKEN_FILE", show_envvar=True,
                 help="Require this secret of scrapers: 'Authorization: Bearer TOKEN' (the file must be private)."),
    click.option("--metrics-tls-cert", type=click.Path(dir_okay=False, path_type=Path),
                 help="Serve the metrics over HTTPS with this certificate."),
    click.option("--metrics-tls-key", type=click.Path(dir_okay=False, path_type=Path),
                 help="Private key of --metrics-tls-cert (if not in the same file)."),
    click.option("--metrics-tls-ca", type=click.Path(dir_okay=False, path_type=Path),
                 help="Require scrapers' client certificates signed by this CA."),
    click.option("--metrics-insecure", is_flag=True,
                 help="Serve the metrics on a non-loopback address without authentication."),
]


def metrics_options(fn: Any) -> Any:
    """The options of `gcshadow serve --metrics`, as one decorator."""
    for option in reversed(METRICS_OPTIONS):
        fn = option(fn)
    return fn


def metrics_listener(metrics: tuple[str, int] | None, metrics_token_file: Path | None,
                     metrics_tls_cert: Path | None, metrics_tls_key: Path | None, metrics_tls_ca: Path | None,
                     metrics_insecure: bool) -> Any:
    """The metrics' listener (shadow.metrics.MetricsOptions), or None without --metrics."""
    if metrics is None:
        return None
    from .shadow.metrics import MetricsOptions

    token, tls = http_security(metrics[0], metrics_token_file, metrics_tls_cert, metrics_tls_key, metrics_tls_ca,
                               metrics_insecure, "the metrics", "--metrics-")
    return MetricsOptions(metrics[0], metrics[1], token, tls)


def need_metrics_extra() -> None:
    """One line when the metrics' libraries are missing (an optional extra)."""
    try:
        import h11  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError:
        raise click.ClickException("--metrics needs the 'metrics' extra: pip install 'gcwrap[metrics]' (it adds "
                                   "prometheus-client and h11)") from None


def http_security(host: str, token_file: Path | None, tls_cert: Path | None, tls_key: Path | None,
                  tls_ca: Path | None, insecure: bool, what: str, prefix: str = "--") -> tuple[Any, Any]:
    """The token and TLS context of an HTTP listener (the web view, the
    metrics), and its posture: loopback only unless authenticated (a token,
    or client certificates) or --insecure; a warning for plain HTTP."""
    import logging

    from .wire.auth import AuthError, is_loopback, load_token, server_context

    try:
        token = load_token(token_file, private=True) if token_file else None
        if (tls_key or tls_ca) and not tls_cert:
            raise AuthError(f"{prefix}tls-key and {prefix}tls-ca need {prefix}tls-cert")
        tls = server_context(tls_cert, tls_key, tls_ca) if tls_cert else None
    except AuthError as e:
        raise click.UsageError(str(e)) from None
    authenticated = token is not None or tls_ca is not None
    if not is_loopback(host):
        if not authenticated and not insecure:
            raise click.UsageError(
                f"refusing to serve {host} without authentication: anyone who can connect could read {what}. "
                f"Use {prefix}token-file, or {prefix}tls-cert/{prefix}tls-key with {prefix}tls-ca; "
                f"or {prefix}insecure if that is really what you want"
            )
        log = logging.getLogger("gcshadow")
        if not authenticated:
            log.warning("serving %s WITHOUT authentication (%sinsecure): anyone who can connect reads %s", host,
                        prefix, what)
        elif tls is None:
            log.warning("serving %s over plain HTTP: the token and %s cross the network in clear "
                        "(add %stls-cert)", host, what, prefix)
    return token, tls
