"""The master rank's start: a usage error is one line and ExitStatus.USAGE; anything else is a
bug, shown with its traceback, and ExitStatus.INTERNAL. Either way every worker hears the
verdict (sent to each), and nothing is left half-made. Driven without MPI: the transport is
a stand-in that records the verdict."""

from __future__ import annotations

import contextlib
import sqlite3

import pytest
from campaigns import damage_a_tasks_page, queued_campaign
from fakes import InstantWorkers, VerdictTransport

from coordinator import master_rank
from coordinator.cli import _parser
from coordinator.config import resolve_run
from coordinator.errors import UsageError
from coordinator.exits import ExitStatus
from coordinator.master import Master
from store import campaign as campaign_module
from store.errors import DamagedDatabaseError


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


# -- a --resume reads only what it has not imported ------------------------------------------

def started(db_path, *args: str) -> master_rank.MasterRank:
    """The master rank's start alone (import included), its store closed again."""
    cfg = resolve_run(_parser().parse_args(["run", "--db", str(db_path), *args]))
    rank = master_rank.MasterRank(cfg, VerdictTransport())
    try:
        rank._start()
    finally:
        if rank.store is not None:
            rank.store.close()
        rank._release_output()
    return rank


def rows(db_path, sql: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        return db.execute(sql).fetchall()


def test_a_resume_does_not_read_an_unchanged_tasks_file_again(db_path, tmp_path, monkeypatch):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(f'{{"data": {i}}}\n' for i in range(5)))
    started(db_path, "--tasks", str(tasks))
    assert rows(db_path, "SELECT incarnation, kind, source, count, added FROM imports") == [
        (1, "tasks_file", str(tasks.resolve()), 5, 5)]

    def never(_path):
        raise AssertionError("the unchanged tasks file was read again")
    with monkeypatch.context() as m:
        m.setattr(master_rank, "load_tasks_jsonl", never)
        again = started(db_path, "--resume", "--tasks", str(tasks))
    assert any("is unchanged since incarnation 1 imported it (5 tasks" in n
               for n in again.notes)
    # Changed (a line appended): read again, the known tasks found there, the new one added.
    with tasks.open("a") as f:
        f.write('{"data": 5}\n')
    changed = started(db_path, "--resume", "--tasks", str(tasks))
    assert not any("unchanged" in n for n in changed.notes)
    assert rows(db_path, "SELECT incarnation, count, added FROM imports ORDER BY id") == [
        (1, 5, 5), (3, 6, 1)]
    assert rows(db_path, "SELECT count(*) FROM tasks") == [(6,)]
    # The same file under another name (a symlink) is the same file.
    link = tmp_path / "link.jsonl"
    link.symlink_to(tasks)
    with monkeypatch.context() as m:
        m.setattr(master_rank, "load_tasks_jsonl", never)
        started(db_path, "--resume", "--tasks", str(link))


def test_a_resume_makes_only_the_demo_tasks_past_those_already_in(db_path, monkeypatch):
    started(db_path, "--demo", "4")
    made: list[int] = []
    real = master_rank.enqueue_tasks

    def counting(tx, new, **kw):
        new = list(new)
        made.extend(t.payload["data"]["n"] for t in new)
        return real(tx, new, **kw)
    monkeypatch.setattr(master_rank, "enqueue_tasks", counting)
    more = started(db_path, "--resume", "--demo", "6")
    assert made == [4, 5]
    assert any(n.startswith("4 of 6 tasks were already in the campaign (demo tasks imported "
                            "by incarnation 1)") for n in more.notes)
    made.clear()
    fewer = started(db_path, "--resume", "--demo", "5")
    assert made == [] and any(n.startswith("5 of 5 tasks were already") for n in fewer.notes)
    assert rows(db_path, "SELECT incarnation, kind, count, added FROM imports ORDER BY id") == [
        (1, "demo", 4, 4), (2, "demo", 6, 2)]
    assert rows(db_path, "SELECT count(*), min(json_extract(payload, '$.data.n')), "
                         "max(json_extract(payload, '$.data.n')) FROM tasks") == [(6, 0, 5)]


def test_an_import_that_is_undone_leaves_no_import_row(db_path, tmp_path):
    """The row and the tasks are one transaction: a tasks file that turns out bad imports
    nothing and says nothing was imported, so the next --resume reads it again."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"data": 1}\n')
    started(db_path, "--tasks", str(tasks))
    tasks.write_text('{"data": 1}\n{"data": 2}\n{"nope": 3}\n')
    got, transport = start(db_path, "--resume", "--tasks", str(tasks))
    assert got == ExitStatus.USAGE
    assert rows(db_path, "SELECT count, added FROM imports") == [(1, 1)]
    assert rows(db_path, "SELECT count(*) FROM tasks") == [(1,)]


# -- a file damaged under the run ---------------------------------------------------------------

class AbortingInstantWorkers(InstantWorkers):
    """Instant workers of a job without ULFM, whose end the master asks for with MPI_Abort."""

    def __init__(self) -> None:
        super().__init__(3)
        self.aborted: list[int] = []
        self.starts: list[int] = []

    def send_start(self, data: bytes, dest: int) -> None:
        self.starts.append(dest)

    def abort(self, status: int) -> None:
        self.aborted.append(int(status))


def test_a_page_damaged_under_the_run_ends_it_as_a_damaged_file_without_a_write(
        tmp_path, monkeypatch, capsys):
    """A round that met a damaged page stopped the run with exit 3 and "nothing is lost —
    fix the storage and continue with --resume": each resume charged an attempt to the tasks
    in flight and ran until it met the page again. It ends as a damaged file (exit 2), says
    to run `coordinator check` and to restore a copy, and writes nothing more to it."""
    db = tmp_path / "k.db"
    queued_campaign(db)
    damage_a_tasks_page(db, which=len(_tasks_leaf_pages(db)) // 2)
    monkeypatch.setattr(campaign_module, "START_CHECK_BYTES", 0)  # met by a round, then
    transactions = []
    real_write_tx = campaign_module.write_tx

    def write_tx(conn, operation, **kwargs):
        transactions.append(operation)
        return real_write_tx(conn, operation, **kwargs)
    monkeypatch.setattr(campaign_module, "write_tx", write_tx)
    cfg = resolve_run(_parser().parse_args(["run", "--db", str(db), "--resume",
                                            "--batch", "1", "--no-progress"]))
    transport = AbortingInstantWorkers()
    rank = master_rank.MasterRank(cfg, transport)
    damaged_at = []
    real_round = Master._round

    def round_(self):
        try:
            return real_round(self)
        except DamagedDatabaseError:
            damaged_at.append(len(transactions))
            raise
    monkeypatch.setattr(Master, "_round", round_)
    got = rank.run()
    err = capsys.readouterr().err
    assert got == ExitStatus.USAGE and transport.aborted == [ExitStatus.USAGE]
    assert rank.master.summary.committed > 0  # it ran, and met the page in a round
    assert damaged_at == [len(transactions)]  # no transaction after it
    assert f"{db} is damaged (database disk image is malformed)" in err
    assert f"`coordinator check --db {db}`" in err and "restore a copy" in err
    assert "fix the storage" not in err and "continue with --resume" not in err
    assert "Traceback" not in err


def _tasks_leaf_pages(db) -> list[int]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return [p for (p,) in conn.execute("SELECT pageno FROM dbstat WHERE name = 'tasks' "
                                           "AND pagetype = 'leaf'")]


# -- a disk too full to start on --------------------------------------------------------------

def test_a_new_campaign_the_disk_has_no_room_for_is_refused_and_leaves_nothing(
        tiny_fs, capsys):
    """A start on a disk with room for part of the schema exited 3 ("fix the storage and
    start it again") and left a file at revision 0004 without a campaign, which `status`
    then said to `db upgrade`. Nothing is left, and it is exit 2, as README's table says of
    a disk too full to start on."""
    filler = tiny_fs / "filler"
    filler.write_bytes(b"\0" * (1024 - 160) * 1024)  # ~160 KiB left: the schema stops midway
    db = tiny_fs / "c.db"
    got, transport = start(db, "--demo", "10")
    err = capsys.readouterr().err
    assert got == ExitStatus.USAGE and transport.verdicts == [ExitStatus.USAGE], err
    assert "database or disk is full" in err and "the new campaign could not be written" in err
    assert "the file this start began was removed, nothing was changed" in err
    assert "Traceback" not in err and "fix the storage" not in err
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["filler"]
