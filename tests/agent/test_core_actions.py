"""The two core actions the agent needed: Evict (move off a node) and SetResources
(requeue with more memory). Both are verified by the control plane like any other."""

from __future__ import annotations

import pytest

from mlwe.core import (
    Evict,
    Exited,
    NodeStatus,
    ReplicaResources,
    Retry,
    SetNodeStatus,
    SetResources,
    State,
)
from tests.core.builders import cluster, cpu_node, gpu_node, job, ok, release, running_on, submit


def _res(**kw: object) -> ReplicaResources:
    return ReplicaResources.model_validate(kw)


def test_evict_moves_a_workload_back_to_the_queue_through_release() -> None:
    cp, _ = cluster(gpu_node("g0"), gpu_node("g1"))
    running_on(cp, job("a", gpu=2), "g0")
    ok(cp.apply([SetNodeStatus("g0", NodeStatus.CORDONED, "ecc errors"), Evict("a", "ecc errors")]))
    assert cp.get("a").state is State.PREEMPTING
    assert cp.get("a").preempted_by is None
    release(cp, "a")
    assert cp.get("a").state is State.PREEMPTED
    assert cp.validate_state() == []


@pytest.mark.parametrize(
    "spec_kw,cordon,expect",
    [
        ({"protected": True}, False, "protected"),
        ({"min_runtime": "1h"}, False, "minimum runtime"),
        ({"protected": True}, True, None),  # moving it off a node that is not ready protects it
    ],
    ids=["protected", "min-runtime", "protected-but-node-cordoned"],
)
def test_evict_keeps_preemption_guarantees_unless_the_node_is_not_ready(
    spec_kw: dict[str, object], cordon: bool, expect: str | None
) -> None:
    cp, _ = cluster(gpu_node("g0"))
    running_on(cp, job("a", gpu=1, **spec_kw), "g0")
    if cordon:
        ok(cp.apply([SetNodeStatus("g0", NodeStatus.CORDONED)]))
    v = cp.version
    r = cp.apply([Evict("a", "test")])
    if expect is None:
        assert r.accepted
    else:
        assert not r.accepted and expect in r.reasons()[0]
        assert cp.version == v and cp.get("a").state is State.RUNNING


def test_evict_rejects_waiting_and_unknown_workloads() -> None:
    cp, _ = cluster(gpu_node("g0", gpus=1))
    submit(cp, job("w", gpu=2))
    r = cp.apply([Evict("w"), Evict("ghost")])
    assert not r.accepted
    assert "only admitted, starting or running" in r.rejections[0].reasons[0]
    assert "unknown workload 'ghost'" in r.rejections[1].reasons[0]


def test_set_resources_raises_memory_of_a_failed_workload_before_its_retry() -> None:
    cp, _ = cluster(cpu_node("c0", memory="256Gi"))
    running_on(cp, job("etl", memory="16Gi"), "c0")
    w = cp.get("etl")
    ok(cp.apply([Exited("etl", w.attempt, 137, "oom")]))
    ok(cp.apply([SetResources("etl", _res(cpu=8, memory="32Gi"), "oom at 16Gi"), Retry("etl")]))
    w = cp.get("etl")
    assert w.spec.resources.memory == 32 * 1024 and w.state is State.PENDING
    assert w.spec.name == "etl" and w.spec.id == "etl"  # the rest of the spec is kept


@pytest.mark.parametrize(
    "res,state_setup,expect",
    [
        (_res(cpu=8, memory="2Ti"), "pending", "no node in the cluster can hold"),
        (_res(gpu=1, cpu=8, memory="8Gi"), "pending", "no node in the cluster can hold"),
        (_res(cpu=8, memory="32Gi"), "running", "resources change only while it waits"),
    ],
    ids=["more-memory-than-any-node", "gpu-on-cpu-cluster", "running"],
)
def test_set_resources_rejections(res: ReplicaResources, state_setup: str, expect: str) -> None:
    cp, _ = cluster(cpu_node("c0", memory="256Gi"))
    if state_setup == "running":
        running_on(cp, job("j", memory="16Gi"), "c0")
    else:
        submit(cp, job("j", memory="16Gi"))
    before = cp.get("j").spec
    v = cp.version
    r = cp.apply([SetResources("j", res)])
    assert not r.accepted and expect in r.reasons()[0]
    assert cp.get("j").spec is before and cp.version == v


def test_set_resources_rolls_back_with_its_batch() -> None:
    cp, _ = cluster(cpu_node("c0"))
    submit(cp, job("j", memory="16Gi"))
    before = cp.get("j").spec
    r = cp.apply([SetResources("j", _res(cpu=8, memory="32Gi")), Evict("nope")])
    assert not r.accepted
    assert cp.get("j").spec is before
