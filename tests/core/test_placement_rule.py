"""The placement rule (``rules.placement_violations``) as a table of named cases.

The rule is pure: it reads the nodes' static description and status and returns
every reason a placement is invalid, before free capacity and quota are counted.
Each case states a spec, the replica allocations and the whole list of reasons.
"""

from __future__ import annotations

import pytest

from mlwe.core import NodeStatus, ReplicaAlloc, Resources, WorkloadSpec
from mlwe.core.capacity import CapacityIndex, NodeInfo
from mlwe.core.rules import placement_violations, replica_violations
from tests.core.builders import A100, T4, job

GIB = 1024
A100_VRAM = 80 * GIB
T4_VRAM = 16 * GIB


def node(
    name: str, model: str | None = A100, gpus: int = 8, vram: int = A100_VRAM,
    labels: dict[str, str] | None = None,
) -> NodeInfo:
    n = gpus if model else 0
    return NodeInfo(
        name, model, n, vram if model else 0,
        Resources(n * 1000, n * vram if model else 0, 64_000, 512 * GIB), labels or {},
    )


def index() -> CapacityIndex:
    """a100-0 (zone a), t4-0, cpu-0 and a cordoned A100 node, all empty."""
    idx = CapacityIndex()
    idx.add_node(node("a100-0", labels={"zone": "a"}))
    idx.add_node(node("t4-0", T4, 4, T4_VRAM))
    idx.add_node(node("cpu-0", None))
    idx.add_node(node("a100-cordoned"), NodeStatus.CORDONED)
    return idx


def alloc(
    node: str, devices: tuple[int, ...] = (), gpu: int = 0, vram: int = 0,
    cpu: int = 8000, ram: int = 64 * GIB, per_device: int | None = None,
) -> ReplicaAlloc:
    """One replica's allocation (defaults: the builders' job of 8 cpu and 64Gi)."""
    if per_device is None:
        per_device = 1000 if devices else 0
    return ReplicaAlloc(node, devices, per_device, Resources(gpu, vram, cpu, ram))


def a100(dev: int = 0, node: str = "a100-0") -> ReplicaAlloc:
    """One whole A100 (80 GiB) on ``node``'s device ``dev``."""
    return alloc(node, (dev,), 1000, A100_VRAM)


ONE_A100 = job("one-a100", gpu=1, models=[A100])
ANY_GPU = job("any-gpu", gpu=1)
CPU_ONLY = job("cpu-only")

CASES: list[tuple[str, WorkloadSpec, object, list[str]]] = [
    # ------------------------------------------------------------- valid
    ("one-gpu-fits", ONE_A100, (a100(4),), []),
    ("cpu-only-fits", CPU_ONLY, (alloc("cpu-0"),), []),
    ("cpu-only-on-a-gpu-node-fits", CPU_ONLY, (alloc("a100-0"),), []),
    ("t4-fits-any-model", ANY_GPU, (alloc("t4-0", (1,), 1000, T4_VRAM),), []),
    ("fraction-fits", job("half", gpu=0.5, models=[A100]),
     (alloc("a100-0", (0,), 500, A100_VRAM // 2, per_device=500),), []),
    ("gang-fits", job("gang", gpu=4, models=[A100], replicas=2),
     (alloc("a100-0", (0, 1, 2, 3), 4000, 4 * A100_VRAM),
      alloc("a100-0", (4, 5, 6, 7), 4000, 4 * A100_VRAM)), []),
    # ----------------------------------------------------------- the gang
    ("gang-incomplete", job("gang", gpu=1, replicas=2), (a100(0),),
     ["gang incomplete: 1 replica placements for 2 replicas"]),
    ("replicas-not-a-tuple", ONE_A100, [a100(0)],
     ["gang incomplete: ? replica placements for 1 replicas"]),
    ("gang-shape-broken",
     job("spread", gpu=1, models=[A100], replicas=2, gang={"max_replicas_per_node": 1}),
     (a100(0), a100(1)),
     ["gang shape: node a100-0 holds 2 replicas; the gang allows at most"
      " max_replicas_per_node=1"]),
    # ------------------------------------------------------- malformed
    ("not-a-replica-allocation", ONE_A100, ("a100-0",),
     ["replica 0: not a replica allocation"]),
    ("unknown-node", ONE_A100, (a100(0, node="nowhere"),),
     ["replica 0: unknown node 'nowhere'"]),
    ("negative-quantities-stop-the-replica", ONE_A100,
     (alloc("a100-cordoned", (0,), 1000, A100_VRAM, cpu=-1),),
     ["replica 0: node a100-cordoned is cordoned", "replica 0: negative quantities (cpu)"]),
    ("each-replica-by-its-index", job("pair", gpu=1, models=[A100], replicas=2),
     (a100(0), a100(1, node="nowhere")),
     ["replica 1: unknown node 'nowhere'"]),
    # ------------------------------------------------------------ the node
    ("node-not-ready", ONE_A100, (a100(0, node="a100-cordoned"),),
     ["replica 0: node a100-cordoned is cordoned"]),
    ("node-selector-not-matched", job("zone-b", gpu=1, node_selector={"zone": "b"}),
     (a100(0),),
     ["replica 0: node a100-0 does not match node_selector"]),
    ("gpu-work-on-a-cpu-node", ANY_GPU, (alloc("cpu-0", (0,), 1000, A100_VRAM),),
     ["replica 0: node cpu-0 has no GPU"]),
    ("wrong-gpu-model", ONE_A100, (alloc("t4-0", (0,), 1000, T4_VRAM),),
     ["replica 0: T4 on t4-0 is not among accepted models A100-80GB"]),
    ("vram-per-gpu-too-small", job("big-vram", gpu=1, min_vram_per_gpu="40Gi"),
     (alloc("t4-0", (0,), 1000, T4_VRAM),),
     ["replica 0: T4 has 16384 MiB VRAM per GPU, 40960 MiB required"]),
    # ------------------------------------------------------ the allocation
    ("allocation-not-the-request", ONE_A100,
     (alloc("a100-0", (0, 1), 2000, 2 * A100_VRAM),),
     ["replica 0: allocation {gpu=2, vram=160Gi, cpu=8, ram=64Gi} does not match the"
      " request (gpu=1000, cpu=8000, ram=65536)",
      "replica 0: VRAM 163840 MiB allocated, 81920 MiB expected"]),
    ("fraction-on-two-devices", job("half", gpu=0.5, models=[A100]),
     (alloc("a100-0", (0, 1), 500, A100_VRAM // 2, per_device=500),),
     ["replica 0: a fractional GPU lives on exactly one device"]),
    ("whole-gpu-split-per-device", ONE_A100,
     (alloc("a100-0", (0,), 1000, A100_VRAM, per_device=500),),
     ["replica 0: 500 milli per device; whole GPUs are whole devices, a fraction is the"
      " fraction asked"]),
    ("vram-larger-than-the-devices", job("vram", gpu=1, resources={
        "gpu": 1, "vram": "40Gi", "cpu": 8, "memory": "64Gi"}),
     (alloc("t4-0", (0,), 1000, 40 * GIB),),
     ["replica 0: VRAM larger than its devices hold"]),
    ("devices-for-cpu-only-work", CPU_ONLY, (alloc("cpu-0", (0,), 0, 0, per_device=0),),
     ["replica 0: GPU devices or VRAM given to a CPU-only workload"]),
]


@pytest.mark.parametrize(
    ("spec", "replicas", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_placement_violations(spec: WorkloadSpec, replicas: object, expected: list[str]) -> None:
    assert placement_violations(spec, replicas, index()) == expected


def test_free_capacity_is_not_the_rule_s_business() -> None:
    """A device already held elsewhere is the control plane's capacity probe to
    refuse (it depends on the batch so far); the rule judges the shape only."""
    idx = index()
    idx.allocate(a100(0))
    assert placement_violations(ONE_A100, (a100(0),), idx) == []


def test_the_rule_reads_and_never_writes() -> None:
    idx = index()
    before = [(idx.free(n), idx.free_devices(n), idx.status(n)) for n in idx.node_names()]
    placement_violations(ONE_A100, (a100(0), a100(0, node="nowhere")), idx)
    placement_violations(ONE_A100, (a100(0),), idx)
    assert [(idx.free(n), idx.free_devices(n), idx.status(n)) for n in idx.node_names()] == before


def test_replica_violations_needs_only_the_node_s_description() -> None:
    """Per replica, without an index: every reason, unprefixed, in the order checked."""
    t4 = node("t4-0", T4, 4, T4_VRAM)
    spec = job("picky", gpu=1, models=[A100], min_vram_per_gpu="40Gi")
    assert replica_violations(alloc("t4-0", (0,), 1000, T4_VRAM), spec, t4, NodeStatus.DOWN) == [
        "node t4-0 is down",
        "T4 on t4-0 is not among accepted models A100-80GB",
        "T4 has 16384 MiB VRAM per GPU, 40960 MiB required",
    ]
    assert replica_violations(a100(0), spec, node("a100-0"), NodeStatus.READY) == []
