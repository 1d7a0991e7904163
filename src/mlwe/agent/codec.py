"""Typed actions to and from JSON, for audit records, streams and LLM tool calls.

``action_to_dict`` writes any core action. ``action_from_dict`` reads only the
kinds an agent may propose (``AGENT_ACTION_KINDS``): an agent never reports a
backend fact, places or starts a workload, or adds a node; those are the
scheduler's and the backend's. Anything malformed raises :class:`ActionError`
naming the field, so a tool call gets a clear error back instead of a crash.
The control plane still verifies everything it receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from mlwe.core.actions import (
    Action,
    AddNode,
    Cancel,
    Evict,
    Exited,
    Place,
    Preempt,
    PreemptReason,
    Progress,
    Released,
    Retry,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    SetResources,
    Start,
    Started,
    Submit,
)
from mlwe.core.spec import NodeStatus, QueueSpec, ReplicaResources, WorkloadSpec

#: What an agent (rules or LLM) may propose.
AGENT_ACTION_KINDS: tuple[str, ...] = (
    "preempt",
    "evict",
    "cancel",
    "retry",
    "set-priority",
    "set-resources",
    "set-node-status",
    "set-queue",
    "submit",
)


class ActionError(ValueError):
    """An action description that cannot be turned into a typed action."""


def action_to_dict(a: Action) -> dict[str, Any]:
    """A JSON-able description of any action (``kind`` plus its fields)."""
    out: dict[str, Any] = {"kind": a.kind}
    if isinstance(a, Submit):
        out["spec"] = a.spec.model_dump(mode="json", exclude_defaults=True)
    elif isinstance(a, Place):
        out["workload"] = a.workload
        out["nodes"] = [r.node for r in a.replicas]
    elif isinstance(a, Preempt):
        out.update(victim=a.victim, preemptor=a.preemptor, reason=str(a.reason))
    elif isinstance(a, AddNode):
        out["spec"] = a.spec.model_dump(mode="json", exclude_defaults=True)
    elif isinstance(a, SetNodeStatus):
        out.update(node=a.node, status=str(a.status), reason=a.reason)
    elif isinstance(a, SetQueue):
        out["spec"] = a.spec.model_dump(mode="json", exclude_defaults=True)
    elif isinstance(a, SetPriority):
        out.update(workload=a.workload, priority=a.priority, reason=a.reason)
    elif isinstance(a, SetResources):
        out.update(
            workload=a.workload,
            resources=a.resources.model_dump(mode="json"),
            reason=a.reason,
        )
    elif isinstance(a, Evict | Cancel):
        out.update(workload=a.workload, reason=a.reason)
    elif isinstance(a, Exited):
        out.update(workload=a.workload, attempt=a.attempt, exit_code=a.exit_code, cause=a.cause)
    elif isinstance(a, Progress):
        out.update(workload=a.workload, attempt=a.attempt, progress=a.progress)
    elif isinstance(a, Start | Started | Released):
        out.update(workload=a.workload, attempt=a.attempt)
    elif isinstance(a, Retry):
        out["workload"] = a.workload
    return out


def _str(d: Mapping[str, Any], key: str, *, required: bool = True, default: str = "") -> str:
    v = d.get(key, None if required else default)
    if v is None:
        raise ActionError(f"{d.get('kind')}: missing field {key!r}")
    if not isinstance(v, str):
        raise ActionError(f"{d.get('kind')}: field {key!r} must be a string, got {v!r}")
    if len(v) > 1000:
        raise ActionError(f"{d.get('kind')}: field {key!r} is longer than 1000 characters")
    return v


def _known(d: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(d) - allowed - {"kind"})
    if extra:
        raise ActionError(f"{d.get('kind')}: unknown field(s) {', '.join(extra)}")


def action_from_dict(d: Any) -> Action:
    """Read an action an agent proposes; raises ActionError naming what is wrong."""
    if not isinstance(d, Mapping):
        raise ActionError(f"an action is an object with a 'kind', got {type(d).__name__}")
    kind = d.get("kind")
    if kind not in AGENT_ACTION_KINDS:
        raise ActionError(
            f"action kind {kind!r} is not one an agent may propose;"
            f" allowed: {', '.join(AGENT_ACTION_KINDS)}"
        )
    try:
        if kind == "preempt":
            _known(d, {"victim", "preemptor", "reason"})
            reason = _str(d, "reason", required=False, default="priority")
            try:
                why = PreemptReason(reason)
            except ValueError:
                raise ActionError(f"preempt: unknown reason {reason!r} (priority or reclaim)") from None
            return Preempt(_str(d, "victim"), _str(d, "preemptor"), why)
        if kind == "evict":
            _known(d, {"workload", "reason"})
            return Evict(_str(d, "workload"), _str(d, "reason", required=False))
        if kind == "cancel":
            _known(d, {"workload", "reason"})
            return Cancel(_str(d, "workload"), _str(d, "reason", required=False) or "cancelled by agent")
        if kind == "retry":
            _known(d, {"workload"})
            return Retry(_str(d, "workload"))
        if kind == "set-priority":
            _known(d, {"workload", "priority", "reason"})
            p = d.get("priority")
            if isinstance(p, bool) or not isinstance(p, int):
                raise ActionError(f"set-priority: priority must be an integer, got {p!r}")
            return SetPriority(_str(d, "workload"), p, _str(d, "reason", required=False))
        if kind == "set-resources":
            _known(d, {"workload", "resources", "reason"})
            res = ReplicaResources.model_validate(d.get("resources"))
            return SetResources(_str(d, "workload"), res, _str(d, "reason", required=False))
        if kind == "set-node-status":
            _known(d, {"node", "status", "reason"})
            st = _str(d, "status")
            try:
                status = NodeStatus(st)
            except ValueError:
                raise ActionError(
                    f"set-node-status: unknown status {st!r} ({', '.join(NodeStatus)})"
                ) from None
            return SetNodeStatus(_str(d, "node"), status, _str(d, "reason", required=False))
        if kind == "set-queue":
            _known(d, {"spec"})
            return SetQueue(QueueSpec.model_validate(d.get("spec")))
        _known(d, {"spec"})
        return Submit(WorkloadSpec.model_validate(d.get("spec")))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
        )
        raise ActionError(f"{kind}: {problems}") from None
