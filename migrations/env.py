"""Alembic environment: batch mode on SQLite, one transaction per migration, our own engine.

The database path comes from `-x db=PATH` on the command line, or from the connection the
project's own `store.versioning.upgrade` hands in through `config.attributes`.
"""

from __future__ import annotations

from alembic import context

from store.engine import open_engine
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
    engine = open_engine(db)
    with engine.connect() as conn:
        _configure(conn)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) mode is not supported: run against a database file")
run_migrations_online()
