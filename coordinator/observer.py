"""The master's look at itself, between rounds, never inside one.

- Once a second, which worker ranks hold a dispatch (a read of the small `dispatches` table):
  over the last `window_s` these samples are each rank's busy fraction.
- Every `interval_s`, one observation: the counts read once (`store.observe.read_observed`),
  written as an `observations` row and the ranks' `rank_load` rows in a transaction of its
  own, and the metrics file rewritten. `coordinator status` takes its rates from these rows.

The reads it makes are bounded like the live display's: the next one waits at least
`LOAD_FACTOR` times as long as the last took.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from store.campaign import Store
from store.observe import (
    Observed,
    Sample,
    busy_ranks,
    read_observed,
    record_observation,
)

from .metrics import metrics_text, write_metrics
from .progress import Snapshot, rates


class Observer:
    BUSY_SAMPLE_S = 1.0
    LOAD_FACTOR = 20
    #: Samples older than this are not needed for any rate (the longest window is an hour).
    KEEP_S = 3700.0

    def __init__(self, store: Store, workers: Callable[[], list[int]], *, interval_s: float,
                 window_s: float = 300.0, finite: bool = True,
                 metrics_file: Path | None = None):
        self.store, self.workers = store, workers
        self.interval_s, self.window_s, self.finite = interval_s, window_s, finite
        self.metrics_file = metrics_file
        self.metrics_error: str | None = None
        self._busy: deque[tuple[float, frozenset[int]]] = deque()
        self._next_busy = 0.0
        self._next = 0.0  # the first observation comes at once: the incarnation's start
        self._samples: deque[Sample] = deque()
        self._first: Sample | None = None

    # -- once a second -----------------------------------------------------------------------
    def sample_busy(self, now: float) -> None:
        if now < self._next_busy:
            return
        self._next_busy = now + self.BUSY_SAMPLE_S
        with self.store.reading() as conn:
            busy = frozenset(busy_ranks(conn))
        self._busy.append((now, busy))
        while self._busy and self._busy[0][0] < now - self.window_s:
            self._busy.popleft()

    def loads(self) -> tuple[list[tuple[int, float]], float]:
        """Each worker rank's busy fraction over the samples of the last `window_s`, and the
        time those samples cover (less than `window_s` early in a run)."""
        n = len(self._busy)
        if not n:
            return [], 0.0
        covered = min(self.window_s, self._busy[-1][0] - self._busy[0][0] + self.BUSY_SAMPLE_S)
        return [(r, sum(r in b for _, b in self._busy) / n) for r in self.workers()], covered

    # -- every interval ----------------------------------------------------------------------
    def due(self, now: float) -> bool:
        return self.interval_s > 0 and now >= self._next

    def read(self, *, running: bool = True) -> Snapshot:
        began = time.monotonic()
        with self.store.reading() as conn:
            seen = read_observed(conn)
        now = time.time()
        self._next = max(self._next, time.monotonic()
                         + self.LOAD_FACTOR * (time.monotonic() - began))
        return self.snapshot(seen, now, running=running)

    def snapshot(self, seen: Observed, now: float, *, running: bool = True) -> Snapshot:
        samples = ([self._first] if self._first is not None else []) + [
            s for s in self._samples if s is not self._first]
        done = seen.stats.tasks["done"]
        return Snapshot(
            at=now, stats=seen.stats, found=seen.found,
            started_at=seen.times.incarnation_started_at,
            rates=rates(samples, now, done), finite=self.finite, ranks=seen.worker_states,
            results_by_status=seen.results_by_status, running=running,
            unrun_ranks=seen.unrun_ranks)

    def record(self, s: Snapshot) -> None:
        """The observation: its row and the ranks' loads, then the metrics file.

        While the run goes on, the loads are written once the samples cover an observation
        interval: the start's observation comes at once, on a sample or two taken before any
        rank was given work, and its "busy 0%" stood beside ranks busy for seconds (`status`
        showed it until the next). The run's last observation writes them whatever they
        cover."""
        self._next = max(self._next, time.monotonic() + self.interval_s)
        loads, covered = self.loads()
        if s.running and covered < min(self.interval_s, self.window_s):
            loads = []
        with self.store.transaction("observation") as tx:
            record_observation(tx, s.tasks, s.found.testcases, loads, covered)
        sample = Sample(s.at, s.tasks["done"], s.found.testcases)
        if self._first is None:
            self._first = sample
        self._samples.append(sample)
        while self._samples and self._samples[0].at < s.at - self.KEEP_S:
            self._samples.popleft()
        self.write_metrics(s)

    def write_metrics(self, s: Snapshot) -> None:
        if self.metrics_file is None:
            return
        times = self.store.commit_times
        text = metrics_text(s, self.store.path.name, times, times.take_peak())
        try:
            write_metrics(self.metrics_file, text)
        except OSError as e:  # a convenience copy: the numbers stay in the database
            why = e.strerror or str(e)
            if why != self.metrics_error:
                print(f"coordinator: cannot write the metrics file {self.metrics_file}: {why} "
                      f"(the numbers stay in the database: `coordinator status`)",
                      file=sys.stderr, flush=True)
            self.metrics_error = why
        else:
            self.metrics_error = None
