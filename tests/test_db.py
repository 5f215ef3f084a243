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
