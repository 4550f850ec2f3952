"""A large campaign file made directly with SQL, for timing what reads it (`coordinator
status`, `coordinator plot`, the views), without running a million tasks.

    python tools/big_campaign.py big.db                 # 1,000,000 tasks
    python tools/big_campaign.py big.db --tasks 100000 --ranks 16

The file is a campaign at the code's head revision, as a master left it while running: most
tasks done (one result each, one in ten with test cases, one in a hundred not ok), some
queued, one dispatch in flight per rank, held tasks with reasons, the counted events of a
campaign with faults (requeues, watchdog timeouts, deaths), quarantined messages, the
master's observations every 10 s and its ranks' loads. Results follow a steady rate over the
campaign's span, so charts have something to show. `coordinator check` finds it consistent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sqlite3
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from store.campaign import Store  # noqa: E402


def build(path: Path, tasks: int, ranks: int, span_s: float, seed: int = 0) -> None:
    rnd = random.Random(seed)
    Store.open(path).close()  # a campaign at the head revision, incarnation 1
    now = time.time()
    t0 = now - span_s
    queued = max(10, tasks // 50)
    held = max(2, tasks // 1000)
    active = min(ranks, tasks - queued - held)
    done = tasks - queued - held - active
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA synchronous = OFF")
    with conn:
        conn.execute("UPDATE campaign SET created_at = ?, settings = ?",
                     (t0, json.dumps({"executor": "command", "source": "tasks"})))
        conn.execute("UPDATE events SET at = ? WHERE kind = 'campaign'", (t0,))
        conn.execute("UPDATE events SET detail = 'new: master pid=1 host=nowhere' "
                     "WHERE kind = 'campaign'")

        def task_rows():
            for i in range(1, tasks + 1):
                payload = json.dumps({"path": f"/seeds/id:{i:06d}"}, sort_keys=True)
                state = ("done" if i <= done else "active" if i <= done + active else
                         "deferred" if i <= done + active + held // 2 else
                         "failed" if i <= done + active + held else "queued")
                reason = ("5 failed attempts (ceiling 5); last: watchdog" if state == "failed"
                          else "past the retry budget: watchdog" if state == "deferred"
                          else None)
                created = t0 + span_s * 0.9 * (i / tasks) ** 2
                yield (i, hashlib.sha256(payload.encode()).hexdigest(), payload, state,
                       1 if state in ("done", "active") else 0, i, reason, created, created)
        conn.executemany(
            "INSERT INTO tasks (id, semantic_id, payload, state, dispatches, queue_pos, reason, "
            "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", task_rows())
        conn.executemany(
            "INSERT INTO events (at, incarnation, kind, task_id, detail) "
            "VALUES (?, 1, 'enqueued', ?, 'tasks')",
            ((t0 + span_s * 0.9 * (i / tasks) ** 2, i) for i in range(1, tasks + 1)))

        def result_rows():
            for i in range(1, done + 1):
                end = t0 + span_s * 0.95 * i / done
                run = rnd.expovariate(1 / (ranks * span_s * 0.95 / done * 0.9))
                bad = i % 100 == 0
                yield (i, hashlib.sha256(f"token {i}".encode()).hexdigest(), 1 + i % ranks, end,
                       "error" if bad else "ok", 3 if i % 10 == 0 else 0, end - run,
                       end - run + 0.0001, "exit status 1" if bad else None)
        conn.executemany(
            "INSERT INTO results (task_id, token, rank, incarnation, committed_at, status, "
            "testcases, dispatched_at, sent_at, detail) VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, ?)",
            result_rows())
        for k, r in enumerate(range(1, active + 1)):
            conn.execute("INSERT INTO dispatches (token, rank, task_id, incarnation, created_at, "
                         "sent_at) VALUES (?, ?, ?, 1, ?, ?)",
                         (hashlib.sha256(f"active {r}".encode()).hexdigest(), r, done + 1 + k,
                          now - r, now - r))
        conn.executemany(
            "INSERT INTO workers (rank, state, incarnation, host, pid, last_seen) "
            "VALUES (?, ?, 1, ?, ?, ?)",
            [(r, "busy" if r <= active else "idle", f"node{r // 16:02d}", 1000 + r, now)
             for r in range(1, ranks + 1)])
        faults = [("requeued", 40), ("deferred", 10), ("watchdog", 20), ("worker_recovered", 15),
                  ("worker_failed", 2), ("failed", held - held // 2)]
        conn.executemany(
            "INSERT INTO events (at, incarnation, kind, rank, task_id) VALUES (?, 1, ?, ?, ?)",
            [(t0 + rnd.random() * span_s, kind, 1 + rnd.randrange(ranks), None)
             for kind, n in faults for _ in range(n)])
        conn.executemany(
            "INSERT INTO quarantine (at, incarnation, channel, reason, rank) "
            "VALUES (?, 1, ?, ?, ?)",
            [(t0 + rnd.random() * span_s, ch, reason, 1 + rnd.randrange(ranks))
             for ch, reason, n in (("result", "stale", 30), ("result", "malformed", 5),
                                   ("ready", "stale", 12)) for _ in range(n)])
        n_obs = int(span_s // 10)
        conn.executemany(
            "INSERT INTO observations (at, incarnation, queued, active, done, deferred, failed, "
            "testcases) VALUES (?, 1, ?, ?, ?, 0, 0, ?)",
            [(t0 + 10 * k, queued, active, int(done * k / n_obs), int(done * k / n_obs) // 10 * 3)
             for k in range(n_obs + 1)])
        conn.executemany(
            "INSERT INTO rank_load (rank, at, incarnation, window_s, busy) "
            "VALUES (?, ?, 1, 300, ?)",
            [(r, now - 5, rnd.uniform(0.6, 1.0)) for r in range(1, ranks + 1)])
    conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("db", type=Path)
    p.add_argument("--tasks", type=int, default=1_000_000)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--span", type=float, default=3 * 86400.0,
                   help="seconds from the campaign's start to now (default 3 days)")
    args = p.parse_args()
    if args.db.exists():
        raise SystemExit(f"{args.db} exists")
    began = time.monotonic()
    build(args.db, args.tasks, args.ranks, args.span)
    print(f"{args.db}: {args.tasks:,} tasks, {args.ranks} ranks, "
          f"{args.db.stat().st_size / 1e6:,.0f} MB in {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
