"""`--batch auto`'s size rule (`coordinator/batching.py`): pure arithmetic over the master's
measures, so plain numbers, no farm."""

from __future__ import annotations

import math

import pytest

from coordinator.batching import AutoBatch
from coordinator.config import MAX_BATCH


def measured(task_s: float, overhead_s: float | None = None, **kw) -> AutoBatch:
    auto = AutoBatch(**kw)
    auto.ran(task_s)
    if overhead_s is not None:
        auto.cycled(answer_s=task_s + overhead_s / 2, ran_s=task_s, waited_s=overhead_s / 2)
    return auto


def test_nothing_measured_yet_sends_one_task():
    assert AutoBatch().size() == 1
    auto = AutoBatch()
    auto.ran(-1.0)  # a result without a run time
    assert auto.size() == 1


def test_tiny_tasks_fill_a_dispatch_of_tens_of_milliseconds_up_to_the_cap():
    assert measured(0.001).size() == 30
    assert measured(0.0001).size() == 300
    assert measured(1e-7).size() == MAX_BATCH


def test_a_task_of_the_target_or_longer_goes_alone_when_dispatching_costs_little():
    # 3 ranks on an idle node: a fraction of a millisecond between dispatches.
    assert measured(0.03, overhead_s=0.0003).size() == 1
    assert measured(0.05, overhead_s=0.0005).size() == 1
    assert measured(2.0, overhead_s=0.01).size() == 1


def test_a_costly_dispatch_is_shared_by_enough_tasks_to_keep_its_share_small():
    """63 ranks on 2 cores: ~5 ms of each 50 ms task's cycle ran nothing (util ~0.9)."""
    auto = measured(0.05, overhead_s=0.005)
    n = auto.size()
    assert n == 3
    lost = lambda k: 0.005 / (k * 0.05 + 0.005)  # noqa: E731
    assert lost(n) <= AutoBatch.OVERHEAD_SHARE < lost(n - 1)


def test_a_dispatch_never_runs_longer_than_its_bound_nor_a_quarter_of_the_watchdog():
    assert AutoBatch.MAX_S == 1.0
    assert measured(0.05, overhead_s=0.5).size() == 20
    watched = AutoBatch.for_watchdog(0.4)
    watched.ran(0.05)
    watched.cycled(answer_s=0.55, ran_s=0.05, waited_s=0.0)
    assert watched.size() == 2  # 0.1 s of tasks, a quarter of the 0.4 s deadline
    assert AutoBatch.for_watchdog(0).max_s == AutoBatch.MAX_S
    # A task longer than the bound still goes, alone.
    assert measured(3.0, overhead_s=1.0).size() == 1


def test_a_slow_node_grows_the_batches_and_the_queues_end_shrinks_them():
    """63 ranks of 50 ms tasks on a node whose dispatches slowed to ~35 ms each (a busy disk):
    17 tasks keep the loss near 4 %. Near the queue's end a dispatch takes at most the queued
    tasks over twice the ranks, so the last ones are short and end together."""
    slow = measured(0.05, overhead_s=0.035)
    assert slow.size() == slow.size(queued=lambda: 10_000, ranks=63) == 17
    assert slow.size(queued=lambda: 1_000, ranks=63) == 8       # ceil(1000 / 126)
    assert slow.size(queued=lambda: 100, ranks=63) == 1
    assert slow.size(queued=lambda: 0, ranks=63) == 1


def test_the_queues_end_never_shrinks_a_dispatch_below_its_commits_worth():
    """Tiny tasks: a dispatch still holds ~30 ms of them however short the queue (the gate
    then shares the last ones out evenly)."""
    tiny = measured(0.0001, overhead_s=0.0003)

    def never() -> int:  # (the queue's length cannot matter: it is not counted)
        raise AssertionError("counted")
    assert tiny.size(queued=never, ranks=3) == 300


def test_a_burst_of_late_answers_does_not_size_the_batches():
    """The first round of WORK, or every rank finishing at once, delays a few ranks' next
    WORK by tens of milliseconds: a few such dispatches among many cheap ones change nothing."""
    auto = measured(0.05)
    for i in range(AutoBatch.SAMPLES):
        waited = 0.08 if i % 4 == 0 else 0.0002  # a quarter of them caught in a burst
        auto.cycled(answer_s=0.0502, ran_s=0.05, waited_s=waited)
    assert auto.overhead_s == pytest.approx(0.0004)
    assert auto.size() == 1


def test_the_means_follow_the_latest_measures():
    auto = measured(0.05, overhead_s=0.005)
    for _ in range(60):  # the node got quiet
        auto.cycled(answer_s=0.0502, ran_s=0.05, waited_s=0.0001)
    assert auto.overhead_s == pytest.approx(0.0003, abs=2e-5)
    assert auto.size() == 1


def test_a_dispatch_whose_run_time_is_unknown_gives_no_overhead_sample():
    auto = measured(0.05)
    auto.cycled(answer_s=0.3, ran_s=math.inf, waited_s=0.1)
    assert auto.overhead_s is None


def test_one_rank_lying_about_its_run_times_moves_no_ranks_batches():
    """A run time is its worker's word: a rank that reports its tasks as instant would size
    every rank's batches to the cap, one that reports them as endless to one task. Each
    rank's mean is kept apart and the size follows the median rank."""
    honest = measured(0.01)
    for rank in (1, 2):
        honest.ran(0.01, rank)
    for lie in (0.0, 1e-9, 3600.0):
        auto = AutoBatch()
        for _ in range(50):
            auto.ran(0.01, 1)
            auto.ran(lie, 2)
            auto.ran(0.01, 3)
        assert auto.task_s == pytest.approx(0.01)
        assert auto.size() == honest.size() == 3
    # With one rank (or two) the median is its word: there is nobody to outvote it.
    alone = AutoBatch()
    alone.ran(1e-9, 1)
    assert alone.size() == MAX_BATCH


def test_batches_stay_small_enough_for_their_result_to_fit_a_message():
    """A batch whose RESULT would be over --max-message-bytes is split and its tasks run
    again: the size is also bounded by the RESULTs seen, to half a message. A larger share
    per task counts at once (a split says the bound was passed), a smaller one slowly."""
    bound = 64 << 20
    auto = measured(1e-6)
    assert auto.bytes_cap(bound) == MAX_BATCH  # nothing seen yet
    auto.answered(2_000, 10)
    assert auto.bytes_cap(bound) == MAX_BATCH  # 200 bytes a task: far from the bound
    auto.answered(200 << 10, 1)  # one task's 200 KiB value
    assert auto.bytes_cap(bound) == 163  # 32 MiB / 200 KiB
    auto.split(bound, 64)        # a batch of 64 asked to be split: over 1 MiB a task
    assert auto.bytes_cap(bound) == 32
    for _ in range(100):         # then small again: the cap comes back, slowly
        auto.answered(1_000, 10)
    assert auto.bytes_cap(bound) == MAX_BATCH


def test_one_rank_asking_for_splits_moves_no_other_ranks_batches():
    """A split is its worker's word: one rank asking for one for every batch, down to one
    task, capped every rank's batches at one (back to 16 only 27 accepted RESULTs later).
    The bound that splits say is the lower median rank's (a rank that asked for none says
    0)."""
    bound = 64 << 20
    auto = measured(1e-6)
    auto.answered(2_000, 10, rank=2)
    for n in (64, 32, 16, 8, 4, 2):
        auto.split(bound, n, rank=1)
        assert auto.bytes_cap(bound, ranks=(1, 2, 3)) == MAX_BATCH
        assert auto.bytes_cap(bound, ranks=(1, 2)) == MAX_BATCH  # (one of two: the lower median)
    auto.split(bound, 64, rank=2)  # a second rank asks too: over 1 MiB a task, it says
    assert auto.bytes_cap(bound, ranks=(1, 2, 3)) == 32
    for _ in range(100):  # rank 2's RESULTs are small again: its word fades
        auto.answered(1_000, 10, rank=2)
    assert auto.bytes_cap(bound, ranks=(1, 2, 3)) == MAX_BATCH
    alone = measured(1e-6)  # a rank alone is its own median
    alone.split(bound, 64, rank=1)
    assert alone.bytes_cap(bound, ranks=(1,)) == 32


def test_a_gone_ranks_splits_cap_no_batches_of_the_ranks_left():
    """The claims of a rank that died or was refused fade only with its own accepted
    RESULTs, which never come: counted still, they capped the rank left alone at one task
    a batch for the rest of the run (found by review: 500 accepted RESULTs later, still 1)."""
    bound = 64 << 20
    auto = measured(1e-6)
    for n in (64, 32, 16, 8, 4, 2, 1):
        auto.split(bound, n, rank=1)
    auto.split(bound, 64, rank=3)
    assert auto.bytes_cap(bound, ranks=(1, 2)) == MAX_BATCH
    assert auto.bytes_cap(bound, ranks=(2,)) == MAX_BATCH  # rank 1 gone, rank 3 too
    assert auto.bytes_cap(bound, ranks=(2, 3)) == MAX_BATCH  # (one of two)
    assert auto.bytes_cap(bound, ranks=(1, 3)) == 32  # both claimants live: the lower


def test_a_batch_past_its_deadline_raises_its_ranks_task_time_at_once():
    """Tasks that grew from microseconds to 50 ms: the running mean of run times lagged, and
    batches of hundreds passed a 4 s deadline one after the other. A batch retired by the
    watchdog bounds its tasks' time from below (its deadline over its tasks)."""
    auto = AutoBatch.for_watchdog(4.0)
    for rank in (1, 2, 3):
        auto.ran(1e-5, rank)
    assert auto.size() == MAX_BATCH
    for rank in (1, 2, 3):
        auto.ran_at_least(4.0 / 734, rank)
    assert auto.task_s == pytest.approx(4.0 / 734)
    assert auto.size() * auto.task_s <= 1.0  # within a quarter of the deadline
    auto.ran_at_least(1e-9, 1)  # a bound below the mean changes nothing
    assert auto.task_s == pytest.approx(4.0 / 734)
