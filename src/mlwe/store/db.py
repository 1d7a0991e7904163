"""Connecting to the database: URLs, engines, schema migrations, retries, health, and
the one transaction helper (:class:`Transactions`) every table of the repository uses.

SQLite (in WAL mode) is the default, in a data directory; PostgreSQL is used
when ``MLWE_DATABASE_URL`` (or an explicit URL) names one. The schema is owned
by the Alembic migrations in ``store/migrations``; :func:`check_schema` refuses
any database whose revision is not the one this code was written for, and says
which command fixes it.

Durability on SQLite: every transaction runs in WAL mode with
``synchronous=FULL``, so a commit returns only after the WAL has been fsynced.
An acknowledged write survives a process crash (SIGKILL) *and* a power loss.
``synchronous=NORMAL`` would survive a process crash but could lose the last
commits on power loss; it is available (``MLWE_SQLITE_SYNCHRONOUS=NORMAL`` or
``make_engine(..., sqlite_synchronous="NORMAL")``) for throwaway data. With
submissions grouped in batches, FULL costs one fsync per batch, which keeps
durable submission well above 1,000 per second.

Transactions on SQLite are started explicitly (the ``sqlite3`` module's
implicit transaction handling is switched off): reads run in a deferred
``BEGIN``; writes through :func:`write_options` in ``BEGIN IMMEDIATE``, which
takes the write lock up front, so a read-then-write transaction never fails
half-way with "database is locked" (``busy_timeout`` makes it wait instead).
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, inspect
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import DBAPIError, OperationalError

from mlwe.core.extras import missing_extra
from mlwe.store import schema

T = TypeVar("T")

#: The packaged Alembic scripts (shipped as package data).
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
DEFAULT_DATA_DIR = Path(".mlwe")
ENV_URL = "MLWE_DATABASE_URL"
ENV_DATA_DIR = "MLWE_DATA_DIR"
ENV_SQLITE_SYNCHRONOUS = "MLWE_SQLITE_SYNCHRONOUS"
SQLITE_BUSY_TIMEOUT_MS = 10_000
UPGRADE_HINT = "run `mlwe db upgrade`"

#: Execution option read by the SQLite ``begin`` hook: "IMMEDIATE" for writes.
_BEGIN_OPTION = "mlwe_sqlite_begin"


class SchemaError(RuntimeError):
    """The database's schema is not the one this version of mlwe works with."""


class StoreUnavailable(RuntimeError):
    """The database could not be reached after every retry."""


# =============================================================== URLs, engines
def database_url(data_dir: Path | str | None = None, url: str | None = None) -> str:
    """The database to use: ``url`` if given, else ``$MLWE_DATABASE_URL``, else SQLite.

    The SQLite default is ``<data_dir or $MLWE_DATA_DIR or ./.mlwe>/mlwe.db``; the
    directory is created if it does not exist.
    """
    if url:
        return url
    env = os.environ.get(ENV_URL, "").strip()
    if env:
        return env
    env_dir = os.environ.get(ENV_DATA_DIR, "").strip()
    if data_dir is not None:
        directory = Path(data_dir)
    else:
        directory = Path(env_dir) if env_dir else DEFAULT_DATA_DIR
    directory.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(directory / 'mlwe.db').resolve()}"


def backend_name(url: str) -> str:
    return make_url(url).get_backend_name()


def redact_url(url: str) -> str:
    """The URL as it may be logged (password hidden)."""
    return make_url(url).render_as_string(hide_password=True)


def make_engine(
    url: str,
    *,
    schema_name: str | None = None,
    sqlite_synchronous: str | None = None,
    connect_timeout_s: int = 10,
    echo: bool = False,
) -> Engine:
    """An engine for ``url`` (SQLite or PostgreSQL), configured for the store.

    ``schema_name`` (PostgreSQL only) puts the store in that schema by setting
    the connection's ``search_path``; tests use it for a fresh schema per run.
    """
    u = make_url(url)
    backend = u.get_backend_name()
    if backend == "sqlite":
        if schema_name:
            raise ValueError("schema_name applies to PostgreSQL only")
        sync = (sqlite_synchronous or os.environ.get(ENV_SQLITE_SYNCHRONOUS) or "FULL").upper()
        if sync not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"unknown SQLite synchronous mode {sync!r}: use FULL or NORMAL")
        if u.database and u.database != ":memory:":
            Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            u, echo=echo, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}
        )
        _configure_sqlite(engine, sync)
        return engine
    if backend == "postgresql":
        if u.drivername == "postgresql":
            u = u.set(drivername="postgresql+psycopg")  # psycopg 3 is the driver we ship
        if u.drivername == "postgresql+psycopg":
            try:  # psycopg is the mlwe[postgres] extra: say so, not just its module name
                import psycopg  # noqa: F401
            except ImportError as exc:
                raise missing_extra("postgres", exc) from exc
        connect_args: dict[str, Any] = {"connect_timeout": connect_timeout_s}
        if schema_name:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema_name):
                raise ValueError(f"invalid schema name {schema_name!r}")
            connect_args["options"] = f"-csearch_path={schema_name}"
        engine = create_engine(u, echo=echo, pool_pre_ping=True, connect_args=connect_args)
        event.listen(engine, "handle_error", _failed_ping_is_a_disconnect)
        return engine
    raise ValueError(
        f"unsupported database {redact_url(url)!r}: use sqlite:///PATH or"
        " postgresql+psycopg://USER@HOST/DB"
    )


def _configure_sqlite(engine: Engine, synchronous: str) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # BEGIN is ours (see the begin hook)
        cur = dbapi_conn.cursor()
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={synchronous}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(_BEGIN_OPTION, "")
        conn.exec_driver_sql(f"BEGIN {mode}".strip())


def write_options() -> dict[str, Any]:
    """Execution options for a connection that will write (``BEGIN IMMEDIATE`` on SQLite)."""
    return {_BEGIN_OPTION: "IMMEDIATE"}


# ================================================================= migrations
def _alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def table_names(engine: Engine) -> set[str]:
    """The tables the database holds now."""
    with engine.connect() as conn:
        return set(inspect(conn).get_table_names())


def is_empty(engine: Engine) -> bool:
    """No mlwe tables and no revision: a database we may create the schema in."""
    names = table_names(engine)
    return not (names & set(schema.metadata.tables)) and "alembic_version" not in names


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrade the database to ``revision`` (the latest by default) with the packaged migrations."""
    cfg = _alembic_config()
    with engine.connect().execution_options(**write_options()) as conn, conn.begin():
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def stamp(engine: Engine, revision: str) -> None:
    """Record ``revision`` as the database's revision without running anything (tests, repairs)."""
    with engine.connect().execution_options(**write_options()) as conn, conn.begin():
        ctx = MigrationContext.configure(conn)
        ctx.stamp(ScriptDirectory.from_config(_alembic_config()), revision)


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at (None: no mlwe schema yet)."""
    with engine.connect() as conn:
        heads = MigrationContext.configure(conn).get_current_heads()
    if len(heads) > 1:
        raise SchemaError(f"database has several schema revisions {sorted(heads)}; repair by hand")
    return heads[0] if heads else None


def check_schema(engine: Engine) -> None:
    """Refuse a database whose schema is not exactly the one this mlwe needs.

    Raises :class:`SchemaError` naming the revision found, the one needed and
    what to run.
    """
    need = schema.SCHEMA_VERSION
    where = engine.url.render_as_string(hide_password=True)
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            where += f" (schema {conn.exec_driver_sql('SELECT current_schema()').scalar()})"
    rev = current_revision(engine)
    if rev == need:
        return
    if rev is None:
        with engine.connect() as conn:
            present = set(inspect(conn).get_table_names()) & set(schema.metadata.tables)
        if present:
            raise SchemaError(
                f"database {where} has mlwe tables ({', '.join(sorted(present)[:4])}, ...) but no"
                f" schema revision; this mlwe needs {need}: back it up, then {UPGRADE_HINT}"
            )
        raise SchemaError(f"database {where} has no mlwe schema: {UPGRADE_HINT}")
    scripts = ScriptDirectory.from_config(_alembic_config())
    try:
        known = scripts.get_revision(rev) is not None
    except Exception:
        known = False
    if not known:
        raise SchemaError(
            f"database {where} is at schema revision {rev!r}, which this mlwe does not know"
            f" (it needs {need}): it was probably written by a newer mlwe; upgrade mlwe, or"
            " point it at another database. Refusing to start."
        )
    raise SchemaError(
        f"database {where} is at revision {rev}, this mlwe needs {need}: {UPGRADE_HINT}"
    )


# ============================================================ retry and health
@dataclass(frozen=True, slots=True)
class HealthReport:
    status: str  # "ok" or "degraded"
    last_error: str | None
    last_error_at: float | None  # wall-clock seconds
    consecutive_failures: int
    failures_total: int
    retries_total: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "consecutive_failures": self.consecutive_failures,
            "failures_total": self.failures_total,
            "retries_total": self.retries_total,
        }


class Health:
    """Whether the database answered the last time it was asked (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_error: str | None = None
        self._last_error_at: float | None = None
        self._consecutive = 0
        self._failures = 0
        self._retries = 0

    def record_success(self) -> None:
        with self._lock:
            self._consecutive = 0

    def record_failure(self, exc: BaseException, retrying: bool) -> None:
        with self._lock:
            self._last_error = _describe(exc)
            self._last_error_at = time.time()
            self._consecutive += 1
            self._failures += 1
            if retrying:
                self._retries += 1

    def report(self) -> HealthReport:
        with self._lock:
            return HealthReport(
                status="degraded" if self._consecutive else "ok",
                last_error=self._last_error,
                last_error_at=self._last_error_at,
                consecutive_failures=self._consecutive,
                failures_total=self._failures,
                retries_total=self._retries,
            )


#: The process-wide health of the store (repositories report into it by default).
HEALTH = Health()


def health() -> dict[str, Any]:
    """``{"status": "ok" | "degraded", "last_error": ..., ...}`` for the process's store."""
    return HEALTH.report().to_dict()


def _failed_ping_is_a_disconnect(ctx: ExceptionContext) -> None:
    """Any error in the pool's pre-ping means the pooled connection is unusable:
    count it as a disconnect, so the pool opens a new connection instead of
    failing the checkout. Seen with psycopg when the server ends a pooled
    connection while it is pinged: the ping's ``SELECT 1`` fails, then setting
    autocommit back in the dialect's ``finally`` raises ``ProgrammingError: can't
    change 'autocommit' now: connection in transaction status ACTIVE``, which
    SQLAlchemy does not know as a disconnect, so the write failed where a
    reconnect was due (tests/store/test_migrations.py)."""
    if ctx.is_pre_ping:
        ctx.is_disconnect = True


def _describe(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(orig or exc).__name__}: {first}"[:500]


_PERMANENT = re.compile(r"no such (table|column)|syntax error|has no column|does not exist", re.I)


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: lost connections, timeouts, a locked SQLite database."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, OperationalError):
        return not _PERMANENT.search(str(exc.orig))
    return False


def with_retry(
    fn: Callable[[], T],
    attempts: int = 5,
    base_delay: float = 0.05,
    *,
    max_delay: float = 2.0,
    health: Health | None = None,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """``fn()``, retried on transient database errors with exponential backoff and jitter.

    Attempt ``k`` (from 0) waits a random time in ``[d/2, d]`` with
    ``d = min(max_delay, base_delay * 2**k)`` before the next try. ``fn`` must
    be a whole transaction (it is re-run from the start). After the last
    attempt the error is raised as :class:`StoreUnavailable`.
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    h = health or HEALTH
    r = rng or random.Random()
    for k in range(attempts):
        try:
            result = fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            last = k == attempts - 1
            h.record_failure(exc, retrying=not last)
            if last:
                raise StoreUnavailable(
                    f"database unavailable after {attempts} attempts: {_describe(exc)}"
                ) from exc
            d = min(max_delay, base_delay * (2**k))
            sleep(d / 2 + r.uniform(0, d / 2))
        else:
            h.record_success()
            return result
    raise AssertionError("unreachable")  # pragma: no cover


# ================================================================ transactions
class Transactions:
    """The one way the repository's tables run a unit of work on ``engine``.

    :meth:`write` runs ``fn(conn)`` in a write transaction (``BEGIN IMMEDIATE`` on
    SQLite), or inside the caller's transaction when it passes one; :meth:`read`
    runs it on a connection of its own. Both re-run ``fn`` whole on transient
    errors (:func:`with_retry`), reporting into ``health``; a caller's own
    transaction (:meth:`transaction`) is never retried here: the caller owns it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        health: Health | None = None,
        attempts: int = 5,
        base_delay: float = 0.05,
    ) -> None:
        self.engine = engine
        self.health = health or HEALTH
        self.attempts = attempts
        self.base_delay = base_delay

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """A write transaction, committed when the block ends (rolled back on an error)."""
        with (
            self.engine.connect().execution_options(**write_options()) as conn,
            conn.begin(),
        ):
            yield conn

    def retry(self, fn: Callable[[], T]) -> T:
        return with_retry(fn, self.attempts, self.base_delay, health=self.health)

    def write(self, fn: Callable[[Connection], T], conn: Connection | None = None) -> T:
        """``fn(conn)`` in ``conn``'s transaction, or in a new one retried whole."""
        if conn is not None:
            return fn(conn)

        def run() -> T:
            with self.transaction() as c:
                return fn(c)

        return self.retry(run)

    def read(self, fn: Callable[[Connection], T]) -> T:
        """``fn(conn)`` on a connection of its own, re-run on transient errors."""

        def run() -> T:
            with self.engine.connect() as c:
                return fn(c)

        return self.retry(run)
