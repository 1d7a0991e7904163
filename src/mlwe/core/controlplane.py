"""The control plane: the single writer of cluster state.

``apply(actions, expected_version)`` verifies every action of a batch against
the state as the earlier actions of the same batch leave it, and applies all
of them or none: each mutation records how to undo itself, and any rejection
rolls the batch back. Verification covers capacity per node and resource,
GPU model and VRAM fit, gang completeness, node state, lifecycle edges, the
preemption rule, quotas, ids and quantities. A rejection is a value listing
every reason; it never raises.

After each applied batch the invariants of what the batch touched are checked
(``check_invariants``); :meth:`validate_state` is the full sweep.

What an applied batch did leaves as a value: ``ApplyResult.transitions`` (its
lifecycle transitions, in order), and, for a reader that asked
(:meth:`ControlPlane.keep_effects`: the reconciler), the same values of every
batch until :meth:`ControlPlane.take_effects`, whoever applied them; a batch
undone by :meth:`ControlPlane.rollback_to` is gone from them. ``listeners``
remain for observers that need a push (the store writer, monitors, metrics).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from mlwe.core.actions import (
    FACTS,
    Action,
    AddNode,
    Cancel,
    Evict,
    Exited,
    Place,
    Preempt,
    PreemptReason,
    Progress,
    Released,
    Retry,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    SetResources,
    Start,
    Started,
    Submit,
    subject,
)
from mlwe.core.capacity import FULL, CapacityIndex, NodeInfo, ReplicaAlloc
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.clock import Clock
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import HOLDING, QUEUED, TRANSITIONS, State, Transition
from mlwe.core.model import Queue, Workload
from mlwe.core.resources import Resources
from mlwe.core.rules import (
    frees_what_is_needed,
    gain_violations,
    placement_violations,
    preemptible,
    quota_verdict,
    reclaim_violations,
)
from mlwe.core.spec import NodeSpec, NodeStatus, QueueSpec, ReplicaResources, WorkloadSpec

DEFAULT_QUEUE = "default"
#: Exit causes that do not count against a workload's retries.
NOT_ITS_FAULT = frozenset({"node-lost", "vanished"})


@dataclass(frozen=True, slots=True)
class Rejection:
    index: int  # position of the action in its batch
    action: str  # action kind
    subject: str  # workload, node or queue id
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        return f"#{self.index} {self.action} {self.subject}: " + "; ".join(self.reasons)


class Changed(NamedTuple):
    """One lifecycle transition an applied batch made, with what the workload's
    retry bookkeeping said when the batch was applied (a later batch may change it
    before the transition is read)."""

    workload: Workload
    transition: Transition
    attempt: int
    failures: int
    failure_cause: str | None


@dataclass(frozen=True, slots=True)
class ApplyResult:
    accepted: bool
    version: int
    rejections: tuple[Rejection, ...] = ()
    duplicate: bool = False  # the event id was seen before: acknowledged, no effect
    ignored: tuple[str, ...] = ()  # stale backend facts acknowledged without effect
    created: tuple[str, ...] = ()  # ids assigned to submitted workloads
    #: What the batch did: its lifecycle transitions, in the order it made them.
    transitions: tuple[Changed, ...] = field(default=(), compare=False, repr=False)

    def reasons(self) -> list[str]:
        return [str(r) for r in self.rejections]


class InvariantViolation(AssertionError):
    """State broke a rule the control plane guarantees: a bug, never user error."""


@dataclass(slots=True)
class _Txn:
    undo: list[Callable[[], None]] = field(default_factory=list)
    touched_nodes: dict[str, None] = field(default_factory=dict)
    touched_workloads: dict[str, None] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    transitions: list[tuple[Workload, Transition]] = field(default_factory=list)

    def rollback(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()


@dataclass(slots=True)
class Savepoint:
    """Where :meth:`ControlPlane.rollback_to` takes the state back to: every batch
    applied since :meth:`ControlPlane.savepoint` keeps its undo log here.

    The runtime takes one around requests it still has to make durable: if the
    store cannot take them, they are undone in memory too (an error answer means
    nothing was kept)."""

    version: int
    decision_seq: int
    decisions: int
    counters: dict[str, int]
    effects: int  # length of the control plane's effects log when it was taken
    undo: list[list[Callable[[], None]]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


class ControlPlane:
    """Holds the cluster state and is the only thing that changes it."""

    def __init__(
        self,
        clock: Clock,
        *,
        catalog: GpuCatalog = DEFAULT_CATALOG,
        check_invariants: bool = True,
        decision_sink: Callable[[DecisionRecord], None] | None = None,
        max_remembered_events: int = 200_000,
    ) -> None:
        self.clock = clock
        self.catalog = catalog
        self.check_invariants = check_invariants
        self.version = 0
        self.capacity = CapacityIndex()
        self.workloads: dict[str, Workload] = {}
        self.queued: dict[str, None] = {}  # ids in PENDING / PREEMPTED, arrival order
        self.on_node: dict[str, dict[str, None]] = {}  # node -> ids of workloads holding there
        self.queues: dict[str, Queue] = {}
        self.holding_by_priority: dict[int, int] = {}  # priority -> workloads holding resources
        #: Bumped whenever any workload takes or gives back resources: projections
        #: made at one epoch stay valid until it changes.
        self.holding_epoch = 0
        self.decisions: list[DecisionRecord] = []
        #: Called after each applied batch, once per state transition in it (in order):
        #: observers that need a push (the store writer, the agent's monitor, metrics).
        #: What is owed to the backend is not read here but from :meth:`take_effects`.
        self.listeners: list[Callable[[Workload, Transition], None]] = []
        #: Called with every stamped decision record (the store, the audit log, streams).
        self.decision_listeners: list[Callable[[DecisionRecord], None]] = []
        #: Called after every applied batch that changed state, with its actions and
        #: result (the store persists what changed beyond lifecycle transitions).
        self.batch_listeners: list[Callable[[Sequence[Action], ApplyResult], None]] = []
        self._sink = decision_sink
        self._decision_seq = 0
        self._seq = 0
        self._events: dict[str, int] = {}
        self._max_events = max_remembered_events
        self.invariant_checks = 0
        self.counters: dict[str, int] = {}
        self._savepoint: Savepoint | None = None
        #: The transitions of applied batches not yet taken (:meth:`take_effects`), in
        #: order; None until a reader asks for them (:meth:`keep_effects`).
        self._effects: list[Changed] | None = None
        self._put_queue(QueueSpec(name=DEFAULT_QUEUE))

    # ================================================================= effects
    def keep_effects(self) -> None:
        """Keep the transitions of every applied batch until :meth:`take_effects`
        (the reconciler asks, once; a control plane nobody reads keeps nothing)."""
        if self._effects is None:
            self._effects = []

    def take_effects(self) -> tuple[Changed, ...]:
        """The transitions applied since the last call, in order, and forget them.

        A batch rolled back (:meth:`rollback_to`) is gone from them, so taking is
        refused while a savepoint is open (it could take what is then undone)."""
        if self._savepoint is not None:
            raise RuntimeError("effects are taken only with no savepoint open")
        out = self._effects
        if not out:
            return ()
        self._effects = []
        return tuple(out)

    def pending_effects(self) -> tuple[Changed, ...]:
        """What :meth:`take_effects` would return, without taking it."""
        return tuple(self._effects or ())

    # ============================================================== savepoints
    def savepoint(self) -> Savepoint:
        """Start keeping the undo log of every applied batch (one savepoint at a time)."""
        if self._savepoint is not None:
            raise RuntimeError("a savepoint is already open")
        sp = Savepoint(self.version, self._decision_seq, len(self.decisions), dict(self.counters),
                       len(self._effects or ()))
        self._savepoint = sp
        return sp

    def release(self, sp: Savepoint) -> None:
        """Keep what was applied since ``sp`` (it is durable now)."""
        if self._savepoint is sp:
            self._savepoint = None

    def rollback_to(self, sp: Savepoint) -> None:
        """Undo every batch applied since ``sp``, newest first, and close it.

        Their effects are dropped from :meth:`take_effects`. Listeners have seen
        those batches: whoever buffered what they said (the store writer) rolls
        its buffers back too."""
        if self._savepoint is not sp:
            raise RuntimeError("not the open savepoint")
        for undo in reversed(sp.undo):
            for fn in reversed(undo):
                fn()
        for event_id in sp.events:
            self._events.pop(event_id, None)
        self.version = sp.version
        self._decision_seq = sp.decision_seq
        del self.decisions[sp.decisions :]
        if self._effects is not None:
            del self._effects[sp.effects :]
        self.counters = sp.counters
        self._savepoint = None

    # ================================================================= reading
    def now(self) -> float:
        return self.clock.now()

    def get(self, workload_id: str) -> Workload:
        try:
            return self.workloads[workload_id]
        except KeyError:
            raise KeyError(f"unknown workload {workload_id!r}") from None

    def queued_workloads(self) -> list[Workload]:
        w = self.workloads
        return [w[i] for i in self.queued]

    def holders(self, node: str) -> list[Workload]:
        w = self.workloads
        return [w[i] for i in self.on_node.get(node, ())]

    def node_status(self, node: str) -> NodeStatus:
        return self.capacity.status(node)

    # ================================================================ decisions
    def record(self, rec: DecisionRecord) -> DecisionRecord:
        """Stamp and store a decision record (sequence, time, version)."""
        self._decision_seq += 1
        stamped = DecisionRecord(
            kind=rec.kind,
            workload=rec.workload,
            policy=rec.policy,
            chosen=rec.chosen,
            reasons=rec.reasons,
            candidates=rec.candidates,
            inputs_digest=rec.inputs_digest,
            cause_id=rec.cause_id,
            time=self.clock.now(),
            version=self.version,
            seq=self._decision_seq,
            extra=rec.extra,
        )
        if self._sink is not None:
            self._sink(stamped)
        else:
            self.decisions.append(stamped)
        for listener in self.decision_listeners:
            listener(stamped)
        return stamped

    def note_pending(self, reasons: Mapping[str, str], policy: str, cause_id: str | None) -> None:
        """Remember why workloads wait; a changed reason becomes an 'unschedulable' record.

        This annotates, it does not change state: no version bump, no lifecycle edge.
        """
        for wid, reason in reasons.items():
            w = self.workloads.get(wid)
            if w is None or w.state not in QUEUED or w.pending_reason == reason:
                continue
            w.pending_reason = reason
            self.record(
                DecisionRecord(
                    kind="unschedulable",
                    workload=wid,
                    policy=policy,
                    chosen="wait",
                    reasons=(reason,),
                    cause_id=cause_id,
                )
            )

    # ==================================================================== apply
    def apply(
        self,
        actions: Sequence[Action],
        expected_version: int | None = None,
        *,
        cause_id: str | None = None,
        event_id: str | None = None,
        decisions: Iterable[DecisionRecord] = (),
    ) -> ApplyResult:
        """Verify ``actions`` and apply all of them, or none.

        ``expected_version``: the version the caller decided on; a batch
        decided on an older state is rejected as stale. ``event_id``: an
        idempotency key; a second batch with the same key is acknowledged and
        has no effect. ``decisions`` are recorded only if the batch applies.
        """
        early = self._screen(actions, expected_version, cause_id, event_id)
        if early is not None:
            return early
        txn = _Txn()
        rejections = self._verify(txn, actions, cause_id)
        if rejections:
            txn.rollback()
            self._record_rejections(rejections, cause_id)
            return ApplyResult(False, self.version, rejections)
        if self.check_invariants:
            problems = self._check_touched(txn)
            if problems:
                txn.rollback()
                raise InvariantViolation("; ".join(problems[:20]))
        if not txn.undo and not txn.touched_nodes:
            # only acknowledged no-ops (stale or repeated facts): nothing changed, so
            # plans decided on this version stay valid
            if event_id is not None:
                self._remember_event(event_id)
            return ApplyResult(True, self.version, (), False, tuple(txn.ignored))
        return self._commit(txn, actions, event_id, cause_id, decisions)

    def _screen(
        self,
        actions: Sequence[Action],
        expected_version: int | None,
        cause_id: str | None,
        event_id: str | None,
    ) -> ApplyResult | None:
        """The answer for a batch that needs no verification (None: verify it): a
        repeated event id, a stale version, an empty batch, a node addition that
        shares its batch (it cannot be rolled back)."""
        if event_id is not None and event_id in self._events:
            return ApplyResult(True, self.version, duplicate=True)
        if expected_version is not None and expected_version != self.version:
            rej = Rejection(
                -1,
                "batch",
                "-",
                (f"stale version: decided on {expected_version}, state is at {self.version}",),
            )
            self._record_rejections((rej,), cause_id)
            return ApplyResult(False, self.version, (rej,))
        if not actions:
            return ApplyResult(True, self.version)
        if len(actions) > 1 and any(isinstance(a, AddNode) for a in actions):
            # a node addition cannot be rolled back, so it never shares a batch
            lone = tuple(
                Rejection(i, "add-node", _subject(a), ("add nodes in a batch of their own",))
                for i, a in enumerate(actions)
                if isinstance(a, AddNode)
            )
            self._record_rejections(lone, cause_id)
            return ApplyResult(False, self.version, lone)
        return None

    def _verify(
        self, txn: _Txn, actions: Sequence[Action], cause_id: str | None
    ) -> tuple[Rejection, ...]:
        """Verify and apply each action in ``txn`` against the state the earlier ones
        leave; every action's reasons are collected (the caller rolls back)."""
        rejections: list[Rejection] = []
        for i, action in enumerate(actions):
            try:
                reasons = self._apply_one(txn, action, cause_id)
            except (TypeError, AttributeError, ValueError, KeyError) as exc:
                # hostile or malformed input must produce a rejection, not a crash
                reasons = [f"malformed action: {exc}"]
            if reasons:
                rejections.append(
                    Rejection(
                        i,
                        getattr(action, "kind", type(action).__name__),
                        _subject(action),
                        tuple(reasons),
                    )
                )
        return tuple(rejections)

    def _commit(
        self,
        txn: _Txn,
        actions: Sequence[Action],
        event_id: str | None,
        cause_id: str | None,
        decisions: Iterable[DecisionRecord],
    ) -> ApplyResult:
        """Make a verified batch that changed something count: bump the version,
        remember the event id (and the savepoint's undo), keep its effects, tell
        the listeners, count the actions, record the decisions."""
        self.version += 1
        if event_id is not None:
            self._remember_event(event_id)
        if self._savepoint is not None:
            self._savepoint.undo.append(txn.undo)
            if event_id is not None:
                self._savepoint.events.append(event_id)
        changed = tuple(
            Changed(w, tr, w.attempt, w.failures, w.failure_cause) for w, tr in txn.transitions
        )
        if self._effects is not None:
            self._effects += changed
        for w, tr in txn.transitions:
            for listener in self.listeners:
                listener(w, tr)
        for a in actions:
            self.counters[a.kind] = self.counters.get(a.kind, 0) + 1
        for rec in decisions:
            self.record(rec if rec.cause_id or cause_id is None else _with_cause(rec, cause_id))
        result = ApplyResult(True, self.version, (), False, tuple(txn.ignored), tuple(txn.created),
                             changed)
        for batch_listener in self.batch_listeners:
            batch_listener(actions, result)
        return result

    def _remember_event(self, event_id: str) -> None:
        self._events[event_id] = self.version
        if len(self._events) > self._max_events:
            # forget the oldest ids; redelivery that late is outside the window
            for k in list(self._events)[: self._max_events // 10]:
                del self._events[k]

    def seen_event(self, event_id: str) -> bool:
        return event_id in self._events

    def _record_rejections(self, rejections: tuple[Rejection, ...], cause_id: str | None) -> None:
        for r in rejections:
            self.record(
                DecisionRecord(
                    kind="reject",
                    workload=r.subject,
                    policy="control-plane",
                    chosen=f"rejected {r.action}",
                    reasons=r.reasons,
                    cause_id=cause_id,
                )
            )

    # ========================================================= primitive edits
    def _transition(
        self, txn: _Txn, w: Workload, target: State, reason: str, cause_id: str | None
    ) -> str | None:
        source = w.state
        if target not in TRANSITIONS[source]:
            allowed = ", ".join(sorted(TRANSITIONS[source])) or "none (terminal)"
            trail = " -> ".join(t.target.value for t in w.history[-8:])
            return (
                f"illegal transition {source.value} -> {target.value} for {w.id}"
                f" (allowed: {allowed}; history: {trail})"
            )
        w.state = target
        tr = Transition(self.clock.now(), source, target, reason, cause_id)
        w.history.append(tr)
        txn.transitions.append((w, tr))
        in_q_before = source in QUEUED
        in_q_after = target in QUEUED
        if in_q_after and not in_q_before:
            self.queued[w.id] = None
        elif in_q_before and not in_q_after:
            self.queued.pop(w.id, None)
        txn.touched_workloads[w.id] = None

        def undo() -> None:
            w.state = source
            w.history.pop()
            if in_q_after and not in_q_before:
                self.queued.pop(w.id, None)
            elif in_q_before and not in_q_after:
                self.queued[w.id] = None  # order within the queue is re-sorted by policy

        txn.undo.append(undo)
        return None

    def _set(self, txn: _Txn, obj: object, name: str, value: object) -> None:
        old = getattr(obj, name)
        setattr(obj, name, value)
        txn.undo.append(lambda: setattr(obj, name, old))

    def _hold(self, txn: _Txn, w: Workload, allocs: tuple[ReplicaAlloc, ...]) -> None:
        q = self.queues[w.queue]
        hp = self.holding_by_priority
        _bump(hp, w.priority, 1)
        self.holding_epoch += 1
        for a in allocs:
            self.capacity.allocate(a)
            self.on_node.setdefault(a.node, {})[w.id] = None
            txn.touched_nodes[a.node] = None
            _add(q.usage, a.res, 1)
        self._set(txn, w, "placement", allocs)

        def undo() -> None:
            _bump(hp, w.priority, -1)
            for a in reversed(allocs):
                self.capacity.release(a)
                self.on_node[a.node].pop(w.id, None)
                _add(q.usage, a.res, -1)

        txn.undo.append(undo)

    def _free(self, txn: _Txn, w: Workload) -> None:
        allocs = w.placement
        q = self.queues[w.queue]
        hp = self.holding_by_priority
        if allocs:
            _bump(hp, w.priority, -1)
            self.holding_epoch += 1
        for a in allocs:
            self.capacity.release(a)
            self.on_node[a.node].pop(w.id, None)
            txn.touched_nodes[a.node] = None
            _add(q.usage, a.res, -1)
        self._set(txn, w, "placement", ())

        def undo() -> None:
            if allocs:
                _bump(hp, w.priority, 1)
            for a in allocs:
                self.capacity.allocate(a)
                self.on_node[a.node][w.id] = None
                _add(q.usage, a.res, 1)

        txn.undo.append(undo)

    # ============================================================ verification
    def _apply_one(self, txn: _Txn, a: Action, cause_id: str | None) -> list[str]:
        if isinstance(a, Submit):
            return self._submit(txn, a, cause_id)
        if isinstance(a, Place):
            return self._place(txn, a, cause_id)
        if isinstance(a, Preempt):
            return self._preempt(txn, a, cause_id)
        if isinstance(a, Cancel):
            return self._cancel(txn, a, cause_id)
        if isinstance(a, Retry):
            return self._retry(txn, a, cause_id)
        if isinstance(a, Start):
            return self._start(txn, a, cause_id)
        if isinstance(a, AddNode):
            return self._add_node(txn, a)
        if isinstance(a, SetNodeStatus):
            return self._set_node_status(txn, a)
        if isinstance(a, SetQueue):
            return self._set_queue(txn, a)
        if isinstance(a, SetPriority):
            return self._set_priority(txn, a)
        if isinstance(a, Evict):
            return self._evict(txn, a, cause_id)
        if isinstance(a, SetResources):
            return self._set_resources(txn, a)
        if isinstance(a, FACTS):
            return self._fact(txn, a, cause_id)
        return [f"unknown action type {type(a).__name__}"]

    def _workload(self, wid: object) -> tuple[Workload | None, list[str]]:
        if not isinstance(wid, str) or wid not in self.workloads:
            return None, [f"unknown workload {wid!r}"]
        return self.workloads[wid], []

    # ------------------------------------------------------------------ submit
    def _submit(self, txn: _Txn, a: Submit, cause_id: str | None) -> list[str]:
        spec = a.spec
        if not isinstance(spec, WorkloadSpec):
            return ["spec is not a validated WorkloadSpec"]
        reasons = []
        if spec.queue not in self.queues:
            reasons.append(f"unknown queue {spec.queue!r}; known: {', '.join(sorted(self.queues))}")
        unknown = [m for m in spec.gpu_models if m not in self.catalog]
        if unknown:
            reasons.append(f"unknown GPU model(s): {', '.join(unknown)}")
        if spec.id is not None and spec.id in self.workloads:
            reasons.append(f"workload id {spec.id!r} already exists")
        if reasons:
            return reasons
        self._seq += 1
        wid = spec.id or f"w{self._seq}"
        while wid in self.workloads:  # a user took the generated name; stay unique
            self._seq += 1
            wid = f"w{self._seq}"
        now = self.clock.now()
        deadline = spec.deadline
        if spec.deadline_in is not None:
            deadline = now + spec.deadline_in
        w = Workload(id=wid, spec=spec, seq=self._seq, submit_time=now, deadline=deadline)
        tr = Transition(now, None, State.PENDING, "submitted", cause_id)
        w.history.append(tr)
        txn.transitions.append((w, tr))
        self.workloads[wid] = w
        self.queued[wid] = None
        txn.created.append(wid)
        txn.touched_workloads[wid] = None

        def undo() -> None:
            del self.workloads[wid]
            self.queued.pop(wid, None)
            self._seq -= 1

        txn.undo.append(undo)
        return []

    # ------------------------------------------------------------------- place
    def _place(self, txn: _Txn, a: Place, cause_id: str | None) -> list[str]:
        w, reasons = self._workload(a.workload)
        if w is None:
            return reasons
        if w.state not in QUEUED:
            return [
                f"{w.id} is {w.state.value}, only pending or preempted workloads are placed"
                f" ({_trail(w)})"
            ]
        if w.victims:
            live = [v for v in w.victims if self.workloads[v].state is State.PREEMPTING]
            if live:
                return [f"{w.id} waits for its victims to release: {', '.join(live)}"]
        reasons = placement_violations(w.spec, a.replicas, self.capacity)
        if reasons:
            return reasons
        replicas = a.replicas
        # capacity: check replica by replica on the live index (earlier replicas of this
        # batch are already allocated, so two replicas can never share the same space)
        probed: list[ReplicaAlloc] = []
        problems: list[str] = []
        for k, r in enumerate(replicas):
            problems = [f"replica {k}: {p}" for p in self.capacity.check(r)]
            if problems:
                break
            self.capacity.allocate(r)
            probed.append(r)
        # give the probe allocations back; _hold re-does them with bookkeeping
        for r in reversed(probed):
            self.capacity.release(r)
        if problems:
            return problems
        quota_reasons, borrowing = self._quota_check(w, replicas)
        if quota_reasons:
            return quota_reasons
        err = self._transition(txn, w, State.ADMITTED, "placed", cause_id)
        if err:
            return [err]
        self._hold(txn, w, replicas)
        self._set(txn, w, "attempt", w.attempt + 1)
        self._set(txn, w, "borrowing", borrowing)
        self._set(txn, w, "victims", ())
        self._set(txn, w, "pending_reason", "")
        return []

    def _quota_check(
        self, w: Workload, replicas: tuple[ReplicaAlloc, ...]
    ) -> tuple[list[str], bool]:
        q = self.queues[w.queue]
        req = [0, 0, 0, 0]
        for r in replicas:
            _add(req, r.res, 1)
        return quota_verdict(self.queues, {n: x.usage for n, x in self.queues.items()}, q.name, req)

    # ----------------------------------------------------------------- preempt
    def _preempt(self, txn: _Txn, a: Preempt, cause_id: str | None) -> list[str]:
        v, reasons = self._workload(a.victim)
        p, r2 = self._workload(a.preemptor)
        reasons += r2
        if v is None or p is None:
            return reasons
        if v.id == p.id:
            return ["a workload cannot preempt itself"]
        now = self.clock.now()
        if p.state not in QUEUED:
            reasons.append(f"preemptor {p.id} is {p.state.value}, not waiting for placement")
        if v.state not in (State.ADMITTED, State.STARTING, State.RUNNING):
            reasons.append(f"victim {v.id} is {v.state.value}, not running ({_trail(v)})")
        try:
            reason = PreemptReason(a.reason)
        except ValueError:
            return [*reasons, f"unknown preemption reason {a.reason!r}"]
        if reason is PreemptReason.PRIORITY:
            if not p.priority > v.priority:
                reasons.append(
                    f"priority rule: {p.id} (priority {p.priority}) may not preempt"
                    f" {v.id} (priority {v.priority}); only a strictly higher priority preempts"
                )
        elif reason is PreemptReason.GAIN:
            reasons += gain_violations(p, v, now)
        else:
            reasons += reclaim_violations(self.queues, p, v)
        why_not = preemptible(v, now)
        if why_not:
            reasons.append(f"victim {v.id} is {why_not}")
        if not frees_what_is_needed(self.capacity, v, p):
            reasons.append(
                f"evicting {v.id} frees nothing {p.id} can use (its resources or GPU models"
                " do not match the request)"
            )
        if reasons:
            return reasons
        err = self._transition(
            txn, v, State.PREEMPTING, f"preempted by {p.id} ({reason.value})", cause_id
        )
        if err:
            return [err]
        self._set(txn, v, "preempted_by", p.id)
        self._set(txn, v, "preemptions", v.preemptions + 1)
        self._set(txn, p, "victims", (*p.victims, v.id))
        return []

    # ------------------------------------------------------------------- facts
    def _fact(
        self, txn: _Txn, a: Started | Progress | Released | Exited, cause_id: str | None
    ) -> list[str]:
        """A backend's report: facts about an earlier attempt are acknowledged and
        ignored; the rest go to the handler of their kind."""
        w, reasons = self._workload(a.workload)
        if w is None:
            return reasons
        if not isinstance(a.attempt, int) or a.attempt != w.attempt:
            # a result about an earlier attempt: acknowledged, no effect
            txn.ignored.append(f"{a.kind} {w.id}: stale attempt {a.attempt} (current {w.attempt})")
            return []
        now = self.clock.now()
        if isinstance(a, Started):
            return self._started(txn, w, now, cause_id)
        if isinstance(a, Progress):
            return self._progress(txn, w, a, now)
        if isinstance(a, Released):
            return self._released(txn, w, a, now, cause_id)
        return self._exited(txn, w, a, now, cause_id)

    def _started(self, txn: _Txn, w: Workload, now: float, cause_id: str | None) -> list[str]:
        """The backend runs ``w``: STARTING -> RUNNING (a repeat is acknowledged)."""
        if w.state is State.RUNNING:
            txn.ignored.append(f"started {w.id}: already running")
            return []
        if w.state is not State.STARTING:
            return [
                f"{w.id} is {w.state.value}; 'started' is only expected while starting"
                f" ({_trail(w)})"
            ]
        err = self._transition(txn, w, State.RUNNING, "backend reports running", cause_id)
        if err:
            return [err]
        self._set(txn, w, "started_at", now)
        self._set(txn, w, "run_base_work", w.work_done)
        self._set(txn, w, "last_checkpoint_at", None)
        return []

    def _progress(self, txn: _Txn, w: Workload, a: Progress, now: float) -> list[str]:
        """Progress of a running workload; a checkpoint also saves the work done."""
        if not 0.0 <= a.progress <= 1.0:
            return [f"progress {a.progress!r} outside [0, 1]"]
        if w.state not in (State.RUNNING, State.PREEMPTING):
            return [f"{w.id} is {w.state.value}; progress is only reported while running"]
        self._set(
            txn,
            w,
            "progress",
            max(w.progress, a.progress) if not a.checkpointed else a.progress,
        )
        if a.checkpointed:
            self._set(txn, w, "last_checkpoint_at", now)
            est = w.spec.estimated_duration
            if est:
                self._set(txn, w, "work_done", a.progress * est)
        return []

    def _released(
        self, txn: _Txn, w: Workload, a: Released, now: float, cause_id: str | None
    ) -> list[str]:
        """The backend confirms a stop: PREEMPTING -> PREEMPTED or STOPPING ->
        CANCELLED, keeping only the checkpointed work; only now is the room freed."""
        ckpt = a.checkpointed_progress
        if ckpt is not None and not 0.0 <= ckpt <= 1.0:
            return [f"checkpointed progress {ckpt!r} outside [0, 1]"]
        work = a.checkpointed_work_s
        if work is not None and not (isinstance(work, (int, float)) and 0.0 <= work < math.inf):
            return [f"checkpointed work {work!r} is not a finite number of seconds >= 0"]
        if w.state is State.PREEMPTING:
            target = State.PREEMPTED
        elif w.state is State.STOPPING:
            target = State.CANCELLED
        elif w.state in (State.PREEMPTED, State.CANCELLED):
            txn.ignored.append(f"released {w.id}: already released")
            return []
        else:
            return [
                f"{w.id} is {w.state.value}; release is only confirmed after a stop request"
                f" ({_trail(w)})"
            ]
        self._account_lost_work(txn, w, now, a.checkpointed_progress, work)
        err = self._transition(txn, w, target, "backend confirmed release", cause_id)
        if err:
            return [err]
        self._free(txn, w)
        self._set(txn, w, "started_at", None)
        return []

    def _exited(
        self, txn: _Txn, w: Workload, a: Exited, now: float, cause_id: str | None
    ) -> list[str]:
        """The process ended: SUCCEEDED on exit 0, CANCELLED after a stop, else FAILED
        (counted against retries unless the node was lost); the room is freed."""
        if w.state in (State.SUCCEEDED, State.FAILED, State.CANCELLED, State.PREEMPTED):
            txn.ignored.append(f"exited {w.id}: already {w.state.value}")
            return []
        if w.state not in HOLDING:
            return [f"{w.id} is {w.state.value}; it has no process to exit ({_trail(w)})"]
        if not isinstance(a.exit_code, int):
            return [f"exit code {a.exit_code!r} is not an integer"]
        if w.state is State.STOPPING:
            target, why = State.CANCELLED, "stopped after cancel"
        elif a.exit_code == 0 and w.state in (State.STARTING, State.RUNNING, State.PREEMPTING):
            target, why = State.SUCCEEDED, "exited 0"
        else:
            target, why = (
                State.FAILED,
                f"exited {a.exit_code}" + (f" ({a.cause})" if a.cause else ""),
            )
        if target is State.FAILED:
            self._account_lost_work(txn, w, now, None)
        elif target is State.SUCCEEDED:
            self._set(txn, w, "progress", 1.0)
        err = self._transition(txn, w, target, why, cause_id)
        if err:
            return [err]
        self._free(txn, w)
        self._set(txn, w, "exit_code", a.exit_code)
        self._set(txn, w, "started_at", None)
        if target is State.FAILED:
            self._set(txn, w, "failure_cause", a.cause or "error")
            if a.cause not in NOT_ITS_FAULT:  # a lost node is not the workload's fault
                self._set(txn, w, "failures", w.failures + 1)
        return []

    def _account_lost_work(
        self,
        txn: _Txn,
        w: Workload,
        now: float,
        checkpointed: float | None,
        work_s: float | None = None,
    ) -> None:
        """Keep only the work saved by checkpoints: the rest of this run is lost."""
        est = w.spec.estimated_duration
        saved = w.saved_work(now)
        if checkpointed is not None and est:
            saved = max(saved, checkpointed * est)
        if work_s is not None:
            saved = max(saved, float(work_s))
        self._set(txn, w, "work_done", saved)
        if est:
            self._set(txn, w, "progress", min(1.0, saved / est))

    def _start(self, txn: _Txn, a: Start, cause_id: str | None) -> list[str]:
        w, reasons = self._workload(a.workload)
        if w is None:
            return reasons
        if a.attempt != w.attempt:
            return [f"start for attempt {a.attempt!r}, but {w.id} is at attempt {w.attempt}"]
        if w.state is not State.ADMITTED:
            return [f"{w.id} is {w.state.value}; only admitted workloads are started ({_trail(w)})"]
        err = self._transition(txn, w, State.STARTING, "start sent to backend", cause_id)
        return [err] if err else []

    # ------------------------------------------------------------ cancel/retry
    def _cancel(self, txn: _Txn, a: Cancel, cause_id: str | None) -> list[str]:
        w, reasons = self._workload(a.workload)
        if w is None:
            return reasons
        if w.state in (State.PENDING, State.PREEMPTED):
            err = self._transition(txn, w, State.CANCELLED, a.reason, cause_id)
        elif w.state is State.FAILED:
            return [f"{w.id} already failed; nothing to cancel"]
        elif w.state in (State.ADMITTED, State.STARTING, State.RUNNING, State.PREEMPTING):
            err = self._transition(txn, w, State.STOPPING, a.reason, cause_id)
        else:
            return [f"{w.id} is {w.state.value}; it cannot be cancelled ({_trail(w)})"]
        return [err] if err else []

    def _retry(self, txn: _Txn, a: Retry, cause_id: str | None) -> list[str]:
        w, reasons = self._workload(a.workload)
        if w is None:
            return reasons
        if w.state is not State.FAILED:
            return [f"{w.id} is {w.state.value}; only failed workloads are retried ({_trail(w)})"]
        if w.failures > w.spec.max_retries:
            return [f"{w.id} failed {w.failures} times; max_retries is {w.spec.max_retries}"]
        err = self._transition(txn, w, State.PENDING, f"retry after {w.failure_cause}", cause_id)
        return [err] if err else []

    # ------------------------------------------------------------ nodes/queues
    def _add_node(self, txn: _Txn, a: AddNode) -> list[str]:
        spec = a.spec
        if not isinstance(spec, NodeSpec):
            return ["node spec is not a validated NodeSpec"]
        if spec.name in self.capacity:
            return [f"node {spec.name!r} already exists"]
        if spec.gpu_model and spec.gpu_model not in self.catalog:
            return [f"unknown GPU model {spec.gpu_model!r}"]
        vram = self.catalog[spec.gpu_model].vram_mib if spec.gpu_model else 0
        info = NodeInfo(
            name=spec.name,
            gpu_model=spec.gpu_model,
            gpu_count=spec.gpus,
            vram_per_gpu=vram,
            capacity=Resources(spec.gpus * FULL, spec.gpus * vram, spec.cpu, spec.memory),
            labels=dict(spec.labels),
            order=len(self.on_node),
        )
        self.capacity.add_node(info, spec.status)
        self.on_node[spec.name] = {}
        txn.touched_nodes[spec.name] = None

        def undo() -> None:
            self.capacity.remove_node(spec.name)
            del self.on_node[spec.name]

        txn.undo.append(undo)
        return []

    def _set_node_status(self, txn: _Txn, a: SetNodeStatus) -> list[str]:
        if a.node not in self.capacity:
            return [f"unknown node {a.node!r}"]
        try:
            status = NodeStatus(a.status)
        except ValueError:
            return [f"unknown node status {a.status!r}"]
        old = self.capacity.status(a.node)
        if old is status:
            return []
        self.capacity.set_status(a.node, status)
        txn.undo.append(lambda: self.capacity.set_status(a.node, old))
        txn.touched_nodes[a.node] = None
        return []

    def _set_priority(self, txn: _Txn, a: SetPriority) -> list[str]:
        w, reasons = self._workload(a.workload)
        if w is None:
            return reasons
        if isinstance(a.priority, bool) or not isinstance(a.priority, int):
            return [f"priority {a.priority!r} is not an integer"]
        if not 0 <= a.priority <= 1_000_000:
            return [f"priority {a.priority} outside [0, 1000000]"]
        if w.state in (State.SUCCEEDED, State.CANCELLED):
            return [f"{w.id} is {w.state.value}; its priority no longer matters"]
        old = w.priority
        if old == a.priority:
            return []
        hp = self.holding_by_priority
        if w.placement:
            _bump(hp, old, -1)
            _bump(hp, a.priority, 1)
        self._set(txn, w, "priority_override", a.priority)
        txn.touched_workloads[w.id] = None

        def undo() -> None:
            if w.placement:
                _bump(hp, a.priority, -1)
                _bump(hp, old, 1)

        txn.undo.append(undo)
        return []

    def _evict(self, txn: _Txn, a: Evict, cause_id: str | None) -> list[str]:
        w, reasons = self._workload(a.workload)
        if w is None:
            return reasons
        if w.state not in (State.ADMITTED, State.STARTING, State.RUNNING):
            return [f"{w.id} is {w.state.value}; only admitted, starting or running workloads"
                    f" are evicted ({_trail(w)})"]
        if not isinstance(a.reason, str):
            return [f"reason {a.reason!r} is not text"]
        unready = [
            x.node for x in w.placement if self.capacity.status(x.node) is not NodeStatus.READY
        ]
        if not unready:
            # moving off a failing node protects the workload; anything else is an
            # eviction like a preemption and keeps the same guarantees
            why_not = preemptible(w, self.clock.now())
            if why_not:
                return [f"{w.id} is {why_not}; it is evicted only to move it off a node"
                        " that is not ready"]
        why = f"evicted: {a.reason}" if a.reason else "evicted"
        err = self._transition(txn, w, State.PREEMPTING, why, cause_id)
        if err:
            return [err]
        self._set(txn, w, "preemptions", w.preemptions + 1)
        return []

    def _set_resources(self, txn: _Txn, a: SetResources) -> list[str]:
        w, reasons = self._workload(a.workload)
        if w is None:
            return reasons
        if not isinstance(a.resources, ReplicaResources):
            return ["resources are not validated ReplicaResources"]
        if w.state not in (State.PENDING, State.PREEMPTED, State.FAILED):
            return [f"{w.id} is {w.state.value}; resources change only while it waits or after"
                    " it failed (a running attempt keeps its allocation)"]
        try:
            spec = WorkloadSpec.model_validate(
                {**w.spec.model_dump(), "resources": a.resources.model_dump()},
                context={"catalog": self.catalog},
            )
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            return [f"invalid resources for {w.id}: {exc}"]
        if spec == w.spec:
            return []
        fit = self._fits_some_node(spec)
        if fit:
            return [fit]
        self._set(txn, w, "spec", spec)
        txn.touched_workloads[w.id] = None
        return []

    def _fits_some_node(self, spec: WorkloadSpec) -> str | None:
        """Why no node of the cluster could ever hold one replica (None: some node can)."""
        r = spec.resources
        if any(could_hold(info, spec) for info in self.capacity.nodes()):
            return None
        return (
            f"no node in the cluster can hold one replica of {r.gpu / FULL:g} GPU,"
            f" {r.cpu / 1000:g} cpu, {r.memory} MiB memory"
            + (f", {r.vram} MiB VRAM" if r.vram is not None else "")
        )

    def _set_queue(self, txn: _Txn, a: SetQueue) -> list[str]:
        if not isinstance(a.spec, QueueSpec):
            return ["queue spec is not a validated QueueSpec"]
        old = self.queues.get(a.spec.name)
        self._put_queue(a.spec)

        def undo() -> None:
            if old is None:
                del self.queues[a.spec.name]
            else:
                self.queues[a.spec.name] = old

        txn.undo.append(undo)
        return []

    def _put_queue(self, spec: QueueSpec) -> None:
        old = self.queues.get(spec.name)
        q = Queue(spec=spec, nominal=spec.nominal_vector(), borrow_limit=spec.borrow_vector())
        if old is not None:
            q.usage = old.usage  # shared list: usage is a fact, not configuration
        self.queues[spec.name] = q

    # ================================================================ restore
    def restore(
        self,
        workloads: Iterable[Workload],
        version: int,
        decision_seq: int = 0,
        *,
        reject: Callable[[Workload, list[str]], None] | None = None,
    ) -> None:
        """Load workloads recovered from a store into an empty control plane.

        Nodes and queues are added first (through ``apply``). Every record is
        checked: its resources are taken through the same capacity checks as a
        placement, and the full invariant sweep must pass, or nothing is loaded.
        With ``reject``, a record that fails its own checks (unknown queue, a
        placement its node cannot hold, a duplicate id) is left out and handed
        to ``reject`` with the reasons, and the others are loaded.
        """
        if self.workloads:
            raise ValueError("restore needs a control plane without workloads")
        loaded: list[Workload] = []
        taken: list[tuple[Workload, ReplicaAlloc]] = []
        problems: list[str] = []
        try:
            for w in workloads:
                mine = self._restore_one(w, loaded, taken)
                if mine and reject is not None:
                    self._unrestore(w, loaded, taken)
                    reject(w, mine)
                else:
                    problems += mine
            if not problems:
                problems = self.validate_state()
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            problems.append(f"malformed record: {exc}")
        if problems:
            # leave nothing half-loaded
            for w, a in reversed(taken):
                self.capacity.release(a)
                self.on_node[a.node].pop(w.id, None)
                _add(self.queues[w.queue].usage, a.res, -1)
            for w in loaded:
                self.workloads.pop(w.id, None)
                self.queued.pop(w.id, None)
            self.holding_by_priority.clear()
            raise InvariantViolation("restored state is invalid: " + "; ".join(problems[:20]))
        self.version = version
        self._decision_seq = max(self._decision_seq, decision_seq)

    def _restore_one(
        self, w: Workload, loaded: list[Workload], taken: list[tuple[Workload, ReplicaAlloc]]
    ) -> list[str]:
        """Load one record (``restore``); the reasons it cannot be, if any."""
        if w.id in self.workloads:
            return [f"duplicate workload {w.id}"]
        if w.spec.queue not in self.queues:
            return [f"{w.id}: unknown queue {w.spec.queue!r}"]
        self.workloads[w.id] = w
        loaded.append(w)
        if w.state in QUEUED:
            self.queued[w.id] = None
        problems: list[str] = []
        if w.placement:
            if w.state not in HOLDING:
                return [f"{w.id}: {w.state.value} but holds resources"]
            q = self.queues[w.queue]
            for a in w.placement:
                why = self.capacity.check(a) if a.node in self.capacity else [
                    f"placed on unknown node {a.node!r}"]
                if why:
                    problems += [f"{w.id}: {p}" for p in why]
                    continue
                self.capacity.allocate(a)
                taken.append((w, a))
                self.on_node.setdefault(a.node, {})[w.id] = None
                _add(q.usage, a.res, 1)
            hp = self.holding_by_priority
            _bump(hp, w.priority, 1)
            self.holding_epoch += 1
        self._seq = max(self._seq, w.seq)
        return problems

    def _unrestore(
        self, w: Workload, loaded: list[Workload], taken: list[tuple[Workload, ReplicaAlloc]]
    ) -> None:
        """Take one record's load back out (it was rejected)."""
        for i in range(len(taken) - 1, -1, -1):
            tw, a = taken[i]
            if tw is w:
                self.capacity.release(a)
                self.on_node[a.node].pop(w.id, None)
                _add(self.queues[w.queue].usage, a.res, -1)
                del taken[i]
        if loaded and loaded[-1] is w:
            loaded.pop()
            self.workloads.pop(w.id, None)
            self.queued.pop(w.id, None)
            if w.placement and w.state in HOLDING:
                hp = self.holding_by_priority
                _bump(hp, w.priority, -1)

    # ============================================================== invariants
    def _check_touched(self, txn: _Txn) -> list[str]:
        self.invariant_checks += 1
        problems: list[str] = []
        for node in txn.touched_nodes:
            problems += self._node_problems(node)
        for wid in txn.touched_workloads:
            problems += (
                self._workload_problems(self.workloads[wid]) if wid in self.workloads else []
            )
        for wid in txn.touched_workloads:
            w = self.workloads.get(wid)
            q = self.queues.get(w.queue) if w is not None else None
            if q is not None and (q.usage[0] < 0 or q.usage[1] < 0 or q.usage[2] < 0 or q.usage[3] < 0):
                problems.append(f"queue {q.name}: negative usage {q.usage}")
        return problems

    def _node_problems(self, node: str) -> list[str]:
        info = self.capacity.info(node)
        used = [0, 0, 0, 0]
        dev_used = [0] * info.gpu_count
        for wid in self.on_node.get(node, ()):
            w = self.workloads[wid]
            if not w.holding:
                return [f"node {node}: {wid} listed but {w.state.value}"]
            for a in w.placement:
                if a.node == node:
                    _add(used, a.res, 1)
                    for d in a.devices:
                        dev_used[d] += a.gpu_per_device
        cap = info.capacity.as_tuple()
        free = self.capacity.free(node).as_tuple()
        out = []
        for name, c, u, f in zip(("gpu", "vram", "cpu", "ram"), cap, used, free):
            if u > c:
                out.append(f"node {node}: {name} allocated {u} > capacity {c}")
            if c - u != f:
                out.append(f"node {node}: {name} free {f} != capacity {c} - allocated {u}")
        devfree = self.capacity.free_devices(node)
        for d, (u, f) in enumerate(zip(dev_used, devfree)):
            if u > FULL or FULL - u != f:
                out.append(f"node {node}: GPU {d} used {u} milli, free {f}")
        return out

    def _workload_problems(self, w: Workload) -> list[str]:
        out = []
        if w.holding:
            if len(w.placement) != w.spec.replicas:
                out.append(
                    f"{w.id}: {w.state.value} with {len(w.placement)}/{w.spec.replicas} replicas"
                )
            for a in w.placement:
                if w.id not in self.on_node.get(a.node, {}):
                    out.append(f"{w.id}: placed on {a.node} but not indexed there")
        elif w.placement:
            out.append(f"{w.id}: {w.state.value} but still holds {len(w.placement)} replicas")
        if (w.state in QUEUED) != (w.id in self.queued):
            out.append(f"{w.id}: queue index disagrees with state {w.state.value}")
        if w.history and w.history[-1].target is not w.state:
            out.append(f"{w.id}: history ends in {w.history[-1].target}, state is {w.state}")
        return out

    def validate_state(self) -> list[str]:
        """The full invariant sweep; an empty list means every rule holds."""
        self.invariant_checks += 1
        problems: list[str] = []
        for node in self.capacity.node_names():
            problems += self._node_problems(node)
        problems += self.capacity.recompute_keys_ok()
        usage: dict[str, list[int]] = {q: [0, 0, 0, 0] for q in self.queues}
        for w in self.workloads.values():
            problems += self._workload_problems(w)
            for a in w.placement:
                _add(usage[w.queue], a.res, 1)
            for prev, nxt in zip(w.history, w.history[1:]):
                if prev.target is not nxt.source or nxt.target not in TRANSITIONS[prev.target]:
                    problems.append(
                        f"{w.id}: history has an illegal step {prev.target} -> {nxt.target}"
                    )
        by_prio: dict[int, int] = {}
        for w in self.workloads.values():
            if w.placement:
                by_prio[w.priority] = by_prio.get(w.priority, 0) + 1
        counted = {p: n for p, n in self.holding_by_priority.items() if n}
        if by_prio != counted:
            problems.append(f"holders by priority {counted} != recount {by_prio}")
        for name, q in self.queues.items():
            if usage[name] != q.usage:
                problems.append(f"queue {name}: usage {q.usage} != sum of placements {usage[name]}")
        for wid in self.queued:
            if self.workloads[wid].state not in QUEUED:
                problems.append(f"{wid}: in queue index while {self.workloads[wid].state.value}")
        return problems

    def assert_valid(self) -> None:
        problems = self.validate_state()
        if problems:
            raise InvariantViolation("; ".join(problems[:20]))


# ============================================================== shared rules
def could_hold(info: NodeInfo, spec: WorkloadSpec) -> bool:
    """Whether the node, empty, could hold one replica of ``spec`` (GPU model, count and
    VRAM, cpu and memory; node selectors are the caller's business)."""
    r = spec.resources
    cap = info.capacity
    if cap.cpu < r.cpu or cap.ram < r.memory:
        return False
    if r.gpu:
        devices = max(1, r.gpu // FULL)
        if info.gpu_model is None or info.gpu_count < devices:
            return False
        if spec.gpu_models and info.gpu_model not in spec.gpu_models:
            return False
        if info.vram_per_gpu < spec.min_vram_per_gpu:
            return False
        if r.vram is not None and r.vram > info.vram_per_gpu * devices:
            return False
    return True


def _add(acc: list[int], r: Resources, sign: int) -> None:
    acc[0] += sign * r.gpu
    acc[1] += sign * r.vram
    acc[2] += sign * r.cpu
    acc[3] += sign * r.ram


def _trail(w: Workload) -> str:
    """The workload's recent lifecycle, for rejections of an edge the table does not allow."""
    return "history: " + " -> ".join(t.target.value for t in w.history[-8:])


def _subject(action: object) -> str:
    try:
        return subject(action)  # type: ignore[arg-type]
    except Exception:  # a malformed action still gets a readable rejection
        return "?"


def _with_cause(rec: DecisionRecord, cause_id: str) -> DecisionRecord:
    return DecisionRecord(
        kind=rec.kind,
        workload=rec.workload,
        policy=rec.policy,
        chosen=rec.chosen,
        reasons=rec.reasons,
        candidates=rec.candidates,
        inputs_digest=rec.inputs_digest,
        cause_id=cause_id,
        extra=rec.extra,
    )


def priority_index(workloads: Mapping[str, Workload]) -> dict[int, int]:
    """Count of workloads per priority (handy for reports and tests)."""
    out: dict[int, int] = {}
    for w in workloads.values():
        out[w.priority] = out.get(w.priority, 0) + 1
    return out


def _bump(counts: dict[int, int], key: int, by: int) -> None:
    """Count ``by`` more at ``key``; a count that reaches zero is dropped, so the
    preemption pre-check ("does anyone hold at a lower priority?") scans only live
    priorities, not every priority ever held (fine-grained levels make many)."""
    n = counts.get(key, 0) + by
    if n:
        counts[key] = n
    else:
        counts.pop(key, None)
