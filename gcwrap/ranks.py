"""How much an error matters, when several fail together (see
`gcwrap.sync.worst_error`): the higher one is raised, the others logged.

A light module (no trio, no TLS): the classes that rank their failures
here are loaded before the job starts (see gcwrap/agent/launch.py).
"""

from __future__ import annotations

import enum
import errno
from collections.abc import Callable
from typing import TypeVar

E = TypeVar("E", bound=type[BaseException])


class Rank(enum.IntEnum):
    """How much an error matters. Whatever is not a known failure is a bug,
    and a bug is never hidden behind the failure it may have caused."""

    NETWORK = 0  # the connection broke, timed out, or the peer hung up: retried
    PROTOCOL = 1  # what one side said to the other: a protocol error, a refusal, the end of a session
    LOCAL = 2  # this machine failed: its storage (the spool, files or state at home: bytes at stake), a port
    BUG = 3  # anything not known to be one of the above
    ABORT = 4  # not an Exception at all (KeyboardInterrupt, SystemExit): the program stops


# A failure of the socket (the peer or the path is gone), not of a disk.
NETWORK_ERRNOS = frozenset({
    errno.EPIPE, errno.ECONNRESET, errno.ECONNABORTED, errno.ENOTCONN, errno.ETIMEDOUT,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EBADF, errno.ECONNREFUSED,
})

# Each known failure's rank, by class: a subclass takes the rank of the
# nearest class listed (a LocalProtocolError is our own bug, a TruncatedFrame
# a hang-up). Classes join with `ranked`: the program's own where they are
# defined, the libraries' in gcwrap.sync.
_RANKS: dict[type[BaseException], Rank] = {ConnectionError: Rank.NETWORK}


def ranked(rank: Rank) -> Callable[[E], E]:
    """Class decorator: the class (and its subclasses) is a known failure of `rank`."""

    def register(cls: E) -> E:
        _RANKS[cls] = rank
        return cls

    return register


def rank_of(exc: BaseException) -> Rank:
    """How much `exc` matters (see Rank)."""
    for cls in type(exc).__mro__:
        if cls in _RANKS:
            return _RANKS[cls]
        if cls is OSError:  # (after its subclasses listed: ConnectionError, SSLError...)
            assert isinstance(exc, OSError)
            return Rank.NETWORK if exc.errno in NETWORK_ERRNOS else Rank.LOCAL
    return Rank.BUG if isinstance(exc, Exception) else Rank.ABORT
