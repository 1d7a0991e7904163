"""Shared helpers for the bus tests: a real SQLite file database and an effects table."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    func,
    select,
    text,
)
from sqlalchemy.exc import OperationalError

from mlwe.bus import Envelope
from mlwe.store import schema

#: The test's own effect: one row per applied event. Deliberately *no* unique
#: constraint on event_id, so a second effect would show up as a second row.
effects_metadata = MetaData()
effects = Table(
    "bus_test_effects",
    effects_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("event_id", String(256), nullable=False),
    Column("n", Integer, nullable=False),
)


def sqlite_engine(path: Path) -> Engine:
    """A file database in WAL mode, with the engine's tables and the effects table."""
    engine = create_engine(f"sqlite:///{path}")

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=10000")
        cur.close()

    create_tables(engine)
    return engine


#: The real PostgreSQL on these machines (trust auth); override with MLWE_TEST_PG_URL.
PG_URL = os.environ.get("MLWE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@contextmanager
def postgres_engine() -> Iterator[Engine]:
    """An engine on a fresh schema of the real PostgreSQL, dropped afterwards."""
    schema_name = f"bus_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema_name}"'))
    except OperationalError as exc:
        admin.dispose()
        service_missing(f"PostgreSQL at {PG_URL}", str(exc.orig))
    engine = create_engine(PG_URL, connect_args={"options": f"-csearch_path={schema_name}"})
    try:
        create_tables(engine)
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema_name}" CASCADE'))
        admin.dispose()


def create_tables(engine: Engine) -> None:
    schema.metadata.create_all(engine)
    effects_metadata.create_all(engine)


def record_effect(env: Envelope, conn: Any) -> None:
    """The cheap handler: one INSERT on the consumer's connection."""
    conn.execute(effects.insert(), {"event_id": env.id, "n": env.payload["n"]})


def effect_counts(engine: Engine) -> tuple[int, int]:
    """(effect rows, distinct event ids among them)."""
    with engine.connect() as conn:
        total = conn.execute(select(func.count()).select_from(effects)).scalar_one()
        distinct = conn.execute(select(func.count(func.distinct(effects.c.event_id)))).scalar_one()
    return int(total), int(distinct)


def processed_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(select(func.count()).select_from(schema.processed_events)).scalar_one()
        )


def service_missing(what: str, reason: str) -> None:
    """Under CI=true a missing service fails the test; elsewhere it skips, saying why."""
    message = f"{what} is not reachable: {reason}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: required)")
    pytest.skip(message)
