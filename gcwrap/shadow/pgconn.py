"""Connections to the shadow's state in PostgreSQL: one per thread that
uses it, opened again after a failure, with a prober that says when a lost
database is back (`pgstate` explains what each is for).

A lost database (refused, reset, or a failing query) makes every call raise
`StateUnavailable` (a StoreError, told to agents as BUSY): nothing is
acknowledged; `Health` says so once in the log. While it is lost no call
waits for it: `Prober` tries to connect every PROBE_EVERY seconds, and the
first that succeeds lets every call through again at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from .files import StateUnavailable

log = logging.getLogger("gcshadow")

CONNECT = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
           "keepalives_count": 3, "tcp_user_timeout": 10000}  # a dead server is noticed in seconds, not hours
PROBE_EVERY = 0.2  # seconds between the prober's connection attempts while the database is lost
PROBE_TIMEOUT = 2  # seconds a probe's connection attempt may take (libpq's least)
PROBE_CONNECT = {**CONNECT, "connect_timeout": PROBE_TIMEOUT}
IDLE_PING = 1.0  # seconds: a connection idle longer is pinged before use
LOCK_TIMEOUT = "3s"  # a claim waits this long for a job row a transaction in doubt still locks
IDLE_IN_TRANSACTION = "30s"  # the server ends a transaction of ours left open this long (its client gone)


class Health:
    """Whether the state database answers: said once in the log when it is
    lost, once when it is back. While it is lost (`down`), no connection
    tries it: `Prober` does, and `ok()` lets them through again."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.down = ""
        self.failures = 0  # how many times a connection failed: the others' may be broken too

    def failed(self, why: str) -> None:
        with self.lock:
            self.failures += 1
            if not self.down:
                log.error("lost the state database %s: %s; acknowledging nothing and refusing sessions "
                          "until it is back", self.name, why)
            self.down = why
            self.changed.notify_all()

    def ok(self) -> None:
        if self.down:
            with self.lock:
                if self.down:
                    log.warning("the state database %s is back: serving again", self.name)
                self.down = ""


class Prober:
    """A thread that, while the state database is lost, tries to connect to
    it every PROBE_EVERY seconds, and says it is back as soon as it is: no
    claim or record waits for a connection attempt meanwhile."""

    def __init__(self, url: str, health: Health) -> None:
        self.url = url
        self.health = health
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="gcshadow-state-prober", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        health = self.health
        while True:
            with health.lock:
                while not health.down and not self.stopping:
                    health.changed.wait()
                if self.stopping:
                    return
            try:
                psycopg.connect(self.url, autocommit=True, **PROBE_CONNECT).close()  # type: ignore[arg-type]
            except psycopg.Error:
                with health.lock:
                    if not self.stopping:
                        health.changed.wait(PROBE_EVERY)
                continue
            health.ok()

    def stop(self) -> None:
        with self.health.lock:
            self.stopping = True
            self.health.changed.notify_all()
        self.thread.join(PROBE_TIMEOUT + 1)


class PgConnection:
    """One connection to the state database, for one thread at a time (its
    lock), opened again after a failure once the database is back."""

    def __init__(self, url: str, health: Health) -> None:
        self.url = url
        self.health = health
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None
        self.why = ""
        self.used = 0.0  # when the connection last answered
        self.seen = 0  # health.failures then
        self.password = str(psycopg.conninfo.conninfo_to_dict(url).get("password") or "")

    def _say(self, e: BaseException) -> str:
        """An error in one line, never with the password."""
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return why.replace(self.password, "***") if self.password else why

    def _connected(self) -> psycopg.Connection[Any]:
        conn = self.conn
        if conn is not None and not conn.closed and not conn.broken:
            if time.monotonic() - self.used < IDLE_PING and self.seen == self.health.failures:
                return conn
            # Idle a while, or another connection failed since this one was
            # last used: the server may have restarted meanwhile. A ping finds
            # out (then one new connection, at once), rather than the next
            # record failing and its sessions being stopped for nothing.
            try:
                conn.execute("SELECT 1")
                self.used, self.seen = time.monotonic(), self.health.failures
                return conn
            except psycopg.Error:
                with contextlib.suppress(Exception):
                    conn.close()
        self.conn = None
        if self.health.down:  # (the prober says when it is back)
            raise StateUnavailable(f"cannot reach the state database {self.health.name}: {self.health.down}",
                                   self.health.down)
        try:
            conn = psycopg.connect(self.url, autocommit=True, **CONNECT)  # type: ignore[arg-type]
            # A claim waits this long at most for a row a transaction in doubt
            # holds; the server ends one of ours whose client went silent.
            conn.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
            conn.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION}'")
        except psycopg.Error as e:
            self._failed(e)
            raise StateUnavailable(f"cannot reach the state database {self.health.name}: {self.why}",
                                   self.why) from None
        self.conn = conn
        self.used, self.seen = time.monotonic(), self.health.failures
        return conn

    def _failed(self, e: BaseException) -> None:
        self.why = self._say(e)
        self.health.failed(self.why)
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """A transaction on the connection: committed when the block ends,
        rolled back on an error; StateUnavailable when the database fails
        (for a COMMIT whose connection was lost: it may have applied)."""
        with self.lock:
            conn = self._connected()
            try:
                with conn.transaction():
                    yield conn
            except psycopg.errors.LockNotAvailable:
                # Rolled back, on a connection that works: a row is held by a
                # transaction in doubt (its client gone) until the server ends it.
                raise StateUnavailable("a job's record is locked by an unfinished transaction "
                                       "(a connection lost mid-commit): come back shortly") from None
            except psycopg.Error as e:
                self._failed(e)
                raise StateUnavailable(f"the state database {self.health.name} failed: {self.why}", self.why) from None
            self.used, self.seen = time.monotonic(), self.health.failures
            self.health.ok()

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                with contextlib.suppress(Exception):
                    self.conn.close()
                self.conn = None
