"""task_history follows every task of a batch, not only its first

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02

A batch dispatch's own events (`recovered`, `watchdog`, `worker_failed`, `interrupted`,
`stop_requeued`, the `requeued` or `split` of its halves) carry its first task's id, and its
other tasks are held by `work` leases while it runs. Revision 0010's `task_history` tied an
event to the tasks of its token only when the event had no task id, and knew a dispatch's tasks
only from its row: the history of every task of a batch but the first lacked the batch's
rollbacks, and, while the batch ran, its dispatch. Such events now show in the history of every
task of the token, and a batch in flight in each of its tasks'.

No row changes; only the view is replaced.
"""

from __future__ import annotations

from alembic import op

from migrations.shipped import shipped_view

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None

# Written out here, not imported: a revision must keep meaning what it meant when it shipped.
# The events a batch dispatch writes once, for all of its tasks, under its first task's id.
_BATCH_KINDS = ("'recovered', 'watchdog', 'worker_failed', 'interrupted', 'stop_requeued', "
                "'requeued', 'split'")

# Every task's history (docs query 5 for all tasks at once): select one with
# `WHERE task_id = N`. The events that carry only a token (`invalid`, `worker_recovered`),
# a batch's own events, and the quarantined messages are tied to a task through its
# dispatches' tokens (a batch's later tasks hold theirs by `work` leases while it runs).
TASK_HISTORY = f"""
WITH toks(task_id, token) AS (
  SELECT task_id, token FROM events
   WHERE kind = 'dispatched' AND task_id IS NOT NULL AND token IS NOT NULL
  UNION SELECT task_id, token FROM results
  UNION SELECT task_id, token FROM dispatches
  UNION SELECT CAST(key AS INTEGER), token FROM leases
   WHERE kind = 'work' AND key NOT GLOB '*[^0-9]*'),
h(task_id, at, src, seq, inc, what, rank, token, detail) AS (
  SELECT task_id, at, 1, id, incarnation, kind, rank, token, detail
    FROM events WHERE task_id IS NOT NULL
  UNION ALL
  SELECT k.task_id, e.at, 1, e.id, e.incarnation, e.kind, e.rank, e.token, e.detail
    FROM events e JOIN toks k ON k.token = e.token
   WHERE e.task_id IS NULL OR (e.task_id <> k.task_id AND e.kind IN ({_BATCH_KINDS}))
  UNION ALL
  SELECT k.task_id, q.at, 0, q.id, q.incarnation, 'quarantined ' || q.channel || '/' || q.reason,
         q.rank, q.expected,
         'sent token ' || coalesce(substr(q.token, 1, 12), 'none') || coalesce('; ' || q.detail, '')
    FROM quarantine q JOIN toks k ON k.token = q.expected OR k.token = q.token
  UNION ALL
  SELECT r.task_id, r.dispatched_at, 1, 0, r.incarnation, 'dispatched', r.rank, r.token, NULL
    FROM results r WHERE r.dispatched_at IS NOT NULL AND NOT EXISTS (
      SELECT 1 FROM events e WHERE e.task_id = r.task_id AND e.kind = 'dispatched'
         AND e.token = r.token)
  UNION ALL
  SELECT d.task_id, d.created_at, 1, 0, d.incarnation, 'dispatched (in flight)', d.rank,
         d.token, NULL FROM dispatches d
  UNION ALL
  SELECT CAST(l.key AS INTEGER), d.created_at, 1, 0, d.incarnation, 'dispatched (in flight)',
         d.rank, d.token, NULL
    FROM leases l JOIN dispatches d ON d.token = l.token
   WHERE l.kind = 'work' AND l.key NOT GLOB '*[^0-9]*'
  UNION ALL
  SELECT task_id, ready_at, 1, 0, incarnation, 'ready', rank, token, NULL
    FROM results WHERE ready_at IS NOT NULL
  UNION ALL
  SELECT task_id, committed_at, 2, 0, incarnation, 'result ' || status, rank, token,
         'testcases=' || testcases || ' new_tasks=' || new_tasks || ' value='
         || coalesce(value, 'null')
    FROM results)
SELECT task_id, datetime(at, 'unixepoch') AS at_utc, inc, what, rank,
       substr(token, 1, 12) AS token, detail, at, src, seq
FROM h ORDER BY task_id, at, src, seq"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS task_history")
    op.execute(f"CREATE VIEW task_history AS {TASK_HISTORY.strip()}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS task_history")
    shipped = shipped_view("0010_observe.py", "task_history")
    op.execute(f"CREATE VIEW task_history AS {shipped.strip()}")
