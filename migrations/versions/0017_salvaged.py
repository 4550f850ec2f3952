"""salvaged: the test cases of runs that were retried, counted with the results' own

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03

A SymCC run killed at its timeout is retried, but the test cases it wrote before it was killed
are kept: written to the coordinator's AFL directory, and fed back as tasks. They were counted
nowhere but in the text of the run's `task_failed` event ("timeout (3 test cases kept)"), so
`status`, the progress line, the metrics and the plot counted fewer test cases than the
directory held, and their "last find" missed them: on a campaign whose targets often time out,
most of what it found. Each such run now leaves a row.

The rows are made from those events for what an earlier revision's code kept (their texts
say how many); the downgrade drops the table, and the events keep saying it.
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None

# Written out here, not imported: what the code of revisions 0001-0016 wrote.
_KEPT = re.compile(r"\((\d+) test cases? kept\)")


def upgrade() -> None:
    op.create_table(
        'salvaged',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.Column('incarnation', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('token', sa.Text(), nullable=False),
        sa.Column('task_id', sa.Integer(), nullable=False),
        sa.Column('testcases', sa.Integer(), nullable=False),
        sa.CheckConstraint('testcases > 0', name=op.f('ck_salvaged_found')),
        sa.ForeignKeyConstraint(['task_id'], ['tasks.id'],
                                name=op.f('fk_salvaged_task_id_tasks')),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_salvaged')),
    )
    bind = op.get_bind()
    rows = []
    for at, incarnation, rank, token, task_id, detail in bind.exec_driver_sql(
            "SELECT at, incarnation, rank, token, task_id, detail FROM events "
            "WHERE kind = 'task_failed' AND detail LIKE '%kept)%' AND task_id IS NOT NULL "
            "AND rank IS NOT NULL AND token IS NOT NULL ORDER BY id"):
        found = _KEPT.search(detail or "")
        if found and int(found[1]) > 0:
            rows.append((at, incarnation, rank, token, task_id, int(found[1])))
    if rows:
        bind.exec_driver_sql(
            "INSERT INTO salvaged (at, incarnation, rank, token, task_id, testcases) "
            "VALUES (?, ?, ?, ?, ?, ?)", rows)


def downgrade() -> None:
    op.drop_table('salvaged')
