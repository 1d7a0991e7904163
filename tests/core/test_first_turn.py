"""Scheduler._first_turn: the first rank from which a turn could start anything.

Once only a fit can start anything, the turns of workloads asking for more whole
GPUs than any ready node has free are passed over; a workload with victims always
takes its turn. With no GPU free at all (``most`` < 0) only the latter remain,
and the queue is read in C: both ways must give the same rank.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

from mlwe.core.capacity import FULL
from mlwe.core.model import Workload
from mlwe.core.scheduler import Scheduler
from tests.core.builders import gpu_job


def _reference(order: list[Workload], rank: int, most: int) -> int:
    r = rank
    while r < len(order):
        w = order[r]
        if w.victims or w.spec.resources.gpu // FULL <= most:
            return r
        r += 1
    return len(order)


def _order(rng: random.Random, n: int) -> list[Workload]:
    out = []
    for i in range(n):
        spec = gpu_job(f"w{i}", gpu=rng.choice([0.5, 1, 2, 4, 8, 16]))  # type: ignore[arg-type]
        w = Workload(id=spec.id, spec=spec, submit_time=0.0, deadline=None, seq=i)
        if rng.random() < 0.03:
            w.victims = (f"v{i}",)
        out.append(w)
    return out


def test_first_turn_equals_the_turn_by_turn_reading() -> None:
    rng = random.Random(7)
    sched = Scheduler()
    checked = {"victims": 0, "none": 0, "fit": 0}
    for _ in range(300):
        order = _order(rng, rng.randrange(0, 60))
        for most in (-1, 0, 1, 3, 7, 8):
            for rank in sorted({0, len(order), *(rng.randrange(len(order) + 1) for _ in range(3))}):
                cycle = SimpleNamespace(order=order, first_turn=None)
                got = sched._first_turn(cycle, rank, most)  # type: ignore[arg-type]
                want = _reference(order, rank, most)
                assert got == want, (most, rank, [w.spec.resources.gpu for w in order])
                # kept for the same question, asked again by the pass-over
                assert cycle.first_turn == (rank, most, want)
                assert sched._first_turn(cycle, rank, most) == want  # type: ignore[arg-type]
                if want == len(order):
                    checked["none"] += 1
                elif order[want].victims and order[want].spec.resources.gpu // FULL > most:
                    checked["victims"] += 1
                else:
                    checked["fit"] += 1
    # every way a rank is found was exercised, the C reading (most < 0) included
    assert min(checked.values()) > 50, checked


def test_with_no_gpu_free_only_a_workload_with_victims_takes_a_turn() -> None:
    spec = [gpu_job(f"w{i}", gpu=g) for i, g in enumerate([0.5, 1, 8, 1])]  # type: ignore[arg-type]
    order = [Workload(id=s.id, spec=s, submit_time=0.0, deadline=None, seq=i) for i, s in enumerate(spec)]
    order[2].victims = ("held",)
    sched = Scheduler()
    cycle = SimpleNamespace(order=order, first_turn=None)
    assert sched._first_turn(cycle, 0, -1) == 2  # type: ignore[arg-type]
    assert sched._first_turn(cycle, 3, -1) == 4  # type: ignore[arg-type]
    # no whole GPU free, part of one: the fraction, else a workload with victims
    assert sched._first_turn(cycle, 0, 0) == 0  # type: ignore[arg-type]
    assert sched._first_turn(cycle, 1, 0) == 2  # type: ignore[arg-type]
    assert sched._first_turn(cycle, 3, 0) == 4  # type: ignore[arg-type]
    # one whole GPU free: the 1-GPU asks too
    assert sched._first_turn(cycle, 1, 1) == 1  # type: ignore[arg-type]
    assert sched._first_turn(cycle, 3, 1) == 3  # type: ignore[arg-type]
