"""store/schema.py as the migrations build it: exactly the schema the code declares, CHECK
constraints included (Alembic's autogenerate does not compare CHECKs, so a new enum value
without a revision would otherwise pass every migration test and then fail at run time), and
each enum column's CHECK listing exactly its enum's values."""

from __future__ import annotations

import re
import sqlite3

from store.engine import open_engine
from store.schema import (
    Channel,
    EventKind,
    ImportKind,
    LeaseKind,
    QuarantineReason,
    TaskState,
    WorkerState,
    metadata,
)
from store.versioning import upgrade


def clauses(sql: str) -> tuple[str, frozenset[str]]:
    """A CREATE statement as (head, set of top-level clauses): the order in which Alembic and
    `create_all` emit constraints differs, their meaning must not."""
    sql = re.sub(r"\s+", " ", sql).strip()
    sql = re.sub(r"DEFAULT \(('[^']*')\)", r"DEFAULT \1", sql)  # ('') and '' are one default
    head, _, body = sql.partition("(")
    head = head.replace('"', "")  # a table Alembic's batch mode rebuilt is named quoted
    parts, depth, quoted, cur = [], 0, False, ""
    for ch in body.rstrip(")").rstrip():
        if ch == "'":
            quoted = not quoted
        elif not quoted and ch == "(":
            depth += 1
        elif not quoted and ch == ")":
            depth -= 1
        if ch == "," and depth == 0 and not quoted:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return head.strip(), frozenset(parts)


def ddl(path) -> dict[str, tuple[str, frozenset[str]]]:
    with sqlite3.connect(path) as c:
        # Views are the migration's alone (revision 0010): the model declares tables.
        rows = c.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL "
                         "AND name != 'alembic_version' AND type != 'view'").fetchall()
    return {name: clauses(sql) for name, sql in rows}


def test_migrated_schema_equals_declared_schema(tmp_path):
    migrated, declared = tmp_path / "migrated.db", tmp_path / "declared.db"
    upgrade(migrated)
    engine = open_engine(declared)
    metadata.create_all(engine)
    engine.dispose()
    assert ddl(migrated) == ddl(declared)


#: Each column whose CHECK lists an enum's values, and that enum.
ENUM_COLUMNS = {
    ("tasks", "state"): TaskState,
    ("workers", "state"): WorkerState,
    ("leases", "kind"): LeaseKind,
    ("quarantine", "channel"): Channel,
    ("quarantine", "reason"): QuarantineReason,
    ("events", "kind"): EventKind,
    ("imports", "kind"): ImportKind,
}


def enum_checks(path) -> dict[tuple[str, str], set[str]]:
    """(table, column) -> the values its `column = 'a' OR column = 'b' ...` CHECK lists, for
    every such CHECK in the file's DDL."""
    found = {}
    for table, (_, parts) in ddl(path).items():
        for part in parts:
            m = re.fullmatch(r"CONSTRAINT \S+ CHECK \(((\w+) = '[^']*'(?: OR \2 = '[^']*')*)\)",
                             part)
            if m:
                found[(table, m.group(2))] = set(re.findall(r"'([^']*)'", m.group(1)))
    return found


def test_each_tables_check_lists_exactly_its_enums_values(tmp_path):
    """Per table, not anywhere in the schema: `failed` is a TaskState and a WorkerState, so a
    search of the whole DDL would not see it missing from `workers`. Every enum CHECK is
    one of ENUM_COLUMNS (a new one must be added there)."""
    path = tmp_path / "m.db"
    upgrade(path)
    assert enum_checks(path) == {column: {m.value for m in enum_cls}
                                 for column, enum_cls in ENUM_COLUMNS.items()}
