"""A gain pool keeps what :meth:`GainPool.viable` answered while the fork it read is
unchanged (a cycle's tests that place nothing ask the same again and again), and
answers anew once the fork changed: never a list read before a placement, a
release or a node's status changed it."""

from __future__ import annotations

from mlwe.core import ControlPlane
from mlwe.core.capacity import CapacityIndex
from mlwe.core.gain import GainPool
from mlwe.core.model import shape_of
from mlwe.core.policies.deadline import accepted_models
from mlwe.core.rules import GAIN_MIN_QUANTUM_S
from mlwe.core.scheduler import SchedulerConfig
from mlwe.core.spec import NodeStatus
from tests.core.builders import cluster, gpu_job, gpu_node, running_on, submit

CFG = SchedulerConfig(gain_preemption=True)
NODES = frozenset({"n0", "n1", "n2"})
NONE: frozenset[str] = frozenset()


def _fresh(cp: ControlPlane, fork: CapacityIndex, need: int) -> list[str]:
    pool = GainPool(CFG, lambda w, t: None, cp, 50, cp.now())
    return pool.viable(need, NODES, NONE, fork)


def test_viable_members_are_read_anew_once_the_fork_changes() -> None:
    cp, clock = cluster(*(gpu_node(f"n{i}", gpus=8) for i in range(3)))
    running_on(cp, gpu_job("a", gpu=4), "n0")
    running_on(cp, gpu_job("b", gpu=4), "n1")
    running_on(cp, gpu_job("c", gpu=2), "n2")
    clock.advance(GAIN_MIN_QUANTUM_S + 1)
    pool = GainPool(CFG, lambda w, t: None, cp, 50, cp.now())
    fork = cp.capacity.fork()

    # a replica asking 8 GPU: on every node, the free GPU and its holder's make 8
    first = pool.viable(8000, NODES, NONE, fork)
    assert first == ["a", "b", "c"] == _fresh(cp, fork, 8000)
    assert pool.viable(8000, NODES, NONE, fork) is first  # (kept: the fork is unchanged)

    # this cycle places a 2-GPU workload on n0: its holder can no longer make room for 8
    submit(cp, gpu_job("p", gpu=2))
    p = cp.get("p")
    alloc = fork.fit_on("n0", shape_of(p.spec, accepted_models(cp, p)))
    assert alloc is not None
    fork.allocate(alloc)
    assert pool.viable(8000, NODES, NONE, fork) == ["b", "c"] == _fresh(cp, fork, 8000)

    # given back: n0 counts again
    fork.release(alloc)
    assert pool.viable(8000, NODES, NONE, fork) == ["a", "b", "c"] == _fresh(cp, fork, 8000)

    # a node cordoned on the fork: its holder frees nothing a replica can use
    fork.set_status("n1", NodeStatus.CORDONED)
    assert pool.viable(8000, NODES, NONE, fork) == ["a", "c"] == _fresh(cp, fork, 8000)

    # another fork (the next cycle's) is read for itself, though it has changed as often
    other = cp.capacity.fork()
    for _ in range(3):
        other.allocate(alloc)
        other.release(alloc)
    assert pool.viable(8000, NODES, NONE, other) == ["a", "b", "c"] == _fresh(cp, other, 8000)

    # other questions are answered for themselves: a smaller replica, excluded nodes
    assert pool.viable(6000, NODES, NONE, fork) == _fresh(cp, fork, 6000)
    assert pool.viable(8000, NODES, frozenset({"n2"}), fork) == ["a"]
    # a part of the nodes: that question is kept for itself
    part = frozenset({"n0", "n2"})
    assert pool.viable(8000, part, NONE, fork) == ["a", "c"]
    assert pool.viable(8000, part, NONE, fork) is pool.viable(8000, part, NONE, fork)


def test_reach_is_where_members_could_make_room_and_every_node_they_hold_on() -> None:
    """GainPool.reach: the nodes a gain search among the pool's members must read.
    A node where the free GPU and every member's there fall short is left out,
    unless a member that could make room elsewhere holds on it too (a gang spread
    out: the search reads it first wherever it comes first)."""
    cp, clock = cluster(*(gpu_node(f"n{i}", gpus=8) for i in range(5)))
    running_on(cp, gpu_job("g", gpu=4, replicas=2), "n0", "n1")  # spread out
    running_on(cp, gpu_job("a", gpu=4), "n0")
    running_on(cp, gpu_job("h", gpu=4, priority=90), "n1")  # not an equal: not a member
    running_on(cp, gpu_job("b", gpu=2), "n2")  # 6 GPU free beside it
    running_on(cp, gpu_job("c", gpu=2), "n3")
    running_on(cp, gpu_job("h2", gpu=6, priority=90), "n3")
    clock.advance(GAIN_MIN_QUANTUM_S + 1)
    pool = GainPool(CFG, lambda w, t: None, cp, 50, cp.now())
    fork = cp.capacity.fork()
    assert pool.spread == 1
    every = frozenset(f"n{i}" for i in range(5))

    # n0 (g and a) and n2 (b and 6 free) reach 8; n1 does not, but g holds there; n3
    # (c, 2 of its 8) does not, nor does n4 (no member)
    first = pool.reach(8000, every, NONE, fork)
    assert first == {"n0", "n1", "n2"}
    assert pool.reach(8000, every, NONE, fork) is first  # (kept: the fork is unchanged)
    # n0 excluded: g makes room nowhere, and n1 is left out with it
    assert pool.reach(8000, every, frozenset({"n0"}), fork) == {"n2"}
    # smaller replicas: 4 GPU (g alone on n1 frees that), 2 (c alone on n3 too)
    assert pool.reach(4000, every, NONE, fork) == {"n0", "n1", "n2"}
    assert pool.reach(2000, every, NONE, fork) == {"n0", "n1", "n2", "n3"}
    # the fork changed: read anew (a 6-GPU placement on n2 leaves b short of 8)
    submit(cp, gpu_job("p", gpu=6))
    p = cp.get("p")
    alloc = fork.fit_on("n2", shape_of(p.spec, accepted_models(cp, p)))
    assert alloc is not None
    fork.allocate(alloc)
    assert pool.reach(8000, every, NONE, fork) == {"n0", "n1"}
    # a cordoned node is no room
    fork.set_status("n0", NodeStatus.CORDONED)
    assert pool.reach(8000, every, NONE, fork) == frozenset()
