"""Worker ranks as the master sees them: state, versions, where they run, when last heard."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from .journal import Tx
from .schema import WorkerState, workers


@dataclass(frozen=True)
class WorkerRecord:
    rank: int
    state: WorkerState
    bitmap_version: int
    profile_version: str
    parked_token: str | None
    host: str | None
    pid: int | None


def set_workers(tx: Tx, rows: Iterable[tuple[int, WorkerState]], *,
                parked_token: str | None = None) -> None:
    """Upsert each rank's state (one statement for the whole batch)."""
    params = [{"rank": r, "state": s.value, "incarnation": tx.incarnation,
               "parked_token": parked_token, "last_seen": tx.now} for r, s in rows]
    if not params:
        return
    stmt = sqlite_insert(workers)
    stmt = stmt.on_conflict_do_update(
        index_elements=["rank"],
        set_={"state": stmt.excluded.state, "incarnation": stmt.excluded.incarnation,
              "parked_token": stmt.excluded.parked_token},
    )
    tx.conn.execute(stmt, params)


def accept_versions(tx: Tx, rank: int, bitmap_version: int, profile_version: str,
                    host: str | None = None, pid: int | None = None) -> None:
    """An idle READY: take its (already sanitised) versions and make the rank idle."""
    values: dict[str, Any] = {"rank": rank, "state": WorkerState.IDLE.value,
                              "incarnation": tx.incarnation, "bitmap_version": bitmap_version,
                              "profile_version": profile_version, "parked_token": None,
                              "last_seen": tx.now}
    if host is not None:
        values["host"] = host
    if pid is not None:
        values["pid"] = pid
    stmt = sqlite_insert(workers).values(**values)
    tx.conn.execute(stmt.on_conflict_do_update(
        index_elements=["rank"], set_={k: stmt.excluded[k] for k in values if k != "rank"}))


def get_workers(tx: Tx) -> dict[int, WorkerRecord]:
    rows = tx.conn.execute(select(workers)).all()
    return {r.rank: WorkerRecord(r.rank, WorkerState(r.state), r.bitmap_version,
                                 r.profile_version, r.parked_token, r.host, r.pid) for r in rows}


def forget_incarnation(tx: Tx) -> None:
    """A new incarnation talks to new processes: nothing known about ranks carries over."""
    tx.conn.execute(update(workers).values(state=WorkerState.UNKNOWN.value, parked_token=None,
                                           incarnation=tx.incarnation))
