"""Plan: strategies turn findings into candidate plans of typed actions.

Each strategy is a small plug-in: a name, the triggers it answers, and
``plan(finding, ctx)`` returning candidate plans (often several variants of
different boldness) with the factors a reasoner weighs: ``benefit``,
``cost``, ``risk`` and ``confidence``, each in [0, 1]. :func:`hazards_for`
states what the agent believes happens if nothing is done, for the what-if.

Strategies only read state. The actions they build are checked again by the
control plane (on a fork first, then live), so a strategy that misjudges is
rejected with reasons, never applied.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any, Protocol

from mlwe.agent.model import CandidatePlan, Finding, Hazard, WorkflowRequest
from mlwe.agent.triggers import SERVICE_LABEL, Context
from mlwe.core.actions import (
    Action,
    Cancel,
    Evict,
    Preempt,
    Retry,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    SetResources,
    Submit,
)
from mlwe.core.capacity import FULL
from mlwe.core.lifecycle import HOLDING, QUEUED, TERMINAL, State
from mlwe.core.model import Workload, shape_of
from mlwe.core.policies.deadline import accepted_models
from mlwe.core.policies.placement import BestFit
from mlwe.core.rules import frees_what_is_needed, preemptible
from mlwe.core.spec import NodeStatus, QueueSpec, WorkloadSpec

#: The agent never raises a workload's priority to this or above ("critical").
MAX_AGENT_PRIORITY = 999


class Strategy(Protocol):
    """A plan maker. The agent loop calls ``plan`` with no lock held: ``ctx.cp`` is a
    private snapshot of the state (read it freely); leave ``ctx.monitor`` alone (the
    engine updates it meanwhile; what a strategy needs of it is in the finding's
    evidence)."""

    name: str
    handles: frozenset[str]  # trigger names

    def plan(self, finding: Finding, ctx: Context) -> list[CandidatePlan]: ...


def _plan(strategy: str, f: Finding, variant: str, actions: Sequence[Action], summary: str,
          rationale: Sequence[str], clears: Sequence[str] = (),
          workflow: WorkflowRequest | None = None, **factors: float) -> CandidatePlan:
    return CandidatePlan(
        id=f"{strategy}/{variant}:{f.subject}",
        strategy=strategy,
        finding_ids=(f.id,),
        actions=tuple(actions),
        summary=summary,
        rationale=tuple(rationale),
        factors={k: round(min(1.0, max(0.0, v)), 4) for k, v in factors.items()},
        clears=tuple(clears),
        workflow=workflow,
    )


def reschedule(preemptor: str, victims: Sequence[str]) -> WorkflowRequest | None:
    """The workflow that carries a preemption through (None when nobody is preempted):
    wait for the victims' checkpoints, confirm the release, see the preemptor placed,
    started and running, and resume the victims if it cannot start."""
    if not victims:
        return None
    return WorkflowRequest("reschedule", {"preemptor": preemptor, "victims": list(victims)})


def recover(workload: str, bad_nodes: Sequence[str] = ()) -> WorkflowRequest:
    """The workflow that sees a failing workload through: retry with exponential
    backoff, move it off the nodes it failed on, give up to a dead letter and an alert."""
    params: dict[str, Any] = {"workload": workload}
    if bad_nodes:
        params["bad_nodes"] = list(bad_nodes)
    return WorkflowRequest("recover", params)


def _workload(ctx: Context, f: Finding) -> Workload | None:
    return ctx.cp.workloads.get(f.subject) if f.subject_kind == "workload" else None


def _need(w: Workload) -> float:
    """What ``w`` needs, in the unit holders free: GPUs, or CPU cores for CPU work."""
    r = w.spec.resources
    return (r.gpu if r.gpu else r.cpu) * w.spec.replicas / FULL


def _frees(h: Workload, w: Workload) -> float:
    r = h.spec.resources
    return (r.gpu if w.spec.resources.gpu else r.cpu) * h.spec.replicas / FULL


def _work_at_risk_h(ws: Sequence[Workload], now: float) -> float:
    return sum(h.work_at_risk(now) * max(1.0, h.gpus()) for h in ws) / 3600


# ================================================================ reprioritise
class Reprioritise:
    """Raise a waiting workload's priority: to the head of the queue, or (with
    explicit preemptions) above the cheapest holders that free what it needs."""

    name = "reprioritise"
    handles = frozenset({"deadline-at-risk", "queue-starving"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        w = _workload(ctx, f)
        if w is None or w.state not in QUEUED or f.evidence.get("lost_cause"):
            return []
        cp, now = ctx.cp, ctx.now
        deadline = f.trigger == "deadline-at-risk"
        out: list[CandidatePlan] = []
        order = ctx.scheduler.ordered(cp)
        ahead = [o for o in order if o.id != w.id][: next(
            (i for i, o in enumerate(order) if o.id == w.id), 0)]
        relevant = [
            h for ids in cp.on_node.values() for h in (cp.workloads[i] for i in ids)
            if h.state in (State.ADMITTED, State.STARTING, State.RUNNING)
            and frees_what_is_needed(cp.capacity, h, w)
        ]
        relevant = list({h.id: h for h in relevant}.values())
        lowest_holder = min((h.priority for h in relevant), default=MAX_AGENT_PRIORITY)
        # 1. head of the queue, without preempting anyone: the smallest priority that
        #    ranks it first (ties go on to deadline, fair share and arrival)
        # the work it competes with: what ranks ahead now and what holds the room (new
        # arrivals come in at those priorities)
        rivals = {o.priority for o in ahead} | {h.priority for h in relevant}
        if rivals:
            top = max(o.priority for o in ahead) if ahead else lowest_holder
            queued = cp.queued_workloads()
            for target in sorted({top, top + 1, lowest_holder}):
                if target <= w.priority or target > min(lowest_holder, MAX_AGENT_PRIORITY):
                    continue
                trial = dataclasses.replace(w, priority_override=target, history=list(w.history))
                ranked = ctx.scheduler.ordering.order(
                    [trial if o.id == w.id else o for o in queued], cp.queues,
                    ctx.scheduler.total_gpu(cp), now)
                if ranked and ranked[0].id != w.id:
                    continue
                out.append(_plan(
                    self.name, f, "head-of-queue",
                    [SetPriority(w.id, target, f"agent: {f.trigger}")],
                    f"raise {w.id} from priority {w.priority} to {target}: first in the queue,"
                    " preempting nobody",
                    [f"{len(ahead)} workload(s) rank ahead of it now",
                     f"the lowest-priority holder it could use has priority {lowest_holder}"],
                    benefit=0.55 if deadline else 0.7, cost=0.05, risk=0.1, confidence=0.8,
                ))
                break
        # 2. above the cheapest level of holders that frees what it needs
        free = self._free(ctx, w)
        need = _need(w)
        levels = sorted({h.priority for h in relevant if h.priority >= w.priority})
        for p in levels:
            if p + 1 > MAX_AGENT_PRIORITY:
                break
            pool = [h for h in relevant if h.priority <= p and preemptible(h, now) is None]
            if free + sum(_frees(h, w) for h in pool) < need:
                continue
            raised = dataclasses.replace(w, priority_override=p + 1, history=list(w.history))
            models = accepted_models(cp, w)
            choice = ctx.scheduler.preemption.select(
                cp, cp.capacity.fork(), raised, shape_of(w.spec, models), set(), frozenset()
            )
            victims = [v for v, _ in choice.victims] if choice is not None else []
            cost = min(1.0, _work_at_risk_h(victims, now) / max(1.0, need))
            acts: list[Action] = [SetPriority(w.id, p + 1, f"agent: {f.trigger}")]
            acts += [Preempt(v.id, w.id) for v in victims]
            out.append(_plan(
                self.name, f, "preempt",
                acts,
                f"raise {w.id} to priority {p + 1} and preempt "
                + (", ".join(v.id for v in victims) or "nobody (room is free)"),
                [f"holders at priority <= {p} free enough for {need:g} unit(s)",
                 f"victims chosen by {ctx.scheduler.preemption.name}: cheapest valid set",
                 f"about {_work_at_risk_h(victims, now):.2f} GPU-hours of work at risk"],
                workflow=reschedule(w.id, [v.id for v in victims]),
                benefit=0.9 if deadline else 0.6, cost=cost + 0.1 * len(victims),
                risk=0.3, confidence=0.8,
            ))
            break
        return out

    @staticmethod
    def _free(ctx: Context, w: Workload) -> float:
        cap = ctx.cp.capacity
        if w.spec.resources.gpu:
            models = accepted_models(ctx.cp, w)
            return float(sum(cap.whole_free_gpus(n) for m in models for n in cap.nodes_of_model(m)
                             if cap.status(n) is NodeStatus.READY))
        return sum(cap.free(i.name).cpu for i in cap.nodes()
                   if i.gpu_model is None and cap.status(i.name) is NodeStatus.READY) / FULL


# ================================================================== failures
def _mean_runtime(f: Finding) -> float:
    runs = [a["runtime_s"] for a in f.evidence.get("attempts", ()) if a.get("runtime_s")]
    return statistics.fmean(runs) if runs else 600.0


def _largest_memory(ctx: Context, w: Workload) -> int:
    cap = ctx.cp.capacity
    models = set(accepted_models(ctx.cp, w))
    out = 0
    for info in cap.nodes():
        if w.spec.resources.gpu and info.gpu_model not in models:
            continue
        if not w.spec.resources.gpu and info.gpu_model is not None:
            continue
        out = max(out, info.capacity.ram)
    return out


def oom_target_memory(request: int, peak: float | None) -> int:
    """The memory to ask for after OOM kills: 1.5x the request, or 1.25x the peak seen."""
    want = max(request * 1.5, (peak or 0) * 1.25)
    return int(math.ceil(want / 1024) * 1024)


class RequeueMoreMemory:
    name = "requeue-more-memory"
    handles = frozenset({"repeated-failures"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        w = _workload(ctx, f)
        if w is None or f.cause != "oom" or w.state in HOLDING:
            return []
        req = w.spec.resources.memory
        peak = f.evidence.get("peak_memory_mib")
        target = min(oom_target_memory(req, peak), _largest_memory(ctx, w))
        if target <= req:
            return []
        res = w.spec.resources.model_copy(update={"memory": target})
        acts: list[Action] = [SetResources(w.id, res, f"OOM-killed at {req} MiB")]
        if w.state is State.FAILED and w.failures <= w.spec.max_retries:
            acts.append(Retry(w.id))
        return [_plan(
            self.name, f, "memory",
            acts,
            f"requeue {w.id} with {target} MiB of memory per replica (was {req} MiB)",
            [f"triage: {f.summary}",
             f"peak memory seen {peak:.0f} MiB" if peak else "no memory telemetry: 1.5x the request",
             "then the recover workflow: retry with backoff, move off its nodes, or give up"
             " to a dead letter and an alert"],
            workflow=recover(w.id),
            benefit=0.9, cost=0.1 + 0.2 * (target - req) / max(target, 1), risk=0.2,
            confidence=0.85 if peak else 0.6,
        )]


class StopCrashLoop:
    name = "stop-crash-loop"
    handles = frozenset({"repeated-failures"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        w = _workload(ctx, f)
        if w is None or f.cause != "code" or w.state in (State.FAILED, State.STOPPING):
            return []
        return [_plan(
            self.name, f, "cancel",
            [Cancel(w.id, f"agent: crash loop ({f.summary})")],
            f"stop {w.id}: it fails the same way on every attempt",
            [f.summary, "retrying a deterministic code error only burns resources"],
            benefit=0.6, cost=0.3, risk=0.4, confidence=0.7,
        )]


class CordonNode:
    name = "cordon-node"
    handles = frozenset({"repeated-failures", "node-flapping"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        cp = ctx.cp
        if f.trigger == "node-flapping":
            nodes = [f.subject]
        elif f.cause == "node":
            nodes = sorted({n for a in f.evidence.get("attempts", ()) for n in a.get("nodes", ())})
        else:
            return []
        nodes = [n for n in nodes if n in cp.capacity and cp.capacity.status(n) is NodeStatus.READY]
        if not nodes:
            return []
        w = _workload(ctx, f) if f.trigger == "repeated-failures" else None
        flow = recover(w.id, nodes) if w is not None and w.state not in TERMINAL else None
        return [_plan(
            self.name, f, "cordon",
            [SetNodeStatus(n, NodeStatus.CORDONED, f"agent: {f.trigger}") for n in nodes],
            f"cordon {', '.join(nodes)}: take no new work there until an operator clears it"
            + (f"; recover {w.id} elsewhere" if flow is not None and w is not None else ""),
            [f.summary] + (["then the recover workflow retries it off those nodes (backoff),"
                            " or gives up to a dead letter and an alert"] if flow else []),
            workflow=flow,
            benefit=0.6, cost=0.2, risk=0.2, confidence=0.7,
        )]


# ====================================================================== nodes
class MoveOffNode:
    name = "move-off-node"
    handles = frozenset({"node-unhealthy"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        cp, now = ctx.cp, ctx.now
        node = f.subject
        if node not in cp.capacity:
            return []
        holders = [h for h in cp.holders(node)
                   if h.state in (State.ADMITTED, State.STARTING, State.RUNNING)]
        out = []
        cordon: list[Action] = []
        if cp.capacity.status(node) is NodeStatus.READY:
            cordon = [SetNodeStatus(node, NodeStatus.CORDONED, f"agent: {f.summary}")]
        if holders:
            risk_h = _work_at_risk_h(holders, now)
            out.append(_plan(
                self.name, f, "drain",
                [*cordon, *(Evict(h.id, f"move off unhealthy node {node}") for h in holders)],
                f"cordon {node} and move {', '.join(h.id for h in holders)} off it"
                " (checkpoint, requeue elsewhere)",
                [f.summary, f"about {risk_h:.2f} GPU-hours since their last checkpoints"],
                benefit=0.85, cost=min(1.0, risk_h / 8), risk=0.3, confidence=0.7,
            ))
        if cordon:
            out.append(_plan(
                self.name, f, "cordon",
                cordon,
                f"cordon {node}: what runs there stays, nothing new goes there",
                [f.summary],
                benefit=0.4, cost=0.05, risk=0.2, confidence=0.7,
            ))
        return out


# ======================================================================= runs
class StopDiverged:
    name = "stop-diverged"
    handles = frozenset({"loss-nan", "loss-diverging"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        w = _workload(ctx, f)
        if w is None or w.state not in (State.ADMITTED, State.STARTING, State.RUNNING):
            return []
        return [
            _plan(self.name, f, "stop", [Cancel(w.id, f"agent: {f.summary}")],
                  f"stop {w.id}: its loss {'is NaN' if f.trigger == 'loss-nan' else 'diverged'};"
                  f" free its {w.gpus():g} GPU(s)",
                  [f.summary, "a diverged run does not recover by itself; its GPU time is wasted"],
                  benefit=0.85, cost=0.2, risk=0.25, confidence=0.8),
            _plan(self.name, f, "restart", [Evict(w.id, f"agent: restart after {f.trigger}")],
                  f"restart {w.id} from its last checkpoint",
                  [f.summary, "a restart helps only if the divergence was transient"],
                  benefit=0.4, cost=0.2, risk=0.5, confidence=0.3),
        ]


class RestartStalled:
    name = "restart-stalled"
    handles = frozenset({"progress-stalled"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        w = _workload(ctx, f)
        if w is None or w.state is not State.RUNNING:
            return []
        return [
            _plan(self.name, f, "restart", [Evict(w.id, f"agent: {f.summary}")],
                  f"restart {w.id} from its last checkpoint (it is hung)",
                  [f.summary], clears=(w.id,),
                  benefit=0.7, cost=min(1.0, _work_at_risk_h([w], ctx.now) / 8), risk=0.3,
                  confidence=0.7),
        ]


# ====================================================================== quota
class ResizeBorrowing:
    name = "resize-borrowing"
    handles = frozenset({"gpus-idle-while-waiting"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        w = _workload(ctx, f)
        if w is None or f.cause != "quota":
            return []
        q = ctx.cp.queues[w.queue]
        if q.cohort is None:
            return []
        need = w.spec.resources.gpu * w.spec.replicas
        current = q.spec.borrowing_limit.gpu if q.spec.borrowing_limit and q.spec.borrowing_limit.gpu is not None else None
        if current is None:
            return []  # unlimited already: quota is the cohort's, not the limit
        spec = q.spec.model_dump(mode="json")
        spec["borrowing_limit"] = {**(spec.get("borrowing_limit") or {}), "gpu": f"{current + need}m"}
        new = QueueSpec.model_validate(spec)
        return [_plan(
            self.name, f, "raise-limit", [SetQueue(new)],
            f"let queue {q.name} borrow {need / FULL:g} more GPU(s) from cohort {q.cohort}",
            [f.summary, "the cohort's idle nominal quota is lent, and reclaimed by preemption"
             " when its owner needs it"],
            benefit=0.6, cost=0.15, risk=0.3, confidence=0.7,
        )]


class Defragment:
    name = "defragment"
    handles = frozenset({"gpus-fragmented"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        w = _workload(ctx, f)
        if w is None or w.spec.replicas != 1 or not w.spec.resources.gpu:
            return []
        cp, now = ctx.cp, ctx.now
        cap = cp.capacity
        need = w.spec.resources.gpu // FULL
        models = accepted_models(cp, w)
        shape = shape_of(w.spec, models)
        best: tuple[float, str, list[Workload]] | None = None
        for m in models:
            for node in cap.nodes_of_model(m):
                if cap.status(node) is not NodeStatus.READY:
                    continue
                free = cap.whole_free_gpus(node)
                cands = sorted(
                    (h for h in cp.holders(node) if h.state is State.RUNNING
                     and h.priority <= w.priority and preemptible(h, now) is None
                     and h.spec.replicas == 1 and h.spec.resources.gpu),
                    key=lambda h: (h.spec.resources.gpu, h.work_at_risk(now), h.id),
                )
                chosen: list[Workload] = []
                for h in cands:
                    if free >= need:
                        break
                    chosen.append(h)
                    free += h.spec.resources.gpu // FULL
                if free < need or not chosen or not self._movable(ctx, node, chosen, shape):
                    continue
                cost = _work_at_risk_h(chosen, now)
                if best is None or (cost, node) < (best[0], best[1]):
                    best = (cost, node, chosen)
        if best is None:
            return []
        cost, node, chosen = best
        return [_plan(
            self.name, f, "consolidate",
            [Evict(h.id, f"agent: make room for {w.id} on {node}") for h in chosen],
            f"move {', '.join(h.id for h in chosen)} off {node} so {w.id} fits there",
            [f.summary, f"each moved workload fits elsewhere now; {cost:.2f} GPU-hours at risk"],
            benefit=0.6, cost=min(1.0, cost / 4 + 0.1 * len(chosen)), risk=0.4, confidence=0.6,
        )]

    @staticmethod
    def _movable(ctx: Context, node: str, chosen: Sequence[Workload], shape: Any) -> bool:
        cp = ctx.cp
        fork = cp.capacity.fork()
        for h in chosen:
            for a in h.placement:
                fork.release(a)
        target = fork.fit_on(node, shape)
        if target is None:
            return False
        fork.allocate(target)
        place = BestFit()
        for h in chosen:
            hs = shape_of(h.spec, accepted_models(cp, h))
            allocs = place.place(fork, hs, h.spec.replicas, frozenset({node}))
            if allocs is None:
                return False
            for a in allocs:
                fork.allocate(a)
        return True


# ================================================================== services
class ScaleService:
    name = "scale-service"
    handles = frozenset({"inference-overloaded", "inference-idle"})

    def plan(self, f: Finding, ctx: Context) -> list[CandidatePlan]:
        cp = ctx.cp
        ids = [i for i in f.evidence.get("replica_ids", ()) if i in cp.workloads]
        if not ids:
            return []
        reps = sorted((cp.workloads[i] for i in ids), key=lambda w: w.seq)
        if f.trigger == "inference-overloaded":
            base = reps[0].spec
            n = len(reps) + 1
            while f"{f.subject}-r{n}" in cp.workloads:
                n += 1
            data = base.model_dump(mode="json")
            data.update(id=f"{f.subject}-r{n}", name=f"{base.name} (replica {n})",
                        labels={**base.labels, SERVICE_LABEL: f.subject})
            data.pop("deadline", None)
            spec = WorkloadSpec.model_validate(data, context={"catalog": cp.catalog})
            return [_plan(
                self.name, f, "up", [Submit(spec)],
                f"scale service {f.subject} up to {len(reps) + 1} replicas",
                [f.summary], benefit=0.7, cost=0.3, risk=0.2, confidence=0.7,
            )]
        newest = reps[-1]
        return [_plan(
            self.name, f, "down", [Cancel(newest.id, f"agent: scale {f.subject} down")],
            f"scale service {f.subject} down: stop replica {newest.id}",
            [f.summary], benefit=0.5, cost=0.2, risk=0.3, confidence=0.6,
        )]


def default_strategies() -> list[Strategy]:
    return [
        Reprioritise(),
        RequeueMoreMemory(),
        StopCrashLoop(),
        CordonNode(),
        MoveOffNode(),
        StopDiverged(),
        RestartStalled(),
        ResizeBorrowing(),
        Defragment(),
        ScaleService(),
    ]


# ==================================================================== hazards
def hazards_for(f: Finding, ctx: Context, node_failure_after_s: float = 1800.0) -> list[Hazard]:
    """What the agent believes happens if nothing is done about ``f`` (for the what-if)."""
    w = _workload(ctx, f)
    if f.trigger in ("loss-nan", "loss-diverging") and w is not None:
        return [Hazard(w.id, "waste", cause=f.trigger)]
    if f.trigger == "progress-stalled" and w is not None:
        return [Hazard(w.id, "hang", cause="stalled", attempt=w.attempt)]
    if f.trigger == "repeated-failures" and w is not None:
        after = _mean_runtime(f)
        if f.cause == "oom":
            peak = f.evidence.get("peak_memory_mib")
            req = w.spec.resources.memory
            # the plan's target (1.25x peak) clears it; a little less than that must too
            clear = int(peak * 1.1) if peak else oom_target_memory(req, None)
            return [Hazard(w.id, "crash", after_s=after, cause="oom",
                           cleared_by_memory=max(clear, req + 1))]
        if f.cause == "code":
            return [Hazard(w.id, "crash", after_s=after, cause="error")]
        return []
    if f.trigger == "node-unhealthy":
        return [Hazard(f.subject, "node-failure", after_s=node_failure_after_s, cause="hardware")]
    if f.trigger == "inference-overloaded":
        return [Hazard(f.subject, "overload", replicas=int(f.evidence.get("replicas", 1)) + 1)]
    if f.trigger == "inference-idle":
        ids = list(f.evidence.get("replica_ids", ()))
        return [Hazard(ids[-1], "waste", cause="idle replica")] if ids else []
    return []
