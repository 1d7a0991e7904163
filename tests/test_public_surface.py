"""The public surface of ``mlwe.core`` is listed and pinned (DESIGN convention 9).

Adding, renaming or removing an exported name is a deliberate act: it changes
this list in the same commit. (Compare httpx ``tests/test_exported_members.py``.)
"""

from __future__ import annotations

import inspect

import pytest

import mlwe.core

PUBLIC_CORE = [
    "Action",
    "AddNode",
    "ApplyResult",
    "Cancel",
    "CapacityIndex",
    "Clock",
    "ClusterSpec",
    "ControlPlane",
    "DEFAULT_CATALOG",
    "DEFAULT_PRIORITY_CLASSES",
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
    "TRANSITIONS",
    "Transition",
    "Workload",
    "WorkloadKind",
    "WorkloadSpec",
    "build_control_plane",
    "deadline_admission",
]


def test_core_all_is_pinned() -> None:
    assert sorted(mlwe.core.__all__) == PUBLIC_CORE


def test_core_all_has_no_duplicates() -> None:
    assert len(set(mlwe.core.__all__)) == len(mlwe.core.__all__)


@pytest.mark.parametrize("name", PUBLIC_CORE)
def test_every_exported_name_imports(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from mlwe.core import {name}", namespace)  # the way a user writes it
    assert namespace[name] is getattr(mlwe.core, name)


def test_nothing_public_leaks_outside_all() -> None:
    """Every public, non-module name in ``mlwe.core`` is in ``__all__``."""
    public = sorted(
        name
        for name, value in vars(mlwe.core).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    )
    assert public == PUBLIC_CORE
