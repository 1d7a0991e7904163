"""Server-Sent Events over the engine's :class:`~mlwe.runtime.streams.StreamHub`.

One response per client, fed by one bounded :class:`Subscription`. The engine
publishes without ever waiting for a reader: a client that reads too slowly
loses its oldest buffered events, and the stream tells it so with a
``dropped`` event (count, and the id to resume from) before the events that
follow. Each event carries its hub id as the SSE ``id``, so a reconnecting
client sends ``Last-Event-ID`` and gets what it missed from the hub's replay
ring (or a ``gap`` event when that is older than the ring holds).

Wire format, one SSE event per stream event::

    id: 1234
    event: state            (the topic)
    data: {"id":1234,"topic":"state","time":...,"correlation_id":...,"workload":...,"data":{...}}
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from mlwe.runtime.streams import StreamEvent, StreamHub, Subscription


def finite(v: Any) -> Any:
    """JSON has no NaN or infinity: they travel as the strings "nan", "inf", "-inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite(x) for x in v]
    return v


def to_json(obj: Any) -> str:
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)
    except ValueError:
        return json.dumps(finite(obj), separators=(",", ":"), allow_nan=False, default=str)


def event_dict(ev: StreamEvent) -> dict[str, Any]:
    return {
        "id": ev.id,
        "topic": ev.topic,
        "time": ev.time,
        "correlation_id": ev.correlation_id,
        "workload": ev.workload,
        "data": dict(ev.data),
    }


_WIRE: OrderedDict[tuple[int, int], str] = OrderedDict()
_WIRE_MAX = 8192
_WIRE_LOCK = threading.Lock()


def format_event(ev: StreamEvent) -> str:
    """The event's SSE text, encoded once however many clients receive it."""
    key = (id(ev), ev.id)  # the hub keeps the event object alive while it is in the ring
    with _WIRE_LOCK:
        text = _WIRE.get(key)
    if text is None:
        text = f"id: {ev.id}\nevent: {ev.topic}\ndata: {to_json(event_dict(ev))}\n\n"
        with _WIRE_LOCK:
            _WIRE[key] = text
            if len(_WIRE) > _WIRE_MAX:
                _WIRE.popitem(last=False)
    return text


def format_notice(kind: str, data: dict[str, Any]) -> str:
    # no id: a notice must not move the client's resume point
    return f"event: {kind}\ndata: {to_json(data)}\n\n"


def parse_last_event_id(value: str | None) -> int | None:
    if value is None or not value.strip():
        return None
    try:
        n = int(value.strip())
    except ValueError:
        raise ValueError(f"Last-Event-ID must be an integer event id, got {value[:40]!r}") from None
    if n < 0:
        raise ValueError("Last-Event-ID must not be negative")
    return n


class StreamStats:
    """Counters the metrics endpoint reads."""

    def __init__(self) -> None:
        self.clients = 0
        self.sent = 0
        self.dropped = 0


async def event_stream(
    hub: StreamHub,
    sub: Subscription,
    *,
    heartbeat_s: float = 15.0,
    keep: Callable[[StreamEvent], bool] | None = None,
    stats: StreamStats | None = None,
) -> AsyncIterator[str]:
    """The body of one SSE response; closes the subscription when the client goes."""
    last_sent = 0
    if stats is not None:
        stats.clients += 1
    try:
        yield "retry: 2000\n\n"
        yield format_notice(
            "hello", {"last_id": hub.last_id, "topics": sorted(sub.topics), "buffer": sub.maxsize}
        )
        if sub.gap:
            yield format_notice(
                "gap",
                {"message": "some events you missed are older than the replay ring; reload state"},
            )
        while not sub.closed:
            events, dropped = await sub.wait(heartbeat_s)
            if dropped:
                if stats is not None:
                    stats.dropped += dropped
                yield format_notice(
                    "dropped",
                    {
                        "dropped": dropped,
                        "resume_after": last_sent,
                        "message": "this client read too slowly; the oldest buffered events were dropped",
                    },
                )
            if not events:
                if not dropped:
                    yield ": keep-alive\n\n"
                continue
            parts = []
            for ev in events:
                last_sent = ev.id
                if keep is None or keep(ev):
                    parts.append(format_event(ev))
            if parts:
                if stats is not None:
                    stats.sent += len(parts)
                yield "".join(parts)
    finally:
        sub.close()
        if stats is not None:
            stats.clients -= 1
