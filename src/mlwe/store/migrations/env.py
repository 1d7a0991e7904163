"""Alembic environment for the mlwe store.

``mlwe.store.db.migrate`` passes an open connection in
``config.attributes["connection"]``; run by hand (``alembic -c ... upgrade
head``) it connects to ``sqlalchemy.url`` from the config, or to
``$MLWE_DATABASE_URL``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection, create_engine

from mlwe.store.schema import metadata

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER much
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("MLWE_DATABASE_URL")
    if not url:
        raise RuntimeError("no database: set sqlalchemy.url or MLWE_DATABASE_URL")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported; run against a database")
run_migrations_online()
