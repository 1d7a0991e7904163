"""The sync client, :class:`Client` (over ``httpx.Client``)."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from mlwe.client.answers import (
    ActionResult,
    AgentStatus,
    Approval,
    AuditRecord,
    Decision,
    Explanation,
    Node,
    Queue,
    SubmitResult,
    TokenCreated,
    TokenInfo,
    WorkloadDetail,
    WorkloadSummary,
)
from mlwe.client.errors import ServerUnreachable, WaitTimeout, _check
from mlwe.client.streams import (
    _TRANSPORT_ERRORS,
    StreamEvent,
    _retry_or_raise,
    _stream_request,
    parse_sse,
)
from mlwe.clientconfig import resolve


def _spec_text(path: str | Path) -> tuple[str, bool]:
    """A spec file's text, and whether it is YAML (anything but .json)."""
    p = Path(path)
    return p.read_text(encoding="utf-8"), p.suffix.lower() != ".json"


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
            retry = _retry_or_raise(self.url, reason, failures, reconnect=reconnect,
                                    max_retries=max_retries, notices=notices)
            failures = retry.failures
            if retry.notice is not None:
                yield retry.notice
            time.sleep(retry.wait)
