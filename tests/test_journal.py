"""`store.journal`: the retry policy's range and its default ceiling (R7)."""

from __future__ import annotations

import pytest
from conftest import Farm, fail_once, rows

from store.journal import RetryPolicy
from store.schema import TaskState, tasks


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
