"""The reconciler, facts in and commands out: each test states the exact command list.

A command is compared whole, as a tuple of what the backend acts on: its kind,
request id (the idempotency key), workload, attempt, and the nodes (a start) or
the grace period and reason (a stop).
"""

from __future__ import annotations

from typing import Any

import pytest

from mlwe.core import ControlPlane, Exited, ManualClock, Released, Started
from mlwe.core.actions import Cancel, Preempt
from mlwe.core.backend import Command, Event, NodeDown, StartCommand, StopCommand
from mlwe.core.lifecycle import State
from mlwe.core.reconcile import Reconciler, commands_for, owed_by
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import NodeStatus
from tests.core.builders import (
    cluster,
    gpu_node,
    job,
    ok,
    place_on,
    run_to_running,
    running_on,
    submit,
)


def view(cmds: list[Command]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for c in cmds:
        if isinstance(c, StartCommand):
            out.append(("start", c.request_id, c.workload, c.attempt,
                        tuple(a.node for a in c.placement), c.resume_work_s))
        else:
            assert isinstance(c, StopCommand)
            out.append(("stop", c.request_id, c.workload, c.attempt, c.grace_s, c.reason))
    return out


def world(*nodes: str, gpus: int = 8) -> tuple[ControlPlane, ManualClock, Reconciler]:
    cp, clock = cluster(*(gpu_node(n, gpus=gpus) for n in nodes))
    rec = Reconciler(cp, Scheduler(), grace_s=10.0, retry_base_s=30.0, retry_max_s=600.0)
    return cp, clock, rec


def event(i: int, fact: Any, t: float = 0.0) -> Event:
    return Event(event_id=f"e{i}", time=t, fact=fact)


def test_a_submission_becomes_one_start_and_nothing_twice() -> None:
    cp, _, rec = world("n1")
    submit(cp, job("a", gpu=4))
    assert view(rec.step()) == [("start", "start:a:1", "a", 1, ("n1",), 0.0)]
    assert view(rec.step()) == []  # owed once: nothing more without a new fact


def test_starts_come_in_queue_order_and_what_does_not_fit_waits() -> None:
    cp, _, rec = world("n1")
    submit(cp, job("a", gpu=4), job("b", gpu=4), job("c", gpu=4))
    assert view(rec.step()) == [
        ("start", "start:a:1", "a", 1, ("n1",), 0.0),
        ("start", "start:b:1", "b", 1, ("n1",), 0.0),
    ]
    rec.handle([event(1, Started("a", 1)), event(2, Started("b", 1))])
    assert view(rec.step()) == []
    rec.handle([event(3, Exited("a", 1, 0))])  # a finishes: c takes its place
    assert view(rec.step()) == [("start", "start:c:1", "c", 1, ("n1",), 0.0)]


def test_a_cancel_of_a_running_workload_is_a_graceful_stop() -> None:
    cp, _, rec = world("n1")
    submit(cp, job("a", gpu=8))
    rec.step()
    rec.handle([event(1, Started("a", 1))])
    assert cp.apply([Cancel("a")]).accepted
    assert view(rec.step()) == [("stop", "stop:a:1:cancel", "a", 1, 10.0, "cancel")]
    rec.handle([event(2, Released("a", 1))])
    assert view(rec.step()) == []


def test_a_higher_priority_arrival_preempts_and_starts_only_after_the_release() -> None:
    cp, _, rec = world("n1")
    submit(cp, job("low", gpu=8, priority="low"))
    rec.step()
    rec.handle([event(1, Started("low", 1))])
    submit(cp, job("hi", gpu=8, priority="urgent"))
    assert view(rec.step()) == [("stop", "stop:low:1:preempt", "low", 1, 10.0, "preempt")]
    assert view(rec.step()) == []  # the preemptor waits for the release
    rec.handle([event(2, Released("low", 1))])
    assert view(rec.step()) == [("start", "start:hi:1", "hi", 1, ("n1",), 0.0)]


def test_a_crash_is_retried_after_its_backoff_as_attempt_two() -> None:
    cp, clock, rec = world("n1")
    submit(cp, job("a", gpu=8, max_retries=2))
    rec.step()
    rec.handle([event(1, Started("a", 1)), event(2, Exited("a", 1, 1, "error"))])
    assert view(rec.step()) == []
    due = rec.next_wakeup()
    assert due is not None and 15.0 <= due < 45.0  # 30 s backoff, jitter in [0.5x, 1.5x)
    clock.set(due - 0.001)
    assert view(rec.step()) == []
    clock.set(due)
    assert view(rec.step()) == [("start", "start:a:2", "a", 2, ("n1",), 0.0)]


def test_a_redelivered_event_has_no_second_effect() -> None:
    cp, _, rec = world("n1")
    submit(cp, job("a", gpu=8), job("b", gpu=8))
    rec.step()
    done = event(1, Exited("a", 1, 0))
    rec.handle([event(0, Started("a", 1)), done])
    assert view(rec.step()) == [("start", "start:b:1", "b", 1, ("n1",), 0.0)]
    rec.handle([done])
    assert view(rec.step()) == [] and rec.rejected == []


def test_a_lost_node_requeues_what_it_held_onto_the_nodes_left() -> None:
    cp, clock, rec = world("n1", "n2")
    submit(cp, job("a", gpu=8))
    assert view(rec.step()) == [("start", "start:a:1", "a", 1, ("n1",), 0.0)]
    rec.handle([event(1, Started("a", 1)), event(2, NodeDown("n1", "lost"))])
    assert cp.node_status("n1") is NodeStatus.DOWN
    # node-lost is not the workload's fault: it does not count against max_retries, but
    # it waits its backoff like any retry (a node that flaps does not cause a start storm)
    assert cp.get("a").state is State.FAILED
    assert view(rec.step()) == []
    due = rec.next_wakeup()
    assert due is not None and 15.0 <= due < 45.0
    clock.set(due)
    assert view(rec.step()) == [("start", "start:a:2", "a", 2, ("n2",), 0.0)]


# ------------------------------------------------------------------ effects as values
def changes(effects: Any) -> list[tuple[Any, ...]]:
    """An effects value as plain tuples: workload, source, target, reason, attempt, failures."""
    return [(c.workload.id, c.transition.source, c.transition.target, c.transition.reason,
             c.attempt, c.failures) for c in effects]


def test_a_preemption_is_returned_by_apply_and_owes_exactly_one_graceful_stop() -> None:
    cp, _, rec = world("n1")
    running_on(cp, job("low", gpu=8, priority="low"), "n1")
    submit(cp, job("hi", gpu=8, priority="urgent"))
    cp.take_effects()  # what led here is not the point
    result = cp.apply([Preempt("low", "hi")], cause_id="c1")
    assert result.accepted
    expected = [("low", State.RUNNING, State.PREEMPTING, "preempted by hi (priority)", 1, 0)]
    assert changes(result.transitions) == expected
    assert changes(cp.pending_effects()) == expected  # the same value, kept for the step
    owed = owed_by(result.transitions)
    assert (owed.starts, owed.stops, owed.retries, owed.cycle) == ({}, {"low": "preempt"}, [],
                                                                   False)
    assert view(commands_for(cp.workloads, [], owed.stops, 10.0)) == [
        ("stop", "stop:low:1:preempt", "low", 1, 10.0, "preempt")]
    assert view(rec.step()) == [("stop", "stop:low:1:preempt", "low", 1, 10.0, "preempt")]
    assert cp.take_effects() == ()  # the step read them


def test_effects_owe_starts_in_admission_order_and_a_failure_its_retry() -> None:
    cp, clock, _ = world("n1", "n2")
    submit(cp, job("a", gpu=8), job("b", gpu=8, max_retries=1))
    clock.set(5.0)
    owed = owed_by(cp.take_effects())
    assert (list(owed.starts), owed.stops, owed.cycle) == ([], {}, True)  # new work: a cycle
    ok(cp.apply([place_on(cp, "b", "n2"), place_on(cp, "a", "n1")]))
    owed = owed_by(cp.take_effects())
    assert list(owed.starts) == ["b", "a"] and owed.cycle is False
    run_to_running(cp, ["b"])
    ok(cp.apply([Exited("b", 1, 3, "error")]))
    owed = owed_by(cp.take_effects())
    assert owed.retries == [(5.0, "b", 1, 1)] and owed.cycle is True  # capacity came back


def test_a_rolled_back_batch_owes_nothing() -> None:
    cp, _, rec = world("n1")
    submit(cp, job("a", gpu=8))
    rec.step()
    rec.handle([event(1, Started("a", 1))])
    assert view(rec.step()) == []
    sp = cp.savepoint()
    assert cp.apply([Cancel("a")]).accepted
    with pytest.raises(RuntimeError):
        cp.take_effects()  # what a savepoint may still undo is not handed out
    cp.rollback_to(sp)
    assert cp.pending_effects() == () and cp.get("a").state is State.RUNNING
    assert view(rec.step()) == []
