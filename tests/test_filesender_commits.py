"""gcwrap.agent.filesender driven on real files, its frames taken by a
model of home (versions built from FILE_DATA and FILE_COPY, commits checked
by SHA-256 as home checks them): what a commit reads, what the job's end
finds. Virtual time (trio's autojump clock) for the quiet moments."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from gcwrap.agent import filedelta, fileresume
from gcwrap.agent.filesender import QUIET, FileSender, _no_record
from gcwrap.agent.filespecs import FileSpec
from gcwrap.agent.spoolfiles import FileRecord, VersionRecord
from gcwrap.sync import Signal
from gcwrap.wire.events import Event, FileAck, FileCommit, FileCopy, FileData, FileHeld, FileOpen

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


class Home:
    """What home would make of the frames: each version's bytes, the
    committed one per file; every frame acknowledged at once."""

    def __init__(self) -> None:
        self.versions: dict[tuple[int, int], bytearray] = {}
        self.bases: dict[tuple[int, int], int | None] = {}
        self.committed: dict[int, tuple[int, bytes]] = {}  # file -> (version, content)
        self.frames: list[Event] = []

    async def send(self, ev: Event) -> None:
        if isinstance(ev, FileData):  # (sent before `send` returns, as a session does: its buffer is used again)
            ev = replace(ev, payload=bytes(ev.payload))
        self.frames.append(ev)

    def answer(self, sender: FileSender) -> None:
        frames, self.frames = self.frames, []
        for ev in frames:
            if isinstance(ev, FileOpen):
                held = self.committed.get(ev.file)
                assert ev.base == (held[0] if held else None), (ev, held)
                self.versions.setdefault((ev.file, ev.version), bytearray())
                self.bases[(ev.file, ev.version)] = ev.base
            elif isinstance(ev, FileData):
                content = self.versions[(ev.file, ev.version)]
                assert ev.offset <= len(content)
                content[ev.offset :] = content[ev.offset : ev.offset + len(ev.payload)] = ev.payload
                sender.ack(FileAck(ev.file, ev.version, len(content)))
            elif isinstance(ev, FileCopy):
                content = self.versions[(ev.file, ev.version)]
                base = self.committed[ev.file][1]
                assert ev.offset == len(content) and ev.source + ev.length <= len(base)
                content += base[ev.source : ev.source + ev.length]
                sender.ack(FileAck(ev.file, ev.version, len(content)))
            elif isinstance(ev, FileCommit):
                content = self.versions[(ev.file, ev.version)]
                assert len(content) == ev.size and hashlib.sha256(content).hexdigest() == ev.sha256, ev
                self.committed[ev.file] = (ev.version, bytes(content))
                sender.ack(FileAck(ev.file, ev.version, ev.size, committed=True))


async def _drive(sender: FileSender, home: Home) -> None:
    """Send until nothing is due, home answering each turn."""
    while await sender.send_some(home.send):
        home.answer(sender)
    home.answer(sender)


async def _look(sender: FileSender) -> None:
    """A stat pass of the watcher, its changes taken."""
    for ev in sender.watcher.check():
        await sender.take(ev)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each block read of a scan took (filedelta reads a file's content through one function)."""
    taken: list[int] = []
    read_block = filedelta._read_block

    def counted(fd: int, offset: int, length: int) -> bytes:
        block = read_block(fd, offset, length)
        taken.append(len(block))
        return block

    monkeypatch.setattr(filedelta, "_read_block", counted)
    return taken


async def test_a_checkpoint_commit_of_an_appended_file_reads_its_appends_not_the_whole(
        tmp_path: Path, autojump_clock: MockClock, reads: list[int]) -> None:
    """A log appended to for hours is committed at every quiet moment: each such commit reads the bytes
    added since the last, not the file again; the job's end reads it whole (a write below what was read
    before is found there) and home holds it exactly."""
    log = tmp_path / "train.log"
    log.write_bytes(os.urandom(4 * MiB))
    sender = FileSender(tmp_path, (FileSpec("train.log"),), Signal())
    home = Home()
    await _look(sender)
    await _drive(sender, home)
    assert home.committed[1][1] == log.read_bytes()  # (sent as scanned: committed at once)
    reads.clear()
    with log.open("ab") as f:
        for step in range(5):
            f.write(os.urandom(10_000))
            f.flush()
            await _look(sender)
            await _drive(sender, home)
            await trio.sleep(QUIET + 0.1)  # (quiet: its commit is due)
            await _drive(sender, home)
            assert home.committed[1] == (1, log.read_bytes()), step
    assert sum(reads) < 5 * 10_000 + 2 * filedelta.BLOCK_SIZE, sum(reads)  # (the whole again: 20 MiB)
    # Written in place below what the checkpoints read, the size unchanged: the job's end finds it.
    with log.open("r+b") as f:
        f.seek(MiB)
        f.write(b"rewritten in place")
    await sender.job_ended()
    await _drive(sender, home)
    assert sender.done
    assert home.committed[1][1] == log.read_bytes()


async def test_a_rewrite_in_place_just_before_the_job_ends_is_found_by_the_last_pass(
        tmp_path: Path, autojump_clock: MockClock) -> None:
    """A file committed, then written in place at the same size as the job ends, with no stat pass of
    the watcher between (its last events lost as it is cancelled): the last pass sees the file as it
    was, by stat; reading it whole finds the write, and home holds the final content."""
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(3 * MiB))
    sender = FileSender(tmp_path, (FileSpec("data.bin"),), Signal())
    home = Home()
    await _look(sender)
    await _drive(sender, home)
    assert home.committed[1] == (1, data.read_bytes())
    before = data.stat()
    fd = os.open(data, os.O_WRONLY)
    try:
        os.pwrite(fd, b"the last step's numbers", 2 * MiB + 5)
        os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))  # (as if within the mtime's granularity)
    finally:
        os.close(fd)
    await sender.job_ended()
    await _drive(sender, home)
    assert sender.done
    assert home.committed[1][1] == data.read_bytes()


async def test_a_resume_builds_on_what_home_committed_not_on_a_commit_home_never_read(
        tmp_path: Path, autojump_clock: MockClock) -> None:
    """The spool keeps the scan of a log's last FILE_COMMIT, sent as gcwrap was killed and never read by
    home, which holds the log committed shorter: the resume copies none of what home lacks."""
    block = filedelta.BLOCK_SIZE
    held = os.urandom(3 * block + 100)
    sent = held + os.urandom(2 * block)  # (the commit home never read was at this size)
    log = tmp_path / "train.log"
    log.write_bytes(sent + os.urandom(1000))
    scan = filedelta.digests_of(sent)
    record = FileRecord(1, "train.log", "train.log", "train.log")
    kept = fileresume.Kept(tmp_path, (FileSpec("train.log"),), {1: record},
                           {1: [VersionRecord(1, 1, None, len(sent), len(sent), len(sent),
                                              hashlib.sha256(sent).hexdigest(), scan.blob(), len(held))]})
    sender = fileresume.restore(kept, Signal(), _no_record)
    home = Home()
    home.committed[1] = (1, held)
    sender.welcomed([FileHeld(1, 1, len(held), len(held))])
    await _drive(sender, home)
    assert sender.done
    assert home.committed[1][1] == log.read_bytes()
    assert sender.copied == 3 * block  # (the whole blocks home holds)


async def test_files_past_what_one_exit_can_list_are_left_out_said_once(
        tmp_path: Path, autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    """A glob matching more files than one WELCOME or EXIT can list (MAX_FILES): the first ones come home,
    the rest are left out with one line; before, the EXIT could not be encoded at the job's end."""
    from gcwrap.wire.fileframes import MAX_FILES

    out = tmp_path / "out"
    out.mkdir()
    for i in range(MAX_FILES + 5):
        (out / f"{i:05d}.csv").write_bytes(b"%d\n" % i)
    sender = FileSender(tmp_path, (FileSpec("out/*.csv"),), Signal())
    home = Home()
    # gcwrap's warnings, whatever an earlier test made of its logger's level and propagation
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="gcwrap")
    logging.getLogger("gcwrap").addHandler(handler)
    try:
        await _look(sender)
        await sender.job_ended()
        await _drive(sender, home)
    finally:
        logging.getLogger("gcwrap").removeHandler(handler)
    assert sender.done
    assert len(home.committed) == MAX_FILES and len(sender.exit_files()) == MAX_FILES
    said = [r.getMessage() for r in records if "at most" in r.getMessage()]
    assert len(said) == 1 and f"at most {MAX_FILES} files a job" in said[0], said
