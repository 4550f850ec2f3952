"""tools/round_cost.py with few tasks: the master alone and, with --floor, its peer of bare SQL
rows, on real SQLite files; the last line has the documented form. No timing is asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "round_cost.py"
LAST = re.compile(r"master=(\d+) floor=(\d+) ratio=(\d+\.\d\d)")


@pytest.mark.timeout(120)
def test_the_master_and_its_floor_of_bare_rows_with_a_short_last_batch():
    # 250 tasks in batches of 100 over 3 ranks: the floor's first round sends 100, 100 and 50
    done = subprocess.run([sys.executable, str(TOOL), "--tasks", "250", "--batch", "100",
                           "--sync", "NORMAL", "--repeat", "1", "--floor"],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    kinds = {"protocol": ("COMMIT", "queue read", "dispatch row", "tasks to active",
                          "work leases", "result rows", "tasks to done",
                          "dispatch and leases deleted"),
             "one state write": ("COMMIT", "queue read", "dispatch row", "result rows",
                                 "tasks to done", "dispatch deleted"),
             "result rows only": ("COMMIT", "queue read", "dispatch row", "result rows",
                                  "dispatch deleted")}
    for shape, expected in kinds.items():
        floor = next(line for line in lines
                     if line.startswith(f"synchronous=NORMAL floor, {shape}: "))
        assert re.search(r": [\d,]+ tasks/s;", floor), floor
        found = set(re.findall(r"(?:: |, )([a-zA-Z ]+?) \d+\.\d", floor))
        assert found == set(expected), (shape, floor)
    m = LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    master, rows, ratio = int(m[1]), int(m[2]), float(m[3])
    assert master > 0 and rows > 0
    assert abs(ratio - master / rows) < 0.01


@pytest.mark.timeout(120)
def test_ranks_that_hold_work_all_run_long_answer_at_the_end():
    """`--holders`: 20 more ranks each keep a dispatch unanswered until the 3 instant ranks
    have done the rest; every task still commits, and the last line has its form."""
    done = subprocess.run([sys.executable, str(TOOL), "--tasks", "200", "--sync", "NORMAL",
                           "--repeat", "1", "--holders", "0", "--holders", "20"],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    m = re.fullmatch(r"holders=0:(\d+) holders=20:(\d+) ratio=(\d+\.\d\d)", lines[-1])
    assert m, lines[-1]
    assert abs(float(m[3]) - int(m[2]) / int(m[1])) < 0.02
    assert any(line.startswith("synchronous=NORMAL, 20 holders: master CPU") for line in lines)
