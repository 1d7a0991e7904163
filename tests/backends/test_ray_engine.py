"""The runtime Engine over the Ray backend: unchanged engine, real Ray, real processes.

The Engine runs its own loop (woken by the backend's watcher when a Ray result
is ready); a workload runs and succeeds, an urgent one preempts another that
checkpoints and resumes, telemetry reaches the stream, and after an engine
restart (the Ray actors are detached, so they outlive it) the running attempt
is adopted, not restarted, and finishes under the new engine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from mlwe.core.lifecycle import State
from mlwe.core.spec import ClusterSpec, WorkloadSpec
from mlwe.runtime import Engine, EngineConfig
from tests.backends.harness import MonotonicClock
from tests.backends.ray_cluster import BASE_NODES, new_prefix, ray_cluster


def synthetic(wid: str, work: float, priority: str = "normal") -> WorkloadSpec:
    return WorkloadSpec(
        id=wid, name=wid, priority=priority, resources={"gpu": 2, "cpu": 1, "memory": "256Mi"},
        gpu_models=("A100-80GB",), estimated_duration=work,
        command=(sys.executable, "-m", "mlwe.programs.synthetic", "--work", str(work),
                 "--memory", "16Mi", "--phases", "0.3:1", "--report-every", "0.2"),
    )


def _wait(eng: Engine, pred: Any, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with eng.lock:
            if pred(eng):
                return True
        time.sleep(0.05)
    return False


def test_engine_runs_preempts_and_adopts_on_ray(tmp_path: Path) -> None:
    from mlwe.backends.ray import RayBackend, RayBackendConfig

    ray_cluster()
    cluster = ClusterSpec(nodes=BASE_NODES)
    clock = MonotonicClock()
    config = RayBackendConfig(prefix=new_prefix("engine"), checkpoint_root=str(tmp_path / "ckpt"),
                              telemetry_period_s=0.3, close_grace_s=0.0)
    cfg = EngineConfig(grace_s=5.0, telemetry_store_every_s=0.2)
    backend = RayBackend(cluster, config, clock=clock)
    eng = Engine.open(cluster, backend, data_dir=tmp_path / "data", clock=clock, config=cfg)
    assert backend.event_listeners  # the engine registered its wake-up
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
        assert starting_at >= released_at  # placed only after Ray confirmed the release
        evs, _ = sub.drain()
        tel = [e.data for e in evs if e.data.get("workload") == "batch"]
        assert tel and any(m["metrics"].get("rss_mib", 0) > 10 for m in tel)
    finally:
        eng.close()  # the engine goes; the detached Ray actors keep the program running

    backend2 = RayBackend(cluster, config, clock=clock)  # a new engine process's backend
    eng2 = Engine.open(cluster, backend2, data_dir=tmp_path / "data", clock=clock, config=cfg)
    try:
        assert eng2.last_restart is not None and eng2.last_restart.adopted == ["batch"]
        eng2.start()
        assert _wait(eng2, lambda e: e.cp.workloads["batch"].state is State.SUCCEEDED)
        batch = eng2.cp.workloads["batch"]
        assert batch.attempt == 2  # adopted, not restarted
        assert eng2.audit.verify().ok and eng2.cp.validate_state() == []
    finally:
        eng2.close(stop_workloads=True)
    backend.close()  # the first engine's backend: nothing of its own is left
