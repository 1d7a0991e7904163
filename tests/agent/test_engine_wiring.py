"""The agent wired into the runtime engine with ``attach``: proposals audited by the
engine, reasoning stored and chained, approvals through the same path."""

from __future__ import annotations

from pathlib import Path

from mlwe.agent.loop import attach
from mlwe.agent.model import Mode
from mlwe.core.clock import ManualClock
from mlwe.core.lifecycle import State
from mlwe.core.spec import ClusterSpec, NodePool, WorkloadSpec
from mlwe.runtime import Engine, LiveSimBackend
from mlwe.store.audit import AuditLog


def _spec(**kw: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate(kw)


def engine_with_sla(tmp_path: Path) -> tuple[Engine, ManualClock]:
    clock = ManualClock(0.0)
    cluster = ClusterSpec(pools=(NodePool(prefix="g", count=2, gpu_model="A100-80GB", gpus=8,
                                          cpu=64, memory="512Gi"),))
    eng = Engine.open(cluster, LiveSimBackend(clock), data_dir=tmp_path, clock=clock)
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
    agent = attach(eng, mode="autonomous")
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
    agent = attach(eng, mode=Mode.APPROVE)
    v = eng.cp.version
    eng.tick()
    assert eng.cp.get("ft").priority == 50
    (pending,) = agent.pending()
    out = agent.approve(pending["id"], actor="alice")
    assert out.outcome == "committed" and eng.cp.get("ft").priority == 51 and eng.cp.version > v
    agent.close()
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
