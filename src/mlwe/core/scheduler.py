"""One scheduling cycle: order the queue, place, preempt, backfill; return a plan.

The scheduler only reads the control plane. It decides on a capacity fork
(never on the live index) and returns a :class:`Plan`: typed actions plus the
decision records that explain them. ``run_cycle`` hands the plan to
``ControlPlane.apply``, which verifies it again and applies it as one unit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from mlwe.core.actions import Action, Place, Preempt
from mlwe.core.capacity import FULL, CapacityIndex, ReplicaAlloc, Shape
from mlwe.core.controlplane import ApplyResult, ControlPlane
from mlwe.core.decisions import DecisionRecord, digest
from mlwe.core.estimator import RuntimeEstimator
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload, shape_of
from mlwe.core.policies.deadline import (
    INF,
    DeadlineVerdict,
    accepted_models,
    deadline_admission,
    project_start,
)
from mlwe.core.policies.ordering import (
    OrderingPolicy,
    PriorityDeadlineFairShare,
    SizeAware,
    attained,
    slack,
)
from mlwe.core.policies.placement import BestFit, PlacementPolicy
from mlwe.core.policies.preemption import (
    CheapestVictims,
    PreemptionPolicy,
    VictimChoice,
    describe_choice,
)
from mlwe.core.resources import format_duration, format_gpu
from mlwe.core.rules import quota_verdict
from mlwe.core.spec import NodeStatus, WorkloadSpec


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    preemption: bool = True
    #: EASY backfill: the first blocked workload gets a reservation; later ones
    #: may start ahead of it only if they do not delay that reservation.
    backfill: bool = True
    #: Stop at the first workload that cannot be placed (strict FIFO semantics).
    strict_order: bool = False
    #: Assumed run time of work that declared none, in projections only.
    default_estimate_s: float = 3600.0
    #: Victim searches that find nothing, per cycle, before the rest wait for the
    #: next cycle (each is a scan of candidate nodes; a full cluster of
    #: equal-priority work would otherwise make every cycle scan it for each job).
    max_failed_preemption_searches: int = 16
    #: preemption among equals (reason "gain") when the expected gain exceeds the
    #: cost, judged on the scheduler's estimator (off without one)
    gain_preemption: bool = False
    #: gain searches per cycle (each scans candidate nodes); the first blocked
    #: workloads in order are the ones that gain most
    max_gain_searches: int = 4
    #: a victim must be expected to run this many times longer than the preemptor
    gain_ratio: float = 2.0
    #: expected run time of work nothing is known about (no history, no user
    #: estimate), in gain decisions only: LAS's prior
    gain_prior_s: float = 600.0
    #: evict an equal now only if its GPUs x the work it would lose is at most
    #: this share of the preemptor's GPUs x the time to the victim's next
    #: checkpoint; otherwise the scheduler wakes then and looks again
    gain_wait_share: float = 0.1


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


def _shape_text(shape: Shape, replicas: int, model: str | None) -> str:
    parts = []
    if shape.gpu:
        parts.append(f"{format_gpu(shape.gpu)} x {model or 'GPU'}")
    parts.append(f"{shape.cpu / 1000:g} cpu")
    parts.append(f"{shape.ram // 1024} GiB")
    text = ", ".join(parts)
    return f"{replicas} x [{text}]" if replicas > 1 else text


class Scheduler:
    """Composes an ordering, a placement and a preemption policy into cycles."""

    def __init__(
        self,
        ordering: OrderingPolicy | None = None,
        placement: PlacementPolicy | None = None,
        preemption: PreemptionPolicy | None = None,
        config: SchedulerConfig | None = None,
        name: str = "mlwe-default",
        estimator: RuntimeEstimator | None = None,
    ) -> None:
        #: learned run times (None: the policy uses only what users declare)
        self.estimator = estimator
        self.ordering = ordering or PriorityDeadlineFairShare()
        self.placement = placement or BestFit()
        self.preemption = preemption or CheapestVictims()
        self.config = config or SchedulerConfig()
        self.name = name
        self._models: dict[tuple[tuple[str, ...], int, int], tuple[str, ...]] = {}
        self._total_gpu: tuple[int, int] = (-1, 0)
        #: nodes each waiting preemptor plans to use (scheduler memory, not cluster state)
        self._nominated: dict[str, frozenset[str]] = {}
        self._shapes: dict[str, tuple[int, WorkloadSpec, tuple[str, ...], Shape]] = {}
        self._reservation_cache: tuple[str, int, float, Reservation | None] | None = None
        #: the next moment a deferred preemption among equals becomes cheap
        self._wake_at = INF

    # ------------------------------------------------------------------ helpers
    def models_for(self, cp: ControlPlane, w: Workload) -> tuple[str, ...]:
        if not w.spec.resources.gpu:
            return ()
        key = (w.spec.gpu_models, w.spec.min_vram_per_gpu, len(cp.on_node))
        got = self._models.get(key)
        if got is None:
            got = self._models[key] = accepted_models(cp, w)
        return got

    def shape_for(self, cp: ControlPlane, w: Workload) -> tuple[tuple[str, ...], Shape]:
        """Accepted models and the placement shape of ``w`` (cached: specs are immutable)."""
        n = len(cp.on_node)
        got = self._shapes.get(w.id)
        if got is None or got[0] != n or got[1] is not w.spec:
            models = self.models_for(cp, w)
            got = (n, w.spec, models, shape_of(w.spec, models))
            if len(self._shapes) > 200_000:
                self._shapes.clear()
            self._shapes[w.id] = got
        return got[2], got[3]

    def total_gpu(self, cp: ControlPlane) -> int:
        n = len(cp.on_node)
        if self._total_gpu[0] != n:
            self._total_gpu = (n, sum(i.capacity.gpu for i in cp.capacity.nodes()) // FULL)
        return self._total_gpu[1]

    def ordered(self, cp: ControlPlane) -> list[Workload]:
        return self.ordering.order(cp.queued_workloads(), cp.queues, self.total_gpu(cp), cp.now())

    def admission(self, cp: ControlPlane, w: Workload) -> DeadlineVerdict:
        """Deadline admission for a queued (or just submitted) workload."""
        order = self.ordered(cp)
        ahead: list[Workload] = []
        for other in order:
            if other.id == w.id:
                break
            ahead.append(other)
        return deadline_admission(
            cp, w, ahead, default_estimate_s=self.config.default_estimate_s,
            remaining=self.remaining if self.estimator is not None else None,
        )

    # ------------------------------------------------------------------ hooks
    def prepare(self, cp: ControlPlane) -> list[Action]:
        """Actions to apply before a cycle (e.g. LAS demotions); none by default."""
        return []

    def next_wakeup(self, cp: ControlPlane) -> float | None:
        """When the scheduler wants a cycle by time alone: the next checkpoint of a
        victim it chose to wait for (None: no such moment)."""
        now = cp.now()
        if self._wake_at <= now:
            self._wake_at = INF
        return None if self._wake_at == INF else self._wake_at

    # --------------------------------------------------------------------- plan
    def remaining(self, w: Workload, now: float) -> float | None:
        """Expected seconds of work left: the user's estimate, else the learned one."""
        rem = w.remaining_estimate(now)
        if rem is None and self.estimator is not None:
            est = self.estimator.estimate(w, attained(w, now))
            if est is not None:
                rem = est.remaining_s
        return rem

    def plan(self, cp: ControlPlane, cause_id: str | None = None) -> Plan:
        plan = Plan(version=cp.version)
        if self.estimator is not None:
            self.estimator.attach(cp)
        queued = cp.queued_workloads()
        if not queued:
            return plan
        now = cp.now()
        cfg = self.config
        order = self.ordering.order(queued, cp.queues, self.total_gpu(cp), now)
        fork = cp.capacity.fork()
        usage = {n: list(q.usage) for n, q in cp.queues.items()}
        failed: set[tuple[Shape, int, bool]] = set()
        taken: set[str] = set()
        no_victims: set[tuple[Shape, int, int, str, bool]] = set()
        failed_searches = 0
        # the cycle stops once nothing further can start: no free GPU anywhere, no
        # CPU-only work waiting, and no preemption possible (nobody waiting ranks
        # above the lowest holder; no cohort that could reclaim quota)
        can_stop = (
            bool(order)
            and all(w.spec.resources.gpu for w in order)
            and not any(q.cohort for q in cp.queues.values())
            and (
                not cfg.preemption
                or max(w.priority for w in order)
                <= min(cp.holding_by_priority, default=1 << 62)
            )
        )
        # shapes that did not fit this cycle: a larger one of the same models cannot
        # fit either (capacity only shrinks within a cycle)
        dominated: list[tuple[tuple[str, ...], int, int, int, int, bool]] = []
        gain_on = cfg.gain_preemption and cfg.preemption and self.estimator is not None
        gain_searches = 0
        reservation: Reservation | None = None
        head: Workload | None = None  # the first blocked workload: backfill must not delay it
        projected = False
        dirty = False
        n = len(order)
        for rank, w in enumerate(order):
            plan.considered += 1
            if w.victims:
                live = [v for v in w.victims if cp.workloads[v].state is State.PREEMPTING]
                if live:
                    plan.pending[w.id] = (
                        f"waiting for {len(live)} victim(s) to release: {', '.join(live)}"
                    )
                    _hold(fork, self._nominated.get(w.id, ()), cp, live)
                    continue
            models, shape = self.shape_for(cp, w)
            if w.spec.resources.gpu and not models:
                plan.pending[w.id] = "no node in the cluster has a GPU model it accepts"
                continue
            replicas = w.spec.replicas
            exclude: frozenset[str] = frozenset()
            if reservation is not None and not self._ends_before(w, now, reservation.start):
                exclude = reservation.nodes
            key = (shape, replicas, bool(exclude))
            allocs = None
            if key not in failed and dominated and shape.gpu:
                for dm, dg, dc, dr, dn, dx in dominated:
                    if (
                        dm == shape.models and dx == bool(exclude) and shape.gpu >= dg
                        and shape.cpu >= dc and shape.ram >= dr and replicas >= dn
                        and not shape.selector and not shape.vram
                    ):
                        failed.add(key)
                        break
            if key not in failed:
                allocs = self.placement.place(fork, shape, replicas, exclude)
                if allocs is not None and head is not None and not projected:
                    # the first workload that could pass the blocked head: only now is
                    # the head's reservation worth projecting (EASY backfill)
                    for a in reversed(allocs):
                        fork.release(a)
                    reservation = self._reserve(cp, head, fork, now, dirty)
                    projected = True
                    if reservation is not None:
                        nodes = ", ".join(sorted(reservation.nodes))
                        plan.pending[head.id] += f"; holds a reservation on {nodes}"
                        if not self._ends_before(w, now, reservation.start):
                            exclude = reservation.nodes
                    key = (shape, replicas, bool(exclude))
                    allocs = self.placement.place(fork, shape, replicas, exclude)
                if allocs is None:
                    failed.add(key)
                    if shape.gpu and not shape.selector and not shape.vram:
                        dominated.append(
                            (shape.models, shape.gpu, shape.cpu, shape.ram, replicas,
                             bool(exclude))
                        )
            if allocs is not None:
                req = _sum(allocs)
                qreasons, borrowing = quota_verdict(cp.queues, usage, w.queue, req)
                if qreasons:
                    for a in reversed(allocs):
                        fork.release(a)
                    plan.pending[w.id] = qreasons[0]
                    continue
                for i in range(4):
                    usage[w.queue][i] += req[i]
                plan.actions.append(Place(w.id, allocs))
                self._nominated.pop(w.id, None)
                plan.decisions.append(
                    self._place_record(
                        cp, w, shape, allocs, rank, n, now, borrowing, reservation, cause_id
                    )
                )
                continue
            # it does not fit now: preempt, or wait (and maybe hold a reservation)
            if (
                can_stop
                and (not gain_on or gain_searches >= cfg.max_gain_searches)
                and not fork.has_free_gpu()
            ):
                plan.pending[w.id] = self._why_waiting(w, shape, models, exclude, reservation)
                for rest in order[rank + 1 :]:
                    if not rest.pending_reason:
                        plan.pending[rest.id] = "no room: no free GPU in the cluster"
                plan.stopped_early = n - rank - 1
                break
            if cfg.preemption and head is not None and not projected:
                # preempting past the blocked head must respect its reservation too
                reservation = self._reserve(cp, head, fork, now, dirty)
                projected = True
                if reservation is not None:
                    nodes = ", ".join(sorted(reservation.nodes))
                    plan.pending[head.id] += f"; holds a reservation on {nodes}"
                    if not self._ends_before(w, now, reservation.start):
                        exclude = reservation.nodes
            pkey = (shape, replicas, w.priority, w.queue, bool(exclude))
            if (
                cfg.preemption
                and pkey not in no_victims
                and failed_searches < cfg.max_failed_preemption_searches
            ):
                # a workload ranked after the blocked head may not preempt its way onto
                # the head's reserved nodes either: backfill rules bind preemption too
                choice = self.preemption.select(cp, fork, w, shape, taken, exclude)
                if choice is None:
                    no_victims.add(pkey)
                    failed_searches += 1
                else:
                    qreasons, _ = quota_verdict(cp.queues, usage, w.queue, _sum(choice.allocs))
                    reclaim = any(why.value == "reclaim" for _, why in choice.victims)
                    if not qreasons or reclaim:
                        for v, why in choice.victims:
                            plan.actions.append(Preempt(v.id, w.id, why))
                            taken.add(v.id)
                        planned = frozenset(a.node for a in choice.allocs)
                        self._nominated[w.id] = planned
                        _hold(fork, planned, cp, [v.id for v, _ in choice.victims])
                        plan.decisions.append(
                            DecisionRecord(
                                kind="preempt",
                                workload=w.id,
                                policy=f"{self.name}/{self.preemption.name}",
                                chosen="evict " + ", ".join(v.id for v, _ in choice.victims),
                                reasons=tuple(describe_choice(w, choice, cp)),
                                candidates=choice.alternatives,
                                inputs_digest=digest(cp.version, w.id, shape, sorted(taken)),
                                cause_id=cause_id,
                            )
                        )
                        plan.pending[w.id] = (
                            f"preempting {len(choice.victims)} workload(s); placed once released"
                        )
                        continue
            if gain_on and gain_searches < cfg.max_gain_searches:
                gain_searches += 1
                got = self._gain_choice(cp, fork, w, shape, taken, exclude, now)
                if got is not None:
                    choice, gain, cost, why_gain = got
                    for v, why in choice.victims:
                        plan.actions.append(Preempt(v.id, w.id, why))
                        taken.add(v.id)
                    planned = frozenset(a.node for a in choice.allocs)
                    self._nominated[w.id] = planned
                    _hold(fork, planned, cp, [v.id for v, _ in choice.victims])
                    plan.decisions.append(
                        DecisionRecord(
                            kind="preempt",
                            workload=w.id,
                            policy=f"{self.name}/{self.preemption.name}+gain",
                            chosen="evict " + ", ".join(v.id for v, _ in choice.victims),
                            reasons=(why_gain, *describe_choice(w, choice, cp)),
                            candidates=choice.alternatives,
                            inputs_digest=digest(cp.version, w.id, shape, sorted(taken)),
                            cause_id=cause_id,
                            extra={"gain_gpu_s": round(gain, 3), "cost_gpu_s": round(cost, 3)},
                        )
                    )
                    plan.pending[w.id] = (
                        f"preempting {len(choice.victims)} equal-priority workload(s) for a"
                        " shorter expected run; placed once released"
                    )
                    continue
            plan.pending[w.id] = self._why_waiting(w, shape, models, exclude, reservation)
            if cfg.strict_order:
                for rest in order[rank + 1 :]:
                    plan.pending[rest.id] = f"strict order: waits behind {w.id}"
                break
            if cfg.backfill and head is None:
                head = w
                dirty = bool(plan.actions)
        plan.reservation = reservation
        return plan

    def _reserve(
        self, cp: ControlPlane, w: Workload, fork: CapacityIndex, now: float, dirty: bool
    ) -> Reservation | None:
        """The head's reservation: when and where it is projected to start.

        Reused while the head and the set of resource holders are unchanged and
        nothing was placed ahead of it in this cycle (the projection is the
        costly part of a cycle on a full cluster).
        """
        cached = self._reservation_cache
        if (
            not dirty
            and cached is not None
            and cached[0] == w.id
            and cached[1] == cp.holding_epoch
            and now <= cached[2]
        ):
            return cached[3]
        proj = project_start(
            cp,
            w,
            fork=fork,
            default_estimate_s=self.config.default_estimate_s,
            placement=self.placement,
            remaining=self.remaining if self.estimator is not None else None,
        )
        res = None
        if proj.start < INF:
            res = Reservation(w.id, proj.start, frozenset(a.node for a in proj.allocs))
        self._reservation_cache = (w.id, cp.holding_epoch, proj.start, res)
        return res

    def _gain_choice(
        self,
        cp: ControlPlane,
        fork: CapacityIndex,
        w: Workload,
        shape: Shape,
        taken: set[str],
        exclude: frozenset[str],
        now: float,
    ) -> tuple[VictimChoice, float, float, str] | None:
        """Victims of ``w``'s own priority worth evicting for it, or None.

        A victim qualifies when it is expected to run ``gain_ratio`` times longer
        than ``w`` and longer than ``w`` plus what evicting it costs (work since
        its last checkpoint, its restore, its checkpoint pause); the core adds the
        minimum quantum and the bound on preemptions. The set is taken only if the
        expected gain, in GPU-seconds (each victim's GPUs x the time by which ``w``
        is shorter), exceeds the cost (each victim's GPUs x its cost, plus a gang
        penalty for each broken gang)."""
        ratio = self.config.gain_ratio
        quantum = self.config.gain_prior_s

        def expect(x: Workload) -> float:
            # learned (or the user's) remaining time; with neither, the heavy-tail
            # prior of least-attained-service: as long again as it has run, and at
            # least a quantum
            r = self.remaining(x, now)
            return r if r is not None else max(attained(x, now), quantum)

        r_p = expect(w)

        def cost_of(v: Workload) -> float:
            return v.work_at_risk(now) + v.spec.restart_cost + v.spec.checkpoint_cost

        g_p = max(w.gpus(), 1e-3)
        share = self.config.gain_wait_share

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
                    self._wake_at = min(self._wake_at, now + wait + 1e-6)
                    return False
            return True

        select = getattr(self.preemption, "select", None)
        if select is None:
            return None
        try:
            choice = select(cp, fork, w, shape, taken, exclude, equals=worth)
        except TypeError:
            return None  # a victim policy that knows no "equals"
        if choice is None:
            return None
        gain = cost = 0.0
        for v, _ in choice.victims:
            r_v = expect(v)
            g = max(v.gpus(), 1e-3)
            gain += g * (r_v - r_p)
            cost += g * cost_of(v) + (3600.0 if v.spec.replicas > 1 else 0.0)
        if gain <= cost:
            return None
        why = (
            f"preemption among equals: expected gain {gain / 3600:.2f} GPU-h > cost"
            f" {cost / 3600:.2f} GPU-h ({w.id} expects {format_duration(r_p)} left)"
        )
        return choice, gain, cost, why

    def _ends_before(self, w: Workload, now: float, t: float) -> bool:
        """Whether ``w`` is expected to be done by ``t`` (backfill may then use the
        reserved nodes): by the user's estimate, else the learned one; never for
        work nobody can estimate."""
        rem = self.remaining(w, now)
        return rem is not None and now + rem <= t

    def _why_waiting(
        self,
        w: Workload,
        shape: Shape,
        models: Sequence[str],
        exclude: frozenset[str],
        reservation: Reservation | None,
    ) -> str:
        what = _shape_text(shape, w.spec.replicas, "/".join(models) if models else None)
        text = f"no room for {what}"
        if exclude and reservation is not None:
            text += f" outside the nodes reserved for {reservation.workload}"
        return text

    def _place_record(
        self,
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
        nodes = list(dict.fromkeys(a.node for a in allocs))
        model = cp.capacity.info(nodes[0]).gpu_model
        why = [
            f"placed {_shape_text(shape, w.spec.replicas, model)} on {', '.join(nodes[:8])}"
            + (f" (+{len(nodes) - 8} more)" if len(nodes) > 8 else "")
        ]
        s = slack(w, now)
        order_why = f"rank {rank + 1}/{n} by {self.ordering.name} (priority {w.priority}"
        if s != INF:
            order_why += f", slack {format_duration(s)}"
        why.append(order_why + ")")
        explain = getattr(self.ordering, "explain", None)
        if explain is not None:
            why.append(f"ranked by {explain(w, now)}")
        if shape.gpu:
            left = cp.capacity.whole_free_gpus(nodes[0]) - (
                sum(len(a.devices) for a in allocs if a.node == nodes[0])
                if shape.gpu >= FULL
                else 0
            )
            why.append(
                f"{self.placement.name}: leaves {max(0, left)} whole GPU(s) free on {nodes[0]}"
            )
        if borrowing:
            why.append(f"borrows idle quota from cohort {cp.queues[w.queue].cohort}")
        if reservation is not None:
            why.append(f"backfilled: does not delay {reservation.workload}'s reservation")
        if w.attempt:
            why.append(f"attempt {w.attempt + 1}, resumes from {w.work_done:.0f}s of saved work")
        return DecisionRecord(
            kind="place",
            workload=w.id,
            policy=f"{self.name}/{self.placement.name}",
            chosen=",".join(nodes),
            reasons=tuple(why),
            candidates=tuple(cp.capacity.info(x).gpu_model or "cpu" for x in nodes[:1]),
            inputs_digest=digest(cp.version, w.id, shape, rank),
            cause_id=cause_id,
        )

    # -------------------------------------------------------------------- cycle
    def run_cycle(self, cp: ControlPlane, cause_id: str | None = None) -> ApplyResult:
        plan = self.plan(cp, cause_id)
        result = cp.apply(plan.actions, plan.version, cause_id=cause_id, decisions=plan.decisions)
        if result.accepted:
            cp.note_pending(plan.pending, self.name, cause_id)
        return result


def _hold(
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




def _sum(allocs: Sequence[ReplicaAlloc]) -> list[int]:
    out = [0, 0, 0, 0]
    for a in allocs:
        r = a.res
        out[0] += r.gpu
        out[1] += r.vram
        out[2] += r.cpu
        out[3] += r.ram
    return out


def default_scheduler(name: str = "mlwe-default") -> Scheduler:
    """The engine's default policy (the replays' "mlwe"): run times learned from
    completed workloads (seeded from what the control plane holds, so a
    recovered store's history counts), size-aware ordering within a priority,
    preemption among equals when the expected gain exceeds the cost."""
    est = RuntimeEstimator()
    return Scheduler(
        ordering=SizeAware(est), estimator=est, name=name,
        config=SchedulerConfig(gain_preemption=True),
    )
