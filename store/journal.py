"""The transaction context every transition runs in, and the append-only logs it writes.

A `Tx` is one write transaction. Transitions append their event and quarantine rows to it;
the rows are inserted with one `executemany` per table when the transaction ends, so a master
round that applies many messages costs a few statements, not one per message.

A transition may also leave its row changes pending (`write_behind`), to be written together
with those of the batches of answers after it: they are written before the transaction's next
statement of any other kind (every statement goes through `conn` or `db`, which write them
first) and before the COMMIT, so no statement ever sees the rows without them.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import Connection

from .schema import Channel, EventKind, QuarantineReason

_INSERT_EVENT = ("INSERT INTO events (at, incarnation, kind, rank, token, task_id, detail) "
                 "VALUES (?, ?, ?, ?, ?, ?, ?)")
_INSERT_QUARANTINE = ("INSERT INTO quarantine (at, incarnation, channel, reason, rank, token, "
                      "expected, detail) VALUES (:at, :incarnation, :channel, :reason, :rank, "
                      ":token, :expected, :detail)")


@dataclass(frozen=True)
class RetryPolicy:
    """docs/protocol.md §3 R7/R8: immediate requeues, then deferral; a total ceiling holds a task as
    failed.

    `retries`: post-send failures requeued at the head of the queue (0–16, default 1).
    `max_attempts`: failed dispatches after which the task is held as failed (both counts are
    stored, so the budget and the ceiling survive a restart). By default the budget, then
    `DEFERRALS_BEFORE_FAILED` deferrals, then the ceiling: 5 for the default budget.
    """

    retries: int = 1
    max_attempts: int | None = None

    DEFERRALS_BEFORE_FAILED = 3

    def __post_init__(self) -> None:
        if not (type(self.retries) is int and 0 <= self.retries <= 16):
            raise ValueError(f"retries must be an integer in 0..16, not {self.retries!r}")
        if self.max_attempts is None:
            object.__setattr__(self, "max_attempts",
                               self.retries + self.DEFERRALS_BEFORE_FAILED + 1)
        if not (type(self.max_attempts) is int and self.max_attempts >= 1):
            raise ValueError(f"max_attempts must be an integer >= 1, not {self.max_attempts!r}")


class QuarantineSampler:
    """Keeps the quarantine small whatever a rank sends, and its counts exact: the first
    `rows_per_key` messages of each (rank, channel, reason) in an incarnation get a row each;
    each later one adds to the `repeats` of the last of those rows. One per store (its
    incarnation)."""

    def __init__(self, rows_per_key: int = 100):
        self.rows_per_key = rows_per_key
        self._rows: dict[tuple[int, str, str], tuple[int, int]] = {}  # key -> (rows, last id)

    def write(self, db: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
        more: dict[int, int] = {}  # last row id -> messages to add to its repeats
        for row in rows:
            key = (row["rank"], row["channel"], row["reason"])
            n, last = self._rows.get(key, (0, 0))
            if n < self.rows_per_key:
                last = db.execute(_INSERT_QUARANTINE, row).lastrowid
                self._rows[key] = (n + 1, last)
            else:
                more[last] = more.get(last, 0) + 1
        if more:
            db.executemany("UPDATE quarantine SET repeats = repeats + ? WHERE id = ?",
                           [(k, row_id) for row_id, k in more.items()])


class WriteBehind(Protocol):
    """Row changes left pending in a transaction (`Tx.write_behind`)."""

    def write(self, tx: Tx) -> None: ...


@dataclass
class Tx:
    _conn: Connection
    incarnation: int
    now: float
    policy: RetryPolicy
    _events: list[tuple[Any, ...]] = field(default_factory=list)
    _quarantine: list[dict[str, Any]] = field(default_factory=list)
    _db: sqlite3.Connection | None = None
    _behind: WriteBehind | None = None
    sampler: QuarantineSampler | None = None  # None: a row per message

    @property
    def conn(self) -> Connection:
        """The SQLAlchemy connection, with every pending row change written."""
        self.write_pending()
        return self._conn

    def write_behind(self, make: Callable[[], WriteBehind]) -> WriteBehind:
        """The transaction's pending row changes, made by `make` if there are none yet. The
        caller adds to it; `write_pending` (called by `conn`, `db` and `flush`) writes them."""
        if self._behind is None:
            self._behind = make()
        return self._behind

    def write_pending(self) -> None:
        behind, self._behind = self._behind, None
        if behind is not None:
            behind.write(self)

    def event(self, kind: EventKind, *, rank: int | None = None, token: str | None = None,
              task_id: int | None = None, detail: str | None = None, at: float | None = None,
              incarnation: int | None = None) -> None:
        """`at` and `incarnation` default to this transaction's; a `dispatched` event, written
        when its dispatch ends, gives the dispatch's own."""
        self._events.append((self.now if at is None else at,
                             self.incarnation if incarnation is None else incarnation,
                             kind.value, rank, token, task_id, detail))

    def quarantine(self, channel: Channel, reason: QuarantineReason, rank: int, *,
                   token: object = None, expected: str | None = None,
                   detail: str | None = None) -> None:
        # Only a string is stored as the token: a list or a number is what made it malformed.
        shown = token if isinstance(token, str) else None
        if not isinstance(token, str) and token is not None and detail is None:
            detail = f"token of type {type(token).__name__}"
        self._quarantine.append({"at": self.now, "incarnation": self.incarnation,
                                 "channel": channel.value, "reason": reason.value, "rank": rank,
                                 "token": shown[:200] if shown else shown,
                                 "expected": expected,
                                 "detail": detail[:1000] if detail else detail})

    @property
    def db(self) -> sqlite3.Connection:
        """The DBAPI connection under `conn`, inside the same transaction, with every pending
        row change written.

        The per-round statements run here as prepared SQL text: building and caching a Core
        statement costs ten to fifty times what SQLite needs to run it, and the master runs a
        dozen of them per task (docs/performance.md, "What one task costs")."""
        self.write_pending()
        return self.raw_db

    @property
    def raw_db(self) -> sqlite3.Connection:
        """The DBAPI connection without writing the pending row changes first: only for a
        read that accounts for them itself (`dispatches.active_by_rank`)."""
        if self._db is None:
            self._db = self._conn.connection.driver_connection
        return self._db

    def pending(self) -> WriteBehind | None:
        """The pending row changes, if any (for a read that accounts for them itself)."""
        return self._behind

    def flush(self) -> None:
        self.write_pending()
        if self._events:
            self.db.executemany(_INSERT_EVENT, self._events)
            self._events = []
        if self._quarantine:
            if self.sampler is not None:
                self.sampler.write(self.db, self._quarantine)
            else:
                self.db.executemany(_INSERT_QUARANTINE, self._quarantine)
            self._quarantine = []

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """A nested transaction whose journal rows vanish with it if it rolls back."""
        n_events, n_quarantine = len(self._events), len(self._quarantine)
        nested = self.conn.begin_nested()  # (nothing is pending from before it, then)
        try:
            yield
        except BaseException:
            self._behind = None  # row changes made inside it and not yet written vanish too
            nested.rollback()
            del self._events[n_events:], self._quarantine[n_quarantine:]
            raise
        self.write_pending()
        nested.commit()
