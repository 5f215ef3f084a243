"""SIGTERM, SIGINT and SIGHUP: a batch system's walltime, `timeout`, Ctrl-C.

gcwrap forwards each to the job while it runs, and obeys them itself within
a bounded grace counted from the first one: it goes on delivering for at
most SIGNAL_GRACE seconds (a job that takes longer to end gets LAST_TRY
seconds after its end), then exits 122, saying how many bytes of each stream
wait in which spool and that `gcwrap resume` delivers them. A second signal
means stop at once. (The preemption case, where home is up and everything
goes home within the grace, is tests/test_chaos.py's
test_preemption_sigterm_forwarded_and_output_pushed_home.)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from helpers import Wrapper, spool_status, tool, wait_until

import gcwrap
from gcwrap.agent.policy import LAST_TRY, SIGNAL_GRACE, StopClock

MARGIN = 3.0  # seconds for gcwrap's own start-up and exit, on a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def home_down(spool_dir: Path, job_id: str, *args: str) -> list[str]:
    """gcwrap pointed at a port nobody listens on, retrying forever and slowly
    (the first signal must cut the wait, not the retry limit)."""
    return ["--shadow", f"127.0.0.1:{free_port()}", "--spool", str(spool_dir), "--job-id", job_id,
            "--retry-limit", "0", "--retry-timeout", "60", *args]


def job_ended(spool_dir: Path) -> bool:
    spools = spool_status(spool_dir)
    return bool(spools) and str(spools[0]["state"]).startswith("exited")


def check_message(err: bytes, spool_dir: Path, left: str, name: str) -> None:
    text = err.decode()
    (spool,) = spool_dir.glob("*.spool")
    assert f"{name} received" in text, text
    assert f"not yet home: {left}" in text, text
    assert f"undelivered output is kept in {spool}" in text, text
    assert f"gcwrap resume --spool {spool_dir}" in text, text


@pytest.mark.timeout(60)
# (SIGINT takes SIGTERM's path here: --run-slow.)
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGHUP],
                         ids=lambda s: s.name)
def test_first_signal_after_the_job_ended_is_obeyed(spool_dir: Path, sig: signal.Signals) -> None:
    """The job has ended, home is down: the first signal ends gcwrap within
    the grace. Before: it was ignored, and gcwrap retried on forever."""
    w = Wrapper([*home_down(spool_dir, f"sig-{sig.name}"), "--stdout", "s.out", "--stderr", "s.err", "--",
                 "sh", "-c", "echo hello; echo oops >&2"])
    wait_until(lambda: job_ended(spool_dir), 30, "the job's end in the spool")
    started = time.monotonic()
    os.kill(w.proc.pid, sig)
    rc = w.wait(SIGNAL_GRACE + 4 * MARGIN)
    took = time.monotonic() - started
    assert rc == 122, w.err.decode()
    assert took < SIGNAL_GRACE + MARGIN, took
    check_message(w.err, spool_dir, "6 bytes of stdout (s.out), 5 bytes of stderr (s.err)", sig.name)
    assert b"the job itself exited with status 0" in w.err
    (st,) = spool_status(spool_dir)
    assert {s["kind"]: s["pending"] for s in st["streams"]} == {"stdout": 6, "stderr": 5}  # type: ignore[index]


@pytest.mark.timeout(60)
def test_timeout_command_ends_gcwrap_within_the_grace(spool_dir: Path) -> None:
    """`timeout 2 gcwrap ...` with home down: the issue's case (it ran 630 s)."""
    if shutil.which("timeout") is None:
        pytest.skip("needs timeout(1) (coreutils)")
    started = time.monotonic()
    res = subprocess.run(["timeout", "--preserve-status", "2", *tool("gcwrap"),
                          *home_down(spool_dir, "walltime"), "--stdout", "t.out", "--", "echo", "computed"],
                         capture_output=True, timeout=2 + SIGNAL_GRACE + 4 * MARGIN, check=False)
    took = time.monotonic() - started
    assert res.returncode == 122, res.stderr.decode()
    assert took < 2 + SIGNAL_GRACE + MARGIN, took
    check_message(res.stderr, spool_dir, "9 bytes of stdout (t.out)", "SIGTERM")


@pytest.mark.timeout(60)
def test_second_signal_stops_at_once(spool_dir: Path) -> None:
    w = Wrapper([*home_down(spool_dir, "twice"), "--stdout", "t.out", "--", "echo", "hi"])
    wait_until(lambda: job_ended(spool_dir), 30, "the job's end in the spool")
    os.kill(w.proc.pid, signal.SIGINT)
    time.sleep(0.3)  # (the first is being obeyed: the grace runs)
    started = time.monotonic()
    os.kill(w.proc.pid, signal.SIGINT)
    rc = w.wait(SIGNAL_GRACE + 4 * MARGIN)
    assert rc == 122, w.err.decode()
    assert time.monotonic() - started < MARGIN, "no more grace after the second signal"
    check_message(w.err, spool_dir, "3 bytes of stdout (t.out)", "SIGINT")


@pytest.mark.timeout(60)
def test_signal_while_the_job_runs_with_home_down(spool_dir: Path, tmp_path: Path) -> None:
    """SIGTERM before the job ended: forwarded; the job ends (its trap writes
    a last line); the grace, counted from the signal, ends gcwrap."""
    started_file = tmp_path / "started"
    w = Wrapper([*home_down(spool_dir, "running"), "--stdout", "r.out", "--", "sh", "-c",
                 f"trap 'echo bye; exit 3' TERM; echo hi; touch {started_file}; while :; do sleep 0.1; done"])
    wait_until(started_file.exists, 30, "the job to start")
    started = time.monotonic()
    os.kill(w.proc.pid, signal.SIGTERM)
    rc = w.wait(SIGNAL_GRACE + 4 * MARGIN)
    took = time.monotonic() - started
    assert rc == 122, w.err.decode()
    assert took < SIGNAL_GRACE + MARGIN, took
    check_message(w.err, spool_dir, "7 bytes of stdout (r.out)", "SIGTERM")
    assert b"the job itself exited with status 3" in w.err, "the job got the signal, and ended by its own trap"


@pytest.mark.timeout(60)
def test_a_job_that_outlives_the_grace_gets_one_last_try(spool_dir: Path, tmp_path: Path) -> None:
    """The job takes longer than the grace to end after SIGTERM: gcwrap waits
    for it (it is the job's to end), then makes its last try, and exits."""
    slow_end = SIGNAL_GRACE + 1.5
    started_file = tmp_path / "started"
    script = f"trap 'sleep {slow_end}; echo late; exit 0' TERM; touch {started_file}; while :; do sleep 0.1; done"
    w = Wrapper([*home_down(spool_dir, "slow-end"), "--stdout", "l.out", "--", "sh", "-c", script])
    wait_until(started_file.exists, 30, "the job to start")
    started = time.monotonic()
    os.kill(w.proc.pid, signal.SIGTERM)
    rc = w.wait(slow_end + LAST_TRY + 4 * MARGIN)
    took = time.monotonic() - started
    assert rc == 122, w.err.decode()
    assert slow_end <= took < slow_end + LAST_TRY + MARGIN, took
    check_message(w.err, spool_dir, "5 bytes of stdout (l.out)", "SIGTERM")


def test_stop_clock() -> None:
    """The rule itself, with the time passed in."""
    clock = StopClock(grace=5.0, last_try=1.0)
    assert clock.deadline == float("inf")
    clock.job_ended(10.0)  # no signal: no deadline
    assert clock.deadline == float("inf")
    clock.signal(20.0, "SIGTERM")
    assert clock.deadline == 25.0 and clock.name == "SIGTERM"

    clock = StopClock(grace=5.0, last_try=1.0)
    clock.signal(20.0, "SIGTERM")  # while the job runs
    clock.job_ended(22.0)
    assert clock.deadline == 25.0  # the grace counts from the signal
    clock = StopClock(grace=5.0, last_try=1.0)
    clock.signal(20.0, "SIGTERM")
    clock.job_ended(30.0)  # the job outlived the grace
    assert clock.deadline == 31.0  # one short last try
    clock.signal(30.5, "SIGINT")
    assert clock.deadline == 30.5 and clock.name == "SIGTERM"  # the second: now

    clock = StopClock(grace=5.0, last_try=1.0)
    clock.signal(20.0, "SIGHUP")
    clock.signal(21.0, "SIGHUP")
    clock.job_ended(40.0)
    assert clock.deadline == 21.0  # after a second signal, no last try


@pytest.mark.timeout(90)
# (SIGINT takes SIGTERM's path here: --run-slow.)
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGHUP],
                         ids=lambda s: s.name)
def test_resume_obeys_a_signal_within_the_grace(spool_dir: Path, sig: signal.Signals) -> None:
    """`gcwrap resume` at a walltime, home still down: it ends within the
    grace, exits 122 naming what is left and the spool, and a later resume
    delivers it. Before: SIGTERM and SIGHUP killed it without a word (no
    exit status of its own), SIGINT printed "Aborted!" and exited 1."""
    args = home_down(spool_dir, f"resume-{sig.name}")
    w = Wrapper([*args, "--stdout", "s.out", "--stderr", "s.err", "--", "sh", "-c", "echo hello; echo oops >&2"])
    wait_until(lambda: job_ended(spool_dir), 30, "the job's end in the spool")
    os.kill(w.proc.pid, signal.SIGKILL)  # (its spool is left behind, as a killed wrapper's would be)
    w.wait(10)
    resume = subprocess.Popen([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--retry-limit", "0",
                               "--retry-timeout", "60", "--shadow", args[1]], stderr=subprocess.PIPE)
    wait_until(lambda: bool(spool_status(spool_dir)[0]["active"]), 30, "the resume to hold the spool")
    time.sleep(0.5)  # (its first attempt has failed: it waits to retry)
    started = time.monotonic()
    resume.send_signal(sig)
    try:
        _, err = resume.communicate(timeout=SIGNAL_GRACE + 4 * MARGIN)
    finally:
        resume.kill()
    took = time.monotonic() - started
    assert resume.returncode == 122, err.decode()
    assert took < SIGNAL_GRACE + MARGIN, took
    (spool,) = spool_dir.glob("*.spool")
    text = err.decode()
    assert (f"{sig.name} received: delivery stopped after the {SIGNAL_GRACE:g} s grace; not yet home: 6 bytes of "
            f"stdout (s.out), 5 bytes of stderr (s.err) (spool {spool})") in text, text
    (st,) = spool_status(spool_dir)
    assert {s["kind"]: s["pending"] for s in st["streams"]} == {"stdout": 6, "stderr": 5}  # type: ignore[index]


@pytest.mark.timeout(90)
def test_resume_of_several_spools_stops_at_the_signal(spool_dir: Path) -> None:
    """The signal ends the whole resume: the next spool is not begun (it would wait out the retry limit)."""
    for name in ("first", "second"):
        args = home_down(spool_dir, name)
        w = Wrapper([*args, "--stdout", f"{name}.out", "--", "echo", name])
        wait_until(lambda: any(str(s["state"]).startswith("exited") and s["job_id"] == name  # noqa: B023
                               for s in spool_status(spool_dir)), 30, f"{name}'s end in the spool")
        os.kill(w.proc.pid, signal.SIGKILL)
        w.wait(10)
    resume = subprocess.Popen([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--retry-limit", "0",
                               "--retry-timeout", "60", "--shadow", args[1]], stderr=subprocess.PIPE)
    wait_until(lambda: any(s["active"] for s in spool_status(spool_dir)), 30, "the resume to hold a spool")
    started = time.monotonic()
    resume.send_signal(signal.SIGTERM)
    try:
        _, err = resume.communicate(timeout=SIGNAL_GRACE + 4 * MARGIN)
    finally:
        resume.kill()
    assert resume.returncode == 122, err.decode()
    assert time.monotonic() - started < SIGNAL_GRACE + MARGIN
    assert err.decode().count("SIGTERM received: delivery stopped") == 1, err.decode()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("obeys", [True, False], ids=["left-child-obeys", "left-child-ignores-it"])
def test_signal_after_the_job_ended_while_what_it_left_holds_its_output(spool_dir: Path, tmp_path: Path,
                                                                        obeys: bool) -> None:
    """The job's process has ended, but something it started in the
    background still holds its stdout (`cmd &` in a batch script). A signal
    must still end gcwrap within the grace: it reaches the job's process
    group (the background process gets it, as it would from a batch
    system), and gcwrap stops waiting for the pipe at the grace. Before:
    "delivering for at most 5 s more", then gcwrap waited for the
    background process to end (20 s here; forever for a daemon)."""
    ended = tmp_path / "ended"
    trap = "" if obeys else "trap '' TERM; "
    w = Wrapper([*home_down(spool_dir, "left-behind"), "--stdout", "lb.out", "--", "sh", "-c",
                 f"echo hi; ({trap}sleep 20; echo late) 2>/dev/null & touch {ended}; exit 0"])  # (not our stderr)
    wait_until(ended.exists, 30, "the job's process to end")
    time.sleep(0.5)
    started = time.monotonic()
    os.kill(w.proc.pid, signal.SIGTERM)
    rc = w.wait(SIGNAL_GRACE + 30)
    took = time.monotonic() - started
    assert rc == 122, w.err.decode()
    assert took < SIGNAL_GRACE + LAST_TRY + MARGIN, took
    check_message(w.err, spool_dir, "3 bytes of stdout (lb.out)", "SIGTERM")


@pytest.mark.timeout(60)
def test_a_hangup_is_ignored_under_nohup(shadow: object, home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """`nohup gcwrap ... &`, then the terminal hangs up: SIGHUP was ignored
    when gcwrap started, so it stays ignored, for gcwrap and for its job
    (which inherits that, as it would without gcwrap). Before: gcwrap
    caught it, forwarded it to the job (which nohup was meant to protect:
    it died of it, status 129) and stopped delivering after the grace."""
    started_file = tmp_path / "started"
    w = subprocess.Popen(
        [*tool("gcwrap"), "--shadow", shadow.address, "--spool", str(spool_dir),  # type: ignore[attr-defined]
         "--job-id", "nohup", "--retry-timeout", "1", "--stdout", "n.out", "--",
         "sh", "-c", f"echo hi; touch {started_file}; sleep 2; echo bye"],
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # as nohup does
    try:
        wait_until(started_file.exists, 30, "the job to start")
        os.killpg(w.pid, signal.SIGHUP)  # (the hangup reaches the whole session: gcwrap and its job)
        os.kill(w.pid, signal.SIGHUP)
        _, err = w.communicate(timeout=30)
    finally:
        w.kill()
    assert w.returncode == 0, err.decode()
    assert b"SIGHUP" not in err, err.decode()
    assert (home / "n.out").read_bytes() == b"hi\nbye\n"


# -- Ctrl-C at any moment of gcwrap's start -----------------------------------------------------

PACKAGE = Path(gcwrap.__file__).resolve().parent
# gcwrap's first instant: the modules that run before its stop signals are
# caught (the package, the console script's entry point, and what that
# imports to catch them). A signal that comes before then finds Python's
# own defaults, as any program would.
FIRST_INSTANT = {PACKAGE / "__init__.py", PACKAGE / "entry.py", PACKAGE / "agent" / "__init__.py",
                 PACKAGE / "agent" / "stopsignals.py"}
START_DELAYS = [i * 0.0103 for i in range(30)]  # 0 (at once after exec) to 300 ms


def _running(marker: str) -> list[int]:
    """The processes whose command line holds `marker` (the job's own argument)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker.encode() in args:
                pids.append(int(entry.name))
    return pids


def _reap(p: subprocess.Popen[bytes], marker: str, err_path: Path, again: bool = False) -> tuple[str, list[int]]:
    """gcwrap's stderr (written to `err_path`) once it exited (killed after
    30 s), and the jobs still running with `marker` in their command line
    (killed too). With `again`: if gcwrap still runs after 10 s and Python
    itself lost the Ctrl-C (`_lost_by_python`), a second Ctrl-C, as its user
    would give, and 30 s more."""
    try:
        try:
            p.wait(timeout=10 if again else 30)
        except subprocess.TimeoutExpired:
            if not (again and _lost_by_python(err_path.read_text(errors="replace"))):
                raise
            p.send_signal(signal.SIGINT)
            p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        left = _running(marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    return err_path.read_text(errors="replace"), left


# Python's report of a KeyboardInterrupt it raised in a weakref callback of
# its own (the import system's module locks: `_get_module_lock.<locals>.cb`)
# and then ignored: "Exception ignored in: <function ...>", its traceback, and
# the KeyboardInterrupt. CPython loses a Ctrl-C that way (python/cpython#95959)
# when it comes while the interpreter imports what runs before gcwrap's first
# instant (`site`, the console script's own imports): no trace of it is left
# for gcwrap to find, so the job starts and a second Ctrl-C is needed.
IGNORED_REPORT = re.compile(
    r"^Exception ignored in: <function [^\n]*>\nTraceback \(most recent call last\):\n"
    r"((?:  File .*\n(?:    .*\n)*)+)KeyboardInterrupt: ?\n", re.M)


def _lost_by_python(err: str) -> bool:
    """Whether `err` holds Python's report of a Ctrl-C it ignored
    (IGNORED_REPORT) in frames of its own alone: none is gcwrap's."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for report in IGNORED_REPORT.finditer(err):
        frames = re.findall(r'^  File "([^"]+)"', report.group(1), re.M)
        if frames and all(f.startswith("<frozen ") or Path(f).resolve().is_relative_to(stdlib) for f in frames):
            return True
    return False


ARGV0_REPORT = "Failed checking if argv[0] is an import path entry\n"


def _without_python_s_report(err: str) -> str:
    """`err` without what Python itself reports of a Ctrl-C that came
    before any of gcwrap's code ran (every frame of it is the interpreter's
    own): that it came while Python checked its argv[0] (gcwrap then counts
    that Ctrl-C as a SIGINT that came early), or that Python ignored it
    (`_lost_by_python`). Neither report is gcwrap's to silence."""
    if _lost_by_python(err):
        err = IGNORED_REPORT.sub("", err)
    if not err.startswith(ARGV0_REPORT):
        return err
    report, sep, rest = err.partition("\nKeyboardInterrupt\n")
    frames = re.findall(r'^  File "([^"]+)"', report, re.M)
    assert sep and frames and all(f.startswith("<frozen ") for f in frames), err
    return rest


def _before_gcwrap_ran(rc: int, err: str) -> bool:
    """Whether the outcome is Python's own, for a signal that came before
    any of gcwrap's code beyond its first instant ran: killed by SIGINT (at
    once, or after an uncaught KeyboardInterrupt), or exit 1 after Python
    reported a KeyboardInterrupt in no frame of gcwrap's. The interpreter
    reports one in many ways as it starts: a fatal error (in `site`:
    init_import_site; while it imports `io`: init_sys_streams), a bare
    "KeyboardInterrupt" (raised where no Python frame runs), or in a `.pth`
    file, which `site` reports and skips ("Remainder of file ignored"), so
    that an editable install's path is missing and the console script cannot
    import gcwrap at all; or, when it makes the console script's loader,
    MAIN_LOADER_REPORT alone. gcwrap's own code never raises one (its handlers
    catch the signals from its first instant), and never prints one."""
    if _lost_by_python(err):
        err = IGNORED_REPORT.sub("", err)  # (that one did not end gcwrap: see `_lost_by_python`)
    frames = {Path(f).resolve() for f in re.findall(r'^ *File "([^"<]+)"', err, re.M)}
    ours = {f for f in frames if f.is_relative_to(PACKAGE)} - FIRST_INSTANT
    if ours or "Aborted!" in err:
        return False
    return rc == -signal.SIGINT or (rc == 1 and ("KeyboardInterrupt" in err or err == MAIN_LOADER_REPORT))


# What Python prints, alone, when a KeyboardInterrupt comes while it makes
# the loader of the console script it is about to run (and exits 1).
MAIN_LOADER_REPORT = "python: failed to set __main__.__loader__\n"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("streams", ["stdout", "pass-through"])
def test_ctrl_c_at_any_moment_of_the_start(shadow: object, tmp_path: Path, spool_dir: Path, streams: str,
                                           request: pytest.FixtureRequest) -> None:
    """SIGINT at 30 moments of gcwrap's first 300 ms (by default, the two
    parameters take every other moment: all 30 between them), from at once after
    exec on: the job it started gets it, gcwrap exits with the job's status
    (130), with no traceback, "Fatal Python error" or "Aborted!", and no job
    is left running. Before: a traceback, a fatal error or click's
    "Aborted!", exit 1, for anything in the first ~100 ms (all of it before
    the job started). A signal that comes while the interpreter itself
    still starts, before any of gcwrap's code runs, gets Python's default
    (`_before_gcwrap_ran`): no job was started then; or Python loses it
    (`_lost_by_python`): the job starts, and a second Ctrl-C stops it."""
    named = ["--spool", str(spool_dir), "--stdout", "c.out"] if streams == "stdout" else []
    handled = 0
    moments = list(enumerate(START_DELAYS))
    if not request.config.getoption("--run-slow"):
        moments = moments[streams != "stdout" :: 2]
    for i, delay in moments:
        # (sleep's argument: this job's, and no other's, in this run and parameter)
        marker = f"{60 + i}.{os.getpid() % 1000:03d}{len(streams) % 10}"
        err_path = tmp_path / f"ctrl-c-{i}.err"
        with err_path.open("wb") as err_file:
            p = subprocess.Popen([*tool("gcwrap"), "--shadow", shadow.address, "--job-id",  # type: ignore[attr-defined]
                                  f"ctrl-c-{i}", *named, "--", "sleep", marker],
                                 stdout=subprocess.DEVNULL, stderr=err_file, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        if delay:
            time.sleep(delay)  # (the moment is what is tested: nothing to wait for)
        p.send_signal(signal.SIGINT)
        err, left = _reap(p, marker, err_path, again=True)
        assert not left, f"at {delay * 1000:.0f} ms: the job was left running; gcwrap said: {err}"
        if _before_gcwrap_ran(p.returncode, err):
            continue
        handled += 1
        for bad in ("Traceback", "Fatal Python error", "Aborted!"):
            assert bad not in _without_python_s_report(err), f"at {delay * 1000:.0f} ms: {err}"
        assert p.returncode == 128 + signal.SIGINT, f"at {delay * 1000:.0f} ms: exit {p.returncode}: {err}"
    assert handled >= len(moments) // 3, f"only {handled} signals reached gcwrap's own code"
    assert list(spool_dir.glob("*.spool")) == [], "every job's output was delivered"


def _gcwrap_after(prelude: str, address: str, job_id: str, marker: str,
                  tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """gcwrap's console entry run by a Python that first runs `prelude`
    (what Python's own start-up would have done before gcwrap's first
    instant), its job `sleep MARKER`; stderr to a file (returned)."""
    start = ("import sys\n" + prelude + "from gcwrap.entry import gcwrap\n"
             f"sys.argv = ['gcwrap', '--shadow', {address!r}, '--job-id', {job_id!r}, '--', 'sleep', {marker!r}]\n"
             "gcwrap()\n")
    err_path = tmp_path / "gcwrap.err"
    with err_path.open("wb") as err_file:
        p = subprocess.Popen([sys.executable, "-c", start], stdout=subprocess.DEVNULL, stderr=err_file,
                             stdin=subprocess.DEVNULL, start_new_session=True, cwd=tmp_path)
    return p, err_path


def test_a_ctrl_c_python_reported_before_gcwrap_ran_still_stops_the_job(shadow: object, tmp_path: Path) -> None:
    """A Ctrl-C while Python checks its argv[0] (after `site`, before the
    console script runs) is reported by Python ("Failed checking if argv[0]
    is an import path entry", a KeyboardInterrupt) and then gcwrap runs
    regardless: only `sys.last_value` remembers it. gcwrap counts it as a
    SIGINT that came early: the job gets it, gcwrap exits 130. Before: the
    Ctrl-C was lost, gcwrap ran the job to its end (a minute's sleep). The
    interpreter's report is reproduced here as Python makes it (the moment
    itself is a few microseconds wide)."""
    marker = f"59.{os.getpid() % 1000:03d}7"
    prelude = ("try:\n    raise KeyboardInterrupt\nexcept KeyboardInterrupt:\n"
               "    sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()\n")
    p, err_path = _gcwrap_after(prelude, shadow.address, "early", marker, tmp_path)  # type: ignore[attr-defined]
    err, left = _reap(p, marker, err_path)
    assert not left, f"the job was left running: {err}"
    assert p.returncode == 128 + signal.SIGINT, f"exit {p.returncode}: {err}"
    assert "Traceback" not in err, err


def test_a_ctrl_c_python_lost_before_gcwrap_ran_needs_a_second_one(shadow: object, tmp_path: Path) -> None:
    """A Ctrl-C that comes while Python imports what runs before gcwrap's
    first instant can be raised in one of the import system's weakref
    callbacks, where Python reports it ("Exception ignored in: ...",
    a KeyboardInterrupt) and drops it (python/cpython#95959), leaving no
    trace gcwrap could find: the job starts, as if no Ctrl-C had come. A
    second one stops it as any other: the job gets it, gcwrap exits 130,
    nothing is left running. Python's report is reproduced here as Python
    makes it (in the suite's start-up test it comes about once in 300, and
    `_reap` gives the second Ctrl-C there)."""
    marker = f"58.{os.getpid() % 1000:03d}7"
    prelude = ("import weakref\n"
               "code = compile('def cb(_):\\n    raise KeyboardInterrupt\\n',\n"
               "               '<frozen importlib._bootstrap>', 'exec')\n"
               "scope = {}\nexec(code, scope)\n"
               "class Lock: pass\n"
               "lock = Lock()\nref = weakref.ref(lock, scope['cb'])\ndel lock\n")
    p, err_path = _gcwrap_after(prelude, shadow.address, "lost", marker, tmp_path)  # type: ignore[attr-defined]
    wait_until(lambda: _running(marker) != [], 20, "the job to start")
    err = err_path.read_text(errors="replace")
    assert _lost_by_python(err), err
    p.send_signal(signal.SIGINT)
    err, left = _reap(p, marker, err_path)
    assert not left, f"the job was left running: {err}"
    assert p.returncode == 128 + signal.SIGINT, f"exit {p.returncode}: {err}"
    assert "Traceback" not in _without_python_s_report(err), err


def test_python_s_report_of_a_lost_ctrl_c_is_told_from_gcwrap_s_own() -> None:
    """`_lost_by_python` takes Python's report as this machine's Python
    printed it when a Ctrl-C came at 6 ms, and no report with a frame of
    gcwrap's or another exception."""
    report = ("Exception ignored in: <function _get_module_lock.<locals>.cb at 0x7f6c2e6cdf80>\n"
              "Traceback (most recent call last):\n"
              '  File "<frozen importlib._bootstrap>", line 198, in cb\n'
              "KeyboardInterrupt: \n")
    assert _lost_by_python(report)
    assert _without_python_s_report(report + "done\n") == "done\n"
    ours = report.replace("<frozen importlib._bootstrap>", str(PACKAGE / "cli.py"))
    assert not _lost_by_python(ours)
    assert not _lost_by_python(report.replace("KeyboardInterrupt", "ValueError"))
    # ... and that Python ignored the Ctrl-C does not make gcwrap's own exit 1 Python's.
    assert not _before_gcwrap_ran(1, report + "gcwrap: cannot run sleep: out of file descriptors\n")


def test_python_s_own_ends_are_told_from_gcwrap_s() -> None:
    """`_before_gcwrap_ran` takes the ways this machine's Python ended when
    a Ctrl-C came as it started (as printed), and not an end of gcwrap's."""
    streams = ("Fatal Python error: init_sys_streams: can't initialize sys standard streams\n"
               "Python runtime state: core initialized\nTraceback (most recent call last):\n"
               '  File "<frozen importlib._bootstrap>", line 1176, in _find_and_load\n'
               '  File "<frozen abc>", line 107, in __new__\nKeyboardInterrupt\n')
    pth = ("Error processing line 1 of /usr/lib/python3/site-packages/__editable__.gcwrap-0.1.0.pth:\n\n"
           "  Traceback (most recent call last):\n"
           '    File "/usr/lib/python3/functools.py", line 972, in __set_name__\n'
           "      def __set_name__(self, owner, name):\n\n  KeyboardInterrupt\n\nRemainder of file ignored\n"
           'Traceback (most recent call last):\n  File "/usr/bin/gcwrap", line 5, in <module>\n'
           "    from gcwrap.entry import gcwrap\nModuleNotFoundError: No module named 'gcwrap'\n")
    for err in (streams, pth, "KeyboardInterrupt\n", MAIN_LOADER_REPORT):
        assert _before_gcwrap_ran(1, err), err
        assert not _before_gcwrap_ran(130, err), err
    assert _before_gcwrap_ran(-signal.SIGINT, "")
    gcwrap_s = ("Traceback (most recent call last):\n"
                f'  File "{PACKAGE / "cli.py"}", line 1, in main\nKeyboardInterrupt\n')
    assert not _before_gcwrap_ran(1, gcwrap_s)
    assert not _before_gcwrap_ran(1, "Aborted!\n")
    assert not _before_gcwrap_ran(1, "gcwrap: cannot run sleep: No such file or directory\n")


def test_a_command_that_starts_no_job_gets_the_early_signals_back(tmp_path: Path) -> None:
    """The stop signals caught from the first instant are `run`'s, for its
    job: any other command gets them back as they were, and one caught
    meanwhile acts as if it came then (Ctrl-C while `gcwrap status` loads
    still interrupts it, as click's own "Aborted!", exit 1)."""
    from click.testing import CliRunner

    from gcwrap.agent.stopsignals import EarlySignals
    from gcwrap.cli import main

    before = signal.getsignal(signal.SIGINT)
    caught = EarlySignals((signal.SIGINT,))
    try:
        signal.raise_signal(signal.SIGINT)
        assert caught.pending == [signal.SIGINT]
        res = CliRunner().invoke(main, ["status", "--spool", str(tmp_path)], obj=caught)
    finally:
        caught.restore()
    assert signal.getsignal(signal.SIGINT) is before
    assert res.exit_code == 1 and "Aborted!" in res.output, res.output
