"""What a `--db` path holds, read without writing anything, with the stdlib alone.

For the checks a start makes before MPI starts (`coordinator.preflight`) and before any
command opens a file for writing: a file that is not a campaign is never written (opening it
for writing would switch it to WAL mode for good), and a campaign from a newer coordinator,
a damaged one or one with a second name is refused before anything touches it.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DatabaseOpenError, NoCampaignYet, SchemaVersionError
from .imports import Imported, read_imports
from .lock import lock_holder, refuse_aliases
from .readonly import (
    cannot_open,
    damaged,
    is_corrupt,
    no_directory,
    path_too_long,
    readonly_connector,
)
from .revisions import head, known_revisions, revision_of


@dataclass(frozen=True)
class Probe:
    exists: bool                   # an SQLite file with something in it is there
    campaign: bool                 # it holds a campaign (its campaign row)
    revision: str | None = None
    settings: dict[str, Any] | None = None  # the first run's executor and source
    tasks: int = 0
    master: int | None = None      # the pid of a master (or `db upgrade`) holding it now
    imports: tuple[Imported, ...] = ()  # what its starts imported (revision 0011)


def probe(path: str | os.PathLike[str], *, current: bool = True) -> Probe:
    """What the file at `path` holds. Raises what a start would be refused for: a path that
    cannot be a campaign (a directory, a missing directory, a device, another kind of file,
    another program's database, a damaged file, a second name of the file) and, with
    `current`, a campaign at another revision than this code's (older: `db upgrade`;
    newer; a stamp no coordinator writes)."""
    path = Path(path)
    refuse_aliases(path)
    if path.is_dir():
        raise DatabaseOpenError(f"{path} is a directory; --db names the campaign's database "
                                f"file, e.g. --db {path / 'campaign.db'}")
    if not path.absolute().parent.is_dir():
        raise DatabaseOpenError(f"{path} cannot be created: "
                                f"{no_directory(path.absolute().parent)}")
    if path.is_symlink():  # (a link to a new file in a directory that exists is fine)
        target = Path(os.path.realpath(path))
        if not target.parent.is_dir():
            raise DatabaseOpenError(f"{path} is a symbolic link to {target}, which cannot be "
                                    f"created: {no_directory(target.parent)}")
    if not path.exists():
        # Refused here, before a run launches MPI, creates the file and its master fails to
        # open it. (SQLite's limit as built by default: a build with a larger one is refused
        # a path it could open.)
        if (too_long := path_too_long(path)) is not None:
            raise too_long
        return Probe(exists=False, campaign=False, master=None)
    if not path.is_file():
        raise DatabaseOpenError(f"{path} is not a regular file (a campaign is a file on a "
                                f"node-local disk)")
    if path.stat().st_size == 0:
        return Probe(exists=False, campaign=False, master=lock_holder(path))
    for at_rest in (True, False):
        try:
            connect, view = readonly_connector(path, at_rest=at_rest)
        except NoCampaignYet:
            return Probe(exists=False, campaign=False, master=lock_holder(path))
        db = connect()
        try:
            db.execute("BEGIN")
            found = _read(db, path, current)
        except sqlite3.DatabaseError as e:
            if not view.unchanged():
                continue  # written meanwhile (a master started): read it as it is now
            if is_corrupt(e):
                raise damaged(path, e) from None
            raise cannot_open(path, e) from e
        finally:
            db.close()
        if view.unchanged():
            holder = lock_holder(path)
            return found if holder is None else Probe(**{**found.__dict__, "master": holder})
    raise AssertionError("not reached: the second reading is not at rest")


def _read(db: sqlite3.Connection, path: Path, current: bool) -> Probe:
    tables = {t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    stamps = ([v for (v,) in db.execute("SELECT version_num FROM alembic_version")]
              if "alembic_version" in tables else [])
    revision = revision_of(path, tables, stamps)
    columns = {c[1] for c in db.execute("PRAGMA table_info(campaign)")}  # (settings: 0004)
    row = (db.execute("SELECT " + ("settings" if "settings" in columns else "NULL")
                      + " FROM campaign").fetchone()
           if revision is not None and "campaign" in tables else None)
    if row is None:  # no schema yet, or a start stopped while it wrote it
        return Probe(exists=True, campaign=False, revision=revision)
    if current and revision != head():
        raise SchemaVersionError(str(path), revision, head(),
                                 newer=revision not in known_revisions())
    try:
        settings = json.loads(row[0]) if row[0] is not None else None
    except ValueError:
        settings = None
    n = db.execute("SELECT count(*) FROM tasks").fetchone()[0]
    return Probe(exists=True, campaign=True, revision=revision,
                 settings=settings if isinstance(settings, dict) else None, tasks=n,
                 imports=read_imports(db))
