"""A test job: writes known pseudo-random bytes to stdout and stderr.

The bytes of each stream are `random.Random(seed).randbytes(n)` (stdout) and
`random.Random(seed + 1).randbytes(n)` (stderr), written interleaved in
chunks of varying size, so a test can compute the expected sha256 itself.

    genjob.py --out N --err M --seed S [--rate BYTES_PER_S] [--exit K | --signal SIG]
              [--done-file PATH] [--timestamps PATH] [--term-report PATH]
              [--copy-stdin PATH [--stdin-rate BYTES_PER_S]]

With --term-report, SIGTERM (or SIGINT, or SIGHUP: what a batch system or a
user sends) ends the job exactly: it is held blocked, the writes are
non-blocking, and once one is pending the job writes to PATH how many bytes
of stdout and stderr it has written ("OUT ERR"), then dies of it.

With --copy-stdin, a thread reads stdin (at --stdin-rate, if given) into
PATH while the job writes, and the job ends only once stdin is at its end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import select
import signal
import sys
import threading
import time

WRITTEN = {1: 0, 2: 0}  # bytes written so far, per descriptor
TERM_REPORT = ""  # see --term-report
TERM_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def end_if_terminated() -> None:
    pending = TERM_SIGNALS & signal.sigpending() if TERM_REPORT else set()
    if pending:
        with open(TERM_REPORT, "w") as f:
            f.write(f"{WRITTEN[1]} {WRITTEN[2]}\n")
        for signum in pending:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, pending)
        signal.pause()


def write_all(fd: int, data: memoryview) -> None:
    while data:
        end_if_terminated()
        try:
            n = os.write(fd, data)
        except BlockingIOError:
            select.select([], [fd], [], 0.05)
            continue
        data = data[n:]
        WRITTEN[fd] += n


def copy_stdin(path: str, rate: float) -> None:
    """Read stdin to its end into `path`, at most `rate` bytes per second (0: as fast as it comes)."""
    got = 0
    start = time.monotonic()
    with open(path, "wb", buffering=0) as f:
        while data := os.read(0, 16384):
            f.write(data)
            got += len(data)
            if rate:
                ahead = got / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=int, default=0)
    p.add_argument("--err", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rate", type=float, default=0.0, help="bytes per second in all (0: as fast as possible)")
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--signal", type=int, default=0)
    p.add_argument("--done-file", default="")
    p.add_argument("--timestamps", default="", help="append a wall-clock time per write to this file")
    p.add_argument("--term-report", default="",
                   help="on SIGTERM, SIGINT or SIGHUP, write the bytes written to this file, then die")
    p.add_argument("--copy-stdin", default="", help="read stdin into this file while writing; end after its end")
    p.add_argument("--stdin-rate", type=float, default=0.0, help="bytes per second read from stdin (0: no limit)")
    a = p.parse_args()
    if a.term_report:
        global TERM_REPORT
        TERM_REPORT = a.term_report
        signal.pthread_sigmask(signal.SIG_BLOCK, TERM_SIGNALS)
        for fd, n in ((1, a.out), (2, a.err)):
            if n:
                os.set_blocking(fd, False)
    reader = None
    if a.copy_stdin:  # (after the mask above: the thread inherits it, the signal stays the main thread's)
        reader = threading.Thread(target=copy_stdin, args=(a.copy_stdin, a.stdin_rate), daemon=True)
        reader.start()
    out = memoryview(random.Random(a.seed).randbytes(a.out))
    err = memoryview(random.Random(a.seed + 1).randbytes(a.err))
    sizes = random.Random(a.seed + 2)
    with open(a.timestamps, "a") if a.timestamps else contextlib.nullcontext() as stamps:
        o = e = 0
        written = 0
        start = time.monotonic()
        while o < len(out) or e < len(err):
            for fd, buf, pos in ((1, out, o), (2, err, e)):
                if pos >= len(buf):
                    continue
                n = min(len(buf) - pos, sizes.choice((1, 100, 4096, 65536, 200000)))
                write_all(fd, buf[pos : pos + n])
                if fd == 1:
                    o += n
                else:
                    e += n
                written += n
                if stamps:
                    stamps.write(f"{time.time():.6f}\n")
                    stamps.flush()
            if a.rate:
                ahead = written / a.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
            end_if_terminated()
        while reader is not None and reader.is_alive():
            reader.join(0.05)
            end_if_terminated()
    if a.done_file:
        with open(a.done_file, "w") as f:
            f.write("done\n")
    if a.signal:
        sys.stdout.flush()
        os.kill(os.getpid(), a.signal)
        signal.pause()
    sys.exit(a.exit)


if __name__ == "__main__":
    main()
