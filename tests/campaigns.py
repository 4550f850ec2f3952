"""Campaign files made by the real master and store, without MPI: what `status`, the metrics
file, the stats file, `plot` and the views are tested on."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from fakes import InstantWorkers, ready_message

from coordinator.master import Master, MasterConfig, Summary
from coordinator.output import TestcaseWriter
from coordinator.sources import demo_tasks
from coordinator.transport import Received
from coordinator.wire import TAG_READY, TAG_RESULT, Result, decode_work, encode
from store.campaign import Store
from store.tasks import NewTask, enqueue_tasks


class FindingWorkers(InstantWorkers):
    """Workers that answer at once, as `round_cost`'s do, but like a campaign with troubles:
    every 5th run writes a test case, every 23rd fails (`error`), and every 17th WORK is first
    answered with a RESULT carrying a token that is not the dispatch's (quarantined as
    `stale`)."""

    def __init__(self, workers: int):
        super().__init__(workers)
        self.sent = 0

    def send_work(self, data: bytes, dest: int) -> None:
        work = decode_work(data)
        self.sent += 1
        n = self.sent
        if n % 17 == 0:
            self.queues[TAG_RESULT].append(Received(dest, TAG_RESULT, encode(Result(
                token="0" * 64, status="ok"))))
        self.queues[TAG_RESULT].append(Received(dest, TAG_RESULT, encode(Result(
            token=work.token, status="error" if n % 23 == 0 else "ok", value={"n": n},
            testcases=[(f"tc{n}", f"found by run {n}".encode())] if n % 5 == 0 else [],
            detail="exit status 1" if n % 23 == 0 else ""))))
        self.queues[TAG_READY].append(ready_message(dest, work.token))


def finding_campaign(db: Path, tasks: int = 300, workers: int = 3, **config) -> Summary:
    """A finished campaign of `tasks` demo tasks run by the real master against
    `FindingWorkers`; its test cases go to DB.out/. `config` overrides `MasterConfig`."""
    store = Store.open(db)
    try:
        with store.transaction("import") as tx:
            enqueue_tasks(tx, [t.as_task() for t in demo_tasks(tasks)])
        writer = TestcaseWriter(db.with_name(db.name + ".out"), afl_style=False)
        return Master(store, FindingWorkers(workers), MasterConfig(**{
            "stats_file": db.with_name(db.name + ".stats"), "linger_s": 0, "grace_s": 1,
            "stop_wait_s": 1, "feedback": False, "observe_interval_s": 0.05, **config}),
            writer=writer).run()
    finally:
        store.close()


def copy_of(campaign: Path, tmp_path: Path) -> Path:
    """A copy of a (module-scoped) campaign file that a test may change: SQLite's backup, so
    its WAL's commits are in it too."""
    copy = tmp_path / "copy.db"
    with sqlite3.connect(campaign) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
    return copy


def queued_campaign(db: Path, n: int = 3000) -> None:
    """A campaign of `n` queued tasks, checkpointed into the file (nothing in its -wal)."""
    with Store.open(db) as store, store.transaction("import") as tx:
        enqueue_tasks(tx, [NewTask({"data": i}) for i in range(n)])
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def damage_a_tasks_page(db: Path, which: int = -1) -> int:
    """200 bytes at the start of one of the `tasks` table's leaf pages overwritten, as a
    failing disk or a stray write leaves them; the page's number."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = [p for (p,) in conn.execute(
            "SELECT pageno FROM dbstat WHERE name = 'tasks' AND pagetype = 'leaf' "
            "ORDER BY pageno")]
    page = pages[which]
    with open(db, "r+b") as f:
        f.seek((page - 1) * size)
        f.write(b"\xff" * 200)
    return page


_KILLED_AFTER_ITS_FIRST_COMMITS = """
import os, sys
from store.campaign import Store
from store.tasks import NewTask, enqueue_tasks
store = Store.open(sys.argv[1], settings={"executor": "demo", "source": "demo"})
with store.transaction("import") as tx:
    enqueue_tasks(tx, [NewTask(payload={"data": i}) for i in range(int(sys.argv[2]))])
os._exit(0)  # as a kill -9: SQLite closes nothing, the -wal stays with every commit
"""


def copied_without_its_wal(db: Path, copy: Path, tasks: int = 5) -> None:
    """A campaign at `db` whose master was killed after its first commits (the -wal left
    beside it holds them all, its campaign row too), and a copy of the file alone at `copy`:
    the schema, which the start checkpointed into the file, and no campaign row."""
    import shutil
    import subprocess
    import sys
    subprocess.run([sys.executable, "-c", _KILLED_AFTER_ITS_FIRST_COMMITS, str(db), str(tasks)],
                   check=True, timeout=60)
    assert Path(f"{db}-wal").stat().st_size > 0
    shutil.copyfile(db, copy)
    with contextlib.closing(sqlite3.connect(f"file:{copy}?mode=ro&immutable=1", uri=True)) as c:
        assert c.execute("SELECT count(*) FROM campaign").fetchone() == (0,)
