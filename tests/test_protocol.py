"""docs/protocol.md's tables as tests of the pure protocol rules (no I/O)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given

from coordinator.protocol import (
    ReadyStatus,
    ResultStatus,
    classify_ready,
    classify_result,
    is_token,
    mint_token,
    ready_info,
    sanitize_bitmap_version,
)

T = mint_token("e" * 32, 1, 1)
OLD = mint_token("e" * 32, 1, 0)


def ready(token):
    return {"rank": 1, "bitmap_version": 0, "empirical_profile_version": "",
            "completed_dispatch_token": token}


def test_tokens_are_canonical_and_unique():
    seen = {mint_token(e, r, s) for e in ("a" * 32, "b" * 32) for r in range(1, 5)
            for s in range(50)}
    assert len(seen) == 2 * 4 * 50
    assert all(is_token(t) for t in seen)


@pytest.mark.parametrize("value", [
    T.upper(), T[:-1], T + "0", [T], None, 7, b"0" * 64, "g" * 64, " " + T[1:], T[:63] + "\n",
])
def test_non_canonical_tokens(value):
    assert not is_token(value)


@given(st.text(alphabet="0123456789abcdef", min_size=64, max_size=64))
def test_every_64_lower_hex_string_is_a_token(s):
    assert is_token(s)


@pytest.mark.parametrize("msg, expected, status", [
    # idle: no active dispatch, empty or any valid old token
    (ready(""), None, ReadyStatus.IDLE),
    (ready(None), None, ReadyStatus.IDLE),
    (ready(OLD), None, ReadyStatus.IDLE),
    # current
    (ready(T), T, ReadyStatus.CURRENT),
    # missing: active dispatch, token absent or empty
    (ready(""), T, ReadyStatus.MISSING),
    ({"rank": 1, "bitmap_version": 0}, T, ReadyStatus.MISSING),
    # malformed: not a mapping, or a non-canonical token, even with no active dispatch
    ([1, 2], T, ReadyStatus.MALFORMED),
    ("READY", None, ReadyStatus.MALFORMED),
    (ready([T]), T, ReadyStatus.MALFORMED),
    (ready([T]), None, ReadyStatus.MALFORMED),
    (ready(T.upper()), T, ReadyStatus.MALFORMED),
    (ready(T.upper()), None, ReadyStatus.MALFORMED),
    (ready(12), None, ReadyStatus.MALFORMED),
    # stale: a valid token that is not the current one
    (ready(OLD), T, ReadyStatus.STALE),
])
def test_ready_table(msg, expected, status):
    assert classify_ready(msg, expected) is status


def test_ready_unowned_when_ownership_is_inconsistent():
    assert classify_ready(ready(T), T, consistent=False) is ReadyStatus.UNOWNED
    # ...but a malformed message is malformed first: it says nothing about ownership.
    assert classify_ready(ready([T]), T, consistent=False) is ReadyStatus.MALFORMED


@pytest.mark.parametrize("msg, expected, status", [
    ({"token": T}, None, ResultStatus.UNOWNED),
    ("garbage", None, ResultStatus.UNOWNED),
    ({"token": T}, T, ResultStatus.CURRENT),
    ({"token": OLD}, T, ResultStatus.STALE),
    ({"status": "ok"}, T, ResultStatus.MISSING),
    ({"token": ""}, T, ResultStatus.MISSING),
    ({"token": None}, T, ResultStatus.MISSING),
    ({"token": [T]}, T, ResultStatus.MALFORMED),
    ({"token": T.upper()}, T, ResultStatus.MALFORMED),
    ({"token": 5}, T, ResultStatus.MALFORMED),
    ([T], T, ResultStatus.MALFORMED),
    (b"\x00", T, ResultStatus.MALFORMED),
])
def test_result_table(msg, expected, status):
    assert classify_result(msg, expected) is status


@pytest.mark.parametrize("value, current, out", [
    (3, 5, 3), (5, 5, 5), (0, 5, 0), (-1, 5, -1),
    (6, 5, -1),          # future version
    (-2, 5, -1),         # below -1
    (True, 5, -1), (False, 5, -1),  # bools are not versions
    (3.0, 5, -1), ("3", 5, -1), (None, 5, -1), ([3], 5, -1),
])
def test_bitmap_version_fails_closed(value, current, out):
    assert sanitize_bitmap_version(value, current) == out


# --- ready_info: the READY fields an idle rank's message may set ----------------------------


def test_ready_profile_version_is_clipped_to_200_chars():
    """A worker cannot make the master store an unbounded string; short values pass unchanged,
    a non-string becomes the empty version."""
    assert ready_info({"empirical_profile_version": "p" * 1000}, 0).profile_version == "p" * 200
    assert ready_info({"empirical_profile_version": "p" * 200}, 0).profile_version == "p" * 200
    assert ready_info({"empirical_profile_version": "v1"}, 0).profile_version == "v1"
    assert ready_info({"empirical_profile_version": 7}, 0).profile_version == ""


@pytest.mark.parametrize("pid", [True, False, 0, -1, -4242, 1.0, "12", [12], None])
def test_ready_pid_must_be_a_positive_int(pid):
    """bool is an int subclass and 0/negatives are not process ids: all are dropped (None)."""
    assert ready_info({"pid": pid}, 0).pid is None


@pytest.mark.parametrize("pid", [1, 4242])
def test_ready_pid_positive_int_is_kept(pid):
    assert ready_info({"pid": pid}, 0).pid == pid


@pytest.mark.parametrize("fields, says", [
    ({"rank": 2}, "it says it is rank 2, and it came from rank 1"),
    ({"rank": True}, "it says it is rank True"),
    ({"pid": 2**64 - 1}, "pid 18446744073709551615 is not a process id"),
    ({"pid": 0}, "pid 0 is not a process id"),
    ({"pid": "12"}, "pid '12' is not a process id"),
    ({"host": ""}, "host '' is not a host name"),
    ({"host": "h" * 256}, "is not a host name"),
    ({"host": "\x1b[2J\x1b]0;pwn\x07h"}, "is not a host name"),  # drove status's terminal
    ({"host": "two words"}, "is not a host name"),
])
def test_a_ready_field_out_of_range_is_named(fields, says):
    """A READY with pid 2**64 - 1 ended the master when the store wrote it."""
    from coordinator.protocol import ready_problem
    assert says in ready_problem({**ready(T), **fields}, 1)
    assert ready_problem(ready(T), 1) is None


@pytest.mark.parametrize("field, value", [
    ("host", "\x00" * (16 << 20)), ("rank", "\x00" * (16 << 20)), ("pid", "\x00" * (16 << 20)),
])
def test_a_long_field_is_cut_before_it_is_shown(field, value):
    """A READY's host name of 16 MiB was repr'd whole (64 MiB, escaped) to show 60
    characters of it: a burst of them took the master's memory past 500 MiB."""
    import tracemalloc

    from coordinator.protocol import ready_problem
    tracemalloc.start()
    try:
        said = ready_problem({**ready(T), field: value}, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert said is not None and "\\x00\\x00" in said and len(said) < 120
    assert peak < 1 << 20, peak
