"""Case study 2: inference scaling (after Scanflow's MLPerf study), run for real.

1. The ``digits-online`` pipeline trains a digits model (a batch step) and
   starts the ``serve`` service: real HTTP server processes, each replica its
   own workload scheduled by the engine on a node, in the ``inference`` queue
   whose quota bounds how many replicas can run;
2. a seeded synthetic load rises and falls (:mod:`mlwe.pipelines.loadgen`);
   the router spreads it over the replicas that run;
3. the infrastructure agent (``inference-scaler`` supervisor) reads the
   latency and the arrival rate every ``sensor_interval_s``, learns a
   replica's capacity from the service time the replicas report, and
   proposes the replica count that keeps the expected utilisation under
   ``target_utilisation`` (one more while p95 is over target; one fewer only
   after ``scale_down_after`` calm readings), within its bounds and the
   queue's quota. Every change is a proposal to the control plane: new
   replicas are submitted, surplus ones cancelled;
4. partway through, the node of a replica fails (its processes are killed and
   the node is reported lost): the router sends traffic to the other
   replicas, and the control plane requeues the lost replicas (a lost node is
   not their fault) and places them on the node that remains; the node comes
   back ``node_down_s`` later.

:func:`run` returns the figures (latency percentiles, replica range, requests,
errors, scaling events, the node failure and how long until the replicas were
back).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlwe.core.backend import Backend
from mlwe.core.clock import Clock
from mlwe.core.policies.placement import Spread
from mlwe.core.resources import parse_cpu_milli
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import ClusterSpec, NodeSpec, QueueSpec, ReplicaQuota
from mlwe.pipelines.loadgen import LoadGenerator, LoadProfile, Router, percentile
from mlwe.pipelines.loop import PipelineLoop
from mlwe.pipelines.programs import digitsdata as D
from mlwe.pipelines.runner import PipelineRunner, stream_listener
from mlwe.pipelines.spec import Pipeline, PipelineSpec
from mlwe.pipelines.supervision import (
    Decision,
    Interval,
    Observation,
    Supervisor,
    engine_sinks,
)
from mlwe.runtime.clock import WallClock
from mlwe.runtime.engine import Engine, EngineConfig

DIGITS = ["${python}", "-m", "mlwe.pipelines.programs.digits"]
SERVER = ["${python}", "-m", "mlwe.pipelines.programs.infer_server"]
QUEUE = "inference"


@dataclass
class ScalingConfig:
    seed: int = 0
    duration_s: float = 40.0
    base_rps: float = 15.0
    peak_rps: float = 150.0
    service_ms: float = 20.0
    latency_target_ms: float = 100.0
    min_replicas: int = 1
    max_replicas: int = 6
    replica_cpu: str = "500m"
    quota_cpu: str = "3"  # the inference queue's nominal CPU: 6 replicas of 500m
    target_utilisation: float = 0.6
    scale_down_after: int = 4  # calm readings in a row before one replica goes
    sensor_interval_s: float = 0.5
    window_s: float = 2.0  # latency percentiles over this window
    rate_window_s: float = 1.0  # arrival rate over this (shorter: less lag on a ramp)
    fail_node_at: float = 0.5  # fraction of the load's duration; negative: no failure
    node_down_s: float = 8.0
    timeout_s: float = 150.0


def online_pipeline(cfg: ScalingConfig) -> PipelineSpec:
    p = Pipeline(
        "digits-online",
        params={"seed": cfg.seed, "service_ms": cfg.service_ms},
        defaults={"resources": {"cpu": "500m", "memory": "512Mi"}},
        description="train a digits model, then serve it over HTTP",
    )
    prep = p.step(
        "prepare",
        [*DIGITS, "prepare", "--seed", "${params.seed}", "--train-out", "${outputs.train}",
         "--holdout-out", "${outputs.holdout}", "--metrics", "${metrics}"],
        outputs={"train": "data/train.npz", "holdout": "data/holdout.npz"},
        workload={"kind": "data-processing"},
    )
    train = p.step(
        "train",
        [*DIGITS, "train-linear", "--data", "${inputs.data}",
         "--model-out", "${outputs.model}", "--metrics", "${metrics}"],
        inputs={"data": prep.output("train")},
        outputs={"model": "model/model.npz"},
        workload={"kind": "training"},
    )
    p.step(
        "serve",
        [*SERVER, "--model", "${inputs.model}",
         "--endpoint", "${endpoint}", "--service-ms", "${params.service_ms}"],
        kind="service",
        replicas=cfg.min_replicas,
        retries=5,
        inputs={"model": train.output("model")},
        workload={
            "queue": QUEUE,
            "priority": "high",
            "resources": {"cpu": cfg.replica_cpu, "memory": "256Mi"},
        },
    )
    return p.build()


def cluster(cfg: ScalingConfig) -> ClusterSpec:
    return ClusterSpec(
        nodes=(
            NodeSpec(name="node-a", cpu="1500m", memory="2Gi"),
            NodeSpec(name="node-b", cpu="1500m", memory="2Gi"),
            NodeSpec(name="node-c", cpu="1500m", memory="2Gi"),
        ),
        queues=(QueueSpec(name=QUEUE, nominal=ReplicaQuota(cpu=cfg.quota_cpu)),),
    )


def build_scaler(
    sup: Supervisor, cfg: ScalingConfig, run_id: str, load: LoadGenerator, engine: Engine,
    events: list[dict[str, Any]],
) -> None:
    """The infrastructure agent: latency sensor and the scale-to-latency rule."""
    runner = sup.runner
    assert runner is not None
    st = sup.state
    st.update(calm=0)
    replica_cpu = parse_cpu_milli(cfg.replica_cpu)

    def quota_replicas() -> int:
        with engine.lock:
            q = engine.cp.queues[QUEUE]
        return max(0, q.nominal.cpu // replica_cpu)

    def read(s: Supervisor, ev: Any) -> Observation | None:
        if load.t0 is None or load.done.is_set():
            return None
        w = load.window(cfg.window_s)
        w["rate_rps"] = load.window(cfg.rate_window_s)["rate_rps"]
        target = runner.replica_target(run_id, "serve")
        ready = len(runner.endpoints(run_id, "serve"))
        live = len(runner.live_replicas(run_id, "serve"))
        return Observation(
            "latency",
            f"p95 {w['p95_ms'] or 0:.0f} ms at {w['rate_rps']:.0f} req/s;"
            f" {ready} ready / {live} live / target {target}",
            evidence={**w, "ready": ready, "live": live, "target": target,
                      "quota_replicas": quota_replicas(), "t": round(load.elapsed(), 3)},
            subject=f"{run_id}/serve",
        )

    def decide(s: Supervisor, obs: Observation) -> Decision | None:
        e = obs.evidence
        svc = e["service_ms"]
        if svc is None or e["requests"] < 5:
            return None  # nothing measured yet: no grounds for a change
        per_replica = 1000.0 / svc  # requests per second one replica can serve
        need = math.ceil(e["rate_rps"] / (per_replica * cfg.target_utilisation))
        target = e["target"]
        p95 = e["p95_ms"]
        if p95 is not None and p95 > cfg.latency_target_ms:
            need = max(need, target + 1)
        upper = min(cfg.max_replicas, e["quota_replicas"])
        need = max(cfg.min_replicas, min(upper, need))
        considered = (f"keep {target}", f"scale to {need}")
        if need > target:
            st["calm"] = 0
            why = (
                f"{e['rate_rps']:.0f} req/s over {per_replica:.0f} req/s per replica at"
                f" {cfg.target_utilisation:.0%} utilisation needs {need}; p95"
                f" {p95 or 0:.0f} ms (target {cfg.latency_target_ms:.0f} ms)"
            )
        elif need < target:
            st["calm"] += 1
            if st["calm"] < cfg.scale_down_after:
                return None
            st["calm"] = 0
            need = target - 1  # down one at a time
            why = (
                f"{e['rate_rps']:.0f} req/s needs fewer than {target} replicas for"
                f" {cfg.scale_down_after} readings; p95 {p95 or 0:.0f} ms"
            )
        else:
            st["calm"] = 0
            return None
        events.append({"t": e["t"], "from": target, "to": need, "rate_rps": round(
            e["rate_rps"], 1), "p95_ms": None if p95 is None else round(p95, 1)})
        return Decision(
            "scale-service", {"run_id": run_id, "step": "serve", "replicas": need},
            rationale=why, considered=considered,
        )

    sup.sensor("latency", read, Interval(cfg.sensor_interval_s))
    sup.rule("scale-to-latency", "latency", decide)


def run(
    data_dir: str | Path | None = None,
    cfg: ScalingConfig | None = None,
    *,
    backend: Backend | None = None,
    clock: Clock | None = None,
) -> dict[str, Any]:
    """Run the case study; returns its figures (see the module docstring)."""
    cfg = cfg or ScalingConfig()
    own_dir = data_dir is None
    ddir = Path(data_dir or tempfile.mkdtemp(prefix="mlwe-scaling-")).resolve()
    ddir.mkdir(parents=True, exist_ok=True)
    clock = clock or WallClock()
    if backend is None:
        from mlwe.pipelines.drift_retrain import default_backend

        backend = default_backend(clock, ddir, cluster(cfg))
    engine = Engine.open(
        cluster(cfg), backend, data_dir=ddir, clock=clock,
        config=EngineConfig(retry_base_s=0.3, retry_max_s=2.0, grace_s=2.0, tick_s=0.05),
        # spread placement: a service's replicas land on different nodes, so a node's
        # failure takes only its share of them
        scheduler=Scheduler(placement=Spread()),
    )
    runner = PipelineRunner(engine, ddir)
    runner.listeners.append(stream_listener(engine.streams.publish, runner))
    audit, reasoning = engine_sinks(engine)
    sup = Supervisor("inference-scaler", clock=clock.now, runner=runner, audit=audit,
                     reasoning=reasoning)
    X, _ = D.load()
    payloads = [[float(v) for v in row] for row in X[:500]]
    load = LoadGenerator(
        LoadProfile(cfg.duration_s, cfg.base_rps, cfg.peak_rps, seed=cfg.seed), Router(), payloads
    )
    events: list[dict[str, Any]] = []
    samples: list[tuple[float, int, int]] = []  # (t, target, ready)
    failure: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        rec = runner.start(online_pipeline(cfg), actor="user")
        run_id = rec.id
        build_scaler(sup, cfg, run_id, load, engine, events)

        def refresh() -> None:
            eps = runner.endpoints(run_id, "serve") if runner.status(run_id) in (
                "running", "serving") else []
            load.router.set_endpoints([e.url for e in eps])
            if load.t0 is not None and not load.done.is_set():
                samples.append((load.elapsed(), runner.replica_target(run_id, "serve"),
                                len(eps)))
                _maybe_fail_node(cfg, runner, run_id, load, backend, engine, failure, eps)

        loop = PipelineLoop(engine, runner, [sup], period_s=0.05, extra=[refresh])
        if not loop.run_until(lambda: runner.status(run_id) in ("serving", "failed"), 60):
            raise TimeoutError("the inference service did not come up within 60 s")
        if runner.status(run_id) == "failed":
            raise RuntimeError(f"pipeline {run_id} failed: {runner.run(run_id).to_dict()}")
        load.start()
        loop.run_until(load.done.is_set, cfg.duration_s + 60)
        runner.stop(run_id, reason="load finished")
        loop.run_until(lambda: runner.status(run_id) not in ("serving", "running"), 15)
        result = _figures(cfg, load, events, samples, failure, sup)
        result["errors_loop"] = loop.errors[:20]
        result["seconds_total"] = round(time.monotonic() - t0, 3)
    finally:
        engine.close(stop_workloads=True)
        if own_dir:
            shutil.rmtree(ddir, ignore_errors=True)
    result["config"] = asdict(cfg)
    return result


def _maybe_fail_node(
    cfg: ScalingConfig, runner: PipelineRunner, run_id: str, load: LoadGenerator,
    backend: Backend, engine: Engine, failure: dict[str, Any], eps: list[Any],
) -> None:
    if cfg.fail_node_at < 0:
        return
    t = load.elapsed()
    if not failure and t >= cfg.fail_node_at * cfg.duration_s and eps:
        fail = getattr(backend, "fail_node", None)
        if fail is None:
            failure["skipped"] = f"backend {getattr(backend, 'name', '?')} cannot fail a node"
            return
        per_node: dict[str, list[str]] = {}
        for e in eps:
            for n in e.nodes:
                per_node.setdefault(n, []).append(e.workload)
        # the node with the fewest replicas that has one: a replica's node, not every one
        node = min(per_node, key=lambda n: (len(per_node[n]), n))
        failure.update(t=round(t, 3), node=node, replicas_lost=len(per_node[node]),
                       lost=sorted(per_node[node]), ready_before=len(eps))
        fail(node)
    elif failure and "t" in failure:
        if "replaced_after_s" not in failure:
            # replaced: as many replicas answer as before, none of them on the dead node
            elsewhere = [e for e in eps if failure["node"] not in e.nodes]
            if len(elsewhere) >= failure["ready_before"]:
                failure["replaced_after_s"] = round(t - failure["t"], 3)
                failure["replaced_on"] = sorted({n for e in elsewhere for n in e.nodes})
        if "recovered" not in failure and t >= failure["t"] + cfg.node_down_s:
            recover = getattr(backend, "recover_node", None)
            if recover is not None:
                recover(failure["node"])
                failure["recovered"] = round(t, 3)


def _figures(
    cfg: ScalingConfig, load: LoadGenerator, events: list[dict[str, Any]],
    samples: list[tuple[float, int, int]], failure: dict[str, Any], sup: Supervisor,
) -> dict[str, Any]:
    recs = load.snapshot()
    ok = [r.latency_ms for r in recs if r.ok]
    d = cfg.duration_s
    prof = LoadProfile(cfg.duration_s, cfg.base_rps, cfg.peak_rps, seed=cfg.seed)
    (r0, r1), (f0, f1) = prof.rise, prof.fall
    phases: dict[str, Callable[[float], bool]] = {
        "base": lambda t: t < r0 * d or t >= f1 * d,
        "rise": lambda t: r0 * d <= t < r1 * d,
        "peak": lambda t: r1 * d <= t < f0 * d,
        "fall": lambda t: f0 * d <= t < f1 * d,
    }
    by_phase = {
        name: _round(percentile([r.latency_ms for r in recs if r.ok and f(r.sent)], 95))
        for name, f in phases.items()
    }
    windows = []
    for k in range(int(d // 2)):
        lat = [r.latency_ms for r in recs if r.ok and 2 * k <= r.sent < 2 * (k + 1)]
        p = percentile(lat, 95)
        if p is not None:
            windows.append(p)
    targets = [s[1] for s in samples]
    ready = [s[2] for s in samples]
    return {
        "p95_latency_ms": _round(percentile(ok, 95)),
        "p50_latency_ms": _round(percentile(ok, 50)),
        "p99_latency_ms": _round(percentile(ok, 99)),
        "latency_target_ms": cfg.latency_target_ms,
        "max_replicas": max(targets) if targets else None,
        "min_replicas": min(targets) if targets else None,
        "max_ready_replicas": max(ready) if ready else None,
        "min_ready_replicas": min(ready) if ready else None,
        "replica_bounds": [cfg.min_replicas, cfg.max_replicas],
        "requests": len(recs),
        "errors": sum(1 for r in recs if not r.ok),
        "retried_requests": sum(1 for r in recs if r.retries),
        "p95_by_phase_ms": by_phase,
        "windows_over_target": sum(1 for p in windows if p > cfg.latency_target_ms),
        "windows": len(windows),
        "scale_events": events,
        "node_failure": failure,
        "peak_rps": cfg.peak_rps,
        "supervision_records": len(sup.records),
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
