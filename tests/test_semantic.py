"""`store.semantic`: a payload's canonical form and semantic id, and what a stored task keeps
of it (R7, §4)."""

from __future__ import annotations

import pytest
from conftest import rows

from store.schema import tasks
from store.semantic import PayloadError, normalize, semantic_id

FULL = {"path": "/q/id:000001", "focus_bytes": [3, 1, 4], "target_branch": 2**63,
        "s2f_actions": [[7, "skip"], [2, "solve"]], "schedule_prefix": [5, 0, 5],
        "continuation": {"kind": "resume", "state": {"depth": 2}}}


def test_payload_round_trips_through_the_store(farm):
    [tid] = farm.enqueue(FULL)
    with farm.store.transaction() as tx:
        from store.tasks import get_task
        rec = get_task(tx, tid)
    assert rec.payload == normalize(FULL)
    assert rec.payload["s2f_actions"] == [[2, "solve"], [7, "skip"]]
    assert rec.payload["focus_bytes"] == [3, 1, 4]
    assert rec.semantic_id == semantic_id(FULL)


def test_identity_ignores_key_order_and_tokens_and_defaults(farm):
    reordered = dict(reversed(list(FULL.items())))
    assert semantic_id(reordered) == semantic_id(FULL)
    assert semantic_id({"path": "p", "target_branch": 0}) == semantic_id({"path": "p"})
    assert semantic_id({"path": "p", "target_branch": 2**64}) == semantic_id({"path": "p"})
    assert farm.enqueue(FULL, reordered) == [1]  # the same payload twice is one task
    # ... at every depth: a continuation or data mapping in another key order too
    nested = {"path": "p", "continuation": {"a": 1, "b": {"x": 2, "y": 3}},
              "data": {"m": 1, "n": 2}}
    renested = {"data": {"n": 2, "m": 1}, "continuation": {"b": {"y": 3, "x": 2}, "a": 1},
                "path": "p"}
    assert semantic_id(renested) == semantic_id(nested)
    farm.ready(1, "")
    assert farm.dispatch(1)  # a token now exists for it; the stored identity is unchanged
    assert rows(farm, tasks)[0].semantic_id == semantic_id(FULL)
    with pytest.raises(PayloadError, match="unknown"):
        semantic_id({**FULL, "token": "ab" * 32})


@pytest.mark.parametrize("bad, match", [
    ({}, "path"), ({"path": 3}, "path"), ({"path": "p", "focus_bytes": [-1]}, ">= 0"),
    ({"path": "p", "s2f_actions": [[1, "solve"], [1, "skip"]]}, "twice"),
    ({"path": "p", "s2f_actions": [[1, "fly"]]}, "solve"),
    ({"path": "p", "s2f_actions": [[i, "skip"] for i in range(65)]}, "at most 64"),
    ({"data": float("nan")}, "JSON"), ({"path": "p", "continuation": []}, "mapping"),
    ({"path": "id:000001,\udcff"}, "not valid Unicode"),  # a name that was not UTF-8
])
def test_bad_payloads_are_refused_clearly(bad, match):
    with pytest.raises(PayloadError, match=match):
        normalize(bad)
