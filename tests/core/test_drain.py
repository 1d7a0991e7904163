"""Drain plans: preemption among equals staged at the victims' own checkpoints.

A 2-GPU job that would gain from evicting two long 1-GPU jobs finds no moment
at which both are cheap to evict (their checkpoints are not aligned), so the
plain search finds none and names no moment to look again. With ``gain_drain`` the scheduler
plans a drain: each victim is evicted just after its own checkpoint, the node
is held for the preemptor meanwhile (nobody else takes the GPU freed first),
and every step is a Preempt the control plane verifies.
"""

from __future__ import annotations

from dataclasses import replace

from mlwe.core import Exited, Place, Preempt, Released
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.scheduler import Scheduler, default_scheduler
from tests.core.builders import ManualClock, cluster, gpu_job, gpu_node, ok, running_on, submit


def _unaligned() -> tuple[ControlPlane, ManualClock]:
    """Node n0 (2 GPUs): "a" runs since t=0 and "b" since t=900, each on one GPU,
    each expected to run 100,000 s and checkpointing every 1,800 s; at t=1,600 an
    equal 2-GPU job "p" expected to run 600 s arrives. "a" would lose 1,600 s now
    (checkpoint in 200 s), "b" 700 s (checkpoint in 1,100 s)."""
    cp, clock = cluster(gpu_node("n0", gpus=2))
    running_on(cp, gpu_job("a", gpu=1, estimated_duration=100_000, checkpoint_interval=1800), "n0")
    clock.advance(900)
    running_on(cp, gpu_job("b", gpu=1, estimated_duration=100_000, checkpoint_interval=1800), "n0")
    clock.advance(700)
    submit(cp, gpu_job("p", gpu=2, estimated_duration=600))
    return cp, clock


def _drainer() -> Scheduler:
    sched = default_scheduler()
    sched.config = replace(sched.config, gain_drain=True)
    return sched


def _preempts(cp: ControlPlane, sched: Scheduler) -> list[tuple[str, str, str]]:
    plan = sched.plan(cp)
    ok(cp.apply(plan.actions, plan.version, decisions=plan.decisions))
    return [(a.victim, a.preemptor, str(a.reason)) for a in plan.actions if isinstance(a, Preempt)]


def _release(cp: ControlPlane, wid: str) -> None:
    ok(cp.apply([Released(wid, cp.get(wid).attempt)]))


def _to_wake(cp: ControlPlane, clock: ManualClock, sched: Scheduler) -> float:
    wake = sched.next_wakeup(cp)
    assert wake is not None, "the scheduler names no moment to look again"
    clock.advance(wake - cp.now())
    return wake


def test_without_drain_unaligned_victims_are_never_cheap_at_once_and_wake_nobody() -> None:
    cp, clock = _unaligned()
    sched = default_scheduler()
    assert _preempts(cp, sched) == []
    # a is cheap for a while after each of its checkpoints (t=1,800, 3,600, ...), b
    # after each of its own (t=2,700, 4,500, ...): never both, so no moment is named
    assert sched.next_wakeup(cp) is None
    # and none would have found them: at each checkpoint, one is still too costly
    for t in (1800.0, 2700.0, 3600.0, 4500.0):
        clock.advance(t + 1e-6 - cp.now())
        assert _preempts(cp, sched) == []
        assert sched.next_wakeup(cp) is None
    assert cp.get("p").state is State.PENDING


def test_a_drain_evicts_each_victim_at_its_checkpoint_and_holds_the_node() -> None:
    cp, clock = _unaligned()
    sched = _drainer()
    plan = sched.plan(cp)
    drains = [d for d in plan.decisions if d.kind == "drain"]
    assert [d.workload for d in drains] == ["p"] and not plan.actions
    rec = drains[0]
    assert rec.reasons[0].startswith("preemption among equals: expected gain")
    assert rec.extra["gain_gpu_s"] > rec.extra["cost_gpu_s"] >= rec.extra["idle_gpu_s"] > 0
    # idle: a's GPU waits from a's checkpoint (t=1,800) to b's (t=2,700); the cost adds
    # each victim's restore and checkpoint pause (nothing is lost: neither goes now);
    # the gain is each victim's expected time left beyond p's, on its one GPU
    spec = cp.get("a").spec
    assert abs(rec.extra["idle_gpu_s"] - 900) < 1e-3
    assert abs(rec.extra["cost_gpu_s"] - (900 + 2 * (spec.restart_cost + spec.checkpoint_cost))) < 1e-3
    assert abs(rec.extra["gain_gpu_s"] - ((98_400 - 600) + (99_300 - 600))) < 1e-3
    ok(cp.apply(plan.actions, plan.version, decisions=plan.decisions))
    assert "draining n0" in plan.pending["p"]

    assert abs(_to_wake(cp, clock, sched) - 1800) < 1e-3
    assert _preempts(cp, sched) == [("a", "p", "gain")]
    assert cp.get("a").work_at_risk(cp.now()) < 1e-3  # just after its checkpoint
    _release(cp, "a")
    # a lower-priority 1-GPU job may not take the GPU a freed: the node is held for p
    submit(cp, gpu_job("s", gpu=1, priority=40, estimated_duration=60))
    plan = sched.plan(cp)
    assert not [a for a in plan.actions if isinstance(a, Place)]
    ok(cp.apply(plan.actions, plan.version, decisions=plan.decisions))

    assert abs(_to_wake(cp, clock, sched) - 2700) < 1e-3
    assert _preempts(cp, sched) == [("b", "p", "gain")]
    assert cp.get("b").work_at_risk(cp.now()) < 1e-3
    _release(cp, "b")
    plan = sched.plan(cp)
    placed = [a for a in plan.actions if isinstance(a, Place)]
    assert [a.workload for a in placed] == ["p"]
    assert {r.node for r in placed[0].replicas} == {"n0"}
    assert sched._drains == {}


def test_a_drain_whose_victim_ends_is_dropped_and_the_preemptor_placed() -> None:
    cp, clock = _unaligned()
    sched = _drainer()
    plan = sched.plan(cp)
    ok(cp.apply(plan.actions, plan.version, decisions=plan.decisions))
    _to_wake(cp, clock, sched)
    assert _preempts(cp, sched) == [("a", "p", "gain")]
    _release(cp, "a")
    # b finishes before its checkpoint: the plan no longer holds, nothing is evicted
    clock.advance(100)
    ok(cp.apply([Exited("b", cp.get("b").attempt, 0)]))
    plan = sched.plan(cp)
    assert not [a for a in plan.actions if isinstance(a, Preempt)]
    assert [a.workload for a in plan.actions if isinstance(a, Place)] == ["p"]
    assert "p" not in sched._drains
