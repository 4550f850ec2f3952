"""A campaign under the user's own `mpiexec`, with stderr to a file as in a batch job: plain
progress lines at the interval, no escape codes, the same figures as `status --json`; the
metrics file's counters equal to it too."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import mpi_jobs
import pytest
from mpi_jobs import Job, check_conservation, finish, job_command, status_json, wait_for
from prometheus_client.parser import text_string_to_metric_families

from coordinator.launcher import LAUNCHER_FAILED

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

LINE = re.compile(r"^coordinator: progress (.*)$", re.MULTILINE)


def _fields(line: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in line.split())


def _lines(path) -> list[dict[str, str]]:
    """The progress lines written whole so far (the job may be in the middle of one)."""
    text = path.read_text(errors="replace")
    return [_fields(m) for m in LINE.findall(text[:text.rfind("\n") + 1])]


def _start(args: list[str], err_path) -> Job:
    with open(err_path, "w") as err:  # the job keeps its own descriptor
        job = Job(job_command(args), stdout=subprocess.PIPE, stderr=err, text=True,
                  env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    mpi_jobs._started.append(job)  # ended after the test, whatever happens
    return job


def test_batch_progress_lines_are_plain_at_the_interval_and_agree_with_status(tmp_path):
    db, err, prom = tmp_path / "c.db", tmp_path / "stderr.txt", tmp_path / "c.prom"
    args = ["run", "--db", str(db), "--demo", "4000", "--demo-work-ms", "5",
            "--progress-interval", "1", "--metrics-file", str(prom)]
    job = _start(args, err)
    wait_for(db, "SELECT count(*) FROM results", lambda n: n is not None and n > 200)
    if LAUNCHER_FAILED in err.read_text():  # nothing ran: one more launch
        job = _start(args, err)
    # While it runs, `status --json` sits between the lines of before and after it. (Told
    # apart by their `elapsed`, not by when they reach the file: mpiexec forwards a rank's
    # stderr with a delay of its own.)
    live = status_json(db)
    assert live["master"]["running"] is True
    at = live["incarnation_run_s"]
    if importlib.util.find_spec("matplotlib") is not None:  # the [plot] extra
        # `plot` reads a live campaign without blocking it, and draws what is in flight.
        shown = subprocess.run([sys.executable, "-m", "coordinator", "plot", "--db", str(db),
                                str(tmp_path / "charts")], capture_output=True, text=True,
                               timeout=120, check=False)
        assert shown.returncode == 0, shown.stderr
        assert "a master was running" in (tmp_path / "charts" / "index.html").read_text()
    done = finish(job, timeout=240)
    lines = _lines(err)
    older = [int(x["done"]) for x in lines if _seconds(x["elapsed"]) <= at - 1]
    newer = [int(x["done"]) for x in lines if _seconds(x["elapsed"]) >= at + 1]
    assert newer, (at, lines)
    assert max(older, default=0) <= live["tasks"]["done"] <= min(newer)

    assert done.returncode == 0, err.read_text()[-3000:]
    check_conservation(db, expected_tasks=4000)
    text = err.read_text()
    assert "\x1b" not in text  # no escape codes in a file
    lines = _lines(err)
    assert len(lines) >= 3, text[-3000:]
    # A line per interval at most (plus the last, at the end), not one per round.
    elapsed = [_seconds(line["elapsed"]) for line in lines]
    assert len(lines) <= elapsed[-1] / 1.0 + 2
    assert [int(x["done"]) for x in lines] == sorted(int(x["done"]) for x in lines)
    # The last line is the end of the run: exactly what status says now.
    s = status_json(db)
    last = lines[-1]
    assert {k: int(last[k]) for k in ("done", "queued", "active", "deferred", "failed")} == \
        s["tasks"]
    assert int(last["testcases"]) == s["testcases"]["written"]
    assert int(last["quarantined"]) == s["quarantined"]
    assert int(last["parked"]) == s["parked_ranks"]
    assert last["eta"] == "0s" and s["eta_s"] == 0
    # The stats file: the six labels first, the other channels' line, then the same fields.
    stats = db.with_name("c.db.stats").read_text().splitlines()
    assert stats[0].startswith("Quarantined worker results: ")
    assert stats[6] == "Quarantined other messages: 0"
    assert stats[8] == "Tasks: 4000 done, 0 queued, 0 active, 0 deferred, 0 failed"
    # The metrics file parses, and its counters are status's.
    families = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
    samples = {(x.name, tuple(sorted((k, v) for k, v in x.labels.items() if k != "campaign"))):
               x.value for f in families.values() for x in f.samples}
    assert samples[("coordinator_results_total", (("status", "ok"),))] == s["results"] == 4000
    for state, n in s["tasks"].items():
        assert samples[("coordinator_tasks", (("state", state),))] == n
    assert samples[("coordinator_requeues_total", ())] == s["requeued"]
    assert samples[("coordinator_watchdog_timeouts_total", ())] == s["watchdog_timeouts"]
    assert samples[("coordinator_worker_deaths_total", ())] == s["worker_deaths"]
    assert samples[("coordinator_testcases_written_total", ())] == s["testcases"]["written"]
    assert samples[("coordinator_running", ())] == 0
    # The ranks' busy fractions were sampled and recorded.
    assert [r["rank"] for r in s["ranks"]] == [1, 2, 3]
    assert all(r["busy"] is not None and 0 < r["busy"] <= 1 for r in s["ranks"])


def _seconds(text: str) -> float:
    total = 0.0
    for n, unit in re.findall(r"(\d+)([dhms])", text):
        total += int(n) * {"d": 86400, "h": 3600, "m": 60, "s": 1}[unit]
    return total
