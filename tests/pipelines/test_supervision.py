"""Supervision agents: triggers, rules, verified actuators, records; the drift detector."""

from __future__ import annotations

from calendar import timegm
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlwe.pipelines.drift import KSDriftDetector
from mlwe.pipelines.runner import PipelineEvent
from mlwe.pipelines.spec import Pipeline
from mlwe.pipelines.supervision import (
    ActuationResult,
    Cron,
    Decision,
    Interval,
    Observation,
    OnEvent,
    Supervisor,
    engine_sinks,
)
from mlwe.store.pipelines import ModelRegistry
from tests.pipelines.conftest import SimRig


# ================================================================= triggers
def test_interval_fires_at_once_then_every_period() -> None:
    t = Interval(5.0)
    assert t.due(100.0)
    t.fired(100.0)
    assert not t.due(104.9) and t.due(105.0)
    with pytest.raises(ValueError, match="an interval must be positive"):
        Interval(0)


def test_cron_fires_on_its_schedule_in_utc() -> None:
    t0 = float(timegm((2026, 1, 1, 12, 1, 0)))  # 12:01:00 UTC
    every5 = Cron("*/5 * * * *")
    assert not every5.due(t0)  # next is 12:05
    assert not every5.due(t0 + 239) and every5.due(t0 + 240)
    every5.fired(t0 + 240)
    assert not every5.due(t0 + 241) and every5.due(t0 + 540)
    seconds = Cron("* * * * * */10")  # the 6th field is seconds
    assert not seconds.due(t0 + 1) and seconds.due(t0 + 10)
    with pytest.raises(ValueError, match="invalid cron expression 'every day'"):
        Cron("every day")


def test_event_trigger_matches_kind_and_filter() -> None:
    trig = OnEvent(("model.registered",), where=lambda ev: ev.data.get("name") == "m")
    ev = PipelineEvent("model.registered", "r", "p", 1.0, "s", {"name": "m"})
    assert trig.matches(ev)
    assert not trig.matches(PipelineEvent("model.registered", "r", "p", 1.0, "s", {"name": "x"}))
    assert not trig.matches(PipelineEvent("run.failed", "r", "p", 1.0, None, {"name": "m"}))
    assert not trig.due(1e12)


# =============================================================== supervisor
class Sinks:
    def __init__(self) -> None:
        self.audit: list[tuple[str, str, dict[str, Any], str | None]] = []
        self.reasoning: list[dict[str, Any]] = []

    def a(self, kind: str, actor: str, payload: dict[str, Any], cid: str | None) -> None:
        self.audit.append((kind, actor, payload, cid))

    def r(self, record: dict[str, Any], cid: str | None) -> None:
        self.reasoning.append(record)


def test_sensors_rules_and_actuators_are_recorded() -> None:
    now = [0.0]
    sinks = Sinks()
    sup = Supervisor("t", clock=lambda: now[0], audit=sinks.a, reasoning=sinks.r)
    seen: list[float] = []

    def sense(s: Supervisor, ev: PipelineEvent | None) -> Observation:
        seen.append(now[0])
        return Observation("load", "load is high", evidence={"rps": 90.0 + now[0]})

    calls: list[dict[str, Any]] = []

    def act(s: Supervisor, d: Decision, cid: str) -> ActuationResult:
        calls.append(dict(d.args))
        return ActuationResult(True, (), {"done": True})

    sup.actuator("scale", act)
    sup.sensor("load", sense, Interval(10.0))
    sup.rule("scale-up", "load",
             lambda s, o: Decision("scale", {"to": 3}, f"rps {o.evidence['rps']}")
             if o.evidence["rps"] > 95 else None)
    sup.tick(0.0)  # fires, no decision (rps 90)
    now[0] = 5.0
    assert sup.tick() == []  # not due yet
    now[0] = 10.0
    records = sup.tick()
    assert seen == [0.0, 10.0]
    assert len(records) == 1 and calls == [{"to": 3}]
    rec = records[0].to_dict()
    assert rec["rule"] == "scale-up" and rec["decision"]["rationale"] == "rps 100.0"
    assert rec["result"] == {"accepted": True, "reasons": [], "detail": {"done": True}}
    assert rec["saw"]["evidence"] == {"rps": 100.0}
    assert [r["rule"] for r in sinks.reasoning] == [None, "scale-up"]
    with pytest.raises(ValueError, match="rule 'x' reads unknown sensor 'nope' \\(sensors: load\\)"):
        sup.rule("x", "nope", lambda s, o: None)
    bad = sup.act(Decision("teleport", {}, "why not"))
    assert not bad.accepted and "unknown actuator 'teleport'" in bad.reasons[0]
    bad = sup.act(Decision("promote-model", {"version": 2}, "no model named"))
    assert bad.reasons == ("promote-model: missing argument 'model'",)
    bad = sup.act(Decision("scale-service", {"run_id": "r", "step": "s", "replicas": "3"}, "x"))
    assert bad.reasons == ("scale-service: argument 'replicas' must be int, got str",)


def test_a_failing_sensor_does_not_stop_the_others() -> None:
    sup = Supervisor("t", clock=lambda: 0.0)
    fired: list[str] = []

    def broken(s: Supervisor, ev: PipelineEvent | None) -> Observation:
        raise RuntimeError("disk on fire")

    def fine(s: Supervisor, ev: PipelineEvent | None) -> Observation:
        fired.append("fine")
        return Observation("fine", "ok", fire=False)

    sup.sensor("broken", broken, Interval(1))
    sup.sensor("fine", fine, Interval(1))
    sup.tick(0.0)
    assert fired == ["fine"]


# ========================================================= promotion rules
@pytest.fixture
def registry(sim: SimRig, tmp_path: Path) -> ModelRegistry:
    return sim.runner.registry


def _register(reg: ModelRegistry, tmp_path: Path, **metrics: Any) -> int:
    art = tmp_path / f"m{len(reg.versions())}.pkl"
    art.write_bytes(b"m")
    return reg.register("m", art, metrics=metrics, time=1.0).version


def test_promotion_is_verified_against_the_serving_version(
    sim: SimRig, registry: ModelRegistry, tmp_path: Path
) -> None:
    sinks = Sinks()
    sup = Supervisor("q", clock=sim.clock.now, runner=sim.runner, audit=sinks.a,
                     reasoning=sinks.r)

    def promote(v: int, **kw: Any) -> ActuationResult:
        return sup.act(Decision("promote-model", {"model": "m", "version": v,
                                                  "metric": "accuracy", **kw}, "test"))

    v1 = _register(registry, tmp_path, accuracy=0.9)
    assert promote(v1).accepted  # nothing serves yet
    worse = _register(registry, tmp_path, accuracy=0.5, baseline_accuracy=0.6, baseline_version=1)
    better = _register(registry, tmp_path, accuracy=0.8, baseline_accuracy=0.6, baseline_version=1)
    stale = _register(registry, tmp_path, accuracy=0.99, baseline_accuracy=0.2, baseline_version=7)
    unmeasured = _register(registry, tmp_path, loss=0.1)

    r = promote(worse)
    assert not r.accepted and r.reasons == (
        "candidate accuracy 0.5000 does not beat production version 1 (0.6000) by more than 0"
        " on the same held-out data",
    )
    r = promote(stale)
    assert not r.accepted and "was not evaluated against production version 1" in r.reasons[0]
    r = promote(unmeasured)
    assert not r.accepted and r.reasons == (f"candidate version {unmeasured} has no 'accuracy' metric",)
    r = promote(better, min_gain=0.3)
    assert not r.accepted and "by more than 0.3" in r.reasons[0]
    stages = {v.version: v.stage for v in registry.versions("m")}
    assert stages[worse] == stages[stale] == stages[better] == "rejected"

    again = _register(registry, tmp_path, accuracy=0.8, baseline_accuracy=0.6, baseline_version=1)
    r = promote(again)
    assert r.accepted and r.detail["previous"] == 1
    assert registry.production("m").version == again  # type: ignore[union-attr]
    r = promote(worse)  # a rejected version is no candidate
    assert not r.accepted and "is rejected, not a candidate" in r.reasons[0]

    rb = sup.act(Decision("rollback-model", {"model": "m"}, "new model misbehaves"))
    assert rb.accepted and rb.detail == {"removed": again, "restored": 1}
    audited = [(p["action"], p["accepted"]) for kind, actor, p, _ in sinks.audit]
    assert audited == [
        ("promote-model", True), ("promote-model", False), ("promote-model", False),
        ("promote-model", False), ("promote-model", False), ("promote-model", True),
        ("promote-model", False), ("rollback-model", True),
    ]
    assert {kind for kind, *_ in sinks.audit} == {"supervision"}
    assert {actor for _, actor, *_ in sinks.audit} == {"supervisor:q"}
    assert sinks.audit[1][2]["figures"] == {
        "candidate": worse, "accuracy": 0.5, "production": 1, "baseline_accuracy": 0.6,
    }


def test_engine_sinks_and_a_rerun_through_proposals(sim: SimRig) -> None:
    e = sim.engine
    audit, reasoning = engine_sinks(e)
    sup = Supervisor("ops", clock=sim.clock.now, runner=sim.runner, audit=audit,
                     reasoning=reasoning)
    p = Pipeline("retrain", params={"data": "old"}, defaults={"estimated_duration": "5s"})
    p.step("train", ["train", "${params.data}"])
    spec = p.build()

    def sense(s: Supervisor, ev: PipelineEvent | None) -> Observation:
        return Observation("drift", "inputs drifted", evidence={"p_value": 1e-6})

    sup.sensor("drift", sense, Interval(60))
    sup.rule("retrain", "drift", lambda s, o: Decision(
        "rerun-pipeline", {"pipeline": spec, "params": {"data": "new"}},
        f"drift p={o.evidence['p_value']:g}"))
    records = sup.tick()
    assert records[0].result is not None and records[0].result.accepted
    run_id = records[0].result.detail["run_id"]
    sim.until(lambda: sim.runner.status(run_id) == "succeeded")
    with e.lock:
        assert e.cp.workloads[f"{run_id}.train"].spec.command == ("train", "new")
    proposals = e.audit.show(kind="proposal", limit=None)
    assert [(a.actor, a.data()["rationale"], a.data()["accepted"]) for a in proposals] == [
        ("supervisor:ops", "drift p=1e-06; run step train of retrain-1", True)
    ]
    stored = e.repo.reasoning()
    assert stored[-1].record["decision"]["actuator"] == "rerun-pipeline"
    assert e.audit.show(kind="reasoning", limit=None)[-1].actor == "supervisor:ops"
    assert e.audit.verify().ok


# ==================================================================== drift
def test_ks_drift_detector() -> None:
    rng = np.random.default_rng(0)
    ref = rng.normal(5.0, 1.0, 500).tolist()
    det = KSDriftDetector(ref, alpha=1e-3, window=100)
    det.update(rng.normal(5.0, 1.0, 50))
    assert not det.test().drift and not det.full  # half a window: never drift
    det.update(rng.normal(5.0, 1.0, 50))
    same = det.test()
    assert det.full and not same.drift and same.p_value > 1e-3
    det.update(rng.normal(3.5, 1.5, 100))  # the window slides onto shifted data
    shifted = det.test()
    assert shifted.drift and shifted.p_value < 1e-6 and shifted.window_mean < 4.0
    det.reset(rng.normal(3.5, 1.5, 200).tolist())
    assert len(det.window) == 0
    for bad, msg in ((dict(reference=[1.0] * 5), "at least 20 values"),
                     (dict(reference=ref, alpha=2.0), "alpha must be within"),
                     (dict(reference=ref, window=5), "the window must hold at least 20")):
        with pytest.raises(ValueError, match=msg):
            KSDriftDetector(**bad)  # type: ignore[arg-type]
