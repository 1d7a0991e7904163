"""The live streams: Server-Sent Events (resumable) and the recent-events backlog."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import StreamingResponse

from mlwe.api.auth import Principal, Role, requires
from mlwe.api.context import API_PREFIX, ApiContext, get_ctx
from mlwe.api.errors import ApiError, explain_pattern, unknown_items
from mlwe.api.models import StreamEventList, list_pattern
from mlwe.api.sse import event_dict, event_stream, finite, parse_last_event_id
from mlwe.runtime.streams import TOPICS, StreamEvent

router = APIRouter(prefix=API_PREFIX, tags=["streams"])

Ctx = Annotated[ApiContext, Depends(get_ctx)]
_TOPICS_HELP = "comma-separated: " + ", ".join(TOPICS) + " (none: all)"
_TOPICS_PATTERN = explain_pattern(
    list_pattern(TOPICS), unknown_items("topic(s)", TOPICS)
)


def _topics(text: str | None) -> list[str]:
    if not text:
        return list(TOPICS)
    wanted = [t.strip() for t in text.split(",") if t.strip()]
    if not wanted:
        return list(TOPICS)  # only blanks and commas: no filter, as when absent
    bad = [t for t in wanted if t not in TOPICS]
    if bad:
        raise ApiError(
            422, "invalid request", [("query.topics", f"unknown topic(s) {', '.join(bad)}; topics: {', '.join(TOPICS)}")]
        )
    return wanted


@router.get(
    "/streams",
    summary="Live events as Server-Sent Events (resume with Last-Event-ID)",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                     "description": "an endless event stream"}},
)
async def streams(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    topics: Annotated[str | None, Query(max_length=100, pattern=_TOPICS_PATTERN, description=_TOPICS_HELP)] = None,
    workload: Annotated[str | None, Query(max_length=128)] = None,
    correlation_id: Annotated[str | None, Query(max_length=256)] = None,
    buffer: Annotated[int | None, Query(ge=1, le=100_000, description="events buffered for this client")] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=32)] = None,
    after: Annotated[int | None, Query(ge=0, le=2**62, description="resume after this id (as Last-Event-ID)")] = None,
) -> StreamingResponse:
    wanted = _topics(topics)
    try:
        resume = parse_last_event_id(last_event_id)
    except ValueError as exc:
        raise ApiError(422, "invalid request", [("header.Last-Event-ID", str(exc))]) from None
    if resume is None:
        resume = after
    size = min(buffer or ctx.settings.stream_buffer, ctx.settings.stream_buffer_max)
    sub = ctx.engine.streams.subscribe(wanted, last_event_id=resume, buffer=size)

    keep = None
    if workload is not None or correlation_id is not None:

        def keep(ev: StreamEvent) -> bool:
            return (workload is None or ev.workload == workload) and (
                correlation_id is None or ev.correlation_id == correlation_id
            )

    body = event_stream(
        ctx.engine.streams, sub, heartbeat_s=ctx.settings.heartbeat_s, keep=keep, stats=ctx.stream_stats
    )
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/streams/recent", response_model=StreamEventList, summary="Recent events still in the replay ring")
def recent(
    ctx: Ctx,
    principal: Annotated[Principal, requires(Role.VIEWER)],
    topics: Annotated[str | None, Query(max_length=100, pattern=_TOPICS_PATTERN, description=_TOPICS_HELP)] = None,
    after_id: Annotated[int, Query(ge=0, le=2**62)] = 0,
    workload: Annotated[str | None, Query(max_length=128)] = None,
    correlation_id: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
) -> dict[str, Any]:
    hub = ctx.engine.streams
    last = hub.last_id
    evs = hub.recent(
        _topics(topics), after_id=after_id, limit=limit, correlation_id=correlation_id, workload=workload
    )
    return {"last_id": last, "items": [finite(event_dict(e)) for e in evs]}
