"""Handlers of the actions on nodes and queues."""

from __future__ import annotations

from mlwe.core.actions import (
    AddNode,
    SetNodeStatus,
    SetQueue,
)
from mlwe.core.capacity import FULL, NodeInfo
from mlwe.core.controlplane.state import (
    PlaneState,
    _Txn,
)
from mlwe.core.resources import Resources
from mlwe.core.spec import NodeSpec, NodeStatus, QueueSpec


class ClusterHandlers(PlaneState):
    """Handlers of the actions on nodes and queues."""

    # ------------------------------------------------------------ nodes/queues
    def _add_node(self, txn: _Txn, a: AddNode) -> list[str]:
        spec = a.spec
        if not isinstance(spec, NodeSpec):
            return ["node spec is not a validated NodeSpec"]
        if spec.name in self.capacity:
            return [f"node {spec.name!r} already exists"]
        if spec.gpu_model and spec.gpu_model not in self.catalog:
            return [f"unknown GPU model {spec.gpu_model!r}"]
        vram = self.catalog[spec.gpu_model].vram_mib if spec.gpu_model else 0
        info = NodeInfo(
            name=spec.name,
            gpu_model=spec.gpu_model,
            gpu_count=spec.gpus,
            vram_per_gpu=vram,
            capacity=Resources(spec.gpus * FULL, spec.gpus * vram, spec.cpu, spec.memory),
            labels=dict(spec.labels),
            order=len(self.on_node),
        )
        self.capacity.add_node(info, spec.status)
        self.on_node[spec.name] = {}
        txn.touched_nodes[spec.name] = None

        def undo() -> None:
            self.capacity.remove_node(spec.name)
            del self.on_node[spec.name]
            self._journal_reset()  # (readers that keep node places read them again)

        txn.undo.append(undo)
        return []

    def _set_node_status(self, txn: _Txn, a: SetNodeStatus) -> list[str]:
        if a.node not in self.capacity:
            return [f"unknown node {a.node!r}"]
        try:
            status = NodeStatus(a.status)
        except ValueError:
            return [f"unknown node status {a.status!r}"]
        old = self.capacity.status(a.node)
        if old is status:
            return []
        self.capacity.set_status(a.node, status)
        txn.undo.append(lambda: self.capacity.set_status(a.node, old))
        txn.touched_nodes[a.node] = None
        return []

    def _set_queue(self, txn: _Txn, a: SetQueue) -> list[str]:
        if not isinstance(a.spec, QueueSpec):
            return ["queue spec is not a validated QueueSpec"]
        old = self.queues.get(a.spec.name)
        self._put_queue(a.spec)

        def undo() -> None:
            if old is None:
                del self.queues[a.spec.name]
            else:
                self.queues[a.spec.name] = old

        txn.undo.append(undo)
        return []
