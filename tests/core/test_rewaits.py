"""Preemption among equals counts the victim's wait to be placed again.

Under a size-aware order an evicted job goes back behind everything with less
service than it: a long job evicted late may wait days, far longer than the
short job it made room for runs. The gain test takes as the victim's delay the
longer of its preemptor's run and the wait evicted jobs like it had before
they were placed again (``Rewaits``, learned from restarts already seen).
"""

from __future__ import annotations

import math

import pytest

from mlwe.core import ControlPlane, Evict, ManualClock, Released
from mlwe.core.gain import Rewaits, saved_gpu_s, victim_rewait
from mlwe.core.scheduler import SchedulerConfig, default_scheduler
from tests.core.builders import (
    cluster,
    gpu_job,
    gpu_node,
    ok,
    place_on,
    run_to_running,
    running_on,
    submit,
)

#: an 8-GPU job evicted after an hour, its hour checkpointed: its saved service
SAVED = 8 * 3600.0
#: the default's configuration with the victims' re-waits counted (mlwe-rewait's)
ON = SchedulerConfig(gain_preemption=True, gain_rewait_quantile=0.9)


def _evicted() -> tuple[ControlPlane, ManualClock]:
    """A long 8-GPU job evicted after an hour of work (all of it checkpointed),
    back in the queue."""
    cp, clock = cluster(gpu_node("n0"))
    running_on(cp, gpu_job("long", estimated_duration=100_000, checkpoint_interval=1800), "n0")
    clock.advance(3600)
    ok(cp.apply([Evict("long", "moved by the operator")]))
    ok(cp.apply([Released("long", cp.get("long").attempt, checkpointed_work_s=3600.0)]))
    return cp, clock


def test_a_wait_is_learned_once_the_evicted_workload_is_placed_again() -> None:
    cp, clock = _evicted()
    rewaits = Rewaits()
    rewaits.observe(cp.get("long"))
    assert rewaits.waits(50, SAVED) == [], "still waiting: nothing known of its wait yet"
    clock.advance(5000)
    ok(cp.apply([place_on(cp, "long", "n0")]))
    rewaits.observe(cp.get("long"))
    assert rewaits.waits(50, SAVED) == [5000.0]
    run_to_running(cp, ["long"])
    rewaits.observe(cp.get("long"))  # seen again, running now: learned once
    assert rewaits.waits(50, SAVED) == [5000.0]
    # kept by priority and by saved service in powers of two of GPU-seconds
    assert rewaits.waits(60, SAVED) == []
    assert rewaits.waits(50, 4 * SAVED) == []
    assert rewaits.waits(50, SAVED * 0.8) == [5000.0]  # (both 2^14 to 2^15)


def test_a_workload_never_evicted_teaches_nothing() -> None:
    cp, _ = cluster(gpu_node("n0"))
    running_on(cp, gpu_job("a"), "n0")
    rewaits = Rewaits()
    rewaits.observe(cp.get("a"))
    assert all(not rewaits.waits(50, 2.0**k) for k in range(63))


def test_hostile_figures_keep_their_class_and_no_wait_that_is_not_a_number_is_learned() -> None:
    assert Rewaits.service_class(math.nan) == 0
    assert Rewaits.service_class(-5.0) == 0
    assert Rewaits.service_class(math.inf) == 62
    assert Rewaits.service_class(1e300) == 62
    assert Rewaits.service_class(0.0) == 0 and Rewaits.service_class(1.0) == 1
    r = Rewaits()
    for wait in (math.nan, math.inf, -math.inf):
        r.record(50, 100.0, wait)
    assert r.waits(50, 100.0) == []
    r.record(50, 100.0, -3.0)
    assert r.waits(50, 100.0) == [0.0]


def test_each_class_keeps_its_latest_waits_and_reads_a_quantile() -> None:
    r = Rewaits()
    for i in range(Rewaits.KEEP + 10):
        r.record(50, 100.0, float(Rewaits.KEEP + 10 - i))  # falling: the oldest are the longest
    kept = r.waits(50, 100.0)
    assert len(kept) == Rewaits.KEEP and max(kept) == float(Rewaits.KEEP)
    r = Rewaits()
    for i in range(1, 11):
        r.record(50, 100.0, float(i))
    assert r.expect(50, 100.0, 0.9, 3) == 10.0
    assert r.expect(50, 100.0, 0.5, 3) == 6.0
    assert r.expect(50, 100.0, 1.0, 3) == 10.0
    assert r.expect(50, 100.0, 0.9, 11) == 0.0, "too few waits: none counted"
    assert r.expect(50, 1e6, 0.9, 1) == 0.0, "another class"


def _long_holder_and_short_waiter() -> tuple[ControlPlane, ManualClock]:
    """One 8-GPU node held for an hour by an equal expected to run ~27 h more
    (no checkpoints: evicting it loses its hour); a 10-minute 8-GPU job waits."""
    cp, clock = cluster(gpu_node("n0"))
    running_on(cp, gpu_job("long", estimated_duration=100_000), "n0")
    clock.advance(3600)
    submit(cp, gpu_job("short", estimated_duration=600))
    return cp, clock


def _preempts(cp: ControlPlane, wait: float | None, cfg: SchedulerConfig = ON
              ) -> tuple[bool, tuple[str, ...]]:
    """Whether the default scheduler with ``cfg`` evicts "long" for "short" when
    evicted jobs like it have waited ``wait`` seconds to be placed again (None:
    nothing learned), and the reasons of its preemption record."""
    sched = default_scheduler()
    sched.config = cfg
    if wait is not None:
        for _ in range(3):
            sched.rewaits.record(50, saved_gpu_s(cp.get("long"), cp.now()), wait)
    plan = sched.plan(cp)
    evicts = [a for a in plan.actions if a.kind == "preempt"]
    reasons = next((d.reasons for d in plan.decisions if d.kind == "preempt"), ())
    return bool(evicts), reasons


def test_a_victim_that_would_wait_longer_than_it_gains_is_not_evicted() -> None:
    cp, _ = _long_holder_and_short_waiter()
    assert _preempts(cp, None)[0], "nothing learned: the victim is taken to resume in 10 min"
    assert _preempts(cp, 50_000.0)[0], "27 h left > 14 h re-wait + the hour it loses"
    assert not _preempts(cp, 200_000.0)[0], "a 56 h re-wait outweighs 27 h left"
    assert not _preempts(cp, 95_000.0)[0], "27 h left < 26 h re-wait + the hour it loses"
    # the quantile off (the default's): what evicted jobs waited is not counted
    assert _preempts(cp, 200_000.0, default_scheduler().config)[0]


def test_the_preemption_record_names_the_re_wait_and_gains_only_what_is_left() -> None:
    cp, _ = _long_holder_and_short_waiter()
    evicted, reasons = _preempts(cp, 50_000.0)
    assert evicted
    why = reasons[0]
    assert "expected re-wait" in why and "long 13h53m" in why, why
    # 8 GPUs x (96,400 s left - 50,000 s re-wait) = 103.11 GPU-h
    left = 100_000.0 - 3600.0
    assert f"expected gain {8 * (left - 50_000.0) / 3600:.2f} GPU-h" in why, why
    _, plain = _preempts(cp, None)
    assert "re-wait" not in plain[0]
    assert f"expected gain {8 * (left - 600.0) / 3600:.2f} GPU-h" in plain[0], plain[0]


def test_the_scheduler_learns_a_wait_from_a_restart_it_sees() -> None:
    cp, clock = _evicted()
    clock.advance(5000)
    ok(cp.apply([place_on(cp, "long", "n0")]))
    run_to_running(cp, ["long"])
    clock.advance(900)
    submit(cp, gpu_job("short", estimated_duration=600))
    sched = default_scheduler()
    sched.plan(cp)
    assert sched.rewaits.waits(50, SAVED) == [], "off by default: nothing learned"
    sched.config = ON
    sched.plan(cp)  # a gain search reads the holders of the node "short" waits for
    assert sched.rewaits.waits(50, SAVED) == [5000.0]
    v = cp.get("long")
    assert victim_rewait(ON, sched.rewaits, v, cp.now()) == 0.0, "one wait: too few"
    more = SchedulerConfig(gain_preemption=True, gain_rewait_quantile=0.9,
                           gain_rewait_min_runs=1)
    # evicted now it would keep its saved hour (and lose the 900 s since)
    assert saved_gpu_s(v, cp.now()) == pytest.approx(SAVED)
    assert victim_rewait(more, sched.rewaits, v, cp.now()) == 5000.0


def test_a_victim_search_passes_over_a_holder_whose_re_wait_outweighs_its_gain() -> None:
    """Two whole-node equals: "a" is cheap to evict (just checkpointed), "b" dearer
    (no checkpoints: it loses its 3,000 s). The search takes the cheapest victim
    that passes the gain test: "a", until evicted jobs with "a"'s saved service
    are known to wait 200,000 s to be placed again, more than its ~27 h left."""
    cp, clock = cluster(gpu_node("n0"), gpu_node("n1"))
    running_on(cp, gpu_job("a", estimated_duration=100_000, checkpoint_interval=1800), "n0")
    clock.advance(610)
    running_on(cp, gpu_job("b", estimated_duration=60_000), "n1")
    clock.advance(3000)  # "a" checkpointed at 3,600 s: 10 s at risk
    submit(cp, gpu_job("short", estimated_duration=600))
    a = cp.get("a")
    assert a.work_at_risk(cp.now()) == pytest.approx(10.0)

    def victims(wait: float | None) -> list[str]:
        sched = default_scheduler()
        sched.config = ON
        if wait is not None:
            for _ in range(3):
                sched.rewaits.record(50, saved_gpu_s(a, cp.now()), wait)
        plan = sched.plan(cp)
        return [getattr(x, "victim", "") for x in plan.actions if x.kind == "preempt"]

    assert victims(None) == ["a"]
    assert victims(200_000.0) == ["b"]
    assert victims(10_000.0) == ["a"], "a re-wait shorter than what is left: still worth it"


@pytest.mark.parametrize("quantile", [-0.1, 1.5, math.nan, math.inf])
def test_a_quantile_outside_zero_to_one_is_refused(quantile: float) -> None:
    with pytest.raises(ValueError, match="gain_rewait_quantile"):
        SchedulerConfig(gain_rewait_quantile=quantile)
    with pytest.raises(ValueError, match="gain_rewait_min_runs"):
        SchedulerConfig(gain_rewait_min_runs=0)
