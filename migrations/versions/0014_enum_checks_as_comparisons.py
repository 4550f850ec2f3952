"""enum CHECKs as comparisons, not IN lists; the `split` event

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-02

SQLite codes a CHECK constraint's `IN` list of three or more constants as a temporary index that
it builds again for every row it writes: 1.7 µs of the 5.0 µs that moving a task to `done` costs
(an UPDATE of 100 tasks by id, synchronous=OFF, this VM), and as much for each work lease and
each task made `active`. The same condition as comparisons (`state = 'queued' OR state =
'active' ...`) costs 0.1 µs. Rows are unchanged, and every row satisfies both forms.

`events.kind` takes one more value, `split`: a batch whose results were too large for one
RESULT, rolled back in halves at its worker's request. It was written as `recovered` and
`requeued`, and so counted in "Protocol-requeued dispatches", which a healthy run keeps at 0
(R10). The downgrade writes such events back as `recovered`.

The CHECK text of each table is rewritten in place (SQLite's documented `writable_schema`
procedure for changing a constraint, with `schema_version` bumped so that every connection
reads the schema again): a batch-mode copy would drop `tasks`, which other tables refer to,
and would take seconds per million tasks where this takes none.
"""

from __future__ import annotations

import re
import sqlite3

from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

#: Each table and how many enum CHECKs it has (quarantine: channel and reason).
TABLES = {'tasks': 1, 'leases': 1, 'workers': 1, 'quarantine': 2, 'events': 1, 'imports': 1}

_IN = re.compile(r"CHECK \((\w+) IN \(((?:'[a-z_]+'(?:, )?)+)\)\)")
_OR = re.compile(r"CHECK \(((\w+) = '[a-z_]+'(?: OR \2 = '[a-z_]+')*)\)")


#: The values 0014 adds, by (table, column).
ADDED = {('events', 'kind'): ['split']}


def _as_comparisons(table: str, m: re.Match[str]) -> str:
    column, values = m.group(1), re.findall(r"'([a-z_]+)'", m.group(2))
    values += ADDED.get((table, column), [])
    return "CHECK (" + " OR ".join(f"{column} = '{v}'" for v in values) + ")"


def _as_in_list(table: str, m: re.Match[str]) -> str:
    column, values = m.group(2), re.findall(r"'([a-z_]+)'", m.group(1))
    values = [v for v in values if v not in ADDED.get((table, column), [])]
    return f"CHECK ({column} IN (" + ", ".join(f"'{v}'" for v in values) + "))"


def _rewrite(pattern: re.Pattern[str], replace) -> None:
    conn = op.get_bind()
    sql = {name: text for name, text in conn.exec_driver_sql(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name IN "
        f"({', '.join(repr(t) for t in TABLES)})")}
    new = {}
    for table, count in TABLES.items():
        if table not in sql:
            raise sqlite3.DatabaseError(f"revision 0014: the table {table} is missing")
        new[table], found = pattern.subn(lambda m, t=table: replace(t, m), sql[table])
        if found != count:
            # A sqlite3 error: the upgrade then says it failed, rolled back, at 0013.
            raise sqlite3.DatabaseError(f"revision 0014: {table} has {found} enum CHECKs of the "
                                        f"form expected, not {count}: the schema was changed")
    version = conn.exec_driver_sql("PRAGMA schema_version").scalar()
    conn.exec_driver_sql("PRAGMA writable_schema = ON")
    try:
        for table, text in new.items():
            conn.exec_driver_sql("UPDATE sqlite_master SET sql = ? WHERE type = 'table' "
                                 "AND name = ?", (text, table))
        conn.exec_driver_sql(f"PRAGMA schema_version = {int(version) + 1}")
    finally:
        conn.exec_driver_sql("PRAGMA writable_schema = OFF")
    # The new text must parse: the next statement on each table reads the schema anew (and
    # fails, rolling all of this back, if it does not). The rows need no check: each
    # condition is its old one, written otherwise (and `split` only added), where a
    # `quick_check` would read the whole file (6 s for a million tasks).
    for table in new:
        conn.exec_driver_sql(f"SELECT 1 FROM {table} LIMIT 1").all()


def upgrade() -> None:
    _rewrite(_IN, _as_comparisons)


def downgrade() -> None:
    op.execute("UPDATE events SET kind = 'recovered' WHERE kind = 'split'")
    _rewrite(_OR, _as_in_list)
