"""Every option of every command parses, from the command line and from its
environment variables (CliRunner and click's own parser, no job is run)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from helpers import tool

from gcwrap.cli import main as gcwrap_main
from gcwrap.clitypes import Size
from gcwrap.shadow_cli import main as gcshadow_main

REQUIRED = {"run": ["--", "true"], "tail": ["job"]}
REQUIRED_FIRST = {"prune": ["--finished-before", "30d"]}  # (a later --finished-before takes its place)


def sample(param: click.Option) -> str:
    t = param.type
    if isinstance(t, click.Choice):
        return str(t.choices[-1])
    if isinstance(t, Size):
        return "3MiB"
    if isinstance(t, (click.IntRange, click.types.IntParamType)):
        return "7"
    if isinstance(t, (click.FloatRange, click.types.FloatParamType)):
        return "2.5"
    if param.name == "shadow":
        return "home.example:50000"
    if param.name == "state":  # (checked as it is parsed)
        return "postgresql://gcshadow@db.example.org/gcshadow"
    if param.name == "metrics":  # ([HOST:]PORT, checked as it is parsed)
        return "127.0.0.1:9100"
    if param.name in ("since", "before"):  # (a duration or a time, checked as it is parsed)
        return "2h"
    if param.name == "columns":  # (known column names, checked as they are parsed)
        return "job,why"
    return "some/value"


def options() -> Iterator[Any]:
    for prog, main in (("gcwrap", gcwrap_main), ("gcshadow", gcshadow_main)):
        assert isinstance(main, click.Group)
        for name, cmd in sorted(main.commands.items()):
            for p in cmd.params:
                if isinstance(p, click.Option) and p.name != "help":
                    yield pytest.param(cmd, name, p, id=f"{prog}-{name}-{p.opts[-1]}")


def parse(cmd: click.Command, name: str, args: list[str]) -> dict[str, Any]:
    with cmd.make_context(name, [*REQUIRED_FIRST.get(name, []), *args, *REQUIRED.get(name, [])]) as ctx:
        return dict(ctx.params)


@pytest.mark.parametrize(("cmd", "name", "param"), list(options()))
def test_option_on_the_command_line(cmd: click.Command, name: str, param: click.Option) -> None:
    flagged = param.is_flag or param.count
    got = parse(cmd, name, [param.opts[-1]] if flagged else [param.opts[-1], sample(param)])
    default = parse(cmd, name, [])[param.name]  # type: ignore[index]
    assert got[param.name] != default, f"{param.opts[-1]} did not change {param.name}"  # type: ignore[index]


@pytest.mark.parametrize(("cmd", "name", "param"), [p for p in options() if p.values[2].envvar])
def test_option_from_each_environment_variable(
    cmd: click.Command, name: str, param: click.Option, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
    default = parse(cmd, name, [])[param.name]  # type: ignore[index]
    for var in names:
        with monkeypatch.context() as m:
            m.setenv(var, "1" if param.is_flag else sample(param))
            assert parse(cmd, name, [])[param.name] != default, f"${var} did not set {param.name}"  # type: ignore[index]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["0", "1048575", "512KiB", "0.5MiB"])
@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_memory_limit_below_1mib_is_refused(tmp_path: Path, value: str, how: str) -> None:
    """--memory-limit (or GCWRAP_MEMORY_LIMIT) below the documented least,
    1MiB, is a usage error naming it, and the job never starts (before: it
    was taken, and silently raised to 1MiB)."""
    ran = tmp_path / "ran"
    limit = ["--memory-limit", value] if how == "option" else []
    env = {**os.environ, "GCWRAP_MEMORY_LIMIT": value} if how == "environment" else None
    res = subprocess.run([*tool("gcwrap"), "--shadow", "127.0.0.1:9", "--retry-limit", "1", "--retry-timeout", "0.1",
                          "--spool", str(tmp_path / "spool"), *limit, "--stdout", "x.out", "--", "touch", str(ran)],
                         capture_output=True, text=True, timeout=30, env=env)
    assert res.returncode == 2, res.stderr
    assert "--memory-limit" in res.stderr and "at least 1MiB" in res.stderr, res.stderr
    assert not ran.exists() and not (tmp_path / "spool").exists()


def test_a_memory_limit_of_1mib_is_taken() -> None:
    assert parse(gcwrap_main.commands["run"], "run", ["--memory-limit", "1MiB"])["memory_limit"] == 1 << 20


# -- --file PATH[=NAME] ------------------------------------------------------------------------


def run_options(monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str] | None = None) -> Any:
    """The AgentOptions `gcwrap run` builds from `args` (the job is not run)."""
    import gcwrap.cli

    seen: list[Any] = []
    monkeypatch.setattr(gcwrap.cli, "_run", lambda opts, *rest: seen.append(opts) or 0)
    result = CliRunner().invoke(gcwrap_main, ["run", "--shadow", "127.0.0.1:9", *args, "--", "true"], env=env)
    assert result.exit_code == 0, result.output
    (opts,) = seen
    return opts


def test_file_specs_reach_the_agents_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from gcwrap.agent.filespecs import FileSpec

    opts = run_options(monkeypatch, ["--job-id", "4242", "--file", "train.log", "--file", "out/*.csv",
                                     "--file", "./model.bin=results/%j.bin"])
    assert opts.files == (FileSpec("train.log"), FileSpec("out/*.csv"), FileSpec("model.bin", "results/4242.bin"))
    assert run_options(monkeypatch, []).files == ()


def test_file_specs_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gcwrap.agent.filespecs import FileSpec

    opts = run_options(monkeypatch, [], env={"GCWRAP_FILES": "train.log  out/*.csv"})
    assert opts.files == (FileSpec("train.log"), FileSpec("out/*.csv"))


@pytest.mark.parametrize(("args", "says"), [
    (["--file", "/etc/passwd"], "must be relative to the job's working directory"),
    (["--file", "out/../../x"], "must not leave the job's working directory"),
    (["--file", "out/*.csv=all.csv"], "cannot land at one NAME"),
    (["--file", "x.bin=out/%z"], "%z"),
    (["--file", "a.log", "--file", "./a.log"], "given twice"),
    (["--file", ".gcshadow/x"], "give it one, PATH=NAME"),
    (["--file", "x.bin=../x"], "contains '..'"),
])
def test_file_specs_refused_with_a_clear_line(args: list[str], says: str) -> None:
    result = CliRunner().invoke(gcwrap_main, ["run", "--shadow", "127.0.0.1:9", "--job-id", "j", *args, "--", "true"])
    assert result.exit_code == 2, result.output
    assert "--file" in result.output and says in result.output, result.output
    assert "Traceback" not in result.output


def test_a_file_needs_a_shadow(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GCWRAP_SHADOW", "BYPASS_SHADOW_HOST", "BYPASS_SHADOW_PORT"):
        monkeypatch.delenv(var, raising=False)
    result = CliRunner().invoke(gcwrap_main, ["run", "--file", "x.log", "--", "true"])
    assert result.exit_code == 2 and "needs a shadow" in result.output, result.output
