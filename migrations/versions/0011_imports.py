"""imports: what each start imported, so that a --resume does not read it again

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01

A --resume of a finished 200,000-task --demo campaign spent 2.5 s of its start re-reading the
task source and finding every task already there; at a million tasks, tens of seconds. Each
import now leaves a row: the demo's N (tasks 0 .. N-1 are all in the campaign), a tasks
file's path and identity as read (device, inode, size, modification time). A --resume that
names the same source unchanged skips it; a larger --demo imports only the tasks past N.
A campaign brought forward has no rows: its first --resume reads its source as before.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'imports',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('incarnation', sa.Integer(), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.Column('kind', sa.Text(), nullable=False),
        sa.Column('source', sa.Text(), nullable=False),
        sa.Column('identity', sa.Text(), nullable=True),
        sa.Column('count', sa.Integer(), nullable=False),
        sa.Column('added', sa.Integer(), nullable=False),
        sa.CheckConstraint("kind IN ('demo', 'tasks_file')", name=op.f('ck_imports_kind_enum')),
        sa.CheckConstraint('count >= 0 AND added >= 0 AND added <= count',
                           name=op.f('ck_imports_counts')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_imports')),
    )
    op.create_index('ix_imports_source', 'imports', ['kind', 'source'])


def downgrade() -> None:
    op.drop_index('ix_imports_source', table_name='imports')
    op.drop_table('imports')
