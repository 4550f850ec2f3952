"""What the master's round costs without MPI: the real Master and store, the tests' fake transport
whose workers answer every WORK at once (`tests/fakes.py`: RESULT and READY), N demo tasks.

    python tools/round_cost.py                  # 10,000 tasks, 3 workers, FULL and NORMAL
    python tools/round_cost.py --tasks 3000 --workers 1 --sync FULL
    python tools/round_cost.py --tasks 30000 --batch 100 --sync FULL --floor
    python tools/round_cost.py --tasks 3000 --sync FULL --holders 0 --holders 600

For each synchronous mode: tasks/s and µs per transaction of the master alone (the ceiling
the MPI benchmark `tools/bench.py` can approach), then, in a second pass with SQLite's trace
callback on, SQL statement executions per task (`executemany` rows included; the initial
enqueue excluded) and WAL frames (pages written) per commit. Workers here cost nothing, so
the figures isolate what the database and the master's Python spend on each task.

`--floor` (batches) adds a peer in the same run: the rows the protocol writes per task, and
nothing else, by bare `sqlite3` statements on the same schema, file system and synchronous
mode, each in the cheapest form known (one statement per batch; no Python per task but the
collecting of its id). Per round: each batch's queue read, dispatch row, tasks to active and
work leases, COMMIT; then each batch's result rows, tasks to done, dispatch and leases
deleted, COMMIT. Its last line,
`master=<tasks/s> floor=<tasks/s> ratio=<x>`, says how close the master comes to what SQLite
alone allows, and the floor's µs per task by statement says where that goes.
It also times two leaner shapes that a change of the protocol's shape could at best reach,
one transaction per round and no task row written at dispatch: "one state write" (each task
goes from queued to done once, beside its result row) and "result rows only" (no task row
written at all). Neither is a design: they say what such a change could buy, set beside
`tools/bench.py --batch 100`'s futures figure from the same hour.

`--holders K` (repeatable) adds K ranks that each hold one dispatch all run long, as ranks
running long tasks do, and answer only once the instant workers have done the rest: the
master's CPU per task should not depend on K (a round's cost follows the answers it handles,
not the ranks that exist). Its last line is `holders=<K>:<µs per task> ... ratio=<x>`, the
ratio of the last K's µs per task to the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' fake transports: `fakes.InstantWorkers`

from fakes import InstantWorkers  # noqa: E402

from coordinator.master import Master, MasterConfig  # noqa: E402
from coordinator.sources import demo_tasks  # noqa: E402
from coordinator.wire import decode_work  # noqa: E402
from store.campaign import Store  # noqa: E402
from store.tasks import enqueue_tasks  # noqa: E402


class Holders(InstantWorkers):
    """`workers` instant ranks, then `holders` ranks that keep their first WORK unanswered
    until the instant ranks have been sent `release_after` tasks, and then answer at once."""

    def __init__(self, workers: int, holders: int, release_after: int):
        super().__init__(workers + holders)
        self.instant, self.release_after = workers, release_after
        self.sent_to_instant = 0
        self.held: list[tuple[int, bytes]] = []

    def send_work(self, data: bytes, dest: int) -> None:
        if dest > self.instant and not self.released:
            self.held.append((dest, data))
            return
        if dest <= self.instant:
            self.sent_to_instant += len(decode_work(data).tasks())
        super().send_work(data, dest)

    @property
    def released(self) -> bool:
        return self.sent_to_instant >= self.release_after

    def drain(self, tag: int, limit: int = 10_000, max_bytes: int | None = None):
        # The held WORKs are answered here, where the master looks for answers.
        if self.released and self.held:
            held, self.held = self.held, []
            for rank, work in held:
                super().send_work(work, rank)
        yield from super().drain(tag, limit)


def run_once(tasks: int, workers: int, sync: str, *, trace: bool,
             batch: int | None = 1, holders: int = 0) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        store = Store.open(Path(d) / "round.db", synchronous=sync)
        try:
            with store.transaction("import") as tx:
                enqueue_tasks(tx, [t.as_task() for t in demo_tasks(tasks)])
            raw = store._connection().connection.driver_connection
            statements = 0
            if trace:
                def count(_sql: str) -> None:
                    nonlocal statements
                    statements += 1
                raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                raw.execute("PRAGMA wal_autocheckpoint = 0")  # the WAL then counts the frames
                raw.set_trace_callback(count)
            ranks = (Holders(workers, holders, tasks - holders * (batch or 1)) if holders
                     else InstantWorkers(workers))
            master = Master(store, ranks, MasterConfig(
                stats_file=Path(d) / "stats", progress=False, linger_s=0, grace_s=1,
                stop_wait_s=1, batch=batch))
            started = time.perf_counter()
            summary = master.run()
            elapsed = time.perf_counter() - started
            raw.set_trace_callback(None)
            wal = Path(d) / "round.db-wal"
            frames = wal.stat().st_size / (4096 + 24) if trace and wal.exists() else 0.0
        finally:
            store.close()
    if summary.committed != tasks:
        raise SystemExit(f"only {summary.committed} of {tasks} tasks committed")
    return {"tasks_per_s": tasks / elapsed, "us_per_tx": elapsed / summary.transactions * 1e6,
            "us_per_task": summary.cpu_s / tasks * 1e6,
            "tx_per_task": summary.transactions / tasks, "sql_per_task": statements / tasks,
            "frames_per_tx": frames / summary.transactions}


#: The shapes `--floor` times. "protocol" is what the master writes today; the two leaner ones
#: are what a change of the protocol's shape could at best reach (see the module's doc).
SHAPES = ("protocol", "one state write", "result rows only")


def floor_once(tasks: int, workers: int, sync: str, batch: int,
               shape: str = "protocol") -> dict[str, float]:
    """The bare rows of `tasks` demo tasks in batches of `batch` over `workers` ranks, in one
    of `SHAPES`: tasks/s, and µs per task by statement kind (see the module's doc)."""
    spent: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "floor.db"
        store = Store.open(path, synchronous=sync)  # the schema, and the tasks, as the master's
        try:
            with store.transaction("import") as tx:
                enqueue_tasks(tx, [t.as_task() for t in demo_tasks(tasks)])
        finally:
            store.close()
        db = sqlite3.connect(path, isolation_level=None)
        try:
            for pragma in ("journal_mode = WAL", f"synchronous = {sync}", "foreign_keys = ON"):
                db.execute(f"PRAGMA {pragma}")

            def run(kind: str, sql: str, params: Any = ()) -> list[Any]:
                t = time.perf_counter()
                rows = db.execute(sql, params).fetchall()
                spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - t
                return rows

            started = time.perf_counter()
            if shape == "protocol":
                _protocol_rows(run, tasks, workers, batch)
            else:
                _lean_rows(run, tasks, workers, batch, state_write=shape == "one state write")
            elapsed = time.perf_counter() - started
            left = db.execute("SELECT count(*) FROM tasks WHERE id NOT IN "
                              "(SELECT task_id FROM results)").fetchone()[0]
        finally:
            db.close()
    if left:
        raise SystemExit(f"the floor ({shape}) left {left} of {tasks} tasks without a result")
    return {"tasks_per_s": tasks / elapsed,
            **{k: v / tasks * 1e6 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}}


def _insert_results(run, batch: int, token: str, rank: int, ids: list[int]) -> None:
    """A batch's result rows: one multi-row INSERT (a short last batch row by row)."""
    now, value = time.time(), json.dumps(None)
    if len(ids) == batch:
        run("result rows", "INSERT INTO results (task_id, token, rank, incarnation, "
            "committed_at, status, value) VALUES " + ", ".join(
                f"(?{5 + k}, ?1, ?2, 1, ?3, 'ok', ?4)" for k in range(batch)),
            [token, rank, now, value, *ids])
    else:
        for i in ids:
            run("result rows", "INSERT INTO results (task_id, token, rank, incarnation, "
                "committed_at, status, value) VALUES (?, ?, ?, 1, ?, 'ok', ?)",
                (i, token, rank, now, value))


def _protocol_rows(run, tasks: int, workers: int, batch: int) -> None:
    """Today's rows. Per round: each batch's queue read, dispatch row, tasks to active and
    work leases, COMMIT; then each batch's result rows, tasks to done, dispatch and leases
    deleted, COMMIT."""
    done = 0
    while done < tasks:
        sent: list[tuple[str, int, list[int]]] = []
        run("COMMIT", "BEGIN")
        for rank in range(1, workers + 1):
            ids = [r[0] for r in run(
                "queue read", "SELECT id, payload FROM tasks WHERE state = 'queued' "
                "ORDER BY queue_pos, id LIMIT ?", (batch,))]
            if not ids:
                break
            token, now = os.urandom(32).hex(), time.time()
            run("dispatch row", "INSERT INTO dispatches (token, rank, task_id, "
                "incarnation, created_at) VALUES (?, ?, ?, 1, ?)",
                (token, rank, ids[0], now))
            run("tasks to active", "UPDATE tasks SET state = 'active', dispatches = "
                "dispatches + 1, updated_at = ? WHERE id IN (SELECT value FROM "
                "json_each(?))", (now, json.dumps(ids)))
            run("work leases", "INSERT INTO leases (token, kind, key) SELECT ?, "
                "'work', CAST(value AS TEXT) FROM json_each(?)",
                (token, json.dumps(ids[1:])))
            sent.append((token, rank, ids))
        run("COMMIT", "COMMIT")
        run("COMMIT", "BEGIN")
        for token, rank, ids in sent:
            _insert_results(run, batch, token, rank, ids)
            run("tasks to done", "UPDATE tasks SET state = 'done', updated_at = ? "
                "WHERE id IN (SELECT value FROM json_each(?))", (time.time(), json.dumps(ids)))
            run("dispatch and leases deleted", "DELETE FROM dispatches WHERE token = ?",
                (token,))
            done += len(ids)
        run("COMMIT", "COMMIT")


def _lean_rows(run, tasks: int, workers: int, batch: int, state_write: bool) -> None:
    """A leaner shape, one transaction per round: the last round's batches' result rows (and,
    with `state_write`, their tasks from queued straight to done) and dispatch rows deleted,
    then this round's dispatch rows, COMMIT. No task row is written at dispatch: the queue is
    read past a cursor (a real change would have to keep tasks in flight out of it)."""
    done, cursor = 0, (-1, -1)
    sent: list[tuple[str, int, list[int]]] = []
    while done < tasks:
        run("COMMIT", "BEGIN")
        for token, rank, ids in sent:
            _insert_results(run, batch, token, rank, ids)
            if state_write:
                run("tasks to done", "UPDATE tasks SET state = 'done', updated_at = ? WHERE "
                    "id IN (SELECT value FROM json_each(?))", (time.time(), json.dumps(ids)))
            run("dispatch deleted", "DELETE FROM dispatches WHERE token = ?", (token,))
            done += len(ids)
        sent = []
        for rank in range(1, workers + 1):
            rows = run("queue read", "SELECT queue_pos, id FROM tasks WHERE state = 'queued' "
                       "AND (queue_pos, id) > (?, ?) ORDER BY queue_pos, id LIMIT ?",
                       (*cursor, batch))
            if not rows:
                break
            cursor = tuple(rows[-1])
            token, ids = os.urandom(32).hex(), [r[1] for r in rows]
            run("dispatch row", "INSERT INTO dispatches (token, rank, task_id, incarnation, "
                "created_at) VALUES (?, ?, ?, 1, ?)", (token, rank, ids[0], time.time()))
            sent.append((token, rank, ids))
        run("COMMIT", "COMMIT")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=10_000, help="tasks per run (default 10,000)")
    p.add_argument("--workers", type=int, default=3, help="worker ranks (default 3)")
    p.add_argument("--sync", action="append", choices=("FULL", "NORMAL"),
                   help="synchronous modes to measure (repeatable; default FULL and NORMAL)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each; the best is kept")
    p.add_argument("--batch", type=int, default=1, help="tasks per dispatch (default 1)")
    p.add_argument("--floor", action="store_true",
                   help="also time the bare rows of each task by plain SQL (a peer; see above)")
    p.add_argument("--holders", type=int, action="append", default=None, metavar="K",
                   help="instead: the master's CPU per task with K more ranks that each hold a "
                        "dispatch all run long (repeatable; see above)")
    p.add_argument("--profile", type=Path, default=None,
                   help="also write a cProfile of one more run (FULL) to this file")
    args = p.parse_args()
    print(f"# master alone: {args.tasks} demo tasks, {args.workers} instant workers, "
          f"SQLite {__import__('sqlite3').sqlite_version}, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d')}")
    if args.holders:
        return holders_main(args)
    for sync in args.sync or ["FULL", "NORMAL"]:
        best = max((run_once(args.tasks, args.workers, sync, trace=False, batch=args.batch)
                    for _ in range(args.repeat)), key=lambda r: r["tasks_per_s"])
        counted = run_once(args.tasks, args.workers, sync, trace=True, batch=args.batch)
        print(f"synchronous={sync}: {best['tasks_per_s']:,.0f} tasks/s, "
              f"{best['us_per_tx']:.0f} µs per transaction, "
              f"{best['tx_per_task']:.3f} transactions per task, "
              f"{counted['sql_per_task']:.1f} SQL executions per task, "
              f"{counted['frames_per_tx']:.1f} WAL frames per commit")
        if args.floor:
            rates: dict[str, float] = {}
            for shape in SHAPES:
                floor = max((floor_once(args.tasks, args.workers, sync, args.batch, shape)
                             for _ in range(args.repeat)), key=lambda r: r["tasks_per_s"])
                rates[shape] = floor.pop("tasks_per_s")
                print(f"synchronous={sync} floor, {shape}: {rates[shape]:,.0f} tasks/s; "
                      f"bare SQL, µs per task: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in floor.items()))
            rate = rates["protocol"]
            last = f"master={best['tasks_per_s']:.0f} floor={rate:.0f} " \
                   f"ratio={best['tasks_per_s'] / rate:.2f}"
            print(last)
    if args.profile is not None:
        import cProfile
        with cProfile.Profile() as prof:
            run_once(args.tasks, args.workers, "FULL", trace=False, batch=args.batch)
        prof.dump_stats(args.profile)
        print(f"profile of a FULL run in {args.profile}")
    return 0


def holders_main(args: argparse.Namespace) -> int:
    sync = (args.sync or ["FULL"])[0]
    cost: dict[int, float] = {}
    for k in args.holders:
        runs = [run_once(args.tasks, args.workers, sync, trace=False, batch=args.batch,
                         holders=k) for _ in range(args.repeat)]
        cost[k] = min(r["us_per_task"] for r in runs)
        print(f"synchronous={sync}, {k} holders: master CPU {cost[k]:.0f} µs per task, "
              f"{max(r['tasks_per_s'] for r in runs):,.0f} tasks/s")
    first, last = cost[args.holders[0]], cost[args.holders[-1]]
    print(" ".join(f"holders={k}:{v:.0f}" for k, v in cost.items())
          + f" ratio={last / first:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
