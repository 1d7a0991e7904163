"""The working state of one scheduling cycle and the small pure rules it uses.

A :class:`Cycle` is what one ``Scheduler.plan`` call decides on (the queue in
order, a capacity fork, per-queue usage) and what it has decided so far; a
:class:`Turn` is one workload's turn in it. The scheduler's phases
(:mod:`mlwe.core.scheduler`) read and update these; nothing here touches the
live control plane.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

from mlwe.core.actions import Action
from mlwe.core.capacity import CapacityIndex, ReplicaAlloc, Shape
from mlwe.core.controlplane import ControlPlane
from mlwe.core.decisions import DecisionRecord
from mlwe.core.model import Workload
from mlwe.core.resources import format_gpu
from mlwe.core.spec import NodeStatus

if TYPE_CHECKING:
    from mlwe.core.gain import GainPool


@dataclass(slots=True)
class Reservation:
    workload: str
    start: float
    nodes: frozenset[str]


@dataclass(slots=True)
class Plan:
    version: int
    actions: list[Action] = field(default_factory=list)
    decisions: list[DecisionRecord] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)
    reservation: Reservation | None = None
    considered: int = 0
    #: workloads not examined because nothing further could start
    stopped_early: int = 0



#: a shape that did not fit this cycle: (shape, replicas, kept off reserved nodes)
FitKey = tuple[Shape, int, bool]
#: a victim search that found nothing: (shape, replicas, priority, queue, kept off)
VictimKey = tuple[Shape, int, int, str, bool]
#: a GPU shape that did not fit: (models, gpu, cpu, ram, replicas, kept off)
Dominator = tuple[tuple[str, ...], int, int, int, int, bool]


class GainMiss(NamedTuple):
    """A gain search of this cycle that found nothing (``could_gain`` said so).

    A later one for the same priority, shape, replicas and excluded nodes, with no
    eviction in between, whose preemptor is expected to run at least ``r_p``
    finds nothing either: its victims must clear higher bars (``gain_ratio`` x
    its remaining time, and that time plus their cost), over the same or fewer
    ready nodes, with no more room free (within a cycle the fork only gives room
    away), under the same loss budget (its GPUs are the shape's). The earliest
    wake time it would report is no earlier than that search's, already taken
    when ``woke`` (its scan was accounted); otherwise it is computed."""

    r_p: float
    woke: bool


@dataclass(slots=True)
class Cycle:
    """What one cycle decides on and has decided so far (the plan's working state)."""

    cp: ControlPlane
    plan: Plan
    cause_id: str | None
    now: float
    order: list[Workload]
    fork: CapacityIndex
    #: per-queue usage, including what this cycle placed
    usage: dict[str, list[int]]
    #: whether the cycle may stop once nothing further fits (see can_stop_early)
    can_stop: bool
    gain_on: bool
    #: whether some queue is in a cohort (quota may be reclaimed)
    cohorts: bool = False
    #: per priority, what a gain search reads of the holders it may evict
    #: (:class:`mlwe.core.gain.GainPool`; once per cycle, when a search asks)
    gain_pools: dict[int, GainPool] = field(default_factory=dict)
    #: gain searches known to find nothing, by (priority, shape, replicas, excluded
    #: nodes, evictions so far, the rotating start of the nodes it examines when
    #: they are a window of the candidates, else None): the least expected
    #: remaining time of a preemptor for which it found nothing
    gain_misses: dict[tuple[int, Shape, int, frozenset[str], int, int | None], GainMiss] = field(
        default_factory=dict
    )
    #: the candidate nodes of each tuple of GPU models, as a set
    node_sets: dict[tuple[str, ...], frozenset[str]] = field(default_factory=dict)
    failed: set[FitKey] = field(default_factory=set)
    #: shapes that did not fit this cycle: a larger one of the same models cannot
    #: fit either (capacity only shrinks within a cycle)
    dominated: list[Dominator] = field(default_factory=list)
    #: workloads already chosen as victims in this cycle
    taken: set[str] = field(default_factory=set)
    #: preemptors whose drain plan took their turn in this cycle
    draining: set[str] = field(default_factory=set)
    no_victims: set[VictimKey] = field(default_factory=set)
    failed_searches: int = 0
    gain_searches: int = 0
    reservation: Reservation | None = None
    #: the first blocked workload: backfill must not delay it
    head: Workload | None = None
    #: whether the head's reservation was projected in this cycle
    projected: bool = False
    #: whether something was placed ahead of the head (its cached reservation is stale)
    dirty: bool = False
    #: the last answer of Scheduler._first_turn: (from rank, most whole GPUs free
    #: on a node, the first rank that could fit or has victims)
    first_turn: tuple[int, int, int] | None = None


@dataclass(slots=True)
class Turn:
    """One workload's turn in a cycle."""

    w: Workload
    rank: int
    models: tuple[str, ...]
    shape: Shape
    #: nodes it must keep off (the head's reservation)
    exclude: frozenset[str]

    @property
    def replicas(self) -> int:
        return self.w.spec.replicas

    def fit_key(self) -> FitKey:
        return (self.shape, self.replicas, bool(self.exclude))


def can_stop_early(
    cp: ControlPlane,
    order: Sequence[Workload],
    preemption: bool,
    summary: tuple[int, bool] | None = None,
) -> bool:
    """Whether the cycle may stop once nothing further can start: all waiting work
    asks for GPUs, no cohort could reclaim quota, and no preemption is possible
    (nobody waiting ranks above the lowest holder). ``summary``: the highest
    priority waiting and whether all waiting work asks for GPUs, where the
    ordering already knows them (:meth:`SizeAware.queue_summary`)."""
    if not order or any(q.cohort for q in cp.queues.values()):
        return False
    lowest = min(cp.holding_by_priority, default=1 << 62) if preemption else 1 << 62
    if summary is not None:
        top, all_gpu = summary
        return all_gpu and top <= lowest
    # one pass over a queue that may be long: every workload asks for GPUs, and
    # none ranks above the lowest holder (w.priority, spelt out)
    for w in order:
        spec = w.spec
        p = w.priority_override
        if not spec.resources.gpu or (spec.priority if p is None else p) > lowest:
            return False
    return True


def dominated(
    dominated: Sequence[Dominator], shape: Shape, replicas: int, excluded: bool
) -> bool:
    """Whether a shape at least as large, of the same models, already failed to fit
    (only plain GPU shapes compare: selectors and VRAM asks are not ordered)."""
    return any(
        dm == shape.models and dx == excluded and shape.gpu >= dg
        and shape.cpu >= dc and shape.ram >= dr and replicas >= dn
        and not shape.selector and not shape.vram
        for dm, dg, dc, dr, dn, dx in dominated
    )


@lru_cache(maxsize=4096)  # a cycle writes the same few shapes for every waiting workload
def shape_text(shape: Shape, replicas: int, model: str | None) -> str:
    parts = []
    if shape.gpu:
        parts.append(f"{format_gpu(shape.gpu)} x {model or 'GPU'}")
    parts.append(f"{shape.cpu / 1000:g} cpu")
    parts.append(f"{shape.ram // 1024} GiB")
    text = ", ".join(parts)
    return f"{replicas} x [{text}]" if replicas > 1 else text


def hold(
    fork: CapacityIndex, planned: Iterable[str], cp: ControlPlane, victims: Sequence[str]
) -> None:
    """Keep what a preemptor waits for: nothing ranked after it may take room on the
    nodes it plans to use, nor on its victims' nodes (in this cycle's fork only),
    while the victims checkpoint. Without this, lower-priority work fills the gap
    (a gang's replica planned on free room, say) and the preemptor evicts again."""
    nodes = set(planned)
    for vid in victims:
        nodes.update(a.node for a in cp.workloads[vid].placement)
    for node in sorted(nodes):
        if fork.status(node) is NodeStatus.READY:
            fork.set_status(node, NodeStatus.CORDONED)




def request_of(allocs: Sequence[ReplicaAlloc]) -> list[int]:
    """What ``allocs`` take together: [gpu, vram, cpu, ram]."""
    out = [0, 0, 0, 0]
    for a in allocs:
        r = a.res
        out[0] += r.gpu
        out[1] += r.vram
        out[2] += r.cpu
        out[3] += r.ram
    return out
