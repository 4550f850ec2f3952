"""baseline schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table('blobs',
    sa.Column('hash', sa.Text(), nullable=False),
    sa.Column('data', sa.LargeBinary(), nullable=False),
    sa.PrimaryKeyConstraint('hash', name=op.f('pk_blobs'))
    )
    op.create_table('campaign',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('epoch', sa.Text(), nullable=False),
    sa.Column('bitmap_version', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.CheckConstraint('id = 1', name=op.f('ck_campaign_single_row')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_campaign'))
    )
    op.create_table('events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('token', sa.Text(), nullable=True),
    sa.Column('task_id', sa.Integer(), nullable=True),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.CheckConstraint("kind IN ('campaign', 'enqueued', 'dispatched', 'send_failed', 'ready', 'invalid', 'committed', 'recovered', 'requeued', 'deferred', 'task_failed', 'retried', 'task_deferred', 'defer_failed', 'failed', 'interrupted', 'stop_requeued', 'reclaimed', 'not_admitted', 'watchdog', 'worker_recovered', 'worker_failed', 'manual_requeue')", name=op.f('ck_events_kind_enum')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_kind', ['kind'], unique=False)
        batch_op.create_index('ix_events_task', ['task_id'], unique=False)

    op.create_table('quarantine',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('channel', sa.Text(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('token', sa.Text(), nullable=True),
    sa.Column('expected', sa.Text(), nullable=True),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.CheckConstraint("channel IN ('ready', 'result')", name=op.f('ck_quarantine_channel_enum')),
    sa.CheckConstraint("reason IN ('missing', 'malformed', 'stale', 'unowned', 'payload')", name=op.f('ck_quarantine_reason_enum')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_quarantine'))
    )
    with op.batch_alter_table('quarantine', schema=None) as batch_op:
        batch_op.create_index('ix_quarantine_channel_reason', ['channel', 'reason'], unique=False)

    op.create_table('workers',
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('bitmap_version', sa.Integer(), server_default=sa.text('(-1)'), nullable=False),
    sa.Column('profile_version', sa.Text(), server_default=sa.text("('')"), nullable=False),
    sa.Column('parked_token', sa.Text(), nullable=True),
    sa.Column('host', sa.Text(), nullable=True),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('last_seen', sa.Float(), nullable=True),
    sa.CheckConstraint("state IN ('unknown', 'idle', 'busy', 'parked', 'failed', 'stopped')", name=op.f('ck_workers_state_enum')),
    sa.PrimaryKeyConstraint('rank', name=op.f('pk_workers'))
    )
    op.create_table('tasks',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('semantic_id', sa.Text(), nullable=False),
    sa.Column('payload', sa.Text(), nullable=False),
    sa.Column('input_hash', sa.Text(), nullable=True),
    sa.Column('state', sa.Text(), nullable=False),
    sa.Column('attempts', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('dispatches', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('queue_pos', sa.BigInteger(), nullable=False),
    sa.Column('depth', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('parent_id', sa.Integer(), nullable=True),
    sa.Column('origin', sa.Text(), server_default=sa.text("('')"), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.CheckConstraint("length(semantic_id) = 64 AND semantic_id NOT GLOB '*[^0-9a-f]*'", name=op.f('ck_tasks_semantic_id_hex')),
    sa.CheckConstraint("state IN ('queued', 'active', 'done', 'deferred', 'failed')", name=op.f('ck_tasks_state_enum')),
    sa.CheckConstraint('attempts >= 0 AND dispatches >= 0', name=op.f('ck_tasks_counts')),
    sa.ForeignKeyConstraint(['input_hash'], ['blobs.hash'], name=op.f('fk_tasks_input_hash_blobs')),
    sa.ForeignKeyConstraint(['parent_id'], ['tasks.id'], name=op.f('fk_tasks_parent_id_tasks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tasks')),
    sa.UniqueConstraint('semantic_id', name=op.f('uq_tasks_semantic_id'))
    )
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.create_index('ix_tasks_queue', ['queue_pos', 'id'], unique=False, sqlite_where=sa.text("state = 'queued'"))
        batch_op.create_index('ix_tasks_state', ['state'], unique=False)

    op.create_table('dispatches',
    sa.Column('token', sa.Text(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('task_id', sa.Integer(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('sent_at', sa.Float(), nullable=True),
    sa.Column('deadline', sa.Float(), nullable=True),
    sa.Column('ready_at', sa.Float(), nullable=True),
    sa.Column('invalid_reason', sa.Text(), nullable=True),
    sa.CheckConstraint("length(token) = 64 AND token NOT GLOB '*[^0-9a-f]*'", name=op.f('ck_dispatches_token_hex')),
    sa.CheckConstraint('rank >= 1', name=op.f('ck_dispatches_worker_rank')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_dispatches_task_id_tasks')),
    sa.PrimaryKeyConstraint('token', name=op.f('pk_dispatches')),
    sa.UniqueConstraint('rank', name=op.f('uq_dispatches_rank')),
    sa.UniqueConstraint('task_id', name=op.f('uq_dispatches_task_id'))
    )
    op.create_table('results',
    sa.Column('task_id', sa.Integer(), nullable=False),
    sa.Column('token', sa.Text(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('committed_at', sa.Float(), nullable=False),
    sa.Column('status', sa.Text(), nullable=False),
    sa.Column('value', sa.Text(), nullable=True),
    sa.Column('testcases', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('new_tasks', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_results_task_id_tasks')),
    sa.PrimaryKeyConstraint('task_id', name=op.f('pk_results')),
    sa.UniqueConstraint('token', name=op.f('uq_results_token'))
    )
    op.create_table('leases',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('token', sa.Text(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('key', sa.Text(), nullable=False),
    sa.CheckConstraint("kind IN ('work', 'target', 'content', 'schedule')", name=op.f('ck_leases_kind_enum')),
    sa.ForeignKeyConstraint(['token'], ['dispatches.token'], name=op.f('fk_leases_token_dispatches'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_leases')),
    sa.UniqueConstraint('kind', 'key', name=op.f('uq_leases_kind_key'))
    )
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.create_index('ix_leases_token', ['token'], unique=False)




def downgrade() -> None:

    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index('ix_leases_token')

    op.drop_table('leases')
    op.drop_table('results')
    op.drop_table('dispatches')
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_index('ix_tasks_state')
        batch_op.drop_index('ix_tasks_queue', sqlite_where=sa.text("state = 'queued'"))

    op.drop_table('tasks')
    op.drop_table('workers')
    with op.batch_alter_table('quarantine', schema=None) as batch_op:
        batch_op.drop_index('ix_quarantine_channel_reason')

    op.drop_table('quarantine')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_task')
        batch_op.drop_index('ix_events_kind')

    op.drop_table('events')
    op.drop_table('campaign')
    op.drop_table('blobs')

