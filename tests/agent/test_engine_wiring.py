"""The agent wired into the runtime engine with ``attach``: proposals audited by the
engine, reasoning stored and chained, approvals through the same path; its preemption
plans carried through by reschedule workflows; in background mode, deliberation with
the engine lock free, and a decision the state has left behind rejected as stale."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from mlwe.agent.loop import Agent
from mlwe.agent.model import Mode
from mlwe.agent.reasoners.base import Choice, Situation
from mlwe.agent.reasoners.rules import RulesReasoner
from mlwe.agent.tools import AgentTools
from mlwe.agent.workflows import WorkflowStatus
from mlwe.core.actions import Exited
from mlwe.core.backend import Command, Event, StartCommand
from mlwe.core.clock import ManualClock
from mlwe.core.lifecycle import State
from mlwe.core.scheduler import Scheduler, SchedulerConfig
from mlwe.core.spec import ClusterSpec, NodePool, WorkloadSpec
from mlwe.runtime import Engine, LiveSimBackend
from mlwe.runtime.wiring import attach_agent as attach
from mlwe.store.audit import AuditLog
from tests.core.builders import tick_until


def _spec(**kw: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate(kw)


class RefusingSim(LiveSimBackend):
    """The live simulated backend, except that starts of ``refuse`` fail (a TEST DOUBLE
    for what a real backend reports when an image cannot be pulled)."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.refuse: set[str] = set()
        self._out: list[Event] = []

    def send(self, commands: Sequence[Command]) -> None:
        passed = []
        for c in commands:
            if isinstance(c, StartCommand) and c.workload in self.refuse:
                self._out.append(Event(f"refused:{c.request_id}", self.clock.now(),
                                       Exited(c.workload, c.attempt, 127, "start-failed")))
            else:
                passed.append(c)
        super().send(passed)

    def poll(self) -> list[Event]:
        out, self._out = self._out, []
        return out + super().poll()


def engine_with_sla(
    tmp_path: Path, backend: LiveSimBackend | None = None, scheduler: Scheduler | None = None,
    clock: ManualClock | None = None,
) -> tuple[Engine, ManualClock]:
    clock = clock or ManualClock(0.0)
    cluster = ClusterSpec(pools=(NodePool(prefix="g", count=2, gpu_model="A100-80GB", gpus=8,
                                          cpu=64, memory="512Gi"),))
    # the plain scheduler (no preemption among equals): the SLA job's wait is the agent's
    # to resolve here; the engine's default would preempt for it by itself, for gain
    eng = Engine.open(cluster, backend or LiveSimBackend(clock), data_dir=tmp_path, clock=clock,
                      scheduler=scheduler or Scheduler())
    eng.submit([_spec(id=f"train-{i}", name=f"train {i}", kind="training",
                      resources={"gpu": 4, "cpu": 8, "memory": "64Gi"},
                      estimated_duration="6h", checkpoint_interval="15m") for i in range(4)],
               actor="test")
    for _ in range(3):
        eng.tick()
        clock.advance(1.0)
    assert all(eng.cp.get(f"train-{i}").state is State.RUNNING for i in range(4))
    clock.advance(1800)
    eng.tick()
    eng.submit([_spec(id="ft", name="sla fine-tune", kind="fine-tune",
                      resources={"gpu": 8, "cpu": 16, "memory": "128Gi"},
                      estimated_duration="2h", deadline_in="3h", checkpoint_interval="15m")],
               actor="test")
    return eng, clock


def test_attached_agent_proposes_through_the_engine(tmp_path: Path) -> None:
    eng, _ = engine_with_sla(tmp_path)
    agent = attach(eng, mode="autonomous", background=False)
    eng.tick()
    assert eng.cp.get("ft").priority == 51
    committed = [o for o in agent.outcomes if o.outcome == "committed"]
    assert committed
    cid = committed[0].correlation_id
    audit = AuditLog(eng.repo.engine)
    proposals = audit.show(correlation_id=cid, kind="proposal")
    assert [(e.actor, '"accepted":true' in e.payload) for e in proposals] == [("agent", True)]
    steps = [e.payload for e in audit.show(correlation_id=cid, kind="agent")]
    assert any('"step":"what-if"' in p for p in steps) and any('"step":"plan"' in p for p in steps)
    stored = eng.repo.reasoning(correlation_id=cid)
    assert stored and stored[-1].record["outcome"] == "committed"
    assert stored[-1].record["forecast"]["better"] is True
    assert audit.verify().ok
    agent.close()
    assert not eng.tick_hooks and not eng.telemetry_listeners
    eng.close()


def test_approve_mode_through_the_engine(tmp_path: Path) -> None:
    eng, _ = engine_with_sla(tmp_path)
    agent = attach(eng, mode=Mode.APPROVE, background=False)
    v = eng.cp.version
    eng.tick()
    assert eng.cp.get("ft").priority == 50
    assert eng.workflows.workflows() == []  # nothing starts before an operator approves
    (pending,) = agent.pending()
    assert pending["plan"]["workflow"]["kind"] == "reschedule"
    out = agent.approve(pending["id"], actor="alice")
    assert out.outcome == "committed" and eng.cp.get("ft").priority == 51 and eng.cp.version > v
    (wf,) = eng.workflows.workflows()
    assert wf.id == out.workflow and wf.correlation_id == pending["correlation_id"]
    agent.close()
    eng.close()


def test_observe_mode_through_the_engine_starts_nothing(tmp_path: Path) -> None:
    eng, _ = engine_with_sla(tmp_path)
    agent = attach(eng, mode=Mode.OBSERVE, background=False)
    eng.tick()
    assert "observed" in {o.outcome for o in agent.outcomes}
    assert eng.cp.get("ft").priority == 50 and eng.workflows.workflows() == []
    assert not eng.audit.show(kind="proposal")
    agent.close()
    eng.close()


def test_the_preemption_plan_runs_as_a_reschedule_workflow(tmp_path: Path) -> None:
    eng, clock = engine_with_sla(tmp_path)
    agent = attach(eng, background=False)
    eng.tick()
    (out,) = [o for o in agent.outcomes if o.outcome == "committed"]
    wf = eng.workflows.get(out.workflow)
    assert wf is not None and wf.kind == "reschedule"
    assert wf.correlation_id == out.correlation_id and wf.id == f"reschedule-{out.correlation_id}"
    victims = wf.params["victims"]
    assert len(victims) == 2 and all(eng.cp.get(v).preempted_by == "ft" for v in victims)
    tick_until(eng, clock, lambda: not wf.active)
    assert wf.status == WorkflowStatus.DONE, wf.log
    assert [e["step"] for e in wf.events("step-done")] == [
        "checkpoint", "wait_checkpoint", "confirm_release", "place", "start"]
    assert eng.cp.get("ft").state is State.RUNNING
    eng.tick()  # the hook stores the workflow's last step
    # one correlation id from the decision to the running preemptor
    cid = out.correlation_id
    (rec,) = [r.record for r in eng.repo.reasoning(correlation_id=cid)]
    assert rec["outcome"] == "committed" and rec["workflow"] == wf.id
    kinds = {e.kind for e in eng.audit.show(correlation_id=cid)}
    assert {"agent", "proposal", "workflow"} <= kinds
    assert all(t.cause_id == cid for v in victims
               for t in eng.cp.get(v).history if t.target is State.PREEMPTING)
    assert eng.audit.verify().ok
    agent.close()
    assert not eng.tick_hooks and eng.workflows is None
    eng.close()


def test_the_victims_are_resumed_when_the_preemptor_cannot_start(tmp_path: Path) -> None:
    clock = ManualClock(0.0)
    backend = RefusingSim(clock)
    backend.refuse.add("ft")
    eng, _ = engine_with_sla(tmp_path, backend, clock=clock,
                             scheduler=Scheduler(config=SchedulerConfig(preemption=False)))
    agent = attach(eng, background=False)
    eng.tick()
    (out,) = [o for o in agent.outcomes if o.outcome == "committed"]
    wf = eng.workflows.get(out.workflow)
    assert wf is not None
    victims = wf.params["victims"]
    placed = {v: eng.cp.get(v).placement for v in victims}
    tick_until(eng, clock, lambda: not wf.active)
    assert wf.status == WorkflowStatus.COMPENSATED, wf.log
    assert "start-failed" in wf.data["error"]
    tick_until(eng, clock, lambda: all(eng.cp.get(v).state is State.RUNNING for v in victims), 60)
    for v in victims:  # back where they were, from their checkpoints
        w = eng.cp.get(v)
        assert w.placement == placed[v] and w.attempt == 2 and w.work_done > 0
    assert eng.workflows.alerts[-1].severity == "warning"
    agent.close()
    eng.close()


class InterferingRules:
    """The rules reasoner, plus a side effect on its first call (a stand-in for a slow
    reasoner while the cluster moves on): from another thread, it submits a workload and
    ticks the engine, which needs the engine lock; that thread must finish while the
    agent is still deliberating."""

    name = "rules"

    def __init__(self, eng: Engine) -> None:
        self.inner = RulesReasoner()
        self.eng = eng
        self.calls = 0
        self.other_thread_done: bool | None = None

    def choose(self, situation: Situation, tools: AgentTools) -> Choice:
        self.calls += 1
        if self.calls == 1:
            def other() -> None:
                self.eng.submit([_spec(id="late", name="late etl",
                                       resources={"cpu": 2, "memory": "4Gi"})], actor="test")
                self.eng.tick()

            t = threading.Thread(target=other)
            t.start()
            t.join(timeout=30)
            self.other_thread_done = not t.is_alive()
        return self.inner.choose(situation, tools)


def test_in_the_background_the_engine_ticks_while_the_agent_deliberates(tmp_path: Path) -> None:
    eng, clock = engine_with_sla(tmp_path)
    reasoner = InterferingRules(eng)
    agent: Agent = attach(eng, reasoner=reasoner)  # type: ignore[arg-type]
    assert agent._worker is not None and agent._worker.is_alive()
    eng.tick()  # the tick only asks for a round; the agent's thread runs it
    assert agent.wait_idle(60)
    assert reasoner.other_thread_done is True  # the engine lock was free meanwhile
    (first,) = [o for o in agent.outcomes if o.finding == "deadline-at-risk:ft"]
    assert first.outcome == "stale" and "stale version" in first.reasons[0]
    rejected = [e.data() for e in eng.audit.show(correlation_id=first.correlation_id,
                                                 kind="proposal")]
    assert [(r["accepted"], "stale version" in r["reasons"][0]) for r in rejected] == [
        (False, True)]
    assert eng.cp.get("ft").priority == 50  # nothing applied
    # the next analysis plans again on the current state, and commits
    clock.advance(agent.config.analysis_interval_s)
    eng.tick()
    assert agent.wait_idle(60)
    outcomes = [o.outcome for o in agent.outcomes if o.finding == "deadline-at-risk:ft"]
    assert outcomes == ["stale", "committed"] and eng.cp.get("ft").priority == 51
    assert agent.stats.stale == 1 and agent.stats.workflows == 1
    worker = agent._worker
    agent.close()
    assert worker is not None and not worker.is_alive()
    eng.close()


def test_a_raised_memory_request_survives_a_restart(tmp_path: Path) -> None:
    """SetResources changes the stored spec too: a restarted engine keeps the new request."""
    from mlwe.core.actions import Exited, Retry, SetResources
    from mlwe.core.spec import ReplicaResources

    clock = ManualClock(0.0)
    cluster = ClusterSpec(pools=(NodePool(prefix="c", count=1, cpu=32, memory="256Gi"),))
    eng = Engine.open(cluster, LiveSimBackend(clock), data_dir=tmp_path, clock=clock)
    eng.submit([_spec(id="etl", name="etl", resources={"cpu": 4, "memory": "16Gi"})], actor="t")
    eng.tick()
    clock.advance(1.0)
    eng.tick()
    w = eng.cp.get("etl")
    eng.propose([Exited("etl", w.attempt, 137, "oom")], actor="test")  # a stand-in OOM kill
    new = ReplicaResources.model_validate({"cpu": 4, "memory": "24Gi"})
    r = eng.propose([SetResources("etl", new, "oom"), Retry("etl")], actor="agent")
    assert r.accepted, r.reasons()
    eng.close()
    again = Engine.open(None, LiveSimBackend(clock), data_dir=tmp_path, clock=clock)
    assert again.cp.get("etl").spec.resources.memory == 24 * 1024
    again.close()
