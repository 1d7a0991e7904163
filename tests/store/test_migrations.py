"""Schema migrations, the schema check, URLs and engines, retries and health."""

from __future__ import annotations

import random
import tomllib
import uuid
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect
from sqlalchemy.exc import IntegrityError, OperationalError

from mlwe.store import db
from mlwe.store import schema as S
from mlwe.store.repository import Repository
from tests.store.conftest import PG_URL

ROOT = Path(__file__).resolve().parents[2]


# ================================================================= migrations
def test_fresh_database_upgrades_to_head_and_matches_the_schema(empty_engine: Engine) -> None:
    db.migrate(empty_engine)
    db.check_schema(empty_engine)  # does not raise
    assert db.current_revision(empty_engine) == S.SCHEMA_VERSION
    with empty_engine.connect() as c:
        tables = set(inspect(c).get_table_names())
        assert tables == set(S.metadata.tables) | {"alembic_version"}
        # the hand-written migration creates exactly what schema.py describes
        diffs = compare_metadata(
            MigrationContext.configure(c, opts={"compare_type": True}), S.metadata
        )
    assert diffs == []
    db.migrate(empty_engine)  # upgrading again is a no-op
    assert db.current_revision(empty_engine) == S.SCHEMA_VERSION


def test_an_empty_database_is_refused_with_the_command_to_run(empty_engine: Engine) -> None:
    with pytest.raises(db.SchemaError, match=r"has no mlwe schema: run `mlwe db upgrade`"):
        db.check_schema(empty_engine)


def test_a_database_at_an_unknown_revision_is_refused(engine: Engine) -> None:
    with engine.begin() as c:
        c.exec_driver_sql("UPDATE alembic_version SET version_num = '9999_future'")
    with pytest.raises(db.SchemaError) as err:
        db.check_schema(engine)
    msg = str(err.value)
    assert "'9999_future'" in msg and "does not know" in msg and f"needs {S.SCHEMA_VERSION}" in msg
    assert "Refusing to start" in msg


def test_mlwe_tables_without_a_revision_are_refused(engine: Engine) -> None:
    with engine.begin() as c:
        c.exec_driver_sql("DROP TABLE alembic_version")
    with pytest.raises(db.SchemaError, match=r"no schema revision.*run `mlwe db upgrade`"):
        db.check_schema(engine)


def test_an_older_known_revision_is_told_to_upgrade(empty_engine: Engine) -> None:
    db.migrate(empty_engine, "0001")  # a database written by an older mlwe
    with pytest.raises(
        db.SchemaError,
        match=rf"is at revision 0001, this mlwe needs {S.SCHEMA_VERSION}: run `mlwe db upgrade`",
    ):
        db.check_schema(empty_engine)
    db.migrate(empty_engine)  # the upgrade it asks for works and keeps going
    db.check_schema(empty_engine)


def test_repository_open_checks_or_upgrades(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'x' / 'mlwe.db'}"
    with pytest.raises(db.SchemaError, match="run `mlwe db upgrade`"):
        Repository.open(url)
    repo = Repository.open(url, upgrade=True)
    assert repo.max_version() == 0
    repo.close()


def test_migrations_ship_as_package_data() -> None:
    files = {p.relative_to(db.MIGRATIONS_DIR).as_posix() for p in db.MIGRATIONS_DIR.rglob("*")}
    assert {"env.py", "script.py.mako", "versions/0001_initial.py"} <= files
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["mlwe"]
    assert "store/migrations/*" in patterns and "store/migrations/versions/*" in patterns


# ============================================================ URLs and engines
def test_database_url_precedence(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(db.ENV_URL, raising=False)
    data = tmp_path / "data" / "dir"
    assert db.database_url(data) == f"sqlite:///{(data / 'mlwe.db').resolve()}"
    assert data.is_dir()  # created
    monkeypatch.setenv(db.ENV_URL, "postgresql+psycopg://u@h/d")
    assert db.database_url(data) == "postgresql+psycopg://u@h/d"
    assert db.database_url(data, url="sqlite:///x.db") == "sqlite:///x.db"
    monkeypatch.delenv(db.ENV_URL)
    monkeypatch.chdir(tmp_path)
    assert db.database_url() == f"sqlite:///{(tmp_path / '.mlwe' / 'mlwe.db').resolve()}"


def test_sqlite_engine_is_durable_by_default(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(db.ENV_SQLITE_SYNCHRONOUS, raising=False)
    engine = db.make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == db.SQLITE_BUSY_TIMEOUT_MS
    engine.dispose()
    engine = db.make_engine(f"sqlite:///{tmp_path / 'b.db'}", sqlite_synchronous="normal")
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    engine.dispose()
    with pytest.raises(ValueError, match="unknown SQLite synchronous mode 'SOMETIMES'"):
        db.make_engine("sqlite://", sqlite_synchronous="sometimes")


def test_sqlite_transactions_are_real(sqlite_repo: Repository) -> None:
    """DDL and DML roll back together (the sqlite3 module's implicit commits are off)."""
    with pytest.raises(RuntimeError), sqlite_repo.transaction() as c:
        c.exec_driver_sql("CREATE TABLE scratch (x INTEGER)")
        sqlite_repo.meta_set("k", "v", conn=c)
        raise RuntimeError
    with sqlite_repo.engine.connect() as c:
        assert "scratch" not in inspect(c).get_table_names()
    assert sqlite_repo.meta_get("k") is None


def test_unsupported_databases_are_named() -> None:
    with pytest.raises(ValueError, match="unsupported database 'mysql://u:\\*\\*\\*@h/d'"):
        db.make_engine("mysql://u:secret@h/d")


def test_postgres_schema_and_driver(pg_schema) -> None:
    engine = pg_schema()
    with engine.connect() as c:
        assert c.exec_driver_sql("SELECT current_schema()").scalar().startswith("mlwe_test_")
    assert engine.pool._pre_ping  # type: ignore[attr-defined]
    bare = db.make_engine(PG_URL.replace("postgresql+psycopg://", "postgresql://", 1))
    assert bare.dialect.driver == "psycopg"
    bare.dispose()
    with pytest.raises(ValueError, match="invalid schema name"):
        db.make_engine("postgresql://x@h/d", schema_name="bad; drop")


# ============================================================ retry and health
def _locked() -> OperationalError:
    return OperationalError("INSERT ...", {}, Exception("database is locked"))


def test_with_retry_backs_off_exponentially_with_jitter() -> None:
    health = db.Health()
    sleeps: list[float] = []
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise _locked()
        return "ok"

    got = db.with_retry(
        flaky, attempts=5, base_delay=0.1, health=health, sleep=sleeps.append, rng=random.Random(1)
    )
    assert got == "ok" and len(calls) == 4
    for k, s in enumerate(sleeps):  # each wait in [d/2, d], d = 0.1 * 2**k
        assert 0.1 * 2**k / 2 <= s <= 0.1 * 2**k
    assert len(set(sleeps)) == 3
    report = health.report()
    assert report.status == "ok" and report.retries_total == 3
    assert report.last_error == "Exception: database is locked"


def test_with_retry_gives_up_and_reports_degraded() -> None:
    health = db.Health()

    def down() -> None:
        raise _locked()

    with pytest.raises(
        db.StoreUnavailable, match="after 3 attempts: Exception: database is locked"
    ):
        db.with_retry(down, attempts=3, base_delay=0.001, health=health, sleep=lambda s: None)
    r = health.report().to_dict()
    assert r["status"] == "degraded" and r["consecutive_failures"] == 3
    assert "locked" in r["last_error"]
    db.with_retry(lambda: None, health=health)
    assert health.report().status == "ok"


def test_permanent_errors_are_not_retried() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed"))

    with pytest.raises(IntegrityError):
        db.with_retry(broken, attempts=5, sleep=lambda s: None, health=db.Health())
    assert len(calls) == 1
    assert not db.is_transient(OperationalError("x", {}, Exception("no such table: workloads")))
    assert isinstance(db.health(), dict) and db.health()["status"] in ("ok", "degraded")


def test_postgres_connection_dropped_mid_run_loses_nothing(pg_schema) -> None:
    """Kill the repository's server connections between writes: it reconnects and
    every acknowledged write is there."""
    engine = pg_schema()
    db.migrate(engine)
    health = db.Health()
    repo = Repository(engine, health=health, retry_base_delay=0.01)
    tag = f"mlwe-{uuid.uuid4().hex[:8]}"
    written = []
    for i in range(6):
        repo.meta_set(f"k{i}", str(i))
        written.append(f"k{i}")
        with engine.connect() as c:
            c.exec_driver_sql(f"SET application_name = '{tag}'")  # mark one pooled connection
            c.commit()
        with db.make_engine(PG_URL).connect() as admin:
            admin.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE application_name = '{tag}'"
            )
            admin.commit()
    assert [repo.meta_get(k) for k in written] == [str(i) for i in range(6)]
    assert health.report().status == "ok"


def test_postgres_failed_pre_ping_of_any_kind_reconnects(pg_schema, monkeypatch) -> None:
    """A pooled connection whose pre-ping fails with an error SQLAlchemy does not know
    as a disconnect (psycopg's "can't change 'autocommit' now", raised when the server
    ends the connection during the ping: seen under load in the test above) is
    replaced by a new one: the write goes through once, nothing is lost."""
    import psycopg

    engine = pg_schema()
    db.migrate(engine)
    health = db.Health()
    repo = Repository(engine, health=health, retry_base_delay=0.01)
    repo.meta_set("before", "1")  # a connection now waits in the pool, to be pinged
    ping = engine.dialect.do_ping
    pings = []

    def failing_once(conn):  # type: ignore[no-untyped-def]
        pings.append(conn)
        if len(pings) == 1:
            raise psycopg.ProgrammingError(
                "can't change 'autocommit' now: connection in transaction status ACTIVE"
            )
        return ping(conn)

    monkeypatch.setattr(engine.dialect, "do_ping", failing_once)
    repo.meta_set("after", "2")
    assert len(pings) >= 1  # the pooled connection was pinged, and failed
    assert [repo.meta_get("before"), repo.meta_get("after")] == ["1", "2"]
    assert health.report().to_dict()["consecutive_failures"] == 0


def test_postgres_connection_lost_inside_a_transaction_is_retried(pg_schema) -> None:
    """The server drops the connection mid-transaction: the whole unit is retried on a new
    connection, health says degraded meanwhile, and the write is there exactly once."""
    engine = pg_schema()
    db.migrate(engine)
    health = db.Health()
    repo = Repository(engine, health=health, retry_base_delay=0.01)
    admin = db.make_engine(PG_URL)
    attempts: list[str] = []

    def unit(c) -> None:
        attempts.append(health.report().status)
        repo.meta_set("acked", "yes", conn=c)
        if len(attempts) == 1:
            pid = c.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            with admin.connect() as a:
                a.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
                a.commit()
            c.exec_driver_sql("SELECT 1")  # the connection is gone

    repo.write(unit)
    admin.dispose()
    assert attempts == ["ok", "degraded"]  # the retry ran while health reported degraded
    assert repo.meta_get("acked") == "yes"
    report = health.report()
    assert report.status == "ok" and report.retries_total == 1
    assert report.last_error is not None
