"""What `--inject` may ask for: the fault kinds, the spec parser and the plan (pure: the
command line parses a spec without loading MPI, which `coordinator.faults` needs)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError

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
    "not_run": "RESULT says the host could not run the task (`not_run`, every task of a batch)",
}

#: At most one of these shapes a RESULT's body; the first that fires (in this order) wins.
_RESULT_SHAPES = ("result_garbage", "result_not_mapping", "result_missing_token",
                  "result_bad_token", "result_list_token", "result_stale")


class InjectSpecError(UsageError):
    """An `--inject` spec that cannot be parsed; the message names the part."""


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
