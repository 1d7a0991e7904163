"""The saga runner: :class:`WorkflowRunner` starts, advances, compensates, cancels,
persists and reloads workflows (table ``workflows``), and files dead letters.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Connection

from mlwe.agent.workflows.model import (
    MAX_LOG,
    Alert,
    Change,
    ControlPlaneProposer,
    DeadLetterRecord,
    Fail,
    Finish,
    Goto,
    Next,
    Outcome,
    Proposer,
    Step,
    StepContext,
    Wait,
    Workflow,
    WorkflowDefinition,
    WorkflowError,
    WorkflowStatus,
    log,
)
from mlwe.agent.workflows.recover import RECOVER
from mlwe.agent.workflows.reschedule import RESCHEDULE
from mlwe.core.actions import PreemptReason
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import NodeStatus
from mlwe.store.audit import AuditLog
from mlwe.store.events import DeadLetterRow, put_dead_letter
from mlwe.store.repository import (
    Repository,
    canonical_json,
)
from mlwe.store.sanitize import sanitize
from mlwe.store.workflows import save_workflows, workflow_rows

#: The workflows a runner runs unless told otherwise.
DEFINITIONS: tuple[WorkflowDefinition, ...] = (RESCHEDULE, RECOVER)


class WorkflowRunner:
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
        self._detach: Callable[[], None] | None = None  # set by mlwe.runtime.wiring.attach_workflows
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
            raise WorkflowError(
                f"{kind}: parameters must be a mapping, got {type(params).__name__}"
            )
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
            raise WorkflowError(
                "correlation id must be a non-empty string of at most 256 characters"
            )
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
            return (
                f"{kind}: workflow {other.id} is already {other.status} for"
                f" {', '.join(sorted(shared))}"
            )
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
            raise WorkflowError(
                f"workflow {workflow_id} is {stored.status}; only running ones are cancelled"
            )
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
            self._alert(
                wf,
                "warning",
                subject,
                f"workflow {wf.kind} failed and was compensated: {wf.data['error']}",
            )

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
            save_workflows(c, rows)
            for rec in dead_out:
                put_dead_letter(c, DeadLetterRow(rec.event_id, rec.time, rec.subject,
                                                 rec.envelope_json(), rec.error, rec.attempts))
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
        rows = self.repo.read(lambda c: workflow_rows(c, statuses, wid))
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
                Workflow(
                    r.id,
                    r.kind,
                    r.correlation_id or r.id,
                    r.status,
                    r.step,
                    data,
                    r.created,
                    r.updated,
                )
            )
        return out

    def _stored(self, wid: str) -> Workflow | None:
        got = self._load_rows(None, wid)
        return got[0] if got else None

    @classmethod
    def load(cls, cp: ControlPlane, repo: Repository, **kwargs: Any) -> WorkflowRunner:
        """A runner holding the active workflows stored in ``repo``, resumed where they were.

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
        wf.data.setdefault(
            "step_name",
            d.steps[wf.step].name
            if wf.phase != "compensate"
            else wf.data["compensations"][wf.step],
        )
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
