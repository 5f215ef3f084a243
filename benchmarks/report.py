#!/usr/bin/env python3
"""The results table of benchmarks/README.md, made from the benchmarks' JSON (benchmarks/results/*.json).

Every benchmark script writes what one invocation measured to
benchmarks/results/NAME.json (benchlib.Results). This script turns those
files, and nothing else, into the table between the markers in
benchmarks/README.md: one row per key figure (gcwrap's median with min-max,
the baseline's of the same invocation, the ratio of the medians, the target
an issue set, the date, commit and load average of the invocation), a row
"not run in this round" for a benchmark without a JSON file, and below it
the command and machine of each invocation. No figure is typed by hand.

Usage:
  python benchmarks/report.py            # rewrite the table in benchmarks/README.md
  python benchmarks/report.py --check    # exit 1 if the README's table is not what the JSON makes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
BEGIN = "<!-- results: made by benchmarks/report.py from benchmarks/results/*.json; do not edit by hand -->"
END = "<!-- end of results -->"
NOT_BENCHMARKS = {"benchlib", "middleboxes", "report"}  # (helpers the benchmarks share, and this script)


def benchmarks(here: Path = HERE) -> list[str]:
    """The benchmark scripts of this directory, by name."""
    return sorted(p.stem for p in here.glob("*.py") if p.stem not in NOT_BENCHMARKS)


def load(results: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Every benchmark's JSON, by name."""
    found = {}
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        found[data["benchmark"]] = data
    return found


def number(x: float | None) -> str:
    """Three significant digits or so, as the scripts print them."""
    if x is None:
        return "-"
    if abs(x) >= 10**6:
        return f"{x / 10**6:.2f} M"
    if abs(x) >= 10**4:
        return f"{x / 1000:.0f} k"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def spread(stats: dict[str, Any]) -> str:
    """'median (min-max)', or the one value of a single run."""
    if stats["median"] is None:
        return "-"
    if len(stats["runs"]) == 1 or stats["min"] == stats["max"]:
        return number(stats["median"])
    return f"{number(stats['median'])} ({number(stats['min'])}-{number(stats['max'])})"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def rows_of(data: dict[str, Any]) -> list[list[str]]:
    """The table's rows for one benchmark's JSON: its key figures."""
    date = data["date"].replace("T", " ")[:16]
    commit = data["commit"] + (" (gcwrap/ modified)" if data["dirty"] else "")
    load = f"{data['load_before'][0]:.1f} -> {data['load_after'][0]:.1f}"
    rows = []
    for fig in data["figures"]:
        if not fig["key"]:
            continue
        base = fig["baseline"]
        ratio = "-" if fig["ratio"] is None else f"{fig['ratio']:.2f}x"
        rows.append([f"`{data['benchmark']}.py`", fig["name"], spread(fig["gcwrap"]),
                     f"{base['name']}: {spread(base)}" if base else "-", ratio if base else "-",
                     fig["target"] or "", date, commit, load])
    return rows


def machine(data: dict[str, Any]) -> str:
    m = data["machine"]
    return f"{m['cores']} CPUs ({m['cpu']}), Linux {m['kernel']}, Python {m['python']}"


def table(found: dict[str, dict[str, Any]], names: list[str]) -> str:
    """The generated part of the README: the table, then each invocation's command and machine."""
    out = [BEGIN, "",
           ("| benchmark | figure | gcwrap: median (min-max) | baseline, same run | ratio | target | date (UTC) "
            "| commit | load (1 min) |"),
           "|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        if name in found:
            out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows_of(found[name])]
        else:
            out.append(f"| `{name}.py` | not run in this round | | | | | | | |")
    ran = [found[name] for name in names if name in found]
    machines = sorted({machine(data) for data in ran})
    out += ["", "The invocations behind the table (" + ("on " + machines[0] if len(machines) == 1 else
                                                      "machines as given") + "; all figures in `results/NAME.json`):",
            ""]
    for data in ran:
        settings = " ".join(f"{k}={v}" for k, v in data["settings"].items())
        out.append(f"- `{data['command']}`" + (f" with {settings}" if settings else "")
                   + (f", on {machine(data)}" if len(machines) > 1 else ""))
    out += ["", END]
    return "\n".join(out)


def rewrite(readme: str, generated: str) -> str:
    """The README with the text between the markers replaced by `generated`."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"report.py: {README} lacks the markers {BEGIN!r} ... {END!r}")
    return readme[:start] + generated + readme[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if the README's table differs from what the JSON makes")
    args = parser.parse_args(argv)
    readme = README.read_text()
    wanted = rewrite(readme, table(load(), benchmarks()))
    if args.check:
        if wanted != readme:
            print("report.py: benchmarks/README.md's table is not what benchmarks/results/*.json make: "
                  "run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    if wanted != readme:
        README.write_text(wanted)
        print(f"report.py: rewrote the table in {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
