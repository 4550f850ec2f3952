"""Polling without MPI traffic: the timer slack that decides how long a backoff sleep lasts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SLACK = Path("/proc/self/timerslack_ns")


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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = map(int, out.stdout.split())
    assert (before, after) == (77_777, 1_000)
