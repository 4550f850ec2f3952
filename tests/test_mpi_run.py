"""The main job end to end under real mpiexec (issue: MPI master and worker loops).

Every test is bounded twice: the job itself (mpi_jobs.finish kills it past its timeout and
fails the test) and pytest-timeout on the test.
"""

from __future__ import annotations

import contextlib
import hashlib
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
    check_conservation,
    children_of,
    finish,
    kill_job,
    kill_ranks,
    master_pid,
    mpi_kind,
    output_files,
    quarantined,
    query,
    ranks_of,
    run,
    split_job_command,
    start,
    status_json,
    wait_for,
)
from processes import running

from coordinator.exits import ExitStatus
from coordinator.launcher import mpiexec_flags
from coordinator.output import INDEX_NAME
from store.audit import audit_path

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def queue_files(queue: Path) -> list[Path]:
    """The files of our AFL queue: the writer's index of their digests is beside it, in the
    instance directory (`afl-fuzz -i` and afl-cmin read a queue's dot files too)."""
    files = list(queue.iterdir())
    assert INDEX_NAME not in {p.name for p in files} and (queue.parent / INDEX_NAME).is_file()
    return files


def test_demo_300_completes_and_status_agrees(tmp_path):
    db = tmp_path / "demo.db"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = run(["run", "--db", str(db), "--demo", "300", "--no-progress"],
               env={"TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr
    assert "300 done" in done.stdout
    # every worker removed its scratch directory, also on the os._exit path under ULFM
    assert sorted(p.name for p in scratch.glob("coordinator-rank*")) == []
    check_conservation(db, expected_tasks=300)
    s = status_json(db)
    assert s["tasks"] == {"queued": 0, "active": 0, "done": 300, "deferred": 0, "failed": 0}
    assert s["results"] == 300 == query(db, "SELECT count(*) FROM results")[0][0]
    assert s["quarantine"] == quarantined()
    assert query(db, "SELECT count(*) FROM quarantine") == [(0,)]
    assert (s["requeued"], s["deferred"], s["incarnation"]) == (0, 0, 1)
    stats = (tmp_path / "demo.db.stats").read_text()
    assert "Quarantined worker results: 0\n" in stats
    # demo results are the executor's deterministic values
    values = query(db, "SELECT t.payload, r.value FROM results r JOIN tasks t ON t.id=r.task_id "
                       "WHERE t.payload = '{\"data\":{\"n\":27}}'")
    assert json.loads(values[0][1])["collatz_steps"] == 111  # 27 takes 111 steps


def test_a_second_start_on_a_running_campaign_changes_nothing(tmp_path):
    """Refused by the campaign's lock (exit 2) and touching nothing of the running master's:
    its output directory's temp files are writes in progress, not leftovers to clean up."""
    db = tmp_path / "c.db"
    # Far more work than the test waits for (it ends the job): the first master must still
    # run when the second one, launched on cores the first one keeps busy, gets to the lock.
    args = ["run", "--db", str(db), "--demo", "20000", "--demo-work-ms", "5", "--no-progress"]
    first = start(args)
    try:
        wait_for(db, "SELECT count(*) FROM results", lambda n: bool(n))
        out_dir = tmp_path / "c.db.out"
        out_dir.mkdir(exist_ok=True)
        live = out_dir / ".tcw-tmp-in-progress"
        live.write_bytes(b"half a test case")
        assert first.poll() is None
        second = run(args[:1] + ["--resume"] + args[1:], timeout=120)
        assert second.returncode == ExitStatus.USAGE, second.stderr[-2000:]
        assert "is in use by a running master (pid" in second.stderr
        assert live.read_bytes() == b"half a test case"
        assert first.poll() is None  # the first master runs on
    finally:
        kill_job(first)
        first.communicate()


def test_existing_campaign_without_resume_exits_2_naming_resume(tmp_path):
    db = tmp_path / "c.db"
    assert run(["run", "--db", str(db), "--demo", "5", "--no-progress"]).returncode == 0
    again = run(["run", "--db", str(db), "--demo", "5", "--no-progress"])
    assert again.returncode == ExitStatus.USAGE
    assert "--resume" in again.stderr
    assert query(db, "SELECT count(*) FROM results") == [(5,)]  # nothing touched


def test_refused_starts_end_every_rank_with_a_clear_message(tmp_path):
    """Refusals found on rank 0 after the launch reach the workers too (they wait in the
    start-up broadcast): the job ends with exit 2 and one line saying why."""
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database\n" * 8)
    bad = run(["run", "--db", str(junk), "--demo", "3", "--no-progress"], timeout=120)
    assert bad.returncode == ExitStatus.USAGE
    assert "is not an SQLite database" in bad.stderr and "Traceback" not in bad.stderr
    assert junk.read_bytes() == b"not a database\n" * 8
    # a payload the store would refuse is named by its line, before any database exists
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"data": 1}\n{"path": "x", "focus_bytes": "abc"}\n')
    db = tmp_path / "c.db"
    bad = run(["run", "--db", str(db), "--tasks", str(tasks), "--no-progress"], timeout=120)
    assert bad.returncode == ExitStatus.USAGE
    assert f"{tasks}:2: focus_bytes must be a list of integers" in bad.stderr
    assert not db.exists()
    # an output that cannot be used is refused before the database is touched
    afile = tmp_path / "afile"
    afile.write_text("x")
    bad = run(["run", "--db", str(tmp_path / "o.db"), "--demo", "3", "--out", str(afile),
               "--no-progress"], timeout=120)
    assert bad.returncode == ExitStatus.USAGE
    assert "is not a directory" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "o.db").exists()
    # --resume with nothing to resume says that it starts a new campaign
    fresh = run(["run", "--db", str(db), "--demo", "3", "--resume", "--no-progress"])
    assert fresh.returncode == 0, fresh.stderr
    assert "held no campaign yet; this starts a new one" in fresh.stderr


TARGET = textwrap.dedent("""\
    import os, sys, time
    # A target must be stoppable: SIGINT (bit 2) and SIGTERM (bit 15) must not reach it
    # ignored (an ignored signal stays ignored across exec). Refusing the run makes every
    # result an error, which the checks below would see.
    ignored = [int(l.split()[1], 16) for l in open("/proc/self/status") if l.startswith("SigIgn")]
    if ignored and ignored[0] & ((1 << 1) | (1 << 14)):
        sys.exit(f"target: SIGINT or SIGTERM is ignored (SigIgn {ignored[0]:x})")
    data = open(sys.argv[1], "rb").read()
    if data.startswith(b"HANG"):
        time.sleep(600)
    if data.startswith(b"FAIL"):
        sys.exit("target: this input is refused")
    out = os.environ["SYMCC_OUTPUT_DIR"]
    # two new test cases per input, as SymCC writes them: derived from the input
    for i in range(2):
        with open(os.path.join(out, f"{i:06d}"), "wb") as f:
            f.write(data + b"-" + str(i).encode())
    """)


def write_target(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(TARGET)
    return target


def test_command_executor_results_feed_back_and_a_hang_is_retried(tmp_path):
    target = write_target(tmp_path)
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    lines = []
    for name, content in [("a", b"A"), ("b", b"B"), ("hang", b"HANG"), ("fail", b"FAIL")]:
        (seeds / name).write_bytes(content)
        lines.append(f'{{"path": "{seeds / name}", "input_file": "{seeds / name}"}}')
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    db, out = tmp_path / "c.db", tmp_path / "out"
    done = run(["run", "--db", str(db), "--tasks", str(tasks), "--out", str(out),
                "--max-depth", "1", "--timeout", "3", "--retries", "1", "--no-progress",
                "--", sys.executable, str(target), "@@"])
    assert done.returncode == 0, done.stderr
    check_conservation(db)
    # a, b: done, each giving 2 test cases that became depth-1 tasks, which also ran (depth
    # limit 1: their own outputs were written but not enqueued)
    files = {p.read_bytes() for p in out.iterdir()}
    assert {b"A-0", b"A-1", b"B-0", b"B-1", b"A-0-0", b"B-1-1"} <= files
    depth = dict(query(db, "SELECT depth, count(*) FROM tasks WHERE state='done' GROUP BY depth"))
    assert depth == {0: 3, 1: 4}
    # the failing input ran to its end: a committed result, status error, with the reason
    [(status, detail)] = query(db, "SELECT r.status, r.detail FROM results r JOIN tasks t "
                                   "ON t.id = r.task_id WHERE t.payload LIKE '%fail%'")
    assert status == "error"
    assert "exited with status 1" in detail and "this input is refused" in detail
    assert query(db, "SELECT count(*) FROM results WHERE status = 'ok' AND detail IS NOT NULL"
                 ) == [(0,)]
    assert status_json(db)["results_by_status"] == {"ok": 6, "error": 1}
    shown = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db", str(db)],
                           capture_output=True, text=True, timeout=60, check=True)
    assert "(error=1, ok=6)" in shown.stdout
    assert "this input is refused" in shown.stdout
    assert "  deferred, most common reasons: 1 × timeout\n" in shown.stdout, shown.stdout
    assert "1 error: see `coordinator status`" in done.stdout
    # the hanging input was killed at 3 s each time: requeued once, then deferred
    [(state, attempts)] = query(db, "SELECT state, attempts FROM tasks "
                                    "WHERE payload LIKE '%hang%'")
    assert (state, attempts) == ("deferred", 2)
    kinds = dict(query(db, "SELECT kind, count(*) FROM events GROUP BY kind"))
    assert kinds["task_failed"] == 2 and kinds["retried"] == 1 and kinds["task_deferred"] == 1
    assert "requeued" not in kinds  # a timeout is not a protocol failure
    # once the cause is fixed, the operator runs exactly the failed run again
    again = subprocess.run([sys.executable, "-m", "coordinator", "requeue", "--db", str(db),
                            "--state", "error"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0, again.stderr
    [(fail_id,)] = query(db, "SELECT id FROM tasks WHERE payload LIKE '%fail%'")
    assert again.stdout.strip() == f"requeued 1 task(s): {fail_id}"
    assert status_json(db)["tasks"]["queued"] == 1
    assert status_json(db)["results_by_status"] == {"ok": 6}


def _shell_target_and_seeds(tmp_path: Path, script: str, n: int) -> tuple[Path, Path]:
    """A shell-script target running `script`, and a tasks file of `n` seed files by path."""
    prog = tmp_path / "target"
    prog.write_text(f"#!/bin/sh\n{script}\n")
    prog.chmod(0o755)
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    for i in range(n):
        (seeds / f"s{i}").write_bytes(b"%d" % i)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"path": "{seeds / f"s{i}"}"}}\n' for i in range(n)))
    return prog, tasks


def test_a_program_its_hosts_cannot_start_defers_its_tasks_and_resume_runs_them(tmp_path):
    """A target that can no longer be started (its exec bit lost, as a rebuild in place can
    leave it) is the hosts' failure, not the tasks': no task is committed as an error; each
    goes to the retry policy (deferred at once with --retries 0), and once the program is back,
    `--resume` runs each exactly once."""
    prog, tasks = _shell_target_and_seeds(
        tmp_path, '[ -e "$0.once" ] || { touch "$0.once"; chmod a-x "$0"; }', 5)
    db = tmp_path / "c.db"
    args = ["run", "--db", str(db), "--tasks", str(tasks), "--retries", "0", "--no-feedback",
            "--no-progress"]
    done = run([*args, "--", str(prog), "@@"], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=5)
    by_state = dict(query(db, "SELECT state, count(*) FROM tasks GROUP BY state"))
    assert by_state.get("done", 0) >= 1 and by_state["deferred"] == 5 - by_state["done"]
    assert query(db, "SELECT count(*) FROM results WHERE status != 'ok'") == [(0,)]
    reasons = [r for (r,) in query(db, "SELECT DISTINCT reason FROM tasks WHERE "
                                       "state = 'deferred'")]
    assert reasons and all(re.fullmatch(r"not_run on rank \d: cannot start '.*target': "
                                        r"Permission denied", r) for r in reasons), reasons
    prog.chmod(0o755)
    again = run([*args, "--resume", "--", str(prog), "@@"], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    check_conservation(db, expected_tasks=5)
    assert query(db, "SELECT status, count(*) FROM results GROUP BY status") == [("ok", 5)]


@pytest.fixture
def full_fs(tmp_path):
    """A tmpfs with room for its root and one directory (`nr_inodes=2`): Python still takes
    it as $TMPDIR (its probe file comes and goes before), a worker makes its scratch directory
    there, and then no task's directory can be made: a node whose disk is full."""
    where = tmp_path / "full"
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=2", "tmpfs",
                           str(where)], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_one_node_whose_disk_is_full_defers_nothing_the_others_can_run(tmp_path, full_fs):
    """One rank's $TMPDIR on a full disk (MPMD: `env TMPDIR=...` for rank 1 only): it answers
    `not_run` at once, while the two healthy ranks run 1 s tasks. Its first failure is charged
    (one failure does not tell the host from the task); after that the master lets it cool
    down and charges its failures nothing, so the healthy ranks run every task and nothing is
    deferred. Before, it took the retried task from the head again within its 0.25 s pause
    and the second failure deferred it, one healthy task after another."""
    prog, tasks = _shell_target_and_seeds(tmp_path, "sleep 1", 8)
    db = tmp_path / "c.db"
    rank = [sys.executable, "-m", "coordinator", "run", "--db", str(db), "--tasks", str(tasks),
            "--retries", "1", "--no-feedback", "--no-progress", "--", str(prog), "@@"]
    flags = [f for f in mpiexec_flags(MPIEXEC, 1, ulfm=mpi_kind() == "openmpi")
             if f not in ("-n", "1")]
    command = [MPIEXEC, *flags, "-n", "1", *rank, ":", "-n", "1", "env",
               f"TMPDIR={full_fs}", *rank, ":", "-n", "2", *rank]
    done = finish(start([], command=command), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=8)
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY state") == [("done", 8)]
    assert query(db, "SELECT count(*) FROM results WHERE rank = 1 OR status != 'ok'") == [(0,)]
    failed = [r for (r,) in query(db, "SELECT detail FROM events WHERE kind = 'task_failed' "
                                      "ORDER BY id")]
    assert failed and all(r.startswith("not_run on rank 1: cannot make the task's directory")
                          for r in failed), failed
    # charged once: the first failure of its streak; the retries after it charged nothing
    assert query(db, "SELECT sum(budget_used), sum(attempts) FROM tasks") == [(1, 0)]
    # (the operator is told: no deferred task shows the broken host)
    said = re.findall(r"rank 1's host could not run its last 2 dispatches \(cannot make "
                      r"the task's directory: .*\); its tasks go back to the other ranks, "
                      r"not charged, and it gets work again after a pause", done.stderr)
    assert len(said) == 1, done.stderr[-3000:]
    # and `status` shows it, from the row its failures wrote (its disk stayed full)
    shown = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db", str(db),
                            "--json"], capture_output=True, text=True, timeout=60)
    unrun = {r["rank"]: r["unrun"] for r in json.loads(shown.stdout)["ranks"]}
    assert unrun[2] is None and unrun[3] is None, unrun
    assert unrun[1]["dispatches"] >= 2 and unrun[1]["detail"].startswith(
        "cannot make the task's directory"), unrun


def test_test_cases_fed_back_after_their_directory_was_emptied_all_run(tmp_path):
    """A fed-back test case is a task by its path. After the coordinator's AFL directory was
    emptied (its files moved away), names started over from id:000000, and new content under
    the name of an earlier task was taken for that task: never run, nothing said (a review:
    4 of 4 lost)."""
    target = write_target(tmp_path)
    queue = tmp_path / "afl" / "main" / "queue"
    queue.mkdir(parents=True)
    db, ours = tmp_path / "c.db", tmp_path / "afl" / "symcc" / "queue"
    args = ["--afl-out", str(tmp_path / "afl"), "--fuzzer", "main", "--max-depth", "2", "--",
            sys.executable, str(target), "@@"]
    count = ("SELECT count(*) FROM tasks t JOIN blobs b ON b.hash = t.input_hash "
             "WHERE t.state = 'done' AND substr(b.data, 1, 1) = CAST(? AS BLOB)")
    for n, seed in enumerate("AC"):
        entry = queue / f"id:{n:06d},orig:{seed}"
        entry.write_bytes(seed.encode())
        os.utime(entry, (time.time() - 60,) * 2)
        # One worker: tasks run in queue order, so the names each run gives are known.
        proc = self_launch(db, *(["--resume"] if n else []), *args, np=2)
        try:
            # Each seed: itself, its 2 test cases, their 4 (depth 2): all run.
            wait_for(db, count.replace("?", f"'{seed}'"), lambda v: v == 7, timeout=120)
            out, err = ctrl_c(proc, timeout=120)
        finally:
            end_launch(proc, db)
        assert proc.returncode == 0, err[-3000:]
        if n == 0:
            (tmp_path / "saved").mkdir()
            for f in ours.iterdir():
                f.rename(tmp_path / "saved" / f.name)
    check_conservation(db, expected_tasks=14)


def test_a_resume_keeps_the_campaigns_feedback_and_timeout_on_every_rank(tmp_path, monkeypatch):
    """A job script's bare `--resume` dropped `--no-feedback` and `--timeout`: the master now
    keeps the campaign's, and tells its workers the timeout (each rank parses its own command
    line, where it is not given)."""
    monkeypatch.delenv("SYMCC_TIMEOUT", raising=False)
    # Two test cases per input; the input "SLOW" first runs 6 s: past the campaign's 2 s, well
    # within the default 30 s (a worker that ran with the default would commit it).
    target = tmp_path / "target.py"
    target.write_text(textwrap.dedent("""\
        import os, sys, time
        data = open(sys.argv[1], "rb").read()
        if data == b"SLOW":
            time.sleep(6)
        for i in range(2):
            with open(os.path.join(os.environ["SYMCC_OUTPUT_DIR"], str(i)), "wb") as f:
                f.write(data + str(i).encode())
        """))
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    tasks = tmp_path / "tasks.jsonl"
    db, out = tmp_path / "c.db", tmp_path / "out"
    args = ["run", "--db", str(db), "--tasks", str(tasks), "--out", str(out), "--retries", "0",
            "--no-progress"]
    command = ["--", sys.executable, str(target), "@@"]
    for name in ("a", "slow"):
        (seeds / name).write_bytes(name.upper().encode())
        with tasks.open("a") as f:
            f.write(f'{{"path": "{seeds / name}", "input_file": "{seeds / name}"}}\n')
        done = run([*args, "--no-feedback", "--timeout", "2", *command] if name == "a" else
                   [*args, "--resume", *command], timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
    assert ("--resume keeps the campaign's --no-feedback --timeout 2, as its last run had "
            "them") in done.stderr
    check_conservation(db, expected_tasks=2)  # no test case fed back
    # Killed at the campaign's 2 s on its worker: deferred (--retries 0), not committed.
    assert query(db, "SELECT state, reason FROM tasks ORDER BY id") == [
        ("done", None), ("deferred", "timeout")]


SLOW_TARGET = textwrap.dedent("""\
    import os, sys, time
    data = open(sys.argv[1], "rb").read()
    with open(os.path.join(os.environ["SYMCC_OUTPUT_DIR"], "000000"), "wb") as f:
        f.write(data + b"-found-before-the-timeout")
    time.sleep(600)  # killed at the timeout
    """)


def test_a_timed_out_run_is_retried_and_its_test_cases_are_kept(tmp_path):
    """SymCC writes each new input as it finds it; a run killed at the timeout used to lose
    them (and every retry found them again, and lost them again)."""
    target = tmp_path / "slow.py"
    target.write_text(SLOW_TARGET)
    seed = tmp_path / "seed"
    seed.write_bytes(b"SLOW")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(f'{{"path": "{seed}", "input_file": "{seed}"}}\n')
    db, out = tmp_path / "c.db", tmp_path / "out"
    done = run(["run", "--db", str(db), "--tasks", str(tasks), "--out", str(out),
                "--timeout", "1", "--retries", "1", "--max-attempts", "2", "--no-feedback",
                "--no-progress", "--", sys.executable, str(target), "@@"], timeout=120)
    assert done.returncode == 0, done.stderr
    check_conservation(db, expected_tasks=1)
    assert [p.read_bytes() for p in output_files(out)] == [b"SLOW-found-before-the-timeout"]
    assert query(db, "SELECT count(*) FROM results") == [(0,)]
    assert query(db, "SELECT state, attempts FROM tasks") == [("failed", 2)]
    details = [d for (d,) in query(db, "SELECT detail FROM events WHERE kind = 'task_failed' "
                                        "ORDER BY id")]
    assert len(details) == 2, details
    assert details[0].startswith("timeout (1 test case kept)")
    assert "kept" not in details[1]  # the retry found the same one: nothing new to keep
    _status_counts_the_kept_test_case(db)


def _status_counts_the_kept_test_case(db: Path) -> None:
    """The one file in the output directory, written by a run that was retried, is counted
    with the results' own (it was not: "test cases: 0")."""
    assert query(db, "SELECT testcases FROM salvaged") == [(1,)]
    shown = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db", str(db),
                            "--json"], capture_output=True, text=True, timeout=60)
    found = json.loads(shown.stdout)["testcases"]
    assert (found["written"], found["retried_runs"]) == (1, 1), found
    assert found["last_at"] == query(db, "SELECT at FROM salvaged")[0][0]


BATCH_SLOW_TARGET = textwrap.dedent("""\
    import os, sys, time
    data = open(sys.argv[1], "rb").read()
    if data == b"FAST":
        sys.exit(0)
    with open(os.path.join(os.environ["SYMCC_OUTPUT_DIR"], "000000"), "wb") as f:
        f.write(data + b"-found-before-the-timeout")
    time.sleep(600)  # killed at the timeout
    """)


def test_a_timed_out_run_in_a_batch_keeps_its_test_cases(tmp_path):
    """As on its own: in a batch, the test cases a run wrote before its timeout were thrown
    away (only the single-task path kept them)."""
    target = tmp_path / "slow.py"
    target.write_text(BATCH_SLOW_TARGET)
    lines = []
    for name, data in (("fast", b"FAST"), ("slow", b"SLOW")):
        seed = tmp_path / name
        seed.write_bytes(data)
        lines.append(json.dumps({"path": str(seed), "input_file": str(seed)}))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    db, out = tmp_path / "c.db", tmp_path / "out"
    done = run(["run", "--db", str(db), "--tasks", str(tasks), "--out", str(out),
                "--batch", "2", "--timeout", "1", "--retries", "0", "--max-attempts", "1",
                "--no-feedback", "--no-progress", "--", sys.executable, str(target), "@@"],
               np=2, timeout=120)
    assert done.returncode == 0, done.stderr
    check_conservation(db, expected_tasks=2)
    assert [p.read_bytes() for p in output_files(out)] == [b"SLOW-found-before-the-timeout"]
    assert query(db, "SELECT count(*) FROM results") == [(1,)]
    assert query(db, "SELECT detail FROM events WHERE kind = 'task_failed'") == [
        ("timeout (1 test case kept)",)]
    _status_counts_the_kept_test_case(db)


def test_afl_queue_filled_while_running(tmp_path):
    target = write_target(tmp_path)
    afl = tmp_path / "afl_out"
    queue = afl / "main" / "queue"
    queue.mkdir(parents=True)
    db = tmp_path / "c.db"
    proc = start(["run", "--db", str(db), "--afl-out", str(afl), "--fuzzer", "main",
                  "--max-depth", "1", "--no-progress", "--", sys.executable, str(target), "@@"])
    try:
        pid = master_pid(db)
        (queue / ".state").mkdir()
        (queue / ".cur_input").write_bytes(b"ignored")
        for i, content in enumerate([b"one", b"two", b"three"]):
            (queue / f"id:{i:06d},time:0,execs:0,orig:seed").write_bytes(content)
            time.sleep(0.3)
        wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 9, timeout=60)
        os.kill(pid, signal.SIGTERM)
        done = finish(proc)
    finally:
        kill_job(proc)
    assert done.returncode == 0, done.stderr
    ours = afl / "symcc" / "queue"
    names = sorted(p.name for p in queue_files(ours))
    assert names and all(n.startswith("id:") and ",src:" in n for n in names)
    assert {p.read_bytes() for p in queue_files(ours)} >= {b"one-0", b"two-1", b"three-0"}
    assert not any(p.name.startswith(".") for p in queue_files(ours))  # no temp file left
    assert query(db, "SELECT count(*) FROM tasks WHERE payload LIKE '%cur_input%'") == [(0,)]
    check_conservation(db)


RECORD_TARGET = textwrap.dedent("""\
    import sys
    data = open(sys.argv[2], "rb").read()
    with open(sys.argv[1], "a") as log:
        log.write(data.hex() + "\\n")
    """)


def test_an_afl_entry_whose_writer_pauses_is_run_whole(tmp_path):
    """AFL++ writes a queue entry with open(O_CREAT|O_EXCL), write, close. A writer that
    paused 3 s between two writes had the first half taken for good: run, and stored with
    that half's hash; the rest was never read. The entry is taken once its writer closed it."""
    from conftest import leases_granted
    if not leases_granted(tmp_path):
        pytest.skip("no read lease is granted here: a writer pausing 3 s defeats two polls")
    target, log = tmp_path / "record.py", tmp_path / "ran.log"
    target.write_text(RECORD_TARGET)
    afl = tmp_path / "afl_out"
    queue = afl / "main" / "queue"
    queue.mkdir(parents=True)
    db = tmp_path / "c.db"
    proc = start(["run", "--db", str(db), "--afl-out", str(afl), "--fuzzer", "main",
                  "--no-feedback", "--no-progress", "--", sys.executable, str(target),
                  str(log), "@@"], np=2)
    try:
        pid = master_pid(db)
        fd = os.open(queue / "id:000000,orig:paused", os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                     0o600)
        try:
            os.write(fd, b"first half, ")
            time.sleep(3)  # past the settle time and two polls of the queue
            os.write(fd, b"second half")
        finally:
            os.close(fd)
        (queue / "id:000001,orig:after").write_bytes(b"after")
        wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 2, timeout=60)
        os.kill(pid, signal.SIGTERM)
        done = finish(proc)
    finally:
        kill_job(proc)
    assert done.returncode == 0, done.stderr
    ran = sorted(bytes.fromhex(line) for line in log.read_text().split())
    assert ran == [b"after", b"first half, second half"]
    assert query(db, "SELECT input_hash FROM tasks WHERE origin LIKE '%paused'") == [
        (hashlib.sha256(b"first half, second half").hexdigest(),)]
    check_conservation(db)


def test_a_tasks_file_appended_to_while_the_run_goes_is_said_at_its_end(tmp_path):
    """A tasks file is read at the start only. A line a generator appended while the run
    went was in no task, and the run ended as drained without a word (exit 0): the end now
    says the file changed and that --resume --tasks adds its new tasks, which it does."""
    target, log = tmp_path / "record.py", tmp_path / "ran.log"
    target.write_text(RECORD_TARGET + "import time; time.sleep(1)\n")
    tasks = tmp_path / "tasks.jsonl"
    inputs = []
    for i in range(4):
        inputs.append(tmp_path / f"in{i}")
        inputs[-1].write_bytes(f"in{i}".encode())
    tasks.write_text("".join(json.dumps({"path": str(p)}) + "\n" for p in inputs[:3]))
    db = tmp_path / "c.db"
    command = ["--no-feedback", "--no-progress", "--", sys.executable, str(target), str(log),
               "@@"]
    proc = start(["run", "--db", str(db), "--tasks", str(tasks), *command], np=2)
    try:
        # (Once a result is in, the import is done: a file changed during it is refused.)
        wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 1, timeout=60)
        with tasks.open("a") as f:
            f.write(json.dumps({"path": str(inputs[3])}) + "\n")
        done = finish(proc)
    finally:
        kill_job(proc)
    assert done.returncode == 0, done.stderr
    assert query(db, "SELECT count(*) FROM results") == [(3,)]
    assert (f"tasks file {tasks} changed since this start read it: lines added to it are in "
            f"no task of this run; `--resume --tasks {tasks}` adds them") in done.stderr
    done = run(["run", "--db", str(db), "--resume", "--tasks", str(tasks), *command], np=2)
    assert done.returncode == 0, done.stderr
    assert "changed since this start read it" not in done.stderr
    assert sorted(bytes.fromhex(line) for line in log.read_text().split()) == [
        b"in0", b"in1", b"in2", b"in3"]
    check_conservation(db)


ECHO_TARGET = textwrap.dedent("""\
    import os, sys
    data = open(sys.argv[1], "rb").read()
    out = os.environ["SYMCC_OUTPUT_DIR"]
    # SymCC often writes its own input back unchanged, beside the new ones
    for name, content in (("000000", data), ("000001", data + b"-x")):
        with open(os.path.join(out, name), "wb") as f:
            f.write(content)
    """)


def test_afl_sync_counter_no_feedback_and_inputs_not_written_back(tmp_path):
    """AFL's main already imported 455 files from a coordinator directory that was emptied
    since: ids from 0 again would never be imported (its sync waits for id:000455). With
    --no-feedback only AFL's entries run; a test case equal to an input is not written back
    (AFL has it); `src:` is the AFL id of the input, as SymCC's helper writes it."""
    target = tmp_path / "echo.py"
    target.write_text(ECHO_TARGET)
    afl = tmp_path / "afl_out"
    queue = afl / "main" / "queue"
    queue.mkdir(parents=True)
    (afl / "main" / ".synced").mkdir()
    (afl / "main" / ".synced" / "symcc").write_bytes((455).to_bytes(4, sys.byteorder))
    for i, content in enumerate([b"one", b"two", b"three"]):
        (queue / f"id:{i:06d},time:0,execs:0,orig:seed{i}").write_bytes(content)
    db = tmp_path / "c.db"
    proc = start(["run", "--db", str(db), "--afl-out", str(afl), "--fuzzer", "main",
                  "--no-feedback", "--no-progress", "--", sys.executable, str(target), "@@"])
    try:
        pid = master_pid(db)
        wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 3, timeout=60)
        time.sleep(1)  # a feedback task, if one were queued, would run now
        os.kill(pid, signal.SIGTERM)
        done = finish(proc)
    finally:
        kill_job(proc)
    assert done.returncode == 0, done.stderr
    assert "expects id:000455 next from 'symcc'" in done.stderr
    ours = afl / "symcc" / "queue"
    written = {p.name: p.read_bytes() for p in queue_files(ours)}
    assert sorted(written.values()) == [b"one-x", b"three-x", b"two-x"]
    # (the three commit in any order)
    assert sorted(int(n[len("id:"):n.index(",")]) for n in written) == [455, 456, 457]
    assert {n.split(",src:")[1]: content for n, content in written.items()} == {
        "000000": b"one-x", "000001": b"two-x", "000002": b"three-x"}
    assert query(db, "SELECT count(*) FROM tasks") == [(3,)]
    assert query(db, "SELECT sum(testcases) FROM results") == [(3,)]
    check_conservation(db)


@pytest.mark.timeout(300)
def test_a_second_campaign_on_one_afl_instance_directory_is_refused(tmp_path):
    """Two campaigns (two --db) with the default --name symcc wrote one AFL instance
    directory at once: its queue held id:000002 to id:000011 twice each, and AFL's sync,
    past one campaign's ids, never imported the other's lower ones. The second is refused
    before MPI starts; the first, killed with kill -9, resumes without meeting a stale lock."""
    target = write_target(tmp_path)
    afl = tmp_path / "afl"
    for fuzzer in ("main", "sec"):
        entry = afl / fuzzer / "queue" / "id:000000,orig:seed"
        entry.parent.mkdir(parents=True)
        entry.write_bytes(fuzzer.encode())
        os.utime(entry, (time.time() - 60,) * 2)
    first_db, second_db = tmp_path / "ct1.db", tmp_path / "ct2.db"

    def args(fuzzer: str) -> list[str]:
        return ["--afl-out", str(afl), "--fuzzer", fuzzer, "--max-depth", "2", "--",
                sys.executable, str(target), "@@"]
    first = self_launch(first_db, *args("main"), np=2)
    try:
        wait_for(first_db, "SELECT count(*) FROM results", lambda n: n >= 1, timeout=120)
        pid = master_pid(first_db)
        second = self_run(second_db, *args("sec"), np=2, timeout=60)
        kill_ranks(first_db)
        first.communicate(timeout=60)
    finally:
        end_launch(first, first_db)
    assert second.returncode == ExitStatus.USAGE, second.stderr[-3000:]
    assert second.stderr.startswith(
        f"coordinator: {afl / 'symcc'} is in use by another campaign's master (pid {pid}, "
        f"--db {first_db}): "), second.stderr
    assert "another --name" in second.stderr and not second_db.exists()
    # A crash: the same campaign goes on, its ids after its own.
    resumed = self_launch(first_db, "--resume", *args("main"), np=2)
    try:
        wait_for(first_db, "SELECT count(*) FROM tasks WHERE state = 'done'",
                 lambda n: n == 7, timeout=120)  # the seed, its 2 test cases, their 4
        _, err = ctrl_c(resumed, timeout=120)
    finally:
        end_launch(resumed, first_db)
    assert resumed.returncode == 0, err[-3000:]
    # Each of the 7 runs wrote 2 test cases, each under an id of its own.
    ids = [p.name.split(",")[0] for p in queue_files(afl / "symcc" / "queue")]
    assert len(ids) == len(set(ids)) == 14


def test_sigkill_of_the_whole_job_then_resume_commits_each_task_once(tmp_path):
    db = tmp_path / "c.db"
    # Long enough that the job still runs when `status` (a Python start, ~0.5 s) looks.
    args = ["run", "--db", str(db), "--demo", "400", "--demo-work-ms", "30", "--no-progress"]
    proc = start(args)
    wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 30)
    running = status_json(db)["master"]
    kill_job(proc)
    proc.communicate(timeout=60)
    kill_ranks(db)
    # (Demo tasks go in automatic batches: a dispatch may hold several active tasks.)
    in_flight = query(db, "SELECT count(*) FROM dispatches")[0][0]
    active = query(db, "SELECT count(*) FROM tasks WHERE state = 'active'")[0][0]
    # status tells a running master from a dead one (by the kernel's lock table, not a pid),
    # and what --resume does with the tasks a dead one left active.
    assert running["running"] is True and running["pid"] == master_pid(db)
    assert status_json(db)["master"] == {**running, "running": False}
    shown = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db", str(db)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"master: not running (the last was pid {running['pid']} on " in shown
    if active:
        assert (f"the {active} active ones were left by a master that is gone: "
                f"`coordinator run --resume` puts them back in the queue first") in shown
    done = run(args[:1] + ["--resume"] + args[1:])
    assert done.returncode == 0, done.stderr
    check_conservation(db, expected_tasks=400)
    assert query(db, "SELECT count(*) FROM results") == [(400,)]
    assert query(db, "SELECT count(DISTINCT task_id) FROM results") == [(400,)]
    assert query(db, "SELECT count(*) FROM events WHERE kind='interrupted'") == [(in_flight,)]
    assert status_json(db)["incarnation"] == 2


def test_sigterm_stops_gracefully_and_resume_completes(tmp_path):
    db = tmp_path / "c.db"
    args = ["run", "--db", str(db), "--demo", "300", "--demo-work-ms", "20", "--grace", "0",
            "--no-progress"]
    proc = start(args)
    pid = master_pid(db)
    wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 30)
    os.kill(pid, signal.SIGTERM)
    done = finish(proc)
    assert done.returncode == 0, done.stderr
    check_conservation(db, expected_tasks=300)
    assert query(db, "SELECT count(*) FROM tasks WHERE state='queued'")[0][0] > 0
    assert query(db, "SELECT state FROM workers") == [("stopped",)] * 3
    again = run(args[:1] + ["--resume"] + args[1:])
    assert again.returncode == 0, again.stderr
    check_conservation(db, expected_tasks=300)
    assert query(db, "SELECT count(*) FROM results") == [(300,)]


LONG_TARGET = textwrap.dedent("""\
    import os, subprocess, sys, time
    # A run longer than the stop's grace and wait, with a child of its own, like SymCC under
    # a wrapper script: both pids recorded where the test finds them.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(sys.argv[2], f"{os.getpid()}-{child.pid}"), "w"):
        pass
    time.sleep(600)
    """)


@pytest.mark.parametrize("ulfm", [True, False], ids=["ulfm", "no-ulfm"])
def test_a_stop_that_ends_busy_ranks_leaves_no_command_running(tmp_path, ulfm):
    """Ranks still running their command when the stop's wait runs out are ended by the
    master (fenced under ULFM, the job aborted without). Each target runs in a session of its
    own, so it used to outlive the job, with its children, until its own end. The master now
    sends such ranks on its host SIGUSR2 first, and a worker takes its command's process
    group with it."""
    if ulfm and mpi_kind() != "openmpi":
        pytest.skip("ULFM is Open MPI's")
    target, pids = tmp_path / "long.py", tmp_path / "pids"
    target.write_text(LONG_TARGET)
    pids.mkdir()
    tasks = _input_tasks(tmp_path, 3)
    db = tmp_path / "c.db"
    proc = start(["run", "--db", str(db), "--tasks", str(tasks), "--timeout", "600",
                  "--grace", "0.5", "--stop-wait", "1", "--no-progress",
                  "--", sys.executable, str(target), "@@", str(pids)], ulfm=ulfm)
    started: list[int] = []
    try:
        pid = master_pid(db)
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        started = [int(p) for f in pids.iterdir() for p in f.name.split("-")]
        assert len(started) == 6 and all(map(running, started))
        os.kill(pid, signal.SIGTERM)
        done = finish(proc, timeout=90)
        assert "did not acknowledge STOP" in done.stderr, done.stderr[-3000:]
        deadline = time.monotonic() + 10  # SIGKILLed by now; /proc may take a moment
        while any(map(running, started)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in started if running(p)] == []
    finally:
        kill_job(proc)
        for p in [int(p) for f in pids.iterdir() for p in f.name.split("-")]:
            if running(p):  # never left behind on the machine running the tests
                os.kill(p, signal.SIGKILL)
    check_conservation(db, expected_tasks=3)
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY 1") == [("queued", 3)]


def _input_tasks(tmp_path: Path, n: int) -> Path:
    """A tasks file of `n` inputs, each stored with its task."""
    lines = []
    for i in range(n):
        (tmp_path / f"in{i}").write_bytes(b"%d" % i)
        lines.append(json.dumps({"path": str(tmp_path / f"in{i}"),
                                 "input_file": str(tmp_path / f"in{i}")}))
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "t.jsonl"


SHORT_TARGET = textwrap.dedent("""\
    import time
    time.sleep(1.5)
    """)


@pytest.mark.parametrize("signalled", ["every rank", "the master"])
def test_runs_in_flight_at_a_sigterm_finish_and_commit(tmp_path, signalled):
    """What a batch system does when a job is cancelled or out of time: SIGTERM to every
    process. The workers go on with their commands through the master's grace period, so the
    tasks in flight commit (no attempt charged, nothing requeued), and the run stops cleanly.

    The same for runs longer than --grace (SymCC's; here the master alone is signalled, with
    a grace of 0.2 s): they used to go back to the queue when the grace period ended, their
    RESULTs then came during the wait for the STOP_ACKs and were quarantined as `unowned`
    (counted for the campaign's life), and the finished runs were done again at --resume. The
    dispatches now stay in flight through that wait: what ends in it is committed."""
    target = tmp_path / "short.py"
    target.write_text(SHORT_TARGET)
    db = tmp_path / "c.db"
    stop = (["--grace", "20"] if signalled == "every rank"
            else ["--grace", "0.2", "--stop-wait", "30"])
    proc = start(["run", "--db", str(db), "--tasks", str(_input_tasks(tmp_path, 9)), *stop,
                  "--no-progress", "--", sys.executable, str(target), "@@"])
    try:
        pid = master_pid(db)
        wait_for(db, "SELECT count(*) FROM dispatches", lambda n: n == 3)
        for rank in ranks_of(db) if signalled == "every rank" else [pid]:
            os.kill(rank, signal.SIGTERM)
        done = finish(proc, timeout=90)
    finally:
        kill_job(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=9)
    # Every task that was running when the signal came finished and committed: none went
    # back to the queue at the stop, none was charged an attempt, nothing was quarantined.
    [(ok,)] = query(db, "SELECT count(*) FROM results WHERE status = 'ok'")
    assert ok >= 3 and query(db, "SELECT count(*) FROM tasks WHERE state = 'queued'") == [
        (9 - ok,)]
    assert query(db, "SELECT count(*) FROM events WHERE kind = 'stop_requeued'") == [(0,)]
    assert query(db, "SELECT sum(attempts) FROM tasks") == [(0,)]
    assert query(db, "SELECT state FROM workers") == [("stopped",)] * 3
    assert query(db, "SELECT count(*) FROM quarantine") == [(0,)]
    assert status_json(db)["quarantine"] == quarantined()


HELD_TARGET = textwrap.dedent("""\
    import os, sys, time
    data = open(sys.argv[1], "rb").read()
    with open(os.path.join(os.environ["SYMCC_OUTPUT_DIR"], "000000"), "wb") as f:
        f.write(data + b"-found-before-the-stop")
    hold = os.path.join(os.path.dirname(sys.argv[0]), "hold")
    if os.path.exists(hold):
        open(f"{hold}.{os.getpid()}", "w").close()  # (running: the test may signal it)
        time.sleep(600)
    """)


def test_a_stop_that_signals_the_targets_too_requeues_their_runs_uncharged(tmp_path):
    """Slurm's SIGTERM at a time limit or a `scancel` reaches every process of the job, the
    targets too. They died of it, and their runs were committed as `error` results ("target
    killed by SIGTERM"): their tasks done for ever, a campaign's runs in flight lost at every
    stop (a review: 3 of 3). Now such a run is `interrupted`: back to the queue, charged
    nothing, its test cases kept and counted; `--resume` runs it."""
    target = tmp_path / "held.py"
    target.write_text(HELD_TARGET)
    (tmp_path / "hold").touch()
    db, out = tmp_path / "c.db", tmp_path / "out"
    proc = start(["run", "--db", str(db), "--tasks", str(_input_tasks(tmp_path, 3)),
                  "--out", str(out), "--grace", "1", "--no-feedback", "--no-progress", "--",
                  sys.executable, str(target), "@@"])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("hold.*"))) < 3:
            assert time.monotonic() < deadline and proc.poll() is None, "no 3 targets running"
            time.sleep(0.05)
        ranks = ranks_of(db)
        targets = [p for p in children_of(ranks) if str(target).encode()
                   in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(targets) == 3, targets
        for pid in targets + ranks:  # (as a batch system does: every process, in no order)
            os.kill(pid, signal.SIGTERM)
        done = finish(proc, timeout=90)
    finally:
        kill_job(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=3)
    assert query(db, "SELECT count(*) FROM results") == [(0,)]
    assert query(db, "SELECT state, attempts, budget_used FROM tasks") == [("queued", 0, 0)] * 3
    failed = [d for (d,) in query(db, "SELECT detail FROM events WHERE kind = 'task_failed'")]
    assert len(failed) == 3 and all(d.startswith(
        "interrupted (1 test case kept) (not charged: cut short by the job's stop)")
        for d in failed), failed
    assert sorted(p.read_bytes() for p in output_files(out)) == [
        b"%d-found-before-the-stop" % i for i in range(3)]
    assert status_json(db)["testcases"]["written"] == 3
    (tmp_path / "hold").unlink()
    again = run(["run", "--db", str(db), "--resume", "--no-progress"], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    check_conservation(db, expected_tasks=3)
    assert query(db, "SELECT status, count(*) FROM results GROUP BY 1") == [("ok", 3)]


def test_a_full_disk_during_the_import_stops_cleanly_and_resume_finishes(tmp_path, tiny_fs):
    """The database fills its filesystem while the tasks file is imported: exit 3, a line
    saying nothing is lost and to continue with --resume (the campaign row exists, so a plain
    start would be refused), no traceback; on a disk with room, --resume imports and runs
    every task once."""
    tasks = tmp_path / "t.jsonl"
    tasks.write_text("".join(json.dumps({"data": {"n": i + 1, "pad": "x" * 200}}) + "\n"
                             for i in range(8000)))
    db = tiny_fs / "c.db"
    args = ["run", "--db", str(db), "--tasks", str(tasks), "--no-progress"]
    done = self_run(db, *args[3:], np=2)
    assert done.returncode == ExitStatus.STORE, done.stderr[-3000:]
    assert "database or disk is full" in done.stderr and "Traceback" not in done.stderr
    assert f"start it again with --resume --tasks {tasks}" in done.stderr
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    for name in ("c.db", "c.db-wal"):  # the same campaign, moved to a disk with room
        if (tiny_fs / name).exists():
            (roomy / name).write_bytes((tiny_fs / name).read_bytes())
    again = run(["run", "--db", str(roomy / "c.db"), "--tasks", str(tasks), "--no-progress",
                 "--resume"], np=2)
    assert again.returncode == 0, again.stderr[-3000:]
    check_conservation(roomy / "c.db", expected_tasks=8000)
    assert query(roomy / "c.db", "SELECT count(*) FROM results") == [(8000,)]


WORKER_FAILS = textwrap.dedent("""\
    import os
    # Loads on the master (rank 0 checks the spec before the start), not on the workers.
    if any(os.environ.get(v, "0") != "0" for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        raise ImportError("a module missing on the worker nodes")
    def work(task):
        return task
    """)


def test_a_worker_that_cannot_load_its_executor_leaves_and_nothing_is_lost(tmp_path):
    """Such a worker used to fall into MPI_Finalize, spinning, with the master never told:
    the job never ended. It now leaves the job (under ULFM the master sees it die and stops
    when no worker is left; otherwise the job is aborted), and --resume with a callable that
    loads finishes every task once."""
    spec = tmp_path / "fails.py"
    spec.write_text(WORKER_FAILS)
    db = tmp_path / "c.db"
    args = ["run", "--db", str(db), "--demo", "20", "--callable", f"{spec}:work",
            "--no-progress"]
    broken = run(args, timeout=120)
    assert "cannot go on and leaves the job" in broken.stderr
    assert "a module missing on the worker nodes" in broken.stderr
    spec.write_text("def work(task):\n    return task\n")
    done = run(args[:1] + ["--resume"] + args[1:])
    assert done.returncode == 0, done.stderr
    check_conservation(db, expected_tasks=20)
    assert status_json(db)["tasks"]["done"] == 20


def test_a_callable_that_calls_os_exit_fails_its_task_and_the_run_goes_on(tmp_path):
    """Under ULFM, Open MPI never reports a rank that leaves with a nonzero status: the job
    hung until the watchdog, then was ended by the launcher. The call is now the task's
    failure, like sys.exit, and every rank stays."""
    spec = tmp_path / "leaves.py"
    spec.write_text("import os\ndef work(task):\n    if task['data']['n'] == 3:\n"
                    "        os._exit(7)\n    return task['data']['n']\n")
    db = tmp_path / "c.db"
    done = run(["run", "--db", str(db), "--demo", "12", "--callable", f"{spec}:work",
                "--no-progress"], timeout=120)
    assert done.returncode == 0, done.stderr
    check_conservation(db, expected_tasks=12)
    assert query(db, "SELECT status, count(*) FROM results GROUP BY status") == [
        ("error", 1), ("ok", 11)]
    [(detail,)] = query(db, "SELECT detail FROM results WHERE status = 'error'")
    said, where = detail.split("\n")
    assert said == "CallableExited: the callable called os._exit(7); the worker stayed"
    assert where.startswith("raised at ") and where.endswith("leaves.py:4 in work"), where
    assert query(db, "SELECT count(*) FROM events WHERE kind IN ('watchdog', "
                     "'worker_failed')") == [(0,)]


def test_a_run_whose_every_rank_hangs_says_so_and_ends_as_stalled(tmp_path):
    """Three workers each run a callable that never returns: the watchdog parks all three,
    and nothing can run. The run used to sit there with "0 done, 6 queued" until killed from
    outside; it now says which ranks hold which tasks, and after --stall-grace ends with the
    tasks charged and queued, the hung ranks ended, and its own exit status."""
    spec = tmp_path / "hangs.py"
    spec.write_text("import time\ndef work(task):\n    time.sleep(10**6)\n")
    db = tmp_path / "c.db"
    began = time.monotonic()
    done = self_run(db, "--demo", "6", "--callable", f"{spec}:work", "--watchdog", "2",
                    "--stall-grace", "3", "--stop-wait", "2", np=4, timeout=120)
    assert done.returncode == ExitStatus.STALLED, done.stderr[-3000:]
    assert time.monotonic() - began < 90
    said = [line for line in done.stderr.splitlines() if "no rank can take work" in line]
    assert said and "rank 1 on task" in said[0] and "rank 3 on task" in said[0], said
    assert "ending the run" in done.stderr and "Traceback" not in done.stderr
    check_conservation(db, expected_tasks=6)
    assert query(db, "SELECT state, count(*) FROM tasks GROUP BY state") == [("queued", 6)]
    assert query(db, "SELECT sum(attempts) FROM tasks") == [(3,)]  # the three it ran
    assert ranks_of(db) == []  # the hung ranks were ended with the job


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ulfm", [True, False], ids=["ulfm", "no-ulfm"])
def test_a_thread_a_callable_leaves_running_does_not_hold_the_end_of_the_run(tmp_path, ulfm):
    """A task's callable starts a thread that never ends. The worker's interpreter waited for
    it at exit, before MPI_Finalize, and the master's MPI_Finalize waited for that worker:
    the run never ended."""
    if ulfm and mpi_kind() != "openmpi":
        pytest.skip("ULFM is an Open MPI feature")
    spec = tmp_path / "lingers.py"
    spec.write_text("import threading\n"
                    "def work(task):\n"
                    "    threading.Thread(target=threading.Event().wait).start()\n"
                    "    return task\n")
    db = tmp_path / "c.db"
    done = run(["run", "--db", str(db), "--demo", "4", "--callable", f"{spec}:work",
                "--no-progress"], np=3, ulfm=ulfm, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert query(db, "SELECT status, count(*) FROM results GROUP BY status") == [("ok", 4)]


def test_a_shell_holding_the_write_lock_is_waited_for_and_nothing_is_lost(tmp_path):
    """An operator's `sqlite3` shell holds BEGIN IMMEDIATE for 14 s in the middle of a run. The
    master used to end with exit 3; it now waits, says what for and who holds it, keeps the
    answers that arrive meanwhile, and finishes every task once the shell lets go."""
    import sqlite3
    db = tmp_path / "c.db"
    proc = start(["run", "--db", str(db), "--demo", "3000", "--demo-work-ms", "3",
                  "--no-progress", "--watchdog", "5"])
    try:
        wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 100)
        shell = sqlite3.connect(db, isolation_level=None)
        shell.execute("BEGIN IMMEDIATE")
        time.sleep(14)
        during = query(db, "SELECT count(*) FROM results")[0][0]
        shell.execute("ROLLBACK")
        shell.close()
        done = finish(proc, timeout=180)
    finally:
        kill_job(proc)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    waits = [line for line in done.stderr.splitlines() if "for the campaign's write lock" in line]
    assert waits and f"held by pid {os.getpid()}" in waits[0], done.stderr[-3000:]
    assert during < 3000
    check_conservation(db, expected_tasks=3000)
    assert status_json(db)["tasks"]["done"] == 3000


def test_a_lock_held_past_lock_wait_stops_the_run_with_exit_3(tmp_path):
    """Self-launched, as a user runs it: the launcher reports the master's status. (Under a
    bare `mpiexec` without ULFM the job's status is the first rank to end abnormally: MPICH
    gave 140, a worker the master ended before its MPI_Abort.)"""
    import sqlite3
    db = tmp_path / "c.db"
    proc = self_launch(db, "--demo", "3000", "--demo-work-ms", "3", "--lock-wait", "2")
    try:
        wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 100)
        shell = sqlite3.connect(db, isolation_level=None)
        shell.execute("BEGIN IMMEDIATE")
        _, err = proc.communicate(timeout=120)
        shell.execute("ROLLBACK")
        shell.close()
    finally:
        end_launch(proc, db)
    assert proc.returncode == ExitStatus.STORE, err[-3000:]
    assert "--lock-wait" in err and "Traceback" not in err
    again = run(["run", "--db", str(db), "--resume", "--no-progress"], timeout=180)
    assert again.returncode == ExitStatus.OK, again.stderr[-3000:]
    check_conservation(db, expected_tasks=3000)


def test_a_hard_link_to_a_running_campaign_gets_no_master_and_changes_nothing(tmp_path):
    """`ln campaign.db alias.db`, then a resume on the alias while a master runs on the
    original: the second master started with its own alias.db-wal, died with a FenceError,
    and a later `status` on the alias replayed that WAL into the shared file (done 1,500 ->
    1,172, a wrong index). Now the alias is refused at once and the run is untouched."""
    db = tmp_path / "campaign.db"
    alias = tmp_path / "alias.db"
    proc = start(["run", "--db", str(db), "--demo", "1500", "--demo-work-ms", "2",
                  "--no-progress"])
    try:
        wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 50)
        os.link(db, alias)
        second = run(["run", "--db", str(alias), "--resume", "--no-progress"], timeout=60)
        assert second.returncode == ExitStatus.USAGE, second.stderr[-2000:]
        assert "has 2 names (hard links to one file)" in second.stderr
        for command in (["status"], ["check"]):
            seen = subprocess.run([sys.executable, "-m", "coordinator", *command, "--db",
                                   str(alias)], capture_output=True, text=True, timeout=60)
            assert seen.returncode == ExitStatus.USAGE and "has 2 names" in seen.stderr
        assert not alias.with_name("alias.db-wal").exists()
        os.unlink(alias)
        done = finish(proc, timeout=180)
    finally:
        kill_job(proc)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    check_conservation(db, expected_tasks=1500)
    assert status_json(db)["tasks"]["done"] == 1500


def test_a_resume_without_the_callable_runs_the_campaigns_own(tmp_path):
    """`--resume` without the executor's arguments was refused although the campaign stores
    them: it now runs the stored callable, and says so."""
    spec = tmp_path / "work.py"
    spec.write_text("def square(task):\n    return task['data']['n'] ** 2\n")
    db = tmp_path / "c.db"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"data": {{"n": {i}}}}}\n' for i in range(40)))
    proc = start(["run", "--db", str(db), "--tasks", str(tasks), "--callable",
                  f"{spec}:square", "--no-progress"])
    try:
        wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 1)
        kill_job(proc)
    finally:
        kill_job(proc)
    again = run(["run", "--db", str(db), "--resume", "--no-progress"], timeout=120)
    assert again.returncode == ExitStatus.OK, again.stderr[-3000:]
    assert f"runs the campaign's own executor, as its last run did: --callable {spec}:square" \
        in again.stderr
    check_conservation(db, expected_tasks=40)
    assert query(db, "SELECT count(*) FROM results WHERE status = 'ok' AND value = "
                     "json_extract((SELECT payload FROM tasks WHERE id = task_id), "
                     "'$.data.n') * json_extract((SELECT payload FROM tasks WHERE id = task_id),"
                     " '$.data.n')") == [(40,)]


def test_every_worker_runs_the_program_the_master_resolved(tmp_path):
    """Workers on other nodes may have another PATH: a bare program name resolved there could
    be another binary. The master resolves the command once and sends it to every worker."""
    for which in ("master", "other"):
        (tmp_path / which).mkdir()
        prog = tmp_path / which / "mytarget"
        prog.write_text(f"#!{sys.executable}\nimport os\nopen(os.path.join("
                        f"os.environ['SYMCC_OUTPUT_DIR'], 'o'), 'w').write({which!r})\n")
        prog.chmod(0o755)
    seed = tmp_path / "seed"
    seed.write_bytes(b"x")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"path": "{seed}", "input_file": "{seed}", "data": {i}}}\n'
                             for i in range(6)))
    db, out = tmp_path / "c.db", tmp_path / "out"
    path = os.environ["PATH"]
    command = split_job_command(
        ["run", "--db", str(db), "--tasks", str(tasks), "--out", str(out), "--no-feedback",
         "--no-progress", "--", "mytarget", "@@"],
        master_wrap=["env", f"PATH={tmp_path / 'master'}:{path}"],
        worker_wrap=["env", f"PATH={tmp_path / 'other'}:{path}"])
    done = finish(start([], command=command), timeout=120)
    assert done.returncode == 0, done.stderr
    check_conservation(db, expected_tasks=6)
    assert [p.read_text() for p in output_files(out)] == ["master"]  # 6 results, one content
    assert query(db, "SELECT status, sum(testcases) FROM results GROUP BY status") == [("ok", 1)]


def self_launch(db, *args: str, np: int = 3, unset: tuple[str, ...] = ()) -> subprocess.Popen:
    """`coordinator run` outside mpiexec, as a user types it, in a session of its own (the
    test plays the terminal); without the variables `unset` names."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMI", "PMIX", "HYDRA", "MPI_LOCAL"))
           and k not in unset}
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator", "run", "--db", str(db), "--no-progress",
         "--np", str(np), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)


def self_run(db, *args: str, np: int = 3, timeout: float = 120,
             unset: tuple[str, ...] = ()) -> Done:
    """`self_launch` to its end. A test of the master's own exit status uses it: without ULFM
    the master ends the ranks it cannot stop before MPI_Abort, and a bare `mpiexec` then
    reports the first of them to end (MPICH: 9 or 140), not the master's status."""
    proc = self_launch(db, *args, np=np, unset=unset)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        end_launch(proc, db)
    return Done(proc.returncode, out, err)


def ctrl_c(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """What the terminal does on Ctrl-C: SIGINT to the launcher's process group; then the
    launch's output once it has ended."""
    os.killpg(proc.pid, signal.SIGINT)
    return proc.communicate(timeout=timeout)


def end_launch(proc: subprocess.Popen, db) -> None:
    """Whatever the test's outcome: no launcher and no rank of its job left running."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()
    kill_ranks(db)


def test_ctrl_c_during_a_long_import_is_a_graceful_stop_not_an_internal_error(tmp_path):
    db = tmp_path / "c.db"
    proc = self_launch(db, "--demo", "300000")
    try:
        deadline = time.monotonic() + 120
        while not db.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the import of 300,000 tasks takes seconds: stop inside it
        out, err = ctrl_c(proc, timeout=180)
    finally:
        end_launch(proc, db)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGINT: no new dispatches" in err and "internal error" not in err
    assert "continue it with --resume" in out
    assert query(db, "SELECT count(*) FROM tasks WHERE state = 'active'") == [(0,)]


def test_a_killed_launcher_takes_its_job_with_it(tmp_path):
    """The job runs in a session of its own (so that a terminal's Ctrl-C reaches only the
    launcher): when the launcher is killed outright, the job must not run on unattended."""
    db = tmp_path / "c.db"
    proc = self_launch(db, "--demo", "100000", "--demo-work-ms", "5")
    try:
        wait_for(db, "SELECT count(*) FROM results", lambda n: bool(n and n >= 20), timeout=120)
        proc.kill()
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 60
        while ranks_of(db) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ranks_of(db) == [], "ranks still running after their launcher died"
    finally:
        end_launch(proc, db)
    assert query(db, "SELECT count(*) FROM results")[0][0] < 100000


def test_ctrl_c_on_a_self_launched_run_stops_it_gracefully(tmp_path):
    """`coordinator run` outside mpiexec (the README's demo command) launches the job itself.
    A terminal's Ctrl-C (SIGINT to the launcher's process group) must stop it as a signal to
    the master does: in-flight work requeued, workers stopped, the summary printed, exit 0."""
    db = tmp_path / "c.db"
    proc = self_launch(db, "--demo", "3000", "--demo-work-ms", "5")
    try:
        wait_for(db, "SELECT count(*) FROM results", lambda n: bool(n and n >= 20), timeout=120)
        out, err = ctrl_c(proc, timeout=120)
    finally:
        end_launch(proc, db)
    assert proc.returncode == 0, err[-3000:]
    assert "SIGINT: no new dispatches" in err
    assert "this run committed" in out and "continue it with --resume" in out
    assert query(db, "SELECT count(*) FROM tasks WHERE state = 'active'") == [(0,)]
    assert query(db, "SELECT DISTINCT state FROM workers") == [("stopped",)]
    check_conservation(db, expected_tasks=3000)


def test_a_self_launched_run_without_home_runs(tmp_path):
    """Open MPI fails at its start without HOME ("Unable to get the user home directory",
    exit 1), as a cron job or `env -i` starts it: the launch takes the user's home from the
    password database."""
    db = tmp_path / "c.db"
    done = self_run(db, "--demo", "20", unset=("HOME",))
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db, expected_tasks=20)


@pytest.mark.timeout(150)
def test_a_self_launched_run_exits_with_the_masters_status(tmp_path):
    """Exit 4 (a rank never acknowledged STOP) used to reach the caller as 140: mpiexec reports
    the first rank to end abnormally, here the hung rank the master ended with SIGUSR2."""
    db = tmp_path / "c.db"
    proc = self_launch(db, "--demo", "1", "--inject", "hang=1", "--watchdog", "1",
                       "--stop-wait", "2", "--retries", "0", "--max-attempts", "1")
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        end_launch(proc, db)
    assert "did not acknowledge STOP" in err, err[-3000:]
    assert proc.returncode == ExitStatus.UNACKED, err[-3000:]
    assert query(db, "SELECT state FROM tasks") == [("failed",)]


@pytest.mark.timeout(200)
def test_a_self_launched_run_whose_master_is_killed_does_not_exit_0(tmp_path):
    """Under ULFM mpiexec exits 0 when the master is SIGKILLed (the OOM killer, say) while
    it imports: the launcher passed that on, and a script read the run as finished."""
    db = tmp_path / "c.db"
    proc = self_launch(db, "--demo", "300000")
    try:
        os.kill(master_pid(db, timeout=120), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        end_launch(proc, db)
    assert proc.returncode == ExitStatus.FAILED, err[-3000:]  # not 0, nor mpiexec's 137
    assert "ended before the master recorded its status" in err, err[-3000:]
    assert "run the same command again with --resume" in err


@pytest.mark.timeout(200)
def test_the_metrics_file_of_a_killed_master_says_it_no_longer_runs(tmp_path):
    """A master killed (kill -9, the OOM killer) never writes its last metrics file: it kept
    `coordinator_running 1` for ever, and an alert on it never fired. The launcher marks it."""
    db, prom = tmp_path / "c.db", tmp_path / "c.prom"
    proc = self_launch(db, "--demo", "3000", "--demo-work-ms", "20", "--metrics-file",
                       str(prom))
    try:
        deadline = time.monotonic() + 120
        while not (prom.exists() and re.search(r"^coordinator_running\{.*\} 1$",
                                                prom.read_text(), re.M)):
            assert time.monotonic() < deadline, "no metrics file of a running master"
            time.sleep(0.1)
        os.kill(master_pid(db), signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        end_launch(proc, db)
    assert proc.returncode != 0, err[-3000:]
    text = prom.read_text()
    assert re.search(r"^coordinator_running\{.*\} 0$", text, re.M), text
    assert re.search(r"^coordinator_tasks\{.*state=\"done\"\} \d+$", text, re.M), text


def ctrl_c_with_fake_mpiexec(tmp_path, body: str, setup: str = "") -> tuple[int, str, Path]:
    """Ctrl-C on a self-launched run whose `mpiexec` is the shell script `setup` then `body`
    (which have the launch's arguments in "$@"), once `setup` has run: (exit status, stderr,
    db)."""
    fake = tmp_path / "fake-mpiexec"
    started = tmp_path / "started"
    fake.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exit 0\n{setup}touch {started}\n'
                    f'{body}')
    fake.chmod(0o755)
    db = tmp_path / "c.db"
    proc = self_launch(db, "--mpiexec", str(fake))
    try:
        deadline = time.monotonic() + 30
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        _, err = ctrl_c(proc, timeout=30)
    finally:
        end_launch(proc, db)
    return proc.returncode, err, db


def test_ctrl_c_before_the_master_starts_says_so(tmp_path):
    """A launch stopped before any master ran (here an `mpiexec` that never starts one) used
    to end with exit 1 and no word; nothing was changed, and the launcher says so."""
    status, err, db = ctrl_c_with_fake_mpiexec(tmp_path, "exec sleep 60\n")
    assert status == 130, err[-3000:]
    assert "stopped before the master started; nothing was changed" in err
    assert not db.exists()


def test_ctrl_c_as_the_master_starts_says_so(tmp_path):
    """The launcher's Ctrl-C found no master yet and ended the job, and the master started
    just then and was killed with it: the launch ended with mpiexec's status (1) and no word.
    Here an `mpiexec` that records a master's pid only as it is ended plays that race."""
    status, err, _ = ctrl_c_with_fake_mpiexec(tmp_path, 'while :; do sleep 0.05; done\n', setup=(
        'while [ $# -gt 0 ]; do [ "$1" = --master-pid-file ] && pid_file=$2; shift; done\n'
        'trap \'echo $$ > "$pid_file"; exit 1\' TERM\n'))
    assert status == 130, err[-3000:]
    assert "stopped while the master was starting; run the same command again" in err


def test_undecodable_results_are_quarantined_and_the_master_keeps_going(tmp_path):
    db = tmp_path / "c.db"
    # One task per dispatch: the fault strikes dispatches, and automatic batches would leave
    # few enough of them (their number depends on timing) that none may be struck.
    done = run(["run", "--db", str(db), "--demo", "60", "--inject", "result_garbage=0.3",
                "--inject-seed", "7", "--retries", "16", "--no-progress", "--batch", "1"])
    assert done.returncode == 0, done.stderr
    check_conservation(db, expected_tasks=60)
    assert query(db, "SELECT count(*) FROM results") == [(60,)]
    reasons = query(db, "SELECT channel, reason, count(*) FROM quarantine "
                        "GROUP BY channel, reason")
    assert [(c, r) for c, r, _ in reasons] == [("result", "malformed")]
    assert query(db, "SELECT detail FROM quarantine LIMIT 1")[0][0].startswith("undecodable")
    assert status_json(db)["quarantine"]["result"]["malformed"] == reasons[0][2] > 0


def test_bad_inject_spec_is_a_usage_error(tmp_path):
    done = run(["run", "--db", str(tmp_path / "c.db"), "--inject", "gremlins=0.5"], np=2)
    assert done.returncode == ExitStatus.USAGE and "unknown fault kind 'gremlins'" in done.stderr
    done = run(["run", "--db", str(tmp_path / "c.db"), "--inject", "hang=1.5"], np=2)
    assert done.returncode == ExitStatus.USAGE and "outside 0..1" in done.stderr
    assert not (tmp_path / "c.db").exists()


def test_a_bare_resume_runs_the_campaigns_own_executor(tmp_path):
    """A bare `--resume` on a campaign of a callable runs that callable again, as its first
    run stored it, and says so. (It used to add 300 demo tasks and run the campaign's own
    tasks through the demo executor, committing every one as an error for good.) Naming
    another executor is a conflict and is refused before anything is written."""
    mod = tmp_path / "square.py"
    mod.write_text("def square(task):\n    return task['data']['n'] ** 2\n")
    db = tmp_path / "c.db"
    first = run(["run", "--db", str(db), "--demo", "4", "--callable", f"{mod}:square",
                 "--no-progress"])
    assert first.returncode == 0, first.stderr[-2000:]
    other = run(["run", "--db", str(db), "--resume", "--executor", "demo", "--no-progress"])
    assert other.returncode == ExitStatus.USAGE, other.stderr[-2000:]
    assert f"python executor (--callable {mod}:square)" in other.stderr
    assert query(db, "SELECT count(*), max(incarnation) FROM campaign, tasks") == [(4, 1)]
    bare = run(["run", "--db", str(db), "--resume", "--no-progress"])
    assert bare.returncode == 0, bare.stderr[-2000:]
    assert "--resume runs the campaign's own executor, as its last run did" in bare.stderr
    assert query(db, "SELECT count(*) FROM tasks") == [(4,)]  # no demo tasks added
    assert query(db, "SELECT status, count(*) FROM results GROUP BY status") == [("ok", 4)]
    more = run(["run", "--db", str(db), "--resume", "--demo", "6", "--no-progress"])
    assert more.returncode == 0, more.stderr[-2000:]
    assert "4 of 6 tasks were already in the campaign" in more.stderr
    assert query(db, "SELECT status, count(*) FROM results GROUP BY status") == [("ok", 6)]
    values = query(db, "SELECT t.payload, r.value FROM results r JOIN tasks t "
                       "ON t.id = r.task_id ORDER BY t.id")
    assert [json.loads(v) for _, v in values] == [
        json.loads(p)["data"]["n"] ** 2 for p, _ in values]  # the callable, not the demo


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_workers_sleep_while_the_master_imports_a_big_tasks_file(tmp_path):
    """The workers wait for the start verdict without burning the cores the master imports
    on. Blocked in the start-up broadcast they took one whole core between them (17 s of
    CPU in an 18 s start on 2 cores), which slowed the import itself."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"data": {{"n": {i}}}}}\n' for i in range(300_000)))
    db = tmp_path / "big.db"
    proc = start(["run", "--db", str(db), "--tasks", str(tasks), "--no-progress"])
    try:
        master = master_pid(db)  # recorded before the import, in its own transaction
        workers: list[int] = []
        deadline = time.monotonic() + 60
        while len(workers) < 3 and time.monotonic() < deadline:
            workers = [p for p in ranks_of(db) if p != master]
            time.sleep(0.05)
        assert len(workers) == 3
        time.sleep(1.0)  # past their own start-up, into the wait for the verdict
        before, t0 = sum(map(_cpu_seconds, workers)), time.monotonic()
        time.sleep(2.0)
        spent, window = sum(map(_cpu_seconds, workers)) - before, time.monotonic() - t0
        # The whole window fell inside the import (one transaction: no task row before it).
        assert query(db, "SELECT count(*) FROM tasks") == [(0,)]
    finally:
        kill_job(proc)
        finish(proc, timeout=60)
    assert spent < 0.2 * window, f"3 waiting workers used {spent:.2f} s of CPU in {window:.2f} s"


def test_a_shell_opening_a_new_campaign_mid_run_costs_no_commit_at_a_kill_9(tmp_path):
    """A `sqlite3` shell (or `coordinator requeue`) that opens and closes a new campaign's
    file while its first master runs must leave that master's -wal alone. It did not: the
    master had dropped its POSIX lock on the file (`Store.open`), the shell's close deleted
    the -wal, and every commit after it went to a deleted file: a reader saw the counts
    frozen, and a kill -9 of the master lost them (131 of 238 results in the report)."""
    import contextlib
    import sqlite3

    db = tmp_path / "c.db"
    proc = start(["run", "--db", str(db), "--demo", "3000", "--demo-work-ms", "20",
                  "--batch", "1", "--no-progress"])
    try:
        wait_for(db, "SELECT count(*) FROM results", lambda n: bool(n and n >= 10),
                 timeout=120)
        with contextlib.closing(sqlite3.connect(db)) as shell:  # read-write, as `sqlite3 c.db`
            shell.execute("SELECT count(*) FROM tasks").fetchall()
        assert db.with_name("c.db-wal").exists(), "the shell deleted the master's -wal"
        after_shell = query(db, "SELECT count(*) FROM results")[0][0]
        seen = wait_for(db, "SELECT count(*) FROM results",
                        lambda n: bool(n and n >= after_shell + 30), timeout=60)
        os.kill(master_pid(db), signal.SIGKILL)
    finally:
        kill_job(proc)
    assert query(db, "SELECT count(*) FROM results")[0][0] >= seen


def test_a_worker_stopped_while_idle_does_not_stop_the_master_sending_it_work(tmp_path):
    """A WORK of a 1 MiB input to a rank that is not polling (stopped, swapped out, stuck
    before its next poll) is never taken. The master's send blocked until it was: the whole
    run froze, with no commit, and the watchdog that should retire that dispatch never ran
    (3 of 3 runs with the rank stopped while idle). Now the send leaves without waiting, the
    watchdog retires the dispatch 2 s later, and the run goes on."""
    target = write_target(tmp_path)
    afl = tmp_path / "afl_out"
    queue = afl / "main" / "queue"
    queue.mkdir(parents=True)
    (queue / "id:000000,time:0,execs:0,orig:seed").write_bytes(b"one")
    db = tmp_path / "c.db"
    proc = start(["run", "--db", str(db), "--afl-out", str(afl), "--fuzzer", "main",
                  "--no-feedback", "--watchdog", "2", "--batch", "1", "--no-progress",
                  # (a loaded machine may retire a dispatch more than once: never deferred)
                  "--retries", "16", "--max-attempts", "50", "--",
                  sys.executable, str(target), "@@"], np=3)
    stopped: list[int] = []
    try:
        master = master_pid(db)
        wait_for(db, "SELECT count(*) FROM results", lambda n: bool(n), timeout=120)
        workers = [p for p in ranks_of(db) if p != master]
        assert len(workers) == 2, workers
        for pid in workers:  # both idle now: the next WORK goes to a rank that does not poll
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        (queue / "id:000001,time:0,execs:0,orig:big").write_bytes(os.urandom(1 << 20))
        wait_for(db, "SELECT count(*) FROM events WHERE kind = 'watchdog'", lambda n: bool(n),
                 timeout=60)
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped.clear()
        wait_for(db, "SELECT count(*) FROM results", lambda n: bool(n and n >= 2), timeout=60)
        os.kill(master, signal.SIGTERM)
        done = finish(proc)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        kill_job(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    check_conservation(db)


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_campaign_file_removed_under_the_master_is_copied_back_whole(tmp_path):
    """`rm campaign.db` (or a /tmp cleaner) while a master ran: it went on in the file no name
    reached any more, finished with exit 0, and everything was lost at its exit. It now sees
    the name gone within a second, stops gracefully (in-flight work back to the queue),
    copies the database back to its name, and exits 3; `--resume` then finishes the
    campaign with every task committed once."""
    db = tmp_path / "c.db"
    args = ["run", "--db", str(db), "--demo", "400", "--demo-work-ms", "20", "--batch", "1",
            "--no-progress"]
    job = start(args, np=3)
    wait_for(db, "SELECT count(*) FROM results", lambda n: n >= 20)
    db.unlink()
    done = finish(job, timeout=120)
    assert done.returncode == ExitStatus.STORE, done.stderr[-3000:]
    assert f"{db} was removed while the master ran" in done.stderr
    assert f"was copied to {db}" in done.stderr
    copied = query(db, "SELECT count(*) FROM results")[0][0]
    assert copied >= 20 and query(db, "SELECT count(*) FROM dispatches")[0][0] == 0
    again = run([*args, "--resume"], np=3, timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    check_conservation(db, expected_tasks=400)


STUBBORN_TARGET = textwrap.dedent("""\
    import os, signal, sys, time
    # A target that finishes its run whatever it is sent (SymCC under a wrapper that traps
    # signals does): the graceful stop cannot end before the launcher ends the job.
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    hold = os.path.join(os.path.dirname(sys.argv[0]), "hold")
    if os.path.exists(hold):
        open(f"{hold}.{os.getpid()}", "w").close()
        time.sleep(600)
    """)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP],
                         ids=lambda s: s.name)
def test_a_time_limit_that_signals_mpiexec_too_charges_nothing(tmp_path, sig):
    """At a Slurm time limit (or `scancel`, `--signal=USR1@N`) every process of the job gets
    the signal: `mpiexec` too, which answers SIGTERM by ending its ranks within about 2 s,
    before the master's graceful stop (its grace, its wait for STOP_ACKs) can finish; SIGUSR1
    ended every rank at once (its default action). Each `--resume` then charged the runs left
    in flight an attempt, as after a crash: two time limits with `--max-attempts 2` held three
    healthy tasks `failed` (a review). The master now writes a `stop` event the moment it gets
    the signal, and the resume charges those runs nothing."""
    if sig is signal.SIGHUP and mpi_kind() != "openmpi":
        pytest.skip("MPICH's mpiexec has no SIGHUP handler: it dies of it and its proxies end "
                    "the ranks at once, before the master's own SIGHUP can be recorded (seen "
                    "here: no `stop` event); operations.md says those runs are charged")
    target = tmp_path / "stubborn.py"
    target.write_text(STUBBORN_TARGET)
    (tmp_path / "hold").touch()
    db = tmp_path / "c.db"
    args = ["run", "--db", str(db), "--tasks", str(_input_tasks(tmp_path, 3)),
            "--max-attempts", "2", "--grace", "3", "--stop-wait", "3", "--no-progress",
            "--", sys.executable, str(target), "@@"]
    targets: list[int] = []
    for time_limit in (1, 2):
        proc = start(args if time_limit == 1 else args[:1] + ["--resume"] + args[1:])
        try:
            # (wait_for launches it once more if Open MPI's launcher failed at its start.)
            wait_for(db, f"SELECT count(*) FROM dispatches WHERE incarnation = {time_limit}",
                     lambda n: n == 3)
            deadline = time.monotonic() + 60
            while len(held := list(tmp_path.glob("hold.*"))) < 3:
                assert time.monotonic() < deadline and proc.poll() is None, "no 3 targets"
                time.sleep(0.05)
            targets = [int(p.name.split(".")[1]) for p in held]
            for p in held:
                p.unlink()
            for pid in [proc.pid, *ranks_of(db), *targets]:  # every process, as Slurm does
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            finish(proc, timeout=90)  # (its status is the launcher's)
        finally:
            kill_job(proc)
            kill_ranks(db)
            for pid in targets:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        # (Ended by the launcher before its stop finished: its runs may still be in flight.)
        assert audit_path(db).violations == []
        assert query(db, "SELECT count(*) FROM results") == [(0,)]
        assert query(db, "SELECT attempts FROM tasks") == [(0,)] * 3
        assert query(db, "SELECT incarnation, detail FROM events WHERE kind = 'stop'")[-1] == (
            time_limit, sig.name)
    (tmp_path / "hold").unlink()
    again = run(["run", "--db", str(db), "--resume", "--no-progress"], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    check_conservation(db, expected_tasks=3)
    assert query(db, "SELECT status, count(*) FROM results GROUP BY 1") == [("ok", 3)]
    assert query(db, "SELECT sum(attempts) FROM tasks") == [(0,)]


BIG_OUTPUT_TARGET = textwrap.dedent("""\
    import os, sys, time
    here = os.path.dirname(sys.argv[0])
    n = open(sys.argv[1], "rb").read()
    if os.path.exists(os.path.join(here, "big")):
        if n == b"0":  # test cases (each under the 1 MiB kept) the output disk cannot hold
            for i in range(3):
                with open(os.path.join(os.environ["SYMCC_OUTPUT_DIR"], f"00000{i}"), "wb") as f:
                    f.write(bytes([i]) * 900_000)
        else:  # the others still running when the write fails
            open(os.path.join(here, f"hold.{os.getpid()}"), "w").close()
            time.sleep(600)
    """)


def test_an_output_directory_that_fills_up_charges_nothing(tmp_path, tiny_fs):
    """A test case the output directory has no room for stops the run (exit 3, nothing lost).
    Every run in flight then, the one whose test case could not be written included, was
    charged an attempt at `--resume`, as after a crash (a review). The master now records the
    stop (a `stop` event: the campaign file itself was writable), and the resume charges
    nothing."""
    target = tmp_path / "big.py"
    target.write_text(BIG_OUTPUT_TARGET)
    (tmp_path / "big").touch()
    db = tmp_path / "c.db"
    args = ["run", "--db", str(db), "--tasks", str(_input_tasks(tmp_path, 3)),
            "--out", str(tiny_fs / "out"), "--no-feedback", "--no-progress", "--",
            sys.executable, str(target), "@@"]
    targets: list[int] = []
    proc = start(args)
    try:
        done = finish(proc, timeout=120)
    finally:
        kill_job(proc)
        targets = [int(p.name.split(".")[1]) for p in tmp_path.glob("hold.*")]
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # (The job's status is the launcher's: the master's own, 3, is in its last line.)
    assert "cannot write output: [Errno 28]" in done.stderr, done.stderr[-3000:]
    assert query(db, "SELECT detail FROM events WHERE kind = 'stop'") == [
        ("the output directory could not be written",)]
    (tmp_path / "big").unlink()
    again = run(args[:1] + ["--resume"] + args[1:], timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    check_conservation(db, expected_tasks=3)
    assert query(db, "SELECT status, count(*) FROM results GROUP BY 1") == [("ok", 3)]
    assert query(db, "SELECT sum(attempts) FROM tasks") == [(0,)]
