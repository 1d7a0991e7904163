"""The runtime Engine over the Slurm backend: unchanged engine, real Slurm, real processes.

The Engine runs its own loop; a workload runs as a Slurm job and an urgent one
preempts it (the victim checkpoints, its job ends, Slurm confirms, the preemptor
is submitted); telemetry reaches the stream; after an engine restart (Slurm
jobs outlive the engine) the running attempt is adopted from ``squeue``, not
restarted, and finishes under the new engine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from mlwe.core.lifecycle import State
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec
from mlwe.runtime import Engine, EngineConfig
from tests.backends.harness import MonotonicClock
from tests.backends.slurm_cluster import new_prefix, slurm_cluster


def synthetic(wid: str, work: float, priority: str = "normal") -> WorkloadSpec:
    return WorkloadSpec(
        id=wid, name=wid, priority=priority, resources={"gpu": 2, "cpu": 1, "memory": "256Mi"},
        gpu_models=("T4",), estimated_duration=work, checkpoint_interval=0.5,
        command=(sys.executable, "-m", "mlwe.programs.synthetic", "--work", str(work),
                 "--memory", "16Mi", "--phases", "0.3:1", "--report-every", "0.2",
                 "--checkpoint-every", "0.5"),
    )


def _wait(eng: Engine, pred: Any, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with eng.lock:
            if pred(eng):
                return True
        time.sleep(0.05)
    return False


def test_engine_runs_preempts_and_adopts_on_slurm(tmp_path: Path) -> None:
    from mlwe.backends.slurm import SlurmBackend, SlurmBackendConfig

    slurm = slurm_cluster(["n0"])
    cluster = ClusterSpec(nodes=(NodeSpec(name="n0", gpus=2, gpu_model="T4", cpu="4",
                                          memory="2Gi"),))
    clock = MonotonicClock()
    config = SlurmBackendConfig(prefix=new_prefix("engine"), run_dir=str(tmp_path / "run"),
                                slurm_conf=str(slurm.conf), telemetry_period_s=0.3)
    cfg = EngineConfig(grace_s=5.0, telemetry_store_every_s=0.2)
    backend = SlurmBackend(cluster, config, clock=clock)
    eng = Engine.open(cluster, backend, data_dir=tmp_path / "data", clock=clock, config=cfg)
    sub = eng.streams.subscribe(["telemetry"], buffer=10_000)
    eng.start()
    try:
        eng.submit([synthetic("batch", 8.0)])
        assert _wait(eng, lambda e: e.cp.workloads["batch"].progress > 0.05)
        eng.submit([synthetic("urgent", 0.5, priority="urgent")])  # needs batch's GPUs
        assert _wait(eng, lambda e: e.cp.workloads["urgent"].state is State.SUCCEEDED)
        assert _wait(eng, lambda e: e.cp.workloads["batch"].state is State.RUNNING
                     and e.cp.workloads["batch"].attempt == 2)
        batch = eng.cp.workloads["batch"]
        released_at = next(t.time for t in batch.history if t.target is State.PREEMPTED)
        starting_at = next(t.time for t in eng.cp.workloads["urgent"].history
                           if t.target is State.STARTING)
        assert starting_at >= released_at  # placed only after Slurm confirmed the release
        evs, _ = sub.drain()
        tel = [e.data for e in evs if e.data.get("workload") == "batch"]
        assert tel and any(m["metrics"].get("rss_mib", 0) > 10 for m in tel)
        node = [e.data for e in evs if e.data.get("workload") is None]
        assert node and any("slurm_alloc_cpus" in m["metrics"] for m in node)
        job = backend.attempt_info("batch", 2)
        assert job is not None and job["job_id"] is not None
    finally:
        eng.close()  # the engine goes; the Slurm job keeps running
    backend.detach()

    backend2 = SlurmBackend(cluster, config, clock=clock)  # a new engine process's backend
    eng2 = Engine.open(cluster, backend2, data_dir=tmp_path / "data", clock=clock, config=cfg)
    try:
        assert eng2.last_restart is not None and eng2.last_restart.adopted == ["batch"]
        assert backend2.attempt_info("batch", 2)["job_id"] == job["job_id"]  # type: ignore[index]
        eng2.start()
        assert _wait(eng2, lambda e: e.cp.workloads["batch"].state is State.SUCCEEDED)
        batch = eng2.cp.workloads["batch"]
        assert batch.attempt == 2  # adopted, not restarted
        assert eng2.audit.verify().ok and eng2.cp.validate_state() == []
    finally:
        eng2.close(stop_workloads=True)
