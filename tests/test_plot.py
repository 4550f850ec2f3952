"""`coordinator plot`: PNG charts and an index.html from a real campaign file, read-only; the
page loaded in a real headless browser (Debian's Chromium), every chart loading."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from datetime import datetime, timezone
from html import escape
from pathlib import Path

import pytest
from campaigns import FindingWorkers, copy_of, finding_campaign
from conftest import load_tool

from coordinator import plot
from coordinator.cli import main
from coordinator.exits import ExitStatus
from coordinator.master import Master, MasterConfig
from coordinator.plot import CHARTS, Counted, task_lines
from store.campaign import Store
from store.observe import PlotSeries

pytest.importorskip("matplotlib", reason="the plot extra: pip install -e '.[plot]'")
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
#: As root in a closed network: no sandbox, and none of the background connections.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _listing(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


@pytest.fixture(scope="module")
def charts(tmp_path_factory) -> tuple[Path, Path]:
    """A campaign with test cases, failed results and quarantined messages, plotted."""
    d = tmp_path_factory.mktemp("plot")
    db = d / "campaign.db"
    assert finding_campaign(db, tasks=600).committed == 600
    before = _listing(d)
    out = d / "charts"
    assert main(["plot", "--db", str(db), str(out)]) == ExitStatus.OK
    after = _listing(d)
    assert after.pop("charts") and after == before  # nothing beside the file was written
    return db, out


def _check_image(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path.name
    assert path.stat().st_size > 10_000, path.name
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.size[0] >= 800 and im.size[1] >= 250, (path.name, im.size)
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 50, path.name  # not a blank canvas


def test_every_chart_is_a_real_image_and_the_index_shows_each(charts):
    _, out = charts
    html = (out / "index.html").read_text()
    shown = re.findall(r'<img src="([^"]+)"', html)
    assert shown == [name for name, _, _ in CHARTS]
    for name in shown:
        _check_image(out / name)
    assert "600 done" in html


def test_the_page_loads_every_chart_in_a_real_browser(charts, tmp_path):
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    _, out = charts
    problems: list[str] = []
    profile = tmp_path / "profile"
    profile.mkdir()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
            page.goto((out / "index.html").as_uri(), wait_until="load")
            images = page.evaluate(
                "Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, "
                "i.naturalWidth, i.naturalHeight])")
            title = page.title()
        finally:
            browser.close()
    assert problems == []
    assert [src for src, *_ in images] == [name for name, _, _ in CHARTS]
    for src, complete, width, height in images:
        assert complete and width >= 800 and height >= 250, (src, width, height)
    assert title == "campaign.db: campaign charts"


def test_without_matplotlib_the_command_says_what_to_install(charts, tmp_path):
    db, _ = charts
    probe = ("import sys; sys.modules['matplotlib'] = None\n"
             "from coordinator.cli import main\n"
             f"sys.exit(main(['plot', '--db', {str(db)!r}, {str(tmp_path / 'x')!r}]))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)
    assert done.returncode == ExitStatus.USAGE
    assert "pip install -e '.[plot]'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x").exists()


def test_a_campaign_of_100000_tasks_is_plotted(tmp_path):
    """Made directly with SQL (tools/big_campaign.py): aggregated in SQL, it takes seconds."""
    big = load_tool("big_campaign")
    db = tmp_path / "big.db"
    big.build(db, 100_000, 16, 86400.0)
    out = tmp_path / "charts"
    assert main(["plot", "--db", str(db), str(out)]) == ExitStatus.OK
    for name, _, _ in CHARTS:
        _check_image(out / name)
    assert "index.html" in os.listdir(out)
    shutil.rmtree(out)


def test_an_outdir_that_cannot_be_written_is_a_refusal(charts, tmp_path, capsys):
    """`plot` to an OUTDIR that cannot be written exited 3, which README's table keeps for
    the storage failing under a run; it is a path the command was given that cannot be
    used: exit 2, one line."""
    db, _ = charts
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    assert main(["plot", "--db", str(db), str(taken)]) == ExitStatus.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"coordinator: cannot write the charts to {taken}: ") and \
        err.count("\n") == 1, err
    assert taken.read_text() == "not a directory"


def test_an_older_revision_is_plotted_from_an_upgraded_copy_left_as_it_is(charts, tmp_path,
                                                                            capsys):
    """`plot` refused a file of an older schema revision ("bring it forward with `coordinator
    db upgrade`"): a post-mortem needed a write to the evidence. It reads a copy upgraded in
    TMPDIR, as `status` does, says so, and the page names the file's own revision."""
    db = copy_of(charts[0], tmp_path)
    down = subprocess.run([sys.executable, "-m", "alembic", "-x", f"db={db}", "downgrade",
                           "0012"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    out = tmp_path.parent / f"{tmp_path.name}-charts"
    assert main(["plot", "--db", str(db), str(out)]) == ExitStatus.OK
    err = capsys.readouterr().err
    assert err.count("read from an upgraded copy of revision 0012 in TMPDIR") == 1, err
    assert "<bound method" not in err
    assert "incarnation 1, schema\n0012;" in (out / "index.html").read_text()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# -- what the charts draw ------------------------------------------------------------------------
# The lines matplotlib was given (after its step styles), read back from the figures: the data
# a chart is built from, not its pixels.

def _drawn(db: Path, out: Path, monkeypatch) -> dict[str, object]:
    """`coordinator plot` run on `db`, its figures kept open: chart file name -> figure."""
    import matplotlib.pyplot as plt
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)
    assert main(["plot", "--db", str(db), str(out)]) == ExitStatus.OK
    titles = {title: name for name, title, _ in CHARTS}
    figures = {titles[f.axes[0].get_title()]: f for f in kept}
    assert sorted(figures) == sorted(titles.values())
    return figures


def _line(fig, label: str):
    """The line of `fig` whose legend label starts with `label`."""
    [line] = [ln for ax in fig.axes for ln in ax.get_lines()
              if ln.get_label().startswith(label)]
    return line


def _x(t: float) -> float:
    import matplotlib.dates as mdates
    return mdates.date2num(datetime.fromtimestamp(t, timezone.utc))


def _ys(line, t: float) -> set[float]:
    """Every value the drawn `line` takes at Unix time `t` (two at a vertical step)."""
    x, got = _x(t), set()
    v = line.get_path().vertices
    eps = 1e-9  # days: 0.1 ms
    for (x0, y0), (x1, y1) in zip(v[:-1], v[1:], strict=True):
        if min(x0, x1) - eps <= x <= max(x0, x1) + eps:
            if abs(x1 - x0) <= eps:
                got |= {round(float(y0), 6), round(float(y1), 6)}
            else:
                got.add(round(float(y0 + (y1 - y0) * (x - x0) / (x1 - x0)), 6))
    return got


def _series(n: int, width: float = 1.0, t0: float = 1_800_000_000.0, **lists) -> PlotSeries:
    zeros = [0] * n
    return PlotSeries(t0, width, n, lists.get("done", zeros), zeros,
                      lists.get("created", zeros), lists.get("testcases", zeros), {}, {})


def test_a_buckets_value_spans_its_bucket():
    """Test cases all written in a campaign's first second were drawn as a vertical line at
    its end (per bucket, `steps-pre` at the buckets' ends): each bucket's value is now level
    from its start to its end, the first's too."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = _series(16, testcases=[4] + [0] * 13 + [1, 0])
    fig, ax = plt.subplots()
    try:
        plot._testcases(ax, s)
        per_bucket = _line(fig, "per bucket (right axis)")
        for i, v in enumerate(s.testcases):
            for f in (0.1, 0.5, 0.9):
                assert _ys(per_bucket, s.at(i) + f * s.width) == {v}, (i, f)
        total = _line(fig, "written so far")
        assert _ys(total, s.at(1)) == {4} and _ys(total, s.at(16)) == {5}
    finally:
        plt.close(fig)


def test_the_test_case_chart_counts_and_says_the_test_cases_of_runs_cut_short(
        charts, tmp_path, monkeypatch):
    """Test cases of runs killed at their timeout or by the job's stop are kept (`salvaged`)
    and counted with the results' own: the caption said only "written by committed
    results"."""
    db, _ = charts
    copy = copy_of(db, tmp_path)
    with sqlite3.connect(copy) as c:
        (last, written) = c.execute(
            "SELECT max(committed_at), total(testcases) FROM results").fetchone()
        c.execute("INSERT INTO salvaged (at, incarnation, rank, token, task_id, testcases) "
                  "VALUES (?, 1, 2, ?, 3, 5)", (last, "a" * 64))
    figures = _drawn(copy, tmp_path / "charts", monkeypatch)
    total = _line(figures["testcases.png"], "written so far")
    assert total.get_path().vertices[-1][1] == written + 5
    caption = dict((name, text) for name, _, text in CHARTS)["testcases.png"]
    assert "runs cut short" in caption and "their test cases kept" in caption
    assert escape(caption) in (tmp_path / "charts" / "index.html").read_text()


@pytest.fixture(scope="module")
def requeued(tmp_path_factory) -> Path:
    """`finding_campaign`'s 300 tasks, then rank 1's results discarded (`requeue --rank 1`)
    and the campaign resumed: every task done again."""
    db = tmp_path_factory.mktemp("requeued") / "campaign.db"
    assert finding_campaign(db, tasks=300).committed == 300
    assert main(["requeue", "--db", str(db), "--rank", "1"]) == ExitStatus.OK
    store = Store.open(db, resume=True)
    try:
        assert Master(store, FindingWorkers(3), MasterConfig(
            stats_file=db.with_name("stats"), linger_s=0, grace_s=1, stop_wait_s=1,
            feedback=False, observe_interval_s=0.05)).run().committed > 50
    finally:
        store.close()
    return db


def _observations(db: Path) -> list[tuple[float, int, int, int]]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT at, incarnation, done, queued + active + deferred + failed "
                         "FROM observations ORDER BY at").fetchall()


def test_the_tasks_chart_draws_what_the_master_recorded_not_what_a_requeue_left(
        requeued, tmp_path, monkeypatch):
    """`requeue` discards results: the chart drew its history from the results left, so the
    first run's 300 done tasks were drawn as the ~200 whose results survived. The master's
    observation rows hold the figures of the time: the lines pass through each of them."""
    observed = _observations(requeued)
    first_run = [o for o in observed if o[1] == 1]
    assert first_run[-1][2:] == (300, 0)
    with sqlite3.connect(requeued) as c:
        (kept,) = c.execute("SELECT count(*) FROM results WHERE incarnation = 1").fetchone()
    assert 100 < kept < 300  # what the rows alone say the first run did
    fig = _drawn(requeued, tmp_path / "charts", monkeypatch)["tasks.png"]
    done, not_done = _line(fig, "done"), _line(fig, "not done")
    for at, _, d, nd in observed:
        assert d in _ys(done, at) and nd in _ys(not_done, at), (at, d, nd)
    assert _ys(done, first_run[-1][0]) == {300}
    end = done.get_path().vertices[-1][0]
    assert done.get_path().vertices[-1][1] == 300 and not_done.get_path().vertices[-1][1] == 0
    assert end >= _x(observed[-1][0])


def test_without_observations_the_tasks_chart_counts_the_rows(requeued, tmp_path, monkeypatch):
    """A campaign from before the master recorded its counts (schema 0010): the results
    committed and tasks created, at each bucket's end."""
    copy = copy_of(requeued, tmp_path)
    with sqlite3.connect(copy) as c:
        c.execute("DELETE FROM observations")
        committed = [t for (t,) in c.execute("SELECT committed_at FROM results")]
    fig = _drawn(copy, tmp_path / "charts", monkeypatch)["tasks.png"]
    done = _line(fig, "done")
    xs, ys = done.get_path().vertices.T
    assert ys[0] == 0 and ys[-1] == len(committed) == 300
    import matplotlib.dates as mdates
    for x, y in zip(xs[1:], ys[1:], strict=True):
        t = mdates.num2date(x).timestamp()
        assert y == sum(c < t + 1e-6 for c in committed)


def test_task_lines_go_on_from_a_record_with_the_rows_and_step_at_the_next_run():
    """Buckets of 10 s: 20 tasks created in the first; a first run recorded at 1 s and 19 s,
    then killed after committing 2 more (bucket 2); 4 results discarded by a requeue; a
    second run recorded at 41 s and 58 s. The rows after 19 s are added to its figures (from
    the next bucket on), held to the second run's first record, and that is drawn where it was
    taken, a step down."""
    s = _series(6, width=10.0, t0=0.0, done=[0, 4, 2, 0, 10, 0], created=[20, 0, 0, 0, 0, 0])
    counts = [Counted(1, 1, 0, 20), Counted(19, 1, 8, 12), Counted(41, 2, 6, 14),
              Counted(58, 2, 20, 0)]
    t, done, not_done = task_lines(s, counts)
    assert list(zip(t, done, not_done, strict=True)) == [
        (0, 0, 0), (1, 0, 0), (1, 0, 20), (19, 8, 12), (20, 8, 12), (30, 10, 10),
        (40, 10, 10), (41, 10, 10), (41, 6, 14), (58, 20, 0), (60, 20, 0)]
    # no records at all: the rows' running totals at each bucket's end, as before
    t, done, not_done = task_lines(s, [])
    assert t == [0, 10, 20, 30, 40, 50, 60]
    assert done == [0, 0, 4, 6, 6, 16, 16] and not_done == [0, 20, 16, 14, 14, 4, 4]
