"""What can refuse a run is checked before MPI starts (coordinator/preflight.py): by the
self-launching `coordinator run` before it runs `mpiexec`, and by the master again."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Farm

from coordinator.cli import _parser
from coordinator.config import campaign_settings, resolve_run
from coordinator.errors import UsageError
from coordinator.exits import ExitStatus
from coordinator.preflight import check_run
from store.errors import CampaignExistsError, ForeignDatabaseError

ROOT = Path(__file__).resolve().parent.parent


def config(db: Path, *args: str):
    return resolve_run(_parser().parse_args(["run", "--db", str(db), *args]))


def _stored_campaign(db: Path, settings: dict) -> None:
    """A campaign whose first run stored `settings` (campaign.settings)."""
    from store.campaign import Store
    Store.open(db, settings=settings).close()


def test_a_resume_without_the_executor_takes_the_campaigns_own_and_says_so(tmp_path):
    """`--resume` without `--callable` was refused although the campaign stores it."""
    db = tmp_path / "c.db"
    spec = tmp_path / "work.py"
    spec.write_text("def solve(task):\n    return 1\n")
    first = config(db, "--tasks", str(tmp_path / "t.jsonl"), "--callable", f"{spec}:solve")
    _stored_campaign(db, campaign_settings(first))
    checked = check_run(config(db, "--resume"))
    assert (checked.cfg.executor, checked.cfg.callable_spec) == ("python", f"{spec}:solve")
    assert checked.notes == [f"--resume runs the campaign's own executor, as its last run "
                             f"did: --callable {spec}:solve"]
    # Another callable of the same kind is the user's call: run, with a note at the start.
    other = check_run(config(db, "--resume", "--callable", f"{spec}:solve"))
    assert other.notes == [] and other.cfg.callable_spec == f"{spec}:solve"


def test_a_resume_keeps_the_campaigns_run_settings_unless_given_again(tmp_path, monkeypatch):
    """A job script's bare `--resume` turned a campaign's `--no-feedback` into unbounded
    feedback (3 queued tasks became 3,993), and dropped its --max-depth and --timeout."""
    monkeypatch.delenv("SYMCC_TIMEOUT", raising=False)
    db = tmp_path / "c.db"
    target = tmp_path / "t.sh"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    first = config(db, "--tasks", str(tmp_path / "t.jsonl"), "--no-feedback", "--max-depth",
                   "3", "--timeout", "7.5", "--", str(target), "@@")
    _stored_campaign(db, campaign_settings(first))
    kept = check_run(config(db, "--resume"))
    assert (kept.cfg.feedback, kept.cfg.max_depth, kept.cfg.timeout_s, kept.cfg.watchdog_s) \
        == (False, 3, 7.5, 120.0)
    assert kept.notes[-1] == ("--resume keeps the campaign's --no-feedback --max-depth 3 "
                              "--timeout 7.5, as its last run had them")
    # Given again (or through SYMCC_TIMEOUT): this run's, without a word.
    monkeypatch.setenv("SYMCC_TIMEOUT", "60")
    mine = check_run(config(db, "--resume", "--feedback", "--max-depth", "0"))
    assert (mine.cfg.feedback, mine.cfg.max_depth, mine.cfg.timeout_s, mine.cfg.watchdog_s) \
        == (True, 0, 60.0, 240.0)
    assert not any(n.startswith("--resume keeps") for n in mine.notes)
    # A campaign from before they were kept: what its runs used cannot be told, and the
    # defaults were taken and stored for good (measured: a --max-depth 1 campaign fed back
    # to depth 15). Each one that matters must be given once; it is kept from then on.
    old = tmp_path / "old.db"
    _stored_campaign(old, {k: v for k, v in campaign_settings(first).items()
                           if k not in ("feedback", "max_depth", "timeout_s")})
    monkeypatch.delenv("SYMCC_TIMEOUT")
    with pytest.raises(UsageError, match=r"was begun by an older coordinator version, which "
                                         r"did not keep the campaign's --feedback, --max-depth,"
                                         r" --timeout: .* Give --feedback or --no-feedback "
                                         r"\(this version's default: on for a command; the "
                                         r"older versions': on\); --max-depth N \(0: "
                                         r"unlimited, the default\); --timeout S \(the "
                                         r"default: 30, or SYMCC_TIMEOUT\) on this --resume"):
        check_run(config(old, "--resume"))
    # --no-feedback makes the depth moot; SYMCC_TIMEOUT gives the timeout.
    monkeypatch.setenv("SYMCC_TIMEOUT", "9")
    from store.campaign import Store
    again = check_run(config(old, "--resume", "--no-feedback"))
    assert (again.cfg.feedback, again.cfg.timeout_s) == (False, 9.0)
    Store.open(old, resume=True, settings=campaign_settings(again.cfg)).close()
    monkeypatch.delenv("SYMCC_TIMEOUT")
    kept = check_run(config(old, "--resume")).cfg
    assert (kept.feedback, kept.max_depth, kept.timeout_s) == (False, 0, 9.0)
    # A timeout kept: the default watchdog follows it (4 x, at least 120 s).
    long = tmp_path / "long.db"
    _stored_campaign(long, campaign_settings(config(db, "--tasks", str(tmp_path / "t.jsonl"),
                                                    "--timeout", "100", "--", str(target))))
    assert check_run(config(long, "--resume")).cfg.watchdog_s == 400.0


def test_a_resume_taking_the_command_over_checks_an_inherited_timeout(tmp_path, monkeypatch):
    """The command left out, an inherited SYMCC_TIMEOUT was checked as for a demo run (any
    value >= 0): 5e6 passed, and every remaining task failed on its worker ("timeout is too
    large"), each committed as its error result, exit 0."""
    db = tmp_path / "c.db"
    target = tmp_path / "t.sh"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    first = config(db, "--tasks", str(tmp_path / "t.jsonl"), "--", str(target), "@@")
    _stored_campaign(db, campaign_settings(first))
    monkeypatch.setenv("SYMCC_TIMEOUT", "5e6")
    with pytest.raises(UsageError, match=r"the command's timeout \(--timeout or SYMCC_TIMEOUT\)"
                                         r" must be > 0 and at most 1,000,000 seconds, got 5e"):
        check_run(config(db, "--resume"))
    monkeypatch.setenv("SYMCC_TIMEOUT", "60")
    assert check_run(config(db, "--resume")).cfg.executor == "command"


def test_a_resume_of_an_afl_campaign_without_its_queue_watches_the_stored_one(tmp_path):
    db = tmp_path / "c.db"
    (tmp_path / "afl" / "main" / "queue").mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    first = config(db, "--afl-out", str(tmp_path / "afl"), "--fuzzer", "main", "--",
                   str(target), "@@")
    _stored_campaign(db, campaign_settings(first))
    checked = check_run(config(db, "--resume"))
    assert (checked.cfg.afl_out, checked.cfg.fuzzer, checked.cfg.name) == (
        (tmp_path / "afl").absolute(), "main", "symcc")
    assert checked.argv == [str(target.absolute()), "@@"]
    assert len(checked.notes) == 2 and "AFL queue" in checked.notes[1]


def test_a_resume_with_another_kind_of_executor_is_still_refused(tmp_path):
    from coordinator.config import ConfigError, check_resume
    db = tmp_path / "c.db"
    first = config(db, "--tasks", "t.jsonl", "--callable", "m:f")
    _stored_campaign(db, campaign_settings(first))
    cfg = config(db, "--resume", "--executor", "demo")
    with pytest.raises(ConfigError, match="runs its tasks with the python executor"):
        check_resume(check_run(cfg).cfg, campaign_settings(first))


def test_a_resume_on_a_new_file_with_a_callable_and_no_tasks_is_refused(tmp_path):
    """`SYMCC_RESUME=1` on a new file ran the callable on 300 demo payloads."""
    db = tmp_path / "new.db"
    with pytest.raises(UsageError, match="holds no campaign yet, and --callable m:f needs "
                                         "tasks: add --tasks FILE or --afl-out DIR"):
        check_run(config(db, "--resume", "--callable", "m:f"))
    assert check_run(config(db, "--resume")).cfg.demo == 300  # the demo executor's own
    assert not db.exists()


def test_an_existing_campaign_or_a_foreign_file_is_refused_before_mpi(tmp_path):
    db = tmp_path / "c.db"
    farm = Farm(db)
    farm.close()
    with pytest.raises(CampaignExistsError, match="pass --resume"):
        check_run(config(db))
    other = tmp_path / "other.db"
    import sqlite3
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE users (x)")
    c.close()
    with pytest.raises(ForeignDatabaseError):
        check_run(dataclasses.replace(config(db), db=other))


@pytest.mark.parametrize("args, says", [
    (["--tasks", "missing.jsonl", "--callable", "m:f"], "cannot read tasks file"),
    (["--tasks", "{tasks}", "--callable", "no_such_module:f"], "cannot import 'no_such_module'"),
    (["--resume"], "already holds"),  # (with no --resume: see the next line)
])
def test_the_self_launcher_refuses_before_it_runs_mpiexec(tmp_path, args, says):
    """These were found after MPI had started (2-8 s); `mpiexec` is now never run for them.
    A stand-in mpiexec records any run of it."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"data": 1}\n')
    ran = tmp_path / "mpiexec-ran"
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f"#!/bin/sh\ntouch {ran}\nexit 0\n")
    mpiexec.chmod(0o755)
    db = tmp_path / "c.db"
    if says == "already holds":
        farm = Farm(db)
        farm.close()
        args, says = [], "already holds a campaign"
    args = [a.replace("{tasks}", str(tasks)) for a in args]
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK")}
    done = subprocess.run([sys.executable, "-m", "coordinator", "run", "--db", str(db),
                           "--mpiexec", str(mpiexec), *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == ExitStatus.USAGE, done.stderr
    assert says in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert not ran.exists()


def test_a_resume_of_the_schema_without_its_campaign_goes_on_warning_of_a_lost_wal(tmp_path):
    """A campaign file copied without its -wal after a kill -9 (every row past the schema
    was still there) has the schema and no campaign row, as has a file whose first start
    died between the two (the fault campaign's start-up crashes reach it), which must go on.
    `--resume` starts a new campaign in it, as before, but first says that a copy's -wal was
    probably left behind and what to do; it said only "held no campaign yet"."""
    import shutil

    from campaigns import copied_without_its_wal

    from store.campaign import Store

    copy = tmp_path / "copy.db"
    copied_without_its_wal(tmp_path / "c.db", copy)
    says = (f"--resume: {copy} holds the schema but no campaign row; a new campaign starts in "
            f"it. If it is a copy, its -wal was probably left behind: stop this run now, copy "
            f"the original's -wal beside it as {copy}-wal and --resume again")
    for args in ([], ["--demo", "5"]):
        assert says in check_run(config(copy, "--resume", *args)).notes
    with Store.open(copy, resume=True) as store:  # the start that died goes on
        assert store.incarnation == 1
    # With the -wal copied beside it, as the message says: the campaign, resumed.
    shutil.copyfile(f"{tmp_path / 'c.db'}-wal", f"{tmp_path / 'again.db'}-wal")
    shutil.copyfile(tmp_path / "c.db", tmp_path / "again.db")
    checked = check_run(config(tmp_path / "again.db", "--resume"))
    assert checked.probe.campaign and checked.probe.tasks == 5
    assert not any("no campaign row" in n for n in checked.notes)
    # Nothing there: a new campaign, as documented (batch scripts always pass --resume).
    fresh = check_run(config(tmp_path / "new.db", "--resume"))
    assert fresh.cfg.demo == 300 and not any("no campaign row" in n for n in fresh.notes)


def test_a_start_on_a_campaign_a_master_runs_names_the_master_before_resume(tmp_path):
    """Without --resume the refusal said "pass --resume", and with it the same command was
    then refused because a master runs: the running master is named first."""
    import os

    from store.campaign import Store
    from store.errors import CampaignLockedError

    db = tmp_path / "c.db"
    Store.open(db).close()
    with pytest.raises(CampaignExistsError):
        check_run(config(db))
    running = Store.open(db, resume=True)  # holds the campaign's lock, as a master does
    try:
        for args in ((), ("--resume",)):
            with pytest.raises(CampaignLockedError, match=f"running master \\(pid {os.getpid()}"):
                check_run(config(db, *args))
    finally:
        running.close()


def test_a_resume_may_not_write_over_the_callable_the_campaign_stored(tmp_path):
    """`--resume` without --callable runs the one the campaign stored: an output naming its
    file was not checked, since the command line did not name it."""
    from coordinator.config import ConfigError

    db, tasks, spec = tmp_path / "c.db", tmp_path / "t.jsonl", tmp_path / "work.py"
    tasks.write_text('{"data": 1}\n')
    spec.write_text("def solve(task):\n    return 1\n")
    _stored_campaign(db, campaign_settings(config(db, "--tasks", str(tasks), "--callable",
                                                  f"{spec}:solve")))
    # (Refused before the take-over now: the file holds no run summary. The take-over's own
    # check stays for a callable's file that is still empty.)
    with pytest.raises(ConfigError, match=r"--summary-json .*work\.py exists and holds text"):
        check_run(config(db, "--resume", "--tasks", str(tasks), "--summary-json", str(spec)))
    spec.write_text("")
    with pytest.raises(ConfigError, match=r"--summary-json .*work\.py would overwrite .*"
                                          r"\(--callable's file\)"):
        check_run(config(db, "--resume", "--tasks", str(tasks), "--summary-json", str(spec)))


def test_a_resume_with_demo_tasks_on_a_command_or_callable_campaign_is_refused(tmp_path):
    """`--resume --demo 10` on a command's campaign added 10 tasks committed as `error` for
    ever (a demo task has no input file), and on a callable's fed them to it unasked: the
    demo payloads are the demo executor's alone, as for a new campaign."""
    target, spec = tmp_path / "t.sh", tmp_path / "work.py"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    spec.write_text("def solve(task):\n    return 1\n")
    cmd, py, demo = tmp_path / "cmd.db", tmp_path / "py.db", tmp_path / "demo.db"
    _stored_campaign(cmd, campaign_settings(config(cmd, "--tasks", "t.jsonl", "--",
                                                   str(target), "@@")))
    _stored_campaign(py, campaign_settings(config(py, "--tasks", "t.jsonl", "--callable",
                                                  f"{spec}:solve")))
    _stored_campaign(demo, campaign_settings(config(demo, "--demo", "5")))
    with pytest.raises(UsageError, match=r"^--demo: .*cmd\.db runs its tasks with a command "
                                         r"\(-- .*t\.sh @@\), .* --demo tasks have none"):
        check_run(config(cmd, "--resume", "--demo", "10"))
    with pytest.raises(UsageError, match=r"^--demo: .*py\.db runs its tasks with --callable "
                                         r".*work\.py:solve; --demo would feed it 10 built-in"):
        check_run(config(py, "--resume", "--demo", "10"))
    # Named again, the callable's demo payloads are the user's call, as for a new campaign;
    # the demo campaign takes more of its own.
    named = check_run(config(py, "--resume", "--demo", "10", "--callable", f"{spec}:solve"))
    assert (named.cfg.executor, named.cfg.demo) == ("python", 10)
    assert check_run(config(demo, "--resume", "--demo", "10")).cfg.demo == 10
    # A callable's campaign started on demo payloads takes more of them.
    py_demo = tmp_path / "py_demo.db"
    _stored_campaign(py_demo, campaign_settings(config(py_demo, "--demo", "4", "--callable",
                                                       f"{spec}:solve")))
    assert check_run(config(py_demo, "--resume", "--demo", "10")).cfg.executor == "python"
    assert check_run(config(cmd, "--resume")).cfg.executor == "command"


def test_a_command_given_by_a_relative_path_is_kept_absolute(tmp_path, monkeypatch):
    """The command was stored as given (`./target.sh`), --afl-out absolute: a --resume from
    another directory failed ("command './target.sh': no such file"), or ran another program
    of that name. A bare name stays as given (PATH finds it wherever the run starts)."""
    from coordinator.config import check_resume

    first_dir, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    for d in (first_dir, elsewhere):
        d.mkdir()
        target = d / "target.sh"
        target.write_text("#!/bin/sh\n")
        target.chmod(0o755)
    db = tmp_path / "c.db"
    monkeypatch.chdir(first_dir)
    first = config(db, "--tasks", "t.jsonl", "--", "./target.sh", "@@")
    assert campaign_settings(first)["command"] == [str(first_dir / "target.sh"), "@@"]
    assert campaign_settings(config(db, "--tasks", "t.jsonl", "--", "sh", "x"))["command"] \
        == ["sh", "x"]
    _stored_campaign(db, campaign_settings(first))
    monkeypatch.chdir(elsewhere)  # which has a target.sh of its own
    checked = check_run(config(db, "--resume"))
    assert checked.argv == [str(first_dir / "target.sh"), "@@"]
    # A campaign kept before: its relative command runs from the directory it was started
    # in, as it did, and given again there it is the same command, without a note.
    old = tmp_path / "old.db"
    _stored_campaign(old, {**campaign_settings(first), "command": ["./target.sh", "@@"]})
    monkeypatch.chdir(first_dir)
    assert check_run(config(old, "--resume")).argv == [str(first_dir / "target.sh"), "@@"]
    again = config(old, "--resume", "--", "./target.sh", "@@")
    assert check_resume(again, {"executor": "command", "command": ["./target.sh", "@@"]}) == []


def test_a_callable_given_by_its_file_is_kept_absolute(tmp_path, monkeypatch):
    """`--callable good.py:f` was stored as given: a --resume from another directory failed
    with "file 'good.py' does not exist", and did not say the spec was the campaign's. A
    module spec stays as given (found on sys.path wherever the run starts)."""
    from coordinator.config import check_resume

    first_dir, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    for d in (first_dir, elsewhere):
        d.mkdir()
    (first_dir / "good.py").write_text("def f(task):\n    return 1\n")
    db = tmp_path / "c.db"
    monkeypatch.chdir(first_dir)
    first = config(db, "--tasks", "t.jsonl", "--callable", "good.py:f")
    assert campaign_settings(first)["callable"] == f"{first_dir / 'good.py'}:f"
    assert campaign_settings(config(db, "--tasks", "t.jsonl", "--callable", "good:f"))[
        "callable"] == "good:f"
    _stored_campaign(db, campaign_settings(first))
    monkeypatch.chdir(elsewhere)
    checked = check_run(config(db, "--resume"))
    assert checked.cfg.callable_spec == f"{first_dir / 'good.py'}:f"
    # A campaign kept before: from another directory, the refusal says whose spec it is.
    old = tmp_path / "old.db"
    _stored_campaign(old, {**campaign_settings(first), "callable": "good.py:f"})
    with pytest.raises(UsageError) as refused:
        check_run(config(old, "--resume"))
    assert str(refused.value) == (
        f"callable spec 'good.py:f': file 'good.py' does not exist ({elsewhere / 'good.py'}); "
        f"that is the campaign's callable, as its last run stored it in {old} (relative to "
        f"the directory that run started in, if relative): give --callable to run another")
    # Given on the command line, it is the user's own: said as before.
    with pytest.raises(UsageError) as given:
        check_run(config(old, "--resume", "--callable", "good.py:f"))
    assert "campaign's callable" not in str(given.value)
    # From where it was started it runs, and given again there it is the same callable.
    monkeypatch.chdir(first_dir)
    assert check_run(config(old, "--resume")).cfg.callable_spec == "good.py:f"
    again = config(old, "--resume", "--callable", "good.py:f")
    assert check_resume(again, {"executor": "python", "callable": "good.py:f"}) == []


def test_a_resume_of_a_campaign_that_kept_no_feedback_must_say_which(tmp_path):
    """Feedback is on for a command and off for a callable unless given; it was on for every
    executor when campaigns kept no setting. Measured on an upgraded callable campaign: the
    same command's --resume turned its feedback off unsaid (20 test cases, 0 new tasks)."""
    spec = tmp_path / "work.py"
    spec.write_text("def solve(task):\n    return 1\n")
    target = tmp_path / "t.sh"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    tasks = ("--tasks", str(tmp_path / "t.jsonl"))
    for name, executor, default in (("py", ("--callable", f"{spec}:solve"), "off"),
                                    ("cmd", ("--", str(target), "@@"), "on")):
        db = tmp_path / f"{name}.db"
        _stored_campaign(db, {k: v for k, v in campaign_settings(
            config(db, *tasks, *executor)).items() if k != "feedback"})
        with pytest.raises(UsageError, match=rf"did not keep the campaign's --feedback: .* "
                                             rf"Give --feedback or --no-feedback \(this "
                                             rf"version's default: {default} for a "):
            check_run(config(db, "--resume"))
        assert check_run(config(db, "--resume", "--feedback")).cfg.feedback is True
        assert check_run(config(db, "--resume", "--no-feedback")).cfg.feedback is False
    # The demo writes no test cases and has no timeout: nothing to ask.
    db = tmp_path / "demo.db"
    _stored_campaign(db, {k: v for k, v in campaign_settings(config(db, "--demo", "5")).items()
                          if k not in ("feedback", "max_depth", "timeout_s")})
    assert check_run(config(db, "--resume")).cfg.executor == "demo"


def _moved_afl_campaign(tmp_path: Path, *flags: str):
    """A campaign file at `tmp_path/c.db` begun on `tmp_path/afl` (with `flags`), whose AFL
    directory `tmp_path/moved` now holds: (db, its target, its first run's config)."""
    db = tmp_path / "c.db"
    for d in ("afl", "moved"):
        (tmp_path / d / "main" / "queue").mkdir(parents=True)
    target = tmp_path / "target"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    first = config(db, "--afl-out", str(tmp_path / "afl"), "--fuzzer", "main", *flags, "--",
                   str(target), "@@")
    _stored_campaign(db, campaign_settings(first))
    return db, target, first


def test_a_resume_with_a_moved_afl_directory_takes_the_campaigns_command(tmp_path):
    """`--resume --afl-out NEW --fuzzer main` without the command (a moved AFL directory)
    was refused ("--afl-out needs the command"), although a --resume needs no executor and
    another --afl-out is allowed."""
    from coordinator.config import ConfigError, check_resume

    db, target, first = _moved_afl_campaign(tmp_path)
    checked = check_run(config(db, "--resume", "--afl-out", str(tmp_path / "moved"),
                               "--fuzzer", "main"))
    assert (checked.cfg.executor, checked.argv) == ("command", [str(target), "@@"])
    assert checked.cfg.afl_out == tmp_path / "moved"
    notes = check_resume(checked.cfg, campaign_settings(first))
    assert len(notes) == 1 and f"--afl-out {tmp_path / 'afl'} (now" in notes[0]
    # With no command to take (a new file), it is refused as for a new campaign.
    with pytest.raises(ConfigError, match="--afl-out needs the command to run on AFL's"):
        check_run(config(tmp_path / "new.db", "--resume", "--afl-out", str(tmp_path / "moved"),
                         "--fuzzer", "main"))
    with pytest.raises(ConfigError, match="--afl-out needs the command to run on AFL's"):
        config(db, "--resume", "--executor", "demo", "--afl-out", str(tmp_path / "moved"),
               "--fuzzer", "main")


def test_a_resume_whose_stored_afl_directory_is_gone_is_refused_not_made_again(tmp_path):
    """A bare `--resume` (the command given again or not) after the AFL output directory was
    moved away took the stored `--afl-out`, said only that the fuzzer's queue "does not
    exist yet; waiting for it", and made the vanished path again for its test cases (71
    written where no AFL reads them). Refused before MPI, naming it and `--afl-out NEW`; an
    AFL directory whose fuzzer's queue is not there yet (AFL starting) is still waited for."""
    import os
    import shutil

    db, target, _ = _moved_afl_campaign(tmp_path)
    shutil.rmtree(tmp_path / "moved")
    os.rename(tmp_path / "afl", tmp_path / "moved")
    for again in ([], ["--", str(target), "@@"]):
        with pytest.raises(UsageError) as e:
            check_run(config(db, "--resume", *again))
        assert str(e.value) == (
            f"--resume: the campaign's AFL output directory {tmp_path / 'afl'} (--afl-out of "
            f"its last run) no longer exists; if it was moved, pass --afl-out NEW --fuzzer main "
            f"to watch it there from now on (the campaign keeps --name symcc); nothing was "
            f"created")
        assert not (tmp_path / "afl").exists()
    # The way on that it names.
    moved = check_run(config(db, "--resume", "--afl-out", str(tmp_path / "moved"),
                             "--fuzzer", "main"))
    assert (moved.cfg.afl_out, moved.argv) == (tmp_path / "moved", [str(target), "@@"])
    # The directory there, its fuzzer's queue not yet (AFL starting): waited for, as before.
    os.rename(tmp_path / "moved", tmp_path / "afl")
    shutil.rmtree(tmp_path / "afl" / "main")
    assert check_run(config(db, "--resume")).cfg.afl_out == tmp_path / "afl"
    # Before MPI: the self-launching command says it in one line, exit 2, mpiexec not run.
    shutil.rmtree(tmp_path / "afl")
    ran, mpiexec = tmp_path / "mpiexec-ran", tmp_path / "mpiexec"
    mpiexec.write_text(f"#!/bin/sh\ntouch {ran}\nexit 0\n")
    mpiexec.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", "coordinator", "run", "--db", str(db),
                           "--resume", "--mpiexec", str(mpiexec)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == ExitStatus.USAGE, done.stderr
    assert done.stderr.startswith("coordinator: --resume: the campaign's AFL output "
                                  f"directory {tmp_path / 'afl'} ") and \
        len(done.stderr.splitlines()) == 1, done.stderr
    assert not ran.exists() and not (tmp_path / "afl").exists()


def test_a_resume_with_a_moved_afl_directory_keeps_the_campaigns_instance_name(tmp_path):
    """`--resume --afl-out NEW --fuzzer main` without --name, on a campaign started with
    `--name sym2`: the default `symcc` took over (test cases into another directory, their
    ids from 0), and was written back for every later --resume (a review). The campaign's
    name is kept unless --name is given."""
    from coordinator.config import check_resume, renewed_settings

    db, _, first = _moved_afl_campaign(tmp_path, "--name", "sym2")
    stored = campaign_settings(first)
    moved = ["--resume", "--afl-out", str(tmp_path / "moved"), "--fuzzer", "main"]
    checked = check_run(config(db, *moved))
    assert checked.cfg.name == "sym2"
    check_resume(checked.cfg, stored)
    assert renewed_settings(checked.cfg, stored) == {"afl_out": str(tmp_path / "moved")}
    renamed = check_run(config(db, *moved, "--name", "sym3"))
    assert renamed.cfg.name == "sym3"
    assert renewed_settings(renamed.cfg, stored)["name"] == "sym3"


def test_what_a_resume_changes_is_what_the_next_bare_resume_runs(tmp_path, monkeypatch):
    """A fixed command, a moved AFL directory or another --timeout given on a --resume were
    not written back: a later bare `--resume` (a job script's) went back to the first run's,
    the target before its fix, or a queue that no longer exists."""
    from coordinator.config import check_resume, renewed_settings
    from store.campaign import Store

    def resume(*args: str):
        """A start as the master makes it: checked, then its changes kept."""
        cfg = check_run(config(db, "--resume", *args)).cfg
        Store.open(db, resume=True, settings=campaign_settings(cfg),
                   check_settings=lambda stored: (check_resume(cfg, stored),
                                                  renewed_settings(cfg, stored))[1]).close()
        return cfg

    db = tmp_path / "c.db"
    for d in ("afl", "moved"):
        (tmp_path / d / "main" / "queue").mkdir(parents=True)
    old, fixed = tmp_path / "old.sh", tmp_path / "fixed.sh"
    for target in (old, fixed):
        target.write_text("#!/bin/sh\n")
        target.chmod(0o755)
    _stored_campaign(db, campaign_settings(config(
        db, "--afl-out", str(tmp_path / "afl"), "--fuzzer", "main", "--no-feedback", "--",
        str(old), "@@")))
    resume("--afl-out", str(tmp_path / "moved"), "--fuzzer", "main", "--timeout", "60",
           "--", str(fixed), "@@")
    bare = check_run(config(db, "--resume"))
    assert (bare.argv, bare.cfg.afl_out, bare.cfg.timeout_s, bare.cfg.feedback) == (
        [str(fixed), "@@"], tmp_path / "moved", 60.0, False)
    assert bare.notes[0].endswith(f"as its last run did: -- {fixed} @@")
    # The executor's kind and the task source stay the first run's.
    from store.probe import probe
    kept = probe(db).settings
    assert (kept["executor"], kept["source"], kept["command"]) == (
        "command", "afl", [str(fixed), "@@"])
    # A bare resume changes nothing.
    resume()
    assert probe(db).settings == kept
    # A campaign that kept a relative command keeps it absolute once resumed where it ran.
    db = tmp_path / "rel.db"  # (the `db` that resume() opens)
    _stored_campaign(db, {**kept, "command": ["./old.sh", "@@"]})
    monkeypatch.chdir(tmp_path)
    resume()
    assert probe(db).settings["command"] == [str(old), "@@"]
