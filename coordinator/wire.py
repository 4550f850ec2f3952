"""Messages on the wire: msgpack bytes with a strict, versioned schema (msgspec).

The master never unpickles what a worker sends. It decodes bytes into plain values; whatever
fails to decode, is too large, or has the wrong shape becomes data for the classifier
(malformed, missing, payload), never an exception that escapes the loop. Workers encode with
typed structs, so a healthy worker cannot send a badly shaped message by accident.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

WIRE_VERSION = 1

# One MPI tag per message kind (docs/protocol.md §2).
TAG_WORK = 11
TAG_RESULT = 12
TAG_READY = 13
TAG_STOP = 14
TAG_STOP_ACK = 15
TAG_START = 16  # the master's start verdict, to each worker

#: Default bound on a message the master accepts (RESULT carries test cases).
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

#: What a RESULT's `status` may say: the executor's outcome of the run.
RESULT_STATUSES = frozenset({"ok", "error", "timeout"})
#: The outcomes that are retried instead of committed (the command was killed).
RETRY_STATUSES = frozenset({"timeout"})

#: The largest count a message may report (what a 32-bit column holds, and far beyond any
#: real one).
MAX_COUNT = 2**31 - 1

#: What a result's explanation (`detail`) keeps, on the worker and on the master alike.
DETAIL_MAX_CHARS = 2000


@dataclass(frozen=True)
class Undecodable:
    """What arrived could not be decoded at all: the classifier sees a non-mapping."""

    detail: str


class Work(msgspec.Struct, forbid_unknown_fields=True):
    token: str
    task: dict[str, Any]
    input: bytes | None = None
    v: int = WIRE_VERSION


class Result(msgspec.Struct, forbid_unknown_fields=True):
    """What a current RESULT must look like to be committed (else: invalid, reason payload)."""

    token: str
    status: str  # ok / error / timeout
    value: Any = None
    testcases: list[tuple[str, bytes]] = []
    returncode: int | None = None
    duration_s: float = 0.0
    detail: str = ""
    #: Test cases the worker could not send (over its limits, or the message's).
    dropped: int = 0
    v: int = WIRE_VERSION


class Ready(msgspec.Struct):
    rank: int
    bitmap_version: int
    empirical_profile_version: str
    completed_dispatch_token: str
    host: str | None = None
    pid: int | None = None
    v: int = WIRE_VERSION


class Start(msgspec.Struct, forbid_unknown_fields=True):
    """The master's start verdict, sent to each worker on its own (no collective: one rank's
    death during the start must cost that rank only). `status` 0: go, with the executor the
    master resolved (a --resume may take the campaign's own); else the exit status of a
    refused start, with which every worker leaves."""

    status: int
    executor: str = ""
    argv: list[str] | None = None
    callable: str | None = None
    v: int = WIRE_VERSION


class Stop(msgspec.Struct):
    token: str
    #: False after a rank failure: MPI_Finalize can then hang the survivors (Open MPI ULFM,
    #: ompi#11404), so they exit without it once everything is acknowledged.
    finalize: bool = True
    v: int = WIRE_VERSION


_encoder = msgspec.msgpack.Encoder()
_untyped = msgspec.msgpack.Decoder()
_work_decoder = msgspec.msgpack.Decoder(Work)
_stop_decoder = msgspec.msgpack.Decoder(Stop)
_start_decoder = msgspec.msgpack.Decoder(Start)


def encode(msg: msgspec.Struct | dict[str, Any]) -> bytes:
    return _encoder.encode(msg)


#: What `encode` raises for a value no message can carry: an integer out of msgpack's range
#: (OverflowError), a type it does not know (TypeError), a string that is not Unicode
#: (UnicodeError, a ValueError), nesting past the recursion limit.
ENCODE_ERRORS = (msgspec.EncodeError, TypeError, ValueError, OverflowError, RecursionError)


def decode_inbound(data: bytes | bytearray | memoryview, max_bytes: int) -> object:
    """Master side: bytes from a worker -> a plain value, or `Undecodable` with the reason."""
    if len(data) > max_bytes:
        return Undecodable(f"oversized message: {len(data)} bytes > {max_bytes}")
    try:
        return _untyped.decode(data)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        return Undecodable(f"undecodable: {e}"[:300])


def check_result(body: dict[str, Any]) -> tuple[Result | None, str | None]:
    """Strict validation of a current RESULT's payload: (result, None) or (None, why)."""
    try:
        res = msgspec.convert(body, Result, strict=True)
    except msgspec.ValidationError as e:
        return None, f"payload: {e}"[:300]
    if res.v != WIRE_VERSION:
        return None, f"wire version {res.v}, expected {WIRE_VERSION}"
    if res.status not in RESULT_STATUSES:
        return None, f"status {res.status!r:.40} is not ok/error/timeout"
    if not 0 <= res.dropped <= MAX_COUNT:
        return None, f"dropped {res.dropped} is not a count"
    # The value itself (msgpack allows what JSON does not) is checked by the gate, which
    # encodes it once for storage.
    return res, None


def decode_work(data: bytes | bytearray) -> Work:
    """Worker side: the master is trusted, but a bad WORK is still a clear protocol error."""
    return _work_decoder.decode(data)


def decode_stop(data: bytes | bytearray) -> Stop:
    return _stop_decoder.decode(data)


def decode_start(data: bytes | bytearray) -> Start:
    return _start_decoder.decode(data)


# -- a RESULT's explanation --------------------------------------------------------------------

def clip_detail(text: str, limit: int = DETAIL_MAX_CHARS) -> str:
    """At most `limit` characters of a run's explanation: its first line (how the command
    ended, the exception) and its tail (the last lines of a failing run say why, and the notes
    on dropped output files come last); the middle goes."""
    if len(text) <= limit:
        return text
    first, newline, rest = text.partition("\n")
    marker = "\n…\n"
    if not newline or len(first) > limit // 2:
        return text[-limit:]
    return first + marker + rest[-(limit - len(first) - len(marker)):]


#: The command executor's note of dropped output files, told apart from the command's own
#: stderr lines that share the result's detail.
DROPPED_NOTE = re.compile(r"dropped \d+ of \d+ output (files|entries) \(")


def _field(parsed: Any, key: str) -> Any:
    return parsed.get(key) if isinstance(parsed, Mapping) else getattr(parsed, key, None)


def failure_detail(parsed: Any) -> str | None:
    """What `results.detail` keeps: for a result whose status is not ok, the worker's
    explanation (how the command ended and its stderr tail, or the exception); for an ok
    result only the command executor's note of output files it dropped (over its limits),
    else None (the happy path writes nothing)."""
    if _field(parsed, "status") == "ok":
        notes = [line for line in str(_field(parsed, "detail") or "").splitlines()
                 if DROPPED_NOTE.match(line)]
        return "\n".join(notes)[:DETAIL_MAX_CHARS] if notes else None
    text = str(_field(parsed, "detail") or "").strip()
    if not text and _field(parsed, "returncode") is not None:
        text = f"exit status {_field(parsed, 'returncode')}"
    return clip_detail(text, DETAIL_MAX_CHARS) or None


def detail_summary(detail: str | None, width: int = 200) -> str:
    """One line for a failed run: its first line (how the command ended, or the exception)
    and its last own line (a command's last word on stderr), not the note of dropped output
    files that may follow them, which said nothing of why the run failed."""
    lines = [line.strip() for line in (detail or "").splitlines() if line.strip()]
    if not lines:
        return "(no detail)"
    own = [line for line in lines[1:] if not DROPPED_NOTE.match(line)]
    last = own[-1] if own else ""
    text = lines[0] if not last or last == lines[0] else f"{lines[0]} … {last}"
    return text if len(text) <= width else text[:width - 1] + "…"
