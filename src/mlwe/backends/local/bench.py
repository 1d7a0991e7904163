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
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from mlwe.backends.local.backend import LocalBackend
from mlwe.backends.local.telemetry import machine_memory_mib, usable_cpus
from mlwe.core.actions import Cancel, Started, Submit
from mlwe.core.cluster import build_control_plane
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.reconcile import Reconciler
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec


class _Clock:
    def now(self) -> float:
        return time.monotonic()


class _Driver:
    """The engine's loop, reacting as soon as the backend has an event."""

    def __init__(self, cluster: ClusterSpec, backend: LocalBackend, clock: _Clock,
                 grace_s: float) -> None:
        self.cp: ControlPlane = build_control_plane(cluster, clock, check_invariants=False)
        self.rec = Reconciler(self.cp, Scheduler(), grace_s=grace_s)
        self.backend = backend
        self.started_at: dict[tuple[str, int], float] = {}
        self.reports: dict[str, int] = {}
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
            if t.workload is None:
                self.node_samples.append(time.monotonic())
            elif "replica" in t.metrics:
                self.reports[t.workload] = self.reports.get(t.workload, 0) + 1

    def until(self, pred: Any, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > end:
                states = {w.id: w.state.value for w in list(self.cp.workloads.values())[:10]}
                raise RuntimeError(f"bench: timed out waiting for {what} ({states})")
            self.step()
            self.backend.wait(0.01)

    def state(self, wid: str) -> State:
        return self.cp.get(wid).state

    def submit(self, spec: WorkloadSpec) -> None:
        r = self.cp.apply([Submit(spec)], cause_id="bench")
        if not r.accepted:
            raise RuntimeError("; ".join(r.reasons()))


def _synthetic(wid: str, *, priority: str, cpu: str, memory: str, args: list[str]) -> WorkloadSpec:
    return WorkloadSpec.model_validate({
        "id": wid, "name": wid, "priority": priority, "max_retries": 0,
        "resources": {"cpu": cpu, "memory": memory},
        "command": ["python", "-m", "mlwe.programs.synthetic", *args],
    })


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def bench_evict_to_place(trials: int, grace_s: float, base: Path) -> dict[str, Any]:
    cluster = ClusterSpec(nodes=(NodeSpec(name="evict-0", cpu="1", memory="2Gi"),))
    clock = _Clock()
    backend = LocalBackend(cluster, heartbeat_s=1.0, telemetry_s=1.0, report_s=0.2,
                           checkpoint_root=base / "ckpt-evict", work_dir=base / "evict",
                           clock=clock)
    try:
        backend.spawn_daemon(list(cluster.nodes))
        backend.wait_for_nodes(timeout=60)
        d = _Driver(cluster, backend, clock, grace_s)
        decided: dict[str, float] = {}

        def on_transition(w: Workload, tr: Transition) -> None:
            if tr.target is State.PREEMPTING:
                decided[w.preempted_by or ""] = time.monotonic()

        d.cp.listeners.append(on_transition)
        totals: list[float] = []
        net: list[float] = []
        stops: list[float] = []
        for i in range(trials):
            victim, urgent = f"victim-{i}", f"urgent-{i}"
            d.submit(_synthetic(victim, priority="low", cpu="1", memory="64Mi",
                                args=["--work", "600", "--memory", "32Mi", "--phases", "0.05:1",
                                      "--report-every", "0.1"]))
            # wait for its first report: the program is up and has its SIGTERM hook
            d.until(lambda v=victim: d.reports.get(v, 0) > 0, 60, f"{victim} to report")
            d.submit(_synthetic(urgent, priority="urgent", cpu="1", memory="64Mi",
                                args=["--work", "0.05", "--memory", "1Mi"]))
            d.until(lambda u=urgent: (u, 1) in d.started_at, 60, f"{urgent} to start")
            total = d.started_at[(urgent, 1)] - decided[urgent]
            wait = backend.stop_wait_s(victim, 1) or 0.0
            totals.append(total * 1000)
            net.append((total - wait) * 1000)
            stops.append(wait * 1000)
            d.until(lambda u=urgent: d.state(u) is State.SUCCEEDED, 60, f"{urgent} to finish")
            d.cp.apply([Cancel(victim, "bench trial over")], cause_id="bench")
            d.until(lambda v=victim: d.state(v) is State.CANCELLED, 60, f"{victim} to stop")
        return {
            "evict_to_place_p50_ms": round(statistics.median(net), 1),
            "evict_to_place_p99_ms": round(_pct(net, 0.99), 1),
            "evict_to_place_total_p50_ms": round(statistics.median(totals), 1),
            "evict_to_place_total_p99_ms": round(_pct(totals, 0.99), 1),
            "victim_sigterm_to_exit_p50_ms": round(statistics.median(stops), 1),
            "evict_trials": trials,
            "grace_s": grace_s,
        }
    finally:
        backend.close()


def bench_daemon_cpu(workloads: int, measure_s: float, telemetry_s: float, base: Path
                     ) -> dict[str, Any]:
    cpus = usable_cpus()
    per_mem = 48
    mem_mib = min(machine_memory_mib() // 2, workloads * per_mem + 1024)
    cluster = ClusterSpec(nodes=(NodeSpec(name="load-0", cpu=f"{cpus}", memory=f"{mem_mib}Mi"),))
    clock = _Clock()
    backend = LocalBackend(cluster, heartbeat_s=1.0, telemetry_s=telemetry_s, report_s=1.0,
                           checkpoint_root=base / "ckpt-load", work_dir=base / "load",
                           clock=clock)
    try:
        daemon = backend.spawn_daemon(list(cluster.nodes))
        backend.wait_for_nodes(timeout=60)
        d = _Driver(cluster, backend, clock, 5.0)
        cpu_each = max(1, cpus * 1000 // (workloads + 1))
        for i in range(workloads):
            d.submit(_synthetic(f"load-{i}", priority="normal", cpu=f"{cpu_each}m",
                                memory=f"{per_mem}Mi",
                                args=["--work", "3600", "--memory", "8Mi", "--phases", "0.01:1",
                                      "--report-every", "1.0"]))
        d.until(lambda: all(d.state(f"load-{i}") is State.RUNNING for i in range(workloads)),
                120, "every workload to run")
        d.until(lambda: all(d.reports.get(f"load-{i}", 0) > 0 for i in range(workloads)),
                120, "every workload to report")
        proc = psutil.Process(daemon.pid)
        me = psutil.Process()
        d.node_samples.clear()
        c0, m0 = proc.cpu_times(), me.cpu_times()
        t0 = time.monotonic()
        end = t0 + measure_s
        while time.monotonic() < end:
            d.step()
            backend.wait(0.05)
        c1, m1 = proc.cpu_times(), me.cpu_times()
        wall = time.monotonic() - t0
        used = (c1.user + c1.system) - (c0.user + c0.system)
        engine = (m1.user + m1.system) - (m0.user + m0.system)
        gaps = [b - a for a, b in zip(d.node_samples, d.node_samples[1:], strict=False)]
        running = sum(1 for i in range(workloads) if d.state(f"load-{i}") is State.RUNNING)
        return {
            "daemon_cpu_pct": round(100 * used / wall, 2),
            "engine_process_cpu_pct": round(100 * engine / wall, 2),
            "workloads_running": running,
            "measure_s": round(wall, 2),
            "telemetry_period_s": round(statistics.median(gaps), 3) if gaps else None,
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
