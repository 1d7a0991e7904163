"""Scheduling policies as tables of named cases with exact outcomes.

Each placement/preemption case builds a cluster, brings ``running`` workloads
to RUNNING at t=0 on the nodes given, lets ``elapsed`` seconds pass, submits
``waiting`` in order and asks the default scheduler for one plan. The plan's
placements and evictions must be exactly the expected ones, and the control
plane must accept the plan as it stands (policy and verifier agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mlwe.core import (
    DeadlineStatus,
    NodeSpec,
    Place,
    Preempt,
    Progress,
    QueueSpec,
    Scheduler,
    SchedulerConfig,
    WorkloadSpec,
)
from mlwe.core.capacity import FULL
from mlwe.core.policies.placement import BestFit, PlacementPolicy, Spread
from tests.core.builders import (
    A100,
    T4,
    cluster,
    cpu_node,
    gpu_node,
    job,
    ok,
    queue,
    release,
    run_to_running,
    running_on,
    submit,
)

HOUR = 3600.0


@dataclass(frozen=True)
class Case:
    id: str
    nodes: tuple[NodeSpec, ...]
    running: tuple[tuple[WorkloadSpec, str], ...] = ()  # (spec, "node[,node...]")
    waiting: tuple[WorkloadSpec, ...] = ()
    elapsed: float = 0.0
    checkpoints: tuple[tuple[str, float], ...] = ()  # Progress(checkpointed) just before the cycle
    progress: tuple[tuple[str, float], ...] = ()  # Progress (no checkpoint) just before the cycle
    queues: tuple[QueueSpec, ...] = ()
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    placement: type[PlacementPolicy] = BestFit
    # expected
    placed: dict[str, str] = field(default_factory=dict)  # id -> "node[:gpuN],node..."
    evicted: dict[str, str] = field(default_factory=dict)  # victim -> "preemptor (reason)"
    waits: dict[str, str] = field(default_factory=dict)  # id -> fragment of its pending reason


def where(p: Place) -> str:
    """A placement as text: node per replica, with the device for a fractional GPU."""
    parts = []
    for r in p.replicas:
        frac = 0 < r.gpu_per_device < FULL
        parts.append(f"{r.node}:gpu{r.devices[0]}" if frac else r.node)
    return ",".join(parts)


A100_0, A100_1, A100_2, A100_3 = (gpu_node(f"a100-{i}") for i in range(4))
T4_0 = gpu_node("t4-0", T4, 4, cpu=32, memory="128Gi")
CPU_0 = cpu_node("cpu-0")

# workloads that recur across cases
FT = job(
    "ft", gpu=8, models=[A100], priority="urgent", kind="fine-tune",
    estimated_duration="2h", deadline_in="3h",
)
BATCH8 = dict(gpu=8, models=[A100], priority="batch")

CASES = [
    # ------------------------------------------------------------ preemption
    Case(
        "urgent-fine-tune-evicts-a100-embedding-not-t4-batch",
        nodes=(A100_0, T4_0, CPU_0),
        running=(
            (job("emb", kind="batch-embedding", restart_cost="30m", **BATCH8), "a100-0"),
            # cheaper to evict (4 GPUs, no restart cost), but frees nothing ft can use
            (job("t4-batch", gpu=4, models=[T4], priority="batch"), "t4-0"),
        ),
        elapsed=HOUR,
        waiting=(FT,),
        evicted={"emb": "ft (priority)"},
        waits={"ft": "preempting 1 workload(s)"},
    ),
    Case(
        "cpu-only-job-never-evicted-to-free-gpus",
        # ft needs 16 cores: evicting the GPU job alone leaves only 8, the rest is held by
        # a CPU-only job, which must not be evicted to make room for a GPU request
        nodes=(gpu_node("a100-0", cpu=64),),
        running=(
            (job("gpu-job", cpu=8, **BATCH8), "a100-0"),
            (job("cpu-job", cpu=56, priority="low"), "a100-0"),
        ),
        elapsed=HOUR,
        waiting=(job("ft", gpu=8, cpu=16, models=[A100], priority="urgent"),),
        waits={"ft": "no room for 8 x A100-80GB, 16 cpu"},
    ),
    Case(
        "cpu-only-job-spared-when-gpu-victim-suffices",
        nodes=(gpu_node("a100-0", cpu=64),),
        running=(
            (job("gpu-job", cpu=8, **BATCH8), "a100-0"),
            (job("cpu-job", cpu=40, priority="low"), "a100-0"),
        ),
        elapsed=HOUR,
        waiting=(job("ft", gpu=8, cpu=16, models=[A100], priority="urgent"),),
        evicted={"gpu-job": "ft (priority)"},
    ),
    Case(
        "protected-workload-survives",
        nodes=(A100_0, A100_1),
        running=(
            (job("prot", protected=True, **BATCH8), "a100-0"),  # cheapest, but protected
            (job("other", restart_cost="1h", **BATCH8), "a100-1"),
        ),
        elapsed=HOUR,
        waiting=(FT,),
        evicted={"other": "ft (priority)"},
    ),
    Case(
        "only-protected-candidates-nobody-evicted",
        nodes=(A100_0,),
        running=((job("prot", protected=True, **BATCH8), "a100-0"),),
        elapsed=HOUR,
        waiting=(FT,),
        waits={"ft": "no room"},
    ),
    Case(
        "under-min-runtime-survives",
        nodes=(A100_0, A100_1),
        running=(
            (job("young", min_runtime="2h", **BATCH8), "a100-0"),
            (job("other", restart_cost="1h", **BATCH8), "a100-1"),
        ),
        elapsed=HOUR,
        waiting=(FT,),
        evicted={"other": "ft (priority)"},
    ),
    Case(
        "past-min-runtime-is-fair-game",
        nodes=(A100_0, A100_1),
        running=(
            (job("young", min_runtime="30m", **BATCH8), "a100-0"),
            (job("other", restart_cost="1h", **BATCH8), "a100-1"),
        ),
        elapsed=HOUR,
        waiting=(FT,),
        evicted={"young": "ft (priority)"},
    ),
    Case(
        "under-min-progress-survives",
        nodes=(A100_0, A100_1),
        running=(
            (job("slow", min_progress=0.5, estimated_duration="10h", **BATCH8), "a100-0"),
            (job("other", restart_cost="1h", **BATCH8), "a100-1"),
        ),
        elapsed=HOUR,
        progress=(("slow", 0.2),),
        waiting=(FT,),
        evicted={"other": "ft (priority)"},
    ),
    Case(
        "equal-priority-never-preempts",
        nodes=(A100_0,),
        running=((job("incumbent", gpu=8, models=[A100], priority="urgent"), "a100-0"),),
        elapsed=HOUR,
        waiting=(FT,),
        waits={"ft": "no room"},
    ),
    Case(
        "lower-priority-never-preempts",
        nodes=(A100_0,),
        running=((job("incumbent", gpu=8, models=[A100], priority="critical"), "a100-0"),),
        elapsed=HOUR,
        waiting=(FT,),
        waits={"ft": "no room"},
    ),
    Case(
        "cheapest-victim-recent-checkpoint-over-unsaved-work",
        nodes=(A100_0, A100_1),
        running=(
            (job("unsaved", **BATCH8), "a100-0"),  # first node: chosen on ties, so cost decides
            (job("saved", checkpoint_interval="10m", **BATCH8), "a100-1"),
        ),
        elapsed=3500.0,  # saved: last checkpoint at 3000s, 500s at risk; unsaved: 3500s
        waiting=(FT,),
        evicted={"saved": "ft (priority)"},
    ),
    Case(
        "cheapest-victim-checkpoint-reported-as-progress",
        nodes=(A100_0, A100_1),
        running=(
            (job("unsaved", estimated_duration="10h", **BATCH8), "a100-0"),
            (job("saved", estimated_duration="10h", **BATCH8), "a100-1"),
        ),
        elapsed=HOUR,
        checkpoints=(("saved", 0.1),),
        waiting=(FT,),
        evicted={"saved": "ft (priority)"},
    ),
    Case(
        "minimal-set-drops-the-cheap-victim-that-frees-too-little",
        # cheapest first, the 2-GPU job goes first but does not make room; once the
        # 6-GPU job is in the set the 2-GPU one is superfluous and must be dropped
        nodes=(A100_0,),
        running=(
            (job("small", gpu=2, models=[A100], priority="batch", checkpoint_interval="5m"),
             "a100-0"),
            (job("big", gpu=6, models=[A100], priority="batch"), "a100-0"),
        ),
        elapsed=HOUR,
        waiting=(job("ft", gpu=6, models=[A100], priority="urgent"),),
        evicted={"big": "ft (priority)"},
    ),
    Case(
        "minimal-set-one-of-two-equal-victims",
        nodes=(A100_0,),
        running=(
            (job("e1", gpu=4, models=[A100], priority="batch"), "a100-0"),
            (job("e2", gpu=4, models=[A100], priority="batch"), "a100-0"),
        ),
        elapsed=HOUR,
        waiting=(job("ft", gpu=4, models=[A100], priority="urgent"),),
        evicted={"e1": "ft (priority)"},
    ),
    Case(
        "victims-are-not-chosen-when-free-room-exists",
        nodes=(A100_0, A100_1),
        running=((job("emb", **BATCH8), "a100-0"),),
        elapsed=HOUR,
        waiting=(FT,),
        placed={"ft": "a100-1"},
    ),
    # ------------------------------------------------------------------ gangs
    Case(
        "gang-4x8-placed-whole-on-4-nodes",
        nodes=(A100_0, A100_1, A100_2, A100_3),
        waiting=(job("gang", gpu=8, models=[A100], replicas=4),),
        placed={"gang": "a100-0,a100-1,a100-2,a100-3"},
    ),
    Case(
        "gang-4x8-with-3-free-nodes-places-nothing",
        nodes=(A100_0, A100_1, A100_2, A100_3),
        running=((job("busy", gpu=8, models=[A100]), "a100-2"),),
        waiting=(job("gang", gpu=8, models=[A100], replicas=4),),
        waits={"gang": "no room for 4 x [8 x A100-80GB"},
    ),
    Case(
        "gang-4x4-packs-two-replicas-per-node",
        nodes=(A100_0, A100_1),
        waiting=(job("gang", gpu=4, models=[A100], replicas=4),),
        placed={"gang": "a100-0,a100-0,a100-1,a100-1"},
    ),
    # ------------------------------------------------------------ quota reclaim
    Case(
        "borrowed-quota-reclaimed-at-equal-priority",
        queues=(queue("qa", cohort="c", gpu=8), queue("qb", cohort="c", gpu=8)),
        nodes=(A100_0, A100_1),
        running=(
            (job("b1", gpu=8, queue="qb", restart_cost="1h"), "a100-0"),
            (job("b2", gpu=8, queue="qb"), "a100-1"),  # above qb's nominal: borrowed from qa
        ),
        elapsed=HOUR,
        waiting=(job("a1", gpu=8, queue="qa"),),
        evicted={"b2": "a1 (reclaim)"},
    ),
    Case(
        "borrowed-quota-reclaimed-at-lower-priority",
        queues=(queue("qa", cohort="c", gpu=8), queue("qb", cohort="c", gpu=8)),
        nodes=(A100_0, A100_1),
        running=(
            (job("b1", gpu=8, queue="qb", restart_cost="1h"), "a100-0"),
            (job("b2", gpu=8, queue="qb"), "a100-1"),
        ),
        elapsed=HOUR,
        waiting=(job("a1", gpu=8, queue="qa", priority="low"),),
        evicted={"b2": "a1 (reclaim)"},
    ),
    Case(
        "no-reclaim-from-a-queue-within-its-nominal",
        queues=(queue("qa", cohort="c", gpu=8), queue("qb", cohort="c", gpu=8)),
        nodes=(A100_0, A100_1),
        running=(
            (job("b1", gpu=8, queue="qb"), "a100-0"),
            (job("a0", gpu=8, queue="qa"), "a100-1"),
        ),
        elapsed=HOUR,
        waiting=(job("a1", gpu=8, queue="qa"),),
        waits={"a1": "no room"},
    ),
    # ------------------------------------------------------------- backfill
    Case(
        "backfill-short-job-ending-before-the-reservation-starts",
        nodes=(A100_0, A100_1),
        running=(
            (job("r0", gpu=8, estimated_duration="2h"), "a100-0"),
            (job("r1", gpu=4, estimated_duration="1h"), "a100-1"),
        ),
        waiting=(
            job("head", gpu=8, estimated_duration="1h"),
            job("short", gpu=4, estimated_duration="30m"),
        ),
        placed={"short": "a100-1"},
        waits={"head": "holds a reservation on a100-1"},
    ),
    Case(
        "backfill-long-job-kept-off-the-reserved-node",
        nodes=(A100_0, A100_1),
        running=(
            (job("r0", gpu=8, estimated_duration="2h"), "a100-0"),
            (job("r1", gpu=4, estimated_duration="1h"), "a100-1"),
        ),
        waiting=(
            job("head", gpu=8, estimated_duration="1h"),
            job("long", gpu=4, estimated_duration="5h"),
        ),
        waits={
            "head": "holds a reservation on a100-1",
            "long": "outside the nodes reserved for head",
        },
    ),
    Case(
        "backfill-job-without-estimate-kept-off-the-reserved-node",
        nodes=(A100_0, A100_1),
        running=(
            (job("r0", gpu=8, estimated_duration="2h"), "a100-0"),
            (job("r1", gpu=4, estimated_duration="1h"), "a100-1"),
        ),
        waiting=(job("head", gpu=8, estimated_duration="1h"), job("unknown", gpu=4)),
        waits={"unknown": "outside the nodes reserved for head"},
    ),
    Case(
        "backfill-long-job-may-use-a-node-outside-the-reservation",
        nodes=(A100_0, A100_1, A100_2),
        running=(
            (job("r0", gpu=8, estimated_duration="2h"), "a100-0"),
            (job("r1", gpu=4, estimated_duration="1h"), "a100-1"),
            (job("r2", gpu=4, estimated_duration="10h"), "a100-2"),
        ),
        waiting=(
            job("head", gpu=8, estimated_duration="1h"),
            job("long", gpu=4, estimated_duration="5h"),
        ),
        placed={"long": "a100-2"},
    ),
    Case(
        "without-backfill-long-job-takes-the-heads-node",
        config=SchedulerConfig(backfill=False),
        nodes=(A100_0, A100_1),
        running=(
            (job("r0", gpu=8, estimated_duration="2h"), "a100-0"),
            (job("r1", gpu=4, estimated_duration="1h"), "a100-1"),
        ),
        waiting=(
            job("head", gpu=8, estimated_duration="1h"),
            job("long", gpu=4, estimated_duration="5h"),
        ),
        placed={"long": "a100-1"},
    ),
    Case(
        "strict-order-stops-at-the-blocked-head",
        config=SchedulerConfig(strict_order=True),
        nodes=(A100_0, A100_1),
        running=((job("r0", gpu=8), "a100-0"), (job("r1", gpu=4), "a100-1")),
        waiting=(job("head", gpu=8), job("small", gpu=1)),
        waits={"small": "strict order: waits behind head"},
    ),
    # ------------------------------------------------------------- placement
    Case(
        "best-fit-packs-onto-the-busier-node",
        nodes=(A100_0, A100_1),
        running=((job("r", gpu=4, models=[A100]), "a100-1"),),
        waiting=(job("j", gpu=2, models=[A100]),),
        placed={"j": "a100-1"},
    ),
    Case(
        "spread-takes-the-emptiest-node",
        placement=Spread,
        nodes=(A100_0, A100_1),
        running=((job("r", gpu=4, models=[A100]), "a100-0"),),
        waiting=(job("j", gpu=2, models=[A100]),),
        placed={"j": "a100-1"},
    ),
    Case(
        "best-fit-takes-the-least-valuable-adequate-model",
        nodes=(A100_0, T4_0),
        waiting=(job("j", gpu=1, cpu=4),),
        placed={"j": "t4-0"},
    ),
    Case(
        "best-fit-respects-min-vram",
        nodes=(A100_0, T4_0),
        waiting=(job("j", gpu=1, cpu=4, min_vram_per_gpu="40Gi"),),
        placed={"j": "a100-0"},
    ),
    Case(
        "spread-takes-the-node-with-most-free-gpus",
        placement=Spread,
        nodes=(T4_0, A100_0),
        waiting=(job("j", gpu=1, cpu=4),),
        placed={"j": "a100-0"},
    ),
    Case(
        "cpu-work-goes-to-cpu-nodes-first",
        nodes=(A100_0, CPU_0),
        waiting=(job("etl", cpu=32, memory="256Gi", priority="low"),),
        placed={"etl": "cpu-0"},
    ),
    Case(
        "fractional-gpus-packed-on-the-same-device",
        nodes=(T4_0,),
        waiting=(
            job("f1", gpu=0.5, cpu=2, memory="8Gi", models=[T4]),
            job("f2", gpu=0.5, cpu=2, memory="8Gi", models=[T4]),
            job("f3", gpu=0.25, cpu=2, memory="8Gi", models=[T4]),
        ),
        placed={"f1": "t4-0:gpu0", "f2": "t4-0:gpu0", "f3": "t4-0:gpu1"},
    ),
    Case(
        "fractional-gpu-joins-the-partly-used-device",
        nodes=(T4_0,),
        running=(
            (job("whole", gpu=1, cpu=2, memory="8Gi", models=[T4]), "t4-0"),
            (job("half", gpu=0.5, cpu=2, memory="8Gi", models=[T4]), "t4-0"),
        ),
        waiting=(job("quarter", gpu=0.25, cpu=2, memory="8Gi", models=[T4]),),
        placed={"quarter": "t4-0:gpu1"},
    ),
    Case(
        "fractional-gpu-takes-the-fullest-device-that-fits",
        nodes=(T4_0,),
        running=(
            (job("x", gpu=0.5, cpu=2, memory="8Gi", models=[T4]), "t4-0"),  # gpu0: 0.5 left
            (job("y", gpu=0.75, cpu=2, memory="8Gi", models=[T4]), "t4-0"),  # gpu1: 0.25 left
        ),
        waiting=(job("z", gpu=0.25, cpu=2, memory="8Gi", models=[T4]),),
        placed={"z": "t4-0:gpu1"},
    ),
    Case(
        "fractional-gpu-skips-a-device-with-too-little-left",
        nodes=(T4_0,),
        running=((job("most", gpu=0.75, cpu=2, memory="8Gi", models=[T4]), "t4-0"),),
        waiting=(job("half", gpu=0.5, cpu=2, memory="8Gi", models=[T4]),),
        placed={"half": "t4-0:gpu1"},
    ),
]


def _setup(case: Case):
    cp, clock = cluster(*case.nodes, queues=case.queues)
    for spec, nodes in case.running:
        running_on(cp, spec, *nodes.split(","))
    clock.advance(case.elapsed)
    for wid, frac in case.progress:
        ok(cp.apply([Progress(wid, cp.get(wid).attempt, frac)]))
    for wid, frac in case.checkpoints:
        ok(cp.apply([Progress(wid, cp.get(wid).attempt, frac, checkpointed=True)]))
    submit(cp, *case.waiting)
    scheduler = Scheduler(placement=case.placement(), config=case.config)
    return cp, clock, scheduler


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan(case: Case) -> None:
    cp, _, scheduler = _setup(case)
    plan = scheduler.plan(cp)

    placed = {a.workload: where(a) for a in plan.actions if isinstance(a, Place)}
    evicted = {
        a.victim: f"{a.preemptor} ({a.reason.value})"
        for a in plan.actions
        if isinstance(a, Preempt)
    }
    assert placed == case.placed
    assert evicted == case.evicted
    for wid, fragment in case.waits.items():
        assert fragment in plan.pending.get(wid, ""), plan.pending
    # the verifier accepts the plan exactly as the policies made it
    ok(cp.apply(plan.actions, plan.version))
    assert cp.validate_state() == []


def test_backfill_reservation_is_exact() -> None:
    case = next(c for c in CASES if c.id == "backfill-long-job-kept-off-the-reserved-node")
    cp, _, scheduler = _setup(case)
    plan = scheduler.plan(cp)
    assert plan.reservation is not None
    assert (plan.reservation.workload, plan.reservation.start, plan.reservation.nodes) == (
        "head",
        HOUR,  # r1 ends after its 1h estimate
        frozenset({"a100-1"}),
    )


def test_reclaimed_quota_goes_to_the_lender_once_released() -> None:
    """The whole reclaim: evict the borrower, wait for its release, place the lender."""
    case = next(c for c in CASES if c.id == "borrowed-quota-reclaimed-at-equal-priority")
    cp, clock, scheduler = _setup(case)
    ok(scheduler.run_cycle(cp))
    assert cp.get("b2").state == "preempting"
    assert cp.queues["qb"].usage[0] == 16_000  # still held until the backend confirms

    ok(scheduler.run_cycle(cp))  # nothing may be placed on resources not yet released
    assert cp.get("a1").state == "pending"
    assert "waiting for 1 victim(s) to release: b2" in cp.get("a1").pending_reason

    clock.advance(30)
    release(cp, "b2")
    ok(scheduler.run_cycle(cp))
    assert cp.get("a1").state == "admitted"
    assert [a.node for a in cp.get("a1").placement] == ["a100-1"]
    assert (cp.queues["qa"].usage[0], cp.queues["qb"].usage[0]) == (8_000, 8_000)
    assert cp.get("b2").state == "preempted"
    assert cp.validate_state() == []


def test_urgent_preemption_end_to_end() -> None:
    """Victim checkpoints and releases; the preemptor takes its node; the victim requeues."""
    cp, clock = cluster(A100_0, T4_0)
    scheduler = Scheduler()
    submit(
        cp,
        job("emb", kind="batch-embedding", estimated_duration="4h", **BATCH8),
        job("t4-batch", gpu=4, models=[T4], priority="batch"),
    )
    ok(scheduler.run_cycle(cp))
    run_to_running(cp, ["emb", "t4-batch"])
    clock.advance(HOUR)
    submit(cp, FT)
    ok(scheduler.run_cycle(cp))
    assert {w.id: w.state.value for w in cp.workloads.values()} == {
        "emb": "preempting",
        "t4-batch": "running",
        "ft": "pending",
    }
    release(cp, "emb", checkpointed_progress=0.25)
    ok(scheduler.run_cycle(cp))
    emb, ft = cp.get("emb"), cp.get("ft")
    assert ft.state == "admitted"
    assert [a.node for a in ft.placement] == ["a100-0"]
    assert (emb.state.value, emb.work_done, emb.preempted_by) == ("preempted", HOUR, "ft")
    assert cp.validate_state() == []


# ----------------------------------------------------------------- ordering
@dataclass(frozen=True)
class OrderCase:
    id: str
    submitted: tuple[WorkloadSpec, ...]  # in arrival order
    expected: tuple[str, ...]
    running: tuple[tuple[WorkloadSpec, str], ...] = ()
    queues: tuple[QueueSpec, ...] = ()


ORDER_CASES = [
    OrderCase(
        "priority-first",
        submitted=(job("low", priority="low"), job("high", priority="high")),
        expected=("high", "low"),
    ),
    OrderCase(
        "then-least-slack",
        submitted=(
            job("none", estimated_duration="1h"),
            job("loose", estimated_duration="1h", deadline_in="10h"),
            job("tight", estimated_duration="1h", deadline_in="2h"),
        ),
        expected=("tight", "loose", "none"),
    ),
    OrderCase(
        "a-deadline-beyond-the-urgency-horizon-does-not-jump-the-queue",
        submitted=(
            job("first", estimated_duration="1h"),
            job("next-week", estimated_duration="1h", deadline_in="7d"),
        ),
        expected=("first", "next-week"),
    ),
    OrderCase(
        "priority-beats-slack",
        submitted=(
            job("urgent-deadline", estimated_duration="1h", deadline_in="90m"),
            job("high", priority="high"),
        ),
        expected=("high", "urgent-deadline"),
    ),
    OrderCase(
        "then-fair-share-least-used-queue-first",
        queues=(QueueSpec(name="qa"), QueueSpec(name="qb")),
        running=((job("qa-running", gpu=4, queue="qa"), "a100-0"),),
        submitted=(job("from-qa", queue="qa"), job("from-qb", queue="qb")),
        expected=("from-qb", "from-qa"),
    ),
    OrderCase(
        "slack-beats-fair-share",
        queues=(QueueSpec(name="qa"), QueueSpec(name="qb")),
        running=((job("qa-running", gpu=4, queue="qa"), "a100-0"),),
        submitted=(
            job("idle-queue", queue="qb"),
            job("busy-queue-deadline", queue="qa", estimated_duration="1h", deadline_in="3h"),
        ),
        expected=("busy-queue-deadline", "idle-queue"),
    ),
    OrderCase(
        "then-arrival",
        submitted=(job("c"), job("a"), job("b")),
        expected=("c", "a", "b"),
    ),
]


@pytest.mark.parametrize("case", ORDER_CASES, ids=[c.id for c in ORDER_CASES])
def test_queue_order(case: OrderCase) -> None:
    cp, clock = cluster(A100_0, queues=case.queues)
    for spec, node in case.running:
        running_on(cp, spec, node)
    for spec in case.submitted:
        clock.advance(1)
        submit(cp, spec)
    assert tuple(w.id for w in Scheduler().ordered(cp)) == case.expected


# ------------------------------------------------------- deadline admission
@dataclass(frozen=True)
class DeadlineCase:
    id: str
    candidate: WorkloadSpec
    expected: DeadlineStatus
    earliest_start: float  # seconds from now (inf: never)
    running: tuple[tuple[WorkloadSpec, str], ...] = ()
    reason: str = ""


DEADLINE_CASES = [
    DeadlineCase(
        "feasible-on-a-free-node",
        job("w", gpu=8, estimated_duration="1h", deadline_in="3h"),
        DeadlineStatus.FEASIBLE,
        0.0,
        reason="slack 2h",
    ),
    DeadlineCase(
        "feasible-after-preempting-lower-priority-work",
        job("w", gpu=8, priority="urgent", estimated_duration="1h", deadline_in="3h"),
        DeadlineStatus.FEASIBLE,
        30.0,  # the grace period of the evicted batch job
        running=((job("batch", gpu=8, priority="batch", estimated_duration="10h"), "a100-0"),),
    ),
    DeadlineCase(
        "at-risk-with-thin-slack",
        job("w", gpu=8, estimated_duration="1h", deadline_in="63m"),
        DeadlineStatus.AT_RISK,
        0.0,
        reason="slack 3m",
    ),
    DeadlineCase(
        "at-risk-without-an-estimate",
        job("w", gpu=8, deadline_in="3h"),
        DeadlineStatus.AT_RISK,
        0.0,
        reason="no estimated_duration",
    ),
    DeadlineCase(
        "at-risk-when-the-blocker-declared-no-estimate",
        job("w", gpu=8, estimated_duration="1h", deadline_in="5h"),
        DeadlineStatus.AT_RISK,
        HOUR,  # the blocker is assumed to run the default hour
        running=((job("blocker", gpu=8), "a100-0"),),
        reason="assumed 3600s for 1 workloads without estimates",
    ),
    DeadlineCase(
        "infeasible-even-on-an-empty-cluster",
        job("w", gpu=8, estimated_duration="3h", deadline_in="2h"),
        DeadlineStatus.INFEASIBLE,
        0.0,
        reason="needs 3h but only 2h remain",
    ),
    DeadlineCase(
        "infeasible-behind-equal-priority-work",
        job("w", gpu=8, estimated_duration="1h", deadline_in="2h"),
        DeadlineStatus.INFEASIBLE,
        5 * HOUR,
        running=((job("blocker", gpu=8, estimated_duration="5h"), "a100-0"),),
        reason="misses by 4h",
    ),
    DeadlineCase(
        "infeasible-when-no-node-can-hold-it",
        job("w", gpu=16, estimated_duration="1h", deadline_in="3h"),
        DeadlineStatus.INFEASIBLE,
        float("inf"),
        reason="no node in the cluster can hold it",
    ),
    DeadlineCase(
        "no-deadline",
        job("w", gpu=8, estimated_duration="1h"),
        DeadlineStatus.NO_DEADLINE,
        0.0,
    ),
]


@pytest.mark.parametrize("case", DEADLINE_CASES, ids=[c.id for c in DEADLINE_CASES])
def test_deadline_admission(case: DeadlineCase) -> None:
    cp, _ = cluster(A100_0, start=1000.0)
    for spec, node in case.running:
        running_on(cp, spec, node)
    submit(cp, case.candidate)
    verdict = Scheduler().admission(cp, cp.get("w"))
    assert verdict.status is case.expected, verdict.reason
    assert verdict.earliest_start - cp.now() == case.earliest_start
    assert case.reason in verdict.reason
