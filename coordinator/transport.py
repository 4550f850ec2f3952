"""MPI point to point: the only module that speaks MPI.

Receives use matched probes (`improbe` + `Message.Recv`) into byte buffers sized from the
probe, so nothing is unpickled, a message can never be received by the wrong call, and a dead
rank's queued leftovers are drained like any other message (docs/mpi-notes.md: `Iprobe` followed by
`recv(source=rank)` can loop forever on them). No wildcard receive is ever pre-posted.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from mpi4py import MPI

from .wire import (
    TAG_READY,
    TAG_RESULT,
    TAG_START,
    TAG_STOP,
    TAG_STOP_ACK,
    TAG_WORK,
    held_bound,
)

#: `poll`/`drain` on every tag.
ANY_TAG = MPI.ANY_TAG


@dataclass(frozen=True)
class Received:
    rank: int
    tag: int
    data: bytearray | None  # None: over the receiver's bound, consumed without being kept
    size: int = -1          # the message's bytes (as sent); -1: len(data)

    @property
    def oversized(self) -> bool:
        return self.data is None


class MasterGone(Exception):
    """Rank 0 is gone (ULFM reported it dead, or a send to it failed): a worker has nobody
    left to work for. The message says how it was found out."""


class SendFailed(Exception):
    def __init__(self, rank: int, cause: BaseException):
        self.rank, self.cause = rank, cause
        super().__init__(f"send to rank {rank} failed: {cause}")


class Backoff:
    """Poll with an exponential sleep that resets on progress (mpi4py.futures does the same).

    Two stages: right after progress the next message usually follows within a commit's time,
    so sleeps stay short (`fast_cap`) for `fast_window` seconds; after that the rank is really
    idle and sleeps up to `cap`, so waiting ranks cost next to no CPU (MPICH ranks blocked in
    recv spin and starve the master; polling ranks that sleep do not).

    `yield_window`: for that long after progress, poll without sleeping, giving the CPU to
    any other runnable process between polls (`sched_yield`), then sleep as above. A sleep of
    10-50 µs lasts longer than it asks for, and an idle worker's next WORK waits that long to
    be noticed, on every task's critical path (see `worker_spin_default`).

    Spinning pays only while the cores are not all wanted: a yield that comes back late
    (LATE_YIELD_S, longer than any of the job's own ranks holds a core between two waits)
    means a process outside the job was given the core, one that runs as long as the kernel
    lets it. Spinning then takes the CPU the master needs (beside one CPU-bound process, a
    2-core job's throughput collapses), so the wait goes to sleeping at once, and the next
    ones do for CONTENDED_S before spinning is tried again."""

    LATE_YIELD_S = 1e-3
    CONTENDED_S = 1.0

    def __init__(self, start: float = 10e-6, fast_cap: float = 50e-6, cap: float = 2e-3,
                 fast_window: float = 0.05, spins: int = 4, yield_window: float = 0.0):
        self.start, self.fast_cap, self.cap = start, fast_cap, cap
        self.fast_window, self.spins, self.yield_window = fast_window, spins, yield_window
        self.contended_until = 0.0
        self.late_yields = 0  # how often spinning was given up (for tests and tuning)
        self.reset()

    def reset(self) -> None:
        self._n, self._delay = 0, self.start
        self._since = time.monotonic()

    def wait(self, quiet_s: float = 0.0) -> None:
        """One wait between polls. `quiet_s`: how long the caller knows nothing is due (the
        master: no rank's answer); past the next sleep's length, it sleeps that long (at
        most `cap`) instead of polling again sooner."""
        self._n += 1
        if self._n <= self.spins:
            return
        if quiet_s > self._delay:
            time.sleep(min(quiet_s, self.cap))
            return
        if self.yield_window:
            now = time.monotonic()
            if now - self._since < self.yield_window and now >= self.contended_until:
                os.sched_yield()
                back = time.monotonic()
                if back - now > self.LATE_YIELD_S:
                    self.late_yields += 1
                    self.contended_until = back + self.CONTENDED_S
                return
        time.sleep(self._delay)
        fast = time.monotonic() - self._since < self.fast_window
        self._delay = min(self._delay * 2, self.fast_cap if fast else self.cap)


def tighten_timer_slack(ns: int = 1_000) -> bool:
    """Make this process's short sleeps last about what they ask for (Linux only).

    With the kernel's default timer slack (50 µs) the backoff's `sleep(10 µs)` lasts several
    times what it asks for, and every WORK waits that long to be noticed by its worker, and
    every answer by the master's linger, on each task's critical path."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_TIMERSLACK, ns, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


PR_SET_TIMERSLACK = 29

#: How long an idle worker polls for its next WORK without sleeping, by default (seconds).
WORKER_SPIN_S = 0.05


def worker_spin_default() -> float:
    """The default of `--worker-spin-ms`, by the MPI library: WORKER_SPIN_S under Open MPI,
    none under any other.

    Under Open MPI, workers that poll and yield after each answer notice their next WORK
    sooner than workers that sleep between polls, and the coordinator runs faster. Under
    MPICH the same polling makes it slower (and, without the yield, starves the master), so
    there workers sleep at once (docs/performance.md, "What moved the figures")."""
    return WORKER_SPIN_S if MPI.Get_library_version().startswith("Open MPI") else 0.0

#: ULFM's error class for "a process in the operation failed" (MPI_ERR_PROC_FAILED).
ERR_PROC_FAILED = getattr(MPI, "ERR_PROC_FAILED", 75)


def is_process_failure(e: BaseException) -> bool:
    return isinstance(e, MPI.Exception) and e.Get_error_class() == ERR_PROC_FAILED


class Transport:
    def __init__(self, comm: MPI.Comm | None = None):
        self.comm = comm or MPI.COMM_WORLD
        # Errors come back as exceptions, not job aborts, so the master can decide.
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._status = MPI.Status()
        #: Started with Open MPI's ULFM (`--with-ft ulfm`): a rank's death or MPI_Abort does
        #: not end the job there, and MPI_Finalize can hang after a failure (ompi#11404), so
        #: the ranks end the job themselves (see runtime.end_job and worker.serve).
        self.fault_tolerant = os.environ.get("OMPI_MCA_mpi_ft_enable") == "1"  # noqa: SIM112 (its own case)
        self._failed: set[int] = set()      # every rank the runtime reported dead
        tighten_timer_slack()
        self._new_failed: list[int] = []    # reported since the last take_failed()
        #: A larger RESULT is consumed without being held (`poll`), and so is a message on
        #: any other tag over its smaller bound (`wire.held_bound`); None: no bound (the
        #: workers, which receive only from the master).
        self.max_message_bytes: int | None = None
        #: The master's sends not yet known to be complete (`post`): requests, and beside
        #: them their bytes (which must live until then), ranks and tags. A few per rank at
        #: most: a rank gets WORK only after its READY, STOP once, START once.
        self._requests: list[MPI.Request] = []
        self._posted: list[tuple[bytes, int, int]] = []
        self._statuses: list[MPI.Status] = []  # Testsome's, kept for the next call
        #: Ranks a posted send failed to reach for another reason than their death.
        self.unreachable: set[int] = set()
        #: Messages probed (matched) but left unreceived: larger than what the caller could
        #: still hold (`poll`'s `room`). (message, rank, tag, size), oldest first; each is
        #: the first that a poll matching it returns.
        self._deferred: list[tuple[MPI.Message, int, int, int]] = []
        #: How many polls found their next message larger than their `room`: the caller
        #: compares it across a drain to learn that the drain stopped short. (The count of
        #: deferred messages cannot say it: a drain that takes the one deferred before and
        #: defers the next leaves it as it was.)
        self.out_of_room = 0

    # -- failure notification (ULFM) ---------------------------------------------------------
    def _note_failure(self) -> None:
        """Learn which ranks died (MPI raised ERR_PROC_FAILED) and acknowledge them, after
        which wildcard probes and traffic with the survivors work again."""
        group = self.comm.Get_failed()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                              self.comm.Get_group())
        finally:
            group.Free()
        self.comm.Ack_failed()
        for r in ranks:
            if r != MPI.UNDEFINED:
                self._mark_failed(r)

    def _mark_failed(self, rank: int) -> None:
        if rank not in self._failed:
            self._failed.add(rank)
            self._new_failed.append(rank)

    def take_failed(self) -> list[int]:
        """Ranks reported dead since the last call: by ULFM, or (with or without it) a rank
        whose posted send failed after it left (`settle_sends`)."""
        out, self._new_failed = self._new_failed, []
        return out

    @property
    def any_failed(self) -> bool:
        return bool(self._failed)

    # -- receiving -------------------------------------------------------------------------
    def poll(self, tag: int, source: int = MPI.ANY_SOURCE, room: int | None = None,
             ) -> Received | None:
        """The next message on `tag` (ANY_TAG: on any), received into a buffer of its own
        size; one over its tag's bound (`wire.held_bound`) is consumed into a small buffer and
        never held (held whole, a 1.9 GB message would take the master's RSS to 1.9 GiB, and
        one over 2 GiB would end it).

        `room`: the most bytes the caller may still hold. A larger message that would be held
        is left matched but unreceived (`deferred`), None returned and `out_of_room` counted;
        it is what the next poll on its tag returns, once it fits. (Received first and
        compared after, the message that crossed a round's budget was held beside the
        budget's worth: twice --max-message-bytes.)"""
        try:
            at = self._deferred_at(tag, source)
            if at is not None:
                msg, rank, got_tag, size = self._deferred[at]
            else:
                # `Improbe`, not `improbe`: the latter allocates the message's size for a
                # pickle before anything can look at it.
                msg = self.comm.Improbe(source=source, tag=tag, status=self._status)
                if msg is None:
                    return None
                rank, got_tag = self._status.Get_source(), self._status.Get_tag()
                # Bytes, from the elements: `Get_count` is MPI_UNDEFINED past 2**31 - 1.
                size = self._status.Get_elements(MPI.BYTE)
                limit = self.max_message_bytes
                if limit is not None and size > held_bound(got_tag, limit):
                    _discard(msg, size)
                    return Received(rank, got_tag, None, size)
            if room is not None and size > room:
                if at is None:
                    self._deferred.append((msg, rank, got_tag, size))
                self.out_of_room += 1
                return None
            if at is not None:
                del self._deferred[at]
            buf = bytearray(size)
            msg.Recv([buf, MPI.BYTE])
        except MPI.Exception as e:
            if not is_process_failure(e):
                raise
            self._note_failure()
            return None
        return Received(rank, got_tag, buf, size)

    def _deferred_at(self, tag: int, source: int) -> int | None:
        """Where the oldest deferred message that `tag` and `source` match is, if any: it
        came before any message a probe would match now (MPI keeps one sender's messages on
        one tag in order)."""
        for i, (_, rank, got_tag, _) in enumerate(self._deferred):
            if tag in (ANY_TAG, got_tag) and source in (MPI.ANY_SOURCE, rank):
                return i
        return None

    @property
    def deferred(self) -> int:
        """How many messages wait probed but unreceived, too large for their poll's room."""
        return len(self._deferred)

    def waiting(self) -> bool:
        """Whether any message waits, on any tag, from any rank: one probe that receives
        nothing. The master's idle polls ask this first: draining each tag costs a poll three
        matched probes (RESULT, READY, the rest): 4.3-5.1 µs of CPU against 1.3-1.5 here."""
        self.settle_sends()
        if self._deferred:
            return True
        try:
            return self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        except MPI.Exception as e:
            if not is_process_failure(e):
                raise
            self._note_failure()
            return True  # (the drains then take what the survivors sent)

    def drain(self, tag: int, limit: int = 10_000, max_bytes: int | None = None,
              ) -> Iterator[Received]:
        """Everything already waiting on `tag`, bounded in count (one phase cannot starve
        the rest) and, with `max_bytes`, in the bytes it holds: it ends at the first message
        that does not fit in what is left, which stays unreceived (`poll`'s `room`)."""
        held = 0
        for _ in range(limit):
            got = self.poll(tag, room=None if max_bytes is None else max_bytes - held)
            if got is None:
                return
            yield got
            held += len(got.data) if got.data is not None else 0

    # -- sending ---------------------------------------------------------------------------
    def send(self, data: bytes, dest: int, tag: int) -> None:
        try:
            self.comm.Send([data, MPI.BYTE], dest=dest, tag=tag)
        except MPI.Exception as e:
            if is_process_failure(e):
                self._note_failure()
            raise SendFailed(dest, e) from e

    def send_work(self, data: bytes, dest: int) -> None:
        self.post(data, dest, TAG_WORK)

    def post(self, data: bytes, dest: int, tag: int) -> None:
        """The master's send (WORK, STOP, the start verdict): it leaves without the master
        waiting for it to be taken. A blocking send did wait: Open MPI's shared-memory
        transport completes even a small send only once the receiver has taken it (until a
        peer has had 16 messages), and a larger one always waits for the receiver. A worker
        takes it at its next poll, when the kernel next runs it: with 63 workers on 2 cores
        a WORK send took a median 8 ms, and a rank that does not poll (stopped) froze the
        master for good. A send that fails at once raises SendFailed (it never left); one
        that fails later reports its rank dead (`take_failed`: recovered as after a send)."""
        try:
            request = self.comm.Isend([data, MPI.BYTE], dest=dest, tag=tag)
        except MPI.Exception as e:
            if is_process_failure(e):
                self._note_failure()
            raise SendFailed(dest, e) from e
        self._requests.append(request)
        self._posted.append((data, dest, tag))

    def settle_sends(self) -> None:
        """Forget the posted sends that completed (one `Testsome` for all); a rank whose
        send failed is reported dead (with ULFM, as the runtime says; otherwise that rank
        alone)."""
        if not self._requests:
            return
        while len(self._statuses) < len(self._requests):
            self._statuses.append(MPI.Status())
        try:
            done = MPI.Request.Testsome(self._requests, self._statuses)
        except MPI.Exception:
            done = self._settle_failed(self._statuses)
        if done is None:  # (every request inactive: none can still be pending)
            done = list(range(len(self._requests)))
        if done:
            finished = set(done)
            self._requests = [r for i, r in enumerate(self._requests) if i not in finished]
            self._posted = [p for i, p in enumerate(self._posted) if i not in finished]

    def _settle_failed(self, statuses: list[MPI.Status]) -> list[int]:
        """After `Testsome` raised (MPI_ERR_IN_STATUS): which sends completed, and the ranks
        of those that failed, reported dead. The error does not say which sends completed,
        and MPI has already freed them (a `Test` of each would now say "done" for the
        failed one too), so they are the requests now null (every one was active before the
        call). A process failure names no rank: the runtime's list of failed ranks does
        (ULFM). Any other error is taken as its own send's, the statuses being in the order
        of the requests (Testsome's indices ascend in the implementations used here)."""
        done = [i for i, r in enumerate(self._requests) if r == MPI.REQUEST_NULL]
        for i, status in zip(done, statuses, strict=False):
            error = status.Get_error()
            if error == MPI.SUCCESS:
                continue
            if MPI.Get_error_class(error) == ERR_PROC_FAILED:
                self._note_failure()
            else:  # (alive as far as MPI knows: to be ended with the job, not mourned)
                self.unreachable.add(self._posted[i][1])
                self._mark_failed(self._posted[i][1])
        return done

    def posted_to(self, tag: int = TAG_WORK) -> set[int]:
        """The ranks that have not yet taken what was posted to them on `tag`."""
        self.settle_sends()
        return {dest for _, dest, t in self._posted if t == tag}

    def unsettled_sends(self, wait_s: float = 0.0) -> list[int]:
        """The ranks that have not taken what was posted to them, after waiting up to
        `wait_s`: MPI_Finalize could wait on them for ever."""
        deadline = time.monotonic() + wait_s
        while True:
            self.settle_sends()
            if not self._posted or time.monotonic() >= deadline:
                return sorted({dest for _, dest, _ in self._posted})
            time.sleep(0.001)

    def send_stop(self, data: bytes, dest: int) -> None:
        self.post(data, dest, TAG_STOP)

    # -- worker side -------------------------------------------------------------------------
    def send_result(self, data: bytes) -> None:
        self.send(data, 0, TAG_RESULT)

    def send_ready(self, data: bytes) -> None:
        self.send(data, 0, TAG_READY)

    def send_stop_ack(self, data: bytes) -> None:
        self.send(data, 0, TAG_STOP_ACK)

    def wait_for_master(self, backoff: Backoff, timeout_s: float) -> Received | None:
        """Worker: the next WORK or STOP from rank 0, polling (never a blocking recv);
        None after `timeout_s` without either."""
        backoff.reset()
        deadline = time.monotonic() + timeout_s
        while True:
            for tag in (TAG_STOP, TAG_WORK):
                got = self.poll(tag, source=0)
                if got is not None:
                    return got
            if 0 in self._failed:
                raise MasterGone("the MPI runtime reported rank 0 dead")
            if time.monotonic() >= deadline:
                return None
            backoff.wait()

    def send_start(self, data: bytes, dest: int) -> None:
        self.post(data, dest, TAG_START)

    def wait_for_start(self) -> Received:
        """Worker: the master's start verdict (or a STOP that came first), polling with
        sleeps, never blocked in MPI: a rank blocked in MPI spins (MPICH) or yields in a loop
        (Open MPI, oversubscribed), and the master may spend minutes importing a tasks file
        on the same cores (300,000 tasks on 2 cores: 3 workers blocked in MPI would burn 17 s
        of CPU in an 18 s start). No collective: another rank's death during the start costs
        that rank only (a barrier or broadcast fails for every rank under ULFM)."""
        backoff = Backoff(start=100e-6, fast_cap=1e-3, cap=20e-3)
        while True:
            for tag in (TAG_STOP, TAG_START):
                got = self.poll(tag, source=0)
                if got is not None:
                    return got
            if 0 in self._failed:
                raise MasterGone("the MPI runtime reported rank 0 dead during the start")
            backoff.wait()

    def finalize(self) -> None:
        """MPI_Finalize now, rather than at the interpreter's exit (mpi4py's own handler)."""
        if not MPI.Is_finalized():
            MPI.Finalize()

    def abort(self, code: int) -> None:
        """MPI_Abort: ends every rank of the job (without ULFM)."""
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.5)  # MPICH's launcher drops output not yet forwarded when the job aborts
        self.comm.Abort(code)


#: What an oversized message is received into, a piece at a time.
_DISCARD_CHUNK = 1 << 20


def _discard(msg: MPI.Message, size: int) -> None:
    """Receive `msg` of `size` bytes without holding it: into one small buffer that a
    datatype with a stride of 0 maps every piece onto. (A plain receive into a small buffer,
    which MPI answers with a truncation error, crashed Open MPI for a rendezvous message.)"""
    chunks, rest = divmod(size, _DISCARD_CHUNK)
    parts = []
    if chunks:
        parts.append(MPI.BYTE.Create_vector(chunks, _DISCARD_CHUNK, 0))
    if rest:
        parts.append(MPI.BYTE.Create_contiguous(rest))
    whole = (parts[0] if len(parts) == 1 else
             MPI.Datatype.Create_struct([1] * len(parts), [0] * len(parts), parts))
    whole.Commit()
    try:
        msg.Recv([bytearray(_DISCARD_CHUNK if chunks else max(rest, 1)), 1, whole])
    finally:
        whole.Free()
        for part in parts:
            if part is not whole:
                part.Free()
