"""Cluster routes: the dashboard snapshot, nodes (cordon, uncordon, drain), queues and
quotas, scheduling decisions, stored telemetry and reasoning."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path, Query
from pydantic import ValidationError

from mlwe.api import views
from mlwe.api.auth import Principal, Role, requires
from mlwe.api.context import API_PREFIX, ApiContext, get_ctx
from mlwe.api.errors import ApiError
from mlwe.api.models import (
    ActionResult,
    ClusterOut,
    DecisionList,
    ErrorBody,
    HistoryOut,
    NodeAction,
    NodeList,
    NodeOut,
    QueueList,
    QueueOut,
    StreamEventList,
)
from mlwe.core.spec import NodeStatus, QueueSpec
from mlwe.store.sanitize import sanitize

router = APIRouter(prefix=API_PREFIX, tags=["cluster"])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
NodeName = Annotated[str, Path(min_length=1, max_length=128)]
_404: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody, "description": "no such node"}}


@router.get("/cluster", response_model=ClusterOut, summary="Snapshot for the dashboard")
def cluster(ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    eng = ctx.engine
    with eng.lock:
        return views.cluster_view(eng.reads, getattr(eng.backend, "name", "backend"))


@router.get("/nodes", response_model=NodeList, summary="Nodes with capacity, free resources and GPUs")
def nodes(ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    eng = ctx.engine
    with eng.lock:
        return {"items": [views.node_view(eng.reads, n) for n in eng.reads.capacity.node_names()]}


@router.get("/nodes/{node}", response_model=NodeOut, responses=_404, summary="One node")
def node(node: NodeName, ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    eng = ctx.engine
    with eng.lock:
        if node not in eng.reads.capacity:
            raise ApiError(404, f"unknown node {node!r}")
        return views.node_view(eng.reads, node)


def _node_action(ctx: ApiContext, node: str, what: str, principal: Principal, reason: str) -> dict[str, Any]:
    eng = ctx.engine
    with eng.lock:
        if node not in eng.reads.capacity:
            raise ApiError(404, f"unknown node {node!r}")
        status = eng.reads.capacity.status(node)
    if what == "uncordon" and status is NodeStatus.DOWN:
        raise ApiError(409, f"node {node} is down; it comes back when its backend reports it up")
    why = reason or f"{what} by {principal.name}"
    if what == "cordon":
        result = eng.set_node_status(node, NodeStatus.CORDONED, why, actor=principal.actor)
    elif what == "uncordon":
        result = eng.set_node_status(node, NodeStatus.READY, why, actor=principal.actor)
    else:
        result = eng.drain(node, actor=principal.actor, reason=why)
    if not result.accepted:
        raise ApiError(409, f"cannot {what} {node}", [("", r) for r in result.reasons()])
    if what == "uncordon":
        # capacity came back without any lifecycle transition, which is what usually
        # tells the reconciler a scheduling cycle is worth running: ask for one
        with eng.lock:
            eng.reconciler.dirty = True
        eng.wake()
    return {"accepted": True, "version": result.version, "message": f"node {node}: {what}", "rejections": []}


_409: dict[int | str, dict[str, Any]] = {**_404, 409: {"model": ErrorBody, "description": "refused in the node's current state"}}


@router.post("/nodes/{node}/cordon", response_model=ActionResult, responses=_409, summary="Take nothing new")
def cordon(
    node: NodeName,
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.OPERATOR)],
    body: Annotated[NodeAction | None, Body()] = None,
) -> dict[str, Any]:
    return _node_action(ctx, node, "cordon", principal, body.reason if body else "")


@router.post("/nodes/{node}/uncordon", response_model=ActionResult, responses=_409, summary="Schedulable again")
def uncordon(
    node: NodeName,
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.OPERATOR)],
    body: Annotated[NodeAction | None, Body()] = None,
) -> dict[str, Any]:
    return _node_action(ctx, node, "uncordon", principal, body.reason if body else "")


@router.post(
    "/nodes/{node}/drain",
    response_model=ActionResult,
    responses=_409,
    summary="Cordon, then checkpoint and requeue everything running there",
)
def drain(
    node: NodeName,
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.OPERATOR)],
    body: Annotated[NodeAction | None, Body()] = None,
) -> dict[str, Any]:
    return _node_action(ctx, node, "drain", principal, body.reason if body else "")


@router.get("/queues", response_model=QueueList, summary="Queues with quotas and usage")
def queues(ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    eng = ctx.engine
    with eng.lock:
        return {"items": views.queue_views(eng.reads)}


@router.put(
    "/queues/{queue}",
    response_model=QueueOut,
    summary="Create a queue or change its quota (admin)",
    responses={409: {"model": ErrorBody, "description": "refused by the control plane"}},
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "a QueueSpec; its name, if given, is the path's",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/QueueSpecBody"}}},
        }
    },
)
def put_queue(
    queue: Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="queue name")],
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.ADMIN)],
    body: Annotated[dict[str, Any], Body(description="a QueueSpec; its name defaults to the path's")],
) -> dict[str, Any]:
    data = {**body}
    if data.setdefault("name", queue) != queue:
        raise ApiError(422, "invalid queue spec", [("name", f"does not match the path ({queue!r})")])
    eng = ctx.engine
    try:
        spec = QueueSpec.model_validate(data, context={"catalog": eng.reads.catalog})
    except ValidationError as exc:
        raise ApiError(
            422,
            "invalid queue spec",
            [
                (".".join(str(p) for p in e["loc"]), str(e["msg"]).removeprefix("Value error, "))
                for e in exc.errors()
            ],
        ) from None
    result = eng.set_queue(spec, actor=principal.actor)
    if not result.accepted:
        raise ApiError(409, f"cannot set queue {queue}", [("", r) for r in result.reasons()])
    with eng.lock:
        return next(q for q in views.queue_views(eng.reads) if q["name"] == queue)


@router.get(
    "/decisions",
    response_model=DecisionList,
    summary="Scheduling decisions (why placed, preempted, not placed, rejected)",
)
def decisions(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    workload: Annotated[str | None, Query(max_length=128)] = None,
    cause_id: Annotated[str | None, Query(max_length=256)] = None,
    kind: Annotated[str | None, Query(max_length=32, description="place, preempt, unschedulable, reject, ...")] = None,
    after_seq: Annotated[int | None, Query(ge=0, le=2**62, description="decisions after this one (a cursor)")] = None,
    limit: Annotated[int, Query(ge=1, le=2000)] = 200,
) -> dict[str, Any]:
    eng = ctx.engine
    if workload is None and cause_id is None:
        with eng.lock:
            recs = list(eng.recent_decisions)
    else:
        recs = eng.repo.decisions_for(workload, cause_id)
    if kind is not None:
        recs = [r for r in recs if r.kind == kind]
    if after_seq is not None:  # the oldest ``limit`` after the cursor
        recs = [r for r in recs if r.seq > after_seq][:limit]
    else:  # the latest ``limit``
        recs = recs[-limit:]
    nxt = recs[-1].seq if recs else after_seq
    return {"items": [views.decision(r) for r in recs], "next_after_seq": nxt}


@router.get("/history", response_model=HistoryOut, summary="The cluster over time (stored samples, oldest first)")
def history(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    since: Annotated[float | None, Query(ge=0, le=1e12, description="points after this engine time")] = None,
    limit: Annotated[int, Query(ge=1, le=5000)] = 720,
) -> dict[str, Any]:
    from mlwe.api.history import series
    from mlwe.api.sse import finite

    pts = series(ctx.engine, None if since is None else since + 1e-6, limit)
    items = [{**p, "at": views.rfc3339(p["time"]), "metrics": finite(p["metrics"])} for p in pts]
    return {"items": items, "next_since": items[-1]["time"] if items else since}


@router.get("/telemetry", response_model=StreamEventList, summary="Stored telemetry samples")
def telemetry(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    node: Annotated[str | None, Query(max_length=128)] = None,
    workload: Annotated[str | None, Query(max_length=128)] = None,
    since: Annotated[float | None, Query(ge=0, le=1e12)] = None,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> dict[str, Any]:
    samples = ctx.engine.repo.telemetry(node=node, workload=workload, since=since)
    samples = samples[-limit:]
    from mlwe.api.sse import finite

    return {
        "last_id": 0,
        "items": [
            {
                "id": 0,
                "topic": "telemetry",
                "time": s.time,
                "correlation_id": None,
                "workload": s.workload,
                "data": finite(sanitize({"node": s.node, "workload": s.workload, "metrics": dict(s.metrics),
                                          "resolution_s": s.resolution_s})),
            }
            for s in samples
        ],
    }


@router.get(
    "/reasoning",
    response_model=StreamEventList,
    summary="Reasoning traces: the agent's (stored) and the scheduler's preemptions, latest last",
)
def reasoning(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    correlation_id: Annotated[str | None, Query(max_length=256)] = None,
    after_id: Annotated[int | None, Query(ge=0, le=2**62, description="stored traces after this id")] = None,
    limit: Annotated[int, Query(ge=1, le=2000)] = 200,
    scheduler: Annotated[bool, Query(description="include the scheduler's preemption traces")] = True,
) -> dict[str, Any]:
    from mlwe.api.relay import trace_of_decision
    from mlwe.api.sse import finite

    eng = ctx.engine
    entries = (
        eng.repo.reasoning(correlation_id, after_id=after_id, limit=limit)
        if after_id is not None
        else eng.repo.latest_reasoning(correlation_id, limit=limit)
    )
    rows = [(e.id, e.time, e.correlation_id, e.record) for e in entries]
    items = [
        {
            "id": i,
            "topic": "reasoning",
            "time": t,
            "correlation_id": c,
            "workload": rec.get("workload") if isinstance(rec.get("workload"), str) else None,
            "data": finite(sanitize(rec)),
        }
        for i, t, c, rec in rows
    ]
    if scheduler and after_id is None:
        decisions = [
            d for d in (eng.repo.decisions_for(None, correlation_id) if correlation_id else list(eng.recent_decisions))
            if d.kind == "preempt"
        ][-limit:]
        for d in decisions:
            trace = trace_of_decision(d.to_dict())
            if trace is not None:
                items.append({"id": 0, "topic": "reasoning", "time": d.time, "correlation_id": d.cause_id,
                              "workload": d.workload, "data": finite(sanitize(trace))})
        items.sort(key=lambda x: x["time"])
        items = items[-limit:]
    return {"last_id": rows[-1][0] if rows else (after_id or 0), "items": items}
