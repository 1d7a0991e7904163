"""The cluster grammar of replays: the short forms ``pooled:N`` and ``nodes:NxG[:MODEL]``
(:func:`parse_cluster_spec`), a caller's cluster override checked against the trace's
catalogue, and the cluster a trace without machine rows is given (sized so its
busiest stretch runs near ``ITP_TARGET_LOAD``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from mlwe.core.catalog import GpuCatalog
from mlwe.core.spec import ClusterSpec, NodePool, NodeSpec, QueueSpec
from mlwe.sim.traces.model import (
    ITP_GPUS_PER_NODE,
    ITP_TARGET_LOAD,
    MIB_PER_GIB,
    NODE_CPU_MILLI_EXTRA,
    NODE_CPU_MILLI_PER_GPU,
    NODE_MEMORY_MIB_PER_GPU,
    POOL_GPU,
    TRACE_CATALOG,
    TRACE_GPU,
    _ceil_div,
    _RawJob,
)

_POOLED_LABEL: Final = "mlwe.pooled"
_NODES_FORM = re.compile(r"^nodes:(\d+)x(\d+)(?::(.+))?$")
_POOLED_FORM = re.compile(r"^pooled:(\d+)$")


# ---------------------------------------------------------------- clusters


def _node(
    name: str,
    model: str | None,
    gpus: int,
    cpu_milli: int,
    memory_mib: int,
    catalog: GpuCatalog,
    labels: Mapping[str, str] | None = None,
) -> NodeSpec:
    data: dict[str, Any] = {
        "name": name,
        "gpus": gpus,
        "cpu": f"{cpu_milli}m",
        "memory": memory_mib,
    }
    if gpus:
        data["gpu_model"] = model
    if labels:
        data["labels"] = dict(labels)
    return NodeSpec.model_validate(data, context={"catalog": catalog})


def _gpu_node(name: str, model: str, gpus: int, catalog: GpuCatalog) -> NodeSpec:
    """A node sized so its GPUs bind first: 4 cores per GPU + 8, 64 GiB per GPU (>= 64 GiB)."""
    return _node(
        name,
        model,
        gpus,
        NODE_CPU_MILLI_PER_GPU * gpus + NODE_CPU_MILLI_EXTRA,
        NODE_MEMORY_MIB_PER_GPU * max(1, gpus),
        catalog,
    )


def _max_gpus_per_node(cluster: ClusterSpec) -> int:
    # not cluster.all_nodes(): that rebuilds pool nodes against the default catalogue
    return max(
        [n.gpus for n in cluster.nodes] + [p.gpus for p in cluster.pools],
        default=0,
    )


def _cluster_models(cluster: ClusterSpec) -> set[str]:
    return {n.gpu_model for n in cluster.nodes if n.gpu_model} | {
        p.gpu_model for p in cluster.pools if p.gpu_model
    }


def _cluster_gpus(cluster: ClusterSpec) -> int:
    return sum(n.gpus for n in cluster.nodes) + sum(p.gpus * p.count for p in cluster.pools)


def _cluster_size(cluster: ClusterSpec) -> int:
    return len(cluster.nodes) + sum(p.count for p in cluster.pools)


def _is_pooled(cluster: ClusterSpec) -> bool:
    return any(n.labels.get(_POOLED_LABEL) == "true" for n in cluster.nodes)


def _cluster_of(
    catalog: GpuCatalog,
    nodes: Iterable[NodeSpec] = (),
    pools: Iterable[NodePool] = (),
    queues: Iterable[QueueSpec] = (),
) -> ClusterSpec:
    # validated with the trace catalogue: nested node specs are checked again against it
    return ClusterSpec.model_validate(
        {"nodes": tuple(nodes), "pools": tuple(pools), "queues": tuple(queues)},
        context={"catalog": catalog},
    )


def _with_queues(cluster: ClusterSpec, queues: Iterable[str], catalog: GpuCatalog) -> ClusterSpec:
    """``cluster`` plus an unlimited QueueSpec for each named queue it lacks."""
    have = {q.name for q in cluster.queues}
    extra = [QueueSpec(name=q) for q in sorted(set(queues)) if q not in have and q != "default"]
    if not extra:
        return cluster
    return _cluster_of(catalog, cluster.nodes, cluster.pools, (*cluster.queues, *extra))


def parse_cluster_spec(
    text: str, catalog: GpuCatalog = TRACE_CATALOG, *, default_model: str = TRACE_GPU.name
) -> ClusterSpec:
    """A cluster from a short form.

    ``pooled:N``: one pool of N GPUs with no node boundaries, as several
    published simulators assume. NodeSpec holds at most 64 GPUs, so the pool
    is ceil(N/64) nodes of model POOL-GPU labelled ``mlwe.pooled=true``;
    trace loaders see the label and split every job into 1-GPU replicas, so
    node boundaries never bind. Nodes get 64 cores and 1 TiB per GPU.

    ``nodes:NxG[:MODEL]``: N nodes of G GPUs of MODEL (default
    ``default_model``), 16 cores and 128 GiB per GPU (at least 32 cores and
    256 GiB) so GPUs bind first.

    A YAML cluster file is not accepted here (mlwe.sim reads no YAML): the
    CLI loads those and passes the ClusterSpec.
    """
    form = text.strip()
    m = _POOLED_FORM.match(form)
    if m:
        total = int(m.group(1))
        if total < 1:
            raise ValueError(f"cluster spec {text!r}: a pool needs at least 1 GPU")
        if POOL_GPU.name not in catalog:
            catalog = catalog.extend([POOL_GPU])
        nodes = []
        for i, start in enumerate(range(0, total, 64)):
            gpus = min(64, total - start)
            nodes.append(
                _node(
                    f"pool-{i}",
                    POOL_GPU.name,
                    gpus,
                    64_000 * gpus,
                    1024 * MIB_PER_GIB * gpus,
                    catalog,
                    {_POOLED_LABEL: "true"},
                )
            )
        return _cluster_of(catalog, nodes)
    m = _NODES_FORM.match(form)
    if m:
        count, gpus = int(m.group(1)), int(m.group(2))
        model = m.group(3) or default_model
        if count < 1:
            raise ValueError(f"cluster spec {text!r}: need at least 1 node")
        if not 1 <= gpus <= 64:
            raise ValueError(f"cluster spec {text!r}: GPUs per node must be 1..64, not {gpus}")
        if model not in catalog:
            raise ValueError(
                f"cluster spec {text!r}: unknown GPU model {model!r}; known: {', '.join(catalog.names())}"
            )
        width = len(str(count - 1))
        prefix = re.sub(r"[^A-Za-z0-9._-]", "-", model).lower()
        nodes = [
            _node(
                f"{prefix}-{i:0{width}d}",
                model,
                gpus,
                max(16_000 * gpus, 32_000),
                max(128 * MIB_PER_GIB * gpus, 256 * MIB_PER_GIB),
                catalog,
            )
            for i in range(count)
        ]
        return _cluster_of(catalog, nodes)
    if form.startswith(("pooled", "nodes")):
        raise ValueError(
            f"cluster spec {text!r} is malformed; expected 'pooled:N' or 'nodes:NxG[:MODEL]'"
        )
    if form.endswith((".yaml", ".yml", ".json")) or "/" in form or os.sep in form:
        raise ValueError(
            f"cluster spec {text!r} looks like a file: cluster files are loaded by the CLI"
            " (mlwe.sim reads no YAML); here give 'pooled:N' or 'nodes:NxG[:MODEL]'"
        )
    raise ValueError(f"cluster spec {text!r} is not 'pooled:N' or 'nodes:NxG[:MODEL]'")


ClusterArg = ClusterSpec | str | None


def _override(
    arg: ClusterSpec | str, catalog: GpuCatalog, default_model: str
) -> tuple[ClusterSpec, list[str]]:
    cluster = (
        parse_cluster_spec(arg, catalog, default_model=default_model)
        if isinstance(arg, str)
        else arg
    )
    unknown = sorted(m for m in _cluster_models(cluster) if m not in catalog)
    if unknown:
        raise ValueError(
            f"cluster uses GPU model(s) {', '.join(unknown)} that the trace catalogue lacks;"
            " pass catalog= with them"
        )
    what = f"{arg!r}" if isinstance(arg, str) else "a ClusterSpec"
    note = (
        f"cluster given by the caller ({what}): {_cluster_size(cluster)} nodes,"
        f" {_cluster_gpus(cluster)} GPUs"
    )
    if _is_pooled(cluster):
        note += (
            "; pooled: no node boundaries, every job of n whole GPUs runs as n 1-GPU"
            " replicas (a gang) and GPU model constraints are dropped"
        )
    return cluster, [note]


def _catalog_for(catalog: GpuCatalog | None) -> GpuCatalog:
    if catalog is None:
        return TRACE_CATALOG
    missing = [TRACE_CATALOG[n] for n in TRACE_CATALOG.names() if n not in catalog]
    return catalog.extend(missing) if missing else catalog


def _size_nodes(
    raws: Sequence[_RawJob], gpus_per_node: int, target: float = ITP_TARGET_LOAD
) -> tuple[int, float, float, int]:
    """Nodes so offered load is closest to ``target`` of capacity; (nodes, load GPUs, span, largest)."""
    if not raws:
        return 1, 0.0, 0.0, 0
    submits = [r.submit for r in raws]
    span = max(submits) - min(submits)
    largest = max(r.gpu_milli for r in raws)
    largest_gpus = _ceil_div(largest, 1000)
    n_min = max(1, _ceil_div(largest_gpus, gpus_per_node))
    gpu_seconds = sum(max(r.gpu_milli, 0) / 1000 * r.duration for r in raws)
    if span <= 0:
        return n_min, 0.0, span, largest_gpus
    load = gpu_seconds / span
    ideal = load / (target * gpus_per_node)
    lo, hi = max(n_min, math.floor(ideal)), max(n_min, math.ceil(ideal))

    def miss(n: int) -> float:
        return abs(load / (n * gpus_per_node) - target)

    return (lo if miss(lo) <= miss(hi) else hi), load, span, largest_gpus


def _sized_cluster(
    raws: Sequence[_RawJob], model: str, catalog: GpuCatalog, prefix: str
) -> tuple[ClusterSpec, str]:
    nodes, load, span, largest = _size_nodes(raws, ITP_GPUS_PER_NODE)
    capacity = nodes * ITP_GPUS_PER_NODE
    cluster = _cluster_of(
        catalog,
        (_gpu_node(f"{prefix}-{i:03d}", model, ITP_GPUS_PER_NODE, catalog) for i in range(nodes)),
    )
    if span > 0:
        share = load / capacity
        note = (
            f"cluster size is not in the trace: assumed {nodes} nodes x {ITP_GPUS_PER_NODE}"
            f" {model} = {capacity} GPUs, the count closest to {ITP_TARGET_LOAD:.0%} offered load"
            f" (offered load = sum(num_gpu*duration) / (last submit - first submit)"
            f" = {load:.1f} GPUs over {span:.0f} s, i.e. {share:.1%} of capacity),"
            f" and at least enough nodes for the largest job ({largest} GPUs)"
        )
        if not 0.80 <= share <= 0.90:
            reason = (
                "the largest job needs that many nodes"
                if nodes == max(1, _ceil_div(largest, ITP_GPUS_PER_NODE))
                else f"of {ITP_GPUS_PER_NODE}-GPU node granularity"
            )
            note += f"; load falls outside 80-90% because {reason}"
    else:
        note = (
            f"cluster size is not in the trace: all submits at one instant, so offered load is"
            f" undefined; assumed {nodes} nodes x {ITP_GPUS_PER_NODE} {model}, enough for the"
            f" largest job ({largest} GPUs)"
        )
    return cluster, note
