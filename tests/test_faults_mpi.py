"""Fault injection and real faults under real mpiexec: every fault kind of
`coordinator.faults.KINDS`, a worker stopped by SIGSTOP from outside, a poison task, and a
database that cannot grow (RLIMIT_FSIZE on the master).

Each test asserts the exact consequence in the database: which quarantine rows, with which
channel, reason, token and expected token; which events for which dispatch; what the task and
worker rows hold at the end; and that `coordinator status --json` says the same.

The seeds are fixed, so the faults each rank injects are the same on every run: the k-th RESULT
a rank sends gets the k-th draw of its own generator (seed * 1_000_003 + rank). How many tasks
each rank gets still depends on timing, so every seed below was chosen (by replaying
`FaultySender` offline) so that each rank's first fault comes within its first few tasks; the
assertions compare the database with the fault log (`--inject-log`), never with a fixed count.

Every test is bounded twice: the job by mpi_jobs (killed past its wall-clock bound) and the
test by pytest-timeout. Under Open MPI the jobs run with ULFM (`--with-ft ulfm`, what
`coordinator run` does when it launches itself); under MPICH a dead rank takes the job down.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mpi_jobs import (
    MPIEXEC,
    Done,
    Job,
    check_conservation,
    kill_job,
    kill_ranks,
    master_pid,
    mpi_kind,
    quarantined,
    query,
    ranks_of,
    run,
    start,
    status_json,
    wait_for,
)
from processes import running

from coordinator.faults import KINDS
from coordinator.launcher import mpiexec_flags
from store.audit import audit_path

pytestmark = [pytest.mark.mpi]

N = 30  # demo tasks per fault-kind campaign
FAULT_JOB_S = 90  # wall-clock bound of one job (a healthy one takes 2-12 s)
RETRY_ALL = ["--retries", "16", "--max-attempts", "50"]  # recoveries never defer or fail
COVERED: set[str] = set()  # fault kinds exercised below (checked by the last test)


def covers(*kinds: str) -> list[str]:
    """Parametrize values: the fault kinds a test exercises (registered at import)."""
    COVERED.update(kinds)
    return list(kinds)


def covering(*kinds: str):
    """Decorator: the test exercises these fault kinds (registered at import)."""
    COVERED.update(kinds)
    return lambda test: test


# -- helpers -----------------------------------------------------------------------------------

def fault_log(log_dir: Path) -> list[dict]:
    """Every fault the workers injected, from DIR/faults-rank<R>.jsonl."""
    out = []
    for f in sorted(log_dir.glob("faults-rank*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def logged(log: list[dict], kind: str) -> list[str]:
    return [r["token"] for r in log if r["kind"] == kind]


def event_tokens(db: Path, kind: str) -> list[str]:
    return sorted(t for (t,) in query(db, f"SELECT token FROM events WHERE kind = '{kind}'"))


def event_counts(db: Path) -> dict[str, int]:
    return dict(query(db, "SELECT kind, count(*) FROM events GROUP BY kind"))


def quarantine_rows(db: Path) -> list[tuple]:
    """(channel, reason, rank, token, expected, detail), oldest first."""
    return query(db, "SELECT channel, reason, rank, token, expected, detail FROM quarantine "
                     "ORDER BY id")


def dispatched_to(db: Path, rank: int) -> list[str]:
    """Tokens of every dispatch to `rank`, in dispatch order: each is recorded by its result
    (committed), its `dispatched` event (ended otherwise) or its dispatch row (in flight)."""
    return [t for (t,) in query(db, f"SELECT token FROM (SELECT token, at AS t FROM events "
                                    f"WHERE kind = 'dispatched' AND rank = {rank} UNION ALL "
                                    f"SELECT token, dispatched_at FROM results WHERE rank = "
                                    f"{rank} UNION ALL SELECT token, created_at FROM dispatches "
                                    f"WHERE rank = {rank}) ORDER BY t")]


def assert_status_agrees(db: Path) -> dict:
    """`coordinator status --json` says what the rows say: it prints the statistics that the
    store's audit found equal to the rows they count."""
    report = audit_path(db)
    assert report.violations == [], report.text()
    s = status_json(db)
    assert {k: s[k] for k in report.stats.as_json()} == report.stats.as_json()
    return s


def assert_each_task_committed_once(db: Path, n: int) -> None:
    check_conservation(db, expected_tasks=n)
    assert query(db, "SELECT count(*), count(DISTINCT task_id), count(DISTINCT token) "
                     "FROM results") == [(n, n, n)]
    assert query(db, "SELECT count(*) FROM tasks WHERE state = 'done'") == [(n,)]


#: One task per dispatch: each injected fault then hits one task, whose fate the tests follow
#: (demo tasks are batched by default; faults in batches: test_batches.py and the campaign).
SINGLE = ["--batch", "1"]


def campaign(tmp_path: Path, inject: str, seed: int, *extra: str, n: int = N,
             timeout: float = FAULT_JOB_S) -> tuple[Path, list[dict], Done]:
    db, log_dir = tmp_path / "c.db", tmp_path / "faults"
    done = run(["run", "--db", str(db), "--demo", str(n), "--no-progress", *SINGLE,
                "--inject", inject,
                "--inject-seed", str(seed), "--inject-log", str(log_dir), *extra],
               timeout=timeout)
    return db, fault_log(log_dir), done


def finish_after_master(proc: subprocess.Popen, db: Path, timeout: float,
                        grace: float) -> tuple[Done, bool]:
    """For a job whose master ends it with MPI_Abort: wait (bounded) for the master process to
    exit, then up to `grace` s for mpiexec; kill whatever is left. Returns the output and
    whether mpiexec ended by itself."""
    deadline = time.monotonic() + timeout
    out = err = ""
    ended = False
    try:
        master = master_pid(db)
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                ended = True
                break
            except subprocess.TimeoutExpired:
                pass
            if not running(master):
                try:
                    out, err = proc.communicate(timeout=grace)
                    ended = True
                except subprocess.TimeoutExpired:
                    pass
                break
            if time.monotonic() > deadline:
                kill_job(proc)
                kill_ranks(db)
                out, err = proc.communicate(timeout=30)
                raise AssertionError(f"master did not exit in {timeout} s\n--- stderr\n"
                                     f"{err[-4000:]}")
    finally:
        kill_job(proc)
        kill_ranks(db)
    if not ended:
        out, err = proc.communicate(timeout=30)
    return Done(proc.returncode, out, err), ended


# -- 1. every fault kind -----------------------------------------------------------------------

#: RESULT shapes that set the invalid mark (R2) and their quarantine reason.
INVALID_RESULT = {
    "result_missing_token": "missing",
    "result_bad_token": "malformed",
    "result_list_token": "malformed",
    "result_not_mapping": "malformed",
    "result_garbage": "malformed",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", covers(*INVALID_RESULT))
def test_an_invalid_result_is_quarantined_joined_with_its_ready_and_retried(tmp_path, kind):
    db, log, done = campaign(tmp_path, f"{kind}=0.3", 1, *RETRY_ALL)
    assert done.returncode == 0, done.stderr[-3000:]
    faulted = logged(log, kind)
    assert faulted and len(set(faulted)) == len(faulted)
    assert {r["kind"] for r in log} == {kind}
    reason = INVALID_RESULT[kind]

    rows = quarantine_rows(db)
    # one quarantine row per faulted dispatch, recorded against that dispatch's token
    assert sorted(r[4] for r in rows) == sorted(faulted)
    assert {(r[0], r[1]) for r in rows} == {("result", reason)}
    for _channel, _, rank, token, expected, detail in rows:
        assert expected in dispatched_to(db, rank)
        if kind == "result_bad_token":
            assert token == expected.upper()
        elif kind == "result_list_token":
            # the typed decoder names the field and what it got
            assert token is None and detail.startswith("wrong shape") and "$.token" in detail
            assert "got `array`" in detail
        elif kind == "result_garbage":
            assert token is None and detail.startswith("undecodable")
        elif kind == "result_not_mapping":
            assert token is None and detail == "wrong shape: Expected `object`, got `array`"
        else:  # no token at all
            assert token is None and detail is None

    # R2-R7: invalid mark, joined with the current READY, rolled back, requeued at the head
    invalid = query(db, "SELECT token, detail FROM events WHERE kind = 'invalid'")
    assert sorted(invalid) == sorted((t, reason) for t in faulted)
    assert event_tokens(db, "recovered") == sorted(faulted)
    assert event_tokens(db, "requeued") == sorted(faulted)
    ev = event_counts(db)
    for kind_absent in ("watchdog", "deferred", "failed", "worker_recovered", "interrupted"):
        assert kind_absent not in ev
    # an attempt per faulted dispatch, one extra dispatch each, and every task committed once
    assert query(db, "SELECT sum(attempts), sum(dispatches) FROM tasks") == \
        [(len(faulted), N + len(faulted))]
    assert_each_task_committed_once(db, N)
    assert not set(faulted) & {t for (t,) in query(db, "SELECT token FROM results")}

    s = assert_status_agrees(db)
    assert s["quarantine"] == quarantined(result={reason: len(faulted)})
    assert s["requeued"] == len(faulted)
    stats = (tmp_path / "c.db.stats").read_text()
    assert f"Quarantined worker results: {len(faulted)} ({reason}={len(faulted)})\n" in stats
    assert f"Protocol-requeued dispatches: {len(faulted)}\n" in stats


@pytest.mark.timeout(120)
@covering("result_stale")
def test_a_stale_result_is_quarantined_and_its_dispatch_retired_by_the_watchdog(tmp_path):
    # A stale RESULT proves nothing about the current dispatch: quarantined, no invalid mark,
    # so READY(current) does not recover it; only the watchdog does. The READY was seen, so
    # the rank is idle again at once (not parked).
    kind = "result_stale"
    db, log, done = campaign(tmp_path, f"{kind}=0.2", 6, "--watchdog", "1", *RETRY_ALL)
    assert done.returncode == 0, done.stderr[-3000:]
    faulted = logged(log, kind)
    assert faulted

    rows = quarantine_rows(db)
    assert {(r[0], r[1]) for r in rows} == {("result", "stale")}
    assert sorted(r[4] for r in rows) == sorted(faulted)
    for _, _, rank, token, expected, _ in rows:
        mine = dispatched_to(db, rank)
        # the replayed token is an earlier dispatch of the same rank, never the current one
        assert token in mine and expected in mine
        assert mine.index(token) < mine.index(expected)

    assert event_tokens(db, "watchdog") == sorted(faulted)
    assert event_tokens(db, "requeued") == sorted(faulted)
    # said on the console too (a run whose ranks all hang was silent)
    assert done.stderr.count("passed its --watchdog deadline (1 s); task ") == len(faulted)
    assert done.stderr.count("the rank had answered READY and gets new work") == len(faulted)
    ev = event_counts(db)
    for absent in ("invalid", "recovered", "worker_recovered", "deferred", "failed"):
        assert absent not in ev
    assert query(db, "SELECT DISTINCT state FROM workers") == [("stopped",)]
    assert query(db, "SELECT sum(attempts) FROM tasks") == [(len(faulted),)]
    assert_each_task_committed_once(db, N)
    s = assert_status_agrees(db)
    assert s["quarantine"] == quarantined(result={"stale": len(faulted)})
    assert (s["watchdog_timeouts"], s["watchdog_recoveries"]) == (len(faulted), 0)


@pytest.mark.timeout(120)
@covering("result_duplicate")
def test_a_duplicate_result_commits_once_and_the_copy_is_quarantined(tmp_path):
    # The copy arrives after the commit: `unowned` if the rank holds no dispatch by then,
    # `stale` (a valid token that is not the current one) if it already holds its next one.
    kind = "result_duplicate"
    db, log, done = campaign(tmp_path, f"{kind}=0.3", 1)
    assert done.returncode == 0, done.stderr[-3000:]
    faulted = logged(log, kind)
    assert faulted

    rows = quarantine_rows(db)
    assert sorted(r[3] for r in rows) == sorted(faulted)  # one copy quarantined per duplicate
    assert {(r[0], r[1]) for r in rows} <= {("result", "unowned"), ("result", "stale")}
    committed = dict(query(db, "SELECT token, rank FROM results"))
    for _, reason, rank, token, expected, _ in rows:
        assert committed[token] == rank  # the original committed, from that rank
        if reason == "unowned":
            assert expected is None
        else:
            mine = dispatched_to(db, rank)
            assert mine.index(token) < mine.index(expected)
    ev = event_counts(db)
    for absent in ("invalid", "recovered", "requeued", "watchdog", "deferred"):
        assert absent not in ev
    assert query(db, "SELECT sum(attempts), sum(dispatches) FROM tasks") == [(0, N)]
    assert_each_task_committed_once(db, N)
    s = assert_status_agrees(db)
    assert sum(s["quarantine"]["result"].values()) == len(faulted)
    assert s["quarantine"]["ready"] == {}


@pytest.mark.timeout(120)
@covering("result_drop")
def test_a_dropped_result_is_retired_by_the_watchdog_and_the_task_completes(tmp_path):
    kind = "result_drop"
    db, log, done = campaign(tmp_path, f"{kind}=0.15", 5, "--watchdog", "1", *RETRY_ALL)
    assert done.returncode == 0, done.stderr[-3000:]
    dropped = logged(log, kind)
    assert dropped

    assert quarantine_rows(db) == []
    assert event_tokens(db, "watchdog") == sorted(dropped)
    assert event_tokens(db, "requeued") == sorted(dropped)
    # its READY was seen, so the retired rank was free at once: never parked
    assert query(db, "SELECT DISTINCT detail FROM events WHERE kind = 'watchdog'") == [
        ("watchdog deadline (READY seen)",)]
    ev = event_counts(db)
    assert ev["watchdog"] == len(dropped) > 0
    for absent in ("invalid", "recovered", "worker_recovered", "deferred", "failed"):
        assert absent not in ev
    assert query(db, "SELECT DISTINCT state FROM workers") == [("stopped",)]
    assert_each_task_committed_once(db, N)
    s = assert_status_agrees(db)
    assert (s["watchdog_timeouts"], s["watchdog_recoveries"]) == (len(dropped), 0)
    assert s["requeued"] == len(dropped)


@pytest.mark.timeout(120)
@covering("ready_malformed")
def test_a_malformed_ready_is_quarantined_and_the_heartbeat_frees_the_rank(tmp_path):
    # Each one costs its rank a heartbeat (5 s): seed 1638 gives one or two in 30 tasks.
    kind = "ready_malformed"
    db, log, done = campaign(tmp_path, f"{kind}=0.05", 1638)
    assert done.returncode == 0, done.stderr[-3000:]
    faulted = logged(log, kind)
    assert faulted

    rows = quarantine_rows(db)
    assert len(rows) == len(faulted)  # malformed even when no dispatch is active
    for channel, reason, _rank, token, expected, detail in rows:
        assert (channel, reason, token) == ("ready", "malformed", None)
        assert detail.startswith("wrong shape") and "$.completed_dispatch_token" in detail
        assert expected is None or expected in faulted
    ev = event_counts(db)
    for absent in ("invalid", "recovered", "requeued", "watchdog", "deferred"):
        assert absent not in ev
    assert query(db, "SELECT sum(attempts), sum(dispatches) FROM tasks") == [(0, N)]
    assert_each_task_committed_once(db, N)
    s = assert_status_agrees(db)
    assert s["quarantine"] == quarantined(ready={"malformed": len(faulted)})


@pytest.mark.timeout(120)
@covering("ready_stale")
@pytest.mark.parametrize("inject, seed, at_least", [
    ("ready_stale=0.2", 461, 0),
    ("reorder=1,ready_stale=0.2", 2642, 1),
], ids=["after-result", "before-result"])
def test_a_stale_ready_is_quarantined_while_its_dispatch_is_active(tmp_path, inject, seed,
                                                                   at_least):
    # A READY replaying an earlier token is `stale` while the current dispatch is active; once that
    # dispatch's RESULT has committed the rank holds no dispatch, and docs/protocol.md §3 makes any
    # valid old token `idle`. Sent after its RESULT (the worker's order), which of the two a replay
    # meets depends on which the master applies first (MPI orders messages per tag only), so any
    # number of stale rows up to the replays is right. With `reorder` the replayed READY leaves
    # before the RESULT: then it is stale.
    kind = "ready_stale"
    db, log, done = campaign(tmp_path, inject, seed)
    assert done.returncode == 0, done.stderr[-3000:]
    faulted = logged(log, kind)
    assert faulted

    rows = quarantine_rows(db)
    assert at_least <= len(rows) <= len(faulted)
    for channel, reason, rank, token, expected, _ in rows:
        assert (channel, reason) == ("ready", "stale")
        assert expected in faulted  # the dispatch that was current, and whose READY it was
        mine = dispatched_to(db, rank)
        assert mine.index(token) < mine.index(expected)
    ev = event_counts(db)
    for absent in ("invalid", "recovered", "requeued", "watchdog", "deferred"):
        assert absent not in ev
    assert_each_task_committed_once(db, N)
    s = assert_status_agrees(db)
    assert s["quarantine"] == quarantined(ready={"stale": len(rows)} if rows else {})


@pytest.mark.timeout(120)
@covering("reorder", "delay")
def test_reordered_and_delayed_answers_change_nothing(tmp_path):
    kinds = ["reorder", "delay"]
    db, log, done = campaign(tmp_path, "reorder=0.3,delay=0.3", 8, n=40)
    assert done.returncode == 0, done.stderr[-3000:]
    for kind in kinds:
        assert logged(log, kind), kind
    assert quarantine_rows(db) == []
    ev = event_counts(db)
    for absent in ("invalid", "recovered", "requeued", "watchdog", "deferred"):
        assert absent not in ev
    assert query(db, "SELECT sum(attempts), sum(dispatches) FROM tasks") == [(0, 40)]
    assert_each_task_committed_once(db, 40)
    s = assert_status_agrees(db)
    assert s["quarantine"] == quarantined() and s["requeued"] == 0


@pytest.mark.timeout(120)
@covering("slow")
def test_a_slow_worker_is_waited_for(tmp_path):
    kind = "slow"
    db, log, done = campaign(tmp_path, f"{kind}=0.2", 5)
    assert done.returncode == 0, done.stderr[-3000:]
    slow = logged(log, kind)
    assert slow
    # each slow RESULT left 0.2-1 s after its WORK, and still committed (the send is recorded
    # by the master's next transaction, which may be the one that commits it)
    for token in slow:
        [(took, sent)] = query(db, f"SELECT committed_at - dispatched_at, "
                                   f"sent_at - dispatched_at FROM results "
                                   f"WHERE token = '{token}'")
        assert took >= 0.2 and 0 <= sent <= took
    assert quarantine_rows(db) == []
    assert "watchdog" not in event_counts(db) and "requeued" not in event_counts(db)
    assert_each_task_committed_once(db, N)
    assert_status_agrees(db)


@pytest.mark.timeout(120)
@covering("not_run")
def test_a_task_its_host_says_it_could_not_run_is_retried_never_committed(tmp_path):
    """Each injected `not_run` (every rank's host fails now and then, as a full disk would):
    the dispatch is ended without a result, its task goes to the retry policy (the first
    failure of a rank's streak charged to the budget, never to the attempt ceiling; later
    ones of the same streak charged nothing while another rank can run tasks), and every
    task is committed once, from a dispatch that ran it."""
    kind = "not_run"
    db, log, done = campaign(tmp_path, f"{kind}=0.3", 2, *RETRY_ALL)
    assert done.returncode == 0, done.stderr[-3000:]
    unrun = logged(log, kind)
    assert unrun
    assert quarantine_rows(db) == []
    assert event_tokens(db, "task_failed") == sorted(unrun)
    assert event_tokens(db, "retried") == sorted(unrun)
    reasons = [r for (r,) in query(db, "SELECT detail FROM events WHERE kind = 'retried'")]
    assert all(re.fullmatch(r"not_run on rank \d: injected: this host cannot run the task"
                            r"( \(not charged: .*\))?", r) for r in reasons), reasons
    assert query(db, "SELECT count(*) FROM results WHERE token IN (SELECT token FROM events "
                     "WHERE kind = 'task_failed')") == [(0,)]
    # the budget only: never the attempt ceiling, and no more than the failures
    charged = len(reasons) - sum("(not charged" in r for r in reasons)
    assert query(db, "SELECT sum(attempts), sum(budget_used) FROM tasks") == [(0, charged)]
    assert_each_task_committed_once(db, N)
    assert_status_agrees(db)


# Seed 112 hangs rank 1 at its first task; 20 ms per task so that a rank slow to start (a
# loaded CI machine) still gets one before the others have done all of them.
HANG_ARGS = ["--demo", str(N), "--demo-work-ms", "20", "--inject", "hang=0.02",
             "--inject-seed", "112", "--watchdog", "1", "--stop-wait", "1", "--no-progress",
             *SINGLE]


@pytest.mark.timeout(120)
@covering("hang")
def test_a_hung_worker_is_retired_parked_and_the_others_finish(tmp_path):
    kind = "hang"
    db, log_dir = tmp_path / "c.db", tmp_path / "faults"
    proc = start(["run", "--db", str(db), "--inject-log", str(log_dir), *HANG_ARGS])
    # The master aborts the job (the hung rank never acknowledges STOP); whether mpiexec then
    # ends by itself is test_the_job_ends_when_the_master_aborts_it's business.
    done, _ = finish_after_master(proc, db, timeout=FAULT_JOB_S, grace=2)
    log = fault_log(log_dir)
    assert [(r["rank"], r["kind"]) for r in log] == [(1, kind)]
    token = log[0]["token"]

    assert query(db, "SELECT rank, token FROM events WHERE kind = 'watchdog'") == [(1, token)]
    assert event_tokens(db, "requeued") == [token]
    assert query(db, "SELECT rank, state, parked_token FROM workers ORDER BY rank") == \
        [(1, "parked", token), (2, "stopped", None), (3, "stopped", None)]
    assert "worker_recovered" not in event_counts(db)
    assert quarantine_rows(db) == []
    assert_each_task_committed_once(db, N)
    assert token not in {t for (t,) in query(db, "SELECT token FROM results")}
    assert "ranks [1] did not acknowledge STOP" in done.stderr, done.stderr[-3000:]
    assert "rank 1 passed its --watchdog deadline" in done.stderr
    assert "the rank gets no work until it answers" in done.stderr
    s = assert_status_agrees(db)
    assert (s["watchdog_timeouts"], s["watchdog_recoveries"]) == (1, 0)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", covers("kill_before_result", "kill_after_result"))
def test_a_worker_that_kills_itself_loses_nothing(tmp_path, kind):
    # Seed 16 (rate 0.15): ranks 1, 2, 3 kill themselves at their 6th, 4th and 4th RESULT, in
    # every incarnation. Open MPI (ULFM) retires the dead rank's dispatch in the running job
    # and stops once no worker is left; MPICH loses the whole job. Either way: --resume until
    # the campaign is complete, and every task is committed exactly once.
    db, log_dir = tmp_path / "c.db", tmp_path / "faults"
    args = ["run", "--db", str(db), "--demo", str(N), "--no-progress", *SINGLE, "--inject",
            f"{kind}=0.15", "--inject-seed", "16", "--inject-log", str(log_dir), *RETRY_ALL]
    runs: list[Done] = []
    for attempt in range(10):
        done = run(args if attempt == 0 else args[:1] + ["--resume"] + args[1:],
                   timeout=FAULT_JOB_S)
        kill_ranks(db)
        runs.append(done)
        if query(db, "SELECT count(*) FROM tasks WHERE state != 'done'") == [(0,)]:
            break
    else:
        raise AssertionError(f"not complete after {len(runs)} runs")
    if mpi_kind() != "openmpi" and runs[-1].returncode != 0:
        # MPICH ends the whole job when a rank dies, also when one kills itself just after
        # the RESULT that completed the campaign (whether it does depends on which rank got
        # the last tasks): committed all the same. The next resume finds nothing to do.
        last = run(args[:1] + ["--resume"] + args[1:], timeout=FAULT_JOB_S)
        assert "this run committed 0 results" in last.stdout, last.stdout[-3000:]
        runs.append(last)
    assert runs[-1].returncode == 0, runs[-1].stderr[-3000:]
    assert len(runs) >= 2  # the first incarnation lost its workers before the end
    if mpi_kind() == "openmpi":
        assert "died" in runs[0].stderr, runs[0].stderr[-3000:]
    else:
        assert runs[0].returncode != 0

    killed = logged(fault_log(log_dir), kind)
    assert killed
    committed = {t for (t,) in query(db, "SELECT token FROM results")}
    for token in killed:
        rolled_back = query(db, f"SELECT count(*) FROM events WHERE token = '{token}' AND "
                                f"kind IN ('interrupted', 'worker_failed')")[0][0]
        if kind == "kill_before_result":
            # no RESULT left: the dispatch is rolled back, by ULFM in the job or at --resume
            assert token not in committed and rolled_back == 1
        else:
            # RESULT left before the kill: committed, or rolled back if the job died first
            assert (token in committed) + rolled_back == 1
    # the only possible quarantine: a RESULT drained after its dead rank's rollback
    assert {(r[0], r[1]) for r in quarantine_rows(db)} <= {("result", "unowned")}
    assert_each_task_committed_once(db, N)
    assert query(db, "SELECT count(*) FROM tasks WHERE state IN ('deferred', 'failed')") == \
        [(0,)]
    s = assert_status_agrees(db)
    assert s["incarnation"] == len(runs)


# -- 2. a worker stopped from outside ----------------------------------------------------------

def dispatch_in_progress(db: Path, timeout: float = 30) -> tuple[int, int, str]:
    """(rank, pid, token) of a dispatch whose WORK left 50-150 ms ago: with 200 ms tasks, its
    worker is inside the task."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.time()
        rows = query(db, f"SELECT d.rank, w.pid, d.token FROM dispatches d "
                         f"JOIN workers w ON w.rank = d.rank WHERE d.sent_at IS NOT NULL "
                         f"AND w.pid IS NOT NULL AND d.created_at BETWEEN {now - 0.15} "
                         f"AND {now - 0.05} ORDER BY d.created_at LIMIT 1")
        if rows:
            return rows[0]
        time.sleep(0.01)
    raise AssertionError("no dispatch in progress")


@pytest.mark.timeout(150)
def test_a_worker_stopped_by_sigstop_is_parked_and_recovered_after_sigcont(tmp_path):
    db = tmp_path / "c.db"
    n = 24
    args = ["run", "--db", str(db), "--demo", str(n), "--demo-work-ms", "200",
            "--watchdog", "2", "--stop-wait", "60", "--no-progress", *SINGLE]
    proc = start(args)
    stopped = None
    try:
        master = master_pid(db)
        for _ in range(20):
            rank, pid, token = dispatch_in_progress(db)
            assert pid != master and pid in ranks_of(db)
            os.kill(pid, signal.SIGSTOP)
            stopped = pid
            time.sleep(0.3)
            # still current 0.3 s later: it was stopped before its RESULT left
            if query(db, f"SELECT count(*) FROM dispatches WHERE token = '{token}'") == [(1,)]:
                break
            os.kill(pid, signal.SIGCONT)
            stopped = None
        else:
            raise AssertionError("never caught a worker inside its task")

        # retired at the deadline; the rank parked on the retired token
        wait_for(db, f"SELECT count(*) FROM events WHERE kind = 'watchdog' "
                     f"AND token = '{token}'", lambda c: c == 1, timeout=30)
        assert query(db, "SELECT rank FROM events WHERE kind = 'watchdog'") == [(rank,)]
        assert query(db, f"SELECT state, parked_token FROM workers WHERE rank = {rank}") == \
            [("parked", token)]
        # the other workers finish the campaign, the retired task included
        wait_for(db, "SELECT count(*) FROM tasks WHERE state = 'done'", lambda c: c == n,
                 timeout=60)
        assert query(db, f"SELECT state, parked_token FROM workers WHERE rank = {rank}") == \
            [("parked", token)]
        assert query(db, "SELECT count(*) FROM quarantine") == [(0,)]
        assert running(master)  # waiting (--stop-wait) for the parked rank's STOP_ACK

        os.kill(pid, signal.SIGCONT)
        stopped = None
        # its late RESULT is quarantined; its READY echoing the retired token frees it
        wait_for(db, "SELECT count(*) FROM events WHERE kind = 'worker_recovered'",
                 lambda c: c == 1, timeout=30)
        out, err = proc.communicate(timeout=60)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        kill_job(proc)
        kill_ranks(db)
    assert proc.returncode == 0, err[-3000:]
    assert quarantine_rows(db) == [("result", "unowned", rank, token, None, None)]
    assert query(db, "SELECT rank, token FROM events WHERE kind = 'worker_recovered'") == \
        [(rank, token)]
    # The operator is told what the rank's return means (slower than --watchdog, not hung).
    assert err.count(f"rank {rank} answered the dispatch the watchdog retired: it was slower "
                     f"than --watchdog (2 s), not hung") == 1, err[-3000:]
    assert query(db, "SELECT DISTINCT state FROM workers") == [("stopped",)]
    assert event_tokens(db, "requeued") == [token]
    assert_each_task_committed_once(db, n)
    assert token not in {t for (t,) in query(db, "SELECT token FROM results")}
    s = assert_status_agrees(db)
    assert (s["watchdog_timeouts"], s["watchdog_recoveries"]) == (1, 1)
    assert s["quarantine"] == quarantined(result={"unowned": 1})


# -- 3. a poison task ------------------------------------------------------------------------

POISON_TARGET = textwrap.dedent("""\
    import sys, time
    if open(sys.argv[1], "rb").read() == b"POISON":
        time.sleep(600)
    """)


@pytest.mark.timeout(150)
def test_a_poison_task_fails_at_the_attempt_ceiling_and_requeue_resets_it(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(POISON_TARGET)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    lines = []
    for name in ["a", "b", "poison", "c", "d"]:
        (inputs / name).write_bytes(b"POISON" if name == "poison" else name.encode())
        lines.append(json.dumps({"path": str(inputs / name), "input_file": str(inputs / name)}))
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("\n".join(lines) + "\n")
    db = tmp_path / "c.db"
    done = run(["run", "--db", str(db), "--tasks", str(tasks_file), "--timeout", "1",
                "--retries", "2", "--max-attempts", "3", "--no-progress", "--",
                sys.executable, str(target), "@@"], timeout=FAULT_JOB_S)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=5)
    [(poison, state, attempts, dispatches, reason)] = query(
        db, f"SELECT id, state, attempts, dispatches, reason FROM tasks "
            f"WHERE json_extract(payload, '$.path') = '{inputs / 'poison'}'")
    assert (state, attempts, dispatches) == ("failed", 3, 3)
    assert reason == "3 failed attempts (ceiling 3); last: timeout"
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY state ORDER BY state") == \
        [("done", 4), ("failed", 1)]
    # three timed-out runs: retried twice within the budget, then held at the ceiling
    per_task = query(db, f"SELECT kind, count(*) FROM events WHERE task_id = {poison} "
                         f"AND kind IN ('task_failed', 'retried', 'failed', 'requeued', "
                         f"'deferred', 'task_deferred') GROUP BY kind ORDER BY kind")
    assert per_task == [("failed", 1), ("retried", 2), ("task_failed", 3)]
    assert query(db, "SELECT detail FROM events WHERE kind = 'failed'") == [(reason,)]
    assert quarantine_rows(db) == []
    s = assert_status_agrees(db)
    assert s["tasks"]["failed"] == 1 and s["requeued"] == 0  # a timeout is no protocol fault

    # requeue of a task that is not held changes nothing
    [(good,)] = query(db, f"SELECT id FROM tasks WHERE json_extract(payload, '$.path') = "
                          f"'{inputs / 'a'}'")
    out = subprocess.run([sys.executable, "-m", "coordinator", "requeue", "--db", str(db),
                          "--id", str(good)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "requeued 0 task(s)", out
    out = subprocess.run([sys.executable, "-m", "coordinator", "requeue", "--db", str(db),
                          "--id", str(poison)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"requeued 1 task(s): {poison}"
    assert query(db, f"SELECT state, attempts, reason FROM tasks WHERE id = {poison}") == \
        [("queued", 0, None)]
    assert query(db, f"SELECT detail FROM events WHERE kind = 'manual_requeue' "
                     f"AND task_id = {poison}") == [("from failed",)]
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY state ORDER BY state") == \
        [("done", 4), ("queued", 1)]
    assert status_json(db)["tasks"]["queued"] == 1


# -- 4. the database cannot grow -------------------------------------------------------------

#: Rank 0 only: MPI is initialised (its shared-memory files created) before the limit, so only
#: the master's own writes (the campaign database) meet it. Python ignores SIGXFSZ: a write
#: past the limit fails with EFBIG.
LIMITED_MASTER = textwrap.dedent("""\
    import resource, runpy, sys
    from mpi4py import MPI  # noqa: F401  (initialises MPI)
    limit = int(sys.argv.pop(1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sys.argv = sys.argv[1:]  # drop this file; argv[0] becomes "coordinator"
    runpy.run_module("coordinator", run_name="__main__", alter_sys=True)
    """)
FSIZE_LIMIT = 1_000_000  # the WAL reaches it after ~25 rounds of the 300-task demo (--batch 1)
STORE_N = 300


def start_with_limited_master(tmp_path: Path, args: list[str], limit: int,
                              np: int = 4) -> Job:
    wrapper = tmp_path / "limited_master.py"
    wrapper.write_text(LIMITED_MASTER)
    flags = mpiexec_flags(MPIEXEC, np, ulfm=mpi_kind() == "openmpi")
    i = flags.index("-n")
    global_flags = flags[:i] + flags[i + 2:]
    cmd = [MPIEXEC, *global_flags,
           "-n", "1", sys.executable, str(wrapper), str(limit), "coordinator", *args, ":",
           "-n", str(np - 1), sys.executable, "-m", "coordinator", *args]
    return start([], command=cmd)


@pytest.mark.timeout(150)
def test_a_database_that_cannot_grow_stops_the_master_and_resume_completes(tmp_path):
    db = tmp_path / "c.db"
    args = ["run", "--db", str(db), "--demo", str(STORE_N), "--no-progress", *SINGLE]
    proc = start_with_limited_master(tmp_path, args, FSIZE_LIMIT)
    done, _ = finish_after_master(proc, db, timeout=FAULT_JOB_S, grace=2)
    assert "database write failed during master round" in done.stderr, done.stderr[-3000:]
    assert "continue with --resume" in done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr

    # nothing torn: the file is consistent and holds the rounds committed before the failure
    assert query(db, "PRAGMA integrity_check") == [("ok",)]
    committed_before = query(db, "SELECT count(*) FROM results")[0][0]
    in_flight = query(db, "SELECT count(*) FROM dispatches")[0][0]
    assert 0 < committed_before < STORE_N
    assert query(db, "SELECT count(*) FROM tasks WHERE state = 'active'") == [(in_flight,)]
    assert query(db, "SELECT count(*) FROM tasks WHERE state = 'done'") == [(committed_before,)]

    again = run(args[:1] + ["--resume"] + args[1:], timeout=FAULT_JOB_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{in_flight} interrupted" in again.stderr
    assert_each_task_committed_once(db, STORE_N)
    assert query(db, "SELECT count(*) FROM results WHERE incarnation = 1") == \
        [(committed_before,)]
    assert query(db, "SELECT count(*) FROM events WHERE kind = 'interrupted'") == [(in_flight,)]
    s = assert_status_agrees(db)
    assert s["incarnation"] == 2 and s["results"] == STORE_N


# -- the job must end when its master aborts it ------------------------------------------------

@pytest.mark.timeout(150)
@pytest.mark.parametrize("cause", ["hung rank never acknowledges STOP", "database write fails"])
def test_the_job_ends_when_the_master_aborts_it(tmp_path, cause):
    db = tmp_path / "c.db"
    if cause.startswith("hung"):
        proc = start(["run", "--db", str(db), *HANG_ARGS])
        expect = "did not acknowledge STOP"
    else:
        proc = start_with_limited_master(tmp_path, ["run", "--db", str(db), "--demo",
                                                    str(STORE_N), "--no-progress", *SINGLE],
                                         FSIZE_LIMIT)
        expect = "database write failed"
    done, ended = finish_after_master(proc, db, timeout=FAULT_JOB_S, grace=15)
    assert expect in done.stderr, done.stderr[-3000:]
    assert ended, f"mpiexec still running 15 s after the master exited\n{done.stderr[-2000:]}"
    assert done.returncode != 0


def test_every_fault_kind_is_covered():
    assert set(KINDS) == COVERED
