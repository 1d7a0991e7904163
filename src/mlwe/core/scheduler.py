"""One scheduling cycle: order the queue, place, preempt, backfill; return a plan.

The scheduler only reads the control plane. It decides on a capacity fork
(never on the live index) and returns a :class:`Plan`: typed actions plus the
decision records that explain them. ``run_cycle`` hands the plan to
``ControlPlane.apply``, which verifies it again and applies it as one unit.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import compress, count, islice
from operator import attrgetter
from typing import Any

from mlwe.core.actions import Action, Place, Preempt, PreemptReason
from mlwe.core.capacity import FULL, CapacityIndex, ReplicaAlloc, Shape
from mlwe.core.controlplane import ApplyResult, ControlPlane
from mlwe.core.cycle import (
    Cycle,
    GainMiss,
    Plan,
    Reservation,
    Turn,
    can_stop_early,
    dominated,
    hold,
    request_of,
)
from mlwe.core.decisions import DecisionRecord, digest
from mlwe.core.estimator import RuntimeEstimator
from mlwe.core.gain import (
    DrainPlan,
    GainAsk,
    GainPool,
    Holders,
    Rewaits,
    cost_of,
    could_gain,
    drain_choice,
    expected_left,
    gain_choice,
    outlasts,
    rested,
    victim_rewait,
)
from mlwe.core.lifecycle import QUEUED, State
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
)
from mlwe.core.policies.placement import BestFit, PlacementPolicy
from mlwe.core.policies.preemption import (
    EVICTABLE,
    CheapestVictims,
    PreemptionPolicy,
    VictimChoice,
    candidate_nodes,
    describe_choice,
)
from mlwe.core.records import place_record, why_waiting
from mlwe.core.rules import gain_violations, preemptible, quota_verdict
from mlwe.core.spec import NodeStatus, WorkloadSpec

#: a workload the cycle's memo of expected remaining times has no answer for yet
_UNKNOWN = object()
#: what Scheduler._first_turn reads of each workload in the order when no GPU is free
_VICTIMS = attrgetter("victims")


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Hold off the cyclic garbage collector for the block (re-enabled after it only
    if it was on before: a caller that turned it off keeps it off). Reference
    counting still frees what the block drops; only cycles wait."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


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
    #: checkpoint; otherwise the scheduler wakes at the first moment enough
    #: victims are cheap at once (mlwe.core.gain.joint_wake) and looks again (0.05:
    #: measured on the eight Philly windows once the wake really ran, against 0.1
    #: and 0.3; see benchmarks/policy_windows.py)
    gain_wait_share: float = 0.05
    #: when no victim set is cheap all at once, drain one: evict each victim at
    #: its own next checkpoint and hold the node for the preemptor meanwhile
    #: (one-replica preemptors; see :class:`mlwe.core.gain.DrainPlan`)
    gain_drain: bool = False
    #: a victim of preemption among equals is delayed by the longer of its
    #: preemptor's run and its own wait to be placed again, taken as this quantile
    #: of the waits that evicted workloads of its priority and saved service (in
    #: powers of two of GPU-seconds) had before they were placed again
    #: (mlwe.core.gain.Rewaits); None: it is taken to resume once the preemptor
    #: ends. Under a size-aware order a long job evicted late waits behind
    #: everything shorter, often far longer than its preemptor runs.
    gain_rewait_quantile: float | None = None
    #: waits a class needs before its quantile counts (0.0 before)
    gain_rewait_min_runs: int = 3
    #: a run that resumed from saved service (after an eviction) is no victim
    #: among equals until it lasts this share of that service (and the core's
    #: minimum quantum, GAIN_MIN_QUANTUM_S, in any case): a long job is not
    #: evicted again soon after each restart (mlwe.core.gain.resume_quantum).
    #: 0.0: the core's quantum only. 0.25: measured against 0, 0.125, 0.5 and 1
    #: over the Philly replicas, ITP and the eight windows (README, "Policy quality")
    gain_quantum_share: float = 0.25

    def __post_init__(self) -> None:
        q = self.gain_rewait_quantile
        if q is not None and not 0.0 <= q <= 1.0:
            raise ValueError(f"gain_rewait_quantile {q!r} is not a number within [0, 1]")
        if self.gain_rewait_min_runs < 1:
            raise ValueError(f"gain_rewait_min_runs {self.gain_rewait_min_runs!r} is below 1")
        s = self.gain_quantum_share
        if not 0.0 <= s < math.inf:
            raise ValueError(f"gain_quantum_share {s!r} is not a finite number >= 0")


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
        #: drain plans in progress, by preemptor (scheduler memory, like _nominated)
        self._drains: dict[str, DrainPlan] = {}
        #: remaining-time answers of the cycle being planned (None between cycles)
        self._left: dict[str, float | None] | None = None
        self._left_at = 0.0
        #: per priority, the holders gain searches examine, kept across cycles
        self._holders: dict[int, Holders] = {}
        #: how long evicted workloads waited to be placed again (learned by the
        #: holder readers as restarts are seen, with gain_rewait_quantile set;
        #: scheduler memory, like _holders)
        self.rewaits = Rewaits()

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
        """``cp``'s queue in the ordering's order (kept across calls where it can be:
        :meth:`SizeAware.order_queue`)."""
        ordering = self.ordering
        if isinstance(ordering, SizeAware):
            return ordering.order_queue(cp, self.total_gpu(cp), cp.now())
        return ordering.order(cp.queued_workloads(), cp.queues, self.total_gpu(cp), cp.now())

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
        """When the scheduler wants a cycle by time alone: the first moment a gain
        search that found nothing would find victims cheap enough at once
        (:func:`mlwe.core.gain.joint_wake`), or a drain plan's next eviction (None:
        no such moment)."""
        now = cp.now()
        if self._wake_at <= now:
            self._wake_at = INF
        return None if self._wake_at == INF else self._wake_at

    # --------------------------------------------------------------------- plan
    def remaining(self, w: Workload, now: float) -> float | None:
        """Expected seconds of work left: the user's estimate, else the learned one.

        Within a cycle (nothing changes while it plans) each answer is kept, so
        the phases that ask again about a workload do not estimate it again."""
        memo = self._left
        if memo is not None and now == self._left_at:
            rem = memo.get(w.id, _UNKNOWN)
            if rem is not _UNKNOWN:
                return rem  # type: ignore[return-value]
        est = self.estimator
        if w.spec.estimated_duration is None:  # (most trace jobs) no estimate of the user's
            rem = None if est is None else est.remaining_s(w, attained(w, now))
        else:
            rem = w.remaining_estimate(now)
            if rem is None and est is not None:
                rem = est.remaining_s(w, attained(w, now))
        if memo is not None and now == self._left_at:
            memo[w.id] = rem
        return rem

    def plan(self, cp: ControlPlane, cause_id: str | None = None) -> Plan:
        """One cycle, in phases (after Kueue's ``schedule()``):

        1. prepare: attach the estimator; an empty queue is an empty plan;
        2. snapshot: order the queue and fork capacity (decide on the fork only);
           then the drain plans in progress evict their due victims and hold
           their nodes (:meth:`_run_drains`; only with ``gain_drain``);
        3. each workload in order takes its turn (:meth:`_turn`): wait for its
           victims, fit (or backfill), preempt by priority, preempt for gain, or
           record why it waits; a turn may end the cycle, and once only a fit
           could start anything, the turns that cannot fit are passed over
           (:meth:`_next_turn`);
        4. hand back the head's reservation with the plan.
        """
        # 1. prepare
        plan = Plan(version=cp.version)
        if self.estimator is not None:
            self.estimator.attach(cp)
        if not cp.queued:
            return plan
        self._left, self._left_at = {}, cp.now()
        if self._wake_at <= self._left_at:
            # a wake that is due now has fired (this cycle may be its own): only
            # the moments this cycle names count, or a wake it names is lost
            self._wake_at = INF
        try:
            # 2. snapshot
            cycle = self._snapshot(cp, plan, cause_id)
            if self._drains:
                self._run_drains(cycle)
            # 3. turns (past those that cannot start, once nothing but a fit can)
            order, rank, n = cycle.order, 0, len(cycle.order)
            while rank < n:
                if self._turn(cycle, rank, order[rank]):
                    break
                rank = self._next_turn(cycle, rank + 1)
        finally:
            self._left = None
        # 4. result
        plan.reservation = cycle.reservation
        return plan

    def _snapshot(
        self, cp: ControlPlane, plan: Plan, cause_id: str | None
    ) -> Cycle:
        """Phase 2: the queue in policy order, a capacity fork and per-queue usage to
        decide on, and the cycle-wide switches (may the cycle stop early, is gain
        preemption on)."""
        now = cp.now()
        cfg = self.config
        order = self.ordered(cp)
        fork = cp.capacity.fork()
        usage = {n: list(q.usage) for n, q in cp.queues.items()}
        return Cycle(
            cp=cp,
            plan=plan,
            cause_id=cause_id,
            now=now,
            order=order,
            fork=fork,
            usage=usage,
            can_stop=can_stop_early(cp, order, cfg.preemption, self._queue_summary(cp)),
            cohorts=any(q.cohort for q in cp.queues.values()),
            gain_on=cfg.gain_preemption and cfg.preemption and self.estimator is not None,
        )

    def _queue_summary(self, cp: ControlPlane) -> tuple[int, bool] | None:
        ordering = self.ordering
        return ordering.queue_summary(cp) if isinstance(ordering, SizeAware) else None

    def _turn(self, cycle: Cycle, rank: int, w: Workload) -> bool:
        """Phase 3: one workload's turn; True ends the cycle (nothing further may start).

        a. waiting for its victims to release: keep their room, nothing else;
        b. no node has a model it accepts: it waits;
        c. fit (backfilling past the blocked head) and admit within quota;
        d. nothing fits and nothing further can start: stop early;
        e. preempt by priority, then among equals for gain;
        f. otherwise it waits, and may become the blocked head.
        """
        cycle.plan.considered += 1
        # a. a drain plan in progress, or victims still releasing
        if w.id in cycle.draining or self._waits_for_victims(cycle, rank, w):
            return False
        # b. no acceptable hardware at all
        models, shape = self.shape_for(cycle.cp, w)
        if w.spec.resources.gpu and not models:
            cycle.plan.pending[w.id] = "no node in the cluster has a GPU model it accepts"
            return False
        turn = Turn(w, rank, models, shape, self._reserved_for_others(cycle, w))
        # c. fit, then admit (or wait on quota)
        allocs = self._try_fit(cycle, turn)
        if allocs is not None:
            self._admit(cycle, turn, allocs)
            return False
        # d. early stop
        if self._nothing_more_can_start(cycle, turn.rank):
            self._stop_early(cycle, turn)
            return True
        # e. preemption
        known: bool | None = None  # whether a gain search could find anything, if known
        if self.config.preemption and cycle.head is not None and not cycle.projected:
            # preempting past the blocked head must respect its reservation too;
            # projecting it is costly, and needless when no search can find victims
            known = self._could_preempt(cycle, turn)
            if known is not False:
                self._project_head(cycle, turn)
                known = None  # (asked again, with the reservation in force)
        if self._preempt_by_priority(cycle, turn) or self._preempt_for_gain(cycle, turn, known):
            return False
        # f. wait
        return self._wait(cycle, turn)

    def _waits_for_victims(self, cycle: Cycle, rank: int, w: Workload) -> bool:
        """Phase 3a: a preemptor whose victims still checkpoint keeps the room it
        planned (in the fork, when a later turn could take it) and waits; True if so."""
        if not w.victims:
            return False
        cp = cycle.cp
        live = [v for v in w.victims if cp.workloads[v].state is State.PREEMPTING]
        if not live:
            return False
        cycle.plan.pending[w.id] = (
            f"waiting for {len(live)} victim(s) to release: {', '.join(live)}"
        )
        if rank + 1 < len(cycle.order):
            hold(cycle.fork, self._nominated.get(w.id, ()), cp, live)
        return True

    def _reserved_for_others(self, cycle: Cycle, w: Workload) -> frozenset[str]:
        """The nodes ``w`` must keep off: the head's reserved nodes, unless ``w`` is
        expected to finish before the head's reserved start (EASY backfill)."""
        res = cycle.reservation
        if res is not None and not self._ends_before(w, cycle.now, res.start):
            return res.nodes
        return frozenset()

    def _project_head(self, cycle: Cycle, turn: Turn) -> None:
        """Project the blocked head's reservation, once per cycle and only when some
        later workload could pass it (the projection is costly); the current
        workload then keeps off the reserved nodes unless it ends before."""
        head = cycle.head
        assert head is not None
        cycle.reservation = self._reserve(cycle.cp, head, cycle.fork, cycle.now, cycle.dirty)
        cycle.projected = True
        if cycle.reservation is not None:
            nodes = ", ".join(sorted(cycle.reservation.nodes))
            cycle.plan.pending[head.id] += f"; holds a reservation on {nodes}"
            turn.exclude = self._reserved_for_others(cycle, turn.w)

    def _try_fit(self, cycle: Cycle, turn: Turn) -> tuple[ReplicaAlloc, ...] | None:
        """Phase 3c: a placement on the fork, or None. Shapes known not to fit this
        cycle (or dominated by one that did not) are not searched again; the first
        workload that could pass the blocked head triggers the head's reservation
        and is placed again with it in force."""
        key = turn.fit_key()
        if (
            key not in cycle.failed
            and cycle.dominated
            and turn.shape.gpu
            and dominated(cycle.dominated, turn.shape, turn.replicas, bool(turn.exclude))
        ):
            cycle.failed.add(key)
        if key in cycle.failed:
            return None
        fork = cycle.fork
        allocs = self.placement.place(fork, turn.shape, turn.replicas, turn.exclude)
        if allocs is not None and cycle.head is not None and not cycle.projected:
            # the first workload that could pass the blocked head: only now is
            # the head's reservation worth projecting (EASY backfill)
            for a in reversed(allocs):
                fork.release(a)
            self._project_head(cycle, turn)
            key = turn.fit_key()
            allocs = self.placement.place(fork, turn.shape, turn.replicas, turn.exclude)
        if allocs is None:
            cycle.failed.add(key)
            shape = turn.shape
            if shape.gpu and not shape.selector and not shape.vram:
                cycle.dominated.append(
                    (shape.models, shape.gpu, shape.cpu, shape.ram, turn.replicas,
                     bool(turn.exclude))
                )
        return allocs

    def _admit(self, cycle: Cycle, turn: Turn, allocs: tuple[ReplicaAlloc, ...]) -> None:
        """Phase 3c: place ``allocs`` if the queue's quota allows (counting what this
        cycle already placed); otherwise give them back and wait on the quota."""
        w, fork, plan = turn.w, cycle.fork, cycle.plan
        req = request_of(allocs)
        qreasons, borrowing = quota_verdict(cycle.cp.queues, cycle.usage, w.queue, req)
        if qreasons:
            for a in reversed(allocs):
                fork.release(a)
            plan.pending[w.id] = qreasons[0]
            return
        for i in range(4):
            cycle.usage[w.queue][i] += req[i]
        plan.actions.append(Place(w.id, allocs))
        self._nominated.pop(w.id, None)
        plan.decisions.append(
            place_record(
                self.ordering, self.placement.name, self.name, cycle.cp, w, turn.shape, allocs, turn.rank, len(cycle.order), cycle.now,
                borrowing, cycle.reservation, cycle.cause_id,
            )
        )

    def _nothing_more_can_start(self, cycle: Cycle, rank: int) -> bool:
        """Phase 3d: whether the rest of the queue (after ``rank``) can be skipped:
        stopping is allowed (see :func:`can_stop_early`: nobody may preempt by
        priority), no gain search is left, and no GPU is free, or no ready node
        has as many whole GPUs free as any later workload asks for one replica
        (none of them fits anywhere: each turn would only write why it waits)
        and none waits for victims (see :meth:`_first_turn`)."""
        if not self._only_a_fit_can_start(cycle):
            return False
        most = _most_free(cycle.fork)
        return most < 0 or self._first_turn(cycle, rank + 1, most) >= len(cycle.order)

    def _only_a_fit_can_start(self, cycle: Cycle) -> bool:
        """Whether stopping is allowed (see :func:`can_stop_early`: nobody may preempt
        by priority) and no gain search is left in this cycle: a later turn can then
        start something only by fitting."""
        return cycle.can_stop and not (
            cycle.gain_on and cycle.gain_searches < self.config.max_gain_searches
        )

    def _first_turn(self, cycle: Cycle, rank: int, most: int) -> int:
        """The first rank from ``rank`` on whose replica asks for at most ``most``
        whole GPUs (its shape's GPU: 0 for a fraction of one, which may fit on a
        partly used GPU) or that has victims (it may hold the room they free);
        the order's length if none. The cycle keeps the last answer: a turn's
        stop test and the pass-over after it ask the same."""
        kept = cycle.first_turn
        if kept is not None and kept[0] == rank and kept[1] == most:
            return kept[2]
        order = cycle.order
        n = len(order)
        if most < 0:
            # no GPU is free: only a workload with victims takes a turn, and a long
            # queue's turns are passed over here, so they are read in C
            r = next(compress(count(rank), map(_VICTIMS, islice(order, rank, None))), n)
        else:
            r = rank
            while r < n:
                w = order[r]
                if w.victims or w.spec.resources.gpu // FULL <= most:
                    break
                r += 1
        cycle.first_turn = (rank, most, r)
        return r

    def _next_turn(self, cycle: Cycle, rank: int) -> int:
        """Phase 3d: the next rank from ``rank`` on worth a turn. Once only a fit could
        start anything (:meth:`_nothing_more_can_start`'s conditions but the last:
        stopping is allowed, no gain search is left, a head is blocked, neither
        strict order nor drain plans), a turn whose replica asks for more whole
        GPUs than any ready node has free (or any GPU, when none is free) fits
        nowhere, and would only write why it waits: those are passed over, as the
        early stop passes over the rest (:meth:`_unexamined`), and so are their
        failed fits and victim searches, which leave nothing later turns read but
        caches of answers they would compute the same. A workload with victims
        always takes its turn (it may hold the room they free)."""
        cfg = self.config
        if (
            rank >= len(cycle.order)
            or cycle.head is None
            or cfg.strict_order
            or cfg.gain_drain
            or not self._only_a_fit_can_start(cycle)
        ):
            return rank
        most = _most_free(cycle.fork)
        nxt = self._first_turn(cycle, rank, most)
        if nxt > rank:
            self._unexamined(cycle, cycle.order[rank:nxt], most < 0)
        return nxt

    def _unexamined(self, cycle: Cycle, passed: list[Workload], full: bool) -> None:
        """Count ``passed`` as not examined, and say why each waits: the reason it
        already carries (most do: the pass costs no call for them), else no free
        GPU (``full``), no accepted model, or no room."""
        cycle.plan.stopped_early += len(passed)
        why = self._why_unexamined
        for w in passed:
            if not w.pending_reason:
                why(cycle, w, full)

    def _why_unexamined(self, cycle: Cycle, w: Workload, full: bool) -> None:
        """The reason passed-over ``w`` waits, when it carries none (see :meth:`_unexamined`)."""
        plan = cycle.plan
        if full:
            plan.pending[w.id] = "no room: no free GPU in the cluster"
            return
        models, shape = self.shape_for(cycle.cp, w)
        if w.spec.resources.gpu and not models:
            plan.pending[w.id] = "no node in the cluster has a GPU model it accepts"
        else:  # GPUs are free, but no node has as many as it asks for
            plan.pending[w.id] = why_waiting(w, shape, models, frozenset(), None)

    def _stop_early(self, cycle: Cycle, turn: Turn) -> None:
        """Phase 3d: this workload waits for room; so do the rest (no GPU is free,
        or no node has as many whole GPUs free as they ask for: a reason saying
        so, unless they already carry one), counted as not examined."""
        plan = cycle.plan
        plan.pending[turn.w.id] = why_waiting(
            turn.w, turn.shape, turn.models, turn.exclude, cycle.reservation
        )
        self._unexamined(cycle, cycle.order[turn.rank + 1 :], not cycle.fork.has_free_gpu())

    def _preempt_by_priority(self, cycle: Cycle, turn: Turn) -> bool:
        """Phase 3e: evict lower-priority (or quota-borrowing) work for ``w``; True if
        a victim set was chosen. Searches that found nothing are remembered per
        shape and bounded per cycle; a set the quota forbids is dropped unless it
        reclaims lent quota."""
        cfg = self.config
        if not cfg.preemption or cycle.can_stop:
            return False  # (can_stop: nobody waiting ranks above the lowest holder, no cohort)
        w, shape = turn.w, turn.shape
        pkey = (shape, turn.replicas, w.priority, w.queue, bool(turn.exclude))
        if (
            pkey in cycle.no_victims
            or cycle.failed_searches >= cfg.max_failed_preemption_searches
        ):
            return False
        # a workload ranked after the blocked head may not preempt its way onto
        # the head's reserved nodes either: backfill rules bind preemption too
        cp = cycle.cp
        choice = self.preemption.select(cp, cycle.fork, w, shape, cycle.taken, turn.exclude)
        if choice is None:
            cycle.no_victims.add(pkey)
            cycle.failed_searches += 1
            return False
        qreasons, _ = quota_verdict(cp.queues, cycle.usage, w.queue, request_of(choice.allocs))
        reclaim = any(why.value == "reclaim" for _, why in choice.victims)
        if qreasons and not reclaim:
            return False
        self._evict_for(
            cycle, turn, choice, f"{self.name}/{self.preemption.name}", (),
            f"preempting {len(choice.victims)} workload(s); placed once released",
        )
        return True

    def _could_preempt(self, cycle: Cycle, turn: Turn) -> bool | None:
        """Phase 3e, before the blocked head's reservation is projected: False when no
        preemption search for ``turn`` can find victims even with every node open to
        it (the reservation only closes nodes, so none can with it in force either,
        and projecting it is needless); otherwise None (the searches tell, once it
        is projected). Known only when nobody holds at a lower priority, no cohort
        may reclaim and drain plans are off: then only a gain search could, and
        :meth:`_could_gain` answers on every node (its answer stands for the turn:
        it is asked once)."""
        cp = cycle.cp
        if (
            cycle.cohorts
            or self.config.gain_drain
            or min(cp.holding_by_priority, default=turn.w.priority) < turn.w.priority
        ):
            return None
        if not cycle.gain_on or cycle.gain_searches >= self.config.max_gain_searches:
            return False  # no gain search is left either
        return None if self._could_gain(cycle, turn) else False

    def _preempt_for_gain(self, cycle: Cycle, turn: Turn, known: bool | None = None) -> bool:
        """Phase 3e: evict equal-priority work expected to run much longer (see
        :func:`mlwe.core.gain.gain_choice`); bounded per cycle. True if a victim set
        was chosen. ``known``: False when :meth:`_could_preempt` already found that
        the gain test finds nothing (the search is counted, not tested again)."""
        if not cycle.gain_on or cycle.gain_searches >= self.config.max_gain_searches:
            return False
        cycle.gain_searches += 1
        if known is False or not self._could_gain(cycle, turn):
            return self._drain_for_gain(cycle, turn)
        ask = self._gain_ask(cycle, turn)._replace(pool=cycle.gain_pools.get(turn.w.priority))
        got, wake = gain_choice(ask, self._wake_at)
        self._wake_at = min(self._wake_at, wake)
        if got is None:
            return self._drain_for_gain(cycle, turn)
        choice, gain, cost, why_gain = got
        self._evict_for(
            cycle, turn, choice, f"{self.name}/{self.preemption.name}+gain", (why_gain,),
            f"preempting {len(choice.victims)} equal-priority workload(s) for a"
            " shorter expected run; placed once released",
            extra={"gain_gpu_s": round(gain, 3), "cost_gpu_s": round(cost, 3)},
        )
        return True

    def _gain_ask(self, cycle: Cycle, turn: Turn) -> GainAsk:
        """What a gain search for ``turn`` is asked, on this cycle's state."""
        return GainAsk(
            self.config, self.remaining, self.preemption, cycle.cp, cycle.fork,
            turn.w, turn.shape, cycle.taken, turn.exclude, cycle.now, rewaits=self.rewaits,
        )

    def _could_gain(self, cycle: Cycle, turn: Turn) -> bool:
        """Whether a gain search for ``turn`` could find anything. Known without a
        node scan for GPU work (one replica, or a gang with no per-node cap) when
        only equals could be its victims (no cohort could reclaim, nobody holds at
        a lower priority) and the victim policy is :class:`CheapestVictims`:
        :func:`mlwe.core.gain.could_gain` on the holders reduced once per cycle
        (no node where one replica fits even with victims: no replica that needs
        them can be placed), over the nodes the search would examine (all
        candidates, or for one replica a window of them: see :meth:`_gain_pool`),
        with the wake time and rotating start the search would leave; the
        decisions are the search's, byte for byte."""
        got = self._gain_pool(cycle, turn)
        if isinstance(got, bool):
            return got
        pool, node_set, start = got
        w, shape, policy = turn.w, turn.shape, self.preemption
        assert isinstance(policy, CheapestVictims)  # (_gain_pool checked it)
        # an earlier search of this cycle for the same shape and room, by a preemptor
        # expected to end no later, found nothing: neither does this one (see
        # GainMiss); on a window of the nodes, only from the same start
        key = (w.priority, shape, w.spec.replicas, turn.exclude, len(cycle.taken), start)
        r_p = expected_left(self.remaining, w, cycle.now, self.config.gain_prior_s)
        miss = cycle.gain_misses.get(key)
        if miss is not None and r_p >= miss.r_p:
            if policy.pass_over(cycle.fork, shape, w.spec.replicas, turn.exclude) and not miss.woke:
                # the earlier miss left no wake time; this one's is its own
                _, wake = could_gain(
                    self.config, self.remaining, w, shape, cycle.fork, node_set,
                    cycle.taken, turn.exclude, pool, cycle.now, cap=self._wake_at,
                )
                self._wake_at = min(self._wake_at, wake)
            return False
        possible, wake = could_gain(
            self.config, self.remaining, w, shape, cycle.fork, node_set, cycle.taken,
            turn.exclude, pool, cycle.now, cap=self._wake_at,
        )
        if not possible:
            woke = policy.pass_over(cycle.fork, shape, w.spec.replicas, turn.exclude)
            if woke:
                self._wake_at = min(self._wake_at, wake)
            if miss is None or r_p < miss.r_p:
                cycle.gain_misses[key] = GainMiss(r_p, woke)
        return possible

    def _gain_pool(
        self, cycle: Cycle, turn: Turn
    ) -> tuple[GainPool, frozenset[str], int | None] | bool:
        """The cycle's holders of ``turn``'s priority and the nodes a search for its
        shape would examine, on which :func:`mlwe.core.gain.could_gain` decides
        whether a gain search could find anything, with the rotating start of those
        nodes when they are a window of the candidate nodes (None: all of them);
        or, where that test does not apply, the answer known without it (True: only
        the search can tell; False: it finds nothing). See :meth:`_could_gain` for
        when it applies.

        With more candidate nodes than the victim policy's ``max_scan``, a search
        for one replica examines only the ``max_scan`` of them from its rotating
        start (:meth:`CheapestVictims.window`), and the test is made on those: a
        large cluster's gain searches that find nothing (each reads the holders of
        ``max_scan`` nodes) are then skipped like a small one's. Only while every
        holder it examines holds on one node: a gang holding on several is seen by
        the search on a node of the window, but its wake time would read its other
        nodes too."""
        cp, w, shape = cycle.cp, turn.w, turn.shape
        policy = self.preemption
        if (
            cycle.cohorts
            or not shape.gpu
            or not isinstance(policy, CheapestVictims)
            or (w.spec.replicas != 1 and (shape.per_node or shape.max_per_node))
        ):
            return True
        lowest = min(cp.holding_by_priority, default=w.priority + 1)
        if lowest != w.priority:
            # below: lower priorities may be victims too (search); above: no equal
            # holds anything, and the search returns before it scans
            return lowest < w.priority
        nodes = candidate_nodes(cycle.fork, shape)
        if not nodes:
            return False
        windowed = len(nodes) > policy.max_scan
        if windowed and w.spec.replicas != 1:
            return True  # a gang's replicas scan one window after another
        pool = cycle.gain_pools.get(w.priority)
        if pool is None:
            holders = self._holders.get(w.priority)
            # (the waits of evicted workloads are learned only where they count)
            learn = self.rewaits if self.config.gain_rewait_quantile is not None else None
            share = self.config.gain_quantum_share
            if (
                holders is None
                or holders.rewaits is not learn
                or holders.quantum_share != share
                or not holders.refresh(cp, cycle.now)
            ):
                if len(self._holders) > 64:
                    self._holders.clear()
                holders = self._holders[w.priority] = Holders(
                    cp, w.priority, cycle.now, learn, share
                )
            pool = cycle.gain_pools[w.priority] = GainPool(
                self.config, self.remaining, cp, w.priority, cycle.now, holders
            )
        if windowed:
            if pool.spread:
                return True
            start, window = policy.window(nodes)
            return pool, frozenset(window), start
        node_set = cycle.node_sets.get(shape.models)
        if node_set is None:
            node_set = cycle.node_sets[shape.models] = frozenset(nodes)
        return pool, node_set, None

    # ------------------------------------------------------------- drain plans
    def _drain_for_gain(self, cycle: Cycle, turn: Turn) -> bool:
        """Phase 3e: no victim set is cheap to evict now; with ``gain_drain``, a
        drain plan instead (:func:`mlwe.core.gain.drain_choice`): registered,
        its due victims evicted at once, its node held. True if one was made.

        Tried only where the search's own test on the cycle's pool applies
        (:meth:`_gain_pool`, one replica): that test, counting the victims that
        would lose too much now, says first whether a search could find anything
        at all."""
        if not self.config.gain_drain or turn.w.spec.replicas != 1:
            return False
        got = self._gain_pool(cycle, turn)
        if isinstance(got, bool):
            return False  # the pool test does not apply
        pool, node_set, _ = got
        possible, _ = could_gain(
            self.config, self.remaining, turn.w, turn.shape, cycle.fork, node_set,
            cycle.taken, turn.exclude, pool, cycle.now, drain=True,
        )
        if not possible:
            return False
        d = drain_choice(self._gain_ask(cycle, turn))
        if d is None:
            return False
        self._drains[turn.w.id] = d
        cycle.plan.decisions.append(
            DecisionRecord(
                kind="drain",
                workload=turn.w.id,
                policy=f"{self.name}/{self.preemption.name}+drain",
                chosen="drain " + ", ".join(
                    f"{v} at +{max(0.0, t - cycle.now):.0f}s" for v, t in d.due.items()
                ),
                reasons=(d.why, *describe_choice(turn.w, d.choice, cycle.cp)),
                candidates=d.choice.alternatives,
                inputs_digest=digest(cycle.cp.version, turn.w.id, turn.shape, sorted(cycle.taken)),
                cause_id=cycle.cause_id,
                extra=self._drain_extra(d),
            )
        )
        self._step_drain(cycle, turn.w, d, turn.rank + 1 < len(cycle.order))
        return True

    @staticmethod
    def _drain_extra(d: DrainPlan) -> dict[str, Any]:
        return {
            "gain_gpu_s": round(d.gain, 3),
            "cost_gpu_s": round(d.cost, 3),
            "idle_gpu_s": round(d.idle_gpu_s, 3),
        }

    def _run_drains(self, cycle: Cycle) -> None:
        """Phase 2b: every drain plan in progress, before any turn: dropped if it no
        longer holds (:meth:`_drain_holds`), else its due victims evicted and
        its node held for the whole cycle (so nothing ranked before the
        preemptor takes the GPUs its early victims freed)."""
        workloads = cycle.cp.workloads
        for pid in list(self._drains):
            d = self._drains[pid]
            p = workloads.get(pid)
            if p is None or not self._drain_holds(cycle, p, d):
                del self._drains[pid]
                continue
            self._step_drain(cycle, p, d, True)

    def _drain_holds(self, cycle: Cycle, p: Workload, d: DrainPlan) -> bool:
        """Whether ``d`` still holds: ``p`` waits, its node is ready, every victim
        not yet evicted still runs there at ``p``'s priority and may still be
        evicted for gain (a due one still passes the gain test), and ``p`` fits
        once they and those still releasing are gone."""
        cp, now, fork = cycle.cp, cycle.now, cycle.fork
        if p.state not in QUEUED or fork.status(d.node) is not NodeStatus.READY:
            return False
        cfg = self.config
        r_p = expected_left(self.remaining, p, now, cfg.gain_prior_s)
        release: list[ReplicaAlloc] = []
        for vid, due in d.due.items():
            v = cp.workloads.get(vid)
            if v is None:
                return False
            if vid in p.victims:
                if v.state is State.PREEMPTING:
                    release.extend(a for a in v.placement if a.node == d.node)
                continue
            if (
                v.state not in EVICTABLE
                or vid in cycle.taken
                or v.priority != p.priority
                or gain_violations(p, v, now)
                or not rested(v, now, cfg.gain_quantum_share)
                or preemptible(v, now) is not None
            ):
                return False
            mine = [a for a in v.placement if a.node == d.node]
            if not mine:
                return False
            release.extend(mine)
            if due <= now and not outlasts(
                expected_left(self.remaining, v, now, cfg.gain_prior_s), r_p,
                cost_of(v, now), cfg.gain_ratio, victim_rewait(cfg, self.rewaits, v, now),
            ):
                return False
        _, shape = self.shape_for(cp, p)
        return fork.fit_after_release(d.node, shape, release) is not None

    def _step_drain(self, cycle: Cycle, p: Workload, d: DrainPlan, hold_node: bool) -> None:
        """Evict ``d``'s due victims (one Preempt each, reason "gain", with the
        plan's gain and cost on its record), keep the rest from other searches,
        hold the node (``hold_node``: later turns read the fork), and end the
        plan once its last victim is evicted (the preemptor then waits for the
        release as any preemptor does)."""
        cp, now, plan = cycle.cp, cycle.now, cycle.plan
        left: list[float] = []
        for vid, due in d.due.items():
            if vid in p.victims:
                continue
            cycle.taken.add(vid)
            if due > now:
                left.append(due)
                continue
            v = cp.workloads[vid]
            plan.actions.append(Preempt(vid, p.id, PreemptReason.GAIN))
            plan.decisions.append(
                DecisionRecord(
                    kind="preempt",
                    workload=p.id,
                    policy=f"{self.name}/{self.preemption.name}+drain",
                    chosen=f"evict {vid}",
                    reasons=(
                        d.why,
                        f"evict {vid} on {d.node} now (drain step): lost work"
                        f" {v.gpus() * v.work_at_risk(now) / 60:.0f} GPU-min since its"
                        " last checkpoint",
                    ),
                    inputs_digest=digest(cp.version, p.id, d.node, vid),
                    cause_id=cycle.cause_id,
                    extra=self._drain_extra(d),
                )
            )
        if hold_node and cycle.fork.status(d.node) is NodeStatus.READY:
            cycle.fork.set_status(d.node, NodeStatus.CORDONED)
        cycle.draining.add(p.id)
        if left:
            nxt = min(left)
            self._wake_at = min(self._wake_at, nxt)
            plan.pending[p.id] = (
                f"draining {d.node} for it: {len(left)} victim(s) still to evict at their"
                f" checkpoints, next in {nxt - now:.0f}s"
            )
        else:
            del self._drains[p.id]
            self._nominated[p.id] = frozenset({d.node})
            plan.pending[p.id] = (
                f"drained {d.node}: its last victim(s) evicted; placed once released"
            )

    def _evict_for(
        self,
        cycle: Cycle,
        turn: Turn,
        choice: VictimChoice,
        policy: str,
        lead: tuple[str, ...],
        pending: str,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Phase 3e: commit a victim set: Preempt actions, the nodes nominated for
        ``w``, their room held in the fork, the decision record, the wait reason.
        The last turn holds nothing: only later turns read the fork (a hold on
        a cluster of thousands of nodes copies its maps, a fifth of the cycle
        that places one urgent workload)."""
        cp, plan, w = cycle.cp, cycle.plan, turn.w
        for v, why in choice.victims:
            plan.actions.append(Preempt(v.id, w.id, why))
            cycle.taken.add(v.id)
        planned = frozenset(a.node for a in choice.allocs)
        self._nominated[w.id] = planned
        if turn.rank + 1 < len(cycle.order):
            hold(cycle.fork, planned, cp, [v.id for v, _ in choice.victims])
        plan.decisions.append(
            DecisionRecord(
                kind="preempt",
                workload=w.id,
                policy=policy,
                chosen="evict " + ", ".join(v.id for v, _ in choice.victims),
                reasons=(*lead, *describe_choice(w, choice, cp)),
                candidates=choice.alternatives,
                inputs_digest=digest(cp.version, w.id, turn.shape, sorted(cycle.taken)),
                cause_id=cycle.cause_id,
                extra=extra if extra is not None else {},
            )
        )
        plan.pending[w.id] = pending

    def _wait(self, cycle: Cycle, turn: Turn) -> bool:
        """Phase 3f: record why ``w`` waits; under strict order everything after it
        waits behind it (True: the cycle ends); with backfill the first workload
        that waits becomes the head whose reservation later ones must respect."""
        cfg, plan, w = self.config, cycle.plan, turn.w
        plan.pending[w.id] = why_waiting(
            w, turn.shape, turn.models, turn.exclude, cycle.reservation
        )
        if cfg.strict_order:
            for rest in cycle.order[turn.rank + 1 :]:
                plan.pending[rest.id] = f"strict order: waits behind {w.id}"
            return True
        if cfg.backfill and cycle.head is None:
            cycle.head = w
            cycle.dirty = bool(plan.actions)
        return False

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

    def _ends_before(self, w: Workload, now: float, t: float) -> bool:
        """Whether ``w`` is expected to be done by ``t`` (backfill may then use the
        reserved nodes): by the user's estimate, else the learned one; never for
        work nobody can estimate."""
        rem = self.remaining(w, now)
        return rem is not None and now + rem <= t

    # -------------------------------------------------------------------- cycle
    def run_cycle(self, cp: ControlPlane, cause_id: str | None = None) -> ApplyResult:
        """Plan and apply one cycle. The cyclic garbage collector is held off while it
        runs (as recovery does while loading): a cycle over a large backlog builds
        records, placements and transitions by the ten thousand, none of them
        garbage, and each full collection it would trigger walks the whole heap
        of workloads; they are collected afterwards at the usual pace."""
        with no_cyclic_gc():
            plan = self.plan(cp, cause_id)
            result = cp.apply(
                plan.actions, plan.version, cause_id=cause_id, decisions=plan.decisions
            )
            if result.accepted:
                cp.note_pending(plan.pending, self.name, cause_id)
        return result




def _most_free(fork: CapacityIndex) -> int:
    """The most whole GPUs free on one ready node of ``fork``; -1 when no GPU is free,
    whole or in part (then nothing that asks for GPUs fits)."""
    return fork.most_whole_free_gpus() if fork.has_free_gpu() else -1


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
