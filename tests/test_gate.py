"""The gate (`coordinator.gate`) against a real campaign file, the user's scenarios (seed note
§7): the join, READY and RESULT classification and what each status writes, the watchdog's
parked rank. (What the store's own modules do is in test_dispatches.py, test_tasks.py, ...)"""

from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import Farm, rows, snapshot, started, task_state, worker_state
from sqlalchemy import text

from coordinator.cooldown import HostCooldown
from coordinator.gate import NOT_CHARGED, STOP_NOT_CHARGED, Gate, Inbound
from coordinator.protocol import ReadyStatus, ResultStatus
from store import dispatches as dsp
from store.campaign import Store
from store.journal import RetryPolicy
from store.schema import (
    TaskState,
    dispatches,
    quarantine,
    results,
    tasks,
    workers,
)
from store.stats import read_stats
from store.tasks import NewTask, enqueue_tasks

POLICY = RetryPolicy(retries=1, max_attempts=4)
DEADLINE_S = 5.0
READY_KEY = "completed_dispatch_token"


# -- the join (R2-R5) ------------------------------------------------------------------------

def _run_order(path: Path, first: str, result_body) -> tuple[dict[str, Any], Counter[str],
                                                             list, str]:
    """One of two tasks dispatched to rank 1 (its WORK sent), its READY and the RESULT
    `result_body(token)` applied in the `first` order, then the sweep: the committed state,
    the event counts, the sweep's recoveries and the token. Neither message alone frees
    the rank."""
    farm = Farm(path, policy=POLICY)
    try:
        farm.enqueue({"path": "/seeds/one", "target_branch": 9}, {"path": "/seeds/two"})
        farm.ready(1)
        token = farm.dispatch(1, sent=True)[1]
        if first == "ready":
            farm.ready(1, token)
            assert worker_state(farm, 1) == "busy"  # a current READY alone does not free it
            farm.result_raw(1, result_body(token))
        else:
            farm.result_raw(1, result_body(token))
            assert worker_state(farm, 1) == "busy"  # it waits for its READY
            farm.ready(1, token)
        swept = farm.sweep()
        return farm.state(), farm.events(), swept, token
    finally:
        farm.close()


def test_ready_first_and_result_first_commit_the_same_state(tmp_path: Path):
    def ok(token: str) -> dict[str, Any]:
        return {"token": token, "status": "ok", "value": {"testcases": 3}}

    a, a_events, a_swept, a_token = _run_order(tmp_path / "ready_first.db", "ready", ok)
    b, b_events, b_swept, b_token = _run_order(tmp_path / "result_first.db", "result", ok)
    assert a == b
    assert a_events == b_events
    assert a_swept == b_swept == []
    # The only difference is when READY was seen: READY-first records the ready mark, which
    # the result keeps; RESULT-first committed already, so its READY is an idle READY.
    def committed(path: Path) -> list[tuple[str, bool]]:
        with sqlite3.connect(path) as c:
            return [(t, bool(r)) for t, r in c.execute(
                "SELECT token, ready_at IS NOT NULL FROM results")]
    assert committed(tmp_path / "ready_first.db") == [(a_token, True)]
    assert committed(tmp_path / "result_first.db") == [(b_token, False)]
    assert [s for _, s, *_ in a["tasks"]].count("done") == 1
    assert a["results"] and a["dispatches"] == [] and a["leases"] == []
    assert a["workers"] == [(1, "idle", None)]
    assert a["quarantine"] == []


@pytest.mark.parametrize("invalid", [
    {"status": "bogus"},                      # current token, payload fails validation
    {"status": "ok"},                         # token missing
    {"token": "NOT-A-TOKEN", "status": "ok"},  # token malformed
], ids=["payload", "missing", "malformed"])
def test_ready_first_and_invalid_result_first_recover_the_same_way(tmp_path: Path, invalid):
    def bad(token: str) -> dict[str, Any]:
        body = dict(invalid)
        if body.get("status") == "bogus":
            body["token"] = token
        return body

    a, a_events, a_swept, a_token = _run_order(tmp_path / "ready_first.db", "ready", bad)
    b, b_events, b_swept, b_token = _run_order(tmp_path / "result_first.db", "result", bad)
    assert a == b and a_events == b_events
    # The join recovered the dispatch: requeued at the head, attempt counted, rank idle.
    for [rec], token in ((a_swept, a_token), (b_swept, b_token)):
        assert (rec.rank, rec.token, rec.task_id, rec.outcome) == (1, token, 1, TaskState.QUEUED)
    assert a["dispatches"] == [] and a["leases"] == [] and a["results"] == []
    assert sorted((s, n) for _, s, n, *_ in a["tasks"]) == [("queued", 0), ("queued", 1)]
    assert a["workers"] == [(1, "idle", None)]
    assert a_events["recovered"] == 1 and a_events["requeued"] == 1


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
    """Only a current READY joined with the current dispatch's invalid mark rolls it back
    (R3): either half alone, or with a stale other half, leaves every row as it was."""
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
    # ... until the missing half comes: the current READY, or an invalid RESULT.
    if case in ("invalid_alone", "stale_ready_current_invalid"):
        farm.ready(1, tok)
    else:
        farm.result(1, None)
    [rec] = farm.sweep()
    assert rec.token == tok and task_state(farm, tid) == "queued"


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


def test_the_master_is_told_of_each_rank_rolled_back_for_its_own_invalid_result(farm):
    """`misbehaved` (the master pauses such a rank): told of the rank and what was quarantined
    at each sweep recovery of an invalid RESULT joined with its READY; not of a split the
    worker asked for (no failure), nor of a dispatch whose later valid RESULT committed."""
    from coordinator.wire import SPLIT_STATUS

    told: list[tuple[int, str]] = []
    farm.gate.misbehaved = lambda rank, why: told.append((rank, why))
    farm.enqueue(*({"path": f"/seeds/{i}"} for i in range(6)))
    farm.ready(1)
    for body in ({"status": "bogus"}, {"token": None}):
        tok = farm.dispatch(1, sent=True)[1]
        farm.result_raw(1, {"token": tok, **body} if "token" not in body else body)
        farm.ready(1, tok)
        assert len(farm.sweep()) == 1
    assert told == [(1, "payload"), (1, "missing")]
    [p] = farm.plan(1, batch=2, sent=True)
    farm.result_raw(1, {"token": p.token, "status": SPLIT_STATUS, "detail": "too big"})
    farm.ready(1, p.token)
    [rec] = farm.sweep()
    assert rec.halves is not None and len(told) == 2
    tok = farm.dispatch(1, sent=True)[1]
    farm.result(1, tok, status="bogus")
    farm.result(1, tok)  # R5: the valid one commits; nothing is rolled back
    farm.ready(1, tok)
    assert farm.sweep() == [] and len(told) == 2


def test_a_repeated_current_ready_is_told_apart_and_writes_nothing(farm):
    """An honest worker sends one READY per dispatch: the repeats (a rank buying good credit
    with the master's garbage watch) are listed apart, and write nothing."""
    _, tok = started(farm)
    first = farm.ready(1, tok)
    assert first.statuses == [(1, ReadyStatus.CURRENT)] and first.repeated == []
    with farm.store.transaction() as tx:
        again = farm.gate.apply_ready(tx, [Inbound(1, {
            "rank": 1, "bitmap_version": 0, "empirical_profile_version": "",
            READY_KEY: tok})] * 3)
    assert again.statuses == [(1, ReadyStatus.CURRENT)] * 3 and again.repeated == [1] * 3
    [d] = rows(farm, dispatches)
    assert d.token == tok and d.ready_at is not None


def test_a_flood_of_invalid_results_for_one_dispatch_writes_one_event_and_counts_all(farm):
    """One rank answering its WORK with 2,000 bad RESULTs of the current token wrote an
    `invalid` event per message (168,000 rows in 32 s). The first sets the mark and is the
    one event; the repeats add nothing to the join and are counted in the sampled quarantine,
    exactly. A later valid RESULT still clears the mark and commits (R5)."""
    tid, tok = started(farm)
    bad = [Inbound(1, {"token": tok, "status": "bogus"})] * 1_000
    with farm.store.transaction() as tx:
        out = farm.gate.apply_results(tx, [Inbound(1, {"token": None})] + bad)
    assert out.rejected == [1] * 1_000  # (what the master's watch counts as garbage)
    for _ in range(4):
        farm.result_raw(1, [tok])  # malformed: a third reason, in later transactions
    [d] = rows(farm, dispatches)
    assert d.token == tok and d.invalid_reason == "missing"  # the first one's
    ev = farm.events()
    assert ev["invalid"] == 1
    with farm.store.reading() as conn:
        [(token, detail)] = conn.execute(text(
            "SELECT token, detail FROM events WHERE kind = 'invalid'")).all()
        q = {r: (n, m) for r, n, m in conn.execute(text(
            "SELECT reason, count(*), sum(repeats) FROM quarantine GROUP BY reason"))}
        stats = read_stats(conn)
    assert (token, detail) == (tok, "missing")
    assert q == {"missing": (1, 1), "payload": (100, 1_000), "malformed": (4, 4)}
    assert stats.quarantine["result"] == {"missing": 1, "payload": 1_000, "malformed": 4}
    assert stats.events["invalid"] == 1
    farm.result(1, tok)  # R5
    assert task_state(farm, tid) == "done" and rows(farm, dispatches) == []
    assert farm.sweep() == [] and farm.events()["invalid"] == 1


def test_duplicate_result_after_commit_is_quarantined_unowned(farm):
    _, tok = started(farm)
    farm.result(1, tok)
    out = farm.result(1, tok)
    assert out.statuses == [(1, ResultStatus.UNOWNED)]
    assert len(rows(farm, results)) == 1


def _two_ranks_busy(farm: Farm) -> dict[int, str]:
    """Two tasks, ranks 1 and 2 idle, then each dispatched one: {rank: token}."""
    farm.enqueue({"path": "/seeds/one"}, {"path": "/seeds/two"})
    farm.ready(1)
    farm.ready(2)
    return farm.dispatch(1, 2, sent=True)


def test_only_an_accepted_result_sizes_the_batches(tmp_path: Path):
    """The sizes that automatic batches follow are the accepted RESULTs': a rank answering
    each WORK with a 62 MB invalid one, then a valid one, cut every rank's batches from 20
    tasks to about 2.6."""
    from coordinator.wire import Result, check_result, decode_result, encode

    farm = Farm(tmp_path / "c.db", policy=POLICY)
    farm.gate = Gate(farm.store, validate=check_result)
    try:
        _, tok = started(farm)
        bad = encode(Result(token=tok, status="bogus", value={"pad": "x" * 100_000}))
        good = encode(Result(token=tok, status="ok", value={"n": 0}))
        with farm.store.transaction() as tx:
            out = farm.gate.apply_results(tx, [Inbound(1, decode_result(m), m)
                                               for m in (bad, good)])
        assert out.rejected == [1] and len(out.committed) == 1
        assert out.sizes == [(1, len(good), 1)]
    finally:
        farm.close()


def test_a_result_value_that_is_not_json_is_an_invalid_payload_not_a_crash(tmp_path: Path):
    """msgpack decodes what JSON cannot store (bytes). With the master's wire validator such a
    current RESULT sets the invalid mark (reason payload); the other rank's commit in the same
    drain still happens."""
    from coordinator.wire import check_result

    farm = Farm(tmp_path / "c.db", policy=POLICY)
    farm.gate = Gate(farm.store, validate=check_result)
    try:
        tokens = _two_ranks_busy(farm)
        with farm.store.transaction() as tx:
            farm.gate.apply_results(tx, [
                Inbound(1, {"token": tokens[1], "status": "ok", "value": 1}),
                Inbound(2, {"token": tokens[2], "status": "ok", "value": b"\x00raw"}),
            ])
        s = farm.state()
        assert [r[1] for r in s["results"]] == [1]
        assert s["quarantine"] == [("result", "payload", 2)]
        assert s["dispatches"] == [(2, 2)]
    finally:
        farm.close()


@pytest.mark.parametrize("validator", ["default", "wire"])
def test_a_value_with_keys_of_mixed_types_is_an_invalid_payload_not_a_crash(tmp_path: Path,
                                                                           validator: str):
    """msgpack maps may mix int and str keys; JSON can hold them, but not in the sorted
    canonical form a result is stored in. Such a RESULT once passed validation and then raised
    TypeError inside the round's transaction (the master exited); whatever the validator, the
    gate now finds it before the commit."""
    from coordinator.wire import check_result

    farm = Farm(tmp_path / "c.db", policy=POLICY)
    if validator == "wire":
        farm.gate = Gate(farm.store, validate=check_result)
    try:
        tokens = _two_ranks_busy(farm)
        with farm.store.transaction() as tx:
            out = farm.gate.apply_results(tx, [
                Inbound(1, {"token": tokens[1], "status": "ok", "value": {"b": 1, "a": [2]}}),
                Inbound(2, {"token": tokens[2], "status": "ok", "value": {1: 0, "a": 0}}),
            ])
        assert [c.rank for c in out.committed] == [1]
        s = farm.state()
        assert [(r[1], r[3]) for r in s["results"]] == [(1, '{"a": [2], "b": 1}')]
        assert s["quarantine"] == [("result", "payload", 2)]
        assert s["dispatches"] == [(2, 2)]
    finally:
        farm.close()


def test_a_timeout_result_sends_the_task_to_the_retry_policy(tmp_path: Path):
    farm = Farm(tmp_path / "c.db", policy=POLICY)
    try:
        [tid] = farm.enqueue({"path": "/seeds/one"})
        farm.ready(1)
        token = farm.dispatch(1, sent=True)[1]
        farm.result_raw(1, {"token": token, "status": "timeout"})
        # Its READY not seen yet: the worker may still be busy with the run, so it is not
        # free for new WORK until that READY arrives.
        assert farm.state()["workers"] == [(1, "busy", None)]
        farm.ready(1, token)
        s = farm.state()
        assert [(t[1], t[2]) for t in s["tasks"]] == [("queued", 1)]
        assert s["results"] == [] and s["dispatches"] == []
        assert s["workers"] == [(1, "idle", None)]
        kinds = farm.events()
        assert kinds["task_failed"] == 1 and kinds["retried"] == 1 and kinds["requeued"] == 0
    finally:
        farm.close()


def test_a_task_its_host_could_not_run_is_retried_with_what_failed_not_committed(tmp_path):
    """`not_run` (the worker's disk full, no process to be had): never the task's result; the
    retry policy takes it, and its reason names the rank and what failed."""
    farm = Farm(tmp_path / "c.db", policy=POLICY)
    try:
        [tid] = farm.enqueue({"path": "/seeds/one"})
        farm.ready(1)
        token = farm.dispatch(1, sent=True)[1]
        farm.result_raw(1, {"token": token, "status": "not_run", "detail":
                            "cannot materialise input: [Errno 28] No space left on device\nx"})
        farm.ready(1, token)
        s = farm.state()
        # The budget charged (deferred past it), not the attempt ceiling (a broken host
        # would hold its tasks failed, which no --resume takes back).
        assert [(t[1], t[2]) for t in s["tasks"]] == [("queued", 0)]
        with farm.store.reading() as conn:
            assert conn.exec_driver_sql("SELECT budget_used FROM tasks").scalar() == 1
        assert s["results"] == [] and s["quarantine"] == []
        with farm.store.reading() as conn:
            [(why,)] = conn.exec_driver_sql(
                "SELECT detail FROM events WHERE kind = 'task_failed'").fetchall()
        assert why == ("not_run on rank 1: cannot materialise input: [Errno 28] No space left "
                       "on device (no READY)")
    finally:
        farm.close()


def test_a_host_known_to_fail_every_task_has_its_next_failures_charged_nothing(tmp_path):
    """With the master's cool-down (`coordinator.cooldown`) plugged in: a rank whose host
    failed one task, failing the next ones too while rank 2 runs tasks, charges them nothing:
    back at the head for a healthy rank, where they were deferred past the budget (one broken
    node deferred a healthy campaign's tasks one by one). Alone and in a batch."""
    farm = Farm(tmp_path / "c.db", policy=RetryPolicy(retries=0, max_attempts=4))
    cooldown = HostCooldown(lambda: [1, 2])
    farm.gate.host_ran = lambda tx, rank, unrun: cooldown.answered(rank, unrun is None)
    disk_full = "cannot materialise input: [Errno 28] No space left on device"
    try:
        first, second, *batch = farm.enqueue(*({"path": f"/seeds/{i}"} for i in range(5)))
        farm.ready(1)
        for _ in (first, second):
            token = farm.dispatch(1, sent=True)[1]
            farm.result_raw(1, {"token": token, "status": "not_run", "detail": disk_full})
            farm.ready(1, token)
        [p] = farm.plan(1, sent=True, batch=3)
        unrun = {"status": "not_run", "detail": disk_full}
        farm.result_raw(1, {"token": p.token, "status": "ok", "batch": [unrun] * 3})
        with farm.store.reading() as conn:
            got = conn.exec_driver_sql("SELECT id, state, attempts, budget_used, reason "
                                       "FROM tasks ORDER BY id").fetchall()
        why = f"not_run on rank 1: {disk_full}"
        # (the batch took the head: `second` again, back there uncharged)
        assert [tuple(r) for r in got] == [
            (first, "deferred", 0, 1, why),  # the first of the streak: charged, as before
            (second, "queued", 0, 0, why + NOT_CHARGED),
            *((t, "queued", 0, 0, why + NOT_CHARGED) for t in batch[:2]),
            (batch[2], "queued", 0, 0, None)]
        kinds = farm.events()
        assert kinds["task_failed"] == 5 and kinds["retried"] == 4
        assert kinds["task_deferred"] == 1
        assert farm.state()["results"] == []
    finally:
        farm.close()


@pytest.mark.parametrize("stopping", [False, True])
def test_a_run_the_jobs_stop_cut_short_is_retried_and_charged_only_outside_a_stop(
        tmp_path, stopping):
    """`interrupted`: the command was killed by the signal that stops the job, which its
    worker got too. Never a result; while the master stops (it got the signal as well) its
    tasks are charged nothing, alone and in a batch. Outside a stop (the master was not
    signalled: not a stop of the job) it is charged as a timeout, so a target that signals its
    own worker cannot run for ever."""
    farm = Farm(tmp_path / "c.db", policy=RetryPolicy(retries=3, max_attempts=4))
    farm.gate.stopping = lambda: stopping
    cut = {"status": "interrupted", "detail": "cut short by the job's stop: SIGTERM ..."}
    try:
        alone, *batch = farm.enqueue(*({"path": f"/seeds/{i}"} for i in range(3)))
        farm.ready(1)
        token = farm.dispatch(1, sent=True)[1]
        farm.result_raw(1, {"token": token, **cut})
        farm.ready(1, token)
        [p] = farm.plan(1, sent=True, batch=2)
        farm.result_raw(1, {"token": p.token, "status": "ok",
                            "batch": [cut, {"status": "ok", "value": 7}]})
        with farm.store.reading() as conn:
            got = conn.exec_driver_sql("SELECT id, state, attempts, budget_used, reason "
                                       "FROM tasks ORDER BY id").fetchall()
        charge, why = ((0, "interrupted" + STOP_NOT_CHARGED) if stopping
                       else (1, "interrupted"))
        # (the batch took the head: `alone`, cut short again, and the next task, done)
        assert [tuple(r) for r in got] == [(alone, "queued", 2 * charge, 2 * charge, why),
                                           (batch[0], "done", 0, 0, None),
                                           (batch[1], "queued", 0, 0, None)]
        assert len(farm.state()["results"]) == 1
    finally:
        farm.close()


def test_whether_the_master_stops_is_asked_only_of_runs_a_stop_cut_short(tmp_path):
    """The master may wait up to 2 s for its own stop signal when asked (an `interrupted` run
    can reach it before its signal). It was asked at every batch's RESULT: each run's first
    batch held the master 2 s, and the idle benchmark fell from 14,659 to 3,768 tasks/s."""
    farm = Farm(tmp_path / "c.db", policy=POLICY)
    asked = []
    farm.gate.stopping = lambda: asked.append(1) or False
    try:
        farm.enqueue(*({"path": f"/seeds/{i}"} for i in range(4)))
        farm.ready(1)
        [p] = farm.plan(1, sent=True, batch=2)
        farm.result_raw(1, {"token": p.token, "status": "ok", "batch": [
            {"status": "ok", "value": 1}, {"status": "timeout"}]})
        farm.ready(1, p.token)
        token = farm.dispatch(1, sent=True)[1]
        farm.result_raw(1, {"token": token, "status": "error", "detail": "exit 1"})
        assert asked == []
    finally:
        farm.close()


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


@pytest.mark.parametrize("bad, says", [
    ({"rank": 2}, "it says it is rank 2, and it came from rank 1"),
    ({"pid": 0}, "pid 0 is not a process id"),
    ({"host": "\x1b[2Jh"}, "is not a host name"),  # would clear `coordinator status`'s screen
])
def test_an_idle_ready_with_a_field_out_of_range_is_malformed_and_changes_no_worker(
        farm, bad, says):
    """A READY whose token passes but whose rank, pid or host no worker could report: the
    gate classifies it malformed (`ready_problem`) and quarantines it; the rank's row keeps
    what its last good READY said. Taken as an idle READY, it would have written another
    rank's claim, a pid no process has (one past the store's integers ended the master) or
    a host that drives the operator's terminal into the rank's row."""
    good = {"rank": 1, "bitmap_version": 0, "empirical_profile_version": "good",
            READY_KEY: "", "host": "node-a", "pid": 100}
    assert farm.ready_raw(1, good).statuses == [(1, ReadyStatus.IDLE)]
    forged = {**good, "empirical_profile_version": "forged", "host": "node-b", "pid": 4242,
              **bad}
    assert farm.ready_raw(1, forged).statuses == [(1, ReadyStatus.MALFORMED)]
    [q] = rows(farm, quarantine)
    assert (q.channel, q.reason, q.rank) == ("ready", "malformed", 1)
    assert says in q.detail, q.detail
    assert [(w.rank, w.state, w.profile_version, w.host, w.pid) for w in rows(farm, workers)
            ] == [(1, "idle", "good", "node-a", 100)]


def test_unowned_ready_is_quarantined_and_visible(farm):
    tid, tok = started(farm)
    with farm.store.transaction() as tx:  # break an invariant behind the protocol's back
        tx.conn.execute(tasks.update().where(tasks.c.id == tid).values(state="failed"))
    assert farm.ready(1, tok).statuses == [(1, ReadyStatus.UNOWNED)]
    with farm.store.reading() as conn:
        s = read_stats(conn)
    assert s.quarantine["ready"] == {"unowned": 1}


# -- the watchdog's parked rank -------------------------------------------------------------

def test_the_watchdog_counts_from_when_the_work_left_not_from_the_plan(tmp_path: Path):
    """A COMMIT held up (a slow disk, the master descheduled) between the plan and the send
    must not eat the worker's budget: the deadline moves to the send time plus the budget."""
    clock = [1000.0]
    store = Store.open(tmp_path / "c.db", policy=POLICY, clock=lambda: clock[0])
    gate = Gate(store)
    try:
        with store.transaction() as tx:
            enqueue_tasks(tx, [NewTask({"path": "/seeds/one"}), NewTask({"path": "/seeds/2"})])
            gate.apply_ready(tx, [Inbound(1, {READY_KEY: ""}), Inbound(2, {READY_KEY: ""})])
        with store.transaction() as tx:
            late, prompt = gate.plan_dispatches(tx, [1, 2], deadline_s=DEADLINE_S)
        sent_late = clock[0] + 3 * DEADLINE_S  # WORK left long after the plan
        with store.transaction() as tx:
            dsp.mark_sent(tx, [(late.token, sent_late), prompt.token])
        clock[0] += DEADLINE_S + 0.001
        with store.transaction() as tx:  # the promptly sent one is past its deadline
            assert [(r.rank, r.token) for r in gate.watchdog(tx)] == [(2, prompt.token)]
        clock[0] = sent_late + DEADLINE_S
        with store.transaction() as tx:
            assert gate.watchdog(tx) == []
        clock[0] += 0.001
        with store.transaction() as tx:
            assert [(r.rank, r.token) for r in gate.watchdog(tx)] == [(1, late.token)]
    finally:
        store.close()


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


def test_a_parked_rank_is_said_to_hold_its_whole_batch_not_its_first_task(farm):
    """The stall message named a hung batch by its first task ("rank 1 on task 3" for a
    batch whose hung task was 401): `parked_detail` says how many tasks the retired dispatch
    held, from the split that put them back."""
    from store.workers import parked_detail
    first, *_ = farm.enqueue(*({"data": i} for i in range(9)))
    farm.ready(1, "")
    farm.ready(2, "")
    [batch] = farm.plan(1, deadline_s=-1, batch=8)
    single = farm.dispatch(2, deadline_s=-1)[2]
    with farm.store.transaction() as tx:
        assert {r.token for r in farm.gate.watchdog(tx)} == {batch.token, single}
    with farm.store.reading() as conn:
        held = {rank: (task, n) for rank, task, _at, n in parked_detail(conn)}
    assert held[1] == (first, 8) and held[2][1] == 1


def test_the_watchdog_retires_a_dispatch_only_after_its_deadline(tmp_path: Path):
    clock = [1000.0]
    store = Store.open(tmp_path / "c.db", policy=POLICY, clock=lambda: clock[0])
    gate = Gate(store)
    try:
        with store.transaction() as tx:
            enqueue_tasks(tx, [NewTask({"path": "/seeds/one"})])
            gate.apply_ready(tx, [Inbound(1, {READY_KEY: ""})])
        with store.transaction() as tx:
            [plan] = gate.plan_dispatches(tx, [1], deadline_s=DEADLINE_S)
        clock[0] += DEADLINE_S  # exactly at the deadline: not yet past it
        with store.transaction() as tx:
            assert gate.watchdog(tx) == []
        clock[0] += 0.001
        with store.transaction() as tx:
            [rec] = gate.watchdog(tx)
        assert (rec.rank, rec.token) == (1, plan.token)
        with store.reading() as conn:
            assert conn.execute(text("SELECT state, parked_token FROM workers")).all() == [
                ("parked", plan.token)]
        # Parked: a READY with another token does not free it, the retired token does.
        with store.transaction() as tx:
            assert [s.value for _, s in gate.apply_ready(
                tx, [Inbound(1, {READY_KEY: ""})]).statuses] == ["missing"]
            assert gate.apply_ready(
                tx, [Inbound(1, {READY_KEY: plan.token})]).recovered_workers == [1]
        with store.reading() as conn:
            assert conn.execute(text("SELECT state, parked_token FROM workers")).all() == [
                ("idle", None)]
    finally:
        store.close()
