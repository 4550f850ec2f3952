"""One process of the job: rank 0 becomes the master, every other rank a worker.

Everything that can refuse to start (the database, the task file, the executor spec) is
checked on rank 0 before any work moves, and the verdict is broadcast, so a refused start
ends every rank with the same clear exit status instead of leaving workers waiting forever.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from .config import RunConfig
from .executors import proc_stat
from .output import replace_text

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_STORE = 3  # the database failed under us: stopped, restart with --resume
EXIT_INTERNAL = 5  # a bug: the job is aborted, the database is consistent
EXIT_NO_WORKERS = 6  # every worker died with work left: saved, continue with --resume
EXIT_UNACKED = 4  # finished on its own, but a rank never acknowledged STOP (hung): ended


def run(cfg: RunConfig) -> int:
    from .transport import Transport
    transport = Transport()
    if transport.size < 2:
        print("coordinator: needs at least 2 ranks (1 master + workers); start it with "
              "`mpiexec -n N` or let `coordinator run` launch itself (--np N)",
              file=sys.stderr)
        return EXIT_USAGE
    if transport.rank == 0:
        return _master(cfg, transport)
    return _worker(cfg, transport)


#: A tasks file this large (bytes) takes long enough to read that the start says so.
BIG_TASKS_FILE = 10_000_000


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # the reader reports it


def peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _write_summary(path: Path, summary: dict) -> None:
    """The run's summary for scripts. Its directory was checked at start; if the write fails
    anyway (a full disk), say so: the campaign itself is in the database."""
    try:
        replace_text(path, json.dumps(summary, indent=2) + "\n")
    except OSError as e:
        print(f"coordinator: cannot write --summary-json {path}: {e.strerror or e} (the "
              f"campaign is in the database: `coordinator status --json`)", file=sys.stderr,
              flush=True)


def _leave_it_to_the_master(_signum: int, _frame: object) -> None:
    pass


def _worker(cfg: RunConfig, transport) -> int:
    from .transport import StartInterrupted, worker_spin_default
    from .worker import TEARDOWN_SIGNAL, Sender, serve, torn_down
    # The master decides when the job stops: a terminal's Ctrl-C, or a batch system's SIGTERM
    # when the job is cancelled or out of time, reaches every rank, and the workers go on
    # with their tasks through the grace period. Caught by a handler that does nothing, not
    # ignored: an ignored signal stays ignored across exec, and the targets the command
    # executor starts could then not be stopped by Ctrl-C or SIGTERM at all.
    signal.signal(signal.SIGINT, _leave_it_to_the_master)
    signal.signal(signal.SIGTERM, _leave_it_to_the_master)
    signal.signal(TEARDOWN_SIGNAL, torn_down)  # the master gave up on this rank
    try:
        verdict = transport.bcast(None)
        if not isinstance(verdict, dict):  # the master refused to start: its exit status
            if transport.fault_tolerant:
                # The master refused to start and leaves without MPI_Finalize, which can hang
                # under ULFM after any rank's death (ompi#11404); the workers do the same.
                _exit_now(int(verdict))
            return int(verdict)
        executor = _executor(cfg, verdict.get("argv"))
        sender = Sender(transport, cfg.max_message_bytes)
        if cfg.inject:
            from .faults import FaultPlan, FaultySender
            sender = FaultySender(transport, FaultPlan(cfg.inject, cfg.inject_seed,
                                                       cfg.inject_log), cfg.max_message_bytes)
        spin_s = (cfg.worker_spin_ms / 1000 if cfg.worker_spin_ms is not None
                  else worker_spin_default())
        return serve(transport, executor, sender=sender, spin_s=spin_s)
    except StartInterrupted as e:  # nothing of this rank's own went wrong: no traceback
        _leave_job(transport, f"a rank left the job before this one had the start verdict: "
                              f"{e}")
        raise  # not reached
    except BaseException:
        _leave_job(transport)
        raise  # not reached


def _executor(cfg: RunConfig, argv: list[str] | None = None):
    """`argv`: the command as the master resolved it, so that every worker runs the program
    the master checked (a bare name on another node's PATH could be another binary)."""
    from .executors import make_executor
    return make_executor(cfg.executor, argv=argv or cfg.argv, callable_spec=cfg.callable_spec,
                         timeout_s=cfg.timeout_s, demo_work_ms=cfg.demo_work_ms,
                         max_message_bytes=cfg.max_message_bytes)


def _leave_job(transport, why: str | None = None) -> None:
    """A worker that cannot go on (its executor does not load here, another rank died during
    the start-up broadcast, a bug) must not return into MPI_Finalize: that waits for ranks
    that will never finalize, spinning, and the master is never told. Under ULFM it exits
    without finalizing, which the master sees as this rank's death (its task goes back to the
    queue, the run goes on with the others; only a zero exit status keeps Open MPI's launcher
    from ending the whole job). Without ULFM a rank's exit ends the job anyway: abort it."""
    # The one line first: it must reach the terminal even if the traceback does not.
    print(f"coordinator: rank {transport.rank} cannot go on and leaves the job "
          + (f"({why}; " if why else "(") + "the master returns any task it held to the queue)",
          file=sys.stderr, flush=True)
    if why is None:  # a known cause needs no traceback
        traceback.print_exc()
    if transport.fault_tolerant:
        _exit_now(0)
    _abort_job(transport, EXIT_INTERNAL)


def _abort_job(transport, status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.5)  # MPICH's launcher drops output not yet forwarded when the job aborts
    transport.abort(status)


def _master(cfg: RunConfig, transport) -> int:
    from store.campaign import Store
    from store.errors import StoreError, StoreWriteError
    from store.journal import RetryPolicy
    from store.stats import read_stats, result_statuses, stats_text
    from store.tasks import enqueue_tasks

    from .cli import describe
    from .config import DEFAULT_DEMO_TASKS, campaign_settings, check_resume
    from .master import NO_WORKERS_LEFT
    from .sources import TaskFileError, afl_queue_missing, demo_tasks, load_tasks_jsonl
    from .transport import host_and_pid

    started = time.monotonic()
    store = None
    master = None
    # A stop asked for while the start is still going on (opening the database, importing a
    # large tasks file) is kept, and honoured as soon as the master runs: the start completes
    # (it is one transaction) and the run stops at once, gracefully.
    early_stops: list[str] = []

    def stop_early(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if master is not None:
            master.request_stop(name)
        else:
            early_stops.append(name)
    signal.signal(signal.SIGINT, stop_early)
    signal.signal(signal.SIGTERM, stop_early)
    if cfg.master_pid_file is not None:
        # The self-launching `coordinator run` forwards Ctrl-C and SIGTERM here.
        try:
            # Atomically: the launcher reads it at any moment, and an empty file means
            # "no master yet" there.
            replace_text(cfg.master_pid_file, f"{os.getpid()}\n")
        except OSError as e:
            print(f"coordinator: cannot record the master's pid ({e}); stop the run with "
                  f"`kill -TERM {os.getpid()}`", file=sys.stderr, flush=True)
    try:
        # Refused here, before the workers build theirs from what it resolved.
        resolved = getattr(_executor(cfg), "argv", None)
        if cfg.tasks_file is not None and _size(cfg.tasks_file) >= BIG_TASKS_FILE:
            # Minutes for millions of lines, before the pid line: say what is going on.
            print(f"coordinator: reading {_size(cfg.tasks_file) / 1e6:,.0f} MB of tasks from "
                  f"{cfg.tasks_file}...", file=sys.stderr, flush=True)
        initial = (demo_tasks(cfg.demo) if cfg.demo is not None else
                   load_tasks_jsonl(cfg.tasks_file) if cfg.tasks_file is not None else [])
        outputs = _outputs(cfg)  # checked before the database is touched
        host, pid = host_and_pid()
        notes: list[str] = []
        store = Store.open(cfg.db, resume=cfg.resume, synchronous=cfg.synchronous,
                           policy=RetryPolicy(cfg.retries, cfg.max_attempts),
                           note=f"master pid={pid} host={host} ranks={transport.size}",
                           settings=campaign_settings(cfg),
                           check_settings=lambda stored: notes.extend(check_resume(cfg, stored)))
        if (cfg.resume and store.incarnation == 1 and cfg.demo is None
                and cfg.tasks_file is None and cfg.afl_out is None
                and cfg.executor != "command"):  # (demo tasks have no input to run it on)
            initial = demo_tasks(DEFAULT_DEMO_TASKS)  # a new campaign: the embedded default
            cfg = dataclasses.replace(cfg, demo=DEFAULT_DEMO_TASKS)  # (as `describe` says)
        if initial:
            if len(initial) >= 100_000:
                print(f"coordinator: importing {len(initial):,} tasks in one transaction...",
                      file=sys.stderr, flush=True)
            # All or nothing: a tasks file is imported in one transaction.
            with store.transaction("import of the initial tasks") as tx:
                added = enqueue_tasks(tx, (i.as_task() for i in initial))
            if len(added) < len(initial):
                # A task is its semantic payload: the same payload again (another input_file
                # with the same path included) is the same task, and is not run twice.
                print(f"coordinator: {len(initial) - len(added)} of {len(initial)} tasks were "
                      f"already in the campaign or repeated (the same payload) and were not "
                      f"added again",
                      file=sys.stderr, flush=True)
        initial = None  # they are in the database now: not held through the whole run
        master = _make_master(cfg, store, transport, outputs)
        if early_stops:
            master.request_stop(early_stops[0])
    except BaseException as e:
        # Whatever stops the start, the workers hear the verdict: they wait in the broadcast.
        refused = isinstance(e, (StoreError, TaskFileError, ValueError, OSError))
        if refused:
            print(f"coordinator: {e}", file=sys.stderr, flush=True)
            # Once the store is open the campaign row exists: a plain start would be refused,
            # and a resume adds only the tasks it is given (no default demo tasks).
            source = (f" --tasks {cfg.tasks_file}" if cfg.tasks_file is not None else
                      f" --demo {cfg.demo}" if cfg.demo is not None else "")
            again = (f" with --resume{source} (tasks already imported are not added twice)"
                     if store is not None else "")
            if isinstance(e, StoreWriteError):
                print("coordinator: stopped before the run; nothing is lost — fix the storage "
                      "and start it again" + again, file=sys.stderr, flush=True)
            elif store is not None:
                print(f"coordinator: stopped before the run; the campaign is in {cfg.db}: "
                      f"once fixed, start it again{again}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
            print("coordinator: internal error before the run started", file=sys.stderr,
                  flush=True)
        if store is not None:
            store.close()
        # A write that failed (disk full) is the storage's fault, not the command line's.
        status = _record_exit(cfg, EXIT_STORE if isinstance(e, StoreWriteError) else
                              EXIT_USAGE if refused else EXIT_INTERNAL)
        transport.bcast(status)
        if transport.fault_tolerant:
            # MPI_Finalize can hang after a rank's death (ompi#11404), which a worker may
            # have seen in the broadcast without the master knowing: under ULFM every rank
            # leaves without it, as at the end of a run.
            _exit_now(status)
        return status
    transport.bcast({"argv": resolved})
    workers = transport.size - 1
    print(f"coordinator: master pid {pid} on {host}, {workers} worker{'s' * (workers != 1)}, "
          f"{describe(cfg)}; stop gracefully with `kill -TERM {pid}`"
          # Only the self-launcher turns Ctrl-C into that; under the user's own mpiexec a
          # Ctrl-C reaches the launcher, which ends the job at once.
          f"{' (or Ctrl-C)' if cfg.master_pid_file is not None else ''}",
          file=sys.stderr, flush=True)

    report = store.resume_report
    if cfg.resume and store.incarnation == 1:
        print(f"coordinator: --resume: {cfg.db} held no campaign yet; this starts a new one",
              file=sys.stderr, flush=True)
    elif cfg.resume:
        print(f"coordinator: resumed incarnation {store.incarnation}: "
              f"{len(report.interrupted)} interrupted and {len(report.reclaimed)} deferred "
              f"tasks first in the queue; {len(report.refused)} deferred tasks whose input is "
              f"gone stay deferred", file=sys.stderr, flush=True)
    for note in notes:
        print(f"coordinator: note: {note}", file=sys.stderr, flush=True)
    if cfg.afl_out is not None and (note := afl_queue_missing(cfg.afl_out, cfg.fuzzer)):
        print(f"coordinator: {note}", file=sys.stderr, flush=True)
    try:
        summary = master.run()
    except StoreWriteError as e:
        # A failed COMMIT has an unknown outcome: stop, and let restart recovery decide.
        print(f"coordinator: {e}\ncoordinator: stopped; nothing is lost — fix the storage "
              f"and continue with --resume", file=sys.stderr, flush=True)
        return end_job(transport, master, _record_exit(cfg, EXIT_STORE))
    except OSError as e:
        # Test cases could not be written (disk full, read-only output): the round that
        # wanted them rolled back, so its task runs again after --resume.
        print(f"coordinator: cannot write output: {e}\ncoordinator: stopped; nothing is lost "
              f"— free space or fix the output directory and continue with --resume",
              file=sys.stderr, flush=True)
        return end_job(transport, master, _record_exit(cfg, EXIT_STORE))
    except BaseException:
        # Anything unhandled aborts the job instead of leaving the workers waiting for ever;
        # the database holds every committed transition, so --resume continues from there.
        traceback.print_exc()
        print("coordinator: internal error; the campaign is saved, continue with --resume",
              file=sys.stderr, flush=True)
        return end_job(transport, master, _record_exit(cfg, EXIT_INTERNAL))
    with store.reading() as conn:
        s = read_stats(conn)
        by_status = result_statuses(conn)
    store.close()
    elapsed = time.monotonic() - started
    t = s.tasks
    print(stats_text(s), end="", file=sys.stderr)
    not_ok = ", ".join(f"{n} {st}" for st, n in sorted(by_status.items()) if st != "ok")
    if not_ok:
        not_ok += (": see `coordinator status`; once fixed, `coordinator requeue --state error` "
                   "runs them again")
    left = t["queued"] + t["active"] + t["deferred"]
    # A script must not take "every worker died" for "done": exit 0 means nothing is waiting
    # for a worker (an AFL watch never finishes, so losing its workers is never clean).
    stranded = summary.stopped_by_signal == NO_WORKERS_LEFT and bool(
        left or cfg.afl_out is not None)
    status = EXIT_NO_WORKERS if stranded else EXIT_OK
    print(f"coordinator: this run committed {summary.committed} results in {elapsed:.1f} s "
          f"({summary.committed / max(summary.elapsed_s, 1e-9):,.0f} tasks/s in the loop; "
          f"{summary.rounds} rounds, {summary.transactions} transactions; master peak RSS "
          f"{peak_rss_mib():.0f} MiB); campaign: {t['done']} done, {t['queued']} queued, "
          f"{t['deferred']} deferred, {t['failed']} failed, {s.results} results"
          f"{f' ({not_ok})' if not_ok else ''}"
          f"{'; continue it with --resume' if left else ''}; "
          + (f"stats in {cfg.stats_file}" if master.stats_error is None else
             f"the stats file {cfg.stats_file} could not be written ({master.stats_error})"),
          flush=True)
    if cfg.summary_json is not None:
        _write_summary(cfg.summary_json, {
            "tasks": t, "results": s.results, "committed_this_run": summary.committed,
            "loop_s": summary.elapsed_s, "total_s": elapsed,
            "tasks_per_s": summary.committed / max(summary.elapsed_s, 1e-9),
            "rounds": summary.rounds, "transactions": summary.transactions,
            "commits_per_task": summary.transactions / max(summary.committed, 1),
            "master_peak_rss_mib": peak_rss_mib(), "workers": transport.size - 1,
            "synchronous": cfg.synchronous, "stopped_by_signal": summary.stopped_by_signal,
        })
    if summary.unacked_ranks:
        print(f"coordinator: ranks {summary.unacked_ranks} did not acknowledge STOP; "
              f"ending the job (the campaign is saved)", file=sys.stderr, flush=True)
        return end_job(transport, master, _record_exit(
            cfg, status if summary.stopped_by_signal else EXIT_UNACKED), stop_first=False)
    _record_exit(cfg, status)
    if transport.fault_tolerant or transport.any_failed:
        # Under ULFM, MPI_Finalize can hang every survivor after a failure (ompi#11404);
        # everything is committed and every worker has gone, so leave without it.
        _exit_now(status)
    return status


def _outputs(cfg: RunConfig) -> tuple[list, object]:
    """The AFL source and the test-case writer; raises (a refusal) if the output directory or
    the AFL layout cannot be used. Neither creates nor removes anything, so a refusal changes
    nothing (the writer reads its directory in `_make_master`, under the campaign's lock)."""
    from .output import TestcaseWriter
    from .sources import AflQueueSource
    if cfg.afl_out is not None:
        return ([AflQueueSource(cfg.afl_out, cfg.fuzzer)],
                TestcaseWriter(cfg.afl_out / cfg.name / "queue", afl_style=True, scan=False,
                               afl_sync=(cfg.afl_out, cfg.name)))
    return [], TestcaseWriter(cfg.out or cfg.db.with_name(cfg.db.name + ".out"),
                              afl_style=False, scan=False)


def _make_master(cfg: RunConfig, store, transport, outputs: tuple[list, object]):
    """The master, built before any work moves (the store holds the campaign's lock)."""
    from store.tasks import origins_starting_with

    from .master import Master, MasterConfig
    sources, writer = outputs
    for source in sources:
        with store.reading() as conn:
            source.remember(origins_starting_with(conn, source.origin_prefix))
    writer.scan()
    if writer.resumed_from_sync is not None:
        instance, counter = writer.resumed_from_sync
        print(f"coordinator: AFL instance {instance!r} expects id:{counter:06d} next from "
              f"{cfg.name!r} ({cfg.afl_out}/{instance}/.synced/{cfg.name}), past our files; new "
              f"test cases are numbered from there, or its sync would import none of them",
              file=sys.stderr, flush=True)
    return Master(store, transport, MasterConfig(
        max_message_bytes=cfg.max_message_bytes, watchdog_s=cfg.watchdog_s,
        grace_s=cfg.grace_s, stop_wait_s=cfg.stop_wait_s, stats_file=cfg.stats_file,
        stats_interval_s=cfg.stats_interval_s, max_depth=cfg.max_depth, feedback=cfg.feedback,
        exit_when_drained=cfg.afl_out is None, progress=cfg.progress,
    ), sources=[s.poll for s in sources], writer=writer)


#: How far a process's start time read from /proc (whole-second boot time, clock ticks) may
#: lie past the wall-clock time of something the process did.
CLOCK_SLACK_S = 2.0


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
    return boot + int(fields[22 - 3]) / os.sysconf("SC_CLK_TCK")  # field 22: start time


def process_exists(pid: int) -> bool:
    """On this host; a process we may not signal exists all the same."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_status_path(pid_file: Path) -> Path:
    """Where the master of a self-launched job records the status it ends with, beside its
    pid. The launcher reports that status, not mpiexec's, which is the first rank's to end
    abnormally (128 + SIGUSR2 for a hung rank the master ended) or, under ULFM, often 0."""
    return pid_file.with_name(pid_file.name + ".exit")


def _record_exit(cfg: RunConfig, status: int) -> int:
    if cfg.master_pid_file is not None:
        try:
            replace_text(exit_status_path(cfg.master_pid_file), f"{status}\n")
        except OSError as e:  # the launcher will say the master gave no status: say why
            print(f"coordinator: cannot record the exit status {status} for the launcher "
                  f"({e})", file=sys.stderr, flush=True)
    return status


def _exit_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def end_job(transport, master, status: int, *, stop_first: bool = True) -> int:
    """End the whole job from the master after saving everything.

    Without ULFM, MPI_Abort does it, once the workers on this host that may still run a
    command were fenced (see `Master.fence`). Under ULFM it does not (the launcher treats the
    master's exit as one more process failure and the others wait on), so the master asks
    every live worker to STOP without finalizing, then fences the ranks on this host that did
    not acknowledge (hung ones), by the pid each reported in its READY, and exits."""
    if not transport.fault_tolerant:
        # MPI_Abort ends the ranks, not the commands they run (each in a session of its own):
        # the ranks on this host that may still run one are told to end theirs first.
        master.fence(master.live_workers() if stop_first else master.summary.unacked_ranks)
        _abort_job(transport, status)
        return status
    unacked = master.stop_workers_now() if stop_first else master.summary.unacked_ranks
    fenced = master.fence(unacked)
    if fenced:
        print(f"coordinator: killed unresponsive ranks {fenced}", file=sys.stderr, flush=True)
    if set(unacked) - set(fenced):
        print(f"coordinator: ranks {sorted(set(unacked) - set(fenced))} did not stop and cannot "
              f"be killed from here (on another host, or no READY ever reported their pid); "
              f"end the job with your launcher", file=sys.stderr, flush=True)
    _exit_now(status)
    return status  # not reached
