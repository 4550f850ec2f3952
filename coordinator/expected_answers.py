"""When the master expects each rank holding work to answer, in time that follows the answers
it handles, not the ranks that exist.

The master asks two things of these times every round: which answers are due within its
linger (a round waits for those, one COMMIT for the lot), and, between rounds, how long until
the first answer is expected (its idle polls sleep until then). A walk over every rank
holding work answered both, and with hundreds of ranks running long tasks that walk was
most of a round's cost (`tools/round_cost.py --holders`). Two heaps keyed by expected time
answer them instead, in time that grows with the answers due, and the logarithm of the ranks.
Entries are never updated in place: a WORK sent pushes new ones, and one whose rank has since
answered (or was sent again, or forgotten) is dropped when it surfaces.
"""

from __future__ import annotations

import heapq
import math

#: An entry: (expected at, rank, its WORK's send time); live while the rank's outstanding
#: WORK is still the one sent then.
_Entry = tuple[float, int, float]


class ExpectedAnswers:
    """Each rank's outstanding WORK (when it left) and mean answer time (WORK to RESULT)."""

    #: The idle polls sleep until this share of a rank's mean answer time has passed since
    #: its WORK left: answers come early too.
    EARLY = 0.8
    #: The weight of the latest answer time in a rank's mean.
    WEIGHT = 0.3

    def __init__(self) -> None:
        self.sent_at: dict[int, float] = {}   # rank -> when its outstanding WORK left
        self.mean_s: dict[int, float] = {}    # rank -> its mean answer time (EWMA)
        self._unknown: set[int] = set()       # ranks out whose mean is not known yet
        self._due: list[_Entry] = []          # keyed by WORK sent + mean answer time
        self._early: list[_Entry] = []        # keyed by WORK sent + EARLY * mean

    def sent(self, rank: int, at: float) -> None:
        """The rank's WORK left at `at` (monotonic)."""
        self.sent_at[rank] = at
        mean = self.mean_s.get(rank)
        if mean is None:
            self._unknown.add(rank)
            return
        self._unknown.discard(rank)
        heapq.heappush(self._due, (at + mean, rank, at))
        heapq.heappush(self._early, (at + self.EARLY * mean, rank, at))
        if len(self._due) + len(self._early) > 8 * len(self.sent_at) + 64:
            # Entries of ranks that answered before their time wait deep in the heaps until
            # it passes; a master too busy to idle would keep them forever.
            self._due = [e for e in self._due if self._live(e)]
            self._early = [e for e in self._early if self._live(e)]
            heapq.heapify(self._due)
            heapq.heapify(self._early)

    def answered(self, rank: int, at: float) -> float | None:
        """The rank's RESULT came in at `at`: how long after its WORK (None if no WORK was
        out to it), which its mean takes in."""
        self._unknown.discard(rank)
        sent = self.sent_at.pop(rank, None)
        if sent is None:
            return None
        took = at - sent
        before = self.mean_s.get(rank)
        self.mean_s[rank] = took if before is None else (
            (1 - self.WEIGHT) * before + self.WEIGHT * took)
        return took

    def forget(self, rank: int) -> None:
        """No answer is awaited from the rank any more (its dispatch was recovered)."""
        self.sent_at.pop(rank, None)
        self._unknown.discard(rank)

    def due_by(self, by: float) -> set[int]:
        """The ranks whose answer is expected by `by`: their WORK left at least their mean
        answer time before it, or their mean is not known yet."""
        due = set(self._unknown)
        again = []
        heap = self._due
        while heap and heap[0][0] <= by:
            entry = heapq.heappop(heap)
            if self._live(entry):
                due.add(entry[1])
                again.append(entry)  # (still due at the next round, until it answers)
        for entry in again:
            heapq.heappush(heap, entry)
        return due

    def first_expected(self) -> float | None:
        """When the first answer is expected (EARLY share of its rank's mean after its WORK):
        None if one may come any moment (a rank's mean not known yet), inf if none is out."""
        if self._unknown:
            return None
        heap = self._early
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def _live(self, entry: _Entry) -> bool:
        return self.sent_at.get(entry[1]) == entry[2]
