"""the `stop` event: a stop signal the master got, written at once

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03

At a Slurm time limit or `scancel` every process of the job gets SIGTERM: the master, the
workers, their targets, and `mpiexec` too, which answers it by ending its ranks within about
2 s. The master's graceful stop (its grace, its wait for the STOP_ACKs) then never ran, and the
next `--resume` charged every run in flight an attempt, as for a crash: two time limits with
`--max-attempts 2` held three healthy tasks `failed`. The master now writes a `stop` event the
moment it gets a stop signal, so a resume can tell an incarnation its operator stopped from one
that crashed.

`events.kind` takes the new value: its CHECK text is rewritten in place, as revision 0014 did
(no copy of `events`, which holds a row per task and more). The downgrade deletes the `stop`
events and takes the value out again.
"""

from __future__ import annotations

import sqlite3

from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None

_LAST = "kind = 'split'"
_ADDED = "kind = 'split' OR kind = 'stop'"


def _rewrite(old: str, new: str) -> None:
    conn = op.get_bind()
    sql = conn.exec_driver_sql(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'events'").scalar()
    if sql is None or sql.count(old) != 1:
        # A sqlite3 error: the upgrade then says it failed, rolled back.
        raise sqlite3.DatabaseError(f"revision 0018: the CHECK of events.kind is not of the "
                                    f"form expected (no single `{old}`): the schema was changed")
    version = conn.exec_driver_sql("PRAGMA schema_version").scalar()
    conn.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        conn.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND "
                             "name = 'events'", (sql.replace(old, new),))
        conn.exec_driver_sql(f"PRAGMA schema_version = {int(version) + 1}")
    finally:
        conn.exec_driver_sql("PRAGMA writable_schema = OFF")
    # The new text must parse: this reads the schema anew (and fails, rolling all of this
    # back, if it does not).
    conn.exec_driver_sql("SELECT 1 FROM events LIMIT 1").all()


def upgrade() -> None:
    _rewrite(_LAST, _ADDED)


def downgrade() -> None:
    op.execute("DELETE FROM events WHERE kind = 'stop'")
    _rewrite(_ADDED, _LAST)
