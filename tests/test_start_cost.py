"""tools/start_cost.py end to end with small campaigns: it makes them (a real run, then SQL),
times a cold start, a --resume and `status`, and prints the documented last line. No timing
is asserted (figures belong in docs/performance.md); the campaigns it grew must be ones the
coordinator resumes and runs to the end, which the tool checks by running them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "start_cost.py"
LAST = re.compile(r"cold_first_work_s=(\d+\.\d{3}) resume_first_work_s=(\d+\.\d{3}) "
                  r"status_s=(\d+\.\d{3}) rss_ratio=(\d+\.\d\d)")


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_start_cost_times_a_cold_start_a_resume_and_status(tmp_path):
    done = subprocess.run([sys.executable, str(TOOL), "--tasks", "3000", "--small", "1000",
                           "--dir", str(tmp_path)], capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("cold start, run --demo 300 (4 ranks): launch to first WORK ")
    assert any(line.startswith("3,000 done tasks (") for line in lines)
    m = LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    cold, resume, status, rss = map(float, m.groups())
    assert cold > resume > 0 and status > 0 and rss > 0
