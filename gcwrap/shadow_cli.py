"""The `gcshadow` command: serve jobs' output at home; list jobs; tail them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from . import __version__
from .clitypes import Size
from .shadow.why import STATUSES
from .shadow_listen import http_security, metrics_listener, metrics_options, need_metrics_extra

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


class DefaultServeGroup(click.Group):
    """`gcshadow --port 50000` means `gcshadow serve --port 50000`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help", "--version")):
            args = ["serve", *args]
        return super().parse_args(ctx, args)


class Port(click.IntRange):
    """A TCP port, 0-65535; the error says so (click's: "not a valid integer range")."""

    name = "port"

    def __init__(self) -> None:
        super().__init__(0, 65535)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value).strip()
        if text.isdigit() and int(text) <= 65535:
            return int(text)
        self.fail(f"{value!r} is not a port number: give 0-65535 (0: any free port)", param, ctx)


class StreamOrName(click.Choice):  # type: ignore[type-arg]
    """stdout, stderr or all (completed as choices); any other word is a file's NAME (`gcshadow tail`)."""

    name = "stream"

    def __init__(self) -> None:
        super().__init__(["stdout", "stderr", "all"])

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        return str(value)


root_option = click.option(
    "--root", type=click.Path(file_okay=False, path_type=Path), default=".", show_default=True,
    envvar="GCSHADOW_ROOT", show_envvar=True, help="Directory under which every job's files land.",
)


def checked_state(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--state as the commands use it ("" for the root's own), checked as
    it is parsed: every command that takes it refuses one it cannot use,
    in one line (exit 1), before it does anything else."""
    from .shadow.files import StoreError
    from .shadow.stateurl import check_state

    try:
        return check_state(value)
    except StoreError as e:
        raise click.ClickException(str(e)) from None


state_option = click.option(
    "--state", metavar="URL", default="", envvar="GCSHADOW_STATE", show_envvar=True, callback=checked_state,
    help="Where the state is (jobs, durable lengths, exit statuses): postgresql://USER@HOST[:PORT]/DATABASE "
         "for several shadows serving one root (password: PGPASSFILE or PGPASSWORD, never in the URL); "
         "default: the root's own embedded database.",
)


@click.group(cls=DefaultServeGroup, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="gcshadow")
def main() -> None:
    """Receive the output of gcwrap jobs at home and serve their stdin.

    \b
    gcshadow [serve] --port PORT [--root DIR]   serve (the default command)
    gcshadow jobs                               list the jobs this shadow knows
    gcshadow tail JOB                           print a job's output
    gcshadow prune --finished-before 30d        forget the jobs that finished long ago

    \b
    Examples:
      gcshadow --port 50000 --root ~/results                  # loopback only
      gcshadow --host 0.0.0.0 --port 50000 --root ~/results --token-file ~/.gcshadow-token
    """


@main.command(context_settings=CONTEXT)
@click.option("--port", type=Port(), default=50000, show_default=True,
              envvar="GCSHADOW_PORT", show_envvar=True, help="TCP port to listen on (0: any free port).")
@click.option("--host", default="127.0.0.1", show_default=True, envvar="GCSHADOW_HOST", show_envvar=True,
              help="Address to listen on.")
@root_option
@click.option("--port-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the port to this file once listening (useful with --port 0).")
@click.option("--handshake-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds an agent has to introduce itself.")
@click.option("--idle-timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds of silence after which a connection is dropped.")
@click.option("--max-connections", type=click.IntRange(min=1), default=20000, show_default=True,
              envvar="GCSHADOW_MAX_CONNECTIONS", show_envvar=True,
              help="Connections served at once; more are told BUSY and come back later. "
                   "The descriptor limit (ulimit -n, raised to its hard limit) caps it too.")
@click.option("--min-free", type=Size(), default="64MiB", show_default=True, envvar="GCSHADOW_MIN_FREE",
              show_envvar=True, help="Free space at home below which new sessions are told BUSY (0: never).")
@click.option("-v", "--verbose", count=True, help="Debug messages on stderr (it logs each job's start and end).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
              envvar="GCSHADOW_LOG_FORMAT", show_envvar=True, help="Log lines on stderr as text or JSON.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              envvar=["GCSHADOW_TOKEN_FILE", "GCWRAP_TOKEN_FILE"], show_envvar=True,
              help="Require agents to prove this shared secret (the file must be private: chmod 600).")
@click.option("--token-dir", type=click.Path(file_okay=False, path_type=Path), envvar="GCSHADOW_TOKEN_DIR",
              show_envvar=True,
              help="One token per identity: each file (chmod 600) is named after the identity whose token it holds. "
                   "Each identity's files land under ROOT/IDENTITY/.")
@click.option("--tls-cert", type=click.Path(dir_okay=False, path_type=Path), envvar="GCSHADOW_TLS_CERT",
              show_envvar=True, help="Serve TLS with this certificate.")
@click.option("--tls-key", type=click.Path(dir_okay=False, path_type=Path), envvar="GCSHADOW_TLS_KEY",
              show_envvar=True, help="Private key of --tls-cert (if not in the same file).")
@click.option("--tls-ca", type=click.Path(dir_okay=False, path_type=Path), envvar="GCSHADOW_TLS_CA",
              show_envvar=True, help="Require client certificates signed by this CA (mutual TLS); "
              "each certificate's CN is an identity, whose files land under ROOT/CN/.")
@click.option("--allow-subject", "allow_subjects", multiple=True, metavar="CN:JOB-GLOB",
              help="With --tls-ca or --token-dir: the identity (certificate CN, or token file name) may write the "
                   "jobs matching the glob (repeatable; none given: any identity may use any job id not in use by "
                   "another).")
@click.option("--allow", "allow", multiple=True, metavar="HOSTS", envvar="GCSHADOW_ALLOW", show_envvar=True,
              help="Hosts, .domain suffixes and CIDR ranges that may connect (repeatable or comma-separated); "
                   "everyone else is refused before a byte is read.")
@click.option("--quota", type=Size(), default="0", show_default=True, envvar="GCSHADOW_QUOTA", show_envvar=True,
              help="Bytes one job may write in all (0: no limit).")
@click.option("--max-jobs-per-identity", type=click.IntRange(min=0), default=0, show_default=True,
              envvar="GCSHADOW_MAX_JOBS_PER_IDENTITY", show_envvar=True,
              help="Jobs streaming at once per certificate CN (or per host without one); 0: no limit.")
@click.option("--insecure", is_flag=True,
              help="Listen on a non-loopback address without authentication (anyone who can connect may write).")
@metrics_options
@state_option
def serve(
    port: int, host: str, root: Path, port_file: Path | None, handshake_timeout: float, idle_timeout: float,
    max_connections: int, min_free: int, verbose: int, log_format: str, token_file: Path | None,
    tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None, allow_subjects: tuple[str, ...],
    allow: tuple[str, ...], quota: int, max_jobs_per_identity: int, insecure: bool, token_dir: Path | None,
    state: str, **metrics: Any,
) -> None:
    """Serve jobs: write their output files under ROOT, durably, and serve their stdin.

    \b
    Examples:
      gcshadow serve --port 50000 --root ~/results            # loopback only
      umask 077; openssl rand -hex 32 > ~/.gcshadow-token     # a token for the agents (copy it to them)
      gcshadow serve --host 0.0.0.0 --port 50000 --root ~/results --token-file ~/.gcshadow-token
      gcshadow serve --port 50000 --root /shared/results --state postgresql://gcshadow@db.example.org/gcshadow
      gcshadow serve --port 50000 --root ~/results --metrics 9100   # Prometheus: http://127.0.0.1:9100/metrics
    """
    from .render import setup_logging
    from .shadow.admission import ShadowOptions

    if metrics["metrics"] is not None:
        need_metrics_extra()
    _check_descriptors()  # (first: a shadow that could serve no job must not even start)
    setup_logging("gcshadow", verbose + 1, log_format, timestamps=True)
    security = _security(host, token_file, tls_cert, tls_key, tls_ca, allow_subjects, allow, insecure, token_dir)
    _serve(ShadowOptions(
        root=root.resolve(), host=host, port=port, port_file=port_file, handshake_timeout=handshake_timeout,
        idle_timeout=idle_timeout, max_connections=max_connections, min_free=min_free, quota=quota,
        max_jobs_per_identity=max_jobs_per_identity, **security), state, metrics_listener(**metrics))


def _check_descriptors() -> None:
    """One line, before anything is opened, when the descriptor limit (once
    raised as far as the shadow may) is too low for it to serve a job: the
    state, the event loop or a job's files would fail on it, anywhere."""
    from .shadow.descriptors import least_limit, nofile, open_fds, raise_fd_limit

    raise_fd_limit()
    limit, need = nofile(), least_limit(open_fds())
    if limit < need:
        raise click.ClickException(f"out of file descriptors: the limit (ulimit -n) is {limit}, a shadow needs at "
                                   f"least {need} to serve a job (raise `ulimit -n`, or LimitNOFILE= in a systemd "
                                   "unit)")


def _serve(opts: Any, state: str = "", metrics: Any = None) -> None:
    """Run the shadow until it stops; its failures as one line each."""
    import functools

    import trio

    from .shadow.files import StoreError, check_root
    from .shadow.run import run_shadow
    from .shadow.server import ListenError

    try:
        check_root(opts.root)  # a root it cannot use is named as such, not blamed on the address
        stuck = trio.run(functools.partial(run_shadow, opts, state=state, metrics=metrics))
    except (StoreError, ListenError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"gcshadow failed: {e.strerror or e}") from None
    except KeyboardInterrupt:
        sys.exit(130)
    if stuck:  # a thread is stuck in a sync (said in the log): the interpreter's exit would wait for it
        import logging
        import os

        logging.shutdown()
        os._exit(0)


def _security(
    host: str, token_file: Path | None, tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None,
    allow_subjects: tuple[str, ...], allow: tuple[str, ...], insecure: bool, token_dir: Path | None = None,
) -> dict[str, Any]:
    """ShadowOptions fields for authentication, and the default posture:
    without authentication, loopback only unless --insecure says otherwise."""
    import logging

    from .wire.auth import AllowList, AuthError, SubjectMap, is_loopback, load_token, load_token_dir, server_context

    log = logging.getLogger("gcshadow")
    try:
        if token_file and token_dir:
            raise AuthError("give --token-file (one shared token) or --token-dir (one per identity), not both")
        token = load_token(token_file, private=True) if token_file else None
        tokens = load_token_dir(token_dir) if token_dir else {}
        if (tls_key or tls_ca) and not tls_cert:
            raise AuthError("--tls-key and --tls-ca need --tls-cert")
        if allow_subjects and not (tls_ca or token_dir):
            raise AuthError("--allow-subject needs identities: --tls-ca (client certificates) or --token-dir")
        tls = server_context(tls_cert, tls_key, tls_ca) if tls_cert else None
        subjects = SubjectMap.parse(list(allow_subjects))
        allowed = AllowList.parse(list(allow))
    except AuthError as e:
        raise click.UsageError(str(e)) from None
    authenticated = token is not None or bool(tokens) or tls_ca is not None
    if not authenticated:
        if not is_loopback(host):
            if not insecure:
                raise click.UsageError(
                    f"refusing to listen on {host} without authentication: anyone who can connect could write "
                    "files under the root. Use --token-file or --token-dir, or --tls-cert/--tls-key with --tls-ca; "
                    "or --insecure if that is really what you want"
                )
            log.warning("listening on %s WITHOUT authentication (--insecure): anyone who can connect may write", host)
        else:
            log.info("no authentication configured: listening on loopback only (%s)", host)
    if tokens or tls_ca is not None:
        log.info("identities from %s: each one's files land in a directory of its own under the root",
                 f"{len(tokens)} token files" if tokens else "client certificates (their CN)")
    return {"token": token, "tokens": tokens, "tls": tls, "subjects": subjects, "allow": allowed}


class Statuses(click.Choice):  # type: ignore[type-arg]
    """--status: one of STATUSES, or several separated by commas."""

    def __init__(self) -> None:
        super().__init__(STATUSES)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        return tuple(super(Statuses, self).convert(v.strip(), param, ctx) for v in str(value).split(",") if v.strip())


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    import time

    from .shadow.history import parse_since

    try:
        return None if value is None else parse_since(value, time.time())
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _columns(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    from .render_jobs import parse_columns

    try:
        return None if value is None else parse_columns(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _patterns(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    return [p.strip() for v in value for p in v.split(",") if p.strip()]


@main.command(context_settings=CONTEXT)
@root_option
@state_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of a table.")
@click.option("-w", "--watch", is_flag=True, help="Refresh the table live, like top (Ctrl-C to stop).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--status", "statuses", type=Statuses(), multiple=True, metavar="STATUS[,STATUS...]",
              help=f"Only jobs in these states (repeatable): {', '.join(STATUSES)}.")
@click.option("--since", callback=_since, metavar="WHEN",
              help="Only jobs active since WHEN: a duration back from now (30m, 2h, 1d) or a time (14:00, 2026-11-23).")
@click.option("--user", "users", multiple=True, callback=_patterns, metavar="USER",
              help="Only jobs of this user (a shell pattern; repeatable or comma-separated).")
@click.option("--host", "hosts", multiple=True, callback=_patterns, metavar="HOST",
              help="Only jobs that ran on this host (a shell pattern; repeatable or comma-separated).")
@click.option("-o", "--columns", callback=_columns, metavar="COLUMNS",
              help="The columns to show, comma-separated: job, host, user, state, status, why, bytes, rate, duration, "
                   "first_seen, last_seen, ended, exit, signal, streams, peer, instance, session, command.")
@click.option("--no-header", is_flag=True,
              help="Tab-separated rows without the header line (off a terminal the rows are tab-separated anyway).")
@click.option("--refused", is_flag=True, help="List the recently refused connections instead (newest first).")
@click.argument("job", required=False)
def jobs(root: Path, state: str, as_json: bool, watch: bool, interval: float, statuses: tuple[tuple[str, ...], ...],
         since: float | None, users: list[str], hosts: list[str], columns: list[str] | None, no_header: bool,
         refused: bool, job: str | None) -> None:
    """List the jobs the shadow at ROOT knows: host, state, exit status, bytes, rate.

    With JOB, show everything known of that job: why it looks the way it
    does, its I/O summary and its timeline (sessions, cuts, stalls,
    refusals, the exit); with --watch, keep showing it (or the list) live.
    On a terminal the list is a table; off a terminal (or with
    --no-header) it is tab-separated rows a script can cut.

    \b
    Examples:
      gcshadow jobs --root ~/results
      gcshadow jobs --root ~/results --status failed,disconnected --since 2h
      gcshadow jobs --root ~/results -o job,status,why --no-header | cut -f1
      gcshadow jobs --root ~/results slurm-4242
      gcshadow jobs --root ~/results --refused
      gcshadow jobs --state postgresql://gcshadow@db.example.org/gcshadow
    """
    wanted = [s for group in statuses for s in group]
    if job is not None and (wanted or since is not None or users or hosts):
        raise click.UsageError("--status, --since, --user and --host select jobs from the list: not with JOB")
    if refused:
        if wanted or users or hosts or columns or watch:
            raise click.UsageError("--refused lists refused connections: it takes JOB, --since, --json and "
                                   "--no-header only")
        _refusals(state, root, job, since, as_json, no_header)
        return
    from .shadow.history import select

    def load() -> list[dict[str, Any]]:
        found = _read(lambda: _read_jobs(state, root, job))
        return select(found, _now(), statuses=wanted, since=since, users=users, hosts=hosts)

    _say_home(state, root)
    found = load()
    if job is not None and not found:
        raise click.ClickException(f"no job {job!r} at this shadow")
    _show_jobs(found, load, job, as_json, watch, interval, columns, no_header)


def _now() -> float:
    import time

    return time.time()


def _read(fn: Callable[[], Any]) -> Any:
    """What `fn` reads of the state; a state that cannot be read in one line (exit 1)."""
    import sqlite3

    from .shadow.files import StoreError

    try:
        return fn()
    except sqlite3.Error as e:
        raise click.ClickException(f"no shadow state under the root: {e}") from None
    except StoreError as e:
        raise click.ClickException(str(e)) from None


def _read_jobs(state: str, root: Path, job: str | None) -> list[dict[str, Any]]:
    from .shadow.backends import read_jobs

    # (A job's whole timeline for JOB; the newest few of each for the list, enough for its status.)
    return read_jobs(state, root, job=job, events=None if job is not None else 20)


def _say_home(state: str, root: Path) -> None:
    """A line on stderr when a shadow of this root is short of disk (its agents are told BUSY)."""
    from .render_jobs import home_warning
    from .shadow.backends import read_homes

    try:
        homes = read_homes(state, root)
    except Exception:  # noqa: BLE001 - the listing itself says why the state cannot be read
        return
    for line in home_warning(homes):
        click.echo(f"gcshadow: {line}", err=True)


def _refusals(state: str, root: Path, job: str | None, since: float | None, as_json: bool, no_header: bool) -> None:
    import json

    from .render import output_width, print_view, stdout_console
    from .render_jobs import refusals_tsv, refusals_view
    from .shadow.backends import read_refusals
    from .shadow.timeline import REFUSALS_KEPT

    found = _read(lambda: read_refusals(state, root, REFUSALS_KEPT))
    found = [r for r in found if (job is None or r["job_id"] == job) and (since is None or r["time"] >= since)]
    if as_json:
        click.echo(json.dumps(found, indent=2))
    elif no_header or not sys.stdout.isatty():
        click.echo(refusals_tsv(found, header=not no_header), nl=False)
    else:
        console = stdout_console()
        print_view(console, refusals_view(found, _now(), output_width(console)))


def _show_jobs(found: list[dict[str, Any]], load: Callable[[], list[dict[str, Any]]], job: str | None,
               as_json: bool, watch: bool, interval: float, columns: list[str] | None, no_header: bool) -> None:
    """The jobs as JSON, tab-separated rows, a table or one job's detail; with `watch`, again and again."""
    import json
    import time

    from rich.console import Group

    from .render import job_bytes, job_detail, output_width, stdout_console
    from .render_jobs import DEFAULT_COLUMNS, columns_view, job_json, job_timeline, jobs_tsv

    if as_json:
        now = time.time()
        shown = [job_json(j, now, events=job is not None) for j in found]
        click.echo(json.dumps(shown[0] if job is not None else shown, indent=2))
        return
    chosen = columns or list(DEFAULT_COLUMNS)
    plain = job is None and (no_header or not sys.stdout.isatty())
    console = stdout_console()

    def view(rates: dict[str, float] | None = None) -> Any:
        now = time.time()
        if job is not None:
            width = output_width(console)
            return Group(job_detail(found[0], rates.get(job) if rates else None, now, width),
                         job_timeline(found[0], now, width))
        if plain:
            return jobs_tsv(found, chosen, now, rates, header=not no_header)
        return columns_view(found, chosen, now, rates, output_width(console))

    if not watch:
        _print(console, view())
        return
    # --watch: the rate is how fast each job's bytes arrive between two refreshes.
    last = {j["job_id"]: job_bytes(j) for j in found}
    last_t = time.monotonic()

    def refresh() -> Any:
        nonlocal found, last, last_t
        time.sleep(interval)
        found, now_t = load(), time.monotonic()
        rates = {j["job_id"]: max(0.0, (job_bytes(j) - last.get(j["job_id"], 0)) / (now_t - last_t)) for j in found}
        last, last_t = {j["job_id"]: job_bytes(j) for j in found}, now_t
        return view(rates)

    _watch(console, view, refresh)


def _print(console: Any, view: Any) -> None:
    """A view: rows for scripts (text) as they are, anything else through rich."""
    from .render import print_view

    if isinstance(view, str):
        sys.stdout.write(view)
    else:
        print_view(console, view)


def _watch(console: Any, first: Callable[[], Any], refresh: Callable[[], Any]) -> None:
    """Show `first()`, then each `refresh()`, until Ctrl-C: live on a
    terminal, one view after another through a pipe (like `top -b`)."""
    try:
        if console.is_terminal:
            from rich.live import Live

            with Live(first(), console=console, auto_refresh=False) as live:
                while True:
                    live.update(refresh(), refresh=True)
        else:
            _print(console, first())
            while True:
                _print(console, refresh())
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass


@main.command(context_settings=CONTEXT)
@root_option
@state_option
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the output grows, until the job ends.")
@click.option("--all", "all_jobs", is_flag=True, help="Every job, each line prefixed with [JOB STREAM].")
@click.option("-n", "--lines", type=click.IntRange(min=0), metavar="N",
              help="Start at the last N lines of each stream (default: its first byte).")
@click.option("-c", "--bytes", "nbytes", type=Size(), metavar="N",
              help="Start at the last N bytes of each stream (4096, 64KiB...).")
@click.argument("job", required=False)
@click.argument("stream", required=False, metavar="[STREAM|NAME]", type=StreamOrName())
def tail(root: Path, state: str, follow: bool, all_jobs: bool, lines: int | None, nbytes: int | None,
         job: str | None, stream: str | None) -> None:
    """Print the output a job has delivered so far; with -f, follow it live.

    STREAM is stdout (the default), stderr, or all; or NAME, a file the job
    writes (gcwrap --file), as the job named it. Following ends when the
    job has ended and all its output is printed; with --all it goes on until
    interrupted. -n N (lines) or -c N (bytes) starts at the end of each
    stream instead of its beginning, like tail(1) and condor_tail. A file
    is followed by its NAME, as tail -F does: when a new version of it
    replaces NAME, a line on stderr says so and the new version is printed
    from its start.

    \b
    Examples:
      gcshadow tail -f --root ~/results slurm-4242
      gcshadow tail -n 20 --root ~/results slurm-4242 stderr
      gcshadow tail -f --root ~/results slurm-4242 train.log
      gcshadow tail -f --all --root ~/results
    """
    import sqlite3

    from .render import say_on_stderr
    from .shadow.files import StoreError
    from .shadow.tail import tail as run_tail

    if job is None and not all_jobs:
        raise click.UsageError("name a JOB, or use --all")
    if job is not None and all_jobs:
        raise click.UsageError("--all follows every job: do not name one")
    if lines is not None and nbytes is not None:
        raise click.UsageError("give -n (lines) or -c (bytes), not both")
    if all_jobs and stream not in (None, "stdout", "stderr", "all"):
        raise click.UsageError("--all follows stdout, stderr or all: name a JOB to follow a file")
    stream = stream or ("all" if all_jobs else "stdout")
    prefix = all_jobs or stream == "all"
    try:
        run_tail(root, job, stream, sys.stdout.buffer, follow=follow, prefix=prefix, state_url=state, lines=lines,
                 nbytes=nbytes, notice=say_on_stderr)
    except sqlite3.Error as e:
        raise click.ClickException(f"no shadow state under {root}: {e}") from None
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    except LookupError as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        sys.exit(130)


# -- gcshadow prune --------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@root_option
@state_option
@click.option("--finished-before", "before", required=True, callback=_since, metavar="WHEN",
              help="Forget the jobs that finished before WHEN: a duration back from now (7d, 12h, 30m; 0s: every "
                   "finished job) or a time (2026-11-01).")
@click.option("--files", is_flag=True, help="Remove their output files under the root too (not a file another job "
                                            "writes now, nor any job's stdin).")
@click.option("--dry-run", is_flag=True, help="Change nothing: say what would be forgotten and removed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of lines.")
def prune(root: Path, state: str, before: float, files: bool, dry_run: bool, as_json: bool) -> None:
    """Forget the jobs that finished before WHEN (their state, and with --files their output files).

    Never a job still streaming or disconnected, nor one whose agent came
    back since it finished. Safe while the shadow serves the root: run it
    from a systemd timer or cron.

    \b
    Examples:
      gcshadow prune --root ~/results --finished-before 30d
      gcshadow prune --root ~/results --finished-before 7d --files --dry-run
      gcshadow prune --state postgresql://gcshadow@db.example.org/gcshadow --root /shared/results \\
          --finished-before 14d --files
    """
    import json

    from .render_jobs import prune_lines
    from .shadow.prune import prune as run_prune

    found = _read(lambda: run_prune(state, root, before, files=files, dry_run=dry_run))
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, "jobs": [p.as_json() for p in found]}, indent=2))
        return
    for line in prune_lines(found, _now(), dry_run):
        click.echo(line)


# -- gcshadow web ---------------------------------------------------------------------


@main.command(context_settings=CONTEXT)
@root_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to serve the pages on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="TCP port of the pages (0: any free port).")
@click.option("--port-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the port to this file once listening (useful with --port 0).")
@click.option("--tail", "tail_kib", type=click.IntRange(0, 16384), default=64, show_default=True,
              help="KiB of each output stream a job page shows when it opens.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), envvar="GCSHADOW_WEB_TOKEN_FILE",
              show_envvar=True, help="Require this secret of every client: a login form for browsers, "
                                     "'Authorization: Bearer TOKEN' for scripts (the file must be private: chmod 600).")
@click.option("--tls-cert", type=click.Path(dir_okay=False, path_type=Path), help="Serve HTTPS with this certificate.")
@click.option("--tls-key", type=click.Path(dir_okay=False, path_type=Path),
              help="Private key of --tls-cert (if not in the same file).")
@click.option("--tls-ca", type=click.Path(dir_okay=False, path_type=Path),
              help="Require client certificates signed by this CA.")
@click.option("--insecure", is_flag=True,
              help="Serve a non-loopback address without authentication (anyone who can connect reads every job).")
@click.option("-v", "--verbose", count=True, help="More messages on stderr.")
@state_option
def web(root: Path, host: str, port: int, port_file: Path | None, tail_kib: int, token_file: Path | None,
        tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None, insecure: bool, verbose: int,
        state: str) -> None:
    """Serve a live view of the jobs at ROOT to a browser, and the same as JSON.

    A reader of the shadow's state and files, apart from the shadow: run it
    beside `gcshadow serve`, or alone on a root. Loopback only unless
    authenticated (--token-file, or --tls-ca) or --insecure.

    \b
    Examples:
      gcshadow web --root ~/results                 # then open http://127.0.0.1:8080/
      gcshadow web --root ~/results --host 0.0.0.0 --token-file ~/.gcshadow-web-token \\
          --tls-cert web.pem --tls-key web.key
    """
    try:
        import h11  # noqa: F401 - only sites that serve the pages install it
    except ImportError:
        raise click.ClickException(
            "gcshadow web needs the 'web' extra: pip install 'gcwrap[web]' (it adds h11)"
        ) from None
    import os

    import trio

    from .render import setup_logging
    from .shadow.web import run_web

    setup_logging("gcshadow", verbose + 1, "text")
    if not root.is_dir():
        raise click.ClickException(f"{root} is not a directory: give the root a gcshadow serves (--root)")
    opts = _web_options(root, host, port, port_file, tail_kib, token_file, tls_cert, tls_key, tls_ca, insecure)
    opts.state = state
    try:
        os.nice(10)  # a viewer, best effort: a shadow on the same machine wins every contention for the CPU
    except OSError:
        pass
    try:
        trio.run(run_web, opts)
    except OSError as e:
        raise click.ClickException(f"cannot serve the web view on {host}:{port}: {e.strerror or e}") from None
    except KeyboardInterrupt:
        sys.exit(130)


def _web_options(root: Path, host: str, port: int, port_file: Path | None, tail_kib: int, token_file: Path | None,
                 tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None, insecure: bool) -> Any:
    """The web view's options, and its security posture: loopback only
    unless authenticated or --insecure, and a warning for plain HTTP."""
    from .shadow.web import WebOptions

    token, tls = http_security(host, token_file, tls_cert, tls_key, tls_ca, insecure, "every job's output")
    return WebOptions(root=root.resolve(), host=host, port=port, port_file=port_file, token=token, tls=tls,
                      client_certs=tls_ca is not None, insecure=insecure, tail=tail_kib * 1024)
