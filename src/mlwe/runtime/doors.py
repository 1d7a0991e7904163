"""The engine's request doors: one method per kind of request, each a thin wrapper
over the one request path, :meth:`Engine.request <mlwe.runtime.engine.Engine.request>`.

Each door builds its :class:`~mlwe.runtime.requests.Request` (what it asks, who
asks, the audit record it leaves; :mod:`mlwe.runtime.requests`) and hands it to
``request``, which screens it, applies it to the control plane under the engine
lock, audits it and returns once it is durable (or rejected: nothing stored).
Three do a little more: :meth:`RequestDoors.drain` (a cordon, then a requeue of
each workload on the node), :meth:`RequestDoors.ingest` (a bus event's actions,
exactly once: the event id is stored in the same transaction) and
:meth:`RequestDoors.record_reasoning` (an agent's trace, stored and streamed).

:class:`RequestDoors` is a mixin the :class:`~mlwe.runtime.engine.Engine` inherits;
what it needs of the engine is declared on it (the attributes, and the request
path as abstract methods), so that it type-checks on its own.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from mlwe.core.actions import Action
from mlwe.core.clock import Clock
from mlwe.core.controlplane import ApplyResult, ControlPlane
from mlwe.core.spec import NodeSpec, NodeStatus, QueueSpec, WorkloadSpec
from mlwe.runtime.requests import (
    Request,
    cancel_request,
    event_request,
    node_request,
    node_status_request,
    note_request,
    priority_request,
    proposal_request,
    queue_request,
    requeue_request,
    submit_request,
)
from mlwe.runtime.streams import StreamHub
from mlwe.store.recovery import StoreWriter
from mlwe.store.repository import Repository


class RequestRejected(ValueError):
    """The control plane refused a request; ``reasons`` says why, one line each."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons) or "rejected")


class RequestDoors(ABC):
    """The request doors of an engine (see the module docstring)."""

    # what the doors use of the engine (set by ``Engine.__init__``)
    cp: ControlPlane
    repo: Repository
    clock: Clock
    writer: StoreWriter
    streams: StreamHub
    lock: threading.RLock
    _flush_mutex: threading.Lock

    @abstractmethod
    def request(self, req: Request) -> ApplyResult:
        """Apply one request through the one request path; returns once it is durable."""

    @abstractmethod
    def requests(self, reqs: Sequence[Request]) -> list[ApplyResult]:
        """Independent requests, made durable together (group commit)."""

    @abstractmethod
    def _durably(
        self, reqs: Sequence[Request], extra: Callable[[Any], None] | None = None
    ) -> list[ApplyResult]:
        """Apply ``reqs`` and flush them (with ``extra`` in the same transaction)."""

    @abstractmethod
    def _commit(self) -> None:
        """Return once everything applied so far is durable."""

    @abstractmethod
    def wake(self, *, soon: bool = False) -> None:
        """Ask the engine loop for a tick."""

    def submit(
        self,
        specs: Sequence[WorkloadSpec],
        *,
        actor: str = "api",
        correlation_id: str | None = None,
    ) -> ApplyResult:
        """Submit workloads; returns once they are durable (or the rejection, nothing stored)."""
        return self.request(submit_request(specs, actor, correlation_id))

    def submit_many(
        self, requests: Sequence[tuple[Sequence[WorkloadSpec], str, str | None]]
    ) -> list[ApplyResult]:
        """Independent submissions ``(specs, actor, correlation id)``, durable together."""
        return self.requests([submit_request(s, a, c) for s, a, c in requests])

    def cancel(
        self, workload_id: str, *, actor: str = "api", correlation_id: str | None = None
    ) -> ApplyResult:
        return self.request(cancel_request(self.cp, workload_id, actor, correlation_id))

    def set_priority(
        self, workload_id: str, priority: int, *, actor: str = "api", reason: str = ""
    ) -> ApplyResult:
        return self.request(priority_request(self.cp, workload_id, priority, actor, reason))

    def set_node_status(
        self, node: str, status: NodeStatus, reason: str = "", *, actor: str = "api"
    ) -> ApplyResult:
        """Cordon (take nothing new), uncordon, or mark down (its workloads are requeued)."""
        return self.request(node_status_request(self.cp, node, status, reason, actor))

    def drain(self, node: str, *, actor: str = "api", reason: str = "drain") -> ApplyResult:
        """Cordon a node and stop what runs there (each workload goes back to the queue)."""
        with self.lock:
            holders = [h.id for h in self.cp.holders(node)]
        result = self.set_node_status(node, NodeStatus.CORDONED, reason, actor=actor)
        if not result.accepted:
            return result
        for wid in holders:
            self.requeue(wid, actor=actor, reason=f"node {node} drained")
        return result

    def requeue(self, workload_id: str, *, actor: str = "api", reason: str = "") -> ApplyResult:
        """Checkpoint-and-stop a running workload and put it back in the queue."""
        return self.request(requeue_request(workload_id, actor, reason))

    def set_queue(self, spec: QueueSpec, *, actor: str = "admin") -> ApplyResult:
        return self.request(queue_request(spec, actor))

    def add_node(self, spec: NodeSpec, *, actor: str = "admin") -> ApplyResult:
        return self.request(node_request(spec, actor))

    def propose(
        self,
        actions: Sequence[Action],
        *,
        actor: str,
        expected_version: int | None = None,
        correlation_id: str | None = None,
        rationale: str | None = None,
    ) -> ApplyResult:
        """An agent's (or any automation's) proposal: verified, applied or rejected, audited."""
        return self.request(proposal_request(actions, actor, expected_version=expected_version,
                                             correlation_id=correlation_id, rationale=rationale))

    def ingest(
        self,
        event_id: str,
        actions: Sequence[Action],
        *,
        actor: str,
        correlation_id: str | None = None,
        what: dict[str, Any] | None = None,
    ) -> bool:
        """Apply a bus event's actions exactly once; False if it was already processed.

        The event id goes into ``processed_events`` in the same transaction as
        the state it changed and its audit record. A rejected request raises
        :class:`RequestRejected` (nothing applied, nothing stored); so does one
        the store cannot take (:class:`StoreRefused`: rolled back, so a
        redelivery applies it afresh).
        """
        req = event_request(event_id, actions, actor, correlation_id, what)
        with self._flush_mutex:
            with self.lock:
                if self.repo.is_processed(event_id) or self.cp.seen_event(event_id):
                    return False
            now = self.clock.now()
            def mark(c: Any) -> None:
                self.repo.mark_processed(c, event_id, now)

            results = self._durably([req], extra=mark)
        result = results[0]
        if result.duplicate:
            return False
        if not result.accepted:
            raise RequestRejected(result.reasons())
        self.wake()
        return True

    def note_audit(
        self,
        kind: str,
        actor: str,
        payload: dict[str, Any],
        *,
        workload: str | None = None,
        correlation_id: str | None = None,
    ) -> None:
        """Record an action taken outside the control plane (e.g. a model promotion).

        Durable when this returns; a payload with a number that is not finite is
        refused (:class:`RequestRejected`)."""
        result = self.request(note_request(kind, actor, payload, workload=workload,
                                           correlation_id=correlation_id))
        if not result.accepted:
            raise RequestRejected(result.reasons())

    def record_reasoning(
        self, record: dict[str, Any], *, correlation_id: str | None = None, actor: str = "agent"
    ) -> None:
        """Store an agent reasoning trace, chain it in the audit log, and stream it."""
        with self.lock:
            now = self.clock.now()
            self.repo.append_reasoning(record, time=now, correlation_id=correlation_id)
            self.writer.note_audit(
                "reasoning", actor, record, workload=record.get("workload"),
                correlation_id=correlation_id,
            )
        self._commit()
        self.streams.publish(
            "reasoning", record, correlation_id=correlation_id, workload=record.get("workload")
        )
