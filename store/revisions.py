"""The schema revisions this code knows, in order, read from the migration scripts' own
`revision`/`down_revision` lines without importing Alembic (which takes a quarter second):
for the checks a start makes before MPI starts. `versioning` holds Alembic's view of the same
scripts; a test holds the two equal."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import migrations

from .errors import (
    DatabaseOpenError,
    ForeignDatabaseError,
    NoCampaignYet,
    SchemaVersionError,
    UnstampedCampaignError,
    restore_hint,
)

if TYPE_CHECKING:
    from .readonly import Reader

_FIELD = re.compile(r"^(revision|down_revision)\s*=\s*(?:'([^']*)'|\"([^\"]*)\"|None)\s*$", re.M)


@lru_cache(maxsize=1)
def known_revisions() -> tuple[str, ...]:
    """Every revision, oldest first (the chain from the baseline to the head)."""
    parent: dict[str, str | None] = {}
    for script in (Path(migrations.__file__).parent / "versions").glob("*.py"):
        fields = {m[1]: m[2] or m[3] or None for m in _FIELD.finditer(script.read_text())}
        if fields.get("revision"):
            parent[fields["revision"]] = fields.get("down_revision")
    order: list[str] = []
    child = {p: r for r, p in parent.items()}
    rev = child.get(None)
    while rev is not None:
        order.append(rev)
        rev = child.get(rev)
    if len(order) != len(parent):
        raise RuntimeError(f"the migration scripts do not form one chain: {sorted(parent)}")
    return tuple(order)


def head() -> str:
    return known_revisions()[-1]


#: The tables every campaign has had since the baseline: a file holding them is a campaign.
CAMPAIGN_TABLES = frozenset({"campaign", "tasks", "dispatches", "results"})


def revision_of(path: object, tables: set[str], stamps: list[str]) -> str | None:
    """The file's revision from its tables and its `alembic_version` rows; None for a file
    with no schema yet (empty, or a downgrade to base, which leaves the stamp table alone).
    Raises for what no coordinator file looks like: another program's database, a campaign
    whose stamp was emptied, several stamps."""
    if len(stamps) > 1:
        raise DatabaseOpenError(
            f"{path}: its alembic_version table holds {len(stamps)} revisions "
            f"({', '.join(sorted(stamps))}) where a campaign has one: it was changed by hand or "
            f"by another tool; {restore_hint(path)}, or keep only the revision its tables "
            f"match")
    if stamps:
        return stamps[0]
    ours = {t for t in tables if not t.startswith("sqlite_") and t != "alembic_version"}
    if not ours:
        return None
    if ours >= CAMPAIGN_TABLES:
        raise UnstampedCampaignError(path)
    raise ForeignDatabaseError(path, sorted(ours))


# -- a file's own revision (plain SQL: a SQLAlchemy connection or a `readonly.Reader`) ------

_TABLES = ("SELECT name FROM sqlite_master WHERE type = 'table' "
           "AND name NOT LIKE 'sqlite~_%' ESCAPE '~'")


def _tables(conn: Reader) -> set[str]:
    return {name for (name,) in conn.exec_driver_sql(_TABLES)}


def _named(conn: Any) -> object:
    """The file `conn` reads, for messages."""
    return getattr(conn, "path", None) or conn.engine.url.database


def current_revision(conn: Reader) -> str | None:
    """The file's revision stamp (None: no schema yet). What no coordinator file looks like
    is refused with what it is (`revision_of`), never Alembic's traceback."""
    tables = _tables(conn)
    stamps = ([v for (v,) in conn.exec_driver_sql("SELECT version_num FROM alembic_version")]
              if "alembic_version" in tables else [])
    return revision_of(_named(conn), tables, stamps)


def refuse_foreign(conn: Reader, path: str | os.PathLike[str]) -> None:
    """Raises for another program's database (or a campaign without its stamp): upgrading
    it would write our tables into someone else's database."""
    current_revision(conn)


def check_revision(conn: Reader, path: str | os.PathLike[str]) -> None:
    """Refuse a file whose revision is not the code's head, naming the way forward."""
    found, code_head = current_revision(conn), head()
    if found == code_head:
        return
    refuse_foreign(conn, path)
    if found is None and not _tables(conn):
        # Empty: a master that has just created the file is about to write its schema.
        raise NoCampaignYet(path)
    raise SchemaVersionError(str(path), found, code_head,
                             newer=found is not None and found not in known_revisions())


def check_campaign(conn: Reader, path: str | os.PathLike[str]) -> None:
    """`check_revision`, and the campaign's row. A file at the head revision may hold the
    schema alone: `coordinator db upgrade` of a path where no file was, or a start that
    stopped before its first incarnation. `status` and `plot` showed it as an empty campaign
    of incarnation 0 while `check` said it held none; every reader now says the latter."""
    check_revision(conn, path)
    if not conn.exec_driver_sql("SELECT count(*) FROM campaign").scalar():
        raise NoCampaignYet(path)
