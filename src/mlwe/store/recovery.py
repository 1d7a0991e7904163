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
:class:`StoreWriter`. The writer follows the control plane's effects log
(``ControlPlane.effects``, reader ``"store"``): at each flush it reads the
records of every batch applied since the last one, whoever applied it and from
whatever thread (their transitions, the workloads, nodes and queues they
changed, including batches with no lifecycle transition such as progress
reports or priority changes, and the decision records, also those filed
outside a batch), adds the audit records queued with
:meth:`StoreWriter.note_audit`, and writes all of it in ONE transaction
(nodes, queues, workload rows and changed specs, transitions, decisions,
version, and with an :class:`AuditLog` the audit chain's entries). Only once
that transaction has committed does it mark those records read. It registers
no listener; a control plane has at most one writer.

**Acknowledged = flushed.** The runtime calls ``flush()`` after each ``apply``
(or after a group of them) and acknowledges a submission, or any other
request, only once the flush that covers it has returned. A crash before that
loses only what was never acknowledged.

Batches undone by ``ControlPlane.rollback_to`` (requests the store could not
take) leave the effects log with their records, so the writer has nothing of
them to forget; only the audit records it queued for them are its own to drop
(:meth:`StoreWriter.audit_mark`, :meth:`StoreWriter.drop_audit_after`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlwe.core.actions import AddNode, SetNodeStatus, SetQueue
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.clock import Clock
from mlwe.core.cluster import node_spec_of
from mlwe.core.controlplane import (
    ApplyResult,
    Changed,
    ControlPlane,
    Effects,
    InvariantViolation,
)
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
#: The writer's reader of ``ControlPlane.effects``: a control plane has at most one writer.
STORE_READER = "store"


class StoreWriter:
    """Writes what a control plane changed, read from its effects log, in one
    transaction per flush (see the module docstring)."""

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
        #: Audit records queued by :meth:`note_audit`: the writer's own buffer (they
        #: are not control-plane effects).
        self._audit_records: list[dict[str, Any]] = []
        #: The audit entries the last flush wrote (for the live audit stream).
        self.last_audit: list[AuditEntry] = []
        #: The transitions the last flush wrote, in order (for the live state stream).
        self.last_transitions: list[tuple[Workload, Transition]] = []
        self.cp: ControlPlane | None = None
        self._stored_version: int | None = None
        self.flushes = 0

    # ---------------------------------------------------------------- wiring
    def attach(self, cp: ControlPlane, *, sync: bool = False) -> StoreWriter:
        """Start following ``cp``'s effects. ``sync``: first store everything it holds.

        Use ``sync=True`` for a control plane built outside the store (nodes
        added, workloads submitted before attaching); a control plane from
        :func:`recover` is already stored.
        """
        if self.cp is not None:
            raise RuntimeError("this writer already follows a control plane")
        if cp.effects.follows(STORE_READER):
            raise RuntimeError("this control plane already has a store writer")
        cp.effects.follow(STORE_READER)
        self.cp = cp
        if sync:
            self.sync()
        else:
            self._stored_version = cp.version
        return self

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

    def audit_mark(self) -> int:
        """How many audit records are queued now; :meth:`drop_audit_after` drops those
        queued after it (the runtime does, with the batches it rolls back: what the
        batches changed leaves the control plane's effects with them)."""
        return len(self._audit_records)

    def drop_audit_after(self, mark: int) -> None:
        del self._audit_records[mark:]

    # ----------------------------------------------------------------- state
    def pending(self) -> bool:
        """Whether anything applied is not yet durable."""
        cp = self._cp()
        return bool(
            cp.effects.has_unread(STORE_READER)
            or self._audit_records
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
        self.last_audit = []
        self.last_transitions = []
        if not self.pending() and extra is None:
            return 0
        upto = cp.effects.end
        w = _Writes.of(cp.effects.unread(STORE_READER))
        dirty = w.workloads
        for d in w.decisions:
            if d.workload in cp.workloads:  # e.g. a changed pending reason
                dirty[d.workload] = None
        new_ids = {wid for wid, step, _ in w.transitions if step == 0}
        wl = cp.workloads
        touched = [wl[i] for i in dirty if i in wl]
        new = [x for x in touched if x.id in new_ids]
        old = [x for x in touched if x.id not in new_ids]
        respecified = [wl[i] for i in w.respecified if i in wl and i not in new_ids]
        transitions = w.transitions
        decisions = w.decisions
        nodes_added = w.nodes_added
        node_status = w.node_status
        queues = w.queues
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
        self.last_transitions = [(c.workload, c.transition) for c in w.changed]
        del self._audit_records[: len(records)]
        cp.effects.mark_read(STORE_READER, upto)
        self._stored_version = version
        self.flushes += 1
        return len(touched)

    def sync(self) -> None:
        """Store the control plane's whole state (nodes, queues, workloads, decisions)."""
        cp = self._cp()
        nodes = [node_spec_of(cp, info.name) for info in cp.capacity.nodes()]
        queues = [q.spec for q in cp.queues.values()]
        workloads = list(cp.workloads.values())
        upto = cp.effects.end
        unread = _Writes.of(cp.effects.unread(STORE_READER))
        # what the control plane kept (also from before attaching) and what was not written
        decisions = list({d.seq: d for d in [*cp.decisions, *unread.decisions]}.values())
        # a stored workload keeps its stored spec through insert_workloads
        respecified = [cp.workloads[i] for i in unread.respecified if i in cp.workloads]
        version = cp.version
        repo = self.repo

        def go(c: Any) -> None:
            repo.save_cluster(nodes, queues, conn=c)
            repo.insert_workloads(workloads, version=version, conn=c)
            repo.save_workload_states(workloads, version, conn=c)
            repo.update_specs(respecified, conn=c)
            repo.append_decisions(decisions, conn=c)
            repo.meta_set("version", str(version), conn=c)

        repo.write(go)
        cp.effects.mark_read(STORE_READER, upto)
        self._stored_version = version


@dataclass
class _Writes:
    """What a flush writes, gathered from the effects records it has not written yet."""

    changed: list[Changed]
    transitions: list[tuple[str, int, Transition]]  # workload, its history step, transition
    workloads: dict[str, None]  # ids of the workload records to write, in order
    nodes_added: dict[str, NodeSpec]
    node_status: dict[str, None]
    queues: dict[str, None]
    respecified: dict[str, None]
    decisions: list[DecisionRecord]

    @classmethod
    def of(cls, effects: Sequence[Effects]) -> _Writes:
        w = cls([], [], {}, {}, {}, {}, {}, [])
        for e in effects:
            for c in e.transitions:
                w.changed.append(c)
                w.transitions.append((c.workload.id, _step(c), c.transition))
            w.workloads.update(dict.fromkeys(e.workloads))
            for spec in e.nodes_added:
                w.nodes_added[spec.name] = spec
            w.node_status.update(dict.fromkeys(e.node_status))
            w.queues.update(dict.fromkeys(e.queues))
            w.respecified.update(dict.fromkeys(e.respecified))
            w.decisions += e.decisions
        return w


def _step(c: Changed) -> int:
    """The transition's position in its workload's history (a batch may give one
    workload several; later batches may have added more)."""
    h = c.workload.history
    step = len(h) - 1
    while step >= 0 and h[step] is not c.transition:
        step -= 1
    if step < 0:
        raise RuntimeError(f"transition of {c.workload.id} is not in its history")
    return step


def attach(
    repo: Repository, cp: ControlPlane, *, sync: bool = False, writer: StoreWriter | None = None
) -> StoreWriter:
    """Persist ``cp``'s changes to ``repo`` from now on; call ``flush()`` before acknowledging."""
    return (writer or StoreWriter(repo)).attach(cp, sync=sync)
