"""campaign.settings: the executor and task source a campaign was started with

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29

`--resume` with other arguments than the first run (a forgotten `--callable`, a forgotten
`--afl-out`) used to run the stored tasks through the built-in demo executor, or write an AFL
campaign's results outside AFL's sync directory, and commit the outcome for good. The first
run's executor and source are now kept so a resume that would change them is refused. Older
campaigns have none (NULL) until their first `--resume`, which records its own.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMN (nullable, no default) needs no table copy, so no batch mode.
    op.add_column('campaign', sa.Column('settings', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('campaign') as batch:
        batch.drop_column('settings')
