"""The job's files in `gcwrap resume`: what the spool kept of them, taken up again.

A run records (gcwrap.agent.spoolfiles) its --file specs and working
directory, each file's handle, NAME and path, and how far home took each
version; never the bytes, which are the job's file itself. After gcwrap
was killed, a resume knows each file's handle and NAME from there, and the
block digests of the versions it sent commits for; the first WELCOME says
which of them home holds committed (gcwrap.agent.filesender's
`_home_base`). Then one last pass, as at a job's end: every spec matched
again, each file's content now made the next version, built from what
home holds by the block digests, and committed; files that appeared since
(a glob's) get handles after the spool's. A file gone meanwhile is said so,
and home keeps what it had of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..sync import Signal
from .filesender import FileSender, Record, TrackedFile
from .filespecs import FileSpec
from .spoolfiles import FileRecord, SpoolFiles, VersionRecord


@dataclass(frozen=True)
class Kept:
    """What a spool keeps of the job's files."""

    workdir: Path
    specs: tuple[FileSpec, ...]
    files: dict[int, FileRecord]
    versions: dict[int, list[VersionRecord]]  # by handle, in order


def read(tables: SpoolFiles) -> Kept | None:
    """The spool's record of the job's files; None where the run named
    none. SpoolError where the spool cannot be read."""
    recorded = tables.specs()
    if recorded is None:
        return None
    files = tables.files()
    return Kept(*recorded, files, {handle: tables.versions(handle) for handle in files})


def restore(kept: Kept, changed: Signal, record: Record) -> FileSender:
    """The FileSender of a resumed spool, its files as the spool keeps them
    (none current yet: the last pass opens them after the first WELCOME)."""
    sender = FileSender(kept.workdir, kept.specs, changed, record)
    sender.resuming = True
    for handle, f in kept.files.items():
        tracked = TrackedFile(handle, f.path, f.name)
        versions = kept.versions[handle]
        for v in versions:
            tracked.bases[v.version] = v.base
            if (digests := v.digests()) is not None:
                tracked.commits[v.version] = digests  # (its last FILE_COMMIT's: `welcomed` cuts it to home's)
        tracked.numbered = versions[-1].version if versions else 0
        sender.files[f.path] = sender.by_handle[handle] = tracked
    return sender
