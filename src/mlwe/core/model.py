"""The control plane's records: a workload as it lives in the cluster, and a queue."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlwe.core.capacity import ReplicaAlloc, Shape
from mlwe.core.lifecycle import HOLDING, State, Transition
from mlwe.core.resources import Resources
from mlwe.core.spec import QueueSpec, WorkloadSpec


@dataclass(slots=True)
class Workload:
    """A submitted workload and everything the control plane knows about it.

    Only the control plane mutates these; everyone else reads them.
    """

    id: str
    spec: WorkloadSpec
    seq: int  # arrival order, the last tie-break of every ordering
    submit_time: float
    deadline: float | None
    state: State = State.PENDING
    history: list[Transition] = field(default_factory=list)
    placement: tuple[ReplicaAlloc, ...] = ()
    attempt: int = 0  # incremented each time it is placed
    failures: int = 0  # failures that count against max_retries
    started_at: float | None = None  # start of the current attempt's run
    work_done: float = 0.0  # seconds of work saved in checkpoints (survives preemption)
    run_base_work: float = 0.0  # work_done when the current run started
    progress: float = 0.0  # fraction done, as last reported
    last_checkpoint_at: float | None = None  # absolute time of the last reported checkpoint
    preempted_by: str | None = None
    victims: tuple[str, ...] = ()  # outstanding victims it waits for, when it preempted
    preemptions: int = 0
    borrowing: bool = False  # admitted on quota borrowed from its cohort
    pending_reason: str = ""
    exit_code: int | None = None
    failure_cause: str | None = None
    priority_override: int | None = None  # set by SetPriority; else the spec's priority

    # ------------------------------------------------------------------ derived
    @property
    def priority(self) -> int:
        p = self.priority_override
        return self.spec.priority if p is None else p

    @property
    def queue(self) -> str:
        return self.spec.queue

    @property
    def holding(self) -> bool:
        return self.state in HOLDING

    def gpus(self) -> float:
        """GPUs the whole workload asks for (all replicas)."""
        return self.spec.resources.gpu * self.spec.replicas / 1000

    def allocated(self) -> Resources:
        total = Resources()
        for a in self.placement:
            total = total + a.res
        return total

    def request(self) -> Resources:
        """Total request without VRAM (VRAM depends on the model chosen)."""
        return self.spec.replica_request() * self.spec.replicas

    def remaining_estimate(self, now: float) -> float | None:
        """Estimated seconds of work left, from the user's estimate; None if none given."""
        est = self.spec.estimated_duration
        if est is None:
            return None
        done = self.work_done
        if self.started_at is not None:
            run = max(0.0, now - self.started_at - self._restart_overhead())
            done = max(done, self.run_base_work + run)
        if self.progress > 0:
            done = max(done, self.progress * est)
        return max(0.0, est - done)

    def _restart_overhead(self) -> float:
        """Seconds a resumed run spends restoring its checkpoint before doing work."""
        return self.spec.restart_cost if self.run_base_work > 0 else 0.0

    def last_checkpoint(self, now: float) -> float | None:
        """When the current run last saved its state (None: never, all work would be lost)."""
        started = self.started_at
        if started is None:
            return None
        best = self.last_checkpoint_at
        spec = self.spec
        interval = spec.checkpoint_interval
        if interval:
            # a checkpoint every `interval` seconds of work (after any restart), each
            # taking checkpoint_cost (read once: victim searches ask this of every holder)
            begin = started + (spec.restart_cost if self.run_base_work > 0 else 0.0)
            period = interval + spec.checkpoint_cost
            n = int(max(0.0, now - begin) // period)
            if n > 0:
                t = begin + n * period
                best = t if best is None else max(best, t)
        return best

    def next_checkpoint(self, now: float) -> float | None:
        """When the current run's next periodic checkpoint is done (None: it takes
        none): a checkpoint every ``checkpoint_interval`` seconds of work, counted
        from the end of its restore, each taking ``checkpoint_cost``."""
        started = self.started_at
        spec = self.spec
        interval = spec.checkpoint_interval
        if started is None or not interval:
            return None
        begin = started + self._restart_overhead()
        period = interval + spec.checkpoint_cost
        return begin + (int(max(0.0, now - begin) // period) + 1) * period

    def saved_work(self, now: float) -> float:
        """Seconds of work that survive if the current run stopped now."""
        saved = self.work_done
        interval = self.spec.checkpoint_interval
        if self.started_at is not None and interval:
            elapsed = max(0.0, now - self.started_at - self._restart_overhead())
            n = int(elapsed // (interval + self.spec.checkpoint_cost))
            saved = max(saved, self.run_base_work + n * interval)
        return saved

    def work_at_risk(self, now: float) -> float:
        """Seconds of work lost if it were stopped now without a chance to checkpoint."""
        started = self.started_at
        if started is None:
            return 0.0
        ckpt = self.last_checkpoint(now)
        return max(0.0, now - (ckpt if ckpt is not None else started))

    def runtime(self, now: float) -> float:
        return 0.0 if self.started_at is None else max(0.0, now - self.started_at)


@dataclass(slots=True)
class Queue:
    spec: QueueSpec
    nominal: Resources
    borrow_limit: Resources
    usage: list[int] = field(default_factory=lambda: [0, 0, 0, 0])

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def cohort(self) -> str | None:
        return self.spec.cohort

    def usage_vector(self) -> Resources:
        u = self.usage
        return Resources(u[0], u[1], u[2], u[3])

    def over_nominal(self) -> bool:
        n = self.nominal
        u = self.usage
        return u[0] > n.gpu or u[1] > n.vram or u[2] > n.cpu or u[3] > n.ram


#: one instance per distinct shape: equal shapes are then the same object, so the
#: cycle's memo tables compare them by identity
_SHAPES: dict[Shape, Shape] = {}
#: the interned shape per tuple of its fields (what :func:`shape_of` looks up first)
_SHAPE_OF: dict[tuple[object, ...], Shape] = {}


def shape_of(spec: WorkloadSpec, models: tuple[str, ...]) -> Shape:
    r = spec.resources
    g = spec.gang
    sel = spec.node_selector
    # the fields in Shape's order: a shape seen before is found without building
    # one (a frozen dataclass, hashed at birth) only to be thrown away for its twin
    fields = (
        r.gpu, r.cpu, r.memory, r.vram, models if r.gpu else (),
        tuple(sorted(sel.items())) if sel else (),
        (g.tasks_per_node or 0) if g is not None else 0,
        (g.max_replicas_per_node or 0) if g is not None else 0,
        g.placement.value if g is not None else "",
    )
    got = _SHAPE_OF.get(fields)
    if got is not None:
        return got
    s = Shape(*fields)
    if len(_SHAPES) > 100_000:
        _SHAPES.clear()
        _SHAPE_OF.clear()
    got = _SHAPE_OF[fields] = _SHAPES.setdefault(s, s)
    return got
