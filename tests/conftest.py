"""Shared fixtures and helpers: real campaign files in tmp_path (WAL does not exist in memory),
the message-by-message master `Farm`, and what tests read back from its file. (The fake
transports are in `fakes.py`.)"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from sqlalchemy import select, text

from coordinator.gate import Gate, Inbound
from store.campaign import Store
from store.dispatches import mark_sent
from store.journal import RetryPolicy
from store.schema import tasks, workers
from store.tasks import NewTask, enqueue_tasks, take_queued
from store.vocabulary import TASK_TRANSITIONS, TaskState

#: The project's `tools/` scripts, which tests load as modules (`load_tool`).
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """`tools/<name>.py` as the module `name`, registered in sys.modules (its dataclasses
    look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# Open MPI refuses to run as root without these; harmless elsewhere.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


#: What a test adds to a campaign file to see every change of `tasks.state` the store makes,
#: by any statement (the fenced `set_state`, and the bulk ones: dispatch, commit, reclaim,
#: requeue), across restarts: one row per change.
TRANSITION_LOG = """
CREATE TABLE IF NOT EXISTS test_transitions (old TEXT NOT NULL, new TEXT NOT NULL);
CREATE TRIGGER IF NOT EXISTS test_log_transition AFTER UPDATE OF state ON tasks
WHEN old.state IS NOT new.state
BEGIN INSERT INTO test_transitions VALUES (old.state, new.state); END;
"""


def log_task_transitions(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.executescript(TRANSITION_LOG)


def assert_task_transitions_allowed(path: Path) -> None:
    """Every logged change is one of `TASK_TRANSITIONS`, the table the store's docs and
    `set_state` go by."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        seen = db.execute("SELECT DISTINCT old, new FROM test_transitions").fetchall()
    for old, new in seen:
        assert TaskState(new) in TASK_TRANSITIONS[TaskState(old)], f"{old} -> {new}"


class Farm:
    """A master without MPI: a real store and gate, driven message by message. Every task
    transition it makes is checked against `TASK_TRANSITIONS` when it closes."""

    def __init__(self, path: Path, *, resume: bool = False, policy: RetryPolicy | None = None,
                 available=None, ranks: int | None = None):
        kwargs = {} if available is None else {"available": available}
        if ranks is not None:
            kwargs["ranks"] = ranks
        self.path = path
        if path.exists():  # (a restart: what its recovery does is logged too)
            log_task_transitions(path)
        self.store = Store.open(path, resume=resume, policy=policy, **kwargs)
        log_task_transitions(path)
        self.gate = Gate(self.store)

    def enqueue(self, *payloads, input_bytes=None) -> list[int]:
        with self.store.transaction() as tx:
            return enqueue_tasks(tx, [NewTask(p, input_bytes) for p in payloads])

    def ready(self, rank: int, token: str | None = "", **extra):
        body = {"rank": rank, "bitmap_version": 0, "empirical_profile_version": "",
                "completed_dispatch_token": token, **extra}
        return self.ready_raw(rank, body)

    def ready_raw(self, rank: int, body: object):
        with self.store.transaction() as tx:
            return self.gate.apply_ready(tx, [Inbound(rank, body)])

    def dispatch(self, *ranks: int, deadline_s: float | None = None, sent: bool = False):
        """{rank: token} of the dispatches planned; `sent`: their WORK marked sent, as the
        master does once it has left."""
        return {p.rank: p.token for p in self.plan(*ranks, deadline_s=deadline_s, sent=sent)}

    def plan(self, *ranks: int, deadline_s: float | None = None, sent: bool = False,
             batch: int = 1, spread: bool = False):
        """The dispatches planned (`dispatches.Planned`), `batch` tasks each at most."""
        with self.store.transaction() as tx:
            plan = self.gate.plan_dispatches(tx, list(ranks), deadline_s=deadline_s,
                                             batch=batch, spread=spread)
            if sent:
                mark_sent(tx, [p.token for p in plan])
        return plan

    def result(self, rank: int, token: object, status: object = "ok", value=None):
        return self.result_raw(rank, {"token": token, "status": status, "value": value})

    def result_raw(self, rank: int, body: object):
        with self.store.transaction() as tx:
            return self.gate.apply_results(tx, [Inbound(rank, body)])

    def sweep(self):
        with self.store.transaction() as tx:
            return self.gate.sweep(tx)

    def state(self) -> dict[str, list[tuple]]:
        """The committed state, without what differs by construction (tokens, times, ids)."""
        with self.store.reading() as conn:
            q = lambda sql: [tuple(r) for r in conn.execute(text(sql)).all()]  # noqa: E731
            return {
                "tasks": q("SELECT semantic_id, state, attempts, dispatches, reason FROM tasks "
                           "ORDER BY semantic_id"),
                "results": q("SELECT t.semantic_id, r.rank, r.status, r.value FROM results r "
                             "JOIN tasks t ON t.id = r.task_id ORDER BY 1"),
                "dispatches": q("SELECT rank, task_id FROM dispatches ORDER BY rank"),
                "leases": q("SELECT kind, key FROM leases ORDER BY kind, key"),
                "workers": q("SELECT rank, state, parked_token FROM workers ORDER BY rank"),
                "quarantine": q("SELECT channel, reason, rank FROM quarantine ORDER BY 1, 2, 3"),
            }

    def events(self) -> Counter[str]:
        """How many events of each kind the file holds."""
        with self.store.reading() as conn:
            return Counter(dict(conn.execute(text(
                "SELECT kind, count(*) FROM events GROUP BY kind")).all()))

    def close(self) -> None:
        self.store.close()
        assert_task_transitions_allowed(self.path)


# -- what tests read back from a Farm's file, and the steps they repeat ---------------------

def rows(farm: Farm, table, *where):
    with farm.store.reading() as conn:
        return conn.execute(select(table).where(*where)).all()


def task_state(farm: Farm, task_id: int) -> str:
    return rows(farm, tasks, tasks.c.id == task_id)[0].state


def worker_state(farm: Farm, rank: int) -> str:
    return rows(farm, workers, workers.c.rank == rank)[0].state


def started(farm: Farm, payload=None, rank=1) -> tuple[int, str]:
    """One task dispatched to `rank`, which has shown its first READY."""
    [tid] = farm.enqueue(payload or {"path": "/seed/a", "target_branch": 7})
    farm.ready(rank, "")
    token = farm.dispatch(rank)[rank]
    return tid, token


def snapshot(farm: Farm):
    """Every row the protocol owns, for 'changes nothing' assertions (events excluded)."""
    with sqlite3.connect(farm.path) as c:
        return {t: sorted(c.execute(f"SELECT * FROM {t}").fetchall(), key=repr)
                for t in ("tasks", "dispatches", "leases", "workers", "results")}


def fail_once(farm: Farm, rank: int = 1):
    """The task at the head of the queue dispatched to `rank` and failed (an invalid RESULT
    joined with its READY): the sweep's recoveries."""
    farm.ready(rank, "")
    tok = farm.dispatch(rank)[rank]
    farm.result(rank, None)
    farm.ready(rank, tok)
    return farm.sweep()


def defer(farm: Farm, payload, input_bytes=None) -> int:
    """Enqueue a task and fail it twice (retries=1): it ends deferred."""
    [tid] = farm.enqueue(payload, input_bytes=input_bytes)
    for _ in range(2):
        fail_once(farm)
    assert rows(farm, tasks, tasks.c.id == tid)[0].state == "deferred"
    return tid


def queue_order(farm: Farm) -> list[int]:
    with farm.store.transaction() as tx:
        return [t.id for t in take_queued(tx, 100)]


@contextlib.contextmanager
def write_lock_held_elsewhere(db_path, monkeypatch):
    """Another process's write transaction (a `sqlite3` shell's BEGIN IMMEDIATE) on the file
    while the block runs, with a busy timeout of 0.1 s for the connections our side opens
    in it (one opened before keeps its own)."""
    import store.engine
    monkeypatch.setattr(store.engine, "BUSY_TIMEOUT_MS", 100)
    monkeypatch.setattr(store.engine, "MASTER_BUSY_TIMEOUT_MS", 100)
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test() -> Iterator[None]:
    yield
    jobs = sys.modules.get("mpi_jobs")  # only a test that imported it can have started a job
    if jobs is not None:
        jobs.kill_leftover_jobs()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "campaign.db"


@pytest.fixture
def farm(db_path: Path) -> Iterator[Farm]:
    f = Farm(db_path)
    yield f
    f.close()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty directory for an executor to run in."""
    path = tmp_path / "work"
    path.mkdir()
    return path


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB filesystem of its own (tmpfs; needs root and a kernel that lets it mount):
    a disk that fills up for real."""
    where = tmp_path / "tiny"
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30,
                       check=False)


def leases_granted(directory: Path) -> bool:
    """Whether the kernel grants this process a read lease on a file in `directory` (not on
    NFSv3, under gVisor, with `fs.leases-enable = 0`): where it does not, the AFL queue source
    falls back to two polls agreeing, which a writer pausing longer than a poll defeats."""
    from coordinator.sources import _read_lease
    probe = directory / ".lease-probe"
    probe.write_bytes(b"")
    fd = os.open(probe, os.O_RDONLY)
    try:
        return bool(_read_lease(fd))
    finally:
        os.close(fd)
        probe.unlink()
