"""One process of the job: rank 0 becomes the master, every other rank a worker.

The master's side is imported only on rank 0: a worker rank never loads the store or
SQLAlchemy (tests/test_layout.py holds that).
"""

from __future__ import annotations

import sys

from .config import RunConfig
from .exits import ExitStatus
from .processes import leave_if_threads_linger
from .transport import Transport
from .worker_rank import run_worker_rank


def run(cfg: RunConfig) -> int:
    transport = Transport()
    if transport.size < 2:
        print("coordinator: needs at least 2 ranks (1 master + workers); start it with "
              "`mpiexec -n N` or let `coordinator run` launch itself (--np N)",
              file=sys.stderr)
        return ExitStatus.USAGE
    if transport.rank == 0:
        from .master_rank import run_master_rank
        return run_master_rank(cfg, transport)
    status = run_worker_rank(cfg, transport)
    # A thread a task's callable left running would hold the interpreter's exit, and with it
    # this rank's MPI_Finalize, which the master's waits on: a thread sleeping 40 s held the
    # whole run's end 40 s. So MPI_Finalize now, and then no wait for such a thread.
    transport.finalize()
    leave_if_threads_linger(status)
    return status
