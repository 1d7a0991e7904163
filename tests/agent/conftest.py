"""Small builders for agent tests: a cluster with running and waiting work."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlwe.core import ControlPlane, ManualClock
from tests.core.builders import A100, cluster, gpu_node, job, running_on, submit


def full_cluster() -> tuple[ControlPlane, ManualClock]:
    """Two 8-GPU nodes full of equal-priority training; an SLA fine-tune waits (deadline 3h)."""
    cp, clock = cluster(gpu_node("g0"), gpu_node("g1"), start=0.0)
    for i, node in enumerate(["g0", "g0", "g1", "g1"]):
        running_on(cp, job(f"train-{i}", gpu=4, models=[A100], estimated_duration="6h",
                           checkpoint_interval="15m", kind="training"), node)
    clock.advance(3600)
    submit(cp, job("ft", gpu=8, models=[A100], estimated_duration="2h", deadline_in="3h",
                   checkpoint_interval="15m", kind="fine-tune"))
    return cp, clock


@pytest.fixture
def sla() -> Iterator[tuple[ControlPlane, ManualClock]]:
    yield full_cluster()
