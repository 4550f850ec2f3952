"""Running real `mpiexec` jobs from tests, each with a wall-clock bound.

The mpiexec is the one installed beside this Python (the Open MPI wheel by default, MPICH in
the second CI environment), so the same tests exercise whichever MPI the venv holds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from processes import in_session

from coordinator.launcher import LAUNCHER_FAILED, find_mpiexec, mpiexec_flags
from coordinator.processes import proc_stat
from store.audit import AuditReport, audit_path
from store.schema import Channel

MPIEXEC = find_mpiexec()
JOB_TIMEOUT_S = 120


@functools.lru_cache(maxsize=1)
def mpi_kind() -> str:
    out = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True,
                         timeout=60).stdout
    return "openmpi" if "Open MPI" in out else "mpich" if "HYDRA" in out else "other"


def job_command(args: list[str], np: int = 4, ulfm: bool | None = None) -> list[str]:
    """`ulfm=None`: what `coordinator run` does when it launches itself (ULFM under Open MPI)."""
    if ulfm is None:
        ulfm = mpi_kind() == "openmpi"
    flags = mpiexec_flags(MPIEXEC, np, ulfm=ulfm)
    return [MPIEXEC, *flags, sys.executable, "-m", "coordinator", *args]


def split_job_command(args: list[str], master_wrap: list[str], worker_wrap: list[str],
                      workers: int = 3) -> list[str]:
    """One job whose master and workers start under different wrappers (e.g. `env PATH=...`):
    what ranks on other nodes of a cluster look like."""
    flags = mpiexec_flags(MPIEXEC, 1, ulfm=mpi_kind() == "openmpi")
    glob = [f for f in flags if f not in ("-n", "1")]
    rank = [sys.executable, "-m", "coordinator", *args]
    return [MPIEXEC, *glob, "-n", "1", *master_wrap, *rank, ":", "-n", str(workers),
            *worker_wrap, *rank]


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def start(args: list[str], np: int = 4, ulfm: bool | None = None, cwd: Path | None = None,
          env: dict[str, str] | None = None, command: list[str] | None = None,
          ) -> Job:
    """`command`: a whole launch line of its own (`split_job_command`) instead of `args`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    job = Job(command or job_command(args, np, ulfm), stdout=subprocess.PIPE,
              stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True)
    _started.append(job)
    return job


class Job:
    """A started job, with `subprocess.Popen`'s interface. Open MPI's launcher sometimes
    fails before any rank ran (LAUNCHER_FAILED); `master_pid` and `wait_for` then launch it
    once more, and the test goes on with the new job."""

    def __init__(self, argv: list[str], **popen_kw) -> None:
        self._argv, self._popen_kw = argv, popen_kw
        self.proc = subprocess.Popen(argv, **popen_kw)
        self.relaunched = 0

    def __getattr__(self, name: str):
        return getattr(self.proc, name)

    def relaunch(self) -> None:
        self.relaunched += 1
        self.proc = subprocess.Popen(self._argv, **self._popen_kw)


#: Every job started by the current test: a job runs in its own session, so a test that
#: fails (or hits its pytest-timeout) before `finish` would otherwise leave it running.
_started: list[Job] = []


def kill_leftover_jobs() -> None:
    """Called after every test (conftest): SIGKILL whatever job the test left running."""
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            kill_job(proc)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def finish(proc: Job | subprocess.Popen, timeout: float = JOB_TIMEOUT_S) -> Done:
    """The job's end; a `Job` whose launcher failed before any rank ran (LAUNCHER_FAILED)
    is launched once more and that launch's end returned. (A job whose stderr goes to a file
    has none here: its test reads the file, and retries itself.)"""
    for launch in (1, 2):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(proc)
            out, err = proc.communicate()
            raise AssertionError(f"job did not finish in {timeout} s (killed)\n--- stdout\n"
                                 f"{out}\n--- stderr\n{err[-4000:]}") from None
        if launch == 1 and isinstance(proc, Job) and LAUNCHER_FAILED in (err or ""):
            proc.relaunch()  # nothing ran
            continue
        break
    return Done(proc.returncode, out, err)


def run(args: list[str], np: int = 4, timeout: float = JOB_TIMEOUT_S, **kw) -> Done:
    return finish(start(args, np, **kw), timeout)


def kill_job(proc: Job | subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """The whole job: mpiexec's process group, and the ranks, which Open MPI puts in groups
    of their own in mpiexec's session (they would end only once they noticed mpiexec gone)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    for pid in in_session(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def ranks_of(db: Path) -> list[int]:
    """PIDs of the ranks started for the campaign at `db` (scanning /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # ranks only: the launcher's own command line names the db too
        if (cmd and os.path.basename(cmd[0]).startswith(b"python") and b"coordinator" in cmd
                and str(db).encode() in cmd and (fields := proc_stat(int(entry.name)))):
            parents[int(entry.name)] = int(fields[1])
    # Nor a worker's command between its fork and its exec, which still has the worker's
    # command line: a SIGTERM meant for the ranks would kill it.
    return [pid for pid, parent in parents.items() if parent not in parents]


def children_of(parents: list[int]) -> list[int]:
    """PIDs of the processes whose parent is one of `parents` (a worker's commands: their own
    sessions keep them out of the job's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) \
                and int(fields[1]) in parents:
            found.append(int(entry.name))
    return found


def kill_ranks(db: Path, timeout: float = 30) -> None:
    """SIGKILL every rank of the job for `db`, and wait until none runs: a kill is delivered
    when the process next runs, so a master on the other core could still commit a round
    after `os.kill` returned (a test that counts rows at once then sees them change)."""
    for pid in ranks_of(db):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while left := ranks_of(db):
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks of {db} still running {timeout} s after SIGKILL")
        for pid in left:  # e.g. a rank's fork that was not one, orphaned by the kill
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def master_pid(db: Path, timeout: float = 60) -> int:
    """The master's pid, as it recorded it in the campaign's latest `campaign` event."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as c:
                row = c.execute("SELECT detail FROM events WHERE kind='campaign' "
                                "ORDER BY id DESC LIMIT 1").fetchone()
            if row and "pid=" in row[0]:
                return int(row[0].split("pid=")[1].split()[0])
        except sqlite3.Error:
            pass
        _unless_the_job_ended(f"no master pid recorded in {db}")
        time.sleep(0.05)
    _unless_the_job_ended(f"no master pid recorded in {db} in {timeout} s", end_it=True)
    raise AssertionError("not reached")


def wait_for(db: Path, sql: str, predicate, timeout: float = 60) -> object:
    """Poll `sql`'s first value until `predicate` holds. If the test's latest job ends first,
    the file will not change any more: fail at once, with the job's output, unless its
    launcher failed before any rank ran (LAUNCHER_FAILED): then it is launched once more."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        job = _started[-1] if _started else None
        ended = job is not None and job.poll() is not None
        value, holds = _value_if(db, sql, predicate)
        if holds:
            return value
        if ended:  # (checked before the read: that read saw all the job wrote)
            _unless_the_job_ended(f"{sql!r} never satisfied the condition (last value "
                                  f"{value!r})")
        time.sleep(0.05)
    _unless_the_job_ended(f"{sql!r} never satisfied the condition (last value {value!r})",
                          end_it=True)
    raise AssertionError("not reached")


def wait_for_path(path: Path, timeout: float = 60) -> None:
    """Wait until the test's latest job writes `path` (e.g. its --master-pid-file), handling
    that job as `wait_for` does: if it ends first, fail at once with its output, unless its
    launcher failed before any rank ran (LAUNCHER_FAILED): then it is launched once more."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        job = _started[-1] if _started else None
        if job is not None and job.poll() is not None and not path.exists():
            _unless_the_job_ended(f"{path} never appeared")
        if time.monotonic() > deadline:
            fail_with_the_job(f"{path} never appeared in {timeout} s")
        time.sleep(0.02)


def fail_with_the_job(what: str) -> NoReturn:
    """Fail with `what` and the output of the test's latest job (ended first if it runs)."""
    _unless_the_job_ended(what, end_it=True)
    raise AssertionError(what)


def _value_if(db: Path, sql: str, predicate) -> tuple[object, bool]:
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True,
                                                timeout=5)) as c:
            row = c.execute(sql).fetchone()
    except sqlite3.Error:
        return None, False
    value = row[0] if row else None  # no row yet: keep polling
    return value, bool(predicate(value))


def _unless_the_job_ended(what: str, end_it: bool = False) -> None:
    """Fail with `what` and the output of the test's latest job (the one waited on: tests
    wait on the job they started last) if that job has ended (or, with `end_it`, once it is
    ended): what a test waiting on its database cannot see. A job whose output the test
    collected already is not the one waited on (a self-launch, say, after it)."""
    proc = _started[-1] if _started else None
    if proc is None or proc.stdout is None or proc.stdout.closed:  # none, or collected
        if end_it:
            raise AssertionError(what)
        return
    if proc.poll() is None:
        if not end_it:
            return
        kill_job(proc)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        out = err = "(not available)"
    if not end_it and LAUNCHER_FAILED in (err or "") and proc.relaunched < 2:
        proc.relaunch()  # nothing ran
        return
    raise AssertionError(f"{what}; the job ended with status {proc.returncode}\n--- stdout\n"
                         f"{(out or '')[-2000:]}\n--- stderr\n{(err or '')[-4000:]}")


def output_files(directory: Path) -> list[Path]:
    """The test cases in an output directory: its dot files are the master's own (its lock,
    `coordinator/output_lock.py`, and its writes in progress)."""
    return [p for p in directory.iterdir() if not p.name.startswith(".")]


def query(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return c.execute(sql).fetchall()


def status_json(db: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "coordinator", "status", "--db", str(db),
                          "--json"], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def quarantined(**by_channel: dict[str, int]) -> dict[str, dict[str, int]]:
    """What `status --json` reports under "quarantine": every channel, empty unless named."""
    return {c.value: by_channel.get(c.value, {}) for c in Channel}


def check_conservation(db: Path, expected_tasks: int | None = None) -> AuditReport:
    """What every run must leave: a file the store's audit finds consistent at this code's
    revision (every rule run: integrity, each done task's one result from a token it was
    dispatched with and never retired, one record per dispatch, ...), and nothing in flight.
    """
    report = audit_path(db)
    assert report.violations == [], report.text()
    assert report.revision == report.head and not report.skipped, report.notes
    # `status` counts active tasks by their dispatch rows, and the audit found those counts
    # equal to the tasks' states and no lease without its dispatch: none active, no dispatch
    # row, no lease.
    assert report.stats is not None and report.stats.tasks["active"] == 0, report.stats
    if expected_tasks is not None:
        assert sum(report.stats.tasks.values()) == expected_tasks, report.stats.tasks
    return report
