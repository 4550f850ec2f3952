"""What a start costs: a cold `coordinator run --demo 300` to its first WORK, and a --resume
and `coordinator status` on a campaign of a million done tasks against the same on one of
10,000 (the start should cost what is in flight, deferred or new, not the campaign's history).

    python tools/start_cost.py                        # 1,000,000 and 10,000 done tasks
    python tools/start_cost.py --tasks 200000 --small 10000

Each campaign is begun by a real `coordinator run --demo 1` (3 workers), then grown with SQL
to N done demo tasks with a result each, and its import row says the demo's N tasks are in
(revision 0011). Then, timed: `coordinator run --resume --demo N+100` (the 100 new tasks are
run: the start has work to send), from the master rank's start to its first WORK, the whole
command, and the master's peak RSS; and `coordinator status` (text and --json), the whole
command, best of three. The cold start is timed from the command's launch (mpiexec started by
the self-launcher, 4 ranks) and from the master rank's start to the first WORK, best of three.
The last line reads `cold_first_work_s=<s> resume_first_work_s=<s> status_s=<s>
rss_ratio=<big/small>` (the resume and status of the large campaign).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store.semantic import canonical_form  # noqa: E402

NEW = 100  # tasks the timed --resume adds and runs


def coordinator(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"coordinator {' '.join(args)} failed ({out.returncode}):\n"
                         f"{out.stderr[-3000:]}")
    return out


def grow(db: Path, tasks: int) -> None:
    """The campaign of one demo task becomes one of `tasks` done demo tasks."""
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA synchronous = OFF")
    now = time.time()
    with conn:
        (first,) = conn.execute("SELECT max(queue_pos) FROM tasks").fetchone()

        def task_rows():
            for n in range(1, tasks):
                canon, sid = canonical_form({"data": {"n": n}})
                yield sid, canon, first + n, now, now
        conn.executemany(
            "INSERT INTO tasks (semantic_id, payload, state, dispatches, queue_pos, origin, "
            "created_at, updated_at) VALUES (?, ?, 'done', 1, ?, 'demo', ?, ?)", task_rows())
        conn.execute(
            "INSERT INTO results (task_id, token, rank, incarnation, committed_at, status, value, "
            "dispatched_at, sent_at, ready_at) SELECT t.id, "
            "substr(t.semantic_id || t.semantic_id, 1 + t.id % 64, 64), 1 + t.id % 3, 1, ?, "
            "'ok', '{}', ?, ?, ? FROM tasks t WHERE NOT EXISTS "
            "(SELECT 1 FROM results r WHERE r.task_id = t.id)", (now, now, now, now))
        conn.execute("UPDATE imports SET count = ?, added = ?", (tasks, tasks))
    conn.close()


def campaign(directory: Path, tasks: int) -> Path:
    db = directory / f"done-{tasks}.db"
    coordinator("run", "--db", str(db), "--demo", "1", "--no-progress")
    grow(db, tasks)
    return db


def resume(db: Path, tasks: int) -> dict:
    summary = db.with_suffix(".summary.json")
    began = time.monotonic()
    coordinator("run", "--db", str(db), "--resume", "--demo", str(tasks + NEW), "--no-progress",
                "--summary-json", str(summary))
    s = json.loads(summary.read_text())
    return {"first_work_s": s["first_work_at"] - s["started_at"],
            "command_s": time.monotonic() - began, "rss_mib": s["master_peak_rss_mib"]}


def status(db: Path, *flags: str, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        began = time.monotonic()
        coordinator("status", "--db", str(db), *flags, timeout=300)
        best = min(best, time.monotonic() - began)
    return best


def cold_start(directory: Path, repeat: int = 3) -> tuple[float, float]:
    """(launch to first WORK, master rank's start to first WORK) of `run --demo 300`, best of
    `repeat`, each on a new file."""
    best = (float("inf"), float("inf"))
    for k in range(repeat):
        db = directory / f"cold-{k}.db"
        summary = db.with_suffix(".summary.json")
        launched = time.time()
        coordinator("run", "--db", str(db), "--demo", "300", "--no-progress", "--summary-json",
                    str(summary))
        s = json.loads(summary.read_text())
        got = (s["first_work_at"] - launched, s["first_work_at"] - s["started_at"])
        best = min(best, got)
    return best


def python_start_s(repeat: int = 3) -> float:
    """A bare interpreter's start on this machine, for scale."""
    best = float("inf")
    for _ in range(repeat):
        began = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        best = min(best, time.monotonic() - began)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=1_000_000, help="the large campaign's tasks")
    p.add_argument("--small", type=int, default=10_000, help="the small campaign's tasks")
    p.add_argument("--dir", type=Path, default=None,
                   help="where the campaign files go (default: a temporary directory)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        cold, cold_master = cold_start(Path(d))
        print(f"cold start, run --demo 300 (4 ranks): launch to first WORK {cold:.3f} s, of "
              f"which the master rank's own start {cold_master:.3f} s", flush=True)
        figures = {}
        for n in (a.small, a.tasks):
            began = time.monotonic()
            db = campaign(Path(d), n)
            made = time.monotonic() - began
            r = resume(db, n)
            figures[n] = {**r, "status_s": status(db), "status_json_s": status(db, "--json"),
                          "mb": db.stat().st_size / 1e6}
            f = figures[n]
            print(f"{n:,} done tasks ({f['mb']:,.0f} MB, made in {made:.0f} s): --resume to "
                  f"first WORK {f['first_work_s']:.3f} s (command {f['command_s']:.1f} s), "
                  f"master peak RSS {f['rss_mib']:.0f} MiB; status {f['status_s']:.3f} s, "
                  f"status --json {f['status_json_s']:.3f} s", flush=True)
    big, small = figures[a.tasks], figures[a.small]
    print(f"# a bare Python starts in {python_start_s():.3f} s here")
    print(f"cold_first_work_s={cold:.3f} resume_first_work_s={big['first_work_s']:.3f} "
          f"status_s={big['status_s']:.3f} "
          f"rss_ratio={big['rss_mib'] / small['rss_mib']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
