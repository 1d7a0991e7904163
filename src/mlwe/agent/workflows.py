"""Multi-step workflows: declarative, persisted, resumable step sequences.

The original system ran its multi-step operations as Cloud Workflows; here a
:class:`WorkflowDefinition` is the same idea as data: an ordered list of named
:class:`Step` values, each with an optional timeout and an optional
compensation (saga style), and a pydantic model for its parameters. Two
definitions ship:

``reschedule``
    ask the victim to checkpoint (``Preempt``) -> wait for the grace period
    -> confirm the backend released it -> place the preemptor -> see it start
    -> confirm it runs. If a later step fails (the preemptor cannot be placed
    or cannot start, or it is cancelled), the compensation of the first step
    resumes the victim: it is placed again, on its old nodes when they are
    free, and continues from its checkpoint.
``recover``
    failure recovery: retry with exponential backoff -> watch the new attempt
    -> move the workload off the nodes it failed on -> give up: a dead letter
    (the bus's ``dead_letters`` table, as a replayable envelope) and an alert.

A :class:`WorkflowEngine` runs them. It has no thread of its own: the runtime
(or a test driving a bare control plane, simulated backend and reconciler)
calls :meth:`WorkflowEngine.tick` once per loop, and each running workflow
advances as far as it can without waiting. Steps act only through proposals
(the control plane verifies them; a rejection is a value the step reacts to)
and observe the state the backend's events produced. Every proposal carries
the workflow's correlation id as its cause, so decisions and transitions name
the workflow that caused them.

Persistence (table ``workflows``): the status, the current step and a JSON
document (parameters, step state, a bounded log) are written after each tick
(:meth:`WorkflowEngine.flush`), after the control plane's own changes are
durable (pass ``writer=`` or call ``flush`` after the store flush), so a stored
workflow is never ahead of the cluster state. Steps are written as "ensure"
operations (look first, act only if the effect is missing, go back a step if
an earlier effect was lost), so a crash anywhere resumes at the right step:
:meth:`WorkflowEngine.load` rebuilds the engine from the store.

Wiring into the runtime (``mlwe.runtime.Engine``) is :func:`attach_workflows`
(``mlwe.agent.loop.attach``, which ``mlwe serve`` uses, calls it): it loads the
workflows from the engine's store, so one in flight when the engine stopped
resumes, and ticks them in the engine's tick hooks (call ``start``/``cancel``
under ``engine.lock``; the hook already runs under it). By hand it amounts to::

    workflows = WorkflowEngine.load(
        engine.cp, engine.repo, scheduler=engine.scheduler, audit=engine.audit,
        proposer=EngineProposer(engine), autoflush=False)
    engine.tick_hooks.append(workflows.tick_hook())  # stores the last tick, then ticks

The agent starts ``reschedule`` for its preemption plans and ``recover`` for
repeated failures, after committing the plan's first actions itself (the
first step then finds the preemption under way and adopts it).

In the runtime the scheduling cycle runs before the hooks, so the scheduler
may place a released preemptor or a retried workload before a step does;
the steps take that as done. The reconciler also retries failed workloads by
itself (and at once after a restart); the recovery workflow counts such a
retry as its own and adds what the runtime does not: moving off the failing
nodes, and giving up with a dead letter and an alert.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from sqlalchemy import Connection, insert, select, update

from mlwe.core.actions import Action, Evict, Place, Preempt, PreemptReason, Retry
from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.controlplane import ApplyResult, ControlPlane
from mlwe.core.lifecycle import HOLDING, QUEUED, TERMINAL, State, Transition
from mlwe.core.model import Workload
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import NodeStatus
from mlwe.store import schema as S
from mlwe.store.audit import AuditLog
from mlwe.store.repository import (
    Repository,
    canonical_json,
    placement_from_json,
    placement_to_json,
)
from mlwe.store.sanitize import sanitize

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


class EngineProposer:
    """Proposals through a runtime engine's one request path (``engine.propose``): the
    same checks and the same audit record as the agent's and any other request's."""

    def __init__(self, engine: Any, actor: str = "workflow") -> None:
        self.engine = engine
        self.actor = actor

    def __call__(
        self, actions: Sequence[Action], *, correlation_id: str, rationale: str
    ) -> ApplyResult:
        result: ApplyResult = self.engine.propose(
            list(actions), actor=self.actor, correlation_id=correlation_id, rationale=rationale
        )
        return result


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

    def __init__(self, engine: WorkflowEngine, wf: Workflow, params: Any) -> None:
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


class WorkflowEngine:
    """Runs workflows tick by tick over one control plane (see the module docstring).

    ``proposer``: how steps propose (default: straight to ``cp``);
    ``scheduler``: whose placement policy places workloads (default: a new
    :class:`Scheduler`); ``repo``: where workflows are stored (None: memory
    only); ``writer``: a store writer flushed before workflows are written;
    ``audit``: the audit log each step event is appended to (in the same
    transaction as the workflow row).
    """

    def __init__(
        self,
        cp: ControlPlane,
        *,
        proposer: Proposer | None = None,
        scheduler: Scheduler | None = None,
        repo: Repository | None = None,
        writer: Any | None = None,
        audit: AuditLog | None = None,
        definitions: Iterable[WorkflowDefinition] | None = None,
        actor: str = "workflow",
        max_moves_per_tick: int = 32,
        autoflush: bool = True,
    ) -> None:
        self.cp = cp
        self.proposer: Proposer = proposer or ControlPlaneProposer(cp)
        self.scheduler = scheduler or Scheduler()
        self.repo = repo
        self.writer = writer
        self.audit = audit
        self.actor = actor
        self.max_moves_per_tick = max_moves_per_tick
        self.autoflush = autoflush
        self.definitions: dict[str, WorkflowDefinition] = {
            d.kind: d for d in (definitions if definitions is not None else DEFINITIONS)
        }
        self.active: dict[str, Workflow] = {}
        self.finished: deque[Workflow] = deque(maxlen=1000)
        #: called with (workflow, log entry) for every step event (streams, dashboards)
        self.listeners: list[Change] = []
        #: called with every alert (the runtime streams it; operators are paged from it)
        self.alert_listeners: list[Callable[[Alert], None]] = []
        self.alerts: deque[Alert] = deque(maxlen=1000)
        #: dead letters of workflows that gave up (kept here too when there is no store)
        self.dead_letters: deque[DeadLetterRecord] = deque(maxlen=1000)
        self.load_errors: list[str] = []
        self._detach: Callable[[], None] | None = None  # set by attach_workflows
        self._params: dict[str, Any] = {}
        self._wake: dict[str, float | None] = {}
        self._dirty: dict[str, None] = {}
        self._audit_out: list[tuple[Workflow, dict[str, Any]]] = []
        self._dead_out: list[DeadLetterRecord] = []
        #: (attempt, nodes) of each workload's latest placement: where a failed attempt ran
        self.last_nodes: dict[str, tuple[int, tuple[str, ...]]] = {}
        cp.listeners.append(self._on_transition)

    # ------------------------------------------------------------- wiring
    def _on_transition(self, w: Workload, tr: Transition) -> None:
        if tr.target is State.ADMITTED and w.placement:
            self.last_nodes[w.id] = (w.attempt, tuple(dict.fromkeys(a.node for a in w.placement)))

    def nodes_of_attempt(self, w: Workload, attempt: int) -> tuple[str, ...]:
        got = self.last_nodes.get(w.id)
        if got is not None and got[0] == attempt:
            return got[1]
        if w.attempt == attempt and w.placement:
            return tuple(dict.fromkeys(a.node for a in w.placement))
        return ()

    def tick_hook(self) -> Callable[[Any], None]:
        """A runtime tick hook: store the last tick's progress (now durable), then tick."""

        def hook(_engine: Any) -> None:
            self.flush()
            self.tick()

        return hook

    # ------------------------------------------------------------ starting
    def definition(self, kind: str) -> WorkflowDefinition:
        d = self.definitions.get(kind)
        if d is None:
            known = ", ".join(sorted(self.definitions))
            raise WorkflowError(f"unknown workflow kind {kind!r}; known: {known}")
        return d

    def start(
        self,
        kind: str,
        params: Mapping[str, Any],
        *,
        correlation_id: str | None = None,
        workflow_id: str | None = None,
    ) -> Workflow:
        """Start a workflow; durable on return (with a store).

        Starting one again for the same subjects while it runs returns the
        running one (the agent may ask twice); a different request for a
        subject that an active workflow of the same kind owns is refused.
        """
        d = self.definition(kind)
        if not isinstance(params, Mapping):
            raise WorkflowError(f"{kind}: parameters must be a mapping, got {type(params).__name__}")
        try:
            p = d.params.model_validate(dict(params))
        except ValidationError as exc:
            raise WorkflowError(f"{kind}: {_pydantic_problems(exc)}") from None
        if workflow_id is not None and (
            not isinstance(workflow_id, str) or not 0 < len(workflow_id) <= 128
        ):
            raise WorkflowError("workflow id must be a non-empty string of at most 128 characters")
        if correlation_id is not None and (
            not isinstance(correlation_id, str) or not 0 < len(correlation_id) <= 256
        ):
            raise WorkflowError("correlation id must be a non-empty string of at most 256 characters")
        problems = d.check(self.cp, p)
        if problems:
            raise WorkflowError(f"{kind}: " + "; ".join(problems))
        subjects = d.subjects(p)
        dumped = p.model_dump(mode="json")
        same = self._same_or_conflict(kind, subjects, dumped)
        if isinstance(same, Workflow):
            return same  # the same request again: idempotent
        if same:
            raise WorkflowError(same)
        wid = workflow_id or f"{kind}-{uuid.uuid4().hex[:12]}"
        if wid in self.active or self._stored(wid) is not None:
            raise WorkflowError(f"workflow id {wid!r} already exists")
        now = self.cp.now()
        wf = Workflow(
            id=wid,
            kind=kind,
            correlation_id=correlation_id or wid,
            status=WorkflowStatus.RUNNING,
            step=0,
            data={
                "params": dumped,
                "state": {},
                "subjects": list(subjects),
                "phase": "forward",
                "step_name": d.steps[0].name,
                "step_started": now,
                "completed": [],
                "log": [],
            },
            created=now,
            updated=now,
        )
        self.active[wid] = wf
        self._params[wid] = p
        self._wake[wid] = None
        self._log(wf, "started", {"kind": kind, "params": dumped})
        try:
            self.flush()
        except Exception:
            # not durable: forget it, so memory and store agree
            self.active.pop(wid, None)
            self._dirty.pop(wid, None)
            self._audit_out = [x for x in self._audit_out if x[0].id != wid]
            raise
        return wf

    def _same_or_conflict(
        self, kind: str, subjects: Sequence[str], dumped: Mapping[str, Any]
    ) -> Workflow | str | None:
        """The active workflow this request repeats, or why it conflicts, or None."""
        for other in self.active.values():
            shared = set(subjects) & set(other.data.get("subjects", ()))
            if other.kind != kind or not shared:
                continue
            if other.params == dumped:
                return other
            return (f"{kind}: workflow {other.id} is already {other.status} for"
                    f" {', '.join(sorted(shared))}")
        return None

    def conflicts(self, kind: str, params: Mapping[str, Any]) -> list[str]:
        """Why :meth:`start` would refuse this request right now, ignoring the state check.

        For a caller about to act before it starts the workflow (the agent
        commits a plan's first actions, then hands the rest to a workflow): a
        bad parameter, or another active workflow of the kind that owns one of
        its subjects. Repeating a running request is no conflict."""
        try:
            d = self.definition(kind)
            p = d.params.model_validate(dict(params))
        except WorkflowError as exc:
            return [str(exc)]
        except ValidationError as exc:
            return [f"{kind}: {_pydantic_problems(exc)}"]
        got = self._same_or_conflict(kind, d.subjects(p), p.model_dump(mode="json"))
        return [got] if isinstance(got, str) else []

    def cancel(self, workflow_id: str, reason: str = "cancelled by operator") -> Workflow:
        """Stop a running workflow; the compensations of its completed steps run."""
        wf = self.active.get(workflow_id)
        if wf is None:
            stored = self.get(workflow_id)
            if stored is None:
                raise WorkflowError(f"unknown workflow {workflow_id!r}")
            raise WorkflowError(f"workflow {workflow_id} is {stored.status}; only running ones are cancelled")
        if wf.status != WorkflowStatus.RUNNING:
            raise WorkflowError(f"workflow {workflow_id} is already {wf.status}")
        self._fail(wf, f"cancelled: {reason}")
        if self.autoflush:
            self.flush()
        return wf

    # ------------------------------------------------------------- reading
    def get(self, workflow_id: str) -> Workflow | None:
        wf = self.active.get(workflow_id)
        if wf is not None:
            return wf
        for f in self.finished:
            if f.id == workflow_id:
                return f
        return self._stored(workflow_id)

    def workflows(self, status: str | None = None) -> list[Workflow]:
        """Every workflow (stored ones included), oldest first."""
        seen: dict[str, Workflow] = {}
        if self.repo is not None:
            for wf in self._load_rows(None):
                seen[wf.id] = wf
        for wf in [*self.finished, *self.active.values()]:
            seen[wf.id] = wf
        out = [w for w in seen.values() if status is None or w.status == status]
        return sorted(out, key=lambda w: (w.created, w.id))

    def next_wakeup(self) -> float | None:
        """The earliest time a waiting workflow asked to be looked at again (timeouts too)."""
        times = [t for t in self._wake.values() if t is not None]
        return min(times) if times else None

    # ---------------------------------------------------------------- tick
    def tick(self) -> int:
        """Advance every active workflow as far as it goes now; returns steps moved."""
        moved = 0
        for wf in sorted(self.active.values(), key=lambda w: (w.created, w.id)):
            moved += self._advance(wf)
        for wid in [w for w, wf in self.active.items() if not wf.active]:
            self.finished.append(self.active.pop(wid))
            self._wake.pop(wid, None)
            self._params.pop(wid, None)
        if self.autoflush and self._dirty:
            self.flush()
        return moved

    def _current(self, wf: Workflow) -> tuple[Step, bool]:
        """The step to run and whether it is a compensation."""
        d = self.definitions[wf.kind]
        if wf.phase == "compensate":
            name = wf.data["compensations"][wf.step]
            return d.step(name), True
        return d.steps[wf.step], False

    def _advance(self, wf: Workflow) -> int:
        d = self.definitions[wf.kind]
        params = self._params.get(wf.id)
        if params is None:
            params = self._params[wf.id] = d.params.model_validate(wf.params)
        ctx = StepContext(self, wf, params)
        moved = 0
        while wf.active and moved < self.max_moves_per_tick:
            step, compensating = self._current(wf)
            timeout_name = d.compensation_timeout if compensating else step.timeout
            limit = float(getattr(params, timeout_name)) if timeout_name else None
            started = float(wf.data["step_started"])
            now = self.cp.now()
            outcome: Outcome
            if limit is not None and now - started > limit:
                reason = f"step {step.name} timed out after {limit:g}s"
                if compensating or step.on_timeout is None:
                    outcome = Fail(reason)
                else:
                    wf.state["timeout_reason"] = reason
                    outcome = Goto(step.on_timeout, reason)
            else:
                fn = step.compensate if compensating else step.run
                assert fn is not None
                try:
                    outcome = fn(ctx)
                except Exception as exc:  # a broken step fails its workflow, not the loop
                    log.exception("workflow %s step %s raised", wf.id, step.name)
                    outcome = Fail(f"step {step.name} raised {type(exc).__name__}: {exc}")
            if isinstance(outcome, Wait):
                if wf.data.get("waiting") != outcome.reason:
                    wf.data["waiting"] = outcome.reason
                    self._log(wf, "waiting", {"reason": outcome.reason})
                deadline = started + limit if limit is not None else None
                wake = [t for t in (outcome.until, deadline) if t is not None]
                # a timeout is noticed strictly after its deadline
                self._wake[wf.id] = min(wake) + (1e-6 if deadline in wake else 0) if wake else None
                break
            moved += 1
            self._wake[wf.id] = None
            wf.data.pop("waiting", None)
            if compensating:
                self._after_compensation(wf, step, outcome)
            else:
                self._after_step(wf, d, step, outcome)
        if wf.active and moved >= self.max_moves_per_tick:
            self._wake[wf.id] = self.cp.now()  # more to do now: come back at once
        return moved

    def _enter(self, wf: Workflow, index: int, name: str) -> None:
        wf.step = index
        wf.data["step_name"] = name
        wf.data["step_started"] = self.cp.now()
        self._touch(wf)

    def _after_step(self, wf: Workflow, d: WorkflowDefinition, step: Step, out: Outcome) -> None:
        if isinstance(out, Next):
            if step.name not in wf.data["completed"]:
                wf.data["completed"].append(step.name)
            self._log(wf, "step-done", {"note": out.note} if out.note else {})
            if wf.step + 1 >= len(d.steps):
                self._end(wf, WorkflowStatus.DONE, summary=out.note or "all steps done")
            else:
                nxt = d.steps[wf.step + 1]
                self._enter(wf, wf.step + 1, nxt.name)
        elif isinstance(out, Goto):
            target = d.index(out.step)
            self._log(wf, "goto", {"to": out.step, **({"note": out.note} if out.note else {})})
            self._enter(wf, target, out.step)
        elif isinstance(out, Fail):
            self._log(wf, "step-failed", {"reason": out.reason})
            self._fail(wf, out.reason)
        elif isinstance(out, Finish):
            if step.name not in wf.data["completed"]:
                wf.data["completed"].append(step.name)
            self._end(
                wf,
                WorkflowStatus.DONE if out.ok else WorkflowStatus.FAILED,
                summary=out.summary,
                error=None if out.ok else out.summary,
            )

    def _fail(self, wf: Workflow, reason: str) -> None:
        d = self.definitions[wf.kind]
        wf.data["error"] = reason
        todo = [
            name for name in reversed(wf.data["completed"]) if d.step(name).compensate is not None
        ]
        if not todo:
            self._end(wf, WorkflowStatus.FAILED, error=reason)
            return
        wf.status = WorkflowStatus.COMPENSATING
        wf.data["phase"] = "compensate"
        wf.data["compensations"] = todo
        wf.data["compensation_errors"] = []
        self._log(wf, "compensating", {"reason": reason, "steps": todo})
        wf.step = 0
        wf.data["step_name"] = todo[0]
        wf.data["step_started"] = self.cp.now()
        self._touch(wf)

    def _after_compensation(self, wf: Workflow, step: Step, out: Outcome) -> None:
        errors: list[str] = wf.data["compensation_errors"]
        if isinstance(out, Fail | Finish) and not (isinstance(out, Finish) and out.ok):
            why = out.reason if isinstance(out, Fail) else out.summary
            errors.append(f"{step.name}: {why}")
            self._log(wf, "compensation-failed", {"step": step.name, "reason": why})
        else:
            note = getattr(out, "note", "") or getattr(out, "summary", "")
            self._log(wf, "compensated", {"step": step.name, **({"note": note} if note else {})})
        if wf.step + 1 < len(wf.data["compensations"]):
            wf.step += 1
            wf.data["step_name"] = wf.data["compensations"][wf.step]
            wf.data["step_started"] = self.cp.now()
            self._touch(wf)
            return
        if errors:
            msg = f"{wf.data['error']}; compensation failed: {'; '.join(errors)}"
            self._end(wf, WorkflowStatus.FAILED, error=msg)
        else:
            self._end(wf, WorkflowStatus.COMPENSATED, error=wf.data["error"])
            subject = ", ".join(wf.data.get("subjects", ())) or wf.id
            self._alert(wf, "warning", subject,
                        f"workflow {wf.kind} failed and was compensated: {wf.data['error']}")

    def _end(
        self, wf: Workflow, status: str, *, summary: str | None = None, error: str | None = None
    ) -> None:
        wf.status = status
        if summary is not None:
            wf.data["summary"] = summary
        if error is not None:
            wf.data["error"] = error
        self._wake[wf.id] = None
        self._log(wf, status, {k: v for k, v in (("summary", summary), ("error", error)) if v})
        if status == WorkflowStatus.FAILED and not wf.data.get("alerted"):
            subject = ", ".join(wf.data.get("subjects", ())) or wf.id
            self._alert(wf, "critical", subject, f"workflow {wf.kind} failed: {error or summary}")

    # ------------------------------------------------------------ recording
    def _touch(self, wf: Workflow) -> None:
        wf.updated = self.cp.now()
        self._dirty[wf.id] = None

    def _log(self, wf: Workflow, event: str, detail: Mapping[str, Any]) -> None:
        entry = {
            "t": self.cp.now(),
            "step": wf.data.get("step_name"),
            "event": event,
            **_jsonable(dict(detail)),
        }
        wf.log.append(entry)
        if len(wf.log) > MAX_LOG:
            del wf.log[: len(wf.log) - MAX_LOG]
        self._touch(wf)
        self._audit_out.append((wf, entry))
        for fn in list(self.listeners):
            try:
                fn(wf, entry)
            except Exception:  # a listener (a stream) must not break the workflow
                log.exception("workflow listener failed")

    def _alert(self, wf: Workflow, severity: str, subject: str, message: str) -> Alert:
        a = Alert(self.cp.now(), wf.id, wf.kind, subject, severity, message, wf.correlation_id)
        wf.data["alerted"] = True
        self.alerts.append(a)
        self._log(wf, "alert", {"severity": severity, "message": message})
        for fn in list(self.alert_listeners):
            try:
                fn(a)
            except Exception:
                log.exception("alert listener failed")
        return a

    def _dead_letter(
        self, wf: Workflow, subject: str, payload: dict[str, Any], error: str, attempts: int
    ) -> None:
        rec = DeadLetterRecord(
            event_id=f"workflow:{wf.id}:gave-up",
            time=self.cp.now(),
            subject=subject,
            payload=sanitize(_jsonable({"workflow": wf.id, "kind": wf.kind, **payload})),
            error=error,
            attempts=max(1, attempts),
            correlation_id=wf.correlation_id,
        )
        self.dead_letters.append(rec)
        self._dead_out.append(rec)
        self._log(wf, "dead-lettered", {"event_id": rec.event_id, "subject": subject})

    # -------------------------------------------------------------- storage
    def flush(self) -> int:
        """Write the workflows changed since the last flush (after the cluster state)."""
        if self.repo is None:
            self._dirty.clear()
            self._audit_out.clear()
            self._dead_out.clear()
            return 0
        if not self._dirty and not self._audit_out and not self._dead_out:
            return 0
        if self.writer is not None:
            self.writer.flush()  # the state the workflows observed is durable first
        by_id = {**{w.id: w for w in self.finished}, **self.active}
        rows = [_row(by_id[w]) for w in self._dirty if w in by_id]
        audit_out = list(self._audit_out)
        dead_out = list(self._dead_out)
        audit = self.audit

        def go(c: Connection) -> None:
            t = S.workflows
            for row in rows:
                res = c.execute(update(t).where(t.c.id == row["id"]).values(**row))
                if res.rowcount == 0:
                    c.execute(insert(t).values(**row))
            dl = S.dead_letters
            for rec in dead_out:
                values = {
                    "time": rec.time,
                    "subject": rec.subject,
                    "payload": rec.envelope_json(),
                    "error": rec.error,
                    "attempts": rec.attempts,
                    "replayed": False,
                }
                got = c.execute(select(dl.c.event_id).where(dl.c.event_id == rec.event_id)).first()
                if got is None:
                    c.execute(insert(dl).values(event_id=rec.event_id, **values))
            if audit is not None:
                for wf, entry in audit_out:
                    subjects = wf.data.get("subjects") or [None]
                    audit.append(
                        kind="workflow" if entry["event"] != "alert" else "alert",
                        actor=f"{self.actor}:{wf.kind}",
                        payload={"workflow": wf.id, **entry},
                        workload=subjects[0],
                        correlation_id=wf.correlation_id,
                        time=entry["t"],
                        conn=c,
                    )

        self.repo.write(go)
        self._dirty.clear()
        del self._audit_out[: len(audit_out)]
        del self._dead_out[: len(dead_out)]
        return len(rows)

    def _load_rows(self, statuses: Sequence[str] | None, wid: str | None = None) -> list[Workflow]:
        if self.repo is None:
            return []
        t = S.workflows
        q = select(t)
        if statuses is not None:
            q = q.where(t.c.status.in_(list(statuses)))
        if wid is not None:
            q = q.where(t.c.id == wid)
        with self.repo.engine.connect() as c:
            rows = c.execute(q.order_by(t.c.created, t.c.id)).all()
        out = []
        for r in rows:
            try:
                data = json.loads(r.data)
                if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
                    raise ValueError("data is not a workflow document")
                for key, default in (("state", {}), ("log", []), ("completed", [])):
                    data.setdefault(key, default)
            except ValueError as exc:
                self.load_errors.append(f"workflow {r.id}: unreadable data: {exc}")
                continue
            out.append(
                Workflow(r.id, r.kind, r.correlation_id or r.id, r.status, r.step, data,
                         r.created, r.updated)
            )
        return out

    def _stored(self, wid: str) -> Workflow | None:
        got = self._load_rows(None, wid)
        return got[0] if got else None

    @classmethod
    def load(cls, cp: ControlPlane, repo: Repository, **kwargs: Any) -> WorkflowEngine:
        """An engine holding the active workflows stored in ``repo``, resumed where they were.

        A stored workflow that cannot be read (unknown kind, bad parameters,
        corrupt JSON) is left as it is in the store and named in
        ``load_errors``; the others resume.
        """
        eng = cls(cp, repo=repo, **kwargs)
        for wf in eng._load_rows(WorkflowStatus.ACTIVE):
            d = eng.definitions.get(wf.kind)
            if d is None:
                eng.load_errors.append(f"workflow {wf.id}: unknown kind {wf.kind!r}")
                continue
            try:
                params = d.params.model_validate(wf.params)
                eng._check_position(wf, d)
            except (ValidationError, ValueError, KeyError, IndexError) as exc:
                eng.load_errors.append(f"workflow {wf.id}: cannot resume: {exc}")
                continue
            eng.active[wf.id] = wf
            eng._params[wf.id] = params
            eng._wake[wf.id] = None
            step, comp = eng._current(wf)
            eng._log(wf, "resumed", {"at": step.name, "phase": "compensate" if comp else "forward"})
        for msg in eng.load_errors:
            log.error("%s", msg)
        return eng

    @staticmethod
    def _check_position(wf: Workflow, d: WorkflowDefinition) -> None:
        if wf.phase == "compensate":
            comps = wf.data.get("compensations")
            if not isinstance(comps, list) or not 0 <= wf.step < len(comps):
                raise ValueError(f"compensation step {wf.step} out of range")
            d.step(comps[wf.step])
        elif not 0 <= wf.step < len(d.steps):
            raise ValueError(f"step {wf.step} out of range (0..{len(d.steps) - 1})")
        wf.data.setdefault("step_name", d.steps[wf.step].name if wf.phase != "compensate"
                           else wf.data["compensations"][wf.step])
        wf.data.setdefault("step_started", wf.updated)


def _row(wf: Workflow) -> dict[str, Any]:
    return {
        "id": wf.id,
        "kind": wf.kind,
        "correlation_id": wf.correlation_id,
        "status": wf.status,
        "step": wf.step,
        "data": canonical_json(sanitize(_jsonable(wf.data))),
        "created": wf.created,
        "updated": wf.updated,
    }


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple | set | frozenset):
        return [_jsonable(x) for x in v]
    if isinstance(v, State | NodeStatus | PreemptReason):
        return v.value
    return v


def _pydantic_problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(x) for x in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
    )


# =============================================================== parameters
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Id = Annotated[str, Field(min_length=1, max_length=128)]


class RescheduleParams(BaseModel):
    """One preemptor and the victim(s) whose resources it takes.

    ``victim`` names one victim; ``victims`` several (an agent's preemption plan
    often needs more than one to free a node); give exactly one of the two."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    victim: Id | None = None
    victims: tuple[Id, ...] = Field(default=(), max_length=64)
    preemptor: Id
    reason: PreemptReason = PreemptReason.PRIORITY
    #: the victims' checkpoint and release (grace period and the backend's confirmation)
    checkpoint_timeout_s: Seconds = 600.0
    place_timeout_s: Seconds = 300.0
    start_timeout_s: Seconds = 300.0
    running_timeout_s: Seconds = 600.0
    compensation_timeout_s: Seconds = 900.0

    @model_validator(mode="after")
    def _one_victim_list(self) -> RescheduleParams:
        if (self.victim is None) == (not self.victims):
            raise ValueError("give exactly one of victim or victims")
        if len(set(self.victims)) != len(self.victims):
            raise ValueError("victims: a workload is named twice")
        return self

    @property
    def all_victims(self) -> tuple[str, ...]:
        return self.victims or ((self.victim,) if self.victim is not None else ())


class RecoverParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    workload: Id
    #: retries in place (the scheduler chooses the nodes) before moving off the failing nodes
    max_retries: int = Field(default=3, ge=0, le=20)
    backoff_base_s: Seconds = 30.0
    backoff_factor: float = Field(default=2.0, ge=1.0, le=10.0, allow_inf_nan=False)
    backoff_max_s: Seconds = 1800.0
    #: a retried attempt that runs this long (or succeeds) counts as recovered
    healthy_after_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 60.0
    max_moves: int = Field(default=1, ge=0, le=10)
    #: how long a move may wait for room off the failing nodes before giving up
    place_timeout_s: Seconds = 600.0
    #: nodes known to be bad already (a node trigger's evidence)
    bad_nodes: tuple[Id, ...] = ()


# =============================================================== reschedule
def _nodes(w: Workload) -> list[str]:
    return list(dict.fromkeys(a.node for a in w.placement))


def _preempted_for(v: Workload, preemptor: str) -> bool:
    return v.state in (State.PREEMPTING, State.PREEMPTED) and v.preempted_by == preemptor


def _check_reschedule(cp: ControlPlane, p: RescheduleParams) -> list[str]:
    out = []
    for role, wid in (*(("victim", v) for v in p.all_victims), ("preemptor", p.preemptor)):
        if wid not in cp.workloads:
            out.append(f"{role}: unknown workload {wid!r}")
    if out:
        return out
    if p.preemptor in p.all_victims:
        return ["a workload cannot preempt itself"]
    w = cp.workloads[p.preemptor]
    for vid in p.all_victims:
        v = cp.workloads[vid]
        # a preemption already under way for this preemptor (the agent's committed plan)
        # is adopted: the workflow carries out the rest
        if v.state not in (State.ADMITTED, State.STARTING, State.RUNNING) and not _preempted_for(
            v, w.id
        ):
            out.append(
                f"victim {v.id} is {v.state.value}; only admitted or running work is preempted"
            )
    if w.state not in QUEUED:
        out.append(f"preemptor {w.id} is {w.state.value}; it must be waiting for placement")
    return out


def _victim_record(v: Workload) -> dict[str, Any]:
    """What compensation needs to know of a victim, taken before it releases."""
    return {
        "attempt": v.attempt,
        "nodes": _nodes(v),
        "placement": placement_to_json(v.placement),
        "progress_before": round(v.progress, 6),
    }


def _victims(ctx: StepContext) -> tuple[list[Workload], str | None]:
    p: RescheduleParams = ctx.params
    out = []
    for vid in p.all_victims:
        v = ctx.workload(vid)
        if v is None:
            return [], f"unknown workload {vid!r}"
        out.append(v)
    return out, None


def _r_checkpoint(ctx: StepContext) -> Outcome:
    p: RescheduleParams = ctx.params
    st = ctx.state
    vs, err = _victims(ctx)
    w = ctx.workload(p.preemptor)
    if err is not None or w is None:
        return Fail(err or f"unknown workload {p.preemptor!r}")
    st.setdefault("preemptor_attempt", w.attempt)
    info: dict[str, Any] = st.setdefault("victims", {})
    if st.get("preempted"):
        return Next("the victims were asked already")
    adopted, to_ask = [], []
    for v in vs:
        rec = info.get(v.id)
        if _preempted_for(v, w.id) and (rec is None or v.attempt == rec["attempt"]):
            # asked already: by the plan that started this workflow, before a restart
            # (the record had not said so yet), or by the scheduler
            if rec is None:
                info[v.id] = _victim_record(v)
            adopted.append(v.id)
        else:
            to_ask.append(v)
    if not to_ask:
        st["preempted"] = True
        return Next(f"{', '.join(adopted)} already preempted for {w.id}")
    if w.state in HOLDING or w.state is State.SUCCEEDED:
        return Finish(True, f"{w.id} is {w.state.value} already; no preemption needed")
    if w.state not in QUEUED:
        return Fail(f"preemptor {w.id} is {w.state.value}, not waiting for placement")
    for v in to_ask:
        if v.state not in (State.ADMITTED, State.STARTING, State.RUNNING):
            if adopted:
                ctx.had_effect()  # the adopted victims are resumed by the compensation
            return Fail(f"victim {v.id} is {v.state.value}; there is nothing to preempt")
    for v in to_ask:
        info[v.id] = _victim_record(v)
    names = ", ".join(v.id for v in to_ask)
    res = ctx.propose(
        [Preempt(v.id, w.id, p.reason) for v in to_ask],
        f"reschedule: {names} checkpoint{'s' if len(to_ask) == 1 else ''} and yield"
        f" {'its' if len(to_ask) == 1 else 'their'} resources to {w.id}",
    )
    if not res.accepted:
        for v in to_ask:
            info.pop(v.id, None)
        if adopted:
            ctx.had_effect()
        return Fail("the control plane refused the preemption: " + "; ".join(res.reasons()))
    st["preempted"] = True
    where = sorted({n for v in to_ask for n in info[v.id]["nodes"]})
    return Next(f"asked {names} to checkpoint and stop (on {', '.join(where)})")


def _r_wait_checkpoint(ctx: StepContext) -> Outcome:
    p: RescheduleParams = ctx.params
    st = ctx.state
    vs, err = _victims(ctx)
    if err is not None:
        return Fail(err)
    info: dict[str, Any] = st.get("victims", {})
    lost = [
        v.id for v in vs
        if v.holding and v.state is not State.PREEMPTING and v.id in info
        and v.attempt == info[v.id]["attempt"] and v.preempted_by != p.preemptor
    ]
    if lost:
        # the preemption is not in the state (it was not durable when the engine stopped)
        st.pop("preempted", None)
        for vid in lost:
            info.pop(vid, None)
        return Goto("checkpoint", f"{', '.join(lost)}: the preemption was lost; asking again")
    waiting = [v.id for v in vs if v.state is State.PREEMPTING]
    if waiting:
        return Wait(f"{', '.join(waiting)} checkpointing within the grace period")
    return Next("; ".join(f"{v.id} is {v.state.value}" for v in vs))


_RELEASED_HOW = {
    State.PREEMPTED: "the backend confirmed the release",
    State.SUCCEEDED: "it finished within its grace period",
    State.FAILED: "it failed within its grace period",
    State.CANCELLED: "it was cancelled",
}


def _r_confirm_release(ctx: StepContext) -> Outcome:
    st = ctx.state
    vs, err = _victims(ctx)
    if err is not None:
        return Fail(err)
    info: dict[str, Any] = st.get("victims", {})
    listed = []
    for v in vs:
        rec = info.get(v.id, {})
        same = v.attempt == rec.get("attempt")
        if v.state is State.PREEMPTING:
            return Goto("wait_checkpoint", f"{v.id} is still releasing")
        if v.holding and same:
            return Goto("wait_checkpoint", f"{v.id} still holds its resources")
        listed += [f"{v.id} on {n}" for n in rec.get("nodes", [])
                   if same and v.id in ctx.cp.on_node.get(n, {})]
    if listed:
        return Wait(f"still listed: {', '.join(listed)}")
    st["released"] = True
    notes = []
    for v in vs:
        info.setdefault(v.id, {})["saved_progress"] = round(v.progress, 6)
        how = _RELEASED_HOW.get(v.state, f"it is {v.state.value}")
        notes.append(f"{v.id}: {how}; it saved {v.progress:.0%} of its work")
    return Next("; ".join(notes))


def _r_place(ctx: StepContext) -> Outcome:
    p: RescheduleParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.preemptor)
    if w is None:
        return Fail(f"unknown workload {p.preemptor!r}")
    before = int(st.get("preemptor_attempt", 0))
    if w.attempt > before and (w.holding or w.state is State.SUCCEEDED):
        st["preemptor_nodes"] = _nodes(w)
        by = "the workflow" if st.get("placed_by_workflow") else "the scheduler"
        return Next(f"{w.id} placed by {by} on {', '.join(_nodes(w)) or 'its nodes'}")
    if w.state not in QUEUED:
        return Fail(f"preemptor {w.id} is {w.state.value}; it cannot be placed")
    allocs = ctx.placement_for(w)
    if allocs is None:
        return Wait(f"{w.id} does not fit yet")
    res = ctx.propose([Place(w.id, allocs)], f"reschedule: place {w.id} on the freed resources")
    if not res.accepted:
        return Wait("placement refused: " + "; ".join(res.reasons()))
    st["placed_by_workflow"] = True
    st["preemptor_nodes"] = _nodes(w)
    return Next(f"placed {w.id} on {', '.join(_nodes(w))}")


def _r_start(ctx: StepContext) -> Outcome:
    # The start edge belongs to the runtime: it pairs the ``Start`` with the backend's
    # start command (applying Start here would leave a workload no backend was asked to run).
    p: RescheduleParams = ctx.params
    w = ctx.workload(p.preemptor)
    if w is None:
        return Fail(f"unknown workload {p.preemptor!r}")
    if w.state in (State.STARTING, State.RUNNING, State.SUCCEEDED):
        return Next(f"{w.id} is {w.state.value}")
    if w.state is State.ADMITTED:
        return Wait(f"{w.id} is admitted; the runtime sends its start command")
    return Fail(f"{w.id} could not start: {_describe_end(w)}")


def _r_confirm_running(ctx: StepContext) -> Outcome:
    p: RescheduleParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.preemptor)
    if w is None:
        return Fail(f"unknown workload {p.preemptor!r}")
    if w.state in (State.RUNNING, State.SUCCEEDED):
        info: dict[str, Any] = st.get("victims", {})
        saved = [f"{vid} saved {float(r['saved_progress']):.0%}" for vid, r in info.items()
                 if r.get("saved_progress")]
        tail = f"; {', '.join(saved)} and wait{'s' if len(saved) == 1 else ''} in the queue" \
            if saved else ""
        return Finish(True, f"{w.id} is {w.state.value}{tail}")
    if w.state is State.STARTING:
        return Wait(f"{w.id} is starting")
    return Fail(f"{w.id} did not come up: {_describe_end(w)}")


def _r_resume_victims(ctx: StepContext) -> Outcome:
    st = ctx.state
    vs, err = _victims(ctx)
    if err is not None:
        return Fail(err)
    info: dict[str, Any] = st.get("victims", {})
    notes: list[str] = []
    waiting: list[str] = []
    for v in vs:
        rec = info.get(v.id)
        if rec is None or rec.get("resumed"):
            continue  # never asked to stop (or resumed on an earlier tick)
        note = _resume_one(ctx, v, rec)
        if note is None:
            waiting.append(rec.pop("waiting", f"{v.id} is not resumed yet"))
        else:
            rec["resumed"] = True
            notes.append(note)
    if waiting:
        return Wait("; ".join(waiting))
    return Next("; ".join(notes) or "nothing to resume")


def _resume_one(ctx: StepContext, v: Workload, rec: dict[str, Any]) -> str | None:
    """Resume one victim; returns what was done, or None (with ``rec['waiting']``) to wait."""
    if v.state in TERMINAL or v.state is State.FAILED:
        return f"nothing to resume: {v.id} is {v.state.value}"
    if v.state is State.PREEMPTING:
        rec["waiting"] = f"{v.id} is still releasing; it is resumed once released"
        return None
    if v.holding:
        again = v.attempt > int(rec.get("attempt", v.attempt))
        return f"{v.id} is {v.state.value}" + (" again" if again else " (it was never stopped)")
    if v.state is not State.PREEMPTED:
        return f"{v.id} is {v.state.value}; the scheduler places it"
    tried: list[str] = []
    old = placement_from_json(rec["placement"]) if rec.get("placement") else ()
    for label, allocs in (("its old nodes", old), ("the best fit", None)):
        if allocs is None:
            allocs = ctx.placement_for(v)
        if not allocs:
            continue
        res = ctx.propose(
            [Place(v.id, tuple(allocs))],
            f"compensation: resume {v.id} from its checkpoint ({ctx.wf.data.get('error')})",
        )
        if res.accepted:
            return f"resumed {v.id} on {label} ({', '.join(_nodes(v))})"
        tried.append("; ".join(res.reasons()))
    rec["waiting"] = f"no room to resume {v.id} yet" + (f" ({tried[-1]})" if tried else "")
    return None


def _describe_end(w: Workload) -> str:
    text = w.state.value
    if w.failure_cause:
        text += f" ({w.failure_cause}"
        text += f", exit {w.exit_code})" if w.exit_code is not None else ")"
    return text


RESCHEDULE = WorkflowDefinition(
    kind="reschedule",
    doc="Move resources from running victims to a waiting, more urgent workload, gracefully.",
    params=RescheduleParams,
    steps=(
        Step("checkpoint", _r_checkpoint, "ask the victims to checkpoint and stop (Preempt)",
             compensate=_r_resume_victims,
             compensate_doc="resume the victims from their checkpoints (their old nodes first)"),
        Step("wait_checkpoint", _r_wait_checkpoint, "wait while the victims checkpoint",
             timeout="checkpoint_timeout_s"),
        Step("confirm_release", _r_confirm_release,
             "confirm the backend released the victims' resources",
             timeout="checkpoint_timeout_s"),
        Step("place", _r_place, "place the preemptor on the freed resources",
             timeout="place_timeout_s"),
        Step("start", _r_start, "see the runtime start the preemptor", timeout="start_timeout_s"),
        Step("confirm_running", _r_confirm_running, "confirm the preemptor runs",
             timeout="running_timeout_s"),
    ),
    subjects=lambda p: (p.preemptor, *p.all_victims),
    check=_check_reschedule,
    compensation_timeout="compensation_timeout_s",
)


# ================================================================= recover
_NODE_CAUSES = frozenset({"node-lost", "vanished"})


def _check_recover(cp: ControlPlane, p: RecoverParams) -> list[str]:
    w = cp.workloads.get(p.workload)
    if w is None:
        return [f"workload: unknown workload {p.workload!r}"]
    unknown = [n for n in p.bad_nodes if n not in cp.capacity]
    if unknown:
        return [f"bad_nodes: unknown node(s) {', '.join(unknown)}"]
    if w.state in TERMINAL:
        return [f"{w.id} is {w.state.value}; there is nothing to recover"]
    return []


def _failed_at(w: Workload) -> float:
    for tr in reversed(w.history):
        if tr.target is State.FAILED:
            return tr.time
    return w.history[-1].time if w.history else 0.0


def _record_failure(ctx: StepContext, w: Workload) -> list[str]:
    """Note the failure of ``w``'s current attempt; returns the nodes it ran on."""
    st = ctx.state
    nodes = list(ctx.engine.nodes_of_attempt(w, w.attempt))
    if not nodes and st.get("current_attempt") == w.attempt:
        nodes = list(st.get("current_nodes", []))
    failures: list[dict[str, Any]] = st.setdefault("failures", [])
    if not any(f["attempt"] == w.attempt for f in failures):
        failures.append(
            {"attempt": w.attempt, "cause": w.failure_cause, "exit_code": w.exit_code,
             "nodes": nodes, "time": _failed_at(w)}
        )
        del failures[:-50]
    bad: list[str] = st.setdefault("bad_nodes", [])
    for n in nodes:
        if n not in bad:
            bad.append(n)
    st["seen_attempt"] = w.attempt
    st["failed_at"] = _failed_at(w)
    return nodes


def _node_trouble(ctx: StepContext, w: Workload, nodes: Sequence[str]) -> bool:
    cap = ctx.cp.capacity
    return w.failure_cause in _NODE_CAUSES or any(
        n in cap and cap.status(n) is not NodeStatus.READY for n in nodes
    )


def _v_triage(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.workload)
    if w is None:
        return Fail(f"unknown workload {p.workload!r}")
    st.setdefault("tries", 0)
    st.setdefault("moves", 0)
    for n in p.bad_nodes:
        st.setdefault("bad_nodes", [])
        if n not in st["bad_nodes"]:
            st["bad_nodes"].append(n)
    if w.state is State.FAILED:
        nodes = _record_failure(ctx, w)
        if _node_trouble(ctx, w, nodes):
            return Goto("move", f"{w.id} failed with its node ({w.failure_cause}); moving it off")
        return Next(f"{w.id} failed ({_describe_end(w)}) on {', '.join(nodes) or 'unknown nodes'}")
    if w.state in TERMINAL:
        return Finish(True, f"{w.id} is {w.state.value}; nothing to recover")
    # not failed right now (the runtime retried it already, or it runs): watch what comes
    st["seen_attempt"] = w.attempt if w.state in QUEUED else w.attempt - 1
    return Goto("watch", f"{w.id} is {w.state.value}; watching its next attempt")


def _v_retry(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.workload)
    if w is None:
        return Fail(f"unknown workload {p.workload!r}")
    tries = int(st.get("tries", 0))
    if tries >= p.max_retries:
        return Goto("move", f"{tries} retr{'y' if tries == 1 else 'ies'} failed; moving it")
    if w.state is not State.FAILED or w.attempt != st.get("seen_attempt"):
        # someone (the runtime's own retry policy) re-queued it already: that is the retry
        st["tries"] = tries + 1
        return Next(f"{w.id} is {w.state.value}: already retried by the runtime")
    delay = min(p.backoff_max_s, p.backoff_base_s * p.backoff_factor**tries)
    due = float(st.get("failed_at", ctx.now())) + delay
    st["retry_due"] = due
    if ctx.now() < due:
        return Wait(f"backoff: retry {tries + 1}/{p.max_retries} at t={due:g} ({delay:g}s)", until=due)
    res = ctx.propose([Retry(w.id)], f"recover: retry {tries + 1}/{p.max_retries} after {delay:g}s")
    if not res.accepted:
        st["give_up_reason"] = "retry refused: " + "; ".join(res.reasons())
        return Goto("give_up", st["give_up_reason"])
    st["tries"] = tries + 1
    st["retried_attempt"] = w.attempt
    return Next(f"retry {tries + 1}/{p.max_retries} after {delay:g}s backoff")


def _v_watch(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.workload)
    if w is None:
        return Fail(f"unknown workload {p.workload!r}")
    seen = int(st.get("seen_attempt", 0))
    if w.holding:
        st["current_attempt"] = w.attempt
        st["current_nodes"] = _nodes(w)
    if w.state is State.SUCCEEDED:
        return Finish(True, f"recovered: {w.id} succeeded ({_story(st)})")
    if w.state is State.CANCELLED:
        return Finish(True, f"{w.id} was cancelled; nothing left to recover")
    if w.state is State.RUNNING and w.attempt > seen and w.started_at is not None:
        healthy_at = w.started_at + p.healthy_after_s
        if ctx.now() >= healthy_at:
            return Finish(True, f"recovered: {w.id} runs on {', '.join(_nodes(w))} ({_story(st)})")
        return Wait(f"{w.id} runs again; healthy after {p.healthy_after_s:g}s", until=healthy_at)
    if w.state is State.FAILED and w.attempt > seen:
        nodes = _record_failure(ctx, w)
        if _node_trouble(ctx, w, nodes):
            return Goto("move", f"attempt {w.attempt} lost its node; moving it off")
        if int(st.get("tries", 0)) < p.max_retries:
            return Goto("retry", f"attempt {w.attempt} failed on {', '.join(nodes) or '?'}")
        return Goto("move", f"attempt {w.attempt} failed on {', '.join(nodes) or '?'}")
    if w.state is State.FAILED and w.attempt == seen:
        if st.get("retried_attempt") == seen:
            # the retry was not durable when the engine stopped: it did not happen
            st["tries"] = max(0, int(st.get("tries", 0)) - 1)
            st.pop("retried_attempt", None)
        if st.get("moved_attempt") == seen:
            st["moves"] = max(0, int(st.get("moves", 0)) - 1)
            st.pop("moved_attempt", None)
        return Goto("retry", f"{w.id} is still failed at attempt {seen}")
    return Wait(f"watching {w.id}: {w.state.value} (attempt {w.attempt})")


def _v_move(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    w = ctx.workload(p.workload)
    if w is None:
        return Fail(f"unknown workload {p.workload!r}")
    moves = int(st.get("moves", 0))
    bad = list(st.get("bad_nodes", []))
    if w.state is State.SUCCEEDED:
        return Finish(True, f"recovered: {w.id} succeeded ({_story(st)})")
    if w.state is State.CANCELLED:
        return Finish(True, f"{w.id} was cancelled; nothing left to recover")
    if moves >= p.max_moves:
        st["give_up_reason"] = (
            f"still failing after {st.get('tries', 0)} retries and {moves} move(s)"
        )
        return Goto("give_up", st["give_up_reason"])
    if w.holding:
        on_bad = [n for n in _nodes(w) if n in bad]
        if not on_bad:
            return Goto("watch", f"{w.id} already runs off the failing nodes")
        if w.state is State.PREEMPTING:
            return Wait(f"{w.id} is being stopped")
        evictions = int(st.get("evictions", 0))
        if evictions > p.max_moves:
            # placed back on a failing node each time (by the scheduler): stop chasing it
            st["give_up_reason"] = (
                f"placed back on {', '.join(on_bad)} after {evictions} eviction(s)"
            )
            return Goto("give_up", st["give_up_reason"])
        res = ctx.propose([Evict(w.id, f"move off {', '.join(on_bad)}")],
                          f"recover: move {w.id} off {', '.join(on_bad)}")
        if not res.accepted:
            return Wait("eviction refused: " + "; ".join(res.reasons()))
        st["evictions"] = evictions + 1
        return Wait(f"{w.id} is being moved off {', '.join(on_bad)}")
    if w.state is State.PREEMPTING:
        return Wait(f"{w.id} is being stopped")
    allocs = ctx.placement_for(w, exclude=bad)
    if allocs is None:
        return Wait(f"no node other than {', '.join(bad) or 'none'} fits {w.id} now")
    actions: list[Action] = [Retry(w.id)] if w.state is State.FAILED else []
    actions.append(Place(w.id, allocs))
    was = w.attempt
    res = ctx.propose(actions, f"recover: move {w.id} off {', '.join(bad) or 'its nodes'}")
    if not res.accepted:
        reasons = "; ".join(res.reasons())
        if w.state is State.FAILED and "max_retries" in reasons:
            st["give_up_reason"] = "retry refused: " + reasons
            return Goto("give_up", st["give_up_reason"])
        return Wait("move refused: " + reasons)
    st["moves"] = moves + 1
    st["moved_attempt"] = was
    st["seen_attempt"] = was
    return Goto("watch", f"moved {w.id} to {', '.join(_nodes(w))}")


def _v_give_up(ctx: StepContext) -> Outcome:
    p: RecoverParams = ctx.params
    st = ctx.state
    reason = str(st.get("give_up_reason") or st.get("timeout_reason") or "recovery exhausted")
    failures = list(st.get("failures", []))
    ctx.dead_letter(
        "workflow.recover.gave_up",
        {"workload": p.workload, "reason": reason, "failures": failures,
         "tries": st.get("tries", 0), "moves": st.get("moves", 0),
         "bad_nodes": st.get("bad_nodes", [])},
        reason,
        attempts=len(failures),
    )
    ctx.alert("critical", p.workload, f"gave up recovering {p.workload}: {reason}")
    return Finish(False, f"gave up: {reason}")


def _story(st: Mapping[str, Any]) -> str:
    return f"{st.get('tries', 0)} retr{'y' if st.get('tries', 0) == 1 else 'ies'}, " \
           f"{st.get('moves', 0)} move(s)"


RECOVER = WorkflowDefinition(
    kind="recover",
    doc="Failure recovery: retry with backoff, move off the failing nodes, give up with an alert.",
    params=RecoverParams,
    steps=(
        Step("triage", _v_triage, "note the failure and its nodes; a lost node goes straight to move"),
        Step("retry", _v_retry, "retry after an exponential backoff"),
        Step("watch", _v_watch, "watch the new attempt: healthy, succeeded, or failed again"),
        Step("move", _v_move, "place it again off the nodes it failed on",
             timeout="place_timeout_s", on_timeout="give_up"),
        Step("give_up", _v_give_up, "dead-letter the case and alert an operator"),
    ),
    subjects=lambda p: (p.workload,),
    check=_check_recover,
)

#: The workflows the engine runs by default.
DEFINITIONS: tuple[WorkflowDefinition, ...] = (RESCHEDULE, RECOVER)

# ================================================================== runtime
def attach_workflows(engine: Any, *, actor: str = "workflow") -> WorkflowEngine:
    """The workflow engine of a runtime engine (``mlwe.runtime.Engine``, duck-typed).

    Loaded from the engine's store, so a workflow in flight when an engine
    stopped resumes at its step after ``Engine.open`` on the same data; ticked
    in ``engine.tick_hooks`` (under the engine lock, after the scheduling
    cycle). Steps propose through an :class:`EngineProposer` (the engine's one request path, verified by the
    control plane; the audit record is written by the engine's flush with the
    effect). Each tick the hook first stores the workflows' previous tick (the
    engine has flushed the state they observed by then, so a stored workflow is
    never ahead of the cluster state), publishes their step events and alerts
    on the engine's ``state`` stream (``type`` "workflow" and "workflow-alert"),
    then advances them.

    The engine keeps it as ``engine.workflows``; a second call returns the same
    one. Call ``start``/``cancel`` under ``engine.lock``. :func:`detach_workflows`
    undoes the wiring.
    """
    existing = getattr(engine, "workflows", None)
    if isinstance(existing, WorkflowEngine):
        return existing
    with engine.lock:
        wfe = WorkflowEngine.load(
            engine.cp,
            engine.repo,
            scheduler=engine.scheduler,
            audit=engine.audit,
            proposer=EngineProposer(engine, actor),
            actor=actor,
            autoflush=False,  # the hook stores each tick once the engine flushed its state
        )
        out: list[tuple[dict[str, Any], str, str | None, float]] = []

        def on_step(wf: Workflow, entry: dict[str, Any]) -> None:
            subjects = wf.data.get("subjects") or [None]
            out.append(({"type": "workflow", "workflow": wf.id, "kind": wf.kind,
                         "status": wf.status, **entry}, wf.correlation_id, subjects[0],
                        float(entry["t"])))

        def on_alert(a: Alert) -> None:
            out.append(({"type": "workflow-alert", **a.to_dict()}, a.correlation_id, None, a.time))

        def hook(_engine: Any) -> None:
            wfe.flush()
            events = list(out)
            out.clear()
            for data, cid, workload, t in events:
                engine.streams.publish("state", data, correlation_id=cid, workload=workload, time=t)
            wfe.tick()

        wfe.listeners.append(on_step)
        wfe.alert_listeners.append(on_alert)
        for wf in wfe.active.values():  # "resumed" entries were logged before the listener
            if wf.log:
                on_step(wf, wf.log[-1])
        engine.tick_hooks.append(hook)
        engine.workflows = wfe
        wfe._detach = lambda: engine.tick_hooks.remove(hook)
    return wfe


def detach_workflows(engine: Any) -> None:
    """Undo :func:`attach_workflows` (stores what the workflows did last first)."""
    wfe = getattr(engine, "workflows", None)
    if not isinstance(wfe, WorkflowEngine):
        return
    with engine.lock:
        if wfe._detach is not None:
            wfe._detach()
            wfe._detach = None
        try:
            wfe.flush()
        except Exception:  # the store is down: the workflows resume from their last row
            log.warning("workflows not stored on detach", exc_info=True)
        del engine.workflows


__all__ = [
    "DEFINITIONS",
    "RECOVER",
    "RESCHEDULE",
    "Alert",
    "AuditingProposer",
    "ControlPlaneProposer",
    "DeadLetterRecord",
    "EngineProposer",
    "Fail",
    "Finish",
    "Goto",
    "Next",
    "Outcome",
    "Proposer",
    "RecoverParams",
    "RescheduleParams",
    "Step",
    "StepContext",
    "Wait",
    "Workflow",
    "WorkflowDefinition",
    "WorkflowEngine",
    "WorkflowError",
    "WorkflowStatus",
    "attach_workflows",
    "detach_workflows",
]
