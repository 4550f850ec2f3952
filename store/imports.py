"""What each start imported (revision 0011): the demo's N, a tasks file's path and identity.

A --resume that names the same source unchanged does not read it again: re-reading a
million-line file (or making a million demo tasks) only to find each one already in the
campaign costs tens of seconds before the first WORK. Read with the stdlib alone (the start's
checks, `store.probe`, read before any engine is made).
"""

from __future__ import annotations

import enum
import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEMO_SOURCE = "demo"


class ImportKind(str, enum.Enum):
    DEMO = "demo"              # --demo N: the built-in tasks 0 .. N-1
    TASKS_FILE = "tasks_file"  # --tasks FILE


@dataclass(frozen=True)
class Imported:
    incarnation: int
    kind: ImportKind
    source: str              # the tasks file's absolute path, or DEMO_SOURCE
    identity: str | None     # the file as it was read: "device:inode:size:mtime_ns"
    count: int               # the tasks it holds (the demo: 0 .. count-1 are all in)
    added: int               # of which new to the campaign then


def file_identity(path: os.PathLike[str] | str) -> tuple[str, str]:
    """(absolute path, identity) of a tasks file as it is now (raises OSError)."""
    st = os.stat(path)
    return str(Path(path).resolve()), identity_of((st.st_dev, st.st_ino, st.st_size,
                                                   st.st_mtime_ns))


def identity_of(stat_fields: Sequence[int]) -> str:
    return ":".join(str(int(v)) for v in stat_fields)


def read_imports(db: sqlite3.Connection) -> tuple[Imported, ...]:
    """Every import row, oldest first; none in a file from before revision 0011."""
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'imports'"
                  ).fetchone() is None:
        return ()
    return tuple(Imported(inc, ImportKind(kind), source, identity, count, added)
                 for inc, kind, source, identity, count, added in db.execute(
                     "SELECT incarnation, kind, source, identity, count, added FROM imports "
                     "ORDER BY id"))


def demo_imported(found: Sequence[Imported]) -> Imported | None:
    """The import that brought the most demo tasks in (every task below its count is in)."""
    demos = [i for i in found if i.kind is ImportKind.DEMO]
    return max(demos, key=lambda i: (i.count, -i.incarnation)) if demos else None


def file_imported(found: Sequence[Imported], source: str, identity: str) -> Imported | None:
    """The first import of this very file, unchanged since (None: never, or it changed)."""
    return next((i for i in found if i.kind is ImportKind.TASKS_FILE and i.source == source
                 and i.identity == identity), None)


def record_import(db: sqlite3.Connection, incarnation: int, at: float, kind: ImportKind,
                  source: str, identity: str | None, count: int, added: int) -> None:
    """In the import's own transaction (`db` is its connection): the row and the tasks are
    kept or undone together."""
    db.execute("INSERT INTO imports (incarnation, at, kind, source, identity, count, added) "
               "VALUES (?, ?, ?, ?, ?, ?, ?)",
               (incarnation, at, kind.value, source, identity, count, added))
