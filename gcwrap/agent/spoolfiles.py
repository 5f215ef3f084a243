"""The spool's record of the job's files (--file): which file each handle
is, and how far home holds each of its versions. Never the bytes: the job's
file is their source (read again through a descriptor, or, after gcwrap was
killed, from the file itself by `gcwrap resume`).

A file is delivered as versions (see gcwrap.wire.events' FileOpen): version
1 has no base; a later one is built from its base, the version home holds
committed. Per version the spool records how far it was sent and how far
home acknowledged it; once scanned for its commit, the size, SHA-256 and
block digests (gcwrap.agent.filedelta) it commits (its latest commit's: a
version appended to after a commit is committed again); and once home
acknowledged a commit, the committed size. A version committed makes the
older ones useless: they are deleted in the same transaction; a new version
abandons those never scanned (no FILE_COMMIT went for them) but its base. So
a file keeps its committed version, those whose FILE_COMMIT went since (home
may hold one of them committed, its acknowledgement lost with the
connection or with gcwrap: a resume builds on it), and the newest.

Synchronous and one transaction per call, like gcwrap.agent.spool, whose
database (and errors: SpoolError with the reason) it shares. Its tables are
made by a migration of their own, applied at the first file recorded: a
table takes a page, and the spool of a job without files must still fit
where little is left (a spool with none reads as one with no file). The
--file specs and the job's working directory are recorded too, as the run
starts watching: `gcwrap resume` reads the files, and matches the globs,
again.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..db import AnyDatabase, Migration, migrate, transaction
from .filespecs import FileSpec
from .spool import Spool, SpoolError, describe_sqlite_error

if TYPE_CHECKING:  # (hashlib and the delta code: only a job with --file needs them)
    from .filedelta import Digests, Scan


def _f001_files(db: AnyDatabase) -> None:
    db.execute(
        """CREATE TABLE files (
            handle INTEGER PRIMARY KEY, path TEXT NOT NULL, name TEXT NOT NULL, spec TEXT NOT NULL,
            dev INTEGER, ino INTEGER)"""
    )
    db.execute(
        """CREATE TABLE file_versions (
            file INTEGER NOT NULL, version INTEGER NOT NULL, base INTEGER,
            sent INTEGER NOT NULL DEFAULT 0, acked INTEGER NOT NULL DEFAULT 0,
            size INTEGER, sha256 TEXT, blocks BLOB, committed INTEGER,
            PRIMARY KEY (file, version)) WITHOUT ROWID"""
    )


def _f002_specs(db: AnyDatabase) -> None:
    # The --file specs as the run expanded them and the job's working directory (bytes: a path need not be
    # UTF-8): `gcwrap resume` matches them again, for files that appeared after gcwrap was killed.
    db.execute("CREATE TABLE file_specs (position INTEGER PRIMARY KEY, pattern TEXT NOT NULL, name TEXT)")
    db.execute("CREATE TABLE file_workdir (workdir BLOB NOT NULL)")


# Numbered apart from the spool's own (gcwrap.agent.spool.MIGRATIONS), in the same `_migrations` table.
FILE_MIGRATIONS: list[Migration] = [
    (1001, "files", _f001_files),
    (1002, "file specs", _f002_specs),
]


@dataclass(frozen=True)
class FileRecord:
    """A file the job writes, as the spool records it: its handle, path, name at home and --file."""

    handle: int  # the file's number on the wire, for this run of the job
    path: str  # relative to the job's working directory
    name: str  # where it lands at home
    spec: str  # the --file that named it
    dev: int | None = None  # the inode its newest version is read from
    ino: int | None = None


@dataclass(frozen=True)
class VersionRecord:
    """One version of a file, as the spool records it: what was sent of it, what home holds, and
    its digests once scanned for its commit."""

    file: int
    version: int
    base: int | None  # the version it is built from (committed at home), or None
    sent: int = 0  # bytes of it handed to the connection
    acked: int = 0  # bytes of it durable at home
    size: int | None = None  # scanned for its commit: its size, SHA-256 and block digests
    sha256: str | None = None
    blocks: bytes | None = None
    committed: int | None = None  # home acknowledged its commit at this size

    def digests(self, block_size: int | None = None) -> Digests | None:
        """The block digests of its scanned content, or None before a scan."""
        if self.size is None or self.blocks is None:
            return None
        from .filedelta import Digests

        return Digests.from_blob(self.size, self.blocks, *(() if block_size is None else (block_size,)))


class SpoolFiles:
    """The files' tables of one spool (see the module's docstring)."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool
        self.db = spool.db

    @contextmanager
    def _write(self) -> Iterator[None]:
        try:
            with transaction(self.db.conn):
                yield
        except sqlite3.Error as e:
            raise SpoolError(describe_sqlite_error(e, self.spool.path)) from e

    def _read(self, fn: Callable[[], list[Any]]) -> list[Any]:
        try:
            if not self._has_tables():
                return []  # no file recorded yet
            return fn()
        except sqlite3.Error as e:
            raise SpoolError(describe_sqlite_error(e, self.spool.path)) from e

    def _has_tables(self, table: str = "file_versions") -> bool:
        return self.db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", [table]).fetchone() is not None

    # -- reads -----------------------------------------------------------

    def specs(self) -> tuple[Path, tuple[FileSpec, ...]] | None:
        """The job's working directory and its --file specs, as the run
        recorded them (`record_specs`); None where it recorded none."""
        try:
            if not self._has_tables("file_specs"):
                return None
            rows = self.db.execute("SELECT pattern, name FROM file_specs ORDER BY position").fetchall()
            workdir = self.db.execute("SELECT workdir FROM file_workdir").fetchone()
        except sqlite3.Error as e:
            raise SpoolError(describe_sqlite_error(e, self.spool.path)) from e
        if workdir is None:
            return None
        return Path(os.fsdecode(workdir[0])), tuple(FileSpec(pattern, name) for pattern, name in rows)

    def files(self) -> dict[int, FileRecord]:
        rows = self._read(lambda: self.db.execute(
            "SELECT handle, path, name, spec, dev, ino FROM files ORDER BY handle").fetchall())
        return {int(r[0]): FileRecord(*r) for r in rows}

    def versions(self, file: int | None = None) -> list[VersionRecord]:
        """Every version the spool keeps (of one file), in order."""
        where, args = ("WHERE file = ?", [file]) if file is not None else ("", [])
        rows = self._read(lambda: self.db.execute(
            "SELECT file, version, base, sent, acked, size, sha256, blocks, committed FROM file_versions "
            f"{where} ORDER BY file, version", args).fetchall())
        return [VersionRecord(*r) for r in rows]

    def newest(self, file: int) -> VersionRecord | None:
        versions = self.versions(file)
        return versions[-1] if versions else None

    def committed(self, file: int) -> VersionRecord | None:
        """The version home holds committed (a new version's base), or None."""
        done = [v for v in self.versions(file) if v.committed is not None]
        return done[-1] if done else None

    # -- writes ----------------------------------------------------------

    def record_specs(self, workdir: Path, specs: tuple[FileSpec, ...]) -> None:
        """The job's working directory and its --file specs (their NAMEs as
        expanded), for `gcwrap resume`: recorded before the job's first file."""
        self._migrate()
        with self._write():
            self.db.execute("DELETE FROM file_specs")
            self.db.execute("DELETE FROM file_workdir")
            for i, spec in enumerate(specs):
                self.db.execute("INSERT INTO file_specs (position, pattern, name) VALUES (?, ?, ?)",
                                [i, spec.pattern, spec.name])
            self.db.execute("INSERT INTO file_workdir (workdir) VALUES (?)", [os.fsencode(workdir)])

    def _migrate(self) -> None:
        try:
            migrate(self.db, FILE_MIGRATIONS)
        except sqlite3.Error as e:
            raise SpoolError(describe_sqlite_error(e, self.spool.path)) from e

    def add_file(self, record: FileRecord) -> None:
        """A new handle. ValueError for a handle or a path already recorded."""
        known = self.files()
        if record.handle in known or record.path in {f.path for f in known.values()}:
            raise ValueError(f"file {record.handle} ({record.path}) is already recorded")
        self._migrate()
        with self._write():
            self.db.execute("INSERT INTO files (handle, path, name, spec, dev, ino) VALUES (?, ?, ?, ?, ?, ?)",
                            [record.handle, record.path, record.name, record.spec, record.dev, record.ino])

    def new_version(self, file: int, version: int, dev: int, ino: int, base: int | None) -> VersionRecord:
        """Start `version` of `file`, read from the inode (dev, ino), built
        from `base`: the version home will hold committed when it reads this
        one's FILE_OPEN (the committed one, or one whose FILE_COMMIT went
        before it: home takes frames in order). Versions only grow. Versions
        neither committed nor scanned, other than the base, are abandoned
        (deleted): home drops them at the new FILE_OPEN. ValueError for an
        unknown file, a version not above the newest, or a base the spool
        holds no scan of."""
        if file not in self.files():
            raise ValueError(f"no file {file}")
        versions = self.versions(file)
        if versions and version <= versions[-1].version:
            raise ValueError(f"version {version} of file {file} after version {versions[-1].version}")
        if base is not None and not any(v.version == base and v.size is not None for v in versions):
            raise ValueError(f"version {base} of file {file} is not scanned: it cannot be a base")
        with self._write():
            self.db.execute("DELETE FROM file_versions WHERE file = ? AND committed IS NULL AND size IS NULL "
                            "AND version IS NOT ?", [file, base])
            self.db.execute("INSERT INTO file_versions (file, version, base) VALUES (?, ?, ?)",
                            [file, version, base])
            self.db.execute("UPDATE files SET dev = ?, ino = ? WHERE handle = ?", [dev, ino, file])
        return VersionRecord(file, version, base)

    def progress(self, file: int, version: int, *, sent: int | None = None, acked: int | None = None) -> None:
        """How far a version was sent and acknowledged. `acked` only grows
        (an older acknowledgement changes nothing); `sent` may go back (a
        resend after a reconnection) but never below `acked`."""
        current = self._version(file, version)
        new_acked = max(current.acked, acked if acked is not None else 0)
        new_sent = max(new_acked, current.sent if sent is None else sent)
        with self._write():
            self.db.execute("UPDATE file_versions SET sent = ?, acked = ? WHERE file = ? AND version = ?",
                            [new_sent, new_acked, file, version])

    def scanned(self, file: int, version: int, scan: Scan) -> None:
        """The version's content as read for its commit (its size, SHA-256,
        block digests): each commit's, so that a resume builds the next
        version on as much of it as home holds. A version committed already
        is scanned again only grown (appended to after its commit: the
        bytes it committed are settled); ValueError for any other."""
        committed = self._version(file, version).committed
        if committed is not None and scan.digests.size <= committed:
            raise ValueError(f"version {version} of file {file} is committed already at {committed} bytes")
        with self._write():
            self.db.execute("UPDATE file_versions SET size = ?, sha256 = ?, blocks = ? WHERE file = ? AND version = ?",
                            [scan.digests.size, scan.sha256, scan.digests.blob(), file, version])

    def commit_acked(self, file: int, version: int, size: int) -> None:
        """Home acknowledged the commit of the version at `size`: it is the
        file's committed version, acknowledged whole, and the versions before
        it are deleted. ValueError where the spool's scan says another size
        (an acknowledgement of an older commit than the scan recorded)."""
        current = self._version(file, version)
        if current.size != size:
            raise ValueError(f"version {version} of file {file} committed at {size}, scanned at {current.size}")
        with self._write():
            self.db.execute("UPDATE file_versions SET committed = ?, acked = ?, sent = MAX(sent, ?) "
                            "WHERE file = ? AND version = ?", [size, size, size, file, version])
            self.db.execute("DELETE FROM file_versions WHERE file = ? AND version < ?", [file, version])

    def _version(self, file: int, version: int) -> VersionRecord:
        found = [v for v in self.versions(file) if v.version == version]
        if not found:
            raise ValueError(f"no version {version} of file {file}")
        return found[0]
