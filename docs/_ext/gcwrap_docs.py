"""Sphinx directives that write gcwrap's reference from the code itself.

- ``exit-statuses``: the table of gcwrap/exitcodes.py as a definition list, so the
  reference page and the man page cannot drift from the statuses gcwrap exits with.
- ``click-body``: one click command's help, usage, options, arguments and environment
  variables, as sphinx-click formats them, without the section sphinx-click wraps them
  in: the man pages give each command a heading of their own (its synopsis) and prose
  after the generated part. The options are not indexed there (``:no-index:``): the
  command reference pages (the ``click`` directive) are the targets of cross-references.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, ClassVar

import click
from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles
from sphinx_click import ext as sphinx_click

CODE = re.compile(r"`([^`]+)`")


def text_with_code(text: str) -> list[nodes.Node]:
    """Plain text in which `...` is inline code (exitcodes.TABLE writes commands so)."""
    out: list[nodes.Node] = []
    for i, part in enumerate(CODE.split(text)):
        if part:
            out.append(nodes.literal(part, part) if i % 2 else nodes.Text(part))
    return out


class ExitStatuses(SphinxDirective):
    """The exit statuses of gcwrap, from gcwrap.exitcodes.TABLE."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from gcwrap import exitcodes

        items = nodes.definition_list()
        for code, text in exitcodes.TABLE:
            term = nodes.term("", "", nodes.strong(code, code))
            definition = nodes.definition("", nodes.paragraph("", "", *text_with_code(text)))
            items += nodes.definition_list_item("", term, definition)
        return [items]


def load(spec: str) -> click.Command:
    module, _, attr = spec.partition(":")
    command = getattr(importlib.import_module(module), attr)
    assert isinstance(command, click.Command), spec
    return command


PLAIN = re.compile(r"([\\*`|])")
OPTION_REF = re.compile(r":option:`([^`]+)`")


def plain_help(app: Sphinx, ctx: click.Context, lines: list[str]) -> None:
    """Help texts are plain text, not reST: a glob's `*` is no emphasis, a `|` no substitution, and a
    block kept as written (click's \\b: examples) is a code block, its lines and backslashes as in --help."""
    out: list[str] = []
    block: list[str] = []
    block_head = ""
    for line in [*lines, ""]:
        body = line.lstrip()
        head = line[: len(line) - len(body)]
        if body.startswith("| ") or body == "|":
            block_head = block_head if block else head
            block.append(block_head + "    " + body[2:])
            continue
        if block:
            out += [block_head + ".. code-block:: text", "", *block, ""]
            block = []
        if body.startswith(("..", ":")) or not body:
            out.append(line)
        else:
            out.append(head + PLAIN.sub(r"\\\1", body))
    lines[:] = out[:-1]


def full_context(ctx: click.Context) -> click.Context:
    """The context click makes for the command, with its context_settings (-h, widths): sphinx-click's has none."""
    return click.Context(ctx.command, info_name=ctx.info_name, parent=ctx.parent, **ctx.command.context_settings)


def metavar(option: click.Option, ctx: click.Context) -> str:
    try:
        return option.make_metavar(ctx)  # click >= 8.2
    except TypeError:
        return option.make_metavar()  # type: ignore[call-arg]


def option_signatures(app: Sphinx, ctx: click.Context, lines: list[str]) -> None:
    """Each option's value named as `--help` names it (SIZE, PATH[=NAME]), not by its Python name."""
    values = {o.opts[0]: metavar(o, ctx) for o in ctx.command.params
              if isinstance(o, click.Option) and not (o.is_flag or o.count)}
    for i, line in enumerate(lines):
        match = re.match(r"\.\. option:: (\S+?),? .*<[^>]*>$", line)
        first = match and next((n for n in match.group(0)[len(".. option:: "):].replace(",", " ").split()
                                if n in values), None)
        if first:
            lines[i] = re.sub(r"<[^>]*>$", f"<{values[first]}>", line)


def help_option(app: Sphinx, ctx: click.Context, lines: list[str]) -> None:
    """sphinx-click leaves out -h/--help, which every command of gcwrap and gcshadow has."""
    # (Not get_help_option: click caches the option it makes, with the names of the first context asking.)
    names = full_context(ctx).help_option_names
    if names and ctx.command.add_help_option:
        lines += [f".. option:: {', '.join(names)}", "", "    Show this message and exit.", ""]


def several_envvars(app: Sphinx, ctx: click.Context, lines: list[str]) -> None:
    """An option read from several variables: one signature each, not a Python list."""
    for i, line in enumerate(lines):
        match = re.fullmatch(r"\.\. envvar:: \[(.*)\]", line)
        if match:
            names = [name.strip().strip("'\"") for name in match.group(1).split(",")]
            lines[i] = f".. envvar:: {names[0]}" + "".join(f"\n            {name}" for name in names[1:])


def usage_as_text(lines: list[str]) -> list[str]:
    """The usage as a line of text, not a code block: a synopsis, where every block is a command to run."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith(".. code-block::") and out[-2:] == [".. rubric:: Usage", ""]:
            i += 2  # the directive and its blank line
            usage = []
            while i < len(lines) and lines[i].startswith(" "):
                usage.append(lines[i].strip())
                i += 1
            out += [f"``{' '.join(usage)}``", ""]
            continue
        out.append(lines[i])
        i += 1
    return out


def unindexed(lines: list[str]) -> list[str]:
    """sphinx-click's reST with its object descriptions kept out of the index, and no labels."""
    result: list[str] = []
    in_signature = False  # `:no-index:` goes after a signature and the lines that continue it
    for line in "\n".join(lines).splitlines():
        if line.startswith(".. _"):
            continue
        line = OPTION_REF.sub(r"``\1``", line)
        if in_signature and not line.startswith("            "):
            result.append("   :no-index:")
            in_signature = False
        result.append(line)
        if line.startswith((".. option::", ".. envvar::")):
            in_signature = True
    if in_signature:
        result.append("   :no-index:")
    return result


class ClickBody(SphinxDirective):
    """``click-body module:group [subcommand]``, with ``:prog:`` the program's name."""

    required_arguments = 1
    optional_arguments = 1
    option_spec: ClassVar[dict[str, Any]] = {"prog": directives.unchanged_required}

    def run(self) -> list[nodes.Node]:
        group = load(self.arguments[0])
        prog = self.options.get("prog") or group.name or ""
        ctx = click.Context(group, info_name=prog)
        if len(self.arguments) > 1:
            assert isinstance(group, click.Group), self.arguments[0]
            ctx = click.Context(group.commands[self.arguments[1]], info_name=self.arguments[1], parent=ctx)
        ctx.meta["sphinx-click-env"] = self.env
        lines = usage_as_text(unindexed(list(sphinx_click._format_command(ctx, nested="none"))))
        container = nodes.container()
        nested_parse_with_titles(self.state, StringList(lines, ctx.command_path), container)
        return list(container.children)


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx_click")
    app.connect("sphinx-click-process-options", option_signatures)
    app.connect("sphinx-click-process-options", help_option)
    # sphinx-click emits its envvars event as "sphinx-click-process-envars" (sic), which it does not declare.
    for event in ("sphinx-click-process-envars", "sphinx-click-process-envvars"):
        if event not in app.events.events:
            app.add_event(event)
        app.connect(event, several_envvars)
    for event in ("description", "options", "arguments", "epilog"):
        app.connect(f"sphinx-click-process-{event}", plain_help)
    app.add_directive("exit-statuses", ExitStatuses)
    app.add_directive("click-body", ClickBody)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
