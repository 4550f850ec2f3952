"""Tasks: enqueue by semantic id, queue order, the retry decision, admission and reclaim."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Connection, and_, exists, select, text, update

from .journal import RetryPolicy, Tx
from .schema import events, results, tasks
from .semantic import canonical_form, canonical_json, content_hash, is_self_contained
from .stats import COUNT_QUEUED_SQL
from .vocabulary import HELD_STATES_SQL, TASK_TRANSITIONS, EventKind, LeaseKind, TaskState


# Not frozen: a frozen dataclass sets each field through object.__setattr__, five times what
# a plain slot costs, and a batched dispatch makes one record per task it takes. Nothing
# changes a record once made.
@dataclass(slots=True)
class TaskRecord:
    id: int
    semantic_id: str
    payload: dict[str, Any]
    input_hash: str | None
    state: TaskState
    attempts: int
    dispatches: int
    depth: int
    reason: str | None
    batch_cap: int | None = None  # the largest dispatch it may go out in (a broken batch's half)

    def lease_keys(self) -> list[tuple[LeaseKind, str]]:
        """Every side-table reservation a dispatch of this task holds (one lease row each).
        The task itself is reserved by the dispatch row (UNIQUE task_id), not by a lease."""
        keys: list[tuple[LeaseKind, str]] = []
        if self.payload.get("target_branch"):
            keys.append((LeaseKind.TARGET, str(self.payload["target_branch"])))
        if self.input_hash:
            keys.append((LeaseKind.CONTENT, self.input_hash))
        if self.payload.get("schedule_prefix"):
            keys.append((LeaseKind.SCHEDULE, canonical_json(self.payload["schedule_prefix"])))
        return keys


_TASK_COLUMNS = (tasks.c.id, tasks.c.semantic_id, tasks.c.payload, tasks.c.input_hash,
                 tasks.c.state, tasks.c.attempts, tasks.c.dispatches, tasks.c.depth,
                 tasks.c.reason, tasks.c.batch_cap)


#: `ix_tasks_held`'s condition, for a query SQLite should read that index for (it uses a
#: partial index only when the query repeats the index's own term).
HELD_TERM = text(HELD_STATES_SQL)


def _record(row: Any) -> TaskRecord:
    return TaskRecord(row.id, row.semantic_id, json.loads(row.payload), row.input_hash,
                      TaskState(row.state), row.attempts, row.dispatches, row.depth, row.reason,
                      row.batch_cap)


@dataclass(frozen=True)
class NewTask:
    payload: Mapping[str, Any]
    input_bytes: bytes | None = None
    origin: str = ""
    depth: int = 0
    parent_id: int | None = None
    #: `canonical_form(payload)` when the caller already has it (a tasks file checks every
    #: line before the import): a million-line import then encodes each payload once.
    canonical: tuple[str, str] | None = None


#: The origin of a task made of a committed result's test case (the feedback loop).
FEEDBACK_ORIGIN = "result"

#: Where the fed-back test cases queue: behind every input (an AFL queue entry, a tasks file's
#: line), which goes to the end of the inputs instead of the end of the queue. With feedback
#: unbounded (the default) each SymCC run adds tasks faster than the ranks drain them, and a
#: new AFL entry, the fuzzer's own new coverage, waited behind a backlog that only grew (a
#: review: position 759, behind 500 test cases of our own). The fed-back ones run when no
#: input waits. (One that AFL imports as new keeps its place: its queue entry, known content,
#: is not a task of its own; finding the task by its content would take an index on it.)
FEEDBACK_QUEUE_POS = 1 << 50


def tail_position(tx: Tx) -> int:
    """Past every queued task (a manual requeue's place)."""
    top = tx.db.execute("SELECT max(queue_pos) FROM tasks INDEXED BY ix_tasks_queue "
                        "WHERE state = 'queued'").fetchone()[0]
    return (top or 0) + 1


def inputs_tail_position(tx: Tx) -> int:
    """Past every queued input, ahead of the fed-back test cases (FEEDBACK_QUEUE_POS)."""
    top = tx.db.execute("SELECT max(queue_pos) FROM tasks INDEXED BY ix_tasks_queue "
                        "WHERE state = 'queued' AND queue_pos < ?",
                        (FEEDBACK_QUEUE_POS,)).fetchone()[0]
    return (top or 0) + 1


def head_position(tx: Tx) -> int:
    low = tx.db.execute("SELECT min(queue_pos) FROM tasks INDEXED BY ix_tasks_queue "
                        "WHERE state = 'queued'").fetchone()[0]
    return min(low or 0, 0) - 1


_INSERT_TASK = (
    "INSERT INTO tasks (semantic_id, payload, input_hash, state, queue_pos, depth, parent_id, "
    "origin, created_at, updated_at) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (semantic_id) DO NOTHING")


def origins_starting_with(conn: Connection, prefix: str) -> list[str]:
    """The origins of the tasks whose origin starts with `prefix` (one scan of `tasks`, as
    a source starts)."""
    return [o for (o,) in conn.exec_driver_sql(
        "SELECT origin FROM tasks WHERE substr(origin, 1, ?) = ?", (len(prefix), prefix))]


def enqueue_tasks(tx: Tx, new: Iterable[NewTask], *,
                  skip_known_content: bool = False) -> list[int]:
    """Enqueue at the tail (of the inputs, or for fed-back test cases, of the whole queue:
    FEEDBACK_QUEUE_POS); returns the ids of tasks that were not already known.

    The same semantic payload twice is one task (UNIQUE semantic_id, ON CONFLICT DO NOTHING).
    Input bytes are stored content-addressed, so the task no longer needs the file. With
    `skip_known_content`, an input whose bytes some task already holds is not enqueued (AFL
    re-imports what we give it under new names; the same bytes need no second run).
    """
    db = tx.db
    created: list[int] = []
    tails = {False: inputs_tail_position(tx), True: max(tail_position(tx), FEEDBACK_QUEUE_POS)}
    for item in new:
        canon, sid = item.canonical or canonical_form(item.payload)
        ihash = None
        if item.input_bytes is not None:
            if db.execute("SELECT 1 FROM tasks WHERE semantic_id = ?", (sid,)).fetchone():
                continue  # a known task: its bytes would only be an orphan blob
            ihash = content_hash(item.input_bytes)
            known = content_known(tx, ihash)
            if known and skip_known_content:
                continue
            if not known:
                db.execute("INSERT INTO blobs (hash, data) VALUES (?, ?)",
                           (ihash, bytes(item.input_bytes)))
        fed_back = item.origin == FEEDBACK_ORIGIN
        cur = db.execute(_INSERT_TASK, (sid, canon, ihash, tails[fed_back], item.depth,
                                        item.parent_id, item.origin, tx.now, tx.now))
        if cur.rowcount == 1:
            created.append(cur.lastrowid)
            tx.event(EventKind.ENQUEUED, task_id=cur.lastrowid, detail=item.origin or None)
            tails[fed_back] += 1
    return created


# INDEXED BY: without ANALYZE statistics SQLite can prefer an index on state (whatever one a
# revision adds) and then sort every queued row on each call; the partial index yields them
# already in queue order. Paged by key ((queue_pos, id) past the last row seen), not OFFSET,
# which walks every earlier row again for each window: quadratic when many queued tasks wait
# on a held lease.
_QUEUED = ("SELECT id, semantic_id, payload, input_hash, state, attempts, dispatches, depth, "
           "reason, queue_pos, batch_cap FROM tasks INDEXED BY ix_tasks_queue "
           "WHERE state = 'queued' AND (queue_pos, id) > (?, ?) {} ORDER BY queue_pos, id "
           "LIMIT ?")
_QUEUED_ALL = _QUEUED.format("")
# While leases are held, rows whose content or target branch is held are skipped in SQL (a
# cheap pre-filter: the lease check below still decides). 20,000 tasks on one input, which
# run one at a time, cost 526 ms per call if every row is decoded in Python.
_QUEUED_FREE = _QUEUED.format(
    "AND (input_hash IS NULL OR input_hash NOT IN "
    "(SELECT key FROM leases WHERE kind = 'content')) "
    "AND (json_extract(payload, '$.target_branch') IS NULL OR "
    "CAST(json_extract(payload, '$.target_branch') AS TEXT) NOT IN "
    "(SELECT key FROM leases WHERE kind = 'target'))")


#: A stored payload is canonical JSON (`store.semantic`); msgspec reads it 6x faster than
#: json.loads, the same values (integers of any size included), once per task taken.
_load_payload = msgspec.json.Decoder().decode


def count_queued(tx: Tx) -> int:
    """How many tasks are queued (a walk of the queue's index: ~30 ms a million here)."""
    return tx.db.execute(COUNT_QUEUED_SQL).fetchone()[0]


def take_queued(tx: Tx, n: int) -> list[TaskRecord]:
    """Up to `n` queued tasks in queue order whose leases are all free.

    A task whose target branch, input content or schedule prefix is held by a running dispatch
    waits (it keeps its place); so does the second of two queued tasks that want the same one.
    """
    if n <= 0:
        return []
    db = tx.db
    # Not the `work` leases: they name tasks that are active, never a queued task's resource
    # (`lease_keys`), and a batched run holds hundreds of them, each of which would otherwise
    # be read here and switch the query to its slower, filtering form.
    held = {(LeaseKind(k), key) for k, key in db.execute(
        "SELECT kind, key FROM leases WHERE kind <> 'work'")}
    sql = _QUEUED_FREE if held else _QUEUED_ALL
    picked: list[TaskRecord] = []
    queued = TaskState.QUEUED  # (what the query selects)
    window = max(4 * n, 16)
    after: tuple[int, int] = (-(1 << 63), -(1 << 63))
    while len(picked) < n:
        # Stepped row by row, not fetched: usually the first n rows are all it takes.
        cur = db.execute(sql, (*after, window))
        seen = 0
        try:
            for row in cur:
                seen += 1
                after = (row[9], row[0])
                rec = TaskRecord(row[0], row[1], _load_payload(row[2]), row[3], queued,
                                 row[5], row[6], row[7], row[8], row[10])
                keys = rec.lease_keys()
                if keys:
                    if any(k in held for k in keys):
                        continue
                    held.update(keys)
                picked.append(rec)
                if len(picked) == n:
                    break
        finally:
            cur.close()
        if seen < window:
            break
        window = min(window * 4, 4096)
    return picked


def get_task(tx: Tx, task_id: int) -> TaskRecord | None:
    row = tx.conn.execute(select(*_TASK_COLUMNS).where(tasks.c.id == task_id)).first()
    return _record(row) if row else None


def content_known(tx: Tx, input_hash: str) -> bool:
    """Whether some task's input already has these bytes (by their content hash)."""
    return tx.db.execute("SELECT 1 FROM blobs WHERE hash = ?", (input_hash,)).fetchone() is not None


def payload_known(tx: Tx, payload: Mapping[str, Any]) -> bool:
    """Whether some task already has this semantic payload (one indexed lookup)."""
    sid = canonical_form(payload)[1]
    return tx.db.execute("SELECT 1 FROM tasks WHERE semantic_id = ?", (sid,)).fetchone() is not None


def input_bytes(tx: Tx, input_hash: str | None) -> bytes | None:
    if input_hash is None:
        return None
    row = tx.db.execute("SELECT data FROM blobs WHERE hash = ?", (input_hash,)).fetchone()
    return row[0] if row else None


def retry_decision(attempts: int, budget_used: int, policy: RetryPolicy) -> TaskState:
    """Where a task goes after a failure the retry policy decides: its `attempts`-th failed
    dispatch (the ceiling) and its `budget_used`-th charged to the budget (R7, R8). A dispatch
    a crash interrupted counts towards the ceiling only."""
    if attempts >= policy.max_attempts:
        return TaskState.FAILED
    if budget_used <= policy.retries:
        return TaskState.QUEUED
    return TaskState.DEFERRED


def set_state(tx: Tx, task_id: int, expected: TaskState, new: TaskState, *,
              queue_pos: int | None = None, reason: str | None = None,
              attempts_delta: int = 0, budget_delta: int = 0,
              dispatches_delta: int = 0, batch_cap: int | None = None) -> bool:
    """The one fenced task transition: changes the row only if it is in `expected`. A
    transition outside `TASK_TRANSITIONS` is a bug in the caller, refused before any write."""
    if new not in TASK_TRANSITIONS[expected]:
        raise ValueError(f"task {task_id}: {expected.value} -> {new.value} is not a task "
                         f"transition")
    values: dict[str, Any] = {"state": new.value, "updated_at": tx.now, "reason": reason}
    if queue_pos is not None:
        values["queue_pos"] = queue_pos
    if attempts_delta:
        values["attempts"] = tasks.c.attempts + attempts_delta
    if budget_delta:
        values["budget_used"] = tasks.c.budget_used + budget_delta
    if dispatches_delta:
        values["dispatches"] = tasks.c.dispatches + dispatches_delta
    if batch_cap is not None:
        values["batch_cap"] = batch_cap
    res = tx.conn.execute(
        update(tasks).where(and_(tasks.c.id == task_id, tasks.c.state == expected.value))
        .values(**values)
    )
    return res.rowcount == 1


def input_available(payload: Mapping[str, Any]) -> bool:
    """The default admission check for a plain seed task: its input file is still there."""
    return os.path.exists(payload["path"])


def reclaim_deferred(tx: Tx, available: Callable[[Mapping[str, Any]], bool] = input_available,
                     ) -> tuple[list[int], list[int]]:
    """R9: put every admissible deferred task at the head, oldest deferral first.

    A plain task whose input is gone and was never stored is not admitted: it stays deferred
    with the reason (never deleted). Returns (reclaimed ids, refused ids).
    """
    rows = tx.conn.execute(
        select(*_TASK_COLUMNS).where(HELD_TERM, tasks.c.state == TaskState.DEFERRED.value)
        .order_by(tasks.c.updated_at, tasks.c.id)
    ).all()
    admitted: list[TaskRecord] = []
    refused: list[int] = []
    newly_refused: list[tuple[str, int]] = []
    for row in rows:
        rec = _record(row)
        if is_self_contained(rec.payload, rec.input_hash is not None) or available(rec.payload):
            admitted.append(rec)
            continue
        refused.append(rec.id)
        reason = f"input unavailable: {rec.payload['path']}"
        if rec.reason != reason:  # said once, not again at every resume (100,000 rows each)
            newly_refused.append((reason, rec.id))
            tx.event(EventKind.NOT_ADMITTED, task_id=rec.id, detail=reason)
    tx.db.executemany("UPDATE tasks SET reason = ? WHERE id = ?", newly_refused)
    pos = head_position(tx) - len(admitted) + 1
    tx.db.executemany(
        "UPDATE tasks SET state = 'queued', queue_pos = ?, reason = NULL, updated_at = ? "
        "WHERE id = ? AND state = 'deferred'",
        [(pos + i, tx.now, rec.id) for i, rec in enumerate(admitted)])
    for rec in admitted:
        tx.event(EventKind.RECLAIMED, task_id=rec.id)
    return [r.id for r in admitted], refused


#: Tasks per transaction of an operator requeue: it shares the write lock with a running
#: master, which waits for it (BUSY_TIMEOUT_MS) and must never wait long.
REQUEUE_CHUNK = 2_000


def requeue_tasks(tx: Tx, *, states: Sequence[TaskState] = (TaskState.FAILED,
                                                             TaskState.DEFERRED),
                  ids: Sequence[int] | None = None, reset_attempts: bool = True,
                  after_id: int = 0, limit: int | None = None) -> list[int]:
    """Operator requeue: failed/deferred tasks back to the tail (by state, or by id), in id
    order from `after_id` on, at most `limit` of them (the caller's next chunk starts after the
    last id returned)."""
    allowed = [s.value for s in states if s in (TaskState.FAILED, TaskState.DEFERRED)]
    q = select(tasks.c.id, tasks.c.state).where(HELD_TERM, tasks.c.state.in_(allowed),
                                                 tasks.c.id > after_id)
    if ids is not None:
        q = q.where(tasks.c.id.in_(list(ids)))
    rows = tx.conn.execute(q.order_by(tasks.c.id).limit(limit)).all()
    pos = tail_position(tx)
    tx.db.executemany(
        "UPDATE tasks SET state = 'queued', queue_pos = ?, reason = NULL, updated_at = ?"
        + (", attempts = 0, budget_used = 0" if reset_attempts else "")
        + " WHERE id = ? AND state = ?",
        [(pos + i, tx.now, r.id, r.state) for i, r in enumerate(rows)])
    for r in rows:
        tx.event(EventKind.MANUAL_REQUEUE, task_id=r.id, detail=f"from {r.state}")
    return [r.id for r in rows]


def requeue_error_results(tx: Tx, *, ids: Sequence[int] | None = None, after_id: int = 0,
                          limit: int | None = None, rank: int | None = None,
                          since: float | None = None, any_status: bool = False) -> list[int]:
    """Operator requeue of done tasks whose run failed (result status not `ok`: a command's
    non-zero exit, a missing input, a callable that raised), after the cause was fixed: the
    result row is discarded (an event keeps its token, status and detail) and the task goes
    back to the tail with a fresh attempt budget. Only `done` tasks are touched, never a
    dispatched one, so it is safe while a master runs. `after_id` and `limit` as in
    `requeue_tasks`.

    `rank`, `since`: only the results that rank committed, or committed at or after that
    time (a rank that answered wrongly: the coordinator checks which dispatch an answer
    belongs to, not whether it is true); `any_status`: its `ok` results too."""
    recorded = exists().where(events.c.task_id == results.c.task_id,
                              events.c.token == results.c.token,
                              events.c.kind == EventKind.DISPATCHED.value)
    q = (select(results.c.task_id, results.c.token, results.c.status, results.c.detail,
                results.c.rank, results.c.incarnation, results.c.dispatched_at,
                recorded.label("recorded"))
         .join(tasks, tasks.c.id == results.c.task_id)
         .where(tasks.c.state == TaskState.DONE.value, results.c.task_id > after_id))
    if not any_status:
        q = q.where(results.c.status != "ok")
    if ids is not None:
        q = q.where(results.c.task_id.in_(list(ids)))
    if rank is not None:
        q = q.where(results.c.rank == rank)
    if since is not None:
        q = q.where(results.c.committed_at >= since)
    rows = tx.conn.execute(q.order_by(results.c.task_id).limit(limit)).all()
    pos = tail_position(tx)
    tx.db.executemany("DELETE FROM results WHERE task_id = ?", [(r.task_id,) for r in rows])
    tx.db.executemany(
        "UPDATE tasks SET state = 'queued', queue_pos = ?, attempts = 0, budget_used = 0, "
        "reason = NULL, updated_at = ? WHERE id = ? AND state = 'done'",
        [(pos + i, tx.now, r.task_id) for i, r in enumerate(rows)])
    for r in rows:
        if r.dispatched_at is not None and not r.recorded:
            # The discarded result was its dispatch's record: the dispatch now ends without
            # one, so it gets its `dispatched` event, as every such dispatch does.
            tx.event(EventKind.DISPATCHED, rank=r.rank, token=r.token, task_id=r.task_id,
                     at=r.dispatched_at, incarnation=r.incarnation)
        why = (r.detail or "").strip().splitlines()
        tx.event(EventKind.MANUAL_REQUEUE, task_id=r.task_id, token=r.token,
                 detail=f"from done: its {r.status} result from rank {r.rank} discarded"
                        + (f" ({why[-1][:200]})" if why else ""))
    return [r.task_id for r in rows]
