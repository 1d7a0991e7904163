"""``mlwe bench backend --backend ray``: how fast the Ray backend evicts and what it costs.

Measured on a real Ray cluster started on this machine (:class:`LocalRayCluster`,
one Ray node per mlwe node) with real synthetic programs, driven through the
real control plane, scheduler and reconciler (the runtime Engine's loop):

- **evict to place**: a low-priority workload holds a whole node; an urgent one
  arrives. From the preemption decision (the victim's PREEMPTING transition) to
  the engine receiving the preemptor's ``Started`` (its program is running in
  its actor). ``evict_to_place_*`` excludes the victim's own time between
  SIGTERM and its exit (its checkpoint, inside the grace period, as the actor
  measured it); ``evict_to_place_total_*`` includes it. Each preemptor start
  includes creating a placement group and a Ray actor (a new worker process).
- **start**: from the start command to ``Started`` (placement group, actor,
  program), ``start_to_running_*``.
- **overhead**: ``workloads`` synthetic workloads running at once. CPU of the
  Ray worker processes hosting their actors (summed, percent of one core) and
  their memory per replica, the engine process's CPU, and the measured interval
  between node telemetry samples.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from mlwe.backends.benchkit import BenchDriver, MonotonicClock, evict_to_place, ms
from mlwe.backends.ray.backend import RayBackend, RayBackendConfig
from mlwe.backends.ray.cluster import LocalRayCluster
from mlwe.core.actions import Cancel
from mlwe.core.lifecycle import State
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec


def _synthetic(wid: str, *, priority: str, cpu: str, node: str, args: list[str]) -> WorkloadSpec:
    return WorkloadSpec.model_validate({
        "id": wid, "name": wid, "priority": priority, "max_retries": 0,
        "resources": {"cpu": cpu, "memory": "64Mi"}, "node_selector": {"bench": node},
        "command": [sys.executable, "-m", "mlwe.programs.synthetic", *args],
    })


def run_bench(*, trials: int = 20, workloads: int = 50, measure_s: float = 10.0,
              grace_s: float = 5.0) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="mlwe-bench-ray-"))
    nodes = (
        NodeSpec(name="evict-0", cpu="1", memory="2Gi", labels={"bench": "evict"}),
        NodeSpec(name="load-0", cpu=f"{max(1, workloads)}", memory=f"{64 * workloads + 64}Mi",
                 labels={"bench": "load"}),
    )
    cluster = ClusterSpec(nodes=nodes)
    t0 = time.monotonic()
    ray_cluster = LocalRayCluster(cluster, cpus_per_node=2, namespace="mlwe-bench")
    out: dict[str, Any] = {"backend": "ray", "cpus": psutil.cpu_count(),
                           "ray_cluster_start_s": round(time.monotonic() - t0, 2)}
    clock = MonotonicClock()
    backend = RayBackend(cluster, RayBackendConfig(
        prefix="bench", checkpoint_root=str(base / "ckpt"), log_root=str(base / "logs"),
        telemetry_period_s=1.0, close_grace_s=0.0), clock=clock)
    try:
        d = BenchDriver(cluster, backend, clock, grace_s, sample_node="load-0",
                        is_report=lambda m: "loss" in m or "step" in m)
        out.update(_evict_to_place(d, backend, trials, grace_s))
        out.update(_overhead(d, backend, workloads, measure_s))
        return out
    finally:
        backend.close()
        ray_cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def _evict_to_place(d: BenchDriver, backend: RayBackend, trials: int, grace_s: float
                    ) -> dict[str, Any]:
    starts: list[float] = []

    def stop_wait(victim: str) -> float:
        return float((backend.attempt_info(victim, 1) or {}).get("stop_wait_s") or 0.0)

    def record_starts(victim: str, urgent: str) -> None:
        for wid in (victim, urgent):
            s = (backend.attempt_info(wid, 1) or {}).get("started_s")
            if s is not None:
                starts.append(float(s))

    trials_out = evict_to_place(
        d, trials,
        victim=lambda v: _synthetic(v, priority="low", cpu="1", node="evict",
                                    args=["--work", "600", "--memory", "16Mi",
                                          "--phases", "0.05:1", "--report-every", "0.1"]),
        urgent=lambda u: _synthetic(u, priority="urgent", cpu="1", node="evict",
                                    args=["--work", "0.05", "--memory", "1Mi"]),
        stop_wait_s=stop_wait, timeout_s=120, after_trial=record_starts,
    )
    return {
        **trials_out.figures(grace_s),
        "start_to_running_p50_ms": ms(starts, 0.5),
        "start_to_running_p99_ms": ms(starts, 0.99),
    }


def _overhead(d: BenchDriver, backend: RayBackend, workloads: int, measure_s: float
              ) -> dict[str, Any]:
    names = [f"load-{i}" for i in range(workloads)]
    for wid in names:
        d.submit(_synthetic(wid, priority="normal", cpu="1", node="load",
                            args=["--work", "3600", "--memory", "8Mi", "--phases", "0.01:1",
                                  "--report-every", "1.0"]))
    t0 = time.monotonic()
    d.until(lambda: all(d.state(w) is State.RUNNING for w in names), 600,
            "every workload to run")
    all_running_s = time.monotonic() - t0
    d.until(lambda: all(d.reported(w) for w in names), 120, "every workload to report")
    actors = []
    for wid in names:
        info = backend.attempt_info(wid, 1) or {}
        for r in info.get("replicas", ()):
            if r.get("actor_pid"):
                actors.append(psutil.Process(r["actor_pid"]))
    me = psutil.Process()
    a0 = sum(_cpu(p) for p in actors)
    m0 = _cpu(me)
    d.node_samples.clear()
    t1 = time.monotonic()
    d.pump(measure_s)
    wall = time.monotonic() - t1
    a1 = sum(_cpu(p) for p in actors)
    m1 = _cpu(me)
    rss = [p.memory_info().rss / 2**20 for p in actors if p.is_running()]
    running = sum(1 for w in names if d.state(w) is State.RUNNING)
    for wid in names:
        d.cp.apply([Cancel(wid, "bench over")], cause_id="bench")
    d.until(lambda: all(d.state(w) is State.CANCELLED for w in names), 300, "the load to stop")
    return {
        "workloads_running": running,
        "all_running_s": round(all_running_s, 2),
        "runner_cpu_pct": round(100 * (a1 - a0) / wall, 2),
        "runner_cpu_pct_per_replica": round(100 * (a1 - a0) / wall / max(1, len(actors)), 3),
        "runner_rss_mib_per_replica": round(statistics.median(rss), 1) if rss else None,
        "engine_process_cpu_pct": round(100 * (m1 - m0) / wall, 2),
        "measure_s": round(wall, 2),
        "telemetry_period_s": d.telemetry_period_s(),
        "telemetry_period_configured_s": backend.config.telemetry_period_s,
    }


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0
