"""Processes on this host: `/proc` reads, the commands a worker runs, process-group kills,
and fencing a rank the master gave up on.

No MPI and no store here: the master and the workers both use it (a worker kills its own
commands when it is torn down; the master fences ranks that never answer, which MPI cannot
end: a stopped process is never reported dead).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import NoReturn

from .pauses import LoopGaps

#: How the master ends a worker it gave up on (one that never acknowledged STOP, or every
#: worker before it aborts the job). Not SIGTERM: a batch system or `mpiexec` sends that to
#: every rank when a job is cancelled or out of time, and the workers must then go on through
#: the master's grace period.
TEARDOWN_SIGNAL = signal.SIGUSR2
#: The signals that stop a job: a terminal's Ctrl-C, a batch system's SIGTERM, a hangup
#: (the terminal or the ssh session gone), and SIGUSR1, which Slurm users ask for ahead of a
#: time limit (`--signal=USR1@300`) and whose default action ended every rank at once. The
#: master's start of a graceful stop; a worker goes on, and notes them (`worker.cut_short`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

#: How far a process's start time read from /proc (whole-second boot time, clock ticks) may
#: lie past the wall-clock time of something the process did.
CLOCK_SLACK_S = 2.0


def host_and_pid() -> tuple[str, int]:
    return socket.gethostname(), os.getpid()


#: `os._exit` as it was when this module was imported. A task's callable runs with
#: `os._exit` replaced (`executors.PythonExecutor` makes its call the task's failure), and a
#: teardown signal handled during that call must still end the process.
real_exit: Callable[[int], NoReturn] = os._exit


PR_SET_PDEATHSIG = 1
# Resolved here, in the parent: the child of a fork in a process with threads (a worker's MPI
# threads) must not load a library (the loader's lock may be held by a thread that is gone).
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # (not Linux)
    _prctl = None


def parent_death_signal(sig: int) -> None:
    """In a child between its fork and its exec: `sig` when its parent ends (Linux)."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def die_with_parent() -> None:
    """In a command's child process, before its exec: SIGKILL when the worker that started it
    ends. A worker ended by SIGKILL (three Ctrl-C, a killed launcher, mpiexec ending the job)
    cannot end its command, which runs in a session of its own: it was left running, a hung
    target for ever, with nothing to enforce --timeout. (A process the command starts itself
    is not covered.)"""
    parent_death_signal(signal.SIGKILL)


def exit_now(status: int) -> NoReturn:
    """Leave at once, without MPI_Finalize (under ULFM it can hang every survivor after a
    rank's death, ompi#11404) and without the interpreter's exit handlers."""
    sys.stdout.flush()
    sys.stderr.flush()
    real_exit(status)


def leave_if_threads_linger(status: int) -> None:
    """After MPI_Finalize: if a thread that is not a daemon still runs (one a task's callable
    left), leave now with `status` rather than wait for it at the interpreter's exit, which
    held a run's end for as long as the thread ran (for ever, for one that never ends).
    Through C's exit(), not os._exit: MPICH's launcher SIGKILLed the job (exit 9, 3 runs of
    4) when a rank skipped the C exit handlers after MPI_Finalize. Returns otherwise."""
    main = threading.main_thread()
    if not any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # PyDLL: the call keeps the GIL, so the lingering threads stay frozen while the C exit
    # handlers run (through CDLL one wrote hundreds of times after exit() began).
    ctypes.PyDLL(None).exit(status)


# -- /proc ------------------------------------------------------------------------------------

def proc_stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (the state first, so field N of
    proc(5) is at N - 3); None if the process is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    return stat[stat.rfind(b")") + 2:].split()


#: Where `proc_stat` puts a process's start time (proc(5) field 22, in clock ticks since boot).
_STARTTIME = 22 - 3


def proc_stats() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, `proc_stat(pid)`) for every process on this host; nothing without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        fields = proc_stat(int(entry)) if entry.isdigit() else None
        if fields is not None:  # (None: gone meanwhile)
            yield int(entry), fields


def process_started_at(pid: int) -> float | None:
    """When the process on this host started (wall clock, to CLOCK_SLACK_S); None if it is
    gone or there is no /proc."""
    fields = proc_stat(pid)
    try:
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, StopIteration, ValueError):
        return None
    if fields is None:
        return None
    return boot + int(fields[_STARTTIME]) / os.sysconf("SC_CLK_TCK")


def describe_process(pid: int) -> str:
    """`pid N (its command line)`, as far as /proc tells, for a line an operator reads."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return f"pid {pid}"
    shown = " ".join(a.decode(errors="replace") for a in argv)
    return f"pid {pid} ({shown[:120]}{'...' if len(shown) > 120 else ''})"


def process_exists(pid: int) -> bool:
    """On this host; a process we may not signal exists all the same."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the commands a worker runs ------------------------------------------------------------------

def kill_command(pgid: int) -> None:
    """SIGKILL a command's whole process group (its id is the command's)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # group already empty


#: The variable each command is started with (its worker's pid and run number): its
#: processes, and those they start, carry it, even those that leave its process group (a
#: daemon's `setsid`).
COMMAND_MARK = "COORDINATOR_COMMAND"


def kill_marked(mark: str, since_ticks: int = 0) -> int:
    """SIGKILL every process on this host whose environment carries `COMMAND_MARK=mark` and
    that started at or after `since_ticks` (/proc's clock ticks since boot; older ones are
    not read): what a command left running outside its process group. A process that
    cleared its environment is not found. Returns how many were signalled."""
    needle = f"{COMMAND_MARK}={mark}".encode()
    killed = 0
    for _ in range(3):  # (one that forked between the look and the kill: the next look)
        found = 0
        for pid, fields in proc_stats():
            if pid == os.getpid() or int(fields[_STARTTIME]) < since_ticks:
                continue
            with _pinned(pid) as pin:
                if pin is None:
                    continue  # gone
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = f.read()
                except OSError:
                    continue
                if needle in env.split(b"\0"):
                    found += 1
                    killed += _kill_pinned(pid, pin)
        if not found:
            break
    return killed


@contextlib.contextmanager
def _pinned(pid: int) -> Iterator[int | None]:
    """A pidfd of `pid`, opened before its environment is read: the signal then reaches that
    process or, if it has ended since, none, never another that got its number in between
    (-1 where the kernel has no pidfd: the number alone, as before Linux 5.3)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        yield None
        return
    except (AttributeError, OSError):
        yield -1
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _kill_pinned(pid: int, pin: int) -> int:
    try:
        if pin >= 0:
            signal.pidfd_send_signal(pin, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return 1
    except OSError:
        return 0


def started_ticks(pid: int) -> int:
    """When process `pid` started, in /proc's clock ticks since boot (0 if unknown)."""
    fields = proc_stat(pid)
    return int(fields[_STARTTIME]) if fields is not None else 0


class RunningCommands:
    """The process groups of the commands this process runs now (their leaders unreaped, so
    each id is still theirs), each with its mark and start (`kill_marked`): what a worker
    torn down by a signal must not leave behind."""

    def __init__(self) -> None:
        self.groups: set[int] = set()
        self.marks: dict[int, tuple[str, int]] = {}
        self.spawning = False  # a command is being started: its group is not known yet
        self.deferred: list[Callable[[], None]] = []

    def spawned(self, pgid: int | None) -> None:
        """The command being started has its group (None: it did not start)."""
        if pgid is not None:
            self.groups.add(pgid)
        self.spawning = False
        if self.deferred:
            self.deferred.pop()()


#: This process's commands (a worker runs one at a time; the registry is what its teardown
#: signal handler reads).
running_commands = RunningCommands()


def kill_running_commands() -> None:
    """Kill every command this process runs, whole groups. A target runs in a session of its
    own, so nothing else ends it when its worker goes: it would outlive the job."""
    for pgid in list(running_commands.groups):
        kill_command(pgid)
        mark = running_commands.marks.get(pgid)
        if mark is not None:
            kill_marked(*mark)


def teardown_when_safe(teardown: Callable[[], None]) -> None:
    """From a signal handler: run `teardown` now, or, if a command is being started, as soon
    as its process group is registered (else it would escape `kill_running_commands`)."""
    if running_commands.spawning:
        running_commands.deferred.append(teardown)
    else:
        teardown()


def commands_run_by(parents: Collection[int]) -> list[int]:
    """The commands that the given processes on this host run now: their children that lead
    a session of their own (the command executor starts each command so), found in /proc;
    [] where there is none. Each one's id is also its process group's.

    For the master, which must end them itself when it ends their workers: a worker's own
    teardown handler runs only once the worker is scheduled again, and a launcher that sees
    another rank end first may SIGKILL it before then (MPICH's does, at once), leaving its
    command running for as long as the command lasts."""
    parents = set(parents)
    return sorted(pid for pid, fields in proc_stats()  # (fields: state, ppid, pgrp, session)
                  if int(fields[1]) in parents and int(fields[3]) == pid)


def wait_exit_unreaped(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait until the child exits *without reaping it*; True if it exited in time.

    While the leader is an unreaped zombie its pid (= the process-group id) cannot be reused,
    so a following killpg() can only hit the target's own leftovers, never an unrelated group.

    Waited in slices of WAIT_SLICE_S: a wake that comes a pause later than asked (the worker
    stopped with its command: `coordinator.pauses`) moves the deadline on by the pause, so a
    job stopped and continued does not time out every command it was running. A command
    stopped or hung alone gets its --timeout: the worker's waits come back on time.
    """
    gaps = LoopGaps()
    deadline = gaps.last + timeout_s
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:  # kernel older than 5.3: fall back to polling
            pass
    poller = None
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
    delay = 0.001
    try:
        while True:
            if poller is not None:
                if poller.poll(0):
                    return True
            else:
                try:
                    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
                except ChildProcessError:
                    return True
                if info is not None:
                    return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if poller is not None:
                wait = min(remaining, WAIT_SLICE_S)
                exited = bool(poller.poll(max(1, math.ceil(wait * 1000))))
            else:
                wait = min(delay, remaining)
                time.sleep(wait)
                delay = min(delay * 2, 0.05)
                exited = False
            deadline += gaps.tick(wait)
            if exited:
                return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


#: How long one wait for a command lasts at most before its deadline is looked at again.
WAIT_SLICE_S = 0.25


# -- fencing ------------------------------------------------------------------------------------

#: Where an MPI launcher puts a process's rank, and the name of its job (Open MPI / PMIx;
#: MPICH's Hydra sets no job name: `_job_of`). A process is a rank of this job only if it has
#: the master's job and the rank, as its launcher set them.
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
#: The prefixes of every variable an MPI launcher gives its ranks (Open MPI, PRRTE and PMIx;
#: MPICH's Hydra and PMI): what makes a process a member of the job.
MPI_JOB_VARIABLES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "HYDI_", "MPI_LOCALRANKID",
                     "MPI_LOCALNRANKS")
JOB_VARS = ("PMIX_NAMESPACE", "PMI_KVSNAME", "PMI_JOBID", "OMPI_MCA_ess_base_jobid")


def environment_of(pid: int) -> dict[str, str] | None:
    """The environment process `pid` started with (/proc/PID/environ); None if it cannot be
    read (gone, or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _launcher_of(pid: int, rank_var: str) -> int | None:
    """The nearest ancestor of `pid` that carries no rank: the launcher's process on this host
    (MPICH Hydra's proxy), whatever wrappers the rank was started under; None if it cannot be
    told."""
    for _ in range(64):
        fields = proc_stat(pid)
        if fields is None:
            return None
        pid = int(fields[1])
        env = environment_of(pid) if pid > 1 else None
        if env is None:
            return None
        if rank_var not in env:
            return pid
    return None


def _job_of(pid: int, env: Mapping[str, str], rank_var: str) -> dict[str, str]:
    """What names the job of process `pid` (with environment `env`): its launcher's job
    variables; where the launcher sets none (MPICH's Hydra), the launcher's process on this
    host, which one job's ranks here share and no other job's do."""
    job = {v: env[v] for v in JOB_VARS if v in env}
    if not job:
        launcher = _launcher_of(pid, rank_var)
        if launcher is not None:
            job["launcher pid"] = str(launcher)
    return job


def _job() -> tuple[dict[str, str], str | None]:
    """This process's job (`_job_of`) and the variable of its rank."""
    rank_var = next((v for v in RANK_VARS if v in os.environ), None)
    if rank_var is None:
        return {}, None
    return _job_of(os.getpid(), os.environ, rank_var), rank_var


def find_rank_process(rank: int) -> int | None:
    """The process of `rank` of this job on this host, found by its launcher's variables (the
    first of those that have them: the commands a rank runs inherit its environment); None if
    there is none here, or it cannot be told."""
    ours, rank_var = _job()
    if not ours or rank_var is None:
        return None
    parents = {}
    for pid, fields in proc_stats():
        env = environment_of(pid) if pid != os.getpid() else None
        if env and env.get(rank_var) == str(rank) and _job_of(pid, env, rank_var) == ours:
            parents[pid] = int(fields[1])
    roots = [pid for pid, ppid in parents.items() if ppid not in parents]
    return roots[0] if len(roots) == 1 else None


def not_our_rank(pid: int, rank: int) -> str | None:
    """Why process `pid` cannot be taken for rank `rank` of this job (None: it is that rank).
    A rank reports its pid in its READY; a rank that lies (or a bug) would otherwise have the
    master stop and kill whatever process it named."""
    ours, rank_var = _job()
    if not ours or rank_var is None:
        return "this master's launcher gave it no job name to check the process against"
    theirs = environment_of(pid)
    if theirs is None:
        return f"process {pid}'s environment cannot be read"
    if _job_of(pid, theirs, rank_var) != ours:
        return f"process {pid} is not a process of this job"
    if theirs.get(rank_var) != str(rank):
        return f"process {pid} is not rank {rank} of this job"
    return None


def fence(ranks: Collection[int], where: Mapping[int, tuple[str, int, float]],
          term_wait_s: float = 1.0,
          refused: Callable[[int, int, str], None] = lambda rank, pid, why: None) -> list[int]:
    """End the given ranks' processes if they run on this host; the only way to end a rank
    that is hung (stopped) and so never answers MPI. `where`: rank -> (host, pid, when last
    heard) as each rank reported it. Returns the ranks fenced. A reported pid that is not
    that rank's process in this job (`not_our_rank`) is left alone, and `refused(rank, pid,
    why)` told; the rank's own process is then looked for by its launcher's variables.

    The commands they run are killed first, each with its process group; then
    TEARDOWN_SIGNAL (with SIGCONT, for a stopped rank), on which a worker also kills any
    command it was just starting; SIGKILL after `term_wait_s` for the rest."""
    here = socket.gethostname()
    pids = {}
    for rank in ranks:
        host, pid, seen = where.get(rank, (None, None, None))
        if host is not None and host != here:
            # Another host's, as it said: not for this master to end, unless the rank's own
            # process is here all the same (a rank may say any host).
            found = find_rank_process(rank)
            if found is None:
                continue
            refused(rank, pid, f"it said it runs on {host!r:.60}; its own process, pid "
                               f"{found}, runs on this host and is fenced instead")
            pids[rank] = found
            continue
        # A process that started after the rank's last READY has taken a dead rank's pid.
        why = ("it reported no pid" if pid is None else
               "that pid is this master's" if pid == os.getpid() else
               f"process {pid} started after that" if
               (process_started_at(pid) or math.inf) > seen + CLOCK_SLACK_S else
               not_our_rank(pid, rank))
        if why is not None:
            # The rank's own process, whatever it said (or a rank that never said).
            found = find_rank_process(rank)
            refused(rank, pid, why + (f"; its own process is pid {found}" if found else ""))
            if found is None:
                continue
            pid = found
        pids[rank] = pid
    # Stopped first, so that none of them can reap a command (and free its id for reuse)
    # between the search for their commands and the kill.
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    for command in commands_run_by(pids.values()):
        kill_command(command)
    for sig in (TEARDOWN_SIGNAL, signal.SIGCONT):
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    deadline = time.monotonic() + term_wait_s
    while any(process_exists(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in pids.values():
        if process_exists(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return sorted(pids)
