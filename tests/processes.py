"""Looking at processes on this host from tests, through /proc (read by the product's own
`proc_stat`)."""

from __future__ import annotations

from coordinator.processes import proc_stat, proc_stats


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited one that nobody reaped yet: gone for
    our purposes, and in a container whose pid 1 reaps nothing it may stay one)."""
    fields = proc_stat(pid)
    return fields is not None and fields[0] != b"Z"


def in_session(sid: int) -> list[int]:
    """The processes of session `sid` but its leader."""
    return [pid for pid, fields in proc_stats() if int(fields[3]) == sid and pid != sid]
