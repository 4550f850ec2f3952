"""The master's cool-down for ranks whose host cannot run tasks, and what it charges
(`coordinator.cooldown`): pure logic, on a clock the test moves."""

from __future__ import annotations

from coordinator.cooldown import HostCooldown


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def held(c: HostCooldown, *ranks: int, now: float) -> list[int]:
    return sorted(c.held(ranks, now))


def test_a_failing_host_cools_down_longer_each_time_and_a_run_ends_it():
    clock, able = Clock(), [1, 2, 3]
    c = HostCooldown(lambda: able, clock)
    assert c.answered(1, ran=True) and held(c, 1, 2, 3, now=clock.now) == []
    waits = []
    for _ in range(7):
        c.answered(1, ran=False)
        waits.append(c.wait_s([1, 2, 3], clock.now))
        assert held(c, 1, 2, 3, now=clock.now) == [1]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    clock.now += 30.0
    assert held(c, 1, now=clock.now) == [] and c.wait_s([1], clock.now) is None
    assert c.until == {}  # (an expired cool-down is dropped: the fast path again)
    c.answered(1, ran=False)
    assert c.wait_s([1], clock.now) == 30.0
    c.answered(1, ran=True)  # a task that ran, whatever its outcome: the host works
    assert held(c, 1, now=clock.now) == [] and c.answered(1, ran=False)
    assert c.wait_s([1], clock.now) == 1.0


def test_only_the_first_failure_of_a_streak_is_charged_while_another_rank_can_run_tasks():
    clock, able = Clock(), [1, 2, 3]
    c = HostCooldown(lambda: able, clock)
    assert c.answered(1, ran=False)  # one failure does not tell the host from the task
    assert not c.answered(1, ran=False)  # the host is the known cause: not charged
    assert not c.answered(1, ran=False)
    assert c.answered(2, ran=False)  # a second host failing: its first is charged
    assert not c.answered(2, ran=False)  # rank 3 still runs tasks


def test_with_no_other_rank_able_to_run_tasks_each_answer_is_charged_and_none_waits():
    """Nobody else to run the tasks (every other rank failing too, or parked, hung past its
    deadline, or dead: `able` leaves them out): they go to the retry policy as before,
    deferred past the budget, which lets the run end for the operator to fix the hosts. A
    broken rank beside a parked one was charged nothing for ever, and the run never ended."""
    clock, able = Clock(), [1, 2]
    c = HostCooldown(lambda: able, clock)
    assert c.answered(1, ran=False) and c.answered(2, ran=False)
    assert c.answered(1, ran=False) and c.answered(2, ran=False)
    assert held(c, 1, 2, now=clock.now) == [] and c.wait_s([1, 2], clock.now) is None
    able.append(3)  # a rank that can: the broken ones wait again, uncharged
    assert held(c, 1, 2, now=clock.now) == [1, 2] and not c.answered(1, ran=False)
    able.remove(3)  # (parked by the watchdog: no longer among those that can)
    assert c.answered(1, ran=False) and held(c, 1, 2, now=clock.now) == []


def test_the_able_ranks_are_read_once_per_question_however_many_are_asked_about():
    """One broken node of 64 ranks in a job of 1,024: the master asks before each dispatch
    and at each idle poll, so a question costs one pass over the able ranks at most."""
    clock, reads = Clock(), []
    able = list(range(1, 1025))

    def read():
        reads.append(1)
        return iter(able)
    c = HostCooldown(read, clock)
    for r in range(1, 65):
        c.answered(r, ran=False)
    reads.clear()
    assert held(c, *range(1, 1025), now=clock.now) == list(range(1, 65))
    assert len(reads) == 1
    reads.clear()
    assert held(c, *range(100, 200), now=clock.now) == [] and reads == []  # none cooling
