"""Any CSV of jobs with the generic columns (see :func:`load_generic_csv`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import ClusterSpec, NodeSpec
from mlwe.sim.traces.cluster import ClusterArg, _catalog_for, _cluster_of, _sized_cluster
from mlwe.sim.traces.model import (
    JOB_CPU_MILLI_PER_GPU,
    JOB_MEMORY_MIB_PER_GPU,
    TRACE_GPU,
    Trace,
    _RawJob,
)
from mlwe.sim.traces.rows import (
    _choose_cluster,
    _Clamp,
    _finish,
    _gc_paused,
    _non_negative,
    _number,
    _read_rows,
    _Row,
    _RowError,
    _sized_on,
)

# ---------------------------------------------------------------- generic CSV


@_gc_paused()
def load_generic_csv(
    path: str | Path,
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Any CSV with columns ``job_id,submit_time,duration,num_gpu`` (seconds).

    Optional columns: ``deadline`` (absolute s, same clock as submit_time,
    must be after it), ``estimated_duration`` (a user estimate, s),
    ``priority`` (an integer or a class name such as high), ``queue``,
    ``gpu_model`` (catalogue names, '|'-separated, empty = any). num_gpu
    may be 0 (CPU-only), a fraction below 1, or whole GPUs. Each job asks 4
    cores and 32 GiB per GPU (CPU-only and fractional jobs: as for one
    GPU). Default cluster: 8-GPU nodes sized like ITP (offered load closest
    to 85%), one group per GPU model named in the trace (TRACE-GPU for jobs
    that name none). Kind other.
    """
    cat = _catalog_for(catalog)
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"trace file {file} does not exist")
    label = str(path)
    clamp = _Clamp()

    raws, skipped = _read_rows(
        file,
        label,
        ("job_id", "submit_time", "duration", "num_gpu"),
        lambda row: _generic_job(row, clamp, cat),
        skip_bad_rows=skip_bad_rows,
    )
    notes = [
        "generic CSV: times in seconds, shifted so the first submit is t=0 (deadlines too);"
        " estimated_duration only where the file gives one",
        "each job asks 4 cores and 32 GiB RAM per GPU (CPU-only and fractional jobs: as one"
        " GPU); nodes offer 4 cores per GPU + 8 and 64 GiB per GPU",
        "gang rule: a job with more GPUs than the largest node becomes n//g replicas of g GPUs,"
        " g the largest divisor of n not above that node size",
    ]
    use, overridden = _choose_cluster(cluster, cat, TRACE_GPU.name, notes,
                                      lambda: _generic_cluster(_sized_on(raws, limit), cat))
    return _finish(
        label,
        raws,
        label=label,
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=skipped,
        limit=limit,
        skip_bad_rows=skip_bad_rows,
        clamp=clamp,
    )


def _generic_cluster(raws: Sequence[_RawJob], catalog: GpuCatalog) -> tuple[ClusterSpec, list[str]]:
    """One group of 8-GPU nodes per model named (first named model per job), sized like ITP."""
    groups: dict[str, list[_RawJob]] = {}
    for r in raws:
        if r.gpu_milli:
            groups.setdefault(r.gpu_models[0] if r.gpu_models else TRACE_GPU.name, []).append(r)
    if not groups:
        groups[TRACE_GPU.name] = list(raws)
    nodes: list[NodeSpec] = []
    notes: list[str] = []
    for model in sorted(groups):
        prefix = re.sub(r"[^A-Za-z0-9._-]", "-", model).lower()
        part, note = _sized_cluster(groups[model], model, catalog, prefix)
        nodes.extend(part.nodes)
        notes.append(f"{model}: {note}")
    return _cluster_of(catalog, nodes), notes


def _generic_job(row: _Row, clamp: _Clamp, cat: GpuCatalog) -> _RawJob:
    job_id = row.get("job_id")
    if not job_id:
        raise _RowError("job_id is missing")
    submit = _non_negative(row.get("submit_time"), "submit_time")
    duration = clamp(_non_negative(row.get("duration"), "duration"))
    gpu_text = row.get("num_gpu")
    gpus = _non_negative(gpu_text, "num_gpu")
    if gpus >= 1 and gpus != int(gpus):
        raise _RowError(f"num_gpu {gpu_text!r}: above 1, GPUs must be whole")
    gpu_milli = round(gpus * 1000)
    if gpus > 0 and gpu_milli == 0:
        raise _RowError(f"num_gpu {gpu_text!r} is below one milli-GPU")
    deadline = None
    if row.get("deadline"):
        deadline = _number(row.get("deadline"), "deadline")
        if deadline <= submit:
            raise _RowError(f"deadline {deadline:g} is not after submit_time {submit:g}")
    estimate = None
    if row.get("estimated_duration"):
        estimate = _number(row.get("estimated_duration"), "estimated_duration")
        if estimate <= 0:
            raise _RowError(f"estimated_duration {estimate:g} is not positive")
    prio_text = row.get("priority")
    priority: int | str = 50
    if prio_text:
        priority = int(prio_text) if prio_text.lstrip("-").isdigit() else prio_text
    models = tuple(m.strip() for m in row.get("gpu_model").split("|") if m.strip())
    unknown = [m for m in models if m not in cat]
    if unknown:
        raise _RowError(
            f"gpu_model {', '.join(unknown)} is not in the GPU catalogue"
            f" (known: {', '.join(cat.names())})"
        )
    if models and not gpu_milli:
        raise _RowError("gpu_model given for a job with num_gpu 0")
    units = max(1000, gpu_milli)
    return _RawJob(
        job_id=job_id,
        line=row.line,
        submit=submit,
        duration=duration,
        gpu_milli=gpu_milli,
        cpu_milli=JOB_CPU_MILLI_PER_GPU * units // 1000,
        memory_mib=JOB_MEMORY_MIB_PER_GPU * units // 1000,
        queue=row.get("queue") or "default",
        priority=priority,
        deadline=deadline,
        estimate=estimate,
        gpu_models=models,
    )
