"""Which of the job's files come home: `--file PATH[=NAME]`, parsed and matched.

A PATH is relative to the job's working directory: a file's path, or a glob
(`out/*.csv`) matched again and again while the job runs, so that files that
appear later count. Globs match as the shell's do (`**` too): `*` matches
no leading dot, so the `.status.json.tmp` a job writes before renaming it
over `status.json` is not picked up by `*.json`. NAME, where given, is where
the file lands at home (templated as --stdout's); without it, the file
lands under its PATH.

No event loop here: the command line parses the specs before the job starts.
"""

from __future__ import annotations

import glob
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


class FileSpecError(ValueError):
    """A --file the command line refuses (absolute, escaping, malformed)."""


@dataclass(frozen=True)
class FileSpec:
    """One --file: a path or glob under the working directory, and where its matches land at home."""

    pattern: str  # a path or a glob, relative to the working directory, normalised
    name: str | None = None  # where it lands at home; None: under its own path

    @property
    def is_glob(self) -> bool:
        return glob.has_magic(self.pattern)

    @property
    def fixed_dir(self) -> str:
        """The deepest directory every match lies in ("" for the working
        directory): where a watch sees new matches appear."""
        parts = PurePosixPath(self.pattern).parts[:-1]
        fixed = []
        for part in parts:
            if glob.has_magic(part):
                break
            fixed.append(part)
        return "/".join(fixed)


def parse_file_spec(text: str) -> FileSpec:
    """`PATH` or `PATH=NAME`. Raises FileSpecError for a PATH that is empty,
    absolute, or leaves the working directory (a `..` component), and for a
    NAME given to a glob (many files cannot land at one NAME)."""
    path, sep, name = text.partition("=")
    if sep and not name:
        raise FileSpecError(f"{text!r}: the NAME after '=' is empty")
    if not path:
        raise FileSpecError(f"{text!r}: the PATH is empty")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise FileSpecError(f"{text!r}: the PATH must be relative to the job's working directory")
    if ".." in pure.parts:
        raise FileSpecError(f"{text!r}: the PATH must not leave the job's working directory ('..')")
    if path.endswith("/") or pure.parts in ((), (".",)):
        raise FileSpecError(f"{text!r}: the PATH names a directory, not a file")
    spec = FileSpec(pure.as_posix(), name if sep else None)
    if spec.is_glob and spec.name is not None:
        raise FileSpecError(f"{text!r}: a glob matches many files, which cannot land at one NAME")
    return spec


@dataclass(frozen=True)
class FileStat:
    """What a stat says of a file: which file it is, how large, when changed."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStat:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def stat_file(path: Path) -> FileStat | None:
    """The regular file at `path` (symbolic links followed), or None where
    there is none (absent, a directory, or not reachable)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStat.of(st) if stat.S_ISREG(st.st_mode) else None


def matches(workdir: Path, specs: tuple[FileSpec, ...]) -> dict[str, tuple[FileSpec, FileStat]]:
    """The files the specs name now, by path relative to `workdir`: each
    regular file once (for the first spec that matches it)."""
    found: dict[str, tuple[FileSpec, FileStat]] = {}
    for spec in specs:
        paths = sorted(glob.glob(spec.pattern, root_dir=workdir, recursive=True)) if spec.is_glob else [spec.pattern]
        for rel in paths:
            if rel in found:
                continue
            st = stat_file(workdir / rel)
            if st is not None:
                found[rel] = (spec, st)
    return found


def unreachable(workdir: Path, specs: tuple[FileSpec, ...], found: dict[str, tuple[FileSpec, FileStat]]
                ) -> dict[tuple[str, FileSpec], str]:
    """What the specs name that is there but out of gcwrap's reach, with
    why (a pass takes it for absent): a PATH not `found` whose stat fails
    for another reason than its absence (the job made a directory on the
    way unsearchable), and a glob's fixed directory it cannot list."""
    out: dict[tuple[str, FileSpec], str] = {}
    for spec in specs:
        target = spec.fixed_dir if spec.is_glob else spec.pattern
        if not spec.is_glob and target in found:
            continue
        try:
            if spec.is_glob:
                os.listdir(workdir / target)
            else:
                os.stat(workdir / target)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            out[(target or ".", spec)] = e.strerror or str(e)
    return out
