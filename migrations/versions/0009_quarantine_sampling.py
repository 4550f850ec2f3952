"""quarantine: new channels and reasons, and `repeats` for rows that stand for many messages

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01

One rank sending garbage wrote a quarantine row per message (77,290 rows in 30 s): past the
first rows of a rank's channel and reason in an incarnation, the last of them now counts the
rest in `repeats`, and the statistics sum it. A message over --max-message-bytes is
quarantined as `oversized`, one on a tag the master never receives as `foreign_tag` on the
`other` channel, and an acknowledgement of a STOP never sent on the `stop_ack` channel. The
CHECK constraints of `channel` and `reason` change: the table is copied (batch mode).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

OLD_CHANNELS = "channel IN ('ready', 'result')"
NEW_CHANNELS = "channel IN ('ready', 'result', 'stop_ack', 'other')"
OLD_REASONS = "reason IN ('missing', 'malformed', 'stale', 'unowned', 'payload')"
NEW_REASONS = ("reason IN ('missing', 'malformed', 'stale', 'unowned', 'payload', 'oversized', "
               "'foreign_tag')")


def upgrade() -> None:
    with op.batch_alter_table('quarantine', recreate='always') as batch:
        batch.add_column(sa.Column('repeats', sa.Integer(), nullable=False,
                                   server_default=sa.text('1')))
        batch.drop_constraint(op.f('ck_quarantine_channel_enum'), type_='check')
        batch.drop_constraint(op.f('ck_quarantine_reason_enum'), type_='check')
        batch.create_check_constraint(op.f('ck_quarantine_channel_enum'), sa.text(NEW_CHANNELS))
        batch.create_check_constraint(op.f('ck_quarantine_reason_enum'), sa.text(NEW_REASONS))


def downgrade() -> None:
    # Rows of the new kinds cannot be kept under the old constraints; a row that stood for
    # many messages becomes as many rows' worth in one (the counts before 0009 were rows).
    op.execute("DELETE FROM quarantine WHERE channel IN ('stop_ack', 'other') "
               "OR reason IN ('oversized', 'foreign_tag')")
    op.execute("INSERT INTO quarantine (at, incarnation, channel, reason, rank, token, "
               "expected, detail) SELECT q.at, q.incarnation, q.channel, q.reason, q.rank, "
               "q.token, q.expected, q.detail FROM quarantine q, "
               "(WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n "
               "WHERE i < (SELECT max(repeats) FROM quarantine)) SELECT i FROM n) k "
               "WHERE k.i < q.repeats")
    with op.batch_alter_table('quarantine', recreate='always') as batch:
        batch.drop_constraint(op.f('ck_quarantine_channel_enum'), type_='check')
        batch.drop_constraint(op.f('ck_quarantine_reason_enum'), type_='check')
        batch.create_check_constraint(op.f('ck_quarantine_channel_enum'), sa.text(OLD_CHANNELS))
        batch.create_check_constraint(op.f('ck_quarantine_reason_enum'), sa.text(OLD_REASONS))
        batch.drop_column('repeats')
