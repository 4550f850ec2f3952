"""tools/fault_campaign.py: a short real campaign under mpiexec, and proof that its checker
fails on planted violations (a checker that cannot fail proves nothing)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import Farm, load_tool

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fault_campaign.py"

fc = load_tool("fault_campaign")


#: The short campaign's seed: its 4 trials hold the three harness kinds (an aliased file in
#: two; a held lock past --lock-wait; a start-up crash with and without ULFM) among
#: injected ones.
SHORT_SEED = 22058


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_short_campaign_passes_and_writes_both_reports(tmp_path):
    out_json, out_md = tmp_path / "report.json", tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, str(TOOL), "--trials", "4", "--tasks", "20", "--seed", str(SHORT_SEED),
         "--timeout-per-job", "20", "--max-restarts", "8", "--workdir", str(tmp_path / "w"),
         "--json", str(out_json), "--markdown", str(out_md)],
        capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out_json.read_text())
    for key in ("trials", "tasks_lost", "wrong_commits", "duplicate_commits",
                "integrity_failures", "recovery_latency_p50_s", "per_kind", "faults_injected",
                "recovery_rate", "extra_executions", "wall_time_s"):
        assert key in report, key
    assert report["trials"] == 4
    assert report["tasks_lost"] == report["wrong_commits"] == 0
    assert report["duplicate_commits"] == report["integrity_failures"] == 0
    assert set(report["per_kind"]) == set(fc.ALL_KINDS)
    assert report["faults_injected"] > 0  # the plans did inject something
    assert report["kind_failures"] == 0
    h = report["harness_faults"]
    assert h["held_lock"]["held"] == h["held_lock"]["past_lock_wait_stopped"] == 1
    assert h["aliased_file"]["linked"] == 2
    assert h["aliased_file"]["refused"] == h["aliased_file"]["commands"] == 6
    assert h["startup_crash"]["killed"] == 2
    assert done.stdout.count("\ntrial ") + done.stdout.startswith("trial ") == 4
    md = out_md.read_text()
    assert f"fault_campaign.py --trials 4 --tasks 20 --seed {SHORT_SEED}" in md
    assert "| **all** |" in md
    assert "| `held_lock` |" in md and "## The operator's environment" in md
    # The default share of batched trials gives this seed's second trial --batch 2.
    assert set(report["per_batch"]) == {"batch 1", "batch 2"}
    assert report["per_batch"]["batch 2"]["trials"] == 1
    assert report["per_batch"]["batch 2"]["failed_trials"] == 0
    assert "## Per batch size" in md and "| batch 2 |" in md


def test_a_share_of_trials_runs_batched_and_the_rest_of_each_plan_is_unchanged(tmp_path):
    plain = fc.draw_plans(400, seed=3, tasks=40, kill_fraction=0.3)
    mixed = fc.draw_plans(400, seed=3, tasks=40, kill_fraction=0.3, batch_fraction=0.25)
    assert {p.batch for p in plain} == {1}
    batched = [p for p in mixed if p.batch > 1]
    assert 60 <= len(batched) <= 140  # a quarter of 400, give or take
    assert {p.batch for p in batched} == set(fc.BATCH_SIZES)
    assert [dataclasses.replace(p, batch=1) for p in mixed] == plain
    args = fc.run_args(tmp_path / "c.db", batched[0], fc.Options(), tmp_path, 0)
    assert args[args.index("--batch") + 1] == str(batched[0].batch)
    args = fc.run_args(tmp_path / "c.db", plain[0], fc.Options(), tmp_path, 0)
    assert args[args.index("--batch") + 1] == "1"  # not the demo's automatic batches
    assert f"batch={batched[0].batch}" in batched[0].label()


def test_batched_trials_can_draw_automatic_batches(tmp_path):
    """--batch-sizes auto: the trials run with --batch auto (the default of demo tasks), and
    the report keeps them apart; a size out of range is refused."""
    ns = fc._parser().parse_args(["--batch-sizes", "auto,8"])
    assert ns.batch_sizes == (fc.AUTO, 8)
    plans = fc.draw_plans(200, seed=3, tasks=40, kill_fraction=0.3, batch_fraction=1.0,
                          sizes=ns.batch_sizes)
    assert {p.batch for p in plans} == {fc.AUTO, 8}
    auto = next(p for p in plans if p.batch == fc.AUTO)
    args = fc.run_args(tmp_path / "c.db", auto, fc.Options(), tmp_path, 0)
    assert args[args.index("--batch") + 1] == "auto" and "batch=auto" in auto.label()
    for bad in ("1", "0", "1001", "many"):
        with pytest.raises(SystemExit):
            fc._parser().parse_args(["--batch-sizes", bad])


def test_the_short_campaign_holds_every_harness_kind():
    plans = fc.draw_plans(4, seed=SHORT_SEED, tasks=20, kill_fraction=0.3)
    assert {k for p in plans for k in p.kinds} >= set(fc.HARNESS_KINDS)
    assert any(p.lock and p.lock.outlasts for p in plans)
    assert {p.startup.ulfm for p in plans if p.startup} == {True, False}


def test_plans_are_seeded_and_cover_every_kind():
    plans = fc.draw_plans(len(fc.ALL_KINDS), seed=3, tasks=40, kill_fraction=0.3)
    assert {k for p in plans for k in p.kinds} == set(fc.ALL_KINDS)
    assert all(1 <= len(p.kinds) <= 4 for p in plans)
    assert all(fc.RATE_MIN <= r <= fc.RATE_MAX for p in plans for r in p.rates.values())
    again = fc.draw_plans(len(fc.ALL_KINDS), seed=3, tasks=40, kill_fraction=0.3)
    assert [(p.rates, p.inject_seed, p.kill, p.lock, p.alias, p.startup) for p in plans] == \
           [(p.rates, p.inject_seed, p.kill, p.lock, p.alias, p.startup) for p in again]
    many = fc.draw_plans(400, seed=3, tasks=40, kill_fraction=0.3)
    assert 80 <= sum(p.kill is not None for p in many) <= 160
    assert min(Counter(k for p in many for k in p.kinds).values()) >= 25


def test_plans_of_the_harness_kinds(tmp_path):
    many = fc.draw_plans(400, seed=5, tasks=25, kill_fraction=0.3, workers=3)
    assert all(set(p.rates) <= set(fc.INJECT_KINDS) for p in many)  # never an --inject kind
    locks = [p.lock for p in many if p.lock]
    short = [lk for lk in locks if lk.outlasts]
    assert [i % fc.SHORT_EVERY for i, lk in enumerate(locks) if lk.outlasts] == [0] * len(short)
    assert all((lk.hold_s, lk.lock_wait_s) == (fc.SHORT_HOLD_S, fc.SHORT_LOCK_WAIT_S)
               for lk in short)
    assert all(fc.HOLD_MIN_S <= lk.hold_s <= fc.HOLD_MAX_S < lk.lock_wait_s
               for lk in locks if not lk.outlasts)
    assert all(0 <= p.after_results < 25 for p in (*locks, *(q.alias for q in many if q.alias)))
    # A hold that must stop the master starts while half the work or more is left.
    assert all(lk.after_results < 12 for lk in short)
    assert max(lk.after_results for lk in locks if not lk.outlasts) >= 12
    starts = [p.startup for p in many if p.startup]
    assert {s.rank for s in starts} == {1, 2, 3}
    assert all(0.02 <= s.delay_s <= 0.2 for s in starts)
    assert [i % fc.ULFM_EVERY for i, s in enumerate(starts) if s.ulfm] == \
           [0] * sum(s.ulfm for s in starts)
    # The command line: the trial's --lock-wait, the master's pid file, and no --inject for
    # a plan of the harness's kinds alone.
    plan = fc.TrialPlan(0, {}, 7, None, lock=short[0])
    args = fc.run_args(tmp_path / "c.db", plan, fc.Options(), tmp_path / "inject", 1,
                       tmp_path / "run01.pid")
    assert "--inject" not in args and "--inject-seed" not in args
    assert args[args.index("--lock-wait") + 1] == "2"
    assert args[args.index("--master-pid-file") + 1] == str(tmp_path / "run01.pid")
    assert args[-1] == "--resume"
    plan = fc.TrialPlan(0, {"hang": 0.1}, 7, None)
    args = fc.run_args(tmp_path / "c.db", plan, fc.Options(), tmp_path / "inject", 2)
    assert args[args.index("--inject") + 1] == "hang=0.1"
    assert args[args.index("--inject-seed") + 1] == "9"
    assert args[args.index("--lock-wait") + 1] == f"{fc.LOCK_WAIT_S:g}"
    assert plan.kinds == ["hang"] and plan.label() == "hang=0.1"


# -- the checker against planted violations ------------------------------------------------

N_TASKS = 4


def _payload_n(farm, token: str) -> int:
    with sqlite3.connect(farm.path) as c:
        (payload,) = c.execute("SELECT t.payload FROM dispatches d JOIN tasks t "
                               "ON t.id = d.task_id WHERE d.token = ?", (token,)).fetchone()
    return json.loads(payload)["data"]["n"]


def _finish(farm, rank: int, token: str) -> None:
    farm.result(rank, token, "ok", {"n": _payload_n(farm, token)})
    farm.ready(rank, token)


@pytest.fixture
def campaign(farm, tmp_path) -> tuple[Path, str, str]:
    """A finished campaign of N_TASKS demo-shaped tasks in which one dispatch was recovered
    (garbage RESULT + current READY) and retried: (db, the recovered token, a good token)."""
    farm.enqueue(*({"data": {"n": i}} for i in range(N_TASKS)))
    farm.ready(1)
    farm.ready(2)
    tokens = farm.dispatch(1, 2)
    recovered = tokens[1]
    farm.result_raw(1, ["not", "a", "mapping"])   # invalid mark
    farm.ready(1, recovered)                        # + ready mark -> joined
    assert [r.token for r in farm.sweep()] == [recovered]
    _finish(farm, 2, tokens[2])
    while True:
        tokens = farm.dispatch(1, 2)
        if not tokens:
            break
        for rank, token in tokens.items():
            _finish(farm, rank, token)
    farm.close()
    with sqlite3.connect(farm.path) as c:
        assert c.execute("SELECT count(*) FROM results").fetchone() == (N_TASKS,)
        good = c.execute("SELECT token FROM results LIMIT 1").fetchone()[0]
    return farm.path, recovered, good


def _check(db: Path) -> dict:
    return fc.check_campaign(db, N_TASKS)


def _write(db: Path, *sql: str, params=()) -> None:
    c = sqlite3.connect(db)  # foreign_keys off, like the sqlite3 shell
    try:
        for s in sql:
            c.execute(s, params if "?" in s else ())
        c.commit()
    finally:
        c.close()


def test_checker_passes_a_clean_campaign(campaign):
    db, _, _ = campaign
    r = _check(db)
    assert r["problems"] == []
    assert (r["tasks_lost"], r["wrong_commits"], r["duplicate_commits"]) == (0, 0, 0)
    assert r["integrity_ok"] and r["stats_mismatches"] == 0 and r["leftover_rows"] == 0
    assert (r["recovered_tasks"], r["recovered_done"]) == (1, 1)
    assert r["dispatches_sum"] == N_TASKS + 1


def test_checker_reports_a_commit_from_a_recovered_token(campaign):
    db, recovered, _ = campaign
    _write(db, "UPDATE results SET token = ? WHERE task_id = (SELECT task_id FROM events "
               "WHERE token = ? AND kind = 'dispatched')", params=(recovered, recovered))
    r = _check(db)
    assert r["wrong_commits"] == 1
    assert any("retired (recovered)" in p for p in r["problems"])


def test_checker_reports_a_deleted_task_as_lost(campaign):
    db, _, good = campaign
    _write(db, "DELETE FROM tasks WHERE id = (SELECT task_id FROM results WHERE token = ?)",
           params=(good,))
    r = _check(db)
    assert r["tasks_lost"] >= 1
    assert any("have no row" in p for p in r["problems"])


def test_checker_reports_an_unfinished_task_as_lost(campaign):
    db, _, good = campaign
    _write(db, "UPDATE tasks SET state = 'queued' WHERE id = "
               "(SELECT task_id FROM results WHERE token = ?)", params=(good,))
    r = _check(db)
    assert r["tasks_lost"] == 1 and r["duplicate_commits"] == 1  # queued, yet has a result
    # `status` counts done tasks by their results rows, the checker by their state: the
    # planted row shows there too.
    assert r["stats_mismatches"] == 1
    assert any("`status` counts 4 done tasks, the tasks' states say 3" in p
               for p in r["problems"])


def test_checker_reports_one_token_committed_for_two_tasks(campaign):
    """No index refuses it since revision 0005; the audit must."""
    db, _, good = campaign
    _write(db, "UPDATE results SET token = ? WHERE task_id = (SELECT max(task_id) FROM results "
               "WHERE token != ?)", params=(good, good))
    r = _check(db)
    assert r["duplicate_commits"] == 1
    assert any("is committed for 2 tasks" in p for p in r["problems"])


def test_checker_reports_another_tasks_value_as_wrong(campaign):
    db, _, good = campaign
    _write(db, "UPDATE results SET value = json_set(value, '$.n', 999) WHERE token = ?",
           params=(good,))
    assert _check(db)["wrong_commits"] == 1


def test_checker_reports_a_commit_whose_result_never_left(campaign, tmp_path):
    db, _, good = campaign
    logs = tmp_path / "inject"
    logs.mkdir()
    (logs / "faults-rank1.jsonl").write_text(json.dumps(
        {"t": 1.0, "rank": 1, "kind": "result_drop", "token": good}) + "\n")
    r = fc.check_campaign(db, N_TASKS, inject_dir=logs)
    assert r["wrong_commits"] == 1 and r["faults"] == {"result_drop": 1}


def test_checker_fails_the_trial_on_any_violation_of_the_audit(campaign):
    """`coordinator check` found "1 of its 2 dispatches without a record", and the trial
    passed: that check, a lease of no dispatch and the foreign keys fed no counter the
    verdict read."""
    db, _, good = campaign
    assert not fc.trial_failed(_check(db))
    _write(db, "UPDATE tasks SET dispatches = dispatches + 1 WHERE id = "
               "(SELECT task_id FROM results WHERE token = ?)", params=(good,))
    r = _check(db)
    assert r["audit_violations"] == 1 and fc.trial_failed(r)


def test_checker_reports_a_task_committed_twice_as_two_rows(campaign):
    """A second done task of the same n, with its result and its `enqueued` event, passed
    `coordinator check` (it is a consistent task of its own) and the harness."""
    db, _, good = campaign
    _write(db, "INSERT INTO tasks (semantic_id, payload, state, dispatches, queue_pos, "
               "created_at, updated_at) SELECT ?, json_set(payload, '$.dup', 1), 'done', 1, "
               "queue_pos, created_at, updated_at FROM tasks WHERE id = (SELECT task_id "
               "FROM results WHERE token = ?)", params=("e" * 64, good))
    _write(db, "INSERT INTO events (at, incarnation, kind, task_id) SELECT 0, 1, 'enqueued', "
               "max(id) FROM tasks")
    _write(db, "INSERT INTO results (task_id, token, rank, incarnation, committed_at, status, "
               "value, dispatched_at) SELECT (SELECT max(id) FROM tasks), ?, rank, "
               "incarnation, committed_at + 1, status, value, dispatched_at FROM results "
               "WHERE token = ?", params=("f" * 64, good))
    r = _check(db)
    assert (r["extra_tasks"], r["duplicate_commits"]) == (1, 1) and fc.trial_failed(r)
    assert any("task rows past the campaign's" in p for p in r["problems"])


def test_checker_reports_leftover_dispatch_rows(campaign):
    db, _, _ = campaign
    _write(db, "INSERT INTO dispatches (token, rank, task_id, incarnation, created_at) "
               "VALUES ('" + "a" * 64 + "', 9, 1, 1, 0)")
    assert _check(db)["leftover_rows"] >= 1


def test_checker_reports_a_corrupt_file(campaign, tmp_path):
    db, _, _ = campaign
    _write(db, "PRAGMA wal_checkpoint(TRUNCATE)")
    bad = tmp_path / "bad.db"
    shutil.copy(db, bad)
    data = bytearray(bad.read_bytes())
    page = 4096
    for p in range(1, len(data) // page):  # every page but the header's: b-tree pages broken
        data[p * page:p * page + 16] = b"\xff" * 16
    bad.write_bytes(bytes(data))
    r = fc.check_campaign(bad, N_TASKS, stats=False)
    assert not r["integrity_ok"]
    assert r["problems"]


@pytest.mark.timeout(60)
def test_a_launcher_that_failed_and_a_fenced_hung_rank_are_not_unusual_exits(tmp_path):
    """Open MPI's launcher flake (exit 213: nothing ran, the trial goes on) and a hung rank
    the master ended with SIGUSR2 (mpiexec exits 140) kept trial directories as unusual."""
    from coordinator.launcher import LAUNCHER_FAILED
    job = fc.run_job(["sh", "-c", 'echo "$0" >&2; exit 213', LAUNCHER_FAILED],
                     tmp_path / "c.db", tmp_path / "run00", fc.Options(),
                     fc.KillTrigger(None), 0, False, 1)
    assert (job.ended_by, job.exit_code) == ("launcher_failed", 213)
    other = fc.run_job(["sh", "-c", "exit 213"], tmp_path / "c.db", tmp_path / "run01",
                       fc.Options(), fc.KillTrigger(None), 1, True, 1)
    assert (other.ended_by, other.exit_code) == ("exit", 213)
    runs = [{"ended_by": "exit", "exit_code": 140}, {"ended_by": "launcher_failed",
                                                      "exit_code": 213}]
    assert fc.unusual_exits({"runs": runs}) == []
    assert fc.unusual_exits({"runs": [*runs, {"ended_by": "exit", "exit_code": 213}]}) == [213]


def test_checker_reports_a_result_the_dispatch_count_does_not_cover(campaign):
    """One record per dispatch: a result on a task with no dispatch left unrecorded for it
    is a commit from a dispatch that never was."""
    db, _, good = campaign
    _write(db, "UPDATE tasks SET dispatches = dispatches - 1 WHERE id = "
               "(SELECT task_id FROM results WHERE token = ?)", params=(good,))
    r = _check(db)
    assert r["wrong_commits"] == 1
    assert any("never dispatched for it" in p for p in r["problems"])


def test_checker_reports_a_dispatch_without_a_record(campaign):
    db, recovered, _ = campaign
    _write(db, "DELETE FROM events WHERE token = ? AND kind = 'dispatched'",
           params=(recovered,))
    r = _check(db)
    assert r["wrong_commits"] == 0
    assert any("dispatches without a record" in p for p in r["problems"])


# -- the harness's own faults, without MPI -------------------------------------------------

class _Job:
    """Stands for the job a harness fault acts on: `proc` a process of our own, `pid_file`
    naming a live "master" (this test's process unless told)."""

    def __init__(self, db: Path, tmp_path: Path, master: int | None = None):
        self.proc = subprocess.Popen(["sleep", "60"])
        pid_file = tmp_path / "run00.pid"
        pid_file.write_text(f"{master or os.getpid()}\n")
        self.ctx = fc.JobContext(self.proc, db, fc.DbMonitor(db), 0, pid_file)

    def poll_until(self, fault, done, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "the fault never came"
            fault.poll(self.ctx)
            time.sleep(0.004)

    def close(self) -> None:
        self.ctx.mon.close()
        self.proc.kill()
        self.proc.wait()


def _runs(master_exit, ended_by="exit", finished=True, run=0) -> list[dict]:
    return [{"run": run, "ended_by": ended_by, "exit_code": 0, "master_exit": master_exit,
             "finished": finished, "started_at": 0.0}]


def test_held_lock_takes_the_write_lock_holds_it_and_rolls_back(campaign, tmp_path):
    db, _, _ = campaign
    fault = fc.HeldLock(fc.LockPlan(after_results=0, delay_s=0.0, hold_s=0.6,
                                    lock_wait_s=fc.LOCK_WAIT_S), db)
    job = _Job(db, tmp_path)
    try:
        job.poll_until(fault, lambda: fault.record is not None
                       and "acquired_at" in fault.record)
        other = sqlite3.connect(db, timeout=0, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")  # what the master meets meanwhile
        fault.settle()
        other.execute("BEGIN IMMEDIATE")  # released
        other.execute("ROLLBACK")
        other.close()
    finally:
        job.close()
    rec = fault.record
    assert rec["hold_s"] == 0.6 and not rec["outlasts"] and rec["holder_pid"] == os.getpid()
    assert 0.6 <= rec["released_at"] - rec["acquired_at"] < 5
    assert rec["master_alive_at_acquire"] and rec["work_left_at_acquire"] == 0
    assert "error" not in rec
    assert _check(db)["problems"] == []  # nothing written
    judged = fc.check_harness_faults(db, _runs(0), {"held_lock": rec}, tmp_path)
    assert judged["problems"] == [] and judged["faults"] == {"held_lock": 1}
    stopped = fc.check_harness_faults(db, _runs(3), {"held_lock": rec}, tmp_path)
    assert any("shorter than its --lock-wait" in p for p in stopped["problems"])


def _lock_record(**kw) -> dict:
    return {"run": 0, "hold_s": 5.0, "lock_wait_s": 2.0, "outlasts": True, "holder_pid": 4242,
            "acquired_at": 100.0, "released_at": 105.0, "master_alive_at_acquire": True,
            "work_left_at_acquire": 10, "master_alive_at_release": False, **kw}


def test_a_lock_held_past_lock_wait_must_stop_the_master(campaign, tmp_path):
    db, _, _ = campaign
    (tmp_path / "run00.err").write_text(
        "coordinator: waiting 1 s for the campaign's write lock, held by pid 4242 (python) ...\n"
        "coordinator: database write failed during master round: database is locked (...)\n")
    ok = fc.check_harness_faults(db, _runs(3, finished=False), {"held_lock": _lock_record()},
                                 tmp_path)
    assert ok["problems"] == []
    assert ok["details"]["held_lock"] == {"held": True, "outlasts": True, "judged": True,
                                          "stopped": True, "said": True}
    assert ok["latency"]["held_lock"][0] > 0  # the fixture's commits came after t=105
    went_on = fc.check_harness_faults(db, _runs(0), {"held_lock": _lock_record()}, tmp_path)
    assert any("expected 3" in p for p in went_on["problems"])
    # A master killed meanwhile (no status of its own), or one with nothing left to write
    # that never waited, is not judged.
    for runs, rec in ((_runs(None), _lock_record()),
                      (_runs(0), _lock_record(work_left_at_acquire=0))):
        (tmp_path / "run00.err").write_text("")
        assert fc.check_harness_faults(db, runs, {"held_lock": rec}, tmp_path)["problems"] == []


def test_a_hold_before_the_tasks_are_imported_is_judged(campaign, tmp_path):
    """A lock taken while the master creates a new campaign (the schema there, no task yet):
    it must write, so wait within --lock-wait and say so. Seed 1, trial 177: a 5.6 s hold
    there was waited out in silence, and not judged (no queued task)."""
    db, _, _ = campaign
    rec = _lock_record(hold_s=5.59, lock_wait_s=30.0, outlasts=False,
                       master_alive_at_release=True, work_left_at_acquire=0,
                       tasks_at_acquire=0)
    (tmp_path / "run00.err").write_text("")
    r = fc.check_harness_faults(db, _runs(0), {"held_lock": rec}, tmp_path)
    assert any("never said it waited" in p for p in r["problems"])
    assert r["details"]["held_lock"]["judged"]
    past = _lock_record(work_left_at_acquire=0, tasks_at_acquire=0)
    r = fc.check_harness_faults(db, _runs(0), {"held_lock": past}, tmp_path)
    assert any("expected 3" in p for p in r["problems"])


def test_a_long_hold_within_lock_wait_must_be_said(campaign, tmp_path):
    db, _, _ = campaign
    rec = _lock_record(hold_s=6.0, lock_wait_s=30.0, outlasts=False,
                       master_alive_at_release=True)
    (tmp_path / "run00.err").write_text("")
    r = fc.check_harness_faults(db, _runs(0), {"held_lock": rec}, tmp_path)
    assert any("never said it waited" in p for p in r["problems"])
    (tmp_path / "run00.err").write_text("coordinator: waiting 1 s for the campaign's write "
                                        "lock, held by pid 4242 (python x) (a sqlite3 ...\n")
    assert fc.check_harness_faults(db, _runs(0), {"held_lock": rec}, tmp_path)["problems"] == []


@pytest.mark.timeout(120)
def test_aliased_file_commands_are_refused_and_leave_nothing(campaign, tmp_path):
    """The three commands, for real, on a second name of a campaign file."""
    db, _, _ = campaign
    fault = fc.AliasedFile(fc.AliasPlan(after_results=0, delay_s=0.0), db)
    fault.prepare()  # as a trial does before its first job: the commands wait, loaded
    job = _Job(db, tmp_path)
    try:
        job.poll_until(fault, lambda: fault.record is not None)
        fault.settle()
    finally:
        job.close()
        fault.close()
    rec = fault.record
    assert "error" not in rec, rec
    assert rec["warm_s"] > 0 and all(c["seconds"] < 30 for c in rec["commands"].values())
    assert sorted(p.name for p in db.parent.iterdir() if p.name.startswith("alias")) == []
    assert {n: (c["exit"], c["refused"]) for n, c in rec["commands"].items()} == {
        "run": (2, True), "status": (2, True), "check": (2, True)}
    assert rec["beside_alias"] == [] and rec["left_after_unlink"] == []
    assert rec["links_after"] == 1 and os.stat(db).st_nlink == 1
    assert not list(db.parent.glob(fc.ALIAS_NAME + "*"))
    r = fc.check_harness_faults(db, _runs(0), {"aliased_file": rec}, tmp_path)
    assert r["problems"] == [] and r["faults"] == {"aliased_file": 1}
    assert r["details"]["aliased_file"]["refused"] == 3


def test_the_alias_checks_fail_on_what_they_must_refuse(campaign, tmp_path):
    db, _, _ = campaign
    refused = {"exit": 2, "timed_out": False, "refused": True, "output": "has 2 names"}
    rec = {"run": 0, "linked_at": 1.0, "master_alive_at_link": True, "master_alive_after": True,
           "commands": {"run": {**refused, "exit": 0, "refused": False, "output": "ran"},
                        "status": refused},
           "beside_alias": ["alias.db-shm", "alias.db-wal"], "left_after_unlink": [],
           "links_after": 2}
    (tmp_path / "run00.err").write_text("coordinator: c.db has 2 names (hard links ...)\n")
    problems = fc.check_harness_faults(db, _runs(0), {"aliased_file": rec},
                                       tmp_path)["problems"]
    assert len(problems) == 5, problems
    assert any("`coordinator run --db alias.db` exited 0" in p for p in problems)
    assert any("`coordinator check` on the alias did not run" in p for p in problems)
    assert any("alias.db-wal" in p for p in problems)
    assert any("still has 2 names" in p for p in problems)
    assert any("own runs [0] were refused" in p for p in problems)


@pytest.mark.timeout(60)
def test_startup_crash_kills_that_rank_once_the_master_recorded_its_pid(tmp_path):
    """Stand-ins for a job's ranks (found the way the tool finds them: the database path on
    the command line, the rank in the environment); only the planned rank is killed."""
    db = tmp_path / "c.db"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "coordinator", str(db)]
    ranks = {r: subprocess.Popen(sleeper, env={**os.environ, "OMPI_COMM_WORLD_RANK": str(r)})
             for r in range(4)}
    fault = fc.StartupCrash(fc.StartupPlan(rank=2, delay_s=0.05, ulfm=False), db)
    job = _Job(db, tmp_path, master=ranks[0].pid)
    try:
        job.ctx.pid_file.unlink()
        for _ in range(20):
            fault.poll(job.ctx)  # no master pid yet: nothing
        assert fault.record is None
        job.ctx.pid_file.write_text(f"{ranks[0].pid}\n")
        t0 = time.time()
        job.poll_until(fault, lambda: fault.record is not None)
        assert ranks[2].wait(timeout=10) == -signal.SIGKILL
        assert all(ranks[r].poll() is None for r in (0, 1, 3))
    finally:
        job.close()
        for p in ranks.values():
            p.kill()
            p.wait()
    rec = fault.record
    assert rec["pid"] == ranks[2].pid and rec["rank"] == 2 and rec["master_pid"] == ranks[0].pid
    assert rec["killed_at"] - t0 >= 0.05


def test_startup_crash_checks(campaign, tmp_path):
    db, _, _ = campaign
    rec = {"run": 0, "rank": 2, "pid": 1, "ulfm": True, "killed_at": 0.0, "delay_s": 0.1,
           "master_pid": 99}
    # Under ULFM the master must go on, and record the death.
    r = fc.check_harness_faults(db, _runs(0), {"startup_crash": rec}, tmp_path)
    assert any("never recorded rank 2's death" in p for p in r["problems"])
    r = fc.check_harness_faults(db, _runs(None), {"startup_crash": rec}, tmp_path)
    assert any("the job ended with rank 2's death" in p for p in r["problems"])
    _write(db, "INSERT INTO events (at, incarnation, kind, rank) VALUES (0.25, 1, "
               "'worker_failed', 2)")
    r = fc.check_harness_faults(db, _runs(0), {"startup_crash": rec}, tmp_path)
    assert r["problems"] == [] and r["latency"] == {"startup_crash": [0.25]}
    assert r["details"]["startup_crash"]["went_on"]
    # Ended by this harness (its kill of the whole job): gone on if the death was recorded,
    # else not judged.
    r = fc.check_harness_faults(db, _runs(None, "harness_kill", False), {"startup_crash": rec},
                                tmp_path)
    assert r["problems"] == [] and r["details"]["startup_crash"]["went_on"]
    later = {**rec, "killed_at": 5.0}
    r = fc.check_harness_faults(db, _runs(None, "harness_kill", False), {"startup_crash": later},
                                tmp_path)
    assert r["problems"] == [] and r["details"]["startup_crash"]["went_on"] is None
    # Without ULFM the job ends; it must not hang.
    plain = {**rec, "ulfm": False}
    r = fc.check_harness_faults(db, _runs(None, "timeout", False), {"startup_crash": plain},
                                tmp_path)
    assert any("the job hung" in p for p in r["problems"])
    runs = [*_runs(None, "exit", False), {**_runs(0)[0], "run": 1, "started_at": 0.0}]
    r = fc.check_harness_faults(db, runs, {"startup_crash": plain}, tmp_path)
    assert r["problems"] == [] and r["latency"]["startup_crash"][0] > 0


def test_a_master_that_stopped_with_work_left_has_not_finished_the_campaign():
    """Under ULFM, every worker dead: the master's last line, with tasks still queued (exit
    6), was taken for a finished campaign, and the trial was checked as one (13 "lost")."""
    stopped = ("coordinator: this run committed 12 results in 0.7 s (31 tasks/s in the loop; "
               "1286 rounds, 20 transactions; master peak RSS 69 MiB); campaign: 12 done, 13 "
               "queued, 0 deferred, 0 failed, 12 results; continue it with --resume; stats in "
               "c.db.stats\n")
    assert not fc.campaign_finished("$ mpiexec ...\n" + stopped)
    drained = stopped.replace("12 done, 13 queued, 0 deferred", "24 done, 0 queued, 1 deferred")
    assert fc.campaign_finished("$ mpiexec ...\n" + drained)
    assert not fc.campaign_finished("$ mpiexec ...\n")


def test_a_trial_failing_only_its_kinds_checks_fails():
    t = {"tasks_lost": 0, "wrong_commits": 0, "duplicate_commits": 0, "integrity_ok": True,
         "leftover_rows": 0, "stats_mismatches": 0, "kind_problems": []}
    assert not fc.trial_failed(t)
    assert fc.trial_failed({**t, "kind_problems": ["aliased_file: ..."]})


def test_a_master_past_its_last_result_may_wait_out_the_end_of_a_long_hold(campaign, tmp_path):
    """Seed 29, trial 3 of the short campaign: the lock was taken after the last result; the
    master wrote only during its stop, began to wait late in the 5 s hold, said so, and got
    the lock within its --lock-wait 2 s. Ending as it would have (0) is right; the exit 4
    it gave then (the wait had used up --stop-wait, finished ranks were killed) is not."""
    db, _, _ = campaign
    (tmp_path / "run00.err").write_text(
        "coordinator: waiting 1 s for the campaign's write lock, held by pid 4242 (python) ...\n")
    late = _lock_record(work_left_at_acquire=0)
    assert fc.check_harness_faults(db, _runs(0), {"held_lock": late}, tmp_path)[
        "problems"] == []
    r = fc.check_harness_faults(db, _runs(4), {"held_lock": late}, tmp_path)
    assert any("exit 4, expected 3" in p for p in r["problems"])
    # With work left when the lock was taken the master had to write at once: 0 is wrong.
    r = fc.check_harness_faults(db, _runs(0), {"held_lock": _lock_record()}, tmp_path)
    assert any("expected 3" in p for p in r["problems"])


# -- an incomplete trial ---------------------------------------------------------------------

def _never_finishing(tmp_path: Path, monkeypatch, name: str) -> Path:
    """A workdir whose trial 1 is a campaign of N_TASKS with work left, and jobs (faked, no
    MPI) that never finish it."""
    workdir = tmp_path / name
    (workdir / "trial-0000").mkdir(parents=True)
    farm = Farm(workdir / "trial-0000" / "c.db")
    farm.enqueue(*({"data": {"n": i}} for i in range(N_TASKS)))
    farm.ready(1)
    _finish(farm, 1, farm.dispatch(1)[1])
    farm.close()

    def job(cmd, db, log_base, opts, trigger, run, resume, inject_seed, **kw):
        return fc.JobRun(run, resume, inject_seed, "timeout", -9, 0.01, False)
    monkeypatch.setattr(fc, "run_job", job)
    monkeypatch.setattr(fc, "mpiexec_command", lambda np, args, ulfm=False: ["echo", *args])
    return workdir


def test_an_incomplete_trial_fails_the_run_unless_allowed(tmp_path, monkeypatch, capsys):
    """In 200 trials none was incomplete: one is a campaign that cannot finish, a finding."""
    args = ["--trials", "1", "--seed", "4", "--tasks", str(N_TASKS), "--kill-fraction", "0",
            "--max-restarts", "2"]
    [plan] = fc.draw_plans(1, 4, N_TASKS, 0.0, batch_fraction=0.25)
    assert not (set(plan.kinds) & set(fc.HARNESS_KINDS))  # (no harness fault to act)
    report = tmp_path / "r.json"
    workdir = _never_finishing(tmp_path, monkeypatch, "strict")
    assert fc.main([*args, "--workdir", str(workdir), "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "FAILED" in out
    assert "incomplete: the campaign did not finish in 3 launches (--max-restarts 2)" in out
    r = json.loads(report.read_text())
    assert (r["failed_trials"], r["incomplete_trials"], r["allow_incomplete"]) == (1, 1, False)
    assert r["failures"][0]["problems"][0].startswith("incomplete:")
    assert r["incomplete"][0]["restarts"] == 2  # (the keys it always had)

    workdir = _never_finishing(tmp_path, monkeypatch, "allowed")
    assert fc.main([*args, "--workdir", str(workdir), "--json", str(report),
                    "--allow-incomplete"]) == 0
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "FAILED" not in out
    r = json.loads(report.read_text())
    assert (r["failed_trials"], r["incomplete_trials"], r["allow_incomplete"]) == (0, 1, True)
    assert "Reported only (`--allow-incomplete`)." in fc.markdown(r)


# -- the harness's kill: timed from the launch's first result --------------------------------

def test_a_wall_time_kill_waits_for_the_launchs_first_result(farm):
    """Timed from the spawn, 10 of 12 kills fell before the file existed (MPI's start takes
    ~2 s here): a start-up was all they tested."""
    farm.enqueue(*({"data": {"n": i}} for i in range(N_TASKS)))
    farm.ready(1)
    farm.ready(2)
    mon = fc.DbMonitor(farm.path)
    trigger = fc.KillTrigger(fc.KillPlan("time", at_s=0.0))
    trigger.launch(0)
    tokens = farm.dispatch(1, 2)
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:
        assert not trigger.due(mon)  # work in flight, none committed by this launch yet
        time.sleep(0.01)
    _finish(farm, 1, tokens[1])
    deadline = time.monotonic() + 5
    while not trigger.due(mon):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    trigger.fire(mon, 0, 2.5)
    assert trigger.fired and trigger.landed["after_start"] and trigger.landed["mid_run"]
    assert (trigger.landed["results"], trigger.landed["in_flight"]) == (1, 1)
    # A resumed launch: the earlier launch's results are not this one's start.
    again = fc.KillTrigger(fc.KillPlan("time", at_s=0.0))
    again.launch(1)
    assert not again.due(mon)
    # A progress kill whose moment came before this launch committed anything lands in its
    # start, and says so.
    early = fc.KillTrigger(fc.KillPlan("progress", after_results=1))
    early.launch(1)
    while not early.due(mon):
        time.sleep(0.005)
    early.fire(mon, 1, 0.1)
    assert early.landed["after_start"] is False and early.landed["mid_run"] is False
    mon.close()


@pytest.mark.timeout(60)
def test_a_job_that_ends_before_the_kills_moment_is_a_kill_missed(tmp_path):
    trigger = fc.KillTrigger(fc.KillPlan("time", at_s=0.0))
    job = fc.run_job(["sleep", "0.5"], tmp_path / "c.db", tmp_path / "run00", fc.Options(),
                     trigger, 0, False, 1)
    assert job.ended_by == "exit" and not trigger.fired and trigger.landed is None


def test_time_kills_are_seeded_and_fall_within_the_least_the_work_lasts():
    plans = fc.draw_plans(400, seed=3, tasks=20, kill_fraction=1.0, workers=3, work_ms=30)
    times = [p.kill.at_s for p in plans if p.kill.mode == "time"]
    assert len(times) > 80 and all(0 <= t <= 0.2 for t in times)  # 20 x 30 ms / 3
    assert max(times) > 0.15
    again = fc.draw_plans(400, seed=3, tasks=20, kill_fraction=1.0, workers=3, work_ms=30)
    assert [p.kill for p in plans] == [p.kill for p in again]
    # Only the time kills' moments depend on --work-ms: the rest of each plan is the same.
    other = fc.draw_plans(400, seed=3, tasks=20, kill_fraction=1.0, workers=3)
    assert [dataclasses.replace(p, kill=None) for p in plans] == \
           [dataclasses.replace(p, kill=None) for p in other]


# -- result tokens, checked exactly -----------------------------------------------------------

def test_checker_reports_a_made_up_result_token(campaign):
    """A result's token is its dispatch's only record: counts and the audit passed a token
    no dispatch ever had."""
    db, _, good = campaign
    _write(db, "UPDATE results SET token = ? WHERE token = ?", params=("5" * 64, good))
    r = _check(db)
    assert r["wrong_commits"] == 1 and fc.trial_failed(r)
    assert any("was never minted for rank" in p for p in r["problems"])


def test_checker_reports_another_tasks_rolled_back_token(campaign):
    db, recovered, _ = campaign
    _write(db, "UPDATE results SET token = ? WHERE task_id = (SELECT max(task_id) FROM results "
               "WHERE task_id != (SELECT task_id FROM events WHERE token = ? AND kind = "
               "'dispatched'))", params=(recovered, recovered))
    r = _check(db)
    assert r["wrong_commits"] == 1
    assert any("a dispatch that ended (recovered" in p for p in r["problems"])
    assert any("another dispatch (of task" in p for p in r["problems"])


def test_checker_reports_a_token_minted_for_another_rank(campaign):
    db, _, good = campaign
    _write(db, "UPDATE results SET rank = 3 - rank WHERE token = ?", params=(good,))
    r = _check(db)
    assert r["wrong_commits"] == 1
    assert any("was never minted for rank" in p for p in r["problems"])


def test_tokens_of_earlier_incarnations_need_their_epochs(campaign):
    """Each start replaces the epoch in the file: the harness reads it after every job."""
    db, _, _ = campaign
    with sqlite3.connect(db) as c:
        first = c.execute("SELECT epoch FROM campaign").fetchone()[0]
    Farm(db, resume=True).close()
    r = _check(db)
    assert r["unverified_tokens"] == N_TASKS and fc.trial_failed(r)
    r = fc.check_campaign(db, N_TASKS, epochs={1: first})
    assert r["problems"] == [] and not fc.trial_failed(r)
