"""The fake transports, one set for every test and tool that drives the master or a worker
without MPI: each is the part of `coordinator.transport.Transport` its side uses, scripted.

The master's side: `InstantWorkers` answer every WORK at once; the others change one thing
about it (a rank that repeats its READY, answers that arrive a few drains late, a rank that
dies, a start verdict and nothing else); and `QueuedComm`, a communicator under a real
`Transport`. The worker's side: `WorkerSide`.

Imported as `fakes` by the tests (pytest puts `tests/` on `sys.path`) and by
`tools/round_cost.py` (which puts it there itself).
"""

from __future__ import annotations

import time
from collections import deque

import msgspec
from mpi4py import MPI

from coordinator.transport import Received
from coordinator.wire import (
    TAG_READY,
    TAG_RESULT,
    TAG_STOP_ACK,
    Ready,
    Result,
    Stop,
    TaskResult,
    decode_start,
    decode_stop,
    decode_work,
    encode,
)


def ready_message(rank: int, token: str) -> Received:
    """A READY as the master receives it from `rank`, echoing `token` ("" for none)."""
    return Received(rank, TAG_READY, bytearray(encode(Ready(
        rank=rank, bitmap_version=0, empirical_profile_version="",
        completed_dispatch_token=token, host="test", pid=None))))


def valid_result(token: str) -> bytes:
    """An ok RESULT for `token`, encoded."""
    return encode(Result(token=token, status="ok", value={"n": 1}))


def ok_answer(work, duration_s: float = 0.0) -> bytes:
    """An ok RESULT for a decoded WORK: one task's, or every task's of a batch, each having
    run `duration_s` (as its worker measured it)."""
    if work.batch is None:
        return encode(Result(token=work.token, status="ok", value={"n": 1},
                             duration_s=duration_s))
    return encode(Result(token=work.token, status="ok", batch=[
        TaskResult(status="ok", value={"n": 1}, duration_s=duration_s) for _ in work.batch]))


# -- the master's side -----------------------------------------------------------------------

class InstantWorkers:
    """`workers` ranks whose first READYs are all waiting when the master starts, and which
    answer every WORK at once: its RESULT (ok) and the READY echoing its token wait at the
    master's next drains. Every STOP is answered with its STOP_ACK."""

    fault_tolerant = False
    any_failed = False
    rank = 0
    unreachable: frozenset[int] = frozenset()  # (ranks a posted send failed to reach)
    out_of_room = 0  # (polls that left a message past a round's budget: the drains take all)

    def __init__(self, workers: int = 2):
        self.size = workers + 1
        self.queues: dict[int, deque[Received]] = {
            TAG_READY: deque(ready_message(r, "") for r in range(1, self.size)),
            TAG_RESULT: deque(), TAG_STOP_ACK: deque()}

    def drain(self, tag: int, limit: int = 10_000, max_bytes: int | None = None):
        q = self.queues.get(tag, deque())
        for _ in range(limit):
            if not q:
                return
            yield q.popleft()

    def take_failed(self) -> list[int]:
        return []

    def waiting(self) -> bool:
        return True  # (the drains say what is there: some fakes make messages appear in them)

    def posted_to(self, tag: int) -> set[int]:
        return set()  # (every WORK is taken at once)

    def send_work(self, data: bytes, dest: int) -> None:
        work = decode_work(data)
        self.queues[TAG_RESULT].append(Received(dest, TAG_RESULT, bytearray(ok_answer(work))))
        self.queues[TAG_READY].append(ready_message(dest, work.token))

    def send_stop(self, data: bytes, dest: int) -> None:
        self.queues[TAG_STOP_ACK].append(Received(dest, TAG_STOP_ACK, bytearray(encode(Stop(
            token=decode_stop(data).token)))))


class RepeatingRank(InstantWorkers):
    """Two instant workers, and rank 2, like a broken worker, also has an empty-token READY
    waiting at each READY drain (idle, or `missing` while it holds a dispatch) until `works`
    WORKs have left: it is still sending when each of them leaves, however many READY drains
    the master makes meanwhile (150-350 with a 5 ms linger on a 2-core machine). `cap`
    bounds it, so that a master holding its round open until the READYs stop fails a test
    (it sends no WORK before the last of them) instead of hanging it."""

    def __init__(self, works: int, cap: int):
        super().__init__(2)
        self.works, self.cap = works, cap
        self.repeated = 0
        self.sent_while_repeating = 0

    def repeating(self) -> bool:
        return self.sent_while_repeating < self.works and self.repeated < self.cap

    def drain(self, tag: int, limit: int = 10_000, max_bytes: int | None = None):
        if tag == TAG_READY and self.repeating():
            self.repeated += 1
            yield ready_message(2, "")
            limit -= 1
        yield from super().drain(tag, limit)

    def send_work(self, data: bytes, dest: int) -> None:
        if self.repeating():
            self.sent_while_repeating += 1
        super().send_work(data, dest)


class StaggeredRanks(InstantWorkers):
    """Each rank's RESULT and READY become visible a given number of drains after its WORK
    left, one message per drain at most: the two halves of an answer (and the answers of
    different ranks) land in different batches of the same open round. The ranks' first
    READYs are all waiting at the master's first poll. `clock` counts the drains."""

    def __init__(self, delays: dict[int, tuple[int, int]]):
        super().__init__(len(delays))
        self.delays = delays  # rank -> (drains until RESULT, drains until READY)
        self.clock = 0
        self.pending: list[tuple[int, int, Received]] = []  # (visible at, tag, message)
        self.first_readies = [ready_message(rank, "") for rank in delays]
        self.queues[TAG_READY].clear()  # (they are `first_readies`)

    def drain(self, tag: int, limit: int = 10_000, max_bytes: int | None = None):
        self.clock += 1
        if tag == TAG_STOP_ACK:
            yield from super().drain(tag, limit)
            return
        if tag == TAG_READY and self.first_readies:  # all waiting when the master starts
            yield from self.first_readies
            self.first_readies = []
            return
        for i, (at, t, msg) in enumerate(self.pending):
            if t == tag and at <= self.clock:
                del self.pending[i]
                yield msg
                return

    def send_work(self, data: bytes, dest: int) -> None:
        token = decode_work(data).token
        to_result, to_ready = self.delays[dest]
        self.pending.append((self.clock + to_result, TAG_RESULT,
                             Received(dest, TAG_RESULT, bytearray(valid_result(token)))))
        self.pending.append((self.clock + to_ready, TAG_READY, ready_message(dest, token)))
        self.pending.sort(key=lambda p: p[0])


class ScriptedAnswers(StaggeredRanks):
    """Each WORK is answered by `script(token)`: (drains until visible, tag, encoded body)."""

    def __init__(self, ranks: int, script):
        super().__init__({r: (0, 0) for r in range(1, ranks + 1)})
        self.script = script

    def send_work(self, data: bytes, dest: int) -> None:
        token = decode_work(data).token
        for delay, tag, body in self.script(token):
            self.pending.append((self.clock + delay, tag, Received(dest, tag, bytearray(body))))
        self.pending.sort(key=lambda p: p[0])


def answered_after(drains: int):
    """A ScriptedAnswers script: a valid RESULT and its READY, visible `drains` drains on."""
    return lambda token: [(drains, TAG_RESULT, valid_result(token)),
                          (drains, TAG_READY, bytes(ready_message(1, token).data))]


class OneSilentRank(StaggeredRanks):
    """Rank 1 answers each WORK by the next drain. Rank 2 is silent: `never-heard` ranks never
    send their first READY (a rank stuck starting); `parked` ones send it, take a WORK and never
    answer, so the watchdog retires the dispatch and parks the rank."""

    def __init__(self, silent: str):
        super().__init__({1: (0, 0), 2: (0, 0)})
        if silent == "never-heard":
            self.first_readies = [ready_message(1, "")]

    def send_work(self, data: bytes, dest: int) -> None:
        if dest == 1:
            super().send_work(data, dest)


class LateStarter(StaggeredRanks):
    """Rank 1 answers at once; rank 2's first READY (it is still starting) comes only at drain
    `late`. Every STOP is answered, and the drain at which it was sent is kept."""

    def __init__(self, late: int):
        super().__init__({1: (0, 0), 2: (0, 0)})
        self.first_readies = [ready_message(1, "")]
        self.pending.append((late, TAG_READY, ready_message(2, "")))
        self.stops: list[tuple[int, int]] = []  # (rank, drain clock)

    def send_stop(self, data: bytes, dest: int) -> None:
        self.stops.append((dest, self.clock))
        super().send_stop(data, dest)


class TimedRanks(StaggeredRanks):
    """Each rank answers (RESULT and READY together) `seconds[rank]` of real time after its
    WORK left, as ranks running tasks of different lengths do, plus `task_s` for each task
    the WORK holds (which its RESULT says each ran); `clock` counts the drains, `sizes` the
    tasks of each WORK."""

    def __init__(self, seconds: dict[int, float], task_s: float = 0.0):
        super().__init__({rank: (0, 0) for rank in seconds})
        self.seconds, self.task_s = seconds, task_s
        self.timed: list[tuple[float, Received]] = []  # (visible at, message)
        self.sizes: list[int] = []

    def drain(self, tag: int, limit: int = 10_000, max_bytes: int | None = None):
        now = time.monotonic()
        for at, msg in [t for t in self.timed if t[0] <= now and t[1].tag == tag]:
            self.timed.remove((at, msg))
            self.queues[tag].append(msg)
        yield from super().drain(tag, limit)
        if tag in (TAG_RESULT, TAG_READY):
            yield from InstantWorkers.drain(self, tag, limit)

    def send_work(self, data: bytes, dest: int) -> None:
        work = decode_work(data)
        self.sizes.append(len(work.tasks()))
        at = time.monotonic() + self.seconds[dest] + self.task_s * len(work.tasks())
        self.timed.append((at, Received(dest, TAG_RESULT, bytearray(ok_answer(work,
                                                                              self.task_s)))))
        self.timed.append((at, ready_message(dest, work.token)))


class DyingRanks(InstantWorkers):
    """Rank 1 takes its WORK and dies (the runtime reports it at the next poll); rank 2 was
    never heard from."""

    def __init__(self):
        super().__init__(2)
        self.queues[TAG_READY] = deque([ready_message(1, "")])
        self.dead: list[int] = []

    def take_failed(self) -> list[int]:
        out, self.dead = self.dead, []
        return out

    def send_work(self, data: bytes, dest: int) -> None:
        self.dead.append(dest)


class VerdictTransport:
    """Rank 0 of a three-rank job that never runs a round: it only sends the start verdict."""

    rank, size, fault_tolerant, any_failed = 0, 3, False, False

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    def send_start(self, data: bytes, dest: int) -> None:
        self.sent.append((dest, decode_start(data).status))

    def unsettled_sends(self, wait_s: float = 0.0) -> list[int]:
        return []  # (every verdict is taken at once)

    @property
    def verdicts(self) -> list[object]:
        """The verdict, once for all workers: each was sent the same one."""
        assert sorted(d for d, _ in self.sent) == [1, 2]
        return sorted({status for _, status in self.sent})


class QueuedComm:
    """The part of an MPI communicator that a real `Transport` receives through, at rank 0:
    the messages sent to it (`arrive`) wait in one queue in arrival order, and a matched
    probe takes out the oldest one its source and tag match, as MPI does (one sender's
    messages on one tag stay in order). Whether the master holds a message, leaves it
    matched but unreceived or never matches it is then the real transport's doing."""

    def __init__(self, size: int):
        self.size = size
        self.queue: list[tuple[int, int, bytes]] = []  # (rank, tag, data), oldest first

    def arrive(self, rank: int, tag: int, data: bytes) -> None:
        self.queue.append((rank, tag, data))

    def waiting(self, tag: int) -> int:
        """How many messages on `tag` wait unmatched."""
        return sum(1 for _, t, _ in self.queue if t == tag)

    def Set_errhandler(self, handler) -> None:  # noqa: N802 (mpi4py's names)
        pass

    def Get_rank(self) -> int:  # noqa: N802
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def _first(self, source: int, tag: int) -> int | None:
        for i, (rank, got_tag, _) in enumerate(self.queue):
            if source in (MPI.ANY_SOURCE, rank) and tag in (MPI.ANY_TAG, got_tag):
                return i
        return None

    def Iprobe(self, source: int, tag: int) -> bool:  # noqa: N802
        return self._first(source, tag) is not None

    def Improbe(self, source: int, tag: int, status):  # noqa: N802
        at = self._first(source, tag)
        if at is None:
            return None
        rank, got_tag, data = self.queue.pop(at)
        status.Set_source(rank)
        status.Set_tag(got_tag)
        status.Set_elements(MPI.BYTE, len(data))
        return _Matched(data)


class _Matched:
    """A message `QueuedComm` matched: its `Recv` fills the buffer it is given."""

    def __init__(self, data: bytes):
        self.data = data

    def Recv(self, spec) -> None:  # noqa: N802
        spec[0][:len(self.data)] = self.data


# -- the worker's side -----------------------------------------------------------------------

class WorkerSide:
    """The part of `Transport` a worker uses: a script of messages from the master, and what
    the worker sent back."""

    rank, fault_tolerant = 1, False

    def __init__(self, messages):
        self.inbox = deque(messages)
        self.results: list[dict] = []
        self.readies: list[dict] = []
        self.backoffs: list = []

    def wait_for_master(self, backoff, timeout_s):
        self.backoffs.append(backoff)
        return self.inbox.popleft() if self.inbox else None

    def send_result(self, data: bytes) -> None:
        self.results.append(msgspec.msgpack.decode(data))

    def send_ready(self, data: bytes) -> None:
        self.readies.append(msgspec.msgpack.decode(data))

    def send_stop_ack(self, data: bytes) -> None:
        pass
