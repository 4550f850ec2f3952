"""`store.workers`: worker rows and states."""

from __future__ import annotations

from conftest import rows

from store.schema import WorkerState, workers
from store.workers import set_workers


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
