"""The engine on the real PostgreSQL: connections dropped by the server mid-run.

The engine's loop runs and a client submits while another thread keeps killing
the engine's server connections: writes are retried on new connections, health
reports the trouble, and every acknowledged submission is in the store
exactly once, with a valid audit chain. (Fails under CI=true without PostgreSQL.)
"""

from __future__ import annotations

import itertools
import threading
import time

from sqlalchemy import event

from mlwe.core.clock import ManualClock
from mlwe.core.cluster import build_control_plane
from mlwe.runtime import Engine, LiveSimBackend, WallClock
from mlwe.store import db
from mlwe.store.recovery import recover
from mlwe.store.repository import Repository
from tests.runtime.test_engine import cluster, job
from tests.store.conftest import PG_URL


def test_postgres_connections_dropped_mid_run_lose_nothing_acknowledged(pg_schema) -> None:
    engine = pg_schema()
    db.migrate(engine)
    pids: set[int] = set()

    @event.listens_for(engine, "connect")
    def _remember(dbapi_conn, _rec) -> None:  # every server connection the engine opens
        pids.add(dbapi_conn.info.backend_pid)

    # Besides the killer's drops (which often hit an idle pooled connection, replaced at
    # its next checkout without a retry), three drops land mid-write for certain: the
    # engine's own connection is terminated (waiting until it is gone) just before one of
    # its INSERTs is sent, so that write fails and must be retried on a new connection.
    admin_sync = db.make_engine(PG_URL)
    inserts = itertools.count(1)
    mid_write: list[int] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _drop_mid_write(conn, _cursor, statement, _params, _context, _many) -> None:
        if statement.startswith("INSERT") and len(mid_write) < 3 and next(inserts) % 25 == 0:
            pid = conn.connection.dbapi_connection.info.backend_pid
            with admin_sync.connect() as a:
                a.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)}, 10000)")
                a.commit()
            mid_write.append(pid)

    health = db.Health()
    repo = Repository(engine, health=health, retry_base_delay=0.01, retry_attempts=20)
    clock = WallClock(speed=20.0)
    eng = Engine(
        build_control_plane(cluster(), clock), LiveSimBackend(clock), repo, clock=clock,
        synced=False,
    )
    eng.start(period_s=0.02)
    stop = threading.Event()
    kills: list[int] = []
    statuses: set[str] = set()

    def killer() -> None:
        admin = db.make_engine(PG_URL)
        try:
            while not stop.is_set():
                time.sleep(0.05)
                with admin.connect() as a:
                    for pid in list(pids):
                        if a.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})").scalar():
                            kills.append(pid)
                    a.commit()
                statuses.add(health.report().status)
        finally:
            admin.dispose()

    t = threading.Thread(target=killer)
    t.start()
    acked: list[str] = []
    try:
        i = 0
        # go on until drops happened mid-run
        while i < 120 or ((len(kills) < 3 or len(mid_write) < 3) and i < 3000):
            i += 1
            wid = f"w{i}"
            r = eng.submit([job(wid, gpu=0, secs=30)], correlation_id=f"req-{i}")
            assert r.accepted, r.reasons()
            acked.append(wid)  # acknowledged: durable from here on
            statuses.add(health.report().status)
    finally:
        stop.set()
        t.join()
        eng.stop()
    admin_sync.dispose()
    assert kills, "the test never dropped a connection"
    assert len(mid_write) == 3, mid_write
    assert health.report().retries_total > 0  # writes really were retried
    eng.close()

    again = Repository(db.make_engine(engine.url.render_as_string(hide_password=False),
                                      schema_name=_schema(engine)))
    cp = recover(again, ManualClock(clock.now()))
    assert set(acked) <= set(cp.workloads)
    for wid in acked:
        assert sum(1 for tr in again.history(wid) if tr.source is None) == 1  # exactly once
    assert cp.validate_state() == []
    from mlwe.store.audit import AuditLog

    assert AuditLog(again.engine).verify().ok
    again.close()


def _schema(engine) -> str:
    opts = engine.dialect.create_connect_args(engine.url)[1].get("options", "")
    if opts:
        return str(opts).split("search_path=")[1]
    with engine.connect() as c:
        return str(c.exec_driver_sql("SELECT current_schema()").scalar())
