"""Restart recovery (R9), graceful stop, and the persistent retry budget, across real reopens."""

from __future__ import annotations

import json

from conftest import Farm, defer, fail_once, queue_order, rows
from sqlalchemy import select

from store.dispatches import requeue_in_flight
from store.journal import RetryPolicy
from store.schema import dispatches, events, leases, results, tasks, workers
from store.tasks import (
    NewTask,
    enqueue_tasks,
    get_task,
    requeue_error_results,
    requeue_tasks,
)


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


def test_graceful_stop_returns_in_flight_work_without_counting_it(farm):
    ids = farm.enqueue({"data": 1}, {"data": 2})
    farm.ready(1, "")
    farm.ready(2, "")
    farm.dispatch(1, 2)
    with farm.store.transaction() as tx:
        assert sorted(requeue_in_flight(tx, earlier_incarnations=False)) == ids
    assert rows(farm, dispatches) == [] and rows(farm, leases) == []
    assert [(t.state, t.attempts) for t in rows(farm, tasks)] == [("queued", 0)] * 2
    assert queue_order(farm) == ids


def test_graceful_stop_charges_the_attempt_of_a_worker_known_to_be_gone(farm):
    """A dead worker's task may be what killed it: a stop must not requeue it for free (a
    poison task would otherwise loop across resumes), while the live ranks' tasks are not
    charged. A live rank whose READY was seen ends idle; one still running stays busy (its STOP
    waits for its READY)."""
    ids = farm.enqueue({"data": 1}, {"data": 2}, {"data": 3})
    for r in (1, 2, 3):
        farm.ready(r, "")
    sent = farm.dispatch(1, 2, 3)
    farm.ready(1, sent[1])  # its RESULT never came
    with farm.store.reading() as conn:
        task_of = dict(conn.execute(select(dispatches.c.rank, dispatches.c.task_id)).all())
    with farm.store.transaction() as tx:
        assert sorted(requeue_in_flight(tx, earlier_incarnations=False,
                                        charged_ranks={2})) == ids
    attempts = {t.id: t.attempts for t in rows(farm, tasks)}
    assert [attempts[task_of[r]] for r in (1, 2, 3)] == [0, 1, 0]
    assert [t.state for t in rows(farm, tasks)] == ["queued"] * 3
    state = {w.rank: w.state for w in rows(farm, workers)}
    assert (state[1], state[3]) == ("idle", "busy")
    kinds = [(e.rank, e.token, e.detail) for e in rows(farm, events)
             if e.kind == "stop_requeued"]
    assert sorted(kinds) == [(1, sent[1], None), (2, sent[2], "worker gone"),
                             (3, sent[3], None)]


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
    assert ev.detail.startswith("from done: its error result discarded")
    assert queue_order(farm) == [bad_id]


def test_a_known_payload_with_other_bytes_is_not_added_and_leaves_no_blob(farm):
    """A task is its semantic payload: the same path with another input file is the same task
    (not run twice), and its bytes must not be stored as a blob nothing refers to."""
    first = farm.enqueue({"path": "seed/a"}, input_bytes=b"one")
    assert farm.enqueue({"path": "seed/a"}, input_bytes=b"two") == []
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM blobs").scalar() == 1
    assert [t.id for t in rows(farm, tasks)] == first


def test_cli_requeue_goes_in_short_chunks_in_id_order(db_path, monkeypatch, capsys):
    """One transaction of 100,000 tasks held the write lock for 30 s, and a master running on
    the campaign gave up waiting for it (database is locked) and died. Chunks of
    REQUEUE_CHUNK tasks each commit on their own; the queue order is still the id order."""
    import sqlite3

    from coordinator import commands
    from coordinator.cli import main
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(10)))
    farm.close()
    with sqlite3.connect(db_path) as c:
        c.execute("UPDATE tasks SET state = 'deferred', reason = 'test'")
    monkeypatch.setattr(commands, "REQUEUE_CHUNK", 3)
    assert main(["requeue", "--db", str(db_path), "--state", "deferred"]) == 0
    assert capsys.readouterr().out == f"requeued 10 task(s): {', '.join(map(str, ids))}\n"
    with sqlite3.connect(db_path) as c:
        order = [r[0] for r in c.execute(
            "SELECT id FROM tasks WHERE state = 'queued' ORDER BY queue_pos, id")]
        commits = c.execute("SELECT count(DISTINCT at) FROM events "
                            "WHERE kind = 'manual_requeue'").fetchone()[0]
    assert order == ids
    assert commits == 4  # 3 + 3 + 3 + 1
    # an id that is not there (or not in that state) is named, not passed over in silence
    assert main(["requeue", "--db", str(db_path), "--id", str(ids[0]), "--id", "9999"]) == 0
    out = capsys.readouterr()
    assert out.out == "requeued 0 task(s)\n"
    assert out.err == (f"coordinator: not requeued (no such task, or not failed or deferred): "
                       f"{ids[0]}, 9999\n")


def test_cli_requeue_of_many_tasks_prints_runs_of_ids_not_every_id(db_path, capsys):
    """50,000 requeued tasks printed one console line of 400 KB, every id in it."""
    import sqlite3

    from coordinator.cli import main
    from coordinator.commands import id_list
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(60)))
    farm.close()
    with sqlite3.connect(db_path) as c:
        c.execute("UPDATE tasks SET state = 'deferred', reason = 'test'")
    assert main(["requeue", "--db", str(db_path), "--state", "deferred"]) == 0
    assert capsys.readouterr().out == f"requeued 60 task(s): {ids[0]}-{ids[-1]}\n"
    assert id_list([1, 2, 3]) == "1, 2, 3"
    assert id_list([*range(1, 100, 2), 200, 201, 202], whole_up_to=3, runs_shown=3) == \
        "1, 3, 5, ... and 48 more runs of ids"
    assert id_list([59, *range(1, 59)], runs_shown=3) == "1-59"


def test_status_groups_held_tasks_by_their_reason(db_path, tmp_path):
    from store.stats import held_reasons
    farm = Farm(db_path)
    for i in range(3):
        defer(farm, {"data": i})
    with farm.store.reading() as conn:
        [(reason, n)] = held_reasons(conn)["deferred"]
        assert n == 3 and reason
        assert "failed" not in held_reasons(conn)
    farm.close()


def test_dropped_test_cases_are_counted_in_status(db_path, capsys):
    """A run whose outputs were over the executor's limits said so only in its result's
    detail; the count is a column that `status` and its JSON sum."""
    from coordinator.cli import main
    farm = Farm(db_path)
    farm.enqueue({"data": 1}, {"data": 2}, {"data": 3})
    farm.ready(1), farm.ready(2), farm.ready(3)
    tokens = farm.dispatch(1, 2, 3)
    farm.result_raw(1, {"token": tokens[1], "status": "ok", "dropped": 2000,
                        "detail": "dropped 2000 of 3000 output files (0 over 1 bytes; ...)"})
    farm.result_raw(2, {"token": tokens[2], "status": "ok", "dropped": 5})
    farm.result_raw(3, {"token": tokens[3], "status": "ok"})
    farm.close()
    assert main(["status", "--db", str(db_path)]) == 0
    assert "dropped test cases: 2005 in 2 results" in capsys.readouterr().out
    assert main(["status", "--db", str(db_path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["dropped_testcases"], got["dropped_results"]) == (2005, 2)
