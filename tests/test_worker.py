"""The worker's side of the protocol (coordinator/worker.py, rule R1) against a scripted master
(`fakes.WorkerSide`): what it runs, what it sends back, how it waits."""

from __future__ import annotations

from fakes import WorkerSide

from coordinator.executors import CommandExecutor


class _Counting:
    needs_workdir = False

    def __init__(self):
        self.calls = 0

    def run(self, task, input_bytes, workdir):
        from coordinator.executors import ExecOutcome
        self.calls += 1
        return ExecOutcome("ok", value={"token": "f" * 64, "echo": task})


def test_the_worker_runs_no_work_whose_token_is_not_canonical(tmp_path):
    """docs/protocol.md R1: a WORK whose token is not canonical is a protocol error on the worker:
    nothing runs and no RESULT is sent (there is no token to echo). A canonical one runs, and its
    RESULT carries the WORK's token, whatever the value holds (the single sender overwrites it),
    then READY echoes that token."""
    from coordinator.transport import Received
    from coordinator.wire import TAG_STOP, TAG_WORK, Stop, Work, encode
    from coordinator.worker import _serve
    good = "a" * 64
    side = WorkerSide([
        Received(0, TAG_WORK, encode(Work(token=good.upper(), task={"data": 1}))),
        Received(0, TAG_WORK, encode(Work(token=good[:-1], task={"data": 2}))),
        Received(0, TAG_WORK, encode(Work(token=good, task={"data": 3}))),
        Received(0, TAG_STOP, encode(Stop(token="b" * 64))),
    ])
    executor = _Counting()
    assert _serve(side, executor, tmp_path, None, 0.0) == 0
    assert executor.calls == 1
    assert [r["token"] for r in side.results] == [good]
    assert side.results[0]["value"] == {"token": "f" * 64, "echo": {"data": 3}}
    assert [r["completed_dispatch_token"] for r in side.readies] == ["", good]


def test_the_worker_waits_for_work_with_the_spin_window_it_was_given(tmp_path):
    """`--worker-spin-ms` reaches the worker's wait for WORK as its backoff's yield window."""
    from coordinator.transport import Received
    from coordinator.wire import TAG_STOP, TAG_WORK, Stop, Work, encode
    from coordinator.worker import serve
    side = WorkerSide([Received(0, TAG_WORK, encode(Work(token="a" * 64, task={"data": 1}))),
                        Received(0, TAG_STOP, encode(Stop(token="b" * 64)))])
    assert serve(side, _Counting(), tmp_path, spin_s=0.025) == 0
    assert [b.yield_window for b in side.backoffs] == [0.025, 0.025]


def test_a_result_the_master_could_not_accept_is_sent_as_an_error(tmp_path, workdir):
    """A file name that is not UTF-8 used to kill the worker in the encoder (every retry, and
    the whole job under MPICH); a callable's value with a lone surrogate did too."""
    from coordinator.executors import ExecOutcome
    from coordinator.wire import decode_inbound
    from coordinator.worker import Sender
    target = tmp_path / "odd.sh"
    target.write_text('#!/bin/sh\nprintf abc > "$SYMCC_OUTPUT_DIR/$(printf "bad\\377")"\n')
    target.chmod(0o755)
    out = CommandExecutor([str(target)], timeout_s=30).run({}, b"x", workdir)
    assert out.status == "ok" and out.testcases == [("bad\\xff", b"abc")]
    sender = Sender(None, max_message_bytes=4096)
    sent = decode_inbound(sender.result_bytes("a" * 64, out), 4096)
    assert sent["status"] == "ok" and sent["testcases"] == [["bad\\xff", b"abc"]]
    odd_value = ExecOutcome("ok", value={"k": "\udcff"})
    bad = decode_inbound(sender.result_bytes("a" * 64, odd_value), 4096)
    assert (bad["status"], bad["token"]) == ("error", "a" * 64)
    assert "cannot be sent" in bad["detail"]
    too_big = ExecOutcome("ok", value="x" * 5000, testcases=[("a", b"1"), ("b", b"2")],
                          dropped=3)
    big = decode_inbound(sender.result_bytes("a" * 64, too_big), 4096)
    assert big["status"] == "error" and "over --max-message-bytes 4096" in big["detail"]
    assert big["dropped"] == 5 and big["testcases"] == []  # its 2 and the 3 already dropped


def test_a_batch_too_large_for_one_result_asks_for_a_split_and_loses_no_outcome():
    """A batch of tasks whose values each fit a message but together do not was sent as an
    `error` for every task: good results committed as failures. Now only a task whose own
    outcome cannot be sent becomes an error; if the rest are still over the bound, the
    RESULT asks the master to split the batch, and says why."""
    from coordinator.executors import BatchOutcome, ExecOutcome
    from coordinator.wire import SPLIT_STATUS, decode_inbound
    from coordinator.worker import Sender

    sender = Sender(None, max_message_bytes=4096)
    token = "a" * 64

    def sent(*outcomes: ExecOutcome) -> dict:
        return decode_inbound(sender.result_bytes(token, BatchOutcome(list(outcomes))), 4096)

    fits = ExecOutcome("ok", value="x" * 1500)
    split = sent(fits, fits, fits)
    assert split["status"] == SPLIT_STATUS and split["token"] == token
    assert "batch" not in split or split["batch"] is None
    assert "over --max-message-bytes 4096" in split["detail"]
    # One task's own outcome cannot be sent: it alone is an error, the others are kept.
    odd = ExecOutcome("ok", value={"k": "\udcff"})
    kept = sent(fits, odd)
    assert [o["status"] for o in kept["batch"]] == ["ok", "error"]
    assert kept["batch"][0]["value"] == "x" * 1500
    assert "cannot be sent" in kept["batch"][1]["detail"]
    too_big = ExecOutcome("ok", value="x" * 5000)
    alone = sent(too_big, fits)
    assert [o["status"] for o in alone["batch"]] == ["error", "ok"]
    # A batch that fits is sent as it is.
    assert [o["value"] for o in sent(fits, fits)["batch"]] == ["x" * 1500] * 2


def test_a_long_explanation_keeps_its_first_line_the_exception():
    """The worker kept the last 2,000 characters of a run's explanation: a long traceback
    lost its first line, the exception itself. Its first line and tail are kept now, as the
    master keeps them."""
    from coordinator.executors import ExecOutcome
    from coordinator.wire import DETAIL_MAX_CHARS
    from coordinator.worker import Sender
    detail = "RuntimeError: the cause\n" + "".join(f"  frame {i}\n" for i in range(400))
    sent = Sender(None).result_message("a" * 64, ExecOutcome("error", detail=detail))
    assert sent.detail.startswith("RuntimeError: the cause\n…\n")
    assert sent.detail.endswith("frame 399\n") and len(sent.detail) <= DETAIL_MAX_CHARS


def test_a_scratch_directory_gone_from_under_the_worker_is_made_again_or_not_run(tmp_path):
    """`$TMPDIR` cleaned under a long campaign: before, the OSError of the task's directory
    left `run_task` and took the rank with it. The scratch directory is made again; where it
    cannot be (here a file in the way), the task is `not_run` and the rank lives on."""
    from coordinator.worker import run_task
    ex = CommandExecutor(["/bin/true"], timeout_s=5)
    gone = tmp_path / "gone" / "scratch"
    assert run_task(ex, {"data": 1}, b"x", gone).status == "ok"
    assert gone.is_dir()
    (tmp_path / "file").write_text("")
    out = run_task(ex, {"data": 1}, b"x", tmp_path / "file" / "scratch")
    assert out.status == "not_run"
    assert out.detail.startswith("cannot make the task's directory: Not a directory\n")


def test_a_host_that_keeps_failing_pauses_its_ready_longer_each_time_until_a_task_runs():
    from coordinator.executors import BatchOutcome, ExecOutcome
    from coordinator.worker import HostFailures
    slept: list[float] = []
    pauses = HostFailures(sleep=slept.append)
    not_run, ran = ExecOutcome("not_run"), ExecOutcome("error")
    for _ in range(7):
        pauses.pause(not_run)
    assert slept == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert pauses.pause(BatchOutcome([not_run, ran])) == 0.0  # part of it ran
    assert pauses.pause(BatchOutcome([not_run, not_run])) == 0.25  # and the streak starts over
    assert pauses.pause(ran) == 0.0 and pauses.pause(not_run) == 0.25
    # A stop waits --stop-wait for the rank's READY and acknowledgement: half of it at most.
    short = HostFailures(sleep=slept.append, stop_wait_s=1.0)
    assert [short.pause(not_run) for _ in range(4)] == [0.25, 0.5, 0.5, 0.5]


def test_a_command_the_jobs_stop_signal_killed_is_interrupted_not_an_error(tmp_path,
                                                                            monkeypatch):
    """A batch system's SIGTERM reaches the targets as well as the ranks: a command killed by
    it was committed as an `error` result. When the worker got the same signal (its handler
    notes it), the run was cut short: `interrupted`, its test cases kept. The same kill with
    no such signal to the worker (a user's `kill` of the target), or with one the worker got
    long before (a `kill` of that rank alone), stays an `error`; so does any other signal."""
    import signal

    import coordinator.worker as worker
    from coordinator.worker import note_stop_signal, run_task
    monkeypatch.setattr(worker, "_stop_signals_seen", {})
    monkeypatch.setattr(worker, "OWN_SIGNAL_WAIT_S", 0.05)
    target = tmp_path / "killed.sh"
    target.write_text('#!/bin/sh\nprintf found > "$SYMCC_OUTPUT_DIR/a"\nkill -"$1" $$\n')
    target.chmod(0o755)

    def run(sig: str):
        ex = CommandExecutor([str(target), sig], timeout_s=30)
        return run_task(ex, {"data": 1}, b"x", tmp_path / "scratch")

    assert (run("TERM").status, run("TERM").returncode) == ("error", -signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, note_stop_signal)
    try:
        signal.raise_signal(signal.SIGTERM)  # (the handler notes it: nothing else happens)
        out = run("TERM")
        assert out.status == "interrupted" and out.testcases == [("a", b"found")]
        assert out.detail.startswith("cut short by the job's stop: SIGTERM reached the "
                                     "command and its rank\ntarget killed by SIGTERM")
        assert run("INT").status == "error"  # (its rank got no SIGINT)
        assert run("KILL").status == "error"
        worker._stop_signals_seen[signal.SIGTERM] -= worker.OWN_SIGNAL_BEFORE_S + 1
        assert run("TERM").status == "error"  # (the rank's SIGTERM came long before)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_retried_run_too_large_to_send_is_still_retried_not_committed_as_an_error():
    """A run whose RESULT is over the master's bound is sent without its outputs. A timeout
    stayed one; an `interrupted` or `not_run` run became an `error`, committed: its task
    done for ever, as before those statuses existed."""
    from coordinator.executors import ExecOutcome
    from coordinator.wire import decode_inbound
    from coordinator.worker import Sender
    sender = Sender(None, max_message_bytes=4096)
    for status in ("timeout", "interrupted", "not_run", "error", "ok"):
        big = ExecOutcome(status, testcases=[("a", b"x" * 10_000)])
        sent = decode_inbound(sender.result_bytes("a" * 64, big), 4096)
        assert sent["status"] == ("error" if status == "ok" else status), status
        assert sent["testcases"] == [] and "over --max-message-bytes" in sent["detail"]


def test_a_start_removes_the_scratch_directories_of_ranks_that_are_gone(tmp_path):
    """A rank ended by SIGKILL leaves its scratch directory (and what its last run wrote):
    4,467 had piled up in a test machine's /tmp in two days. A start removes those whose
    owner lock nobody holds, and nothing of a live rank: not by its pid, which a rank in
    another pid namespace (a container sharing /tmp) does not have here."""
    import os
    import subprocess
    import sys
    import time

    from coordinator.worker import SCRATCH_OWNER, own_scratch, remove_orphaned_scratch

    def scratch(name: str, *, files: bool = False, age_s: float = 0.0, owner: bool = True):
        d = tmp_path / f"coordinator-rank{name}"
        d.mkdir()
        if owner:  # as a rank that ended left it: written, its lock gone with it
            (d / SCRATCH_OWNER).write_text("elsewhere 1\n")
        if files:
            (d / "dispatch-x").mkdir()
            (d / "dispatch-x" / "out").write_bytes(b"a SymCC run's output")
        if age_s:
            os.utime(d, (time.time() - age_s,) * 2)
        return d

    dead = scratch("1-dead", files=True)
    live = tmp_path / "coordinator-rank2-live"
    live.mkdir()
    # A live rank, whatever its pid: another process holding its directory's owner lock.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from coordinator.worker import own_scratch; "
         f"own_scratch(Path({str(live)!r})); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        (live / "dispatch-y").mkdir()
        old_empty = scratch("4-old", owner=False, age_s=7200)
        new_empty = scratch("5-new", owner=False)
        old_full = scratch("6-full", owner=False, files=True, age_s=7200)
        foreign = tmp_path / "unrelated"
        foreign.mkdir()
        mine = tmp_path / "coordinator-rank7-mine"
        mine.mkdir()
        own_scratch(mine)  # this process's own: held too
        remove_orphaned_scratch(tmp_path)
        assert not dead.exists() and not old_empty.exists()
        assert (live / "dispatch-y").exists() and mine.exists()
        assert new_empty.exists() and old_full.exists() and foreign.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    remove_orphaned_scratch(tmp_path)  # its rank gone: removed at the next start
    assert not live.exists() and mine.exists()
