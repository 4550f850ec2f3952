"""Messages on the wire: msgpack bytes with a strict, versioned schema (msgspec).

The master never unpickles what a worker sends. It decodes bytes into plain values; whatever
fails to decode, is too large, or has the wrong shape becomes data for the classifier
(malformed, missing, payload), never an exception that escapes the loop. Workers encode with
typed structs, so a healthy worker cannot send a badly shaped message by accident.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from .protocol import shown

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
#: The bound on any other message the master receives (READY, STOP_ACK, a foreign tag's): a
#: larger one is consumed without being held, as an oversized RESULT is. Only a RESULT carries
#: anything large; the largest READY a worker can honestly send is 2,003 bytes (64-bit
#: integers, its token, a host name of 255 characters and a profile version of 200, each
#: character taking 4 bytes), a STOP_ACK 86. Held to --max-message-bytes instead, a burst of
#: READYs with a long host name took the master's memory past 500 MiB.
MAX_SMALL_MESSAGE_BYTES = 4096


def held_bound(tag: int, max_message_bytes: int) -> int:
    """The largest message on `tag` the master holds: --max-message-bytes for a RESULT,
    MAX_SMALL_MESSAGE_BYTES at most on any other tag (small by nature); a larger one is
    consumed unheld and quarantined as oversized."""
    return (max_message_bytes if tag == TAG_RESULT
            else min(max_message_bytes, MAX_SMALL_MESSAGE_BYTES))

#: A task the worker's host could not run (its disk full, no process to be had, the program
#: gone): not the task's outcome, so never its result. The task goes to the retry policy.
NOT_RUN_STATUS = "not_run"
#: A command killed by the signal that is stopping the job (a batch system's SIGTERM reaches
#: every process of the job, the targets too): its run was cut short, so it is not the task's
#: outcome either. Retried, and charged nothing while the master stops.
INTERRUPTED_STATUS = "interrupted"
#: A command killed at its --timeout.
TIMEOUT_STATUS = "timeout"
#: What a RESULT's `status` may say: the executor's outcome of the run.
RESULT_STATUSES = frozenset({"ok", "error", TIMEOUT_STATUS, NOT_RUN_STATUS, INTERRUPTED_STATUS})
#: The outcomes that are retried instead of committed (the command was killed, or never ran).
RETRY_STATUSES = frozenset({TIMEOUT_STATUS, NOT_RUN_STATUS, INTERRUPTED_STATUS})
#: A batch's RESULT that says only this (its token, and why in `detail`): the batch ran, but
#: its outcomes together are over the master's bound on a message. The master splits it in
#: halves, none charged, as any broken batch; each half's outcomes come back in a smaller
#: RESULT. Never an answer to a dispatch of one task (it is then an invalid payload).
SPLIT_STATUS = "split"

#: The largest count a message may report (what a 32-bit column holds, and far beyond any
#: real one).
MAX_COUNT = 2**31 - 1

#: What a result's explanation (`detail`) keeps, on the worker and on the master alike.
DETAIL_MAX_CHARS = 2000


#: The most test cases the master takes from one RESULT (the command executor keeps no more
#: itself): one RESULT of 100,000 would hold the master inside a round for ~95 s. The rest are
#: dropped, and counted with the result.
MAX_TESTCASES = 1000
#: The most bytes of a result's value the master decodes: a value is decoded into Python
#: objects (up to ~56 bytes each from one byte of msgpack: a 64 MiB "bomb" of empty arrays
#: takes 4.7 GiB), so it is bounded apart from the message. Bulk output belongs in test cases.
MAX_VALUE_BYTES = 2 << 20
#: The longest test-case name (in characters) the master takes: a longer one makes the whole
#: RESULT invalid, so the python executor refuses it as the task's error.
MAX_TESTCASE_NAME_CHARS = 1024


@dataclass(frozen=True)
class Undecodable:
    """What arrived could not be decoded at all: the classifier sees a non-mapping.
    `reason` names a quarantine reason other than the classifier's (`oversized`)."""

    detail: str
    reason: str | None = None


class BatchTask(msgspec.Struct, forbid_unknown_fields=True):
    task: dict[str, Any]
    input: bytes | None = None


class Work(msgspec.Struct, forbid_unknown_fields=True):
    """One dispatch: its token and one task, or (`batch`) several, run in order and answered
    by one RESULT (then `task` is empty)."""

    token: str
    task: dict[str, Any]
    input: bytes | None = None
    batch: list[BatchTask] | None = None
    v: int = WIRE_VERSION

    def tasks(self) -> list[BatchTask]:
        return self.batch if self.batch is not None else [BatchTask(self.task, self.input)]


class TaskResult(msgspec.Struct, forbid_unknown_fields=True):
    """One task's outcome in a batch's RESULT (the fields a single-task RESULT has)."""

    status: str
    value: Any = None
    testcases: list[tuple[str, bytes]] = []
    returncode: int | None = None
    duration_s: float = 0.0
    detail: str = ""
    dropped: int = 0


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
    #: A batch dispatch's outcomes, one per task in the WORK's order (`status` is then the
    #: batch's: ok, it ran).
    batch: list[TaskResult] | None = None
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
    #: The command's limit as the master resolved it (a --resume keeps the campaign's).
    timeout_s: float | None = None
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


# -- what the master decodes -------------------------------------------------------------------
#
# Straight into typed structs, so that a wrong shape fails at its first wrong byte and nothing
# is built of what is not needed: a field the struct does not name is skipped unread, and the
# fields it names hold scalars, or stay raw bytes until their size is checked.

Scalar = None | bool | int | float | str


class _ReadyIn(msgspec.Struct):
    """A READY as the classifier sees it: scalars only (a list or a map in any field makes
    the whole message malformed); what a field may hold is checked by the protocol rules."""

    rank: Scalar = None
    bitmap_version: Scalar = None
    empirical_profile_version: Scalar = None
    completed_dispatch_token: Scalar = None
    host: Scalar = None
    pid: Scalar = None
    v: Scalar = None


class _Envelope(msgspec.Struct):
    """A RESULT as far as its classification needs it: its token, and its status (a batch
    that asks to be split, `SPLIT_STATUS`). The rest is read only for a current one
    (`check_result`): a stale one's payload proves nothing (R4)."""

    #: Left undecoded until its size is checked (`_token`).
    token: msgspec.Raw = msgspec.Raw()
    #: Left undecoded (a status of any shape is `check_result`'s to refuse): compared whole.
    status: msgspec.Raw = msgspec.Raw()


class _Split(msgspec.Struct):
    detail: Scalar = None


#: The most tasks one dispatch carries (`--batch`; config.MAX_BATCH).
MAX_BATCH = 1000


class _TaskResultIn(msgspec.Struct, forbid_unknown_fields=True):
    status: str
    value: msgspec.Raw = msgspec.Raw()
    testcases: msgspec.Raw = msgspec.Raw()
    returncode: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] | None = None
    duration_s: Annotated[float, msgspec.Meta(ge=0, le=1e9)] = 0.0
    detail: Annotated[str, msgspec.Meta(max_length=64 << 10)] = ""
    dropped: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 0


class _ResultIn(_TaskResultIn, forbid_unknown_fields=True):
    token: str = ""
    batch: Annotated[list[_TaskResultIn], msgspec.Meta(max_length=MAX_BATCH)] | None = None
    v: int = WIRE_VERSION


_ready_in = msgspec.msgpack.Decoder(_ReadyIn)
_envelope = msgspec.msgpack.Decoder(_Envelope)
_scalar = msgspec.msgpack.Decoder(Scalar)
#: The most bytes of a RESULT's token the master decodes: a dispatch token takes 66. A longer
#: one can be no token, and decoded whole a stale RESULT's token of --max-message-bytes cost
#: up to twice that again (a string of 2-byte characters), beside the message's own bytes.
MAX_TOKEN_BYTES = 1024
_split = msgspec.msgpack.Decoder(_Split)
_SPLIT_RAW = msgspec.msgpack.encode(SPLIT_STATUS)
_result_in = msgspec.msgpack.Decoder(_ResultIn)
_testcases = msgspec.msgpack.Decoder(
    list[tuple[Annotated[str, msgspec.Meta(max_length=MAX_TESTCASE_NAME_CHARS)], bytes]])
_DECODE_ERRORS = (msgspec.DecodeError, ValueError, RecursionError)


def _why(e: Exception) -> Undecodable:
    # Bytes that parse but do not fit the schema say which field is wrong ("$.token"); an
    # operator reading the quarantine tells a confused sender from line noise by the prefix.
    what = "wrong shape" if isinstance(e, msgspec.ValidationError) else "undecodable"
    return Undecodable(f"{what}: {e}"[:300])


def decode_ready(data: bytes | bytearray | memoryview) -> dict[str, Any] | Undecodable:
    """Master side: a READY's bytes -> its fields (a mapping for the classifier), or
    `Undecodable` with the reason."""
    try:
        msg = _ready_in.decode(data)
    except _DECODE_ERRORS as e:
        return _why(e)
    return {f: getattr(msg, f) for f in msg.__struct_fields__}


def decode_result(data: bytes | bytearray | memoryview) -> dict[str, Any] | Undecodable:
    """Master side: a RESULT's bytes -> its token (a mapping for the classifier), or
    `Undecodable`; its payload is read by `check_result` if it is current."""
    try:
        head = _envelope.decode(data)
    except _DECODE_ERRORS as e:
        return _why(e)
    raw = memoryview(head.token)
    if len(raw) > MAX_TOKEN_BYTES:
        return Undecodable(f"wrong shape: its token takes {len(raw)} bytes, over the "
                           f"{MAX_TOKEN_BYTES} a token may have")
    try:
        token = _scalar.decode(raw) if len(raw) else None
    except msgspec.ValidationError as e:  # (where, as when it was decoded with the rest)
        return _why(msgspec.ValidationError(f"{e} - at `$.token`"))
    except _DECODE_ERRORS as e:
        return _why(e)
    # (Compared as a view: `bytes()` of a stale RESULT's status of --max-message-bytes copied
    # all of it, in every RESULT drain.)
    if memoryview(head.status) == _SPLIT_RAW:
        return {"token": token, "status": SPLIT_STATUS}
    return {"token": token}


def split_detail(body: Mapping[str, Any], raw: bytes | bytearray | None) -> str:
    """Why a batch's worker asked for a split (its RESULT's `detail`), printable, bounded."""
    why = body.get("detail")
    if raw is not None:
        with contextlib.suppress(*_DECODE_ERRORS):
            why = _split.decode(raw).detail
    return why[:300] if isinstance(why, str) else "its outcomes are too large for one message"


def oversized(size: int, max_bytes: int) -> Undecodable:
    return Undecodable(f"oversized message: {size} bytes > {max_bytes}", reason="oversized")


def decode_inbound(data: bytes | bytearray | memoryview, max_bytes: int) -> object:
    """Any message's bytes -> a plain value, or `Undecodable` with the reason (for messages
    that are only looked at: a STOP_ACK)."""
    if len(data) > max_bytes:
        return oversized(len(data), max_bytes)
    try:
        return _untyped.decode(data)
    except _DECODE_ERRORS as e:
        return Undecodable(f"undecodable: {e}"[:300])  # untyped: no shape to miss


def check_result(body: Mapping[str, Any], raw: bytes | bytearray | None = None,
                 tasks: int | None = None) -> tuple[Result | None, str | None]:
    """Strict validation of a current RESULT's payload, from its bytes (`raw`; a mapping is
    encoded first): (result, None) or (None, why). At most MAX_TESTCASES test cases are
    taken in all, the rest counted as dropped; a value over MAX_VALUE_BYTES is refused.

    `tasks`: how many the dispatch holds. A RESULT answering another number is refused
    before any value is decoded: each may be 2 MiB of nested empty arrays, some 150 MiB
    once decoded, and a batch of 1,000 of them, sent for a dispatch of one task, took the
    master's memory far past its bound before the count was compared."""
    try:
        if raw is None:
            raw = encode(dict(body))
        msg = _result_in.decode(raw)
    except (*_DECODE_ERRORS, *ENCODE_ERRORS) as e:
        return None, f"payload: {e}"[:300]
    if msg.v != WIRE_VERSION:
        return None, f"wire version {msg.v}, expected {WIRE_VERSION}"
    answers = len(msg.batch) if msg.batch is not None else 1
    if tasks is not None and answers != tasks:
        return None, f"payload: the RESULT answers {answers} task(s); the dispatch holds {tasks}"
    # The test-case limit is the message's, shared by its tasks in order: 1,000 tasks of
    # 1,000 test cases each decoded to a million in one round.
    left = [MAX_TESTCASES]
    outcome, why = _task_result(msg, left)
    if why is not None:
        return None, why
    batch = None
    if msg.batch is not None:
        batch = []
        for i, item in enumerate(msg.batch):
            got, why = _task_result(item, left)
            if why is not None:
                return None, f"batch[{i}]: {why}"
            batch.append(got)
    return Result(token=msg.token, status=outcome.status, value=outcome.value,
                  testcases=outcome.testcases, returncode=outcome.returncode,
                  duration_s=outcome.duration_s, detail=outcome.detail,
                  dropped=outcome.dropped, batch=batch), None


def _task_result(msg: _TaskResultIn, left: list[int]) -> tuple[TaskResult, None] | tuple[None, str]:
    """One task's outcome, checked: its status, its value's size, its test cases (at most
    `left[0]` taken, which it lowers by as many; the rest counted as dropped)."""
    if msg.status not in RESULT_STATUSES:
        return None, (f"status {shown(msg.status, 40)} is not "
                      f"{'/'.join(sorted(RESULT_STATUSES))}")
    value_raw, testcases_raw = memoryview(msg.value), memoryview(msg.testcases)
    if len(value_raw) > MAX_VALUE_BYTES:
        return None, (f"payload: its value is {len(value_raw)} bytes, over the "
                      f"{MAX_VALUE_BYTES} a value may have (bulk output belongs in test cases)")
    try:
        # The value itself (msgpack allows what JSON does not) is checked by the gate, which
        # encodes it once for storage.
        value = _untyped.decode(value_raw) if len(value_raw) else None
        testcases, over = _first_testcases(testcases_raw, left[0])
    except _DECODE_ERRORS as e:
        return None, f"payload: {e}"[:300]
    left[0] -= len(testcases)
    return TaskResult(status=msg.status, value=value, testcases=testcases,
                      returncode=msg.returncode, duration_s=msg.duration_s, detail=msg.detail,
                      dropped=min(msg.dropped + over, MAX_COUNT)), None


def _first_testcases(raw: memoryview, limit: int) -> tuple[list[tuple[str, bytes]], int]:
    """The first `limit` test cases of the msgpack array `raw` and how many more it holds,
    without decoding those: the entries before are walked by their headers alone (each is
    [name, bytes]), so a RESULT of 100,000 test cases costs what 1,000 do."""
    if not len(raw) or raw == b"\x90":
        # None, or an empty array: what a worker sends for a task that found nothing, in a
        # batch nearly every task.
        return [], 0
    count, pos = _array_header(raw, 0)
    if count <= limit:
        return _testcases.decode(raw), 0
    start = pos
    for _ in range(limit):
        n, pos = _array_header(raw, pos)
        if n != 2:
            raise ValueError("a test case is not [name, bytes]")
        pos = _skip_str_or_bin(raw, pos)
        pos = _skip_str_or_bin(raw, pos)
    head = b"\xdc" + limit.to_bytes(2, "big") if limit < 1 << 16 else \
        b"\xdd" + limit.to_bytes(4, "big")
    return _testcases.decode(head + bytes(raw[start:pos])), count - limit


def _array_header(raw: memoryview, pos: int) -> tuple[int, int]:
    b = raw[pos]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F, pos + 1
    if b == 0xDC:
        return int.from_bytes(raw[pos + 1:pos + 3], "big"), pos + 3
    if b == 0xDD:
        return int.from_bytes(raw[pos + 1:pos + 5], "big"), pos + 5
    raise ValueError("test cases are not an array")


def _skip_str_or_bin(raw: memoryview, pos: int) -> int:
    b = raw[pos]
    if 0xA0 <= b <= 0xBF:
        n, at = b & 0x1F, pos + 1
    elif b in (0xD9, 0xC4):
        n, at = raw[pos + 1], pos + 2
    elif b in (0xDA, 0xC5):
        n, at = int.from_bytes(raw[pos + 1:pos + 3], "big"), pos + 3
    elif b in (0xDB, 0xC6):
        n, at = int.from_bytes(raw[pos + 1:pos + 5], "big"), pos + 5
    else:
        raise ValueError("a test case's name or bytes are not a string")
    if at + n > len(raw):
        raise ValueError("a test case runs past the message's end")
    return at + n


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


_ABSENT = object()


def _field(parsed: Any, key: str) -> Any:
    got = getattr(parsed, key, _ABSENT)  # a Struct: no ABC check (see gate._get)
    if got is not _ABSENT:
        return got
    return parsed.get(key) if isinstance(parsed, Mapping) else None


def failure_detail(parsed: Any) -> str | None:
    """What `results.detail` keeps: for a result whose status is not ok, the worker's
    explanation (how the command ended and its stderr tail, or the exception); for an ok
    result only the command executor's note of output files it dropped (over its limits),
    else None (the happy path writes nothing)."""
    if _field(parsed, "status") == "ok":
        if not _field(parsed, "detail"):
            return None  # the happy path
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
    text = for_terminal(lines[0] if not last or last == lines[0] else f"{lines[0]} … {last}")
    return text if len(text) <= width else text[:width - 1] + "…"


def for_terminal(text: str) -> str:
    """`text`, from a target's stderr or a rank's message, safe for the operator's terminal:
    its escape sequences shown, not obeyed (one could clear the screen or retitle the
    window)."""
    return text if text.isprintable() else "".join(
        c if c.isprintable() else repr(c)[1:-1] for c in text)
