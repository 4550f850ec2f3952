"""Time a process spent not running: the job SIGSTOPped (Slurm's `scontrol suspend`), the
VM paused, a debugger holding it, a long I/O stall.

`time.monotonic()` keeps running while a process is stopped, so a deadline that counts in it
passes during the pause, and whoever checks it on waking blames the other side for the time
it did not watch: the master retired every dispatch out at the pause (each charged an
attempt, its answer then quarantined as stale), a worker killed its command for --timeout.
A loop that normally comes round every few milliseconds notices the pause as a gap between
two of its ticks; the gap is owed to every deadline it keeps. A worker hung on its own still
passes its deadline: the master's loop kept running then, and opened no gap.

Pure logic, with the clock given. The master ticks where it looks for answers, between the
tries of a wait for the write lock, and before its watchdog sweep, and pays what is owed to
the dispatches' deadlines there, and to its stop's waits; it counts in the wall clock, as
those deadlines do (a host suspended stops the monotonic clock but not the wall clock, and a
wall clock stepped forward passes them too). A worker waiting for its command ticks at each
wake and pays it to the command's --timeout (`processes.wait_exit_unreaped`), which counts
in the monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: A gap between two ticks longer than this, less the CPU time the process used in it, was a
#: pause. Master rounds and worker polls come round in milliseconds (a poll sleeps 2 ms at
#: most), and while another process holds the campaign's write lock the master ticks after
#: each 1 s try (`store.engine.MASTER_BUSY_TIMEOUT_MS`); its one longer sleep, the wait for
#: its own stop signal, is ticked as waited. A longer round is one
#: the master spent working (a large commit, a scan of a large queue directory), whose CPU
#: time is no pause, or blocked on a stalled disk, during which it watched no deadline.
PAUSE_GAP_S = 2.0

#: The CPU clock costs ~0.7 us a read, ten times the wall clock: read at most this often on the
#: master's hot path (the CPU used in up to this long before a gap counts as used in it).
CPU_SAMPLE_S = 0.05


class LoopGaps:
    """The pauses of one loop, as ticked; what is owed accumulates until `take`n."""

    def __init__(self, gap_s: float = PAUSE_GAP_S,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.gap_s, self.clock, self.cpu_clock = gap_s, clock, cpu_clock
        self.last = clock()
        self._cpu_at, self._cpu = self.last, cpu_clock()
        self.owed = 0.0      # pauses not yet paid to the deadlines
        self.total_s = 0.0   # every pause: what a wait that keeps its own deadline is owed

    def tick(self, waited_s: float = 0.0) -> float:
        """The loop came round, having asked to wait `waited_s` since the last tick: the
        time beyond that in which the process did not run, if it was a pause; else 0."""
        now = self.clock()
        gap, self.last = now - self.last - waited_s, now
        if gap <= self.gap_s:
            if now - self._cpu_at >= CPU_SAMPLE_S:
                self._cpu_at, self._cpu = now, self.cpu_clock()
            return 0.0
        cpu = self.cpu_clock()
        gap -= cpu - self._cpu  # (it ran that long: working, not stopped)
        self._cpu_at, self._cpu = now, cpu
        if gap <= self.gap_s:
            return 0.0
        self.owed += gap
        self.total_s += gap
        return gap

    def take(self) -> float:
        """What is owed to the deadlines (after a tick), now paid."""
        owed, self.owed = self.owed, 0.0
        return owed
