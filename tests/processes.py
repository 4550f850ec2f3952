"""Looking at processes on this host from tests, through /proc."""

from __future__ import annotations


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited one that nobody reaped yet: gone for
    our purposes, and in a container whose pid 1 reaps nothing it may stay one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False
