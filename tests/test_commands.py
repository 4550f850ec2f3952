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
    assert out == f"{db_path}: consistent (4 tasks, schema 0008)\n"
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
