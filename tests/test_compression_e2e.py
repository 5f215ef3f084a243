"""Compression end to end: real gcwrap and gcshadow, byte-exact, on loopback
and through a rate-limited link into a network namespace, with older peers
(the code of the revision before compression, run from git) on either side."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faults import NS_IP, VETH_HOST, BufferingRelay, NetNS, need_netns, sh, shadow_in_ns
from helpers import ShadowProc, Wrapper, sha256_file, tool, wait_until

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent


def write_log_text(path: Path, size: int, seed: int = 1) -> None:
    rnd = random.Random(seed)
    with open(path, "wb") as f:
        written, i = 0, 0
        while written < size:
            line = (f"2026-11-23T18:{i // 60 % 60:02d}:{i % 60:02d}.{rnd.randrange(10**6):06d} INFO worker[{i % 16}] "
                    f"step {i} loss={rnd.random():.6f} lr=0.0003 grad_norm={rnd.random() * 10:.4f}\n").encode()
            line = line[: size - written]
            f.write(line)
            written += len(line)
            i += 1


def summary(err: bytes) -> dict[str, Any]:
    """gcwrap's I/O summary, from its JSON lines on stderr."""
    for line in reversed(err.decode(errors="replace").splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("summary"), dict) and "wire_bytes" in rec["summary"]:
            return dict(rec["summary"])
    raise AssertionError(f"no I/O summary in gcwrap's stderr:\n{err.decode(errors='replace')[-3000:]}")


def run(address: str, out: str, data: Path, spool: Path, *extra: str, timeout: float = 120) -> dict[str, Any]:
    w = Wrapper(["--shadow", address, "--stdout", out, "--spool", str(spool), "--log-format", "json",
                 "--retry-timeout", "1", *extra, "--", "cat", str(data)])
    status = w.wait(timeout)
    assert status == 0, w.err.decode(errors="replace")[-3000:]
    return summary(w.err)


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "log.txt"
    write_log_text(path, 6 << 20)
    return path


@pytest.mark.parametrize("mode", ["zstd", "auto", "none"])
def test_every_mode_lands_byte_exact(shadow: ShadowProc, home: Path, tmp_path: Path, text: Path, mode: str) -> None:
    noise = tmp_path / "noise"
    noise.write_bytes(os.urandom(2 << 20) + text.read_bytes()[: 1 << 20])  # incompressible, then compressible
    for data in (text, noise):
        s = run(shadow.address, f"{mode}-{data.name}", data, tmp_path / f"spool-{mode}-{data.name}", "--compress", mode)
        assert sha256_file(home / f"{mode}-{data.name}") == sha256_file(data)
        assert s["stdout_bytes"] == data.stat().st_size
        if mode == "zstd":
            assert s["compressed_pct"] > 0 and s["wire_bytes"] < s["stdout_bytes"]
        if mode == "none":
            assert s["compressed_pct"] == 0 and s["wire_bytes"] >= s["stdout_bytes"]
    if mode == "zstd":
        # The random megabytes go as they are, the log text shrinks about 5x.
        assert 2 << 20 <= s["wire_bytes"] < (2 << 20) + 0.5 * (1 << 20)


def test_the_environment_chooses_the_mode(shadow: ShadowProc, home: Path, tmp_path: Path, text: Path) -> None:
    w = Wrapper(["--shadow", shadow.address, "--stdout", "env.out", "--spool", str(tmp_path / "spool"),
                 "--log-format", "json", "--", "cat", str(text)], env={**os.environ, "GCWRAP_COMPRESS": "zstd"})
    assert w.wait(60) == 0
    assert summary(w.err)["compressed_pct"] > 0
    bad = subprocess.run([*tool("gcwrap"), "--compress", "gzip", "--", "true"],
                         capture_output=True, timeout=30)
    assert bad.returncode == 2 and b"gzip" in bad.stderr


def test_compressed_output_survives_the_shadow_killed_mid_stream(tmp_path: Path, home: Path, text: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    sp = ShadowProc(home, logs)
    sp.start()
    try:
        big = tmp_path / "big.txt"
        write_log_text(big, 64 << 20, seed=2)
        w = Wrapper(["--shadow", sp.address, "--stdout", "killed.out", "--spool", str(tmp_path / "spool"),
                     "--compress", "zstd", "--retry-timeout", "0.5", "--log-format", "json", "--", "cat", str(big)])
        wait_until(lambda: (home / "killed.out").exists() and (home / "killed.out").stat().st_size > 1 << 20, 60,
                   "the first compressed megabyte at home")
        sp.kill9()
        sp.start(port=sp.port)
        assert w.wait(120) == 0, w.err.decode(errors="replace")[-3000:]
        assert sha256_file(home / "killed.out") == sha256_file(big)
        s = summary(w.err)
        assert s["connections"] >= 2 and s["compressed_pct"] > 0
    finally:
        sp.stop()


# -- a slow link -----------------------------------------------------------------


@pytest.fixture
def slow_link(tmp_path: Path) -> Iterator[tuple[NetNS, str, Path]]:
    """A shadow in a namespace behind a 2 MB/s token bucket (agent -> shadow)."""
    need_netns()
    if not shutil.which("tc"):
        pytest.skip("needs tc (iproute2)")
    root = tmp_path / "ns-home"
    root.mkdir()
    with NetNS() as ns:
        sh("tc", "qdisc", "add", "dev", VETH_HOST, "root", "tbf", "rate", "16mbit", "burst", "32kb", "latency", "400ms")
        proc, port = shadow_in_ns(ns, root, tmp_path)
        try:
            yield ns, f"{NS_IP}:{port}", root
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def tcp_payload_to(ns: NetNS, port: int) -> int:
    """TCP payload bytes the namespace received for `port`, from an
    accounting rule's counters (IP and TCP headers taken off: 52 bytes a
    packet with timestamps)."""
    out = sh(*ns.prefix(), "iptables", "-L", "INPUT", "-v", "-x", "-n").stdout.decode()
    for line in out.splitlines():
        if f"dpt:{port}" in line:
            packets, size = (int(x) for x in line.split()[:2])
            return size - 52 * packets
    raise AssertionError(f"no accounting rule for port {port}:\n{out}")


def test_auto_compresses_log_output_on_a_slow_link(slow_link: tuple[NetNS, str, Path], tmp_path: Path) -> None:
    ns, address, root = slow_link
    port = int(address.rsplit(":", 1)[1])
    ns.iptables("-I", "INPUT", "-p", "tcp", "--dport", str(port))  # counts, lets everything through
    data = tmp_path / "slow.txt"
    write_log_text(data, 16 << 20, seed=3)  # 8 s at 2 MB/s as it is
    started = time.monotonic()
    w = Wrapper(["--shadow", address, "--stdout", "slow.out", "--spool", str(tmp_path / "spool"), "--",
                 "cat", str(data)])
    assert w.wait(120) == 0, w.err.decode(errors="replace")[-3000:]
    took = time.monotonic() - started
    assert sha256_file(root / "slow.out") == sha256_file(data)
    # The text summary says what went on the wire, and it is true: what the
    # namespace received is that, plus frame headers and the handshake.
    text = w.err.decode()
    m = re.search(r"on the wire \S+ \S+ \(([\d,]+) bytes\); ([\d.]+)% of the output sent compressed", text)
    assert m, text
    wire, pct = int(m.group(1).replace(",", "")), float(m.group(2))
    received = tcp_payload_to(ns, port)
    assert wire <= received <= wire * 1.01 + 16384, (wire, received)
    # The link is the bottleneck and the text compresses: most of it went compressed.
    assert pct > 50 and wire < 0.6 * data.stat().st_size, text
    print(f"16 MiB of log text through 2 MB/s: {took:.1f} s, {wire:,} bytes on the wire, {received:,} received")
    # Home counted the same bytes (one connection: nothing was sent twice), and says so.
    (job,) = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(root)],
                                       capture_output=True, timeout=60, check=True).stdout)
    (stream,) = job["streams"]
    assert (stream["durable"], stream["wire"]) == (data.stat().st_size, wire)
    detail = subprocess.run([*tool("gcshadow"), "jobs", "--root", str(root), job["job_id"]], capture_output=True,
                            text=True, timeout=60, check=True, env={**os.environ, "COLUMNS": "200"}).stdout
    assert f"on the wire, {data.stat().st_size / wire:.1f}x smaller" in detail, detail


def test_status_tells_what_a_running_job_sends_compressed(slow_link: tuple[NetNS, str, Path],
                                                          tmp_path: Path) -> None:
    _, address, root = slow_link
    data = tmp_path / "long.txt"
    write_log_text(data, 48 << 20, seed=4)  # ~10 s at 2 MB/s compressed
    spool = tmp_path / "spool"
    w = Wrapper(["--shadow", address, "--stdout", "long.out", "--spool", str(spool), "--", "cat", str(data)])

    def compressing() -> bool:
        out = subprocess.run([*tool("gcwrap"), "status", "--json", "--spool", str(spool)], capture_output=True,
                             timeout=60, check=True).stdout
        spools = json.loads(out)
        return bool(spools) and bool((spools[0].get("wire") or {}).get("compressed_bytes"))

    wait_until(compressing, 60, "gcwrap status to show compressed output")
    text = subprocess.run([*tool("gcwrap"), "status", "--spool", str(spool)], capture_output=True, text=True,
                          timeout=60, check=True, env={**os.environ, "COLUMNS": "200"}).stdout
    # (\s+: a long spool path wraps the line, however wide the terminal)
    words = r"sent \S+ \S+ of output as \S+ \S+ on the wire \([\d.]+x smaller\)".replace(" ", r"\s+")
    assert re.search(words, text), text
    assert w.wait(120) == 0, w.err.decode(errors="replace")[-3000:]
    assert sha256_file(root / "long.out") == sha256_file(data)


def test_auto_leaves_incompressible_output_alone_on_a_slow_link(slow_link: tuple[NetNS, str, Path],
                                                                 tmp_path: Path) -> None:
    _, address, root = slow_link
    data = tmp_path / "noise"
    data.write_bytes(os.urandom(6 << 20))  # 3 s at 2 MB/s
    s = run(address, "noise.out", data, tmp_path / "spool", "--compress", "auto")
    assert sha256_file(root / "noise.out") == sha256_file(data)
    assert s["compressed_pct"] == 0 and s["wire_bytes"] == data.stat().st_size


# -- a buffering relay, and loopback ------------------------------------------------


def compressing(spool: Path) -> bool:
    """`gcwrap status` says the running job sends some output compressed."""
    out = subprocess.run([*tool("gcwrap"), "status", "--json", "--spool", str(spool)], capture_output=True,
                         timeout=60, check=True).stdout
    spools = json.loads(out)
    return bool(spools) and bool((spools[0].get("wire") or {}).get("compressed_bytes"))


def test_auto_compresses_log_output_behind_a_buffering_relay(shadow: ShadowProc, home: Path,
                                                             tmp_path: Path) -> None:
    # The relay takes whatever gcwrap sends at once and forwards 2 MB/s: gcwrap's
    # socket queue stays empty, the path is slow all the same.
    data = tmp_path / "relayed.txt"
    write_log_text(data, 32 << 20, seed=5)  # 16 s at 2 MB/s as it is
    spool = tmp_path / "spool"
    host, port = shadow.address.rsplit(":", 1)
    with BufferingRelay((host, int(port)), rate=2e6) as relay:
        started = time.monotonic()
        w = Wrapper(["--shadow", f"127.0.0.1:{relay.port}", "--stdout", "relayed.out", "--spool", str(spool),
                     "--log-format", "json", "--", "cat", str(data)])
        wait_until(lambda: compressing(spool), 60, "gcwrap status to show compressed output")
        assert w.wait(120) == 0, w.err.decode(errors="replace")[-3000:]
        took = time.monotonic() - started
    assert sha256_file(home / "relayed.out") == sha256_file(data)
    s = summary(w.err)
    assert s["compressed_pct"] > 50 and s["wire_bytes"] < 0.5 * data.stat().st_size, s
    # What went raw before compression started was at most the path's cap, not the whole output.
    assert relay.most < 12 << 20, relay.most
    print(f"32 MiB of log text through a buffering 2 MB/s relay: {took:.1f} s, {s['wire_bytes']:,} bytes on the wire")


def test_auto_leaves_random_bytes_alone_behind_a_buffering_relay(shadow: ShadowProc, home: Path,
                                                                 tmp_path: Path) -> None:
    data = tmp_path / "noise"
    data.write_bytes(os.urandom(4 << 20))  # 2 s at 2 MB/s
    host, port = shadow.address.rsplit(":", 1)
    with BufferingRelay((host, int(port)), rate=2e6) as relay:
        s = run(f"127.0.0.1:{relay.port}", "noise.out", data, tmp_path / "spool", "--compress", "auto")
    assert sha256_file(home / "noise.out") == sha256_file(data)
    assert s["compressed_pct"] == 0 and s["wire_bytes"] == data.stat().st_size


def test_auto_does_not_compress_on_loopback(shadow: ShadowProc, home: Path, tmp_path: Path) -> None:
    data = tmp_path / "fast.txt"
    write_log_text(data, 96 << 20, seed=6)
    s = run(shadow.address, "fast.out", data, tmp_path / "spool")
    assert sha256_file(home / "fast.out") == sha256_file(data)
    # At most the first frame goes compressed (a probe): a fast path never pays for it.
    assert s["compressed_pct"] < 2 and s["wire_bytes"] > 0.98 * data.stat().st_size, s


# -- older peers: the revision before compression, run from git --------------------


def _older_revision(tmp_path: Path) -> Path:
    """The package as it was before compression, unpacked from git (skip when
    this is not a git checkout with that history)."""
    try:
        first = subprocess.run(
            ["git", "-C", str(REPO), "log", "--diff-filter=A", "--format=%H", "--", "gcwrap/compress.py"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        pytest.skip("needs git and the project's history")
    if not first:
        pytest.skip("gcwrap/compress.py is not committed yet")
    dest = tmp_path / "older"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", f"{first[-1]}^", "gcwrap"],
                             capture_output=True, timeout=60)
    if archive.returncode != 0:
        pytest.skip(f"the revision before compression is not in this clone: {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True, timeout=60)
    assert not (dest / "gcwrap" / "compress.py").exists()
    return dest


def _older(dest: Path, program: str) -> list[str]:
    return [sys.executable, "-c", (f"import sys; sys.path.insert(0, {str(dest)!r}); "
                                   f"from gcwrap.{program} import main; sys.argv[0] = {program!r}; main()")]


def test_a_new_agent_and_an_older_shadow(tmp_path: Path, home: Path, text: Path) -> None:
    dest = _older_revision(tmp_path)
    port_file = tmp_path / "older-port"
    with open(tmp_path / "older-shadow.log", "wb") as log:  # (the child keeps its own copy)
        proc = subprocess.Popen([*_older(dest, "shadow_cli"), "serve", "--port", "0", "--root", str(home),
                                 "--port-file", str(port_file)], stdout=log, stderr=log, start_new_session=True)
    try:
        wait_until(lambda: port_file.exists() or proc.poll() is not None, 30, "the older shadow to listen")
        assert proc.poll() is None, (tmp_path / "older-shadow.log").read_text()
        s = run(f"127.0.0.1:{int(port_file.read_text())}", "to-older.out", text, tmp_path / "spool",
                "--compress", "zstd")
        assert sha256_file(home / "to-older.out") == sha256_file(text)
        assert s["compressed_pct"] == 0  # it did not offer it: everything went as DATA
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    # The newer shadow takes over the older one's state: a stream it did not
    # count has no wire figure, and the next job is counted.
    logs = tmp_path / "logs"
    logs.mkdir()
    newer = ShadowProc(home, logs)
    newer.start()
    try:
        run(newer.address, "to-newer.out", text, tmp_path / "spool-2", "--compress", "zstd")
    finally:
        newer.stop()
    listed = json.loads(subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)],
                                       capture_output=True, timeout=60, check=True).stdout)
    wires = {st["name"]: st["wire"] for job in listed for st in job["streams"]}
    assert wires["to-older.out"] is None and 0 < wires["to-newer.out"] < text.stat().st_size


def test_an_older_agent_and_a_new_shadow(shadow: ShadowProc, tmp_path: Path, home: Path, text: Path) -> None:
    dest = _older_revision(tmp_path)
    older = subprocess.run([*_older(dest, "cli"), "--shadow", shadow.address, "--stdout", "from-older.out",
                            "--spool", str(tmp_path / "spool"), "--", "cat", str(text)],
                           capture_output=True, timeout=120)
    assert older.returncode == 0, older.stderr.decode(errors="replace")[-3000:]
    assert sha256_file(home / "from-older.out") == sha256_file(text)


def test_compressed_output_over_tls(tmp_path: Path, home: Path, text: Path) -> None:
    import trustme

    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    logs = tmp_path / "logs"
    logs.mkdir()
    sp = ShadowProc(home, logs, ["--tls-cert", str(tmp_path / "server.pem")])
    sp.start()
    try:
        s = run(sp.address, "tls.out", text, tmp_path / "spool", "--compress", "zstd",
                "--tls-ca", str(tmp_path / "ca.pem"))
    finally:
        sp.stop()
    assert sha256_file(home / "tls.out") == sha256_file(text)
    assert s["compressed_pct"] > 90 and s["wire_bytes"] < 0.4 * text.stat().st_size
