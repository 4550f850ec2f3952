"""`coordinator run` flags and SYMCC_* variables as resolved before anything is launched
(pure logic: the parser and `resolve_run`, no MPI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.cli import _parser
from coordinator.config import ConfigError, describe, dispatch_batch, resolve_run


def resolve(tmp_path, *args: str):
    return resolve_run(_parser().parse_args(["run", "--db", str(tmp_path / "c.db"), *args]))


@pytest.mark.parametrize("value, resume", [
    ("1", True), ("true", True), ("YES", True), ("on", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False),
])
def test_symcc_resume_takes_yes_and_no_words(tmp_path, monkeypatch, value, resume):
    monkeypatch.setenv("SYMCC_RESUME", value)
    assert resolve(tmp_path).resume is resume


def test_symcc_resume_that_is_neither_yes_nor_no_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMCC_RESUME", "maybe")
    with pytest.raises(ConfigError, match="SYMCC_RESUME='maybe' is not a yes/no value"):
        resolve(tmp_path)


def test_resume_flag_wins_over_a_no_in_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMCC_RESUME", "0")
    assert resolve(tmp_path, "--resume").resume is True


def test_the_retry_budget_defaults_to_1_and_allows_0_to_16(tmp_path, monkeypatch):
    """docs/protocol.md R7: SYMCC_DISPATCH_PROTOCOL_RETRIES, default 1, range 0-16."""
    monkeypatch.delenv("SYMCC_DISPATCH_PROTOCOL_RETRIES", raising=False)
    assert resolve(tmp_path).retries == 1
    for value in ("0", "16"):
        monkeypatch.setenv("SYMCC_DISPATCH_PROTOCOL_RETRIES", value)
        assert resolve(tmp_path).retries == int(value)
    for value in ("17", "-1"):
        monkeypatch.setenv("SYMCC_DISPATCH_PROTOCOL_RETRIES", value)
        with pytest.raises(ConfigError, match=r"SYMCC_DISPATCH_PROTOCOL_RETRIES.*0\.\.16"):
            resolve(tmp_path)
    monkeypatch.delenv("SYMCC_DISPATCH_PROTOCOL_RETRIES")
    with pytest.raises(SystemExit):
        resolve(tmp_path, "--retries", "17")


def test_command_executor_on_demo_tasks_is_refused(tmp_path):
    """Demo tasks carry no input file: every run would end in an error result."""
    with pytest.raises(ConfigError, match="--demo tasks have none"):
        resolve(tmp_path, "--demo", "5", "--", "./target", "@@")
    with pytest.raises(ConfigError, match=r"input file: add --tasks FILE .* or --afl-out DIR"):
        resolve(tmp_path, "--", "./target", "@@")  # the default source is the demo's alone


def test_a_callable_without_a_task_source_is_refused_naming_the_flag(tmp_path):
    """`--callable` without `--tasks` ran the user's function on 300 demo payloads and made a
    campaign of 300 errors (exit 0): the demo payloads are the demo executor's alone."""
    with pytest.raises(ConfigError, match="--callable runs on tasks you give it: add --tasks"):
        resolve(tmp_path, "--callable", "m:f")
    assert resolve(tmp_path, "--callable", "m:f", "--demo", "3").demo == 3  # asked for
    assert resolve(tmp_path, "--callable", "m:f", "--resume").demo is None  # stored tasks
    assert resolve(tmp_path).demo == 300  # the embedded default, demo executor


def test_a_ceiling_at_or_below_the_retry_budget_is_refused(tmp_path, monkeypatch):
    """It would hold a task as failed before the requeues asked for are used."""
    with pytest.raises(ConfigError, match=r"--max-attempts 16 holds a task as failed before "
                                          r"its 16 immediate retries"):
        resolve(tmp_path, "--retries", "16", "--max-attempts", "16")
    monkeypatch.setenv("SYMCC_DISPATCH_MAX_ATTEMPTS", "1")
    with pytest.raises(ConfigError, match="SYMCC_DISPATCH_MAX_ATTEMPTS 1 holds"):
        resolve(tmp_path)  # against the default budget of 1
    assert resolve(tmp_path, "--retries", "0").max_attempts == 1
    monkeypatch.delenv("SYMCC_DISPATCH_MAX_ATTEMPTS")
    cfg = resolve(tmp_path, "--retries", "16")
    assert (cfg.retries, cfg.max_attempts) == (16, None)  # the store's default: 20


def test_db_that_is_a_directory_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        resolve_run(_parser().parse_args(["run", "--db", str(tmp_path)]))


@pytest.mark.parametrize("flag, value", [
    ("--name", "main/"), ("--name", "x/../main"), ("--name", "../o2/main"), ("--name", "."),
    ("--fuzzer", "../etc"), ("--fuzzer", "a/b"),
])
def test_afl_instance_names_must_be_plain_directory_names(tmp_path, flag, value):
    """Another spelling of the fuzzer's own directory would feed results back for ever."""
    args = ["--afl-out", str(tmp_path), *(["--fuzzer", "main"] if flag != "--fuzzer" else []),
            flag, value]
    with pytest.raises(ConfigError, match="single directory name"):
        resolve(tmp_path, *args, "--", "./target", "@@")


def test_afl_instance_names_that_afl_would_not_import_from_are_refused(tmp_path):
    """AFL's sync skips dot directories; an instance's own directory is AFL's to write."""
    with pytest.raises(ConfigError, match="skips directories whose name starts with"):
        resolve(tmp_path, "--afl-out", str(tmp_path), "--fuzzer", "main", "--name", ".symcc",
                "--", "./target", "@@")
    (tmp_path / "fuzzer02").mkdir()
    (tmp_path / "fuzzer02" / "fuzzer_stats").write_text("start_time : 1\n")
    with pytest.raises(ConfigError, match="is an AFL instance's own directory"):
        resolve(tmp_path, "--afl-out", str(tmp_path), "--fuzzer", "main", "--name", "fuzzer02",
                "--", "./target", "@@")


def test_a_name_that_links_to_the_fuzzers_queue_is_refused(tmp_path):
    """symcc/queue -> ../main/queue (or symcc -> main without fuzzer_stats yet) wrote the
    coordinator's test cases into AFL's own queue, which it reads: each result became a task,
    for ever."""
    afl = tmp_path / "afl"
    (afl / "main" / "queue").mkdir(parents=True)
    (afl / "symcc").mkdir()
    (afl / "symcc" / "queue").symlink_to("../main/queue")
    (afl / "linked").symlink_to("main")
    args = ("--afl-out", str(afl), "--fuzzer", "main", "--", "./target", "@@")
    for name in ("symcc", "linked"):
        with pytest.raises(ConfigError, match="fuzzer's own queue through a symbolic link"):
            resolve(tmp_path, "--name", name, *args)
    (afl / "symcc" / "queue").unlink()
    assert resolve(tmp_path, "--name", "symcc", *args).name == "symcc"


def test_feedback_is_on_for_a_command_and_off_for_a_callable_unless_given(tmp_path):
    """A callable's test cases are its bulk output, not new inputs: fed back by default, each
    became a task `{"path": "DB.out/<hash>"}` its function failed on (or, without
    --max-depth, maybe ran for ever). A command's (SymCC's) are fed back, as before."""
    target = tmp_path / "t.sh"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    tasks = ("--tasks", str(tmp_path / "t.jsonl"))
    command = ("--", str(target), "@@")
    assert resolve(tmp_path, *tasks, *command).feedback is True
    assert resolve(tmp_path, *tasks, "--no-feedback", *command).feedback is False
    assert resolve(tmp_path, *tasks, "--callable", "m:f").feedback is False
    assert resolve(tmp_path, *tasks, "--callable", "m:f", "--feedback").feedback is True
    assert resolve(tmp_path, "--demo", "3", "--callable", "m:f").feedback is False
    assert resolve(tmp_path).feedback is False  # the demo's writes none
    assert resolve(tmp_path, "--feedback").feedback is True


def test_afl_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "afl").write_text("not a directory")
    with pytest.raises(ConfigError, match="is not a directory"):
        resolve(tmp_path, "--afl-out", str(tmp_path / "afl"), "--fuzzer", "main",
                "--", "./target", "@@")


def test_resume_without_a_source_adds_no_demo_tasks(tmp_path):
    """The embedded demo default is for a new campaign; `--resume` continues stored tasks."""
    assert resolve(tmp_path).demo == 300
    assert resolve(tmp_path, "--resume").demo is None
    assert resolve(tmp_path, "--resume", "--demo", "25").demo == 25


def test_resume_with_another_executor_or_without_the_afl_queue_is_refused(tmp_path):
    from coordinator.config import campaign_settings, check_resume
    first = campaign_settings(resolve(tmp_path, "--tasks", "t.jsonl", "--callable", "m:f"))
    assert (first["executor"], first["callable"], first["source"]) == ("python", "m:f", "tasks")
    with pytest.raises(ConfigError, match=r"python executor \(--callable m:f\); this --resume "
                                          r"would use the demo executor"):
        check_resume(resolve(tmp_path, "--resume"), first)
    check_resume(resolve(tmp_path, "--resume", "--callable", "m:f"), first)
    # Another callable or command is the user's call (a fixed target), but said.
    assert check_resume(resolve(tmp_path, "--resume", "--callable", "m:g"), first) == [
        "this campaign's earlier runs used --callable m:f; this --resume runs --callable m:g"]
    cmd = campaign_settings(resolve(tmp_path, "--tasks", "t.jsonl", "--", "./a", "@@"))
    assert check_resume(resolve(tmp_path, "--resume", "--", "./a", "@@"), cmd) == []
    assert check_resume(resolve(tmp_path, "--resume", "--", "./b", "@@"), cmd) == [
        f"this campaign's earlier runs used -- {Path.cwd() / 'a'} @@; this --resume runs -- "
        f"{Path.cwd() / 'b'} @@"]
    check_resume(resolve(tmp_path, "--resume"), None)  # a campaign from before 0004
    check_resume(resolve(tmp_path, "--resume"), {})  # keys it lacks are not compared
    afl = campaign_settings(resolve(tmp_path, "--afl-out", str(tmp_path), "--fuzzer", "main",
                                    "--callable", "m:f"))
    with pytest.raises(ConfigError, match="watches an AFL queue .* --fuzzer main --name symcc"):
        check_resume(resolve(tmp_path, "--resume", "--callable", "m:f"), afl)
    assert check_resume(resolve(tmp_path, "--resume", "--afl-out", str(tmp_path), "--fuzzer",
                                "main", "--callable", "m:f"), afl) == []
    # Another instance name or fuzzer is allowed (a moved AFL directory is a reason), but said.
    notes = check_resume(resolve(tmp_path, "--resume", "--afl-out", str(tmp_path), "--fuzzer",
                                 "main", "--name", "symc", "--callable", "m:f"), afl)
    assert notes == [(f"this campaign last ran with --name symcc (now symc); its new test "
                      f"cases now go to {tmp_path / 'symc' / 'queue'} and it reads "
                      f"{tmp_path / 'main' / 'queue'}")]
    assert check_resume(resolve(tmp_path, "--resume", "--callable", "m:f"), first) == []
    # The same directory by another path is no change.
    assert check_resume(resolve(tmp_path, "--resume", "--afl-out", os.path.relpath(tmp_path),
                                "--fuzzer", "main", "--callable", "m:f"), afl) == []


def test_tasks_from_a_pipe_and_out_with_afl_out_are_refused(tmp_path):
    """The ranks cannot read the launcher's stdin: the master used to wait on it for ever."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is not a regular file"):
        resolve(tmp_path, "--tasks", str(fifo), "--callable", "m:f")
    with pytest.raises(ConfigError, match="--out is not used with --afl-out"):
        resolve(tmp_path, "--afl-out", str(tmp_path), "--fuzzer", "main", "--out",
                str(tmp_path / "o"))


@pytest.mark.parametrize("value", ["0", "1e7", "inf", "nan", "-1"])
def test_a_timeout_that_cannot_be_waited_for_is_refused(tmp_path, monkeypatch, value):
    """1e7 s or inf used to start, then commit every task as `error` (OverflowError in the
    wait); 0 was refused only by the executor, without naming the variable."""
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--db", str(tmp_path / "c.db"), "--timeout", value])
    monkeypatch.setenv("SYMCC_TIMEOUT", value)
    with pytest.raises(ConfigError, match="SYMCC_TIMEOUT"):
        resolve(tmp_path, "--", "./target", "@@")
    if value not in ("-1", "nan", "inf"):  # (not a time at all: refused whatever runs)
        assert resolve(tmp_path).executor == "demo"  # no command: an inherited value is moot


def test_an_afl_campaign_needs_something_to_run_its_inputs(tmp_path):
    with pytest.raises(ConfigError, match="--afl-out needs the command"):
        resolve(tmp_path, "--afl-out", str(tmp_path), "--fuzzer", "main")


def test_end_of_run_files_in_a_missing_directory_are_refused_at_start(tmp_path):
    for flag in ("--stats-file", "--summary-json", "--metrics-file"):
        with pytest.raises(ConfigError, match=f"{flag} .* does not exist"):
            resolve(tmp_path, flag, str(tmp_path / "missing" / "f"))


def test_end_of_run_files_in_a_read_only_directory_are_refused_at_start(tmp_path,
                                                                         monkeypatch):
    """A read-only mount (root can write anywhere else, so the check is faked here: what is
    tested is that the answer of access(2) is asked and reported)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == ro else real(p, m))
    for flag in ("--stats-file", "--summary-json"):
        with pytest.raises(ConfigError, match=f"{flag} .*/ro is not writable"):
            resolve(tmp_path, flag, str(ro / "f"))
    assert resolve(tmp_path, "--summary-json", str(tmp_path / "f")).summary_json


def test_an_endless_time_and_an_end_of_run_file_that_is_a_directory_are_refused(tmp_path):
    """--demo-work-ms inf ran every demo task for ever; a --stats-file naming a directory was
    found out only at the end of the run."""
    with pytest.raises(SystemExit):
        _parser().parse_args(["run", "--db", str(tmp_path / "c.db"), "--demo-work-ms", "inf"])
    for flag in ("--stats-file", "--summary-json"):
        with pytest.raises(ConfigError, match=f"{flag} .* is a directory"):
            resolve(tmp_path, flag, str(tmp_path))


def test_worker_spin_is_left_to_the_mpi_library_unless_given(tmp_path, capsys):
    assert resolve(tmp_path).worker_spin_ms is None
    assert resolve(tmp_path, "--worker-spin-ms", "0").worker_spin_ms == 0.0
    assert resolve(tmp_path, "--worker-spin-ms", "12.5").worker_spin_ms == 12.5
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            resolve(tmp_path, "--worker-spin-ms", bad)


def test_plain_progress_lines_unless_the_live_display_or_none_is_asked_for(tmp_path):
    """Under mpiexec rank 0's stderr is a pipe or a file: by default plain lines at the
    interval; `--progress` (the self-launcher's, from a terminal) is the live display alone;
    `--no-progress` is no progress output at all."""
    default = resolve(tmp_path)
    assert (default.progress, default.progress_interval_s) == (False, 30.0)
    assert resolve(tmp_path, "--progress-interval", "5").progress_interval_s == 5.0
    assert resolve(tmp_path, "--progress-interval", "0").progress_interval_s == 0.0
    live = resolve(tmp_path, "--progress")
    assert (live.progress, live.progress_interval_s) == (True, 0.0)
    off = resolve(tmp_path, "--no-progress", "--progress-interval", "5")
    assert (off.progress, off.progress_interval_s) == (False, 0.0)
    for bad in ("-1", "inf", "often"):
        with pytest.raises(SystemExit):
            resolve(tmp_path, "--progress-interval", bad)
    assert resolve(tmp_path, "--metrics-file", str(tmp_path / "c.prom")).metrics_file == \
        tmp_path / "c.prom"


@pytest.mark.parametrize("args, batch", [
    (["--", "./target", "@@"], 1),                    # a command runs alone by default
    (["--executor", "command", "--", "t", "@@"], 1),
    (["--demo", "10"], None),                         # demo and python tasks: auto
    (["--callable", "m:f", "--demo", "10"], None),
    (["--batch", "8", "--", "./target", "@@"], 8),    # --batch wins either way
    (["--batch", "auto", "--", "./target", "@@"], None),
    (["--batch", "1", "--demo", "10"], 1),
])
def test_the_batch_defaults_to_1_for_commands_and_auto_for_python_tasks(tmp_path, args, batch):
    if "--" in args:
        (tmp_path / "t.jsonl").write_text('{"path": "in"}\n')
        args = ["--tasks", str(tmp_path / "t.jsonl"), *args]
    cfg = resolve(tmp_path, *args)
    assert dispatch_batch(cfg.batch, cfg.executor) == batch


def test_the_first_line_says_how_tasks_are_batched(tmp_path):
    assert describe(resolve(tmp_path, "--demo", "10")).endswith(
        "10 demo tasks, demo executor, batches sized from the measured run times (--batch auto)")
    assert describe(resolve(tmp_path, "--demo", "10", "--batch", "8")).endswith(
        ", up to 8 tasks per dispatch")
    assert describe(resolve(tmp_path, "--demo", "10", "--batch", "1")).endswith(
        "demo executor")


@pytest.mark.parametrize("flag", ["--stats-file", "--summary-json", "--metrics-file", "--out",
                                  "--master-pid-file"])
def test_what_a_run_writes_may_not_be_its_database_or_its_inputs(tmp_path, flag):
    """`--stats-file campaign.db` replaced a campaign with 445 bytes of text, `--summary-json
    tasks.jsonl` the tasks file: every path a run writes is refused at start when it names
    the database (its -wal, -shm), the tasks file, the callable's file or another output,
    through a symlink or a hard link too."""
    tasks, work = tmp_path / "t.jsonl", tmp_path / "w.py"
    tasks.write_text('{"data": 1}\n')
    work.write_text("def f(p):\n    return p\n")
    (tmp_path / "c.db").write_bytes(b"")
    os.link(tasks, tmp_path / "hard.jsonl")
    os.symlink(work, tmp_path / "soft.py")
    source = ("--tasks", str(tasks), "--callable", f"{work}:f")
    for name, names in (("c.db", "--db"), ("c.db-wal", "--db's -wal"),
                        ("c.db-shm", "--db's -shm"), ("t.jsonl", "--tasks"),
                        ("hard.jsonl", "--tasks"), ("soft.py", "--callable's file")):
        with pytest.raises(ConfigError, match=f"^{flag} .* would overwrite .*\\({names}\\)"):
            resolve(tmp_path, *source, flag, str(tmp_path / name))
    other = "--metrics-file" if flag == "--stats-file" else "--stats-file"
    with pytest.raises(ConfigError, match=r"would overwrite .*x \(--"):
        resolve(tmp_path, *source, flag, str(tmp_path / "x"), other, str(tmp_path / "x"))
    assert resolve(tmp_path, *source, flag, str(tmp_path / "fresh")).db == tmp_path / "c.db"


@pytest.mark.parametrize("value", ["0", "0.5"])
def test_a_start_wait_shorter_than_a_rank_takes_to_start_is_refused(value, capsys):
    """`--start-wait 0` lost every rank before its first READY and ended the run at once with
    exit 6, as if all had died."""
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["run", "--db", "c.db", "--start-wait", value])
    assert e.value.code == 2
    assert "is too short: ranks take a second or more to start" in capsys.readouterr().err


def test_a_start_wait_of_a_second_is_taken(tmp_path):
    assert resolve(tmp_path, "--start-wait", "1").start_wait_s == 1.0


def test_an_output_written_through_its_tmp_file_or_a_linked_db_is_refused_too(tmp_path):
    """Each end-of-run file is written to NAME.tmp and renamed: `--stats-file X --db X.tmp`
    truncated the database through the temporary file. SQLite keeps -wal and -shm beside
    the file a --db link names, and those are refused there too."""
    with pytest.raises(ConfigError, match=r"--stats-file .*s would overwrite .*s\.tmp \(--db, "
                                          r"through .*s\.tmp\)"):
        resolve_run(_parser().parse_args(["run", "--db", str(tmp_path / "s.tmp"),
                                          "--stats-file", str(tmp_path / "s")]))
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link.db").symlink_to(real / "c.db")
    with pytest.raises(ConfigError, match=r"would overwrite .*real/c\.db-wal \(--db's -wal\)"):
        resolve_run(_parser().parse_args(["run", "--db", str(tmp_path / "link.db"),
                                          "--metrics-file", str(real / "c.db-wal")]))
    # (the launcher's pid file, and the exit status it writes beside it: NAME.exit)
    with pytest.raises(ConfigError, match=r"--master-pid-file's exit status .*p\.exit would "
                                          r"overwrite .*p\.exit \(--db\)"):
        resolve_run(_parser().parse_args(["run", "--db", str(tmp_path / "p.exit"),
                                          "--master-pid-file", str(tmp_path / "p")]))


@pytest.mark.parametrize("flag", ["--stats-file", "--metrics-file", "--summary-json"])
def test_an_end_of_run_file_that_holds_something_else_is_refused(tmp_path, flag):
    """`--stats-file victim.db` (or --metrics-file, --summary-json) replaced another
    campaign's database with text, exit 0, and `--stats-file t.jsonl` a tasks file: an
    existing file is replaced only if it is empty or what that flag itself writes."""
    from store.campaign import Store
    victim = tmp_path / "victim.db"
    Store.open(victim).close()
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"data": 1}\n')
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for path, held in ((victim, "an SQLite database"), (tasks, r"JSON \(a tasks file\?\)"),
                       (notes, "text starting 'my notes'")):
        before = path.read_bytes()
        with pytest.raises(ConfigError, match=f"^{flag} .*{path.name} exists and holds {held}"):
            resolve(tmp_path, "--demo", "5", flag, str(path))
        assert path.read_bytes() == before
    ours = {"--stats-file": "Quarantined worker results: 0\nProtocol-requeued dispatches: 0\n",
            "--metrics-file": "# HELP coordinator_tasks Tasks by state.\n",
            "--summary-json": '{\n  "tasks": {}, "committed_this_run": 5\n}\n'}[flag]
    again = tmp_path / "again"
    for text in ("", ours):  # an empty file (mktemp), or this flag's own from the last run
        again.write_text(text)
        assert resolve(tmp_path, "--demo", "5", flag, str(again))
    if flag == "--summary-json":  # JSON, but not a summary
        again.write_text('{"data": 1}\n')
        with pytest.raises(ConfigError, match="holds JSON"):
            resolve(tmp_path, "--demo", "5", flag, str(again))
    with pytest.raises(ConfigError, match=f"^{flag} /dev/null is not a regular file"):
        resolve(tmp_path, "--demo", "5", flag, "/dev/null")
