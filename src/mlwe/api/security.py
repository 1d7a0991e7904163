"""HTTP hardening: request size limits, security headers, and the submit rate limiter.

Both middlewares are plain ASGI (no per-request task switching), so they add
almost nothing to a request and never buffer a streaming response.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The dashboard loads only its own files and talks only to its own origin.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
    " connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self';"
    " frame-ancestors 'none'; object-src 'none'"
)

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=(), payment=(), usb=()"),
)


async def _error(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail, "errors": []}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *SECURITY_HEADERS,
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class SecurityHeaders:
    """Adds the security headers to every HTTP response (API and dashboard alike)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [h for h in SECURITY_HEADERS if h[0] not in names]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class BodySizeLimit:
    """Refuses request bodies over ``max_bytes`` with 413, declared or streamed.

    A declared ``Content-Length`` over the limit is refused before reading; a
    body without one (chunked) is read up to the limit and refused past it.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    await _error(send, 400, "invalid Content-Length header")
                    return
        limit = self.max_bytes
        if declared is not None and declared > limit:
            await _error(send, 413, f"request body is {declared} bytes; the limit is {limit}")
            return
        if declared is not None:
            await self.app(scope, receive, send)
            return
        # no declared length: count what arrives, buffer at most the limit
        chunks: list[bytes] = []
        size = 0
        chunks_done: Message | None = None
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                chunks_done = msg
                break
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                await _error(send, 413, f"request body is over the limit of {limit} bytes")
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                chunks_done = None
                break
        payload = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                if chunks_done is not None:
                    return chunks_done
                return {"type": "http.request", "body": payload, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RateLimiter:
    """Token buckets per key (a token id): ``rate`` per second, bursts up to ``burst``."""

    def __init__(self, rate: float, burst: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be positive and burst at least 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str, n: float = 1.0) -> float:
        """Take ``n`` tokens: 0.0 if allowed, else the seconds to wait before retrying."""
        now = self._clock()
        with self._lock:
            level, last = self._buckets.get(key, (self.burst, now))
            level = min(self.burst, level + (now - last) * self.rate)
            if n > self.burst:
                self._buckets[key] = (level, now)
                return math.inf  # can never pass: the batch is bigger than a burst
            if level >= n:
                self._buckets[key] = (level - n, now)
                return 0.0
            self._buckets[key] = (level, now)
            return (n - level) / self.rate
