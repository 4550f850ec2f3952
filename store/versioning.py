"""Schema revisions: the code's head, the file's revision, and bringing a file forward.

Alembic ships inside the package (`migrations/`), so `coordinator db upgrade` needs no
alembic.ini; `alembic -x db=PATH upgrade head` from the repository root does the same.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import exc

import migrations

from .engine import open_engine
from .errors import SchemaVersionError, StoreWriteError
from .probe import probe
from .revisions import current_revision, known_revisions, refuse_foreign

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

# Alembic is imported where a revision is run or walked, not here: `status` and `plot` only
# compare the file's stamp with the head (`revisions`, a test holds the two views equal),
# and importing Alembic would be a third of their start-up.


def alembic_config() -> Config:
    from alembic.config import Config
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return cfg


@lru_cache(maxsize=1)
def _script() -> ScriptDirectory:
    from alembic.script import ScriptDirectory
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    heads = _script().get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"migrations have {len(heads)} heads: {heads}")
    return heads[0]


def revisions_in_order() -> list[str]:
    """Every revision this code knows, oldest first."""
    return [rev.revision for rev in reversed(list(_script().walk_revisions()))]


def upgrade(path: str | os.PathLike[str], revision: str = "head", *,
            announce: Callable[[str, str], None] | None = None) -> tuple[str | None, str]:
    """Create or upgrade the database at `path`; returns (revision before, revision after).
    `announce(before, target)` is called before an existing campaign is changed: a revision
    that copies a table takes seconds per million rows, and the caller may want to say so.
    What is not a campaign (another program's database, a damaged file, a second name of
    one, a stamp no coordinator writes) is refused before anything writes it."""
    found = probe(path, current=False)
    if found.revision is not None and found.revision not in known_revisions():
        raise SchemaVersionError(str(path), found.revision, head_revision())
    engine = open_engine(path)
    try:
        with engine.connect() as conn:
            refuse_foreign(conn, path)
            before = current_revision(conn)
            known = {rev.revision for rev in _script().walk_revisions()}
            if before is not None and before not in known:
                raise SchemaVersionError(str(path), before, head_revision(), newer=True)
            target = head_revision() if revision == "head" else revision
            if announce is not None and before is not None and before != target:
                announce(before, target)
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            # The reads above opened a transaction; inside it Alembic would nest every revision
            # into one. Ended, each revision commits on its own (transaction_per_migration):
            # an upgrade that fails or is interrupted keeps the revisions it completed.
            conn.commit()
            try:
                from alembic import command
                command.upgrade(cfg, revision)
                conn.commit()
            except (exc.DBAPIError, sqlite3.Error) as e:
                conn.rollback()
                try:
                    now = f" (the file is at {current_revision(conn) or '(none)'} now)"
                except (exc.DBAPIError, sqlite3.Error):
                    now = ""
                raise StoreWriteError(f"the schema upgrade from {before or '(new)'} to "
                                      f"{target}{now}", getattr(e, "orig", None) or e) from e
            after = current_revision(conn)
        return before, after
    finally:
        engine.dispose()
