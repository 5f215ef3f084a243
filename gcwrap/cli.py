"""The `gcwrap` command: run a job, show spools, resume, demo.

Commands are thin: parse, call the library, render. Heavy modules (trio,
sqlite-utils, rich) are imported inside the commands that need them, so
`gcwrap --help` and the job's start stay fast.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from . import __version__, exitcodes
from .agent.stopsignals import EarlySignals, stop_signals
from .clitypes import Size
from .wire.names import NameError_, normalize

if TYPE_CHECKING:
    from .agent.filespecs import FileSpec

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

EXIT_HELP = "\n\b\nExit status:\n" + "\n".join(f"  {code:<8}{text}" for code, text in exitcodes.TABLE)


class DefaultRunGroup(click.Group):
    """`gcwrap [OPTIONS] -- COMMAND` means `gcwrap run [OPTIONS] -- COMMAND`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help", "--version"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def parse_hostport(value: str) -> tuple[str, int]:
    """HOST:PORT, [IPV6]:PORT."""
    from .agent.addresses import parse_address

    return parse_address(value)


def security(token_file: Path | None, tls_on: bool, tls_ca: Path | None, tls_cert: Path | None,
             tls_key: Path | None) -> dict[str, Any]:
    """AgentOptions fields for the token and TLS options (usage errors if unusable)."""
    if not (token_file or tls_on or tls_ca or tls_cert or tls_key):
        return {"token": None, "tls": None}  # (nor is TLS loaded: see launch)
    from .wire.auth import AuthError, client_context, load_token

    try:
        token = load_token(token_file, private=False) if token_file else None
        tls = client_context(tls_ca, tls_cert, tls_key) if (tls_on or tls_ca or tls_cert or tls_key) else None
    except AuthError as e:
        raise click.UsageError(str(e)) from None
    if tls_key and not tls_cert:
        raise click.UsageError("--tls-key needs --tls-cert")
    return {"token": token, "tls": tls}


def shadow_addresses(values: tuple[str, ...] | str | None) -> tuple[tuple[str, int], ...]:
    """The shadows of --shadow (repeated, or a comma-separated list), else of
    $BYPASS_SHADOW_HOST (one or a list) and $BYPASS_SHADOW_PORT; () for none."""
    from .agent.addresses import AddressError, env_addresses, parse_addresses

    if isinstance(values, str):
        values = (values,)
    try:
        if values:
            return tuple(parse_addresses(values))
    except AddressError as e:
        raise click.BadParameter(str(e), param_hint="--shadow") from None
    host, port = os.environ.get("BYPASS_SHADOW_HOST"), os.environ.get("BYPASS_SHADOW_PORT")
    if host:
        try:
            return tuple(env_addresses(host, port))
        except AddressError as e:
            raise click.UsageError(str(e)) from None
    if port:
        raise click.UsageError("set both BYPASS_SHADOW_HOST and BYPASS_SHADOW_PORT, or use --shadow HOST:PORT")
    return ()


def check_name(param: str) -> Callable[[click.Context, click.Parameter, str | None], str | None]:
    """A NAME template's syntax (%j, %a...); `expand_name` makes it a NAME once the job is known."""
    def callback(ctx: click.Context, p: click.Parameter, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        from .agent.templates import TemplateError, check

        try:
            check(value)
        except TemplateError as e:
            raise click.BadParameter(str(e), param_hint=param) from None
        return value

    return callback


def check_files(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[FileSpec, ...]:
    """`--file PATH[=NAME]`, each parsed (gcwrap.agent.filespecs) and its NAME
    template's syntax checked; the NAMEs are expanded once the job is known."""
    from .agent.filespecs import FileSpecError, parse_file_spec
    from .agent.templates import TemplateError, check

    specs: list[FileSpec] = []
    for value in values:
        try:
            spec = parse_file_spec(value)
            if spec.name is not None:
                check(spec.name)
        except (FileSpecError, TemplateError) as e:
            raise click.BadParameter(str(e), param_hint="--file") from None
        if spec.pattern in (s.pattern for s in specs):
            raise click.BadParameter(f"{spec.pattern!r} is given twice", param_hint="--file")
        specs.append(spec)
    return tuple(specs)


def expand_name(value: str | None, values: dict[str, str], param: str) -> str | None:
    """A NAME template expanded for this job, then checked as a NAME."""
    if value is None:
        return None
    from .agent.templates import expand

    name = expand(value, values)
    try:
        return normalize(name)
    except NameError_ as e:
        shown = str(e) if name == value else f"{value!r} expands to {name!r}: {e}"
        raise click.BadParameter(shown, param_hint=param) from None


class SpoolDir(click.Path):
    """`run --spool DIR`: a directory that cannot serve (a file, not
    writable...) is no usage error. The job runs, its output goes home from
    memory, and gcwrap says why (as for a directory it cannot create)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if isinstance(value, Path) else Path(os.fsdecode(value))


def check_compress(ctx: click.Context, param: click.Parameter, value: str) -> Any:
    """`--compress zstd` needs the codec here; `auto` does without it (and never compresses)."""
    from .wire.compress import Mode, available

    if value == "zstd" and not available():
        raise click.BadParameter(f"zstd needs the zstandard package, which {sys.executable} does not have "
                                 "(pip install zstandard)")
    return Mode(value)


def common_delivery_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by `run` and `resume`."""
    options = [
        click.option("--retry-limit", type=click.IntRange(min=0), default=20, show_default=True,
                     envvar=["GCWRAP_RETRY_LIMIT", "GRID_CONSOLE_RETRY_LIMIT"], show_envvar=True,
                     help="Consecutive failed attempts, while the output can go nowhere, before giving up (0: never)."),
        click.option("--retry-timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
                     envvar=["GCWRAP_RETRY_TIMEOUT", "GRID_CONSOLE_RETRY_TIMEOUT"], show_envvar=True,
                     help="Longest wait in seconds between two attempts (exponential backoff with jitter up to this)."),
        click.option("--heartbeat", type=click.FloatRange(min=0.05), default=5.0, show_default=True,
                     envvar="GCWRAP_HEARTBEAT", show_envvar=True,
                     help="Seconds between heartbeats; a connection silent, or leaving what it sent unanswered, "
                          "for 3 heartbeats is replaced."),
        click.option("-v", "--verbose", count=True, help="More messages on stderr (-vv for debug)."),
        click.option("-q", "--quiet", is_flag=True, help="Only errors on stderr: no warnings, no I/O summary."),
        click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True,
                     envvar="GCWRAP_LOG_FORMAT", show_envvar=True, help="Messages on stderr as text or JSON lines."),
        click.option("--compress", type=click.Choice(["auto", "zstd", "none"]), default="auto", show_default=True,
                     envvar="GCWRAP_COMPRESS", show_envvar=True, callback=check_compress,
                     help="Compress output on the wire (zstd): auto only while the link, not the CPU, is the "
                          "bottleneck and the output compresses; zstd every frame that shrinks; none never."),
        click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), envvar="GCWRAP_TOKEN_FILE",
                     show_envvar=True, help="Shared secret: prove it to the shadow, and make it prove it back."),
        click.option("--tls", "tls_on", is_flag=True, envvar="GCWRAP_TLS", show_envvar=True,
                     help="Speak TLS to the shadow, verified against the system's CAs (implied by --tls-*)."),
        click.option("--tls-ca", type=click.Path(dir_okay=False, path_type=Path), envvar="GCWRAP_TLS_CA",
                     show_envvar=True, help="CA certificate(s) that signed the shadow's certificate."),
        click.option("--tls-cert", type=click.Path(dir_okay=False, path_type=Path), envvar="GCWRAP_TLS_CERT",
                     show_envvar=True, help="Client certificate, for a shadow that requires one (mutual TLS)."),
        click.option("--tls-key", type=click.Path(dir_okay=False, path_type=Path), envvar="GCWRAP_TLS_KEY",
                     show_envvar=True, help="Private key of --tls-cert (if not in the same file)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.group(cls=DefaultRunGroup, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="gcwrap")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Run a batch job and bring its output home, live, over an unreliable network.

    \b
    gcwrap [OPTIONS] -- COMMAND [ARGS...]     run COMMAND (same as `gcwrap run`)
    gcwrap status                             show the spools on this machine
    gcwrap resume                             deliver spools left behind

    \b
    Example:
      gcwrap --shadow home.example.org:50000 --token-file ~/.gcshadow-token --stdout out.5 --stderr err.5 -- ./app
    """
    # The stop signals caught from the first instant (gcwrap.entry) are
    # `run`'s, for its job; any other command gets them back as they were.
    if ctx.invoked_subcommand != "run" and isinstance(ctx.obj, EarlySignals):
        ctx.obj.release()
    if ctx.invoked_subcommand != "run":
        gc.enable()  # (off while gcwrap loaded: see gcwrap.entry)


file_option = click.option(
    "--file", "files", metavar="PATH[=NAME]", multiple=True, envvar="GCWRAP_FILES", show_envvar=True,
    callback=check_files,
    help="A file the job writes that comes home too, live and exact at the end (repeat it for more; "
         "GCWRAP_FILES: separated by spaces). PATH is relative to the job's working directory, or a "
         "glob ('out/*.csv') matched while the job runs. At home it lands at NAME (templates as for "
         "--stdout), else at PATH.")


@main.command(context_settings={**CONTEXT, "allow_interspersed_args": False}, epilog=EXIT_HELP)
@click.option("--shadow", metavar="HOST:PORT", multiple=True, envvar="GCWRAP_SHADOW", show_envvar=True,
              help="Where gcshadow listens. Several shadows serving one root (a comma-separated list, or "
                   "--shadow repeated): tried in a random order, the one that works kept, the next tried at once "
                   "when it fails. Default: $BYPASS_SHADOW_HOST (one or a list):$BYPASS_SHADOW_PORT.")
@click.option("--stdout", "stdout_name", metavar="NAME", envvar=["GCWRAP_STDOUT", "GRID_CONSOLE_STDOUT"],
              show_envvar=True, callback=check_name("--stdout"),
              help="File (relative to the shadow's root) that receives the job's stdout. Unset: pass through. "
                   "A template: %j job id, %a array task, %h host, %u user, %n attempt, %% a literal %.")
@click.option("--stderr", "stderr_name", metavar="NAME", envvar=["GCWRAP_STDERR", "GRID_CONSOLE_STDERR"],
              show_envvar=True, callback=check_name("--stderr"),
              help="File that receives the job's stderr; the same NAME as --stdout merges them (2>&1). "
                   "Templates as for --stdout.")
@click.option("--stdin", "stdin_name", metavar="NAME", envvar=["GCWRAP_STDIN", "GRID_CONSOLE_STDIN"],
              show_envvar=True, callback=check_name("--stdin"),
              help="File at the shadow that is fed to the job's stdin. Unset: pass through. "
                   "Templates as for --stdout.")
@file_option
@click.option("--job-id", metavar="ID", envvar="GCWRAP_JOB_ID", show_envvar=True,
              help="Job id at the shadow. Default: the batch system's (Slurm, HTCondor, PBS), else host-pid-time.")
@click.option("--spool", "spool_dir", metavar="DIR", type=SpoolDir(file_okay=False, path_type=Path),
              envvar="GCWRAP_SPOOL", show_envvar=True,
              help="Directory for the spool. Default: gcwrap-UID in the batch system's scratch directory "
                   "($_CONDOR_SCRATCH_DIR, $SLURM_TMPDIR) or $TMPDIR, else in /tmp.")
@click.option("--spool-limit", type=Size(), default="0", show_default=True, envvar="GCWRAP_SPOOL_LIMIT",
              show_envvar=True, help="Most bytes the spool may hold (0: only free disk space limits it).")
@click.option("--min-free", type=Size(), default=None, envvar="GCWRAP_MIN_FREE", show_envvar=True,
              help="Free disk space the spool leaves to the job. Default: 5% of the file system, at most 256MiB.")
@click.option("--memory-limit", type=Size(minimum="1MiB"), default="32MiB", show_default=True,
              envvar="GCWRAP_MEMORY_LIMIT", show_envvar=True,
              help="Output held only in memory (disk failing) before the job is paused by backpressure; "
                   "at least 1MiB.")
@click.option("--write-behind", type=click.FloatRange(min=0, max=60), default=0.0, show_default=True,
              metavar="SECONDS", envvar="GCWRAP_WRITE_BEHIND", show_envvar=True,
              help="Relaxed mode: spool only output that home has not acknowledged within SECONDS "
                   "(0: spool every byte at once). Saves the disk and CPU while the network keeps up; "
                   "a wrapper killed with kill -9 loses up to SECONDS of output not yet home.")
@common_delivery_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    shadow: tuple[str, ...], stdout_name: str | None, stderr_name: str | None, stdin_name: str | None,
    job_id: str | None, spool_dir: Path | None, spool_limit: int, min_free: int | None, memory_limit: int,
    write_behind: float, retry_limit: int, retry_timeout: float, heartbeat: float, verbose: int, quiet: bool,
    log_format: str, compress: Any, files: tuple[FileSpec, ...],
    token_file: Path | None, tls_on: bool, tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND; stream its stdout/stderr to the shadow through a local spool.

    The job keeps running when the network fails: its output waits in the
    spool and goes home when the shadow is reachable again. gcwrap exits with
    the job's status once every byte is acknowledged.

    \b
    Examples (the token: see gcshadow's; a shadow beyond loopback requires one, or TLS):
      gcwrap --shadow home:50000 --token-file ~/.gcshadow-token --stdout outfile.5 -- ./app
      gcwrap --shadow home:50000 --token-file ~/.gcshadow-token --stdout 'out/%j.%a.out' -- ./app    # out/4242.7.out
      export BYPASS_SHADOW_HOST=home BYPASS_SHADOW_PORT=50000 GRID_CONSOLE_STDOUT=outfile.5
      GCWRAP_TOKEN_FILE=~/.gcshadow-token gcwrap -- ./app
    """
    from .logs import setup_logging

    setup_logging("gcwrap", -1 if quiet else verbose, log_format)
    addresses = shadow_addresses(shadow)
    if not addresses and (stdout_name or stderr_name or stdin_name or files):
        raise click.UsageError("a stream NAME or a --file needs a shadow: use --shadow HOST:PORT or set "
                               "BYPASS_SHADOW_HOST/PORT")
    job_id, names = job_and_names(job_id, stdout_name, stderr_name, stdin_name, *(f.name for f in files))
    (stdout_name, stderr_name, stdin_name), files = names[:3], file_specs(files, names[3:], names[:2])
    from .agent.options import AgentOptions

    merge = stderr_name is not None and stderr_name == stdout_name
    opts = AgentOptions(
        shadows=addresses, stdout=stdout_name, stderr=None if merge else stderr_name, stdin=stdin_name,
        files=files, merge_stderr=merge, retry_limit=retry_limit, retry_timeout=retry_timeout, heartbeat=heartbeat,
        spool_limit=spool_limit, min_free=min_free, mem_limit=memory_limit,
        write_behind=write_behind, compress=compress, **security(token_file, tls_on, tls_ca, tls_cert, tls_key),
    )
    caught = click.get_current_context().find_object(EarlySignals)
    sys.exit(_run(opts, addresses, job_id, spool_dir, list(command), quiet, log_format, caught))


def job_and_names(job_id: str | None, *names: str | None) -> tuple[str | None, list[str | None]]:
    """The job id (--job-id, else the batch system's) and the stream NAMEs
    with their templates expanded; usage errors for what cannot be."""
    if job_id is not None and (not job_id or len(job_id) > 256 or not job_id.isprintable()):
        raise click.BadParameter("must be 1-256 printable characters", param_hint="--job-id")
    from .agent.identity import detect
    from .agent.templates import values_for

    ident = detect()
    values = values_for(ident, job_id)
    options = ("--stdout", "--stderr", "--stdin", *("--file",) * (len(names) - 3))
    expanded = [expand_name(name, values, option) for name, option in zip(names, options, strict=True)]
    job_id = job_id or ident.job_id
    if job_id and not job_id.isprintable():  # from the batch system's environment: the shadow would refuse it
        raise click.UsageError(f"the job id {job_id!r} from the environment holds control characters: give --job-id")
    return job_id, expanded


def file_specs(files: tuple[FileSpec, ...], names: list[str | None], streams: list[str | None] | None = None
               ) -> tuple[FileSpec, ...]:
    """The --file specs with their NAMEs expanded; a PATH without a NAME
    lands at PATH, so it must be a NAME (a glob's matches are checked as they
    appear). Two outputs landing at one NAME (the `streams`' NAMEs too) are
    refused here, not by the shadow once the job runs."""
    import dataclasses

    taken = {n for n in streams or () if n is not None}
    specs = []
    for spec, name in zip(files, names, strict=True):
        lands = name
        if name is None and not spec.is_glob:
            try:
                lands = normalize(spec.pattern)
            except NameError_ as e:
                raise click.BadParameter(f"{spec.pattern!r} cannot land at home under its own name ({e}): "
                                         "give it one, PATH=NAME", param_hint="--file") from None
        if lands is not None:
            if lands in taken:
                raise click.BadParameter(f"{spec.pattern!r} lands at {lands!r}, where another output lands too",
                                         param_hint="--file")
            taken.add(lands)
        specs.append(dataclasses.replace(spec, name=name))
    return tuple(specs)


def _run(
    opts: Any, addresses: tuple[tuple[str, int], ...], job_id: str | None, spool_dir: Path | None, command: list[str],
    quiet: bool = False, log_format: str = "text", caught: EarlySignals | None = None,
) -> int:
    """Run the job; gcwrap's exit status. `caught`: the stop signals, caught
    since the process started (else from now on, and given back at the end)."""
    signals = caught or EarlySignals(stop_signals())
    try:
        return _run_caught(opts, addresses, job_id, spool_dir, command, quiet, log_format, signals)
    finally:
        if caught is None:
            signals.restore()


def _run_caught(
    opts: Any, addresses: tuple[tuple[str, int], ...], job_id: str | None, spool_dir: Path | None, command: list[str],
    quiet: bool, log_format: str, signals: EarlySignals,
) -> int:
    import time

    from .agent.addresses import show_all
    from .agent.identity import default_job_id, hostname, username
    from .agent.launch import not_started, prepare, stream_specs
    from .agent.records import JobRecord
    from .agent.spool import SPOOL_SUFFIX, default_spool_dir, new_instance, safe_filename

    job_id = job_id or default_job_id()
    instance = new_instance()
    directory = spool_dir or default_spool_dir()
    spool_path = directory / f"{safe_filename(job_id)}-{instance}{SPOOL_SUFFIX}"
    # The command goes home as text: bytes that are not UTF-8 are shown escaped.
    shown = [a.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") for a in command]
    job = JobRecord(
        job_id=job_id, instance=instance, command=shown, host=hostname(), user=username(),
        shadow=show_all(addresses), started=time.time(), wrapper_pid=os.getpid(),
    )
    # The spool, then the job, before the event loop and the sender are even
    # loaded: the job starts up while the rest of gcwrap does (see launch).
    start = prepare(opts, command, job, spool_path, signals=signals)
    if start.job is None:
        # Nothing runs, so nothing is delivered or waited for: no event loop
        # (out of descriptors, it could not even be set up).
        assert start.error is not None
        from .render import Reporter

        status, message = not_started(command, start.error)
        Reporter(fmt=log_format).say(message)
        return status

    import trio

    from .agent.run import run_job
    from .render import Reporter

    # What is loaded now lives as long as gcwrap: out of the collector's
    # sight, a full collection during the run and the last one at exit
    # (about 20 ms on a small VM) do not walk it again and again.
    gc.freeze()
    gc.enable()  # (off while gcwrap loaded: see gcwrap.entry)
    # (A signal that comes once the event loop has ended is caught, and
    # goes nowhere: the job has ended, and gcwrap is saying its last words.)
    outcome = trio.run(run_job, opts, command, job, spool_path, start)
    say = Reporter(fmt=log_format)
    delivering = bool(addresses) and bool(stream_specs(opts) or opts.files)  # (else a plain pass-through)
    if not quiet and delivering and outcome.job_status is not None:
        say.summary(job_id, outcome.job_status, outcome.stats, outcome.files)
    if outcome.message:
        say.say(outcome.message)
    if outcome.lost:
        say.say(outcome.lost, lost=outcome.stats.get("lost", 0))
    if outcome.spool is not None and outcome.status in (
        exitcodes.UNDELIVERED, exitcodes.RETRY_LIMIT, exitcodes.REFUSED, exitcodes.LOST
    ):
        if outcome.pending or not outcome.lost:
            say.say(f"undelivered output {'before the lost bytes ' if outcome.lost else ''}is kept in "
                    f"{outcome.spool}", spool=str(outcome.spool))
        else:
            say.say(f"no output is kept: the spool {outcome.spool} holds the job's record, for home",
                    spool=str(outcome.spool))
        if outcome.refused:
            say.say(f"once that is fixed at home, deliver it with: "
                    f"gcwrap resume --include-refused --spool {outcome.spool.parent}")
        else:
            say.say(f"deliver it later with: gcwrap resume --spool {outcome.spool.parent}")
        if outcome.job_status is not None:
            say.say(f"the job itself exited with status {outcome.job_status}", job_status=outcome.job_status)
    gc.freeze()  # (nothing is left to collect that matters: the exit need not walk it all)
    return outcome.status


@main.command(context_settings=CONTEXT)
@click.option("--spool", "spool_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path),
              envvar="GCWRAP_SPOOL", show_envvar=True,
              help="Spool directory. Default: as for run, gcwrap-UID in the scratch directory or /tmp.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of a table.")
def status(spool_dir: Path | None, as_json: bool) -> None:
    """Show the spools on this machine: job, state, bytes written, acked, pending.

    \b
    Example:
      gcwrap status --spool /scratch/gcwrap
    """
    import json

    from .agent.spool import default_spool_dir
    from .render import output_width, print_view, status_view, stdout_console
    from .status import read_spools

    directory = spool_dir or default_spool_dir()
    spools = read_spools(directory)
    if as_json:
        click.echo(json.dumps(spools, indent=2))
    else:
        console = stdout_console()
        print_view(console, status_view(spools, output_width(console), directory))


@main.command(context_settings=CONTEXT)
@click.option("--spool", "spool_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path),
              envvar="GCWRAP_SPOOL", show_envvar=True,
              help="Spool directory. Default: as for run, gcwrap-UID in the scratch directory or /tmp.")
@click.option("--shadow", metavar="HOST:PORT", multiple=True, envvar="GCWRAP_SHADOW", show_envvar=True,
              help="Deliver to this shadow (or these: a comma-separated list, or --shadow repeated) instead of "
                   "the one(s) recorded in the spool.")
@click.option("--include-refused", is_flag=True,
              help="Also retry spools the shadow refused for good (e.g. a file owned by another job).")
@common_delivery_options
@click.argument("spools", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
def resume(
    spool_dir: Path | None, shadow: tuple[str, ...], include_refused: bool, retry_limit: int, retry_timeout: float,
    heartbeat: float, verbose: int, quiet: bool, log_format: str, compress: Any, token_file: Path | None, tls_on: bool,
    tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None, spools: tuple[Path, ...],
) -> None:
    """Deliver the output that spools left behind (a killed wrapper, an outage at job end).

    With no SPOOLS, every spool in the spool directory that no gcwrap is
    using is resumed. Exits 0 when everything is home, 121 when the run had
    lost output (the rest is delivered, home is told), 122 when something is
    still undelivered, 123 when the shadow refused a spool, 125 when a spool
    cannot be read or is in use.

    \b
    Example:
      gcwrap resume --spool /scratch/gcwrap
    """
    import trio

    from .agent.addresses import recorded_addresses
    from .agent.options import AgentOptions
    from .agent.run import resume_spool
    from .agent.spool import SpoolError, default_spool_dir, spool_files
    from .render import Reporter, setup_logging, stderr_console
    from .status import in_use

    setup_logging("gcwrap", -1 if quiet else verbose, log_format)
    say = Reporter(fmt=log_format)
    scanning = not spools
    paths = list(spools) or spool_files(spool_dir or default_spool_dir())
    if not paths:
        say.say("no spools to resume", "info")
        return
    worst = 0
    for path in paths:
        if scanning and in_use(path):
            say.say(f"{path}: in use by a running gcwrap; skipped", "info")
            continue
        try:
            job = _recorded_job(path)
        except SpoolError as e:
            say.say(str(e))
            worst = exitcodes.worst(worst, exitcodes.INTERNAL)
            continue
        if job.state == "refused" and not include_refused:
            say.say(f"job {job.job_id}: skipped, the shadow refused it: {job.reason or job.last_error} "
                    "(--include-refused to try again)", "warning")
            worst = exitcodes.worst(worst, exitcodes.REFUSED)
            continue
        addresses = shadow_addresses(shadow) if shadow else ()
        if not addresses:
            try:
                addresses = tuple(recorded_addresses(job.shadow))
            except ValueError:
                say.say(f"{path}: no shadow recorded; use --shadow HOST:PORT")
                worst = exitcodes.worst(worst, exitcodes.USAGE)
                continue
        opts = AgentOptions(shadows=addresses, retry_limit=retry_limit, retry_timeout=retry_timeout,
                            heartbeat=heartbeat, compress=compress,
                            **security(token_file, tls_on, tls_ca, tls_cert, tls_key))
        console = stderr_console()
        # A bar only for a person watching: not in a log file or a pipe.
        with resume_progress(console, job.job_id, quiet or log_format == "json" or not console.is_terminal) as progress:
            outcome = trio.run(resume_spool, opts, path, progress)
        _say_resumed(say, job.job_id, addresses, path, outcome)
        worst = exitcodes.worst(worst, outcome.status)
        if outcome.signalled:
            break  # (the batch system's walltime, Ctrl-C: the other spools wait too)
    sys.exit(worst)


def _say_resumed(say: Any, job_id: str, addresses: tuple[tuple[str, int], ...], path: Path, outcome: Any) -> None:
    """What became of one resumed spool, in a line or two."""
    from .agent.addresses import show_all

    if outcome.status == 0:
        shadow = outcome.stats.get("shadow") or show_all(addresses)
        say.say(f"job {job_id}: all output delivered to {shadow}", "info")
    elif outcome.status == exitcodes.LOST and outcome.spool is None:
        say.say(f"job {job_id}: {outcome.message}")  # (delivered: the spool is gone)
    else:
        say.say(f"job {job_id}: {outcome.message} (spool {path})")
        if outcome.lost and outcome.lost not in outcome.message:
            say.say(f"job {job_id}: {outcome.lost}")


def _recorded_job(path: Path) -> Any:
    """The job a spool records (a JobRecord); SpoolError if it cannot be read."""
    from .agent.spool import Spool

    recorded = Spool.open(path, readonly=True)
    try:
        job = recorded.job()
        recorded.streams()  # (readable before a progress bar is shown for it)
    finally:
        recorded.close()
    return job


@contextlib.contextmanager
def resume_progress(console: Any, job_id: str, hidden: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar (bytes, rate, ETA) on stderr while a spool is resumed."""
    if hidden:
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        Task,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class Speed(TransferSpeedColumn):
        """The rate once there is one (rich shows "?" until then)."""

        def render(self, task: Task) -> Text:
            return super().render(task) if task.speed is not None else Text("")

    with Progress(TextColumn("{task.fields[job]}", markup=False), BarColumn(), DownloadColumn(), Speed(),
                  TimeRemainingColumn(), console=console, transient=False) as bar:
        task = bar.add_task("resume", total=None, job=job_id)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=max(total, 1))

        yield update


@main.command(context_settings=CONTEXT)
@click.option("--size", default="8MiB", show_default=True,
              help="Bytes the sample job writes to stdout (it also writes progress lines to stderr).")
@click.option("--keep", is_flag=True, help="Keep the demo's directory instead of deleting it.")
def demo(size: str, keep: bool) -> None:
    """Run a shadow on loopback and a sample job through gcwrap; verify checksums.

    \b
    Example:
      gcwrap demo --size 64MiB
    """
    import importlib.util

    from .demo import run_demo
    from .units import parse_size

    if importlib.util.find_spec("gcwrap.shadow") is None:
        raise click.ClickException("the demo runs a gcshadow, which the bundle does not carry: "
                                   "run it with gcwrap installed (pip install gcwrap)")

    try:
        nbytes = parse_size(size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--size") from None
    sys.exit(run_demo(nbytes, keep))


@main.command(context_settings=CONTEXT,
              epilog="\n\b\nExit status:\n  0       built\n  1       not built (the reason on stderr)")
@click.option("-o", "--output", metavar="FILE", type=click.Path(dir_okay=False, path_type=Path),
              default="gcwrap.pyz", show_default=True, help="Where the bundle is written.")
def bundle(output: Path) -> None:
    """Build the agent as one executable file, to ship with jobs to machines with only Python >= 3.11.

    The file runs with `python3 FILE ...` or as `./FILE ...`, with nothing
    installed there; zstandard is used if that Python has it. At its first
    start on a machine it unpacks itself into $XDG_CACHE_HOME/gcwrap or
    /tmp/gcwrap-UID-cache, and writes nothing beside itself. Its modules are
    compiled for this Python (another compiles them once, into that cache);
    run from a bundle, `bundle` rebuilds it for the Python that runs it.

    \b
    Example:
      gcwrap bundle -o gcwrap.pyz
      python3 gcwrap.pyz --shadow home.example.org:50000 --token-file gcshadow-token --stdout out.5 -- ./app
    """
    from .bundle import BundleError, build

    try:
        built = build(output)
    except BundleError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{built.path}: {built.size / (1 << 20):.1f} MiB, {built.modules} modules compiled for Python "
               f"{sys.version_info[0]}.{sys.version_info[1]}")
