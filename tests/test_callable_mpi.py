"""A `--callable` task farm end to end under real mpiexec: what becomes of the test cases a
callable returns (its bulk output), and how a task's files are found."""

from __future__ import annotations

import hashlib
import json

import pytest
from mpi_jobs import check_conservation, output_files, query, run

from coordinator.exits import ExitStatus

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

#: Bulk output as docs/running.md recommends: task n writes b"x" * (n % 3), so tasks 1 and
#: 4 (and 2 and 5) write the same bytes; task 0 writes an empty file.
BULK = """\
def work(task):
    n = task["data"]["n"]
    return {"n": n, "testcases": {"out-1.bin": b"x" * (n % 3)}}
"""


def test_a_callables_test_cases_are_its_output_not_new_tasks(tmp_path):
    """Fed back by default, a callable's bulk output became tasks `{"path": "DB.out/<hash>"}`
    its function then failed on (KeyError), and with --max-depth 0 (the default) could run
    for ever. Off by default now (an explicit --feedback still turns it on), and each
    result's value ties its names to the files, also a file another task wrote first (its
    own `testcases` count is 0: the content is written once)."""
    mod = tmp_path / "bulk.py"
    mod.write_text(BULK)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"data": {{"n": {i}}}}}\n' for i in range(6)))
    db, out = tmp_path / "c.db", tmp_path / "c.db.out"
    done = run(["run", "--db", str(db), "--tasks", str(tasks), "--callable", f"{mod}:work",
                "--no-progress"], np=3)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    check_conservation(db, expected_tasks=6)
    assert query(db, "SELECT count(*) FROM tasks WHERE origin = 'result'") == [(0,)]
    rows = query(db, "SELECT json_extract(t.payload, '$.data.n'), r.status, r.value, "
                     "r.testcases FROM results r JOIN tasks t ON t.id = r.task_id ORDER BY 1")
    assert [status for _, status, _, _ in rows] == ["ok"] * 6
    for n, _, value, _ in rows:
        content = b"x" * (n % 3)
        digest = hashlib.sha256(content).hexdigest()
        assert json.loads(value) == {"n": n, "testcases": {"out-1.bin": digest}}
        # where docs/running.md says a task's file is
        assert (out / digest[:16]).read_bytes() == content
    assert sorted(p.name for p in output_files(out)) == sorted(
        hashlib.sha256(b"x" * k).hexdigest()[:16] for k in range(3))
    assert sum(written for *_, written in rows) == 3  # each content once, by its first task
    assert json.loads(query(db, "SELECT settings FROM campaign")[0][0])["feedback"] is False

    # Asked for, feedback runs the callable on its own output files, as before.
    fed = tmp_path / "fed.db"
    done = run(["run", "--db", str(fed), "--tasks", str(tasks), "--callable", f"{mod}:work",
                "--feedback", "--max-depth", "1", "--no-progress"], np=3)
    assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
    assert query(fed, "SELECT count(*) FROM tasks WHERE origin = 'result'") == [(3,)]
    assert query(fed, "SELECT count(*) FROM results WHERE status = 'error' "
                      "AND detail LIKE 'KeyError: ''data''%'") == [(3,)]
