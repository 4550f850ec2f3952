"""Rank 0's life: the start (everything that can refuse it), the run, the report, the end.

Everything that can refuse a start (the database, the task file, the executor spec, the output
directory) is checked here before any work moves, and the verdict is sent to each worker, so a
refused start ends every rank with the same clear exit status instead of leaving workers
waiting.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

from store.campaign import Store
from store.errors import DamagedDatabaseError, StoreError, StoreWriteError
from store.imports import (
    DEMO_SOURCE,
    Imported,
    ImportKind,
    file_identity,
    identity_of,
    record_import,
)
from store.journal import RetryPolicy
from store.stats import other_messages_text, read_stats, result_statuses, stats_text
from store.tasks import enqueue_tasks, origins_starting_with

from .config import (
    RunConfig,
    campaign_settings,
    check_resume,
    describe,
    dispatch_batch,
    renewed_settings,
)
from .errors import UsageError
from .exits import ExitStatus
from .launcher import exit_status_path
from .master import (
    NO_RANK_CAN_WORK,
    NO_WORKERS_LEFT,
    LockWaiter,
    Master,
    MasterConfig,
    Summary,
)
from .output import TestcaseWriter, replace_text
from .output_lock import OutputLock, lock_output
from .preflight import check_run, output_directory
from .preflight import writer as test_case_writer
from .processes import STOP_SIGNALS, exit_now, host_and_pid
from .sources import (
    AflQueueSource,
    DemoTasks,
    TasksFile,
    afl_queue_missing,
    demo_tasks,
    load_tasks_jsonl,
)
from .transport import SendFailed, Transport
from .wire import Start, encode

#: A tasks file this large (bytes) takes long enough to read that the start says so.
BIG_TASKS_FILE = 10_000_000
#: The `stop` event's detail when the run ends because its storage failed: not its tasks'
#: doing, so --resume charges nothing for the runs it left in flight (when the event could
#: be written).
STORAGE_STOP = "the campaign file could not be written"
OUTPUT_STOP = "the output directory could not be written"


def run_master_rank(cfg: RunConfig, transport: Transport) -> int:
    return MasterRank(cfg, transport).run()


def _say(text: str) -> None:
    print(f"coordinator: {text}", file=sys.stderr, flush=True)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class MasterRank:
    def __init__(self, cfg: RunConfig, transport: Transport):
        self.cfg, self.transport = cfg, transport
        self.started = time.monotonic()
        self.started_at = time.time()  # the master rank is up: --resume's clock starts here
        self.store: Store | None = None
        self.output_lock: OutputLock | None = None
        self.master: Master | None = None
        #: A stop asked for while the start is still going on (opening the database,
        #: importing a large tasks file): honoured as soon as the master runs.
        self.early_stops: list[str] = []
        #: The tasks file as this start read it (or found it imported unchanged).
        self.tasks_identity: str | None = None
        self.notes: list[str] = []
        self.resolved_argv: list[str] | None = None
        self.host, self.pid = host_and_pid()

    def run(self) -> int:
        self._catch_early_stops()
        self._record_pid()
        try:
            self._start()
        except BaseException as e:
            return self._refuse(e)
        self._tell_workers(Start(status=ExitStatus.OK, executor=self.cfg.executor,
                                 argv=self.resolved_argv, callable=self.cfg.callable_spec,
                                 timeout_s=self.cfg.timeout_s))
        self._announce()
        return self._run()

    # -- the start ---------------------------------------------------------------------------
    def _catch_early_stops(self) -> None:
        def stop_early(signum: int, _frame: object) -> None:
            name = signal.Signals(signum).name
            if self.master is not None:
                self.master.request_stop(name)
            else:
                self.early_stops.append(name)
        for signum in STOP_SIGNALS:
            signal.signal(signum, stop_early)

    def _record_pid(self) -> None:
        """For the self-launching `coordinator run`, which forwards Ctrl-C and SIGTERM here.
        Written atomically: the launcher reads it at any moment, and an empty file means "no
        master yet" there."""
        if self.cfg.master_pid_file is None:
            return
        try:
            replace_text(self.cfg.master_pid_file, f"{os.getpid()}\n")
        except OSError as e:
            _say(f"cannot record the master's pid ({e}); stop the run with "
                 f"`kill -TERM {os.getpid()}`")

    def _start(self) -> None:
        """Everything that can refuse the run, in the order that changes nothing until the
        database is opened; the master is built, holding the campaign's lock."""
        # Refused here, before the database is opened and the workers build their executor
        # from what it resolved.
        checked = check_run(self.cfg)
        cfg = self.cfg = checked.cfg
        self.resolved_argv, self.notes = checked.argv, [*checked.notes]
        initial = self._initial_tasks(checked.known)
        sources = [AflQueueSource(cfg.afl_out, cfg.fuzzer)] if cfg.afl_out is not None else []
        writer = test_case_writer(cfg)
        # Before the database is opened: a start refused here (another campaign writes there,
        # having passed the check before MPI at the same moment as this one) changes nothing
        # in it, and the user can start it again, in a directory of its own, as a new campaign.
        self.output_lock = lock_output(*output_directory(cfg), db=cfg.db)
        self.store = Store.open(
            cfg.db, resume=cfg.resume, synchronous=cfg.synchronous,
            policy=RetryPolicy(cfg.retries, cfg.max_attempts),
            note=f"master pid={self.pid} host={self.host} ranks={self.transport.size}",
            settings=campaign_settings(cfg),
            check_settings=self._check_settings,
            lock_wait_s=cfg.lock_wait_s, on_lock_wait=LockWaiter(cfg.db, cfg.lock_wait_s),
            ranks=self.transport.size)
        if initial is not None:
            self._import(initial)
        self.master = self._make_master(sources, writer)
        if self.early_stops:
            self.master.request_stop(self.early_stops[0])

    def _check_settings(self, stored: dict | None) -> dict:
        """A --resume against what the campaign stores: refused, or noted, and what it
        changes there (written in the start's transaction, so only a start that goes on)."""
        self.notes.extend(check_resume(self.cfg, stored))
        return renewed_settings(self.cfg, stored)

    def _initial_tasks(self, known: Imported | None) -> DemoTasks | TasksFile | None:
        """The tasks this start imports: none of a tasks file an earlier start imported and
        that is unchanged since, only the demo tasks past those already in."""
        cfg = self.cfg
        if cfg.demo is not None:
            start = min(known.count, cfg.demo) if known is not None else 0
            if known is not None and start:
                self.notes.append(
                    f"{start} of {cfg.demo} tasks were already in the campaign (demo tasks "
                    f"imported by incarnation {known.incarnation}) and were not made again"
                    + (f"; {cfg.demo - start} added" if start < cfg.demo else ""))
            return demo_tasks(cfg.demo, start=start) if start < cfg.demo else None
        if cfg.tasks_file is None:
            return None
        if known is not None:
            self.notes.append(
                f"tasks file {cfg.tasks_file} is unchanged since incarnation "
                f"{known.incarnation} imported it ({known.count:,} tasks, all in the "
                f"campaign): not read again")
            self.tasks_identity = known.identity
            return None
        if _size(cfg.tasks_file) >= BIG_TASKS_FILE:
            # Minutes for millions of lines, before the pid line: say what is going on.
            _say(f"reading {_size(cfg.tasks_file) / 1e6:,.0f} MB of tasks from "
                 f"{cfg.tasks_file}...")
        tasks = load_tasks_jsonl(cfg.tasks_file)
        self.tasks_identity = identity_of(tasks.identity)
        return tasks

    def _import(self, initial: DemoTasks | TasksFile) -> None:
        """All or nothing: the initial tasks are imported in one transaction, with the row
        that says so (`store.imports`: a --resume of the same source does not read it)."""
        assert self.store is not None
        if len(initial) >= 100_000:
            _say(f"importing {len(initial):,} tasks in one transaction...")
        with self.store.transaction("import of the initial tasks") as tx:
            added = enqueue_tasks(tx, (i.as_task() for i in initial))
            if isinstance(initial, DemoTasks):
                what = (ImportKind.DEMO, DEMO_SOURCE, None, initial.n)
            else:
                what = (ImportKind.TASKS_FILE, str(initial.path.resolve()),
                        identity_of(initial.identity), len(initial))
            record_import(tx.db, tx.incarnation, tx.now, *what, added=len(added))
        if len(added) < len(initial):
            # A task is its semantic payload: the same payload again (another input_file with
            # the same path included) is the same task, and is not run twice.
            _say(f"{len(initial) - len(added)} of {len(initial)} tasks were already in the "
                 f"campaign or repeated (the same payload) and were not added again")

    def _make_master(self, sources: list[AflQueueSource], writer: TestcaseWriter) -> Master:
        """The master, built before any work moves (the store holds the campaign's lock)."""
        cfg, store = self.cfg, self.store
        assert store is not None
        for source in sources:
            with store.reading() as conn:
                source.remember(origins_starting_with(conn, source.origin_prefix))
        writer.scan()
        if writer.resumed_from_sync is not None:
            instance, counter = writer.resumed_from_sync
            _say(f"AFL instance {instance!r} expects id:{counter:06d} next from {cfg.name!r} "
                 f"({cfg.afl_out}/{instance}/.synced/{cfg.name}), past our files; new test "
                 f"cases are numbered from there, or its sync would import none of them")
        return Master(store, self.transport, MasterConfig(
            max_message_bytes=cfg.max_message_bytes, watchdog_s=cfg.watchdog_s,
            grace_s=cfg.grace_s, stop_wait_s=cfg.stop_wait_s, stats_file=cfg.stats_file,
            stats_interval_s=cfg.stats_interval_s, max_depth=cfg.max_depth,
            feedback=cfg.feedback, exit_when_drained=cfg.afl_out is None,
            progress=cfg.progress, progress_interval_s=cfg.progress_interval_s,
            metrics_file=cfg.metrics_file, stall_grace_s=cfg.stall_grace_s,
            start_wait_s=cfg.start_wait_s, batch=dispatch_batch(cfg.batch, cfg.executor),
            task_timeout_s=cfg.timeout_s if cfg.executor == "command" else math.inf,
        ), sources=[s.poll for s in sources], writer=writer)

    def _refuse(self, e: BaseException) -> int:
        """Whatever stops the start, the workers hear the verdict: they wait for it. A usage
        or storage error is said in a line; anything else is a bug."""
        cfg, store = self.cfg, self.store
        refused = isinstance(e, (StoreError, UsageError, OSError))
        if refused:
            _say(f"{e}")
            # Once the store is open the campaign row exists: a plain start would be refused,
            # and a resume adds only the tasks it is given (no default demo tasks).
            source = (f" --tasks {cfg.tasks_file}" if cfg.tasks_file is not None else
                      f" --demo {cfg.demo}" if cfg.demo is not None else "")
            again = (f" with --resume{source} (tasks already imported are not added twice)"
                     if store is not None else "")
            if isinstance(e, DamagedDatabaseError):
                # A --resume would meet the same page again (and charge what it rolls back).
                _say("stopped before the run; nothing more is written to the damaged file")
            elif isinstance(e, StoreWriteError):
                _say("stopped before the run; nothing is lost — fix the storage and start it "
                     "again" + again)
            elif store is not None:
                _say(f"stopped before the run; the campaign is in {cfg.db}: once fixed, start "
                     f"it again{again}")
        else:
            traceback.print_exc()
            _say("internal error before the run started")
        if store is not None:
            store.close()
        self._release_output(undo=True)
        # A write that failed (disk full) is the storage's fault, not the command line's.
        status = self._record_exit(ExitStatus.STORE if isinstance(e, StoreWriteError) else
                                   ExitStatus.USAGE if refused else ExitStatus.INTERNAL)
        self._tell_workers(Start(status=status))
        if self.transport.fault_tolerant:
            # MPI_Finalize can hang after a rank's death (ompi#11404), which the master may
            # not have seen: under ULFM every rank leaves without it, as at the end of a run.
            exit_now(status)
        # A verdict not taken would hold MPI_Finalize for ever (a rank that never polls:
        # stopped); each rank has --start-wait to come up and take it, as at any start.
        untaken = self.transport.unsettled_sends(wait_s=cfg.start_wait_s)
        if untaken:
            _say(f"ranks {untaken} never took the start verdict; leaving without MPI_Finalize")
            exit_now(status)
        return status

    def _release_output(self, *, undo: bool = False) -> None:
        """For a master run in-process (the tests): the process's end releases it anyway.
        `undo`: a refused start leaves no output directory it made."""
        if self.output_lock is not None:
            self.output_lock.release(undo=undo)
            self.output_lock = None

    def _tell_workers(self, start: Start) -> None:
        """The start verdict to each worker, one send each: a rank that died meanwhile fails
        its own send only (ULFM notes it, and the run goes on without it)."""
        data = encode(start)
        for rank in range(1, self.transport.size):
            try:
                self.transport.send_start(data, rank)
            except SendFailed as e:
                _say(f"rank {rank} cannot be told the start verdict ({e.cause}); it is left out")

    def _announce(self) -> None:
        cfg, store = self.cfg, self.store
        assert store is not None
        workers = self.transport.size - 1
        _say(f"master pid {self.pid} on {self.host}, {workers} worker{'s' * (workers != 1)}, "
             f"{describe(cfg)}; stop gracefully with `kill -TERM {self.pid}`"
             # Only the self-launcher turns Ctrl-C into that; under the user's own mpiexec a
             # Ctrl-C reaches the launcher, which ends the job at once.
             f"{' (or Ctrl-C)' if cfg.master_pid_file is not None else ''}")
        report = store.resume_report
        if cfg.resume and store.incarnation == 1:
            _say(f"--resume: {cfg.db} held no campaign yet; this starts a new one")
        elif cfg.resume:
            _say(f"resumed incarnation {store.incarnation}: {len(report.interrupted)} "
                 f"interrupted and {len(report.reclaimed)} deferred tasks first in the queue; "
                 f"{len(report.refused)} deferred tasks whose input is gone stay deferred")
        for note in self.notes:
            _say(f"note: {note}")
        if cfg.afl_out is not None and (note := afl_queue_missing(cfg.afl_out, cfg.fuzzer)):
            _say(note)

    # -- the run and its end -------------------------------------------------------------------
    def _run(self) -> int:
        assert self.master is not None
        try:
            summary = self.master.run()
        except DamagedDatabaseError as e:
            # Every later round, and every --resume, would meet the same page: each resume
            # had charged an attempt to every task it found in flight before it did. The
            # round that met it rolled back (its WORK never left); what was sent before is
            # recorded in the file, so the job ends without another write to it.
            print(f"coordinator: {e}", file=sys.stderr, flush=True)
            _say("stopped without writing to the damaged file again: do not --resume it; "
                 "a --resume of a restored or recovered copy goes on from what it holds")
            return self._end_job(self._record_exit(ExitStatus.USAGE))
        except StoreWriteError as e:
            # A failed COMMIT has an unknown outcome: stop, and let restart recovery decide.
            print(f"coordinator: {e}", file=sys.stderr, flush=True)
            self._record_stop(STORAGE_STOP)
            _say("stopped; nothing is lost — fix the storage and continue with --resume")
            return self._end_job(self._record_exit(ExitStatus.STORE))
        except StoreError as e:
            # The file changed under the run (its schema, by hand): the round that met it
            # rolled back.
            print(f"coordinator: {e}", file=sys.stderr, flush=True)
            _say("stopped; nothing is lost — continue with --resume once the file is fixed")
            return self._end_job(self._record_exit(ExitStatus.STORE))
        except OSError as e:
            # Test cases could not be written (disk full, read-only output): the round that
            # wanted them rolled back, so its task runs again after --resume.
            _say(f"cannot write output: {e}")
            self._record_stop(OUTPUT_STOP)
            _say("stopped; nothing is lost — free space or fix the output directory and "
                 "continue with --resume")
            return self._end_job(self._record_exit(ExitStatus.STORE))
        except BaseException:
            # Anything unhandled aborts the job instead of leaving the workers waiting for
            # ever; the database holds every committed transition, so --resume continues.
            traceback.print_exc()
            _say("internal error; the campaign is saved, continue with --resume")
            return self._end_job(self._record_exit(ExitStatus.INTERNAL))
        return self._report(summary)

    def _say_tasks_file_changed(self) -> None:
        """The tasks file is read at the start only: lines a generator appended while the
        run went are in no task yet, and the run ended as if drained without a word."""
        if self.cfg.tasks_file is None or self.tasks_identity is None:
            return
        try:
            _, now = file_identity(self.cfg.tasks_file)
        except OSError:
            return  # gone or unreadable: the next start that names it says so
        if now != self.tasks_identity:
            _say(f"tasks file {self.cfg.tasks_file} changed since this start read it: lines "
                 f"added to it are in no task of this run; `--resume --tasks "
                 f"{self.cfg.tasks_file}` adds them")

    def _record_stop(self, why: str) -> None:
        """Best effort: the storage that failed may refuse this write too (the runs left in
        flight are then charged an attempt at --resume, as after a crash)."""
        assert self.master is not None
        with contextlib.suppress(Exception):  # (the first failure is the one reported)
            self.master.record_stop(why)

    def _report(self, summary: Summary) -> int:
        cfg, store, master = self.cfg, self.store, self.master
        assert store is not None and master is not None
        with store.reading() as conn:
            s = read_stats(conn)
            by_status = result_statuses(conn)
        # (Asked again here: the name may have gone since the master's last look.)
        lost = master.file_lost or store.lost_name()
        saved = store.close(rescue=lost is not None)
        self._release_output()
        if lost is not None:
            _say(f"{lost} while the master ran: the campaign, everything committed in it, was "
                 f"copied to {saved}" + ("" if saved == Path(cfg.db) else
                                         " (something else has the name now; the copy is a "
                                         "whole campaign: move it to a name of its own, then "
                                         "--resume --db it)"))
        commits = store.commit_times
        elapsed = time.monotonic() - self.started
        t = s.tasks
        print(stats_text(s), end="", file=sys.stderr)
        if (other := other_messages_text(s)) is not None:
            print(other, file=sys.stderr)
        not_ok = ", ".join(f"{n} {st}" for st, n in sorted(by_status.items()) if st != "ok")
        if not_ok:
            not_ok += (": see `coordinator status`; once fixed, `coordinator requeue --state "
                       "error` runs them again")
        left = t["queued"] + t["active"] + t["deferred"]
        # A script must not take "every worker died" for "done": exit 0 means nothing is
        # waiting for a worker (an AFL watch never finishes, so losing its workers is never
        # clean).
        stranded = summary.stopped_by_signal == NO_WORKERS_LEFT and bool(
            left or cfg.afl_out is not None)
        status = (ExitStatus.STORE if lost is not None else
                  ExitStatus.NO_WORKERS if stranded else
                  ExitStatus.STALLED if summary.stopped_by_signal == NO_RANK_CAN_WORK else
                  ExitStatus.OK)
        rate = summary.committed / max(summary.elapsed_s, 1e-9)
        print(f"coordinator: this run committed {summary.committed} results in {elapsed:.1f} s "
              f"({rate:,.0f} tasks/s in the loop; {summary.rounds} rounds, "
              f"{summary.transactions} transactions; master peak RSS {peak_rss_mib():.0f} MiB); "
              f"campaign: {t['done']} done, {t['queued']} queued, {t['deferred']} deferred, "
              f"{t['failed']} failed, {s.results} results{f' ({not_ok})' if not_ok else ''}"
              f"{_dropped(s)}"
              f"{'; continue it with --resume' if left else ''}; "
              + (f"stats in {cfg.stats_file}" if master.stats_error is None else
                 f"the stats file {cfg.stats_file} could not be written "
                 f"({master.stats_error})"), flush=True)
        self._say_tasks_file_changed()
        if cfg.summary_json is not None:
            self._write_summary({
                "tasks": t, "results": s.results, "committed_this_run": summary.committed,
                "loop_s": summary.elapsed_s, "total_s": elapsed, "tasks_per_s": rate,
                "rounds": summary.rounds, "transactions": summary.transactions,
                "dispatches": summary.dispatches,
                "commits_per_task": summary.transactions / max(summary.committed, 1),
                "master_peak_rss_mib": peak_rss_mib(), "workers": self.transport.size - 1,
                "master_cpu_s": cpu_s(), "loop_cpu_s": summary.cpu_s, "started_at": self.started_at,
                "first_work_at": summary.first_work_at, "last_commit_at": summary.last_commit_at,
                "synchronous": cfg.synchronous, "stopped_by_signal": summary.stopped_by_signal,
                # The disk's share: a COMMIT at FULL waits for its fsync, and the master waits
                # with it (a slow disk shows here, not in the CPU time).
                "commits": commits.count, "commit_s": commits.total_s,
                "commit_max_s": commits.max_s,
            })
        if summary.unacked_ranks:
            _say(f"ranks {summary.unacked_ranks} did not acknowledge STOP; ending the job (the "
                 f"campaign is saved)")
            return self._end_job(self._record_exit(
                status if summary.stopped_by_signal else ExitStatus.UNACKED), stop_first=False)
        self._record_exit(status)
        # Every rank acknowledged its STOP, so each took its last WORK: none is left to wait
        # for, unless something is wrong, and then MPI_Finalize could wait on it for ever.
        untaken = self.transport.unsettled_sends(wait_s=1.0)
        if untaken:
            _say(f"the WORK sent to ranks {untaken} was never taken although they acknowledged "
                 f"their STOP; leaving without MPI_Finalize (the campaign is saved)")
        if self.transport.fault_tolerant or self.transport.any_failed or untaken:
            # Under ULFM, MPI_Finalize can hang every survivor after a failure (ompi#11404);
            # everything is committed and every worker has gone, so leave without it.
            exit_now(status)
        return status

    def _write_summary(self, summary: dict) -> None:
        """The run's summary for scripts. Its directory was checked at start; if the write
        fails anyway (a full disk), say so: the campaign itself is in the database."""
        path = self.cfg.summary_json
        assert path is not None
        try:
            replace_text(path, json.dumps(summary, indent=2) + "\n")
        except OSError as e:
            _say(f"cannot write --summary-json {path}: {e.strerror or e} (the campaign is in "
                 f"the database: `coordinator status --json`)")

    def _record_exit(self, status: ExitStatus) -> ExitStatus:
        pid_file = self.cfg.master_pid_file
        if pid_file is not None:
            try:
                replace_text(exit_status_path(pid_file), f"{int(status)}\n")
            except OSError as e:  # the launcher will say the master gave no status: say why
                _say(f"cannot record the exit status {int(status)} for the launcher ({e})")
        return status

    def _end_job(self, status: ExitStatus, *, stop_first: bool = True) -> int:
        """End the whole job from the master after saving everything.

        Without ULFM, MPI_Abort does it, once the workers on this host that may still run a
        command were fenced (see `Master.fence`). Under ULFM it does not (the launcher treats
        the master's exit as one more process failure and the others wait on), so the master
        asks every live worker to STOP without finalizing, then fences the ranks on this host
        that did not acknowledge (hung ones), by the pid each reported in its READY, and
        exits."""
        master, transport = self.master, self.transport
        assert master is not None
        if not transport.fault_tolerant:
            # MPI_Abort ends the ranks, not the commands they run (each in a session of its
            # own): the ranks on this host that may still run one are told to end theirs first.
            master.fence(master.live_workers() if stop_first else master.summary.unacked_ranks)
            transport.abort(status)
            return status
        unacked = master.stop_workers_now() if stop_first else master.summary.unacked_ranks
        fenced = master.fence(unacked)
        if fenced:
            _say(f"killed unresponsive ranks {fenced}")
        if set(unacked) - set(fenced):
            _say(f"ranks {sorted(set(unacked) - set(fenced))} did not stop and cannot be killed "
                 f"from here (on another host, or no READY ever reported their pid); end the job "
                 f"with your launcher")
        exit_now(status)


def _dropped(s) -> str:
    if not s.dropped_testcases:
        return ""
    return (f", {s.dropped_testcases} test cases dropped over the limits in "
            f"{s.dropped_results} results (`coordinator status`)")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # the reader reports it
