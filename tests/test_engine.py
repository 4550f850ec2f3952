"""The engine's pragmas, read back from real files, and the refusals that keep a campaign safe."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from campaigns import damage_a_tasks_page, queued_campaign
from conftest import write_lock_held_elsewhere
from sqlalchemy import text

from store import campaign as campaign_module
from store.campaign import Store
from store.engine import (
    BUSY_TIMEOUT_MS,
    JOURNAL_SIZE_LIMIT,
    check_sqlite_version,
    filesystem_type,
    open_engine,
    read_pragmas,
)
from store.errors import (
    CampaignLockedError,
    DamagedDatabaseError,
    DatabaseOpenError,
    ReadOnlyDatabaseError,
    StoreWriteError,
    UnsafeDatabaseError,
)
from store.revisions import check_revision
from store.schema import EventKind
from store.stats import read_stats


@pytest.mark.parametrize("mode, level", [("FULL", 2), ("NORMAL", 1)])
def test_every_pragma_reads_back(db_path, mode, level):
    engine = open_engine(db_path, synchronous=mode)
    with engine.connect() as conn:
        got = read_pragmas(conn)
    engine.dispose()
    assert got == {"journal_mode": "wal", "synchronous": level, "foreign_keys": 1,
                   "busy_timeout": BUSY_TIMEOUT_MS, "journal_size_limit": JOURNAL_SIZE_LIMIT}


def test_default_is_full(db_path):
    store = Store.open(db_path)
    with store.reading() as conn:
        assert read_pragmas(conn)["synchronous"] == 2
    store.close()


def test_unknown_synchronous_mode_is_refused(db_path):
    with pytest.raises(ValueError, match="synchronous"):
        open_engine(db_path, synchronous="OFF")


def test_an_sqlite_without_returning_is_refused_by_name():
    check_sqlite_version(sqlite3.sqlite_version_info)  # this machine's passes
    check_sqlite_version((3, 35, 0))
    with pytest.raises(UnsafeDatabaseError, match=r"SQLite is 3\.34\.1; .* needs 3\.35\.0"):
        check_sqlite_version((3, 34, 1))


def test_writes_begin_immediate(db_path):
    """A write transaction holds the write lock from its first statement: a second writer
    cannot even begin while it is open (no half-done transaction can fail on lock upgrade)."""
    engine = open_engine(db_path)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (x)"))
    with engine.begin() as conn:
        other = sqlite3.connect(db_path, timeout=0.05, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.close()
    engine.dispose()


def test_reads_do_not_wait_for_another_writer(db_path, monkeypatch):
    """`reading()` used to BEGIN IMMEDIATE like a write: while `coordinator requeue` (or a
    `sqlite3` shell) held the write lock, the master's progress and stats reads waited for it,
    and failed as "database is locked" past the busy timeout. Writes still wait."""
    store = Store.open(db_path)
    with write_lock_held_elsewhere(db_path, monkeypatch):
        with store.reading() as conn:
            assert read_stats(conn).incarnation == 1
        with pytest.raises(StoreWriteError, match="locked"), store.transaction("a write"):
            pass
    with store.transaction("a write"):  # the flag did not stay behind
        pass
    store.close()


def test_read_only_file_is_refused_with_a_clear_error(tmp_path):
    """SQLite cannot switch a read-only file to WAL. As root, file modes do not stop us, so
    the file is made immutable (ext4 `chattr +i`), which binds root too."""
    path = tmp_path / "c.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        os.chmod(path, 0o444)
        if os.access(path, os.W_OK):
            pytest.skip("neither chattr +i nor a read-only mode can protect the file here")
    try:
        with pytest.raises(ReadOnlyDatabaseError, match=r"c\.db is read-only: the file cannot "
                                                        r"be written"):
            open_engine(path)  # refused at once, not at the caller's first transaction
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def test_network_filesystem_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("store.engine.filesystem_type", lambda p: "nfs")
    with pytest.raises(UnsafeDatabaseError, match="node-local"):
        open_engine(tmp_path / "c.db")


def test_a_link_to_a_file_on_a_network_filesystem_is_refused(tmp_path, monkeypatch):
    """SQLite follows a link to the database and keeps its -wal and -shm beside the real
    file: the check looked at the link's own directory."""
    shared = tmp_path / "lustre"
    shared.mkdir()
    link = tmp_path / "c.db"
    link.symlink_to(shared / "c.db")
    monkeypatch.setattr("store.engine.filesystem_type",
                        lambda p: "lustre" if Path(p) == shared.resolve() else "ext4")
    with pytest.raises(UnsafeDatabaseError, match="lustre filesystem"):
        open_engine(link)
    open_engine(tmp_path / "local.db").dispose()


def test_filesystem_type_of_tmp_is_known(tmp_path):
    assert filesystem_type(tmp_path)  # /proc/mounts names the mount holding tmp_path


@pytest.mark.parametrize("kind, message", [
    ("junk", "is not an SQLite database"),
    ("directory", "is a directory"),
    ("missing directory", "directory .* does not exist"),
])
def test_a_path_that_cannot_be_a_database_is_refused_with_the_reason(tmp_path, kind, message):
    path = {"junk": tmp_path / "junk.db", "directory": tmp_path,
            "missing directory": tmp_path / "nowhere" / "c.db"}[kind]
    if kind == "junk":
        path.write_bytes(b"these bytes are not an SQLite header\n" * 4)
    with pytest.raises(DatabaseOpenError, match=message):
        open_engine(path)
    with pytest.raises(DatabaseOpenError, match=message):
        Store.open(path)
    if kind == "junk":  # refused, not overwritten
        assert path.read_bytes().startswith(b"these bytes")


def test_an_empty_file_holds_no_campaign_yet(tmp_path):
    """What `status` meets while a new master is still creating the schema: not advice to run
    `db upgrade` (which would race the master)."""
    path = tmp_path / "new.db"
    path.touch()
    with pytest.raises(DatabaseOpenError, match="holds no campaign yet .* within a moment"):
        open_engine(path, write=False)  # refused before opening: no header written into it
    assert path.stat().st_size == 0
    sqlite3.connect(path).execute("PRAGMA journal_mode = WAL").fetchall()  # a header, no tables
    engine = open_engine(path, write=False)
    try:
        with engine.connect() as conn, pytest.raises(DatabaseOpenError,
                                                     match="holds no campaign yet"):
            check_revision(conn, path)
    finally:
        engine.dispose()


def test_a_path_is_the_file_it_names_however_it_is_spelled(tmp_path):
    """The database path went into a URL: "c?mode=ro.db" created "c" and "p%41.db" "pA.db",
    each beside a lock of the name given, so two spellings made two masters on one file. And
    a symbolic link to a running campaign took a lock of its own."""
    for name in ("c?mode=ro.db", "p%41.db"):
        Store.open(tmp_path / name).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c?mode=ro.db", "p%41.db"]
    running = Store.open(tmp_path / "real.db")
    try:
        (tmp_path / "link.db").symlink_to("real.db")
        with pytest.raises(CampaignLockedError, match="in use by another master"):
            Store.open(tmp_path / "link.db", resume=True)
    finally:
        running.close()


def test_a_write_waits_for_a_lock_held_elsewhere_and_says_so_between_tries(db_path):
    """A `sqlite3` shell holding BEGIN IMMEDIATE for 14 s ended a running master (exit 3).
    A write now tries again until the store's `lock_wait_s`, calling `on_lock_wait` with the
    time waited between tries; the holder is named from /proc/locks."""
    import threading

    from store.engine import write_lock_holders
    waits: list[float] = []
    store = Store.open(db_path, lock_wait_s=30, on_lock_wait=waits.append)
    other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    assert write_lock_holders(db_path) == [os.getpid()]
    release = threading.Timer(2.5, lambda: other.execute("ROLLBACK"))
    release.start()
    try:
        with store.transaction("a write") as tx:
            tx.event(EventKind.CAMPAIGN, detail="written after the wait")
    finally:
        release.join()
        other.close()
    assert len(waits) >= 2 and waits == sorted(waits) and waits[-1] < 30, waits
    assert write_lock_holders(db_path) == []
    with store.reading() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM events WHERE detail = "
                                    "'written after the wait'").scalar() == 1
    store.close()


def test_a_write_stops_once_its_lock_wait_is_over(db_path):
    store = Store.open(db_path, lock_wait_s=1.5)
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreWriteError, match="--lock-wait"), store.transaction("a write"):
            pass
    finally:
        other.close()
    store.close()


def test_a_failed_switch_to_wal_says_its_likely_cause(tmp_path, monkeypatch):
    """Every failed switch to WAL mode was said to be a read-only file: a `sqlite3` reader's
    open transaction on a file in rollback-journal mode (a `VACUUM INTO` copy), or a full
    filesystem, sent the user looking for the wrong thing."""
    from store.engine import _why_no_wal
    path = tmp_path / "copy.db"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE t (x)")
        db.commit()
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT * FROM t").fetchall()  # a shared lock held
        with pytest.raises(UnsafeDatabaseError, match="another process has the file open"):
            open_engine(path, busy_timeout_ms=50)
    finally:
        reader.close()
    full = os.statvfs_result((4096, 4096, 1000, 0, 0, 100, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda p: full)
    why = _why_no_wal(path, sqlite3.OperationalError("disk I/O error"))
    assert why.startswith("the filesystem holding it is full (0 bytes free)")


# -- a damaged file --------------------------------------------------------------------------

def test_a_damaged_page_met_by_a_write_is_the_files_damage_not_a_storage_failure(
        tmp_path, monkeypatch):
    """A write transaction that met a damaged page raised StoreWriteError, which a master
    answers with "fix the storage and continue with --resume" (exit 3): every resume then
    ran until it met the page again. It is a DamagedDatabaseError (exit 2), which says to
    run `coordinator check` and to restore a copy."""
    db = tmp_path / "c.db"
    queued_campaign(db)
    damage_a_tasks_page(db)
    monkeypatch.setattr(campaign_module, "START_CHECK_BYTES", 0)  # (met by a round, then)
    with (Store.open(db, resume=True) as store, pytest.raises(DamagedDatabaseError) as got,
          store.transaction() as tx):
        tx.conn.execute(text("UPDATE tasks SET updated_at = updated_at + 1"))
    assert not isinstance(got.value, StoreWriteError)
    message = str(got.value)
    assert f"{db} is damaged (database disk image is malformed)" in message
    assert f"`coordinator check --db {db}`" in message and "--resume" not in message
    assert f"remove {db}-wal and {db}-shm first" in message and ".recover" in message


def test_a_start_refuses_a_damaged_file_before_it_writes_anything(tmp_path):
    """A start read only the pages its own reads went through, so each `--resume` of a
    damaged file began an incarnation, charged an attempt to every task the last one had in
    flight, and dispatched until a round met the page. A file small enough to read whole at
    start (`START_CHECK_BYTES`) is refused first, unchanged."""
    db = tmp_path / "c.db"
    queued_campaign(db)
    damage_a_tasks_page(db)
    before = db.read_bytes()
    with pytest.raises(DamagedDatabaseError, match="coordinator check --db"):
        Store.open(db, resume=True)
    assert db.read_bytes() == before
