"""Fault injection, present only when asked for (`--inject`), acting only in the worker's send
path: the master runs its ordinary code and cannot know it is being tested.

    --inject kind=rate[,kind=rate...]   --inject-seed N   --inject-log DIR

Each kind fires independently per task with its rate; the same seed reproduces the same faults
on the same rank. With --inject-log every injected fault is appended to
DIR/faults-rank<R>.jsonl (time, kind, token), which tools/fault_campaign.py reads.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .executors import ExecOutcome
from .wire import encode
from .worker import Sender

#: Every kind, and what it does to the task it fires on.
KINDS: dict[str, str] = {
    "reorder": "READY is sent before RESULT",
    "delay": "a pause of up to 50 ms before the second of RESULT/READY",
    "result_missing_token": "RESULT without a token",
    "result_bad_token": "RESULT whose token is not canonical (upper case)",
    "result_list_token": "RESULT whose token is a list",
    "result_not_mapping": "RESULT whose body is a list, not a mapping",
    "result_garbage": "RESULT that is not decodable at all",
    "result_stale": "RESULT replaying an earlier dispatch's token",
    "result_duplicate": "RESULT sent twice",
    "result_drop": "RESULT never sent (READY is)",
    "ready_malformed": "READY whose token is a list",
    "ready_stale": "READY replaying an earlier dispatch's token",
    "kill_before_result": "the worker SIGKILLs itself before sending RESULT",
    "kill_after_result": "the worker SIGKILLs itself after RESULT, before READY",
    "hang": "the worker stops (SIGSTOP) before sending RESULT",
    "slow": "the worker sleeps 0.2-1 s before sending RESULT",
}

#: At most one of these shapes a RESULT's body; the first that fires (in this order) wins.
_RESULT_SHAPES = ("result_garbage", "result_not_mapping", "result_missing_token",
                  "result_bad_token", "result_list_token", "result_stale")


class InjectSpecError(ValueError):
    pass


def parse_inject(spec: str) -> dict[str, float]:
    """`kind=rate[,kind=rate...]` -> {kind: rate}; unknown kinds and rates outside 0–1 are
    errors that name the offending part."""
    rates: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        kind, sep, value = part.partition("=")
        kind = kind.strip()
        if not sep:
            raise InjectSpecError(f"--inject: {part!r} is not kind=rate")
        if kind not in KINDS:
            raise InjectSpecError(f"--inject: unknown fault kind {kind!r}; known kinds: "
                                  f"{', '.join(KINDS)}")
        try:
            rate = float(value)
        except ValueError:
            raise InjectSpecError(f"--inject: rate {value!r} of {kind} is not a number") from None
        if not 0.0 <= rate <= 1.0:
            raise InjectSpecError(f"--inject: rate {rate} of {kind} is outside 0..1")
        rates[kind] = rate
    if not rates:
        raise InjectSpecError("--inject: no fault kinds given")
    return rates


@dataclass
class FaultPlan:
    rates: dict[str, float]
    seed: int
    log_dir: Path | None = None

    def rng_for(self, rank: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + rank)


class FaultySender(Sender):
    """The worker's one sender, with faults: R1 still holds whenever no fault fires."""

    def __init__(self, transport, plan: FaultPlan):
        super().__init__(transport)
        self.plan = plan
        self.rng = plan.rng_for(transport.rank)
        self.history: list[str] = []  # tokens of earlier dispatches, for stale replays
        self._fired: set[str] = set()
        self._log = None
        if plan.log_dir is not None:
            plan.log_dir.mkdir(parents=True, exist_ok=True)
            self._log = open(plan.log_dir / f"faults-rank{transport.rank}.jsonl", "a",
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

    def send_result(self, token: str, outcome: ExecOutcome) -> str:
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
            return encode(msg)
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
