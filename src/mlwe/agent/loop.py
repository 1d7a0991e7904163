"""The MAPE loop: monitor, analyze, plan, execute; every step audited and streamed.

``Agent.tick()`` is one pass: the monitor takes in telemetry and lifecycle
events; the triggers whose schedule is due look for findings; for each
finding (most severe first) the strategies build candidate plans, the
reasoner chooses one and explains itself, the what-if engine plays the plan
and doing nothing forward on a fork of the state, and a plan that is
verified and better is executed according to the mode:

- ``autonomous``: proposed to the control plane at the version it was decided
  on (``expected_version``); a rejection goes back to the reasoner with its
  reasons, which may choose another plan (up to ``max_attempts``);
- ``approve``: it waits for an operator (:meth:`Agent.pending`,
  :meth:`Agent.approve`, :meth:`Agent.reject`); approval re-runs the what-if on
  the state of that moment before proposing;
- ``observe``: it is recorded as a proposal and never committed.

The agent never changes state except through the ``propose`` sink, which by
default is ``ControlPlane.apply`` (the runtime passes ``Engine.propose``).
Every step yields an audit record (``audit_sink``) and every decision a
reasoning record (``reasoning_sink``), both plain JSON-able dicts.

Wiring into the runtime (``mlwe.runtime.Engine``)::

    agent = Agent(engine.cp, lock=engine.lock,
                  propose=lambda acts, v, cid, why: engine.propose(
                      acts, actor="agent", expected_version=v, correlation_id=cid,
                      rationale=why),
                  reasoning_sink=lambda r: engine.record_reasoning(
                      r, correlation_id=r["correlation_id"]),
                  audit_sink=...)
    engine.telemetry_listeners.append(lambda s: agent.observe([s]))
    engine.tick_hooks.append(lambda e: agent.tick())

which is what :func:`attach` does (the engine is duck-typed: the agent does not
import the runtime, an outer layer).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlwe.agent.codec import AGENT_ACTION_KINDS, action_to_dict
from mlwe.agent.model import CandidatePlan, Finding, Hazard, Mode, WhatIf, json_dict
from mlwe.agent.monitor import Monitor
from mlwe.agent.reasoners import make_reasoner
from mlwe.agent.reasoners.base import Choice, Feedback, Reasoner, Situation
from mlwe.agent.strategies import Strategy, default_strategies, hazards_for
from mlwe.agent.telemetry import TelemetryWindow
from mlwe.agent.tools import AgentTools
from mlwe.agent.triggers import AnalyzeConfig, Analyzer, Context, Trigger, default_triggers
from mlwe.agent.whatif import WhatIfConfig, WhatIfEngine
from mlwe.core.actions import Action
from mlwe.core.backend import Telemetry
from mlwe.core.controlplane import ApplyResult, ControlPlane
from mlwe.core.model import Workload
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import WorkloadSpec

#: (actions, expected_version, correlation_id, rationale) -> the control plane's answer
ProposeFn = Callable[[Sequence[Action], int | None, str, str], ApplyResult]
Sink = Callable[[dict[str, Any]], None]


@dataclass
class AgentConfig:
    mode: Mode = Mode.AUTONOMOUS
    #: at most one analysis per this many seconds (engine clock), news or not
    min_interval_s: float = 30.0
    #: after a decision about a finding, leave it alone this long (unless it changes)
    cooldown_s: float = 1800.0
    max_attempts: int = 3  # plans tried per finding per round (feedback loop)
    max_findings_per_tick: int = 8
    whatif: bool = True  # forecast before commit (off: verified plans commit as chosen)
    node_failure_after_s: float = 1800.0  # assumed time to failure of an unhealthy node
    stream_lookback_s: float = 3 * 3600.0  # recurring arrivals: the window looked at
    stream_min: int = 3  # arrivals of one (queue, priority) in the window to call it a stream
    stream_max: int = 500  # expected arrivals played in one forecast, at most
    analyze: AnalyzeConfig = field(default_factory=AnalyzeConfig)
    forecast: WhatIfConfig = field(default_factory=WhatIfConfig)


@dataclass
class Outcome:
    """What became of one finding in one round."""

    correlation_id: str
    finding: str
    outcome: str  # committed | rejected | not-better | pending-approval | observed | nothing | gave-up | approved | operator-rejected
    plan: str | None = None
    reasons: tuple[str, ...] = ()
    version: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"correlation_id": self.correlation_id, "finding": self.finding,
                "outcome": self.outcome, "plan": self.plan, "reasons": list(self.reasons),
                "version": self.version}


@dataclass
class PendingPlan:
    id: str
    plan: CandidatePlan
    finding: Finding
    whatif: WhatIf | None
    trace: dict[str, Any]
    version: int
    created: float
    correlation_id: str

    def to_dict(self) -> dict[str, Any]:
        return json_dict({
            "id": self.id,
            "plan": self.plan.to_dict(),
            "finding": self.finding.to_dict(),
            "forecast": self.whatif.to_dict() if self.whatif else None,
            "trace": self.trace,
            "version": self.version,
            "created": self.created,
            "correlation_id": self.correlation_id,
        })


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
    ) -> None:
        self.cp = cp
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
        self.whatif = WhatIfEngine(cp, config=self.config.forecast,
                                   scheduler_factory=scheduler_factory,
                                   hazards=lambda: self._hazards,
                                   arrivals=self.arrival_pattern)
        self._propose = propose or self._apply
        self.audit_sink = audit_sink
        self.reasoning_sink = reasoning_sink
        self.lock = lock if lock is not None else threading.RLock()
        self._seq = itertools.count(1)
        self._last_analysis: float | None = None
        self._handled: dict[str, tuple[float, Any]] = {}
        self._operator_feedback: dict[str, list[Feedback]] = {}
        self._pending: dict[str, PendingPlan] = {}
        self.records: deque[dict[str, Any]] = deque(maxlen=2000)  # recent reasoning records
        self.audit: deque[dict[str, Any]] = deque(maxlen=5000)  # recent audit records
        self.outcomes: list[Outcome] = []
        self.ticks = 0
        self.analyses = 0
        self._detachers: list[Callable[[], None]] = []

    @property
    def mode(self) -> Mode:
        return self.config.mode

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
    def tick(self) -> list[Outcome]:
        """One monitor-analyze-plan-execute pass; returns what became of each finding."""
        with self.lock:
            self.ticks += 1
            now = self.cp.now()
            self.monitor.poll()
            # lifecycle events are analysed at once (a failure waits for its retry only
            # briefly); telemetry and timers at most every min_interval_s
            if (
                self._last_analysis is not None
                and now - self._last_analysis < self.config.min_interval_s
                and not self.monitor.new_events
            ):
                return []
            self._last_analysis = now
            self.monitor.refresh()
            events, samples, _kinds = self.monitor.take_news()
            ctx = Context(self.cp, self.monitor, self.scheduler, self.config.analyze)
            findings, ran = self.analyzer.run(ctx, samples, events)
            if not ran:
                return []
            self.analyses += 1
            self.monitor.forget_finished()
            findings.sort(key=lambda f: (-f.severity, f.id))
            self._hazards = [h for f in findings
                             for h in hazards_for(f, ctx, self.config.node_failure_after_s)]
            out: list[Outcome] = []
            for f in findings:
                if len(out) >= self.config.max_findings_per_tick:
                    break
                if self._cooling(f, now):
                    continue
                out.append(self._handle(f, ctx))
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

    def _handle(self, f: Finding, ctx: Context) -> Outcome:
        cid = f"{self.name}-{next(self._seq)}"
        now = self.cp.now()
        self._handled[f.id] = (now, self._revision(f))
        self._audit("analyze", cid, finding=f.to_dict())
        candidates = self._candidates(f, ctx)
        self._audit("plan", cid, finding=f.id, candidates=[c.to_dict() for c in candidates])
        feedback: list[Feedback] = list(self._operator_feedback.get(f.id, ()))
        for attempt in range(1, self.config.max_attempts + 1):
            version = self.cp.version
            situation = Situation(now, version, self.mode, (f,), tuple(candidates), tuple(feedback))
            tools = AgentTools(self.cp, telemetry=self.monitor.telemetry, candidates=candidates,
                               findings=(f,), forecaster=self.whatif if self.config.whatif else None,
                               scheduler=self.scheduler)
            choice = self.reasoner.choose(situation, tools)
            plan = self._known_plan(choice, candidates, tools)
            self._audit("reason", cid, finding=f.id, attempt=attempt, chose=choice.trace.chose,
                        reasoner=self.reasoner.name)
            reasons: tuple[str, ...]
            if plan is None:
                reasons = () if choice.plan is None else (
                    f"the reasoner chose {choice.plan.id!r}, which is neither a candidate nor"
                    " proposed through the tools",)
                return self._finish(cid, f, situation, choice, None, "nothing", reasons, attempt)
            wi: WhatIf | None = None
            if self.config.whatif:
                wi = tools.forecasts.get(plan.id)
                if wi is None or wi.fork_version != self.cp.version:
                    wi = self.whatif.what_if(plan)
                self._audit("what-if", cid, plan=plan.id, better=wi.better, summary=wi.summary,
                            plan_score=wi.plan.score, nothing_score=wi.nothing.score)
                if not wi.better:
                    outcome = "not-verified" if not wi.plan.verified else "not-better"
                    reasons = (wi.summary, *wi.plan.rejections[:5])
                    self._reason(cid, f, situation, choice, wi, outcome, reasons, attempt)
                    feedback.append(Feedback(plan.id, outcome, reasons))
                    continue
            if self.mode is Mode.OBSERVE:
                return self._finish(cid, f, situation, choice, wi, "observed",
                                    ("observe mode: proposed, not committed",), attempt)
            if self.mode is Mode.APPROVE:
                pid = f"plan-{cid}"
                self._pending[pid] = PendingPlan(pid, plan, f, wi, choice.trace.to_dict(),
                                                 self.cp.version, now, cid)
                self._audit("await-approval", cid, pending=pid, plan=plan.id)
                return self._finish(cid, f, situation, choice, wi, "pending-approval",
                                    (f"waiting for an operator: approve or reject {pid}",), attempt)
            result = self._propose(plan.actions, self.cp.version, cid, _rationale(choice))
            if result.accepted:
                return self._finish(cid, f, situation, choice, wi, "committed", (), attempt,
                                    version=result.version)
            reasons = tuple(result.reasons()) or ("rejected without a reason",)
            self._reason(cid, f, situation, choice, wi, "rejected", reasons, attempt)
            feedback.append(Feedback(plan.id, "rejected", reasons))
        return self._finish(cid, f, situation, None, None, "gave-up",
                            tuple(f"{fb.plan_id}: {fb.outcome}" for fb in feedback), attempt)

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
                version: int | None = None) -> None:
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
        })

    def _finish(self, cid: str, f: Finding, situation: Situation, choice: Choice | None,
                wi: WhatIf | None, outcome: str, reasons: Sequence[str], attempt: int,
                version: int | None = None) -> Outcome:
        self._reason(cid, f, situation, choice, wi, outcome, reasons, attempt, version)
        plan_id = choice.plan_id if choice is not None else None
        self._audit("execute", cid, finding=f.id, plan=plan_id, outcome=outcome,
                    reasons=list(reasons), committed_version=version)
        return Outcome(cid, f.id, outcome, plan_id, tuple(reasons), version)

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
        """Commit a pending plan: re-forecast on today's state, then propose it."""
        with self.lock:
            p = self._take(plan_id)
            self._audit("approved", p.correlation_id, pending=plan_id, actor=actor)
            wi = p.whatif
            if self.config.whatif:
                wi = self.whatif.what_if(p.plan) if (
                    wi is None or wi.fork_version != self.cp.version) else wi
                if not wi.better:
                    return self._decide_after_approval(p, wi, "not-better", (
                        f"approved by {actor}, but on the current state: {wi.summary}",
                        *wi.plan.rejections[:5]))
            result = self._propose(p.plan.actions, self.cp.version, p.correlation_id,
                                   f"approved by {actor}: " + p.plan.summary)
            if result.accepted:
                return self._decide_after_approval(p, wi, "committed", (f"approved by {actor}",),
                                                   result.version)
            return self._decide_after_approval(p, wi, "rejected", tuple(result.reasons()))

    def reject(self, plan_id: str, reason: str = "", *, actor: str = "operator") -> Outcome:
        with self.lock:
            p = self._take(plan_id)
            why = f"rejected by {actor}" + (f": {reason}" if reason else "")
            self._operator_feedback.setdefault(p.finding.id, []).append(
                Feedback(p.plan.id, "operator-rejected", (why,)))
            self._handled.pop(p.finding.id, None)  # next round may offer another plan
            return self._decide_after_approval(p, p.whatif, "operator-rejected", (why,))

    def _decide_after_approval(self, p: PendingPlan, wi: WhatIf | None, outcome: str,
                               reasons: Sequence[str], version: int | None = None) -> Outcome:
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
            "pending": p.id,
        }
        self._reason_record(rec)
        self._audit("execute", p.correlation_id, finding=p.finding.id, plan=p.plan.id,
                    outcome=outcome, reasons=list(reasons), committed_version=version)
        out = Outcome(p.correlation_id, p.finding.id, outcome, p.plan.id, tuple(reasons), version)
        self.outcomes.append(out)
        return out

    def close(self) -> None:
        self.monitor.detach()
        for undo in self._detachers:
            undo()
        self._detachers.clear()


def _rationale(choice: Choice) -> str:
    return "; ".join(choice.trace.why)[:2000]


def attach(
    engine: Any,
    *,
    mode: Mode | str = Mode.AUTONOMOUS,
    reasoner: Reasoner | str | None = None,
    config: AgentConfig | None = None,
    name: str = "agent",
) -> Agent:
    """An agent driving a runtime engine (``mlwe.runtime.Engine``, duck-typed).

    Proposals go through ``engine.propose`` (verified, applied or rejected, and
    audited by the engine), reasoning records through
    ``engine.record_reasoning`` (stored, chained in the audit log, streamed on
    "reasoning"), the other steps into the engine's audit; the agent takes
    telemetry from ``engine.telemetry_listeners`` and ticks in
    ``engine.tick_hooks`` under the engine lock. ``agent.close()`` detaches it.
    """

    def propose(actions: Sequence[Action], version: int | None, cid: str, why: str) -> ApplyResult:
        result: ApplyResult = engine.propose(
            actions, actor=name, expected_version=version, correlation_id=cid, rationale=why
        )
        return result

    def reasoning(rec: dict[str, Any]) -> None:
        engine.record_reasoning(rec, correlation_id=rec.get("correlation_id"), actor=name)

    def audit(rec: dict[str, Any]) -> None:
        engine.writer.note_audit(
            "agent", name, rec, workload=None, correlation_id=rec.get("correlation_id")
        )

    agent = Agent(engine.cp, reasoner=reasoner, mode=mode, config=config, propose=propose,
                  reasoning_sink=reasoning, audit_sink=audit, lock=engine.lock, name=name)

    def on_sample(sample: Telemetry) -> None:
        agent.observe([sample])

    def on_tick(_engine: Any) -> None:
        agent.tick()

    engine.telemetry_listeners.append(on_sample)
    engine.tick_hooks.append(on_tick)
    agent._detachers += [
        lambda: engine.telemetry_listeners.remove(on_sample),
        lambda: engine.tick_hooks.remove(on_tick),
    ]
    return agent
