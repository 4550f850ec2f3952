"""rank_utilisation counts a dispatch's time once, not once per task of its batch

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02

Revision 0010's `rank_utilisation` view summed, per result, the time from its dispatch to
its commit. Since a dispatch can carry a batch of tasks (`--batch`, the default for demo and
Python tasks), every task of a batch has its own result row with the dispatch's times, so a
rank's busy time was counted once per task: `busy_fraction` read 7.9 for ranks running
batches of 8, and `mean_task_s` 0.127 s for 10 ms tasks. The view now groups a rank's results
by their dispatch first (its start and its commit, which a batch's results share and no two
dispatches of one rank do; numbers sort faster than the 64-character token), and gains a
`dispatches` column (last, so that a `SELECT *` reads the old columns where they were).

No row changes; only the view is replaced.
"""

from __future__ import annotations

from alembic import op

from migrations.shipped import shipped_view

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

# Written out here, not imported: a revision must keep meaning what it meant when it shipped.
_STARTED = "coalesce(r.dispatched_at, r.sent_at, r.committed_at)"

# Per incarnation and rank: results, the dispatches they came in, the time those dispatches
# ran (each from its record to its commit, once however many tasks it carried), and that time
# as a fraction of the incarnation's span (its first dispatch to its last commit). Dispatches
# rolled back are not counted.
RANK_UTILISATION = f"""
WITH per_dispatch AS (
  SELECT r.incarnation AS inc, r.rank, count(*) AS results, sum(r.status = 'ok') AS ok,
         sum(r.status <> 'ok') AS not_ok, r.committed_at - {_STARTED} AS busy,
         {_STARTED} AS first, r.committed_at AS last
  FROM results r GROUP BY r.incarnation, r.rank, r.committed_at, {_STARTED}),
per AS (
  SELECT inc, rank, sum(results) AS results, sum(ok) AS ok, sum(not_ok) AS not_ok,
         count(*) AS dispatches, total(busy) AS busy, min(first) AS first, max(last) AS last
  FROM per_dispatch GROUP BY inc, rank),
span AS (SELECT inc, max(last) - min(first) AS s FROM per GROUP BY inc)
SELECT per.inc, per.rank, w.host, per.results, per.ok, per.not_ok,
       round(per.busy, 1) AS busy_s, round(span.s, 1) AS span_s,
       round(per.busy / nullif(span.s, 0), 3) AS busy_fraction,
       round(per.busy / per.results, 3) AS mean_task_s,
       datetime(per.first, 'unixepoch') AS first_utc, datetime(per.last, 'unixepoch') AS last_utc,
       per.dispatches
FROM per JOIN span ON span.inc = per.inc
LEFT JOIN workers w ON w.rank = per.rank AND w.incarnation = per.inc
ORDER BY per.inc, per.rank"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS rank_utilisation")
    op.execute(f"CREATE VIEW rank_utilisation AS {RANK_UTILISATION.strip()}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS rank_utilisation")
    shipped = shipped_view("0010_observe.py", "rank_utilisation")
    op.execute(f"CREATE VIEW rank_utilisation AS {shipped.strip()}")
