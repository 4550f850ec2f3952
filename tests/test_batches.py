"""Batch dispatches (`--batch N`): one dispatch, one token, up to N tasks; every rule of the
protocol stays per dispatch, and every task still gets exactly one result row. A failed
batch is split in halves back at the head of the queue, none charged, so a poison task is
alone after ceil(log2 N) more failures and only it is ever charged."""

from __future__ import annotations

import math

import pytest
from conftest import Farm
from mpi_jobs import check_conservation, query, run

from store.audit import audit_path
from store.journal import RetryPolicy
from store.schema import WorkerState
from store.stats import read_stats
from store.workers import ranks_in_state

T = "t" * 64


def batch_result(token: str, task_ids, **per_task) -> dict:
    return {"token": token, "status": "ok",
            "batch": [{"status": "ok", "value": {"task": t}, **per_task} for t in task_ids]}


def states(farm: Farm) -> dict[int, tuple[str, int, int]]:
    """task id -> (state, attempts, budget_used)."""
    with farm.store.reading() as conn:
        return {r[0]: tuple(r[1:]) for r in conn.exec_driver_sql(
            "SELECT id, state, attempts, budget_used FROM tasks")}


def test_a_batch_commits_a_result_per_task_under_one_token(db_path):
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(10)))
    farm.ready(1)
    [p] = farm.plan(1, batch=4)
    assert [t.id for t in p.tasks] == ids[:4]
    round_ = farm.result_raw(1, batch_result(p.token, ids[:4]))
    assert len(round_.committed) == 4
    with farm.store.reading() as conn:
        rows = conn.exec_driver_sql("SELECT task_id, token, value FROM results "
                                    "ORDER BY task_id").fetchall()
        leases = conn.exec_driver_sql("SELECT count(*) FROM leases").scalar()
    assert [(r[0], r[1]) for r in rows] == [(i, p.token) for i in ids[:4]]
    assert [r[2] for r in rows] == [f'{{"task": {i}}}' for i in ids[:4]]
    assert leases == 0  # the batch's work leases went with its dispatch
    farm.close()
    assert audit_path(db_path).ok, audit_path(db_path).text()


def test_automatic_batches_share_a_short_queue_among_the_idle_ranks(db_path):
    """With --batch auto, the last tasks of a queue go to every idle rank, not all to the
    first one (which would then run them while the others wait)."""
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(10)))
    for rank in (1, 2, 3):
        farm.ready(rank)
    plan = farm.plan(1, 2, 3, batch=1000, spread=True)
    assert [len(p.tasks) for p in plan] == [4, 4, 2]
    assert [t.id for p in plan for t in p.tasks] == ids  # in queue order, each task once
    farm.close()


def test_a_fixed_batch_size_is_not_spread(db_path):
    farm = Farm(db_path)
    farm.enqueue(*({"data": i} for i in range(10)))
    for rank in (1, 2, 3):
        farm.ready(rank)
    assert [len(p.tasks) for p in farm.plan(1, 2, 3, batch=8)] == [8, 2]
    farm.close()


@pytest.mark.parametrize("failed", [{"status": "timeout"},
                                    {"status": "not_run", "detail": "cannot start 't': again"}])
def test_a_task_of_a_batch_whose_run_failed_is_retried_while_the_others_commit(db_path, failed):
    """A `timeout` (killed), or a `not_run` (its host could not start it): that task only."""
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(4)))
    farm.ready(1)
    [p] = farm.plan(1, batch=4)
    answer = batch_result(p.token, ids)
    answer["batch"][1].update(failed)
    round_ = farm.result_raw(1, answer)
    assert len(round_.committed) == 3
    with farm.store.reading() as conn:
        done = [r[0] for r in conn.exec_driver_sql("SELECT task_id FROM results ORDER BY 1")]
    assert done == [ids[0], ids[2], ids[3]]
    # Back for another run, on its own; a run its host could not start is charged the
    # budget only, never the attempt ceiling.
    assert states(farm)[ids[1]] == ("queued", int(failed["status"] == "timeout"), 1)
    farm.close()
    assert audit_path(db_path).ok, audit_path(db_path).text()


@pytest.mark.parametrize("failed", [{"status": "timeout"},
                                    {"status": "not_run", "detail": "cannot start 't': again"}])
def test_a_batch_whose_every_run_failed_after_its_ready_frees_its_rank(db_path, failed):
    """Every task of the batch timed out (or its host could not start it), and its READY came
    before its RESULT: the dispatch ends with no result to wait for, so the rank is idle and
    gets the retries (or other work) at once. Left busy, it would hold no dispatch and never
    be given work again: no READY is coming to free it, it was already seen."""
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(2)))
    farm.ready(1)
    [p] = farm.plan(1, batch=2, sent=True)
    farm.ready(1, p.token)  # READY first: the mark is set, the rank still busy
    round_ = farm.result_raw(1, batch_result(p.token, ids, **failed))
    assert round_.committed == [] and round_.retried == [1]
    assert farm.state()["workers"] == [(1, "idle", None)]
    assert farm.state()["dispatches"] == []
    assert all(states(farm)[t][0] == "queued" for t in ids)
    with farm.store.reading() as conn:  # the ranks the master gives work to
        idle = ranks_in_state(conn, WorkerState.IDLE)
    [again] = farm.plan(*idle, batch=2)
    assert again.rank == 1 and [t.id for t in again.tasks] == ids  # in the batch's order
    farm.close()
    assert audit_path(db_path).ok, audit_path(db_path).text()


def queue_order(farm: Farm) -> list[tuple[int, int | None]]:
    """The queued tasks in the order they go out: (id, batch_cap)."""
    with farm.store.reading() as conn:
        return [tuple(r) for r in conn.exec_driver_sql(
            "SELECT id, batch_cap FROM tasks WHERE state = 'queued' ORDER BY queue_pos, id")]


@pytest.mark.parametrize("failing", [4, 2], ids=["every-run", "two-runs"])
def test_the_failed_runs_of_a_batch_go_back_to_the_head_in_the_batchs_order(db_path, failing):
    """Every run of a batch of 4 timed out (or 2 of them, the others committed): its tasks
    go back to the head, ahead of the queue, in the order the batch held them. Each retried
    to the head on its own put them there in reverse order (4, 3, 2, 1)."""
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(6)))
    farm.ready(1)
    [p] = farm.plan(1, batch=4, sent=True)
    answer = batch_result(p.token, ids[:4])
    for outcome in answer["batch"][4 - failing:]:
        outcome["status"] = "timeout"
    farm.result_raw(1, answer)
    assert queue_order(farm) == [(t, None) for t in ids[4 - failing:]]
    assert [states(farm)[t] for t in ids[4 - failing:4]] == [("queued", 1, 1)] * failing
    farm.close()
    assert audit_path(db_path).ok, audit_path(db_path).text()


def _a_broken_batch_of_3(db_path):
    """A batch of 3 sent to rank 1, answered by an invalid RESULT and a READY: its sweep
    rolls it back in halves."""
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(3)))
    farm.ready(1)
    [p] = farm.plan(1, batch=3, sent=True)
    farm.result_raw(1, {"status": "ok"})  # no token: the invalid mark
    farm.ready(1, p.token)
    return farm, ids, p


def test_a_half_whose_every_run_failed_goes_back_ahead_of_the_other_half(db_path):
    """A broken batch of 3 went back as halves (a, b) and (c); the first half's runs then all
    timed out: a and b go back in their order, still a half of 2, ahead of c. Reversed, the
    next dispatches held (b, a) and (c)."""
    farm, (a, b, c), p = _a_broken_batch_of_3(db_path)
    farm.sweep()
    [p] = farm.plan(1, batch=3, sent=True)
    assert [t.id for t in p.tasks] == [a, b]
    farm.result_raw(1, batch_result(p.token, [a, b], status="timeout"))
    assert queue_order(farm) == [(a, 2), (b, 2), (c, 1)]
    farm.ready(1, p.token)
    farm.ready(2)
    plan = farm.plan(1, 2, batch=3)
    assert [[t.id for t in q.tasks] for q in plan] == [[a, b], [c]]
    farm.close()
    assert audit_path(db_path).ok, audit_path(db_path).text()


def test_a_result_that_answers_fewer_tasks_than_the_batch_holds_is_invalid(db_path):
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(3)))
    farm.ready(1)
    [p] = farm.plan(1, batch=3)
    farm.result_raw(1, batch_result(p.token, ids[:2]))
    farm.result(1, p.token)  # a single task's RESULT for a batch: invalid too
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql("SELECT detail FROM quarantine ORDER BY id").fetchall() == [
            ("payload: the RESULT answers 2 task(s); the dispatch holds 3",),
            ("payload: the RESULT answers 1 task(s); the dispatch holds 3",)]
        assert conn.exec_driver_sql("SELECT count(*) FROM results").scalar() == 0
    farm.close()


def test_a_poison_task_in_a_batch_of_64_is_isolated_and_only_it_is_charged(db_path):
    """The poison task's dispatches always fail (an invalid RESULT joined with its READY);
    every other task's succeed. Each failure splits the batch that held it in halves."""
    n = 64
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(n)))
    poison = ids[37]
    holding_poison: list[int] = []
    farm.ready(1)
    for _ in range(200):
        plan = farm.plan(1, batch=n, sent=True)
        if not plan:
            break
        [p] = plan
        tasks = [t.id for t in p.tasks]
        if poison not in tasks:
            farm.result_raw(1, batch_result(p.token, tasks))
            farm.ready(1, p.token)
            continue
        holding_poison.append(len(tasks))
        farm.result_raw(1, {"token": p.token, "status": "ok", "batch": "not a list"})
        farm.ready(1, p.token)
        farm.sweep()
    # 64, 32, 16, 8, 4, 2 fail and are split; then it goes out alone (charged) and again
    # alone after its one requeue, and is deferred.
    assert holding_poison[:7] == [64, 32, 16, 8, 4, 2, 1]
    assert holding_poison[1:].index(1) + 1 == math.ceil(math.log2(n))
    got = states(farm)
    assert got[poison][0] == "deferred" and got[poison][1:] == (2, 2)
    assert all(got[t] == ("done", 0, 0) for t in ids if t != poison), got
    with farm.store.reading() as conn:
        per_task = dict(conn.exec_driver_sql(
            "SELECT task_id, count(*) FROM results GROUP BY task_id").fetchall())
    assert per_task == {t: 1 for t in ids if t != poison}
    farm.close()
    report = audit_path(db_path)
    assert report.ok, report.text()


def test_a_batch_rolled_back_by_rank_and_token_undoes_every_task_it_held(db_path):
    """R6 per dispatch: a stale token changes nothing; the current one takes every task of
    the batch back, its work and side leases with it."""
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i, "target_branch": 100 + i} for i in range(5)))
    farm.ready(1)
    [p] = farm.plan(1, batch=5, sent=True)
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql("SELECT kind, count(*) FROM leases GROUP BY kind").fetchall(
        ) == [("target", 5), ("work", 4)]
    farm.result_raw(1, {"token": T, "status": "ok"})  # stale: proves nothing
    farm.result_raw(1, {"status": "ok"})              # missing: the invalid mark
    farm.ready(1, p.token)
    [rec] = farm.sweep()
    assert rec.halves == (tuple(ids[:3]), tuple(ids[3:]))
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM leases").scalar() == 0
        assert conn.exec_driver_sql("SELECT count(*) FROM dispatches").scalar() == 0
        order = [r[0] for r in conn.exec_driver_sql(
            "SELECT id FROM tasks WHERE state = 'queued' ORDER BY queue_pos, id")]
    assert order == ids  # back at the head, in order
    assert all(v == ("queued", 0, 0) for v in states(farm).values())
    farm.close()
    assert audit_path(db_path).ok


def test_a_broken_batch_of_an_odd_size_goes_back_with_the_larger_half_first(db_path):
    """Halves of an odd batch: the first ceil(n/2) tasks, then the rest, each task capped to
    its own half (`tasks.batch_cap`), so the next dispatches are of 2 and 1 for a batch of 3.
    (The batches of 64 elsewhere split evenly at every step: an off-by-one in the halving, or
    halves the other way round, passed them.)"""
    farm, (a, b, c), p = _a_broken_batch_of_3(db_path)
    [rec] = farm.sweep()
    assert rec.halves == ((a, b), (c,))
    with farm.store.reading() as conn:
        caps = [r[0] for r in conn.exec_driver_sql(
            "SELECT batch_cap FROM tasks WHERE state = 'queued' ORDER BY queue_pos, id")]
        [detail] = [r[0] for r in conn.exec_driver_sql(
            "SELECT detail FROM events WHERE token = ? AND kind = 'requeued'", (p.token,))]
    assert caps == [2, 2, 1]
    assert detail.startswith("split: 3 tasks back at the head in halves of 2 and 1, "
                             "none charged"), detail
    farm.ready(2)
    plan = farm.plan(1, 2, batch=3)
    assert [[t.id for t in q.tasks] for q in plan] == [[a, b], [c]]
    farm.close()
    assert audit_path(db_path).ok, audit_path(db_path).text()


def test_a_batch_whose_outcomes_are_too_large_for_one_result_is_split_not_refused(db_path):
    """A worker whose batch's outcomes are over the bound on one message says so (`status:
    split`): the batch goes back in halves, none charged, no message quarantined; each half
    commits in its own RESULT. The same answer to a dispatch of one task is an invalid
    payload: one task cannot be split."""
    from coordinator.wire import SPLIT_STATUS

    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(6)))
    farm.ready(1)
    [p] = farm.plan(1, batch=6, sent=True)
    farm.result_raw(1, {"token": p.token, "status": SPLIT_STATUS,
                        "detail": "the result is 99999 bytes, over --max-message-bytes 65536"})
    farm.ready(1, p.token)
    [rec] = farm.sweep()
    assert rec.halves == (tuple(ids[:3]), tuple(ids[3:]))
    assert farm.events()["quarantined"] == 0
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM quarantine").scalar() == 0
        # Said by one event of its own: no protocol requeue, which a healthy run keeps at 0.
        assert conn.exec_driver_sql(
            "SELECT kind, detail FROM events WHERE token = ? AND kind NOT IN ('invalid', "
            "'dispatched')", (p.token,)).fetchall() == [
            ("split", "split: 6 tasks back at the head in halves of 3 and 3, none charged "
                      "(split: the result is 99999 bytes, over --max-message-bytes 65536)")]
    with farm.store.reading() as conn:
        stats = read_stats(conn)
    assert (stats.requeued, stats.deferred) == (0, 0)
    sizes = []
    while plan := farm.plan(1, batch=6, sent=True):
        [p] = plan
        sizes.append(len(p.tasks))
        farm.result_raw(1, batch_result(p.token, [t.id for t in p.tasks]))
        farm.ready(1, p.token)
    assert sizes == [3, 3]
    assert all(states(farm)[t] == ("done", 0, 0) for t in ids)
    [single] = farm.enqueue({"data": "alone"})
    [p] = farm.plan(1, batch=6, sent=True)
    farm.result_raw(1, {"token": p.token, "status": SPLIT_STATUS, "detail": "no"})
    farm.ready(1, p.token)
    [one] = farm.sweep()
    assert one.halves is None and one.attempts == 1 and states(farm)[single][1] == 1
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql(
            "SELECT channel, reason FROM quarantine").fetchall() == [("result", "payload")]
    farm.close()


def test_a_batch_a_crash_interrupted_goes_back_in_halves_until_its_poison_task_is_alone(
        db_path):
    """Without ULFM a worker's crash ends the whole job: the batch it held is interrupted, and
    `--resume` put it back whole, so the next run dispatched it whole and crashed again, for
    ever, its poison task never charged. An interrupted batch now goes back in halves that
    last across restarts (`tasks.batch_cap`): the poison task's dispatches halve, then it
    alone is charged, once per crash, up to the ceiling; every other task commits once."""
    n, poison_at = 64, 37
    farm = Farm(db_path, policy=RetryPolicy(retries=1, max_attempts=3))
    ids = farm.enqueue(*({"data": i} for i in range(n)))
    poison = ids[poison_at]
    holding_poison: list[int] = []
    for _restart in range(40):
        farm.ready(1)
        while plan := farm.plan(1, batch=n, sent=True):
            [p] = plan
            tasks = [t.id for t in p.tasks]
            if poison in tasks:
                holding_poison.append(len(tasks))
                break  # the job ends with this dispatch in flight
            farm.result_raw(1, batch_result(p.token, tasks))
        else:
            break  # nothing left to dispatch
        farm.close()
        farm = Farm(db_path, resume=True, policy=RetryPolicy(retries=1, max_attempts=3))
    assert holding_poison == [64, 32, 16, 8, 4, 2, 1, 1, 1], holding_poison
    got = states(farm)
    assert got[poison] == ("failed", 3, 0)  # charged once per crash alone, up to the ceiling
    assert all(got[t] == ("done", 0, 0) for t in ids if t != poison), got
    with farm.store.reading() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM results").scalar() == n - 1
        splits = [r[0] for r in conn.exec_driver_sql(
            "SELECT detail FROM events WHERE kind = 'interrupted' AND detail LIKE 'split:%' "
            "ORDER BY id")]
    assert len(splits) == 6 and splits[0].startswith("split: 64 tasks back at the head in "
                                                     "halves of 32 and 32")
    farm.close()
    assert audit_path(db_path).ok


# -- under MPI: a poison task in a batch of 64 ----------------------------------------------

POISON = 37
POISON_MODULE = f"""
import time

def run(task):
    n = task["data"]["n"]
    # past the watchdog's deadline (1 s): whatever dispatch holds this task is retired
    if n == {POISON}:
        time.sleep(2)
    return n * n
"""


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_poison_task_in_a_batch_of_64_is_isolated_and_alone_charged(tmp_path):
    """64 tasks in one batch, one of them poison (it runs past the watchdog's deadline, so
    each dispatch holding it is retired; its worker comes back 2 s later): the batch is split
    64, 32, 16, 8, 4, 2, 1, each split uncharged; only the poison task is ever charged, and it
    alone is deferred; the 63 others commit their own results, each exactly once. (A poison
    that makes the RESULT invalid no longer exists: a value over the master's bound is the
    task's own error since the worker checks it.)"""
    mod = tmp_path / "poison.py"
    mod.write_text(POISON_MODULE)
    db = tmp_path / "c.db"
    done = run(["run", "--db", str(db), "--demo", "64", "--batch", "64", "--callable",
                f"{mod}:run", "--retries", "1", "--watchdog", "1", "--no-progress"], np=2,
               timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=64)
    rows = query(db, "SELECT json_extract(t.payload, '$.data.n'), t.state, t.attempts, "
                     "r.value FROM tasks t LEFT JOIN results r ON r.task_id = t.id")
    by_n = {n: (state, attempts, value) for n, state, attempts, value in rows}
    poison_state, poison_attempts, poison_value = by_n.pop(POISON)
    assert poison_state == "deferred" and poison_value is None and poison_attempts >= 1
    assert by_n == {n: ("done", 0, str(n * n)) for n in range(64) if n != POISON}
    splits = query(db, "SELECT detail FROM events WHERE kind = 'requeued' "
                       "AND detail LIKE 'split:%' ORDER BY id")
    assert len(splits) == math.ceil(math.log2(64)), splits
    retired = query(db, "SELECT count(*) FROM events WHERE kind = 'watchdog'")[0][0]
    assert retired == len(splits) + poison_attempts  # each split's batch, then the task alone


WIDE_MODULE = """
def run(task):
    return str(task["data"]["n"]) * 10_000  # 10 KB to 20 KB: 16 of them are over 64 KiB
"""


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_batch_too_large_for_one_result_commits_every_value_in_smaller_dispatches(tmp_path):
    """Values that each fit a message but not sixteen together: the batch is split (asked by
    its worker, never refused) until its halves' RESULTs fit, and every task commits its own
    value `ok`. Before, all sixteen were committed as `error` results."""
    mod = tmp_path / "wide.py"
    mod.write_text(WIDE_MODULE)
    db = tmp_path / "c.db"
    done = run(["run", "--db", str(db), "--demo", "32", "--batch", "16", "--callable",
                f"{mod}:run", "--max-message-bytes", "65536", "--no-progress"], np=2,
               timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=32)
    rows = query(db, "SELECT json_extract(t.payload, '$.data.n'), r.status, r.value "
                     "FROM tasks t JOIN results r ON r.task_id = t.id")
    assert sorted(rows) == sorted((n, "ok", '"' + str(n) * 10_000 + '"') for n in range(32))
    assert query(db, "SELECT count(*) FROM quarantine")[0][0] == 0
    splits = query(db, "SELECT count(*) FROM events WHERE kind = 'split' "
                       "AND detail LIKE 'split:%over --max-message-bytes 65536%'")[0][0]
    assert splits >= 2  # both batches of 16 (and their halves while still too large)
    # Nothing failed: no protocol requeue (R10 keeps it at 0 in a healthy run).
    assert query(db, "SELECT count(*) FROM events WHERE kind = 'requeued'") == [(0,)]


CRASH_MODULE = """
import os, signal, time

def run(task):
    n = task["data"]["n"]
    if n == 13:
        # Late enough that the other ranks' tasks, all instant, are done when the job ends:
        # without failure notification a dispatch a crash interrupts counts an attempt, and
        # which rank crashed cannot be told.
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGSEGV)  # the worker dies, and without ULFM, the job
    return n * n
"""


@pytest.mark.mpi
@pytest.mark.timeout(420)
def test_a_crash_in_a_batch_without_ulfm_is_isolated_across_resumes(tmp_path):
    """Without ULFM (MPICH; Open MPI without --with-ft ulfm) a worker's crash ends the whole
    job. The batch that held the crashing task went back whole at each --resume, so every
    resumed run crashed the same way, for ever, the task never charged (MPICH: 4 resumes, 0
    done). Its halves are now kept in the file: each resume halves the crashing task's
    batch until it runs alone, is charged once per crash, and fails at the ceiling; every
    other task commits once."""
    mod = tmp_path / "crash.py"
    mod.write_text(CRASH_MODULE)
    db = tmp_path / "c.db"
    args = ["run", "--db", str(db), "--demo", "32", "--batch", "16", "--callable",
            f"{mod}:run", "--retries", "1", "--max-attempts", "2", "--no-progress"]
    runs = [run(args, np=3, ulfm=False, timeout=120)]
    while runs[-1].returncode != 0 and len(runs) < 12:
        runs.append(run([*args, "--resume"], np=3, ulfm=False, timeout=120))
    assert runs[-1].returncode == 0, [r.returncode for r in runs]
    # 16 -> 8 -> 4 -> 2 -> 1, then charged alone up to the ceiling of 2: 6 crashed runs or
    # fewer (a crash may also end a run after the crashing task's own batch was split).
    assert 2 <= len(runs) <= 8, [r.returncode for r in runs]
    check_conservation(db, expected_tasks=32)
    rows = dict(((n, state) for n, state in query(
        db, "SELECT json_extract(payload, '$.data.n'), state FROM tasks")))
    assert rows.pop(13) == "failed"
    assert set(rows.values()) == {"done"}
    assert query(db, "SELECT attempts FROM tasks WHERE json_extract(payload, '$.data.n') = 13"
                 ) == [(2,)]
    splits = query(db, "SELECT count(*) FROM events WHERE detail LIKE 'split:%'")[0][0]
    assert splits >= 4  # 16, 8, 4, 2: each halved, across the restarts
