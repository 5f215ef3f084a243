"""A real gcshadow, spoken to by a raw protocol client over loopback.

These are the things an honest gcwrap never does (names that escape the
root, gaps, garbage, two sessions of one job), so they are driven with the
sans-I/O Connection directly.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ShadowProc, file_size, wait_until
from rawagent import RawAgent, connect

from gcwrap.wire.events import (
    Ack,
    ConnectionClosed,
    Data,
    Done,
    Error,
    ErrorCode,
    Event,
    Exit,
    Hello,
    Ping,
    Pong,
    StdinData,
    StdinRead,
    StreamSpec,
    Welcome,
    ZData,
)
from gcwrap.wire.protocol import MAGIC, Connection, Role, encode


def hello(job: str, instance: str = "i1", out: str = "o", **kw: str) -> Hello:
    streams = [StreamSpec(1, "stdout", out)]
    if "stdin" in kw:
        streams.append(StreamSpec(0, "stdin", kw["stdin"]))
    return Hello(job_id=job, instance=instance, streams=tuple(streams), host="test")


def welcome(agent: RawAgent, h: Hello) -> Welcome:
    agent.send(h)
    ev = agent.next()
    assert isinstance(ev, Welcome), ev
    return ev


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["../x", "/etc/x", "a/../../x", ".gcshadow/state.db", ""])
def test_names_that_escape_are_refused(shadow: ShadowProc, home: Path, tmp_path: Path, name: str) -> None:
    a = RawAgent(shadow.port)
    a.send(hello("esc", out=name))
    ev = a.next()
    assert isinstance(ev, Error) and ev.code is ErrorCode.PATH_FORBIDDEN, ev
    assert isinstance(a.next(), ConnectionClosed)
    a.close()
    assert not (tmp_path / "x").exists() and not Path("/etc/x").exists()
    # the shadow keeps serving others
    b = RawAgent(shadow.port)
    assert isinstance(welcome(b, hello("fine", out="fine.out")), Welcome)
    b.close()


@pytest.mark.timeout(60)
def test_fifo_and_directory_names_refused(shadow: ShadowProc, home: Path) -> None:
    os.mkfifo(home / "fifo")
    (home / "adir").mkdir()
    for name in ("fifo", "adir"):
        a = RawAgent(shadow.port)
        a.send(hello(f"special-{name}", out=name))
        ev = a.next()
        assert isinstance(ev, Error) and ev.code is ErrorCode.PATH_FORBIDDEN, ev
        a.close()


@pytest.mark.timeout(60)
def test_gap_refused_trim_and_ack(shadow: ShadowProc, home: Path) -> None:
    a = RawAgent(shadow.port)
    w = welcome(a, hello("gappy", out="gap.out"))
    assert w.durable == ((1, 0),)
    a.send(Data(1, 0, b"hello "))
    a.send(Data(1, 3, b"lo world"))  # overlaps: only "world" is new
    ack = a.until(Ack)
    while isinstance(ack, Ack) and ack.offset < 11:
        ack = a.until(Ack)
    assert ack == Ack(1, 11)
    assert (home / "gap.out").read_bytes() == b"hello world"
    a.send(Data(1, 20, b"!"))
    ev = a.until(Error)
    assert isinstance(ev, Error) and ev.code is ErrorCode.OFFSET_GAP
    assert (home / "gap.out").read_bytes() == b"hello world"


@pytest.mark.timeout(60)
def test_garbage_gets_an_error_and_the_shadow_lives(shadow: ShadowProc) -> None:
    for junk in (b"GET / HTTP/1.1\r\n\r\n", MAGIC + b"\x00\x00\x00\x05\x01{{{{", MAGIC + b"\xff\xff\xff\xff\x03",
                 os.urandom(4096)):
        s = connect(shadow.port)
        s.sendall(junk)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        s.close()
        conn = Connection(Role.AGENT)
        conn.receive_data(got)
        conn.receive_data(b"")
        ev = conn.next_event()
        assert isinstance(ev, Error) and ev.code in (ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE), ev
    a = RawAgent(shadow.port)
    assert isinstance(welcome(a, hello("alive", out="alive.out")), Welcome)


@pytest.mark.timeout(60)
def test_newer_connection_fences_the_older(shadow: ShadowProc, home: Path) -> None:
    a = RawAgent(shadow.port)
    welcome(a, hello("fence", out="f.out"))
    a.send(Data(1, 0, b"abc"))
    assert a.until(Ack) == Ack(1, 3)
    b = RawAgent(shadow.port)
    wb = welcome(b, hello("fence", out="f.out"))
    assert wb.durable == ((1, 3),)
    ev = a.until(Error)
    assert isinstance(ev, Error) and ev.code is ErrorCode.FENCED
    try:
        a.sock.sendall(encode(Data(1, 3, b"OLD")))  # past our own state machine: must never land
    except OSError:
        pass
    b.send(Data(1, 3, b"def"))
    assert b.until(Ack) == Ack(1, 6)
    assert (home / "f.out").read_bytes() == b"abcdef"
    b.send(Exit(0, None, ((1, 6),)))
    assert isinstance(b.until(Done), Done)


@pytest.mark.timeout(60)
def test_new_attempt_truncates_old_attempt_is_stale(shadow: ShadowProc, home: Path) -> None:
    a = RawAgent(shadow.port)
    welcome(a, hello("attempts", instance="first", out="att.out"))
    a.send(Data(1, 0, b"first attempt"))
    assert a.until(Ack) == Ack(1, 13)
    a.close()
    b = RawAgent(shadow.port)
    assert welcome(b, hello("attempts", instance="second", out="att.out")).durable == ((1, 0),)
    assert (home / "att.out").read_bytes() == b""
    b.send(Data(1, 0, b"second"))
    assert b.until(Ack) == Ack(1, 6)
    b.close()
    c = RawAgent(shadow.port)
    c.send(hello("attempts", instance="first", out="att.out"))
    ev = c.until(Welcome)
    assert isinstance(ev, Error) and ev.code is ErrorCode.STALE_ATTEMPT
    assert (home / "att.out").read_bytes() == b"second"


@pytest.mark.timeout(60)
def test_torn_tail_is_cut_back_on_restart(shadow: ShadowProc, home: Path) -> None:
    a = RawAgent(shadow.port)
    welcome(a, hello("torn", out="torn.out"))
    a.send(Data(1, 0, b"durable bytes"))
    assert a.until(Ack) == Ack(1, 13)
    shadow.kill9()
    a.close()
    with open(home / "torn.out", "ab") as f:
        f.write(b"\x00garbage that was never acknowledged")  # a torn/unsynced tail
    shadow.start()
    b = RawAgent(shadow.port)
    assert welcome(b, hello("torn", out="torn.out")).durable == ((1, 13),)
    assert (home / "torn.out").read_bytes() == b"durable bytes"
    b.send(Data(1, 13, b" and more"))
    assert b.until(Ack) == Ack(1, 22)
    assert (home / "torn.out").read_bytes() == b"durable bytes and more"


@pytest.mark.timeout(60)
def test_file_shortened_behind_the_shadows_back_is_refused(shadow: ShadowProc, home: Path) -> None:
    a = RawAgent(shadow.port)
    welcome(a, hello("short", out="short.out"))
    a.send(Data(1, 0, b"0123456789"))
    assert a.until(Ack) == Ack(1, 10)
    a.close()
    wait_until(lambda: file_size(home / "short.out") == 10, 10, "the file")
    os.truncate(home / "short.out", 4)
    b = RawAgent(shadow.port)
    b.send(hello("short", out="short.out"))
    ev = b.until(Welcome)
    assert isinstance(ev, Error) and ev.code is ErrorCode.LENGTH_MISMATCH
    assert "truncated or replaced" in ev.message


@pytest.mark.timeout(60)
def test_stdin_by_offset_and_ping(shadow: ShadowProc, home: Path) -> None:
    (home / "in.txt").write_bytes(b"0123456789" * 10)
    a = RawAgent(shadow.port)
    welcome(a, hello("reader", out="r.out", stdin="in.txt"))
    a.send(StdinRead(0, 95, 100))
    assert a.until(StdinData) == StdinData(0, 95, b"56789", True)
    a.send(StdinRead(0, 10, 5))
    assert a.until(StdinData) == StdinData(0, 10, b"01234", False)
    a.send(Ping(42))
    assert a.until(Pong) == Pong(42)


@pytest.mark.timeout(60)
def test_missing_stdin_refused(shadow: ShadowProc) -> None:
    a = RawAgent(shadow.port)
    a.send(hello("nostdin", out="n.out", stdin="missing.txt"))
    ev = a.until(Welcome)
    assert isinstance(ev, Error) and ev.code is ErrorCode.NOT_FOUND


@pytest.mark.timeout(60)
def test_exit_with_wrong_lengths_refused(shadow: ShadowProc) -> None:
    a = RawAgent(shadow.port)
    welcome(a, hello("liar", out="liar.out"))
    a.send(Data(1, 0, b"abc"))
    assert a.until(Ack) == Ack(1, 3)
    a.send(Exit(0, None, ((1, 5),)))
    ev = a.until(Done)
    assert isinstance(ev, Error) and ev.code is ErrorCode.LENGTH_MISMATCH


@pytest.mark.timeout(60)
def test_second_shadow_on_same_root_refused(shadow: ShadowProc, home: Path, tmp_path: Path) -> None:
    import subprocess

    from helpers import tool

    res = subprocess.run([*tool("gcshadow"), "serve", "--port", "0", "--root", str(home)], capture_output=True,
                         timeout=30)
    assert res.returncode == 1
    assert b"another gcshadow is already serving" in res.stderr


# -- two sessions of one job at once ----------------------------------------------------


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _race_two_hellos(port: int, h: Hello, content: bytes, chunk: int = 16 << 10) -> list[list[str]]:
    """Two agents of one job send the same HELLO at the same instant, then
    each streams `content` from where its WELCOME says and finishes. Returns
    what each saw, in order: "welcome", "ack", "fenced", "done", "error:CODE"."""
    import threading

    start = threading.Barrier(2)
    seen: list[list[str]] = [[], []]
    # Prepared before the barrier: the two HELLOs leave within microseconds.
    agents = [RawAgent(port), RawAgent(port)]

    def one(i: int) -> None:
        a, log = agents[i], seen[i]
        hello_bytes = a.conn.send(h)
        try:
            start.wait(10)
            a.sock.sendall(hello_bytes)
            ev = a.next()
            if not isinstance(ev, Welcome):
                log.append(f"error:{ev.code.name}" if isinstance(ev, Error) else type(ev).__name__)
                return
            log.append("welcome")
            pos = dict(ev.durable)[1]
            # A WELCOME that holds it all (the other session made every byte
            # durable before it was fenced) is the acknowledgement: nothing
            # is sent, and no ACK will come.
            waiting = pos < len(content)
            while pos < len(content):
                a.send(Data(1, pos, content[pos : pos + chunk]))
                pos = min(len(content), pos + chunk)
            while waiting:
                ev = a.next()
                if isinstance(ev, Ack):
                    log.append("ack")
                    waiting = ev.offset < len(content)
                    continue
                if isinstance(ev, Error):
                    log.append("fenced" if ev.code is ErrorCode.FENCED else f"error:{ev.code.name}")
                    return
                if isinstance(ev, ConnectionClosed):
                    log.append("closed")
                    return
            a.send(Exit(0, None, ((1, len(content)),)))
            ev = a.next()
            log.append("done" if isinstance(ev, Done) else
                       "fenced" if isinstance(ev, Error) and ev.code is ErrorCode.FENCED else repr(ev))
        except OSError as e:  # the shadow closed a fenced connection under our feet
            log.append(f"oserror:{e.errno}")
        finally:
            a.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "an agent hung"
    return seen


@pytest.mark.timeout(120)
def test_two_identical_hellos_at_once_one_session_holds_the_job(shadow: ShadowProc, home: Path) -> None:
    """A relay delivers an abandoned connection attempt together with the
    current one: two identical HELLOs within microseconds. At most one session
    holds the job (a welcomed one is fenced by the later one before it can
    finish), exactly one finishes, and the file is byte-exact: no hole."""
    import hashlib

    assert shadow.proc is not None
    content = random.Random(7).randbytes(600_000)
    fds_before = _open_fds(shadow.proc.pid)
    for round_ in range(20):
        name = f"race{round_}.out"
        seen = _race_two_hellos(shadow.port, hello(f"race{round_}", out=name), content)
        holders = [s for s in seen if "welcome" in s and "fenced" not in s and not any("error" in x for x in s)]
        assert len(holders) <= 1, f"round {round_}: two sessions held the job: {seen}"
        assert sum("done" in s for s in seen) == 1, f"round {round_}: {seen}"
        data = (home / name).read_bytes()
        assert len(data) == len(content), f"round {round_}: {len(data)} bytes landed"
        assert hashlib.sha256(data).digest() == hashlib.sha256(content).digest(), f"round {round_}: bytes differ"
    # Every raced session's files are closed again (not one descriptor per round).
    wait_until(lambda: _open_fds(shadow.proc.pid) <= fds_before + 2, 10, "the raced sessions' files to close")


@pytest.mark.timeout(120)
def test_jobs_per_identity_cap_holds_for_hellos_at_once(home: Path, tmp_path: Path) -> None:
    """Two jobs of one identity, capped at one live job, send HELLO at the
    same instant: the cap is checked and the job claimed with no await
    between, so at most one of them is welcomed (the other is told BUSY)."""
    import threading

    logs = tmp_path / "logs"
    logs.mkdir()
    sh = ShadowProc(home, logs, extra=["--max-jobs-per-identity", "1"])
    sh.start()
    decided = 0

    # Each thread gets its round's objects: a thread still waiting past its
    # join never reads the next round's agents.
    def one(start: threading.Barrier, agent: RawAgent, frame: bytes, answers: list[Event | None], i: int) -> None:
        start.wait(10)
        agent.sock.sendall(frame)
        answers[i] = agent.next()

    try:
        for round_ in range(20):
            agents = [RawAgent(sh.port), RawAgent(sh.port)]
            frames = [a.conn.send(hello(f"cap{round_}-{i}", out=f"cap{round_}-{i}.out")) for i, a in enumerate(agents)]
            start = threading.Barrier(2)
            answers: list[Event | None] = [None, None]
            threads = [threading.Thread(target=one, args=(start, agents[i], frames[i], answers, i)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            welcomed = [a for a in answers if isinstance(a, Welcome)]
            assert len(welcomed) <= 1, f"round {round_}: both jobs welcomed past the cap: {answers}"
            busy = [a for a in answers if isinstance(a, Error) and a.code is ErrorCode.BUSY]
            decided += len(welcomed) == 1 and len(busy) == 1
            for a in agents:  # end both, and wait until the shadow has let go of the welcomed one
                a.close()
            wait_until(lambda: "cap" not in _live_jobs(home), 10, "the jobs to be released")
    finally:
        sh.stop()
    assert decided >= 10, "the rounds were not races"


def _live_jobs(home: Path) -> str:
    import subprocess

    from helpers import tool

    res = subprocess.run([*tool("gcshadow"), "jobs", "--json", "--root", str(home)], capture_output=True, timeout=30)
    import json

    return " ".join(j["job_id"] for j in json.loads(res.stdout or b"[]") if j["state"] == "streaming")


# -- compressed DATA (the "zstd" feature) ------------------------------------


def _acked_to(agent: RawAgent, end: int) -> None:
    ack = agent.until(Ack)
    while isinstance(ack, Ack) and ack.offset < end:
        ack = agent.until(Ack)
    assert ack == Ack(1, end), ack


@pytest.mark.timeout(60)
def test_zdata_lands_as_the_jobs_bytes_and_overlaps_are_trimmed(shadow: ShadowProc, home: Path) -> None:
    from gcwrap.wire.compress import Codec

    codec = Codec()
    text = b"".join(b"step %d loss=0.%06d\n" % (i, i * 7919 % 1000000) for i in range(20000))
    a = RawAgent(shadow.port)
    w = welcome(a, replace(hello("zjob", out="z.out"), features=("zstd", "some-later-feature")))
    assert w.features == ("zstd",)  # what it knows of what was offered
    half = len(text) // 2
    a.send(ZData(1, 0, half, codec.compress(text[:half])))
    a.send(Data(1, half, text[half : half + 10]))  # plain and compressed frames mix
    # A resend that overlaps what landed: only the new bytes are written.
    a.send(ZData(1, half - 100, len(text) - half + 100, codec.compress(text[half - 100 :])))
    _acked_to(a, len(text))
    assert (home / "z.out").read_bytes() == text


@pytest.mark.timeout(60)
def test_a_zdata_bomb_is_refused_and_nothing_of_it_written(shadow: ShadowProc, home: Path) -> None:
    import zstandard

    a = RawAgent(shadow.port)
    welcome(a, replace(hello("zbomb", out="bomb.out"), features=("zstd",)))
    a.send(Data(1, 0, b"before\n"))
    _acked_to(a, 7)
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (256 << 20))  # 256 MiB in a few KiB
    a.send(ZData(1, 7, 1 << 20, bomb))
    ev = a.until(Error)
    assert isinstance(ev, Error) and ev.code is ErrorCode.BAD_FRAME and "holds 268435456 bytes" in ev.message
    assert (home / "bomb.out").read_bytes() == b"before\n"
    assert int(Path(f"/proc/{shadow.proc.pid}/status").read_text().split("VmHWM:")[1].split()[0]) < 200 << 10  # KiB


@pytest.mark.timeout(60)
def test_an_agent_that_offers_nothing_gets_the_welcome_older_agents_know(shadow: ShadowProc) -> None:
    sock = connect(shadow.port)
    sock.sendall(MAGIC + encode(hello("plain", out="plain.out")))
    conn = Connection(Role.SHADOW)  # only to cut the reply into frames
    raw = b""
    while len(raw) < 5 or len(raw) < 4 + int.from_bytes(raw[:4], "big"):
        chunk = sock.recv(65536)
        assert chunk, "the shadow closed"
        raw += chunk
    assert raw[4] == 2 and b'"features"' not in raw[5 : 4 + int.from_bytes(raw[:4], "big")]  # WELCOME
    del conn


# -- DATA written in pieces, as it arrives -------------------------------------


@pytest.mark.timeout(60)
def test_a_frame_lands_as_it_arrives_but_counts_only_whole(shadow: ShadowProc, home: Path) -> None:
    """The pieces of a DATA frame are in the file before the frame is whole
    (a frame gathered first would show nothing of it); none of it is
    acknowledged or recorded durable until all of it is in; after the
    connection died mid-frame the resend writes the same bytes at the same
    offsets, once."""
    a = RawAgent(shadow.port)
    welcome(a, hello("pieces", out="p.out"))
    a.send(Data(1, 0, b"head:"))
    _acked_to(a, 5)
    payload = os.urandom(900_000)
    frame = a.conn.send(Data(1, 5, payload))
    half = 500_000
    a.sock.sendall(frame[:half])
    wait_until(lambda: file_size(home / "p.out") >= 5 + half - 14, 20, "the frame's first half in the file")
    assert (home / "p.out").read_bytes()[5:] == payload[: file_size(home / "p.out") - 5]
    b = RawAgent(shadow.port)  # a newer session of the job fences the first, mid-frame
    assert welcome(b, hello("pieces", out="p.out")).durable == ((1, 5),)  # nothing of the half frame
    seen = []
    while not isinstance(ev := a.next(), (Error, ConnectionClosed)):
        seen.append(ev)
    assert isinstance(ev, Error) and ev.code is ErrorCode.FENCED, ev
    assert all(not isinstance(e, Ack) or e.offset <= 5 for e in seen), seen  # never acked past the whole frames
    assert (home / "p.out").read_bytes() == b"head:"  # the new session cut the file back to its durable length
    b.send(Data(1, 0, b"head:" + payload[:1000]))  # a resend overlapping what is held
    b.send(Data(1, 1005, payload[1000:]))
    _acked_to(b, 5 + len(payload))
    assert (home / "p.out").read_bytes() == b"head:" + payload
    b.send(Exit(0, None, ((1, 5 + len(payload)),)))
    assert isinstance(b.until(Done), Done)


@pytest.mark.timeout(60)
def test_an_agent_that_hangs_up_mid_frame_is_a_lost_connection(shadow: ShadowProc, home: Path) -> None:
    """An agent gone in the middle of a DATA frame (it gave up on a shadow
    that seemed dead, its host died) sent nothing malformed: the shadow says
    the connection was lost, not that the agent broke the protocol, and
    holds only the whole frames before it."""
    a = RawAgent(shadow.port)
    welcome(a, hello("hangup", out="h.out"))
    a.send(Data(1, 0, b"whole"))
    _acked_to(a, 5)
    frame = a.conn.send(Data(1, 5, os.urandom(300_000)))
    a.sock.sendall(frame[:100_000])
    wait_until(lambda: file_size(home / "h.out") > 5, 20, "part of the frame in the file")
    a.close()
    wait_until(lambda: "middle of a frame" in shadow.log(), 20, "the shadow's word on the hang-up")
    said = [line for line in shadow.log().splitlines() if "middle of a frame" in line]
    assert len(said) == 1 and "connection lost (connection closed in the middle of a frame)" in said[0], said
    assert "protocol error" not in shadow.log(), shadow.log()
    b = RawAgent(shadow.port)
    assert welcome(b, hello("hangup", out="h.out")).durable == ((1, 5),)
    assert (home / "h.out").read_bytes() == b"whole"


@pytest.mark.timeout(60)
def test_a_welcome_that_holds_everything_is_the_acknowledgement(shadow: ShadowProc, home: Path) -> None:
    """A session fenced after it made all of the job's bytes durable: the
    newer session's WELCOME says the shadow holds them all, which is their
    acknowledgement (no ACK follows: nothing new became durable); the agent
    sends no byte again and its EXIT finishes the job."""
    content = os.urandom(200_000)
    a = RawAgent(shadow.port)
    welcome(a, hello("all-held", out="all.out"))
    a.send(Data(1, 0, content))
    _acked_to(a, len(content))
    b = RawAgent(shadow.port)
    assert welcome(b, hello("all-held", out="all.out")).durable == ((1, len(content)),)
    ev = a.until(Error)
    assert isinstance(ev, Error) and ev.code is ErrorCode.FENCED, ev
    b.send(Exit(0, None, ((1, len(content)),)))
    assert isinstance(b.next(), Done)  # the very next frame: no ACK came before it
    assert (home / "all.out").read_bytes() == content


@pytest.mark.timeout(60)
def test_an_agent_that_hangs_up_between_frames_is_said(shadow: ShadowProc, home: Path) -> None:
    """An agent that closes its connection before its EXIT, between two
    frames (it gave up on the connection), ends the session with a word in
    the log, as one cut off mid-frame does: not in silence."""
    a = RawAgent(shadow.port)
    welcome(a, hello("between", out="b.out"))
    a.send(Data(1, 0, b"whole frame"))
    _acked_to(a, 11)
    a.close()
    wait_until(lambda: "closed by the agent" in shadow.log(), 20, "the shadow's word on the hang-up")
    (said,) = [line for line in shadow.log().splitlines() if "closed by the agent" in line]
    assert "[anonymous]: connection lost (closed by the agent)" in said, said
    assert (home / "b.out").read_bytes() == b"whole frame"
