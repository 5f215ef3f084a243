"""gcwrap's exit statuses: the job's own status passes through (128+N when
signal N killed it); gcwrap's own failures use these, like timeout(1).

Precedence, when more than one applies: LOST (121) comes first, since no
resume can bring those bytes back; then RETRY_LIMIT (124) or REFUSED (123);
UNDELIVERED (122) only when everything the job wrote is in the spool.
`gcwrap resume` of several spools exits with the first of them in `RANK`.
"""

from __future__ import annotations

USAGE = 2  # bad command line (before the job starts)
LOST = 121  # output held only in memory could go neither to disk nor home: it is lost
UNDELIVERED = 122  # the job ended, output is still in the spool: run `gcwrap resume`
REFUSED = 123  # the shadow refused the job for good (path forbidden, owned, auth...)
RETRY_LIMIT = 124  # both disk and network failed past --retry-limit; job killed
INTERNAL = 125  # gcwrap itself failed (spool unusable, internal error)
CANNOT_EXECUTE = 126  # COMMAND found but could not be run (or too few descriptors to run it)
NOT_FOUND = 127  # COMMAND not found

TABLE = [
    ("0-255", "the job's own exit status (128+N if signal N killed it)"),
    (str(USAGE), "usage error: bad option or NAME; the job was not started"),
    (str(LOST), ("output is lost: bytes held only in memory could go neither to disk nor home "
                 "(first in precedence: the rest may also be spooled, refused or killed)")),
    (str(UNDELIVERED), "the job ended but output is still spooled; `gcwrap resume` delivers it"),
    (str(REFUSED), "the shadow refused the job (forbidden path, file owned by another job...)"),
    (str(RETRY_LIMIT), "disk and network both failed past --retry-limit; the job was killed"),
    (str(INTERNAL), "gcwrap failed (spool unusable, internal error)"),
    (str(CANNOT_EXECUTE), "COMMAND could not be executed (also: too few file descriptors to run it, `ulimit -n`)"),
    (str(NOT_FOUND), "COMMAND was not found"),
]

# Most telling first: what a script should hear of when several spools end differently.
RANK = [LOST, INTERNAL, REFUSED, UNDELIVERED, USAGE]


def worst(a: int, b: int) -> int:
    """The status that tells more, of two (0 tells least; a status not in RANK less than any in it)."""
    def rank(code: int) -> int:
        return RANK.index(code) if code in RANK else len(RANK) + (code == 0)

    return a if rank(a) <= rank(b) else b
