"""Application-layer supervision agents: sensors, rules, actuators.

After Scanflow's agents: a :class:`Supervisor` owns **sensors** (each fires on
its triggers: an :class:`Interval`, a :class:`Cron` schedule, or an
:class:`OnEvent` filter over pipeline events), **rules** (each turns a
sensor's :class:`Observation` into a :class:`Decision`, or nothing), and
**actuators** (what a decision may do: rerun a pipeline with new data,
promote a model, roll one back, scale a service).

Actuators act through the same verified path as everything else:

- what changes cluster state (the steps of a rerun, service replicas) is a
  proposal to the control plane (``Engine.propose``): verified, applied or
  rejected with reasons, and audited by the engine;
- what changes the model registry (promote, roll back) is verified here
  (the candidate exists, is a candidate, and beats production on the same
  held-out data, evaluated against the production version that serves now)
  and recorded as an audit ``proposal`` record, accepted or rejected with
  its reasons, through the ``audit`` sink.

Every decision, with what the sensor saw, which rule chose what, and the
result, is a reasoning record (``reasoning`` sink). The sinks are plain
callables; :func:`engine_sinks` wires them to an engine's audit log and
reasoning stream.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from croniter import croniter  # type: ignore[import-untyped]

from mlwe.pipelines.ports import EngineLike
from mlwe.pipelines.runner import PipelineEvent, PipelineRunner
from mlwe.pipelines.spec import PipelineError, PipelineSpec
from mlwe.store.pipelines import ModelRegistry, RegistryError

log = logging.getLogger("mlwe.pipelines.supervision")
T = TypeVar("T")

AuditSink = Callable[[str, str, dict[str, Any], str | None], None]  # kind, actor, payload, cid
ReasoningSink = Callable[[dict[str, Any], str | None], None]  # record, correlation id


# =================================================================== triggers
class Trigger(Protocol):
    def due(self, now: float) -> bool: ...

    def fired(self, now: float) -> None: ...

    def describe(self) -> str: ...


@dataclass
class Interval:
    """Fires every ``seconds`` (the first time at once)."""

    seconds: float
    _next: float | None = None

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"an interval must be positive, got {self.seconds!r}")

    def due(self, now: float) -> bool:
        return self._next is None or now >= self._next

    def fired(self, now: float) -> None:
        self._next = now + self.seconds

    def describe(self) -> str:
        return f"every {self.seconds:g}s"


@dataclass
class Cron:
    """Fires on a cron schedule (5 fields, or 6 with seconds), in UTC."""

    expr: str
    _next: float | None = None

    def __post_init__(self) -> None:
        if not croniter.is_valid(self.expr):
            raise ValueError(f"invalid cron expression {self.expr!r}")

    def _after(self, t: float) -> float:
        start = datetime.fromtimestamp(t, tz=UTC)
        return float(croniter(self.expr, start).get_next(float))

    def due(self, now: float) -> bool:
        if self._next is None:
            self._next = self._after(now)
        return now >= self._next

    def fired(self, now: float) -> None:
        self._next = self._after(now)

    def describe(self) -> str:
        return f"cron {self.expr!r}"


@dataclass
class OnEvent:
    """Fires on pipeline events of the given kinds (and matching ``where``)."""

    kinds: tuple[str, ...]
    where: Callable[[PipelineEvent], bool] | None = None

    def matches(self, ev: PipelineEvent) -> bool:
        return ev.kind in self.kinds and (self.where is None or self.where(ev))

    def due(self, now: float) -> bool:
        return False  # events, not time, fire it

    def fired(self, now: float) -> None:
        return None

    def describe(self) -> str:
        return f"on {', '.join(self.kinds)}"


# ============================================================ observations
@dataclass(frozen=True)
class Observation:
    """What a sensor saw: ``fire`` says whether it is worth a rule's attention."""

    sensor: str
    summary: str
    fire: bool = True
    evidence: Mapping[str, Any] = field(default_factory=dict)
    subject: str = ""
    time: float = 0.0
    event: PipelineEvent | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "sensor": self.sensor,
            "summary": self.summary,
            "fire": self.fire,
            "subject": self.subject,
            "time": self.time,
            "evidence": _jsonable(dict(self.evidence)),
            "event": self.event.to_dict() if self.event is not None else None,
        }


SenseFn = Callable[["Supervisor", PipelineEvent | None], Observation | None]


@dataclass
class Sensor:
    name: str
    read: SenseFn
    triggers: tuple[Interval | Cron | OnEvent, ...]


@dataclass(frozen=True)
class Decision:
    """A rule's choice: call ``actuator`` with ``args``, because ``rationale``."""

    actuator: str
    args: Mapping[str, Any]
    rationale: str
    considered: tuple[str, ...] = ()


DecideFn = Callable[["Supervisor", Observation], Decision | None]


@dataclass
class Rule:
    name: str
    sensor: str  # the sensor whose observations it reads
    decide: DecideFn


@dataclass(frozen=True)
class ActuationResult:
    accepted: bool
    reasons: tuple[str, ...] = ()
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "reasons": list(self.reasons),
            "detail": _jsonable(dict(self.detail)),
        }


ActuatorFn = Callable[["Supervisor", Decision, str], ActuationResult]  # sup, decision, cid


@dataclass(frozen=True)
class Record:
    """One supervision step, as stored in the reasoning stream."""

    time: float
    supervisor: str
    observation: Observation
    rule: str | None
    decision: Decision | None
    result: ActuationResult | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "supervision",
            "time": self.time,
            "supervisor": self.supervisor,
            "saw": self.observation.to_dict(),
            "rule": self.rule,
            "decision": None
            if self.decision is None
            else {
                "actuator": self.decision.actuator,
                "args": _jsonable(dict(self.decision.args)),
                "rationale": self.decision.rationale,
                "considered": list(self.decision.considered),
            },
            "result": None if self.result is None else self.result.to_dict(),
        }


def _jsonable(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, PipelineSpec):
        return v.name
    if v is None or isinstance(v, int | str | bool):
        return v
    return str(v)


# ================================================================= supervisor
class Supervisor:
    """Sensors -> rules -> actuators, recorded (see the module docstring)."""

    def __init__(
        self,
        name: str,
        *,
        clock: Callable[[], float],
        runner: PipelineRunner | None = None,
        registry: ModelRegistry | None = None,
        audit: AuditSink | None = None,
        reasoning: ReasoningSink | None = None,
        history: int = 1000,
    ) -> None:
        self.name = name
        self.clock = clock
        self.runner = runner
        self.registry = registry or (runner.registry if runner is not None else None)
        self.audit = audit
        self.reasoning = reasoning
        self.sensors: dict[str, Sensor] = {}
        self.rules: list[Rule] = []
        self.actuators: dict[str, ActuatorFn] = dict(BUILTIN_ACTUATORS)
        self.records: deque[Record] = deque(maxlen=history)
        #: Free-form memory the sensors and rules of one supervisor share.
        self.state: dict[str, Any] = {}
        self._events: deque[PipelineEvent] = deque()
        self._n = 0
        if runner is not None:
            runner.listeners.append(self.on_event)

    @property
    def actor(self) -> str:
        return f"supervisor:{self.name}"

    # ------------------------------------------------------------- building
    def sensor(
        self, name: str, read: SenseFn, *triggers: Interval | Cron | OnEvent
    ) -> Sensor:
        if not triggers:
            raise ValueError(f"sensor {name!r} needs at least one trigger")
        if name in self.sensors:
            raise ValueError(f"sensor {name!r} already exists")
        s = Sensor(name, read, tuple(triggers))
        self.sensors[name] = s
        return s

    def rule(self, name: str, sensor: str, decide: DecideFn) -> Rule:
        if sensor not in self.sensors:
            raise ValueError(
                f"rule {name!r} reads unknown sensor {sensor!r}"
                f" (sensors: {', '.join(self.sensors) or 'none'})"
            )
        r = Rule(name, sensor, decide)
        self.rules.append(r)
        return r

    def actuator(self, name: str, fn: ActuatorFn) -> None:
        self.actuators[name] = fn

    # ---------------------------------------------------------------- running
    def on_event(self, ev: PipelineEvent) -> None:
        """Queue a pipeline event for the event triggers (handled at the next tick)."""
        self._events.append(ev)

    def tick(self, now: float | None = None) -> list[Record]:
        """Read every due sensor (time triggers first, then queued events), apply rules."""
        now = self.clock() if now is None else now
        out: list[Record] = []
        for s in self.sensors.values():
            timed = [t for t in s.triggers if not isinstance(t, OnEvent) and t.due(now)]
            if timed:
                for t in timed:
                    t.fired(now)
                out += self._sense(s, None, now)
        while self._events:
            ev = self._events.popleft()
            for s in self.sensors.values():
                if any(isinstance(t, OnEvent) and t.matches(ev) for t in s.triggers):
                    out += self._sense(s, ev, now)
        return out

    def _sense(self, s: Sensor, ev: PipelineEvent | None, now: float) -> list[Record]:
        try:
            obs = s.read(self, ev)
        except Exception as exc:  # a broken sensor is reported, and the others go on
            log.exception("sensor %s failed", s.name)
            obs = Observation(s.name, f"sensor failed: {type(exc).__name__}: {exc}", fire=False)
        if obs is None or not obs.fire:
            return []
        obs = Observation(
            obs.sensor, obs.summary, obs.fire, obs.evidence, obs.subject, obs.time or now, ev
        )
        out = []
        decided = False
        for rule in self.rules:
            if rule.sensor != s.name:
                continue
            decision = rule.decide(self, obs)
            if decision is None:
                continue
            decided = True
            result = self.act(decision, rule=rule.name, observation=obs)
            out.append(self.records[-1])
            if not result.accepted:
                log.info("%s: %s rejected: %s", self.name, decision.actuator, result.reasons)
        if not decided:
            rec = Record(now, self.name, obs, None, None, None)
            self._record(rec)
            out.append(rec)
        return out

    def act(
        self, decision: Decision, *, rule: str | None = None, observation: Observation | None = None
    ) -> ActuationResult:
        """Carry out a decision through its actuator, and record the whole step."""
        self._n += 1
        cid = f"{self.name}-{self._n}-{int(self.clock() * 1000)}"
        fn = self.actuators.get(decision.actuator)
        if fn is None:
            result = ActuationResult(
                False,
                (f"unknown actuator {decision.actuator!r}"
                 f" (known: {', '.join(sorted(self.actuators))})",),
            )
        else:
            try:
                result = fn(self, decision, cid)
            except (PipelineError, RegistryError, KeyError, ValueError) as exc:
                result = ActuationResult(False, (str(exc),))
        obs = observation or Observation("manual", decision.rationale)
        self._record(Record(self.clock(), self.name, obs, rule, decision, result), cid)
        return result

    def _record(self, rec: Record, cid: str | None = None) -> None:
        self.records.append(rec)
        if self.reasoning is not None:
            try:
                self.reasoning(rec.to_dict(), cid)
            except Exception:
                log.exception("reasoning sink failed")

    def _audit(self, payload: dict[str, Any], cid: str | None) -> None:
        if self.audit is not None:
            # "supervision", not "proposal": a registry decision is no control-plane
            # proposal (those, e.g. a rerun's submissions, the engine files itself)
            self.audit("supervision", self.actor, _jsonable(payload), cid)


# ================================================================= actuators
def _need_runner(sup: Supervisor) -> PipelineRunner:
    if sup.runner is None:
        raise ValueError(f"supervisor {sup.name!r} has no pipeline runner")
    return sup.runner


def _need_registry(sup: Supervisor) -> ModelRegistry:
    if sup.registry is None:
        raise ValueError(f"supervisor {sup.name!r} has no model registry")
    return sup.registry


def _arg(d: Decision, name: str, kind: type[T]) -> T:
    """A decision's argument, checked: a missing or mistyped one is refused by name."""
    if name not in d.args:
        raise ValueError(f"{d.actuator}: missing argument {name!r}")
    v = d.args[name]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ValueError(
            f"{d.actuator}: argument {name!r} must be {kind.__name__}, got {type(v).__name__}"
        )
    return v


def rerun_pipeline(sup: Supervisor, d: Decision, cid: str) -> ActuationResult:
    """args: ``pipeline`` (a PipelineSpec), ``params``: start a run whose steps are proposals."""
    runner = _need_runner(sup)
    spec = d.args.get("pipeline")
    if not isinstance(spec, PipelineSpec):
        return ActuationResult(False, ("'pipeline' must be a PipelineSpec",))
    params = dict(d.args.get("params") or {})
    rec = runner.start(spec, params, actor=sup.actor, rationale=d.rationale, correlation_id=cid)
    return ActuationResult(True, (), {"run_id": rec.id, "params": params})


def check_promotion(
    registry: ModelRegistry, name: str, version: int, metric: str, min_gain: float = 0.0
) -> tuple[list[str], dict[str, Any]]:
    """Why ``version`` may not be promoted (empty: it may), and the figures compared.

    The candidate's metrics must hold ``metric`` and, when a production version
    serves, ``baseline_<metric>`` and ``baseline_version``: production's figure on
    the same held-out data, measured against the version that serves *now*."""
    mv = registry.get(name, version)
    reasons: list[str] = []
    figures: dict[str, Any] = {"candidate": version}
    if mv.stage != "candidate":
        reasons.append(f"model {name!r} version {version} is {mv.stage}, not a candidate")
    value = mv.metrics.get(metric)
    if not isinstance(value, int | float):
        reasons.append(f"candidate version {version} has no {metric!r} metric")
        return reasons, figures
    figures[metric] = value
    prod = registry.production(name)
    if prod is None:
        figures["production"] = None
        return reasons, figures
    figures["production"] = prod.version
    base = mv.metrics.get(f"baseline_{metric}")
    base_version = mv.metrics.get("baseline_version")
    if not isinstance(base, int | float) or base_version != prod.version:
        reasons.append(
            f"candidate version {version} was not evaluated against production version"
            f" {prod.version} (baseline: {base_version!r}); evaluate it again"
        )
        return reasons, figures
    figures[f"baseline_{metric}"] = base
    if not value > base + min_gain:
        reasons.append(
            f"candidate {metric} {value:.4f} does not beat production version {prod.version}"
            f" ({base:.4f}) by more than {min_gain:g} on the same held-out data"
        )
    return reasons, figures


def promote_model(sup: Supervisor, d: Decision, cid: str) -> ActuationResult:
    """args: ``model``, ``version``, ``metric``, optional ``min_gain``: verified promotion."""
    name = _arg(d, "model", str)
    version = _arg(d, "version", int)
    registry = _need_registry(sup)
    metric = str(d.args.get("metric", "accuracy"))
    min_gain = float(d.args.get("min_gain", 0.0))
    try:
        reasons, figures = check_promotion(registry, name, version, metric, min_gain)
    except RegistryError as exc:
        reasons, figures = [str(exc)], {}
    accepted = not reasons
    previous = None
    if accepted:
        prev = registry.promote(name, version)
        previous = prev.version if prev is not None else None
    elif figures.get("candidate") is not None:
        try:
            if registry.get(name, version).stage == "candidate":
                registry.reject(name, version)
        except RegistryError:
            pass
    payload = {
        "action": "promote-model",
        "model": name,
        "version": version,
        "metric": metric,
        "figures": figures,
        "previous_production": previous,
        "accepted": accepted,
        "reasons": reasons,
        "rationale": d.rationale,
    }
    sup._audit(payload, cid)
    return ActuationResult(accepted, tuple(reasons), {**figures, "previous": previous})


def rollback_model(sup: Supervisor, d: Decision, cid: str) -> ActuationResult:
    """args: ``model``: put back the version production replaced last."""
    name = _arg(d, "model", str)
    registry = _need_registry(sup)
    try:
        removed, restored = registry.rollback(name)
    except RegistryError as exc:
        sup._audit(
            {"action": "rollback-model", "model": name, "accepted": False,
             "reasons": [str(exc)], "rationale": d.rationale},
            cid,
        )
        return ActuationResult(False, (str(exc),))
    sup._audit(
        {"action": "rollback-model", "model": name, "removed": removed.version,
         "restored": restored.version, "accepted": True, "reasons": [],
         "rationale": d.rationale},
        cid,
    )
    return ActuationResult(True, (), {"removed": removed.version, "restored": restored.version})


def scale_service(sup: Supervisor, d: Decision, cid: str) -> ActuationResult:
    """args: ``run_id``, ``step``, ``replicas``: replicas added or cancelled by proposal."""
    run_id, step, n = _arg(d, "run_id", str), _arg(d, "step", str), _arg(d, "replicas", int)
    result = _need_runner(sup).scale_service(
        run_id, step, n, actor=sup.actor, rationale=d.rationale
    )
    return ActuationResult(
        result.accepted, tuple(result.reasons()), {"version": result.version,
                                                    "created": list(result.created)}
    )


BUILTIN_ACTUATORS: Mapping[str, ActuatorFn] = {
    "rerun-pipeline": rerun_pipeline,
    "promote-model": promote_model,
    "rollback-model": rollback_model,
    "scale-service": scale_service,
}


# ===================================================================== wiring
def engine_sinks(engine: EngineLike) -> tuple[AuditSink, ReasoningSink]:
    """Sinks that write to ``engine``'s audit chain and reasoning stream (durably)."""

    def audit(kind: str, actor: str, payload: dict[str, Any], cid: str | None) -> None:
        # an audit note is a request like any other: screened, durable when this returns
        engine.note_audit(kind, actor, payload, correlation_id=cid)

    def reasoning(record: dict[str, Any], cid: str | None) -> None:
        engine.record_reasoning(
            record, correlation_id=cid, actor=f"supervisor:{record.get('supervisor')}"
        )

    return audit, reasoning


def list_records(sup: Supervisor, kinds: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The supervisor's recent records as JSON (optionally only those with these actuators)."""
    out = []
    for r in sup.records:
        if kinds and (r.decision is None or r.decision.actuator not in kinds):
            continue
        out.append(r.to_dict())
    return out
