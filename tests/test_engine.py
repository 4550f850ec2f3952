"""The engine's pragmas, read back from real files, and the refusals that keep a campaign safe."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess

import pytest
from sqlalchemy import text

from coordinator.exits import ExitStatus
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
    CampaignExistsError,
    CampaignLockedError,
    DatabaseOpenError,
    StoreWriteError,
    UnsafeDatabaseError,
)
from store.schema import EventKind
from store.stats import read_stats
from store.versioning import check_revision, upgrade


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


@contextlib.contextmanager
def write_lock_held_elsewhere(db_path, monkeypatch):
    """Another process's write transaction (a `sqlite3` shell's BEGIN IMMEDIATE) on the file
    while the block runs, with a busy timeout of 0.1 s for the connections our side opens
    in it (one opened before keeps its own)."""
    import store.engine
    monkeypatch.setattr(store.engine, "BUSY_TIMEOUT_MS", 100)
    monkeypatch.setattr(store.engine, "MASTER_BUSY_TIMEOUT_MS", 100)
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        other.execute("ROLLBACK")
        other.close()


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


def test_requeue_while_another_process_holds_the_write_lock_exits_3(db_path, monkeypatch,
                                                                   capsys):
    """`coordinator requeue` read the schema revision in a write transaction: past the busy
    timeout it ended in a driver traceback (exit 1), not with the cause (exit 3)."""
    from coordinator.cli import main
    Store.open(db_path).close()
    with write_lock_held_elsewhere(db_path, monkeypatch):
        assert main(["requeue", "--db", str(db_path)]) == ExitStatus.STORE
    err = capsys.readouterr().err
    assert "database is locked (another process held the campaign's write lock" in err, err
    assert main(["requeue", "--db", str(db_path)]) == 0


def test_a_master_starting_under_another_process_s_write_lock_says_why(db_path, monkeypatch):
    """Store.open read the schema in BEGIN IMMEDIATE: past the busy timeout a raw driver
    error escaped, which the start took for an internal error (exit 5, a traceback)."""
    Store.open(db_path).close()
    with write_lock_held_elsewhere(db_path, monkeypatch), \
            pytest.raises(StoreWriteError, match="longer than the master waits"):
        Store.open(db_path, resume=True)
    Store.open(db_path, resume=True).close()


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
        with pytest.raises(UnsafeDatabaseError, match="WAL"):
            open_engine(path)  # refused at once, not at the caller's first transaction
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def test_journal_mode_in_force_is_wal(db_path):
    """`PRAGMA journal_mode` returns the mode actually in force; ours must be wal."""
    engine = open_engine(db_path)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()


def test_network_filesystem_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("store.engine.filesystem_type", lambda p: "nfs")
    with pytest.raises(UnsafeDatabaseError, match="node-local"):
        open_engine(tmp_path / "c.db")


def test_filesystem_type_of_tmp_is_known(tmp_path):
    assert filesystem_type(tmp_path)  # /proc/mounts names the mount holding tmp_path


def test_existing_campaign_needs_resume(db_path, farm):
    farm.enqueue({"data": 1})
    farm.store.close()  # the master that made it is gone (it would hold the campaign's lock)
    with pytest.raises(CampaignExistsError, match="--resume"):
        Store.open(db_path)
    again = Store.open(db_path, resume=True)
    assert again.incarnation == 2 and again.epoch != farm.store.epoch
    again.close()


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


def test_an_sqlite_file_of_something_else_is_not_turned_into_a_campaign(tmp_path):
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE users (name TEXT)")
    conn.close()
    with pytest.raises(DatabaseOpenError, match="something else .*users"):
        Store.open(path)
    with pytest.raises(DatabaseOpenError, match="something else"):
        upgrade(path)
    conn = sqlite3.connect(path)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["users"]
    conn.close()


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


def test_a_second_master_on_the_same_campaign_is_refused(db_path):
    """Nothing else stops two masters (each would fence the other's dispatches out); the lock
    goes with the first one's close (or its process)."""
    first = Store.open(db_path)
    try:
        with pytest.raises(CampaignLockedError, match=r"in use by another master \(pid \d+"):
            Store.open(db_path, resume=True)
    finally:
        first.close()
    again = Store.open(db_path, resume=True)
    assert again.incarnation == 2
    again.close()


def test_settings_are_kept_and_a_refused_resume_writes_nothing(db_path):
    """campaign.settings is written once, with the new campaign; on resume the stored ones go
    to the check, and a check that refuses leaves the file as it was (same incarnation)."""
    Store.open(db_path, settings={"executor": "python", "callable": "m:f"}).close()
    seen = []

    def refuse(stored):
        seen.append(stored)
        raise ValueError("another executor")

    with pytest.raises(ValueError, match="another executor"):
        Store.open(db_path, resume=True, settings={"executor": "demo"}, check_settings=refuse)
    assert seen == [{"callable": "m:f", "executor": "python"}]
    again = Store.open(db_path, resume=True, settings={"executor": "demo"},
                       check_settings=seen.append)
    assert again.incarnation == 2  # the refused start did not count as one
    again.close()
    assert seen[-1] == {"callable": "m:f", "executor": "python"}  # never overwritten


def test_a_campaign_without_settings_takes_the_first_resumes(db_path):
    """A campaign from before revision 0004 (NULL), or one whose settings are not a JSON
    object, is not checked once: that start's settings become the record."""
    Store.open(db_path).close()  # no settings given: NULL, as after `db upgrade`
    for stored in (None, "not json", "[1, 2]"):
        with sqlite3.connect(db_path) as c:
            c.execute("UPDATE campaign SET settings = ?", (stored,))
        seen = []
        Store.open(db_path, resume=True, settings={"executor": "python"},
                   check_settings=seen.append).close()
        assert seen == [None]
        with sqlite3.connect(db_path) as c:
            assert c.execute("SELECT settings FROM campaign").fetchone() == (
                '{"executor": "python"}',)


def test_db_upgrade_waits_for_no_master(db_path):
    """A schema change under a running master (batch migrations copy tables) is refused."""
    import sys
    master = Store.open(db_path)
    try:
        up = subprocess.run([sys.executable, "-m", "coordinator", "db", "upgrade", "--db",
                             str(db_path)], capture_output=True, text=True, timeout=60)
    finally:
        master.close()
    assert up.returncode == ExitStatus.USAGE and "in use by another master" in up.stderr
    up = subprocess.run([sys.executable, "-m", "coordinator", "db", "upgrade", "--db",
                         str(db_path)], capture_output=True, text=True, timeout=60)
    assert up.returncode == 0 and "already at" in up.stdout, up.stderr


def test_db_upgrade_of_an_older_campaign_says_what_it_does_first(db_path):
    """A revision that copies a table (0005 copies `results`: seconds per million rows) is
    announced before it starts, so a long upgrade is not a silent one."""
    import sys

    from store import versioning
    versioning.upgrade(db_path, "0004")
    up = subprocess.run([sys.executable, "-m", "coordinator", "db", "upgrade", "--db",
                         str(db_path)], capture_output=True, text=True, timeout=60, check=False)
    assert up.returncode == 0, up.stderr
    assert f"upgrading {db_path} from schema 0004 to {versioning.head_revision()}" in up.stderr
    assert f"schema 0004 -> {versioning.head_revision()}" in up.stdout


def _cli(*args: str) -> subprocess.CompletedProcess:
    import sys
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_a_file_with_two_revision_stamps_is_refused_clearly_by_every_command(db_path):
    """A hand edit left two rows in alembic_version: Alembic's own answer is a traceback
    ("more than one head"); every command names what the file says instead."""
    upgrade(db_path)
    with sqlite3.connect(db_path) as conn:
        conn.execute("INSERT INTO alembic_version VALUES ('0099')")
    for args in (["status"], ["db", "upgrade"], ["requeue", "--state", "all"]):
        got = _cli(*args, "--db", str(db_path))
        assert got.returncode == ExitStatus.USAGE, (args, got.stderr)
        assert "alembic_version table holds 2 revisions" in got.stderr, (args, got.stderr)
        assert "Traceback" not in got.stderr


def test_an_upgrade_that_fails_changes_nothing_and_says_so(db_path):
    """A stamp older than the tables (0003 on a file whose tables are newer): the revision that
    fails is rolled back whole; exit 3, no traceback."""
    upgrade(db_path)
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0003'")
    got = _cli("db", "upgrade", "--db", str(db_path))
    assert got.returncode == ExitStatus.STORE, got.stderr
    assert "cannot upgrade" in got.stderr and "duplicate column name: settings" in got.stderr
    assert "Traceback" not in got.stderr
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("0003",)]


def test_status_and_requeue_leave_an_empty_file_empty(db_path):
    """A read-only command on a 0-byte file (a start that failed early, a `touch`) must not
    turn it into an SQLite database."""
    db_path.write_bytes(b"")
    for args in (["status"], ["requeue", "--state", "all"]):
        got = _cli(*args, "--db", str(db_path))
        assert got.returncode == ExitStatus.USAGE and "holds no campaign yet" in got.stderr, got.stderr
        assert db_path.stat().st_size == 0


def test_the_lock_says_whether_a_master_runs_the_campaign(db_path):
    """What `status` reports: from the kernel's lock table, so a reused pid cannot pass for
    a running master."""

    from store.lock import lock_holder
    assert lock_holder(db_path) is None  # never run
    store = Store.open(db_path)
    try:
        assert lock_holder(db_path) == os.getpid()
    finally:
        store.close()
    assert lock_holder(db_path) is None


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


def test_a_damaged_file_is_named_as_such_by_every_command(tmp_path):
    """A page overwritten on disk made `status`, `requeue` and `db upgrade` end in a driver
    traceback (exit 1), a start in "internal error" (exit 5). Each now says the file is
    damaged and what to do (exit 2)."""
    import sys
    db = tmp_path / "c.db"
    store = Store.open(db)
    store.close()
    with sqlite3.connect(db) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        roots = [r for (r,) in conn.execute("SELECT rootpage FROM sqlite_master WHERE name "
                                            "IN ('campaign', 'alembic_version')")]
    conn.close()
    assert len(roots) == 2
    data = bytearray(db.read_bytes())
    for root in roots:  # the file opens; what is read from it first is garbage
        data[(root - 1) * page:root * page] = b"\xff" * page
    db.write_bytes(bytes(data))
    for command in (["status"], ["requeue", "--state", "deferred"], ["db", "upgrade"]):
        done = subprocess.run([sys.executable, "-m", "coordinator", *command, "--db", str(db)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == ExitStatus.USAGE, (command, done.stderr[-2000:])
        assert "is damaged (database disk image is malformed): restore a copy" in done.stderr
        assert "Traceback" not in done.stderr
    with pytest.raises(DatabaseOpenError, match="is damaged"):
        Store.open(db, resume=True)


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
