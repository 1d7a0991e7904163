"""What every route needs: the engine, the token store, the settings, and the optional parts."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from mlwe.api.auth import TokenStore
from mlwe.api.metrics import ApiMetrics
from mlwe.api.security import RateLimiter
from mlwe.api.sse import StreamStats
from mlwe.api.submitter import SubmitQueue
from mlwe.runtime.engine import Engine

#: Where the REST API lives (the dashboard and system routes are outside it).
API_PREFIX = "/api/v1"


@dataclass
class ApiSettings:
    max_body_bytes: int = 1 << 20  # 1 MiB: a spec file of thousands of workloads still fits
    submit_rate_per_s: float = 100.0  # workloads per second per token, sustained
    submit_burst: int = 500  # workloads one token may submit at once
    max_workloads_per_request: int = 500
    cors_origins: tuple[str, ...] = ()  # none: browsers allow same-origin requests only
    stream_buffer: int = 1000  # events buffered per stream client before dropping
    stream_buffer_max: int = 10_000
    heartbeat_s: float = 15.0
    token_cache_s: float = 5.0
    bus_prefix: str = "mlwe"  # subject prefix of the engine's NATS stream (dead-letter replay)
    public_metrics: bool = False  # /metrics without a token (a scraper that has none)
    history_every_s: float = 10.0  # how often the cluster is sampled for the dashboard's plots


class InFlightKeys:
    """Idempotency-Keys whose first request is still being handled (a concurrent retry
    with the same key is told to wait instead of submitting twice)."""

    def __init__(self) -> None:
        self._keys: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, key: str) -> bool:
        with self._lock:
            if key in self._keys:
                return False
            self._keys.add(key)
            return True

    def release(self, key: str) -> None:
        with self._lock:
            self._keys.discard(key)


@dataclass
class ApiContext:
    engine: Engine
    tokens: TokenStore
    settings: ApiSettings
    limiter: RateLimiter
    metrics: ApiMetrics
    stream_stats: StreamStats
    submitter: SubmitQueue
    agent: Any | None = None  # the agent loop, when one runs (see routes/ops.py)
    bus: Any | None = None  # the event bus (or its URL), for dead-letter replay
    extras: dict[str, Any] = field(default_factory=dict)
    idempotency: InFlightKeys = field(default_factory=InFlightKeys)


async def get_ctx(request: Request) -> ApiContext:
    # async: FastAPI runs plain-def dependencies on a worker thread, a hop per request

    ctx: ApiContext = request.app.state.ctx
    return ctx
