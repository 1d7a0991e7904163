"""Triggers: each fires on its condition, with evidence, and stays quiet otherwise;
schedules run them on telemetry, events, intervals and cron."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from mlwe.agent.model import Finding
from mlwe.agent.monitor import Monitor
from mlwe.agent.triggers import (
    Analyzer,
    Context,
    DeadlineAtRisk,
    GpusIdle,
    InferenceLoad,
    LossDiverging,
    LossNaN,
    LossPlateaued,
    LowUtilisation,
    NodeLost,
    NodeUnhealthy,
    ProgressStalled,
    QueueStarving,
    RepeatedFailures,
    Schedule,
    Trigger,
    default_triggers,
)
from mlwe.core import ControlPlane, Exited, ManualClock, NodeStatus, QueueSpec, SetNodeStatus
from mlwe.core.backend import Telemetry
from mlwe.core.scheduler import Scheduler
from tests.core.builders import (
    A100,
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

World = tuple[ControlPlane, ManualClock, Monitor]


def world(*nodes: object, queues: tuple[QueueSpec, ...] = ()) -> World:
    cp, clock = cluster(*(nodes or (gpu_node("g0"), gpu_node("g1"))), queues=queues)  # type: ignore[arg-type]
    return cp, clock, Monitor(cp).attach()


def samples(mon: Monitor, wid: str | None, node: str, metric: str, values: list[float],
            t0: float = 0.0, step: float = 300.0) -> None:
    mon.observe(Telemetry(t0 + i * step, node, wid, {metric: v}) for i, v in enumerate(values))


def check(trigger: Trigger, w: World) -> list[Finding]:
    cp, _, mon = w
    mon.refresh()
    return trigger.check(Context(cp, mon, Scheduler()))


# ------------------------------------------------------------------ builders
def loss_world(values: list[float]) -> World:
    w = world()
    cp, clock, mon = w
    running_on(cp, job("run", gpu=8, models=[A100], kind="training"), "g0")
    clock.advance(len(values) * 300)
    samples(mon, "run", "g0", "loss", values)
    return w


def failures_world(causes: list[tuple[int, str]], memory_peak: float | None = None) -> World:
    w = world(gpu_node("g0"), cpu_node("c0"))
    cp, clock, mon = w
    submit(cp, job("crashy", cpu=8, memory="32Gi", max_retries=5))
    from mlwe.core import Retry

    for code, cause in causes:
        ok(cp.apply([place_on(cp, "crashy", "c0")]))
        run_to_running(cp, ["crashy"])
        clock.advance(600)
        if memory_peak is not None:
            mon.observe([Telemetry(clock.now(), "c0", "crashy", {"memory_used_mib": memory_peak})])
        ok(cp.apply([Exited("crashy", cp.get("crashy").attempt, code, cause)]))
        ok(cp.apply([Retry("crashy")]))
    return w


def stalled_world(progress_moves: bool) -> World:
    w = world()
    cp, clock, mon = w
    running_on(cp, job("stuck", gpu=8, models=[A100]), "g0")
    for i in range(8):
        clock.advance(300)
        p = 0.1 + (0.05 * i if progress_moves else 0.0)
        mon.observe([Telemetry(clock.now(), "g0", "stuck", {"progress": p, "gpu_util": 0.8})])
        mon.refresh()
    return w


def node_world(ecc: list[float]) -> World:
    w = world()
    cp, clock, mon = w
    running_on(cp, job("tenant", gpu=4, models=[A100]), "g0")
    clock.advance(1800)
    samples(mon, None, "g0", "ecc_errors", ecc, t0=clock.now() - 300 * len(ecc))
    return w


def deadline_world(deadline: str) -> World:
    w = world()
    cp, _clock, _ = w
    running_on(cp, job("big-0", gpu=8, models=[A100], estimated_duration="6h"), "g0")
    running_on(cp, job("big-1", gpu=8, models=[A100], estimated_duration="6h"), "g1")
    submit(cp, job("sla", gpu=8, models=[A100], estimated_duration="1h", deadline_in=deadline))
    return w


def starving_world(wait_h: float) -> World:
    w = world()
    cp, clock, _ = w
    running_on(cp, job("hog-0", gpu=8, models=[A100], estimated_duration="20h"), "g0")
    running_on(cp, job("hog-1", gpu=8, models=[A100], estimated_duration="20h"), "g1")
    submit(cp, job("patient", gpu=8, models=[A100], priority="low"))
    clock.advance(wait_h * 3600)
    return w


def fragmented_world(fragmented: bool) -> World:
    w = world()
    cp, _clock, _ = w
    # 4 + 4 GPUs free on two nodes: an 8-GPU job cannot fit on either
    running_on(cp, job("half-0", gpu=4, models=[A100]), "g0")
    if fragmented:
        running_on(cp, job("half-1", gpu=4, models=[A100]), "g1")
    submit(cp, job("wide", gpu=8, models=[A100]))
    return w


def util_world(util: float) -> World:
    w = world()
    cp, clock, mon = w
    running_on(cp, job("idle", gpu=8, models=[A100]), "g0")
    clock.advance(3600)
    samples(mon, "idle", "g0", "gpu_util", [util] * 6, t0=clock.now() - 1500)
    return w


def service_world(util: float, replicas: int) -> World:
    w = world()
    cp, _clock, mon = w
    for i in range(replicas):
        running_on(cp, job(f"svc-{i}", gpu=1, models=[A100], kind="inference",
                           labels={"mlwe.service": "chat"}), "g0")
        samples(mon, f"svc-{i}", "g0", "gpu_util", [util] * 3)
    return w


def lost_world(losses: int, back: bool) -> World:
    w = world()
    cp, clock, mon = w
    for _ in range(losses):
        ok(cp.apply([SetNodeStatus("g1", NodeStatus.DOWN, "lost")]))
        mon.refresh()
        clock.advance(600)
        if back:
            ok(cp.apply([SetNodeStatus("g1", NodeStatus.READY, "back")]))
            mon.refresh()
    return w


CASES: list[tuple[str, Trigger, Callable[[], World], str | None, str | None]] = [
    # (id, trigger, world, expected finding trigger name or None, expected cause)
    ("loss-nan", LossNaN(), lambda: loss_world([2.0, 1.5, math.nan]), "loss-nan", "numerics"),
    ("loss-finite", LossNaN(), lambda: loss_world([2.0, 1.5, 1.2]), None, None),
    ("loss-diverging", LossDiverging(), lambda: loss_world([2.0, 1.5, 1.0, 0.8, 1.4, 1.9, 2.6]),
     "loss-diverging", "diverged"),
    ("loss-converging", LossDiverging(), lambda: loss_world([2.0, 1.5, 1.0, 0.8, 0.7, 0.65, 0.6]),
     None, None),
    ("loss-noisy-not-diverging", LossDiverging(),
     lambda: loss_world([2.0, 1.5, 1.0, 0.8, 1.3, 0.9, 1.25]), None, None),
    ("loss-plateaued", LossPlateaued(), lambda: loss_world([2.0, 1.0, 0.5] + [0.5] * 12),
     "loss-plateaued", "plateau"),
    ("loss-still-learning", LossPlateaued(),
     lambda: loss_world([2.0 * 0.9**i for i in range(15)]), None, None),
    ("failures-oom", RepeatedFailures(), lambda: failures_world([(137, "oom"), (137, "oom")]),
     "repeated-failures", "oom"),
    ("failures-oom-by-telemetry", RepeatedFailures(),
     lambda: failures_world([(1, "error"), (1, "error")], memory_peak=32 * 1024), "repeated-failures", "oom"),
    ("failures-code", RepeatedFailures(), lambda: failures_world([(2, "error"), (2, "error")]),
     "repeated-failures", "code"),
    ("failures-node", RepeatedFailures(),
     lambda: failures_world([(-1, "node-lost"), (-1, "node-lost")]), "repeated-failures", "node"),
    ("one-failure", RepeatedFailures(), lambda: failures_world([(137, "oom")]), None, None),
    ("stalled", ProgressStalled(), lambda: stalled_world(False), "progress-stalled", "hung"),
    ("progressing", ProgressStalled(), lambda: stalled_world(True), None, None),
    ("ecc-rising", NodeUnhealthy(), lambda: node_world([0, 0, 4, 8]), "node-unhealthy", "hardware"),
    ("ecc-flat", NodeUnhealthy(), lambda: node_world([3, 3, 3, 3]), None, None),
    ("deadline-infeasible", DeadlineAtRisk(), lambda: deadline_world("3h"), "deadline-at-risk", None),
    ("deadline-comfortable", DeadlineAtRisk(), lambda: deadline_world("12h"), None, None),
    ("starving", QueueStarving(), lambda: starving_world(3), "queue-starving", "starving"),
    ("waiting-briefly", QueueStarving(), lambda: starving_world(0.5), None, None),
    ("fragmented", GpusIdle(), lambda: fragmented_world(True), "gpus-fragmented", "fragmented"),
    ("fits", GpusIdle(), lambda: fragmented_world(False), None, None),
    ("low-util", LowUtilisation(), lambda: util_world(0.05), "utilisation-low", "over-allocated"),
    ("busy", LowUtilisation(), lambda: util_world(0.8), None, None),
    ("service-overloaded", InferenceLoad(), lambda: service_world(0.97, 1), "inference-overloaded",
     "overloaded"),
    ("service-idle", InferenceLoad(), lambda: service_world(0.02, 2), "inference-idle", "idle"),
    ("service-fine", InferenceLoad(), lambda: service_world(0.5, 2), None, None),
    ("node-down", NodeLost(), lambda: lost_world(1, back=False), "node-lost", "lost"),
    ("node-flapping", NodeLost(), lambda: lost_world(2, back=True), "node-flapping", "flapping"),
    ("node-back-once", NodeLost(), lambda: lost_world(1, back=True), None, None),
]


@pytest.mark.parametrize("trigger,build,expect,cause", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_trigger(trigger: Trigger, build: Callable[[], World], expect: str | None,
                 cause: str | None) -> None:
    found = check(trigger, build())
    if expect is None:
        assert found == [], [f.summary for f in found]
        return
    assert [f.trigger for f in found] == [expect], [f.summary for f in found]
    f = found[0]
    assert f.summary and f.evidence and 0 < f.severity <= 1
    if cause is not None:
        assert f.cause == cause, f.summary


def test_default_triggers_have_unique_names_and_schedules() -> None:
    trigs = default_triggers()
    assert len({t.name for t in trigs}) == len(trigs)
    assert all(t.schedule.describe() for t in trigs)


class Probe:
    def __init__(self, name: str, schedule: Schedule) -> None:
        self.name, self.schedule, self.calls = name, schedule, 0

    def check(self, ctx: Context) -> list[Finding]:
        self.calls += 1
        return []


def test_schedules_interval_cron_telemetry_events() -> None:
    cp, clock, mon = world()
    every = Probe("every", Schedule(every_s=600))
    cron = Probe("cron", Schedule(cron="0 * * * *"))  # on the hour, engine clock
    tel = Probe("tel", Schedule(on_telemetry=True))
    ev = Probe("ev", Schedule(on_events=True))
    an = Analyzer([every, cron, tel, ev], start=clock.now())
    ctx = Context(cp, mon, Scheduler())
    ran = []
    for minute in range(0, 181, 5):
        clock.set(minute * 60.0)
        news_t = 1 if minute == 30 else 0
        news_e = 1 if minute == 45 else 0
        ran.append((minute, an.run(ctx, news_t, news_e)[1]))
    runs = {name: [m for m, names in ran if name in names] for name in ("every", "cron", "tel", "ev")}
    assert runs["every"] == list(range(0, 181, 10))
    assert runs["cron"] == [60, 120, 180]
    assert runs["tel"] == [30] and runs["ev"] == [45]


@pytest.mark.parametrize("kw,expect", [
    ({}, "at least one"),
    ({"cron": "every tuesday"}, "invalid cron"),
    ({"every_s": 0}, "positive"),
])
def test_bad_schedules_are_refused(kw: dict[str, object], expect: str) -> None:
    with pytest.raises(ValueError, match=expect):
        Schedule(**kw)  # type: ignore[arg-type]


def test_duplicate_trigger_names_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate trigger names: x"):
        Analyzer([Probe("x", Schedule(every_s=1)), Probe("x", Schedule(every_s=2))], 0.0)
