"""What a workflow is, as values: the outcomes a step returns (:class:`Next`, :class:`Wait`,
:class:`Goto`, :class:`Fail`, :class:`Finish`), :class:`Step` and
:class:`WorkflowDefinition`, the persisted :class:`Workflow`, :class:`Alert` and
:class:`DeadLetterRecord`, how steps propose (:class:`Proposer` and its
implementations) and what a step sees (:class:`StepContext`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from pydantic import BaseModel, Field

from mlwe.core.actions import Action, Place, Preempt
from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.controlplane import ApplyResult, ControlPlane
from mlwe.core.model import Workload

if TYPE_CHECKING:
    from mlwe.agent.workflows.runner import WorkflowRunner

log = logging.getLogger("mlwe.workflows")

#: Entries kept in a workflow's log (older ones are dropped; the audit log keeps all).
MAX_LOG = 200


# =================================================================== errors
class WorkflowError(ValueError):
    """A request the engine refuses (unknown kind, bad parameters, unknown workload...).

    Raised before anything is stored: a refused request changes nothing."""


class WorkflowStatus:
    RUNNING = "running"
    COMPENSATING = "compensating"  # a step failed: undoing what the completed steps did
    DONE = "done"
    FAILED = "failed"  # failed (nothing to undo, or an undo failed too) or gave up
    COMPENSATED = "compensated"  # failed, and every compensation succeeded

    ALL = (RUNNING, COMPENSATING, DONE, FAILED, COMPENSATED)
    ACTIVE = (RUNNING, COMPENSATING)


# ================================================================= outcomes
@dataclass(frozen=True, slots=True)
class Next:
    """The step is done: go on to the next one."""

    note: str = ""


@dataclass(frozen=True, slots=True)
class Wait:
    """Not yet: run the step again on a later tick (not before ``until``, if given)."""

    reason: str
    until: float | None = None


@dataclass(frozen=True, slots=True)
class Goto:
    """Jump to the named step (loops, going back after a lost effect, escalation)."""

    step: str
    note: str = ""


@dataclass(frozen=True, slots=True)
class Fail:
    """The step failed: the compensations of the completed steps run."""

    reason: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The workflow is over (``ok``: done; else failed without anything to undo)."""

    ok: bool
    summary: str


Outcome = Next | Wait | Goto | Fail | Finish


# ============================================================== definitions
@dataclass(frozen=True, slots=True)
class Step:
    name: str
    run: Callable[[StepContext], Outcome]
    doc: str
    #: name of the parameter that holds this step's timeout in seconds (from when it began)
    timeout: str | None = None
    #: where a timeout leads: None fails the workflow, a step name jumps there
    on_timeout: str | None = None
    #: undoes what this step did, when a later step fails
    compensate: Callable[[StepContext], Outcome] | None = None
    compensate_doc: str = ""


@dataclass(frozen=True, slots=True)
class WorkflowDefinition:
    kind: str
    doc: str
    params: type[BaseModel]
    steps: tuple[Step, ...]
    #: the workloads a workflow is about: one active workflow of a kind per subject
    subjects: Callable[[Any], tuple[str, ...]]
    #: reasons the current state refuses a new workflow (checked at start)
    check: Callable[[ControlPlane, Any], list[str]]
    compensation_timeout: str | None = None

    def __post_init__(self) -> None:
        names = [s.name for s in self.steps]
        if len(set(names)) != len(names):
            raise ValueError(f"workflow {self.kind}: duplicate step names")
        for s in self.steps:
            if s.on_timeout is not None and s.on_timeout not in names:
                raise ValueError(f"workflow {self.kind}: step {s.name} times out to unknown step")

    def index(self, name: str) -> int:
        for i, s in enumerate(self.steps):
            if s.name == name:
                return i
        raise KeyError(f"workflow {self.kind} has no step {name!r}")

    def step(self, name: str) -> Step:
        return self.steps[self.index(name)]

    def describe(self) -> dict[str, Any]:
        """The definition as data (for the CLI, the API and the dashboard)."""
        schema = self.params.model_json_schema()
        return {
            "kind": self.kind,
            "doc": self.doc,
            "steps": [
                {
                    "name": s.name,
                    "doc": s.doc,
                    "timeout": s.timeout,
                    "on_timeout": s.on_timeout or ("fail" if s.timeout else None),
                    "compensation": s.compensate_doc or None,
                }
                for s in self.steps
            ],
            "params": schema.get("properties", {}),
            "required": schema.get("required", []),
        }


# ================================================================= records
@dataclass(slots=True)
class Workflow:
    """One workflow instance, as stored (``data`` is its JSON document)."""

    id: str
    kind: str
    correlation_id: str
    status: str
    step: int  # index into the steps (forward phase) or the compensation list
    data: dict[str, Any]
    created: float
    updated: float

    @property
    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = self.data["params"]
        return p

    @property
    def state(self) -> dict[str, Any]:
        s: dict[str, Any] = self.data["state"]
        return s

    @property
    def log(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self.data["log"]
        return entries

    @property
    def phase(self) -> str:
        return str(self.data.get("phase", "forward"))

    @property
    def active(self) -> bool:
        return self.status in WorkflowStatus.ACTIVE

    @property
    def step_name(self) -> str | None:
        """The step it is at (or was at when it ended)."""
        name = self.data.get("step_name")
        return name if isinstance(name, str) else None

    def events(self, event: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.log if event is None or e["event"] == event]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "correlation_id": self.correlation_id,
            "status": self.status,
            "step": self.step,
            "step_name": self.step_name,
            "phase": self.phase,
            "created": self.created,
            "updated": self.updated,
            "params": self.params,
            "state": self.state,
            "error": self.data.get("error"),
            "summary": self.data.get("summary"),
            "log": self.log,
        }


@dataclass(frozen=True, slots=True)
class Alert:
    time: float
    workflow_id: str
    kind: str
    subject: str
    severity: str  # "warning" | "critical"
    message: str
    correlation_id: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "workflow_id": self.workflow_id,
            "kind": self.kind,
            "subject": self.subject,
            "severity": self.severity,
            "message": self.message,
            "correlation_id": self.correlation_id,
        }


@dataclass(frozen=True, slots=True)
class DeadLetterRecord:
    """A workflow that gave up, as a row of the bus's ``dead_letters`` table."""

    event_id: str
    time: float
    subject: str
    payload: dict[str, Any]
    error: str
    attempts: int
    correlation_id: str

    def envelope_json(self) -> str:
        # the bus's envelope wire form, so `mlwe` dead-letter tools list and replay it
        return json.dumps(
            {
                "id": self.event_id,
                "subject": self.subject,
                "payload": self.payload,
                "correlation_id": self.correlation_id,
                "published_at": self.time,
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
        )


# ================================================================ proposing
class Proposer(Protocol):
    """How steps propose: the runtime's audited ``propose``, or a bare control plane."""

    def __call__(
        self, actions: Sequence[Action], *, correlation_id: str, rationale: str
    ) -> ApplyResult: ...


class ControlPlaneProposer:
    """Proposals straight to a control plane (tests, simulations), caused by the workflow."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp

    def __call__(
        self, actions: Sequence[Action], *, correlation_id: str, rationale: str
    ) -> ApplyResult:
        return self.cp.apply(list(actions), cause_id=correlation_id)


class AuditingProposer:
    """Proposals to a control plane, each noted as an audit record by ``note_audit``.

    For the runtime's tick hooks: ``note_audit`` is the store writer's, so the
    record is written in the same transaction as the effect, by the flush that
    follows the hooks (calling a proposal method that flushes by itself from
    inside the loop is not needed)."""

    def __init__(
        self,
        cp: ControlPlane,
        note_audit: Callable[..., None],
        actor: str = "workflow",
    ) -> None:
        self.cp = cp
        self.note_audit = note_audit
        self.actor = actor

    def __call__(
        self, actions: Sequence[Action], *, correlation_id: str, rationale: str
    ) -> ApplyResult:
        result = self.cp.apply(list(actions), cause_id=correlation_id)
        subjects = sorted({str(getattr(a, "workload", getattr(a, "victim", ""))) for a in actions})
        self.note_audit(
            "proposal",
            self.actor,
            {
                "actions": [describe_action(a) for a in actions],
                "accepted": result.accepted,
                "reasons": result.reasons(),
                "rationale": rationale,
            },
            workload=subjects[0] if len(subjects) == 1 and subjects[0] else None,
            correlation_id=correlation_id,
        )
        return result


def describe_action(a: Action) -> dict[str, Any]:
    """A short JSON description of an action for logs and audit records."""
    out: dict[str, Any] = {"kind": a.kind}
    if isinstance(a, Place):
        out["workload"] = a.workload
        out["nodes"] = [r.node for r in a.replicas]
    elif isinstance(a, Preempt):
        out.update(victim=a.victim, preemptor=a.preemptor, reason=a.reason.value)
    else:
        for name in ("workload", "reason"):
            v = getattr(a, name, None)
            if isinstance(v, str):
                out[name] = v
    return out


# ================================================================== context
class StepContext:
    """What a step sees: the control plane (read only), its parameters and state,
    and the means to act (``propose``), to place (``placement_for``) and to speak
    (``note``, ``alert``, ``dead_letter``)."""

    def __init__(self, engine: WorkflowRunner, wf: Workflow, params: Any) -> None:
        self.engine = engine
        self.wf = wf
        self.params = params
        self.state = wf.state

    @property
    def cp(self) -> ControlPlane:
        return self.engine.cp

    def now(self) -> float:
        return self.engine.cp.now()

    def workload(self, wid: str) -> Workload | None:
        return self.engine.cp.workloads.get(wid)

    def note(self, event: str, **detail: Any) -> None:
        self.engine._log(self.wf, event, detail)

    def propose(self, actions: Sequence[Action], rationale: str) -> ApplyResult:
        """Propose ``actions`` (verified by the control plane); logged either way."""
        eng = self.engine
        try:
            result = eng.proposer(
                actions, correlation_id=self.wf.correlation_id, rationale=rationale
            )
        except Exception as exc:  # a proposer that breaks is a rejection, not a crash
            log.exception("workflow %s: proposal failed", self.wf.id)
            result = ApplyResult(False, eng.cp.version)
            reasons = [f"proposal failed: {type(exc).__name__}: {exc}"]
        else:
            reasons = result.reasons()
        self.state["proposals"] = int(self.state.get("proposals", 0)) + 1
        self.note(
            "proposed" if result.accepted else "rejected",
            actions=[describe_action(a) for a in actions],
            rationale=rationale,
            **({"reasons": reasons} if reasons else {}),
        )
        if not result.accepted and not result.rejections and reasons:
            # keep the reasons reachable for the step that asked
            self.state["last_rejection"] = reasons
        return result

    def placement_for(
        self, w: Workload, exclude: Iterable[str] = ()
    ) -> tuple[ReplicaAlloc, ...] | None:
        """Where ``w`` fits now (the scheduler's placement policy), avoiding ``exclude``."""
        sched = self.engine.scheduler
        models, shape = sched.shape_for(self.cp, w)
        if w.spec.resources.gpu and not models:
            return None
        fork = self.cp.capacity.fork()
        return sched.placement.place(fork, shape, w.spec.replicas, frozenset(exclude))

    def had_effect(self) -> None:
        """The current step failed but changed something: its compensation must run.

        (A step that fails normally did nothing, so only completed steps are undone.)"""
        name = self.wf.data.get("step_name")
        completed: list[str] = self.wf.data["completed"]
        if self.wf.phase == "forward" and isinstance(name, str) and name not in completed:
            completed.append(name)

    def alert(self, severity: str, subject: str, message: str) -> Alert:
        return self.engine._alert(self.wf, severity, subject, message)

    def dead_letter(self, subject: str, payload: dict[str, Any], error: str, attempts: int) -> None:
        self.engine._dead_letter(self.wf, subject, payload, error, attempts)


# =================================================================== engine
Change = Callable[[Workflow, dict[str, Any]], None]


# =============================================================== parameters
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Id = Annotated[str, Field(min_length=1, max_length=128)]


# =============================================================== reschedule
def _nodes(w: Workload) -> list[str]:
    return list(dict.fromkeys(a.node for a in w.placement))


def _describe_end(w: Workload) -> str:
    text = w.state.value
    if w.failure_cause:
        text += f" ({w.failure_cause}"
        text += f", exit {w.exit_code})" if w.exit_code is not None else ")"
    return text
