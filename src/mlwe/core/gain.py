"""Preemption among equals, when it pays: which running workloads of a waiting
workload's own priority are worth evicting for it, judged on expected remaining
run times (learned, or the user's), against what the eviction costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mlwe.core.capacity import CapacityIndex, Shape
from mlwe.core.controlplane import ControlPlane
from mlwe.core.model import Workload
from mlwe.core.policies.deadline import INF
from mlwe.core.policies.ordering import attained
from mlwe.core.policies.preemption import PreemptionPolicy, VictimChoice
from mlwe.core.resources import format_duration

if TYPE_CHECKING:
    from mlwe.core.scheduler import SchedulerConfig

#: victims, expected gain and cost (GPU-seconds), and the reason text
GainChoice = tuple[VictimChoice, float, float, str]


def gain_choice(
    cfg: SchedulerConfig,
    remaining: Callable[[Workload, float], float | None],
    preemption: PreemptionPolicy,
    cp: ControlPlane,
    fork: CapacityIndex,
    w: Workload,
    shape: Shape,
    taken: set[str],
    exclude: frozenset[str],
    now: float,
) -> tuple[GainChoice | None, float]:
    """Victims of ``w``'s own priority worth evicting for it, or None.

    A victim qualifies when it is expected to run ``gain_ratio`` times longer
    than ``w`` and longer than ``w`` plus what evicting it costs (work since
    its last checkpoint, its restore, its checkpoint pause); the core adds the
    minimum quantum and the bound on preemptions. The set is taken only if the
    expected gain, in GPU-seconds (each victim's GPUs x the time by which ``w``
    is shorter), exceeds the cost (each victim's GPUs x its cost, plus a gang
    penalty for each broken gang).

    Also returns the earliest moment a victim passed over because evicting it now
    would lose too much becomes cheap (its next checkpoint; INF: none)."""
    wake = [INF]
    ratio = cfg.gain_ratio
    quantum = cfg.gain_prior_s

    def expect(x: Workload) -> float:
        # learned (or the user's) remaining time; with neither, the heavy-tail
        # prior of least-attained-service: as long again as it has run, and at
        # least a quantum
        r = remaining(x, now)
        return r if r is not None else max(attained(x, now), quantum)

    r_p = expect(w)

    def cost_of(v: Workload) -> float:
        return v.work_at_risk(now) + v.spec.restart_cost + v.spec.checkpoint_cost

    g_p = max(w.gpus(), 1e-3)
    share = cfg.gain_wait_share

    def worth(v: Workload) -> bool:
        r_v = expect(v)
        if not (r_v >= ratio * r_p and r_v > r_p + cost_of(v)):
            return False
        iv = v.spec.checkpoint_interval
        if iv:
            # evict now, losing the work since its last checkpoint, or wait for
            # its next one (delaying the preemptor): now only if the loss is
            # small against the wait
            since = v.work_at_risk(now)
            wait = max(0.0, iv + v.spec.checkpoint_cost - since)
            if max(v.gpus(), 1e-3) * since > share * g_p * wait:
                wake[0] = min(wake[0], now + wait + 1e-6)
                return False
        return True

    select = getattr(preemption, "select", None)
    if select is None:
        return None, wake[0]
    try:
        choice = select(cp, fork, w, shape, taken, exclude, equals=worth)
    except TypeError:
        return None, wake[0]  # a victim policy that knows no "equals"
    if choice is None:
        return None, wake[0]
    gain = cost = 0.0
    for v, _ in choice.victims:
        r_v = expect(v)
        g = max(v.gpus(), 1e-3)
        gain += g * (r_v - r_p)
        cost += g * cost_of(v) + (3600.0 if v.spec.replicas > 1 else 0.0)
    if gain <= cost:
        return None, wake[0]
    why = (
        f"preemption among equals: expected gain {gain / 3600:.2f} GPU-h > cost"
        f" {cost / 3600:.2f} GPU-h ({w.id} expects {format_duration(r_p)} left)"
    )
    return (choice, gain, cost, why), wake[0]
