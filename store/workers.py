"""Worker ranks as the master sees them: state, versions, where they run, when last heard."""

from __future__ import annotations

import re
from collections.abc import Iterable

from sqlalchemy import Connection, select, text, update

from .journal import Tx
from .schema import COUNTED_KIND_SQL, WorkerState, workers

_UPSERT_STATE = (
    "INSERT INTO workers (rank, state, incarnation, parked_token, last_seen) "
    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (rank) DO UPDATE SET state = excluded.state, "
    "incarnation = excluded.incarnation, parked_token = excluded.parked_token")

_ACCEPT_READY = (
    "INSERT INTO workers (rank, state, incarnation, bitmap_version, profile_version, "
    "parked_token, host, pid, last_seen) VALUES (?, 'idle', ?, ?, ?, NULL, ?, ?, ?) "
    "ON CONFLICT (rank) DO UPDATE SET state = 'idle', incarnation = excluded.incarnation, "
    "bitmap_version = excluded.bitmap_version, profile_version = excluded.profile_version, "
    "parked_token = NULL, host = coalesce(excluded.host, host), "
    "pid = coalesce(excluded.pid, pid), last_seen = excluded.last_seen")


_UPDATE_STATE = "UPDATE workers SET state = ?, incarnation = ?, parked_token = ? WHERE rank = ?"


def set_workers(tx: Tx, rows: Iterable[tuple[int, WorkerState]], *,
                parked_token: str | None = None) -> None:
    """Set each rank's state (one statement for the whole batch). A plain UPDATE first: the
    master writes every rank's row twice a task, and the upsert costs about twice as much; a
    rank with no row yet (never heard from) gets the upsert, which is idempotent."""
    rows = list(rows)
    if not rows:
        return
    n = tx.db.executemany(_UPDATE_STATE, [(s.value, tx.incarnation, parked_token, r)
                                          for r, s in rows]).rowcount
    if n != len(rows):
        tx.db.executemany(_UPSERT_STATE, [(r, s.value, tx.incarnation, parked_token, tx.now)
                                          for r, s in rows])


def accept_versions(tx: Tx, rank: int, bitmap_version: int, profile_version: str,
                    host: str | None = None, pid: int | None = None) -> None:
    """An idle READY: take its (already sanitised) versions and make the rank idle."""
    tx.db.execute(_ACCEPT_READY, (rank, tx.incarnation, bitmap_version, profile_version, host,
                                  pid, tx.now))


def parked_tokens(tx: Tx) -> dict[int, str]:
    """Parked ranks and the retired token each must echo to be given work again.

    Read without writing the transaction's pending row changes first (`Tx.raw_db`): they are
    marks and commits of dispatches, and a parked rank holds none, so none of them can park
    or unpark a rank; writing them here would split a round's changes in two statements."""
    return dict(tx.raw_db.execute(
        "SELECT rank, parked_token FROM workers WHERE state = 'parked'").fetchall())


def idle_ranks(tx: Tx) -> list[int]:
    """Ranks that showed READY and hold no dispatch: the ones that may receive WORK."""
    return [r for (r,) in tx.db.execute(
        "SELECT w.rank FROM workers w WHERE w.state = 'idle' AND NOT EXISTS "
        "(SELECT 1 FROM dispatches d WHERE d.rank = w.rank) ORDER BY w.rank")]


def _ranges(ranks: list[int]) -> str:
    """1, 2, 3, 7 -> "1-3,7"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def where_ranks_ran(tx: Tx) -> str | None:
    """Where the ranks of the incarnation before `tx`'s ran, for the `campaign` event that
    begins it: "ranks of incarnation N by host: node17=1-3,7 node18=4-6". A resume drops
    the rows of ranks the new job lacks and restamps the others (`forget_incarnation`), and
    a READY of the new job replaces a rank's host: this is what keeps, in the file, which
    host each rank of every incarnation was on (`rank_utilisation` finds only the latest's).
    The ranks heard from in it that reported a host; None if none did."""
    ended = tx.incarnation - 1
    by_host: dict[str, list[int]] = {}
    for rank, host in tx.db.execute(
            "SELECT rank, host FROM workers WHERE incarnation = ? AND state <> 'unknown' "
            "AND host IS NOT NULL ORDER BY rank", (ended,)):
        by_host.setdefault(host, []).append(rank)
    if not by_host:
        return None
    return f"ranks of incarnation {ended} by host: " + " ".join(
        f"{h}={_ranges(rs)}" for h, rs in sorted(by_host.items(), key=lambda i: min(i[1])))


def forget_incarnation(tx: Tx, ranks: int | None = None) -> None:
    """A new incarnation talks to new processes: nothing known about ranks carries over.
    `ranks`: the new job's size. The rows of ranks it does not have (a resume with fewer)
    are dropped: kept, they were shown for ever as ranks yet to be heard from, counted as
    `unknown` ranks in the metrics, and as ranks that could still work in the ETA's test."""
    if ranks is not None:
        tx.db.execute("DELETE FROM workers WHERE rank >= ?", (ranks,))
    tx.conn.execute(update(workers).values(state=WorkerState.UNKNOWN.value, parked_token=None,
                                           incarnation=tx.incarnation, unrun_streak=None,
                                           unrun_since=None, unrun_detail=None))


_NOTE_UNRUN = ("UPDATE workers SET unrun_streak = ?, unrun_detail = ?, unrun_since = "
               "CASE WHEN ? THEN ? ELSE coalesce(unrun_since, ?) END WHERE rank = ?")
_END_UNRUN = ("UPDATE workers SET unrun_streak = NULL, unrun_since = NULL, unrun_detail = NULL "
              "WHERE rank = ?")


def note_unrun(tx: Tx, rank: int, streak: int | None, detail: str | None = None) -> None:
    """A rank's host could not run its last `streak` answers (what it could not do:
    `detail`), for `status` to show; None: an answer of it ran a task. Written on failures
    and on the answer that ends them only, never on a healthy rank's round."""
    if streak is None:
        tx.db.execute(_END_UNRUN, (rank,))
    else:
        tx.db.execute(_NOTE_UNRUN, (streak, detail, streak == 1, tx.now, tx.now, rank))


def where_they_run(conn: Connection) -> dict[int, tuple[str, int, float]]:
    """rank -> (host, pid, when last heard) as each worker reported them in its last READY,
    for the ranks heard from in this incarnation (an earlier one's pid is another process's
    by now, or nobody's)."""
    return {r: (h, p, seen) for r, h, p, seen in conn.execute(
        select(workers.c.rank, workers.c.host, workers.c.pid, workers.c.last_seen).where(
            workers.c.state != WorkerState.UNKNOWN.value, workers.c.host.is_not(None),
            workers.c.pid.is_not(None), workers.c.last_seen.is_not(None)))}


def worker_states(conn: Connection) -> dict[int, WorkerState]:
    """Every rank heard from, with its state (a rank with no row was never heard from)."""
    return {r: WorkerState(s) for r, s in conn.execute(select(workers.c.rank, workers.c.state))}


#: The watchdog events of parked ranks, through the partial index of the counted kinds (a
#: few rows), never the per-task events.
# A batch's watchdog event names its first task; the split that put its tasks back says how
# many it held ("split: 8 tasks back at the head ...").
_PARKED = text(
    "SELECT w.rank, e.task_id, e.at, (SELECT s.detail FROM events s WHERE s.kind = 'requeued' "
    f"AND {COUNTED_KIND_SQL} AND s.token = w.parked_token AND substr(s.detail, 1, 7) = 'split: '"
    ") FROM workers w LEFT JOIN events e "
    f"ON e.kind = 'watchdog' AND {COUNTED_KIND_SQL} AND e.token = w.parked_token "
    "WHERE w.state = 'parked' ORDER BY w.rank")
_SPLIT_SIZE = re.compile(r"split: (\d+) tasks")


def parked_detail(conn: Connection) -> list[tuple[int, int | None, float | None, int]]:
    """(rank, the (first) task of the dispatch the watchdog retired, when, how many tasks it
    held) for every parked rank."""
    out = []
    for rank, task_id, at, split in conn.execute(_PARKED):
        m = _SPLIT_SIZE.match(split or "")
        out.append((rank, task_id, at, int(m[1]) if m else 1))
    return out


def ranks_in_state(conn: Connection, *states: WorkerState) -> set[int]:
    return {r for (r,) in conn.execute(select(workers.c.rank).where(
        workers.c.state.in_([s.value for s in states])))}
