"""What is kept across cycles from the control plane's journal of changed
workloads (``ControlPlane.changed_since``) is at every moment what a reading of
everything would give: the holders a gain search examines (``mlwe.core.gain.Holders``)
through placements, starts, completions, preemptions, priority changes, gangs, the
minimum quantum passing and rollbacks; the size-aware order of the queue
(``SizeAware.order_queue``) and what the early stop reads of it."""

from __future__ import annotations

import random
from typing import Any

import pytest

from mlwe.core import ControlPlane, Exited
from mlwe.core.actions import Evict, SetPriority, Start, Started, Submit
from mlwe.core.gain import GainPool, Holders
from mlwe.core.lifecycle import State
from mlwe.core.rules import GAIN_MIN_QUANTUM_S
from mlwe.core.scheduler import SchedulerConfig, default_scheduler
from tests.core.builders import cluster, gpu_job, gpu_node, ok, release, submit

PRIORITIES = (50, 60)


def _reading(h: Holders) -> tuple[dict[str, Any], dict[str, int], dict[str, set[str]]]:
    members = {wid: (v.id, held) for wid, (v, held) in h.members.items()}
    return members, dict(h.node_gpu), {n: set(ids) for n, ids in h.on_node.items()}


def _check(
    cp: ControlPlane, kept: dict[int, Holders], now: float, rolled_back: bool, share: float
) -> None:
    """Bring every kept reading up to ``now`` (it cannot be, and only then, after a
    rollback) and compare it with a fresh one (both with the resume quantum's ``share``)."""
    cfg = SchedulerConfig(gain_preemption=True, gain_quantum_share=share)
    ids = list(cp.holder_ids())
    assert sorted(ids, key=lambda i: cp.hold_key(cp.workloads[i])) == ids
    for p in PRIORITIES:
        h = kept.get(p)
        if h is not None:
            assert h.refresh(cp, now) is not rolled_back
        if h is None or rolled_back:
            h = kept[p] = Holders(cp, p, now, quantum_share=share)
        fresh = Holders(cp, p, now, quantum_share=share)
        assert _reading(h) == _reading(fresh)
        # the pool reads the same members in the same (holder) order either way
        a = GainPool(cfg, lambda w, t: None, cp, p, now, h)
        b = GainPool(cfg, lambda w, t: None, cp, p, now, fresh)
        assert [v.id for v in a.members] == [v.id for v in b.members]
        nodes = frozenset(cp.capacity.node_names())
        fork = cp.capacity.fork()
        for need in (1000, 4000, 8000):
            assert a.viable(need, nodes, frozenset(), fork) == b.viable(
                need, nodes, frozenset(), fork
            )


def _scenario(seed: int, share: float) -> tuple[int, int, int]:
    rng = random.Random(seed)
    cp, clock = cluster(*(gpu_node(f"n{i}", gpus=8) for i in range(5)))
    sched = default_scheduler()
    kept: dict[int, Holders] = {}
    n = members_seen = resumed_seen = 0
    rollbacks = 0
    for _ in range(40):
        specs = []
        for _ in range(rng.randint(0, 4)):
            kw: dict[str, Any] = {"priority": rng.choice(PRIORITIES)}
            if rng.random() < 0.2:
                kw["replicas"] = 2
            if rng.random() < 0.5:
                kw["estimated_duration"] = rng.choice([300.0, 50_000.0])
            if rng.random() < 0.5:  # resumed runs: a quantum from the service saved
                kw["checkpoint_interval"] = 300.0
            specs.append(gpu_job(f"w{n}", gpu=rng.choice([1, 2, 4, 8]), **kw))
            n += 1
        if specs:
            submit(cp, *specs)
        sched.run_cycle(cp)
        live = list(cp.workloads.values())
        for w in live:  # some start, some only get as far as STARTING
            if w.state is State.ADMITTED and rng.random() < 0.8:
                ok(cp.apply([Start(w.id, w.attempt)]))
            if w.state is State.STARTING and rng.random() < 0.8:
                ok(cp.apply([Started(w.id, w.attempt)]))
            if w.state is State.PREEMPTING and rng.random() < 0.7:
                release(cp, w.id)
        running = [w for w in cp.workloads.values() if w.state is State.RUNNING]
        for w in rng.sample(running, len(running) // 4):
            ok(cp.apply([Exited(w.id, w.attempt, 0)]))
        holding = [w for w in cp.workloads.values() if w.placement]
        if holding and rng.random() < 0.3:  # a batch refused after a release: undone
            w = rng.choice(holding)
            got = cp.apply([Exited(w.id, w.attempt, 0), SetPriority("nobody", 1)])
            assert not got.accepted and w.placement  # (it holds again, last on its nodes)
        for w in rng.sample(holding, min(2, len(holding))):
            ok(cp.apply([SetPriority(w.id, rng.choice(PRIORITIES))]))
        if holding and rng.random() < 0.3:
            cp.apply([Evict(rng.choice(holding).id, "test")])  # may be refused: no matter
        rolled_back = rng.random() < 0.15
        if rolled_back:  # a batch undone (a request the store could not take)
            sp = cp.savepoint()
            cp.apply([Submit(gpu_job(f"w{n}", gpu=1))])
            n += 1
            for w in [w for w in cp.workloads.values() if w.placement][:1]:
                cp.apply([SetPriority(w.id, 99)])
            cp.rollback_to(sp)
            rollbacks += 1
        # short steps cross the minimum quantum of some holders, long ones of all
        clock.advance(rng.choice([1.0, GAIN_MIN_QUANTUM_S / 3, GAIN_MIN_QUANTUM_S, 2000.0]))
        _check(cp, kept, clock.now(), rolled_back and bool(kept), share)
        members_seen += sum(len(h.members) for h in kept.values())
        resumed_seen += sum(
            v.run_base_work > 0 for h in kept.values() for v, _ in h.members.values()
        )
    return members_seen, rollbacks, resumed_seen


@pytest.mark.parametrize("share", [0.0, 0.25])
def test_kept_holders_are_what_a_fresh_reading_gives(share: float) -> None:
    seen = rollbacks = resumed = 0
    for seed in range(6):
        s, r, m = _scenario(seed, share)
        seen, rollbacks, resumed = seen + s, rollbacks + r, resumed + m
    # the scenarios kept holders worth comparing, resumed runs among them
    assert seen > 200 and rollbacks > 0 and resumed > 0


def test_journal_says_what_changed_and_when_it_cannot() -> None:
    cp, _ = cluster(gpu_node("n0", gpus=8))
    mark = cp.journal_mark()
    submit(cp, gpu_job("a", gpu=1), gpu_job("b", gpu=1))
    assert cp.changed_since(mark) == ["a", "b"]
    mark = cp.journal_mark()
    ok(cp.apply([SetPriority("a", 70)]))  # no transition: named by the action
    assert cp.changed_since(mark) == ["a"]
    mark = cp.journal_mark()
    sp = cp.savepoint()
    submit(cp, gpu_job("c", gpu=1))
    cp.rollback_to(sp)
    assert cp.changed_since(mark) is None  # undone: the reader must read everything
    mark = cp.journal_mark()
    assert cp.changed_since(mark) == []
    refused = cp.apply([SetPriority("nobody", 1)])
    assert not refused.accepted and cp.changed_since(mark) == []  # nothing kept, nothing named
    for i in range(ControlPlane.JOURNAL_LIMIT // 2 + 2):  # past the limit, it starts over
        ok(cp.apply([SetPriority("a", i % 90), SetPriority("b", i % 90)]))
    assert cp.changed_since(mark) is None
    assert cp.changed_since(cp.journal_mark()) == []


def test_kept_holders_start_over_on_another_control_plane_or_an_earlier_moment() -> None:
    cp, clock = cluster(gpu_node("n0", gpus=8))
    other, _ = cluster(gpu_node("n0", gpus=8))
    h = Holders(cp, 50, clock.now())
    assert h.refresh(cp, clock.now())
    assert not h.refresh(other, clock.now())
    assert not h.refresh(cp, clock.now() - 1.0)


def test_the_queue_order_kept_from_the_journal_is_the_full_sort() -> None:
    """SizeAware.order_queue, brought up to date from the journal, gives at every
    step the full sort of the queue's keys and the right summary for the early stop,
    through arrivals, placements, cancellations, priority and spec changes (a job
    whose new spec asks for no GPU), another reader of the order, and a rollback."""
    from mlwe.core.actions import Cancel, SetResources
    from mlwe.core.estimator import RuntimeEstimator
    from mlwe.core.policies.ordering import SizeAware
    from mlwe.core.spec import ReplicaResources

    rng = random.Random(7)
    cp, clock = cluster(*(gpu_node(f"n{i}", gpus=8) for i in range(2)))
    sched = default_scheduler()
    ordering = SizeAware(RuntimeEstimator())
    served = n = 0
    for step in range(120):
        specs = [
            gpu_job(f"w{n + i}", gpu=rng.choice([1, 4, 8]), priority=rng.choice(PRIORITIES))
            for i in range(rng.randint(0, 3))
        ]
        n += len(specs)
        if specs:
            submit(cp, *specs)
        waiting = [cp.workloads[w] for w in cp.queued]
        if waiting and rng.random() < 0.3:
            ok(cp.apply([SetPriority(rng.choice(waiting).id, rng.choice(PRIORITIES))]))
        if waiting and rng.random() < 0.2:
            res = ReplicaResources.model_validate(
                {"gpu": rng.choice([0, 1]), "cpu": 1, "memory": "1Gi"}
            )
            ok(cp.apply([SetResources(rng.choice(waiting).id, res)]))
        if waiting and rng.random() < 0.1:
            ok(cp.apply([Cancel(rng.choice(waiting).id)]))
        if rng.random() < 0.2:
            sched.run_cycle(cp)
        if rng.random() < 0.1:
            sp = cp.savepoint()
            submit(cp, gpu_job(f"w{n}", gpu=1))
            n += 1
            cp.rollback_to(sp)
        if rng.random() < 0.1:  # another reader orders part of the queue
            ordering.order(waiting[: len(waiting) // 2], cp.queues, 16, clock.now())
        before = ordering._synced is not None
        got = ordering.order_queue(cp, 16, clock.now())
        served += before and ordering._synced is not None
        queued = cp.queued_workloads()
        want = sorted(queued, key=lambda w: ordering.key(w, clock.now()))
        assert [w.id for w in got] == [w.id for w in want], step
        summary = ordering.queue_summary(cp)
        if queued:
            assert summary == (max(w.priority for w in queued),
                               all(w.spec.resources.gpu for w in queued)), step
        clock.advance(30.0)
    assert served > 50  # the journal served most steps
