"""Building a control plane from a cluster spec (nodes and queues)."""

from __future__ import annotations

from collections.abc import Callable

from mlwe.core.actions import AddNode, SetQueue
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.clock import Clock
from mlwe.core.controlplane import ControlPlane
from mlwe.core.decisions import DecisionRecord
from mlwe.core.spec import ClusterSpec, NodeSpec


def build_control_plane(
    cluster: ClusterSpec,
    clock: Clock,
    *,
    catalog: GpuCatalog = DEFAULT_CATALOG,
    check_invariants: bool = True,
    decision_sink: Callable[[DecisionRecord], None] | None = None,
) -> ControlPlane:
    """A control plane holding ``cluster``'s nodes and queues, every one added through ``apply``."""
    cp = ControlPlane(
        clock, catalog=catalog, check_invariants=check_invariants, decision_sink=decision_sink
    )
    for node in cluster.all_nodes():
        result = cp.apply([AddNode(node)], cause_id="cluster-spec")
        if not result.accepted:
            raise ValueError("; ".join(result.reasons()))
    if cluster.queues:
        result = cp.apply([SetQueue(q) for q in cluster.queues], cause_id="cluster-spec")
        if not result.accepted:
            raise ValueError("; ".join(result.reasons()))
    return cp


def node_spec_of(cp: ControlPlane, name: str) -> NodeSpec:
    """The NodeSpec a node of ``cp`` was added with (as far as the control plane keeps it)."""
    info = cp.capacity.info(name)
    return NodeSpec.model_validate(
        {
            "name": info.name,
            "gpu_model": info.gpu_model,
            "gpus": info.gpu_count,
            "cpu": f"{info.capacity.cpu}m",
            "memory": info.capacity.ram,
            "labels": dict(info.labels),
            "status": cp.node_status(name).value,
        },
        context={"catalog": cp.catalog},
    )
