"""The operator's commands (`coordinator status`, `check`, `requeue`, `db upgrade`) on real
campaign files, through the command line's own `main` or run as `python -m coordinator`: their
output, their exit status, and what they leave of a file they cannot use."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess

import pytest
from conftest import Farm, write_lock_held_elsewhere

from coordinator.cli import main
from coordinator.exits import ExitStatus
from store.campaign import Store
from store.errors import DatabaseOpenError
from store.tasks import NewTask, enqueue_tasks
from store.versioning import head_revision, upgrade


def _finished_campaign(db_path, n: int = 4) -> None:
    farm = Farm(db_path)
    farm.enqueue(*({"data": i} for i in range(n)))
    ranks = list(range(1, n + 1))
    for r in ranks:
        farm.ready(r)
    for r, token in farm.dispatch(*ranks).items():
        farm.result(r, token, value=r)
    farm.close()


def _listing(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_check_of_a_consistent_campaign_is_one_line_and_exit_0(db_path, capsys):
    _finished_campaign(db_path)
    before = _listing(db_path.parent)
    assert main(["check", "--db", str(db_path)]) == ExitStatus.OK
    out = capsys.readouterr().out
    assert out == f"{db_path}: consistent (4 tasks, schema {head_revision()})\n"
    assert _listing(db_path.parent) == before  # nothing written, nothing created


def test_check_says_each_violation_in_a_line_and_exits_1(db_path, capsys):
    _finished_campaign(db_path)
    with contextlib.closing(sqlite3.connect(db_path)) as db, db:
        db.execute("DELETE FROM results WHERE task_id = 2")
    assert main(["check", "--db", str(db_path)]) == ExitStatus.FAILED
    lines = capsys.readouterr().out.splitlines()
    assert f"{db_path}: conservation: task 2 is done without a result" in lines
    assert all(line.startswith(f"{db_path}: ") for line in lines) and len(lines) >= 2
    assert main(["check", "--db", str(db_path), "--json"]) == ExitStatus.FAILED
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["revision"] == report["head"]
    assert {"kind": "conservation", "check": "done_without_result", "task_id": 2} \
        .items() <= report["violations"][0].items()


@pytest.mark.parametrize("make, says", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_bytes(b""), "holds no campaign yet"),
    (lambda p: p.write_text("hello"), "not an SQLite database"),
    (lambda p: p.mkdir(), "is a directory"),
])
def test_check_refuses_what_is_no_campaign_in_one_line(tmp_path, capsys, make, says):
    path = tmp_path / "x.db"
    make(path)
    before = sorted(tmp_path.iterdir())
    assert main(["check", "--db", str(path)]) == ExitStatus.USAGE
    err = capsys.readouterr().err
    assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == before


def test_status_reads_a_finished_campaign_without_creating_anything(db_path, capsys):
    """`status` opened the file for writing: it set WAL mode, and left -wal and -shm."""
    _finished_campaign(db_path)
    before = _listing(db_path.parent)
    assert main(["status", "--db", str(db_path)]) == ExitStatus.OK
    assert "tasks: 4 = 4 done" in capsys.readouterr().out
    assert _listing(db_path.parent) == before


def test_requeue_by_rank_or_since_discards_what_was_committed_then(db_path, capsys):
    """The coordinator checks which dispatch an answer belongs to, not whether it is true:
    what a rank committed (any status) can be put back, by rank and from a time on."""
    import time

    from store.audit import audit_path
    farm = Farm(db_path)
    farm.enqueue(*({"data": i} for i in range(3)))
    for r in (1, 2):
        farm.ready(r)
    tokens = farm.dispatch(1, 2)
    farm.result(1, tokens[1], value="wrong")
    farm.result(2, tokens[2], status="error")
    farm.ready(1, tokens[1])
    later = farm.dispatch(1)
    farm.result(1, later[1], value="wrong too")
    farm.close()
    assert main(["requeue", "--db", str(db_path), "--since", str(time.time() + 60)]) == 0
    assert capsys.readouterr().out == "requeued 0 task(s)\n"
    assert main(["requeue", "--db", str(db_path), "--rank", "1", "--state", "failed"]) \
        == ExitStatus.USAGE
    assert main(["requeue", "--db", str(db_path), "--rank", "1"]) == 0
    assert capsys.readouterr().out == "requeued 2 task(s): 1, 3\n"
    assert audit_path(db_path).ok
    with contextlib.closing(sqlite3.connect(db_path)) as c:
        assert c.execute("SELECT id, state FROM tasks ORDER BY id").fetchall() == [
            (1, "queued"), (2, "done"), (3, "queued")]
        assert c.execute("SELECT count(*) FROM events WHERE kind = 'manual_requeue' AND "
                         "detail LIKE '%result from rank 1 discarded%'").fetchone() == (2,)
    assert main(["requeue", "--db", str(db_path), "--since", "2000-01-01T00:00"]) == 0
    assert capsys.readouterr().out == "requeued 1 task(s): 2\n"  # rank 2's error result
def test_cli_requeue_goes_in_short_chunks_in_id_order(db_path, monkeypatch, capsys):
    """One transaction of 100,000 tasks held the write lock for 30 s, and a master running on
    the campaign gave up waiting for it (database is locked) and died. Chunks of
    REQUEUE_CHUNK tasks each commit on their own; the queue order is still the id order."""
    import sqlite3

    from coordinator import commands
    from coordinator.cli import main
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(10)))
    farm.close()
    with sqlite3.connect(db_path) as c:
        c.execute("UPDATE tasks SET state = 'deferred', reason = 'test'")
    monkeypatch.setattr(commands, "REQUEUE_CHUNK", 3)
    assert main(["requeue", "--db", str(db_path), "--state", "deferred"]) == 0
    assert capsys.readouterr().out == f"requeued 10 task(s): {', '.join(map(str, ids))}\n"
    with sqlite3.connect(db_path) as c:
        order = [r[0] for r in c.execute(
            "SELECT id FROM tasks WHERE state = 'queued' ORDER BY queue_pos, id")]
        commits = c.execute("SELECT count(DISTINCT at) FROM events "
                            "WHERE kind = 'manual_requeue'").fetchone()[0]
    assert order == ids
    assert commits == 4  # 3 + 3 + 3 + 1
    # an id that is not there (or not in that state) is named, not passed over in silence
    assert main(["requeue", "--db", str(db_path), "--id", str(ids[0]), "--id", "9999"]) == 0
    out = capsys.readouterr()
    assert out.out == "requeued 0 task(s)\n"
    assert out.err == (f"coordinator: not requeued (no such task, or not failed or deferred): "
                       f"{ids[0]}, 9999\n")


def test_cli_requeue_of_many_tasks_prints_runs_of_ids_not_every_id(db_path, capsys):
    """50,000 requeued tasks printed one console line of 400 KB, every id in it."""
    import sqlite3

    from coordinator.cli import main
    from coordinator.commands import id_list
    farm = Farm(db_path)
    ids = farm.enqueue(*({"data": i} for i in range(60)))
    farm.close()
    with sqlite3.connect(db_path) as c:
        c.execute("UPDATE tasks SET state = 'deferred', reason = 'test'")
    assert main(["requeue", "--db", str(db_path), "--state", "deferred"]) == 0
    assert capsys.readouterr().out == f"requeued 60 task(s): {ids[0]}-{ids[-1]}\n"
    assert id_list([1, 2, 3]) == "1, 2, 3"
    assert id_list([*range(1, 100, 2), 200, 201, 202], whole_up_to=3, runs_shown=3) == \
        "1, 3, 5, ... and 48 more runs of ids"
    assert id_list([59, *range(1, 59)], runs_shown=3) == "1-59"


def test_dropped_test_cases_are_counted_in_status(db_path, capsys):
    """A run whose outputs were over the executor's limits said so only in its result's
    detail; the count is a column that `status` and its JSON sum."""
    from coordinator.cli import main
    farm = Farm(db_path)
    farm.enqueue({"data": 1}, {"data": 2}, {"data": 3})
    farm.ready(1), farm.ready(2), farm.ready(3)
    tokens = farm.dispatch(1, 2, 3)
    farm.result_raw(1, {"token": tokens[1], "status": "ok", "dropped": 2000,
                        "detail": "dropped 2000 of 3000 output files (0 over 1 bytes; ...)"})
    farm.result_raw(2, {"token": tokens[2], "status": "ok", "dropped": 5})
    farm.result_raw(3, {"token": tokens[3], "status": "ok"})
    farm.close()
    assert main(["status", "--db", str(db_path)]) == 0
    assert "dropped test cases: 2005 in 2 results" in capsys.readouterr().out
    assert main(["status", "--db", str(db_path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["dropped_testcases"], got["dropped_results"]) == (2005, 2)


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


def test_status_and_requeue_leave_an_empty_file_empty(db_path):
    """A read-only command on a 0-byte file (a start that failed early, a `touch`) must not
    turn it into an SQLite database."""
    db_path.write_bytes(b"")
    for args in (["status"], ["requeue", "--state", "all"]):
        got = _cli(*args, "--db", str(db_path))
        assert got.returncode == ExitStatus.USAGE, got.stderr
        assert "holds no campaign yet" in got.stderr, got.stderr
        assert db_path.stat().st_size == 0


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


def test_check_and_status_json_say_a_refusal_in_json_too(db_path, tmp_path):
    """`check --json` and `status --json` of a file they refused printed nothing on stdout
    (one line on stderr, exit 2): a script parsing stdout failed on the empty string. Each
    now prints its own object there with `error` saying why (null when the file was read),
    as for a path the system refuses (a name too long)."""
    _finished_campaign(db_path)
    foreign = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(foreign)) as db, db:
        db.execute("CREATE TABLE notes (x)")
    refusals = {tmp_path / "missing.db": "does not exist (nothing was created)",
                foreign: "is an SQLite database of something else",
                tmp_path / ("x" * 300): "File name too long"}
    for path, why in refusals.items():
        check = _cli("check", "--db", str(path), "--json")
        status = _cli("status", "--db", str(path), "--json")
        for got in (check, status):
            assert got.returncode == ExitStatus.USAGE, (path, got.stderr)
            [line] = got.stderr.splitlines()
            assert line.startswith(f"coordinator: {path}") and why in line, line
            assert json.loads(got.stdout)["error"] == line.removeprefix("coordinator: ")
        assert json.loads(status.stdout) == {"error": status.stderr[13:].rstrip("\n")}
        assert json.loads(check.stdout) == {
            "ok": False, "error": check.stderr[13:].rstrip("\n"), "revision": None,
            "head": head_revision(), "violations": [], "skipped": [], "notes": []}
    read = _cli("check", "--db", str(db_path), "--json")
    assert read.returncode == ExitStatus.OK, read.stderr
    assert set(json.loads(read.stdout)) == set(json.loads(check.stdout))
    assert json.loads(read.stdout)["error"] is None
    assert json.loads(_cli("status", "--db", str(db_path), "--json").stdout)["error"] is None


def test_a_file_db_upgrade_creates_holds_no_campaign_yet_for_every_reader(tmp_path):
    """A schema without its campaign row (`db upgrade` of a path where no file was): `status`
    and `plot` showed an empty campaign of incarnation 0, while `check` said the file held no
    campaign yet. Every reader now gives `check`'s answer."""
    import importlib.util
    db = tmp_path / "typo.db"
    upgrade(db)
    readers = [["status"], ["status", "--json"], ["check"], ["check", "--json"]]
    if importlib.util.find_spec("matplotlib") is not None:
        readers.append(["plot", str(tmp_path / "charts")])
    for command, *rest in readers:
        got = _cli(command, "--db", str(db), *rest)
        assert got.returncode == ExitStatus.USAGE, (command, rest, got.stdout, got.stderr)
        assert got.stderr.startswith(f"coordinator: {db} holds no campaign yet ("), \
            (command, rest, got.stderr)
    assert not (tmp_path / "charts").exists()


def test_db_upgrade_says_when_it_created_the_file(tmp_path):
    """`db upgrade` of a mistyped --db made a new file and said only "schema (new) -> HEAD",
    like an upgrade that worked."""
    db = tmp_path / "typo.db"
    up = _cli("db", "upgrade", "--db", str(db))
    assert up.returncode == 0, up.stderr
    assert up.stdout == f"{db}: schema (new) -> {head_revision()}\n"
    assert up.stderr == (f"coordinator: {db} did not exist: created it, with schema "
                         f"{head_revision()} and no campaign in it yet (`coordinator run --db "
                         f"{db}` starts one); if you meant an existing campaign, check the "
                         f"path and remove this file\n"), up.stderr
    again = _cli("db", "upgrade", "--db", str(db))
    assert again.returncode == 0 and again.stderr == "", again.stderr
    assert again.stdout == f"{db}: schema already at {head_revision()}\n"


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
        assert (f"is damaged (database disk image is malformed): `coordinator check --db "
                f"{db}` says where; restore a copy (remove {db}-wal and {db}-shm first"
                in done.stderr)
        assert "Traceback" not in done.stderr
    with pytest.raises(DatabaseOpenError, match="is damaged"):
        Store.open(db, resume=True)


def test_a_schema_changed_by_hand_is_named_as_such_by_every_command(tmp_path):
    """`DROP INDEX ix_tasks_queue` in a `sqlite3` shell made `status` and `check` end in a
    driver traceback, and a start say "database write failed … fix the storage" (exit 3),
    while `db upgrade` found nothing to do. Each now says the schema was changed outside the
    coordinator and what to do (exit 2)."""
    import sys
    db = tmp_path / "c.db"
    store = Store.open(db)
    with store.transaction("import") as tx:
        enqueue_tasks(tx, [NewTask({"path": f"x{i}"}) for i in range(3)])
    store.close()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("DROP INDEX ix_tasks_queue")
    for command in (["status"], ["check"], ["requeue", "--state", "deferred"]):
        done = subprocess.run([sys.executable, "-m", "coordinator", *command, "--db", str(db)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == ExitStatus.USAGE, (command, done.stderr[-2000:])
        assert ("its schema is not the one its revision defines (no such index: "
                "ix_tasks_queue): it was changed outside the coordinator") in done.stderr
        assert "Traceback" not in done.stderr
    with pytest.raises(DatabaseOpenError, match="changed outside the coordinator"):
        Store.open(db, resume=True)


@pytest.mark.parametrize("command", [["check"], ["check", "--json"], ["requeue", "--id", "9"],
                                     ["status"]])
def test_a_reader_that_leaves_early_costs_no_traceback_and_not_the_status(db_path, command):
    """`check | head`, a script that stopped reading: the write failed with EPIPE, a
    BrokenPipeError traceback followed and the exit was 1 (for `check`, "violations found";
    for `requeue`, after its commits)."""
    import sys
    _finished_campaign(db_path)
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", *command, "--db",
                             str(db_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command (a new interpreter) has written anything
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitStatus.OK, err
    assert b"Traceback" not in err and b"BrokenPipe" not in err


# -- write commands on read-only media -------------------------------------------------------

def _cli_in_read_only_directory(src, *args: str) -> subprocess.CompletedProcess:
    """`coordinator ARGS` with `{ro}` in them naming a read-only view of `src`: as root, a
    read-only bind mount in a private mount namespace (modes do not stop root); otherwise
    `src` itself, its files and itself made read-only by their modes."""
    import os
    import shutil
    import sys
    if os.geteuid() != 0:
        files = [p for p in src.iterdir()]
        for p in (*files, src):
            p.chmod(0o555 if p.is_dir() else 0o444)
        try:
            return _cli(*(a.format(ro=src) for a in args))
        finally:
            for p in (src, *files):
                p.chmod(0o755 if p.is_dir() else 0o644)
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` to make a read-only mount as root")
    ro = src.parent / "ro"
    ro.mkdir(exist_ok=True)
    script = (f'mount --bind "{src}" "{ro}" || exit 98; '
              f'mount -o remount,bind,ro "{ro}" || exit 98; '
              f'touch "{ro}/probe" 2>/dev/null && exit 99; '
              f'exec "$@"')
    got = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                          sys.executable, "-m", "coordinator",
                          *(a.format(ro=ro) for a in args)],
                         capture_output=True, text=True, timeout=60, check=False)
    if got.returncode == 99:
        pytest.fail("the read-only bind mount was writable")
    if got.returncode == 98 or got.stderr.startswith("unshare:"):
        pytest.skip(f"no read-only mount can be made here: {got.stderr.strip()[:200]}")
    return got


def test_a_write_command_on_read_only_media_says_so_in_one_message(tmp_path):
    """On read-only media `requeue` said "cannot switch the database to WAL mode" when no
    -wal was beside the file, and failed its first write (exit 3) when one was; `db upgrade`
    said "a run needs a writable node-local path". Each now names the file, says it is
    read-only and what to do, whichever side files exist; nothing is created or changed."""
    import re
    import shutil

    from conftest import defer
    campaign, plain, with_wal = tmp_path / "c.db", tmp_path / "plain", tmp_path / "with_wal"
    for d in (plain, with_wal):
        d.mkdir()
    farm = Farm(campaign)
    defer(farm, {"data": 1})  # something for `requeue` to write
    farm.close()
    shutil.copy(campaign, plain / "c.db")
    with contextlib.closing(sqlite3.connect(campaign, isolation_level=None)) as db:
        db.execute("PRAGMA wal_autocheckpoint = 0")
        db.execute("UPDATE tasks SET reason = 'held' WHERE state = 'deferred'")  # in the -wal
        for side in ("", "-wal", "-shm"):  # as a master killed with kill -9 leaves them
            shutil.copy(f"{campaign}{side}", with_wal / f"c.db{side}")
    refusal = re.compile(
        r"coordinator: \S+/c\.db is read-only: the file (is on a read-only filesystem|cannot "
        r"be written \(its mode, or an immutable file: `lsattr -d \S+` shows an i\))\. This "
        r"command writes to the campaign: copy c\.db and its -wal, if there is one, to a "
        r"writable node-local directory and run it on the copy; `coordinator status` and "
        r"`coordinator check` read the file where it is\n")
    for src in (plain, with_wal):
        before = _listing(src)
        assert ("c.db-wal" in before) == (src is with_wal)
        for command in (["requeue", "--state", "all"], ["db", "upgrade"]):
            got = _cli_in_read_only_directory(src, *command, "--db", "{ro}/c.db")
            assert got.returncode == ExitStatus.USAGE, (src.name, command, got.stderr)
            assert refusal.fullmatch(got.stderr), (src.name, command, got.stderr)
        new = _cli_in_read_only_directory(src, "db", "upgrade", "--db", "{ro}/new.db")
        assert new.returncode == ExitStatus.USAGE, new.stderr
        assert re.fullmatch(r"coordinator: \S+/new\.db cannot be created: its directory \S+ "
                            r"(is on a read-only filesystem|cannot be written \(.*\)); "
                            r"choose a --db path in a writable node-local directory\n",
                            new.stderr), new.stderr
        assert _listing(src) == before


# -- paths SQLite cannot open ----------------------------------------------------------------

def _path_of_length(base, length: int, name: str = "c.db"):
    """A path of `length` bytes under `base`: directories of up to 200 bytes, then `name`
    padded."""
    import os
    parts, left = [], length - len(os.fsencode(base)) - 1
    while left > 200 + 1 + len(name) + 50:
        parts.append("d" * 200)
        left -= 201
    path = base.joinpath(*parts, "p" * (left - len(name)) + name)
    assert len(os.fsencode(path)) == length
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_a_path_too_long_for_sqlite_is_said_so_by_run_status_and_check(tmp_path):
    """SQLite opens no path longer than 504 bytes (its 512, less room for a journal's name),
    once links are resolved: `status`, `check`, `requeue` and a run's master said only
    "cannot be opened: unable to open database file", the run after MPI had started. Each
    now says the path is too long for SQLite and how long it is; a run says so before it
    launches anything."""
    import shutil
    campaign = tmp_path / "c.db"
    _finished_campaign(campaign)
    fits, over = _path_of_length(tmp_path / "a", 504), _path_of_length(tmp_path / "b", 505)
    for path in (fits, over):
        shutil.copy(campaign, path)
    assert _cli("status", "--db", str(fits)).returncode == 0
    assert _cli("check", "--db", str(fits)).returncode == 0
    said = ("the path is too long for SQLite (505 bytes{}; it opens at most 504): put the "
            "campaign in a directory with a shorter path (a shorter symbolic link to it does "
            "not help: SQLite opens the file by its resolved path)\n")
    short = tmp_path / "short"
    short.symlink_to(over.parent)
    new = over.with_name(over.name[:-len("c.db")] + "n.db")
    for db, resolved in ((over, ""), (short / over.name, " with its links resolved")):
        for command in (["status"], ["check"], ["requeue"], ["check", "--json"]):
            got = _cli(*command, "--db", str(db))
            assert got.returncode == ExitStatus.USAGE, (command, got.stderr)
            assert got.stderr == f"coordinator: {db}: " + said.format(resolved), \
                (command, got.stderr)
    # (--mpiexec /bin/false: nothing would be launched if the check let it through)
    got = _cli("run", "--db", str(new), "--demo", "2", "--mpiexec", "/bin/false")
    assert got.returncode == ExitStatus.USAGE, got.stderr
    assert got.stderr == f"coordinator: {new}: " + said.format(""), got.stderr
    assert not new.exists()
    # A name linking to the campaign is measured as SQLite measures it: up to 511 bytes as
    # given, the links resolved as they come (here to a short path), and 504 once resolved.
    opens, too_long = (_path_of_length(tmp_path / "c", 508, "link.db"),
                       _path_of_length(tmp_path / "e", 600, "link.db"))
    for link in (opens, too_long):
        link.symlink_to(campaign)
    assert _cli("status", "--db", str(opens)).returncode == 0
    got = _cli("status", "--db", str(too_long))
    assert got.returncode == ExitStatus.USAGE, got.stderr
    assert got.stderr == (f"coordinator: {too_long}: the path is too long for SQLite (600 "
                          f"bytes, of which it takes at most 511 before it resolves the "
                          f"symbolic links in it): name the file by a shorter path\n")


_DIES_WITH_ITS_CAMPAIGN_IN_THE_WAL = """
import os, sys
from store.campaign import Store
from store.tasks import NewTask, enqueue_tasks
store = Store.open(sys.argv[1])
with store.transaction("import") as tx:
    enqueue_tasks(tx, [NewTask({"data": i}) for i in range(100)])
os._exit(0)
"""


def test_a_reader_that_cannot_read_the_wal_says_so_not_that_there_is_no_campaign(tmp_path):
    """A campaign whose every commit is still in its -wal (a master killed early), on
    read-only media, where SQLite reads a -wal only through a -shm it cannot make there,
    and a TMPDIR too small for the copy that is read instead: `status` and `check` said it
    "holds no campaign yet" (exit 2), `--json` too. The refusal says the -wal was not
    read, its size, why, and what to do."""
    import os
    import shutil
    import sys
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and `unshare`: a read-only bind mount and a small tmpfs")
    src = tmp_path / "src"
    src.mkdir()
    db = src / "c.db"
    # A master that dies (os._exit: nothing closed, no checkpoint) once the campaign is made.
    subprocess.run([sys.executable, "-c", _DIES_WITH_ITS_CAMPAIGN_IN_THE_WAL, str(db)],
                   check=True, timeout=60)
    (src / "c.db-shm").unlink()  # (copied without it)
    with contextlib.closing(sqlite3.connect(f"file:{db}?immutable=1", uri=True)) as conn:
        assert conn.execute("SELECT count(*) FROM campaign").fetchone() == (0,)
    wal_bytes = (src / "c.db-wal").stat().st_size
    ro, small = tmp_path / "ro", tmp_path / "small"
    ro.mkdir()
    small.mkdir()
    script = (f'mount --bind "{src}" "{ro}" && mount -o remount,bind,ro "{ro}" && '
              f'mount -t tmpfs -o size=64k tmpfs "{small}" || exit 98; exec "$@"')
    for command in (["status"], ["status", "--json"], ["check"], ["check", "--json"]):
        got = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
             sys.executable, "-m", "coordinator", *command, "--db", str(ro / "c.db")],
            capture_output=True, text=True, timeout=60, check=False,
            env={**os.environ, "TMPDIR": str(small)})
        if got.returncode == 98 or got.stderr.startswith("unshare:"):
            pytest.skip(f"no mount can be made here: {got.stderr.strip()[:200]}")
        assert got.returncode == ExitStatus.USAGE, (command, got.stderr)
        assert "holds no campaign yet" not in got.stderr + got.stdout
        said = json.loads(got.stdout)["error"] if "--json" in command else got.stderr
        assert (f"the {wal_bytes} bytes of its -wal (commits not yet copied into the file) "
                f"are not read: no copy could be made in TMPDIR ({small}: No space left on "
                f"device); point TMPDIR at a directory with") in said, (command, said)
        assert f"or copy {ro / 'c.db'} and {ro / 'c.db'}-wal to a writable directory" in said


@pytest.mark.parametrize("change", [
    "UPDATE alembic_version SET version_num = 'custom'",
    "DELETE FROM alembic_version",
    "INSERT INTO alembic_version VALUES ('0003')",
    "DROP INDEX ix_tasks_queue",
], ids=["unknown stamp", "no stamp", "two stamps", "index dropped"])
def test_a_refusal_that_says_to_restore_a_copy_says_to_remove_the_wal_first(tmp_path, change):
    """A copy put over a campaign's file with the old -wal still beside it is silently turned
    back into the old campaign (SQLite applies the -wal it finds to the file). The refusals
    said "restore a copy" and no more."""
    db = tmp_path / "c.db"
    _finished_campaign(db)
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(change)
    got = _cli("status", "--db", str(db))
    assert got.returncode == ExitStatus.USAGE, got.stderr
    assert (f"restore a copy (remove {db}-wal and {db}-shm first: SQLite would apply the old "
            f"-wal to the copy)") in got.stderr, got.stderr
