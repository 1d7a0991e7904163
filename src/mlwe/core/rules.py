"""Rules shared by verification (the control plane) and planning (the policies).

Keeping one definition means a policy can never plan something the control
plane would reject for a different reading of the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mlwe.core.capacity import FULL, CapacityIndex, NodeInfo, ReplicaAlloc
from mlwe.core.model import Queue, Workload
from mlwe.core.resources import UNLIMITED, Resources
from mlwe.core.spec import NodeStatus, WorkloadSpec

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


def placement_violations(
    spec: WorkloadSpec, replicas: object, capacity: CapacityIndex
) -> list[str]:
    """Why ``replicas`` is not a valid placement of ``spec`` (empty: it is), before
    free capacity and quota are counted: one allocation per replica, each on a
    known, ready node that matches the request (see :func:`replica_violations`),
    and, for a gang, the replicas per node its shape allows.

    Reads ``capacity`` only for the nodes' static description and status; free
    room is the caller's check (it depends on what the batch has placed so far).
    ``replicas`` may be anything: a malformed placement is a reason, not a crash.
    """
    if not isinstance(replicas, tuple) or len(replicas) != spec.replicas:
        n = len(replicas) if isinstance(replicas, tuple) else "?"
        return [f"gang incomplete: {n} replica placements for {spec.replicas} replicas"]
    reasons: list[str] = []
    for k, r in enumerate(replicas):
        if not isinstance(r, ReplicaAlloc) or not isinstance(r.res, Resources):
            reasons.append(f"replica {k}: not a replica allocation")
            continue
        if r.node not in capacity:
            reasons.append(f"replica {k}: unknown node {r.node!r}")
            continue
        problems = replica_violations(r, spec, capacity.info(r.node), capacity.status(r.node))
        reasons += [f"replica {k}: {p}" for p in problems]
    if spec.gang is not None and not reasons:
        counts: dict[str, int] = {}
        for r in replicas:
            counts[r.node] = counts.get(r.node, 0) + 1
        reasons += [f"gang shape: {p}" for p in spec.gang.per_node_problems(counts)]
    return reasons


def replica_violations(
    r: ReplicaAlloc, spec: WorkloadSpec, info: NodeInfo, status: NodeStatus
) -> list[str]:
    """Why allocation ``r`` cannot hold one replica of ``spec`` on the node ``info``
    describes, in state ``status`` (empty: it can): the node is ready, quantities
    are not negative, the allocation is exactly the request, the node matches the
    selector, and GPU work gets an accepted model with enough VRAM on the right
    devices (CPU-only work gets no devices and no VRAM)."""
    reasons = []
    want = spec.resources
    if status is not NodeStatus.READY:
        reasons.append(f"node {r.node} is {status.value}")
    neg = r.res.negative()
    if neg or r.gpu_per_device < 0:
        reasons.append(f"negative quantities ({', '.join(neg) or 'gpu'})")
        return reasons
    if r.res.gpu != want.gpu or r.res.cpu != want.cpu or r.res.ram != want.memory:
        reasons.append(
            f"allocation {r.res} does not match the request"
            f" (gpu={want.gpu}, cpu={want.cpu}, ram={want.memory})"
        )
    if spec.node_selector and any(
        info.labels.get(key) != val for key, val in spec.node_selector.items()
    ):
        reasons.append(f"node {r.node} does not match node_selector")
    if want.gpu:
        reasons += _gpu_violations(r, spec, info)
    elif r.devices or r.res.vram:
        reasons.append("GPU devices or VRAM given to a CPU-only workload")
    return reasons


def _gpu_violations(r: ReplicaAlloc, spec: WorkloadSpec, info: NodeInfo) -> list[str]:
    """The GPU half of :func:`replica_violations` (``spec`` asks for GPUs)."""
    want = spec.resources
    if info.gpu_model is None:
        return [f"node {r.node} has no GPU"]
    reasons = []
    if spec.gpu_models and info.gpu_model not in spec.gpu_models:
        reasons.append(
            f"{info.gpu_model} on {r.node} is not among accepted models"
            f" {', '.join(spec.gpu_models)}"
        )
    if info.vram_per_gpu < spec.min_vram_per_gpu:
        reasons.append(
            f"{info.gpu_model} has {info.vram_per_gpu} MiB VRAM per GPU,"
            f" {spec.min_vram_per_gpu} MiB required"
        )
    devices = max(1, want.gpu // FULL)
    expect_vram = (
        want.vram
        if want.vram is not None
        else (
            devices * info.vram_per_gpu
            if want.gpu >= FULL
            else want.gpu * info.vram_per_gpu // FULL
        )
    )
    if r.res.vram != expect_vram:
        reasons.append(f"VRAM {r.res.vram} MiB allocated, {expect_vram} MiB expected")
    if want.gpu < FULL and len(r.devices) != 1:
        reasons.append("a fractional GPU lives on exactly one device")
    if r.gpu_per_device != (FULL if want.gpu >= FULL else want.gpu):
        reasons.append(
            f"{r.gpu_per_device} milli per device; whole GPUs are"
            " whole devices, a fraction is the fraction asked"
        )
    if r.res.vram > info.vram_per_gpu * len(r.devices):
        reasons.append("VRAM larger than its devices hold")
    return reasons


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


def gain_allowed(p: Workload, v: Workload, now: float) -> bool:
    """``not gain_violations(p, v, now)``, without writing the reasons: a victim
    search asks it of every equal on every node it examines, and most fail."""
    started = v.started_at
    return (
        p.priority == v.priority
        and (0.0 if started is None else max(0.0, now - started)) >= GAIN_MIN_QUANTUM_S
        and v.preemptions < GAIN_MAX_PREEMPTIONS
    )


def gain_violations(p: Workload, v: Workload, now: float) -> list[str]:
    """Why ``p`` may not preempt ``v`` among equals (empty: it may; see
    :func:`gain_allowed` for the test alone)."""
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
