"""The Microsoft Philly trace (2017): jobs and the machines they ran on."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import ClusterSpec, NodeSpec
from mlwe.sim.traces.cluster import (
    ClusterArg,
    _catalog_for,
    _cluster_gpus,
    _cluster_of,
    _gpu_node,
)
from mlwe.sim.traces.model import PHILLY_GPU, Trace, _RawJob, resolve_traces_dir
from mlwe.sim.traces.rows import (
    _choose_cluster,
    _Clamp,
    _finish,
    _gc_paused,
    _non_negative,
    _per_gpu_job,
    _read_rows,
    _Row,
    _RowError,
    _trace_file,
    _validation_message,
    _wall_clock_utc,
    _whole,
)

# ---------------------------------------------------------------- Philly


@_gc_paused()
def load_philly(
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    traces_dir: str | Path | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Microsoft Philly (2017): ``philly/jobs.csv`` and ``philly/machines.csv``.

    Assumes: submit = ``timestamp`` (wall clock, UTC), sorted (the file is
    not) and shifted so the first is t=0; duration = ``duration`` (s);
    ``gpu_time`` is ignored (it is duration x num_gpus). Philly names no GPU
    model: every GPU is PHILLY-GPU (12 GiB, P100/K80 era). Queue
    ``vc-<virtual cluster hash>`` (no quotas), priority 50, kind training,
    no user estimate. Each replica asks 4 cores and 32 GiB per GPU; nodes
    (one per machine, GPU count from the file, 0-GPU machines as CPU nodes)
    offer 4 cores per GPU + 8 and 64 GiB per GPU, so GPUs bind first.
    """
    cat = _catalog_for(catalog)
    root = resolve_traces_dir(traces_dir)
    jobs_label, machines_label = "philly/jobs.csv", "philly/machines.csv"
    clamp = _Clamp()

    raws, skipped = _read_rows(
        _trace_file(root, jobs_label),
        jobs_label,
        ("timestamp", "duration", "num_gpus", "cluster"),
        lambda row: _philly_job(row, clamp),
        skip_bad_rows=skip_bad_rows,
    )
    vcs = {r.queue for r in raws}
    notes = [
        "Philly names no GPU model: every GPU is the generic catalogue model PHILLY-GPU"
        " (12 GiB VRAM, P100/K80 era); jobs ask no VRAM, so the size limits nothing",
        "submit = timestamp (wall clock read as UTC), sorted (jobs.csv is not) and shifted so"
        " the first submit is t=0"
        + (
            f" ({datetime.fromtimestamp(min(r.submit for r in raws), UTC):%Y-%m-%d %H:%M:%S} UTC)"
            if raws
            else ""
        ),
        "Philly has no user estimates: estimated_duration is None (a policy that uses"
        " durations is an oracle)",
        f"queue = vc-<virtual cluster hash> ({len(vcs)} queues, no quotas); priority 50 for"
        " every job; kind training; job_id = philly-<line of jobs.csv>",
        "each replica asks 4 cores and 32 GiB RAM per GPU; nodes offer 4 cores per GPU + 8"
        " and 64 GiB per GPU (at least 64 GiB), so GPUs bind first; gpu_time is ignored",
        "gang rule: a job with more GPUs than the largest node becomes n//g replicas of g GPUs,"
        " g the largest divisor of n not above that node size (16 -> 2x8, 12 -> 2x6,"
        " 24 -> 3x8, 128 -> 16x8 on 8-GPU machines)",
    ]
    def default() -> tuple[ClusterSpec, list[str]]:
        machines, zero = _philly_machines(root, machines_label, cat)
        use = _cluster_of(cat, machines)
        return use, [f"cluster = philly/machines.csv: {len(machines)} machines,"
                     f" {_cluster_gpus(use)} GPUs ({zero} machines with 0 GPUs are CPU-only"
                     " nodes)"]

    use, overridden = _choose_cluster(cluster, cat, PHILLY_GPU.name, notes, default)
    return _finish(
        "philly",
        raws,
        label=jobs_label,
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=skipped,
        limit=limit,
        skip_bad_rows=skip_bad_rows,
        clamp=clamp,
        queues=vcs,
    )


def _philly_job(row: _Row, clamp: _Clamp) -> _RawJob:
    submit = _wall_clock_utc(row.get("timestamp"), "timestamp")
    duration = clamp(_non_negative(row.get("duration"), "duration"))
    gpus = _whole(row.get("num_gpus"), "num_gpus")
    if gpus <= 0:
        raise _RowError(f"num_gpus {gpus} is not positive (Philly jobs use GPUs)")
    vc = row.get("cluster")
    if not vc:
        raise _RowError("cluster (virtual cluster) is missing")
    return _per_gpu_job(f"philly-{row.line}", row.line, submit, duration, gpus,
                        queue=f"vc-{vc}", kind="training")


def _philly_machines(root: Path, label: str, catalog: GpuCatalog) -> tuple[list[NodeSpec], int]:
    def parse(row: _Row) -> NodeSpec:
        name = row.get("machineId")
        if not name:
            raise _RowError("machineId is missing")
        gpus = _whole(row.get("number of GPUs"), "number of GPUs")
        if gpus < 0:
            raise _RowError(f"number of GPUs {gpus} is negative")
        try:
            return _gpu_node(name, PHILLY_GPU.name, gpus, catalog)
        except ValueError as e:
            raise _RowError(_validation_message(e)) from None

    nodes, _ = _read_rows(
        _trace_file(root, label),
        label,
        ("machineId", "number of GPUs"),
        parse,
        skip_bad_rows=False,
    )
    return nodes, sum(1 for n in nodes if n.gpus == 0)
