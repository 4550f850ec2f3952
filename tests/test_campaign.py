"""`store.campaign` across real reopens: restart recovery (R9) of deferred tasks and of a dead
master's dispatches, and the retry budget and attempt ceiling that outlive a restart."""

from __future__ import annotations

from conftest import Farm, defer, fail_once, queue_order, rows
from sqlalchemy import select

from store.journal import RetryPolicy
from store.schema import dispatches, events, leases, tasks
from store.tasks import NewTask, enqueue_tasks, get_task, requeue_tasks


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
