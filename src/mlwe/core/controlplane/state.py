"""The control plane's state and the primitives every handler uses: lifecycle
transitions with their undo, holding and freeing capacity, decision records,
the effects log's readers and savepoints; the result types of ``apply``; the
shared rules."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain

from mlwe.core.actions import subject
from mlwe.core.capacity import FULL, CapacityIndex, NodeInfo, ReplicaAlloc
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.clock import Clock
from mlwe.core.controlplane.effects import Changed, Effects, EffectsLog
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import QUEUED, TRANSITIONS, State, Transition
from mlwe.core.model import Queue, Workload
from mlwe.core.resources import Resources
from mlwe.core.spec import NodeStatus, QueueSpec, WorkloadSpec

DEFAULT_QUEUE = "default"
#: The reader of the effects log behind :meth:`PlaneState.take_effects` (the reconciler).
RECONCILER = "reconciler"
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
    effects: int  # the position of the effects log's next record when it was taken
    undo: list[list[Callable[[], None]]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

class PlaneState:
    """The state of :class:`mlwe.core.controlplane.ControlPlane` and its primitives
    (the handlers of each kind of action are mixed in over it)."""

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
        #: node -> ids of the workloads holding there, each with the sequence number
        #: of its hold there (ascending in the dict's order: see :meth:`hold_key`)
        self.on_node: dict[str, dict[str, int]] = {}
        self._hold_seq = 0
        self._node_ranks: dict[str, int] = {}  # node -> its place in on_node (hold_key)
        self.queues: dict[str, Queue] = {}
        self.holding_by_priority: dict[int, int] = {}  # priority -> workloads holding resources
        #: Bumped whenever any workload takes or gives back resources, and when that
        #: is undone: projections (and the holder list) made at one epoch stay valid
        #: until it changes.
        self.holding_epoch = 0
        self._holder_ids: tuple[int, tuple[str, ...]] = (-1, ())
        self.decisions: list[DecisionRecord] = []
        #: Called after each applied batch, once per state transition in it (in order):
        #: observers that need a push (the agent's monitor, metrics, history). What is
        #: owed to the backend and what is to be stored are read from :attr:`effects`.
        self.listeners: list[Callable[[Workload, Transition], None]] = []
        #: Called with every stamped decision record: observers (recent decisions);
        #: the store reads them from :attr:`effects`.
        self.decision_listeners: list[Callable[[DecisionRecord], None]] = []
        #: What each applied batch did, and the decision records filed outside batches,
        #: kept for each reader that follows it (the reconciler, the store writer).
        self.effects = EffectsLog()
        #: The decision records filed by the batch being committed (None outside one).
        self._batch_decisions: list[DecisionRecord] | None = None
        self._sink = decision_sink
        self._decision_seq = 0
        self._seq = 0
        self._events: dict[str, int] = {}
        self._max_events = max_remembered_events
        self.invariant_checks = 0
        self.counters: dict[str, int] = {}
        self._savepoint: Savepoint | None = None
        #: The ids of the workloads each applied batch changed, in order (see
        #: :meth:`changed_since`): readers that keep what they read of workloads
        #: across cycles update it from here instead of reading every workload.
        self._journal: list[str] = []
        self._journal_start = 0  # the position of _journal[0]
        #: Bumped when the journal cannot tell what changed since a position taken
        #: before (a rollback, a restore): every reader then reads everything again.
        self._journal_generation = 0
        self._put_queue(QueueSpec(name=DEFAULT_QUEUE))

    # ================================================================= effects
    # The reconciler's reader of :attr:`effects`: it needs only the transitions.
    def keep_effects(self) -> None:
        """Keep the transitions of every applied batch for :meth:`take_effects`
        (the reconciler asks; a control plane nobody reads keeps nothing)."""
        if not self.effects.follows(RECONCILER):
            self.effects.follow(RECONCILER)

    def take_effects(self) -> tuple[Changed, ...]:
        """The transitions applied since the last call, in order, now read (other
        readers of :attr:`effects` still have them).

        A batch rolled back (:meth:`rollback_to`) is gone from them, so taking is
        refused while a savepoint is open (it could take what is then undone)."""
        if self._savepoint is not None:
            raise RuntimeError("effects are taken only with no savepoint open")
        if not self.effects.follows(RECONCILER):
            return ()
        return _transitions(self.effects.take(RECONCILER))

    def pending_effects(self) -> tuple[Changed, ...]:
        """What :meth:`take_effects` would return, without taking it."""
        if not self.effects.follows(RECONCILER):
            return ()
        return _transitions(self.effects.unread(RECONCILER))

    # ================================================================= journal
    #: the most ids the journal keeps; past it, it starts over and readers read all
    JOURNAL_LIMIT = 1 << 16

    def journal_mark(self) -> tuple[int, int]:
        """A position in the journal of changed workloads, for :meth:`changed_since`."""
        return (self._journal_generation, self._journal_start + len(self._journal))

    def changed_since(self, mark: tuple[int, int]) -> list[str] | None:
        """The ids of the workloads that applied batches changed since ``mark`` (a
        :meth:`journal_mark`), in order and possibly repeated; None when that can
        no longer be told (a rollback or a restore since, or the journal started
        over): the reader must then read every workload again. A workload whose
        record an applied batch changed in any way (a transition, its priority,
        its spec, a progress report, a preemption naming it) is in it."""
        gen, at = mark
        if gen != self._journal_generation or at < self._journal_start:
            return None
        return self._journal[at - self._journal_start :]

    def _journal_note(self, ids: Sequence[str]) -> None:
        journal = self._journal
        if len(journal) > self.JOURNAL_LIMIT:
            self._journal_start += len(journal)
            journal.clear()
        journal.extend(ids)

    def _journal_reset(self) -> None:
        """What was read of workloads before now cannot be brought up to date."""
        self._journal_generation += 1
        self._journal_start += len(self._journal)
        self._journal.clear()

    # ============================================================== savepoints
    def savepoint(self) -> Savepoint:
        """Start keeping the undo log of every applied batch (one savepoint at a time)."""
        if self._savepoint is not None:
            raise RuntimeError("a savepoint is already open")
        sp = Savepoint(self.version, self._decision_seq, len(self.decisions), dict(self.counters),
                       self.effects.end)
        self._savepoint = sp
        return sp

    def release(self, sp: Savepoint) -> None:
        """Keep what was applied since ``sp`` (it is durable now)."""
        if self._savepoint is sp:
            self._savepoint = None

    def rollback_to(self, sp: Savepoint) -> None:
        """Undo every batch applied since ``sp``, newest first, and close it.

        Their effects (and the decision records filed since) are dropped from
        :attr:`effects` for every reader. Push listeners have seen those batches:
        an observer that keeps what they said rolls it back itself."""
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
        self.effects.truncate(sp.effects)
        self._journal_reset()
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
        return list(map(self.workloads.__getitem__, self.queued))

    def holders(self, node: str) -> list[Workload]:
        w = self.workloads
        return [w[i] for i in self.on_node.get(node, ())]

    def holder_ids(self) -> tuple[str, ...]:
        """Every workload holding resources, once each, in the order of the nodes it
        holds on (a gang appears on several; its first node places it). Kept until
        the holding epoch moves: a cycle's projection and its gain search both read it."""
        got = self._holder_ids
        if got[0] != self.holding_epoch:
            ids = tuple(dict.fromkeys(chain.from_iterable(self.on_node.values())))
            got = self._holder_ids = (self.holding_epoch, ids)
        return got[1]

    def hold_key(self, w: Workload) -> tuple[int, int]:
        """Where holder ``w`` comes in :meth:`holder_ids`: the place of the first node
        it holds on (in the order nodes were added) and its hold's sequence number
        there; comparing keys compares places in that order. It moves only when
        ``w`` is held anew, which a batch that changes it names in the journal."""
        ranks = self._node_ranks
        if len(ranks) != len(self.on_node):
            ranks = self._node_ranks = {node: i for i, node in enumerate(self.on_node)}
        on_node = self.on_node
        return min((ranks[a.node], on_node[a.node][w.id]) for a in w.placement)

    def node_status(self, node: str) -> NodeStatus:
        return self.capacity.status(node)

    # ================================================================ decisions
    def record(self, rec: DecisionRecord) -> DecisionRecord:
        """Stamp and store a decision record (sequence, time, version)."""
        self._decision_seq += 1
        stamped = rec.stamped(self.clock.now(), self.version, self._decision_seq)
        if self._sink is not None:
            self._sink(stamped)
        else:
            self.decisions.append(stamped)
        batch = self._batch_decisions
        if batch is not None:
            batch.append(stamped)  # filed with the batch being committed
        elif self.effects.followed:
            self.effects.append(Effects(self.version, decisions=(stamped,)))
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
        self._hold_seq += 1
        for a in allocs:
            self.capacity.allocate(a)
            self.on_node.setdefault(a.node, {})[w.id] = self._hold_seq
            txn.touched_nodes[a.node] = None
            _add(q.usage, a.res, 1)
        self._set(txn, w, "placement", allocs)

        def undo() -> None:
            _bump(hp, w.priority, -1)
            self.holding_epoch += 1  # what was read at the epoch this batch moved to is gone
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
                self.holding_epoch += 1
                # held again, last on its nodes: a reader that kept where it held
                # (hold_key) reads it again
                self._hold_seq += 1
                self._journal_note((w.id,))
            for a in allocs:
                self.capacity.allocate(a)
                self.on_node[a.node][w.id] = self._hold_seq
                _add(q.usage, a.res, 1)

        txn.undo.append(undo)

    # ============================================================ verification
    def _workload(self, wid: object) -> tuple[Workload | None, list[str]]:
        if not isinstance(wid, str) or wid not in self.workloads:
            return None, [f"unknown workload {wid!r}"]
        return self.workloads[wid], []

    def _put_queue(self, spec: QueueSpec) -> None:
        old = self.queues.get(spec.name)
        q = Queue(spec=spec, nominal=spec.nominal_vector(), borrow_limit=spec.borrow_vector())
        if old is not None:
            q.usage = old.usage  # shared list: usage is a fact, not configuration
        self.queues[spec.name] = q

    # ================================================================ restore


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


def _transitions(effects: tuple[Effects, ...]) -> tuple[Changed, ...]:
    return tuple(c for e in effects for c in e.transitions)


def _with_cause(rec: DecisionRecord, cause_id: str) -> DecisionRecord:
    return replace(rec, cause_id=cause_id)


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
