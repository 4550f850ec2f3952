"""The values the campaign's rows hold (task states, rank states, quarantine channels and
reasons, lease and event kinds) and the literal conditions of its partial indexes.

Apart from `schema` (the SQLAlchemy tables, which re-export all of this), so that what reads
a campaign with the stdlib's sqlite3 alone (`coordinator status`) names them without loading
SQLAlchemy.
"""

from __future__ import annotations

import enum


class TaskState(str, enum.Enum):
    QUEUED = "queued"      # waiting for a rank, ordered by queue_pos
    ACTIVE = "active"      # held by exactly one dispatch row
    DONE = "done"          # exactly one results row
    DEFERRED = "deferred"  # past the immediate-retry budget; reclaimed by the next --resume
    FAILED = "failed"      # past the attempt ceiling; held until `coordinator requeue`


#: Allowed task transitions. `tasks.set_state` refuses any other; the tests log every change
#: of `tasks.state` the store makes, its bulk statements included (dispatch, commit, reclaim,
#: requeue), and check each against this table (conftest.TRANSITION_LOG).
TASK_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.QUEUED: frozenset({TaskState.ACTIVE}),
    TaskState.ACTIVE: frozenset(
        {TaskState.DONE, TaskState.QUEUED, TaskState.DEFERRED, TaskState.FAILED}
    ),
    TaskState.DONE: frozenset({TaskState.QUEUED}),  # `coordinator requeue --state error`
    TaskState.DEFERRED: frozenset({TaskState.QUEUED}),
    TaskState.FAILED: frozenset({TaskState.QUEUED}),
}


class WorkerState(str, enum.Enum):
    UNKNOWN = "unknown"  # not heard from in this incarnation
    IDLE = "idle"        # may receive WORK
    BUSY = "busy"        # holds a dispatch (or its READY is awaited after the commit)
    PARKED = "parked"    # its dispatch was retired by the watchdog; waits for READY(retired)
    FAILED = "failed"    # the MPI runtime reported the process dead
    STOPPED = "stopped"  # acknowledged STOP


class Channel(str, enum.Enum):
    READY = "ready"
    RESULT = "result"
    STOP_ACK = "stop_ack"  # an acknowledgement of a STOP the master did not send
    OTHER = "other"        # a message on a tag the master never receives


class QuarantineReason(str, enum.Enum):
    MISSING = "missing"
    MALFORMED = "malformed"
    STALE = "stale"
    UNOWNED = "unowned"
    PAYLOAD = "payload"      # a current RESULT whose payload failed validation
    OVERSIZED = "oversized"  # larger than --max-message-bytes: consumed, never held
    FOREIGN_TAG = "foreign_tag"  # on a tag the master never receives


class LeaseKind(str, enum.Enum):
    # A batch dispatch's tasks after its first (the dispatch row's own, UNIQUE task_id), by
    # task id: UNIQUE (kind, key) keeps a task in one active dispatch, and the lease goes with
    # the dispatch. (A file at a revision before 0007 holds one per dispatch, keyed by
    # semantic id; the upgrade to 0007 deletes them.) The order is the CHECK constraint's: do
    # not reorder.
    WORK = "work"        # a task of a batch dispatch (its id)
    TARGET = "target"    # a target branch being solved
    CONTENT = "content"  # the input's content hash
    SCHEDULE = "schedule"  # the schedule prefix being explored


class EventKind(str, enum.Enum):
    CAMPAIGN = "campaign"            # an incarnation started (detail: resume or new)
    ENQUEUED = "enqueued"
    # A dispatch that ended without its result (rolled back, requeued, interrupted, or its
    # result discarded by `requeue --state error`), written as it ends with `at` = when the
    # dispatch was recorded. A committed dispatch's record is its results row (revision 0007:
    # `results.dispatched_at`); a campaign begun before 0007 keeps one for each dispatch it
    # made then.
    DISPATCHED = "dispatched"
    SEND_FAILED = "send_failed"      # pre-send compensation: rewound exactly
    # READY and COMMITTED are not written (the results row holds both facts, and an event
    # each would sit on the master's critical path, per task); kept so that older files, from
    # before revision 0002, stay valid. (The order is the CHECK constraint's: do not reorder.)
    READY = "ready"                  # current READY: ready mark set (results.ready_at holds it)
    INVALID = "invalid"              # invalid-result mark set (once per dispatch: its first)
    COMMITTED = "committed"          # (the results row itself holds it)
    RECOVERED = "recovered"          # joined READY + invalid RESULT: rolled back
    REQUEUED = "requeued"            # protocol requeue at the head (within the retry budget)
    DEFERRED = "deferred"            # protocol deferral (past the retry budget)
    TASK_FAILED = "task_failed"      # a valid RESULT said the run failed (timeout, not_run)
    RETRIED = "retried"              # task-failure requeue at the head (within the budget)
    TASK_DEFERRED = "task_deferred"  # task-failure deferral (past the budget)
    DEFER_FAILED = "defer_failed"    # the deferral could not be written; task kept queued
    FAILED = "failed"                # past the attempt ceiling
    INTERRUPTED = "interrupted"      # dispatch of an earlier incarnation rolled back at resume
    STOP_REQUEUED = "stop_requeued"  # in-flight work returned to the queue by a graceful stop
    RECLAIMED = "reclaimed"          # deferred task put back at the head by --resume
    NOT_ADMITTED = "not_admitted"    # deferred task whose input is gone: stays deferred
    WATCHDOG = "watchdog"            # past its deadline: recovered; rank parked (or idle)
    WORKER_RECOVERED = "worker_recovered"  # a parked rank echoed its retired token
    WORKER_FAILED = "worker_failed"  # the runtime reported the rank dead; its work recovered
    MANUAL_REQUEUE = "manual_requeue"
    # A batch whose results were too large for one RESULT, rolled back in halves at its
    # worker's request (revision 0014): no failure, none charged, not a protocol requeue.
    SPLIT = "split"
    # The master got a stop signal (detail: its name), written at once, or stopped because its
    # output directory or campaign file could not be written (revision 0018). An incarnation
    # that holds one and then died with runs in flight (the launcher, or the scheduler's
    # SIGKILL after its grace, ended the job before the stop finished) did not crash on a
    # task: `--resume` charges those runs nothing (`dispatches.requeue_in_flight`).
    STOP = "stop"


#: The events that retire a dispatch without its result (a rollback, a requeue at a stop or a
#: resume, a failed send or run, a dead worker): a result committed under such a token would
#: be a commit from the wrong dispatch (`store.audit` reads this).
ROLLBACK_EVENTS = (EventKind.RECOVERED, EventKind.WATCHDOG, EventKind.INTERRUPTED,
                   EventKind.STOP_REQUEUED, EventKind.TASK_FAILED, EventKind.SEND_FAILED,
                   EventKind.WORKER_FAILED, EventKind.SPLIT)


#: How many times one task's run may be cut off uncharged by an incarnation its operator
#: stopped (`dispatches.requeue_in_flight`); the next such run is charged as a crash's.
STOPPED_FREE = 3

#: The held states, as literal SQL: a query must repeat this very term for SQLite to read
#: `ix_tasks_held`. Only held tasks are in it (revision 0007): an index of every task's state
#: would have each dispatch and each commit move an entry, ~3 written pages per commit. The other
#: counts come from the rows that define those states: `ix_tasks_queue` (queued), one
#: `dispatches` row per active task, one `results` row per done task (`count_by_state`).
HELD_STATES_SQL = "state IN ('deferred', 'failed')"

#: Only the results that dropped test cases are in it: the happy path writes no entry, and
#: `status` sums the drops without reading a million results.
DROPPED_SQL = "dropped > 0"

#: Only the results that wrote test cases are in it (revision 0010), with their time and
#: count: the test cases found and the time of the last find are read from it alone. A
#: result that found nothing writes no entry, so a no-op farm's commits pay nothing for it;
#: a SymCC run that finds something takes seconds, against one more page in its commit.
FOUND_SQL = "testcases > 0"

#: Written once or more per task: the statistics never count them, and leaving them out of
#: the kind index saves the master ~1.6 written pages per commit (revision 0005).
PER_TASK_EVENT_KINDS = (EventKind.ENQUEUED, EventKind.DISPATCHED)
#: The partial index's condition, as literal SQL: SQLite uses a partial index only for a query
#: that repeats this very term, so `store.stats` builds its WHERE clause from it.
COUNTED_KIND_SQL = f"kind NOT IN ({', '.join(repr(k.value) for k in PER_TASK_EVENT_KINDS)})"
