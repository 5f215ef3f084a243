"""`gcwrap bundle`: the agent as one file, run where nothing is installed.

The bundle is built from this tree by the installed `gcwrap bundle`, copied
to an empty directory, and run with `python -I` from a venv made without
pip and without --system-site-packages: nothing can be imported from
outside the file (the first test proves the venv has no trio). Against a
real gcshadow: byte-exact output and the exit status home, `status` and
`resume` from the bundle after a kill -9, twenty jobs from one bundle at
once (racing to unpack it into one cache), a cache others can write left
alone, a read-only job directory with no HOME (and the zip run as it is
where no cache can be made), the shebang, and `--compress zstd` where this
Python has no zstandard.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ShadowProc, expected, genjob, sha256_file, tool, wait_until

MB = 1 << 20


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundle built from the tree, alone in an empty directory."""
    build = tmp_path_factory.mktemp("build")
    done = subprocess.run([*tool("gcwrap"), "bundle", "-o", str(build / "gcwrap.pyz")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "gcwrap.pyz" in done.stdout and "modules" in done.stdout
    alone = tmp_path_factory.mktemp("shipped")
    shutil.copy2(build / "gcwrap.pyz", alone / "gcwrap.pyz")
    return alone / "gcwrap.pyz"


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Python with no site-packages of ours: a venv without pip, without the system's packages."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python3"
    probe = subprocess.run([str(python), "-I", "-c", "import trio"], capture_output=True, timeout=30)
    assert probe.returncode != 0, "the bare venv can import trio: the test would prove nothing"
    return python


def bare_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """An environment naming no gcwrap: PATH without our venv, the spool's scratch
    and the bundle's cache ($XDG_CACHE_HOME/gcwrap) in tmp_path."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(scratch), "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.update(extra)
    return env


def run_bundle(python: Path, bundle: Path, args: list[str], env: dict[str, str], cwd: Path,
               ) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(python), "-I", str(bundle), *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen[bytes], timeout: float = 60) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"the bundle's gcwrap did not finish in {timeout} s") from None
    return proc.returncode, err.decode(errors="replace")


def home_job(home: Path, job_id: str) -> dict[str, object]:
    done = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True,
                          text=True, timeout=60, check=True)
    (job,) = [j for j in json.loads(done.stdout) if j["job_id"] == job_id]
    return dict(job)


@pytest.fixture
def shadow_home(tmp_path: Path) -> Iterator[tuple[ShadowProc, Path]]:
    home = tmp_path / "home"
    home.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs)
    sh.start()
    try:
        yield sh, home
    finally:
        sh.stop()


@pytest.mark.timeout(120)
def test_bundle_delivers_exact_output_and_exit_status_with_nothing_installed(
        bundle: Path, bare_python: Path, shadow_home: tuple[ShadowProc, Path], tmp_path: Path) -> None:
    shadow, home = shadow_home
    assert bundle.stat().st_size <= 5 * MB
    assert bundle.read_bytes().startswith(b"#!/usr/bin/env python3\n")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    proc = run_bundle(bare_python, bundle, ["--shadow", shadow.address, "--job-id", "bundled", "--stdout", "b.out",
                                            "--stderr", "b.err", "--", *genjob(2 * MB, 300_000, seed=7, exit=3)],
                      bare_env(tmp_path), job_dir)
    status, err = finish(proc)
    assert status == 3, err
    assert sha256_file(home / "b.out") == expected(2 * MB, 7)
    assert sha256_file(home / "b.err") == expected(300_000, 8)
    job = home_job(home, "bundled")
    assert job["state"] == "finished" and job["exit_code"] == 3, job
    assert sorted(p.name for p in bundle.parent.iterdir()) == ["gcwrap.pyz"]  # nothing written beside it
    assert list(job_dir.iterdir()) == []


@pytest.mark.timeout(120)
def test_the_seeds_variables_and_the_shebang(bundle: Path, bare_python: Path, shadow_home: tuple[ShadowProc, Path],
                                            tmp_path: Path) -> None:
    shadow, home = shadow_home
    env = bare_env(tmp_path, BYPASS_SHADOW_HOST="127.0.0.1", BYPASS_SHADOW_PORT=str(shadow.port),
                   GRID_CONSOLE_STDOUT="seed.out", GRID_CONSOLE_RETRY_LIMIT="0")
    # `./gcwrap.pyz`: its #! finds python3 on PATH, here the bare venv's.
    env["PATH"] = f"{bare_python.parent}:{env['PATH']}"
    done = subprocess.run(["./gcwrap.pyz", "--", *genjob(500_000, seed=9)], cwd=bundle.parent, env=env,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sha256_file(home / "seed.out") == expected(500_000, 9)


@pytest.mark.timeout(120)
def test_status_and_resume_from_the_bundle_after_kill_9(bundle: Path, bare_python: Path, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port where home is down, for now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = bare_env(tmp_path)
    spool = tmp_path / "spool"
    done_file = tmp_path / "done"
    proc = run_bundle(bare_python, bundle, ["--shadow", f"127.0.0.1:{port}", "--spool", str(spool), "--job-id",
                                            "orphan", "--retry-timeout", "1", "--stdout", "orphan.out", "--",
                                            *genjob(MB, seed=11, done_file=done_file)], env, tmp_path)

    def status() -> list[dict[str, object]]:
        got = subprocess.run([str(bare_python), "-I", str(bundle), "status", "--json", "--spool", str(spool)],
                             capture_output=True, timeout=60, env=env, check=True)
        return list(json.loads(got.stdout))

    try:
        wait_until(done_file.exists, 60, "the job to finish")
        wait_until(lambda: str(status()[0]["state"]).startswith("exited"), 30, "the spool to record the exit")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
    (st,) = status()
    assert st["state"] == "exited 0" and not st["active"], st
    text = subprocess.run([str(bare_python), "-I", str(bundle), "status", "--spool", str(spool)],
                          capture_output=True, text=True, timeout=60, env=env, check=True).stdout
    assert "orphan" in text
    home = tmp_path / "home"
    home.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    shadow = ShadowProc(home, logs)
    shadow.start(port)
    try:
        resumed = subprocess.run([str(bare_python), "-I", str(bundle), "resume", "--spool", str(spool),
                                  "--retry-timeout", "1"], capture_output=True, text=True, timeout=60, env=env)
    finally:
        shadow.stop()
    assert resumed.returncode == 0, resumed.stderr
    assert "all output delivered" in resumed.stderr
    assert sha256_file(home / "orphan.out") == expected(MB, 11)
    assert list(spool.glob("*.spool")) == []


@pytest.mark.timeout(120)
def test_twenty_jobs_start_from_one_bundle_at_once(bundle: Path, bare_python: Path,
                                                  shadow_home: tuple[ShadowProc, Path], tmp_path: Path) -> None:
    shadow, home = shadow_home
    env = bare_env(tmp_path)
    procs = [run_bundle(bare_python, bundle, ["--shadow", shadow.address, "--job-id", f"many-{i}", "--stdout",
                                              f"many-{i}.out", "--", *genjob(100_000, seed=100 + i)], env, tmp_path)
             for i in range(20)]
    results = [finish(p, 90) for p in procs]
    assert [r[0] for r in results] == [0] * 20, [r[1] for r in results if r[0]]
    for i in range(20):
        assert sha256_file(home / f"many-{i}.out") == expected(100_000, 100 + i)
    assert sorted(p.name for p in bundle.parent.iterdir()) == ["gcwrap.pyz"]
    # All twenty raced to unpack it: one copy won, no half-made one is left.
    (cached,) = (tmp_path / "cache" / "gcwrap").iterdir()
    assert (cached / "gcwrap" / "__pycache__").is_dir() and not cached.name.startswith(".")


@pytest.mark.timeout(60)
def test_a_cache_a_cleaner_took_files_from_is_made_again(bundle: Path, bare_python: Path,
                                                         shadow_home: tuple[ShadowProc, Path], tmp_path: Path) -> None:
    """A cleaner of /tmp (systemd-tmpfiles, tmpreaper) takes files unused for
    a while from the cache's copy: the next start finds it short of them and
    unpacks it again, rather than fail on an import mid-run."""
    shadow, home = shadow_home
    env = bare_env(tmp_path)
    for n in (1, 2):
        status, err = finish(run_bundle(bare_python, bundle, ["--shadow", shadow.address, "--stdout",
                                                              f"clean-{n}.out", "--", "echo", str(n)], env, tmp_path))
        assert status == 0, err
        assert (home / f"clean-{n}.out").read_bytes() == f"{n}\n".encode()
        (cached,) = (tmp_path / "cache" / "gcwrap").iterdir()
        taken = [*cached.glob("rich/**/*.py"), *cached.glob("gcwrap/agent/*.py")]
        assert taken, sorted(p.name for p in cached.iterdir())
        for f in taken:
            f.unlink()
    (cached,) = (tmp_path / "cache" / "gcwrap").iterdir()
    assert not (cached / "gcwrap" / "agent" / "sender.py").exists()  # (taken after the second run: made again)
    status, err = finish(run_bundle(bare_python, bundle, ["--shadow", shadow.address, "--stdout", "clean-3.out",
                                                          "--", "echo", "3"], env, tmp_path))
    assert status == 0, err
    (cached,) = (tmp_path / "cache" / "gcwrap").iterdir()
    assert (cached / "gcwrap" / "agent" / "sender.py").is_file()


@pytest.mark.timeout(60)
def test_a_cache_others_can_write_is_not_used(bundle: Path, bare_python: Path,
                                              shadow_home: tuple[ShadowProc, Path], tmp_path: Path) -> None:
    shadow, home = shadow_home
    base = tmp_path / "cache" / "gcwrap"
    base.mkdir(parents=True)
    base.chmod(0o777)
    status, err = finish(run_bundle(bare_python, bundle, ["--shadow", shadow.address, "--stdout", "shared.out", "--",
                                                          "echo", "from the zip"], bare_env(tmp_path), tmp_path))
    assert status == 0, err
    assert (home / "shared.out").read_bytes() == b"from the zip\n"
    assert list(base.iterdir()) == []


@pytest.mark.root
@pytest.mark.timeout(120)
def test_read_only_job_directory_and_no_home(bundle: Path, bare_python: Path, shadow_home: tuple[ShadowProc, Path],
                                            tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a read-only bind mount (root writes through file modes)")
    shadow, home = shadow_home
    job_dir = tmp_path / "ro"
    job_dir.mkdir()
    shutil.copy2(bundle, job_dir / "gcwrap.pyz")
    subprocess.run(["mount", "--bind", str(job_dir), str(job_dir)], check=True, timeout=30)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(job_dir)], check=True, timeout=30)
        # No HOME, no XDG_CACHE_HOME: the cache is /tmp/gcwrap-UID-cache. Then a
        # cache that cannot be made (in the read-only directory): run from the zip.
        default_cache = Path(f"/tmp/gcwrap-{os.getuid()}-cache")
        before = set(default_cache.iterdir()) if default_cache.is_dir() else set()
        try:
            for i, cache in enumerate([None, str(job_dir / "cache")]):
                env = bare_env(tmp_path, HOME="/nonexistent")
                del env["XDG_CACHE_HOME"]
                if cache is not None:
                    env["XDG_CACHE_HOME"] = cache
                proc = run_bundle(bare_python, job_dir / "gcwrap.pyz", ["--shadow", shadow.address, "--stdout",
                                                                        f"ro{i}.out", "--", *genjob(MB, seed=21 + i)],
                                  env, job_dir)
                status, err = finish(proc)
                assert status == 0, err
                assert sha256_file(home / f"ro{i}.out") == expected(MB, 21 + i)
                assert sorted(p.name for p in job_dir.iterdir()) == ["gcwrap.pyz"]
            assert len(set(default_cache.iterdir()) - before) == 1
        finally:
            for made in set(default_cache.iterdir()) - before if default_cache.is_dir() else ():
                shutil.rmtree(made)
    finally:
        subprocess.run(["umount", str(job_dir)], check=True, timeout=30)


@pytest.mark.timeout(60)
def test_without_zstandard_compression_is_left_out_and_zstd_says_why(
        bundle: Path, bare_python: Path, shadow_home: tuple[ShadowProc, Path], tmp_path: Path) -> None:
    shadow, home = shadow_home
    env = bare_env(tmp_path)
    status, err = finish(run_bundle(bare_python, bundle, ["--compress", "zstd", "--", "true"], env, tmp_path))
    assert status == 2
    assert "zstd needs the zstandard package" in err and str(bare_python) in err and "Traceback" not in err
    status, err = finish(run_bundle(bare_python, bundle, ["-v", "--shadow", shadow.address, "--stdout", "v.out",
                                                          "--", "echo", "plain"], env, tmp_path))
    assert status == 0, err
    assert err.count("compression left out") == 1, err
    assert (home / "v.out").read_bytes() == b"plain\n"


@pytest.mark.timeout(120)
def test_the_bundle_rebuilds_itself_for_the_python_that_runs_it(bundle: Path, bare_python: Path,
                                                                tmp_path: Path) -> None:
    env = bare_env(tmp_path)
    out = tmp_path / "again" / "gcwrap.pyz"
    out.parent.mkdir()
    status, err = finish(run_bundle(bare_python, bundle, ["bundle", "-o", str(out)], env, tmp_path))
    assert status == 0, err
    with zipfile.ZipFile(bundle) as a, zipfile.ZipFile(out) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
    status, err = finish(run_bundle(bare_python, out, ["--", "true"], env, tmp_path))
    assert status == 0, err
    status, err = finish(run_bundle(bare_python, bundle, ["demo"], env, tmp_path))
    assert status == 1 and "the bundle does not carry" in err and "Traceback" not in err
