"""Progress: what a campaign shows while it runs, the same figures wherever they are shown.

A `Snapshot` is one reading of the campaign (counts, finds, rates, the incarnation's times).
It is shown as a plain line on stderr every `--progress-interval` seconds when stderr is not
a terminal (a batch job's log: no escape codes), as a live display on a terminal (rich), and
as the lines the stats file has after its six counters; `coordinator status` and the metrics
file show the same figures, computed by the same functions.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from store.observe import Found, Sample
from store.stats import Stats

#: A rate over less time than this is not given.
MIN_SPAN_S = 0.1
#: The windows of the rates, seconds.
RATE_WINDOWS = {"last_minute": 60.0, "last_hour": 3600.0}


def rate_over(samples: Sequence[Sample], now: float, done: int,
              window: float | None) -> float | None:
    """Tasks done per second over the last `window` seconds (None: since the first sample,
    the incarnation's start): from the latest sample at least that old, or from the first one
    if the incarnation is younger. None when less than `MIN_SPAN_S` separates them."""
    if not samples or done < samples[-1].done:
        return None
    # `done` falls when results are discarded (`coordinator requeue --state error`, safe
    # while a master runs): across the fall the difference would read as a negative rate
    # (and a negative ETA). Only the samples since the last fall are compared.
    falls = [i for i in range(1, len(samples)) if samples[i].done < samples[i - 1].done]
    if falls:
        samples = samples[falls[-1]:]
    ref = samples[0]
    if window is not None:
        for s in samples:
            if s.at > now - window:
                break
            ref = s
    dt = now - ref.at
    return (done - ref.done) / dt if dt >= MIN_SPAN_S else None


def rates(samples: Sequence[Sample], now: float, done: int) -> dict[str, float | None]:
    got = {name: rate_over(samples, now, done, w) for name, w in RATE_WINDOWS.items()}
    got["overall"] = rate_over(samples, now, done, None)
    return got


def eta_s(tasks: dict[str, int], rate: float | None, finite: bool) -> float | None:
    """Seconds until what is queued and in flight now is done at `rate`; None for a source
    that never ends (an AFL queue being watched) or no rate yet."""
    left = tasks.get("queued", 0) + tasks.get("active", 0)
    if not finite:
        return None
    if left == 0:
        return 0.0
    return left / rate if rate is not None and rate > 0 else None


@dataclass(frozen=True)
class Snapshot:
    """One reading of the campaign, at `at` (Unix time)."""

    at: float
    stats: Stats
    found: Found
    started_at: float | None           # this incarnation's start
    rates: dict[str, float | None]
    finite: bool                       # the task source ends (not an AFL watch)
    ranks: dict[str, int] = field(default_factory=dict)  # worker state -> ranks
    results_by_status: dict[str, int] = field(default_factory=dict)
    running: bool = True
    unrun_ranks: int = 0  # ranks whose host could not run their last answers' tasks

    @property
    def tasks(self) -> dict[str, int]:
        return self.stats.tasks

    @property
    def elapsed_s(self) -> float | None:
        return None if self.started_at is None else max(0.0, self.at - self.started_at)

    @property
    def eta_s(self) -> float | None:
        """None once the master is gone, or while no rank can run anything (all parked by the
        watchdog, or dead: the last minute's rate says nothing of when they return), unless
        nothing is left (0)."""
        working = self.running and (not self.ranks or any(
            n for state, n in self.ranks.items() if state in ("idle", "busy", "unknown")))
        return eta_s(self.tasks, self.rates.get("last_minute") if working else None,
                     self.finite)

    @property
    def since_find_s(self) -> float | None:
        return None if self.found.last_at is None else max(0.0, self.at - self.found.last_at)

    @property
    def quarantined(self) -> int:
        return sum(n for reasons in self.stats.quarantine.values() for n in reasons.values())

    @property
    def parked(self) -> int:
        return self.ranks.get("parked", 0)


def duration(seconds: float | None) -> str:
    """`1h02m03s`, `4m05s`, `12s`, `3d04h05m`; `-` for unknown."""
    if seconds is None:
        return "-"
    s = round(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def per_s(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:.3g}/s" if rate < 100 else f"{rate:.0f}/s"


def progress_line(s: Snapshot) -> str:
    """The plain progress line: `key=value` fields, no escape codes, one line."""
    t = s.tasks
    return (f"coordinator: progress elapsed={duration(s.elapsed_s)} done={t['done']} "
            f"queued={t['queued']} active={t['active']} deferred={t['deferred']} "
            f"failed={t['failed']} rate_1m={per_s(s.rates.get('last_minute'))} "
            f"eta={duration(s.eta_s) if s.finite else 'never'} "
            f"testcases={s.found.testcases} last_find="
            f"{duration(s.since_find_s) + '_ago' if s.since_find_s is not None else 'never'} "
            f"quarantined={s.quarantined} parked={s.parked}")


def clock_utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def stats_fields(s: Snapshot) -> str:
    """The stats file's lines after its six counters: the progress line's fields."""
    t = s.tasks
    r = s.rates
    started = f", started {clock_utc(s.started_at)}" if s.started_at is not None else ""
    return "\n".join([
        f"Elapsed: {duration(s.elapsed_s)} (incarnation {s.stats.incarnation}{started})",
        f"Tasks: {t['done']} done, {t['queued']} queued, {t['active']} active, "
        f"{t['deferred']} deferred, {t['failed']} failed",
        f"Rate: {per_s(r.get('last_minute'))} last minute, {per_s(r.get('last_hour'))} last "
        f"hour, {per_s(r.get('overall'))} this incarnation",
        f"ETA: {duration(s.eta_s) if s.finite else 'never (the source is an AFL queue)'}",
        f"Test cases: {s.found.testcases}" + (
            f" (the last {duration(s.since_find_s)} ago)" if s.since_find_s is not None
            else " (none yet)"),
        f"Quarantined messages: {s.quarantined}",
        f"Parked ranks: {s.parked}",
    ]) + "\n"


class Progress:
    """The live display on a terminal (`live`), or a plain line every `interval_s` seconds
    (`interval_s` > 0), or nothing."""

    REFRESH_S = 0.5
    #: A refresh reads counts over whole indexes (a quarter second at a million tasks): at
    #: most 1/LOAD_FACTOR of the master's time goes to it.
    LOAD_FACTOR = 20

    def __init__(self, live: bool, interval_s: float = 0.0, stream=None):
        self.live, self.interval_s = live, interval_s
        self.stream = stream
        self.enabled = live or interval_s > 0
        self._live = None
        self._next = 0.0

    def start(self) -> None:
        if self.live:
            from rich.console import Console
            from rich.live import Live
            # Asked for explicitly: the terminal is at the far end of mpiexec's output pipe.
            self._live = Live("starting...", console=Console(stderr=True, force_terminal=True),
                              refresh_per_second=4, transient=False)
            self._live.start()
        self._next = time.monotonic() + (self.REFRESH_S if self.live else self.interval_s)

    def due(self, now: float) -> bool:
        if not self.enabled or now < self._next:
            return False
        self._next = now + (self.REFRESH_S if self.live else self.interval_s)
        return True

    def took(self, now: float, read_s: float) -> None:
        """The refresh's read took `read_s`: the next one waits in proportion."""
        self._next = max(self._next, now + self.LOAD_FACTOR * read_s)

    def update(self, s: Snapshot) -> None:
        if self._live is not None:
            self._live.update(_table(s))
        elif self.interval_s > 0:
            print(progress_line(s), file=self.stream or sys.stderr, flush=True)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def _table(s: Snapshot):
    from rich.table import Table
    t = s.tasks
    q_result = sum(s.stats.quarantine.get("result", {}).values())
    q_ready = sum(s.stats.quarantine.get("ready", {}).values())
    grid = Table.grid(padding=(0, 2))
    grid.add_row("elapsed", duration(s.elapsed_s), "done", f"{t['done']}",
                 "queued", f"{t['queued']}")
    grid.add_row("in flight", f"{t['active']}", "deferred", f"{t['deferred']}",
                 "failed", f"{t['failed']}")
    grid.add_row("rate (1 min)", per_s(s.rates.get("last_minute")), "ETA",
                 duration(s.eta_s) if s.finite else "never", "incarnation",
                 f"{s.stats.incarnation}")
    grid.add_row("test cases", f"{s.found.testcases}", "last find",
                 f"{duration(s.since_find_s)} ago" if s.since_find_s is not None else "never",
                 "parked ranks", f"{s.parked}")
    grid.add_row("quarantined", f"result {q_result} / ready {q_ready}", "requeued",
                 f"{s.stats.requeued}", "", "")
    return grid
