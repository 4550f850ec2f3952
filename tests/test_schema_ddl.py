"""The migrations must build exactly the schema the code declares, CHECK constraints included
(Alembic's autogenerate does not compare CHECKs, so a new enum value without a revision would
otherwise pass every migration test and then fail at run time)."""

from __future__ import annotations

import re
import sqlite3

from store.engine import open_engine
from store.schema import EventKind, QuarantineReason, TaskState, WorkerState, metadata
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
        # Views are the migration's alone (revision 0009): the model declares tables.
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


def test_every_enum_value_is_allowed_by_the_migrated_checks(tmp_path):
    path = tmp_path / "m.db"
    upgrade(path)
    sql = "\n".join(c for _, parts in ddl(path).values() for c in parts)
    for enum_cls in (EventKind, QuarantineReason, TaskState, WorkerState):
        for member in enum_cls:
            assert f"'{member.value}'" in sql, f"{enum_cls.__name__}.{member.name}"
