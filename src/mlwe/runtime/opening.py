"""Opening an engine on its store: recovered when the store holds state, seeded otherwise.

:func:`open_engine` is what :meth:`mlwe.runtime.engine.Engine.open` does:

1. the store at the database URL (a data directory's SQLite file, or PostgreSQL),
   its schema created when it is empty and checked against the code's revision;
2. the control plane it holds, recovered (records that cannot be loaded are
   quarantined, the rest of the cluster comes back), or one seeded from the
   cluster spec when it holds no nodes (:func:`open_state`);
3. the backend (a Backend, a factory taking the clock, or the live simulator);
4. the engine, its start audited (and the quarantine, if any); a recovered state
   is reconciled with what the backend runs (``Engine.reconcile_backend``) and
   all of it flushed before the engine is returned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from mlwe.core.backend import Backend
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.clock import Clock
from mlwe.core.cluster import build_control_plane
from mlwe.core.controlplane import ControlPlane
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import ClusterSpec
from mlwe.runtime.clock import WallClock
from mlwe.store import db
from mlwe.store.recovery import Quarantined, recover
from mlwe.store.repository import Repository

if TYPE_CHECKING:  # the engine module imports this one
    from mlwe.runtime.engine import Engine, EngineConfig

log = logging.getLogger("mlwe.engine")

#: What ``Engine.open`` takes for a backend besides a Backend: a factory taking the clock.
BackendFactory = Callable[[Clock], Backend]

E = TypeVar("E", bound="Engine")


def open_engine(
    cls: type[E],
    cluster: ClusterSpec | None = None,
    backend: Backend | BackendFactory | None = None,
    *,
    data_dir: str | Path | None = None,
    database_url: str | None = None,
    clock: Clock | None = None,
    catalog: GpuCatalog = DEFAULT_CATALOG,
    config: EngineConfig | None = None,
    scheduler: Scheduler | None = None,
    create_schema: bool = True,
) -> E:
    """An engine of class ``cls`` on its store (see the module docstring and ``Engine.open``)."""
    clock = clock or WallClock()
    url = db.database_url(data_dir, database_url)
    repo, cp, recovered, quarantined = open_state(url, cluster, clock, catalog,
                                                  create_schema=create_schema)
    synced = recovered  # a recovered state is the store's; a seeded one is written first
    be = _backend(backend, clock)
    eng = cls(cp, be, repo, clock=clock, config=config, scheduler=scheduler, synced=synced)
    eng.quarantined = list(quarantined)
    if quarantined:
        log.error(
            "%d stored record(s) could not be loaded and were quarantined (the rest of the"
            " cluster came back); list them with `mlwe quarantine list`: %s",
            len(quarantined), "; ".join(str(q) for q in quarantined[:5]),
        )
    with eng.lock:
        if quarantined:
            eng.writer.note_audit("config", "engine", {
                "event": "quarantine",
                "records": [{"id": q.id, "table": q.table, "key": q.key,
                             "problem": q.problem} for q in quarantined],
            })
        eng.writer.note_audit(
            "config",
            "engine",
            {
                "event": "engine-start",
                "recovered": recovered,
                "backend": getattr(be, "name", type(be).__name__),
                "database": db.backend_name(url),
                "nodes": sum(1 for _ in cp.capacity.nodes()),
                "workloads": len(cp.workloads),
                "version": cp.version,
            },
        )
        if recovered:
            eng.reconcile_backend()
        eng._flush_locked()
    return eng


def _backend(backend: Backend | BackendFactory | None, clock: Clock) -> Backend:
    """The backend ``Engine.open`` was given, made with the clock if it is a factory; the
    live simulator if none was."""
    if backend is None:
        from mlwe.sim.live import LiveSimBackend

        return LiveSimBackend(clock)
    if callable(backend) and not hasattr(backend, "send"):
        return backend(clock)
    return backend  # type: ignore[return-value]


def open_state(
    url: str, cluster: ClusterSpec | None, clock: Clock, catalog: GpuCatalog, *,
    create_schema: bool,
) -> tuple[Repository, ControlPlane, bool, list[Quarantined]]:
    """The store at ``url`` and the control plane it holds (recovered: True), or one
    seeded from ``cluster`` when it holds no nodes; what recovery had to quarantine."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    engine = db.make_engine(url)
    try:
        if create_schema and db.is_empty(engine):
            db.migrate(engine)
        db.check_schema(engine)
        repo = Repository(engine, catalog=catalog)
        quarantined: list[Quarantined] = []
        if repo.load_nodes(catalog, corrupt=[]):
            return repo, recover(repo, clock, catalog, quarantined=quarantined), True, quarantined
        if cluster is None:
            raise ValueError("the store holds no cluster and none was given: pass a cluster spec")
        return repo, build_control_plane(cluster, clock, catalog=catalog), False, quarantined
    except BaseException:
        engine.dispose()
        raise
