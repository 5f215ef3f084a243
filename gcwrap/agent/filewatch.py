"""When the job's files change: a stat poll, woken early by inotify.

The poll is the rule: every `interval` seconds the watcher matches the specs
again (globs match files that appear later) and stats every match, and the
difference from the last pass is what it reports. It works everywhere,
network file systems included, where inotify sees only this machine's
writes. inotify, where the kernel has it, only wakes the poll early: a
change is reported by the stat pass it triggers, so the two cannot disagree,
and a lost or overflowing inotify queue costs at most one interval.

inotify through the kernel interface (ctypes on libc), not a library such as
watchfiles: the agent ships as one file with nothing to install (a compiled
extension would not do), and it needs only "wake up", not inotify's events.

What a stat pass can see, per file (`Change`): it appeared; it grew (the
same inode, larger); it was replaced (another inode at its path: a rename
over it); it was rewritten (the same inode, smaller, or the same size with
another mtime); it was deleted. A grown file may also have been written in
place below its old size, and a rewrite within the mtime's granularity is
seen at the next one or not at all: the block digests at each commit, and
the final pass at the job's end, are what make the delivery exact.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import trio

from .filespecs import FileSpec, FileStat, matches, unreachable

log = logging.getLogger("gcwrap")

POLL_INTERVAL = 1.0  # seconds between stat passes when nothing wakes the watcher
SETTLE = 0.05  # at least this long between passes: a job appending fast wakes inotify at every write


class Change(enum.Enum):
    """What happened to a watched path between two looks."""

    APPEARED = "appeared"
    GREW = "grew"
    REPLACED = "replaced"
    REWRITTEN = "rewritten"
    DELETED = "deleted"


@dataclass(frozen=True)
class FileEvent:
    """A change to one path that a --file matches, with its stat after the change."""

    path: str  # relative to the working directory
    spec: FileSpec
    change: Change
    stat: FileStat | None  # None: deleted


def change(old: FileStat | None, new: FileStat | None) -> Change | None:
    """What happened to one path between two stat passes (None: nothing seen)."""
    if old is None:
        return None if new is None else Change.APPEARED
    if new is None:
        return Change.DELETED
    if (old.dev, old.ino) != (new.dev, new.ino):
        return Change.REPLACED
    if new.size < old.size or (new.size == old.size and new.mtime_ns != old.mtime_ns):
        return Change.REWRITTEN
    return Change.GREW if new.size > old.size else None


# -- inotify, through the kernel interface -----------------------------------

IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
# A file in a watched directory written, closed after writing, its metadata
# changed; an entry created, deleted, renamed in or out; the directory itself
# deleted or moved. IN_ONLYDIR: a watch only ever names a directory.
IN_MASK = (0x2 | 0x8 | 0x4 | 0x100 | 0x200 | 0x40 | 0x80 | 0x400 | 0x800) | 0x01000000
READ_SIZE = 64 << 10


class Inotify:
    """An inotify descriptor watching directories. Raises OSError where the
    kernel or the C library has none, or no descriptor is left."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            self._init = libc.inotify_init1
            self._add = libc.inotify_add_watch
        except AttributeError:
            raise OSError(errno.ENOSYS, "no inotify in the C library") from None
        self._add.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
        fd = self._init(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        self.fd: int = fd

    def watch(self, directory: Path) -> bool:
        """Watch a directory's entries (again: the same watch). False where it
        cannot be watched (absent, no permission, no watches left): the poll
        still sees it."""
        return int(self._add(self.fd, os.fsencode(directory), IN_MASK)) >= 0

    async def wait(self) -> None:
        """Until something happened in a watched directory; what it was does
        not matter (the stat pass that follows finds out), so the queue is
        drained and its events dropped."""
        await trio.lowlevel.wait_readable(self.fd)
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, READ_SIZE):
                pass

    def close(self) -> None:
        if self.fd >= 0:
            trio.lowlevel.notify_closing(self.fd)
            os.close(self.fd)
            self.fd = -1


def open_inotify() -> Inotify | None:
    try:
        return Inotify()
    except OSError as e:
        log.info("files are watched by a stat poll alone (no inotify: %s)", e.strerror)
        return None


# -- the watcher -------------------------------------------------------------


class FileWatcher:
    """The job's files named by `specs`, in `workdir`, and their changes."""

    def __init__(self, workdir: Path, specs: tuple[FileSpec, ...], *, interval: float = POLL_INTERVAL,
                 settle: float = SETTLE, inotify: bool = True) -> None:
        self.workdir = workdir
        self.specs = specs
        self.interval = interval
        self.settle = settle
        self.use_inotify = inotify
        self.inotify: Inotify | None = None
        self.files: dict[str, tuple[FileSpec, FileStat]] = {}  # what the last pass saw
        self.out_of_reach: dict[tuple[str, FileSpec], str] = {}  # said already: (path, spec) -> why

    def check(self) -> list[FileEvent]:
        """One stat pass now: what changed since the last (the first reports
        every file there as appeared)."""
        seen = matches(self.workdir, self.specs) if self.inotify is None else self._watched_pass()
        events = []
        for path in sorted(self.files.keys() | seen.keys()):
            old, new = self.files.get(path), seen.get(path)
            what = change(old[1] if old else None, new[1] if new else None)
            spec = new[0] if new else old[0] if old else None
            if what is not None and spec is not None:
                events.append(FileEvent(path, spec, what, new[1] if new else None))
        self.files = seen
        self._say_out_of_reach(seen)
        return events

    def _say_out_of_reach(self, seen: dict[str, tuple[FileSpec, FileStat]]) -> None:
        """Say once what the pass could not reach (it took it for absent)."""
        now = unreachable(self.workdir, self.specs, seen)
        for (path, spec), why in now.items():
            if self.out_of_reach.get((path, spec)) == why:
                continue
            if spec.is_glob:
                log.warning("cannot list the directory %s of --file %r (%s): its files there are not seen", path,
                            spec.pattern, why)
            else:
                log.warning("cannot reach the job's file %s (%s): home gets what gcwrap could read of it before, "
                            "if anything", path, why)
        self.out_of_reach = now

    def _watched_pass(self) -> dict[str, tuple[FileSpec, FileStat]]:
        """A stat pass with the directories it depends on watched first, so
        that a change after the pass read a directory wakes the next one.
        Where the pass finds directories not watched yet (a new match in a
        new directory), it runs again."""
        assert self.inotify is not None
        watched: set[Path] = set()
        seen = self.files
        while True:
            wanted = self._directories(seen)
            for directory in wanted - watched:
                self.inotify.watch(directory)
            watched |= wanted
            seen = matches(self.workdir, self.specs)
            if self._directories(seen) <= watched:
                return seen

    def _directories(self, seen: dict[str, tuple[FileSpec, FileStat]]) -> set[Path]:
        """The directories to watch: for each spec, the deepest existing one
        of those its matches lie in (a missing `out/` is watched through its
        parent, where it appears); and each matched file's own. A directory
        a wildcard enters (`a/*/x.csv`) is watched once it holds a match:
        until then the poll alone finds it."""
        found = set()
        for spec in self.specs:
            directory = self.workdir / spec.fixed_dir
            while directory != self.workdir and not directory.is_dir():
                directory = directory.parent
            found.add(directory)
        for path in seen:
            found.add((self.workdir / path).parent)
        return found

    async def run(self, send: trio.MemorySendChannel[FileEvent], *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Report every change on `send`, the files there now first, until
        cancelled. Started (task_status) once the first pass is done."""
        self.inotify = open_inotify() if self.use_inotify else None
        try:
            async with send:
                for event in self.check():
                    await send.send(event)
                task_status.started()
                while True:
                    await self._wait()
                    for event in self.check():
                        await send.send(event)
        finally:
            if self.inotify is not None:
                self.inotify.close()
                self.inotify = None

    async def _wait(self) -> None:
        """Until the next pass is due: an interval, or inotify's wake-up (but
        not sooner than `settle` after the last pass)."""
        await trio.sleep(self.settle)
        with trio.move_on_after(max(0.0, self.interval - self.settle)):
            if self.inotify is not None:
                await self.inotify.wait()
            else:
                await trio.sleep_forever()
