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


def test_the_storage_subset_reads_as_sqlite_utils_does(tmp_path: Path) -> None:
    """Code written against db[table].rows_where runs on either database."""
    import sqlite_utils

    from gcwrap.db import Database, connect

    conn = connect(tmp_path / "x.db")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, n INTEGER)")
    conn.executemany("INSERT INTO t VALUES (?, ?, ?)", [(2, "b", None), (1, "a", 5), (3, "c", 7)])
    for db in (Database(conn), sqlite_utils.Database(conn)):
        assert list(db["t"].rows_where(order_by="id")) == [  # type: ignore[index]
            {"id": 1, "name": "a", "n": 5}, {"id": 2, "name": "b", "n": None}, {"id": 3, "name": "c", "n": 7}]
        assert list(db["t"].rows_where("n > ?", [5])) == [{"id": 3, "name": "c", "n": 7}]  # type: ignore[index]
    conn.close()


def test_a_job_imports_no_sqlite_utils_and_the_read_side_does(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; from gcwrap.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('sqlite_utils' in sys.modules, file=sys.stderr)")
    env = {**os.environ, "GCWRAP_SPOOL": str(tmp_path)}
    job = subprocess.run([sys.executable, "-c", code, "--", "true"], capture_output=True, text=True, timeout=60,
                         env=env, check=False)
    assert job.stderr.strip().endswith("False"), job.stderr
    from gcwrap.records import JobRecord
    from gcwrap.spool import SPOOL_SUFFIX, Spool

    Spool.create(tmp_path / f"j{SPOOL_SUFFIX}", JobRecord("j", "1", ["true"]), [(1, "stdout", "out")], 1 << 20).close()
    status = subprocess.run([sys.executable, "-c", code, "status"], capture_output=True, text=True, timeout=60,
                            env=env, check=False)
    assert status.stderr.strip().endswith("True"), status.stderr
    assert "j" in status.stdout
