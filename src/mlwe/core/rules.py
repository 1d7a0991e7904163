"""Rules shared by verification (the control plane) and planning (the policies).

Keeping one definition means a policy can never plan something the control
plane would reject for a different reading of the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mlwe.core.capacity import CapacityIndex
from mlwe.core.model import Queue, Workload
from mlwe.core.resources import UNLIMITED

_NAMES = ("gpu", "vram", "cpu", "ram")


def quota_verdict(
    queues: Mapping[str, Queue],
    usage: Mapping[str, Sequence[int]],
    qname: str,
    req: Sequence[int],
) -> tuple[list[str], bool]:
    """Whether ``req`` more fits queue ``qname``: (reasons it does not, whether it borrows).

    Kueue cohort semantics: a queue may use up to its nominal quota; above
    that it borrows idle nominal quota of its cohort, up to its borrowing
    limit and never beyond the cohort's total nominal quota.
    """
    q = queues[qname]
    nominal = q.nominal.as_tuple()
    if all(n >= UNLIMITED for n in nominal):
        return [], False
    after = [u + r for u, r in zip(usage[qname], req)]
    if all(a <= n for a, n in zip(after, nominal)):
        return [], False
    over = [i for i in range(4) if after[i] > nominal[i]]
    if q.cohort is None:
        text = ", ".join(f"{_NAMES[i]} {after[i]} > nominal {nominal[i]}" for i in over)
        return [f"queue {q.name} quota exceeded: {text} (no cohort to borrow from)"], False
    limit = q.borrow_limit.as_tuple()
    members = [m for m in queues.values() if m.cohort == q.cohort]
    reasons = []
    for i in over:
        if after[i] - nominal[i] > limit[i]:
            reasons.append(
                f"queue {q.name}: {_NAMES[i]} would borrow {after[i] - nominal[i]},"
                f" above its borrowing limit {limit[i]}"
            )
            continue
        cohort_nominal = sum(min(m.nominal.as_tuple()[i], UNLIMITED) for m in members)
        cohort_used = sum(usage[m.name][i] for m in members) + req[i]
        if cohort_used > cohort_nominal:
            reasons.append(
                f"cohort {q.cohort}: {_NAMES[i]} {cohort_used} would exceed the cohort's"
                f" nominal {cohort_nominal}"
            )
    return reasons, not reasons


def reclaim_violations(queues: Mapping[str, Queue], p: Workload, v: Workload) -> list[str]:
    """Reasons ``p`` may not reclaim lent quota from ``v`` (empty: it may)."""
    qp, qv = queues[p.queue], queues[v.queue]
    if qp.cohort is None or qp.cohort != qv.cohort or qp.name == qv.name:
        return [f"reclaim: {v.id} is not in another queue of {p.id}'s cohort"]
    out = []
    if not qv.over_nominal():
        out.append(f"reclaim: queue {qv.name} is within its nominal quota; nothing is borrowed")
    after = [u + r for u, r in zip(qp.usage, p.request().as_tuple())]
    if any(a > n for a, n in zip(after, qp.nominal.as_tuple())):
        out.append(f"reclaim: {p.id} would take queue {qp.name} above its nominal quota")
    return out


def frees_what_is_needed(capacity: CapacityIndex, v: Workload, p: Workload) -> bool:
    """Whether evicting ``v`` frees a resource ``p`` asks for, on hardware ``p`` accepts.

    A CPU-only job never frees GPUs; a job on T4s frees nothing for a job
    that accepts only A100s.
    """
    want = p.spec.resources
    for a in v.placement:
        info = capacity.info(a.node)
        if want.gpu:
            if (
                a.res.gpu
                and info.gpu_model is not None
                and (not p.spec.gpu_models or info.gpu_model in p.spec.gpu_models)
                and info.vram_per_gpu >= p.spec.min_vram_per_gpu
            ):
                return True
        elif (want.cpu and a.res.cpu) or (want.memory and a.res.ram):
            return True
    return False


def preemptible(v: Workload, now: float) -> str | None:
    """Why ``v`` may not be a victim at all (None: it may be)."""
    if v.spec.protected:
        return "protected"
    if v.started_at is not None and v.runtime(now) < v.spec.min_runtime:
        return f"under its minimum runtime ({v.runtime(now):.0f}s < {v.spec.min_runtime:.0f}s)"
    if v.spec.min_progress > 0 and v.progress < v.spec.min_progress:
        return f"under its minimum progress ({v.progress:.0%} < {v.spec.min_progress:.0%})"
    return None


#: Preemption among equals (reason "gain"): a victim must have run this long in
#: its current attempt, and may be preempted this way at most this many times.
GAIN_MIN_QUANTUM_S = 600.0
GAIN_MAX_PREEMPTIONS = 6


def gain_violations(p: Workload, v: Workload, now: float) -> list[str]:
    """Why ``p`` may not preempt ``v`` among equals (empty: it may)."""
    out = []
    if p.priority != v.priority:
        out.append(
            f"gain: {p.id} (priority {p.priority}) and {v.id} (priority {v.priority}) are not"
            " equals; a higher priority preempts by rule 'priority'"
        )
    if v.runtime(now) < GAIN_MIN_QUANTUM_S:
        out.append(
            f"gain: {v.id} has run {v.runtime(now):.0f}s of its minimum quantum"
            f" {GAIN_MIN_QUANTUM_S:.0f}s"
        )
    if v.preemptions >= GAIN_MAX_PREEMPTIONS:
        out.append(
            f"gain: {v.id} was already preempted {v.preemptions} times"
            f" (bound {GAIN_MAX_PREEMPTIONS})"
        )
    return out
