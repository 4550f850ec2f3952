"""The user's scenarios (seed note §7) against a real campaign file: the join, the rollback,
the retry policy, payload identity and the stats text."""

from __future__ import annotations

import dataclasses
import sqlite3

import pytest
from conftest import Farm, fail_once, rows, snapshot, started, task_state, worker_state
from sqlalchemy import select

from coordinator.gate import Inbound
from coordinator.protocol import ReadyStatus, ResultStatus
from coordinator.wire import DETAIL_MAX_CHARS, detail_summary, failure_detail
from store import dispatches as dsp
from store.journal import RetryPolicy
from store.schema import (
    TaskState,
    WorkerState,
    dispatches,
    events,
    leases,
    results,
    tasks,
    workers,
)
from store.semantic import PayloadError, normalize, semantic_id
from store.stats import read_stats, stats_text
from store.workers import set_workers

# -- the join (R2-R5) ------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["ready_first", "result_first"])
def test_valid_result_commits_in_either_order(farm, order):
    tid, tok = started(farm)
    if order == "ready_first":
        farm.ready(1, tok)
        assert worker_state(farm, 1) == "busy"  # current READY alone does not free the rank
        farm.result(1, tok)
    else:
        farm.result(1, tok)
        assert worker_state(farm, 1) == "busy"  # waits for its READY
        farm.ready(1, tok)
    assert task_state(farm, tid) == "done"
    assert worker_state(farm, 1) == "idle"
    assert rows(farm, dispatches) == [] and rows(farm, leases) == []
    assert [r.token for r in rows(farm, results)] == [tok]


@pytest.mark.parametrize("order", ["ready_first", "result_first"])
def test_invalid_result_joined_with_ready_recovers_in_either_order(farm, order):
    tid, tok = started(farm)
    steps = [lambda: farm.ready(1, tok), lambda: farm.result(1, None)]
    for step in steps if order == "ready_first" else steps[::-1]:
        step()
    [rec] = farm.sweep()
    assert (rec.rank, rec.token, rec.task_id, rec.outcome) == (1, tok, tid, TaskState.QUEUED)
    assert task_state(farm, tid) == "queued"
    assert worker_state(farm, 1) == "idle"
    assert rows(farm, dispatches) == [] and rows(farm, leases) == []


def test_late_valid_result_cancels_the_recovery(farm):
    """RESULT(invalid) then RESULT(valid) drained before the sweep: the valid one commits."""
    tid, tok = started(farm)
    farm.ready(1, tok)
    farm.result(1, "not-a-token")      # malformed -> invalid mark
    out = farm.result(1, tok)          # late valid current RESULT (R5)
    assert out.statuses == [(1, ResultStatus.CURRENT)]
    assert farm.sweep() == []
    assert task_state(farm, tid) == "done"
    assert len(rows(farm, results)) == 1


@pytest.mark.parametrize("case", ["ready_alone", "invalid_alone", "stale_result_current_ready",
                                  "stale_ready_current_invalid"])
def test_these_never_recover(farm, case):
    tid, tok = started(farm)
    old = "ab" * 32
    if case == "ready_alone":
        farm.ready(1, tok)
    elif case == "invalid_alone":
        farm.result(1, [tok])
    elif case == "stale_result_current_ready":
        farm.result(1, old)
        farm.ready(1, tok)
    else:
        farm.ready(1, old)
        farm.result(1, None)
    before = snapshot(farm)
    assert farm.sweep() == []
    assert snapshot(farm) == before
    assert task_state(farm, tid) == "active"


def test_stale_result_does_not_mark_the_current_dispatch(farm):
    _, tok = started(farm)
    farm.result(1, "cd" * 32)
    [d] = rows(farm, dispatches)
    assert d.token == tok and d.invalid_reason is None


def test_invalid_payload_of_a_current_result_sets_the_mark(farm):
    _, tok = started(farm)
    out = farm.result(1, tok, status="bogus")
    assert out.statuses == [(1, ResultStatus.CURRENT)] and out.committed == []
    [d] = rows(farm, dispatches)
    assert d.invalid_reason == "payload"
    farm.ready(1, tok)
    assert len(farm.sweep()) == 1


def test_duplicate_result_after_commit_is_quarantined_unowned(farm):
    _, tok = started(farm)
    farm.result(1, tok)
    out = farm.result(1, tok)
    assert out.statuses == [(1, ResultStatus.UNOWNED)]
    assert len(rows(farm, results)) == 1


# -- READY classification against the store ----------------------------------------------

def test_ready_statuses_and_their_effects(db_path):
    farm = Farm(db_path)
    with farm.store.transaction() as tx:  # the master's bitmap is at version 3
        tx.conn.execute(tasks.metadata.tables["campaign"].update().values(bitmap_version=3))
    farm.close()
    farm = Farm(db_path, resume=True)
    assert farm.store.bitmap_version == 3
    assert farm.ready(1, "", bitmap_version=2).statuses == [(1, ReadyStatus.IDLE)]
    assert rows(farm, workers)[0].bitmap_version == 2
    assert farm.ready(2, "", bitmap_version=9).statuses == [(2, ReadyStatus.IDLE)]  # future
    assert rows(farm, workers, workers.c.rank == 2)[0].bitmap_version == -1
    farm.ready(2, "", bitmap_version=True)
    assert rows(farm, workers, workers.c.rank == 2)[0].bitmap_version == -1
    farm.enqueue({"data": "x"})
    tok = farm.dispatch(1)[1]
    before = snapshot(farm)
    cases = [({"completed_dispatch_token": ""}, ReadyStatus.MISSING),
             ({"completed_dispatch_token": [tok]}, ReadyStatus.MALFORMED),
             ({"completed_dispatch_token": tok.upper()}, ReadyStatus.MALFORMED),
             ({"completed_dispatch_token": "ef" * 32}, ReadyStatus.STALE)]
    for body, status in cases:
        body = {"bitmap_version": 0, "empirical_profile_version": "x", **body}
        assert farm.ready_raw(1, body).statuses == [(1, status)]
    assert farm.ready_raw(1, ["not", "a", "mapping"]).statuses == [(1, ReadyStatus.MALFORMED)]
    assert snapshot(farm) == before  # no version, idle-set or dispatch change
    assert farm.ready(1, tok).statuses == [(1, ReadyStatus.CURRENT)]
    farm.close()


def test_unowned_ready_is_quarantined_and_visible(farm):
    tid, tok = started(farm)
    with farm.store.transaction() as tx:  # break an invariant behind the protocol's back
        tx.conn.execute(tasks.update().where(tasks.c.id == tid).values(state="failed"))
    assert farm.ready(1, tok).statuses == [(1, ReadyStatus.UNOWNED)]
    with farm.store.reading() as conn:
        s = read_stats(conn)
    assert s.quarantine["ready"] == {"unowned": 1}


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
    with pytest.raises(RuntimeError):
        with farm.store.transaction() as tx:
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


# -- retry policy (R7, R8) ---------------------------------------------------------------

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


def test_the_default_ceiling_leaves_the_whole_budget_usable(db_path):
    """`--retries 16` means 16 immediate requeues: the default ceiling follows the budget
    (then three deferrals, then failed), instead of a fixed 5 that cut the budget at 4."""
    policy = RetryPolicy(retries=16)
    assert (policy.max_attempts, RetryPolicy().max_attempts) == (20, 5)
    farm = Farm(db_path, policy=policy)
    [tid] = farm.enqueue({"data": 1})
    outcomes = [fail_once(farm)[0].outcome for _ in range(17)]
    assert outcomes == [TaskState.QUEUED] * 16 + [TaskState.DEFERRED]
    t = rows(farm, tasks, tasks.c.id == tid)[0]
    assert (t.state, t.attempts, t.budget_used) == ("deferred", 17, 17)
    farm.close()


@pytest.mark.parametrize("bad", [-1, 17, True, "1"])
def test_retry_budget_range(bad):
    with pytest.raises(ValueError, match="0..16"):
        RetryPolicy(retries=bad)


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
    with farm.store.reading() as conn:
        s = read_stats(conn)
    assert s.deferred == 0 and s.events["defer_failed"] == 1


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


def test_a_parked_rank_echoing_twice_in_one_round_is_recovered_once(farm):
    """Two READYs echoing the retired token in the same batch: the rank comes back once
    (the second is an idle READY), so `watchdog_recoveries` counts one recovery."""
    farm.enqueue({"data": 1})
    farm.ready(1, "")
    tok = farm.dispatch(1, deadline_s=-1)[1]  # already past its deadline
    with farm.store.transaction() as tx:
        [rec] = farm.gate.watchdog(tx)
    assert worker_state(farm, 1) == "parked" and rec.token == tok
    body = {"rank": 1, "bitmap_version": 0, "empirical_profile_version": "",
            "completed_dispatch_token": tok}
    with farm.store.transaction() as tx:
        out = farm.gate.apply_ready(tx, [Inbound(1, body), Inbound(1, dict(body))])
    assert out.recovered_workers == [1]
    assert worker_state(farm, 1) == "idle"
    with farm.store.reading() as conn:
        assert read_stats(conn).watchdog_recoveries == 1


@pytest.mark.parametrize("parsed, detail", [
    ({"status": "ok", "detail": "warnings on stderr", "returncode": 0}, None),
    ({"status": "error", "detail": "target exited with status 3\nboom", "returncode": 3},
     "target exited with status 3\nboom"),
    ({"status": "error", "detail": "", "returncode": 3}, "exit status 3"),
    ({"status": "error", "detail": "", "returncode": None}, None),
    ({"status": "error", "detail": "x" * 5000}, "x" * DETAIL_MAX_CHARS),
    # an ok result keeps only the note of output files dropped over the executor's limits
    ({"status": "ok", "detail": "warn\ndropped 500 of 1500 output files (limits: ...)"},
     "dropped 500 of 1500 output files (limits: ...)"),
    ({"status": "ok", "detail": "dropped 3 packets (the target's own stderr)"}, None),
])
def test_failure_detail_is_kept_for_non_ok_results_only(parsed, detail):
    assert failure_detail(parsed) == detail


@pytest.mark.parametrize("detail, line", [
    # how the command ended, and its last word, not the dropped-files note after them
    ("exited with status 3\ntarget: bad input\ndropped 1 of 2 output files (1 over 10 "
     "bytes; limits: ...)", "exited with status 3 … target: bad input"),
    ("exited with status 3\ndropped 1 of 2 output files (...)", "exited with status 3"),
    ("ValueError: no\nTraceback (most recent call last):\n  File x\nValueError: no",
     "ValueError: no"),
    ("", "(no detail)"), (None, "(no detail)"),
    ("a" * 150 + "\n" + "b" * 150, "a" * 150 + " … " + "b" * 46 + "…"),
])
def test_status_shows_the_first_and_last_own_line_of_a_failure(detail, line):
    assert detail_summary(detail) == line


# -- payload identity (R7, §4) -------------------------------------------------------------

FULL = {"path": "/q/id:000001", "focus_bytes": [3, 1, 4], "target_branch": 2**63,
        "s2f_actions": [[7, "skip"], [2, "solve"]], "schedule_prefix": [5, 0, 5],
        "continuation": {"kind": "resume", "state": {"depth": 2}}}


def test_payload_round_trips_through_the_store(farm):
    [tid] = farm.enqueue(FULL)
    with farm.store.transaction() as tx:
        from store.tasks import get_task
        rec = get_task(tx, tid)
    assert rec.payload == normalize(FULL)
    assert rec.payload["s2f_actions"] == [[2, "solve"], [7, "skip"]]
    assert rec.payload["focus_bytes"] == [3, 1, 4]
    assert rec.semantic_id == semantic_id(FULL)


def test_identity_ignores_key_order_and_tokens_and_defaults(farm):
    reordered = dict(reversed(list(FULL.items())))
    assert semantic_id(reordered) == semantic_id(FULL)
    assert semantic_id({"path": "p", "target_branch": 0}) == semantic_id({"path": "p"})
    assert semantic_id({"path": "p", "target_branch": 2**64}) == semantic_id({"path": "p"})
    assert farm.enqueue(FULL, reordered) == [1]  # the same payload twice is one task
    # ... at every depth: a continuation or data mapping in another key order too
    nested = {"path": "p", "continuation": {"a": 1, "b": {"x": 2, "y": 3}},
              "data": {"m": 1, "n": 2}}
    renested = {"data": {"n": 2, "m": 1}, "continuation": {"b": {"y": 3, "x": 2}, "a": 1},
                "path": "p"}
    assert semantic_id(renested) == semantic_id(nested)
    farm.ready(1, "")
    assert farm.dispatch(1)  # a token now exists for it; the stored identity is unchanged
    assert rows(farm, tasks)[0].semantic_id == semantic_id(FULL)
    with pytest.raises(PayloadError, match="unknown"):
        semantic_id({**FULL, "token": "ab" * 32})


@pytest.mark.parametrize("bad, match", [
    ({}, "path"), ({"path": 3}, "path"), ({"path": "p", "focus_bytes": [-1]}, ">= 0"),
    ({"path": "p", "s2f_actions": [[1, "solve"], [1, "skip"]]}, "twice"),
    ({"path": "p", "s2f_actions": [[1, "fly"]]}, "solve"),
    ({"path": "p", "s2f_actions": [[i, "skip"] for i in range(65)]}, "at most 64"),
    ({"data": float("nan")}, "JSON"), ({"path": "p", "continuation": []}, "mapping"),
    ({"path": "id:000001,\udcff"}, "not valid Unicode"),  # a name that was not UTF-8
])
def test_bad_payloads_are_refused_clearly(bad, match):
    with pytest.raises(PayloadError, match=match):
        normalize(bad)


# -- stats text (R10) --------------------------------------------------------------------

def test_stats_text_labels(farm):
    for p in ({"data": 1}, {"data": 2}):
        farm.enqueue(p)
    farm.ready(1, "")
    farm.ready(2, "")
    toks = farm.dispatch(1, 2)
    old = "12" * 32
    farm.ready_raw(1, "garbage")                       # ready malformed
    farm.ready(2, old)                                 # ready stale
    farm.result(1, [toks[1]])                          # result malformed
    farm.result(2, old)                                # result stale
    farm.result(1, "34" * 32)                          # result stale
    farm.ready(1, toks[1])
    farm.sweep()                                       # rank 1: joined -> requeued
    farm.dispatch(1)
    with farm.store.reading() as conn:
        text = stats_text(read_stats(conn))
    assert "Quarantined worker ready messages: 2 (malformed=1,stale=1)\n" in text
    assert "Quarantined worker results: 3 (malformed=1,stale=2)\n" in text
    assert "Protocol-requeued dispatches: 1\n" in text
    assert "Protocol-deferred dispatches: 0\n" in text
    assert "Dispatch watchdog timeouts: 0\n" in text


def test_stats_text_sorts_the_reasons_whatever_order_they_come_in():
    """R10: reasons sorted, joined by commas without spaces (the store's GROUP BY happens to
    return them sorted through its index; the text must not depend on that)."""
    from store.stats import Stats
    s = Stats(tasks={}, results=0, quarantine={"result": {"stale": 1, "malformed": 2},
                                               "ready": {"unowned": 3, "missing": 4}},
              requeued=0, deferred=0, watchdog_timeouts=0, watchdog_recoveries=0,
              incarnation=1, schema_revision=None)
    text = stats_text(s)
    assert "Quarantined worker results: 3 (malformed=2,stale=1)\n" in text
    assert "Quarantined worker ready messages: 7 (missing=4,unowned=3)\n" in text


def test_with_ready_mark_changes_only_the_mark():
    # Spelled out for speed; it must stay what dataclasses.replace would give, field by field.
    a = dsp.ActiveDispatch("t" * 64, 3, 7, 2, True, False, "payload", 12.5, False)
    assert a.with_ready_mark() == dataclasses.replace(a, ready=True)


def test_set_workers_updates_known_ranks_and_creates_unknown_ones(farm):
    farm.ready(1, "")
    farm.ready(2, "")
    before = {r.rank: r.state for r in rows(farm, workers)}
    assert before == {1: "idle", 2: "idle"}
    new_rank = 7
    known = [1]  # one statement for a batch that mixes a known rank and a new one
    with farm.store.transaction("test") as tx:
        set_workers(tx, [(r, WorkerState.FAILED) for r in known] + [(new_rank, WorkerState.BUSY)])
    after = {r.rank: r.state for r in rows(farm, workers)}
    assert after == {**before, **{r: "failed" for r in known}, new_rank: "busy"}
    with farm.store.transaction("test") as tx:  # now every rank is known: UPDATE only
        set_workers(tx, [(new_rank, WorkerState.IDLE)])
    assert {r.rank: r.state for r in rows(farm, workers)}[new_rank] == "idle"


@pytest.mark.parametrize("field, held_value, free_value", [
    ("target_branch", 5, 6),          # skipped in SQL already
    ("schedule_prefix", [1, 2], [3]),  # only by the lease check: read past several windows
])
def test_tasks_waiting_on_a_lease_are_skipped_past_the_first_window(farm, field, held_value,
                                                                     free_value):
    """take_queued reads the queue a window of rows at a time: more waiting tasks than one
    window holds must not hide the dispatchable ones behind them, nor lose their places."""
    held, _ = started(farm, {"path": "/seed/held", field: held_value})
    waiting = farm.enqueue(*({"path": f"/seed/w{i}", field: held_value} for i in range(100)))
    free = farm.enqueue({"path": "/seed/free1"}, {"path": "/seed/free2", field: free_value},
                        {"path": "/seed/free3", field: free_value})
    farm.ready(2, "")
    farm.ready(3, "")
    farm.ready(4, "")
    got = farm.dispatch(2, 3, 4)
    assert sorted(got) == [2, 3]  # free3 waits: free2 took target 6 in the same plan
    with farm.store.reading() as conn:
        active = {r.task_id for r in conn.execute(select(dispatches.c.task_id))}
    assert active == {held, *free[:2]}
    assert all(task_state(farm, t) == "queued" for t in waiting + free[2:])


# -- one round's row changes, written together (dispatches._Pending) ----------------------------

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
