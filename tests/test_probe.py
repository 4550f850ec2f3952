"""A file that is not a current campaign is read, never written (store/probe.py), by every
command and by Alembic's own command line, which refuses it with the very line `coordinator
db upgrade` says."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Farm

from coordinator.exits import ExitStatus

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = (["status"], ["check"], ["requeue"], ["db", "upgrade"], ["run", "--np", "2"],
            ["run", "--resume", "--np", "2"])


def _coordinator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def _alembic(db: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "alembic", "-x", f"db={db}", "upgrade",
                           "head"], capture_output=True, text=True, timeout=60, cwd=ROOT)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _sql(db: Path, *statements: str) -> None:
    with contextlib.closing(sqlite3.connect(db)) as c, c:
        for statement in statements:
            c.execute(statement)


def _another_apps_db(path: Path) -> None:
    _sql(path, "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)",
         "INSERT INTO users (name) VALUES ('ada')")


def _unstamped_campaign(path: Path) -> None:
    farm = Farm(path)
    farm.close()
    _sql(path, "DELETE FROM alembic_version")


def _garbage_stamp(path: Path) -> None:
    farm = Farm(path)
    farm.close()
    _sql(path, "UPDATE alembic_version SET version_num = 'not-a-revision'")


@pytest.mark.parametrize("make, says", [
    (_another_apps_db, "is an SQLite database of something else (tables users)"),
    (lambda p: p.write_text("a text file\n"), "is not an SQLite database"),
    (_unstamped_campaign, "holds a campaign's tables but no schema stamp"),
    (_garbage_stamp, "is not a revision this coordinator or a newer one writes"),
])
def test_what_is_not_a_campaign_is_refused_by_every_command_and_never_written(
        tmp_path, make, says):
    """`status`, `requeue`, `db upgrade` and `run` switched another application's SQLite file
    to WAL mode for good before refusing it; `alembic -x db=PATH upgrade head` added every
    campaign table to it, exit 0, and gave tracebacks for the rest."""
    db = tmp_path / "x.db"
    make(db)
    before = _files(tmp_path)
    for command in COMMANDS:
        done = _coordinator(*command, "--db", str(db))
        assert done.returncode == ExitStatus.USAGE, (command, done.stderr)
        assert says in done.stderr and "Traceback" not in done.stderr, (command, done.stderr)
        assert _files(tmp_path) == before, command
    line = _coordinator("db", "upgrade", "--db", str(db)).stderr
    done = _alembic(db)
    assert done.returncode == ExitStatus.USAGE and line in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert _files(tmp_path) == before


@pytest.mark.parametrize("make, says", [
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: None, "cannot be created: the directory"),
])
def test_alembic_refuses_a_path_that_cannot_be_a_campaign_as_db_upgrade_does(tmp_path, make,
                                                                            says):
    db = tmp_path / "d.db" if says == "is a directory" else tmp_path / "nowhere" / "d.db"
    make(db)
    line = _coordinator("db", "upgrade", "--db", str(db)).stderr
    done = _alembic(db)
    assert says in line and done.returncode == ExitStatus.USAGE and line in done.stderr
    assert "Traceback" not in done.stderr


def test_dev_null_is_refused_and_nothing_is_made_beside_it():
    """`--db /dev/null` made /dev/null-journal."""
    for command in (["status"], ["run", "--np", "2"], ["db", "upgrade"]):
        done = _coordinator(*command, "--db", "/dev/null")
        assert done.returncode == ExitStatus.USAGE and "is not a regular file" in done.stderr
    assert not Path("/dev/null-journal").exists() and not Path("/dev/null-wal").exists()


def test_alembic_upgrades_an_older_campaign_and_creates_a_new_one(tmp_path):
    from store import versioning
    old, new = tmp_path / "old.db", tmp_path / "new.db"
    versioning.upgrade(old, "0006")
    for db in (old, new):
        done = _alembic(db)
        assert done.returncode == 0, done.stderr
    for db in (old, new):
        with contextlib.closing(sqlite3.connect(db)) as c:
            assert c.execute("SELECT version_num FROM alembic_version").fetchall() == [
                (versioning.head_revision(),)]


def test_a_link_to_a_file_in_a_missing_directory_is_refused_saying_so(tmp_path):
    """A dangling symbolic link as --db gave a bare "[Errno 2] No such file or directory";
    a link to a new file in a directory that exists still makes the campaign there."""
    from store.errors import DatabaseOpenError
    from store.probe import probe

    dangling = tmp_path / "dangling.db"
    dangling.symlink_to(tmp_path / "nowhere" / "c.db")
    with pytest.raises(DatabaseOpenError, match=r"is a symbolic link to .*nowhere/c\.db, which "
                                                 r"cannot be created: the directory .*nowhere "
                                                 r"does not exist"):
        probe(dangling)
    fresh = tmp_path / "fresh.db"
    fresh.symlink_to(tmp_path / "c.db")
    assert probe(fresh).exists is False
