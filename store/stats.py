"""Statistics read from the rows they count (docs/protocol.md §3 R10), and the stats text.

Nothing is counted in memory: the numbers are queries over the append-only quarantine and
event tables, so they survive restarts and always equal the rows a post-mortem would read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .revisions import current_revision
from .vocabulary import (
    COUNTED_KIND_SQL,
    DROPPED_SQL,
    HELD_STATES_SQL,
    Channel,
    EventKind,
    TaskState,
)

if TYPE_CHECKING:
    from .readonly import Reader

# Every read here is plain SQL through `exec_driver_sql`, which a SQLAlchemy connection (the
# master's, the audit's) and `readonly.Reader` (`coordinator status`, without SQLAlchemy)
# both answer.


@dataclass(frozen=True)
class Stats:
    tasks: dict[str, int]
    results: int
    quarantine: dict[str, dict[str, int]]  # channel -> reason -> count
    requeued: int
    deferred: int
    watchdog_timeouts: int
    watchdog_recoveries: int
    incarnation: int
    schema_revision: str | None
    events: dict[str, int] = field(default_factory=dict)  # by kind, but the per-task kinds
    #: Test cases runs produced that their workers could not send, and in how many results.
    dropped_testcases: int = 0
    dropped_results: int = 0
    #: Dispatches in flight: the ranks holding one (a batch's is one, whatever its tasks).
    dispatches: int = 0
    #: Of the `worker_failed` events, the ranks the master refused (most of what they sent
    #: was quarantined), not dead.
    refused_ranks: int = 0

    @property
    def worker_deaths(self) -> int:
        """Ranks the MPI runtime reported dead (the refused ones apart)."""
        return self.events.get(EventKind.WORKER_FAILED.value, 0) - self.refused_ranks

    def as_json(self) -> dict[str, object]:
        """The stable keys of `coordinator status --json` (documented in docs/running.md)."""
        return {
            "tasks": self.tasks,
            "results": self.results,
            "quarantine": {c.value: self.quarantine.get(c.value, {}) for c in Channel},
            "requeued": self.requeued,
            "deferred": self.deferred,
            "watchdog_timeouts": self.watchdog_timeouts,
            "watchdog_recoveries": self.watchdog_recoveries,
            "incarnation": self.incarnation,
            "schema_revision": self.schema_revision,
            "dropped_testcases": self.dropped_testcases,
            "dropped_results": self.dropped_results,
        }


#: The event kinds `read_stats` counts: all but the ones written once or more per task, whose
#: counts nobody reads here, and which would be most of its time on a large campaign (the live
#: progress reads it every half second: 127 of 250 ms at a million tasks). The condition is the
#: partial index's own text, so SQLite reads `ix_events_counted_kind` and never the per-task rows.
_COUNT_EVENTS = f"SELECT kind, count(*) FROM events WHERE {COUNTED_KIND_SQL} GROUP BY kind"
#: A refused rank's event (`Master._refuse_garbage_ranks`): its detail says so.
REFUSED_DETAIL = "refused: "
_COUNT_REFUSED = (f"SELECT count(*) FROM events WHERE {COUNTED_KIND_SQL} AND "
                  f"kind = 'worker_failed' AND detail LIKE '{REFUSED_DETAIL}%'")
#: A row stands for `repeats` messages (revision 0009; one each before).
_COUNT_QUARANTINE = ("SELECT channel, reason, sum(repeats) FROM quarantine "
                     "GROUP BY channel, reason")
_COUNT_QUARANTINE_ROWS = ("SELECT channel, reason, count(*) FROM quarantine "
                          "GROUP BY channel, reason")
#: Through `ix_results_dropped`: only the results that dropped test cases are read.
_COUNT_DROPPED = f"SELECT count(*), total(dropped) FROM results WHERE {DROPPED_SQL}"


#: A batch dispatch's `work` lease (keyed by task id). In a file from before revision 0007
#: every dispatch has one, keyed by the task's 64-character semantic id: such a file is
#: audited as it is.
BATCH_LEASE_SQL = "kind = 'work' AND length(key) < 20"
COUNT_QUEUED_SQL = "SELECT count(*) FROM tasks INDEXED BY ix_tasks_queue WHERE state = 'queued'"
_COUNT_HELD = f"SELECT state, count(*) FROM tasks WHERE {HELD_STATES_SQL} GROUP BY state"


def count_by_state(tx_or_conn: Any) -> dict[str, int]:
    """Tasks by state, each counted from the rows that define it, through narrow indexes (the
    live progress reads this twice a second, on campaigns of millions of tasks): queued ones
    in `ix_tasks_queue`, active ones as their `dispatches` rows (one each, UNIQUE task_id) and
    the `work` leases of a batch dispatch's other tasks (UNIQUE key),
    done ones as their `results` rows (one each, the primary key), held ones in
    `ix_tasks_held`. The audit (`coordinator check`, store/audit.py) checks that the rows
    agree."""
    conn = getattr(tx_or_conn, "conn", tx_or_conn)
    counts = {s.value: 0 for s in TaskState}
    counts[TaskState.QUEUED.value] = conn.exec_driver_sql(COUNT_QUEUED_SQL).scalar_one()
    counts[TaskState.ACTIVE.value] = conn.exec_driver_sql(
        "SELECT (SELECT count(*) FROM dispatches) + "
        f"(SELECT count(*) FROM leases WHERE {BATCH_LEASE_SQL})").scalar_one()
    counts[TaskState.DONE.value] = conn.exec_driver_sql(
        "SELECT count(*) FROM results").scalar_one()
    for state, n in conn.exec_driver_sql(_COUNT_HELD):
        counts[state] = n
    return counts


def read_stats(conn: Reader) -> Stats:
    revision = current_revision(conn)
    # (A file of an older revision, which the audit reads, lacks the newer columns.)
    since = lambda rev: revision is None or revision >= rev  # noqa: E731
    q: dict[str, dict[str, int]] = {c.value: {} for c in Channel}
    for channel, reason, n in conn.exec_driver_sql(_COUNT_QUARANTINE if since("0009") else
                                                   _COUNT_QUARANTINE_ROWS):
        q.setdefault(channel, {})[reason] = n
    ev = dict(conn.exec_driver_sql(_COUNT_EVENTS).all())
    dropped_results, dropped = (conn.exec_driver_sql(_COUNT_DROPPED).one() if since("0008")
                                else (0, 0))
    return Stats(
        tasks=count_by_state(conn),
        results=conn.exec_driver_sql("SELECT count(*) FROM results").scalar_one(),
        quarantine=q,
        requeued=ev.get(EventKind.REQUEUED.value, 0),
        deferred=ev.get(EventKind.DEFERRED.value, 0),
        watchdog_timeouts=ev.get(EventKind.WATCHDOG.value, 0),
        watchdog_recoveries=ev.get(EventKind.WORKER_RECOVERED.value, 0),
        incarnation=conn.exec_driver_sql("SELECT incarnation FROM campaign").scalar() or 0,
        schema_revision=revision,
        events=ev,
        dropped_testcases=int(dropped),
        dropped_results=dropped_results,
        dispatches=conn.exec_driver_sql("SELECT count(*) FROM dispatches").scalar_one(),
        refused_ranks=(conn.exec_driver_sql(_COUNT_REFUSED).scalar_one()
                       if ev.get(EventKind.WORKER_FAILED.value) else 0),
    )


def result_statuses(conn: Reader) -> dict[str, int]:
    """Committed results by the executor's status (ok / error ...). Not part of `read_stats`:
    it reads every result row, too much for the live progress display of a large campaign."""
    return dict(conn.exec_driver_sql(
        "SELECT status, count(*) FROM results GROUP BY status").all())


def recent_failures(conn: Reader, limit: int = 5) -> list[tuple[int, int, str, str | None]]:
    """The latest committed results whose status is not ok: (task id, rank, status, detail)."""
    return [tuple(r) for r in conn.exec_driver_sql(  # type: ignore[misc]
        "SELECT task_id, rank, status, detail FROM results "
        # Two ranges rather than `!=`, which SQLite cannot look up in ix_results_status: a
        # million ok results are then never read.
        "WHERE status < 'ok' OR status > 'ok' "
        "ORDER BY committed_at DESC, task_id DESC LIMIT ?", (limit,))]


_HELD_REASONS = (f"SELECT reason, count(*) AS n FROM tasks WHERE {HELD_STATES_SQL} "
                 f"AND state = :state GROUP BY reason ORDER BY n DESC, reason LIMIT :limit")


def held_reasons(conn: Reader, limit: int = 3) -> dict[str, list[tuple[str, int]]]:
    """For deferred and failed tasks: their most common reasons, with counts (state ->
    [(reason, n)], most common first). Read through ix_tasks_held: held tasks only."""
    held: dict[str, list[tuple[str, int]]] = {}
    for state in (TaskState.DEFERRED.value, TaskState.FAILED.value):
        rows = conn.exec_driver_sql(_HELD_REASONS, {"state": state, "limit": limit}).all()
        if rows:
            held[state] = [(reason or "(no reason)", n) for reason, n in rows]
    return held


def _reasons(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    inner = ",".join(f"{r}={n}" for r, n in sorted(counts.items()) if n)
    return f"{total} ({inner})" if total else "0"


def stats_text(s: Stats) -> str:
    """The periodic stats file and the final summary, with the exact labels of docs/protocol.md
    R10."""
    return "\n".join([
        f"Quarantined worker results: {_reasons(s.quarantine.get('result', {}))}",
        f"Quarantined worker ready messages: {_reasons(s.quarantine.get('ready', {}))}",
        f"Protocol-requeued dispatches: {s.requeued}",
        f"Protocol-deferred dispatches: {s.deferred}",
        f"Dispatch watchdog timeouts: {s.watchdog_timeouts}",
        f"Dispatch watchdog worker recoveries: {s.watchdog_recoveries}",
    ]) + "\n"


def other_messages_text(s: Stats, *, always: bool = False) -> str | None:
    """What came on no READY or RESULT tag (a STOP_ACK for no STOP, a tag the master never
    receives), as one line beside the six of `stats_text`; None if nothing did, unless
    `always` (the stats file: a script that reads it finds the same lines in every copy)."""
    counts = _other_messages(s)
    return (f"Quarantined other messages: {_reasons(counts)}" if counts or always
            else None)


def _other_messages(s: Stats) -> dict[str, int]:
    return {f"{channel}:{reason}" if channel != Channel.OTHER.value else reason: n
            for channel in (Channel.STOP_ACK.value, Channel.OTHER.value)
            for reason, n in s.quarantine.get(channel, {}).items()}


#: The note a master's incarnation event carries (`master_rank`: "master pid=P host=H ...").
_MASTER_NOTE = re.compile(r"\bmaster pid=(\d+) host=(\S+)")


def last_master(conn: Reader) -> tuple[int, str] | None:
    """(pid, host) of the master of the latest incarnation, from its `campaign` event; None
    if no start recorded one (an older start, or a store opened without a note)."""
    row = conn.exec_driver_sql(
        f"SELECT detail FROM events WHERE kind = 'campaign' AND {COUNTED_KIND_SQL} "
        f"ORDER BY id DESC LIMIT 1").first()
    m = _MASTER_NOTE.search(row[0] or "") if row is not None else None
    return (int(m[1]), m[2]) if m else None


def incarnation_stop(conn: Reader, incarnation: int) -> tuple[float, str] | None:
    """(time, cause) of the first `stop` event of an incarnation (a stop signal's name, or why
    its master stopped on its own: revision 0018); None if it recorded none (a crash, a worker
    death, a run that finished, or a file from before 0018)."""
    return conn.exec_driver_sql(
        f"SELECT at, detail FROM events WHERE kind = 'stop' AND {COUNTED_KIND_SQL} "
        f"AND incarnation = ? AND rank IS NULL ORDER BY id LIMIT 1", (incarnation,)).first()
