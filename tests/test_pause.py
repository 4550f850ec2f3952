"""A job paused and continued (Slurm's `scontrol suspend`: SIGSTOP to every process of the
job, SIGCONT at its resume; a paused VM; a master held by a debugger): the time it was stopped
is no evidence against any rank, so nothing is charged and the campaign carries on. A worker
stopped alone is still a hung worker, retired at its deadline (coordinator/pauses.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mpi_jobs import (
    check_conservation,
    children_of,
    finish,
    kill_job,
    master_pid,
    query,
    ranks_of,
    start,
    status_json,
    wait_for,
)
from processes import in_session

from coordinator.pauses import LoopGaps


def test_loop_gaps_count_only_time_the_process_neither_waited_nor_ran():
    now, cpu = [0.0], [0.0]
    gaps = LoopGaps(gap_s=1.0, clock=lambda: now[0], cpu_clock=lambda: cpu[0])
    now[0] = 0.5
    assert gaps.tick() == 0.0                  # a round, not a pause
    now[0] = 1.0
    assert gaps.tick(waited_s=0.25) == 0.0
    now[0] = 8.0
    assert gaps.tick(waited_s=0.25) == 6.75    # stopped: what it did not ask to wait
    now[0], cpu[0] = 10.0, 0.5
    assert gaps.tick() == 1.5                  # stopped, less the half second it ran
    now[0], cpu[0] = 13.0, 3.3
    assert gaps.tick() == 0.0                  # a long round of work is no pause
    assert gaps.take() == 8.25 and gaps.take() == 0.0
    assert gaps.total_s == 8.25


#: Waits, as the worker's command executor does, for a command of `sleep 1` under a 1.5 s
#: timeout, and says how it ended.
WAITER = textwrap.dedent("""\
    import subprocess
    from coordinator.processes import wait_exit_unreaped
    child = subprocess.Popen(["sleep", "1"])
    print(child.pid, flush=True)
    print("exited" if wait_exit_unreaped(child, 1.5) else "timed out", flush=True)
    child.wait()
    """)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stopped", ["worker and command", "command alone"])
def test_a_command_times_out_only_for_time_the_worker_ran(stopped):
    """The worker and its command stopped together for longer than --timeout: on SIGCONT the
    command gets the rest of its time (the worker continued first: the worst order), where it
    used to be killed as timed out the moment the worker ran again. A command stopped alone
    (a hung target) still times out."""
    waiter = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child = int(waiter.stdout.readline())
        time.sleep(0.2)
        pids = [waiter.pid, child] if stopped == "worker and command" else [child]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(2.5)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.3)
        said = waiter.stdout.readline().strip()
        assert waiter.wait(timeout=10) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(waiter.pid, signal.SIGKILL)
    assert said == ("exited" if stopped == "worker and command" else "timed out")


def _tasks(tmp_path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        (tmp_path / f"in{i}").write_bytes(b"%d" % i)
        lines.append(f'{{"path": "{tmp_path / f"in{i}"}"}}')
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "t.jsonl"


def _job_processes(proc, db: Path) -> list[int]:
    """Every process of the job, as a batch system's suspend reaches them: the launcher's
    session, the ranks, and the workers' commands (in sessions of their own)."""
    ranks = ranks_of(db)
    return list(dict.fromkeys([proc.pid, *in_session(proc.pid), *ranks, *children_of(ranks)]))


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stopped", ["the whole job", "the master alone", "one worker alone"])
def test_a_paused_job_charges_nothing_but_a_worker_stopped_alone_is_hung(tmp_path, stopped):
    """Stopped for 4 s, twice the --watchdog and more than the --timeout, with each worker in
    the middle of a 1 s run. The whole job, or the master alone (the workers finish and
    answer meanwhile): the answers are taken, no attempt charged, nothing retired or
    quarantined; before, each dispatch out was retired by the watchdog (charged, its answer
    quarantined as stale) and, with the workers stopped too, each command killed as timed
    out. A worker stopped alone is hung as far as anyone can tell: the watchdog retires it."""
    db = tmp_path / "c.db"
    proc = start(["run", "--db", str(db), "--tasks", str(_tasks(tmp_path, 6)),
                  "--watchdog", "2", "--timeout", "1.5", "--no-progress", "--", "sleep", "1"],
                 np=3)
    try:
        master = master_pid(db)
        wait_for(db, "SELECT count(*) FROM dispatches", lambda n: n == 2)
        time.sleep(0.3)  # (the WORKs left, the commands run)
        if stopped == "the whole job":
            pids = _job_processes(proc, db)
        elif stopped == "the master alone":
            pids = [master]
        else:
            worker = min(p for p in ranks_of(db) if p != master)
            pids = [worker, *children_of([worker])]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        time.sleep(4)
        for pid in pids:  # the master first: it sees every deadline passed at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        done = finish(proc, timeout=120)
    finally:
        kill_job(proc, signal.SIGCONT)
        kill_job(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=6)
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY 1") == [("done", 6)]
    assert query(db, "SELECT status, count(*) FROM results GROUP BY 1") == [("ok", 6)]
    charged = query(db, "SELECT sum(attempts) FROM tasks")[0][0]
    watchdog = query(db, "SELECT count(*) FROM events WHERE kind = 'watchdog'")[0][0]
    if stopped == "one worker alone":
        assert watchdog == 1 and charged == 1, done.stderr[-3000:]
        assert "passed its --watchdog deadline" in done.stderr
        return
    assert (watchdog, charged) == (0, 0), done.stderr[-3000:]
    assert query(db, "SELECT kind, count(*) FROM events WHERE kind NOT IN "
                     "('campaign', 'enqueued', 'dispatched') GROUP BY 1") == []
    assert query(db, "SELECT count(*) FROM quarantine") == [(0,)]
    s = status_json(db)
    assert (s["deferred"], s["quarantined"], s["parked_ranks"]) == (0, 0, 0)
    assert "the master did not run for" in done.stderr
