"""A run that resumed from saved service is no victim among equals until it has
lasted ``SchedulerConfig.gain_quantum_share`` x that service (and the core's
minimum quantum in any case): a long job evicted late is not evicted again soon
after each restart. The gain pool (``could_gain``), the search without a pool
(``gain_choice``) and a whole scheduling cycle agree on it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlwe.core.actions import Evict
from mlwe.core.clock import ManualClock
from mlwe.core.controlplane import ControlPlane
from mlwe.core.gain import GainAsk, GainPool, could_gain, gain_choice, resume_quantum
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload, shape_of
from mlwe.core.policies.deadline import INF
from mlwe.core.policies.preemption import CheapestVictims, candidate_nodes
from mlwe.core.rules import GAIN_MIN_QUANTUM_S
from mlwe.core.scheduler import SchedulerConfig, default_scheduler
from tests.core.builders import (
    A100,
    cluster,
    gpu_job,
    gpu_node,
    ok,
    place_on,
    release,
    run_to_running,
    running_on,
    submit,
)

PERIOD = 1800.0
SAVED = 40 * PERIOD  # the service the long job resumes from


def _resumed() -> tuple[ControlPlane, ManualClock]:
    """One 8-GPU node; a long job ran 40 checkpoint periods, was evicted, and now
    runs again from its last checkpoint; a short job of the same priority waits."""
    cp, clock = cluster(gpu_node("n0", gpus=8))
    running_on(cp, gpu_job("long", gpu=8, checkpoint_interval=PERIOD,
                           estimated_duration=2_000_000.0), "n0")
    clock.advance(SAVED + 10.0)
    ok(cp.apply([Evict("long", "test")]))
    release(cp, "long")
    ok(cp.apply([place_on(cp, "long", "n0")]))
    run_to_running(cp, ["long"])
    v = cp.get("long")
    assert v.run_base_work == pytest.approx(SAVED) and v.started_at == clock.now()
    submit(cp, gpu_job("short", gpu=8, estimated_duration=600.0))
    return cp, clock


def _searches(cp: ControlPlane, cfg: SchedulerConfig) -> tuple[bool, bool]:
    """Whether the pool's test and the search without a pool find the long job."""
    now = cp.now()
    w = cp.get("short")
    shape = shape_of(w.spec, (A100,))
    fork = cp.capacity.fork()

    def remaining(x: Workload, t: float) -> float | None:
        return x.remaining_estimate(t)

    nodes = frozenset(candidate_nodes(fork, shape))
    pool = GainPool(cfg, remaining, cp, w.priority, now)
    found, _ = could_gain(cfg, remaining, w, shape, fork, nodes, set(), frozenset(), pool, now)
    ask = GainAsk(cfg, remaining, CheapestVictims(), cp, fork, w, shape, set(), frozenset(), now)
    choice, _ = gain_choice(ask, INF)
    return found, choice is not None


def test_the_quantum_is_the_core_minimum_or_a_share_of_the_saved_service() -> None:
    cp, _ = _resumed()
    v = cp.get("long")
    assert resume_quantum(v, 0.0) == GAIN_MIN_QUANTUM_S
    assert resume_quantum(v, 0.25) == pytest.approx(0.25 * SAVED)
    assert resume_quantum(v, 1e-6) == GAIN_MIN_QUANTUM_S  # never below the core's
    assert resume_quantum(cp.get("short"), 0.25) == GAIN_MIN_QUANTUM_S  # saved nothing


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5])
def test_a_resumed_run_is_no_victim_before_its_quantum(share: float) -> None:
    cfg = SchedulerConfig(gain_preemption=True, gain_quantum_share=share)
    quantum = max(GAIN_MIN_QUANTUM_S, share * SAVED)
    # just after a checkpoint (cheap to evict) past the core's minimum quantum, and
    # just after the first checkpoint past this share's quantum
    early = 2 * PERIOD + 1.0
    late = (quantum // PERIOD + 1) * PERIOD + 1.0
    for at, expected in ((early, quantum <= early), (late, True)):
        cp, clock = _resumed()
        clock.advance(at)
        assert _searches(cp, cfg) == (expected, expected), (share, at)
        # a whole cycle of the default policy decides the same
        sched = default_scheduler()
        sched.config = replace(sched.config, gain_quantum_share=share)
        sched.run_cycle(cp)
        assert (cp.get("long").state is State.PREEMPTING) is expected, (share, at)


def test_the_default_share_and_bad_shares() -> None:
    assert SchedulerConfig().gain_quantum_share == 0.25
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gain_quantum_share"):
            SchedulerConfig(gain_quantum_share=bad)
