"""Server-Sent Events on the client side: :class:`StreamEvent`, the SSE parser, the
request a stream opens with, and what to do when it is lost (:func:`_retry_or_raise`:
give up, or wait with backoff and open it again), for the sync and async clients."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from mlwe.client.errors import ServerUnreachable


@dataclass(frozen=True)
class StreamEvent:
    """One Server-Sent Event: ``topic`` is the SSE event name (a stream topic, or a notice
    such as ``dropped``, ``gap``, ``hello``, ``reconnecting``); ``id`` is None for notices.
    ``data`` is the envelope as sent; ``payload``, ``time`` and ``workload`` read into it."""

    topic: str
    id: int | None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def payload(self) -> dict[str, Any]:
        """What the event says (``data["data"]``), e.g. ``{"workload", "from", "to", "reason"}``."""
        inner = self.data.get("data")
        return inner if isinstance(inner, dict) else {}

    @property
    def time(self) -> float | None:
        t = self.data.get("time")
        return float(t) if isinstance(t, int | float) else None

    @property
    def workload(self) -> str | None:
        w = self.data.get("workload") or self.payload.get("workload")
        return w if isinstance(w, str) else None


def parse_sse(lines: Iterable[str]) -> Iterator[StreamEvent]:
    """Events from the lines of an SSE response (the wire format of ``mlwe.api.sse``)."""
    parser = _SseParser()
    for raw in lines:
        ev = parser.feed(raw)
        if ev is not None:
            yield ev


class _SseParser:
    def __init__(self) -> None:
        self.event: str = "message"
        self.ident: int | None = None
        self.data: list[str] = []

    def feed(self, raw: str) -> StreamEvent | None:
        line = raw.rstrip("\r")
        if line == "":
            out = None
            if self.data:
                try:
                    payload = json.loads("\n".join(self.data))
                except ValueError:
                    payload = {"text": "\n".join(self.data)}
                out = StreamEvent(self.event, self.ident,
                                  payload if isinstance(payload, dict) else {"value": payload})
            self.event, self.data, self.ident = "message", [], None
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        elif name == "id":
            try:
                self.ident = int(value)
            except ValueError:
                self.ident = None
        return None


def _backoff(attempt: int, base: float = 0.5, cap: float = 30.0,
             rand: Callable[[], float] = random.random) -> float:
    """Exponential backoff with jitter: 0.5, 1, 2, ... up to ``cap`` seconds, each times
    0.75 to 1.25 (``rand()``, in [0, 1), picks where)."""
    return float(min(cap, base * 2 ** (attempt - 1)) * (0.75 + rand() / 2))


@dataclass(frozen=True)
class _Retry:
    """How a lost stream is opened again: ``failures`` in a row now, ``wait`` seconds
    first, and the ``reconnecting`` notice to yield before waiting (None without notices)."""

    failures: int
    wait: float
    notice: StreamEvent | None


def _retry_or_raise(url: str, reason: str, failures: int, *, reconnect: bool,
                    max_retries: int | None, notices: bool,
                    rand: Callable[[], float] = random.random) -> _Retry:
    """The stream from ``url`` was lost (``reason``) after ``failures`` failed attempts in a
    row: raise :class:`ServerUnreachable` without ``reconnect`` or once more than
    ``max_retries`` failed in a row, else how to retry. No I/O: both clients' ``stream``
    do the waiting and the yielding."""
    if not reconnect:
        raise ServerUnreachable(url, reason)
    failures += 1
    if max_retries is not None and failures > max_retries:
        raise ServerUnreachable(url, f"{reason} (gave up after {max_retries} retries)")
    wait = _backoff(failures, rand=rand)
    notice = (StreamEvent("reconnecting", None, {"message": f"{reason}; again in {wait:.1f} s",
                                                 "attempt": failures})
              if notices else None)
    return _Retry(failures, wait, notice)


_TRANSPORT_ERRORS = (httpx.TransportError,)


def _stream_request(
    topics: Iterable[str], last_event_id: int | None, workload: str | None, correlation_id: str | None
) -> tuple[dict[str, Any], dict[str, str]]:
    params: dict[str, Any] = {"topics": ",".join(topics)}
    if workload:
        params["workload"] = workload
    if correlation_id:
        params["correlation_id"] = correlation_id
    headers = {"Accept": "text/event-stream"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    return params, headers
