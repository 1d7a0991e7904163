"""A seeded synthetic trace of the job mix a shared ML cluster sees, on a mixed cluster."""

from __future__ import annotations

import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import ClusterSpec
from mlwe.sim.traces.cluster import (
    ClusterArg,
    _catalog_for,
    _cluster_gpus,
    _cluster_size,
)
from mlwe.sim.traces.model import MIB_PER_GIB, TRACE_CATALOG, Trace, _RawJob
from mlwe.sim.traces.rows import _choose_cluster, _finish, _gc_paused

# ---------------------------------------------------------------- synthetic


SYNTHETIC_MIX: Final[Mapping[str, float]] = MappingProxyType(
    {
        "fine-tune": 0.12,
        "batch-embedding": 0.28,
        "data-processing": 0.12,
        "inference": 0.06,
        "training": 0.08,
        "cpu": 0.34,
    }
)

SYNTHETIC_QUEUES: Final = ("llm", "batch", "data", "serving", "research")


def synthetic_cluster(
    a100: int = 8, h100: int = 4, t4: int = 8, cpu: int = 4, catalog: GpuCatalog = TRACE_CATALOG
) -> ClusterSpec:
    """A heterogeneous cluster: A100-80GB x8 and H100-80GB x8 nodes (96 cores, 1 TiB),
    T4 x4 nodes (32 cores, 256 GiB), high-memory CPU nodes (128 cores, 2 TiB)."""
    pools: list[dict[str, Any]] = []
    for prefix, count, model, gpus, cores, memory in (
        ("a100", a100, "A100-80GB", 8, 96, "1Ti"),
        ("h100", h100, "H100-80GB", 8, 96, "1Ti"),
        ("t4", t4, "T4", 4, 32, "256Gi"),
        ("cpu", cpu, None, 0, 128, "2Ti"),
    ):
        if count < 0:
            raise ValueError(f"synthetic_cluster: {prefix}={count} is negative")
        if count:
            pool: dict[str, Any] = {
                "prefix": prefix,
                "count": count,
                "cpu": cores,
                "memory": memory,
            }
            if model:
                pool |= {"gpu_model": model, "gpus": gpus}
            pools.append(pool)
    if not pools:
        raise ValueError("synthetic_cluster: no nodes")
    return ClusterSpec.model_validate(
        {"pools": pools, "queues": [{"name": q} for q in SYNTHETIC_QUEUES]},
        context={"catalog": catalog},
    )


def _synthetic_job(rng: random.Random, kind: str) -> tuple[dict[str, Any], _RawJob]:
    """(extra spec fields, raw job without id/submit) for one synthetic job."""
    u = rng.uniform
    extra: dict[str, Any] = {}
    deadline_factor: float | None = None
    replicas = 0
    gpu_models: tuple[str, ...] = ()
    if kind == "fine-tune":
        duration = u(3600, 6 * 3600)
        gpus, cpu, mem = 8, 48_000, 512 * MIB_PER_GIB
        gpu_models = ("A100-80GB", "H100-80GB")
        priority: int | str = "urgent" if rng.random() < 0.3 else "high"
        deadline_factor = u(1.2, 2.0)
        extra = {
            "checkpoint_interval": u(900, 1800),
            "checkpoint_cost": 60.0,
            "restart_cost": 120.0,
        }
        queue, spec_kind = "llm", "fine-tune"
    elif kind == "batch-embedding":
        duration = u(600, 3 * 3600)
        gpus = rng.choice((1, 2, 4))
        cpu, mem = 8_000 * gpus, 32 * MIB_PER_GIB * gpus
        priority = rng.choice(("low", "batch"))
        extra = {"checkpoint_interval": u(600, 1200), "checkpoint_cost": 10.0, "restart_cost": 30.0}
        queue, spec_kind = "batch", "batch-embedding"
    elif kind == "data-processing":
        duration = u(600, 2 * 3600)
        gpus, cpu = 0, rng.choice((16, 32, 64)) * 1000
        mem = rng.choice((256, 512, 1024)) * MIB_PER_GIB
        priority = "low"
        queue, spec_kind = "data", "data-processing"
    elif kind == "inference":
        duration = u(6 * 3600, 24 * 3600)
        gpus, cpu, mem = rng.choice((1, 2)), 8_000, 32 * MIB_PER_GIB
        gpu_models = ("T4", "L4")
        priority = "high"
        extra = {"protected": True}
        queue, spec_kind = "serving", "inference"
    elif kind == "training":
        duration = u(2 * 3600, 12 * 3600)
        replicas = rng.choice((2, 3, 4))
        gpus, cpu, mem = 8 * replicas, 48_000 * replicas, 512 * MIB_PER_GIB * replicas
        gpu_models = ("A100-80GB", "H100-80GB")
        priority = "normal"
        extra = {
            "checkpoint_interval": u(1800, 3600),
            "checkpoint_cost": 120.0,
            "restart_cost": 300.0,
        }
        queue, spec_kind = "research", "training"
    else:  # "cpu"
        duration = u(120, 3600)
        gpus, cpu = 0, rng.choice((2, 4, 8)) * 1000
        mem = rng.choice((8, 16, 32)) * MIB_PER_GIB
        priority = rng.choice(("normal", "low"))
        queue, spec_kind = "default", "other"
    estimate = duration * u(0.8, 1.5)
    if deadline_factor is not None:
        extra["_deadline_after"] = estimate * deadline_factor
    raw = _RawJob(
        job_id="",
        line=0,
        submit=0.0,
        duration=duration,
        gpu_milli=gpus * 1000,
        cpu_milli=cpu,
        memory_mib=mem,
        queue=queue,
        priority=priority,
        estimate=estimate,
        gpu_models=gpu_models,
        kind=spec_kind,
        replicas=replicas,
        labels={"mix": kind},
    )
    return extra, raw


@_gc_paused()
def synthetic_trace(
    n_jobs: int = 1000,
    seed: int = 0,
    *,
    rate_per_hour: float = 20.0,
    mix: Mapping[str, float] | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """A seeded synthetic trace of the mission's workload mix (``random.Random(seed)``).

    Poisson arrivals at ``rate_per_hour`` (first at t=0). Mix (``SYNTHETIC_MIX``
    by default, keys as there): LLM fine-tunes (8 GPUs of A100-80GB/H100-80GB,
    priority high or urgent, deadline = submit + estimate x U[1.2, 2.0],
    checkpoints every 15-30 min), batch embedding (1/2/4 GPUs of any model,
    low or batch priority, checkpoints), data processing (CPU-only, 256 GiB-1
    TiB), inference services (1-2 T4/L4, protected, high priority, 6-24 h),
    training gangs (2-4 replicas x 8 GPUs), small CPU-only jobs. Every job
    carries a user estimate = true duration x U[0.8, 1.5] (honest noise).
    ``line`` is the 1-based sequence number.
    """
    if n_jobs < 0:
        raise ValueError(f"n_jobs {n_jobs} is negative")
    if rate_per_hour <= 0:
        raise ValueError(f"rate_per_hour {rate_per_hour} is not positive")
    weights = dict(SYNTHETIC_MIX if mix is None else mix)
    unknown = sorted(set(weights) - set(SYNTHETIC_MIX))
    if unknown:
        raise ValueError(
            f"unknown mix kind(s) {', '.join(unknown)}; known: {', '.join(SYNTHETIC_MIX)}"
        )
    if any(w < 0 for w in weights.values()) or not any(weights.values()):
        raise ValueError("mix weights must be non-negative and not all zero")
    cat = _catalog_for(catalog)
    rng = random.Random(seed)
    kinds = list(weights)
    kind_weights = [weights[k] for k in kinds]
    raws: list[_RawJob] = []
    now = 0.0
    width = max(5, len(str(n_jobs)))
    for i in range(n_jobs):
        if i:
            now += rng.expovariate(rate_per_hour / 3600.0)
        kind = rng.choices(kinds, kind_weights)[0]
        extra, raw = _synthetic_job(rng, kind)
        raw.job_id = f"syn-{i + 1:0{width}d}"
        raw.line = i + 1
        raw.submit = now
        after = extra.pop("_deadline_after", None)
        if after is not None:
            raw.deadline = now + after
        raw.extra = extra
        raws.append(raw)
    notes = [
        f"synthetic trace: {n_jobs} jobs, seed {seed}, Poisson arrivals at {rate_per_hour:g}/h,"
        " mix " + ", ".join(f"{k} {weights[k]:g}" for k in kinds),
        "every job has a user estimate = true duration x U[0.8, 1.5]; fine-tune deadlines ="
        " submit + estimate x U[1.2, 2.0]",
    ]
    def default() -> tuple[ClusterSpec, list[str]]:
        use = synthetic_cluster(catalog=cat)
        return use, [f"cluster = synthetic_cluster(): {_cluster_size(use)} nodes,"
                     f" {_cluster_gpus(use)} GPUs (A100-80GB x8, H100-80GB x8, T4 x4 nodes,"
                     " high-memory CPU nodes)"]

    use, overridden = _choose_cluster(cluster, cat, "A100-80GB", notes, default)
    return _finish(
        "synthetic",
        raws,
        label="synthetic",
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=0,
        limit=None,
        skip_bad_rows=False,
        clamp=None,
        queues=SYNTHETIC_QUEUES,
    )
