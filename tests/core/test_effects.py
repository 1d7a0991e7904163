"""The control plane's effects log: what each applied batch did, as a value, for
every reader that follows it, each with its own cursor.

Each test states the exact records a reader gets: the batch's version, its
transitions, the workloads, nodes and queues it changed, its decision records.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlwe.core import (
    AddNode,
    Cancel,
    ControlPlane,
    Preempt,
    Progress,
    QueueSpec,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    SetResources,
)
from mlwe.core.controlplane import Effects, EffectsLog
from mlwe.core.lifecycle import State
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import NodeStatus, ReplicaResources
from tests.core.builders import cluster, cpu_node, gpu_node, job, ok, running_on, submit


def record(e: Effects) -> tuple[Any, ...]:
    """An effects record as plain values: version, transitions (workload, source,
    target), workloads, nodes added, node status, queues, respecified, decisions
    (kind, workload, seq)."""
    return (
        e.version,
        [(c.workload.id, c.transition.source, c.transition.target) for c in e.transitions],
        e.workloads,
        tuple(n.name for n in e.nodes_added),
        e.node_status,
        e.queues,
        e.respecified,
        [(d.kind, d.workload, d.seq) for d in e.decisions],
    )


def followed(*readers: str) -> tuple[ControlPlane, Any]:
    cp, clock = cluster(gpu_node("n1"), cpu_node("c1", cpu=8, memory="64Gi"))
    for r in readers:
        cp.effects.follow(r)
    return cp, clock


P = State.PENDING


def test_two_readers_have_their_own_cursors() -> None:
    cp, _ = followed("a", "b")
    v0 = cp.version
    submit(cp, job("x", cpu=1, memory="1Gi"))
    first = (v0 + 1, [("x", None, P)], ("x",), (), (), (), (), [])
    assert [record(e) for e in cp.effects.take("a")] == [first]
    ok(cp.apply([SetPriority("x", 70)]))  # no transition, still a change of x's record
    second = (v0 + 2, [], ("x",), (), (), (), (), [])
    assert [record(e) for e in cp.effects.unread("a")] == [second]
    # what "a" read is still there for "b", in order, until "b" reads it too
    assert [record(e) for e in cp.effects.unread("b")] == [first, second]
    assert len(cp.effects) == 2
    assert [record(e) for e in cp.effects.take("b")] == [first, second]
    assert len(cp.effects) == 1  # the second record: "a" has not read it yet
    assert [record(e) for e in cp.effects.take("a")] == [second]
    assert len(cp.effects) == 0 and cp.effects.take("a") == cp.effects.take("b") == ()


def test_a_reader_sees_only_what_was_applied_after_it_started_following() -> None:
    cp, _ = followed("early")
    submit(cp, job("x", cpu=1, memory="1Gi"))
    cp.effects.follow("late")
    ok(cp.apply([Cancel("x")]))
    assert [record(e)[1] for e in cp.effects.unread("early")] == [
        [("x", None, P)], [("x", P, State.CANCELLED)]]
    assert [record(e)[1] for e in cp.effects.unread("late")] == [[("x", P, State.CANCELLED)]]
    with pytest.raises(ValueError, match="already follows"):
        cp.effects.follow("late")


def test_a_log_nobody_follows_keeps_nothing() -> None:
    cp, _ = cluster(gpu_node("n1"))
    submit(cp, job("x", cpu=1, memory="1Gi"))
    ok(cp.apply([Cancel("x")]))
    assert len(cp.effects) == 0 and cp.effects.end == 0 and not cp.effects.followed


def test_a_rollback_drops_the_undone_batches_for_every_reader() -> None:
    cp, _ = followed("a", "b")
    submit(cp, job("x", cpu=1, memory="1Gi"))
    kept = [record(e) for e in cp.effects.unread("b")]
    assert [record(e) for e in cp.effects.take("a")] == kept
    sp = cp.savepoint()
    submit(cp, job("y", cpu=1, memory="1Gi"))
    assert not cp.apply([Cancel("nobody")]).accepted  # its rejection record is filed too
    ok(cp.apply([SetPriority("x", 70)]))
    assert len(cp.effects.unread("a")) == 3
    cp.rollback_to(sp)
    assert cp.effects.unread("a") == ()
    assert [record(e) for e in cp.effects.unread("b")] == kept
    submit(cp, job("z", cpu=1, memory="1Gi"))  # the log goes on from where it was
    assert [record(e)[2] for e in cp.effects.take("a")] == [("z",)]


def test_a_reader_that_read_what_is_then_undone_is_set_back() -> None:
    log = EffectsLog()
    log.follow("a")
    log.follow("b")
    sp = log.end
    log.append(Effects(1))
    log.append(Effects(2))
    assert [e.version for e in log.take("a")] == [1, 2]
    log.truncate(sp)
    assert log.unread("a") == log.unread("b") == () and len(log) == 0
    log.append(Effects(1))
    assert [e.version for e in log.unread("a")] == [e.version for e in log.unread("b")] == [1]
    with pytest.raises(ValueError, match="cannot have read"):
        log.mark_read("a", log.end + 1)


def test_what_each_kind_of_batch_changed() -> None:
    cp, _ = followed("r")
    running_on(cp, job("low", gpu=8, priority="low"), "n1")
    submit(cp, job("hi", gpu=8, priority="urgent"), job("w", cpu=1, memory="1Gi"))
    cp.effects.take("r")
    v = cp.version
    ok(cp.apply([Preempt("low", "hi")]))
    ok(cp.apply([Progress("low", 1, 0.5)]))
    ok(cp.apply([SetResources("w", ReplicaResources(cpu=2, memory="2Gi"))]))
    ok(cp.apply([SetNodeStatus("c1", NodeStatus.CORDONED, "test")]))
    ok(cp.apply([SetQueue(QueueSpec(name="team"))]))
    ok(cp.apply([AddNode(cpu_node("c2"))]))
    assert [record(e) for e in cp.effects.take("r")] == [
        (v + 1, [("low", State.RUNNING, State.PREEMPTING)], ("low", "hi"), (), (), (), (), []),
        (v + 2, [], ("low",), (), (), (), (), []),
        (v + 3, [], ("w",), (), (), (), ("w",), []),
        (v + 4, [], (), (), ("c1",), (), (), []),
        (v + 5, [], (), (), (), ("team",), (), []),
        (v + 6, [], (), ("c2",), (), (), (), []),
    ]


def test_decisions_are_filed_with_their_batch_or_on_their_own() -> None:
    cp, _ = followed("r")
    submit(cp, job("fits", gpu=8), job("waits", gpu=8))
    cp.effects.take("r")
    v, seq = cp.version, len(cp.decisions)
    ok(Scheduler().run_cycle(cp, cause_id="cycle-1"))
    assert not cp.apply([Cancel("nobody")], cause_id="req-1").accepted
    assert [record(e) for e in cp.effects.take("r")] == [
        # the cycle's batch carries its placement record...
        (v + 1, [("fits", P, State.ADMITTED)], ("fits",), (), (), (), (),
         [("place", "fits", seq + 1)]),
        # ...the pending reason noted after it and a rejection are records of their own
        (v + 1, [], (), (), (), (), (), [("unschedulable", "waits", seq + 2)]),
        (v + 1, [], (), (), (), (), (), [("reject", "nobody", seq + 3)]),
    ]
    assert [d.seq for d in cp.decisions] == list(range(1, seq + 4))


def test_the_reconcilers_take_does_not_take_from_another_reader() -> None:
    cp, _ = followed("store")
    cp.keep_effects()
    submit(cp, job("x", cpu=1, memory="1Gi"))
    assert [c.workload.id for c in cp.take_effects()] == ["x"]
    assert cp.take_effects() == ()
    assert [record(e)[2] for e in cp.effects.take("store")] == [("x",)]
