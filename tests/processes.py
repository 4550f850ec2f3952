"""Looking at processes on this host from tests, through /proc."""

from __future__ import annotations

import os


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited one that nobody reaped yet: gone for
    our purposes, and in a container whose pid 1 reaps nothing it may stay one)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def in_session(sid: int) -> list[int]:
    """The processes of session `sid` but its leader."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == sid:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2:].split()[3]) == sid:
            found.append(int(entry))
    return found
