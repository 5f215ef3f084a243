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


# -- the store, on a real PostgreSQL ----------------------------------------------------------

import os  # noqa: E402
from pathlib import Path  # noqa: E402

from gcwrap.shadow.files import Problem, StoreError, StreamFile  # noqa: E402
from gcwrap.shadow.state import Store  # noqa: E402
from gcwrap.shadow.stateurl import check_state, shown  # noqa: E402
from gcwrap.wire.events import StreamSpec  # noqa: E402

STREAMS = (StreamSpec(1, "stdout", "out.txt"),)


def _pg(root: Path, url: str):  # type: ignore[no-untyped-def]
    from gcwrap.shadow.pgstate import PgStore

    return PgStore(root, url)


def _open(store: Store, instance: str = "a1", job: str = "j1"):  # type: ignore[no-untyped-def]
    return store.open_job(job_id=job, instance=instance, streams=STREAMS, host="h", user="u", command=["c"],
                          peer="p")


def _write(sf: StreamFile, data: bytes) -> None:
    os.pwrite(sf.fd, data, sf.written)
    sf.written += len(data)


@pytest.mark.timeout(120)
def test_a_claim_records_and_resumes_at_the_durable_length(tmp_path: Path, pg_url: str) -> None:
    store = _pg(tmp_path, pg_url)
    try:
        files = _open(store)
        sf = files.outputs[1]
        _write(sf, b"hello world")
        results, error = store.make_durable([(sf, 6)])
        assert error == "" and [err for _, _, err in results] == [None]
        files.close()
        (tmp_path / "out.txt").write_bytes(b"hello world and a torn tail")
        again = _open(store)
        assert again.session == 2 and again.outputs[1].durable == 6
        assert (tmp_path / "out.txt").read_bytes() == b"hello "  # cut back to what was acknowledged
        assert store.record_finished("j1", 2, code=0, signal=None, reason="", summary={"k": 1})
        again.close()
    finally:
        store.close()
    from gcwrap.shadow.backends import read_jobs

    [job] = read_jobs(pg_url, tmp_path)
    assert (job["job_id"], job["state"], job["exit_code"], job["summary"]) == ("j1", "finished", 0, {"k": 1})
    assert job["streams"][0]["durable"] == 6


@pytest.mark.timeout(120)
def test_two_shadows_one_job_the_file_lock_and_the_epoch_fence_the_older(tmp_path: Path, pg_url: str) -> None:
    a, b = _pg(tmp_path, pg_url), _pg(tmp_path, pg_url)
    try:
        held = _open(a)
        sf = held.outputs[1]
        _write(sf, b"0123456789")
        assert a.make_durable([(sf, 4)])[0][0][2] is None
        # The other shadow cannot take the files while the holder has them
        # open; it takes the job in the state, and the holder's later
        # lengths are not recorded (no ACK).
        with pytest.raises(StoreError) as e:
            _open(b)
        assert e.value.problem is Problem.HELD and "told to let go" in str(e.value)
        assert a.superseded({"j1": held.session}) == {"j1"}
        results, error = a.make_durable([(sf, 10)])
        assert error == "" and type(results[0][2]).__name__ == "Superseded"
        held.close()  # the holder lets go
        taken = _open(b)
        assert taken.outputs[1].durable == 4 and (tmp_path / "out.txt").read_bytes() == b"0123"
        assert b.superseded({"j1": taken.session}) == set()
        taken.close()
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(120)
def test_a_root_belongs_to_one_state(tmp_path: Path, pg_url: str, postgres) -> None:  # type: ignore[no-untyped-def]
    import psycopg

    embedded = Store(tmp_path / "one")
    with pytest.raises(StoreError, match="embedded state"):
        _pg(tmp_path / "one", pg_url)  # while it serves: the root lock
    embedded.close()
    with pytest.raises(StoreError, match=r"belongs to the embedded state \(ROOT/.gcshadow/state.db\)"):
        _pg(tmp_path / "one", pg_url)  # and after: the root's record
    _pg(tmp_path / "two", pg_url).close()
    with pytest.raises(StoreError, match="belongs to a shared state database"):
        Store(tmp_path / "two")
    other = postgres.database_url("other_" + os.urandom(4).hex())
    with psycopg.connect(postgres.url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{other.rsplit("/", 1)[1]}"')
    with pytest.raises(StoreError, match="another shared state database"):
        _pg(tmp_path / "two", other)


def test_a_password_in_the_url_is_never_shown() -> None:
    url = "postgresql://gc:s3cret@db.example.org:5433/gcshadow?sslmode=require&password=s3cret"
    assert "s3cret" not in shown(url)
    assert shown(url) == "postgresql://gc@db.example.org:5433/gcshadow?sslmode=require"
    with pytest.raises(StoreError, match="not a state this shadow knows") as e:
        check_state("mysql://gc:s3cret@db/x")
    assert "s3cret" not in str(e.value)


@pytest.mark.timeout(120)
def test_a_durable_record_waits_for_a_claim_in_progress_and_then_records_nothing(tmp_path: Path, pg_url: str) -> None:
    """A claim reads the durable lengths after locking the job's row: a
    record that slipped in between (and was acknowledged) would be below
    what the new session cuts the file back to. So a record locks the row
    too, and one that waited for a claim finds its session superseded."""
    import threading
    import time

    import psycopg

    store = _pg(tmp_path, pg_url)
    try:
        files = _open(store)
        sf = files.outputs[1]
        _write(sf, b"0123456789")
        assert store.make_durable([(sf, 4)])[0][0][2] is None
        claim = psycopg.connect(pg_url)  # another shadow's claim, in its transaction
        claim.execute("SELECT session FROM gcshadow.jobs WHERE job_id = 'j1' FOR UPDATE")
        result: dict[str, object] = {}
        recording = threading.Thread(target=lambda: result.update(
            refused=store.record_durable([("j1", 1, 10, files.session, 10)])))
        recording.start()
        with psycopg.connect(pg_url, autocommit=True) as watch:
            deadline = time.monotonic() + 20
            while watch.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                "AND datname = current_database()").fetchone() != (1,):
                assert time.monotonic() < deadline and recording.is_alive(), "the record did not wait"
                time.sleep(0.01)
        claim.execute("UPDATE gcshadow.jobs SET session = session + 1 WHERE job_id = 'j1'")
        durable_seen = claim.execute("SELECT durable FROM gcshadow.streams WHERE job_id = 'j1'").fetchone()
        claim.commit()
        claim.close()
        recording.join(20)
        assert result["refused"] == {("j1", 1)}
        assert durable_seen == (4,)
        with psycopg.connect(pg_url) as conn:
            assert conn.execute("SELECT durable FROM gcshadow.streams WHERE job_id = 'j1'").fetchone() == (4,)
        files.close()
    finally:
        store.close()
