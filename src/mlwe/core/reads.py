"""What readers may use of the control plane: reads only.

The API's views, its metrics and history, the dashboard's scenarios and the
CLI's local mode read the cluster through ``Engine.reads``, typed as
:class:`ClusterReads`: the control plane itself (nothing is copied), but a type
that has no ``apply``, no capacity mutation and no listener list, so that mypy
keeps every change on the one request path (``Engine.request``). The workloads
handed out are the live records: read them under the engine lock, never write
them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from mlwe.core.capacity import NodeInfo
from mlwe.core.catalog import GpuCatalog
from mlwe.core.model import Queue, Workload
from mlwe.core.resources import Resources
from mlwe.core.spec import NodeStatus


class CapacityReads(Protocol):
    """The read side of :class:`mlwe.core.capacity.CapacityIndex`."""

    def __contains__(self, node: str) -> bool: ...

    def info(self, node: str) -> NodeInfo: ...

    def nodes(self) -> Iterator[NodeInfo]: ...

    def node_names(self) -> list[str]: ...

    def status(self, node: str) -> NodeStatus: ...

    def free(self, node: str) -> Resources: ...

    def free_devices(self, node: str) -> tuple[int, ...]: ...

    def models(self) -> list[str]: ...


class ClusterReads(Protocol):
    """The read side of :class:`mlwe.core.controlplane.ControlPlane`."""

    @property
    def version(self) -> int: ...

    @property
    def workloads(self) -> Mapping[str, Workload]: ...

    @property
    def queued(self) -> Mapping[str, None]: ...

    @property
    def queues(self) -> Mapping[str, Queue]: ...

    @property
    def counters(self) -> Mapping[str, int]: ...

    @property
    def catalog(self) -> GpuCatalog: ...

    @property
    def capacity(self) -> CapacityReads: ...

    def now(self) -> float: ...

    def holders(self, node: str) -> list[Workload]: ...
