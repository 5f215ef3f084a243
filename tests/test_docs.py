"""The documentation tells the truth about the CLI, and keeps telling it.

- the shell completions are exactly what completions/generate.py writes from
  the click definitions (drift fails: regenerate them);
- the man pages are what Sphinx's man builder writes from docs/man/ (drift
  fails: run `python docs/build_man.py`);
- every option and environment variable of gcwrap and gcshadow is in their
  man pages (each command's options in that command's section, the
  variables under ENVIRONMENT), nothing there names an option that is gone,
  and the exit status table matches gcwrap/exitcodes.py;
- the man pages render without a groff warning, and mandoc finds nothing;
- the documentation site builds with warnings as errors, and its reference
  names every option, environment variable and exit status;
- the completions load in bash, zsh and fish, and bash and fish complete;
- every command's help has an example;
- README.md opens with the two set-up commands, and .ci/run runs the same
  test command and builds the site.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gcwrap import exitcodes
from gcwrap.cli import main as gcwrap_main
from gcwrap.shadow_cli import main as gcshadow_main

ROOT = Path(__file__).resolve().parents[1]
COMPLETIONS = ROOT / "completions"
MAN = ROOT / "man"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PROGRAMS: dict[str, click.Group] = {"gcwrap": gcwrap_main, "gcshadow": gcshadow_main}
SETUP_COMMANDS = ["pip install -e '.[test]' && gcwrap demo", "python -m pytest -q"]
SITE_COMMAND = "python -m sphinx -W --keep-going -b html docs build/docs"
# Read by gcwrap itself (not through click), so no click option declares them.
SEED_VARIABLES = {"gcwrap": ["BYPASS_SHADOW_HOST", "BYPASS_SHADOW_PORT"], "gcshadow": []}


# -- the CLI as click declares it --------------------------------------------------------------


def commands(prog: str) -> dict[str, click.Command]:
    """The group itself (as "") and each of its subcommands."""
    group = PROGRAMS[prog]
    return {"": group, **group.commands}


def options(cmd: click.Command) -> list[click.Option]:
    ctx = click.Context(cmd, **cmd.context_settings)
    return [p for p in cmd.get_params(ctx) if isinstance(p, click.Option)]


def long_options(cmd: click.Command) -> set[str]:
    return {n for o in options(cmd) for n in o.opts + o.secondary_opts if n.startswith("--")}


def envvars(prog: str) -> set[str]:
    found: set[str] = set()
    for cmd in commands(prog).values():
        for o in options(cmd):
            if o.envvar:
                found.update([o.envvar] if isinstance(o.envvar, str) else o.envvar)
    return found


# -- the man pages as text -----------------------------------------------------------------------


def roff_text(text: str) -> str:
    """Roff source to plain words: escapes resolved, fonts and quotes dropped."""
    text = re.sub(r"\\f(\[[^]]*\]|.)", "", text)
    text = text.replace("\\-", "-").replace("\\&", "").replace("\\e", "\\")
    text = re.sub(r"\\\((..)", " ", text)
    return text.replace('"', "")


def man_source(prog: str) -> str:
    return (MAN / f"{prog}.1").read_text(encoding="utf-8")


def sections(prog: str, macro: str) -> dict[str, str]:
    """Heading -> body (roff text) of each .SH or .SS section."""
    out: dict[str, str] = {}
    heading = None
    body: list[str] = []
    for line in man_source(prog).splitlines():
        if line.startswith((".SH ", ".SS ")):
            if heading is not None:
                out[heading] = "\n".join(body)
            heading, body = None, []
            if line.startswith(macro + " "):
                heading = roff_text(line[4:]).strip()
            continue
        if heading is not None:
            body.append(line)
    if heading is not None:
        out[heading] = "\n".join(body)
    return out


def command_section(prog: str, name: str) -> str:
    """The .SS section that documents `prog name` ("gcwrap [run] ..." for a default command)."""
    pattern = re.compile(rf"^{re.escape(prog)} \[?{re.escape(name)}\]?( |$)")
    found = [body for heading, body in sections(prog, ".SS").items() if pattern.match(heading)]
    assert len(found) == 1, f"man/{prog}.1 needs one .SS section for '{prog} {name}', found {len(found)}"
    return found[0]


def tags(body: str) -> list[str]:
    """The tag (roff text) of each .TP item: the next line that is not empty."""
    lines = [line for line in body.splitlines() if line.strip()]
    return [roff_text(lines[i + 1]) for i, line in enumerate(lines[:-1]) if line.strip() == ".TP"]


def mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", roff_text(text)) is not None


# -- (a) the completions are generated, not edited -------------------------------------------------


def test_completions_are_what_the_generator_writes(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(COMPLETIONS / "generate.py"), "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    generated = sorted(p.name for p in tmp_path.iterdir())
    checked_in = sorted(p.name for p in COMPLETIONS.iterdir() if p.is_file() and p.name != "generate.py")
    assert generated == checked_in, (
        f"completions/ holds {checked_in}, the generator writes {generated}: run `python completions/generate.py`"
    )
    stale = [name for name in generated if (tmp_path / name).read_bytes() != (COMPLETIONS / name).read_bytes()]
    assert not stale, (
        f"completions/{', completions/'.join(stale)} differ from what the CLI generates now: "
        "run `python completions/generate.py` and commit the result"
    )


# -- (b) the man pages name every option and variable, and no option that is gone ----------------


@pytest.mark.parametrize("prog", PROGRAMS)
def test_man_page_documents_every_long_option_of_every_command(prog: str) -> None:
    source = man_source(prog)
    missing = []
    for name, cmd in commands(prog).items():
        text = command_section(prog, name) if name else source
        missing += [f"{prog} {name} {opt}".replace("  ", " ") for opt in sorted(long_options(cmd))
                    if not mentions(text, opt)]
    assert not missing, f"man/{prog}.1 does not document: {', '.join(missing)}"


@pytest.mark.parametrize("prog", PROGRAMS)
def test_man_page_documents_no_option_the_cli_lacks(prog: str) -> None:
    """Every option a command's section defines (a .TP tag) exists in that command."""
    stale = []
    for name, cmd in PROGRAMS[prog].commands.items():
        known = {n for o in options(cmd) for n in o.opts + o.secondary_opts}
        for tag in tags(command_section(prog, name)):
            stale += [f"{prog} {name} {opt}" for opt in re.findall(r"(?<![\w-])--?[a-z][\w-]*", tag)
                      if opt not in known]
    assert not stale, f"man/{prog}.1 documents options the CLI does not have: {', '.join(stale)}"


@pytest.mark.parametrize("prog", PROGRAMS)
def test_man_page_environment_names_every_variable(prog: str) -> None:
    env = sections(prog, ".SH").get("ENVIRONMENT")
    assert env is not None, f"man/{prog}.1 has no ENVIRONMENT section"
    wanted = sorted(envvars(prog) | set(SEED_VARIABLES[prog]))
    assert wanted, f"{prog} declares no environment variable?"
    missing = [v for v in wanted if not mentions(env, v)]
    assert not missing, f"ENVIRONMENT of man/{prog}.1 lacks: {', '.join(missing)}"


def test_man_page_exit_status_matches_exitcodes() -> None:
    body = sections("gcwrap", ".SH").get("EXIT STATUS")
    assert body is not None, "man/gcwrap.1 has no EXIT STATUS section"
    codes = [tag.split()[-1] for tag in tags(body)]
    assert codes == [code for code, _ in exitcodes.TABLE], "EXIT STATUS of man/gcwrap.1 differs from exitcodes.TABLE"


def needs_sphinx() -> None:
    for module in ("sphinx", "sphinx_click", "myst_parser"):
        pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[docs]'): no docs to build")


def test_man_pages_are_what_sphinx_writes(tmp_path: Path) -> None:
    needs_sphinx()
    result = subprocess.run(
        [sys.executable, str(DOCS / "build_man.py"), "--out", str(tmp_path / "man")],
        check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    generated = sorted(p.name for p in (tmp_path / "man").iterdir())
    checked_in = sorted(p.name for p in MAN.iterdir())
    assert generated == checked_in, f"man/ holds {checked_in}, docs/build_man.py writes {generated}"
    stale = [name for name in generated if (tmp_path / "man" / name).read_bytes() != (MAN / name).read_bytes()]
    assert not stale, (
        f"man/{', man/'.join(stale)} differ from what docs/man/ and the CLI make now: "
        "run `python docs/build_man.py` and commit the result"
    )


# -- (b2) the documentation site builds, and its reference is complete -----------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built as CI builds it: warnings are errors."""
    needs_sphinx()
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         "-d", str(out / ".doctrees"), str(DOCS), str(out)],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, f"the docs do not build with -W:\n{result.stdout}{result.stderr}"
    return out


def page_text(site: Path, page: str, section: str | None = None) -> str:
    """A built page's words (or those of its <section id=...>): tags dropped, entities resolved."""
    source = (site / page).read_text(encoding="utf-8")
    if section is not None:
        found = re.search(rf'<section id="{re.escape(section)}">(.*?)</section>', source, re.DOTALL)
        assert found, f"{page} has no section {section!r}"
        source = found.group(1)
    return html.unescape(re.sub(r"<[^>]+>", " ", source))


def test_site_builds_with_warnings_as_errors(site: Path) -> None:
    for page in ["index.html", "reference/gcwrap.html", "reference/gcshadow.html", "man/gcwrap.html"]:
        assert (site / page).is_file(), f"the site has no {page}"


def test_reference_names_every_option_variable_and_exit_status(site: Path) -> None:
    """Each command's options in its own section of the command reference, every variable, every status."""
    missing = []
    for prog in PROGRAMS:
        for name, cmd in commands(prog).items():
            text = page_text(site, f"reference/{prog}.html", f"{prog}-{name}" if name else None)
            missing += [f"{prog} {name} {opt}".replace("  ", " ") for opt in sorted(long_options(cmd))
                        if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text)]
        env = page_text(site, "reference/environment.html")
        missing += [v for v in sorted(envvars(prog) | set(SEED_VARIABLES[prog])) if not re.search(rf"\b{v}\b", env)]
    assert not missing, f"the reference pages do not mention: {', '.join(missing)}"
    source = (site / "reference" / "exit-status.html").read_text(encoding="utf-8")
    codes = re.findall(r"<dt><strong>([^<]*)</strong></dt>", source)
    assert codes == [code for code, _ in exitcodes.TABLE], "reference/exit-status differs from exitcodes.TABLE"


# -- (c) the man pages render cleanly ---------------------------------------------------------------


@pytest.mark.parametrize("prog", PROGRAMS)
def test_man_page_renders_without_groff_warnings(prog: str) -> None:
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed (apt-get install groff): cannot check the man pages render")
    result = subprocess.run(
        ["groff", "-ww", "-man", "-Tutf8", str(MAN / f"{prog}.1")],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0 and result.stderr == "", f"groff -ww on man/{prog}.1:\n{result.stderr}"
    assert f"{prog.upper()}(1)" in result.stdout


@pytest.mark.parametrize("prog", PROGRAMS)
def test_man_page_passes_mandoc_lint(prog: str) -> None:
    if shutil.which("mandoc") is None:
        pytest.skip("mandoc is not installed (apt-get install mandoc): no second opinion on the man pages")
    result = subprocess.run(
        ["mandoc", "-T", "lint", "-W", "warning", str(MAN / f"{prog}.1")],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, f"mandoc -T lint on man/{prog}.1:\n{result.stdout}{result.stderr}"


# -- (d) the completions load, and complete ---------------------------------------------------------


def run_shell(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)


@pytest.mark.parametrize("prog", PROGRAMS)
def test_bash_sources_the_completion(prog: str, tmp_path: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    script = f"source {COMPLETIONS / (prog + '.bash')} && complete -p {prog}"
    result = run_shell(["bash", "--norc", "-c", script], tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert f"-F _{prog} {prog}" in result.stdout


BASH_CASES = [
    # words on the line (the last is being completed), some of what must be offered
    (["gcwrap", ""], {"run", "status", "resume", "demo"}),
    (["gcwrap", "--std"], {"--stdout", "--stderr", "--stdin"}),
    (["gcwrap", "--shadow", "h", ":", "1", "--ret"], {"--retry-limit", "--retry-timeout"}),
    (["gcwrap", "--spool", "sp"], {"spooldir"}),
    (["gcwrap", "--shadow", "h", ":", "1", "--", "ech"], {"echo"}),
    (["gcwrap", "status", "--"], {"--spool", "--json", "--help"}),
    (["gcwrap", "resume", "spo"], {"spooldir", "spoolfile.spool"}),
    (["gcshadow", ""], {"serve", "jobs", "tail"}),
    (["gcshadow", "--port-file", "spoolf"], {"spoolfile.spool"}),
    (["gcshadow", "tail", "--"], {"--root", "--help"}),
]


@pytest.mark.parametrize(("words", "expected"), BASH_CASES, ids=[" ".join(w) for w, _ in BASH_CASES])
def test_bash_completes(words: list[str], expected: set[str], tmp_path: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    (tmp_path / "spooldir").mkdir()
    (tmp_path / "spoolfile.spool").write_text("")
    prog = words[0]
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    script = (
        f"source {COMPLETIONS / (prog + '.bash')}\n"
        f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; COMPREPLY=()\n"
        f"_{prog}\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    result = run_shell(["bash", "--norc", "-c", script], tmp_path)
    assert result.returncode == 0, result.stderr
    offered = set(result.stdout.split())
    assert expected <= offered, f"{' '.join(words)!r}: offered {sorted(offered)}"


def choice_cases() -> list[tuple[list[str], list[str]]]:
    """Words before a value that has choices (an option's or an argument's), and the choices."""
    cases = []
    for prog, group in PROGRAMS.items():
        for name, cmd in group.commands.items():
            ctx = click.Context(cmd, **cmd.context_settings)
            arguments = [p for p in cmd.get_params(ctx) if isinstance(p, click.Argument)]
            for o in options(cmd):
                if isinstance(o.type, click.Choice):
                    cases += [([prog, name, n], [str(c) for c in o.type.choices]) for n in o.opts if n.startswith("--")]
            for pos, a in enumerate(arguments):
                if isinstance(a.type, click.Choice) and all(b.nargs == 1 for b in arguments[:pos]):
                    cases.append(([prog, name, *(["x"] * pos)], [str(c) for c in a.type.choices]))
    return cases


CHOICE_CASES = choice_cases()


@pytest.mark.parametrize(("words", "choices"), CHOICE_CASES, ids=[" ".join(w) for w, _ in CHOICE_CASES])
def test_bash_completes_every_choice(words: list[str], choices: list[str], tmp_path: Path) -> None:
    test_bash_completes([*words, ""], set(choices), tmp_path)


@pytest.mark.parametrize("prog", PROGRAMS)
def test_zsh_parses_the_completion(prog: str, tmp_path: Path) -> None:
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed (apt-get install zsh): cannot check the zsh completion")
    result = run_shell(["zsh", "-n", str(COMPLETIONS / f"_{prog}")], tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert (COMPLETIONS / f"_{prog}").read_text().startswith(f"#compdef {prog}\n")


@pytest.mark.parametrize("prog", PROGRAMS)
def test_fish_parses_the_completion(prog: str, tmp_path: Path) -> None:
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed (apt-get install fish): cannot check the fish completion")
    result = run_shell(["fish", "--no-execute", str(COMPLETIONS / f"{prog}.fish")], tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr


FISH_CASES = [
    ("gcwrap ", {"run", "status", "resume", "demo"}),
    ("gcwrap --std", {"--stdout", "--stderr", "--stdin"}),
    ("gcwrap --shadow h:1 -- ech", {"echo"}),
    ("gcwrap resume --", {"--spool", "--shadow", "--retry-limit"}),
    ("gcshadow --ro", {"--root"}),
    ("gcshadow ", {"serve", "jobs", "tail"}),
]


@pytest.mark.parametrize(("line", "expected"), FISH_CASES, ids=[line for line, _ in FISH_CASES])
def test_fish_completes(line: str, expected: set[str], tmp_path: Path) -> None:
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed (apt-get install fish): cannot check the fish completion")
    prog = line.split()[0]
    script = f"source {COMPLETIONS / (prog + '.fish')}; complete -C '{line}'"
    result = run_shell(["fish", "--no-config", "-c", script], tmp_path)
    assert result.returncode == 0, result.stderr
    offered = {row.split("\t")[0] for row in result.stdout.splitlines()}
    assert expected <= offered, f"{line!r}: offered {sorted(offered)}"


# -- (e) every command's help has an example ----------------------------------------------------------


@pytest.mark.parametrize(
    ("prog", "name"), [(prog, name) for prog in PROGRAMS for name in commands(prog)],
    ids=[f"{prog} {name}".strip() for prog in PROGRAMS for name in commands(prog)],
)
def test_every_command_help_has_an_example(prog: str, name: str) -> None:
    cmd = commands(prog)[name]
    assert "Example" in (cmd.help or ""), f"`{prog} {name}`: its help text has no example"
    args = [name, "--help"] if name else ["--help"]
    result = CliRunner().invoke(PROGRAMS[prog], args, prog_name=prog)
    assert result.exit_code == 0, result.output
    assert "Example" in result.output, f"`{prog} {name} --help` shows no example"


# -- (f) README opens with the two set-up commands -------------------------------------------------------


def test_readme_first_code_block_is_the_two_setup_commands() -> None:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no code block"
    commands_ = [line.strip() for line in match.group(1).splitlines() if line.strip()]
    assert commands_ == SETUP_COMMANDS, f"README.md's first code block must be exactly {SETUP_COMMANDS}"
    before = text[: match.start()]
    assert before.startswith("# ") and before.count("```") == 0


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert SETUP_COMMANDS[1] in [line.strip() for line in ci.splitlines()], ".ci/run must run `python -m pytest -q`"


def test_ci_builds_the_site_with_warnings_as_errors() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert SITE_COMMAND in [line.strip() for line in ci.splitlines()], f".ci/run must run `{SITE_COMMAND}`"
    installs = re.findall(r"pip install [^\n]*-e '\.\[([^]]*)\]'", ci)
    assert any("docs" in extras.split(",") for extras in installs), ".ci/run must install the docs extra"
