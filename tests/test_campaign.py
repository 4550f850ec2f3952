"""`store.campaign` across real reopens: restart recovery (R9) of deferred tasks and of a dead
master's dispatches, the retry budget and attempt ceiling that outlive a restart, and what
opening a campaign checks (--resume, the one master's lock, the stored settings)."""

from __future__ import annotations

import contextlib
import sqlite3

import pytest
from conftest import (
    Farm,
    defer,
    fail_once,
    queue_order,
    rows,
    write_lock_held_elsewhere,
)
from sqlalchemy import select

from store.campaign import Store
from store.errors import CampaignExistsError, CampaignLockedError, StoreWriteError
from store.journal import RetryPolicy
from store.schema import dispatches, events, leases, tasks
from store.tasks import NewTask, enqueue_tasks, get_task, requeue_tasks
from store.workers import note_unrun


def test_deferred_tasks_come_back_first_and_rebuilt_exactly(db_path, tmp_path):
    seed = tmp_path / "seed"
    seed.write_bytes(b"AFL")
    farm = Farm(db_path)
    payload = {"path": str(seed), "focus_bytes": [0, 2], "target_branch": 11,
               "s2f_actions": [[11, "solve"]], "schedule_prefix": [1],
               "continuation": {"k": 1}}
    tid = defer(farm, payload)
    original = rows(farm, tasks, tasks.c.id == tid)[0]
    farm.enqueue({"data": "queued before the restart"})
    farm.close()

    farm = Farm(db_path, resume=True)
    assert farm.store.resume_report.reclaimed == [tid]
    with farm.store.transaction() as tx:
        enqueue_tasks(tx, [NewTask({"data": "new after the restart"})])
        rebuilt = get_task(tx, tid)
    order = queue_order(farm)
    assert order[0] == tid and len(order) == 3
    after = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (after.semantic_id, after.payload, after.attempts) == \
        (original.semantic_id, original.payload, original.attempts)
    assert rebuilt.payload["s2f_actions"] == [[11, "solve"]]
    farm.close()


def test_plain_task_with_its_input_gone_stays_deferred_with_reason(db_path, tmp_path):
    gone = tmp_path / "id:000007"
    gone.write_bytes(b"x")
    farm = Farm(db_path)
    plain = defer(farm, {"path": str(gone)})
    stored = defer(farm, {"path": str(tmp_path / "id:000008")}, input_bytes=b"kept")
    cont = defer(farm, {"path": str(tmp_path / "id:000009"), "continuation": {"c": 1}})
    farm.close()
    gone.unlink()  # AFL moved or deleted the seed while the coordinator was down

    farm = Farm(db_path, resume=True)
    report = farm.store.resume_report
    assert report.refused == [plain]
    assert sorted(report.reclaimed) == sorted([stored, cont])
    t = rows(farm, tasks, tasks.c.id == plain)[0]
    assert t.state == "deferred" and t.reason == f"input unavailable: {gone}"
    assert queue_order(farm)[:2] == [stored, cont]  # oldest deferral first
    farm.close()
    # Refused again at the next resume, but said once: each resume used to add one event per
    # refused task (100,000 rows and 12 s per resume on a large campaign).
    farm = Farm(db_path, resume=True)
    assert farm.store.resume_report.refused == [plain]
    assert [(e.task_id, e.detail) for e in rows(farm, events, events.c.kind == "not_admitted")
            ] == [(plain, f"input unavailable: {gone}")]
    farm.close()
    # Never deleted: still there on the next resume, and admitted once the input is back.
    gone.write_bytes(b"x")
    farm = Farm(db_path, resume=True)
    assert farm.store.resume_report.reclaimed == [plain]
    farm.close()


def test_dispatches_of_a_dead_incarnation_are_requeued_on_resume(db_path):
    farm = Farm(db_path)
    ids = farm.enqueue({"data": 1}, {"data": 2}, {"data": 3})
    farm.ready(1, "")
    farm.ready(2, "")
    farm.dispatch(1, 2)
    farm.close()  # the master died: two dispatches and their leases are left behind

    farm = Farm(db_path, resume=True)
    assert farm.store.resume_report.interrupted == ids[:2]
    assert rows(farm, dispatches) == [] and rows(farm, leases) == []
    assert queue_order(farm) == ids  # the interrupted ones first, in dispatch order
    assert [t.attempts for t in rows(farm, tasks)] == [1, 1, 0]  # post-send: attempt counts
    with farm.store.reading() as conn:
        kinds = [e.kind for e in conn.execute(select(events.c.kind))]
    assert kinds.count("interrupted") == 2
    farm.close()


def test_a_resume_with_fewer_ranks_forgets_the_ranks_it_lacks(db_path):
    """A job of 4 ranks, resumed with 3: rank 3's row stayed, stamped with the new
    incarnation, and `status`, the metrics and the ETA counted it as a rank yet to be heard
    from, for ever."""
    farm = Farm(db_path, ranks=4)
    for rank in (1, 2, 3):
        farm.ready(rank, "")
    with farm.store.transaction("a host that fails") as tx:
        note_unrun(tx, 2, 3, "no space")
    farm.close()
    farm = Farm(db_path, resume=True, ranks=3)
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql("SELECT rank, state FROM workers ORDER BY rank").fetchall(
        ) == [(1, "unknown"), (2, "unknown")]
        # (nor what its host failed: the new job's rank 2 may run elsewhere)
        assert conn.exec_driver_sql("SELECT count(*) FROM workers WHERE unrun_streak IS NOT "
                                    "NULL OR unrun_since IS NOT NULL OR unrun_detail IS NOT "
                                    "NULL").scalar() == 0
    farm.close()


def test_retry_budget_survives_a_restart(db_path):
    farm = Farm(db_path)
    [tid] = farm.enqueue({"data": 1})
    assert fail_once(farm)[0].outcome.value == "queued"
    farm.close()
    farm = Farm(db_path, resume=True)
    # The budget (1) was spent before the restart: the next failure defers.
    assert fail_once(farm)[0].outcome.value == "deferred"
    assert rows(farm, tasks, tasks.c.id == tid)[0].attempts == 2
    farm.close()


def test_a_crash_counts_towards_the_ceiling_but_not_the_retry_budget(db_path):
    """A dispatch the dead master left counts an attempt (the ceiling stops a task that takes
    the job down every time), but it was no protocol failure: the task's first real one is
    still requeued within the budget of 1, its second deferred."""
    farm = Farm(db_path)
    [tid] = farm.enqueue({"data": 1})
    farm.ready(1, "")
    farm.dispatch(1)
    farm.close()  # the master died with the dispatch committed
    farm = Farm(db_path, resume=True)
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (t.state, t.attempts, t.budget_used) == ("queued", 1, 0)
    assert fail_once(farm)[0].outcome.value == "queued"
    assert fail_once(farm)[0].outcome.value == "deferred"
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (t.attempts, t.budget_used) == (3, 2)
    with farm.store.transaction() as tx:  # an operator requeue resets both counts
        assert requeue_tasks(tx, ids=[tid]) == [tid]
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (t.state, t.attempts, t.budget_used) == ("queued", 0, 0)
    farm.close()


def test_restarts_cannot_retry_a_poison_task_forever(db_path):
    farm = Farm(db_path, policy=RetryPolicy(max_attempts=3))
    [tid] = farm.enqueue({"data": "kills its worker, and the job with it"})
    for _ in range(3):
        farm.ready(1, "")
        farm.dispatch(1)
        farm.close()
        farm = Farm(db_path, resume=True, policy=RetryPolicy(max_attempts=3))
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert t.state == "failed" and "interrupted" in t.reason
    with farm.store.transaction() as tx:
        assert requeue_tasks(tx) == [tid]
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (t.state, t.attempts, t.reason) == ("queued", 0, None)
    farm.close()


def _stop_signal(farm: Farm, name: str = "SIGTERM") -> None:
    """What the master writes the moment it gets a stop signal (`Master._record_stop`)."""
    from store.schema import EventKind
    with farm.store.transaction() as tx:
        tx.event(EventKind.STOP, detail=name)


def test_an_incarnation_stopped_by_its_operator_leaves_its_runs_uncharged(db_path):
    """At a Slurm time limit `mpiexec` ends the ranks (and SIGKILL follows the grace) before
    the graceful stop can finish: its `stop` event makes the resume charge the single runs it
    left in flight nothing; a batch still goes back in halves, none charged, as after a crash;
    an incarnation that got no stop signal is charged as before."""
    from store.dispatches import STOPPED_BY
    farm = Farm(db_path)
    single, other, *batch = farm.enqueue(*({"data": i} for i in range(6)))
    farm.ready(1, "")
    farm.ready(2, "")
    farm.dispatch(1)
    farm.plan(2, batch=4)
    _stop_signal(farm, "SIGUSR1")
    farm.close()  # ended before its graceful stop finished

    farm = Farm(db_path, resume=True)
    attempts = {t.id: t.attempts for t in rows(farm, tasks)}
    assert attempts == dict.fromkeys([single, other, *batch], 0)
    details = {e.task_id: e.detail for e in rows(farm, events, events.c.kind == "interrupted")}
    assert details[single] == f"{STOPPED_BY}SIGUSR1): not charged"
    assert details[other].startswith("split: 4 tasks")
    # The next incarnation got no stop signal: its run is a crash's, charged.
    farm.ready(1, "")
    farm.dispatch(1)
    farm.close()
    farm = Farm(db_path, resume=True)
    assert rows(farm, tasks, tasks.c.id == single)[0].attempts == 1
    farm.close()


def test_a_stop_charges_only_the_run_of_a_worker_gone_at_it(db_path):
    """A worker holding work was gone when the stop signal came (without ULFM its death is
    what makes the launcher signal the master): its run is charged at the resume as a
    crash's, the other ranks' are not. (The master wrote no `stop` event at all then, and
    one rank's READY naming a pid that is no process here cost every honest rank's run an
    attempt.) `status` still reads the stop's cause from its own event."""
    from store.dispatches import GONE_AT_STOP, STOPPED_BY
    from store.schema import EventKind
    from store.stats import incarnation_stop
    farm = Farm(db_path)
    honest, suspect = farm.enqueue({"data": "honest"}, {"data": "suspect"})
    farm.ready(1, "")
    farm.ready(2, "")
    farm.dispatch(1, 2)
    with farm.store.transaction() as tx:
        tx.event(EventKind.STOP, detail="SIGTERM")
        tx.event(EventKind.STOP, rank=2, detail=GONE_AT_STOP)
        incarnation = tx.incarnation
    farm.close()

    farm = Farm(db_path, resume=True)
    attempts = {t.id: t.attempts for t in rows(farm, tasks)}
    assert attempts == {honest: 0, suspect: 1}
    details = {e.task_id: e.detail for e in rows(farm, events, events.c.kind == "interrupted")}
    assert details[honest] == f"{STOPPED_BY}SIGTERM): not charged"
    assert details[suspect] is None
    with farm.store.reading() as conn:
        assert incarnation_stop(conn, incarnation)[1] == "SIGTERM"
    farm.close()


def test_stops_cannot_rerun_a_task_uncharged_for_ever(db_path):
    """A target that signals the whole job (or a worker's death that makes `mpiexec` signal
    the master) looks like an operator's stop: STOPPED_FREE such runs of one task go uncharged,
    and the next ones are charged up to the ceiling."""
    from store.dispatches import STOPPED_FREE
    policy = RetryPolicy(max_attempts=2)
    farm = Farm(db_path, policy=policy)
    [tid] = farm.enqueue({"data": "signals the whole job"})
    charged = []
    for _ in range(STOPPED_FREE + 2):
        farm.ready(1, "")
        farm.dispatch(1)
        _stop_signal(farm)
        farm.close()
        farm = Farm(db_path, resume=True, policy=policy)
        charged.append(rows(farm, tasks, tasks.c.id == tid)[0].attempts)
    assert charged == [0] * STOPPED_FREE + [1, 2]
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert t.state == "failed" and "interrupted by a coordinator restart" in t.reason
    farm.close()


# -- open: a new campaign or --resume, the campaign's lock, its settings ------------------------

def test_existing_campaign_needs_resume(db_path, farm):
    farm.enqueue({"data": 1})
    farm.store.close()  # the master that made it is gone (it would hold the campaign's lock)
    with pytest.raises(CampaignExistsError, match="--resume"):
        Store.open(db_path)
    again = Store.open(db_path, resume=True)
    assert again.incarnation == 2 and again.epoch != farm.store.epoch
    again.close()


def test_a_second_master_on_the_same_campaign_is_refused(db_path):
    """Nothing else stops two masters (each would fence the other's dispatches out); the lock
    goes with the first one's close (or its process)."""
    first = Store.open(db_path)
    try:
        with pytest.raises(CampaignLockedError, match=r"in use by another master \(pid \d+"):
            Store.open(db_path, resume=True)
    finally:
        first.close()
    again = Store.open(db_path, resume=True)
    assert again.incarnation == 2
    again.close()


def test_a_master_starting_under_another_process_s_write_lock_says_why(db_path, monkeypatch):
    """Store.open read the schema in BEGIN IMMEDIATE: past the busy timeout a raw driver
    error escaped, which the start took for an internal error (exit 5, a traceback)."""
    Store.open(db_path).close()
    with write_lock_held_elsewhere(db_path, monkeypatch), \
            pytest.raises(StoreWriteError,
                          match="longer than this command waits .a master: --lock-wait"):
        Store.open(db_path, resume=True)
    Store.open(db_path, resume=True).close()


def test_a_write_lock_held_on_a_new_campaign_file_is_waited_for_and_said(db_path,
                                                                           monkeypatch):
    """A lock taken between the new file's creation and its schema (the fault campaign's
    held_lock, once in 200 trials) was waited for inside Alembic's connection, for up to its
    busy timeout and without a word. The start now waits for it like any write: said, and
    bounded by the lock wait."""
    import threading

    from store import campaign as campaign_module
    holder = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    release = threading.Timer(2.5, lambda: holder.execute("ROLLBACK"))
    waits: list[float] = []
    no_campaign_yet = campaign_module._no_campaign_yet

    def then_the_shell_takes_the_lock(conn):
        fresh = no_campaign_yet(conn)
        if fresh and not release.is_alive():
            holder.execute("BEGIN IMMEDIATE")  # between the file's creation and its schema
            release.start()
        return fresh

    monkeypatch.setattr(campaign_module, "_no_campaign_yet", then_the_shell_takes_the_lock)
    try:
        store = Store.open(db_path, lock_wait_s=30, on_lock_wait=waits.append)
    finally:
        release.join()
        holder.close()
    assert waits and waits == sorted(waits) and waits[-1] < 30, waits
    store.close()


def test_settings_are_kept_and_a_refused_resume_writes_nothing(db_path):
    """campaign.settings is written once, with the new campaign; on resume the stored ones go
    to the check, and a check that refuses leaves the file as it was (same incarnation)."""
    Store.open(db_path, settings={"executor": "python", "callable": "m:f"}).close()
    seen = []

    def refuse(stored):
        seen.append(stored)
        raise ValueError("another executor")

    with pytest.raises(ValueError, match="another executor"):
        Store.open(db_path, resume=True, settings={"executor": "demo"}, check_settings=refuse)
    assert seen == [{"callable": "m:f", "executor": "python"}]
    again = Store.open(db_path, resume=True, settings={"executor": "demo"},
                       check_settings=seen.append)
    assert again.incarnation == 2  # the refused start did not count as one
    again.close()
    assert seen[-1] == {"callable": "m:f", "executor": "python"}  # never overwritten


def test_a_campaign_without_settings_takes_the_first_resumes(db_path):
    """A campaign from before revision 0004 (NULL), or one whose settings are not a JSON
    object, is not checked once: that start's settings become the record."""
    Store.open(db_path).close()  # no settings given: NULL, as after `db upgrade`
    for stored in (None, "not json", "[1, 2]"):
        with sqlite3.connect(db_path) as c:
            c.execute("UPDATE campaign SET settings = ?", (stored,))
        seen = []
        Store.open(db_path, resume=True, settings={"executor": "python"},
                   check_settings=seen.append).close()
        assert seen == [None]
        with sqlite3.connect(db_path) as c:
            assert c.execute("SELECT settings FROM campaign").fetchone() == (
                '{"executor": "python"}',)


@pytest.mark.parametrize("replaced", [False, True])
def test_a_store_whose_file_lost_its_name_copies_it_out_whole(db_path, replaced):
    """A master whose campaign file is removed (or replaced) goes on in the open file, which
    no name reaches: closed as usual, everything in it was lost. `close(rescue=True)` copies
    it out first: back at its name (the lost file's -wal and -shm, which SQLite leaves there,
    removed first), or beside it when something else has the name."""
    store = Store.open(db_path)
    with store.transaction("import") as tx:
        enqueue_tasks(tx, [NewTask({"path": f"x{i}"}) for i in range(10)])
    assert store.lost_name() is None
    db_path.unlink()
    if replaced:
        db_path.write_text("another file")
    with store.transaction("import") as tx:  # (still committed, to the file no name reaches)
        enqueue_tasks(tx, [NewTask({"path": f"y{i}"}) for i in range(5)])
    became = "replaced by another file" if replaced else "removed"
    assert store.lost_name() == f"{db_path} was {became}"
    saved = store.close(rescue=True)
    assert (saved == db_path) is not replaced
    with contextlib.closing(sqlite3.connect(saved)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT count(*) FROM tasks").fetchone() == (15,)
    if replaced:
        assert db_path.read_text() == "another file"
    else:
        assert sorted(p.name for p in db_path.parent.iterdir()) == [db_path.name]
        again = Store.open(db_path, resume=True)
        assert again.incarnation == 2
        again.close()
