"""A real PostgreSQL for the tests that keep the shadow's state there.

`postgres_url` starts one throwaway cluster per test session from the
operating system's packages (tests/postgres/start-postgres.sh; its port and
directory derived from GCWRAP_TEST_NET and this process, so parallel runs do
not collide) and stops it at the end by pg_ctl; tests that need it skip,
saying why, where PostgreSQL or psycopg cannot be had. `pg_url` is a fresh
database of that server for one test (CREATE DATABASE: fast).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from stages import net_number

SCRIPTS = Path(__file__).parent / "postgres"
NET = net_number()


@dataclass
class PgServer:
    """The test session's PostgreSQL: its URL and cluster directory."""

    url: str
    port: int
    pg_dir: Path

    def ctl(self, action: str) -> None:
        """stop, start or restart the server (tests/postgres/ctl-postgres.sh)."""
        subprocess.run([str(SCRIPTS / "ctl-postgres.sh"), action], env={**os.environ, "PG_DIR": str(self.pg_dir)},
                       check=True, timeout=120, capture_output=True)

    def database_url(self, name: str) -> str:
        return self.url.rsplit("/", 1)[0] + "/" + name


def _start() -> PgServer:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed: pip install -e '.[test]' (the postgresql extra)")
    pg_dir = Path(tempfile.gettempdir()) / f"gcwrap-pg-{NET}-{os.getpid()}"
    why = ""
    for attempt in range(8):  # a port another run or program holds: the next one
        port = 55400 + NET * 8 + (os.getpid() + attempt) % 8
        proc = subprocess.run([str(SCRIPTS / "start-postgres.sh"), str(port)],
                              env={**os.environ, "PG_DIR": str(pg_dir)}, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0:
            return PgServer(proc.stdout.strip().splitlines()[-1], port, pg_dir)
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        if "not installed" in why:
            break
    subprocess.run([str(SCRIPTS / "stop-postgres.sh")], env={**os.environ, "PG_DIR": str(pg_dir)}, timeout=120)
    pytest.skip(f"cannot start PostgreSQL: {why}")


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    """The session's PostgreSQL server (skips where it cannot be started)."""
    server = _start()
    try:
        yield server
    finally:
        subprocess.run([str(SCRIPTS / "stop-postgres.sh")], env={**os.environ, "PG_DIR": str(server.pg_dir)},
                       timeout=120)


@pytest.fixture(scope="session")
def postgres_url(postgres: PgServer) -> str:
    """The URL of the session's PostgreSQL server (its first database)."""
    return postgres.url


@pytest.fixture
def pg_url(postgres: PgServer) -> Iterator[str]:
    """A fresh, empty database for one test, dropped after it."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield postgres.database_url(name)
    finally:
        try:
            with psycopg.connect(postgres.url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except psycopg.Error:
            pass  # the server is gone (a test stopped it): the cluster is removed at the end anyway
