"""The queries for `sqlite3` users in docs/sqlite.md run on a real campaign file and say what
the page says: a schema revision that renames a column or an index must not leave them behind."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest
from campaigns import copy_of
from fakes import InstantWorkers

from coordinator.master import Master, MasterConfig
from coordinator.sources import demo_tasks
from store.campaign import Store
from store.engine import open_engine, read_file
from store.stats import read_stats, stats_text
from store.tasks import enqueue_tasks

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "sqlite.md").read_text()
# From "## Queries" to the page's next section, or its end.
SECTION = PAGE[PAGE.index("\n## Queries\n"):]
_END = SECTION.find("\n## ", 1)
SECTION = SECTION if _END < 0 else SECTION[:_END]
QUERIES = dict(re.findall(r"### (\d+)\.[^\n]*\n(?:.*?\n)*?```sql\n(.*?)```", SECTION,
                          flags=re.DOTALL))
VIEWS_SECTION = PAGE[PAGE.index("\n## Views\n"):PAGE.index("\n## Queries\n")]
VIEW_QUERIES = [q.strip() for q in re.search(r"```sql\n(.*?)```", VIEWS_SECTION,
                                             flags=re.DOTALL)[1].split(";") if q.strip()]


def _run_campaign(db: Path, tasks: int, batch: int = 1) -> None:
    """`tasks` demo tasks run to their end by the real master, `batch` tasks per dispatch."""
    store = Store.open(db)
    try:
        with store.transaction("import") as tx:
            enqueue_tasks(tx, [t.as_task() for t in demo_tasks(tasks)])
        summary = Master(store, InstantWorkers(3), MasterConfig(
            stats_file=db.with_name("stats"), progress=False, linger_s=0, grace_s=1,
            stop_wait_s=1, batch=batch)).run()
        assert summary.committed == tasks
    finally:
        store.close()


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> Path:
    """A finished 30-task campaign run by the real master, plus one quarantined READY."""
    db = tmp_path_factory.mktemp("docs_sql") / "campaign.db"
    _run_campaign(db, 30)
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO quarantine (at, incarnation, channel, reason, rank, token) "
                  "VALUES (1, 1, 'ready', 'malformed', 2, 'zz')")
    return db


def test_the_page_lists_its_thirteen_queries():
    assert sorted(QUERIES, key=int) == [str(i) for i in range(1, 14)]


@pytest.mark.parametrize("number", [str(i) for i in range(1, 14)])
def test_every_query_runs_on_a_campaign_file(campaign: Path, number: str):
    with sqlite3.connect(f"file:{campaign}?mode=ro", uri=True) as c:
        rows = c.execute(QUERIES[number]).fetchall()
    if number == "1":
        assert rows == [("done", 30, 0, 30)]
    if number == "13":
        assert rows == []


def test_query_11_prints_the_stats_text(campaign: Path):
    with sqlite3.connect(f"file:{campaign}?mode=ro", uri=True) as c:
        lines = [r[0] for r in c.execute(QUERIES["11"])]
        plan = " ".join(r[3] for r in c.execute("EXPLAIN QUERY PLAN " + QUERIES["11"]))
    engine = open_engine(campaign)
    try:
        with engine.connect() as conn:
            expected = stats_text(read_stats(conn))
    finally:
        engine.dispose()
    assert "\n".join(lines) + "\n" == expected
    assert "ready messages: 1 (malformed=1)" in expected
    assert "ix_events_counted_kind" in plan  # the per-task events are never read


def test_query_13_finds_a_token_committed_twice(campaign: Path, tmp_path: Path):
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:
        c.execute("UPDATE results SET token = (SELECT token FROM results WHERE task_id = 1) "
                  "WHERE task_id = 2")
        rows = c.execute(QUERIES["13"]).fetchall()
    assert [r[0] for r in rows] == ["token committed by more than one dispatch"]


def test_query_13_finds_nothing_wrong_with_batches_done_and_in_flight(tmp_path: Path):
    """A batch's tasks share their dispatch's token, and only its first task has the
    dispatch row (the others: `work` leases): no problem, finished or in flight. The query
    reported a token "committed for more than one task" for every batch, and every batched
    task in flight as "active without a dispatch"."""
    db = tmp_path / "batched.db"
    _run_campaign(db, 40, batch=4)
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(DISTINCT token) FROM results").fetchone() == (10,)
        assert c.execute(QUERIES["13"]).fetchall() == []
        # Tasks 9-12 back in flight, as one batch of rank 2 (as the master writes it).
        token = c.execute("SELECT token FROM results WHERE task_id = 9").fetchone()[0]
        c.execute("DELETE FROM results WHERE task_id BETWEEN 9 AND 12")
        c.execute("UPDATE tasks SET state = 'active' WHERE id BETWEEN 9 AND 12")
        c.execute("INSERT INTO dispatches (token, rank, task_id, incarnation, created_at) "
                  "VALUES (?, 2, 9, 1, 0)", (token,))
        c.executemany("INSERT INTO leases (token, kind, key) VALUES (?, 'work', ?)",
                      [(token, str(i)) for i in (10, 11, 12)])
        assert c.execute(QUERIES["13"]).fetchall() == []
        # A batched task that is no longer active, and an active one that nothing holds.
        c.execute("UPDATE tasks SET state = 'queued' WHERE id = 11")
        c.execute("DELETE FROM leases WHERE key = '12'")
        assert sorted(c.execute(QUERIES["13"]).fetchall()) == [
            ("active task without a dispatch", 12, None),
            ("batched task that is not active", 11, token)]


def test_query_5_shows_a_late_result_of_a_retired_dispatch(campaign: Path, tmp_path: Path):
    """A RESULT that comes after the watchdog retired its dispatch is `unowned`, with no
    `expected` token: the history found it only through `expected` and left it out."""
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:
        c.execute("INSERT INTO quarantine (at, incarnation, channel, reason, rank, token) "
                  "SELECT committed_at + 1, 1, 'result', 'unowned', rank, token FROM results "
                  "WHERE task_id = 7")
        rows = c.execute(QUERIES["5"]).fetchall()
    assert [r[2] for r in rows if r[2].startswith("quarantined")] == \
        ["quarantined result/unowned"]


def test_query_5_says_whose_each_event_of_a_batch_is(campaign: Path, tmp_path: Path):
    """A batch's tasks share its token, so a task's history holds its batch-mates' events
    too: six identical `dispatched` rows, with nothing to tell them apart."""
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:  # tasks 8 and 9 went out with task 7, and came back
        c.execute("INSERT INTO events (at, incarnation, kind, rank, token, task_id) "
                  "SELECT dispatched_at - 1, incarnation, 'dispatched', rank, token, t.id "
                  "FROM results, (SELECT 7 AS id UNION SELECT 8 UNION SELECT 9) t "
                  "WHERE task_id = 7")
        rows = c.execute(QUERIES["5"]).fetchall()
    assert sorted(r[4] for r in rows if r[2] == "dispatched") == [7, 8, 9]


def test_the_page_uses_every_view_and_each_runs_on_a_campaign_file(campaign: Path):
    """Each view of revision 0010 is in the page's table and used by one of its examples,
    and each example runs (on a campaign with a held task and a dispatch in flight)."""
    from store.schema import VIEWS

    for view in VIEWS:
        assert f"| `{view}` |" in VIEWS_SECTION, view
        assert any(f"FROM {view}" in q for q in VIEW_QUERIES), view
    with sqlite3.connect(f"file:{campaign}?mode=ro", uri=True) as c:
        got = {q: c.execute(q).fetchall() for q in VIEW_QUERIES}
    history = next(rows for q, rows in got.items() if "task_history" in q)
    assert [r[3] for r in history][-1] == "result ok" and "dispatched" in [r[3] for r in history]
    throughput = next(rows for q, rows in got.items() if "throughput_per_minute" in q)
    assert sum(r[1] for r in throughput) == 30
    [ranks] = [rows for q, rows in got.items() if "rank_utilisation" in q]
    assert sorted(r[1] for r in ranks) == [1, 2, 3] and sum(r[3] for r in ranks) == 30


def test_the_views_show_a_dispatch_in_flight_and_a_held_task(campaign: Path, tmp_path: Path):
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:
        c.execute("DELETE FROM results WHERE task_id IN (7, 8)")
        c.execute("UPDATE tasks SET state = 'active' WHERE id = 7")
        c.execute("UPDATE tasks SET state = 'failed', reason = 'five failed attempts' "
                  "WHERE id = 8")
        c.execute("INSERT INTO dispatches (token, rank, task_id, incarnation, created_at) "
                  "VALUES (?, 2, 7, 1, (SELECT max(at) + 1 FROM events))", ("7" * 64,))
        assert c.execute("SELECT rank, task_id, sent FROM in_flight").fetchall() == [(2, 7, "no")]
        assert c.execute("SELECT task_id, state, reason FROM held_tasks").fetchall() == [
            (8, "failed", "five failed attempts")]
        assert c.execute("SELECT what FROM task_history WHERE task_id = 7").fetchall()[-1] == (
            "dispatched (in flight)",)


def test_the_page_warns_that_immutable_leaves_the_wal_out_where_it_gives_it(campaign: Path,
                                                                             tmp_path: Path):
    """`?immutable=1` was given "on read-only media" alone: a file copied with its `-wal`
    read 113 results where it held 193. SQLite reads the main file alone that way."""
    import shutil
    copy = copy_of(campaign, tmp_path)
    kept = tmp_path / "kept"
    kept.mkdir()
    c = sqlite3.connect(copy)
    try:  # commits left in the -wal, as a kill -9 leaves them, copied with it
        c.execute("PRAGMA wal_autocheckpoint = 0")
        c.execute("DELETE FROM results WHERE task_id IN "
                  "(SELECT task_id FROM results ORDER BY task_id LIMIT 10)")
        c.commit()
        shutil.copy(copy, kept / "c.db")
        shutil.copy(f"{copy}-wal", kept / "c.db-wal")
    finally:
        c.close()
    count = "SELECT count(*) FROM results"
    with sqlite3.connect(f"file:{kept / 'c.db'}?immutable=1", uri=True) as c:
        assert c.execute(count).fetchone() == (30,)  # the -wal's commit left out
    with sqlite3.connect(f"file:{kept / 'c.db'}?mode=ro", uri=True) as c:
        assert c.execute(count).fetchone() == (20,)
    head = PAGE[:PAGE.index("\n## Rules of use\n")]
    assert "?immutable=1'  # read-only media, and only with no -wal beside it" in head
    assert "**ignores `campaign.db-wal`**" in head
    assert "copy `campaign.db` and `campaign.db-wal` together" in head
    assert "`coordinator status` or\n`check`, which read the `-wal` too" in head


def test_query_5_shows_the_dispatch_in_flight_of_a_task_alone_and_in_a_batch(farm):
    """The `task_history` view shows a task's dispatch in flight (`dispatched (in flight)`);
    query 5, its by-hand twin, left it out, for a task alone and a batch's tasks alike."""
    ids = farm.enqueue(*({"data": i} for i in range(4)))
    farm.ready(1)
    farm.ready(2)
    [batch] = farm.plan(1, batch=3, sent=True)
    [alone] = farm.plan(2, batch=1)
    assert [t.id for t in batch.tasks] == ids[:3] and [t.id for t in alone.tasks] == ids[3:]
    with farm.store.reading() as conn:
        for task_id, token, rank, detail in ((ids[0], batch.token, 1, "sent"),
                                             (ids[2], batch.token, 1, "sent"),
                                             (ids[3], alone.token, 2, "not sent yet")):
            rows = conn.exec_driver_sql(
                QUERIES["5"].replace("WHERE id = 7", f"WHERE id = {task_id}")).all()
            assert [(r[2], r[3], r[4], r[5], r[6]) for r in rows][1:] == [
                ("dispatched (in flight)", rank, task_id, token[:12], detail)]
            assert rows[0][2] == "enqueued"
            view = conn.exec_driver_sql(
                f"SELECT what FROM task_history WHERE task_id = {task_id}").all()
            assert [r[0] for r in view] == [r[2] for r in rows]
    assert "`dispatched (in flight)` (the dispatch that holds the task now" in PAGE


def test_query_7_gives_the_test_cases_status_counts(campaign: Path, tmp_path: Path):
    """`status` and the plot count the test cases of committed results and of retried runs
    (`salvaged`, revision 0017); query 7 and the `throughput_per_minute` view counted the
    first only, with no word of it."""
    from store.observe import read_found
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:
        c.execute("UPDATE results SET testcases = 1 WHERE task_id % 5 = 0")
        (last,) = c.execute("SELECT max(committed_at) FROM results").fetchone()
        c.executemany("INSERT INTO salvaged (at, incarnation, rank, token, task_id, testcases) "
                      "VALUES (?, 1, 2, ?, ?, ?)", [(last, "a" * 64, 3, 1),
                                                    (last + 120, "b" * 64, 4, 3)])
        rows = c.execute(QUERIES["7"]).fetchall()
        view = c.execute("SELECT sum(testcases) FROM throughput_per_minute").fetchone()[0]
    found = read_file(copy, read_found)[0]
    assert sum(r[1] for r in rows) == 30 and rows[-1][1] == 0  # a minute of a retried run alone
    assert (sum(r[5] for r in rows), sum(r[6] for r in rows)) == (6, 4)
    assert found.testcases == 10 == sum(r[5] + r[6] for r in rows) == view + 4
    section = SECTION[SECTION.index("### 7."):SECTION.index("### 8.")]
    assert "`coordinator status`, the progress line, the metrics and the plot count both" in section
    assert "not the `salvaged` ones of retried runs" in VIEWS_SECTION


def test_a_broken_batch_is_one_protocol_requeue_and_the_page_says_so(farm):
    """A batch broken by a failure goes back in halves, none charged, logged as `requeued`
    (`split: ...` in its detail) and counted as a "Protocol-requeued dispatch", as a task
    requeued alone is; the page said a `requeued` was a requeue within the retry budget, and
    splits were not counted."""
    ids = farm.enqueue(*({"data": i} for i in range(9)))
    farm.ready(1)
    farm.ready(2)
    [batch] = farm.plan(1, batch=8, sent=True)
    [alone] = farm.plan(2, sent=True)
    for p in (batch, alone):
        farm.result_raw(p.rank, {"status": "ok"})  # no token: the invalid mark
        farm.ready(p.rank, p.token)
    assert len(farm.sweep()) == 2
    with farm.store.reading() as conn:
        requeued = conn.exec_driver_sql(
            "SELECT token, task_id, detail FROM events WHERE kind = 'requeued' "
            "ORDER BY id").all()
        stats = read_stats(conn)
    assert sorted(requeued) == sorted([
        (batch.token, ids[0], "split: 8 tasks back at the head in halves of 4 and 4, none "
                              "charged (invalid result)"),
        (alone.token, ids[8], "invalid result")])
    assert stats.requeued == 2
    [row] = [line for line in PAGE.splitlines() if line.startswith("| `requeued` |")]
    assert "`split: 8 tasks back at the head in halves of 4 and 4, none charged" in row
    assert "the count is of dispatches, not tasks, and includes these broken batches" in row
