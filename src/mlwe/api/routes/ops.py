"""Operations routes: the agent (mode, approvals), audit (query, verify), events (dead
letters, replay), scenario triggers, API tokens, and who-am-I."""

from __future__ import annotations

import contextlib
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query
from fastapi.concurrency import run_in_threadpool

from mlwe.api.auth import Principal, Role, TokenInfo, TokenPolicy, requires
from mlwe.api.context import API_PREFIX, ApiContext, get_ctx
from mlwe.api.errors import ApiError
from mlwe.api.models import (
    ActionResult,
    AgentModeIn,
    AgentStatus,
    ApprovalDecisionIn,
    ApprovalList,
    AuditList,
    AuditVerifyOut,
    DeadLetterList,
    ErrorBody,
    ScenarioIn,
    ScenarioList,
    ScenarioResult,
    TokenCreated,
    TokenCreateIn,
    TokenList,
    WhoAmI,
)
from mlwe.api.scenarios import SCENARIOS, ScenarioError, audit_note, run_scenario
from mlwe.api.sse import finite
from mlwe.api.views import rfc3339
from mlwe.store.sanitize import sanitize, sanitize_text

router = APIRouter(prefix=API_PREFIX)

Ctx = Annotated[ApiContext, Depends(get_ctx)]
_NOT_AGENT: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorBody, "description": "no agent runs in this engine"}
}


# ===================================================================== agent
# The agent is ``mlwe.agent.loop.Agent``: ``mode``, ``config.mode``, ``pending()`` (plans
# waiting in approve mode, as dicts), ``approve(id, actor=)``, ``reject(id, reason, actor=)``.
def _approval(p: dict[str, Any]) -> dict[str, Any]:
    plan: dict[str, Any] = p["plan"] if isinstance(p.get("plan"), dict) else {}
    finding: dict[str, Any] = p["finding"] if isinstance(p.get("finding"), dict) else {}
    summary = str(plan.get("summary") or "")
    if finding.get("summary"):
        summary = f"{finding['summary']} -> {summary}" if summary else str(finding["summary"])
    out: dict[str, Any] = finite(
        sanitize(
            {
                "id": str(p.get("id", "")),
                "time": float(p.get("created") or 0.0),
                "summary": summary,
                "correlation_id": p.get("correlation_id"),
                "plan": {k: v for k, v in p.items() if k not in ("id", "correlation_id")},
            }
        )
    )
    return out


def _pending(agent: Any) -> list[dict[str, Any]]:
    return [p for p in agent.pending() if isinstance(p, dict)]


def _require_agent(ctx: ApiContext) -> Any:
    if ctx.agent is None:
        raise ApiError(409, "no agent runs in this engine (start it with mlwe serve, without --no-agent)")
    return ctx.agent


@router.get("/agent", response_model=AgentStatus, tags=["agent"], summary="Agent mode and status")
def agent_status(ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    agent = ctx.agent
    if agent is None:
        return {"present": False, "mode": None, "reasoner": None, "pending_approvals": 0, "detail": {}}
    outcomes = [o.to_dict() for o in list(getattr(agent, "outcomes", []))[-5:]]
    return {
        "present": True,
        "mode": str(agent.mode.value),
        "reasoner": str(getattr(agent.reasoner, "name", "")),
        "pending_approvals": len(_pending(agent)),
        "detail": finite(
            sanitize(
                {
                    "ticks": getattr(agent, "ticks", 0),
                    "analyses": getattr(agent, "analyses", 0),
                    "recent_outcomes": outcomes,
                }
            )
        ),
    }


@router.put(
    "/agent/mode", response_model=AgentStatus, tags=["agent"], responses=_NOT_AGENT,
    summary="Set the agent's mode: autonomous, approve or observe",
)
def set_agent_mode(
    body: AgentModeIn, ctx: Ctx, principal: Annotated[Principal, requires(Role.OPERATOR)]
) -> dict[str, Any]:
    agent = _require_agent(ctx)
    modes = ("autonomous", "approve", "observe")
    if body.mode not in modes:
        raise ApiError(422, "invalid request", [("body.mode", f"must be one of {', '.join(modes)}")])
    with ctx.engine.lock:
        old = agent.mode.value
        agent.config.mode = type(agent.mode)(body.mode)
    audit_note(
        ctx.engine, "config", principal.actor, {"action": "agent-mode", "from": old, "to": body.mode}
    )
    if body.mode != "approve":  # nobody will approve them now: withdraw, audited, not left stale
        for p in _pending(agent):
            with contextlib.suppress(KeyError):  # decided meanwhile
                agent.reject(str(p.get("id")), f"withdrawn: the agent left approve mode ({body.mode})",
                             actor=principal.actor)
    return agent_status(ctx, principal)


@router.get(
    "/agent/approvals", response_model=ApprovalList, tags=["agent"],
    summary="Plans waiting for an operator (approve mode)",
)
def approvals(ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    if ctx.agent is None:
        return {"items": []}
    return {"items": [_approval(p) for p in _pending(ctx.agent)]}


def _decide(ctx: ApiContext, approval_id: str, principal: Principal, approve: bool, comment: str) -> dict[str, Any]:
    agent = _require_agent(ctx)
    try:
        if approve:
            out = agent.approve(approval_id, actor=principal.actor)
        else:
            out = agent.reject(approval_id, comment, actor=principal.actor)
    except KeyError as exc:
        raise ApiError(404, str(exc.args[0]) if exc.args else f"no pending plan {approval_id!r}") from None
    # the agent's audit records of the decision are made durable with it
    audit_note(
        ctx.engine, "operator", principal.actor,
        {"action": "approve" if approve else "reject", "plan": approval_id, "outcome": out.outcome,
         "comment": comment},
        correlation_id=out.correlation_id,
    )
    committed = out.outcome in ("committed", "operator-rejected")
    return {
        "accepted": committed,
        "version": int(out.version if out.version is not None else ctx.engine.reads.version),
        "message": f"plan {approval_id}: {out.outcome}",
        "rejections": [str(r) for r in out.reasons] if not committed else [],
    }


_APPROVAL_ERRORS: dict[int | str, dict[str, Any]] = {
    **_NOT_AGENT,
    404: {"model": ErrorBody, "description": "no such pending plan"},
}


@router.post(
    "/agent/approvals/{approval_id}/approve", response_model=ActionResult, tags=["agent"],
    responses=_APPROVAL_ERRORS,
    summary="Approve a pending plan (re-forecast on the current state, then verified and applied)",
)
def approve(
    approval_id: Annotated[str, Path(max_length=200)],
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.OPERATOR)],
    body: ApprovalDecisionIn | None = None,
) -> dict[str, Any]:
    return _decide(ctx, approval_id, principal, True, body.comment if body else "")


@router.post(
    "/agent/approvals/{approval_id}/reject", response_model=ActionResult, tags=["agent"],
    responses=_APPROVAL_ERRORS,
    summary="Reject a pending plan (the agent may offer another)",
)
def reject(
    approval_id: Annotated[str, Path(max_length=200)],
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.OPERATOR)],
    body: ApprovalDecisionIn | None = None,
) -> dict[str, Any]:
    return _decide(ctx, approval_id, principal, False, body.comment if body else "")


# ===================================================================== audit
def _audit_dict(e: Any) -> dict[str, Any]:
    return {
        "seq": e.seq,
        "time": e.time,
        "kind": e.kind,
        "actor": e.actor,
        "workload": e.workload,
        "correlation_id": e.correlation_id,
        "payload": finite(e.data()),
        "hash": e.hash,
        "prev_hash": e.prev_hash,
        "at": rfc3339(e.time),
    }


@router.get("/audit", response_model=AuditList, tags=["audit"], summary="Audit records, oldest first")
def audit(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    workload: Annotated[str | None, Query(max_length=128)] = None,
    correlation_id: Annotated[str | None, Query(max_length=256)] = None,
    kind: Annotated[str | None, Query(max_length=32)] = None,
    after_seq: Annotated[int | None, Query(ge=0, le=2**62, description="records after this one")] = None,
    limit: Annotated[int, Query(ge=1, le=2000)] = 200,
) -> dict[str, Any]:
    log = ctx.engine.audit
    if after_seq is not None:
        out = []
        for e in log.entries(after_seq):
            if (workload is None or e.workload == workload) and (
                correlation_id is None or e.correlation_id == correlation_id
            ) and (kind is None or e.kind == kind):
                out.append(e)
                if len(out) >= limit:
                    break
        entries = out
    else:
        entries = log.show(workload=workload, correlation_id=correlation_id, kind=kind, limit=limit)
    nxt = entries[-1].seq if entries else after_seq
    return {"items": [_audit_dict(e) for e in entries], "next_after_seq": nxt}


@router.get(
    "/audit/verify", response_model=AuditVerifyOut, tags=["audit"],
    summary="Walk the hash chain; name the first record that does not fit",
)
async def audit_verify(ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    r = await run_in_threadpool(ctx.engine.audit.verify)
    return {
        "ok": r.ok,
        "checked": r.checked,
        "first_bad_seq": r.first_bad_seq,
        "reason": r.reason,
        "head_seq": r.head_seq,
        "head_hash": r.head_hash,
    }


# ==================================================================== events
@router.get(
    "/events/dead-letters", response_model=DeadLetterList, tags=["events"],
    summary="Events that failed every retry",
)
def dead_letter_list(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    include_replayed: bool = True,
) -> dict[str, Any]:
    from mlwe.bus.consumer import dead_letters

    rows = dead_letters(ctx.engine.repo.engine, include_replayed=include_replayed)
    return {
        "items": [
            {
                "event_id": d.event_id,
                "time": d.time,
                "subject": d.subject,
                "error": sanitize_text(d.error),
                "attempts": d.attempts,
                "replayed": d.replayed,
                "processed": d.processed,
            }
            for d in rows
        ]
    }


@router.post(
    "/events/dead-letters/{event_id}/replay", response_model=ActionResult, tags=["events"],
    responses={
        404: {"model": ErrorBody, "description": "no such dead letter"},
        409: {"model": ErrorBody, "description": "no event bus configured"},
        503: {"model": ErrorBody, "description": "the event bus cannot be reached"},
    },
    summary="Publish a dead letter again (same id: still exactly-once)",
)
async def dead_letter_replay(
    event_id: Annotated[str, Path(max_length=256)],
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.OPERATOR)],
) -> dict[str, Any]:
    from mlwe.bus.consumer import replay_dead_letter

    if ctx.bus is None:
        raise ApiError(409, "no event bus is configured (start the server with --bus nats://...)")
    bus, own = ctx.bus, False
    if isinstance(bus, str):  # a URL: connect on this event loop, for this replay
        from mlwe.bus.nats import NatsBus

        try:
            bus, own = await NatsBus.connect(ctx.bus, prefix=ctx.settings.bus_prefix), True
        except Exception as exc:
            raise ApiError(503, f"cannot reach the event bus: {exc}") from None
    try:
        env = await replay_dead_letter(ctx.engine.repo.engine, bus, event_id)
    except KeyError:
        raise ApiError(404, f"no dead letter with id {event_id!r}") from None
    finally:
        if own:
            await bus.close()
    await run_in_threadpool(
        audit_note, ctx.engine, "operator", principal.actor,
        {"action": "replay-dead-letter", "event_id": event_id, "subject": env.subject},
    )
    return {"accepted": True, "version": ctx.engine.reads.version, "message": f"replayed {env.id}", "rejections": []}


# ================================================================= scenarios
@router.get("/scenarios", response_model=ScenarioList, tags=["scenarios"], summary="Scenario triggers")
def scenarios(ctx: Ctx, principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    return {
        "items": [{"name": s.name, "title": s.title, "description": s.description} for s in SCENARIOS.values()]
    }


@router.post(
    "/scenarios/{name}", response_model=ScenarioResult, tags=["scenarios"],
    responses={
        404: {"model": ErrorBody, "description": "no such scenario"},
        409: {"model": ErrorBody, "description": "the scenario cannot run now"},
    },
    summary="Trigger a scenario (urgent-fine-tune, node-fails, loss-diverges, oom-loop)",
)
def trigger(
    name: Annotated[str, Path(max_length=64)],
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.OPERATOR)],
    body: ScenarioIn | None = None,
) -> dict[str, Any]:
    if name not in SCENARIOS:
        raise ApiError(404, f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    try:
        return run_scenario(ctx.engine, name, principal.actor, body.target if body else None)
    except ScenarioError as exc:
        raise ApiError(409, f"{name}: {exc}") from None


# ==================================================================== tokens
@router.get("/tokens", response_model=TokenList, tags=["tokens"], summary="API tokens (never the secrets)")
def tokens(ctx: Ctx, principal: Annotated[Principal, requires(Role.ADMIN)]) -> dict[str, Any]:
    return {"items": [token_out(t) for t in ctx.tokens.list()]}


def token_out(t: TokenInfo) -> dict[str, Any]:
    return {
        "id": t.id, "name": t.name, "role": t.role.label, "created": t.created, "revoked": t.revoked,
        "subject": t.id, "policy": t.policy.to_dict(),
    }


@router.post(
    "/tokens", response_model=TokenCreated, status_code=201, tags=["tokens"],
    summary="Create a token; the secret is in this response only",
)
def create_token(
    body: TokenCreateIn, ctx: Ctx, principal: Annotated[Principal, requires(Role.ADMIN)]
) -> dict[str, Any]:
    from mlwe.api.auth import Role as R

    try:
        role = R.parse(body.role)
        policy = TokenPolicy.build(
            queues=body.queues, max_priority=body.max_priority, allow_protected=body.allow_protected
        )
        token, info = ctx.tokens.create(body.name, role, policy)
    except ValueError as exc:
        raise ApiError(422, "invalid token request", [("body", str(exc))]) from None
    audit_note(
        ctx.engine, "config", principal.actor,
        {"action": "token-create", "token_id": info.id, "name": info.name, "role": role.label,
         "policy": policy.to_dict()},
    )
    return {**token_out(info), "token": token}


@router.delete(
    "/tokens/{token_id}", response_model=ActionResult, tags=["tokens"],
    responses={404: {"model": ErrorBody, "description": "no such token"}},
    summary="Revoke a token",
)
def revoke_token(
    token_id: Annotated[str, Path(max_length=64)],
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.ADMIN)],
) -> dict[str, Any]:
    if not ctx.tokens.revoke(token_id):
        raise ApiError(404, f"no token {token_id!r}")
    audit_note(ctx.engine, "config", principal.actor, {"action": "token-revoke", "token_id": token_id})
    return {"accepted": True, "version": ctx.engine.reads.version, "message": f"token {token_id} revoked", "rejections": []}


@router.get("/whoami", response_model=WhoAmI, tags=["tokens"], summary="The calling token")
def whoami(principal: Annotated[Principal, requires(Role.VIEWER)]) -> dict[str, Any]:
    return {
        "token_id": principal.token_id, "name": principal.name, "role": principal.role.label,
        "subject": principal.subject, "policy": principal.policy.to_dict(),
    }
