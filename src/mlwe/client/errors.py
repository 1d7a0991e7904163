"""The client's errors: :class:`ClientError` and a subclass for each kind of failure
(:class:`ServerUnreachable` when no answer came, else one per HTTP status), and how an
answer becomes one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx


class ClientError(RuntimeError):
    """A request that did not succeed: ``status`` (0 when the server gave no answer),
    ``detail`` (the server's summary) and ``errors`` (each problem with its field path)."""

    def __init__(self, status: int, detail: str, errors: list[dict[str, str]] | None = None) -> None:
        self.status = status
        self.detail = detail
        self.errors = errors or []
        lines = [f"{status}: {detail}" if status else detail]
        for e in self.errors:
            where = e.get("path") or ""
            lines.append(f"  {where + ': ' if where else ''}{e.get('message', '')}")
        super().__init__("\n".join(lines))


class ServerUnreachable(ClientError):
    """No answer: the server is down, the address is wrong, or it timed out."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        super().__init__(0, f"cannot reach the server at {url}: {reason}")


class InvalidRequest(ClientError):
    """400 / 422: the request (a spec, a parameter) is wrong; ``errors`` says where."""


class Unauthorized(ClientError):
    """401: no token, or one the server does not know (revoked?)."""


class Forbidden(ClientError):
    """403: the token's role may not do this."""


class NotFound(ClientError):
    """404: no such workload, node, plan..."""


class Conflict(ClientError):
    """409: refused in the current state (the control plane said why)."""


class RateLimited(ClientError):
    """429: too many submissions; ``retry_after`` seconds."""

    retry_after: float | None = None


class ServerError(ClientError):
    """5xx: the server failed (503: the store is unavailable; nothing was acknowledged)."""


class WaitTimeout(ClientError):
    """:meth:`Client.wait` ran out of time; ``last`` is the workload as last seen."""

    last: Mapping[str, Any] | None = None


_BY_STATUS: dict[int, type[ClientError]] = {
    400: InvalidRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
    413: InvalidRequest, 415: InvalidRequest, 422: InvalidRequest, 429: RateLimited,
}


def _error(resp: httpx.Response) -> ClientError:
    try:
        body = resp.json()
    except ValueError:
        body = {"detail": resp.text[:500] or resp.reason_phrase}
    detail = body.get("detail") if isinstance(body, dict) else str(body)
    errors = body.get("errors") if isinstance(body, dict) else None
    cls = _BY_STATUS.get(resp.status_code) or (ServerError if resp.status_code >= 500 else ClientError)
    exc = cls(resp.status_code, str(detail), errors if isinstance(errors, list) else None)
    if isinstance(exc, RateLimited):
        try:
            exc.retry_after = float(resp.headers.get("Retry-After", ""))
        except ValueError:
            exc.retry_after = None
    return exc


def _check(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        raise _error(resp)
    if resp.headers.get("content-type", "").startswith("application/json"):
        return resp.json()
    return resp.text
