"""`coordinator plot --db PATH OUTDIR`: charts of a campaign's history, like `afl-plot`: PNG
files and an `index.html` that shows them, from the timestamps the database holds.

Read-only (a finished campaign, a copy, or a live one, which it never blocks); the history is
aggregated in SQL (`store.observe.plot_series`), so a million tasks take seconds, and the tasks
chart follows the master's own records (`observations`) where there are any. matplotlib
is an optional extra: `pip install -e '.[plot]'`.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import itertools
import math
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from store.engine import read_file
from store.errors import StoreError
from store.lock import lock_holder
from store.observe import Counted, PlotSeries, plot_series, read_counted
from store.revisions import check_campaign
from store.stats import Stats, read_stats
from store.versioning import upgrade

from .exits import ExitStatus
from .progress import duration

#: (file, title, what it shows), in the order index.html shows them.
CHARTS = (
    ("tasks.png", "Tasks over time",
     ("Tasks done, and not done (queued, in flight or held), as the master recorded them "
      "(every 10 s while it ran, straight lines between); between runs, a run's last "
      "figures until the next run's first. Where it recorded none (a campaign run before "
      "revision 0010, a master killed since its last record), from the results committed "
      "and tasks created, which lack the results a requeue discarded.")),
    ("throughput.png", "Throughput",
     ("Results committed per minute, averaged over each bucket; results that are not ok "
      "apart. Results a requeue discarded are not counted.")),
    ("testcases.png", "Test cases over time",
     ("Test cases written by committed results and by runs cut short (a timeout or the "
      "job's stop: retried, their test cases kept), in all and per bucket; not those of "
      "results a requeue discarded.")),
    ("ranks.png", "Rank utilisation",
     ("The share of each bucket each worker rank held a dispatch (committed ones, and what "
      "is in flight on a live campaign; dispatches rolled back are not counted).")),
    ("events.png", "Faults over time",
     ("Quarantined messages, protocol requeues and deferrals, watchdog timeouts and "
      "recoveries, worker deaths and tasks held as failed, per bucket.")),
)

INSTALL_HINT = ("coordinator plot needs matplotlib: install the plot extra, e.g. "
                "`pip install -e '.[plot]'` in the project, or `pip install matplotlib`")

_EVENT_LABELS = {
    "quarantine/result": "quarantined RESULTs", "quarantine/ready": "quarantined READYs",
    "quarantine/stop_ack": "quarantined STOP_ACKs", "quarantine/other": "other messages",
    "interrupted": "dispatches a master's crash interrupted",
    "requeued": "protocol requeues", "deferred": "protocol deferrals",
    "watchdog": "watchdog timeouts", "worker_recovered": "watchdog recoveries",
    "worker_failed": "worker deaths", "failed": "tasks held as failed",
    "task_failed": "runs that failed (timeout, not run)",
}


def plot(db: Path, outdir: Path) -> int:
    try:
        import matplotlib
    except ImportError:
        print(f"coordinator: {INSTALL_HINT}", file=sys.stderr)
        return ExitStatus.USAGE
    matplotlib.use("Agg")  # files only: no display, whatever the environment says
    began = time.monotonic()
    running = lock_holder(db) is not None if db.exists() else False

    def read(conn):
        check_campaign(conn, db)
        return read_plot(conn, time.time() if running else None)
    try:
        # An older revision is read from a copy upgraded in TMPDIR: a post-mortem needs no
        # write to the evidence (as `status`).
        (series, counts, stats), view = read_file(db, read, upgrade=upgrade)
    except StoreError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    read_s = time.monotonic() - began
    if view.upgraded_from is not None:  # the file's own revision, not its copy's
        stats = dataclasses.replace(stats, schema_revision=view.upgraded_from)
    try:
        outdir.mkdir(parents=True, exist_ok=True)
        tasks = functools.partial(_tasks, counts=counts)
        for (name, title, _), draw in zip(CHARTS, (tasks, _throughput, _testcases, _ranks,
                                                    _events), strict=True):
            _render(outdir / name, title, series, draw)
        (outdir / "index.html").write_text(_index(db, series, stats, running))
    except OSError as e:
        # The OUTDIR given cannot be used (read-only, full, a file): a refusal, as for any
        # path a command is given; the campaign was only read (exit 3 is the run's storage).
        print(f"coordinator: cannot write the charts to {outdir}: {e.strerror or e} (the "
              f"campaign was only read; choose an OUTDIR that can be written)", file=sys.stderr)
        return ExitStatus.USAGE
    if view.note():
        print(f"note: {view.note()}", file=sys.stderr)
    print(f"{outdir / 'index.html'}: {len(CHARTS)} charts of {db} ({series.n} buckets of "
          f"{duration(series.width)}; read in {read_s:.1f} s, drawn in "
          f"{time.monotonic() - began - read_s:.1f} s)")
    return 0


def read_plot(conn, now: float | None) -> tuple[PlotSeries, list[Counted], Stats]:
    """What the charts are drawn from, in one read transaction: the history aggregated from
    the rows, the master's records of the tasks' counts (and, on a live campaign, the counts
    `now`), and the campaign's figures."""
    stats = read_stats(conn)
    counts = read_counted(conn)
    if now is not None:
        t = stats.tasks
        counts.append(Counted(now, stats.incarnation, t.get("done", 0),
                              sum(t.get(k, 0) for k in ("queued", "active", "deferred",
                                                        "failed"))))
    return plot_series(conn, now), counts, stats


def task_lines(s: PlotSeries, counts: Sequence[Counted]
               ) -> tuple[list[float], list[float], list[float]]:
    """The tasks chart's lines, (times, done, not done) with times in Unix seconds.

    The master's records where there are any, straight lines between those of a run: the
    rows cannot say what a requeue discarded (`requeue --rank`, `--since` and `--state
    error` delete results: a run's done tasks were drawn as only those whose results a later
    requeue left). Where there
    are none (before the first, a campaign from before they existed; after a run's last,
    a master killed before its next one, or the span's end) the last figures go on with the
    results committed and tasks created in the buckets after the one they were recorded in;
    the next record, a run's start, is drawn where it was taken (a vertical step, when a
    requeue changed the figures between two runs)."""
    results = [0, *_cumulative(s.done)]    # at each bucket boundary
    created = [0, *_cumulative(s.created)]
    times: list[float] = []
    done: list[float] = []
    not_done: list[float] = []

    def point(at: float, d: float, nd: float) -> None:
        times.append(at)
        done.append(d)
        not_done.append(nd)

    def from_rows(since: float, d0: float, nd0: float, until: float) -> None:
        """(since, until], with no record: d0 and nd0 at `since`, and the rows after it."""
        a = max(0, min(s.n, math.ceil((since - s.t0) / s.width)))

        def counted(k: int) -> tuple[float, float]:
            r, c = results[k] - results[a], created[k] - created[a]
            return d0 + r, nd0 + c - r

        for k in range(a, s.n + 1):
            if since < s.at(k) < until:
                point(s.at(k), *counted(k))
        point(until, *counted(max(a, min(s.n, math.floor((until - s.t0) / s.width)))))

    point(s.t0, 0, 0)
    last = Counted(s.t0, 0, 0, 0)
    for _, run in itertools.groupby(counts, key=lambda c: c.incarnation):
        records = list(run)
        from_rows(last.at, last.done, last.not_done, records[0].at)
        for c in records:
            point(c.at, c.done, c.not_done)
        last = records[-1]
    from_rows(last.at, last.done, last.not_done, max(last.at, s.at(s.n)))
    return times, done, not_done


def _dates(times: Sequence[float]):
    """Unix times as matplotlib dates (UTC)."""
    import matplotlib.dates as mdates
    return [mdates.date2num(datetime.fromtimestamp(t, timezone.utc)) for t in times]


def _times(s: PlotSeries, centre: bool = True):
    """Each bucket's time as matplotlib dates (UTC)."""
    import matplotlib.dates as mdates
    off = 0.5 if centre else 1.0
    return [mdates.date2num(datetime.fromtimestamp(s.at(i) + off * s.width, timezone.utc))
            for i in range(s.n)]


#: The faults chart's panels: what each shows, of `PlotSeries.events`.
_EVENT_PANELS = (
    ("quarantined", ("quarantine/result", "quarantine/ready", "quarantine/stop_ack",
                     "quarantine/other")),
    ("retries", ("requeued", "deferred", "failed", "task_failed", "interrupted")),
    ("ranks", ("watchdog", "worker_recovered", "worker_failed")),
)


def _render(path: Path, title: str, s: PlotSeries, draw) -> None:
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    if draw is _events:
        height, panels = 6.5, len(_EVENT_PANELS)
    elif draw is _ranks:
        height, panels = max(3.0, 1.6 + 0.14 * len(s.busy)), 1
    else:
        height, panels = 4.0, 1
    fig, axes = plt.subplots(panels, 1, figsize=(10, height), dpi=100, sharex=True,
                             squeeze=False)
    axes = [row[0] for row in axes]
    try:
        draw(axes if draw is _events else axes[0], s)
        axes[0].set_title(title)
        axes[-1].set_xlabel(f"time (UTC); buckets of {duration(s.width)}")
        for ax in axes:
            loc = mdates.AutoDateLocator()
            ax.xaxis.set_major_locator(loc)
            ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc, tz=timezone.utc))
            # The campaign's span, also for a chart with nothing to draw (matplotlib's
            # default then spans years).
            ax.set_xlim(*(mdates.date2num(datetime.fromtimestamp(t, timezone.utc))
                          for t in (s.t0, s.at(s.n))))
            for inc, at in s.incarnations:
                x = mdates.date2num(datetime.fromtimestamp(at, timezone.utc))
                ax.axvline(x, color="grey", linestyle=":", linewidth=1)
                if ax is axes[0]:
                    ax.annotate(f" start {inc}", (x, 0), xycoords=("data", "axes fraction"),
                                fontsize=7, color="grey", ha="left", va="bottom", rotation=90)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _cumulative(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _running_totals(s: PlotSeries, per_bucket: list[int]):
    """(times, totals): 0 at the span's start, then each bucket's total at its end. (Totals
    at bucket ends drawn `steps-post` ran a bucket behind: a finished two-bucket campaign
    showed 0 done, its final total never drawn.)"""
    import matplotlib.dates as mdates
    start = mdates.date2num(datetime.fromtimestamp(s.at(0), timezone.utc))
    return [start, *_times(s, centre=False)], [0, *_cumulative(per_bucket)]


def _tasks(ax, s: PlotSeries, counts: Sequence[Counted] = ()) -> None:
    t, done, not_done = task_lines(s, counts)
    t = _dates(t)
    ax.plot(t, done, label="done", color="tab:green")
    ax.plot(t, not_done, label="not done (queued, in flight or held)", color="tab:orange")
    ax.set_ylabel("tasks")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)


def _throughput(ax, s: PlotSeries) -> None:
    t = _times(s)
    per_min = 60.0 / s.width
    width = s.width / 86400 * 0.9
    ok = [(d - b) * per_min for d, b in zip(s.done, s.not_ok, strict=True)]
    bad = [b * per_min for b in s.not_ok]
    ax.bar(t, ok, width=width, color="tab:blue", label="ok")
    if any(bad):
        ax.bar(t, bad, width=width, bottom=ok, color="tab:red", label="not ok")
    ax.set_ylabel("results per minute")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3, axis="y")


def _levels(s: PlotSeries, per_bucket: list[int]):
    """(times, values) to draw `steps-post`: each bucket's value level from its start to its
    end. (Drawn `steps-pre` at the buckets' ends, the first bucket's value was only a
    vertical line at its end: test cases all found in a campaign's first second showed as a
    spike at its end.)"""
    return _dates([s.at(i) for i in range(s.n + 1)]), [*per_bucket, per_bucket[-1]]


def _testcases(ax, s: PlotSeries) -> None:
    ax.plot(*_running_totals(s, s.testcases), color="tab:purple", label="written so far")
    ax.set_ylabel("test cases written")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(*_levels(s, s.testcases), drawstyle="steps-post", color="tab:grey",
             linewidth=0.8, alpha=0.7, label="per bucket (right axis)")
    ax2.set_ylabel("per bucket")
    ax2.set_ylim(bottom=0)
    if not any(s.testcases):
        ax.text(0.5, 0.5, "no test cases written", transform=ax.transAxes, ha="center",
                va="center", color="grey")
    lines, labels = ax.get_legend_handles_labels()
    bars, bar_labels = ax2.get_legend_handles_labels()
    ax.legend(lines + bars, labels + bar_labels, loc="upper left")
    ax.grid(alpha=0.3)


def _ranks(ax, s: PlotSeries) -> None:
    import matplotlib.dates as mdates
    ranks = sorted(s.busy)
    if not ranks:
        ax.text(0.5, 0.5, "no dispatch committed yet", transform=ax.transAxes, ha="center",
                va="center", color="grey")
        ax.set_yticks([])
        return
    grid = [[min(1.0, max(0.0, v / s.width)) for v in s.busy[r]] for r in ranks]
    x0 = mdates.date2num(datetime.fromtimestamp(s.t0, timezone.utc))
    x1 = mdates.date2num(datetime.fromtimestamp(s.at(s.n), timezone.utc))
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1,
                   extent=(x0, x1, len(ranks) - 0.5, -0.5))
    step = max(1, len(ranks) // 16)
    ax.set_yticks(range(0, len(ranks), step), [str(r) for r in ranks[::step]])
    ax.set_ylabel("rank")
    ax.figure.colorbar(im, ax=ax, label="share of the bucket busy", pad=0.01)


def _events(axes, s: PlotSeries) -> None:
    """One panel per kind of trouble, each kind a line of its own colour: rare events (a
    death) stay visible beside frequent ones (quarantined messages)."""
    t = _times(s)
    for ax, (what, kinds) in zip(axes, _EVENT_PANELS, strict=True):
        shown = [(k, s.events[k]) for k in kinds if any(s.events.get(k, ()))]
        for kind, counts in shown:
            ax.plot(t, counts, marker=".", markersize=4, linewidth=1,
                    label=f"{_EVENT_LABELS.get(kind, kind)} ({sum(counts)})")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if shown:
            ax.legend(loc="upper right", fontsize=8)
        else:
            ax.text(0.5, 0.5, f"none ({', '.join(_EVENT_LABELS[k] for k in kinds)})",
                    transform=ax.transAxes, ha="center", va="center", color="grey",
                    fontsize=9)
            ax.set_ylim(0, 1)
            ax.set_yticks([])


def _index(db: Path, s: PlotSeries, stats: Stats, running: bool) -> str:
    t = stats.tasks
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    span = f"{_utc(s.t0)} to {_utc(s.at(s.n))}"
    esc = html.escape
    figures = "\n".join(
        f'<figure>\n  <h2>{esc(title)}</h2>\n  <img src="{name}" alt="{esc(title)}" '
        f'width="1000">\n  <figcaption>{esc(caption)}</figcaption>\n</figure>'
        for name, title, caption in CHARTS)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{esc(db.name)}: campaign charts</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1040px; }}
figure {{ margin: 0 0 2em 0; }}
img {{ max-width: 100%; height: auto; border: 1px solid #ddd; }}
figcaption, .meta {{ color: #555; font-size: 90%; }}
</style>
</head>
<body>
<h1>{esc(db.name)}</h1>
<p class="meta">{esc(str(db))}: incarnation {stats.incarnation}, schema
{esc(str(stats.schema_revision))}; {'a master was running' if running else 'no master running'}
when drawn ({when}). {t['done']} done, {t['queued']} queued, {t['active']} active,
{t['deferred']} deferred, {t['failed']} failed; {stats.results} results. From {span}, in
buckets of {duration(s.width)}.</p>
{figures}
</body>
</html>
"""


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
