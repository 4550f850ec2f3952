"""One root exception for everything the store refuses, with a few leaves that carry data.

Driver errors are translated once, at the store boundary (`engine.write_tx`), so callers see
`sqlite3` or SQLAlchemy exception types only for a broken schema invariant (an IntegrityError
is a bug, passed on unchanged).
"""

from __future__ import annotations

import os
import re


class StoreError(Exception):
    """Root of every error the store raises on purpose."""


class UnsafeDatabaseError(StoreError):
    """The file cannot be run safely: a network filesystem, an SQLite too old, or WAL refused."""


class DatabaseOpenError(StoreError):
    """The path cannot hold a campaign: a directory, a missing directory, a file that is not
    SQLite, or an SQLite file that belongs to something else."""


class ReadOnlyDatabaseError(DatabaseOpenError):
    """A command that writes (a run, `requeue`, `db upgrade`) on a file it cannot write, or
    beside which SQLite cannot make its `-wal` and `-shm`: a read-only medium or directory,
    or an immutable file (`lock.refuse_read_only`)."""


class NoCampaignYet(DatabaseOpenError):
    """A file with no campaign in it (yet): empty, or a schema without its campaign row."""

    def __init__(self, path: object, what: str = ""):
        super().__init__(f"{path} holds no campaign yet{what} (a master starting on it creates "
                         f"one within a moment; an empty file left by a start that failed is "
                         f"used as it is by the next `coordinator run`)")


class CampaignRowMissing(NoCampaignYet):
    """This coordinator's schema without its campaign row, in a file no master is starting
    on: a copy made without its `-wal` (after a `kill -9` every commit may still be there,
    the campaign row included), or a file whose first start died between the schema and the
    campaign row, which `Store.open` commits one after the other. The two look alike: a
    `--resume` starts a new campaign in it (the second must go on), saying this loudly."""

    def __init__(self, path: object, *, resume: bool = False):
        what = (f"--resume: {path} holds the schema but no campaign row; a new campaign starts "
                f"in it" if resume else
                f"{path} holds no campaign yet (its schema, but no campaign row, and no master "
                f"is starting on it)")
        self.message = (f"{what}. If it is a copy, its -wal was probably left behind: "
                        + ("stop this run now, " if resume else "")
                        + f"copy the original's -wal beside it as {path}-wal"
                        + (" and --resume again" if resume else "; if a master died while "
                           "creating it, the next `coordinator run` makes its campaign"))
        DatabaseOpenError.__init__(self, self.message)


def restore_hint(path: object) -> str:
    """How to put a copy back: SQLite applies a `-wal` it finds beside a file to it, so a
    copy put over a crashed campaign's file was silently turned back into the old one by
    the old campaign's `-wal`."""
    return (f"restore a copy (remove {path}-wal and {path}-shm first: SQLite would apply "
            f"the old -wal to the copy)")


class DamagedDatabaseError(DatabaseOpenError):
    """Pages of the file are damaged (SQLITE_CORRUPT, SQLITE_NOTADB: "database disk image
    is malformed"), wherever that was met: a start, a master's round, its COMMIT, a command.
    Not a storage failure that `--resume` gets past once fixed: every resume ran until the
    same page was read again, charging an attempt to each task it had in flight."""

    def __init__(self, path: object, cause: BaseException):
        self.path, self.cause = path, cause
        super().__init__(f"{path} is damaged ({cause}): `coordinator check --db {path}` says "
                         f"where; {restore_hint(path)}, or `sqlite3 {path} .recover` may save "
                         f"what is left")


class UnreadWalError(DatabaseOpenError):
    """A reader on read-only media, where SQLite reads a `-wal` only through a `-shm` it
    cannot make, that could not read a copy either (`readonly.ReadOnlyView.no_copy`): the
    file without its -wal holds no campaign, which is not to say the campaign has none."""


class SchemaVersionError(StoreError):
    """The database's schema revision is not the one this code was written for: an older one
    (`coordinator db upgrade` brings it forward), a newer one (a newer coordinator wrote it),
    or a stamp no coordinator writes (another tool changed it)."""

    def __init__(self, path: str, found: str | None, expected: str, newer: bool = False):
        self.path, self.found, self.expected = path, found, expected
        # Revisions are four digits that grow: one past the head is a newer coordinator's.
        self.unknown = found is not None and not re.fullmatch(r"\d{4}", found)
        self.newer = not self.unknown and (newer or (found is not None and found > expected))
        if self.unknown:
            msg = (f"{path}: its schema stamp {found!r:.40} (alembic_version) is not a revision "
                   f"this coordinator or a newer one writes (they are four digits; this one's "
                   f"head is {expected}): another tool changed it; {restore_hint(path)}")
        elif self.newer:
            msg = (f"{path}: schema revision {found} is newer than this coordinator knows "
                   f"(head {expected}); upgrade the coordinator, do not open it with this "
                   f"version")
        else:
            msg = (f"{path}: schema revision {found or '(none)'} is older than this "
                   f"coordinator's {expected}; bring it forward with `coordinator db upgrade "
                   f"--db {path}` (or `alembic -x db={path} upgrade head` from the repository "
                   f"root)")
        super().__init__(msg)


class ForeignDatabaseError(DatabaseOpenError):
    """An SQLite file with tables but no campaign schema stamp: another program's database.
    Every revision, the baseline included, writes its tables and the stamp in one
    transaction, so a campaign always has one."""

    def __init__(self, path: object, tables: list[str]):
        shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
        super().__init__(f"{path} is an SQLite database of something else (tables {shown}), "
                         f"not a coordinator campaign; choose another --db path")


class UnstampedCampaignError(DatabaseOpenError):
    """A campaign's tables without a schema stamp (its `alembic_version` is empty): not a
    file a coordinator wrote like this (each revision writes its tables and stamp in one
    transaction), so which revision its tables are is not known."""

    def __init__(self, path: object):
        super().__init__(f"{path} holds a campaign's tables but no schema stamp (its "
                         f"alembic_version table is empty): it was changed by hand or by another "
                         f"tool; {restore_hint(path)}, or stamp the revision its tables match with "
                         f"`alembic -x db={path} stamp REVISION`")


class NewCampaignNotMade(StoreError):
    """A start on a new file could not write the campaign (a disk too full for its schema or
    first rows, an I/O error): the file it began was removed, nothing changed (exit 2, as a
    disk too full to start on)."""

    def __init__(self, path: object, cause: BaseException):
        self.path, self.cause = path, cause
        try:
            fs = os.statvfs(os.path.dirname(os.path.abspath(path)))
            free = f" ({fs.f_bavail * fs.f_frsize} bytes free there now)"
        except OSError:
            free = ""
        super().__init__(f"{path}: the new campaign could not be written ({cause}){free}; the "
                         f"file this start began was removed, nothing was changed: free some "
                         f"space or choose another --db, then run the same command again")


class CampaignExistsError(StoreError):
    """A campaign is already stored in the file and the caller did not ask to resume it."""

    def __init__(self, path: str, tasks: int):
        self.path, self.tasks = path, tasks
        super().__init__(
            f"{path} already holds a campaign ({tasks} tasks); pass --resume (or set "
            f"SYMCC_RESUME=1) to continue it, or choose a new --db path"
        )


class CampaignLockedError(StoreError):
    """Another master holds the campaign: two masters on one file would fence each other's
    dispatches out and hand the same ranks work twice."""


class StoreWriteError(StoreError):
    """A write failed (disk full, I/O error, read-only file, lock timeout).

    The outcome of a failed COMMIT is unknown (it can still be durable), so the caller must not
    retry blindly: stop, and let restart recovery decide.
    """

    def __init__(self, operation: str, cause: BaseException):
        self.operation, self.cause = operation, cause
        hint = (" (another process held the campaign's write lock longer than this command "
                "waits (a master: --lock-wait; `requeue`, `db upgrade`: 10 s): a `sqlite3` "
                "shell with a transaction open, or another program writing to it?)"
                if "database is locked" in str(cause) else "")
        super().__init__(f"database write failed during {operation}: {cause}{hint}")


class FenceError(StoreError):
    """A fenced write matched no row: the (rank, token, state) it named is not current."""
