"""Executors against real subprocesses and real Python modules (no mocks)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import msgspec
import pytest

from coordinator.cli import _parser
from coordinator.config import resolve_run
from coordinator.errors import UsageError
from coordinator.executors import (
    CommandExecutor,
    DemoExecutor,
    Executor,
    PythonExecutor,
    build_executor,
    collatz_steps,
    make_executor,
    output_limits,
)
from coordinator.processes import TEARDOWN_SIGNAL
from coordinator.wire import (
    DETAIL_MAX_CHARS,
    MAX_TESTCASE_NAME_CHARS,
    MAX_VALUE_BYTES,
    detail_summary,
    failure_detail,
)
from coordinator.worker_rank import say_if_not_runnable_here

# Writes two outputs (named so that name order != creation order) plus things that must be
# ignored, reports what it saw on stderr, and exits 3 for inputs starting with b"fail".
TARGET = textwrap.dedent(
    """
    import os, sys
    out = os.environ["SYMCC_OUTPUT_DIR"]
    args = sys.argv[1:]
    if args:
        path = args[0].split("=", 1)[-1]
        data = open(path, "rb").read()
    else:
        data = sys.stdin.buffer.read()
    with open(os.path.join(out, "000001"), "wb") as f:
        f.write(data[::-1])
    with open(os.path.join(out, "000000"), "wb") as f:
        f.write(b"A" + data)
    with open(os.path.join(out, ".hidden"), "wb") as f:
        f.write(b"dot file")
    os.mkdir(os.path.join(out, "subdir"))
    with open(os.path.join(out, "subdir", "nested"), "wb") as f:
        f.write(b"nested")
    os.symlink("/etc/hostname", os.path.join(out, "link"))
    sys.stderr.write("input-env=%s\\n" % os.environ.get("SYMCC_INPUT_FILE"))
    sys.exit(3 if data.startswith(b"fail") else 0)
    """
)

# Forks a grandchild in the same process group, records both pids, writes one test case, hangs.
HANGING_TARGET = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(os.path.join(os.environ["SYMCC_OUTPUT_DIR"], "early"), "wb") as f:
        f.write(b"written before the hang")
    with open(sys.argv[1], "w") as f:
        f.write("%d %d" % (os.getpid(), child.pid))
    time.sleep(60)
    """
)

# Writes N files of the given sizes: argv = [N, size].
MANY_FILES_TARGET = textwrap.dedent(
    """
    import os, sys
    out = os.environ["SYMCC_OUTPUT_DIR"]
    count, size = int(sys.argv[1]), int(sys.argv[2])
    for i in range(count):
        with open(os.path.join(out, "tc%03d" % i), "wb") as f:
            f.write(bytes([i]) * size)
    """
)


def write_script(tmp_path: pathlib.Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


# ---------------------------------------------------------------------------------- command


def test_command_file_mode_with_input_bytes(tmp_path, workdir):
    target = write_script(tmp_path, "target.py", TARGET)
    ex = CommandExecutor([sys.executable, target, "@@"], timeout_s=30)
    out = ex.run({"path": "/nonexistent/ignored"}, b"hello", workdir)
    assert out.status == "ok"
    assert out.returncode == 0
    assert out.value is None
    # sorted by name; dot file, subdirectory and symlink are not test cases
    assert out.testcases == [("000000", b"Ahello"), ("000001", b"olleh")]
    assert (workdir / "input").read_bytes() == b"hello"
    assert f"input-env={workdir.resolve() / 'input'}" in out.detail
    assert out.duration_s > 0


def test_command_file_mode_uses_task_path_inside_an_argument(tmp_path, workdir):
    target = write_script(tmp_path, "target.py", TARGET)
    seed = tmp_path / "seed"
    seed.write_bytes(b"xyz")
    ex = CommandExecutor([sys.executable, target, "--input=@@"], timeout_s=30)
    out = ex.run({"path": str(seed)}, None, workdir)
    assert out.status == "ok", out.detail
    assert out.testcases == [("000000", b"Axyz"), ("000001", b"zyx")]
    assert not (workdir / "input").exists()


def test_command_stdin_mode_and_no_inherited_input_file(tmp_path, workdir, monkeypatch):
    # An inherited SYMCC_INPUT_FILE would make SymCC treat stdin as concrete.
    monkeypatch.setenv("SYMCC_INPUT_FILE", "/bogus/from/the/environment")
    target = write_script(tmp_path, "target.py", TARGET)
    ex = CommandExecutor([sys.executable, target], timeout_s=30)
    out = ex.run({}, b"stdin data", workdir)
    assert out.status == "ok", out.detail
    assert out.testcases == [("000000", b"Astdin data"), ("000001", b"atad nidts")]
    assert "input-env=None" in out.detail


def test_command_file_mode_leaves_a_memory_input_harness_alone(tmp_path, workdir, monkeypatch):
    """SymCC refuses SYMCC_INPUT_FILE beside SYMCC_MEMORY_INPUT, which the user sets for a
    harness that makes a buffer symbolic itself: every run failed."""
    monkeypatch.setenv("SYMCC_MEMORY_INPUT", "1")
    monkeypatch.setenv("SYMCC_INPUT_FILE", "/bogus/from/the/environment")
    target = write_script(tmp_path, "target.py", TARGET)
    out = CommandExecutor([sys.executable, target, "@@"], timeout_s=30).run({}, b"hi", workdir)
    assert out.status == "ok", out.detail
    assert "input-env=None" in out.detail
    monkeypatch.setenv("SYMCC_MEMORY_INPUT", "0")
    again = tmp_path / "again"
    again.mkdir()
    out = CommandExecutor([sys.executable, target, "@@"], timeout_s=30).run({}, b"hi", again)
    assert f"input-env={again.resolve() / 'input'}" in out.detail


def test_command_nonzero_exit_is_an_error_but_keeps_testcases(tmp_path, workdir):
    target = write_script(tmp_path, "target.py", TARGET)
    ex = CommandExecutor([sys.executable, target, "@@"], timeout_s=30)
    out = ex.run({}, b"fail!", workdir)
    assert out.status == "error"
    assert out.returncode == 3
    assert "exited with status 3" in out.detail
    assert [name for name, _ in out.testcases] == ["000000", "000001"]


def test_command_missing_input_is_an_outcome_not_an_exception(tmp_path, workdir):
    target = write_script(tmp_path, "target.py", TARGET)
    ex = CommandExecutor([sys.executable, target, "@@"], timeout_s=30)
    out = ex.run({"path": str(tmp_path / "gone")}, None, workdir)
    assert out.status == "error"
    assert "cannot materialise input" in out.detail
    assert ex.run({}, None, workdir).status == "error"


def test_command_program_gone_after_the_start_is_the_hosts_failure_not_the_tasks(
        tmp_path, workdir):
    """Retried (`not_run`), never committed as the task's error: the task is only an input."""
    target = tmp_path / "target"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    ex = CommandExecutor([str(target), "@@"], timeout_s=30)
    target.unlink()
    out = ex.run({}, b"x", workdir)
    assert out.status == "not_run"
    assert "cannot start" in out.detail and "No such file" in out.detail


def test_an_input_the_hosts_full_disk_cannot_take_is_not_run_a_missing_one_is_an_error(
        tmp_path, tiny_fs):
    target = write_script(tmp_path, "target.py", TARGET)
    ex = CommandExecutor([sys.executable, target, "@@"], timeout_s=30)
    with contextlib.suppress(OSError), open(tiny_fs / "filler", "wb") as f:
        while True:  # the disk filled for real
            f.write(b"\0" * 65536)
    out = ex.run({}, b"x" * 200_000, tiny_fs)
    assert out.status == "not_run", out
    assert "No space left on device" in out.detail
    # The task's own input gone, or a name no file can have: its outcome, whatever the disk.
    assert ex.run({"path": str(tmp_path / "gone")}, None, tmp_path).status == "error"
    long = ex.run({"path": str(tmp_path / ("a" * 300))}, None, tmp_path)
    assert (long.status, long.detail) == ("error", (
        f"cannot materialise input: input file {str(tmp_path / ('a' * 300))!r} cannot be "
        f"read: File name too long"))


def test_command_program_is_resolved_and_checked_when_built(tmp_path, workdir, monkeypatch):
    """Each dispatch runs in a directory of its own: `./target` means the start directory's."""
    (tmp_path / "target").write_text("#!/bin/sh\necho ran > \"$SYMCC_OUTPUT_DIR/out\"\n")
    (tmp_path / "target").chmod(0o755)
    (tmp_path / "plain").write_text("#!/bin/sh\n")
    monkeypatch.chdir(tmp_path)
    ex = CommandExecutor(["./target"], timeout_s=30)
    assert ex.argv == [str(tmp_path / "target")]
    out = ex.run({}, b"x", workdir)
    assert out.status == "ok", out.detail
    assert out.testcases == [("out", b"ran\n")]
    assert CommandExecutor(["sh", "-c", "true"], timeout_s=1).argv[0] == shutil.which("sh")
    with pytest.raises(UsageError, match="no such file"):
        CommandExecutor(["./no-such-target", "@@"], timeout_s=1)
    with pytest.raises(UsageError, match="not executable"):
        CommandExecutor(["./plain"], timeout_s=1)
    with pytest.raises(UsageError, match="not on PATH"):
        CommandExecutor(["no-such-program-here"], timeout_s=1)
    with pytest.raises(UsageError, match="is a directory"):
        CommandExecutor([str(tmp_path)], timeout_s=1)
    with pytest.raises(UsageError, match="is empty"):
        CommandExecutor([""], timeout_s=1)


def test_a_worker_takes_the_masters_program_unchecked_and_answers_not_run(tmp_path, workdir,
                                                                         capsys):
    """A worker that started after another rank's run took the target's exec bit refused to
    build its executor and left the job, which under MPICH aborted every rank's work (a CI
    run). The master's resolved path is taken as it is; a task this node cannot start is
    `not_run` (the master rests the rank), and the rank says once what is wrong here."""
    prog = tmp_path / "target"
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o644)
    cfg = resolve_run(_parser().parse_args(["run", "--db", str(tmp_path / "c.db"), "--tasks",
                                            str(tmp_path / "t.jsonl"), "--", "./target", "@@"]))
    ex = build_executor(cfg, [str(prog), "@@"])
    assert ex.argv == [str(prog), "@@"]
    out = ex.run({}, b"x", workdir)
    assert out.status == "not_run", out
    assert out.detail.startswith(f"cannot start {str(prog)!r}: Permission denied"), out.detail
    prog.chmod(0o755)
    assert ex.run({}, b"x", workdir).status == "ok"  # fixed on the node: runs again
    prog.chmod(0o644)
    say_if_not_runnable_here(3, str(prog))
    said = capsys.readouterr().err
    assert said.startswith(f"coordinator: rank 3: command {str(prog)!r} is not executable"), said
    assert "its tasks here answer not_run" in said
    prog.chmod(0o755)
    say_if_not_runnable_here(3, str(prog))
    assert capsys.readouterr().err == ""
    # Only the master's absolute path is taken unchecked; the master's own build checks.
    with pytest.raises(UsageError, match="absolute path"):
        CommandExecutor(["target"], timeout_s=1, resolved=True)
    prog.chmod(0o644)
    with pytest.raises(UsageError, match="not executable"):
        build_executor(dataclasses.replace(cfg, argv=[str(prog), "@@"]))


def test_a_script_without_an_interpreter_line_is_refused_when_built(tmp_path, workdir,
                                                                   monkeypatch):
    """`printf 'echo hi' > t; chmod +x t` passed every check, then each task failed with
    "Exec format error", committed as its error result, and the run exited 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "noshebang").write_text("echo hi\n")
    (tmp_path / "noshebang").chmod(0o755)
    with pytest.raises(UsageError, match="is a script without a `#!` line"):
        CommandExecutor(["./noshebang", "@@"], timeout_s=1)
    # What the kernel runs stays accepted: a script with one, an ELF binary, and a binary
    # format binfmt_misc may know (not text).
    (tmp_path / "other").write_bytes(b"MZ\x90\x00\x03\x00" + bytes(range(256)))
    (tmp_path / "other").chmod(0o755)
    CommandExecutor(["./other", "@@"], timeout_s=1)
    elf = os.path.realpath(sys.executable)
    assert CommandExecutor([elf, "@@"], timeout_s=1).argv[0] == elf
    assert CommandExecutor(["sh", "-c", "true"], timeout_s=1).argv[0] == shutil.which("sh")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # a zombie waiting for an init that does not reap is dead for our purposes
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_command_timeout_kills_the_whole_process_group(tmp_path, workdir):
    target = write_script(tmp_path, "hang.py", HANGING_TARGET)
    pid_file = tmp_path / "pids"
    ex = CommandExecutor([sys.executable, target, str(pid_file)], timeout_s=1.0)
    out = ex.run({}, b"x", workdir)
    assert out.status == "timeout"
    assert "timed out" in out.detail
    assert out.testcases == [("early", b"written before the hang")]
    assert pid_file.exists(), "the target did not start within the timeout"
    pids = [int(p) for p in pid_file.read_text().split()]
    # SIGKILL delivery is asynchronous; bounded wait, not a timing assertion
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(_gone(p) for p in pids), f"still alive: {[p for p in pids if not _gone(p)]}"


def test_a_target_does_not_inherit_the_mpi_launchers_variables(tmp_path, workdir, monkeypatch):
    """With them, a target that uses MPI joined the job as its worker's rank (`rank 1 size
    2`), and the real rank crashed in MPI_Improbe: the run lost it."""
    launcher = {"OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1", "PMIX_NAMESPACE": "prterun-x",
                "PMI_FD": "7", "PRTE_MCA_x": "y", "HYDRA_PROXY": "1", "HYDI_CONTROL_FD": "9",
                "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    for k, v in {**launcher, "MY_TARGET_SETTING": "kept"}.items():
        monkeypatch.setenv(k, v)
    env_file = tmp_path / "env.json"
    target = write_script(tmp_path, "env.py", "import json, os, sys\n"
                          "json.dump(dict(os.environ), open(sys.argv[1], 'w'))\n")
    out = CommandExecutor([sys.executable, target, str(env_file), "@@"], timeout_s=30).run(
        {}, b"x", workdir)
    assert out.status == "ok", out.detail
    seen = json.loads(env_file.read_text())
    assert not set(launcher) & set(seen)
    assert seen["MY_TARGET_SETTING"] == "kept" and "SYMCC_OUTPUT_DIR" in seen


# Starts a daemon in a session of its own (out of the target's process group), which records
# its pid and sleeps; the target itself exits at once, successfully.
DAEMONIZING_TARGET = textwrap.dedent(
    """
    import subprocess, sys, time
    pid_file = sys.argv[1]
    subprocess.Popen([sys.executable, "-c",
                      "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid()));"
                      " time.sleep(60)", pid_file], start_new_session=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the daemon is up and has said who it is
        try:
            if open(pid_file).read():
                break
        except OSError:
            pass
        time.sleep(0.01)
    """
)


RUN_A_HANGING_COMMAND = textwrap.dedent("""\
    import sys
    from coordinator.executors import CommandExecutor
    CommandExecutor([sys.executable, sys.argv[1], sys.argv[2]], timeout_s=600).run(
        {}, b"x", sys.argv[3])
""")


def test_a_command_ends_with_its_worker_killed_by_sigkill(tmp_path, workdir):
    """A worker ended by SIGKILL (three Ctrl-C, a killed launcher, mpiexec ending the job)
    could not end its command, in a session of its own: the target ran on, past --timeout,
    for ever if it hung."""
    target = write_script(tmp_path, "hang.py", HANGING_TARGET)
    pids = tmp_path / "pids"
    worker = subprocess.Popen([sys.executable, "-c", RUN_A_HANGING_COMMAND, target, str(pids),
                               str(workdir)])
    try:
        deadline = time.monotonic() + 30
        while not (pids.exists() and pids.read_text()):
            assert time.monotonic() < deadline, "the target never started"
            time.sleep(0.02)
        command = int(pids.read_text().split()[0])
        assert not _gone(command)
        worker.kill()
        worker.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _gone(command) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gone(command), f"the command {command} outlived its worker"
    finally:
        if worker.poll() is None:
            worker.kill()
        for pid in (pids.read_text().split() if pids.exists() else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_a_process_that_leaves_the_targets_group_is_ended_with_it(tmp_path, workdir):
    """A daemon the target started in a session of its own escaped the group kill and
    outlived the whole job (its parent then init)."""
    target = write_script(tmp_path, "daemon.py", DAEMONIZING_TARGET)
    pid_file = tmp_path / "daemon.pid"
    out = CommandExecutor([sys.executable, target, str(pid_file), "@@"], timeout_s=30).run(
        {}, b"x", workdir)
    assert out.status == "ok", out.detail
    daemon = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(daemon) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(daemon), f"the daemon {daemon} outlived its target"


def test_a_failure_while_a_target_runs_does_not_leave_it_running(tmp_path, workdir,
                                                                  monkeypatch):
    """Anything raised between the start and the wait (a thread that cannot start) used to
    leave the target and its group running, unsupervised, past --timeout."""
    from coordinator import executors

    def cannot_start(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(executors._TailReader, "start", cannot_start)
    target = write_script(tmp_path, "hang.py", HANGING_TARGET)
    pid_file = tmp_path / "pids"
    ex = CommandExecutor([sys.executable, target, str(pid_file)], timeout_s=30)
    with pytest.raises(RuntimeError):
        ex.run({}, b"x", workdir)

    def running_it() -> list[int]:  # (by its command line: it may not have written its pid)
        mine = []
        for entry in os.listdir("/proc"):
            try:
                cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if str(pid_file).encode() in cmdline and not _gone(int(entry)):
                mine.append(int(entry))
        return mine

    deadline = time.monotonic() + 10
    while running_it() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_it() == []


@pytest.mark.timeout(30)
def test_an_output_file_swapped_for_a_pipe_does_not_block_the_worker(tmp_path):
    """The output files are listed, then read: one a leftover process swaps for a pipe
    meanwhile is unreadable, not a read that waits for a writer for ever."""
    from coordinator.executors import _read_bounded
    fifo = tmp_path / "000000"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="no longer a regular file"):
        _read_bounded(str(fifo), 1 << 20)


def test_command_file_count_limit(tmp_path, workdir):
    target = write_script(tmp_path, "many.py", MANY_FILES_TARGET)
    ex = CommandExecutor([sys.executable, target, "5", "10"], timeout_s=30, max_files=2)
    out = ex.run({}, b"", workdir)
    assert out.status == "ok"
    assert [name for name, _ in out.testcases] == ["tc000", "tc001"]
    assert "dropped 3 of 5 output files" in out.detail and out.dropped == 3


ODD_ENTRIES_TARGET = """
import os
out = os.environ["SYMCC_OUTPUT_DIR"]
open(os.path.join(out, "kept"), "wb").write(b"a test case")
open(os.path.join(out, ".partial"), "wb").write(b"a temporary file")
os.mkdir(os.path.join(out, "subdir"))
os.symlink("/etc/passwd", os.path.join(out, "link"))
os.mkfifo(os.path.join(out, "fifo"))
"""


def test_output_entries_that_are_not_test_cases_are_counted_in_the_note(tmp_path, workdir):
    """Dot files, directories, symlinks and pipes are not test cases; they used to vanish
    without a word."""
    target = write_script(tmp_path, "odd.py", ODD_ENTRIES_TARGET)
    out = CommandExecutor([sys.executable, target], timeout_s=30).run({}, b"", workdir)
    assert out.status == "ok", out.detail
    assert out.testcases == [("kept", b"a test case")]
    assert out.detail == ("dropped 4 of 5 output entries (dot files, directories, symlinks "
                          "and other entries that are not regular files)")
    assert out.dropped == 0  # none of them was a test case
    assert failure_detail({"status": "ok", "detail": out.detail}) == out.detail


def test_command_file_size_limits(tmp_path, workdir):
    target = write_script(tmp_path, "many.py", MANY_FILES_TARGET)
    too_big = CommandExecutor([sys.executable, target, "2", "100"], timeout_s=30, max_file_bytes=99)
    out = too_big.run({}, b"", workdir)
    assert out.testcases == []
    assert "dropped 2 of 2 output files (2 over 99 bytes" in out.detail and out.dropped == 2

    workdir2 = tmp_path / "work2"
    workdir2.mkdir()
    total = CommandExecutor([sys.executable, target, "4", "100"], timeout_s=30, max_total_bytes=250)
    out = total.run({}, b"", workdir2)
    assert [name for name, _ in out.testcases] == ["tc000", "tc001"]
    assert sum(len(c) for _, c in out.testcases) <= 250
    assert "dropped 2 of 4 output files" in out.detail


@pytest.mark.parametrize(
    "kwargs",
    [
        ({"argv": [], "timeout_s": 1}, "non-empty argv"),
        ({"argv": "./target @@", "timeout_s": 1}, "non-empty argv"),
        ({"argv": ["sh"], "timeout_s": 0}, "timeout .* must be > 0"),
        ({"argv": ["sh"], "timeout_s": 5e6}, "at most 1,000,000 seconds"),
        ({"argv": ["sh"], "timeout_s": 1, "max_files": 0}, "max_files"),
    ],
)
def test_command_rejects_bad_configuration(kwargs):
    kwargs, why = kwargs
    with pytest.raises(UsageError, match=why):
        CommandExecutor(**kwargs)


# ----------------------------------------------------------------------------------- python

TASK_MODULE = textwrap.dedent(
    """
    NOT_CALLABLE = 42

    def square(task):
        n = task["data"]["n"]
        task["data"]["n"] = "mutated"
        return {"n": n, "square": n * n, "pair": (n, n)}

    def size(task, input_bytes):
        return {"size": None if input_bytes is None else len(input_bytes)}

    def boom(task):
        raise RuntimeError("kaput for " + str(task["data"]))

    def leaves(task):
        raise SystemExit(7)

    def interrupts(task):
        raise KeyboardInterrupt("from the callable")

    def exits(task):
        try:
            import os
            os._exit(7)
        except Exception:  # the callable's own catch-all must not swallow it
            return "swallowed"

    def thread_exits(task):
        import os, threading
        t = threading.Thread(target=os._exit, args=(9,))  # a hard limit, as a Timer would
        t.start()
        t.join()
        return "not reached"

    def forks(task):
        import os
        pid = os.fork()
        if pid == 0:
            os._exit(task["code"])  # the child leaves for real
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    def not_json(task):
        return {"x": object()}

    def nan(task):
        return [float("nan")]

    def emits(task):
        return {"found": 2, "testcases": {"a": b"first", "b": bytearray(b"second")}}

    def bad_testcases(task):
        return {"testcases": {"a": "not bytes"}}

    def cancelled(task):
        import asyncio
        raise asyncio.CancelledError("from the callable")

    def closes(task):
        raise GeneratorExit()

    class Custom(BaseException):
        pass

    def custom(task):
        raise Custom("a BaseException of its own")

    def sized(task):
        return {"blob": "x" * task["n"]}

    def floats(task):
        return [0.0] * task["n"]

    def long_name(task):
        return {"testcases": {"n" * task["n"]: b"found"}}

    def sleeps(task):
        import time
        time.sleep(task["s"])
        return "woke"
    """
)


@pytest.fixture
def task_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "farm_tasks.py"
    path.write_text(TASK_MODULE)
    return path


def test_python_happy_path_from_file_spec(task_file, workdir):
    ex = PythonExecutor(f"{task_file}:square")
    task = {"data": {"n": 7}}
    out = ex.run(task, None, workdir)
    assert out.status == "ok", out.detail
    assert out.value == {"n": 7, "square": 49, "pair": [7, 7]}  # as JSON will carry it
    assert task == {"data": {"n": 7}}  # the callable got a copy
    assert out.testcases == []


def python_probe(script: str, *args: str, cwd: pathlib.Path | None = None,
                 ) -> subprocess.CompletedProcess:
    """`script` in a Python process of its own (what it tests could end or change this one)."""
    return subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60, check=False)


def test_a_module_spec_is_found_in_the_start_directory_without_python_m(tmp_path):
    """The `coordinator` console script (under a user's own mpiexec) has no start directory
    on sys.path, unlike `python -m coordinator`: `--callable mypkg.work:solve` failed there."""
    (tmp_path / "mymod_here.py").write_text("def solve(task):\n    return task['n'] * 2\n")
    script = ("import os, sys; sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]"
              "; from coordinator.executors import PythonExecutor; "
              "print(PythonExecutor('mymod_here:solve').run({'n': 21}, None, '.').value)")
    probe = python_probe(script, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout == "42\n"


def test_python_module_spec_and_two_argument_form(tmp_path, workdir, monkeypatch):
    module_name = f"farm_{tmp_path.name}"
    (tmp_path / f"{module_name}.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        ex = PythonExecutor(f"{module_name}:size")
        assert ex.run({"path": "p"}, b"12345", workdir).value == {"size": 5}
        assert ex.run({"path": "p"}, None, workdir).value == {"size": None}
    finally:
        sys.modules.pop(module_name, None)


def raised_at(path: pathlib.Path, line: str, function: str) -> str:
    """The last line of a raising callable's detail: the file as the detail shows it (not
    under this test's start directory: whole), the line's number, the function."""
    number = path.read_text().splitlines().index(line) + 1
    return f"raised at {path}:{number} in {function}"


def test_python_exception_becomes_an_error_outcome(task_file, workdir):
    out = PythonExecutor(f"{task_file}:boom").run({"data": 1}, None, workdir)
    assert out.status == "error"
    assert out.detail == ("RuntimeError: kaput for 1\n" + raised_at(
        task_file, '    raise RuntimeError("kaput for " + str(task["data"]))', "boom"))
    out = PythonExecutor(f"{task_file}:leaves").run({"data": 1}, None, workdir)
    assert out.status == "error"
    assert out.detail.startswith("SystemExit")
    # workers ignore SIGINT: this one can only come from the callable, a task failure too
    out = PythonExecutor(f"{task_file}:interrupts").run({"data": 1}, None, workdir)
    assert out.status == "error"
    assert out.detail.startswith("KeyboardInterrupt: from the callable\nraised at ")


def test_an_exceptions_detail_says_where_it_was_raised(tmp_path, workdir, monkeypatch):
    """A raising callable left only `ValueError: bad input -1` in results.detail: no file,
    line or function. Its last line now says where (the file relative to the start
    directory when under it), and, for one raised in a library the callable called, the
    callable's own line too; within the detail's bound, and what `status` shows."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.py").write_text(
        "import json\n"
        "def f(task):\n"
        "    if task['n'] < 0:\n"
        "        raise ValueError(f\"bad input {task['n']}\")\n"
        "def parses(task):\n"
        "    return json.loads('{bad')\n"
        "def long(task):\n"
        "    raise ValueError('x' * 5000)\n")
    out = PythonExecutor("good.py:f").run({"n": -1}, None, workdir)
    assert (out.status, out.detail) == ("error",
                                        "ValueError: bad input -1\nraised at good.py:4 in f")
    assert detail_summary(out.detail) == "ValueError: bad input -1 … raised at good.py:4 in f"
    deep = PythonExecutor("good.py:parses").run({}, None, workdir).detail
    assert deep.startswith("JSONDecodeError: Expecting property name")
    assert re.fullmatch(r"raised at \S*json/decoder\.py:\d+ in raw_decode, called from "
                        r"good\.py:6 in parses", deep.splitlines()[-1]), deep
    long = PythonExecutor("good.py:long").run({}, None, workdir).detail
    assert len(long) == DETAIL_MAX_CHARS
    assert long.endswith("xxx\nraised at good.py:8 in long")


@pytest.mark.parametrize(("function", "detail"), [
    ("cancelled", "CancelledError: from the callable"),
    ("closes", "GeneratorExit: "),
    ("custom", "Custom: a BaseException of its own")])
def test_any_base_exception_of_the_callable_is_the_tasks_error(task_file, workdir, function,
                                                                detail):
    """asyncio.CancelledError, GeneratorExit or a BaseException class of the user's own went
    past the executor and the worker's task loop and took the rank out of the job (in a
    batch, its halves then took the next ranks)."""
    out = PythonExecutor(f"{task_file}:{function}").run({"data": 1}, None, workdir)
    assert out.status == "error"
    assert out.detail.startswith(f"{detail}\nraised at {task_file}:")
    assert out.detail.endswith(f" in {function}")


TEARDOWN_DURING_A_CALL = textwrap.dedent("""\
    import os, signal, sys, threading
    from coordinator.executors import PythonExecutor
    from coordinator.processes import TEARDOWN_SIGNAL
    from coordinator.worker import torn_down
    signal.signal(TEARDOWN_SIGNAL, torn_down)
    threading.Timer(0.3, os.kill, (os.getpid(), TEARDOWN_SIGNAL)).start()
    out = PythonExecutor(sys.argv[1]).run({"s": 20}, None, sys.argv[2])
    print("stayed:", out.status, out.detail)
""")


def test_a_teardown_signal_during_a_call_ends_the_worker(task_file, workdir):
    """The master's teardown signal (it gave up on the rank) arrived while a callable ran:
    the handler's os._exit was the callable's replacement, so the worker reported the task
    as an error ("the callable called os._exit(140)") and went on until the fence's
    SIGKILL."""
    probe = python_probe(TEARDOWN_DURING_A_CALL, f"{task_file}:sleeps", str(workdir))
    assert probe.returncode == 128 + TEARDOWN_SIGNAL, (probe.stdout, probe.stderr)
    assert probe.stdout == ""


def test_a_value_over_the_masters_bound_is_the_tasks_error(task_file, workdir):
    """The master refuses a whole RESULT whose value is over MAX_VALUE_BYTES: sent, it was an
    invalid RESULT (its batch split, the task retried, then deferred, each --resume again).
    Refused by the executor, it is the task's error, said once."""
    ok = PythonExecutor(f"{task_file}:sized").run({"n": MAX_VALUE_BYTES - 100}, None, workdir)
    assert ok.status == "ok", ok.detail
    over = PythonExecutor(f"{task_file}:sized").run({"n": MAX_VALUE_BYTES}, None, workdir)
    assert over.status == "error"
    size = len(msgspec.msgpack.encode({"blob": "x" * MAX_VALUE_BYTES}))  # as the master counts
    assert over.detail == (f"result is {size} bytes encoded, over the "
                           f"{MAX_VALUE_BYTES} a value may have: return bulk output as test "
                           f"cases")
    # Floats take 9 bytes of msgpack and 5 of JSON text ("0.0, "): measured, not guessed.
    n = MAX_VALUE_BYTES // 9 + 1
    assert PythonExecutor(f"{task_file}:floats").run({"n": n}, None, workdir).status == "error"


def test_a_test_case_name_over_the_masters_bound_is_the_tasks_error(task_file, workdir):
    ex = PythonExecutor(f"{task_file}:long_name")
    assert ex.run({"n": MAX_TESTCASE_NAME_CHARS}, None, workdir).status == "ok"
    out = ex.run({"n": MAX_TESTCASE_NAME_CHARS + 1}, None, workdir)
    assert (out.status, out.detail) == ("error", (
        f"result['testcases'] has a name of {MAX_TESTCASE_NAME_CHARS + 1} characters, over "
        f"the {MAX_TESTCASE_NAME_CHARS} the master takes"))


def test_python_os_exit_is_the_tasks_failure_and_the_worker_stays(task_file, workdir):
    """Under ULFM a rank that leaves with a nonzero status is never reported failed: the
    callable's os._exit(7) used to make its rank vanish unseen until the watchdog."""
    # In a process of its own: without the guard, os._exit would end the test run.
    script = ("import os, sys; from coordinator.executors import PythonExecutor; "
              "real = os._exit; out = PythonExecutor(sys.argv[1]).run({}, None, sys.argv[2]); "
              "print(out.status, out.detail, os._exit is real)")
    probe = python_probe(script, f"{task_file}:exits", str(workdir))
    assert probe.returncode == 0, probe.stderr
    # (where: the callable's call of os._exit, not the executor's stand-in for it)
    assert probe.stdout == ("error CallableExited: the callable called os._exit(7); the "
                            "worker stayed\n" + raised_at(task_file, "        os._exit(7)",
                                                          "exits") + " True\n")
    # Another thread's os._exit (a Timer putting a hard limit on the call) ends the process
    # for real, as it would without the worker.
    probe = python_probe(script, f"{task_file}:thread_exits", str(workdir))
    assert probe.returncode == 9, (probe.stdout, probe.stderr)
    real_exit = os._exit
    # A child the callable forks exits for real, with its own status.
    assert PythonExecutor(f"{task_file}:forks").run({"code": 5}, None, workdir).value == 5
    assert os._exit is real_exit


@pytest.mark.parametrize("function", ["not_json", "nan", "bad_testcases"])
def test_python_non_json_result_is_an_error(task_file, workdir, function):
    out = PythonExecutor(f"{task_file}:{function}").run({"data": 1}, None, workdir)
    assert out.status == "error"
    assert out.value is None
    assert out.detail


def test_python_testcases_are_moved_out_of_the_value(task_file, workdir):
    """Their contents go as test cases; the value keeps each name with its content's SHA-256,
    which names the file the master writes (its first 16 hex digits, in DB.out/)."""
    out = PythonExecutor(f"{task_file}:emits").run({"data": 1}, None, workdir)
    assert out.status == "ok"
    assert out.value == {"found": 2, "testcases": {
        "a": hashlib.sha256(b"first").hexdigest(), "b": hashlib.sha256(b"second").hexdigest()}}
    assert out.testcases == [("a", b"first"), ("b", b"second")]


@pytest.mark.parametrize("testcases", [5, "out.bin", ["a"], None])
def test_a_testcases_key_of_another_type_says_it_is_reserved(tmp_path, workdir, testcases):
    """`{"testcases": 5, "x": 1}` was committed as an error saying only that it must be a
    dict: the key is reserved, and the detail says how to return such a value."""
    (tmp_path / "reserved.py").write_text(f"def f(task):\n    return {{'testcases': "
                                          f"{testcases!r}, 'x': 1}}\n")
    out = PythonExecutor(f"{tmp_path / 'reserved.py'}:f").run({}, None, workdir)
    assert (out.status, out.detail) == ("error", (
        f"result['testcases'] is reserved for test cases, a dict of name -> bytes, and this "
        f"one is {type(testcases).__name__}: return such a value under another key, or "
        f"nested, e.g. {{\"value\": {{\"testcases\": ...}}}}"))
    nested = tmp_path / "nested.py"
    nested.write_text(f"def f(task):\n    return {{'value': {{'testcases': {testcases!r}, "
                      f"'x': 1}}}}\n")
    out = PythonExecutor(f"{nested}:f").run({}, None, workdir)
    assert (out.status, out.value) == ("ok", {"value": {"testcases": testcases, "x": 1}})


def test_python_bad_specs_name_the_spec(tmp_path, task_file):
    broken = tmp_path / "broken_mod.py"
    broken.write_text("raise ImportError('needs numpy')\n")
    for spec in [
        "no_colon_here",
        ":square",
        f"{task_file}:",
        "surely_no_such_module_xyz:fn",
        f"{tmp_path / 'missing.py'}:fn",
        f"{task_file}:missing",
        f"{task_file}:NOT_CALLABLE",
        f"{broken}:fn",
    ]:
        with pytest.raises(UsageError) as err:
            PythonExecutor(spec)
        assert repr(spec) in str(err.value)


# ------------------------------------------------------------------------------------- demo


def test_demo_is_deterministic(workdir):
    task = {"data": {"n": 27}}
    first = DemoExecutor().run(task, None, workdir)
    second = DemoExecutor(work_ms=2).run(dict(task), None, workdir)
    assert first.status == second.status == "ok"
    assert first.value == second.value
    assert first.value["n"] == 27
    assert first.value["collatz_steps"] == collatz_steps(27) == 111
    assert len(first.value["digest"]) == 64
    json.dumps(first.value, allow_nan=False)
    other = DemoExecutor().run({"data": {"n": 28}}, None, workdir)
    assert other.value["digest"] != first.value["digest"]


def test_demo_from_input_bytes_or_path(tmp_path, workdir):
    seed = tmp_path / "seed"
    seed.write_bytes(b"some input")
    by_path = DemoExecutor().run({"path": str(seed)}, None, workdir)
    by_bytes = DemoExecutor().run({"path": "elsewhere"}, b"some input", workdir)
    assert by_path.status == "ok"
    assert by_path.value == by_bytes.value


@pytest.mark.parametrize("task", [{"data": {"n": -1}}, {"data": {"n": True}},
                                  {"data": {"n": "5"}}, {}])
def test_demo_bad_task_is_an_error_outcome(workdir, task):
    out = DemoExecutor().run(task, None, workdir)
    assert out.status == "error"
    assert out.detail


# ------------------------------------------------------------------------------------ factory


def test_make_executor_kinds(task_file):
    assert isinstance(make_executor("command", argv=["sh", "@@"], timeout_s=5), CommandExecutor)
    assert isinstance(make_executor("python", callable_spec=f"{task_file}:square"), PythonExecutor)
    demo = make_executor("demo", demo_work_ms=1)
    assert isinstance(demo, DemoExecutor)
    assert isinstance(demo, Executor)


@pytest.mark.parametrize(
    "kind, kwargs",
    [
        ("nope", {}),
        ("command", {}),
        ("command", {"argv": ["./t"], "callable_spec": "m:f"}),
        ("command", {"argv": ["./t"], "demo_work_ms": 5}),
        ("python", {}),
        ("python", {"callable_spec": "m:f", "argv": ["./t"]}),
        ("demo", {"argv": ["./t"]}),
        ("demo", {"callable_spec": "m:f"}),
        ("demo", {"demo_work_ms": -1}),
    ],
)
def test_make_executor_rejects_bad_combinations(kind, kwargs):
    with pytest.raises(UsageError):
        make_executor(kind, **kwargs)


def test_command_limits_do_not_read_huge_files_into_memory(tmp_path, workdir):
    # A sparse 1 GiB file: only max_file_bytes + 1 bytes may be read before it is dropped.
    script = textwrap.dedent(
        """
        import os
        path = os.path.join(os.environ["SYMCC_OUTPUT_DIR"], "huge")
        with open(path, "wb") as f:
            f.truncate(1 << 30)
        """
    )
    target = write_script(tmp_path, "huge.py", script)
    out = CommandExecutor([sys.executable, target], timeout_s=30).run({}, b"", workdir)
    assert out.status == "ok"
    assert out.testcases == []
    assert "dropped 1 of 1" in out.detail
    assert os.path.getsize(workdir / "out" / "huge") == 1 << 30


def test_command_output_is_kept_under_the_masters_message_bound(tmp_path, workdir):
    """The output caps used to equal the message bound: a run that filled them sent a RESULT
    the master had to quarantine whole (every test case lost, the task retried for ever)."""
    from coordinator.wire import encode
    from coordinator.worker import Sender
    target = tmp_path / "many.sh"
    target.write_text("#!/bin/sh\nfor i in 1 2 3 4 5 6; do head -c 400000 /dev/zero "
                      "> \"$SYMCC_OUTPUT_DIR/f$i\"; done\n")
    target.chmod(0o755)
    bound = 2 << 20
    ex = make_executor("command", argv=[str(target)], timeout_s=30, max_message_bytes=bound)
    out = ex.run({}, b"x", workdir)
    assert out.status == "ok", out.detail
    assert 0 < len(out.testcases) < 6 and "dropped" in out.detail
    assert len(encode(Sender(None).result_message("0" * 64, out))) <= bound
    with pytest.raises(UsageError, match="leaves no room for test cases"):
        make_executor("command", argv=[str(target)], timeout_s=30, max_message_bytes=4096)


@pytest.mark.parametrize("bound", [64 << 10, 1 << 20, 64 << 20, 1 << 30])
def test_output_limits_keep_a_full_result_under_the_bound(bound):
    """Every file at its name's longest and the detail at its longest: still under."""
    files, per_file, total = output_limits(bound)
    assert files >= 1 and 1 <= per_file <= total
    worst = total + files * (255 + 45) + 2000 * 4 + 1024
    assert worst <= bound


def test_command_program_is_never_substituted(tmp_path, workdir, monkeypatch):
    """The start directory may contain `@@`; only the arguments name the input."""
    odd = tmp_path / "x@@y"
    odd.mkdir()
    (odd / "t").write_text("#!/bin/sh\ncat \"$1\" > \"$SYMCC_OUTPUT_DIR/copy\"\n")
    (odd / "t").chmod(0o755)
    monkeypatch.chdir(odd)
    ex = CommandExecutor(["./t", "@@"], timeout_s=30)
    assert ex.argv[0] == str(odd / "t") and ex.uses_file_arg
    out = ex.run({}, b"seed", workdir)
    assert out.status == "ok", out.detail
    assert out.testcases == [("copy", b"seed")]
    with pytest.raises(UsageError, match="cannot be the program"):
        CommandExecutor(["@@"], timeout_s=30)


def test_a_long_stderr_keeps_how_the_command_ended_and_its_last_lines(tmp_path, workdir):
    """SymCC's stderr easily passes the detail's 2,000 characters: keeping only the tail lost
    the line saying how the command ended, which `coordinator status` shows first."""
    target = write_script(tmp_path, "chatty.py", (
        "import sys\n"
        "for i in range(200):\n"
        "    print(f'chatter line {i:03d} ' + 'x' * 40, file=sys.stderr)\n"
        "sys.exit('target: the real cause')\n"))
    out = CommandExecutor([sys.executable, target], timeout_s=30).run({}, b"", workdir)
    assert out.status == "error" and len(out.detail) <= DETAIL_MAX_CHARS
    first, *_, last = out.detail.splitlines()
    assert (first, last) == ("target exited with status 1", "target: the real cause")
    assert "chatter line 000" not in out.detail  # the middle went
    assert failure_detail({"status": "error", "detail": out.detail}) == out.detail.strip()
    assert detail_summary(out.detail) == "target exited with status 1 … target: the real cause"


def test_a_callable_whose_import_exits_is_a_bad_spec(tmp_path):
    """A script with module-level argparse exits while it is imported: that ended the master
    with a traceback and "internal error" (exit 5) instead of a refused start (exit 2)."""
    script = tmp_path / "cli_script.py"
    script.write_text("import sys\nsys.exit(3)\ndef work(x):\n    return x\n")
    with pytest.raises(UsageError, match=r"cannot import .*SystemExit: 3"):
        make_executor("python", callable_spec=f"{script}:work")


def test_a_file_spec_imports_what_lies_beside_it_from_any_start_directory(tmp_path):
    """A file spec is stored absolute, so a --resume from another directory runs the same
    file; its import of a module beside it failed there (only the start directory was on
    the path), as it does on ranks started with `python -P`."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "helper_beside.py").write_text("def twice(n):\n    return 2 * n\n")
    (lib / "work_beside.py").write_text("from helper_beside import twice\n"
                                        "def f(task):\n    return twice(task['n'])\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = ("import sys; from coordinator.executors import PythonExecutor; "
              f"print(PythonExecutor({str(lib / 'work_beside.py') + ':f'!r})"
              ".run({'n': 21}, None, '.').value)")
    probe = subprocess.run([sys.executable, "-P", "-c", script] if sys.version_info >= (3, 11)
                           else [sys.executable, "-c", "import sys; del sys.path[0]; " + script],
                           cwd=elsewhere, capture_output=True, text=True, timeout=60, check=False)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout == "42\n"


def test_many_test_cases_name_only_those_the_master_keeps(tmp_path, workdir):
    """Each test case's name and digest went into the value: 30,000 of them made it larger
    than a RESULT may carry, an `error` where the master keeps the first MAX_TESTCASES and
    counts the rest as dropped. The value names those it keeps and counts the others."""
    from coordinator.wire import MAX_TESTCASES
    spec = tmp_path / "many.py"
    spec.write_text("def f(task):\n"
                    "    return {'testcases': {f'{i:06d}': b'%d' % i for i in range(30000)}}\n")
    out = PythonExecutor(f"{spec}:f").run({}, None, workdir)
    assert out.status == "ok", out.detail
    assert len(out.value["testcases"]) == MAX_TESTCASES
    assert out.value["testcases_omitted"] == 30000 - MAX_TESTCASES
    assert len(out.testcases) == 30000  # (the master keeps the first MAX_TESTCASES)


def test_a_callable_that_removed_the_working_directory_keeps_its_own_error(tmp_path,
                                                                          workdir):
    """Where it was raised is read relative to the working directory: a callable that
    removed it made that read's FileNotFoundError the task's error in place of its own."""
    spec = tmp_path / "gone.py"
    spec.write_text("import os, tempfile\n"
                    "def f(task):\n"
                    "    d = tempfile.mkdtemp()\n"
                    "    os.chdir(d)\n"
                    "    os.rmdir(d)\n"
                    "    raise ValueError('its own')\n")
    here = os.getcwd()
    try:
        out = PythonExecutor(f"{spec}:f").run({}, None, workdir)
    finally:
        os.chdir(here)
    assert out.status == "error" and out.detail.startswith("ValueError: its own"), out.detail
