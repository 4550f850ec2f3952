"""One master per campaign file, whatever its name (store/lock.py), and no command on a file
with a second name (a hard link), which would keep a -wal of its own."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Farm

from coordinator.exits import ExitStatus
from store.campaign import Store
from store.errors import CampaignLockedError, DatabaseOpenError, ReadOnlyDatabaseError
from store.lock import lock_holder

COMMANDS = (["status"], ["check"], ["requeue"], ["db", "upgrade"],
            ["run", "--resume", "--np", "2"])


def _campaign(db_path) -> None:
    farm = Farm(db_path)
    farm.enqueue({"data": 1})
    farm.close()


def _files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_campaign_with_a_second_name_is_refused_by_every_command(db_path):
    """`ln campaign.db alias.db`: a master on the alias kept its own alias.db-wal beside the
    running one's, and a later `status` on the alias applied it to the shared file (done
    1,500 -> 1,172, a wrong index). No command touches a file with two names."""
    _campaign(db_path)
    alias = db_path.with_name("alias.db")
    os.link(db_path, alias)
    before = _files(db_path.parent)
    for command in COMMANDS:
        for name in (db_path, alias):
            done = subprocess.run([sys.executable, "-m", "coordinator", *command, "--db",
                                   str(name)], capture_output=True, text=True, timeout=60)
            assert done.returncode == ExitStatus.USAGE, (command, done.stderr)
            assert "has 2 names (hard links to one file)" in done.stderr, done.stderr
            assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
    assert _files(db_path.parent) == before
    with pytest.raises(DatabaseOpenError, match="has 2 names"):
        Store.open(alias, resume=True)
    os.unlink(alias)
    Store.open(db_path, resume=True).close()  # one name again: fine


def test_the_lock_is_the_files_own_whatever_the_name(tmp_path):
    """Through a symbolic link (or any other spelling) a second master meets the first's
    lock: it is a `flock` on the file itself, and no `.lock` file is left beside it."""
    real = tmp_path / "real.db"
    running = Store.open(real)
    try:
        assert lock_holder(real) == os.getpid()
        (tmp_path / "link.db").symlink_to("real.db")
        for name in (tmp_path / "link.db", tmp_path / "." / "real.db"):
            with pytest.raises(CampaignLockedError, match=f"pid {os.getpid()}"):
                Store.open(name, resume=True)
    finally:
        running.close()
    assert lock_holder(real) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.db", "real.db"]


def test_a_start_refused_after_it_took_a_new_files_lock_leaves_nothing_behind(tmp_path):
    """The lock is the file's own, so a new campaign's file is made (empty) to take it: a
    start that fails after that removes it, as if it had never started."""
    db = tmp_path / "new.db"
    with pytest.raises(ValueError, match="synchronous"):
        Store.open(db, synchronous="SOMETIMES")
    assert list(tmp_path.iterdir()) == []


def test_the_lock_says_whether_a_master_runs_the_campaign(db_path):
    """What `status` reports: from the kernel's lock table, so a reused pid cannot pass for
    a running master."""
    assert lock_holder(db_path) is None  # never run
    store = Store.open(db_path)
    try:
        assert lock_holder(db_path) == os.getpid()
    finally:
        store.close()
    assert lock_holder(db_path) is None


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_an_older_masters_lock_file_of_another_user_is_tested_all_the_same(tmp_path):
    """The older versions made NAME.lock 0644: another user's master left one this process
    cannot open for writing, which was taken for "nobody holds it". `flock` needs no write
    access."""
    import tempfile
    where = Path(tempfile.mkdtemp(prefix="legacy-lock-"))
    try:
        where.chmod(0o755)
        db = where / "c.db"
        db.write_bytes(b"")
        lock = where / "c.db.lock"
        old = subprocess.Popen([sys.executable, "-c", _OLD_MASTER.format(lock=str(lock))],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert old.stdout.readline() == "locked\n"
            assert oct(lock.stat().st_mode & 0o777) == "0o644" and lock.stat().st_uid == 0
            # Another user once the module is loaded (the checkout may be in a directory
            # only root can enter, as CI's mktemp -d is).
            other = subprocess.run(
                [sys.executable, "-c", "import os; from store.lock import _hold_legacy_lock; "
                 "os.setgroups([]); os.setgid(65534); os.setuid(65534); "
                 f"_hold_legacy_lock({str(db)!r})"],
                capture_output=True, text=True, timeout=60, cwd=where)
            assert "CampaignLockedError" in other.stderr, other.stderr
            assert f"(pid {old.pid})" in other.stderr, other.stderr
        finally:
            old.stdin.close()
            old.wait(timeout=30)
    finally:
        shutil.rmtree(where, ignore_errors=True)


# What a master of a version at revision 0008 or older held: `flock` on `REALPATH.lock`, in
# which it wrote its pid and host (store/campaign.py before 18e6230).
_OLD_MASTER = """
import fcntl, os, socket, sys
fd = os.open({lock!r}, os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.pwrite(fd, f"pid {{os.getpid()}} on {{socket.gethostname()}}\\n".encode(), 0)
print("locked", flush=True)
sys.stdin.readline()
"""


@pytest.mark.timeout(120)
def test_a_master_of_an_older_version_still_running_is_seen_by_every_command(db_path):
    """Measured on an upgrade: a 0007 master still ran on the file; this version's `status`
    said "not running", `db upgrade` changed its schema under it and `run --resume` started a
    second master, which charged the first's in-flight tasks. Its lock file is held too."""
    _campaign(db_path)
    lock = db_path.with_name(db_path.name + ".lock")
    old = subprocess.Popen([sys.executable, "-c", _OLD_MASTER.format(lock=str(lock))],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert old.stdout.readline() == "locked\n"
        assert lock_holder(db_path) == old.pid
        before = _files(db_path.parent)
        for command in (["db", "upgrade"], ["run", "--resume", "--np", "2"]):
            done = subprocess.run([sys.executable, "-m", "coordinator", *command, "--db",
                                   str(db_path)], capture_output=True, text=True, timeout=60)
            assert done.returncode == ExitStatus.USAGE, (command, done.stderr)
            assert f"pid {old.pid}" in done.stderr, done.stderr
        status = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db",
                                 str(db_path)], capture_output=True, text=True, timeout=60)
        assert f"master: running (pid {old.pid} on " in status.stdout, status.stdout
        assert _files(db_path.parent) == before
        with pytest.raises(CampaignLockedError, match=f"older coordinator version \\(pid "
                                                      f"{old.pid}\\), which holds "):
            Store.open(db_path, resume=True)
    finally:
        old.stdin.close()
        old.wait(timeout=30)
    # Gone: the lock file it left is no master, and is held with the file's own from now on.
    store = Store.open(db_path, resume=True)
    try:
        assert lock_holder(db_path) == os.getpid()
        with pytest.raises(BlockingIOError):
            fcntl.flock(os.open(lock, os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        store.close()
    lock.unlink()
    Store.open(db_path, resume=True).close()
    assert not lock.exists()  # never made


_MASTER = """
import os, sys, time
sys.path.insert(0, {root!r})
from store.campaign import Store
from store.tasks import NewTask, enqueue_tasks
store = Store.open({db!r}, resume={resume}, synchronous="FULL")
print("open", flush=True)
sys.stdin.readline()
with store.transaction("import") as tx:
    enqueue_tasks(tx, [NewTask({{"data": i}}) for i in range(10)])
print("written", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("resume", [False, True], ids=["new campaign", "resumed campaign"])
def test_another_process_closing_the_file_leaves_a_running_masters_wal_alone(tmp_path, resume):
    """A master's SQLite connection holds a POSIX lock on the file while it is open, so that a
    `sqlite3` shell or a `coordinator requeue` that closes its own connection knows it is not
    the last one and leaves the -wal alone. Closing any descriptor of the file drops the
    process's POSIX locks, and `Store.open` closed one after its engine had opened a new
    campaign (the schema's creation read the file's header): the next process to close the
    file checkpointed and deleted the -wal under the running master, whose later commits went
    to a deleted file (a kill -9 then lost 131 committed results)."""
    db = tmp_path / "c.db"
    if resume:
        Store.open(db).close()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    master = subprocess.Popen(
        [sys.executable, "-c", _MASTER.format(root=root, db=str(db), resume=resume)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert master.stdout.readline() == "open\n"
        subprocess.run([sys.executable, "-c", "import sqlite3, sys; c = sqlite3.connect("
                        "sys.argv[1]); c.execute('SELECT count(*) FROM tasks').fetchall(); "
                        "c.close()", str(db)], check=True, timeout=60)
        assert db.with_name("c.db-wal").exists(), "the -wal was deleted under the master"
        master.stdin.write("\n")
        master.stdin.flush()
        assert master.stdout.readline() == "written\n"
    finally:
        master.kill()  # as kill -9: what it committed must be in the file
        master.communicate(timeout=60)
    import sqlite3
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT count(*) FROM tasks").fetchone() == (10,)


def _my_locks(*paths) -> list[str]:
    """This process's POSIX locks on these files, from /proc/locks (type and range)."""
    inodes = set()
    for p in paths:
        st = os.stat(p)
        inodes.add(f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}")
    mine = []
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            # "1: POSIX  ADVISORY  READ 1234 08:01:5678 128 128" (a "->" marks a waiter)
            if "->" in fields or fields[1] != "POSIX" or fields[4] != str(os.getpid()):
                continue
            if fields[5] in inodes:
                mine.append(" ".join(fields[3:4] + fields[5:]))
    return sorted(mine)


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux's /proc/locks")
def test_a_master_reads_no_file_of_its_campaign_in_the_afl_queues(tmp_path):
    """The campaign's database kept in the master's own AFL queue (or a link to its -shm in
    the fuzzer's): hashed or imported like a test case, it was opened and closed beside
    SQLite's descriptor, which dropped every POSIX lock SQLite held on it; the next process
    to close the file would then delete the -wal under the master."""
    from coordinator.output import TestcaseWriter
    from coordinator.sources import AflQueueSource

    ours, theirs = tmp_path / "afl" / "symcc" / "queue", tmp_path / "afl" / "main" / "queue"
    ours.mkdir(parents=True)
    theirs.mkdir(parents=True)
    db = ours / "campaign.db"
    store = Store.open(db)
    try:
        with store.reading() as conn:  # a reader holds its locks while it reads
            conn.exec_driver_sql("SELECT count(*) FROM tasks").all()
            files = [db, db.with_name("campaign.db-shm")]
            held = _my_locks(*files)
            assert held, "SQLite holds no POSIX lock: nothing to check"
            os.link(files[1], theirs / "id:000000,orig:shm")
            (theirs / "id:000001,orig:seed").write_bytes(b"seed")
            writer = TestcaseWriter(ours, afl_style=True)
            writer.scan()
            source = AflQueueSource(tmp_path / "afl", "main", settle_s=0)
            os.utime(theirs / "id:000001,orig:seed", (0, 0))
            os.utime(files[1], (0, 0))
            found = source.poll()
            assert _my_locks(*files) == held
        assert [i.input_bytes for i in found] == [b"seed"]
        assert source.skipped == 1
    finally:
        store.close()


def test_a_campaign_file_that_cannot_be_written_is_refused_in_a_sentence(tmp_path):
    """An immutable file (`chattr +i`; as root, a mode of 0444 stops nothing) or one on a
    read-only mount: the run said only `[Errno 1] Operation not permitted: 'c.db'`. And
    `requeue` made c.db-wal and c.db-shm beside it before its first write failed."""
    db = tmp_path / "c.db"
    _campaign(db)
    before = _files(tmp_path)
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this filesystem")
    said = (rf"{db} is read-only: the file cannot be written \(its mode, or an immutable "
            rf"file: `lsattr -d {db}` shows an i\)\. This command writes to the campaign: "
            rf"copy c\.db and its -wal, if there is one, to a writable node-local directory")
    try:
        with pytest.raises(ReadOnlyDatabaseError, match=said):
            Store.open(db, resume=True)
        for command in (["requeue", "--state", "all"], ["db", "upgrade"]):
            got = subprocess.run([sys.executable, "-m", "coordinator", *command, "--db",
                                  str(db)], capture_output=True, text=True, timeout=60)
            assert got.returncode == ExitStatus.USAGE, (command, got.stderr)
            assert re.match(f"coordinator: {said}", got.stderr), (command, got.stderr)
        assert _files(tmp_path) == before
    finally:
        subprocess.run(["chattr", "-i", str(db)], check=True)
    Store.open(db, resume=True).close()  # (and nothing was changed meanwhile)
