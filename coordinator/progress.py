"""Live progress on a terminal (rich): tasks done / queued / in flight, rate, quarantines."""

from __future__ import annotations

import time

from store.stats import Stats


class Progress:
    REFRESH_S = 0.5
    #: A refresh reads counts over whole tables (a quarter second at a million tasks): at most
    #: 1/LOAD_FACTOR of the master's time goes to it.
    LOAD_FACTOR = 20

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._live = None
        self._next = 0.0
        self._start = time.monotonic()
        self._done_at_start: int | None = None

    def start(self) -> None:
        if not self.enabled:
            return
        from rich.console import Console
        from rich.live import Live
        # Asked for explicitly: the terminal is at the far end of mpiexec's output pipe.
        self._live = Live("starting...", console=Console(stderr=True, force_terminal=True),
                          refresh_per_second=4, transient=False)
        self._live.start()

    def due(self, now: float) -> bool:
        if self._live is None or now < self._next:
            return False
        self._next = now + self.REFRESH_S
        return True

    def took(self, now: float, read_s: float) -> None:
        """The refresh's read took `read_s`: the next one waits in proportion."""
        self._next = max(self._next, now + self.LOAD_FACTOR * read_s)

    def update(self, s: Stats) -> None:
        if self._live is None:
            return
        from rich.table import Table
        done = s.tasks.get("done", 0)
        if self._done_at_start is None:
            self._done_at_start = done
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rate = (done - self._done_at_start) / elapsed
        q_result = sum(s.quarantine.get("result", {}).values())
        q_ready = sum(s.quarantine.get("ready", {}).values())
        t = Table.grid(padding=(0, 2))
        t.add_row("done", f"{done}", "queued", f"{s.tasks.get('queued', 0)}",
                  "in flight", f"{s.tasks.get('active', 0)}")
        t.add_row("deferred", f"{s.tasks.get('deferred', 0)}", "failed",
                  f"{s.tasks.get('failed', 0)}", "rate", f"{rate:,.0f} tasks/s")
        t.add_row("quarantined", f"result {q_result} / ready {q_ready}", "requeued",
                  f"{s.requeued}", "incarnation", f"{s.incarnation}")
        self._live.update(t)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
