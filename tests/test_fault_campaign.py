"""tools/fault_campaign.py: a short real campaign under mpiexec, and proof that its checker
fails on planted violations (a checker that cannot fail proves nothing)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fault_campaign.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("fault_campaign", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fault_campaign"] = mod  # dataclasses resolve annotations through it
    spec.loader.exec_module(mod)
    return mod


fc = _load_tool()


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_short_campaign_passes_and_writes_both_reports(tmp_path):
    out_json, out_md = tmp_path / "report.json", tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, str(TOOL), "--trials", "4", "--tasks", "20", "--seed", "1",
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
    assert done.stdout.count("\ntrial ") + done.stdout.startswith("trial ") == 4
    md = out_md.read_text()
    assert "fault_campaign.py --trials 4 --tasks 20 --seed 1" in md
    assert "| **all** |" in md


def test_plans_are_seeded_and_cover_every_kind():
    plans = fc.draw_plans(len(fc.ALL_KINDS), seed=3, tasks=40, kill_fraction=0.3)
    assert {k for p in plans for k in p.rates} == set(fc.ALL_KINDS)
    assert all(1 <= len(p.rates) <= 4 for p in plans)
    assert all(fc.RATE_MIN <= r <= fc.RATE_MAX for p in plans for r in p.rates.values())
    again = fc.draw_plans(len(fc.ALL_KINDS), seed=3, tasks=40, kill_fraction=0.3)
    assert [(p.rates, p.inject_seed, p.kill) for p in plans] == \
           [(p.rates, p.inject_seed, p.kill) for p in again]
    many = fc.draw_plans(400, seed=3, tasks=40, kill_fraction=0.3)
    assert 80 <= sum(p.kill is not None for p in many) <= 160
    assert min(Counter(k for p in many for k in p.rates).values()) >= 25


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
