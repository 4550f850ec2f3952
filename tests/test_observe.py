"""What a running campaign shows, on campaign files made by the real master: `status --json`'s
figures, the stats file, the plain progress lines, the metrics file, and the rates' arithmetic.
"""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path

import pytest
from campaigns import copy_of, finding_campaign
from prometheus_client.parser import text_string_to_metric_families

from coordinator.cli import main
from coordinator.exits import ExitStatus
from coordinator.progress import (
    Progress,
    Snapshot,
    eta_s,
    progress_line,
    rate_over,
    rates,
)
from store.campaign import Store
from store.engine import read_file
from store.observe import Found, Sample, plot_series, read_observed
from store.stats import read_stats, stats_text
from store.tasks import NewTask, enqueue_tasks


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("observe")
    db = d / "c.db"
    summary = finding_campaign(db, metrics_file=d / "c.prom")
    assert summary.committed == 300
    return db


def _status(db: Path, capsys) -> dict:
    assert main(["status", "--db", str(db), "--json"]) == ExitStatus.OK
    return json.loads(capsys.readouterr().out)


def _stats(db: Path):
    return read_file(db, read_stats)[0]


def _rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return c.execute(sql).fetchall()


def test_the_stats_file_keeps_the_six_labels_first_then_the_progress_fields(campaign):
    text = campaign.with_name(campaign.name + ".stats").read_text()
    six = stats_text(_stats(campaign))
    assert text.startswith(six)  # byte for byte
    other, *rest = text[len(six):].splitlines()
    assert other == "Quarantined other messages: 0"
    assert [line.split(":")[0] for line in rest] == [
        "Elapsed", "Tasks", "Rate", "ETA", "Test cases", "Quarantined messages", "Parked ranks"]
    assert rest[1] == "Tasks: 300 done, 0 queued, 0 active, 0 deferred, 0 failed"
    assert rest[4].startswith("Test cases: 60 (the last ")
    assert rest[5] == "Quarantined messages: 17"


def test_the_metrics_file_parses_and_its_counters_equal_status_json(campaign, capsys):
    text = campaign.with_name("c.prom").read_text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    got = _status(campaign, capsys)

    def value(family: str, sample: str | None = None, **labels: str) -> float:
        found = [s.value for s in families[family].samples
                 if s.name == (sample or family) and labels.items() <= s.labels.items()]
        assert len(found) == 1, (family, labels, found)
        return found[0]

    for family in families.values():
        assert family.name.startswith("coordinator_")
        assert all(s.labels.get("campaign") == "c.db" for s in family.samples)
    assert families["coordinator_results"].type == "counter"
    for state, n in got["tasks"].items():
        assert value("coordinator_tasks", state=state) == n
    for status, n in got["results_by_status"].items():
        assert value("coordinator_results", "coordinator_results_total", status=status) == n
    for channel, reasons in got["quarantine"].items():
        for reason, n in reasons.items():
            assert value("coordinator_quarantined_messages",
                         "coordinator_quarantined_messages_total",
                         channel=channel, reason=reason) == n
    for family, key in (("coordinator_requeues", "requeued"),
                        ("coordinator_deferrals", "deferred"),
                        ("coordinator_watchdog_timeouts", "watchdog_timeouts"),
                        ("coordinator_watchdog_recoveries", "watchdog_recoveries"),
                        ("coordinator_worker_deaths", "worker_deaths"),
                        ("coordinator_testcases_dropped", "dropped_testcases")):
        assert value(family, family + "_total") == got[key], family
    assert value("coordinator_testcases_written",
                 "coordinator_testcases_written_total") == got["testcases"]["written"]
    assert value("coordinator_last_find_timestamp_seconds") == pytest.approx(
        got["testcases"]["last_at"])
    assert value("coordinator_running") == 0 and value("coordinator_active_ranks") == 0
    assert value("coordinator_ranks_unable_to_run") == sum(
        r["unrun"] is not None for r in got["ranks"])
    assert value("coordinator_commit_duration_seconds", "coordinator_commit_duration_seconds_count"
                 ) > 100  # a commit per round: 300 tasks on 3 ranks
    assert families["coordinator_commit_duration_seconds"].type == "summary"


def test_the_metrics_count_ranks_not_tasks_and_every_quarantine_channel():
    """`coordinator_active_ranks` was the active tasks (100 for 2 ranks holding batches of
    50), and the quarantine counter left out the stop_ack and other channels (79 against
    status's 82)."""
    from coordinator.metrics import metrics_text
    from coordinator.progress import Snapshot
    from store.stats import Stats

    stats = Stats(tasks={"queued": 0, "active": 100, "done": 5, "deferred": 0, "failed": 0},
                  results=5, quarantine={"result": {"stale": 4}, "ready": {},
                                         "stop_ack": {"stale": 3}, "other": {"foreign_tag": 2}},
                  requeued=0, deferred=0, watchdog_timeouts=0, watchdog_recoveries=0,
                  incarnation=1, schema_revision=None, dispatches=2)
    text = metrics_text(Snapshot(at=1.0, stats=stats, found=Found(0, 0, None), started_at=0.0,
                                 rates={}, finite=True, unrun_ranks=1), "c.db")
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert [s.value for s in samples if s.name == "coordinator_ranks_unable_to_run"] == [1]
    quarantined = {(s.labels["channel"], s.labels["reason"]): s.value for s in samples
                   if s.name == "coordinator_quarantined_messages_total"}
    assert {k: v for k, v in quarantined.items() if v} == {
        ("result", "stale"): 4, ("stop_ack", "stale"): 3, ("other", "foreign_tag"): 2}
    assert [s.value for s in samples if s.name == "coordinator_active_ranks"] == [2]


def test_every_series_is_in_the_metrics_file_from_the_first_write_at_zero():
    """Prometheus takes no `rate()` of a series' first appearance, and an alert on
    `coordinator_tasks{state="failed"} > 0` needs the series: a campaign that has counted
    nothing yet still writes every state, status and refusal it can count, at 0."""
    from coordinator.metrics import metrics_text
    from coordinator.progress import Snapshot
    from coordinator.wire import RESULT_STATUSES
    from store.stats import Stats
    from store.vocabulary import QuarantineReason, TaskState, WorkerState

    stats = Stats(tasks={"queued": 7}, results=0, quarantine={}, requeued=0, deferred=0,
                  watchdog_timeouts=0, watchdog_recoveries=0, incarnation=1,
                  schema_revision=None, dispatches=0)
    text = metrics_text(Snapshot(at=1.0, stats=stats, found=Found(0, 0, None), started_at=0.0,
                                 rates={}, finite=True, ranks={"idle": 3}), "c.db")
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def series(name: str, label: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in samples if s.name == name}

    assert series("coordinator_tasks", "state") == {**{s.value: 0 for s in TaskState},
                                                    "queued": 7}
    assert series("coordinator_ranks", "state") == {**{s.value: 0 for s in WorkerState},
                                                    "idle": 3}
    assert series("coordinator_results_total", "status") == dict.fromkeys(RESULT_STATUSES, 0)
    assert [s.value for s in samples if s.name == "coordinator_ranks_unable_to_run"] == [0]
    refused = {(s.labels["channel"], s.labels["reason"]): s.value for s in samples
               if s.name == "coordinator_quarantined_messages_total"}
    assert set(refused.values()) == {0}
    assert {r for c, r in refused if c in ("ready", "result")} == {
        r.value for r in QuarantineReason} - {"foreign_tag"}
    assert ("result", "payload") in refused and ("ready", "payload") not in refused
    assert ("stop_ack", "stale") in refused and ("other", "foreign_tag") in refused


def test_progress_lines_are_plain_and_say_what_the_snapshot_says(campaign):
    seen = read_file(campaign, read_observed)[0]
    now = seen.found.last_at + 12
    snap = Snapshot(at=now, stats=seen.stats, found=seen.found, started_at=now - 3723,
                    rates={"last_minute": 2.5, "last_hour": 2.0, "overall": 1.5},
                    finite=True, ranks={"parked": 1, "busy": 2})
    out = io.StringIO()
    p = Progress(live=False, interval_s=30, stream=out)
    p.start()
    p.update(snap)
    line = out.getvalue()
    assert line.count("\n") == 1 and "\x1b" not in line
    assert line == ("coordinator: progress elapsed=1h02m03s done=300 queued=0 active=0 "
                    "deferred=0 failed=0 rate_1m=2.5/s eta=0s testcases=60 last_find=12s_ago "
                    "quarantined=17 parked=1\n")
    assert progress_line(snap) + "\n" == line


def test_rates_are_taken_from_the_latest_sample_old_enough():
    samples = [Sample(0.0, 0, 0), Sample(10.0, 100, 0), Sample(50.0, 500, 0),
               Sample(100.0, 900, 0)]
    assert rate_over(samples, 110.0, 1000, 60.0) == pytest.approx((1000 - 500) / 60)
    assert rate_over(samples, 110.0, 1000, None) == pytest.approx(1000 / 110)
    # Younger than the window: since the first sample.
    assert rate_over(samples, 110.0, 1000, 3600.0) == pytest.approx(1000 / 110)
    assert rate_over([Sample(10.0, 5, 0)], 10.05, 6, 60.0) is None  # too short a span
    assert rate_over([], 10.0, 6, 60.0) is None
    assert set(rates(samples, 110.0, 1000)) == {"last_minute", "last_hour", "overall"}
    tasks = {"queued": 90, "active": 10}
    assert eta_s(tasks, 20.0, True) == 5.0
    assert eta_s(tasks, 20.0, False) is None and eta_s(tasks, None, True) is None
    assert eta_s({"queued": 0, "active": 0}, None, True) == 0.0


def test_a_fall_of_done_gives_no_negative_rate_nor_eta():
    """`coordinator requeue --state error` on a running campaign discards results: the done
    count fell, and the rates (differences of it) read -5.26/s, the ETA -1d23h13m."""
    samples = [Sample(0.0, 0, 0), Sample(30.0, 3000, 0), Sample(60.0, 2000, 0),
               Sample(90.0, 2500, 0)]
    assert rate_over(samples, 120.0, 3000, 60.0) == pytest.approx((3000 - 2000) / 60)
    assert rate_over(samples, 120.0, 3000, None) == pytest.approx((3000 - 2000) / 60)
    assert rate_over(samples, 120.0, 2400, 60.0) is None  # fell since the last sample
    assert eta_s({"queued": 10}, -5.0, True) is None and eta_s({"queued": 10}, 0.0, True) is None


def test_no_eta_while_every_rank_is_parked_or_dead():
    """The last minute's rate went on giving an ETA after the watchdog had parked every rank:
    nothing runs until one comes back, so the ETA is unknown."""
    from coordinator.progress import Snapshot
    from store.stats import Stats

    stats = Stats(tasks={"queued": 90, "active": 10, "done": 5}, results=5, quarantine={},
                  requeued=0, deferred=0, watchdog_timeouts=3, watchdog_recoveries=0,
                  incarnation=1, schema_revision=None, dispatches=0)

    def eta(**ranks: int) -> float | None:
        return Snapshot(at=1.0, stats=stats, found=Found(0, 0, None), started_at=0.0,
                        rates={"last_minute": 20.0}, finite=True, ranks=ranks).eta_s

    assert eta(busy=1, parked=2) == eta(idle=3) == eta() == 5.0
    assert eta(parked=3) is None and eta(parked=2, failed=1) is None


def test_plot_series_adds_up_to_the_campaigns_rows(campaign):
    s = read_file(campaign, plot_series)[0]
    assert sum(s.done) == 300 and sum(s.not_ok) == 13 and sum(s.testcases) == 60
    assert sum(s.created) == 300
    assert sum(s.events["quarantine/result"]) == 17
    [(busy,)] = _rows(campaign, "SELECT total(committed_at - dispatched_at) FROM results")
    assert sum(sum(row) for row in s.busy.values()) == pytest.approx(busy)
    assert sorted(s.busy) == [1, 2, 3] and s.incarnations[0][0] == 1


def test_the_plot_of_a_file_with_no_campaign_yet_starts_now(tmp_path):
    """A file `db upgrade` made holds no campaign: its plot's axis began in 1970."""
    import time

    from store.versioning import upgrade

    path = tmp_path / "empty.db"
    upgrade(path)
    before = time.time()
    s = read_file(path, plot_series)[0]
    assert before - 3600 <= s.t0 <= time.time() and sum(s.done) == 0


def test_plot_series_counts_a_flood_as_status_does(campaign, tmp_path):
    """Past a rank's first 100 messages of a kind, a quarantine row counts the rest in its
    `repeats`: the chart counted rows (19 against status's 68)."""
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:
        c.execute("UPDATE quarantine SET repeats = 50 WHERE id = (SELECT min(id) FROM "
                  "quarantine WHERE channel = 'result')")
        c.execute("INSERT INTO quarantine (at, incarnation, channel, reason, rank, repeats) "
                  "SELECT max(at), 1, 'stop_ack', 'stale', 1, 3 FROM quarantine")
    s = read_file(copy, plot_series)[0]
    stats = read_file(copy, read_stats)[0]
    assert sum(s.events["quarantine/result"]) == sum(stats.quarantine["result"].values()) == 66
    assert sum(s.events["quarantine/stop_ack"]) == 3


def test_a_batch_counts_its_dispatch_time_once_and_each_of_its_results(tmp_path):
    """Every task of a batch has a result row with its dispatch's times: a rank's busy time
    is its dispatches' (the view read 8× too much in batches of 8, and the chart showed such
    ranks busy all the time), its results are counted one by one."""
    from fakes import InstantWorkers

    from coordinator.master import Master, MasterConfig
    from coordinator.sources import demo_tasks

    db = tmp_path / "batched.db"
    store = Store.open(db)
    try:
        with store.transaction("import") as tx:
            enqueue_tasks(tx, [t.as_task() for t in demo_tasks(64)])
        assert Master(store, InstantWorkers(2), MasterConfig(
            stats_file=tmp_path / "stats", linger_s=0, grace_s=1, stop_wait_s=1,
            batch=8)).run().committed == 64
    finally:
        store.close()
    with sqlite3.connect(db) as c:  # each dispatch ran 2 s: every row of a batch says so
        c.execute("UPDATE results SET dispatched_at = committed_at - 2.0")
    dispatches = {rank: n for rank, n in _rows(
        db, "SELECT rank, count(DISTINCT token) FROM results GROUP BY rank")}
    assert sum(dispatches.values()) == 8

    s = read_file(db, plot_series)[0]
    assert sum(s.done) == 64
    assert sum(sum(row) for row in s.busy.values()) == pytest.approx(8 * 2.0)  # not 64 × 2

    rows = _rows(db, "SELECT rank, results, dispatches, busy_s, mean_task_s "
                     "FROM rank_utilisation")
    assert sum(r[1] for r in rows) == 64
    for rank, results, n, busy_s, mean_task_s in rows:
        assert n == dispatches[rank]
        assert busy_s == pytest.approx(2.0 * n)
        assert mean_task_s == round(2.0 * n / results, 3)


def test_a_dispatch_longer_than_a_bucket_is_spread_over_the_buckets_it_covered(tmp_path):
    """A run of 25 s in buckets of 1 s adds a second to each bucket it spans: the chart of
    a rank's load shows it busy all along, not 25 s in one bucket."""
    db = tmp_path / "long.db"
    finding_campaign(db, tasks=3, workers=1)
    with sqlite3.connect(db) as c:
        c.execute("UPDATE results SET dispatched_at = committed_at - 25.5 WHERE task_id = 1")
    s = read_file(db, plot_series)[0]
    assert s.width == 1.0
    row = s.busy[1]
    assert max(row) <= 1.0 + 1e-9
    assert sum(1 for v in row if v > 0.999) >= 24


def test_found_counts_only_results_that_wrote_test_cases():
    assert Found(0, 0, None).last_at is None


def test_the_live_display_shows_the_fields_it_lacked(campaign):
    """Elapsed, ETA, test cases and the last find, beside what it showed before."""
    from rich.console import Console

    from coordinator.progress import _table

    seen = read_file(campaign, read_observed)[0]
    snap = Snapshot(at=seen.found.last_at + 5, stats=seen.stats, found=seen.found,
                    started_at=seen.found.last_at - 60, rates={"last_minute": 3.0},
                    finite=True, ranks={})
    out = io.StringIO()
    Console(file=out, width=120, force_terminal=False).print(_table(snap))
    text = out.getvalue()
    for field in ("elapsed", "1m05s", "ETA", "0s", "test cases", "60", "last find", "5s ago",
                  "done", "300", "quarantined", "result 17 / ready 0"):
        assert field in text, (field, text)


def test_the_store_times_its_commits_and_keeps_the_longest_past_a_peak_taken(tmp_path):
    store = Store.open(tmp_path / "c.db", synchronous="FULL")
    try:
        before = store.commit_times.count
        for i in range(3):
            with store.transaction("import") as tx:
                enqueue_tasks(tx, [NewTask({"data": f"task {i}"})])
        times = store.commit_times
        assert times.count == before + 3
        assert times.total_s > 0 and times.total_s / times.count <= times.max_s
        assert times.take_peak() == times.max_s > 0
        assert times.peak_s == 0 and times.max_s > 0  # the metrics' peak restarts, not the max
    finally:
        store.close()


def test_the_start_observation_writes_no_busy_figure_before_the_samples_cover_an_interval(
        farm):
    """The start's observation comes at once, on one sample taken before any rank was given
    work: `status` showed every rank "busy 0%" (as of 7 s ago) beside ranks busy for 2–6 s,
    until the next observation. Now a rank's figure comes once the samples cover an
    observation interval, and at the run's end whatever they cover."""
    from coordinator.observer import Observer
    from store.observe import read_ranks

    def busy() -> dict[int, tuple]:
        with farm.store.reading() as conn:
            return {r.rank: (r.busy, r.window_s) for r in read_ranks(conn)}

    farm.enqueue(*({"data": i} for i in range(4)))
    farm.ready(1)
    farm.ready(2)
    observer = Observer(farm.store, lambda: [1, 2], interval_s=10.0, window_s=300.0)
    observer.sample_busy(100.0)  # before any dispatch
    observer.record(observer.read())
    assert busy() == {1: (None, None), 2: (None, None)}
    farm.dispatch(1, 2, sent=True)
    for t in range(101, 111):
        observer.sample_busy(float(t))
    observer.record(observer.read())  # 11 samples, 10 of them busy, over 11 s
    assert busy() == {1: (pytest.approx(10 / 11), 11.0), 2: (pytest.approx(10 / 11), 11.0)}

    end = Observer(farm.store, lambda: [1, 2], interval_s=10.0, window_s=300.0)
    end.sample_busy(200.0)
    end.record(end.read(running=False))  # a run's last observation: written, however short
    assert busy() == {1: (1.0, 1.0), 2: (1.0, 1.0)}
