"""tools/bench.py end to end with few tasks: both farms run under the real mpiexec, the
coordinator through its python executor with the same no-op as futures, and the last line
has the documented form. No timing is asserted (figures belong in docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
LAST = re.compile(r"coordinator=(\d+) futures=(\d+) ratio=(\d+\.\d\d)")


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_bench_runs_both_farms_and_prints_the_ratio():
    done = subprocess.run(
        [sys.executable, str(TOOL), "--tasks", "200", "--sync", "FULL", "--timeout", "100"],
        capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("# 200 tasks (noop), 3 workers, ")
    assert any(line.startswith("coordinator synchronous=FULL: ") for line in lines)
    m = LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    coordinator, futures, ratio = int(m[1]), int(m[2]), float(m[3])
    assert coordinator > 0 and futures > 0
    assert abs(ratio - coordinator / futures) < 0.01
