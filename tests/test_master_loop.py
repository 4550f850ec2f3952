"""The master's round against a real campaign file and a scripted transport (no MPI): what the
loop itself decides, like when a round that lingers for more answers must end anyway."""

from __future__ import annotations

from collections import deque

import pytest
from sqlalchemy import func, select

from coordinator.master import Master, MasterConfig
from coordinator.sources import demo_tasks
from coordinator.transport import Received
from coordinator.wire import (
    TAG_READY, TAG_RESULT, TAG_STOP_ACK, Ready, Result, Stop, decode_stop, decode_work, encode,
)
from store.campaign import Store
from store.schema import results, tasks
from store.tasks import NewTask, enqueue_tasks


def _ready(rank: int, token: str) -> Received:
    return Received(rank, TAG_READY, bytearray(encode(Ready(
        rank=rank, bitmap_version=0, empirical_profile_version="",
        completed_dispatch_token=token, host="test", pid=None))))


SPAM_DRAINS = 20_000


class ScriptedRanks:
    """The part of `Transport` the master uses. Both ranks answer each WORK (RESULT, READY)
    by the master's next drain; rank 2, like a broken worker, also has an empty-token READY
    waiting on each of the first `SPAM_DRAINS` drains (idle, or `missing` while it holds a
    dispatch): rounds must end meanwhile, so the work goes on."""

    fault_tolerant = False
    any_failed = False
    rank = 0
    size = 3

    def __init__(self):
        self.queues = {TAG_READY: deque([_ready(1, ""), _ready(2, "")]),
                       TAG_RESULT: deque(),
                       TAG_STOP_ACK: deque()}
        self.spam_readies = 0
        self.committed_during_spam = 0

    def drain(self, tag: int, limit: int = 10_000):
        if tag == TAG_READY and self.spam_readies < SPAM_DRAINS:
            self.spam_readies += 1
            yield _ready(2, "")
        q = self.queues.get(tag, deque())
        while q:
            yield q.popleft()

    def take_failed(self) -> list[int]:
        return []

    def send_work(self, data: bytes, dest: int) -> None:
        work = decode_work(data)
        if self.spam_readies < SPAM_DRAINS:
            self.committed_during_spam += 1
        self.queues[TAG_RESULT].append(Received(dest, TAG_RESULT, bytearray(encode(Result(
            token=work.token, status="ok", value={"n": 1})))))
        self.queues[TAG_READY].append(_ready(dest, work.token))

    def send_stop(self, data: bytes, dest: int) -> None:
        self.queues[TAG_STOP_ACK].append(Received(dest, TAG_STOP_ACK, bytearray(encode(Stop(
            token=decode_stop(data).token)))))


@pytest.mark.timeout(60)
def test_a_rank_that_never_stops_sending_does_not_hold_a_round_open(tmp_path):
    store = Store.open(tmp_path / "c.db")
    try:
        with store.transaction("import") as tx:
            enqueue_tasks(tx, [NewTask(t.payload, origin="demo") for t in demo_tasks(5)])
        ranks = ScriptedRanks()
        summary = Master(store, ranks, MasterConfig(
            linger_s=0.005, grace_s=1, stop_wait_s=1, stats_file=None)).run()
        with store.reading() as conn:
            done = conn.execute(select(func.count()).where(tasks.c.state == "done")).scalar()
            committed = conn.execute(select(func.count()).select_from(results)).scalar()
    finally:
        store.close()
    assert (summary.exit_status, done, committed) == (0, 5, 5)
    # Every WORK left while rank 2 was still sending: no round waited for it to stop.
    assert ranks.committed_during_spam == 5
