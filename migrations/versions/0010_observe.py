"""What a running campaign shows: the master's observations, per-rank load, the finds index, views

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02

- `observations`: one row per observation interval, written by the master in a transaction of
  its own (tasks by state, test cases written): `status` takes its rates from them.
- `rank_load`: one row per worker rank, replaced at each observation: the fraction of the
  last minutes the rank held a dispatch.
- `ix_results_found`: a partial index of the results that wrote test cases, with their time
  and count, so that the test cases found and the time of the last find are read without
  reading every result. A result that found nothing writes no entry.
- Five views for post-mortems in the `sqlite3` shell (docs/sqlite.md): `in_flight`,
  `task_history`, `throughput_per_minute`, `rank_utilisation`, `held_tasks`. They read only
  what earlier revisions already hold, so they work on every campaign brought forward.

No existing row changes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

# Written out here, not imported: a revision must keep meaning what it meant when it shipped.
_NOW = "(julianday('now') - 2440587.5) * 86400.0"
_STARTED = "coalesce(r.dispatched_at, r.sent_at, r.committed_at)"

VIEWS = {
    # What is in flight, since when, sent or not, which marks are set (docs query 2).
    "in_flight": f"""
SELECT d.rank, w.host, d.task_id, substr(d.token, 1, 12) AS token, d.incarnation AS inc,
       datetime(d.created_at, 'unixepoch') AS since_utc,
       round({_NOW} - d.created_at, 1) AS age_s,
       CASE WHEN d.sent_at IS NULL THEN 'no' ELSE 'yes' END AS sent,
       CASE WHEN d.ready_at IS NULL THEN '' ELSE 'ready' END AS ready_mark,
       coalesce(d.invalid_reason, '') AS invalid_mark,
       round(d.deadline - ({_NOW}), 1) AS deadline_in_s,
       (SELECT group_concat(l.kind) FROM leases l WHERE l.token = d.token) AS leases,
       t.attempts,
       coalesce(json_extract(t.payload, '$.path'), substr(t.payload, 1, 60)) AS task
FROM dispatches d JOIN tasks t ON t.id = d.task_id LEFT JOIN workers w ON w.rank = d.rank
ORDER BY d.created_at""",
    # Every task's history (docs query 5 for all tasks at once): select one with
    # `WHERE task_id = N`. The events that carry only a token (`invalid`, `worker_recovered`)
    # and the quarantined messages are tied to a task through its dispatches' tokens.
    "task_history": """
WITH toks(task_id, token) AS (
  SELECT task_id, token FROM events
   WHERE kind = 'dispatched' AND task_id IS NOT NULL AND token IS NOT NULL
  UNION SELECT task_id, token FROM results
  UNION SELECT task_id, token FROM dispatches),
h(task_id, at, src, seq, inc, what, rank, token, detail) AS (
  SELECT task_id, at, 1, id, incarnation, kind, rank, token, detail
    FROM events WHERE task_id IS NOT NULL
  UNION ALL
  SELECT k.task_id, e.at, 1, e.id, e.incarnation, e.kind, e.rank, e.token, e.detail
    FROM events e JOIN toks k ON k.token = e.token WHERE e.task_id IS NULL
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
  SELECT task_id, ready_at, 1, 0, incarnation, 'ready', rank, token, NULL
    FROM results WHERE ready_at IS NOT NULL
  UNION ALL
  SELECT task_id, committed_at, 2, 0, incarnation, 'result ' || status, rank, token,
         'testcases=' || testcases || ' new_tasks=' || new_tasks || ' value='
         || coalesce(value, 'null')
    FROM results)
SELECT task_id, datetime(at, 'unixepoch') AS at_utc, inc, what, rank,
       substr(token, 1, 12) AS token, detail, at, src, seq
FROM h ORDER BY task_id, at, src, seq""",
    # Committed results per minute (docs query 7); minutes with no commit have no row.
    "throughput_per_minute": """
SELECT datetime(CAST(committed_at / 60 AS INTEGER) * 60, 'unixepoch') AS minute_utc,
       count(*) AS results, round(count(*) / 60.0, 2) AS per_s,
       sum(status = 'ok') AS ok, sum(status <> 'ok') AS not_ok,
       sum(testcases) AS testcases, sum(new_tasks) AS new_tasks
FROM results GROUP BY 1 ORDER BY 1""",
    # Per incarnation and rank: results, the time its committed dispatches ran (from the
    # dispatch's record to its commit), and that time as a fraction of the incarnation's span
    # (its first dispatch to its last commit). Dispatches rolled back are not counted.
    "rank_utilisation": f"""
WITH per AS (
  SELECT r.incarnation AS inc, r.rank, count(*) AS results, sum(r.status = 'ok') AS ok,
         sum(r.status <> 'ok') AS not_ok, total(r.committed_at - {_STARTED}) AS busy,
         min({_STARTED}) AS first, max(r.committed_at) AS last
  FROM results r GROUP BY r.incarnation, r.rank),
span AS (SELECT inc, max(last) - min(first) AS s FROM per GROUP BY inc)
SELECT per.inc, per.rank, w.host, per.results, per.ok, per.not_ok,
       round(per.busy, 1) AS busy_s, round(span.s, 1) AS span_s,
       round(per.busy / nullif(span.s, 0), 3) AS busy_fraction,
       round(per.busy / per.results, 3) AS mean_task_s,
       datetime(per.first, 'unixepoch') AS first_utc, datetime(per.last, 'unixepoch') AS last_utc
FROM per JOIN span ON span.inc = per.inc
LEFT JOIN workers w ON w.rank = per.rank AND w.incarnation = per.inc
ORDER BY per.inc, per.rank""",
    # What is deferred or failed, and why (docs query 6); through ix_tasks_held.
    "held_tasks": """
SELECT id AS task_id, state, attempts, dispatches,
       datetime(updated_at, 'unixepoch') AS since_utc, reason,
       coalesce(json_extract(payload, '$.path'), substr(payload, 1, 60)) AS task,
       substr(semantic_id, 1, 12) AS semantic_id
FROM tasks WHERE state IN ('deferred', 'failed') ORDER BY state, updated_at""",
}


def upgrade() -> None:
    op.create_table(
        'observations',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.Column('incarnation', sa.Integer(), nullable=False),
        sa.Column('queued', sa.Integer(), nullable=False),
        sa.Column('active', sa.Integer(), nullable=False),
        sa.Column('done', sa.Integer(), nullable=False),
        sa.Column('deferred', sa.Integer(), nullable=False),
        sa.Column('failed', sa.Integer(), nullable=False),
        sa.Column('testcases', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_observations')),
    )
    op.create_index('ix_observations_incarnation_at', 'observations', ['incarnation', 'at'])
    op.create_table(
        'rank_load',
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.Column('incarnation', sa.Integer(), nullable=False),
        sa.Column('window_s', sa.Float(), nullable=False),
        sa.Column('busy', sa.Float(), nullable=False),
        sa.CheckConstraint('busy >= 0 AND busy <= 1', name=op.f('ck_rank_load_fraction')),
        sa.PrimaryKeyConstraint('rank', name=op.f('pk_rank_load')),
    )
    op.create_index('ix_results_found', 'results', ['committed_at', 'testcases'],
                    sqlite_where=sa.text('testcases > 0'))
    for name, sql in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {sql.strip()}")


def downgrade() -> None:
    for name in reversed(list(VIEWS)):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.drop_index('ix_results_found', table_name='results')
    op.drop_table('rank_load')
    op.drop_index('ix_observations_incarnation_at', table_name='observations')
    op.drop_table('observations')
