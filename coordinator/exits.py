"""The exit statuses of `coordinator` commands: one enum for the CLI, the docs and the tests.

`coordinator run` under a self-launch reports the master's own status, whatever `mpiexec`
says (under ULFM `mpiexec` often exits 0 whatever happened). A run ended by a signal before
its master started exits 128 + the signal's number, as a shell reports it.
"""

from __future__ import annotations

import enum


class ExitStatus(enum.IntEnum):
    #: Finished, or stopped cleanly (work may be left for `--resume`: the last line says so).
    OK = 0
    #: A self-launched run whose `mpiexec` failed before the master started, whose master had
    #: not started within `--start-timeout`, or whose master was killed without a status.
    #: `coordinator check`: the campaign has violations.
    FAILED = 1
    #: Refused, nothing changed: a bad flag, variable, file or database. Also a damaged
    #: campaign file met by a round: the run ends without another write to it, and a
    #: `--resume` would only meet the page again (`store.errors.DamagedDatabaseError`).
    USAGE = 2
    #: The storage failed under the run (disk full, I/O error, the campaign file removed or
    #: replaced): continue with `--resume`.
    STORE = 3
    #: The run finished on its own, but a rank never acknowledged STOP and was ended.
    UNACKED = 4
    #: A bug: the traceback is printed; the campaign is saved, continue with `--resume`.
    INTERNAL = 5
    #: Every worker died while work was left: saved, continue with `--resume`.
    NO_WORKERS = 6
    #: No live rank could take work (every one parked past the watchdog) for `--stall-grace`:
    #: the hung ranks were ended, the campaign is saved, continue with `--resume`.
    STALLED = 7


def signalled(signum: int) -> int:
    """The status a shell reports for a process ended by `signum`."""
    return 128 + signum
