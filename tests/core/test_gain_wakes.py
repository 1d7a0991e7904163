"""When a deferred preemption among equals looks again: the wake a cycle names.

A victim that would lose too much work now is passed over, and the scheduler
names the moment just after its next checkpoint (``next_wakeup``). Two rules
hold here: the moment is the checkpoint's own (counted from the end of a
resumed run's restore, as the backends checkpoint), and a cycle that runs at
a wake keeps the wakes it names.
"""

from __future__ import annotations

from mlwe.core import ControlPlane, Evict, ManualClock, Place, Released
from mlwe.core.scheduler import default_scheduler
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


def _resumed_victim() -> tuple[ControlPlane, ManualClock, float]:
    """One 8-GPU node; a long job that was moved once (so it restores 60 s before it
    works) has run 1,810 s of its new attempt: its first checkpoint of that attempt
    is done at 60 + 1,800 s. An equal, much shorter job waits for the node."""
    cp, clock = cluster(gpu_node("n0"))
    running_on(cp, gpu_job("long", estimated_duration=100_000, checkpoint_interval=1800,
                           restart_cost=60), "n0")
    clock.advance(3600)
    ok(cp.apply([Evict("long", "moved by the operator")]))
    # the backend's final checkpoint holds the hour of work done
    ok(cp.apply([Released("long", cp.get("long").attempt, checkpointed_work_s=3600.0)]))
    ok(cp.apply([place_on(cp, "long", "n0")]))
    run_to_running(cp, ["long"])
    assert cp.get("long").run_base_work > 0, "the new attempt resumes from a checkpoint"
    started = cp.get("long").started_at
    assert started is not None
    clock.advance(1810)
    submit(cp, gpu_job("short", estimated_duration=600))
    return cp, clock, started


def test_the_wake_is_the_victims_next_checkpoint_after_its_restore() -> None:
    cp, _, started = _resumed_victim()
    v = cp.get("long")
    assert v.next_checkpoint(cp.now()) == started + 60 + 1800
    sched = default_scheduler()
    plan = sched.plan(cp)
    assert not [a for a in plan.actions if a.kind == "preempt"], "1,810 s would be lost now"
    # before: the wait was read as 1,800 s minus the time since the start (restore
    # included), i.e. 0, and the scheduler asked for a cycle every microsecond
    wake = sched.next_wakeup(cp)
    assert wake is not None and abs(wake - (started + 1860)) < 1e-3


def test_a_cycle_run_at_a_wake_keeps_the_wake_it_names() -> None:
    cp, _, started = _resumed_victim()
    sched = default_scheduler()
    sched._wake_at = cp.now()  # a wake named earlier is due: this cycle is its own
    sched.plan(cp)
    wake = sched.next_wakeup(cp)
    # before: min(due, new) kept the due one, which next_wakeup then dropped as past
    assert wake is not None and abs(wake - (started + 1860)) < 1e-3


def test_at_the_named_wake_the_victim_is_cheap_and_evicted() -> None:
    cp, clock, _ = _resumed_victim()
    sched = default_scheduler()
    ok(sched.run_cycle(cp))
    wake = sched.next_wakeup(cp)
    assert wake is not None
    clock.advance(wake - cp.now())
    plan = sched.plan(cp)
    assert [(a.kind, getattr(a, "victim", None)) for a in plan.actions] == [("preempt", "long")]
    assert cp.get("long").work_at_risk(cp.now()) < 1e-3
    assert not any(isinstance(a, Place) for a in plan.actions)


def test_loses_too_much_weighs_the_work_at_risk_against_the_wait() -> None:
    """The test a gain search and a drain plan share: evicting now is too dear
    when the victim's GPUs x its work since the last checkpoint exceed the budget
    (the preemptor's GPUs x gain_wait_share) x the wait for its next checkpoint;
    a victim with no checkpoint interval gains nothing by waiting."""
    from mlwe.core.gain import loses_too_much, outlasts

    cp, clock = cluster(gpu_node("n0"), gpu_node("n1"))
    running_on(cp, gpu_job("ck", estimated_duration=100_000, checkpoint_interval=1800), "n0")
    running_on(cp, gpu_job("plain", estimated_duration=100_000), "n1")
    clock.advance(900)  # halfway to the first checkpoint: 900 s at risk, 900 s to wait
    ck, plain, now = cp.get("ck"), cp.get("plain"), cp.now()
    g = ck.gpus()
    assert loses_too_much(ck, now, budget=g * 0.99) == (True, 900.0)
    assert loses_too_much(ck, now, budget=g * 1.0) == (False, 900.0)
    assert loses_too_much(plain, now, budget=0.0) == (False, 0.0)
    # the gain test: long enough against the ratio, and against the preemptor plus the cost
    assert outlasts(10_000.0, 1_000.0, 500.0, ratio=4.0)
    assert not outlasts(3_999.0, 1_000.0, 0.0, ratio=4.0)
    assert not outlasts(10_000.0, 1_000.0, 9_000.0, ratio=4.0)
