"""Running a job under gcwrap: start it with pipes for the named streams,
run the agent's tasks beside it, forward signals, end it when asked, and
say what happened (`Outcome`); and `gcwrap resume`, which delivers what a
spool left behind.

Tasks, all in one nursery: one `Agent.read_pipe` per output stream,
`Agent.commit_loop` (the only writer of the spool), `Agent.deliver_loop`
(connect, run a session, back off, repeat), `_write_stdin`, `live_loop`
and `_forward_signals`. They share state through the agent's `Outbox` and
wake each other with its one `changed` signal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import trio

from .. import exitcodes
from ..render import human_bytes
from ..sync import worst_error
from ..wire.events import STDERR, STDOUT, Exit, StreamSpec
from .addresses import show, show_all
from .agent import Agent
from .launch import Launched, Start, lock_spool, not_started, prepare, stream_specs
from .options import AgentOptions
from .records import JobRecord, Outcome
from .retry import describe
from .spool import Spool, SpoolError
from .spooler import Spooler
from .spoolfiles import SpoolFiles
from .stopsignals import stop_signals
from .timeline import process_started

log = logging.getLogger("gcwrap")

KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL when gcwrap ends the job
DRAIN_GRACE = 2.0  # seconds to read what a job's pipes still hold after gcwrap ended it


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Job:
    """The job's process (started by `launch`), as the event loop waits for
    it and signals it; its pipes' ends as trio streams."""

    def __init__(self, launched: Launched) -> None:
        self.popen = launched.popen
        self.pid = launched.popen.pid
        self.pidfd = launched.pidfd
        self.stdin = None if launched.stdin is None else trio.lowlevel.FdStream(launched.stdin)
        self.stdout = None if launched.stdout is None else trio.lowlevel.FdStream(launched.stdout)
        self.stderr = None if launched.stderr is None else trio.lowlevel.FdStream(launched.stderr)
        self._lock = trio.Lock()  # (one task at a time waits on the pidfd)

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        async with self._lock:
            if self.popen.poll() is None:
                if self.pidfd is not None:
                    await trio.lowlevel.wait_readable(self.pidfd)
                else:
                    await trio.to_thread.run_sync(os.waitid, os.P_PID, self.pid, os.WEXITED | os.WNOWAIT,
                                                  abandon_on_cancel=True)
                self.popen.wait()
                if self.pidfd is not None:
                    trio.lowlevel.notify_closing(self.pidfd)
                    os.close(self.pidfd)
                    self.pidfd = None
        assert self.popen.returncode is not None
        return self.popen.returncode

    def send_signal(self, signum: int) -> None:
        self.popen.send_signal(signum)  # (not once it has been reaped)


def _signal_job(proc: Job, signum: int) -> None:
    """Signal the job's whole process group when it has its own (a shell
    script's children must get the batch system's SIGTERM too)."""
    if proc.returncode is not None:
        return
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signum)
            return
    except ProcessLookupError:
        return
    proc.send_signal(signum)


@dataclasses.dataclass
class JobProcess:
    """The job's process as the signal forwarder needs it."""

    proc: Job
    group: int | None = None  # its own process group, if it has one
    pipes: trio.CancelScope | None = None  # reading its pipes once its process has ended


async def _forward_signals(job: JobProcess, agent: Agent, signals: AsyncIterator[int]) -> None:
    """SIGTERM, SIGINT and SIGHUP go to the job while it runs, and start
    gcwrap's own end: it delivers for a bounded grace (see StopClock), then
    keeps the rest in the spool. A batch system signals the job and gcwrap
    together: the job may well die before gcwrap reads its copy, so the
    first signal still leaves time to deliver; a second one stops at once."""
    proc = job.proc
    async for signum in signals:
        name = signal.Signals(signum).name
        agent.stop.signal(trio.current_time(), name)
        agent.changed.fire()
        if proc.returncode is None:
            log.info("forwarding %s to the job", name)
            _signal_job(proc, signum)
        elif job.group is not None and agent.outbox.exit is None:
            # The job's process has ended; what it started in the background holds its pipes: it gets the signal
            # (as from a batch system), and gcwrap reads them until the stop clock's deadline at most.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.group, signum)
        if job.pipes is not None:
            job.pipes.deadline = min(job.pipes.deadline, agent.stop.deadline)
        if proc.returncode is not None and agent.stop.signals == 1 and agent.delivering:
            log.warning("%s received: delivering for at most %g s more (again to stop now)", name, agent.stop.grace)


async def _obey_signals(agent: Agent, signals: AsyncIterator[int]) -> None:
    """`gcwrap resume`: each signal moves the end of delivery to the stop clock's deadline."""
    async for signum in signals:
        agent.stop.signal(trio.current_time(), signal.Signals(signum).name)
        if agent.stop.signals == 1:
            log.warning("%s received: delivering for at most %g s more (again to stop now)", agent.stop.name,
                        agent.stop.grace)
        if agent.delivery_scope is not None:
            agent.delivery_scope.deadline = agent.stop.deadline
        agent.changed.fire()


async def _stop_delivery(agent: Agent, delivery_done: trio.Event) -> None:
    """The stop clock ran out: stop delivering, and say what waits in the spool."""
    stop = agent.stop
    how = "a second signal" if stop.signals > 1 else f"the {stop.grace:g} s grace"
    agent.interrupt(f"{stop.name} received: delivery stopped after {how}")
    await delivery_done.wait()
    if agent.give_up is not None and not agent.delivered.is_set():
        agent.give_up.message += f"; not yet home: {agent.not_home()}"


async def _write_stdin(agent: Agent, pipe: trio.abc.SendStream) -> None:
    feeder = agent.outbox.stdin
    assert feeder is not None
    async with pipe:
        while True:
            data = feeder.take()
            if data is None:
                if feeder.eof:
                    return
                await agent.changed.wait()
                continue
            try:
                await pipe.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                feeder.closed = True  # the job closed its stdin: stop fetching
                return
            agent.changed.fire()


async def _end_job(proc: Job, grace: float) -> None:
    if proc.returncode is None:
        _signal_job(proc, signal.SIGTERM)
        with trio.move_on_after(grace):
            await proc.wait()
        if proc.returncode is None:
            _signal_job(proc, signal.SIGKILL)
            await proc.wait()


async def run_job(
    opts: AgentOptions, command: list[str], job: JobRecord, spool_path: Path, start: Start | None = None
) -> Outcome:
    """Run the job: `start` is what the command line prepared (the spool,
    the job started: `launch.prepare`), else it is prepared here."""
    # SIGTERM, SIGINT and SIGHUP are ours from before the job starts to
    # gcwrap's last word: one that came before `_forward_signals` runs would
    # otherwise end gcwrap at once (and orphan the job), one that comes
    # during the last commit, before it prints what happened. (One that came
    # before this receiver opened was kept by `start.signals`.)
    with trio.open_signal_receiver(*stop_signals()) as receiver:
        if start is None:
            start = prepare(opts, command, job, spool_path, signals=None)
        early = start.signals.take() if start.signals is not None else []
        return await _run_job(opts, command, job, spool_path, start, _signals(early, receiver))


async def _signals(early: list[int], receiver: AsyncIterator[int]) -> AsyncIterator[int]:
    for signum in early:
        yield signum
    async for signum in receiver:
        yield signum


async def _run_job(
    opts: AgentOptions, command: list[str], job: JobRecord, spool_path: Path, start: Start,
    signals: AsyncIterator[int],
) -> Outcome:
    specs = stream_specs(opts)
    if not specs and not opts.files and opts.shadows:
        # Nothing to deliver: every stream passes through. No spool, no
        # session, no retries: the shadow's state cannot hold the job up.
        log.info("no stream is named (--stdout, --stderr, --stdin): nothing goes to the shadow at %s, "
                 "the job's streams pass through", show_all(opts.shadows))
        opts = dataclasses.replace(opts, shadows=())
    spooler = Spooler(
        spool_path, job, [(s.id, s.kind, s.name) for s in specs], limit=opts.spool_limit, min_free=opts.min_free
    )
    spooler.live_fd = start.live_fd
    if start.files is not None:
        spooler.adopt(start.files)
    agent = Agent(opts, spooler, job, specs, started=process_started())  # (the job started before trio loaded)
    if specs and spooler.spool is None and start.spool_error:
        agent.disk.refused_at_start(start.spool_error)
    if start.job is None:
        assert start.error is not None
        spooler.close(remove=True)
        code, message = not_started(command, start.error)
        return Outcome(code, message=message)
    proc = Job(start.job)
    agent.note(child_pid=proc.pid, state="running")
    running = JobProcess(proc, proc.pid if start.job.own_group else None)
    log.info("job %s started: pid %d, spool %s", job.job_id, proc.pid,
             spool_path if specs or opts.files else "none (nothing to spool)")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_forward_signals, running, agent, signals)
        with worst_error():
            status = await _supervise(agent, running)
        if not agent.delivered.is_set():
            await agent.final_flush()
            await _keep(agent)  # (refused: what the disk did not take has no other copy)
        outcome = _finish(agent, status)
        outcome.stats = agent.summary()
        outcome.files = agent.files.listing() if agent.files is not None else []
        nursery.cancel_scope.cancel()
    return outcome


async def _supervise(agent: Agent, running: JobProcess) -> int:
    """Run the job's tasks until the job has ended and its output is home
    (or can never get there); return the job's exit status."""
    proc = running.proc
    delivery_done = trio.Event()

    async def deliver() -> None:
        try:
            if agent.opts.shadows:
                with trio.CancelScope() as agent.delivery_scope:
                    agent.delivering = True
                    await agent.deliver_loop()
        finally:
            agent.delivering = False
            delivery_done.set()
            agent.changed.fire()
            if agent.give_up is not None and agent.outbox.exit is None:
                # Past the retry limit with nowhere to put the output: end the job, and say why.
                agent.kill_reason = agent.give_up.message
                with trio.CancelScope(shield=True):
                    await _end_job(proc, KILL_GRACE)

    async with trio.open_nursery() as nursery:
        if agent.specs:  # with no stream named there is nothing to spool
            nursery.start_soon(agent.commit_loop)
            nursery.start_soon(agent.live_loop)
        nursery.start_soon(_end_when_asked, agent, proc)
        if agent.files is not None:  # (watched until the job ends: then each file's content is final)
            nursery.start_soon(agent.files.run, lambda: agent.child_exited)
        if proc.stdin is not None:
            nursery.start_soon(_write_stdin, agent, proc.stdin)
        nursery.start_soon(deliver)
        async with trio.open_nursery() as readers:
            if proc.stdout is not None:
                readers.start_soon(agent.read_pipe, agent.out[STDOUT], proc.stdout)
            if proc.stderr is not None:
                readers.start_soon(agent.read_pipe, agent.out[STDERR], proc.stderr)
            await proc.wait()
            running.pipes = readers.cancel_scope
            stop = agent.stop  # a signal came while it ran: the pipes are read as long as delivery goes on (StopClock)
            readers.cancel_scope.deadline = (
                max(stop.deadline, trio.current_time() + stop.last_try) if stop.signals == 1 else stop.deadline)
            agent.child_exited = True
            agent.commit_soon.set()
            agent.changed.fire()
            if delivery_done.is_set() and not agent.delivered.is_set():
                # gcwrap gave up and ended the job. What its pipes still hold
                # is read (so it is counted: kept if the disk takes it, else
                # reported lost), but a process that outlived the job and
                # keeps a pipe open must not hold gcwrap for long.
                readers.cancel_scope.deadline = trio.current_time() + DRAIN_GRACE
        returncode = proc.returncode
        assert returncode is not None
        log.info("the job ended with %s after %.1f s; %d bytes not yet home",
                 f"signal {-returncode}" if returncode < 0 else f"status {returncode}",
                 time.monotonic() - agent.started, sum(o.read_end - o.acked for o in agent.out.values()))
        ended = agent.outbox.exit = Exit(
            code=returncode if returncode >= 0 else None,
            signal=-returncode if returncode < 0 else None,
            lengths=agent.outbox.lengths(),
            reason=agent.kill_reason,
        )
        agent.note(
            state="exited", ended=time.time(), exit_code=ended.code, exit_signal=ended.signal,
            reason=agent.kill_reason,
        )
        if not agent.opts.shadows:
            agent.delivered.set()
        agent.stop.job_ended(trio.current_time())
        while not (agent.delivered.is_set() or delivery_done.is_set()):
            if trio.current_time() >= agent.stop.deadline:
                await _stop_delivery(agent, delivery_done)
                break
            with trio.move_on_at(agent.stop.deadline):
                await agent.changed.wait()
        nursery.cancel_scope.cancel()
    return exit_status(returncode)


async def _end_when_asked(agent: Agent, proc: Job) -> None:
    await agent.must_end.wait()
    with trio.CancelScope(shield=True):
        await _end_job(proc, KILL_GRACE)


async def _report_progress(agent: Agent, progress: Callable[[int, int], None], start: dict[int, int]) -> None:
    total = sum(o.read_end - start[sid] for sid, o in agent.out.items())
    try:
        while True:
            progress(sum(o.acked - start[sid] for sid, o in agent.out.items()), total)
            await trio.sleep(0.2)
    finally:
        progress(sum(o.acked - start[sid] for sid, o in agent.out.items()), total)


async def _keep(agent: Agent) -> None:
    """The end, when home will never take the output (the shadow refused
    the job for good) and the disk took none of what memory holds: that
    copy is the only one, so the spool is tried again until it takes it,
    at the retry policy's pace, each try that takes none of it counted as
    a failed attempt while the output can go nowhere (--retry-limit; 0:
    until it does; a try that takes some starts the count again), and no
    later than a stop signal's deadline. What is still out then is lost,
    and said (`_finish`)."""
    if not (agent.lost and agent.refusal is not None):
        return

    def held() -> int:
        return sum(end - start for start, end in agent.lost.values())

    retry = agent.retry
    retry.succeeded()  # (the spool's tries count from the last one, not the connection attempts before)
    log.warning("the shadow refused the job for good, and the spool cannot take the %s held only in memory: "
                "trying the spool again until it does (%s)", human_bytes(held()),
                f"at most {retry.limit} tries in all, --retry-limit" if retry.limit else "no --retry-limit")
    while agent.lost:
        before = held()
        nxt = retry.failed(blocked=True, refused=False)  # (the last try, the first being the final flush)
        if nxt.give_up:
            log.error("the spool took none of the %s held only in memory in %d tries: giving up",
                      human_bytes(before), retry.failures_blocked)
            return
        until = trio.current_time() + nxt.delay
        while trio.current_time() < min(until, agent.stop.deadline):  # (a signal moves the deadline: look again)
            signals = agent.stop.signals
            with trio.move_on_at(min(until, agent.stop.deadline)):
                await agent.changed.wait()
            if agent.stop.signals == 1 and not signals:
                log.warning("%s received: trying the spool for at most %g s more (again to stop now)",
                            agent.stop.name, agent.stop.grace)
        if trio.current_time() >= agent.stop.deadline:
            log.warning("%s received: keeping no more of the output held in memory", agent.stop.name)
            return
        await agent.final_flush(quiet=True)
        if not agent.lost:
            log.warning("the spool took the output held in memory")
        elif held() < before:
            retry.succeeded()  # (it took some: the count starts again)


def _finish(agent: Agent, job_status: int | None) -> Outcome:
    """Delete a delivered spool; keep one that still holds output and say
    why; say what is lost (`agent.lost`), which comes first in the status."""
    spooler = agent.spooler
    if agent.delivered.is_set() and not agent.lost:
        spooler.close(remove=True)
        return Outcome(job_status if job_status is not None else 0, job_status)
    path = spooler.path if spooler.spool is not None else None
    loss = agent.loss()
    if agent.delivered.is_set():
        # (A resumed spool whose run lost its tail: what it held is home.)
        spooler.close(remove=True)
        where = show(agent.shadows.in_use) if agent.shadows.in_use else show_all(agent.opts.shadows) or "home"
        return Outcome(exitcodes.LOST, job_status, f"what the spool held is delivered to {where}; lost when the "
                                                   f"job ran: {loss}")
    final = dict(agent.job_updates, connected=False, summary=agent.summary())
    if agent.give_up is not None:
        final.update(state="gave-up", last_error=agent.give_up.message)
        if agent.kill_reason:
            final.update(reason=agent.kill_reason)
    elif agent.refusal is not None:
        final.update(state="refused", last_error=describe(agent.refusal))
    agent.live_fields.update({k: v for k, v in final.items() if k != "summary"})
    spooler.write_live(agent.live_snapshot())
    acked = {s: o.acked for s, o in agent.out.items()}
    # What the job wrote: bytes past what the spool holds are on record as lost.
    # (A resume knows only what its spool holds, and keeps the record it found.)
    written = None if agent.outbox.resuming else {s: o.read_end for s, o in agent.out.items()}
    if not spooler.last_commit(final, acked, written) and path is not None:
        log.error("could not record the job's final state in %s", path)
    spooler.close()
    if agent.refusal is not None:
        outcome = Outcome(exitcodes.REFUSED, job_status, agent.kill_reason or describe(agent.refusal), path,
                          refused=True)
    elif agent.give_up is not None:
        outcome = agent.give_up
        outcome.job_status, outcome.spool = job_status, path
    else:
        outcome = Outcome(exitcodes.UNDELIVERED, job_status, "output was not delivered", path)
    outcome.pending = sum(max(0, o.safe_end - o.acked) for o in agent.out.values()) if path is not None else 0
    if loss:
        outcome.status = exitcodes.LOST
        outcome.lost = (f"LOST: {loss}: held only in memory, and neither the disk nor home could take them"
                        if not agent.outbox.resuming else f"lost when the job ran: {loss}")
    return outcome


async def resume_spool(
    opts: AgentOptions, path: Path, progress: Callable[[int, int], None] | None = None
) -> Outcome:
    """Deliver what a spool left behind (a killed wrapper, an outage at job end).
    `progress(done, total)` is called as bytes are acknowledged."""
    from . import fileresume  # (here: a run that starts a job takes up no files from a spool)

    try:
        lock_fd = lock_spool(path)
    except BlockingIOError:
        return Outcome(exitcodes.INTERNAL, message=f"spool {path} is in use by a running gcwrap")
    except OSError as e:
        return Outcome(exitcodes.INTERNAL, message=f"cannot open spool {path}: {e.strerror}")
    try:
        spool = await trio.to_thread.run_sync(Spool.open, path)
        job = spool.job()
        states = spool.streams()
        files = fileresume.read(SpoolFiles(spool))
    except SpoolError as e:
        os.close(lock_fd)
        return Outcome(exitcodes.INTERNAL, message=str(e))
    specs = [StreamSpec(s.id, s.kind, s.name) for s in states.values() if s.kind != "stdin"]
    spooler = Spooler(path, job, [], spool=spool, lock_fd=lock_fd)
    agent = Agent(opts, spooler, job, specs, resuming=True)
    if files is not None:  # (the job's files: from the files themselves, once home says what it holds)
        agent.files = fileresume.restore(files, agent.changed, spooler.record_files)
    for sid, out in agent.out.items():
        st = states[sid]
        out.restore(st.appended, st.acked)
        if st.lost:
            agent.lost[sid] = (st.appended, st.appended + st.lost)
    if agent.outbox.pending:
        agent.journal.link.output(trio.current_time())  # (what the spool holds waits from now)
    lengths = agent.outbox.lengths()
    # Home is told what the run lost, with why the job ended.
    loss = f"lost: {agent.loss()}" if agent.lost else ""
    if job.exit_code is None and job.exit_signal is None:
        reason = "gcwrap ended before the job did; the job's exit status is unknown"
        agent.outbox.exit = Exit(None, None, lengths, reason="; ".join(filter(None, (reason, loss))))
    else:
        agent.outbox.exit = Exit(job.exit_code, job.exit_signal, lengths,
                                 reason="; ".join(filter(None, (job.reason, loss))))
    # SIGTERM, SIGINT and SIGHUP are obeyed as by a run whose job has ended:
    # delivery goes on for the grace (none after a second one), the rest stays in the spool.
    with worst_error(), trio.open_signal_receiver(*stop_signals()) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.commit_loop)
            nursery.start_soon(agent.live_loop)
            nursery.start_soon(_obey_signals, agent, signals)
            start = {sid: o.acked for sid, o in agent.out.items()}
            if progress is not None:
                nursery.start_soon(_report_progress, agent, progress, start)
            with trio.CancelScope() as agent.delivery_scope:
                await agent.deliver_loop()
            if agent.delivery_scope.cancelled_caught and not agent.delivered.is_set():
                how = "a second signal" if agent.stop.signals > 1 else f"the {agent.stop.grace:g} s grace"
                agent.interrupt(f"{agent.stop.name} received: delivery stopped after {how}")
                assert agent.give_up is not None
                agent.give_up.message += f"; not yet home: {agent.not_home()}"
            nursery.cancel_scope.cancel()
    job_status = None
    if job.exit_signal is not None:
        job_status = 128 + job.exit_signal
    elif job.exit_code is not None:
        job_status = job.exit_code
    if agent.files is not None:
        agent.files.close()
    outcome = _finish(agent, job_status)
    if agent.delivered.is_set() and not agent.lost:
        outcome.status = 0
    outcome.stats = agent.summary()
    outcome.signalled = agent.stop.name
    return outcome
