"""The typed answers of the API (typed dicts: the server's OpenAPI models, checked against
them by a test through :data:`MODELS`)."""

from __future__ import annotations

from typing import Any, TypedDict


class Resources(TypedDict):
    gpu: int
    vram: int
    cpu: int
    ram: int


class Transition(TypedDict):
    time: float
    source: str | None
    target: str
    reason: str
    cause_id: str | None
    at: str | None


class WorkloadSummary(TypedDict):
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
    deadline_left_s: float | None
    deadline_at_risk: bool
    progress: float
    attempt: int
    preemptions: int
    nodes: list[str]
    pending_reason: str
    owner: str | None  # the name of the token that submitted it
    owner_subject: str | None  # the token's id: what owns it (unique, never reused)
    correlation_id: str | None
    lifecycle: list[str]
    transitions: int
    lifecycle_causes: list[str | None]
    preempted_by: str | None
    submitted_at: str | None
    deadline_at: str | None
    condition: str | None  # for a queued workload: "waiting" or "inadmissible" (can never run here)
    inadmissible_reasons: list[str]


class WorkloadDetail(WorkloadSummary):
    spec: dict[str, Any]
    history: list[Transition]
    placement: list[dict[str, Any]]
    victims: list[str]
    failures: int
    failure_cause: str | None
    exit_code: int | None
    work_done_s: float
    remaining_estimate_s: float | None
    now: float | None


class Quantities(TypedDict):
    gpu: str
    cpu: str
    memory: str
    vram: str


class NodeQuantities(TypedDict):
    capacity: Quantities
    free: Quantities


class Node(TypedDict):
    name: str
    status: str
    gpu_model: str | None
    gpus: int
    vram_per_gpu: int
    labels: dict[str, str]
    capacity: Resources
    free: Resources
    devices: list[dict[str, Any]]
    workloads: list[str]
    quantities: NodeQuantities | None


class Queue(TypedDict):
    name: str
    cohort: str | None
    weight: float
    nominal: dict[str, int | None]
    borrowing_limit: dict[str, int | None]
    usage: Resources
    pending: int
    running: int


class Decision(TypedDict):
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
    extra: dict[str, Any]
    at: str | None


class Explanation(TypedDict):
    workload: str
    state: str
    summary: str
    pending_reason: str
    preempted_by: str | None
    victims: list[str]
    history: list[Transition]
    decisions: list[Decision]
    condition: str | None
    inadmissible_reasons: list[str]


class AuditRecord(TypedDict):
    seq: int
    time: float
    kind: str
    actor: str
    workload: str | None
    correlation_id: str | None
    payload: dict[str, Any]
    hash: str
    prev_hash: str
    at: str | None


class SubmitResult(TypedDict):
    accepted: bool
    created: list[str]
    version: int
    correlation_id: str
    rejections: list[str]


class ActionResult(TypedDict):
    accepted: bool
    version: int
    message: str
    rejections: list[str]


class TokenPolicy(TypedDict):
    queues: list[str] | None  # None: any queue
    max_priority: int | None  # None: any priority
    max_priority_class: str | None
    allow_protected: bool


class TokenInfo(TypedDict):
    id: str
    name: str
    role: str
    created: float
    revoked: bool
    subject: str
    policy: TokenPolicy


class TokenCreated(TokenInfo):
    token: str


class AgentStatus(TypedDict):
    present: bool
    mode: str | None
    reasoner: str | None
    pending_approvals: int
    detail: dict[str, Any]


class Approval(TypedDict):
    id: str
    time: float
    summary: str
    correlation_id: str | None
    plan: dict[str, Any]


#: client model -> the server's model of the same answer (tests/api/test_client_lib.py checks both agree)
MODELS: dict[str, type] = {
    "ResourcesOut": Resources, "TransitionOut": Transition, "WorkloadSummary": WorkloadSummary,
    "WorkloadDetail": WorkloadDetail, "NodeOut": Node, "QueueOut": Queue, "DecisionOut": Decision,
    "Explanation": Explanation, "AuditOut": AuditRecord, "SubmitResult": SubmitResult,
    "ActionResult": ActionResult, "TokenOut": TokenInfo, "TokenCreated": TokenCreated,
    "AgentStatus": AgentStatus, "ApprovalOut": Approval, "QuantitiesOut": Quantities,
    "NodeQuantities": NodeQuantities,
}
