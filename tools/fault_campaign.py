"""Fault campaign: M trials of real `mpiexec` jobs with random fault plans, each checked from
its database alone.

    python tools/fault_campaign.py                              # 200 trials, 40 tasks, 3 workers
    python tools/fault_campaign.py --trials 20 --seed 7 --json r.json --markdown r.md

Each trial is a fresh campaign: `coordinator run --demo T` under `mpiexec -n W+1` with a plan of
1–4 fault kinds (`--inject`, rates 0.02–0.3, log-uniform) drawn from a seeded RNG; every kind
leads a trial once per 20 trials (17 injected kinds, 3 of the harness's own, below), so a long
campaign covers all of them. In `--kill-fraction` of the trials the harness SIGKILLs the whole
job once at a random moment: once a random number of results has committed, or by wall time,
0 to T × work-ms / W seconds after the launch's first committed result (timed from the spawn,
most such kills fell in MPI's start, before the campaign file existed); the trial records
where it landed (`kill_landed`; *mid-run*: after a result of that launch, dispatches in flight).
Whatever ends a job — its own exit, a worker's injected SIGKILL (which takes an Open MPI job
without ULFM down), the harness's kill, the per-job time limit, or a stall (every worker
SIGSTOPped by `hang` with nothing in flight) — the harness kills what is left of it (every rank
found in /proc by the database path, then mpiexec's process group: Open MPI gives each rank a
process group of its own) and reruns the same command with `--resume`, until the master reports
the campaign finished or `--max-restarts` is exhausted (an *incomplete* trial: it fails the
run, a campaign that cannot finish; `--allow-incomplete` only reports it).

Three more kinds are the harness's own, made beside the job (the coordinator runs its
ordinary code): `held_lock` (an operator's `BEGIN IMMEDIATE` held 1–12 s while the master runs,
every trial with `--lock-wait 30`; the 1st, 5th, 9th... such trial holds 5 s against
`--lock-wait 2`: the master must stop with exit 3, and is resumed), `aliased_file` (a hard link
`alias.db` to the campaign file; `run --resume`, `status` and `check` on it, at once, while the
master runs, must each exit 2 saying "has 2 names" and make nothing beside it; the link is then
removed) and `startup_crash` (one worker rank SIGKILLed 20–200 ms after the master recorded its
pid, before its start verdict: without ULFM the job ends and is resumed; the 1st, 4th, 7th...
such trial runs all its jobs under ULFM, where the run must go on without the rank). A lasting
fault (a hold, the commands on the alias) is over before the next launch.

Each resumed run gets `--inject-seed base+run` (the worker RNGs restart at every launch, so
with one seed every incarnation would replay the same faults in the same places);
`--same-inject-seed` keeps the seed fixed instead.

After a trial, read-only from the database (plus the inject logs): every one of the T tasks
exists and is done, deferred or failed, none active, no dispatch or lease rows; every dispatch
has one record (its results row, or a `dispatched` event if it ended without a result); every
result's (task, rank, token) is a dispatch's that was never rolled back: the token is
`mint_token(epoch, rank, seq)` of the result's own incarnation and rank (each incarnation's
epoch read by the harness after each job: the file keeps only the last), every other record
of the token (another task's result or `dispatched` event: a batch) names the same rank,
incarnation and dispatch time, and no event rolled it back, for its task (recovered / watchdog
/ interrupted / stop_requeued / task_failed / send_failed / worker_failed / split) or as a
whole dispatch; every result carries its own task's value, and is not a token whose RESULT
was never validly sent (a breaking fault fired on it); one result per task (the schema allows
no other), only for done tasks;
`PRAGMA integrity_check` ok; `coordinator status --json` equals SQL counts over the rows.
The rules that hold for any campaign are `store.audit`'s; this tool adds what only it knows
(the T tasks and their values, the faults it injected, a finished run's end state), and
judges its own kinds (`check_harness_faults`): the exit statuses and lines each must or must
not cause (the master's own status read beside `--master-pid-file`), nothing left beside the
alias, a ULFM run going on.

Exit status 1 if any trial lost a task, committed wrongly or twice, failed integrity, left
dispatch/lease rows behind, had statistics disagreeing with its rows, failed one of its
kinds' own checks, had result tokens it could not check (an epoch unknown) or was incomplete
(unless `--allow-incomplete`); else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import Connection  # noqa: E402
from sqlalchemy.exc import DBAPIError  # noqa: E402

from coordinator.config import MAX_BATCH, int_range  # noqa: E402
from coordinator.exits import ExitStatus  # noqa: E402
from coordinator.faults import KINDS  # noqa: E402
from coordinator.launcher import (  # noqa: E402
    LAUNCHER_FAILED,
    exit_status_path,
    find_mpiexec,
    mpiexec_flags,
)
from coordinator.protocol import mint_token  # noqa: E402
from store.audit import Check, ViolationKind, audit  # noqa: E402
from store.engine import open_readonly  # noqa: E402
from store.errors import NoCampaignYet, StoreError  # noqa: E402
from store.schema import COUNTED_KIND_SQL  # noqa: E402

#: Faults of the operator's environment that this harness makes itself, beside the job (no
#: `--inject` kind: the coordinator runs its ordinary code).
HARNESS_KINDS: dict[str, str] = {
    "held_lock": "an operator's write transaction (BEGIN IMMEDIATE) held 1-12 s while the "
                 "master runs; in 1 of 4 such trials 5 s against --lock-wait 2: exit 3, resumed",
    "aliased_file": "a hard link alias.db to the campaign file while the master runs; run, "
                    "status and check on it must each refuse it (exit 2, 'has 2 names')",
    "startup_crash": "one worker rank SIGKILLed 20-200 ms after the master recorded its pid, "
                     "before its start verdict; 1 in 3 such trials run under ULFM",
}
INJECT_KINDS: tuple[str, ...] = tuple(KINDS)
ALL_KINDS: tuple[str, ...] = INJECT_KINDS + tuple(HARNESS_KINDS)

#: --lock-wait of every trial but the ones whose held lock must outlast it: longer than any hold.
LOCK_WAIT_S = 30.0
#: The 1st, (1 + SHORT_EVERY)th, ... held_lock trials hold past their --lock-wait (exit 3).
SHORT_LOCK_WAIT_S, SHORT_HOLD_S, SHORT_EVERY = 2.0, 5.0, 4
HOLD_MIN_S, HOLD_MAX_S = 1.0, 12.0
#: The 1st, (1 + ULFM_EVERY)th, ... startup_crash trials run under ULFM (the run goes on).
ULFM_EVERY = 3
#: The second name of the campaign file in an aliased_file trial.
ALIAS_NAME = "alias.db"
#: What every command says when it refuses a file with a second name.
ALIAS_REFUSAL = "has 2 names"

#: Kinds after which the dispatch normally cannot commit from its own RESULT: the master must
#: roll it back (recovered, watchdog, or interrupted at the next --resume). Recovery latency is
#: measured from these.
BREAKING: frozenset[str] = frozenset({
    "result_missing_token", "result_bad_token", "result_list_token", "result_not_mapping",
    "result_garbage", "result_stale", "result_drop", "kill_before_result", "kill_after_result",
    "hang", "not_run"})
#: Kinds whose dispatch never sent a valid RESULT: a commit of such a token is a wrong commit.
#: Not `kill_after_result` (its RESULT left intact before the kill) and not `hang`: a stopped
#: worker that gets SIGCONT sends its RESULT late but validly — which happens for real when
#: mpiexec dies first: each rank is its own process group, orphaned when mpiexec exits, and
#: the kernel sends SIGHUP+SIGCONT to a stopped member of an orphaned process group.
NEVER_VALIDLY_SENT: frozenset[str] = BREAKING - {"kill_after_result", "hang"}

#: Events that mark a task as recovered (for the recovery rate and latency). `stop_requeued`
#: too: under Open MPI a worker's death makes the launcher SIGTERM the master, whose graceful
#: stop may return the dead worker's dispatch to the queue before the launcher's SIGKILL.
CAUSE_KINDS = ("recovered", "watchdog", "interrupted", "task_failed", "stop_requeued")
#: What follows a cause event for the same task: the task is back in the queue (or held).
FOLLOW_KINDS = ("requeued", "deferred", "failed", "retried", "task_deferred", "defer_failed")

FINISHED_MARK = "this run committed"  # the master's last line after a drained campaign
#: ... which a master that stopped with work left prints too (every worker dead under ULFM,
#: exit 6): the campaign is drained only with nothing queued.
FINISHED_LINE = re.compile(r"campaign: \d+ done, (\d+) queued")
RATE_MIN, RATE_MAX = 0.02, 0.3


# -- plans ---------------------------------------------------------------------------------

@dataclass
class KillPlan:
    mode: str            # "time": at_s after the launch's first result; "progress": once
    at_s: float = 0.0    # `after_results` have committed (+ delay_s)
    after_results: int = 0
    delay_s: float = 0.0


@dataclass
class LockPlan:
    """held_lock: once `after_results` results have committed (+ `delay_s`), hold the
    campaign's write lock `hold_s`; the trial runs with --lock-wait `lock_wait_s`."""
    after_results: int
    delay_s: float
    hold_s: float
    lock_wait_s: float

    @property
    def outlasts(self) -> bool:
        """The hold is longer than the master waits: it must stop (exit 3)."""
        return self.hold_s > self.lock_wait_s


@dataclass
class AliasPlan:
    """aliased_file: once `after_results` results have committed (+ `delay_s`)."""
    after_results: int
    delay_s: float


@dataclass
class StartupPlan:
    """startup_crash: SIGKILL worker `rank` `delay_s` after the master recorded its pid (before
    its start verdict); `ulfm`: every job of the trial runs under ULFM."""
    rank: int
    delay_s: float
    ulfm: bool


@dataclass
class TrialPlan:
    index: int
    rates: dict[str, float]
    inject_seed: int
    kill: KillPlan | None
    lock: LockPlan | None = None
    alias: AliasPlan | None = None
    startup: StartupPlan | None = None
    batch: int = 1       # --batch: tasks per dispatch; AUTO: --batch auto

    def inject_spec(self) -> str:
        return ",".join(f"{k}={r:g}" for k, r in self.rates.items())

    @property
    def kinds(self) -> list[str]:
        """Every fault kind of the plan: the injected ones, then the harness's own."""
        return [*self.rates, *(k for k, p in (("held_lock", self.lock),
                                              ("aliased_file", self.alias),
                                              ("startup_crash", self.startup)) if p)]

    @property
    def ulfm(self) -> bool:
        return bool(self.startup and self.startup.ulfm)

    @property
    def lock_wait_s(self) -> float:
        return self.lock.lock_wait_s if self.lock else LOCK_WAIT_S

    def label(self) -> str:
        """The plan in one line: the --inject spec, then the harness's kinds."""
        parts = [self.inject_spec()] if self.rates else []
        if self.lock:
            parts.append(f"held_lock={self.lock.hold_s:g}s/lock-wait={self.lock.lock_wait_s:g}")
        if self.alias:
            parts.append("aliased_file")
        if self.startup:
            parts.append(f"startup_crash=rank{self.startup.rank}"
                         + ("/ulfm" if self.startup.ulfm else ""))
        if self.batch != 1:
            parts.append(f"batch={batch_arg(self.batch)}")
        return ",".join(parts)


#: The batch sizes a batched trial draws from (`--batch-fraction`): a broken dispatch of
#: several tasks is split in halves and requeued uncharged, so every kind also meets that path.
BATCH_SIZES = (2, 4, 8, 16)
#: A trial's `batch` for `--batch auto` (sized by the master from the tasks' run time, the
#: default for demo tasks): `--batch-sizes auto`.
AUTO = 0


def batch_arg(batch: int) -> str:
    """`--batch`'s value for a plan's batch."""
    return "auto" if batch == AUTO else str(batch)


def batch_sizes(text: str) -> tuple[int, ...]:
    """`--batch-sizes 2,4,auto`: sizes of 2..1000, or auto."""
    size = int_range(2, MAX_BATCH)
    return tuple(AUTO if part.strip() == "auto" else size(part.strip())
                 for part in text.split(","))


def draw_plans(n: int, seed: int, tasks: int, kill_fraction: float,
               workers: int = 3, batch_fraction: float = 0.0,
               sizes: tuple[int, ...] = BATCH_SIZES, work_ms: float = 20.0) -> list[TrialPlan]:
    """`n` trial plans from one seeded RNG. Each plan's first kind comes from a shuffled deck
    of all kinds (refilled when empty), so every kind leads one trial in each run of
    len(ALL_KINDS) trials; 0–3 more distinct kinds join it. Rates of injected kinds are
    log-uniform in 0.02–0.3; the harness's kinds draw their moment (a number of committed
    results, 0 to tasks-1 — below tasks/2 for a hold past --lock-wait — plus up to 50 ms),
    hold, victim rank and MPI mode. A wall-time kill comes 0 to tasks × work_ms / workers
    (the least the work can last) after the launch's first result. A share
    `batch_fraction` of the trials run with `--batch` (one of `sizes`), drawn from an RNG
    of its own so that the rest of each plan is the same whatever the share."""
    rng = random.Random(seed)
    batches = random.Random(f"batch:{seed}")
    deck: list[str] = []
    plans = []
    locks = startups = 0
    for i in range(n):
        if not deck:
            deck = list(ALL_KINDS)
            rng.shuffle(deck)
        kinds = [deck.pop()]
        extra = rng.randint(1, 4) - 1
        kinds += rng.sample([k for k in ALL_KINDS if k != kinds[0]], extra)
        rates = {k: round(math.exp(rng.uniform(math.log(RATE_MIN), math.log(RATE_MAX))), 3)
                 for k in kinds if k in KINDS}
        lock = alias = startup = None
        if "held_lock" in kinds:
            at, delay = rng.randint(0, max(0, tasks - 1)), round(rng.uniform(0.0, 0.05), 3)
            hold = round(rng.uniform(HOLD_MIN_S, HOLD_MAX_S), 2)
            locks += 1
            if locks % SHORT_EVERY == 1:
                # In the first half of the results: a hold near the end can start after the
                # last commit, when the master no longer has to write, and prove nothing.
                lock = LockPlan(at % max(1, tasks // 2), delay, SHORT_HOLD_S, SHORT_LOCK_WAIT_S)
            else:
                lock = LockPlan(at, delay, hold, LOCK_WAIT_S)
        if "aliased_file" in kinds:
            alias = AliasPlan(rng.randint(0, max(0, tasks - 1)), round(rng.uniform(0.0, 0.05), 3))
        if "startup_crash" in kinds:
            startups += 1
            startup = StartupPlan(rng.randint(1, max(1, workers)),
                                  round(rng.uniform(0.02, 0.2), 3), startups % ULFM_EVERY == 1)
        kill = None
        if rng.random() < kill_fraction:
            if rng.random() < 0.3:
                span = tasks * work_ms / 1000 / max(1, workers)
                kill = KillPlan("time", at_s=round(rng.uniform(0.0, span), 3))
            else:
                kill = KillPlan("progress", after_results=rng.randint(1, max(1, tasks - 1)),
                                delay_s=round(rng.uniform(0.0, 0.05), 3))
        batch = (batches.choice(sizes) if batches.random() < batch_fraction else 1)
        plans.append(TrialPlan(i, rates, rng.randrange(1, 2**31), kill, lock, alias, startup,
                               batch))
    return plans


# -- running jobs ---------------------------------------------------------------------------

@dataclass
class Options:
    tasks: int = 40
    workers: int = 3
    work_ms: float = 20.0
    watchdog_s: float = 2.0
    timeout_per_job: float = 30.0
    max_restarts: int = 20
    same_inject_seed: bool = False
    ulfm: bool = True    # the MPI has ULFM (Open MPI): else a plan's ULFM share runs without
    allow_incomplete: bool = False  # a trial that never finished is reported, not failed


@dataclass
class JobRun:
    run: int
    resume: bool
    inject_seed: int
    ended_by: str        # exit | harness_kill | timeout | stall | launcher_failed
    exit_code: int | None
    seconds: float
    finished: bool       # the master reported the campaign finished
    results_after: int | None = None     # committed results when the job had ended
    in_flight_after: int | None = None   # dispatch rows it left behind
    started_at: float | None = None      # wall clock (time.time()) at launch
    master_exit: int | None = None       # the status the master recorded (None: it was killed)
    # The campaign's incarnation and token epoch when the job had ended: each start replaces
    # the epoch in the file, and the check needs every incarnation's to recompute its tokens.
    incarnation: int | None = None
    epoch: str | None = None


_MPIEXEC: str | None = None
_FLAGS: dict[tuple[int, bool], list[str]] = {}


def mpiexec_command(np: int, args: list[str], ulfm: bool = False) -> list[str]:
    """Open MPI without ULFM unless `ulfm` (a startup_crash trial's share): a dead rank then
    costs that rank only."""
    global _MPIEXEC
    if _MPIEXEC is None:
        _MPIEXEC = find_mpiexec()
        if _MPIEXEC is None:
            raise SystemExit("fault_campaign: no mpiexec beside this Python or on PATH")
    if (np, ulfm) not in _FLAGS:
        _FLAGS[np, ulfm] = mpiexec_flags(_MPIEXEC, np, ulfm=ulfm)
    return [_MPIEXEC, *_FLAGS[np, ulfm], sys.executable, "-m", "coordinator", *args]


def inject_seed_of(plan: TrialPlan, opts: Options, run: int) -> int:
    return plan.inject_seed if opts.same_inject_seed else plan.inject_seed + run


def run_args(db: Path, plan: TrialPlan, opts: Options, inject_dir: Path, run: int,
             pid_file: Path | None = None) -> list[str]:
    """The job's command line; `pid_file`: where the master records its pid, and beside it
    (`exit_status_path`) the status it ends with (what the held_lock checks read)."""
    args = ["run", "--db", str(db), "--demo", str(opts.tasks), "--demo-work-ms",
            f"{opts.work_ms:g}"]
    if plan.rates:
        args += ["--inject", plan.inject_spec(), "--inject-seed",
                 str(inject_seed_of(plan, opts, run)), "--inject-log", str(inject_dir)]
    args += ["--watchdog", f"{opts.watchdog_s:g}", "--lock-wait", f"{plan.lock_wait_s:g}",
             "--retries", "16", "--max-attempts", "50", "--grace", "1", "--stop-wait", "3",
             "--no-progress"]
    # Always said: demo tasks are batched automatically unless --batch says otherwise, and a
    # plain trial's faults are meant to hit one task each.
    args += ["--batch", batch_arg(plan.batch)]
    if pid_file is not None:
        args += ["--master-pid-file", str(pid_file)]
    if run > 0:
        args.append("--resume")
    return args


def _ro(db: Path, timeout: float = 2.0) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=timeout)


def _row(db: Path, sql: str) -> tuple | None:
    """One row read from a running campaign, or None if it cannot be read (yet)."""
    if not db.exists():
        return None
    try:
        c = _ro(db)
        try:
            return c.execute(sql).fetchone()
        finally:
            c.close()
    except sqlite3.Error:
        return None


def _scalar(db: Path, sql: str) -> Any:
    row = _row(db, sql)
    return row[0] if row else None


def ranks_of(db: Path) -> list[int]:
    """PIDs of processes of this campaign's job (mpiexec and ranks), found by the db path."""
    needle = str(db).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"coordinator" in cmd and needle in cmd:
            pids.append(int(entry.name))
    return pids


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def kill_everything(proc: subprocess.Popen, db: Path) -> None:
    """The whole job at once: every rank first, then mpiexec's process group.

    Open MPI puts each rank in a process group of its own, so killing mpiexec's group alone
    leaves the ranks running until they notice the launcher is gone (up to a second here),
    and a SIGSTOPped rank is even continued by the kernel (orphaned process group): the
    master could commit in between. With every rank killed first, the job dies as one."""
    for pid in ranks_of(db):
        if pid != proc.pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = ranks_of(db)
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


class DbMonitor:
    """A read-only view of a running campaign for the harness's triggers: one autocommit
    connection (every SELECT its own snapshot, none held open), opened only once the master
    has the file in WAL mode (a reader's lock must never make its switch to WAL fail)."""

    def __init__(self, db: Path):
        self.db = db
        self.conn: sqlite3.Connection | None = None

    def scalar(self, sql: str) -> Any:
        if self.conn is None:
            if not self.db.with_name(self.db.name + "-wal").exists():
                return None
            try:
                self.conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=0.5,
                                            isolation_level=None)
            except sqlite3.Error:
                return None
        try:
            row = self.conn.execute(sql).fetchone()
            return row[0] if row else None
        except sqlite3.Error:
            self.close()
            return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class AfterResults:
    """Due `delay_s` after the campaign has `after` committed results (polled every 5 ms;
    with `after` 0, as soon as the master has created the campaign)."""

    def __init__(self, after: int, delay_s: float):
        self.after, self.delay_s = after, delay_s
        self._deadline: float | None = None
        self._next_poll = 0.0

    def due(self, mon: DbMonitor) -> bool:
        now = time.monotonic()
        if self._deadline is not None:
            return now >= self._deadline
        if now >= self._next_poll:
            self._next_poll = now + 0.005
            n = mon.scalar("SELECT count(*) FROM results")
            if n is not None and n >= self.after:
                self._deadline = now + self.delay_s
        return False


class KillTrigger:
    """The harness's one SIGKILL of a trial, pending until it fires (across runs).

    A wall-time kill is timed from the launch's first committed result, not from the spawn:
    MPI's start and the imports take ~2 s here and 20 tasks' work ~0.2 s, so a kill timed
    from the spawn mostly landed before the campaign file existed, and tested only a start.
    A result of this launch means its master is past its start and restart recovery, with
    the other ranks' dispatches in flight. `landed` records where the kill fell."""

    def __init__(self, plan: KillPlan | None):
        self.plan = plan
        self.fired = False
        self.landed: dict[str, Any] | None = None
        self._progress = (AfterResults(plan.after_results, plan.delay_s)
                          if plan is not None and plan.mode == "progress" else None)
        self._before = 0                     # results committed before this launch
        self._started: float | None = None   # when this launch's first result was seen
        self._next_poll = 0.0

    def launch(self, results_before: int) -> None:
        """A new job starts, the campaign holding `results_before` results."""
        self._before, self._started, self._next_poll = results_before, None, 0.0

    def due(self, mon: DbMonitor) -> bool:
        p = self.plan
        if p is None or self.fired:
            return False
        if p.mode == "progress":
            assert self._progress is not None
            return self._progress.due(mon)
        now = time.monotonic()
        if self._started is None and now >= self._next_poll:
            self._next_poll = now + 0.005
            if (mon.scalar("SELECT count(*) FROM results") or 0) > self._before:
                self._started = now
        return self._started is not None and now - self._started >= p.at_s

    def fire(self, mon: DbMonitor, run: int, elapsed: float) -> None:
        """Say where the kill lands (just before it): `after_start`, a result of this launch
        had committed; `in_flight`, the dispatch rows then (mid-run: both)."""
        self.fired = True
        results = mon.scalar("SELECT count(*) FROM results")
        after = results is not None and results > self._before
        # (once this launch has committed, its start's restart recovery has retired the dead
        # incarnation's dispatch rows: those left are its own)
        in_flight = mon.scalar("SELECT count(*) FROM dispatches") if after else None
        self.landed = {"run": run, "elapsed_s": round(elapsed, 3), "after_start": after,
                       "since_first_result_s": None if self._started is None
                       else round(time.monotonic() - self._started, 3),
                       "results": results, "in_flight": in_flight,
                       "mid_run": bool(after and in_flight)}


# -- the harness's own faults: held lock, aliased file, start-up crash ----------------------

@dataclass
class JobContext:
    """What a harness fault sees of the job it acts on."""
    proc: subprocess.Popen
    db: Path
    mon: DbMonitor
    run: int
    pid_file: Path | None = None
    _master: int | None = None

    def master_pid(self) -> int | None:
        """The master's pid once it has recorded it (past MPI_Init), else None."""
        if self._master is None and self.pid_file is not None:
            try:
                text = self.pid_file.read_text().strip()
            except OSError:
                return None
            self._master = int(text) if text.isdigit() else None
        return self._master

    def master_alive(self) -> bool:
        pid = self.master_pid()
        return pid is not None and _alive(pid)


def _alive(pid: int) -> bool:
    """Running (not a zombie: a killed master is one until mpiexec reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


#: Where a rank finds its number in its environment: Open MPI's launcher, MPICH's Hydra.
RANK_VARIABLES = (b"OMPI_COMM_WORLD_RANK=", b"PMI_RANK=")


def _rank_of(pid: int) -> int | None:
    """The MPI rank of a process of the job, from its environment (None if not a rank)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for var in env:
        if var.startswith(RANK_VARIABLES):
            value = var.partition(b"=")[2]
            return int(value) if value.isdigit() else None
    return None


class HarnessFault:
    """One fault of the harness's own in a trial: pending (across runs) until its moment,
    then done once, in a thread of its own if it lasts (`settle` waits for it before the
    next launch or the check). `record` says what happened; None while it has not."""

    kind = ""

    def __init__(self) -> None:
        self.record: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None

    def poll(self, job: JobContext) -> None:
        raise NotImplementedError

    def _in_thread(self, body, *args) -> None:
        def guarded() -> None:
            assert self.record is not None
            try:
                body(*args)
            except Exception as e:  # noqa: BLE001 -- said in the record, judged a problem
                self.record["error"] = f"{type(e).__name__}: {e}"
        self._thread = threading.Thread(target=guarded, name=self.kind, daemon=True)
        self._thread.start()

    def settle(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """The trial is over (after `settle`): anything of the fault's still running ends."""


class HeldLock(HarnessFault):
    """held_lock: what an operator's `sqlite3` shell does with `BEGIN IMMEDIATE`: the write
    lock taken (waiting for the master's transaction, if one is open), held, rolled back."""

    kind = "held_lock"

    def __init__(self, plan: LockPlan | None, db: Path):
        super().__init__()
        self.plan, self.db = plan, db
        self._due = AfterResults(plan.after_results, plan.delay_s) if plan else None

    def poll(self, job: JobContext) -> None:
        if self._due is None or self.record is not None or not self._due.due(job.mon):
            return
        assert self.plan is not None
        self.record = {"run": job.run, "hold_s": self.plan.hold_s,
                       "lock_wait_s": self.plan.lock_wait_s, "outlasts": self.plan.outlasts,
                       "holder_pid": os.getpid()}
        self._in_thread(self._hold, job)

    def _hold(self, job: JobContext) -> None:
        rec = self.record
        assert rec is not None and self.plan is not None
        asked = time.time()
        # mode=rw: never create the file; isolation_level=None: the statements as written
        conn = sqlite3.connect(f"file:{self.db}?mode=rw", uri=True, timeout=60,
                               isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            rec["acquired_at"] = time.time()
            rec["acquire_wait_s"] = round(rec["acquired_at"] - asked, 4)
            rec["master_alive_at_acquire"] = job.master_alive()
            # The master must write again (and so wait) while work is left, or while it has
            # not imported its tasks yet (its start: the schema is there, the tasks not).
            rec["work_left_at_acquire"] = conn.execute(
                "SELECT count(*) FROM tasks WHERE state IN ('queued', 'active')").fetchone()[0]
            rec["tasks_at_acquire"] = conn.execute("SELECT count(*) FROM tasks").fetchone()[0]
            time.sleep(self.plan.hold_s)
            rec["master_alive_at_release"] = job.master_alive()
        finally:
            try:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                    rec["released_at"] = time.time()
            finally:
                conn.close()


#: A command on the alias, started (and its modules imported) before the trial, run once the
#: harness says go: cold, the three took 2-3 s here beside a busy job (10 s on a loaded
#: machine), longer than the master's whole run, which must still be going on when they read
#: the alias. It says it is ready by creating its file `argv[2]`; the go file holds the
#: master's pid; its last line on stdout says when it answered and whether that master was
#: still running then (its interpreter's exit takes a while longer on a busy machine).
_WARM_COMMAND = """\
import json, os, sys, time
import coordinator.cli, coordinator.commands, coordinator.preflight
import store.audit, store.probe, store.readonly
go, ready, deadline = sys.argv[1], sys.argv[2], time.monotonic() + 3600
open(ready, "w").close()
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit(125)
    time.sleep(0.002)
master = open(go).read().strip()
status = coordinator.cli.main(sys.argv[3:])
answered_at = time.time()
alive = False
if master.isdigit():
    try:
        with open(f"/proc/{master}/stat") as f:
            alive = f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        pass
print(json.dumps({"answered_at": answered_at, "master_alive": alive}), flush=True)
sys.exit(status)
"""


class AliasedFile(HarnessFault):
    """aliased_file: a second name (hard link) for the campaign file while the master runs,
    and the three commands an operator could run on it, at once; then the name removed.
    The commands are `coordinator.cli.main` in processes started before the trial's first
    job (`prepare`), waiting for the go (`alias.go`) with their modules loaded."""

    kind = "aliased_file"
    COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("run", ("--resume",)), ("status", ()), ("check", ()))
    TIMEOUT_S = 120.0

    def __init__(self, plan: AliasPlan | None, db: Path):
        super().__init__()
        self.plan, self.db = plan, db
        self.alias, self.go = db.with_name(ALIAS_NAME), db.with_name("alias.go")
        self._due = AfterResults(plan.after_results, plan.delay_s) if plan else None
        self._procs: dict[str, subprocess.Popen] | None = None
        self.warm_s: float | None = None

    def poll(self, job: JobContext) -> None:
        if self._due is None or self.record is not None:
            return
        if self._procs is None:
            self.prepare(wait_s=0.0)
        if self._due.due(job.mon):
            self.record = {"run": job.run, "warm_s": self.warm_s}
            self._in_thread(self._alias, job)

    def prepare(self, wait_s: float = 120.0) -> None:
        """Start the commands, and wait (up to `wait_s`) until each has loaded its modules."""
        if self.plan is None or self._procs is not None:
            return
        self.go.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        started = time.monotonic()
        ready = {name: self.db.with_name(f"alias.ready-{name}") for name, _ in self.COMMANDS}
        self._procs = {name: subprocess.Popen(
            [sys.executable, "-c", _WARM_COMMAND, str(self.go), str(ready[name]), name, "--db",
             str(self.alias), *rest], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, cwd=self.db.parent, start_new_session=True) for name, rest in self.COMMANDS}
        while time.monotonic() - started < wait_s:
            if all(r.exists() for r in ready.values()) or any(
                    p.poll() is not None for p in self._procs.values()):
                break
            time.sleep(0.01)
        self.warm_s = round(time.monotonic() - started, 3) if wait_s else None
        for r in ready.values():
            r.unlink(missing_ok=True)

    def close(self) -> None:
        """The trial is over: commands still waiting (the moment never came) are ended."""
        for proc in (self._procs or {}).values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        self._procs = {} if self._procs is not None else None
        self.go.unlink(missing_ok=True)

    def alias_files(self) -> list[str]:
        """What exists under the alias's name: the link, and what SQLite would make beside
        it (-wal, -shm, -journal)."""
        return sorted(p.name for p in self.db.parent.iterdir()
                      if p.name.startswith(ALIAS_NAME))

    def _alias(self, job: JobContext | None) -> None:
        rec, procs = self.record, self._procs
        assert rec is not None and procs is not None
        os.link(self.db, self.alias)
        try:
            rec["linked_at"] = time.time()
            rec["master_alive_at_link"] = job.master_alive() if job else None
            started = time.monotonic()
            master = job.master_pid() if job else None
            tmp = self.go.with_name(self.go.name + ".tmp")
            tmp.write_text(f"{master or ''}\n")
            tmp.replace(self.go)  # whole, at once: the commands read the pid
            ended: dict[str, float] = {}  # seconds from the go to its exit; -1: timed out
            while len(ended) < len(procs):
                now = time.monotonic()
                for name, proc in procs.items():
                    if name in ended:
                        continue
                    if proc.poll() is not None:
                        ended[name] = now - started
                    elif now - started > self.TIMEOUT_S:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        ended[name] = -1.0
                time.sleep(0.005)
            commands: dict[str, dict[str, Any]] = {}
            for name, proc in procs.items():
                out, err = proc.communicate()
                seconds = ended[name]
                said: dict[str, Any] = {}
                with contextlib.suppress(json.JSONDecodeError, IndexError):
                    said = json.loads(out.strip().splitlines()[-1])
                answered = said.get("answered_at")
                commands[name] = {
                    "exit": proc.returncode, "timed_out": seconds < 0,
                    "refused": ALIAS_REFUSAL in err, "seconds": round(seconds, 4),
                    "answered_s": round(answered - rec["linked_at"], 4) if answered else None,
                    "master_alive_at_answer": said.get("master_alive"),
                    "output": (err + out)[-400:]}
            rec["commands"] = commands
            rec["seconds"] = round(time.monotonic() - started, 4)
            rec["master_alive_after"] = job.master_alive() if job else None
            rec["beside_alias"] = [n for n in self.alias_files() if n != ALIAS_NAME]
        finally:
            os.unlink(self.alias)
            self.go.unlink(missing_ok=True)
            rec["left_after_unlink"] = self.alias_files()
            rec["links_after"] = os.stat(self.db).st_nlink


class StartupCrash(HarnessFault):
    """startup_crash: one worker rank SIGKILLed during the start: `delay_s` after the master
    recorded its pid (it is past MPI_Init; its start verdict comes ~0.3 s later here), in the
    first launch whose master got that far."""

    kind = "startup_crash"

    def __init__(self, plan: StartupPlan | None, db: Path):
        super().__init__()
        self.plan, self.db = plan, db
        self._due_at: float | None = None
        self._due_run: int | None = None
        self._next_look = 0.0

    def poll(self, job: JobContext) -> None:
        if self.plan is None or self.record is not None:
            return
        if self._due_run != job.run:
            self._due_at, self._due_run = None, job.run
        now = time.monotonic()
        if self._due_at is None:
            if job.master_pid() is not None:
                self._due_at = now + self.plan.delay_s
            return
        if now < max(self._due_at, self._next_look):
            return
        self._next_look = now + 0.02
        master = job.master_pid()
        victim = next((pid for pid in ranks_of(self.db)
                       if pid not in (master, job.proc.pid) and _rank_of(pid) == self.plan.rank),
                      None)
        if victim is None:
            if now > self._due_at + 2.0:  # the rank is gone already: said, judged
                self.record = {"run": job.run, "rank": self.plan.rank, "ulfm": self.plan.ulfm,
                               "error": f"rank {self.plan.rank} not found among the job's "
                                        f"processes"}
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        self.record = {"run": job.run, "rank": self.plan.rank, "pid": victim,
                       "ulfm": self.plan.ulfm, "killed_at": time.time(),
                       "delay_s": self.plan.delay_s, "master_pid": master}


def run_job(cmd: list[str], db: Path, log_base: Path, opts: Options, trigger: KillTrigger,
            run: int, resume: bool, inject_seed: int, *,
            faults: tuple[HarnessFault, ...] = (), pid_file: Path | None = None,
            ulfm: bool = False) -> JobRun:
    """One launch, until it ends (or the harness ends it). `faults` act on it while it runs
    and are settled (a held lock released, an alias removed) before this returns; `ulfm`:
    a dead worker does not end the job, so a stall is every *live* worker stopped."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out_path, err_path = log_base.with_suffix(".out"), log_base.with_suffix(".err")
    trigger.launch(_scalar(db, "SELECT count(*) FROM results") or 0)
    t0 = time.monotonic()
    started_at = time.time()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        ended_by = "exit"
        mon = DbMonitor(db)
        job = JobContext(proc, db, mon, run, pid_file)
        all_stopped_since: float | None = None
        next_stall_check = t0 + 0.5
        while proc.poll() is None:
            now = time.monotonic()
            elapsed = now - t0
            if elapsed > opts.timeout_per_job:
                ended_by = "timeout"
                break
            if trigger.due(mon):
                trigger.fire(mon, run, elapsed)
                ended_by = "harness_kill"
                break
            for fault in faults:
                fault.poll(job)
            if now >= next_stall_check:
                next_stall_check = now + 0.25
                pids = ranks_of(db)
                stopped = [p for p in pids if _stopped(p)]
                needed = opts.workers
                if ulfm:  # the workers still alive (a dead one costs only itself)
                    needed = sum(1 for p in pids if (_rank_of(p) or 0) >= 1) or opts.workers
                if len(stopped) >= needed:
                    all_stopped_since = all_stopped_since or now
                    # Every worker hangs (SIGSTOP): nothing can progress once the watchdog has
                    # retired their dispatches. Kill only if work is left to do (else the
                    # master ends by itself, aborting the unacknowledged ranks).
                    in_flight = mon.scalar("SELECT count(*) FROM dispatches")
                    queued = mon.scalar("SELECT count(*) FROM tasks WHERE state IN "
                                        "('queued','active')")
                    if queued and (in_flight == 0
                                   or now - all_stopped_since > opts.watchdog_s + 3):
                        ended_by = "stall"
                        break
                else:
                    all_stopped_since = None
            time.sleep(0.004)
        kill_everything(proc, db)
        seconds = time.monotonic() - t0
        mon.close()
        for fault in faults:
            fault.settle()
    if ended_by == "exit" and LAUNCHER_FAILED in err_path.read_text(errors="replace"):
        ended_by = "launcher_failed"  # Open MPI's own flake (exit 213): nothing ran; rerun
    finished = campaign_finished(out_path.read_text(errors="replace"))
    master_exit = None
    if pid_file is not None:
        with contextlib.suppress(OSError, ValueError):
            master_exit = int(exit_status_path(pid_file).read_text().strip())
    incarnation, epoch = _row(db, "SELECT incarnation, epoch FROM campaign") or (None, None)
    return JobRun(run, resume, inject_seed, ended_by, proc.returncode, round(seconds, 3),
                  finished, _scalar(db, "SELECT count(*) FROM results"),
                  _scalar(db, "SELECT count(*) FROM dispatches"), round(started_at, 4),
                  master_exit, incarnation, epoch)


def campaign_finished(out: str) -> bool:
    """The master's last line (stdout) says the campaign drained: nothing left queued."""
    for line in reversed(out.splitlines()):
        if FINISHED_MARK in line:
            m = FINISHED_LINE.search(line)
            return m is None or m.group(1) == "0"
    return False


# -- checking a campaign from its database -------------------------------------------------

def read_inject_logs(inject_dir: Path) -> tuple[list[dict], int]:
    """Every injected fault recorded in DIR/faults-rank*.jsonl, and the count of torn lines."""
    records, torn = [], 0
    if not inject_dir.is_dir():
        return records, torn
    for path in sorted(inject_dir.glob("faults-rank*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if isinstance(rec, dict) and {"t", "kind", "token"} <= rec.keys():
                    records.append(rec)
                    continue
            except json.JSONDecodeError:
                pass
            torn += 1
    return records, torn


def status_json(db: Path) -> dict | None:
    try:
        out = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db", str(db),
                              "--json"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT)
        return json.loads(out.stdout) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError):
        return None


def _percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(p * len(s)) - 1)]


def check_campaign(db: Path, expected_tasks: int, *, complete: bool = True,
                   inject_dir: Path | None = None, stats: bool = True,
                   epochs: Mapping[int, str] | None = None) -> dict[str, Any]:
    """Everything the brief asks of a finished trial, read-only from `db` (and the inject
    logs for fault counts, latencies and commits of tokens whose RESULT never validly left;
    `epochs`: each incarnation's token epoch, read after each job, the file keeping only the
    last one's).

    The store's own rules are `store.audit`'s; this adds what only the harness knows (the
    tasks it enqueued and their values, the faults it injected, a finished run's end state).
    `complete=False` (restart budget exhausted: the last job was killed mid-flight) skips the
    final-state checks (queued/active tasks, dispatch and lease rows) and keeps the safety
    checks. Returns counts and a list of human-readable problems."""
    r: dict[str, Any] = {
        "tasks_lost": 0, "wrong_commits": 0, "duplicate_commits": 0, "integrity_ok": True,
        "leftover_rows": 0, "stats_mismatches": 0, "fk_violations": 0, "problems": [],
        "audit_violations": 0, "extra_tasks": 0, "unverified_tokens": 0,
        "tasks": 0, "states": {}, "results": 0, "dispatches_sum": 0, "recovered_tasks": 0,
        "recovered_done": 0, "faults": {}, "torn_log_lines": 0, "latency": {},
        "latency_overall": [], "events": {}, "incarnation": 0,
    }
    problems: list[str] = r["problems"]
    records, r["torn_log_lines"] = read_inject_logs(inject_dir) if inject_dir else ([], 0)
    r["faults"] = dict(Counter(rec["kind"] for rec in records))
    try:
        engine = open_readonly(db)
    except NoCampaignYet as e:
        return _no_campaign(r, e, expected_tasks, complete)
    except StoreError as e:
        r["integrity_ok"] = False
        problems.append(f"cannot open database: {e}")
        return r
    try:
        with engine.connect() as conn:
            conn.begin()  # one snapshot for the audit and the harness's own checks
            try:
                return _check(conn, r, expected_tasks, complete, records, db, stats,
                              dict(epochs or {}))
            finally:
                conn.rollback()
    except NoCampaignYet as e:
        return _no_campaign(r, e, expected_tasks, complete)
    except (StoreError, DBAPIError, sqlite3.DatabaseError) as e:
        r["integrity_ok"] = False
        problems.append(f"database error while checking: {e}")
        return r
    finally:
        engine.dispose()


def _no_campaign(r: dict[str, Any], e: StoreError, expected: int,
                 complete: bool) -> dict[str, Any]:
    # The job was killed before the schema was created (it is one transaction): no campaign
    # yet. Only a trial the master reported finished has lost its tasks then.
    r["problems"].append(f"the database holds no campaign ({e})")
    if complete:
        r["tasks_lost"] = expected
    return r


def _check(conn: Connection, r: dict[str, Any], expected: int, complete: bool,
           records: list[dict], db: Path, stats: bool,
           epochs: dict[int, str]) -> dict[str, Any]:
    problems: list[str] = r["problems"]
    report = audit(conn)
    raw = conn.connection.driver_connection  # the same transaction, for the harness's SQL
    q = lambda sql, *a: raw.execute(sql, a).fetchall()  # noqa: E731
    one = lambda sql, *a: raw.execute(sql, a).fetchone()[0]  # noqa: E731

    # -- the store's rules, counted the way this report counts -------------------------------
    lost_ids: set[int] = set()
    lost_rest = orphan_enqueued = dup = 0
    wrong: dict[str, list[str]] = defaultdict(list)
    for v in report.violations:
        n = v.count or 1
        problems.append(f"{v.kind.value}: {v.message}")
        if v.kind is ViolationKind.INTEGRITY:
            r["integrity_ok"] = False
        elif v.kind in (ViolationKind.FOREIGN_KEYS, ViolationKind.ORPHAN_LEASE):
            r["fk_violations"] += n
        elif v.kind is ViolationKind.STATISTICS or v.check is Check.STATUS_COUNTS:
            r["stats_mismatches"] += 1
        elif v.check in (Check.DONE_WITHOUT_RESULT, Check.ACTIVE_WITHOUT_DISPATCH):
            if v.task_id is None:
                lost_rest += n
            else:
                lost_ids.add(v.task_id)
        elif v.check is Check.ENQUEUED_WITHOUT_TASK:
            orphan_enqueued += n
        elif v.check is Check.RESULT_OF_UNDONE_TASK:
            dup += n
        elif v.check in (Check.RESULTS_PER_TASK, Check.TOKEN_SHARED):
            dup += n - 1  # the results past the first of the task, or of the token
        elif v.check is Check.DISPATCH_OF_INACTIVE_TASK:
            r["leftover_rows"] += n
        elif v.check is Check.MORE_RECORDS_THAN_DISPATCHES and v.token is not None:
            # One record too many, and it is the task's result: a commit from a dispatch
            # that never was (for this task).
            wrong[v.token].append(f"task {v.task_id}: result token {v.token[:12]} is one more "
                                  f"record than the task's dispatches (never dispatched for "
                                  f"it)")
        elif v.check in (Check.TOKEN_ENDED_WITHOUT_RESULT, Check.TOKEN_RETIRED):
            # Said above; counted once per token, with the harness's own findings.
            wrong.setdefault(v.token or "", [])
    # Every violation fails the trial, counted above or not (a dispatch without its record,
    # a lease of no dispatch, a foreign key: none of the counters above takes them).
    r["audit_violations"] = len(report.violations)
    if not r["integrity_ok"]:
        return r  # the audit read no rows of a damaged file; nor does the harness

    # -- lost tasks --------------------------------------------------------------------------
    r["tasks"] = one("SELECT count(*) FROM tasks")
    r["states"] = dict(q("SELECT state, count(*) FROM tasks GROUP BY state"))
    present = {n for (n,) in q("SELECT json_extract(payload, '$.data.n') FROM tasks")}
    missing = sorted(set(range(expected)) - present)
    if missing:
        problems.append(f"{len(missing)} of the {expected} tasks have no row (n={missing[:10]})")
    # ... and none has more than one, nor is one the campaign never had: the same work
    # enqueued twice, or committed twice as two task rows, which no store rule refuses.
    extra = q("SELECT json_extract(payload, '$.data.n') AS n, count(*) FROM tasks GROUP BY n "
              "HAVING count(*) > 1 OR n IS NULL OR n NOT BETWEEN 0 AND ?", expected - 1)
    if extra:
        r["extra_tasks"] = sum(c - (0 <= (n if isinstance(n, int) else -1) < expected)
                               for n, c in extra)
        problems.append(f"{r['extra_tasks']} task rows past the campaign's {expected} "
                        f"(n, rows: {extra[:10]})")
        dup += sum(c - 1 for (c,) in q(
            "SELECT count(*) FROM tasks t JOIN results r ON r.task_id = t.id "
            "GROUP BY json_extract(t.payload, '$.data.n') HAVING count(*) > 1"))
    if complete:
        unfinished = q("SELECT id, state FROM tasks WHERE state IN ('queued', 'active')")
        if unfinished:
            lost_ids.update(i for i, _ in unfinished)
            problems.append(f"campaign reported finished but {len(unfinished)} tasks are "
                            f"queued/active: {unfinished[:10]}")
        left = one("SELECT count(*) FROM dispatches") + one("SELECT count(*) FROM leases")
        if left:
            r["leftover_rows"] = max(r["leftover_rows"], left)
            problems.append(f"{left} dispatch/lease rows left after the campaign finished")
    r["tasks_lost"] = max(len(missing), orphan_enqueued) + len(lost_ids) + lost_rest

    # -- wrong commits: the harness's own (values, faults it injected) -----------------------
    for task_id, token, got, want in q(
            "SELECT r.task_id, r.token, json_extract(r.value, '$.n'), "
            "json_extract(t.payload, '$.data.n') FROM results r JOIN tasks t "
            "ON t.id = r.task_id WHERE json_extract(r.value, '$.n') IS NOT "
            "json_extract(t.payload, '$.data.n')"):
        wrong[token].append(f"task {task_id}: result value is task n={got}'s, not n={want}'s")
    broken = {rec["token"]: rec["kind"] for rec in records
              if rec["kind"] in NEVER_VALIDLY_SENT}
    if broken:
        for task_id, token in q("SELECT task_id, token FROM results"):
            if token in broken:
                wrong[token].append(f"task {task_id}: committed token {token[:12]} whose "
                                    f"RESULT never validly left ({broken[token]})")
    _check_tokens(raw, r, wrong, epochs)
    r["wrong_commits"] = len(wrong)
    for msgs in wrong.values():
        problems.extend(msgs)
    r["duplicate_commits"] = dup
    r["results"] = one("SELECT count(*) FROM results")

    # -- `coordinator status --json` prints the statistics the audit checked -----------------
    ev = dict(q("SELECT kind, count(*) FROM events GROUP BY kind"))
    r["events"] = ev
    r["incarnation"] = one("SELECT coalesce(max(incarnation), 0) FROM campaign")
    if stats and report.stats is not None:
        s = status_json(db)
        if s is None:
            r["stats_mismatches"] += 1
            problems.append("`coordinator status --json` failed")
        else:
            for key, value in report.stats.as_json().items():
                if s.get(key) != value:
                    r["stats_mismatches"] += 1
                    problems.append(f"status --json {key}={s.get(key)!r}, the store reads "
                                    f"{value!r}")

    # -- recovery ----------------------------------------------------------------------------
    causes = ",".join(f"'{k}'" for k in CAUSE_KINDS)
    recovered = q(f"SELECT DISTINCT e.task_id, t.state FROM events e JOIN tasks t "
                  f"ON t.id = e.task_id WHERE e.kind IN ({causes}) AND {COUNTED_KIND_SQL}")
    r["recovered_tasks"] = len(recovered)
    r["recovered_done"] = sum(1 for _, st in recovered if st == "done")
    r["dispatches_sum"] = one("SELECT coalesce(sum(dispatches), 0) FROM tasks")

    # latency: fault time (worker clock = master clock, same host) -> task back in the queue
    follow = ",".join(f"'{k}'" for k in FOLLOW_KINDS)
    by_token: dict[str, tuple[str, int, float, int]] = {}
    for eid, kind, token, task_id, at in q(
            f"SELECT id, kind, token, task_id, at FROM events WHERE kind IN ({causes}) "
            f"AND {COUNTED_KIND_SQL} AND token IS NOT NULL"):
        by_token[token] = (kind, task_id, at, eid)
    requeue_at: dict[str, float] = {}
    for token, (kind, task_id, at, eid) in by_token.items():
        if kind in ("interrupted", "stop_requeued"):
            requeue_at[token] = at  # requeued in the same transaction, no event of its own
            continue
        row = raw.execute(f"SELECT at FROM events WHERE task_id = ? AND id > ? AND kind IN "
                           f"({follow}) ORDER BY id LIMIT 1", (task_id, eid)).fetchone()
        if row:
            requeue_at[token] = row[0]
    lat: dict[str, list[float]] = defaultdict(list)
    first: dict[str, float] = {}
    for rec in records:
        tok = rec["token"]
        if rec["kind"] in BREAKING and tok in requeue_at:
            lat[rec["kind"]].append(round(requeue_at[tok] - rec["t"], 4))
            first[tok] = min(first.get(tok, rec["t"]), rec["t"])
    r["latency"] = dict(lat)
    r["latency_overall"] = [round(requeue_at[t] - f, 4) for t, f in first.items()]
    return r


#: Events that end a whole dispatch, every task of a batch: no result may carry its token.
#: Not `task_failed`: a batch's task whose own run failed ends alone, and the others commit.
DISPATCH_ENDED = ("recovered", "watchdog", "interrupted", "stop_requeued", "worker_failed",
                  "split", "send_failed")


def _check_tokens(raw: sqlite3.Connection, r: dict[str, Any], wrong: dict[str, list[str]],
                  epochs: dict[int, str]) -> None:
    """Every result's (task, rank, token) is a dispatch's that was never rolled back.

    A committed dispatch has no record but its results rows (docs/sqlite.md, `dispatched`),
    so a token is checked against what made it and against the token's other records:
    it must be `mint_token(epoch, rank, seq)` of its result's incarnation and rank (a token
    made up, or another rank's or incarnation's, is not); every `dispatched` event of it (a
    batch's task that ended without a result) must name the same rank, incarnation and
    dispatch time (else it is another dispatch's); and no event may say its dispatch ended
    as a whole. `store.audit` checks the rest: the same token on other results, and the
    events of the result's own task."""
    ended = ", ".join(f"'{k}'" for k in DISPATCH_ENDED)
    for task_id, token, kind, other, rank in raw.execute(
            f"SELECT r.task_id, r.token, e.kind, e.task_id, e.rank FROM results r "
            f"JOIN events e ON e.token = r.token AND e.task_id IS NOT r.task_id "
            f"WHERE e.kind IN ({ended}) OR (e.kind = 'dispatched' AND (e.rank IS NOT r.rank "
            f"OR e.incarnation IS NOT r.incarnation OR e.at IS NOT r.dispatched_at))"):
        wrong[token].append(f"task {task_id}: result token {token[:12]} is that of "
                            + (f"a dispatch that ended ({kind}, task {other})"
                               if kind != "dispatched" else
                               f"another dispatch (of task {other} to rank {rank})"))
    epochs.update(raw.execute("SELECT incarnation, epoch FROM campaign"))
    # Tokens are minted in sequence, one per dispatch planned: the dispatches the file
    # records bound the sequence, plus a margin for plans that never committed.
    most = 64 + raw.execute("SELECT (SELECT coalesce(sum(dispatches), 0) FROM tasks) + "
                            "(SELECT count(*) FROM events WHERE kind = 'send_failed')"
                            ).fetchone()[0]
    want: dict[int, set[tuple[int, str, int]]] = defaultdict(set)
    for task_id, token, rank, inc in raw.execute(
            "SELECT task_id, token, rank, incarnation FROM results"):
        want[inc].add((rank, token, task_id))
    for inc, left in want.items():
        epoch = epochs.get(inc)
        if epoch is None:
            r["unverified_tokens"] += len(left)
            r["problems"].append(f"{len(left)} results of incarnation {inc}: its token epoch "
                                 f"is unknown, their tokens cannot be checked")
            continue
        by_token = {(rank, token): task_id for rank, token, task_id in left}
        ranks = {rank for rank, _ in by_token}
        for seq in range(1, most + 1):
            if not by_token:
                break
            for rank in ranks:
                by_token.pop((rank, mint_token(epoch, rank, seq)), None)
        for (rank, token), task_id in by_token.items():
            wrong[token].append(f"task {task_id}: result token {token[:12]} was never minted "
                                f"for rank {rank} in incarnation {inc}")


# -- judging the harness's own faults ------------------------------------------------------

#: What the master says while it waits for the write lock (`LockWaiter`), and when it stops.
LOCK_WAIT_LINE = "for the campaign's write lock, held by pid {pid} ("
LOCK_STOP_LINE = "database is locked"


def check_harness_faults(db: Path, runs: list[dict[str, Any]],
                         records: dict[str, dict[str, Any] | None],
                         logs: Path | None = None) -> dict[str, Any]:
    """Judge the harness's own faults of a trial: `records` are what `HeldLock`,
    `AliasedFile` and `StartupCrash` recorded (None: not planned), `runs` the trial's jobs
    (`JobRun` as dicts), `logs` the directory of their `runNN.err`. The exit statuses and
    lines each fault must (or must not) cause, and its recovery, read-only from `db`.

    - held_lock: a hold shorter than --lock-wait must not stop the master (exit 3, "database
      is locked"); a longer one must, if the master had to write during it (it was running
      with work left, or tasks still to import, when the lock was taken, or said it waited)
      and ended by itself (a master killed meanwhile, by the launcher after a worker's death
      or by this harness, is not judged). A hold of 4 s or more that the master
      outlived with work left must have been said (naming this process's pid). Recovery: from
      the ROLLBACK to the campaign's next commit (a resumed master's, after an exit 3).
    - aliased_file: `run --resume`, `status` and `check` on the second name each exit 2
      saying "has 2 names"; nothing made beside the alias (-wal, -shm, -journal); the file has
      one name again afterwards; no run of the trial was refused.
    - startup_crash: the job must not hang (the per-job limit); under ULFM a job the harness
      did not end must go on: its master ends by itself and records the rank's death
      (`worker_failed`); one the harness ended counts as gone on if the death was recorded.
      Recovery: without ULFM, from the kill to the first result committed by the relaunched
      job; under ULFM, to the `worker_failed` event."""
    out: dict[str, Any] = {"problems": [], "latency": {}, "faults": {}, "details": {}}
    by_run = {j["run"]: j for j in runs}

    def err_of(run: int) -> str:
        if logs is None:
            return ""
        try:
            return (logs / f"run{run:02d}.err").read_text(errors="replace")
        except OSError:
            return ""

    try:
        conn = _ro(db) if db.exists() else None
    except sqlite3.Error:
        conn = None

    def value(sql: str, *params: Any) -> Any:
        if conn is None:
            return None
        try:
            row = conn.execute(sql, params).fetchone()
        except sqlite3.Error:
            return None
        return row[0] if row else None

    def next_commit_after(t: float) -> float | None:
        return value("SELECT min(t) FROM (SELECT min(at) AS t FROM events WHERE at > ? "
                     "UNION ALL SELECT min(committed_at) FROM results WHERE committed_at > ?)",
                     t, t)

    try:
        rec = records.get("held_lock")
        if rec is not None:
            _judge_lock(rec, by_run, err_of, next_commit_after, out)
        rec = records.get("aliased_file")
        if rec is not None:
            _judge_alias(rec, runs, err_of, out)
        rec = records.get("startup_crash")
        if rec is not None:
            _judge_startup(rec, runs, by_run, value, out)
    finally:
        if conn is not None:
            conn.close()
    return out


def _judge_lock(rec: dict[str, Any], by_run: dict[int, dict[str, Any]], err_of,
                next_commit_after, out: dict[str, Any]) -> None:
    problems: list[str] = out["problems"]
    d = out["details"]["held_lock"] = {"held": "acquired_at" in rec, "outlasts": rec["outlasts"],
                                       "judged": False, "stopped": False, "said": False}
    if rec.get("error"):
        problems.append(f"held_lock: {rec['error']}")
    if "acquired_at" not in rec:
        return
    out["faults"]["held_lock"] = 1
    job = by_run.get(rec["run"], {})
    err = err_of(rec["run"])
    master_exit = job.get("master_exit")
    d["stopped"] = master_exit == ExitStatus.STORE
    d["said"] = LOCK_WAIT_LINE.format(pid=rec["holder_pid"]) in err
    # The master had to write while the lock was held: it was running with work left or
    # still to import its tasks, or it said it waited (a master past its last result still
    # writes at its end).
    alive = bool(rec.get("master_alive_at_acquire"))
    running = alive and bool(rec.get("work_left_at_acquire") or rec.get("tasks_at_acquire") == 0)
    hold, wait = rec["hold_s"], rec["lock_wait_s"]
    if rec["outlasts"]:
        if (running or (alive and d["said"])) and master_exit is not None:
            d["judged"] = True
            # A master past its last result when the lock was taken writes only at its end,
            # and may begin to wait late in the hold: it then gets the lock within its
            # --lock-wait and ends as it would have.
            late = not running and master_exit == ExitStatus.OK
            if master_exit != ExitStatus.STORE:
                if not late:
                    problems.append(f"held_lock: the master outlived a {hold:g} s hold past "
                                    f"its --lock-wait {wait:g} s: exit {master_exit}, "
                                    f"expected 3")
            elif LOCK_STOP_LINE not in err:
                problems.append(f"held_lock: the master stopped with exit 3 without saying "
                                f"{LOCK_STOP_LINE!r}")
    else:
        d["judged"] = running
        if master_exit == ExitStatus.STORE or LOCK_STOP_LINE in err:
            problems.append(f"held_lock: the master stopped (exit {master_exit}) under a "
                            f"{hold:g} s hold, shorter than its --lock-wait {wait:g} s")
        if running and hold >= 4 and rec.get("master_alive_at_release") and not d["said"]:
            problems.append(f"held_lock: the master never said it waited for the write lock "
                            f"held {hold:g} s by pid {rec['holder_pid']}")
    if "released_at" in rec:
        nxt = next_commit_after(rec["released_at"])
        if nxt is not None:
            out["latency"]["held_lock"] = [round(nxt - rec["released_at"], 4)]


def _judge_alias(rec: dict[str, Any], runs: list[dict[str, Any]], err_of,
                 out: dict[str, Any]) -> None:
    problems: list[str] = out["problems"]
    answers = [c["answered_s"] for c in rec.get("commands", {}).values()
               if c.get("answered_s") is not None]
    out["details"]["aliased_file"] = {
        "linked": "linked_at" in rec, "seconds": rec.get("seconds"),
        "last_answer_s": max(answers) if answers else None,
        # the master ran from the link until every command had answered
        "during_run": bool(rec.get("master_alive_at_link") and all(
            c.get("master_alive_at_answer") for c in rec.get("commands", {}).values())),
        "refused": sum(1 for c in rec.get("commands", {}).values()
                       if c["exit"] == ExitStatus.USAGE and c["refused"])}
    if rec.get("error"):
        problems.append(f"aliased_file: {rec['error']}")
    if "linked_at" not in rec:
        return
    out["faults"]["aliased_file"] = 1
    commands = rec.get("commands", {})
    for name, _ in AliasedFile.COMMANDS:
        c = commands.get(name)
        if c is None:
            problems.append(f"aliased_file: `coordinator {name}` on the alias did not run")
        elif c["exit"] != ExitStatus.USAGE or not c["refused"]:
            problems.append(f"aliased_file: `coordinator {name} --db {ALIAS_NAME}` exited "
                            f"{c['exit']}{' (timed out)' if c['timed_out'] else ''}, expected "
                            f"2 and {ALIAS_REFUSAL!r}: {c['output'][-200:]!r}")
    if rec.get("beside_alias"):
        problems.append(f"aliased_file: made beside the alias: {rec['beside_alias']}")
    if rec.get("left_after_unlink"):
        problems.append(f"aliased_file: left after the alias was removed: "
                        f"{rec['left_after_unlink']}")
    if rec.get("links_after", 1) != 1:
        problems.append(f"aliased_file: the campaign file still has {rec['links_after']} names")
    refused = [j["run"] for j in runs if ALIAS_REFUSAL in err_of(j["run"])]
    if refused:
        problems.append(f"aliased_file: the trial's own runs {refused} were refused")


def _judge_startup(rec: dict[str, Any], runs: list[dict[str, Any]],
                   by_run: dict[int, dict[str, Any]], value, out: dict[str, Any]) -> None:
    problems: list[str] = out["problems"]
    d = out["details"]["startup_crash"] = {"killed": "killed_at" in rec, "ulfm": rec["ulfm"],
                                           "before_first_dispatch": None, "went_on": None}
    if rec.get("error"):
        problems.append(f"startup_crash: {rec['error']}")
    if "killed_at" not in rec:
        return
    out["faults"]["startup_crash"] = 1
    killed_at, rank = rec["killed_at"], rec["rank"]
    job = by_run.get(rec["run"], {})
    if job.get("ended_by") == "timeout":
        problems.append(f"startup_crash: the job hung after rank {rank} died during its start "
                        f"(ended at the per-job limit)")
    incarnation = value("SELECT incarnation FROM events WHERE kind = 'campaign' AND detail "
                        "LIKE ? ORDER BY id DESC LIMIT 1", f"master pid={rec['master_pid']} %")
    if incarnation is not None:
        first = value("SELECT min(t) FROM (SELECT min(dispatched_at) AS t FROM results WHERE "
                      "incarnation = ? UNION ALL SELECT min(at) FROM events WHERE kind = "
                      "'dispatched' AND incarnation = ?)", incarnation, incarnation)
        d["before_first_dispatch"] = first is None or first > killed_at
    else:
        d["before_first_dispatch"] = True  # the master had not even begun its incarnation
    if rec["ulfm"]:
        failed_at = value("SELECT min(at) FROM events WHERE kind = 'worker_failed' AND rank = ? "
                          "AND at >= ?", rank, killed_at - 1.0)
        if job.get("ended_by") not in ("exit", None):
            # Ended by this harness (its kill, a stall), not by the death: judged only by
            # what the master did before (it recorded the death and went on).
            if failed_at is not None:
                d["went_on"] = True
                out["latency"]["startup_crash"] = [round(failed_at - killed_at, 4)]
            return
        d["went_on"] = job.get("master_exit") is not None and failed_at is not None
        if job.get("master_exit") is None:
            problems.append(f"startup_crash: under ULFM the job ended with rank {rank}'s death "
                            f"during the start (the master recorded no exit status)")
        elif failed_at is None:
            problems.append(f"startup_crash: under ULFM the master never recorded rank {rank}'s "
                            f"death during the start (no worker_failed event)")
        else:
            out["latency"]["startup_crash"] = [round(failed_at - killed_at, 4)]
        return
    later = [j for j in runs if j["run"] > rec["run"] and j.get("started_at") is not None]
    d["went_on"] = bool(job.get("finished"))
    if later:
        first = value("SELECT min(committed_at) FROM results WHERE committed_at >= ?",
                      later[0]["started_at"])
        if first is not None:
            out["latency"]["startup_crash"] = [round(first - killed_at, 4)]


# -- one trial -----------------------------------------------------------------------------

def run_trial(plan: TrialPlan, trial_dir: Path, opts: Options) -> dict[str, Any]:
    trial_dir.mkdir(parents=True, exist_ok=True)
    db, inject_dir = trial_dir / "c.db", trial_dir / "inject"
    t0 = time.monotonic()
    trigger = KillTrigger(plan.kill)
    if plan.startup and plan.startup.ulfm and not opts.ulfm:  # (MPICH): judged without ULFM
        plan = dataclasses.replace(plan, startup=dataclasses.replace(plan.startup, ulfm=False))
    faults = (HeldLock(plan.lock, db), AliasedFile(plan.alias, db), StartupCrash(plan.startup, db))
    faults[1].prepare()
    runs: list[JobRun] = []
    for run in range(opts.max_restarts + 1):
        pid_file = trial_dir / f"run{run:02d}.pid"
        args = run_args(db, plan, opts, inject_dir, run, pid_file)
        job = run_job(mpiexec_command(opts.workers + 1, args, plan.ulfm), db,
                      trial_dir / f"run{run:02d}", opts, trigger, run, run > 0,
                      inject_seed_of(plan, opts, run), faults=faults, pid_file=pid_file,
                      ulfm=plan.ulfm)
        runs.append(job)
        if job.finished:
            break
    for fault in faults:
        fault.close()
    complete = bool(runs and runs[-1].finished)
    check = check_campaign(db, opts.tasks, complete=complete, inject_dir=inject_dir,
                           epochs={j.incarnation: j.epoch for j in runs if j.epoch})
    if not complete:
        last = runs[-1]
        check["problems"].insert(0, f"incomplete: the campaign did not finish in {len(runs)} "
                                    f"launches (--max-restarts {opts.max_restarts}); tasks "
                                    f"{check['states']}, the last launch ended by "
                                    f"{last.ended_by} (exit {last.exit_code})")
    records = {f.kind: f.record for f in faults}
    run_dicts = [asdict(j) for j in runs]
    harness = check_harness_faults(db, run_dicts, records, trial_dir)
    first = mpiexec_command(opts.workers + 1, run_args(db, plan, opts, inject_dir, 0),
                            plan.ulfm)
    return {
        "index": plan.index, "trial": plan.index + 1, "plan": plan.rates, "kinds": plan.kinds,
        "inject": plan.inject_spec(), "label": plan.label(), "inject_seed": plan.inject_seed,
        "kill": asdict(plan.kill) if plan.kill else None, "kill_fired": trigger.fired,
        "kill_landed": trigger.landed,
        "ulfm": plan.ulfm, "batch": plan.batch, "runs": run_dicts,
        "restarts": len(runs) - 1, "complete": complete,
        "incomplete_allowed": opts.allow_incomplete,
        "wall_s": round(time.monotonic() - t0, 3), "dir": str(trial_dir),
        "command": shlex.join(first),
        **{k: check[k] for k in ("tasks_lost", "wrong_commits", "duplicate_commits",
                                 "integrity_ok", "leftover_rows", "stats_mismatches",
                                 "fk_violations", "audit_violations", "extra_tasks",
                                 "unverified_tokens", "problems", "tasks", "states", "results",
                                 "dispatches_sum", "recovered_tasks", "recovered_done",
                                 "torn_log_lines", "latency_overall", "events",
                                 "incarnation")},
        "faults": {**check["faults"], **harness["faults"]},
        "latency": {**check["latency"], **harness["latency"]},
        "harness_faults": {k: {"plan": asdict(p) if p else None, "record": records[k],
                               **harness["details"].get(k, {})}
                           for k, p in (("held_lock", plan.lock), ("aliased_file", plan.alias),
                                        ("startup_crash", plan.startup)) if p},
        "kind_problems": harness["problems"],
    }


#: mpiexec exit statuses this harness expects: done, aborted unacknowledged ranks (4), a worker's
#: injected SIGKILL brought the job down (137), a hung rank the master ended with SIGUSR2 (140:
#: mpiexec reports that rank's status, not the master's 4, nor the 3 of a master stopped by a
#: held lock, which ends the workers the same way), and under ULFM a master whose workers all
#: died (6) or that a held lock stopped (3).
EXPECTED_EXITS = (0, 3, 4, 6, 137, 140)


def unusual_exits(t: dict[str, Any]) -> list[int | None]:
    """Exit statuses of runs that ended on their own in a way this harness does not expect
    (e.g. mpiexec killed by a signal of its own): kept and listed for a post-mortem."""
    return [j["exit_code"] for j in t["runs"]
            if j["ended_by"] == "exit" and j["exit_code"] not in EXPECTED_EXITS]


def trial_failed(t: dict[str, Any]) -> bool:
    # An incomplete trial is a campaign that could not finish in --max-restarts resumes: none
    # was in 200 trials, so one is a finding, not bad luck (`--allow-incomplete`: reported).
    return bool(t["tasks_lost"] or t["wrong_commits"] or t["duplicate_commits"]
                or not t["integrity_ok"] or t["leftover_rows"] or t["stats_mismatches"]
                or t.get("audit_violations") or t.get("extra_tasks")
                or t.get("unverified_tokens") or t.get("kind_problems")
                or not (t.get("complete", True) or t.get("incomplete_allowed")))


# -- the report ----------------------------------------------------------------------------

def _summarise(trials: list[dict[str, Any]], faults_of: str | None = None) -> dict[str, Any]:
    """Totals over `trials`; with `faults_of`, faults and latency of that kind only."""
    lat: list[float] = []
    faults = 0
    for t in trials:
        if faults_of is None:
            lat += t["latency_overall"]
            faults += sum(t["faults"].values())
        else:
            lat += t["latency"].get(faults_of, [])
            faults += t["faults"].get(faults_of, 0)
    rec = sum(t["recovered_tasks"] for t in trials)
    rec_done = sum(t["recovered_done"] for t in trials)
    results = sum(t["results"] for t in trials)
    walls = [t["wall_s"] for t in trials]
    ended = Counter(f"exit {j['exit_code']}" if j["ended_by"] == "exit" else j["ended_by"]
                    for t in trials for j in t["runs"])
    master_ends = Counter("killed" if j.get("master_exit") is None else f"exit {j['master_exit']}"
                          for t in trials for j in t["runs"] if "master_exit" in j)
    return {
        "trials": len(trials),
        "faults_injected": faults,
        "tasks_lost": sum(t["tasks_lost"] for t in trials),
        "wrong_commits": sum(t["wrong_commits"] for t in trials),
        "duplicate_commits": sum(t["duplicate_commits"] for t in trials),
        "integrity_failures": sum(not t["integrity_ok"] for t in trials),
        "leftover_rows": sum(t["leftover_rows"] for t in trials),
        "stats_mismatches": sum(t["stats_mismatches"] for t in trials),
        "kind_failures": sum(bool(t.get("kind_problems")) for t in trials),
        "failed_trials": sum(trial_failed(t) for t in trials),
        "incomplete_trials": sum(not t["complete"] for t in trials),
        "harness_kills": sum(t["kill_fired"] for t in trials),
        "harness_kills_mid_run": sum(bool((t.get("kill_landed") or {}).get("mid_run"))
                                     for t in trials),
        "restarts": sum(t["restarts"] for t in trials),
        "job_ends": dict(ended),
        "master_ends": dict(master_ends),
        "recovered_tasks": rec,
        "recovered_done": rec_done,
        "recovery_rate": round(rec_done / rec, 4) if rec else None,
        "recovery_latency_n": len(lat),
        "recovery_latency_p50_s": _percentile(lat, 0.50),
        "recovery_latency_p99_s": _percentile(lat, 0.99),
        "extra_executions": round(sum(t["dispatches_sum"] for t in trials) / results, 4)
        if results else None,
        "wall_time_s": round(sum(walls), 2),
        "trial_wall_p50_s": _percentile(walls, 0.5),
        "trial_wall_max_s": max(walls) if walls else None,
    }


def _details(trials: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [t["harness_faults"][kind] for t in trials if kind in t.get("harness_faults", {})]


def summarise_harness_faults(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """What the harness's own faults did over the campaign (see `check_harness_faults`)."""
    def lat(kind: str, pick=lambda d: True) -> list[float]:
        return [x for t in trials if kind in t.get("harness_faults", {})
                and pick(t["harness_faults"][kind]) for x in t["latency"].get(kind, [])]

    lock = _details(trials, "held_lock")
    short = [d for d in lock if d["outlasts"] and d["held"]]
    longer = [d for d in lock if not d["outlasts"] and d["held"]]
    alias = _details(trials, "aliased_file")
    crash = _details(trials, "startup_crash")
    ulfm = [d for d in crash if d["ulfm"] and d["killed"]]
    plain = [d for d in crash if not d["ulfm"] and d["killed"]]
    lock_lat, short_lat = lat("held_lock", lambda d: not d["outlasts"]), \
        lat("held_lock", lambda d: d["outlasts"])
    ulfm_lat, plain_lat = lat("startup_crash", lambda d: d["ulfm"]), \
        lat("startup_crash", lambda d: not d["ulfm"])
    refusal_s = [d["last_answer_s"] for d in alias if d.get("last_answer_s") is not None]
    return {
        "held_lock": {
            "trials": len(lock), "held": sum(d["held"] for d in lock),
            "within_lock_wait": len(longer),
            "within_lock_wait_said": sum(d["said"] for d in longer),
            "within_lock_wait_stopped": sum(d["stopped"] for d in longer),
            "past_lock_wait": len(short),
            "past_lock_wait_judged": sum(d["judged"] for d in short),
            "past_lock_wait_stopped": sum(d["stopped"] for d in short),
            "release_to_commit_p50_s": _percentile(lock_lat, 0.5),
            "release_to_commit_max_s": max(lock_lat) if lock_lat else None,
            "release_to_resumed_commit_p50_s": _percentile(short_lat, 0.5),
            "release_to_resumed_commit_max_s": max(short_lat) if short_lat else None,
        },
        "aliased_file": {
            "trials": len(alias), "linked": sum(d["linked"] for d in alias),
            "while_master_ran": sum(d["during_run"] for d in alias),
            "commands": 3 * sum(d["linked"] for d in alias),
            "refused": sum(d["refused"] for d in alias),
            "last_answer_p50_s": _percentile(refusal_s, 0.5),
            "last_answer_max_s": max(refusal_s) if refusal_s else None,
        },
        "startup_crash": {
            "trials": len(crash), "killed": sum(d["killed"] for d in crash),
            "before_first_dispatch": sum(bool(d["before_first_dispatch"]) for d in crash),
            "without_ulfm": len(plain),
            "without_ulfm_run_finished_anyway": sum(bool(d["went_on"]) for d in plain),
            "kill_to_resumed_result_p50_s": _percentile(plain_lat, 0.5),
            "kill_to_resumed_result_max_s": max(plain_lat) if plain_lat else None,
            "ulfm": len(ulfm), "ulfm_went_on": sum(bool(d["went_on"]) for d in ulfm),
            "ulfm_kill_to_worker_failed_p50_s": _percentile(ulfm_lat, 0.5),
            "ulfm_kill_to_worker_failed_max_s": max(ulfm_lat) if ulfm_lat else None,
        },
    }


def build_report(trials: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    report = {**meta, **_summarise(trials)}
    report["per_kind"] = {k: _summarise([t for t in trials if k in t.get("kinds", t["plan"])],
                                        faults_of=k)
                          for k in ALL_KINDS}
    report["per_batch"] = {f"batch {batch_arg(b)}": _summarise(group) for b, group in sorted(
        _by_batch(trials).items())}
    report["harness_faults"] = summarise_harness_faults(trials)
    report["failures"] = [{"trial": t["trial"], "dir": t["dir"], "inject": t.get("label",
                                                                              t["inject"]),
                           "problems": (t.get("kind_problems", []) + t["problems"])[:20]}
                          for t in trials if trial_failed(t)]
    report["incomplete"] = [{"trial": t["trial"], "dir": t["dir"],
                             "inject": t.get("label", t["inject"]),
                             "restarts": t["restarts"], "states": t["states"]}
                            for t in trials if not t["complete"]]
    report["unusual_exits"] = [{"trial": t["trial"], "dir": t["dir"],
                                "inject": t.get("label", t["inject"]),
                                "exit_codes": unusual_exits(t)}
                               for t in trials if unusual_exits(t)]
    report["trials_detail"] = trials
    return report


def _by_batch(trials: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    groups: dict[int, list[dict[str, Any]]] = {}
    for t in trials:
        groups.setdefault(t.get("batch", 1), []).append(t)
    return groups


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _harness_markdown(h: dict[str, Any]) -> list[str]:
    lk, al, sc = h["held_lock"], h["aliased_file"], h["startup_crash"]
    lock = (f"- `held_lock` ({lk['trials']} trials, {lk['held']} holds): "
            f"{lk['within_lock_wait']} held 1–12 s within `--lock-wait {LOCK_WAIT_S:g}`: "
            f"masters stopped: {lk['within_lock_wait_stopped']}; the master said it waited, "
            f"naming the holder's pid, for {lk['within_lock_wait_said']}; ROLLBACK → next "
            f"commit p50 {_fmt(lk['release_to_commit_p50_s'])} s, max "
            f"{_fmt(lk['release_to_commit_max_s'])} s. {lk['past_lock_wait']} held "
            f"{SHORT_HOLD_S:g} s past `--lock-wait {SHORT_LOCK_WAIT_S:g}`: masters stopped with "
            f"exit 3: {lk['past_lock_wait_stopped']} (judged: {lk['past_lock_wait_judged']}, "
            f"the others were killed meanwhile or had nothing left to write); ROLLBACK → the "
            f"resumed master's first commit p50 {_fmt(lk['release_to_resumed_commit_p50_s'])} "
            f"s, max {_fmt(lk['release_to_resumed_commit_max_s'])} s.")
    alias = (f"- `aliased_file` ({al['trials']} trials, {al['linked']} links): {al['refused']} "
             f"of {al['commands']} commands on the second name (`run --resume`, `status`, "
             f"`check`) refused it with exit 2 and \"has 2 names\", nothing made beside it; "
             f"the master ran from the link to the last answer in {al['while_master_ran']} "
             f"trials (link → last answer p50 {_fmt(al['last_answer_p50_s'])} s, max "
             f"{_fmt(al['last_answer_max_s'])} s: the commands were started, their modules "
             f"loaded, before the trial).")
    crash = (f"- `startup_crash` ({sc['trials']} trials, {sc['killed']} kills, "
             f"{sc['before_first_dispatch']} before the master's first dispatch): "
             f"{sc['without_ulfm']} without ULFM (the job ends; finished before the launcher "
             f"ended it: {sc['without_ulfm_run_finished_anyway']}), kill → first result of the "
             f"resumed job p50 {_fmt(sc['kill_to_resumed_result_p50_s'])} s, max "
             f"{_fmt(sc['kill_to_resumed_result_max_s'])} s; {sc['ulfm']} under ULFM, went on "
             f"without the rank: {sc['ulfm_went_on']} (the others were ended by this harness "
             f"first), kill → `worker_failed` p50 "
             f"{_fmt(sc['ulfm_kill_to_worker_failed_p50_s'])} s, max "
             f"{_fmt(sc['ulfm_kill_to_worker_failed_max_s'])} s.")
    return ["## The operator's environment", "", lock, alias, crash, ""]


def markdown(report: dict[str, Any]) -> str:
    cols = [("trials", "trials"), ("faults injected", "faults_injected"),
            ("lost", "tasks_lost"), ("wrong", "wrong_commits"), ("dup", "duplicate_commits"),
            ("integrity fail", "integrity_failures"), ("incomplete", "incomplete_trials"),
            ("restarts", "restarts"), ("recovered", "recovered_tasks"),
            ("recovery rate", "recovery_rate"), ("latency p50 s", "recovery_latency_p50_s"),
            ("latency p99 s", "recovery_latency_p99_s"), ("latency n", "recovery_latency_n"),
            ("dispatches/commit", "extra_executions"), ("wall s", "wall_time_s")]
    head = "| kind | " + " | ".join(c for c, _ in cols) + " |"
    sep = "| --- |" + " --- |" * len(cols)

    def row(name: str, s: dict[str, Any]) -> str:
        return f"| {name} | " + " | ".join(_fmt(s[k]) for _, k in cols) + " |"

    lines = [
        "# Fault campaign report", "",
        "Produced by:", "", "```sh", f"cd {shlex.quote(report['cwd'])} && {report['command']}",
        "```", "",
        f"{report['trials']} trials of {report['tasks_per_trial']} demo tasks on "
        f"{report['workers']} workers (Open MPI: {report['mpi']}), seed {report['seed']}, "
        f"kill fraction {report['kill_fraction']}, batch fraction "
        f"{report.get('batch_fraction', 0)} (--batch "
        f"{', '.join(report.get('batch_sizes', map(str, BATCH_SIZES)))}), per-job limit "
        f"{report['timeout_per_job']} s, up to {report['max_restarts']} restarts per trial; "
        f"total wall time {report['wall_time_s']} s (trial p50 "
        f"{_fmt(report['trial_wall_p50_s'], 1)} s, max {_fmt(report['trial_wall_max_s'], 1)} s)."
        , "",
        "A trial's outcomes count for every kind in its plan; *faults injected* and the "
        "latency columns count only faults of that kind (latency: from the fault's time in the "
        "inject log to the task being back in the queue, for kinds that break a dispatch; for "
        "`kill_*` it includes the harness's relaunch; for `held_lock`, from the ROLLBACK to the "
        "campaign's next commit; for `startup_crash`, from the kill to the first result of the "
        "relaunched job, or under ULFM to the master's `worker_failed` event; none for "
        "`aliased_file`, which must change nothing). The *all* row's latency is the injected "
        "kinds' only. *dispatches/commit* = sum(tasks.dispatches) / count(results).", "",
        "## Overall", "", head, sep, row("**all**", report), "",
        "## Per fault kind", "", head, sep,
        *[row(f"`{k}`", s) for k, s in report["per_kind"].items()], "",
        "## Per batch size (`--batch`)", "",
        "A batched dispatch that breaks is split in halves and requeued without charging its "
        "tasks; only a single task's dispatch is charged an attempt.", "", head, sep,
        *[row(k, s) for k, s in report.get("per_batch", {}).items()], "",
        "## How jobs ended", "",
        "`exit N`: mpiexec's own exit status (137: a worker's injected SIGKILL took the job "
        "down; 4 or 140: the master ended ranks that never acknowledged STOP, 140 being the "
        "SIGUSR2 status of the hung rank it ended); `harness_kill`, `stall` (every worker "
        "SIGSTOPped with work left) and `timeout`: killed by this tool; `launcher_failed`: "
        "Open MPI's launcher did not start (nothing ran; run again).",
        "",
        ", ".join(f"{k}: {v}" for k, v in sorted(report["job_ends"].items())) or "—", "",
        "The masters' own exit statuses (recorded beside `--master-pid-file`; *killed*: "
        "none recorded, the launcher or this tool ended it): "
        + (", ".join(f"{k}: {v}" for k, v in sorted(report["master_ends"].items())) or "—")
        + ".", "",
        f"Harness kills fired: {report['harness_kills']} "
        f"({report.get('harness_kills_mid_run', '—')} mid-run: after a result of that launch, "
        f"with dispatches in flight); statistics mismatches: "
        f"{report['stats_mismatches']}; leftover dispatch/lease rows: "
        f"{report['leftover_rows']}; trials failing a fault kind's own checks: "
        f"{report['kind_failures']}.", "",
        *_harness_markdown(report["harness_faults"]),
    ]
    if report["failures"]:
        lines += ["## Failed trials", ""]
        for f in report["failures"]:
            lines.append(f"- trial {f['trial']} (`{f['inject']}`, {f['dir']}); reproduce "
                         f"with the command above plus `--only {f['trial']} --keep`:")
            lines += [f"  - {p}" for p in f["problems"]]
        lines.append("")
    if report["incomplete"]:
        lines += ["## Incomplete trials (restart budget exhausted)", "",
                  "Reported only (`--allow-incomplete`)." if report.get("allow_incomplete")
                  else "Each fails the run: a campaign that could not finish.", ""]
        lines += [f"- trial {i['trial']} (`{i['inject']}`, {i['restarts']} restarts): "
                  f"{i['states']} — {i['dir']}" for i in report["incomplete"]]
        lines.append("")
    if report["unusual_exits"]:
        lines += ["## Unusual mpiexec exits (campaign checks still apply)", ""]
        lines += [f"- trial {u['trial']} (`{u['inject']}`): exit statuses {u['exit_codes']} "
                  f"— {u['dir']}" for u in report["unusual_exits"]]
        lines.append("")
    verdict = "FAIL" if report["failed_trials"] else "PASS"
    lines += [f"**Verdict: {verdict}** ({report['failed_trials']} failed trials)", ""]
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=200, help="trials (default 200)")
    p.add_argument("--seed", type=int, default=1, help="campaign RNG seed (default 1)")
    p.add_argument("--tasks", type=int, default=40, help="demo tasks per trial (default 40)")
    p.add_argument("--workers", type=int, default=3, help="worker ranks (default 3)")
    p.add_argument("--work-ms", type=float, default=20.0,
                   help="--demo-work-ms per task (default 20: a trial's campaign lasts long "
                        "enough for the harness's kill to land mid-flight)")
    p.add_argument("--watchdog", type=float, default=2.0, help="--watchdog S (default 2)")
    p.add_argument("--kill-fraction", type=float, default=0.3,
                   help="fraction of trials whose job the harness SIGKILLs once (default 0.3)")
    p.add_argument("--batch-fraction", type=float, default=0.25,
                   help="fraction of trials run with one of --batch-sizes (default 0.25)")
    p.add_argument("--batch-sizes", type=batch_sizes, default=BATCH_SIZES, metavar="N,...",
                   help="the --batch values a batched trial draws from: sizes of 2..1000 or "
                        "auto (default 2,4,8,16)")
    p.add_argument("--timeout-per-job", type=float, default=30.0,
                   help="wall-clock bound of one mpiexec job, then killed and resumed "
                        "(default 30)")
    p.add_argument("--max-restarts", type=int, default=20,
                   help="--resume runs per trial before it counts as incomplete (default 20)")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="report an incomplete trial without failing the run (default: it "
                        "fails it)")
    p.add_argument("--same-inject-seed", action="store_true",
                   help="resume with the same --inject-seed (default: seed + run number)")
    p.add_argument("--json", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--markdown", type=Path, default=None, help="write the Markdown report here")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where trial directories go (default: a new directory in /tmp)")
    p.add_argument("--only", default=None, metavar="N[,N...]",
                   help="run only these trials (1-based, as printed) of the seeded sequence: "
                        "reproduces a trial of a longer campaign")
    p.add_argument("--keep", action="store_true",
                   help="keep every trial's directory (default: only failed or incomplete)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.trials < 1 or ns.tasks < 1 or ns.workers < 1:
        print("fault_campaign: --trials, --tasks and --workers must be >= 1", file=sys.stderr)
        return 2
    for name in ("kill_fraction", "batch_fraction"):
        if not 0.0 <= getattr(ns, name) <= 1.0:
            print(f"fault_campaign: --{name.replace('_', '-')} must be in 0..1", file=sys.stderr)
            return 2
    mpi = subprocess.run([mpiexec_command(2, [])[0], "--version"], capture_output=True,
                         text=True, timeout=60).stdout.splitlines()[:1]
    opts = Options(tasks=ns.tasks, workers=ns.workers, work_ms=ns.work_ms,
                   watchdog_s=ns.watchdog, timeout_per_job=ns.timeout_per_job,
                   max_restarts=ns.max_restarts, same_inject_seed=ns.same_inject_seed,
                   ulfm=bool(mpi) and "Open MPI" in mpi[0],
                   allow_incomplete=ns.allow_incomplete)
    workdir = ns.workdir or Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else \
        shlex.join([sys.executable, str(Path(__file__).resolve()), *argv])
    plans = draw_plans(ns.trials, ns.seed, ns.tasks, ns.kill_fraction, ns.workers,
                       ns.batch_fraction, ns.batch_sizes, ns.work_ms)
    if ns.only:
        try:
            wanted = {int(x) for x in ns.only.split(",") if x.strip()}
        except ValueError:
            print("fault_campaign: --only takes trial numbers, e.g. 3,17", file=sys.stderr)
            return 2
        plans = [p for p in plans if p.index + 1 in wanted]
        if not plans:
            print("fault_campaign: --only selects no trial of --trials", file=sys.stderr)
            return 2
    print(f"fault_campaign: {len(plans)} trials, seed {ns.seed}, {ns.tasks} tasks, "
          f"{ns.workers} workers, in {workdir}", flush=True)
    trials: list[dict[str, Any]] = []
    started = time.monotonic()
    for plan in plans:
        tdir = workdir / f"trial-{plan.index:04d}"
        t = run_trial(plan, tdir, opts)
        trials.append(t)
        bad = trial_failed(t)
        if not (bad or not t["complete"] or unusual_exits(t) or ns.keep):
            shutil.rmtree(tdir, ignore_errors=True)
        lat = t["latency_overall"]
        landed = t["kill_landed"] or {}
        kill = "" if not t["kill"] else " kill=" + (
            "missed" if not t["kill_fired"] else "fired/mid-run" if landed.get("mid_run")
            else "fired/after-start" if landed.get("after_start") else "fired/before-start")
        ends = ",".join(f"{j['ended_by']}:{j['exit_code']}" for j in t["runs"])
        print(f"trial {plan.index + 1:>4}/{ns.trials} [{t['label']}]{kill} runs={ends} "
              f"{'complete' if t['complete'] else 'INCOMPLETE'} "
              f"done={t['states'].get('done', 0)}/{ns.tasks} lost={t['tasks_lost']} "
              f"wrong={t['wrong_commits']} dup={t['duplicate_commits']} "
              f"integrity={'ok' if t['integrity_ok'] else 'FAIL'} "
              f"stats={'ok' if not t['stats_mismatches'] else 'MISMATCH'} "
              f"faults={sum(t['faults'].values())} "
              f"recovered={t['recovered_done']}/{t['recovered_tasks']} "
              f"lat_p50={_fmt(_percentile(lat, 0.5))}s {t['wall_s']:.1f}s"
              + (" FAILED" if bad else ""), flush=True)
        for p in (t["kind_problems"] + t["problems"])[:5] if bad else []:
            print(f"    {p}", flush=True)
    meta = {"command": command, "cwd": os.getcwd(), "seed": ns.seed, "tasks_per_trial": ns.tasks,
            "workers": ns.workers, "kill_fraction": ns.kill_fraction,
            "batch_fraction": ns.batch_fraction,
            "batch_sizes": [batch_arg(b) for b in ns.batch_sizes],
            "timeout_per_job": ns.timeout_per_job, "max_restarts": ns.max_restarts,
            "allow_incomplete": ns.allow_incomplete,
            "watchdog_s": ns.watchdog, "work_ms": ns.work_ms,
            "same_inject_seed": ns.same_inject_seed, "mpi": mpi[0] if mpi else "?",
            "workdir": str(workdir), "elapsed_s": round(time.monotonic() - started, 2)}
    report = build_report(trials, meta)
    if ns.json:
        ns.json.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    if ns.markdown:
        ns.markdown.write_text(markdown(report))
    print(f"fault_campaign: {report['trials']} trials in {report['elapsed_s']} s: "
          f"faults={report['faults_injected']} lost={report['tasks_lost']} "
          f"wrong={report['wrong_commits']} dup={report['duplicate_commits']} "
          f"integrity_failures={report['integrity_failures']} "
          f"stats_mismatches={report['stats_mismatches']} "
          f"leftover_rows={report['leftover_rows']} "
          f"kind_failures={report['kind_failures']} "
          f"incomplete={report['incomplete_trials']} restarts={report['restarts']} "
          f"kills={report['harness_kills']} mid_run={report['harness_kills_mid_run']} "
          f"recovery_rate={_fmt(report['recovery_rate'])} "
          f"latency p50={_fmt(report['recovery_latency_p50_s'])}s "
          f"p99={_fmt(report['recovery_latency_p99_s'])}s "
          f"dispatches/commit={_fmt(report['extra_executions'])}", flush=True)
    if report["failed_trials"]:
        print(f"fault_campaign: {report['failed_trials']} trials FAILED (kept in {workdir})",
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
