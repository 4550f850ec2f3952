"""The generation gate and the store under arbitrary interleavings (Hypothesis stateful).

A model of the master's protocol state (dispatches, marks, worker states, queue order, retry
budget, quarantine and event counts) is driven side by side with a real `Store` + `Gate` on a
real SQLite file. After every step the file itself is checked: by the store's audit
(`store.audit`: integrity, foreign keys, task states against their rows, one result per task,
one record per dispatch, no commit from an ended or retired token, leases owned by their
dispatch, the statistics against the rows they count) -- and the whole observable state
against the model.

The model is an independent oracle: it classifies READY and RESULT messages from docs/protocol.md §3
on its own, without calling `coordinator.protocol`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_task_transitions_allowed, log_task_transitions
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sqlalchemy import text

from coordinator.gate import Gate, Inbound
from coordinator.wire import Undecodable
from store import dispatches as dsp
from store.audit import audit
from store.campaign import Store
from store.errors import CampaignExistsError
from store.journal import RetryPolicy
from store.semantic import canonical_json
from store.tasks import NewTask, enqueue_tasks

RANKS = (1, 2, 3)
POLICY = RetryPolicy(retries=1, max_attempts=4)
DEADLINE_S = 5.0
READY_KEY = "completed_dispatch_token"
STATES = ("queued", "active", "done", "deferred", "failed")
_TOKEN = re.compile(r"[0-9a-f]{64}")

# The task catalogue: (name, payload extras, stored input bytes, input file present at start).
# b/c share a target branch and d/f share their stored input (a content lease), so some queued
# tasks must wait while another holds the lease; g's file never exists, a/b/c's files come and
# go, so deferred plain tasks are sometimes refused at resume; d/f (stored) and e
# (continuation) are self-contained.
SHARED = b"shared input bytes"
CATALOG: list[tuple[str, dict[str, Any], bytes | None, bool]] = [
    ("a", {}, None, True),
    ("b", {"target_branch": 7}, None, True),
    ("c", {"target_branch": 7, "focus_bytes": [1, 2]}, None, True),
    ("d", {}, SHARED, False),
    ("e", {"continuation": {"resume_at": 3}}, None, False),
    ("f", {"schedule_prefix": [1, 2]}, SHARED, False),
    ("g", {}, None, False),
]
TOGGLABLE = (0, 1, 2)  # a, b, c: plain tasks whose input file may disappear and come back

TRIGGER = "refuse_deferral"
CREATE_TRIGGER = (f"CREATE TRIGGER {TRIGGER} BEFORE UPDATE OF state ON tasks "
                  f"WHEN NEW.state = 'deferred' "
                  f"BEGIN SELECT RAISE(ABORT, 'injected: the deferral cannot be written'); END")


def _is_token(v: object) -> bool:
    return type(v) is str and _TOKEN.fullmatch(v) is not None


def _fresh_token(*parts: object) -> str:
    """A canonical token that no dispatch was ever given."""
    return hashlib.sha256(("never-issued:" + ":".join(map(str, parts))).encode()).hexdigest()


def _sanitized_bitmap(v: object) -> int:
    return v if type(v) is int and -1 <= v <= 0 else -1  # the campaign's bitmap version is 0


@dataclass
class MTask:
    idx: int
    id: int
    keys: frozenset[tuple[str, str]]  # the non-work leases a dispatch of it holds
    self_contained: bool
    path: str
    state: str = "queued"
    pos: int = 0
    attempts: int = 0
    budget_used: int = 0  # the failures the retry policy decided (not a crash's)
    dispatches: int = 0
    deferred_at: float = 0.0
    refused_said: bool = False  # a resume said its input is gone, and nothing changed since


@dataclass
class MDispatch:
    token: str
    rank: int
    task_id: int
    created: float
    deadline: float | None
    ready: bool = False
    invalid: str | None = None


class GateMachine(RuleBasedStateMachine):
    """One campaign file per example; the model predicts every row the protocol writes."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="stateful-"))
        self.path = self.tmp / "campaign.db"
        (self.tmp / "inputs").mkdir()
        self.now = 1000.0
        self.store: Store | None = None
        self._open(resume=False)
        # Every change of a task's state the store makes, by any statement, through restarts.
        log_task_transitions(self.path)
        # -- the model --
        self.payloads = []
        for name, extra, _stored, present in CATALOG:
            p = str(self.tmp / "inputs" / name)
            self.payloads.append({"path": p, **extra})
            if present:
                Path(p).write_bytes(b"seed " + name.encode())
        self.tasks: dict[int, MTask] = {}       # task id -> model task
        self.by_idx: dict[int, int] = {}        # catalogue index -> task id
        self.blobs: set[bytes] = set()          # input bytes the store holds
        self.active: dict[int, MDispatch] = {}  # rank -> current dispatch
        self.wstate = {r: "unknown" for r in RANKS}
        self.parked: dict[int, str | None] = {r: None for r in RANKS}
        self.bitmap: dict[int, int | None] = {r: None for r in RANKS}
        self.issued: dict[int, list[str]] = {r: [] for r in RANKS}
        self.committed: dict[int, tuple[str, int]] = {}  # task id -> (token, rank)
        self.committed_created: dict[int, float] = {}  # task id -> its dispatch's time
        self.committed_ready: dict[int, bool] = {}  # task id -> its READY was seen first
        self.committed_as_current: set[str] = set()
        self.quarantine: Counter[tuple[str, str]] = Counter()
        self.events: Counter[str] = Counter(campaign=1)
        self.retired: list[tuple[str, int, int, float]] = []  # dispatched events, in order
        self.defer_blocked = False
        self.incarnation = 1
        self.stopping = False  # SIGTERM seen: no more dispatching in this incarnation

    # -- plumbing ----------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def _open(self, *, resume: bool) -> None:
        self.store = Store.open(self.path, resume=resume, policy=POLICY, clock=self._clock,
                                synchronous="NORMAL")
        self.gate = Gate(self.store)

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the model's queue -------------------------------------------------------------------
    def _queued(self) -> list[MTask]:
        return sorted((t for t in self.tasks.values() if t.state == "queued"),
                      key=lambda t: (t.pos, t.id))

    def _head(self) -> int:
        q = [t.pos for t in self.tasks.values() if t.state == "queued"]
        return min(min(q) if q else 0, 0) - 1

    def _tail(self) -> int:
        q = [t.pos for t in self.tasks.values() if t.state == "queued"]
        return (max(q) if q else 0) + 1

    def _to_head(self, t: MTask) -> None:
        t.pos = self._head()
        t.state = "queued"

    def _retry(self, d: MDispatch, *, protocol: bool = True) -> None:
        """_apply_retry, as docs/protocol.md R7/R8 and the ceiling say it must behave. A task whose
        run failed (a `timeout` RESULT) is retried alike but counted apart from protocol
        failures."""
        t = self.tasks[d.task_id]
        t.attempts += 1
        t.budget_used += 1
        if t.attempts >= POLICY.max_attempts:
            t.state = "failed"
            self.events["failed"] += 1
        elif t.budget_used <= POLICY.retries:
            self._to_head(t)
            self.events["requeued" if protocol else "retried"] += 1
        elif self.defer_blocked:
            self._to_head(t)  # R8: the deferral could not be written; never dropped
            self.events["defer_failed"] += 1
        else:
            t.state = "deferred"
            t.deferred_at = self.now
            t.refused_said = False
            self.events["deferred" if protocol else "task_deferred"] += 1

    def _ended_without_result(self, d: MDispatch) -> None:
        """A dispatch that ends any way but its commit is recorded by its `dispatched` event,
        written then (a committed one by its results row)."""
        del self.active[d.rank]
        self.events["dispatched"] += 1
        self.retired.append((d.token, d.rank, d.task_id, d.created))

    def _recover(self, d: MDispatch, *, protocol: bool = True) -> None:
        self._ended_without_result(d)
        self._retry(d, protocol=protocol)

    def _quarantine(self, channel: str, reason: str) -> None:
        self.quarantine[(channel, reason)] += 1

    def _expected_ready(self, rank: int) -> str | None:
        d = self.active.get(rank)
        if d is not None:
            return d.token
        return self.parked[rank] if self.wstate[rank] == "parked" else None

    # -- rules -------------------------------------------------------------------------------
    @initialize(idxs=st.lists(st.integers(0, len(CATALOG) - 1), max_size=5),
                ranks=st.lists(st.sampled_from(RANKS), unique=True))
    def a_running_campaign(self, idxs: list[int], ranks: list[int]) -> None:
        """Most examples start with some work queued and some workers announced."""
        if idxs:
            self.enqueue(idxs, False)
        for r in ranks:
            self.ready_empty(r, 0)

    @precondition(lambda self: len(self.by_idx) < len(CATALOG))
    @rule(idxs=st.lists(st.integers(0, len(CATALOG) - 1), min_size=1, max_size=3),
          skip_known_content=st.booleans())
    def enqueue(self, idxs: list[int], skip_known_content: bool) -> None:
        """New work at the tail; a known payload is the same task (INSERT OR IGNORE); with
        `skip_known_content` (what results feed back), known input bytes are not enqueued."""
        with self.store.transaction() as tx:
            created = enqueue_tasks(tx, [NewTask(self.payloads[i], CATALOG[i][2]) for i in idxs],
                                    skip_known_content=skip_known_content)
        fresh: list[int] = []
        for i in idxs:
            stored = CATALOG[i][2]
            if i in self.by_idx or i in fresh:
                continue
            if skip_known_content and stored is not None and stored in self.blobs:
                continue
            fresh.append(i)
            if stored is not None:
                self.blobs.add(stored)
        assert len(created) == len(fresh), (idxs, created, fresh)
        pos = self._tail()
        for i, tid in zip(fresh, created, strict=True):
            name, extra, stored, _ = CATALOG[i]
            keys = set()
            if "target_branch" in extra:
                keys.add(("target", str(extra["target_branch"])))
            if stored is not None:
                keys.add(("content", hashlib.sha256(stored).hexdigest()))
            if "schedule_prefix" in extra:
                keys.add(("schedule", canonical_json(extra["schedule_prefix"])))
            self.tasks[tid] = MTask(i, tid, frozenset(keys),
                                    stored is not None or "continuation" in extra,
                                    self.payloads[i]["path"], pos=pos)
            self.by_idx[i] = tid
            self.events["enqueued"] += 1
            pos += 1

    # -- READY -------------------------------------------------------------------------------
    def _ready_body(self, rank: int, kind: str, bitmap: object, data: st.DataObject) -> object:
        expected = self._expected_ready(rank)
        own = [t for t in self.issued[rank] if t != expected]
        others = [t for r in RANKS if r != rank for t in self.issued[r]]
        base = expected or (self.issued[rank][-1] if self.issued[rank] else _fresh_token(rank))
        token: object = None
        if kind == "current":
            token = expected if expected is not None else ""
        elif kind == "empty":
            token = ""
        elif kind == "stale":  # an earlier token of this rank (from any incarnation)
            token = data.draw(st.sampled_from(own)) if own else _fresh_token("stale", rank)
        elif kind == "foreign":  # a token another rank was given
            token = data.draw(st.sampled_from(others)) if others else _fresh_token("f", rank)
        elif kind == "never_issued":
            token = _fresh_token(self.now, rank, len(self.issued[rank]))
        elif kind == "upper":
            token = base.upper()
        elif kind == "list":
            token = [base]
        elif kind == "short":
            token = base[:63]
        elif kind == "number":
            token = 12345
        body: dict[str, Any] = {"rank": rank, "bitmap_version": bitmap,
                                "empirical_profile_version": "p1", READY_KEY: token}
        if kind == "absent":
            del body[READY_KEY]
        elif kind == "not_mapping":
            return [rank, base]
        elif kind == "undecodable":
            return Undecodable("truncated msgpack")
        return body

    def _send_ready(self, rank: int, body: object, bitmap: object = 0) -> str:
        """Apply one READY; the oracle is docs/protocol.md §3's READY table. Returns the status."""
        expected = self._expected_ready(rank)
        if not isinstance(body, dict):
            status = "malformed"
        else:
            tok = body.get(READY_KEY)
            present = tok is not None and tok != ""
            if present and not _is_token(tok):
                status = "malformed"
            elif expected is None:
                status = "idle"
            elif not present:
                status = "missing"
            else:
                status = "current" if tok == expected else "stale"

        with self.store.transaction() as tx:
            out = self.gate.apply_ready(tx, [Inbound(rank, body)])
        assert [(r, s.value) for r, s in out.statuses] == [(rank, status)]

        if status == "idle":
            self.wstate[rank] = "idle"
            self.bitmap[rank] = _sanitized_bitmap(bitmap)
        elif status == "current" and rank not in self.active:  # a parked rank echoed its token
            assert out.recovered_workers == [rank]
            self.wstate[rank], self.parked[rank] = "idle", None
            self.bitmap[rank] = _sanitized_bitmap(bitmap)
            self.events["worker_recovered"] += 1
        elif status == "current":
            self.active[rank].ready = True  # a column (results.ready_at later), no event
        else:
            self._quarantine("ready", status)
        if status != "current" or rank in self.active:
            assert out.recovered_workers == []
        return status

    @precondition(lambda self: any(self._expected_ready(r) is None for r in RANKS))
    @rule(data=st.data(), bitmap=st.sampled_from([0, -1, -2, 1, True, "0", 0.5]))
    def ready_idle(self, data: st.DataObject, bitmap: object) -> None:
        """A worker's first READY, or a READY after its RESULT committed."""
        rank = data.draw(st.sampled_from([r for r in RANKS if self._expected_ready(r) is None]))
        self.ready_empty(rank, bitmap)

    def ready_empty(self, rank: int, bitmap: object) -> None:
        self._send_ready(rank, {"rank": rank, "bitmap_version": bitmap,
                                "empirical_profile_version": "p1", READY_KEY: ""}, bitmap)

    @precondition(lambda self: any(self._expected_ready(r) for r in RANKS))
    @rule(data=st.data())
    def ready_current(self, data: st.DataObject) -> None:
        rank = data.draw(st.sampled_from([r for r in RANKS if self._expected_ready(r)]))
        self._send_ready(rank, self._ready_body(rank, "current", 0, data))

    @rule(rank=st.sampled_from(RANKS),
          kind=st.sampled_from(["stale", "foreign", "never_issued", "upper", "list", "short",
                                "number", "absent", "not_mapping", "undecodable"]),
          bitmap=st.sampled_from([0, -1, 5, None]),
          data=st.data())
    def ready_odd(self, rank: int, kind: str, bitmap: object, data: st.DataObject) -> None:
        """Stale, foreign, never-issued, malformed or token-less READY messages."""
        self._send_ready(rank, self._ready_body(rank, kind, bitmap, data), bitmap)

    # -- dispatch ----------------------------------------------------------------------------
    @precondition(lambda self: not self.stopping
                  and any(s == "idle" for s in self.wstate.values()))
    @rule(data=st.data())
    def dispatch(self, data: st.DataObject) -> None:
        # (Arguments are drawn inside: Hypothesis favours rules with fewer arguments, and the
        # rules that make progress should not be the rare ones.)
        idle = data.draw(st.permutations(sorted(r for r in RANKS if self.wstate[r] == "idle")))
        with_deadline = data.draw(st.booleans(), label="with_deadline")
        # The model's pick: queue order, skipping tasks whose leases are held or already taken.
        held = {k for d in self.active.values() for k in self.tasks[d.task_id].keys}
        picks: list[MTask] = []
        for t in self._queued():
            if len(picks) == len(idle):
                break
            if t.keys & held:
                continue
            held |= t.keys
            picks.append(t)
        with self.store.transaction() as tx:
            plan = self.gate.plan_dispatches(tx, idle,
                                             deadline_s=DEADLINE_S if with_deadline else None)
        # one dispatch per idle rank, as far as there are tasks to pick
        assert [(p.rank, p.task.id) for p in plan] == [
            (r, t.id) for r, t in zip(idle, picks, strict=False)]
        # Some sends may fail (the rank died): pre-send compensation rewinds those exactly.
        unsent = (data.draw(st.sets(st.sampled_from([p.rank for p in plan])), label="unsent")
                  if plan and data.draw(st.integers(0, 4), label="send_failures") == 0
                  else set())
        with self.store.transaction() as tx:
            for p in plan:
                if p.rank in unsent:
                    assert dsp.cancel_dispatch(tx, p.rank, p.token, detail="send failed")
            dsp.mark_sent(tx, [p.token for p in plan if p.rank not in unsent])
        all_issued = {t for ts in self.issued.values() for t in ts}
        for p, t in zip(plan, picks, strict=False):  # one per idle rank
            assert _is_token(p.token) and p.token not in all_issued
            self.issued[p.rank].append(p.token)
            if p.rank in unsent:  # the task keeps its queue place; nothing is counted
                self.events["send_failed"] += 1
                continue
            self.active[p.rank] = MDispatch(p.token, p.rank, t.id, self.now,
                                            self.now + DEADLINE_S if with_deadline else None)
            t.state = "active"
            t.dispatches += 1
            self.wstate[p.rank] = "busy"

    # -- RESULT ------------------------------------------------------------------------------
    def _result_body(self, rank: int, kind: str, data: st.DataObject,
                     active: dict[int, MDispatch]) -> object:
        d = active.get(rank)
        base = d.token if d else (self.issued[rank][-1] if self.issued[rank]
                                  else _fresh_token("r", rank))
        if kind in ("ok", "error", "timeout"):
            return {"token": base, "status": kind, "value": {"n": 1, "rank": rank}}
        if kind == "bogus":
            return {"token": base, "status": "bogus"}
        if kind == "no_status":
            return {"token": base, "value": 1}
        if kind == "missing":
            return {"status": "ok"}
        if kind == "empty":
            return {"token": "", "status": "ok"}
        if kind == "upper":
            return {"token": base.upper(), "status": "ok"}
        if kind == "list":
            return {"token": [base], "status": "ok"}
        if kind == "not_mapping":
            return ["token", base]
        if kind == "undecodable":
            return Undecodable("bad frame")
        if kind == "stale":  # an earlier token of this rank (from any incarnation): late
            old = [t for t in self.issued[rank] if d is None or t != d.token]
            tok = data.draw(st.sampled_from(old)) if old else _fresh_token("s", rank)
            return {"token": tok, "status": "ok"}
        if kind == "foreign":
            others = [t for r in RANKS if r != rank for t in self.issued[r]]
            tok = data.draw(st.sampled_from(others)) if others else _fresh_token("x", rank)
            return {"token": tok, "status": "ok"}
        assert kind == "duplicate"  # a RESULT already committed from this rank, again
        dup = [tok for tok, r in self.committed.values() if r == rank]
        return {"token": data.draw(st.sampled_from(dup)) if dup else _fresh_token("d", rank),
                "status": "ok"}

    def _send_results(self, msgs: list[tuple[int, str]], data: st.DataObject) -> list[str]:
        """One RESULT drain, all messages in one transaction; the oracle is docs/protocol.md §3's
        RESULT classification. Returns the statuses."""
        bodies: list[Inbound] = []
        expect: list[tuple[int, str]] = []
        commits: list[MDispatch] = []
        retried: list[int] = []
        active = dict(self.active)  # as the batch sees it: a commit retires the rank at once
        for rank, kind in msgs:
            body = self._result_body(rank, kind, data, active)
            bodies.append(Inbound(rank, body))
            d = active.get(rank)
            if d is None:
                status = "unowned"
            elif not isinstance(body, dict):
                status = "malformed"
            elif body.get("token") in (None, ""):
                status = "missing"
            elif not _is_token(body["token"]):
                status = "malformed"
            elif body["token"] != d.token:
                status = "stale"
            else:
                status = "current"
            expect.append((rank, status))
            if status == "current" and body.get("status") == "timeout":
                # A valid answer that the run failed: retried, not committed; the rank frees
                # up once its READY is seen.
                del active[rank]
                self._recover(d, protocol=False)
                self.events["task_failed"] += 1
                self.wstate[rank] = "idle" if d.ready else "busy"
                retried.append(rank)
            elif status == "current" and body.get("status") in ("ok", "error"):
                commits.append(d)
                del active[rank]
            elif status == "current":
                self._quarantine("result", "payload")
                self._mark_invalid(d, "payload")
            else:
                self._quarantine("result", status)
                if status in ("missing", "malformed"):
                    self._mark_invalid(d, status)

        with self.store.transaction() as tx:
            out = self.gate.apply_results(tx, bodies)
        assert [(r, s.value) for r, s in out.statuses] == expect
        assert sorted((c.rank, c.token) for c in out.committed) == sorted(
            (d.rank, d.token) for d in commits)
        assert out.retried == retried
        for d in commits:
            self.committed_as_current.add(d.token)
            self.committed[d.task_id] = (d.token, d.rank)
            self.committed_ready[d.task_id] = d.ready
            self.committed_created[d.task_id] = d.created
            self.tasks[d.task_id].state = "done"
            del self.active[d.rank]
            self.wstate[d.rank] = "idle" if d.ready else "busy"
        return [s for _, s in expect]

    def _mark_invalid(self, d: MDispatch, reason: str) -> None:
        # Only the first invalid RESULT of a dispatch sets the mark and writes its event: the
        # repeats add nothing to the join (each is in the quarantine's counts).
        if d.invalid is None:
            d.invalid = reason
            self.events["invalid"] += 1

    @precondition(lambda self: self.active)
    @rule(data=st.data(), status=st.sampled_from(["ok", "error"]))
    def result_current(self, data: st.DataObject, status: str) -> None:
        rank = data.draw(st.sampled_from(sorted(self.active)))
        assert self._send_results([(rank, status)], data) == ["current"]

    @precondition(lambda self: self.active)
    @rule(data=st.data(), ready_first=st.booleans())
    def result_timeout(self, data: st.DataObject, ready_first: bool) -> None:
        """The executor's run timed out: a valid RESULT that sends the task to the retry
        policy (counted apart from protocol failures)."""
        rank = data.draw(st.sampled_from(sorted(self.active)))
        ready = {"rank": rank, "bitmap_version": 0, "empirical_profile_version": "p1",
                 READY_KEY: self.active[rank].token}
        if ready_first:
            self._send_ready(rank, ready)
        assert self._send_results([(rank, "timeout")], data) == ["current"]
        if not ready_first:
            self._send_ready(rank, ready)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), kind=st.sampled_from(["bogus", "no_status", "missing", "empty",
                                                "upper", "list", "not_mapping",
                                                "undecodable"]))
    def result_invalid(self, data: st.DataObject, kind: str) -> None:
        rank = data.draw(st.sampled_from(sorted(self.active)))
        self._send_results([(rank, kind)], data)

    @rule(msgs=st.lists(st.tuples(
              st.sampled_from(RANKS),
              st.sampled_from(["ok", "ok", "error", "timeout", "bogus", "missing", "upper",
                               "not_mapping", "stale", "stale", "foreign", "duplicate",
                               "duplicate"])),
          min_size=1, max_size=3),
          data=st.data())
    def result_drain(self, msgs: list[tuple[int, str]], data: st.DataObject) -> None:
        """A drain of 1-3 RESULTs from any ranks: late, stale, duplicate, same-round repeats."""
        self._send_results(msgs, data)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def worker_finishes(self, data: st.DataObject) -> None:
        """What a live worker does (R1): RESULT, then READY with its token -- observed by the
        master in either order; then, maybe, the round's recovery sweep."""
        kind = data.draw(st.sampled_from(["ok", "ok", "error", "bogus", "missing"]),
                         label="kind")
        self._worker(data, data.draw(st.booleans(), label="ready_first"),
                     data.draw(st.booleans(), label="then_sweep"), kind)

    def _worker(self, data: st.DataObject, ready_first: bool, then_sweep: bool,
                kind: str) -> None:
        rank = data.draw(st.sampled_from(sorted(self.active)))
        token = self.active[rank].token
        ready = {"rank": rank, "bitmap_version": 0, "empirical_profile_version": "p1",
                 READY_KEY: token}
        if ready_first:
            self._send_ready(rank, ready)
            self._send_results([(rank, kind)], data)
        else:
            self._send_results([(rank, kind)], data)
            self._send_ready(rank, ready)
        if then_sweep:
            self.sweep()

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def worker_breaks(self, data: st.DataObject) -> None:
        """A worker whose RESULT arrives broken, then its READY (either order), then the
        round's sweep: the join recovers the dispatch (R3-R6) and the retry policy runs."""
        kind = data.draw(st.sampled_from(["bogus", "no_status", "missing", "empty", "upper",
                                          "list", "not_mapping", "undecodable"]), label="kind")
        self._worker(data, data.draw(st.booleans(), label="ready_first"), True, kind)

    @precondition(lambda self: self.active)
    @rule()
    def sweep(self) -> None:
        joined = [self.active[r] for r in sorted(self.active)
                  if self.active[r].ready and self.active[r].invalid]
        with self.store.transaction() as tx:
            recs = self.gate.sweep(tx)
        assert [(r.rank, r.token) for r in recs] == [(d.rank, d.token) for d in joined]
        for d, rec in zip(joined, recs, strict=True):
            self._recover(d)
            self.wstate[d.rank] = "idle"  # its current READY was seen
            self.events["recovered"] += 1
            t = self.tasks[d.task_id]
            assert (rec.outcome.value, rec.attempts, rec.defer_failed) == (
                "queued" if t.state == "queued" else t.state, t.attempts,
                self.defer_blocked and t.state == "queued" and t.budget_used > POLICY.retries)

    def _deadlines(self) -> bool:
        return any(d.deadline is not None for d in self.active.values())

    @precondition(_deadlines)
    @rule(dt=st.sampled_from([1.0, DEADLINE_S, 6.0]))  # DEADLINE_S: exactly at a deadline
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @precondition(_deadlines)
    @rule()
    def watchdog(self) -> None:
        """Dispatches past their deadline are retired (no join will come: the worker died or
        hung, or its RESULT was lost after its READY). A rank whose READY was not seen is
        parked until it echoes the retired token; one that did send it is free."""
        expired = [self.active[r] for r in sorted(self.active)
                   if self.active[r].deadline is not None and self.active[r].deadline < self.now]
        with self.store.transaction() as tx:
            recs = self.gate.watchdog(tx)
        assert [(r.rank, r.token) for r in recs] == [(d.rank, d.token) for d in expired]
        for d in expired:
            self._recover(d)
            self.events["watchdog"] += 1
            if d.ready:
                self.wstate[d.rank] = "idle"
            else:
                self.wstate[d.rank], self.parked[d.rank] = "parked", d.token

    @precondition(lambda self: self.active)
    @rule()
    def toggle_deferral_failure(self) -> None:
        """Make every deferral write fail (as a full disk would), or heal it again."""
        sql = f"DROP TRIGGER {TRIGGER}" if self.defer_blocked else CREATE_TRIGGER
        with self.store.engine.begin() as conn:
            conn.exec_driver_sql(sql)
        self.defer_blocked = not self.defer_blocked

    @precondition(lambda self: any(t.state == "deferred" for t in self.tasks.values()))
    @rule(i=st.sampled_from(TOGGLABLE))
    def toggle_input(self, i: int) -> None:
        p = Path(self.payloads[i]["path"])
        if p.exists():
            p.unlink()
        else:
            p.write_bytes(b"back again")

    @precondition(lambda self: self.active and not self.stopping)
    @rule()
    def graceful_stop(self) -> None:
        """SIGTERM: this incarnation's in-flight work goes back to the queue head, no attempt
        counted, oldest dispatch first; a rank whose READY was seen is idle, the others are
        still running (busy) until their READY."""
        order = sorted(self.active.values(), key=lambda d: (d.created, d.rank), reverse=True)
        with self.store.transaction() as tx:
            requeued = dsp.requeue_in_flight(tx, earlier_incarnations=False)
        assert requeued == [d.task_id for d in reversed(order)]  # oldest first, as queued
        self.stopping = True
        for d in order:
            self._ended_without_result(d)
            self._to_head(self.tasks[d.task_id])
            if d.ready:
                self.wstate[d.rank] = "idle"
            self.events["stop_requeued"] += 1

    @precondition(lambda self: self.incarnation < 4 and (
        self.stopping or self.active or any(t.state == "deferred" for t in self.tasks.values())))
    @rule()
    def restart(self) -> None:
        """The master dies (or stopped) and is started again: refused without resume, then
        restart recovery with resume=True."""
        self.store.close()
        self.store = None
        with pytest.raises(CampaignExistsError):
            Store.open(self.path, policy=POLICY, clock=self._clock)
        self._open(resume=True)
        self.incarnation += 1
        self.stopping = False
        self.events["campaign"] += 1
        # Dispatches of the dead incarnation: the attempt counts, the ceiling applies, the
        # immediate-retry budget does not; newest first to the head, so the oldest leads.
        interrupted = sorted(self.active.values(), key=lambda d: (d.created, d.rank),
                             reverse=True)
        for d in interrupted:
            self._ended_without_result(d)
            t = self.tasks[d.task_id]
            t.attempts += 1
            self.events["interrupted"] += 1
            if t.attempts >= POLICY.max_attempts:
                t.state = "failed"
                self.events["failed"] += 1
            else:
                self._to_head(t)
        # R9: deferred tasks that can still run go first, oldest deferral first.
        deferred = sorted((t for t in self.tasks.values() if t.state == "deferred"),
                          key=lambda t: (t.deferred_at, t.id))
        admitted = [t for t in deferred if t.self_contained or os.path.exists(t.path)]
        refused = [t for t in deferred if t not in admitted]
        pos = self._head() - len(admitted) + 1
        for t in admitted:
            t.state, t.pos = "queued", pos
            pos += 1
        self.events["reclaimed"] += len(admitted)
        for t in refused:  # once per refusal, not again at each resume
            self.events["not_admitted"] += not t.refused_said
            t.refused_said = True
        report = self.store.resume_report
        assert report.interrupted == [d.task_id for d in reversed(interrupted)]
        assert report.reclaimed == [t.id for t in admitted]
        assert report.refused == [t.id for t in refused]
        for r in RANKS:  # new processes: nothing known about the ranks carries over
            self.wstate[r], self.parked[r] = "unknown", None

    # -- invariants, by SQL on the file ------------------------------------------------------
    @invariant()
    def every_task_transition_is_an_allowed_one(self) -> None:
        assert_task_transitions_allowed(self.path)

    @invariant()
    def the_file_agrees(self) -> None:
        if self.store is None:
            return
        with self.store.reading() as conn:
            # What holds for any campaign: store.audit (integrity, foreign keys, task states
            # against their rows, one record per dispatch, no commit from an ended or retired
            # token or for two tasks, leases owned by their dispatch, statistics against the
            # rows they count). The rest is this file against the model.
            report = audit(conn)
            assert report.violations == [], report.text()
            assert report.skipped == []
            stats = report.stats
            q = lambda sql: conn.execute(text(sql)).all()  # noqa: E731

            # Every enqueued task exists, in the model's state; none appeared or vanished.
            rows = {r.id: r for r in q(
                "SELECT id, state, attempts, budget_used, dispatches, queue_pos FROM tasks")}
            assert set(rows) == set(self.tasks)
            for tid, t in self.tasks.items():
                assert rows[tid].state == t.state, (tid, rows[tid], t)
                assert rows[tid].attempts == t.attempts, (tid, rows[tid], t)
                assert rows[tid].budget_used == t.budget_used, (tid, rows[tid], t)
                assert rows[tid].dispatches == t.dispatches, (tid, rows[tid], t)
                if t.state == "queued":
                    assert rows[tid].queue_pos == t.pos, (tid, rows[tid], t)

            # Results: only from a token that was current when it committed, as the model did.
            res = q("SELECT task_id, token, rank, ready_at IS NOT NULL AS ready, dispatched_at "
                    "FROM results")
            for r in res:
                assert r.token in self.committed_as_current, r
            assert {r.task_id: (r.token, r.rank) for r in res} == self.committed
            assert {r.task_id: bool(r.ready) for r in res} == self.committed_ready
            assert {r.task_id: r.dispatched_at for r in res} == self.committed_created
            # ... and every other dispatch that ended, by its `dispatched` event: the time and
            # incarnation it was recorded in, not those of the transaction that ended it.
            assert [tuple(e) for e in q(
                "SELECT token, rank, task_id, at FROM events WHERE kind = 'dispatched' "
                "ORDER BY id")] == self.retired

            # Dispatches: the model's, one per rank.
            disp = q("SELECT token, rank, task_id, ready_at, invalid_reason, deadline, "
                     "sent_at FROM dispatches")
            assert {d.rank: d.token for d in disp} == {
                r: d.token for r, d in self.active.items()}
            for d in disp:
                m = self.active[d.rank]
                assert (d.task_id, d.ready_at is not None, d.invalid_reason, d.deadline) == (
                    m.task_id, m.ready, m.invalid, m.deadline), (d, m)
                assert d.sent_at is not None
            assert not set(self.committed_as_current) & {d.token for d in disp}

            # Leases: exactly the side-table reservations the task names (the task itself is
            # reserved by its dispatch row: no `work` lease).
            leases = q("SELECT token, kind, key FROM leases")
            assert not [lease for lease in leases if lease.kind == "work"]
            for d in disp:
                side = {(lease.kind, lease.key) for lease in leases if lease.token == d.token}
                assert side == set(self.tasks[d.task_id].keys)

            # Workers.
            wrows = {w.rank: w for w in q(
                "SELECT rank, state, parked_token, bitmap_version, incarnation FROM workers")}
            for r in RANKS:
                w = wrows.get(r)
                assert (w.state if w else "unknown") == self.wstate[r], (r, w, self.wstate)
                assert (w.parked_token if w else None) == self.parked[r]
                if self.bitmap[r] is not None:
                    assert w.bitmap_version == self.bitmap[r]
            assert q("SELECT incarnation FROM campaign") == [(self.incarnation,)]

            # Statistics (equal to the rows, by the audit) equal the model's counts.
            assert {(c, r): n for c, rs in stats.quarantine.items() for r, n in rs.items()} == {
                k: n for k, n in self.quarantine.items() if n}
            assert stats.requeued == self.events["requeued"]
            assert stats.deferred == self.events["deferred"]
            assert stats.tasks == {s: sum(t.state == s for t in self.tasks.values())
                                   for s in STATES}
            ev = dict(q("SELECT kind, count(*) FROM events GROUP BY kind"))
            assert ev == {k: n for k, n in self.events.items() if n}


GateMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_gate_state_machine = GateMachine.TestCase
