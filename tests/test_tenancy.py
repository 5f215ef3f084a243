"""One shadow, many identities: each sees and touches only its own files.

Two real identities (certificates made here with trustme, or a token of
their own each) try each other's files through every path a NAME can take:
stdout, stderr, stdin, templated names, `..` variants, links a local user
made in the root, a finished file and a running one. Then the limits before
authentication (oversized announced frames refused from their header; the
memory 1,000 unauthenticated connections can make the shadow hold, and give
back), control characters in names, and hard links on a single-user shadow.

Real processes over loopback; a raw client (the sans-I/O protocol over a
socket) where gcwrap itself would refuse the input before sending it.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import select
import socket
import ssl
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
from helpers import ShadowProc, Wrapper, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcwrap.auth import agent_mac, client_context, new_nonce
from gcwrap.events import Auth, Challenge, Error, ErrorCode, Event, Hello, StreamSpec, Welcome
from gcwrap.protocol import (
    DEFAULT_MAX_FRAME,
    MAGIC,
    MAX_CONTROL,
    NEED_DATA,
    Connection,
    ProtocolError,
    Role,
    decode,
    encode,
)
from gcwrap.shadow_store import Store, StoreError

trustme = pytest.importorskip("trustme", reason="needs trustme (pip install -e '.[test]')")

MAX_HANDSHAKE_FRAME = MAX_CONTROL + 1  # the largest control frame (type byte and JSON body): the limit before WELCOME
BOB_SECRET = b"BOB-PRIVATE-RESULT\n"
VICTIM = b"OUTSIDE-VICTIM\n"


def _token(path: Path) -> Path:
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


@dataclass
class Site:
    """A shadow serving two identities, and how each one connects."""

    home: Path
    tmp: Path
    shadow: ShadowProc
    kind: str
    agent_args: dict[str, list[str]] = field(default_factory=dict)  # identity -> gcwrap's security options
    tokens: dict[str, bytes] = field(default_factory=dict)
    contexts: dict[str, ssl.SSLContext] = field(default_factory=dict)

    def run(self, who: str, job_id: str, *args: str, job: list[str] | None = None) -> Wrapper:
        return Wrapper(["--shadow", self.shadow.address, "--spool", str(self.tmp / f"spool-{who}"),
                        "--job-id", job_id, "--retry-timeout", "0.2", "--retry-limit", "2",
                        *self.agent_args[who], *args, "--", *(job or ["echo", f"{who} was here"])])

    def raw(self, who: str, hello: Hello) -> Event:
        """The shadow's answer (WELCOME or ERROR) to `hello` from `who`, over a raw connection."""
        return handshake(self.shadow.port, hello, token=self.tokens.get(who), ctx=self.contexts.get(who))


def handshake(port: int, hello: Hello, *, token: bytes | None = None, ctx: ssl.SSLContext | None = None) -> Event:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if ctx is not None:
        sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
    with sock:
        conn = Connection(Role.AGENT)
        nonce = new_nonce() if token else ""
        hello = dataclasses.replace(hello, nonce=nonce)
        sock.sendall(conn.send(hello))
        while True:
            ev = conn.next_event()
            if ev is NEED_DATA:
                conn.receive_data(sock.recv(65536))
                continue
            if isinstance(ev, Challenge):
                assert token is not None
                sock.sendall(conn.send(Auth(agent_mac(token, nonce, ev.nonce, hello.job_id, hello.instance))))
                continue
            assert isinstance(ev, Event)
            return ev


@pytest.fixture(params=["certificates", "tokens"])
def site(request: pytest.FixtureRequest, home: Path, tmp_path: Path) -> Iterator[Site]:
    logs = tmp_path / "logs"
    logs.mkdir()
    if request.param == "certificates":
        ca = trustme.CA()
        pki = tmp_path / "pki"
        pki.mkdir()
        ca.cert_pem.write_to_path(str(pki / "ca.pem"))
        ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pki / "server.pem"))
        for who in ("alice", "bob"):
            ca.issue_cert(f"{who}@grid", common_name=who).private_key_and_cert_chain_pem.write_to_path(
                str(pki / f"{who}.pem"))
        # As in the report: each certificate may use only its own job ids.
        extra = ["--tls-cert", str(pki / "server.pem"), "--tls-ca", str(pki / "ca.pem"),
                 "--allow-subject", "alice:alice-*", "--allow-subject", "bob:bob-*"]
        sh = ShadowProc(home, logs, extra=extra)
        s = Site(home, tmp_path, sh, request.param)
        for who in ("alice", "bob"):
            s.agent_args[who] = ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / f"{who}.pem")]
            s.contexts[who] = client_context(pki / "ca.pem", pki / f"{who}.pem", None)
    else:
        tokens = tmp_path / "tokens"
        tokens.mkdir(mode=0o700)
        # No --allow-subject: any identity may pick any job id, so job ids are owned by who used them first.
        sh = ShadowProc(home, logs, extra=["--token-dir", str(tokens)])
        s = Site(home, tmp_path, sh, request.param)
        for who in ("alice", "bob"):
            path = _token(tokens / who)
            s.agent_args[who] = ["--token-file", str(path)]
            s.tokens[who] = path.read_text().strip().encode()
    sh.start()
    try:
        yield s
    finally:
        sh.stop()


@pytest.mark.timeout(300)
def test_two_identities_cannot_touch_each_others_files(site: Site, tmp_path: Path) -> None:
    home = site.home
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(VICTIM)

    # bob: a finished file and a running job.
    done = site.run("bob", "bob-1", "--stdout", "results.txt", job=["printf", BOB_SECRET.decode()])
    assert done.wait(30) == 0, done.err.decode()
    results = home / "bob" / "results.txt"
    assert results.read_bytes() == BOB_SECRET, "bob's files are under ROOT/bob/"
    live = home / "bob" / "live.txt"
    running = site.run("bob", "bob-2", "--stdout", "live.txt",
                       job=["sh", "-c", "echo BOB-LIVE; sleep 12; echo BOB-END"])
    wait_until(lambda: live.exists() and live.read_bytes() == b"BOB-LIVE\n", 30, "bob's running job")

    # A local user makes links in alice's part of the root: to a file outside
    # the root, to bob's finished file, and symlinks to bob's file and directory.
    mine = home / "alice"
    mine.mkdir(exist_ok=True)
    os.link(victim, mine / "hardlink")
    os.link(results, mine / "bobs-link")
    os.symlink("../bob/results.txt", mine / "symlink")
    os.symlink("../bob", mine / "bobdir")

    attempts = refused_by_shadow = refused_by_agent = 0
    n = 0

    def alice(*args: str, want: int, job_id: str = "", job: list[str] | None = None) -> Wrapper:
        nonlocal attempts, n
        n += 1
        attempts += 1
        w = site.run("alice", job_id or f"alice-{n}", *args, job=job)
        code = w.wait(60)
        assert code == want, (args, code, w.err.decode())
        return w

    # Refused by the shadow: nothing written, the job runs on into its spool (123).
    for args in (
        ("--stdin", "bob/results.txt"),  # bob's finished file, by its name under the root
        ("--stdin", "bob/live.txt"),  # bob's running one
        ("--stdin", "hardlink"), ("--stdin", "bobs-link"), ("--stdin", "symlink"), ("--stdin", "bobdir/results.txt"),
        ("--stdout", "hardlink"), ("--stderr", "bobs-link"), ("--stdout", "symlink"),
        ("--stdout", "bobdir/results.txt"), ("--stderr", "bobdir/live.txt"),
    ):
        out = f"refused-{n + 1}.out"
        extra = ("--stdout", out) if args[0] != "--stdout" else ()
        w = alice(*args, *extra, want=123, job=["cat"] if args[0] == "--stdin" else None)
        refused_by_shadow += 1
        assert b"refused" in w.err or b"forbidden" in w.err.lower() or b"does not exist" in w.err, w.err.decode()
        assert not (mine / out).exists(), f"nothing written for a refused job {args}"
        assert BOB_SECRET not in w.out and VICTIM not in w.out
    # bob's job ids: the running one and the finished one.
    for job_id in ("bob-2", "bob-1"):
        w = alice("--stdout", "results.txt", want=123, job_id=job_id)
        refused_by_shadow += 1
        assert b"may not write job" in w.err or b"belongs to another identity" in w.err, w.err.decode()

    # Refused by gcwrap itself (exit 2): `..` and absolute names, plain or templated.
    for args in (("--stdout", "../bob/results.txt"), ("--stderr", "x/../../bob/live.txt"),
                 ("--stdin", "../bob/results.txt"), ("--stdout", "/etc/passwd"),
                 ("--stdout", "%j.out")):
        job_id = "../bob/results" if args[1] == "%j.out" else ""
        alice(*args, want=2, job_id=job_id)
        refused_by_agent += 1

    # Allowed, but in alice's own part of the root: bob's files are not touched.
    alice("--stdout", "bob/results.txt", want=0)
    alice("--stdout", "own.out", "--stderr", "bob/live.txt", want=0, job=["sh", "-c", "echo out; echo err >&2"])
    alice("--stdout", "bob/%j.out", want=0, job_id="alice-templated")
    alice("--stdout", "%j.out", want=0, job_id="alice-../bob/results")  # "alice-.." is a name like any other
    assert (mine / "alice-.." / "bob" / "results.out").read_bytes() == b"alice was here\n"
    assert (mine / "bob" / "results.txt").read_bytes() == b"alice was here\n"
    assert (mine / "bob" / "live.txt").read_bytes() == b"err\n"
    assert (mine / "bob" / "alice-templated.out").read_bytes() == b"alice was here\n"

    # The same names from a raw client (gcwrap refuses them before it sends them): the shadow refuses them too.
    raw = 0
    for kind in ("stdout", "stdin"):
        for name in ("../bob/results.txt", "./../bob/results.txt", "a/../../bob/results.txt", "..", "/etc/passwd",
                     "bob/../../bob/results.txt", "hardlink", "symlink", "bobdir/results.txt", "bad\nname"):
            raw += 1
            ev = site.raw("alice", Hello(f"alice-raw-{raw}", "r1", (StreamSpec(1, kind, name),)))
            assert isinstance(ev, Error) and ev.code is ErrorCode.PATH_FORBIDDEN, (kind, name, ev)
    for job_id in ("bob-1", "bob-2"):  # bob's jobs, finished and running
        raw += 1
        ev = site.raw("alice", Hello(job_id, "r1", (StreamSpec(1, "stdout", "results.txt"),)))
        assert isinstance(ev, Error) and ev.code is ErrorCode.AUTH_FAILED, (job_id, ev)

    # bob's files are as bob left them, his running job is untouched, the file outside the root too.
    assert running.wait(60) == 0, running.err.decode()
    assert live.read_bytes() == b"BOB-LIVE\nBOB-END\n"
    assert results.read_bytes() == BOB_SECRET
    assert victim.read_bytes() == VICTIM
    for path in mine.rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_nlink == 1:
            assert BOB_SECRET not in path.read_bytes() and b"BOB-LIVE" not in path.read_bytes(), path
    log = site.shadow.log()
    refusals = [line for line in log.splitlines() if "[alice]: refused:" in line]
    assert len(refusals) >= refused_by_shadow + raw, log[-3000:]
    assert all("127.0.0.1:" in line for line in refusals)
    print(f"tenancy ({site.kind}): {attempts} gcwrap attempts by alice ({refused_by_shadow} refused by the shadow, "
          f"{refused_by_agent} by gcwrap, {attempts - refused_by_shadow - refused_by_agent} landed in alice's part); "
          f"{raw} raw handshakes, all refused; {len(refusals)} refusal log lines naming peer and identity")


# -- identities: rules and configuration ---------------------------------------------------


def _serve(home: Path, *extra: str) -> tuple[int, str]:
    import subprocess

    from helpers import tool

    res = subprocess.run([*tool("gcshadow"), "serve", "--port", "0", "--root", str(home), *extra],
                         capture_output=True, timeout=30, check=False)
    return res.returncode, res.stderr.decode()


@pytest.mark.parametrize(("setup", "message"), [
    ("../evil", "is not usable as an identity"),  # the file name would not be a safe directory name
    ("same-token", "hold the same token"),
    ("open-mode", "readable by others"),
    ("group-writable-dir", "writable by others"),
    ("empty", "holds no token files"),
])
def test_token_dir_misconfigurations_are_refused(home: Path, tmp_path: Path, setup: str, message: str) -> None:
    d = tmp_path / "tokens"
    d.mkdir(mode=0o700)
    if setup == "../evil":
        _token(d / "alice")
        _token(d / "-evil")
    elif setup == "same-token":
        _token(d / "alice")
        (d / "bob").write_text((d / "alice").read_text())
        (d / "bob").chmod(0o600)
    elif setup == "open-mode":
        _token(d / "alice").chmod(0o644)
    elif setup == "group-writable-dir":
        _token(d / "alice")
        d.chmod(0o770)
    code, err = _serve(home, "--token-dir", str(d))
    assert code == 2 and message in err, err
    assert not any(home.iterdir()) or list(home.iterdir()) == [home / ".gcshadow"]


@pytest.mark.timeout(60)
def test_certificate_whose_cn_is_not_a_safe_directory_name_is_refused(home: Path, tmp_path: Path) -> None:
    ca = trustme.CA()
    pki = tmp_path / "pki"
    pki.mkdir()
    ca.cert_pem.write_to_path(str(pki / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pki / "server.pem"))
    ca.issue_cert("x@grid", common_name="..").private_key_and_cert_chain_pem.write_to_path(str(pki / "dots.pem"))
    ca.issue_cert("y@grid", common_name=".gcshadow").private_key_and_cert_chain_pem.write_to_path(
        str(pki / "state.pem"))
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["--tls-cert", str(pki / "server.pem"), "--tls-ca", str(pki / "ca.pem")])
    sh.start()
    try:
        for cert in ("dots", "state"):
            ctx = client_context(pki / "ca.pem", pki / f"{cert}.pem", None)
            ev = handshake(sh.port, Hello(f"job-{cert}", "i1", (StreamSpec(1, "stdout", "x.out"),)), ctx=ctx)
            assert isinstance(ev, Error) and ev.code is ErrorCode.AUTH_FAILED, ev
            assert "not usable as an identity" in ev.message
        assert sorted(p.name for p in home.iterdir()) == [".gcshadow"], "nothing written"
    finally:
        sh.stop()


@pytest.mark.timeout(60)
def test_a_token_of_one_identity_with_the_certificate_of_another_is_refused(home: Path, tmp_path: Path) -> None:
    ca = trustme.CA()
    pki = tmp_path / "pki"
    pki.mkdir()
    ca.cert_pem.write_to_path(str(pki / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pki / "server.pem"))
    ca.issue_cert("alice@grid", common_name="alice").private_key_and_cert_chain_pem.write_to_path(
        str(pki / "alice.pem"))
    tokens = tmp_path / "tokens"
    tokens.mkdir(mode=0o700)
    alice, bob = (_token(tokens / who).read_text().strip().encode() for who in ("alice", "bob"))
    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["--tls-cert", str(pki / "server.pem"), "--tls-ca", str(pki / "ca.pem"),
                                       "--token-dir", str(tokens)])
    sh.start()
    try:
        ctx = client_context(pki / "ca.pem", pki / "alice.pem", None)
        hello = Hello("j1", "i1", (StreamSpec(1, "stdout", "x.out"),))
        ev = handshake(sh.port, hello, token=bob, ctx=ctx)
        assert isinstance(ev, Error) and ev.code is ErrorCode.AUTH_FAILED and "certificate of CN=alice" in ev.message
        assert isinstance(handshake(sh.port, hello, token=alice, ctx=ctx), Welcome)
        assert "[alice]: refused: authentication failed: the token of bob" in sh.log()
    finally:
        sh.stop()


# -- a single-user shadow: today's layout; links refused ---------------------------------------


@pytest.mark.timeout(120)
def test_single_user_shadow_keeps_its_layout_and_refuses_links(home: Path, tmp_path: Path, shadow: ShadowProc,
                                                              spool_dir: Path) -> None:
    def run(*args: str, job: list[str] | None = None) -> Wrapper:
        w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--retry-timeout", "0.2",
                     "--retry-limit", "2", *args, "--", *(job or ["echo", "hello"])])
        w.wait(60)
        return w

    ok = run("--stdout", "plain/out.txt")
    assert ok.proc.returncode == 0 and (home / "plain" / "out.txt").read_bytes() == b"hello\n", "same path as before"
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    os.link(victim, home / "hardlink")  # a local user links a file from outside into the root
    (home / "mine.txt").write_bytes(b"MINE\n")
    os.link(home / "mine.txt", home / "second-name")  # two names of one file inside the root
    for args in (("--stdout", "hardlink"), ("--stderr", "second-name", "--stdout", "a.out"),
                 ("--stdin", "hardlink", "--stdout", "b.out"), ("--stdin", "second-name", "--stdout", "c.out")):
        w = run(*args, job=["cat"])
        assert w.proc.returncode == 123, (args, w.err.decode())
        assert b"hard link" in w.err, w.err.decode()
        assert VICTIM not in w.out and b"MINE" not in w.out
    assert victim.read_bytes() == VICTIM and (home / "mine.txt").read_bytes() == b"MINE\n"
    assert not any((home / n).exists() for n in ("a.out", "b.out", "c.out")), "nothing written for a refused job"
    assert "[anonymous]: refused:" in shadow.log()


def test_a_link_made_while_a_file_is_open_is_refused_when_it_is_reopened(tmp_path: Path) -> None:
    """The descriptor cache closes idle files and opens them again, confined
    as the first time: a link a local user made meanwhile is refused then."""
    store = Store(tmp_path / "root")
    try:
        files = store.open_job(job_id="j", instance="i", streams=[StreamSpec(1, "stdout", "out")], host="h",
                               user="u", command=[], peer="p", codes=ErrorCode, tenant="alice")
        sf = files.outputs[1]
        assert sf.name == "alice/out" and (tmp_path / "root" / "alice" / "out").is_file()
        sf.close()  # as FileCache does with a clean, idle file
        os.link(tmp_path / "root" / "alice" / "out", tmp_path / "elsewhere")
        with pytest.raises(StoreError, match="links") as e:
            sf.reopen(store.root_fd)
        assert e.value.code is ErrorCode.PATH_FORBIDDEN
        files.close()
        with pytest.raises(StoreError, match="belongs to another identity"):
            store.open_job(job_id="j", instance="i2", streams=[StreamSpec(1, "stdout", "out")], host="h",
                           user="u", command=[], peer="p", codes=ErrorCode, tenant="bob")
        assert store.owner("j") == "alice" and store.owner("new") is None
    finally:
        store.close()


def test_a_refused_job_leaves_no_file_it_would_have_made(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    try:
        root = tmp_path / "root"
        (root / "plain").write_bytes(b"KEEP\n")
        os.link(root / "plain", root / "linked")
        streams = [StreamSpec(1, "stdout", "new/out"), StreamSpec(2, "stderr", "plain"),
                   StreamSpec(3, "stdin", "linked")]
        with pytest.raises(StoreError, match="links"):
            store.open_job(job_id="j", instance="i", streams=streams, host="h", user="u", command=[], peer="p",
                           codes=ErrorCode)
        assert not (root / "new" / "out").exists(), "the file it made is removed again"
        assert (root / "plain").read_bytes() == b"KEEP\n", "and none is cut back before every one is opened"
    finally:
        store.close()


# -- names with control characters ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["new\nline", "esc\x1b[31m", "tab\there", "del\x7f", "dir\r/file"])
def test_control_characters_in_names_are_refused(home: Path, shadow: ShadowProc, spool_dir: Path, name: str) -> None:
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--stdout", name, "--", "echo", "x"])
    assert w.wait(30) == 2, w.err.decode()
    assert b"control character" in w.err
    ev = handshake(shadow.port, Hello("ctl", "i1", (StreamSpec(1, "stdout", name),)))
    assert isinstance(ev, Error) and ev.code is ErrorCode.PATH_FORBIDDEN and "control character" in ev.message, ev
    assert sorted(p.name for p in home.iterdir()) == [".gcshadow"], "nothing written"


@pytest.mark.timeout(60)
def test_control_characters_in_job_ids_are_refused(shadow: ShadowProc, spool_dir: Path) -> None:
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--job-id", "a\x01b", "--", "true"])
    assert w.wait(30) == 2 and b"--job-id" in w.err
    env = {**os.environ, "SLURM_JOB_ID": "12\n34"}
    w = Wrapper(["--shadow", shadow.address, "--spool", str(spool_dir), "--", "true"], env=env)
    assert w.wait(30) == 2 and b"control characters" in w.err, w.err.decode()


# -- before authentication -------------------------------------------------------------------------


def _header(length: int, ftype: int = 1) -> bytes:
    return struct.pack("!IB", length, ftype)


def _token_shadow(home: Path, tmp_path: Path, *extra: str) -> ShadowProc:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    sh = ShadowProc(home, logs, extra=["--token-file", str(_token(tmp_path / "token")), *extra])
    sh.start()
    return sh


@pytest.mark.timeout(60)
def test_oversized_frame_before_authentication_is_refused_from_its_header(home: Path, tmp_path: Path) -> None:
    sh = _token_shadow(home, tmp_path)
    try:
        for announced in (DEFAULT_MAX_FRAME, MAX_HANDSHAKE_FRAME + 1):
            with socket.create_connection(("127.0.0.1", sh.port), timeout=5) as s:
                s.sendall(MAGIC + _header(announced))  # the header alone: the body never comes
                conn = Connection(Role.AGENT)
                conn.send(Hello("x", "y", ()))
                conn.receive_data(s.recv(65536))  # (a timeout here: the shadow waits for a body it must refuse)
                ev = conn.next_event()
                assert isinstance(ev, Error) and ev.code is ErrorCode.FRAME_TOO_LARGE, ev
        assert "[unauthenticated]: protocol error: frame of" in sh.log()
    finally:
        sh.stop()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def _flood(port: int, pid: int, payload: bytes, n: int, limit: int, seconds: float) -> tuple[int, list[socket.socket]]:
    """Open n connections that each send `payload` (as far as the shadow takes
    it), for `seconds`; the peak RSS of the shadow meanwhile. Stops early once
    the RSS passes `limit` (the test has failed: no need to take the machine's memory)."""
    socks: list[socket.socket] = []
    left: dict[int, tuple[socket.socket, memoryview]] = {}
    poll = select.poll()
    peak = _rss(pid)
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.setblocking(False)
        socks.append(s)
        left[s.fileno()] = s, memoryview(payload)
        poll.register(s, select.POLLOUT)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and peak <= limit:
        if left:
            for fd, _ in poll.poll(50):
                s, rest = left[fd]
                try:
                    rest = rest[s.send(rest[:65536]):]
                except OSError:  # refused and closed by the shadow: as an attacker would, go on
                    rest = rest[:0]
                left[fd] = s, rest
                if not rest:
                    del left[fd]
                    poll.unregister(fd)
        else:
            time.sleep(0.05)
        peak = max(peak, _rss(pid))
    return peak, socks


@pytest.mark.timeout(180)
def test_memory_of_1000_unauthenticated_connections_is_bounded_and_returned(home: Path, tmp_path: Path) -> None:
    """As in the report: MAGIC and a HELLO header announcing 1 MiB + 64, then
    1 MiB of body, on 1,000 connections; then 1,000 that each stop just short
    of a whole (legal-sized) control frame. RSS before, at peak, after."""
    mib = 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # 1,000 sockets here too
    sh = _token_shadow(home, tmp_path, "--handshake-timeout", "30")
    try:
        assert sh.proc is not None
        pid = sh.proc.pid
        figures = []
        idle = _open_sockets(pid)  # listeners and trio's own
        oversized = MAGIC + _header(DEFAULT_MAX_FRAME) + os.urandom(mib)
        partial = MAGIC + _header(MAX_HANDSHAKE_FRAME) + os.urandom(MAX_HANDSHAKE_FRAME - 64)
        ends: dict[str, int] = {}
        for what, payload in (("oversized", oversized), ("oversized again", oversized), ("partial", partial),
                              ("partial again", partial)):
            before = _rss(pid)
            peak, socks = _flood(sh.port, pid, payload, 1000, before + 256 * mib, 6.0)
            for s in socks:
                s.close()
            wait_until(lambda: _open_sockets(pid) <= idle, 30, "the shadow closes the connections")
            time.sleep(0.5)  # (the shadow's lingering reads end within a second of a refusal)
            after = _rss(pid)
            figures.append(f"{what}: RSS before {before / mib:.1f} MiB, peak {peak / mib:.1f} MiB, "
                           f"after {after / mib:.1f} MiB")
            # Bounds: 16 MiB of handshake bytes in all, and what 1,000 connections cost in any case
            # (a trio task, a socket, a log line: about 8 MiB, which the next ones reuse).
            assert peak - before < 48 * mib, figures[-1]
            assert after - before < 20 * mib, figures[-1]
            if what == "partial":  # more than 16 MiB were offered: the rest were told BUSY
                assert "holds too many unfinished handshakes" in sh.log()
            kind = what.split()[0]
            if kind in ends:  # the memory of the first round was free: the second one reuses it
                assert after < ends[kind] + 8 * mib, figures
            ends[kind] = after
        print("1,000 unauthenticated connections, " + "; ".join(figures))
        ok = Wrapper(["--shadow", sh.address, "--spool", str(tmp_path / "spool"), "--token-file",
                      str(tmp_path / "token"), "--stdout", "after.out", "--", "echo", "still serving"])
        assert ok.wait(60) == 0, ok.err.decode()
        assert "Traceback" not in sh.log()
    finally:
        sh.stop()


def _open_sockets(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


# -- handshake fuzzing, oversized announced frames included ------------------------------------------


def _handshake_bytes() -> st.SearchStrategy[tuple[bytes, list[int]]]:
    """Bytes a peer may send before it has authenticated: MAGIC, then frames
    whose header announces any length (legal, oversized, huge) with a body of
    any length, a valid HELLO or AUTH now and then; cut into reads."""
    hello = encode(Hello("fuzz", "f1", (StreamSpec(1, "stdout", "f.out"),), nonce="00"))
    frame = st.one_of(
        st.just(hello),
        st.just(encode(Auth("00"))),
        st.builds(lambda n, t, body: _header(n, t) + body,
                  st.one_of(st.integers(0, 64), st.integers(MAX_HANDSHAKE_FRAME - 2, MAX_HANDSHAKE_FRAME + 2),
                            st.integers(MAX_HANDSHAKE_FRAME, DEFAULT_MAX_FRAME + 2), st.integers(0, 2**32 - 1)),
                  st.integers(0, 255), st.binary(max_size=64)),
    )
    data = st.tuples(st.sampled_from([MAGIC, MAGIC[:5], b""]), st.lists(frame, max_size=4)).map(
        lambda t: t[0] + b"".join(t[1]))
    return data.flatmap(lambda d: st.tuples(st.just(d), st.lists(st.integers(1, 4096), max_size=8)))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_handshake_bytes())
def test_handshake_fuzz_never_buffers_more_than_a_control_frame(case: tuple[bytes, list[int]]) -> None:
    data, cuts = case
    conn = Connection(Role.SHADOW)
    pos = 0
    for size in [*cuts, len(data)]:
        piece, pos = data[pos : pos + size], pos + size
        if not piece:
            break
        conn.receive_data(piece)
        try:
            while (ev := conn.next_event()) is not NEED_DATA:
                assert not isinstance(ev, Welcome)
        except ProtocolError as e:
            if e.code is ErrorCode.FRAME_TOO_LARGE:
                # refused from the header: the frame's body was never waited for
                assert conn.state.value.startswith("await")
            return
        # Waiting for more: never for the body of a frame longer than a
        # control frame (its header alone is refused), so before WELCOME the
        # shadow holds at most one control frame.
        assert conn.buffered <= 4 + MAX_HANDSHAKE_FRAME, (conn.buffered, conn.state)
        if data.startswith(MAGIC):
            o = len(MAGIC)
            while o + 5 <= min(pos, len(data)):
                length = struct.unpack_from("!I", data, o)[0]
                assert length <= MAX_HANDSHAKE_FRAME, f"waits for the body of a frame of {length} bytes"
                o += 4 + length


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(_handshake_bytes())
def test_live_shadow_with_a_token_answers_fuzzed_handshakes(shared_shadow: ShadowProc,
                                                            case: tuple[bytes, list[int]]) -> None:
    data, _ = case
    with socket.create_connection(("127.0.0.1", shared_shadow.port), timeout=10) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := s.recv(65536):  # the shadow answers and closes, in bounded time
                got += chunk
        except ConnectionResetError:
            got = b""
    assert shared_shadow.proc is not None and shared_shadow.proc.poll() is None, "the shadow died"
    pos = 0
    errors = []
    while pos + 5 <= len(got):  # never a WELCOME: no one authenticated
        length, ftype = struct.unpack_from("!IB", got, pos)
        assert ftype != 2, got
        if ftype == 11:
            errors.append(decode(ftype, got[pos + 5 : pos + 4 + length]))
        pos += 4 + length
    if data.startswith(MAGIC) and len(data) >= len(MAGIC) + 5:
        first = struct.unpack_from("!I", data, len(MAGIC))[0]
        if first > MAX_HANDSHAKE_FRAME and got:  # refused from its header, not as a frame cut short
            assert isinstance(errors[0], Error) and errors[0].code is ErrorCode.FRAME_TOO_LARGE, errors


@pytest.fixture(scope="module")
def shared_shadow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShadowProc]:
    d = tmp_path_factory.mktemp("fuzz")
    (d / "home").mkdir()
    sh = _token_shadow(d / "home", d, "--handshake-timeout", "2")
    try:
        yield sh
    finally:
        assert "Traceback" not in sh.log() and "internal error" not in sh.log(), sh.log()[-3000:]
        sh.stop()
