"""``mlwe bench store-direct``: durable submission throughput and recovery time of the
store alone, without the runtime engine (through the engine, with its threads and
group commit: ``mlwe bench engine-store``, :mod:`mlwe.runtime.bench`, which also
takes its recovery figures and scratch databases from here).

``submit_per_s``: workloads submitted through the control plane and made
durable (``apply([Submit...])`` then ``StoreWriter.flush()``: one transaction
per batch, fsynced on SQLite), in batches of ``batch`` submissions, as an
engine groups the submissions that arrive while the previous flush runs.
``submit_single_per_s`` is the same with one submission per transaction.

``recovery_s``: ``recover()`` of ``n_recover`` stored workloads (a mix of
running, waiting, preempted and finished ones, with their full histories) into
a new control plane, including the full invariant sweep.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine

from mlwe.core.actions import Submit
from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.clock import ManualClock
from mlwe.core.cluster import build_control_plane
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.resources import Resources
from mlwe.core.spec import ClusterSpec, NodePool, WorkloadSpec
from mlwe.store import db
from mlwe.store import schema as S
from mlwe.store.recovery import attach, recover
from mlwe.store.repository import Repository, canonical_json, mutable_values, transition_row

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
A100 = "A100-80GB"
A100_VRAM = 81920


@contextlib.contextmanager
def scratch_engine(backend: str, url: str | None = None) -> Iterator[Engine]:
    """A migrated, empty store that is deleted afterwards (a temp dir, or a fresh PG schema)."""
    if backend == "sqlite":
        tmp = tempfile.mkdtemp(prefix="mlwe-bench-")
        engine = db.make_engine(url or f"sqlite:///{Path(tmp) / 'mlwe.db'}")
        try:
            db.migrate(engine)
            yield engine
        finally:
            engine.dispose()
            shutil.rmtree(tmp, ignore_errors=True)
        return
    if backend != "postgres":
        raise ValueError(f"unknown backend {backend!r}: sqlite or postgres")
    base = url or os.environ.get(db.ENV_URL) or DEFAULT_POSTGRES_URL
    schema = f"mlwe_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base.replace("postgresql://", "postgresql+psycopg://", 1))
    with admin.begin() as c:
        c.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    engine = db.make_engine(base, schema_name=schema)
    try:
        db.migrate(engine)
        yield engine
    finally:
        engine.dispose()
        with admin.begin() as c:
            c.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


def _cluster(nodes: int) -> ClusterSpec:
    return ClusterSpec(
        pools=(NodePool(prefix="gpu", count=nodes, gpu_model=A100, gpus=8, cpu=64, memory="512Gi"),)
    )


def _template() -> WorkloadSpec:
    return WorkloadSpec.model_validate(
        {
            "id": "tpl",
            "name": "tpl",
            "kind": "fine-tune",
            "priority": "normal",
            "resources": {"gpu": 1, "cpu": 8, "memory": "64Gi"},
            "gpu_models": [A100],
            "estimated_duration": 3600,
            "checkpoint_interval": 600,
            "labels": {"team": "bench"},
        }
    )


def measure_submit(repo: Repository, n: int, batch: int) -> float:
    """Durable submissions per second through the control plane and the store writer."""
    cp = build_control_plane(_cluster(4), ManualClock(0.0))
    writer = attach(repo, cp, sync=True)
    tpl = _template()
    specs = [tpl.model_copy(update={"id": f"s{i}", "name": f"sub-{i}"}) for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        result = cp.apply([Submit(s) for s in specs[i : i + batch]], cause_id=f"req-{i}")
        if not result.accepted:
            raise RuntimeError("; ".join(result.reasons()))
        writer.flush()  # acknowledged only after this returns
    return n / (time.perf_counter() - t0)


def synthetic_workloads(n: int, nodes: int) -> list[Workload]:
    """``n`` consistent workload records: 1-GPU jobs, running on ``nodes`` 8-GPU nodes,
    waiting, preempted (waiting again) or finished, each with its full history."""
    tpl = _template()
    running = min(n // 10, nodes * 8)
    out = []
    for i in range(n):
        spec = tpl.model_copy(
            update={"id": f"w{i}", "name": f"job-{i}", "estimated_duration": 600.0 + i % 5000}
        )
        t = float(i)
        hist = [Transition(t, None, State.PENDING, "submitted", f"req-{i}")]
        w = Workload(id=spec.id or "", spec=spec, seq=i + 1, submit_time=t, deadline=None)
        if i < running:
            node, dev = f"gpu-{i // 8}", i % 8
            w.placement = (
                ReplicaAlloc(node, (dev,), 1000, Resources(1000, A100_VRAM, 8000, 65536)),
            )
            w.attempt, w.started_at, w.run_base_work = 1, t + 2, 0.0
            hist += [
                Transition(t + 1, State.PENDING, State.ADMITTED, "placed"),
                Transition(t + 1, State.ADMITTED, State.STARTING, "start sent to backend"),
                Transition(t + 2, State.STARTING, State.RUNNING, "backend reports running"),
            ]
        elif i % 10 < 3:
            w.progress = 0.0  # waiting
        elif i % 10 == 3:
            hist += [
                Transition(t + 1, State.PENDING, State.ADMITTED, "placed"),
                Transition(t + 1, State.ADMITTED, State.STARTING, "start sent to backend"),
                Transition(t + 2, State.STARTING, State.RUNNING, "backend reports running"),
                Transition(t + 9, State.RUNNING, State.PREEMPTING, "preempted by x (priority)"),
                Transition(t + 10, State.PREEMPTING, State.PREEMPTED, "backend confirmed release"),
            ]
            w.attempt, w.preemptions, w.work_done, w.progress = 1, 1, 6.0, 0.01
        else:
            hist += [
                Transition(t + 1, State.PENDING, State.ADMITTED, "placed"),
                Transition(t + 1, State.ADMITTED, State.STARTING, "start sent to backend"),
                Transition(t + 2, State.STARTING, State.RUNNING, "backend reports running"),
                Transition(t + 50, State.RUNNING, State.SUCCEEDED, "exited 0"),
            ]
            w.attempt, w.progress, w.exit_code = 1, 1.0, 0
        w.history = hist
        w.state = hist[-1].target
        out.append(w)
    return out


def bulk_load(repo: Repository, workloads: list[Workload], version: int = 1) -> None:
    """Write ``workloads`` with their histories the way ``insert_workloads`` does, but through
    the driver's ``executemany`` (no sanitizer, no SQLAlchemy parameter processing): a fast
    way to fill a database for the recovery benchmark. Same rows, same text (a test checks)."""
    wrows: list[dict[str, Any]] = []
    trows: list[dict[str, Any]] = []
    for w in workloads:
        row = {
            "id": w.id,
            "seq": w.seq,
            "spec": canonical_json(w.spec.model_dump(mode="json")),
            "submit_time": w.submit_time,
            "deadline": w.deadline,
            "correlation_id": w.history[0].cause_id if w.history else None,
        }
        row.update(mutable_values(w, version))
        wrows.append(row)
        trows.extend(transition_row(w.id, i, tr) for i, tr in enumerate(w.history))

    def go(c: Connection) -> None:
        for table, rows in ((S.workloads, wrows), (S.transitions, trows)):
            if not rows:
                continue
            compiled = table.insert().compile(dialect=c.dialect, column_keys=list(rows[0]))
            if compiled.positional:
                order = compiled.positiontup or []
                params: list[Any] = [tuple(r[k] for k in order) for r in rows]
            else:
                params = rows
            for i in range(0, len(params), 20_000):
                c.exec_driver_sql(str(compiled), params[i : i + 20_000])

    repo.write(go)


def measure_recovery(repo: Repository, n: int) -> dict[str, float]:
    nodes = max(1, n // 100)
    cluster = _cluster(nodes)
    repo.save_cluster(cluster.all_nodes(), [])
    t0 = time.perf_counter()
    bulk_load(repo, synthetic_workloads(n, nodes))
    load_s = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    cp = recover(repo, ManualClock(float(n + 100)))
    recovery_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if len(cp.workloads) != n:
        raise RuntimeError(f"recovered {len(cp.workloads)} workloads, stored {n}")
    return {
        "recovery_s": recovery_s,
        "recovery_cpu_s": cpu_s,  # this process's CPU time: less sensitive to a busy machine
        "load_data_s": load_s,
        "nodes": float(nodes),
    }


def bench_store(
    backend: str = "sqlite",
    n_submit: int = 5000,
    n_recover: int = 100_000,
    *,
    batch: int = 100,
    n_single: int = 200,
    url: str | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Run the store benchmark on a scratch database; returns (and prints) the figures."""
    out: dict[str, Any] = {"backend": backend, "batch": batch, "n_submit": n_submit}
    with scratch_engine(backend, url) as engine:
        repo = Repository(engine)
        out["sanitizer"] = repo.sanitizing
        out["submit_per_s"] = round(measure_submit(repo, n_submit, batch), 1)
    if n_single:
        with scratch_engine(backend, url) as engine:
            out["submit_single_per_s"] = round(measure_submit(Repository(engine), n_single, 1), 1)
    if n_recover:
        with scratch_engine(backend, url) as engine:
            rec = measure_recovery(Repository(engine), n_recover)
        out["n_recover"] = n_recover
        out["recovery_s"] = round(rec["recovery_s"], 3)
        out["recovery_cpu_s"] = round(rec["recovery_cpu_s"], 3)
        out["load_data_s"] = round(rec["load_data_s"], 3)
    if backend == "sqlite":
        out["sqlite_synchronous"] = (os.environ.get(db.ENV_SQLITE_SYNCHRONOUS) or "FULL").upper()
    if verbose:
        for k, v in out.items():
            print(f"{k}: {v}")
    return out


if __name__ == "__main__":  # pragma: no cover
    import json
    import sys

    print(json.dumps(bench_store(sys.argv[1] if len(sys.argv) > 1 else "sqlite", verbose=False)))
