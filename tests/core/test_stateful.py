"""Stateful property test: a real ControlPlane under random valid and hostile action sequences.

A hypothesis ``RuleBasedStateMachine`` drives one control plane (a small mixed
cluster: A100-80GB, T4 and CPU nodes; two queues sharing a cohort) through
valid moves (submit, scheduling cycles, backend facts, cancel, retry, clock,
cordon) and hostile ones (over-allocation, wrong hardware, illegal lifecycle
edges, priority and protection breaches, stale versions, malformed objects).

After every step: the full invariant sweep is clean, an independent recount of
every node's allocation fits its capacity, quotas hold, and every hostile batch
was rejected with reasons and left the state exactly as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from mlwe.core import (
    AddNode,
    ApplyResult,
    Cancel,
    ClusterSpec,
    ControlPlane,
    Exited,
    ManualClock,
    NodePool,
    NodeSpec,
    NodeStatus,
    Place,
    Preempt,
    PreemptReason,
    Progress,
    QueueSpec,
    Released,
    ReplicaAlloc,
    ReplicaQuota,
    Resources,
    Retry,
    Scheduler,
    SetNodeStatus,
    SetQueue,
    Start,
    Started,
    State,
    Submit,
    Workload,
    WorkloadKind,
    WorkloadSpec,
    build_control_plane,
)
from mlwe.core.model import shape_of

A100 = "A100-80GB"
T4 = "T4"
FULL = 1000  # milli-GPU of one device
UNLIMITED = 1 << 60

CLUSTER = ClusterSpec(
    pools=(
        NodePool(prefix="a100", count=2, gpu_model=A100, gpus=8, cpu=64, memory="512Gi"),
        NodePool(prefix="t4", count=2, gpu_model=T4, gpus=4, cpu=32, memory="128Gi"),
        NodePool(prefix="cpu", count=1, cpu=96, memory="1Ti"),
    ),
    queues=(
        QueueSpec(
            name="team-a",
            cohort="research",
            nominal=ReplicaQuota(gpu=4, cpu=64),
            borrowing_limit=ReplicaQuota(gpu=2, cpu=32),
        ),
        QueueSpec(
            name="team-b",
            cohort="research",
            nominal=ReplicaQuota(gpu=8, cpu=64),
            borrowing_limit=ReplicaQuota(gpu=8),
        ),
    ),
)
QUEUE_NAMES = ("default", "team-a", "team-b")
#: Per queue: the most it may ever hold, (gpu milli, cpu milli) = nominal + borrowing limit.
QUEUE_CEILING = {"team-a": (6_000, 96_000), "team-b": (16_000, UNLIMITED)}

#: (kind, batch, ids of the workloads it involves)
Hostile = tuple[str, list[Any], frozenset[str]]

HOLDING = (State.ADMITTED, State.STARTING, State.RUNNING, State.PREEMPTING, State.STOPPING)
QUEUED = (State.PENDING, State.PREEMPTED)
VICTIM_STATES = (State.ADMITTED, State.STARTING, State.RUNNING)

#: Seed workloads started in every run (a protected one, preemption targets of each kind).
SEED_RUNNING = ("prot", "low", "fragile", "steady", "t4-low", "young", "cpu-batch")

#: Hostile action kinds sent across every machine run (read by the coverage test).
HOSTILE_SENT: Counter[str] = Counter()

#: Hostile kinds the deterministic run must exercise (each one at least once).
EXPECTED_HOSTILE = frozenset(
    {
        "add-node-in-batch",
        "cancel-finished",
        "double-place",
        "exited-bad-code",
        "exited-not-holding",
        "malformed",
        "mixed-batch",
        "place-cordoned",
        "place-cpu-node",
        "place-dup-devices",
        "place-full-device",
        "place-gang-size",
        "place-low-vram",
        "place-negative",
        "place-not-queued",
        "place-over-quota",
        "place-oversize",
        "place-short-changed",
        "place-split-gpu",
        "place-too-big",
        "place-unknown-node",
        "place-waiting-victims",
        "place-wrong-model",
        "preempt-bad-reason",
        "preempt-frees-nothing",
        "preempt-not-higher",
        "preempt-not-queued",
        "preempt-not-running",
        "preempt-protected",
        "preempt-reclaim-invalid",
        "preempt-self",
        "preempt-under-minimum",
        "progress-not-running",
        "progress-out-of-range",
        "released-bad-checkpoint",
        "released-not-stopping",
        "retry-exhausted",
        "retry-not-failed",
        "stale-version",
        "start-not-admitted",
        "start-wrong-attempt",
        "started-not-starting",
        "submit-duplicate-id",
        "unknown-id",
    }
)


# ==================================================================== builders
def make_spec(wid: str | None, **over: Any) -> WorkloadSpec:
    """A valid spec; ``gpu`` and ``cpu`` in milli, ``memory`` in MiB."""
    gpu = over.pop("gpu", 0)
    cpu = over.pop("cpu", 1000)
    memory = over.pop("memory", 4096)
    fields: dict[str, Any] = {
        "id": wid,
        "name": f"job {wid or 'anonymous'}",
        "resources": {"gpu": gpu / 1000, "cpu": f"{cpu}m", "memory": memory},
    }
    fields.update(over)
    spec = WorkloadSpec(**fields)
    assert (spec.resources.gpu, spec.resources.cpu, spec.resources.memory) == (gpu, cpu, memory)
    return spec


@st.composite
def spec_fields(draw: st.DrawFn) -> dict[str, Any]:
    gpu = draw(st.sampled_from([0, 0, 250, 500, 1000, 1000, 2000, 4000, 8000]))
    fields: dict[str, Any] = {
        "gpu": gpu,
        "cpu": draw(st.sampled_from([500, 1000, 4000, 8000, 16000])),
        "memory": draw(st.sampled_from([512, 4096, 16384, 65536])),
        "kind": draw(st.sampled_from(list(WorkloadKind))),
        "queue": draw(st.sampled_from(QUEUE_NAMES)),
        "priority": draw(st.sampled_from([0, 10, 20, 50, 100, 500])),
        "replicas": draw(st.integers(1, 3 if gpu <= 2000 else 2)),
        "protected": draw(st.sampled_from([False, False, False, True])),
        "min_runtime": draw(st.sampled_from([0.0, 0.0, 600.0])),
        "min_progress": draw(st.sampled_from([0.0, 0.0, 0.5])),
        "max_retries": draw(st.integers(0, 2)),
        "estimated_duration": draw(st.sampled_from([None, 600.0, 3600.0])),
        "checkpoint_interval": draw(st.sampled_from([None, 300.0])),
        "deadline_in": draw(st.sampled_from([None, 7200.0])),
    }
    if gpu:
        models = draw(st.sampled_from([(), (A100,), (T4,), (A100, T4)]))
        fields["gpu_models"] = models
        if models != (T4,):
            fields["min_vram_per_gpu"] = draw(st.sampled_from([0, 0, 40960]))
    return fields


def exact_alloc(
    cp: ControlPlane,
    w: Workload,
    node: str,
    devices: tuple[int, ...],
    per_device: int | None = None,
) -> ReplicaAlloc:
    """The allocation record one replica of ``w`` would get on ``node`` with ``devices``."""
    want = w.spec.resources
    if not want.gpu:
        return ReplicaAlloc(node, devices, 0, Resources(0, 0, want.cpu, want.memory))
    vpg = cp.capacity.info(node).vram_per_gpu
    whole = want.gpu >= FULL
    if want.vram is not None:
        vram = want.vram
    else:
        vram = (want.gpu // FULL) * vpg if whole else want.gpu * vpg // FULL
    per = per_device if per_device is not None else (FULL if whole else want.gpu)
    return ReplicaAlloc(node, devices, per, Resources(want.gpu, vram, want.cpu, want.memory))


def accepted_models(cp: ControlPlane, w: Workload) -> tuple[str, ...]:
    spec = w.spec
    names = spec.gpu_models or tuple(cp.capacity.models())
    return tuple(m for m in names if cp.catalog[m].vram_mib >= spec.min_vram_per_gpu)


def accepts_node(cp: ControlPlane, w: Workload, node: str) -> bool:
    model = cp.capacity.info(node).gpu_model
    return model is not None and model in accepted_models(cp, w)


def fork_allocs(cp: ControlPlane, w: Workload) -> tuple[ReplicaAlloc, ...] | None:
    """A capacity-valid gang placement found on a copy of the index (None: no room)."""
    fork = cp.capacity.fork()
    shape = shape_of(w.spec, accepted_models(cp, w))
    out = []
    for _ in range(w.spec.replicas):
        a = fork.find(shape)
        if a is None:
            return None
        fork.allocate(a)
        out.append(a)
    return tuple(out)


def digest(cp: ControlPlane) -> tuple[Any, ...]:
    """Everything a rejected batch must leave exactly as it was."""
    workloads = tuple(
        tuple(
            len(w.history) if f.name == "history" else getattr(w, f.name)
            for f in dataclasses.fields(Workload)
        )
        for _, w in sorted(cp.workloads.items())
    )
    nodes = tuple(
        (
            n,
            cp.capacity.free(n),
            cp.capacity.free_devices(n),
            cp.capacity.status(n),
            tuple(sorted(cp.on_node.get(n, ()))),
        )
        for n in cp.capacity.node_names()
    )
    queues = tuple(
        (name, tuple(q.usage), q.spec, q.nominal, q.borrow_limit)
        for name, q in sorted(cp.queues.items())
    )
    return workloads, nodes, queues, tuple(sorted(cp.queued)), tuple(sorted(cp.on_node))


def check_result_shape(result: ApplyResult) -> None:
    """Every rejection is a value with at least one non-empty reason."""
    if result.accepted:
        assert result.rejections == ()
        return
    assert result.rejections, "a rejected batch must say why"
    for rej in result.rejections:
        assert rej.reasons, f"rejection without reasons: {rej!r}"
        for reason in rej.reasons:
            assert isinstance(reason, str) and reason.strip(), f"empty reason in {rej!r}"


def freed(cp: ControlPlane, w: Workload) -> dict[str, Resources]:
    out: dict[str, Resources] = {}
    for a in w.placement:
        out[a.node] = out.get(a.node, Resources()) + a.res
    return out


# ============================================================== state machine
class ControlPlaneMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(0)
        self.cp = build_control_plane(CLUSTER, self.clock)
        self.scheduler = Scheduler()
        self.ids = 0
        self.events = 0
        self.extra_nodes = 0
        self.sent: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.accepted_invalid: list[str] = []
        self.last_version = self.cp.version
        self.terminal: dict[str, int] = {}  # SUCCEEDED / CANCELLED id -> history length

    # ------------------------------------------------------------- helpers
    def new_id(self) -> str:
        self.ids += 1
        return f"j{self.ids}"

    def ids_in(self, *states: State) -> list[str]:
        return [wid for wid, w in sorted(self.cp.workloads.items()) if w.state in states]

    def apply(self, batch: list[Any], **kw: Any) -> ApplyResult:
        result = self.cp.apply(batch, **kw)
        check_result_shape(result)
        return result

    def apply_ok(self, batch: list[Any], *, changes: bool = True, **kw: Any) -> ApplyResult:
        """Apply a valid batch: accepted, and the version moves iff the state changes."""
        before = self.cp.version
        result = self.apply(batch, **kw)
        assert result.accepted, f"valid batch {batch!r} rejected: {result.reasons()}"
        assert result.ignored == ()
        assert self.cp.version == result.version == before + (1 if changes else 0)
        return result

    def expect_rejected(
        self,
        label: str,
        batch: list[Any],
        indices: set[int] | None = None,
        expected_version: int | None = None,
        also: str | None = None,
    ) -> None:
        """Send a known-invalid batch: it must be rejected and change nothing.

        ``also``: the kind of the invalid action inside a mixed batch, counted too.
        """
        cp = self.cp
        version, before, decisions = cp.version, digest(cp), len(cp.decisions)
        self.sent[label] += 1
        HOSTILE_SENT[label] += 1
        if also is not None:
            HOSTILE_SENT[also] += 1
        result = self.apply(batch, expected_version=expected_version)
        if result.accepted:
            self.accepted_invalid.append(f"{label}: {batch!r}")
            return
        self.rejected[label] += 1
        got = {r.index for r in result.rejections}
        want = indices if indices is not None else {0}
        assert got == want, f"{label}: rejected indices {got}, expected {want}: {result.reasons()}"
        assert result.version == version == cp.version
        assert digest(cp) == before, f"{label}: a rejected batch changed the state"
        # every rejection is audited, and nothing else is recorded
        new = cp.decisions[decisions:]
        assert [d.kind for d in new] == ["reject"] * len(result.rejections)

    def expect_ignored(self, batch: list[Any]) -> None:
        """A stale or duplicate backend fact: acknowledged, no effect on state or version."""
        version, before = self.cp.version, digest(self.cp)
        result = self.apply(batch)
        assert result.accepted, result.reasons()
        assert len(result.ignored) == len(batch), result
        assert result.version == self.cp.version == version
        assert digest(self.cp) == before

    # ----------------------------------------------------------- scenario seed
    @initialize()
    def seed(self) -> None:
        """Hostile cases that break exactly one rule need particular states; build them.

        A protected job, a preemption in flight while its preemptor would fit
        elsewhere, an exhausted failure, a quota hog, running jobs that are each
        a wrong victim for one reason, and queued jobs pickier than the T4s.
        """
        cp = self.cp
        self.apply_ok([SetNodeStatus("a100-1", NodeStatus.CORDONED)])
        self.apply_ok(
            [
                Submit(
                    make_spec("prot", gpu=4000, gpu_models=(A100,), priority=20, protected=True)
                ),
                Submit(
                    make_spec(
                        "low", gpu=4000, gpu_models=(A100,), priority=10,
                        checkpoint_interval=300.0, estimated_duration=3600.0,
                    )
                ),
                Submit(make_spec("fragile", cpu=4000, max_retries=0)),
                Submit(make_spec("steady", gpu=1000, gpu_models=(T4,), priority=100)),
                Submit(make_spec("t4-low", gpu=1000, gpu_models=(T4,), priority=0)),
                Submit(make_spec("young", gpu=1000, gpu_models=(T4,), priority=0, min_progress=0.5)),
                Submit(make_spec("cpu-batch", cpu=2000, priority=0)),
            ]
        )
        assert self.scheduler.run_cycle(cp).accepted
        assert {a.node for wid in ("prot", "low") for a in cp.get(wid).placement} == {"a100-0"}
        for wid in SEED_RUNNING:
            assert cp.get(wid).state is State.ADMITTED
            self.apply_ok([Start(wid, 1)])
            self.apply_ok([Started(wid, 1)])
        self.apply_ok([Exited("fragile", 1, 1, "error")])
        assert cp.get("fragile").state is State.FAILED
        self.clock.advance(600)
        self.apply_ok([Submit(make_spec("urgent", gpu=4000, gpu_models=(A100,), priority=500))])
        assert self.scheduler.run_cycle(cp).accepted
        # the protected job is never the victim; the low-priority one is
        assert cp.get("prot").state is State.RUNNING
        assert cp.get("low").state is State.PREEMPTING
        assert cp.get("low").preempted_by == "urgent"
        assert cp.get("urgent").victims == ("low",)
        assert [w.state for w in map(cp.get, SEED_RUNNING)] == [
            State.RUNNING, State.PREEMPTING, State.FAILED, *[State.RUNNING] * 4
        ]
        # urgent now fits on a100-1, but must still wait for its victim to release
        self.apply_ok([SetNodeStatus("a100-1", NodeStatus.READY)])
        # 4 x 32 cores would fit, but team-a may never hold more than 96 cores
        self.apply_ok([Submit(make_spec("greedy", cpu=32000, replicas=4, queue="team-a"))])
        assert self.scheduler.run_cycle(cp).accepted
        assert cp.get("greedy").state is State.PENDING
        assert cp.get("greedy").pending_reason == (
            "queue team-a: cpu would borrow 64000, above its borrowing limit 32000"
        )
        # placed, never started
        self.apply_ok([Submit(make_spec("idle", cpu=1000))])
        assert self.scheduler.run_cycle(cp).accepted
        assert cp.get("idle").state is State.ADMITTED
        self.apply_ok(
            [
                Submit(make_spec("a100-only", gpu=1000, gpu_models=(A100,), priority=0)),
                Submit(make_spec("big-vram", gpu=1000, min_vram_per_gpu=40960, priority=0)),
            ]
        )

    # ------------------------------------------------------------ invariants
    @invariant()
    def no_invalid_action_accepted(self) -> None:
        assert self.accepted_invalid == [], f"invalid actions accepted: {self.accepted_invalid}"
        assert self.sent == self.rejected

    @invariant()
    def full_sweep_is_clean(self) -> None:
        assert self.cp.validate_state() == []

    @invariant()
    def version_never_goes_back(self) -> None:
        assert self.cp.version >= self.last_version
        self.last_version = self.cp.version

    @invariant()
    def allocation_within_capacity(self) -> None:
        """An independent recount: per node and resource, allocated <= capacity."""
        cp = self.cp
        used = {n: [0, 0, 0, 0] for n in cp.capacity.node_names()}
        dev = {i.name: [0] * i.gpu_count for i in cp.capacity.nodes()}
        for w in cp.workloads.values():
            for a in w.placement:
                for k, v in enumerate(a.res.as_tuple()):
                    used[a.node][k] += v
                for d in a.devices:
                    dev[a.node][d] += a.gpu_per_device
        for info in cp.capacity.nodes():
            cap = info.capacity.as_tuple()
            u = used[info.name]
            assert all(0 <= x <= c for x, c in zip(u, cap, strict=True)), (info.name, u, cap)
            free = cp.capacity.free(info.name).as_tuple()
            expect = tuple(c - x for c, x in zip(cap, u, strict=True))
            assert free == expect, (info.name, free, cap, u)
            assert all(0 <= x <= FULL for x in dev[info.name]), (info.name, dev[info.name])

    @invariant()
    def placements_match_requests(self) -> None:
        """What holds resources holds exactly what it asked for, on hardware it accepts."""
        cp = self.cp
        for w in cp.workloads.values():
            if w.state not in HOLDING:
                assert w.placement == ()
                continue
            want = w.spec.resources
            assert len(w.placement) == w.spec.replicas
            for a in w.placement:
                info = cp.capacity.info(a.node)
                assert (a.res.gpu, a.res.cpu, a.res.ram) == (want.gpu, want.cpu, want.memory)
                if not want.gpu:
                    assert a.devices == () and a.res.vram == 0
                    continue
                assert info.gpu_model in accepted_models(cp, w), (w.id, info.gpu_model)
                if want.gpu >= FULL:
                    assert a.gpu_per_device == FULL and len(a.devices) == want.gpu // FULL
                else:
                    assert a.gpu_per_device == want.gpu and len(a.devices) == 1
                assert len(set(a.devices)) == len(a.devices)

    @invariant()
    def quotas_hold(self) -> None:
        for name, (gpu_cap, cpu_cap) in QUEUE_CEILING.items():
            u = self.cp.queues[name].usage
            assert u[0] <= gpu_cap and u[2] <= cpu_cap, (name, u)

    @invariant()
    def preemption_rule_held(self) -> None:
        """Only a strictly higher priority preempts, and never a protected workload."""
        cp = self.cp
        for w in cp.workloads.values():
            for t in w.history:
                if t.target is not State.PREEMPTING:
                    continue
                assert not w.spec.protected, f"protected {w.id} was preempted"
                assert t.source in VICTIM_STATES
                assert t.reason.startswith("preempted by "), t.reason
                preemptor = t.reason.removeprefix("preempted by ").split(" ")[0]
                if t.reason.endswith(f"({PreemptReason.PRIORITY.value})"):
                    assert cp.get(preemptor).priority > w.priority, (w.id, preemptor)

    @invariant()
    def terminal_states_stay(self) -> None:
        for wid, n in self.terminal.items():
            assert len(self.cp.get(wid).history) == n
        for wid in self.ids_in(State.SUCCEEDED, State.CANCELLED):
            self.terminal[wid] = len(self.cp.get(wid).history)

    # =========================================================== valid moves
    @precondition(lambda self: len(self.cp.workloads) < 28)
    @rule(fields=spec_fields(), explicit_id=st.booleans())
    def submit(self, fields: dict[str, Any], explicit_id: bool) -> None:
        wid = self.new_id() if explicit_id else None
        spec = make_spec(wid, **fields)
        result = self.apply_ok([Submit(spec)])
        assert len(result.created) == 1
        created = result.created[0]
        if wid is not None:
            assert created == wid
        w = self.cp.get(created)
        assert w.state is State.PENDING and w.attempt == 0 and created in self.cp.queued
        if spec.deadline_in is not None:
            assert w.deadline == self.clock.now() + spec.deadline_in

    @rule()
    def schedule(self) -> None:
        cp = self.cp
        before = digest(cp)
        plan = self.scheduler.plan(cp)
        assert digest(cp) == before, "planning changed the state (it must decide on a copy)"
        placed = {a.workload for a in plan.actions if isinstance(a, Place)}
        victims = {a.victim for a in plan.actions if isinstance(a, Preempt)}
        states = {wid: w.state for wid, w in cp.workloads.items()}
        result = self.scheduler.run_cycle(cp)
        check_result_shape(result)
        assert result.accepted, f"the scheduler's own plan was rejected: {result.reasons()}"
        admitted = {
            wid for wid, w in cp.workloads.items()
            if w.state is State.ADMITTED and states[wid] is not State.ADMITTED
        }
        preempting = {
            wid for wid, w in cp.workloads.items()
            if w.state is State.PREEMPTING and states[wid] is not State.PREEMPTING
        }
        assert admitted == placed
        assert preempting == victims
        assert all(states[wid] in QUEUED for wid in placed)

    @precondition(lambda self: any(w.state is State.ADMITTED for w in self.cp.workloads.values()))
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        wid = data.draw(st.sampled_from(self.ids_in(State.ADMITTED)))
        w = self.cp.get(wid)
        self.apply_ok([Start(wid, w.attempt)])
        assert w.state is State.STARTING

    @precondition(lambda self: any(w.state is State.STARTING for w in self.cp.workloads.values()))
    @rule(data=st.data())
    def started(self, data: st.DataObject) -> None:
        wid = data.draw(st.sampled_from(self.ids_in(State.STARTING)))
        w = self.cp.get(wid)
        self.apply_ok([Started(wid, w.attempt)])
        assert w.state is State.RUNNING and w.started_at == self.clock.now()

    @precondition(
        lambda self: any(
            w.state in (State.RUNNING, State.PREEMPTING) for w in self.cp.workloads.values()
        )
    )
    @rule(data=st.data(), p=st.floats(0.0, 1.0), checkpointed=st.booleans())
    def progress(self, data: st.DataObject, p: float, checkpointed: bool) -> None:
        wid = data.draw(st.sampled_from(self.ids_in(State.RUNNING, State.PREEMPTING)))
        w = self.cp.get(wid)
        old = w.progress
        self.apply_ok([Progress(wid, w.attempt, p, checkpointed)])
        assert w.progress == (p if checkpointed else max(old, p))
        if checkpointed:
            assert w.last_checkpoint_at == self.clock.now()
            if w.spec.estimated_duration:
                assert w.work_done == p * w.spec.estimated_duration

    @precondition(lambda self: any(w.holding for w in self.cp.workloads.values()))
    @rule(
        data=st.data(),
        code=st.sampled_from([0, 0, 1, 137]),
        cause=st.sampled_from(["", "oom", "node-lost"]),
    )
    def exited(self, data: st.DataObject, code: int, cause: str) -> None:
        wid = data.draw(st.sampled_from(self.ids_in(*HOLDING)))
        cp = self.cp
        w = cp.get(wid)
        source, failures = w.state, w.failures
        frees = freed(cp, w)
        free_before = {n: cp.capacity.free(n) for n in frees}
        self.apply_ok([Exited(wid, w.attempt, code, cause)])
        if source is State.STOPPING:
            assert w.state is State.CANCELLED
        elif code == 0 and source in (State.STARTING, State.RUNNING, State.PREEMPTING):
            assert w.state is State.SUCCEEDED and w.progress == 1.0
        else:
            assert w.state is State.FAILED
            assert w.failure_cause == (cause or "error")
            assert w.failures == failures + (0 if cause == "node-lost" else 1)
        assert w.placement == () and w.exit_code == code and w.started_at is None
        for n, res in frees.items():
            assert cp.capacity.free(n) == free_before[n] + res

    @precondition(
        lambda self: any(
            w.state in (State.PREEMPTING, State.STOPPING) for w in self.cp.workloads.values()
        )
    )
    @rule(data=st.data(), ckpt=st.one_of(st.none(), st.floats(0.0, 1.0)))
    def released(self, data: st.DataObject, ckpt: float | None) -> None:
        wid = data.draw(st.sampled_from(self.ids_in(State.PREEMPTING, State.STOPPING)))
        cp = self.cp
        w = cp.get(wid)
        source, work = w.state, w.work_done
        frees = freed(cp, w)
        free_before = {n: cp.capacity.free(n) for n in frees}
        self.apply_ok([Released(wid, w.attempt, ckpt)])
        assert w.state is (State.PREEMPTED if source is State.PREEMPTING else State.CANCELLED)
        assert w.placement == () and w.started_at is None
        assert w.work_done >= work
        assert (wid in cp.queued) is (w.state is State.PREEMPTED)
        for n, res in frees.items():
            assert cp.capacity.free(n) == free_before[n] + res

    @precondition(
        lambda self: any(
            w.state not in (State.SUCCEEDED, State.CANCELLED, State.FAILED, State.STOPPING)
            for w in self.cp.workloads.values()
        )
    )
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = (
            State.PENDING, State.PREEMPTED, State.ADMITTED, State.STARTING, State.RUNNING,
            State.PREEMPTING,
        )
        wid = data.draw(st.sampled_from(self.ids_in(*live)))
        w = self.cp.get(wid)
        source = w.state
        self.apply_ok([Cancel(wid)])
        assert w.state is (State.CANCELLED if source in QUEUED else State.STOPPING)
        assert wid not in self.cp.queued

    @precondition(
        lambda self: any(
            w.state is State.FAILED and w.failures <= w.spec.max_retries
            for w in self.cp.workloads.values()
        )
    )
    @rule(data=st.data())
    def retry(self, data: st.DataObject) -> None:
        ok = [
            wid for wid in self.ids_in(State.FAILED)
            if self.cp.get(wid).failures <= self.cp.get(wid).spec.max_retries
        ]
        wid = data.draw(st.sampled_from(ok))
        w = self.cp.get(wid)
        attempt = w.attempt
        self.apply_ok([Retry(wid)])
        assert w.state is State.PENDING and wid in self.cp.queued and w.attempt == attempt

    @rule(seconds=st.sampled_from([0.0, 30.0, 300.0, 900.0, 3600.0]))
    def advance_clock(self, seconds: float) -> None:
        before = self.clock.now()
        self.clock.advance(seconds)
        assert self.clock.now() == before + seconds

    @rule(data=st.data(), status=st.sampled_from([NodeStatus.READY, NodeStatus.CORDONED]))
    def set_node_status(self, data: st.DataObject, status: NodeStatus) -> None:
        node = data.draw(st.sampled_from(self.cp.capacity.node_names()))
        changes = self.cp.node_status(node) is not status
        before = digest(self.cp)
        self.apply_ok([SetNodeStatus(node, status, "maintenance")], changes=changes)
        assert self.cp.node_status(node) is status
        if not changes:
            assert digest(self.cp) == before

    @rule(data=st.data(), status=st.sampled_from([NodeStatus.READY, NodeStatus.CORDONED]))
    def duplicate_event(self, data: st.DataObject, status: NodeStatus) -> None:
        """A redelivered event (same id) is acknowledged and has no effect."""
        node = data.draw(st.sampled_from(self.cp.capacity.node_names()))
        self.events += 1
        eid = f"ev-{self.events}"
        changes = self.cp.node_status(node) is not status
        self.apply_ok([SetNodeStatus(node, status)], changes=changes, event_id=eid)
        version, before = self.cp.version, digest(self.cp)
        again = self.apply([SetNodeStatus(node, NodeStatus.DOWN)], event_id=eid)
        assert again.accepted and again.duplicate and again.version == version
        assert self.cp.version == version and digest(self.cp) == before
        assert self.cp.node_status(node) is status

    @precondition(lambda self: self.extra_nodes < 2)
    @rule(gpus=st.sampled_from([0, 2]))
    def add_node(self, gpus: int) -> None:
        self.extra_nodes += 1
        name = f"extra-{self.extra_nodes}"
        spec = NodeSpec(name=name, gpu_model=T4 if gpus else None, gpus=gpus, cpu=16_000)
        self.apply_ok([AddNode(spec)])
        assert self.cp.capacity.free(name) == self.cp.capacity.info(name).capacity

    @precondition(lambda self: len(self.cp.workloads) > 0)
    @rule(data=st.data())
    def stale_or_duplicate_fact(self, data: st.DataObject) -> None:
        """Facts about another attempt, or repeated facts, are acknowledged and ignored."""
        wid = data.draw(st.sampled_from(sorted(self.cp.workloads)))
        w = self.cp.get(wid)
        options: list[Any] = [
            Started(wid, w.attempt + 1),
            Progress(wid, w.attempt - 1, 0.5),
            Released(wid, w.attempt + 3),
            Exited(wid, w.attempt + 1, 0),
        ]
        if w.state is State.RUNNING:
            options.append(Started(wid, w.attempt))
        if w.state in (State.PREEMPTED, State.CANCELLED):
            options.append(Released(wid, w.attempt))
        if w.state in (State.SUCCEEDED, State.FAILED, State.CANCELLED, State.PREEMPTED):
            options.append(Exited(wid, w.attempt, 1))
        self.expect_ignored([data.draw(st.sampled_from(options))])

    # ========================================================= hostile moves
    def hostile_options(self, data: st.DataObject) -> dict[str, list[Hostile]]:
        """Known-invalid batches for the current state, by kind."""
        cp = self.cp
        ids = sorted(cp.workloads)
        node = data.draw(st.sampled_from(cp.capacity.node_names()), label="node")
        bad = {
            "attempt": data.draw(st.sampled_from([1, -1, 7]), label="attempt offset"),
            "progress": data.draw(st.sampled_from([-0.1, 1.5, math.nan, math.inf, "half"])),
            "checkpoint": data.draw(st.sampled_from([-0.5, 1.5, math.nan, "x"])),
        }
        out: dict[str, list[Hostile]] = {}
        for wid in ids:
            for kind, batch, involved in self.subject_options(cp.get(wid), node, bad):
                out.setdefault(kind, []).append((kind, batch, involved))
        for vid in ids:
            for pid in ids:
                for kind, batch, involved in self.preempt_options(cp.get(vid), cp.get(pid)):
                    out.setdefault(kind, []).append((kind, batch, involved))
        w = cp.get(data.draw(st.sampled_from(ids), label="subject"))
        ghost = "no-such-workload"
        unknown: list[Any] = [
            Cancel(ghost), Retry(ghost), Start(ghost, 0), Started(ghost, 1),
            Progress(ghost, 1, 0.1), Released(ghost, 1), Exited(ghost, 1, 0),
            Preempt(ghost, w.id), Preempt(w.id, ghost), Place(ghost, ()),
            SetNodeStatus("ghost-node", NodeStatus.CORDONED),
        ]
        out["unknown-id"] = [("unknown-id", [a], frozenset()) for a in unknown]
        n = w.spec.replicas
        malformed: list[Any] = [
            Place(workload=None, replicas="x"),  # type: ignore[arg-type]
            Place(w.id, "x"),  # type: ignore[arg-type]
            Place(w.id, list(w.placement or [exact_alloc(cp, w, node, ())] * n)),  # type: ignore[arg-type]
            Place(w.id, (None,) * n),  # type: ignore[arg-type]
            Place(w.id, (ReplicaAlloc(None, None, None, None),) * n),  # type: ignore[arg-type]
            Place(w.id, (ReplicaAlloc(node, (), 0, "lots"),) * n),  # type: ignore[arg-type]
            Submit(None),  # type: ignore[arg-type]
            Submit({"name": "dict spec", "resources": {"cpu": 1}}),  # type: ignore[arg-type]
            Submit(w.spec.model_dump()),  # type: ignore[arg-type]
            Start(None, None),  # type: ignore[arg-type]
            Start(w.id, str(w.attempt)),  # type: ignore[arg-type]
            Cancel(42),  # type: ignore[arg-type]
            Retry(None),  # type: ignore[arg-type]
            SetNodeStatus(node, "exploded"),  # type: ignore[arg-type]
            SetNodeStatus(None, NodeStatus.READY),  # type: ignore[arg-type]
            AddNode({"name": "n"}),  # type: ignore[arg-type]
            AddNode(NodeSpec(name=node, cpu=1000)),
            SetQueue("team-a"),  # type: ignore[arg-type]
            Preempt(None, None),  # type: ignore[arg-type]
            "submit",
            42,
            None,
        ]
        out["malformed"] = [("malformed", [a], frozenset()) for a in malformed]
        return out

    def subject_options(
        self, w: Workload, node: str, bad: dict[str, Any]
    ) -> list[Hostile]:
        """Known-invalid batches about workload ``w``."""
        cp = self.cp
        out: list[Hostile] = []
        wid = w.id
        info = cp.capacity.info(node)
        want = w.spec.resources
        n = w.spec.replicas
        only = frozenset({wid})

        def add(kind: str, batch: list[Any], involved: frozenset[str] = only) -> None:
            out.append((kind, batch, involved))

        # ---------------------------------------------------------- placement
        if w.state in QUEUED:
            cap = info.capacity
            big = ReplicaAlloc(
                node,
                tuple(range(info.gpu_count + 1)),
                FULL,
                cap + Resources(FULL, 1, 1000, 1024),
            )
            add("place-oversize", [Place(wid, (big,) * n)])
            neg = ReplicaAlloc(node, (), 0, Resources(0, 0, -want.cpu or -1, -want.memory or -1))
            add("place-negative", [Place(wid, (neg,) * n)])
            add("place-gang-size", [Place(wid, (exact_alloc(cp, w, node, ()),) * (n + 1))])
            if n > 1:
                add("place-gang-size", [Place(wid, (exact_alloc(cp, w, node, ()),) * (n - 1))])
            ghost_alloc = ReplicaAlloc("ghost-0", (), 0, Resources())
            add("place-unknown-node", [Place(wid, (ghost_alloc,) * n)])
            live = [v for v in w.victims if cp.get(v).state is State.PREEMPTING]
            allocs = fork_allocs(cp, w)
            if live:
                anywhere = allocs or (exact_alloc(cp, w, node, ()),) * n
                add("place-waiting-victims", [Place(wid, anywhere)])
            if allocs is not None and w.queue in QUEUE_CEILING:
                gpu_cap, cpu_cap = QUEUE_CEILING[w.queue]
                usage = cp.queues[w.queue].usage
                if usage[0] + want.gpu * n > gpu_cap or usage[2] + want.cpu * n > cpu_cap:
                    add("place-over-quota", [Place(wid, allocs)])
            if allocs is not None:
                # a placement that fits but does not hold exactly what was asked
                for cheat in (Resources(0, 0, 1, 0), Resources(0, 0, 0, 1), Resources(0, 1, 0, 0)):
                    a0 = allocs[0]
                    if cheat.vram and not a0.res.vram:
                        continue
                    short = ReplicaAlloc(a0.node, a0.devices, a0.gpu_per_device, a0.res - cheat)
                    add("place-short-changed", [Place(wid, (short, *allocs[1:]))])
                if not want.gpu:
                    # right resources, room to spare, but a negative share of no device
                    a0 = allocs[0]
                    odd = ReplicaAlloc(a0.node, a0.devices, -FULL, a0.res)
                    add("place-negative", [Place(wid, (odd, *allocs[1:]))])
                # the second Place of the same workload in one batch is always illegal
                add("double-place", [Place(wid, allocs), Place(wid, allocs)])
                if cp.capacity.status(allocs[0].node) is NodeStatus.READY:
                    cordon = SetNodeStatus(allocs[0].node, NodeStatus.CORDONED)
                    add("place-cordoned", [cordon, Place(wid, allocs)])
            if want.gpu:
                for other in cp.capacity.node_names():
                    out += self.gpu_place_options(w, other)
        else:
            allocs = fork_allocs(cp, w) or w.placement or (exact_alloc(cp, w, node, ()),)
            add("place-not-queued", [Place(wid, allocs)])

        # ---------------------------------------------------------- lifecycle
        if w.state is State.ADMITTED:
            add("start-wrong-attempt", [Start(wid, w.attempt + bad["attempt"])])
        else:
            add("start-not-admitted", [Start(wid, w.attempt)])
            add("start-not-admitted", [Start(wid, w.attempt + bad["attempt"])])
        if w.state not in (State.STARTING, State.RUNNING):
            add("started-not-starting", [Started(wid, w.attempt)])
        if w.state not in (State.RUNNING, State.PREEMPTING):
            add("progress-not-running", [Progress(wid, w.attempt, 0.5)])
        add("progress-out-of-range", [Progress(wid, w.attempt, bad["progress"])])
        if w.state in (State.PENDING, State.ADMITTED, State.STARTING, State.RUNNING,
                       State.SUCCEEDED, State.FAILED):
            add("released-not-stopping", [Released(wid, w.attempt)])
        if w.state in (State.PREEMPTING, State.STOPPING):
            add("released-bad-checkpoint", [Released(wid, w.attempt, bad["checkpoint"])])
        if w.state is State.PENDING:
            add("exited-not-holding", [Exited(wid, w.attempt, 0)])
        if w.state in HOLDING:
            add("exited-bad-code", [Exited(wid, w.attempt, "boom")])  # type: ignore[arg-type]
        if w.state in (State.SUCCEEDED, State.CANCELLED, State.FAILED, State.STOPPING):
            add("cancel-finished", [Cancel(wid)])
        if w.state is not State.FAILED:
            add("retry-not-failed", [Retry(wid)])
        elif w.failures > w.spec.max_retries:
            add("retry-exhausted", [Retry(wid)])
        add("submit-duplicate-id", [Submit(make_spec(wid, cpu=1000))])

        return out

    def preempt_options(self, v: Workload, p: Workload) -> list[Hostile]:
        """Preemptions of ``v`` by ``p`` that must be rejected.

        Most cases break exactly one rule (judged here, independently of the
        control plane), so each rule is shown to be enforced on its own.
        """
        if v.id == p.id:
            return [("preempt-self", [Preempt(v.id, v.id)], frozenset({v.id}))]
        cp = self.cp
        now = self.clock.now()
        pair = frozenset({v.id, p.id})
        out: list[Hostile] = []

        def add(kind: str, reason: PreemptReason | str = PreemptReason.PRIORITY) -> None:
            out.append((kind, [Preempt(v.id, p.id, reason)], pair))  # type: ignore[arg-type]

        running = v.state in VICTIM_STATES
        waiting = p.state in QUEUED
        higher = p.priority > v.priority
        if p.spec.resources.gpu:
            models = accepted_models(cp, p)
            frees = any(
                a.res.gpu and cp.capacity.info(a.node).gpu_model in models for a in v.placement
            )
        else:
            frees = bool(v.placement)
        spec = v.spec
        young = v.started_at is not None and now - v.started_at < spec.min_runtime
        unripe = spec.min_progress > 0 and v.progress < spec.min_progress
        fair = frees and not spec.protected and not young and not unripe  # a fair target
        add("preempt-bad-reason", "because")
        if not running and waiting and higher:
            add("preempt-not-running")
        if running and not waiting and higher and fair:
            add("preempt-not-queued")
        if running and waiting and not higher and fair:
            add("preempt-not-higher")
        if running and waiting and higher and frees and spec.protected:
            add("preempt-protected")
            add("preempt-protected", PreemptReason.RECLAIM)
        if running and waiting and higher and frees and not spec.protected and (young or unripe):
            add("preempt-under-minimum")
        if running and waiting and higher and not frees and not spec.protected:
            add("preempt-frees-nothing")
        qp, qv = cp.queues[p.queue], cp.queues[v.queue]
        if running and waiting and fair and (qp.cohort is None or qp is qv or qp.cohort != qv.cohort):
            add("preempt-reclaim-invalid", PreemptReason.RECLAIM)
        return out

    def gpu_place_options(self, w: Workload, node: str) -> list[Hostile]:
        """Placements of queued GPU workload ``w`` on ``node`` that must be rejected."""
        cp = self.cp
        info = cp.capacity.info(node)
        want = w.spec.resources
        n = w.spec.replicas
        out: list[Hostile] = []

        def add(kind: str, alloc: ReplicaAlloc) -> None:
            out.append((kind, [Place(w.id, (alloc,) * n)], frozenset({w.id})))

        if info.gpu_model is None:
            add("place-cpu-node", exact_alloc(cp, w, node, ()))
            return out
        g = max(1, want.gpu // FULL)
        devs = tuple(range(min(g, info.gpu_count)))
        if not accepts_node(cp, w, node):
            # on free devices, so that the hardware is the only thing wrong
            free_devs = cp.capacity.free_devices(node)
            fits = [d for d, f in enumerate(free_devs) if f >= (FULL if g > 1 else want.gpu)]
            chosen = tuple(fits[:g]) if len(fits) >= g else devs
            listed = not w.spec.gpu_models or info.gpu_model in w.spec.gpu_models
            kind = "place-low-vram" if listed else "place-wrong-model"
            add(kind, exact_alloc(cp, w, node, chosen))
            return out
        live = [v for v in w.victims if cp.get(v).state is State.PREEMPTING]
        if live or cp.capacity.status(node) is not NodeStatus.READY:
            return out
        # from here on the allocation is right in every way but capacity
        if g > info.gpu_count:
            add("place-too-big", exact_alloc(cp, w, node, tuple(range(g))))
            return out
        free_devs = cp.capacity.free_devices(node)
        per = FULL if want.gpu >= FULL else want.gpu
        busy = [d for d, f in enumerate(free_devs) if f < per]
        if busy:
            others = [d for d in range(info.gpu_count) if d != busy[0]][: g - 1]
            add("place-full-device", exact_alloc(cp, w, node, (busy[0], *others)))
        dup = (devs[0],) * max(2, g)
        add("place-dup-devices", exact_alloc(cp, w, node, dup, per_device=want.gpu // len(dup)))
        if want.gpu >= FULL and 2 * g <= info.gpu_count:
            whole = [d for d, f in enumerate(free_devs) if f == FULL]
            split = tuple(whole[: 2 * g]) if len(whole) >= 2 * g else tuple(range(2 * g))
            add("place-split-gpu", exact_alloc(cp, w, node, split, per_device=FULL // 2))
        return out

    @precondition(lambda self: len(self.cp.workloads) > 0)
    @rule(data=st.data())
    def hostile(self, data: st.DataObject) -> None:
        """One batch of every hostile kind the current state allows, each on its own."""
        options = self.hostile_options(data)
        rng = data.draw(st.randoms(use_true_random=False), label="pick")  # one draw, not forty
        for kind in sorted(options):
            _, batch, _ = rng.choice(options[kind])
            if kind == "double-place":
                # the first Place may be valid (then only the second is rejected) or not
                cp = self.cp
                probe = copy.deepcopy(cp, {id(cp.catalog): cp.catalog, id(cp.decisions): []})
                first_ok = probe.apply(batch[:1]).accepted
                self.expect_rejected(kind, batch, {1} if first_ok else {0, 1})
            elif kind == "place-cordoned":
                self.expect_rejected(kind, batch, {1})
            else:
                self.expect_rejected(kind, batch)

    @precondition(lambda self: len(self.cp.workloads) > 0)
    @rule(data=st.data())
    def hostile_after_valid_prefix(self, data: st.DataObject) -> None:
        """[valid..., invalid]: the whole batch is rejected, the valid part rolled back."""
        cp = self.cp
        options = self.hostile_options(data)
        options.pop("double-place", None)  # its first Place may be valid: no fixed index
        kind = data.draw(st.sampled_from(sorted(options)), label="kind")
        _, bad, involved = data.draw(st.sampled_from(options[kind]), label="hostile")
        prefix: list[Any] = [Submit(make_spec(self.new_id(), cpu=500))]
        admitted = [x for x in self.ids_in(State.ADMITTED) if x not in involved]
        if admitted:
            x = data.draw(st.sampled_from(admitted), label="start")
            prefix.append(Start(x, cp.get(x).attempt))
        pending = [x for x in self.ids_in(State.PENDING) if x not in involved]
        if pending:
            prefix.append(Cancel(data.draw(st.sampled_from(pending), label="cancel")))
        ready = [x for x in cp.capacity.node_names() if cp.node_status(x) is NodeStatus.READY]
        if ready:
            prefix.append(SetNodeStatus(data.draw(st.sampled_from(ready)), NodeStatus.CORDONED))
        last = len(prefix) + len(bad) - 1  # the invalid action ends every hostile batch
        self.expect_rejected("mixed-batch", [*prefix, *bad], {last}, also=kind)

    @precondition(lambda self: len(self.cp.workloads) > 0)
    @rule(data=st.data())
    def add_node_with_other_actions(self, data: st.DataObject) -> None:
        """Node additions cannot be undone, so they never share a batch."""
        name = f"extra-batch-{self.events}"
        self.events += 1
        wid = data.draw(st.sampled_from(sorted(self.cp.workloads)))
        tail = data.draw(st.sampled_from([Cancel("no-such-workload"), Cancel(wid), Retry(wid)]))
        self.expect_rejected("add-node-in-batch", [AddNode(NodeSpec(name=name, cpu=8000)), tail])
        assert name not in self.cp.capacity

    @rule(offset=st.sampled_from([-1, 1, 5]), cordon=st.booleans())
    def stale_version(self, offset: int, cordon: bool) -> None:
        cp = self.cp
        stale = cp.version + offset
        batch: list[Any] = (
            [SetNodeStatus(cp.capacity.node_names()[0], NodeStatus.CORDONED)]
            if cordon
            else [Submit(make_spec(self.new_id()))]
        )
        self.expect_rejected("stale-version", batch, {-1}, expected_version=stale)


ControlPlaneMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestControlPlaneStateful = ControlPlaneMachine.TestCase


def test_every_hostile_kind_is_sent_and_rejected() -> None:
    """A fixed-seed run must exercise every hostile kind (else the test proves nothing)."""
    HOSTILE_SENT.clear()
    run_state_machine_as_test(
        ControlPlaneMachine,
        settings=settings(
            max_examples=50,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    missing = sorted(EXPECTED_HOSTILE - set(HOSTILE_SENT))
    assert missing == [], f"hostile kinds never exercised: {missing}"
    unexpected = sorted(set(HOSTILE_SENT) - EXPECTED_HOSTILE)
    assert unexpected == []
