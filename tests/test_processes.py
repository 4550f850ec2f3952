"""Process helpers (coordinator/processes.py) on real processes: the teardown of a worker's
running commands, and fencing a rank (`Master.fence`, which reads where each rank runs from
the campaign file) that kills its commands and never another process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest
from fakes import InstantWorkers
from processes import running

from coordinator.executors import CommandExecutor
from coordinator.master import Master, MasterConfig
from coordinator.processes import JOB_VARS, RANK_VARS, commands_run_by
from store.campaign import Store
from store.workers import accept_versions


def test_a_teardown_signalled_while_the_command_starts_still_kills_it(workdir, monkeypatch):
    """The worker's teardown handler can run while Popen waits for the exec, before the new
    group is registered: it must then run once the group is known, or the command would
    escape it. Here the 'signal' arrives inside Popen; the teardown kills what is running."""
    from coordinator import executors, processes
    real_popen = subprocess.Popen
    seen: list[list[int]] = []

    def teardown() -> None:
        seen.append(sorted(processes.running_commands.groups))
        processes.kill_running_commands()

    def popen(*args, **kwargs):
        processes.teardown_when_safe(teardown)  # as the handler would, mid-spawn
        assert seen == []  # deferred: the group is not known yet
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(executors.subprocess, "Popen", popen)
    out = CommandExecutor(["sleep", "30"], timeout_s=60).run({}, b"", workdir)
    assert len(seen) == 1 and len(seen[0]) == 1  # ran once, with the new group registered
    assert (out.status, out.returncode) == ("error", -9), out.detail  # killed, not waited for
    assert processes.running_commands.groups == set() and not processes.running_commands.spawning


# -- fencing a rank: its commands, and only its own process -----------------------------------

# A worker whose teardown handler never runs (as when the launcher SIGKILLs it first), running
# a command in a session of its own, which has a child of its own. It prints the command's pid,
# the command's child's, and that of a plain child of its own, which is no command.
UNHANDLED_TEARDOWN_WORKER = textwrap.dedent("""\
    import signal, subprocess, sys, time
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    command = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         f"c = subprocess.Popen({sleep!r}); print(c.pid, flush=True); time.sleep(600)"],
        start_new_session=True, stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen(sleep)
    print(command.pid, command.stdout.readline().strip(), plain.pid, flush=True)
    time.sleep(600)
    """)


#: The launcher's variables a rank of this (pretend) job carries: the master fences only a
#: process that has them (`processes.not_our_rank`).
JOB = {"PMIX_NAMESPACE": "test-job@1"}


@pytest.fixture
def as_rank_0_of_a_job(monkeypatch):
    """The test process as a job's master: its launcher's job name and rank 0."""
    for var, value in {**JOB, "OMPI_COMM_WORLD_RANK": "0"}.items():
        monkeypatch.setenv(var, value)


@contextlib.contextmanager
def unhandled_teardown_worker(rank: int = 1, job: dict[str, str] = JOB):
    """UNHANDLED_TEARDOWN_WORKER running as `rank` of `job`: (its Popen, the pids it
    printed); all of them killed afterwards, whatever the test did."""
    env = {k: v for k, v in os.environ.items() if k not in (*JOB_VARS, *RANK_VARS)}
    if job:  # (no job: a process no launcher started)
        env.update({**job, "OMPI_COMM_WORLD_RANK": str(rank)})
    worker = subprocess.Popen([sys.executable, "-c", UNHANDLED_TEARDOWN_WORKER],
                              stdout=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        pids = [int(p) for p in worker.stdout.readline().split()]
        yield worker, pids
    finally:
        worker.kill()
        worker.wait()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_fencing_a_rank_kills_its_command_even_if_the_rank_never_handles_its_teardown(
        tmp_path, as_rank_0_of_a_job):
    """A worker's teardown handler kills its command; under load MPICH's launcher SIGKILLs
    the other ranks as soon as one of them leaves, before they ran theirs, and their commands
    ran on after the job (one CI run in a few). The master kills the commands itself."""
    with (contextlib.closing(Store.open(tmp_path / "c.db")) as store,
          unhandled_teardown_worker() as (worker, pids)):
        command, its_child, plain_child = pids
        assert commands_run_by([worker.pid]) == [command]
        with store.transaction("test") as tx:
            accept_versions(tx, 1, 0, "", host=socket.gethostname(), pid=worker.pid)
        master = Master(store, InstantWorkers(), MasterConfig(stats_file=None))
        assert master.fence([1], term_wait_s=0.2) == [1]
        assert worker.wait(timeout=10) == -signal.SIGKILL  # it ignored the teardown signal
        deadline = time.monotonic() + 10
        while (running(command) or running(its_child)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(command) and not running(its_child)
        # Only the command's group: the worker's other children are the launcher's business.
        assert running(plain_child)


@pytest.mark.timeout(60)
def test_a_pid_not_reported_in_this_incarnation_or_taken_over_is_left_alone(
        tmp_path, as_rank_0_of_a_job):
    """Only a rank's own process is fenced: not the pid an earlier incarnation's READY
    reported (a resumed master's ranks are new processes), nor a process that started after
    the rank's last READY (the rank died and its pid went to another process). Either could
    be anything: a shell server, whose shells the master would kill as 'commands'. Here that
    process is no rank of the job: it is left alone however recent its pid's report."""
    with (contextlib.closing(Store.open(tmp_path / "c.db")) as store,
          unhandled_teardown_worker(rank=2, job={}) as (other, pids)):
        with store.transaction("test") as tx:
            for rank in (1, 2):
                accept_versions(tx, rank, 0, "", host=socket.gethostname(), pid=other.pid)
        with sqlite3.connect(tmp_path / "c.db") as db:
            db.execute("UPDATE workers SET state = 'unknown' WHERE rank = 1")
            db.execute("UPDATE workers SET last_seen = last_seen - 60 WHERE rank = 2")
        master = Master(store, InstantWorkers(), MasterConfig(stats_file=None))
        assert master.fence([1, 2], term_wait_s=0.2) == []
        with sqlite3.connect(tmp_path / "c.db") as db:  # reported in time, but no rank
            db.execute("UPDATE workers SET last_seen = last_seen + 60 WHERE rank = 2")
        assert master.fence([1, 2], term_wait_s=0.2) == []
        time.sleep(0.3)
        assert other.poll() is None and all(map(running, pids))


@pytest.mark.timeout(60)
def test_a_ranks_own_process_is_fenced_whatever_pid_it_reported(tmp_path,
                                                                as_rank_0_of_a_job):
    """The rank's own process is found by its launcher's variables when what it reported is
    not it (a pid of another process, a pid reported before it was restarted)."""
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with (contextlib.closing(Store.open(tmp_path / "c.db")) as store,
              unhandled_teardown_worker(rank=2) as (worker, pids)):
            with store.transaction("test") as tx:
                accept_versions(tx, 2, 0, "", host=socket.gethostname(), pid=decoy.pid)
            master = Master(store, InstantWorkers(), MasterConfig(stats_file=None))
            assert master.fence([2], term_wait_s=0.2) == [2]
            assert worker.wait(timeout=10) == -signal.SIGKILL
            assert decoy.poll() is None
    finally:
        decoy.kill()
        decoy.wait()


@pytest.mark.timeout(60)
def test_a_rank_on_this_host_that_names_another_is_fenced_all_the_same(tmp_path, capsys,
                                                                       as_rank_0_of_a_job):
    """A rank may say any host: one here that named another host (and ignored its STOP) was
    never ended, and under ULFM the job waited on it."""
    with (contextlib.closing(Store.open(tmp_path / "c.db")) as store,
          unhandled_teardown_worker(rank=2) as (worker, _)):
        with store.transaction("test") as tx:
            accept_versions(tx, 2, 0, "", host="elsewhere.example", pid=worker.pid)
        master = Master(store, InstantWorkers(), MasterConfig(stats_file=None))
        assert master.fence([2], term_wait_s=0.2) == [2]
        assert worker.wait(timeout=10) == -signal.SIGKILL
        assert f"its own process, pid {worker.pid}, runs on this host and is fenced instead" \
            in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("who", ["another job's rank 1", "this job's rank 2", "no rank"])
def test_a_pid_that_is_not_the_ranks_own_process_is_never_fenced(tmp_path, capsys,
                                                                 as_rank_0_of_a_job, who):
    """A rank reported another process's pid in its READY and ignored STOP: the fence
    stopped and killed that process. Only a process of this job holding that rank is fenced;
    anything else is left alone, and the master says why."""
    rank, job = {"another job's rank 1": (1, {"PMIX_NAMESPACE": "other-job@1"}),
                 "this job's rank 2": (2, JOB), "no rank": (1, {})}[who]
    with (contextlib.closing(Store.open(tmp_path / "c.db")) as store,
          unhandled_teardown_worker(rank, job) as (other, pids)):
        with store.transaction("test") as tx:
            accept_versions(tx, 1, 0, "", host=socket.gethostname(), pid=other.pid)
        master = Master(store, InstantWorkers(), MasterConfig(stats_file=None))
        try:
            assert master.fence([1], term_wait_s=0.2) == []
            time.sleep(0.3)
            assert other.poll() is None
        finally:
            other.kill()
            other.wait()
    assert f"rank 1 reported pid {other.pid}, which is not fenced" in capsys.readouterr().err


# MPICH's Hydra starts a host's ranks from one proxy process and sets no job variable: only
# PMI_RANK (and PMI_SIZE, PMI_FD...). This proxy does the same with the commands it is given,
# one rank each, and passes its stdout on.
HYDRA_LIKE_PROXY = textwrap.dedent("""\
    import json, subprocess, sys
    procs = [subprocess.Popen(argv, env={**json.loads(sys.argv[1]), "PMI_RANK": str(rank)})
             for rank, argv in enumerate(json.loads(sys.argv[2]))]
    for p in procs:
        p.wait()
    """)

# Each rank's line goes out in one write (atomic on a pipe): two ranks of one proxy share its
# stdout, and `print` writes the text and its newline apart, so two pids could run together.
SLEEPING_RANK = textwrap.dedent("""\
    import os, time
    os.write(1, f"{os.getpid()}\\n".encode())
    time.sleep(600)
    """)

# Rank 0 of the proxy's job: what the master's fence would make of its own rank 1, of the
# other job's rank 1 (whose pid it is given) and of its rank 1 taken for rank 2.
CHECKING_RANK = textwrap.dedent("""\
    import json, os, sys, time
    from coordinator.processes import find_rank_process, not_our_rank
    deadline = time.monotonic() + 20
    while (found := find_rank_process(1)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    other = int(sys.argv[1])
    os.write(1, (json.dumps({"found": found, "own": not_our_rank(found, 1),
                             "as rank 2": not_our_rank(found, 2),
                             "other": not_our_rank(other, 1)}) + "\\n").encode())
    """)


@pytest.mark.timeout(60)
def test_ranks_of_a_launcher_that_sets_no_job_variable_are_told_by_its_proxy():
    """Under MPICH the fence refused every rank ('no job name to check the process against'),
    and a stop past --stop-wait left every busy rank's command running. A rank's job is then
    the nearest ancestor without a rank variable: the proxy its host's ranks share, whatever
    wrapper (here `sh -c`) a rank was started under."""
    import json
    env = {k: v for k, v in os.environ.items() if k not in (*JOB_VARS, *RANK_VARS)}
    sleeping = [sys.executable, "-c", SLEEPING_RANK]
    wrapped = ["sh", "-c", f"{sys.executable} -c '{SLEEPING_RANK}'; true"]
    procs = []
    try:
        other_job = subprocess.Popen(
            [sys.executable, "-c", HYDRA_LIKE_PROXY, json.dumps(env),
             json.dumps([sleeping, sleeping])], stdout=subprocess.PIPE, text=True,
            start_new_session=True)
        procs.append(other_job)
        other_pid = int(other_job.stdout.readline())
        this_job = subprocess.Popen(
            [sys.executable, "-c", HYDRA_LIKE_PROXY, json.dumps(env),
             json.dumps([[sys.executable, "-c", CHECKING_RANK, str(other_pid)], wrapped])],
            stdout=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(this_job)
        lines = [this_job.stdout.readline(), this_job.stdout.readline()]  # in either order
        seen = json.loads(next(line for line in lines if line.startswith("{")))
        own_pid = int(next(line for line in lines if not line.startswith("{")))
    finally:
        for proc in procs:  # each proxy's session: its ranks and what they started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert seen["found"] is not None and seen["found"] != own_pid  # the `sh` around it
    assert seen["own"] is None, seen
    assert seen["as rank 2"] == f"process {seen['found']} is not rank 2 of this job"
    assert seen["other"] == f"process {other_pid} is not a process of this job"
