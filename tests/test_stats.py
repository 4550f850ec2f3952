"""`store.stats`: the counters and the stats text (R10), read from the rows a campaign wrote."""

from __future__ import annotations

from conftest import Farm, defer

from store.stats import read_stats, stats_text


def test_stats_text_labels(farm):
    for p in ({"data": 1}, {"data": 2}):
        farm.enqueue(p)
    farm.ready(1, "")
    farm.ready(2, "")
    toks = farm.dispatch(1, 2)
    old = "12" * 32
    farm.ready_raw(1, "garbage")                       # ready malformed
    farm.ready(2, old)                                 # ready stale
    farm.result(1, [toks[1]])                          # result malformed
    farm.result(2, old)                                # result stale
    farm.result(1, "34" * 32)                          # result stale
    farm.ready(1, toks[1])
    farm.sweep()                                       # rank 1: joined -> requeued
    farm.dispatch(1)
    with farm.store.reading() as conn:
        text = stats_text(read_stats(conn))
    assert "Quarantined worker ready messages: 2 (malformed=1,stale=1)\n" in text
    assert "Quarantined worker results: 3 (malformed=1,stale=2)\n" in text
    assert "Protocol-requeued dispatches: 1\n" in text
    assert "Protocol-deferred dispatches: 0\n" in text
    assert "Dispatch watchdog timeouts: 0\n" in text


def test_stats_text_sorts_the_reasons_whatever_order_they_come_in():
    """R10: reasons sorted, joined by commas without spaces (the store's GROUP BY happens to
    return them sorted through its index; the text must not depend on that)."""
    from store.stats import Stats
    s = Stats(tasks={}, results=0, quarantine={"result": {"stale": 1, "malformed": 2},
                                               "ready": {"unowned": 3, "missing": 4}},
              requeued=0, deferred=0, watchdog_timeouts=0, watchdog_recoveries=0,
              incarnation=1, schema_revision=None)
    text = stats_text(s)
    assert "Quarantined worker results: 3 (malformed=2,stale=1)\n" in text
    assert "Quarantined worker ready messages: 7 (missing=4,unowned=3)\n" in text


def test_status_groups_held_tasks_by_their_reason(db_path, tmp_path):
    from store.stats import held_reasons
    farm = Farm(db_path)
    for i in range(3):
        defer(farm, {"data": i})
    with farm.store.reading() as conn:
        [(reason, n)] = held_reasons(conn)["deferred"]
        assert n == 3 and reason
        assert "failed" not in held_reasons(conn)
    farm.close()
