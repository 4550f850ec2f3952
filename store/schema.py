"""The campaign database: SQLAlchemy Core tables with the protocol's invariants in the schema.

The database refuses what the code must never do:

- one active dispatch per rank and per task (UNIQUE `dispatches.rank`, `dispatches.task_id`):
  the dispatch row is itself the task's reservation (its work lease);
- at most one committed result per task (`results.task_id` is the primary key);
- a side-table lease is owned by its dispatch and removed with it (FK ... ON DELETE CASCADE),
  and a resource is leased at most once (UNIQUE (kind, key));
- every state is a small lowercase enum with a CHECK constraint;
- a token is 64 lowercase hex characters (CHECK).

The schema notes for `sqlite3` users are in docs/sqlite.md.
"""

from __future__ import annotations

import enum

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Table,
    Text,
    UniqueConstraint,
    text,
)

from .imports import ImportKind
from .vocabulary import (
    COUNTED_KIND_SQL,
    DROPPED_SQL,
    FOUND_SQL,
    HELD_STATES_SQL,
    Channel,
    EventKind,
    LeaseKind,
    QuarantineReason,
    TaskState,
    WorkerState,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def _enum_check(column: str, enum_cls: type[enum.Enum]) -> CheckConstraint:
    # Comparisons, not `column IN (...)`: SQLite codes a CHECK's IN list of three or more
    # values as a temporary index built afresh for every row written, 1.7 µs of a 5 µs task
    # update (revision 0014).
    values = " OR ".join(f"{column} = '{m.value}'" for m in enum_cls)
    return CheckConstraint(values, name=f"{column}_enum")


TOKEN_CHECK = "length({c}) = 64 AND {c} NOT GLOB '*[^0-9a-f]*'"

campaign = Table(
    "campaign",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("created_at", Float, nullable=False),
    # Bumped at every coordinator start; every event and dispatch carries the one it ran in.
    Column("incarnation", Integer, nullable=False),
    # Random per incarnation, hashed into every token: tokens never repeat across restarts.
    Column("epoch", Text, nullable=False),
    Column("bitmap_version", Integer, nullable=False, server_default=text("0")),
    # JSON: the executor and task source of the first run (revision 0004; NULL before), so
    # that a --resume which would run the campaign differently is refused.
    Column("settings", Text, nullable=True),
    CheckConstraint("id = 1", name="single_row"),
)

blobs = Table(
    "blobs",
    metadata,
    Column("hash", Text, primary_key=True),  # sha256 hex of data: content-addressed inputs
    Column("data", LargeBinary, nullable=False),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", Integer, primary_key=True),
    # sha256 of the canonical JSON of the semantic payload: stable across dispatches/restarts.
    Column("semantic_id", Text, nullable=False, unique=True),
    Column("payload", Text, nullable=False),  # canonical JSON (sorted keys, no NaN)
    Column("input_hash", Text, ForeignKey("blobs.hash"), nullable=True),
    Column("state", Text, nullable=False),
    # Failed dispatches of this task, a crash-interrupted one included, persistent: the
    # ceiling (--max-attempts) reads it, and a restart does not refill it.
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    # Of those, the ones the retry policy decided (not a crash-interrupted dispatch): what the
    # immediate-retry budget reads (revision 0006).
    Column("budget_used", Integer, nullable=False, server_default=text("0")),
    Column("dispatches", Integer, nullable=False, server_default=text("0")),
    # Queue order among queued tasks: new work at the tail (positive, growing), requeued and
    # reclaimed work at the head (negative, shrinking).
    Column("queue_pos", BigInteger, nullable=False),
    Column("depth", Integer, nullable=False, server_default=text("0")),
    Column("parent_id", Integer, ForeignKey("tasks.id"), nullable=True),
    Column("origin", Text, nullable=False, server_default=text("''")),
    Column("reason", Text, nullable=True),  # why deferred / failed / not admitted
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    # The largest dispatch this task may go out in: set to its half's size when a dispatch
    # of several tasks broke (split in halves, none charged), so that the halving goes on
    # across restarts; NULL for a task never in a broken batch (revision 0013).
    Column("batch_cap", Integer, nullable=True),
    _enum_check("state", TaskState),
    CheckConstraint(TOKEN_CHECK.format(c="semantic_id"), name="semantic_id_hex"),
    CheckConstraint("attempts >= 0 AND dispatches >= 0", name="counts"),
)
# `state` is in the queue index (revision 0007) only so that counting the queued tasks reads
# the index alone: SQLite reads each row for a column the index lacks, even for the term that
# is the partial index's own condition.
Index("ix_tasks_queue", tasks.c.queue_pos, tasks.c.id, tasks.c.state,
      sqlite_where=tasks.c.state == "queued")
#: The records of a task's dispatches, as an SQL expression over `tasks t`: its result (a
#: committed dispatch), its `dispatched` events (ended without a result) and its dispatch row
#: (in flight). Each dispatch has exactly one since revision 0007, so on a campaign begun
#: there this equals `t.dispatches` (a pre-send rewind takes back its count); `store.audit`
#: checks it.
DISPATCH_RECORDS_SQL = (
    "((SELECT count(*) FROM results r WHERE r.task_id = t.id) + "
    "(SELECT count(*) FROM events e WHERE e.task_id = t.id AND e.kind = 'dispatched') + "
    "(SELECT count(*) FROM dispatches d WHERE d.task_id = t.id) + "
    "(SELECT count(*) FROM leases l WHERE l.kind = 'work' AND l.key = CAST(t.id AS TEXT)))")
# Only held tasks (revision 0007); `vocabulary.HELD_STATES_SQL` says why.
Index("ix_tasks_held", tasks.c.state, sqlite_where=text(HELD_STATES_SQL))

dispatches = Table(
    "dispatches",
    metadata,
    Column("token", Text, primary_key=True),
    Column("rank", Integer, nullable=False, unique=True),
    Column("task_id", Integer, ForeignKey("tasks.id"), nullable=False, unique=True),
    Column("incarnation", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    # NULL until WORK has left the master: decides pre-send vs post-send compensation.
    Column("sent_at", Float, nullable=True),
    Column("deadline", Float, nullable=True),  # watchdog: NULL = none
    # The two independent facts of the generation gate (R2); both refer to this row's token.
    Column("ready_at", Float, nullable=True),
    Column("invalid_reason", Text, nullable=True),
    CheckConstraint(TOKEN_CHECK.format(c="token"), name="token_hex"),
    CheckConstraint("rank >= 1", name="worker_rank"),
)

leases = Table(
    "leases",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("token", Text, ForeignKey("dispatches.token", ondelete="CASCADE"), nullable=False),
    Column("kind", Text, nullable=False),
    Column("key", Text, nullable=False),
    UniqueConstraint("kind", "key"),
    _enum_check("kind", LeaseKind),
)
Index("ix_leases_token", leases.c.token)

workers = Table(
    "workers",
    metadata,
    Column("rank", Integer, primary_key=True),
    Column("state", Text, nullable=False),
    Column("incarnation", Integer, nullable=False),
    Column("bitmap_version", Integer, nullable=False, server_default=text("-1")),
    Column("profile_version", Text, nullable=False, server_default=text("''")),
    Column("parked_token", Text, nullable=True),  # the retired token a parked rank must echo
    Column("host", Text, nullable=True),
    Column("pid", Integer, nullable=True),
    Column("last_seen", Float, nullable=True),
    # Its host cannot run tasks (revision 0016): its answers in a row whose every task was
    # `not_run`, since when, and what the host could not do; NULL once one ran.
    Column("unrun_streak", Integer, nullable=True),
    Column("unrun_since", Float, nullable=True),
    Column("unrun_detail", Text, nullable=True),
    _enum_check("state", WorkerState),
)

results = Table(
    "results",
    metadata,
    Column("task_id", Integer, ForeignKey("tasks.id"), primary_key=True),
    # The dispatch it was committed from. Not UNIQUE (revision 0005): an index on random
    # tokens costs ~4 written pages per commit (random tokens land on random leaves of an
    # index that grows with the campaign). Tokens do not repeat because of how they are
    # minted (SHA-256 of a random per-incarnation epoch, the rank and a sequence number); the
    # schema only refuses two active dispatches with one token, and the audit
    # (`coordinator check`, store/audit.py) checks the rest.
    Column("token", Text, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("incarnation", Integer, nullable=False),
    Column("committed_at", Float, nullable=False),
    Column("status", Text, nullable=False),  # executor outcome: ok / error (a timeout is retried)
    Column("value", Text, nullable=True),  # JSON
    Column("testcases", Integer, nullable=False, server_default=text("0")),
    Column("new_tasks", Integer, nullable=False, server_default=text("0")),
    # The committed dispatch's happy path, copied from its row (revision 0002): when its WORK
    # left and when its current READY was seen (NULL: READY came after the commit).
    Column("sent_at", Float, nullable=True),
    Column("ready_at", Float, nullable=True),
    # Why a run with a non-ok status failed, clipped (revision 0003); NULL for ok results,
    # unless the command executor dropped output files over its limits (its note).
    Column("detail", Text, nullable=True),
    # When the committed dispatch was recorded (its row's `created_at`; revision 0007): with
    # token, rank and incarnation, the record of the dispatch itself, in place of a
    # `dispatched` event for each dispatch (two more written pages per commit).
    Column("dispatched_at", Float, nullable=True),
    # Test cases the worker could not send with this result: over the command executor's
    # limits, or the whole set when the result would not fit in a message.
    Column("dropped", Integer, nullable=False, server_default=text("0")),
)
# Counts by status and `count(*)` read this narrow index; new entries go to the end of the
# `ok` run, so a commit writes one of its pages, not one per result (revision 0005).
Index("ix_results_status", results.c.status)
# Only the results that dropped test cases (`vocabulary.DROPPED_SQL`).
Index("ix_results_dropped", results.c.dropped, sqlite_where=text(DROPPED_SQL))
# Only the results that wrote test cases (`vocabulary.FOUND_SQL`), with their time and count.
Index("ix_results_found", results.c.committed_at, results.c.testcases,
      sqlite_where=text(FOUND_SQL))

quarantine = Table(
    "quarantine",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("at", Float, nullable=False),
    Column("incarnation", Integer, nullable=False),
    Column("channel", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("token", Text, nullable=True),  # what the message said, if it was a string
    Column("expected", Text, nullable=True),  # the rank's active token at the time
    Column("detail", Text, nullable=True),
    # The messages this row stands for: past the first rows of a rank's channel and reason in
    # an incarnation, the row sampled last counts the rest (a rogue rank wrote 77,290 rows in
    # 30 s), so the statistics, sum(repeats), stay exact while the table stays small.
    Column("repeats", Integer, nullable=False, server_default=text("1")),
    _enum_check("channel", Channel),
    _enum_check("reason", QuarantineReason),
)
Index("ix_quarantine_channel_reason", quarantine.c.channel, quarantine.c.reason)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("at", Float, nullable=False),
    Column("incarnation", Integer, nullable=False),
    Column("kind", Text, nullable=False),
    Column("rank", Integer, nullable=True),
    Column("token", Text, nullable=True),
    Column("task_id", Integer, nullable=True),
    Column("detail", Text, nullable=True),
    _enum_check("kind", EventKind),
)
# All but the per-task kinds (`vocabulary.COUNTED_KIND_SQL`).
Index("ix_events_counted_kind", events.c.kind, sqlite_where=text(COUNTED_KIND_SQL))
Index("ix_events_task", events.c.task_id)


# -- what the master observes of itself (revision 0010) --------------------------------------
# Written by the master once per observation interval (`--progress-interval`'s sampling, every
# few seconds), in a transaction of its own, never in a round: the per-task writes are not
# touched. `coordinator status`, the progress lines and the metrics file read them.

observations = Table(
    "observations",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("at", Float, nullable=False),
    Column("incarnation", Integer, nullable=False),
    # Tasks by state and test cases written, as `store.observe.read_counts` read them then:
    # the rates of `status` are differences between these rows.
    Column("queued", Integer, nullable=False),
    Column("active", Integer, nullable=False),
    Column("done", Integer, nullable=False),
    Column("deferred", Integer, nullable=False),
    Column("failed", Integer, nullable=False),
    Column("testcases", Integer, nullable=False),
)
Index("ix_observations_incarnation_at", observations.c.incarnation, observations.c.at)

rank_load = Table(
    "rank_load",
    metadata,
    # One row per worker rank, replaced at every observation: the fraction of the last
    # `window_s` seconds the rank held a dispatch, sampled by the master once a second.
    Column("rank", Integer, primary_key=True),
    Column("at", Float, nullable=False),
    Column("incarnation", Integer, nullable=False),
    Column("window_s", Float, nullable=False),
    Column("busy", Float, nullable=False),
    CheckConstraint("busy >= 0 AND busy <= 1", name="fraction"),
)

# -- the test cases of retried runs (revision 0017) --------------------------------------------

salvaged = Table(
    "salvaged",
    metadata,
    # One row per run that was retried (killed at its timeout) after it had written test
    # cases, which were kept: counted with the results' own (`observe.read_found`).
    Column("id", Integer, primary_key=True),
    Column("at", Float, nullable=False),
    Column("incarnation", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("token", Text, nullable=False),
    Column("task_id", Integer, ForeignKey("tasks.id"), nullable=False),
    Column("testcases", Integer, nullable=False),  # files written (new content only)
    CheckConstraint("testcases > 0", name="found"),
)

# -- what a start imported (revision 0011) ---------------------------------------------------

imports = Table(
    "imports",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("incarnation", Integer, nullable=False),
    Column("at", Float, nullable=False),
    Column("kind", Text, nullable=False),
    # The tasks file's absolute path ('demo' for the built-in tasks).
    Column("source", Text, nullable=False),
    # The tasks file as it was read (device, inode, size, modification time in ns): a
    # --resume naming the same file unchanged does not read it again. NULL for the demo.
    Column("identity", Text, nullable=True),
    # The tasks the source holds (the demo: N, all of 0 .. N-1 now in the campaign) and how
    # many of them were new to it.
    Column("count", Integer, nullable=False),
    Column("added", Integer, nullable=False),
    _enum_check("kind", ImportKind),
    CheckConstraint("count >= 0 AND added >= 0 AND added <= count", name="counts"),
)
Index("ix_imports_source", imports.c.kind, imports.c.source)


#: The views revision 0010 made for post-mortems in the `sqlite3` shell (docs/sqlite.md; 0012
#: redefined `rank_utilisation`).
#: Their DDL is the migration's; the names are here for the tests and the docs.
VIEWS = ("in_flight", "task_history", "throughput_per_minute", "rank_utilisation",
         "held_tasks")
