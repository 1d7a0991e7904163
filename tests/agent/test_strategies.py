"""Strategies turn findings into plans the control plane accepts (on a fork)."""

from __future__ import annotations

from mlwe.agent.model import Finding
from mlwe.agent.monitor import Monitor
from mlwe.agent.strategies import (
    CordonNode,
    Defragment,
    MoveOffNode,
    Reprioritise,
    RequeueMoreMemory,
    ResizeBorrowing,
    RestartStalled,
    ScaleService,
    StopCrashLoop,
    StopDiverged,
    default_strategies,
    hazards_for,
    oom_target_memory,
)
from mlwe.agent.triggers import Context
from mlwe.agent.whatif import WhatIfForecaster
from mlwe.core import (
    ControlPlane,
    Evict,
    Exited,
    ManualClock,
    NodeStatus,
    Preempt,
    QueueSpec,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    SetResources,
    State,
)
from mlwe.core.scheduler import Scheduler
from tests.core.builders import A100, cluster, cpu_node, gpu_node, job, ok, running_on, submit


def ctx(cp: ControlPlane) -> Context:
    return Context(cp, Monitor(cp), Scheduler())


def verified(cp: ControlPlane, actions: object) -> None:
    assert WhatIfForecaster(cp).verify(actions) == ()  # type: ignore[arg-type]


def test_reprioritise_raises_just_above_the_cheapest_holders(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    f = Finding("deadline-at-risk", "ft", "workload", "at risk", 0.9)
    plans = Reprioritise().plan(f, ctx(cp))
    assert [p.id for p in plans] == ["reprioritise/preempt:ft"]
    acts = plans[0].actions
    assert acts[0] == SetPriority("ft", 51, "agent: deadline-at-risk")
    victims = [a.victim for a in acts[1:] if isinstance(a, Preempt)]
    # two 4-GPU runs on the same node: the fine-tune needs one whole node
    assert len(victims) == 2
    assert len({cp.get(v).placement[0].node for v in victims}) == 1
    verified(cp, acts)
    # carried through by a reschedule workflow for exactly those victims
    wf = plans[0].workflow
    assert wf is not None and wf.kind == "reschedule"
    assert dict(wf.params) == {"preemptor": "ft", "victims": victims}


def test_reprioritise_prefers_head_of_queue_when_that_suffices() -> None:
    cp, _ = cluster(gpu_node("g0"), queues=[QueueSpec(name="research")])
    running_on(cp, job("batch-run", gpu=8, models=[A100], priority="batch"), "g0")
    submit(cp, job("batch-next", gpu=8, models=[A100], priority="batch"),
           job("patient", gpu=8, models=[A100], priority="low", queue="research"))
    # at the batch priority, the research queue's smaller fair share ranks it first
    f = Finding("queue-starving", "patient", "workload", "starving", 0.6)
    plans = {p.id: p for p in Reprioritise().plan(f, ctx(cp))}
    head = plans["reprioritise/head-of-queue:patient"]
    assert head.actions == (SetPriority("patient", 20, "agent: queue-starving"),)
    assert head.factors["cost"] < plans["reprioritise/preempt:patient"].factors["cost"]
    verified(cp, head.actions)
    # in the same queue, equal priority would leave it behind the earlier arrival: raising
    # it further would preempt, so there is no head-of-queue variant
    cp2, _ = cluster(gpu_node("g0"))
    running_on(cp2, job("batch-run", gpu=8, models=[A100], priority="batch"), "g0")
    submit(cp2, job("batch-next", gpu=8, models=[A100], priority="batch"),
           job("patient", gpu=8, models=[A100], priority="low"))
    ids = [p.id for p in Reprioritise().plan(f, ctx(cp2))]
    assert ids == ["reprioritise/preempt:patient"]


def test_requeue_with_more_memory_after_oom_kills() -> None:
    cp, _clock = cluster(cpu_node("c0", memory="256Gi"))
    running_on(cp, job("etl", memory="32Gi"), "c0")
    ok(cp.apply([Exited("etl", cp.get("etl").attempt, 137, "oom")]))
    f = Finding("repeated-failures", "etl", "workload", "oom", 0.7, cause="oom",
                evidence={"peak_memory_mib": 32 * 1024, "attempts": [{"runtime_s": 600}]})
    (p,) = RequeueMoreMemory().plan(f, ctx(cp))
    sr = p.actions[0]
    assert isinstance(sr, SetResources) and sr.resources.memory == oom_target_memory(32 * 1024, 32 * 1024)
    assert sr.resources.memory == 48 * 1024
    # the recover workflow carries it on (backoff, move, dead letter)
    assert p.workflow is not None and (p.workflow.kind, dict(p.workflow.params)) == (
        "recover", {"workload": "etl"})
    verified(cp, p.actions)
    (hz,) = hazards_for(f, ctx(cp))
    assert hz.kind == "crash" and hz.cleared_by_memory is not None
    assert 32 * 1024 < hz.cleared_by_memory <= sr.resources.memory


def test_requeue_more_memory_is_capped_by_the_largest_node() -> None:
    cp, _ = cluster(cpu_node("c0", memory="40Gi"))
    submit(cp, job("etl", memory="32Gi"))
    f = Finding("repeated-failures", "etl", "workload", "oom", 0.7, cause="oom",
                evidence={"peak_memory_mib": 32 * 1024})
    (p,) = RequeueMoreMemory().plan(f, ctx(cp))
    assert p.actions[0].resources.memory == 40 * 1024  # type: ignore[union-attr]


def test_move_off_node_cordons_and_evicts() -> None:
    cp, _ = cluster(gpu_node("g0"), gpu_node("g1"))
    running_on(cp, job("a", gpu=4, models=[A100]), "g0")
    running_on(cp, job("b", gpu=4, models=[A100], protected=True), "g0")
    f = Finding("node-unhealthy", "g0", "node", "ecc", 0.8)
    plans = {p.id: p for p in MoveOffNode().plan(f, ctx(cp))}
    drain = plans["move-off-node/drain:g0"]
    assert drain.actions[0] == SetNodeStatus("g0", NodeStatus.CORDONED, "agent: ecc")
    assert {a.workload for a in drain.actions[1:] if isinstance(a, Evict)} == {"a", "b"}
    verified(cp, drain.actions)  # a protected workload may be moved off a cordoned node
    assert hazards_for(f, ctx(cp))[0].kind == "node-failure"


def test_diverged_run_stop_and_restart_variants(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    f = Finding("loss-diverging", "train-0", "workload", "diverging", 0.8)
    plans = StopDiverged().plan(f, ctx(cp))
    assert [p.id for p in plans] == ["stop-diverged/stop:train-0", "stop-diverged/restart:train-0"]
    assert plans[0].factors["confidence"] > plans[1].factors["confidence"]
    for p in plans:
        verified(cp, p.actions)


def test_borrowing_limit_is_raised_within_a_cohort() -> None:
    q = QueueSpec.model_validate({"name": "team-a", "cohort": "co", "nominal": {"gpu": 4},
                                  "borrowing_limit": {"gpu": 0}})
    cp, _ = cluster(gpu_node("g0"), queues=[q, QueueSpec(name="team-b", cohort="co",
                                                         nominal={"gpu": 4})])
    submit(cp, job("wide", gpu=8, models=[A100], queue="team-a"))
    f = Finding("gpus-idle-while-waiting", "wide", "workload", "quota", 0.5, cause="quota")
    (p,) = ResizeBorrowing().plan(f, ctx(cp))
    (a,) = p.actions
    assert isinstance(a, SetQueue) and a.spec.borrowing_limit is not None
    assert a.spec.borrowing_limit.gpu == 8000
    verified(cp, p.actions)


def test_defragment_moves_small_work_that_fits_elsewhere() -> None:
    cp, _ = cluster(gpu_node("g0"), gpu_node("g1"), gpu_node("g2"))
    running_on(cp, job("small-0", gpu=4, models=[A100]), "g0")
    running_on(cp, job("small-1", gpu=4, models=[A100]), "g1")
    running_on(cp, job("big", gpu=4, models=[A100]), "g2")
    running_on(cp, job("big2", gpu=2, models=[A100]), "g2")
    submit(cp, job("wide", gpu=8, models=[A100]))
    # g0 and g1 have 4 free, g2 has 2: moving small-0 onto g1 frees g0 for "wide"
    f = Finding("gpus-fragmented", "wide", "workload", "fragmented", 0.5, cause="fragmented")
    (p,) = Defragment().plan(f, ctx(cp))
    assert p.actions == (Evict("small-0", "agent: make room for wide on g0"),)
    verified(cp, p.actions)


def test_scale_service_up_and_down() -> None:
    cp, _ = cluster(gpu_node("g0"))
    for i in range(2):
        running_on(cp, job(f"chat-{i}", gpu=1, models=[A100], kind="inference",
                           labels={"mlwe.service": "chat"}), "g0")
    up = Finding("inference-overloaded", "chat", "service", "hot", 0.6,
                 evidence={"replica_ids": ["chat-0", "chat-1"], "replicas": 2})
    (p,) = ScaleService().plan(up, ctx(cp))
    spec = p.actions[0].spec  # type: ignore[union-attr]
    assert spec.id == "chat-r3" and spec.labels["mlwe.service"] == "chat"
    verified(cp, p.actions)
    down = Finding("inference-idle", "chat", "service", "cold", 0.3,
                   evidence={"replica_ids": ["chat-0", "chat-1"], "replicas": 2})
    (q,) = ScaleService().plan(down, ctx(cp))
    assert q.actions[0].workload == "chat-1"  # type: ignore[union-attr]


def test_strategies_without_a_fitting_finding_propose_nothing(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    c = ctx(cp)
    ghost = Finding("repeated-failures", "ghost", "workload", "?", 0.5, cause="oom")
    code_on_running = Finding("repeated-failures", "train-0", "workload", "?", 0.5, cause="oom")
    for s in (RequeueMoreMemory(), StopCrashLoop(), CordonNode(), RestartStalled()):
        assert s.plan(ghost, c) == []
    assert RequeueMoreMemory().plan(code_on_running, c) == []  # a running attempt keeps its memory
    assert cp.get("train-0").state is State.RUNNING


def test_every_default_strategy_has_a_unique_name() -> None:
    names = [s.name for s in default_strategies()]
    assert len(names) == len(set(names))


def test_failures_on_a_node_cordon_it_and_recover_the_workload_elsewhere() -> None:
    cp, _ = cluster(gpu_node("g0"), gpu_node("g1"))
    running_on(cp, job("job", gpu=4, models=[A100]), "g0")
    ok(cp.apply([Exited("job", cp.get("job").attempt, 1, "error")]))
    f = Finding("repeated-failures", "job", "workload", "fails on g0", 0.7, cause="node",
                evidence={"attempts": [{"nodes": ["g0"]}, {"nodes": ["g0"]}]})
    (p,) = CordonNode().plan(f, ctx(cp))
    assert p.actions == (SetNodeStatus("g0", NodeStatus.CORDONED, "agent: repeated-failures"),)
    assert p.workflow is not None and p.workflow.kind == "recover"
    assert dict(p.workflow.params) == {"workload": "job", "bad_nodes": ["g0"]}
    verified(cp, p.actions)
    # a flapping node is cordoned, and no single workload is recovered for it
    (flap,) = CordonNode().plan(Finding("node-flapping", "g0", "node", "flaps", 0.6), ctx(cp))
    assert flap.workflow is None
