"""The shadow's file cache against every order of its users, chosen by hypothesis.

Connections write their jobs' files a read at a time: a DATA frame may
arrive in pieces, with awaits (socket reads) between them. Meanwhile the
idle closer (`Descriptors.close_idle`: `FileCache.close_idle` every half
second), the budget's trim (`FileCache.trim`), the durability thread's
syncs (a file pinned from the batch's start to its end) and sessions that
end (`JobFiles.close`: a pinned file is orphaned, closed by its last unpin)
all act on the same cache. Each rule below is one of those steps, as the
shadow's code takes it; hypothesis interleaves them. Real files, real
descriptors, and other files opened meanwhile, so that a descriptor number
closed under a user is reused at once and a wrong write lands somewhere it
can be seen.

What must hold after every step: every open file's descriptor is its own
file (the inode it was opened as); a dirty file (bytes written but not yet
durable), a file with a frame half written, and a pinned file are open; the
cache holds exactly the open files of live sessions; and every file holds
exactly the bytes written to it, in order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gcwrap.shadow.files import FileCache, StreamFile, open_confined

FILES = 4
IDLE = 2.0  # (descriptors.IDLE_CLOSE)


class CacheAndItsUsers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="gcwrap-cache-"))
        self.root_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        self.cache = FileCache(self.root_fd)
        self.files: list[StreamFile] = []
        for i in range(FILES):
            fd = open_confined(self.root_fd, f"job{i}/out", write=True)
            sf = StreamFile(f"job{i}", 1, f"job{i}/out", fd, 0, 0)
            sf.identify()
            self.cache.add(sf)
            self.files.append(sf)
        self.whole = [b""] * FILES  # each file's bytes up to `written` (frames whole)
        self.piece = [b""] * FILES  # ...and past it, of a frame not yet whole
        self.live = [True] * FILES  # its session holds it (else ended: JobFiles.close)
        self.syncs: list[tuple[int, int, int]] = []  # in flight: (file, `written` at the pin, fd at the pin)
        self.skew = 0.0  # seconds the idle closer's clock runs ahead of the users'
        self.others: list[int] = []  # other descriptors the shadow opened meanwhile

    def teardown(self) -> None:
        for sf in self.files:
            sf.close()
        for fd in self.others:
            os.close(fd)
        os.close(self.root_fd)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- a connection ------------------------------------------------------------------------

    @rule(i=st.integers(0, FILES - 1), data=st.binary(min_size=1, max_size=64), last=st.booleans())
    def a_read_writes_a_piece_of_a_frame(self, i: int, data: bytes, last: bool) -> None:
        """As AgentConnection._write: reopened if the cache closed it, the
        piece written after what the frame already has; `written` moves at
        the frame's last piece."""
        sf = self.files[i]
        if not self.live[i]:
            return
        self.cache.use(sf)
        os.pwrite(sf.fd, data, sf.written + len(self.piece[i]))
        self.piece[i] += data
        if last:
            sf.written += len(self.piece[i])
            self.whole[i] += self.piece[i]
            self.piece[i] = b""
        sf.partial = bool(self.piece[i])

    # -- the durability thread ----------------------------------------------------------------

    @rule(i=st.integers(0, FILES - 1))
    def a_batch_pins_a_dirty_file(self, i: int) -> None:
        """As Durability's batch: pinned under the cache's lock with its
        `written` of that moment; the thread syncs its descriptor later."""
        sf = self.files[i]
        if sf.written == sf.durable or sf.sync_failed or not self.live[i]:
            return
        with self.cache.lock:
            sf.pins += 1
            self.syncs.append((i, sf.written, sf.fd))

    @precondition(lambda self: self.syncs)
    @rule(k=st.integers(0, 7))
    def the_thread_syncs_and_unpins(self, k: int) -> None:
        i, written, fd = self.syncs.pop(k % len(self.syncs))
        sf = self.files[i]
        assert sf.fd == fd, f"file {i}'s descriptor changed while a sync held it"
        st_ = os.fstat(fd)
        assert (st_.st_dev, st_.st_ino) == (sf.dev, sf.ino), f"file {i}'s pinned descriptor is another file"
        os.fdatasync(fd)
        with self.cache.lock:
            sf.durable = max(sf.durable, written)
            sf.unpin()

    # -- the idle closer, the budget, other descriptors ---------------------------------------------

    @rule(later=st.sampled_from([0.0, IDLE / 4, IDLE + 0.1]))
    def the_idle_closer_looks(self, later: float) -> None:
        self.skew += later
        self.cache.close_idle(time.monotonic() + self.skew, IDLE)

    @rule(most=st.integers(0, FILES))
    def the_budget_trims(self, most: int) -> None:
        self.cache.trim(most)

    @rule()
    def the_shadow_opens_another_file(self) -> None:
        """(takes the lowest free number: one closed under a user is reused at once)"""
        self.others.append(os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY))

    @precondition(lambda self: self.others)
    @rule()
    def the_shadow_closes_another_file(self) -> None:
        os.close(self.others.pop())

    # -- sessions -----------------------------------------------------------------------------

    @rule(i=st.integers(0, FILES - 1))
    def a_session_ends(self, i: int) -> None:
        """As Shadow's session end: the cache forgets the file and
        JobFiles.close closes it, or orphans it while a sync holds it."""
        sf = self.files[i]
        if not self.live[i]:
            return
        self.live[i] = False
        self.cache.forget(sf)
        with self.cache.lock:
            if sf.pins:
                sf.orphaned = True
            else:
                sf.close()

    # -- what must hold after every step -----------------------------------------------------------

    @invariant()
    def every_open_descriptor_is_its_own_file(self) -> None:
        for i, sf in enumerate(self.files):
            if sf.fd >= 0:
                st_ = os.fstat(sf.fd)
                assert (st_.st_dev, st_.st_ino) == (sf.dev, sf.ino), f"file {i}'s descriptor is another file"

    @invariant()
    def what_must_stay_open_is_open(self) -> None:
        for i, sf in enumerate(self.files):
            if self.live[i] and (sf.written > sf.durable or sf.partial):
                assert sf.fd >= 0, f"file {i} was closed dirty (its own sync must see its writeback errors)"
            if sf.pins:
                assert sf.fd >= 0, f"file {i} was closed under a sync"
            if not self.live[i] and not sf.pins:
                assert sf.fd < 0, f"file {i} outlived its session and its syncs"

    @invariant()
    def the_cache_holds_the_open_files_of_live_sessions(self) -> None:
        held = set(self.cache.slots)
        assert held == {sf for i, sf in enumerate(self.files) if self.live[i] and sf.fd >= 0}
        assert set(self.cache.where) == held and len(self.cache) == len(held)

    @invariant()
    def every_file_holds_what_was_written_to_it(self) -> None:
        for i in range(FILES):
            assert (self.dir / f"job{i}" / "out").read_bytes() == self.whole[i] + self.piece[i], f"file {i}"


TestCacheAndItsUsers = CacheAndItsUsers.TestCase
TestCacheAndItsUsers.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_an_idle_closer_far_ahead_closes_every_clean_file_and_no_other(tmp_path: Path) -> None:
    """The closer's liveness: once the clock is past IDLE, every file that
    is clean, whole and unpinned is closed by one look, and none other."""
    root_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cache = FileCache(root_fd)
        files = []
        for i in range(4):
            sf = StreamFile(f"j{i}", 1, f"f{i}", open_confined(root_fd, f"f{i}", write=True), 0, 0)
            sf.identify()
            cache.add(sf)
            os.pwrite(sf.fd, b"x", 0)
            sf.written = 1
            files.append(sf)
        files[0].durable = 1  # clean
        files[1].durable, files[1].pins = 1, 1  # clean, being synced
        files[2].durable, files[2].partial = 1, True  # a frame half written
        # (files[3]: dirty)
        assert cache.close_idle(time.monotonic() + 0.5, IDLE) == 0, "nothing is idle yet"
        assert cache.close_idle(time.monotonic() + IDLE + 1, IDLE) == 1
        assert [sf.fd >= 0 for sf in files] == [False, True, True, True]
        for sf in files:
            sf.close()
    finally:
        os.close(root_fd)
