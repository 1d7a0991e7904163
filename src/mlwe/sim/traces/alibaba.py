"""The Alibaba GPU trace (openb, 2023): pods, QoS classes and the nodes they ran on."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import ClusterSpec, NodeSpec
from mlwe.sim.traces.cluster import (
    ClusterArg,
    _catalog_for,
    _cluster_gpus,
    _cluster_of,
    _node,
)
from mlwe.sim.traces.model import TRACE_GPU, Trace, _RawJob, resolve_traces_dir
from mlwe.sim.traces.rows import (
    _choose_cluster,
    _Clamp,
    _finish,
    _gc_paused,
    _non_negative,
    _read_rows,
    _Row,
    _RowError,
    _trace_file,
    _validation_message,
    _whole,
)

#: Alibaba openb model names -> catalogue names.
ALIBABA_MODELS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "P100": "P100",
        "T4": "T4",
        "V100M16": "V100-16GB",
        "V100M32": "V100-32GB",
        "A10": "A10",
        "G2": "G2",
        "G3": "G3",
    }
)

#: Alibaba QoS class -> priority (LS = latency-sensitive services first, BE last).
ALIBABA_QOS_PRIORITY: Final[Mapping[str, int]] = MappingProxyType(
    {
        "LS": 100,
        "Guaranteed": 80,
        "Burstable": 50,
        "BE": 10,
    }
)


# ---------------------------------------------------------------- Alibaba openb


@_gc_paused()
def load_alibaba(
    *,
    limit: int | None = None,
    skip_bad_rows: bool = False,
    traces_dir: str | Path | None = None,
    cluster: ClusterArg = None,
    catalog: GpuCatalog | None = None,
) -> Trace:
    """Alibaba GPU cluster 2023 "openb": ``alibaba-openb/pods.csv`` and ``nodes.csv``.

    Assumes: nodes as in nodes.csv (cpu_milli, memory_mib, gpu, model mapped
    by ALIBABA_MODELS; G2 and G3 are undisclosed models given an assumed
    32 GiB). Pods: submit = creation_time; duration = deletion_time -
    scheduled_time, or deletion_time - creation_time for pods never
    scheduled (Pending) -- every phase is kept, pod_phase goes to labels;
    pods still Running at the end of the trace have a censored duration.
    num_gpu 0 = CPU-only; num_gpu 1 = gpu_milli of one GPU (fractional
    below 1000); num_gpu > 1 = that many whole GPUs. gpu_spec: accepted
    models separated by '|', empty = any. qos -> priority by
    ALIBABA_QOS_PRIORITY; LS pods are kind inference, others other. No user
    estimate, queue default.
    """
    cat = _catalog_for(catalog)
    root = resolve_traces_dir(traces_dir)
    pods_label, nodes_label = "alibaba-openb/pods.csv", "alibaba-openb/nodes.csv"
    clamp = _Clamp()

    rows, skipped = _read_rows(
        _trace_file(root, pods_label),
        pods_label,
        (
            "name",
            "cpu_milli",
            "memory_mib",
            "num_gpu",
            "gpu_milli",
            "qos",
            "creation_time",
            "deletion_time",
        ),
        lambda row: _alibaba_pod(row, clamp),
        skip_bad_rows=skip_bad_rows,
    )
    raws: list[_RawJob] = [r for r, _, _ in rows]
    notes = _alibaba_notes(rows)
    def default() -> tuple[ClusterSpec, list[str]]:
        nodes = _alibaba_nodes(root, nodes_label, cat)
        use = _cluster_of(cat, nodes)
        return use, [f"cluster = alibaba-openb/nodes.csv: {len(nodes)} nodes,"
                     f" {_cluster_gpus(use)} GPUs, cpu and memory as given"]

    use, overridden = _choose_cluster(cluster, cat, TRACE_GPU.name, notes, default)
    return _finish(
        "alibaba",
        raws,
        label=pods_label,
        catalog=cat,
        cluster=use,
        overridden=overridden,
        notes=notes,
        skipped=skipped,
        limit=limit,
        skip_bad_rows=skip_bad_rows,
        clamp=clamp,
    )


def _alibaba_notes(rows: list[tuple[_RawJob, bool, float]]) -> list[str]:
    """The trace's assumptions, and what its pods say (never scheduled, phases, censored)."""
    never = sum(1 for _, scheduled, _ in rows if not scheduled)
    end = max((deleted for _, _, deleted in rows), default=0.0)
    censored = sum(
        1 for r, _, deleted in rows if deleted == end and r.labels.get("pod_phase") == "Running"
    )
    phases = Counter(r.labels.get("pod_phase", "") for r, _, _ in rows)
    return [
        "G2 and G3 are undisclosed Alibaba GPU models: catalogue models G2 and G3 with an"
        " assumed 32 GiB VRAM each (no pod asks VRAM, so only fractional-GPU VRAM shares use it);"
        " V100M16 -> V100-16GB, V100M32 -> V100-32GB, P100/T4/A10 as named",
        "qos -> priority: LS 100, Guaranteed 80, Burstable 50, BE 10; LS pods are kind"
        " inference, the rest other; queue default; no user estimates (estimated_duration None)",
        "num_gpu 1 with gpu_milli < 1000 is a fractional GPU (gpu = gpu_milli milli-GPU);"
        " num_gpu > 1 asks that many whole GPUs; num_gpu 0 pods are CPU-only; gpu_spec"
        " ('|'-separated, empty = any) -> gpu_models",
        "submit = creation_time; duration = deletion_time - scheduled_time, or deletion_time -"
        f" creation_time for the {never} pod(s) never scheduled in the trace (Pending)",
        "every pod_phase is replayed ("
        + ", ".join(f"{k or '?'} {v}" for k, v in sorted(phases.items()))
        + f"); {censored} pod(s) still Running at the trace end ({end:.0f} s) have censored"
        " durations",
    ]


def _alibaba_nodes(root: Path, label: str, catalog: GpuCatalog) -> list[NodeSpec]:
    def parse(row: _Row) -> NodeSpec:
        name = row.get("sn")
        gpus = _whole(row.get("gpu"), "gpu")
        model_text = row.get("model")
        if gpus and model_text not in ALIBABA_MODELS:
            raise _RowError(f"model {model_text!r} is not one of {', '.join(ALIBABA_MODELS)}")
        try:
            return _node(
                name,
                ALIBABA_MODELS.get(model_text),
                gpus,
                _whole(row.get("cpu_milli"), "cpu_milli"),
                _whole(row.get("memory_mib"), "memory_mib"),
                catalog,
            )
        except ValueError as e:
            raise _RowError(_validation_message(e)) from None

    nodes, _ = _read_rows(
        _trace_file(root, label),
        label,
        ("sn", "cpu_milli", "memory_mib", "gpu", "model"),
        parse,
        skip_bad_rows=False,
    )
    return nodes


def _alibaba_pod(row: _Row, clamp: _Clamp) -> tuple[_RawJob, bool, float]:
    """One pod: (the job, whether it was ever scheduled, its deletion time)."""
    name = row.get("name")
    if not name:
        raise _RowError("name is missing")
    cpu = _whole(row.get("cpu_milli"), "cpu_milli")
    mem = _whole(row.get("memory_mib"), "memory_mib")
    num_gpu = _whole(row.get("num_gpu"), "num_gpu")
    gpu_milli = _whole(row.get("gpu_milli"), "gpu_milli")
    for col, v in (
        ("cpu_milli", cpu),
        ("memory_mib", mem),
        ("num_gpu", num_gpu),
        ("gpu_milli", gpu_milli),
    ):
        if v < 0:
            raise _RowError(f"{col} {v} is negative")
    if num_gpu == 0:
        if gpu_milli:
            raise _RowError(f"gpu_milli {gpu_milli} given with num_gpu 0")
        total_gpu = 0
    elif num_gpu == 1:
        if not 0 < gpu_milli <= 1000:
            raise _RowError(f"gpu_milli {gpu_milli} is not in 1..1000 for num_gpu 1")
        total_gpu = gpu_milli
    else:
        total_gpu = num_gpu * 1000
    qos = row.get("qos")
    if qos not in ALIBABA_QOS_PRIORITY:
        raise _RowError(f"qos {qos!r} is not one of {', '.join(ALIBABA_QOS_PRIORITY)}")
    models: list[str] = []
    for part in row.get("gpu_spec").split("|"):
        part = part.strip()
        if not part:
            continue
        if part not in ALIBABA_MODELS:
            raise _RowError(
                f"gpu_spec model {part!r} is not one of {', '.join(ALIBABA_MODELS)}"
            )
        models.append(ALIBABA_MODELS[part])
    if models and not total_gpu:
        raise _RowError("gpu_spec given for a pod that asks no GPU")
    created = _non_negative(row.get("creation_time"), "creation_time")
    deleted = _non_negative(row.get("deletion_time"), "deletion_time")
    sched_text = row.get("scheduled_time")
    start = _non_negative(sched_text, "scheduled_time") if sched_text else created
    if start < created:
        raise _RowError(f"scheduled_time {start:g} is before creation_time {created:g}")
    if deleted < start:
        what = "scheduled_time" if sched_text else "creation_time"
        raise _RowError(f"deletion_time {deleted:g} is before {what} {start:g}")
    phase = row.get("pod_phase")
    raw = _RawJob(
        job_id=name,
        line=row.line,
        submit=created,
        duration=clamp(deleted - start),
        gpu_milli=total_gpu,
        cpu_milli=cpu,
        memory_mib=mem,
        priority=ALIBABA_QOS_PRIORITY[qos],
        gpu_models=tuple(dict.fromkeys(models)),
        kind="inference" if qos == "LS" else "other",
        labels={"qos": qos, "pod_phase": phase} if phase else {"qos": qos},
    )
    return raw, bool(sched_text), deleted
