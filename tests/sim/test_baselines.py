"""Baseline policies on tiny hand-checked traces, with exact completion times.

Every case is a one- or two-node cluster and a few jobs whose schedule was
worked out by hand (the comment on each case is that working). Eviction is
immediate (``eviction_delay_s=0``), start latency is 0, checkpoint cost and
restart cost are 0, so the only preemption loss is the work since the last
checkpoint (``checkpoint_interval``), which each case states.

A job's JCT is read from the control plane: time of its SUCCEEDED transition
minus its submit time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from mlwe.core.catalog import DEFAULT_CATALOG
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec
from mlwe.sim import baselines
from mlwe.sim.baselines import (
    ORACLE_POLICIES,
    POLICIES,
    POLICY_SEMANTICS,
    make_policy,
    power_of_two_level,
    tiresias,
)
from mlwe.sim.replay import ReplayConfig, ReplayResult, replay
from mlwe.sim.traces import Trace, TraceJob

A100 = "A100-80GB"


# ------------------------------------------------------------------ builders
def job(
    jid: str, submit: float, duration: float, gpus: int = 1, **spec: Any
) -> TraceJob:
    """A trace job: ``gpus`` whole GPUs, true run time ``duration``."""
    return TraceJob(
        jid, submit, duration, WorkloadSpec(id=jid, name=jid, resources={"gpu": gpus}, **spec), 0
    )


def trace(*jobs: TraceJob, gpus: int = 1, nodes: int = 1) -> Trace:
    cluster = ClusterSpec(
        nodes=tuple(NodeSpec(name=f"n{i}", gpu_model=A100, gpus=gpus) for i in range(nodes))
    )
    return Trace("hand", tuple(jobs), cluster, DEFAULT_CATALOG, 0, ())


def run(policy: str, tr: Trace) -> ReplayResult:
    result = replay(tr, ReplayConfig(policy=policy, eviction_delay_s=0.0))
    assert result.metrics["rejected_batches"] == 0
    assert result.cp.validate_state() == []
    return result


def jcts(result: ReplayResult) -> dict[str, float]:
    out = {}
    for w in result.cp.workloads.values():
        done = [tr.time for tr in w.history if tr.target is State.SUCCEEDED]
        assert len(done) == 1, f"{w.id} did not succeed exactly once: {w.state}"
        out[w.id] = done[0] - w.submit_time
    return out


@pytest.fixture
def tiresias_at(monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """Registers a Tiresias with given thresholds/knob under a test-only name."""

    def register(thresholds: tuple[float, ...], promote_knob: float = 0.0) -> str:
        name = f"tiresias{thresholds}-{promote_knob}"
        monkeypatch.setitem(
            POLICIES,
            name,
            functools.partial(tiresias, thresholds_gpu_s=thresholds, promote_knob=promote_knob),
        )
        return name

    return register


@dataclass(frozen=True)
class Case:
    name: str
    policy: str
    trace: Trace
    want: dict[str, float]
    preemptions: int = 0
    tiresias: tuple[tuple[float, ...], float] | None = None  # (thresholds, promote_knob)
    notes: list[str] = field(default_factory=list)


# 1 node x 4 GPUs: a holds 3 GPUs 0-100; b (2 GPUs) cannot fit until 100;
# c (1 GPU) fits at once but strict FIFO holds it behind b.
FIFO_3 = trace(job("a", 0, 100, 3), job("b", 1, 50, 2), job("c", 2, 10, 1), gpus=4)

# 1 GPU: a runs 0-100; b(50), c(10), d(30) wait.
SJF_4 = trace(job("a", 0, 100), job("b", 1, 50), job("c", 2, 10), job("d", 3, 30))

CASES = [
    # strict: b 100-150 (JCT 149) and c 100-110 (JCT 108) once a is done.
    Case("fifo strict blocks c behind b", "fifo", FIFO_3, {"a": 100, "b": 149, "c": 108}),
    # backfill: c starts at 2 on the free GPU (2-12, JCT 10); b still 100-150.
    Case("fifo backfill lets c pass b", "fifo-backfill", FIFO_3, {"a": 100, "b": 149, "c": 10}),
    # FIFO on SJF_4: b 100-150, c 150-160, d 160-190.
    Case("fifo on the sjf trace", "fifo", SJF_4, {"a": 100, "b": 149, "c": 158, "d": 187}),
    # SJF: at 100 shortest true duration first: c 100-110, d 110-140, b 140-190.
    Case("sjf shortest true duration first", "sjf", SJF_4,
         {"a": 100, "c": 108, "d": 137, "b": 189}),
    # 2 GPUs: a (1 GPU) 0-100; b (2 GPUs, shortest) cannot fit; c (1 GPU, 150 s)
    # fits and starts at 2 with no reservation for b (greedy): c 2-152; b 152-162.
    Case("sjf greedy backfill, no reservation", "sjf",
         trace(job("a", 0, 100), job("b", 1, 10, 2), job("c", 2, 150), gpus=2),
         {"a": 100, "c": 150, "b": 161}),
    # 1 GPU: at 100, a has 900 s left (level 10), b 10 s (level 4): b preempts a.
    # a checkpointed at 60 s of work (interval 60), so 40 s are lost: b 100-110,
    # a resumes at 110 with 940 s left and ends at 1050.
    Case("srtf: a short arrival preempts a long job", "srtf",
         trace(job("a", 0, 1000, checkpoint_interval=60), job("b", 100, 10)),
         {"a": 1050, "b": 10}, preemptions=1),
    # at 100 a has 900 s left and b 600 s: both level 10 ((512, 1024] s), so no
    # preemption (the discretisation): a 0-1000, b 1000-1600.
    Case("srtf: same power-of-two level, no preemption", "srtf",
         trace(job("a", 0, 1000), job("b", 100, 600)),
         {"a": 1000, "b": 1500}),
    # b (300 s, level 9) and c (280 s, level 9) never preempt a (<= 100 s left,
    # level <= 7); at 100 the queue is ordered by exact remaining time: c 100-380,
    # b 380-680.
    Case("srtf: queue by level, then exact remaining", "srtf",
         trace(job("a", 0, 100), job("b", 1, 300), job("c", 2, 280)),
         {"a": 100, "c": 378, "b": 679}),
    # Tiresias defaults (one threshold at 3250 GPU-s): b (queue 0) waits behind a
    # (queue 0, FIFO, no preemption) until a has 3250 GPU-s at t=3250 and is
    # demoted; b preempts it. a saved 3200 s (interval 100), so 50 s are lost:
    # b 3250-3750, a resumes with 800 s left, 3750-4550.
    Case("tiresias defaults: demotion at 3250 GPU-s", "tiresias",
         trace(job("a", 0, 4000, checkpoint_interval=100), job("b", 10, 500)),
         {"a": 4550, "b": 3740}, preemptions=1),
    # threshold 100 GPU-s, 1 GPU: a is demoted at t=100 (a wakeup: no other event
    # then) and b preempts it; no loss (interval 10): b 100-180 (80 GPU-s: stays in
    # queue 0), a resumes with 200 s left, 180-380.
    Case("tiresias: demotion wakes the scheduler", "tiresias", trace(
        job("a", 0, 300, checkpoint_interval=10), job("b", 50, 80)),
        {"a": 380, "b": 130}, preemptions=1, tiresias=((100.0,), 0.0)),
    # threshold 100: a demoted at 100, b (waiting since 10) preempts it and is
    # demoted at 200; c (queue 0) preempts b and ends at 250. a and b both in
    # queue 1, FIFO by arrival: a (150 s left) 250-400, then b (150 s left) 400-550.
    Case("tiresias: LAS demotion order, FIFO within a queue", "tiresias", trace(
        job("a", 0, 250, checkpoint_interval=10), job("b", 10, 250, checkpoint_interval=10),
        job("c", 20, 50)),
        {"a": 400, "b": 540, "c": 230}, preemptions=2, tiresias=((100.0,), 0.0)),
    # 2D: a holds 2 GPUs, so it attains 100 GPU-s at t=50, not 100. b (1 GPU)
    # preempts it at 50; a saved 50 s (interval 10). b 50-80; a needs both GPUs,
    # restarts at 80 with 250 s left, ends at 330.
    Case("tiresias: attained service is GPUs x time", "tiresias", trace(
        job("a", 0, 300, 2, checkpoint_interval=10), job("b", 10, 30), gpus=2),
        {"a": 330, "b": 70}, preemptions=1, tiresias=((100.0,), 0.0)),
    # no starvation promotion: a demoted at 100, b preempts it; b demoted at 200
    # but a is in queue 1 too: no preemption, b runs on to 600; a 600-790.
    Case("tiresias: without promotion", "tiresias", trace(
        job("a", 0, 290, checkpoint_interval=10), job("b", 50, 500, checkpoint_interval=10)),
        {"a": 790, "b": 550}, preemptions=1, tiresias=((100.0,), 0.0)),
    # promote_knob 0.5: a job that has run is promoted to queue 0 when it has
    # waited 0.5 x its executed time since its last promotion (waiting before it
    # runs again does not count), and its attained service restarts.
    # 100: a demoted, b preempts (a ran 100 s). 150: a promoted (waited 50), b is
    # in queue 0 too: no preemption. 200: b demoted, a preempts (a 190 s left).
    # 250: b promoted. 300: a demoted (100 GPU-s since promotion), b preempts;
    # a has 90 s left. 350: a promoted. 400: b demoted (300 s left), a preempts,
    # a ends at 490; b 490-790.
    Case("tiresias: starvation promotion (promote_knob)", "tiresias", trace(
        job("a", 0, 290, checkpoint_interval=10), job("b", 50, 500, checkpoint_interval=10)),
        {"a": 490, "b": 740}, preemptions=4, tiresias=((100.0,), 0.5)),
    # 1 GPU: at 100, c (deadline 500) before b (deadline 1000), then d and e (no
    # deadline) in arrival order: c 100-150, b 150-200, d 200-210, e 210-220.
    Case("edf: earliest deadline first, no-deadline jobs last in FIFO", "edf", trace(
        job("a", 0, 100), job("b", 1, 50, deadline=1000), job("c", 2, 50, deadline=500),
        job("d", 3, 10), job("e", 4, 10)),
        {"a": 100, "c": 148, "b": 199, "d": 207, "e": 216}),
    # 1 GPU each job except c (2): c (priority 500) cannot fit while a runs and
    # never preempts it. d (50) takes the free GPU at 2 (2-12); at 12 b (100) fits
    # (12-62) while c still waits; c 100-120.
    Case("priority: strict order, greedy backfill, no preemption", "priority", trace(
        job("a", 0, 100, priority=10), job("c", 1, 20, 2, priority=500),
        job("d", 2, 10, priority=50), job("b", 3, 50, priority=100), gpus=2),
        {"a": 100, "c": 119, "d": 10, "b": 59}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_exact_completion_times(case: Case, tiresias_at: Callable[..., str]) -> None:
    policy = case.policy if case.tiresias is None else tiresias_at(*case.tiresias)
    result = run(policy, case.trace)
    assert jcts(result) == pytest.approx(case.want, abs=1e-9)
    assert result.metrics["preemptions"] == case.preemptions


def test_srtf_preemption_loses_exactly_the_work_since_the_checkpoint() -> None:
    result = run("srtf", trace(job("a", 0, 1000, checkpoint_interval=60), job("b", 100, 10)))
    assert result.metrics["gpu_hours_lost_to_preemption"] == round(40 / 3600, 3)
    a = result.cp.workloads["a"]
    assert [t.target for t in a.history].count(State.PREEMPTED) == 1


def test_srtf_and_tiresias_priorities_stay_in_range() -> None:
    # a 2^22-second job (48 days) and an unknown duration still get priorities in range
    for policy in ("srtf", "tiresias"):
        result = run(policy, trace(job("huge", 0, 2.0**22 + 5), job("b", 1, 3), gpus=2))
        assert result.metrics["rejected_batches"] == 0
    sched = make_policy("srtf", {})  # a workload the oracle does not know: lowest level
    assert isinstance(sched, baselines.OracleSrtf)
    w = Workload(id="x", spec=WorkloadSpec(id="x", name="x"), seq=1, submit_time=0, deadline=None)
    assert sched.level(w, 0.0) == 999


# ------------------------------------------------------------ honest knowledge
class _Sealed(Mapping[str, float]):
    """A durations mapping that fails the test if anyone reads it."""

    def __getitem__(self, key: str) -> float:
        raise AssertionError(f"a non-oracle policy read the true duration of {key}")

    def get(self, key: str, default: Any = None) -> Any:
        raise AssertionError(f"a non-oracle policy read the true duration of {key}")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("a non-oracle policy iterated the true durations")

    def __len__(self) -> int:
        raise AssertionError("a non-oracle policy looked at the true durations")


@pytest.mark.parametrize("name", sorted(set(POLICIES) - ORACLE_POLICIES))
def test_non_oracle_policies_never_read_true_durations(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tr = trace(
        job("a", 0, 300, 2, checkpoint_interval=10), job("b", 10, 30, deadline=500),
        job("c", 20, 4000, priority=70), job("d", 30, 60), gpus=2,
    )
    want = jcts(run(name, tr))
    factory = POLICIES[name]
    monkeypatch.setitem(POLICIES, name, lambda durations: factory(_Sealed()))
    assert jcts(run(name, tr)) == want


def test_oracle_policies_say_so() -> None:
    assert "SJF (oracle durations)" in POLICY_SEMANTICS["sjf"]
    assert "oracle" in POLICY_SEMANTICS["srtf"].lower()
    for name in set(POLICIES) - ORACLE_POLICIES:
        assert "oracle" not in POLICY_SEMANTICS[name].lower(), name


def test_every_policy_states_its_semantics() -> None:
    assert set(POLICY_SEMANTICS) == set(POLICIES)
    for name, text in POLICY_SEMANTICS.items():
        assert len(text) > 60, name
    assert "preempt" in POLICY_SEMANTICS["tiresias"].lower()
    assert "3250" in POLICY_SEMANTICS["tiresias"]
    assert "power" in POLICY_SEMANTICS["srtf"].lower()
    assert "non-preemptive" in POLICY_SEMANTICS["edf"].lower()
    assert "without preemption" in POLICY_SEMANTICS["priority"].lower()


def test_mlwe_stays_the_default_policy() -> None:
    assert next(iter(POLICIES)) == "mlwe"
    assert ReplayConfig().policy == "mlwe"


def test_unknown_policy_and_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown policy 'lottery'"):
        make_policy("lottery", {})
    with pytest.raises(ValueError, match="strictly increasing"):
        make_policy("tiresias", {}, thresholds_gpu_s=(7200, 3250))
    with pytest.raises(ValueError, match="promote_knob"):
        make_policy("tiresias", {}, promote_knob=-1)
    t = make_policy("tiresias", {}, thresholds_gpu_s=(3250, 7200), promote_knob=8)
    assert isinstance(t, baselines.Tiresias)
    assert t.thresholds == (3250.0, 7200.0)


@pytest.mark.parametrize(
    ("seconds", "level"),
    [(0.0, 0), (0.5, 0), (1.0, 0), (1.5, 1), (2.0, 1), (3.0, 2), (4.0, 2), (5.0, 3),
     (1024.0, 10), (1025.0, 11), (2.0**40, 40)],
)
def test_power_of_two_levels(seconds: float, level: int) -> None:
    assert power_of_two_level(seconds) == level


def test_bounded_slowdown_reads_the_short_job_left_waiting() -> None:
    # one GPU, FIFO: a runs 0-100; b (5 s, submitted at 1) waits for it and ends at
    # 105: JCT 104 over the 10 s floor = 10.4; a's slowdown is 1; c (submitted at 200,
    # 3 s) runs at once: its JCT 3 is under the floor, so 1, not 0.3
    m = run("fifo", trace(job("a", 0, 100), job("b", 1, 5), job("c", 200, 3))).metrics
    assert m["max_bounded_slowdown"] == 10.4
    assert m["avg_bounded_slowdown"] == round((1 + 10.4 + 1) / 3, 3)
    # the 99th percentile between the two largest (1 and 10.4), interpolated
    assert m["p99_bounded_slowdown"] == round(1 + 9.4 * 0.98, 3)
