"""The shadow under fan-in: descriptor budget, file cache, group sync, receive path.

Real gcshadow processes under a low RLIMIT_NOFILE, spoken to by simulated
agents over loopback (and one real gcwrap), plus in-process checks of the
pieces: the file cache reopening files (and refusing files replaced behind
its back), syncfs against fdatasync, the rule that nothing is recorded or
acknowledged before it is synced, and the zero-copy frame parser.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import resource
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import Wrapper, drop_cap_sys_resource, tool, wait_until

from gcwrap.shadow import syncer as shadow_files
from gcwrap.shadow.files import FileCache, Problem, StoreError, StreamFile, open_confined
from gcwrap.shadow.pacing import GroupOptions
from gcwrap.shadow.receive import Buffers
from gcwrap.shadow.state import Store
from gcwrap.shadow.syncer import Syncer
from gcwrap.wire.events import Ack, Data, Done, Error, ErrorCode, Exit, Hello, StreamSpec, Welcome
from gcwrap.wire.protocol import MAGIC, NEED_DATA, Connection, Role, encode

NOFILE = 96  # the shadow's descriptor limit in the fan-in tests: far fewer than 2 per job


class LimitedShadow:
    """A real gcshadow whose RLIMIT_NOFILE (soft and hard) is `nofile`."""

    def __init__(self, root: Path, logdir: Path, nofile: int, extra: list[str] | None = None,
                 may_raise: bool = False) -> None:
        self.root, self.logdir, self.nofile = root, logdir, nofile
        port_file = logdir / "port"
        self.log_path = logdir / "shadow.log"

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
            if not may_raise:  # as root, the shadow would raise its hard limit: take that right away
                drop_cap_sys_resource()

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*tool("gcshadow"), "serve", "--port", "0", "--root", str(root), "--port-file", str(port_file),
                 "--min-free", "0", "-v", *(extra or [])],
                stdout=log, stderr=log, start_new_session=True, preexec_fn=limit,
            )

        def ready() -> bool:
            assert self.proc.poll() is None, self.log()
            return port_file.exists()

        wait_until(ready, 30, "gcshadow to listen")
        self.port = int(port_file.read_text())
        self.max_fds = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sample_fds(self) -> None:
        try:
            self.max_fds = max(self.max_fds, len(os.listdir(f"/proc/{self.proc.pid}/fd")))
        except OSError:
            pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def may_raise_limits() -> bool:
    """Whether this process has CAP_SYS_RESOURCE (root in a container may not)."""
    status = Path("/proc/self/status").read_text()
    m = re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M)
    return bool(m and int(m[1], 16) >> 24 & 1)


@pytest.fixture
def limited(home: Path, tmp_path: Path) -> Iterator[LimitedShadow]:
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = LimitedShadow(home, logs, NOFILE)
    try:
        yield sh
    finally:
        sh.stop()


def budget(text: str) -> dict[str, int]:
    m = re.search(r"descriptors: limit (\d+), (\d+) for sockets and files; up to (\d+) connections served", text)
    assert m, text
    return {"limit": int(m[1]), "avail": int(m[2]), "served": int(m[3])}


def payload(job: int, sid: int, n: int) -> bytes:
    return random.Random(job * 1000 + sid).randbytes(n)


class SimAgent:
    """One job over the wire protocol: two output streams, written in a few
    frames with pauses (so many jobs are connected at once); on BUSY it comes
    back after retry_after, as gcwrap does."""

    def __init__(self, port: int, job: int, size: int, frames: int, pause: float) -> None:
        self.port, self.job, self.size, self.frames, self.pause = port, job, size, frames, pause
        self.busy = 0
        self.data = {sid: payload(job, sid, size) for sid in (1, 2)}

    async def run(self) -> None:
        while True:
            stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            async with stream:
                conn = Connection(Role.AGENT)
                hello = Hello(job_id=f"fan-{self.job}", instance="i1", host="test",
                              streams=(StreamSpec(1, "stdout", f"fan/{self.job}.out"),
                                       StreamSpec(2, "stderr", f"fan/{self.job}.err")))
                await stream.send_all(conn.send(hello))
                ev = await self._next(stream, conn)
                if isinstance(ev, Error) and ev.code is ErrorCode.BUSY:
                    assert ev.retry_after > 0, ev
                    self.busy += 1
                    await trio.sleep(min(ev.retry_after, 2.0))
                    continue
                assert isinstance(ev, Welcome), ev
                await self._session(stream, conn, dict(ev.durable))
                return

    async def _next(self, stream: trio.SocketStream, conn: Connection) -> Any:
        while True:
            ev = conn.next_event()
            if ev is not NEED_DATA:
                return ev
            conn.receive_data(await stream.receive_some(65536))

    async def _session(self, stream: trio.SocketStream, conn: Connection, durable: dict[int, int]) -> None:
        acked = dict(durable)
        step = -(-self.size // self.frames)
        for k in range(self.frames):
            for sid, data in self.data.items():
                lo = max(k * step, durable.get(sid, 0))
                if lo < min((k + 1) * step, self.size):
                    await stream.send_all(conn.send(Data(sid, lo, data[lo:(k + 1) * step])))
            await trio.sleep(self.pause)
        while any(acked.get(sid, 0) < self.size for sid in self.data):
            ev = await self._next(stream, conn)
            assert isinstance(ev, Ack), ev
            assert ev.offset >= acked.get(ev.stream, 0)
            acked[ev.stream] = ev.offset
        await stream.send_all(conn.send(Exit(0, None, tuple((sid, self.size) for sid in self.data))))
        ev = await self._next(stream, conn)
        assert isinstance(ev, Done), ev


def no_descriptor_trouble(text: str) -> None:
    for bad in ("Too many open files", "EMFILE", "IO_ERROR", "I/O error", "internal error", "Traceback",
                "cannot accept"):
        assert bad not in text, f"{bad!r} in the shadow's log:\n{text[-3000:]}"


# -- a shadow with far fewer descriptors than its jobs need ---------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.skipif(not may_raise_limits(), reason="raising a hard limit needs CAP_SYS_RESOURCE")
def test_a_shadow_that_may_raises_its_hard_descriptor_limit(home: Path, tmp_path: Path) -> None:
    sh = LimitedShadow(home, tmp_path, 1024, may_raise=True)
    try:
        text = sh.log()
        want = min(1 << 16, int(Path("/proc/sys/fs/nr_open").read_text()))
        assert budget(text)["limit"] == want, text
        assert resource.prlimit(sh.proc.pid, resource.RLIMIT_NOFILE) == (want, want)
        assert "lets this shadow serve" not in text, text
    finally:
        sh.stop()


@pytest.mark.timeout(60)
def test_a_shadow_that_may_not_says_how_many_connections_it_serves(limited: LimitedShadow) -> None:
    text = limited.log()
    b = budget(text)
    assert b["limit"] == NOFILE, text
    line = next((x for x in text.splitlines() if "lets this shadow serve" in x), "")
    assert f"the descriptor limit ({NOFILE}) lets this shadow serve {b['served']} connections at once, not 20000" \
        in line, text
    assert "ulimit -Hn" in line


@pytest.mark.timeout(180)
def test_more_jobs_than_descriptors_all_land_the_excess_is_told_busy(limited: LimitedShadow, home: Path) -> None:
    b = budget(limited.log())
    jobs = 48  # 48 sockets + 96 files at once would need 1.5x the limit
    assert jobs > b["served"] and jobs * 3 > NOFILE, b
    agents = [SimAgent(limited.port, j, size=48 << 10, frames=6, pause=0.15) for j in range(jobs)]

    async def main() -> None:
        with trio.fail_after(150):
            async with trio.open_nursery() as nursery:
                for a in agents:
                    nursery.start_soon(a.run)
                while any(True for _ in nursery.child_tasks):
                    limited.sample_fds()
                    await trio.sleep(0.05)

    trio.run(main)
    for a in agents:
        for sid, data in a.data.items():
            landed = (home / "fan" / f"{a.job}.{'out' if sid == 1 else 'err'}").read_bytes()
            assert landed == data, f"job {a.job} stream {sid}: {len(landed)} bytes landed, {len(data)} sent"
    text = limited.log()
    assert sum(a.busy for a in agents) > 0, "no job was told BUSY: the test did not exceed the budget"
    assert "too many connections" in text
    no_descriptor_trouble(text)
    assert limited.max_fds <= NOFILE
    reopened = [int(m) for m in re.findall(r"the cache reopened (\d+)", text)]
    assert reopened and max(reopened) > 0, "files were never closed and reopened: the cache was not exercised"


@pytest.mark.timeout(180)
def test_a_real_gcwrap_told_busy_comes_back_and_lands(limited: LimitedShadow, home: Path, spool_dir: Path) -> None:
    """Hold every served connection with simulated jobs; a real gcwrap arriving
    then is told BUSY, retries, and lands once they have gone."""
    b = budget(limited.log())
    holders = [SimAgent(limited.port, j, size=8 << 10, frames=4, pause=1.0) for j in range(b["served"] + 2)]
    done = threading.Event()

    def hold() -> None:
        async def main() -> None:
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for a in holders:
                        nursery.start_soon(a.run)
        try:
            trio.run(main)
        finally:
            done.set()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    wait_until(lambda: limited.log().count("session 1") >= b["served"], 60, "the holders to connect")
    data = os.urandom(200_000)
    src = home.parent / "real-src"
    src.write_bytes(data)
    w = Wrapper(["--shadow", f"127.0.0.1:{limited.port}", "--spool", str(spool_dir), "--job-id", "real-1",
                 "--retry-timeout", "2", "--stdout", "real/out", "--", "cat", str(src)])
    assert w.wait(120) == 0, w.err.decode(errors="replace")
    t.join(130)
    assert done.is_set()
    assert (home / "real" / "out").read_bytes() == data
    text = limited.log()
    assert re.search(r"too many connections", text), text[-3000:]
    no_descriptor_trouble(text)
    for a in holders:
        assert (home / "fan" / f"{a.job}.out").read_bytes() == a.data[1]


# -- the file cache ------------------------------------------------------------------------------------


def _output(root_fd: int, name: str) -> StreamFile:
    fd = open_confined(root_fd, name, write=True)
    sf = StreamFile("job", 1, name, fd, 0, 0)
    sf.identify()
    return sf


def _write(sf: StreamFile, data: bytes) -> None:
    os.pwrite(sf.fd, data, sf.written)
    sf.written += len(data)


@pytest.mark.timeout(30)
def test_cache_closes_only_clean_unpinned_files_and_reopens_them(tmp_path: Path) -> None:
    root_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cache = FileCache(root_fd)
        files = [_output(root_fd, f"d/f{i}") for i in range(10)]
        for sf in files:
            cache.add(sf)
            _write(sf, b"a" * 10)
        files[0].durable = files[0].written  # clean
        files[1].durable = files[1].written
        files[1].pins = 1  # clean but in a sync batch
        cache.trim(0)
        assert files[0].fd < 0, "a clean file is closed"
        assert files[1].fd >= 0, "a pinned file is never closed"
        assert all(sf.fd >= 0 for sf in files[2:]), "dirty files are never closed"
        assert len(cache) == 9
        for sf in files:
            sf.durable, sf.pins = sf.written, 0
        cache.trim(3)
        assert len(cache) == 3 and sum(sf.fd >= 0 for sf in files) == 3
        # a closed file reopens where it was, confined, and goes on growing
        for sf in files:
            fd = cache.use(sf)
            assert fd >= 0 and os.fstat(fd).st_ino == sf.ino
            _write(sf, b"b" * 5)
            sf.durable = sf.written
            cache.trim(3)
        assert cache.reopened >= 7
        for i in range(10):
            assert (tmp_path / "d" / f"f{i}").read_bytes() == b"a" * 10 + b"b" * 5
    finally:
        os.close(root_fd)


@pytest.mark.timeout(30)
def test_cache_keeps_a_file_open_while_a_frame_is_half_written(tmp_path: Path) -> None:
    """Bytes of a DATA frame not yet whole are past `written`: the file looks
    clean, but its own sync must still see their writeback errors, so the
    cache does not close it until the frame is whole."""
    root_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cache = FileCache(root_fd)
        sf = _output(root_fd, "half")
        cache.add(sf)
        os.pwrite(sf.fd, b"first piece", 0)
        sf.partial = True
        cache.trim(0)
        assert sf.fd >= 0 and len(cache) == 1
        sf.partial = False
        cache.trim(0)
        assert sf.fd < 0 and len(cache) == 0
    finally:
        os.close(root_fd)


def test_read_buffers_are_lent_again_only_when_nothing_views_them() -> None:
    buffers = Buffers(size=64, cap=2)
    buf = buffers.take()
    assert buf is not None
    view = memoryview(buf)[:10]
    buffers.give(buf)
    assert buffers.free == [], "a buffer a payload still views is not lent again"
    del view
    buf = buffers.take()
    assert buf is not None and buffers.made == 2
    buffers.give(buf)
    assert buffers.free == [buf] and len(buf) == 64
    assert buffers.take() is buf and buffers.made == 2


def test_no_more_read_buffers_are_lent_than_the_cap() -> None:
    """Sessions that wait while acting on a read (10 000 EXITs waiting for
    their flush) hold at most `cap` buffers: past it a read gets its own."""
    buffers = Buffers(size=64, cap=3)
    lent = [buffers.take() for _ in range(3)]
    assert all(b is not None for b in lent) and buffers.take() is None
    buffers.give(lent.pop())  # type: ignore[arg-type]
    assert buffers.take() is not None and buffers.take() is None and buffers.made == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("change", ["removed", "replaced", "truncated", "symlinked"])
def test_cache_refuses_a_file_changed_while_closed(tmp_path: Path, change: str) -> None:
    root_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        cache = FileCache(root_fd)
        sf = _output(root_fd, "d/out")
        cache.add(sf)
        _write(sf, b"0123456789")
        sf.durable = sf.written
        cache.trim(0)
        assert sf.fd < 0
        path = tmp_path / "d" / "out"
        if change == "removed":
            path.unlink()
        elif change == "replaced":
            (tmp_path / "d" / "new").write_bytes(b"0123456789")
            (tmp_path / "d" / "new").replace(path)
        elif change == "truncated":
            os.truncate(path, 4)
        else:
            (tmp_path / "d").rename(tmp_path / "elsewhere")
            (tmp_path / "d").symlink_to(tmp_path / "elsewhere")
        with pytest.raises(StoreError) as info:
            cache.use(sf)
        want = Problem.FORBIDDEN_NAME if change == "symlinked" else Problem.CHANGED_AT_HOME
        assert info.value.problem is want, info.value
        assert sf.fd < 0
        assert not (change == "removed" and path.exists()), "a removed file is never created again"
    finally:
        os.close(root_fd)


# -- syncfs and fdatasync: nothing recorded that was not synced ----------------------------------------------


class Spy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, syncer: Syncer, fail: int | None = None) -> None:
        self.syncfs = 0
        self.fdatasync = 0
        real_fdatasync = os.fdatasync

        def fdatasync(fd: int) -> None:
            self.fdatasync += 1
            if fail is not None:
                raise OSError(fail, os.strerror(fail))
            real_fdatasync(fd)

        def syncfs(fd: int) -> None:
            self.syncfs += 1
            if fail is not None:
                raise OSError(fail, os.strerror(fail))

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        syncer.syncfs = syncfs


def _job(store: Store, name: str, n: int) -> list[StreamFile]:
    files = store.open_job(job_id=name, instance="i", host="h", user="u", command=[], peer="p",
                           streams=[StreamSpec(i, "stdout", f"{name}/{i}") for i in range(n)])
    return list(files.outputs.values())


def _db_durable(root: Path) -> dict[tuple[str, int], int]:
    db = sqlite3.connect(f"file:{root / '.gcshadow' / 'state.db'}?mode=ro", uri=True)
    try:
        return {(j, s): d for j, s, d in db.execute("SELECT job_id, stream, durable FROM streams")}
    finally:
        db.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nfiles", [1, shadow_files.SYNCFS_MIN - 1, shadow_files.SYNCFS_MIN, 40])
def test_make_durable_syncs_then_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nfiles: int) -> None:
    store = Store(tmp_path)
    try:
        spy = Spy(monkeypatch, store.syncer)
        files = _job(store, "j", nfiles)
        for sf in files:
            _write(sf, b"x" * 100)
        results, db_error = store.make_durable([(sf, sf.written) for sf in files])
        assert db_error == "" and all(err is None for _, _, err in results)
        if nfiles >= shadow_files.SYNCFS_MIN:
            assert (spy.syncfs, spy.fdatasync) == (1, 0), "many dirty files: one syncfs"
        else:
            assert (spy.syncfs, spy.fdatasync) == (0, nfiles), "few dirty files: fdatasync each"
        assert _db_durable(tmp_path) == {("j", sf.stream): 100 for sf in files}
    finally:
        store.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nfiles", [1, 40])
def test_a_failed_sync_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nfiles: int) -> None:
    store = Store(tmp_path)
    try:
        files = _job(store, "j", nfiles)
        Spy(monkeypatch, store.syncer, fail=errno.EIO)
        for sf in files:
            _write(sf, b"x" * 100)
        results, _ = store.make_durable([(sf, sf.written) for sf in files])
        assert len(results) == nfiles and all(isinstance(err, OSError) for _, _, err in results)
        assert set(_db_durable(tmp_path).values()) == {0}
    finally:
        store.close()


@pytest.mark.timeout(30)
def test_a_file_on_another_file_system_is_fdatasynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path)
    try:
        spy = Spy(monkeypatch, store.syncer)
        files = _job(store, "j", 6)
        files[0].dev = store.syncer.root_dev + 1  # as if a mount below the root held it
        for sf in files:
            _write(sf, b"y")
        store.make_durable([(sf, sf.written) for sf in files])
        assert (spy.syncfs, spy.fdatasync) == (1, 1)
    finally:
        store.close()


@pytest.mark.timeout(60)
def test_a_file_whose_sync_failed_is_never_acknowledged_later(tmp_path: Path) -> None:
    """The durability thread starts the next batch before the event loop has
    seen the previous one fail. After a reported writeback error a later
    fdatasync can succeed although the bytes are gone: the file must not be
    synced or recorded again, and its job must be fenced."""
    from gcwrap.shadow.durability import Durability, LiveJob

    store = Store(tmp_path)
    calls: list[int] = []
    first_started, release_first = threading.Event(), threading.Event()
    real_sync = store.syncer.sync

    def sync(files: list[tuple[StreamFile, int]]) -> list[tuple[StreamFile, int, OSError | None]]:
        calls.append(len(files))
        if len(calls) == 1:
            first_started.set()
            release_first.wait(10)
            return [(sf, n, OSError(errno.EIO, "Input/output error")) for sf, n in files]
        return real_sync(files)

    store.syncer.sync = sync  # type: ignore[method-assign]
    try:
        files = store.open_job(job_id="j", instance="i", host="h", user="u", command=[], peer="p",
                               streams=[StreamSpec(1, "stdout", "out")])
        sf = files.outputs[1]

        async def main() -> None:
            with trio.fail_after(30):
                durability = Durability(store)
                job = LiveJob("j")
                job.files = files
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(durability.run)
                    _write(sf, b"first")
                    durability.mark(sf, job)
                    await trio.to_thread.run_sync(first_started.wait, 10)
                    _write(sf, b"second")  # marked while the failing batch is in flight
                    durability.mark(sf, job)
                    release_first.set()
                    while durability.batches < 2:
                        await durability.done.wait()
                    assert job.fenced and "could not sync" in job.fenced
                    assert sf.durable == 0
                    nursery.cancel_scope.cancel()

        trio.run(main)
        assert calls == [1], "the failed file was synced again"
        assert _db_durable(tmp_path) == {("j", 1): 0}
        assert (tmp_path / "out").stat().st_size == 0, "cut back to the durable length"
    finally:
        files.close()
        store.close()


# -- durable groups under bulk output ---------------------------------------------------------------------


def _grouping(tmp_path: Path, steps: Any) -> list[int]:
    """Run `steps(durability, job, sf)` against a real Store's Durability,
    with the fill bounds in time set far out (so only bytes, a flush or
    small batches can end a wait); the length each batch synced the file to."""
    from gcwrap.shadow import durability as dmod

    store = Store(tmp_path)
    synced: list[int] = []
    real_sync = store.syncer.sync

    def sync(files: list[tuple[StreamFile, int]]) -> list[tuple[StreamFile, int, OSError | None]]:
        synced.append(sum(n for _, n in files))
        return real_sync(files)

    store.syncer.sync = sync  # type: ignore[method-assign]
    files = store.open_job(job_id="j", instance="i", host="h", user="u", command=[], peer="p",
                           streams=[StreamSpec(1, "stdout", "out")])
    try:
        async def main() -> None:
            with trio.fail_after(30):
                durability = dmod.Durability(store, GroupOptions(interval=60.0, idle=60.0))
                job = dmod.LiveJob("j")
                job.files = files
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(durability.run)
                    await steps(durability, job, files.outputs[1])
                    nursery.cancel_scope.cancel()

        trio.run(main)
    finally:
        files.close()
        store.close()
    return synced


async def _mark(durability: Any, job: Any, sf: StreamFile, n: int) -> None:
    _write(sf, b"x" * n)
    durability.mark(sf, job, n)


@pytest.mark.timeout(60)
def test_small_batches_never_wait_to_fill(tmp_path: Path) -> None:
    """Line output and small agents: each frame is synced as it comes, with
    the time bounds of a bulk batch a minute away."""
    async def steps(durability: Any, job: Any, sf: StreamFile) -> None:
        for i in range(1, 4):
            await _mark(durability, job, sf, 100)
            while sf.durable < 100 * i:
                await job.durable_changed.wait()

    assert _grouping(tmp_path, steps) == [100, 200, 300]


@pytest.mark.timeout(60)
def test_under_bulk_output_a_batch_waits_to_fill(tmp_path: Path) -> None:
    """After a batch of `GroupOptions.bulk` bytes or more, the next one waits
    for `GroupOptions.full` (with the time bounds a minute away): whole frames
    marked one by one are synced together; a flush takes the batch at once."""
    bulk, full = GroupOptions().bulk, GroupOptions().full
    mib = 1 << 20

    async def steps(durability: Any, job: Any, sf: StreamFile) -> None:
        await _mark(durability, job, sf, bulk)
        while sf.durable < bulk:
            await job.durable_changed.wait()
        for _ in range(full // mib - 1):
            await _mark(durability, job, sf, mib)
        await trio.to_thread.run_sync(wait_until, lambda: durability.filling, 10, "the batch waiting to fill")
        assert durability.batches == 1
        await _mark(durability, job, sf, mib)  # a full batch pending: it goes
        while sf.durable < bulk + full:
            await job.durable_changed.wait()
        await _mark(durability, job, sf, 10)
        await trio.to_thread.run_sync(wait_until, lambda: durability.filling, 10, "the next batch waiting to fill")
        await durability.flush(job)  # EXIT, or the shadow stopping: no waiting to fill
        assert sf.durable == bulk + full + 10

    assert _grouping(tmp_path, steps) == [bulk, bulk + full, bulk + full + 10]


# -- acknowledgements never run ahead of the state database, on either sync path -------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("jobs", [1, 12])
def test_every_ack_is_recorded_and_on_disk_when_it_arrives(
        limited: LimitedShadow, home: Path, jobs: int) -> None:
    """One job: fdatasync batches; twelve at once: syncfs batches. Whenever an
    ACK arrives, the state database already holds at least that length."""
    lag: list[tuple[int, int, int]] = []

    async def agent(j: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", limited.port)
        async with stream:
            conn = Connection(Role.AGENT)
            await stream.send_all(conn.send(Hello(job_id=f"ack-{j}", instance="i", host="t",
                                                  streams=(StreamSpec(1, "stdout", f"ack/{j}"),))))
            conn.receive_data(await stream.receive_some(65536))
            assert isinstance(conn.next_event(), Welcome)
            connected.append(j)
            if len(connected) == jobs:
                start.set()
            data = payload(j, 1, 64 << 10)
            await start.wait()  # all connected: their frames overlap, so batches hold many files
            for k in range(0, len(data), 4096):
                await stream.send_all(conn.send(Data(1, k, data[k:k + 4096])))
                await trio.sleep(0.01)
            acked = 0
            while acked < len(data):
                ev = conn.next_event()
                if ev is NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                    continue
                assert isinstance(ev, Ack), ev
                acked = ev.offset
                recorded = _db_durable(home).get((f"ack-{j}", 1), 0)
                size = (home / "ack" / str(j)).stat().st_size
                if recorded < acked or size < acked:
                    lag.append((acked, recorded, size))
            await stream.send_all(conn.send(Exit(0, None, ((1, len(data)),))))

    async def main() -> None:
        with trio.fail_after(100):
            async with trio.open_nursery() as nursery:
                for j in range(jobs):
                    nursery.start_soon(agent, j)

    connected: list[int] = []
    start = trio.Event()
    trio.run(main)
    assert not lag, f"ACKs ahead of the state database or the file: {lag[:5]}"
    wait_until(lambda: len(re.findall(r"job ack-\d+: files closed", limited.log())) == jobs, 10, "the shadow's log")
    counts = re.findall(r"(\d+) syncfs, (\d+) fdatasync", limited.log())
    syncfs, fdatasync = map(int, counts[-1])
    if jobs == 1:
        assert fdatasync > 0 and syncfs == 0, counts
    elif shadow_files._load_syncfs() is not None:
        assert syncfs > 0, counts
    no_descriptor_trouble(limited.log())


# -- the receive path ------------------------------------------------------------------------------------


def _streaming_shadow() -> Connection:
    shadow = Connection(Role.SHADOW)
    shadow.receive_data(MAGIC + encode(Hello("j", "i", (StreamSpec(1, "stdout", "o"),))))
    assert isinstance(shadow.next_event(), Hello)
    shadow.send(Welcome(1, 1, ((1, 0),), 10.0))
    return shadow


@pytest.mark.timeout(30)
def test_data_payloads_are_views_of_the_received_bytes() -> None:
    shadow = _streaming_shadow()
    frames = [encode(Data(1, i * 1000, bytes([i]) * 1000)) for i in range(5)]
    chunk = b"".join(frames)
    shadow.receive_data(chunk)
    events = [shadow.next_event() for _ in range(5)]
    assert shadow.next_event() is NEED_DATA and shadow.buffered == 0
    for i, ev in enumerate(events):
        assert isinstance(ev, Data) and ev == Data(1, i * 1000, bytes([i]) * 1000)
        assert isinstance(ev.payload, memoryview) and ev.payload.readonly and ev.payload.obj is chunk


@pytest.mark.timeout(30)
def test_a_frame_across_reads_is_copied_once_and_small_tails_do_not_pin_chunks() -> None:
    shadow = _streaming_shadow()
    big = os.urandom(1 << 20)
    wire = encode(Data(1, 0, big)) + encode(Data(1, len(big), b"tail"))
    reads = [wire[i:i + 120_000] for i in range(0, len(wire), 120_000)]
    got = []
    for r in reads:
        shadow.receive_data(r)
        while (ev := shadow.next_event()) is not NEED_DATA:
            got.append(ev)
        # what waits for the next read never keeps a whole chunk for a small piece of it
        for part in shadow._parts:
            if isinstance(part, memoryview):
                assert 2 * len(part) >= memoryview(part.obj).nbytes, "a small tail keeps its whole chunk alive"
    assert got == [Data(1, 0, big), Data(1, len(big), b"tail")]
    assert shadow.buffered == 0

    # a header and a frame split into a tiny piece then a large one
    shadow.receive_data(encode(Data(1, len(big) + 4, b"z" * 10_000))[:3])
    assert shadow.next_event() is NEED_DATA
    shadow.receive_data(encode(Data(1, len(big) + 4, b"z" * 10_000))[3:])
    assert shadow.next_event() == Data(1, len(big) + 4, b"z" * 10_000)


@pytest.mark.timeout(30)
def test_names_the_shadow_made_are_synced_in_their_directories_once(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A file's fdatasync() does not make its name durable (POSIX; ext4 and
    XFS happen to): before the first bytes of a file the shadow created are
    recorded durable, each directory holding a name it made (the file's,
    and those of directories made on its path) is fsynced, once however
    many files it holds; a failure there fails the files that need it. A
    job whose files exist already costs no directory sync."""
    store = Store(tmp_path)
    try:
        files = list(store.open_job(job_id="j", instance="i", host="h", user="u", command=[], peer="p", streams=[
            StreamSpec(1, "stdout", "d1/d2/out"), StreamSpec(2, "stderr", "top.err")]).outputs.values())
        assert [sf.new_entries for sf in files] == [("", "d1", "d1/d2"), ("",)]
        synced: list[str] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        for sf in files:
            _write(sf, b"x" * 10)
        results, db_error = store.make_durable([(sf, sf.written) for sf in files])
        assert db_error == "" and all(err is None for _, _, err in results)
        assert sorted(synced) == sorted(str(tmp_path / d) for d in ("", "d1", "d1/d2")), synced
        assert store.syncer.stats["dirsync"] == 3 and [sf.new_entries for sf in files] == [(), ()]
        for sf in files:
            _write(sf, b"y" * 10)
        store.make_durable([(sf, sf.written) for sf in files])
        assert len(synced) == 3, "synced once"
        # A directory sync that fails fails the files that need it, and nothing of them is recorded.
        more = list(store.open_job(job_id="k", instance="i", host="h", user="u", command=[], peer="p", streams=[
            StreamSpec(1, "stdout", "k/out"), StreamSpec(2, "stderr", "d1/k.err")]).outputs.values())
        assert [sf.new_entries for sf in more] == [("", "k"), ("d1",)]

        def failing(fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "k"):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", failing)
        for sf in more:
            _write(sf, b"z" * 10)
        results, _ = store.make_durable([(sf, sf.written) for sf in more])
        errors = {sf.name: err for sf, _, err in results}
        assert isinstance(errors["k/out"], OSError) and errors["d1/k.err"] is None, errors
        assert _db_durable(tmp_path)[("k", 1)] == 0 and _db_durable(tmp_path)[("k", 2)] == 10
    finally:
        store.close()
    # The same job again (its files exist): nothing to sync but its bytes.
    store = Store(tmp_path)
    try:
        again = store.open_job(job_id="j", instance="i", host="h", user="u", command=[], peer="p", streams=[
            StreamSpec(1, "stdout", "d1/d2/out"), StreamSpec(2, "stderr", "top.err")])
        assert [sf.new_entries for sf in again.outputs.values()] == [(), ()]
    finally:
        store.close()


# -- idle jobs hold their sockets alone ----------------------------------------------------------------


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _files_open(pid: int, under: Path) -> int:
    """The shadow's descriptors of files under `under` (the jobs' files)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{under}/")
        except OSError:
            pass
    return n


async def _until(cond: Any, timeout: float, what: str) -> None:
    with trio.move_on_after(timeout):
        while not cond():
            await trio.sleep(0.05)
        return
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class IdleAgent:
    """One job with one output over the wire protocol, driven a step at a time."""

    def __init__(self, port: int, job: int) -> None:
        self.port, self.job = port, job
        self.data = random.Random(job).randbytes(3 * 4096)
        self.sent = 0
        self.conn = Connection(Role.AGENT)
        self.stream: trio.SocketStream | None = None

    async def next(self) -> Any:
        assert self.stream is not None
        while True:
            ev = self.conn.next_event()
            if ev is not NEED_DATA:
                return ev
            self.conn.receive_data(await self.stream.receive_some(65536))

    async def connect(self) -> None:
        self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        await self.stream.send_all(self.conn.send(Hello(job_id=f"idle-{self.job}", instance="i1", host="test",
                                                        streams=(StreamSpec(1, "stdout", f"idle/{self.job}.out"),))))
        ev = await self.next()
        assert isinstance(ev, Welcome), ev

    async def send(self, n: int) -> None:
        assert self.stream is not None
        end = self.sent + n
        await self.stream.send_all(self.conn.send(Data(1, self.sent, self.data[self.sent:end])))
        self.sent = end
        while True:
            ev = await self.next()
            assert isinstance(ev, Ack), ev
            if ev.offset == end:
                return

    async def exit(self) -> None:
        assert self.stream is not None
        await self.stream.send_all(self.conn.send(Exit(0, None, ((1, self.sent),))))
        ev = await self.next()
        assert isinstance(ev, Done), ev
        await self.stream.aclose()


@pytest.mark.timeout(150)
def test_idle_jobs_hold_their_sockets_alone_and_their_files_reopen_exactly(home: Path, tmp_path: Path) -> None:
    """300 connected jobs, idle between writes: the shadow closes their files
    (a descriptor per job, not two), reopens them for the next write, and
    every byte lands where it was sent."""
    jobs = 300
    sh = LimitedShadow(home, tmp_path, 2048)  # (room for every file: only idleness closes them)
    try:
        pid = sh.proc.pid
        base = _fds(pid)
        agents = [IdleAgent(sh.port, j) for j in range(jobs)]

        async def each(step: Any) -> None:
            async with trio.open_nursery() as nursery:
                for a in agents:
                    nursery.start_soon(step, a)

        async def main() -> None:
            with trio.fail_after(120):
                await each(IdleAgent.connect)
                for _ in range(2):
                    await each(lambda a: a.send(4096))
                    assert _files_open(pid, home / "idle") > 0  # (the job that just wrote has its file open)
                    await _until(lambda: _files_open(pid, home / "idle") == 0, 30, "the idle jobs' files to be closed")
                    held = _fds(pid)
                    assert held <= base + jobs + 16, f"{held} descriptors for {jobs} idle jobs ({base} at start)"
                await each(lambda a: a.send(4096))
                await each(IdleAgent.exit)

        trio.run(main)
        for a in agents:
            landed = (home / "idle" / f"{a.job}.out").read_bytes()
            assert hashlib.sha256(landed).digest() == hashlib.sha256(a.data).digest(), f"job {a.job}"
        no_descriptor_trouble(sh.log())
    finally:
        sh.stop()


def _fd_of(pid: int, path: Path) -> int | None:
    """The shadow's descriptor number of the file at `path`, if it has it open."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return int(fd)
        except OSError:
            pass
    return None


@pytest.mark.timeout(90)
def test_a_frame_that_stalls_after_its_header_lands_in_its_own_file(home: Path, tmp_path: Path) -> None:
    """The idle closer against a connection waiting in the middle of a frame:
    job A's DATA header arrives, its payload (large: spliced from the socket)
    does not for longer than the idle close; the clean file is closed under
    the waiting connection, and the jobs connecting meanwhile take its
    descriptor number (a socket's or a file's). A's payload then lands in
    A's file (reopened), none of it elsewhere. (Each step is awaited on what
    the shadow shows in /proc: A's file closed, its number taken.)"""
    sh = LimitedShadow(home, tmp_path, 2048)
    try:
        pid = sh.proc.pid
        a, others = IdleAgent(sh.port, 0), [IdleAgent(sh.port, j) for j in (1, 2, 3)]
        a.data = random.Random(7).randbytes(4096 + 512 * 1024)
        a_file = home / "idle" / "0.out"

        async def main() -> None:
            with trio.fail_after(60):
                await a.connect()
                await a.send(4096)  # (the file exists and is clean, everything durable)
                assert a.stream is not None
                frame = a.conn.send(Data(1, 4096, a.data[4096:]))
                head = len(frame) - (len(a.data) - 4096)
                number = _fd_of(pid, a_file)
                assert number is not None
                await a.stream.send_all(frame[:head])
                await _until(lambda: _fd_of(pid, a_file) is None, 30, "A's file to be closed while it waits")
                for o in others:  # (a socket and a file each: the lowest free numbers are taken)
                    await o.connect()
                    await o.send(4096)
                taken = os.readlink(f"/proc/{pid}/fd/{number}")
                assert taken != str(a_file), "(A's file is closed)"
                await a.stream.send_all(frame[head:])
                a.sent = len(a.data)
                while True:
                    ev = await a.next()
                    assert isinstance(ev, Ack), f"A's frame, completed: {ev}"
                    if ev.offset == len(a.data):
                        break
                for o in others:
                    await o.send(4096)
                    await o.exit()
                await a.exit()

        trio.run(main)
        assert a_file.read_bytes() == a.data, "A's frame landed whole in A's file"
        for o in others:
            assert (home / "idle" / f"{o.job}.out").read_bytes() == o.data[:8192], f"job {o.job}'s file holds its own"
        no_descriptor_trouble(sh.log())
    finally:
        sh.stop()


@pytest.mark.timeout(60)
def test_a_file_replaced_while_its_job_is_idle_is_refused(home: Path, tmp_path: Path) -> None:
    """An idle job's file is closed; replaced at home meanwhile (the same
    bytes, another file), it is not reopened: the next write is refused
    and the file at home is left as it was."""
    sh = LimitedShadow(home, tmp_path, 256)
    try:
        a = IdleAgent(sh.port, 1)
        path = home / "idle" / "1.out"

        async def main() -> None:
            with trio.fail_after(45):
                await a.connect()
                await a.send(4096)
                pid = sh.proc.pid
                await _until(lambda: _files_open(pid, home / "idle") == 0, 30, "the idle job's file to be closed")
                other = path.with_name("other")
                other.write_bytes(path.read_bytes())
                other.replace(path)
                assert a.stream is not None
                await a.stream.send_all(a.conn.send(Data(1, 4096, a.data[4096:8192])))
                ev = await a.next()
                await a.stream.aclose()
                assert isinstance(ev, Error) and ev.code is ErrorCode.LENGTH_MISMATCH, ev

        trio.run(main)
        assert path.read_bytes() == a.data[:4096]
        assert "replaced at home while in use" in sh.log()
    finally:
        sh.stop()
