"""Rebuilding the state from stored records at start-up (what cannot be restored
is handed back, never fatal)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.controlplane.invariants import Invariants
from mlwe.core.controlplane.state import (
    InvariantViolation,
    _add,
    _bump,
)
from mlwe.core.lifecycle import HOLDING, QUEUED
from mlwe.core.model import Workload


class Restore(Invariants):
    """Rebuilding the state from stored records at start-up (what cannot be restored"""

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
        self._journal_reset()  # the workloads came in without a batch

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
            self._hold_seq += 1
            for a in w.placement:
                why = self.capacity.check(a) if a.node in self.capacity else [
                    f"placed on unknown node {a.node!r}"]
                if why:
                    problems += [f"{w.id}: {p}" for p in why]
                    continue
                self.capacity.allocate(a)
                taken.append((w, a))
                self.on_node.setdefault(a.node, {})[w.id] = self._hold_seq
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
