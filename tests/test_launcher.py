"""The self-launch under `mpiexec` (coordinator/launcher.py), driven with stand-in launchers
that fail, hang or start a master that records its status: what `coordinator run` says and
exits with, and what it leaves behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.exits import ExitStatus


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
    # One that ends well without a master (ranks that ran another `coordinator`) was exit 1
    # and not a word either.
    true = launch("true")
    assert true.returncode == ExitStatus.FAILED
    assert true.stderr == (f"coordinator: {shutil.which('true')} exited with status 0, but no "
                           f"master started (the ranks never reached the coordinator's start: "
                           f"see their output above, if any); nothing was changed\n")
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
    # Its own status is said; the run's is the table's (213 is not one of its meanings).
    assert always.returncode == ExitStatus.FAILED, always.stderr
    assert always.stderr.count("launching once more") == 1
    assert "exited with status 213 before the master started" in always.stderr
    assert launches.read_text().count("launch") == 2


def test_a_tmpdir_mpi_cannot_use_is_refused_before_the_launch(tmp_path):
    """Open MPI makes its session directory in TMPDIR: one it could not use made mpiexec exit
    213, which the launcher took for its launcher's start-up race (launched twice, said so,
    exit 213)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI"))}
    for tmp in (tmp_path / "missing", tmp_path / "a-file"):
        if tmp.name == "a-file":
            tmp.write_text("")
        got = subprocess.run([sys.executable, "-m", "coordinator", "run", "--db",
                              str(tmp_path / "c.db"), "--no-progress", "--demo", "3"],
                             capture_output=True, text=True, timeout=120, check=False,
                             env={**env, "TMPDIR": str(tmp)})
        assert got.returncode == ExitStatus.USAGE, got.stderr
        assert got.stderr == (f"coordinator: TMPDIR={tmp} is not a directory: MPI makes its "
                              f"session files there (set TMPDIR)\n")
        assert not (tmp_path / "c.db").exists()


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
                      "  if [ \"$1\" = --master-pid-file ]; then echo $$ > \"$2\"; f=$2; fi;"
                      " shift\n"
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
    assert "ended before the master recorded its status (" in killed.stderr
    assert "exited with status 0;" in killed.stderr
    # Nor mpiexec's 137 of a master's kill -9: the table reads it as "killed before the master
    # started, nothing changed", and a script would start it again without --resume.
    starts.write_text(starts.read_text() + "exit 137\n")
    killed, _ = launch(starts)
    assert killed.returncode == ExitStatus.FAILED, killed.stderr
    assert "exited with status 137;" in killed.stderr
    assert "run the same command again with --resume" in killed.stderr


def _fake_mpiexec(tmp_path: Path, version: str) -> str:
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\necho '{version}'\n")
    fake.chmod(0o755)
    return str(fake)


def test_open_mpi_gets_the_shorter_keepalive_and_mpich_none_of_its_flags(tmp_path):
    """A host cut off the network went unnoticed by Open MPI's launcher for 487 s (its TCP
    keepalive defaults); the self-launch passes settings that give up in about a minute, and
    only to Open MPI, whose launcher knows them."""
    from coordinator.launcher import OOB_KEEPALIVE, mpiexec_flags
    ompi = mpiexec_flags(_fake_mpiexec(tmp_path, "mpiexec (Open MPI) 5.0.11"), 4)
    for name, value in OOB_KEEPALIVE:
        at = ompi.index(name)
        assert ompi[at - 1] == "--prtemca" and ompi[at + 1] == str(value)
    keep = dict(OOB_KEEPALIVE)  # silence, then probes a while apart: gone within 90 s
    assert (keep["oob_tcp_keepalive_time"]
            + keep["oob_tcp_keepalive_intvl"] * keep["oob_tcp_keepalive_probes"]) <= 90
    (tmp_path / "m").mkdir()
    mpich = mpiexec_flags(_fake_mpiexec(tmp_path / "m", "HYDRA build details:"), 4)
    assert mpich == ["-n", "4"]


def test_a_wait_for_a_file_of_the_job_relaunches_it_once_its_launcher_failed(tmp_path):
    """tests/mpi_jobs.wait_for_path, as a test that waits for a job's --master-pid-file uses
    it: a job whose launcher failed before any rank ran (LAUNCHER_FAILED) is launched once
    more and the wait goes on (it waited out its whole minute, then failed on nothing); a
    job that ends otherwise fails the wait at once, with the job's output."""
    import subprocess

    import mpi_jobs
    import pytest

    from coordinator.launcher import LAUNCHER_FAILED
    launches, written = tmp_path / "launches", tmp_path / "pid"
    flaky = ('echo launch >> "$1"; if [ "$(wc -l < "$1")" -le 1 ]; then echo "$2" >&2; '
             'exit 213; fi; echo 1 > "$3"; sleep 30')

    def job(script: str) -> mpi_jobs.Job:
        started = mpi_jobs.Job(["sh", "-c", script, "sh", str(launches), LAUNCHER_FAILED,
                                str(written)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        mpi_jobs._started.append(started)  # (killed after the test by conftest)
        return started

    first = job(flaky)
    mpi_jobs.wait_for_path(written, timeout=20)
    assert first.relaunched == 1 and launches.read_text().count("launch") == 2
    job('echo "the job said why" >&2; exit 3')
    with pytest.raises(AssertionError, match="the job said why"):
        mpi_jobs.wait_for_path(tmp_path / "never", timeout=20)


def test_without_home_the_launch_takes_the_users_or_says_to_set_it(monkeypatch, tmp_path):
    import pwd

    from coordinator import launcher
    monkeypatch.delenv("HOME", raising=False)
    home = str(tmp_path)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: type("E", (), {"pw_dir": home}))
    assert launcher._home_unset() is None and os.environ["HOME"] == str(tmp_path)
    monkeypatch.delenv("HOME")
    home = str(tmp_path / "gone")
    assert launcher._home_unset() == ("HOME is not set, and this user has no home directory: "
                                      "MPI needs one (set HOME)")
    assert "HOME" not in os.environ


#: What a user's start directory may hold under the names of the project's own packages.
SHADOWS = {"store.py": "raise SystemExit('the start directory\\'s store.py')\n",
           "migrations.py": "raise SystemExit(5)\n",
           "coordinator.py": "print('the start directory\\'s coordinator.py')\n"}


def _start_directory_with_shadows(tmp_path: Path) -> Path:
    start = tmp_path / "start"
    start.mkdir()
    for name, text in SHADOWS.items():
        (start / name).write_text(text)
    return start


def test_the_ranks_start_without_the_start_directory_first_on_sys_path(tmp_path):
    """`python -m coordinator` puts the start directory first on sys.path: a user's store.py,
    migrations.py or coordinator.py there took the place of the project's packages in every
    rank. The ranks' command (and its form for a Python without -P) does not."""
    from coordinator.launcher import _SAFE_PATH_MAIN, rank_command

    start = _start_directory_with_shadows(tmp_path)
    for command in (rank_command(), [sys.executable, "-c", _SAFE_PATH_MAIN]):
        got = subprocess.run([*command, "status", "--db", str(tmp_path / "none.db")],
                             cwd=start, capture_output=True, text=True, timeout=60)
        assert (got.returncode, got.stdout, got.stderr) == (
            ExitStatus.USAGE, "",
            f"coordinator: {tmp_path / 'none.db'} does not exist (nothing was created)\n"), \
            command


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_self_launch_from_a_directory_holding_store_py_runs(tmp_path):
    """A store.py, migrations.py or coordinator.py in the directory `coordinator run` starts
    from broke every self-launched run, --demo too: a traceback then a wait for
    --start-timeout blaming MPI_Init, exit 5, or a silent exit 1. A --callable module there
    (and a module beside it that it imports) is still found."""
    import sqlite3
    import time as clock

    start = _start_directory_with_shadows(tmp_path)
    (start / "helper.py").write_text("def twice(n):\n    return 2 * n\n")
    (start / "mymod.py").write_text("import helper\ndef f(task):\n"
                                    "    return helper.twice(task['data']['n'])\n")
    (start / "tasks.jsonl").write_text("".join(f'{{"data": {{"n": {i}}}}}\n' for i in range(5)))
    # The `coordinator` script, as installed: the start directory is not on its sys.path.
    script = tmp_path / "bin" / "coordinator"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom coordinator.cli import main\n"
                      f"sys.exit(main())\n")
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMI", "PMIX", "HYDRA", "MPI_LOCAL"))}
    for name, args in (("demo", ["--demo", "5"]),
                       ("callable", ["--tasks", "tasks.jsonl", "--callable", "mymod:f"])):
        t0 = clock.monotonic()
        done = subprocess.run([str(script), "run", "--db", f"{name}.db", "--np", "2",
                               "--no-progress", "--start-timeout", "30", *args], cwd=start,
                              capture_output=True, text=True, timeout=150, env=env)
        assert done.returncode == ExitStatus.OK, done.stderr[-3000:]
        assert "start directory's" not in done.stdout + done.stderr
        assert clock.monotonic() - t0 < 30  # not a wait for --start-timeout
        with sqlite3.connect(start / f"{name}.db") as db:
            got = db.execute("SELECT status, value FROM results ORDER BY task_id").fetchall()
        assert [status for status, _ in got] == ["ok"] * 5
        if name == "callable":
            assert [v for _, v in got] == [str(2 * i) for i in range(5)]


def test_a_callable_file_in_the_start_directory_imports_the_modules_beside_it(tmp_path):
    """Without the start directory on the ranks' sys.path (-P), a `--callable good.py:f`
    whose file imports a module beside it found it no more: the executor adds the start
    directory (last) for a file spec too, as for a module spec."""
    (tmp_path / "helper.py").write_text("ANSWER = 42\n")
    (tmp_path / "good.py").write_text("import helper\ndef f(task):\n    return helper.ANSWER\n")
    script = ("from coordinator.executors import PythonExecutor; "
              "print(PythonExecutor('good.py:f').run({}, None, '.').value)")
    # (-P is Python 3.11's: before it, the same by hand, as `launcher.rank_command` does.)
    got = subprocess.run(
        [sys.executable, "-P", "-c", script] if sys.version_info >= (3, 11)
        else [sys.executable, "-c", f"import sys; del sys.path[0]; {script}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (got.returncode, got.stdout) == (0, "42\n"), got.stderr
