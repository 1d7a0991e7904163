"""The agent's vocabulary: findings, candidate plans, forecasts, reasoning traces.

Plain frozen values shared by every part of the loop (triggers produce
findings, strategies produce candidate plans, the what-if forecaster produces
forecasts, reasoners produce choices with traces). Every one of them turns
into JSON with ``to_dict()`` so it can be audited, stored and streamed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlwe.agent.codec import action_to_dict
from mlwe.core.actions import Action


class Mode(enum.StrEnum):
    AUTONOMOUS = "autonomous"  # verified, better plans are committed at once
    APPROVE = "approve"  # plans wait for an operator's approve(id) / reject(id)
    OBSERVE = "observe"  # plans are proposed and recorded, never committed


def jsonable(v: Any) -> Any:
    """``v`` with non-finite floats as strings and tuples as lists (strict JSON)."""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return round(v, 6)
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [jsonable(x) for x in v]
    if isinstance(v, enum.Enum):
        return v.value
    return v


def json_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """``jsonable`` for a mapping, typed as a dict."""
    out = jsonable(d)
    assert isinstance(out, dict)
    return out


@dataclass(frozen=True, slots=True)
class Finding:
    """Something a trigger noticed, with the evidence it rests on."""

    trigger: str  # the trigger's name, e.g. "loss-diverging"
    subject: str  # the workload, node or queue it is about
    subject_kind: str  # "workload" | "node" | "queue" | "cluster"
    summary: str  # one readable line
    severity: float = 0.5  # 0 (note) .. 1 (act now)
    evidence: Mapping[str, Any] = field(default_factory=dict)
    time: float = 0.0
    cause: str | None = None  # triage result where the trigger classifies (oom, code, node)

    @property
    def id(self) -> str:
        return f"{self.trigger}:{self.subject}"

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {
                "id": self.id,
                "trigger": self.trigger,
                "subject": self.subject,
                "subject_kind": self.subject_kind,
                "summary": self.summary,
                "severity": self.severity,
                "evidence": dict(self.evidence),
                "time": self.time,
                "cause": self.cause,
            }
        )


@dataclass(frozen=True, slots=True)
class Hazard:
    """What the agent believes will happen to a workload if nothing changes.

    The what-if forecaster plays hazards forward: a ``crash`` hazard fails every
    attempt after ``after_s`` seconds of running (an out-of-memory loop, say)
    unless the plan removes it; a ``waste`` hazard marks a run whose GPU time
    produces nothing of value (a diverged loss); a ``hang`` hazard is a run
    that holds its resources and never finishes (stalled progress); a
    ``node-failure`` hazard names a NODE in ``workload`` that is expected to
    fail ``after_s`` seconds from now (a degrading node); an ``overload``
    hazard names an inference SERVICE in ``workload`` that is overloaded while
    fewer than ``replicas`` of its replicas run."""

    workload: str  # the workload (the node, for node-failure)
    kind: str  # "crash" | "waste" | "hang" | "node-failure" | "overload"
    after_s: float = 0.0
    cause: str = ""
    #: the hazard is gone once the workload asks at least this much memory (MiB)
    cleared_by_memory: int | None = None
    #: the hazard holds only for this attempt (a restart clears it); None: every attempt
    attempt: int | None = None
    #: for "overload": the service (label value) needs this many running replicas
    replicas: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {
                "workload": self.workload,
                "kind": self.kind,
                "after_s": self.after_s,
                "cause": self.cause,
                "cleared_by_memory": self.cleared_by_memory,
                "attempt": self.attempt,
                "replicas": self.replicas,
            }
        )


@dataclass(frozen=True, slots=True)
class WorkflowRequest:
    """A multi-step workflow that carries a plan through once its actions are committed.

    ``kind`` names a workflow definition (``reschedule``, ``recover``) and
    ``params`` its parameters (see :mod:`mlwe.agent.workflows`). The plan's
    actions are the first, verified step (proposed at the version the plan was
    decided on); the workflow then waits, confirms and compensates."""

    kind: str
    params: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return json_dict({"kind": self.kind, "params": dict(self.params)})


@dataclass(frozen=True, slots=True)
class CandidatePlan:
    """A strategy's proposal: typed actions plus why, and the factors a reasoner weighs.

    ``factors`` are the strategy's own estimates in [0, 1] (``benefit``:
    how much it addresses the finding; ``cost``: work lost or disruption;
    ``risk``: how likely it is wrong; ``confidence``: in the diagnosis)."""

    id: str
    strategy: str
    finding_ids: tuple[str, ...]
    actions: tuple[Action, ...]
    summary: str
    rationale: tuple[str, ...] = ()
    factors: Mapping[str, float] = field(default_factory=dict)
    #: hazards that applying this plan removes (the what-if plays the rest)
    clears: tuple[str, ...] = ()  # workload ids whose hazards the plan removes
    #: the workflow that carries the plan through after its actions commit (None: none)
    workflow: WorkflowRequest | None = None

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {
                "id": self.id,
                "strategy": self.strategy,
                "finding_ids": list(self.finding_ids),
                "actions": [action_to_dict(a) for a in self.actions],
                "summary": self.summary,
                "rationale": list(self.rationale),
                "factors": dict(self.factors),
                "clears": list(self.clears),
                "workflow": self.workflow.to_dict() if self.workflow is not None else None,
            }
        )


@dataclass(frozen=True, slots=True)
class Forecast:
    """One future, played on the simulator from a fork of the current state."""

    label: str  # "plan" or "nothing"
    horizon_s: float
    verified: bool  # the plan's actions were accepted by the forked control plane
    rejections: tuple[str, ...] = ()
    kpis: Mapping[str, float] = field(default_factory=dict)
    score: float = math.inf  # lower is better
    terms: Mapping[str, float] = field(default_factory=dict)  # weighted parts of the score

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {
                "label": self.label,
                "horizon_s": self.horizon_s,
                "verified": self.verified,
                "rejections": list(self.rejections),
                "kpis": dict(self.kpis),
                "score": self.score,
                "terms": dict(self.terms),
            }
        )


@dataclass(frozen=True, slots=True)
class WhatIf:
    """A plan and doing nothing, played over the same horizon from the same fork."""

    plan_id: str | None
    plan: Forecast
    nothing: Forecast
    better: bool  # verified, and the plan's score beats doing nothing by the margin
    margin: float
    summary: str
    fork_version: int  # the live version the fork was taken at

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {
                "plan_id": self.plan_id,
                "plan": self.plan.to_dict(),
                "nothing": self.nothing.to_dict(),
                "better": self.better,
                "margin": self.margin,
                "summary": self.summary,
                "fork_version": self.fork_version,
            }
        )
