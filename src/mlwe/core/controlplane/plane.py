"""The control plane's batch path: screen, verify, commit (see the package
docstring), and the dispatch of each action to its handler."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mlwe.core.actions import (
    FACTS,
    Action,
    AddNode,
    Cancel,
    Evict,
    Place,
    Preempt,
    Retry,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    SetResources,
    Start,
    Submit,
)
from mlwe.core.controlplane.cluster import ClusterHandlers
from mlwe.core.controlplane.effects import Changed, batch_effects, changed_workloads
from mlwe.core.controlplane.facts import FactHandlers
from mlwe.core.controlplane.restore import Restore
from mlwe.core.controlplane.state import (
    ApplyResult,
    InvariantViolation,
    Rejection,
    _subject,
    _Txn,
    _with_cause,
)
from mlwe.core.controlplane.workloads import WorkloadHandlers
from mlwe.core.decisions import DecisionRecord


class ControlPlane(WorkloadHandlers, FactHandlers, ClusterHandlers, Restore):
    """Holds the cluster state and is the only thing that changes it (the state and
    its primitives: :mod:`.state`; the handlers by kind of action: :mod:`.workloads`,
    :mod:`.facts`, :mod:`.cluster`; :mod:`.restore`, :mod:`.invariants`)."""

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
        remember the event id (and the savepoint's undo), tell the listeners,
        count the actions, record the decisions, keep its effects."""
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
        for w, tr in txn.transitions:
            for listener in self.listeners:
                listener(w, tr)
        for a in actions:
            self.counters[a.kind] = self.counters.get(a.kind, 0) + 1
        filed: list[DecisionRecord] = []
        self._batch_decisions = filed  # recorded with the batch, not on their own
        try:
            for rec in decisions:
                self.record(rec if rec.cause_id or cause_id is None else _with_cause(rec, cause_id))
        finally:
            self._batch_decisions = None
        if self.effects.followed:
            effects = batch_effects(self.version, actions, changed, txn.created, tuple(filed))
            self.effects.append(effects)
            self._journal_note(effects.workloads)
        else:
            self._journal_note(changed_workloads(actions, changed, txn.created))
        return ApplyResult(True, self.version, (), False, tuple(txn.ignored), tuple(txn.created),
                           changed)

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
