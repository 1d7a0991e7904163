"""The pure, deterministic core: resources, nodes, workloads, the lifecycle
table, typed actions, verification and invariants, the control plane, and the
scheduling policies. No I/O, no wall clock, no threads, no unseeded randomness.
"""

from mlwe.core.actions import (
    Action,
    AddNode,
    Cancel,
    Evict,
    Exited,
    Place,
    Preempt,
    PreemptReason,
    Progress,
    Released,
    Retry,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    SetResources,
    Start,
    Started,
    Submit,
)
from mlwe.core.capacity import CapacityIndex, NodeInfo, ReplicaAlloc, Shape
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog, GpuModel
from mlwe.core.clock import Clock, ManualClock
from mlwe.core.cluster import build_control_plane
from mlwe.core.controlplane import (
    ApplyResult,
    ControlPlane,
    InvariantViolation,
    Rejection,
)
from mlwe.core.cycle import Plan
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import TRANSITIONS, IllegalTransition, State, Transition
from mlwe.core.model import Queue, Workload
from mlwe.core.policies.deadline import DeadlineStatus, DeadlineVerdict, deadline_admission
from mlwe.core.resources import Resources
from mlwe.core.scheduler import Scheduler, SchedulerConfig
from mlwe.core.spec import (
    DEFAULT_PRIORITY_CLASSES,
    ClusterSpec,
    NodePool,
    NodeSpec,
    NodeStatus,
    QueueSpec,
    ReplicaQuota,
    ReplicaResources,
    WorkloadKind,
    WorkloadSpec,
)

__all__ = [
    "DEFAULT_CATALOG",
    "DEFAULT_PRIORITY_CLASSES",
    "TRANSITIONS",
    "Action",
    "AddNode",
    "ApplyResult",
    "Cancel",
    "CapacityIndex",
    "Clock",
    "ClusterSpec",
    "ControlPlane",
    "DeadlineStatus",
    "DeadlineVerdict",
    "DecisionRecord",
    "Evict",
    "Exited",
    "GpuCatalog",
    "GpuModel",
    "IllegalTransition",
    "InvariantViolation",
    "ManualClock",
    "NodeInfo",
    "NodePool",
    "NodeSpec",
    "NodeStatus",
    "Place",
    "Plan",
    "Preempt",
    "PreemptReason",
    "Progress",
    "Queue",
    "QueueSpec",
    "Rejection",
    "Released",
    "ReplicaAlloc",
    "ReplicaQuota",
    "ReplicaResources",
    "Resources",
    "Retry",
    "Scheduler",
    "SchedulerConfig",
    "SetNodeStatus",
    "SetPriority",
    "SetQueue",
    "SetResources",
    "Shape",
    "Start",
    "Started",
    "State",
    "Submit",
    "Transition",
    "Workload",
    "WorkloadKind",
    "WorkloadSpec",
    "build_control_plane",
    "deadline_admission",
]
