"""The SQLite URI the spool and the shadow's state are opened with."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from gcwrap.db import uri


@pytest.mark.parametrize("name", ["C#1", "a?b", "50%", "%41", "two words", "ü", "x&mode=ro", os.fsdecode(b"\xff\xfe")])
def test_uri_names_exactly_the_path(tmp_path: Path, name: str) -> None:
    d = tmp_path / name
    d.mkdir()
    db = sqlite3.connect(uri(d / "state.db", mode="rwc"), uri=True)
    db.execute("CREATE TABLE t (x)")
    db.close()
    assert sorted(os.listdir(d)) == ["state.db"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name], "no stray database beside it"
    ro = sqlite3.connect(uri(d / "state.db", mode="ro"), uri=True)
    try:
        assert ro.execute("SELECT name FROM sqlite_master").fetchall() == [("t",)]
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            ro.execute("INSERT INTO t VALUES (1)")
    finally:
        ro.close()


def test_uri_of_a_relative_path_and_of_one_with_two_leading_slashes(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert uri("rel.db") == f"file://{tmp_path}/rel.db"
    # POSIX keeps two leading slashes: "file://" + "//x" must not read "x" as a host.
    db = sqlite3.connect(uri("/" + str(tmp_path / "two.db")), uri=True)
    db.execute("CREATE TABLE t (x)")
    db.close()
    assert (tmp_path / "two.db").exists()


def test_migrations_apply_once_in_order_each_in_its_own_transaction(tmp_path: Path) -> None:
    from gcwrap.db import Database, configure, connect, migrate

    conn = connect(tmp_path / "x.db")
    configure(conn, synchronous="FULL", journal_size_limit=1 << 20)
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert conn.execute("PRAGMA synchronous").fetchone() == (2,)
    db = Database(conn)
    ran: list[int] = []

    def step(n: int) -> object:
        def fn(d: Database) -> None:
            ran.append(n)
            d.execute(f"CREATE TABLE t{n} (x)")
        return fn

    def broken(d: Database) -> None:
        d.execute("CREATE TABLE t3 (x)")
        raise RuntimeError("half-way")

    migrations = [(1, "one", step(1)), (2, "two", step(2))]
    migrate(db, migrations)  # type: ignore[arg-type]
    migrate(db, migrations)  # type: ignore[arg-type]
    assert ran == [1, 2]
    with pytest.raises(RuntimeError):
        migrate(db, [*migrations, (3, "broken", broken)])
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "t3" not in tables, "rolled back with its record"
    assert [r[0] for r in conn.execute("SELECT id FROM _migrations ORDER BY id")] == [1, 2]
    conn.close()


def test_remove_deletes_the_database_with_its_wal_files(tmp_path: Path) -> None:
    from gcwrap.db import configure, connect, files, remove, size

    path = tmp_path / "x.db"
    conn = connect(path)
    configure(conn)
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")
    assert size(path) > 0 and any(p.exists() for p in files(path)[1:])
    conn.close()
    remove(path)
    remove(path)  # (nothing left: no error)
    assert not any(p.exists() for p in files(path)) and size(path) == 0
