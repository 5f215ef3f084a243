#!/usr/bin/env python3
"""Line output: 2 M lines of 100 B, one write(2) per line, through gcwrap -> gcshadow against socat and rsyslog+RELP.

The job is a small C program (compiled at start with `cc -O2`; a Python
writer if there is no compiler, which the ceiling then shows) that reads
SOURCE into memory and writes it to stdout BLOCK bytes per write(2). SOURCE
is --lines lines of --width bytes ("%09d " + printable filler + "\\n", from a
fixed seed). Two variants, each against the same bytes:

  lines    BLOCK = --width (100): one write per line, as a line-buffered program logs
  blocks   BLOCK = 65536: the same lines written in 64 KiB blocks (block-buffered stdio)

Paths, each run in rotating order within a run (run i starts with path i):

  gcwrap   gcshadow serve --port 0 --root HOME --port-file F --min-free 0           (started before the clock)
           gcwrap --shadow 127.0.0.1:PORT --stdout lines.out --spool SPOOL --job-id ID -- JOB SOURCE BLOCK - TIMES
           ends when gcwrap exits: every byte acknowledged, i.e. fdatasync'd at home.
  socat    socat -u TCP-LISTEN:PORT,reuseaddr,bind=127.0.0.1 OPEN:FILE,creat,trunc
           JOB SOURCE BLOCK - TIMES | socat -u - TCP:127.0.0.1:PORT
           ends when the receiving socat exits. Nothing is synced.
  rsyslog  (lines variant only; when rsyslogd and its imrelp/omrelp modules are installed)
           two rsyslogd -n, each with its own config, work directory and pid file in the work dir:
           a sender following the job's log file with imfile (inotify) and forwarding with omrelp, a
           receiver with imrelp writing %msg% with omfile. The job writes its lines to that file
           (Debian's rsyslog has no pipe input: improg is not packaged). Ends when the received file
           holds every byte (polled every 10 ms). Nothing is synced.

Figures per run: lines/s from spawning the job (or gcwrap) to the end, and
from the job's first write to the end (without gcwrap's start-up); the job's
own write time (first to last write: back-pressure shows here); CPU-seconds
of the sender (gcwrap's own, without the job; the sending socat; the sending
rsyslogd) and of the receiver (gcshadow, the receiving socat or rsyslogd),
user+sys over all threads. Every landed file must hold the job's bytes in
order: its sha256 is compared with SOURCE's, and a mismatch is diagnosed line
by line (missing, duplicated, out of order, altered). gcwrap and socat fail
the benchmark on any mismatch; rsyslog's runs are counted as in order or not
(and its lines/s reported either way), as that is what is being compared.

Before the runs, the job's ceiling: JOB | cat > /dev/null, per variant.

Usage:
  python benchmarks/lines.py --runs 3
  python benchmarks/lines.py --runs 1 --lines 200000            # smoke
  python benchmarks/lines.py --runs 1 --profile /tmp/prof        # + one profiled gcwrap run per variant
  python benchmarks/lines.py --runs 0 --timeline --variants lines  # where a run's wall time goes
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import math
import mmap
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    AckSniffer,
    BenchError,
    PeakRss,
    Results,
    ShadowProc,
    fmt,
    free_port,
    guarded,
    header,
    install_signal_handlers,
    proc_times,
    profiled_run,
    render_table,
    results_option,
    sha256_file,
    signal_tree,
    stop,
    summary,
    thread_cpu,
    thread_cpu_summary,
    tools,
    vm_hwm_kib,
    wait_listening,
    wait_measured,
)

SEED = 17
OUT_NAME = "lines.out"
BLOCKS = 64 << 10
VARIANTS = {"lines": None, "blocks": BLOCKS}  # None: --width

JOB_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
/* lines-job SOURCE BLOCK OUT|- TIMES: write SOURCE to OUT (stdout for -), BLOCK bytes per write(2);
   TIMES gets "FIRST_NS LAST_NS" (CLOCK_MONOTONIC before the first write, after the last). */
static long long now_ns(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000LL + t.tv_nsec;
}
int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: lines-job SOURCE BLOCK OUT|- TIMES\n"); return 2; }
    int in = open(argv[1], O_RDONLY);
    struct stat st;
    if (in < 0 || fstat(in, &st) < 0) { perror(argv[1]); return 1; }
    size_t size = (size_t)st.st_size, block = (size_t)atoll(argv[2]), got = 0;
    char *buf = malloc(size ? size : 1);
    if (!buf || block == 0) { fprintf(stderr, "lines-job: bad block size or out of memory\n"); return 1; }
    while (got < size) {
        ssize_t n = read(in, buf + got, size - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) { perror("read"); return 1; }
        got += (size_t)n;
    }
    close(in);
    int out = 1;
    if (strcmp(argv[3], "-") != 0 && (out = open(argv[3], O_WRONLY | O_CREAT | O_APPEND, 0644)) < 0) {
        perror(argv[3]);
        return 1;
    }
    long long t0 = now_ns();
    for (size_t off = 0; off < size;) {
        size_t want = size - off < block ? size - off : block;
        ssize_t n = write(out, buf + off, want);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { perror("write"); return 1; }
        off += (size_t)n;
    }
    long long t1 = now_ns();
    FILE *f = fopen(argv[4], "w");
    if (!f) { perror(argv[4]); return 1; }
    fprintf(f, "%lld %lld\n", t0, t1);
    return fclose(f) == 0 ? 0 : 1;
}
"""

JOB_PY = r"""
import os, sys, time
src, block, out, times = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
data = memoryview(open(src, "rb").read())
fd = 1 if out == "-" else os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
write = os.write
t0 = time.monotonic_ns()
off = 0
while off < len(data):
    off += write(fd, data[off:off + block])
t1 = time.monotonic_ns()
open(times, "w").write("%d %d\n" % (t0, t1))
"""

RSYSLOG_RECV = """\
global(workDirectory="{work}" maxMessageSize="8k")
main_queue(queue.type="LinkedList" queue.size="200000" queue.dequeueBatchSize="4096")
module(load="imrelp")
input(type="imrelp" port="{port}" address="127.0.0.1")
template(name="line" type="string" string="%msg:2:$%\\n")
action(type="omfile" file="{out}" template="line" ioBufferSize="256k" flushOnTXEnd="on")
"""
RSYSLOG_SEND = """\
global(workDirectory="{work}" maxMessageSize="8k")
main_queue(queue.type="LinkedList" queue.size="200000" queue.dequeueBatchSize="4096")
module(load="imfile" mode="inotify")
input(type="imfile" file="{log}" tag="job" readMode="0" freshStartTail="off" persistStateInterval="0")
module(load="omrelp")
template(name="fwd" type="string" string="<%PRI%>%TIMESTAMP:::date-rfc3339% %HOSTNAME% %syslogtag% %msg%\\n")
action(type="omrelp" target="127.0.0.1" port="{port}" template="fwd" windowSize="65536"
       queue.type="LinkedList" queue.size="200000" queue.dequeueBatchSize="4096")
"""


@dataclass
class Run:
    variant: str
    path: str
    index: int
    order: int  # position of this path within its run (0 = first)
    wall_s: float  # spawn -> end
    from_write_s: float  # the job's first write -> end
    job_write_s: float  # the job's first write -> its last write
    sender_cpu_s: float
    receiver_cpu_s: float
    job_cpu_s: float
    sender_rss_mib: float = 0.0
    receiver_rss_mib: float = 0.0
    in_order: bool = True
    problem: str = ""
    notes: dict[str, object] = field(default_factory=dict)


def make_source(path: Path, lines: int, width: int) -> str:
    """`lines` lines of `width` bytes: "%09d " + filler + newline, filler printable (base64) from a fixed seed."""
    if width < 12:
        raise BenchError("--width must be at least 12 (9 digits, a space, filler, a newline)")
    rng = random.Random(SEED)
    fill = width - 11
    pool = base64.b64encode(rng.randbytes(3 << 20))  # 4 MiB of printable bytes
    h = hashlib.sha256()
    with open(path, "wb") as f:
        chunk = 100_000
        for start in range(0, lines, chunk):
            parts = []
            for i in range(start, min(lines, start + chunk)):
                at = (i * 7919) % (len(pool) - fill)
                parts.append(b"%09d %s\n" % (i, pool[at:at + fill]))
            data = b"".join(parts)
            h.update(data)
            f.write(data)
    return h.hexdigest()


def diagnose(landed: Path, source: Path, width: int, lines: int) -> tuple[bool, str]:
    """(every line present exactly once, a description) of a landed file whose sha256 differs.

    Each landed line is looked up by its sequence number in SOURCE: the counts
    of altered, duplicated, missing and out-of-order lines (a line whose
    number is not the previous one's + 1)."""
    if not landed.exists():
        return False, "nothing landed"
    seen = bytearray(lines)
    altered = dup = out_of_order = extra = 0
    prev = -1
    with open(source, "rb") as fs, mmap.mmap(fs.fileno(), 0, access=mmap.ACCESS_READ) as src, \
            open(landed, "rb") as fl:
        for raw in fl:
            head = raw[:9]
            if not head.isdigit():
                altered += 1
                continue
            n = int(head)
            if n >= lines:
                extra += 1
                continue
            if raw != src[n * width:(n + 1) * width]:
                altered += 1
            if seen[n]:
                dup += 1
            seen[n] = 1
            if n != prev + 1:
                out_of_order += 1
            prev = n
    missing = lines - sum(seen)
    complete = missing == 0 and dup == 0 and altered == 0 and extra == 0
    return complete, (f"{missing} missing, {dup} duplicated, {altered} altered, {extra} unknown, "
                      f"{out_of_order} out of order (of {lines} lines; {landed.stat().st_size:,} bytes landed)")


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.source = workdir / "source.txt"
        self.size = args.lines * args.width
        self.expected = ""
        self.gcwrap, _ = tools()
        self.socat = shutil.which("socat") or "socat"
        self.job_cmd: list[str] = []
        self.job_kind = ""
        self.commands: dict[str, str] = {}
        self.rss = PeakRss()
        sbin = "/usr/sbin/rsyslogd"
        self.rsyslogd = shutil.which("rsyslogd") or (os.path.exists(sbin) and sbin) or ""
        self.rsyslog_skip = ""

    def prepare(self) -> None:
        self.expected = make_source(self.source, self.args.lines, self.args.width)
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc:
            src = self.workdir / "lines-job.c"
            src.write_text(JOB_C)
            exe = self.workdir / "lines-job"
            r = subprocess.run([cc, "-O2", "-o", str(exe), str(src)], capture_output=True, text=True, timeout=120,
                               check=False)
            if r.returncode == 0:
                self.job_cmd, self.job_kind = [str(exe)], f"C ({cc} -O2)"
            else:
                print(f"could not compile the C job ({r.stderr.strip()[:300]}); using the Python writer", flush=True)
        if not self.job_cmd:
            self.job_cmd, self.job_kind = [sys.executable, "-c", JOB_PY], "Python (no C compiler: see the ceiling)"
        self.rsyslog_skip = self._rsyslog_missing()

    def _rsyslog_missing(self) -> str:
        if "rsyslog" not in self.args.paths:
            return "not asked for (--paths)"
        if not self.rsyslogd:
            return "rsyslogd is not installed (apt-get install rsyslog rsyslog-relp)"
        r = subprocess.run([self.rsyslogd, "-v"], capture_output=True, text=True, timeout=30, check=False)
        libdir = next((Path(p) for p in ("/usr/lib/x86_64-linux-gnu/rsyslog", "/usr/lib/rsyslog",
                                          "/usr/lib64/rsyslog") if Path(p, "imfile.so").exists()), None)
        if libdir is None or not (libdir / "omrelp.so").exists() or not (libdir / "imrelp.so").exists():
            return "rsyslog's imrelp/omrelp/imfile modules are not installed (apt-get install rsyslog-relp)"
        self.commands.setdefault("rsyslogd version", r.stdout.splitlines()[0].replace(" compiled with:", "").strip()
                                 if r.stdout else "?")
        return ""

    def job(self, block: int, out: str, times: Path) -> list[str]:
        return [*self.job_cmd, str(self.source), str(block), out, str(times)]

    def block(self, variant: str) -> int:
        return VARIANTS[variant] or self.args.width

    def deadline(self) -> float:
        return time.monotonic() + float(self.args.timeout)

    @staticmethod
    def job_times(path: Path) -> tuple[float, float]:
        try:
            first, last = path.read_text().split()
        except (OSError, ValueError):
            raise BenchError(f"the job did not write its times to {path}") from None
        return int(first) / 1e9, int(last) / 1e9

    def verify(self, landed: Path, what: str, strict: bool = True) -> tuple[bool, str]:
        if landed.exists() and landed.stat().st_size == self.size and sha256_file(landed) == self.expected:
            return True, ""
        complete, text = diagnose(landed, self.source, self.args.width, self.args.lines)
        if strict:
            raise BenchError(f"{what}: the landed file is not the job's bytes in order: {text}")
        return False, ("all lines, out of order: " if complete else "") + text

    # -- the ceiling ---------------------------------------------------------------

    def ceiling(self, variant: str) -> tuple[float, float, float]:
        """(lines/s over the job's own writes, lines/s spawn -> cat's exit, the job's CPU-s): JOB | cat > /dev/null."""
        times = self.workdir / "ceiling.times"
        os.sync()
        time.sleep(0.2)
        t0 = time.monotonic()
        job = subprocess.Popen(self.job(self.block(variant), "-", times), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, start_new_session=True)
        sink = subprocess.Popen(["cat"], stdin=job.stdout, stdout=subprocess.DEVNULL, start_new_session=True)
        assert job.stdout is not None
        job.stdout.close()
        try:
            rs = wait_measured(sink, self.deadline())
            rj = wait_measured(job, self.deadline())
        finally:
            for p in (job, sink):
                if p.returncode is None:
                    signal_tree(p, 9)
                    p.wait(10)
        if rj.returncode != 0 or rs.returncode != 0 or rj.timed_out or rs.timed_out:
            raise BenchError(f"ceiling ({variant}): job exit {rj.returncode}, cat exit {rs.returncode}")
        first, last = self.job_times(times)
        return self.args.lines / (last - first), self.args.lines / (rs.end - t0), rj.rusage_cpu

    # -- gcwrap ----------------------------------------------------------------------

    def run_gcwrap(self, variant: str, index: int, order: int, profile: Path | None = None) -> Run:
        rundir = self.workdir / f"gcwrap-{variant}-{index}"
        home, spool = rundir / "home", rundir / "spool"
        times = rundir / "job.times"
        shadow = ShadowProc(home, rundir)
        wrapper: subprocess.Popen[bytes] | None = None
        try:
            port = shadow.wait_ready()
            cmd = [*self.gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", OUT_NAME, "--spool", str(spool),
                   "--job-id", f"lines-{os.getpid()}-{variant}-{index}", "--",
                   *self.job(self.block(variant), "-", times)]
            self.commands.setdefault("gcshadow", shlex.join(shadow.cmd))
            self.commands.setdefault("gcwrap", shlex.join(cmd).replace(shlex.quote(JOB_PY), "JOB_PY"))
            os.sync()
            time.sleep(0.2)
            log = rundir / "gcwrap.log"
            if profile is not None:
                wall, text = profiled_run(profile, variant, shadow.pid, cmd, log, self.args.timeout)
                self.verify(home / OUT_NAME, f"gcwrap ({variant}) profiled run")
                print(f"\n-- profile of gcwrap -> gcshadow, {variant} ({wall:.1f} s under the samplers; files in "
                      f"{profile}) --\n{text}", flush=True)
                return Run(variant, "gcwrap", index, order, wall, math.nan, math.nan, math.nan, math.nan, math.nan)
            threads0 = thread_cpu(shadow.pid)
            cpu0 = shadow.cpu()
            with open(log, "wb") as err:
                t0 = time.monotonic()
                wrapper = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                           start_new_session=True)
            self.rss.watch(wrapper)
            r = wait_measured(wrapper, self.deadline(), self.rss)
            time.sleep(0.25)  # the shadow's book-keeping for the job
            cpu = shadow.cpu() - cpu0
            threads1 = thread_cpu(shadow.pid)
            hwm = (vm_hwm_kib(shadow.pid) or 0) / 1024
            if r.timed_out or r.returncode != 0:
                raise BenchError(f"gcwrap ({variant}) run {index}: exit {r.returncode}, timed out {r.timed_out}\n"
                                 f"{log.read_text(errors='replace')[-2000:]}")
            if r.own_cpu is None or r.children_cpu is None:
                raise BenchError("could not read gcwrap's /proc/PID/stat before reaping it")
            self.verify(home / OUT_NAME, f"gcwrap ({variant}) run {index}")
            first, last = self.job_times(times)
            return Run(variant, "gcwrap", index, order, r.end - t0, r.end - first, last - first,
                       sender_cpu_s=r.own_cpu, receiver_cpu_s=cpu, job_cpu_s=r.children_cpu,
                       sender_rss_mib=r.peak_rss_kib / 1024, receiver_rss_mib=hwm,
                       notes={"shadow_threads": thread_cpu_summary(threads0, threads1)})
        finally:
            if wrapper is not None and wrapper.returncode is None:
                signal_tree(wrapper, 9)
                wrapper.wait(10)
            shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    def timeline(self, variant: str, interval: float = 0.1) -> str:
        """One untimed gcwrap run, watched every `interval` s: the bytes the job has written (/proc/JOB/io
        wchar), the bytes the shadow has acknowledged (ACK frames captured on loopback, as latency.py does), and
        the CPU gcwrap and gcshadow used in the interval. Where the two curves part, and neither process is
        busy, the time goes to waiting."""
        from gcwrap.wire.events import STDOUT

        rundir = self.workdir / f"timeline-{variant}"
        home, spool, times = rundir / "home", rundir / "spool", rundir / "job.times"
        shadow = ShadowProc(home, rundir)
        wrapper: subprocess.Popen[bytes] | None = None
        sniffer: AckSniffer | None = None
        try:
            port = shadow.wait_ready()
            sniffer = AckSniffer(port, STDOUT)
            sniffer.start()
            cmd = [*self.gcwrap, "--shadow", f"127.0.0.1:{port}", "--stdout", OUT_NAME, "--spool", str(spool),
                   "--job-id", f"lines-{os.getpid()}-{variant}-timeline", "--",
                   *self.job(self.block(variant), "-", times)]
            os.sync()
            time.sleep(0.2)
            rows: list[tuple[float, int, int, float, float]] = []
            with open(rundir / "gcwrap.log", "wb") as err:
                t0 = time.monotonic()
                wrapper = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                           start_new_session=True)
            job: int | None = None
            wrote = 0
            while wrapper.poll() is None and time.monotonic() < t0 + self.args.timeout:
                try:
                    cpu_w = proc_times(wrapper.pid)[0]
                    if job is None:
                        job = next((int(k) for tid in os.listdir(f"/proc/{wrapper.pid}/task") for k in
                                    Path(f"/proc/{wrapper.pid}/task/{tid}/children").read_text().split()), None)
                    if job is not None:
                        with open(f"/proc/{job}/io") as f:
                            wrote = next(int(line.split()[1]) for line in f if line.startswith("wchar"))
                except (OSError, StopIteration, ValueError):
                    pass  # gcwrap or the job is exiting
                acked = max((a[0] for a in list(sniffer.acks)), default=0)
                rows.append((time.monotonic() - t0, wrote, acked, cpu_w, shadow.cpu()))
                time.sleep(interval)
            if wrapper.poll() is None:
                raise BenchError(f"gcwrap ({variant}) timeline run: still running after {self.args.timeout:.0f} s")
            end = time.monotonic() - t0
            if wrapper.returncode != 0:
                raise BenchError(f"gcwrap ({variant}) timeline run: exit {wrapper.returncode}\n"
                                 f"{(rundir / 'gcwrap.log').read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
            sniffer.close()
            self.verify(home / OUT_NAME, f"gcwrap ({variant}) timeline run")
            out = [(f"timeline of one gcwrap run ({variant}; untimed; ended after {end:.2f} s, "
                    f"{len(sniffer.acks)} ACKs):"),
                   "      t (s)  job wrote (MB)  acked (MB)  gcwrap CPU  gcshadow CPU"]
            prev = rows[0] if rows else (0.0, 0, 0, 0.0, 0.0)
            for row in rows[1:]:
                dt = max(row[0] - prev[0], 1e-6)
                out.append(f"  {row[0]:9.2f}  {row[1] / 1e6:14.1f}  {row[2] / 1e6:10.1f}  "
                           f"{100 * (row[3] - prev[3]) / dt:9.0f}%  {100 * (row[4] - prev[4]) / dt:11.0f}%")
                prev = row
            return "\n".join(out)
        finally:
            if sniffer is not None:
                sniffer.close()
            if wrapper is not None and wrapper.returncode is None:
                signal_tree(wrapper, 9)
                wrapper.wait(10)
            shadow.stop()
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    # -- socat -----------------------------------------------------------------------

    def run_socat(self, variant: str, index: int, order: int) -> Run:
        rundir = self.workdir / f"socat-{variant}-{index}"
        rundir.mkdir()
        out, times = rundir / "socat.out", rundir / "job.times"
        port = free_port()
        recv_cmd = [self.socat, "-u", f"TCP-LISTEN:{port},reuseaddr,bind=127.0.0.1", f"OPEN:{out},creat,trunc"]
        send_cmd = [self.socat, "-u", "-", f"TCP:127.0.0.1:{port}"]
        job_cmd = self.job(self.block(variant), "-", times)
        self.commands.setdefault("socat receiver", shlex.join(recv_cmd))
        self.commands.setdefault(f"socat sender ({variant})",
                                 shlex.join(job_cmd).replace(shlex.quote(JOB_PY), "JOB_PY") + " | "
                                 + shlex.join(send_cmd))
        procs: list[subprocess.Popen[bytes]] = []
        try:
            recv = subprocess.Popen(recv_cmd, stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(recv)
            wait_listening(recv, port, "the receiving socat")
            os.sync()
            time.sleep(0.2)
            t0 = time.monotonic()
            job = subprocess.Popen(job_cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
            procs.append(job)
            send = subprocess.Popen(send_cmd, stdin=job.stdout, start_new_session=True)
            procs.append(send)
            assert job.stdout is not None
            job.stdout.close()
            for p in procs:
                self.rss.watch(p)
            deadline = self.deadline()
            rr = wait_measured(recv, deadline, self.rss)
            rs = wait_measured(send, deadline, self.rss)
            rj = wait_measured(job, deadline, self.rss)
            for name, r in (("receiving socat", rr), ("sending socat", rs), ("job", rj)):
                if r.timed_out or r.returncode != 0:
                    raise BenchError(f"socat ({variant}) run {index}: {name} exit {r.returncode}, "
                                     f"timed out {r.timed_out}")
            self.verify(out, f"socat ({variant}) run {index}")
            first, last = self.job_times(times)
            return Run(variant, "socat", index, order, rr.end - t0, rr.end - first, last - first,
                       sender_cpu_s=rs.rusage_cpu, receiver_cpu_s=rr.rusage_cpu, job_cpu_s=rj.rusage_cpu,
                       sender_rss_mib=rs.peak_rss_kib / 1024, receiver_rss_mib=rr.peak_rss_kib / 1024)
        finally:
            for p in procs:
                if p.returncode is None:
                    signal_tree(p, 9)
                    p.wait(10)
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)

    # -- rsyslog + RELP -------------------------------------------------------------

    def _rsyslogd(self, rundir: Path, role: str, conf_text: str) -> subprocess.Popen[bytes]:
        work = rundir / f"{role}-work"
        work.mkdir(parents=True)
        conf = rundir / f"{role}.conf"
        text = conf_text.replace("{work}", str(work))
        conf.write_text(text)
        cmd = [self.rsyslogd, "-n", "-f", str(conf), "-i", str(rundir / f"{role}.pid")]
        self.commands.setdefault(f"rsyslogd {role}", shlex.join(cmd))
        self.commands.setdefault(f"rsyslog {role}.conf", " ".join(text.split()))
        with open(rundir / f"{role}.log", "wb") as log:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)

    def run_rsyslog(self, variant: str, index: int, order: int) -> Run:
        rundir = self.workdir / f"rsyslog-{variant}-{index}"
        rundir.mkdir()
        out, joblog, times = rundir / "received.log", rundir / "job.log", rundir / "job.times"
        port = free_port()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            recv = self._rsyslogd(rundir, "receiver", RSYSLOG_RECV.format(work="{work}", port=port, out=out))
            procs.append(recv)
            wait_listening(recv, port, "the receiving rsyslogd", timeout=20,
                           why=lambda: ": " + (rundir / "receiver.log").read_text(errors="replace")[-1000:])
            send = self._rsyslogd(rundir, "sender", RSYSLOG_SEND.format(work="{work}", port=port, log=joblog))
            procs.append(send)
            time.sleep(1.0)  # the sender connects its RELP session and sets up its inotify watch
            if send.poll() is not None:
                raise BenchError(f"the sending rsyslogd exited: {(rundir / 'sender.log').read_text()[-1000:]}")
            os.sync()
            time.sleep(0.2)
            s0, r0 = proc_times(send.pid)[0], proc_times(recv.pid)[0]
            job_cmd = self.job(self.block(variant), str(joblog), times)
            self.commands.setdefault("rsyslog job", shlex.join(job_cmd).replace(shlex.quote(JOB_PY), "JOB_PY"))
            t0 = time.monotonic()
            job = subprocess.Popen(job_cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   start_new_session=True)
            procs.append(job)
            rj = wait_measured(job, self.deadline())
            if rj.timed_out or rj.returncode != 0:
                raise BenchError(f"rsyslog ({variant}) run {index}: the job exit {rj.returncode}")
            # The end: the received file holds every byte; or it stops growing (lines lost) / the deadline.
            deadline = t0 + self.args.timeout
            last_size, last_change = -1, time.monotonic()
            end = None
            while True:
                size = out.stat().st_size if out.exists() else 0
                now = time.monotonic()
                if size >= self.size:
                    end = now
                    break
                if size != last_size:
                    last_size, last_change = size, now
                if now - last_change > self.args.stall or now > deadline:
                    break
                time.sleep(0.01)
            s_cpu, r_cpu = proc_times(send.pid)[0] - s0, proc_times(recv.pid)[0] - r0
            s_hwm, r_hwm = (vm_hwm_kib(send.pid) or 0) / 1024, (vm_hwm_kib(recv.pid) or 0) / 1024
            first, last = self.job_times(times)
            if end is None:
                _, text = diagnose(out, self.source, self.args.width, self.args.lines)
                return Run(variant, "rsyslog", index, order, float("nan"), float("nan"), last - first, s_cpu, r_cpu,
                           rj.rusage_cpu, s_hwm, r_hwm, in_order=False,
                           problem=f"incomplete after {time.monotonic() - t0:.0f} s: {text}")
            time.sleep(0.2)  # anything beyond the expected bytes (duplicates) lands too
            in_order, problem = self.verify(out, f"rsyslog ({variant}) run {index}", strict=False)
            return Run(variant, "rsyslog", index, order, end - t0, end - first, last - first, s_cpu, r_cpu,
                       rj.rusage_cpu, s_hwm, r_hwm, in_order=in_order, problem=problem)
        finally:
            for p in reversed(procs):
                if p.returncode is None:
                    stop(p)
            if not self.args.keep:
                shutil.rmtree(rundir, ignore_errors=True)


# -- reporting ------------------------------------------------------------------------


LINES_TARGETS = {"lines": ">= 1.0x", "blocks": ">= 1.0x"}  # (blocks: issue 31 raised it from 0.8x)
LINES_KEY = {"lines/s, spawn -> end", "sender CPU-s per M lines", "receiver CPU-s per M lines"}


def report(runs: list[Run], variant: str, lines: int, record: Results | None = None) -> list[str]:
    rs = [r for r in runs if r.variant == variant]
    paths = [p for p in ("gcwrap", "socat", "rsyslog") if any(r.path == p for r in rs)]
    head = ["figure"]
    for p in paths:
        head += [f"{p} median", "(min-max)"]
    head += [f"{p}/socat" for p in paths if p != "socat"]
    rows = [head]

    def per_m(x: float) -> float:
        return x / (lines / 1e6)

    figures: list[tuple[str, Callable[[Run], float]]] = [
        ("lines/s, spawn -> end", lambda r: lines / r.wall_s),
        ("lines/s, job's first write -> end", lambda r: lines / r.from_write_s),
        ("job's write time (s)", lambda r: r.job_write_s),
        ("drain: job's last write -> end (s)", lambda r: r.from_write_s - r.job_write_s),
        ("wall, spawn -> end (s)", lambda r: r.wall_s),
        ("sender CPU-s", lambda r: r.sender_cpu_s),
        ("receiver CPU-s", lambda r: r.receiver_cpu_s),
        ("sender CPU-s per M lines", lambda r: per_m(r.sender_cpu_s)),
        ("receiver CPU-s per M lines", lambda r: per_m(r.receiver_cpu_s)),
        ("job CPU-s", lambda r: r.job_cpu_s),
        ("sender peak RSS (MiB)", lambda r: r.sender_rss_mib),
        ("receiver peak RSS (MiB)", lambda r: r.receiver_rss_mib),
    ]
    for label, key in figures:
        row = [label]
        meds: dict[str, float] = {}
        for p in paths:
            med, lo, hi = summary(key(r) for r in rs if r.path == p)
            meds[p] = med
            row += [fmt(med), f"{fmt(lo)}-{fmt(hi)}"]
        if record is not None and "gcwrap" in paths:
            for base in ("socat", "rsyslog") if label.startswith("lines/s") else ("socat",):
                if base in paths:
                    target = LINES_TARGETS.get(variant, "") if (base, label) == ("socat", figures[0][0]) else ""
                    record.figure(f"line output, {variant} ({lines:,} lines): {label}", "",
                                  [key(r) for r in rs if r.path == "gcwrap"], [key(r) for r in rs if r.path == base],
                                  base, target, key=label in LINES_KEY and (base == "socat" or variant == "lines"))
        for p in paths:
            if p != "socat":
                ok = "socat" in meds and meds["socat"] and meds["socat"] == meds["socat"] and meds[p] == meds[p]
                row.append(f"{meds[p] / meds['socat']:.2f}x" if ok else "-")
        rows.append(row)
    row = ["runs byte-exact and in order"]
    for p in paths:
        mine = [r for r in rs if r.path == p]
        row += [f"{sum(r.in_order for r in mine)}/{len(mine)}", ""]
    rows.append(row + [""] * (len(head) - len(row)))
    return [render_table(rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2_000_000, help="lines the job writes (default 2000000)")
    parser.add_argument("--width", type=int, default=100, help="bytes per line, newline included (default 100)")
    parser.add_argument("--runs", type=int, default=3,
                        help="runs of each path and variant (default 3; 0 with --profile: the profiled runs only)")
    parser.add_argument("--variants", default="lines,blocks", help="lines (one write per line), blocks (64 KiB)")
    parser.add_argument("--paths", default="gcwrap,socat,rsyslog", help="gcwrap,socat,rsyslog (default all)")
    parser.add_argument("--rsyslog-variants", default="lines", help="variants rsyslog runs in (default lines)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run (default 300)")
    parser.add_argument("--stall", type=float, default=30.0,
                        help="rsyslog: seconds without growth of the received file before a run is called "
                             "incomplete (default 30)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="after the timed runs, one more gcwrap run per variant under py-spy (gcshadow "
                             "attached by pid, gcwrap launched by it); raw stacks and summaries go to this directory")
    parser.add_argument("--timeline", action="store_true",
                        help="after the timed runs, one more gcwrap run per variant, watched every 0.1 s: bytes the "
                             "job wrote, bytes acknowledged (ACKs captured on loopback; needs root), CPU of each side")
    parser.add_argument("--tmpdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    results_option(parser, "lines")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants):
        parser.error(f"--variants: one of {', '.join(VARIANTS)}")
    paths = [p for p in args.paths.split(",") if p]
    if "socat" in paths and not shutil.which("socat"):
        print("lines: socat is not installed (apt-get install socat)", file=sys.stderr)
        return 2
    install_signal_handlers()
    record = Results("lines", args.json)
    print(header("lines"), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="gcwrap-bench-lines-", dir=args.tmpdir))
    bench = Bench(args, workdir)
    runs: list[Run] = []
    with guarded("lines", workdir, args.keep, cleanup=bench.rss.close) as outcome:
        bench.prepare()
        print(f"source: {args.lines:,} lines x {args.width} B = {bench.size:,} bytes, sha256 {bench.expected}; "
              f"job: {bench.job_kind}; runs: {args.runs}; work dir {workdir}")
        if "rsyslog" in paths:
            print("rsyslog: " + (f"SKIPPED: {bench.rsyslog_skip}" if bench.rsyslog_skip else
                                 f"{bench.rsyslogd}, in variants {args.rsyslog_variants}"))
        for v in variants:
            per_write, spawn_to_end, cpu = bench.ceiling(v)
            print(f"job ceiling ({v}, {bench.block(v)} B per write; job | cat > /dev/null): "
                  f"{per_write:,.0f} lines/s over its writes, {spawn_to_end:,.0f} lines/s spawn -> cat's exit, "
                  f"job CPU {cpu:.2f} s", flush=True)
        for v in variants:
            vpaths = [p for p in paths if p != "rsyslog" or (not bench.rsyslog_skip and v in args.rsyslog_variants)]
            if not vpaths:
                print(f"{v}: no path to run ({', '.join(paths)} skipped)", flush=True)
                continue
            for i in range(1, args.runs + 1):
                shift = (i - 1) % len(vpaths)
                order = vpaths[shift:] + vpaths[:shift]
                for k, p in enumerate(order):
                    run = (bench.run_gcwrap(v, i, k) if p == "gcwrap" else bench.run_socat(v, i, k) if p == "socat"
                           else bench.run_rsyslog(v, i, k))
                    runs.append(run)
                    record.run(**asdict(run))
                    rate = args.lines / run.wall_s if run.wall_s == run.wall_s else float("nan")
                    print(f"{v:6} run {i} #{k + 1} {p:7}  {rate:10,.0f} lines/s  wall {run.wall_s:6.2f} s  "
                          f"from first write {run.from_write_s:6.2f} s  job writes {run.job_write_s:6.2f} s  "
                          f"sender CPU {run.sender_cpu_s:6.2f} s  receiver CPU {run.receiver_cpu_s:6.2f} s  "
                          + ("sha256 OK (in order)" if run.in_order else f"NOT in order: {run.problem}"), flush=True)
        print("\ncommands (first run):")
        for name, cmd in bench.commands.items():
            print(f"  {name}: {cmd}")
        print("load average at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        for v in variants if runs else []:
            print(f"\n== {v}: {args.lines:,} lines of {args.width} B, {bench.block(v)} B per write ==")
            print("\n".join(report(runs, v, args.lines, record)))
        print("\nCPU-s = user+sys over all threads (gcwrap: its own, not the job's). Ratios: median / socat's median"
              " in this run. gcwrap's end is every byte fdatasync'd at home; socat's and rsyslog's is every byte "
              "in the receiver's page cache.")
        for name, cmd in bench.commands.items():
            record.command(name, cmd)
        if runs:
            record.write()
        if args.timeline:
            for v in variants:
                print("\n" + bench.timeline(v), flush=True)
        if args.profile is not None:
            for v in variants:
                bench.run_gcwrap(v, 0, 0, profile=args.profile)
    if not runs and outcome.status == 0 and args.runs:
        print("lines: no run was made", file=sys.stderr)
        return 2
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
