"""The package's shape, checked: no import circle, small modules and
functions, layers that point one way.

These read the source with `ast` (nothing is imported), so a circle hidden
behind `if TYPE_CHECKING:` or inside a function counts as much as one at
the top of a module.

What does not meet a target yet is listed below as a known exception, with
its size today: the list may only shrink. A listed module or function that
grows fails, one that meets the target fails until it leaves the list, and
anything new must meet the target.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

PACKAGE = Path(__file__).resolve().parent.parent / "gcwrap"
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
MAX_ATTRIBUTES = 20  # per class, every class of the package

# Known exceptions (lines today). They shrink; none is added.
BIG_MODULES: dict[str, int] = {}
LONG_FUNCTIONS: dict[str, int] = {}


def _package(name: str) -> tuple[str, ...]:
    """Every module of one of the package's subpackages (gcwrap.agent, ...)."""
    dotted = (p.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", ".")
              for p in (PACKAGE / name).rglob("*.py"))
    return tuple(sorted(d.removesuffix(".__init__") for d in dotted))


# Layer rules (module -> modules it must not import, even for types only).
# The two programs' sides are packages: what runs on the execute machine
# (gcwrap.agent) never imports the shadow's modules (gcwrap.shadow), and the
# reverse; the protocol they share (gcwrap.wire) imports neither.
AGENT_SIDE = _package("agent")
SHADOW_SIDE = _package("shadow")
WIRE = _package("wire")
CLIS = ("gcwrap.cli", "gcwrap.shadow_cli")
# The face: what draws for a terminal. Logic reaches it never (sizes and
# durations in words come from gcwrap.units, which both use).
FACE = ("gcwrap.render", "gcwrap.render_jobs")
LAYERS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(WIRE, (*AGENT_SIDE, *SHADOW_SIDE, *CLIS, *FACE, "gcwrap.db")),
    **dict.fromkeys(AGENT_SIDE, (*SHADOW_SIDE, *CLIS, *FACE)),
    **dict.fromkeys(SHADOW_SIDE, (*AGENT_SIDE, *CLIS, *FACE)),
    "gcwrap.units": (*AGENT_SIDE, *SHADOW_SIDE, *WIRE, *CLIS, *FACE),
    "gcwrap.shadow_cli": ("gcwrap.cli",),
    # The sender speaks to the outbox and reads bytes through a small
    # interface: it knows neither the agent nor how the spool is kept.
    "gcwrap.agent.sender": ("gcwrap.agent.agent", "gcwrap.agent.spool", "gcwrap.agent.spooler",
                            "gcwrap.agent.segments", "gcwrap.db"),
    "gcwrap.agent.outbox": ("gcwrap.agent.agent", "gcwrap.agent.sender", "gcwrap.agent.spool",
                            "gcwrap.agent.spooler", "gcwrap.agent.segments", "gcwrap.db"),
    "gcwrap.agent.records": ("gcwrap.agent.spool", "gcwrap.agent.spooler", "gcwrap.db"),
    "gcwrap.agent.policy": ("gcwrap.agent.agent", "gcwrap.agent.sender", "gcwrap.agent.spool",
                            "gcwrap.agent.spooler", "gcwrap.db"),
}
# Known layer exceptions (module, what it imports). They shrink.
WRONG_WAY: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `module` imports, anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            # `from pkg import mod` imports the module pkg.mod when there is one.
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    # The package itself (gcwrap/__init__) is imported by each module: only its own imports count.
    return {m: imports(m, p, known) - {"gcwrap"} for m, p in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the list of modules around it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, by qualified name (Class.method, outer.inner)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def module_sizes() -> dict[str, int]:
    return {name: len(path.read_text().splitlines()) for name, path in modules().items()}


def function_sizes() -> dict[str, int]:
    sizes = {}
    for name, path in modules().items():
        for qualname, fn in functions(ast.parse(path.read_text())):
            first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
            sizes[f"{name}.{qualname}"] = (fn.end_lineno or fn.lineno) - first + 1
    return sizes


def attributes(cls: ast.ClassDef) -> set[str]:
    """What a class keeps: every `self.X` it assigns, and its annotated class-level fields."""
    names = {st.target.id for st in cls.body if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
        else:
            continue
        names |= {e.attr for e in _assigned(targets)
                  if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"}
    return names


def _assigned(targets: list[ast.expr]) -> Iterator[ast.expr]:
    """What an assignment binds: its targets, and the elements of those that unpack."""
    for t in targets:
        if isinstance(t, (ast.Tuple, ast.List)):
            yield from _assigned(t.elts)
        elif isinstance(t, ast.Starred):
            yield from _assigned([t.value])
        else:
            yield t


def classes(path: Path) -> Iterator[ast.ClassDef]:
    return (node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef))


def over(sizes: dict[str, int], limit: int, known: dict[str, int]) -> list[str]:
    """What breaks the rule: too large and not a known exception, a known
    exception that grew, or one that meets the target and must leave the list."""
    wrong = [f"{n}: {s} lines (limit {limit})" for n, s in sizes.items() if s > limit and n not in known]
    for n, allowed in known.items():
        size = sizes.get(n, 0)
        if size > allowed:
            wrong.append(f"{n}: {size} lines, grew past its known {allowed}")
        elif size <= limit:
            wrong.append(f"{n}: {size} lines, meets the limit now: remove it from the known exceptions")
    return wrong


# -- the checks check themselves ---------------------------------------------------


def test_the_cycle_finder_finds_a_circle_and_only_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_are_resolved_relative_and_type_only_alike(tmp_path: Path) -> None:
    path = tmp_path / "x.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..wire import events\n"
                    "from .outbox import OutStream\ndef f():\n    from . import late\n")
    known = {"gcwrap.wire.events", "gcwrap.wire", "gcwrap.agent.outbox", "gcwrap.agent.x", "gcwrap.agent.late"}
    assert imports("gcwrap.agent.x", path, known) == {"gcwrap.wire.events", "gcwrap.agent.outbox",
                                                      "gcwrap.agent.late"}


def test_functions_are_named_by_their_class_and_measured_with_decorators() -> None:
    tree = ast.parse("class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n")
    found = {name: (fn.end_lineno or 0) - min([fn.lineno, *(d.lineno for d in fn.decorator_list)]) + 1
             for name, fn in functions(tree)}
    assert found == {"A.f": 4, "A.f.g": 2}


def test_known_exceptions_shrink() -> None:
    assert over({"a": 10, "b": 5}, 8, {}) == ["a: 10 lines (limit 8)"]
    assert over({"a": 10}, 8, {"a": 9})[0].startswith("a: 10 lines, grew")
    assert over({"a": 7}, 8, {"a": 9})[0].startswith("a: 7 lines, meets the limit")
    assert over({"a": 9}, 8, {"a": 9}) == []


def test_attributes_are_what_self_assigns_and_annotated_fields() -> None:
    tree = ast.parse("class A:\n    x: int\n    y = 1\n    def f(self):\n        self.a = self.b.c = 0\n"
                     "        self.a += 1\n        self.e, (self.f, *self.g) = h\n"
                     "        with g() as self.d:\n            other.z = 0\n")
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
    assert attributes(cls) == {"x", "a", "d", "e", "f", "g"}


# -- the targets ----------------------------------------------------------------


def test_no_import_circle() -> None:
    # Every import counts, at the top of a module or inside a function: an
    # import put off to a function's first call is still a circle in the
    # design (and one function's call away from a half-made module).
    edges = graph()
    for module, target in WRONG_WAY:  # (known, and checked by test_layers_point_one_way)
        edges[module].discard(target)
    assert find_cycle(edges) is None


TESTS = Path(__file__).resolve().parent
BENCHMARKS = TESTS.parent / "benchmarks"
# Known circles outside the package ((module, what it imports) taken out to break each). They shrink.
FLAT_CIRCLES: dict[str, set[tuple[str, str]]] = {}


def flat_graph(folder: Path) -> dict[str, set[str]]:
    """The imports among a folder's own modules, imported by their bare names
    (tests/ and benchmarks/ put their folder on sys.path): `import helpers`."""
    mods = {path.stem: path for path in sorted(folder.glob("*.py"))}
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


@pytest.mark.parametrize("folder", [TESTS, BENCHMARKS], ids=["tests", "benchmarks"])
def test_no_import_circle_among_the_test_and_benchmark_modules(folder: Path) -> None:
    # The helper modules (helpers, faults, pgserver...) and the test modules
    # that others borrow from (test_web for test_web_browser), any import alike.
    edges = flat_graph(folder)
    known = FLAT_CIRCLES.get(folder.name, set())
    assert {(m, t) for m, t in known if t not in edges.get(m, set())} == set(), \
        "known circles that are gone: remove them from FLAT_CIRCLES"
    for module, target in known:
        edges[module].discard(target)
    assert find_cycle(edges) is None


def test_the_flat_graph_reads_bare_imports(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("import faults\n")
    (tmp_path / "faults.py").write_text("def f():\n    from helpers import wait_until\n")
    (tmp_path / "test_x.py").write_text("import os\nfrom helpers import x\n")
    edges = flat_graph(tmp_path)
    assert edges == {"faults": {"helpers"}, "helpers": {"faults"}, "test_x": {"helpers"}}
    assert find_cycle(edges) == ["faults", "helpers", "faults"]


def public_classes() -> Iterator[tuple[str, ast.ClassDef]]:
    """Every class of the package whose name does not start with _, nested ones too."""
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                yield f"{name}.{node.name}", node


def test_every_public_class_says_what_it_is() -> None:
    assert len(list(public_classes())) > 100  # (the walk finds them)
    assert [name for name, node in public_classes() if not ast.get_docstring(node)] == []


def test_no_module_over_700_lines() -> None:
    assert over(module_sizes(), MAX_MODULE_LINES, BIG_MODULES) == []


def test_no_function_over_80_lines() -> None:
    assert over(function_sizes(), MAX_FUNCTION_LINES, LONG_FUNCTIONS) == []


def _forbidden(module: str, target: str) -> bool:
    return target in LAYERS.get(module, ())


def test_layers_point_one_way() -> None:
    wrong = {(m, t) for m, targets in graph().items() for t in targets if _forbidden(m, t)}
    assert wrong - WRONG_WAY == set(), "imports against the layers"
    assert WRONG_WAY - wrong == set(), "known exceptions that are gone: remove them from WRONG_WAY"


# What importing the outbox and the sender still pulls in (known, shrinking).
PURE_LEAKS: set[str] = set()


def test_the_outbox_and_the_sender_import_no_sqlite_not_even_through_others() -> None:
    code = ("import sys, gcwrap.agent.outbox, gcwrap.agent.sender; "
            "print(' '.join(m for m in ('sqlite3', 'sqlite_utils', '_sqlite3', 'gcwrap.agent.agent', "
            "'gcwrap.agent.spool') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert set(out.stdout.split()) == PURE_LEAKS


def test_failures_are_recognised_by_class_not_by_name() -> None:
    source = modules()["gcwrap.agent.retry"].read_text()
    assert "__name__" not in source


def test_no_class_keeps_more_than_20_attributes() -> None:
    """A class that keeps more is doing several things: split it by
    responsibility (the attributes that change together, with one owner)."""
    wrong = [f"{name}.{cls.name}: {len(attrs)} attributes (limit {MAX_ATTRIBUTES})"
             for name, path in modules().items()
             for cls in classes(path) if len(attrs := attributes(cls)) > MAX_ATTRIBUTES]
    assert wrong == []


def test_the_run_reaches_the_agent_through_its_methods_only() -> None:
    """gcwrap.agent.run talks to `Agent` through named methods and
    properties, never an attribute the agent keeps (its parts, its state)."""
    mods = modules()
    agent = next(c for c in classes(mods["gcwrap.agent.agent"]) if c.name == "Agent")
    kept = attributes(agent)
    used = {node.attr for node in ast.walk(ast.parse(mods["gcwrap.agent.run"].read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "agent"}
    assert kept and used
    assert used & kept == set()
