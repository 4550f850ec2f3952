"""The command line (coordinator/cli.py): the parser's refusals, and `main` itself (it loads no
MPI, and a reader that leaves early is not an error)."""

from __future__ import annotations

import pytest

from coordinator.cli import _parser
from coordinator.exits import ExitStatus


@pytest.mark.parametrize("value", ["99999999999999999999999", "0", "-3", "x"])
def test_requeue_ids_sqlite_cannot_hold_are_usage_errors(value, capsys):
    """An id past SQLite's integers ended `requeue` in an OverflowError traceback."""
    with pytest.raises(SystemExit) as ended:
        _parser().parse_args(["requeue", "--db", "c.db", "--id", value])
    assert ended.value.code == ExitStatus.USAGE and "--id" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "yesterday"])
def test_requeue_since_that_is_no_time_is_a_usage_error(value, capsys):
    """`--since nan` (or 1e400, which is inf) was taken: it matched nothing, and `requeue`
    said it requeued no task, exit 0."""
    with pytest.raises(SystemExit) as ended:
        _parser().parse_args(["requeue", "--db", "c.db", f"--since={value}"])
    assert ended.value.code == ExitStatus.USAGE and "is not a time" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "1001", "many", "1.5"])
def test_a_batch_size_outside_1_to_1000_or_auto_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as ended:
        _parser().parse_args(["run", "--db", "c.db", "--batch", value])
    assert ended.value.code == ExitStatus.USAGE and "--batch" in capsys.readouterr().err


@pytest.mark.parametrize("value, size", [("1", 1), ("1000", 1000), ("auto", "auto")])
def test_a_batch_size_in_range_or_auto_is_taken(value, size):
    assert _parser().parse_args(["run", "--db", "c.db", "--batch", value]).batch == size


@pytest.mark.parametrize("flag, value", [("--tasks", "t.jsonl"), ("--demo", "5"),
                                         ("--callable", "m:f"), ("--out", "o")])
def test_a_single_valued_flag_given_twice_is_an_error(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["run", "--db", str(tmp_path / "c.db"), flag, value, flag, value])
    assert e.value.code == ExitStatus.USAGE
    assert f"{flag} given twice" in capsys.readouterr().err


def test_the_command_line_does_not_start_mpi():
    """`status`, `requeue`, `db upgrade`, `--help` and the self-launcher never need MPI: loading
    it ran MPI_Init (~1 s here; an abort on a login node where MPI cannot start)."""
    import subprocess
    import sys
    probe = ("import sys, coordinator.cli\n"
             "sys.exit('mpi4py.MPI' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0


def test_status_into_a_closed_pipe_is_quiet(tmp_path):
    """`coordinator status | head -1`: the reader leaving early is not an error."""
    import subprocess
    import sys

    from store.campaign import Store
    Store.open(tmp_path / "c.db").close()
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "status", "--db",
                             str(tmp_path / "c.db")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the status is printed (the interpreter starts first)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["run", "--demo", "3", "--no-progress"], ["status"],
                                     ["check"], ["requeue", "--state", "failed"],
                                     ["plot", "charts"]])
def test_a_path_the_system_refuses_is_one_line_not_a_traceback(tmp_path, command):
    """A name over 255 bytes (or, for a user who is not root, a directory they cannot
    search): Path.exists() and the like raise, and every command printed a traceback, exit
    1. A refusal now: one line naming the path and why, exit 2."""
    import subprocess
    import sys

    db = tmp_path / ("a" * 300 + ".db")
    got = subprocess.run([sys.executable, "-m", "coordinator", *command[:1], "--db", str(db),
                          *command[1:]], capture_output=True, text=True, timeout=120,
                         check=False, cwd=tmp_path)
    assert got.returncode == ExitStatus.USAGE, got.stderr
    assert "Traceback" not in got.stderr and "File name too long" in got.stderr
    assert got.stderr.count("\n") == 1, got.stderr


def test_a_path_the_console_cannot_encode_is_still_said_on_one_line(tmp_path):
    """stderr escapes what its encoding cannot hold: an ASCII console got a crash ("lost
    sys.stderr") instead of the refusal when stdout and stderr were both made to pass
    surrogates through."""
    import os
    import subprocess
    import sys
    got = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db",
                          str(tmp_path / "é.db")], capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONIOENCODING": "ascii"}, check=False)
    assert got.returncode == ExitStatus.USAGE, got.stderr
    assert got.stderr.endswith(b"\\xe9.db does not exist (nothing was created)\n")


@pytest.mark.parametrize("command", [["run"], ["status"], ["check"], ["requeue"],
                                     ["db", "upgrade"], ["plot"]])
def test_an_empty_db_path_is_said_to_be_empty(command, capsys):
    """`--db ""` is Path("."): it was said to be "--db . is a directory"."""
    with pytest.raises(SystemExit) as ended:
        _parser().parse_args([*command, "--db", "", *(["o"] if command == ["plot"] else [])])
    assert ended.value.code == ExitStatus.USAGE
    assert "argument --db: the path is empty" in capsys.readouterr().err


def test_a_path_under_a_regular_file_is_said_to_be_under_no_directory(tmp_path):
    """`--db txt.db/x.db`, txt.db a regular file, was said to be in "the directory txt.db",
    which "does not exist"."""
    from coordinator.config import ConfigError, resolve_run
    from store.errors import DatabaseOpenError
    from store.probe import probe
    from store.readonly import readonly_connector

    (tmp_path / "txt.db").write_text("notes\n")
    db = tmp_path / "txt.db" / "x.db"
    with pytest.raises(DatabaseOpenError, match=r"x\.db cannot be created: .*txt\.db is not a "
                                                r"directory$"):
        probe(db)
    with pytest.raises(DatabaseOpenError, match=r"x\.db does not exist: .*txt\.db is not a "
                                                r"directory \(nothing was created\)$"):
        readonly_connector(db)
    with pytest.raises(ConfigError, match=r"^--stats-file .*s: .*txt\.db is not a directory$"):
        resolve_run(_parser().parse_args(["run", "--db", str(tmp_path / "c.db"),
                                          "--stats-file", str(db.with_name("s"))]))
    with pytest.raises(DatabaseOpenError, match="the directory .*missing does not exist"):
        probe(tmp_path / "missing" / "x.db")  # (a missing one is still said so)
