"""When a gain search that found nothing wakes the scheduler again: the first
moment it would find victims if only the clock moved (``joint_wake``), not the
first checkpoint of any holder it passed over.

A waiting whole-node job needs every holder of a node cheap to evict at once;
each is cheap only for a while after each of its checkpoints. Waking at every
holder's checkpoint ran a cycle that found nothing at most of them (14,168 of
philly-5000's 25,077 cycles did nothing else).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from mlwe.core.capacity import Shape
from mlwe.core.controlplane import ControlPlane
from mlwe.core.gain import (
    GainAsk,
    GainPool,
    cost_of,
    could_gain,
    gain_choice,
    holder_at,
    joint_wake,
    loses_too_much,
)
from mlwe.core.model import Workload, shape_of
from mlwe.core.policies.deadline import INF
from mlwe.core.policies.preemption import CheapestVictims, candidate_nodes
from mlwe.core.rules import GAIN_MIN_QUANTUM_S, preemptible
from mlwe.core.scheduler import SchedulerConfig
from tests.core.builders import (
    A100,
    cluster,
    gpu_job,
    gpu_node,
    random_checkpoints,
    random_guards,
    running_on,
    submit,
)

PERIOD = 1800.0
CFG = SchedulerConfig(gain_preemption=True)


def _fixed(left: dict[str, float]) -> Any:
    """Expected remaining times that do not move with the clock (what the wake assumes)."""
    return lambda w, now: left.get(w.id)


def _node_of_four(stagger: float) -> tuple[ControlPlane, Any, Workload, Shape, dict[str, float]]:
    """One 8-GPU node held by four long 2-GPU jobs whose checkpoints are ``stagger``
    seconds apart; a short 8-GPU job of the same priority waits."""
    cp, clock = cluster(gpu_node("n0", gpus=8))
    left: dict[str, float] = {}
    for i in range(4):
        running_on(cp, gpu_job(f"long{i}", gpu=2, checkpoint_interval=PERIOD), "n0")
        left[f"long{i}"] = 500_000.0
        clock.advance(stagger)
    clock.advance(GAIN_MIN_QUANTUM_S + 2 * PERIOD)
    submit(cp, gpu_job("short", gpu=8))
    left["short"] = 600.0
    w = cp.get("short")
    return cp, clock, w, shape_of(w.spec, (A100,)), left


def _test(cp: ControlPlane, w: Workload, shape: Shape, left: dict[str, float], t: float
          ) -> tuple[bool, float]:
    """could_gain for ``w`` at moment ``t`` (nothing else moved), on a pool built then."""
    fork = cp.capacity.fork()
    remaining = _fixed(left)
    pool = GainPool(CFG, remaining, cp, w.priority, t)
    nodes = frozenset(candidate_nodes(fork, shape))
    return could_gain(CFG, remaining, w, shape, fork, nodes, set(), frozenset(), pool, t)


def _checkpoints(cp: ControlPlane, start: float, end: float) -> list[float]:
    """Every holder's checkpoint moments (just after) in [start, end)."""
    out = []
    for wid in cp.holder_ids():
        v = cp.workloads[wid]
        t = v.next_checkpoint(start)
        while t is not None and t < end:
            out.append(t + 1e-6)
            t = v.next_checkpoint(t + 1e-3)
    return sorted(out)


def test_staggered_checkpoints_whose_cheap_windows_never_meet_wake_nobody() -> None:
    # each 2-GPU holder is cheap for budget x period / (2 + budget) = 300 s after each
    # checkpoint (budget: 0.05 x the waiting job's 8 GPUs); 450 s apart, four never meet
    cp, clock, w, shape, left = _node_of_four(450.0)
    now = clock.now()
    possible, wake = _test(cp, w, shape, left, now)
    assert not possible
    assert wake == INF
    # the search itself says the same
    ask = GainAsk(CFG, _fixed(left), CheapestVictims(), cp, cp.capacity.fork(), w, shape,
                  set(), frozenset(), now)
    assert gain_choice(ask) == (None, INF)
    # and no moment in the next two periods proves it wrong
    assert not any(_test(cp, w, shape, left, t)[0] for t in _checkpoints(cp, now, now + 2 * PERIOD))


def test_the_wake_is_the_first_moment_every_holder_of_a_node_is_cheap_at_once() -> None:
    cp, clock, w, shape, left = _node_of_four(90.0)
    now = clock.now()
    possible, wake = _test(cp, w, shape, left, now)
    assert not possible and now < wake < now + PERIOD
    # it is a checkpoint moment, the last of the four in a row (the first three
    # checkpoints after now each make one holder cheap, not all four)
    moments = _checkpoints(cp, now, wake + 1.0)
    assert wake == pytest.approx(moments[-1], abs=1e-3)
    assert len(moments) >= 4
    for t in moments[:-1]:
        assert not _test(cp, w, shape, left, t)[0], t
    assert _test(cp, w, shape, left, wake)[0]
    # a cap the caller already has: nothing from it on is looked for
    fork = cp.capacity.fork()
    pool = GainPool(CFG, _fixed(left), cp, w.priority, now)
    nodes = frozenset(candidate_nodes(fork, shape))
    assert could_gain(CFG, _fixed(left), w, shape, fork, nodes, set(), frozenset(), pool, now,
                      cap=wake - 1.0) == (False, wake - 1.0)
    assert could_gain(CFG, _fixed(left), w, shape, fork, nodes, set(), frozenset(), pool, now,
                      cap=wake + 1.0) == (False, wake)


def test_a_holder_that_started_at_time_zero_ripened_then() -> None:
    # a trace's first job starts at 0.0: read as "not started", its minimum runtime
    # ran out at every call, and a wake was named a microsecond after each cycle: a
    # replay crawled forward one microsecond per cycle (found on philly-5000)
    cp, clock = cluster(gpu_node("n0", gpus=8))
    running_on(cp, gpu_job("long", gpu=8, checkpoint_interval=PERIOD), "n0")
    v = cp.get("long")
    assert v.started_at == 0.0
    clock.advance(10 * PERIOD + 1.0)  # a second after a checkpoint: cheap to evict now
    submit(cp, gpu_job("short", gpu=8))
    left = {"long": 500_000.0, "short": 600.0}
    w = cp.get("short")
    shape = shape_of(w.spec, (A100,))
    now = clock.now()
    c = GainPool(CFG, _fixed(left), cp, w.priority, now).get("long")
    assert c is not None and c.loss <= CFG.gain_wait_share * 8 * c.wait
    fork = cp.capacity.fork()
    wake = joint_wake(
        [(v, c.left, c.wait, c.held, c.rewait)], left["short"], CFG.gain_ratio,
        CFG.gain_wait_share * 8, shape.gpu, fork, frozenset(candidate_nodes(fork, shape)),
        frozenset(), now,
    )
    # the next moment it turns cheap is its next checkpoint, not a microsecond from now
    nxt = v.next_checkpoint(now)
    assert nxt is not None and wake == pytest.approx(nxt + 1e-6)


@pytest.mark.parametrize("seed", range(12))
def test_no_moment_before_the_wake_finds_victims_and_the_wake_does(seed: int) -> None:
    """Random holders (GPUs, checkpoint phases and periods, protection, minimum
    runtimes) on three nodes, expected times fixed: at every checkpoint moment
    before the wake the test finds nothing; with one period, it finds victims at
    the wake itself (with several, the wake may be a look-again moment)."""
    rng = random.Random(seed)
    cp, clock = cluster(*(gpu_node(f"n{i}", gpus=8) for i in range(3)))
    left: dict[str, float] = {}
    periods = [PERIOD] if seed % 3 else [PERIOD, 1200.0]
    k = 0
    for node in ("n0", "n1", "n2"):
        room = 8 - rng.choice([0, 0, 1, 2])
        while room > 0:
            g = min(room, rng.choice([1, 2, 2, 4]))
            room -= g
            k += 1
            kw: dict[str, Any] = {"checkpoint_interval": rng.choice(periods)}
            if rng.random() < 0.1:
                kw["min_runtime"] = GAIN_MIN_QUANTUM_S + rng.uniform(2000, 6000)
            running_on(cp, gpu_job(f"h{k}", gpu=g, **kw), node)
            left[f"h{k}"] = rng.choice([500_000.0, 500_000.0, 3000.0, 800.0])
            clock.advance(rng.uniform(0, 700))
    clock.advance(GAIN_MIN_QUANTUM_S)
    submit(cp, gpu_job("p", gpu=rng.choice([4, 8])))
    left["p"] = 600.0
    w = cp.get("p")
    shape = shape_of(w.spec, (A100,))
    now = clock.now()
    possible, wake = _test(cp, w, shape, left, now)
    if possible:
        return  # victims now: nothing to wake for
    horizon = wake if wake < INF else now + 2 * max(periods)
    for t in _checkpoints(cp, now, horizon):
        if t < wake:
            assert not _test(cp, w, shape, left, t)[0], (t - now, wake - now)
    if wake < INF and len(periods) == 1:
        assert _test(cp, w, shape, left, wake)[0]
    # the search reports the same moment as the test
    ask = GainAsk(CFG, _fixed(left), CheapestVictims(), cp, cp.capacity.fork(), w, shape,
                  set(), frozenset(), now)
    assert gain_choice(ask) == (None, wake)


def test_holder_at_is_the_rules_at_that_moment() -> None:
    rng = random.Random(3)
    cp, clock = cluster(*(gpu_node(f"n{i}", gpus=8) for i in range(6)))
    for i in range(24):
        kw = random_checkpoints(rng, 0.8) | random_guards(rng)
        running_on(cp, gpu_job(f"w{i}", gpu=rng.choice([1, 2]), **kw), f"n{i % 6}")
        clock.advance(rng.uniform(0, 400))
    holders = [cp.workloads[w] for w in cp.holder_ids()]
    for v in holders:
        v.run_base_work = rng.choice([0.0, rng.uniform(10, 500)])
        v.last_checkpoint_at = rng.choice([None, (v.started_at or 0.0) + rng.uniform(0, 900)])
        v.progress = rng.choice([0.0, 0.7])
    seen = set()
    for step in range(40):
        t = clock.now() + step * 71.9
        budget = rng.choice([0.05, 0.4, 2.0])
        for v in holders:
            too_much, _ = loses_too_much(v, t, budget)
            cost, cheap, evictable = holder_at(v, t, budget)
            assert cost == pytest.approx(cost_of(v, t), abs=1e-9)
            assert (cheap, evictable) == (not too_much, preemptible(v, t) is None)
            seen.add((cheap, evictable))
    assert len(seen) == 4  # every outcome occurs


def test_holders_off_the_candidate_nodes_or_that_never_checkpoint_wake_nobody() -> None:
    cp, clock = cluster(gpu_node("n0", gpus=8))
    running_on(cp, gpu_job("a", gpu=8, checkpoint_interval=PERIOD), "n0")
    clock.advance(GAIN_MIN_QUANTUM_S + 500)
    a = cp.get("a")
    fork = cp.capacity.fork()
    later = [(a, 1e6, (a.next_checkpoint(clock.now()) or 0) - clock.now(), (("n0", 8000),), 0.0)]
    now = clock.now()
    assert joint_wake(later, 600.0, 2.0, 0.4, 8000, fork, frozenset(), frozenset(), now) == INF
    assert joint_wake(later, 600.0, 2.0, 0.4, 8000, fork, {"n0"}, {"n0"}, now) == INF
    got = joint_wake(later, 600.0, 2.0, 0.4, 8000, fork, {"n0"}, frozenset(), now)
    assert got == pytest.approx((a.next_checkpoint(now) or 0) + 1e-6)
    never = [(a, 1e6, 0.0, (("n0", 8000),), 0.0)]  # no checkpoint: nothing changes with time
    assert joint_wake(never, 600.0, 2.0, 0.4, 8000, fork, {"n0"}, frozenset(), now) == INF
