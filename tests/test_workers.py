"""`store.workers`: worker rows and states."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from conftest import Farm, rows

from store.schema import WorkerState, workers
from store.workers import set_workers


def test_set_workers_updates_known_ranks_and_creates_unknown_ones(farm):
    farm.ready(1, "")
    farm.ready(2, "")
    before = {r.rank: r.state for r in rows(farm, workers)}
    assert before == {1: "idle", 2: "idle"}
    new_rank = 7
    known = [1]  # one statement for a batch that mixes a known rank and a new one
    with farm.store.transaction("test") as tx:
        set_workers(tx, [(r, WorkerState.FAILED) for r in known] + [(new_rank, WorkerState.BUSY)])
    after = {r.rank: r.state for r in rows(farm, workers)}
    assert after == {**before, **{r: "failed" for r in known}, new_rank: "busy"}
    with farm.store.transaction("test") as tx:  # now every rank is known: UPDATE only
        set_workers(tx, [(new_rank, WorkerState.IDLE)])
    assert {r.rank: r.state for r in rows(farm, workers)}[new_rank] == "idle"


def test_where_the_ranks_of_every_incarnation_ran_stays_in_the_file(farm, db_path):
    """`--resume` restamps the `workers` rows with the new incarnation and drops those of
    ranks the new job lacks, so `rank_utilisation.host` was NULL for every earlier
    incarnation and "which host was rank 4 on in incarnation 1" had no answer in the file.
    The `campaign` event that begins the next incarnation says it; the page's query reads it."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "sqlite.md").read_text()
    section = page[page.index("### `workers`"):page.index("| column | meaning |",
                                                           page.index("### `workers`"))]
    [query] = re.findall(r"```sql\n(.*?)```", section, flags=re.DOTALL)
    assert "One row per rank the master has dealt with." not in page

    for rank, host in ((1, "node17"), (2, "node17"), (3, "node18"), (4, "node17")):
        farm.ready(rank, "", host=host, pid=100 + rank)
    farm.ready(5, "")  # no host reported
    farm.close()
    second = Farm(db_path, resume=True, ranks=3)  # the master and ranks 1-2: 3-5 dropped
    second.ready(1, "", host="node20")
    second.close()
    third = Farm(db_path, resume=True)
    third.close()
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as c:
        assert c.execute(query).fetchall() == [
            (1, "ranks of incarnation 1 by host: node17=1-2,4 node18=3"),
            (2, "ranks of incarnation 2 by host: node20=1")]  # rank 2 not heard from in 2
        assert c.execute("SELECT rank, host, incarnation FROM workers ORDER BY rank"
                         ).fetchall() == [(1, "node20", 3), (2, "node17", 3)]
