"""Shared fixtures: real campaign files in tmp_path (WAL does not exist in memory)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.gate import Gate, Inbound
from store.campaign import Store
from store.journal import RetryPolicy
from store.tasks import NewTask, enqueue_tasks

# Open MPI refuses to run as root without these; harmless elsewhere.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


class Farm:
    """A master without MPI: a real store and gate, driven message by message."""

    def __init__(self, path: Path, *, resume: bool = False, policy: RetryPolicy | None = None,
                 available=None):
        kwargs = {} if available is None else {"available": available}
        self.path = path
        self.store = Store.open(path, resume=resume, policy=policy, **kwargs)
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
