"""Agents with several shadows (`--shadow a,b`): real gcwrap and gcshadow
processes, real faults; every run byte-exact.

A job meets the shadows in an order shuffled by its job id
(gcwrap.agent.shadows.ShadowList.for_job): these tests choose job ids whose
order puts the address they want first."""

from __future__ import annotations

import socket
import subprocess
import threading
from pathlib import Path

import pytest
from faults import NS_IP, NetNS, need_netns
from helpers import (
    ShadowProc,
    Wrapper,
    expected,
    file_size,
    genjob,
    sha256_file,
    spool_status,
    tool,
    wait_until,
)

from gcwrap.agent.shadows import Address, ShadowList, parse_addresses, show

MB = 1_000_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_first_at(addresses: list[Address], first: Address, stem: str) -> str:
    """A job id whose order of `addresses` begins with `first`."""
    for i in range(1000):
        job_id = f"{stem}-{i}"
        if ShadowList.for_job(addresses, job_id).current == first:
            return job_id
    raise AssertionError("no job id puts that address first")


def listed(addresses: list[Address]) -> str:
    return ",".join(show(a) for a in addresses)


@pytest.mark.timeout(120)
def test_first_shadow_refuses_the_second_takes_it(shadow: ShadowProc, home: Path, spool_dir: Path) -> None:
    """Nothing listens at the first address: the agent moves to the second
    at once (no backoff), and says which shadow took the output."""
    dead: Address = ("127.0.0.1", free_port())
    live: Address = ("127.0.0.1", shadow.port)
    addresses = [dead, live]
    job_id = job_first_at(addresses, dead, "refused")
    size = 6 * MB
    w = Wrapper(["--shadow", listed(addresses), "--spool", str(spool_dir), "--job-id", job_id,
                 "--retry-timeout", "30", "-v", "--stdout", "f1.out", "--", *genjob(size, 0, seed=81)])
    assert w.wait(60) == 0, w.err.decode()
    assert sha256_file(home / "f1.out") == expected(size, 81)
    err = w.err.decode()
    assert f"connection refused by the shadow {show(dead)}" in err
    assert f"trying the shadow {show(live)} now (failover 1)" in err
    assert f"shadow in use: {show(live)}; 1 failover(s) to another shadow" in err
    assert "next attempt in" not in err, "a second shadow is tried at once, not after a backoff"


@pytest.mark.timeout(120)
def test_a_shadow_that_hangs_up_mid_frame_is_a_lost_connection(shadow: ShadowProc, home: Path,
                                                               spool_dir: Path) -> None:
    """The first shadow welcomes the job, then dies in the middle of sending
    a frame: the agent says it lost the connection (the shadow sent nothing
    malformed) and carries on at the second, byte-exact."""
    from gcwrap.wire.events import PROTOCOL_VERSION, Ack, Hello, Welcome
    from gcwrap.wire.protocol import NEED_DATA, Connection, Role

    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(30)
    dying: Address = ("127.0.0.1", srv.getsockname()[1])
    live: Address = ("127.0.0.1", shadow.port)
    addresses = [dying, live]
    job_id = job_first_at(addresses, dying, "hangup")
    done: list[BaseException | None] = []

    def serve() -> None:
        try:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(30)
                proto = Connection(Role.SHADOW)
                hello = None
                while hello is None:
                    proto.receive_data(conn.recv(65536))
                    while (ev := proto.next_event()) is not NEED_DATA:
                        hello = ev if isinstance(ev, Hello) else hello
                conn.sendall(proto.send(Welcome(PROTOCOL_VERSION, 1, tuple((s.id, 0) for s in hello.streams))))
                ack = proto.send(Ack(hello.streams[0].id, 0))
                conn.sendall(ack[: len(ack) // 2])
                # Its end goes out after the half frame (a FIN); what the
                # agent sends meanwhile is read, so no reset overtakes it.
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(1 << 16):
                    pass
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            done.append(e)
        finally:
            srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    size = 3 * MB
    w = Wrapper(["--shadow", listed(addresses), "--spool", str(spool_dir), "--job-id", job_id,
                 "--retry-timeout", "30", "-v", "--stdout", "h.out", "--", *genjob(size, 0, seed=83)])
    assert w.wait(60) == 0, w.err.decode()
    t.join(10)
    assert done == [None], done
    assert sha256_file(home / "h.out") == expected(size, 83)
    err = w.err.decode()
    assert "the shadow closed the connection in the middle of a frame" in err, err
    assert "TruncatedFrame" not in err and "protocol" not in err.lower(), err
    assert f"trying the shadow {show(live)} now (failover 1)" in err, err


@pytest.mark.timeout(120)
def test_first_shadow_black_holed_the_second_takes_it(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """The first address drops every packet (a host gone from the network):
    the connection times out within three heartbeats and the second shadow
    takes the job; `gcwrap status` names the shadow in use while it runs."""
    need_netns()
    logs = tmp_path / "logs"
    logs.mkdir()
    shadow = ShadowProc(home, logs)
    shadow.start()
    try:
        with NetNS() as ns:
            hole_port = 50999
            ns.blackhole(hole_port)
            hole: Address = (NS_IP, hole_port)
            live: Address = ("127.0.0.1", shadow.port)
            addresses = [hole, live]
            job_id = job_first_at(addresses, hole, "hole")
            size = 4 * MB
            w = Wrapper(["--shadow", listed(addresses), "--spool", str(spool_dir), "--job-id", job_id,
                         "--heartbeat", "0.5", "--retry-timeout", "30", "-v", "--stdout", "f2.out", "--",
                         *genjob(size, 0, seed=82, rate=1 * MB)])

            def in_use() -> bool:
                st = spool_status(spool_dir)
                return bool(st) and st[0].get("shadow_in_use") == show(live) and st[0].get("failovers") == 1

            wait_until(in_use, 30, "gcwrap status to name the shadow in use")
            text = subprocess.run([*tool("gcwrap"), "status", "--spool", str(spool_dir)], capture_output=True,
                                  timeout=60, check=True, env={"COLUMNS": "400", "PATH": ""}).stdout.decode()
            assert f"connected to {show(live)}, 1 failover(s)" in text, text
            assert w.wait(60) == 0, w.err.decode()
    finally:
        shadow.stop()
    assert sha256_file(home / "f2.out") == expected(size, 82)
    err = w.err.decode()
    assert f"connecting to the shadow {show(hole)} timed out" in err
    assert f"shadow in use: {show(live)}; 1 failover(s)" in err


@pytest.mark.timeout(120)
def test_all_shadows_dead_the_retry_limit_counts_rounds(spool_dir: Path) -> None:
    """Three addresses, none listening, --retry-limit 3: three rounds of
    three attempts, then the same exit status as with one shadow (122: the
    job ended, its output is undelivered), the message naming them all."""
    addresses: list[Address] = [("127.0.0.1", free_port()) for _ in range(3)]
    w = Wrapper(["--shadow", listed(addresses[:2]), "--shadow", show(addresses[2]), "--spool", str(spool_dir),
                 "--job-id", "nowhere", "--retry-timeout", "0.2", "--retry-limit", "3", "--stdout", "x.out", "--",
                 "echo", "lost?"])
    assert w.wait(60) == 122, w.err.decode()
    err = w.err.decode()
    order = ShadowList.for_job(addresses, "nowhere").order
    assert (f"retry limit reached: 3 consecutive rounds of failed attempts over the shadows {listed(order)} "
            "(each tried once a round) after the job ended") in err, err
    (st,) = spool_status(spool_dir)
    assert st["retries"] == 9, "three rounds of three failed attempts"
    assert parse_addresses([str(st["shadow"])]) == addresses  # (the spool records the list as given)


@pytest.mark.timeout(180)
def test_shadow_killed_and_restarted_on_the_other_address(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """The shadow in use is killed (-9) mid-stream and a new one started on
    the other address of the list, with the same root: the agent follows it
    there, twice, and the output is byte-exact."""
    logs = tmp_path / "logs"
    logs.mkdir()
    shadow = ShadowProc(home, logs)
    a: Address = ("127.0.0.1", shadow.start())
    b: Address = ("127.0.0.1", free_port())
    size, err_size = 40 * MB, 2 * MB
    w = Wrapper(["--shadow", listed([a, b]), "--spool", str(spool_dir), "--job-id", "follow", "--heartbeat", "0.5",
                 "--retry-timeout", "0.5", "--stdout", "k.out", "--stderr", "k.err", "--",
                 *genjob(size, err_size, seed=83, rate=10 * MB)])
    out = home / "k.out"
    try:
        for threshold, port in ((8 * MB, b[1]), (20 * MB, a[1])):
            wait_until(lambda t=threshold: file_size(out) > t, 60, f"{threshold} bytes at home")
            shadow.kill9()
            shadow.start(port=port)
        assert w.wait(120) == 0, w.err.decode()
    finally:
        shadow.stop()
    assert sha256_file(out) == expected(size, 83)
    assert sha256_file(home / "k.err") == expected(err_size, 84)
    err = w.err.decode()
    assert f"shadow in use: {show(a)};" in err, err
    failovers = int(err.split(f"shadow in use: {show(a)}; ")[1].split()[0])
    assert failovers >= 2, err


@pytest.mark.timeout(120)
def test_wrong_token_is_not_tried_on_every_shadow_forever(tmp_path: Path, spool_dir: Path) -> None:
    """A refusal for good (here a wrong token, the same for every shadow of
    the list) is paced as with one shadow (every --retry-timeout, a last try
    at the job's end), not carried from shadow to shadow at once; the exit
    status is today's (123)."""
    secret = tmp_path / "token"
    secret.write_text("a" * 64 + "\n")
    secret.chmod(0o600)
    wrong = tmp_path / "wrong"
    wrong.write_text("b" * 64 + "\n")
    wrong.chmod(0o600)
    shadows = []
    for i in range(2):
        home = tmp_path / f"home{i}"
        home.mkdir()
        logs = tmp_path / f"logs{i}"
        logs.mkdir()
        shadows.append(ShadowProc(home, logs, extra=["--token-file", str(secret)]))
    try:
        addresses: list[Address] = [("127.0.0.1", sh.start()) for sh in shadows]
        w = Wrapper(["--shadow", listed(addresses), "--spool", str(spool_dir), "--job-id", "badtoken",
                     "--token-file", str(wrong), "--retry-timeout", "30", "--stdout", "t.out", "--",
                     "sh", "-c", "sleep 2; echo hi"])
        assert w.wait(60) == 123, w.err.decode()
    finally:
        for sh in shadows:
            sh.stop()
    assert b"authentication failed: wrong token" in w.err
    refusals = sum(sh.log().count("authentication failed: wrong token") for sh in shadows)
    assert 1 <= refusals <= 3, f"{refusals} refusals in 2 s: the shadows were hammered"
    (st,) = spool_status(spool_dir)
    assert st["retries"] <= 3


@pytest.mark.timeout(120)
def test_resume_delivers_to_the_list_the_spool_records(home: Path, spool_dir: Path, tmp_path: Path) -> None:
    """A run that gave up with every listed shadow down leaves its spool,
    which records the list; once one of them is up, `gcwrap resume` finds
    it there without being told where."""
    addresses: list[Address] = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    size = 300_000
    w = Wrapper(["--shadow", listed(addresses), "--spool", str(spool_dir), "--job-id", "later", "--retry-timeout",
                 "0.2", "--retry-limit", "2", "--stdout", "later.out", "--", *genjob(size, 0, seed=85)])
    assert w.wait(60) == 122, w.err.decode()
    (st,) = spool_status(spool_dir)
    assert parse_addresses([str(st["shadow"])]) == addresses
    logs = tmp_path / "logs"
    logs.mkdir()
    shadow = ShadowProc(home, logs)
    shadow.start(port=addresses[1][1])
    try:
        res = subprocess.run([*tool("gcwrap"), "resume", "--spool", str(spool_dir), "--retry-timeout", "0.2"],
                             capture_output=True, timeout=60)
    finally:
        shadow.stop()
    assert res.returncode == 0, res.stderr.decode()
    assert f"all output delivered to {show(addresses[1])}".encode() in res.stderr
    assert sha256_file(home / "later.out") == expected(size, 85)
