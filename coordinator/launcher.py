"""`coordinator run` started outside `mpiexec`: it launches itself under `mpiexec` and stays
in front as the job's supervisor, turning Ctrl-C and SIGTERM into a graceful stop of the
master and reporting the master's own exit status."""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .config import RunConfig, exit_status_path
from .errors import UsageError, refusing_os_errors
from .exits import ExitStatus, signalled
from .processes import parent_death_signal, process_exists

_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK",
                  "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")


def under_mpi_launcher() -> bool:
    return any(v in os.environ for v in _LAUNCHER_VARS)


def find_mpiexec(explicit: str | None = None) -> str | None:
    if explicit:
        found = shutil.which(explicit)  # a path must be an executable file; a name, on PATH
        return os.path.abspath(found) if found else None
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


#: Open MPI's launcher (prterun) sometimes fails to start its PMIx server when several jobs
#: start at once on the machine (exit 213, before any rank runs): `coordinator run`, the tests
#: and the benchmark launch once more when they see it.
LAUNCHER_FAILED = "PMIx server's listener thread failed to start"
LAUNCHER_FAILED_STATUS = 213


#: Open MPI's launcher notices a host cut off the network only through TCP keepalive, by
#: default after 300 s + 9 x 20 s (a job whose master had saved everything waited 487 s):
#: these give up after about a minute (30 s + 3 x 10 s).
OOB_KEEPALIVE = (("oob_tcp_keepalive_time", 30), ("oob_tcp_keepalive_intvl", 10),
                 ("oob_tcp_keepalive_probes", 3))


def mpiexec_flags(mpiexec: str, np: int, ulfm: bool = False) -> list[str]:
    """The flags a newcomer would otherwise have to know: Open MPI refuses root without
    --allow-run-as-root and more ranks than cores without --oversubscribe; `ulfm` asks Open
    MPI to keep the job alive when a rank dies."""
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    flags = ["-n", str(np)]
    if "Open MPI" in version or "OpenRTE" in version or "prte" in version.lower():
        flags.append("--oversubscribe")
        for name, value in OOB_KEEPALIVE:
            flags += ["--prtemca", name, str(value)]
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
        if ulfm:
            flags = ["--with-ft", "ulfm", *flags]
    return flags


def self_launch(ns: argparse.Namespace, args: list[str], cfg: RunConfig) -> int:
    """Check what can refuse the run (`preflight`, well under a second), then launch the
    job and supervise it."""
    # Here, not at the top: every rank imports the command line, and a worker must not load
    # the store that the check reads.
    from store.errors import StoreError

    from .preflight import check_run
    try:
        with refusing_os_errors():
            check_run(cfg)
    except (StoreError, UsageError) as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    mpiexec = find_mpiexec(ns.mpiexec)
    if mpiexec is None and ns.mpiexec:
        print(f"coordinator: --mpiexec {ns.mpiexec}: no such executable (give its path, or a "
              f"name on PATH)", file=sys.stderr)
        return ExitStatus.USAGE
    if mpiexec is None:
        print("coordinator: no mpiexec found; install the project (it brings Open MPI) or "
              "start the job with your MPI's mpiexec", file=sys.stderr)
        return ExitStatus.USAGE
    why = _session_dir_unusable() or _home_unset()
    if why is not None:
        print(f"coordinator: {why}", file=sys.stderr)
        return ExitStatus.USAGE
    rest = _strip_launch_options(args)
    if ns.progress is None and sys.stderr.isatty():
        # Under mpiexec a rank's stderr is a pipe: decide here, where the terminal is.
        rest.insert(1, "--progress")
    elif ns.progress and not sys.stderr.isatty():
        print("coordinator: --progress with stderr not a terminal writes the live display's "
              "frames into it, 4 a second; without --progress (and without --no-progress, "
              "which silences both), --progress-interval S gives plain lines",
              file=sys.stderr, flush=True)
    _remove_orphaned_launch_dirs(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=LAUNCH_DIR_PREFIX) as d:
        (Path(d) / LAUNCHER_PID).write_text(f"{os.getpid()}\n")
        pid_file = Path(d) / "master.pid"
        rest[1:1] = ["--master-pid-file", str(pid_file)]
        cmd = [mpiexec, *mpiexec_flags(mpiexec, ns.np, ulfm=ns.ulfm), *rank_command(), *rest]
        return _supervise(cmd, pid_file, ns.start_timeout, cfg.metrics_file)


#: `python -m coordinator` for Pythons without -P (3.10): the same, without the start
#: directory that -c puts first on sys.path.
_SAFE_PATH_MAIN = ("import runpy, sys; del sys.path[0]; "
                   "runpy.run_module('coordinator', run_name='__main__', alter_sys=True)")


def rank_command() -> list[str]:
    """How every rank of a self-launched job starts: `python -m coordinator` without the
    start directory first on sys.path (-P), where a user's `store.py`, `migrations.py` or
    `coordinator.py` took the place of the project's own packages: every launch, --demo too,
    failed (a traceback, then a wait for --start-timeout; or exit 5; or a silent exit 1).
    A `--callable` module there is still found: the executor adds the start directory at
    the end of sys.path (`executors._resolve`)."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "coordinator"]
    return [sys.executable, "-c", _SAFE_PATH_MAIN]


#: The least free space the launch's temporary directory needs: Open MPI's session directory
#: there takes a few hundred KiB.
SESSION_DIR_MIN_FREE = 4 << 20


def _session_dir_unusable() -> str | None:
    """Why Open MPI cannot make its session directory in TMPDIR (/tmp without it), if it
    cannot: an unwritable or full one made mpiexec exit 213, the status of a known start-up
    race of its launcher, so the launch was made twice and reported as that race. (Python's
    own temporary files would silently go elsewhere.)"""
    tmp = os.environ.get("TMPDIR") or "/tmp"
    named = f"TMPDIR={tmp}" if os.environ.get("TMPDIR") else tmp
    if not os.path.isdir(tmp):
        return f"{named} is not a directory: MPI makes its session files there (set TMPDIR)"
    if not os.access(tmp, os.W_OK | os.X_OK):
        return f"{named} is not writable: MPI makes its session files there (set TMPDIR)"
    try:
        free = shutil.disk_usage(tmp).free
    except OSError:
        return None
    if free < SESSION_DIR_MIN_FREE:
        return (f"{named} has {free >> 10} KiB free: MPI makes its session files there "
                f"(free some space, or set TMPDIR)")
    return None


def _home_unset() -> str | None:
    """Open MPI reads HOME at its start and fails without it ("Unable to get the user home
    directory", exit 1: a cron job, `env -i`, some schedulers). Without HOME the launch gets
    the user's home from the password database; why it cannot, if it cannot."""
    if os.environ.get("HOME"):
        return None
    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        home = ""
    if not home or not os.path.isdir(home):
        return "HOME is not set, and this user has no home directory: MPI needs one (set HOME)"
    os.environ["HOME"] = home  # the launched job's, and so every local rank's
    return None


#: Seconds a self-launched job may take to reach the master's start (its pid file is written
#: right after MPI_Init, before the database or a tasks file is read): ~1-2 s here.
START_TIMEOUT_S = 120
LAUNCH_DIR_PREFIX = "coordinator-launch-"
LAUNCHER_PID = "launcher.pid"


def _remove_orphaned_launch_dirs(tmp: Path) -> None:
    """A launcher that was SIGKILLed could not remove its directory (it holds only the pid
    files): the next launch removes those of this user whose launcher process is gone. A
    directory without a launcher pid, or whose pid is alive (or reused), is left alone."""
    for d in tmp.glob(LAUNCH_DIR_PREFIX + "*"):
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
            pid = int((d / LAUNCHER_PID).read_text())
        except (OSError, ValueError):
            continue  # no pid file, or unreadable: not known to be orphaned
        if not process_exists(pid):
            shutil.rmtree(d, ignore_errors=True)


def _end_with_parent() -> None:
    """In the launched mpiexec: SIGTERM when the launcher dies. Its own session keeps the
    terminal's Ctrl-C away from it, but also a kill of the launcher's process group (a CI
    cancel, `timeout -s KILL`), which would otherwise leave the job running unattended."""
    parent_death_signal(signal.SIGTERM)

#: Ctrl-C presses (or SIGTERMs to the launcher) after which the job is ended at once.
FORCE_AFTER = 3


def _supervise(cmd: list[str], pid_file: Path, start_timeout_s: float = 0,
               metrics_file: Path | None = None) -> int:
    """Run the job in a session of its own and turn a stop request into a signal to the master.

    A terminal's Ctrl-C goes to its foreground process group. If that held `mpiexec`, Open
    MPI's launcher would answer it by killing every rank before the master could requeue its
    in-flight work or acknowledge anything (exit 1, no summary). So the launcher stays in
    front, and the master, whose pid rank 0 writes to `pid_file`, gets the signal instead and
    stops gracefully; pressing Ctrl-C FORCE_AFTER times ends the job at once."""
    sys.stdout.flush()
    proc: subprocess.Popen | None = None
    presses = 0
    ended_by: int | None = None  # the signal that ended a launch with no master (yet)

    def forward(signum: int, _frame: object) -> None:
        nonlocal presses, ended_by
        presses += 1
        master = _recorded_pid(pid_file)  # 0: not started yet, nothing to save: end the launch
        target_sig = signal.SIGTERM if signum == signal.SIGHUP else signum
        if master and presses < FORCE_AFTER:
            try:
                os.kill(master, target_sig)
                if signum == signal.SIGHUP:  # the master can only say which signal it got
                    with contextlib.suppress(OSError):  # the terminal may be gone with it
                        print("coordinator: SIGHUP passed on to the master as SIGTERM",
                              file=sys.stderr, flush=True)
                if presses == FORCE_AFTER - 1:
                    print("coordinator: still stopping; signal once more to end the job at "
                          "once (the campaign is saved: continue with --resume)",
                          file=sys.stderr, flush=True)
                return
            except ProcessLookupError:
                pass  # the master has gone already: nothing is left to save, end the rest
        if master:
            print("coordinator: ending the job now (the campaign is saved: continue with "
                  "--resume)", file=sys.stderr, flush=True)
        else:
            ended_by = ended_by or signum
        if proc is not None:  # else it is ended as soon as it exists
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)

    # Before the job starts: a Ctrl-C then would otherwise end this launcher with a
    # KeyboardInterrupt, and leave the job (in its own session) to run on.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, forward)
    for launch in (1, 2):
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_end_with_parent)
        if ended_by is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        rc = _wait_for_start(proc, pid_file, start_timeout_s)
        if (launch == 2 or rc != LAUNCHER_FAILED_STATUS or ended_by is not None
                or _recorded_pid(pid_file)):
            break
        proc = None  # reaped: its id may be another process's by now
        print(f"coordinator: {cmd[0]} exited with status {rc} before the master started; "
              f"launching once more (Open MPI's launcher does so at times when jobs start at "
              f"once, saying \"{LAUNCHER_FAILED}\")", file=sys.stderr, flush=True)
        if ended_by is not None:  # stopped meanwhile: nothing to launch
            break
    proc = None  # (for a signal from here on: the job has ended)
    if rc is None:
        print(f"coordinator: no master had started {start_timeout_s} s after the launch (a "
              f"rank that dies inside MPI_Init leaves Open MPI with ULFM waiting for ever); "
              f"ended the job, nothing was changed: start it again (or give --start-timeout)",
              file=sys.stderr, flush=True)
        return ExitStatus.FAILED
    if ended_by is not None and not _recorded_pid(pid_file):
        # The master records its pid (atomically) before it opens the database, and it never
        # did: nothing was changed. (If it started meanwhile, the SIGTERM the job got reached
        # it as a graceful stop, and its own status stands.)
        print("coordinator: stopped before the master started; nothing was changed",
              file=sys.stderr, flush=True)
        return signalled(ended_by)
    if rc != 0 and not _recorded_pid(pid_file):
        # Not one of ours: the launcher or MPI_Init failed, and nothing ran of the campaign.
        print(f"coordinator: {cmd[0]} exited with status {rc if rc >= 0 else 128 - rc} before "
              f"the master started (see its output above); nothing was changed",
              file=sys.stderr, flush=True)
    own = _read_number(exit_status_path(pid_file))
    if own is not None:
        return own  # the master's, not that of whichever rank mpiexec saw end first
    if ended_by is not None:
        # The job was ended while the master started (its pid came just after the signal),
        # and the master did not live to say how it ended.
        print("coordinator: stopped while the master was starting; run the same command again "
              "(with --resume if it says the campaign exists)", file=sys.stderr, flush=True)
        return signalled(ended_by)
    code = rc if rc >= 0 else 128 - rc
    if _recorded_pid(pid_file):
        # The master started and gave no status: it was killed (the OOM killer, a kill -9),
        # or without ULFM another rank's death took the job down. Under ULFM mpiexec may
        # still exit 0, which would read as "finished".
        print(f"coordinator: the job ended before the master recorded its status ({cmd[0]} "
              f"exited with status {code}; the master or another rank was killed: see the "
              f"output above); the campaign is saved: run the same command again with "
              f"--resume (tasks already imported are not added twice)",
              file=sys.stderr, flush=True)
        if metrics_file is not None:
            # The master's last write said it ran: an alert on it must see the end.
            from .metrics import mark_stopped
            try:
                mark_stopped(metrics_file)
            except OSError as e:
                print(f"coordinator: cannot mark the metrics file {metrics_file} stopped: "
                      f"{e.strerror or e}", file=sys.stderr, flush=True)
        # Not mpiexec's status: its 137 for a master's kill -9 read, by the table, as a
        # signal before the master started, and a script then started it again without
        # --resume (refused).
        return ExitStatus.FAILED
    # The master never started: whatever mpiexec's own status was (213, 230, ...; 2 or 130
    # would read as another of the table's meanings), the launch failed.
    if rc == 0:
        # (Otherwise said above.) The ranks ran and ended well, but not one of them was a
        # master: they ran something else than the coordinator.
        print(f"coordinator: {cmd[0]} exited with status 0, but no master started (the "
              f"ranks never reached the coordinator's start: see their output above, if "
              f"any); nothing was changed", file=sys.stderr, flush=True)
    return ExitStatus.FAILED




def _wait_for_start(proc: subprocess.Popen, pid_file: Path, start_timeout_s: float) -> int | None:
    """The job's exit status; None if no master started within `start_timeout_s` (0: no
    limit), after ending the job (SIGTERM, then SIGKILL: ranks stuck in MPI_Init may ignore
    the first)."""
    deadline = time.monotonic() + start_timeout_s if start_timeout_s else None
    while True:
        try:
            return proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            pass
        if deadline is None or time.monotonic() < deadline:
            continue
        if _recorded_pid(pid_file):
            deadline = None  # started: from here on, the run takes what it takes
            continue
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 30.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=grace)
                return None
            except subprocess.TimeoutExpired:
                continue
        return None


def _recorded_pid(pid_file: Path) -> int:
    return _read_number(pid_file) or 0


def _read_number(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _strip_launch_options(args: list[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--":
            out.extend(args[i:])
            break
        if a in ("--np", "--mpiexec", "--start-timeout"):
            skip = True
            continue
        if (a.startswith(("--np=", "--mpiexec=", "--start-timeout="))
                or a in ("--ulfm", "--no-ulfm")):
            continue
        out.append(a)
    return out


