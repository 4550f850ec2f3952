"""Fault campaign: M trials of real `mpiexec` jobs with random fault plans, each checked from
its database alone.

    python tools/fault_campaign.py                              # 200 trials, 40 tasks, 3 workers
    python tools/fault_campaign.py --trials 20 --seed 7 --json r.json --markdown r.md

Each trial is a fresh campaign: `coordinator run --demo T` under `mpiexec -n W+1` with a plan of
1–4 fault kinds (`--inject`, rates 0.02–0.3, log-uniform) drawn from a seeded RNG; every kind
leads a trial once per 16 trials, so a long campaign covers all of them. In `--kill-fraction` of
the trials the harness SIGKILLs the whole job once at a random moment (by wall time, or once a
random number of results has committed). Whatever ends a job — its own exit, a worker's
injected SIGKILL (which takes an Open MPI job without ULFM down), the harness's kill, the
per-job time limit, or a stall (every worker SIGSTOPped by `hang` with nothing in flight) —
the harness kills what is left of it (every rank found in /proc by the database path, then
mpiexec's process group: Open MPI gives each rank a process group of its own) and reruns the
same command with `--resume`, until the master reports the campaign finished or
`--max-restarts` is exhausted (an *incomplete* trial, reported).

Each resumed run gets `--inject-seed base+run` (the worker RNGs restart at every launch, so
with one seed every incarnation would replay the same faults in the same places);
`--same-inject-seed` keeps the seed fixed instead.

After a trial, read-only from the database (plus the inject logs): every one of the T tasks
exists and is done, deferred or failed, none active, no dispatch or lease rows; every dispatch
has one record (its results row, or a `dispatched` event if it ended without a result); every
result comes from a token dispatched for its task and never rolled back (no recovered / watchdog /
interrupted / stop_requeued / task_failed / send_failed / worker_failed event), carries its own
task's value, and is not a token whose RESULT was never validly sent (a breaking fault fired on
it); one result per task (the schema allows no other), only for done tasks;
`PRAGMA integrity_check` ok; `coordinator status --json` equals SQL counts over the rows.
The rules that hold for any campaign are `store.audit`'s; this tool adds what only it knows
(the T tasks and their values, the faults it injected, a finished run's end state).

Exit status 1 if any trial lost a task, committed wrongly or twice, failed integrity, left
dispatch/lease rows behind or had statistics disagreeing with its rows; else 0. Incomplete
trials (restart budget exhausted) are reported but do not fail the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import Connection  # noqa: E402
from sqlalchemy.exc import DBAPIError  # noqa: E402

from coordinator.faults import KINDS  # noqa: E402
from coordinator.launcher import LAUNCHER_FAILED, find_mpiexec, mpiexec_flags  # noqa: E402
from store.audit import Check, ViolationKind, audit  # noqa: E402
from store.engine import open_readonly  # noqa: E402
from store.errors import NoCampaignYet, StoreError  # noqa: E402
from store.schema import COUNTED_KIND_SQL  # noqa: E402

ALL_KINDS: tuple[str, ...] = tuple(KINDS)

#: Kinds after which the dispatch normally cannot commit from its own RESULT: the master must
#: roll it back (recovered, watchdog, or interrupted at the next --resume). Recovery latency is
#: measured from these.
BREAKING: frozenset[str] = frozenset({
    "result_missing_token", "result_bad_token", "result_list_token", "result_not_mapping",
    "result_garbage", "result_stale", "result_drop", "kill_before_result", "kill_after_result",
    "hang"})
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
RATE_MIN, RATE_MAX = 0.02, 0.3


# -- plans ---------------------------------------------------------------------------------

@dataclass
class KillPlan:
    mode: str            # "time": at_s after launch; "progress": once `after_results` committed
    at_s: float = 0.0
    after_results: int = 0
    delay_s: float = 0.0


@dataclass
class TrialPlan:
    index: int
    rates: dict[str, float]
    inject_seed: int
    kill: KillPlan | None

    def inject_spec(self) -> str:
        return ",".join(f"{k}={r:g}" for k, r in self.rates.items())


def draw_plans(n: int, seed: int, tasks: int, kill_fraction: float) -> list[TrialPlan]:
    """`n` trial plans from one seeded RNG. Each plan's first kind comes from a shuffled deck
    of all kinds (refilled when empty), so every kind leads one trial in each run of
    len(KINDS) trials; 0–3 more distinct kinds join it. Rates are log-uniform in 0.02–0.3."""
    rng = random.Random(seed)
    deck: list[str] = []
    plans = []
    for i in range(n):
        if not deck:
            deck = list(ALL_KINDS)
            rng.shuffle(deck)
        kinds = [deck.pop()]
        extra = rng.randint(1, 4) - 1
        kinds += rng.sample([k for k in ALL_KINDS if k != kinds[0]], extra)
        rates = {k: round(math.exp(rng.uniform(math.log(RATE_MIN), math.log(RATE_MAX))), 3)
                 for k in kinds}
        kill = None
        if rng.random() < kill_fraction:
            if rng.random() < 0.3:
                kill = KillPlan("time", at_s=round(rng.uniform(0.2, 3.0), 3))
            else:
                kill = KillPlan("progress", after_results=rng.randint(1, max(1, tasks - 1)),
                                delay_s=round(rng.uniform(0.0, 0.05), 3))
        plans.append(TrialPlan(i, rates, rng.randrange(1, 2**31), kill))
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


_MPIEXEC: str | None = None
_FLAGS: dict[int, list[str]] = {}


def mpiexec_command(np: int, args: list[str]) -> list[str]:
    global _MPIEXEC
    if _MPIEXEC is None:
        _MPIEXEC = find_mpiexec()
        if _MPIEXEC is None:
            raise SystemExit("fault_campaign: no mpiexec beside this Python or on PATH")
    if np not in _FLAGS:
        _FLAGS[np] = mpiexec_flags(_MPIEXEC, np)
    return [_MPIEXEC, *_FLAGS[np], sys.executable, "-m", "coordinator", *args]


def run_args(db: Path, plan: TrialPlan, opts: Options, inject_dir: Path, run: int) -> list[str]:
    seed = plan.inject_seed if opts.same_inject_seed else plan.inject_seed + run
    args = ["run", "--db", str(db), "--demo", str(opts.tasks), "--demo-work-ms",
            f"{opts.work_ms:g}", "--inject", plan.inject_spec(), "--inject-seed", str(seed),
            "--inject-log", str(inject_dir), "--watchdog", f"{opts.watchdog_s:g}",
            "--retries", "16", "--max-attempts", "50", "--grace", "1", "--stop-wait", "3",
            "--no-progress"]
    if run > 0:
        args.append("--resume")
    return args


def _ro(db: Path, timeout: float = 2.0) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=timeout)


def _scalar(db: Path, sql: str) -> Any:
    """One value read from a running campaign, or None if it cannot be read (yet)."""
    if not db.exists():
        return None
    try:
        c = _ro(db)
        try:
            row = c.execute(sql).fetchone()
        finally:
            c.close()
        return row[0] if row else None
    except sqlite3.Error:
        return None


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


class KillTrigger:
    """The harness's one SIGKILL of a trial, pending until it fires (across runs)."""

    def __init__(self, plan: KillPlan | None):
        self.plan = plan
        self.fired = False
        self._deadline: float | None = None
        self._next_poll = 0.0

    def due(self, mon: DbMonitor, elapsed: float) -> bool:
        p = self.plan
        if p is None or self.fired:
            return False
        now = time.monotonic()
        if p.mode == "time":
            return elapsed >= p.at_s
        if self._deadline is not None:
            return now >= self._deadline
        if now >= self._next_poll:
            self._next_poll = now + 0.005
            n = mon.scalar("SELECT count(*) FROM results")
            if n is not None and n >= p.after_results:
                self._deadline = now + p.delay_s
        return False


def run_job(cmd: list[str], db: Path, log_base: Path, opts: Options, trigger: KillTrigger,
            run: int, resume: bool, inject_seed: int) -> JobRun:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out_path, err_path = log_base.with_suffix(".out"), log_base.with_suffix(".err")
    t0 = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        ended_by = "exit"
        mon = DbMonitor(db)
        all_stopped_since: float | None = None
        next_stall_check = t0 + 0.5
        while proc.poll() is None:
            now = time.monotonic()
            elapsed = now - t0
            if elapsed > opts.timeout_per_job:
                ended_by = "timeout"
                break
            if trigger.due(mon, elapsed):
                trigger.fired = True
                ended_by = "harness_kill"
                break
            if now >= next_stall_check:
                next_stall_check = now + 0.25
                stopped = [p for p in ranks_of(db) if _stopped(p)]
                if len(stopped) >= opts.workers:
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
        mon.close()
    seconds = time.monotonic() - t0
    if ended_by == "exit" and LAUNCHER_FAILED in err_path.read_text(errors="replace"):
        ended_by = "launcher_failed"  # Open MPI's own flake (exit 213): nothing ran; rerun
    finished = FINISHED_MARK in out_path.read_text(errors="replace")
    return JobRun(run, resume, inject_seed, ended_by, proc.returncode, round(seconds, 3),
                  finished, _scalar(db, "SELECT count(*) FROM results"),
                  _scalar(db, "SELECT count(*) FROM dispatches"))


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
                   inject_dir: Path | None = None, stats: bool = True) -> dict[str, Any]:
    """Everything the brief asks of a finished trial, read-only from `db` (and the inject
    logs for fault counts, latencies and commits of tokens whose RESULT never validly left).

    The store's own rules are `store.audit`'s; this adds what only the harness knows (the
    tasks it enqueued and their values, the faults it injected, a finished run's end state).
    `complete=False` (restart budget exhausted: the last job was killed mid-flight) skips the
    final-state checks (queued/active tasks, dispatch and lease rows) and keeps the safety
    checks. Returns counts and a list of human-readable problems."""
    r: dict[str, Any] = {
        "tasks_lost": 0, "wrong_commits": 0, "duplicate_commits": 0, "integrity_ok": True,
        "leftover_rows": 0, "stats_mismatches": 0, "fk_violations": 0, "problems": [],
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
                return _check(conn, r, expected_tasks, complete, records, db, stats)
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
           records: list[dict], db: Path, stats: bool) -> dict[str, Any]:
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
    if not r["integrity_ok"]:
        return r  # the audit read no rows of a damaged file; nor does the harness

    # -- lost tasks --------------------------------------------------------------------------
    r["tasks"] = one("SELECT count(*) FROM tasks")
    r["states"] = dict(q("SELECT state, count(*) FROM tasks GROUP BY state"))
    present = {n for (n,) in q("SELECT json_extract(payload, '$.data.n') FROM tasks")}
    missing = sorted(set(range(expected)) - present)
    if missing:
        problems.append(f"{len(missing)} of the {expected} tasks have no row (n={missing[:10]})")
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


# -- one trial -----------------------------------------------------------------------------

def run_trial(plan: TrialPlan, trial_dir: Path, opts: Options) -> dict[str, Any]:
    trial_dir.mkdir(parents=True, exist_ok=True)
    db, inject_dir = trial_dir / "c.db", trial_dir / "inject"
    t0 = time.monotonic()
    trigger = KillTrigger(plan.kill)
    runs: list[JobRun] = []
    for run in range(opts.max_restarts + 1):
        args = run_args(db, plan, opts, inject_dir, run)
        seed = int(args[args.index("--inject-seed") + 1])
        job = run_job(mpiexec_command(opts.workers + 1, args), db, trial_dir / f"run{run:02d}",
                      opts, trigger, run, run > 0, seed)
        runs.append(job)
        if job.finished:
            break
    complete = bool(runs and runs[-1].finished)
    check = check_campaign(db, opts.tasks, complete=complete, inject_dir=inject_dir)
    first = mpiexec_command(opts.workers + 1, run_args(db, plan, opts, inject_dir, 0))
    return {
        "index": plan.index, "trial": plan.index + 1, "plan": plan.rates,
        "inject": plan.inject_spec(), "inject_seed": plan.inject_seed,
        "kill": asdict(plan.kill) if plan.kill else None, "kill_fired": trigger.fired,
        "runs": [asdict(j) for j in runs], "restarts": len(runs) - 1, "complete": complete,
        "wall_s": round(time.monotonic() - t0, 3), "dir": str(trial_dir),
        "command": shlex.join(first),
        **{k: check[k] for k in ("tasks_lost", "wrong_commits", "duplicate_commits",
                                 "integrity_ok", "leftover_rows", "stats_mismatches",
                                 "fk_violations", "problems", "tasks", "states", "results",
                                 "dispatches_sum", "recovered_tasks", "recovered_done",
                                 "faults", "torn_log_lines", "latency", "latency_overall",
                                 "events", "incarnation")},
    }


#: mpiexec exit statuses this harness expects: done, aborted unacknowledged ranks (4), a worker's
#: injected SIGKILL brought the job down (137), a hung rank the master ended with SIGUSR2 (140:
#: mpiexec reports that rank's status, not the master's 4).
EXPECTED_EXITS = (0, 4, 137, 140)


def unusual_exits(t: dict[str, Any]) -> list[int | None]:
    """Exit statuses of runs that ended on their own in a way this harness does not expect
    (e.g. mpiexec killed by a signal of its own): kept and listed for a post-mortem."""
    return [j["exit_code"] for j in t["runs"]
            if j["ended_by"] == "exit" and j["exit_code"] not in EXPECTED_EXITS]


def trial_failed(t: dict[str, Any]) -> bool:
    return bool(t["tasks_lost"] or t["wrong_commits"] or t["duplicate_commits"]
                or not t["integrity_ok"] or t["leftover_rows"] or t["stats_mismatches"])


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
    return {
        "trials": len(trials),
        "faults_injected": faults,
        "tasks_lost": sum(t["tasks_lost"] for t in trials),
        "wrong_commits": sum(t["wrong_commits"] for t in trials),
        "duplicate_commits": sum(t["duplicate_commits"] for t in trials),
        "integrity_failures": sum(not t["integrity_ok"] for t in trials),
        "leftover_rows": sum(t["leftover_rows"] for t in trials),
        "stats_mismatches": sum(t["stats_mismatches"] for t in trials),
        "failed_trials": sum(trial_failed(t) for t in trials),
        "incomplete_trials": sum(not t["complete"] for t in trials),
        "harness_kills": sum(t["kill_fired"] for t in trials),
        "restarts": sum(t["restarts"] for t in trials),
        "job_ends": dict(ended),
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


def build_report(trials: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    report = {**meta, **_summarise(trials)}
    report["per_kind"] = {k: _summarise([t for t in trials if k in t["plan"]], faults_of=k)
                          for k in ALL_KINDS}
    report["failures"] = [{"trial": t["trial"], "dir": t["dir"], "inject": t["inject"],
                           "problems": t["problems"][:20]} for t in trials if trial_failed(t)]
    report["incomplete"] = [{"trial": t["trial"], "dir": t["dir"], "inject": t["inject"],
                             "restarts": t["restarts"], "states": t["states"]}
                            for t in trials if not t["complete"]]
    report["unusual_exits"] = [{"trial": t["trial"], "dir": t["dir"], "inject": t["inject"],
                                "exit_codes": unusual_exits(t)}
                               for t in trials if unusual_exits(t)]
    report["trials_detail"] = trials
    return report


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


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
        f"kill fraction {report['kill_fraction']}, per-job limit "
        f"{report['timeout_per_job']} s, up to {report['max_restarts']} restarts per trial; "
        f"total wall time {report['wall_time_s']} s (trial p50 "
        f"{_fmt(report['trial_wall_p50_s'], 1)} s, max {_fmt(report['trial_wall_max_s'], 1)} s)."
        , "",
        "A trial's outcomes count for every kind in its plan; *faults injected* and the "
        "latency columns count only faults of that kind (latency: from the fault's time in the "
        "inject log to the task being back in the queue, for kinds that break a dispatch; for "
        "`kill_*` it includes the harness's relaunch). *dispatches/commit* = "
        "sum(tasks.dispatches) / count(results).", "",
        "## Overall", "", head, sep, row("**all**", report), "",
        "## Per fault kind", "", head, sep,
        *[row(f"`{k}`", s) for k, s in report["per_kind"].items()], "",
        "## How jobs ended", "",
        "`exit N`: mpiexec's own exit status (137: a worker's injected SIGKILL took the job "
        "down; 4 or 140: the master ended ranks that never acknowledged STOP, 140 being the "
        "SIGUSR2 status of the hung rank it ended); `harness_kill`, `stall` (every worker "
        "SIGSTOPped with work left) and `timeout`: killed by this tool; `launcher_failed`: "
        "Open MPI's launcher did not start (nothing ran; run again).",
        "",
        ", ".join(f"{k}: {v}" for k, v in sorted(report["job_ends"].items())) or "—", "",
        f"Harness kills fired: {report['harness_kills']}; statistics mismatches: "
        f"{report['stats_mismatches']}; leftover dispatch/lease rows: "
        f"{report['leftover_rows']}.", "",
    ]
    if report["failures"]:
        lines += ["## Failed trials", ""]
        for f in report["failures"]:
            lines.append(f"- trial {f['trial']} (`{f['inject']}`, {f['dir']}); reproduce "
                         f"with the command above plus `--only {f['trial']} --keep`:")
            lines += [f"  - {p}" for p in f["problems"]]
        lines.append("")
    if report["incomplete"]:
        lines += ["## Incomplete trials (restart budget exhausted)", ""]
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
    p.add_argument("--timeout-per-job", type=float, default=30.0,
                   help="wall-clock bound of one mpiexec job, then killed and resumed "
                        "(default 30)")
    p.add_argument("--max-restarts", type=int, default=20,
                   help="--resume runs per trial before it counts as incomplete (default 20)")
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
    if not 0.0 <= ns.kill_fraction <= 1.0:
        print("fault_campaign: --kill-fraction must be in 0..1", file=sys.stderr)
        return 2
    opts = Options(tasks=ns.tasks, workers=ns.workers, work_ms=ns.work_ms,
                   watchdog_s=ns.watchdog, timeout_per_job=ns.timeout_per_job,
                   max_restarts=ns.max_restarts, same_inject_seed=ns.same_inject_seed)
    workdir = ns.workdir or Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else \
        shlex.join([sys.executable, str(Path(__file__).resolve()), *argv])
    mpi = subprocess.run([mpiexec_command(2, [])[0], "--version"], capture_output=True,
                         text=True, timeout=60).stdout.splitlines()[:1]
    plans = draw_plans(ns.trials, ns.seed, ns.tasks, ns.kill_fraction)
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
        kill = "" if not t["kill"] else f" kill={'fired' if t['kill_fired'] else 'missed'}"
        ends = ",".join(f"{j['ended_by']}:{j['exit_code']}" for j in t["runs"])
        print(f"trial {plan.index + 1:>4}/{ns.trials} [{t['inject']}]{kill} runs={ends} "
              f"{'complete' if t['complete'] else 'INCOMPLETE'} "
              f"done={t['states'].get('done', 0)}/{ns.tasks} lost={t['tasks_lost']} "
              f"wrong={t['wrong_commits']} dup={t['duplicate_commits']} "
              f"integrity={'ok' if t['integrity_ok'] else 'FAIL'} "
              f"stats={'ok' if not t['stats_mismatches'] else 'MISMATCH'} "
              f"faults={sum(t['faults'].values())} "
              f"recovered={t['recovered_done']}/{t['recovered_tasks']} "
              f"lat_p50={_fmt(_percentile(lat, 0.5))}s {t['wall_s']:.1f}s"
              + (" FAILED" if bad else ""), flush=True)
        for p in t["problems"][:5] if bad else []:
            print(f"    {p}", flush=True)
    meta = {"command": command, "cwd": os.getcwd(), "seed": ns.seed, "tasks_per_trial": ns.tasks,
            "workers": ns.workers, "kill_fraction": ns.kill_fraction,
            "timeout_per_job": ns.timeout_per_job, "max_restarts": ns.max_restarts,
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
          f"incomplete={report['incomplete_trials']} restarts={report['restarts']} "
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
