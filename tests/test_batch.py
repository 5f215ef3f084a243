"""Batch systems: job identity from the environment, name templates, the
spool's default directory, and attempts of a requeued job.

The identity and template tests are unit tests (an HTCondor job ad is a real
file in tmp_path); the attempt tests run the installed gcwrap and gcshadow and
compare sha256 of what each attempt wrote with what landed at home. The real
Slurm cluster is in test_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from helpers import (
    ShadowProc,
    Wrapper,
    _children,
    expected,
    file_size,
    genjob,
    sha256_file,
    spool_status,
    tool,
    wait_until,
)

from gcwrap.agent import identity, templates
from gcwrap.agent.identity import BatchIdentity, detect
from gcwrap.agent.spool import default_spool_dir
from gcwrap.agent.templates import TemplateError, expand, values_for
from gcwrap.cli import main as gcwrap_main
from gcwrap.wire.names import normalize

UID = os.getuid()

# An HTCondor job ad as the starter writes it to .job.ad in the job's scratch directory (abridged).
CONDOR_AD = """\
AccountingGroup = "group_physics.alice"
Args = "--shadow home.example.org:50000 --stdout ana/%j.%a.out -- python3 analyze.py"
ClusterId = 1234
Cmd = "/usr/local/bin/gcwrap"
CurrentHosts = 1
Environment = ""
GlobalJobId = "submit.example.org#1234.5#1700000000"
Iwd = "/home/alice/ana"
JobPrio = 0
JobStatus = 2
JobUniverse = 5
MyType = "Job"
NumJobStarts = 2
NumShadowStarts = 3
Owner = "alice"
ProcId = 5
QDate = 1700000000
Requirements = (TARGET.Arch == "X86_64") && (TARGET.OpSys == "LINUX")
TransferExecutable = false
"""


# -- identity ------------------------------------------------------------------------------------


def test_slurm_job() -> None:
    ident = detect({"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "sim"})
    assert ident == BatchIdentity("slurm", "4242", None, 0, "slurm-4242")


def test_slurm_array_task_is_named_after_its_array() -> None:
    # SLURM_JOB_ID is the task's own id; the array's id and the task index name it.
    ident = detect({"SLURM_JOB_ID": "4250", "SLURM_ARRAY_JOB_ID": "4242", "SLURM_ARRAY_TASK_ID": "7"})
    assert ident == BatchIdentity("slurm", "4242", "7", 0, "slurm-4242_7")


@pytest.mark.parametrize(("count", "attempt"), [("0", 0), ("1", 1), ("12", 12), ("", 0), ("x", 0), (" 3 ", 3)])
def test_slurm_restart_count_is_the_attempt(count: str, attempt: int) -> None:
    assert detect({"SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": count}).attempt == attempt


def test_condor_job_ad_file(tmp_path: Path) -> None:
    ad = tmp_path / ".job.ad"
    ad.write_text(CONDOR_AD)
    ident = detect({"_CONDOR_JOB_AD": str(ad), "_CONDOR_SCRATCH_DIR": str(tmp_path)})
    # NumJobStarts counts the starts before this one: the shadow counts a start once the job runs.
    assert ident == BatchIdentity("condor", "1234", "5", 2, "condor-1234.5")


def test_condor_ad_names_are_case_insensitive_and_procid_defaults_to_0(tmp_path: Path) -> None:
    ad = tmp_path / ".job.ad"
    ad.write_text('CLUSTERID = 77\nowner = "bob"\n')
    assert detect({"_CONDOR_JOB_AD": str(ad)}) == BatchIdentity("condor", "77", "0", 0, "condor-77.0")


@pytest.mark.parametrize("content", [None, "", 'Owner = "alice"\n', 'ClusterId = "x"\n'])
def test_condor_without_a_usable_ad_falls_back(tmp_path: Path, content: str | None) -> None:
    ad = tmp_path / ".job.ad"
    if content is not None:
        ad.write_text(content)
    ident = detect({"_CONDOR_JOB_AD": str(ad), "PBS_JOBID": "55.pbs"})
    assert ident.system == "pbs" and ident.job_id == "pbs-55.pbs"


def test_pbs_job() -> None:
    assert detect({"PBS_JOBID": "1234.pbs01.example.org"}) == BatchIdentity(
        "pbs", "1234", None, 0, "pbs-1234.pbs01.example.org")


@pytest.mark.parametrize(
    ("env", "job_id"),
    [
        ({"PBS_JOBID": "1234[5].pbs01", "PBS_ARRAYID": "5"}, "pbs-1234[5].pbs01"),  # Torque
        ({"PBS_JOBID": "1234[5].pbs01", "PBS_ARRAY_INDEX": "5"}, "pbs-1234[5].pbs01"),  # PBS Pro
        ({"PBS_JOBID": "1234.pbs01", "PBS_ARRAYID": "5"}, "pbs-1234.pbs01-5"),  # an id without the index
    ],
)
def test_pbs_array_task(env: dict[str, str], job_id: str) -> None:
    assert detect(env) == BatchIdentity("pbs", "1234", "5", 0, job_id)


def test_no_batch_system_gives_host_pid_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity.socket, "gethostname", lambda: "node7.example.org")
    ident = detect({})
    assert re.fullmatch(rf"node7\.example\.org-{os.getpid()}-\d{{10}}", ident.job_id), ident.job_id
    assert ident == BatchIdentity("", ident.job_id, None, 0, ident.job_id)


def test_slurm_wins_over_condor_wins_over_pbs(tmp_path: Path) -> None:
    ad = tmp_path / ".job.ad"
    ad.write_text(CONDOR_AD)
    everything = {"SLURM_JOB_ID": "1", "_CONDOR_JOB_AD": str(ad), "PBS_JOBID": "3.pbs"}
    assert detect(everything).system == "slurm"
    assert detect({k: v for k, v in everything.items() if k != "SLURM_JOB_ID"}).system == "condor"
    assert (detect({"PBS_JOBID": "3.pbs"}).system, detect({"PBS_JOBID": "3.pbs"}).job_id) == ("pbs", "pbs-3.pbs")
    assert identity.default_job_id({"SLURM_JOB_ID": "8"}) == "slurm-8"


# -- templates ------------------------------------------------------------------------------------------

VALUES = {"j": "4242", "a": "7", "h": "node7", "u": "alice", "n": "2"}


def test_every_key_expands() -> None:
    assert expand("out/%j.%a.%h.%u.%n.out", VALUES) == "out/4242.7.node7.alice.2.out"
    assert expand("%j%a%h%u%n", VALUES) == "42427node7alice2"


@pytest.mark.parametrize(
    ("template", "name"),
    [("100%%/%j%%", "100%/4242%"), ("%%j", "%j"), ("%%%j", "%4242"), ("a%%%%b", "a%%b"),
     ("plain/name.5", "plain/name.5"), ("", "")],
)
def test_percent_percent_is_a_literal_percent(template: str, name: str) -> None:
    assert expand(template, VALUES) == name


@pytest.mark.parametrize(("template", "key"), [("out/%q.out", "%q"), ("%J", "%J"), ("%a%x", "%x"), ("%-", "%-"),
                                                ("%/x", "%/")])
def test_unknown_key_is_an_error_that_names_it(template: str, key: str) -> None:
    with pytest.raises(TemplateError) as e:
        templates.check(template)
    assert f"unknown key {key} " in str(e.value) and "%j %a %h %u %n %%" in str(e.value)


@pytest.mark.parametrize("template", ["out/x%", "%", "%%%", "%j%"])
def test_trailing_lone_percent_is_an_error(template: str) -> None:
    with pytest.raises(TemplateError, match="ends with a lone '%'"):
        expand(template, VALUES)


def test_values_for_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity.socket, "gethostname", lambda: "node7.cluster.example.org")
    monkeypatch.setattr(identity.getpass, "getuser", lambda: "alice")
    array = BatchIdentity("slurm", "4242", "7", 1, "slurm-4242_7")
    assert values_for(array) == {"j": "4242", "a": "7", "h": "node7", "u": "alice", "n": "1"}
    single = BatchIdentity("pbs", "99", None, 0, "pbs-99.server")
    assert values_for(single) == {"j": "99", "a": "0", "h": "node7", "u": "alice", "n": "0"}
    assert values_for(single, "my-run")["j"] == "my-run", "--job-id wins for %j"


def invoke(args: list[str], env: dict[str, str] | None = None) -> click.testing.Result:
    return CliRunner().invoke(gcwrap_main, args, env=env, prog_name="gcwrap")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--stdout", "out/%q.out"], {}, "unknown key %q"),
        (["--stderr", "err/%j.%"], {}, "ends with a lone '%'"),
        (["--stdin", "in/%Z"], {}, "unknown key %Z"),
        ([], {"GRID_CONSOLE_STDOUT": "seed/%y.out"}, "unknown key %y"),
        ([], {"GCWRAP_STDERR": "x%"}, "ends with a lone '%'"),
    ],
)
def test_bad_template_is_a_usage_error_and_the_job_does_not_start(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    marker = tmp_path / "ran"
    result = invoke(["run", "--shadow", "127.0.0.1:9", *args, "--", "touch", str(marker)], env)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Invalid value for --std" in result.output
    assert not marker.exists()


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--job-id", "..", "--stdout", "%j/x"], {}, "'%j/x' expands to '../x'"),
        (["--job-id", "/etc/passwd", "--stdout", "%j"], {}, "is an absolute path"),
        (["--job-id", ".gcshadow", "--stdout", "%j/state.db"], {}, "inside the shadow's own state directory"),
        (["--stdout", "%j/x"], {"SLURM_JOB_ID": "../.."}, "contains '..'"),
        (["--stdout", "a/%a/../../../x"], {"SLURM_ARRAY_JOB_ID": "1", "SLURM_ARRAY_TASK_ID": ".."}, "contains '..'"),
    ],
)
def test_expanded_names_that_escape_the_root_are_refused(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    marker = tmp_path / "ran"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "_CONDOR_"))}
    result = invoke(["run", "--shadow", "127.0.0.1:9", *args, "--", "touch", str(marker)], {**clean, **env})
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert not marker.exists()


# -- the spool's default directory -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "base"),
    [
        ({"_CONDOR_SCRATCH_DIR": "/scratch/condor", "SLURM_TMPDIR": "/scratch/slurm", "TMPDIR": "/tmp/t"},
         "/scratch/condor"),
        ({"SLURM_TMPDIR": "/scratch/slurm", "TMPDIR": "/tmp/t"}, "/scratch/slurm"),
        ({"TMPDIR": "/tmp/t"}, "/tmp/t"),
        ({"_CONDOR_SCRATCH_DIR": "", "SLURM_TMPDIR": "", "TMPDIR": ""}, "/tmp"),
        ({}, "/tmp"),
    ],
)
def test_spool_default_is_the_batch_scratch_directory(env: dict[str, str], base: str) -> None:
    assert default_spool_dir(env) == Path(base) / f"gcwrap-{UID}"


def test_spool_default_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("_CONDOR_SCRATCH_DIR", raising=False)
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path))
    assert default_spool_dir() == tmp_path / f"gcwrap-{UID}"


# -- end to end: templated names, and attempts of one job id -------------------------------------------------


def batch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_", "_CONDOR_", "GCWRAP_",
                                                                      "GRID_CONSOLE_"))}
    return {**env, **extra}


def shadow_jobs(home: Path) -> dict[str, dict[str, object]]:
    done = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                          timeout=60, check=True)
    return {j["job_id"]: j for j in json.loads(done.stdout)}


@pytest.mark.timeout(60)
def test_templated_names_land_at_home_in_a_slurm_array_task(
    shadow: ShadowProc, home: Path, tmp_path: Path
) -> None:
    scratch = tmp_path / "scratch"
    env = batch_env(SLURM_JOB_ID="4250", SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_ID="7", SLURM_RESTART_COUNT="1",
                    SLURM_TMPDIR=str(scratch), GRID_CONSOLE_STDERR="arr/%j.%a.err")
    w = Wrapper(["--shadow", shadow.address, "--stdout", "arr/%j.%a.%n.out", "--", *genjob(300_000, 20_000, seed=5)],
                env=env)
    assert w.wait(50) == 0, w.err.decode()
    assert sorted(p.name for p in (home / "arr").iterdir()) == ["4242.7.1.out", "4242.7.err"]
    assert sha256_file(home / "arr/4242.7.1.out") == expected(300_000, 5)
    assert sha256_file(home / "arr/4242.7.err") == expected(20_000, 6)
    assert shadow_jobs(home)["slurm-4242_7"]["state"] == "finished"
    assert b"job slurm-4242_7 ended with status 0" in w.err
    assert (scratch / f"gcwrap-{UID}").is_dir(), "the spool went to $SLURM_TMPDIR"


def kill9_with_job(w: Wrapper) -> None:
    """kill -9 gcwrap and its job (a node that dies with both)."""
    jobs = _children(w.proc.pid)
    w.kill9()
    for pid in jobs:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(120)
def test_new_attempt_replaces_the_old_one_and_the_old_spool_is_refused(
    shadow: ShadowProc, home: Path, tmp_path: Path
) -> None:
    spool_a, spool_b = tmp_path / "spool-a", tmp_path / "spool-b"  # two nodes
    args = ["--shadow", shadow.address, "--job-id", "slurm-77", "--retry-timeout", "1",
            "--stdout", "rq/77.out", "--stderr", "rq/77.err"]
    a = Wrapper([*args, "--spool", str(spool_a), "--", *genjob(2_000_000, 50_000, seed=10, rate=200_000)])
    wait_until(lambda: file_size(home / "rq/77.out") > 0 and file_size(home / "rq/77.err") > 0, 30,
               "attempt 1's bytes at home")
    kill9_with_job(a)  # the node dies; its spool stays behind
    (left,) = spool_a.glob("*.spool")

    b = Wrapper([*args, "--spool", str(spool_b), "--", *genjob(300_000, 30_000, seed=20)])
    assert b.wait(60) == 0, b.err.decode()
    out_sum, err_sum = expected(300_000, 20), expected(30_000, 21)
    assert sha256_file(home / "rq/77.out") == out_sum, "the new attempt starts the file afresh"
    assert sha256_file(home / "rq/77.err") == err_sum

    # The old attempt's leftover spool cannot reach the files any more.
    resumed = subprocess.run([*tool("gcwrap"), "resume", "--retry-timeout", "1", str(left)], capture_output=True,
                             check=False, timeout=60)
    assert resumed.returncode == 123, resumed.stderr.decode()
    assert b"newer attempt" in resumed.stderr and b"STALE_ATTEMPT" in resumed.stderr, resumed.stderr.decode()
    assert sha256_file(home / "rq/77.out") == out_sum and sha256_file(home / "rq/77.err") == err_sum
    rec = shadow_jobs(home)["slurm-77"]
    assert rec["state"] == "finished" and rec["exit_code"] == 0


@pytest.mark.timeout(120)
def test_concurrent_attempts_never_share_a_file(shadow: ShadowProc, home: Path, tmp_path: Path) -> None:
    """A requeued job starts while its old attempt still streams (a node that lost its network and came back):
    the new attempt fences the old one off, the old one is refused, the file holds the new attempt alone."""
    args = ["--shadow", shadow.address, "--job-id", "condor-5.0", "--retry-timeout", "1", "--stdout", "cc.out"]
    a = Wrapper([*args, "--spool", str(tmp_path / "spool-a"), "--",
                 *genjob(1_500_000, 0, seed=30, rate=300_000)])
    wait_until(lambda: file_size(home / "cc.out") > 0, 30, "the old attempt's bytes at home")
    b = Wrapper([*args, "--spool", str(tmp_path / "spool-b"), "--", *genjob(1_000_000, 0, seed=40, rate=500_000)])
    assert a.wait(60) == 123, a.err.decode()
    assert b"newer attempt" in a.err
    assert b.wait(60) == 0, b.err.decode()
    assert sha256_file(home / "cc.out") == expected(1_000_000, 40), "only the new attempt's bytes"


@pytest.mark.timeout(90)
def test_batch_system_sigterm_after_the_job_died_still_delivers(home: Path, shadow_down: ShadowProc,
                                                                tmp_path: Path) -> None:
    """scancel/condor_rm/qdel signal every process of the job at once. Here the job dies of SIGTERM first
    (with its output still spooled: the shadow is down), then gcwrap gets its own, first, SIGTERM."""
    sh, port = shadow_down, shadow_down.port
    spool = tmp_path / "spool"
    w = Wrapper(["--shadow", f"127.0.0.1:{port}", "--spool", str(spool), "--job-id", "slurm-88", "--retry-timeout",
                 "1", "--retry-limit", "0", "--stdout", "sig.out", "--", *genjob(500_000, 0, seed=50,
                                                                                    signal=signal.SIGTERM)])
    wait_until(lambda: any("signal 15" in str(s["state"]) for s in spool_status(spool)), 30, "the job to die")
    os.kill(w.proc.pid, signal.SIGTERM)
    try:
        sh.start(port)
        rc = w.wait(60)
    finally:
        sh.stop()
    assert rc == 128 + signal.SIGTERM, w.err.decode()
    assert sha256_file(home / "sig.out") == expected(500_000, 50)
    rec = shadow_jobs(home)["slurm-88"]
    assert rec["state"] == "finished" and rec["exit_signal"] == signal.SIGTERM


# -- the examples ------------------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["slurm-job.sh", "slurm-array.sh", "htcondor.sub", "pbs-job.sh"])
def test_examples_are_shown_in_the_documentation_and_their_names_are_valid(name: str) -> None:
    text = (EXAMPLES / name).read_text()
    page = (EXAMPLES.parent / "docs" / "howto" / "batch-systems.md").read_text()
    shown = f"```{'text' if name.endswith('.sub') else 'sh'}\n{text}```"
    assert shown in page, f"docs/howto/batch-systems.md shows examples/{name} as it is"
    names = re.findall(r"--std(?:out|err|in) '?([^'\s\"]+)", text)
    assert len(names) == 2, names
    for template in names:
        assert normalize(expand(template, VALUES)) == expand(template, VALUES)
    assert "%j" in names[0] and "gcwrap" in text
    if name.endswith(".sh"):
        done = subprocess.run(["bash", "-n", str(EXAMPLES / name)], capture_output=True, text=True,
                              timeout=30, check=False)
        assert done.returncode == 0, done.stderr
