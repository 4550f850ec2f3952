"""What the master's round costs without MPI: the real Master and store, the tests' fake transport
whose workers answer every WORK at once (`tests/fakes.py`: RESULT and READY), N demo tasks.

    python tools/round_cost.py                  # 10,000 tasks, 3 workers, FULL and NORMAL
    python tools/round_cost.py --tasks 3000 --workers 1 --sync FULL

For each synchronous mode: tasks/s and µs per transaction of the master alone (the ceiling
the MPI benchmark `tools/bench.py` can approach), then, in a second pass with SQLite's trace
callback on, SQL statement executions per task (`executemany` rows included; the initial
enqueue excluded) and WAL frames (pages written) per commit. Workers here cost nothing, so
the figures isolate what the database and the master's Python spend on each task.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tests' fake transports: `fakes.InstantWorkers`

from fakes import InstantWorkers  # noqa: E402

from coordinator.master import Master, MasterConfig  # noqa: E402
from coordinator.sources import demo_tasks  # noqa: E402
from store.campaign import Store  # noqa: E402
from store.tasks import enqueue_tasks  # noqa: E402


def run_once(tasks: int, workers: int, sync: str, *, trace: bool,
             batch: int | None = 1) -> dict[str, float]:
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
            master = Master(store, InstantWorkers(workers), MasterConfig(
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
            "tx_per_task": summary.transactions / tasks, "sql_per_task": statements / tasks,
            "frames_per_tx": frames / summary.transactions}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=10_000, help="tasks per run (default 10,000)")
    p.add_argument("--workers", type=int, default=3, help="worker ranks (default 3)")
    p.add_argument("--sync", action="append", choices=("FULL", "NORMAL"),
                   help="synchronous modes to measure (repeatable; default FULL and NORMAL)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each; the best is kept")
    p.add_argument("--batch", type=int, default=1, help="tasks per dispatch (default 1)")
    p.add_argument("--profile", type=Path, default=None,
                   help="also write a cProfile of one more run (FULL) to this file")
    args = p.parse_args()
    print(f"# master alone: {args.tasks} demo tasks, {args.workers} instant workers, "
          f"SQLite {__import__('sqlite3').sqlite_version}, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d')}")
    for sync in args.sync or ["FULL", "NORMAL"]:
        best = max((run_once(args.tasks, args.workers, sync, trace=False, batch=args.batch)
                    for _ in range(args.repeat)), key=lambda r: r["tasks_per_s"])
        counted = run_once(args.tasks, args.workers, sync, trace=True, batch=args.batch)
        print(f"synchronous={sync}: {best['tasks_per_s']:,.0f} tasks/s, "
              f"{best['us_per_tx']:.0f} µs per transaction, "
              f"{best['tx_per_task']:.2f} transactions per task, "
              f"{counted['sql_per_task']:.1f} SQL executions per task, "
              f"{counted['frames_per_tx']:.1f} WAL frames per commit")
    if args.profile is not None:
        import cProfile
        with cProfile.Profile() as prof:
            run_once(args.tasks, args.workers, "FULL", trace=False, batch=args.batch)
        prof.dump_stats(args.profile)
        print(f"profile of a FULL run in {args.profile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
