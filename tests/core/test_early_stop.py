"""A cycle stops once nothing further can start, and stopping changes no action.

Where nobody may preempt by priority and no gain search is left, the turns of
the rest of the queue can only write why each waits. The cycle stops when no
GPU is free, or when GPUs are free but no ready node has as many whole GPUs
free as any later workload asks for one replica. Each test holds the stop
against the same cycle with the second rule turned off (every turn taken).
"""

from __future__ import annotations

import pytest

from mlwe.core import ControlPlane
from mlwe.core.cycle import Plan
from mlwe.core.policies.ordering import ArrivalOrder
from mlwe.core.scheduler import Scheduler
from tests.core.builders import cluster, gpu_job, gpu_node, running_on, submit


def _scheduler() -> Scheduler:
    """Arrival order (a later small workload stays later), no gain preemption."""
    return Scheduler(ordering=ArrivalOrder(), name="test")


def _two_free_per_node() -> ControlPlane:
    """Two 8-GPU nodes, each with 6 GPUs held: 2 whole GPUs free on each."""
    cp, _ = cluster(gpu_node("n0"), gpu_node("n1"))
    running_on(cp, gpu_job("held0", gpu=6), "n0")
    running_on(cp, gpu_job("held1", gpu=6), "n1")
    return cp


def _full_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the free-GPU rule off: no later workload seems too large for any node."""
    monkeypatch.setattr(Scheduler, "_least_need", lambda self, cycle, rank: 0)


def _actions(plan: Plan) -> list[tuple[str, str]]:
    return [(a.kind, a.workload) for a in plan.actions]


def test_free_gpus_no_node_can_use_stop_the_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    cp = _two_free_per_node()
    submit(cp, *(gpu_job(f"big{i}", gpu=4) for i in range(5)))
    plan = _scheduler().plan(cp)
    assert plan.actions == []
    # the first turn fails to fit, and no later one asks for 2 GPUs or fewer
    assert plan.considered == 1 and plan.stopped_early == 4
    for i in range(5):
        assert plan.pending[f"big{i}"].startswith("no room for 4 x A100-80GB"), plan.pending
    with monkeypatch.context() as m:
        _full_turns(m)
        full = _scheduler().plan(cp)
    assert full.considered == 5 and full.stopped_early == 0
    assert _actions(full) == _actions(plan) == []


def test_a_later_workload_that_fits_keeps_the_cycle_going(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp = _two_free_per_node()
    submit(cp, *(gpu_job(f"big{i}", gpu=4) for i in range(3)))
    submit(cp, gpu_job("small", gpu=2))
    plan = _scheduler().plan(cp)
    assert ("place", "small") in _actions(plan)
    assert plan.stopped_early == 0
    with monkeypatch.context() as m:
        _full_turns(m)
        assert _actions(_scheduler().plan(cp)) == _actions(plan)


def test_a_fractional_ask_keeps_the_cycle_going() -> None:
    """A replica asking for part of a GPU may fit on a partly used one: no stop past it."""
    cp = _two_free_per_node()
    submit(cp, *(gpu_job(f"big{i}", gpu=4) for i in range(3)))
    submit(cp, gpu_job("part", gpu=0.5))  # type: ignore[arg-type]
    plan = _scheduler().plan(cp)
    assert ("place", "part") in _actions(plan)
    assert plan.stopped_early == 0


def test_no_stop_while_someone_may_preempt_by_priority() -> None:
    """A waiting workload above the lowest holder may evict it: every turn is taken."""
    cp = _two_free_per_node()
    submit(cp, gpu_job("big", gpu=4), gpu_job("urgent", gpu=4, priority=90))
    plan = _scheduler().plan(cp)
    assert plan.stopped_early == 0
    assert any(a.kind == "preempt" for a in plan.actions)
