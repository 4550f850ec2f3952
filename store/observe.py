"""What a running (or finished) campaign shows: the reads behind `coordinator status`, the
progress lines, the metrics file and `coordinator plot`, and the master's observation rows.

Every read here is cheap on a campaign of a million tasks, except `plot_series`, which reads
the results and tasks once each and aggregates them in SQL (a second or two): `status` and the
master read only narrow indexes, small tables (dispatches, workers, the master's own
observations) and the latest rows of append-only ones.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .stats import Stats, read_stats
from .vocabulary import COUNTED_KIND_SQL, FOUND_SQL, EventKind

if TYPE_CHECKING:
    from .journal import Tx
    from .readonly import Reader as Connection

# -- commits ---------------------------------------------------------------------------------

@dataclass
class CommitTimes:
    """How long the store's COMMITs took (with their fsync at `synchronous=FULL`), since the
    store was opened: for the metrics file and the run's summary. `peak_s` is the longest
    since `take_peak`, `max_s` the longest of all."""

    count: int = 0
    total_s: float = 0.0
    peak_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.peak_s = max(self.peak_s, seconds)
        self.max_s = max(self.max_s, seconds)

    def take_peak(self) -> float:
        peak, self.peak_s = self.peak_s, 0.0
        return peak


# -- the finds ---------------------------------------------------------------------------------

#: Through `ix_results_found` alone: only the results that wrote test cases are read; and
#: the few rows of the retried runs' kept ones.
_FOUND = (f"SELECT * FROM (SELECT count(*), total(testcases), max(committed_at) FROM results "
          f"WHERE {FOUND_SQL}), (SELECT count(*), total(testcases), max(at) FROM salvaged)")


@dataclass(frozen=True)
class Found:
    """Test cases written by committed results and by runs that were retried (killed at
    their timeout, their test cases kept: `salvaged`)."""

    testcases: int
    results: int            # results that wrote any
    last_at: float | None   # when the latest of them committed (or its run was retried)
    retried: int = 0        # runs that were retried after writing some (of `testcases`)


def read_found(conn: Connection) -> Found:
    # Plain driver SQL here and below: the master reads these every few seconds, and
    # building a Core statement costs more than running one of them.
    n, total, last, k, kept, kept_last = conn.exec_driver_sql(_FOUND).one()
    return Found(int(total + kept), n, max(last, kept_last, key=lambda t: t or -math.inf),
                 k)


def record_salvaged(tx: Tx, rank: int, token: str, task_id: int, testcases: int) -> None:
    """A run of `task_id` that is retried wrote `testcases` new files before it ended."""
    tx.db.execute("INSERT INTO salvaged (at, incarnation, rank, token, task_id, testcases) "
                  "VALUES (?, ?, ?, ?, ?, ?)",
                  (tx.now, tx.incarnation, rank, token, task_id, testcases))


# -- ranks -------------------------------------------------------------------------------------

def busy_ranks(conn: Connection) -> set[int]:
    """The ranks holding a dispatch now (one row each: the table holds what is in flight)."""
    return {r for (r,) in conn.exec_driver_sql("SELECT rank FROM dispatches")}


@dataclass(frozen=True)
class RankView:
    rank: int
    state: str
    incarnation: int
    host: str | None
    pid: int | None
    task_id: int | None        # the dispatch it holds, if any
    since: float | None        # when that dispatch was recorded
    busy: float | None         # fraction of `window_s` it held a dispatch (the master's sample)
    window_s: float | None
    load_at: float | None      # when the master wrote that fraction
    unrun_streak: int | None = None    # its host's answers in a row that ran nothing
    unrun_since: float | None = None
    unrun_detail: str | None = None    # what its host could not do


_RANKS = (
    "SELECT w.rank, w.state, w.incarnation, w.host, w.pid, d.task_id, d.created_at, "
    "l.busy, l.window_s, l.at, w.unrun_streak, w.unrun_since, w.unrun_detail "
    "FROM workers w "
    "LEFT JOIN dispatches d ON d.rank = w.rank "
    "LEFT JOIN rank_load l ON l.rank = w.rank AND l.incarnation = w.incarnation "
    "ORDER BY w.rank")


def read_ranks(conn: Connection) -> list[RankView]:
    """Every rank the master has dealt with: its row, the dispatch it holds, its load."""
    return [RankView(*row) for row in conn.exec_driver_sql(_RANKS)]


# -- the master's observations ----------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    at: float
    done: int
    testcases: int


_INSERT_OBSERVATION = (
    "INSERT INTO observations (at, incarnation, queued, active, done, deferred, failed, "
    "testcases) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
_REPLACE_LOAD = ("INSERT OR REPLACE INTO rank_load (rank, at, incarnation, window_s, busy) "
                 "VALUES (?, ?, ?, ?, ?)")


def record_observation(tx: Tx, tasks: dict[str, int], testcases: int,
                       loads: Iterable[tuple[int, float]], window_s: float) -> None:
    """One observation of the master: the counts it just read, and each rank's busy fraction
    over the last `window_s` (a fraction in [0, 1])."""
    tx.db.execute(_INSERT_OBSERVATION, (
        tx.now, tx.incarnation, tasks.get("queued", 0), tasks.get("active", 0),
        tasks.get("done", 0), tasks.get("deferred", 0), tasks.get("failed", 0), testcases))
    rows = [(rank, tx.now, tx.incarnation, window_s, min(1.0, max(0.0, busy)))
            for rank, busy in loads]
    if rows:
        tx.db.executemany(_REPLACE_LOAD, rows)


def read_samples(conn: Connection, incarnation: int, since: float) -> list[Sample]:
    """The observations of `incarnation` from `since` on, and its first one (its start),
    oldest first, through `ix_observations_incarnation_at`."""
    rows = conn.exec_driver_sql(
        "SELECT at, done, testcases FROM observations WHERE incarnation = :inc AND at >= :since "
        "UNION SELECT * FROM (SELECT at, done, testcases FROM observations "
        "WHERE incarnation = :inc ORDER BY at LIMIT 1) ORDER BY 1",
        {"inc": incarnation, "since": since}).all()
    return [Sample(at, done, tc) for at, done, tc in rows]


# -- the campaign's times --------------------------------------------------------------------

@dataclass(frozen=True)
class Times:
    created_at: float | None       # the campaign's first start
    incarnation_started_at: float | None
    #: The current incarnation's last sign of life after its start (`read_times`); None if
    #: nothing after the start was recorded.
    last_observed_at: float | None
    source: str | None              # campaign.settings' task source: demo, tasks or afl
    oldest_dispatch: tuple[int, int, float] | None  # (rank, task id, recorded at)


def read_times(conn: Connection) -> Times:
    created, incarnation, settings = conn.exec_driver_sql(
        "SELECT created_at, incarnation, settings FROM campaign").first() or (None, 0, None)
    started = conn.exec_driver_sql(
        f"SELECT max(at) FROM events WHERE kind = 'campaign' AND {COUNTED_KIND_SQL} "
        f"AND incarnation = ?", (incarnation,)).scalar()
    # The observations are seconds apart, and a master killed between two (kill -9) writes
    # no last one: 2 s and 77 results read "ran 0s". What it left in flight, and its latest
    # event (the last row of its table), say when it was last alive: O(in flight). The start
    # itself is no sign of having run: its `campaign` event (and what its transaction wrote)
    # and its first observation, which comes at once. A master killed before it wrote anything
    # else ran for a time nobody recorded, not 0 s.
    last = conn.exec_driver_sql(
        "SELECT max(at) FROM (SELECT max(at) AS at FROM observations WHERE incarnation = ?1 "
        "AND at > (SELECT min(at) FROM observations WHERE incarnation = ?1) "
        "UNION ALL SELECT max(coalesce(sent_at, created_at)) FROM dispatches "
        "WHERE incarnation = ?1 "
        "UNION ALL SELECT at FROM (SELECT at, incarnation FROM events "
        "ORDER BY id DESC LIMIT 1) WHERE incarnation = ?1)", (incarnation,)).scalar()
    if last is not None and started is not None and last <= started:
        last = None
    try:
        source = (json.loads(settings) or {}).get("source") if settings else None
    except ValueError:
        source = None
    oldest = conn.exec_driver_sql(
        "SELECT rank, task_id, created_at FROM dispatches ORDER BY created_at LIMIT 1").first()
    return Times(created, started, last, source, tuple(oldest) if oldest else None)


def results_by_status(conn: Connection, total: int) -> dict[str, int]:
    """Committed results by status, with the `ok` ones counted as the rest of `total`: the
    others are read through two ranges of `ix_results_status` (a million ok results are never
    read; `stats.result_statuses` reads them all)."""
    # Two ranges, not `<>` or an OR, which SQLite answers by reading every entry.
    counts = dict(conn.exec_driver_sql(
        "SELECT status, count(*) FROM results WHERE status < 'ok' GROUP BY status UNION ALL "
        "SELECT status, count(*) FROM results WHERE status > 'ok' GROUP BY status").all())
    ok = total - sum(counts.values())
    return {**({"ok": ok} if ok else {}), **counts}


def worker_state_counts(conn: Connection) -> dict[str, int]:
    return dict(conn.exec_driver_sql("SELECT state, count(*) FROM workers GROUP BY state").all())


@dataclass(frozen=True)
class Observed:
    """What one look at the campaign reads, in one read transaction."""

    stats: Stats
    found: Found
    worker_states: dict[str, int]
    times: Times
    results_by_status: dict[str, int]
    unrun_ranks: int = 0  # ranks whose host could not run their last answers' tasks

    @property
    def worker_deaths(self) -> int:
        return self.stats.worker_deaths


def read_observed(conn: Connection) -> Observed:
    """Counts, finds, ranks' states and the campaign's times: every read through a narrow
    index or a small table (tens of milliseconds at a million tasks, most of it counting the
    results)."""
    s = read_stats(conn)
    return Observed(s, read_found(conn), worker_state_counts(conn), read_times(conn),
                    results_by_status(conn, s.results), conn.exec_driver_sql(
                        "SELECT count(*) FROM workers WHERE unrun_streak IS NOT NULL").scalar())


# -- plots -------------------------------------------------------------------------------------

#: Bucket widths a plot may use, seconds: the first that gives at most `MAX_BUCKETS`.
_WIDTHS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600,
           43200, 86400)
MAX_BUCKETS = 240


@dataclass
class PlotSeries:
    """A campaign's history in `n` buckets of `width` seconds from `t0` (Unix time)."""

    t0: float
    width: float
    n: int
    done: list[int]            # results committed in each bucket
    not_ok: list[int]          # of those, status not ok
    created: list[int]         # tasks created in each bucket
    testcases: list[int]       # test cases written in each bucket (results and retried runs)
    busy: dict[int, list[float]]  # rank -> seconds of each bucket it held a dispatch
    events: dict[str, list[int]]  # what -> count per bucket (quarantine/<channel>, kinds)
    incarnations: list[tuple[int, float]] = field(default_factory=list)
    now: float | None = None

    def at(self, i: int) -> float:
        return self.t0 + i * self.width


@dataclass(frozen=True)
class Counted:
    """Tasks done and not done (queued, in flight or held) at `at`, as the master recorded
    them (an `observations` row), or as a live campaign's tables hold them now."""

    at: float
    incarnation: int
    done: int
    not_done: int


def read_counted(conn: Connection) -> list[Counted]:
    """The master's records of the tasks' counts, each run's in turn, through
    `ix_observations_incarnation_at` (a row every 10 s of a run): the plot's tasks chart
    draws them, as the rows cannot say what a requeue discarded."""
    return [Counted(*row) for row in conn.exec_driver_sql(
        "SELECT at, incarnation, done, queued + active + deferred + failed "
        "FROM observations ORDER BY incarnation, at")]


#: The events a plot shows over time: how a campaign went wrong, when.
PLOTTED_EVENTS = (EventKind.REQUEUED, EventKind.DEFERRED, EventKind.WATCHDOG,
                  EventKind.WORKER_RECOVERED, EventKind.WORKER_FAILED, EventKind.FAILED,
                  EventKind.TASK_FAILED, EventKind.INTERRUPTED)

_START = "coalesce(dispatched_at, sent_at, committed_at)"


def plot_series(conn: Connection, now: float | None = None) -> PlotSeries:
    """The campaign's history, aggregated in SQL: one read of `results` for its span, one
    that groups it by dispatch, then by rank and the buckets each dispatch began and ended in, one
    of `tasks` by creation bucket; the counted events and quarantined messages by kind and
    bucket. Python then only spreads the groups of dispatches longer than a bucket over the
    buckets they covered (a few per group)."""
    created_at = conn.exec_driver_sql("SELECT created_at FROM campaign").scalar()
    first_r, last_r = conn.exec_driver_sql(
        f"SELECT min({_START}), max(committed_at) FROM results").one()
    first_t = conn.exec_driver_sql(
        "SELECT min(created_at) FROM tasks WHERE id = (SELECT min(id) FROM tasks)").scalar()
    last_e = conn.exec_driver_sql("SELECT at FROM events ORDER BY id DESC LIMIT 1").scalar()
    last_d = conn.exec_driver_sql("SELECT max(created_at) FROM dispatches").scalar()
    last_o = conn.exec_driver_sql(
        "SELECT at FROM observations ORDER BY id DESC LIMIT 1").scalar()
    starts = [t for t in (created_at, first_r, first_t) if t is not None]
    ends = [t for t in (last_r, last_e, last_d, last_o, now if last_d is not None else None)
            if t is not None]
    # (A file with no campaign yet, made by `db upgrade`: its axis starts now, not in 1970.)
    t0 = min(starts) if starts else (now if now is not None else time.time())
    t1 = max(ends + [t0])
    span = max(t1 - t0, 1e-9)
    width = float(next((w for w in _WIDTHS if span / w <= MAX_BUCKETS), _WIDTHS[-1]))
    t0 = math.floor(t0 / width) * width  # buckets on round times
    n = max(1, int((t1 - t0) // width) + 1)
    params = {"t0": t0, "w": width}

    done, not_ok, testcases = [0] * n, [0] * n, [0] * n
    busy: dict[int, list[float]] = {}

    def spread(rank: int, bs: int, be: int, count: int, s_sum: float, e_sum: float) -> None:
        """`count` dispatches of `rank` that began in bucket bs and ended in be; s_sum and
        e_sum are their start and end times summed, relative to t0."""
        row = busy.setdefault(rank, [0.0] * n)
        bs, be = max(0, min(bs, n - 1)), max(0, min(be, n - 1))
        if bs == be:
            row[bs] += e_sum - s_sum
            return
        row[bs] += count * (bs + 1) * width - s_sum
        row[be] += e_sum - count * be * width
        for b in range(bs + 1, be):
            row[b] += count * width

    # A dispatch's results (one per task of its batch) share its times, and no two dispatches
    # of a rank share both: its busy time counts once, its results each.
    for rank, bs, be, count, s_sum, e_sum, results, tc, bad in conn.exec_driver_sql(
            f"SELECT rank, CAST((s - :t0) / :w AS INTEGER) AS bs, "
            f"CAST((e - :t0) / :w AS INTEGER) AS be, count(*), total(s - :t0), "
            f"total(e - :t0), sum(n), total(tc), sum(bad) "
            f"FROM (SELECT rank, {_START} AS s, committed_at AS e, count(*) AS n, "
            f"total(testcases) AS tc, sum(status <> 'ok') AS bad FROM results "
            f"GROUP BY rank, committed_at, {_START}) GROUP BY rank, bs, be", params):
        b = max(0, min(be, n - 1))
        done[b] += results
        not_ok[b] += bad or 0
        testcases[b] += int(tc)
        spread(rank, bs, be, count, s_sum, e_sum)
    for b, tc in conn.exec_driver_sql(  # (kept from runs that were retried)
            "SELECT CAST((at - :t0) / :w AS INTEGER), total(testcases) FROM salvaged "
            "GROUP BY 1", params):
        testcases[max(0, min(b, n - 1))] += int(tc)
    if now is not None:  # what is in flight counts as busy up to now
        for rank, bs, s in conn.exec_driver_sql(
                "SELECT rank, CAST((created_at - :t0) / :w AS INTEGER), created_at - :t0 "
                "FROM dispatches", params):
            spread(rank, bs, int((now - t0) // width), 1, s, now - t0)

    created = [0] * n
    for b, count in conn.exec_driver_sql(
            "SELECT CAST((created_at - :t0) / :w AS INTEGER) AS b, count(*) FROM tasks "
            "GROUP BY b", params):
        created[max(0, min(b, n - 1))] += count

    events: dict[str, list[int]] = {}
    kinds = ", ".join(f"'{k.value}'" for k in PLOTTED_EVENTS)
    for kind, b, count in conn.exec_driver_sql(
            f"SELECT kind, CAST((at - :t0) / :w AS INTEGER) AS b, count(*) FROM events "
            f"WHERE {COUNTED_KIND_SQL} AND kind IN ({kinds}) GROUP BY kind, b", params):
        events.setdefault(kind, [0] * n)[max(0, min(b, n - 1))] += count
    for channel, b, count in conn.exec_driver_sql(
            # A row stands for its `repeats` messages past a rank's first 100 of a kind.
            "SELECT channel, CAST((at - :t0) / :w AS INTEGER) AS b, total(repeats) "
            "FROM quarantine GROUP BY channel, b", params):
        events.setdefault(f"quarantine/{channel}", [0] * n)[max(0, min(b, n - 1))] += int(count)
    incarnations = [tuple(r) for r in conn.exec_driver_sql(
        f"SELECT incarnation, min(at) FROM events WHERE kind = 'campaign' AND "
        f"{COUNTED_KIND_SQL} GROUP BY incarnation ORDER BY incarnation")]
    return PlotSeries(t0, width, n, done, not_ok, created, testcases, busy, events,
                      incarnations, now)  # type: ignore[arg-type]
