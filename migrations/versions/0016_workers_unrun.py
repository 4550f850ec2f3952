"""workers.unrun_*: a rank whose host cannot run tasks, as the master knows it

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03

A rank whose host cannot run tasks (a full disk, the target gone: every task of its answers
`not_run`) cools down while the other ranks run its tasks, and its later failures are charged
nothing. The master held that in memory alone and said it on its stderr, which a batch job
writes to a log the operator may never open: `coordinator status` showed the rank as idle or
busy like any other. Each such answer now writes the rank's streak to its row (how many
answers in a row ran nothing, since when, what the host could not do), cleared when an answer
of the rank runs a task and at each new incarnation.

Existing rows start with NULL: nothing failing is known of an earlier revision's ranks.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

_COLUMNS = (("unrun_streak", sa.Integer()), ("unrun_since", sa.Float()),
            ("unrun_detail", sa.Text()))


def upgrade() -> None:
    # Nullable ADD COLUMNs without a default rewrite no row.
    for name, type_ in _COLUMNS:
        op.add_column('workers', sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    # In place, as 0013's downgrade.
    for name, _ in reversed(_COLUMNS):
        op.drop_column('workers', name)
