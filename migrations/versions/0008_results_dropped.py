"""results.dropped: the test cases a run produced that its worker could not send

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01

A run's output files over the command executor's limits (count, size, total), or all of them
when the RESULT would exceed --max-message-bytes, were only noted in `results.detail`: a
campaign that lost 2,000 of 3,000 test cases said so nowhere a user looks. The count is now a
column, and a partial index of the results that dropped any lets `status` sum them at once.
Existing results keep 0: the notes in their `detail` stay readable.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ADD COLUMN with a constant default needs no table copy.
    op.add_column('results', sa.Column('dropped', sa.Integer(), nullable=False,
                                       server_default=sa.text('0')))
    op.create_index('ix_results_dropped', 'results', ['dropped'],
                    sqlite_where=sa.text('dropped > 0'))


def downgrade() -> None:
    op.drop_index('ix_results_dropped', table_name='results')
    # Not batch mode: its copy drops `results`; SQLite >= 3.35 drops a column in place.
    op.drop_column('results', 'dropped')
