"""Restart repair: make the recovered state and what the backend runs agree.

After a restart the control plane comes back from the store, and the backend
may have moved on meanwhile. :func:`repair` compares the two and says, as
values, what to do about each difference:

- an attempt the backend still runs is **adopted** (a start that was in
  flight is confirmed with ``Started``);
- an attempt the backend no longer has **vanished**: a workload that was
  being stopped is ``Released`` (its stop is what we waited for); any other is
  ``Exited`` with reason "vanished", which is not the workload's fault;
- a start that was owed (``STARTING`` with nothing running) is **restarted**:
  its start command is sent again (idempotent by request id);
- an attempt the backend runs that the state does not hold (or an older
  attempt of one it does) is an **orphan**: stopped at once.

:func:`repair` reads only; the engine applies the facts, audits the report
and sends the commands (:meth:`mlwe.runtime.engine.Engine.reconcile_backend`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mlwe.core.actions import Action, Exited, Released, Started
from mlwe.core.backend import Command, RunningAttempt, StopCommand
from mlwe.core.lifecycle import HOLDING, State
from mlwe.core.model import Workload
from mlwe.core.reconcile import start_command


@dataclass
class RestartReport:
    """What reconciling with the backend found after a restart."""

    adopted: list[str] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, list[str]]:
        return {
            "adopted": self.adopted,
            "vanished": self.vanished,
            "orphans": self.orphans,
            "restarted": self.restarted,
        }


@dataclass
class Repair:
    """What :func:`repair` found and what to do: facts to apply (one by one, in this
    order), then commands to send (stops of orphans first, then starts owed)."""

    report: RestartReport
    facts: list[Action]
    commands: list[Command]


def orphan_stop(workload: str, attempt: int) -> StopCommand:
    return StopCommand(
        request_id=f"orphan:{workload}:{attempt}",
        workload=workload,
        attempt=attempt,
        grace_s=0.0,
        reason="orphan",
    )


def repair(workloads: Iterable[Workload], inventory: Iterable[RunningAttempt]) -> Repair:
    """Compare the recovered ``workloads`` with the backend's ``inventory`` (module docstring)."""
    rep = RestartReport()
    running: dict[str, RunningAttempt] = {r.workload: r for r in inventory}
    facts: list[Action] = []
    resend: list[Command] = []
    stops: list[Command] = []
    for w in list(workloads):
        if w.state not in HOLDING or w.state is State.ADMITTED:
            continue
        r = running.pop(w.id, None)
        if r is not None and r.attempt == w.attempt:
            rep.adopted.append(w.id)
            if w.state is State.STARTING:
                facts.append(Started(w.id, w.attempt))
            continue
        if r is not None:  # an older attempt still runs: stop it
            rep.orphans.append(f"{r.workload}#{r.attempt}")
            stops.append(orphan_stop(r.workload, r.attempt))
        if w.state is State.STARTING:  # the start may never have reached it: send again
            rep.restarted.append(w.id)
            resend.append(start_command(w))
        elif w.state in (State.PREEMPTING, State.STOPPING):
            # it was being stopped and is gone: the release is what we waited for
            rep.vanished.append(w.id)
            facts.append(Released(w.id, w.attempt))
        else:
            rep.vanished.append(w.id)
            facts.append(Exited(w.id, w.attempt, -1, "vanished"))
    for r in running.values():
        rep.orphans.append(f"{r.workload}#{r.attempt}")
        stops.append(orphan_stop(r.workload, r.attempt))
    return Repair(rep, facts, [*stops, *resend])
