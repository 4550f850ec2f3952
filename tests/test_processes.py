"""Process helpers (coordinator/processes.py) on real processes: the teardown of a worker's
running commands."""

from __future__ import annotations

import subprocess

from coordinator.executors import CommandExecutor


def test_a_teardown_signalled_while_the_command_starts_still_kills_it(workdir, monkeypatch):
    """The worker's teardown handler can run while Popen waits for the exec, before the new
    group is registered: it must then run once the group is known, or the command would
    escape it. Here the 'signal' arrives inside Popen; the teardown kills what is running."""
    from coordinator import executors, processes
    real_popen = subprocess.Popen
    seen: list[list[int]] = []

    def teardown() -> None:
        seen.append(sorted(processes.running_commands.groups))
        processes.kill_running_commands()

    def popen(*args, **kwargs):
        processes.teardown_when_safe(teardown)  # as the handler would, mid-spawn
        assert seen == []  # deferred: the group is not known yet
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(executors.subprocess, "Popen", popen)
    out = CommandExecutor(["sleep", "30"], timeout_s=60).run({}, b"", workdir)
    assert len(seen) == 1 and len(seen[0]) == 1  # ran once, with the new group registered
    assert (out.status, out.returncode) == ("error", -9), out.detail  # killed, not waited for
    assert processes.running_commands.groups == set() and not processes.running_commands.spawning
