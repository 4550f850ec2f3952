"""`coordinator/expected_answers.py`: the heaps answer what a walk over every rank holding work
would, whatever the order of sends, answers and recoveries (Hypothesis, against that walk)."""

from __future__ import annotations

import math

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from coordinator.expected_answers import ExpectedAnswers

RANKS = st.integers(1, 6)
#: Time moves on in steps of whole milliseconds, so equal times (a tie in a heap) happen.
STEPS = st.integers(0, 40).map(lambda ms: ms / 1000)


class AgainstTheWalk(RuleBasedStateMachine):
    """The walk (the master's code before the heaps): every rank out, its WORK's time plus its
    mean (EARLY share of it for the first expected answer), unknown means due at once."""

    def __init__(self) -> None:
        super().__init__()
        self.expected = ExpectedAnswers()
        self.now = 100.0
        self.sent: dict[int, float] = {}
        self.mean: dict[int, float] = {}

    @rule(step=STEPS)
    def time_passes(self, step: float) -> None:
        self.now += step

    @rule(rank=RANKS)
    def work_leaves(self, rank: int) -> None:
        self.expected.sent(rank, self.now)
        self.sent[rank] = self.now

    @rule(rank=RANKS)
    def result_comes_in(self, rank: int) -> None:
        took = self.expected.answered(rank, self.now)
        sent = self.sent.pop(rank, None)
        if sent is None:
            assert took is None
            return
        assert took == self.now - sent
        before = self.mean.get(rank)
        self.mean[rank] = took if before is None else 0.7 * before + 0.3 * took

    @rule(rank=RANKS)
    def dispatch_recovered(self, rank: int) -> None:
        self.expected.forget(rank)
        self.sent.pop(rank, None)

    @invariant()
    def the_answers_due_are_the_walks(self) -> None:
        for ahead in (0.0, 0.0005, 0.02):
            by = self.now + ahead
            walk = {r for r, at in self.sent.items()
                    if r not in self.mean or at + self.mean[r] <= by}
            assert self.expected.due_by(by) == walk

    @invariant()
    def the_first_expected_answer_is_the_walks(self) -> None:
        if any(r not in self.mean for r in self.sent):
            assert self.expected.first_expected() is None
            return
        walk = min((at + ExpectedAnswers.EARLY * self.mean[r] for r, at in self.sent.items()),
                   default=math.inf)
        assert self.expected.first_expected() == walk

    @invariant()
    def the_heaps_stay_bounded(self) -> None:
        heaps = len(self.expected._due) + len(self.expected._early)
        assert heaps <= 8 * len(self.sent) + 64 + 2


TestAgainstTheWalk = AgainstTheWalk.TestCase
TestAgainstTheWalk.settings = settings(max_examples=300, stateful_step_count=60,
                                       deadline=None)


def test_a_master_that_never_idles_keeps_its_heaps_small():
    """Dispatches recovered long before their ranks' mean answer time (their entries deep in
    the heaps), and no idle poll to drop them: 30,000 of them leave the heaps bounded by the
    ranks out."""
    expected = ExpectedAnswers()
    now = 0.0
    for rank in range(1, 4):  # a slow first answer: a mean of 10 s
        expected.sent(rank, now)
        expected.answered(rank, now + 10)
    for i in range(30_000):
        now += 0.0001
        rank = 1 + i % 3
        expected.sent(rank, now)
        expected.forget(rank)
    assert len(expected._due) + len(expected._early) <= 8 * 3 + 64 + 2
