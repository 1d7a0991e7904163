"""Scenario triggers: the four stories an operator (or a demo) can start from the dashboard.

- ``urgent-fine-tune``: an urgent, deadline-bound fine-tune asks for a whole
  GPU node. So that the story always happens, the idle GPUs of that model are
  first filled with low-priority background work; the scheduler then has to
  preempt (checkpoint and requeue) lower-priority work to place it.
- ``node-fails``: a GPU node that runs work is lost; its workloads are
  requeued and placed elsewhere. On the simulated backend the failure comes
  from the backend itself (a real node-lost event, back after a while); on
  others the node is marked down through the control plane.
- ``loss-diverges``: a running training run's loss starts to grow (injected
  by :class:`mlwe.backends.faults.FaultInjector`).
- ``oom-loop``: a new training job is OOM-killed on every attempt until it is
  given more memory (injected likewise).

Every trigger goes through the engine's public paths (submit, node status,
backend events) and is audited with the operator who pulled it.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlwe.backends.faults import FaultInjector
from mlwe.core.lifecycle import HOLDING, State
from mlwe.core.spec import NodeStatus, WorkloadKind, WorkloadSpec
from mlwe.runtime.engine import Engine


class ScenarioError(ValueError):
    """The scenario cannot run on this engine now (the message says why)."""


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    description: str
    run: Callable[[Engine, str, str | None, str], dict[str, Any]]


_counter = itertools.count(1)


def _suffix() -> str:
    return f"{next(_counter)}-{uuid.uuid4().hex[:4]}"


def audit_note(
    engine: Engine,
    kind: str,
    actor: str,
    payload: dict[str, Any],
    *,
    workload: str | None = None,
    correlation_id: str | None = None,
) -> None:
    """An audit record for an action that has no state change of its own (made durable now).

    A request like any other (:meth:`Engine.note_audit`): screened, then in the
    hash chain and on the live audit stream like every other record.
    """
    engine.note_audit(kind, actor, payload, workload=workload, correlation_id=correlation_id)


def _injector(engine: Engine) -> FaultInjector:
    be = engine.backend
    if not isinstance(be, FaultInjector):
        raise ScenarioError(
            "this engine's backend has no fault injection (mlwe serve wraps its backend in one)"
        )
    return be


# --------------------------------------------------------------- urgent fine-tune
def urgent_fine_tune(engine: Engine, actor: str, target: str | None, cid: str) -> dict[str, Any]:
    with engine.lock:
        cp = engine.reads
        nodes = [
            cp.capacity.info(n)
            for n in cp.capacity.node_names()
            if cp.capacity.status(n) is NodeStatus.READY and cp.capacity.info(n).gpu_count
        ]
        if target is not None:
            nodes = [n for n in nodes if n.name == target or n.gpu_model == target]
        if not nodes:
            raise ScenarioError(
                "no ready GPU node" + (f" matches {target!r}" if target else "")
            )
        # the model with the biggest node: the fine-tune wants one whole node of it
        best = max(nodes, key=lambda n: (n.gpu_count, n.vram_per_gpu, -n.order))
        model, gpus = best.gpu_model, best.gpu_count
        cpu = min(best.capacity.cpu // 2, 32_000)
        ram = min(best.capacity.ram // 2, 256 * 1024)
        # the story needs a full cluster: what is free of that model now, background work takes
        free = sorted((cp.capacity.free(n.name).gpu // 1000 for n in nodes if n.gpu_model == model),
                      reverse=True)
    fillers = _fill(engine, actor, cid, model, [f for f in free if f > 0])
    name = f"urgent-ft-{_suffix()}"
    spec = WorkloadSpec.model_validate(
        {
            "id": name,
            "name": f"urgent fine-tune ({model})",
            "kind": "fine-tune",
            "priority": "urgent",
            "resources": {"gpu": gpus, "cpu": f"{cpu}m", "memory": f"{ram}Mi"},
            "gpu_models": [model],
            "estimated_duration": "20m",
            "deadline_in": "45m",
            "checkpoint_interval": "5m",
            "labels": {"scenario": "urgent-fine-tune"},
        }
    )
    result = engine.submit([spec], actor=actor, correlation_id=cid)
    if not result.accepted:
        raise ScenarioError("submission refused: " + "; ".join(result.reasons()))
    filled = f"; first filled {len(fillers)} idle slot(s) of {model} with low-priority work" if fillers else ""
    return {
        "message": f"submitted {name}: {gpus} x {model}, priority urgent, deadline in 45m{filled}",
        "workloads": list(result.created) + fillers,
    }


def _fill(engine: Engine, actor: str, cid: str, model: str | None, sizes: list[int],
          wait_s: float = 10.0) -> list[str]:
    """Submit low-priority background work of ``sizes`` GPUs of ``model`` and wait (a bounded
    real time) until it is placed, so what follows arrives into a full cluster."""
    import time

    if not sizes:
        return []
    specs = [
        WorkloadSpec.model_validate(
            {
                "id": f"background-{_suffix()}",
                "name": f"background embedding ({n} x {model})",
                "kind": "batch-embedding",
                "priority": "low",
                "resources": {"gpu": n, "cpu": 2 * n, "memory": f"{8 * n}Gi"},
                "gpu_models": [model],
                "estimated_duration": "2h",
                "checkpoint_interval": "5m",
                "labels": {"scenario": "urgent-fine-tune", "role": "background"},
            }
        )
        for n in sizes
    ]
    res = engine.submit(specs, actor=actor, correlation_id=cid)
    if not res.accepted:
        return []
    created = list(res.created)
    engine.wake()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with engine.lock:
            if all(engine.reads.workloads[w].state not in (State.PENDING,) for w in created):
                break
        time.sleep(0.05)
    return created


# ------------------------------------------------------------------- node fails
def node_fails(engine: Engine, actor: str, target: str | None, cid: str) -> dict[str, Any]:
    with engine.lock:
        cp = engine.reads
        if target is not None:
            if target not in cp.capacity:
                raise ScenarioError(f"unknown node {target!r}")
            if cp.capacity.status(target) is NodeStatus.DOWN:
                raise ScenarioError(f"node {target} is already down")
            node = target
        else:
            ready = [
                n for n in cp.capacity.node_names() if cp.capacity.status(n) is NodeStatus.READY
            ]
            if not ready:
                raise ScenarioError("no ready node to fail")
            # the GPU node running the most work: the failure that matters most
            node = max(
                ready,
                key=lambda n: (
                    len(cp.holders(n)),
                    cp.capacity.info(n).gpu_count,
                    -cp.capacity.info(n).order,
                ),
            )
        victims = [w.id for w in cp.holders(node)]
    down_for = 120.0
    fail = getattr(engine.backend, "fail_node", None)
    audit_note(
        engine,
        "operator",
        actor,
        {"action": "scenario", "scenario": "node-fails", "node": node, "running": victims},
        correlation_id=cid,
    )
    if callable(fail):
        engine.call_soon(lambda: fail(node, down_for))
        how = f"backend reports node {node} lost (back in {down_for:.0f}s of engine time)"
    else:
        res = engine.set_node_status(node, NodeStatus.DOWN, "scenario: node fails", actor=actor)
        if not res.accepted:
            raise ScenarioError("; ".join(res.reasons()))
        how = f"node {node} marked down"
    return {"message": f"{how}; {len(victims)} workload(s) were running there", "workloads": victims}


# ---------------------------------------------------------------- loss diverges
def loss_diverges(engine: Engine, actor: str, target: str | None, cid: str) -> dict[str, Any]:
    inj = _injector(engine)
    training = (WorkloadKind.TRAINING, WorkloadKind.FINE_TUNE)
    with engine.lock:
        cp = engine.reads
        if target is not None:
            w = cp.workloads.get(target)
            if w is None:
                raise ScenarioError(f"unknown workload {target!r}")
            if w.state not in HOLDING and w.state not in (State.PENDING, State.PREEMPTED):
                raise ScenarioError(f"{target} is {w.state.value}: it will not report loss again")
            chosen: str | None = target
        else:
            running = [
                w for w in cp.workloads.values()
                if w.state is State.RUNNING and w.spec.kind in training
            ]
            running.sort(key=lambda w: (w.priority, -(w.started_at or 0)))
            chosen = running[0].id if running else None
    if chosen is None:
        # nothing trains right now: start a run that will diverge
        spec = WorkloadSpec.model_validate(
            {
                "id": f"diverging-{_suffix()}",
                "name": "training run (loss will diverge)",
                "kind": "training",
                "priority": "normal",
                "resources": {"gpu": 1, "cpu": 4, "memory": "16Gi"},
                "estimated_duration": "30m",
                "labels": {"scenario": "loss-diverges"},
            }
        )
        res = engine.submit([spec], actor=actor, correlation_id=cid)
        if not res.accepted:
            raise ScenarioError("submission refused: " + "; ".join(res.reasons()))
        chosen = res.created[0]
    inj.diverge(chosen)
    audit_note(
        engine,
        "operator",
        actor,
        {"action": "scenario", "scenario": "loss-diverges", "injected": "loss grows from now"},
        workload=chosen,
        correlation_id=cid,
    )
    return {"message": f"injected fault: the loss of {chosen} now diverges", "workloads": [chosen]}


# --------------------------------------------------------------------- OOM loop
def oom_loop(engine: Engine, actor: str, target: str | None, cid: str) -> dict[str, Any]:
    inj = _injector(engine)
    if target is not None:
        with engine.lock:
            if target not in engine.reads.workloads:
                raise ScenarioError(f"unknown workload {target!r}")
        chosen = target
    else:
        spec = WorkloadSpec.model_validate(
            {
                "id": f"oom-loop-{_suffix()}",
                "name": "training job (too little memory)",
                "kind": "training",
                "priority": "normal",
                "resources": {"gpu": 1, "cpu": 4, "memory": "8Gi"},
                "estimated_duration": "15m",
                "max_retries": 5,
                "labels": {"scenario": "oom-loop"},
            }
        )
        inj.oom(spec.id or "")
        res = engine.submit([spec], actor=actor, correlation_id=cid)
        if not res.accepted:
            inj.clear(spec.id or "")
            raise ScenarioError("submission refused: " + "; ".join(res.reasons()))
        chosen = res.created[0]
    inj.oom(chosen)
    audit_note(
        engine,
        "operator",
        actor,
        {"action": "scenario", "scenario": "oom-loop", "injected": "OOM-killed until given more memory"},
        workload=chosen,
        correlation_id=cid,
    )
    return {
        "message": f"injected fault: {chosen} is OOM-killed on each attempt until it asks for more memory",
        "workloads": [chosen],
    }


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "urgent-fine-tune",
            "urgent fine-tune arrives",
            "An urgent fine-tune with a 45 minute deadline asks for a whole GPU node;"
            " on a busy cluster lower-priority work is preempted (checkpointed, requeued).",
            urgent_fine_tune,
        ),
        Scenario(
            "node-fails",
            "node fails",
            "The busiest ready node is lost; its workloads are requeued and placed elsewhere.",
            node_fails,
        ),
        Scenario(
            "loss-diverges",
            "loss diverges",
            "A running training job's loss starts growing (injected fault).",
            loss_diverges,
        ),
        Scenario(
            "oom-loop",
            "OOM crash loop",
            "A new training job is OOM-killed on each attempt until it asks for more memory"
            " (injected fault).",
            oom_loop,
        ),
    )
}


def run_scenario(engine: Engine, name: str, actor: str, target: str | None = None) -> dict[str, Any]:
    """Run scenario ``name``; raises KeyError (unknown) or ScenarioError (cannot run now)."""
    sc = SCENARIOS.get(name)
    if sc is None:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    cid = f"scenario-{name}-{uuid.uuid4().hex[:10]}"
    out = sc.run(engine, actor, target, cid)
    return {"scenario": name, "correlation_id": cid, **out}
