"""Projection of start times, for deadline admission and backfill reservations.

``project_start`` plays the near future forward on a capacity fork: holders
release at their estimated ends, and the workloads ahead in the queue are
placed in order as room appears (no backfill, so the answer is conservative).
Work with no estimate is assumed to run ``default_estimate_s`` and the answer
says so. This is an estimate from what users declared, never from the true
durations a simulator knows.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlwe.core.capacity import CapacityIndex, ReplicaAlloc, Shape
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload, shape_of
from mlwe.core.policies.placement import BestFit, PlacementPolicy
from mlwe.core.resources import format_duration
from mlwe.core.rules import preemptible

INF = math.inf


@dataclass(frozen=True, slots=True)
class Projection:
    start: float  # INF: never, with what is known
    allocs: tuple[ReplicaAlloc, ...]
    assumed: int  # how many estimates were assumed (no user estimate given)


def accepted_models(cp: ControlPlane, w: Workload) -> tuple[str, ...]:
    """GPU models ``w`` accepts that exist in the cluster, least valuable adequate first."""
    if not w.spec.resources.gpu:
        return ()
    present = cp.capacity.models()
    names = w.spec.gpu_models or tuple(present)
    ok = [m for m in names if m in present and cp.catalog[m].vram_mib >= w.spec.min_vram_per_gpu]
    return tuple(sorted(ok, key=lambda m: (cp.catalog[m].rank, m)))


#: expected seconds of work left for a workload at a time (None: nobody knows)
Remaining = Callable[[Workload, float], "float | None"]


def _declared(w: Workload, now: float) -> float | None:
    return w.remaining_estimate(now)


def project_start(
    cp: ControlPlane,
    target: Workload,
    ahead: Sequence[Workload] = (),
    *,
    fork: CapacityIndex | None = None,
    default_estimate_s: float = 3600.0,
    preemptible_below: int | None = None,
    grace_s: float = 30.0,
    placement: PlacementPolicy | None = None,
    max_steps: int = 10_000,
    remaining: Remaining | None = None,
) -> Projection:
    """When ``target`` could start if ``ahead`` go first, in order.

    ``preemptible_below``: holders under this priority (and preemptible) are
    treated as evicted after ``grace_s`` (what the default policy would do).
    """
    now = cp.now()
    left = remaining or _declared
    f = (fork or cp.capacity).fork()
    place = placement or BestFit()
    heap, assumed = _holder_ends(cp, left, now, default_estimate_s, preemptible_below, grace_s)
    seq = len(heap)
    heapq.heapify(heap)
    order = [*ahead, target]
    shapes = {id(w): shape_of(w.spec, accepted_models(cp, w)) for w in order}
    t = now
    steps = 0
    #: nodes freed since the first in order was last found unable to fit (None:
    #: try it): a node tested and found short stays short until it frees more,
    #: which adds it again (nothing is taken from the fork while it waits)
    freed: set[str] | None = None
    while True:
        while order:
            w = order[0]
            shape = shapes[id(w)]
            if freed is not None and not _may_fit_now(f, shape, freed):
                freed.clear()
                break
            allocs = place.place(f, shape, w.spec.replicas)
            if allocs is None:
                freed = set()
                break
            freed = None
            order.pop(0)
            if w is target:
                return Projection(t, allocs, assumed)
            rem = left(w, t)
            if rem is None:
                rem = default_estimate_s
                assumed += 1
            seq += 1
            heapq.heappush(heap, (t + rem + w.spec.restart_cost, seq, allocs))
        if not heap or steps >= max_steps:
            return Projection(INF, (), assumed)
        t, _, allocs = heapq.heappop(heap)
        for a in allocs:
            f.release(a)
        if freed is not None:
            freed.update(a.node for a in allocs)
        while heap and heap[0][0] <= t:  # everything ending at the same moment
            for a in heapq.heappop(heap)[2]:
                f.release(a)
                if freed is not None:
                    freed.add(a.node)
        steps += 1


def _holder_ends(
    cp: ControlPlane,
    left: Remaining,
    now: float,
    default_estimate_s: float,
    preemptible_below: int | None,
    grace_s: float,
) -> tuple[list[tuple[float, int, tuple[ReplicaAlloc, ...]]], int]:
    """When each holder is expected to release what it holds, as (end, seq,
    allocations), and how many ends were assumed (nobody estimated them): a
    holder being stopped, or one :func:`project_start` treats as evicted, after
    ``grace_s``; the rest after their expected remaining time."""
    heap: list[tuple[float, int, tuple[ReplicaAlloc, ...]]] = []
    append = heap.append
    assumed = 0
    workloads = cp.workloads
    stopping = _STOPPING
    for seq, wid in enumerate(cp.holder_ids(), 1):
        h = workloads[wid]
        if h.state in stopping or (
            preemptible_below is not None
            and h.priority < preemptible_below
            and preemptible(h, now) is None
        ):
            end = now + grace_s
        else:
            rem = left(h, now)
            if rem is None:
                rem = max(0.0, default_estimate_s - h.runtime(now))
                assumed += 1
            end = now + rem
        append((end, seq, h.placement))
    return heap, assumed


#: holders :func:`_holder_ends` sees releasing within the grace period
_STOPPING = frozenset((State.PREEMPTING, State.STOPPING))


def _may_fit_now(f: CapacityIndex, shape: Shape, freed: set[str]) -> bool:
    """Whether ``shape`` (one replica or several), which did not fit before ``freed``'s nodes
    released work, may fit now (a quick necessary test; the placement decides).
    Only a node of ``freed`` changed, so the placement can differ only if one of
    them can now hold a replica: it has the GPU one asks for. That holds for a
    gang as for one replica: the nodes that could hold a replica before are the
    only ones that can now, each with no more room than it had. CPU-only work is
    always tried."""
    if not shape.gpu:
        return True
    free_gpu, need = f.free_gpu, shape.gpu
    return any(free_gpu(n) >= need for n in freed)


class DeadlineStatus(enum.StrEnum):
    FEASIBLE = "feasible"
    AT_RISK = "at-risk"
    INFEASIBLE = "infeasible"
    NO_DEADLINE = "no-deadline"


@dataclass(frozen=True, slots=True)
class DeadlineVerdict:
    status: DeadlineStatus
    earliest_start: float
    earliest_completion: float
    deadline: float | None
    reason: str


def deadline_admission(
    cp: ControlPlane,
    w: Workload,
    ahead: Sequence[Workload] = (),
    *,
    margin: float = 0.1,
    default_estimate_s: float = 3600.0,
    grace_s: float = 30.0,
    remaining: Remaining | None = None,
) -> DeadlineVerdict:
    """Whether ``w``'s deadline is still reachable, given what runs and what is queued.

    Feasible: projected completion leaves at least ``margin`` of the estimate
    as slack. At risk: it makes the deadline with less slack than that, or the
    projection had to assume durations nobody declared. Infeasible: projected
    completion is after the deadline, or there is no room for it at all.
    """
    now = cp.now()
    if w.deadline is None:
        return DeadlineVerdict(DeadlineStatus.NO_DEADLINE, now, now, None, "no deadline given")
    rem = (remaining or _declared)(w, now)
    if rem is None or now + rem > w.deadline:
        return _unprojected_verdict(now, rem, w.deadline)
    ahead_strong = [a for a in ahead if a.priority >= w.priority and a.id != w.id]
    proj = project_start(
        cp,
        w,
        ahead_strong[:200],
        default_estimate_s=default_estimate_s,
        preemptible_below=w.priority,
        grace_s=grace_s,
        remaining=remaining,
    )
    return _projected_verdict(w, now, rem, w.deadline, proj, margin, default_estimate_s)


def _unprojected_verdict(now: float, rem: float | None, deadline: float) -> DeadlineVerdict:
    """The verdict without a projection: nothing to project from (no estimate), or
    the deadline is missed even if ``w`` started now on an empty cluster."""
    if rem is None:
        return DeadlineVerdict(
            DeadlineStatus.AT_RISK,
            now,
            INF,
            deadline,
            "no estimated_duration: completion cannot be projected",
        )
    return DeadlineVerdict(
        DeadlineStatus.INFEASIBLE,
        now,
        now + rem,
        deadline,
        f"needs {format_duration(rem)} but only {format_duration(deadline - now)} remain"
        " even on an empty cluster",
    )


def _projected_verdict(
    w: Workload,
    now: float,
    rem: float,
    deadline: float,
    proj: Projection,
    margin: float,
    default_estimate_s: float,
) -> DeadlineVerdict:
    """The verdict from ``w``'s projected start: infeasible when it never starts or
    misses, at risk on thin slack or assumed durations, else feasible."""
    if proj.start == INF:
        return DeadlineVerdict(
            DeadlineStatus.INFEASIBLE,
            INF,
            INF,
            deadline,
            "no node in the cluster can hold it, even when everything ahead has finished",
        )
    restart = w.spec.restart_cost if w.work_done > 0 else 0.0
    done = proj.start + restart + rem
    slack = deadline - done
    where = ", ".join(sorted({a.node for a in proj.allocs}))
    base = (
        f"earliest start in {format_duration(proj.start - now)} on {where}, completion in"
        f" {format_duration(done - now)}, deadline in {format_duration(deadline - now)}"
    )
    if proj.assumed:
        base += (
            f" (assumed {default_estimate_s:.0f}s for {proj.assumed} workloads without estimates)"
        )
    if slack < 0:
        return DeadlineVerdict(
            DeadlineStatus.INFEASIBLE,
            proj.start,
            done,
            deadline,
            f"misses by {format_duration(-slack)}: {base}",
        )
    if slack < margin * rem or proj.assumed:
        return DeadlineVerdict(
            DeadlineStatus.AT_RISK,
            proj.start,
            done,
            deadline,
            f"slack {format_duration(slack)}: {base}",
        )
    return DeadlineVerdict(
        DeadlineStatus.FEASIBLE,
        proj.start,
        done,
        deadline,
        f"slack {format_duration(slack)}: {base}",
    )
