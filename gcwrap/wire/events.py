"""The events of the gcwrap wire protocol: what one side can say to the other.

Every event is a frozen dataclass. `protocol.Connection.send()` turns one into
bytes; `protocol.Connection.next_event()` turns bytes back into one. Field
values are validated by the codec, not here, so tests can build any event.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# The streams (ids, kinds, `StreamSpec`) are streams.py's: a run needs them
# before its job starts, and this module's many dataclasses take a while to
# make (loaded once the job runs).
from .streams import STDERR as STDERR
from .streams import STDIN as STDIN
from .streams import STDOUT as STDOUT
from .streams import STREAM_KINDS as STREAM_KINDS
from .streams import StreamSpec as StreamSpec

PROTOCOL_VERSION = 1

NOTES_FEATURE = "notes"  # the agent sends NOTES, for the job's timeline at home (`Notes`)
FILES_FEATURE = "files"  # the agent sends the files the job writes (`FileOpen`, ...)


class ErrorCode(enum.IntEnum):
    """What failed, as the peer is told it in an `Error` frame.

    Codes below 100 are permanent for the job: retrying the same request
    cannot succeed (a forbidden path stays forbidden). Codes from 100 up are
    transient: the agent backs off and tries again.
    """

    BAD_FRAME = 1  # undecodable or malformed frame
    VERSION_MISMATCH = 2  # no protocol version in common
    UNEXPECTED = 3  # a legal frame in the wrong state
    FRAME_TOO_LARGE = 4  # frame longer than the receiver accepts
    PATH_FORBIDDEN = 10  # NAME escapes the root, is absolute, or not a regular file
    PATH_OWNED = 11  # NAME belongs to another job that is still active
    NOT_FOUND = 12  # stdin NAME does not exist at the shadow
    UNKNOWN_STREAM = 13  # a stream id the handshake did not declare
    OFFSET_GAP = 14  # DATA would leave a hole in the file
    LENGTH_MISMATCH = 15  # EXIT's final lengths differ from what the shadow holds
    STALE_ATTEMPT = 16  # a newer attempt of this job has replaced this one
    AUTH_FAILED = 20  # authentication refused
    QUOTA = 21  # the job exceeded its byte quota
    FENCED = 100  # a newer connection of the same job took over
    BUSY = 101  # the shadow is overloaded; back off
    IO_ERROR = 102  # the shadow could not write or sync (disk full, unwritable root)
    SHUTTING_DOWN = 103  # the shadow is stopping
    TIMEOUT = 104  # the peer was silent for too long
    INTERNAL = 105  # a bug or unexpected failure on the sender's side

    @property
    def permanent(self) -> bool:
        return self.value < 100


class Event:
    """Base class of every protocol event."""

    __slots__ = ()


@dataclass(frozen=True)
class FileHeld:
    """What home holds of one version of a file the job writes (WELCOME):
    every byte below `durable` is durable, and the version is NAME's
    content at `committed` bytes (-1: not committed yet)."""

    file: int
    version: int
    durable: int
    committed: int = -1


@dataclass(frozen=True)
class Hello(Event):
    """Agent → shadow, first frame: who this job is and what it streams.

    `instance` identifies one run of the job (one spool). A job id seen with a
    new instance is a new attempt: the shadow starts its files afresh.
    """

    job_id: str
    instance: str
    streams: tuple[StreamSpec, ...]
    host: str = ""
    user: str = ""
    command: tuple[str, ...] = ()
    versions: tuple[int, ...] = (PROTOCOL_VERSION,)
    nonce: str = ""  # the agent's challenge to the shadow (hex), for token authentication
    features: tuple[str, ...] = ()  # optional extensions the agent can use, e.g. "zstd"


@dataclass(frozen=True)
class Welcome(Event):
    """Shadow → agent: the durable length the shadow holds of every output
    stream, so the agent resumes exactly there. `session` increases with every
    accepted connection of the job (the fencing epoch)."""

    version: int
    session: int
    durable: tuple[tuple[int, int], ...]  # (stream id, durable length)
    heartbeat: float = 10.0  # seconds the shadow waits for a frame before it gives up
    proof: str = ""  # the shadow's answer to the agent's nonce (hex HMAC), when a token is in use
    features: tuple[str, ...] = ()  # the agent's features the shadow accepts for this connection
    files: tuple[FileHeld, ...] = ()  # what home holds of this run's files ("files" feature)


@dataclass(frozen=True)
class Challenge(Event):
    """Shadow → agent, after HELLO when a token is required: prove you know it."""

    nonce: str  # hex, fresh for every connection


@dataclass(frozen=True)
class Auth(Event):
    """Agent → shadow: HMAC-SHA256 over both nonces and the job (hex)."""

    mac: str


@dataclass(frozen=True)
class Data(Event):
    """Agent → shadow: bytes of an output stream at an absolute offset."""

    stream: int
    offset: int
    payload: bytes


@dataclass(frozen=True)
class DataPiece(Event):
    """Agent → shadow, as it arrives: the bytes of a DATA frame's payload
    that belong at `offset`, of the frame that covers `start`..`end` of
    `stream`. A frame's pieces come in order, without gaps: the first at
    `start`, the last ending at `end` (one empty piece for an empty frame).
    Only from a receiving `Connection` with `pieces` set; the frame's head
    (its length, stream field, offset range) is checked before its first
    piece. Whether the frame is whole is known only at its last piece."""

    stream: int
    offset: int
    payload: bytes
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.offset == self.start

    @property
    def last(self) -> bool:
        return self.offset + len(self.payload) == self.end


@dataclass(frozen=True)
class ZData(Event):
    """Agent → shadow: `size` bytes of an output stream at `offset`, as one
    zstd frame. Only once WELCOME accepted the "zstd" feature. Offsets and
    sizes count the job's bytes, never the compressed ones."""

    stream: int
    offset: int
    size: int
    payload: bytes


@dataclass(frozen=True)
class Ack(Event):
    """Shadow → agent: every byte of `stream` below `offset` is durable at home."""

    stream: int
    offset: int


@dataclass(frozen=True)
class StdinRead(Event):
    """Agent → shadow: send stdin bytes from `offset`, at most `max_bytes`."""

    stream: int
    offset: int
    max_bytes: int


@dataclass(frozen=True)
class StdinData(Event):
    """Shadow → agent: stdin bytes at `offset`; `eof` when the file ends there."""

    stream: int
    offset: int
    payload: bytes
    eof: bool


@dataclass(frozen=True)
class Exit(Event):
    """Agent → shadow: the job ended. `code` is its exit status, or `signal`
    the signal that killed it; `lengths` the final length of each output stream.
    `reason` says why gcwrap ended it, when it did."""

    code: int | None
    signal: int | None
    lengths: tuple[tuple[int, int], ...]
    reason: str = ""
    summary: tuple[tuple[str, str], ...] = field(default=())
    files: tuple[tuple[int, int, int], ...] = ()  # (file, version, size): each file's final version


# -- the files the job writes ("files" feature) ----------------------------------
#
# A file is delivered as versions. A version is append-only with
# acknowledged offsets, as an output stream is; its bytes come from the wire
# (FILE_DATA) or from the version home holds (FILE_COPY, a block that did
# not change), and it ends in a commit: home checks its size and SHA-256 and
# makes NAME hold exactly it. A newer version of a file abandons an older
# one that is not committed. `file` is a handle (1..2**32-1) the agent gives
# a NAME for this run of the job; versions (1..2**32-1) only grow.


@dataclass(frozen=True)
class FileOpen(Event):
    """Agent → shadow: version `version` of file `file` is NAME's next
    content; `base` (a version home holds committed) is what FILE_COPY
    frames copy from (None: every byte comes on the wire)."""

    file: int
    name: str
    version: int
    base: int | None = None


@dataclass(frozen=True)
class FileData(Event):
    """Agent → shadow: bytes of a file's version at an absolute offset."""

    file: int
    version: int
    offset: int
    payload: bytes | memoryview  # (a sender's view of its read buffer, sent before the buffer is used again)


@dataclass(frozen=True)
class FileCopy(Event):
    """Agent → shadow: the version's `length` bytes at `offset` are its
    base's at `source` (a block home holds already)."""

    file: int
    version: int
    offset: int
    source: int
    length: int


@dataclass(frozen=True)
class FileCommit(Event):
    """Agent → shadow: the version is whole at `size` bytes, whose SHA-256 is
    `sha256` (64 hex digits): home makes NAME hold exactly it."""

    file: int
    version: int
    size: int
    sha256: str


@dataclass(frozen=True)
class FileAck(Event):
    """Shadow → agent: every byte of the version below `offset` is durable
    at home; `committed`: the version is NAME's content at `offset` bytes."""

    file: int
    version: int
    offset: int
    committed: bool = False


NoteValue = str | int | float | bool | None


@dataclass(frozen=True)
class Note:
    """One moment of a job's life as the agent saw it (a stall, a lost
    connection, a reconnection, a pause, compression turned on...), for the
    job's timeline at home: when (`time`, a Unix time), what (`kind`, a short
    identifier), and its details (name, value pairs)."""

    time: float
    kind: str
    details: tuple[tuple[str, NoteValue], ...] = ()


@dataclass(frozen=True)
class Notes(Event):
    """Agent → shadow, once WELCOME accepted the "notes" feature: moments of
    the job's life the shadow could not see itself (an outage's start and
    length, known to the agent alone), sent when it reconnects."""

    notes: tuple[Note, ...]


@dataclass(frozen=True)
class Done(Event):
    """Shadow → agent: the exit status and every byte are recorded; goodbye."""


@dataclass(frozen=True)
class Ping(Event):
    """Either side: are you there? The peer answers with a Pong of the same nonce."""

    nonce: int


@dataclass(frozen=True)
class Pong(Event):
    """Either side: the answer to the Ping of the same nonce."""

    nonce: int


@dataclass(frozen=True)
class Error(Event):
    """Either side: what failed, then the connection closes."""

    code: ErrorCode
    message: str
    retry_after: float = 0.0


@dataclass(frozen=True)
class ConnectionClosed(Event):
    """The peer closed its side cleanly (EOF between frames)."""
