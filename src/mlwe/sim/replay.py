"""Replay a trace through the real control plane and policies on simulated time."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlwe.core.actions import Submit
from mlwe.core.cluster import build_control_plane
from mlwe.core.controlplane import ControlPlane
from mlwe.core.decisions import DecisionRecord
from mlwe.core.estimator import RuntimeEstimator
from mlwe.core.reconcile import Reconciler
from mlwe.sim.backend import SimBackend, SimBackendConfig
from mlwe.sim.baselines import POLICY_PLACEMENT, POLICY_SEMANTICS, make_policy
from mlwe.sim.checkpoint import DEFAULT_CHECKPOINT, CheckpointModel
from mlwe.sim.driver import Driver
from mlwe.sim.kernel import Kernel
from mlwe.sim.metrics import Metrics
from mlwe.sim.traces import Trace, TraceJob


@dataclass
class ReplayConfig:
    policy: str = "mlwe"
    seed: int = 0
    check_invariants: bool = True
    #: a full invariant sweep every N scheduling cycles (0: only at the end);
    #: the cheap check of what each batch touched always runs when checks are on
    full_check_every: int = 0
    grace_s: float = 30.0
    eviction_delay_s: float = 5.0
    failure_prob: float = 0.0
    node_failures: Sequence[tuple[float, str, float | None]] = ()
    keep_decisions: int = 0  # how many decision records to keep (memory); all are counted
    #: what a preemption costs trace jobs (a policy such as tiresias-free may force "free")
    checkpoint: CheckpointModel = DEFAULT_CHECKPOINT
    progress: Callable[[float, int, int], None] | None = None  # (sim time, done, events)


@dataclass
class ReplayResult:
    trace: str
    policy: str
    metrics: dict[str, Any]
    cp: ControlPlane
    series: list[tuple[float, float, int]]
    jcts: list[float]
    decisions: list[DecisionRecord] = field(default_factory=list)


def replay(trace: Trace, config: ReplayConfig | None = None) -> ReplayResult:
    cfg = config or ReplayConfig()
    kernel = Kernel()
    durations = {j.spec.id or j.job_id: j.duration for j in trace.jobs}
    kept: list[DecisionRecord] = []
    counts: dict[str, int] = {}

    def sink(rec: DecisionRecord) -> None:
        counts[rec.kind] = counts.get(rec.kind, 0) + 1
        if len(kept) < cfg.keep_decisions:
            kept.append(rec)

    # decisions are counted, not all kept: a replay makes millions
    cp = build_control_plane(
        trace.cluster, kernel.clock, catalog=trace.catalog,
        check_invariants=cfg.check_invariants, decision_sink=sink,
    )
    scheduler = make_policy(cfg.policy, durations)
    forced: CheckpointModel | None = getattr(scheduler, "checkpoint_model", None)
    ckpt = forced or cfg.checkpoint
    backend = SimBackend(
        kernel, durations,
        SimBackendConfig(eviction_delay_s=0.0 if ckpt.free else cfg.eviction_delay_s,
                         failure_prob=cfg.failure_prob, seed=cfg.seed,
                         free_preemption=ckpt.free),
    )
    # every report scores run-time estimates: the policy's own estimator where it
    # has one, else one that only watches (learning from completed jobs alike)
    estimator = getattr(scheduler, "estimator", None) or RuntimeEstimator()
    estimator.attach(cp)
    rec = Reconciler(cp, scheduler, grace_s=cfg.grace_s)
    total_gpus = sum(i.capacity.gpu for i in cp.capacity.nodes()) / 1000
    metrics = Metrics(cp, durations, total_gpus)
    for t, node, down in cfg.node_failures:
        backend.fail_node(t, node, down)

    def submit(job: TraceJob) -> None:
        res = cp.apply([Submit(ckpt.apply(job.spec))], cause_id=f"trace:{job.line}")
        if not res.accepted:
            raise ValueError(f"{trace.name}:{job.line}: rejected: {'; '.join(res.reasons())}")

    for job in trace.jobs:
        kernel.at(job.submit_time, submit, job)

    full_checks = [0]

    def full_check(_t: float) -> None:
        if cfg.full_check_every and rec.cycles and rec.cycles % cfg.full_check_every == 0:
            full_checks[0] += 1
            cp.assert_valid()

    def progress(t: float) -> None:
        assert cfg.progress is not None
        cfg.progress(t, len(metrics.jobs), kernel.events)

    # a policy that acts by time alone (a LAS demotion) names its next moment
    policy_wakeup = getattr(scheduler, "next_wakeup", None)
    # observers only (no hook proposes anything): no second step after them
    drv = Driver(
        kernel, rec, backend,
        after_step=[h for h, on in ((full_check, cfg.full_check_every),
                                    (progress, cfg.progress is not None)) if on],
        restep_after_hooks=False,
        scheduler_wakeup=None if policy_wakeup is None else lambda: policy_wakeup(cp),
    )

    wall0 = time.perf_counter()
    drv.run()
    wall = time.perf_counter() - wall0
    if cfg.check_invariants:
        cp.assert_valid()
    summary = metrics.summary(kernel.clock.t, backend.lost_gpu_s)
    jcts = [r.finish - r.submit for r in metrics.jobs.values()
            if r.state == "succeeded" and r.finish is not None]
    out = _figures(trace, cfg, ckpt=ckpt, forced=forced, wall=wall, kernel=kernel, rec=rec,
                   summary=summary, estimator=estimator, scheduler=scheduler, cp=cp, counts=counts)
    return ReplayResult(trace.name, cfg.policy, out, cp, metrics.series, jcts, kept)


def _figures(
    trace: Trace, cfg: ReplayConfig, *, ckpt: CheckpointModel, forced: CheckpointModel | None,
    wall: float, kernel: Kernel, rec: Reconciler, summary: dict[str, Any], estimator: Any,
    scheduler: Any, cp: ControlPlane, counts: dict[str, int],
) -> dict[str, Any]:
    """The replay's report: what ran (policy, checkpoint model, seed), how fast, the
    metrics' summary, the estimator's errors, and the checks and decisions made."""
    return {
        "trace": trace.name,
        "policy": cfg.policy,
        "policy_semantics": POLICY_SEMANTICS.get(cfg.policy, ""),
        "placement": POLICY_PLACEMENT.get(cfg.policy, ""),
        "checkpoint_model": ckpt.text(),
        "checkpoint_semantics": ckpt.describe()
        + (f" (forced by policy {cfg.policy})" if forced is not None and forced != cfg.checkpoint
           else ""),
        "seed": cfg.seed,
        "wall_s": round(wall, 3),
        "events": kernel.events,
        "events_per_s": round(kernel.events / wall) if wall else None,
        "jobs_per_s": round(len(trace.jobs) / wall, 1) if wall else None,
        "cycles": rec.cycles,
        **summary,
        **estimator.error_stats(),
        "estimator": (
            f"{estimator.name} (learned online from completed jobs only; min"
            f" {estimator.min_samples} runs per key; run times from the key whose own"
            f" predictions erred least once {estimator.min_errors} are scored) "
            + ("used by the policy" if getattr(scheduler, "estimator", None) is estimator
               else "scored only: the policy does not use it")
        ),
        "invariant_checks": cp.invariant_checks,
        "invariants": "on" if cfg.check_invariants else "OFF (profiling only)",
        "decisions": dict(sorted(counts.items())),
        "rejected_batches": len(rec.rejected),
        "trace_notes": list(trace.notes),
        "skipped_rows": trace.skipped,
    }
