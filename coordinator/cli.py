"""`coordinator` / `python -m coordinator`: the command line (run, status, check, requeue,
db upgrade) and its dispatch.

Every rank of a job starts here, so nothing the master alone needs (the store, SQLAlchemy)
is imported at the top: the operator commands and the master are loaded by what runs them."""

from __future__ import annotations

import argparse
import datetime
import io
import logging
import math
import signal
import sys

from .config import (
    DEFAULT_DEMO_TASKS,
    DEFAULT_LOCK_WAIT_S,
    ENV_MAX_ATTEMPTS,
    ENV_RESUME,
    ENV_RETRIES,
    ENV_TIMEOUT,
    ENV_WATCHDOG,
    EXECUTOR_KINDS,
    batch_size,
    int_range,
    non_negative_float,
    path_arg,
    resolve_run,
    start_wait,
    timeout_seconds,
)
from .errors import UsageError, reader_may_leave, refused, refusing_os_errors
from .exits import ExitStatus
from .fault_spec import KINDS, InjectSpecError, parse_inject
from .launcher import START_TIMEOUT_S, self_launch, under_mpi_launcher

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
  coordinator run --db demo.db              # {DEFAULT_DEMO_TASKS} built-in demo tasks, 4 ranks
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
    """A task id: one SQLite can hold (a larger one would end `requeue` in a traceback)."""
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
    r.add_argument("--db", action=Once, type=path_arg, required=True,
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
    src.add_argument("--tasks", action=Once, type=path_arg, default=None, metavar="FILE",
                     help="a JSONL file of task payloads (one object per line)")
    src.add_argument("--afl-out", action=Once, type=path_arg, default=None, metavar="DIR",
                     help="AFL output directory; watches DIR/FUZZER/queue for new inputs and "
                          "writes results to DIR/NAME/queue (runs until a stop signal: "
                          "SIGINT, SIGTERM, SIGHUP or SIGUSR1)")
    src.add_argument("--fuzzer", action=Once, default=None,
                     help="the AFL instance whose queue is read")
    src.add_argument("--name", action=Once, default=None,
                     help="this coordinator's AFL instance directory (default symcc); one "
                          "campaign's at a time: another campaign's master there is refused")
    ex = r.add_argument_group("executors")
    ex.add_argument("--executor", action=Once, choices=EXECUTOR_KINDS, default=None,
                    help="default: command if a command follows --, python with --callable, "
                         "else demo")
    ex.add_argument("--callable", action=Once, default=None, metavar="MODULE:FUNCTION",
                    help="python executor: called with each task payload, returns JSON")
    ex.add_argument("--timeout", action=Once, type=timeout_seconds, default=None, metavar="S",
                    help="command executor: kill the command's process group after S seconds "
                         "(default SYMCC_TIMEOUT, else 30; a --resume keeps the campaign's)")
    ex.add_argument("--demo-work-ms", action=Once, type=non_negative_float, default=0.0,
                    metavar="MS",
                    help="demo executor: CPU time burnt per task (default 0)")
    r.add_argument("--watchdog", action=Once, type=non_negative_float, default=None, metavar="S",
                   help="per-dispatch deadline; past it the dispatch is recovered and the rank "
                        "parked (default max(120, 4 x timeout); 0 disables)")
    r.add_argument("--max-depth", action=Once, type=int_range(0), default=None,
                   help="feedback depth limit for test cases found by results (0 = unlimited, "
                        "the default; a --resume keeps the campaign's)")
    r.add_argument("--feedback", action=argparse.BooleanOptionalAction, default=None,
                   help="queue the test cases that results find as new tasks (default on "
                        "for a command, off for a callable, whose test cases are its output; "
                        "with --afl-out, --no-feedback leaves it to AFL to pick the ones worth "
                        "a run, as SymCC's own helper does; a --resume keeps the campaign's)")
    r.add_argument("--out", action=Once, type=path_arg, default=None,
                   help="where committed test cases go without --afl-out (default DB.out/); "
                        "one campaign's at a time: another campaign's master there is refused")
    r.add_argument("--stats-file", action=Once, type=path_arg, default=None,
                   help="stats text, rewritten every --stats-interval and at exit "
                        "(default DB.stats; an existing file holding anything else is "
                        "refused)")
    r.add_argument("--stats-interval", action=Once, type=non_negative_float, default=60.0,
                   metavar="S",
                   help="seconds between rewrites of the stats file (default 60)")
    r.add_argument("--grace", action=Once, type=non_negative_float, default=10.0, metavar="S",
                   help="after a stop signal, time given to in-flight work (default 10)")
    r.add_argument("--batch", action=Once, type=batch_size, default=None, metavar="N|auto",
                   help="tasks per dispatch (1..1000): one token, one WORK and one RESULT for "
                        "N tasks, for tasks too small to pay a commit each; auto sizes each "
                        "dispatch from the tasks' measured run time (at least ~30 ms of them) "
                        "and what a dispatch costs its rank (at most ~4%% of its time; at most "
                        "1 s of tasks, less as the queue empties) (default: 1 for a command, "
                        "auto for python and demo tasks)")
    r.add_argument("--stall-grace", action=Once, type=non_negative_float, default=120.0,
                   metavar="S",
                   help="when no live rank can take work (each parked past --watchdog), end "
                        "the run after S seconds unless one answers (default 120)")
    r.add_argument("--start-wait", action=Once, type=start_wait, default=60.0,
                   metavar="S",
                   help="a rank that reports no READY this long after the start is treated as "
                        "lost: no work, not waited for at the stop (default 60, at least 1)")
    r.add_argument("--lock-wait", action=Once, type=non_negative_float,
                   default=DEFAULT_LOCK_WAIT_S, metavar="S",
                   help="while another process holds the campaign's write lock (a sqlite3 "
                        "shell, a backup), wait up to S seconds, saying so once a minute, "
                        f"before stopping (exit 3; default {DEFAULT_LOCK_WAIT_S:g})")
    r.add_argument("--stop-wait", action=Once, type=non_negative_float, default=10.0, metavar="S",
                   help="bounded wait for each worker's STOP_ACK; runs that end in it are "
                        "committed, the rest go back to the queue (default 10)")
    r.add_argument("--worker-spin-ms", action=Once, type=non_negative_float, default=None,
                   metavar="MS",
                   help="after each answer an idle worker polls for its next WORK without "
                        "sleeping (yielding the CPU between polls) this long, then sleeps "
                        "between polls (default 50 under Open MPI, 0 under other MPIs)")
    r.add_argument("--max-message-bytes", action=Once, type=int_range(1024), default=64 << 20,
                   help="larger worker messages are quarantined as oversized; a batch whose "
                        "RESULT or WORK would be larger is split (default 64 MiB)")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="--progress: the live display (default when `coordinator run` "
                        "launches itself from a terminal); --no-progress: no progress output "
                        "at all; otherwise a plain line every --progress-interval seconds")
    r.add_argument("--progress-interval", action=Once, type=non_negative_float, default=30.0,
                   metavar="S",
                   help="seconds between plain progress lines on stderr when there is no "
                        "live display (a batch job's log; default 30, 0: none)")
    r.add_argument("--metrics-file", action=Once, type=path_arg, default=None, metavar="PATH",
                   help="Prometheus text file for node_exporter's textfile collector, "
                        "rewritten every 10 s and at exit (e.g. DIR/campaign.prom; an "
                        "existing file holding anything else is refused)")
    r.add_argument("--summary-json", action=Once, type=path_arg, default=None, metavar="PATH",
                   help="write the run's summary (counts, loop rate, transactions, master "
                        "peak memory) as JSON at exit, for scripts (an existing file "
                        "holding anything else is refused)")
    # Set by the self-launch for rank 0 (see _self_launch), not by users.
    r.add_argument("--master-pid-file", type=path_arg, default=None, help=argparse.SUPPRESS)
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
                    help="inject faults, each kind independently per dispatch at its rate (0..1)")
    fi.add_argument("--inject-seed", action=Once, type=int, default=0, metavar="N",
                    help="the same seed reproduces the same faults (default 0)")
    fi.add_argument("--inject-log", action=Once, type=path_arg, default=None, metavar="DIR",
                    help="append every injected fault to DIR/faults-rank<R>.jsonl")
    r.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- COMMAND ARGS...: the command executor's command; @@ is replaced "
                        "by the input file's path (without @@ the input is on stdin)")

    s = sub.add_parser("status", help="one screen for a campaign: tasks, rates, ETA, test "
                                      "cases, ranks, faults (read-only)")
    s.add_argument("--db", type=path_arg, required=True)
    s.add_argument("--json", action="store_true",
                   help="machine-readable, stable keys (a file it refuses, exit 2: an object "
                        "whose error says why)")

    pl = sub.add_parser("plot", help="charts of a campaign's history: PNG files and an "
                                     "index.html (read-only; needs the plot extra)",
                        description="Like afl-plot: PNG charts of tasks done and queue "
                                    "depth, throughput, test cases, per-rank utilisation and "
                                    "faults over time, and an index.html that shows them, from "
                                    "the timestamps the campaign file holds. Read-only: works "
                                    "on a finished campaign, a copy, or a live one. Needs "
                                    "matplotlib (pip install -e '.[plot]'). Exit 2 for a file "
                                    "it refuses or an OUTDIR it cannot write.")
    pl.add_argument("--db", type=path_arg, required=True)
    pl.add_argument("outdir", type=path_arg, metavar="OUTDIR",
                    help="where the charts and index.html go (made if missing)")

    c = sub.add_parser("check", help="audit a campaign file's consistency (read-only)",
                       description="Check every rule a campaign file must hold: conservation "
                                   "of tasks, one record per dispatch, no result from a "
                                   "dispatch that ended otherwise, no lease without its "
                                   "dispatch, statistics equal to their rows, SQLite's "
                                   "integrity_check and foreign_key_check. Read-only: works on "
                                   "a copy, on read-only media, and while a master runs. Exit "
                                   "0 when consistent, 1 with one line per violation, 2 when "
                                   "the file is refused (not a campaign, no campaign yet).")
    c.add_argument("--db", type=path_arg, required=True)
    c.add_argument("--json", action="store_true",
                   help="machine-readable report (for a refused file too: its error says why)")

    q = sub.add_parser("requeue", help="put failed or deferred tasks back in the queue, or "
                                       "done tasks whose run failed (--state error)")
    q.add_argument("--db", type=path_arg, required=True)
    q.add_argument("--state", choices=("failed", "deferred", "all", "error"), default="all",
                   help="all (default): failed and deferred tasks; error: done tasks whose "
                        "result status is not ok (their result is discarded), e.g. after "
                        "fixing the target or restoring missing inputs")
    q.add_argument("--id", type=_task_id, action="append", dest="ids", metavar="TASK_ID",
                   help="only this task (repeatable)")
    q.add_argument("--rank", type=int_range(1), default=None, metavar="R",
                   help="done tasks whose result rank R committed, whatever its status (their "
                        "results are discarded): a rank that answered wrongly")
    q.add_argument("--since", type=_moment, default=None, metavar="T",
                   help="done tasks whose result was committed at or after T (an ISO 8601 time, "
                        "UTC unless it says otherwise, or seconds since the epoch), whatever its "
                        "status; with --rank, that rank's from then on")

    d = sub.add_parser("db", help="schema maintenance")
    dsub = d.add_subparsers(dest="db_cmd", required=True, metavar="upgrade")
    u = dsub.add_parser("upgrade", help="create or bring a campaign database to the code's "
                                        "schema (same as `alembic -x db=PATH upgrade head`)")
    u.add_argument("--db", type=path_arg, required=True)
    return p


def _moment(text: str) -> float:
    """A point in time for `requeue --since`: seconds since the epoch, or ISO 8601 (UTC
    unless it names its offset)."""
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return value
        # (nan and inf matched no time at all: the command requeued nothing, exit 0)
        raise argparse.ArgumentTypeError(f"{text!r} is not a time (ISO 8601, e.g. "
                                         f"2026-12-01T14:00, or seconds since the epoch)")
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a time (ISO 8601, e.g. "
                                         f"2026-12-01T14:00, or seconds since the epoch)"
                                         ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()


def _inject_spec(text: str) -> dict[str, float]:
    try:
        return parse_inject(text)
    except InjectSpecError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--inject: ")) from None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = sys.stdout
    # A path the file system holds as bytes that are not UTF-8 is printed as those bytes,
    # not a UnicodeEncodeError traceback from the line that names it. (Only a strict UTF-8
    # stdout: stderr already escapes them, and another encoding would fail on other text.)
    if (isinstance(out, io.TextIOWrapper) and out.errors == "strict"
            and out.encoding.lower().replace("-", "") == "utf8"):
        out.reconfigure(errors="surrogateescape")
    ns = _parser().parse_args(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if ns.cmd == "run":
            try:
                with refusing_os_errors():
                    cfg = resolve_run(ns)
                if not under_mpi_launcher():
                    return self_launch(ns, args, cfg)
            except KeyboardInterrupt:
                if under_mpi_launcher():
                    raise
                # Before the launch (from it on, the launcher handles Ctrl-C itself): the
                # checks so far only read.
                print("coordinator: interrupted before the launch; nothing was changed",
                      file=sys.stderr)
                return 128 + signal.SIGINT
            from .runtime import run
            return run(cfg)
        with refusing_os_errors():
            return _command(ns)
    except UsageError as e:
        return refused(str(e), _json_refusal(ns, str(e)))


def _json_refusal(ns: argparse.Namespace, message: str) -> dict | None:
    """What `status --json` and `check --json` print on stdout for a path the system refused
    (a name too long, a directory that cannot be searched), as for a file the store refused."""
    if not getattr(ns, "json", False):
        return None
    if ns.cmd == "check":
        from .commands import check_refusal
        return check_refusal(message)
    return {"error": message}


def _command(ns: argparse.Namespace) -> int:
    """The commands that read (or, `requeue` and `db upgrade`, write) a campaign file."""
    if ns.cmd == "status":
        from .status import status
        with reader_may_leave():  # `status | head`: the reader had enough
            return status(ns.db, ns.json)
        return ExitStatus.OK
    if ns.cmd == "plot":
        from .plot import plot
        return plot(ns.db, ns.outdir)
    from . import commands
    if ns.cmd == "check":
        return commands.check(ns.db, ns.json)
    if ns.cmd == "requeue":
        return commands.requeue(ns)
    if ns.cmd == "db":
        return commands.db_upgrade(ns.db)
    return ExitStatus.USAGE
