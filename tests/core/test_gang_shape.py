"""Gang shapes (``WorkloadSpec.gang``): tasks_per_node, max_replicas_per_node, pack vs spread.

Tables of named cases: the spec's validation, where the scheduler puts a
shaped gang (under both placement policies), what the control plane refuses,
and preemption for a shaped gang.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import ValidationError

from mlwe.core import NodeSpec, Place, ReplicaAlloc, Scheduler, State
from mlwe.core.policies.placement import BestFit, Spread
from mlwe.core.scheduler import SchedulerConfig
from tests.core.builders import (
    allocs_on,
    cluster,
    cpu_node,
    job,
    ok,
    release,
    run_to_running,
    running_on,
    submit,
)


def per_node(allocs: tuple[ReplicaAlloc, ...]) -> dict[str, int]:
    return dict(Counter(a.node for a in allocs))


# ------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class SpecCase:
    id: str
    replicas: int
    gang: dict[str, Any]
    error: str | None  # a fragment of the validation error, None: valid


SPEC_CASES = [
    SpecCase("tpn-divides", 8, {"tasks_per_node": 4}, None),
    SpecCase("tpn-not-dividing", 6, {"tasks_per_node": 4},
             "gang.tasks_per_node (4) must divide replicas (6)"),
    SpecCase("tpn-zero", 4, {"tasks_per_node": 0}, "greater than or equal to 1"),
    SpecCase("max-below-tpn", 4, {"tasks_per_node": 2, "max_replicas_per_node": 1},
             "max_replicas_per_node (1) is less than tasks_per_node (2)"),
    SpecCase("spread", 3, {"placement": "spread", "max_replicas_per_node": 2}, None),
    SpecCase("unknown-placement", 2, {"placement": "scatter"}, "'pack' or 'spread'"),
    SpecCase("unknown-field", 2, {"tasks_per_nodes": 2}, "Extra inputs are not permitted"),
]


@pytest.mark.parametrize("case", SPEC_CASES, ids=[c.id for c in SPEC_CASES])
def test_gang_spec(case: SpecCase) -> None:
    if case.error is None:
        spec = job("g", replicas=case.replicas, gang=case.gang)
        assert spec.gang is not None
        return
    with pytest.raises(ValidationError) as exc:
        job("g", replicas=case.replicas, gang=case.gang)
    assert case.error in str(exc.value)


# ------------------------------------------------------------------ placement
def nodes(*cpus: int) -> list[NodeSpec]:
    """CPU nodes c0, c1, ... with the given cores each."""
    return [cpu_node(f"c{i}", cpu=c, memory="64Gi") for i, c in enumerate(cpus)]


@dataclass(frozen=True)
class PlaceCase:
    id: str
    cluster: tuple[int, ...]  # cores per node
    replicas: int
    gang: dict[str, Any] | None
    expected: dict[str, int] | None  # replicas per node, None: the gang stays pending
    busy: tuple[tuple[str, int], ...] = ()  # (node, cores) already taken by a filler


PLACE_CASES = [
    PlaceCase("tpn-two-nodes-of-four", (8, 8, 8), 8, {"tasks_per_node": 4},
              {"c0": 4, "c1": 4}),
    PlaceCase("tpn-skips-a-node-short-of-room", (8, 8, 8), 4, {"tasks_per_node": 2},
              {"c1": 2, "c2": 2}, busy=(("c0", 7),)),
    PlaceCase("tpn-no-node-with-room", (3, 3, 3), 4, {"tasks_per_node": 4}, None),
    PlaceCase("tpn-not-enough-nodes", (4, 4, 2), 12, {"tasks_per_node": 4}, None),
    PlaceCase("tpn-pack-takes-the-tightest", (8, 4, 8), 4, {"tasks_per_node": 4},
              {"c1": 4}),
    PlaceCase("tpn-spread-takes-the-emptiest", (8, 4, 16), 4,
              {"tasks_per_node": 4, "placement": "spread"}, {"c2": 4}),
    PlaceCase("max-caps-each-node", (8, 8, 8), 6, {"max_replicas_per_node": 2},
              {"c0": 2, "c1": 2, "c2": 2}),
    PlaceCase("max-too-tight", (8, 8), 6, {"max_replicas_per_node": 2}, None),
    PlaceCase("pack-fills-few-nodes", (8, 8, 8), 6, {"placement": "pack"},
              {"c0": 6}),
    PlaceCase("pack-emptiest-first", (4, 16, 8), 6, {"placement": "pack"}, {"c1": 6}),
    PlaceCase("pack-overflows-to-the-next", (4, 4, 2), 6, {"placement": "pack"},
              {"c0": 4, "c1": 2}),
    PlaceCase("spread-one-per-node", (8, 8, 8), 3, {"placement": "spread"},
              {"c0": 1, "c1": 1, "c2": 1}),
    PlaceCase("spread-goes-round-again", (8, 8, 8), 5, {"placement": "spread"},
              {"c0": 2, "c1": 2, "c2": 1}),
    PlaceCase("spread-with-cap", (8, 8), 4, {"placement": "spread", "max_replicas_per_node": 2},
              {"c0": 2, "c1": 2}),
    PlaceCase("spread-cap-too-tight", (8, 8), 5,
              {"placement": "spread", "max_replicas_per_node": 2}, None),
]


@pytest.mark.parametrize("policy", [BestFit(), Spread()], ids=["best-fit", "spread"])
@pytest.mark.parametrize("case", PLACE_CASES, ids=[c.id for c in PLACE_CASES])
def test_shaped_gang_placement(case: PlaceCase, policy: Any) -> None:
    cp, _ = cluster(*nodes(*case.cluster))
    for i, (node, cores) in enumerate(case.busy):
        running_on(cp, job(f"filler-{i}", cpu=cores, memory="1Gi"), node)
    submit(cp, job("g", cpu=1, memory="1Gi", replicas=case.replicas, gang=case.gang))
    ok(Scheduler(placement=policy, config=SchedulerConfig(preemption=False)).run_cycle(cp))
    g = cp.get("g")
    if case.expected is None:
        assert g.state is State.PENDING
        assert g.placement == ()
    else:
        assert g.state is State.ADMITTED
        assert per_node(g.placement) == case.expected
    assert cp.validate_state() == []


# ----------------------------------------------- the control plane's own check
@dataclass(frozen=True)
class VerifyCase:
    id: str
    gang: dict[str, Any]
    nodes: tuple[str, ...]  # one node per replica, as a (possibly wrong) plan says
    reason: str | None  # a fragment of the refusal, None: accepted


VERIFY_CASES = [
    VerifyCase("tpn-kept", {"tasks_per_node": 2}, ("c0", "c0", "c1", "c1"), None),
    VerifyCase("tpn-uneven", {"tasks_per_node": 2}, ("c0", "c0", "c0", "c1"),
               "gang shape: node c0 holds 3 replicas; the gang asks tasks_per_node=2"),
    VerifyCase("tpn-one-each", {"tasks_per_node": 2}, ("c0", "c1", "c2", "c0"),
               "node c1 holds 1 replicas; the gang asks tasks_per_node=2"),
    VerifyCase("max-kept", {"max_replicas_per_node": 2}, ("c0", "c0", "c1", "c2"), None),
    VerifyCase("max-broken", {"max_replicas_per_node": 2}, ("c0", "c0", "c0", "c1"),
               "node c0 holds 3 replicas; the gang allows at most max_replicas_per_node=2"),
]


@pytest.mark.parametrize("case", VERIFY_CASES, ids=[c.id for c in VERIFY_CASES])
def test_control_plane_verifies_gang_shape(case: VerifyCase) -> None:
    """Whatever proposes a placement (a policy, the agent, a test), the control plane
    applies it only if it keeps the gang's shape."""
    cp, _ = cluster(*nodes(8, 8, 8))
    submit(cp, job("g", cpu=1, memory="1Gi", replicas=len(case.nodes), gang=case.gang))
    result = cp.apply([Place("g", allocs_on(cp, "g", *case.nodes))])
    if case.reason is None:
        assert result.accepted, result.reasons()
        assert cp.get("g").state is State.ADMITTED
    else:
        assert not result.accepted
        assert any(case.reason in r for r in result.reasons()), result.reasons()
        assert cp.get("g").state is State.PENDING
    assert cp.validate_state() == []


# ----------------------------------------------------------------- preemption
def test_shaped_gang_preempts_for_whole_nodes() -> None:
    """An urgent gang of 2 x 4 tasks per node, on three 4-core nodes each holding a
    low-priority job: it evicts exactly two of them, never splitting a node's tasks."""
    cp, _ = cluster(*nodes(4, 4, 4))
    for i in range(3):
        running_on(cp, job(f"low-{i}", cpu=4, memory="1Gi", priority="low"), f"c{i}")
    submit(cp, job("mpi", cpu=1, memory="1Gi", replicas=8, priority="urgent",
                   gang={"tasks_per_node": 4}))
    ok(Scheduler().run_cycle(cp))
    victims = [w.id for w in cp.workloads.values() if w.state is State.PREEMPTING]
    assert len(victims) == 2
    freed = {cp.get(v).placement[0].node for v in victims}
    for v in victims:
        release(cp, v)
    ok(Scheduler().run_cycle(cp))
    g = cp.get("mpi")
    assert g.state is State.ADMITTED
    assert per_node(g.placement) == dict.fromkeys(freed, 4)  # the victims' nodes, whole
    run_to_running(cp, ["mpi"])
    assert cp.validate_state() == []

