"""The master's cool-down for ranks whose host cannot run tasks, and what it charges
(`coordinator.cooldown`): pure logic, on a clock the test moves."""

from __future__ import annotations

from coordinator.cooldown import HostCooldown


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failing_host_cools_down_longer_each_time_and_a_run_ends_it():
    clock, live = Clock(), [1, 2, 3]
    c = HostCooldown(lambda: live, clock)
    assert c.answered(1, ran=True) and not c.cooling(1, clock.now)
    waits = []
    for _ in range(7):
        c.answered(1, ran=False)
        waits.append(c.wait_s([1, 2, 3], clock.now))
        assert c.cooling(1, clock.now) and not c.cooling(2, clock.now)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    clock.now += 30.0
    assert not c.cooling(1, clock.now) and c.wait_s([1], clock.now) is None
    c.answered(1, ran=False)
    assert c.wait_s([1], clock.now) == 30.0
    c.answered(1, ran=True)  # a task that ran, whatever its outcome: the host works
    assert not c.cooling(1, clock.now) and c.answered(1, ran=False)
    assert c.wait_s([1], clock.now) == 1.0


def test_only_the_first_failure_of_a_streak_is_charged_while_another_rank_runs_tasks():
    clock, live = Clock(), [1, 2, 3]
    c = HostCooldown(lambda: live, clock)
    assert c.answered(1, ran=False)  # one failure does not tell the host from the task
    assert not c.answered(1, ran=False)  # the host is the known cause: not charged
    assert not c.answered(1, ran=False)
    assert c.answered(2, ran=False)  # a second host failing: its first is charged
    assert not c.answered(2, ran=False)  # rank 3 still runs tasks


def test_with_every_live_rank_failing_each_answer_is_charged_and_none_waits():
    """Nobody else to run the tasks: they go to the retry policy as before (deferred past the
    budget, which lets the run end for the operator to fix the hosts)."""
    clock, live = Clock(), [1, 2]
    c = HostCooldown(lambda: live, clock)
    assert c.answered(1, ran=False) and c.answered(2, ran=False)
    assert c.answered(1, ran=False) and c.answered(2, ran=False)
    assert not c.cooling(1, clock.now) and c.wait_s([1, 2], clock.now) is None
    live.append(3)  # a rank that has not failed: the broken ones wait again
    assert c.cooling(1, clock.now) and not c.answered(1, ran=False)
    live.remove(3)  # (dead): as before
    live.remove(2)
    assert c.answered(1, ran=False) and not c.cooling(1, clock.now)
