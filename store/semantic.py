"""A task's semantic payload and its stable identity (docs/protocol.md §3 R7, §4).

The identity is SHA-256 over the canonical JSON of the payload (sorted keys, compact separators,
no NaN), and never includes the transport token: the same work keeps the same id across
dispatches and restarts. Defaults are dropped before hashing, so `{"path": p}` and
`{"path": p, "target_branch": 0}` are the same task.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from .errors import StoreError

S2F_ACTIONS = frozenset({"solve", "sample", "skip"})
MAX_S2F_ACTIONS = 64
MAX_BRANCH = 2**64 - 1
FIELDS = ("path", "data", "focus_bytes", "target_branch", "s2f_actions", "schedule_prefix",
          "continuation")


class PayloadError(StoreError, ValueError):
    """A semantic payload that cannot be a task."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(name: str, value: object, *, minimum: int | None = None) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(v) for v in value):
        raise PayloadError(f"{name} must be a list of integers, not {value!r:.80}")
    if minimum is not None and any(v < minimum for v in value):
        raise PayloadError(f"{name} values must be >= {minimum}")
    return list(value)


def normalize_target_branch(value: object) -> int:
    """docs/protocol.md §4: an int in 1..2^64-1, anything else (bool, float, out of range) means
    none (0)."""
    return value if _is_int(value) and 1 <= value <= MAX_BRANCH else 0  # type: ignore[return-value]


def _s2f(value: object) -> list[list[Any]]:
    if not isinstance(value, (list, tuple)):
        raise PayloadError("s2f_actions must be a list of [branch, action] pairs")
    if len(value) > MAX_S2F_ACTIONS:
        raise PayloadError(f"s2f_actions holds {len(value)} actions; at most {MAX_S2F_ACTIONS}")
    seen: dict[int, str] = {}
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 2 or not _is_int(item[0])
                or item[1] not in S2F_ACTIONS):
            raise PayloadError(
                f"s2f_actions entry {item!r:.60} is not [branch, solve|sample|skip]")
        if item[0] in seen:
            raise PayloadError(f"s2f_actions names branch {item[0]} twice")
        seen[item[0]] = item[1]
    # Unique per branch, so order carries no meaning: sort for a canonical identity.
    return [[b, seen[b]] for b in sorted(seen)]


def normalize(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical semantic payload: validated, defaults dropped. Raises PayloadError."""
    out = _normalized(payload)
    canonical_json(out)  # rejects NaN, infinities and non-JSON values now, not at commit
    return out


def _normalized(payload: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(payload, Mapping):
        raise PayloadError(f"a task payload must be a mapping, not {type(payload).__name__}")
    unknown = sorted(set(payload) - set(FIELDS))
    if unknown:
        raise PayloadError(f"unknown payload field(s): {', '.join(map(str, unknown))}")
    out: dict[str, Any] = {}
    path = payload.get("path")
    if path is not None:
        if not isinstance(path, str) or not path:
            raise PayloadError("path must be a non-empty string")
        out["path"] = path
    if payload.get("data") is not None:
        out["data"] = payload["data"]
    if "path" not in out and "data" not in out:
        raise PayloadError("a task needs a path (an input file) or data (a generic task)")
    if payload.get("focus_bytes"):
        out["focus_bytes"] = _int_list("focus_bytes", payload["focus_bytes"], minimum=0)
    branch = normalize_target_branch(payload.get("target_branch"))
    if branch:
        out["target_branch"] = branch
    if payload.get("s2f_actions"):
        out["s2f_actions"] = _s2f(payload["s2f_actions"])
    if payload.get("schedule_prefix"):
        out["schedule_prefix"] = _int_list("schedule_prefix", payload["schedule_prefix"])
    cont = payload.get("continuation")
    if cont is not None:
        if not isinstance(cont, Mapping) or not cont:
            raise PayloadError("continuation must be a non-empty mapping")
        if not all(isinstance(k, str) for k in cont):
            raise PayloadError("continuation keys must be strings")
        out["continuation"] = dict(cont)
    _check_integers(out)
    return out


#: What a message can carry (msgpack): a larger integer would be stored, then fail every
#: send of its task, and take the master down with it.
INT_MIN, INT_MAX = -(2**63), 2**64 - 1


def _check_integers(value: Any) -> None:
    stack = [value]
    while stack:  # not recursive: a payload may nest as deep as JSON allows
        v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool) and not INT_MIN <= v <= INT_MAX:
            raise PayloadError(f"integer {v if abs(v) < 10**30 else '...'} is out of range "
                               f"(-2**63 to 2**64-1, what a message can carry)")
        if isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def canonical_json(value: Any) -> str:
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False,
                          ensure_ascii=False)
        if not text.isascii():
            text.encode()  # a lone surrogate (a str made from bytes that were not UTF-8)
        return text
    except UnicodeEncodeError as e:
        raise PayloadError(f"payload is not valid Unicode: {e.reason} in "
                           f"{text[max(0, e.start - 20):e.end + 20]!r}") from None
    except (TypeError, ValueError) as e:
        raise PayloadError(f"payload is not canonical JSON: {e}") from None


def semantic_id(payload: Mapping[str, Any]) -> str:
    """SHA-256 hex of the canonical JSON of the normalized payload."""
    return canonical_form(payload)[1]


def canonical_form(payload: Mapping[str, Any]) -> tuple[str, str]:
    """(canonical JSON, semantic id) of a payload, normalizing and encoding it once (the
    encoding is also the check that it is JSON at all)."""
    text = canonical_json(_normalized(payload))
    return text, hashlib.sha256(text.encode()).hexdigest()


def is_self_contained(payload: Mapping[str, Any], has_stored_input: bool) -> bool:
    """A task that needs no file on the master's disk to be dispatched again."""
    return has_stored_input or "continuation" in payload or "path" not in payload


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
