"""``mlwe bench backend --backend slurm``: how fast the Slurm backend evicts and what it costs.

Measured on a real Slurm cluster started on this machine
(:class:`LocalSlurmCluster`: munged, slurmctld, one slurmd per node; needs
root and slurm-wlm) with real synthetic programs, driven through the real
control plane, scheduler and reconciler (the runtime Engine's loop):

- **evict to place**: a low-priority workload holds the whole ``evict-0`` node;
  an urgent one arrives. From the preemption decision (the victim's PREEMPTING)
  to the engine receiving the preemptor's ``Started`` (its program runs in its
  Slurm job). That spans ``scancel --signal=TERM``, the victim's checkpoint and
  exit, Slurm confirming the job over (squeue), ``sbatch`` of the preemptor,
  Slurm scheduling and launching it (slurmd, slurmstepd, srun, the task
  wrapper, the program). ``evict_to_place_*`` excludes the victim's own time
  between SIGTERM and its exit (as its task wrapper measured it);
  ``evict_to_place_total_*`` includes it.
- **start**: from the ``sbatch`` to ``Started``, ``start_to_running_*``; and the
  release leg, from the decision until Slurm confirmed the victim's job over,
  ``release_confirmed_*``.
- **overhead**: ``workloads`` synthetic workloads running at once as that many
  Slurm jobs. The engine process's CPU (its own threads: the backend's
  tailing of report files and parsing of squeue/sinfo JSON) and, separately,
  the Slurm commands it ran (squeue, sinfo, as children); the task wrappers'
  CPU per replica; slurmctld's CPU; squeue calls per second.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from mlwe.backends.benchkit import BenchDriver, MonotonicClock, evict_to_place, ms
from mlwe.backends.slurm.backend import SlurmBackend, SlurmBackendConfig
from mlwe.backends.slurm.cluster import LocalSlurmCluster, SlurmNode, slurm_missing
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
    why = slurm_missing()
    if why is not None:
        raise RuntimeError(f"the Slurm benchmark starts a Slurm cluster here: {why}")
    base = Path(tempfile.mkdtemp(prefix="mlwe-bench-slurm-"))
    nodes = (
        NodeSpec(name="evict-0", cpu="1", memory="2Gi", labels={"bench": "evict"}),
        NodeSpec(name="load-0", cpu=f"{max(1, workloads)}", memory=f"{64 * workloads + 64}Mi",
                 labels={"bench": "load"}),
    )
    cluster = ClusterSpec(nodes=nodes)
    t0 = time.monotonic()
    slurm = LocalSlurmCluster(
        [SlurmNode("evict-0", cpus=2, memory_mib=2048),
         SlurmNode("load-0", cpus=max(1, workloads), memory_mib=64 * workloads + 128)],
        base / "cluster")
    out: dict[str, Any] = {"backend": "slurm", "cpus": psutil.cpu_count(),
                           "slurm_cluster_start_s": round(time.monotonic() - t0, 2)}
    clock = MonotonicClock()
    backend = SlurmBackend(cluster, SlurmBackendConfig(
        prefix="bench", run_dir=str(base / "run"), slurm_conf=str(slurm.conf),
        telemetry_period_s=1.0), clock=clock)
    try:
        out["slurm_version"] = _version(backend)
        out["node_source"] = backend.slurm.node_source
        d = BenchDriver(cluster, backend, clock, grace_s, sample_node="load-0",
                        is_report=lambda m: "loss" in m or "step" in m)
        out.update(_evict_to_place(d, backend, trials, grace_s))
        out.update(_overhead(d, backend, slurm, workloads, measure_s))
        return out
    finally:
        backend.close()
        slurm.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def _version(backend: SlurmBackend) -> str:
    p = backend.slurm.run(["sinfo", "--version"], check=False)
    return p.stdout.strip()


def _evict_to_place(d: BenchDriver, backend: SlurmBackend, trials: int, grace_s: float
                    ) -> dict[str, Any]:
    starts: list[float] = []

    def stop_wait(victim: str) -> float:
        return float((backend.attempt_info(victim, 1) or {}).get("stop_wait_s") or 0.0)

    releases: list[float] = []  # victim PREEMPTING -> PREEMPTED (Slurm confirmed the job over)

    def record_starts(victim: str, urgent: str) -> None:
        for wid in (victim, urgent):
            s = (backend.attempt_info(wid, 1) or {}).get("started_s")
            if s is not None:
                starts.append(float(s))
        hist = {t.target: t.time for t in d.cp.get(victim).history}
        if State.PREEMPTING in hist and State.PREEMPTED in hist:
            releases.append(hist[State.PREEMPTED] - hist[State.PREEMPTING])

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
        "release_confirmed_p50_ms": ms(releases, 0.5),
        "release_confirmed_p99_ms": ms(releases, 0.99),
    }


def _overhead(d: BenchDriver, backend: SlurmBackend, slurm: LocalSlurmCluster, workloads: int,
              measure_s: float) -> dict[str, Any]:
    names = [f"load-{i}" for i in range(workloads)]
    for wid in names:
        d.submit(_synthetic(wid, priority="normal", cpu="1", node="load",
                            args=["--work", "3600", "--memory", "8Mi", "--phases", "0.01:1",
                                  "--report-every", "1.0"]))
    t0 = time.monotonic()
    d.until(lambda: all(d.state(w) is State.RUNNING for w in names), 900,
            "every workload to run")
    all_running_s = time.monotonic() - t0
    d.until(lambda: all(d.reported(w) for w in names), 120, "every workload to report")
    wrappers = _procs(lambda p: "mlwe.backends.slurm.task" in " ".join(p.cmdline()))
    ctld = _procs(lambda p: p.name() == "slurmctld" and str(slurm.conf) in " ".join(p.cmdline()))
    me = psutil.Process()
    w0, c0, m0, k0 = _sum(wrappers), _sum(ctld), _cpu(me), _children_cpu()
    q0 = backend.squeue_calls
    d.node_samples.clear()
    t1 = time.monotonic()
    d.pump(measure_s)
    wall = time.monotonic() - t1
    w1, c1, m1, k1 = _sum(wrappers), _sum(ctld), _cpu(me), _children_cpu()
    running = sum(1 for w in names if d.state(w) is State.RUNNING)
    rss = [p.memory_info().rss / 2**20 for p in wrappers if p.is_running()]
    figures = {
        "workloads_running": running,
        "all_running_s": round(all_running_s, 2),
        "engine_process_cpu_pct": round(100 * (m1 - m0) / wall, 2),
        "engine_slurm_commands_cpu_pct": round(100 * (k1 - k0) / wall, 2),
        "squeue_calls_per_s": round((backend.squeue_calls - q0) / wall, 2),
        "task_wrapper_cpu_pct_per_replica": round(100 * (w1 - w0) / wall / max(1, len(wrappers)),
                                                  3),
        "task_wrapper_rss_mib_per_replica": round(statistics.median(rss), 1) if rss else None,
        "slurmctld_cpu_pct": round(100 * (c1 - c0) / wall, 2),
        "measure_s": round(wall, 2),
        "node_telemetry_period_s": d.telemetry_period_s(),
    }
    for wid in names:
        d.cp.apply([Cancel(wid, "bench over")], cause_id="bench")
    d.until(lambda: all(d.state(w) is State.CANCELLED for w in names), 300, "the load to stop")
    return figures


def _procs(pred: Any) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if pred(p):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _sum(procs: list[psutil.Process]) -> float:
    return sum(_cpu(p) for p in procs)


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":  # python -m mlwe.backends.slurm.bench (same as the CLI)
    import json

    print(json.dumps(run_bench(trials=int(os.environ.get("TRIALS", "20"))), sort_keys=True))
