"""Throughput benchmark: N tasks through this coordinator and through
mpi4py.futures.MPIPoolExecutor (`map`), with the same number of workers, in one invocation.

Both sides run the same task: a no-op (`noop(x): return x`) by default, or `--work-ms W`, a
task that sleeps W ms. The coordinator runs it through its python executor (`--callable`) on
`--demo N` task payloads; `--workload demo` runs the demo executor instead (~35 µs of hashing
per task). Without `--batch` each side runs its default: the coordinator batches python
tasks automatically, futures sends one task per message (`chunksize=1`); `--batch K` packs K
tasks in each dispatch on both sides (the coordinator's `--batch K` against futures'
`chunksize=K`; `--batch 1`: one task per message on both). Both are timed from the first task
sent to the last result in. `--hog N` runs N
CPU-bound processes beside both sides for the whole run, as on a node shared with other jobs.

    python tools/bench.py                                   # 10,000 no-ops, FULL and NORMAL
    python tools/bench.py --batch 1 --sync FULL             # one task per dispatch
    python tools/bench.py --hog 1 --sync FULL               # on a busy node
    python tools/bench.py --batch 100 --tasks 100000 --sync FULL
    python tools/bench.py --workers 63 --work-ms 50 --tasks 5000 --sync FULL

Prints tasks/s for each, their ratio, database commits per task, the master's CPU time per
task, peak memory and the coordinator's COMMITs' wall time (mean, longest, share of its
loop: the disk's fsync, which the master waits for at FULL). The last line reads
`coordinator=<tasks/s> futures=<tasks/s> ratio=<coordinator/futures>` (the coordinator at
the first --sync mode given, FULL by default); with --work-ms it reads `utilisation
coordinator=<u> futures=<u> ratio=<x>`, where utilisation = tasks × W / (workers ×
makespan): the share of the workers' time spent in tasks (nominal task time on both sides,
so a sleep's overshoot counts against both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.config import batch_size  # noqa: E402
from coordinator.launcher import LAUNCHER_FAILED, find_mpiexec, mpiexec_flags  # noqa: E402

#: The task both sides run; BENCH_WORK_S > 0 makes it sleep that long.
TASK_MODULE = """
import os, time
WORK_S = float(os.environ.get("BENCH_WORK_S", "0"))

def task(x):
    if WORK_S:
        time.sleep(WORK_S)
    return x
"""

FUTURES_CHILD = """
import resource, sys, time
from mpi4py.futures import MPIPoolExecutor
from bench_task import task

def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime

if __name__ == "__main__":
    n, chunk = int(sys.argv[1]), int(sys.argv[2])
    with MPIPoolExecutor() as ex:
        list(ex.map(int, range(min(200, n)), chunksize=1))  # spawn and warm the workers
        t, c = time.perf_counter(), cpu()
        list(ex.map(task, range(n), chunksize=chunk))
        el, used = time.perf_counter() - t, cpu() - c
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"FUTURES {n / el:.1f} {el:.4f} {used:.4f} {rss:.1f}")
"""


@dataclass
class Side:
    rate: float         # tasks/s
    makespan: float     # seconds from the first task sent to the last answer handled
    master_cpu: float   # seconds of CPU in the master (futures: the client) during that
    rss: float          # MiB
    extra: dict


#: Open MPI's launcher, on a loaded machine, now and then ends a job saying this before any
#: rank has printed a result (twice in a few hundred runs here, futures' side both times).
LAUNCHER_ABORTED = "prterun: SIGPIPE detected"


def launch(cmd: list[str], fresh: Callable[[], None] = lambda: None,
           **kw) -> subprocess.CompletedProcess:
    """Run a side's job; a job its launcher failed to start, or aborted, is run once more
    (after `fresh()` removes what the first one left), saying so on stderr."""
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    why = next((m for m in (LAUNCHER_FAILED, LAUNCHER_ABORTED) if m in out.stderr), None)
    if why is not None:
        print(f"# the launcher said {why!r}: that run is taken again", file=sys.stderr,
              flush=True)
        fresh()
        out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    return out


def task_env(d: Path, work_s: float) -> dict[str, str]:
    (d / "bench_task.py").write_text(TASK_MODULE)
    env = dict(os.environ)
    # Every rank runs on this host, so the environment reaches them all (no `-x` needed).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(d), env.get("PYTHONPATH")) if p)
    env["BENCH_WORK_S"] = repr(work_s)
    return env


def run_futures(mpiexec: str, a: argparse.Namespace) -> Side:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "futures_bench.py"
        script.write_text(FUTURES_CHILD)
        cmd = [mpiexec, *mpiexec_flags(mpiexec, a.workers + 1, a.ulfm), sys.executable, "-m",
               "mpi4py.futures", str(script), str(a.tasks), str(chunksize(a))]
        out = launch(cmd, timeout=a.timeout, env=task_env(Path(d), a.work_ms / 1000))
    for line in out.stdout.splitlines():
        if line.startswith("FUTURES "):
            rate, el, used, rss = map(float, line.split()[1:])
            return Side(rate, el, used, rss, {})
    raise SystemExit(f"futures run failed:\n{out.stdout}\n{out.stderr[-3000:]}")


def run_coordinator(mpiexec: str, a: argparse.Namespace, sync: str) -> Side:
    with tempfile.TemporaryDirectory() as d:
        db, summary = Path(d) / "bench.db", Path(d) / "summary.json"
        cmd = [mpiexec, *mpiexec_flags(mpiexec, a.workers + 1, a.ulfm), sys.executable, "-m",
               "coordinator", "run", "--db", str(db), "--demo", str(a.tasks), "--synchronous",
               sync, "--no-progress", "--summary-json", str(summary)]
        if a.batch is not None:
            cmd += ["--batch", str(a.batch)]
        if a.work_ms:
            cmd += ["--worker-spin-ms", "0"]  # sleeping tasks: workers that do not spin
        if a.workload == "noop":
            cmd += ["--callable", "bench_task:task"]

        def fresh() -> None:
            for f in Path(d).iterdir():
                if f.name.startswith((db.name, summary.name)):
                    f.unlink()

        out = launch(cmd, fresh, timeout=a.timeout, env=task_env(Path(d), a.work_ms / 1000))
        if out.returncode != 0 or not summary.exists():
            raise SystemExit(f"coordinator run failed ({out.returncode}):\n{out.stderr[-3000:]}")
        s = json.loads(summary.read_text())
    # Timed as futures' map is: from the first task sent to the last result in, leaving out
    # the ranks' start (futures warms its pool first) and the stop after the last commit.
    makespan = s["last_commit_at"] - s["first_work_at"]
    return Side(a.tasks / makespan, makespan, s["loop_cpu_s"], s["master_peak_rss_mib"], s)


#: A CPU-bound loop that ends once its parent is gone: a benchmark killed by a signal (no
#: `finally`) must not leave it burning a core under the next measurement.
HOG = ("import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n"
       "    for _ in range(1_000_000): pass\n")


@contextlib.contextmanager
def hogs(n: int) -> Iterator[None]:
    """N CPU-bound processes for the duration: a node shared with someone else's work."""
    procs = [subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())])
             for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _runtime_name(version: str) -> str:
    """`mpiexec --version`'s first line, or MPICH's version (Hydra's first line names none)."""
    lines = version.splitlines()
    if lines[0].startswith("HYDRA"):
        for line in lines:
            if line.strip().startswith("Version:"):
                return f"mpiexec (MPICH Hydra) {line.split(':', 1)[1].strip()}"
    return lines[0]


def commit_text(s: dict) -> str:
    """The COMMITs' wall time from a run's summary: a slow disk (a slow fsync at FULL) makes
    the master wait without using CPU, and shows here."""
    n = max(s["commits"], 1)
    return (f"mean {s['commit_s'] / n * 1e3:.2f} ms, max {s['commit_max_s'] * 1e3:.1f} ms, "
            f"{s['commit_s'] / max(s['loop_s'], 1e-9):.0%} of the loop")


def chunksize(a: argparse.Namespace) -> int:
    """futures' chunksize: --batch N, else its default (1) against the coordinator's own."""
    return a.batch if isinstance(a.batch, int) else 1


def median(sides: list[Side]) -> Side:
    return sorted(sides, key=lambda s: s.rate)[len(sides) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=10_000, help="tasks per run (default 10,000)")
    p.add_argument("--workers", type=int, default=3, help="worker ranks (default 3)")
    p.add_argument("--sync", action="append", choices=("FULL", "NORMAL"),
                   help="synchronous modes to measure (repeatable; default FULL and NORMAL)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each; the median is kept")
    p.add_argument("--batch", type=batch_size, default=None, metavar="N|auto",
                   help="tasks per dispatch: the coordinator's --batch N against futures' "
                        "chunksize N; `auto`, or by default the coordinator's default (auto "
                        "batches for python tasks), against futures' default chunksize 1")
    p.add_argument("--hog", type=int, default=0,
                   help="CPU-bound processes run beside both sides (default 0)")
    p.add_argument("--work-ms", type=float, default=0.0,
                   help="each task sleeps this long (default 0: a no-op); prints utilisation")
    p.add_argument("--workload", choices=("noop", "demo"), default="noop",
                   help="the coordinator's task: the same task as futures through the python "
                        "executor (default), or the built-in demo executor")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds each MPI job may take before it counts as hung (default 900)")
    p.add_argument("--ulfm", action=argparse.BooleanOptionalAction, default=True,
                   help="launch both with Open MPI's --with-ft ulfm, as `coordinator run` "
                        "does when it launches itself (default on; ignored for other MPIs)")
    a = p.parse_args()
    if (chunksize(a) < 1 or a.hog < 0 or a.work_ms < 0 or a.tasks < 1
            or a.workers < 1):
        p.error("--batch, --tasks and --workers must be positive; --hog and --work-ms not "
                "negative")
    modes = a.sync or ["FULL", "NORMAL"]
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise SystemExit("no mpiexec beside this Python or on PATH")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    task = f"sleep {a.work_ms:g} ms" if a.work_ms else a.workload
    batch = {None: "the coordinator's default", "auto": "auto"}.get(a.batch, a.batch)
    print(f"# {a.tasks} tasks ({task}), {a.workers} workers, batch {batch}, "
          f"{a.hog} hog(s), {os.cpu_count()} cores, "
          f"{_runtime_name(version) if version else mpiexec}"
          f"{' with --with-ft ulfm' if a.ulfm and 'Open MPI' in version else ''}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)

    def util(s: Side) -> float:
        return a.tasks * a.work_ms / 1000 / (a.workers * s.makespan)

    with hogs(a.hog):
        fut = median([run_futures(mpiexec, a) for _ in range(a.repeat)])
        print(f"futures (MPIPoolExecutor.map, chunksize={chunksize(a)}): {fut.rate:,.0f} tasks/s, "
              f"client CPU {fut.master_cpu / a.tasks * 1e6:.0f} µs per task, "
              f"peak RSS {fut.rss:.0f} MiB"
              + (f", utilisation {util(fut):.3f}" if a.work_ms else ""), flush=True)
        first: Side | None = None
        for sync in modes:
            run = median([run_coordinator(mpiexec, a, sync) for _ in range(a.repeat)])
            first = first or run
            s = run.extra
            print(f"coordinator synchronous={sync}: {run.rate:,.0f} tasks/s "
                  f"(ratio {run.rate / fut.rate:.2f}), {s['commits_per_task']:.3f} commits "
                  f"per task, {s['rounds'] / max(s['committed_this_run'], 1):.3f} rounds per "
                  f"task, {s['committed_this_run'] / max(s['dispatches'], 1):.1f} tasks per "
                  f"dispatch, master CPU {run.master_cpu / a.tasks * 1e6:.0f} µs per task, "
                  f"peak RSS {run.rss:.0f} MiB"
                  + (f", utilisation {util(run):.3f}" if a.work_ms else "")
                  + f"; COMMIT {commit_text(s)}", flush=True)
    assert first is not None
    if a.work_ms:
        print(f"utilisation coordinator={util(first):.3f} futures={util(fut):.3f} "
              f"ratio={util(first) / util(fut):.2f}")
    else:
        print(f"coordinator={first.rate:.0f} futures={fut.rate:.0f} "
              f"ratio={first.rate / fut.rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
