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


def synthetic(wid: str, work: float, priority: str = "normal",
              hold: tuple[float, Path] | None = None) -> WorkloadSpec:
    """``hold``: (fraction, file): the program waits at that fraction of its work
    until the file exists, so that it surely still runs when the test needs it to."""
    gate = ("--hold-at", str(hold[0]), "--hold-file", str(hold[1])) if hold else ()
    return WorkloadSpec(
        id=wid, name=wid, priority=priority, resources={"gpu": 2, "cpu": 1, "memory": "256Mi"},
        gpu_models=("A100-80GB",), estimated_duration=work,
        command=(sys.executable, "-m", "mlwe.programs.synthetic", "--work", str(work),
                 "--memory", "16Mi", "--phases", "0.3:1", "--report-every", "0.2", *gate),
    )


def _wait(eng: Engine, pred: Any, what: str, timeout: float = 120.0) -> None:
    """Until ``pred(eng)`` holds (under the engine's lock); on timeout, fail naming
    ``what`` and every workload's state, attempt and failure cause."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with eng.lock:
            if pred(eng):
                return
        time.sleep(0.05)
    with eng.lock:
        states = {w.id: (w.state.value, w.attempt, w.failure_cause)
                  for w in eng.cp.workloads.values()}
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: {states}")


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
    # batch waits at 60 % of its work until the gate opens: it still runs (attempt 2)
    # when the first engine closes, however slowly a loaded machine runs the test
    gate = tmp_path / "release-batch"
    eng.start()
    try:
        eng.submit([synthetic("batch", 8.0, hold=(0.6, gate))])
        _wait(eng, lambda e: e.cp.workloads["batch"].progress > 0.05, "batch to progress")
        eng.submit([synthetic("urgent", 0.5, priority="urgent")])  # needs batch's GPUs
        _wait(eng, lambda e: e.cp.workloads["urgent"].state is State.SUCCEEDED,
              "urgent to preempt batch and succeed")
        _wait(eng, lambda e: e.cp.workloads["batch"].state is State.RUNNING
              and e.cp.workloads["batch"].attempt == 2, "batch to run again (attempt 2)")
        batch = eng.cp.workloads["batch"]
        released_at = next(t.time for t in batch.history if t.target is State.PREEMPTED)
        starting_at = next(t.time for t in eng.cp.workloads["urgent"].history
                           if t.target is State.STARTING)
        assert starting_at >= released_at  # placed only after Ray confirmed the release
        evs, _ = sub.drain()
        tel = [e.data for e in evs if e.data.get("workload") == "batch"]
        assert tel and any(m["metrics"].get("rss_mib", 0) > 10 for m in tel)
    except BaseException:
        gate.touch()  # no adoption follows: let the detached program finish on its own
        raise
    finally:
        eng.close()  # the engine goes; the detached Ray actors keep the program running

    backend2 = RayBackend(cluster, config, clock=clock)  # a new engine process's backend
    eng2 = Engine.open(cluster, backend2, data_dir=tmp_path / "data", clock=clock, config=cfg)
    try:
        assert eng2.last_restart is not None and eng2.last_restart.adopted == ["batch"]
        eng2.start()
        gate.touch()
        _wait(eng2, lambda e: e.cp.workloads["batch"].state is State.SUCCEEDED,
              "the adopted batch to succeed")
        batch = eng2.cp.workloads["batch"]
        assert batch.attempt == 2  # adopted, not restarted
        assert eng2.audit.verify().ok and eng2.cp.validate_state() == []
    finally:
        eng2.close(stop_workloads=True)
    backend.close()  # the first engine's backend: nothing of its own is left
