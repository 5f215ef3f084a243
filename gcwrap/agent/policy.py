"""The agent's policies, as pure objects: no I/O, no trio, no clock of
their own. The caller passes `now` in (trio.current_time() in the agent),
acts on the answer, and tests drive them under trio's autojump clock.

- `StopClock`: when delivery stops after SIGTERM, SIGINT or SIGHUP.
- `CommitPlan`: when the commit loop records what (group commit pacing,
  acknowledgements alone, write-behind, cache eviction).
- `RetryPolicy`: how long to wait before the next connection attempt, and
  when the retry limit is reached.
- `DiskHealth`: whether the spool takes output, and what has been said of it.
- `HomeHealth`: whether home takes output, and what has been said of an outage.

(`gcwrap.agent.liveness` is the session watchdog's policy, of the same kind.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .retry import Backoff

SIGNAL_GRACE = 5.0  # seconds gcwrap goes on delivering after SIGTERM, SIGINT or SIGHUP (see StopClock)
LAST_TRY = 1.0  # ...and after the job's end, for a job that outlives that grace
ACK_COMMIT_INTERVAL = 0.2  # seconds an acknowledgement alone may wait to be recorded in the spool
# Group commit: after a transaction, let the next one gather for this long
# (each costs a worker-thread hop and a WAL append); never while the job has
# ended, the disk is tight, or a quarter of --memory-limit waits unrecorded.
COMMIT_PACE = 0.01
IDLE_LOOK = 1.0  # seconds between looks at a full disk that frees up by itself (the job deletes files)
# "The spool takes output again" is said only once the spool has taken every
# byte that waited in memory, and no write failed for this long: a full disk
# that frees a little at a time must not flip the message back and forth.
DISK_CALM = 2.0
# A shadow that is shutting down is coming back soon: try again after about
# this long, without counting the attempt toward --retry-limit.
COME_BACK = 1.0


class StopClock:
    """When gcwrap stops delivering after SIGTERM, SIGINT or SIGHUP (a batch
    system's walltime, `timeout`, Ctrl-C): a pure policy, times passed in.

    The first signal leaves `grace` seconds, counted from the signal whether
    the job had ended or not (the job gets the signal too, and usually ends
    at once). A job that ends later than that gets `last_try` seconds after
    its end: one short last attempt. A second signal means stop now. What is
    not home by then waits in the spool for `gcwrap resume`."""

    def __init__(self, grace: float = SIGNAL_GRACE, last_try: float = LAST_TRY) -> None:
        self.grace = grace
        self.last_try = last_try
        self.signals = 0
        self.name = ""  # the first signal's name
        self.deadline = math.inf

    def signal(self, now: float, name: str) -> None:
        self.signals += 1
        if self.signals == 1:
            self.name = name
            self.deadline = now + self.grace
        else:
            self.deadline = min(self.deadline, now)

    def job_ended(self, now: float) -> None:
        if self.signals == 1:
            self.deadline = max(self.deadline, now + self.last_try)


@dataclass
class CommitPlan:
    """When the commit loop records what: each method answers "how long may
    this wait" in seconds (0 or less: now) for one of its decisions.

    - write-behind: output home acknowledges within `write_behind` seconds
      never touches the disk; only what is older is spooled;
    - acknowledgements alone wait up to `ack_interval` (recorded late, they
      only mean a resume resends bytes the shadow then trims), unless the
      disk is tight (recording them frees the spool's space);
    - after a commit that wrote output, the next gathers for `pace`, unless
      the job has ended or the disk is tight;
    - cached (already safe) bytes beyond `cache_limit` are evicted."""

    mem_limit: int
    cache_limit: int
    write_behind: float = 0.0
    ack_interval: float = ACK_COMMIT_INTERVAL
    pace: float = COMMIT_PACE
    acks_at: float = -math.inf  # when acknowledgements were last recorded

    def behind_wait(self, now: float, may_ack: bool, unsafe: int, oldest: float | None) -> float:
        """Seconds until the oldest byte held only in memory is due in the spool
        (now, when home cannot acknowledge it: `HomeHealth.may_ack`)."""
        if not self.write_behind or not may_ack or unsafe >= self.mem_limit // 2 or oldest is None:
            return 0.0
        return oldest + self.write_behind - now

    def ack_wait(self, now: float, tight: bool) -> float:
        """Seconds acknowledgements alone (nothing else to record) may wait."""
        return -1.0 if tight else self.acks_at + self.ack_interval - now

    def acks_recorded(self, now: float) -> None:
        self.acks_at = now

    @staticmethod
    def idle_wait(waiting: bool) -> float:
        """Nothing to record: wait for a change, or look again at a full disk."""
        return IDLE_LOOK if waiting else math.inf

    def gather(self, wrote: bool, ended: bool, tight: bool) -> float:
        """Seconds the next commit may gather after this one."""
        return self.pace if wrote and not (ended or tight) else 0.0

    def eviction_share(self, held: int, streams: int) -> int | None:
        """Bytes of cache each stream may keep, or None: nothing to evict."""
        return self.cache_limit // max(1, streams) if held > self.cache_limit else None


@dataclass(frozen=True)
class NextAttempt:
    """What `RetryPolicy.failed` decided: wait `delay` seconds, or give up."""

    delay: float
    give_up: bool = False
    counted: bool = True  # the attempt counted toward --retry-limit


@dataclass
class RetryPolicy:
    """Backoff between connection attempts, and the retry limit.

    Only failed attempts while the job's output can go nowhere count toward
    `limit` (`blocked`: paused with the disk failing, or ended with output
    undelivered), and a session that moved bytes resets the count. A shadow
    refusing for good is tried every `retry_timeout`; one that asks for a
    pause (`retry_after`) gets it, up to `retry_timeout`; one shutting down
    is tried again after the pause it asks for (at least COME_BACK), and
    that costs no attempt."""

    limit: int = 20
    retry_timeout: float = 60.0
    backoff: Backoff = field(default_factory=lambda: Backoff())
    failures_blocked: int = 0  # consecutive failed attempts while output could go nowhere

    def __post_init__(self) -> None:
        self.backoff.cap = self.retry_timeout

    def succeeded(self) -> None:
        """A session moved bytes."""
        self.backoff.reset()
        self.failures_blocked = 0

    def failed(self, *, blocked: bool, refused: bool, retry_after: float = 0.0,
               shutting_down: bool = False) -> NextAttempt:
        if shutting_down:  # (after the pause it asks for, a restart's length)
            return NextAttempt(min(max(COME_BACK, retry_after), self.retry_timeout), counted=False)
        if blocked:
            self.failures_blocked += 1
        if self.limit and self.failures_blocked >= self.limit:
            return NextAttempt(0.0, give_up=True)
        delay = self.retry_timeout if refused else self.backoff.next_delay()
        if retry_after:
            delay = max(delay, min(retry_after, self.retry_timeout))
        return NextAttempt(delay)


@dataclass
class DiskHealth:
    """Whether the spool takes output, and what has been said of it: the one
    home of the disk's state. `error` is why it refuses now ("": it takes
    output). A failure is said once per episode; its end only once the spool
    has caught up and no write failed for `calm` seconds."""

    calm: float = DISK_CALM
    error: str = ""
    partial: bool = False  # the last commit took part of what waited (a nearly full disk's last pieces)
    last_reason: str = ""  # the last failure's reason (kept when a commit clears `error`)
    said: bool = False  # "the spool cannot take..." was said, and its recovery not yet
    failed_at: float = -math.inf  # the last time the spool refused bytes

    @property
    def refusing(self) -> bool:
        """The spool takes nothing now (not merely less than waits)."""
        return bool(self.error) and not self.partial

    def failed(self, now: float, reason: str, partial: bool = False) -> tuple[bool, Literal["warning", "info", ""]]:
        """The spool refused bytes, all or (`partial`) some of what waited:
        (whether this begins a failure or a refusal, what to say)."""
        first = not self.error or (self.partial and not partial)
        say: Literal["warning", "info", ""] = ""
        if not self.said:
            say, self.said = "warning", True
        elif reason != self.last_reason:
            say = "info"
        self.error, self.last_reason, self.partial, self.failed_at = reason, reason, partial, now
        return first, say

    def refused_at_start(self, reason: str) -> None:
        """No spool could be made before the job started, and that was said
        then: the failure goes on, said (the next try that fails alike says
        nothing more)."""
        self.error = self.last_reason = reason
        self.said = True

    def took(self) -> None:
        """The spool took output."""
        self.error, self.partial = "", False

    def recovered(self, now: float, caught_up: bool) -> bool:
        """Whether to say now that the spool takes output again."""
        if self.said and caught_up and not self.error and now - self.failed_at >= self.calm:
            self.said = False
            return True
        return False


@dataclass
class HomeHealth:
    """Whether home takes output now, and what has been said of it: the one
    home of the link's state that the pipe readers and the spool writer read
    and delivery keeps. An outage is said once, its end once (with its length)."""

    streaming: bool = False  # a session is welcomed and running
    error: str = ""  # why the last attempt failed ("": since welcomed, none has)
    tried: bool = False  # a session was welcomed or an attempt failed (before: home has had no chance yet)
    outage_said: bool = False  # "output waits in ..., retrying" was said, and no welcome since
    outage_since: float = 0.0  # when the outage that was said began

    def failed(self, reason: str) -> None:
        self.error, self.tried = reason, True

    @property
    def may_ack(self) -> bool:
        """Whether home may still acknowledge what is read now in time: a
        session streams, or the first is still being made (the job starts
        before the connection: its first output must not go to the disk for
        that alone)."""
        return self.streaming or not self.tried

    def outage(self, now: float) -> bool:
        """An attempt failed for a reason worth a warning: whether to say it
        (only the first of an outage is)."""
        if self.outage_said:
            return False
        self.outage_said, self.outage_since = True, now
        return True

    def welcomed(self, now: float) -> float | None:
        """A session was welcomed: how long the outage that was said lasted
        (None: none was)."""
        self.streaming, self.error, self.tried = True, "", True
        if not self.outage_said:
            return None
        self.outage_said = False
        return now - self.outage_since
