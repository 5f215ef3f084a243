#!/usr/bin/env python3
"""Compare: gcwrap's own CPU per GiB of bulk output at several git revisions, interleaved.

On a shared 2-core VM the CPU a process spends on the same work drifts by a
third over minutes (other tenants, frequency): figures taken an hour apart,
even minutes apart, can't be compared. This script runs the revisions one
after another in rotation, RUNS rounds, so that each round sees the same
machine, and prints medians (min, max) and the ratio of each to the first.

Each revision is checked out with `git worktree add --detach` into a temporary
directory and byte-compiled; gcwrap runs from there as
`python -c "import sys; sys.path.insert(0, TREE); from gcwrap.cli import main; main()"`,
with `-q --shadow ... --stdout bulk.out --spool ... -- head -c SIZE /dev/zero`,
against one live `gcshadow` (the installed one, shared by all revisions, so
only the wrapper differs). Its own CPU (user+sys, all threads, not head's)
is read from /proc/PID/stat of the zombie before it is reaped; each landed
file's size is checked. Worktrees are removed in a finally.

Usage:
  python benchmarks/compare.py --rev cfe554a --rev HEAD --runs 6
  python benchmarks/compare.py --rev HEAD~1 --rev WORKTREE --runs 5 --size 1GiB   # uncommitted work too
  python benchmarks/compare.py --rev HEAD --runs 1 --size 64MiB                   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    BenchError,
    GiB,
    Results,
    ShadowProc,
    fmt,
    guarded,
    header,
    install_signal_handlers,
    parse_size,
    render_table,
    results_option,
    wait_measured,
)

REPO = Path(__file__).resolve().parent.parent
LAUNCH = "import sys; sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'gcwrap'; from gcwrap.cli import main; main()"


def checkout(rev: str, into: Path) -> Path:
    """The gcwrap tree of `rev` (WORKTREE: the working copy as it is), byte-compiled."""
    if rev == "WORKTREE":
        tree = REPO
    else:
        tree = into / rev.replace("/", "_")
        done = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(tree), rev],
                              capture_output=True, text=True, timeout=120, check=False)
        if done.returncode:
            raise BenchError(f"cannot check out {rev}: {done.stderr.strip()}")
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "gcwrap")], timeout=120, check=True)
    return tree


def one_run(tree: Path, port: int, size: int, workdir: Path, tag: str, timeout: float) -> float:
    """gcwrap's own CPU seconds for SIZE bytes of `head -c SIZE /dev/zero`."""
    name = f"{tag}.out"
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(tree), "-q", "--shadow", f"127.0.0.1:{port}", "--stdout", name,
         "--spool", str(workdir / "spool" / tag), "--job-id", tag, "--", "head", "-c", str(size), "/dev/zero"],
        start_new_session=True)
    reaped = wait_measured(proc, time.monotonic() + timeout)
    if reaped.timed_out or reaped.returncode:
        raise BenchError(f"{tag}: gcwrap exited {reaped.returncode}{' (timed out)' if reaped.timed_out else ''}")
    if reaped.own_cpu is None:
        raise BenchError(f"{tag}: could not read gcwrap's /proc/PID/stat before reaping it")
    landed = workdir / "home" / name
    if landed.stat().st_size != size:
        raise BenchError(f"{tag}: {landed.stat().st_size} bytes landed, {size} expected")
    landed.unlink()
    return reaped.own_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", action="append", required=True,
                        help="a git revision to measure (repeat; the first is the baseline; WORKTREE: uncommitted)")
    parser.add_argument("--size", type=parse_size, default=GiB, help="bytes per run (default 1GiB)")
    parser.add_argument("--runs", type=int, default=5, help="rounds over all revisions (default 5)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per run (default 300)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    results_option(parser, "compare")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    install_signal_handlers()
    results = Results("compare", args.json)
    print(header("compare"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-compare-"))
    trees: list[Path] = []
    with guarded("compare", workdir, args.keep) as outcome:
        try:
            trees = [checkout(rev, workdir / "trees") for rev in args.rev]
            cpu: list[list[float]] = [[] for _ in args.rev]
            with ShadowProc(workdir / "home", workdir / "run") as shadow:
                port = shadow.wait_ready()
                for i in range(args.runs):
                    for k, (rev, tree) in enumerate(zip(args.rev, trees)):
                        cpu[k].append(one_run(tree, port, args.size, workdir, f"r{i}-{k}", args.timeout)
                                      * GiB / args.size)
                        print(f"run {i + 1} {rev:12} {cpu[k][-1]:.3f} CPU-s/GiB", flush=True)
                        results.run(round=i + 1, rev=rev, gcwrap_cpu_s_per_gib=cpu[k][-1])
            base = statistics.median(cpu[0])
            rows = [["revision", "gcwrap CPU-s/GiB median", "min", "max", "ratio to first"]]
            for rev, values in zip(args.rev, cpu):
                rows.append([rev, fmt(statistics.median(values)), fmt(min(values)), fmt(max(values)),
                             f"{statistics.median(values) / base:.2f}x"])
            print()
            print(render_table(rows))
            results.command("gcwrap (each revision)", f"python -c 'import sys; sys.path.insert(0, TREE); "
                            f"from gcwrap.cli import main; main()' -q --shadow 127.0.0.1:PORT --stdout bulk.out "
                            f"--spool SPOOL -- head -c {args.size} /dev/zero")
            for rev, values in zip(args.rev[1:], cpu[1:]):
                results.figure(f"gcwrap CPU-s/GiB, bulk {args.size / GiB:.2f} GiB: {rev} against {args.rev[0]}",
                               "CPU-s/GiB", values, cpu[0], args.rev[0], key=True)
            results.write()
        finally:
            for tree in trees:
                if tree != REPO:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True, timeout=120, check=False)
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
