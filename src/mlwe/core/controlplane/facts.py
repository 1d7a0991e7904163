"""Handlers of what backends report (facts): started, progress, released, exited,
and the work lost with an attempt."""

from __future__ import annotations

import math

from mlwe.core.actions import (
    Exited,
    Progress,
    Released,
    Started,
)
from mlwe.core.controlplane.state import (
    NOT_ITS_FAULT,
    PlaneState,
    _trail,
    _Txn,
)
from mlwe.core.lifecycle import HOLDING, State
from mlwe.core.model import Workload


class FactHandlers(PlaneState):
    """Handlers of what backends report (facts): started, progress, released, exited,"""

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
