#!/usr/bin/env python3
"""Start-up: `gcwrap -- true` against the bare import of its dependencies and an empty Python.

Each round runs these commands once, in a rotating order, and times each from
spawn to exit (wall clock, time.perf_counter):

    gcwrap -- true                                    pass-through: no shadow, no stream NAME
    PYTHON -c "import trio, click, rich, sqlite_utils"   the target's baseline (<= 1.3x this), from the days
                                                      gcwrap imported all four at start-up
    PYTHON -c "import trio"                           what `gcwrap -- true` does import now (with click)
    PYTHON -c pass                                    the interpreter alone
    gcwrap --shadow 127.0.0.1:PORT --stdout startup-N.out --spool DIR --job-id ID -- true
                                                      with a live gcshadow (one per benchmark run)
    PYTHON gcwrap.pyz -- true                         the same from the one-file bundle (`gcwrap bundle`,
                                                      built into the benchmark's directory first)
    gcwrap --shadow ... -- sh -c 'date +%s.%N > STAMP'   the same with a job that writes the time it
                                                      started: spawn -> the job's start is how long the
                                                      job waits for gcwrap (the spool, its pipes)
    sh -c 'date +%s.%N > STAMP'                       that job alone, for its own share of that

PYTHON is the interpreter of the gcwrap script (its #! line), so both sides
import the same installed packages. When `gcwrap` on PATH is a pyenv shim
(a bash script that runs `pyenv exec`), the real script is timed and the
shim is timed separately, as its own row, for context.

Then `PYTHON -X importtime -m gcwrap -- true` is run a few times and the
modules with the largest import times (self, and cumulative for the
packages imported at top level) are listed, averaged over those runs.

Every command has a timeout; a non-zero exit or a timeout fails the
benchmark (exit status 1). The shadow is stopped by pid in a finally.

Usage:
  python benchmarks/startup.py --runs 15
  python benchmarks/startup.py --runs 3 --importtime-runs 1     # smoke
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    BenchError,
    ShadowProc,
    fmt,
    guarded,
    header,
    install_signal_handlers,
    render_table,
    summary,
    tools,
)

IMPORT_DEPS = "import trio, click, rich, sqlite_utils"
IMPORT_TRIO = "import trio"
BUNDLE_KEY = "python gcwrap.pyz -- true (the bundle)"


def real_script(path: str) -> tuple[str, str | None]:
    """(the real gcwrap script, the shim in front of it or None) when PATH holds a pyenv shim."""
    try:
        head = Path(path).read_bytes()[:4096]
    except OSError:
        return path, None
    if b"pyenv" in head and b"exec" in head:
        try:
            found = subprocess.run(["pyenv", "which", Path(path).name], capture_output=True, text=True, timeout=30,
                                   check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return path, None
        if found:
            return found, path
    return path, None


def interpreter_of(script: str) -> str:
    try:
        first = Path(script).read_bytes().split(b"\n", 1)[0].decode()
    except (OSError, UnicodeDecodeError):
        return sys.executable
    if first.startswith("#!") and "python" in first:
        parts = first[2:].split()
        if parts and parts[0].endswith("/env") and len(parts) > 1:
            return shutil.which(parts[1]) or sys.executable
        if parts:
            return parts[0]
    return sys.executable


STAMP_JOB = "date +%s.%N > {}"


def timed(cmd: list[str], timeout: float, stamp: Path | None = None,
          started: list[float] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child tree) of one run; BenchError on failure.
    With `stamp` (the file a STAMP_JOB writes) the seconds from spawn to the
    job's start are appended to `started`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    if stamp is not None:
        stamp.unlink(missing_ok=True)
    epoch = time.time()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise BenchError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from None
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise BenchError(f"exit status {proc.returncode}: {' '.join(cmd)}\n{proc.stderr.decode(errors='replace')[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if stamp is not None and started is not None:
        try:
            started.append(float(stamp.read_text()) - epoch)
        except (OSError, ValueError) as e:
            raise BenchError(f"the job wrote no start time to {stamp}: {e}") from None
    return wall, cpu


def importtime(python: str, runs: int, timeout: float, env: dict[str, str]) -> tuple[list[tuple[str, float, float]], float]:
    """Modules by mean self and cumulative import time (ms), and the mean total, over `runs` runs."""
    selfs: dict[str, float] = defaultdict(float)
    cums: dict[str, float] = defaultdict(float)
    depth: dict[str, int] = {}
    total = 0.0
    line_re = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")
    for _ in range(runs):
        proc = subprocess.run([python, "-X", "importtime", "-m", "gcwrap", "--", "true"], check=False,
                              stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, env=env, start_new_session=True)
        if proc.returncode != 0:
            raise BenchError(f"-X importtime run exited {proc.returncode}: {proc.stderr[-2000:]}")
        for line in proc.stderr.splitlines():
            m = line_re.match(line)
            if not m:
                continue
            us_self, us_cum, indent, name = int(m.group(1)), int(m.group(2)), len(m.group(3)), m.group(4)
            selfs[name] += us_self / 1000 / runs
            cums[name] += us_cum / 1000 / runs
            depth[name] = min(depth.get(name, indent), indent)
            if indent == 1:  # a module imported at top level (the line starts with "import time: ... | name")
                total += us_cum / 1000 / runs
    rows = [(name, selfs[name], cums[name]) for name in selfs]
    top_level = {name for name, d in depth.items() if d == 1}
    return [r for r in rows if r[0] in top_level] + [("__self__:" + r[0], r[1], r[2]) for r in rows], total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15, help="timed runs of each command (default 15, at least 10 "
                                                             "for the README figures)")
    parser.add_argument("--importtime-runs", type=int, default=5, help="runs of -X importtime averaged (default 5)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds allowed per command (default 60)")
    parser.add_argument("--tmpdir", type=Path, default=None, help="where the shadow's root and spools go")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    install_signal_handlers()
    print(header("startup"), flush=True)

    found, _ = tools()
    script, shim = real_script(found[0]) if len(found) == 1 else (found[0], None)
    gcwrap = [script] if len(found) == 1 else found
    python = interpreter_of(script) if len(found) == 1 else sys.executable
    print(f"gcwrap: {' '.join(gcwrap)}" + (f" (PATH has the pyenv shim {shim}; timed separately)" if shim else ""))
    print(f"python: {python}", flush=True)

    commands: dict[str, list[str]] = {
        "gcwrap -- true": [*gcwrap, "--", "true"],
        f'python -c "{IMPORT_DEPS}"': [python, "-c", IMPORT_DEPS],
        f'python -c "{IMPORT_TRIO}"': [python, "-c", IMPORT_TRIO],
        "python -c pass": [python, "-c", "pass"],
    }
    if shim:
        commands["gcwrap -- true (via the pyenv shim)"] = [shim, "--", "true"]
    shadow_key = "gcwrap --shadow ... --stdout x -- true (live shadow)"
    stamp_key = "gcwrap --shadow ... --stdout x -- sh -c 'date > STAMP' (live shadow)"
    bare_stamp_key = "sh -c 'date > STAMP' (the job alone)"

    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-startup-", dir=args.tmpdir))
    walls: dict[str, list[float]] = defaultdict(list)
    cpus: dict[str, list[float]] = defaultdict(list)
    job_starts: dict[str, list[float]] = defaultdict(list)  # spawn -> the job's start (s)
    shadow: ShadowProc | None = None

    def stop_shadow() -> None:
        if shadow is not None:
            shadow.stop()

    with guarded("startup", workdir, cleanup=stop_shadow) as outcome:
        shadow = ShadowProc(workdir / "home", workdir)
        port = shadow.wait_ready()
        spool = workdir / "spool"
        print(f"gcshadow: {' '.join(shadow.cmd)}", flush=True)
        pyz = workdir / "gcwrap.pyz"
        os.environ["XDG_CACHE_HOME"] = str(workdir / "cache")  # the bundle unpacks there (at the warm-up run)
        built = subprocess.run([*gcwrap, "bundle", "-o", str(pyz)], capture_output=True, text=True,
                               timeout=args.timeout, check=False)
        if built.returncode != 0:
            raise BenchError(f"gcwrap bundle failed: {built.stderr.strip()}")
        print(f"bundle: {built.stdout.strip()}", flush=True)
        commands[BUNDLE_KEY] = [python, str(pyz), "--", "true"]
        keys = [*commands, shadow_key, stamp_key, bare_stamp_key]
        stamp = workdir / "job-started"
        stamped = {stamp_key, bare_stamp_key}

        def command(key: str, i: int) -> list[str]:
            job = ["sh", "-c", STAMP_JOB.format(stamp)] if key in stamped else ["true"]
            if key == bare_stamp_key:
                return job
            if key in (shadow_key, stamp_key):
                name = f"startup-{i}.out" if key == shadow_key else f"stamp-{i}.out"
                return [*gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", name, "--spool", str(spool),
                        "--job-id", f"startup-{os.getpid()}-{i}", "--", *job]
            return commands[key]

        def run(key: str, i: int) -> tuple[float, float]:
            if key in stamped:
                return timed(command(key, i), args.timeout, stamp, job_starts[key] if i else [])
            return timed(command(key, i), args.timeout)

        print("example with a live shadow:", " ".join(command(shadow_key, 0)))
        for key in keys:  # one warm-up run of each (page cache, .pyc), not counted
            run(key, 0)
        for i in range(1, args.runs + 1):
            order = keys[i % len(keys):] + keys[:i % len(keys)]
            for key in order:
                wall, cpu = run(key, i)
                walls[key].append(wall)
                cpus[key].append(cpu)
            print(f"round {i:2}: " + "  ".join(f"{walls[k][-1] * 1000:6.0f} ms" for k in keys), flush=True)
        leftover = sorted(p.name for p in spool.glob("*")) if spool.exists() else []
        if leftover:
            print(f"note: spool directory not empty after the runs: {leftover}")
        for prefix in ("startup", "stamp"):
            landed = sorted(p.name for p in (workdir / "home").glob(f"{prefix}-*.out"))
            if len(landed) != args.runs + 1:
                raise BenchError(f"expected {args.runs + 1} landed files {prefix}-*.out, found {len(landed)}")

        base = summary(walls[f'python -c "{IMPORT_DEPS}"'])[0]
        trio_base = summary(walls[f'python -c "{IMPORT_TRIO}"'])[0]
        bare = summary(walls["python -c pass"])[0]
        rows = [["command", "wall median (ms)", "min", "max", "CPU median (ms)", "/ 4 imports", "/ import trio",
                 "/ python -c pass"]]
        for key in keys:
            med, lo, hi = summary(walls[key])
            cmed = summary(cpus[key])[0]
            rows.append([key, fmt(med * 1000), fmt(lo * 1000), fmt(hi * 1000), fmt(cmed * 1000),
                         f"{med / base:.2f}x", f"{med / trio_base:.2f}x", f"{med / bare:.1f}x"])
        print()
        print(f"{args.runs} runs of each, order rotated each round; load average at the end: "
              "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        print(render_table(rows))
        mine = summary(walls["gcwrap -- true"])[0]
        print(f"\ngcwrap -- true / import trio, click, rich, sqlite_utils: {mine / base:.2f}x "
              f"(the target, <= 1.30x: {'met' if mine / base <= 1.3 else 'NOT met'}). gcwrap no longer imports rich "
              "or sqlite_utils at start-up, so this baseline flatters it:")
        print(f"gcwrap -- true / import trio (what it does import, with click): {mine / trio_base:.2f}x, "
              f"{(mine - trio_base) * 1000:+.0f} ms")
        pyz_med = summary(walls[BUNDLE_KEY])[0]
        print(f"python gcwrap.pyz -- true / gcwrap -- true: {pyz_med / mine:.2f}x, {(pyz_med - mine) * 1000:+.0f} ms "
              f"(the target, <= 1.10x: {'met' if pyz_med / mine <= 1.1 else 'NOT met'})")
        med, lo, hi = summary(job_starts[stamp_key])
        alone = summary(job_starts[bare_stamp_key])[0]
        print(f"\nspawn -> the job's start, with a live shadow (the job waits this long for gcwrap): median "
              f"{med * 1000:.0f} ms ({lo * 1000:.0f}-{hi * 1000:.0f}); the same job spawned alone: "
              f"{alone * 1000:.1f} ms")

        if args.importtime_runs > 0:
            env = dict(os.environ)
            rows_it, total = importtime(python, args.importtime_runs, args.timeout, env)
            top = sorted((r for r in rows_it if not r[0].startswith("__self__:")), key=lambda r: -r[2])[:12]
            selfs = sorted((r for r in rows_it if r[0].startswith("__self__:")), key=lambda r: -r[1])[:15]
            print(f"\n`{python} -X importtime -m gcwrap -- true`, mean of {args.importtime_runs} runs: "
                  f"{total:.0f} ms of imports in all")
            print("top-level imports by cumulative time:")
            print(render_table([["module", "cumulative (ms)", "share"]]
                               + [[n, f"{c:.1f}", f"{c / total:.0%}"] for n, _, c in top]))
            print("\nmodules by self time (their own code, without what they import):")
            print(render_table([["module", "self (ms)", "cumulative (ms)"]]
                               + [[n.removeprefix("__self__:"), f"{s:.1f}", f"{c:.1f}"] for n, s, c in selfs]))
            heavy = []
            for n in ("numpy", "pandas", "sqlite_utils", "rich", "trio", "click", "pluggy", "dateutil"):
                mods = [r for r in rows_it if r[0] == "__self__:" + n or r[0].startswith(f"__self__:{n}.")]
                if mods:
                    heavy.append(f"{n} ({len(mods)} modules, {sum(r[1] for r in mods):.0f} ms self)")
            print("\nheavy packages imported by `gcwrap -- true`: " + (", ".join(heavy) or "none"))
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
