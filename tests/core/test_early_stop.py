"""A cycle stops once nothing further can start, and stopping changes no action.

Where nobody may preempt by priority and no gain search is left, the turns of
the rest of the queue can only write why each waits. The cycle stops when no
GPU is free, or when GPUs are free but no ready node has as many whole GPUs
free as any later workload asks for one replica; once a head is blocked, a
turn whose replica asks for more whole GPUs than any node has free is passed
over the same way. Each test holds the stop against the same cycle with both
rules turned off (every turn taken).
"""

from __future__ import annotations

import pytest

from mlwe.core import ControlPlane
from mlwe.core.actions import Preempt, PreemptReason
from mlwe.core.cycle import Plan
from mlwe.core.lifecycle import State
from mlwe.core.policies.ordering import ArrivalOrder
from mlwe.core.policies.preemption import CheapestVictims
from mlwe.core.scheduler import Scheduler
from tests.core.builders import apply_all, cluster, gpu_job, gpu_node, ok, running_on, submit


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
    """Turn the free-GPU rules off: no later workload seems too large for any node,
    and none is passed over."""
    monkeypatch.setattr(Scheduler, "_first_turn", lambda self, cycle, rank, most: rank)
    monkeypatch.setattr(Scheduler, "_next_turn", lambda self, cycle, rank: rank)


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
    # big0 is the blocked head; big1 and big2 (4 GPUs, 2 free per node) are
    # passed over; small takes its turn and fits
    assert plan.considered == 2 and plan.stopped_early == 2
    assert plan.pending["big1"].startswith("no room for 4 x A100-80GB"), plan.pending
    with monkeypatch.context() as m:
        _full_turns(m)
        full = _scheduler().plan(cp)
    assert full.considered == 4 and full.stopped_early == 0
    assert _actions(full) == _actions(plan)


def test_a_pass_over_keeps_a_reason_a_workload_already_carries() -> None:
    cp = _two_free_per_node()
    submit(cp, *(gpu_job(f"big{i}", gpu=4) for i in range(2)))
    submit(cp, gpu_job("small", gpu=2))
    cp.workloads["big1"].pending_reason = "an earlier reason"
    plan = _scheduler().plan(cp)
    assert plan.considered == 2 and plan.stopped_early == 1
    assert "big1" not in plan.pending  # kept as it was, like the early stop's


def test_a_preemptor_waiting_for_its_victims_is_never_passed_over() -> None:
    """It holds the room its victims free against later turns: "small" would fit in
    the 2 GPUs left on n0 but must keep off them while held0 releases, though the
    waiter asks for more GPUs than any node has free."""
    cp, clock = cluster(gpu_node("n0"), gpu_node("n1"))
    running_on(cp, gpu_job("held0", gpu=6), "n0")
    running_on(cp, gpu_job("held1", gpu=6), "n1")
    clock.advance(3600)  # past held0's minimum quantum
    submit(cp, gpu_job("big0", gpu=4), gpu_job("waiter", gpu=4), gpu_job("small", gpu=2))
    ok(apply_all(cp, [Preempt("held0", "waiter", PreemptReason.GAIN)]))
    assert cp.workloads["held0"].state is State.PREEMPTING
    assert cp.workloads["waiter"].victims == ("held0",)
    plan = _scheduler().plan(cp)
    assert plan.pending["waiter"].startswith("waiting for 1 victim(s) to release")
    # (n1 is reserved for big0, the blocked head: small has nowhere to go)
    assert _actions(plan) == [] and plan.pending["small"].startswith("no room")
    assert plan.considered == 3 and plan.stopped_early == 0


def test_a_fractional_ask_keeps_the_cycle_going() -> None:
    """A replica asking for part of a GPU may fit on a partly used one: no stop past
    it, and no pass-over of it (big1 and big2 are passed over)."""
    cp = _two_free_per_node()
    submit(cp, *(gpu_job(f"big{i}", gpu=4) for i in range(3)))
    submit(cp, gpu_job("part", gpu=0.5))  # type: ignore[arg-type]
    plan = _scheduler().plan(cp)
    assert ("place", "part") in _actions(plan)
    assert plan.considered == 2 and plan.stopped_early == 2


def test_no_stop_while_someone_may_preempt_by_priority() -> None:
    """A waiting workload above the lowest holder may evict it: every turn is taken."""
    cp = _two_free_per_node()
    submit(cp, gpu_job("big", gpu=4), gpu_job("urgent", gpu=4, priority=90))
    plan = _scheduler().plan(cp)
    assert plan.stopped_early == 0
    assert any(a.kind == "preempt" for a in plan.actions)


def test_no_victim_search_where_nobody_may_preempt_by_priority() -> None:
    """Where the cycle may stop early (nobody waiting ranks above the lowest holder,
    no cohort) a search for lower-priority victims cannot find any: none is run."""
    asked: list[str] = []

    class Spy(CheapestVictims):
        def select(self, cp, fork, p, shape, taken, exclude=(), equals=None):  # type: ignore[no-untyped-def]
            asked.append(p.id)
            return super().select(cp, fork, p, shape, taken, exclude, equals)

    cp = _two_free_per_node()
    submit(cp, gpu_job("big", gpu=4), gpu_job("small", gpu=2))
    plan = Scheduler(ordering=ArrivalOrder(), preemption=Spy(), name="test").plan(cp)
    assert _actions(plan) == [("place", "small")]
    assert asked == []
    # one who ranks above a holder is searched for
    submit(cp, gpu_job("urgent", gpu=4, priority=90))
    Scheduler(ordering=ArrivalOrder(), preemption=Spy(), name="test").plan(cp)
    assert "urgent" in asked
