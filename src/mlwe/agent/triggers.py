"""Analyze: triggers, each a small plug-in with a name, a condition and evidence.

A trigger reads the monitor's memory, the telemetry window and the control
plane (read only) and returns :class:`~mlwe.agent.model.Finding` values. When
it runs is its :class:`Schedule`: on new telemetry, on new lifecycle events,
every N seconds, or on a cron expression (croniter, on the engine's clock),
as Scanflow's sensors do. Triggers are registered explicitly
(:func:`default_triggers`), never by import side effects.

Built in: deadline at risk; loss NaN, diverging, plateaued; progress stalled;
repeated failures triaged by cause (out-of-memory, code error, node); node
unhealthy, lost or flapping; a workload starving in its queue; GPUs
fragmented, or idle while work waits; utilisation far below allocation; an
inference service overloaded or idle.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from croniter import croniter  # type: ignore[import-untyped]

from mlwe.agent.model import Finding
from mlwe.agent.monitor import FailureRecord, Monitor
from mlwe.core.capacity import FULL
from mlwe.core.controlplane import NOT_ITS_FAULT, ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload, shape_of
from mlwe.core.policies.deadline import DeadlineStatus, accepted_models
from mlwe.core.resources import format_duration
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import NodeStatus, WorkloadKind

#: The label that groups inference replicas into one service.
SERVICE_LABEL = "mlwe.service"


@dataclass(frozen=True, slots=True)
class Schedule:
    """When a trigger runs: on news (telemetry, events), by interval, or by cron."""

    on_telemetry: bool = False
    on_events: bool = False
    every_s: float | None = None
    cron: str | None = None

    def __post_init__(self) -> None:
        if self.every_s is not None and not self.every_s > 0:
            raise ValueError(f"every_s must be positive, got {self.every_s}")
        if self.cron is not None and not croniter.is_valid(self.cron):
            raise ValueError(f"invalid cron expression {self.cron!r}")
        if not (self.on_telemetry or self.on_events or self.every_s or self.cron):
            raise ValueError("a schedule needs at least one of on_telemetry, on_events, every_s, cron")

    def describe(self) -> str:
        parts = []
        if self.on_telemetry:
            parts.append("on telemetry")
        if self.on_events:
            parts.append("on events")
        if self.every_s:
            parts.append(f"every {format_duration(self.every_s)}")
        if self.cron:
            parts.append(f"cron '{self.cron}'")
        return ", ".join(parts)


@dataclass
class AnalyzeConfig:
    deadline_checks: int = 20  # queued deadline workloads checked per run (least slack first)
    loss_min_points: int = 6
    diverge_ratio: float = 0.5  # loss above the best seen by this fraction, and rising
    plateau_window_s: float = 3600.0
    plateau_min_improvement: float = 0.005  # relative improvement over the window
    stall_s: float = 1800.0
    hung_util: float = 0.02  # GPU utilisation below this for stall_s: hung
    min_failures: int = 2
    oom_memory_fraction: float = 0.95  # memory use at this fraction of the request: OOM-bound
    node_temp_c: float = 90.0
    node_window_s: float = 3600.0
    node_failures_distinct: int = 2  # distinct workloads failing on one node in the window
    flapping_losses: int = 2
    starve_s: float = 2 * 3600.0
    low_util: float = 0.15
    low_util_window_s: float = 1800.0
    overload_util: float = 0.9
    idle_service_util: float = 0.1


@dataclass
class Context:
    cp: ControlPlane
    monitor: Monitor
    scheduler: Scheduler
    config: AnalyzeConfig = field(default_factory=AnalyzeConfig)

    @property
    def now(self) -> float:
        return self.cp.now()


class Trigger(Protocol):
    name: str
    schedule: Schedule

    def check(self, ctx: Context) -> list[Finding]: ...


# ===================================================================== helpers
def _gpus(w: Workload) -> float:
    return w.spec.resources.gpu * w.spec.replicas / FULL


def _running(cp: ControlPlane) -> Iterable[Workload]:
    for w in cp.workloads.values():
        if w.state is State.RUNNING:
            yield w


def _window(series: Sequence[tuple[float, float]], since: float) -> list[float]:
    return [v for t, v in series if t >= since]


# =================================================================== deadlines
class DeadlineAtRisk:
    name = "deadline-at-risk"
    schedule = Schedule(on_events=True, every_s=300.0)

    def check(self, ctx: Context) -> list[Finding]:
        cp, now = ctx.cp, ctx.now
        waiting = [w for w in cp.queued_workloads() if w.deadline is not None]
        waiting.sort(key=lambda w: (w.deadline or 0.0, w.seq))
        out = []
        for w in waiting[: ctx.config.deadline_checks]:
            v = ctx.scheduler.admission(cp, w)
            if v.status not in (DeadlineStatus.AT_RISK, DeadlineStatus.INFEASIBLE):
                continue
            lost = "even on an empty cluster" in v.reason
            assert w.deadline is not None
            out.append(
                Finding(
                    self.name, w.id, "workload",
                    f"{w.id}: deadline {v.status.value} ({v.reason})",
                    severity=0.4 if lost else (0.9 if v.status is DeadlineStatus.INFEASIBLE else 0.7),
                    evidence={
                        "status": v.status.value,
                        "reason": v.reason,
                        "deadline_in_s": w.deadline - now,
                        "earliest_completion_in_s": v.earliest_completion - now,
                        "priority": w.priority,
                        "lost_cause": lost,
                        "pending_reason": w.pending_reason,
                    },
                    time=now,
                )
            )
        return out


# ======================================================================== loss
def _loss_series(ctx: Context, w: Workload) -> list[tuple[float, float]]:
    return ctx.monitor.telemetry.series("loss", workload=w.id)


class LossNaN:
    name = "loss-nan"
    schedule = Schedule(on_telemetry=True)

    def check(self, ctx: Context) -> list[Finding]:
        out = []
        for w in _running(ctx.cp):
            s = _loss_series(ctx, w)[-3:]
            bad = [v for _, v in s if not math.isfinite(v)]
            if bad:
                out.append(
                    Finding(self.name, w.id, "workload",
                            f"{w.id}: loss is {bad[-1]} (not a number) in the latest samples",
                            severity=0.95, evidence={"last_losses": [v for _, v in s]},
                            time=ctx.now, cause="numerics")
                )
        return out


class LossDiverging:
    name = "loss-diverging"
    schedule = Schedule(on_telemetry=True)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        out = []
        for w in _running(ctx.cp):
            s = [(t, v) for t, v in _loss_series(ctx, w) if math.isfinite(v)]
            if len(s) < cfg.loss_min_points:
                continue
            values = [v for _, v in s]
            best = min(values)
            tail = values[-3:]
            last = statistics.fmean(tail)
            rising = all(b > a for a, b in itertools.pairwise(tail))
            if best > 0 and last > best * (1 + cfg.diverge_ratio) and rising:
                out.append(
                    Finding(self.name, w.id, "workload",
                            f"{w.id}: loss {last:.3g} is {last / best - 1:.0%} above its best"
                            f" {best:.3g} and still rising",
                            severity=0.8,
                            evidence={"best": best, "last": last, "tail": tail,
                                      "samples": len(values)},
                            time=ctx.now, cause="diverged")
                )
        return out


class LossPlateaued:
    name = "loss-plateaued"
    schedule = Schedule(on_telemetry=True, every_s=900.0)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        now = ctx.now
        out = []
        for w in _running(ctx.cp):
            s = [(t, v) for t, v in _loss_series(ctx, w) if math.isfinite(v)]
            if len(s) < cfg.loss_min_points or s[-1][0] - s[0][0] < cfg.plateau_window_s:
                continue
            recent = _window(s, s[-1][0] - cfg.plateau_window_s)
            first, last = recent[0], statistics.fmean(recent[-3:])
            if first <= 0 or w.progress >= 0.95:
                continue
            gain = (first - last) / first
            if 0 <= gain < cfg.plateau_min_improvement or (gain < 0 and last <= min(recent) * 1.05):
                out.append(
                    Finding(self.name, w.id, "workload",
                            f"{w.id}: loss improved {gain:.2%} over the last"
                            f" {format_duration(cfg.plateau_window_s)} (plateau)",
                            severity=0.3,
                            evidence={"window_s": cfg.plateau_window_s, "first": first,
                                      "last": last, "progress": w.progress},
                            time=now, cause="plateau")
                )
        return out


# ==================================================================== progress
class ProgressStalled:
    name = "progress-stalled"
    schedule = Schedule(on_telemetry=True, every_s=300.0)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        now = ctx.now
        tel = ctx.monitor.telemetry
        out = []
        for w in _running(ctx.cp):
            if w.runtime(now) < cfg.stall_s:
                continue
            mem = ctx.monitor.workloads.get(w.id)
            evidence: dict[str, object] = {"runtime_s": w.runtime(now), "progress": w.progress}
            why = None
            if mem is not None and mem.progress >= 0 and now - mem.progress_since >= cfg.stall_s:
                since = max(mem.progress_since, w.started_at or 0.0)
                if now - since >= cfg.stall_s and (mem.progress > 0 or tel.samples(
                        workload=w.id, metric="progress", last=1)):
                    why = f"progress stuck at {mem.progress:.1%} for {format_duration(now - since)}"
                    evidence["stuck_for_s"] = now - since
            if why is None and w.spec.resources.gpu:
                util = [
                    float(s.metrics["gpu_util"])
                    for s in tel.samples(workload=w.id, metric="gpu_util")
                    if s.time >= now - cfg.stall_s and "gpu_util" not in s.declared
                ]
                if len(util) >= 3 and max(util) < cfg.hung_util:
                    why = (f"GPU utilisation below {cfg.hung_util:.0%} for"
                           f" {format_duration(cfg.stall_s)} ({len(util)} samples)")
                    evidence["gpu_util_max"] = max(util)
            if why:
                out.append(Finding(self.name, w.id, "workload", f"{w.id}: {why}",
                                   severity=0.6, evidence=evidence, time=now, cause="hung"))
        return out


# ==================================================================== failures
def triage(fails: Sequence[FailureRecord], request_mib: int, cfg: AnalyzeConfig,
           node_failures: dict[str, int]) -> tuple[str, str]:
    """(cause, why) of a run of failures: "oom", "node" or "code"."""
    oom = [f for f in fails if f.cause == "oom" or f.exit_code == 137
           or (f.peak_memory_mib is not None
               and f.peak_memory_mib >= cfg.oom_memory_fraction * request_mib)]
    if oom and len(oom) * 2 >= len(fails):
        return "oom", f"{len(oom)}/{len(fails)} attempts were killed for memory (exit 137 or use at the limit)"
    node = [f for f in fails if f.cause in NOT_ITS_FAULT or any(
        node_failures.get(n, 0) >= cfg.node_failures_distinct for n in f.nodes)]
    if node and len(node) * 2 >= len(fails):
        shared = sorted({n for f in node for n in f.nodes})
        return "node", f"{len(node)}/{len(fails)} failures point at node(s) {', '.join(shared)}"
    codes = sorted({f.exit_code for f in fails if f.exit_code is not None})
    return "code", f"exit code(s) {', '.join(map(str, codes))} on {len(fails)} attempts: the code fails"


class RepeatedFailures:
    name = "repeated-failures"
    schedule = Schedule(on_events=True, every_s=600.0)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        now = ctx.now
        mon = ctx.monitor
        distinct = _node_failure_counts(mon, now, cfg.node_window_s)
        out = []
        for wid, mem in mon.workloads.items():
            if len(mem.failures) < cfg.min_failures:
                continue
            w = ctx.cp.workloads.get(wid)
            if w is None or w.state not in (State.FAILED, State.PENDING, State.PREEMPTED):
                continue
            fails = mem.failures[-6:]
            cause, why = triage(fails, w.spec.resources.memory, cfg, distinct)
            peaks = [f.peak_memory_mib for f in fails if f.peak_memory_mib is not None]
            out.append(
                Finding(
                    self.name, wid, "workload",
                    f"{wid}: {len(mem.failures)} failures, triaged as {cause}: {why}",
                    severity=0.8 if w.failures >= w.spec.max_retries else 0.7,
                    evidence={
                        "attempts": [
                            {"time": f.time, "attempt": f.attempt, "exit_code": f.exit_code,
                             "cause": f.cause, "nodes": list(f.nodes), "runtime_s": f.runtime_s,
                             "peak_memory_mib": f.peak_memory_mib}
                            for f in fails
                        ],
                        "memory_request_mib": w.spec.resources.memory,
                        "peak_memory_mib": max(peaks) if peaks else None,
                        "state": w.state.value,
                        "failures": w.failures,
                        "max_retries": w.spec.max_retries,
                    },
                    time=now, cause=cause,
                )
            )
        return out


def _node_failure_counts(mon: Monitor, now: float, window: float) -> dict[str, int]:
    out = {}
    for node, nm in mon.nodes.items():
        ids = {wid for t, wid, cause in nm.failures if t >= now - window and cause not in NOT_ITS_FAULT}
        out[node] = len(ids)
    return out


# ======================================================================= nodes
NODE_HEALTH_METRICS = ("ecc_errors", "xid_errors", "gpu_temp_c", "node_health")


class NodeUnhealthy:
    name = "node-unhealthy"
    schedule = Schedule(on_telemetry=True, on_events=True)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        cp, now = ctx.cp, ctx.now
        tel = ctx.monitor.telemetry
        distinct = _node_failure_counts(ctx.monitor, now, cfg.node_window_s)
        out = []
        for node in cp.capacity.node_names():
            if cp.capacity.status(node) is NodeStatus.DOWN:
                continue
            signs: list[str] = []
            ev: dict[str, object] = {}
            since = now - cfg.node_window_s
            for metric in ("ecc_errors", "xid_errors"):
                s = _window(tel.series(metric, node=node), since)
                if len(s) >= 2 and s[-1] > s[0]:
                    signs.append(f"{metric} rose from {s[0]:g} to {s[-1]:g}")
                    ev[metric] = s[-1]
            temp = tel.latest("gpu_temp_c", node=node)
            if temp is not None and temp >= cfg.node_temp_c:
                signs.append(f"GPU temperature {temp:g} C")
                ev["gpu_temp_c"] = temp
            health = tel.latest("node_health", node=node)
            if health is not None and health < 0.5:
                signs.append(f"health {health:g}")
                ev["node_health"] = health
            if distinct.get(node, 0) >= cfg.node_failures_distinct:
                signs.append(f"{distinct[node]} different workloads failed here in the last"
                             f" {format_duration(cfg.node_window_s)}")
                ev["distinct_failures"] = distinct[node]
            holders = [h.id for h in cp.holders(node)]
            if not signs:
                continue
            if cp.capacity.status(node) is NodeStatus.CORDONED and not holders:
                continue  # already drained
            ev["holders"] = holders
            ev["status"] = cp.capacity.status(node).value
            out.append(Finding(self.name, node, "node", f"node {node}: " + "; ".join(signs),
                               severity=0.8, evidence=ev, time=now, cause="hardware"))
        return out


class NodeLost:
    name = "node-lost"
    schedule = Schedule(on_events=True, every_s=600.0)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        cp, now = ctx.cp, ctx.now
        out = []
        for node, nm in ctx.monitor.nodes.items():
            if node not in cp.capacity:
                continue
            st = cp.capacity.status(node)
            recent = [t for t in nm.losses if t >= now - 24 * 3600]
            if st is NodeStatus.DOWN:
                out.append(Finding(self.name, node, "node",
                                   f"node {node} is down since {format_duration(now - nm.since)} ago;"
                                   " its work was requeued",
                                   severity=0.5, evidence={"down_for_s": now - nm.since,
                                                           "losses_24h": len(recent)},
                                   time=now, cause="lost"))
            elif st is NodeStatus.READY and len(recent) >= cfg.flapping_losses:
                out.append(Finding("node-flapping", node, "node",
                                   f"node {node} was lost {len(recent)} times in 24h and is back",
                                   severity=0.7, evidence={"losses_24h": len(recent),
                                                           "loss_times": recent},
                                   time=now, cause="flapping"))
        return out


# ======================================================================= queues
class QueueStarving:
    name = "queue-starving"
    schedule = Schedule(every_s=300.0, cron=None)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        cp, now = ctx.cp, ctx.now
        order = ctx.scheduler.ordered(cp)
        rank = {w.id: i for i, w in enumerate(order)}
        starving = []
        for w in order:
            since = w.history[-1].time if w.history else w.submit_time
            waited = now - min(since, now)
            if w.state is State.PENDING:
                waited = now - w.submit_time
            if waited >= cfg.starve_s:
                starving.append((waited, w))
        starving.sort(key=lambda x: (-x[0], x[1].seq))
        out = []
        for waited, w in starving[:5]:
            served = [h for h in cp.workloads.values()
                      if h.holding and h.submit_time > w.submit_time]
            out.append(Finding(
                self.name, w.id, "workload",
                f"{w.id} (queue {w.queue}) has waited {format_duration(waited)};"
                f" {len(served)} later arrivals hold resources",
                severity=min(0.9, 0.4 + 0.1 * waited / cfg.starve_s),
                evidence={"queue": w.queue, "waited_s": waited, "rank": rank[w.id] + 1,
                          "priority": w.priority, "pending_reason": w.pending_reason,
                          "later_arrivals_running": len(served)},
                time=now, cause="starving",
            ))
        return out


# ========================================================================= GPUs
class GpusIdle:
    """GPUs free while GPU work waits: fragmentation, or quota, or reservations."""

    name = "gpus-idle-while-waiting"
    schedule = Schedule(on_events=True, every_s=300.0)

    def check(self, ctx: Context) -> list[Finding]:
        cp, now = ctx.cp, ctx.now
        cap = cp.capacity
        free_by_model: dict[str, int] = {}
        for info in cap.nodes():
            if info.gpu_model and cap.status(info.name) is NodeStatus.READY:
                free_by_model[info.gpu_model] = (
                    free_by_model.get(info.gpu_model, 0) + cap.whole_free_gpus(info.name)
                )
        if not any(free_by_model.values()):
            return []
        out = []
        for w in cp.queued_workloads()[:200]:
            if not w.spec.resources.gpu or w.victims:
                continue
            models = accepted_models(cp, w)
            free = sum(free_by_model.get(m, 0) for m in models)
            need = math.ceil(_gpus(w))
            if free < need:
                continue
            shape = shape_of(w.spec, models)
            fits_one = cap.find(shape) is not None
            reason = w.pending_reason
            if "quota" in reason or "borrow" in reason:
                kind, cause = self.name, "quota"
            elif not fits_one or (w.spec.replicas == 1 and need > max(
                    (cap.whole_free_gpus(n) for m in models for n in cap.nodes_of_model(m)
                     if cap.status(n) is NodeStatus.READY), default=0)):
                kind, cause = "gpus-fragmented", "fragmented"
            else:
                continue  # it fits: the next cycle (or a reservation) will place it
            out.append(Finding(
                kind, w.id, "workload",
                f"{free} {'/'.join(models)} GPU(s) free in total but {w.id} ({need} GPU) waits:"
                f" {cause} ({reason or 'no reason recorded yet'})",
                severity=0.5,
                evidence={"free_gpus": free, "needs_gpus": need, "models": list(models),
                          "pending_reason": reason, "waited_s": now - w.submit_time},
                time=now, cause=cause,
            ))
        return out[:5]


class LowUtilisation:
    name = "utilisation-low"
    schedule = Schedule(every_s=600.0)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        now = ctx.now
        tel = ctx.monitor.telemetry
        out = []
        for w in _running(ctx.cp):
            if not w.spec.resources.gpu or w.runtime(now) < cfg.low_util_window_s:
                continue
            util = [float(s.metrics["gpu_util"]) for s in tel.samples(workload=w.id, metric="gpu_util")
                    if s.time >= now - cfg.low_util_window_s and "gpu_util" not in s.declared]
            if len(util) < 3:
                continue
            mean = statistics.fmean(util)
            if cfg.hung_util <= mean < cfg.low_util:
                out.append(Finding(self.name, w.id, "workload",
                                   f"{w.id} uses {mean:.0%} of the {_gpus(w):g} GPU(s) it holds",
                                   severity=0.3, evidence={"gpu_util_mean": mean,
                                                           "samples": len(util),
                                                           "gpus": _gpus(w)},
                                   time=now, cause="over-allocated"))
        return out


class InferenceLoad:
    """Inference services (replicas sharing the ``mlwe.service`` label) under or over load."""

    name = "inference-load"
    schedule = Schedule(on_telemetry=True, every_s=300.0)

    def check(self, ctx: Context) -> list[Finding]:
        cfg = ctx.config
        now = ctx.now
        tel = ctx.monitor.telemetry
        services: dict[str, list[Workload]] = {}
        for w in ctx.cp.workloads.values():
            if w.spec.kind is WorkloadKind.INFERENCE and w.state not in (
                    State.SUCCEEDED, State.CANCELLED, State.FAILED):
                services.setdefault(w.spec.labels.get(SERVICE_LABEL, w.id), []).append(w)
        out = []
        for name, reps in services.items():
            running = [w for w in reps if w.state is State.RUNNING]
            if not running:
                continue
            util = []
            for w in running:
                u = [float(s.metrics["gpu_util"]) for s in tel.samples(workload=w.id, metric="gpu_util", last=5)
                     if "gpu_util" not in s.declared]
                if u:
                    util.append(statistics.fmean(u))
            if not util:
                continue
            mean = statistics.fmean(util)
            ev = {"service": name, "replicas": len(reps), "running": len(running),
                  "gpu_util_mean": mean, "replica_ids": [w.id for w in reps]}
            if mean >= cfg.overload_util and all(w.state is State.RUNNING for w in reps):
                out.append(Finding("inference-overloaded", name, "service",
                                   f"service {name}: {len(running)} replica(s) at {mean:.0%} GPU",
                                   severity=0.6, evidence=ev, time=now, cause="overloaded"))
            elif mean < cfg.idle_service_util and len(reps) >= 2:
                out.append(Finding("inference-idle", name, "service",
                                   f"service {name}: {len(reps)} replicas at {mean:.0%} GPU",
                                   severity=0.3, evidence=ev, time=now, cause="idle"))
        return out


def default_triggers() -> list[Trigger]:
    return [
        DeadlineAtRisk(),
        LossNaN(),
        LossDiverging(),
        LossPlateaued(),
        ProgressStalled(),
        RepeatedFailures(),
        NodeUnhealthy(),
        NodeLost(),
        QueueStarving(),
        GpusIdle(),
        LowUtilisation(),
        InferenceLoad(),
    ]


# ==================================================================== analyzer
class Analyzer:
    """Runs each trigger when its schedule says so; collects findings."""

    def __init__(self, triggers: Sequence[Trigger], start: float) -> None:
        names = [t.name for t in triggers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate trigger names: {', '.join(dup)}")
        self.triggers = list(triggers)
        self.last_run: dict[str, float] = {}
        self._next_cron: dict[str, float] = {}
        for t in self.triggers:
            if t.schedule.cron:
                self._next_cron[t.name] = croniter(t.schedule.cron, start).get_next(float)
        self.runs: dict[str, int] = {t.name: 0 for t in self.triggers}
        self._forced: set[str] = set()

    def again(self, name: str) -> None:
        """Run trigger ``name`` at the next analysis whatever its schedule says (its
        finding was not decided: a plan made on it went stale)."""
        self._forced.add(name)

    def due(self, now: float, new_samples: int, new_events: int) -> list[Trigger]:
        out = []
        for t in self.triggers:
            s = t.schedule
            last = self.last_run.get(t.name)
            why = (
                t.name in self._forced
                or (s.on_telemetry and new_samples > 0)
                or (s.on_events and new_events > 0)
                or (s.every_s is not None and (last is None or now - last >= s.every_s))
                or (s.cron is not None and now >= self._next_cron[t.name])
            )
            if why:
                out.append(t)
        return out

    def run(self, ctx: Context, new_samples: int, new_events: int) -> tuple[list[Finding], list[str]]:
        now = ctx.now
        findings: list[Finding] = []
        ran = []
        for t in self.due(now, new_samples, new_events):
            self._forced.discard(t.name)
            self.last_run[t.name] = now
            self.runs[t.name] += 1
            if t.schedule.cron:
                self._next_cron[t.name] = croniter(t.schedule.cron, now).get_next(float)
            findings += t.check(ctx)
            ran.append(t.name)
        return findings, ran
