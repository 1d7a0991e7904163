"""Handlers of the actions on workloads: submit, place, preempt, start, cancel,
retry, evict, priority and resource changes."""

from __future__ import annotations

from mlwe.core.actions import (
    Cancel,
    Evict,
    Place,
    Preempt,
    PreemptReason,
    Retry,
    SetPriority,
    SetResources,
    Start,
    Submit,
)
from mlwe.core.capacity import FULL, ReplicaAlloc
from mlwe.core.controlplane.state import (
    PlaneState,
    _add,
    _bump,
    _trail,
    _Txn,
    could_hold,
)
from mlwe.core.lifecycle import QUEUED, State, Transition
from mlwe.core.model import Workload
from mlwe.core.rules import (
    frees_what_is_needed,
    gain_violations,
    placement_violations,
    preemptible,
    quota_verdict,
    reclaim_violations,
)
from mlwe.core.spec import NodeStatus, ReplicaResources, WorkloadSpec


class WorkloadHandlers(PlaneState):
    """Handlers of the actions on workloads: submit, place, preempt, start, cancel,"""

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
        problems = self._capacity_problems(replicas)
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

    def _capacity_problems(self, replicas: tuple[ReplicaAlloc, ...]) -> list[str]:
        """Why ``replicas`` do not fit the live index's free capacity (empty: they do).
        Several are checked replica by replica, each probe allocated before the next
        is checked (two replicas can never share the same space) and all given back
        (``_hold`` takes them with its bookkeeping); one is checked as it is."""
        if len(replicas) == 1:
            return [f"replica 0: {p}" for p in self.capacity.check(replicas[0])]
        probed: list[ReplicaAlloc] = []
        problems: list[str] = []
        for k, r in enumerate(replicas):
            problems = [f"replica {k}: {p}" for p in self.capacity.check(r)]
            if problems:
                break
            self.capacity.allocate(r)
            probed.append(r)
        for r in reversed(probed):
            self.capacity.release(r)
        return problems

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
