"""tasks.batch_cap: the largest dispatch a task of a broken batch may go out in

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02

A dispatch of several tasks that breaks (a dead worker, a timeout, an invalid RESULT) goes back
to the queue in two halves, none charged, so that a poison task is isolated in ⌈log2 N⌉
dispatches and only it is charged. Which tasks formed each half was kept in the master's memory
alone: a batch a crash interrupted (without ULFM a worker's crash ends the whole job) went back
as one block at `--resume`, was dispatched whole again, and brought the job down again, for
ever, its poison task never charged. The halves' sizes are now rows: `batch_cap`, NULL for a
task that has never been in a broken batch.

Existing tasks start with NULL: a file of an earlier revision holds no halves.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable ADD COLUMN without a default rewrites no row.
    op.add_column('tasks', sa.Column('batch_cap', sa.Integer(), nullable=True))


def downgrade() -> None:
    # In place, as 0006's downgrade (a batch-mode copy would drop `tasks`, which others
    # refer to).
    op.drop_column('tasks', 'batch_cap')
