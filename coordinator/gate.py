"""The generation gate: applies one phase's drained messages to the store in one transaction.

The master loop (docs/protocol.md §3) calls, every round and in this order: `apply_ready` (drain
READY), `plan_dispatches` (dispatch; committed before any send), `apply_results` (drain RESULT),
`sweep` (recovery) and `watchdog`. No MPI here: messages arrive already decoded (or as
`Undecodable`), so the whole protocol can be driven from tests with real database files.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from store import dispatches as dsp
from store import tasks as task_ops
from store import workers as wrk
from store.campaign import Store
from store.journal import Tx
from store.schema import Channel, EventKind, QuarantineReason, WorkerState

from .protocol import (
    INVALIDATING,
    READY_TOKEN_KEY,
    ReadyStatus,
    ResultStatus,
    classify_ready,
    classify_result,
    mint_token,
    ready_info,
    ready_problem,
    shown,
)
from .wire import (
    INTERRUPTED_STATUS,
    MAX_COUNT,
    NOT_RUN_STATUS,
    RESULT_STATUSES,
    RETRY_STATUSES,
    SPLIT_STATUS,
    TIMEOUT_STATUS,
    Undecodable,
    failure_detail,
    split_detail,
)

log = logging.getLogger(__name__)


#: How the invalid mark of a batch whose worker asked for a split begins (`sweep` reads it).
SPLIT_MARK = "split: "
#: How much of a `not_run` answer's detail its task's retry reason keeps.
NOT_RUN_REASON_CHARS = 240
#: Ends the reason of a `not_run` that was charged nothing (`coordinator.cooldown`).
NOT_CHARGED = " (not charged: the rank's host failed its previous tasks too)"
#: Ends the reason of an `interrupted` run retried while the master stops.
STOP_NOT_CHARGED = " (not charged: cut short by the job's stop)"


@dataclass(frozen=True)
class Inbound:
    rank: int
    body: object  # a decoded mapping, anything else a decoder produced, or Undecodable
    raw: bytes | bytearray | None = None  # the message's bytes, for `validate` to read again


@dataclass(frozen=True)
class Stray:
    """A message the master received outside the READY and RESULT phases (a STOP_ACK for no
    STOP, a tag it never receives): quarantined as it is, nothing else."""

    rank: int
    channel: Channel
    reason: QuarantineReason
    detail: str


@dataclass
class ReadyRound:
    statuses: list[tuple[int, ReadyStatus]] = field(default_factory=list)
    recovered_workers: list[int] = field(default_factory=list)  # parked ranks back in service
    #: The rank of each current READY whose dispatch's ready mark was already set: an honest
    #: worker sends one per dispatch, so the master's garbage watch does not count it as a
    #: good message (25 of them per WORK kept a rank flooding bad RESULTs from its refusal).
    repeated: list[int] = field(default_factory=list)
    #: The active dispatches as this phase left them (ready marks included), for the phases
    #: that follow in the same transaction: it saves them reading the table again.
    active: dict[int, dsp.ActiveDispatch] | None = None
    #: Likewise the parked ranks and the token each must echo.
    parked: dict[int, str] | None = None


@dataclass
class ResultRound:
    statuses: list[tuple[int, ResultStatus]] = field(default_factory=list)
    #: The rank of each *current* RESULT quarantined for its payload: classified current, but
    #: it moved nothing on, so the master's watch on a rank's garbage counts it as garbage.
    rejected: list[int] = field(default_factory=list)
    committed: list[dsp.CommitItem] = field(default_factory=list)
    retried: list[int] = field(default_factory=list)  # ranks whose run failed (timeout, not_run)
    #: Each accepted current RESULT's (rank, bytes, tasks it answers); bytes None: a batch
    #: too large to answer in one message, which asked for a split.
    sizes: list[tuple[int, int | None, int]] = field(default_factory=list)
    #: The active dispatches as this phase left them (its commits and retries gone).
    active: dict[int, dsp.ActiveDispatch] | None = None


def validate_result(body: Mapping[str, Any], raw: object = None, tasks: int = 1,
                    ) -> tuple[Any, str | None]:
    """The default payload check for a current RESULT of a dispatch of `tasks` tasks: (the
    parsed result, None), or (None, why it is invalid). The master plugs in the strict wire
    schema instead; either way the gate then checks that the value can be stored
    (`dispatches.encode_value`) and that it answers each task once."""
    if body.get("status") not in RESULT_STATUSES:
        return None, (f"status {shown(body.get('status'), 40)} is not one of "
                      f"{sorted(RESULT_STATUSES)}")
    return body, None


def default_commit(tx: Tx, active: dsp.ActiveDispatch, parsed: Any,
                   value_json: str | None, task_id: int | None = None) -> dsp.CommitItem:
    return dsp.CommitItem(active.rank, active.token, task_id, status=str(_status_of(parsed)),
                          value_json=value_json, detail=failure_detail(parsed),
                          dropped=_dropped_of(parsed))


_ABSENT = object()


def _not_run_what(outcome: Any) -> str:
    """What a `not_run` answer's host could not do: its detail's first line."""
    detail = _get(outcome, "detail")
    return detail.strip().partition("\n")[0] if isinstance(detail, str) else ""


def _get(parsed: Any, key: str, default: Any = None) -> Any:
    # The attribute first: a validated result is a Struct, and isinstance(x, Mapping) (an ABC
    # check) costs more than the attribute read, several times per task of a batch.
    got = getattr(parsed, key, _ABSENT)
    if got is not _ABSENT:
        return got
    return parsed.get(key, default) if isinstance(parsed, Mapping) else default


def _status_of(parsed: Any) -> object:
    return _get(parsed, "status")


def _dropped_of(parsed: Any) -> int:
    n = _get(parsed, "dropped", 0)
    return n if type(n) is int and 0 <= n <= MAX_COUNT else 0


def _value_of(parsed: Any) -> object:
    return _get(parsed, "value")


def _reason(body: object, status: str) -> QuarantineReason:
    """The classifier's status, or what made the message undecodable if it has a name of its
    own (`oversized`)."""
    named = body.reason if isinstance(body, Undecodable) else None
    return QuarantineReason(named or status)


def _detail(body: object) -> str | None:
    return body.detail if isinstance(body, Undecodable) else None


class Gate:
    def __init__(self, store: Store, *,
                 validate: Callable[[Mapping[str, Any], Any, int], tuple[Any, str | None]]
                 = validate_result,
                 commit: Callable[..., dsp.CommitItem] = default_commit,
                 salvage: Callable[[Tx, dsp.ActiveDispatch, Any, int], int] | None = None,
                 host_ran: Callable[[Tx, int, str | None], bool] | None = None,
                 stopping: Callable[[], bool] = lambda: False,
                 misbehaved: Callable[[int, str], None] | None = None,
                 timed_out: Callable[[int, int], None] | None = None):
        """`salvage`: keeps what a current run that is retried already produced (the test
        cases a timed-out SymCC run wrote), returning how many were kept. `host_ran`: told of
        each current RESULT's rank and, when none of its tasks ran (all `not_run`), what its
        host could not do (None when one ran), in the round's transaction; returns whether
        the `not_run` ones are charged (`coordinator.cooldown`). None: they always are.
        `stopping`: whether the master is stopping, when an `interrupted` run (cut short by the
        signal that stops the job) is charged nothing. `misbehaved`: told of each rank whose
        dispatch the sweep rolls back for the rank's own invalid RESULT, and why (a split a
        worker asked for is no failure), in the round's transaction. `timed_out`: told of
        each current RESULT's rank and how many of its runs it said timed out (the master
        judges whether any run could have, so soon)."""
        self.store = store
        self.validate, self.commit, self.salvage = validate, commit, salvage
        self.host_ran, self.stopping, self.misbehaved = host_ran, stopping, misbehaved
        self.timed_out = timed_out
        self._seq = itertools.count(1)

    # -- phase 1: READY --------------------------------------------------------------------
    def apply_ready(self, tx: Tx, msgs: Sequence[Inbound], *,
                    active: dict[int, dsp.ActiveDispatch] | None = None,
                    parked: dict[int, str] | None = None) -> ReadyRound:
        """`active` and `parked`, if given, are the state as the phases before this one in
        the same transaction left it (`ResultRound.active`, `ReadyRound.parked`); they are
        updated in place. None reads them from the store."""
        out = ReadyRound(active=active, parked=parked)
        if not msgs:
            return out
        if active is None:
            active = out.active = dsp.active_by_rank(tx)
        if parked is None:
            parked = out.parked = wrk.parked_tokens(tx)
        bitmap = self.store.bitmap_version
        for m in msgs:
            a = active.get(m.rank)
            parked_token = parked.get(m.rank) if a is None else None
            expected = a.token if a is not None else parked_token
            status = classify_ready(m.body, expected,
                                    consistent=a.consistent if a is not None else True)
            problem = (ready_problem(m.body, m.rank)  # type: ignore[arg-type]
                       if status is not ReadyStatus.MALFORMED else None)
            if problem is not None:
                status = ReadyStatus.MALFORMED
            out.statuses.append((m.rank, status))
            unparked = status is ReadyStatus.CURRENT and parked_token is not None
            if status is ReadyStatus.IDLE or unparked:
                info = ready_info(m.body, bitmap)  # type: ignore[arg-type]
                wrk.accept_versions(tx, m.rank, info.bitmap_version, info.profile_version,
                                    info.host, info.pid)
                if unparked:
                    # A parked rank echoed exactly its retired token: alive and free again.
                    tx.event(EventKind.WORKER_RECOVERED, rank=m.rank, token=parked_token)
                    del parked[m.rank]
                    out.recovered_workers.append(m.rank)
            elif status is ReadyStatus.CURRENT:
                assert a is not None
                if a.ready:  # (the mark is set: nothing to write)
                    out.repeated.append(m.rank)
                    continue
                dsp.set_ready_mark(tx, m.rank, a.token)
                active[m.rank] = a.with_ready_mark()
            else:
                token = m.body.get(READY_TOKEN_KEY) if isinstance(m.body, Mapping) else None
                detail = problem or _detail(m.body)
                if status is ReadyStatus.UNOWNED:
                    detail = (f"ownership rows disagree for dispatch {a.token if a else None}: "
                              f"its task is not active")
                    log.error("rank %d: %s", m.rank, detail)
                tx.quarantine(Channel.READY, _reason(m.body, status.value), m.rank,
                              token=token, expected=expected, detail=detail)
        return out

    # -- phase 2: dispatch -----------------------------------------------------------------
    def plan_dispatches(self, tx: Tx, idle_ranks: Sequence[int], *,
                        deadline_s: float | None = None,
                        active: dict[int, dsp.ActiveDispatch] | None = None,
                        batch: int = 1, spread: bool = False) -> list[dsp.Planned]:
        """Pick queued tasks for idle ranks and record the dispatches (the caller commits the
        transaction, then sends WORK, then reports failed sends: `dispatches.cancel_dispatch`).
        `active`, if given, is kept up to date for the phases that follow.

        `batch`: up to that many tasks per dispatch, in queue order; a task of a broken batch
        split back goes out in a dispatch of at most its half's size (`tasks.batch_cap`), so
        a poison task's dispatches halve until it goes alone, across restarts too. `spread`:
        fewer queued tasks than the idle ranks could take are shared out evenly (automatic
        batches: the last tasks of a queue are not all handed to the first idle rank)."""
        picked = task_ops.take_queued(tx, len(idle_ranks) * batch)
        if spread and idle_ranks and len(picked) < len(idle_ranks) * batch:
            batch = max(1, -(-len(picked) // len(idle_ranks)))
        deadline = tx.now + deadline_s if deadline_s else None
        plan = []
        at = 0
        for rank in idle_ranks:
            if at == len(picked):
                break
            group = picked[at:at + max(batch, 1)]
            if any(t.batch_cap for t in group):  # (a broken batch's halves: each within its cap)
                cap, kept = batch, 0
                for t in group:
                    cap = min(cap, t.batch_cap or cap)
                    if kept >= cap:
                        break
                    kept += 1
                group = group[:kept]
            at += len(group)
            plan.append(dsp.Planned(rank, group[0], mint_token(self.store.epoch, rank,
                                                               next(self._seq)),
                                    deadline, tuple(group[1:])))
        dsp.record_dispatches(tx, plan)
        if active is not None:
            for p in plan:
                active[p.rank] = dsp.ActiveDispatch(p.token, p.rank, p.task.id, tx.incarnation,
                                                    False, False, None, deadline, True,
                                                    len(p.tasks))
        return plan

    # -- phase 3: RESULT -------------------------------------------------------------------
    def apply_results(self, tx: Tx, msgs: Sequence[Inbound], *,
                      active: dict[int, dsp.ActiveDispatch] | None = None) -> ResultRound:
        out = ResultRound(active=active)
        if not msgs:
            return out
        active = out.active = dict(active) if active is not None else dsp.active_by_rank(tx)
        committed_from: dict[int, dsp.ActiveDispatch] = {}
        for m in msgs:
            a = active.get(m.rank)
            expected = a.token if a is not None else None
            status = classify_result(m.body, expected)
            if status is ResultStatus.CURRENT:
                assert a is not None and isinstance(m.body, Mapping)
                if a.size > 1 and m.body.get("status") == SPLIT_STATUS:
                    # The batch ran, but its outcomes are over the bound on one message: no
                    # refusal, a split (the READY join rolls it back in halves, uncharged).
                    out.statuses.append((m.rank, status))
                    out.sizes.append((m.rank, None, a.size))
                    dsp.set_invalid_mark(tx, m.rank, a.token,
                                         SPLIT_MARK + split_detail(m.body, m.raw))
                    continue
                parsed, why = self.validate(m.body, m.raw, a.size)
                value_json = None
                if why is None:
                    # Encoded once, here, for every validator: what cannot be stored is an
                    # invalid payload, never an exception inside the round's transaction.
                    try:
                        value_json = dsp.encode_value(_value_of(parsed))
                    except (TypeError, ValueError, OverflowError, RecursionError) as e:
                        why = f"value is not JSON-serialisable: {e}"[:300]
                if why is not None:
                    out.statuses.append((m.rank, status))
                    out.rejected.append(m.rank)
                    tx.quarantine(Channel.RESULT, QuarantineReason.PAYLOAD, m.rank,
                                  token=a.token, expected=a.token, detail=why)
                    dsp.set_invalid_mark(tx, m.rank, a.token, QuarantineReason.PAYLOAD.value)
                    continue
                out.statuses.append((m.rank, status))
                batch = (parsed.get("batch") if isinstance(parsed, Mapping)
                         else getattr(parsed, "batch", None))
                more = dsp.members(tx, a.token) if batch is not None or a.size > 1 else []
                if batch is not None or more:
                    why = self._apply_batch(tx, a, parsed, batch, [a.task_id, *more], out)
                    if why is not None:
                        out.rejected.append(m.rank)
                        tx.quarantine(Channel.RESULT, QuarantineReason.PAYLOAD, m.rank,
                                      token=a.token, expected=a.token, detail=why)
                        dsp.set_invalid_mark(tx, m.rank, a.token,
                                             QuarantineReason.PAYLOAD.value)
                        continue
                    committed_from[m.rank] = a
                    del active[m.rank]
                    self._note_size(out, m, a)
                    continue
                self._note_size(out, m, a)
                ran = _status_of(parsed)
                unrun = ran == NOT_RUN_STATUS
                charged = self._charged(tx, m.rank, _not_run_what(parsed) if unrun else None)
                if ran in RETRY_STATUSES:
                    # A valid answer that the run failed: not a result to keep, a task for
                    # the retry policy. The rank frees up once its READY is seen.
                    if ran == TIMEOUT_STATUS and self.timed_out is not None:
                        self.timed_out(m.rank, 1)
                    charged = charged and not (ran == INTERRUPTED_STATUS and self.stopping())
                    dsp.recover_dispatch(tx, m.rank, a.token, cause=EventKind.TASK_FAILED,
                                         reason=self._salvaged(tx, a, parsed, a.task_id,
                                                               charged),
                                         worker_state=WorkerState.BUSY,
                                         charge_attempt=not unrun, charge_budget=charged)
                    out.retried.append(m.rank)
                    del active[m.rank]
                    continue
                out.committed.append(self.commit(tx, a, parsed, value_json))
                committed_from[m.rank] = a
                # Committed within this batch: a duplicate later in it finds no dispatch.
                del active[m.rank]
                continue
            out.statuses.append((m.rank, status))
            token = m.body.get("token") if isinstance(m.body, Mapping) else None
            tx.quarantine(Channel.RESULT, _reason(m.body, status.value), m.rank,
                          token=token, expected=expected, detail=_detail(m.body))
            if status in INVALIDATING:
                assert a is not None
                dsp.set_invalid_mark(tx, m.rank, a.token, status.value)
        # One batch for the round's commits (R5: a commit also drops an earlier invalid mark).
        dsp.commit_results(tx, out.committed, committed_from)
        return out

    def _apply_batch(self, tx: Tx, a: dsp.ActiveDispatch, parsed: Any,
                     batch: Sequence[Any] | None, task_ids: Sequence[int],
                     out: ResultRound) -> str | None:
        """A current RESULT of a batch dispatch: each task's outcome committed (a result row
        each, one token), a task whose own run failed (`timeout`, `not_run`) retried on its
        own. Returns why the payload is invalid instead (then nothing of it is kept)."""
        if batch is None or len(batch) != len(task_ids):
            return (f"payload: the RESULT answers {len(batch) if batch is not None else 1} "
                    f"task(s); the dispatch holds {len(task_ids)}")
        try:
            values = [dsp.encode_value(_value_of(o)) for o in batch]
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            return f"value is not JSON-serialisable: {e}"[:300]
        retry = [_status_of(o) in RETRY_STATUSES for o in batch]
        # (charged the retry budget only: their host could not run them; nothing at all when
        # it is known to fail every task while other ranks run them)
        unrun = {t for t, o in zip(task_ids, batch, strict=True)
                 if _status_of(o) == NOT_RUN_STATUS}
        charged = self._charged(tx, a.rank, _not_run_what(batch[0])
                                if len(unrun) == len(task_ids) else None)
        free = set() if charged else set(unrun)
        cut = {t for t, o in zip(task_ids, batch, strict=True)
               if _status_of(o) == INTERRUPTED_STATUS}
        # (asked only of runs the job's stop cut short: the master may wait for its signal)
        if cut and self.stopping():
            free |= cut
        # What each failed run wrote before it was killed is kept, as for a task on its own.
        failed = {t: self._salvaged(tx, a, o, t, t not in free)
                  for t, o, r in zip(task_ids, batch, retry, strict=True) if r}
        if len(failed) == len(task_ids):
            dsp.retry_all(tx, a.rank, a.token, failed, unrun, free)
            out.retried.append(a.rank)
            self._tell_timeouts(a.rank, batch)
            return None
        rows: Iterable[tuple[int, Any, str | None]] = zip(task_ids, batch, values, strict=True)
        if failed:  # before the commits, which end the dispatch
            dsp.end_without_result(tx, a.rank, a.token, failed, unrun, free)
            out.retried.append(a.rank)
            rows = [row for row, r in zip(rows, retry, strict=True) if not r]
        commit = self.commit
        out.committed += [commit(tx, a, o, value, t) for t, o, value in rows]
        if failed:
            self._tell_timeouts(a.rank, batch)
        return None

    @staticmethod
    def _note_size(out: ResultRound, m: Inbound, a: dsp.ActiveDispatch) -> None:
        # Only a RESULT whose payload was accepted sizes the batches: a rank answering each
        # WORK with a 62 MB invalid one, then a valid one, cut every rank's batches from 20
        # tasks to about 2.6.
        if m.raw is not None:
            out.sizes.append((m.rank, len(m.raw), a.size))

    def _tell_timeouts(self, rank: int, batch: Sequence[Any]) -> None:
        timeouts = sum(_status_of(o) == TIMEOUT_STATUS for o in batch)
        if timeouts and self.timed_out is not None:
            self.timed_out(rank, timeouts)

    def _charged(self, tx: Tx, rank: int, unrun: str | None) -> bool:
        return True if self.host_ran is None else self.host_ran(tx, rank, unrun)

    def _salvaged(self, tx: Tx, a: dsp.ActiveDispatch, outcome: Any, task_id: int,
                  charged: bool = True) -> str:
        """A run of `task_id` that is retried (`timeout`, `not_run`): the test cases it wrote
        kept, and the reason its retry is recorded with (for a task its host could not run,
        what failed: the operator has a host to fix)."""
        status = str(_status_of(outcome))
        if status == NOT_RUN_STATUS:
            return (f"{status} on rank {a.rank}: {_not_run_what(outcome)}"
                    [:NOT_RUN_REASON_CHARS].rstrip()
                    + ("" if charged else NOT_CHARGED))
        kept = self.salvage(tx, a, outcome, task_id) if self.salvage is not None else 0
        return (status + (f" ({kept} test case{'s' * (kept != 1)} kept)" if kept else "")
                + ("" if charged else STOP_NOT_CHARGED))

    def apply_strays(self, tx: Tx, strays: Sequence[Stray]) -> None:
        for m in strays:
            tx.quarantine(m.channel, m.reason, m.rank, detail=m.detail)

    # -- phase 4: recovery sweep -----------------------------------------------------------
    def sweep(self, tx: Tx) -> list[dsp.Recovery]:
        """R3–R6: roll back every dispatch whose READY and invalid RESULT joined."""
        recovered = []
        for rank, token, why in dsp.find_joined(tx):
            # A batch too large for one RESULT, which its worker asked to split: no failure.
            asked = why.startswith(SPLIT_MARK)
            rec = dsp.recover_dispatch(tx, rank, token, reason=why if asked else "invalid result",
                                       cause=EventKind.SPLIT if asked else EventKind.RECOVERED)
            if rec is not None:
                recovered.append(rec)
                if not asked and self.misbehaved is not None:
                    self.misbehaved(rank, why)
        return recovered

    # -- phase 5: watchdog -----------------------------------------------------------------
    def watchdog(self, tx: Tx) -> list[dsp.Recovery]:
        """Dispatches past their deadline: recovered; a rank whose READY was not seen is
        parked until it echoes the retired token (a rank that did send it is free)."""
        recovered = []
        for rank, token in dsp.find_expired(tx):
            rec = dsp.recover_dispatch(tx, rank, token, cause=EventKind.WATCHDOG,
                                       reason="watchdog deadline", worker_state=WorkerState.PARKED)
            if rec is not None:
                recovered.append(rec)
        return recovered
