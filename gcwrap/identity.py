"""Who and where this job is: its id from the batch system, host, user."""

from __future__ import annotations

import getpass
import os
import re
import socket
import time
from typing import Mapping


def hostname() -> str:
    return socket.gethostname()


def username() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _condor_ad(path: str) -> dict[str, str]:
    """ClusterId/ProcId from an HTCondor job ad file (`Attr = value` lines)."""
    out: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = re.match(r"\s*(ClusterId|ProcId)\s*=\s*(\d+)\s*$", line)
                if m:
                    out[m.group(1)] = m.group(2)
    except OSError:
        pass
    return out


def batch_job_id(env: Mapping[str, str]) -> str | None:
    """The job id the batch system gave this job, if any."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm-{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    if env.get("_CONDOR_JOB_AD"):
        ad = _condor_ad(env["_CONDOR_JOB_AD"])
        if "ClusterId" in ad:
            return f"condor-{ad['ClusterId']}.{ad.get('ProcId', '0')}"
    if env.get("PBS_JOBID"):
        job = env["PBS_JOBID"]
        if env.get("PBS_ARRAYID") and "[" not in job:
            job = f"{job}-{env['PBS_ARRAYID']}"
        return f"pbs-{job}"
    return None


def default_job_id(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return batch_job_id(env) or f"{hostname()}-{os.getpid()}-{int(time.time())}"
