"""Shared fixtures: real campaign files in tmp_path (WAL does not exist in memory)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.gate import Gate, Inbound
from store.campaign import Store
from store.journal import RetryPolicy
from store.schema import TASK_TRANSITIONS, TaskState
from store.tasks import NewTask, enqueue_tasks

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
                 available=None):
        kwargs = {} if available is None else {"available": available}
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

    def dispatch(self, *ranks: int, deadline_s: float | None = None):
        with self.store.transaction() as tx:
            plan = self.gate.plan_dispatches(tx, list(ranks), deadline_s=deadline_s)
        return {p.rank: p.token for p in plan}

    def result(self, rank: int, token: object, status: object = "ok", value=None):
        return self.result_raw(rank, {"token": token, "status": status, "value": value})

    def result_raw(self, rank: int, body: object):
        with self.store.transaction() as tx:
            return self.gate.apply_results(tx, [Inbound(rank, body)])

    def sweep(self):
        with self.store.transaction() as tx:
            return self.gate.sweep(tx)

    def close(self) -> None:
        self.store.close()
        assert_task_transitions_allowed(self.path)


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
