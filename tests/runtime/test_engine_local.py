"""The runtime engine over the local workload daemon: real processes, real telemetry.

The same Engine that drives the simulator drives daemons here, unchanged:
a workload runs as a real process and succeeds; an urgent one preempts it (the
victim checkpoints and is requeued, then resumes); telemetry from the OS reaches
the telemetry stream and the store; and after an engine restart the running
process is adopted, not restarted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mlwe.core.lifecycle import State
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec
from mlwe.runtime import Engine, EngineConfig
from tests.backends.harness import MonotonicClock


def synthetic(wid: str, work: float, priority: str = "normal") -> WorkloadSpec:
    return WorkloadSpec(
        id=wid, name=wid, priority=priority, resources={"cpu": 1, "memory": "256Mi"},
        estimated_duration=work,
        command=(sys.executable, "-m", "mlwe.programs.synthetic", "--work", str(work),
                 "--memory", "16Mi", "--phases", "0.3:1", "--report-every", "0.2"),
    )


@pytest.fixture
def local(tmp_path: Path):
    from mlwe.backends.local import LocalBackend

    clock = MonotonicClock()
    node = NodeSpec(name="n1", cpu=1, memory="2Gi")
    cluster = ClusterSpec(nodes=(node,))
    backend = LocalBackend(cluster, heartbeat_s=0.25, missed_heartbeats=12, telemetry_s=0.3,
                           report_s=0.1, register_timeout_s=30, checkpoint_root=tmp_path / "ckpt",
                           work_dir=tmp_path / "work", clock=clock)
    backend.spawn_daemon([node])
    backend.wait_for_nodes(timeout=30)
    yield cluster, backend, clock
    backend.close()


def test_engine_runs_preempts_and_adopts_real_processes(tmp_path: Path, local) -> None:
    cluster, backend, clock = local
    cfg = EngineConfig(grace_s=5.0, telemetry_store_every_s=0.2)
    eng = Engine.open(cluster, backend, data_dir=tmp_path / "data", clock=clock, config=cfg)
    sub = eng.streams.subscribe(["telemetry"], buffer=10_000)
    eng.submit([synthetic("batch", 30.0)])
    assert eng.run_until(lambda e: e.cp.workloads["batch"].state is State.RUNNING, 30)
    assert eng.run_until(lambda e: e.cp.workloads["batch"].progress > 0.02, 30)

    eng.submit([synthetic("urgent", 1.0, priority="urgent")])  # needs the node's only CPU
    assert eng.run_until(lambda e: e.cp.workloads["urgent"].state is State.SUCCEEDED, 60)
    batch = eng.cp.workloads["batch"]
    assert State.PREEMPTED in [tr.target for tr in batch.history]
    # the preemptor started only after the victim's release
    hist_b = [(tr.target, tr.time) for tr in batch.history]
    released_at = next(t for s, t in hist_b if s is State.PREEMPTED)
    started_at = next(tr.time for tr in eng.cp.workloads["urgent"].history
                      if tr.target is State.STARTING)
    assert started_at >= released_at
    assert eng.run_until(lambda e: e.cp.workloads["batch"].state is State.RUNNING, 30)
    assert eng.cp.workloads["batch"].attempt == 2

    evs, _ = sub.drain()
    tel = [e.data for e in evs if e.data.get("workload") == "batch"]
    assert tel and any(m["metrics"].get("rss_mib", 0) > 10 for m in tel)  # measured, whole tree
    eng.close()  # the daemon keeps the process running

    eng2 = Engine.open(cluster, backend, data_dir=tmp_path / "data", clock=clock, config=cfg)
    assert eng2.last_restart.adopted == ["batch"]
    assert eng2.run_until(lambda e: e.cp.workloads["batch"].state is State.RUNNING, 5)
    assert eng2.cp.workloads["batch"].attempt == 2  # not restarted
    assert eng2.repo.telemetry(workload="batch")
    assert eng2.audit.verify().ok and eng2.cp.validate_state() == []
    eng2.close()
