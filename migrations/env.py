"""Alembic environment: batch mode on SQLite, one transaction per migration, our own engine.

The database path comes from `-x db=PATH` on the command line, or from the connection the
project's own `store.versioning.upgrade` hands in through `config.attributes`.
"""

from __future__ import annotations

import sys

from alembic import context

from store.engine import open_engine
from store.errors import SchemaVersionError, StoreError
from store.lock import campaign_locked
from store.probe import probe
from store.revisions import head, known_revisions
from store.schema import metadata

config = context.config


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things; batch mode copies the table
        transaction_per_migration=True,
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    db = context.get_x_argument(as_dictionary=True).get("db")
    if not db:
        raise SystemExit("usage: alembic -x db=PATH upgrade head")
    try:
        # The checks `coordinator db upgrade` makes, with its words: what is not a campaign
        # (another program's database, a file of another kind, a directory, a damaged file,
        # a stamp no coordinator writes, a second name of the file) is never written, and
        # never under a running master. `stamp` is how an operator repairs a stamp: let be.
        if _command() != "stamp":
            found = probe(db, current=False)
            if found.revision is not None and found.revision not in known_revisions():
                raise SchemaVersionError(db, found.revision, head())
        with campaign_locked(db):
            engine = open_engine(db)
            try:
                with engine.connect() as conn:
                    _configure(conn)
                    with context.begin_transaction():
                        context.run_migrations()
            finally:
                engine.dispose()
    except StoreError as e:
        print(f"coordinator: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _command() -> str | None:
    """The Alembic command being run (`upgrade`, `downgrade`, `stamp`, ...)."""
    cmd = getattr(config.cmd_opts, "cmd", None)
    fn = cmd[0] if isinstance(cmd, tuple) and cmd else None
    return getattr(fn, "__name__", None)


if context.is_offline_mode():
    raise SystemExit("offline (--sql) mode is not supported: run against a database file")
run_migrations_online()
