"""`coordinator status`: one screen for a whole campaign, like `afl-whatsup`, and `--json` with
the same figures; on campaign files made by the real master, read-only."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from campaigns import copy_of, finding_campaign

from coordinator.cli import main
from coordinator.exits import ExitStatus
from coordinator.progress import clock_utc
from store.campaign import Store
from store.engine import read_file
from store.observe import record_observation
from store.stats import read_stats, stats_text


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("status") / "c.db"
    assert finding_campaign(db).committed == 300
    return db


def _status(db: Path, capsys) -> dict:
    assert main(["status", "--db", str(db), "--json"]) == ExitStatus.OK
    return json.loads(capsys.readouterr().out)


def _rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return c.execute(sql).fetchall()


def test_status_json_keeps_its_keys_and_adds_the_campaigns_figures(campaign, capsys):
    got = _status(campaign, capsys)
    old = {"tasks", "results", "results_by_status", "quarantine", "requeued", "deferred",
           "watchdog_timeouts", "watchdog_recoveries", "incarnation", "schema_revision",
           "master", "dropped_testcases", "dropped_results"}
    new = {"now", "campaign_created_at", "campaign_age_s", "incarnation_started_at",
           "incarnation_run_s", "source", "rate", "eta_s", "testcases", "quarantined",
           "parked_ranks", "worker_deaths", "refused_ranks", "oldest_dispatch", "ranks",
           "view", "error", "stop"}
    assert old | new == set(got)
    assert got["stop"] is None  # it ran to its end
    assert got["error"] is None
    assert got["view"] == {"mode": "at rest", "note": None}
    [(written, finding, last)] = _rows(campaign, "SELECT sum(testcases), count(*), "
                                                 "max(committed_at) FROM results "
                                                 "WHERE testcases > 0")
    assert (written, finding) == (60, 60)  # every 5th run found one
    assert got["testcases"]["written"] == written and got["testcases"]["results"] == finding
    assert got["testcases"]["last_at"] == pytest.approx(last)
    assert got["results_by_status"] == {"ok": 287, "error": 13}
    assert got["quarantine"]["result"] == {"stale": 17} and got["quarantined"] == 17
    assert got["tasks"] == {"queued": 0, "active": 0, "done": 300, "deferred": 0, "failed": 0}
    # The master is gone: its rates of the last minute and hour are nobody's now; the
    # incarnation's own rate is what its observations say.
    assert got["rate"]["last_minute"] is None and got["rate"]["last_hour"] is None
    [(first_at, first_done), (last_at, last_done)] = [
        _rows(campaign, f"SELECT at, done FROM observations ORDER BY id {o} LIMIT 1")[0]
        for o in ("ASC", "DESC")]
    assert last_done == 300
    assert got["rate"]["overall"] == pytest.approx((300 - first_done) / (last_at - first_at))
    assert got["incarnation_run_s"] == pytest.approx(last_at - got["incarnation_started_at"])
    assert got["eta_s"] == 0 and got["oldest_dispatch"] is None
    assert got["source"] is None  # (Store.open was given no settings)
    assert [r["rank"] for r in got["ranks"]] == [1, 2, 3]
    loads = dict(_rows(campaign, "SELECT rank, busy FROM rank_load"))
    assert {r["rank"]: r["busy"] for r in got["ranks"]} == loads


def test_status_text_is_one_screen_with_the_same_figures(campaign, capsys):
    assert main(["status", "--db", str(campaign)]) == ExitStatus.OK
    out = capsys.readouterr().out
    assert "test cases: 60 written by 60 results; the last " in out
    assert "quarantined: 17; requeued: 0; parked ranks: 0; worker deaths: 0" in out
    assert "rate: - last minute, - last hour, " in out and "; ETA 0s" in out
    assert "committed results: 300 (error=13, ok=287)" in out
    # The stats text closes it, as before.
    assert out.endswith(stats_text(_stats(campaign)))


def _stats(db: Path):
    return read_file(db, read_stats)[0]


def test_the_test_cases_of_retried_runs_count_with_the_results_own(campaign, tmp_path,
                                                                  capsys):
    """A run killed at its timeout is retried, its test cases kept (written, fed back): they
    were in the output directory but in no figure ("test cases: 60" beside 64 files). Now
    status, the plot's series and the master's observations (one reader) count them, and the
    latest of them is the last find."""
    from store.observe import plot_series, read_found
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:
        (last,) = c.execute("SELECT max(committed_at) FROM results").fetchone()
        c.executemany("INSERT INTO salvaged (at, incarnation, rank, token, task_id, testcases) "
                      "VALUES (?, 1, 2, ?, ?, ?)",
                      [(last - 5, "a" * 64, 3, 1), (last + 1, "b" * 64, 4, 3)])
    got = _status(copy, capsys)["testcases"]
    assert (got["written"], got["results"], got["retried_runs"]) == (64, 60, 2)
    assert got["last_at"] == last + 1
    assert main(["status", "--db", str(copy)]) == ExitStatus.OK
    assert ("test cases: 64 written by 60 results and 2 runs cut short (a timeout or the "
            "job's stop: retried, their test cases kept); the last ") in capsys.readouterr().out
    found, series = read_file(copy, lambda conn: (read_found(conn), plot_series(conn)))[0]
    assert found.testcases == sum(series.testcases) == 64


def test_status_of_a_live_dispatch_shows_the_rank_its_task_and_age(campaign, tmp_path, capsys):
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:
        # task 7 back in flight on rank 2, recorded 30 s before the master's last observation:
        # its master is gone, so its age is counted to then, not to now (a growing age)
        c.execute("DELETE FROM results WHERE task_id = 7")
        c.execute("UPDATE tasks SET state = 'active' WHERE id = 7")
        c.execute("INSERT INTO dispatches (token, rank, task_id, incarnation, created_at) "
                  "SELECT ?, 2, 7, 1, max(at) - 30 FROM observations", ("7" * 64,))
        c.execute("UPDATE workers SET state = 'busy' WHERE rank = 2")
    got = _status(copy, capsys)
    assert got["oldest_dispatch"]["rank"] == 2 and got["oldest_dispatch"]["task_id"] == 7
    assert got["oldest_dispatch"]["age_s"] == pytest.approx(30)
    [rank2] = [r for r in got["ranks"] if r["rank"] == 2]
    assert rank2["task_id"] == 7 and rank2["state"] == "busy"
    assert main(["status", "--db", str(copy)]) == ExitStatus.OK
    out = capsys.readouterr().out
    assert "oldest active dispatch: task 7 on rank 2, 30s when its master stopped" in out


def test_a_master_killed_between_observations_ran_until_the_last_it_left(campaign, tmp_path,
                                                                         capsys):
    """kill -9 leaves no last observation: a 2 s run with 77 results read "ran 0s" and no
    rate. What it left in flight says when it was last alive."""
    copy = copy_of(campaign, tmp_path)
    with sqlite3.connect(copy) as c:
        (inc,) = c.execute("SELECT incarnation FROM campaign").fetchone()
        (started,) = c.execute("SELECT max(at) FROM events WHERE kind = 'campaign' "
                               "AND incarnation = ?", (inc,)).fetchone()
        # only the first observation was written; task 7 was in flight 5 s in, then the kill
        c.execute("DELETE FROM observations WHERE incarnation = ?1 AND at > (SELECT min(at) "
                  "FROM observations WHERE incarnation = ?1)", (inc,))
        c.execute("UPDATE observations SET at = ? WHERE incarnation = ?", (started, inc))
        c.execute("DELETE FROM events WHERE at > ?", (started,))
        c.execute("DELETE FROM results WHERE task_id = 7")
        c.execute("UPDATE tasks SET state = 'active' WHERE id = 7")
        c.execute("INSERT INTO dispatches (token, rank, task_id, incarnation, created_at, "
                  "sent_at) VALUES (?, 2, 7, ?, ?, ?)", ("7" * 64, inc, started + 4.5,
                                                        started + 5.0))
    got = _status(copy, capsys)
    assert got["incarnation_run_s"] == pytest.approx(5.0)
    assert got["rate"]["overall"] == pytest.approx(299 / 5.0)


def _resumed_by_a_master_that_is_gone(copy: Path) -> tuple[Store, int]:
    """The campaign resumed (a new incarnation) under the note of a master whose pid no
    longer exists: (its store, still open, and that pid)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return Store.open(copy, resume=True, note=f"master pid={gone.pid} "
                                              f"host={socket.gethostname()} ranks=4"), gone.pid


def test_an_incarnation_that_got_a_stop_signal_says_so_and_what_it_means(campaign, tmp_path,
                                                                         capsys):
    """A Slurm time limit ended the last incarnation: its `stop` event, which tells `--resume`
    to charge its runs nothing, is what the operator reads too, not a silent "not running"."""
    from store.schema import EventKind
    copy = copy_of(campaign, tmp_path)
    store, gone = _resumed_by_a_master_that_is_gone(copy)
    try:
        with store.transaction("stop") as tx:
            tx.event(EventKind.STOP, detail="SIGTERM")
        with store.transaction("stop") as tx:  # a later one does not replace the first
            tx.event(EventKind.STOP, detail="SIGUSR1")
    finally:
        store.close()
    [(at,)] = _rows(copy, "SELECT min(at) FROM events WHERE kind = 'stop'")
    got = _status(copy, capsys)
    assert got["master"]["running"] is False
    assert got["stop"] == {"at": pytest.approx(at), "cause": "SIGTERM"}
    assert main(["status", "--db", str(copy)]) == ExitStatus.OK
    out = capsys.readouterr().out
    assert (f"\n  it was stopping since {clock_utc(at)}: SIGTERM; the runs it left in flight, "
            f"if any, are charged nothing at `--resume` (up to 3 such stops per task; but a "
            f"worker's that was already gone)\n") in out
    # Where whether a master runs cannot be told, neither is claimed.
    from coordinator.status import _stop_text
    assert _stop_text((at, "SIGTERM"), None).startswith(f"a stop began {clock_utc(at)}: ")
    assert _stop_text((at, "SIGTERM"), True).startswith(f"stopping since {clock_utc(at)}: ")
    # A resume's own incarnation got none: the one before's is not shown as its.
    _resumed_by_a_master_that_is_gone(copy)[0].close()
    assert _status(copy, capsys)["stop"] is None


@pytest.mark.parametrize("observed", [True, False])
def test_a_master_killed_before_it_recorded_anything_ran_for_no_known_time(
        campaign, tmp_path, capsys, observed):
    """A resume killed (kill -9) right after its start: its `campaign` event and, if it got
    that far, the observation it writes at once are all it left. Its incarnation read "ran
    0s"; its end is not known, and no rate is made from its start to now."""
    copy = copy_of(campaign, tmp_path)
    store, gone = _resumed_by_a_master_that_is_gone(copy)
    try:
        if observed:
            with store.transaction("observation") as tx:
                record_observation(tx, {"done": 300}, 60, [], 300.0)
    finally:
        store.close()
    [(started,)] = _rows(copy, "SELECT max(at) FROM events WHERE kind = 'campaign'")
    got = _status(copy, capsys)
    assert got["incarnation"] == 2 and got["master"]["running"] is False
    assert got["incarnation_started_at"] == pytest.approx(started)
    assert got["incarnation_run_s"] is None
    assert got["rate"] == {"last_minute": None, "last_hour": None, "overall": None}
    assert main(["status", "--db", str(copy)]) == ExitStatus.OK
    out = capsys.readouterr().out
    assert "ran 0s" not in out
    assert (f"; this incarnation started {clock_utc(started)}, its end was not recorded "
            f"(its master left no record after its start)\n") in out


def test_a_campaign_in_a_directory_whose_name_is_not_utf8(campaign, tmp_path, capsys):
    """A name the file system holds as bytes (`x\\xff`): every command failed with a
    UnicodeEncodeError traceback while it quoted the path for SQLite's URI."""
    import os
    import shutil
    odd = tmp_path / os.fsdecode(b"x\xff")
    odd.mkdir()
    shutil.copy(campaign, odd / "c.db")
    assert _status(odd / "c.db", capsys)["tasks"]["done"] == 300
    import subprocess
    import sys
    for command in (["check"], ["status"]):  # (each names the file, in its own bytes)
        said = subprocess.run([sys.executable, "-m", "coordinator", *command, "--db",
                               odd / "c.db"], capture_output=True, timeout=120, check=False)
        assert said.returncode == ExitStatus.OK, said.stderr
        assert os.fsencode(odd / "c.db") in said.stdout


def test_a_copy_made_without_its_wal_is_said_to_have_left_it_behind(tmp_path, capsys):
    """A campaign file copied without its -wal (after a kill -9 every row past the schema is
    still there) was said to hold "no campaign yet (a master starting on it creates one
    within a moment...)", with no hint of the -wal: a `--resume` of it then ran the whole
    campaign again. `status` says what `run --resume` warns of."""
    import shutil

    from campaigns import copied_without_its_wal
    copy = tmp_path / "copy.db"
    copied_without_its_wal(tmp_path / "c.db", copy)
    says = (f"{copy} holds no campaign yet (its schema, but no campaign row, and no master is "
            f"starting on it). If it is a copy, its -wal was probably left behind: copy the "
            f"original's -wal beside it as {copy}-wal; if a master died while creating it, "
            f"the next `coordinator run` makes its campaign")
    assert main(["status", "--db", str(copy)]) == ExitStatus.USAGE
    assert capsys.readouterr().err == f"coordinator: {says}\n"
    assert main(["status", "--db", str(copy), "--json"]) == ExitStatus.USAGE
    assert json.loads(capsys.readouterr().out) == {"error": says}
    # A master starting on it (holding its lock) creates the campaign within a moment.
    from store.lock import lock_campaign, release_campaign
    fd = lock_campaign(copy)
    try:
        assert main(["status", "--db", str(copy)]) == ExitStatus.USAGE
        assert "a master starting on it creates one within a moment" in capsys.readouterr().err
    finally:
        release_campaign(fd)
    shutil.copyfile(f"{tmp_path / 'c.db'}-wal", f"{copy}-wal")
    assert _status(copy, capsys)["tasks"]["queued"] == 5


def test_an_older_revision_is_read_from_an_upgraded_copy_and_left_as_it_is(campaign, tmp_path,
                                                                           capsys):
    """A file of an older schema revision was refused ("bring it forward with `coordinator db
    upgrade`") while `check` read it: a post-mortem needed a write to the evidence. `status`
    reads a copy upgraded in TMPDIR and says so in a line; the file, and its directory, are
    left as they were."""
    import os
    import tempfile

    from store.versioning import head_revision
    db = copy_of(campaign, tmp_path)
    head = _status(db, capsys)
    down = subprocess.run([sys.executable, "-m", "alembic", "-x", f"db={db}", "downgrade",
                           "0012"], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert _rows(db, "SELECT version_num FROM alembic_version") == [("0012",)]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    got = _status(db, capsys)
    note = got["view"]["note"]
    assert got["view"]["mode"] == "upgraded copy" and got["error"] is None
    assert note.startswith(f"read from an upgraded copy of revision 0012 in TMPDIR "
                           f"({tempfile.gettempdir()}/coordinator-read-{os.getpid()}-")
    assert note.endswith(f"); the file itself was not changed (`coordinator db upgrade --db "
                         f"{db}` brings it forward)")
    assert got["schema_revision"] == "0012" and head["schema_revision"] == head_revision()
    for key in ("tasks", "results", "results_by_status", "quarantine", "incarnation"):
        assert got[key] == head[key], key
    assert got["testcases"]["written"] == head["testcases"]["written"] == 60
    assert main(["status", "--db", str(db)]) == ExitStatus.OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("(incarnation 1, schema 0012)")
    assert out[1].startswith("note: read from an upgraded copy of revision 0012 in TMPDIR (")
    # The SQLAlchemy reader (`plot`'s, `check`'s) does the same when given the upgrade.
    from store.revisions import check_campaign, current_revision
    from store.versioning import upgrade

    def revision(conn):
        check_campaign(conn, db)
        return current_revision(conn)
    stamp, view = read_file(db, revision, upgrade=upgrade)
    assert (stamp, view.mode, view.upgraded_from) == (head_revision(), "upgraded copy", "0012")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # Its own process: the copy goes at its exit.
    own_tmp = tmp_path.parent / f"{tmp_path.name}-tmp"
    own_tmp.mkdir()
    done = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db", str(db)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(own_tmp)})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert f"note: read from an upgraded copy of revision 0012 in TMPDIR ({own_tmp}/" \
        in done.stdout
    assert list(own_tmp.iterdir()) == []
    # No room for a copy there: refused as before, saying why it was not read from one.
    blocked = tmp_path.parent / f"{tmp_path.name}-file"
    blocked.write_text("")
    old = tempfile.tempdir
    tempfile.tempdir = str(blocked)
    try:
        assert main(["status", "--db", str(db)]) == ExitStatus.USAGE
    finally:
        tempfile.tempdir = old
    err = capsys.readouterr().err
    assert err.startswith(f"coordinator: {db}: schema revision 0012 is older than this "
                          f"coordinator's {head_revision()}; bring it forward with"), err
    assert f"; no upgraded copy could be read in TMPDIR ({blocked}: Not a directory)" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
