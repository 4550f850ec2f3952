"""results.sent_at and results.ready_at replace the per-task ready/committed events

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

The happy path of a task used to write three events (dispatched, ready, committed) on the
master's critical path. `ready` and `committed` only repeated what the dispatch row and the
results row already hold, so the committed result now carries its dispatch's send and READY
times instead. Older rows get `ready_at` from their `ready` events (`sent_at` stays NULL:
no event held it); the events stay.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (nullable, no default) needs no table copy, so no batch mode.
    op.add_column('results', sa.Column('sent_at', sa.Float(), nullable=True))
    op.add_column('results', sa.Column('ready_at', sa.Float(), nullable=True))
    # One pass over the ready events (events has no token index: a correlated subquery per
    # result would be quadratic on a long campaign).
    op.execute(
        "UPDATE results SET ready_at = e.at FROM (SELECT token, max(at) AS at FROM events "
        "WHERE kind = 'ready' GROUP BY token) AS e WHERE e.token = results.token")


def downgrade() -> None:
    with op.batch_alter_table('results') as batch:
        batch.drop_column('ready_at')
        batch.drop_column('sent_at')
