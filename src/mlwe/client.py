"""A Python client for a running mlwe server (``mlwe serve``), over httpx; sync and async.

    from mlwe.client import Client
    with Client("http://localhost:8080", token="mlwe_...") as c:
        created = c.submit_file("job.yaml")
        w = c.wait(created[0], {"running", "succeeded"}, timeout=600)
        print(c.explain(w["id"])["summary"])
        for ev in c.stream(["state"]):          # reconnects, resuming after the last event
            print(ev.topic, ev.workload, ev.payload.get("to"))

    async with AsyncClient() as c:              # the same methods, awaited
        await c.wait("job-1", {"succeeded"})

``url`` and ``token`` default to ``$MLWE_URL`` / ``$MLWE_TOKEN``, then the current
client context (``mlwe config``, :mod:`mlwe.clientconfig`), then
http://127.0.0.1:8080. Answers are typed dicts (:class:`WorkloadSummary`,
:class:`Node`, ...: the server's OpenAPI models, checked against them by a
test). Every failure raises a :class:`ClientError`: :class:`ServerUnreachable`
when no answer came (connection refused, timeout), else the subclass for the
HTTP status, with the server's message and each problem it named.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypedDict

import httpx

from mlwe.clientconfig import DEFAULT_URL, resolve

__all__ = [
    "AsyncClient",
    "Client",
    "ClientError",
    "Conflict",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "RateLimited",
    "ServerError",
    "ServerUnreachable",
    "StreamEvent",
    "Unauthorized",
    "WaitTimeout",
]
_ = DEFAULT_URL  # re-exported for callers that knew it here


# ===================================================================== errors
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


# ================================================================ typed answers
class Resources(TypedDict):
    gpu: int
    vram: int
    cpu: int
    ram: int


class Transition(TypedDict):
    time: float
    source: str | None
    target: str
    reason: str
    cause_id: str | None
    at: str | None


class WorkloadSummary(TypedDict):
    id: str
    name: str
    kind: str
    queue: str
    state: str
    priority: int
    replicas: int
    gpus: float
    submit_time: float
    deadline: float | None
    deadline_left_s: float | None
    deadline_at_risk: bool
    progress: float
    attempt: int
    preemptions: int
    nodes: list[str]
    pending_reason: str
    owner: str | None  # the name of the token that submitted it
    owner_subject: str | None  # the token's id: what owns it (unique, never reused)
    correlation_id: str | None
    lifecycle: list[str]
    lifecycle_causes: list[str | None]
    preempted_by: str | None
    submitted_at: str | None
    deadline_at: str | None
    condition: str | None  # for a queued workload: "waiting" or "inadmissible" (can never run here)
    inadmissible_reasons: list[str]


class WorkloadDetail(WorkloadSummary):
    spec: dict[str, Any]
    history: list[Transition]
    placement: list[dict[str, Any]]
    victims: list[str]
    failures: int
    failure_cause: str | None
    exit_code: int | None
    work_done_s: float
    remaining_estimate_s: float | None
    now: float | None


class Quantities(TypedDict):
    gpu: str
    cpu: str
    memory: str
    vram: str


class NodeQuantities(TypedDict):
    capacity: Quantities
    free: Quantities


class Node(TypedDict):
    name: str
    status: str
    gpu_model: str | None
    gpus: int
    vram_per_gpu: int
    labels: dict[str, str]
    capacity: Resources
    free: Resources
    devices: list[dict[str, Any]]
    workloads: list[str]
    quantities: NodeQuantities | None


class Queue(TypedDict):
    name: str
    cohort: str | None
    weight: float
    nominal: dict[str, int | None]
    borrowing_limit: dict[str, int | None]
    usage: Resources
    pending: int
    running: int


class Decision(TypedDict):
    seq: int
    time: float
    version: int
    kind: str
    workload: str
    policy: str
    cause_id: str | None
    inputs_digest: str
    candidates: list[str]
    chosen: str
    reasons: list[str]
    extra: dict[str, Any]
    at: str | None


class Explanation(TypedDict):
    workload: str
    state: str
    summary: str
    pending_reason: str
    preempted_by: str | None
    victims: list[str]
    history: list[Transition]
    decisions: list[Decision]
    condition: str | None
    inadmissible_reasons: list[str]


class AuditRecord(TypedDict):
    seq: int
    time: float
    kind: str
    actor: str
    workload: str | None
    correlation_id: str | None
    payload: dict[str, Any]
    hash: str
    prev_hash: str
    at: str | None


class SubmitResult(TypedDict):
    accepted: bool
    created: list[str]
    version: int
    correlation_id: str
    rejections: list[str]


class ActionResult(TypedDict):
    accepted: bool
    version: int
    message: str
    rejections: list[str]


class TokenPolicy(TypedDict):
    queues: list[str] | None  # None: any queue
    max_priority: int | None  # None: any priority
    max_priority_class: str | None
    allow_protected: bool


class TokenInfo(TypedDict):
    id: str
    name: str
    role: str
    created: float
    revoked: bool
    subject: str
    policy: TokenPolicy


class TokenCreated(TokenInfo):
    token: str


class AgentStatus(TypedDict):
    present: bool
    mode: str | None
    reasoner: str | None
    pending_approvals: int
    detail: dict[str, Any]


class Approval(TypedDict):
    id: str
    time: float
    summary: str
    correlation_id: str | None
    plan: dict[str, Any]


#: client model -> the server's model of the same answer (tests/api/test_client_lib.py checks both agree)
MODELS: dict[str, type] = {
    "ResourcesOut": Resources, "TransitionOut": Transition, "WorkloadSummary": WorkloadSummary,
    "WorkloadDetail": WorkloadDetail, "NodeOut": Node, "QueueOut": Queue, "DecisionOut": Decision,
    "Explanation": Explanation, "AuditOut": AuditRecord, "SubmitResult": SubmitResult,
    "ActionResult": ActionResult, "TokenOut": TokenInfo, "TokenCreated": TokenCreated,
    "AgentStatus": AgentStatus, "ApprovalOut": Approval, "QuantitiesOut": Quantities,
    "NodeQuantities": NodeQuantities,
}


# ===================================================================== streams
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


def _backoff(attempt: int, base: float = 0.5, cap: float = 30.0) -> float:
    """Exponential backoff with jitter: 0.5, 1, 2, ... up to ``cap`` seconds."""
    return float(min(cap, base * 2 ** (attempt - 1)) * (0.75 + random.random() / 2))


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


def _spec_text(path: str | Path) -> tuple[str, bool]:
    p = Path(path)
    return p.read_text(encoding="utf-8"), p.suffix.lower() != ".json"


# ============================================================== the sync client
class Client:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        context: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url, self.token = resolve(url, token, context)
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except _TRANSPORT_ERRORS as exc:
            raise ServerUnreachable(self.url, str(exc) or type(exc).__name__) from None
        return _check(resp)

    # ------------------------------------------------------------------ basic
    def get(self, path: str, **params: Any) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        return self._send("GET", f"/api/v1/{path.lstrip('/')}", params=clean)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self._send("POST", f"/api/v1/{path.lstrip('/')}", json=body, **kwargs)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = self._send("GET", "/healthz")
        return out

    def metrics(self) -> str:
        return str(self._send("GET", "/metrics"))

    # -------------------------------------------------------------- workloads
    def submit(self, specs: Any, *, correlation_id: str | None = None) -> SubmitResult:
        """Submit a spec dict, a list of them, or ``{"workloads": [...]}``."""
        headers = {"X-Correlation-ID": correlation_id} if correlation_id else {}
        out: SubmitResult = self.post("workloads", specs, headers=headers)
        return out

    def submit_text(self, text: str, *, yaml: bool = True, correlation_id: str | None = None) -> SubmitResult:
        headers = {"Content-Type": "application/yaml" if yaml else "application/json"}
        if correlation_id:
            headers["X-Correlation-ID"] = correlation_id
        out: SubmitResult = self._send("POST", "/api/v1/workloads", content=text.encode(), headers=headers)
        return out

    def submit_file(self, path: str | Path, *, correlation_id: str | None = None) -> list[str]:
        """Submit the specs in a YAML or JSON file; returns the ids created."""
        text, is_yaml = _spec_text(path)
        return list(self.submit_text(text, yaml=is_yaml, correlation_id=correlation_id)["created"])

    def validate_text(self, text: str, *, yaml: bool = True) -> dict[str, Any]:
        headers = {"Content-Type": "application/yaml" if yaml else "application/json"}
        out: dict[str, Any] = self._send("POST", "/api/v1/workloads/validate", content=text.encode(), headers=headers)
        return out

    def workload_page(self, *, state: str | None = None, queue: str | None = None, owner: str | None = None,
                      limit: int = 100, offset: int = 0) -> dict[str, Any]:
        """One page: ``{"total", "items", "now", "next_offset"}`` (``next_offset`` None at the end)."""
        out: dict[str, Any] = self.get("workloads", state=state, queue=queue, owner=owner, limit=limit,
                                       offset=offset or None)
        return out

    def workloads(self, *, state: str | None = None, queue: str | None = None, owner: str | None = None,
                  limit: int = 100) -> list[WorkloadSummary]:
        out: list[WorkloadSummary] = self.workload_page(state=state, queue=queue, owner=owner, limit=limit)["items"]
        return out

    def iter_workloads(self, *, state: str | None = None, queue: str | None = None,
                       owner: str | None = None, page_size: int = 500) -> Iterator[WorkloadSummary]:
        """Every matching workload, a page at a time."""
        offset: int | None = 0
        while offset is not None:
            page = self.workload_page(state=state, queue=queue, owner=owner, limit=page_size, offset=offset)
            yield from page["items"]
            offset = page.get("next_offset")

    def workload(self, workload_id: str) -> WorkloadDetail:
        out: WorkloadDetail = self.get(f"workloads/{workload_id}")
        return out

    def explain(self, workload_id: str) -> Explanation:
        out: Explanation = self.get(f"workloads/{workload_id}/explain")
        return out

    def cancel(self, workload_id: str) -> ActionResult:
        out: ActionResult = self.post(f"workloads/{workload_id}/cancel")
        return out

    def wait(self, workload_id: str, states: Collection[str] = ("succeeded", "failed", "cancelled"),
             timeout: float = 600.0, *, poll: float = 1.0) -> WorkloadDetail:
        """Return the workload once it is in one of ``states``; :class:`WaitTimeout` after
        ``timeout`` seconds (real time). Polls; a dropped connection is retried until then."""
        deadline = time.monotonic() + timeout
        last: WorkloadDetail | None = None
        while True:
            try:
                last = self.workload(workload_id)
                if last["state"] in states:
                    return last
            except ServerUnreachable:
                if time.monotonic() >= deadline:
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                err = WaitTimeout(0, f"{workload_id} not in {sorted(states)} after {timeout:g} s"
                                     f" (last seen: {last['state'] if last else 'never'})")
                err.last = last
                raise err
            time.sleep(min(poll, left))

    # ---------------------------------------------------------------- cluster
    def cluster(self) -> dict[str, Any]:
        out: dict[str, Any] = self.get("cluster")
        return out

    def nodes(self) -> list[Node]:
        out: list[Node] = self.get("nodes")["items"]
        return out

    def node(self, name: str) -> Node:
        out: Node = self.get(f"nodes/{name}")
        return out

    def node_action(self, node: str, action: str, reason: str = "") -> ActionResult:
        if action not in ("cordon", "uncordon", "drain"):
            raise ValueError("action must be cordon, uncordon or drain")
        out: ActionResult = self.post(f"nodes/{node}/{action}", {"reason": reason})
        return out

    def queues(self) -> list[Queue]:
        out: list[Queue] = self.get("queues")["items"]
        return out

    def set_queue(self, name: str, spec: Mapping[str, Any]) -> Queue:
        out: Queue = self._send("PUT", f"/api/v1/queues/{name}", json=dict(spec))
        return out

    def decisions(self, **filters: Any) -> list[Decision]:
        out: list[Decision] = self.get("decisions", **filters)["items"]
        return out

    # -------------------------------------------------------------- operations
    def audit(self, **filters: Any) -> list[AuditRecord]:
        out: list[AuditRecord] = self.get("audit", **filters)["items"]
        return out

    def verify_audit(self) -> dict[str, Any]:
        out: dict[str, Any] = self.get("audit/verify")
        return out

    def scenarios(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.get("scenarios")["items"]
        return out

    def trigger(self, scenario: str, target: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = self.post(f"scenarios/{scenario}", {"target": target} if target else {})
        return out

    def agent(self) -> AgentStatus:
        out: AgentStatus = self.get("agent")
        return out

    def set_agent_mode(self, mode: str) -> AgentStatus:
        out: AgentStatus = self._send("PUT", "/api/v1/agent/mode", json={"mode": mode})
        return out

    def approvals(self) -> list[Approval]:
        out: list[Approval] = self.get("agent/approvals")["items"]
        return out

    def decide(self, approval_id: str, approve: bool, comment: str = "") -> ActionResult:
        verb = "approve" if approve else "reject"
        out: ActionResult = self.post(f"agent/approvals/{approval_id}/{verb}", {"comment": comment})
        return out

    def whoami(self) -> dict[str, Any]:
        out: dict[str, Any] = self.get("whoami")
        return out

    def tokens(self) -> list[TokenInfo]:
        out: list[TokenInfo] = self.get("tokens")["items"]
        return out

    def create_token(
        self, name: str, role: str, *, queues: list[str] | None = None,
        max_priority: int | str | None = None, allow_protected: bool = True,
    ) -> TokenCreated:
        """A token (admin); with a policy: the queues it may submit to, its highest
        priority (an integer or a class name), whether it may submit protected work."""
        body: dict[str, Any] = {"name": name, "role": role, "allow_protected": allow_protected}
        if queues is not None:
            body["queues"] = list(queues)
        if max_priority is not None:
            body["max_priority"] = max_priority
        out: TokenCreated = self.post("tokens", body)
        return out

    def revoke_token(self, token_id: str) -> ActionResult:
        out: ActionResult = self._send("DELETE", f"/api/v1/tokens/{token_id}")
        return out

    # ----------------------------------------------------------------- streams
    def stream(
        self,
        topics: Iterable[str] = ("telemetry", "state", "reasoning", "audit"),
        *,
        last_event_id: int | None = None,
        workload: str | None = None,
        correlation_id: str | None = None,
        notices: bool = False,
        reconnect: bool = True,
        max_retries: int | None = None,
    ) -> Iterator[StreamEvent]:
        """Live events, forever (break out of the loop to stop). Resume with ``last_event_id``.

        With ``reconnect`` (the default) a dropped connection is opened again with
        backoff, resuming after the last event seen (the server replays what was
        missed, or says ``gap``); ``max_retries`` failures in a row raise
        :class:`ServerUnreachable`. A ``reconnecting`` notice is yielded (with
        ``notices``) before each wait."""
        topics = list(topics)
        failures = 0
        while True:
            params, headers = _stream_request(topics, last_event_id, workload, correlation_id)
            try:
                with self._http.stream("GET", "/api/v1/streams", params=params, headers=headers,
                                       timeout=httpx.Timeout(30.0, read=None)) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        _check(resp)
                    failures = 0
                    for ev in parse_sse(resp.iter_lines()):
                        if ev.id is not None:
                            last_event_id = ev.id
                        elif not notices:
                            continue
                        yield ev
                reason = "the server closed the stream"
            except _TRANSPORT_ERRORS as exc:
                reason = str(exc) or type(exc).__name__
            if not reconnect:
                raise ServerUnreachable(self.url, reason)
            failures += 1
            if max_retries is not None and failures > max_retries:
                raise ServerUnreachable(self.url, f"{reason} (gave up after {max_retries} retries)")
            wait = _backoff(failures)
            if notices:
                yield StreamEvent("reconnecting", None, {"message": f"{reason}; again in {wait:.1f} s",
                                                         "attempt": failures})
            time.sleep(wait)


# ============================================================= the async client
class AsyncClient:
    """The async twin of :class:`Client` (httpx.AsyncClient): the same methods, awaited;
    :meth:`stream` is an async iterator."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        context: str | None = None,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url, self.token = resolve(url, token, context)
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = await self._http.request(method, path, **kwargs)
        except _TRANSPORT_ERRORS as exc:
            raise ServerUnreachable(self.url, str(exc) or type(exc).__name__) from None
        return _check(resp)

    async def get(self, path: str, **params: Any) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        return await self._send("GET", f"/api/v1/{path.lstrip('/')}", params=clean)

    async def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return await self._send("POST", f"/api/v1/{path.lstrip('/')}", json=body, **kwargs)

    async def health(self) -> dict[str, Any]:
        out: dict[str, Any] = await self._send("GET", "/healthz")
        return out

    async def submit(self, specs: Any, *, correlation_id: str | None = None) -> SubmitResult:
        headers = {"X-Correlation-ID": correlation_id} if correlation_id else {}
        out: SubmitResult = await self.post("workloads", specs, headers=headers)
        return out

    async def submit_text(self, text: str, *, yaml: bool = True,
                          correlation_id: str | None = None) -> SubmitResult:
        headers = {"Content-Type": "application/yaml" if yaml else "application/json"}
        if correlation_id:
            headers["X-Correlation-ID"] = correlation_id
        out: SubmitResult = await self._send("POST", "/api/v1/workloads", content=text.encode(), headers=headers)
        return out

    async def submit_file(self, path: str | Path, *, correlation_id: str | None = None) -> list[str]:
        text, is_yaml = _spec_text(path)
        return list((await self.submit_text(text, yaml=is_yaml, correlation_id=correlation_id))["created"])

    async def workload_page(self, *, state: str | None = None, queue: str | None = None,
                            owner: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = await self.get("workloads", state=state, queue=queue, owner=owner, limit=limit,
                                             offset=offset or None)
        return out

    async def workloads(self, *, state: str | None = None, queue: str | None = None,
                        owner: str | None = None, limit: int = 100) -> list[WorkloadSummary]:
        out: list[WorkloadSummary] = (await self.workload_page(state=state, queue=queue, owner=owner,
                                                               limit=limit))["items"]
        return out

    async def workload(self, workload_id: str) -> WorkloadDetail:
        out: WorkloadDetail = await self.get(f"workloads/{workload_id}")
        return out

    async def explain(self, workload_id: str) -> Explanation:
        out: Explanation = await self.get(f"workloads/{workload_id}/explain")
        return out

    async def cancel(self, workload_id: str) -> ActionResult:
        out: ActionResult = await self.post(f"workloads/{workload_id}/cancel")
        return out

    async def wait(self, workload_id: str, states: Collection[str] = ("succeeded", "failed", "cancelled"),
                   timeout: float = 600.0, *, poll: float = 1.0) -> WorkloadDetail:
        """See :meth:`Client.wait`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: WorkloadDetail | None = None
        while True:
            try:
                last = await self.workload(workload_id)
                if last["state"] in states:
                    return last
            except ServerUnreachable:
                if loop.time() >= deadline:
                    raise
            left = deadline - loop.time()
            if left <= 0:
                err = WaitTimeout(0, f"{workload_id} not in {sorted(states)} after {timeout:g} s"
                                     f" (last seen: {last['state'] if last else 'never'})")
                err.last = last
                raise err
            await asyncio.sleep(min(poll, left))

    async def nodes(self) -> list[Node]:
        out: list[Node] = (await self.get("nodes"))["items"]
        return out

    async def node(self, name: str) -> Node:
        out: Node = await self.get(f"nodes/{name}")
        return out

    async def node_action(self, node: str, action: str, reason: str = "") -> ActionResult:
        if action not in ("cordon", "uncordon", "drain"):
            raise ValueError("action must be cordon, uncordon or drain")
        out: ActionResult = await self.post(f"nodes/{node}/{action}", {"reason": reason})
        return out

    async def queues(self) -> list[Queue]:
        out: list[Queue] = (await self.get("queues"))["items"]
        return out

    async def audit(self, **filters: Any) -> list[AuditRecord]:
        out: list[AuditRecord] = (await self.get("audit", **filters))["items"]
        return out

    async def agent(self) -> AgentStatus:
        out: AgentStatus = await self.get("agent")
        return out

    async def approvals(self) -> list[Approval]:
        out: list[Approval] = (await self.get("agent/approvals"))["items"]
        return out

    async def decide(self, approval_id: str, approve: bool, comment: str = "") -> ActionResult:
        verb = "approve" if approve else "reject"
        out: ActionResult = await self.post(f"agent/approvals/{approval_id}/{verb}", {"comment": comment})
        return out

    async def whoami(self) -> dict[str, Any]:
        out: dict[str, Any] = await self.get("whoami")
        return out

    async def stream(
        self,
        topics: Iterable[str] = ("telemetry", "state", "reasoning", "audit"),
        *,
        last_event_id: int | None = None,
        workload: str | None = None,
        correlation_id: str | None = None,
        notices: bool = False,
        reconnect: bool = True,
        max_retries: int | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> AsyncIterator[StreamEvent]:
        """See :meth:`Client.stream`."""
        topics = list(topics)
        failures = 0
        while True:
            params, headers = _stream_request(topics, last_event_id, workload, correlation_id)
            try:
                async with self._http.stream("GET", "/api/v1/streams", params=params, headers=headers,
                                             timeout=httpx.Timeout(30.0, read=None)) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        _check(resp)
                    failures = 0
                    parser = _SseParser()
                    async for line in resp.aiter_lines():
                        ev = parser.feed(line)
                        if ev is None:
                            continue
                        if ev.id is not None:
                            last_event_id = ev.id
                        elif not notices:
                            continue
                        yield ev
                reason = "the server closed the stream"
            except _TRANSPORT_ERRORS as exc:
                reason = str(exc) or type(exc).__name__
            if not reconnect:
                raise ServerUnreachable(self.url, reason)
            failures += 1
            if max_retries is not None and failures > max_retries:
                raise ServerUnreachable(self.url, f"{reason} (gave up after {max_retries} retries)")
            wait = _backoff(failures)
            if notices:
                yield StreamEvent("reconnecting", None, {"message": f"{reason}; again in {wait:.1f} s",
                                                         "attempt": failures})
            await sleep(wait)
