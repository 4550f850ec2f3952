"""The master's view of ranks whose host cannot run tasks (`not_run` answers): when such a
rank gets work again, and which of its failed tasks are charged to the retry policy.

A rank whose disk is full or whose target lost its exec bit answers `not_run` at once. Left
alone it took the task at the head of the queue again as soon as it answered (the retried
task goes back to the head, and the healthy ranks were busy with long runs), failed it again,
and the second failure deferred it: one healthy campaign's tasks deferred, one by one, by one
broken node. So:

- after an answer whose every task was `not_run`, the rank gets no work for a cool-down that
  doubles while its host keeps failing (FIRST_S up to CAP_S), as long as another rank can run
  tasks (the healthy ranks take its tasks); any answer with a task that ran ends it;
- the first such answer of a streak is charged as before (the retry budget, not the attempt
  ceiling: `dispatches._apply_retry`), because one failure does not tell the host from the
  task (an input too large for any disk fails everywhere);
- later ones are charged nothing while another rank can run tasks (its host is the known
  cause, and the healthy ranks will run the task), so a broken node no longer defers anything.

"Another rank can run tasks": one not failing that holds work (its WORK out, not past its
deadline), answered one moments ago, is idle, or was given work this round (`Master._able`).
A parked rank (hung past its deadline), a lost, refused or dead one does not count: with a
broken node beside a hung one, the broken node's failures were charged nothing for ever and
the run never ended. With no such rank there is no one to wait for: no cool-down, each answer
charged, and the tasks are deferred as before, which ends the run for the operator to fix the
hosts (`--resume` then runs them).

Pure logic: the master feeds it the answers and asks it before each dispatch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


class HostCooldown:
    FIRST_S = 1.0
    CAP_S = 30.0

    def __init__(self, able: Callable[[], Iterable[int]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`able`: the ranks that hold work or are idle (see the module's docstring), asked
        only while some rank is failing, and at most once per question."""
        self.able, self.clock = able, clock
        self.streak: dict[int, int] = {}   # rank -> answers in a row with nothing run
        self.until: dict[int, float] = {}  # rank -> when its cool-down ends (monotonic)

    def answered(self, rank: int, ran: bool) -> bool:
        """A current RESULT of `rank`: `ran` unless every task it answers is `not_run`.
        Returns whether its `not_run` tasks are charged."""
        if ran:
            if self.streak:
                self.streak.pop(rank, None)
                self.until.pop(rank, None)
            return True
        known = rank in self.streak
        n = self.streak[rank] = self.streak.get(rank, 0) + 1
        self.until[rank] = self.clock() + min(self.FIRST_S * 2 ** (n - 1), self.CAP_S)
        return not (known and self._others_run())

    def _others_run(self) -> bool:
        # (Asked of a rank in the streak: any able rank outside it is another one.)
        streak = self.streak
        return any(r not in streak for r in self.able())

    def held(self, ranks: Iterable[int], now: float) -> set[int]:
        """Of `ranks`, those still cooling down: none while no other rank can run tasks.
        One pass over the able ranks at most, however many are asked about."""
        if not self.until:
            return set()
        for r in [r for r, at in self.until.items() if at <= now]:
            del self.until[r]  # (over: the next question takes the fast path again)
        held = {r for r in ranks if r in self.until}
        return held if held and self._others_run() else set()

    def wait_s(self, ranks: Iterable[int], now: float) -> float | None:
        """How long until the first of `ranks` that is cooling down may take work again;
        None if none of them is."""
        held = self.held(ranks, now)
        return min(self.until[r] for r in held) - now if held else None
