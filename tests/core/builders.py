"""Small builders shared by the tests (in the spirit of Kueue's pkg/util/testing).

Each builder makes one thing with sensible defaults, so a test states only
what matters to it: ``job("ft", gpu=8, models=["A100-80GB"], priority="urgent")``.
Written for the core's tests and used by the other folders too (agent, runtime,
store): clusters, workloads, driving a control plane, and :func:`tick_until` for
an engine on a manual clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from mlwe.core import (
    Action,
    ApplyResult,
    ClusterSpec,
    ControlPlane,
    ManualClock,
    NodePool,
    NodeSpec,
    NodeStatus,
    Place,
    QueueSpec,
    Released,
    ReplicaAlloc,
    Start,
    Started,
    Submit,
    WorkloadSpec,
    build_control_plane,
)
from mlwe.core.model import shape_of
from mlwe.core.policies.deadline import accepted_models

A100 = "A100-80GB"
T4 = "T4"


# ------------------------------------------------------------------ cluster
def gpu_node(
    name: str,
    model: str = A100,
    gpus: int = 8,
    *,
    cpu: int = 64,
    memory: str = "512Gi",
    status: NodeStatus = NodeStatus.READY,
    **kw: Any,
) -> NodeSpec:
    return NodeSpec(
        name=name, gpu_model=model, gpus=gpus, cpu=cpu, memory=memory, status=status, **kw
    )


def cpu_node(name: str, *, cpu: int = 96, memory: str = "1Ti", **kw: Any) -> NodeSpec:
    return NodeSpec(name=name, cpu=cpu, memory=memory, **kw)


def cluster(
    *nodes: NodeSpec | NodePool,
    queues: Sequence[QueueSpec] = (),
    start: float = 0.0,
) -> tuple[ControlPlane, ManualClock]:
    """A control plane over ``nodes`` (specs or pools), with a manual clock at ``start``."""
    clock = ManualClock(start)
    spec = ClusterSpec(
        nodes=tuple(n for n in nodes if isinstance(n, NodeSpec)),
        pools=tuple(n for n in nodes if isinstance(n, NodePool)),
        queues=tuple(queues),
    )
    return build_control_plane(spec, clock), clock


def queue(name: str, *, cohort: str | None = None, gpu: float | None = None) -> QueueSpec:
    """A queue with a nominal GPU quota (other resources unlimited)."""
    nominal = None if gpu is None else {"gpu": gpu}
    return QueueSpec(name=name, cohort=cohort, nominal=nominal)


# ---------------------------------------------------------------- workloads
def job(
    id: str,
    *,
    gpu: float = 0,
    models: Iterable[str] = (),
    priority: str | int = "normal",
    cpu: float = 8,
    memory: str = "64Gi",
    replicas: int = 1,
    **kw: Any,
) -> WorkloadSpec:
    """A workload spec; keyword arguments go straight to :class:`WorkloadSpec`."""
    return WorkloadSpec.model_validate(
        {
            "id": id,
            "name": id,
            "priority": priority,
            "replicas": replicas,
            "resources": {"gpu": gpu, "cpu": cpu, "memory": memory},
            "gpu_models": list(models),
            **kw,
        }
    )


def gpu_job(wid: str, *, gpu: int = 8, priority: int = 50, **kw: Any) -> WorkloadSpec:
    """A GPU workload (8 CPUs, 64Gi), priority 50 unless given; ``kw`` goes to the spec.

    Unlike :func:`job`, only the fields named here and in ``kw`` are set."""
    return WorkloadSpec.model_validate(
        {"id": wid, "name": wid, "priority": priority,
         "resources": {"gpu": gpu, "cpu": 8, "memory": "64Gi"}, **kw}
    )


def ok(result: ApplyResult) -> ApplyResult:
    """``result``, after checking the batch was accepted (with the reasons if not)."""
    assert result.accepted, result.reasons()
    return result


def submit(cp: ControlPlane, *specs: WorkloadSpec) -> None:
    ok(cp.apply([Submit(s) for s in specs]))


def allocs_on(cp: ControlPlane, wid: str, *nodes: str) -> tuple[ReplicaAlloc, ...]:
    """What each replica of ``wid`` would get on ``nodes`` (one node per replica), now."""
    w = cp.get(wid)
    shape = shape_of(w.spec, accepted_models(cp, w))
    fork = cp.capacity.fork()
    out = []
    for node in nodes:
        alloc = fork.fit_on(node, shape)
        assert alloc is not None, f"{wid} does not fit on {node}"
        fork.allocate(alloc)
        out.append(alloc)
    return tuple(out)


def place_on(cp: ControlPlane, wid: str, *nodes: str) -> Place:
    return Place(wid, allocs_on(cp, wid, *nodes))


def run_to_running(cp: ControlPlane, ids: Iterable[str]) -> None:
    """Start admitted workloads and report them running (current attempt)."""
    for wid in ids:
        ok(cp.apply([Start(wid, cp.get(wid).attempt)]))
        ok(cp.apply([Started(wid, cp.get(wid).attempt)]))


def running_on(cp: ControlPlane, spec: WorkloadSpec, *nodes: str) -> None:
    """Submit ``spec``, place it on ``nodes`` and bring it to RUNNING."""
    assert spec.id is not None
    submit(cp, spec)
    ok(cp.apply([place_on(cp, spec.id, *nodes)]))
    run_to_running(cp, [spec.id])


def release(cp: ControlPlane, wid: str, checkpointed_progress: float | None = None) -> None:
    ok(cp.apply([Released(wid, cp.get(wid).attempt, checkpointed_progress)]))


def apply_all(cp: ControlPlane, actions: Sequence[Action]) -> ApplyResult:
    return ok(cp.apply(actions))


# ------------------------------------------------------------------ runtime
class _Ticks(Protocol):
    def tick(self) -> object: ...


def tick_until(eng: _Ticks, clock: ManualClock, pred: Callable[[], bool], limit: int = 3000) -> None:
    """Advance ``clock`` a second and tick ``eng`` until ``pred()`` holds, at most ``limit``
    times (an engine driven by hand on a manual clock); fails if it never does."""
    for _ in range(limit):
        if pred():
            return
        clock.advance(1.0)
        eng.tick()
    raise AssertionError("condition not reached")


def random_checkpoints(rng: random.Random, share: float) -> dict[str, Any]:
    """Spec fields for a holder that checkpoints (with probability ``share``):
    an interval (one of them very short) and a pause per save."""
    if rng.random() < share:
        return {"checkpoint_interval": rng.choice([300.0, 1800.0, 7.5]),
                "checkpoint_cost": rng.choice([0.0, 20.0])}
    return {}


def random_guards(rng: random.Random) -> dict[str, Any]:
    """Spec fields that guard a holder against eviction, drawn at random: its restore
    cost, protection, minimum runtime and minimum progress."""
    return {
        "restart_cost": rng.choice([0.0, 60.0]),
        "protected": rng.random() < 0.1,
        "min_runtime": rng.choice([0.0, 0.0, 3000.0]),
        "min_progress": rng.choice([0.0, 0.0, 0.5]),
    }
