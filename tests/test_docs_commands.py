"""Every command the documentation shows works as written.

1. Every gcwrap and gcshadow command line in README.md and in every page
   of the documentation (docs/**/*.md: code blocks, and inline code that is
   a whole command), in the man pages' examples (every
   `.nf` block), in examples/ (the scripts, their comments, the HTCondor
   `arguments`) and in each command's --help examples is parsed by the real
   click parser, with the environment variables its block exports: every
   option exists and every value is valid.
2. A shadow that listens beyond loopback carries authentication (a token, or
   TLS with client certificates) or says --insecure; an agent that talks to a
   shadow beyond loopback carries the token or TLS (such a shadow refuses
   anyone else).
3. The documentation's sessions run for real, unchanged, in a sandbox of
   their own (tests/sandbox.py: its own loopback, /tmp, /etc/hosts and HOME,
   so port 50000, /tmp/rd/results and home.example.org are the documented
   ones): the quick start, the session transcript, the demo, the outage, the
   retry limit and resume, the token set-up, the seed's variables, and the
   README's five-minute tour. Each
   transcript's lines must be what the commands print, up to the figures
   that change from run to run (times, ports, instance ids). A page marks a
   session with a comment on the line before its code block,
   `<!-- session: NAME -->`: the tests find it by NAME, wherever it lies.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest

from gcwrap.agent.shadows import env_addresses, parse_addresses, show
from gcwrap.cli import main as gcwrap_main
from gcwrap.cli import parse_hostport
from gcwrap.shadow_cli import main as gcshadow_main
from gcwrap.wire.auth import is_loopback

ROOT = Path(__file__).resolve().parents[1]
# The session markers the tests run (see the module's docstring), each on one code block of one page.
SESSIONS = {"quick-start-serve", "quick-start-wrap", "quick-start-log", "quick-start-session", "seed-variables",
            "token-setup", "demo", "outage", "outage-status", "retry-limit", "resume",
            "tour-serve", "tour-job", "tour-watch", "tour-outage"}
SESSION_MARK = re.compile(r"^<!-- session: ([\w-]+) -->$")
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
        pending = (n, line) if pending is None else (pending[0], pending[1] + " " + line.strip())
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
        if condor:  # an HTCondor submit file: gcwrap is the executable, or python3 runs the bundle
            text = condor.group(1) if re.match(r"\S*gcwrap\S*\.pyz ", condor.group(1)) else "gcwrap " + condor.group(1)
        elif stripped.startswith("#"):
            # A comment: a command it gives ("# At home: gcshadow ..."), or inline code in its prose.
            given = re.match(r"#\s*(?:[A-Z][\w ]*:\s*)?((?:gcwrap|gcshadow|python3 \S*gcwrap\.pyz)\s.*)$", stripped)
            if given:
                out.append(Line(f"{where}:{n}", given.group(1), dict(env)))
            out += [Line(f"{where}:{n}", span, {}, inline=True) for span in _inline_commands(stripped)]
            continue
        elif kind == "text" or not re.search(r"\b(gcwrap|gcshadow|export) |gcwrap\S*\.pyz\b", stripped):
            continue
        for m in re.finditer(r"(?:^|;|&&)\s*export\s+((?:\w+=\S+\s*)+)", text):
            for assignment in m.group(1).split():
                key, _, value = assignment.partition("=")
                env[key] = os.path.expanduser(value)
        out.append(Line(f"{where}:{n}", text, dict(env)))
    return out


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page of the documentation (docs/**/*.md, not a build's output)."""
    pages = sorted(p for p in (root / "docs").rglob("*.md") if "_build" not in p.relative_to(root).parts)
    return [root / "README.md", *pages]


def doc_lines(root: Path = ROOT) -> list[Line]:
    return [line for page in doc_pages(root) for line in page_lines(page, root)]


def page_lines(page: Path, root: Path = ROOT) -> list[Line]:
    """The shell lines of one Markdown page: its code blocks, and inline code that is a whole command."""
    name = page.relative_to(root).as_posix()
    text = page.read_text(encoding="utf-8").splitlines()
    out: list[Line] = []
    block: list[tuple[int, str]] | None = None
    lang = ""
    for n, line in enumerate(text, 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            if block is None:
                block, lang = [], fence.group(1)
            else:
                kind = lang if lang in ("console", "text") else "sh"
                out += _block_lines(name, block, kind)
                block = None
            continue
        if block is not None:
            block.append((n, line.strip() if lang != "console" else line))
            continue
        out += [Line(f"{name}:{n}", span, {}, inline=True) for span in _inline_commands(line)]
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
            if line.startswith((".nf", ".EX")):  # .EX: a code block as Sphinx writes it
                block = []
            elif line.startswith((".fi", ".EE")) and block is not None:
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
    return doc_lines() + man_lines() + example_lines() + help_lines()


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
        bundle = r"gcwrap\S*\.pyz"  # the one-file gcwrap (`gcwrap bundle`)
        if (len(words) > 1 and re.fullmatch(r"(\S*/)?python3(\.\d+)?", words[0])
                and re.fullmatch(bundle, Path(words[1]).name)):
            words = words[1:]
        if words and re.fullmatch(bundle, Path(words[0]).name):
            out.append(Invocation(line.where, "gcwrap", words[1:], env, line.inline))
        elif words and Path(words[0]).name in PROGRAMS:
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
    pages = sum(n for where, n in wheres.items() if where.startswith("docs/"))
    assert wheres["README.md"] >= 5 and pages >= 60, wheres
    assert wheres["man/gcwrap.1"] >= 5 and wheres["man/gcshadow.1"] >= 5, wheres
    for kind in ("tutorial", "howto"):  # the pages that show commands at all
        assert sum(n for where, n in wheres.items() if where.startswith(f"docs/{kind}/")) >= 10, (kind, wheres)
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


def _shadows_of(params: dict[str, Any], env: dict[str, str]) -> list[str]:
    """Every shadow an invocation names (--shadow repeated or a list; the seed's variables)."""
    if params.get("shadow"):
        return [show(a) for a in parse_addresses(params["shadow"])]
    if env.get("BYPASS_SHADOW_HOST"):
        return [show(a) for a in env_addresses(env["BYPASS_SHADOW_HOST"], env.get("BYPASS_SHADOW_PORT"))]
    return []


def security_problems(inv: Invocation) -> list[str]:
    """What is wrong with the invocation's security posture (see the module's docstring)."""
    name, params = parse(inv)
    shown = f"{inv.where}: `{shlex.join([inv.prog, *inv.args])}`"
    if inv.prog == "gcshadow" and name == "serve" and not is_loopback(params["host"]) and not (
            params["token_file"] or params["token_dir"] or (params["tls_cert"] and params["tls_ca"])
            or params["insecure"]):
        return [(f"{shown}: listens on {params['host']} without --token-file, --token-dir, --tls-cert with --tls-ca, "
                 "or --insecure (gcshadow refuses to start)")]
    if inv.prog == "gcwrap" and name == "run":
        shadows = _shadows_of(params, inv.env)
        shadow = ",".join(shadows)
        beyond = not all(is_loopback(parse_hostport(s)[0]) for s in shadows)
        if beyond and not (params["token_file"] or params["tls_on"] or params["tls_ca"]
                                          or params["tls_cert"]):
            return [(f"{shown}: talks to the shadow {shadow} with neither a token nor TLS (such a shadow "
                     "requires one: give --token-file, as the shadow's examples do)")]
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


def test_a_wrong_command_line_on_any_page_fails(tmp_path: Path) -> None:
    """A page under docs/ is read like README.md: its wrong command lines,
    in a code block, a console transcript or inline, are found and fail;
    and a session marker that marks no code block is an error."""
    (tmp_path / "README.md").write_text("# x\n\n```sh\ngcwrap --shadow 127.0.0.1:1 -- true\n```\n")
    page = tmp_path / "docs" / "howto" / "deep" / "bad.md"
    page.parent.mkdir(parents=True)
    page.write_text("# Bad\n\nRun `gcshadow --port abc` first.\n\n<!-- session: demo -->\n```console\n"
                    "$ gcwrap --shadow h:1 --no-such-option -- true\nprinted\n```\n\n```sh\n"
                    "gcshadow --host 0.0.0.0 --root ~/r\n```\n")
    (tmp_path / "docs" / "_build").mkdir()
    (tmp_path / "docs" / "_build" / "copy.md").write_text("`gcwrap --nope`\n")  # a build's output: not a page
    lines = doc_lines(tmp_path)
    assert [line.where for line in lines] == ["README.md:4", "docs/howto/deep/bad.md:3", "docs/howto/deep/bad.md:7",
                                              "docs/howto/deep/bad.md:12"], lines
    invs = [inv for line in lines for inv in invocations(line)]
    for inv in invs[1:3]:
        with pytest.raises(AssertionError, match=r"docs/howto/deep/bad\.md"):
            parse(inv)
    assert security_problems(invs[3]) and not security_problems(invs[0])
    (block,) = [b for b in page_blocks(page, tmp_path) if b.session]
    assert (block.session, block.where, block.transcript()[0][1]) == ("demo", "docs/howto/deep/bad.md:6", ["printed"])
    page.write_text("# Bad\n\n<!-- session: demo -->\n\nA paragraph, not a block.\n")
    with pytest.raises(AssertionError, match="not followed by a code block"):
        page_blocks(page, tmp_path)


# -- 3. the documentation's sessions, run for real ------------------------------------------------------


@dataclass
class Block:
    session: str  # its marker, `<!-- session: NAME -->` on the line before it ("" for none)
    where: str  # page:line of its opening fence
    lang: str
    lines: list[str]

    def transcript(self) -> list[tuple[str, list[str]]]:
        """A console block as (command, the lines it printed)."""
        out: list[tuple[str, list[str]]] = []
        for line in self.lines:
            if line.startswith("$ "):
                out.append((line[2:], []))
            elif out:
                out[-1][1].append(line)
        return out


def page_blocks(page: Path, root: Path = ROOT) -> list[Block]:
    """The code blocks of one page, each with the session marker on the line before it, if any.
    A marker not followed by a code block is an error: a session the tests would not find."""
    name = page.relative_to(root).as_posix()
    out = []
    mark, mark_line = "", 0
    block: Block | None = None
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and block is None:
            block = Block(mark if mark_line == n - 1 else "", f"{name}:{n}", fence.group(1), [])
            mark = ""
        elif fence and block is not None:
            out.append(block)
            block = None
        elif block is not None:
            block.lines.append(line.strip() if block.lang == "sh" else line)
        else:
            found = SESSION_MARK.match(line.strip())
            if line.strip().startswith("<!-- session") and not found:
                raise AssertionError(f"{name}:{n}: not a session marker (`<!-- session: NAME -->`): {line}")
            if mark:
                raise AssertionError(f"{name}:{mark_line}: the session marker {mark!r} is not followed by a code block")
            if found:
                mark, mark_line = found.group(1), n
    if mark:
        raise AssertionError(f"{name}:{mark_line}: the session marker {mark!r} is not followed by a code block")
    return out


def doc_blocks(root: Path = ROOT) -> list[Block]:
    return [b for page in doc_pages(root) for b in page_blocks(page, root)]


def session(name: str, containing: str = "") -> Block:
    """The one code block of the documentation marked as session NAME (holding `containing`)."""
    assert name in SESSIONS, f"{name!r} is not in SESSIONS"
    found = [b for b in doc_blocks() if b.session == name]
    assert len(found) == 1, (f"the documentation needs one code block marked `<!-- session: {name} -->`, "
                             f"found {[b.where for b in found]}")
    assert any(containing in x for x in found[0].lines), f"{found[0].where}: session {name!r} lacks {containing!r}"
    return found[0]


def test_every_session_is_marked_once_and_every_marker_is_known() -> None:
    marked = Counter(b.session for b in doc_blocks() if b.session)
    assert set(marked) == SESSIONS and set(marked.values()) == {1}, marked


def shape(line: str) -> str:
    """A line with what changes from run to run made equal: figures, times,
    ports, sizes and their units, instance ids, temporary names, checksums,
    and the spacing of table cells. `gcwrap status`'s "nothing acknowledged
    for N s" shows past a second only: the outage's timing on a busy machine
    puts it on either side."""
    line = re.sub(r"; nothing acknowledged for [^;]*", "", line)
    line = re.sub(r"gcwrap-demo-[\w-]+", "gcwrap-demo-X", line)
    line = re.sub(r"\b[0-9a-f]{64}\b", "SHA256", line)
    line = re.sub(r"\b[0-9a-f]{16}\b", "INSTANCE", line)
    line = re.sub(r"\d+(\.\d+)?(?:e[-+]?\d+)?", "#", line)
    line = re.sub(r"# ?[smh] ago", "# ago", line)
    line = re.sub(r"\b(B|KiB|MiB|GiB|TiB|kB|MB|GB)\b", "U", line)
    line = re.sub(r"[━─]+", "─", line)
    return re.sub(r"\s+", " ", line).strip()


def same_lines(where: str, expected: list[str], printed: str) -> None:
    want = Counter(shape(x) for x in expected if x.strip())
    got = Counter(shape(x) for x in printed.splitlines() if x.strip())
    missing, extra = want - got, got - want
    assert not missing and not extra, (
        f"{where}: the documented transcript is not what the commands print now\n"
        f"in the documentation only: {sorted(missing)}\nprinted only: {sorted(extra)}\nprinted:\n{printed}"
    )


APP = """#!/bin/sh
# Stands in for the user's program: `./app -n N` prints N steps, and a note on stderr.
n=3; [ "$1" = -n ] && n=$2
i=1; while [ "$i" -le "$n" ]; do echo "step $i"; i=$((i + 1)); done
echo "done after $n steps" >&2
"""


def need_sandbox() -> None:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("needs root, unshare and ip: the documented commands run in namespaces of their own")


def sandbox_run(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    import sandbox

    results = sandbox.run(steps)
    assert len(results) == len(steps)
    return results


@pytest.mark.timeout(300)
def test_quick_start_and_the_seeds_variables_work_as_written() -> None:
    """The quick start's commands, unchanged, on one machine whose /etc/hosts
    names it home.example.org; then the seed's variables against the same shadow."""
    need_sandbox()
    serve, wrap = session("quick-start-serve", "gcshadow"), session("quick-start-wrap", "gcwrap")
    assert len(serve.lines) == 2 and len(wrap.lines) == 1, (serve, wrap)
    token, shadow = serve.lines[0], serve.lines[1]
    seed = session("seed-variables", "export BYPASS_SHADOW_HOST")
    steps: list[dict[str, Any]] = [
        {"file": "app", "text": APP, "mode": "755"},
        {"sh": token},
        {"serve": shadow, "name": "shadow", "port": 50000},
        {"sh": wrap.lines[0], "timeout": 60},
        {"sh": "cat ~/results/run1/out.5 ~/results/run1/err.5"},
        {"sh": "\n".join(seed.lines), "timeout": 60},
        {"sh": "cat ~/results/outfile.5 ~/results/errfile.5"},
        {"stop": "shadow"},
    ]
    r = sandbox_run(steps)
    assert r[1]["rc"] == 0, r[1]
    assert "error" not in r[2], r[2]
    assert r[3]["rc"] == 0, r[3]["output"]
    assert r[4]["output"] == "step 1\nstep 2\nstep 3\nstep 4\nstep 5\ndone after 5 steps\n", r[4]
    assert r[5]["rc"] == 0, r[5]["output"]
    assert r[6]["output"] == "step 1\nstep 2\nstep 3\ndone after 3 steps\n", r[6]
    assert "job " in r[7]["output"] and "refused" not in r[7]["output"], r[7]["output"]


@pytest.mark.timeout(300)
def test_the_readme_tour_works_as_written() -> None:
    """The README's five-minute tour, its commands unchanged: a job whose
    output `tail -f` follows to its end and `gcshadow jobs` lists; then a
    longer job, the shadow stopped under it (`gcwrap status` shows the output
    waiting) and started again with the same command: every tick arrives once."""
    need_sandbox()
    (serve,) = session("tour-serve", "gcshadow").lines
    (job,) = session("tour-job", "--job-id tour-1").lines
    follow, jobs = session("tour-watch", "gcshadow tail").lines
    long_job, status = session("tour-outage", "--job-id tour-2").lines
    assert status == "gcwrap status", status
    r = sandbox_run([
        {"serve": serve, "name": "shadow", "port": 50000},
        {"start": job, "name": "job"},
        {"sh": "until gcshadow jobs --root /tmp/tour/results --no-header | grep -q ^tour-1; do sleep 0.1; done",
         "timeout": 30},  # (the tour's reader comes once the job is running)
        {"sh": follow, "timeout": 60},
        {"sh": jobs},
        {"wait": "job", "timeout": 60},
        {"start": long_job, "name": "long"},
        {"sh": "until [ -s /tmp/tour/results/tour/long.txt ]; do sleep 0.1; done", "timeout": 30},
        {"stop": "shadow"},
        {"sh": "until gcwrap status | grep -q 'not connected'; do sleep 0.1; done", "timeout": 30},
        {"sh": status},
        {"serve": serve, "name": "shadow2", "port": 50000},
        {"wait": "long", "timeout": 120},
        {"sh": "cat /tmp/tour/results/tour/long.txt /tmp/tour/results/tour/err.txt"},
        {"stop": "shadow2"},
    ])
    assert all("error" not in x for x in r), r
    assert r[3]["rc"] == 0 and r[3]["output"] == "".join(f"step {i}\n" for i in range(1, 6)), r[3]
    assert re.search(r"^tour-1\t.*\tfinished with status 0\t", r[4]["output"], re.M), r[4]["output"]
    assert r[5]["rc"] == 0, r[5]["output"]
    assert re.search(r"tour-2 .*running .*tour/long\.txt", r[10]["output"]) and "not connected" in r[10]["output"], \
        r[10]["output"]
    assert r[12]["rc"] == 0 and "2 connection(s), 1 reconnect(s)" in r[12]["output"], r[12]["output"]
    assert r[13]["output"] == "".join(f"tick {i}\n" for i in range(1, 31)) + "done\n", r[13]


@pytest.mark.timeout(300)
def test_the_token_setup_in_security_works_as_written() -> None:
    need_sandbox()
    lines = session("token-setup", "openssl rand").lines
    assert len(lines) == 3 and lines[1].startswith("gcshadow") and lines[2].startswith("gcwrap")
    r = sandbox_run([
        {"file": "app", "text": APP, "mode": "755"},
        {"sh": lines[0]},
        {"serve": lines[1], "name": "shadow", "port": 50000},
        {"sh": lines[2], "timeout": 60},
        {"sh": "cat ~/results/out.5; stat -c %a ~/.gcshadow-token"},
        {"stop": "shadow"},
    ])
    assert "error" not in r[2], r[2]
    assert r[3]["rc"] == 0, r[3]["output"]
    assert r[4]["output"] == "step 1\nstep 2\nstep 3\n600\n", r[4]


# True once `gcwrap status` shows the outage's job with output pending and the shadow's stop as its last error.
OUTAGE_PENDING = ("gcwrap status --json | python3 -c 'import json, sys; sys.exit(not any("
                  "\"SHUTTING_DOWN\" in (s.get(\"last_error\") or \"\") and any(t[\"pending\"] for t in s[\"streams\"])"
                  " for s in json.load(sys.stdin)))'")


@pytest.mark.timeout(400)
def test_the_documented_sessions_print_what_the_documentation_shows() -> None:
    """The session of the quick start, the demo, and the failures (an outage,
    the retry limit, resume, `gcwrap status` during each), run in this order
    against one shadow on 127.0.0.1:50000 that the test stops and starts
    where the text says so. Every line printed must be in the transcript, and
    every line of the transcript printed."""
    need_sandbox()
    log_block, transcript = session("quick-start-log", "$ gcshadow"), session("quick-start-session", "$ gcwrap")
    ((serve, log_lines),) = log_block.transcript()
    demo = session("demo", "$ gcwrap demo").transcript()
    (outage,) = session("outage", "--job-id example-4").transcript()
    (outage_status,) = session("outage-status", "example-4").transcript()
    assert outage_status[0] == "gcwrap status", outage_status
    late = session("retry-limit", "--job-id example-5").transcript()
    resume = session("resume", "$ gcwrap resume").transcript()
    # Each step, and the documentation's lines for what it prints (None: not shown there).
    plan: list[tuple[dict[str, Any], tuple[str, list[str]] | None]] = [
        ({"serve": serve, "name": "shadow", "port": 50000}, None)]
    plan += [({"sh": cmd, "timeout": 120}, (f"{transcript.where} `{cmd}`", lines))
             for cmd, lines in transcript.transcript()]
    plan += [({"sh": cmd, "timeout": 120}, (f"{session('demo').where} `{cmd}`", lines)) for cmd, lines in demo]
    # "the shadow was stopped while a job ran, and started again three seconds later"
    # Each step waits for the event the page tells of, not for a time: the first tick home; after the
    # stop, output pending and the stop's SHUTTING_DOWN the last error (status then, before gcwrap's
    # come-back 3 s later); that come-back refused ("found it not yet back"); then the restart.
    plan += [({"start": outage[0], "name": "outage"}, None),
             ({"until": "grep -qs 'tick 1' /tmp/rd/results/outage/out.5", "timeout": 30}, None),
             ({"stop": "shadow"}, None), ({"until": OUTAGE_PENDING, "timeout": 30}, None),
             ({"sh": outage_status[0]}, ("`gcwrap status` during the outage", outage_status[1])),
             ({"until": "grep -q 'connection refused' .outage.log", "timeout": 30}, None),
             ({"serve": serve, "name": "shadow2", "port": 50000}, None),
             ({"wait": "outage", "timeout": 60}, (f"`{outage[0]}`", outage[1])), ({"stop": "shadow2"}, None)]
    # the retry limit, with the shadow down; then resume with it back
    plan += [({"sh": cmd, "timeout": 60}, (f"`{cmd}`", lines)) for cmd, lines in late]
    plan += [({"serve": serve, "name": "shadow3", "port": 50000}, None)]
    plan += [({"sh": cmd, "timeout": 60}, (f"`{cmd}`", lines)) for cmd, lines in resume]
    plan += [({"stop": "shadow3"}, None)]
    r = sandbox_run([step for step, _ in plan])
    if os.environ.get("GCWRAP_DOCS_TRANSCRIPTS"):  # for whoever updates the pages: what the commands print now
        Path(os.environ["GCWRAP_DOCS_TRANSCRIPTS"]).write_text("\n".join(
            f"$ {x['step'].get('sh') or x['step'].get('start') or x['step'].get('stop') or x['step'].get('wait') or ''}"
            f"\n{x.get('output', '')}" for x in r))
    failures = []
    for (_, check), result in zip(plan, r):
        assert "error" not in result, result
        if check is not None:
            try:
                same_lines(check[0], check[1], result["output"])
            except AssertionError as e:
                failures.append(str(e))
    # The shadow's log up to the outage is the page's (the outage job's own session comes after).
    (log,) = [x["output"] for x in r if x["step"].get("stop") == "shadow"]
    try:
        same_lines(f"{log_block.where} the shadow's log", log_lines,
                   "\n".join(log.splitlines()[: len([x for x in log_lines if x.strip()])]))
    except AssertionError as e:
        failures.append(str(e))
    assert not failures, "\n\n".join(failures)
