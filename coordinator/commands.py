"""The operator's commands on a campaign file: `check`, `requeue`, `db upgrade` (`status`
has a module of its own, which loads no SQLAlchemy).

None of them needs MPI; `check` only reads, and works while a master runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from store.audit import AuditReport, audit_path
from store.campaign import Store
from store.errors import StoreError, StoreWriteError
from store.lock import campaign_locked
from store.probe import probe
from store.revisions import head
from store.schema import TaskState
from store.tasks import REQUEUE_CHUNK, requeue_error_results, requeue_tasks
from store.versioning import upgrade

from .errors import reader_may_leave, refused
from .exits import ExitStatus


def check(db: Path, as_json: bool) -> int:
    """The campaign file's consistency audit (`store.audit`), read-only: exit 0 and one line
    when it holds, exit 1 and one line per violation when it does not."""
    try:
        report = audit_path(db)
    except StoreError as e:
        return refused(str(e), check_refusal(str(e)) if as_json else None)
    with reader_may_leave():
        _say_check(db, report, as_json)
    return ExitStatus.OK if report.ok else ExitStatus.FAILED


def check_refusal(message: str) -> dict:
    """`check --json` of a file it refused: the report's keys, `error` saying why (null in a
    report), so that a script reads both with the same code."""
    return {"ok": False, "error": message, "revision": None, "head": head(),
            "violations": [], "skipped": [], "notes": []}


def _say_check(db: Path, report: AuditReport, as_json: bool) -> None:
    if as_json:
        print(json.dumps({
            "ok": report.ok, "error": None, "revision": report.revision, "head": report.head,
            "violations": [{"kind": v.kind.value, "check": v.check.value, "message": v.message,
                            "task_id": v.task_id, "token": v.token, "count": v.count}
                           for v in report.violations],
            "skipped": [c.value for c in report.skipped], "notes": report.notes,
        }, indent=2, sort_keys=True))
        return
    if report.ok:
        tasks = sum(report.stats.tasks.values()) if report.stats is not None else 0
        skipped = (f"; {len(report.skipped)} checks not run on it: "
                   f"{', '.join(c.value for c in report.skipped)}" if report.skipped else "")
        print(f"{db}: consistent ({tasks} tasks, schema {report.revision}{skipped})")
    for v in report.violations:
        print(f"{db}: {v.kind.value}: {v.message}")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)


def requeue(ns: argparse.Namespace) -> int:
    states = {"failed": (TaskState.FAILED,), "deferred": (TaskState.DEFERRED,),
              "all": (TaskState.FAILED, TaskState.DEFERRED), "error": ()}[ns.state]
    # By their results: done tasks whose result is to be discarded (its run failed, or it
    # came from a rank, or a time, the operator no longer trusts).
    by_result = ns.state == "error" or ns.rank is not None or ns.since is not None
    if by_result and ns.state in ("failed", "deferred"):
        print("coordinator: --rank and --since requeue done tasks by their result; --state "
              f"{ns.state} does not go with them", file=sys.stderr)
        return ExitStatus.USAGE
    try:
        store = Store.attach(ns.db)
    except StoreError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    done: list[int] = []
    try:
        # In chunks, each its own short transaction, in id order: a running master shares the
        # write lock and waits for each (a single one of 100,000 tasks would hold it 30 s). A
        # task the master runs and fails again meanwhile is not taken twice.
        while True:
            after = done[-1] if done else 0
            with store.transaction("manual requeue") as tx:
                chunk = (requeue_error_results(
                            tx, ids=ns.ids, after_id=after, limit=REQUEUE_CHUNK, rank=ns.rank,
                            since=ns.since, any_status=ns.state != "error")
                         if by_result else
                         requeue_tasks(tx, states=states, ids=ns.ids, after_id=after,
                                       limit=REQUEUE_CHUNK))
            done += chunk
            if len(chunk) < REQUEUE_CHUNK:
                break
    except StoreError as e:
        print(f"coordinator: {e}" + (f" (after {len(done)} tasks were requeued; run it again "
                                     f"for the rest)" if done else ""), file=sys.stderr)
        # (A write that failed is the storage's; a file refused as it is, the command's.)
        return ExitStatus.STORE if isinstance(e, StoreWriteError) else ExitStatus.USAGE
    finally:
        store.close()
    with reader_may_leave():  # (committed: whoever reads it, the requeue is done)
        print(f"requeued {len(done)} task(s)" + (f": {id_list(done)}" if done else ""))
    left = sorted(set(ns.ids or ()) - set(done))
    if left:
        wanted = {"all": "failed or deferred", "error": "done with a result that is not ok"}
        if by_result and ns.state != "error":
            wanted["all"] = "done with a result that matches"
        print(f"coordinator: not requeued (no such task, or not "
              f"{wanted.get(ns.state, ns.state)}): {id_list(left)}", file=sys.stderr)
    return 0


def id_list(ids: list[int], whole_up_to: int = 50, runs_shown: int = 20) -> str:
    """Task ids for a console line: all of them when few, else runs of consecutive ids
    (`1-5000`), the first `runs_shown` of them (a requeue of 50,000 tasks printed a line
    of 400 KB)."""
    if len(ids) <= whole_up_to:
        return ", ".join(map(str, ids))
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    shown = [f"{a}-{b}" if a != b else str(a) for a, b in runs[:runs_shown]]
    more = len(runs) - runs_shown
    # ASCII: a console whose encoding cannot show "…" failed the command after its commits.
    return ", ".join(shown) + (f", ... and {more} more runs of ids" if more > 0 else "")


def db_upgrade(db: Path) -> int:
    """Create the campaign file, or bring it to this code's schema, one revision per
    transaction; never under a running master."""

    def announce(before: str, target: str) -> None:
        print(f"coordinator: upgrading {db} from schema {before} to {target} (a revision that "
              f"copies a table takes seconds per million rows)...",
              file=sys.stderr, flush=True)

    try:
        probe(db, current=False)  # what is not a campaign is refused before anything else
        new = not db.exists()
        with campaign_locked(db):  # never under a running master
            before, after = upgrade(db, announce=announce)
    except StoreWriteError as e:
        # A full disk, tables that do not match the revision stamp: each revision runs in
        # one transaction, so the failed one changed nothing.
        print(f"coordinator: cannot upgrade {db}: {e}; the revision that failed changed "
              f"nothing (each runs in one transaction): fix the cause and run it again",
              file=sys.stderr)
        return ExitStatus.STORE
    except OSError as e:  # the file cannot be opened to take its lock (an I/O error)
        print(f"coordinator: cannot upgrade {db}: {e}; nothing was changed", file=sys.stderr)
        return ExitStatus.STORE
    except StoreError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        return ExitStatus.USAGE
    if new:
        # Otherwise a mistyped --db reads like an upgrade that worked, and leaves a file
        # behind that the other commands then find.
        print(f"coordinator: {db} did not exist: created it, with schema {after} and no "
              f"campaign in it yet (`coordinator run --db {db}` starts one); if you meant an "
              f"existing campaign, check the path and remove this file",
              file=sys.stderr)
    print(f"{db}: schema {before or '(new)'} -> {after}" if before != after
          else f"{db}: schema already at {after}")
    return 0
