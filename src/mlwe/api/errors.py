"""One error shape for every failure: ``{"detail": ..., "errors": [{"path", "message"}]}``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlwe.api.models import ErrorBody


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


def _loc(loc: Any) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(_body(exc.detail, exc.errors), exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse(_body(detail, []), exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            (_loc(e.get("loc", ())), str(e.get("msg", "invalid")).removeprefix("Value error, "))
            for e in exc.errors()
        ]
        return JSONResponse(_body("invalid request", errors), 422)


#: Documented on every route (FastAPI merges them into each operation).
COMMON_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "malformed request (a body that cannot be parsed, an unknown query parameter)"},
    401: {"model": ErrorBody, "description": "missing, invalid or revoked bearer token"},
    403: {"model": ErrorBody, "description": "the token's role is below what the route needs"},
    413: {"model": ErrorBody, "description": "request body over the size limit"},
    422: {"model": ErrorBody, "description": "invalid input; each problem names its field"},
}
