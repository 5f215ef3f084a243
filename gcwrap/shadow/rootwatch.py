"""The shadow's root, watched: deleted or replaced under a running shadow.

The shadow works under its root through one descriptor opened at start
(`Store.root_fd`): every file is opened relative to it. After `rm -rf ROOT;
mkdir ROOT`, or `mv ROOT ROOT.old; mkdir ROOT`, that descriptor still names
the old directory, deleted or elsewhere: files made there are not where
anyone looks, and what was acknowledged is no longer at ROOT. So the shadow
compares its descriptor with the path (their identity, not their names):
once the root is gone or replaced it says so once, fences every live
session (nothing more is acknowledged) and refuses every new one with BUSY
(the agents keep their output in their spools and come back), until it is
restarted: a new, empty root would not hold what was acknowledged.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import trio

from .durability import LiveJob, Trouble

log = logging.getLogger("gcshadow")

ROOT_CHECK = 1.0  # seconds between two looks at the root (and when a session is admitted)


class RootWatch:
    """Whether the root is still the directory this shadow serves (`gone`: why not)."""

    def __init__(self, root: Path, root_fd: int, live: dict[str, LiveJob]) -> None:
        self.root = root
        self.root_fd = root_fd
        self.live = live  # the sessions to fence once it is gone
        st = os.fstat(root_fd)
        self.identity = (st.st_dev, st.st_ino)
        self.gone = ""

    def look(self) -> str:
        """Why the root is no longer the one served, or "" (two stats: blocking)."""
        try:
            if os.fstat(self.root_fd).st_nlink == 0:
                return f"the root {self.root} was deleted"
        except OSError as e:
            return f"the root {self.root} was deleted" if e.errno == errno.ESTALE else ""  # (NFS: deleted elsewhere)
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return f"the root {self.root} is gone (moved away or deleted)"
        except OSError:
            return ""  # (cannot tell now: the next look will)
        if (st.st_dev, st.st_ino) != self.identity:
            return f"the root {self.root} was replaced by another directory"
        return ""

    @property
    def refusal(self) -> str:
        """What a refused agent is told."""
        return f"{self.gone} under the shadow: it takes no job until it is restarted" if self.gone else ""

    def check(self) -> str:
        """Look now (a session is being admitted): why it is refused, or ""."""
        self._act(self.gone or self.look())
        return self.refusal

    def _act(self, why: str) -> None:
        if why and not self.gone:
            self.gone = why
            log.error("%s while this shadow served it: it acknowledges nothing more and refuses every job until "
                      "it is restarted (what it acknowledged was in that directory)", why)
        if self.gone:  # every look: a session admitted since the last one is fenced too
            for job in list(self.live.values()):
                job.fence(self.refusal, Trouble.ROOT)

    async def run(self) -> None:
        """Look every ROOT_CHECK seconds (in a thread: the root may be on NFS)."""
        while True:
            await trio.sleep(ROOT_CHECK)
            self._act(self.gone or await trio.to_thread.run_sync(self.look, abandon_on_cancel=True))
