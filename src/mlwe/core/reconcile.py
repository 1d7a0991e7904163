"""The engine's step, as pure logic: facts in, scheduling cycle, commands out.

The :class:`Reconciler` is what makes "same control plane, any backend" true.
A driver (the simulator, the runtime) feeds it backend events and asks it for
commands; it never touches a backend itself:

1. ``handle(events)``: each event's fact is applied with its event id (so a
   redelivered event has no second effect); a lost node becomes a status
   change plus a node-lost exit for everything on it.
2. ``step()``: retries whose backoff has elapsed are re-queued, a scheduling
   cycle runs if anything changed since the last one, and every transition the
   control plane applied becomes a command: ADMITTED -> start, PREEMPTING ->
   graceful stop (the preemptor is placed only after the backend's release),
   STOPPING -> stop.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence
from typing import Any

from mlwe.core.actions import Action, Exited, Retry, SetNodeStatus, Start
from mlwe.core.backend import Command, Event, NodeDown, NodeUp, StartCommand, StopCommand
from mlwe.core.controlplane import NOT_ITS_FAULT, ApplyResult, ControlPlane
from mlwe.core.lifecycle import HOLDING, State, Transition
from mlwe.core.model import Workload
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import NodeStatus


def _jitter(key: str) -> float:
    """Deterministic jitter in [0, 1): seeded by the key, the same on every run."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") / 2**32


def correlation_of(w: Workload) -> str | None:
    """The correlation id of a workload's story: the cause of its submission."""
    return w.history[0].cause_id if w.history else None


def start_command(w: Workload) -> StartCommand:
    """The command that starts ``w``'s current attempt (idempotent by its request id)."""
    return StartCommand(
        request_id=f"start:{w.id}:{w.attempt}",
        workload=w.id,
        attempt=w.attempt,
        placement=w.placement,
        spec=w.spec,
        resume_work_s=w.work_done,
        correlation_id=correlation_of(w),
    )


class Reconciler:
    def __init__(
        self,
        cp: ControlPlane,
        scheduler: Scheduler,
        *,
        grace_s: float = 30.0,
        retry_base_s: float = 30.0,
        retry_factor: float = 2.0,
        retry_max_s: float = 1800.0,
    ) -> None:
        self.cp = cp
        self.scheduler = scheduler
        self.grace_s = grace_s
        self.retry_base_s = retry_base_s
        self.retry_factor = retry_factor
        self.retry_max_s = retry_max_s
        self.dirty = True
        self.cycles = 0
        self._to_start: dict[str, None] = {}
        self._to_stop: dict[str, str] = {}
        self._retries: list[tuple[float, int, str]] = []
        self._seq = 0
        self.rejected: list[ApplyResult] = []
        cp.listeners.append(self._on_transition)

    # ----------------------------------------------------------------- marks
    def mark(self) -> tuple[Any, ...]:
        """What is owed to the backend now; :meth:`reset` goes back to it (the runtime
        does when batches it applied are rolled back: their commands are not owed)."""
        return (dict(self._to_start), dict(self._to_stop), list(self._retries), self._seq)

    def reset(self, mark: tuple[Any, ...]) -> None:
        start, stop, retries, seq = mark
        self._to_start, self._to_stop, self._retries, self._seq = (
            dict(start), dict(stop), list(retries), seq
        )

    # ------------------------------------------------------------- transitions
    def _on_transition(self, w: Workload, tr: Transition) -> None:
        target = tr.target
        if target is State.ADMITTED:
            self._to_start[w.id] = None
        elif target is State.PREEMPTING:
            self._to_stop[w.id] = "preempt"
        elif target is State.STOPPING:
            self._to_stop[w.id] = "cancel"
        elif target is State.FAILED and (
            w.failures <= w.spec.max_retries or w.failure_cause in NOT_ITS_FAULT
        ):
            delay = min(
                self.retry_max_s, self.retry_base_s * self.retry_factor ** max(0, w.failures - 1)
            )
            delay *= 0.5 + _jitter(f"{w.id}:{w.attempt}")  # jitter in [0.5x, 1.5x)
            self._seq += 1
            heapq.heappush(self._retries, (tr.time + delay, self._seq, w.id))
        if tr.source is None or target in (State.PENDING, State.PREEMPTED) or (
            tr.source in HOLDING and target not in HOLDING
        ):
            self.dirty = True  # new work, or capacity came back: worth a cycle

    def resume(self) -> None:
        """Re-derive what is owed to the backend after a restart from the store.

        Admitted workloads still need their start, preempting and stopping ones
        their stop; failed ones with retries left get their retry scheduled
        again (from now: the backoff already waited before the crash is not
        known). Starting and running ones are the runtime's business: it asks
        the backend what really runs."""
        now = self.cp.now()
        for w in self.cp.workloads.values():
            st = w.state
            if st is State.ADMITTED:
                self._to_start[w.id] = None
            elif st is State.PREEMPTING:
                self._to_stop[w.id] = "preempt"
            elif st is State.STOPPING:
                self._to_stop[w.id] = "cancel"
            elif st is State.FAILED and (
                w.failures <= w.spec.max_retries or w.failure_cause in NOT_ITS_FAULT
            ):
                self._seq += 1
                heapq.heappush(self._retries, (now, self._seq, w.id))
        self.dirty = True

    # ------------------------------------------------------------------ events
    def handle(self, events: Sequence[Event]) -> None:
        cp = self.cp
        for ev in events:
            fact = ev.fact
            cause = ev.correlation_id or ev.event_id
            if isinstance(fact, NodeDown):
                if fact.node not in cp.capacity:
                    continue
                actions: list[Action] = [SetNodeStatus(fact.node, NodeStatus.DOWN, fact.reason)]
                for h in cp.holders(fact.node):
                    actions.append(Exited(h.id, h.attempt, -1, "node-lost"))
                result = cp.apply(actions, cause_id=cause, event_id=ev.event_id)
                self.dirty = True
            elif isinstance(fact, NodeUp):
                if fact.node not in cp.capacity:
                    continue
                result = cp.apply(
                    [SetNodeStatus(fact.node, NodeStatus.READY, "node back")],
                    cause_id=cause, event_id=ev.event_id,
                )
                self.dirty = True
            else:
                result = cp.apply([fact], cause_id=cause, event_id=ev.event_id)
            if not result.accepted:
                self.rejected.append(result)

    # -------------------------------------------------------------------- step
    def next_wakeup(self) -> float | None:
        """When the reconciler next has something to do by itself (a retry)."""
        return self._retries[0][0] if self._retries else None

    def step(self, cause_id: str | None = None) -> list[Command]:
        cp = self.cp
        now = cp.now()
        retries: list[Action] = []
        while self._retries and self._retries[0][0] <= now:
            _, _, wid = heapq.heappop(self._retries)
            w = cp.workloads.get(wid)
            if w is not None and w.state is State.FAILED:
                retries.append(Retry(wid))
        if retries:
            self._apply_each(retries, cause_id)
        prep = self.scheduler.prepare(cp)
        if prep:
            self._apply_each(prep, cause_id)
            self.dirty = True
        if self.dirty:
            self.dirty = False
            self.cycles += 1
            result = self.scheduler.run_cycle(cp, cause_id)
            if not result.accepted:
                self.rejected.append(result)
                self.dirty = True
        return self._commands(cause_id)

    def _apply_each(self, actions: list[Action], cause_id: str | None) -> None:
        result = self.cp.apply(actions, cause_id=cause_id)
        if not result.accepted:  # apply what is still valid, one by one
            for a in actions:
                r = self.cp.apply([a], cause_id=cause_id)
                if not r.accepted:
                    self.rejected.append(r)

    def _commands(self, cause_id: str | None) -> list[Command]:
        cp = self.cp
        out: list[Command] = []
        if self._to_start:
            starts = []
            for wid in self._to_start:
                w = cp.workloads[wid]
                if w.state is State.ADMITTED:
                    starts.append(w)
            self._to_start.clear()
            if starts:
                self._apply_each([Start(w.id, w.attempt) for w in starts], cause_id)
                for w in starts:
                    if w.state is State.STARTING:
                        out.append(start_command(w))
        if self._to_stop:
            for wid, reason in self._to_stop.items():
                w = cp.workloads[wid]
                if w.state in (State.PREEMPTING, State.STOPPING):
                    out.append(
                        StopCommand(
                            request_id=f"stop:{w.id}:{w.attempt}:{reason}",
                            workload=w.id,
                            attempt=w.attempt,
                            grace_s=self.grace_s,
                            reason=reason,
                            correlation_id=correlation_of(w),
                        )
                    )
            self._to_stop.clear()
        return out
