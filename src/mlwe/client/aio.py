"""The async client, :class:`AsyncClient` (over ``httpx.AsyncClient``): the sync client's twin."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from mlwe.client.answers import (
    ActionResult,
    AgentStatus,
    Approval,
    AuditRecord,
    Explanation,
    Node,
    Queue,
    SubmitResult,
    WorkloadDetail,
    WorkloadSummary,
)
from mlwe.client.errors import ServerUnreachable, WaitTimeout, _check
from mlwe.client.streams import (
    _TRANSPORT_ERRORS,
    StreamEvent,
    _retry_or_raise,
    _SseParser,
    _stream_request,
)
from mlwe.client.sync import _spec_text
from mlwe.clientconfig import resolve


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
            retry = _retry_or_raise(self.url, reason, failures, reconnect=reconnect,
                                    max_retries=max_retries, notices=notices)
            failures = retry.failures
            if retry.notice is not None:
                yield retry.notice
            await sleep(retry.wait)
