"""A broken or hostile rank cannot crash, hang, bloat or steer the master (issue 19).

Each test runs a real job, MPMD: the master, one misbehaving rank (`bad_rank.py MODE`) and two
honest workers, `mpiexec -n 1 coordinator run ... : -n 1 python bad_rank.py ... : -n 2
coordinator run ...`. Every job is bounded in time (`finish`) and the master's memory is read
from its own summary (`--summary-json`, peak RSS).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_jobs import (
    MPIEXEC,
    check_conservation,
    finish,
    kill_job,
    master_pid,
    mpi_kind,
    output_files,
    query,
    start,
    status_json,
    wait_for,
)
from processes import running

from coordinator.exits import ExitStatus
from coordinator.launcher import mpiexec_flags
from store.lock import lock_holder

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300),
              pytest.mark.skipif(mpi_kind() != "openmpi",
                                 reason="the hostile rank's checks run under Open MPI (issue "
                                        "19); MPICH ends a job whose rank is fenced")]

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def hostile_job(tmp_path: Path, mode: str, arg: str = "", *args: str,
                tasks: int = 60, stop_wait: str = "5") -> tuple[object, Path, Path]:
    """Start the job: (its Job, the campaign file, the summary file)."""
    db, summary = tmp_path / "c.db", tmp_path / "summary.json"
    rank = [sys.executable, "-m", "coordinator", "run", "--db", str(db), "--demo", str(tasks),
            "--no-progress", "--summary-json", str(summary), "--stop-wait", stop_wait, *args]
    flags = [f for f in mpiexec_flags(MPIEXEC, 1, ulfm=True) if f not in ("-n", "1")]
    command = [MPIEXEC, *flags, "-n", "1", *rank, ":", "-n", "1", sys.executable,
               str(HERE / "bad_rank.py"), mode, *([arg] if arg else []), ":", "-n", "2", *rank]
    env = {"PYTHONPATH": str(HERE.parent)}
    return start([], command=command, env=env), db, summary


def peak_rss_mib(summary: Path) -> float:
    return json.loads(summary.read_text())["master_peak_rss_mib"]


def quarantined(db: Path) -> dict[tuple[str, str], tuple[int, int]]:
    """(channel, reason) -> (rows, messages they stand for)."""
    return {(c, r): (n, m) for c, r, n, m in query(
        db, "SELECT channel, reason, count(*), sum(repeats) FROM quarantine GROUP BY 1, 2")}


def test_a_pid_the_store_cannot_hold_is_quarantined_not_fatal(tmp_path):
    """One idle READY with pid 2**64 - 1 ended the master (exit 5): the store raised
    OverflowError writing it. Every reported field is range-checked at the gate."""
    job, db, _ = hostile_job(tmp_path, "pid")
    done = finish(job, timeout=180)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    check_conservation(db, expected_tasks=60)
    [(detail,)] = query(db, "SELECT detail FROM quarantine WHERE channel = 'ready'")
    assert "pid 18446744073709551615 is not a process id" in detail


@pytest.mark.parametrize("size", [300 * MiB, (2 << 30) + 5 * MiB])
def test_an_oversized_message_is_consumed_without_being_held(tmp_path, size):
    """A message over 2 GiB ended the master (exit 5), and one of 1.9 GB raised its RSS to
    1.9 GiB although --max-message-bytes was 64 MiB: the size is now read from the probe and
    the message consumed into a small buffer, quarantined as oversized."""
    # Making and sending 2 GiB took the rank past a 5 s --stop-wait on a loaded machine: it
    # had not acknowledged the STOP when the 60 tasks were done (exit 4, UNACKED).
    job, db, summary = hostile_job(tmp_path, "oversized", str(size), stop_wait="60")
    done = finish(job, timeout=240)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    check_conservation(db, expected_tasks=60)
    assert quarantined(db) == {("result", "oversized"): (1, 1)}
    [(detail,)] = query(db, "SELECT detail FROM quarantine")
    assert detail == f"oversized message: {size} bytes > {64 * MiB}"
    assert peak_rss_mib(summary) < 3 * 64, peak_rss_mib(summary)


@pytest.mark.parametrize("where, n", [("value", 60_000_000), ("testcases", 15_000_000)])
def test_a_decoding_bomb_in_a_current_result_costs_no_memory(tmp_path, where, n):
    """A 64 MiB msgpack "bomb" (an array of empty arrays) raised the master's RSS to 4.7 GiB.
    Messages are decoded into typed structs: a value over its bound is refused unread (the
    task is retried), test cases past the first MAX_TESTCASES are counted, not built."""
    job, db, summary = hostile_job(tmp_path, f"bomb-{where}", str(n), "--no-feedback")
    done = finish(job, timeout=240)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    check_conservation(db, expected_tasks=60)
    # The master's own ~70 MiB and the bomb's receive buffer (60 MB), held once: what is
    # decoded of it are views of that buffer (msgspec.Raw) and 1,000 test cases at most.
    # 127 MiB here, under load too; decoded, the bomb took 4.7 GiB.
    assert peak_rss_mib(summary) < 3 * 64, peak_rss_mib(summary)
    if where == "value":
        [(detail,)] = query(db, "SELECT detail FROM quarantine WHERE reason = 'payload'")
        assert "its value is" in detail and "over the 2097152 a value may have" in detail
    else:
        assert query(db, "SELECT sum(dropped) FROM results") == [(n - 1000,)]


def test_messages_on_a_foreign_tag_are_drained_and_counted(tmp_path):
    """Messages on tags the master never receives piled up in MPI's queue (320,000 brought
    it to 1.6 GiB in 47 s). Every message to rank 0 is drained, whatever its tag; the
    quarantine keeps a sample of rows and the exact count."""
    job, db, summary = hostile_job(tmp_path, "foreign", "900", "--demo-work-ms", "50")
    done = finish(job, timeout=240)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    check_conservation(db, expected_tasks=60)
    rows, messages = quarantined(db)[("other", "foreign_tag")]
    assert messages == 900 and rows == 100
    assert "Quarantined other messages: 900 (foreign_tag=900)" in done.stderr


def test_a_flood_on_a_foreign_tag_costs_no_memory_and_refuses_its_rank(tmp_path):
    """A rank whose messages are mostly garbage gets no more work (and is ended with the job);
    however many it sends, they are drained at the master's pace and sampled."""
    job, db, summary = hostile_job(tmp_path, "foreign", "300000", "--demo-work-ms", "50")
    done = finish(job, timeout=240)
    assert "rank 1 is refused: " in done.stderr, done.stderr[-3000:]
    assert done.returncode == ExitStatus.UNACKED, done.stderr[-3000:]  # ended with the job
    check_conservation(db, expected_tasks=60)
    rows, messages = quarantined(db)[("other", "foreign_tag")]
    assert messages >= 1_000 and rows == 100
    assert peak_rss_mib(summary) < 3 * 64, peak_rss_mib(summary)


def test_a_rank_that_never_starts_is_treated_as_lost(tmp_path):
    """A rank that never joined the start-up barrier left the honest workers waiting in it
    and the master with 300 tasks queued, past any bound. The verdict goes to each worker
    alone, and a rank silent --start-wait seconds after the start is lost."""
    job, db, _ = hostile_job(tmp_path, "silent", "", "--start-wait", "3",
                             "--demo-work-ms", "200")
    done = finish(job, timeout=180)
    assert "rank 1 reported no READY 3 s after the start; treated as lost" in done.stderr
    assert done.returncode == ExitStatus.UNACKED, done.stderr[-3000:]  # ended at the end
    check_conservation(db, expected_tasks=60)
    assert query(db, "SELECT count(*) FROM results") == [(60,)]


def test_a_pid_that_is_not_the_ranks_own_is_never_fenced(tmp_path):
    """A rank that sent another process's pid in its READY and then ignored STOP got that
    process killed by the fence. The fence checks the process is that rank of this job."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        job, db, _ = hostile_job(tmp_path, "steer", str(victim.pid), "--watchdog", "3")
        done = finish(job, timeout=180)
        time.sleep(1)
        assert victim.poll() is None, "the fence killed a process that is no rank"
    finally:
        victim.kill()
        victim.wait()
    assert f"rank 1 reported pid {victim.pid}, which is not fenced" in done.stderr, \
        done.stderr[-3000:]
    check_conservation(db, expected_tasks=60)


def test_test_cases_past_the_masters_limit_are_dropped_and_counted(tmp_path):
    """105 answers of 2,000 test cases made 210,000 tasks and files; one of 100,000 held the
    master in one round ~95 s. The master keeps MAX_TESTCASES per RESULT, counts the rest."""
    job, db, _ = hostile_job(tmp_path, "testcases", "5000", "--no-feedback")
    done = finish(job, timeout=240)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    check_conservation(db)
    assert query(db, "SELECT max(testcases), sum(dropped) FROM results") == [(1000, 4000)]
    assert len(output_files(tmp_path / "c.db.out")) == 1000


def test_a_pickle_sent_to_other_ranks_is_never_unpickled(tmp_path):
    """The start-up broadcast was a pickled bcast that a rank relays in Open MPI's tree: a
    rogue at rank 1 had its pickle unpickled (its code run) by rank 3. Nothing that crosses
    the wire is pickled; a worker takes its verdict from rank 0 alone."""
    marker = tmp_path / "pwned"
    job, db, _ = hostile_job(tmp_path, "pickle", str(marker))
    done = finish(job, timeout=180)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    assert not marker.exists()
    check_conservation(db, expected_tasks=60)


def test_a_rank_sending_mostly_garbage_is_refused_and_its_rows_stay_few(tmp_path):
    """77,290 quarantine rows came from one rogue in 30 s. Rows are sampled per rank and
    reason (exact counts in `repeats`); a rank whose messages are mostly garbage gets no
    more work, and the master says so."""
    job, db, _ = hostile_job(tmp_path, "garbage", "20000", "--demo-work-ms", "100")
    done = finish(job, timeout=240)
    assert done.returncode == ExitStatus.UNACKED, done.stderr[-3000:]  # ended with the job
    assert "rank 1 is refused: " in done.stderr
    check_conservation(db, expected_tasks=60)
    q = quarantined(db)
    # The 20,000 (READYs malformed; RESULTs unowned: the rank held no dispatch), and the READY
    # it sent after them, refused too.
    assert 20_000 <= sum(m for _, m in q.values()) <= 20_001, q
    assert sum(n for n, _ in q.values()) <= 300  # 100 per rank, channel and reason at most
    assert query(db, "SELECT state FROM workers WHERE rank = 1") == [("failed",)]
    # Refused, not dead: the metrics and `status` counted it among the worker deaths.
    seen = status_json(db)
    assert (seen["worker_deaths"], seen["refused_ranks"]) == (0, 1)


def test_forged_stop_acks_are_counted_not_printed(tmp_path):
    """Each forged STOP_ACK printed a line (25,059 in one run)."""
    job, db, _ = hostile_job(tmp_path, "acks", "10000", stop_wait="60")
    done = finish(job, timeout=240)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    assert done.stderr.count("STOP_ACK with a token") == 3
    rows, messages = quarantined(db)[("stop_ack", "stale")]
    assert messages == 10_000 and rows <= 100
    check_conservation(db, expected_tasks=60)


@pytest.mark.timeout(240)
def test_a_rank_flooding_invalid_results_is_refused_and_its_rows_stay_few(tmp_path):
    """A rank that answered each WORK with 2,000 bad RESULTs of its current token wrote an
    `invalid` event per message (168,000 rows, a 23 MB file in 32 s) and, its READYs being
    current, was never refused: it failed 84 dispatches, deferring 42 tasks. Now one event per
    dispatch, the messages counted exactly in the sampled quarantine, and the rank refused as
    one whose messages are mostly quarantined; the honest ranks run every task once."""
    per_work, tasks = 600, 300
    # (a budget that outlasts the flood: the few tasks it fails are requeued, not deferred;
    # refused at its second dispatch, 1 s later, after the pause its first one earned)
    job, db, _ = hostile_job(tmp_path, "flood", str(per_work), "--batch", "1", "--retries", "8",
                             "--demo-work-ms", "20", tasks=tasks)
    done = finish(job, timeout=200)
    assert "rank 1 is refused: " in done.stderr, done.stderr[-3000:]
    assert done.returncode == ExitStatus.UNACKED, done.stderr[-3000:]  # ended with the job
    check_conservation(db, expected_tasks=tasks)
    assert query(db, "SELECT rank, count(*), count(DISTINCT task_id) FROM results "
                     "GROUP BY rank HAVING rank = 1") == []
    assert query(db, "SELECT count(*), count(DISTINCT task_id) FROM results") == [(tasks, tasks)]
    # Its dispatches (each ended without a result, each recorded by its `dispatched` event):
    # refused past 1,000 quarantined messages, 10 times its current READYs, so 5 at most.
    [(works,)] = query(db, "SELECT count(*) FROM events WHERE kind = 'dispatched' AND rank = 1")
    assert 1 <= works <= 5, works
    assert query(db, "SELECT count(*), count(DISTINCT token) FROM events "
                     "WHERE kind = 'invalid'") == [(works, works)]
    q = quarantined(db)
    assert sum(m for (c, _), (_, m) in q.items() if c == "result") == works * per_work, q
    assert all(n <= 100 for n, _ in q.values()), q
    # Besides its tasks' `enqueued`: the start, each of its dispatches' record, mark and
    # rollback (`recovered`, `requeued`), its refusal, and the stop.
    [(events,)] = query(db, "SELECT count(*) FROM events WHERE kind != 'enqueued'")
    assert events <= 4 * works + 3, query(db, "SELECT kind, count(*) FROM events GROUP BY 1")
    checked = subprocess.run([sys.executable, "-m", "coordinator", "check", "--db", str(db)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "consistent" in checked.stdout, checked
    seen = status_json(db)
    assert (seen["worker_deaths"], seen["refused_ranks"], seen["deferred"]) == (0, 1, 0)


@pytest.mark.timeout(240)
def test_a_rank_answering_timeouts_no_run_could_reach_defers_no_task(tmp_path):
    """A rank answering every WORK at once with a valid `timeout` (the demo executor has no
    timeout at all) took each retried task back and timed it out again: 46 of 100 tasks
    deferred beside two honest ranks. Now it pauses as a rank whose answers are invalid."""
    tasks = 100
    job, db, _ = hostile_job(tmp_path, "timeouts", "", "--batch", "1", "--demo-work-ms", "50",
                             tasks=tasks)
    done = finish(job, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"rank 1 answered its last 2 dispatches with timeouts no run could have "
                     r"reached so soon \(1 run said to time out [0-9.e-]+ s after the WORK "
                     r"left: its executor has no timeout\)", done.stderr), done.stderr[-3000:]
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY 1") == [("done", tasks)]
    check_conservation(db, expected_tasks=tasks)
    [(failed,)] = query(db, "SELECT count(*) FROM events WHERE kind = 'task_failed'")
    assert 1 <= failed <= 8, failed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("batch", [["--batch", "1"], []], ids=["alone", "auto"])
def test_a_rank_sending_a_few_bad_results_per_work_defers_no_task(tmp_path, batch):
    """A rank that answered each WORK with 5 bad RESULTs of its token, then READY, stays far
    below the garbage watch's refusal, and, answering at once, took each retried task back
    from the head of the queue and failed it again: 71 of 200 tasks deferred beside two
    honest ranks (55 with automatic batches). Now such a rank pauses as a broken host does
    (1 s, doubling), so the honest ranks take the retries: none deferred, every task done
    once, and the operator told which rank to look at."""
    tasks = 200
    job, db, _ = hostile_job(tmp_path, "flood", "5", *batch, "--demo-work-ms", "20",
                             tasks=tasks)
    done = finish(job, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 answered its last 2 dispatches with invalid results (payload)" in \
        done.stderr, done.stderr[-3000:]
    check_conservation(db, expected_tasks=tasks)
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY 1") == [("done", tasks)]
    assert query(db, "SELECT count(*) FROM results WHERE rank = 1") == [(0,)]
    seen = status_json(db)
    assert (seen["deferred"], seen["refused_ranks"]) == (0, 0)
    # Its failures stay charged (R7), each once: the honest ranks ran them next.
    [(charged,)] = query(db, "SELECT count(*) FROM tasks WHERE attempts > 0")
    [(rolled,)] = query(db, "SELECT count(DISTINCT token) FROM events WHERE kind = 'invalid'")
    assert 1 <= rolled <= 12 and charged <= rolled, (rolled, charged)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("batch", [[], ["--batch", "32"]], ids=["auto", "fixed"])
def test_a_rank_asking_to_split_every_batch_shrinks_no_honest_ranks_batches(tmp_path, batch):
    """A rank answering every batch with `split` halves its own down to one task (then an
    invalid payload: it pauses), each split said to the master's sizing that a task's
    outcome was half a message or more: every rank's batches were capped with its own, the
    honest ranks' down to one task, climbing back over tens of dispatches (3,000 tasks of
    2 ms: 117 honest dispatches, 22 of fewer than 4 tasks where more were allowed; 167 and
    31 with --batch 32). Now one rank's splits size no other rank's batches (74 and 0; 109
    and 0): an honest rank runs a half of its batches whole, and its own as large as they
    were."""
    tasks = 3000
    job, db, _ = hostile_job(tmp_path, "split", "", *batch, "--demo-work-ms", "2",
                             tasks=tasks)
    done = finish(job, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=tasks)
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY 1") == [("done", tasks)]
    [(splits,)] = query(db, "SELECT count(*) FROM events WHERE kind = 'split' AND rank = 1")
    assert splits >= 4, splits  # (it asked while the honest ranks ran: a pause ended)
    # Each honest dispatch: its rank, its tasks, the cap of the half they came from (None:
    # no split's), in the order they committed.
    rows = query(db, "SELECT r.rank, count(*), min(t.batch_cap) FROM results r JOIN tasks t "
                     "ON t.id = r.task_id WHERE r.rank != 1 GROUP BY r.token "
                     "ORDER BY min(r.rowid)")
    firsts = {rank: i for i, (rank, _, _) in reversed(list(enumerate(rows)))}
    small = [(n, cap) for i, (rank, n, cap) in enumerate(rows[:-4])  # (the queue's end: fewer)
             if i != firsts[rank] and n < min(4, cap or 4)]  # (a rank's first: nothing measured)
    assert len(small) <= 2, (small, rows)


def test_a_rank_naming_a_pid_that_is_no_process_costs_the_honest_ranks_nothing(tmp_path):
    """A rank whose READY names this host and a pid no process has looks gone. When the stop
    signal came the master then wrote no `stop` event at all, so a job ended before its
    graceful stop finished (a scheduler's SIGKILL) had every honest rank's run charged an
    attempt at `--resume`. Now only that rank's run is."""
    from conftest import Farm

    from store.dispatches import GONE_AT_STOP
    probe = subprocess.Popen(["true"])  # (a pid just freed: no process has it)
    probe.wait()
    job, db, _ = hostile_job(tmp_path, "fakepid", str(probe.pid), "--batch", "1",
                             "--demo-work-ms", "60000", "--grace", "30", tasks=6)
    try:
        wait_for(db, "SELECT count(*) FROM dispatches WHERE sent_at IS NOT NULL",
                 lambda n: n == 3)
        master = master_pid(db)
        os.kill(master, signal.SIGTERM)
        wait_for(db, "SELECT count(*) FROM events WHERE kind = 'stop'", lambda n: n == 2)
        os.kill(master, signal.SIGKILL)  # the scheduler's, before the grace is over
    finally:
        kill_job(job)
    # Until the kernel has released the file's lock, not until the master looks gone: its
    # main thread can show as a zombie while its other threads still exit with the file open
    # (the resume below then failed with CampaignLockedError, once in 9 runs under load).
    deadline = time.monotonic() + 30
    while (running(master) or lock_holder(db) is not None) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert query(db, "SELECT rank, detail FROM events WHERE kind = 'stop' ORDER BY id") == [
        (None, "SIGTERM"), (1, GONE_AT_STOP)]
    held = dict(query(db, "SELECT rank, task_id FROM dispatches"))
    assert sorted(held) == [1, 2, 3]
    farm = Farm(db, resume=True)  # what --resume does with the runs left in flight
    try:
        with farm.store.reading() as conn:
            attempts = dict(conn.exec_driver_sql("SELECT id, attempts FROM tasks").all())
    finally:
        farm.close()
    assert {rank: attempts[task] for rank, task in held.items()} == {1: 1, 2: 0, 3: 0}


def test_a_burst_of_large_messages_costs_the_master_a_bounded_memory(tmp_path):
    """A rank that posted 40 messages just under --max-message-bytes at once, twice (stale
    RESULTs with a long status, READYs with a long host name), took the master to 928 MiB
    with the default 64 MiB bound: each drain of a round held up to twice the bound, the
    answers that joined the open round came on top, and a READY's host name was copied
    whole to be cut to 60 characters. A READY is small by nature: one over 4 KiB is
    consumed unheld, as oversized; what a round holds of the rest is one budget, and a
    message that does not fit in what is left of it waits, unreceived, for the next round."""
    bound = 16 * MiB
    (tmp_path / "calm").mkdir()  # the master's own size: the same job, with no burst
    honest, _, calm = hostile_job(tmp_path / "calm", "honest", "",
                                  "--max-message-bytes", str(bound))
    assert finish(honest, timeout=180).returncode == ExitStatus.OK
    job, db, summary = hostile_job(tmp_path, "burst", f"40:{bound - 4096}:2",
                                   "--max-message-bytes", str(bound), stop_wait="60")
    done = finish(job, timeout=240)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    check_conservation(db, expected_tasks=60)
    q = quarantined(db)
    assert q.get(("ready", "oversized"), (0, 0))[1] == 40, q
    assert sum(m for (c, _), (_, m) in q.items() if c == "result") == 40, q
    # A round holds its budget (the bound) at most, and a little besides (the buffer an
    # oversized READY is consumed into): 176 MiB more than the same job without the burst,
    # before; 33 MiB (twice the bound) when a round also held the message that crossed its
    # budget; 17 MiB since.
    grown = peak_rss_mib(summary) - peak_rss_mib(calm)
    assert grown < 1.5 * bound / MiB, (peak_rss_mib(calm), peak_rss_mib(summary))


@pytest.mark.timeout(180)
def test_a_rank_answering_its_stop_with_garbage_cannot_stretch_the_stop_wait(tmp_path):
    """A rank that never acknowledged its STOP and kept sending garbage stretched a 5 s
    --stop-wait to 9-16 s: each round of garbage the master quarantined moved the deadline on
    by the time it took. Only a wait for another process's write lock moves it now."""
    job, db, summary = hostile_job(tmp_path, "deaf", "", stop_wait="5")
    done = finish(job, timeout=150)
    assert done.returncode == ExitStatus.UNACKED, done.stderr[-3000:]
    assert "ranks [1] did not acknowledge STOP" in done.stderr, done.stderr[-3000:]
    check_conservation(db, expected_tasks=60)
    seen = json.loads(summary.read_text())
    waited = summary.stat().st_mtime - seen["last_commit_at"]
    # (what follows the wait before the summary is written: 0.1 s here; 9.4 s in all before)
    assert waited < 5 + 2.5, waited
