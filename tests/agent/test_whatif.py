"""What-if before commit: forks never touch the live control plane, and forecasts
tell a better plan from a worse one."""

from __future__ import annotations

from mlwe.agent.model import CandidatePlan, Hazard
from mlwe.agent.whatif import WhatIfConfig, WhatIfForecaster, fork_state, state_digest
from mlwe.core import (
    Cancel,
    ControlPlane,
    Evict,
    ManualClock,
    NodeStatus,
    Preempt,
    ReplicaResources,
    Retry,
    SetNodeStatus,
    SetPriority,
    SetResources,
    State,
)
from tests.core.builders import ok


def plan(*actions: object, pid: str = "p", clears: tuple[str, ...] = ()) -> CandidatePlan:
    return CandidatePlan(pid, "test", ("f",), tuple(actions), "test plan", clears=clears)  # type: ignore[arg-type]


def _count_listener_calls(cp: ControlPlane) -> list[int]:
    calls = [0]
    cp.listeners.append(lambda w, tr: calls.__setitem__(0, calls[0] + 1))
    cp.decision_listeners.append(lambda rec: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_forecasts_leave_the_live_state_untouched(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    before = state_digest(cp)
    calls = _count_listener_calls(cp)
    engine = WhatIfForecaster(cp, config=WhatIfConfig(check_forecast_invariants=True),
                          hazards=lambda: [Hazard("train-0", "waste")])
    good = plan(SetPriority("ft", 51), Preempt("train-0", "ft"), Preempt("train-1", "ft"))
    bad = plan(Preempt("train-0", "ft"), pid="bad")
    for p in (good, bad, plan(Cancel("train-3"), pid="c"), plan(Evict("train-2"), pid="e")):
        engine.what_if(p)
    engine.verify(good.actions)
    assert state_digest(cp) == before
    assert calls[0] == 0  # no transition, no decision record reached the live listeners
    assert cp.validate_state() == []


def test_the_digest_notices_a_change(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    before = state_digest(cp)
    ok(cp.apply([SetPriority("ft", 51)]))
    assert state_digest(cp) != before


def test_a_fork_holds_the_same_state(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, clock = sla
    fork = fork_state(cp, ManualClock(clock.now()))
    assert fork.version == cp.version
    assert fork.validate_state() == []
    for wid, w in cp.workloads.items():
        f = fork.workloads[wid]
        assert (f.state, f.placement, f.priority, f.work_done) == (w.state, w.placement, w.priority, w.work_done)
        assert f is not w and f.history is not w.history
    for node in cp.capacity.node_names():
        assert fork.capacity.free(node) == cp.capacity.free(node)
    # changing the fork changes nothing live
    ok(fork.apply([SetPriority("ft", 70), Cancel("train-0")]))
    assert cp.get("ft").priority == 50 and cp.get("train-0").state is State.RUNNING


def test_a_fork_keeps_each_nodes_status(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, clock = sla
    nodes = cp.capacity.node_names()
    ok(cp.apply([SetNodeStatus(nodes[0], NodeStatus.CORDONED, "maintenance")]))
    fork = fork_state(cp, ManualClock(clock.now()))
    assert [fork.node_status(n) for n in nodes] == [cp.node_status(n) for n in nodes]
    assert fork.node_status(nodes[0]) is NodeStatus.CORDONED
    assert fork.validate_state() == []


def test_a_plan_that_saves_a_deadline_scores_better(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    r = WhatIfForecaster(cp).what_if(
        plan(SetPriority("ft", 51), Preempt("train-0", "ft"), Preempt("train-1", "ft")))
    assert r.plan.verified and r.better
    assert r.nothing.kpis["deadlines_missed"] == 1 and r.plan.kpis["deadlines_missed"] == 0
    assert r.plan.score < r.nothing.score
    assert set(r.plan.terms) == set(r.nothing.terms)  # both futures scored on the same terms


def test_an_unverifiable_plan_is_not_better(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    r = WhatIfForecaster(cp).what_if(plan(Preempt("train-0", "ft")))  # equal priority: illegal
    assert not r.plan.verified and not r.better
    assert any("priority rule" in x for x in r.plan.rejections)


def test_a_pointless_plan_is_not_better(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    r = WhatIfForecaster(cp).what_if(plan(Evict("train-3", "for nothing")))
    assert r.plan.verified and not r.better


def test_hazards_crash_loop_and_its_cure() -> None:
    from tests.core.builders import cluster, cpu_node, job, running_on

    cp, clock = cluster(cpu_node("c0", memory="256Gi"))
    running_on(cp, job("etl", memory="16Gi", estimated_duration="1h", max_retries=2), "c0")
    clock.advance(300)
    from mlwe.core import Exited

    ok(cp.apply([Exited("etl", cp.get("etl").attempt, 137, "oom")]))
    hz = [Hazard("etl", "crash", after_s=300, cause="oom", cleared_by_memory=24 * 1024)]
    engine = WhatIfForecaster(cp, hazards=lambda: hz)
    fix = plan(SetResources("etl", ReplicaResources.model_validate({"cpu": 8, "memory": "32Gi"})), Retry("etl"))
    r = engine.what_if(fix)
    assert r.nothing.kpis["failed"] == 1 and r.plan.kpis["failed"] == 0
    assert r.plan.kpis["completed"] == 1 and r.better
    # not enough memory: the hazard stays, the plan is no better
    weak = plan(SetResources("etl", ReplicaResources.model_validate({"cpu": 8, "memory": "20Gi"})), Retry("etl"),
                pid="weak")
    assert not engine.what_if(weak).better


def test_waste_hazard_makes_stopping_a_useless_run_better(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    engine = WhatIfForecaster(cp, hazards=lambda: [Hazard("train-0", "waste", cause="diverged")])
    r = engine.what_if(plan(Cancel("train-0", "diverged")))
    # the cancelled run holds its GPUs only while it stops (the eviction delay)
    assert r.plan.kpis["wasted_gpu_s"] < 0.01 * r.nothing.kpis["wasted_gpu_s"]
    assert r.better


def test_a_snapshot_forecasts_as_the_live_state_would_and_stays_put(
    sla: tuple[ControlPlane, ManualClock],
) -> None:
    """The agent copies the state under the lock, then forecasts on the copy with no lock:
    the same forecast as on the live state at that version, untouched by later changes."""
    cp, _ = sla
    engine = WhatIfForecaster(cp, hazards=lambda: [Hazard("train-0", "waste")])
    good = plan(SetPriority("ft", 51), Preempt("train-0", "ft"), Preempt("train-1", "ft"))
    live = engine.what_if(good)
    snap = engine.snapshot()
    assert (snap.version, snap.hazards) == (cp.version, (Hazard("train-0", "waste"),))
    digest = state_digest(snap.cp)
    ok(cp.apply([Cancel("train-0")]))  # the live state moves on
    on_copy = engine.at(snap).what_if(good)
    assert on_copy.fork_version == live.fork_version == snap.version < cp.version
    assert on_copy.plan.score == live.plan.score and on_copy.nothing.score == live.nothing.score
    assert on_copy.better is live.better is True
    assert engine.at(snap).verify(good.actions) == ()
    assert engine.verify(good.actions) != ()  # live, train-0 is stopping: no longer a victim
    assert state_digest(snap.cp) == digest  # forecasts fork the copy; the copy stays put
