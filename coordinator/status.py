"""`coordinator status`: one screen (or one JSON document) for a whole campaign, like
`afl-whatsup`, read without writing anything.

It reads through `store.readonly` with the stdlib's sqlite3 and the store's plain-SQL readers
(`stats`, `observe`), never SQLAlchemy, whose import alone took 0.3-0.5 s of the command's
start on a 2-core node: an operator's `watch coordinator status` stays cheap.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

from store.errors import CampaignRowMissing, NoCampaignYet, StoreError
from store.lock import lock_holder, locks_readable
from store.observe import RankView, read_observed, read_ranks, read_samples
from store.readonly import read_file
from store.revisions import check_campaign, current_revision
from store.stats import (
    held_reasons,
    incarnation_stop,
    last_master,
    other_messages_text,
    recent_failures,
    stats_text,
)
from store.vocabulary import STOPPED_FREE

from .errors import refused
from .processes import process_exists
from .progress import RATE_WINDOWS, Snapshot, clock_utc, duration, per_s, rates
from .wire import detail_summary


def status(db: Path, as_json: bool) -> int:
    """What the campaign file holds, read without writing anything (a read-only view that a
    running master never waits for, on read-only media too): like `afl-whatsup`, one screen
    for the whole campaign. Every read is of a narrow index or a small table."""
    now = time.time()

    def read(conn):
        try:
            check_campaign(conn, db)
        except NoCampaignYet:
            # The schema without its campaign row, and no master starting on it: a copy made
            # without its -wal was said to be about to get a campaign "within a moment".
            if current_revision(conn) is not None and lock_holder(db) is None:
                raise CampaignRowMissing(db) from None
            raise
        seen = read_observed(conn)
        s = seen.stats
        failures = recent_failures(conn) if set(seen.results_by_status) - {"ok"} else []
        held = held_reasons(conn) if s.tasks["deferred"] or s.tasks["failed"] else {}
        samples = read_samples(conn, s.incarnation, now - 2 * max(RATE_WINDOWS.values()))
        return (seen, failures, held, last_master(conn), read_ranks(conn), samples,
                incarnation_stop(conn, s.incarnation))
    try:
        (seen, failures, held, last, ranks, samples, stop), view = read_file(
            db, read, upgrade=_upgrade)
    except StoreError as e:
        return refused(str(e), {"error": str(e)} if as_json else None)
    master = _master_state(last, lock_holder(db))
    s, times, by_status = seen.stats, seen.times, seen.results_by_status
    if view.upgraded_from is not None:  # the file's own revision, not its copy's
        s = dataclasses.replace(s, schema_revision=view.upgraded_from)
    running = master is not None and master["running"] is not False
    # A master that is gone ran until its last observation; its rates of the last minute
    # and hour are not those of anything running now. One that recorded nothing after its
    # start has no end to measure to: its start stands in, so that no rate is made up.
    end = now if running else (times.last_observed_at or times.incarnation_started_at or now)
    got = rates(samples, end, s.tasks["done"])
    if not running:
        got["last_minute"] = got["last_hour"] = None
    snap = Snapshot(at=end, stats=s, found=seen.found, started_at=times.incarnation_started_at,
                    rates=got, finite=times.source != "afl", ranks=seen.worker_states,
                    results_by_status=by_status, running=running,
                    unrun_ranks=seen.unrun_ranks)
    oldest = times.oldest_dispatch
    if as_json:
        print(json.dumps({
            **s.as_json(), "error": None, "results_by_status": by_status, "master": master,
            "now": now,
            "stop": None if stop is None else {"at": stop[0], "cause": stop[1]},
            "view": {"mode": view.mode, "note": view.note()},
            "campaign_created_at": times.created_at,
            "campaign_age_s": None if times.created_at is None else now - times.created_at,
            "incarnation_started_at": times.incarnation_started_at,
            "incarnation_run_s": (None if times.incarnation_started_at is None
                                  or (not running and times.last_observed_at is None)
                                  else end - times.incarnation_started_at),
            "source": times.source,
            "rate": got,
            "eta_s": snap.eta_s,
            "testcases": {"written": seen.found.testcases, "results": seen.found.results,
                          "retried_runs": seen.found.retried,
                          "last_at": seen.found.last_at,
                          "since_last_s": None if seen.found.last_at is None
                          else now - seen.found.last_at},
            "quarantined": snap.quarantined,
            "parked_ranks": snap.parked,
            "worker_deaths": seen.worker_deaths,
            "refused_ranks": s.refused_ranks,
            "oldest_dispatch": None if oldest is None else {
                "rank": oldest[0], "task_id": oldest[1], "age_s": end - oldest[2]},
            "ranks": [{"rank": r.rank, "host": r.host, "pid": r.pid, "state": r.state,
                       "incarnation": r.incarnation, "busy": r.busy,
                       "busy_window_s": r.window_s, "busy_at": r.load_at,
                       "task_id": r.task_id,
                       "task_age_s": None if r.since is None else end - r.since,
                       "unrun": None if not r.unrun_streak else {
                           "dispatches": r.unrun_streak, "since": r.unrun_since,
                           "detail": r.unrun_detail}}
                      for r in ranks],
        }, indent=2, sort_keys=True))
        return 0
    t = s.tasks
    print(f"campaign {db} (incarnation {s.incarnation}, schema {s.schema_revision})")
    if view.note():
        print(f"note: {view.note()}")
    if master is not None:
        where = f"pid {master['pid']} on {master['host']}"
        state = {True: f"running ({where})",
                 False: f"not running (the last was {where})",
                 None: f"{where} (whether it runs cannot be told from here)"}[master["running"]]
        print("master: " + state)
    if stop is not None:
        print(f"  {_stop_text(stop, None if master is None else master['running'])}")
    if times.created_at is not None:
        started = times.incarnation_started_at
        run = ("" if started is None else
               f"; this incarnation {'has run' if running else 'ran'} {duration(end - started)}"
               if running or times.last_observed_at is not None else
               f"; this incarnation started {clock_utc(started)}, its end was not recorded "
               f"(its master left no record after its start)")
        print(f"age: {duration(now - times.created_at)} (created "
              f"{clock_utc(times.created_at)}){run}")
    print(f"tasks: {sum(t.values())} = {t['done']} done, {t['queued']} queued, "
          f"{t['active']} active, {t['deferred']} deferred, {t['failed']} failed")
    if t["active"] and master is not None and master["running"] is False:
        print(f"  the {t['active']} active ones were left by a master that is gone: "
              f"`coordinator run --resume` puts them back in the queue first")
    for state, reasons in held.items():
        print(f"  {state}, most common reasons: " + "; ".join(
            f"{n} × {detail_summary(reason, 100)}" for reason, n in reasons))
    print(f"rate: {per_s(got['last_minute'])} last minute, {per_s(got['last_hour'])} last "
          f"hour, {per_s(got['overall'])} over this incarnation; ETA "
          + (duration(snap.eta_s) if snap.finite else "never (an AFL queue is watched)"))
    found = seen.found
    print(f"test cases: {found.testcases} written by {found.results} results"
          + (f" and {found.retried} run{'s' * (found.retried != 1)} cut short (a timeout or "
             f"the job's stop: retried, their test cases kept)" if found.retried else "")
          + (f"; the last {duration(now - found.last_at)} ago" if found.last_at else ""))
    shown = ", ".join(f"{st}={n}" for st, n in sorted(by_status.items()))
    print(f"committed results: {s.results}" + (f" ({shown})" if shown else ""))
    if s.dropped_testcases:
        print(f"dropped test cases: {s.dropped_testcases} in {s.dropped_results} results "
              f"(over the command executor's limits or --max-message-bytes; each result's "
              f"detail says which)")
    if failures:
        print("latest results that are not ok:")
        for task_id, rank, status, detail in failures:
            print(f"  task {task_id} (rank {rank}): {status}: {detail_summary(detail)}")
    if oldest is not None:
        # (A master that is gone: how long it had been out when it stopped, not a growing age.)
        print(f"oldest active dispatch: task {oldest[1]} on rank {oldest[0]}, "
              f"{duration(end - oldest[2])}" + ("" if running else " when its master stopped"))
    _print_ranks(ranks, now, s.incarnation, end)
    print(f"quarantined: {snap.quarantined}; requeued: {s.requeued}; parked ranks: "
          f"{snap.parked}; worker deaths: {seen.worker_deaths}"
          + (f"; refused ranks: {s.refused_ranks}" if s.refused_ranks else ""))
    print(stats_text(s), end="")
    if (other := other_messages_text(s)) is not None:
        print(other)
    return 0


#: Ranks listed one per line; past this many, the rest are summed up (`--json` has all).
RANKS_SHOWN = 32


def _print_ranks(ranks: list[RankView], now: float, incarnation: int, ages_at: float) -> None:
    current = [r for r in ranks if r.incarnation == incarnation]
    if not current:
        return
    window = next((r.window_s for r in current if r.window_s), None)
    load_at = max((r.load_at for r in current if r.load_at), default=None)
    print(f"ranks: {len(current)}" + (
        f" (busy: share of the last {duration(window)} holding a dispatch, as of "
        f"{duration(now - load_at)} ago)" if window and load_at else ""))
    print(f"  {'rank':>5}  {'host':<16} {'state':<8} {'busy':>5}  {'task':>10}  age")
    for r in current[:RANKS_SHOWN]:
        busy = "-" if r.busy is None else f"{r.busy:.0%}"
        task = "-" if r.task_id is None else str(r.task_id)
        age = "-" if r.since is None else duration(ages_at - r.since)
        print(f"  {r.rank:>5}  {(r.host or '-')[:16]:<16} {r.state:<8} {busy:>5}  {task:>10}  "
              f"{age}")
    if len(current) > RANKS_SHOWN:
        rest = current[RANKS_SHOWN:]
        states = ", ".join(f"{n} {st}" for st, n in sorted(
            {st: sum(r.state == st for r in rest) for st in {r.state for r in rest}}.items()))
        print(f"  ... and {len(rest)} more ({states}; `--json` lists them all)")
    failing = [r for r in current if r.unrun_streak]
    if failing:
        # Every one, past RANKS_SHOWN too: a host to fix, which nothing else here shows (its
        # tasks go to the other ranks uncharged, so no count of deferred or failed grows).
        print("hosts that cannot run tasks (the rank's last answers ran nothing; fix the "
              "host):")
        for r in failing:
            since = ("" if r.unrun_since is None else
                     f" since {clock_utc(r.unrun_since)} ({duration(ages_at - r.unrun_since)})")
            print(f"  rank {r.rank} on {r.host or 'an unknown host'}: its last "
                  f"{r.unrun_streak} dispatch{'es' * (r.unrun_streak != 1)}{since}: "
                  f"{detail_summary(r.unrun_detail, 160)}")



def _upgrade(copy: Path) -> None:
    """A copy of a campaign at an older revision, brought to the head to be read: a
    post-mortem needs no write to the evidence. SQLAlchemy and Alembic are loaded for it
    alone (`read_file`)."""
    from store.versioning import upgrade
    upgrade(copy)


def _stop_text(stop: tuple[float, str], running: bool | None) -> str:
    """What this incarnation's `stop` event means to its operator: a master that is stopping,
    or one whose end was a stop (a signal, or storage it could not write), not a crash: the
    runs it left in flight, if any, rerun at `--resume` uncharged. (`running`: None when it
    cannot be told, as for `master`.)"""
    at, cause = stop
    if running:
        return (f"stopping since {clock_utc(at)}: {cause} (no new dispatches; in-flight work "
                f"finishes within the grace period or goes back to the queue)")
    if running is None:  # (no /proc here, or a master on another host)
        return (f"a stop began {clock_utc(at)}: {cause}; the runs it leaves in flight, if "
                f"any, are charged nothing at `--resume` (up to {STOPPED_FREE} such stops "
                f"per task; but a worker's that was already gone)")
    return (f"it was stopping since {clock_utc(at)}: {cause}; the runs it left in flight, if "
            f"any, are charged nothing at `--resume` (up to {STOPPED_FREE} such stops per "
            f"task; but a worker's that was already gone)")


def _master_state(last: tuple[int, str] | None, holder: int | None) -> dict | None:
    """The campaign's latest master, and whether it runs: the kernel's table of locks says
    who holds the file now (the database is on a node-local disk, so its master runs here);
    without one (no /proc), whether the latest master's pid exists on this host; None if it
    cannot be told."""
    if holder is not None:
        return {"pid": holder, "host": socket.gethostname(), "running": True}
    if last is None:
        return None
    pid, host = last
    running: bool | None = False
    if not locks_readable():
        running = process_exists(pid) if host == socket.gethostname() else None
    return {"pid": pid, "host": host, "running": running}
