"""The API's response and request bodies, as pydantic models.

They are the OpenAPI schema: FastAPI validates every response against them,
and the Schemathesis test checks that what goes over the wire matches.
Times are engine-clock seconds (epoch seconds unless the engine runs a sped-up
or simulated clock), each with an RFC 3339 twin (``submitted_at``, ``at``);
resources use the engine's integer units (milli-GPU, MiB of VRAM, milli-CPU,
MiB of RAM), and nodes also give them as in specs (``quantities``: "4",
"500m", "256Gi"). Every list answers with a cursor for the next page
(``next_offset`` or ``next_after_seq``), and an unknown query parameter is a 400.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator


def list_pattern(names: Iterable[str]) -> str:
    """The pattern of a comma-separated list of ``names`` (blanks and empty items allowed,
    as the routes read such a list: split on commas, strip, skip empty), for the schema."""
    one = "(?:" + "|".join(re.escape(n) for n in names) + ")"
    return rf"^\s*{one}?\s*(?:,\s*{one}?\s*)*$"


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorItem(_Out):
    path: str = Field(description="where the problem is: a field path, or empty")
    message: str


class ErrorBody(_Out):
    """Every error response: a summary and, for bad input, each problem with its field."""

    detail: str
    errors: list[ErrorItem] = Field(default_factory=list)


class ResourcesOut(_Out):
    gpu: int = Field(description="milli-GPU")
    vram: int = Field(description="MiB")
    cpu: int = Field(description="milli-CPU")
    ram: int = Field(description="MiB")


class TransitionOut(_Out):
    time: float
    source: str | None
    target: str
    reason: str
    cause_id: str | None
    at: str | None = Field(default=None, description="time as RFC 3339 UTC")


class ReplicaOut(_Out):
    node: str
    devices: list[int]
    gpu_per_device: int
    res: ResourcesOut


class WorkloadSummary(_Out):
    id: str
    name: str
    kind: str
    queue: str
    state: str
    priority: int
    replicas: int
    gpus: float
    submit_time: float
    deadline: float | None
    deadline_left_s: float | None = Field(description="seconds to the deadline (negative: missed)")
    deadline_at_risk: bool
    progress: float
    attempt: int
    preemptions: int
    nodes: list[str]
    pending_reason: str
    condition: Literal["waiting", "inadmissible"] | None = Field(
        default=None,
        description="for a queued workload: 'inadmissible' (it could never run on this"
        " cluster and queue as they are now) or 'waiting' (for capacity)",
    )
    inadmissible_reasons: list[str] = Field(default_factory=list)
    owner: str | None = Field(description="name of the token that submitted it")
    owner_subject: str | None = Field(
        description="subject (token id) that owns it: unique, never reused; null for workloads"
        " stored before subjects"
    )
    correlation_id: str | None
    lifecycle: list[str] = Field(description="the states it went through, oldest first (last 12)")
    transitions: int = Field(
        default=0,
        description="how many transitions it has had in all; a state event's 'seq' is the"
        " number of its transition, so a client keeps the newer of a snapshot and its stream",
    )
    lifecycle_causes: list[str | None] = Field(
        default_factory=list,
        description="per lifecycle entry: for a failure, its cause (node-lost and vanished are not the"
        " workload's fault); else null",
    )
    preempted_by: str | None
    submitted_at: str | None = Field(default=None, description="submit_time as RFC 3339 UTC")
    deadline_at: str | None = Field(default=None, description="deadline as RFC 3339 UTC")


class WorkloadDetail(WorkloadSummary):
    spec: dict[str, Any]
    history: list[TransitionOut]
    placement: list[ReplicaOut]
    victims: list[str]
    failures: int
    failure_cause: str | None
    exit_code: int | None
    work_done_s: float
    remaining_estimate_s: float | None
    now: float | None = Field(default=None, description="the engine's clock when read (ages are now - time)")


class WorkloadList(_Out):
    total: int
    items: list[WorkloadSummary]
    now: float | None = Field(default=None, description="the engine's clock when listed (ages are now - submit_time)")
    next_offset: int | None = Field(default=None, description="offset of the next page; null: this is the last")


class SubmitResult(_Out):
    accepted: bool
    created: list[str]
    version: int
    correlation_id: str
    rejections: list[str] = Field(default_factory=list)


class ValidateResult(_Out):
    valid: bool
    workloads: int
    errors: list[ErrorItem]


class ActionResult(_Out):
    accepted: bool
    version: int
    message: str
    rejections: list[str] = Field(default_factory=list)


class GpuDeviceOut(_Out):
    index: int
    free_milli: int
    holders: list[dict[str, Any]] = Field(
        description="workloads using this device: id, name, priority, milli, state"
    )


class QuantitiesOut(_Out):
    gpu: str = Field(description="GPUs, as in specs: '4', '500m'")
    cpu: str = Field(description="CPU cores, as in specs: '32', '500m'")
    memory: str = Field(description="RAM, as in specs: '256Gi'")
    vram: str = Field(description="VRAM in total, as in specs: '320Gi'")


class NodeQuantities(_Out):
    capacity: QuantitiesOut
    free: QuantitiesOut


class NodeOut(_Out):
    name: str
    status: str
    gpu_model: str | None
    gpus: int
    vram_per_gpu: int
    labels: dict[str, str]
    capacity: ResourcesOut
    free: ResourcesOut
    devices: list[GpuDeviceOut]
    workloads: list[str]
    quantities: NodeQuantities | None = Field(default=None, description="capacity and free, as in specs")


class NodeList(_Out):
    items: list[NodeOut]


class QueueOut(_Out):
    name: str
    cohort: str | None
    weight: float
    nominal: dict[str, int | None] = Field(description="quota per resource; null: unlimited")
    borrowing_limit: dict[str, int | None]
    usage: ResourcesOut
    pending: int
    running: int


class QueueList(_Out):
    items: list[QueueOut]


class DecisionOut(_Out):
    seq: int
    time: float
    version: int
    kind: str
    workload: str
    policy: str
    cause_id: str | None
    inputs_digest: str
    candidates: list[str]
    chosen: str
    reasons: list[str]
    extra: dict[str, Any] = Field(default_factory=dict)
    at: str | None = Field(default=None, description="time as RFC 3339 UTC")


class DecisionList(_Out):
    items: list[DecisionOut]
    next_after_seq: int | None = Field(default=None, description="pass as after_seq for the decisions after these")


class Explanation(_Out):
    workload: str
    state: str
    summary: str = Field(description="why it is where it is, in one paragraph")
    pending_reason: str
    condition: Literal["waiting", "inadmissible"] | None = Field(
        default=None,
        description="for a queued workload: 'inadmissible' (it could never run on this"
        " cluster and queue as they are now) or 'waiting' (for capacity)",
    )
    inadmissible_reasons: list[str] = Field(default_factory=list)
    preempted_by: str | None
    victims: list[str]
    history: list[TransitionOut]
    decisions: list[DecisionOut]


class AuditOut(_Out):
    seq: int
    time: float
    kind: str
    actor: str
    workload: str | None
    correlation_id: str | None
    payload: dict[str, Any]
    hash: str
    prev_hash: str
    at: str | None = Field(default=None, description="time as RFC 3339 UTC")


class AuditList(_Out):
    items: list[AuditOut]
    next_after_seq: int | None = Field(
        default=None, description="pass as after_seq for the records after these (also to follow new ones)"
    )


class AuditVerifyOut(_Out):
    ok: bool
    checked: int
    first_bad_seq: int | None
    reason: str
    head_seq: int
    head_hash: str


class DeadLetterOut(_Out):
    event_id: str
    time: float
    subject: str
    error: str
    attempts: int
    replayed: bool
    processed: bool


class DeadLetterList(_Out):
    items: list[DeadLetterOut]


class AgentStatus(_Out):
    present: bool = Field(description="whether an agent loop runs in this engine")
    mode: str | None
    reasoner: str | None
    pending_approvals: int
    detail: dict[str, Any] = Field(default_factory=dict)


class ApprovalOut(_Out):
    id: str
    time: float
    summary: str
    correlation_id: str | None
    plan: dict[str, Any]


class ApprovalList(_Out):
    items: list[ApprovalOut]


class ScenarioOut(_Out):
    name: str
    title: str
    description: str


class ScenarioList(_Out):
    items: list[ScenarioOut]


class ScenarioResult(_Out):
    scenario: str
    correlation_id: str
    message: str
    workloads: list[str]


class StreamEventOut(_Out):
    id: int
    topic: str
    time: float
    correlation_id: str | None
    workload: str | None
    data: dict[str, Any]


class StreamEventList(_Out):
    last_id: int
    items: list[StreamEventOut]


class ClusterOut(_Out):
    now: float
    version: int
    backend: str
    nodes: list[NodeOut]
    workloads: list[WorkloadSummary] = Field(
        description="workloads that hold resources, wait in a queue, or have a deadline"
    )
    totals: dict[str, float]


class HistoryPoint(_Out):
    time: float
    at: str | None = Field(description="time as RFC 3339 UTC")
    resolution_s: int
    metrics: dict[str, float] = Field(
        description="gpus, gpus_used, gpu_util, pending, running, pending:<queue>; and since the previous"
        " point: preemptions, lost_gpu_h, deadlines_met, deadlines_missed"
    )


class HistoryOut(_Out):
    items: list[HistoryPoint]
    next_since: float | None = Field(description="pass as since for the points after these")


class TokenPolicyOut(_Out):
    queues: list[str] | None = Field(description="queues it may submit to; null: any")
    max_priority: int | None = Field(description="highest priority it may ask for; null: any")
    max_priority_class: str | None
    allow_protected: bool


class TokenOut(_Out):
    id: str
    name: str
    role: str
    created: float
    revoked: bool
    subject: str = Field(description="what owns this token's workloads (its id; never reused)")
    policy: TokenPolicyOut


class TokenList(_Out):
    items: list[TokenOut]


class TokenCreated(TokenOut):
    token: str = Field(description="the bearer token; shown once, stored only as a hash")


class WhoAmI(_Out):
    token_id: str
    name: str
    role: str
    subject: str
    policy: TokenPolicyOut


class Health(_Out):
    status: str
    checks: dict[str, Any] = Field(default_factory=dict)


# ------------------------------------------------------------------ requests
class NodeAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="", max_length=500)


class AgentModeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["autonomous", "approve", "observe"] = Field(description="autonomous, approve or observe")


class ApprovalDecisionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    comment: str = Field(default="", max_length=1000)


_PRIORITY_CLASS_NAMES = ("best-effort", "low", "batch", "normal", "high", "urgent", "critical")


class TokenCreateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
    role: Literal["viewer", "submitter", "operator", "admin"] = Field(
        description="viewer, submitter, operator or admin"
    )
    queues: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]] | None = Field(
        default=None, min_length=1, max_length=1000,
        description="queues the token may submit to (omit: any queue)",
    )
    max_priority: (
        Annotated[int, Field(ge=0, le=1_000_000)]
        | Literal["best-effort", "low", "batch", "normal", "high", "urgent", "critical"]  # _PRIORITY_CLASS_NAMES
        | None
    ) = Field(
        default=None,
        description="highest priority it may ask for: an integer 0..1000000 or a class name (omit: any)",
    )
    allow_protected: StrictBool = Field(default=True, description="whether it may submit protected workloads")

    @field_validator("max_priority", mode="before")
    @classmethod
    def _integer_or_class(cls, v: Any) -> Any:
        # an integer (JSON's 5 or 5.0) or a class name; not the text "5", nor true/false
        if isinstance(v, bool):
            raise ValueError("must be an integer or a priority class name, not a boolean")
        if isinstance(v, str) and v not in _PRIORITY_CLASS_NAMES:
            known = ", ".join(_PRIORITY_CLASS_NAMES)
            raise ValueError(f"must be an integer or a priority class ({known}); got {v[:40]!r}")
        return v


class ScenarioIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str | None = Field(
        default=None, max_length=128, description="a node or workload to aim at (optional)"
    )
