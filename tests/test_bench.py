"""tools/bench.py end to end with few tasks: both farms run under the real mpiexec, the
coordinator through its python executor with the same no-op as futures, and the last line
has the documented form. No timing is asserted (figures belong in docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_tool

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
LAST = re.compile(r"coordinator=(\d+) futures=(\d+) ratio=(\d+\.\d\d)")


def bench(*args: str, timeout: float) -> list[str]:
    """The tool's output lines, once it has exited 0."""
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.strip().splitlines()


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_bench_runs_both_farms_and_prints_the_ratio():
    lines = bench("--tasks", "200", "--sync", "FULL", "--timeout", "100", timeout=220)
    assert lines[0].startswith("# 200 tasks (noop), 3 workers, ")
    coordinator = next(line for line in lines if line.startswith("coordinator synchronous="))
    # The default batches no-op python tasks (futures keeps its default chunksize 1)
    assert "futures (MPIPoolExecutor.map, chunksize=1): " in lines[1]
    assert float(re.search(r"([\d.]+) tasks per dispatch", coordinator)[1]) > 1, coordinator
    # The COMMITs' wall time, from the run's summary: a mean no longer than the longest
    mean, longest, share = re.search(
        r"; COMMIT mean ([\d.]+) ms, max ([\d.]+) ms, (\d+)% of the loop$", coordinator).groups()
    assert 0 < float(mean) <= float(longest) + 0.1 and int(share) <= 100, coordinator
    m = LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    coordinator, futures, ratio = int(m[1]), int(m[2]), float(m[3])
    assert coordinator > 0 and futures > 0
    assert abs(ratio - coordinator / futures) < 0.01


UTIL = re.compile(r"utilisation coordinator=(\d\.\d{3}) futures=(\d\.\d{3}) ratio=(\d+\.\d\d)")


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bench_batches_beside_a_hog_and_reports_what_it_ran():
    """--batch packs tasks on both sides (the coordinator's dispatches, futures' chunks) and
    --hog runs CPU-bound processes beside them, which are gone when the tool is."""
    lines = bench("--tasks", "600", "--batch", "50", "--hog", "1", "--sync", "FULL",
                  "--timeout", "120", timeout=280)
    assert lines[0].startswith("# 600 tasks (noop), 3 workers, batch 50, 1 hog(s), ")
    assert any(line.startswith("futures (MPIPoolExecutor.map, chunksize=50): ")
               for line in lines)
    coordinator = next(line for line in lines if line.startswith("coordinator synchronous="))
    # 600 tasks in dispatches of 50: 12 dispatches, each committed in one round, or in two
    # when its READY is applied in a round of its own (one task per dispatch: >= 0.33)
    commits = float(re.search(r"([\d.]+) commits per task", coordinator)[1])
    assert 0 < commits <= 2 * 12 / 600 + 1e-9, coordinator
    assert LAST.fullmatch(lines[-1]), lines[-1]
    hogs = subprocess.run(["pgrep", "-f", "range.1_000_000.: pass"], capture_output=True,
                          text=True)
    assert hogs.stdout == "", "a hog outlived the tool"


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bench_with_sleeping_tasks_reports_utilisation():
    lines = bench("--tasks", "120", "--workers", "5", "--work-ms", "20", "--sync", "FULL",
                  "--timeout", "120", timeout=280)
    assert lines[0].startswith("# 120 tasks (sleep 20 ms), 5 workers, batch the coordinator's "
                               "default, ")
    m = UTIL.fullmatch(lines[-1])
    assert m, lines[-1]
    ours, theirs, ratio = float(m[1]), float(m[2]), float(m[3])
    # 120 × 20 ms over 5 workers is 0.48 s of work: no farm does it in less
    assert 0 < ours <= 1 and 0 < theirs <= 1
    assert abs(ratio - ours / theirs) < 0.01


#: A job that aborts, as Open MPI's launcher now and then does, the first time it is run in a
#: directory (argv[1]) and leaves a file there; then prints its result.
FLAKY_JOB = """
import pathlib, sys
d = pathlib.Path(sys.argv[1])
if not (d / "ran").exists():
    (d / "ran").write_text("")
    (d / "left.db").write_text("half")
    print(sys.argv[2] + " - aborting", file=sys.stderr)
    sys.exit(1)
print("RESULT", (d / "left.db").exists())
"""


@pytest.mark.parametrize("said", ["LAUNCHER_FAILED", "LAUNCHER_ABORTED"])
def test_a_job_its_launcher_failed_or_aborted_is_run_again_on_a_fresh_directory(tmp_path, said,
                                                                                capsys):
    tool = load_tool("bench")
    cleared = []

    def fresh() -> None:
        cleared.append(True)
        (tmp_path / "left.db").unlink()

    out = tool.launch([sys.executable, "-c", FLAKY_JOB, str(tmp_path), getattr(tool, said)],
                      fresh, timeout=60)
    assert out.returncode == 0 and out.stdout == "RESULT False\n", out
    assert cleared == [True]
    assert "that run is taken again" in capsys.readouterr().err
    # A job that fails otherwise is not run again.
    other = tmp_path / "other"
    other.mkdir()
    out = tool.launch([sys.executable, "-c", FLAKY_JOB, str(other), "something else"], timeout=60)
    assert out.returncode == 1 and not out.stdout
