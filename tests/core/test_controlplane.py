"""Verification by the control plane, as a table of rejected batches.

Every case starts from the same state (``base``), applies one batch that must
be refused, and checks three things: the result says no, the reason names the
problem, and nothing changed (version, workloads, free capacity, queues,
indexes), with the invariant sweep still clean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mlwe.core import (
    Action,
    AddNode,
    Cancel,
    ControlPlane,
    Exited,
    NodeStatus,
    Place,
    Preempt,
    PreemptReason,
    Progress,
    Released,
    ReplicaAlloc,
    Resources,
    Retry,
    SetNodeStatus,
    Start,
    Started,
    Submit,
)
from tests.core.builders import (
    A100,
    T4,
    allocs_on,
    cluster,
    cpu_node,
    gpu_node,
    job,
    ok,
    place_on,
    run_to_running,
    running_on,
    submit,
)

A100_VRAM = 81920
T4_VRAM = 16384
GIB = 1024


def base() -> ControlPlane:
    """a100-0: 'run' holds GPUs 0-3; t4-0: 'hi' and 'prot' hold GPUs 0 and 1; cpu-0: 'etl'."""
    cp, _ = cluster(
        gpu_node("a100-0"),
        gpu_node("t4-0", T4, 4, cpu=32, memory="128Gi"),
        cpu_node("cpu-0"),
        gpu_node("a100-cordoned", status=NodeStatus.CORDONED),
        gpu_node("a100-down", status=NodeStatus.DOWN),
    )
    running_on(cp, job("run", gpu=4, models=[A100], priority="low"), "a100-0")
    running_on(cp, job("hi", gpu=1, models=[T4], priority="high"), "t4-0")
    running_on(cp, job("prot", gpu=1, models=[T4], priority="batch", protected=True), "t4-0")
    running_on(cp, job("etl", cpu=16, priority="low"), "cpu-0")
    submit(
        cp,
        job("big", gpu=8, models=[A100]),
        job("small-a100", gpu=1, models=[A100]),
        job("vram-hungry", gpu=1, min_vram_per_gpu="40Gi"),
        job("gang", gpu=4, models=[A100], replicas=2),
        job("cpu-job", cpu=8),
        job("low-wait", gpu=1, priority="low"),
        job("urgent-any", gpu=1, priority="urgent"),
        job("urgent-a100", gpu=1, models=[A100], priority="urgent"),
        job("done", cpu=4),
        job("broken", cpu=4, max_retries=0),
    )
    for wid in ("done", "broken"):
        ok(cp.apply([place_on(cp, wid, "cpu-0")]))
        run_to_running(cp, [wid])
    ok(cp.apply([Exited("done", 1, 0), Exited("broken", 1, 1, "error")]))
    assert cp.validate_state() == []
    return cp


def snapshot(cp: ControlPlane, *, version: bool = True) -> tuple[Any, ...]:
    """Everything a rejected batch must leave as it was."""
    nodes = cp.capacity.node_names()
    return (
        cp.version if version else None,
        {
            wid: (
                w.state, w.attempt, w.placement, w.victims, w.failures, w.progress,
                w.work_done, w.started_at, w.preempted_by, len(w.history),
            )
            for wid, w in cp.workloads.items()
        },
        [(cp.capacity.free(n), cp.capacity.free_devices(n), cp.capacity.status(n)) for n in nodes],
        {name: list(q.usage) for name, q in cp.queues.items()},
        sorted(cp.queued),  # membership: order within the index is re-sorted by policy
        {n: list(ids) for n, ids in cp.on_node.items()},
    )


def alloc(node: str, devices: tuple[int, ...], gpu: int, vram: int, cpu: int, ram: int,
          per_device: int = 1000) -> ReplicaAlloc:
    return ReplicaAlloc(node, devices, per_device if devices else 0, Resources(gpu, vram, cpu, ram))


def one_a100(node: str = "a100-0", dev: int = 4, vram: int = A100_VRAM) -> ReplicaAlloc:
    """What 'small-a100' (1 GPU, 8 cpu, 64Gi) would hold on ``node``'s device ``dev``."""
    return alloc(node, (dev,), 1000, vram, 8000, 64 * GIB)


#: 'big' (8 GPUs, 8 cpu, 64Gi) on the whole of a100-0, and a 4-GPU 'gang' replica on its GPUs 4-7
ALL_OF_A100_0 = alloc("a100-0", tuple(range(8)), 8000, 8 * A100_VRAM, 8000, 64 * GIB)
UPPER_HALF_OF_A100_0 = alloc("a100-0", (4, 5, 6, 7), 4000, 4 * A100_VRAM, 8000, 64 * GIB)

Batch = Callable[[ControlPlane], list[Action]]

REJECTED: list[tuple[str, Batch, str]] = [
    # ------------------------------------------------------------- capacity
    ("over-allocation-of-a-node",
     lambda cp: [Place("big", (ALL_OF_A100_0,))],
     "node a100-0: gpu 8000 requested, 4000 free"),
    ("two-replicas-on-the-same-devices",
     lambda cp: [Place("gang", (UPPER_HALF_OF_A100_0, UPPER_HALF_OF_A100_0))],
     "replica 1: node a100-0: GPU 4 has 0 milli free, 1000 asked"),
    ("device-already-held-by-another-workload",
     lambda cp: [Place("small-a100", (one_a100(dev=0),))],
     "node a100-0: GPU 0 has 0 milli free"),
    ("no-such-device",
     lambda cp: [Place("small-a100", (one_a100(dev=9),))],
     "node a100-0: no GPU device 9"),
    # -------------------------------------------------------- compatibility
    ("wrong-gpu-model",
     lambda cp: [Place("small-a100", (one_a100("t4-0", 2, T4_VRAM),))],
     "T4 on t4-0 is not among accepted models A100-80GB"),
    ("vram-per-gpu-too-small",
     lambda cp: [Place("vram-hungry", (one_a100("t4-0", 2, T4_VRAM),))],
     "T4 has 16384 MiB VRAM per GPU, 40960 MiB required"),
    ("vram-allocated-short",
     lambda cp: [Place("small-a100", (one_a100(vram=1024),))],
     "VRAM 1024 MiB allocated, 81920 MiB expected"),
    ("cpu-node-for-gpu-job",
     lambda cp: [Place("small-a100", (one_a100("cpu-0", 0, 0),))],
     "node cpu-0 has no GPU"),
    ("gpu-given-to-cpu-only-job",
     lambda cp: [Place("cpu-job", (alloc("a100-0", (4,), 0, 0, 8000, 64 * GIB, per_device=0),))],
     "GPU devices or VRAM given to a CPU-only workload"),
    ("allocation-smaller-than-the-request",
     lambda cp: [Place("small-a100", (alloc("a100-0", (4,), 1000, A100_VRAM, 1000, 64 * GIB),))],
     "does not match the request (gpu=1000, cpu=8000, ram=65536)"),
    ("cordoned-node",
     lambda cp: [Place("small-a100", (one_a100("a100-cordoned", 0),))],
     "node a100-cordoned is cordoned"),
    ("down-node",
     lambda cp: [Place("small-a100", (one_a100("a100-down", 0),))],
     "node a100-down is down"),
    ("incomplete-gang",
     lambda cp: [Place("gang", allocs_on(cp, "gang", "a100-0")[:1])],
     "gang incomplete: 1 replica placements for 2 replicas"),
    ("replicas-not-a-tuple",
     lambda cp: [Place("small-a100", [one_a100()])],  # type: ignore[arg-type]
     "gang incomplete: ? replica placements for 1 replicas"),
    # --------------------------------------------------------- ids, sizes
    ("unknown-workload-place", lambda cp: [Place("nope", ())], "unknown workload 'nope'"),
    ("unknown-workload-start", lambda cp: [Start("nope", 1)], "unknown workload 'nope'"),
    ("unknown-workload-cancel", lambda cp: [Cancel("nope")], "unknown workload 'nope'"),
    ("unknown-workload-fact", lambda cp: [Released("nope", 1)], "unknown workload 'nope'"),
    ("unknown-preemptor", lambda cp: [Preempt("run", "nope")], "unknown workload 'nope'"),
    ("unknown-node-in-placement",
     lambda cp: [Place("small-a100", (one_a100("a100-9", 0),))],
     "unknown node 'a100-9'"),
    ("unknown-node-status-target",
     lambda cp: [SetNodeStatus("a100-9", NodeStatus.CORDONED)], "unknown node 'a100-9'"),
    ("unknown-queue", lambda cp: [Submit(job("x", queue="nowhere"))], "unknown queue 'nowhere'"),
    ("duplicate-workload-id", lambda cp: [Submit(job("big"))], "workload id 'big' already exists"),
    ("duplicate-node", lambda cp: [AddNode(gpu_node("a100-0"))], "node 'a100-0' already exists"),
    ("unvalidated-spec", lambda cp: [Submit({"name": "x"})],  # type: ignore[arg-type]
     "spec is not a validated WorkloadSpec"),
    ("negative-sizes",
     lambda cp: [Place("small-a100", (alloc("a100-0", (4,), -1000, 0, 8000, 64 * GIB),))],
     "negative quantities (gpu)"),
    ("progress-out-of-range", lambda cp: [Progress("run", 1, 1.5)], "progress 1.5 outside [0, 1]"),
    ("exit-code-not-an-integer", lambda cp: [Exited("run", 1, "zero")],  # type: ignore[arg-type]
     "exit code 'zero' is not an integer"),
    # ----------------------------------------------------------- preemption
    ("preempting-higher-priority",
     lambda cp: [Preempt("hi", "low-wait")],
     "priority rule: low-wait (priority 10) may not preempt hi (priority 100)"),
    ("preempting-equal-priority",
     lambda cp: [Preempt("run", "low-wait")],
     "only a strictly higher priority preempts"),
    ("preempting-a-protected-workload",
     lambda cp: [Preempt("prot", "urgent-any")], "victim prot is protected"),
    ("victim-on-gpus-the-preemptor-does-not-accept",
     lambda cp: [Preempt("hi", "urgent-a100")],
     "evicting hi frees nothing urgent-a100 can use"),
    ("cpu-only-victim-for-a-gpu-preemptor",
     lambda cp: [Preempt("etl", "urgent-a100")],
     "evicting etl frees nothing urgent-a100 can use"),
    ("preemptor-already-running",
     lambda cp: [Preempt("run", "hi")], "preemptor hi is running, not waiting for placement"),
    ("reclaim-outside-a-cohort",
     lambda cp: [Preempt("run", "urgent-a100", PreemptReason.RECLAIM)],
     "reclaim: run is not in another queue of urgent-a100's cohort"),
    ("self-preemption", lambda cp: [Preempt("run", "run")], "a workload cannot preempt itself"),
    ("gain-between-unequal-priorities",
     lambda cp: [Preempt("run", "urgent-any", PreemptReason.GAIN)],
     "are not equals; a higher priority preempts by rule 'priority'"),
    ("gain-before-the-minimum-quantum",
     lambda cp: [Preempt("run", "low-wait", PreemptReason.GAIN)],
     "of its minimum quantum 600s"),
    # ------------------------------------------------------------ lifecycle
    ("resume-succeeded-by-place",
     lambda cp: [Place("done", (alloc("cpu-0", (), 0, 0, 4000, 64 * GIB),))],
     "done is succeeded, only pending or preempted workloads are placed"),
    ("resume-succeeded-by-start",
     lambda cp: [Start("done", 1)], "done is succeeded; only admitted workloads are started"),
    ("cancel-succeeded", lambda cp: [Cancel("done")], "done is succeeded; it cannot be cancelled"),
    ("retry-beyond-max-retries",
     lambda cp: [Retry("broken")], "broken failed 1 times; max_retries is 0"),
    ("retry-a-running-workload",
     lambda cp: [Retry("run")], "run is running; only failed workloads are retried"),
    ("start-for-another-attempt",
     lambda cp: [Start("run", 7)], "start for attempt 7, but run is at attempt 1"),
    ("release-without-a-stop-request",
     lambda cp: [Released("run", 1)], "release is only confirmed after a stop request"),
    # ----------------------------------------------------------- batch-wide
    ("whole-batch-rolled-back-when-its-last-action-fails",
     lambda cp: [
         place_on(cp, "small-a100", "a100-0"),
         Cancel("cpu-job"),
         Progress("run", 1, 0.5),
         Place("big", (one_a100("cpu-0", 0, 0),)),
     ],
     "#3 place big"),
    ("later-action-sees-what-an-earlier-one-took",
     # each Place fits alone; together they ask for the same device
     lambda cp: [place_on(cp, "urgent-a100", "a100-0"), Place("small-a100", (one_a100(dev=4),))],
     "#1 place small-a100: replica 0: node a100-0: GPU 4 has 0 milli free"),
]


@pytest.mark.parametrize(("batch", "fragment"), [r[1:] for r in REJECTED],
                         ids=[r[0] for r in REJECTED])
def test_rejected_batch_changes_nothing(batch: Batch, fragment: str) -> None:
    cp = base()
    actions = batch(cp)
    before = snapshot(cp)
    decisions = len(cp.decisions)

    result = cp.apply(actions)

    assert not result.accepted
    assert (result.duplicate, result.ignored, result.created) == (False, (), ())
    assert result.version == cp.version
    reasons = result.reasons()
    assert any(fragment in r for r in reasons), reasons
    assert snapshot(cp) == before
    assert cp.validate_state() == []
    # the refusal is audited, one record per rejected action
    audit = cp.decisions[decisions:]
    assert [d.kind for d in audit] == ["reject"] * len(result.rejections)
    assert [d.reasons for d in audit] == [r.reasons for r in result.rejections]


ACCEPTED: list[tuple[str, Batch]] = [
    # the same base state takes valid versions of the batches above
    ("place-on-free-devices", lambda cp: [place_on(cp, "small-a100", "a100-0")]),
    ("cancel-and-release-running", lambda cp: [Cancel("run"), Released("run", 1)]),
    ("preempt-lower-priority", lambda cp: [Preempt("run", "urgent-a100")]),
    ("preempt-on-accepted-hardware", lambda cp: [Preempt("hi", "urgent-any")]),
    ("cordon-a-node", lambda cp: [SetNodeStatus("a100-0", NodeStatus.CORDONED)]),
    ("cancel-pending", lambda cp: [Cancel("big")]),
]


@pytest.mark.parametrize("batch", [r[1] for r in ACCEPTED], ids=[r[0] for r in ACCEPTED])
def test_valid_batch_is_accepted(batch: Batch) -> None:
    cp = base()
    version = cp.version
    ok(cp.apply(batch(cp)))
    assert cp.version == version + 1
    assert cp.validate_state() == []


# ------------------------------------------------- stale and repeated input
def test_stale_expected_version_is_rejected() -> None:
    cp = base()
    decided_on = cp.version
    ok(cp.apply([Cancel("cpu-job")]))  # someone else changed the state meanwhile
    before = snapshot(cp)
    result = cp.apply([place_on(cp, "small-a100", "a100-0")], expected_version=decided_on)
    assert not result.accepted
    assert result.reasons() == [
        f"#-1 batch -: stale version: decided on {decided_on}, state is at {decided_on + 1}"
    ]
    assert snapshot(cp) == before
    assert cp.validate_state() == []


def test_duplicate_event_id_is_acknowledged_without_effect() -> None:
    cp = base()
    ok(cp.apply([Cancel("cpu-job")], event_id="evt-1"))
    before = snapshot(cp)
    result = cp.apply([Cancel("big")], event_id="evt-1")
    assert (result.accepted, result.duplicate, result.version) == (True, True, before[0])
    assert snapshot(cp) == before
    assert cp.get("big").state == "pending"
    assert cp.seen_event("evt-1") and not cp.seen_event("evt-2")
    assert cp.validate_state() == []


def test_rejected_batch_does_not_consume_its_event_id() -> None:
    cp = base()
    assert not cp.apply([Retry("broken")], event_id="evt-1").accepted
    assert not cp.seen_event("evt-1")
    result = ok(cp.apply([Cancel("big")], event_id="evt-1"))  # a corrected redelivery
    assert not result.duplicate
    assert cp.get("big").state == "cancelled"


def _second_attempt(cp: ControlPlane) -> None:
    """'again' fails on its first attempt, is retried, and runs as attempt 2."""
    submit(cp, job("again", gpu=1, models=[A100], estimated_duration="1h"))
    ok(cp.apply([place_on(cp, "again", "a100-0")]))
    run_to_running(cp, ["again"])
    ok(cp.apply([Exited("again", 1, 1, "oom")]))
    ok(cp.apply([Retry("again")]))
    ok(cp.apply([place_on(cp, "again", "a100-0")]))
    run_to_running(cp, ["again"])
    assert (cp.get("again").state, cp.get("again").attempt) == ("running", 2)


STALE_FACTS = [
    ("started", Started("again", 1)),
    ("progress", Progress("again", 1, 0.9, checkpointed=True)),
    ("released", Released("again", 1, 0.5)),
    ("exited-ok", Exited("again", 1, 0)),
    ("exited-failed", Exited("again", 1, 137, "oom")),
]


@pytest.mark.parametrize("fact", [f for _, f in STALE_FACTS], ids=[n for n, _ in STALE_FACTS])
def test_fact_about_an_earlier_attempt_is_ignored(fact: Action) -> None:
    cp = base()
    _second_attempt(cp)
    before = snapshot(cp, version=False)
    result = cp.apply([fact])
    assert result.accepted
    assert result.rejections == ()
    assert result.ignored == (f"{fact.kind} again: stale attempt 1 (current 2)",)
    assert snapshot(cp, version=False) == before
    assert cp.get("again").state == "running"
    assert cp.validate_state() == []


def test_repeated_started_is_ignored() -> None:
    cp = base()
    before = snapshot(cp, version=False)
    result = ok(cp.apply([Started("run", 1)]))
    assert result.ignored == ("started run: already running",)
    assert snapshot(cp, version=False) == before


def test_failure_on_a_lost_node_does_not_count_against_retries() -> None:
    cp = base()
    ok(cp.apply([Exited("run", 1, 137, "node-lost")]))
    assert (cp.get("run").state, cp.get("run").failures) == ("failed", 0)
    ok(cp.apply([Retry("run")]))
    assert cp.get("run").state == "pending"


def test_preempted_resources_free_only_on_release() -> None:
    cp = base()
    ok(cp.apply([Preempt("run", "big")]))
    assert cp.capacity.whole_free_gpus("a100-0") == 4
    result = cp.apply([Place("big", (ALL_OF_A100_0,))])
    assert not result.accepted
    assert any("big waits for its victims to release: run" in r for r in result.reasons())
    ok(cp.apply([Released("run", 1)]))
    ok(cp.apply([place_on(cp, "big", "a100-0")]))
    assert cp.get("big").state == "admitted"
    assert cp.validate_state() == []
