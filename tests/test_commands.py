"""The operator's commands (`coordinator status`, `check`, `requeue`, `db upgrade`) on real
campaign files, through the command line's own `main`."""

from __future__ import annotations

import contextlib
import json
import sqlite3

import pytest
from conftest import Farm

from coordinator.cli import main
from coordinator.exits import ExitStatus


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
    assert out == f"{db_path}: consistent (4 tasks, schema 0009)\n"
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
