"""``mlwe bench engine-store``: durable submissions through the ENGINE, and recovery time.

(``mlwe bench store`` is its old name, kept as a hidden alias; the store alone,
without the engine, is ``mlwe bench store-direct``: :mod:`mlwe.store.bench`.)

``submit_per_s``: ``Engine.submit`` called by ``clients`` concurrent threads,
one workload per call, each call returning only once its submission is
durable (the engine's group commit lets one flush cover the submissions that
arrived while the previous one ran), as API request handlers would.
``submit_batch_per_s``: one thread, ``batch`` workloads per call.
``recovery_s`` and the rest come from :func:`mlwe.store.bench.bench_store`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mlwe.core.cluster import build_control_plane
from mlwe.runtime.clock import WallClock
from mlwe.runtime.engine import Engine
from mlwe.sim.live import LiveSimBackend
from mlwe.store.bench import _cluster, _template, bench_store, scratch_engine
from mlwe.store.repository import Repository


def measure_engine_submit(repo: Repository, n: int, *, clients: int = 1, batch: int = 1) -> float:
    clock = WallClock()
    cp = build_control_plane(_cluster(4), clock)
    eng = Engine(cp, LiveSimBackend(clock), repo, clock=clock, synced=False)
    tpl = _template()
    specs = [tpl.model_copy(update={"id": f"s{i}", "name": f"sub-{i}"}) for i in range(n)]
    chunks = [specs[i : i + batch] for i in range(0, n, batch)]
    errors: list[str] = []

    def worker(k: int) -> None:
        for chunk in chunks[k::clients]:
            r = eng.submit(chunk, actor="bench")
            if not r.accepted:
                errors.append("; ".join(r.reasons()))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    if repo.count_workloads() != n:
        raise RuntimeError("not every acknowledged submission is stored")
    return n / dt


def bench_engine_store(
    backend: str = "sqlite",
    n_submit: int = 3000,
    n_recover: int = 100_000,
    *,
    clients: int = 8,
    batch: int = 100,
    url: str | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": backend, "clients": clients}
    with scratch_engine(backend, url) as engine:
        out["submit_per_s"] = round(
            measure_engine_submit(Repository(engine), n_submit, clients=clients), 1
        )
    with scratch_engine(backend, url) as engine:
        out["submit_one_client_per_s"] = round(
            measure_engine_submit(Repository(engine), min(n_submit, 500)), 1
        )
    with scratch_engine(backend, url) as engine:
        out["submit_batch_per_s"] = round(
            measure_engine_submit(Repository(engine), n_submit * 3, batch=batch), 1
        )
    out["batch"] = batch
    rest = bench_store(backend, 0, n_recover, n_single=0, url=url, verbose=False)
    for k in ("sanitizer", "n_recover", "recovery_s", "recovery_cpu_s", "load_data_s",
              "sqlite_synchronous"):
        if k in rest:
            out[k] = rest[k]
    if verbose:
        for k, v in out.items():
            print(f"{k}: {v}")
    return out
