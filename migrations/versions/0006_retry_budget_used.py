"""tasks.budget_used: the failures charged to the retry budget, apart from all failed attempts

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30

The retry decision read one counter, `attempts`, for both the immediate-retry budget
(`--retries`) and the ceiling (`--max-attempts`). `attempts` also counts dispatches a master
crash interrupted (and a worker found gone at a graceful stop), which are not failures of the
task's run: after one crash a task's first real protocol failure deferred it at once. The
budget now reads `budget_used`, the failures the retry policy decided (an invalid or missing
answer, a watchdog timeout, a dead worker, a `timeout` result); `attempts` keeps counting every
failed dispatch for the ceiling.

Existing tasks start with `budget_used = attempts`: what the budget read until now, so a task in
the middle of its retries is treated as it was.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # ADD COLUMN with a constant default needs no table copy; the UPDATE writes only the tasks
    # that ever failed.
    op.add_column('tasks', sa.Column('budget_used', sa.Integer(), nullable=False,
                                     server_default=sa.text('0')))
    op.execute("UPDATE tasks SET budget_used = attempts WHERE attempts > 0")


def downgrade() -> None:
    # Not batch mode: its copy drops `tasks`, which `results` and `tasks.parent_id` refer to
    # (foreign keys are on). SQLite >= 3.35 (the least this project runs on) drops a column
    # in place.
    op.drop_column('tasks', 'budget_used')
