"""The shadows an agent may deliver to, and which one it tries next.

An agent may be given several shadows (`--shadow a:50000,b:50000`) that
serve one root and share their state: any of them can take the job at any
moment. They are tried as the seed's `forany` tries a list, the Ethernet
way: in an order shuffled once per job (by its id, so a thousand agents do
not all start on the first), the one that works kept while it works, the next one
tried at once when it fails, and only after a whole ROUND (every address
tried once, none of them moving a byte) a backoff with jitter. The retry
limit counts rounds, so a list of one behaves exactly as one shadow always
has: every failure is a round.

`ShadowList` is a pure object (no I/O, no clock): the deliver loop tells it
what became of each attempt, it says where to go next and whether a round
is over. `connect` opens the connection to one address.
"""

from __future__ import annotations

import random
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from ..wire.events import ErrorCode
from .addresses import Address, show, show_all
from .addresses import AddressError as AddressError  # (re-exported: where they were)
from .addresses import env_addresses as env_addresses
from .addresses import parse_address as parse_address
from .addresses import parse_addresses as parse_addresses
from .addresses import recorded_addresses as recorded_addresses
from .retry import ShadowRefused


@dataclass(frozen=True)
class Round:
    """A round that ended without success: what the retry policy needs of it."""

    retry_after: float  # the longest pause a shadow asked for in it
    shutting_down: bool  # every shadow in it said it was shutting down (that costs no attempt)


@dataclass
class ShadowList:
    """Which shadow to try now, and when a round of failures is complete.

    `order` is the agent's (shuffled) order of the addresses. `failed()`
    after every failed attempt moves to the next address and returns the
    Round once every address has failed once since the last success (or the
    last round); `succeeded()` after an attempt that moved bytes keeps the
    current address. `failed_for_good()` after a refusal that another
    shadow would repeat (bad credentials, a name the root forbids...) moves
    on too, but ends the round at once: it is paced as today's refusals."""

    order: list[Address]
    index: int = 0
    failures_in_round: int = 0
    rounds: int = 0  # rounds completed without success, in all
    failovers: int = 0  # moves from a failed shadow to another
    _retry_after: float = 0.0
    _all_shutting_down: bool = True
    in_use: Address | None = field(default=None)  # the last shadow that welcomed the agent

    @classmethod
    def shuffled(cls, addresses: Sequence[Address], rng: random.Random | None = None) -> ShadowList:
        order = list(addresses)
        (rng or random.Random()).shuffle(order)
        return cls(order)

    @classmethod
    def for_job(cls, addresses: Sequence[Address], job_id: str) -> ShadowList:
        """The order of one job: shuffled by its job id, so the jobs of a
        cluster spread over the shadows, and a job resumed later (or a test)
        meets them in the same order."""
        return cls.shuffled(addresses, random.Random(job_id))

    @property
    def current(self) -> Address:
        if not self.order:
            raise AddressError("no shadow address")  # (no delivery without one: the streams pass through)
        return self.order[self.index]

    def welcomed(self) -> None:
        """The current shadow welcomed the agent: it is the one in use."""
        self.in_use = self.current

    def succeeded(self) -> None:
        """An attempt at the current shadow moved bytes: keep it; a new round begins."""
        self._new_round()

    def failed(self, retry_after: float = 0.0, shutting_down: bool = False) -> Round | None:
        """An attempt at the current shadow failed: move to the next; the
        Round when this failure completes one (None: try the next at once)."""
        self.failures_in_round += 1
        self._retry_after = max(self._retry_after, retry_after)
        self._all_shutting_down = self._all_shutting_down and shutting_down
        self._advance()
        if self.failures_in_round < len(self.order):
            return None
        done = Round(self._retry_after, self._all_shutting_down)
        self.rounds += 1
        self._new_round()
        return done

    def failed_for_good(self) -> None:
        """A refusal that every shadow would repeat: move on, the round is over."""
        self._advance()
        self._new_round()

    def _advance(self) -> None:
        if len(self.order) > 1:
            self.index = (self.index + 1) % len(self.order)
            self.failovers += 1

    def _new_round(self) -> None:
        self.failures_in_round = 0
        self._retry_after = 0.0
        self._all_shutting_down = True


async def connect(address: Address, timeout: float, tls: ssl.SSLContext | None) -> tuple[trio.abc.Stream,
                                                                                          trio.SocketStream]:
    """A connection to the shadow at `address`: TCP, and TLS over it when configured."""
    host, port = address
    with trio.fail_after(timeout):
        tcp = await trio.open_tcp_stream(host, port)
        if tls is None:
            return tcp, tcp
        stream = trio.SSLStream(tcp, tls, server_hostname=host)
        try:
            await stream.do_handshake()
        except BaseException as e:
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(tcp)
            if isinstance(e.__cause__, ssl.SSLCertVerificationError):
                why = f"the shadow's certificate failed verification: {e.__cause__.verify_message}"
                raise ShadowRefused(ErrorCode.AUTH_FAILED, why, permanent=True) from None
            raise
        return stream, tcp


def local_address(tcp: trio.SocketStream) -> str:
    """Our end of a connection, host:port, for the log."""
    try:
        host, port = tcp.socket.getsockname()[:2]
    except OSError:
        return "?"
    return show((host, port))


def given_up(rounds: int, order: Sequence[Address], ended: bool, reason: str) -> str:
    """Why the agent gave up at the retry limit, naming the shadows it tried."""
    when = "after the job ended" if ended else "while the job's output could go nowhere"
    if len(order) == 1:
        return f"retry limit reached: {rounds} consecutive failed attempts {when} (last: {reason})"
    return (f"retry limit reached: {rounds} consecutive rounds of failed attempts over the shadows {show_all(order)} "
            f"(each tried once a round) {when} (last: {reason})")
