"""The FastAPI app factory: routes, auth, limits, headers, metrics and the dashboard.

``create_app(engine)`` serves one running :class:`~mlwe.runtime.Engine`:

- ``/api/v1/...``: the REST API (OpenAPI at ``/openapi.json``); every route
  declares the least role it needs (``mlwe.api.auth.requires``);
- ``/api/v1/streams``: Server-Sent Events (telemetry, state, reasoning, audit);
- ``/metrics``: Prometheus (viewer token, or public when the operator chooses);
- ``/healthz``, ``/readyz``: liveness and readiness (public, no data);
- ``/``: the dashboard (static files, public: it holds no data until a token is given).

The factory refuses to build an app in which a route declares no role and is
not listed in :data:`PUBLIC_PATHS`, so a new route cannot be left open by
mistake. Swagger UI and ReDoc are off: they load scripts from a CDN.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles

from mlwe.api import errors
from mlwe.api.auth import Principal, Role, TokenStore, declared_role, requires
from mlwe.api.context import ApiContext, ApiSettings
from mlwe.api.metrics import AccessLog, ApiMetrics, RequestMetrics
from mlwe.api.models import Health
from mlwe.api.relay import DecisionRelay
from mlwe.api.routes import cluster, ops, pipelines, streams, workloads
from mlwe.api.security import BodySizeLimit, RateLimiter, SecurityHeaders
from mlwe.api.sse import StreamStats
from mlwe.api.submitter import SubmitQueue
from mlwe.core.spec import QueueSpec, WorkloadSpec
from mlwe.dashboard import STATIC_DIR
from mlwe.runtime.engine import Engine

log = logging.getLogger("mlwe.api")

#: Routes anyone may call: liveness, readiness, the schema, and the dashboard's static files.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json", "/", "/static"})


def create_app(
    engine: Engine,
    *,
    tokens: TokenStore | None = None,
    settings: ApiSettings | None = None,
    agent: Any | None = None,
    bus: Any | None = None,
    relay_decisions: bool = True,
) -> FastAPI:
    settings = settings or ApiSettings()
    tokens = tokens or TokenStore(engine.repo.engine, cache_ttl_s=settings.token_cache_s)
    ctx = _context(engine, tokens, settings, agent, bus)
    relay = DecisionRelay(engine) if relay_decisions else None
    from mlwe.api.history import ClusterHistory

    history = ClusterHistory(engine, settings.history_every_s) if relay_decisions else None

    app = FastAPI(
        title="mlwe",
        version="1",
        summary="ML Workload Engine: verified scheduling for shared ML clusters",
        docs_url=None,
        redoc_url=None,
        responses=errors.COMMON_RESPONSES,
        dependencies=[Depends(known_query_params)],
    )
    app.state.ctx = ctx
    app.state.tokens = tokens
    app.state.relay = relay
    app.state.history = history
    errors.install(app)

    app.include_router(workloads.router)
    app.include_router(cluster.router)
    app.include_router(ops.router)
    app.include_router(streams.router)
    app.include_router(pipelines.router)
    _add_system_routes(app, settings)

    _check_roles(app, {"/metrics"} if settings.public_metrics else set())
    _add_spec_schema(app)
    _add_middleware(app, ctx, settings)
    return app


def _context(engine: Engine, tokens: TokenStore, settings: ApiSettings, agent: Any | None,
             bus: Any | None) -> ApiContext:
    """What every route reads from ``app.state.ctx``: the engine, tokens, limits, metrics."""
    stream_stats = StreamStats()
    metrics = ApiMetrics(engine, stream_stats)
    return ApiContext(
        engine=engine,
        tokens=tokens,
        settings=settings,
        limiter=RateLimiter(settings.submit_rate_per_s, settings.submit_burst),
        metrics=metrics,
        stream_stats=stream_stats,
        submitter=SubmitQueue(engine),
        agent=agent,
        bus=bus,
    )


def _add_system_routes(app: FastAPI, settings: ApiSettings) -> None:
    """Liveness, readiness, Prometheus metrics and the dashboard (with its static files)."""

    @app.get("/healthz", response_model=Health, tags=["system"], summary="Liveness (public)")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "checks": {}}

    @app.get(
        "/readyz",
        response_model=Health,
        tags=["system"],
        summary="Readiness: store writable and engine loop running (public)",
        responses={503: {"model": Health, "description": "not ready"}},
    )
    def readyz(request: Request) -> Response:
        c: ApiContext = request.app.state.ctx
        h = c.engine.health()
        ready = h.get("status") == "ok" and bool(h.get("loop_running"))
        checks = {
            "store": "ok" if not h.get("degraded") else "degraded",
            "loop": "running" if h.get("loop_running") else "stopped",
        }
        n = len(h.get("quarantined") or ())
        if n:  # the engine runs, but some stored records did not come back: say so loudly
            checks["quarantine"] = (
                f"{n} stored record(s) could not be loaded on start and are quarantined;"
                " see `mlwe quarantine list`"
            )
        body = {"status": "ready" if ready else "not ready", "checks": checks}
        return JSONResponse(body, status_code=200 if ready else 503)

    def _metrics_body(request: Request) -> Response:
        data = request.app.state.ctx.metrics.render()
        return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")

    if settings.public_metrics:  # chosen by the operator (mlwe serve --public-metrics)

        @app.get("/metrics", tags=["system"], summary="Prometheus metrics (public on this server)",
                 response_class=Response,
                 responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
        def prometheus_public(request: Request) -> Response:
            return _metrics_body(request)
    else:

        @app.get(
            "/metrics",
            tags=["system"],
            summary="Prometheus metrics (viewer token; mlwe serve --public-metrics: none)",
            response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
        )
        def prometheus(request: Request, principal: Annotated[Principal, requires(Role.VIEWER)]) -> Response:
            return _metrics_body(request)

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


def _add_middleware(app: FastAPI, ctx: ApiContext, settings: ApiSettings) -> None:
    """Security headers, CORS (when origins are given), body size limits, access log, metrics."""
    # outermost last: headers on everything, then size limits, then metrics
    app.add_middleware(RequestMetrics, metrics=lambda: ctx.metrics)
    app.add_middleware(AccessLog)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "PUT", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Last-Event-ID", "X-Correlation-ID"],
            allow_credentials=False,
            max_age=600,
        )
    app.add_middleware(SecurityHeaders)


def _query_names(route: Any) -> frozenset[str]:
    """The query parameters a route declares (its own and its dependencies'), cached on it."""
    cached: frozenset[str] | None = getattr(route, "_mlwe_query_names", None)
    if cached is None:
        names: set[str] = set()
        stack = [route.dependant]
        while stack:  # the route's parameters and its dependencies', all the way down
            d = stack.pop()
            names |= {p.alias for p in d.query_params}
            stack += d.dependencies
        cached = frozenset(names)
        route._mlwe_query_names = cached
    return cached


async def known_query_params(request: Request) -> None:
    """400 for a query parameter the route does not take: a typo (``?stat=running``) must not
    silently answer as if no filter were given."""
    route = request.scope.get("route")
    if route is None or not hasattr(route, "dependant") or not request.query_params:
        return
    if not getattr(route, "include_in_schema", True):  # the dashboard page: a browser's URL
        return
    allowed = _query_names(route)
    unknown = sorted(k for k in request.query_params if k not in allowed)
    if unknown:
        from mlwe.specfile import did_you_mean

        known = ", ".join(sorted(allowed)) or "none"
        raise errors.ApiError(
            400,
            f"unknown query parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}",
            [(f"query.{k}", f"not a parameter of {request.method} {route.path}{did_you_mean(k, allowed)};"
              f" it takes: {known}") for k in unknown],
        )


def iter_api_routes(app: FastAPI) -> list[tuple[str, frozenset[str], APIRoute]]:
    """(full path, methods, route) of every API route, however routers were included.

    FastAPI >= 0.16x keeps included routers lazily (``iter_route_contexts``);
    older versions flatten them into ``app.routes``. Both are handled.
    """
    out: list[tuple[str, frozenset[str], APIRoute]] = []
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:
        for r in app.routes:
            if isinstance(r, APIRoute):
                out.append((r.path, frozenset(r.methods or ()), r))
        return out
    for rc in iter_route_contexts(app.routes):
        route = rc.original_route
        if isinstance(route, APIRoute):
            out.append((str(rc.path), frozenset(rc.methods or route.methods or ()), route))
    return out


def _check_roles(app: FastAPI, also_public: set[str] | None = None) -> None:
    """Every API route declares a role, or is explicitly public."""
    public = PUBLIC_PATHS | (also_public or set())
    missing = [
        f"{','.join(sorted(methods))} {path}"
        for path, methods, route in iter_api_routes(app)
        if declared_role(route.dependant) is None and path not in public
    ]
    if missing:
        raise RuntimeError("routes without a declared role: " + "; ".join(missing))


def route_roles(app: FastAPI) -> list[tuple[str, str, Role | None]]:
    """(method, path, role) for every route; None for the public ones."""
    return [
        (m, path, declared_role(route.dependant))
        for path, methods, route in iter_api_routes(app)
        for m in sorted(methods)
    ]


def _add_spec_schema(app: FastAPI) -> None:
    """Put WorkloadSpec's JSON schema in the OpenAPI components (the submit body refers to it)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        spec = WorkloadSpec.model_json_schema(ref_template="#/components/schemas/{model}")
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, sub in spec.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        comps["WorkloadSpec"] = spec
        # PUT /queues/{queue}: a QueueSpec whose name may be left out (it is the path's)
        queue = QueueSpec.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in queue.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        queue["required"] = [r for r in queue.get("required", []) if r != "name"]
        queue["title"] = "QueueSpecBody"
        comps["QueueSpecBody"] = queue
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
