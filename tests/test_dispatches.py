"""`store.dispatches` on real campaign files: the fenced rollback and the pre-send rewind, the
retry policy's fallback when a deferral cannot be written (R8), and one round's row changes
written together."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest
from conftest import Farm, fail_once, queue_order, rows, snapshot, started, worker_state
from sqlalchemy import select

from coordinator.gate import Inbound
from coordinator.protocol import ReadyStatus
from store import dispatches as dsp
from store.dispatches import requeue_in_flight
from store.schema import TaskState, dispatches, events, leases, results, tasks, workers
from store.stats import read_stats

# -- rollback (R6, R7) -------------------------------------------------------------------

def test_stale_token_rollback_changes_no_row(farm):
    from store.dispatches import recover_dispatch
    _, tok = started(farm)
    farm.ready(1, tok)
    before = snapshot(farm)
    with farm.store.transaction() as tx:
        assert recover_dispatch(tx, 1, "99" * 32) is None
        assert recover_dispatch(tx, 2, tok) is None  # right token, wrong rank
    assert snapshot(farm) == before


def test_current_token_rollback_removes_everything_in_one_transaction(farm):
    from store.dispatches import recover_dispatch
    tid, tok = started(farm, {"path": "/seed/b", "target_branch": 9,
                              "schedule_prefix": [1, 2]})
    farm.enqueue({"path": "/seed/c", "target_branch": 9})  # waits: target 9 is leased
    # target and schedule (the task itself is reserved by its dispatch row)
    assert sorted(r.kind for r in rows(farm, leases)) == ["schedule", "target"]
    assert farm.dispatch(2) == {}
    farm.ready(1, tok)
    farm.result(1, None)
    with farm.store.transaction() as tx:
        rec = recover_dispatch(tx, 1, tok)
    assert rec is not None and rec.outcome is TaskState.QUEUED
    assert rows(farm, dispatches) == [] and rows(farm, leases) == []
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (t.state, t.attempts, t.dispatches) == ("queued", 1, 1)
    # requeued at the head, ahead of the task that waited behind it
    farm.ready(2, "")
    assert 2 in farm.dispatch(2)
    assert rows(farm, dispatches, dispatches.c.rank == 2)[0].task_id == tid


def test_rollback_is_atomic_when_the_transaction_fails(farm):
    from store.dispatches import recover_dispatch
    _, tok = started(farm)
    farm.ready(1, tok)
    before = snapshot(farm)
    with pytest.raises(RuntimeError), farm.store.transaction() as tx:
        assert recover_dispatch(tx, 1, tok) is not None
        raise RuntimeError("crash before COMMIT")
    assert snapshot(farm) == before


def test_pre_send_compensation_rewinds_exactly(farm):
    from store.dispatches import cancel_dispatch, mark_sent
    tid, tok = started(farm)
    with farm.store.transaction() as tx:
        assert cancel_dispatch(tx, 1, tok, detail="send failed")
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (t.state, t.attempts, t.dispatches) == ("queued", 0, 0)
    assert rows(farm, dispatches) == [] and rows(farm, leases) == []
    tok2 = farm.dispatch(1)[1]
    with farm.store.transaction() as tx:
        mark_sent(tx, [tok2])
        assert not cancel_dispatch(tx, 1, tok2)  # after the send it is no longer pre-send


# -- a deferral that cannot be written (R8) ------------------------------------------------

def test_failed_deferral_leaves_the_task_queued_and_reported(farm):
    """R8 with a real failing write: the database itself refuses the deferral."""
    [tid] = farm.enqueue({"data": 1})
    fail_once(farm)
    with sqlite3.connect(farm.path) as c:
        c.execute("CREATE TRIGGER refuse_defer BEFORE UPDATE OF state ON tasks "
                  "WHEN NEW.state = 'deferred' BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    [rec] = fail_once(farm)
    assert rec.defer_failed and rec.outcome is TaskState.QUEUED
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert t.state == "queued" and "deferral failed" in t.reason
    assert t.attempts == 2  # the failure is counted all the same
    with farm.store.reading() as conn:
        s = read_stats(conn)
    assert s.deferred == 0 and s.events["defer_failed"] == 1
    # Healed: the next failure is deferred as the policy says.
    with sqlite3.connect(farm.path) as c:
        c.execute("DROP TRIGGER refuse_defer")
    [rec] = fail_once(farm)
    assert rec.outcome is TaskState.DEFERRED and not rec.defer_failed
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (t.state, t.attempts) == ("deferred", 3)


def test_failed_deferral_puts_the_task_back_at_the_head(farm):
    """R8's fallback keeps the task *queued at the head*, not where it stood before: here
    other tasks were requeued in front of its old place meanwhile, and must not stay there."""
    a, b, c = farm.enqueue({"data": "a"}, {"data": "b"}, {"data": "c"})
    fail_once(farm, rank=1)  # a: first failure, requeued at the head
    farm.ready(1, "")
    tok_a = farm.dispatch(1)[1]
    farm.ready(2, "")
    farm.ready(3, "")
    tokens = farm.dispatch(2, 3)
    for rank in (3, 2):  # c, then b fail once: each requeued at the head, b first
        farm.result(rank, None)
        farm.ready(rank, tokens[rank])
        farm.sweep()
    with sqlite3.connect(farm.path) as db:
        db.execute("CREATE TRIGGER refuse_defer BEFORE UPDATE OF state ON tasks "
                  "WHEN NEW.state = 'deferred' BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    farm.result(1, None)  # a's second failure: deferral refused, so queued at the head
    farm.ready(1, tok_a)
    [rec] = farm.sweep()
    assert rec.defer_failed and rec.outcome is TaskState.QUEUED
    with farm.store.reading() as conn:
        order = [r.id for r in conn.execute(select(tasks.c.id).where(
            tasks.c.state == "queued").order_by(tasks.c.queue_pos, tasks.c.id))]
    assert order == [a, b, c]


# -- one round's row changes, written together (dispatches._Pending) ----------------------------

def test_with_ready_mark_changes_only_the_mark():
    # Spelled out for speed; it must stay what dataclasses.replace would give, field by field.
    a = dsp.ActiveDispatch("t" * 64, 3, 7, 2, True, False, "payload", 12.5, False)
    assert a.with_ready_mark() == dataclasses.replace(a, ready=True)


def _ready_body(rank: int, token: str) -> dict:
    return {"rank": rank, "bitmap_version": 0, "empirical_profile_version": "",
            "completed_dispatch_token": token}


def _statements(farm: Farm, round_) -> list[str]:
    """The SQL one master round (`round_(tx)`, one transaction) sends to SQLite."""
    sent: list[str] = []
    with farm.store.transaction() as tx:
        raw = tx.raw_db
        raw.set_trace_callback(sent.append)
        try:
            round_(tx)
            tx.flush()
        finally:
            raw.set_trace_callback(None)
    return sent


def test_a_round_writes_its_sends_marks_and_commits_in_one_statement_each(farm):
    """Two ranks, each with its WORK sent last round, answer in two batches (READY then
    RESULT, as the master applies them): their commits are written together, carrying the
    send and READY times into the results rows; no UPDATE marks a dispatch the round deletes."""
    farm.enqueue({"path": "/seed/a"}, {"path": "/seed/b"})
    farm.ready(1, "")
    farm.ready(2, "")
    toks = farm.dispatch(1, 2)

    def round_(tx):
        dsp.mark_sent(tx, toks.values())
        active = None
        for rank in (1, 2):  # one batch per rank
            ready = farm.gate.apply_ready(tx, [Inbound(rank, _ready_body(rank, toks[rank]))],
                                          active=active)
            assert ready.statuses == [(rank, ReadyStatus.CURRENT)]
            active = farm.gate.apply_results(tx, [Inbound(rank, {"token": toks[rank],
                                                                 "status": "ok"})],
                                             active=ready.active).active

    sql = _statements(farm, round_)
    assert [s.split(" (")[0] for s in sql if s.startswith("INSERT INTO results")] == \
        ["INSERT INTO results"] * 2  # (one executemany: one trace line per row)
    assert not [s for s in sql if s.startswith("UPDATE dispatches")]
    rs = rows(farm, results)
    assert {r.token for r in rs} == set(toks.values())
    assert all(r.sent_at is not None and r.ready_at is not None and r.dispatched_at
               for r in rs)
    assert rows(farm, dispatches) == []
    assert (worker_state(farm, 1), worker_state(farm, 2)) == ("idle", "idle")


def test_a_ready_after_its_result_in_the_same_round_still_frees_the_rank(farm):
    """The commit is pending when the READY comes (classified idle: the dispatch is gone);
    the rank's `busy` from the commit is written before the READY's `idle`, not after."""
    _, tok = started(farm)

    def round_(tx):
        rr = farm.gate.apply_results(tx, [Inbound(1, {"token": tok, "status": "ok"})])
        ready = farm.gate.apply_ready(tx, [Inbound(1, _ready_body(1, tok))], active=rr.active)
        assert ready.statuses == [(1, ReadyStatus.IDLE)]

    _statements(farm, round_)
    [r] = rows(farm, results)
    assert r.token == tok and r.ready_at is None  # READY came after the commit
    assert worker_state(farm, 1) == "idle"


def test_a_rollback_in_the_round_sees_the_pending_ready_mark(farm):
    """A READY's mark still pending when the same round rolls its dispatch back (an invalid
    RESULT, then the sweep): the rollback reads it (the rank is free, not parked)."""
    _, tok = started(farm)

    def round_(tx):
        ready = farm.gate.apply_ready(tx, [Inbound(1, _ready_body(1, tok))])
        farm.gate.apply_results(tx, [Inbound(1, {"token": None, "status": "ok"})],
                                active=ready.active)
        [rec] = farm.gate.sweep(tx)
        assert rec.ready_seen and rec.token == tok

    _statements(farm, round_)
    assert rows(farm, dispatches) == [] and worker_state(farm, 1) == "idle"


# -- a graceful stop's requeue ---------------------------------------------------------------

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
