"""Typed actions: the only way anything asks the control plane for a change.

Policies, the agent, the API, the bus and backend results all become these
values. The control plane verifies each one and applies a batch all-or-nothing.
Backend facts (``Started``, ``Progress``, ``Released``, ``Exited``) carry the
attempt they are about, so a late result from an earlier attempt is
recognised as stale and ignored instead of corrupting the current one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.spec import NodeSpec, NodeStatus, QueueSpec, ReplicaResources, WorkloadSpec


class PreemptReason(enum.StrEnum):
    PRIORITY = "priority"  # the preemptor has strictly higher priority
    RECLAIM = "reclaim"  # the preemptor's queue reclaims nominal quota lent to the victim's
    #: same priority: the policy expects the gain to exceed the cost; the core
    #: enforces the structural bounds (core.rules.gain_violations)
    GAIN = "gain"


@dataclass(frozen=True, slots=True)
class Submit:
    spec: WorkloadSpec
    kind = "submit"


@dataclass(frozen=True, slots=True)
class Place:
    workload: str
    replicas: tuple[ReplicaAlloc, ...]
    kind = "place"


@dataclass(frozen=True, slots=True)
class Start:
    workload: str
    attempt: int
    kind = "start"


@dataclass(frozen=True, slots=True)
class Started:
    workload: str
    attempt: int
    kind = "started"


@dataclass(frozen=True, slots=True)
class Progress:
    workload: str
    attempt: int
    progress: float
    checkpointed: bool = False  # the run saved a checkpoint at this progress
    kind = "progress"


@dataclass(frozen=True, slots=True)
class Preempt:
    victim: str
    preemptor: str
    reason: PreemptReason = PreemptReason.PRIORITY
    kind = "preempt"


@dataclass(frozen=True, slots=True)
class Released:
    """The backend confirms the workload's processes are gone and its resources free."""

    workload: str
    attempt: int
    checkpointed_progress: float | None = None  # progress saved by the final checkpoint
    #: seconds of work the final checkpoint holds, when the backend knows them
    checkpointed_work_s: float | None = None
    kind = "released"


@dataclass(frozen=True, slots=True)
class Exited:
    workload: str
    attempt: int
    exit_code: int
    cause: str = ""  # "oom", "node-lost", "error", "start-failed", ...
    kind = "exited"


@dataclass(frozen=True, slots=True)
class Cancel:
    workload: str
    reason: str = "cancelled by user"
    kind = "cancel"


@dataclass(frozen=True, slots=True)
class Retry:
    workload: str
    kind = "retry"


@dataclass(frozen=True, slots=True)
class AddNode:
    spec: NodeSpec
    kind = "add-node"


@dataclass(frozen=True, slots=True)
class SetNodeStatus:
    node: str
    status: NodeStatus
    reason: str = ""
    kind = "set-node-status"


@dataclass(frozen=True, slots=True)
class SetPriority:
    """Change a workload's effective priority (agent reprioritisation, LAS/SRTF levels)."""

    workload: str
    priority: int
    reason: str = ""
    kind = "set-priority"


@dataclass(frozen=True, slots=True)
class Evict:
    """Stop a workload gracefully and put it back in the queue (no preemptor).

    Used to move work off a node that is failing: the workload checkpoints,
    is released, and is placed again elsewhere. The same guarantees as
    preemption hold (protected, minimum runtime and progress), except when one
    of its nodes is no longer ready: moving it off protects it."""

    workload: str
    reason: str = ""
    kind = "evict"


@dataclass(frozen=True, slots=True)
class SetResources:
    """Change the per-replica request of a workload that waits or has failed
    (e.g. more memory after an out-of-memory kill); a running attempt keeps its
    allocation."""

    workload: str
    resources: ReplicaResources
    reason: str = ""
    kind = "set-resources"


@dataclass(frozen=True, slots=True)
class SetQueue:
    spec: QueueSpec
    kind = "set-queue"


Action = (
    Submit
    | Place
    | Start
    | Started
    | Progress
    | Preempt
    | Released
    | Exited
    | Cancel
    | Retry
    | AddNode
    | SetNodeStatus
    | SetPriority
    | SetQueue
    | Evict
    | SetResources
)

#: Backend facts: stale ones (an older attempt) are acknowledged and ignored.
FACTS = (Started, Progress, Released, Exited)


def subject(action: Action) -> str:
    """The id the action is about (workload, node or queue), for messages."""
    if isinstance(action, Submit):
        return action.spec.id or action.spec.name
    if isinstance(action, Preempt):
        return action.victim
    if isinstance(action, AddNode | SetQueue):
        return action.spec.name
    if isinstance(action, SetNodeStatus):
        return action.node
    return action.workload
