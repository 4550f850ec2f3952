"""Throughput benchmark: N no-op tasks through this coordinator and through
mpi4py.futures.MPIPoolExecutor (map, chunksize=1: one task per message, the fair comparison
for per-task dispatch), with the same number of workers, in one invocation. Both run the same
no-op, `noop(x): return x`: the coordinator through its python executor (`--callable`) on
`--demo N` task payloads; `--workload demo` runs the demo executor instead (~35 µs of hashing
per task).

    python tools/bench.py                       # 10,000 tasks, 3 workers, FULL and NORMAL
    python tools/bench.py --tasks 2000 --workers 3 --sync FULL

Prints tasks/s for each, their ratio, database commits per task and the master's peak memory;
the last line reads `coordinator=<tasks/s> futures=<tasks/s> ratio=<coordinator/futures>`
(the coordinator at the first --sync mode given, FULL by default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.launcher import LAUNCHER_FAILED, find_mpiexec, mpiexec_flags  # noqa: E402

FUTURES_CHILD = """
import sys, time, resource
from mpi4py.futures import MPIPoolExecutor

def noop(x):
    return x

if __name__ == "__main__":
    n = int(sys.argv[1])
    with MPIPoolExecutor() as ex:
        list(ex.map(noop, range(min(200, n)), chunksize=1))  # spawn and warm the workers
        t = time.perf_counter()
        list(ex.map(noop, range(n), chunksize=1))
        el = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"FUTURES {n / el:.1f} {rss:.1f}")
"""


def launch(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if LAUNCHER_FAILED in out.stderr:
        out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    return out


def run_futures(mpiexec: str, tasks: int, workers: int, timeout: float,
                ulfm: bool) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "futures_noop.py"
        script.write_text(FUTURES_CHILD)
        cmd = [mpiexec, *mpiexec_flags(mpiexec, workers + 1, ulfm), sys.executable, "-m",
               "mpi4py.futures", str(script), str(tasks)]
        out = launch(cmd, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("FUTURES "):
            _, rate, rss = line.split()
            return float(rate), float(rss)
    raise SystemExit(f"futures run failed:\n{out.stdout}\n{out.stderr[-3000:]}")


NOOP_MODULE = "def noop(x):\n    return x\n"


def run_coordinator(mpiexec: str, tasks: int, workers: int, sync: str,
                    timeout: float, ulfm: bool, workload: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        db, summary = Path(d) / "bench.db", Path(d) / "summary.json"
        cmd = [mpiexec, *mpiexec_flags(mpiexec, workers + 1, ulfm), sys.executable, "-m",
               "coordinator", "run", "--db", str(db), "--demo", str(tasks), "--synchronous",
               sync, "--no-progress", "--summary-json", str(summary)]
        env = dict(os.environ)
        if workload == "noop":
            (Path(d) / "bench_noop.py").write_text(NOOP_MODULE)
            # Every rank runs here, so the environment reaches them all (no `-x` needed).
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (d, env.get("PYTHONPATH")) if p)
            cmd += ["--callable", "bench_noop:noop"]
        out = launch(cmd, timeout=timeout, env=env)
        if out.returncode != 0 or not summary.exists():
            raise SystemExit(f"coordinator run failed ({out.returncode}):\n{out.stderr[-3000:]}")
        return json.loads(summary.read_text())


def _runtime_name(version: str) -> str:
    """`mpiexec --version`'s first line, or MPICH's version (Hydra's first line names none)."""
    lines = version.splitlines()
    if lines[0].startswith("HYDRA"):
        for line in lines:
            if line.strip().startswith("Version:"):
                return f"mpiexec (MPICH Hydra) {line.split(':', 1)[1].strip()}"
    return lines[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=10_000, help="tasks per run (default 10,000)")
    p.add_argument("--workers", type=int, default=3, help="worker ranks (default 3)")
    p.add_argument("--sync", action="append", choices=("FULL", "NORMAL"),
                   help="synchronous modes to measure (repeatable; default FULL and NORMAL)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each; the median is kept")
    p.add_argument("--workload", choices=("noop", "demo"), default="noop",
                   help="the coordinator's task: the same no-op as futures through the python "
                        "executor (default), or the built-in demo executor")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds each MPI job may take before it counts as hung (default 900)")
    p.add_argument("--ulfm", action=argparse.BooleanOptionalAction, default=True,
                   help="launch both with Open MPI's --with-ft ulfm, as `coordinator run` "
                        "does when it launches itself (default on; ignored for other MPIs)")
    args = p.parse_args()
    modes = args.sync or ["FULL", "NORMAL"]
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise SystemExit("no mpiexec beside this Python or on PATH")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    print(f"# {args.tasks} tasks ({args.workload}), {args.workers} workers, "
          f"{_runtime_name(version) if version else mpiexec}"
          f"{' with --with-ft ulfm' if args.ulfm and 'Open MPI' in version else ''}, "
          f"{time.strftime('%Y-%m-%d')}")

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    fut = [run_futures(mpiexec, args.tasks, args.workers, args.timeout, args.ulfm)
           for _ in range(args.repeat)]
    fut_rate = median([r for r, _ in fut])
    print(f"futures (MPIPoolExecutor.map, chunksize=1): {fut_rate:,.0f} tasks/s, "
          f"client peak RSS {median([m for _, m in fut]):.0f} MiB")
    first = None
    for sync in modes:
        runs = [run_coordinator(mpiexec, args.tasks, args.workers, sync, args.timeout, args.ulfm,
                                args.workload)
                for _ in range(args.repeat)]
        run = sorted(runs, key=lambda r: r["tasks_per_s"])[len(runs) // 2]
        rate = run["tasks_per_s"]
        first = first if first is not None else rate
        print(f"coordinator synchronous={sync}: {rate:,.0f} tasks/s "
              f"(ratio {rate / fut_rate:.2f}), {run['commits_per_task']:.2f} commits per task, "
              f"{run['rounds'] / max(run['committed_this_run'], 1):.2f} rounds per task, "
              f"master peak RSS {run['master_peak_rss_mib']:.0f} MiB")
    print(f"coordinator={first:.0f} futures={fut_rate:.0f} ratio={first / fut_rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
