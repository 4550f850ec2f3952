"""Indexes for the master's hot path: fewer pages written per commit, a faster `status`

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29

Every COMMIT of the master writes each B-tree page it touched to the WAL, and at
`synchronous=FULL` those pages are what the fsync waits for. Counted per commit (3 workers):
the UNIQUE index on `results.token` took ~3.8 pages, since random tokens land on random
leaves of an index that grows with the campaign; `ix_events_kind` took ~1.6 for the
`dispatched` entries nothing reads by kind. So:

- `results.token` is no longer UNIQUE. Tokens do not repeat because of how they are minted
  (a random per-incarnation epoch in their hash); the audits check it after the fact. The
  result's own primary key (`task_id`) is what keeps a task from being committed twice. This
  copies the `results` table (batch mode): a few seconds per million results.
- `ix_results_status` (status): `count(*)` and the counts by status read it instead of
  the whole table (the token index was what `count(*)` used before).
- `ix_events_kind` becomes `ix_events_counted_kind`, partial: it leaves out the per-task
  kinds (`enqueued`, `dispatched`), which the statistics never count.

No row changes. The events stay as they were; only their index does not list the per-task ones.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

# Written out here, not imported: a revision must keep meaning what it meant when it shipped.
_COUNTED_KIND_SQL = "kind NOT IN ('enqueued', 'dispatched')"


def upgrade() -> None:
    with op.batch_alter_table('results', recreate='always') as batch:
        batch.drop_constraint('uq_results_token', type_='unique')
        batch.create_index('ix_results_status', ['status'], unique=False)
    with op.batch_alter_table('events') as batch:
        batch.drop_index('ix_events_kind')
        batch.create_index('ix_events_counted_kind', ['kind'], unique=False,
                           sqlite_where=sa.text(_COUNTED_KIND_SQL))


def downgrade() -> None:
    with op.batch_alter_table('events') as batch:
        batch.drop_index('ix_events_counted_kind', sqlite_where=sa.text(_COUNTED_KIND_SQL))
        batch.create_index('ix_events_kind', ['kind'], unique=False)
    with op.batch_alter_table('results', recreate='always') as batch:
        batch.drop_index('ix_results_status')
        batch.create_unique_constraint('uq_results_token', ['token'])
