"""Keeping the control plane durable: persisting its changes, and rebuilding it on start.

:func:`recover` rebuilds a control plane from the store: nodes and queues go
in through ``apply`` (``AddNode``, ``SetNodeStatus``, ``SetQueue``), then the
workloads through ``ControlPlane.restore``, which re-checks every placement
against capacity and runs the full invariant sweep. The engine passes a
``quarantined`` list: a record that cannot be read back or restored is moved
whole into the quarantine table and the rest comes back (one bad record never
stops a start); without it (tools, tests) nothing is loaded and
:class:`RecoveryError` says what is wrong.

:func:`attach` connects a control plane to the store through a
:class:`StoreWriter`. The writer collects, per applied batch, the transitions
(a ``listeners`` entry), the workloads, nodes and queues each accepted batch
touched, the decision records, and the audit records queued with
:meth:`StoreWriter.note_audit`; :meth:`StoreWriter.flush` writes all of it in
ONE transaction (nodes, queues, workload rows and changed specs, transitions,
decisions, version, and with an :class:`AuditLog` the audit chain's entries).

**Acknowledged = flushed.** The runtime calls ``flush()`` after each ``apply``
(or after a group of them) and acknowledges a submission, or any other
request, only once the flush that covers it has returned. A crash before that
loses only what was never acknowledged.

To see every accepted batch that changed state, including those with no
lifecycle transition (progress reports, priority changes, node and queue
changes), the writer registers on that one control plane's hooks: its
``batch_listeners`` (each such batch, with its actions and result), its
``listeners`` (transitions) and its ``decision_listeners`` (a control plane
without them has its ``decisions`` list read at each flush instead). Nothing
is wrapped or patched; a control plane has at most one writer.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlwe.core.actions import (
    AddNode,
    Preempt,
    SetNodeStatus,
    SetQueue,
    SetResources,
    Submit,
)
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.clock import Clock
from mlwe.core.cluster import node_spec_of
from mlwe.core.controlplane import ApplyResult, ControlPlane, InvariantViolation
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import Transition
from mlwe.core.model import Workload
from mlwe.core.spec import NodeSpec
from mlwe.store.audit import AuditEntry, AuditLog
from mlwe.store.repository import CorruptRecord, Repository

#: Cause id of the batches recovery applies (node and queue set-up).
RECOVERY_CAUSE = "recovery"


class RecoveryError(RuntimeError):
    """The stored state cannot be loaded; the control plane was not built."""


# ================================================================== recovery
@dataclass(frozen=True)
class Quarantined:
    """A stored record recovery could not load, moved to the quarantine table."""

    id: int
    table: str  # workload, node, queue
    key: str
    problem: str

    def __str__(self) -> str:
        return f"#{self.id} {self.table} {self.key}: {self.problem}"


def recover(
    repo: Repository,
    clock: Clock,
    catalog: GpuCatalog = DEFAULT_CATALOG,
    *,
    decision_sink: Callable[[DecisionRecord], None] | None = None,
    check_invariants: bool = True,
    quarantined: list[Quarantined] | None = None,
) -> ControlPlane:
    """A control plane holding exactly what the store holds.

    The version and the decision sequence continue from the stored ones.
    Without ``quarantined``, raises :class:`RecoveryError` (nothing loaded)
    when a stored record cannot be read back or the restored state breaks an
    invariant (for example a placement larger than its node).

    With ``quarantined`` (what the engine passes), one bad record never stops
    a start: a node, queue or workload that cannot be read back, or a
    workload that cannot be restored (its queue or node is gone, its
    placement does not fit), is moved whole into the quarantine table (see
    :meth:`Repository.quarantine`), appended to ``quarantined``, and the rest
    of the cluster comes back. Only a broken invariant of the loaded state as
    a whole (a bug, not a record) still raises.
    """
    cp = ControlPlane(
        clock, catalog=catalog, check_invariants=check_invariants, decision_sink=decision_sink
    )
    bad: list[tuple[CorruptRecord, dict[str, Any]]] | None = [] if quarantined is not None else None
    unrestorable: list[tuple[str, str, str, dict[str, Any]]] = []
    # Loading builds ~10 objects per workload and none of them are garbage:
    # cyclic GC passes over them are pure cost (seconds at 100,000 workloads).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        nodes = repo.load_nodes(catalog, corrupt=bad)
        for spec, _status in nodes:
            _must(cp.apply([AddNode(spec)], cause_id=RECOVERY_CAUSE), f"stored node {spec.name}")
        changed = [
            SetNodeStatus(spec.name, status, reason="recovered")
            for spec, status in nodes
            if status is not spec.status
        ]
        if changed:
            _must(cp.apply(changed, cause_id=RECOVERY_CAUSE), "stored node status")
        queues = repo.load_queues(catalog, corrupt=bad)
        if queues:
            _must(cp.apply([SetQueue(q) for q in queues], cause_id=RECOVERY_CAUSE), "stored queues")
        workloads = repo.load_workloads(catalog=catalog, corrupt=bad)
        version = repo.max_version()
        decision_seq = repo.max_decision_seq()

        def reject(w: Workload, why: list[str]) -> None:
            unrestorable.append(("workload", w.id, "; ".join(why),
                                 {"workload": w.id, "spec": w.spec.model_dump(mode="json"),
                                  "state": w.state.value,
                                  "placement": [a.node for a in w.placement]}))

        cp.restore(workloads, version=max(version, cp.version), decision_seq=decision_seq,
                   reject=reject if quarantined is not None else None)
    except CorruptRecord as exc:
        raise RecoveryError(f"cannot recover: a stored record is unreadable: {exc}") from exc
    except InvariantViolation as exc:
        raise RecoveryError(f"cannot recover, nothing was loaded: {exc}") from exc
    finally:
        if gc_was_enabled:
            gc.enable()
    if quarantined is not None:
        records = [(e.table, str(e.key), str(e), raw) for e, raw in (bad or [])]
        records += unrestorable
        if records:
            ids = repo.quarantine(records, clock.now())
            quarantined += [Quarantined(i, t, k, p) for i, (t, k, p, _) in zip(ids, records)]
    return cp


def _must(result: ApplyResult, what: str) -> None:
    if not result.accepted:
        raise RecoveryError(f"cannot recover {what}: " + "; ".join(result.reasons()))


# ==================================================================== writer
#: control planes a StoreWriter follows (one writer each)
_FOLLOWED: weakref.WeakSet[ControlPlane] = weakref.WeakSet()


class StoreWriter:
    """Buffers what a control plane changes and writes it in one transaction per flush."""

    def __init__(
        self,
        repo: Repository,
        audit: AuditLog | None = None,
        *,
        correlate: Callable[[DecisionRecord], str | None] | None = None,
    ) -> None:
        self.repo = repo
        #: The correlation id an audited decision is filed under (default: its cause).
        self.correlate = correlate
        #: With an audit log, every decision and every record queued by
        #: :meth:`note_audit` is chained in the SAME transaction as the state it
        #: explains: nothing is durable without its audit record, and vice versa.
        self.audit = audit
        self._audit_records: list[dict[str, Any]] = []
        #: The audit entries the last flush wrote (for the live audit stream).
        self.last_audit: list[AuditEntry] = []
        #: The transitions the last flush wrote, in order (for the live state stream).
        self.last_transitions: list[tuple[Workload, Transition]] = []
        self.cp: ControlPlane | None = None
        self._transitions: list[tuple[Workload, int, Transition]] = []
        self._dirty: dict[str, None] = {}
        self._nodes_added: dict[str, NodeSpec] = {}
        self._node_status: dict[str, None] = {}
        self._queues: dict[str, None] = {}
        self._specs: dict[str, None] = {}  # workloads whose spec changed (SetResources)
        self._decisions: list[DecisionRecord] = []
        self._decisions_seen = 0  # of cp.decisions, when it keeps them itself
        self._stored_version: int | None = None
        self._poll_decisions = True
        self.flushes = 0

    # ---------------------------------------------------------------- wiring
    def attach(self, cp: ControlPlane, *, sync: bool = False) -> StoreWriter:
        """Start following ``cp``. ``sync``: first store everything it already holds.

        Use ``sync=True`` for a control plane built outside the store (nodes
        added, workloads submitted before attaching); a control plane from
        :func:`recover` is already stored.
        """
        if self.cp is not None:
            raise RuntimeError("this writer already follows a control plane")
        if cp in _FOLLOWED:
            raise RuntimeError("this control plane already has a store writer")
        self.cp = cp
        cp.listeners.append(self._on_transition)
        cp.batch_listeners.append(self._note)
        _FOLLOWED.add(cp)
        listeners = getattr(cp, "decision_listeners", None)
        self._poll_decisions = listeners is None
        if listeners is not None:
            listeners.append(self._on_decision)
        self._decisions_seen = len(cp.decisions)
        if sync:
            self.sync()
        else:
            self._stored_version = cp.version
        return self

    def _on_decision(self, rec: DecisionRecord) -> None:
        self._decisions.append(rec)

    def _poll(self, cp: ControlPlane) -> None:
        # control planes without decision listeners keep their records in cp.decisions
        if self._poll_decisions and len(cp.decisions) > self._decisions_seen:
            self._decisions.extend(cp.decisions[self._decisions_seen :])
            self._decisions_seen = len(cp.decisions)

    def _on_transition(self, w: Workload, tr: Transition) -> None:
        h = w.history
        step = len(h) - 1
        while step >= 0 and h[step] is not tr:  # a batch may give one workload several
            step -= 1
        if step < 0:
            raise RuntimeError(f"transition of {w.id} is not in its history")
        self._transitions.append((w, step, tr))
        self._dirty[w.id] = None

    def _note(self, actions: Any, result: ApplyResult) -> None:
        for wid in result.created:
            self._dirty[wid] = None
        for a in actions:
            if isinstance(a, Submit):
                continue
            if isinstance(a, Preempt):
                self._dirty[a.victim] = None
                self._dirty[a.preemptor] = None
            elif isinstance(a, AddNode):
                self._nodes_added[a.spec.name] = a.spec
            elif isinstance(a, SetNodeStatus):
                self._node_status[a.node] = None
            elif isinstance(a, SetQueue):
                self._queues[a.spec.name] = None
            elif isinstance(a, SetResources):
                self._dirty[a.workload] = None
                self._specs[a.workload] = None  # the spec column changes too
            else:
                subject = getattr(a, "workload", None)
                if isinstance(subject, str):
                    self._dirty[subject] = None

    def note_audit(
        self,
        kind: str,
        actor: str,
        payload: dict[str, Any],
        *,
        workload: str | None = None,
        correlation_id: str | None = None,
    ) -> None:
        """Queue an audit record (operator action, proposal, config change) for the next flush."""
        if self.audit is None:
            return
        self._audit_records.append(
            {"kind": kind, "actor": actor, "payload": payload, "workload": workload,
             "correlation_id": correlation_id}
        )

    # ----------------------------------------------------------------- marks
    def mark(self) -> tuple[Any, ...]:
        """What is buffered now; :meth:`reset` drops whatever was buffered after it
        (the runtime does when it rolls back batches the store could not take)."""
        self._poll(self._cp())
        return (
            len(self._transitions), len(self._decisions), len(self._audit_records),
            dict(self._dirty), dict(self._nodes_added), dict(self._node_status),
            dict(self._queues), dict(self._specs), self._decisions_seen,
        )

    def reset(self, mark: tuple[Any, ...]) -> None:
        (transitions, decisions, records, dirty, added, status, queues, specs, seen) = mark
        del self._transitions[transitions:]
        del self._decisions[decisions:]
        del self._audit_records[records:]
        self._dirty, self._nodes_added, self._node_status = dict(dirty), dict(added), dict(status)
        self._queues, self._specs = dict(queues), dict(specs)
        self._decisions_seen = min(self._decisions_seen, seen)

    # ----------------------------------------------------------------- state
    def pending(self) -> bool:
        """Whether anything applied is not yet durable."""
        cp = self._cp()
        return bool(
            self._transitions
            or self._dirty
            or self._nodes_added
            or self._node_status
            or self._queues
            or self._decisions
            or self._audit_records
            or (self._poll_decisions and len(cp.decisions) > self._decisions_seen)
            or cp.version != self._stored_version
        )

    def _cp(self) -> ControlPlane:
        if self.cp is None:
            raise RuntimeError("the writer is not attached to a control plane")
        return self.cp

    # ----------------------------------------------------------------- flush
    def flush(self, extra: Callable[[Any], None] | None = None) -> int:
        """Write everything applied since the last flush, in one transaction.

        Returns how many workload rows were written. Retried on transient
        database errors; if it finally fails, nothing is dropped: the next
        flush writes it all again (every write is idempotent). ``extra(conn)``
        runs in the same transaction (e.g. marking a bus event processed).
        """
        cp = self._cp()
        self._poll(cp)
        self.last_audit = []
        self.last_transitions = []
        if not self.pending() and extra is None:
            return 0
        for d in self._decisions:
            if d.workload in cp.workloads:  # e.g. a changed pending reason
                self._dirty[d.workload] = None
        new_ids = {w.id for w, step, _ in self._transitions if step == 0}
        wl = cp.workloads
        touched = [wl[i] for i in self._dirty if i in wl]
        new = [w for w in touched if w.id in new_ids]
        old = [w for w in touched if w.id not in new_ids]
        respecified = [wl[i] for i in self._specs if i in wl and i not in new_ids]
        flushed = list(self._transitions)
        transitions = [(w.id, step, tr) for w, step, tr in flushed]
        decisions = list(self._decisions)
        nodes_added = dict(self._nodes_added)
        node_status = list(self._node_status)
        queues = list(self._queues)
        version = cp.version
        repo = self.repo
        audit = self.audit
        records = list(self._audit_records)
        written: list[AuditEntry] = []

        def go(c: Any) -> None:
            written.clear()  # a retried transaction starts again
            for name, spec in nodes_added.items():
                repo.upsert_node(
                    spec, cp.node_status(name), position=cp.capacity.info(name).order, conn=c
                )
            for name in node_status:
                if name not in nodes_added:
                    repo.set_node_status(name, cp.node_status(name), conn=c)
            for q in queues:
                repo.put_queue(cp.queues[q].spec, conn=c)
            repo.insert_workloads(new, version=version, with_history=False, conn=c)
            repo.save_workload_states(old, version, conn=c)
            repo.update_specs(respecified, conn=c)
            repo.append_transitions(transitions, conn=c)
            repo.append_decisions(decisions, conn=c)
            repo.meta_set("version", str(version), conn=c)
            if audit is not None:
                entries = [*records, *(
                    {"kind": "decision", "actor": d.policy, "payload": d.to_dict(),
                     "workload": d.workload,
                     "correlation_id": self.correlate(d) if self.correlate is not None
                     else d.cause_id}
                    for d in decisions
                )]
                written.extend(audit.extend(entries, conn=c))
            if extra is not None:
                extra(c)

        repo.write(go)
        # only now is it durable: forget exactly what was written
        self.last_audit = list(written)
        self.last_transitions = [(w, tr) for w, _, tr in flushed]
        del self._audit_records[: len(records)]
        del self._transitions[: len(transitions)]
        del self._decisions[: len(decisions)]
        self._dirty.clear()
        self._specs.clear()
        self._nodes_added.clear()
        self._node_status.clear()
        self._queues.clear()
        self._stored_version = version
        self.flushes += 1
        return len(touched)

    def sync(self) -> None:
        """Store the control plane's whole state (nodes, queues, workloads, decisions)."""
        cp = self._cp()
        nodes = [node_spec_of(cp, info.name) for info in cp.capacity.nodes()]
        queues = [q.spec for q in cp.queues.values()]
        workloads = list(cp.workloads.values())
        self._poll(cp)
        # what the control plane kept (also from before attaching) and what was buffered
        decisions = list({d.seq: d for d in [*cp.decisions, *self._decisions]}.values())
        version = cp.version
        repo = self.repo

        def go(c: Any) -> None:
            repo.save_cluster(nodes, queues, conn=c)
            repo.insert_workloads(workloads, version=version, conn=c)
            repo.save_workload_states(workloads, version, conn=c)
            repo.append_decisions(decisions, conn=c)
            repo.meta_set("version", str(version), conn=c)

        repo.write(go)
        self._transitions.clear()
        self._decisions.clear()
        self._decisions_seen = len(cp.decisions)
        self._dirty.clear()
        self._nodes_added.clear()
        self._node_status.clear()
        self._queues.clear()
        self._stored_version = version


def attach(
    repo: Repository, cp: ControlPlane, *, sync: bool = False, writer: StoreWriter | None = None
) -> StoreWriter:
    """Persist ``cp``'s changes to ``repo`` from now on; call ``flush()`` before acknowledging."""
    return (writer or StoreWriter(repo)).attach(cp, sync=sync)
