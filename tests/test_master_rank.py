"""The master rank's start: a usage error is one line and ExitStatus.USAGE; anything else is a
bug, shown with its traceback, and ExitStatus.INTERNAL. Either way every worker hears the
verdict (sent to each), and nothing is left half-made. Driven without MPI: the transport is
a stand-in that records the verdict."""

from __future__ import annotations

import pytest
from fakes import VerdictTransport

from coordinator import master_rank
from coordinator.cli import _parser
from coordinator.config import resolve_run
from coordinator.errors import UsageError
from coordinator.exits import ExitStatus


def start(db_path, *args: str) -> tuple[int, VerdictTransport]:
    cfg = resolve_run(_parser().parse_args(["run", "--db", str(db_path), *args]))
    transport = VerdictTransport()
    return master_rank.MasterRank(cfg, transport).run(), transport


@pytest.mark.parametrize("error, status", [
    (UsageError("tasks file 'x' holds no tasks"), ExitStatus.USAGE),
    (ValueError("a bug"), ExitStatus.INTERNAL),
    (KeyError("a bug"), ExitStatus.INTERNAL),
])
def test_a_start_is_refused_as_usage_only_for_a_usage_error(db_path, tmp_path, monkeypatch,
                                                            capsys, error, status):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"data": 1}\n')

    def load(_path):
        raise error
    monkeypatch.setattr(master_rank, "load_tasks_jsonl", load)
    got, transport = start(db_path, "--tasks", str(tasks))
    err = capsys.readouterr().err
    assert got == status and transport.verdicts == [int(status)]
    if status is ExitStatus.USAGE:
        assert err.splitlines()[0] == f"coordinator: {error}" and "Traceback" not in err
    else:
        assert "Traceback" in err and "internal error before the run started" in err
    assert not db_path.exists()  # refused before the database was touched


def test_a_real_bad_tasks_file_is_a_usage_error(db_path, tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"data": 1}\n{"nope": 2}\n')
    got, transport = start(db_path, "--tasks", str(tasks))
    err = capsys.readouterr().err
    assert got == ExitStatus.USAGE and transport.verdicts == [ExitStatus.USAGE]
    assert "tasks.jsonl:2: unknown key 'nope'" in err and "Traceback" not in err
