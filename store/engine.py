"""The one engine factory: every pragma set in one place, each with its reason, and our own BEGIN.

Only rank 0 opens the database. Pragmas are per connection, so they are set in a `connect`
listener; pysqlite's own transaction handling is switched off so that the `begin` listener can
emit `BEGIN IMMEDIATE` (SQLAlchemy's documented pysqlite recipe): a write transaction takes the
write lock at its start, so it can never fail half-way with SQLITE_BUSY on lock upgrade.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from sqlalchemy import URL, Connection, Engine, create_engine, event, exc

from .errors import (
    NoCampaignYet,
    StoreWriteError,
    UnsafeDatabaseError,
)
from .lock import refuse_read_only
from .readonly import (
    ReadOnlyView,
    Upgrade,
    cannot_open,
    check_sqlite_version,
    damaged,
    is_corrupt,
    is_schema_changed,
    read_consistently,
    readonly_connector,
    schema_changed,
)

T = TypeVar("T")

#: FULL: every acknowledged commit survives a power loss (measured: NORMAL lost up to 19
#: acknowledged transactions in 65 of 80 simulated power losses; FULL lost none). NORMAL is
#: about 5x more commits per second and still never corrupts; a power loss can then undo the
#: last few dispatches and results, which restart recovery re-runs (duplicated CPU, no loss).
SYNCHRONOUS_MODES = ("FULL", "NORMAL")
DEFAULT_SYNCHRONOUS = "FULL"

#: Wait this long for the write lock held by another writer (`coordinator requeue`, a `sqlite3`
#: shell in a write transaction) or a checkpoint, instead of failing the write at once. WAL
#: readers (`coordinator status`) never block it.
BUSY_TIMEOUT_MS = 10_000
#: The master's wait, per attempt: it tries again until its `lock_wait_s`, and between
#: attempts keeps its run going (answers received, a line said once a minute).
MASTER_BUSY_TIMEOUT_MS = 1_000

#: Bytes of WAL file kept after a checkpoint resets it (SQLite's default keeps it all).
JOURNAL_SIZE_LIMIT = 64 << 20

#: Set in a connection's `info` for a read-only transaction on the write engine: a plain
#: BEGIN, which takes no lock until it reads (and WAL readers never wait for the writer).
DEFERRED_BEGIN = "coordinator.deferred_begin"
WRITING = "coordinator.writing"  # inside write_tx
#: Set in a connection's `info` by a reader that reports damage itself (the audit): driver
#: errors reach it as they are.
RAW_ERRORS = "coordinator.raw_errors"

#: WAL relies on shared memory and POSIX locks that these filesystems do not provide reliably.
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "9p", "fuse.sshfs", "beegfs", "ceph"}
)


def filesystem_type(path: Path) -> str | None:
    """The filesystem type of the mount holding `path`, from /proc/mounts (None if unknown)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount_point = fields[1].replace("\\040", " ")
        prefix = mount_point.rstrip("/") + "/"
        if (target == mount_point or target.startswith(prefix)) and len(mount_point) > len(best):
            best, best_type = mount_point, fields[2]
    return best_type


def _why_no_wal(db_path: Path, e: sqlite3.OperationalError) -> str:
    """The likely cause of a failed switch to WAL mode, by what SQLite said and what the
    filesystem has left."""
    if is_busy(e):
        return ("another process has the file open in a transaction (a `sqlite3` shell?), and "
                "the switch needs it alone: end that transaction, then start again")
    try:
        fs = os.statvfs(db_path.parent)
    except OSError:
        fs = None
    if fs is not None and fs.f_bavail * fs.f_frsize < (1 << 20):
        return (f"the filesystem holding it is full ({fs.f_bavail * fs.f_frsize} bytes free): "
                f"free some space, then start again")
    return ("the file or its directory is probably read-only. Use a writable node-local "
            "path.")


def refuse_empty_file(path: Path) -> None:
    """For commands that only look at (or maintain) an existing campaign: opening an empty
    file, as a start that failed early or a `touch` leaves, would write an SQLite header
    into it."""
    if path.is_file() and path.stat().st_size == 0:
        raise NoCampaignYet(path, " (an empty file)")


def open_engine(path: str | os.PathLike[str], *, synchronous: str = DEFAULT_SYNCHRONOUS,
                write: bool = True, busy_timeout_ms: int | None = None) -> Engine:
    """An engine on the SQLite file at `path`, verified safe to run the protocol on.

    `write=False` gives an engine whose transactions start with a deferred `BEGIN`, for
    inspection commands that must not take the write lock while a master runs.
    """
    check_sqlite_version()
    synchronous = synchronous.upper()
    if synchronous not in SYNCHRONOUS_MODES:
        raise ValueError(f"synchronous must be one of {SYNCHRONOUS_MODES}, not {synchronous!r}")
    db_path = Path(path).absolute()
    if not write:
        refuse_empty_file(db_path)
    # Where the file really is: SQLite follows a link to it and keeps its -wal and -shm there
    # (a `campaign.db -> /lustre/...` link passed a check of the link's own directory).
    fstype = filesystem_type(Path(os.path.realpath(db_path)).parent)
    if fstype in NETWORK_FILESYSTEMS:
        raise UnsafeDatabaseError(
            f"{db_path} is on a {fstype} filesystem; SQLite WAL needs a node-local filesystem "
            f"(put the campaign database on local disk, e.g. under /tmp or the node's scratch)"
        )
    if write:
        refuse_read_only(db_path)
    # The default pool keeps the connection open between transactions: opening one costs a
    # file open plus the pragmas above, too much for every round of the master. Only the
    # master process ever opens the database, and it never forks with it open.
    # URL.create, not "sqlite:///" + path: a path is no URL ("c?mode=ro.db" opened "c", and
    # "p%41.db" opened "pA.db", each beside a lock file of the name given).
    engine = create_engine(URL.create("sqlite", database=str(db_path)))

    @event.listens_for(engine, "connect")
    def _set_pragmas(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (see module docstring)
        cur = dbapi_conn.cursor()
        try:
            wait_ms = BUSY_TIMEOUT_MS if busy_timeout_ms is None else busy_timeout_ms
            cur.execute(f"PRAGMA busy_timeout = {int(wait_ms)}")
            # Leases are owned by their dispatch and removed with it (ON DELETE CASCADE).
            cur.execute("PRAGMA foreign_keys = ON")
            try:
                mode = cur.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            except sqlite3.OperationalError as e:
                raise UnsafeDatabaseError(
                    f"{db_path}: cannot switch the database to WAL mode ({e}); "
                    + _why_no_wal(db_path, e)) from e
            if str(mode).lower() != "wal":
                raise UnsafeDatabaseError(
                    f"{db_path}: SQLite refused WAL mode (journal_mode is {mode!r}); the file is "
                    f"probably on a network or read-only filesystem. Use a node-local path."
                )
            cur.execute(f"PRAGMA synchronous = {synchronous}")
            # A large import grows the WAL to its size (348 MB for a million tasks), and
            # SQLite keeps the file that large for ever unless told to truncate it.
            cur.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
        finally:
            cur.close()

    begin_sql = "BEGIN IMMEDIATE" if write else "BEGIN"

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # Straight to the driver: through exec_driver_sql this one statement costs a sizeable
        # share of a master round at synchronous=NORMAL.
        conn.connection.driver_connection.execute(
            "BEGIN" if conn.info.get(DEFERRED_BEGIN) else begin_sql)

    _name_damage(engine, db_path)

    # Connect now, so that a path that cannot be a database fails here with a message that
    # says why, not later inside the caller's first transaction as a driver traceback.
    try:
        with engine.connect():
            pass
    except (exc.DBAPIError, sqlite3.Error) as e:
        engine.dispose()
        raise cannot_open(db_path, e) from e
    except BaseException:
        engine.dispose()
        raise
    return engine


def _name_damage(engine: Engine, db_path: Path) -> None:
    """A damaged page read by `status`, `check`, `requeue`, `db upgrade` or a start raises a
    driver error: it becomes a DamagedDatabaseError that says so and what to do (inside a
    write transaction `write_tx` does the same); a file that is no database at all is said
    so by `cannot_open`."""
    @event.listens_for(engine, "handle_error")
    def _damaged(ctx: exc.ExceptionContext) -> None:
        if ctx.connection is None:
            return  # opening it: a file that is no database (NOTADB) is `cannot_open`'s
        info = ctx.connection.info
        if is_corrupt(ctx.original_exception) and not (info.get(WRITING)
                                                        or info.get(RAW_ERRORS)):
            raise damaged(db_path, ctx.original_exception) from None
        if is_schema_changed(ctx.original_exception):  # (a master's write too: exit 2, not 3)
            raise schema_changed(db_path, ctx.original_exception) from None


def read_pragmas(conn: Connection) -> dict[str, object]:
    """The pragmas actually in force on `conn` (tests read them back)."""
    names = ("journal_mode", "synchronous", "foreign_keys", "busy_timeout", "journal_size_limit")
    return {n: conn.exec_driver_sql(f"PRAGMA {n}").scalar() for n in names}


@contextlib.contextmanager
def read_tx(conn: Connection) -> Iterator[Connection]:
    """A read transaction on a connection of a writing engine: a plain BEGIN, so that it never
    waits for the write lock (held by a master's round, `coordinator requeue` or a `sqlite3`
    shell) as a write would."""
    conn.info[DEFERRED_BEGIN] = True
    try:
        with conn.begin():
            yield conn
    finally:
        conn.info[DEFERRED_BEGIN] = False


def is_busy(e: BaseException) -> bool:
    """SQLITE_BUSY: another connection holds the lock (nothing was written)."""
    e = getattr(e, "orig", None) or e
    code = getattr(e, "sqlite_errorcode", None)  # Python 3.11+
    return (code & 0xFF == 5 if code is not None else
            isinstance(e, sqlite3.OperationalError) and "database is locked" in str(e))


def write_lock_holders(path: str | os.PathLike[str]) -> list[int]:
    """The processes on this host holding the campaign's write lock now: in WAL mode, a POSIX
    write lock on byte 120 of the `-shm` file (SQLite's WAL_WRITE_LOCK), as /proc/locks lists
    them. [] if none, or no /proc."""
    try:
        st = os.stat(f"{os.path.realpath(path)}-shm")
        table = Path("/proc/locks").read_text()
    except OSError:
        return []
    ours = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in table.splitlines():
        f = line.split()
        if len(f) >= 8 and f[1] == "POSIX" and f[3] == "WRITE" and f[5] == ours \
                and f[6] == "120" and f[4].isdigit():
            pids.append(int(f[4]))
    return sorted(set(pids))


@contextlib.contextmanager
def write_tx(conn: Connection, operation: str, *, lock_wait_s: float = 0.0,
             on_wait: Callable[[float], None] | None = None) -> Iterator[Connection]:
    """One write transaction on `conn`; a driver failure becomes `StoreWriteError` (outcome
    unknown). While another process holds the write lock, BEGIN IMMEDIATE is tried again
    (each try waits the connection's busy timeout) until `lock_wait_s` has passed, with
    `on_wait(seconds waited)` between tries: a failed BEGIN wrote nothing."""
    conn.info[WRITING] = True
    try:
        began = time.monotonic()
        while True:
            try:
                transaction = conn.begin()
                break
            except (exc.DBAPIError, sqlite3.Error) as e:
                waited = time.monotonic() - began
                if not is_busy(e) or waited >= lock_wait_s:
                    raise
                if on_wait is not None:
                    on_wait(waited)
        with transaction:
            yield conn
    except (exc.DBAPIError, sqlite3.Error) as e:
        if isinstance(e, exc.IntegrityError):
            raise  # an invariant the schema enforces: a bug, not a storage fault
        if isinstance(e, sqlite3.IntegrityError):
            raise
        cause = getattr(e, "orig", None) or e
        if is_schema_changed(cause):  # not the storage failing: nothing was written
            raise schema_changed(Path(conn.engine.url.database or ""), cause) from e
        if is_corrupt(cause):
            # Not a failure that passes: the next transaction meets the same page, so the
            # run must stop writing, and a --resume would only meet it again.
            raise damaged(Path(conn.engine.url.database or ""), cause) from e
        raise StoreWriteError(operation, cause) from e
    finally:
        conn.info[WRITING] = False


# -- read-only opening -----------------------------------------------------------------------

_VIEWS: weakref.WeakKeyDictionary[Engine, ReadOnlyView] = weakref.WeakKeyDictionary()


def readonly_view(engine: Engine) -> ReadOnlyView:
    """How `open_readonly` opened `engine` (KeyError for another engine)."""
    return _VIEWS[engine]


def open_readonly(path: str | os.PathLike[str], *, at_rest: bool = True) -> Engine:
    """An engine that only reads the SQLite file at `path`, for audits and inspection
    (`readonly.readonly_connector` says how it is opened, and what is refused);
    `readonly_view(engine)` tells how it was."""
    return _readonly_engine(*readonly_connector(path, at_rest=at_rest))


def _readonly_engine(connect: Callable[[], sqlite3.Connection], view: ReadOnlyView) -> Engine:
    # The URL only names the file (for messages); `connect` opens it.
    engine = create_engine(URL.create("sqlite", database=str(view.named)), creator=connect)

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.connection.driver_connection.execute("BEGIN")

    _name_damage(engine, view.named)
    _VIEWS[engine] = view
    return engine


def read_file(path: str | os.PathLike[str], read: Callable[[Connection], T],
              upgrade: Upgrade | None = None) -> tuple[T, ReadOnlyView]:
    """`read(conn)` in one read transaction on the file at `path`, opened with
    `open_readonly`, and how it was opened (`readonly.read_consistently`: a WAL file at rest
    is read without creating anything beside it, and again if it changed meanwhile; with
    `upgrade` (`versioning.upgrade`), an older campaign from a copy upgraded in TMPDIR)."""
    def once(connect: Callable[[], sqlite3.Connection], view: ReadOnlyView) -> T:
        engine = _readonly_engine(connect, view)
        try:
            with engine.connect() as conn:
                conn.begin()
                try:
                    return read(conn)
                finally:
                    conn.rollback()  # it read; nothing to commit (a COMMIT of a read
                    # transaction on a damaged file raises "malformed")
        finally:
            engine.dispose()
    return read_consistently(path, once, errors=(exc.DBAPIError,), upgrade=upgrade)
