"""A file system whose reads or syncs hang until the test says so (FUSE, in process).

A hung NFS server makes a read, or an fsync, block in the kernel for as
long as it is away; FUSE does the same thing for real: every read, write
and sync of a file here is a request this process answers, and while a
gate is closed it does not. The process using the file waits in pread(2)
or fdatasync(2) exactly as it would on a dead NFS mount (and, as on a
mount with `intr`, a signal that ends the process ends the wait).

One directory of regular files, kept in memory. It speaks the kernel's
FUSE protocol directly (/dev/fuse, mount(2)): no library, no helper
program; it needs root (`available()` says whether it can run here).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import select
import struct
import threading
import time
from pathlib import Path

IN_HEADER = struct.Struct("=IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("=IiQ")  # len, error, unique
# ino, size, blocks, [amc]time, [amc]timensec, mode, nlink, uid, gid, rdev, blksize, flags
ATTR = struct.Struct("=QQQQQQIIIIIIIIII")
ENTRY = struct.Struct("=QQQQII")  # nodeid, generation, entry_valid, attr_valid, *_nsec (then the attributes)
OPEN_OUT = struct.Struct("=QII")  # fh, open_flags, padding
IO_IN = struct.Struct("=QQII")  # fh, offset, size, flags: the head of a READ's and a WRITE's request
SETATTR_IN = struct.Struct("=IIQQ")  # valid, padding, fh, size (the rest unused here)
CREATE_IN = struct.Struct("=IIII")  # flags, mode, umask, open_flags (then the name)
WRITE_HEAD = 40  # sizeof(struct fuse_write_in): the data follows

LOOKUP, FORGET, GETATTR, SETATTR, OPEN, READ, WRITE, STATFS, RELEASE = 1, 2, 3, 4, 14, 15, 16, 17, 18
FSYNC, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, ACCESS = 20, 25, 26, 27, 28, 29, 30, 34
CREATE, INTERRUPT, DESTROY, BATCH_FORGET = 35, 36, 38, 42
NO_REPLY = {FORGET, BATCH_FORGET}
FOPEN_DIRECT_IO = 1  # every read goes to the file system, none is served from the page cache
FATTR_SIZE = 1 << 3
ROOT = 1


def available() -> str:
    """Why a FUSE file system cannot be mounted here, or ""."""
    if os.geteuid() != 0:
        return "mounting needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return ""


class Gate:
    """Requests of one kind held while closed (their answers wait)."""

    def __init__(self, closed: bool) -> None:
        self.open = not closed
        self.held: list[tuple[int, bytes]] = []  # (unique, the answer's body)
        self.seen = 0


class SlowFS:
    """Mounted at `mountpoint` (an empty directory) holding `files` (name ->
    content; more are created by whoever writes). Reads wait while `reads`
    is closed, fsyncs while `syncs` is; `release` opens both, and `close`
    answers what is held and unmounts."""

    def __init__(self, mountpoint: Path, files: dict[str, bytes], *, hang_reads: bool = False,
                 hang_syncs: bool = False, fail_reads: bool = False) -> None:
        self.mountpoint = mountpoint
        self.fail_reads = fail_reads  # every read answered EIO (a disk or a server that fails)
        self.names: dict[bytes, int] = {}
        self.data: dict[int, bytearray] = {}
        for name, content in files.items():
            self._make(name.encode(), content)
        self.reads = Gate(hang_reads)
        self.syncs = Gate(hang_syncs)
        self.lock = threading.Lock()
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        self.wake_r, self.wake_w = os.pipe()
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, name="slow-fs", daemon=True)
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        if self._libc.mount(b"slowfs", str(mountpoint).encode(), b"fuse", 0, opts) != 0:
            err = ctypes.get_errno()
            for fd in (self.fd, self.wake_r, self.wake_w):
                os.close(fd)
            raise OSError(err, f"mount -t fuse {mountpoint}: {os.strerror(err)}")
        self.thread.start()  # (once mounted: /dev/fuse refuses reads before)

    def waiting(self, gate: Gate) -> int:
        """How many requests the gate holds now."""
        with self.lock:
            return len(gate.held)

    def release(self) -> None:
        """Open both gates: answer what they hold, and every later request at once."""
        for gate in (self.reads, self.syncs):
            with self.lock:
                gate.open = True
                held, gate.held = gate.held, []
            for unique, body in held:
                self._reply(unique, body)

    def close(self) -> None:
        self.release()
        self._libc.umount2(str(self.mountpoint).encode(), 2)  # MNT_DETACH
        self.stopping = True
        os.write(self.wake_w, b"x")
        self.thread.join(10)
        for fd in (self.fd, self.wake_r, self.wake_w):
            os.close(fd)

    def __enter__(self) -> SlowFS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the protocol -------------------------------------------------------------

    def _make(self, name: bytes, content: bytes = b"") -> int:
        node = len(self.data) + 2
        self.names[name] = node
        self.data[node] = bytearray(content)
        return node

    def _reply(self, unique: int, body: bytes = b"", error: int = 0) -> None:
        try:
            os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error, unique) + body)
        except OSError:
            pass  # (the request was interrupted, or the file system is gone)

    def _attr(self, node: int) -> bytes:
        now = int(time.time())
        if node == ROOT:
            return ATTR.pack(ROOT, 0, 0, now, now, now, 0, 0, 0, 0o40755, 2, 0, 0, 0, 4096, 0)
        size = len(self.data[node])
        return ATTR.pack(node, size, (size + 511) // 512, now, now, now, 0, 0, 0, 0o100644, 1, 0, 0, 0, 4096, 0)

    def _entry(self, node: int) -> bytes:
        return ENTRY.pack(node, 0, 0, 0, 0, 0) + self._attr(node)  # (valid for no time: sizes change)

    def _hold(self, gate: Gate, unique: int, body: bytes) -> None:
        with self.lock:
            gate.seen += 1
            if not gate.open:
                gate.held.append((unique, body))
                return
        self._reply(unique, body)

    def _serve(self) -> None:
        poll = select.poll()
        poll.register(self.fd, select.POLLIN)
        poll.register(self.wake_r, select.POLLIN)
        while not self.stopping:
            if not poll.poll(1000) or self.stopping:
                continue
            try:
                req = os.read(self.fd, (1 << 20) + 4096)
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue
                return  # ENODEV: unmounted
            self._handle(req)

    def _handle(self, req: bytes) -> None:
        _, opcode, unique, node, *_ = IN_HEADER.unpack_from(req)
        body = req[IN_HEADER.size:]
        if opcode in NO_REPLY:
            return
        if opcode == INTERRUPT:  # (a signal, such as the one that ends the process: a held request ends with EINTR)
            (target,) = struct.unpack_from("=Q", body)
            for gate in (self.reads, self.syncs):
                with self.lock:
                    found = [h for h in gate.held if h[0] == target]
                    gate.held = [h for h in gate.held if h[0] != target]
                if found:
                    self._reply(target, error=errno.EINTR)
            return
        if opcode == INIT:
            # major 7, minor 31; max_readahead, flags, max_background, congestion, max_write, time_gran, max_pages
            self._reply(unique, struct.pack("=IIIIHHIIHH", 7, 31, 0, 0, 16, 12, 1 << 20, 1, 256, 0).ljust(64, b"\0"))
        elif opcode == LOOKUP:
            found = self.names.get(body.rstrip(b"\0")) if node == ROOT else None
            if found is None:
                self._reply(unique, error=errno.ENOENT)
            else:
                self._reply(unique, self._entry(found))
        elif opcode == GETATTR:
            self._reply(unique, struct.pack("=QII", 0, 0, 0) + self._attr(node))
        elif opcode == SETATTR:
            valid, _, _, size = SETATTR_IN.unpack_from(body)
            if valid & FATTR_SIZE:
                del self.data[node][size:]
                self.data[node].extend(bytes(size - len(self.data[node])))
            self._reply(unique, struct.pack("=QII", 0, 0, 0) + self._attr(node))
        elif opcode in (OPEN, OPENDIR):
            self._reply(unique, OPEN_OUT.pack(0, FOPEN_DIRECT_IO if opcode == OPEN else 0, 0))
        elif opcode == CREATE:
            name = body[CREATE_IN.size:].split(b"\0")[0]
            if name in self.names:
                self._reply(unique, error=errno.EEXIST)
            else:
                self._reply(unique, self._entry(self._make(name)) + OPEN_OUT.pack(0, FOPEN_DIRECT_IO, 0))
        elif opcode == READ and self.fail_reads:
            self._reply(unique, error=errno.EIO)
        elif opcode == READ:
            _, offset, size, _ = IO_IN.unpack_from(body)
            self._hold(self.reads, unique, bytes(self.data[node][offset:offset + size]))
        elif opcode == WRITE:
            _, offset, size, _ = IO_IN.unpack_from(body)
            content = self.data[node]
            if len(content) < offset:
                content.extend(bytes(offset - len(content)))
            content[offset:offset + size] = body[WRITE_HEAD:WRITE_HEAD + size]
            self._reply(unique, struct.pack("=II", size, 0))
        elif opcode == FSYNC:
            self._hold(self.syncs, unique, b"")
        elif opcode == READDIR:
            self._reply(unique)  # (empty: nobody lists it)
        elif opcode == STATFS:
            self._reply(unique, struct.pack("=QQQQQIII", 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 4096, 255,
                                            4096).ljust(80, b"\0"))
        elif opcode in (RELEASE, RELEASEDIR, FLUSH, ACCESS, FSYNCDIR):
            self._reply(unique)
        elif opcode == DESTROY:
            self._reply(unique)
            self.stopping = True
        else:
            self._reply(unique, error=errno.ENOSYS)
