"""Reading a campaign file without writing anything, with the stdlib's sqlite3 alone.

Light enough for the checks `coordinator run` makes before it launches MPI and for
`coordinator status` (SQLAlchemy and Alembic take most of a second to import);
`engine.open_readonly` and `engine.read_file` build on it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from .errors import (
    DamagedDatabaseError,
    DatabaseOpenError,
    NoCampaignYet,
    SchemaVersionError,
    StoreError,
    UnreadWalError,
    UnsafeDatabaseError,
    restore_hint,
)
from .lock import refuse_aliases

T = TypeVar("T")

#: Waited for a lock a reader needs now and then (the WAL index while a writer recovers it).
READ_BUSY_TIMEOUT_MS = 10_000

#: `DELETE ... RETURNING` (the fenced rollback) needs 3.35; revision 0002 uses `UPDATE ... FROM`.
MIN_SQLITE = (3, 35, 0)


def check_sqlite_version(version: tuple[int, int, int] = sqlite3.sqlite_version_info) -> None:
    if version < MIN_SQLITE:
        raise UnsafeDatabaseError(
            f"this Python's SQLite is {'.'.join(map(str, version))}; the coordinator needs "
            f"{'.'.join(map(str, MIN_SQLITE))} or newer (use a newer Python build, or one "
            f"linked against a newer libsqlite3)")


#: SQLite's file header: its first 16 bytes, and the offset of its read version (2: WAL).
_SQLITE_MAGIC = b"SQLite format 3\x00"
_READ_VERSION_AT = 19


@dataclass(frozen=True)
class ReadOnlyView:
    """How a file is opened for reading (`readonly_connector`, `engine.readonly_view`).

    `mode` is one of:

    - `shared`: an ordinary read-only connection. In WAL mode it shares the `-shm` index
      with a master, sees every commit up to its read transaction's start, and never makes
      the master wait.
    - `at rest`: a WAL file with no `-wal` beside it, which no connection has open (SQLite
      deletes it as the last one closes). An ordinary reader would create `-wal` and `-shm`
      and leave them behind, so the file is read as immutable (no locks, nothing created);
      `unchanged()` tells afterwards whether something wrote it meanwhile (a master that
      started), in which case what was read may be torn.
    - `immutable`: a WAL file whose `-shm` cannot be created (a read-only directory or
      medium), with no `-wal` beside it (or one that holds no commit, or no copy could be
      made): read as immutable. The view may be stale if a master is live, or leave out
      what the `-wal` holds; `note()` says so, and a refusal made from such a view says it
      too (`read_consistently`): the file without its -wal may hold no campaign at all.
    - `copy`: the same, with a `-wal` beside it. SQLite reads a `-wal` only through a
      `-shm`; read as immutable, the campaign's latest commits (all of them, for a file
      whose every commit is still in its `-wal`) were not seen, and `status` and `check`
      answered for an older or an empty campaign. The file and its `-wal` are copied to a
      temporary directory and read there, whole (no master can be writing a file whose
      `-shm` cannot be made); `note()` says so.
    - `upgraded copy`: a campaign at an older schema revision than this code's, which a
      reader of the head's schema (`status`) refused until `coordinator db upgrade` had
      written to it: a post-mortem needed a write to the evidence. What a reader sees of it
      (the `-wal`'s commits included) is copied to a temporary directory with SQLite's
      backup and upgraded there with the project's migrations (`read_consistently`, for a
      caller that gives it the upgrade); the file is left as it is, and `note()` says so.
    """

    path: Path      # the file itself (a symbolic link's target)
    mode: str
    wal_bytes: int  # size of the `-wal` when opened (0: none)
    stamp: tuple[int, ...] | None = None  # the file's stat when opened (`at rest` only)
    named: Path | None = None  # the path as given (absolute), for messages

    copied_to: Path | None = None  # `copy`: the directory read
    #: `immutable` with a -wal that holds commits: why no copy of it could be read
    no_copy: str | None = None
    #: `upgraded copy`: the file's own revision
    upgraded_from: str | None = None

    SHARED = "shared"
    AT_REST = "at rest"
    IMMUTABLE = "immutable"
    COPY = "copy"
    UPGRADED = "upgraded copy"

    @property
    def immutable(self) -> bool:
        return self.mode in (self.AT_REST, self.IMMUTABLE)

    def unchanged(self) -> bool:
        """Whether the file is as it was when opened (always true for `shared`, whose reads
        are isolated by SQLite's own locks)."""
        return self.stamp is None or _file_stamp(self.path) == self.stamp

    @property
    def wal_unread(self) -> bool:
        """Commits in the `-wal` were left out: what was read may be an older campaign, or
        none at all (a campaign whose every commit is still in its -wal)."""
        return self.mode == self.IMMUTABLE and self.wal_bytes > _WAL_HEADER_BYTES

    def note(self) -> str | None:
        if self.mode == self.UPGRADED:
            return (f"read from an upgraded copy of revision {self.upgraded_from} in TMPDIR "
                    f"({self.copied_to}); the file itself was not changed (`coordinator db "
                    f"upgrade --db {self.named or self.path}` brings it forward)")
        if self.mode == self.COPY:
            return (f"read from a copy in {self.copied_to}: SQLite cannot create "
                    f"{self.path.name}-shm beside it (read-only directory or medium), and "
                    f"reads the {self.wal_bytes} bytes of its -wal only through one")
        if self.mode != self.IMMUTABLE:
            return None
        unseen = f"; {self.unread_wal()}" if self.wal_unread else ""
        return (f"opened as immutable: SQLite cannot create {self.path.name}-shm beside it "
                f"(read-only directory or medium), so the view may be stale if a master is "
                f"live{unseen}")


    def unread_wal(self) -> str:
        """What was left out, why, and what to do about it."""
        name = self.named or self.path
        need = self.wal_bytes + (_file_stamp(self.path) or (0, 0, 0))[2]
        return (f"the {self.wal_bytes} bytes of its -wal (commits not yet copied into the "
                f"file) are not read: no copy could be made in TMPDIR "
                f"({tempfile.gettempdir()}: {self.no_copy or 'unknown why'}); point TMPDIR at "
                f"a directory with {need} bytes free, or copy {name} and {name}-wal to a "
                f"writable directory and read the copy")


def _file_stamp(path: Path) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def readonly_connector(path: str | os.PathLike[str], *, at_rest: bool = True
                       ) -> tuple[Callable[[], sqlite3.Connection], ReadOnlyView]:
    """A function that opens the SQLite file at `path` for reading only, and how it does.

    It never writes: a `mode=ro` URI, `PRAGMA query_only`, no persistent pragma. A missing
    path, a directory, an empty file or one that is not SQLite is refused with one line, and
    nothing is created beside it. `at_rest=False` refuses the immutable reading of a WAL file
    nobody has open (a caller whose first read found it changed reads it again as
    `shared`)."""
    check_sqlite_version()
    db_path = Path(path).absolute()
    refuse_aliases(db_path)  # a second name's -wal would be read as this one's
    if db_path.is_dir():
        raise DatabaseOpenError(f"{db_path} is a directory; --db names the campaign's "
                                f"database file")
    if not db_path.exists():
        where = "" if db_path.parent.is_dir() else f": {no_directory(db_path.parent)}"
        raise DatabaseOpenError(f"{db_path} does not exist{where} (nothing was created)")
    if not db_path.is_file():
        raise DatabaseOpenError(f"{db_path} is not a regular file (a campaign is a file on a "
                                f"node-local disk)")
    # SQLite keeps -wal and -shm beside the file a symbolic link names.
    real = Path(os.path.realpath(db_path))
    stamp = _file_stamp(real)
    try:
        with open(real, "rb") as f:
            header = f.read(100)
    except OSError as e:
        raise DatabaseOpenError(f"{db_path} cannot be read: {e.strerror}") from None
    if not header:
        raise NoCampaignYet(db_path, " (an empty file)")
    wal = (header.startswith(_SQLITE_MAGIC) and len(header) > _READ_VERSION_AT
           and header[_READ_VERSION_AT] == 2)
    wal_file = real.with_name(real.name + "-wal")
    wal_bytes = wal_file.stat().st_size if wal_file.exists() else 0
    mode = ReadOnlyView.AT_REST if wal and at_rest and not wal_file.exists() \
        else ReadOnlyView.SHARED
    connect = _connector(db_path, immutable=mode == ReadOnlyView.AT_REST)
    try:
        connect().close()
    except sqlite3.Error as e:
        code = getattr(e, "sqlite_errorcode", 0) & 0xFF
        # (Before the fallbacks below: a copy in TMPDIR, at a short path, opened, and was
        # said to be needed because the directory was read-only.)
        if code == 14 and (too_long := path_too_long(db_path)) is not None:
            raise too_long from None
        # SQLITE_CANTOPEN / SQLITE_READONLY: the -shm a WAL reader shares cannot be made.
        if not (wal and mode == ReadOnlyView.SHARED and code in (8, 14)):
            raise cannot_open(db_path, e) from e
        no_copy = None
        if wal_bytes > _WAL_HEADER_BYTES:  # (a header alone holds no commit)
            copied = _read_a_copy(db_path, real, wal_file)
            if not isinstance(copied, str):
                return copied
            no_copy = copied
        mode = ReadOnlyView.IMMUTABLE
        connect = _connector(db_path, immutable=True)
        try:
            connect().close()
        except sqlite3.Error as e2:
            raise cannot_open(db_path, e2) from e2
        return connect, ReadOnlyView(real, mode, wal_bytes, None, db_path, no_copy=no_copy)
    return connect, ReadOnlyView(real, mode, wal_bytes,
                                 stamp if mode == ReadOnlyView.AT_REST else None, db_path)


#: A -wal's header: a -wal no longer than it holds no frame.
_WAL_HEADER_BYTES = 32
_COPY_PREFIX = "coordinator-read-"


def _read_a_copy(db_path: Path, real: Path, wal_file: Path
                 ) -> tuple[Callable[[], sqlite3.Connection], ReadOnlyView] | str:
    """A WAL file and its `-wal` where no `-shm` can be made, read from a copy of both in a
    temporary directory, where SQLite makes one (`ReadOnlyView.COPY`); why not, if no copy
    can be made there (the caller reads the file as immutable, and says what it leaves out).
    The directory goes at exit; one whose process was killed first, at the next copy."""
    tmp = Path(tempfile.gettempdir())
    _remove_orphaned_copies(tmp)
    try:
        where = Path(tempfile.mkdtemp(prefix=f"{_COPY_PREFIX}{os.getpid()}-", dir=tmp))
    except OSError as e:
        return e.strerror or str(e)
    atexit.register(shutil.rmtree, where, True)
    copy = where / real.name
    try:
        shutil.copyfile(real, copy)
        shutil.copyfile(wal_file, copy.with_name(copy.name + "-wal"))
        connect = _connector(copy, immutable=False)
        connect().close()
    except OSError as e:
        shutil.rmtree(where, ignore_errors=True)
        return e.strerror or str(e)
    except sqlite3.Error as e:
        shutil.rmtree(where, ignore_errors=True)
        return f"the copy could not be opened: {e}"
    wal_bytes = copy.with_name(copy.name + "-wal").stat().st_size
    return connect, ReadOnlyView(real, ReadOnlyView.COPY, wal_bytes, None, db_path, where)


def _remove_orphaned_copies(tmp: Path) -> None:
    for d in tmp.glob(_COPY_PREFIX + "*"):
        try:
            pid = int(d.name[len(_COPY_PREFIX):].split("-", 1)[0])
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (OSError, ValueError):
            continue  # not ours to judge: another user's, or a name we did not make


def _connector(db_path: Path, *, immutable: bool) -> Callable[[], sqlite3.Connection]:
    # Quoted: the path is part of a URI, where "?", "#" and "%" mean something.
    # Its bytes, quoted: a directory name that is not UTF-8 has no str to quote.
    uri = f"file:{quote(os.fsencode(db_path))}?mode=ro" + ("&immutable=1" if immutable else "")

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA query_only = ON")
            conn.execute(f"PRAGMA busy_timeout = {READ_BUSY_TIMEOUT_MS}")
            # The first read opens the WAL index: a file that cannot be shared, or is no
            # database, fails here rather than in the caller's first transaction.
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except BaseException:
            conn.close()
            raise
        return conn
    return connect


def quick_check(path: Path) -> list[str]:
    """What SQLite's `quick_check` finds wrong in every page of the file ([] when nothing),
    on a connection of its own: read-only, it took a third of the time one that may write
    did (0.08 s against 0.24 s for 17 MB)."""
    conn = _connector(Path(path).absolute(), immutable=False)()
    try:
        rows = [row[0] for row in conn.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as e:
        if not is_corrupt(e):
            raise
        return [str(e)]
    finally:
        conn.close()
    return [] if rows == ["ok"] else rows


def is_corrupt(e: BaseException) -> bool:
    """SQLITE_CORRUPT (11) or SQLITE_NOTADB (26) met on a file that opened: damaged pages
    (26 when the damage is in a page's header or the file's own)."""
    e = getattr(e, "orig", None) or e
    if not isinstance(e, sqlite3.DatabaseError):
        return False
    code = getattr(e, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (11, 26)
    return "malformed" in str(e) or "not a database" in str(e)


def is_schema_changed(e: BaseException) -> bool:
    """A table, index, view or column the code's revision defines is not in the file: the
    schema was changed outside the coordinator (a `DROP INDEX` in a `sqlite3` shell)."""
    return isinstance(e, sqlite3.OperationalError) and str(e).startswith(
        ("no such table", "no such index", "no such column", "no such view"))


def schema_changed(path: Path, e: BaseException) -> DatabaseOpenError:
    """What such a file becomes for a command or a start: said, with what to do (a traceback
    before, and a start said to fix the storage)."""
    return DatabaseOpenError(
        f"{path}: its schema is not the one its revision defines ({e}): it was changed outside "
        f"the coordinator: {restore_hint(path)}, or recreate what is missing as "
        f"docs/sqlite.md's schema shows (`sqlite3 {path} .schema` shows what the file has)")


def damaged(path: Path, e: BaseException) -> DamagedDatabaseError:
    """What a damaged page met by a command, a start or a master's round becomes: it says
    so, and what to do (`engine` and `read_file` raise it, `engine.write_tx` too)."""
    return DamagedDatabaseError(path, getattr(e, "orig", None) or e)


def no_directory(directory: Path) -> str:
    """Why a file cannot be made in `directory`, which is not one: `txt.db/x.db` was said to
    be in "the directory txt.db", which "does not exist", while txt.db was a regular file."""
    if directory.exists():
        return f"{directory} is not a directory"
    return f"the directory {directory} does not exist"


def cannot_open(path: Path, e: BaseException) -> DatabaseOpenError:
    cause = getattr(e, "orig", None) or e
    if path.is_dir():
        why = "is a directory; --db names the campaign's database file"
    elif not path.parent.is_dir():
        why = f"cannot be created: {no_directory(path.parent)}"
    elif isinstance(cause, sqlite3.DatabaseError) and "not a database" in str(cause):
        why = "is not an SQLite database (some other kind of file, or a damaged one)"
    elif (too_long := path_too_long(path)) is not None:
        return too_long
    else:
        why = f"cannot be opened: {cause}"
    return DatabaseOpenError(f"{path} {why}")


#: SQLite's unix VFS as built by default (SQLITE_MAX_PATHNAME): it resolves a path's symbolic
#: links one component at a time in a buffer of this many bytes (and a NUL), and opens no
#: file whose resolved path leaves fewer than 8 of them for a journal's name beside it, i.e.
#: longer than 504. A longer one failed with "unable to open database file" alone.
SQLITE_MAX_PATHNAME = 512
SQLITE_MAX_PATH_BYTES = SQLITE_MAX_PATHNAME - 8


def path_too_long(path: str | os.PathLike[str]) -> DatabaseOpenError | None:
    """The refusal of a path SQLite would not open for its length, or None. It is measured
    as SQLite measures it: a long name linking to a file at a short path opens, a short one
    through a link to a long directory does not."""
    given = os.fsencode(Path(path).absolute())
    try:
        resolved = _resolved_as_sqlite_does(given)
    except _TooLong:
        return DatabaseOpenError(
            f"{path}: the path is too long for SQLite ({len(given)} bytes, of which it takes "
            f"at most {SQLITE_MAX_PATHNAME - 1} before it resolves the symbolic links in it): "
            f"name the file by a shorter path")
    except OSError:
        return None  # (not for its length: SQLite says what it is)
    if len(resolved) <= SQLITE_MAX_PATH_BYTES:
        return None
    how = "" if resolved == given else " with its links resolved"
    return DatabaseOpenError(
        f"{path}: the path is too long for SQLite ({len(resolved)} bytes{how}; it opens at "
        f"most {SQLITE_MAX_PATH_BYTES}): put the campaign in a directory with a shorter path "
        f"(a shorter symbolic link to it does not help: SQLite opens the file by its resolved "
        f"path)")


class _TooLong(Exception):
    pass


def _resolved_as_sqlite_does(path: bytes) -> bytes:
    """`path` (absolute) resolved as the unix VFS's unixFullPathname does: component by
    component, a link's target replacing it as it comes; _TooLong where its buffer would
    overflow."""
    out = b""
    links = 0

    def walk(p: bytes) -> None:
        nonlocal out, links
        for name in p.split(b"/"):
            if name in (b"", b"."):
                continue
            if name == b"..":
                out = out[:out.rfind(b"/")] if b"/" in out else b""
                continue
            if len(out) + len(name) + 2 >= SQLITE_MAX_PATHNAME + 1:
                raise _TooLong
            out += b"/" + name
            if os.path.islink(out):
                links += 1
                if links > 100:  # (a loop: SQLite refuses it for that, not for its length)
                    raise OSError("too many links")
                target = os.readlink(out)
                out = b"" if target.startswith(b"/") else out[:out.rfind(b"/")]
                walk(target)

    walk(path)
    return out or b"/"


# -- one consistent reading ------------------------------------------------------------------

#: Brings the campaign file at a path to the code's head revision (`versioning.upgrade`,
#: which this module cannot import: it reads files through this one).
Upgrade = Callable[[Path], object]


def read_consistently(path: str | os.PathLike[str],
                      read: Callable[[Callable[[], sqlite3.Connection], ReadOnlyView], T],
                      errors: tuple[type[BaseException], ...] = (),
                      upgrade: Upgrade | None = None) -> tuple[T, ReadOnlyView]:
    """`read(connect, view)` on the file at `path`, opened by `readonly_connector`, and how
    it was opened. A WAL file that no connection had open is read without creating
    `-wal`/`-shm` beside it; if something wrote it meanwhile (a master that started), it is
    read again as an ordinary reader, whose view SQLite keeps consistent. `errors` are the
    caller's own exceptions for a failed read (which a torn reading may also raise).

    With `upgrade`, a campaign that `read` refuses for an older schema revision is read
    again from a copy in TMPDIR that `upgrade` brought to the head (`ReadOnlyView.UPGRADED`),
    the file itself left as it is; if no such copy can be made, the refusal says why."""
    for at_rest in (True, False):
        connect, view = readonly_connector(path, at_rest=at_rest)
        try:
            got = read(connect, view)
        except StoreError as e:
            if not view.unchanged():
                continue
            if upgrade is not None and _older_revision(e) and not view.wal_unread:
                assert isinstance(e, SchemaVersionError)
                connect, upgraded = _upgraded_copy(connect, view, e, upgrade)
                if not view.unchanged():
                    continue  # copied while something wrote it: copied again, as it is now
                return read(connect, upgraded), upgraded
            if view.wal_unread:
                # What refused it may be only what the -wal was not read for: a campaign
                # whose every commit is still there was said to hold none.
                raise _without_its_wal(e, view) from e
            raise
        except (sqlite3.Error, *errors):
            if view.unchanged():
                raise
            continue
        if view.unchanged():
            return got, view
    raise AssertionError("not reached: the second reading is not at rest")


def _older_revision(e: StoreError) -> bool:
    """A refusal of a campaign at an older revision than the code's (one the migrations do
    not know is refused by `upgrade`, and said)."""
    return (isinstance(e, SchemaVersionError) and not e.newer and not e.unknown
            and e.found is not None)


def _upgraded_copy(connect: Callable[[], sqlite3.Connection], view: ReadOnlyView,
                   refused: SchemaVersionError, upgrade: Upgrade
                   ) -> tuple[Callable[[], sqlite3.Connection], ReadOnlyView]:
    """What `connect` reads of an older campaign, copied to a temporary directory (SQLite's
    backup: one consistent snapshot, the `-wal`'s commits in it, whatever the view) and
    brought to the head there by `upgrade`; the copy's reader, and its view. Raises
    `refused`, saying why, if that cannot be done."""
    tmp = Path(tempfile.gettempdir())
    _remove_orphaned_copies(tmp)
    where = None
    try:
        where = Path(tempfile.mkdtemp(prefix=f"{_COPY_PREFIX}{os.getpid()}-", dir=tmp))
        atexit.register(shutil.rmtree, where, True)
        copy = where / view.path.name
        source = connect()
        try:
            with contextlib.closing(sqlite3.connect(copy)) as target:
                source.backup(target)
        finally:
            source.close()
        upgrade(copy)
        reader = _connector(copy, immutable=False)
        reader().close()
    except (OSError, sqlite3.Error, StoreError) as e:
        if where is not None:
            shutil.rmtree(where, ignore_errors=True)
        why = getattr(e, "strerror", None) or str(e)
        refused.args = (f"{refused}; no upgraded copy could be read in TMPDIR ({tmp}: {why})",)
        raise refused from e
    return reader, ReadOnlyView(view.path, ReadOnlyView.UPGRADED, view.wal_bytes, None,
                                view.named, where, upgraded_from=refused.found)


def _without_its_wal(e: StoreError, view: ReadOnlyView) -> StoreError:
    """A refusal made from a view that left the `-wal` out, saying so."""
    name = view.named or view.path
    if isinstance(e, NoCampaignYet):
        return UnreadWalError(
            f"{name}: the file holds no campaign without its -wal, which may hold all of it: "
            f"{view.unread_wal()}")
    # (Its own class, so that what catches it still does: the text alone says more.)
    e.args = (f"{e}; and {view.unread_wal()}",)
    return e


def read_file(path: str | os.PathLike[str], read: Callable[[Reader], T],
              upgrade: Upgrade | None = None) -> tuple[T, ReadOnlyView]:
    """`read(reader)` in one read transaction, as `engine.read_file` does, without SQLAlchemy:
    for the readers written in plain SQL (`stats`, `observe`), which a `Reader` answers.
    `upgrade`: an older campaign is read from an upgraded copy (`read_consistently`)."""
    def once(connect: Callable[[], sqlite3.Connection], view: ReadOnlyView) -> T:
        conn = connect()
        try:
            conn.execute("BEGIN")
            try:
                return read(Reader(conn, view.named or view.path))
            except sqlite3.DatabaseError as e:
                if is_corrupt(e):
                    raise damaged(view.named or view.path, e) from None
                if is_schema_changed(e):
                    raise schema_changed(view.named or view.path, e) from None
                raise
            finally:
                conn.rollback()  # it read; nothing to commit
        finally:
            conn.close()
    return read_consistently(path, once, upgrade=upgrade)


class Rows:
    """A statement's rows, taken the ways the store's readers take a SQLAlchemy result."""

    __slots__ = ("_cursor",)

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self._cursor = cursor

    def __iter__(self) -> Iterator[Any]:
        return iter(self._cursor)

    def all(self) -> list[Any]:
        return self._cursor.fetchall()

    def first(self) -> Any:
        return self._cursor.fetchone()

    def one(self) -> Any:
        rows = self._cursor.fetchmany(2)
        if len(rows) != 1:
            raise LookupError(f"{len(rows) or 'no'} rows where exactly one was expected")
        return rows[0]

    def scalar(self) -> Any:
        row = self._cursor.fetchone()
        return None if row is None else row[0]

    def scalar_one(self) -> Any:
        return self.one()[0]


class Reader:
    """A read-only sqlite3 connection offering the one method of a SQLAlchemy connection
    that the plain-SQL readers call, `exec_driver_sql` (parameters as a sequence for `?`, a
    mapping for `:name`), and the file's path for messages."""

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self.path = path

    def exec_driver_sql(self, sql: str, params: Any = ()) -> Rows:
        return Rows(self._conn.execute(sql, params))
