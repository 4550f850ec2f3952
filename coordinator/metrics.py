"""The metrics file (`--metrics-file`): Prometheus text format, for node_exporter's textfile
collector, replaced whole (write, then rename) at every observation and at the end of a run.

Counters are the campaign's totals, read from the rows they count (the same numbers as
`coordinator status --json`), so they survive restarts; names end in `_total`, times are in
seconds. Every sample carries a `campaign` label (the database file's name), so that several
campaigns on one node can share a textfile directory.

Every series a campaign can have is in the file from the first write, at 0 until it counts
something: Prometheus cannot take `rate()` or `increase()` of a series' first appearance, and
an alert on `coordinator_tasks{state="failed"} > 0` sees no series at all, not a 0, until one.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from store.observe import CommitTimes
from store.vocabulary import Channel, QuarantineReason, TaskState, WorkerState

from .output import replace_text
from .progress import Snapshot
from .wire import RESULT_STATUSES

_R = QuarantineReason
#: What the gate can refuse on each channel: these series are written from the start.
_QUARANTINE_SERIES = {
    Channel.READY: (_R.MISSING, _R.MALFORMED, _R.STALE, _R.UNOWNED, _R.OVERSIZED),
    Channel.RESULT: (_R.MISSING, _R.MALFORMED, _R.STALE, _R.UNOWNED, _R.PAYLOAD, _R.OVERSIZED),
    Channel.STOP_ACK: (_R.STALE,),
    Channel.OTHER: (_R.FOREIGN_TAG,),
}

_HELP = {
    "coordinator_tasks": ("gauge", "Tasks by state."),
    "coordinator_results_total": ("counter", "Committed results by the executor's status."),
    "coordinator_quarantined_messages_total": (
        "counter", "Worker messages the gate refused, by channel and reason."),
    "coordinator_requeues_total": ("counter", "Protocol requeues of broken dispatches."),
    "coordinator_deferrals_total": ("counter", "Protocol deferrals of broken dispatches."),
    "coordinator_watchdog_timeouts_total": ("counter", "Dispatches retired past their deadline."),
    "coordinator_watchdog_recoveries_total": ("counter", "Parked ranks back in service."),
    "coordinator_worker_deaths_total": ("counter", "Ranks the MPI runtime reported dead."),
    "coordinator_refused_ranks_total": (
        "counter", "Ranks given no more work: most of what they sent was quarantined."),
    "coordinator_testcases_written_total": (
        "counter", "Test cases written by committed results and by runs cut short (a timeout "
                   "or the job's stop), whose test cases are kept."),
    "coordinator_testcases_dropped_total": (
        "counter", "Test cases runs produced that their workers could not send."),
    "coordinator_last_find_timestamp_seconds": (
        "gauge", "When the latest result that wrote test cases committed (Unix time)."),
    "coordinator_throughput_tasks_per_second": ("gauge", "Tasks done per second, by window."),
    "coordinator_active_ranks": ("gauge", "Worker ranks holding a dispatch."),
    "coordinator_ranks": ("gauge", "Worker ranks by state."),
    "coordinator_ranks_unable_to_run": (
        "gauge", "Worker ranks whose host ran none of the tasks of their last answers "
        "(not_run: a full disk, the target gone); their tasks go to the other ranks."),
    "coordinator_commit_duration_seconds": (
        "summary", "The master's COMMITs (with their fsync), since it started."),
    "coordinator_commit_duration_max_seconds": (
        "gauge", "The longest COMMIT since the previous write of this file."),
    "coordinator_incarnation": ("gauge", "Coordinator starts of this campaign."),
    "coordinator_incarnation_start_timestamp_seconds": (
        "gauge", "When this incarnation started (Unix time)."),
    "coordinator_running": ("gauge", "1 while the master runs; 0 in the file it leaves."),
    "coordinator_metrics_timestamp_seconds": ("gauge", "When this file was written (Unix time)."),
}


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _with_zeros(counted: dict[str, int], known) -> dict[str, int]:
    return {**{getattr(k, "value", k): 0 for k in known}, **counted}


def metrics_text(s: Snapshot, campaign: str, commits: CommitTimes | None = None,
                 commit_peak_s: float = 0.0) -> str:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name in _HELP}
    st = s.stats

    def add(name: str, value: float, **labels: str) -> None:
        samples[name.removesuffix("_count").removesuffix("_sum")
                if name.startswith("coordinator_commit_duration_seconds") else name].append(
            ({**labels, "__name__": name}, value))

    for state, n in sorted(_with_zeros(st.tasks, TaskState).items()):
        add("coordinator_tasks", n, state=state)
    for status, n in sorted(_with_zeros(s.results_by_status, RESULT_STATUSES).items()):
        add("coordinator_results_total", n, status=status)
    # Every channel, as `status --json` counts them (a STOP_ACK forged outside a stop, a
    # message on a foreign tag too).
    channels = {c.value: _with_zeros({}, reasons) for c, reasons in _QUARANTINE_SERIES.items()}
    for channel, counted in st.quarantine.items():
        channels.setdefault(channel, {}).update(counted)
    for channel in sorted(channels):
        for reason, n in sorted(channels[channel].items()):
            add("coordinator_quarantined_messages_total", n, channel=channel, reason=reason)
    add("coordinator_requeues_total", st.requeued)
    add("coordinator_deferrals_total", st.deferred)
    add("coordinator_watchdog_timeouts_total", st.watchdog_timeouts)
    add("coordinator_watchdog_recoveries_total", st.watchdog_recoveries)
    add("coordinator_worker_deaths_total", st.worker_deaths)
    add("coordinator_refused_ranks_total", st.refused_ranks)
    add("coordinator_testcases_written_total", s.found.testcases)
    add("coordinator_testcases_dropped_total", st.dropped_testcases)
    if s.found.last_at is not None:
        add("coordinator_last_find_timestamp_seconds", s.found.last_at)
    for window, rate in sorted(s.rates.items()):
        if rate is not None:
            add("coordinator_throughput_tasks_per_second", rate, window=window)
    add("coordinator_active_ranks", st.dispatches)  # (not the tasks: a batch holds many)
    for state, n in sorted(_with_zeros(s.ranks, WorkerState).items()):
        add("coordinator_ranks", n, state=state)
    add("coordinator_ranks_unable_to_run", s.unrun_ranks)
    if commits is not None:
        add("coordinator_commit_duration_seconds_count", commits.count)
        add("coordinator_commit_duration_seconds_sum", commits.total_s)
        add("coordinator_commit_duration_max_seconds", commit_peak_s)
    add("coordinator_incarnation", st.incarnation)
    if s.started_at is not None:
        add("coordinator_incarnation_start_timestamp_seconds", s.started_at)
    add("coordinator_running", 1 if s.running else 0)
    add("coordinator_metrics_timestamp_seconds", s.at)

    lines = []
    for name, got in samples.items():
        if not got:
            continue
        kind, help_text = _HELP[name]
        # The text format names a counter with its `_total` (OpenMetrics would not).
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in got:
            sample = labels.pop("__name__")
            shown = ",".join(f'{k}="{_label(v)}"' for k, v in
                             [("campaign", campaign), *sorted(labels.items())])
            lines.append(f"{sample}{{{shown}}} {_number(value)}")
    return "\n".join(lines) + "\n"


def write_metrics(path: Path, text: str) -> None:
    """Replaced whole: node_exporter reads the old file or the new one, never half of one.
    The temporary name ends in `.tmp`, which the textfile collector does not read."""
    replace_text(path, text)


_RUNNING = re.compile(r"^(coordinator_running\{[^}]*\}) 1$", re.M)


def mark_stopped(path: Path) -> bool:
    """The file of a master that was killed (it never wrote its last one): its
    `coordinator_running` set to 0, the rest as the master last wrote it (at its
    `coordinator_metrics_timestamp_seconds`). False if there was nothing to mark."""
    try:
        text = path.read_text()
    except OSError:
        return False
    new = _RUNNING.sub(r"\1 0", text)
    if new == text:
        return False
    write_metrics(path, new)
    return True
