"""The loop on a bare control plane: modes, sinks, feedback, and safety against a
reasoner that makes things up."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from mlwe.agent.loop import Agent, AgentConfig
from mlwe.agent.model import CandidatePlan, Mode
from mlwe.agent.reasoners.base import Choice, ReasoningTrace, Situation
from mlwe.agent.tools import AgentTools
from mlwe.agent.whatif import state_digest
from mlwe.core import Action, ApplyResult, Cancel, ControlPlane, ManualClock, Rejection, State
from tests.agent.conftest import full_cluster


def agent_for(cp: ControlPlane, **kw: Any) -> tuple[Agent, list[dict[str, Any]], list[dict[str, Any]]]:
    audit: list[dict[str, Any]] = []
    reasoning: list[dict[str, Any]] = []
    a = Agent(cp, audit_sink=audit.append, reasoning_sink=reasoning.append, **kw)
    return a, audit, reasoning


def test_autonomous_commits_a_verified_better_plan(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    agent, audit, reasoning = agent_for(cp)
    out = [o for o in agent.tick() if o.finding == "deadline-at-risk:ft"]
    assert [o.outcome for o in out] == ["committed"]
    assert cp.get("ft").priority == 51
    victims = [w.id for w in cp.workloads.values() if w.state is State.PREEMPTING]
    assert len(victims) == 2 and all(cp.get(v).preempted_by == "ft" for v in victims)
    assert cp.validate_state() == []
    cid = out[0].correlation_id
    steps = [r["step"] for r in audit if r["correlation_id"] == cid]
    assert steps == ["analyze", "plan", "reason", "what-if", "proposal", "execute"]
    rec = next(r for r in reasoning if r["correlation_id"] == cid)
    trace = rec["trace"]
    assert trace["reasoner"] == "rules" and trace["chose"] == out[0].plan
    assert trace["saw"] and trace["why"] and trace["weights"]["forecast_gain"] > 0
    chosen = next(c for c in trace["considered"] if c["plan_id"] == out[0].plan)
    assert set(chosen["contributions"]) >= {"benefit", "cost", "risk", "forecast_gain"}
    fc = rec["forecast"]
    assert fc["better"] and fc["plan"]["kpis"]["deadlines_missed"] == 0
    assert fc["nothing"]["kpis"]["deadlines_missed"] == 1
    # the decision was applied under the cause id of the agent's correlation id
    assert cp.get("ft").history[-1].target is State.PENDING  # still waiting for the victims


def test_observe_mode_never_commits(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    before = state_digest(cp)
    agent, audit, reasoning = agent_for(cp, mode=Mode.OBSERVE)
    out = agent.tick()
    assert "observed" in {o.outcome for o in out}
    assert state_digest(cp) == before
    assert not any(r["step"] == "proposal" for r in audit)
    assert any(r["outcome"] == "observed" and r["forecast"]["better"] for r in reasoning)


def test_approve_mode_waits_for_an_operator(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    before = state_digest(cp)
    agent, audit, _ = agent_for(cp, mode="approve")
    out = agent.tick()
    assert "pending-approval" in {o.outcome for o in out}
    assert state_digest(cp) == before
    pending = agent.pending()
    assert len(pending) == 1 and pending[0]["forecast"]["better"]
    got = agent.approve(pending[0]["id"], actor="alice")
    assert got.outcome == "committed" and cp.get("ft").priority == 51
    assert agent.pending() == []
    assert any(r["step"] == "approved" and r["actor"] == "alice" for r in audit)
    with pytest.raises(KeyError, match="no pending plan"):
        agent.approve(pending[0]["id"])


def test_an_operator_rejection_comes_back_to_the_reasoner(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, clock = sla
    before = state_digest(cp)
    agent, _, reasoning = agent_for(cp, mode=Mode.APPROVE)
    agent.tick()
    pid = agent.pending()[0]["id"]
    plan_id = agent.pending()[0]["plan"]["id"]
    assert agent.reject(pid, "not during the demo").outcome == "operator-rejected"
    assert state_digest(cp) == before
    clock.advance(301)  # the deadline trigger runs every 5 minutes
    agent.tick()
    rec = [r for r in reasoning if r["finding"]["id"] == "deadline-at-risk:ft"][-1]
    assert rec["outcome"] == "nothing"
    tried = next(c for c in rec["trace"]["considered"] if c["plan_id"] == plan_id)
    assert tried["verdict"] == "already tried: operator-rejected"
    assert agent.pending() == []  # the only plan was refused: nothing else to offer


def test_control_plane_rejections_come_back_with_reasons(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    before = state_digest(cp)

    def always_refused(actions: Sequence[Action], v: int | None, cid: str, why: str) -> ApplyResult:
        rej = Rejection(0, actions[0].kind, "ft", ("quota: queue default is over its limit",))
        return ApplyResult(False, cp.version, (rej,))

    agent, _, reasoning = agent_for(cp, propose=always_refused)
    out = [o for o in agent.tick() if o.finding == "deadline-at-risk:ft"]
    recs = [r for r in reasoning if r["finding"]["id"] == "deadline-at-risk:ft"]
    assert recs[0]["outcome"] == "rejected" and "over its limit" in recs[0]["reasons"][0]
    # the reasoner saw the rejection and did not choose the same plan again
    assert "already tried: rejected" in {c["verdict"] for c in recs[1]["trace"]["considered"]}
    assert any("earlier in this round" in s for s in recs[1]["trace"]["saw"])
    assert out[0].outcome == "nothing"
    assert state_digest(cp) == before


def test_a_stale_proposal_is_planned_again_on_fresh_state(
    sla: tuple[ControlPlane, ManualClock],
) -> None:
    """Decided on a version the state has left: not a verdict on the plan; the finding
    stays out of its cooldown and the next analysis decides again, at the new version."""
    cp, clock = sla
    seen: list[int | None] = []

    def stale_once(actions: Sequence[Action], v: int | None, cid: str, why: str) -> ApplyResult:
        seen.append(v)
        if len(seen) == 1:
            rej = Rejection(-1, "batch", "-", (f"stale version: decided on {v}, state is at {v + 1}",))  # type: ignore[operator]
            return ApplyResult(False, cp.version, (rej,))
        return cp.apply(list(actions), v, cause_id=cid)

    agent, _, _ = agent_for(cp, propose=stale_once, config=AgentConfig(min_interval_s=0))
    first = [o for o in agent.tick() if o.finding == "deadline-at-risk:ft"]
    assert first[0].outcome == "stale" and "stale version" in first[0].reasons[0]
    assert cp.get("ft").priority == 50 and agent.stats.stale == 1
    clock.advance(agent.config.analysis_interval_s)
    again = [o for o in agent.tick() if o.finding == "deadline-at-risk:ft"]
    assert again[0].outcome == "committed" and cp.get("ft").priority == 51
    assert seen == [cp.version - 1, cp.version - 1]  # both decided on the state of their time


class Fabricator:
    """A stand-in for a misbehaving LLM reasoner: returns a plan nobody offered."""

    name = "fabricator"

    def choose(self, situation: Situation, tools: AgentTools) -> Choice:
        fake = CandidatePlan("made-up", "none", (), (Cancel("train-0"), Cancel("train-1")),
                             "cancel everything")
        return Choice(fake, ReasoningTrace(self.name, (), (), fake.id, ("trust me",)))


class OwnPlan:
    """A stand-in reasoner that composes its own plan through the propose tool."""

    name = "own-plan"

    def choose(self, situation: Situation, tools: AgentTools) -> Choice:
        r = tools.call("propose", {"rationale": "raise and preempt", "actions": [
            {"kind": "set-priority", "workload": "ft", "priority": 60},
            {"kind": "preempt", "victim": "train-2", "preemptor": "ft"},
            {"kind": "preempt", "victim": "train-3", "preemptor": "ft"}]})
        assert r["ok"], r
        plan = tools.proposed()
        return Choice(plan, ReasoningTrace(self.name, (), (), plan.id if plan else "nothing",
                                           ("composed",), tool_calls=tuple(tools.calls)))


def test_a_plan_nobody_offered_is_never_executed(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    before = state_digest(cp)
    agent, _, reasoning = agent_for(cp, reasoner=Fabricator())  # type: ignore[arg-type]
    out = agent.tick()
    assert {o.outcome for o in out} == {"nothing"}
    assert state_digest(cp) == before
    assert any("neither a candidate nor proposed" in " ".join(r["reasons"]) for r in reasoning)


def test_a_plan_composed_through_the_tools_is_forecast_then_committed(
    sla: tuple[ControlPlane, ManualClock],
) -> None:
    cp, _ = sla
    agent, _, reasoning = agent_for(cp, reasoner=OwnPlan())  # type: ignore[arg-type]
    out = [o for o in agent.tick() if o.finding == "deadline-at-risk:ft"]
    assert out[0].outcome == "committed" and cp.get("ft").priority == 60
    assert {cp.get("train-2").state, cp.get("train-3").state} == {State.PREEMPTING}
    rec = next(r for r in reasoning if r["correlation_id"] == out[0].correlation_id)
    assert rec["forecast"]["better"] and rec["trace"]["tool_calls"][0]["tool"] == "propose"


def test_a_finding_acted_on_is_left_alone_during_its_cooldown(
    sla: tuple[ControlPlane, ManualClock],
) -> None:
    cp, clock = sla
    agent, _, _ = agent_for(cp, mode=Mode.OBSERVE, config=AgentConfig(min_interval_s=0))
    first = agent.tick()
    clock.advance(60)
    again = agent.tick()
    assert first and not {o.finding for o in again} & {o.finding for o in first}


def test_the_rules_reasoner_is_deterministic() -> None:
    traces = []
    for _ in range(2):
        cp, _ = full_cluster()
        agent, _, reasoning = agent_for(cp, mode=Mode.OBSERVE)
        agent.tick()
        traces.append([(r["trace"], r["forecast"]) for r in reasoning])
    assert traces[0] == traces[1]


def test_unknown_reasoner_is_refused(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    with pytest.raises(ValueError, match="unknown reasoner 'oracle'"):
        Agent(cp, reasoner="oracle")
