"""store.audit and store.engine.open_readonly on real campaign files.

Each planted violation is one a broken store or a hand edit could leave, written with raw
`sqlite3` (foreign keys off, as the `sqlite3` shell has them) into a campaign the real store
and gate produced; the audit must name that kind and no other. Every audit must leave the file
and its directory as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alembic import command

import store.audit
import store.stats
from store import versioning
from store.audit import Check, ViolationKind, audit, audit_path
from store.engine import ReadOnlyView, open_engine, open_readonly, readonly_view
from store.errors import DatabaseOpenError, NoCampaignYet, SchemaVersionError

REPO = Path(__file__).resolve().parents[1]
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
    assert sorted(p.name for p in farm.path.parent.iterdir()) == ["campaign.db"]
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


# -- planted violations --------------------------------------------------------------------

def _corrupt_index_page(db: Path) -> None:
    page = _one(db, "PRAGMA page_size")[0]
    root = _one(db, "SELECT rootpage FROM sqlite_master WHERE name = 'ix_events_task'")[0]
    data = bytearray(db.read_bytes())
    data[(root - 1) * page:root * page] = b"\xff" * page
    db.write_bytes(bytes(data))


def _corrupt_schema_pages(db: Path) -> None:
    """The pages read first (the revision stamp and the campaign row) overwritten."""
    page = _one(db, "PRAGMA page_size")[0]
    with contextlib.closing(sqlite3.connect(db)) as c:
        roots = [r for (r,) in c.execute("SELECT rootpage FROM sqlite_master WHERE name "
                                         "IN ('campaign', 'alembic_version')")]
    data = bytearray(db.read_bytes())
    for root in roots:
        data[(root - 1) * page:root * page] = b"\xff" * page
    db.write_bytes(bytes(data))


def _blob_removed(db: Path) -> None:
    _write(db, "DELETE FROM blobs")


def _done_without_result(db: Path) -> None:
    """The result is gone and its dispatch keeps its one record, as an ended dispatch's event."""
    task_id, _ = _done_task(db)
    _write(db, "INSERT INTO events (at, incarnation, kind, rank, token, task_id) SELECT "
               "dispatched_at, incarnation, 'dispatched', rank, token, task_id FROM results "
               "WHERE task_id = ?", "DELETE FROM results WHERE task_id = ?",
           params=(task_id,))


def _result_of_queued_task(db: Path) -> None:
    task_id, _ = _done_task(db)
    _write(db, "UPDATE tasks SET state = 'queued' WHERE id = ?", params=(task_id,))


def _active_without_dispatch(db: Path) -> None:
    """The dispatch row and its lease gone, its record kept as an ended dispatch's event; the
    task still says active."""
    _write(db, "INSERT INTO events (at, incarnation, kind, rank, token, task_id) SELECT "
               "created_at, incarnation, 'dispatched', rank, token, task_id FROM dispatches",
           "DELETE FROM leases", "DELETE FROM dispatches")


def _dispatch_of_queued_task(db: Path) -> None:
    _write(db, "UPDATE tasks SET state = 'queued' WHERE state = 'active'")


def _queued_task_deleted(db: Path) -> None:
    _write(db, "DELETE FROM tasks WHERE state = 'queued'")


def _one_dispatch_more(db: Path) -> None:
    task_id, _ = _done_task(db)
    _write(db, "UPDATE tasks SET dispatches = dispatches + 1 WHERE id = ?", params=(task_id,))


def _one_dispatch_less(db: Path) -> None:
    task_id, _ = _done_task(db)
    _write(db, "UPDATE tasks SET dispatches = dispatches - 1 WHERE id = ?", params=(task_id,))


def _commit_from_recovered_token(db: Path) -> None:
    """The recovered dispatch's token on its task's result: its record count still adds up
    (the recovered dispatch's event and the result, for two dispatches)."""
    _write(db, "UPDATE results SET token = (SELECT token FROM events WHERE kind = "
               "'recovered') WHERE task_id = (SELECT task_id FROM events WHERE kind = "
               "'recovered')")


def _commit_from_ended_dispatch(db: Path) -> None:
    """The result's dispatch also ended without a result (its `dispatched` event), counted as
    a dispatch of its own."""
    task_id, token = _done_task(db)
    _write(db, "INSERT INTO events (at, incarnation, kind, rank, token, task_id) SELECT "
               "dispatched_at, incarnation, 'dispatched', rank, token, task_id FROM results "
               "WHERE task_id = ?", "UPDATE tasks SET dispatches = 2 WHERE id = ?",
           params=(task_id,))


def _token_committed_twice(db: Path) -> None:
    task_id, token = _done_task(db)
    _write(db, "UPDATE results SET token = ? WHERE task_id = (SELECT max(task_id) FROM "
               "results WHERE task_id != ?)", params=(token, task_id))


def _lease_without_dispatch(db: Path) -> None:
    _write(db, "INSERT INTO leases (token, kind, key) VALUES (?, 'content', 'x')",
           params=("b" * 64,))


def _incarnation_without_its_start(db: Path) -> None:
    _write(db, "UPDATE campaign SET incarnation = incarnation + 1")


PLANTS = {
    "a corrupt index page": (_corrupt_index_page, ViolationKind.INTEGRITY,
                             Check.INTEGRITY_CHECK),
    "corrupt schema pages": (_corrupt_schema_pages, ViolationKind.INTEGRITY,
                             Check.INTEGRITY_CHECK),
    "a task's stored input removed": (_blob_removed, ViolationKind.FOREIGN_KEYS,
                                      Check.FOREIGN_KEY),
    "a done task without its result": (_done_without_result, ViolationKind.CONSERVATION,
                                       Check.DONE_WITHOUT_RESULT),
    "a result of a queued task": (_result_of_queued_task, ViolationKind.CONSERVATION,
                                  Check.RESULT_OF_UNDONE_TASK),
    "an active task without its dispatch": (_active_without_dispatch,
                                            ViolationKind.CONSERVATION,
                                            Check.ACTIVE_WITHOUT_DISPATCH),
    "a dispatch of a queued task": (_dispatch_of_queued_task, ViolationKind.CONSERVATION,
                                    Check.DISPATCH_OF_INACTIVE_TASK),
    "an enqueued task deleted": (_queued_task_deleted, ViolationKind.CONSERVATION,
                                 Check.ENQUEUED_WITHOUT_TASK),
    "a dispatch without a record": (_one_dispatch_more, ViolationKind.DISPATCH_RECORDS,
                                    Check.DISPATCH_WITHOUT_RECORD),
    "a record without a dispatch": (_one_dispatch_less, ViolationKind.DISPATCH_RECORDS,
                                    Check.MORE_RECORDS_THAN_DISPATCHES),
    "a commit from a recovered token": (_commit_from_recovered_token,
                                        ViolationKind.WRONG_COMMIT, Check.TOKEN_RETIRED),
    "a commit from a dispatch that ended": (_commit_from_ended_dispatch,
                                            ViolationKind.WRONG_COMMIT,
                                            Check.TOKEN_ENDED_WITHOUT_RESULT),
    "one token committed for two tasks": (_token_committed_twice, ViolationKind.WRONG_COMMIT,
                                          Check.TOKEN_SHARED),
    "a lease without its dispatch": (_lease_without_dispatch, ViolationKind.ORPHAN_LEASE,
                                     Check.LEASE_WITHOUT_DISPATCH),
    "an incarnation without its start": (_incarnation_without_its_start,
                                         ViolationKind.STATISTICS, Check.STATS_VS_ROWS),
}


def test_a_clean_campaign_has_no_violation(campaign):
    before = _listing(campaign.parent)
    report = audit_path(campaign)
    assert report.violations == [] and report.ok
    assert report.notes == [] and report.skipped == []
    assert report.revision == report.head == versioning.head_revision()
    assert report.stats is not None and report.stats.tasks["active"] == 1
    assert report.stats.quarantine["result"] == {"malformed": 1}
    assert _listing(campaign.parent) == before  # no -wal, -shm, -journal or lock made


@pytest.mark.parametrize("plant", PLANTS)
def test_a_planted_violation_is_reported_as_its_kind_only(campaign, plant):
    do, kind, check = PLANTS[plant]
    do(campaign)
    before = _listing(campaign.parent)
    report = audit_path(campaign)
    assert report.kinds() == {kind}, report.text()
    assert check in {v.check for v in report.violations}, report.text()
    assert all(v.message and "\n" not in v.message for v in report.violations)
    assert _listing(campaign.parent) == before


def test_each_conservation_check_names_the_task(campaign):
    _done_without_result(campaign)
    task_id, _ = _one(campaign, "SELECT task_id, token FROM events WHERE kind = 'dispatched' "
                                "ORDER BY id DESC LIMIT 1")
    report = audit_path(campaign)
    [missing] = report.of(Check.DONE_WITHOUT_RESULT)
    assert missing.task_id == task_id and f"task {task_id} is done without a result" in \
        missing.message
    # `status` counts done tasks by their results: it shows one fewer than their states.
    [counts] = report.of(Check.STATUS_COUNTS)
    assert counts.message == "`status` counts 4 done tasks, the tasks' states say 5"


def test_the_statistics_rule_catches_a_reader_that_leaves_out_a_kind(campaign, monkeypatch):
    """`read_stats` counts events through the partial index of the counted kinds; a reader
    whose condition left out a kind it shows (here `requeued`) disagrees with the rows."""
    monkeypatch.setattr(store.stats, "_COUNT_EVENTS", (
        "SELECT kind, count(*) FROM events WHERE kind NOT IN ('enqueued', 'dispatched', "
        "'requeued') GROUP BY kind"))
    report = audit_path(campaign)
    assert report.kinds() == {ViolationKind.STATISTICS}
    assert {v.message for v in report.violations} >= {
        "statistics say requeued=0, the rows say 1"}


def test_more_violations_than_kept_are_counted(campaign, monkeypatch):
    monkeypatch.setattr(store.audit, "MAX_PER_CHECK", 2)
    _write(campaign, *(f"INSERT INTO leases (token, kind, key) VALUES ('{c * 64}', 'content', "
                       f"'{c}')" for c in "abcde"))
    report = audit_path(campaign)
    assert [v.count for v in report.violations] == [None, None, 3]
    assert report.violations[-1].message == "... and 3 more leases without a dispatch"


# -- revisions -----------------------------------------------------------------------------

def _downgrade(db: Path, revision: str) -> None:
    engine = open_engine(db)
    try:
        with engine.connect() as conn:
            cfg = versioning.alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, revision)
            conn.commit()
    finally:
        engine.dispose()


@pytest.mark.parametrize("revision", ["0006", "0004", "0001"])
def test_an_older_revision_is_audited_by_the_rules_that_hold_on_it(campaign, revision, capsys):
    """Taken down to an older revision, the campaign has what that code wrote: a `dispatched`
    event for every dispatch, committed ones included. The one-record rules do not hold
    there: they are skipped, and the notes say so, naming each (`check` said "3 checks not
    run on it" and its note named two rules); the other rules still run."""
    from coordinator.cli import main
    _downgrade(campaign, revision)
    report = audit_path(campaign)
    assert report.violations == [], report.text()
    assert (report.revision, report.head) == (revision, versioning.head_revision())
    skipped = [Check.MORE_RECORDS_THAN_DISPATCHES, Check.DISPATCH_WITHOUT_RECORD,
               Check.TOKEN_ENDED_WITHOUT_RESULT]
    assert report.skipped == skipped
    [note] = report.notes
    assert note.startswith(f"schema revision {revision} is older than this coordinator's "
                           f"{versioning.head_revision()}: 3 checks were not run, "
                           f"`more_records_than_dispatches` (that no task has more dispatch "
                           f"records than dispatches), `dispatch_without_record` (that every "
                           f"dispatch has its record) and `token_ended_without_result` (that "
                           f"no result comes from a dispatch that ended without one) "
                           f"(before "), note
    assert f"`coordinator db upgrade --db {campaign}`" in note
    assert main(["check", "--db", str(campaign)]) == 0
    out, err = capsys.readouterr()
    assert out == (f"{campaign}: consistent (7 tasks, schema {revision}; 3 checks not run on "
                   f"it: more_records_than_dispatches, dispatch_without_record, "
                   f"token_ended_without_result)\n")
    assert err == f"note: {note}\n"
    assert main(["check", "--db", str(campaign), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == [c.value for c in skipped]

    _lease_without_dispatch(campaign)
    assert audit_path(campaign).kinds() == {ViolationKind.ORPHAN_LEASE}


def test_the_skipped_rules_hold_on_an_older_file_once_it_is_read_as_older_code_left_it(
        campaign):
    """What the skipping is for: the same 0006 rows under a 0007 stamp (the revision that
    brought both rules) hold a `dispatched` event beside each result and beside the dispatch
    in flight. Nothing in them was made by newer code, so they are read as older code left
    them; one observation of their incarnation (which no code before 0010 wrote) says newer
    code ran it, and then its second records break both rules."""
    _downgrade(campaign, "0006")
    upgraded = campaign.with_name("upgraded.db")
    with contextlib.closing(sqlite3.connect(campaign)) as c, \
            contextlib.closing(sqlite3.connect(upgraded)) as copy:
        c.backup(copy)
    _write(campaign, "UPDATE alembic_version SET version_num = ?", params=("0007",))
    _write(campaign, "ALTER TABLE results ADD COLUMN dispatched_at REAL")  # 0007's column
    report = audit_path(campaign)
    assert report.violations == [] and report.legacy_incarnations == 1, report.text()

    versioning.upgrade(upgraded)
    assert audit_path(upgraded).ok
    _write(upgraded, "INSERT INTO observations (at, incarnation, queued, active, done, "
                     "deferred, failed, testcases) VALUES (1.0, 1, 0, 0, 0, 0, 0, 0)")
    report = audit_path(upgraded)
    assert report.legacy_incarnations == 0
    assert report.kinds() == {ViolationKind.DISPATCH_RECORDS, ViolationKind.WRONG_COMMIT}


@pytest.fixture
def brought_forward(campaign) -> Path:
    """The campaign as code before revision 0007 left it (the 0007 downgrade writes what that
    code wrote: a `dispatched` event for each dispatch, committed ones and the one in flight
    included), brought to the head with `coordinator db upgrade`; then resumed by this code,
    which ends the dispatch left in flight (a second event of its token), commits the queued
    task and leaves the leased one in flight again."""
    _downgrade(campaign, "0006")
    assert _one(campaign, "SELECT count(*) FROM events WHERE kind = 'dispatched'") == (7,)
    up = subprocess.run([sys.executable, "-m", "coordinator", "db", "upgrade", "--db",
                         str(campaign)], capture_output=True, text=True, timeout=120,
                        check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert up.returncode == 0, up.stderr
    return campaign


def _resume(db: Path) -> None:
    from conftest import Farm
    farm = Farm(db, resume=True)
    try:
        farm.ready(1)
        farm.ready(2)
        for _ in range(2):
            for rank, token in farm.dispatch(1, 2).items():
                if "target_branch" not in _payload(db, token):
                    _finish(farm, rank, token)
    finally:
        farm.close()


def _check_cli(db: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", "check", "--db", str(db)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_campaign_begun_before_0007_and_brought_forward_is_consistent(brought_forward):
    """`coordinator check` failed every campaign begun before revision 0007 once it was
    upgraded: each dispatch of that code has its `dispatched` event beside its result (or
    its row in flight), which read as two records of one dispatch and as commits from
    dispatches that ended (exit 1, 11 violations here). A resume and its work do not change
    that, and the incarnations of this code are still held to one record each."""
    said = _check_cli(brought_forward)
    assert said.returncode == 0, said.stdout + said.stderr
    assert said.stdout == f"{brought_forward}: consistent (7 tasks, schema " \
                          f"{versioning.head_revision()})\n"
    assert "begun before revision 0007 and brought forward: its incarnations up to 1 " \
        in said.stderr
    report = audit_path(brought_forward)
    assert report.ok and report.legacy_incarnations == 1 and report.skipped == []

    _resume(brought_forward)
    assert _one(brought_forward, "SELECT count(*), max(incarnation) FROM results "
                                 "WHERE incarnation = 2") == (1, 2)
    assert _one(brought_forward, "SELECT count(*) FROM dispatches WHERE incarnation = 2") == (1,)
    said = _check_cli(brought_forward)
    assert said.returncode == 0, said.stdout + said.stderr
    report = audit_path(brought_forward)
    assert report.ok and report.legacy_incarnations == 1, report.text()
    [note] = report.notes
    assert "and 6 of their dispatches have the `dispatched` event older code wrote" in note


def _legacy_done_task(db: Path) -> tuple[int, str]:
    return _one(db, "SELECT r.task_id, r.token FROM results r JOIN tasks t ON t.id = "
                    "r.task_id WHERE t.dispatches = 1 AND r.incarnation = 1 ORDER BY 1 LIMIT 1")


def _new_done_task(db: Path) -> tuple[int, str]:
    return _one(db, "SELECT task_id, token FROM results WHERE incarnation = 2")


def _dispatches_of(pick, delta: int):
    def plant(db: Path) -> None:
        _write(db, "UPDATE tasks SET dispatches = dispatches + ? WHERE id = ?",
               params=(delta, pick(db)[0]))
    return plant


def _ended_beside_result(pick):
    def plant(db: Path) -> None:
        """As `_commit_from_ended_dispatch`, on the result `pick` chooses."""
        _write(db, "INSERT INTO events (at, incarnation, kind, rank, token, task_id) SELECT "
                   "dispatched_at, incarnation, 'dispatched', rank, token, task_id FROM "
                   "results WHERE task_id = ?", "UPDATE tasks SET dispatches = 2 WHERE id = ?",
               params=(pick(db)[0],))
    return plant


BROUGHT_FORWARD_PLANTS = {
    "older code's task: a dispatch without a record": (
        _dispatches_of(_legacy_done_task, 1), Check.DISPATCH_WITHOUT_RECORD),
    "older code's task: a record without a dispatch": (
        _dispatches_of(_legacy_done_task, -1), Check.MORE_RECORDS_THAN_DISPATCHES),
    "older code's result from a recovered token": (
        _commit_from_recovered_token, Check.TOKEN_RETIRED),
    "older code's result of a queued task": (  # (and `status` counts one done task more)
        _result_of_queued_task, Check.RESULT_OF_UNDONE_TASK),
    "this code's task: a record without a dispatch": (
        _dispatches_of(_new_done_task, -1), Check.MORE_RECORDS_THAN_DISPATCHES),
    "this code's result from a dispatch that ended": (
        _ended_beside_result(_new_done_task), Check.TOKEN_ENDED_WITHOUT_RESULT),
    "a lease without its dispatch": (_lease_without_dispatch, Check.LEASE_WITHOUT_DISPATCH),
}


@pytest.mark.parametrize("plant", BROUGHT_FORWARD_PLANTS)
def test_a_campaign_brought_forward_still_has_its_faults_found(brought_forward, plant):
    do, check = BROUGHT_FORWARD_PLANTS[plant]
    _resume(brought_forward)
    assert audit_path(brought_forward).ok
    do(brought_forward)
    report = audit_path(brought_forward)
    assert {v.check for v in report.violations} - {Check.STATUS_COUNTS} == {check}, \
        report.text()
    assert _check_cli(brought_forward).returncode == 1


def test_a_newer_revision_is_refused(campaign):
    _write(campaign, "UPDATE alembic_version SET version_num = '0099'")
    with pytest.raises(SchemaVersionError, match="revision 0099 is newer than this "
                                                 "coordinator knows"):
        audit_path(campaign)


def test_a_file_without_a_campaign_yet(tmp_path):
    header_only = tmp_path / "header.db"
    with contextlib.closing(sqlite3.connect(header_only)) as c:
        c.execute("PRAGMA journal_mode = WAL").fetchall()
    half = tmp_path / "half.db"
    versioning.upgrade(half, "0004")  # a start stopped while it created the schema
    for db in (header_only, half):
        before = _listing(tmp_path)
        with pytest.raises(NoCampaignYet, match="holds no campaign yet"):
            audit_path(db)
        assert _listing(tmp_path) == before


def test_an_sqlite_file_of_something_else_is_not_audited(tmp_path):
    other = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(other)) as c:
        c.execute("CREATE TABLE users (name TEXT)")
        c.commit()
    with pytest.raises(DatabaseOpenError, match="something else .*users"):
        audit_path(other)


# -- a live campaign -------------------------------------------------------------------------

def test_a_live_campaign_is_audited_without_waiting_for_the_write_lock(campaign, monkeypatch):
    """A master's round holds the write lock (BEGIN IMMEDIATE) and has written half of it:
    the audit reads the last committed state, and does not wait (with a busy timeout of 0.2 s,
    waiting would fail)."""
    import store.engine
    monkeypatch.setattr(store.engine, "BUSY_TIMEOUT_MS", 200)
    master = sqlite3.connect(campaign, isolation_level=None)
    try:
        master.execute("BEGIN IMMEDIATE")
        master.execute("DELETE FROM results")  # uncommitted: not what the audit sees
        before = set(os.listdir(campaign.parent))
        t0 = time.monotonic()
        report = audit_path(campaign)
        assert time.monotonic() - t0 < 5
        assert report.violations == [] and report.notes == []
        assert set(os.listdir(campaign.parent)) == before  # its -wal and -shm, no more
        view_engine = open_readonly(campaign)
        assert readonly_view(view_engine).mode == ReadOnlyView.SHARED
        view_engine.dispose()
        master.execute("COMMIT")
    finally:
        master.close()
    assert {v.check for v in audit_path(campaign).violations} >= {Check.DONE_WITHOUT_RESULT}


def test_a_master_that_writes_during_an_at_rest_reading_gets_it_read_again(campaign,
                                                                            monkeypatch):
    """A file nobody has open is read as immutable (no -wal/-shm made); a master that starts
    and checkpoints meanwhile changes the pages under it. The audit notices the file changed
    and reads it again as an ordinary reader."""
    real_audit = store.audit.audit
    seen: list[str] = []
    masters: list[sqlite3.Connection] = []

    def audit_while_a_master_starts(conn):
        seen.append(readonly_view(conn.engine).mode)
        if len(seen) == 1:
            masters.append(master := sqlite3.connect(campaign, isolation_level=None))
            master.execute("INSERT INTO quarantine (at, incarnation, channel, reason, rank) "
                           "VALUES (1, 1, 'ready', 'stale', 1)")
            master.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return real_audit(conn)

    monkeypatch.setattr(store.audit, "audit", audit_while_a_master_starts)
    try:
        report = audit_path(campaign)
    finally:
        for master in masters:
            master.close()
    assert seen == [ReadOnlyView.AT_REST, ReadOnlyView.SHARED]
    assert report.violations == []
    assert report.stats.quarantine["ready"] == {"stale": 1}


def test_the_audit_runs_in_a_masters_own_read_transaction(campaign):
    """`audit(conn)` on the master's engine, as the stateful test calls it."""
    from store.campaign import Store
    with Store.open(campaign, resume=True) as s, s.reading() as conn:
        report = audit(conn)
    # The resume put the dispatch left in flight back in the queue.
    assert report.violations == [] and report.stats.tasks["active"] == 0
    assert report.stats.incarnation == 2


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
    for opener in (open_readonly, audit_path):
        with pytest.raises(error, match=message) as e:
            opener(path)
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



def test_a_read_beside_a_wal_makes_the_shm_as_operations_md_says(campaign, tmp_path):
    """operations.md said `status`/`check` created nothing beside the file; beside a `-wal`
    with no `-shm` (a kill -9's, or a copy's) SQLite makes one wherever the directory can be
    written, and leaves it: the page says so. Nothing is written to the file or its -wal."""
    left = tmp_path / "left"
    left.mkdir()
    c = sqlite3.connect(campaign)
    try:  # a commit left in the -wal, copied with it as a kill -9 leaves them
        c.execute("PRAGMA wal_autocheckpoint = 0")
        c.execute("DELETE FROM quarantine")
        c.commit()
        for suffix in ("", "-wal"):
            shutil.copy(f"{campaign}{suffix}", left / f"c.db{suffix}")
    finally:
        c.close()
    before = _listing(left)
    report = audit_path(left / "c.db")
    assert report.stats is not None and report.stats.quarantine["result"] == {}  # -wal read
    after = _listing(left)
    assert set(after) - set(before) == {"c.db-shm"}
    assert {k: after[k] for k in before} == before  # the file and its -wal as they were
    text = (REPO / "docs" / "operations.md").read_text()
    [row] = [line for line in text.splitlines() if line.startswith("| `status`/`check`")]
    assert "nothing created beside the file" not in row
    assert "it creates `campaign.db-shm` and leaves it" in row

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


# -- a read-only directory -------------------------------------------------------------------

_CHILD = """
import json, os, sys
from store.audit import audit_path
from store.engine import open_readonly, readonly_view
path = sys.argv[1]
engine = open_readonly(path)
mode = readonly_view(engine).mode
with engine.connect() as conn:
    quarantined = conn.exec_driver_sql("SELECT count(*) FROM quarantine").scalar()
engine.dispose()
report = audit_path(path)
print(json.dumps({"mode": mode, "kinds": sorted(k.value for k in report.kinds()),
                  "notes": report.notes, "results": report.stats.results,
                  "quarantined": quarantined,
                  "listing": sorted(os.listdir(os.path.dirname(path)))}))
"""


def _audit_in_read_only_directory(src: Path, name: str) -> dict:
    """Audit `src/name` through a read-only view of `src`: as root, a read-only bind mount in
    a private mount namespace (gone with the child); otherwise a directory without write
    permission."""
    if os.geteuid() != 0:
        src.chmod(0o555)
        try:
            out = subprocess.run([sys.executable, "-c", _CHILD, str(src / name)], cwd=REPO,
                                 capture_output=True, text=True, timeout=120)
        finally:
            src.chmod(0o755)
    else:
        if shutil.which("unshare") is None:
            pytest.skip("no `unshare` to make a read-only mount as root")
        ro = src.parent / "ro"
        ro.mkdir()
        script = (f'mount --bind "{src}" "{ro}" || exit 98; '
                  f'mount -o remount,bind,ro "{ro}" || exit 98; '
                  f'touch "{ro}/probe" 2>/dev/null && exit 99; '
                  f'exec "{sys.executable}" -c "$0" "{ro / name}"')
        out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                              _CHILD], cwd=REPO, capture_output=True, text=True, timeout=120)
        if out.returncode == 99:
            pytest.fail("the read-only bind mount was writable")
        if out.returncode == 98 or out.stderr.startswith("unshare:"):
            # A container without CAP_SYS_ADMIN: no mount namespace, no bind mount.
            pytest.skip(f"no read-only mount can be made here: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_a_campaign_at_rest_in_a_read_only_directory(campaign, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(campaign, src / "c.db")
    got = _audit_in_read_only_directory(src, "c.db")
    assert got == {"mode": ReadOnlyView.AT_REST, "kinds": [], "notes": [], "results": 5,
                   "quarantined": _one(campaign, "SELECT count(*) FROM quarantine")[0],
                   "listing": ["c.db"]}


def test_a_campaign_whose_shm_cannot_be_made_is_read_whole_from_a_copy(campaign, tmp_path):
    """A -wal with a commit not yet copied into the file, and no -shm (a copy of the files on
    read-only media): SQLite reads a -wal only through a -shm. Read as immutable, that commit
    was not seen (a campaign whose every commit was in its -wal read as empty, and `check`
    said it held none yet); it is read from a copy of both files, whole, and the notes say
    so. Nothing is made beside the file."""
    src = tmp_path / "src"
    src.mkdir()
    master = sqlite3.connect(campaign, isolation_level=None)
    try:
        master.execute("PRAGMA wal_autocheckpoint = 0")
        assert master.execute("SELECT count(*) FROM quarantine").fetchone()[0] > 0
        master.execute("DELETE FROM quarantine")  # committed, in the -wal only
        shutil.copy(campaign, src / "c.db")
        shutil.copy(f"{campaign}-wal", src / "c.db-wal")
    finally:
        master.close()
    wal_bytes = (src / "c.db-wal").stat().st_size
    got = _audit_in_read_only_directory(src, "c.db")
    assert got["mode"] == ReadOnlyView.COPY and got["kinds"] == []
    assert got["quarantined"] == 0  # the -wal's commit, seen
    assert got["listing"] == ["c.db", "c.db-wal"]
    [note] = got["notes"]
    assert re.fullmatch(
        r"read from a copy in \S+/coordinator-read-\d+-\w+: SQLite cannot create c\.db-shm beside "
        rf"it \(read-only directory or medium\), and reads the {wal_bytes} bytes of its -wal "
        r"only through one", note), note


def test_a_copy_left_by_a_killed_reader_goes_at_the_next_copy_and_none_may_fail(
        campaign, tmp_path, monkeypatch):
    """The copies are removed at exit; a reader killed first (SIGTERM of `status`, a master
    refused under ULFM, which leaves by os._exit) left one the size of the campaign. And
    when no copy can be made in TMPDIR, the caller reads the file as immutable instead."""
    import tempfile

    from store import readonly
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dead, mine = tmp_path / f"coordinator-read-{gone}-x", \
        tmp_path / f"coordinator-read-{os.getpid()}-y"
    for d in (dead, mine):
        d.mkdir()
        (d / "c.db").write_bytes(b"copy")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    wal = Path(f"{campaign}-wal")
    master = sqlite3.connect(campaign, isolation_level=None)
    try:
        master.execute("PRAGMA wal_autocheckpoint = 0")
        master.execute("DELETE FROM quarantine")  # a commit in the -wal
        got = readonly._read_a_copy(Path(campaign), Path(campaign), wal)
        assert not isinstance(got, str) and got[1].mode == ReadOnlyView.COPY
        assert not dead.exists() and mine.exists()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no such directory"))
        # (why not, for the note that says what was left out)
        assert isinstance(readonly._read_a_copy(Path(campaign), Path(campaign), wal), str)
    finally:
        master.close()
