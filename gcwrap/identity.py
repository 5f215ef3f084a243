"""Who and where this job is: its id from the batch system, attempt, host, user.

`detect(env)` reads the batch system's environment:

- Slurm: `SLURM_JOB_ID`; an array task has `SLURM_ARRAY_JOB_ID` and
  `SLURM_ARRAY_TASK_ID`; `SLURM_RESTART_COUNT` counts the requeues/restarts.
- HTCondor: the job ad file named by `_CONDOR_JOB_AD` (`ClusterId`, `ProcId`,
  and `NumJobStarts`: the starts before this one, since the shadow counts a
  start only once the job runs).
- PBS/Torque: `PBS_JOBID`; an array task has `PBS_ARRAYID` (Torque) or
  `PBS_ARRAY_INDEX` (PBS Pro). PBS tells a job nothing about restarts.
- else a generated `HOST-PID-TIME`.

Every run of gcwrap is a new attempt at the shadow (a new spool instance);
the attempt number here only feeds `%n` in name templates.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass


def hostname() -> str:
    return socket.gethostname()


def short_hostname() -> str:
    return hostname().split(".", 1)[0]


def username() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


@dataclass(frozen=True)
class BatchIdentity:
    """This job as its batch system knows it."""

    system: str  # "slurm", "condor", "pbs", or "" when no batch system was found
    job: str  # the batch system's job id (%j); an array task's is its array's
    task: str | None  # the array task (Slurm, PBS) or ProcId (HTCondor), else None
    attempt: int  # 0 for the first run, 1 after one requeue/restart... (%n)
    job_id: str  # gcwrap's default job id at the shadow


_AD_LINE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*(.*?)\s*$")


def read_condor_ad(path: str) -> dict[str, str]:
    """The attributes of an HTCondor job ad file (`Attr = value` lines).

    Names are case-insensitive in ClassAds: the keys here are lower case.
    String values keep their quotes; an unreadable file is an empty ad.
    """
    out: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = _AD_LINE.match(line)
                if m:
                    out[m.group(1).lower()] = m.group(2)
    except OSError:
        pass
    return out


def _count(value: str | None) -> int:
    """A non-negative count from the environment or a job ad; anything else is 0."""
    value = (value or "").strip()
    return int(value) if value.isdigit() else 0


def _slurm(env: Mapping[str, str]) -> BatchIdentity | None:
    attempt = _count(env.get("SLURM_RESTART_COUNT"))
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return BatchIdentity("slurm", array, task, attempt, f"slurm-{array}_{task}")
    if env.get("SLURM_JOB_ID"):
        job = env["SLURM_JOB_ID"]
        return BatchIdentity("slurm", job, None, attempt, f"slurm-{job}")
    return None


def _condor(env: Mapping[str, str]) -> BatchIdentity | None:
    if not env.get("_CONDOR_JOB_AD"):
        return None
    ad = read_condor_ad(env["_CONDOR_JOB_AD"])
    cluster = ad.get("clusterid", "")
    if not cluster.isdigit():
        return None
    proc = ad.get("procid", "0")
    proc = proc if proc.isdigit() else "0"
    return BatchIdentity("condor", cluster, proc, _count(ad.get("numjobstarts")), f"condor-{cluster}.{proc}")


def _pbs(env: Mapping[str, str]) -> BatchIdentity | None:
    full = env.get("PBS_JOBID")
    if not full:
        return None
    task = env.get("PBS_ARRAYID") or env.get("PBS_ARRAY_INDEX") or None
    job = re.sub(r"\[[^]]*\]", "", full.split(".", 1)[0]) or full  # 1234[5].server -> 1234
    job_id = full if task is None or "[" in full else f"{full}-{task}"
    return BatchIdentity("pbs", job, task, 0, f"pbs-{job_id}")


def detect(env: Mapping[str, str] | None = None) -> BatchIdentity:
    """This job's identity: Slurm, then HTCondor, then PBS, else generated."""
    env = os.environ if env is None else env
    for probe in (_slurm, _condor, _pbs):
        found = probe(env)
        if found is not None:
            return found
    generated = f"{hostname()}-{os.getpid()}-{int(time.time())}"
    return BatchIdentity("", generated, None, 0, generated)


def default_job_id(env: Mapping[str, str] | None = None) -> str:
    return detect(env).job_id
