"""What the scheduler writes down: why a workload waits, and the decision record
of a placement (the rank, the ordering's reason, what the placement leaves free).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlwe.core.capacity import FULL, ReplicaAlloc, Shape
from mlwe.core.controlplane import ControlPlane
from mlwe.core.cycle import Reservation, shape_text
from mlwe.core.decisions import DecisionRecord, digest
from mlwe.core.model import Workload
from mlwe.core.policies.deadline import INF
from mlwe.core.policies.ordering import OrderingPolicy, slack
from mlwe.core.resources import format_duration


def why_waiting(
    w: Workload,
    shape: Shape,
    models: Sequence[str],
    exclude: frozenset[str],
    reservation: Reservation | None,
) -> str:
    what = shape_text(shape, w.spec.replicas, "/".join(models) if models else None)
    text = f"no room for {what}"
    if exclude and reservation is not None:
        text += f" outside the nodes reserved for {reservation.workload}"
    return text

def place_record(
    ordering: OrderingPolicy,
    placement_name: str,
    scheduler_name: str,
    cp: ControlPlane,
    w: Workload,
    shape: Shape,
    allocs: tuple[ReplicaAlloc, ...],
    rank: int,
    n: int,
    now: float,
    borrowing: bool,
    reservation: Reservation | None,
    cause_id: str | None,
) -> DecisionRecord:
    first = allocs[0].node
    # (one replica, the common case, without building the set of nodes)
    nodes = [first] if len(allocs) == 1 else list(dict.fromkeys(a.node for a in allocs))
    capacity = cp.capacity
    model = capacity.info(first).gpu_model
    where = ", ".join(nodes[:8]) if len(nodes) > 1 else first
    if len(nodes) > 8:
        where += f" (+{len(nodes) - 8} more)"
    why = [f"placed {shape_text(shape, w.spec.replicas, model)} on {where}"]
    s = slack(w, now)
    if s != INF:
        why.append(f"rank {rank + 1}/{n} by {ordering.name} (priority {w.priority},"
                   f" slack {format_duration(s)})")
    else:
        why.append(f"rank {rank + 1}/{n} by {ordering.name} (priority {w.priority})")
    explain = getattr(ordering, "explain", None)
    if explain is not None:
        why.append(f"ranked by {explain(w, now)}")
    if shape.gpu:
        left = capacity.whole_free_gpus(first)
        if shape.gpu >= FULL:
            left -= sum(len(a.devices) for a in allocs if a.node == first)
        why.append(f"{placement_name}: leaves {left if left > 0 else 0} whole GPU(s) free on {first}")
    if borrowing:
        why.append(f"borrows idle quota from cohort {cp.queues[w.queue].cohort}")
    if reservation is not None:
        why.append(f"backfilled: does not delay {reservation.workload}'s reservation")
    if w.attempt:
        why.append(f"attempt {w.attempt + 1}, resumes from {w.work_done:.0f}s of saved work")
    return DecisionRecord(
        "place",
        w.id,
        f"{scheduler_name}/{placement_name}",
        ",".join(nodes) if len(nodes) > 1 else first,
        tuple(why),
        (model or "cpu",),
        digest(cp.version, w.id, shape, rank),
        cause_id,
    )
