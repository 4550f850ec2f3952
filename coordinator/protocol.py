"""The protocol's pure rules (docs/protocol.md §2–§3): tokens, READY/RESULT classification, the
join, the fail-closed `bitmap_version` rule. No I/O here, so every row of docs/protocol.md's tables
is a test.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TOKEN_LABEL = b"mpi-dispatch-coordinator/dispatch-token/v1"
_TOKEN_RE = re.compile(r"[0-9a-f]{64}")


def is_token(value: object) -> bool:
    """Canonical form: a `str` of exactly 64 lowercase hex characters, nothing else."""
    return type(value) is str and _TOKEN_RE.fullmatch(value) is not None


def mint_token(epoch: str, rank: int, seq: int) -> str:
    """A fresh dispatch token: SHA-256 over a fixed label, the incarnation's random epoch, the
    rank and a per-incarnation sequence number, so tokens never repeat across ranks, dispatches
    and restarts. A correlation key inside one trusted MPI job, not authentication."""
    h = hashlib.sha256(TOKEN_LABEL)
    h.update(b"\0" + epoch.encode() + b"\0" + str(rank).encode() + b"\0" + str(seq).encode())
    return h.hexdigest()


class ReadyStatus(str, enum.Enum):
    IDLE = "idle"
    CURRENT = "current"
    MISSING = "missing"
    MALFORMED = "malformed"
    STALE = "stale"
    UNOWNED = "unowned"


class ResultStatus(str, enum.Enum):
    CURRENT = "current"
    MISSING = "missing"
    MALFORMED = "malformed"
    STALE = "stale"
    UNOWNED = "unowned"


#: The RESULT statuses that set the invalid-result mark (R2); stale/unowned only quarantine.
INVALIDATING = frozenset({ResultStatus.MISSING, ResultStatus.MALFORMED})

READY_TOKEN_KEY = "completed_dispatch_token"


def classify_ready(msg: object, expected: str | None, *, consistent: bool = True) -> ReadyStatus:
    """docs/protocol.md §3 READY table. `expected` is the token of the rank's active dispatch (or,
    for a parked rank, the retired token it must echo); None when there is none. `consistent` is
    False when the rank's ownership rows disagree (an internal invariant is broken)."""
    if not isinstance(msg, Mapping):
        return ReadyStatus.MALFORMED
    token = msg.get(READY_TOKEN_KEY)
    present = token is not None and token != ""
    if present and not is_token(token):
        return ReadyStatus.MALFORMED  # even with no active dispatch
    if not consistent:
        return ReadyStatus.UNOWNED
    if expected is None:
        return ReadyStatus.IDLE
    if not present:
        return ReadyStatus.MISSING
    return ReadyStatus.CURRENT if token == expected else ReadyStatus.STALE


def classify_result(msg: object, expected: str | None) -> ResultStatus:
    """docs/protocol.md §3 RESULT classification, in the protocol's order (docs/protocol.md §3)."""
    if expected is None:
        return ResultStatus.UNOWNED
    if not isinstance(msg, Mapping):
        return ResultStatus.MALFORMED
    token = msg.get("token")
    if token is None or token == "":
        return ResultStatus.MISSING
    if not is_token(token):
        return ResultStatus.MALFORMED
    return ResultStatus.CURRENT if token == expected else ResultStatus.STALE


def sanitize_bitmap_version(value: object, current: int) -> int:
    """Fail closed: a bool, a non-integer, a value < -1 or a future version becomes -1, so a
    forged version can neither kill the master nor block the next full bitmap sync."""
    if type(value) is not int or value < -1 or value > current:
        return -1
    return value


def sanitize_profile_version(value: object) -> str:
    return value[:200] if isinstance(value, str) else ""


#: What a reported pid may be (Linux keeps them below 2**22; the store holds 64-bit integers,
#: and a READY with pid 2**64 - 1 would end the master when it is written).
MAX_PID = 2**31 - 1
MAX_HOST_CHARS = 255
_SPACE = re.compile(r"\s")


def shown(value: object, chars: int) -> str:
    """`value`'s repr cut to `chars`, made from a cut of it: a rank's string may be as long as
    its message, and a repr of the whole (four times its size, escaped) costs that much
    memory to show a few characters of it."""
    if isinstance(value, str | bytes | bytearray):
        value = value[:chars]
    return repr(value)[:chars]


def ready_problem(msg: Mapping[str, Any], sender: int) -> str | None:
    """Why a READY whose token passed cannot be taken as it is: a field a worker reports out
    of its range (the rank it claims is not the one it sends from, a pid no process has, a
    host name no host has). None if every field is in range; the version fields are not
    checked here: they fail closed (`sanitize_bitmap_version`)."""
    rank, pid, host = msg.get("rank"), msg.get("pid"), msg.get("host")
    if rank is not None and (type(rank) is not int or rank != sender):
        return f"it says it is rank {shown(rank, 40)}, and it came from rank {sender}"
    if pid is not None and (type(pid) is not int or not 1 <= pid <= MAX_PID):
        return f"pid {shown(pid, 40)} is not a process id"
    # (Printed by `coordinator status`: a control character in it would drive the terminal.)
    if host is not None and (not isinstance(host, str) or not host or
                             len(host) > MAX_HOST_CHARS or not host.isprintable()
                             or _SPACE.search(host) is not None):
        return f"host {shown(host, 60)} is not a host name"
    return None


@dataclass(frozen=True)
class ReadyInfo:
    """The fields of a READY the master takes once it is classified idle."""

    bitmap_version: int
    profile_version: str
    host: str | None
    pid: int | None


def ready_info(msg: Mapping[str, Any], current_bitmap: int) -> ReadyInfo:
    host = msg.get("host")
    pid = msg.get("pid")
    return ReadyInfo(
        sanitize_bitmap_version(msg.get("bitmap_version"), current_bitmap),
        sanitize_profile_version(msg.get("empirical_profile_version")),
        host if isinstance(host, str) and 0 < len(host) <= MAX_HOST_CHARS else None,
        pid if type(pid) is int and 1 <= pid <= MAX_PID else None,
    )
