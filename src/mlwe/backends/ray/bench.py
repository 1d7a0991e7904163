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

from mlwe.backends.ray.backend import RayBackend, RayBackendConfig
from mlwe.backends.ray.cluster import LocalRayCluster
from mlwe.core.actions import Cancel, Started, Submit
from mlwe.core.cluster import build_control_plane
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.reconcile import Reconciler
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec


class _Clock:
    def now(self) -> float:
        return time.monotonic()


class _Driver:
    """The engine's loop over one RayBackend."""

    def __init__(self, cluster: ClusterSpec, backend: RayBackend, clock: _Clock,
                 grace_s: float) -> None:
        self.cp = build_control_plane(cluster, clock, check_invariants=False)
        self.rec = Reconciler(self.cp, Scheduler(), grace_s=grace_s)
        self.backend = backend
        self.started_at: dict[tuple[str, int], float] = {}
        self.reported: set[str] = set()
        self.node_samples: list[float] = []

    def step(self) -> None:
        events = self.backend.poll()
        now = time.monotonic()
        for ev in events:
            if isinstance(ev.fact, Started):
                self.started_at[(ev.fact.workload, ev.fact.attempt)] = now
        self.rec.handle(events)
        commands = self.rec.step()
        if commands:
            self.backend.send(commands)
        for t in self.backend.drain_telemetry():
            if t.workload is None and t.node == "load-0":  # one node: one sample per period
                self.node_samples.append(time.monotonic())
            elif t.workload is not None and ("loss" in t.metrics or "step" in t.metrics):
                self.reported.add(t.workload)

    def until(self, pred: Any, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                raise RuntimeError(f"bench: timed out waiting for {what};"
                                   f" backend errors: {self.backend.errors[-3:]}")
            self.step()
            time.sleep(0.005)

    def state(self, wid: str) -> State:
        return self.cp.get(wid).state

    def submit(self, spec: WorkloadSpec) -> None:
        r = self.cp.apply([Submit(spec)], cause_id="bench")
        if not r.accepted:
            raise RuntimeError("; ".join(r.reasons()))


def _synthetic(wid: str, *, priority: str, cpu: str, node: str, args: list[str]) -> WorkloadSpec:
    return WorkloadSpec.model_validate({
        "id": wid, "name": wid, "priority": priority, "max_retries": 0,
        "resources": {"cpu": cpu, "memory": "64Mi"}, "node_selector": {"bench": node},
        "command": [sys.executable, "-m", "mlwe.programs.synthetic", *args],
    })


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _ms(values: list[float], q: float) -> float:
    return round(1000 * (statistics.median(values) if q == 0.5 else _pct(values, q)), 1)


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
    clock = _Clock()
    backend = RayBackend(cluster, RayBackendConfig(
        prefix="bench", checkpoint_root=str(base / "ckpt"), log_root=str(base / "logs"),
        telemetry_period_s=1.0, close_grace_s=0.0), clock=clock)
    try:
        d = _Driver(cluster, backend, clock, grace_s)
        out.update(_evict_to_place(d, trials, grace_s))
        out.update(_overhead(d, workloads, measure_s))
        return out
    finally:
        backend.close()
        ray_cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def _evict_to_place(d: _Driver, trials: int, grace_s: float) -> dict[str, Any]:
    decided: dict[str, float] = {}

    def on_transition(w: Workload, tr: Transition) -> None:
        if tr.target is State.PREEMPTING:
            decided[w.preempted_by or ""] = time.monotonic()

    d.cp.listeners.append(on_transition)
    net: list[float] = []
    totals: list[float] = []
    stops: list[float] = []
    starts: list[float] = []
    for i in range(trials):
        victim, urgent = f"victim-{i}", f"urgent-{i}"
        d.submit(_synthetic(victim, priority="low", cpu="1", node="evict",
                            args=["--work", "600", "--memory", "16Mi", "--phases", "0.05:1",
                                  "--report-every", "0.1"]))
        # its first report: the program is up and has its SIGTERM hook
        d.until(lambda v=victim: v in d.reported, 120, f"{victim} to report")
        d.submit(_synthetic(urgent, priority="urgent", cpu="1", node="evict",
                            args=["--work", "0.05", "--memory", "1Mi"]))
        d.until(lambda u=urgent: (u, 1) in d.started_at, 120, f"{urgent} to start")
        total = d.started_at[(urgent, 1)] - decided[urgent]
        info = d.backend.attempt_info(victim, 1) or {}
        wait = float(info.get("stop_wait_s") or 0.0)
        totals.append(total)
        net.append(total - wait)
        stops.append(wait)
        for wid in (victim, urgent):
            s = (d.backend.attempt_info(wid, 1) or {}).get("started_s")
            if s is not None:
                starts.append(float(s))
        d.until(lambda u=urgent: d.state(u) is State.SUCCEEDED, 120, f"{urgent} to finish")
        d.cp.apply([Cancel(victim, "bench trial over")], cause_id="bench")
        d.until(lambda v=victim: d.state(v) is State.CANCELLED, 120, f"{victim} to stop")
    return {
        "evict_to_place_p50_ms": _ms(net, 0.5),
        "evict_to_place_p99_ms": _ms(net, 0.99),
        "evict_to_place_total_p50_ms": _ms(totals, 0.5),
        "evict_to_place_total_p99_ms": _ms(totals, 0.99),
        "victim_sigterm_to_exit_p50_ms": _ms(stops, 0.5),
        "start_to_running_p50_ms": _ms(starts, 0.5),
        "start_to_running_p99_ms": _ms(starts, 0.99),
        "evict_trials": trials,
        "grace_s": grace_s,
    }


def _overhead(d: _Driver, workloads: int, measure_s: float) -> dict[str, Any]:
    names = [f"load-{i}" for i in range(workloads)]
    for wid in names:
        d.submit(_synthetic(wid, priority="normal", cpu="1", node="load",
                            args=["--work", "3600", "--memory", "8Mi", "--phases", "0.01:1",
                                  "--report-every", "1.0"]))
    t0 = time.monotonic()
    d.until(lambda: all(d.state(w) is State.RUNNING for w in names), 600,
            "every workload to run")
    all_running_s = time.monotonic() - t0
    d.until(lambda: all(w in d.reported for w in names), 120, "every workload to report")
    actors = []
    for wid in names:
        info = d.backend.attempt_info(wid, 1) or {}
        for r in info.get("replicas", ()):
            if r.get("actor_pid"):
                actors.append(psutil.Process(r["actor_pid"]))
    me = psutil.Process()
    a0 = sum(_cpu(p) for p in actors)
    m0 = _cpu(me)
    d.node_samples.clear()
    t1 = time.monotonic()
    end = t1 + measure_s
    while time.monotonic() < end:
        d.step()
        time.sleep(0.05)
    wall = time.monotonic() - t1
    a1 = sum(_cpu(p) for p in actors)
    m1 = _cpu(me)
    rss = [p.memory_info().rss / 2**20 for p in actors if p.is_running()]
    gaps = [b - a for a, b in zip(d.node_samples, d.node_samples[1:], strict=False)]
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
        "telemetry_period_s": round(statistics.median(gaps), 3) if gaps else None,
        "telemetry_period_configured_s": d.backend.config.telemetry_period_s,
    }


def _cpu(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0
