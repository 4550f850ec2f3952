"""The live display (coordinator/progress.py): when it refreshes."""

from __future__ import annotations


def test_progress_refreshes_less_often_when_its_read_is_slow():
    """A refresh counts whole tables (a quarter second at a million tasks): every half second,
    that cut a large campaign's rate by 2-3x. The next refresh waits LOAD_FACTOR x the read."""
    from coordinator.progress import Progress
    p = Progress(live=True)  # not started: due() draws nothing
    assert p.due(100.0) and not p.due(100.4) and p.due(100.5)
    p.took(100.5, 0.001)  # a cheap read changes nothing
    assert p.due(101.0)
    p.took(101.0, 0.25)
    assert not p.due(101.0 + Progress.LOAD_FACTOR * 0.25 - 0.01)
    assert p.due(101.0 + Progress.LOAD_FACTOR * 0.25)
