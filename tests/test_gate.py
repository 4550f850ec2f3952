"""The gate (`coordinator.gate`) against a real campaign file, the user's scenarios (seed note
§7): the join, READY and RESULT classification and what each status writes, the watchdog's
parked rank. (What the store's own modules do is in test_dispatches.py, test_tasks.py, ...)"""

from __future__ import annotations

import pytest
from conftest import Farm, rows, snapshot, started, task_state, worker_state

from coordinator.gate import Inbound
from coordinator.protocol import ReadyStatus, ResultStatus
from store.schema import (
    TaskState,
    dispatches,
    leases,
    results,
    tasks,
    workers,
)
from store.stats import read_stats

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


# -- the watchdog's parked rank -------------------------------------------------------------

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
