"""Opening a campaign: schema check, incarnations, the token epoch, and restart recovery.

`Store.open` is the master's way in (`Store.attach` serves `coordinator requeue`). It refuses
a file with a foreign schema revision, refuses an existing campaign unless asked to resume (or
a resume its settings check refuses), and on resume performs restart recovery (R9) as one
transaction: dispatches left by the dead incarnation go back to the queue head, then the
deferred tasks that can still run are reclaimed in front of them, before any new input.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, inspect, select, update

from . import engine as engine_module
from . import tasks as task_ops
from .dispatches import requeue_in_flight
from .engine import (
    DEFAULT_SYNCHRONOUS,
    open_engine,
    read_tx,
    refuse_empty_file,
    write_tx,
)
from .errors import (
    CampaignExistsError,
    DamagedDatabaseError,
    NewCampaignNotMade,
    NoCampaignYet,
    StoreError,
    StoreWriteError,
)
from .journal import QuarantineSampler, RetryPolicy, Tx
from .lock import SIDE_FILES, lock_campaign, lost_name, release_campaign
from .observe import CommitTimes
from .probe import probe
from .readonly import quick_check
from .revisions import check_revision, current_revision
from .schema import EventKind, campaign, tasks
from .versioning import head_revision, upgrade
from .workers import forget_incarnation, where_ranks_ran

#: A start reads every page of a campaign file up to this size (file and -wal), SQLite's
#: `quick_check`: 0.08 s for 17 MB here, but 1.6 s for a million tasks (407 MB), which a
#: start's budget (< 1 s) cannot take. A damaged page is otherwise met only where a round
#: reads it, after the start has charged what it rolled back.
START_CHECK_BYTES = 16 << 20


@dataclass(frozen=True)
class ResumeReport:
    interrupted: list[int] = field(default_factory=list)  # requeued from a dead incarnation
    reclaimed: list[int] = field(default_factory=list)    # deferred, admitted again
    refused: list[int] = field(default_factory=list)      # deferred, input gone: still deferred


class Store:
    """The campaign database as the master uses it. Only rank 0 ever opens one."""

    def __init__(self, path: Path, engine: Engine, incarnation: int, epoch: str,
                 policy: RetryPolicy, resume_report: ResumeReport,
                 clock: Callable[[], float] = time.time, bitmap_version: int = 0,
                 lock_wait_s: float = 0.0, on_lock_wait: Callable[[float], None] | None = None):
        self.path, self.engine, self.incarnation, self.epoch = path, engine, incarnation, epoch
        #: How long a write waits for a lock another process holds, and what it does between
        #: tries (`engine.write_tx`).
        self.lock_wait_s, self.on_lock_wait = lock_wait_s, on_lock_wait
        self.quarantine_sampler = QuarantineSampler()
        self.policy, self.resume_report, self.clock = policy, resume_report, clock
        self.commit_times = CommitTimes()
        #: The master's current coverage-bitmap version (READY versions above it are future).
        self.bitmap_version = bitmap_version
        self._conn: Connection | None = None
        self._lock_fd: int | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, resume: bool = False,
             policy: RetryPolicy | None = None, synchronous: str = DEFAULT_SYNCHRONOUS,
             available: Callable[[Mapping[str, Any]], bool] = task_ops.input_available,
             clock: Callable[[], float] = time.time, note: str | None = None,
             settings: Mapping[str, Any] | None = None,
             check_settings: Callable[[Mapping[str, Any] | None],
                                      Mapping[str, Any] | None] | None = None,
             lock_wait_s: float = 0.0,
             on_lock_wait: Callable[[float], None] | None = None,
             ranks: int | None = None,
             ) -> Store:
        """Open (creating if new) and start a new incarnation (of a job of `ranks` ranks, the
        master's included, if given: rows of ranks past them are dropped at a resume).

        `settings` (JSON-able) are stored with a new campaign; on resume the stored ones go to
        `check_settings`, whose exception refuses the start before anything is written, and
        which returns the settings this start changes (written over the stored ones, in the
        start's transaction), if any. A campaign without them (from before revision 0004, or
        unreadable: None to the check) takes this start's.

        Raises SchemaVersionError for an older or newer schema, CampaignExistsError for an
        existing campaign without `resume`, UnsafeDatabaseError if WAL cannot be used,
        DatabaseOpenError for a path that cannot hold a campaign, CampaignLockedError while
        another master runs on it. A write lock another process holds (a `sqlite3` shell, a
        backup) is waited for up to `lock_wait_s`, `on_lock_wait(seconds)` between tries.
        """
        path = Path(path)
        policy = policy or RetryPolicy()
        # Read first: a file that is not a campaign (another program's database, a damaged
        # one, a second name of one) is refused before anything writes it; opening it for
        # writing would already switch it to WAL mode for good.
        new = not probe(path, current=False).exists
        lock_fd = lock_campaign(path)  # the file's own lock (it creates a new file, empty)
        engine = None
        try:
            engine = open_engine(path, synchronous=synchronous,
                                 busy_timeout_ms=engine_module.MASTER_BUSY_TIMEOUT_MS)
            # Reads in a plain BEGIN: a write lock held elsewhere (a `sqlite3` shell) is waited
            # for by the incarnation's write below, which says so, not by a read.
            with engine.connect() as conn, read_tx(conn):
                fresh = _no_campaign_yet(conn)
            if fresh:
                # The schema is made through Alembic's own connection, which would wait for a
                # write lock held elsewhere silently (its busy timeout): it is waited for here,
                # said and bounded like any other write, first.
                with engine.connect() as conn, write_tx(conn, "creation of the schema",
                                                        lock_wait_s=lock_wait_s,
                                                        on_wait=on_lock_wait):
                    pass
                # The upgrade reads the file's header through a descriptor of its own, and
                # closing a descriptor of the file drops every POSIX lock this process holds
                # on it, SQLite's too: with the engine's connection open, the next process
                # to close the file would think itself the last one and delete the -wal
                # under the master. So no connection of this process is open meanwhile.
                engine.dispose()
                # Committed (and, as its engine closes, checkpointed into the file) before
                # the campaign row, which the incarnation's transaction below writes: a start
                # killed in between leaves the schema alone, and so does a copy of a campaign
                # made without its -wal while every later commit is still there: a --resume
                # makes its campaign (the first must go on; the preflight warns of the second).
                upgrade(path)
            with engine.connect() as conn, read_tx(conn):
                check_revision(conn, path)
                check_pages(path)
            now = clock()
            report = ResumeReport()
            with engine.connect() as conn, write_tx(conn, "start of a new incarnation",
                                                    lock_wait_s=lock_wait_s,
                                                    on_wait=on_lock_wait):
                incarnation, epoch = _new_incarnation(conn, path, resume, now, settings,
                                                      check_settings)
                tx = Tx(conn, incarnation, now, policy)
                detail = "resume" if resume else "new"
                detail = f"{detail} {note}" if note else detail
                where = where_ranks_ran(tx) if resume else None
                tx.event(EventKind.CAMPAIGN, detail=f"{detail}; {where}" if where else detail)
                if resume:
                    forget_incarnation(tx, ranks)
                    interrupted = requeue_in_flight(tx, earlier_incarnations=True)
                    reclaimed, refused = task_ops.reclaim_deferred(tx, available)
                    report = ResumeReport(interrupted, reclaimed, refused)
                tx.flush()
                bitmap = conn.execute(select(campaign.c.bitmap_version)).scalar_one()
        except BaseException as e:
            if engine is not None:
                engine.dispose()
            removed = new and _remove_what_it_made(path)
            release_campaign(lock_fd)
            if removed and isinstance(e, StoreWriteError):
                raise NewCampaignNotMade(path, e.cause) from e
            raise
        store = cls(path, engine, incarnation, epoch, policy, report, clock, bitmap,
                    lock_wait_s, on_lock_wait)
        store._lock_fd = lock_fd
        return store

    @classmethod
    def attach(cls, path: str | os.PathLike[str], *,
               policy: RetryPolicy | None = None) -> Store:
        """Open an existing campaign for maintenance (requeue) without starting an
        incarnation or running restart recovery: safe while a master is running."""
        path = Path(path)
        if not path.exists():
            raise StoreError(f"{path}: no such campaign database")
        refuse_empty_file(path)
        probe(path)  # read first: what is not a current campaign is never written
        engine = open_engine(path)
        try:
            with engine.connect() as conn, read_tx(conn):
                check_revision(conn, path)
                row = conn.execute(select(campaign.c.incarnation, campaign.c.epoch)).first()
        except BaseException:
            engine.dispose()
            raise
        if row is None:
            engine.dispose()
            raise NoCampaignYet(path)
        return cls(path, engine, row.incarnation, row.epoch, policy or RetryPolicy(),
                   ResumeReport())

    def _connection(self) -> Connection:
        # One connection for the life of the store: a pool checkout and its reset for each
        # transaction cost about a third of a FULL commit.
        if self._conn is None or self._conn.closed:
            self._conn = self.engine.connect()
        return self._conn

    @contextlib.contextmanager
    def transaction(self, operation: str = "master round",
                    on_lock_wait: Callable[[float], None] | None = None) -> Iterator[Tx]:
        """One write transaction (BEGIN IMMEDIATE); the journal is flushed before COMMIT.
        `on_lock_wait` replaces the store's own for this one (see `Store.open`)."""
        conn = self._connection()
        with write_tx(conn, operation, lock_wait_s=self.lock_wait_s,
                      on_wait=on_lock_wait or self.on_lock_wait):
            tx = Tx(conn, self.incarnation, self.clock(), self.policy,
                    sampler=self.quarantine_sampler)
            yield tx
            tx.flush()
            committing = time.perf_counter()
        self.commit_times.add(time.perf_counter() - committing)  # the COMMIT (and its fsync)

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        """A read transaction: a plain BEGIN, so that it never waits for the write lock (held
        by `coordinator requeue`, or a `sqlite3` shell) as a write would."""
        with read_tx(self._connection()) as conn:
            yield conn

    def lost_name(self) -> str | None:
        """None while the campaign file still has its name; else what became of it (the
        store goes on in the file it opened, which no name reaches any more)."""
        return lost_name(self._lock_fd) if self._lock_fd is not None else None

    def close(self, *, rescue: bool = False) -> Path | None:
        """`rescue`: the campaign file lost its name (`lost_name`): before it closes, and is
        gone with everything in it, the database is copied out whole (SQLite's backup), and
        the copy put back at the name if nothing has it now, else beside it. Returns where."""
        copy = self._copy_out() if rescue and self._lock_fd is not None else None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.engine.dispose()
        if self._lock_fd is not None:
            # After the engine's connections: closing a descriptor of the file drops the
            # process's POSIX locks on it, which are SQLite's.
            release_campaign(self._lock_fd)  # releases the campaign to the next master
            self._lock_fd = None
        return _put_back(copy, Path(self.path)) if copy is not None else None

    def _copy_out(self) -> Path:
        path = Path(self.path)
        copy = path.with_name(f"{path.name}.rescue-{os.getpid()}.tmp")
        raw = self._connection().connection.driver_connection
        with contextlib.closing(sqlite3.connect(copy)) as dst:
            raw.backup(dst)
        return copy

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _put_back(copy: Path, path: Path) -> Path:
    """The rescued copy at the campaign's name if nothing has the name now, else beside it.
    The side files still at the name are the lost file's own, which SQLite leaves when its
    file has gone (no other database can have them: none has the name): removed first, or
    a -wal would be replayed into the copy."""
    if not os.path.lexists(path):
        for side in SIDE_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{path}{side}")
        try:
            os.link(copy, path)  # (never over a file that took the name meanwhile)
        except OSError:
            pass
        else:
            os.unlink(copy)
            return path
    kept = path.with_name(f"{path.name}.rescued-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    os.replace(copy, kept)
    return kept


def _remove_what_it_made(path: Path) -> bool:
    """A start that failed on a file it created (a disk too full for the schema, an I/O
    error) left it half made: a schema at some revision and no campaign, which `status` then
    said to `db upgrade`. It held nothing before, so it goes, with its -wal and -shm, as if
    the start had never been; whether anything was there to remove."""
    removed = False
    for side in ("", *SIDE_FILES):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{path}{side}")
            removed = True
    return removed


def check_pages(path: Path) -> None:
    """Refuse a damaged file before a start writes to it, when it is small enough
    (`START_CHECK_BYTES`) to read whole; a larger one is left to `coordinator check`."""
    size = sum(os.stat(f"{path}{side}").st_size if os.path.exists(f"{path}{side}") else 0
               for side in ("", "-wal"))
    if size <= START_CHECK_BYTES and (problems := quick_check(path)):
        raise DamagedDatabaseError(path, sqlite3.DatabaseError(
            f"PRAGMA quick_check: {'; '.join(problems[:3])}"))


def _no_campaign_yet(conn: Connection) -> bool:
    """A new file, or one whose schema a start that was stopped left half created (each
    revision commits on its own): nothing in it to lose, so it is brought to the head here
    instead of being refused as an older campaign that needs `db upgrade`."""
    tables = inspect(conn).get_table_names()
    if not tables:
        return True
    if "campaign" not in tables or current_revision(conn) == head_revision():
        return False  # not ours (refused later, with the reason), or ready
    return conn.execute(select(func.count()).select_from(campaign)).scalar_one() == 0


def _parse_settings(text: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _new_incarnation(conn: Connection, path: Path, resume: bool, now: float,
                     settings: Mapping[str, Any] | None,
                     check_settings: Callable[[Mapping[str, Any] | None],
                                              Mapping[str, Any] | None] | None,
                     ) -> tuple[int, str]:
    epoch = secrets.token_hex(16)
    row = conn.execute(select(campaign.c.incarnation, campaign.c.settings)).first()
    if row is None:
        n_tasks = conn.execute(select(func.count()).select_from(tasks)).scalar_one()
        if n_tasks and not resume:
            raise CampaignExistsError(str(path), n_tasks)
        conn.execute(insert(campaign).values(
            id=1, created_at=now, incarnation=1, epoch=epoch,
            settings=None if settings is None else json.dumps(settings, sort_keys=True)))
        return 1, epoch
    if not resume:
        n_tasks = conn.execute(select(func.count()).select_from(tasks)).scalar_one()
        raise CampaignExistsError(str(path), n_tasks)
    stored = _parse_settings(row.settings)
    renewed = check_settings(stored) if check_settings is not None else None
    if stored is None and settings is not None:
        # A campaign from before revision 0004 (or one whose settings are unreadable): this
        # run's become the reference the next resume is checked against.
        conn.execute(update(campaign).values(settings=json.dumps(settings, sort_keys=True)))
    elif stored is not None:
        # Kept by a newer version than the one that began it (feedback, depth, timeout):
        # this run's, from now on; what the campaign already kept stays, unless this start
        # changed it (`renewed`).
        kept = {**(settings or {}), **stored, **(renewed or {})}
        if kept != stored:
            conn.execute(update(campaign).values(settings=json.dumps(kept, sort_keys=True)))
    incarnation = row.incarnation + 1
    conn.execute(update(campaign).values(incarnation=incarnation, epoch=epoch))
    return incarnation, epoch


