"""The worker rank: the mirror image of the master's round (rule R1).

    READY(empty) -> loop: WORK(T) -> run -> RESULT(T) -> completed=T -> READY(T) -> clear
                          STOP(S) -> STOP_ACK(S) -> exit

Every exit path of a task (normal run, an input that cannot be materialised, an executor that
raises) sends its RESULT through the one sender, which always overwrites the token with the
authoritative one from WORK: a forged or stale token in a payload never survives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import msgspec

from .executors import BatchOutcome, ExecOutcome, Executor, not_run
from .processes import (
    STOP_SIGNALS,
    exit_now,
    host_and_pid,
    kill_running_commands,
    real_exit,
    teardown_when_safe,
)
from .protocol import is_token
from .transport import Backoff, MasterGone, SendFailed, Transport
from .wire import (
    ENCODE_ERRORS,
    INTERRUPTED_STATUS,
    NOT_RUN_STATUS,
    RETRY_STATUSES,
    SPLIT_STATUS,
    TAG_STOP,
    Ready,
    Result,
    Stop,
    TaskResult,
    Work,
    clip_detail,
    decode_stop,
    decode_work,
    encode,
)

log = logging.getLogger(__name__)

#: An idle worker re-sends its last READY (the last completed token, or empty) this often
#: while no WORK arrives.
HEARTBEAT_S = 5.0

#: The longest sleep between two polls of a waiting worker (after its `spin_s` of yielding):
#: a WORK waits at most this long to be noticed, a few FULL commits' time. Shorter sleeps of
#: many waiting ranks take the cores the master needs, more so the more ranks share a core
#: (docs/performance.md, "Many ranks").
WAIT_CAP_S = 1e-3

#: This worker's scratch directory while it serves (a teardown removes it too).
_scratch: list[Path] = []
#: The scratch directories' names begin so. Each holds SCRATCH_OWNER, which its rank keeps
#: open with an exclusive `flock` for its life ("HOST PID" inside, for a reader).
SCRATCH_PREFIX = "coordinator-rank"
SCRATCH_OWNER = ".owner"
#: An older version's scratch directory (no SCRATCH_OWNER) is removed once empty and this old:
#: a rank that has just made its own has not written its owner yet.
SCRATCH_OWNERLESS_AGE_S = 3600.0
#: The descriptor holding this rank's SCRATCH_OWNER lock (released by the kernel at its end).
_owner_fd: list[int] = []


def own_scratch(scratch_dir: Path) -> None:
    """Marks `scratch_dir` as a live rank's: SCRATCH_OWNER, held locked until the process
    ends, however it ends. Best effort: a full disk must leave the rank to answer `not_run`
    for its host, not end it here."""
    with contextlib.suppress(OSError):
        fd = os.open(scratch_dir / SCRATCH_OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            host, pid = host_and_pid()
            os.write(fd, f"{host} {pid}\n".encode())
        except OSError:
            os.close(fd)
            raise
        _owner_fd.append(fd)


def remove_orphaned_scratch(parent: Path) -> None:
    """A rank ended by SIGKILL (mpiexec's teardown, the OOM killer, a node's kill -9) cannot
    remove its scratch directory: measured, 4,467 were left in a test machine's /tmp in two
    days, each holding what its last command's run wrote (a SymCC run's outputs). Each start
    removes this user's whose SCRATCH_OWNER lock nobody holds. The lock, not the pid: a rank
    in another pid namespace sharing this /tmp and host name (a container) has a pid that
    does not exist here, and a pid may be reused."""
    now = time.time()
    for d in parent.glob(SCRATCH_PREFIX + "*"):
        try:
            st = d.lstat()
            if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid():
                continue
            try:
                fd = os.open(d / SCRATCH_OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                if now - st.st_mtime > SCRATCH_OWNERLESS_AGE_S:
                    d.rmdir()  # (only if empty)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its rank lives
            finally:
                os.close(fd)  # (a lock taken goes with it: the directory is removed next)
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue  # gone meanwhile, not empty, unreadable: not known to be orphaned


#: When this worker last received each of STOP_SIGNALS (monotonic).
_stop_signals_seen: dict[int, float] = {}

#: How long a worker whose command was killed by one of STOP_SIGNALS waits for the same signal
#: to reach itself: sent to every process of the job at once, it may reach the target first.
OWN_SIGNAL_WAIT_S = 0.5
#: How long before the command's end the worker's own signal may have come: one signal to the
#: whole job reaches its processes within moments; a worker signalled earlier on its own (an
#: operator's `kill` of one rank) does not make every later kill of its commands a stop's.
OWN_SIGNAL_BEFORE_S = 5.0


def note_stop_signal(signum: int, _frame: object = None) -> None:
    """The worker's handler of STOP_SIGNALS: the master decides when the job stops, so the
    worker goes on; only `cut_short` needs to know."""
    _stop_signals_seen[signum] = time.monotonic()


def cut_short(outcome: ExecOutcome, wait_s: float | None = None) -> ExecOutcome:
    """A command killed by a signal that stops the job, which this worker received too, did
    not fail: the job's stop cut its run short (Slurm's SIGTERM at a time limit or a
    `scancel` reaches the targets as well as the ranks). It was committed as an `error` result,
    the task done for ever. Now `interrupted`: the master retries it, charged nothing while it
    stops. What the run wrote is kept, as for a timeout. A command killed by such a signal
    that the worker did not receive (another cause: a user's `kill`) stays an `error`."""
    if outcome.status != "error" or outcome.returncode is None or outcome.returncode >= 0:
        return outcome
    signum = -outcome.returncode
    if signum not in STOP_SIGNALS:
        return outcome
    ended = time.monotonic()

    def shared() -> bool:
        return _stop_signals_seen.get(signum, -math.inf) >= ended - OWN_SIGNAL_BEFORE_S

    deadline = ended + (OWN_SIGNAL_WAIT_S if wait_s is None else wait_s)
    while not shared() and time.monotonic() < deadline:
        time.sleep(0.01)  # (the handler runs between two sleeps)
    if not shared():
        return outcome
    return dataclasses.replace(
        outcome, status=INTERRUPTED_STATUS,
        detail=clip_detail(f"cut short by the job's stop: {signal.Signals(signum).name} "
                           f"reached the command and its rank\n{outcome.detail}"))


def torn_down(signum: int, _frame: object) -> None:
    """TEARDOWN_SIGNAL handler: the running command's whole process group is killed (it runs
    in a session of its own: nothing else would end it, and it outlived the job), and the
    worker leaves at once. The master has killed the command already (`Master.fence`); this
    one covers a command being started right now, killed as soon as its group is known. A
    RESULT the worker sent for a command the master killed is never read: its task was
    requeued, never committed from a run cut short."""
    teardown_when_safe(lambda: _leave_now(signum))


def _leave_now(signum: int) -> None:
    kill_running_commands()
    for d in _scratch:
        shutil.rmtree(d, ignore_errors=True)
    real_exit(128 + signum)  # (not os._exit: a callable's call replaces it)


class Sender:
    """The worker's only way to send RESULT and READY (R1)."""

    def __init__(self, transport: Transport, max_message_bytes: int | None = None):
        self.transport = transport
        self.host, self.pid = host_and_pid()
        #: The master's bound on a message: a larger RESULT would be quarantined whole.
        self.max_message_bytes = max_message_bytes

    def result_message(self, token: str, outcome: ExecOutcome | BatchOutcome) -> Result:
        # The token is the authoritative one from WORK: nothing in the outcome can set it.
        batch = ([TaskResult(status=o.status, value=o.value, testcases=list(o.testcases),
                             returncode=o.returncode, duration_s=o.duration_s,
                             detail=clip_detail(o.detail), dropped=o.dropped)
                  for o in outcome.outcomes] if isinstance(outcome, BatchOutcome) else None)
        return Result(token=token, status=outcome.status, value=outcome.value,
                      testcases=list(outcome.testcases), returncode=outcome.returncode,
                      duration_s=outcome.duration_s, detail=clip_detail(outcome.detail),
                      dropped=outcome.dropped, batch=batch)

    def ready_message(self, completed: str) -> Ready:
        return Ready(rank=self.transport.rank, bitmap_version=0, empirical_profile_version="",
                     completed_dispatch_token=completed, host=self.host, pid=self.pid)

    def result_bytes(self, token: str, outcome: ExecOutcome | BatchOutcome) -> bytes:
        """The RESULT as sent. One the master could never accept (a string that is not
        Unicode, from a callable's value or the like; or more bytes than its bound) becomes an
        `error` result saying why: the task's outcome, committed once, instead of a worker
        that dies on every try or a message quarantined on every retry. In a batch, only the
        tasks whose own outcome is such become errors; if the others together are still over
        the bound, the RESULT asks the master to split the batch (`SPLIT_STATUS`): each of its
        outcomes would fit a message of its own, and none of them is lost."""
        data, why = self._encoded(self.result_message(token, outcome))
        if why is None:
            return data
        if not isinstance(outcome, BatchOutcome):
            return encode(self.result_message(token, _unsent(outcome, why)))
        kept = []
        for o in outcome.outcomes:
            _, own = self._encoded(self.result_message(token, o))
            kept.append(o if own is None else _unsent(o, own))
        data, why = self._encoded(self.result_message(token, BatchOutcome(kept)))
        if why is None:
            return data
        if len(kept) > 1:
            return encode(Result(token=token, status=SPLIT_STATUS, detail=clip_detail(why)))
        return encode(self.result_message(token, BatchOutcome([_unsent(kept[0], why)])))

    def _encoded(self, message: Result) -> tuple[bytes, str | None]:
        """The message's bytes, or why it cannot be sent."""
        try:
            data = encode(message)
        except ENCODE_ERRORS as e:
            return b"", f"the result cannot be sent: {type(e).__name__}: {e}"
        if self.max_message_bytes is not None and len(data) > self.max_message_bytes:
            return b"", (f"the result is {len(data)} bytes, over --max-message-bytes "
                         f"{self.max_message_bytes}: nothing of it was kept")
        return data, None

    def send_result(self, token: str, outcome: ExecOutcome | BatchOutcome) -> str:
        self.transport.send_result(self.result_bytes(token, outcome))
        return token

    def send_ready(self, completed: str) -> None:
        self.transport.send_ready(encode(self.ready_message(completed)))


def _unsent(outcome: ExecOutcome, why: str) -> ExecOutcome:
    """What is sent for a result the master could not accept: an `error` saying why (a run
    that is retried stays one, without its outputs: the master retries it as before)."""
    return ExecOutcome(status=outcome.status if outcome.status in RETRY_STATUSES else "error",
                       returncode=outcome.returncode, duration_s=outcome.duration_s,
                       detail=clip_detail(why), dropped=outcome.dropped + len(outcome.testcases))


class HostFailures:
    """A rank whose host cannot run tasks (its disk full, no process to be had) answers
    `not_run` at once, and would take task after task to the retry policy as fast as it can
    answer. After such an answer the worker waits before its READY, doubling up to its cap
    while its host keeps failing, so that the healthy ranks take more of the retries. (The
    master also holds such a rank back, and charges its later failures nothing while others
    run tasks: `coordinator.cooldown`.) A task that runs, whatever its outcome, ends the
    pause."""

    FIRST_PAUSE_S = 0.25
    PAUSE_CAP_S = 4.0

    def __init__(self, sleep: Callable[[float], None] = time.sleep,
                 stop_wait_s: float = 10.0) -> None:
        self.sleep = sleep
        self.streak = 0
        # A stop sends STOP once the rank's READY is seen and waits --stop-wait for its
        # acknowledgement: a pause must leave it time for both.
        self.cap = min(self.PAUSE_CAP_S, stop_wait_s / 2)

    def pause(self, outcome: ExecOutcome | BatchOutcome) -> float:
        """Sleeps as this answer calls for; returns how long."""
        runs = outcome.outcomes if isinstance(outcome, BatchOutcome) else [outcome]
        if any(o.status != NOT_RUN_STATUS for o in runs):
            self.streak = 0
            return 0.0
        wait = min(self.FIRST_PAUSE_S * 2 ** self.streak, self.cap)
        self.streak += 1
        self.sleep(wait)
        return wait


def run_work(executor: Executor, work: Work, scratch: Path) -> ExecOutcome | BatchOutcome:
    """The dispatch's task, or each of a batch's in order."""
    if work.batch is None:
        return run_task(executor, work.task, work.input, scratch)
    return BatchOutcome([run_task(executor, t.task, t.input, scratch) for t in work.batch])


def run_task(executor: Executor, task: dict, input_bytes: bytes | None,
             scratch: Path) -> ExecOutcome:
    # Creating and removing a directory costs more than a no-op task itself: only executors
    # that leave files get a fresh one.
    fresh = getattr(executor, "needs_workdir", True)
    try:
        workdir = _task_dir(scratch) if fresh else scratch
    except OSError as e:  # this host's disk, not the task: retried, and the rank lives on
        return not_run("cannot make the task's directory", e)
    try:
        return cut_short(executor.run(task, input_bytes, workdir))
    except Exception as e:  # the task failed, not the worker: report it as data
        return ExecOutcome(status="error", detail=f"{type(e).__name__}: {e}\n"
                                                  f"{traceback.format_exc(limit=5)}")
    finally:
        if fresh:
            shutil.rmtree(workdir, ignore_errors=True)


def _task_dir(scratch: Path) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix="dispatch-", dir=scratch))
    except FileNotFoundError:  # $TMPDIR cleaned under a long campaign: made again, once
        scratch.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="dispatch-", dir=scratch))


def answer_stop(transport: Transport, data: bytes | bytearray,
                scratch_dir: Path | None = None) -> int | None:
    """A STOP from the master: acknowledged with its exact token; the exit status, or None
    for a STOP that cannot be decoded (ignored). A STOP that says not to finalize (after a
    rank's death: MPI_Finalize could hang, ompi#11404), or any under ULFM, ends the process
    here."""
    try:
        stop = decode_stop(data)
    except msgspec.DecodeError as e:
        log.error("rank %d: undecodable STOP ignored: %s", transport.rank, e)
        return None
    transport.send_stop_ack(encode(Stop(token=stop.token)))
    if not stop.finalize or transport.fault_tolerant:
        # os._exit skips the caller's `finally`: without this every run left one scratch
        # directory per worker behind in $TMPDIR.
        if scratch_dir is not None:
            shutil.rmtree(scratch_dir, ignore_errors=True)
        exit_now(0)
    return 0


def serve(transport: Transport, executor: Executor, scratch: Path | None = None,
          sender: Sender | None = None, spin_s: float = 0.0, stop_wait_s: float = 10.0) -> int:
    """Run until STOP; returns the process exit status. If the master dies (ULFM reports
    it), exit at once: its database already holds everything, and --resume continues.

    `spin_s`: after each answer, poll for the next WORK this long without sleeping (yielding
    the CPU between polls), then sleep between polls (`--worker-spin-ms`). `stop_wait_s`:
    the master's --stop-wait, which bounds a broken host's pause (`HostFailures`)."""
    try:
        return _serve(transport, executor, scratch, sender, spin_s, stop_wait_s)
    except (MasterGone, SendFailed) as e:
        print(f"rank {transport.rank}: the master is gone ({e}); exiting", file=sys.stderr,
              flush=True)
        os._exit(1)


def _serve(transport: Transport, executor: Executor, scratch: Path | None,
           sender: Sender | None, spin_s: float, stop_wait_s: float = 10.0) -> int:
    sender = sender or Sender(transport)
    scratch_dir = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{transport.rank}-",
                                        dir=scratch))
    _scratch.append(scratch_dir)
    own_scratch(scratch_dir)
    with contextlib.suppress(OSError):
        remove_orphaned_scratch(scratch_dir.parent)
    backoff = Backoff(fast_cap=WAIT_CAP_S, cap=WAIT_CAP_S, yield_window=spin_s)
    host_failed = HostFailures(stop_wait_s=stop_wait_s)
    completed = ""  # R1: empty in the first READY
    last_completed = ""
    try:
        sender.send_ready(completed)
        while True:
            got = transport.wait_for_master(backoff, HEARTBEAT_S)
            if got is None:
                # No work for a while: say READY again, naming the last completed dispatch.
                # A READY the master could not use (lost, malformed, stale) would otherwise
                # leave this rank unused for ever; repeating the last token is safe in every
                # state (idle: accepted; parked on it: recovered; a newer dispatch: stale).
                sender.send_ready(last_completed)
                continue
            if got.tag == TAG_STOP:
                status = answer_stop(transport, got.data, scratch_dir)
                if status is None:
                    continue
                return status
            try:
                work = decode_work(got.data)
            except msgspec.DecodeError as e:
                print(f"rank {transport.rank}: protocol error: undecodable WORK ({e})",
                      file=sys.stderr, flush=True)
                continue
            if not is_token(work.token):
                # A protocol error on the worker: there is no token to echo, so no RESULT;
                # the master's watchdog retires the dispatch.
                print(f"rank {transport.rank}: protocol error: WORK token {work.token!r:.80} "
                      f"is not canonical", file=sys.stderr, flush=True)
                continue
            outcome = run_work(executor, work, scratch_dir)
            completed = sender.send_result(work.token, outcome)
            host_failed.pause(outcome)
            sender.send_ready(completed)
            last_completed, completed = completed, ""
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)

