"""Every command the documentation shows works as written.

1. Every gcwrap and gcshadow command line in README.md (code blocks, and
   inline code that is a whole command), in the man pages' examples (every
   `.nf` block), in examples/ (the scripts, their comments, the HTCondor
   `arguments`) and in each command's --help examples is parsed by the real
   click parser, with the environment variables its block exports: every
   option exists and every value is valid.
2. A shadow that listens beyond loopback carries authentication (a token, or
   TLS with client certificates) or says --insecure; an agent that talks to a
   shadow beyond loopback carries the token or TLS (such a shadow refuses
   anyone else).
3. The README's own sessions run for real, unchanged, in a sandbox of their
   own (tests/sandbox.py: its own loopback, /tmp, /etc/hosts and HOME, so
   port 50000, /tmp/rd/results and home.example.org are the documented
   ones): the quick start, the session transcript, the demo, the outage, the
   retry limit and resume, the token set-up and the seed's variables. Each
   transcript's lines must be what the commands print, up to the figures
   that change from run to run (times, ports, instance ids).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import click
import pytest

from gcwrap.auth import is_loopback
from gcwrap.cli import main as gcwrap_main
from gcwrap.cli import parse_hostport
from gcwrap.shadow_cli import main as gcshadow_main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PROGRAMS: dict[str, click.Group] = {"gcwrap": gcwrap_main, "gcshadow": gcshadow_main}
# What a command line may read from its environment: stripped for the parse, so only what the docs set counts.
ENV_PREFIXES = ("GCWRAP_", "GCSHADOW_", "GRID_CONSOLE_", "BYPASS_SHADOW_")


@dataclass
class Line:
    """One shell line of the documentation (continuations joined)."""

    where: str  # file:line
    text: str
    env: dict[str, str]  # what the lines before it in the same block exported
    inline: bool = False  # inline code in prose: parsed, not held to the security rules


@dataclass
class Invocation:
    where: str
    prog: str
    args: list[str]
    env: dict[str, str]
    inline: bool


# -- the documentation's command lines ------------------------------------------------------------------


def _join_continuations(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for n, line in lines:
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.strip())
        else:
            pending = (n, line)
        if pending[1].rstrip().endswith("\\"):
            pending = (pending[0], pending[1].rstrip()[:-1])
            continue
        out.append(pending)
        pending = None
    if pending is not None:
        out.append(pending)
    return out


def _block_lines(where: str, lines: list[tuple[int, str]], kind: str = "sh") -> list[Line]:
    """The shell lines of one code block: in a console transcript only the
    `$ ` ones; in a text block (messages, a submit file) only an HTCondor
    `arguments` line; and only lines that run gcwrap or gcshadow, or export."""
    env: dict[str, str] = {}
    out = []
    if kind == "console":
        lines = [(n, line[2:]) for n, line in lines if line.startswith("$ ")]
    for n, text in _join_continuations(lines):
        stripped = text.strip()
        condor = re.match(r'arguments\s*=\s*"(.*)"\s*$', stripped)
        if condor:  # an HTCondor submit file: gcwrap is the executable
            text = "gcwrap " + condor.group(1)
        elif stripped.startswith("#"):
            # A comment: a command it gives ("# At home: gcshadow ..."), or inline code in its prose.
            given = re.match(r"#\s*(?:[A-Z][\w ]*:\s*)?((?:gcwrap|gcshadow)\s.*)$", stripped)
            if given:
                out.append(Line(f"{where}:{n}", given.group(1), dict(env)))
            out += [Line(f"{where}:{n}", span, {}, inline=True) for span in _inline_commands(stripped)]
            continue
        elif kind == "text" or not re.search(r"\b(gcwrap|gcshadow|export) ", stripped):
            continue
        for m in re.finditer(r"(?:^|;|&&)\s*export\s+((?:\w+=\S+\s*)+)", text):
            for assignment in m.group(1).split():
                key, _, value = assignment.partition("=")
                env[key] = os.path.expanduser(value)
        out.append(Line(f"{where}:{n}", text, dict(env)))
    return out


def readme_lines() -> list[Line]:
    text = README.read_text(encoding="utf-8").splitlines()
    out: list[Line] = []
    block: list[tuple[int, str]] | None = None
    lang = ""
    for n, line in enumerate(text, 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            if block is None:
                block, lang = [], fence.group(1)
            else:
                out += _block_lines("README.md", block, "console" if lang == "console" else "text" if lang == "text" else "sh")
                block = None
            continue
        if block is not None:
            block.append((n, line.strip() if lang != "console" else line))
            continue
        out += [Line(f"README.md:{n}", span, {}, inline=True) for span in _inline_commands(line)]
    return out


def _inline_commands(prose: str) -> list[str]:
    """Inline code that is a whole command: not a synopsis ([OPTIONS], COMMAND, JOB...)."""
    return [span for span in re.findall(r"`([^`]+)`", prose)
            if re.match(r"(gcwrap|gcshadow)( |$)", span) and not re.search(r"[\[\]]|\.\.\.|\b[A-Z]{3,}\b", span)]


def roff_plain(line: str) -> str:
    line = re.sub(r"\\f(\[[^]]*\]|.)", "", line)
    line = line.replace("\\-", "-").replace("\\(aq", "'").replace("\\e", "\\").replace("\\&", "")
    return line


def man_lines() -> list[Line]:
    out: list[Line] = []
    for page in sorted((ROOT / "man").glob("*.1")):
        block: list[tuple[int, str]] | None = None
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith(".nf"):
                block = []
            elif line.startswith(".fi") and block is not None:
                out += _block_lines(f"man/{page.name}", block)
                block = None
            elif block is not None:
                block.append((n, roff_plain(line)))
    return out


def example_lines() -> list[Line]:
    out: list[Line] = []
    for path in sorted((ROOT / "examples").iterdir()):
        lines = list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
        out += _block_lines(f"examples/{path.name}", lines)
    return out


def help_lines() -> list[Line]:
    """The examples in each command's --help (after "Example:" up to a blank line)."""
    out: list[Line] = []
    for prog, group in PROGRAMS.items():
        for name, cmd in {"": group, **group.commands}.items():
            block: list[tuple[int, str]] | None = None
            for n, line in enumerate([*(cmd.help or "").splitlines(), ""], 1):
                if re.match(r"\s*Examples?\b.*:\s*$", line):
                    block = []
                elif block is not None and line.strip():
                    block.append((n, line.strip()))
                elif block is not None:
                    out += _block_lines(f"{prog} {name} --help".replace("  ", " "), block)
                    block = None
    return out


def all_lines() -> list[Line]:
    return readme_lines() + man_lines() + example_lines() + help_lines()


def invocations(line: Line) -> list[Invocation]:
    """The gcwrap and gcshadow commands in a shell line (after `;`, `&&`, `|`, `exec`, VAR=value...)."""
    lex = shlex.shlex(line.text, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    try:
        words = list(lex)
    except ValueError as e:
        raise AssertionError(f"{line.where}: not a shell line ({e}): {line.text}") from None
    commands: list[list[str]] = [[]]
    for w in words:
        if w and set(w) <= set(";&|"):
            commands.append([])
        else:
            commands[-1].append(w)
    out = []
    for words in commands:
        env = dict(line.env)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words and words[0] in ("exec", "export"):
            if words[0] == "export":
                continue
            words = words[1:]
        if words and Path(words[0]).name in PROGRAMS:
            out.append(Invocation(line.where, Path(words[0]).name, words[1:], env, line.inline))
    return out


def all_invocations() -> list[Invocation]:
    return [inv for line in all_lines() for inv in invocations(line)]


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if k.startswith(ENV_PREFIXES)]:
            del os.environ[key]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse(inv: Invocation) -> tuple[str, dict[str, Any]]:
    """(subcommand, its parameters) as click parses the invocation; AssertionError if it cannot."""
    group = PROGRAMS[inv.prog]
    shown = f"{inv.where}: `{shlex.join([inv.prog, *inv.args])}`"
    with environment(inv.env):
        try:
            ctx = group.make_context(inv.prog, list(inv.args))
            protected = getattr(ctx, "_protected_args", None)
            rest = [*(ctx.protected_args if protected is None else protected), *ctx.args]
            if not rest:
                return "", {}
            name, cmd, args = group.resolve_command(ctx, rest)
            assert cmd is not None and name is not None
            sub = cmd.make_context(name, args, parent=ctx)
            return name, dict(sub.params)
        except click.exceptions.Exit:  # --help, --version
            return "", {}
        except click.ClickException as e:
            raise AssertionError(f"{shown}: {e.format_message()}") from None


# -- the tests ------------------------------------------------------------------------------------------


def test_the_documentation_has_commands_from_every_source() -> None:
    wheres = Counter(inv.where.split(":")[0].split(" ")[0] for inv in all_invocations())
    assert wheres["README.md"] >= 30 and wheres["man/gcwrap.1"] >= 5 and wheres["man/gcshadow.1"] >= 5, wheres
    assert all(wheres[f"examples/{p.name}"] >= 1 for p in (ROOT / "examples").iterdir()), wheres
    assert wheres["gcwrap"] >= 4 and wheres["gcshadow"] >= 4, wheres  # --help examples


def test_every_documented_command_parses() -> None:
    failures = []
    for inv in all_invocations():
        if inv.inline and all(a in PROGRAMS[inv.prog].commands for a in inv.args):
            continue  # prose naming a command (`gcwrap run`), not running one
        try:
            parse(inv)
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "documented commands that do not parse:\n" + "\n".join(failures)


def _shadow_of(params: dict[str, Any], env: dict[str, str]) -> str | None:
    if params.get("shadow"):
        return str(params["shadow"])
    if env.get("BYPASS_SHADOW_HOST") and env.get("BYPASS_SHADOW_PORT"):
        return f"{env['BYPASS_SHADOW_HOST']}:{env['BYPASS_SHADOW_PORT']}"
    return None


def security_problems(inv: Invocation) -> list[str]:
    """What is wrong with the invocation's security posture (see the module's docstring)."""
    name, params = parse(inv)
    shown = f"{inv.where}: `{shlex.join([inv.prog, *inv.args])}`"
    if inv.prog == "gcshadow" and name == "serve" and not is_loopback(params["host"]):
        if not (params["token_file"] or (params["tls_cert"] and params["tls_ca"]) or params["insecure"]):
            return [f"{shown}: listens on {params['host']} without --token-file, --tls-cert with --tls-ca, "
                    "or --insecure (gcshadow refuses to start)"]
    if inv.prog == "gcwrap" and name == "run":
        shadow = _shadow_of(params, inv.env)
        host = parse_hostport(shadow)[0] if shadow else "127.0.0.1"
        if not is_loopback(host) and not (params["token_file"] or params["tls_on"] or params["tls_ca"]
                                          or params["tls_cert"]):
            return [f"{shown}: talks to the shadow {shadow} with neither a token nor TLS (such a shadow "
                    "requires one: give --token-file, as the shadow's examples do)"]
    return []


def test_public_binds_carry_authentication_and_agents_carry_credentials() -> None:
    problems = [p for inv in all_invocations() if not inv.inline for p in security_problems(inv)]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_are_for() -> None:
    """The rules above fail on the lines this test exists for."""
    bad = [
        Line("x:1", "gcshadow --host 0.0.0.0 --port 50000 --root ~/results", {}),
        Line("x:2", "gcwrap --shadow home.example.org:50000 --stdout o -- ./app", {}),
        Line("x:3", "BYPASS_SHADOW_HOST=home BYPASS_SHADOW_PORT=1 gcwrap -- ./app", {}),
    ]
    for line in bad:
        (inv,) = invocations(line)
        assert security_problems(inv), line.text
    for text in ("gcshadow --port abc", "gcwrap --shadow h:1 --no-such-option -- true",
                 "gcwrap --shadow h:1 --stdout 'out/%q' -- true", "gcshadow jobs --watch --interval 0"):
        (inv,) = invocations(Line("x:4", text, {}))
        with pytest.raises(AssertionError):
            parse(inv)
    good = Line("x:5", "gcshadow --host 0.0.0.0 --root ~/r --token-file ~/.t; gcwrap --shadow 127.0.0.1:1 -- true", {})
    assert [security_problems(inv) for inv in invocations(good)] == [[], []]
