"""Workload routes: submit, validate, list, describe, explain, cancel."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Request
from fastapi.responses import JSONResponse

from mlwe.api import views
from mlwe.api.auth import (
    CORRELATION_MAX,
    Principal,
    Role,
    check_correlation_id,
    policy_denials,
    requires,
    scoped_correlation_id,
)
from mlwe.api.context import API_PREFIX, ApiContext, get_ctx
from mlwe.api.errors import ApiError, explain_pattern, unknown_items
from mlwe.api.models import (
    ActionResult,
    ErrorBody,
    Explanation,
    SubmitResult,
    ValidateResult,
    WorkloadDetail,
    WorkloadList,
    list_pattern,
)
from mlwe.api.specs import BodyError, parse_specs
from mlwe.core.lifecycle import State
from mlwe.core.spec import WorkloadSpec
from mlwe.runtime.engine import new_correlation_id
from mlwe.runtime.requests import StoreRefused

router = APIRouter(prefix=API_PREFIX, tags=["workloads"])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
#: Header values the server accepts (also declared in the OpenAPI schema).
#: a client's X-Correlation-ID: the id rule (':' too), short enough to take the subject's prefix
CORRELATION_ID_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._:-]{{0,{CORRELATION_MAX - 1}}}$"
IDEMPOTENCY_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+/=-]{0,254}$"
WorkloadId = Annotated[str, Path(min_length=1, max_length=128, description="workload id")]

_SPEC_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "a workload spec, a list of specs, or {workloads: [...]}, as JSON or YAML",
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [
                        {"$ref": "#/components/schemas/WorkloadSpec"},
                        {"type": "array", "items": {"$ref": "#/components/schemas/WorkloadSpec"}},
                        {
                            "type": "object",
                            "properties": {
                                "workloads": {
                                    "type": "array",
                                    "items": {"$ref": "#/components/schemas/WorkloadSpec"},
                                }
                            },
                            "required": ["workloads"],
                            "additionalProperties": False,
                        },
                    ]
                }
            },
            "application/yaml": {"schema": {"type": "string"}},
        },
    }
}


def _not_found(wid: str) -> ApiError:
    return ApiError(404, f"unknown workload {wid!r}")


async def _specs(request: Request, ctx: ApiContext) -> list[WorkloadSpec]:
    body = await request.body()
    try:
        specs = parse_specs(body, request.headers.get("content-type"), ctx.engine.reads.catalog)
    except BodyError as exc:
        raise ApiError(exc.status, "invalid workload spec", exc.errors) from None
    limit = ctx.settings.max_workloads_per_request
    if len(specs) > limit:
        raise ApiError(413, f"{len(specs)} workloads in one request; the limit is {limit}")
    reserved = [
        (f"[{i}].labels.{k}", f"labels under {views.RESERVED_LABEL_PREFIX!r} are set by the engine")
        for i, s in enumerate(specs)
        for k in s.labels
        if k.startswith(views.RESERVED_LABEL_PREFIX)
    ]
    if reserved:
        raise ApiError(422, "invalid workload spec", reserved)
    return specs


@router.post(
    "/workloads",
    status_code=201,
    response_model=SubmitResult,
    summary="Submit workloads (JSON or YAML)",
    openapi_extra=_SPEC_BODY,
    responses={
        403: {
            "model": ErrorBody,
            "description": "the token's role, or its policy (queues, highest priority, protected),"
            " does not allow it; each error names the field (nothing stored)",
        },
        409: {"model": ErrorBody, "description": "refused by the control plane (nothing stored)"},
        415: {"model": ErrorBody, "description": "body is neither JSON nor YAML"},
        429: {"model": ErrorBody, "description": "submission rate limit; see Retry-After"},
        503: {"model": ErrorBody, "description": "the store is unavailable; nothing was acknowledged"},
    },
)
async def submit(
    request: Request,
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.SUBMITTER)],
    x_correlation_id: Annotated[
        str | None,
        Header(
            max_length=CORRELATION_MAX,
            pattern=CORRELATION_ID_PATTERN,
            description="your id for this request; it is filed under your token's subject"
            " (the answer's correlation_id is <subject>.<your id>)",
        ),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key", min_length=1, max_length=255, pattern=IDEMPOTENCY_KEY_PATTERN,
            description="a retry with the same key (and body) returns the first answer and"
            " submits nothing again",
        ),
    ] = None,
) -> Any:
    """Validate and submit; answers once the workloads are durable."""
    if x_correlation_id is not None and (why := check_correlation_id(x_correlation_id)):
        raise ApiError(422, "invalid request", [("header.X-Correlation-ID", why)])
    key = body_hash = None
    if idempotency_key is not None:
        body = await request.body()
        key = f"{principal.token_id}:{idempotency_key}"
        body_hash = hashlib.sha256(
            request.headers.get("content-type", "").encode() + b"\0" + body
        ).hexdigest()
        replay = _idempotent_replay(ctx, key, body_hash)
        if replay is not None:
            return replay
    specs = await _specs(request, ctx)
    _admit(ctx, principal, specs)
    owner = {views.OWNER_LABEL: principal.name, views.OWNER_SUBJECT_LABEL: principal.subject}
    owned = [s.model_copy(update={"labels": {**s.labels, **owner}}) for s in specs]
    cid = scoped_correlation_id(principal, x_correlation_id) if x_correlation_id else new_correlation_id()
    on_durable = None
    if key is not None and body_hash is not None:
        if not ctx.idempotency.claim(key):
            raise ApiError(409, "a request with this Idempotency-Key is in progress; retry",
                           headers={"Retry-After": "1"})
        repo, now, k, h = ctx.engine.repo, ctx.engine.clock.now(), key, body_hash

        def on_durable(conn: Any, res: Any) -> None:
            repo.remember_answer(conn, k, h, 201, json.dumps(_answer(res, cid)), now)

    try:
        result = await ctx.submitter.submit(owned, principal.actor, cid, on_durable)
    except StoreRefused as exc:  # the store is unreachable: nothing was kept
        raise ApiError(
            503, f"nothing was stored: {exc}; retry later (with the same Idempotency-Key)",
            headers={"Retry-After": "5"},
        ) from None
    finally:
        if key is not None:
            ctx.idempotency.release(key)
    if not result.accepted:
        raise ApiError(
            409 if not any(_inadmissible(r.reasons) for r in result.rejections) else 422,
            "the submission was refused; nothing was stored",
            [(f"[{r.index}]" if r.index >= 0 else "", f"{r.subject}: " + "; ".join(r.reasons))
             for r in result.rejections],
        )
    return _answer(result, cid)


def _admit(ctx: ApiContext, principal: Principal, specs: list[WorkloadSpec]) -> None:
    """403 when the token's policy does not allow the specs, 429 when its rate is spent."""
    denied = policy_denials(principal, specs)
    if denied:
        raise ApiError(
            403, f"token {principal.name!r} is not allowed to submit this; nothing was stored", denied
        )
    wait = ctx.limiter.take(principal.token_id, len(specs))
    if wait:
        retry = "3600" if math.isinf(wait) else str(max(1, math.ceil(wait)))
        raise ApiError(
            429,
            f"submission rate limit: {ctx.limiter.rate:g} workloads/s per token"
            f" (bursts of {ctx.limiter.burst:g}); retry in {retry} s",
            headers={"Retry-After": retry},
        )


def _inadmissible(reasons: tuple[str, ...]) -> bool:
    """Refusals of what the request *is* (a credential, an impossible shape), not of the
    cluster's current state (an id already taken)."""
    return any(r.startswith("inadmissible:") or "like a credential" in r
               or "must be a finite number" in r or "out of range" in r for r in reasons)


def _answer(result: Any, cid: str) -> dict[str, Any]:
    return {
        "accepted": True,
        "created": list(result.created),
        "version": result.version,
        "correlation_id": cid,
        "rejections": [],
    }


def _idempotent_replay(ctx: ApiContext, key: str, body_hash: str) -> JSONResponse | None:
    """The first answer to ``key``, if there was one (the same body: or a 422)."""
    try:
        found = ctx.engine.repo.idempotent_answer(key)
    except Exception as exc:
        raise ApiError(503, f"the store is unavailable: {exc}", headers={"Retry-After": "5"}) from None
    if found is None:
        return None
    stored_hash, status, response = found
    if stored_hash != body_hash:
        raise ApiError(
            422,
            "Idempotency-Key was already used with a different request; use a new key",
            [("header.Idempotency-Key", "reused with a different body")],
        )
    return JSONResponse(json.loads(response), status_code=status,
                        headers={"Idempotent-Replayed": "true"})


#: validate takes any document and says whether it is valid (so its schema is open);
#: only a missing body is a bad request
_VALIDATE_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "what you would submit (JSON or YAML); the answer lists every problem",
        "content": {
            "application/json": {"schema": {}},
            "application/yaml": {"schema": {}},
        },
    }
}


@router.post(
    "/workloads/validate",
    response_model=ValidateResult,
    summary="Validate workload specs without submitting",
    openapi_extra=_VALIDATE_BODY,
    responses={415: {"model": ErrorBody, "description": "body is neither JSON nor YAML"}},
)
async def validate(
    request: Request,
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.SUBMITTER)],
) -> dict[str, Any]:
    body = await request.body()
    if not body.strip():
        raise ApiError(422, "invalid request", [
            ("body", "empty body: send a workload spec, a list of them, or {workloads: [...]}")
        ])
    try:
        specs = parse_specs(body, request.headers.get("content-type"), ctx.engine.reads.catalog)
    except BodyError as exc:
        if exc.status != 422:
            raise ApiError(exc.status, str(exc)) from None
        return {
            "valid": False,
            "workloads": 0,
            "errors": [{"path": p, "message": m} for p, m in exc.errors],
        }
    return {"valid": True, "workloads": len(specs), "errors": []}


_STATES_PATTERN = explain_pattern(
    list_pattern(s.value for s in State),
    unknown_items("state", [s.value for s in State]),
)


@router.get("/workloads", response_model=WorkloadList, summary="List workloads, newest first")
def list_workloads(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    state: Annotated[
        str | None,
        Query(max_length=200, pattern=_STATES_PATTERN,
              description="comma-separated states, e.g. running,pending"),
    ] = None,
    queue: Annotated[str | None, Query(max_length=128)] = None,
    owner: Annotated[
        str | None, Query(max_length=128, description="token name or subject that submitted")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> dict[str, Any]:
    wanted: set[State] | None = None
    if state:
        try:
            wanted = {State(s.strip()) for s in state.split(",") if s.strip()}
        except ValueError:
            known = ", ".join(s.value for s in State)
            raise ApiError(422, "invalid request", [("query.state", f"unknown state; known: {known}")]) from None
    eng = ctx.engine
    with eng.lock:
        now = eng.reads.now()
        ws = list(eng.reads.workloads.values())
        ws.reverse()  # arrival order, newest first
        if wanted is not None:
            ws = [w for w in ws if w.state in wanted]
        if queue is not None:
            ws = [w for w in ws if w.queue == queue]
        if owner is not None:
            ws = [
                w for w in ws
                if owner in (w.spec.labels.get(views.OWNER_LABEL), views.owner_subject(w))
            ]
        total = len(ws)
        cache: views.AdmissionCache = {}
        items = [views.workload_summary(w, now, eng.reads, cache) for w in ws[offset : offset + limit]]
    nxt = offset + limit if offset + limit < total else None
    return {"total": total, "items": items, "now": now, "next_offset": nxt}


@router.get(
    "/workloads/{workload_id}",
    response_model=WorkloadDetail,
    summary="One workload with its spec, placement and state history",
    responses={404: {"model": ErrorBody, "description": "no such workload"}},
)
def get_workload(
    workload_id: WorkloadId, ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]
) -> dict[str, Any]:
    eng = ctx.engine
    with eng.lock:
        w = eng.reads.workloads.get(workload_id)
        if w is None:
            raise _not_found(workload_id)
        now = eng.reads.now()
        return {**views.workload_detail(w, now, eng.reads), "now": now}


@router.get(
    "/workloads/{workload_id}/explain",
    response_model=Explanation,
    summary="Why is this workload where it is (not placed, preempted, failed)?",
    responses={404: {"model": ErrorBody, "description": "no such workload"}},
)
def explain(
    workload_id: WorkloadId, ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]
) -> dict[str, Any]:
    eng = ctx.engine
    with eng.lock:
        w = eng.reads.workloads.get(workload_id)
        if w is None:
            raise _not_found(workload_id)
        preemptors = {w.preempted_by} if w.preempted_by else set()
        preemptors |= {
            t.reason.removeprefix("preempted by ").split()[0]
            for t in w.history
            if t.target is State.PREEMPTING and t.reason.startswith("preempted by ")
        }
    decisions = eng.repo.decisions_for(workload_id, limit=500)
    # the decisions that evicted it are recorded under the preemptor's id
    for p in sorted(preemptors):
        decisions += [
            d
            for d in eng.repo.decisions_for(p, limit=500)
            if d.kind == "preempt" and workload_id in d.chosen.replace(",", " ").split()
        ]
    decisions.sort(key=lambda d: d.seq)
    with eng.lock:
        return views.explain(eng.reads, w, decisions)


@router.post(
    "/workloads/{workload_id}/cancel",
    response_model=ActionResult,
    summary="Cancel a workload (submitters: their own; operators: any)",
    responses={
        404: {"model": ErrorBody, "description": "no such workload"},
        409: {"model": ErrorBody, "description": "it cannot be cancelled in its state"},
    },
)
def cancel(
    workload_id: WorkloadId, ctx: Ctx, principal: Annotated[Principal, requires(Role.SUBMITTER)]
) -> dict[str, Any]:
    eng = ctx.engine
    with eng.lock:
        w = eng.reads.workloads.get(workload_id)
        if w is None:
            raise _not_found(workload_id)
        owner = views.owner_subject(w)
        owner_name = w.spec.labels.get(views.OWNER_LABEL)
    if not principal.at_least(Role.OPERATOR) and owner != principal.subject:
        who = f"token {owner_name!r} ({owner})" if owner else (
            f"{owner_name!r} before tokens had subjects" if owner_name else "someone else"
        )
        raise ApiError(
            403,
            f"{workload_id} was submitted by {who}; a submitter may cancel only what its own"
            " token submitted (operators may cancel any)",
        )
    result = eng.cancel(workload_id, actor=principal.actor)
    if not result.accepted:
        raise ApiError(
            409, f"cannot cancel {workload_id}", [("", r) for r in result.reasons()]
        )
    return {
        "accepted": True,
        "version": result.version,
        "message": f"{workload_id} cancelled",
        "rejections": [],
    }
