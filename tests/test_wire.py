"""The wire schema (coordinator/wire.py): what the master accepts from a worker.

`decode_inbound` must turn every byte string, however broken or large, into data (a plain value
or `Undecodable`) and never raise into the master loop; `check_result` must refuse any RESULT
payload that is not exactly the current, strictly typed schema rather than coerce it. What a
failed result's detail keeps, and the line `status` shows of it.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from coordinator.protocol import (
    ReadyStatus,
    ResultStatus,
    classify_ready,
    classify_result,
    mint_token,
)
from coordinator.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DETAIL_MAX_CHARS,
    RESULT_STATUSES,
    WIRE_VERSION,
    Result,
    Undecodable,
    check_result,
    decode_inbound,
    detail_summary,
    encode,
    failure_detail,
)

T = mint_token("e" * 32, 1, 1)


def result(**fields):
    return {"token": T, "status": "ok", **fields}


# --- decode_inbound: size bound ------------------------------------------------------------

def test_message_at_the_bound_decodes_one_byte_over_is_oversized():
    """The bound is in bytes and inclusive: a valid RESULT one byte too large is refused unread."""
    data = encode(result(value="x" * 1000))
    assert decode_inbound(data, len(data)) == result(value="x" * 1000)
    over = decode_inbound(data, len(data) - 1)
    assert isinstance(over, Undecodable) and "oversized" in over.detail
    assert classify_result(over, T) is ResultStatus.MALFORMED


def test_default_bound_is_exact():
    """The default bound, not a multiple of it: a valid message of bound + 1 bytes is refused."""
    at = encode(bytes(DEFAULT_MAX_MESSAGE_BYTES - 5))  # bin32: 5 header bytes
    assert len(at) == DEFAULT_MAX_MESSAGE_BYTES
    assert isinstance(decode_inbound(at, DEFAULT_MAX_MESSAGE_BYTES), bytes)
    over = encode(bytes(DEFAULT_MAX_MESSAGE_BYTES - 4))
    assert isinstance(decode_inbound(over, DEFAULT_MAX_MESSAGE_BYTES), Undecodable)


# --- decode_inbound: broken bytes are data, not exceptions ---------------------------------

@pytest.mark.parametrize("data", [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x92\x01", id="truncated"),
    pytest.param(b"\x01\x02", id="trailing-bytes"),
    pytest.param(b"\xa2\xff\xfe", id="str-not-utf8"),            # UnicodeDecodeError
    pytest.param(b"\x81\xa2\xff\xfe\x01", id="map-key-not-utf8"),
    pytest.param(b"\xd7\xff" + b"\xff" * 8, id="bad-timestamp"),
    pytest.param(b"\x91" * 100_000 + b"\xc0", id="deeply-nested"),  # RecursionError
])
def test_undecodable_bytes_become_malformed_messages(data):
    """Whatever the decoder raises (DecodeError, ValueError, RecursionError) must not escape:
    the message becomes `Undecodable`, which both classifiers see as malformed."""
    body = decode_inbound(data, DEFAULT_MAX_MESSAGE_BYTES)
    assert isinstance(body, Undecodable) and body.detail.startswith("undecodable")
    assert classify_result(body, T) is ResultStatus.MALFORMED
    assert classify_ready(body, None) is ReadyStatus.MALFORMED


@given(st.binary(max_size=64))
def test_decode_inbound_never_raises(data):
    decode_inbound(data, DEFAULT_MAX_MESSAGE_BYTES)


# --- check_result: the strict RESULT schema ------------------------------------------------

@pytest.mark.parametrize("status", sorted(RESULT_STATUSES))
def test_a_well_formed_result_round_trips(status):
    """What a worker encodes is what the master commits."""
    sent = Result(T, status, value={"k": [1, 2.5]}, testcases=[("t1", b"\x00")], returncode=0,
                  duration_s=1.5, detail="d")
    res, why = check_result(decode_inbound(encode(sent), DEFAULT_MAX_MESSAGE_BYTES))
    assert why is None and res == sent


@pytest.mark.parametrize("body", [
    pytest.param(result(v=WIRE_VERSION + 1), id="future-wire-version"),
    pytest.param(result(v=WIRE_VERSION - 1), id="old-wire-version"),
    pytest.param(result(status="bogus"), id="unknown-status"),
    pytest.param(result(status="OK"), id="status-case"),
    pytest.param(result(extra=1), id="unknown-field"),
    pytest.param(result(returncode="3"), id="str-for-int"),
    pytest.param(result(duration_s="1.5"), id="str-for-float"),
    pytest.param(result(v=str(WIRE_VERSION)), id="str-for-version"),
    pytest.param(result(returncode=True), id="bool-for-int"),
    pytest.param({"token": T}, id="no-status"),
])
def test_results_off_schema_are_refused(body):
    """Strict: nothing is coerced, nothing unknown is ignored; the reason is returned, not
    raised."""
    res, why = check_result(body)
    assert res is None and isinstance(why, str) and why


def test_a_ready_is_decoded_into_scalars_only():
    """Straight into a typed struct: a container in any field is malformed at once, and the
    fields the master does not read are skipped unread."""
    from coordinator.wire import decode_ready
    good = encode({"rank": 1, "bitmap_version": 0, "empirical_profile_version": "",
                   "completed_dispatch_token": T, "host": "h", "pid": 7, "extra": [[1]] * 9})
    assert decode_ready(good)["completed_dispatch_token"] == T
    for bad in ({"completed_dispatch_token": [T]}, {"pid": {"a": 1}}, [1, 2], "x"):
        assert isinstance(decode_ready(encode(bad)), Undecodable), bad


def test_a_results_payload_is_read_only_if_it_is_current():
    """Classification reads the token alone (a stale RESULT's payload proves nothing, R4);
    `check_result` reads the rest, strictly."""
    from coordinator.wire import decode_result
    body = encode({"token": T, "status": "ok", "value": [[]] * 1000, "junk": {"a": [1] * 50}})
    assert decode_result(body) == {"token": T}
    # A batch's worker asking for a split says so in its status, read undecoded: any other
    # status, of any shape, is left to `check_result`.
    assert decode_result(encode({"token": T, "status": "split"})) == {"token": T,
                                                                     "status": "split"}
    assert decode_result(encode({"token": T, "status": [[]] * 1000})) == {"token": T}
    res, why = check_result({}, encode(Result(token=T, status="ok", value={"n": 1})))
    assert why is None and res.value == {"n": 1}
    _, why = check_result({}, encode({"token": T, "status": "ok", "duration_s": -1.0}))
    assert why is not None and "duration_s" in why


def test_a_results_token_is_decoded_only_if_it_is_small():
    """A stale RESULT's token was decoded whole before it was found to be no token: 16 MiB of
    2-byte characters took 32 MiB more (tracemalloc's peak) beside the message's bytes. A
    token over MAX_TOKEN_BYTES is refused undecoded, as malformed as before."""
    import tracemalloc

    from coordinator.wire import MAX_TOKEN_BYTES, decode_result
    n = 16 << 20
    raw = (b"\x82" + encode("status") + encode("ok") + encode("token") + b"\xdb"
           + n.to_bytes(4, "big") + "é".encode() * (n // 2))
    tracemalloc.start()
    try:
        body = decode_result(raw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(body, Undecodable) and "its token takes" in body.detail, body
    assert peak < 1 << 20, peak
    assert classify_result(body, T) is ResultStatus.MALFORMED
    # Up to the bound, decoded as it was: a string that is no token is malformed, by its value.
    long = "x" * (MAX_TOKEN_BYTES - 3)
    assert decode_result(encode({"token": long})) == {"token": long}
    assert classify_result({"token": long}, T) is ResultStatus.MALFORMED
    assert decode_result(encode({"token": [T]})).detail.endswith("got `array` - at `$.token`")


def test_a_value_past_its_bound_is_refused_and_test_cases_past_theirs_are_counted():
    from coordinator.wire import MAX_TESTCASES, MAX_VALUE_BYTES
    big = Result(token=T, status="ok", value="x" * (MAX_VALUE_BYTES + 1))
    res, why = check_result({}, encode(big))
    assert res is None and "over the" in why
    many = Result(token=T, status="ok", dropped=5,
                  testcases=[(f"t{i}", bytes([i % 256])) for i in range(MAX_TESTCASES + 250)])
    res, why = check_result({}, encode(many))
    assert why is None and len(res.testcases) == MAX_TESTCASES
    assert res.testcases[-1] == (f"t{MAX_TESTCASES - 1}", bytes([(MAX_TESTCASES - 1) % 256]))
    assert res.dropped == 255  # the 250 past the bound and the 5 the worker dropped itself
    few = Result(token=T, status="ok", testcases=[("a", b"1"), ("b", b"2")])
    assert check_result({}, encode(few))[0].testcases == [("a", b"1"), ("b", b"2")]


def test_a_result_answering_another_number_of_tasks_is_refused_unread():
    """Each value of a batch is decoded (up to 2 MiB of msgpack each, ~56 bytes of Python
    objects per byte): 4 bombs sent for a one-task dispatch took 577 MiB before the count
    was compared. The count is compared first."""
    import tracemalloc

    from coordinator.wire import MAX_VALUE_BYTES
    bomb = (b"\xdd" + (MAX_VALUE_BYTES - 5).to_bytes(4, "big")
            + b"\x90" * (MAX_VALUE_BYTES - 5))  # one array of ~2M empty arrays
    item = b"\x82" + encode("status") + encode("ok") + encode("value") + bomb
    raw = (b"\x83" + encode("token") + encode(T) + encode("status") + encode("ok")
           + encode("batch") + b"\x94" + item * 4)
    tracemalloc.start()
    try:
        res, why = check_result({}, raw, tasks=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert res is None and why == "payload: the RESULT answers 4 task(s); the dispatch holds 1"
    assert peak < 4 * MAX_VALUE_BYTES, peak  # the structure alone, no value decoded
    assert check_result({}, encode(Result(token=T, status="ok")), tasks=3)[1] == \
        "payload: the RESULT answers 1 task(s); the dispatch holds 3"


def test_a_batch_shares_the_test_case_bound_of_its_result():
    """1,000 tasks of 1,000 test cases each decoded to a million test cases in one round."""
    from coordinator.wire import MAX_TESTCASES, TaskResult
    cases = [(f"t{i}", b"x") for i in range(600)]
    raw = encode(Result(token=T, status="ok",
                        batch=[TaskResult(status="ok", testcases=cases)] * 3))
    res, why = check_result({}, raw, tasks=3)
    assert why is None
    assert [len(t.testcases) for t in res.batch] == [600, MAX_TESTCASES - 600, 0]
    assert [t.dropped for t in res.batch] == [0, 1200 - MAX_TESTCASES, 600]


@pytest.mark.parametrize("parsed, detail", [
    ({"status": "ok", "detail": "warnings on stderr", "returncode": 0}, None),
    ({"status": "error", "detail": "target exited with status 3\nboom", "returncode": 3},
     "target exited with status 3\nboom"),
    ({"status": "error", "detail": "", "returncode": 3}, "exit status 3"),
    ({"status": "error", "detail": "", "returncode": None}, None),
    ({"status": "error", "detail": "x" * 5000}, "x" * DETAIL_MAX_CHARS),
    # an ok result keeps only the note of output files dropped over the executor's limits
    ({"status": "ok", "detail": "warn\ndropped 500 of 1500 output files (limits: ...)"},
     "dropped 500 of 1500 output files (limits: ...)"),
    ({"status": "ok", "detail": "dropped 3 packets (the target's own stderr)"}, None),
])
def test_failure_detail_is_kept_for_non_ok_results_only(parsed, detail):
    assert failure_detail(parsed) == detail


@pytest.mark.parametrize("detail, line", [
    # how the command ended, and its last word, not the dropped-files note after them
    ("exited with status 3\ntarget: bad input\ndropped 1 of 2 output files (1 over 10 "
     "bytes; limits: ...)", "exited with status 3 … target: bad input"),
    ("exited with status 3\ndropped 1 of 2 output files (...)", "exited with status 3"),
    ("ValueError: no\nTraceback (most recent call last):\n  File x\nValueError: no",
     "ValueError: no"),
    ("", "(no detail)"), (None, "(no detail)"),
    ("a" * 150 + "\n" + "b" * 150, "a" * 150 + " … " + "b" * 46 + "…"),
    # a target's escape sequences are shown, not sent to the operator's terminal
    ("killed\n\x1b[2J\x1b]0;pwn\x07 done\x9b", "killed … \\x1b[2J\\x1b]0;pwn\\x07 done\\x9b"),
])
def test_status_shows_the_first_and_last_own_line_of_a_failure(detail, line):
    assert detail_summary(detail) == line


def test_the_largest_honest_ready_is_far_under_the_bound_on_a_small_message():
    """A READY over MAX_SMALL_MESSAGE_BYTES is consumed unheld, as oversized: the bound has
    room for the largest one a worker can send (its host name and profile version at the
    most the master keeps, 4 bytes a character, its integers 64-bit)."""
    from coordinator.protocol import MAX_HOST_CHARS
    from coordinator.wire import MAX_SMALL_MESSAGE_BYTES, Ready, Stop, encode
    big = 2**63 - 1
    largest = encode(Ready(rank=big, bitmap_version=big,
                           empirical_profile_version="\U0001F600" * 200,
                           completed_dispatch_token="a" * 64,
                           host="\U0001F600" * MAX_HOST_CHARS, pid=big))
    assert 2 * len(largest) < MAX_SMALL_MESSAGE_BYTES
    assert 10 * len(encode(Stop(token="a" * 64))) < MAX_SMALL_MESSAGE_BYTES
