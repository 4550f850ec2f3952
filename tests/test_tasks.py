"""`store.tasks` on real campaign files: the retry decision (R7) and the queue read a window
at a time."""

from __future__ import annotations

import pytest
from conftest import Farm, fail_once, queue_order, rows, task_state
from sqlalchemy import select

from store.journal import RetryPolicy
from store.schema import TaskState, dispatches, events, results, tasks
from store.tasks import requeue_error_results

# -- retry decision (R7) ---------------------------------------------------------------

def test_retries_one_requeues_then_defers_with_the_same_id(farm):
    [tid] = farm.enqueue({"path": "/seed/x", "focus_bytes": [1, 2]})
    sid = rows(farm, tasks)[0].semantic_id
    [first] = fail_once(farm)
    assert first.outcome is TaskState.QUEUED
    assert [t.id for t in rows(farm, tasks, tasks.c.state == "queued")] == [tid]
    [second] = fail_once(farm)
    assert second.outcome is TaskState.DEFERRED
    [t] = rows(farm, tasks)
    assert (t.id, t.semantic_id, t.state, t.attempts) == (tid, sid, "deferred", 2)
    with farm.store.reading() as conn:
        kinds = [e.kind for e in conn.execute(select(events).where(events.c.task_id == tid))]
    assert kinds.count("requeued") == 1 and kinds.count("deferred") == 1


def test_retries_zero_defers_at_once(db_path):
    farm = Farm(db_path, policy=RetryPolicy(retries=0))
    farm.enqueue({"data": 1})
    assert fail_once(farm)[0].outcome is TaskState.DEFERRED
    farm.close()


def test_ceiling_holds_the_task_as_failed_with_its_reason(db_path):
    farm = Farm(db_path, policy=RetryPolicy(retries=16, max_attempts=3))
    [tid] = farm.enqueue({"data": 1})
    outcomes = [fail_once(farm)[0].outcome for _ in range(3)]
    assert outcomes == [TaskState.QUEUED, TaskState.QUEUED, TaskState.FAILED]
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert t.state == "failed" and "3 failed attempts" in t.reason
    assert (t.attempts, t.budget_used) == (3, 3)  # the last failure is charged like the others
    farm.close()


# -- queue order and leases ------------------------------------------------------------

def _add(farm: Farm, field: str, value, *paths: str) -> list[int]:
    """Tasks at `paths` that all want `value` for `field`: a payload field, or (`input_bytes`)
    the input file's content."""
    if field == "input_bytes":
        return farm.enqueue(*({"path": p} for p in paths), input_bytes=value)
    return farm.enqueue(*({"path": p, field: value} for p in paths))


@pytest.mark.parametrize("field, held_value, free_value", [
    ("target_branch", 5, 6),          # skipped in SQL already
    ("input_bytes", b"held", b"free"),  # the content lease: skipped in SQL too
    ("schedule_prefix", [1, 2], [3]),  # only by the lease check: read past several windows
])
def test_tasks_waiting_on_a_lease_are_skipped_past_the_first_window(farm, field, held_value,
                                                                     free_value):
    """take_queued reads the queue a window of rows at a time: more waiting tasks than one
    window holds must not hide the dispatchable ones behind them, nor lose their places.
    (Two tasks of the same input content are two tasks when their paths differ, and never
    run at once: a dispatch takes the content's lease.)"""
    [held] = _add(farm, field, held_value, "/seed/held")
    farm.ready(1, "")
    farm.dispatch(1)
    waiting = _add(farm, field, held_value, *(f"/seed/w{i}" for i in range(100)))
    free = farm.enqueue({"path": "/seed/free1"}) + _add(farm, field, free_value,
                                                        "/seed/free2", "/seed/free3")
    farm.ready(2, "")
    farm.ready(3, "")
    farm.ready(4, "")
    got = farm.dispatch(2, 3, 4)
    assert sorted(got) == [2, 3]  # free3 waits: free2 took the same lease in the same plan
    with farm.store.reading() as conn:
        active = {r.task_id for r in conn.execute(select(dispatches.c.task_id))}
    assert active == {held, *free[:2]}
    assert all(task_state(farm, t) == "queued" for t in waiting + free[2:])


def test_each_retry_goes_ahead_of_the_ones_before_it(farm):
    """A retried task goes to the head of the queue, ahead of every queued task, retries
    before it included: A then B failed, the queue is B, A, C. (A retry placed at the head
    plus one went behind an earlier retry, or tied with it: A, B, C.)"""
    a, b, c = farm.enqueue({"data": "A"}, {"data": "B"}, {"data": "C"})
    farm.ready(1, "")
    farm.ready(2, "")
    sent = farm.dispatch(1, 2, sent=True)
    assert queue_order(farm) == [c]
    for rank, task in ((1, a), (2, b)):  # A failed, then B: an invalid RESULT and its READY
        farm.result(rank, None)
        farm.ready(rank, sent[rank])
        [rec] = farm.sweep()
        assert (rec.task_id, rec.outcome) == (task, TaskState.QUEUED)
    assert queue_order(farm) == [b, a, c]


# -- enqueue and requeue ---------------------------------------------------------------------

def test_a_known_payload_with_other_bytes_is_not_added_and_leaves_no_blob(farm):
    """A task is its semantic payload: the same path with another input file is the same task
    (not run twice), and its bytes must not be stored as a blob nothing refers to."""
    first = farm.enqueue({"path": "seed/a"}, input_bytes=b"one")
    assert farm.enqueue({"path": "seed/a"}, input_bytes=b"two") == []
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM blobs").scalar() == 1
    assert [t.id for t in rows(farm, tasks)] == first


def test_done_tasks_whose_run_failed_can_be_requeued(farm):
    """A run that failed for a reason outside the task (a target missing on a node, inputs
    gone) is committed as an `error` result and its task is done; after the fix the operator
    requeues exactly those: the result is discarded (its event keeps the token and why), the
    task goes to the tail, the ok result stays."""
    ok_id, bad_id, other_id = farm.enqueue({"data": 1}, {"data": 2}, {"data": 3})
    farm.ready(1, "")
    farm.ready(2, "")
    farm.ready(3, "")
    sent = farm.dispatch(1, 2, 3)
    farm.result(1, sent[1], status="ok")
    farm.result(2, sent[2], status="error")
    with farm.store.transaction() as tx:  # ids narrow it: task 3 is still active anyway
        assert requeue_error_results(tx, ids=[ok_id, other_id]) == []
        assert requeue_error_results(tx) == [bad_id]
        assert requeue_error_results(tx) == []  # once
    assert [(t.id, t.state, t.attempts) for t in rows(farm, tasks)] == [
        (ok_id, "done", 0), (bad_id, "queued", 0), (other_id, "active", 0)]
    assert [r.task_id for r in rows(farm, results)] == [ok_id]
    [ev] = rows(farm, events, events.c.kind == "manual_requeue")
    assert (ev.task_id, ev.token) == (bad_id, sent[2])
    assert ev.detail.startswith("from done: its error result from rank 2 discarded")
    assert queue_order(farm) == [bad_id]


def test_an_input_queues_ahead_of_the_fed_back_test_cases_behind_the_retries(farm):
    """With feedback unbounded (the default) every SymCC run queued its test cases faster
    than the ranks ran them, and a new AFL entry, the fuzzer's own new coverage, waited at
    the tail behind them (a review: position 759 behind 500 of our own). Inputs now go to the
    end of the inputs, the test cases fed back behind them; a retry still goes to the head,
    and a manual requeue to the very end."""
    from store.tasks import FEEDBACK_ORIGIN, NewTask, enqueue_tasks, requeue_tasks

    def add(*items: tuple[str, str]) -> list[int]:
        with farm.store.transaction() as tx:
            return enqueue_tasks(tx, [NewTask({"path": p}, p.encode(), origin=o)
                                      for p, o in items], skip_known_content=True)

    [a1] = add(("/afl/a1", "afl"))
    f1, f2 = add(("/ours/f1", FEEDBACK_ORIGIN), ("/ours/f2", FEEDBACK_ORIGIN))
    [a2] = add(("/afl/a2", "afl"))
    assert queue_order(farm) == [a1, a2, f1, f2]
    [first] = fail_once(farm)  # a1 taken, failed, requeued at the head
    assert first.task_id == a1 and queue_order(farm) == [a1, a2, f1, f2]
    [a3] = add(("/afl/a3", "afl"))
    [f3] = add(("/ours/f3", FEEDBACK_ORIGIN))
    assert queue_order(farm) == [a1, a2, a3, f1, f2, f3]
    [second] = fail_once(farm)  # a1 again: past its budget, deferred
    assert second.outcome is TaskState.DEFERRED
    assert queue_order(farm) == [a2, a3, f1, f2, f3]
    with farm.store.transaction() as tx:
        requeue_tasks(tx, ids=[a1])
    assert queue_order(farm) == [a2, a3, f1, f2, f3, a1]
