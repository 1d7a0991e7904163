"""The MAPE loop: monitor, analyze, plan, execute; every step audited and streamed.

One *round* of the agent: the monitor takes in telemetry and lifecycle
events; the triggers whose schedule is due look for findings; for each
finding (most severe first) the strategies build candidate plans, the
reasoner chooses one and explains itself, the what-if forecaster plays the plan
and doing nothing forward on a fork of the state, and a plan that is
verified and better is executed according to the mode:

- ``autonomous``: proposed to the control plane at the version it was decided
  on (``expected_version``); a rejection goes back to the reasoner with its
  reasons, which may choose another plan (up to ``max_attempts``). A plan with
  a workflow (a preemption: ``reschedule``; repeated failures: ``recover``)
  has its actions committed that way first, then the workflow carries it
  through (wait, confirm, compensate) under the same correlation id;
- ``approve``: it waits for an operator (:meth:`Agent.pending`,
  :meth:`Agent.approve`, :meth:`Agent.reject`); approval re-runs the what-if on
  the state of that moment before proposing and starting the workflow;
- ``observe``: it is recorded as a proposal and never committed.

Locking: the agent reads and writes the live state only under ``lock`` (the
engine's lock in the runtime), and only for short phases: analysing and
planning (triggers, strategies) and taking a *snapshot* (a private copy of the
state, see :class:`mlwe.agent.whatif.Snapshot`); then executing (proposing at
the snapshot's version, starting the workflow, recording). The reasoner and
the forecasts (the seconds) work on the snapshot with no lock held. If the
state moved on meanwhile, the control plane rejects the proposal as stale
(``expected_version``); the finding is left out of its cooldown and the next
analysis plans again on fresh state.

Two ways to run: :meth:`Agent.tick` does a whole round synchronously when one
is due (simulations, tests, an engine ticked by hand: deterministic), and
:meth:`Agent.start_background` runs rounds on the agent's own thread, the
engine's tick hook only noting telemetry and asking for a round when one is
due (:meth:`Agent.background_tick`): the engine loop never waits for a
forecast. Either way an analysis runs at most every ``analysis_interval_s`` of
engine time (and, without lifecycle news, every ``min_interval_s``).

The agent never changes state except through the ``propose`` sink, which by
default is ``ControlPlane.apply`` (the runtime passes ``Engine.propose``), and
the workflows it starts (whose steps propose the same way). Every step yields
an audit record (``audit_sink``) and every decision a reasoning record
(``reasoning_sink``), both plain JSON-able dicts.

Its configuration is in :mod:`mlwe.agent.config`, what its rounds yield in
:mod:`mlwe.agent.outcomes`, its timing figures in :mod:`mlwe.agent.stats`.

Wiring into the runtime (``mlwe.runtime.Engine``) is
:func:`mlwe.runtime.wiring.attach_agent` (the agent does not import the runtime,
an outer layer).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mlwe.agent.codec import AGENT_ACTION_KINDS, action_to_dict
from mlwe.agent.config import AgentConfig, ProposeFn, Sink
from mlwe.agent.model import CandidatePlan, Finding, Hazard, Mode, WhatIf, json_dict
from mlwe.agent.monitor import Monitor
from mlwe.agent.outcomes import Outcome, PendingPlan, _Deliberation, _stale
from mlwe.agent.reasoners import make_reasoner
from mlwe.agent.reasoners.base import Choice, Feedback, Reasoner, Situation
from mlwe.agent.stats import AgentStats, _LockedTelemetry
from mlwe.agent.strategies import Strategy, default_strategies, hazards_for
from mlwe.agent.telemetry import TelemetryWindow
from mlwe.agent.tools import AgentTools
from mlwe.agent.triggers import Analyzer, Context, Trigger, default_triggers
from mlwe.agent.whatif import Snapshot, WhatIfForecaster, YieldGil
from mlwe.agent.workflows import WorkflowError, WorkflowRunner
from mlwe.core.actions import Action
from mlwe.core.backend import Telemetry
from mlwe.core.controlplane import ApplyResult, ControlPlane
from mlwe.core.model import Workload
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import WorkloadSpec

log = logging.getLogger("mlwe.agent")

__all__ = ["Agent", "AgentConfig", "AgentStats", "Outcome", "PendingPlan", "ProposeFn", "Sink"]


class Agent:
    def __init__(
        self,
        cp: ControlPlane,
        *,
        reasoner: Reasoner | str | None = None,
        mode: Mode | str | None = None,
        config: AgentConfig | None = None,
        triggers: Sequence[Trigger] | None = None,
        strategies: Sequence[Strategy] | None = None,
        scheduler: Scheduler | None = None,
        scheduler_factory: Callable[[], Scheduler] = Scheduler,
        propose: ProposeFn | None = None,
        audit_sink: Sink | None = None,
        reasoning_sink: Sink | None = None,
        telemetry_source: Callable[[], list[Telemetry]] | None = None,
        lock: Any = None,
        name: str = "agent",
        workflows: WorkflowRunner | None = None,
        run_id: str = "",
    ) -> None:
        self.cp = cp
        #: in correlation ids (``name-run_id-n``): keeps them unique across restarts
        self.run_id = run_id
        self.config = config or AgentConfig()
        if mode is not None:
            self.config.mode = Mode(mode)
        self.reasoner: Reasoner = (
            make_reasoner(reasoner or "rules") if reasoner is None or isinstance(reasoner, str)
            else reasoner
        )
        self.name = name
        self.scheduler = scheduler or scheduler_factory()
        self.monitor = Monitor(cp, TelemetryWindow()).attach(telemetry_source)
        self.analyzer = Analyzer(triggers if triggers is not None else default_triggers(), cp.now())
        self.strategies = list(strategies if strategies is not None else default_strategies())
        self._hazards: list[Hazard] = []
        self.whatif = WhatIfForecaster(cp, config=self.config.forecast,
                                   scheduler_factory=scheduler_factory,
                                   hazards=lambda: self._hazards,
                                   arrivals=self.arrival_pattern)
        #: the workflows committed plans are carried through by (None: actions only)
        self.workflows = workflows
        self._propose = propose or self._apply
        self.audit_sink = audit_sink
        self.reasoning_sink = reasoning_sink
        self.lock = lock if lock is not None else threading.RLock()
        self._seq = itertools.count(1)
        self._last_analysis: float | None = None
        self._replan = False  # a finding went stale: analyse again soon
        self._handled: dict[str, tuple[float, Any]] = {}
        self._operator_feedback: dict[str, list[Feedback]] = {}
        self._pending: dict[str, PendingPlan] = {}
        self.records: deque[dict[str, Any]] = deque(maxlen=2000)  # recent reasoning records
        self.audit: deque[dict[str, Any]] = deque(maxlen=5000)  # recent audit records
        self.outcomes: list[Outcome] = []
        self.ticks = 0
        self.analyses = 0
        self.stats = AgentStats()
        self._detachers: list[Callable[[], None]] = []
        # background rounds (start_background)
        self._worker: threading.Thread | None = None
        self._requested = threading.Event()
        self._stopping = threading.Event()
        self._busy = False

    @property
    def mode(self) -> Mode:
        return self.config.mode

    @contextmanager
    def _locked(self, phase: str = "other") -> Iterator[None]:
        """Hold the lock for one short phase (and count how long it was held)."""
        with self.lock:
            t = time.perf_counter()
            try:
                yield
            finally:
                self.stats.held(phase, (time.perf_counter() - t) * 1000)

    # ================================================================= monitor
    def observe(self, samples: Iterable[Telemetry]) -> None:
        with self.lock:
            self.monitor.observe(samples)

    def arrival_pattern(self) -> list[tuple[float, WorkloadSpec]]:
        """Recurring arrivals to expect, from what arrived lately (for the what-if).

        Streams only: per (queue, priority), at least ``stream_min`` arrivals
        without a deadline in the last ``stream_lookback_s``, replayed with the
        same spacing over the forecast horizon. A one-off job (an SLA
        fine-tune) is not assumed to come again.
        """
        cfg = self.config
        now = self.cp.now()
        lookback = cfg.stream_lookback_s
        groups: dict[tuple[str, int], list[Workload]] = {}
        for w in self.cp.workloads.values():
            if now - lookback <= w.submit_time <= now and w.deadline is None:
                groups.setdefault((w.queue, w.spec.priority), []).append(w)
        out: list[tuple[float, WorkloadSpec]] = []
        horizon = cfg.forecast.horizon_s
        k = 0
        for ws in groups.values():
            if len(ws) < cfg.stream_min:
                continue
            ws.sort(key=lambda w: w.seq)
            rounds = int(horizon // lookback) + 1
            for r in range(rounds):
                for w in ws:
                    offset = w.submit_time - (now - lookback) + r * lookback
                    if offset <= 0 or offset >= horizon:
                        continue
                    k += 1
                    out.append((offset, w.spec.model_copy(update={"id": f"expected-{k}-{w.id}"[:128]})))
        out.sort(key=lambda x: x[0])
        return out[: cfg.stream_max]

    # ================================================================== sinks
    def _audit(self, step: str, cid: str, **data: Any) -> None:
        rec = json_dict({"type": "agent", "agent": self.name, "step": step,
                         "time": self.cp.now(), "version": self.cp.version,
                         "correlation_id": cid, **data})
        self.audit.append(rec)
        if self.audit_sink is not None:
            self.audit_sink(rec)

    def _reason_record(self, rec: dict[str, Any]) -> None:
        rec = json_dict(rec)
        self.records.append(rec)
        if self.reasoning_sink is not None:
            self.reasoning_sink(rec)

    def _apply(self, actions: Sequence[Action], expected_version: int | None, cid: str,
               rationale: str) -> ApplyResult:
        result = self.cp.apply(list(actions), expected_version, cause_id=cid)
        self._audit("proposal", cid, actions=[action_to_dict(a) for a in actions],
                    expected_version=expected_version, accepted=result.accepted,
                    reasons=result.reasons(), rationale=rationale)
        return result

    # ==================================================================== tick
    def _due(self, now: float) -> bool:
        last = self._last_analysis
        if last is None:
            return True
        since = now - last
        if since < self.config.analysis_interval_s:
            return False
        # lifecycle events are analysed soon (a failure waits for its retry only
        # briefly); telemetry and timers at most every min_interval_s
        return (since >= self.config.min_interval_s or self.monitor.new_events > 0
                or self._replan)

    def tick(self) -> list[Outcome]:
        """One monitor-analyze-plan-execute round, synchronously, if one is due;
        returns what became of each finding."""
        with self._locked("tick"):
            self.ticks += 1
            self.monitor.poll()
            if not self._due(self.cp.now()):
                return []
        return self._round()

    def _round(self) -> list[Outcome]:
        with self._locked("analyze"):
            now = self.cp.now()
            self._last_analysis = now
            self._replan = False
            self.monitor.refresh()
            events, samples, _kinds = self.monitor.take_news()
            ctx = Context(self.cp, self.monitor, self.scheduler, self.config.analyze)
            findings, ran = self.analyzer.run(ctx, samples, events)
            if not ran:
                return []
            self.analyses += 1
            self.stats.rounds += 1
            self.monitor.forget_finished()
            findings.sort(key=lambda f: (-f.severity, f.id))
            self._hazards = [h for f in findings
                             for h in hazards_for(f, ctx, self.config.node_failure_after_s)]
            todo: list[Finding] = []
            for f in findings:
                if len(todo) >= self.config.max_findings_per_tick:
                    break
                if self._cooling(f, now):
                    continue
                self._handled[f.id] = (now, self._revision(f))
                todo.append(f)
        out: list[Outcome] = []
        for f in todo:
            if self._stopping.is_set():
                with self._locked("record"):
                    self._handled.pop(f.id, None)
                continue
            out.append(self._handle(f))
        with self._locked("record"):
            self.outcomes += out
            del self.outcomes[:-1000]
        return out

    def _revision(self, f: Finding) -> Any:
        ev = f.evidence
        return (ev.get("failures"), ev.get("holders") and tuple(ev["holders"]), ev.get("status"))

    def _cooling(self, f: Finding, now: float) -> bool:
        got = self._handled.get(f.id)
        if got is None:
            return False
        t, rev = got
        return now - t < self.config.cooldown_s and rev == self._revision(f)

    def _candidates(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        plans: dict[str, CandidatePlan] = {}
        for s in self.strategies:
            if f.trigger in s.handles:
                for p in s.plan(f, ctx):
                    bad = [a.kind for a in p.actions if a.kind not in AGENT_ACTION_KINDS]
                    if not bad and p.actions:
                        plans.setdefault(p.id, p)
        return list(plans.values())

    def _snapshot(self) -> Snapshot:
        """The state a deliberation works on (call under the lock: a quick copy)."""
        return self.whatif.snapshot()

    def _handle(self, f: Finding) -> Outcome:
        cfg = self.config
        with self._locked("snapshot"):
            cid = f"{self.name}-{self.run_id + '-' if self.run_id else ''}{next(self._seq)}"
            self._audit("analyze", cid, finding=f.to_dict())
            feedback: list[Feedback] = list(self._operator_feedback.get(f.id, ()))
            snap = self._snapshot()
        # the strategies read the snapshot too (they only read state): no lock held
        candidates = self._candidates(f, Context(snap.cp, self.monitor, self.scheduler,
                                                 cfg.analyze))
        d: _Deliberation | None = None
        for attempt in range(1, cfg.max_attempts + 1):
            if attempt > 1:
                with self._locked("snapshot"):
                    if self.cp.version != snap.version:  # the state moved on: look again
                        snap = self._snapshot()
            d = self._deliberate(f, candidates, feedback, snap)  # no lock held
            with self._locked("act"):
                if attempt == 1:
                    self._audit("plan", cid, finding=f.id, version=snap.version,
                                candidates=[c.to_dict() for c in candidates])
                done = self._act(cid, f, d, feedback, attempt)
            if done is not None:
                return done
        assert d is not None
        with self._locked("record"):
            return self._finish(cid, f, d.situation, None, None, "gave-up",
                                tuple(f"{fb.plan_id}: {fb.outcome}" for fb in feedback),
                                cfg.max_attempts)

    def _deliberate(self, f: Finding, candidates: Sequence[CandidatePlan],
                    feedback: Sequence[Feedback], snap: Snapshot) -> _Deliberation:
        """Choose and forecast on ``snap`` (a private copy): needs no lock."""
        started = time.perf_counter()
        situation = Situation(snap.time, snap.version, self.mode, (f,), tuple(candidates),
                              tuple(feedback))
        view = self.whatif.at(snap)
        tools = AgentTools(snap.cp, telemetry=_LockedTelemetry(self.monitor.telemetry, self.lock),
                           candidates=candidates, findings=(f,),
                           forecaster=view if self.config.whatif else None,
                           scheduler=self.scheduler)
        choice = self.reasoner.choose(situation, tools)
        plan = self._known_plan(choice, candidates, tools)
        wi: WhatIf | None = None
        if plan is not None and self.config.whatif:
            wi = tools.forecasts.get(plan.id)
            if wi is None or wi.fork_version != snap.version:
                wi = view.what_if(plan)
        self.stats.think_ms.append((time.perf_counter() - started) * 1000)
        return _Deliberation(situation, choice, plan, wi)

    def _act(self, cid: str, f: Finding, d: _Deliberation, feedback: list[Feedback],
             attempt: int) -> Outcome | None:
        """Execute a deliberation (under the lock); None: try another plan."""
        situation, choice, plan, wi = d.situation, d.choice, d.plan, d.whatif
        self._audit("reason", cid, finding=f.id, attempt=attempt, chose=choice.trace.chose,
                    reasoner=self.reasoner.name)
        reasons: tuple[str, ...]
        if plan is None:
            reasons = () if choice.plan is None else (
                f"the reasoner chose {choice.plan.id!r}, which is neither a candidate nor"
                " proposed through the tools",)
            return self._finish(cid, f, situation, choice, None, "nothing", reasons, attempt)
        if wi is not None:
            self._audit("what-if", cid, plan=plan.id, better=wi.better, summary=wi.summary,
                        plan_score=wi.plan.score, nothing_score=wi.nothing.score,
                        fork_version=wi.fork_version)
            if not wi.better:
                outcome = "not-verified" if not wi.plan.verified else "not-better"
                reasons = (wi.summary, *wi.plan.rejections[:5])
                self._reason(cid, f, situation, choice, wi, outcome, reasons, attempt)
                feedback.append(Feedback(plan.id, outcome, reasons))
                return None
        if self.mode is Mode.OBSERVE:
            return self._finish(cid, f, situation, choice, wi, "observed",
                                ("observe mode: proposed, not committed",), attempt)
        if self.mode is Mode.APPROVE:
            waiting = next((p for p in self._pending.values() if p.finding.id == f.id), None)
            if waiting is not None:  # the same finding again: one plan waits for it, not one per tick
                return self._finish(cid, f, situation, choice, wi, "pending-approval",
                                    (f"already waiting for an operator: {waiting.id}",), attempt)
            pid = f"plan-{cid}"
            self._pending[pid] = PendingPlan(pid, plan, f, wi, choice.trace.to_dict(),
                                             situation.version, self.cp.now(), cid)
            self._audit("await-approval", cid, pending=pid, plan=plan.id)
            return self._finish(cid, f, situation, choice, wi, "pending-approval",
                                (f"waiting for an operator: approve or reject {pid}",), attempt)
        if self._stopping.is_set():
            self._handled.pop(f.id, None)
            return self._finish(cid, f, situation, choice, wi, "nothing",
                                ("the agent stopped before acting",), attempt)
        conflicts = self._workflow_conflicts(plan)
        if conflicts:
            self._reason(cid, f, situation, choice, wi, "rejected", conflicts, attempt)
            feedback.append(Feedback(plan.id, "rejected", conflicts))
            return None
        result, workflow, notes = self._commit(plan, situation.version, cid, _rationale(choice))
        if result.accepted:
            return self._finish(cid, f, situation, choice, wi, "committed", notes, attempt,
                                version=result.version, workflow=workflow)
        reasons = tuple(result.reasons()) or ("rejected without a reason",)
        if _stale(result):
            # decided on a state that has moved on: not a verdict on the plan; leave the
            # finding out of its cooldown so the next analysis plans on fresh state
            self.stats.stale += 1
            self._handled.pop(f.id, None)
            self.analyzer.again(f.trigger)
            self._replan = True
            return self._finish(cid, f, situation, choice, wi, "stale",
                                (*reasons, "the next analysis plans again on the current state"),
                                attempt)
        self._reason(cid, f, situation, choice, wi, "rejected", reasons, attempt)
        feedback.append(Feedback(plan.id, "rejected", reasons))
        return None

    # ============================================================== execution
    def _workflow_conflicts(self, plan: CandidatePlan) -> tuple[str, ...]:
        """Reasons the plan's workflow could not be started after its actions commit
        (another workflow owns the same workloads): checked before anything is proposed."""
        if plan.workflow is None or self.workflows is None:
            return ()
        return tuple(self.workflows.conflicts(plan.workflow.kind, plan.workflow.params))

    def _commit(self, plan: CandidatePlan, version: int, cid: str,
                rationale: str) -> tuple[ApplyResult, str | None, tuple[str, ...]]:
        """Propose the plan's actions at ``version``; once accepted, start its workflow.

        Returns the control plane's answer, the workflow id (if one started) and notes."""
        result = self._propose(plan.actions, version, cid, rationale)
        req = plan.workflow
        if not result.accepted or req is None:
            return result, None, ()
        if self.workflows is None:
            return result, None, (
                f"no workflow runner attached: the runtime carries the {req.kind} through",)
        wid = f"{req.kind}-{cid}"  # deterministic in simulations; unique per agent run
        try:
            wf = self.workflows.start(req.kind, req.params, correlation_id=cid,
                                      workflow_id=wid if self.workflows.get(wid) is None else None)
        except WorkflowError as exc:
            self._audit("workflow", cid, plan=plan.id, kind=req.kind, started=False,
                        reason=str(exc))
            return result, None, (f"the {req.kind} workflow did not start: {exc}",)
        except Exception as exc:  # the store refused the workflow row: the actions stand
            log.exception("agent: workflow %s for %s did not start", req.kind, cid)
            self._audit("workflow", cid, plan=plan.id, kind=req.kind, started=False,
                        reason=f"{type(exc).__name__}: {exc}")
            return result, None, (f"the {req.kind} workflow did not start: {exc}",)
        self.stats.workflows += 1
        self._audit("workflow", cid, plan=plan.id, kind=wf.kind, started=True, workflow=wf.id,
                    params=dict(req.params))
        return result, wf.id, (f"carried through by the {wf.kind} workflow {wf.id}",)

    @staticmethod
    def _known_plan(choice: Choice, candidates: Sequence[CandidatePlan],
                    tools: AgentTools) -> CandidatePlan | None:
        """The chosen plan, if it is one the loop knows (a candidate or a tool proposal)."""
        if choice.plan is None:
            return None
        for p in [*candidates, *tools.proposals]:
            if p.id == choice.plan.id and p.actions == choice.plan.actions:
                return p
        return None

    def _reason(self, cid: str, f: Finding, situation: Situation, choice: Choice | None,
                wi: WhatIf | None, outcome: str, reasons: Sequence[str], attempt: int,
                version: int | None = None, workflow: str | None = None) -> None:
        w = f.subject if f.subject_kind == "workload" else None
        self._reason_record({
            "type": "agent-decision",
            "agent": self.name,
            "reasoner": self.reasoner.name,
            "mode": self.mode.value,
            "time": self.cp.now(),
            "version": situation.version,
            "correlation_id": cid,
            "workload": w,
            "finding": f.to_dict(),
            "candidates": [c.to_dict() for c in situation.candidates],
            "trace": choice.trace.to_dict() if choice is not None else None,
            "forecast": wi.to_dict() if wi is not None else None,
            "attempt": attempt,
            "outcome": outcome,
            "reasons": list(reasons),
            "committed_version": version,
            "workflow": workflow,
        })

    def _finish(self, cid: str, f: Finding, situation: Situation, choice: Choice | None,
                wi: WhatIf | None, outcome: str, reasons: Sequence[str], attempt: int,
                version: int | None = None, workflow: str | None = None) -> Outcome:
        self._reason(cid, f, situation, choice, wi, outcome, reasons, attempt, version, workflow)
        plan_id = choice.plan_id if choice is not None else None
        self._audit("execute", cid, finding=f.id, plan=plan_id, outcome=outcome,
                    reasons=list(reasons), committed_version=version, workflow=workflow)
        return Outcome(cid, f.id, outcome, plan_id, tuple(reasons), version, workflow)

    # =============================================================== approval
    def pending(self) -> list[dict[str, Any]]:
        with self.lock:
            return [p.to_dict() for p in self._pending.values()]

    def _take(self, plan_id: str) -> PendingPlan:
        p = self._pending.pop(plan_id, None)
        if p is None:
            known = ", ".join(self._pending) or "none"
            raise KeyError(f"no pending plan {plan_id!r}; pending: {known}")
        return p

    def approve(self, plan_id: str, *, actor: str = "operator") -> Outcome:
        """Commit a pending plan: re-forecast on today's state, propose it, start its workflow.

        The forecast runs on a snapshot with no lock held (an API request thread
        calls this); if the state moves on before the proposal, it is forecast
        again (up to ``max_attempts``)."""
        cfg = self.config
        with self._locked("approve"):
            p = self._take(plan_id)
            self._audit("approved", p.correlation_id, pending=plan_id, actor=actor)
        wi = p.whatif
        for attempt in range(1, cfg.max_attempts + 1):
            snap: Snapshot | None = None
            with self._locked("snapshot"):
                if cfg.whatif and (wi is None or wi.fork_version != self.cp.version):
                    snap = self._snapshot()
            if snap is not None:
                wi = self.whatif.at(snap).what_if(p.plan)  # no lock held
            with self._locked("act"):
                if cfg.whatif and wi is not None and not wi.better:
                    return self._decide_after_approval(p, wi, "not-better", (
                        f"approved by {actor}, but on the current state: {wi.summary}",
                        *wi.plan.rejections[:5]))
                conflicts = self._workflow_conflicts(p.plan)
                if conflicts:
                    return self._decide_after_approval(p, wi, "rejected", conflicts)
                version = wi.fork_version if cfg.whatif and wi is not None else self.cp.version
                result, workflow, notes = self._commit(
                    p.plan, version, p.correlation_id, f"approved by {actor}: " + p.plan.summary)
                if result.accepted:
                    return self._decide_after_approval(
                        p, wi, "committed", (f"approved by {actor}", *notes), result.version,
                        workflow)
                if not _stale(result) or attempt == cfg.max_attempts:
                    if _stale(result):
                        self.stats.stale += 1
                    return self._decide_after_approval(p, wi, "rejected", tuple(result.reasons()))
                self.stats.stale += 1
        raise AssertionError("unreachable")  # the last attempt always decides

    def reject(self, plan_id: str, reason: str = "", *, actor: str = "operator") -> Outcome:
        with self._locked("approve"):
            p = self._take(plan_id)
            why = f"rejected by {actor}" + (f": {reason}" if reason else "")
            self._operator_feedback.setdefault(p.finding.id, []).append(
                Feedback(p.plan.id, "operator-rejected", (why,)))
            self._handled.pop(p.finding.id, None)  # next round may offer another plan
            return self._decide_after_approval(p, p.whatif, "operator-rejected", (why,))

    def _decide_after_approval(self, p: PendingPlan, wi: WhatIf | None, outcome: str,
                               reasons: Sequence[str], version: int | None = None,
                               workflow: str | None = None) -> Outcome:
        rec = {
            "type": "agent-decision",
            "agent": self.name,
            "reasoner": self.reasoner.name,
            "mode": self.mode.value,
            "time": self.cp.now(),
            "version": self.cp.version,
            "correlation_id": p.correlation_id,
            "workload": p.finding.subject if p.finding.subject_kind == "workload" else None,
            "finding": p.finding.to_dict(),
            "candidates": [p.plan.to_dict()],
            "trace": p.trace,
            "forecast": wi.to_dict() if wi is not None else None,
            "attempt": 1,
            "outcome": outcome,
            "reasons": list(reasons),
            "committed_version": version,
            "workflow": workflow,
            "pending": p.id,
        }
        self._reason_record(rec)
        self._audit("execute", p.correlation_id, finding=p.finding.id, plan=p.plan.id,
                    outcome=outcome, reasons=list(reasons), committed_version=version,
                    workflow=workflow)
        out = Outcome(p.correlation_id, p.finding.id, outcome, p.plan.id, tuple(reasons), version,
                      workflow)
        self.outcomes.append(out)
        return out

    # ============================================================= background
    def start_background(self) -> None:
        """Run rounds on the agent's own thread, when :meth:`background_tick` asks."""
        if self._worker is not None:
            return
        self._stopping.clear()
        # forecasts on this thread must not starve the engine thread's database I/O
        self.whatif.pause = YieldGil()
        self._worker = threading.Thread(target=self._work, name=f"mlwe-{self.name}", daemon=True)
        self._worker.start()

    def background_tick(self) -> None:
        """The engine tick's share of a background agent (under the engine lock): note
        the tick, take in telemetry, and ask for a round when one is due. Cheap."""
        with self.lock:
            self.ticks += 1
            self.monitor.poll()
            if not self.busy and self._due(self.cp.now()):
                self._requested.set()

    @property
    def busy(self) -> bool:
        """A background round runs or is asked for."""
        return self._busy or self._requested.is_set()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no background round runs or is asked for (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while self.busy:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def _work(self) -> None:
        while True:
            self._requested.wait()
            if self._stopping.is_set():
                return
            self._busy = True
            self._requested.clear()
            try:
                self._round()
            except Exception:  # a failed round is logged; the next one may do better
                log.exception("agent %s: round failed", self.name)
            finally:
                self._busy = False

    def on_close(self, undo: Callable[[], None]) -> None:
        """Call ``undo`` (under the lock) when the agent closes: what wired it in."""
        self._detachers.append(undo)

    def close(self) -> None:
        """Stop the background thread (a round in progress finishes without acting), detach."""
        self._stopping.set()
        self._requested.set()
        if self._worker is not None:
            self._worker.join(timeout=60)
            self._worker = None
        self._requested.clear()
        self._busy = False
        with self.lock:
            self.monitor.detach()
            for undo in self._detachers:
                undo()
            self._detachers.clear()


def _rationale(choice: Choice) -> str:
    return "; ".join(choice.trace.why)[:2000]

