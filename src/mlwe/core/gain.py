"""Preemption among equals, when it pays: which running workloads of a waiting
workload's own priority are worth evicting for it, judged on expected remaining
run times (learned, or the user's), against what the eviction costs.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import TYPE_CHECKING, NamedTuple

from mlwe.core.capacity import CapacityIndex, ReplicaAlloc, Shape
from mlwe.core.controlplane import ControlPlane
from mlwe.core.model import Workload
from mlwe.core.policies.deadline import INF
from mlwe.core.policies.ordering import attained
from mlwe.core.policies.preemption import EVICTABLE, PreemptionPolicy, VictimChoice
from mlwe.core.resources import format_duration
from mlwe.core.rules import GAIN_MAX_PREEMPTIONS, GAIN_MIN_QUANTUM_S
from mlwe.core.spec import NodeStatus

if TYPE_CHECKING:
    from mlwe.core.scheduler import SchedulerConfig

#: victims, expected gain and cost (GPU-seconds), and the reason text
GainChoice = tuple[VictimChoice, float, float, str]


def expected_left(
    remaining: Callable[[Workload, float], float | None], x: Workload, now: float, prior_s: float
) -> float:
    """What gain decisions take as ``x``'s remaining run time: the learned (or the
    user's) estimate; with neither, the heavy-tail prior of least attained service
    (as long again as it has run, and at least ``prior_s``)."""
    r = remaining(x, now)
    return r if r is not None else max(attained(x, now), prior_s)


class Candidate(NamedTuple):
    """What a gain search reads of one holder it may consider as a victim (a named
    tuple: one is built per holder per cycle, and a frozen dataclass costs several
    times as much to build)."""

    id: str
    #: expected remaining run time, and what evicting it now costs (seconds)
    left: float
    cost: float
    #: its GPUs x the work it would lose now, and the time to its next checkpoint
    #: (both 0.0 without a checkpoint interval)
    loss: float
    wait: float
    #: not protected, past its minimum runtime and progress
    evictable: bool
    #: the GPU (in thousandths) each of its replicas holds, and where
    held: tuple[tuple[str, int], ...]


def gain_candidates(
    cfg: SchedulerConfig,
    remaining: Callable[[Workload, float], float | None],
    cp: ControlPlane,
    priority: int,
    now: float,
) -> list[Candidate]:
    """The holders of ``priority`` that a gain search examines at all (running or
    starting, past the minimum quantum, under the bound on preemptions), reduced
    to what :func:`gain_choice`'s victim test reads of them: the part of a search
    that does not depend on the preemptor, computed once per cycle so that a
    search that cannot find anything is known without scanning nodes
    (:func:`could_gain`)."""
    out: list[Candidate] = []
    append = out.append
    workloads = cp.workloads
    prior = cfg.gain_prior_s
    # each holder once, in the order of the nodes it holds on (a gang appears on several)
    for wid in cp.holder_ids():
        v = workloads[wid]
        p = v.priority_override
        started = v.started_at
        if (
            (v.spec.priority if p is None else p) != priority
            or v.state not in EVICTABLE
            or v.preemptions >= GAIN_MAX_PREEMPTIONS
            or started is None
            or now - started < GAIN_MIN_QUANTUM_S
        ):
            continue
        # what follows is, inline, v.work_at_risk(now), expected_left(...),
        # cost_of(v, now) and preemptible(v, now): one holder per call
        # otherwise costs six calls, and this runs for every holder each cycle
        spec = v.spec
        iv = spec.checkpoint_interval
        restore = spec.restart_cost if v.run_base_work > 0 else 0.0
        ckpt = v.last_checkpoint_at
        if iv:
            begin = started + restore
            period = iv + spec.checkpoint_cost
            n = int(max(0.0, now - begin) // period)
            if n > 0:
                t = begin + n * period
                ckpt = t if ckpt is None else max(ckpt, t)
        risk = max(0.0, now - (ckpt if ckpt is not None else started))
        left = remaining(v, now)
        if left is None:
            done = max(v.work_done, v.run_base_work + max(0.0, now - started - restore))
            left = max(done, prior)
        run = max(0.0, now - started)
        since = risk if iv else 0.0
        append(Candidate(
            wid,
            left,
            risk + spec.restart_cost + spec.checkpoint_cost,
            max(v.gpus(), 1e-3) * since if iv else 0.0,
            max(0.0, iv + spec.checkpoint_cost - since) if iv else 0.0,
            not (
                spec.protected
                or run < spec.min_runtime
                or (spec.min_progress > 0 and v.progress < spec.min_progress)
            ),
            _held(v),
        ))
    return out


#: (placement, what gain tests read of it) per holder: a placement is immutable, so
#: its summary is kept while the workload holds the same one
_HELD: dict[str, tuple[tuple[ReplicaAlloc, ...], tuple[tuple[str, int], ...]]] = {}


def _held(v: Workload) -> tuple[tuple[str, int], ...]:
    """``(node, GPU in thousandths)`` per replica of ``v``'s placement."""
    got = _HELD.get(v.id)
    if got is None or got[0] is not v.placement:
        if len(_HELD) > 200_000:
            _HELD.clear()
        got = _HELD[v.id] = (v.placement, tuple((a.node, a.res.gpu) for a in v.placement))
    return got[1]


def could_gain(
    cfg: SchedulerConfig,
    remaining: Callable[[Workload, float], float | None],
    w: Workload,
    shape: Shape,
    fork: CapacityIndex,
    nodes: Container[str],
    taken: Container[str],
    exclude: Container[str],
    candidates: list[Candidate],
    now: float,
) -> tuple[bool, float]:
    """Whether a gain search for one replica of ``w`` over the candidate ``nodes``
    could find anything, and the earliest moment a victim it passes over for the
    work it would lose becomes cheap (INF: none).

    The test is the search's own, on what it would examine (candidates not yet
    taken, on a ready node of ``nodes`` outside ``exclude``): a victim must pass
    :func:`gain_choice`'s test for ``w``, and some node must then have the GPU the
    replica asks for (free on ``fork`` plus what the passing victims hold there).
    False means the search finds nothing, and the wake time is the one it would
    report (both checked against the search in tests/sim/test_mlwe_policy.py)."""
    r_p = expected_left(remaining, w, now, cfg.gain_prior_s)
    floor = cfg.gain_ratio * r_p
    budget = cfg.gain_wait_share * max(w.gpus(), 1e-3)
    wake = INF
    freed: dict[str, int] = {}
    for c in candidates:
        left = c.left
        if not (left >= floor and left > r_p + c.cost) or c.id in taken:
            continue  # the test first: it turns most candidates away, and costs nothing
        seen = [
            (node, gpu) for node, gpu in c.held
            if node in nodes and node not in exclude and fork.status(node) is NodeStatus.READY
        ]
        if not seen:
            continue
        if c.loss > budget * c.wait:  # evicting now loses too much: wait for its checkpoint
            wake = min(wake, now + c.wait + 1e-6)
            continue
        if c.evictable:
            for node, gpu in seen:
                freed[node] = freed.get(node, 0) + gpu
    need = shape.gpu
    free_gpu = fork.free_gpu
    return any(free_gpu(node) + gpu >= need for node, gpu in freed.items()), wake


def cost_of(v: Workload, now: float) -> float:
    """What evicting ``v`` now costs it, in seconds: the work since its last
    checkpoint, its restore and its checkpoint pause."""
    return v.work_at_risk(now) + v.spec.restart_cost + v.spec.checkpoint_cost


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
        return expected_left(remaining, x, now, quantum)

    r_p = expect(w)

    g_p = max(w.gpus(), 1e-3)
    share = cfg.gain_wait_share

    def worth(v: Workload) -> bool:
        r_v = expect(v)
        if not (r_v >= ratio * r_p and r_v > r_p + cost_of(v, now)):
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
        cost += g * cost_of(v, now) + (3600.0 if v.spec.replicas > 1 else 0.0)
    if gain <= cost:
        return None, wake[0]
    why = (
        f"preemption among equals: expected gain {gain / 3600:.2f} GPU-h > cost"
        f" {cost / 3600:.2f} GPU-h ({w.id} expects {format_duration(r_p)} left)"
    )
    return (choice, gain, cost, why), wake[0]
