"""store.engine.open_readonly on real campaign files: it reads, and leaves the file and its
directory as they were."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
from pathlib import Path

import pytest

from store.engine import ReadOnlyView, open_readonly, readonly_view
from store.errors import DatabaseOpenError, NoCampaignYet

LEASED = {"data": {"n": 90}, "target_branch": 7}  # left in flight, holding a target lease
QUEUED = {"data": {"n": 91}}                       # enqueued last, never dispatched


def _payload(db: Path, token: str) -> dict:
    (payload,) = _one(db, "SELECT t.payload FROM dispatches d JOIN tasks t ON t.id = d.task_id "
                          "WHERE d.token = ?", (token,))
    return json.loads(payload)


def _finish(farm, rank: int, token: str) -> None:
    farm.result(rank, token, "ok", {"n": _payload(farm.path, token)["data"]["n"]})
    farm.ready(rank, token)


@pytest.fixture
def campaign(farm) -> Path:
    """A campaign as a killed master leaves it: done tasks (one with a stored input), one that
    was recovered from a garbage RESULT and done on its second dispatch (a quarantine row, a
    `recovered` and a `dispatched` event), one in flight holding a target lease, one queued."""
    farm.enqueue(*({"data": {"n": i}} for i in range(4)))
    farm.enqueue({"data": {"n": 4}}, input_bytes=b"stored input")
    farm.enqueue(LEASED)
    farm.ready(1)
    farm.ready(2)
    first = farm.dispatch(1, 2)
    farm.result_raw(2, ["not", "a", "mapping"])
    farm.ready(2, first[2])
    assert [r.token for r in farm.sweep()] == [first[2]]
    _finish(farm, 1, first[1])
    in_flight = None
    while tokens := farm.dispatch(*(r for r in (1, 2) if r != in_flight)):
        for rank, token in tokens.items():
            if "target_branch" in _payload(farm.path, token):
                in_flight = rank
            else:
                _finish(farm, rank, token)
    farm.enqueue(QUEUED)
    farm.close()
    with contextlib.closing(sqlite3.connect(farm.path)) as c:
        states = dict(c.execute("SELECT state, count(*) FROM tasks GROUP BY state"))
        assert states == {"done": 5, "active": 1, "queued": 1}
        assert c.execute("SELECT count(*) FROM leases").fetchone() == (1,)
        assert c.execute("SELECT count(*) FROM quarantine").fetchone() == (1,)
    # Every connection closed: the file is at rest (its last closer removed the -wal).
    assert sorted(p.name for p in farm.path.parent.iterdir()) == ["campaign.db",
                                                                   "campaign.db.lock"]
    return farm.path


def _write(db: Path, *sql: str, params: tuple = ()) -> None:
    c = sqlite3.connect(db)  # foreign keys off, like the sqlite3 shell
    try:
        for s in sql:
            c.execute(s, params if "?" in s else ())
        c.commit()
    finally:
        c.close()


def _one(db: Path, sql: str, params: tuple = ()):
    with contextlib.closing(sqlite3.connect(db)) as c:
        return c.execute(sql, params).fetchone()


def _listing(directory: Path) -> dict[str, str]:
    """Every name in `directory` with a digest of its bytes."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.iterdir())}


def _done_task(db: Path) -> tuple[int, str]:
    """A done task with one dispatch, and its result's token."""
    return _one(db, "SELECT r.task_id, r.token FROM results r JOIN tasks t ON t.id = r.task_id "
                    "WHERE t.dispatches = 1 ORDER BY r.task_id LIMIT 1")


# -- opening read-only -----------------------------------------------------------------------

@pytest.mark.parametrize("kind, error, message", [
    ("missing", DatabaseOpenError, "does not exist"),
    ("missing directory", DatabaseOpenError, "does not exist"),
    ("directory", DatabaseOpenError, "is a directory"),
    ("empty", NoCampaignYet, r"holds no campaign yet \(an empty file\)"),
    ("not sqlite", DatabaseOpenError, "is not an SQLite database"),
])
def test_a_path_that_holds_no_database_is_refused_and_nothing_is_made(tmp_path, kind, error,
                                                                      message):
    path = {"missing": tmp_path / "c.db", "missing directory": tmp_path / "no" / "c.db",
            "directory": tmp_path / "d.db", "empty": tmp_path / "c.db",
            "not sqlite": tmp_path / "c.db"}[kind]
    if kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.touch()
    elif kind == "not sqlite":
        path.write_bytes(b"these bytes are not an SQLite header\n" * 200)
    before = _listing(tmp_path)
    with pytest.raises(error, match=message) as e:
        open_readonly(path)
    assert "\n" not in str(e.value)
    assert _listing(tmp_path) == before


def _read(path: Path, sql: str) -> list[tuple]:
    engine = open_readonly(path)
    try:
        with engine.connect() as conn, conn.begin():
            return [tuple(r) for r in conn.exec_driver_sql(sql)]
    finally:
        engine.dispose()


def test_a_name_with_uri_characters_is_the_file_it_names(tmp_path):
    from store.campaign import Store
    for name in ("c?mode=rw.db", "p%41#x.db"):
        Store.open(tmp_path / name).close()
    (tmp_path / "c").write_bytes(b"the file an unquoted URI would open")
    (tmp_path / "pA#x.db").write_bytes(b"the file an unquoted URI would open")
    before = _listing(tmp_path)
    for name in ("c?mode=rw.db", "p%41#x.db"):
        assert _read(tmp_path / name, "SELECT incarnation FROM campaign") == [(1,)]
    assert _listing(tmp_path) == before


def test_a_campaign_at_rest_is_read_without_a_file_made_beside_it(campaign):
    """An ordinary read-only reader of a WAL file nobody has open makes its -wal and -shm,
    and leaves them: the file is read as immutable instead."""
    before = _listing(campaign.parent)
    engine = open_readonly(campaign)
    assert readonly_view(engine).mode == ReadOnlyView.AT_REST
    engine.dispose()
    assert _read(campaign, "SELECT count(*) FROM results") == [(5,)]
    assert _listing(campaign.parent) == before


def test_the_connection_refuses_to_write(campaign):
    engine = open_readonly(campaign)
    try:
        with engine.connect() as conn, conn.begin():
            assert conn.exec_driver_sql("PRAGMA query_only").scalar() == 1
            with pytest.raises(Exception, match="readonly|read-only|query_only"):
                conn.exec_driver_sql("DELETE FROM results")
    finally:
        engine.dispose()
    assert _one(campaign, "SELECT count(*) FROM results") == (5,)
