"""The Microsoft ITP traces (clusters 01-05, with deadlines)."""

from __future__ import annotations

from pathlib import Path

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import ClusterSpec
from mlwe.sim.traces.cluster import ClusterArg, _catalog_for, _sized_cluster
from mlwe.sim.traces.model import ITP_GPU, Trace, TraceError, _RawJob, resolve_traces_dir
from mlwe.sim.traces.rows import (
    _choose_cluster,
    _Clamp,
    _finish,
    _gc_paused,
    _non_negative,
    _number,
    _per_gpu_job,
    _read_rows,
    _Row,
    _RowError,
    _sized_on,
    _whole,
)

# ---------------------------------------------------------------- ITP


@_gc_paused()
def load_itp(
    cluster_no: int,
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    traces_dir: str | Path | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Microsoft ITP (2021), ``itp/clusterNN.csv``: jobs with deadlines.

    Assumes: submit = ``submission_time`` (s), deadline = ``deadline``
    (absolute, same clock; both shifted by the same offset, so deadline -
    submit is preserved), duration = ``duration`` (s), ``num_gpu`` whole
    GPUs of the generic model ITP-GPU (32 GiB). No user estimate
    (estimated_duration None), priority 50, queue default, kind training;
    model_name, batch_size and num_iteration go to labels. ITP gives no
    cluster size: the default cluster is the number of 8-GPU nodes whose
    capacity puts offered load (sum(num_gpu*duration) over last submit -
    first submit of the loaded jobs) closest to 85%, at least enough for
    the largest job; the note states the size and the load.
    """
    if not 1 <= cluster_no <= 99:
        raise TraceError(f"ITP cluster number must be 01..99, not {cluster_no}")
    cat = _catalog_for(catalog)
    root = resolve_traces_dir(traces_dir)
    label = f"itp/cluster{cluster_no:02d}.csv"
    path = root / label
    if not path.is_file():
        have = sorted(p.name for p in (root / "itp").glob("cluster*.csv"))
        raise FileNotFoundError(
            f"trace file {path} does not exist (ITP files there: {', '.join(have) or 'none'})"
        )
    clamp = _Clamp()

    raws, skipped = _read_rows(
        path,
        label,
        ("job_id", "submission_time", "deadline", "num_gpu", "duration"),
        lambda row: _itp_job(row, clamp),
        skip_bad_rows=skip_bad_rows,
    )
    notes = [
        "ITP names no GPU model: every GPU is the generic catalogue model ITP-GPU (32 GiB)",
        "deadline = the trace's absolute deadline, shifted with submit times (deadline - submit"
        " preserved; the trace drew it as submit + U[0.5,1.5] x duration)",
        "ITP has no user estimates: estimated_duration is None, deadlines are kept",
        "priority 50 and queue default for every job; kind training; model_name, batch_size and"
        " num_iteration kept as labels",
        "each replica asks 4 cores and 32 GiB RAM per GPU; nodes offer 4 cores per GPU + 8 and"
        " 64 GiB per GPU, so GPUs bind first",
        "gang rule: a job with more GPUs than the largest node becomes n//g replicas of g GPUs,"
        " g the largest divisor of n not above that node size (16 -> 2x8, 64 -> 8x8)",
    ]
    def default() -> tuple[ClusterSpec, list[str]]:
        use, sizing = _sized_cluster(_sized_on(raws, limit), ITP_GPU.name, cat, "itp")
        return use, [sizing]

    use, overridden = _choose_cluster(cluster, cat, ITP_GPU.name, notes, default)
    return _finish(
        f"itp:{cluster_no:02d}",
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


def _itp_job(row: _Row, clamp: _Clamp) -> _RawJob:
    job_id = row.get("job_id")
    if not job_id:
        raise _RowError("job_id is missing")
    submit = _non_negative(row.get("submission_time"), "submission_time")
    deadline = _number(row.get("deadline"), "deadline")
    if deadline <= submit:
        raise _RowError(f"deadline {deadline:g} is not after submission_time {submit:g}")
    duration = clamp(_non_negative(row.get("duration"), "duration"))
    gpus = _whole(row.get("num_gpu"), "num_gpu")
    if gpus <= 0:
        raise _RowError(f"num_gpu {gpus} is not positive (ITP jobs use GPUs)")
    labels = {
        k: row.get(k) for k in ("model_name", "batch_size", "num_iteration") if row.get(k)
    }
    return _per_gpu_job(
        job_id,
        row.line,
        submit,
        duration,
        gpus,
        deadline=deadline,
        kind="training",
        labels=labels,
    )
