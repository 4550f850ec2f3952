"""`--batch auto`: how many tasks a dispatch takes, from what the master measures.

Every dispatch costs a rank some time that runs nothing: its WORK's trip and decoding, the
RESULT's, and the wait for the master's next round. With a few ranks on an idle node that is
a fraction of a millisecond, and only tasks of microseconds need batches. With 63 ranks on 2
cores it was 4-5 ms per dispatch: a 50 ms task then kept its rank busy only ~0.9 of the time,
and a batch of a few tasks shares that cost out. When the node slows down (a slow disk, other
jobs' CPU) the cost grows to tens of milliseconds, and batches grow with it.

Larger batches leave the queue's end uneven: the last dispatches, each holding up to a second
of tasks, end far apart while the other ranks wait. So the share of the queue one dispatch
takes shrinks as the queue does (guided self-scheduling, Polychronopoulos and Kuck 1987): a
dispatch holds at most the queued tasks over twice the ranks, though never fewer than the
tens of milliseconds of tasks that pay for its commit.

A task's run time is its worker's word, so each rank's is kept apart and the size follows the
median rank: one rank that reports its tasks as instant (or as endless) cannot move every
rank's batches to the cap (or to one task) while the others tell the truth. So is a worker's
request to split a batch whose outcomes are over a message (`split`): one rank answering every
batch so halved every rank's batches with its own, down to single tasks.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from .config import MAX_BATCH


@dataclass
class AutoBatch:
    """The running means behind an automatic batch size, and the size they give."""

    #: A dispatch runs at least about this long (tens of milliseconds: the round's commit is
    #: then shared by far more work than it costs).
    TARGET_S = 0.03
    #: ... and long enough that the time its rank loses around it is at most about this share
    #: of the rank's time.
    OVERHEAD_SHARE = 0.04
    #: ... but no longer than this, so results keep coming back and a failed batch (split and
    #: run again) costs little; lower under a --watchdog (`for_watchdog`). At 0.2 s, 63 ranks
    #: of 50 ms tasks on a node whose dispatches had slowed to ~35 ms lost 0.21 of their time
    #: (3 tasks a dispatch); up to 1 s, 0.11 (11-19 tasks).
    MAX_S = 1.0
    #: A dispatch takes at most the queued tasks over this many times the ranks (but never
    #: fewer than TARGET_S of them): the queue's last dispatches are short and end together.
    GUIDED_SHARE = 2
    #: The overhead is the median of this many latest dispatches: a burst of answers (the
    #: first round of WORK, all ranks finishing at once) delays a few ranks by tens of
    #: milliseconds, which says nothing of what a dispatch costs.
    SAMPLES = 64

    #: A dispatch's RESULT is meant to take at most this share of --max-message-bytes: a
    #: batch whose RESULT would not fit is split, and its tasks run again.
    BYTES_SHARE = 0.5

    max_s: float = MAX_S
    _rank_task_s: dict[int, float] = field(default_factory=dict)  # rank -> its tasks' mean
    _task_s: float | None = None
    _task_bytes: float | None = None  # a task's share of an accepted RESULT, the larger lately
    #: rank -> the share of a message it said a task of its took, asking for a split
    _rank_split_bytes: dict[int, float] = field(default_factory=dict)
    _lost: deque[float] = field(default_factory=lambda: deque(maxlen=AutoBatch.SAMPLES))
    _overhead_s: float | None = None

    @classmethod
    def for_watchdog(cls, watchdog_s: float) -> AutoBatch:
        """A dispatch's deadline covers all its tasks: a batch stays well inside it."""
        return cls(max_s=min(cls.MAX_S, watchdog_s / 4) if watchdog_s > 0 else cls.MAX_S)

    def ran(self, seconds: float, rank: int = 0) -> None:
        """One task's run time as `rank` measured it (<0 if it had none)."""
        if seconds >= 0:
            mean = self._rank_task_s.get(rank)
            self._rank_task_s[rank] = seconds if mean is None else 0.9 * mean + 0.1 * seconds
            self._task_s = None

    def ran_at_least(self, seconds: float, rank: int = 0) -> None:
        """`rank`'s tasks took at least this long each (a batch passed its watchdog deadline:
        it holds no run times, but its deadline over its tasks bounds them from below). When
        tasks grow from microseconds to 50 ms, the running mean lagged, and the halves of a
        batch of 734 passed a 4 s deadline one after the other."""
        mean = self._rank_task_s.get(rank)
        if mean is None or mean < seconds:
            self._rank_task_s[rank] = seconds
            self._task_s = None

    def answered(self, nbytes: int, tasks: int, rank: int = 0) -> None:
        """An accepted RESULT of `rank`, `nbytes` for `tasks` tasks (measured by the master:
        it sizes every rank's batches). A larger share counts at once, a smaller one slowly,
        and the bound of the rank's own splits fades likewise."""
        per = nbytes / max(tasks, 1)
        self._task_bytes = _larger_lately(self._task_bytes, per)
        if rank in self._rank_split_bytes:
            self._rank_split_bytes[rank] = _larger_lately(self._rank_split_bytes[rank], per)

    def split(self, max_message_bytes: int, tasks: int, rank: int = 0) -> None:
        """`rank` asked for its batch of `tasks` to be split: their outcomes were over the
        bound, it says. Its word, so it counts for every rank's batches only as the median
        rank's (`bytes_cap`)."""
        self._rank_split_bytes[rank] = _larger_lately(self._rank_split_bytes.get(rank),
                                                      max_message_bytes / max(tasks, 1))

    def bytes_cap(self, max_message_bytes: int, ranks: Collection[int] = (0,)) -> int:
        """The most tasks whose RESULT fits BYTES_SHARE of a message, as large as seen: in
        an accepted RESULT, or said by the lower median of the live `ranks` asking for
        splits (a rank that asked for none says 0). One rank of two or three cannot shrink
        the others' batches by asking; nor can a rank gone or refused, whose claim would
        otherwise never fade (it fades only with that rank's accepted RESULTs)."""
        per = self._task_bytes or 0.0
        said = [self._rank_split_bytes.get(rank, 0.0) for rank in ranks]
        if any(said):
            per = max(per, statistics.median_low(said))
        if not per:
            return MAX_BATCH
        return max(1, min(MAX_BATCH, math.floor(max_message_bytes * self.BYTES_SHARE / per)))

    @property
    def task_s(self) -> float | None:
        """A task's mean run time: the median of the ranks' means."""
        if self._task_s is None and self._rank_task_s:
            self._task_s = statistics.median(self._rank_task_s.values())
        return self._task_s

    def cycled(self, answer_s: float, ran_s: float, waited_s: float) -> None:
        """One dispatch's rank cycle: WORK sent to RESULT received (`answer_s`), of which its
        tasks ran `ran_s`, and the time from its RESULT to its next WORK (`waited_s`)."""
        if not math.isfinite(ran_s):
            return  # a run time was not known
        self._lost.append(max(0.0, answer_s - ran_s) + max(0.0, waited_s))
        self._overhead_s = None

    @property
    def overhead_s(self) -> float | None:
        """A dispatch's time on its rank that ran nothing (the median of the latest)."""
        if self._overhead_s is None and self._lost:
            self._overhead_s = statistics.median(self._lost)
        return self._overhead_s

    def size(self, queued: Callable[[], int] | None = None, ranks: int = 1) -> int:
        """Tasks for the next dispatch. `queued`, if given, answers how many tasks wait in
        the queue for `ranks` ranks; it is asked only when its answer could matter."""
        if self.task_s is None:
            return 1  # nothing measured yet
        task_s = max(self.task_s, 1e-6)
        n = target = round(self.TARGET_S / task_s)
        if (overhead_s := self.overhead_s) is not None:
            share = self.OVERHEAD_SHARE
            n = max(n, math.ceil(overhead_s * (1 - share) / (share * task_s)))
        if queued is not None and n > target:
            n = min(n, max(target, math.ceil(queued() / (self.GUIDED_SHARE * max(ranks, 1)))))
        return max(1, min(n, MAX_BATCH, math.floor(self.max_s / task_s)))


def _larger_lately(mean: float | None, per: float) -> float:
    """A running share that takes a larger one at once and a smaller one slowly."""
    return per if mean is None else max(per, 0.9 * mean + 0.1 * per)
