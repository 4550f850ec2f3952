"""Is this campaign file consistent? One read-only audit, one function per rule.

Every rule is SQL over the rows, read in the caller's transaction (`audit_path` opens the
file read-only and runs them all in one read transaction, so they see one snapshot and never
make a running master wait). The rules are the store's own invariants; a harness adds what
only it knows (how many tasks it enqueued, what their values must be, which faults it
injected).

- `integrity`: `PRAGMA integrity_check` is not ok (or the file cannot be read at all). The
  other rules are then not run: a damaged page would decide their answers.
- `foreign_keys`: `PRAGMA foreign_key_check` rows (but a lease's, which `orphan_lease` names).
- `conservation`: a task's state and the rows that define it disagree (an active task and its
  dispatch row, a done task and its one result), an `enqueued` task has no row (tasks are never
  deleted), or what `status` counts (`count_by_state`) differs from the tasks' states.
- `dispatch_records`: each dispatch has one record (`schema.DISPATCH_RECORDS_SQL`); from
  revision 0007 on.
- `wrong_commit`: a result from a token whose dispatch ended without a result (its
  `dispatched` event; from revision 0007 on) or was retired (`vocabulary.ROLLBACK_EVENTS`), or one
  token committed for several tasks (no index refuses it since revision 0005).
- `orphan_lease`: a lease row without its dispatch.
- `statistics`: `read_stats` (what `status` shows) and a direct count of the quarantine, event
  and result rows it summarizes disagree, or the incarnation is not the number of starts.

The one-record rules describe dispatches made at revision 0007 or later. A campaign begun
before it and brought forward keeps what the older code wrote: a `dispatched` event for each
of its dispatches, written as it was made, so a dispatch committed then has its event and its
result, and one in flight then its event and its row (and, once a resume has ended it, a
second event). Nothing in the file says when it was brought forward; `_legacy_incarnations`
reads it from the rows: the incarnations before the first that recorded a dispatch the newer
way. A token of those incarnations counts as one record however many it has, and its result
beside its `dispatched` event is no commit from a dispatch that ended; every other rule holds
for them as it is.
"""

from __future__ import annotations

import enum
import os
import sqlite3
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, exc

from .engine import RAW_ERRORS, read_file
from .errors import NoCampaignYet, SchemaVersionError, restore_hint
from .revisions import current_revision, refuse_foreign
from .schema import DISPATCH_RECORDS_SQL
from .stats import Stats, count_by_state, read_stats
from .versioning import head_revision, revisions_in_order
from .vocabulary import (
    COUNTED_KIND_SQL,
    PER_TASK_EVENT_KINDS,
    ROLLBACK_EVENTS,
    Channel,
    EventKind,
)

#: The revision from which every dispatch has exactly one record.
ONE_RECORD_SINCE = "0007"

#: Violations kept per check; past it, one more stands for the rest (with their count).
MAX_PER_CHECK = 1000

ROLLBACK_KINDS_SQL = ", ".join(f"'{k.value}'" for k in ROLLBACK_EVENTS)


class ViolationKind(str, enum.Enum):
    INTEGRITY = "integrity"
    FOREIGN_KEYS = "foreign_keys"
    CONSERVATION = "conservation"
    DISPATCH_RECORDS = "dispatch_records"
    WRONG_COMMIT = "wrong_commit"
    ORPHAN_LEASE = "orphan_lease"
    STATISTICS = "statistics"


class Check(str, enum.Enum):
    """The check within a rule that found a violation (what a harness maps to its counts)."""

    INTEGRITY_CHECK = "integrity_check"
    FOREIGN_KEY = "foreign_key"
    ACTIVE_WITHOUT_DISPATCH = "active_without_dispatch"
    DISPATCH_OF_INACTIVE_TASK = "dispatch_of_inactive_task"
    DONE_WITHOUT_RESULT = "done_without_result"
    RESULT_OF_UNDONE_TASK = "result_of_undone_task"
    RESULTS_PER_TASK = "results_per_task"
    ENQUEUED_WITHOUT_TASK = "enqueued_without_task"
    STATUS_COUNTS = "status_counts"
    MORE_RECORDS_THAN_DISPATCHES = "more_records_than_dispatches"
    DISPATCH_WITHOUT_RECORD = "dispatch_without_record"
    TOKEN_ENDED_WITHOUT_RESULT = "token_ended_without_result"
    TOKEN_RETIRED = "token_retired"
    TOKEN_SHARED = "token_shared"
    LEASE_WITHOUT_DISPATCH = "lease_without_dispatch"
    STATS_VS_ROWS = "stats_vs_rows"


#: What each check a file's revision can rule out would have made sure of.
SKIPPABLE = {
    Check.MORE_RECORDS_THAN_DISPATCHES: "that no task has more dispatch records than "
                                        "dispatches",
    Check.DISPATCH_WITHOUT_RECORD: "that every dispatch has its record",
    Check.TOKEN_ENDED_WITHOUT_RESULT: "that no result comes from a dispatch that ended "
                                      "without one",
}


def skipped_text(skipped: list[Check]) -> str:
    """The checks not run, each by its name (as `check --json` lists them) and what it
    makes sure of: `a` (that ...), `b` (that ...) and `c` (that ...)."""
    named = [f"`{c.value}` ({SKIPPABLE.get(c, 'a check')})" for c in skipped]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"


@dataclass(frozen=True)
class Violation:
    kind: ViolationKind
    check: Check
    message: str  # one line
    task_id: int | None = None
    token: str | None = None
    #: How many it stands for, where not one: rows of a foreign-key group, results sharing a
    #: token, records missing or in excess, the rest of a check past MAX_PER_CHECK.
    count: int | None = None


@dataclass
class AuditReport:
    violations: list[Violation] = field(default_factory=list)
    revision: str | None = None  # the file's
    head: str | None = None      # this code's
    notes: list[str] = field(default_factory=list)
    skipped: list[Check] = field(default_factory=list)  # checks the file's revision rules out
    stats: Stats | None = None   # what `status` shows, as the `statistics` rule read it
    #: Incarnations 1..this recorded their dispatches as code before revision 0007 did
    #: (`_legacy_incarnations`); 0 for a campaign begun at 0007 or later.
    legacy_incarnations: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> set[ViolationKind]:
        return {v.kind for v in self.violations}

    def of(self, *checks: Check) -> list[Violation]:
        return [v for v in self.violations if v.check in checks]

    def text(self) -> str:
        lines = [f"{v.kind.value}: {v.message}" for v in self.violations]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines) or "consistent"


def _short(token: str | None) -> str:
    return (token or "")[:12]


def _capped(kind: ViolationKind, rows: Iterable[Any],
            make: dict[Check, tuple[Callable[[Any], Violation], str]]) -> list[Violation]:
    """Violations from `rows` whose first column names their check (`make`: check -> (one
    violation from a row, what the rest are called)), at most MAX_PER_CHECK per check, then
    one for the rest of that check, with their count."""
    out: list[Violation] = []
    kept: Counter[Check] = Counter()
    rest: Counter[Check] = Counter()
    for row in rows:
        check = Check(row[0])
        if kept[check] < MAX_PER_CHECK:
            kept[check] += 1
            out.append(make[check][0](row))
        else:
            rest[check] += 1
    out += [Violation(kind, check, f"... and {n} more {make[check][1]}", count=n)
            for check, n in rest.items()]
    return out


@dataclass
class _File:
    conn: Connection
    revision: str
    order: list[str]
    notes: list[str] = field(default_factory=list)
    skipped: list[Check] = field(default_factory=list)
    stats: Stats | None = None
    legacy: int = 0  # `_legacy_incarnations`

    def since(self, revision: str) -> bool:
        return self.order.index(self.revision) >= self.order.index(revision)

    def rows(self, sql: str) -> Any:
        return self.conn.exec_driver_sql(sql)


# -- the rules -------------------------------------------------------------------------------

def _integrity(conn: Connection) -> list[Violation]:
    try:
        found = [r[0] for r in conn.exec_driver_sql("PRAGMA integrity_check")]
    except exc.DBAPIError as e:
        if not isinstance(e.orig, sqlite3.DatabaseError):
            raise
        return [Violation(ViolationKind.INTEGRITY, Check.INTEGRITY_CHECK,
                          f"integrity_check cannot read the file: {e.orig}")]
    if found == ["ok"]:
        return []
    return [Violation(ViolationKind.INTEGRITY, Check.INTEGRITY_CHECK,
                      f"integrity_check: {line}") for line in found]


def _foreign_keys(f: _File) -> list[Violation]:
    groups: dict[tuple[str, str], list[int]] = {}
    for table, rowid, parent, _fkid in f.rows("PRAGMA foreign_key_check"):
        if (table, parent) == ("leases", "dispatches"):
            continue  # named by `orphan_lease`
        groups.setdefault((table, parent), []).append(rowid)
    return [Violation(ViolationKind.FOREIGN_KEYS, Check.FOREIGN_KEY,
                      f"{len(ids)} rows of {table} refer to missing rows of {parent} "
                      f"(rowids {ids[:10]})", count=len(ids))
            for (table, parent), ids in sorted(groups.items())]


def _conservation(f: _File) -> list[Violation]:
    kind = ViolationKind.CONSERVATION
    c = Check
    # A task is held by its dispatch's row, or (a batch's other tasks) by a `work` lease of it.
    batched = f.since(ONE_RECORD_SINCE)  # (before 0007, work leases were every dispatch's)
    in_batch = ("OR EXISTS (SELECT 1 FROM leases l WHERE l.kind = 'work' "
                "AND l.key = CAST(t.id AS TEXT)) " if batched else "")
    batch_members = (
        f"UNION ALL SELECT '{c.DISPATCH_OF_INACTIVE_TASK.value}', CAST(l.key AS INTEGER), "
        f"l.token, t.state FROM leases l LEFT JOIN tasks t ON t.id = CAST(l.key AS INTEGER) "
        f"WHERE l.kind = 'work' AND length(l.key) < 20 AND t.state IS NOT 'active' "
        if batched else "")
    out = _capped(kind, f.rows(
        f"SELECT '{c.ACTIVE_WITHOUT_DISPATCH.value}', t.id, NULL, NULL FROM tasks t "
        f"WHERE t.state = 'active' AND NOT (EXISTS "
        f"(SELECT 1 FROM dispatches d WHERE d.task_id = t.id) {in_batch}) "
        f"UNION ALL SELECT '{c.DISPATCH_OF_INACTIVE_TASK.value}', d.task_id, d.token, t.state "
        f"FROM dispatches d LEFT JOIN tasks t ON t.id = d.task_id "
        f"WHERE t.state IS NOT 'active' {batch_members}"
        f"UNION ALL SELECT '{c.DONE_WITHOUT_RESULT.value}', id, NULL, NULL FROM tasks "
        f"WHERE state = 'done' AND id NOT IN (SELECT task_id FROM results) "
        f"UNION ALL SELECT '{c.RESULT_OF_UNDONE_TASK.value}', r.task_id, r.token, t.state "
        f"FROM results r LEFT JOIN tasks t ON t.id = r.task_id WHERE t.state IS NOT 'done' "
        f"UNION ALL SELECT '{c.RESULTS_PER_TASK.value}', task_id, NULL, count(*) FROM results "
        f"GROUP BY task_id HAVING count(*) > 1 "
        f"UNION ALL SELECT DISTINCT '{c.ENQUEUED_WITHOUT_TASK.value}', task_id, NULL, NULL "
        f"FROM events WHERE kind = 'enqueued' AND task_id NOT IN (SELECT id FROM tasks)"), {
        c.ACTIVE_WITHOUT_DISPATCH: (lambda r: Violation(
            kind, c.ACTIVE_WITHOUT_DISPATCH, f"task {r[1]} is active without its dispatch "
            f"row (no rank will finish it)", task_id=r[1]),
            "active tasks without a dispatch row"),
        c.DISPATCH_OF_INACTIVE_TASK: (lambda r: Violation(
            kind, c.DISPATCH_OF_INACTIVE_TASK, f"dispatch {_short(r[2])} holds task {r[1]}, "
            f"which " + (f"is {r[3]}, not active" if r[3] else "has no row"),
            task_id=r[1], token=r[2]),
            "dispatches of tasks that are not active"),
        c.DONE_WITHOUT_RESULT: (lambda r: Violation(
            kind, c.DONE_WITHOUT_RESULT, f"task {r[1]} is done without a result",
            task_id=r[1]),
            "done tasks without a result"),
        c.RESULT_OF_UNDONE_TASK: (lambda r: Violation(
            kind, c.RESULT_OF_UNDONE_TASK, f"task {r[1]} has a result (token {_short(r[2])}) "
            f"but " + (f"is {r[3]}, not done" if r[3] else "no task row"),
            task_id=r[1], token=r[2]),
            "results of tasks that are not done"),
        c.RESULTS_PER_TASK: (lambda r: Violation(
            kind, c.RESULTS_PER_TASK, f"task {r[1]} has {r[3]} results", task_id=r[1],
            count=r[3]),
            "tasks with more than one result"),
        c.ENQUEUED_WITHOUT_TASK: (lambda r: Violation(
            kind, c.ENQUEUED_WITHOUT_TASK, f"task {r[1]} was enqueued and has no row (lost)",
            task_id=r[1]),
            "enqueued tasks without a row"),
    })
    shown = count_by_state(f.conn)
    by_state = dict(f.rows("SELECT state, count(*) FROM tasks GROUP BY state").all())
    for state in sorted(set(shown) | set(by_state)):
        a, b = shown.get(state, 0), by_state.get(state, 0)
        if a != b:
            out.append(Violation(kind, c.STATUS_COUNTS,
                                 f"`status` counts {a} {state} tasks, the tasks' states say {b}",
                                 count=abs(a - b)))
    return out


#: A result or a dispatch in flight without a `dispatched` event of its token: code before
#: revision 0007 wrote one for every dispatch as it made it (and 0007 gave a result found with
#: its event the event's time; one found without stayed NULL), so such a row was made by newer
#: code. The earliest incarnation of one.
_FIRST_RECORDED_ONCE = (
    "SELECT min(incarnation) FROM (SELECT r.incarnation FROM results r "
    "WHERE r.dispatched_at IS NOT NULL AND NOT EXISTS (SELECT 1 FROM events e "
    "WHERE e.task_id = r.task_id AND e.token = r.token AND e.kind = 'dispatched') "
    "UNION ALL SELECT d.incarnation FROM dispatches d WHERE NOT EXISTS (SELECT 1 FROM events e "
    "WHERE e.task_id = d.task_id AND e.token = d.token AND e.kind = 'dispatched'))")


def _legacy_incarnations(f: _File) -> int:
    """How many of the first incarnations recorded their dispatches the way code before
    revision 0007 did. The upgrade left no mark of when it ran, so the rows say it: the first
    incarnation that left a row only newer code makes (`_FIRST_RECORDED_ONCE`), or an
    observation (revision 0010's; no older code wrote one), began the newer way, and every
    later one is held to it. A file with neither is read as older code left it."""
    first = [f.rows(_FIRST_RECORDED_ONCE).scalar()]
    if f.since("0010"):
        first.append(f.rows("SELECT min(incarnation) FROM observations").scalar())
    known = [i for i in first if i is not None]
    if known:
        return max(0, min(known) - 1)
    return f.rows("SELECT incarnation FROM campaign").scalar() or 0


def _records_sql(legacy: int) -> str:
    """The records of a task's dispatches (`schema.DISPATCH_RECORDS_SQL`), where the records
    of a token of the first `legacy` incarnations count as one: its event written as it was
    made, and its result, its row in flight or the event a later resume wrote as it ended
    it, were one dispatch."""
    if not legacy:
        return DISPATCH_RECORDS_SQL
    old, new = f"incarnation <= {int(legacy)}", f"incarnation > {int(legacy)}"
    return (
        f"((SELECT count(*) FROM results r WHERE r.task_id = t.id AND r.{new}) + "
        f"(SELECT count(*) FROM events e WHERE e.task_id = t.id AND e.kind = 'dispatched' "
        f"AND e.{new}) + "
        f"(SELECT count(*) FROM dispatches d WHERE d.task_id = t.id AND d.{new}) + "
        f"(SELECT count(*) FROM leases l WHERE l.kind = 'work' AND l.key = CAST(t.id AS TEXT)) + "
        f"(SELECT count(DISTINCT token) FROM (SELECT token FROM results WHERE task_id = t.id "
        f"AND {old} UNION ALL SELECT token FROM events WHERE task_id = t.id "
        f"AND kind = 'dispatched' AND {old} UNION ALL SELECT token FROM dispatches "
        f"WHERE task_id = t.id AND {old})))")


#: Tokens of the first N incarnations (`_legacy_incarnations`) with more than one record.
_LEGACY_DOUBLES = (
    "SELECT count(*) FROM (SELECT task_id, token FROM (SELECT task_id, token FROM results "
    "WHERE incarnation <= ?1 UNION ALL SELECT task_id, token FROM events "
    "WHERE kind = 'dispatched' AND incarnation <= ?1 UNION ALL SELECT task_id, token "
    "FROM dispatches WHERE incarnation <= ?1) GROUP BY task_id, token HAVING count(*) > 1)")


def _dispatch_records(f: _File) -> list[Violation]:
    more, fewer = Check.MORE_RECORDS_THAN_DISPATCHES, Check.DISPATCH_WITHOUT_RECORD
    if not f.since(ONE_RECORD_SINCE):
        f.skipped += [more, fewer]
        return []
    kind = ViolationKind.DISPATCH_RECORDS
    return _capped(kind, f.rows(
        f"SELECT CASE WHEN n > records THEN '{fewer.value}' ELSE '{more.value}' END, id, n, "
        f"records, token FROM (SELECT t.id, t.dispatches AS n, {_records_sql(f.legacy)} AS "
        f"records, (SELECT r.token FROM results r WHERE r.task_id = t.id) AS token "
        f"FROM tasks t) WHERE n != records"), {
        more: (lambda r: Violation(
            kind, more, f"task {r[1]} has {r[3]} dispatch records for {r[2]} dispatches"
            + (f" (its result's token {_short(r[4])})" if r[4] else ""),
            task_id=r[1], token=r[4], count=r[3] - r[2]),
            "tasks with more dispatch records than dispatches"),
        fewer: (lambda r: Violation(
            kind, fewer, f"task {r[1]}: {r[2] - r[3]} of its {r[2]} dispatches without a "
            f"record", task_id=r[1], count=r[2] - r[3]),
            "tasks with dispatches without a record"),
    })


def _wrong_commits(f: _File) -> list[Violation]:
    kind = ViolationKind.WRONG_COMMIT
    ended, retired, shared = (Check.TOKEN_ENDED_WITHOUT_RESULT, Check.TOKEN_RETIRED,
                              Check.TOKEN_SHARED)
    # One token's results are one dispatch's: a batch's tasks share it (one rank, incarnation
    # and dispatch time); before revision 0007 there were no batches.
    one_dispatch = ("count(DISTINCT rank || ':' || incarnation || ':' || "
                    "coalesce(dispatched_at, '')) > 1 OR (count(*) > 1 AND "
                    "max(dispatched_at) IS NULL)" if f.since(ONE_RECORD_SINCE) else
                    "count(*) > 1")
    sql = (f"SELECT DISTINCT '{retired.value}', r.task_id, r.token, e.kind FROM results r "
           f"JOIN events e ON e.task_id = r.task_id AND e.token = r.token "
           f"WHERE e.kind IN ({ROLLBACK_KINDS_SQL}) AND {COUNTED_KIND_SQL} "
           f"UNION ALL SELECT '{shared.value}', group_concat(task_id, ', '), token, count(*) "
           f"FROM results GROUP BY token HAVING {one_dispatch}")
    if f.since(ONE_RECORD_SINCE):
        # (A result of the incarnations before revision 0007 has its dispatch's event beside
        # it: the record made as it was dispatched, `_legacy_incarnations`.)
        sql += (f" UNION ALL SELECT DISTINCT '{ended.value}', r.task_id, r.token, NULL "
                f"FROM results r JOIN events e ON e.task_id = r.task_id AND e.token = r.token "
                f"AND e.kind = 'dispatched' WHERE r.incarnation > {int(f.legacy)}")
    else:
        f.skipped.append(ended)
    return _capped(kind, f.rows(sql), {
        ended: (lambda r: Violation(
            kind, ended, f"task {r[1]}: committed from token {_short(r[2])} whose dispatch "
            f"ended without a result", task_id=r[1], token=r[2]),
            "results from dispatches that ended without one"),
        retired: (lambda r: Violation(
            kind, retired, f"task {r[1]}: committed from token {_short(r[2])} that was "
            f"retired ({r[3]})", task_id=r[1], token=r[2]),
            "results from retired tokens"),
        shared: (lambda r: Violation(
            kind, shared, f"token {_short(r[2])} is committed for {r[3]} tasks ({r[1]}) by "
            f"more than one dispatch",
            token=r[2], count=r[3]),
            "tokens committed for more than one task"),
    })


def _orphan_leases(f: _File) -> list[Violation]:
    kind, check = ViolationKind.ORPHAN_LEASE, Check.LEASE_WITHOUT_DISPATCH
    return _capped(kind, f.rows(
        f"SELECT '{check.value}', l.id, l.token, l.kind, l.key FROM leases l WHERE NOT EXISTS "
        f"(SELECT 1 FROM dispatches d WHERE d.token = l.token)"), {
        check: (lambda r: Violation(
            kind, check, f"lease {r[1]} ({r[3]} {str(r[4])[:40]!r}) is held by token "
            f"{_short(r[2])}, which has no dispatch", token=r[2]),
            "leases without a dispatch"),
    })


def _statistics(f: _File) -> list[Violation]:
    """`read_stats` reads narrow indexes and leaves out the per-task event kinds; the direct
    counts here read the tables themselves (NOT INDEXED) and every kind."""
    kind = ViolationKind.STATISTICS
    stats = f.stats = read_stats(f.conn)
    quarantine: dict[str, dict[str, int]] = {c.value: {} for c in Channel}
    counted_by = "sum(repeats)" if f.since("0009") else "count(*)"  # (a row per message)
    for channel, reason, n in f.rows(f"SELECT channel, reason, {counted_by} FROM quarantine "
                                     f"NOT INDEXED GROUP BY channel, reason"):
        quarantine.setdefault(channel, {})[reason] = n
    events = Counter(dict(f.rows("SELECT kind, count(*) FROM events NOT INDEXED "
                                 "GROUP BY kind").all()))
    counted = {k: n for k, n in events.items()
               if k not in {e.value for e in PER_TASK_EVENT_KINDS}}
    n_results = f.rows("SELECT count(*) FROM results NOT INDEXED").scalar_one()
    pairs: list[tuple[str, object, object]] = [
        ("quarantine", stats.quarantine, quarantine),
        ("events by kind", stats.events, counted),
        ("requeued", stats.requeued, events[EventKind.REQUEUED.value]),
        ("deferred", stats.deferred, events[EventKind.DEFERRED.value]),
        ("watchdog_timeouts", stats.watchdog_timeouts, events[EventKind.WATCHDOG.value]),
        ("watchdog_recoveries", stats.watchdog_recoveries,
         events[EventKind.WORKER_RECOVERED.value]),
        ("results", stats.results, n_results),
    ]
    out = [Violation(kind, Check.STATS_VS_ROWS, f"statistics say {name}={got!r}, the rows "
                                                f"say {want!r}")
           for name, got, want in pairs if got != want]
    # Each start bumps the incarnation and writes its `campaign` event in one transaction.
    starts = events[EventKind.CAMPAIGN.value]
    if stats.incarnation != starts:
        out.append(Violation(kind, Check.STATS_VS_ROWS,
                             f"statistics say incarnation {stats.incarnation}, the campaign "
                             f"has {starts} `campaign` events (one per start)"))
    return out


RULES: tuple[Callable[[_File], list[Violation]], ...] = (
    _foreign_keys, _conservation, _dispatch_records, _wrong_commits, _orphan_leases,
    _statistics)


# -- the audit -------------------------------------------------------------------------------

def _is_database_error(e: BaseException) -> bool:
    return isinstance(getattr(e, "orig", None) or e, sqlite3.DatabaseError)


def audit(conn: Connection) -> AuditReport:
    """Every rule on the campaign `conn` reads, in the caller's transaction (read-only).

    Raises NoCampaignYet for a file without a campaign (yet), DatabaseOpenError for an SQLite
    file of something else, SchemaVersionError for a revision newer than this code knows. An
    older revision is audited by the rules that hold on it; `notes` says which did not run.
    """
    conn.info[RAW_ERRORS] = True  # damage is a violation here, found by integrity_check
    try:
        return _audit(conn)
    finally:
        conn.info[RAW_ERRORS] = False


def _audit(conn: Connection) -> AuditReport:
    name = conn.engine.url.database or "the database"
    order, head = revisions_in_order(), head_revision()
    try:
        revision = current_revision(conn)
        tables = {t for (t,) in conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
    except exc.DBAPIError as e:
        if not _is_database_error(e):
            raise
        found = _integrity(conn) or [Violation(ViolationKind.INTEGRITY, Check.INTEGRITY_CHECK,
                                               f"the schema cannot be read: {e.orig}")]
        return AuditReport(found, None, head, [
            "the file is damaged where its schema is kept: no other rule was run "
            f"({restore_hint(name)}; `sqlite3 {name} .recover` may save what is left)"])
    if revision is None:
        refuse_foreign(conn, name)
        raise NoCampaignYet(name)
    if revision not in order:
        raise SchemaVersionError(name, revision, head, newer=True)
    if "campaign" not in tables or conn.exec_driver_sql(
            "SELECT count(*) FROM campaign").scalar_one() == 0:
        raise NoCampaignYet(name)

    damaged = _integrity(conn)
    if damaged:
        return AuditReport(damaged, revision, head, [
            "the file is damaged: the other rules were not run (what a damaged page holds "
            f"would decide them); {restore_hint(name)}, or `sqlite3 {name} .recover`"])

    f = _File(conn, revision, order)
    if f.since(ONE_RECORD_SINCE):
        f.legacy = _legacy_incarnations(f)
    if f.legacy and (doubles := f.rows(_LEGACY_DOUBLES.replace("?1", str(f.legacy))).scalar()):
        f.notes.append(
            f"read as a campaign begun before revision {ONE_RECORD_SINCE} and brought "
            f"forward: its incarnations up to {f.legacy} left no row that only later code "
            f"writes, and {doubles} of their dispatches have the `dispatched` event older "
            f"code wrote as it made them beside their result, their row in flight or the "
            f"event a later start wrote as it ended them; each counts as one dispatch, and "
            f"its result as no commit from a dispatch that ended")
    violations: list[Violation] = []
    for rule in RULES:
        violations += rule(f)
    if f.skipped:
        f.notes.append(
            f"schema revision {revision} is older than this coordinator's {head}: "
            f"{len(f.skipped)} checks were not run, {skipped_text(f.skipped)} (before "
            f"{ONE_RECORD_SINCE} every dispatch had a `dispatched` event, its committed ones "
            f"too); `coordinator db upgrade --db {name}` brings the file forward")
    return AuditReport(violations, revision, head, f.notes, f.skipped, f.stats, f.legacy)


def audit_path(path: str | os.PathLike[str]) -> AuditReport:
    """`audit` of the file at `path`, read with `engine.read_file` (nothing is written, and a
    running master is never made to wait; SQLite itself makes a `-shm` beside a `-wal` that
    has none, where the directory can be written)."""
    report, view = read_file(path, audit)
    if view.note():
        report.notes.append(view.note())
    return report
