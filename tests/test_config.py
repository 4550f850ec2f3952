"""`coordinator run` flags and SYMCC_* variables as resolved before anything is launched
(pure logic: the parser and `resolve_run`, no MPI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.cli import _parser
from coordinator.config import ConfigError, resolve_run
from coordinator.exits import ExitStatus


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


@pytest.mark.parametrize("value", ["99999999999999999999999", "0", "-3", "x"])
def test_requeue_ids_sqlite_cannot_hold_are_usage_errors(value, capsys):
    """An id past SQLite's integers ended `requeue` in an OverflowError traceback."""
    with pytest.raises(SystemExit) as ended:
        _parser().parse_args(["requeue", "--db", "c.db", "--id", value])
    assert ended.value.code == ExitStatus.USAGE and "--id" in capsys.readouterr().err


def test_feedback_is_on_unless_turned_off(tmp_path):
    assert resolve(tmp_path).feedback is True
    assert resolve(tmp_path, "--no-feedback").feedback is False


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
        "this campaign's earlier runs used -- ./a @@; this --resume runs -- ./b @@"]
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
    assert notes == [(f"this campaign was started with --name symcc (now symc); its new test "
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


@pytest.mark.parametrize("flag, value", [("--tasks", "t.jsonl"), ("--demo", "5"),
                                         ("--callable", "m:f"), ("--out", "o")])
def test_a_single_valued_flag_given_twice_is_an_error(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        resolve(tmp_path, flag, value, flag, value)
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


def test_a_launcher_that_is_missing_or_fails_at_once_is_named(tmp_path):
    """`--mpiexec /nonexistent` ended in a traceback, `--mpiexec /bin/false` in exit 1 and not
    a word."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI"))}

    def launch(mpiexec: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "coordinator", "run", "--db",
                               str(tmp_path / "c.db"), "--no-progress", "--mpiexec", mpiexec],
                              capture_output=True, text=True, timeout=120, env=env, check=False)
    missing = launch(str(tmp_path / "nonexistent"))
    assert missing.returncode == ExitStatus.USAGE
    assert "--mpiexec" in missing.stderr and "no such executable" in missing.stderr
    assert "Traceback" not in missing.stderr
    false = launch("false")  # a name on PATH
    assert false.returncode == ExitStatus.FAILED
    assert "exited with status 1 before the master started" in false.stderr
    assert not (tmp_path / "c.db").exists()


def test_a_launch_that_open_mpis_launcher_failed_is_made_once_more(tmp_path):
    """Open MPI's launcher at times fails before any rank ran (exit 213, LAUNCHER_FAILED):
    `coordinator run` then launched nothing and failed. It now launches once more, and only
    once (a stand-in mpiexec that fails on its first launch, or on every one)."""
    import subprocess
    import sys

    from coordinator.launcher import LAUNCHER_FAILED
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI"))}
    launches = tmp_path / "launches"
    fake = tmp_path / "flaky-mpiexec"
    fake.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo "stand-in"; exit 0; }\n'
        f'echo launch >> {launches}\n'
        f'if [ "$(wc -l < {launches})" -le "$FAILURES" ]; then\n'
        f'  echo "{LAUNCHER_FAILED}" >&2; exit 213\n'
        "fi\n"
        "while [ $# -gt 0 ]; do\n"
        '  if [ "$1" = --master-pid-file ]; then echo $$ > "$2"; f=$2; fi; shift\n'
        'done\necho 0 > "$f.exit"\n')
    fake.chmod(0o755)

    def launch(failures: int) -> subprocess.CompletedProcess:
        launches.write_text("")
        return subprocess.run([sys.executable, "-m", "coordinator", "run", "--db",
                               str(tmp_path / "c.db"), "--no-progress", "--mpiexec", str(fake)],
                              capture_output=True, text=True, timeout=120, check=False,
                              env={**env, "FAILURES": str(failures)})

    once = launch(1)
    assert once.returncode == 0, once.stderr
    assert "status 213 before the master started; launching once more" in once.stderr
    assert launches.read_text().count("launch") == 2
    always = launch(5)
    assert always.returncode == 213, always.stderr
    assert always.stderr.count("launching once more") == 1
    assert "exited with status 213 before the master started" in always.stderr
    assert launches.read_text().count("launch") == 2


def test_a_killed_launchers_directory_is_removed_by_the_next_launch(tmp_path):
    """`coordinator run` keeps its pid files in a temporary directory; a SIGKILLed launcher
    left it behind. The next launch removes those whose launcher is gone, and only those."""
    import subprocess
    import sys

    from coordinator.launcher import (
        LAUNCH_DIR_PREFIX,
        LAUNCHER_PID,
        _remove_orphaned_launch_dirs,
    )

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dirs = {}
    for name, pid in (("orphan", gone.stdout.strip()), ("live", str(os.getpid())),
                      ("garbled", "not a pid"), ("legacy", None)):
        d = dirs[name] = tmp_path / f"{LAUNCH_DIR_PREFIX}{name}"
        d.mkdir()
        (d / "master.pid").write_text("123\n")
        if pid is not None:
            (d / LAUNCHER_PID).write_text(f"{pid}\n")
    (tmp_path / f"{LAUNCH_DIR_PREFIX}file").write_text("not a directory")
    (tmp_path / "unrelated").mkdir()
    _remove_orphaned_launch_dirs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{LAUNCH_DIR_PREFIX}{n}" for n in ("live", "garbled", "legacy", "file")] + ["unrelated"])


def test_a_self_launched_job_whose_master_never_starts_is_ended(tmp_path):
    """A rank that dies inside MPI_Init leaves Open MPI with ULFM waiting for ever, before any
    of our code runs. The self-launcher ends a job whose master has not started within
    --start-timeout (a stand-in mpiexec that hangs, in its own process group, here), and
    leaves one whose master did start alone however long it then runs."""
    import subprocess
    import sys
    import time as clock
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI"))}
    hang = tmp_path / "hanging-mpiexec"
    version = '[ "$1" = --version ] && { echo "stand-in"; exit 0; }\n'
    hang.write_text("#!/bin/sh\n" + version + "sleep 600 &\nwait\n")
    # Writes the master's pid, runs for 3 s, and records the master's exit status (0).
    starts = tmp_path / "starting-mpiexec"
    starts.write_text("#!/bin/sh\n" + version + "while [ $# -gt 0 ]; do\n"
                      "  if [ \"$1\" = --master-pid-file ]; then echo $$ > \"$2\"; f=$2; fi; shift\n"
                      "done\nsleep 3\necho 0 > \"$f.exit\"\n")
    for script in (hang, starts):
        script.chmod(0o755)

    def launch(mpiexec: Path) -> tuple[subprocess.CompletedProcess, float]:
        t0 = clock.monotonic()
        done = subprocess.run([sys.executable, "-m", "coordinator", "run", "--db",
                               str(tmp_path / "c.db"), "--no-progress", "--mpiexec",
                               str(mpiexec), "--start-timeout", "1"],
                              capture_output=True, text=True, timeout=120, env=env, check=False)
        return done, clock.monotonic() - t0

    ended, took = launch(hang)
    assert ended.returncode == ExitStatus.FAILED, ended.stderr
    assert "no master had started 1 s after the launch" in ended.stderr
    assert took < 30  # ended by the launcher, not by the test's own timeout
    started, _ = launch(starts)
    assert started.returncode == ExitStatus.OK, started.stderr
    assert "no master had started" not in started.stderr
    # A master that started and gave no status was killed, whatever mpiexec says (0 here).
    starts.write_text(starts.read_text().replace('echo 0 > "$f.exit"', ""))
    killed, _ = launch(starts)
    assert killed.returncode == ExitStatus.FAILED, killed.stderr
    assert "ended before the master recorded its status" in killed.stderr


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
