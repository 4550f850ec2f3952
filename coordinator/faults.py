"""Fault injection, present only when asked for (`--inject`), acting only in the worker's send
path: the master runs its ordinary code and cannot know it is being tested.

    --inject kind=rate[,kind=rate...]   --inject-seed N   --inject-log DIR

Each kind fires independently per dispatch (a batch draws once) with its rate; the same seed
reproduces the same faults on the same rank. With --inject-log every injected fault is appended to
DIR/faults-rank<R>.jsonl (time, kind, token), which tools/fault_campaign.py reads.
"""

from __future__ import annotations

import json
import os
import signal
import time

from .executors import BatchOutcome, ExecOutcome
from .fault_spec import _RESULT_SHAPES, KINDS, FaultPlan, InjectSpecError, parse_inject
from .wire import NOT_RUN_STATUS, encode
from .worker import Sender

__all__ = ["KINDS", "FaultPlan", "FaultySender", "InjectSpecError", "parse_inject"]


class FaultySender(Sender):
    """The worker's one sender, with faults: R1 still holds whenever no fault fires."""

    def __init__(self, transport, plan: FaultPlan, max_message_bytes: int | None = None):
        super().__init__(transport, max_message_bytes)
        self.plan = plan
        self.rng = plan.rng_for(transport.rank)
        self.history: list[str] = []  # tokens of earlier dispatches, for stale replays
        self._fired: set[str] = set()
        self._log = None
        if plan.log_dir is not None:
            plan.log_dir.mkdir(parents=True, exist_ok=True)
            # Held for the rank's life, appended to line by line (closed at exit).
            self._log = open(plan.log_dir / f"faults-rank{transport.rank}.jsonl", "a",  # noqa: SIM115
                             buffering=1)

    def _draw(self) -> set[str]:
        return {k for k, rate in self.plan.rates.items() if self.rng.random() < rate}

    def _record(self, kind: str, token: str) -> None:
        if self._log is not None:
            self._log.write(json.dumps({"t": time.time(), "rank": self.transport.rank,
                                        "kind": kind, "token": token}) + "\n")
            self._log.flush()
            os.fsync(self._log.fileno())  # the record must survive the SIGKILL that follows

    def _stale_token(self) -> str | None:
        return self.rng.choice(self.history) if self.history else None

    def send_result(self, token: str, outcome: ExecOutcome | BatchOutcome) -> str:
        fired = self._draw()
        self._fired = fired
        if "slow" in fired:
            self._record("slow", token)
            time.sleep(self.rng.uniform(0.2, 1.0))
        if "hang" in fired:
            self._record("hang", token)
            os.kill(os.getpid(), signal.SIGSTOP)
        if "kill_before_result" in fired:
            self._record("kill_before_result", token)
            os.kill(os.getpid(), signal.SIGKILL)
        if "not_run" in fired:
            self._record("not_run", token)
            outcome = _not_run(outcome)
        if "reorder" in fired:
            self._record("reorder", token)
            self._send_ready_now(token)
            self._maybe_delay(fired, token)
        if "result_drop" in fired:
            self._record("result_drop", token)
        else:
            body = self._result_bytes(token, outcome, fired)
            self.transport.send_result(body)
            if "result_duplicate" in fired:
                self._record("result_duplicate", token)
                self.transport.send_result(body)
        if "kill_after_result" in fired:
            self._record("kill_after_result", token)
            os.kill(os.getpid(), signal.SIGKILL)
        self.history = (self.history + [token])[-8:]
        return token

    def send_ready(self, completed: str) -> None:
        fired, self._fired = self._fired, set()  # a heartbeat READY after it gets no faults
        if completed and "reorder" in fired:
            return  # already sent, before the RESULT
        if completed:
            self._maybe_delay(fired, completed)
        self._send_ready_now(completed, fired)

    def _maybe_delay(self, fired: set[str], token: str) -> None:
        if "delay" in fired:
            self._record("delay", token)
            time.sleep(self.rng.uniform(0.0, 0.05))

    def _send_ready_now(self, completed: str, fired: set[str] | None = None) -> None:
        fired = fired if fired is not None else self._fired
        token: object = completed
        if completed and "ready_malformed" in fired:
            self._record("ready_malformed", completed)
            token = [completed]
        elif completed and "ready_stale" in fired:
            stale = self._stale_token()
            if stale is not None and stale != completed:
                self._record("ready_stale", completed)
                token = stale
        msg = self.ready_message(completed)
        if token == completed:
            self.transport.send_ready(encode(msg))
        else:  # a shape the schema forbids: sent as a plain mapping
            body = {f: getattr(msg, f) for f in msg.__struct_fields__}
            body["completed_dispatch_token"] = token
            self.transport.send_ready(encode(body))

    def _result_bytes(self, token: str, outcome: ExecOutcome, fired: set[str]) -> bytes:
        msg = self.result_message(token, outcome)
        shape = next((k for k in _RESULT_SHAPES if k in fired), None)
        if shape == "result_stale":
            stale = self._stale_token()
            if stale is None or stale == token:
                shape = None
            else:
                msg.token = stale
        if shape is None:
            return self.result_bytes(token, outcome)
        self._record(shape, token)
        if shape == "result_garbage":
            return b"\xc1" + os.urandom(16)  # 0xc1 is never valid msgpack
        body = {f: getattr(msg, f) for f in msg.__struct_fields__}
        if shape == "result_not_mapping":
            return encode([token, outcome.status])  # type: ignore[arg-type]
        if shape == "result_missing_token":
            del body["token"]
        elif shape == "result_bad_token":
            body["token"] = token.upper()
        elif shape == "result_list_token":
            body["token"] = [token]
        elif shape == "result_stale":
            pass  # msg.token already replaced
        return encode(body)


#: The detail of an injected `not_run` (what a real one says: what the host could not do).
INJECTED_NOT_RUN = "injected: this host cannot run the task"


def _not_run(outcome: ExecOutcome | BatchOutcome) -> ExecOutcome | BatchOutcome:
    """The answer of a host that could run none of it, the run's own outcome dropped."""
    if isinstance(outcome, BatchOutcome):
        return BatchOutcome([ExecOutcome(status=NOT_RUN_STATUS, detail=INJECTED_NOT_RUN)
                             for _ in outcome.outcomes])
    return ExecOutcome(status=NOT_RUN_STATUS, detail=INJECTED_NOT_RUN)
