"""Name templates: one submit file for thousands of jobs.

`--stdout 'out/%j.%a.out'` becomes `out/4242.7.out` in task 7 of Slurm array
job 4242: the modern form of Condor's `file_remaps "datafile data.$(PROCESS)"`.

    %j  the job id: --job-id when given, else the batch system's (an array
        task's is its array's: SLURM_ARRAY_JOB_ID, the HTCondor ClusterId,
        the PBS job number), else the generated HOST-PID-TIME
    %a  the array task (SLURM_ARRAY_TASK_ID, HTCondor ProcId, PBS_ARRAYID), else 0
    %h  the short host name (up to the first dot)
    %u  the user running gcwrap
    %n  the attempt: 0 on the first run, 1 after the first requeue/restart...
    %%  a literal %

Any other key, or a `%` at the end, is an error. The expanded text must
still be a valid NAME (gcwrap.names): a value cannot smuggle in `..` or an
absolute path.
"""

from __future__ import annotations

from collections.abc import Mapping

from .identity import BatchIdentity, short_hostname, username

KEYS: dict[str, str] = {
    "j": "job id",
    "a": "array task id (0 when none)",
    "h": "short host name",
    "u": "user name",
    "n": "attempt number (0 on the first run)",
}
KNOWN = " ".join(f"%{k}" for k in KEYS) + " %%"


class TemplateError(ValueError):
    """A template with a key that does not exist, or a lone % at its end."""


def _pieces(template: str) -> list[tuple[bool, str]]:
    """(is_key, text) pieces of a template; TemplateError for a bad one."""
    out: list[tuple[bool, str]] = []
    literal: list[str] = []
    i = 0
    while i < len(template):
        ch = template[i]
        if ch != "%":
            literal.append(ch)
            i += 1
            continue
        if i + 1 == len(template):
            raise TemplateError(
                f"{template!r} ends with a lone '%': write %% for a literal %; known keys: {KNOWN}"
            )
        key = template[i + 1]
        if key == "%":
            literal.append("%")
        elif key in KEYS:
            out.append((False, "".join(literal)))
            literal = []
            out.append((True, key))
        else:
            raise TemplateError(
                f"unknown key %{key} in {template!r}: known keys are {KNOWN} (write %% for a literal %)"
            )
        i += 2
    out.append((False, "".join(literal)))
    return out


def check(template: str) -> None:
    """TemplateError unless every % in TEMPLATE starts a known key or %%."""
    _pieces(template)


def expand(template: str, values: Mapping[str, str]) -> str:
    """TEMPLATE with each key replaced by its value from VALUES."""
    return "".join(values[text] if is_key else text for is_key, text in _pieces(template))


def values_for(ident: BatchIdentity, job_id: str | None = None) -> dict[str, str]:
    """The value of every key for this job; JOB_ID (--job-id) wins for %j."""
    return {
        "j": job_id or ident.job,
        "a": ident.task if ident.task is not None else "0",
        "h": short_hostname(),
        "u": username(),
        "n": str(ident.attempt),
    }
