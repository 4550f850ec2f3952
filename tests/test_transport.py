"""Polling without MPI traffic: the timer slack that decides how long a backoff sleep lasts,
and when a backoff yields the CPU instead of sleeping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SLACK = Path("/proc/self/timerslack_ns")


def in_a_child(code: str) -> list[str]:
    """Run `code` in a fresh Python, which initialises this environment's MPI library by
    itself; the words it printed."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not SLACK.exists(), reason="needs Linux >= 4.6 (/proc/self/timerslack_ns)")
def test_a_transport_tightens_its_process_timer_slack():
    # In a child, so the slack of the test process itself is left alone; the Transport does
    # it at construction, which is what both the master and the workers build first.
    code = ("import ctypes\n"
            "from pathlib import Path\n"
            "ctypes.CDLL(None).prctl(29, 77_777, 0, 0, 0)  # PR_SET_TIMERSLACK\n"
            "before = int(Path('/proc/self/timerslack_ns').read_text())\n"
            "from coordinator.transport import Transport\n"
            "Transport()\n"
            "print(before, int(Path('/proc/self/timerslack_ns').read_text()))\n")
    before, after = map(int, in_a_child(code))
    assert (before, after) == (77_777, 1_000)


class _Clock:
    def __init__(self):
        self.now, self.slept, self.yields = 100.0, [], 0
        self.yield_takes = 1e-6  # the core given straight back: nobody else wanted it

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.slept.append(s)
        self.now += s

    def sched_yield(self):
        self.yields += 1
        self.now += self.yield_takes


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    """The backoff's clock, sleep and yield, recorded instead of spent."""
    from coordinator import transport
    c = _Clock()
    monkeypatch.setattr(transport.time, "monotonic", c.monotonic)
    monkeypatch.setattr(transport.time, "sleep", c.sleep)
    monkeypatch.setattr(transport.os, "sched_yield", c.sched_yield)
    return c


def test_a_backoff_yields_instead_of_sleeping_within_its_yield_window(clock):
    """Pure logic: the first `spins` waits return at once, then each wait yields the CPU
    until `yield_window` has passed since the last reset, then the sleeps start from `start`
    and double; a reset starts the window again."""
    from coordinator import transport
    clock.yield_takes = 0.9e-3  # each yield lets the job's own ranks run: not late
    b = transport.Backoff(start=10e-6, fast_cap=40e-6, spins=2, yield_window=0.0044)
    for _ in range(2 + 5):
        b.wait()
    assert (clock.yields, clock.slept) == (5, [])
    for _ in range(4):
        b.wait()
    assert clock.yields == 5 and clock.slept == [10e-6, 20e-6, 40e-6, 40e-6]
    b.reset()
    for _ in range(3):
        b.wait()
    assert clock.yields == 6 and len(clock.slept) == 4


def test_a_late_yield_turns_spinning_off_for_a_while(clock):
    """Pure logic: a yield that comes back late (another process was given the core) ends
    the spinning of this wait and of every wait for CONTENDED_S; then spinning is tried
    again, and stays on while the yields come back at once."""
    from coordinator import transport
    b = transport.Backoff(start=10e-6, fast_cap=40e-6, spins=0, yield_window=0.05)
    b.wait()
    assert (clock.yields, clock.slept, b.late_yields) == (1, [], 0)
    clock.yield_takes = 4e-3  # a CPU-bound neighbour ran for its time slice
    b.wait()
    assert (clock.yields, b.late_yields) == (2, 1)
    clock.yield_takes = 1e-6
    for _ in range(3):
        b.wait()
    assert clock.yields == 2 and clock.slept == [10e-6, 20e-6, 40e-6]  # no more spinning
    b.reset()
    b.wait()
    assert clock.yields == 2 and len(clock.slept) == 4  # nor in the next wait, for a while
    clock.now += transport.Backoff.CONTENDED_S
    b.reset()
    for _ in range(3):
        b.wait()
    assert clock.yields == 5 and len(clock.slept) == 4 and b.late_yields == 1


def test_a_backoff_without_a_yield_window_never_yields(clock):
    from coordinator import transport
    b = transport.Backoff(start=10e-6, fast_cap=40e-6, spins=1)
    for _ in range(4):
        b.wait()
    assert clock.yields == 0 and clock.slept == [10e-6, 20e-6, 40e-6]


def test_a_wait_with_nothing_due_sleeps_until_then_at_most_its_cap(clock):
    """Pure logic: told that nothing is due for a while (`quiet_s`), a wait sleeps that long,
    up to `cap`, instead of its short fast-window sleep; told nothing, or less than its next
    sleep, it backs off as before."""
    from coordinator import transport
    b = transport.Backoff(start=10e-6, fast_cap=40e-6, cap=2e-3, spins=1)
    b.wait(quiet_s=1.0)  # (a spin: returns at once)
    b.wait(quiet_s=1.5e-3)
    b.wait(quiet_s=1.0)
    b.wait(quiet_s=5e-6)
    b.wait()
    assert clock.slept == [1.5e-3, 2e-3, 10e-6, 20e-6]


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_workers_spin_by_default_only_under_open_mpi():
    """Measured (docs/performance.md): workers that poll and yield after an answer were faster
    under Open MPI and slower, unsteadily, under MPICH. Run in a child, which initialises the
    MPI library of this environment (the MPICH one in CI's second environment)."""
    library, spins, value = in_a_child(
        "from mpi4py import MPI\n"
        "from coordinator.transport import WORKER_SPIN_S, worker_spin_default\n"
        "print(MPI.Get_library_version().split()[0], worker_spin_default() == WORKER_SPIN_S,"
        " worker_spin_default())\n")
    assert (spins == "True") == (library == "Open") == (float(value) > 0), (library, value)


#: Rank 1 posts two RESULTs of 1 MiB (A, B) and one of 16 bytes (C). Rank 0 drains with no
#: room (A waits, matched), then, once B can be matched, with room for one and a half of
#: them (A comes first, B waits), then, once C can be matched, for 16 bytes, then for all.
#: Each "once" is a probe, not a sleep: MPICH moves a 1 MiB message only while its receiver
#: calls MPI (after a 0.5 s sleep, B and C had not arrived), and a message matched by a drain
#: is out of the probe's way, so the probe sees the next one behind it.
PAST_THE_ROOM = """
import os, time
from coordinator.transport import ANY_TAG, Transport
from coordinator.wire import TAG_RESULT
from mpi4py import MPI
t = Transport()
MiB = 1 << 20
if t.rank == 1:
    sent = [b"A" * MiB, b"B" * MiB, b"C" * 16]
    MPI.Request.Waitall([t.comm.Isend([m, MPI.BYTE], dest=0, tag=TAG_RESULT) for m in sent])
    os._exit(0)
t.max_message_bytes = 4 * MiB
def matchable(what):
    deadline = time.monotonic() + 15
    while not t.comm.Iprobe(source=1, tag=TAG_RESULT):
        if time.monotonic() > deadline:
            print("NEVER", what, flush=True)
            os._exit(1)
        time.sleep(0.001)
def taken(tag, room):
    got = "".join(chr(r.data[0]) + str(len(r.data)) for r in t.drain(tag, max_bytes=room))
    return got or "-"
matchable("A")
print("NONE", taken(TAG_RESULT, 0), t.deferred, t.out_of_room)
matchable("B")
print("FIRST", taken(TAG_RESULT, MiB + MiB // 2), t.deferred, t.out_of_room, t.waiting())
matchable("C")
print("SMALL", taken(TAG_RESULT, 16), t.deferred, t.out_of_room)
print("REST", taken(ANY_TAG, 4 * MiB), t.deferred, t.out_of_room, flush=True)
os._exit(0)
"""


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_a_message_past_a_drains_room_waits_unreceived_and_comes_first(tmp_path):
    """A drain bounded in bytes received the message that crossed its bound before it
    compared: a round whose budget of --max-message-bytes was nearly spent held another
    message of that size beside it (a burst of 60 MB messages took the master to 199 MiB
    with the default 64 MiB bound, 70 of them its own). The size is compared from the probe;
    the message is received by the next drain on its tag that has room, before any later
    one."""
    from mpi_jobs import MPIEXEC

    from coordinator.launcher import mpiexec_flags
    script = tmp_path / "room.py"
    script.write_text(PAST_THE_ROOM)
    out = subprocess.run([MPIEXEC, *mpiexec_flags(MPIEXEC, 2), sys.executable, str(script)],
                         capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parent.parent)
    lines = [x for x in out.stdout.splitlines()
             if x.split(" ")[0] in ("NONE", "FIRST", "SMALL", "REST", "NEVER")]
    # FIRST takes the message deferred before and defers the next: the count of deferred
    # messages is what it was, and only `out_of_room` says that the drain stopped short.
    assert lines == ["NONE - 1 1", "FIRST A1048576 1 2 True", "SMALL - 1 3",
                     "REST B1048576C16 0 3"], (out.stdout[-2000:], out.stderr[-2000:])
