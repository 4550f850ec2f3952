"""results.detail: why a run that finished with a non-ok status failed

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

A result whose executor status is not `ok` (a command's non-zero exit, a callable that raised,
an input that could not be materialised) was committed with nothing saying why: the worker's
explanation was dropped at the master. It is now kept, clipped, for those results only (an
`ok` result stores NULL, so the happy path writes no more than before). Older results have none.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (nullable, no default) needs no table copy, so no batch mode.
    op.add_column('results', sa.Column('detail', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('results') as batch:
        batch.drop_column('detail')
