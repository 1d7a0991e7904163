"""The engine's step, as pure logic: facts in, scheduling cycle, commands out.

The :class:`Reconciler` is what makes "same control plane, any backend" true.
A driver (the simulator, the runtime) feeds it backend events and asks it for
commands; it never touches a backend itself:

1. ``handle(events)``: each event's fact is applied with its event id (so a
   redelivered event has no second effect); a lost node becomes a status
   change plus a node-lost exit for everything on it.
2. ``step()``: what was applied since the last step (by anyone: events,
   requests, the agent) is read as a value, ``cp.take_effects()``, and
   :func:`owed_by` says what it owes: a start for each ADMITTED, a graceful
   stop for each PREEMPTING (the preemptor is placed only after the backend's
   release), a stop for each STOPPING, a retry after a backoff for each
   FAILED that has retries left, and whether a cycle is worth running. Then
   retries whose backoff has elapsed are re-queued, a scheduling cycle runs if
   anything changed, the owed workloads are started (``Start``), and the owed
   starts and stops become commands (:func:`commands_for`).

Why the step applies transitions itself: ``Retry``, the scheduler's preparation
and plan (its placements and preemptions, with their decision records) and
``Start`` are not requests that anyone makes; they are the state machine's own
transitions, owed by the state and the clock alone (a failed attempt whose
backoff elapsed goes back to the queue, queued work that fits is placed, an
admitted workload starts). The reconciler is what takes them, the way Dask's
``WorkerState`` handles a stimulus by transitioning its own tasks and returning
the instructions its ``Worker`` is to carry out. It applies them through
``cp.apply`` like any other action: verified against the control plane's
invariants, recorded as transitions and decisions, and, in the runtime, made
durable by the flush that comes before the commands are sent. The commands the
step returns are those instructions, for the backend (start this attempt there,
stop that one with this grace); the driver sends them, the reconciler never
calls a backend.

Each of the step's phases takes the effects of what it applied before the next
one reads the state, so the order is the one written in :meth:`Reconciler.step`.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mlwe.core.actions import Action, Exited, Retry, SetNodeStatus, Start
from mlwe.core.backend import Command, Event, NodeDown, NodeUp, StartCommand, StopCommand
from mlwe.core.controlplane import NOT_ITS_FAULT, ApplyResult, Changed, ControlPlane
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


@dataclass(slots=True)
class Owed:
    """What a run of effects owes the backend (see :func:`owed_by`)."""

    #: workloads that were admitted: each gets a ``Start`` and then a start command
    starts: dict[str, None] = field(default_factory=dict)
    #: workloads to stop, with why ("preempt" or "cancel"; a later reason wins)
    stops: dict[str, str] = field(default_factory=dict)
    #: failed attempts to retry: (failed at, workload, attempt, failures so far)
    retries: list[tuple[float, str, int, int]] = field(default_factory=list)
    #: new work, or capacity came back: worth a scheduling cycle
    cycle: bool = False


def cycle_trigger(tr: Transition) -> str | None:
    """Why transition ``tr`` makes a scheduling cycle worth running: new work
    ("arrival"), work back in the queue ("requeue") or resources given back
    ("release"); None: it changes nothing a cycle could use."""
    if tr.source is None:
        return "arrival"
    if tr.target in (State.PENDING, State.PREEMPTED):
        return "requeue"
    if tr.source in HOLDING and tr.target not in HOLDING:
        return "release"
    return None


def owed_by(effects: Iterable[Changed], owed: Owed | None = None) -> Owed:
    """What ``effects`` (transitions, in the order applied) owe, added to ``owed``."""
    out = owed if owed is not None else Owed()
    for w, tr, attempt, failures, cause in effects:
        target = tr.target
        if target is State.ADMITTED:
            out.starts[w.id] = None
        elif target is State.PREEMPTING:
            out.stops[w.id] = "preempt"
        elif target is State.STOPPING:
            out.stops[w.id] = "cancel"
        elif target is State.FAILED and (failures <= w.spec.max_retries or cause in NOT_ITS_FAULT):
            out.retries.append((tr.time, w.id, attempt, failures))
        if cycle_trigger(tr) is not None:
            out.cycle = True
    return out


def stop_command(w: Workload, reason: str, grace_s: float) -> StopCommand:
    """The command that stops ``w``'s current attempt (idempotent by its request id)."""
    return StopCommand(
        request_id=f"stop:{w.id}:{w.attempt}:{reason}",
        workload=w.id,
        attempt=w.attempt,
        grace_s=grace_s,
        reason=reason,
        correlation_id=correlation_of(w),
    )


def commands_for(
    workloads: Mapping[str, Workload],
    started: Iterable[str],
    stops: Mapping[str, str],
    grace_s: float,
) -> list[Command]:
    """The commands for workloads whose ``Start`` was applied and for owed stops, as
    the state now has them: a start for each of ``started`` that is STARTING, then
    a stop for each of ``stops`` still PREEMPTING or STOPPING (whatever came
    between, a release or a cancel, made the others moot)."""
    out: list[Command] = []
    for wid in started:
        w = workloads[wid]
        if w.state is State.STARTING:
            out.append(start_command(w))
    for wid, reason in stops.items():
        w = workloads[wid]
        if w.state in (State.PREEMPTING, State.STOPPING):
            out.append(stop_command(w, reason, grace_s))
    return out


class Reconciler:
    """The driver of the control plane's own transitions: facts in (:meth:`handle`),
    the transitions they owe applied and commands for the backend out
    (:meth:`step`); see the module docstring."""

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
        #: owed across steps only by :meth:`resume` (a restart); a step owes what it reads
        self._owed = Owed()
        self._retries: list[tuple[float, int, str]] = []  # (due, sequence, workload)
        self._seq = 0
        self.rejected: list[ApplyResult] = []
        cp.keep_effects()

    # ----------------------------------------------------------------- effects
    def _absorb(self, owed: Owed) -> Owed:
        """Read what was applied since the last read (``cp.take_effects()``) into
        ``owed``; schedule its retries and note whether a cycle is worth running."""
        n = len(owed.retries)
        owed_by(self.cp.take_effects(), owed)
        for failed_at, wid, attempt, failures in owed.retries[n:]:
            delay = min(
                self.retry_max_s, self.retry_base_s * self.retry_factor ** max(0, failures - 1)
            )
            delay *= 0.5 + _jitter(f"{wid}:{attempt}")  # jitter in [0.5x, 1.5x)
            self._seq += 1
            heapq.heappush(self._retries, (failed_at + delay, self._seq, wid))
        if owed.cycle:
            owed.cycle = False
            self.dirty = True
        return owed

    def wants_step(self) -> bool:
        """Whether a step now would run a cycle (set by a request, or owed by what
        was applied since the last step); what else is owed waits for the next one."""
        return self.dirty or owed_by(self.cp.pending_effects()).cycle

    def resume(self) -> None:
        """Re-derive what is owed to the backend after a restart from the store.

        Admitted workloads still need their start, preempting and stopping ones
        their stop; failed ones with retries left get their retry scheduled
        again (from now: the backoff already waited before the crash is not
        known). Starting and running ones are the runtime's business: it asks
        the backend what really runs."""
        owed = self._absorb(self._owed)  # what the restart's own repairs applied first
        now = self.cp.now()
        for w in self.cp.workloads.values():
            st = w.state
            if st is State.ADMITTED:
                owed.starts[w.id] = None
            elif st is State.PREEMPTING:
                owed.stops[w.id] = "preempt"
            elif st is State.STOPPING:
                owed.stops[w.id] = "cancel"
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
        """When the reconciler next has something to do by itself (a retry), counting
        the retries owed by what was applied since the last step (kept for it)."""
        self._absorb(self._owed)
        return self._retries[0][0] if self._retries else None

    def due_retries(self, now: float) -> list[Action]:
        """The retries whose backoff has elapsed by ``now`` (taken off the timer)."""
        cp = self.cp
        retries: list[Action] = []
        while self._retries and self._retries[0][0] <= now:
            _, _, wid = heapq.heappop(self._retries)
            w = cp.workloads.get(wid)
            if w is not None and w.state is State.FAILED:
                retries.append(Retry(wid))
        return retries

    def step(self, cause_id: str | None = None) -> list[Command]:
        """Effects in, commands out (see the module docstring): the state machine's
        own transitions applied (due retries, the scheduler's preparation, a cycle,
        the owed starts), then the instructions for the backend returned; each
        phase reads the effects of the one before it."""
        cp = self.cp
        owed, self._owed = self._absorb(self._owed), Owed()  # since the last step
        retries = self.due_retries(cp.now())
        if retries:
            self._apply_each(retries, cause_id)
            self._absorb(owed)
        prep = self.scheduler.prepare(cp)
        if prep:
            self._apply_each(prep, cause_id)
            self.dirty = True
            self._absorb(owed)
        if self.dirty:
            self.dirty = False
            self.cycles += 1
            result = self.scheduler.run_cycle(cp, cause_id)
            if not result.accepted:
                self.rejected.append(result)
                self.dirty = True
            self._absorb(owed)
        started: list[str] = []
        if owed.starts:
            wl = cp.workloads
            starts = [wl[wid] for wid in owed.starts if wl[wid].state is State.ADMITTED]
            if starts:
                self._apply_each([Start(w.id, w.attempt) for w in starts], cause_id)
                started = [w.id for w in starts]
                # ADMITTED -> STARTING owes nothing; anything else is the next step's
                self._absorb(self._owed)
        return commands_for(cp.workloads, started, owed.stops, self.grace_s)

    def _apply_each(self, actions: list[Action], cause_id: str | None) -> None:
        result = self.cp.apply(actions, cause_id=cause_id)
        if not result.accepted:  # apply what is still valid, one by one
            for a in actions:
                r = self.cp.apply([a], cause_id=cause_id)
                if not r.accepted:
                    self.rejected.append(r)
