"""The built-in demo: an urgent fine-tune arrives into a full heterogeneous cluster.

A scripted stand-in backend confirms starts at once, finishes each workload
after its (known to the script, not to the scheduler) duration, and lets a
preempted workload checkpoint within a 30 s grace period before confirming
the release. Everything goes through ``ControlPlane.apply``; the scheduler is
the real default policy. The output is the decision log with its reasons.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from mlwe.core import (
    ClusterSpec,
    ControlPlane,
    DecisionRecord,
    Exited,
    ManualClock,
    NodePool,
    NodeSpec,
    Released,
    Scheduler,
    Start,
    Started,
    State,
    Submit,
    WorkloadSpec,
    build_control_plane,
)

GRACE_S = 30.0

DEMO_CLUSTER = ClusterSpec(
    pools=(
        NodePool(prefix="a100", count=2, gpu_model="A100-80GB", gpus=8, cpu=96, memory="1Ti"),
        NodePool(prefix="h100", count=1, gpu_model="H100-80GB", gpus=8, cpu=96, memory="1Ti"),
        NodePool(prefix="t4", count=2, gpu_model="T4", gpus=4, cpu=32, memory="256Gi"),
    ),
    nodes=(NodeSpec(name="himem-0", cpu=128, memory="2Ti"),),
)


def _spec(**kw: object) -> WorkloadSpec:
    return WorkloadSpec.model_validate(kw)


@dataclass
class Demo:
    clock: ManualClock = field(default_factory=ManualClock)
    cp: ControlPlane = field(init=False)
    scheduler: Scheduler = field(default_factory=Scheduler)
    true_duration: dict[str, float] = field(default_factory=dict)
    events: list[tuple[float, int, str, Callable[[], None]]] = field(default_factory=list)
    _n: int = 0
    _signalled: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.cp = build_control_plane(DEMO_CLUSTER, self.clock)

    def at(self, t: float, label: str, fn: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, self._n, label, fn))

    def submit(self, spec: WorkloadSpec, true_duration: float) -> None:
        res = self.cp.apply([Submit(spec)], cause_id=f"submit:{spec.id}")
        assert res.accepted, res.reasons()
        self.true_duration[res.created[0]] = true_duration

    def cycle(self) -> None:
        self.scheduler.run_cycle(self.cp, cause_id=f"cycle@{self.clock.now():.0f}")
        now = self.clock.now()
        for w in list(self.cp.workloads.values()):
            if w.state is State.ADMITTED:
                self.cp.apply([Start(w.id, w.attempt)])
                self.cp.apply([Started(w.id, w.attempt)])
                left = self.true_duration[w.id] - w.work_done
                self.at(now + left, f"finish {w.id}", self._finisher(w.id, w.attempt))
            elif w.state is State.PREEMPTING and w.id not in self._signalled:
                # the backend sends SIGTERM now; the workload checkpoints within the grace
                self._signalled.add(w.id)
                self.at(now + GRACE_S, f"release {w.id}", self._releaser(w.id, w.attempt))

    def _finisher(self, wid: str, attempt: int) -> Callable[[], None]:
        def fn() -> None:
            self.cp.apply([Exited(wid, attempt, 0)], cause_id=f"backend:exit:{wid}")

        return fn

    def _releaser(self, wid: str, attempt: int) -> Callable[[], None]:
        def fn() -> None:
            w = self.cp.get(wid)
            # the victim checkpoints on SIGTERM: progress is saved up to now
            done = w.run_base_work + w.runtime(self.clock.now())
            est = w.spec.estimated_duration or self.true_duration[wid]
            self.cp.apply(
                [Released(wid, attempt, checkpointed_progress=min(1.0, done / est))],
                cause_id=f"backend:released:{wid}",
            )

        return fn

    def run(self, until: float) -> None:
        self.cycle()
        while self.events and self.events[0][0] <= until:
            t, _, _label, fn = heapq.heappop(self.events)
            self.clock.set(t)
            fn()
            while self.events and self.events[0][0] == t:
                heapq.heappop(self.events)[3]()
            self.cycle()


_H = 3600.0  # an hour, in seconds


def build_demo() -> Demo:
    d = Demo()
    _submit_backlog(d)
    d.at(1.25 * _H, "urgent fine-tune arrives", lambda: _urgent(d))
    return d


def _submit_backlog(d: Demo) -> None:
    """The cluster's work at the start: embedding shards, a gang, a protected service, ETL."""
    h = _H
    for i in range(4):
        d.submit(
            _spec(
                id=f"embed-{i}",
                name=f"nightly embedding shard {i}",
                kind="batch-embedding",
                queue="default",
                priority="batch",
                resources={"gpu": 4, "cpu": 16, "memory": "128Gi"},
                gpu_models=["A100-80GB", "H100-80GB"],
                estimated_duration="6h",
                checkpoint_interval="20m",
                restart_cost="2m",
            ),
            true_duration=5.5 * h,
        )
    d.submit(
        _spec(
            id="pretrain-gang",
            name="2-node pretraining",
            kind="training",
            priority="normal",
            replicas=2,
            resources={"gpu": 4, "cpu": 32, "memory": "256Gi"},
            gpu_models=["H100-80GB"],
            estimated_duration="8h",
            checkpoint_interval="30m",
            min_runtime="1h",
        ),
        true_duration=7 * h,
    )
    d.submit(
        _spec(
            id="serve-llm",
            name="chat inference",
            kind="inference",
            priority="high",
            resources={"gpu": 2, "cpu": 8, "memory": "64Gi"},
            gpu_models=["T4"],
            protected=True,
            estimated_duration="24h",
        ),
        true_duration=24 * h,
    )
    for i in range(2):
        d.submit(
            _spec(
                id=f"etl-{i}",
                name=f"tokenise corpus part {i}",
                kind="data-processing",
                priority="low",
                resources={"cpu": 48, "memory": "512Gi"},
                estimated_duration="3h",
            ),
            true_duration=2.5 * h,
        )


def _urgent(d: Demo) -> None:
    """The urgent fine-tune arrives; its deadline admission is recorded as a decision."""
    h = _H
    d.submit(
        _spec(
            id="ft-llama-urgent",
            name="urgent LLM fine-tune (customer demo)",
            kind="fine-tune",
            priority="urgent",
            resources={"gpu": 8, "cpu": 32, "memory": "512Gi"},
            gpu_models=["A100-80GB", "H100-80GB"],
            min_vram_per_gpu="80Gi",
            estimated_duration="2h",
            deadline_in="3h",
            checkpoint_interval="15m",
        ),
        true_duration=1.8 * h,
    )
    w = d.cp.get("ft-llama-urgent")
    verdict = d.scheduler.admission(d.cp, w)
    d.cp.record(
        DecisionRecord(
            kind="admit-deadline",
            workload=w.id,
            policy="deadline-admission",
            chosen=verdict.status.value,
            reasons=(verdict.reason,),
        )
    )


def run_demo(until_h: float = 12.0) -> Demo:
    d = build_demo()
    d.run(until_h * 3600.0)
    problems = d.cp.validate_state()
    if problems:
        raise AssertionError("; ".join(problems))
    return d
