"""Schema revisions: pytest-alembic's standard checks, plus what a user does with a campaign file.

Every test runs on a real SQLite file in tmp_path, opened through the project's one engine
factory (WAL, foreign keys, our own BEGIN IMMEDIATE), never an in-memory database.
"""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from alembic import command
from pytest_alembic.config import Config as AlembicTestConfig
from pytest_alembic.runner import runner as alembic_test_runner
from sqlalchemy import inspect, text

from store import versioning
from store.campaign import Store
from store.engine import open_engine
from store.errors import DatabaseOpenError, SchemaVersionError, StoreWriteError
from store.schema import (
    Channel,
    EventKind,
    LeaseKind,
    QuarantineReason,
    TaskState,
    WorkerState,
    metadata,
)
from store.tasks import NewTask, enqueue_tasks

with warnings.catch_warnings():
    # Their `@pytest.mark.alembic` is registered by the plugin's pytest_configure, which does
    # not run here (see the `alembic_runner` fixture below).
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    from pytest_alembic.tests import (  # noqa: F401  (collected as tests of this module)
        test_model_definitions_match_ddl,
        test_single_head_revision,
        test_up_down_consistency,
        test_upgrade,
    )

REPO_ROOT = Path(__file__).resolve().parent.parent


# -- pytest-alembic fixtures -------------------------------------------------------------------

@pytest.fixture
def alembic_config():
    return versioning.alembic_config()


@pytest.fixture
def alembic_engine(tmp_path: Path):
    """A connection, not the engine: pytest-alembic hands this object to env.py as
    `config.attributes["connection"]`, and env.py (like `store.versioning.upgrade`) takes a
    Connection there."""
    engine = open_engine(tmp_path / "alembic.db")
    with engine.connect() as conn:
        yield conn
    engine.dispose()


@pytest.fixture
def alembic_runner(alembic_config, alembic_engine):
    """The plugin's own fixture, defined here: the plugin is switched off in pyproject.toml
    (`-p no:pytest_alembic`) because its collector breaks under pytest 9 (`TestCollector` has
    no `_nodeid`), so its fixtures are not registered."""
    config = AlembicTestConfig.from_raw_config(alembic_config)
    with alembic_test_runner(config=config, engine=alembic_engine) as context:
        yield context


# -- helpers -----------------------------------------------------------------------------------

def _dump(path: Path) -> dict[str, object]:
    """Every schema object and every row of the file, for before/after comparisons."""
    conn = sqlite3.connect(path)
    try:
        objects = sorted(conn.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name").fetchall(),
            key=repr)
        tables = [r[1] for r in objects if r[0] == "table" and not r[1].startswith("sqlite_")]
        rows = {t: sorted(conn.execute(f'SELECT * FROM "{t}"').fetchall(), key=repr)
                for t in tables}
        return {"objects": objects, "rows": rows}
    finally:
        conn.close()


def _with_campaign(path: Path, n: int = 3) -> None:
    """A campaign with a few tasks (and a stored input), then closed."""
    store = Store.open(path)
    try:
        with store.transaction() as tx:
            enqueue_tasks(tx, [NewTask({"path": f"/seeds/{i}"}) for i in range(n)]
                          + [NewTask({"path": "/seeds/stored"}, input_bytes=b"abc")])
    finally:
        store.close()


def _table_count(path: Path, table: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
    finally:
        conn.close()


def _set_revision(path: Path, revision: str) -> None:
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    finally:
        conn.close()


def _run_alembic(path: Path, *args: str) -> None:
    """An alembic command through the project's config, on the project's engine."""
    engine = open_engine(path)
    try:
        with engine.connect() as conn:
            cfg = versioning.alembic_config()
            cfg.attributes["connection"] = conn
            getattr(command, args[0])(cfg, *args[1:])
            conn.commit()
    finally:
        engine.dispose()


# -- the command line and Store.open -----------------------------------------------------------

def test_alembic_cli_upgrade_head_creates_a_database_store_open_accepts(tmp_path: Path):
    db = tmp_path / "cli.db"
    alembic = Path(sys.executable).with_name("alembic")
    cmd = [str(alembic)] if alembic.exists() else [sys.executable, "-m", "alembic"]
    proc = subprocess.run([*cmd, "-x", f"db={db}", "upgrade", "head"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert db.exists()

    engine = open_engine(db)
    try:
        with engine.connect() as conn:
            assert versioning.current_revision(conn) == versioning.head_revision()
            assert set(inspect(conn).get_table_names()) >= set(metadata.tables)
    finally:
        engine.dispose()

    store = Store.open(db)
    try:
        assert store.incarnation == 1
        with store.transaction() as tx:
            assert enqueue_tasks(tx, [NewTask({"path": "/seeds/x"})])
    finally:
        store.close()
    assert _table_count(db, "tasks") == 1


def test_store_open_creates_a_new_file_at_head(tmp_path: Path):
    db = tmp_path / "new.db"
    Store.open(db).close()
    engine = open_engine(db)
    try:
        with engine.connect() as conn:
            assert versioning.current_revision(conn) == versioning.head_revision()
    finally:
        engine.dispose()


@pytest.mark.parametrize("stamp, says", [
    ("0099", "newer than this coordinator knows"),
    # Another tool's stamp is no newer coordinator's: it was called "newer" all the same.
    ("ffffffff9999", "is not a revision this coordinator or a newer one writes"),
])
def test_store_open_refuses_a_newer_or_an_unknown_revision(tmp_path: Path, stamp, says):
    db = tmp_path / "newer.db"
    _with_campaign(db)
    _set_revision(db, stamp)
    before = _dump(db)
    with pytest.raises(SchemaVersionError, match=says) as info:
        Store.open(db, resume=True)
    err = info.value
    assert (err.newer, err.unknown) == ((True, False) if stamp == "0099" else (False, True))
    assert err.found == stamp and stamp in str(err)
    assert err.expected == versioning.head_revision()
    # versioning.upgrade refuses it too, and neither touched the file.
    with pytest.raises(SchemaVersionError, match=says):
        versioning.upgrade(db)
    assert _dump(db) == before


def test_an_unversioned_database_with_a_table_of_our_name_is_not_a_campaign(tmp_path: Path):
    """Every revision writes its tables and its stamp together, so tables without a stamp
    were never a campaign, even under a name we also use: `db upgrade` would fail on it."""
    db = tmp_path / "other.db"
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("CREATE TABLE tasks (id INTEGER PRIMARY KEY, path TEXT)")
        conn.execute("INSERT INTO tasks (path) VALUES ('/seeds/old')")
    conn.close()
    with pytest.raises(DatabaseOpenError, match="something else .*tasks") as info:
        Store.open(db, resume=True)
    assert str(db) in str(info.value)
    with pytest.raises(DatabaseOpenError, match="something else"):
        versioning.upgrade(db)
    # Refused, not "repaired": the table and its row are untouched.
    assert _table_count(db, "tasks") == 1


def test_an_sqlite_file_of_something_else_is_not_turned_into_a_campaign(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    conn.close()
    with pytest.raises(DatabaseOpenError, match="something else .*users"):
        Store.open(path)
    with pytest.raises(DatabaseOpenError, match="something else"):
        versioning.upgrade(path)
    conn = sqlite3.connect(path)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["users"]
    conn.close()


def test_store_open_refuses_a_database_downgraded_to_base(tmp_path: Path):
    db = tmp_path / "base.db"
    Store.open(db).close()
    _run_alembic(db, "downgrade", "base")
    with pytest.raises(SchemaVersionError, match="coordinator db upgrade"):
        Store.open(db)


def test_a_schema_a_stopped_start_left_half_created_is_completed_not_refused(tmp_path: Path):
    """Each revision commits on its own: a first start stopped while it created the schema
    left a file at 0004 with no campaign, which every later `run` refused as an older
    campaign needing `db upgrade`. With no campaign in it there is nothing to lose."""
    db = tmp_path / "half.db"
    versioning.upgrade(db, "0004")
    store = Store.open(db)
    try:
        with store.reading() as conn:
            assert versioning.current_revision(conn) == versioning.head_revision()
        assert store.incarnation == 1
    finally:
        store.close()
    # An older file with a campaign in it is still left to `db upgrade` (it may be large).
    _run_alembic(db, "downgrade", "0004")
    with pytest.raises(SchemaVersionError, match="coordinator db upgrade"):
        Store.open(db, resume=True)


def test_upgrade_of_a_current_database_changes_nothing(tmp_path: Path):
    db = tmp_path / "current.db"
    _with_campaign(db)
    before = _dump(db)
    assert before["rows"]["tasks"] and before["rows"]["blobs"]
    head = versioning.head_revision()
    assert versioning.upgrade(db) == (head, head)
    assert versioning.upgrade(db) == (head, head)
    assert _dump(db) == before
    # ... and the campaign still resumes with its rows.
    store = Store.open(db, resume=True)
    try:
        with store.reading() as conn:
            assert conn.execute(text("SELECT count(*) FROM tasks")).scalar() == 4
    finally:
        store.close()


def test_upgrade_from_nothing_reports_none_then_head(tmp_path: Path):
    db = tmp_path / "empty.db"
    assert versioning.upgrade(db) == (None, versioning.head_revision())


def test_downgrade_to_base_and_upgrade_again(tmp_path: Path):
    db = tmp_path / "roundtrip.db"
    Store.open(db).close()
    schema_at_head = _dump(db)["objects"]

    _run_alembic(db, "downgrade", "base")
    engine = open_engine(db)
    try:
        with engine.connect() as conn:
            assert versioning.current_revision(conn) is None
            assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    finally:
        engine.dispose()

    head = versioning.head_revision()
    assert versioning.upgrade(db) == (None, head)
    assert _dump(db)["objects"] == schema_at_head
    # A usable campaign file again (a --resume of the schema without its campaign row makes
    # it, as a start that died before its campaign row must go on: test_preflight.py).
    store = Store.open(db, resume=True)
    try:
        with store.transaction() as tx:
            assert enqueue_tasks(tx, [NewTask({"path": "/seeds/again"})])
    finally:
        store.close()


def test_migrated_schema_enforces_the_invariants(tmp_path: Path):
    """What the module docstring of store/schema.py promises, checked on a migrated file."""
    db = tmp_path / "inv.db"
    versioning.upgrade(db)
    engine = open_engine(db)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            uniques = {t: {tuple(u["column_names"]) for u in insp.get_unique_constraints(t)}
                       for t in ("dispatches", "results", "leases", "tasks")}
            assert {("rank",), ("task_id",)} <= uniques["dispatches"]
            # The result's own key is the task. Since revision 0005 no index refuses one token
            # on two results (tokens are unique by how they are minted; the audits check it).
            assert uniques["results"] == set()
            assert ("kind", "key") in uniques["leases"]
            assert ("semantic_id",) in uniques["tasks"]
            assert insp.get_pk_constraint("results")["constrained_columns"] == ["task_id"]
            fks = insp.get_foreign_keys("leases")
            assert [(fk["referred_table"], fk["options"].get("ondelete")) for fk in fks] == [
                ("dispatches", "CASCADE")]
    finally:
        engine.dispose()


def test_a_migrated_file_accepts_every_enum_value_the_code_writes(tmp_path: Path):
    """The failure mode of CHECK drift is an IntegrityError in the middle of a master round
    (e.g. a new EventKind without a revision): write every value once, on a migrated file."""
    db = tmp_path / "enums.db"
    versioning.upgrade(db)
    conn = sqlite3.connect(db)
    try:
        with conn:
            for kind in EventKind:
                conn.execute("INSERT INTO events (at, incarnation, kind) VALUES (0, 1, ?)",
                             (kind.value,))
            for channel in Channel:
                for reason in QuarantineReason:
                    conn.execute("INSERT INTO quarantine (at, incarnation, channel, reason, rank)"
                                 " VALUES (0, 1, ?, ?, 1)", (channel.value, reason.value))
            for i, state in enumerate(WorkerState):
                conn.execute("INSERT INTO workers (rank, state, incarnation) VALUES (?, ?, 1)",
                             (i + 1, state.value))
            for i, state in enumerate(TaskState):
                conn.execute("INSERT INTO tasks (semantic_id, payload, state, queue_pos, "
                             "created_at, updated_at) VALUES (?, '{}', ?, 0, 0, 0)",
                             (f"{i:064x}", state.value))
            token = f"{1:064x}"
            conn.execute("INSERT INTO dispatches (token, rank, task_id, incarnation, created_at)"
                         " VALUES (?, 1, 1, 1, 0)", (token,))
            for kind in LeaseKind:
                conn.execute("INSERT INTO leases (token, kind, key) VALUES (?, ?, 'k')",
                             (token, kind.value))
        # ... and still refuses what is not a value of the enum.
        for sql in ("INSERT INTO events (at, incarnation, kind) VALUES (0, 1, 'bogus')",
                    "INSERT INTO quarantine (at, incarnation, channel, reason, rank) "
                    "VALUES (0, 1, 'result', 'bogus', 1)",
                    "UPDATE tasks SET state = 'bogus' WHERE id = 1"):
            with pytest.raises(sqlite3.IntegrityError, match="CHECK"), conn:
                conn.execute(sql)
    finally:
        conn.close()


def test_0002_moves_the_ready_time_from_the_old_events_into_results(tmp_path: Path):
    """A file written at 0001 (ready/committed events, results without times) keeps every
    row and gets results.ready_at from its `ready` events; a result whose READY came after the
    commit (no ready event) stays NULL."""
    db = tmp_path / "old.db"
    versioning.upgrade(db, "0001")
    t1, t2 = "a" * 64, "b" * 64
    conn = sqlite3.connect(db)
    try:
        with conn:
            for i, tok in ((1, t1), (2, t2)):
                conn.execute("INSERT INTO tasks (id, semantic_id, payload, state, queue_pos, "
                             "created_at, updated_at) VALUES (?, ?, '{}', 'done', ?, 0, 0)",
                             (i, f"{i:064x}", i))
                conn.execute("INSERT INTO results (task_id, token, rank, incarnation, "
                             "committed_at, status) VALUES (?, ?, 1, 1, 20, 'ok')", (i, tok))
                conn.execute("INSERT INTO events (at, incarnation, kind, rank, token, task_id) "
                             "VALUES (20, 1, 'committed', 1, ?, ?)", (tok, i))
            conn.execute("INSERT INTO events (at, incarnation, kind, rank, token) "
                         "VALUES (12.5, 1, 'ready', 1, ?)", (t1,))
    finally:
        conn.close()
    assert versioning.upgrade(db) == ("0001", versioning.head_revision())
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT task_id, ready_at, sent_at FROM results ORDER BY 1").fetchall()
        kinds = conn.execute("SELECT kind, count(*) FROM events GROUP BY 1 ORDER BY 1").fetchall()
    finally:
        conn.close()
    assert rows == [(1, 12.5, None), (2, None, None)]
    assert kinds == [("committed", 2), ("ready", 1)]  # history is kept, not rewritten


def _plans(path: Path, *queries: str | tuple[str, dict]) -> list[str]:
    """Each query's plan; a query with named parameters comes as (text, parameters)."""
    conn = sqlite3.connect(path)
    try:
        return [" / ".join(r[3] for r in conn.execute(f"EXPLAIN QUERY PLAN {q}", params))
                for q, params in ((q, {}) if isinstance(q, str) else q for q in queries)]
    finally:
        conn.close()


def test_0005_keeps_every_result_and_event_and_goes_back(tmp_path: Path):
    """0005 copies `results` without the token index and narrows the kind index: a file with
    results at 0004 keeps every row byte for byte, and a downgrade brings the UNIQUE token
    index and the full kind index back."""
    db = tmp_path / "old.db"
    versioning.upgrade(db, "0004")
    conn = sqlite3.connect(db)
    try:
        with conn:
            for i in (1, 2, 3):
                tok = f"{i:x}" * 64
                conn.execute("INSERT INTO tasks (id, semantic_id, payload, state, queue_pos, "
                             "created_at, updated_at) VALUES (?, ?, '{}', 'done', ?, 0, 0)",
                             (i, f"{i:064x}", i))
                conn.execute("INSERT INTO results (task_id, token, rank, incarnation, "
                             "committed_at, status, value, detail) VALUES (?, ?, 1, 1, 20, ?, "
                             "'{\"n\": 1}', ?)", (i, tok[:64], "ok" if i < 3 else "error",
                                                  None if i < 3 else "exit 1"))
                for kind in ("enqueued", "dispatched", "retried"):
                    conn.execute("INSERT INTO events (at, incarnation, kind, task_id) "
                                 "VALUES (1, 1, ?, ?)", (kind, i))
    finally:
        conn.close()
    def rows() -> dict[str, object]:
        got = dict(_dump(db)["rows"])  # type: ignore[call-overload]
        del got["alembic_version"]
        return got

    before = rows()
    assert before["results"] and before["events"]
    assert versioning.upgrade(db, "0005") == ("0004", "0005")
    assert rows() == before
    with sqlite3.connect(db) as conn:
        indexes = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = "
                                              "'index' AND tbl_name IN ('results', 'events')")}
    assert {"ix_results_status", "ix_events_counted_kind"} <= indexes
    assert "ix_events_kind" not in indexes and not any("autoindex_results" in n for n in indexes)

    _run_alembic(db, "downgrade", "0004")
    assert rows() == before
    with pytest.raises(sqlite3.IntegrityError, match="results.token"), \
            sqlite3.connect(db) as conn:
        conn.execute("UPDATE results SET token = (SELECT token FROM results WHERE "
                     "task_id = 1) WHERE task_id = 2")
    assert _plans(db, "SELECT count(*) FROM events WHERE kind = 'dispatched'") == [
        "SEARCH events USING COVERING INDEX ix_events_kind (kind=?)"]


def test_0006_starts_each_budget_at_what_it_read_before_and_goes_back(tmp_path: Path):
    """Until 0006 the retry budget read `attempts`: a task in the middle of its retries keeps
    the budget it had used, every other row is untouched, and a downgrade drops the column."""
    db = tmp_path / "old.db"
    versioning.upgrade(db, "0005")
    with sqlite3.connect(db) as conn:
        for i, (state, attempts) in enumerate([("queued", 0), ("deferred", 2), ("failed", 5),
                                               ("done", 1)], start=1):
            conn.execute("INSERT INTO tasks (id, semantic_id, payload, state, attempts, "
                         "queue_pos, created_at, updated_at) VALUES (?, ?, '{}', ?, ?, ?, 0, 0)",
                         (i, f"{i:064x}", state, attempts, i))
        # Rows that refer to tasks: a downgrade that copied `tasks` failed on them.
        conn.execute("INSERT INTO results (task_id, token, rank, incarnation, committed_at, "
                     "status) VALUES (4, ?, 1, 1, 0, 'ok')", ("4" * 64,))
        conn.execute("UPDATE tasks SET parent_id = 4 WHERE id = 1")
    before = _dump(db)["rows"]
    assert versioning.upgrade(db, "0006") == ("0005", "0006")
    with sqlite3.connect(db) as conn:
        got = conn.execute("SELECT id, attempts, budget_used FROM tasks ORDER BY id").fetchall()
        conn.execute("INSERT INTO tasks (id, semantic_id, payload, state, queue_pos, "
                     "created_at, updated_at) VALUES (9, ?, '{}', 'queued', 9, 0, 0)",
                     ("9" * 64,))
        new = conn.execute("SELECT budget_used FROM tasks WHERE id = 9").fetchone()
        conn.execute("DELETE FROM tasks WHERE id = 9")
    assert got == [(1, 0, 0), (2, 2, 2), (3, 5, 5), (4, 1, 1)] and new == (0,)
    _run_alembic(db, "downgrade", "0005")
    assert _dump(db)["rows"] == before  # every row, the stamp (0005) included


def _at_0006_with_a_dispatch_in_flight(db: Path) -> None:
    """A file written by 0006 code: a task of each state, a dispatch in flight with its `work`
    and `target` leases, a committed result; a `dispatched` event for each dispatch."""
    versioning.upgrade(db, "0006")
    active, done = "a" * 64, "d" * 64
    with sqlite3.connect(db) as conn:
        for i, state in enumerate(["queued", "active", "done", "deferred", "failed"], start=1):
            conn.execute("INSERT INTO tasks (id, semantic_id, payload, state, queue_pos, "
                         "created_at, updated_at) VALUES (?, ?, '{}', ?, ?, 0, 0)",
                         (i, f"{i:064x}", state, i))
        conn.execute("INSERT INTO dispatches (token, rank, task_id, incarnation, created_at, "
                     "sent_at) VALUES (?, 1, 2, 1, 10.5, 10.6)", (active,))
        conn.execute("INSERT INTO leases (token, kind, key) VALUES (?, 'work', ?), "
                     "(?, 'target', '7')", (active, f"{2:064x}", active))
        conn.execute("INSERT INTO results (task_id, token, rank, incarnation, committed_at, "
                     "status, sent_at) VALUES (3, ?, 2, 1, 9.0, 'ok', 8.6)", (done,))
        conn.execute("INSERT INTO events (at, incarnation, kind, rank, token, task_id) VALUES "
                     "(8.5, 1, 'dispatched', 2, ?, 3), (10.5, 1, 'dispatched', 1, ?, 2)",
                     (done, active))


def test_0007_drops_the_work_leases_fills_dispatched_at_and_goes_back(tmp_path: Path):
    """0007 deletes the `work` leases (the dispatch row is the reservation), replaces the
    state index by one of the held tasks, and gives each result the time of its `dispatched`
    event; every other row is kept. A downgrade gives 0006 code what it expects: a `work`
    lease per dispatch in flight, a `dispatched` event per dispatch, the state index."""
    db = tmp_path / "old.db"
    _at_0006_with_a_dispatch_in_flight(db)
    before = _dump(db)["rows"]
    assert versioning.upgrade(db, "0007") == ("0006", "0007")
    after = _dump(db)["rows"]
    with sqlite3.connect(db) as conn:
        leases = conn.execute("SELECT kind, key FROM leases").fetchall()
        dispatched_at = conn.execute("SELECT task_id, dispatched_at FROM results").fetchall()
        indexes = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE "
                                              "type = 'index' AND tbl_name = 'tasks'")}
    assert leases == [("target", "7")]
    assert dispatched_at == [(3, 8.5)]
    assert "ix_tasks_held" in indexes and "ix_tasks_state" not in indexes
    for table in ("tasks", "dispatches", "events", "blobs", "workers", "quarantine"):
        assert after[table] == before[table], table

    _run_alembic(db, "downgrade", "0006")
    got = _dump(db)["rows"]
    assert {t: got[t] for t in got if t != "leases"} == {
        t: before[t] for t in before if t != "leases"}
    assert sorted(r[1:] for r in got["leases"]) == sorted(r[1:] for r in before["leases"])


def test_0007_downgrade_records_the_dispatches_0007_wrote_no_event_for(tmp_path: Path):
    """A result and a dispatch in flight written at 0007 have no `dispatched` event (their
    rows are the record): the downgrade writes one for each, with their own times."""
    db = tmp_path / "new.db"
    versioning.upgrade(db, "0007")
    with sqlite3.connect(db) as conn:
        for i, state in ((1, "done"), (2, "active")):
            conn.execute("INSERT INTO tasks (id, semantic_id, payload, state, queue_pos, "
                         "created_at, updated_at) VALUES (?, ?, '{}', ?, ?, 0, 0)",
                         (i, f"{i:064x}", state, i))
        conn.execute("INSERT INTO results (task_id, token, rank, incarnation, committed_at, "
                     "status, dispatched_at) VALUES (1, ?, 3, 2, 9.0, 'ok', 8.0)", ("1" * 64,))
        conn.execute("INSERT INTO dispatches (token, rank, task_id, incarnation, created_at) "
                     "VALUES (?, 1, 2, 2, 12.0)", ("2" * 64,))
    _run_alembic(db, "downgrade", "0006")
    with sqlite3.connect(db) as conn:
        events = conn.execute("SELECT at, incarnation, kind, rank, token, task_id FROM events "
                              "ORDER BY task_id").fetchall()
        leases = conn.execute("SELECT token, kind, key FROM leases").fetchall()
    assert events == [(8.0, 2, "dispatched", 3, "1" * 64, 1),
                      (12.0, 2, "dispatched", 1, "2" * 64, 2)]
    assert leases == [("2" * 64, "work", f"{2:064x}")]


def test_the_statistics_read_only_the_narrow_indexes(tmp_path: Path):
    """What keeps `status` and the live progress cheap on a million tasks: the counts read
    `ix_results_status` and the partial `ix_events_counted_kind`, never the rows. A query
    whose text drifts from the partial index's condition silently scans every event."""
    from store import stats

    db = tmp_path / "plans.db"
    versioning.upgrade(db)
    plans = _plans(db, str(stats._COUNT_EVENTS), "SELECT count(*) FROM results",
                   "SELECT status, count(*) FROM results GROUP BY status",
                   stats.COUNT_QUEUED_SQL, stats._COUNT_HELD,
                   (stats._HELD_REASONS, {"state": "failed", "limit": 3}))
    assert plans == ["SCAN events USING COVERING INDEX ix_events_counted_kind",
                     "SCAN results USING COVERING INDEX ix_results_status",
                     "SCAN results USING COVERING INDEX ix_results_status",
                     "SCAN tasks USING COVERING INDEX ix_tasks_queue",
                     "SEARCH tasks USING COVERING INDEX ix_tasks_held (state=?)",
                     "SEARCH tasks USING INDEX ix_tasks_held (state=?) / "
                     "USE TEMP B-TREE FOR GROUP BY / USE TEMP B-TREE FOR ORDER BY"]
    engine = open_engine(db)
    try:
        with engine.connect() as conn:
            conn.execute(text("INSERT INTO events (at, incarnation, kind) VALUES "
                              "(1, 1, 'dispatched'), (1, 1, 'enqueued'), (1, 1, 'requeued')"))
            assert stats.read_stats(conn).events == {"requeued": 1}
    finally:
        engine.dispose()


def test_an_upgrade_that_fails_keeps_the_revisions_it_completed(tmp_path: Path):
    """Each revision is its own transaction (docs/operations.md): a file at 0004 whose 0006
    cannot apply (a hand-made column of that name) ends at 0005, with 0005's changes, and the
    error names the failed step."""
    db = tmp_path / "old.db"
    versioning.upgrade(db, "0004")
    with sqlite3.connect(db) as conn:
        conn.execute("ALTER TABLE tasks ADD COLUMN budget_used INTEGER")
    with pytest.raises(StoreWriteError, match="duplicate column name: budget_used"):
        versioning.upgrade(db)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("0005",)]
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = "
                            "'ix_results_status'").fetchone() == (1,)


def test_0009_keeps_the_quarantine_and_goes_back_expanding_sampled_rows(tmp_path: Path):
    """0009 copies `quarantine` for its new channels and reasons and adds `repeats`; going
    back, a row that stood for several messages becomes that many rows, and rows of the new
    kinds (which the old constraints refuse) go."""
    db = tmp_path / "q.db"
    versioning.upgrade(db, "0008")
    with contextlib.closing(sqlite3.connect(db)) as c, c:
        c.executemany("INSERT INTO quarantine (at, incarnation, channel, reason, rank) "
                      "VALUES (1, 1, ?, ?, 1)", [("ready", "stale"), ("result", "missing")])
    versioning.upgrade(db, "0009")
    with contextlib.closing(sqlite3.connect(db)) as c, c:
        assert c.execute("SELECT channel, reason, repeats FROM quarantine ORDER BY id").fetchall(
        ) == [("ready", "stale", 1), ("result", "missing", 1)]
        c.execute("UPDATE quarantine SET repeats = 4 WHERE channel = 'ready'")
        c.execute("INSERT INTO quarantine (at, incarnation, channel, reason, rank, repeats) "
                  "VALUES (2, 1, 'other', 'foreign_tag', 1, 9)")
    _run_alembic(db, "downgrade", "0008")
    with contextlib.closing(sqlite3.connect(db)) as c:
        assert c.execute("SELECT channel, reason, count(*) FROM quarantine GROUP BY 1, 2 "
                         "ORDER BY 1, 2").fetchall() == [("ready", "stale", 4),
                                                          ("result", "missing", 1)]


def test_0010_adds_observations_loads_the_finds_index_and_views_and_goes_back(tmp_path: Path):
    """0010 changes no row: it adds two tables the master writes, a partial index of the
    results that wrote test cases, and five views that read what 0009 files already hold.
    The views work on a file brought forward; a downgrade leaves the file as 0009 made it."""
    from store.schema import VIEWS

    db = tmp_path / "old.db"
    _at_0006_with_a_dispatch_in_flight(db)
    versioning.upgrade(db, "0009")
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE results SET testcases = 2 WHERE task_id = 3")
        conn.execute("INSERT INTO workers (rank, state, incarnation, host) "
                     "VALUES (1, 'busy', 1, 'node1')")
    before = _dump(db)
    assert versioning.upgrade(db, "0010") == ("0009", "0010")
    after = _dump(db)
    assert {t: rows for t, rows in after["rows"].items() if t != "alembic_version"} == {
        **{t: rows for t, rows in before["rows"].items() if t != "alembic_version"},
        "observations": [], "rank_load": []}
    with sqlite3.connect(db) as conn:
        views = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'view'")}
        assert views == set(VIEWS)
        assert conn.execute("SELECT rank, host, task_id, sent FROM in_flight").fetchall() == [
            (1, "node1", 2, "yes")]
        assert [r[0] for r in conn.execute("SELECT task_id FROM held_tasks")] == [4, 5]
        assert conn.execute("SELECT results, testcases FROM throughput_per_minute"
                            ).fetchall() == [(1, 2)]
        assert conn.execute("SELECT inc, rank, results FROM rank_utilisation").fetchall() == [
            (1, 2, 1)]
        history = conn.execute("SELECT what FROM task_history WHERE task_id = 3").fetchall()
        assert history == [("dispatched",), ("result ok",)]
        assert conn.execute("SELECT count(*), total(testcases) FROM results "
                            "INDEXED BY ix_results_found WHERE testcases > 0").fetchone() == (1, 2)

    _run_alembic(db, "downgrade", "0009")
    assert _dump(db) == before


def test_the_revisions_read_without_alembic_are_alembics():
    """`store.revisions` reads the scripts' own `revision` lines (no Alembic import, for the
    start's checks, `status` and `plot`); it must name the chain Alembic walks."""
    from store.revisions import head, known_revisions

    assert list(known_revisions()) == versioning.revisions_in_order()
    assert head() == versioning.head_revision()


def test_0011_adds_the_imports_table_empty_and_goes_back(tmp_path: Path):
    """0011 changes no row: a campaign brought forward has no import rows, so its first
    --resume reads its task source as before."""
    db = tmp_path / "old.db"
    _at_0006_with_a_dispatch_in_flight(db)
    versioning.upgrade(db, "0010")
    before = _dump(db)
    assert versioning.upgrade(db, "0011") == ("0010", "0011")
    after = _dump(db)
    assert {t: rows for t, rows in after["rows"].items() if t != "alembic_version"} == {
        **{t: rows for t, rows in before["rows"].items() if t != "alembic_version"},
        "imports": []}
    _run_alembic(db, "downgrade", "0010")
    assert _dump(db) == before


def test_0012_counts_a_batch_once_in_rank_utilisation_and_goes_back(tmp_path: Path):
    """0012 changes no row, only the view: three results of one dispatch (a batch shares its
    token and times) count its 10 s once, where 0010's view counted them three times."""
    db = tmp_path / "old.db"
    _at_0006_with_a_dispatch_in_flight(db)
    versioning.upgrade(db, "0011")
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE results SET dispatched_at = committed_at - 10")
        [(task, token, rank, committed)] = conn.execute(
            "SELECT task_id, token, rank, committed_at FROM results").fetchall()
        for other in (4, 5):  # two more tasks of the same dispatch
            conn.execute("INSERT INTO results (task_id, token, rank, incarnation, committed_at, "
                         "dispatched_at, status) VALUES (?, ?, ?, 1, ?, ?, 'ok')",
                         (other, token, rank, committed, committed - 10))
    query = "SELECT rank, results, busy_s, mean_task_s FROM rank_utilisation"
    with sqlite3.connect(db) as conn:
        assert conn.execute(query).fetchall() == [(rank, 3, 30.0, 10.0)]  # (0010's)
    before = _dump(db)
    assert versioning.upgrade(db, "0012") == ("0011", "0012")
    after = _dump(db)
    assert {t: rows for t, rows in after["rows"].items() if t != "alembic_version"} == {
        t: rows for t, rows in before["rows"].items() if t != "alembic_version"}
    with sqlite3.connect(db) as conn:
        assert conn.execute(query.replace(" FROM", ", dispatches FROM")).fetchall() == [
            (rank, 3, 10.0, 3.333, 1)]
    _run_alembic(db, "downgrade", "0011")
    assert _dump(db) == before


def _plan(conn: sqlite3.Connection, sql: str, params: tuple = ()) -> list[str]:
    return [row[1] for row in conn.execute(f"EXPLAIN {sql}", params)]


def test_0014_writes_the_enum_checks_as_comparisons_and_goes_back(tmp_path: Path):
    """0014 changes no row, only the CHECK text of six tables (and one kind more for events,
    `split`, which its downgrade writes back as `recovered`): at 0013 moving a task to
    `done` builds a temporary index (SQLite's code for a CHECK's IN list) for every row; at
    0014 it builds none, the CHECK still refuses a state that is not one, and a second
    connection, opened before the upgrade, reads the new text too."""
    db = tmp_path / "old.db"
    _at_0006_with_a_dispatch_in_flight(db)
    versioning.upgrade(db, "0013")
    update = "UPDATE tasks SET state = 'done' WHERE id = ?"
    # No statement cache: EXPLAIN does not look at the schema's version, so a cached EXPLAIN
    # run again after the schema was read anew would print a program of the freed schema.
    other = sqlite3.connect(db, cached_statements=0)
    try:
        assert "OpenEphemeral" in _plan(other, update, (1,))
        before = _dump(db)
        assert versioning.upgrade(db, "0014") == ("0013", "0014")
        after = _dump(db)
        assert after["rows"] == {**before["rows"], "alembic_version": [("0014",)]}
        changed = {o[1] for o, b in zip(after["objects"], before["objects"], strict=True) if o != b}
        assert changed == {"tasks", "leases", "workers", "quarantine", "events", "imports"}
        # A statement that reads makes the connection read the schema anew.
        assert other.execute("SELECT count(*) FROM tasks").fetchone()[0] > 0
        assert "OpenEphemeral" not in _plan(other, update, (1,))
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"), other:
            other.execute("UPDATE tasks SET state = 'bogus' WHERE id = 1")
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"), other:
            other.execute("INSERT INTO leases (token, kind, key) SELECT token, 'bogus', 'k' "
                          "FROM dispatches")
        with other:  # the kind 0014 adds
            split = other.execute("INSERT INTO events (at, incarnation, kind) "
                                  "VALUES (0, 1, 'split')").lastrowid
    finally:
        other.close()
    _run_alembic(db, "downgrade", "0013")
    with sqlite3.connect(db) as conn:  # ... goes back as the rollback it is
        assert conn.execute("SELECT kind FROM events WHERE id = ?", (split,)).fetchall() == [
            ("recovered",)]
        conn.execute("DELETE FROM events WHERE id = ?", (split,))
    assert _dump(db) == before


def _edit_table_sql(db: Path, table: str, old: str, new: str) -> None:
    """A table's CREATE text edited by hand (SQLite's `writable_schema`), as a `sqlite3`
    shell could."""
    conn = sqlite3.connect(db)
    try:
        with conn:
            conn.execute("PRAGMA writable_schema = ON")
            conn.execute("UPDATE sqlite_master SET sql = replace(sql, ?, ?) WHERE name = ?",
                         (old, new, table))
            version = conn.execute("PRAGMA schema_version").fetchone()[0]
            conn.execute(f"PRAGMA schema_version = {version + 1}")
            conn.execute("PRAGMA writable_schema = OFF")
    finally:
        conn.close()


def test_0014_refuses_a_file_whose_checks_were_changed_and_writes_nothing(tmp_path: Path):
    """A table whose enum CHECK is not in the form 0013 left (edited by hand) stops the
    revision before anything is rewritten: the file stays at 0013, whole."""
    db = tmp_path / "edited.db"
    versioning.upgrade(db, "0013")
    _edit_table_sql(db, "leases", "kind IN ('work', ", "kind IN ('work',")
    before = _dump(db)
    with pytest.raises(StoreWriteError, match="0014.*leases has 0 enum CHECKs"):
        versioning.upgrade(db)
    assert _dump(db) == before


def test_0015_shows_a_batchs_events_in_each_of_its_tasks_history_and_goes_back(tmp_path):
    """Before 0015 the history of every task of a batch but the first lacked the batch in
    flight (its later tasks are held by `work` leases) and the batch's rollback (its events
    carry the first task's id)."""
    from conftest import Farm

    db = tmp_path / "batch.db"
    farm = Farm(db)
    first, second, third = farm.enqueue(*({"data": i} for i in range(3)))
    farm.ready(1)
    [p] = farm.plan(1, batch=3, sent=True)
    history = "SELECT what FROM task_history WHERE task_id = ? ORDER BY at, src, seq"

    def seen(task: int) -> list[str]:
        with sqlite3.connect(db) as conn:
            return [w for (w,) in conn.execute(history, (task,))]

    assert seen(third) == ["enqueued", "dispatched (in flight)"]
    farm.result_raw(1, {"token": p.token, "status": "ok", "batch": "not a list"})
    farm.ready(1, p.token)
    farm.sweep()
    farm.close()
    for task in (first, second, third):
        assert seen(task) == ["enqueued", "dispatched", "quarantined result/payload",
                              "invalid", "recovered", "requeued"], (task, seen(task))
    _run_alembic(db, "downgrade", "0014")
    assert "recovered" not in seen(third)  # (0010's view)
    versioning.upgrade(db)
    assert "recovered" in seen(third)


def test_0016_adds_the_unrun_columns_empty_and_goes_back(tmp_path: Path):
    """0016 adds three nullable columns to `workers`: every earlier row is kept, with nothing
    failing known of its rank, and the downgrade gives back the file as it was."""
    db = tmp_path / "old.db"
    _at_0006_with_a_dispatch_in_flight(db)
    versioning.upgrade(db, "0015")
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO workers (rank, state, incarnation, host, pid, last_seen) "
                     "VALUES (1, 'busy', 1, 'n7', 42, 10.0), (2, 'idle', 1, 'n8', 43, 9.0)")
    before = _dump(db)
    assert versioning.upgrade(db, "0016") == ("0015", "0016")
    assert _rows_of(db, "SELECT rank, state, host, unrun_streak, unrun_since, unrun_detail "
                        "FROM workers ORDER BY rank") == [
        (1, "busy", "n7", None, None, None), (2, "idle", "n8", None, None, None)]
    _run_alembic(db, "downgrade", "0015")
    assert _dump(db) == before


def _rows_of(db: Path, sql: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return conn.execute(sql).fetchall()


def test_0017_counts_what_earlier_code_kept_from_its_events_and_goes_back(tmp_path: Path):
    """Before 0017 a retried run's kept test cases were said only in its `task_failed` event's
    text: 0017 makes a `salvaged` row of each such event (and of nothing else), and the
    downgrade leaves the file as it was."""
    db = tmp_path / "old.db"
    _at_0006_with_a_dispatch_in_flight(db)
    versioning.upgrade(db, "0016")
    with sqlite3.connect(db) as conn:
        conn.executemany(
            "INSERT INTO events (at, incarnation, kind, rank, token, task_id, detail) "
            "VALUES (?, 1, ?, 2, ?, ?, ?)",
            [(20.0, "task_failed", "e" * 64, 1, "timeout (3 test cases kept)"),
             (21.0, "task_failed", "f" * 64, 1, "timeout"),
             (22.0, "task_failed", "9" * 64, 4, "timeout (1 test case kept)"),
             (23.0, "task_failed", "8" * 64, 5, "not_run on rank 2: no space (kept)"),
             (24.0, "retried", "e" * 64, 1, "timeout (3 test cases kept)")])
    before = _dump(db)
    assert versioning.upgrade(db, "0017") == ("0016", "0017")
    assert _rows_of(db, "SELECT at, incarnation, rank, token, task_id, testcases FROM salvaged "
                        "ORDER BY id") == [(20.0, 1, 2, "e" * 64, 1, 3),
                                           (22.0, 1, 2, "9" * 64, 4, 1)]
    _run_alembic(db, "downgrade", "0016")
    assert _dump(db) == before


def test_0018_lets_events_hold_a_stop_and_goes_back(tmp_path: Path):
    """0018 changes no row, only the CHECK text of `events`: a `stop` is refused at 0017 and
    accepted at 0018 (by a connection opened before the upgrade too); any other kind is still
    refused; the downgrade deletes the `stop` events and leaves the file as it was."""
    db = tmp_path / "old.db"
    _at_0006_with_a_dispatch_in_flight(db)
    versioning.upgrade(db, "0017")
    stop = "INSERT INTO events (at, incarnation, kind, detail) VALUES (0, 1, ?, 'SIGTERM')"
    other = sqlite3.connect(db, cached_statements=0)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"), other:
            other.execute(stop, ("stop",))
        before = _dump(db)
        assert versioning.upgrade(db, "0018") == ("0017", "0018")
        after = _dump(db)
        assert after["rows"] == {**before["rows"], "alembic_version": [("0018",)]}
        changed = {o[1] for o, b in zip(after["objects"], before["objects"], strict=True) if o != b}
        assert changed == {"events"}
        with other:
            other.execute(stop, ("stop",))
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"), other:
            other.execute(stop, ("stopped",))
    finally:
        other.close()
    _run_alembic(db, "downgrade", "0017")
    assert _dump(db) == before


def test_0018_refuses_a_file_whose_events_check_was_changed(tmp_path: Path):
    """An `events` CHECK not in the form 0017 left stops the revision, the file whole."""
    db = tmp_path / "edited.db"
    versioning.upgrade(db, "0017")
    _edit_table_sql(db, "events", " OR kind = 'split'", "")
    before = _dump(db)
    with pytest.raises(StoreWriteError, match="0018.*events.kind"):
        versioning.upgrade(db)
    assert _dump(db) == before
