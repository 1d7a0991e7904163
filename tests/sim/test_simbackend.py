"""The simulated backend through the real control plane: exact timings of
checkpoint loss, graceful eviction, restart cost, retries and node failures."""

from __future__ import annotations

from mlwe.core import ClusterSpec, NodeSpec, State, WorkloadSpec
from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import TRACE_CATALOG, Trace, TraceJob


def _trace(jobs: list[tuple[str, float, float, dict[str, object]]], nodes: int = 1) -> Trace:
    cluster = ClusterSpec(
        nodes=tuple(
            NodeSpec(name=f"n{i}", gpu_model="A100-80GB", gpus=8, cpu=64, memory="512Gi")
            for i in range(nodes)
        )
    )
    out = []
    for line, (jid, submit, duration, fields) in enumerate(jobs, start=2):
        spec = WorkloadSpec.model_validate({"id": jid, "name": jid, **fields})
        out.append(TraceJob(jid, submit, duration, spec, line))
    return Trace("test", tuple(out), cluster, TRACE_CATALOG, 0, ())


def _finished_at(result, wid: str) -> float:  # type: ignore[no-untyped-def]
    (t,) = [t.time for t in result.cp.get(wid).history if t.target is State.SUCCEEDED]
    return t


def test_preemption_loses_work_since_last_checkpoint_and_pays_restart_cost() -> None:
    batch = {"priority": "batch", "resources": {"gpu": 8, "cpu": 8, "memory": "64Gi"},
             "checkpoint_interval": 300, "restart_cost": 50, "estimated_duration": 1000}
    urgent = {"priority": "urgent", "resources": {"gpu": 8, "cpu": 8, "memory": "64Gi"},
              "estimated_duration": 100}
    tr = _trace([("batch", 0, 1000, batch), ("urgent", 700, 100, urgent)])
    r = replay(tr, ReplayConfig(eviction_delay_s=5))
    # preempted at 700 after 2 checkpoints (600 s saved, 100 s lost); released at 705
    assert _finished_at(r, "urgent") == 805.0
    # resumes at 805: 50 s restart + 400 s of work left
    assert _finished_at(r, "batch") == 1255.0
    assert r.metrics["preemptions"] == 1
    # it kept running through the 5 s grace: 105 s of work since the last checkpoint lost
    assert r.metrics["gpu_hours_lost_to_preemption"] == round(8 * 105 / 3600, 3)
    batch_w = r.cp.get("batch")
    assert [t.target for t in batch_w.history].count(State.PREEMPTED) == 1
    assert batch_w.attempt == 2


def test_without_checkpoints_a_preempted_job_starts_over() -> None:
    batch = {"priority": "batch", "resources": {"gpu": 8}, "estimated_duration": 1000}
    urgent = {"priority": "urgent", "resources": {"gpu": 8}, "estimated_duration": 100}
    tr = _trace([("batch", 0, 1000, batch), ("urgent", 700, 100, urgent)])
    r = replay(tr, ReplayConfig(eviction_delay_s=0))
    assert _finished_at(r, "urgent") == 800.0
    assert _finished_at(r, "batch") == 1800.0


def test_crashing_job_is_retried_until_its_retry_limit() -> None:
    job = {"resources": {"gpu": 1}, "max_retries": 2}
    tr = _trace([("crashy", 0, 100, job)])
    r = replay(tr, ReplayConfig(failure_prob=1.0))
    w = r.cp.get("crashy")
    assert w.state is State.FAILED
    assert w.attempt == 3  # first run + 2 retries
    assert w.failures == 3
    assert r.cp.validate_state() == []


def test_node_failure_requeues_work_and_it_finishes_elsewhere() -> None:
    job = {"resources": {"gpu": 8}, "checkpoint_interval": 60}
    tr = _trace([("a", 0, 1000, job)], nodes=2)
    r = replay(tr, ReplayConfig(node_failures=[(250.0, "n0", None)]))
    w = r.cp.get("a")
    assert w.state is State.SUCCEEDED
    assert w.failures == 0  # a lost node is not the workload's fault
    assert w.failure_cause == "node-lost"
    assert w.placement == ()
    lost = [t for t in w.history if t.target is State.FAILED]
    assert len(lost) == 1 and lost[0].time == 250.0
    assert r.cp.node_status("n0").value == "down"
    # 240 s were saved by checkpoints: 760 s left after the retry backoff
    finish = _finished_at(r, "a")
    restarted = [t.time for t in w.history if t.target is State.RUNNING][-1]
    assert finish - restarted == 760.0


def test_replay_is_deterministic() -> None:
    from mlwe.sim.report import WALL_CLOCK_KEYS
    from mlwe.sim.traces import load_trace

    tr = load_trace("synthetic", limit=150)
    a = replay(tr, ReplayConfig(seed=3)).metrics
    b = replay(tr, ReplayConfig(seed=3)).metrics
    for k in WALL_CLOCK_KEYS:
        a.pop(k)
        b.pop(k)
    assert a == b


def test_core_and_simulator_agree_on_saved_work_after_a_restart() -> None:
    from mlwe.core import State
    from mlwe.core.model import Workload
    from mlwe.sim.backend import SimBackend, _Run
    from mlwe.sim.kernel import Kernel

    spec = WorkloadSpec(id="a", name="a", resources={"gpu": 1}, checkpoint_interval=60,
                        restart_cost=10)
    w = Workload(id="a", spec=spec, seq=1, submit_time=0, deadline=None, state=State.RUNNING,
                 started_at=110.0, work_done=60.0, run_base_work=60.0)
    sim = SimBackend(Kernel(), {"a": 1000.0})._work_saved(
        _Run("a", 2, spec, ("n0",), 110.0, 10.0, 60.0), 175.0)
    assert w.saved_work(175.0) == sim == 60.0
    assert w.saved_work(181.0) == sim + 60.0 == 120.0
