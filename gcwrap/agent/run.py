"""Running a job under gcwrap: start it with pipes for the named streams,
run the agent's tasks beside it, forward signals, end it when asked, and
say what happened (`Outcome`); and `gcwrap resume`, which delivers what a
spool left behind.

Tasks, all in one nursery: the agent's (`Agent.start`: the spool writer,
the live view, the job's stdin; `Agent.read_output`, one per output stream;
`Agent.deliver`), `_end_when_asked` and `_forward_signals`. The run talks to
the agent through its methods; the stop clock (signals) is the run's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import trio

from .. import exitcodes
from ..sync import worst_error
from ..wire.events import STDERR, STDOUT, StreamSpec
from .addresses import show_all
from .agent import Agent
from .launch import Launched, Start, lock_spool, not_started, prepare, stream_specs
from .options import AgentOptions
from .policy import StopClock
from .records import JobRecord, Outcome
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


async def _forward_signals(job: JobProcess, agent: Agent, stop: StopClock, signals: AsyncIterator[int]) -> None:
    """SIGTERM, SIGINT and SIGHUP go to the job while it runs, and start
    gcwrap's own end: it delivers for a bounded grace (see StopClock), then
    keeps the rest in the spool. A batch system signals the job and gcwrap
    together: the job may well die before gcwrap reads its copy, so the
    first signal still leaves time to deliver; a second one stops at once."""
    proc = job.proc
    async for signum in signals:
        name = signal.Signals(signum).name
        stop.signal(trio.current_time(), name)
        agent.wake()
        if proc.returncode is None:
            log.info("forwarding %s to the job", name)
            _signal_job(proc, signum)
        elif job.group is not None and not agent.ended:
            # The job's process has ended; what it started in the background holds its pipes: it gets the signal
            # (as from a batch system), and gcwrap reads them until the stop clock's deadline at most.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.group, signum)
        if job.pipes is not None:
            job.pipes.deadline = min(job.pipes.deadline, stop.deadline)
        if proc.returncode is not None and stop.signals == 1 and agent.delivering:
            log.warning("%s received: delivering for at most %g s more (again to stop now)", name, stop.grace)


async def _obey_signals(agent: Agent, stop: StopClock, signals: AsyncIterator[int]) -> None:
    """`gcwrap resume`: each signal moves the end of delivery to the stop clock's deadline."""
    async for signum in signals:
        stop.signal(trio.current_time(), signal.Signals(signum).name)
        if stop.signals == 1:
            log.warning("%s received: delivering for at most %g s more (again to stop now)", stop.name, stop.grace)
        agent.deliver_until(stop.deadline)
        agent.wake()


def _stopped(stop: StopClock) -> str:
    how = "a second signal" if stop.signals > 1 else f"the {stop.grace:g} s grace"
    return f"{stop.name} received: delivery stopped after {how}"


async def _stop_delivery(agent: Agent, stop: StopClock, delivery_done: trio.Event) -> None:
    """The stop clock ran out: stop delivering, and say what waits in the spool."""
    agent.interrupt(_stopped(stop))
    await delivery_done.wait()
    agent.say_not_home()


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
        spool_path, job, [(s.id, s.kind, s.name) for s in specs], limit=opts.spool_limit, min_free=opts.min_free,
        tuning=opts.tuning,
    )
    spooler.live_fd = start.live_fd
    if start.files is not None:
        spooler.adopt(start.files)
    stop = StopClock()
    agent = Agent(opts, spooler, job, specs, started=process_started(),  # (the job started before trio loaded)
                  stop=stop, spool_error=start.spool_error)
    if start.job is None:
        assert start.error is not None
        spooler.close(remove=True)
        code, message = not_started(command, start.error)
        return Outcome(code, message=message)
    proc = Job(start.job)
    agent.job_started(proc.pid)
    running = JobProcess(proc, proc.pid if start.job.own_group else None)
    log.info("job %s started: pid %d, spool %s", job.job_id, proc.pid,
             spool_path if specs or opts.files else "none (nothing to spool)")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_forward_signals, running, agent, stop, signals)
        with worst_error():
            status = await _supervise(agent, stop, running)
        if not agent.delivered:
            await agent.keep_the_rest()  # (refused: what the disk did not take has no other copy)
        outcome = agent.finish(status)
        outcome.files = agent.files_listing()
        nursery.cancel_scope.cancel()
    return outcome


async def _supervise(agent: Agent, stop: StopClock, running: JobProcess) -> int:
    """Run the job's tasks until the job has ended and its output is home
    (or can never get there); return the job's exit status."""
    proc = running.proc
    delivery_done = trio.Event()

    async def deliver() -> None:
        try:
            await agent.deliver()
        finally:
            delivery_done.set()
            if agent.end_for_giving_up():
                # Past the retry limit with nowhere to put the output: end the job, and say why.
                with trio.CancelScope(shield=True):
                    await _end_job(proc, KILL_GRACE)

    async with trio.open_nursery() as nursery:
        agent.start(nursery, proc.stdin)
        nursery.start_soon(_end_when_asked, agent, proc)
        nursery.start_soon(deliver)
        async with trio.open_nursery() as readers:
            if proc.stdout is not None:
                readers.start_soon(agent.read_output, STDOUT, proc.stdout)
            if proc.stderr is not None:
                readers.start_soon(agent.read_output, STDERR, proc.stderr)
            await proc.wait()
            running.pipes = readers.cancel_scope
            # A signal came while it ran: the pipes are read as long as delivery goes on (StopClock).
            readers.cancel_scope.deadline = (
                max(stop.deadline, trio.current_time() + stop.last_try) if stop.signals == 1 else stop.deadline)
            agent.job_exited()
            if delivery_done.is_set() and not agent.delivered:
                # gcwrap gave up and ended the job. What its pipes still hold
                # is read (so it is counted: kept if the disk takes it, else
                # reported lost), but a process that outlived the job and
                # keeps a pipe open must not hold gcwrap for long.
                readers.cancel_scope.deadline = trio.current_time() + DRAIN_GRACE
        returncode = proc.returncode
        assert returncode is not None
        agent.job_ended(returncode)
        stop.job_ended(trio.current_time())
        while not (agent.delivered or delivery_done.is_set()):
            if trio.current_time() >= stop.deadline:
                await _stop_delivery(agent, stop, delivery_done)
                break
            with trio.move_on_at(stop.deadline):
                await agent.wait_changed()
        nursery.cancel_scope.cancel()
    return exit_status(returncode)


async def _end_when_asked(agent: Agent, proc: Job) -> None:
    await agent.end_requested()
    with trio.CancelScope(shield=True):
        await _end_job(proc, KILL_GRACE)


async def _report_progress(agent: Agent, progress: Callable[[int, int], None]) -> None:
    start, written = agent.totals()  # (what home held when the resume began)
    total = written - start
    try:
        while True:
            progress(agent.totals()[0] - start, total)
            await trio.sleep(0.2)
    finally:
        progress(agent.totals()[0] - start, total)


async def resume_spool(
    opts: AgentOptions, path: Path, progress: Callable[[int, int], None] | None = None
) -> Outcome:
    """Deliver what a spool left behind (a killed wrapper, an outage at job end).
    `progress(done, total)` is called as bytes are acknowledged."""
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
        from . import fileresume  # (a resume only)

        files = fileresume.read(SpoolFiles(spool))
    except SpoolError as e:
        os.close(lock_fd)
        return Outcome(exitcodes.INTERNAL, message=str(e))
    specs = [StreamSpec(s.id, s.kind, s.name) for s in states.values() if s.kind != "stdin"]
    spooler = Spooler(path, job, [], spool=spool, lock_fd=lock_fd, tuning=opts.tuning)
    stop = StopClock()
    agent = Agent(opts, spooler, job, specs, resuming=True, stop=stop)
    agent.resume_from(job, states, files)
    # SIGTERM, SIGINT and SIGHUP are obeyed as by a run whose job has ended:
    # delivery goes on for the grace (none after a second one), the rest stays in the spool.
    with worst_error(), trio.open_signal_receiver(*stop_signals()) as signals:
        async with trio.open_nursery() as nursery:
            agent.start(nursery)
            nursery.start_soon(_obey_signals, agent, stop, signals)
            if progress is not None:
                nursery.start_soon(_report_progress, agent, progress)
            if await agent.deliver() and not agent.delivered:
                agent.interrupt(_stopped(stop))
                agent.say_not_home()
            nursery.cancel_scope.cancel()
    job_status = None
    if job.exit_signal is not None:
        job_status = 128 + job.exit_signal
    elif job.exit_code is not None:
        job_status = job.exit_code
    agent.close_files()
    complete = agent.complete
    outcome = agent.finish(job_status)
    if complete:
        outcome.status = 0
    outcome.signalled = stop.name
    return outcome
