"""`coordinator` / `python -m coordinator`: run, status, requeue, db upgrade."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .executors import EXECUTOR_KINDS
from .fault_spec import KINDS, InjectSpecError, parse_inject
from .runtime import EXIT_STORE, EXIT_USAGE, exit_status_path, process_exists
from .config import (
    DEFAULT_DEMO_TASKS,
    ENV_MAX_ATTEMPTS,
    ENV_RESUME,
    ENV_RETRIES,
    ENV_TIMEOUT,
    ENV_WATCHDOG,
    ConfigError,
    RunConfig,
    int_range,
    non_negative_float,
    resolve_run,
    timeout_seconds,
)


RUN_EPILOG = f"""\
environment (a flag wins over its variable):
  {ENV_RESUME}=1                        same as --resume
  {ENV_RETRIES}=N     same as --retries (0..16, default 1)
  {ENV_MAX_ATTEMPTS}=N         same as --max-attempts (default retries + 4)
  {ENV_TIMEOUT}=S                       same as --timeout (default 30)
  {ENV_WATCHDOG}=S         same as --watchdog (default max(120, 4 x timeout))

Started outside mpiexec, `run` launches itself with the mpiexec beside this Python (else
PATH's) and --np ranks (rank 0 is the master, the others are workers). Under mpiexec it uses
the ranks it was given.

examples:
  coordinator run --db demo.db                      # {DEFAULT_DEMO_TASKS} built-in demo tasks, 4 ranks
  mpiexec -n 64 coordinator run --db campaign.db --afl-out afl_out --fuzzer main \\
      --name symcc -- ./target_symcc @@
  coordinator run --db farm.db --tasks tasks.jsonl --callable mypkg.work:solve
"""


class Once(argparse.Action):
    """A flag that takes one value: given twice it is an error, not the last one silently
    winning (`--tasks a.jsonl --tasks b.jsonl` would have imported b alone)."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault("_given_once", set())
        if self.dest in seen:
            parser.error(f"{option_string} given twice")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


def _task_id(text: str) -> int:
    """A task id: one SQLite can hold (a larger one made `requeue` end in a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid task id: {text!r}") from None
    if not 1 <= value <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"no task has id {text} (ids run from 1)")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="coordinator",
        description="A durable coordinator for MPI task farms: every master transition is one "
                    "SQLite transaction, so nothing is lost or committed twice across crashes.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run (or resume) a campaign under MPI",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=RUN_EPILOG)
    r.add_argument("--db", action=Once, type=Path, required=True,
                   help="campaign database (node-local disk)")
    r.add_argument("--resume", action="store_true",
                   help="continue the campaign stored in --db: interrupted and deferred work "
                        "is dispatched first")
    r.add_argument("--retries", action=Once, type=int_range(0, 16), default=None,
                   help="immediate requeues of a task whose dispatch broke, before it is "
                        "deferred to the next --resume (0..16, default 1)")
    r.add_argument("--max-attempts", action=Once, type=int_range(1), default=None,
                   help="failed dispatches after which a task is held as failed until "
                        "`coordinator requeue` (above --retries; default retries + 4, i.e. "
                        "5; counted across restarts)")
    r.add_argument("--synchronous", action=Once, choices=("FULL", "NORMAL"), default="FULL",
                   help="FULL (default): every dispatch and commit survives a power loss; "
                        "NORMAL: faster, a power loss may re-run the last few tasks")
    src = r.add_argument_group("task sources (choose one; default: --demo "
                               f"{DEFAULT_DEMO_TASKS})")
    src.add_argument("--demo", action=Once, type=int_range(1), default=None, metavar="N",
                     help="N built-in demo tasks")
    src.add_argument("--tasks", action=Once, type=Path, default=None, metavar="FILE",
                     help="a JSONL file of task payloads (one object per line)")
    src.add_argument("--afl-out", action=Once, type=Path, default=None, metavar="DIR",
                     help="AFL output directory; watches DIR/FUZZER/queue for new inputs and "
                          "writes results to DIR/NAME/queue (runs until SIGINT/SIGTERM)")
    src.add_argument("--fuzzer", action=Once, default=None,
                     help="the AFL instance whose queue is read")
    src.add_argument("--name", action=Once, default="symcc",
                     help="this coordinator's AFL instance directory (default symcc)")
    ex = r.add_argument_group("executors")
    ex.add_argument("--executor", action=Once, choices=EXECUTOR_KINDS, default=None,
                    help="default: command if a command follows --, python with --callable, "
                         "else demo")
    ex.add_argument("--callable", action=Once, default=None, metavar="MODULE:FUNCTION",
                    help="python executor: called with each task payload, returns JSON")
    ex.add_argument("--timeout", action=Once, type=timeout_seconds, default=None, metavar="S",
                    help="command executor: kill the command's process group after S seconds "
                         "(default 30)")
    ex.add_argument("--demo-work-ms", action=Once, type=non_negative_float, default=0.0,
                    metavar="MS",
                    help="demo executor: CPU time burnt per task (default 0)")
    r.add_argument("--watchdog", action=Once, type=non_negative_float, default=None, metavar="S",
                   help="per-dispatch deadline; past it the dispatch is recovered and the rank "
                        "parked (default max(120, 4 x timeout); 0 disables)")
    r.add_argument("--max-depth", action=Once, type=int_range(0), default=0,
                   help="feedback depth limit for test cases found by results (0 = unlimited)")
    r.add_argument("--feedback", action=argparse.BooleanOptionalAction, default=True,
                   help="queue the test cases that results find as new tasks (default on; "
                        "with --afl-out, --no-feedback leaves it to AFL to pick the ones worth "
                        "a run, as SymCC's own helper does)")
    r.add_argument("--out", action=Once, type=Path, default=None,
                   help="where committed test cases go without --afl-out (default DB.out/)")
    r.add_argument("--stats-file", action=Once, type=Path, default=None,
                   help="stats text, rewritten every --stats-interval and at exit "
                        "(default DB.stats)")
    r.add_argument("--stats-interval", action=Once, type=non_negative_float, default=60.0,
                   metavar="S",
                   help="seconds between rewrites of the stats file (default 60)")
    r.add_argument("--grace", action=Once, type=non_negative_float, default=10.0, metavar="S",
                   help="after SIGINT/SIGTERM, time given to in-flight work (default 10)")
    r.add_argument("--stop-wait", action=Once, type=non_negative_float, default=10.0, metavar="S",
                   help="bounded wait for each worker's STOP_ACK (default 10)")
    r.add_argument("--worker-spin-ms", action=Once, type=non_negative_float, default=None,
                   metavar="MS",
                   help="after each answer an idle worker polls for its next WORK without "
                        "sleeping (yielding the CPU between polls) this long, then sleeps "
                        "between polls (default 50 under Open MPI, 0 under other MPIs)")
    r.add_argument("--max-message-bytes", action=Once, type=int_range(1024), default=64 << 20,
                   help="larger worker messages are quarantined as malformed (default 64 MiB)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="live progress display (default: on when `coordinator run` launches "
                        "itself from a terminal)")
    r.add_argument("--summary-json", action=Once, type=Path, default=None, metavar="PATH",
                   help="write the run's summary (counts, loop rate, transactions, master "
                        "peak memory) as JSON at exit, for scripts")
    # Set by the self-launch for rank 0 (see _self_launch), not by users.
    r.add_argument("--master-pid-file", type=Path, default=None, help=argparse.SUPPRESS)
    r.add_argument("--np", action=Once, type=int_range(2), default=4,
                   help="ranks to launch when started outside mpiexec (default 4)")
    r.add_argument("--ulfm", action=argparse.BooleanOptionalAction, default=True,
                   help="self-launch with Open MPI's fault tolerance (--with-ft ulfm), so a "
                        "dead worker is noticed and its task recovered while the job goes on "
                        "(default on; ignored for other MPIs)")
    r.add_argument("--mpiexec", action=Once, default=None,
                   help="mpiexec to self-launch with (default: the one beside this Python)")
    r.add_argument("--start-timeout", action=Once, type=int_range(0), default=START_TIMEOUT_S,
                   metavar="SECONDS",
                   help="self-launch: end the job if no master has started after this long "
                        "(a rank that dies inside MPI_Init leaves Open MPI with ULFM waiting "
                        f"for ever; nothing has been changed then); 0 = wait for ever "
                        f"(default {START_TIMEOUT_S})")
    fi = r.add_argument_group(
        "fault injection (testing only; acts in the workers' send path)",
        "kinds: " + "; ".join(f"{k}: {v}" for k, v in KINDS.items()))
    fi.add_argument("--inject", action=Once, type=_inject_spec, default=None,
                    metavar="KIND=RATE[,...]",
                    help="inject faults, each kind independently per task at its rate (0..1)")
    fi.add_argument("--inject-seed", action=Once, type=int, default=0, metavar="N",
                    help="the same seed reproduces the same faults (default 0)")
    fi.add_argument("--inject-log", action=Once, type=Path, default=None, metavar="DIR",
                    help="append every injected fault to DIR/faults-rank<R>.jsonl")
    r.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- COMMAND ARGS...: the command executor's command; @@ is replaced "
                        "by the input file's path (without @@ the input is on stdin)")

    s = sub.add_parser("status", help="what a campaign database holds")
    s.add_argument("--db", type=Path, required=True)
    s.add_argument("--json", action="store_true", help="machine-readable, stable keys")

    q = sub.add_parser("requeue", help="put failed or deferred tasks back in the queue, or "
                                       "done tasks whose run failed (--state error)")
    q.add_argument("--db", type=Path, required=True)
    q.add_argument("--state", choices=("failed", "deferred", "all", "error"), default="all",
                   help="all (default): failed and deferred tasks; error: done tasks whose "
                        "result status is not ok (their result is discarded), e.g. after "
                        "fixing the target or restoring missing inputs")
    q.add_argument("--id", type=_task_id, action="append", dest="ids", metavar="TASK_ID",
                   help="only this task (repeatable)")

    d = sub.add_parser("db", help="schema maintenance")
    dsub = d.add_subparsers(dest="db_cmd", required=True, metavar="upgrade")
    u = dsub.add_parser("upgrade", help="create or bring a campaign database to the code's "
                                        "schema (same as `alembic -x db=PATH upgrade head`)")
    u.add_argument("--db", type=Path, required=True)
    return p


def _inject_spec(text: str) -> dict[str, float]:
    try:
        return parse_inject(text)
    except InjectSpecError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--inject: ")) from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ns = _parser().parse_args(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if ns.cmd == "run":
            cfg = resolve_run(ns)
            if not _under_mpi_launcher():
                return _self_launch(ns, args)
            from .runtime import run
            return run(cfg)
        if ns.cmd == "status":
            try:
                return _status(ns.db, ns.json)
            except BrokenPipeError:  # `status | head`: the reader had enough
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
        if ns.cmd == "requeue":
            return _requeue(ns)
        if ns.cmd == "db":
            return _db_upgrade(ns.db)
    except ConfigError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_USAGE


# -- launching -----------------------------------------------------------------------------

_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK",
                  "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")


def _under_mpi_launcher() -> bool:
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
        if os.geteuid() == 0:
            flags.append("--allow-run-as-root")
        if ulfm:
            flags = ["--with-ft", "ulfm", *flags]
    return flags


def _self_launch(ns: argparse.Namespace, args: list[str]) -> int:
    mpiexec = find_mpiexec(ns.mpiexec)
    if mpiexec is None and ns.mpiexec:
        print(f"coordinator: --mpiexec {ns.mpiexec}: no such executable (give its path, or a "
              f"name on PATH)", file=sys.stderr)
        return EXIT_USAGE
    if mpiexec is None:
        print("coordinator: no mpiexec found; install the project (it brings Open MPI) or "
              "start the job with your MPI's mpiexec", file=sys.stderr)
        return EXIT_USAGE
    rest = _strip_launch_options(args)
    if ns.progress is None and sys.stderr.isatty():
        # Under mpiexec a rank's stderr is a pipe: decide here, where the terminal is.
        rest.insert(1, "--progress")
    _remove_orphaned_launch_dirs(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=LAUNCH_DIR_PREFIX) as d:
        (Path(d) / LAUNCHER_PID).write_text(f"{os.getpid()}\n")
        pid_file = Path(d) / "master.pid"
        rest[1:1] = ["--master-pid-file", str(pid_file)]
        cmd = [mpiexec, *mpiexec_flags(mpiexec, ns.np, ulfm=ns.ulfm), sys.executable, "-m",
               "coordinator", *rest]
        return _supervise(cmd, pid_file, ns.start_timeout)


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
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


PR_SET_PDEATHSIG = 1

#: Ctrl-C presses (or SIGTERMs to the launcher) after which the job is ended at once.
FORCE_AFTER = 3


def _supervise(cmd: list[str], pid_file: Path, start_timeout_s: float = 0) -> int:
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
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
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
        return LAUNCH_TIMED_OUT
    if ended_by is not None and not _recorded_pid(pid_file):
        # The master records its pid (atomically) before it opens the database, and it never
        # did: nothing was changed. (If it started meanwhile, the SIGTERM the job got reached
        # it as a graceful stop, and its own status stands.)
        print("coordinator: stopped before the master started; nothing was changed",
              file=sys.stderr, flush=True)
        return 128 + ended_by  # as a shell reports a process ended by that signal
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
        return 128 + ended_by
    code = rc if rc >= 0 else 128 - rc
    if _recorded_pid(pid_file):
        # The master started and gave no status: it was killed (the OOM killer, a kill -9),
        # or without ULFM another rank's death took the job down. Under ULFM mpiexec may
        # still exit 0, which would read as "finished".
        print("coordinator: the job ended before the master recorded its status (the master "
              "or another rank was killed: see the output above); the campaign is saved: run "
              "the same command again with --resume (tasks already imported are not added "
              "twice)", file=sys.stderr, flush=True)
        return code or 1
    return code


#: The status of a self-launched job ended because no master started in time.
LAUNCH_TIMED_OUT = 1


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


# -- inspection commands -------------------------------------------------------------------

def _open_readonly(db: Path):
    from store.engine import open_engine
    from store.errors import StoreError
    if not db.exists():
        print(f"coordinator: {db}: no such campaign database", file=sys.stderr)
        return None
    try:
        return open_engine(db, write=False)
    except StoreError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return None


def _status(db: Path, as_json: bool) -> int:
    from store.campaign import lock_held, lock_holder
    from store.errors import StoreError
    from store.stats import (
        held_reasons,
        read_stats,
        recent_failures,
        result_statuses,
        stats_text,
    )
    from store.versioning import check_revision

    from .gate import detail_summary
    engine = _open_readonly(db)
    if engine is None:
        return EXIT_USAGE
    try:
        with engine.connect() as conn:
            check_revision(conn, db)
            s = read_stats(conn)
            by_status = result_statuses(conn)
            failures = recent_failures(conn) if set(by_status) - {"ok"} else []
            held = held_reasons(conn) if s.tasks["deferred"] or s.tasks["failed"] else {}
    except StoreError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        engine.dispose()
    master = _master_state(lock_holder(db), lock_held(db))
    if as_json:
        print(json.dumps({**s.as_json(), "results_by_status": by_status, "master": master},
                         indent=2, sort_keys=True))
        return 0
    t = s.tasks
    print(f"campaign {db} (incarnation {s.incarnation}, schema {s.schema_revision})")
    if master is not None:
        where = f"pid {master['pid']} on {master['host']}"
        print("master: " + {True: f"running ({where})", False: f"not running (the last was "
                            f"{where})", None: f"{where} (whether it runs cannot be told from here)"}[
                                master["running"]])
    print(f"tasks: {sum(t.values())} = {t['done']} done, {t['queued']} queued, "
          f"{t['active']} active, {t['deferred']} deferred, {t['failed']} failed")
    if t["active"] and master is not None and master["running"] is False:
        print(f"  the {t['active']} active ones were left by a master that is gone: "
              f"`coordinator run --resume` puts them back in the queue first")
    for state, reasons in held.items():
        print(f"  {state}, most common reasons: " + "; ".join(
            f"{n} × {detail_summary(reason, 100)}" for reason, n in reasons))
    shown = ", ".join(f"{st}={n}" for st, n in sorted(by_status.items()))
    print(f"committed results: {s.results}" + (f" ({shown})" if shown else ""))
    if failures:
        print("latest results that are not ok:")
        for task_id, rank, status, detail in failures:
            print(f"  task {task_id} (rank {rank}): {status}: {detail_summary(detail)}")
    print(stats_text(s), end="")
    return 0


def _master_state(holder: tuple[int, str] | None, held: bool | None) -> dict | None:
    """The last master that held the campaign's lock, and whether it runs: the kernel's lock
    table says (the database is on a node-local disk, so the master runs here); without one,
    whether its pid still exists on this host; None if it cannot be told."""
    if holder is None:
        return None
    pid, host = holder
    if held is None and host == socket.gethostname():
        held = process_exists(pid)
    return {"pid": pid, "host": host, "running": held}


def _requeue(ns: argparse.Namespace) -> int:
    from store.campaign import Store
    from store.errors import StoreError
    from store.schema import TaskState
    from store.tasks import REQUEUE_CHUNK, requeue_error_results, requeue_tasks
    states = {"failed": (TaskState.FAILED,), "deferred": (TaskState.DEFERRED,),
              "all": (TaskState.FAILED, TaskState.DEFERRED), "error": ()}[ns.state]
    try:
        store = Store.attach(ns.db)
    except StoreError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return EXIT_USAGE
    done: list[int] = []
    try:
        # In chunks, each its own short transaction, in id order: a running master shares the
        # write lock and waits for each (a single one of 100,000 tasks took 30 s and killed
        # it). A task the master runs and fails again meanwhile is not taken twice.
        while True:
            after = done[-1] if done else 0
            with store.transaction("manual requeue") as tx:
                chunk = (requeue_error_results(tx, ids=ns.ids, after_id=after,
                                               limit=REQUEUE_CHUNK) if ns.state == "error" else
                         requeue_tasks(tx, states=states, ids=ns.ids, after_id=after,
                                       limit=REQUEUE_CHUNK))
            done += chunk
            if len(chunk) < REQUEUE_CHUNK:
                break
    except StoreError as e:
        print(f"coordinator: {e}" + (f" (after {len(done)} tasks were requeued; run it again "
                                     f"for the rest)" if done else ""), file=sys.stderr)
        return EXIT_STORE
    finally:
        store.close()
    print(f"requeued {len(done)} task(s)" + (f": {id_list(done)}" if done else ""))
    left = sorted(set(ns.ids or ()) - set(done))
    if left:
        wanted = {"all": "failed or deferred", "error": "done with a result that is not ok"}
        print(f"coordinator: not requeued (no such task, or not "
              f"{wanted.get(ns.state, ns.state)}): {id_list(left)}", file=sys.stderr)
    return 0


def id_list(ids: list[int], whole_up_to: int = 50, runs_shown: int = 20) -> str:
    """Task ids for a console line: all of them when few, else runs of consecutive ids
    (`1-5000`), the first `runs_shown` of them (a requeue of 50,000 tasks printed a line
    of 400 KB)."""
    if len(ids) <= whole_up_to:
        return ", ".join(map(str, ids))
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = [f"{a}-{b}" if a != b else str(a) for a, b in runs[:runs_shown]]
    more = len(runs) - runs_shown
    # ASCII: a console whose encoding cannot show "…" failed the command after its commits.
    return ", ".join(shown) + (f", ... and {more} more runs of ids" if more > 0 else "")


def _db_upgrade(db: Path) -> int:
    from store.campaign import campaign_locked
    from store.errors import StoreError, StoreWriteError
    from store.versioning import upgrade

    def announce(before: str, target: str) -> None:
        print(f"coordinator: upgrading {db} from schema {before} to {target} (a revision that "
              f"copies a table takes seconds per million rows)...",
              file=sys.stderr, flush=True)

    try:
        if db.parent.is_dir():
            with campaign_locked(db):  # never under a running master
                before, after = upgrade(db, announce=announce)
        else:
            before, after = upgrade(db, announce=announce)  # (which explains the missing dir)
    except StoreWriteError as e:
        # A full disk, a read-only file, tables that do not match the revision stamp: each
        # revision runs in one transaction, so the failed one changed nothing.
        print(f"coordinator: cannot upgrade {db}: {e}; the revision that failed changed "
              f"nothing (each runs in one transaction): fix the cause and run it again",
              file=sys.stderr)
        return EXIT_STORE
    except OSError as e:  # the lock file beside it: a read-only or full directory
        print(f"coordinator: cannot upgrade {db}: {e}; nothing was changed", file=sys.stderr)
        return EXIT_STORE
    except StoreError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{db}: schema {before or '(new)'} -> {after}" if before != after
          else f"{db}: schema already at {after}")
    return 0


def describe(cfg: RunConfig) -> str:
    src = (f"{cfg.demo} demo tasks" if cfg.demo is not None else
           f"tasks from {cfg.tasks_file}" if cfg.tasks_file else
           f"AFL queue {cfg.afl_out}/{cfg.fuzzer}/queue" if cfg.afl_out is not None else
           "the campaign's stored tasks")
    return f"{src}, {cfg.executor} executor"
