"""Requests: everything from outside that asks the engine to change state.

Every entry point (HTTP submit, one or many; the CLI; bus ingress; agent and
workflow proposals; operator and configuration actions; audit notes) builds a
:class:`Request` and hands it to :meth:`mlwe.runtime.engine.Engine.request`.
There it meets the same checks, in the same order, whatever door it came in by:

1. :func:`screen`: what the control plane cannot judge, because it is about
   what may be *stored*: a credential anywhere in a spec (identity fields
   included: a workload id shaped like a token is refused, not stored
   altered), a number that is not finite or that no column could hold, a
   correlation id that is not an id;
2. the control plane's own verification (``ControlPlane.apply``);
3. durability: the request is acknowledged only once the store has it; if the
   store cannot take it, it is rolled back in memory too, so an error answer
   means nothing was kept.

and it leaves one audit record of one shape (:func:`audit_payload`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from mlwe.core.actions import (
    Action,
    AddNode,
    Cancel,
    Evict,
    Exited,
    SetNodeStatus,
    SetPriority,
    SetQueue,
    Submit,
)
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.controlplane import ApplyResult, ControlPlane, Rejection, could_hold
from mlwe.core.reads import ClusterReads
from mlwe.core.reconcile import correlation_of
from mlwe.core.spec import NodeSpec, NodeStatus, QueueSpec, WorkloadSpec
from mlwe.store.sanitize import find_secrets

#: A correlation id is an id: letters, digits, ``._:-``, matched in full.
CORRELATION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
#: Integers a request may carry (exact in a double, in every column and on every stream).
MAX_INT = 2**53


@dataclass(frozen=True)
class Request:
    """One request: its actions are applied all-or-nothing and audited as one record.

    ``kind`` files the audit record (``request`` for submissions, ``operator``,
    ``config``, ``proposal``); ``action`` names what was asked (``submit``,
    ``cancel``, ``propose``...); ``detail`` adds what the audit should say about it.
    """

    kind: str
    action: str
    actions: tuple[Action, ...]
    actor: str
    correlation_id: str | None = None
    expected_version: int | None = None
    event_id: str | None = None
    workload: str | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    rationale: str | None = None
    #: submissions that the control plane refuses leave only its decision record
    #: (nothing of them is stored); other refused requests are audited with reasons
    audit_refused: bool = True
    #: called in the transaction that makes an accepted request durable, with its
    #: result (e.g. keeping the answer to an Idempotency-Key with the effect)
    on_durable: Callable[[Any, ApplyResult], None] | None = field(default=None, compare=False)


class StoreRefused(RuntimeError):
    """The store could not take a request (its database is unreachable): nothing was kept."""


def screen(req: Request, catalog: GpuCatalog = DEFAULT_CATALOG) -> list[Rejection]:
    """What the engine refuses before the control plane sees it (module docstring).

    Specs are validated again here, whatever door they came in by: one built in
    code with ``model_construct`` (no validation) is held to the same rules
    as one parsed from a request body."""
    out: list[Rejection] = []
    cid = req.correlation_id
    if cid is not None and (not isinstance(cid, str) or not CORRELATION_ID.fullmatch(cid)):
        out.append(
            Rejection(-1, "request", "correlation_id", (
                "correlation id must be 1-128 letters, digits, '.', '_', ':' or '-',"
                " starting with a letter or digit",
            ))
        )
    elif cid is not None and find_secrets(cid):
        out.append(Rejection(-1, "request", "correlation_id",
                             (f"the correlation id looks like a credential: {_CREDENTIAL}",)))
    notes = _number_problems(dict(req.detail))
    if notes:
        out.append(Rejection(-1, "request", "payload", tuple(notes)))
    for i, a in enumerate(req.actions):
        reasons = _spec_problems(a, catalog)
        reasons += _number_problems(a) if not reasons else []
        reasons += _credential_problems(a) if not reasons else []
        if reasons:
            out.append(Rejection(i, getattr(a, "kind", type(a).__name__), _subject(a),
                                 tuple(reasons)))
    return out


_CREDENTIAL = (
    "credentials are never stored (an id or name shaped like a token is refused, not stored"
    " altered); give secrets to the node's daemon environment"
)


def _spec_problems(a: Action, catalog: GpuCatalog) -> list[str]:
    spec = getattr(a, "spec", None) if isinstance(a, Submit | SetQueue | AddNode) else None
    if not isinstance(spec, BaseModel):
        return []  # the control plane rejects it as not validated
    try:
        type(spec).model_validate(spec.model_dump(mode="json"), context={"catalog": catalog})
    except ValidationError as exc:
        return [
            f"{'.'.join(str(p) for p in e['loc']) or 'spec'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        ]
    except (ValueError, TypeError, OverflowError) as exc:
        return [f"spec: {exc}"]
    return []


def _credential_problems(a: Action) -> list[str]:
    if isinstance(a, Submit):
        doc: Any = a.spec
    elif isinstance(a, SetQueue | AddNode):
        doc = a.spec
    else:
        return []
    if not isinstance(doc, BaseModel):
        return []  # the control plane rejects it as not validated
    paths = [_field(p) for p in find_secrets(doc.model_dump(mode="json"))]
    if not paths:
        return []
    what = paths[0] if len(paths) == 1 else ", ".join(paths[:-1]) + " and " + paths[-1]
    return [f"{what} {'looks' if len(paths) == 1 else 'look'} like a credential: {_CREDENTIAL}"]


def _field(path: str) -> str:
    if path.startswith("env."):
        return f"env {path[4:]}"
    return path or "the spec"


def _number_problems(obj: Any, path: str = "", depth: int = 0) -> list[str]:
    """Non-finite floats and integers past :data:`MAX_INT` anywhere in an action."""
    if depth > 8:
        return []
    if isinstance(obj, bool) or obj is None or isinstance(obj, str | enum.Enum):
        return []
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [f"{path or 'value'} must be a finite number"]
    if isinstance(obj, int):
        return [] if -MAX_INT <= obj <= MAX_INT else [f"{path or 'value'} is out of range"]
    if isinstance(obj, BaseModel):
        return []  # specs are validated again (_spec_problems), with their own bounds
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: list[str] = []
        for f in dataclasses.fields(obj):
            out += _number_problems(getattr(obj, f.name), f.name if not path else
                                    f"{path}.{f.name}", depth + 1)
        return out
    if isinstance(obj, Mapping):
        out = []
        for k, v in obj.items():
            out += _number_problems(v, f"{path}.{k}" if path else str(k), depth + 1)
        return out
    if isinstance(obj, Sequence):
        out = []
        for i, v in enumerate(obj):
            out += _number_problems(v, f"{path}[{i}]", depth + 1)
        return out
    return []


def _subject(a: object) -> str:
    for name in ("workload", "victim", "node"):
        v = getattr(a, name, None)
        if isinstance(v, str):
            return v
    spec = getattr(a, "spec", None)
    for name in ("id", "name"):
        v = getattr(spec, name, None)
        if isinstance(v, str):
            return v
    return "-"


def describe_action(a: Action) -> dict[str, Any]:
    """An action as the audit shows it (plain JSON)."""
    out: dict[str, Any] = {"action": type(a).__name__}
    if not dataclasses.is_dataclass(a):
        out["value"] = repr(a)[:500]
        return out
    for f in dataclasses.fields(a):
        value = getattr(a, f.name)
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        elif isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, tuple):
            value = [str(v) for v in value]
        elif (isinstance(value, float) and not math.isfinite(value)) or not isinstance(value, int | float | str | bool | type(None) | dict | list):
            value = str(value)
        out[f.name] = value
    return out


def audit_payload(req: Request, result: ApplyResult) -> dict[str, Any]:
    """The one shape of a request's audit record (a note's payload is its own)."""
    if req.action == "note":
        return dict(req.detail)
    payload: dict[str, Any] = {
        "action": req.action,
        "accepted": result.accepted,
        "reasons": result.reasons(),
    }
    if result.created:
        payload["workloads"] = list(result.created)
    if req.kind == "proposal" or req.action == "propose":
        payload["actions"] = [describe_action(a) for a in req.actions]
        payload["expected_version"] = req.expected_version
        payload["rationale"] = req.rationale
    if req.event_id is not None:
        payload["event_id"] = req.event_id
    payload.update(req.detail)
    return payload


def submit_request(
    specs: Sequence[WorkloadSpec],
    actor: str,
    correlation_id: str | None = None,
    on_durable: Callable[[Any, ApplyResult], None] | None = None,
) -> Request:
    """The request of a submission (what every door that submits builds)."""
    return Request("request", "submit", tuple(Submit(s) for s in specs), actor, correlation_id,
                   audit_refused=False, on_durable=on_durable)


# ============================================================= the builders
# What each door asks for, as a Request (the engine's methods of the same names
# build them with these; a door may build its own with the same result).
def operator_request(
    actions: Sequence[Action],
    *,
    kind: str,
    actor: str,
    what: Mapping[str, Any],
    workload: str | None = None,
    correlation_id: str | None = None,
) -> Request:
    """An operator's or an administrator's request; ``what["action"]`` names it."""
    action = str(what.get("action", kind))
    detail = {k: v for k, v in what.items() if k != "action"}
    return Request(kind, action, tuple(actions), actor, correlation_id, workload=workload,
                   detail=detail)


def cancel_request(cp: ControlPlane, workload_id: str, actor: str,
                   correlation_id: str | None = None) -> Request:
    w = cp.workloads.get(workload_id)
    cid = correlation_id or (correlation_of(w) if w is not None else None)
    return operator_request([Cancel(workload_id)], kind="operator", actor=actor,
                            what={"action": "cancel", "workload": workload_id},
                            workload=workload_id, correlation_id=cid)


def priority_request(cp: ControlPlane, workload_id: str, priority: int, actor: str,
                     reason: str = "") -> Request:
    w = cp.workloads.get(workload_id)
    return operator_request(
        [SetPriority(workload_id, priority, reason or f"set by {actor}")],
        kind="operator", actor=actor,
        what={"action": "set-priority", "workload": workload_id, "priority": priority},
        workload=workload_id, correlation_id=correlation_of(w) if w is not None else None)


def node_status_request(cp: ControlPlane, node: str, status: NodeStatus, reason: str,
                        actor: str) -> Request:
    """Cordon, uncordon, or mark down (with the ``Exited`` of what the node holds)."""
    actions: list[Action] = [SetNodeStatus(node, status, reason or f"set by {actor}")]
    if status is NodeStatus.DOWN and node in cp.capacity:
        actions += [Exited(h.id, h.attempt, -1, "node-lost") for h in cp.holders(node)]
    return operator_request(
        actions, kind="operator", actor=actor,
        what={"action": "node-status", "node": node, "status": status.value, "reason": reason})


def requeue_request(workload_id: str, actor: str, reason: str = "") -> Request:
    return operator_request([Evict(workload_id, reason or f"requeued by {actor}")],
                            kind="operator", actor=actor,
                            what={"action": "requeue", "workload": workload_id,
                                  "reason": reason},
                            workload=workload_id)


def queue_request(spec: QueueSpec, actor: str) -> Request:
    return operator_request([SetQueue(spec)], kind="config", actor=actor,
                            what={"action": "set-queue", "queue": spec.model_dump(mode="json")})


def node_request(spec: NodeSpec, actor: str) -> Request:
    return operator_request([AddNode(spec)], kind="config", actor=actor,
                            what={"action": "add-node", "node": spec.model_dump(mode="json")})


def proposal_request(actions: Sequence[Action], actor: str, *,
                     expected_version: int | None = None, correlation_id: str | None = None,
                     rationale: str | None = None) -> Request:
    """An agent's (or any automation's) proposal; filed under the one workload it
    touches, if it touches one."""
    workloads = sorted(
        {a for x in actions for a in [getattr(x, "workload", None)] if isinstance(a, str)})
    return Request("proposal", "propose", tuple(actions), actor, correlation_id,
                   expected_version=expected_version, rationale=rationale,
                   workload=workloads[0] if len(workloads) == 1 else None)


def event_request(event_id: str, actions: Sequence[Action], actor: str,
                  correlation_id: str | None = None,
                  what: Mapping[str, Any] | None = None) -> Request:
    """A bus event's request: applied once per ``event_id``; refused ones are not audited
    (the event is answered with the reasons instead)."""
    detail = dict(what or {})
    action = str(detail.pop("action", "submit" if any(
        isinstance(a, Submit) for a in actions) else "request"))
    return Request("request", action, tuple(actions), actor, correlation_id,
                   event_id=event_id, detail=detail, audit_refused=False)


def note_request(kind: str, actor: str, payload: Mapping[str, Any], *,
                 workload: str | None = None, correlation_id: str | None = None) -> Request:
    """An audit record of something done outside the control plane (no actions)."""
    return Request(kind, "note", (), actor, correlation_id, workload=workload, detail=payload)


def inadmissible(cp: ClusterReads, spec: WorkloadSpec, now: float) -> list[str]:
    """Why ``spec`` could never run on this cluster (empty: it may, some day).

    Conservative (Kueue's *Inadmissible*, as opposed to waiting for capacity): a
    deadline already past; no node that could ever hold one replica; more
    replicas than every compatible node together could hold if empty (an upper
    bound per node, so nothing that could run is refused); a request larger than
    its queue's nominal quota plus what it may borrow.
    """
    out: list[str] = []
    if spec.deadline is not None and spec.deadline <= now:
        out.append(f"inadmissible: the deadline ({spec.deadline:.0f}) has already passed"
                   f" (the engine clock is at {now:.0f})")
    r = spec.resources
    room = 0
    for info in cp.capacity.nodes():
        cap = info.capacity
        if not could_hold(info, spec):
            continue
        if any(info.labels.get(k) != v for k, v in spec.node_selector.items()):
            continue
        fits = [cap.cpu // r.cpu if r.cpu else spec.replicas,
                cap.ram // r.memory if r.memory else spec.replicas]
        if r.gpu:
            fits.append(cap.gpu // r.gpu)
        n = min(fits)
        g = spec.gang  # a shaped gang: a node holds whole groups of tasks_per_node, or a capped few
        if g is not None and g.tasks_per_node:
            n -= n % g.tasks_per_node
        elif g is not None and g.max_replicas_per_node:
            n = min(n, g.max_replicas_per_node)
        room += n
        if room >= spec.replicas:
            break
    if room == 0:
        out.append(
            f"inadmissible: no node of the cluster can ever hold one replica ({r.gpu / 1000:g}"
            f" GPU, {r.cpu / 1000:g} cpu, {r.memory} MiB memory"
            + (f", models {', '.join(spec.gpu_models)}" if spec.gpu_models else "")
            + (f", node selector {spec.node_selector}" if spec.node_selector else "") + ")"
        )
    elif room < spec.replicas:
        out.append(f"inadmissible: {spec.replicas} replicas, but every compatible node together"
                   f" could hold at most {room}")
    q = cp.queues.get(spec.queue)
    if q is not None:
        need = spec.replica_request() * spec.replicas
        limit = q.nominal + q.borrow_limit
        over = [n for n, a, c in zip(("gpu", "vram", "cpu", "memory"), need.as_tuple(),
                                     limit.as_tuple()) if a > c]
        if over:
            out.append(f"inadmissible: asks more {', '.join(over)} than queue {q.name!r} may"
                       " ever use (its nominal quota plus what it may borrow)")
    return out
