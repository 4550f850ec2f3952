"""The master rank: the five phases of a round, in the protocol's order (docs/protocol.md §3), over
the durable store.

    drain READY -> dispatch to idle ranks -> drain RESULT -> recovery sweep -> watchdog sweep

A round is one transaction (group commit). Answers that arrive while it is open join it: the
READY and RESULT phases are applied again for them, in that order, before the sweeps, so the
round's COMMIT carries every answer that came in within `linger_s` while the store work for
the first ones was already being done. Every dispatch is committed before its WORK is sent; a
WORK that fails to leave is compensated pre-send in the next transaction, and the sends that
did leave are marked there, so a rollback afterwards is post-send.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import socket
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from store import dispatches as dsp
from store import tasks as task_ops
from store.campaign import Store
from store.engine import write_lock_holders
from store.errors import StoreError
from store.journal import Tx
from store.observe import record_salvaged
from store.schema import Channel, EventKind, QuarantineReason, TaskState, WorkerState
from store.semantic import content_hash
from store.stats import REFUSED_DETAIL, other_messages_text, stats_text
from store.workers import (
    idle_ranks,
    note_unrun,
    parked_detail,
    ranks_in_state,
    set_workers,
    where_they_run,
    worker_states,
)

from .batching import AutoBatch
from .cooldown import HostCooldown
from .expected_answers import ExpectedAnswers
from .gate import NOT_RUN_REASON_CHARS, Gate, Inbound, Stray
from .observer import Observer
from .output import TestcaseWriter, input_id, replace_text
from .pauses import LoopGaps
from .processes import STOP_SIGNALS, describe_process, fence, process_exists
from .progress import Progress, Snapshot, stats_fields
from .protocol import ReadyStatus, ResultStatus, mint_token
from .sources import NewInput
from .transport import ANY_TAG, Backoff, Received, SendFailed, Transport
from .wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ENCODE_ERRORS,
    MAX_SMALL_MESSAGE_BYTES,
    TAG_READY,
    TAG_RESULT,
    TAG_STOP_ACK,
    TAG_WORK,
    BatchTask,
    Result,
    Stop,
    Work,
    check_result,
    decode_inbound,
    decode_ready,
    decode_result,
    encode,
    failure_detail,
    for_terminal,
    held_bound,
    oversized,
)

_STOP_SIGNAL_NAMES = frozenset(signal.Signals(s).name for s in STOP_SIGNALS)

log = logging.getLogger(__name__)

#: `Summary.stopped_by_signal` when every worker died (ULFM): not a stop anyone asked for.
NO_WORKERS_LEFT = "no workers left"
#: ... and when no live rank could take work for `stall_grace_s` (every one parked).
NO_RANK_CAN_WORK = "no rank can take work"
#: How long a rank that answered counts as able to run tasks while its READY is awaited
#: (`Master._able`).
ANSWERED_ABLE_S = 5.0
#: How long the master waits for its own stop signal when a worker says a signal that stops
#: the job cut a run short (`interrupted`) before the master got it: one job's processes on
#: several nodes are signalled moments apart, and the run is charged unless the master stops.
STOP_SIGNAL_WAIT_S = 2.0
CAMPAIGN_FILE_LOST = "the campaign file lost its name"


_OUTCOME_WORDS = {TaskState.QUEUED: "goes back to the queue", TaskState.DEFERRED: "is deferred",
                  TaskState.FAILED: "failed (attempts used up)"}


@dataclass
class MasterConfig:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    watchdog_s: float = 0.0          # 0: no per-dispatch deadline
    grace_s: float = 10.0            # after a stop signal: let in-flight work finish
    stop_wait_s: float = 10.0        # bounded wait for READY and STOP_ACK from every worker
    stats_file: Path | None = None
    stats_interval_s: float = 60.0
    max_depth: int = 0               # feedback loop depth limit, 0 = unlimited
    feedback: bool = True            # test cases found by results become new tasks
    exit_when_drained: bool = True   # --demo/--tasks: stop when nothing is queued or active
    source_interval_s: float = 1.0
    progress: bool = False           # the live display (a terminal at the far end)
    progress_interval_s: float = 0.0  # plain progress lines on stderr, 0: none
    observe_interval_s: float = 10.0  # observation rows, rank loads and the metrics file
    busy_window_s: float = 300.0      # the ranks' busy fraction is over this long
    metrics_file: Path | None = None
    linger_s: float = 0.0005         # group commit: hold a round open this long for more answers
    stall_grace_s: float = 120.0     # no rank can take work this long: the run ends
    start_wait_s: float = 60.0       # a rank silent this long after the start is lost
    batch: int | None = 1            # tasks per dispatch; None: sized from the task time
    # The command's --timeout: a `timeout` answer sooner than half of it per run timed out is
    # no honest worker's (0: not checked; inf: the executor has none, so none is).
    task_timeout_s: float = 0.0


@dataclass
class Summary:
    rounds: int = 0
    transactions: int = 0
    committed: int = 0
    dispatches: int = 0  # WORK messages sent (a batch's tasks go in one)
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # the master's CPU time in the loop
    first_work_at: float | None = None  # time.time() when this run's first WORK left
    last_commit_at: float | None = None  # time.time() when this run last committed a result
    stopped_by_signal: str | None = None
    unacked_ranks: list[int] = field(default_factory=list)


class Budget:
    """What a round may still hold of the messages it receives, in bytes, shared by every drain
    whose messages are held at the same time: its RESULT, READY and any-tag drains, and those
    of the answers that join it while it is open (its linger, a wait for the write lock).
    Bounded one by one, they let a round hold several times --max-message-bytes. A drain
    ends at the first message that does not fit in what is left (its size read from the
    probe, before it is received), so a round holds its budget at most (and a few KiB of
    READYs past it); that message waits, unreceived, for the next round, which takes it
    first, and the rest wait in MPI's queues, their senders'. (Stopping only once past the
    budget, a round held the message that crossed it too: twice the bound.)"""

    __slots__ = ("left",)

    def __init__(self, left: int):
        self.left = left


class Master:
    def __init__(self, store: Store, transport: Transport, config: MasterConfig, *,
                 sources: Sequence[Callable[[], list[NewInput]]] = (),
                 writer: TestcaseWriter | None = None):
        self.store, self.transport, self.config = store, transport, config
        self.sources, self.writer = list(sources), writer
        self._cooldown = HostCooldown(self._able)  # ranks whose host fails tasks
        # Ranks whose own answers were invalid (a current RESULT missing, malformed or refused
        # for its payload, then its READY): paused as a broken host is. Without the pause such
        # a rank, answering at once, took the retried task back from the head of the queue and
        # failed it again: one rank sending 5 bad RESULTs per WORK beside two honest ones
        # deferred 71 of 200 tasks. Its failures stay charged (R7): the pause only lets
        # the honest ranks take the retries.
        self._misbehaving = HostCooldown(self._able)
        self._invalid_said_at: dict[int, float] = {}
        #: What each rank's current streak of such answers held: invalid RESULTs, timeouts no
        #: run could have reached, or both (the stderr line names what it saw, not the other).
        self._misbehaved_with: dict[int, set[str]] = {}
        self.gate = Gate(store, validate=check_result, commit=self._commit,
                         salvage=self._salvage, host_ran=self._host_ran,
                         stopping=self._stopping, misbehaved=self._misbehaved,
                         timed_out=self._timed_out)
        self.summary = Summary()
        self._stop_signal: str | None = None
        self._no_stop_seen_until = -math.inf  # (`_stopping`)
        self._stop_recorded = False  # (`_record_stop`)
        #: What became of the campaign file's name, once it no longer reaches the open file.
        self.file_lost: str | None = None
        self._next_name_check = 0.0
        self._stop_at = 0.0
        self._sent: list[tuple[str, float]] = []   # WORK left (token, when): marked next tx
        self._unsent: list[tuple[int, str, str]] = []  # (rank, token, why): compensate pre-send
        self._failed_ranks: set[int] = set()
        # Parked ranks that echoed their retired token this round (they were slow, not hung),
        # and whether the operator was told what that means.
        self._unparked: list[int] = []
        self._told_unparked = False
        self._idle: list[int] = []
        self._unsent_plan: set[int] = set()  # ranks given work this round, their WORK unsent
        #: Ranks whose failing host was said on stderr, and whether their tasks were charged.
        self._host_said: dict[int, bool] = {}
        self._host_said_at: dict[int, float] = {}
        self._may_have_queued = True
        self._next_source = 0.0
        self._next_watchdog = 0.0
        self._next_drain_check = 0.0
        self._next_stats = 0.0
        self._cpu_at_start = 0.0
        self._stop_seq = 0
        self._next_stall_check = 0.0
        self._auto = AutoBatch.for_watchdog(config.watchdog_s)  # --batch auto's measures
        #: Queued tasks as last counted, less those dispatched since; and when to count again.
        self._queued: int | None = None
        self._recount_at = 0.0
        self._answered: dict[int, tuple[float, float]] = {}  # rank -> (RESULT in, WORK-to-it)
        self._ran_s: dict[int, float] = {}       # rank -> its answered dispatch's run time
        self._expected = ExpectedAnswers()       # ranks' outstanding WORKs and answer times
        self._strays: list[Stray] = []           # quarantined with the next round
        self._ack_inbox: list[Received] = []      # STOP_ACKs drained with other messages
        self._sweep_first = False                 # (`_receive_strays`)
        self._forged_acks = 0
        self._health = RankHealth()
        self._lost: set[int] = set()             # never reported READY: no work, not waited for
        self._refused: set[int] = set()          # sent mostly garbage: no work, ended at the end
        self._dead: set[int] = set()             # the runtime reported them dead
        self._started_at = time.monotonic()
        self._lost_checked = False
        # The master not running (`coordinator.pauses`), in the deadlines' clock.
        self._gaps = LoopGaps(clock=time.time)
        transport.max_message_bytes = config.max_message_bytes
        self._stalled_since: float | None = None  # monotonic; None: some rank can work
        self._progress = Progress(live=config.progress, interval_s=config.progress_interval_s)
        self._observer = Observer(store, lambda: list(range(1, transport.size)),
                                  interval_s=config.observe_interval_s,
                                  window_s=config.busy_window_s,
                                  finite=config.exit_when_drained,
                                  metrics_file=config.metrics_file)
        self.stats_error: str | None = None  # why the last stats file write failed
        #: Says, once a minute, what a write waits for (`LockWaiter`).
        self.lock_waiter = LockWaiter(store.path, store.lock_wait_s)
        if store.on_lock_wait is None:
            store.on_lock_wait = self._lock_wait

    # -- the round ---------------------------------------------------------------------------
    def run(self) -> Summary:
        start = time.monotonic()
        self._install_signal_handlers()
        backoff = Backoff()
        self._cpu_at_start = time.process_time()
        self._next_stats = time.monotonic() + self.config.stats_interval_s
        self._progress.start()
        try:
            while True:
                progressed = self._round()
                self.summary.rounds += 1
                self._record_stop()
                if self._stop_signal is not None and self._stop_ready():
                    break
                if self._stop_signal is None and self.config.exit_when_drained \
                        and not progressed and self._drained():
                    break
                if progressed:
                    backoff.reset()
                else:
                    backoff.wait(self._quiet_s())
                self._periodic()
                self._watch_for_a_stall()
            self._shutdown()
        except BaseException:
            # The first failure is the one to report: a read for the last frame or the stats
            # file can fail the same way (the database locked, the disk gone) and hide it.
            with contextlib.suppress(Exception):
                self._finish(start)
            raise
        self._finish(start)
        return self.summary

    def _finish(self, start: float) -> None:
        # Called from run()'s handler too: then the store may be what failed (or its write
        # lock what the run gave up waiting for), and only reads are tried.
        failing = sys.exc_info()[1] is not None
        s = None
        try:
            s = self._observer.read(running=False)
            self._progress.update(s)  # the last frame (or line) shows the end
            if failing:
                self._observer.write_metrics(s)
            else:
                try:
                    self._observer.record(s)  # the incarnation's end, for `status`
                except StoreError as e:  # the numbers themselves are in the database
                    print(f"coordinator: the run's last observation was not recorded: {e}",
                          file=sys.stderr, flush=True)
        finally:
            self._progress.stop()
            self.summary.elapsed_s = time.monotonic() - start
            self.summary.cpu_s = time.process_time() - self._cpu_at_start
        self.write_stats(s)

    def _round(self) -> bool:
        """One round, one transaction, in the protocol's order (docs/protocol.md §3); WORK leaves
        only after COMMIT.

        The next round's dispatch phase joins the transaction at its end (its READY drain
        would have nothing new: those messages were just applied), so a rank freed by this
        round's commits gets work without waiting for another COMMIT."""
        dispatching = self._stop_signal is None
        self._unsent_plan.clear()  # (the last round's WORKs have all left, or failed to)
        budget = Budget(self.config.max_message_bytes)
        results, readies = self._receive(budget)
        # Outside a stop, no STOP_ACK is awaited: each is quarantined.
        self._strays += [self._stray(r) for r in self._ack_inbox]
        self._ack_inbox = []
        now = time.monotonic()
        poll_sources = bool(dispatching and self.sources and now >= self._next_source)
        watchdog_due = bool(self.config.watchdog_s) and now >= self._next_watchdog
        want_dispatch = dispatching and self._may_have_queued and self._can_take(now)
        died = self._take_failed()
        # Out of this round's dispatch phase: planned in it, its WORK would still leave after
        # the COMMIT, its task charged for a dispatch `_retire_dead` ended before it left.
        self._failed_ranks.update(died)
        # Sends still to be marked do not by themselves justify a COMMIT: they ride along with
        # the next transaction (until then a rollback treats them as sent, the safe side).
        if not (readies or results or self._unsent or poll_sources or watchdog_due
                or want_dispatch or died or self._strays or self._lost_due(now)):
            return False
        new_inputs = self._poll_sources() if poll_sources else []
        plan: list[tuple[dsp.Planned, bytes]] = []
        timed_out: list[dsp.Recovery] = []
        with self._tx("master round", self._keep_answering(results, readies, budget)) as tx:
            self._settle_sends(tx)
            committed, retried, planned_early = self._apply_answers(
                tx, results, readies, dispatching, plan, budget)         # phases 1–3
            self.summary.committed += len(committed)
            self._note_strays(tx)
            recovered = self._retire_dead(tx, died)                  # ranks the MPI lost
            recovered += self._refuse_garbage_ranks(tx)
            self._lose_silent_ranks(now)
            recovered += self.gate.sweep(tx)                         # 4 recovery sweep
            if watchdog_due:                                         # 5 watchdog sweep
                # Deadlines are seconds apart: checking a few times a second is enough.
                self._next_watchdog = now + min(0.25, self.config.watchdog_s / 4)
                self._pay_pauses(tx)
                timed_out = self.gate.watchdog(tx)
                recovered += timed_out
            for rec in recovered:  # no answer is awaited from them any more
                self._expected.forget(rec.rank)
            if new_inputs:
                task_ops.enqueue_tasks(tx, [i.as_task() for i in new_inputs],
                                       skip_known_content=True)
            if recovered or new_inputs or retried or any(c.new_tasks for c in committed):
                self._may_have_queued = True
            if dispatching and (committed or recovered or retried or new_inputs):
                plan += self._plan(tx, None)                         # next round's dispatch
            elif not planned_early:  # (that one just refreshed it, and nothing freed a rank)
                self._refresh_idle(tx)
        if committed:
            self.summary.last_commit_at = time.time()
        for p, data in plan:  # committed: now the WORK may leave
            self._send_work(p, data)
        for rec in timed_out:
            if rec.halves is not None and self.config.batch is None:
                self._auto.ran_at_least(self.config.watchdog_s / sum(map(len, rec.halves)),
                                        rec.rank)
        for rec in timed_out:  # a hung rank is otherwise silent: all of them, a silent run
            print(f"coordinator: rank {rec.rank} passed its --watchdog deadline "
                  f"({self.config.watchdog_s:g} s); {_what_became(rec)}; "
                  + ("the rank had answered READY and gets new work" if rec.ready_seen else
                     "the rank gets no work until it answers"), file=sys.stderr, flush=True)
        self._tell_unparked()
        return bool(readies or plan or results)

    def _notice_pause(self, waited_s: float = 0.0) -> None:
        """Ticked where the master looks for answers (and after `waited_s` it slept on
        purpose): a gap since the last look was time the master did not run. Its own
        start-wait, stall and grace clocks move on by it here; the dispatches' deadlines at
        the next watchdog sweep (`_pay_pauses`), the stop's wait for acknowledgements in
        `_stop_workers`."""
        gap = self._gaps.tick(waited_s)
        if gap:
            self._started_at += gap
            if self._stalled_since is not None:
                self._stalled_since += gap
            if self._stop_signal is not None:
                self._stop_at += gap

    def _lock_wait(self, waited: float) -> None:
        """Between two tries for the write lock outside a round (an observation, the stop's
        writes): a wait for another process is not a pause, and must not move the deadlines
        on (a shell holding the lock for minutes would have delayed every hung worker's
        retirement that long)."""
        self._notice_pause()
        self.lock_waiter(waited)

    def _pay_pauses(self, tx: Tx) -> None:
        """Before the watchdog sweep (ticked again: the master may have stopped since this
        round's look): every sent dispatch's deadline moves later by the time the master was
        not running. A deadline that passed then is no evidence against its rank: with the
        whole job stopped its worker did not run either, and an answer sent meanwhile is
        taken by the next look. A worker stopped alone still passes its deadline: the
        master's loop went on and opened no gap."""
        self._notice_pause()
        owed = self._gaps.take()
        if not owed:
            return
        moved = dsp.extend_deadlines(tx, owed)
        if moved:
            print(f"coordinator: the master did not run for {owed:.1f} s (the job stopped or "
                  f"paused, or the disk stalled); the watchdog deadlines of {moved} "
                  f"dispatch{'es' * (moved != 1)} move that much later: the time is not held "
                  f"against their ranks", file=sys.stderr, flush=True)

    def _tell_unparked(self) -> None:
        """Once a run, when a parked rank first comes back: it was slow, not hung. (With
        tasks longer than the deadline every dispatch goes this way, and each retirement is
        said on its own.)"""
        if not self._unparked:
            return
        if not self._told_unparked:
            self._told_unparked = True
            print(f"coordinator: rank {self._unparked[0]} answered the dispatch the watchdog "
                  f"retired: it was slower than --watchdog ({self.config.watchdog_s:g} s), not "
                  f"hung, and gets work again; what it sent was not kept (the task is retried, "
                  f"then deferred). If tasks or batches run this long, raise --watchdog (0 "
                  f"disables it)", file=sys.stderr, flush=True)
        self._unparked = []

    def _retire_dead(self, tx: Tx, ranks: list[int], why: str = "died",
                     detail: str = "worker process died") -> list[dsp.Recovery]:
        """Ranks the runtime reported dead (ULFM), or the master refuses: their dispatches
        are recovered now, not at the watchdog deadline (anything they sent before was applied
        just before), and they get no more work. With no worker left the run stops,
        everything persisted."""
        if not ranks:
            return []
        active = dsp.active_by_rank(tx)
        recovered = []
        for rank in sorted(ranks):
            self._failed_ranks.add(rank)
            a = active.get(rank)
            rec = (dsp.recover_dispatch(tx, rank, a.token, cause=EventKind.WORKER_FAILED,
                                        reason=detail, worker_state=WorkerState.FAILED)
                   if a is not None else None)
            if rec is None:
                tx.event(EventKind.WORKER_FAILED, rank=rank, detail=detail)
            else:
                recovered.append(rec)
            # Also after a recovery: a rank whose READY was seen came back from it idle.
            set_workers(tx, [(rank, WorkerState.FAILED)])
            print(f"coordinator: rank {rank} {why}" + (
                f"; {_what_became(rec, 'its ')}" if rec is not None else ""),
                file=sys.stderr, flush=True)
        self._idle = [r for r in self._idle if r not in self._failed_ranks]
        if len(self._failed_ranks) >= self.transport.size - 1 and self._stop_signal is None:
            print("coordinator: no workers left; stopping (the campaign is saved: continue "
                  "with --resume)", file=sys.stderr, flush=True)
            self._stop_signal = NO_WORKERS_LEFT
            self._stop_at = time.monotonic()
        return recovered

    def _apply_answers(self, tx: Tx, results: list[Inbound], readies: list[Inbound],
                       dispatching: bool, plan: list[tuple[dsp.Planned, bytes]],
                       budget: Budget) -> tuple[list[dsp.CommitItem], list[int], bool]:
        """Phases 1–3 (READY, dispatch to ranks it freed, RESULT) for what was received, then
        again for each answer that arrives while the round is still open, up to `linger_s`
        (group commit: a COMMIT with its fsync costs more than a task's statements, so answers
        that arrive within a fraction of it should share it, and applying the first ones while
        the others are on their way takes their statements off the critical path).

        The round stays open while fewer answers than outstanding dispatches arrived, or while
        the ranks that sent a RESULT and those that sent a READY differ: a worker sends RESULT
        then READY, but the master often *observes* READY first (tag queues are matched
        independently). Each batch is applied READY first, then RESULT, and the sweeps run
        after the last, so arrival order changes nothing. Returns the commits, the ranks whose
        run is retried, and whether a dispatch phase ran. `budget`: the round's, which what
        it receives shares with what it was given."""
        committed: list[dsp.CommitItem] = []
        retried: list[int] = []
        planned_early = False
        # What each batch leaves is what the next one starts from: nothing else writes
        # dispatches or parked ranks between them, so they are not read again.
        active: dict[int, dsp.ActiveDispatch] | None = None
        parked: dict[int, str] | None = None
        # The answers to wait for are those of the ranks holding a dispatch: a parked rank, or
        # one never heard from, has none, and counting it would make each round linger its
        # whole `linger_s` for an answer that is not coming. Of those, only the answers due
        # within the linger are worth it: with 63 ranks of 50 ms tasks a round that waited for
        # every rank holding work lingered its whole `linger_s` each time, holding every freed
        # rank's next WORK back; with tasks of microseconds every answer is due at once and the
        # round waits for them all, one COMMIT for the lot. Unknown: due.
        due: set[int] = set()
        # The dispatches read are those of the ranks that answered (`looked_up`), each once a
        # round: a round's cost follows the answers it handles, not the ranks holding work
        # (`tools/round_cost.py --holders`). What the phases change (a commit, a dispatch
        # planned) is kept in `active` itself, never read again.
        looked_up: set[int] = set()
        if results or readies:
            active = self._look_up({}, looked_up, results, readies, tx)
            soon = time.monotonic() + self.config.linger_s
            due = self._expected.due_by(soon)
        sent_result: set[int] = set()
        sent_ready: set[int] = set()
        deadline = None
        any_ready = False
        while True:
            any_ready = any_ready or bool(readies)
            ready = self.gate.apply_ready(tx, readies, active=active, parked=parked)  # 1 READY
            self._unparked += ready.recovered_workers
            # Only an idle READY (or a parked rank's) frees a rank here; a current READY just
            # sets its mark, so without one the idle set cannot have grown: no query for it.
            if dispatching and (self._idle or ready.recovered_workers
                                or any(s is ReadyStatus.IDLE for _, s in ready.statuses)):
                planned_early = True
                plan.extend(self._plan(tx, ready.active))                # 2 dispatch
            rr = self.gate.apply_results(tx, results, active=ready.active)  # 3 drain RESULT
            self._health.note(ready.statuses, rr.statuses, rr.rejected, ready.repeated)
            self._note_sizes(rr.sizes)
            active, parked = rr.active, ready.parked
            if active is not None:
                looked_up.update(active)  # (the ranks just planned: their rows are these)
            committed += rr.committed
            retried += rr.retried
            if self.config.linger_s <= 0 or not (results or readies):
                break  # (a round opened for another reason, with no answers: nothing to pair)
            sent_result.update(m.rank for m in results)
            sent_ready.update(m.rank for m in readies)
            if sent_result == sent_ready and due <= sent_result:
                break
            if deadline is None:
                deadline = time.monotonic() + self.config.linger_s
            elif time.monotonic() >= deadline:
                break  # even if more keeps coming (a rank repeating READY): the round ends
            results, readies = self._linger(deadline, budget)
            if not (results or readies):
                break
            assert active is not None
            active = self._look_up(active, looked_up, results, readies, tx)
        if any_ready:
            # docs/protocol.md §3: READY drained, then RESULT, then the sweep. A RESULT sent before
            # a READY applied above and receivable only now is applied before the sweep can join
            # that READY with an earlier invalid mark and roll a good dispatch back.
            late = self._receive_tag(TAG_RESULT, budget)
            if late:
                assert active is not None
                active = self._look_up(active, looked_up, late, (), tx)
                rr = self.gate.apply_results(tx, late, active=active)
                self._health.note((), rr.statuses, rr.rejected)
                self._note_sizes(rr.sizes)
                committed += rr.committed
                retried += rr.retried
        return committed, retried, planned_early

    @staticmethod
    def _look_up(active: dict[int, dsp.ActiveDispatch], looked_up: set[int],
                 results: Sequence[Inbound], readies: Sequence[Inbound], tx: Tx,
                 ) -> dict[int, dsp.ActiveDispatch]:
        """`active` with the dispatches of the ranks that sent these answers and were not
        looked up yet this round. A rank looked up before keeps what the phases left: its
        dispatch committed in this round is gone from `active`, and must not come back."""
        ranks = {m.rank for m in results} | {m.rank for m in readies}
        ranks -= looked_up
        if ranks:
            active.update(dsp.active_by_rank(tx, ranks))
            looked_up |= ranks
        return active

    def _quiet_s(self) -> float:
        """How long no answer is due: until the first rank holding work is expected to answer
        (its WORK left plus four fifths of its mean answer time: answers come early too).
        The idle polls sleep that long (up to the backoff's cap) instead of every 50 µs:
        with 63 ranks of 50 ms tasks on 2 cores an answer came every few milliseconds, and
        the master polled 4-5 times per task, CPU the ranks' wake-ups needed (utilisation
        0.85-0.92 that way, 0.91-0.94 this way). 0 while anything may come any moment: a
        rank's time unknown, or a READY awaited after a RESULT."""
        if self._answered:
            return 0.0
        # (a rank cooling down takes work when it ends: nothing to poll for until then)
        cooled = (self._cool_wait(self._idle, time.monotonic())
                  if self._idle and self._may_have_queued else None)
        if not self._expected.sent_at:
            return 0.0 if cooled is None else cooled
        first = self._expected.first_expected()
        if first is None:
            return 0.0
        quiet = max(0.0, first - time.monotonic())
        return quiet if cooled is None else min(quiet, cooled)

    def _note_answer_times(self, results: list[Inbound]) -> None:
        now = time.monotonic()
        for m in results:
            took = self._expected.answered(m.rank, now)
            if took is not None:
                self._answered[m.rank] = (now, took)

    def _receive(self, budget: Budget | None = None) -> tuple[list[Inbound], list[Inbound]]:
        """The RESULTs and READYs waiting now (and the other messages, kept aside), up to
        `budget`: the round's, when these join answers it still holds; None: their own."""
        if budget is None:
            budget = Budget(self.config.max_message_bytes)
        self._notice_pause()
        if budget.left <= 0 or not self.transport.waiting():
            return [], []
        results: list[Inbound] = []
        readies: list[Inbound] = []
        sweep_first = self._sweep_first
        if sweep_first:
            self._receive_strays(results, readies, budget)
        self._receive_answers(results, readies, budget)
        if not sweep_first:
            self._receive_strays(results, readies, budget)
        if results:
            self._note_answer_times(results)
        if self._refused:  # drained and counted, never applied: the rank gets nothing more
            for answers in (results, readies):
                kept = [m for m in answers if m.rank not in self._refused]
                self._strays += [Stray(m.rank, Channel.RESULT if answers is results else
                                       Channel.READY, QuarantineReason.UNOWNED,
                                       "from a rank the master refused")
                                 for m in answers if m.rank in self._refused]
                answers[:] = kept
        return results, readies

    def _receive_answers(self, results: list[Inbound], readies: list[Inbound],
                         budget: Budget) -> None:
        """The RESULTs and READYs waiting now, decoded (undecodable ones as such), added to
        `results` and `readies`.

        RESULT first: a worker sends it just before its READY, so a READY that arrives
        between the two drains still joins its RESULT in the batch (READY first would split
        them more often, and each extra batch costs the master ~4 % of its throughput). The
        protocol's order, READY drained before RESULT, is kept where it matters:
        `_apply_answers` drains RESULT once more after the last READY, before the sweep."""
        results += self._receive_tag(TAG_RESULT, budget)
        readies += self._receive_tag(TAG_READY, budget)

    def _receive_tag(self, tag: int, budget: Budget) -> list[Inbound]:
        # Past the budget, a flood of large messages waits in MPI's queues (its sender's),
        # not in the master's memory. READYs are small (MAX_SMALL_MESSAGE_BYTES at most), so
        # a few are taken even then: a rank's stream of large RESULTs, each round's budget
        # spent on them first, would otherwise keep every other rank's READY waiting.
        room = budget.left if tag == TAG_RESULT else max(budget.left, MAX_SMALL_MESSAGE_BYTES)
        if room <= 0:
            return []
        refused = self.transport.out_of_room
        got = [self._inbound(r, budget) for r in self.transport.drain(tag, max_bytes=room)]
        if self.transport.out_of_room != refused:  # the next one does not fit: spent
            budget.left = min(budget.left, 0)
        return got

    def _inbound(self, r: Received, budget: Budget) -> Inbound:
        """A received RESULT or READY, decoded into what the gate classifies (its bytes kept
        for a RESULT's payload, read only if it is current), its size taken from `budget`."""
        limit = held_bound(r.tag, self.config.max_message_bytes)
        if r.data is None or len(r.data) > limit:
            return Inbound(r.rank, oversized(r.size if r.data is None else len(r.data), limit))
        budget.left -= len(r.data)
        if r.tag == TAG_RESULT:
            return Inbound(r.rank, decode_result(r.data), r.data)
        return Inbound(r.rank, decode_ready(r.data))

    def _receive_strays(self, results: list[Inbound], readies: list[Inbound],
                        budget: Budget) -> None:
        """Every message to the master is drained, whatever its tag: left in MPI's queue,
        messages on tags it never receives piled up (320,000 brought it to 1.6 GiB in 47 s).
        A RESULT or READY that arrived since its own drain joins it; anything else (a
        STOP_ACK outside a stop, a foreign tag) is quarantined in the next round.

        With `budget` spent (on RESULTs) the sweep waits, and the next one comes first, before
        the RESULT drain: spent on RESULTs at every round, the budget would otherwise leave
        the small messages of other tags piling up in MPI's queue, the master's memory."""
        self._sweep_first = budget.left <= 0
        if self._sweep_first:
            return
        refused = self.transport.out_of_room
        for r in self.transport.drain(ANY_TAG, limit=1_000, max_bytes=budget.left):
            if r.tag == TAG_RESULT:
                results.append(self._inbound(r, budget))
            elif r.tag == TAG_READY:
                readies.append(self._inbound(r, budget))
            elif r.tag == TAG_STOP_ACK:
                self._ack_inbox.append(r)  # `_take_acks` judges it (or the next round)
                budget.left -= len(r.data) if r.data is not None else 0
            else:
                self._strays.append(self._stray(r))
        if self.transport.out_of_room != refused:  # (taken first next round, with its budget)
            budget.left = min(budget.left, 0)
            self._sweep_first = True

    def _stray(self, r: Received, why: str = "") -> Stray:
        size = r.size if r.data is None else len(r.data)
        if r.tag == TAG_STOP_ACK:
            return Stray(r.rank, Channel.STOP_ACK, QuarantineReason.STALE,
                         why or f"a STOP_ACK for no STOP sent to rank {r.rank}")
        return Stray(r.rank, Channel.OTHER, QuarantineReason.FOREIGN_TAG,
                     f"tag {r.tag}, {size} bytes: the master receives no message on it")

    def _linger(self, deadline: float, budget: Budget) -> tuple[list[Inbound], list[Inbound]]:
        """The next answers to arrive before `deadline` (empty lists if none did, or if the
        round's `budget` is spent: they wait for the next round)."""
        while True:
            results, readies = self._receive(budget)
            if results or readies or budget.left <= 0 or time.monotonic() >= deadline:
                return results, readies
            time.sleep(20e-6)

    def _plan(self, tx: Tx, active: dict[int, dsp.ActiveDispatch] | None,
              ) -> list[tuple[dsp.Planned, bytes]]:
        self._refresh_idle(tx)
        now = time.monotonic()
        held = self._held(self._idle, now)
        able = [r for r in self._idle if r not in held] if held else self._idle
        if not able:
            self._idle_waits()
            return []
        planned = self.gate.plan_dispatches(tx, able, deadline_s=self.config.watchdog_s
                                            or None, active=active, batch=self._batch_size(tx),
                                            spread=self.config.batch is None)
        if len(planned) < len(able):
            self._may_have_queued = False  # nothing dispatchable left until something changes
        if self._queued is not None:
            self._queued = max(0, self._queued - sum(1 + len(p.more) for p in planned))
        taken = {p.rank for p in planned}
        self._idle = [r for r in self._idle if r not in taken]
        self._idle_waits()
        # Each WORK is built inside the transaction that records its dispatch, so a task that
        # cannot be carried is held as failed in it, instead of raising after the COMMIT (at
        # every --resume again).
        plan = []
        for p in planned:
            try:
                data = encode(_work(tx, p))
            except ENCODE_ERRORS as e:
                # The task (or the tasks of a batch) whose payload no message can carry.
                bad = [t.id for t in p.tasks if _unsendable(tx, t)] or [p.task.id]
                why = f"{type(e).__name__}: {e}"[:300]
                log.error("task %s: its WORK message cannot be built (%s); held as failed",
                          ", ".join(map(str, bad)), why)
                dsp.refuse_unsendable(tx, p.rank, p.token, why, bad)
            else:
                if not (p.more and len(data) > self.config.max_message_bytes):
                    plan.append((p, data))
                    self._unsent_plan.add(p.rank)
                    continue
                # A batch's inputs together (11 of 200 MB: past what one MPI message carries,
                # and the send failure cost the rank) go in smaller batches; a task alone
                # goes whatever its size.
                dsp.split_unsent(tx, p.rank, p.token, f"its WORK is {len(data)} bytes, over "
                                 f"--max-message-bytes {self.config.max_message_bytes}")
            if active is not None:
                active.pop(p.rank, None)
            self._idle.append(p.rank)
            self._may_have_queued = True
        return plan

    def _send_work(self, p: dsp.Planned, data: bytes) -> None:
        self._unsent_plan.discard(p.rank)
        try:
            self.transport.send_work(data, p.rank)
            now = time.monotonic()
            self._expected.sent(p.rank, now)
            answered, ran = self._answered.pop(p.rank, None), self._ran_s.pop(p.rank, None)
            if answered is not None and ran is not None:
                self._auto.cycled(answered[1], ran, now - answered[0])
            self._sent.append((p.token, self.store.clock()))
            self.summary.dispatches += 1
            if self.summary.first_work_at is None:
                self.summary.first_work_at = time.time()
        except SendFailed as e:
            log.error("%s", e)
            self._unsent.append((p.rank, p.token, str(e.cause)[:300]))

    def _settle_sends(self, tx: Tx) -> None:
        # The failed sends first: rewound now, before any answer is classified. The marks of
        # the sends that left are written with this round's commits (`dispatches._Pending`).
        for rank, token, why in self._unsent:
            dsp.cancel_dispatch(tx, rank, token, worker_state=WorkerState.FAILED,
                                detail=f"send failed: {why}")
            self._failed_ranks.add(rank)
        if self._unsent:
            self._may_have_queued = True
        self._unsent = []
        dsp.mark_sent(tx, self._sent)
        self._sent = []

    def _refresh_idle(self, tx: Tx) -> None:
        self._idle = [r for r in idle_ranks(tx) if r not in self._failed_ranks]

    def _idle_waits(self) -> None:
        for rank in self._idle:  # its wait for the next WORK is the queue's, not overhead
            self._answered.pop(rank, None)
            self._ran_s.pop(rank, None)

    def _can_take(self, now: float) -> bool:
        """Whether an idle rank may be given work now: one cooling down after its host could
        not run its tasks (`coordinator.cooldown`) waits, and must not make every idle poll
        a transaction meanwhile."""
        return len(self._held(self._idle, now)) < len(self._idle)

    def _held(self, ranks: Collection[int], now: float) -> set[int]:
        """Of `ranks`, those pausing: their host could not run tasks, or their answers were
        invalid (each pause only while another rank can run tasks)."""
        if not (self._cooldown.until or self._misbehaving.until):
            return set()
        return self._cooldown.held(ranks, now) | self._misbehaving.held(ranks, now)

    def _cool_wait(self, ranks: Collection[int], now: float) -> float | None:
        """How long until the first pausing rank of `ranks` may take work; None: none is."""
        waits = [c.wait_s(ranks, now) for c in (self._cooldown, self._misbehaving) if c.until]
        return min((w for w in waits if w is not None), default=None)

    #: How the stderr line names the answers of a rank's streak (`_misbehaved`).
    MISBEHAVED_WITH = {"invalid": "invalid results",
                       "timeout": "timeouts no run could have reached so soon"}

    def _misbehaved(self, rank: int, reason: str, kind: str = "invalid") -> None:
        """A dispatch of `rank` rolled back for its own invalid answer (`reason`: what was
        quarantined), or answered with timeouts no run could have reached (`_timed_out`,
        `kind` "timeout": valid RESULTs, not invalid ones): the rank pauses (`_misbehaving`)
        until a result of it commits. Said on stderr at its second such dispatch in a row,
        once a minute at most: a rank that only pauses defers nothing, so only the quarantine
        counts would show the operator a broken worker."""
        streak = self._misbehaving.streak.get(rank, 0)
        self._misbehaving.answered(rank, False)
        kinds = self._misbehaved_with.setdefault(rank, set())
        if streak == 0:  # (a result of it committed since: a new streak)
            kinds.clear()
        kinds.add(kind)
        now = time.monotonic()
        if (streak >= 1 and self._stop_signal is None
                and now >= self._invalid_said_at.get(rank, -math.inf) + 60):
            self._invalid_said_at[rank] = now
            what = " or ".join(self.MISBEHAVED_WITH[k] for k in self.MISBEHAVED_WITH
                               if k in kinds)
            print(f"coordinator: rank {rank} answered its last {streak + 1} dispatches with "
                  f"{what} ({reason}); their tasks go back to the retry policy and the "
                  f"other ranks, and it gets work again after a pause (up to "
                  f"{self._misbehaving.CAP_S:g} s while it goes on); check that rank's worker",
                  file=sys.stderr, flush=True)

    def _timed_out(self, rank: int, runs: int) -> None:
        """A current RESULT of `rank` said `runs` of its runs timed out. Sooner than half the
        command's --timeout each after its WORK left (or at all, when the executor has no
        timeout), no run could have: the rank pauses as one whose answers are invalid. A rank
        answering every WORK at once with a valid `timeout` deferred 46 of 100 tasks beside
        two honest ones. A real hang never pauses a rank: its run took the whole timeout."""
        limit = self.config.task_timeout_s
        took = self._answered.get(rank, (0.0, None))[1]
        if limit <= 0 or took is None or took >= 0.5 * runs * limit:
            return
        self._misbehaved(rank, f"{runs} run{'s' * (runs != 1)} said to time out "
                               f"{took:.3g} s after the WORK left"
                               + (f", under --timeout {limit:g} s" if limit < math.inf else
                                  ": its executor has no timeout"), "timeout")

    def _able(self) -> Iterator[int]:
        """The ranks that could run a task (`coordinator.cooldown`): those whose WORK is out
        (a parked rank's was forgotten when the watchdog retired it), those that answered one
        within ANSWERED_ABLE_S (its READY follows at once; one that never comes, a rank hung
        after its RESULT, must not excuse a broken host for ever), the idle ones, and those
        given work this round (its WORK leaves after the COMMIT: a healthy rank is in none of
        the others then), and those still starting (no READY yet, not yet lost at
        --start-wait's end: an honest rank slower to start than a broken one would otherwise
        leave it no one to wait for, and the broken one failed the first task twice, deferring
        it). Never a dead, refused, unreachable or lost one."""
        gone = self._failed_ranks | self._lost
        if not self._lost_checked:
            heard = self._health.heard
            yield from (r for r in range(1, self.transport.size)
                        if r not in heard and r not in gone)
        recent = time.monotonic() - ANSWERED_ABLE_S
        yield from (r for r in self._expected.sent_at if r not in gone)
        yield from (r for r, (at, _) in self._answered.items() if at > recent and r not in gone)
        yield from (r for r in self._idle if r not in gone)
        yield from (r for r in self._unsent_plan if r not in gone)

    def _host_ran(self, tx: Tx, rank: int, unrun: str | None) -> bool:
        """A current RESULT's rank: whether its `not_run` tasks are charged. Written to the
        rank's row for `status` at each such answer, and said on stderr when its host is
        known to fail (its second such answer in a row); both again when it runs tasks
        again: a rank that only cools down defers nothing, so neither `status`'s held
        reasons nor the deferred count would show the operator a host to fix."""
        streak = self._cooldown.streak.get(rank, 0)
        charged = self._cooldown.answered(rank, unrun is None)
        if unrun is not None:
            note_unrun(tx, rank, streak + 1, unrun[:NOT_RUN_REASON_CHARS])
        elif streak:
            note_unrun(tx, rank, None)
        if self._stop_signal is not None:
            return charged  # (no more work for anyone: nothing to say about its next)
        said = self._host_said.get(rank)
        if unrun is None:
            if said is not None:
                self._host_said.pop(rank)
                print(f"coordinator: rank {rank} runs tasks again", file=sys.stderr,
                      flush=True)
        elif streak >= 1 and said != charged and (
                said is not None
                or time.monotonic() >= self._host_said_at.get(rank, -math.inf) + 60):
            # Its second failure in a row (once a minute at most: a host that fails two
            # tasks of three would say so every few seconds), or whether it is charged changed
            # since it was said (the other ranks parked or died: its tasks now go to the
            # retry policy).
            self._host_said[rank] = charged
            self._host_said_at[rank] = time.monotonic()
            print(f"coordinator: rank {rank}'s host could not run its last {streak + 1} "
                  f"dispatches ({for_terminal(unrun)}); "
                  + ("its tasks go back to the other ranks, not charged, and it gets work "
                     f"again after a pause (up to {self._cooldown.CAP_S:g} s while it keeps "
                     "failing)" if not charged else
                     "no other rank can run tasks, so they go to the retry policy (deferred "
                     "past its budget)")
                  + "; fix the host", file=sys.stderr, flush=True)
        return charged

    def _drained(self) -> bool:
        # Asked only after a round with no progress, and at most every 50 ms: a transaction
        # per idle poll would add its cost to every answer's latency.
        now = time.monotonic()
        if self._may_have_queued or now < self._next_drain_check:
            return False
        self._next_drain_check = now + 0.05
        with self.store.reading() as conn:
            live = dsp.work_left(conn)
        return not live and not self._sent

    def _poll_sources(self) -> list[NewInput]:
        self._next_source = time.monotonic() + self.config.source_interval_s
        out: list[NewInput] = []
        for poll in self.sources:
            out.extend(poll())
        return out

    def _commit(self, tx: Tx, active: dsp.ActiveDispatch, res: Result,
                value_json: str | None, task_id: int | None = None) -> dsp.CommitItem:
        """A current result (or one task's of a batch, `task_id`): its test cases written and
        fed back, its run time taken into the means that size automatic batches."""
        if self._misbehaving.streak:
            self._misbehaving.answered(active.rank, True)  # (a run that ran ends its pause)
        written, created = self._keep_testcases(
            tx, task_id if task_id is not None else active.task_id,
            res.testcases) if res.testcases else (0, 0)
        if self.config.batch is None:
            self._auto.ran(res.duration_s, active.rank)
            # (A run time not known: no overhead can be told from this dispatch.)
            self._ran_s[active.rank] = (self._ran_s.get(active.rank, 0.0) + res.duration_s
                                        if res.duration_s >= 0 else math.inf)
        return dsp.CommitItem(active.rank, active.token, task_id, res.status, value_json,
                              written, created, failure_detail(res), res.dropped)

    def _salvage(self, tx: Tx, active: dsp.ActiveDispatch, res: Result, task_id: int) -> int:
        """A timed-out run of `task_id` (the dispatch's, or one of its batch's) is retried,
        but the test cases it wrote before it was killed are real (SymCC writes each as it
        finds it, and its own helper keeps them): kept, and counted with the results'."""
        kept = self._keep_testcases(tx, task_id, res.testcases)[0]
        if kept:
            record_salvaged(tx, active.rank, active.token, task_id, kept)
        return kept

    def _keep_testcases(self, tx: Tx, task_id: int,
                        testcases: Sequence[tuple[str, bytes]]) -> tuple[int, int]:
        """Writes a current run's test cases and queues the new ones (the feedback loop):
        (files written, tasks created)."""
        written, new = 0, []
        if testcases and self.writer is not None:
            task = task_ops.get_task(tx, task_id)
            assert task is not None
            depth = task.depth + 1
            feedback = self.config.feedback and (self.config.max_depth == 0
                                                 or depth <= self.config.max_depth)
            src = input_id(task.payload, task.id)
            # A fed-back test case is a task by its path: a name an earlier one had (the
            # directory emptied, its ids started over) would make its new content that
            # task, never run.
            taken = (lambda p: task_ops.payload_known(tx, {"path": str(p)})) if feedback \
                else None
            for _name, content in testcases:  # the worker's name never becomes a path
                if self.writer.afl_style and task_ops.content_known(tx, content_hash(content)):
                    # An input the campaign already has (often the task's own, unchanged):
                    # AFL has it, and writing it back would only make AFL run it again.
                    continue
                path, fresh = self.writer.store(content, src=src, taken=taken, sync=False)
                written += fresh
                if feedback:
                    new.append(task_ops.NewTask({"path": str(path)}, content,
                                                origin=task_ops.FEEDBACK_ORIGIN,
                                                depth=depth, parent_id=task.id))
        if self.writer is not None:
            self.writer.sync()  # (the names durable before the commit that records them)
        # Content already known as some task's input is not run again.
        created = task_ops.enqueue_tasks(tx, new, skip_known_content=True) if new else []
        return written, len(created)

    # -- batches ----------------------------------------------------------------------------
    def _batch_size(self, tx: Tx) -> int:
        """--batch N, or auto's size; either way few enough tasks that their RESULT, as large
        as the RESULTs seen so far, fits a message with room to spare (a batch that does not
        is split, and its tasks run again)."""
        live = self.live_workers()
        n = (self.config.batch if self.config.batch is not None else
             self._auto.size(lambda: self._queued_now(tx), len(live)))
        # (A rank refused for garbage asks for nothing any more: its splits are not heard.)
        heard = [rank for rank in live if rank not in self._refused]
        return min(n, self._auto.bytes_cap(self.config.max_message_bytes, heard))

    def _note_sizes(self, sizes: Sequence[tuple[int, int | None, int]]) -> None:
        for rank, nbytes, tasks in sizes:
            if nbytes is None:  # (a split it asked for: the rank's word)
                self._auto.split(self.config.max_message_bytes, tasks, rank)
            else:
                self._auto.answered(nbytes, tasks, rank)

    def _queued_now(self, tx: Tx) -> int:
        """The queue's length for `--batch auto`'s guided share: counted at most once a
        second, and less often when counting takes long (a queue of millions), so that the
        count costs at most ~1 % of the master's time; in between, each dispatch's tasks are
        taken off. Tasks queued meanwhile (new inputs, a batch split back) are missed until
        the next count, which only makes the dispatches a little smaller until then."""
        now = time.monotonic()
        if self._queued is None or now >= self._recount_at:
            self._queued = task_ops.count_queued(tx)
            self._recount_at = now + max(1.0, 100 * (time.monotonic() - now))
        return self._queued

    def _tx(self, operation: str, on_lock_wait: Callable[[float], None] | None = None):
        self.summary.transactions += 1
        return self.store.transaction(operation, on_lock_wait)

    def _keep_answering(self, results: list[Inbound], readies: list[Inbound], budget: Budget,
                        ) -> Callable[[float], None]:
        """While another process holds the write lock (a `sqlite3` shell, a backup), the
        round's BEGIN waits: the answers that arrive meanwhile join the round that waits, so
        they are applied before its sweeps (a watchdog deadline that passed during the wait
        does not retire a dispatch whose answer is in). Up to the round's `budget`: a wait
        may last `--lock-wait` (30 min), and a rank sending RESULTs of --max-message-bytes
        would otherwise fill the master's memory at each retry; past it, they wait in MPI's
        queues, their senders'."""
        def waiting(waited: float) -> None:
            more_results, more_readies = self._receive(budget)  # (ticks the pause clock)
            results.extend(more_results)
            readies.extend(more_readies)
            self.lock_waiter(waited)
        return waiting

    # -- a run no rank can work for ---------------------------------------------------------
    def _watch_for_a_stall(self) -> None:
        """Every live rank parked (hung past its deadline) while work waits: nothing can run,
        and the run would sit there for ever without a word. Said at once, with which ranks
        hold which tasks since when; the run ends after `stall_grace_s` unless one of them
        answers (a parked rank that echoes its retired token is back in service). Checked
        twice a second, from the small workers table."""
        now = time.monotonic()
        if self._stop_signal is not None or now < self._next_stall_check:
            return
        self._next_stall_check = now + 0.5
        live = self.live_workers()
        with self.store.reading() as conn:
            states = worker_states(conn)
            stuck = bool(live) and all(states.get(r) is WorkerState.PARKED for r in live)
            waiting = stuck and (dsp.work_left(conn) or not self.config.exit_when_drained)
            parked = parked_detail(conn) if waiting and self._stalled_since is None else []
        if not waiting:
            if self._stalled_since is not None:
                able = [r for r in live if states.get(r) is not WorkerState.PARKED]
                print(f"coordinator: rank{'s' * (len(able) != 1)} {_ranks(able)} can take work "
                      f"again; the run goes on", file=sys.stderr, flush=True)
            self._stalled_since = None
            return
        if self._stalled_since is None:
            self._stalled_since = now
            held = "; ".join(
                f"rank {rank} on " + (f"a batch of {n} tasks from task {task_id}" if n > 1
                                      else f"task {task_id}")
                + (f" since {_clock(at)}" if at else "")
                for rank, task_id, at, n in parked)
            dead = sorted(self._failed_ranks)
            print(f"coordinator: no rank can take work: every live rank is parked, hung past "
                  f"its --watchdog deadline ({held})"
                  + (f"; rank{'s' * (len(dead) != 1)} {_ranks(dead)} died" if dead else "")
                  + f"; the run ends in {self.config.stall_grace_s:g} s unless one of them "
                  f"answers (--stall-grace)", file=sys.stderr, flush=True)
        elif now - self._stalled_since >= self.config.stall_grace_s:
            print(f"coordinator: no rank could take work for {self.config.stall_grace_s:g} s; "
                  f"ending the run (the campaign is saved: the watchdog put their tasks back, "
                  f"a task alone charged, a batch's in halves; continue with --resume once "
                  f"the cause is fixed)",
                  file=sys.stderr, flush=True)
            self._stop_signal = NO_RANK_CAN_WORK
            self._stop_at = now

    # -- stats and progress ----------------------------------------------------------------
    def _periodic(self) -> None:
        now = time.monotonic()
        if now >= self._next_name_check:
            self._next_name_check = now + 1.0
            self._check_the_file_name()
        self._observer.sample_busy(now)
        progress_due, stats_due = self._progress.due(now), now >= self._next_stats
        observe_due = self._observer.due(now)
        if not (progress_due or stats_due or observe_due):
            return
        s = self._observer.read()  # one read for all that fall due together
        if observe_due:
            self._observer.record(s)
        if progress_due:
            self._progress.took(now, time.monotonic() - now)
            self._progress.update(s)
        if stats_due:
            self._next_stats = now + self.config.stats_interval_s
            self.write_stats(s)

    def _check_the_file_name(self) -> None:
        """A campaign file removed (a `rm`, a /tmp cleaner) or replaced under the master: it
        goes on in the file it opened, which no name reaches, and would lose everything at
        exit. Said at once, and the run stops; its end copies the database out
        (`Store.close(rescue=True)`)."""
        if self.file_lost is not None or (lost := self.store.lost_name()) is None:
            return
        self.file_lost = lost
        print(f"coordinator: {lost} while the master ran; stopping (the campaign is copied "
              f"out whole before the master exits)", file=sys.stderr, flush=True)
        self.request_stop(CAMPAIGN_FILE_LOST)

    def write_stats(self, s: Snapshot | None = None) -> None:
        """The six counters of docs/protocol.md R10, the quarantined messages of the other
        channels, then the progress line's fields."""
        if self.config.stats_file is None:
            return
        if s is None:
            s = self._observer.read()
        # The six R10 lines stay first, byte for byte, for what parses them; a forged
        # STOP_ACK or a message on a foreign tag fits none of their labels, so it is counted on
        # a line after them, written even at 0 so that every copy of the file has its lines.
        other = other_messages_text(s.stats, always=True)
        try:
            replace_text(self.config.stats_file,
                         stats_text(s.stats) + f"{other}\n" + stats_fields(s))
        except OSError as e:  # a convenience copy: the numbers stay in the database
            why = e.strerror or str(e)
            if why != self.stats_error:  # said once per cause, not every interval
                print(f"coordinator: cannot write the stats file {self.config.stats_file}: "
                      f"{why} (the numbers stay in the database: `coordinator status`)",
                      file=sys.stderr, flush=True)
            self.stats_error = why
        else:
            self.stats_error = None

    # -- graceful stop -----------------------------------------------------------------------
    def request_stop(self, why: str) -> None:
        """A graceful stop (a stop signal, also one that came before `run`): no new
        dispatches, in-flight work gets the grace period."""
        if self._stop_signal is None:
            self._stop_signal = why
            self._stop_at = time.monotonic()
            print(f"coordinator: {why}: no new dispatches; giving in-flight work "
                  f"{self.config.grace_s:g} s", file=sys.stderr, flush=True)

    def _record_stop(self) -> None:
        """A stop signal is written at once (a `stop` event), in a transaction of its own: at a
        Slurm time limit `mpiexec` gets SIGTERM too and ends the ranks within about 2 s, and the
        scheduler's SIGKILL follows its grace, either of which can end this master before its
        graceful stop finishes. The event tells `--resume` that the runs left in flight were
        its operator's stop, not a crash: they are charged nothing
        (`dispatches.requeue_in_flight`)."""
        if self._stop_signal in _STOP_SIGNAL_NAMES:
            self.record_stop(self._stop_signal)

    def record_stop(self, why: str) -> None:
        """A `stop` event, once: the run ends for a cause that is not its tasks' (a stop
        signal, the output directory full), so `--resume` charges nothing for the runs it
        leaves in flight."""
        if self._stop_recorded:
            return
        self._stop_recorded = True
        with self._tx("stop") as tx:
            tx.event(EventKind.STOP, detail=why)
            if why in _STOP_SIGNAL_NAMES:
                # A worker holding work is gone: without ULFM that death is what made the
                # launcher signal this master (measured: a poison task then reran uncharged
                # at each --resume), so its run is charged as after a crash. Only its own:
                # no event at all charged every rank's, and one READY naming a pid that is no
                # process here (a hostile rank, or one in another pid namespace) cost the
                # honest ranks an attempt each.
                for rank in sorted(self._gone_ranks(tx, take_failed=False)):
                    tx.event(EventKind.STOP, rank=rank, detail=dsp.GONE_AT_STOP)

    def _stopping(self) -> bool:
        """Asked for an `interrupted` run: whether the master stops, after waiting up to
        STOP_SIGNAL_WAIT_S for its own signal (once: a rank signalled alone, by an operator,
        may answer several such runs, and the rounds are not held up again for each)."""
        now = time.monotonic()
        if self._stop_signal is None and now >= self._no_stop_seen_until:
            self._notice_pause()
            deadline, slept = now + STOP_SIGNAL_WAIT_S, 0.0
            while self._stop_signal is None and time.monotonic() < deadline:
                time.sleep(0.01)  # (the handler runs between two sleeps)
                slept += 0.01
            # As long as a pause (2 s): not one, it slept on purpose.
            self._notice_pause(waited_s=slept)
            self._no_stop_seen_until = time.monotonic() + 30.0
        return self._stop_signal is not None

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: object) -> None:
            self.request_stop(signal.Signals(signum).name)
        for signum in STOP_SIGNALS:
            signal.signal(signum, handler)

    def _stop_ready(self) -> bool:
        """Stop once in-flight work has finished, or the grace period is over."""
        if time.monotonic() - self._stop_at >= self.config.grace_s:
            return True
        with self.store.reading() as conn:
            return not dsp.any_in_flight(conn)

    def _shutdown(self) -> None:
        self.summary.stopped_by_signal = self._stop_signal
        with self._tx("graceful stop") as tx:
            self._settle_sends(tx)
        self.summary.unacked_ranks, back = self._stop_workers()
        if back:
            print(f"coordinator: {len(back)} unfinished task{'s' * (len(back) != 1)} "
                  f"returned to the queue",
                  file=sys.stderr, flush=True)

    def _gone_ranks(self, tx: Tx, take_failed: bool = True) -> set[int]:
        """Ranks holding a dispatch whose worker is known to be gone: reported dead by MPI, or
        (same host) its process no longer exists. Without ULFM, Open MPI's launcher answers a
        worker's death by signalling the master, which must not then requeue the task that
        killed it for free (a poison task would loop for ever across resumes). `take_failed`:
        also take the deaths MPI reported since the last round (not in a round's loop, whose
        `_retire_dead` must see them)."""
        if take_failed:
            self._failed_ranks.update(self._take_failed())
        here = socket.gethostname()
        gone = set()
        for rank, host, pid in dsp.holders(tx):
            if rank in self._failed_ranks or host == here and pid and not process_exists(pid):
                gone.add(rank)
        return gone

    def stop_workers_now(self) -> list[int]:
        """After a fatal error: STOP (no finalize) to every live worker, without the database
        (it may be what failed); returns the ranks that did not acknowledge in time."""
        pending = set(self.live_workers())
        tokens: dict[int, str] = {}
        unreachable = set()
        for rank in sorted(pending):
            token = self._send_stop(rank, finalize=False)
            if token is None:
                pending.discard(rank)
                unreachable.add(rank)
            else:
                tokens[rank] = token
        deadline = time.monotonic() + min(self.config.stop_wait_s, 5.0)
        backoff = Backoff()
        while pending and time.monotonic() < deadline:
            pending.difference_update(self._take_acks(tokens))
            self._receive()  # busy workers answer first: discarded (the database may be down)
            self._strays = []
            pending -= set(self._take_failed())
            backoff.wait()
        return sorted(pending | (unreachable - self._dead))

    def _take_failed(self) -> list[int]:
        """Ranks the runtime reported dead since the last call (ULFM), kept in `_dead`."""
        died = [r for r in self.transport.take_failed() if r != 0]
        # A rank a posted send could not reach is retired like a dead one, but it is alive
        # as far as MPI knows: ended with the job (`_stop_workers`), or Finalize waits on it.
        self._dead.update(r for r in died if r not in self.transport.unreachable)
        return died

    def live_workers(self) -> list[int]:
        return [r for r in range(1, self.transport.size)
                if r not in self._failed_ranks and r not in self._lost]

    # -- ranks that misbehave -----------------------------------------------------------------
    def _note_strays(self, tx: Tx) -> None:
        strays, self._strays = self._strays, []
        if strays:
            self.gate.apply_strays(tx, strays)
            self._health.note_bad(m.rank for m in strays)

    def _refuse_garbage_ranks(self, tx: Tx) -> list[dsp.Recovery]:
        """A rank that sends mostly what the master quarantines (a hostile or broken build)
        gets no more work: its dispatch is recovered as a dead rank's, and the messages it
        goes on sending are still drained and counted (sampled in the quarantine)."""
        refuse = [r for r in self._health.garbage_senders() if r not in self._failed_ranks]
        recovered = []
        for rank in refuse:
            self._refused.add(rank)
            bad, good = self._health.counts(rank)
            recovered += self._retire_dead(
                tx, [rank], why=f"is refused: {bad} of its {bad + good} messages were "
                                f"quarantined; it gets no more work",
                detail=f"{REFUSED_DETAIL}{bad} of its {bad + good} messages were quarantined")
        return recovered

    def _lost_due(self, now: float) -> bool:
        return not self._lost_checked and now - self._started_at >= self.config.start_wait_s

    def _lose_silent_ranks(self, now: float) -> None:
        """A rank that has not reported READY `start_wait_s` after the start (it never
        started, or hangs before it could) would hold the stop and the stall watch for ever:
        it is treated as lost. A READY from it later takes it back (a slow node)."""
        heard = self._health.heard
        for rank in sorted(self._lost & heard):
            self._lost.discard(rank)
            print(f"coordinator: rank {rank} reported READY at last; it gets work",
                  file=sys.stderr, flush=True)
        if not self._lost_due(now):
            return
        self._lost_checked = True
        silent = [r for r in range(1, self.transport.size)
                  if r not in heard and r not in self._failed_ranks]
        if silent:
            self._lost.update(silent)
            self._idle = [r for r in self._idle if r not in self._lost]
            # With no live rank left the run stops: a late READY would find no master.
            later = ("one that reports READY later gets work" if self.live_workers() else
                     "none is left to wait for; if they are only slow to start, give a longer "
                     "--start-wait")
            print(f"coordinator: rank{'s' * (len(silent) != 1)} {_ranks(silent)} reported no "
                  f"READY {self.config.start_wait_s:g} s after the start; treated as lost (no "
                  f"work, not waited for at the stop; {later})", file=sys.stderr, flush=True)
        if not self.live_workers() and self._stop_signal is None:
            print("coordinator: no workers left; stopping (the campaign is saved: continue "
                  "with --resume)", file=sys.stderr, flush=True)
            self._stop_signal = NO_WORKERS_LEFT
            self._stop_at = now

    def fence(self, ranks: list[int], term_wait_s: float = 1.0) -> list[int]:
        """End the given ranks' processes if they run on this host, by the pid each reported
        in its READY (`processes.fence`); the ranks fenced."""
        if not ranks:
            return []
        try:
            with self.store.reading() as conn:
                where = where_they_run(conn)
        except Exception:  # the database may be what failed; then nothing can be fenced
            return []

        def refused(rank: int, pid: int | None, why: str) -> None:
            if pid is not None:
                print(f"coordinator: rank {rank} reported pid {pid}, which is not fenced: "
                      f"{why}", file=sys.stderr, flush=True)
        return fence(ranks, where, term_wait_s, refused)

    def _send_stop(self, rank: int, *, finalize: bool) -> str | None:
        """A tokenized STOP with a fresh token to `rank`: the token, or None if the send
        failed (the rank is then not waited for)."""
        self._stop_seq += 1
        token = mint_token(self.store.epoch, -rank, self._stop_seq)
        try:
            self.transport.send_stop(encode(Stop(token=token, finalize=finalize)), rank)
        except SendFailed as e:
            log.error("%s", e)
            return None
        return token

    def _take_acks(self, tokens: dict[int, str]) -> list[int]:
        """The ranks whose STOP_ACK waiting now echoes exactly their STOP's token."""
        acked = []
        inbox, self._ack_inbox = self._ack_inbox, []
        for got in [*inbox, *self.transport.drain(TAG_STOP_ACK, max_bytes=1 << 20)]:
            body = (decode_inbound(got.data, MAX_SMALL_MESSAGE_BYTES) if got.data is not None
                    else None)
            token = body.get("token") if isinstance(body, dict) else None
            if got.rank in tokens and token == tokens[got.rank]:
                acked.append(got.rank)
                continue
            # Quarantined (sampled, counted); said a few times, not once each (a forged flood
            # printed 25,059 lines).
            self._strays.append(self._stray(got, "a STOP_ACK whose token is not its STOP's"))
            self._forged_acks += 1
            if self._forged_acks <= 3:
                log.warning("rank %d: STOP_ACK with a token that is not its STOP's%s", got.rank,
                            " (further ones are counted in the quarantine, not said)"
                            if self._forged_acks == 3 else "")
        return acked

    def _apply_late(self, tx: Tx, results: list[Inbound], readies: list[Inbound]) -> None:
        """Answers that come while the stop waits for the STOP_ACKs: applied as in any round,
        READY, then RESULT (committed: its dispatch is still in flight), then the sweep (a
        READY joined with an invalid RESULT rolled back, a batch in halves, not returned
        whole by the stop as if unfinished)."""
        self._unparked += self.gate.apply_ready(tx, readies).recovered_workers
        self.summary.committed += len(self.gate.apply_results(tx, results).committed)
        self.gate.sweep(tx)

    def _stop_workers(self) -> tuple[list[int], list[int]]:
        """Tokenized STOP to each worker once it has shown READY; wait, bounded, for the
        exact-token STOP_ACK. A run that ends meanwhile is committed as in any round (its
        dispatch is still in flight: the longest runs, SymCC's, are the ones still going when
        the grace period ends, and their results were quarantined as `unowned` and the runs
        done again); what is still in flight at the end goes back to the queue. Returns the
        ranks that never acknowledged, and the tasks returned to the queue."""
        pending = set(self.live_workers())
        with self.store.reading() as conn:
            # (a rank whose READY came before its RESULT has shown it too)
            shown_ready = ranks_in_state(conn, WorkerState.IDLE) | dsp.ready_seen(conn)
        stop_tokens: dict[int, str] = {}
        acked: set[int] = set()
        deadline = time.monotonic() + self.config.stop_wait_s
        paused = self._gaps.total_s
        backoff = Backoff()
        while pending and time.monotonic() < deadline:
            progressed = False
            for rank in self._take_failed():  # died while stopping: nothing to ack
                self._failed_ranks.add(rank)
                pending.discard(rank)
            results, readies = self._receive()
            # The job stopped and continued meanwhile (`_notice_pause`, ticked by the
            # receive): the ranks did not run either, and are owed that time.
            deadline += self._gaps.total_s - paused
            paused = self._gaps.total_s
            if readies or results or self._strays:
                progressed = True
                began = time.monotonic()
                with self._tx("drain during stop") as tx:
                    # A wait for another process's write lock (a shell, a backup) is not the
                    # workers' time: they still get all of --stop-wait to acknowledge (a lock
                    # held through the stop once used it up, and ranks that had finished were
                    # reported unacknowledged and killed). The master's own work is not
                    # credited: when it was, a rank answering its STOP with garbage moved the
                    # deadline on with each round it cost (a 5 s --stop-wait lasted 9-16 s).
                    deadline += time.monotonic() - began
                    self._apply_late(tx, results, readies)
                    self._note_strays(tx)
                self._tell_unparked()
                shown_ready.update(m.rank for m in readies)
            # A rank that has not taken its last WORK yet may have shown an older READY: its
            # STOP waits until it has (a worker takes a STOP first, and would finalize with
            # that WORK never taken, which MPI_Finalize could wait on for ever).
            untaken = self.transport.posted_to(TAG_WORK)
            for rank in sorted(pending & shown_ready - set(stop_tokens) - untaken):
                token = self._send_stop(rank, finalize=not self.transport.any_failed)
                if token is None:  # (not waited for; ended below unless it is dead)
                    pending.discard(rank)
                    self._failed_ranks.add(rank)
                else:
                    stop_tokens[rank] = token
                progressed = True
            for rank in self._take_acks(stop_tokens):
                pending.discard(rank)
                acked.add(rank)
                progressed = True
            if progressed:
                backoff.reset()
            else:
                backoff.wait()
        # A worker sends its RESULT before its READY and STOP_ACK, but the master drains each
        # tag on its own: a RESULT that came before the last acknowledgement is applied
        # before its task could go back to the queue.
        results, readies = self._receive()
        # Acknowledged ranks are stopped even if they then exit without finalizing (ULFM
        # reports that exit as a failure).
        with self._tx("graceful stop: in-flight work back to the queue") as tx:
            if results or readies:
                self._apply_late(tx, results, readies)
            back = dsp.requeue_in_flight(tx, earlier_incarnations=False,
                                         charged_ranks=self._gone_ranks(tx))
            set_workers(tx, [(r, WorkerState.STOPPED) for r in sorted(acked)])
            self._note_strays(tx)
        # Ranks lost at the start, refused, or sent to in vain (a send that failed for
        # another reason than their death) are alive as far as MPI knows, and would hold
        # the job open: ended with the unacknowledged ones.
        self._take_failed()
        alive = (self._lost | self._refused | self._failed_ranks) - self._dead
        return sorted(pending | alive), back


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


class LockWaiter:
    """Says what a write waits for: at the first try that found the campaign's write lock
    held by another process, then once a minute, naming the holder (on this host) and how
    long the master waits at most."""

    EVERY_S = 60.0

    def __init__(self, path: Path, lock_wait_s: float):
        self.path, self.lock_wait_s = path, lock_wait_s
        self._next_at = 0.0

    def __call__(self, waited: float) -> None:
        if waited < self._next_at - self.EVERY_S:  # a new wait: say it at once
            self._next_at = 0.0
        if waited < self._next_at:
            return
        self._next_at = waited + self.EVERY_S
        holders = [describe_process(p) for p in write_lock_holders(self.path)]
        print(f"coordinator: waiting {waited:.0f} s for the campaign's write lock, held by "
              + (", ".join(holders) if holders else "another process (not on this host?)")
              + f" (a sqlite3 shell with a transaction open, a backup?); the run goes on once "
              f"it is released, answers that arrive meanwhile are kept; it stops after "
              f"--lock-wait {self.lock_wait_s:g} s", file=sys.stderr, flush=True)


class RankHealth:
    """What each rank's messages were: answers that moved its work on (a current READY or
    RESULT), and ones the master quarantined. A rank past GARBAGE_AFTER quarantined messages,
    more than GARBAGE_RATIO times its good ones, sends mostly garbage. An idle READY counts as
    neither: it costs a rank nothing, so one sent beside every nine pieces of garbage kept a
    flooding rank from ever being refused. A current RESULT whose payload was refused is
    garbage, not good: counted good, a rank that answered each WORK with 2,000 of them was
    never refused, and went on taking tasks to fail (42 deferred in 32 s)."""

    GARBAGE_AFTER = 1_000
    GARBAGE_RATIO = 10

    def __init__(self) -> None:
        self.good: dict[int, int] = {}
        self.bad: dict[int, int] = {}
        self.heard: set[int] = set()  # ranks whose READY came, whatever it said

    def note(self, readies: Sequence[tuple[int, object]],
             results: Sequence[tuple[int, object]], rejected: Sequence[int] = (),
             repeated: Sequence[int] = ()) -> None:
        """`rejected`: the rank of each current RESULT among `results` whose payload was
        refused (`ResultRound.rejected`); `repeated`: of each current READY among `readies`
        that repeated one already seen (`ReadyRound.repeated`), which counts as neither."""
        for rank, status in readies:
            self.heard.add(rank)
            if status is not ReadyStatus.IDLE:
                self._count(rank, status is ReadyStatus.CURRENT)
        for rank, status in results:
            self._count(rank, status is ResultStatus.CURRENT)
        for rank in rejected:
            self.good[rank] -= 1
            self._count(rank, False)
        for rank in repeated:
            self.good[rank] -= 1

    def note_bad(self, ranks) -> None:
        for rank in ranks:
            self._count(rank, False)

    def _count(self, rank: int, good: bool) -> None:
        counts = self.good if good else self.bad
        counts[rank] = counts.get(rank, 0) + 1

    def counts(self, rank: int) -> tuple[int, int]:
        return self.bad.get(rank, 0), self.good.get(rank, 0)

    def garbage_senders(self) -> list[int]:
        return sorted(r for r, bad in self.bad.items() if bad >= self.GARBAGE_AFTER
                      and bad > self.GARBAGE_RATIO * self.good.get(r, 0))


def _work(tx: Tx, p: dsp.Planned) -> Work:
    """The WORK of a planned dispatch: its task, or each of a batch's."""
    if not p.more:
        return Work(token=p.token, task=p.task.payload,
                    input=task_ops.input_bytes(tx, p.task.input_hash))
    return Work(token=p.token, task={}, batch=[
        BatchTask(t.payload, task_ops.input_bytes(tx, t.input_hash)) for t in p.tasks])


def _unsendable(tx: Tx, task: task_ops.TaskRecord) -> bool:
    try:
        encode(BatchTask(task.payload, task_ops.input_bytes(tx, task.input_hash)))
    except ENCODE_ERRORS:
        return True
    return False


def _what_became(rec: dsp.Recovery, its: str = "") -> str:
    """What a recovery did with the dispatch's tasks, for a console line."""
    if rec.halves is not None:
        a, b = rec.halves
        return (f"its {len(a) + len(b)} tasks go back to the queue in halves of {len(a)} and "
                f"{len(b)}, none charged")
    return f"{its}task {rec.task_id} {_OUTCOME_WORDS.get(rec.outcome, rec.outcome.value)}"
