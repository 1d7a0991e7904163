"""``mlwe bench backend --backend local``: what the local backend costs and how fast it evicts.

Two measurements on real daemons and real processes, driven through the real
control plane, scheduler and reconciler (the loop the runtime Engine runs):

- **evict to place**: a low-priority synthetic workload holds a whole node; an
  urgent one arrives. Measured from the preemption decision (the victim's
  PREEMPTING transition) to the engine receiving the preemptor's *started*
  (its process is running). ``evict_to_place_*`` excludes the victim's own
  time between SIGTERM and its exit (its checkpoint, inside the grace period,
  reported by the daemon); ``evict_to_place_total_*`` includes it.
- **daemon CPU**: one daemon running ``workloads`` synthetic workloads (each
  reporting every second, sampled every ``telemetry_s``); the daemon process's
  own CPU time over ``measure_s`` seconds, as a percent of one core. The
  measured interval between telemetry samples is reported too.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from mlwe.backends.benchkit import BenchDriver, MonotonicClock, evict_to_place
from mlwe.backends.local.backend import LocalBackend
from mlwe.backends.local.telemetry import machine_memory_mib, usable_cpus
from mlwe.core.lifecycle import State
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec


def _synthetic(wid: str, *, priority: str, cpu: str, memory: str, args: list[str]) -> WorkloadSpec:
    return WorkloadSpec.model_validate({
        "id": wid, "name": wid, "priority": priority, "max_retries": 0,
        "resources": {"cpu": cpu, "memory": memory},
        "command": ["python", "-m", "mlwe.programs.synthetic", *args],
    })


def bench_evict_to_place(trials: int, grace_s: float, base: Path) -> dict[str, Any]:
    cluster = ClusterSpec(nodes=(NodeSpec(name="evict-0", cpu="1", memory="2Gi"),))
    clock = MonotonicClock()
    backend = LocalBackend(cluster, heartbeat_s=1.0, telemetry_s=1.0, report_s=0.2,
                           checkpoint_root=base / "ckpt-evict", work_dir=base / "evict",
                           clock=clock)
    try:
        backend.spawn_daemon(list(cluster.nodes))
        backend.wait_for_nodes(timeout=60)
        d = BenchDriver(cluster, backend, clock, grace_s, is_report=_is_report)
        trials_out = evict_to_place(
            d, trials,
            victim=lambda v: _synthetic(v, priority="low", cpu="1", memory="64Mi",
                                        args=["--work", "600", "--memory", "32Mi",
                                              "--phases", "0.05:1", "--report-every", "0.1"]),
            urgent=lambda u: _synthetic(u, priority="urgent", cpu="1", memory="64Mi",
                                        args=["--work", "0.05", "--memory", "1Mi"]),
            stop_wait_s=lambda v: backend.stop_wait_s(v, 1) or 0.0,
        )
        return trials_out.figures(grace_s)
    finally:
        backend.close()


def _is_report(metrics: Mapping[str, float]) -> bool:
    return "replica" in metrics  # a sample of the program's own reports


def bench_daemon_cpu(workloads: int, measure_s: float, telemetry_s: float, base: Path
                     ) -> dict[str, Any]:
    cpus = usable_cpus()
    per_mem = 48
    mem_mib = min(machine_memory_mib() // 2, workloads * per_mem + 1024)
    cluster = ClusterSpec(nodes=(NodeSpec(name="load-0", cpu=f"{cpus}", memory=f"{mem_mib}Mi"),))
    clock = MonotonicClock()
    backend = LocalBackend(cluster, heartbeat_s=1.0, telemetry_s=telemetry_s, report_s=1.0,
                           checkpoint_root=base / "ckpt-load", work_dir=base / "load",
                           clock=clock)
    try:
        daemon = backend.spawn_daemon(list(cluster.nodes))
        backend.wait_for_nodes(timeout=60)
        d = BenchDriver(cluster, backend, clock, 5.0, is_report=_is_report)
        cpu_each = max(1, cpus * 1000 // (workloads + 1))
        for i in range(workloads):
            d.submit(_synthetic(f"load-{i}", priority="normal", cpu=f"{cpu_each}m",
                                memory=f"{per_mem}Mi",
                                args=["--work", "3600", "--memory", "8Mi", "--phases", "0.01:1",
                                      "--report-every", "1.0"]))
        d.until(lambda: all(d.state(f"load-{i}") is State.RUNNING for i in range(workloads)),
                120, "every workload to run")
        d.until(lambda: all(d.reported(f"load-{i}") for i in range(workloads)),
                120, "every workload to report")
        proc = psutil.Process(daemon.pid)
        me = psutil.Process()
        d.node_samples.clear()
        c0, m0 = proc.cpu_times(), me.cpu_times()
        t0 = time.monotonic()
        d.pump(measure_s)
        c1, m1 = proc.cpu_times(), me.cpu_times()
        wall = time.monotonic() - t0
        used = (c1.user + c1.system) - (c0.user + c0.system)
        engine = (m1.user + m1.system) - (m0.user + m0.system)
        running = sum(1 for i in range(workloads) if d.state(f"load-{i}") is State.RUNNING)
        return {
            "daemon_cpu_pct": round(100 * used / wall, 2),
            "engine_process_cpu_pct": round(100 * engine / wall, 2),
            "workloads_running": running,
            "measure_s": round(wall, 2),
            "telemetry_period_s": d.telemetry_period_s(),
            "telemetry_period_configured_s": telemetry_s,
        }
    finally:
        backend.close()


def run_bench(*, trials: int = 20, workloads: int = 50, measure_s: float = 10.0,
              grace_s: float = 5.0, telemetry_s: float = 1.0) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="mlwe-bench-local-"))
    try:
        out: dict[str, Any] = {"backend": "local", "cpus": usable_cpus()}
        out.update(bench_evict_to_place(trials, grace_s, base))
        out.update(bench_daemon_cpu(workloads, measure_s, telemetry_s, base))
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)
