"""The master's round writes fewer rows: no work lease, no per-task state index, no event per dispatch

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

Every page a COMMIT touched goes to the WAL and, at `synchronous=FULL`, through its fsync.
Counted per commit of the master (3 workers, no-op tasks), three structures cost ~7 of its
~17 written pages while holding nothing another row did not hold already:

- The `work` lease: one `leases` row per dispatch (its table and two indexes), keyed by the
  task's semantic id. The dispatch row is that reservation: `dispatches.task_id` is UNIQUE,
  and so is `tasks.semantic_id`. Leases are now written for side reservations only (target
  branch, input content, schedule prefix); the `work` rows of dispatches in flight are deleted
  (the kind stays valid, for older files).
- `ix_tasks_state`, an index of every task's state: each dispatch and each commit moved an
  entry through it. It becomes `ix_tasks_held`, of the deferred and failed tasks only; the
  counts of the other states come from the rows that define them (`ix_tasks_queue`,
  `dispatches`, `results`). `ix_tasks_queue` gains `state`, so that counting the queued
  tasks reads the index alone (one index build over the queued tasks).
- The `dispatched` event written for every dispatch (an `events` row and its `task_id` index
  entry). A committed dispatch is recorded by its results row, which gains `dispatched_at`;
  a dispatch that ends without a result gets its `dispatched` event when it ends (with the
  time it was recorded). Existing results take `dispatched_at` from their `dispatched` event.

No other row changes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

# Written out here, not imported: a revision must keep meaning what it meant when it shipped.
_HELD_STATES_SQL = "state IN ('deferred', 'failed')"


def upgrade() -> None:
    op.execute("DELETE FROM leases WHERE kind = 'work'")
    op.drop_index('ix_tasks_state', table_name='tasks')
    op.create_index('ix_tasks_held', 'tasks', ['state'], unique=False,
                    sqlite_where=sa.text(_HELD_STATES_SQL))
    _queue_index(['queue_pos', 'id', 'state'])
    # ADD COLUMN without a default needs no table copy. The fill reads each result's own
    # events through ix_events_task (a few per task), never a scan per result.
    op.add_column('results', sa.Column('dispatched_at', sa.Float(), nullable=True))
    op.execute("UPDATE results SET dispatched_at = (SELECT max(e.at) FROM events e "
               "WHERE e.task_id = results.task_id AND e.token = results.token "
               "AND e.kind = 'dispatched')")


def downgrade() -> None:
    # What 0006 code expects to find: a `dispatched` event for every dispatch, a `work` lease
    # for every dispatch in flight, and the state index.
    op.execute("INSERT INTO events (at, incarnation, kind, rank, token, task_id) "
               "SELECT r.dispatched_at, r.incarnation, 'dispatched', r.rank, r.token, r.task_id "
               "FROM results r WHERE r.dispatched_at IS NOT NULL AND NOT EXISTS (SELECT 1 "
               "FROM events e WHERE e.task_id = r.task_id AND e.token = r.token "
               "AND e.kind = 'dispatched')")
    op.execute("INSERT INTO events (at, incarnation, kind, rank, token, task_id) "
               "SELECT d.created_at, d.incarnation, 'dispatched', d.rank, d.token, d.task_id "
               "FROM dispatches d WHERE NOT EXISTS (SELECT 1 FROM events e "
               "WHERE e.task_id = d.task_id AND e.token = d.token AND e.kind = 'dispatched')")
    op.execute("INSERT INTO leases (token, kind, key) SELECT d.token, 'work', t.semantic_id "
               "FROM dispatches d JOIN tasks t ON t.id = d.task_id")
    # Not batch mode (see 0006): SQLite >= 3.35 drops a column in place.
    op.drop_column('results', 'dispatched_at')
    op.drop_index('ix_tasks_held', table_name='tasks', sqlite_where=sa.text(_HELD_STATES_SQL))
    op.create_index('ix_tasks_state', 'tasks', ['state'], unique=False)
    _queue_index(['queue_pos', 'id'])


def _queue_index(columns: list[str]) -> None:
    op.drop_index('ix_tasks_queue', table_name='tasks', sqlite_where=sa.text("state = 'queued'"))
    op.create_index('ix_tasks_queue', 'tasks', columns, unique=False,
                    sqlite_where=sa.text("state = 'queued'"))
