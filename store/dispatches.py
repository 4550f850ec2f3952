"""Dispatches: one fenced transition per function (record, cancel, mark, commit, recover, ...).

Every write names the rank *and* the exact token in its WHERE clause; a write that matches no
row is reported to the caller (False / None / FenceError), never silently ignored. Lease rows
cascade with their dispatch, and both generation-gate marks are columns of the dispatch row,
so removing the row is the whole rollback of rank-owned state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sqlite3
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Connection, exists, select
from sqlalchemy.exc import DBAPIError

from .errors import FenceError
from .journal import Tx
from .schema import COUNTED_KIND_SQL, EventKind, TaskState, WorkerState, dispatches, tasks
from .tasks import TaskRecord, head_position, retry_decision, set_state
from .vocabulary import STOPPED_FREE
from .workers import set_workers


@dataclass(frozen=True)
class ActiveDispatch:
    token: str
    rank: int
    task_id: int
    incarnation: int
    sent: bool
    ready: bool
    invalid_reason: str | None
    deadline: float | None
    #: False when the rows disagree about who owns what (the dispatch's task is not active):
    #: an internal invariant is broken, and READY from this rank is classified `unowned`.
    consistent: bool
    #: Its tasks: more than one for a batch dispatch (`members` names the others).
    size: int = 1

    def with_ready_mark(self) -> ActiveDispatch:
        # Spelled out: dataclasses.replace walks the fields on every call, and this runs once
        # per task in the master round.
        return ActiveDispatch(self.token, self.rank, self.task_id, self.incarnation, self.sent,
                              True, self.invalid_reason, self.deadline, self.consistent,
                              self.size)


@dataclass(frozen=True)
class Planned:
    rank: int
    task: TaskRecord
    token: str
    deadline: float | None = None
    #: A batch's other tasks, in order (`--batch`): one dispatch, one token, all of them.
    more: tuple[TaskRecord, ...] = ()

    @property
    def tasks(self) -> tuple[TaskRecord, ...]:
        return (self.task, *self.more)


#: json.dumps with these options builds an encoder at each call (a third of its time on the
#: small values of a batch's tasks): one, made once.
_VALUE_ENCODER = json.JSONEncoder(sort_keys=True, allow_nan=False)


def _not_json(o: Any) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


#: And even `JSONEncoder.encode` makes a new C encoder at each call (about half of what it
#: then takes for a small value). This one is made once, with `_VALUE_ENCODER`'s options and
#: no circular-reference bookkeeping (its memo would be state shared between calls): a value
#: decoded from msgpack cannot refer to itself, and one nested too deep still raises
#: RecursionError.
_C_ENCODER = (None if json.encoder.c_make_encoder is None else json.encoder.c_make_encoder(
    None, _not_json, json.encoder.encode_basestring_ascii, None,
    _VALUE_ENCODER.key_separator, _VALUE_ENCODER.item_separator, True, False, False))


def encode_value(value: Any) -> str | None:
    """A result value as stored (`results.value`): canonical JSON, or None for no value.
    Raises TypeError/ValueError for what JSON cannot hold (bytes, NaN, keys of mixed types)."""
    if value is None:
        return None
    if _C_ENCODER is None:
        return _VALUE_ENCODER.encode(value)
    return "".join(_C_ENCODER(value, 0))


# Not frozen, for the reason TaskRecord is not: one is made per task a batch commits.
@dataclass(slots=True)
class CommitItem:
    rank: int
    token: str
    #: One task of a batch dispatch (None: the dispatch's own, single, task).
    task_id: int | None = None
    status: str = "ok"
    value_json: str | None = None  # from encode_value
    testcases: int = 0
    new_tasks: int = 0
    detail: str | None = None  # kept for a non-ok status only (results.detail)
    dropped: int = 0  # test cases the worker could not send (results.dropped)


@dataclass(frozen=True)
class Recovery:
    rank: int
    token: str
    task_id: int
    outcome: TaskState  # queued (requeued at the head), deferred or failed
    attempts: int
    defer_failed: bool = False
    ready_seen: bool = False  # the rank's READY for it was seen: the rank is idle, not parked
    #: A batch dispatch's tasks, back at the head in two halves, none charged: each half may
    #: go out again in a dispatch of at most its own size (so a poison task is alone after
    #: ceil(log2 N) more failures, and only it is ever charged).
    halves: tuple[tuple[int, ...], tuple[int, ...]] | None = None


_ACTIVE = """
SELECT d.token, d.rank, d.task_id, d.incarnation, d.sent_at, d.ready_at, d.invalid_reason,
       d.deadline, t.state = 'active',
       1 + (SELECT count(*) FROM leases l WHERE l.token = d.token AND l.kind = 'work')
FROM dispatches d LEFT JOIN tasks t ON t.id = d.task_id
"""
#: The same for some ranks (a JSON array), through the rank's UNIQUE index: the master's round
#: reads the dispatches of the ranks that answered, not of every rank holding work.
_ACTIVE_OF = _ACTIVE + "WHERE d.rank IN (SELECT value FROM json_each(?))\n"


def active_by_rank(tx: Tx, ranks: Collection[int] | None = None) -> dict[int, ActiveDispatch]:
    """Every active dispatch with its ownership check (only `ranks`' if given), in one query.
    Pending row changes (`_Pending`) are taken into account, not written: the sends marked at
    the start of a round then reach the rows with the commits of its answers, in the same
    statements."""
    pending = tx.pending()
    if isinstance(pending, _Pending) and (pending.ready or pending.commits):
        # (Not in the master's round, where marks and commits come after this read.)
        tx.write_pending()
        pending = None
    sent = pending.sent if isinstance(pending, _Pending) else {}
    return {r[1]: ActiveDispatch(r[0], r[1], r[2], r[3], r[4] is not None or r[0] in sent,
                                 r[5] is not None, r[6], r[7], r[8] == 1, r[9])
            for r in (tx.raw_db.execute(_ACTIVE) if ranks is None else
                      tx.raw_db.execute(_ACTIVE_OF, (_ids(sorted(ranks)),)))}


#: One statement for every listed task (a JSON array of ids), not one execution each: an
#: executemany's own per-row cost would double what a batch's UPDATEs take.
_UPDATE_LISTED = ("UPDATE tasks SET {} WHERE id IN (SELECT value FROM json_each(?)) "
                  "AND state = '{}'")


#: A list of ids as JSON text for json_each (msgspec: a tenth of json.dumps' time).
_json_list = msgspec.json.Encoder().encode


def _ids(ids: Sequence[int]) -> str:
    return _json_list(ids).decode()


def record_dispatches(tx: Tx, plan: Sequence[Planned]) -> None:
    """Before the send: task active, a dispatch row with its fresh token, one lease per side
    reservation, the rank busy. The caller commits, then sends. No event: the dispatch row is
    the record while it is active, then its results row or its `dispatched` event (`_take`)."""
    if not plan:
        return
    db = tx.db
    db.executemany(
        "INSERT INTO dispatches (token, rank, task_id, incarnation, created_at, deadline) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        [(p.token, p.rank, p.task.id, tx.incarnation, tx.now, p.deadline) for p in plan])
    every = [t.id for p in plan for t in p.tasks]
    n = db.execute(_UPDATE_LISTED.format(
        "state = 'active', dispatches = dispatches + 1, updated_at = ?, reason = NULL",
        "queued"), (tx.now, _ids(every))).rowcount
    if n != len(every):
        raise FenceError(f"{len(every) - n} of {len(every)} planned tasks were no longer queued")
    # A batch's other tasks are reserved by `work` leases of its dispatch (UNIQUE key: a task
    # in one active dispatch at most), removed with it, in the batch's order (lease id).
    for p in plan:
        if p.more:
            db.execute("INSERT INTO leases (token, kind, key) SELECT ?, 'work', "
                       "CAST(value AS TEXT) FROM json_each(?) ORDER BY key",
                       (p.token, _ids([t.id for t in p.more])))
    held = [(p.token, kind.value, key) for p in plan for t in p.tasks
            for kind, key in t.lease_keys()]
    if held:
        db.executemany("INSERT INTO leases (token, kind, key) VALUES (?, ?, ?)", held)
    set_workers(tx, [(p.rank, WorkerState.BUSY) for p in plan])


class _Pending:
    """The row changes a master round's answers make, left pending (`Tx.write_behind`) and
    written together: the sends marked, the current READYs' marks, the commits. A commit
    takes its dispatch's pending send and READY times into its result row, so a dispatch
    whose WORK left last round and whose answers came in this one is written once, by its
    commit, instead of by three UPDATEs first; and the commits of all the batches of answers
    a round applies go in one statement of each kind, not in one per batch."""

    __slots__ = ("sent", "ready", "commits")

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}                 # token -> when its WORK left
        self.ready: dict[tuple[int, str], float] = {}    # (rank, token) -> when seen
        self.commits: list[tuple[CommitItem, int, bool]] = []  # item, task id, READY seen

    def write(self, tx: Tx) -> None:
        db = tx.db  # (no longer pending: the transaction let go of it before this call)
        if self.commits:
            _write_commits(tx, self)
        if self.sent:
            # The watchdog's budget counts from the WORK leaving, not from the dispatch's
            # planning: a COMMIT held up by a slow disk (or a master descheduled) before the
            # send must not eat the worker's time and retire a dispatch whose answer is due.
            db.executemany("UPDATE dispatches SET sent_at = ?1, "
                           "deadline = deadline - created_at + ?1 WHERE token = ?2 "
                           "AND sent_at IS NULL", [(at, t) for t, at in self.sent.items()])
        if self.ready:
            db.executemany("UPDATE dispatches SET ready_at = ? WHERE rank = ? AND token = ? "
                           "AND ready_at IS NULL",
                           [(at, r, t) for (r, t), at in self.ready.items()])


def _pending(tx: Tx) -> _Pending:
    pending = tx.write_behind(_Pending)
    assert isinstance(pending, _Pending)
    return pending


def mark_sent(tx: Tx, tokens: Iterable[str | tuple[str, float]]) -> None:
    """WORK left the master: from now on a rollback is post-send (the attempt counts), and a
    watchdog deadline counts from then. Each token comes with when its WORK left, or alone
    (then: this transaction's time). Written with the transaction's next statement of another
    kind, or by the commit of the dispatch's result in this transaction (`_Pending`)."""
    sent = _pending(tx).sent
    for t in tokens:
        token, at = (t, tx.now) if isinstance(t, str) else t
        sent.setdefault(token, at)


def members(tx: Tx, token: str) -> list[int]:
    """A batch dispatch's other tasks, in order ([] for a single-task dispatch)."""
    return [int(k) for (k,) in tx.db.execute(
        "SELECT key FROM leases WHERE token = ? AND kind = 'work' ORDER BY id", (token,))]


@dataclass(frozen=True)
class Taken:
    """A dispatch just removed: its tasks (the first is the row's own) and its times."""

    task_ids: tuple[int, ...]
    sent_at: float | None
    ready_at: float | None
    created_at: float
    incarnation: int

    def __getitem__(self, i: int) -> Any:  # (task_id, sent_at, ready_at) as a row had them
        return (self.task_ids[0], self.sent_at, self.ready_at)[i]


def _take(tx: Tx, rank: int, token: str, *, unsent_only: bool = False) -> Taken | None:
    """Delete the dispatch (rank, token) and return its tasks and times; None if it is not
    current. Its leases go with it (ON DELETE CASCADE), a batch's `work` leases included.

    A dispatch that ends here ends without a result, so its `dispatched` event is written now
    for each of its tasks, with the time and incarnation it was recorded in: the record a
    committed dispatch has in its results row. A pre-send rewind (`unsent_only`) is a
    dispatch that never was: none."""
    more = members(tx, token)
    sql = "DELETE FROM dispatches WHERE rank = ? AND token = ?"
    if unsent_only:
        sql += " AND sent_at IS NULL"
    row = tx.db.execute(sql + " RETURNING task_id, sent_at, ready_at, created_at, incarnation",
                        (rank, token)).fetchone()
    if row is None:
        return None
    taken = Taken((row[0], *more), row[1], row[2], row[3], row[4])
    if not unsent_only:
        for task_id in taken.task_ids:
            tx.event(EventKind.DISPATCHED, rank=rank, token=token, task_id=task_id, at=row[3],
                     incarnation=row[4])
    return taken


def cancel_dispatch(tx: Tx, rank: int, token: str, *,
                    worker_state: WorkerState = WorkerState.IDLE, detail: str | None = None,
                    ) -> bool:
    """Pre-send compensation: the WORK never left, so everything is rewound exactly (the task
    keeps its queue place, the dispatch count goes back, no attempt is counted)."""
    return _rewind(tx, rank, token, worker_state, detail) is not None


def _rewind(tx: Tx, rank: int, token: str, worker_state: WorkerState, detail: str | None,
            to: TaskState = TaskState.QUEUED, reason: str | None = None,
            bad: Collection[int] | None = None) -> list[int] | None:
    """`cancel_dispatch`: the tasks back in their places, or, those in `bad` (default: the
    first), going `to` that state; returns the ones that went `to` it (None: no such unsent
    dispatch)."""
    taken = _take(tx, rank, token, unsent_only=True)
    if taken is None:
        return None
    bad = set(bad) if bad is not None else {taken.task_ids[0]}
    for task_id in taken.task_ids:
        state = to if task_id in bad else TaskState.QUEUED
        if not set_state(tx, task_id, TaskState.ACTIVE, state, dispatches_delta=-1,
                         reason=reason if task_id in bad else None):
            raise FenceError(f"task {task_id} of dispatch {token[:12]} was not active")
        tx.event(EventKind.SEND_FAILED, rank=rank, token=token, task_id=task_id, detail=detail)
    set_workers(tx, [(rank, worker_state)])
    return [t for t in taken.task_ids if t in bad]


def split_unsent(tx: Tx, rank: int, token: str, why: str) -> bool:
    """Pre-send, for a batch whose WORK is too large to send as one message: rewound in place
    as for a failed send, each task capped to its half (`tasks.batch_cap`), none charged, so
    the next dispatches carry half as much. The rank stays idle."""
    taken = _take(tx, rank, token, unsent_only=True)
    if taken is None:
        return False
    n = len(taken.task_ids)
    for i, task_id in enumerate(taken.task_ids):
        if not set_state(tx, task_id, TaskState.ACTIVE, TaskState.QUEUED, dispatches_delta=-1,
                         batch_cap=half_size(n, i)):
            raise FenceError(f"task {task_id} of dispatch {token[:12]} was not active")
        tx.event(EventKind.SEND_FAILED, rank=rank, token=token, task_id=task_id,
                 detail=f"split: {why}")
    set_workers(tx, [(rank, WorkerState.IDLE)])
    return True


def refuse_unsendable(tx: Tx, rank: int, token: str, why: str,
                      bad: Collection[int] | None = None) -> bool:
    """Pre-send, for a task whose WORK cannot be built (a payload stored by an older version
    that the wire format cannot carry): the dispatch is rewound as for a failed send, and the
    task is held as failed with the reason, since every later dispatch would fail the same way
    (and a master that raised here would do so again at each --resume). The rank stays idle.
    `bad`: the tasks of a batch that cannot be carried (default: its first); the others go
    back to their places."""
    reason = f"its WORK message cannot be built: {why}"
    failed = _rewind(tx, rank, token, WorkerState.IDLE, f"WORK not built: {why}",
                     to=TaskState.FAILED, reason=reason, bad=bad)
    if failed is None:
        return False
    for task_id in failed:
        tx.event(EventKind.FAILED, rank=rank, token=token, task_id=task_id, detail=reason)
    return True


def set_ready_mark(tx: Tx, rank: int, token: str) -> None:
    """R2: the current READY for (rank, token) was observed. Written, fenced by rank, token and
    no mark yet, with the transaction's next statement of another kind, or by the commit of
    the dispatch's result in this transaction (`_Pending`)."""
    # No event: the mark is a column, and the committed result keeps its time (ready_at).
    _pending(tx).ready.setdefault((rank, token), tx.now)


def set_invalid_mark(tx: Tx, rank: int, token: str, reason: str) -> bool:
    """R2: a missing/malformed/invalid current RESULT was observed for (rank, token). Only the
    first sets the mark (its reason kept) and writes the `invalid` event: a repeat adds
    nothing to the join, and a rank that answered each WORK with 2,000 bad RESULTs wrote an
    event row per message (168,000 in 32 s, 16.6 MB). Each one is still counted,
    exactly, in the sampled quarantine (`repeats`). Returns whether this one set the mark."""
    n = tx.db.execute("UPDATE dispatches SET invalid_reason = ? WHERE rank = ? AND token = ? "
                      "AND invalid_reason IS NULL", (reason, rank, token)).rowcount
    if n:
        tx.event(EventKind.INVALID, rank=rank, token=token, detail=reason)
    return n == 1


def commit_results(tx: Tx, items: Sequence[CommitItem],
                   active: dict[int, ActiveDispatch]) -> None:
    """Only a current RESULT commits (R3): result row, task done, dispatch and its leases gone
    (a later valid RESULT also clears an earlier invalid mark, R5). The rank becomes idle only
    if its current READY was already seen; otherwise it waits for that READY. `active` is the
    dispatches as the caller classified the RESULTs against (ready marks included).

    Written, fenced by rank and token, with the transaction's next statement of another kind
    (`_Pending`): a FenceError for a dispatch that vanished surfaces there."""
    if not items:
        return
    checked: dict[int, ActiveDispatch] = {}  # (a batch's items share their rank's check)
    for it in items:
        a = checked.get(it.rank)
        if a is None or a.token != it.token:
            a = active.get(it.rank)
            if a is None or a.token != it.token:
                raise FenceError(f"rank {it.rank} token {it.token[:12]} is not current")
            checked[it.rank] = a
    _pending(tx).commits.extend(
        (it, it.task_id if it.task_id is not None else checked[it.rank].task_id,
         checked[it.rank].ready) for it in items)


def _write_commits(tx: Tx, pending: _Pending) -> None:
    batches = [c for c in pending.commits if c[0].task_id is not None]
    if batches:
        pending.commits = [c for c in pending.commits if c[0].task_id is None]
        _write_batch_commits(tx, pending, batches)
        if not pending.commits:
            return
    db, items = tx.db, pending.commits
    # The result row is the record of the commit and of its dispatch (no event for either): it
    # takes the task, the token and the dispatch/send/READY times from the dispatch row, which
    # must still be there, or from the marks pending with it.
    n = db.executemany(
        "INSERT INTO results (task_id, token, rank, incarnation, committed_at, status, value, "
        "testcases, new_tasks, detail, dropped, sent_at, ready_at, dispatched_at) SELECT task_id, "
        "token, rank, ?, ?, ?, ?, ?, ?, ?, ?, coalesce(sent_at, ?), coalesce(ready_at, ?), "
        "created_at "
        "FROM dispatches WHERE rank = ? AND token = ?",
        [(tx.incarnation, tx.now, it.status, it.value_json, it.testcases, it.new_tasks,
          it.detail, it.dropped, pending.sent.pop(it.token, None),
          pending.ready.pop((it.rank, it.token), None), it.rank, it.token)
         for it, _, _ in items]).rowcount
    if n == len(items):
        n = db.executemany("DELETE FROM dispatches WHERE rank = ? AND token = ?",
                           [(it.rank, it.token) for it, _, _ in items]).rowcount
    if n != len(items):
        raise FenceError(f"{len(items) - n} dispatches vanished before their commit")
    _tasks_done(tx, [task_id for _, task_id, _ in items], "a committed task")
    set_workers(tx, [(it.rank, WorkerState.IDLE if ready else WorkerState.BUSY)
                     for it, _, ready in items])


def _tasks_done(tx: Tx, task_ids: list[int], what: str) -> None:
    """The committed tasks, active until now, done: one statement for all of them."""
    n = tx.db.execute(_UPDATE_LISTED.format("state = 'done', updated_at = ?, reason = NULL",
                                            "active"), (tx.now, _ids(task_ids))).rowcount
    if n != len(task_ids):
        raise FenceError(f"{what} was not active")


#: A batch's result rows go in statements of this many rows at most, each a multi-row VALUES
#: whose dispatch columns (token, rank, times) are bound once: an executemany row costs about
#: 8 µs here and a row of such a statement 5 (its per-row reset, step and 14 bindings gone).
#: Sizes are powers of two, so that a few statement texts cover every batch size and stay in
#: the driver's statement cache.
_RESULT_ROWS = (32, 16, 8, 4, 2, 1)
_RESULT_COLUMNS = ("INSERT INTO results (task_id, token, rank, incarnation, committed_at, "
                   "status, value, testcases, new_tasks, detail, dropped, sent_at, ready_at, "
                   "dispatched_at) VALUES ")
#: Bound first, once per statement: token, rank, incarnation, committed_at, sent_at,
#: ready_at, dispatched_at; then each row's own 7 values (`_ROW_FIELDS`).
_SHARED = 7
_ROW_FIELDS = 7


@functools.cache
def _insert_results_sql(rows: int) -> str:
    return _RESULT_COLUMNS + ", ".join(
        f"(?{b}, ?1, ?2, ?3, ?4, ?{b + 1}, ?{b + 2}, ?{b + 3}, ?{b + 4}, ?{b + 5}, ?{b + 6}, "
        f"?5, ?6, ?7)" for b in range(_SHARED + 1, _SHARED + 1 + rows * _ROW_FIELDS,
                                       _ROW_FIELDS))


def _insert_results(db: sqlite3.Connection, shared: list[Any], values: list[Any]) -> None:
    """One dispatch's result rows: `values` is each row's `_ROW_FIELDS`, flat."""
    at, left = 0, len(values) // _ROW_FIELDS
    for size in _RESULT_ROWS:
        while left >= size:
            step = size * _ROW_FIELDS
            db.execute(_insert_results_sql(size), shared + values[at:at + step])
            at, left = at + step, left - size


def _write_batch_commits(tx: Tx, pending: _Pending,
                         items: list[tuple[CommitItem, int, bool]]) -> None:
    """The commits of batch dispatches: a result row per task (the same token, rank and
    dispatch times for all of a dispatch's), then the dispatch and its leases gone, once."""
    db = tx.db
    by_token: dict[tuple[int, str], tuple[bool, list[Any]]] = {}
    for it, task_id, ready in items:
        key = (it.rank, it.token)
        got = by_token.get(key)
        if got is None:
            got = by_token[key] = (ready, [])
        got[1].extend((task_id, it.status, it.value_json, it.testcases, it.new_tasks,
                       it.detail, it.dropped))
    for (rank, token), (_, values) in by_token.items():
        times = db.execute("SELECT created_at, sent_at, ready_at FROM dispatches "
                           "WHERE rank = ? AND token = ?", (rank, token)).fetchone()
        if times is None:
            raise FenceError(f"rank {rank} token {token[:12]} vanished before its commit")
        created, sent, seen = times
        sent = sent if sent is not None else pending.sent.pop(token, None)
        seen = seen if seen is not None else pending.ready.pop((rank, token), None)
        _insert_results(db, [token, rank, tx.incarnation, tx.now, sent, seen, created], values)
    n = db.executemany("DELETE FROM dispatches WHERE rank = ? AND token = ?",
                       list(by_token)).rowcount
    if n != len(by_token):
        raise FenceError(f"{len(by_token) - n} batch dispatches vanished before their commit")
    _tasks_done(tx, [task_id for _, task_id, _ in items], "a committed task of a batch")
    set_workers(tx, [(rank, WorkerState.IDLE if ready else WorkerState.BUSY)
                     for (rank, _), (ready, _) in by_token.items()])


def end_without_result(tx: Tx, rank: int, token: str, reasons: Mapping[int, str],
                       unrun: Collection[int] = (), free: Collection[int] = (),
                       ) -> list[Recovery]:
    """Tasks of a batch dispatch whose own run failed (a `timeout`, a `not_run`) while the
    others commit, each with the reason its retry is recorded with: each is retried on its own,
    charged as a single task's failure, its dispatch recorded by its `dispatched` event (the
    committed ones' record is their result row), those requeued back at the head in the
    order of `reasons` (the batch's). `unrun`: those whose host could not run
    them, charged the budget only; `free`: of those, the ones charged nothing
    (`_apply_retry`)."""
    times = tx.db.execute("SELECT created_at, incarnation FROM dispatches WHERE rank = ? AND "
                          "token = ?", (rank, token)).fetchone()
    if times is None:
        raise FenceError(f"rank {rank} token {token[:12]} is not current")
    out = []
    pos = head_position(tx) - len(reasons) + 1
    for i, (task_id, reason) in enumerate(reasons.items()):
        tx.db.execute("DELETE FROM leases WHERE token = ? AND kind = 'work' AND key = ?",
                      (token, str(task_id)))
        tx.event(EventKind.DISPATCHED, rank=rank, token=token, task_id=task_id, at=times[0],
                 incarnation=times[1])
        tx.event(EventKind.TASK_FAILED, rank=rank, token=token, task_id=task_id,
                 detail=reason)
        out.append(_apply_retry(tx, rank, token, task_id, reason, protocol=False,
                                charge_attempt=task_id not in unrun,
                                charge_budget=task_id not in free, queue_pos=pos + i))
    return out


def retry_all(tx: Tx, rank: int, token: str, reasons: Mapping[int, str],
              unrun: Collection[int] = (), free: Collection[int] = ()) -> list[Recovery]:
    """A batch dispatch all of whose tasks' runs failed on their own (`timeout`, `not_run`):
    it ends, and each task is retried, charged as a single task's failure (`reasons`: each
    one's; `unrun` and `free` as for `end_without_result`). Those requeued go back to the
    head in the batch's order (a half of a broken batch still ahead of the other half)."""
    taken = _take(tx, rank, token)
    if taken is None:
        return []
    out = []
    pos = head_position(tx) - len(taken.task_ids) + 1
    for i, task_id in enumerate(taken.task_ids):
        reason = reasons[task_id]
        tx.event(EventKind.TASK_FAILED, rank=rank, token=token, task_id=task_id,
                 detail=reason)
        out.append(_apply_retry(tx, rank, token, task_id, reason, protocol=False,
                                charge_attempt=task_id not in unrun,
                                charge_budget=task_id not in free, queue_pos=pos + i))
    set_workers(tx, [(rank, WorkerState.IDLE if taken.ready_at is not None
                      else WorkerState.BUSY)])
    return out


def find_joined(tx: Tx) -> list[tuple[int, str, str]]:
    """R3: the dispatches whose ready mark and invalid mark name the same token, one query:
    (rank, token, the invalid mark's reason)."""
    return tx.db.execute(
        "SELECT rank, token, invalid_reason FROM dispatches WHERE ready_at IS NOT NULL "
        "AND invalid_reason IS NOT NULL ORDER BY rank").fetchall()


def extend_deadlines(tx: Tx, seconds: float) -> int:
    """Every sent dispatch's watchdog deadline `seconds` later (the master was not running
    that long: `coordinator.pauses`); how many moved. An unsent one's deadline is set from
    its send (`mark_sent`), which is still to come."""
    return tx.db.execute("UPDATE dispatches SET deadline = deadline + ? WHERE deadline IS "
                         "NOT NULL AND sent_at IS NOT NULL", (seconds,)).rowcount


def find_expired(tx: Tx) -> list[tuple[int, str]]:
    """Dispatches past their watchdog deadline: no join will ever come for them (the worker
    died or hung, or its RESULT was lost after its READY)."""
    return tx.db.execute(
        "SELECT rank, token FROM dispatches WHERE deadline IS NOT NULL AND deadline < ? "
        "ORDER BY rank", (tx.now,)).fetchall()


def _apply_retry(tx: Tx, rank: int | None, token: str, task_id: int, reason: str, *,
                 protocol: bool = True, charge_attempt: bool = True,
                 charge_budget: bool = True, queue_pos: int | None = None) -> Recovery:
    """Post-send compensation plus the retry policy: the attempt counts, towards the ceiling
    and the budget alike (the worker may have consumed the input), then requeue at the head,
    defer, or hold as failed.

    `protocol` says whether a broken dispatch (counted as Protocol-requeued/-deferred) or a
    task whose run failed (a timeout, a run its host could not start; counted apart) is being
    retried. `charge_attempt=False` (a run its host could not start) charges the budget only:
    deferred past it, never held failed for a broken host. `charge_budget=False` as well (a
    host already known to fail every task, while other ranks run them:
    `coordinator.cooldown`) charges nothing: back at the head, for a healthy rank.
    `queue_pos`: its place at the head when several tasks of one batch go back (the head
    position taken once for them all), so that they keep the batch's order; one each at the
    head, in turn, reversed it."""
    requeued_kind = EventKind.REQUEUED if protocol else EventKind.RETRIED
    deferred_kind = EventKind.DEFERRED if protocol else EventKind.TASK_DEFERRED
    attempts, budget_used = tx.conn.execute(
        select(tasks.c.attempts, tasks.c.budget_used).where(tasks.c.id == task_id)).one()
    charge = int(charge_attempt and charge_budget)
    budget = int(charge_budget)
    attempts += charge
    decision = (retry_decision(attempts, budget_used + 1, tx.policy) if charge_budget
                else TaskState.QUEUED)
    if decision is TaskState.DEFERRED:
        try:
            with tx.savepoint():
                ok = set_state(tx, task_id, TaskState.ACTIVE, TaskState.DEFERRED,
                               attempts_delta=charge, budget_delta=budget, reason=reason)
                tx.event(deferred_kind, rank=rank, token=token, task_id=task_id,
                         detail=reason)
        except (DBAPIError, sqlite3.Error) as e:
            # R8: a deferral that cannot be written must not lose the task: keep it queued.
            ok = set_state(tx, task_id, TaskState.ACTIVE, TaskState.QUEUED,
                           queue_pos=head_position(tx) if queue_pos is None else queue_pos,
                           attempts_delta=charge, budget_delta=1,
                           reason=f"deferral failed: {getattr(e, 'orig', None) or e}")
            tx.event(EventKind.DEFER_FAILED, rank=rank, token=token, task_id=task_id,
                     detail=str(getattr(e, "orig", None) or e)[:500])
            if not ok:
                raise FenceError(f"task {task_id} was not active") from None
            return Recovery(rank or 0, token, task_id, TaskState.QUEUED, attempts, True)
    elif decision is TaskState.QUEUED:
        ok = set_state(tx, task_id, TaskState.ACTIVE, TaskState.QUEUED,
                       queue_pos=head_position(tx) if queue_pos is None else queue_pos,
                       attempts_delta=charge, budget_delta=budget, reason=reason)
        tx.event(requeued_kind, rank=rank, token=token, task_id=task_id, detail=reason)
    else:
        ok = _hold_failed(tx, rank, token, task_id, attempts, reason, charged=True)
    if not ok:
        raise FenceError(f"task {task_id} was not active")
    return Recovery(rank or 0, token, task_id, decision, attempts)


def _hold_failed(tx: Tx, rank: int | None, token: str, task_id: int, attempts: int,
                 last: str, *, charged: bool = False) -> bool:
    """The attempt ceiling: the task is held as failed (its `attempts`-th failure counted,
    and charged to the budget if the retry policy decided it)."""
    why = f"{attempts} failed attempts (ceiling {tx.policy.max_attempts}); last: {last}"
    ok = set_state(tx, task_id, TaskState.ACTIVE, TaskState.FAILED, attempts_delta=1,
                   budget_delta=int(charged), reason=why)
    tx.event(EventKind.FAILED, rank=rank, token=token, task_id=task_id, detail=why)
    return ok


def half_size(n: int, i: int) -> int:
    """The size of the half of a broken dispatch of `n` tasks that its `i`-th task goes back
    in (`tasks.batch_cap`): the first ⌈n/2⌉, the rest ⌊n/2⌋."""
    half = (n + 1) // 2
    return half if i < half else n - half


def _split_back(tx: Tx, rank: int, token: str, task_ids: Sequence[int], reason: str,
                kind: EventKind = EventKind.REQUEUED) -> Recovery:
    """A failed dispatch of several tasks: which of them broke it is not known, so none is
    charged. They go back to the head of the queue, in order, as two halves (`Recovery.
    halves`), each to be dispatched again in a dispatch of at most its own size. `kind`:
    the event that says so (`split` for a batch whose worker asked for it: no failure)."""
    half = (len(task_ids) + 1) // 2
    pos = head_position(tx) - len(task_ids) + 1
    for i, task_id in enumerate(task_ids):
        if not set_state(tx, task_id, TaskState.ACTIVE, TaskState.QUEUED, queue_pos=pos + i,
                         reason=reason, batch_cap=half_size(len(task_ids), i)):
            raise FenceError(f"task {task_id} of dispatch {token[:12]} was not active")
    tx.event(kind, rank=rank, token=token, task_id=task_ids[0],
             detail=f"split: {len(task_ids)} tasks back at the head in halves of {half} and "
                    f"{len(task_ids) - half}, none charged ({reason})")
    return Recovery(rank, token, task_ids[0], TaskState.QUEUED, 0,
                    halves=(tuple(task_ids[:half]), tuple(task_ids[half:])))


def recover_dispatch(tx: Tx, rank: int, token: str, *, cause: EventKind = EventKind.RECOVERED,
                     reason: str | None = None, worker_state: WorkerState | None = None,
                     charge_attempt: bool = True, charge_budget: bool = True,
                     ) -> Recovery | None:
    """R6: roll back exactly the dispatch (rank, token) and hand its task to the retry policy
    (`charge_attempt`, `charge_budget`: as `_apply_retry`'s).

    A stale token (or a rank with another dispatch) changes nothing and returns None. The rank
    becomes idle if its current READY was seen, else `worker_state` (e.g. parked, failed).
    """
    row = _take(tx, rank, token)
    if row is None:
        return None
    detail = reason or cause.value
    asked = cause is EventKind.SPLIT and len(row.task_ids) > 1  # (its one event says it all)
    if not asked:
        # Whether the rank's READY was seen decides if it is free now or parked (post-mortems
        # ask).
        tx.event(cause, rank=rank, token=token, task_id=row[0],
                 detail=f"{detail} ({'READY seen' if row[2] is not None else 'no READY'})")
    if len(row.task_ids) > 1:
        rec = _split_back(tx, rank, token, row.task_ids, detail,
                          EventKind.SPLIT if asked else EventKind.REQUEUED)
    else:
        rec = _apply_retry(tx, rank, token, row[0], detail,
                           protocol=cause is not EventKind.TASK_FAILED,
                           charge_attempt=charge_attempt, charge_budget=charge_budget)
    if row[2] is not None:
        rec = dataclasses.replace(rec, ready_seen=True)
        set_workers(tx, [(rank, WorkerState.IDLE)])
    elif worker_state is not None:
        set_workers(tx, [(rank, worker_state)],
                    parked_token=token if worker_state is WorkerState.PARKED else None)
    return rec


#: The start of the detail of such a run's `interrupted` event (then the stop's cause).
STOPPED_BY = "stopped ("


#: The detail of a `stop` event that names a rank, written just after the stop's own: that
#: rank held work and its worker was gone when the stop signal came (MPI reported it dead, or
#: its pid was no process on its host). Without ULFM such a death is what makes the launcher
#: signal the master, so that rank's run is charged at `--resume` as a crash's; the other
#: ranks' runs are not.
GONE_AT_STOP = "its worker was gone when the stop came"


def stop_signals(tx: Tx) -> tuple[dict[int, str], set[tuple[int, int]]]:
    """incarnation -> the first stop signal it got, and the (incarnation, rank) whose worker
    was gone at it (its `stop` events; one index range)."""
    got: dict[int, str] = {}
    gone: set[tuple[int, int]] = set()
    for incarnation, rank, detail in tx.db.execute(
            f"SELECT incarnation, rank, detail FROM events WHERE kind = 'stop' "
            f"AND {COUNTED_KIND_SQL} ORDER BY id"):
        if rank is None:
            got.setdefault(incarnation, detail or "a stop signal")
        else:
            gone.add((incarnation, rank))
    return got, gone


def _stopped_free_runs(tx: Tx, task_id: int) -> int:
    return tx.db.execute("SELECT count(*) FROM events WHERE task_id = ? AND kind = 'interrupted' "
                         "AND substr(detail, 1, ?) = ?",
                         (task_id, len(STOPPED_BY), STOPPED_BY)).fetchone()[0]


def requeue_in_flight(tx: Tx, *, earlier_incarnations: bool,
                      charged_ranks: Collection[int] = ()) -> list[int]:
    """Return dispatched work to the queue head, oldest dispatch first.

    Graceful stop (`earlier_incarnations=False`): this incarnation's dispatches; no attempt is
    counted, except for the dispatches of `charged_ranks` (workers known to be gone: the task
    may be what killed them, and a launcher that tears the job down after a death signals the
    master like an operator would). Resume (`True`): dispatches an earlier incarnation left
    behind when it died; the attempt counts and the ceiling applies, but nothing is charged to
    the immediate-retry budget (`budget_used`: a coordinator crash is not a protocol failure).
    A single task's run of an incarnation that recorded a stop (a `stop` event: a stop signal,
    its storage full) before it died is charged nothing, STOPPED_FREE times at most per task:
    its operator's stop (at a Slurm time limit `mpiexec` ends the ranks before the graceful
    stop can finish, and SIGKILL follows the scheduler's grace) or its storage ended it, not a
    crash the task may have caused.
    """
    cond = (dispatches.c.incarnation < tx.incarnation if earlier_incarnations
            else dispatches.c.incarnation == tx.incarnation)
    rows = tx.conn.execute(select(dispatches.c.rank, dispatches.c.token, dispatches.c.task_id,
                                  dispatches.c.ready_at, dispatches.c.incarnation)
                           .where(cond).order_by(dispatches.c.created_at.desc(),
                                                 dispatches.c.rank.desc())).all()
    kind = EventKind.INTERRUPTED if earlier_incarnations else EventKind.STOP_REQUEUED
    stopped, gone = stop_signals(tx) if earlier_incarnations and rows else ({}, set())
    back: list[int] = []
    for r in rows:  # newest first, each to the head: the oldest ends up first
        taken = _take(tx, r.rank, r.token)
        assert taken is not None
        # A batch's tasks are never charged: which of them it was is not known. Where a single
        # task would be charged (the dispatch may be what ended its worker, or the job), they
        # go back in halves, as a broken batch does: without ULFM a worker's crash ends the
        # whole job, and a batch requeued whole at each --resume ended it again for ever.
        suspect = earlier_incarnations or r.rank in charged_ranks
        n = len(taken.task_ids)
        free = None
        # Bounded: a target that signals the whole job (or a worker's death that makes
        # `mpiexec` signal the master) must not get its task rerun uncharged for ever.
        if suspect and n == 1 and r.incarnation in stopped \
                and (r.incarnation, r.rank) not in gone \
                and _stopped_free_runs(tx, r.task_id) < STOPPED_FREE:
            free = f"{STOPPED_BY}{stopped[r.incarnation]}): not charged"
        charged = suspect and n == 1 and free is None
        split = (f"split: {n} tasks back at the head in halves of {half_size(n, 0)} and "
                 f"{half_size(n, n - 1)}, none charged") if suspect and n > 1 else None
        tx.event(kind, rank=r.rank, token=r.token, task_id=r.task_id,
                 detail="worker gone" if charged and not earlier_incarnations else split or free)
        pos = head_position(tx) - len(taken.task_ids) + 1
        for i, task_id in enumerate(taken.task_ids):
            if charged:
                attempts = tx.conn.execute(
                    select(tasks.c.attempts).where(tasks.c.id == task_id)).scalar_one() + 1
                if attempts >= tx.policy.max_attempts:
                    _hold_failed(tx, r.rank, r.token, task_id, attempts,
                                 "interrupted by a coordinator restart" if earlier_incarnations
                                 else "its worker was gone at a stop")
                    continue
            set_state(tx, task_id, TaskState.ACTIVE, TaskState.QUEUED, queue_pos=pos + i,
                      attempts_delta=int(charged),
                      batch_cap=half_size(n, i) if suspect and n > 1 else None)
        back[:0] = taken.task_ids
    if not earlier_incarnations and rows:
        # Only a rank whose READY was seen is idle: the others are still running the task just
        # requeued, and get their STOP once their READY comes (docs/protocol.md §3, Shutdown: STOP
        # after READY).
        set_workers(tx, [(r.rank, WorkerState.IDLE) for r in rows
                         if r.rank not in charged_ranks and r.ready_at is not None])
    return back  # oldest dispatch first, as queued


def ready_seen(conn: Connection) -> set[int]:
    """The ranks holding a dispatch whose current READY was seen (its RESULT not yet)."""
    return {r for (r,) in conn.execute(select(dispatches.c.rank).where(
        dispatches.c.ready_at.is_not(None)))}


def any_in_flight(conn: Connection) -> bool:
    return bool(conn.execute(select(exists(select(dispatches.c.token)))).scalar())


def work_left(conn: Connection) -> bool:
    """A queued task or a dispatch: an active task always has its dispatch row, so two index
    probes answer it, never a scan."""
    return bool(conn.execute(select(exists(select(tasks.c.id).where(
        tasks.c.state == TaskState.QUEUED.value)) | exists(select(dispatches.c.token)))).scalar())


def holders(tx: Tx) -> list[tuple[int, str | None, int | None]]:
    """(rank, host, pid) of every rank that holds a dispatch, as its READY last reported."""
    return tx.db.execute("SELECT d.rank, w.host, w.pid FROM dispatches d "
                         "LEFT JOIN workers w ON w.rank = d.rank").fetchall()
