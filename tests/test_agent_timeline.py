"""The agent's journal of its delivery, as pure objects (gcwrap.agent.timeline):
the link's clock (connected, stalled, disconnected, waiting since), the
notes for home and their frames. Driven by trio's autojump clock: time
passes with trio.sleep, no real waiting."""

from __future__ import annotations

import json

import pytest
import trio
from trio.testing import MockClock

from gcwrap.agent.timeline import NOTE_TEXT, Journal, LinkClock, Timeline, make_note, note_frames, process_started
from gcwrap.wire.events import Note, Notes
from gcwrap.wire.frames import MAX_CONTROL, MAX_NOTES
from gcwrap.wire.protocol import Connection, Role

HB = 1.0  # the heartbeat of these tests
UNIX = 1.7e9  # a Unix time for trio's clock's zero


def autojump() -> MockClock:
    return MockClock(autojump_threshold=0)


def now() -> float:
    return trio.current_time()


def journal() -> Journal:
    return Journal(HB, lambda t: UNIX + t)


def kinds(j: Journal) -> list[str]:
    return [n.kind for n in j.notes.unsent(0)]


def details(note: Note) -> dict[str, object]:
    return dict(note.details)


# -- the link's clock ----------------------------------------------------------------------------------------


def test_a_wait_longer_than_a_heartbeat_is_a_stall_counted_whole() -> None:
    async def main() -> None:
        link = LinkClock(HB)
        link.connected(now())
        link.output(now())
        await trio.sleep(0.5)
        assert link.acked(now(), pending=True) is None  # half a heartbeat: no stall
        await trio.sleep(0.2)
        link.output(now())  # (more output: it waits since the last ACK, not since now)
        await trio.sleep(3.8)
        assert link.stalled_since(now()) == pytest.approx(0.5)
        assert link.figures(now()) == pytest.approx((4.5, 4.0))  # a stall going on counts, whole
        stall = link.acked(now(), pending=False)
        assert stall is not None and stall.since == pytest.approx(0.5) and stall.seconds == pytest.approx(4.0)
        await trio.sleep(10)  # nothing waits: a quiet job is no stall
        assert link.stalled_since(now()) is None and link.waiting_since is None
        assert link.figures(now()) == pytest.approx((14.5, 4.0))

    trio.run(main, clock=autojump())


def test_bytes_moving_on_a_slow_link_are_no_stall_and_a_link_that_holds_still_is() -> None:
    """A thin link: one frame takes longer than a heartbeat to cross, but its
    bytes move (the send queue shrinks: `busy`): no stall. Once they stop
    moving, the wait is a stall from the last moment they moved."""

    async def main() -> None:
        link = LinkClock(HB)
        link.connected(now())
        link.output(now())
        for _ in range(20):  # 5 s of bytes moving, no ACK
            await trio.sleep(0.25)
            link.busy(now())
        assert link.stalled_since(now()) is None
        assert link.acked(now(), pending=True) is None and link.stalled_s == 0.0
        for _ in range(4):
            await trio.sleep(0.25)
            link.busy(now())
        await trio.sleep(3.0)  # the bytes stopped moving (a cut): 3 s since they last did
        stall = link.acked(now(), pending=False)
        assert stall is not None and stall.seconds == pytest.approx(3.0)

    trio.run(main, clock=autojump())


def test_a_send_queue_that_empties_into_a_peer_that_holds_the_bytes_is_a_stall() -> None:
    """The send queue as the watchdog sees it: shrinking while bytes remain
    is a slow link (no stall); emptying, again and again, while nothing is
    acknowledged is a peer that takes the bytes and holds them (a relay, a
    proxy): the wait is a stall counted whole. Before, any shrinking queue
    was "moving", and a relay holding a job's lines for 4 s was counted a
    2 s stall, or none, by when the watchdog happened to look."""

    async def main() -> None:
        link = LinkClock(HB)
        link.connected(now())
        link.output(now())
        start, before = now(), 0
        for i in range(16):  # 4 s: every line taken off the queue at once, nothing acknowledged
            await trio.sleep(0.25)
            queued = 120 if i % 2 else 0
            link.send_queue(now(), before, queued)
            before = queued
        stall = link.acked(now(), pending=True)
        assert stall is not None and stall.seconds == pytest.approx(now() - start)
        link.output(now())
        for queued in range(1 << 20, 0, -(1 << 16)):  # a thin link: the queue drains, still non-empty
            await trio.sleep(0.25)
            link.send_queue(now(), before, queued)
            before = queued
        assert link.stalled_since(now()) is None
        assert link.acked(now(), pending=False) is None

    trio.run(main, clock=autojump())


def test_a_dead_connection_counts_as_connected_only_until_it_last_worked() -> None:
    async def main() -> None:
        link = LinkClock(HB)
        await trio.sleep(0.3)  # gcwrap's start-up: not connected
        link.connected(now())
        link.output(now())
        for _ in range(10):  # output acknowledged every 0.2 s; the last ACK at 2.3, then the link is cut
            await trio.sleep(0.2)
            link.acked(now(), pending=True)
        await trio.sleep(0.5)
        link.worked(now())  # t = 2.8: the last PONG
        await trio.sleep(3)  # the watchdog notices at 5.8 (three heartbeats of silence)
        stall = link.closed(now())
        assert stall is None  # 0.5 s of waiting up to when it last worked: no stall
        assert link.last_worked == pytest.approx(2.8)
        assert link.figures(now()) == pytest.approx((2.5, 0.0))  # connected from 0.3 to 2.8 only
        await trio.sleep(2)  # out of reach, and reconnected at 7.8
        link.connected(now())
        link.welcomed(now(), moved=False, pending=True)
        assert link.waiting_since == pytest.approx(2.3)  # (still nothing acknowledged since then)
        await trio.sleep(0.1)
        link.acked(now(), pending=False)  # the backlog is home at 7.9
        connected, stalled = link.figures(now())
        # wall 7.9 = 2.5 + 0.1 connected; the cut's 5.1 s (from 2.8) and the start-up are not
        assert (connected, stalled) == pytest.approx((2.6, 0.0))

    trio.run(main, clock=autojump())


def test_a_stall_that_ends_with_the_connection_lasts_until_it_last_worked() -> None:
    """Bytes vanish while heartbeats are answered: the stall runs up to the
    last PONG, the rest of the connection's life is time off the link."""

    async def main() -> None:
        link = LinkClock(HB)
        link.connected(now())
        link.output(now())
        link.acked(now(), pending=True)
        for _ in range(5):  # PONGs for 5 s, no ACK
            await trio.sleep(1)
            link.worked(now())
        await trio.sleep(0.5)
        stall = link.closed(now())
        assert stall is not None and stall.seconds == pytest.approx(5.0)
        assert link.figures(now()) == pytest.approx((5.0, 5.0))
        assert link.stalls == 1

    trio.run(main, clock=autojump())


def test_a_welcome_that_holds_more_restarts_the_wait() -> None:
    link = LinkClock(HB)
    link.output(1.0)
    link.connected(5.0)
    link.welcomed(5.1, moved=True, pending=True)
    assert link.waiting_since == 5.1
    link.welcomed(5.2, moved=False, pending=False)
    assert link.waiting_since is None


# -- notes ---------------------------------------------------------------------------------------------------


def test_notes_are_kept_bounded_newest_first_out_until_confirmed() -> None:
    t = Timeline(kept=3)
    for i in range(5):
        t.add(make_note(float(i), "k"))
    assert [n.time for n in t.unsent(0)] == [2.0, 3.0, 4.0] and t.dropped == 2
    assert t.has_unsent(4) and not t.has_unsent(5)
    assert [n.time for n in t.unsent(4)] == [4.0]
    t.confirmed(4)  # (numbered from 1: the note of time 3.0 is number 4)
    assert [n.time for n in t.unsent(0)] == [4.0]
    t.confirmed(5)
    assert not t.has_unsent(0)


def test_note_text_is_bounded_and_unicode() -> None:
    note = make_note(1.23456, "refused", message="x" * 2000, shadow="a\x00b\udcff")
    d = details(note)
    assert note.time == 1.235
    assert len(str(d["message"])) == NOTE_TEXT
    assert d["shadow"] == "a\\0b\\udcff"
    Connection(Role.AGENT)  # (the encoder's checks are the protocol's; see the frames test below)


def test_many_notes_go_in_frames_the_protocol_takes() -> None:
    big = [make_note(float(i), "stalled", **{f"d{k}": "é" * 500 for k in range(16)}) for i in range(40)]
    small = [make_note(float(i), "disk", full=True, reason="r") for i in range(200)]
    for notes in (big, small):
        frames = note_frames(notes)
        assert [n for f in frames for n in f.notes] == notes  # all, in order
        for f in frames:
            assert 1 <= len(f.notes) <= MAX_NOTES
            body = json.dumps({"notes": [[n.time, n.kind, dict(n.details)] for n in f.notes]},
                              separators=(",", ":"), ensure_ascii=False).encode()
            assert len(body) <= MAX_CONTROL
    assert len(note_frames(big)) > 1 and len(note_frames(small)) == 4
    # And the protocol's own encoder takes each of them.
    from gcwrap.wire.frames import encode

    for f in note_frames(big):
        assert isinstance(f, Notes) and encode(f)


# -- the journal: what becomes a note --------------------------------------------------------------------------


def test_a_stall_a_loss_and_a_reconnection_become_notes_in_order() -> None:
    async def main() -> None:
        j = journal()
        link = j.link
        link.connected(now())
        link.output(now())
        j.acked(now(), True, "h:1")
        await trio.sleep(3)
        j.acked(now(), True, "h:1")  # a 3 s stall ends
        await trio.sleep(0.4)
        link.worked(now())  # t = 3.4: the last frame; the watchdog notices at 6.4
        await trio.sleep(3)
        j.session_ended(now(), "h:1", True, "no answer from the shadow h:1", attempts=1)
        await trio.sleep(1.5)  # two failed attempts, then the third is welcomed at 7.9
        link.connected(now())
        j.welcomed(now(), "h:1", attempts=4, first=False, since_start=7.9)
        notes = j.notes.unsent(0)
        assert [n.kind for n in notes] == ["stalled", "connection_lost", "reconnected"]
        assert [n.time for n in notes] == [UNIX + 3, UNIX + 6.4, UNIX + 7.9]
        assert details(notes[0]) == {"since": UNIX, "seconds": 3.0, "shadow": "h:1"}
        assert details(notes[1]) == {"reason": "no answer from the shadow h:1", "worked_at": UNIX + 3.4,
                                     "shadow": "h:1"}
        assert details(notes[2]) == {"after_s": 4.5, "shadow": "h:1", "attempts": 3}

    trio.run(main, clock=autojump())


def test_refusals_are_noted_once_until_they_change_or_a_welcome() -> None:
    j = journal()
    for _ in range(3):
        j.refused(1.0, "BUSY", "busy", "h:1")
    j.refused(2.0, "AUTH_FAILED", "bad token", "h:1")
    j.welcomed(3.0, "h:1", attempts=5, first=True, since_start=3.0)
    j.refused(4.0, "AUTH_FAILED", "bad token", "h:1")
    assert kinds(j) == ["refused", "refused", "connected", "refused"]
    assert details(j.notes.unsent(0)[2]) == {"after_s": 3.0, "shadow": "h:1", "attempts": 5}


def test_a_refused_connection_is_lost_without_a_connection_lost_note() -> None:
    j = journal()
    j.link.connected(0.0)
    j.session_ended(1.0, "h:1", True, "", attempts=1)
    assert kinds(j) == []
    j.link.connected(2.0)
    j.welcomed(2.0, "h:1", attempts=2, first=False, since_start=2.0)
    assert kinds(j) == ["reconnected"]


def test_compression_is_noted_when_it_turns() -> None:
    j = journal()
    j.compression(1.0, False, "x")
    j.compression(2.0, True, "the link is the bottleneck")
    j.compression(3.0, True, "still")
    j.compression(4.0, False, "no longer compresses")
    assert [(n.kind, details(n)["on"]) for n in j.notes.unsent(0)] == [("compression", True), ("compression", False)]


def test_the_process_start_is_the_kernels() -> None:
    """A fresh interpreter: its start lies before its first line of code, by
    the interpreter's own start-up (a few tens of ms; seconds on a busy machine)."""
    import subprocess
    import sys

    code = ("import time; t = time.monotonic(); import gcwrap.agent.timeline as tl; "
            "print(t - tl.process_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert 0.0 < float(out.stdout) < 10.0, out.stdout
    assert process_started() < __import__("time").monotonic()


# -- in words ---------------------------------------------------------------------------------------------------


def test_the_summary_says_the_stalls_of_the_time_connected() -> None:
    from gcwrap.render import summary_lines, summary_rows

    figures = {"stdout_bytes": 10, "wall_s": 20.0, "throughput_mb_s": 0.0, "connected_s": 18.0, "stalled_s": 10.04,
               "disconnected_s": 2.0, "paused_s": 0.0, "connections": 1, "reconnects": 0, "failed_attempts": 0}
    lines = summary_lines("j", 0, figures)
    assert lines[2] == "  connected 18.0 s (stalled 10.0 s), disconnected 2.0 s, job paused 0.0 s"
    assert "stalled" not in summary_lines("j", 0, {**figures, "stalled_s": 0.0})[2]
    assert "stalled" not in summary_lines("j", 0, {k: v for k, v in figures.items() if k != "stalled_s"})[2]
    # At home the summary comes as text: the same words.
    assert ("stalled (connected, nothing acknowledged)", "10.0 s") in summary_rows({"stalled_s": "10.04"})


def test_gcwrap_status_says_how_long_nothing_was_acknowledged() -> None:
    from gcwrap.render import status_details
    from gcwrap.status import ack_age

    spool = {"job_id": "j", "spool": "/s", "shadow": "h:1", "connected": True, "retries": 0, "streams": []}
    assert ack_age({"waiting_since": 100.0}, 112.4) == 12.4
    assert ack_age({"waiting_since": None}, 112.4) is None and ack_age({}, 1.0) is None
    assert ack_age({"waiting_since": True}, 5.0) is None
    text = " ".join(status_details([{**spool, "last_ack_age_s": 12.4}]))
    assert "(connected)" in text and text.endswith("; nothing acknowledged for 12 s")
    assert "nothing" not in " ".join(status_details([{**spool, "last_ack_age_s": 0.6}]))  # (a round trip)
    assert "nothing" not in " ".join(status_details([{**spool, "last_ack_age_s": None}]))


def test_why_compression_turned_is_said_in_words() -> None:
    from gcwrap.agent.timeline import compression_why
    from gcwrap.wire import compress as zc

    assert compression_why(zc.Policy(zc.Mode.ZSTD, 0.0)).startswith("--compress zstd")
    auto = zc.Policy(zc.Mode.AUTO, 0.0)
    assert compression_why(auto) == "a new connection starts uncompressed"
    auto.active, auto.link_rate, auto.ratio = True, 250_000.0, 0.2
    auto.history.append((1.0, True))
    assert compression_why(auto) == ("the link is the bottleneck (0.25 MB/s) "
                                     "and the output compresses to 20% of its size")
    auto.active, auto.ratio = False, 0.95
    assert compression_why(auto) == "the output no longer compresses well (to 95% of its size)"
    auto.ratio = 0.2
    assert "fits the link uncompressed" in compression_why(auto)
