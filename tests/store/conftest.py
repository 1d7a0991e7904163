"""Fixtures for the store: a migrated SQLite repository in ``tmp_path``, and the real
PostgreSQL on this machine in a fresh schema per test (dropped afterwards).

PostgreSQL is found at ``$MLWE_TEST_DATABASE_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/test``). When it cannot be
reached, its tests are skipped with the reason, except under ``CI=true``,
where they fail: a CI run must not pass by silently testing less.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import OperationalError

from mlwe.store import db
from mlwe.store.repository import Repository

PG_URL = os.environ.get(
    "MLWE_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
BACKENDS = ["sqlite", "postgres"]

_pg_error: list[str] = []  # memo: the reason PostgreSQL is unavailable, once known
_pg_checked: list[bool] = []


def _pg_admin() -> Engine:
    return create_engine(PG_URL, connect_args={"connect_timeout": 5})


def require_postgres() -> None:
    """Skip (or, under CI=true, fail) the calling test if PostgreSQL is unreachable."""
    if not _pg_checked:
        _pg_checked.append(True)
        admin = _pg_admin()
        try:
            with admin.connect() as c:
                c.exec_driver_sql("SELECT 1")
        except OperationalError as exc:
            _pg_error.append(str(exc.orig).strip().splitlines()[0])
        finally:
            admin.dispose()
    if _pg_error:
        reason = f"PostgreSQL not reachable at {db.redact_url(PG_URL)}: {_pg_error[0]}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: PostgreSQL tests must run)", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def pg_schema() -> Iterator[Callable[[], Engine]]:
    """A factory of engines, each on a fresh, uniquely named (empty) schema; all dropped at the end."""
    require_postgres()
    admin = _pg_admin()
    made: list[tuple[str, Engine]] = []

    def make() -> Engine:
        name = f"mlwe_test_{uuid.uuid4().hex[:12]}"
        with admin.begin() as c:
            c.exec_driver_sql(f'CREATE SCHEMA "{name}"')
        engine = db.make_engine(PG_URL, schema_name=name)
        made.append((name, engine))
        return engine

    yield make
    for name, engine in made:
        engine.dispose()
        with admin.begin() as c:
            c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    admin.dispose()


@pytest.fixture
def sqlite_engine(tmp_path) -> Iterator[Engine]:
    engine = db.make_engine(f"sqlite:///{tmp_path / 'mlwe.db'}")
    yield engine
    engine.dispose()


@pytest.fixture(params=BACKENDS)
def empty_engine(request, tmp_path) -> Engine:
    """An engine on an empty database (no tables), of each backend."""
    if request.param == "sqlite":
        engine = db.make_engine(f"sqlite:///{tmp_path / 'mlwe.db'}")
        request.addfinalizer(engine.dispose)
        return engine
    make = request.getfixturevalue("pg_schema")
    return make()


@pytest.fixture
def engine(empty_engine: Engine) -> Engine:
    """An engine on a database upgraded to the current schema, of each backend."""
    db.migrate(empty_engine)
    return empty_engine


@pytest.fixture
def repo(engine: Engine) -> Repository:
    """A repository on a fresh, migrated database (SQLite and PostgreSQL)."""
    return Repository(engine, retry_attempts=3, retry_base_delay=0.01, health=db.Health())


@pytest.fixture
def sqlite_repo(sqlite_engine: Engine) -> Repository:
    db.migrate(sqlite_engine)
    return Repository(sqlite_engine, health=db.Health())
