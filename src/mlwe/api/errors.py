"""One error shape for every failure: ``{"detail": ..., "errors": [{"path", "message"}]}``.

That includes the failures nobody planned for: when the database cannot be
reached (a token looked up, a change persisted, a history read), the answer
is a JSON 503 saying the store is unavailable and to retry, never a
plain-text 500; any other unexpected error is a JSON 500 that names no
internals (the traceback goes to the log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlwe.api.models import ErrorBody
from mlwe.store import db

log = logging.getLogger("mlwe.api")

#: Seconds a client is told to wait before retrying during a store outage.
STORE_RETRY_AFTER_S = 5


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        detail: str,
        errors: list[tuple[str, str]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.errors = errors or []
        self.headers = headers


def _body(detail: str, errors: list[tuple[str, str]]) -> dict[str, Any]:
    return {"detail": detail, "errors": [{"path": p, "message": m} for p, m in errors]}


#: A pattern's meaning in words, for its mismatch errors (a regex is no clear error):
#: the message, given the value that did not match.
PATTERN_MESSAGES: dict[str, Callable[[str], str]] = {}


def explain_pattern(pattern: str, message: Callable[[str], str]) -> str:
    """Register what ``pattern`` means; returns it (``Query(pattern=explain_pattern(...))``)."""
    PATTERN_MESSAGES[pattern] = message
    return pattern


def unknown_items(what: str, known: Sequence[str]) -> Callable[[str], str]:
    """The message of a comma-separated list with items not in ``known``."""
    def message(value: str) -> str:
        bad = [t.strip() for t in value.split(",") if t.strip() and t.strip() not in known]
        shown = ", ".join(repr(b[:40]) for b in bad[:5]) or repr(value[:40])
        return f"unknown {what} {shown}; known: {', '.join(known)} (comma-separated)"
    return message


def _message(e: Any) -> str:
    if e.get("type") == "string_pattern_mismatch":
        explain = PATTERN_MESSAGES.get(str((e.get("ctx") or {}).get("pattern", "")))
        if explain is not None:
            return explain(str(e.get("input", "")))
    return str(e.get("msg", "invalid")).removeprefix("Value error, ")


def _loc(loc: Any) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def store_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database cannot be reached (not a bug, not a bad request)."""
    if isinstance(exc, db.StoreUnavailable | sa_exc.OperationalError | sa_exc.InterfaceError
                  | sa_exc.TimeoutError | sa_exc.DisconnectionError):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)


def unavailable(exc: BaseException | None = None) -> JSONResponse:
    """The 503 of a store outage (also used by routes that catch the error themselves)."""
    why = f" ({db._describe(exc)})" if exc is not None else ""
    detail = (
        f"the store (database) is unavailable{why}; nothing was changed by this request."
        f" Retry in {STORE_RETRY_AFTER_S} s"
    )
    return JSONResponse(
        _body(detail, [("", "store unavailable")]), 503,
        headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
    )


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(_body(exc.detail, exc.errors), exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        headers = exc.headers
        if exc.status_code == 405:
            # Starlette names only the methods of the first route whose path matched; a
            # path served by several routes (GET and POST /workloads) supports them all
            allowed = allowed_methods(request)
            if allowed:
                headers = {**(headers or {}), "Allow": ", ".join(allowed)}
                detail = f"method {request.method} not allowed here; allowed: {', '.join(allowed)}"
        return JSONResponse(_body(detail, []), exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [(_loc(e.get("loc", ())), _message(e)) for e in exc.errors()]
        return JSONResponse(_body("invalid request", errors), 422)

    async def _store_error(request: Request, exc: Exception) -> JSONResponse:
        # handled inside the app (so the security headers and metrics still apply)
        return await _unexpected(request, exc)

    app.add_exception_handler(sa_exc.SQLAlchemyError, _store_error)
    app.add_exception_handler(db.StoreUnavailable, _store_error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's last resort: without this a database outage (or a bug) is a
        # plain-text 500 "Internal Server Error"
        if store_outage(exc) or any(store_outage(c) for c in _causes(exc)):
            log.warning("store unavailable during %s %s: %s", request.method, request.url.path,
                        db._describe(exc))
            return unavailable(exc)
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return JSONResponse(
            _body("internal error; it has been logged (nothing here names its details)", []), 500
        )


def allowed_methods(request: Request) -> list[str]:
    """The methods of this request's path (HEAD and OPTIONS left implicit).

    As OpenAPI matches paths: a concrete path (``/workloads/validate``) is
    matched before a templated one (``/workloads/{workload_id}``)."""
    app = request.app
    table: list[tuple[Any, int, frozenset[str]]] | None = getattr(app.state, "method_table", None)
    if table is None:
        from starlette.routing import compile_path

        from mlwe.api.app import iter_api_routes

        table = [(compile_path(path)[0], path.count("{"), methods) for path, methods, _ in iter_api_routes(app)]
        app.state.method_table = table
    path = request.scope.get("path", "")
    hits = [(n, methods) for regex, n, methods in table if regex.match(path)]
    if not hits:
        return []
    fewest = min(n for n, _ in hits)
    found = {m for n, methods in hits if n == fewest for m in methods}
    return sorted(found - {"HEAD", "OPTIONS"})


def _causes(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur = exc.__cause__ or exc.__context__
    while cur is not None and len(out) < 10:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


#: Documented on every route (FastAPI merges them into each operation).
COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "malformed request (a body that cannot be parsed, an unknown query parameter)"},
    401: {"model": ErrorBody, "description": "missing, invalid or revoked bearer token"},
    403: {"model": ErrorBody, "description": "the token's role is below what the route needs"},
    413: {"model": ErrorBody, "description": "request body over the size limit"},
    422: {"model": ErrorBody, "description": "invalid input; each problem names its field"},
    500: {"model": ErrorBody, "description": "an unexpected error (logged; no details given)"},
    503: {"model": ErrorBody, "description": "the store (database) is unavailable; retry after Retry-After"},
}
