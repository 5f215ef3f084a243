"""The shadow's state in PostgreSQL: a real server, started by the tests."""

from __future__ import annotations

import pytest


@pytest.mark.timeout(120)
def test_each_test_gets_a_fresh_database_of_a_real_server(pg_url: str, postgres_url: str) -> None:
    import psycopg

    assert pg_url != postgres_url
    with psycopg.connect(pg_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone() == (0,)
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
