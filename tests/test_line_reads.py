"""How the agent reads line output from the job's pipe (PipeReaders.read_pipe).

A job that logs fast is read in few, larger reads (LINE_GAP apart), not one
read per line or two; a job that writes now and then is read at once, each
line on its own. The bytes come out whole and in order either way. The
writer is a real process with one write(2) per line; the reader is the
agent's own read_pipe (no spool: every read lands in memory as a Chunk, so
the chunks are the reads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import trio

from gcwrap.agent.agent import Agent
from gcwrap.agent.options import AgentOptions
from gcwrap.agent.readers import LINE_GAP, READ_SIZE, SMALL_READ, read_size
from gcwrap.agent.records import Chunk, JobRecord
from gcwrap.agent.spooler import Spooler
from gcwrap.wire.events import STDOUT, StreamSpec

WIDTH = 100  # bytes a line, newline included

# A line every `gap` seconds, paced by the clock, one os.write each; then the time it took.
WRITER = """
import os, sys, time
count, gap = int(sys.argv[1]), float(sys.argv[2])
t0 = time.monotonic()
for i in range(count):
    while time.monotonic() < t0 + i * gap:
        pass
    os.write(1, b"%09d " % i + b"x" * 89 + b"\\n")
print(time.monotonic() - t0, file=sys.stderr)
"""


def expected(count: int) -> bytes:
    return b"".join(b"%09d " % i + b"x" * 89 + b"\n" for i in range(count))


def read_job(tmp_path: Path, count: int, gap: float) -> tuple[list[Chunk], float]:
    """Run the writer with its stdout on a pipe that Agent.read_output reads;
    the chunks it appended (one a read) and the writer's own time."""
    job = JobRecord(job_id="reads", instance="i", command=["writer"], host="h", user="u", shadow="", started=0.0,
                    wrapper_pid=os.getpid())
    spec = StreamSpec(STDOUT, "stdout", "out")
    agent = Agent(AgentOptions(shadows=()), Spooler(tmp_path / "s.spool", job, [(STDOUT, "stdout", "out")]), job,
                  [spec])
    out = agent.outbox.streams[STDOUT]
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(count), str(gap)], stdout=w, stderr=subprocess.PIPE)
    os.close(w)

    async def main() -> None:
        with trio.fail_after(60):
            await agent.read_output(STDOUT, trio.lowlevel.FdStream(r))

    trio.run(main)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    chunks = list(out.mem)
    assert all(isinstance(c, Chunk) for c in chunks)
    assert b"".join(c.data for c in chunks) == expected(count)  # whole, in order
    assert out.eof and out.read_end == count * WIDTH
    return chunks, float(err.decode().split()[-1])


def test_a_fast_line_writer_is_read_in_few_reads(tmp_path: Path) -> None:
    # 4 000 lines at 20 000 lines/s: 0.2 s of writing. Read as they come,
    # that was a read for every line or few (thousands); gathered for
    # LINE_GAP between reads, about one read a LINE_GAP.
    chunks, took = read_job(tmp_path, 4000, 50e-6)
    reads = len(chunks)
    assert reads <= 2 * took / LINE_GAP + 20, (reads, took)
    assert sum(len(c.data) for c in chunks) / reads >= 5 * WIDTH


def test_a_line_now_and_then_is_read_at_once(tmp_path: Path) -> None:
    # A line every 50 ms: each is read on its own, none waits for the next.
    chunks, _ = read_job(tmp_path, 10, 0.05)
    assert [len(c.data) for c in chunks] == [WIDTH] * 10


def test_a_read_asks_for_what_the_pipe_holds() -> None:
    # Not a fresh 1 MiB buffer for a few lines: what the pipe holds, at
    # least SMALL_READ (for what comes meanwhile), at most READ_SIZE.
    assert read_size(0) == SMALL_READ
    assert read_size(300) == SMALL_READ
    assert read_size(SMALL_READ + 1) == SMALL_READ + 1
    assert read_size(10 * READ_SIZE) == READ_SIZE


def test_the_writer_paces_itself() -> None:
    # (The first test's premise: the writer takes about count * gap.)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", WRITER, "2000", "50e-6"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=True, timeout=60)
    assert time.monotonic() - t0 >= 0.1
