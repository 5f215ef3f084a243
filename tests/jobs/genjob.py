"""A test job: writes known pseudo-random bytes to stdout and stderr.

The bytes of each stream are `random.Random(seed).randbytes(n)` (stdout) and
`random.Random(seed + 1).randbytes(n)` (stderr), written interleaved in
chunks of varying size, so a test can compute the expected sha256 itself.

    genjob.py --out N --err M --seed S [--rate BYTES_PER_S] [--exit K | --signal SIG]
              [--done-file PATH] [--timestamps PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time


def write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


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
    a = p.parse_args()
    out = memoryview(random.Random(a.seed).randbytes(a.out))
    err = memoryview(random.Random(a.seed + 1).randbytes(a.err))
    sizes = random.Random(a.seed + 2)
    stamps = open(a.timestamps, "a") if a.timestamps else None
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
    if stamps:
        stamps.close()
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
