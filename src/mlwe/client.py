"""A small Python client for a running mlwe server (``mlwe serve``), over httpx.

    from mlwe.client import Client
    with Client("http://localhost:8080", token="mlwe_...") as c:
        created = c.submit_file("job.yaml")
        print(c.explain(created[0])["summary"])
        for ev in c.stream(["state"]):
            print(ev.topic, ev.data)

``url`` and ``token`` default to ``$MLWE_URL`` (else http://127.0.0.1:8080) and
``$MLWE_TOKEN``. Every failure raises :class:`ClientError` with the HTTP
status, the server's message and each problem it named.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"

__all__ = ["Client", "ClientError", "StreamEvent"]


class ClientError(RuntimeError):
    def __init__(self, status: int, detail: str, errors: list[dict[str, str]] | None = None) -> None:
        self.status = status
        self.detail = detail
        self.errors = errors or []
        lines = [f"{status}: {detail}"]
        for e in self.errors:
            where = e.get("path") or ""
            lines.append(f"  {where + ': ' if where else ''}{e.get('message', '')}")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class StreamEvent:
    """One Server-Sent Event: ``topic`` is the SSE event name (a stream topic, or a notice
    such as ``dropped``, ``gap``, ``hello``); ``id`` is None for notices."""

    topic: str
    id: int | None
    data: dict[str, Any] = field(default_factory=dict)


def _check(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        try:
            body = resp.json()
        except ValueError:
            body = {"detail": resp.text[:500] or resp.reason_phrase}
        detail = body.get("detail") if isinstance(body, dict) else str(body)
        errors = body.get("errors") if isinstance(body, dict) else None
        raise ClientError(resp.status_code, str(detail), errors if isinstance(errors, list) else None)
    if resp.headers.get("content-type", "").startswith("application/json"):
        return resp.json()
    return resp.text


def parse_sse(lines: Iterable[str]) -> Iterator[StreamEvent]:
    """Events from the lines of an SSE response (the wire format of ``mlwe.api.sse``)."""
    event, ident = "message", None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r")
        if line == "":
            if data:
                try:
                    payload = json.loads("\n".join(data))
                except ValueError:
                    payload = {"text": "\n".join(data)}
                yield StreamEvent(event, ident, payload if isinstance(payload, dict) else {"value": payload})
            event, data, ident = "message", [], None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            try:
                ident = int(value)
            except ValueError:
                ident = None


class Client:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = (url or os.environ.get("MLWE_URL") or DEFAULT_URL).rstrip("/")
        self.token = token or os.environ.get("MLWE_TOKEN")
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

    # ------------------------------------------------------------------ basic
    def get(self, path: str, **params: Any) -> Any:
        clean = {k: v for k, v in params.items() if v is not None}
        return _check(self._http.get(f"/api/v1/{path.lstrip('/')}", params=clean))

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return _check(self._http.post(f"/api/v1/{path.lstrip('/')}", json=body, **kwargs))

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = _check(self._http.get("/healthz"))
        return out

    def metrics(self) -> str:
        return str(_check(self._http.get("/metrics")))

    # -------------------------------------------------------------- workloads
    def submit(self, specs: Any, *, correlation_id: str | None = None) -> dict[str, Any]:
        """Submit a spec dict, a list of them, or ``{"workloads": [...]}``."""
        headers = {"X-Correlation-ID": correlation_id} if correlation_id else {}
        out: dict[str, Any] = self.post("workloads", specs, headers=headers)
        return out

    def submit_text(self, text: str, *, yaml: bool = True, correlation_id: str | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/yaml" if yaml else "application/json"}
        if correlation_id:
            headers["X-Correlation-ID"] = correlation_id
        out: dict[str, Any] = _check(
            self._http.post("/api/v1/workloads", content=text.encode(), headers=headers)
        )
        return out

    def submit_file(self, path: str | Path, *, correlation_id: str | None = None) -> list[str]:
        """Submit the specs in a YAML or JSON file; returns the ids created."""
        p = Path(path)
        res = self.submit_text(
            p.read_text(encoding="utf-8"),
            yaml=p.suffix.lower() != ".json",
            correlation_id=correlation_id,
        )
        return list(res["created"])

    def validate_text(self, text: str, *, yaml: bool = True) -> dict[str, Any]:
        headers = {"Content-Type": "application/yaml" if yaml else "application/json"}
        out: dict[str, Any] = _check(
            self._http.post("/api/v1/workloads/validate", content=text.encode(), headers=headers)
        )
        return out

    def workloads(self, *, state: str | None = None, queue: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.get("workloads", state=state, queue=queue, limit=limit)["items"]
        return out

    def workload(self, workload_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self.get(f"workloads/{workload_id}")
        return out

    def explain(self, workload_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self.get(f"workloads/{workload_id}/explain")
        return out

    def cancel(self, workload_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self.post(f"workloads/{workload_id}/cancel")
        return out

    # ---------------------------------------------------------------- cluster
    def cluster(self) -> dict[str, Any]:
        out: dict[str, Any] = self.get("cluster")
        return out

    def nodes(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.get("nodes")["items"]
        return out

    def node_action(self, node: str, action: str, reason: str = "") -> dict[str, Any]:
        if action not in ("cordon", "uncordon", "drain"):
            raise ValueError("action must be cordon, uncordon or drain")
        out: dict[str, Any] = self.post(f"nodes/{node}/{action}", {"reason": reason})
        return out

    def queues(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.get("queues")["items"]
        return out

    def set_queue(self, name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = _check(self._http.put(f"/api/v1/queues/{name}", json=dict(spec)))
        return out

    def decisions(self, **filters: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.get("decisions", **filters)["items"]
        return out

    # -------------------------------------------------------------- operations
    def audit(self, **filters: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.get("audit", **filters)["items"]
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

    def agent(self) -> dict[str, Any]:
        out: dict[str, Any] = self.get("agent")
        return out

    def set_agent_mode(self, mode: str) -> dict[str, Any]:
        out: dict[str, Any] = _check(self._http.put("/api/v1/agent/mode", json={"mode": mode}))
        return out

    def approvals(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.get("agent/approvals")["items"]
        return out

    def decide(self, approval_id: str, approve: bool, comment: str = "") -> dict[str, Any]:
        verb = "approve" if approve else "reject"
        out: dict[str, Any] = self.post(f"agent/approvals/{approval_id}/{verb}", {"comment": comment})
        return out

    def whoami(self) -> dict[str, Any]:
        out: dict[str, Any] = self.get("whoami")
        return out

    def create_token(self, name: str, role: str) -> dict[str, Any]:
        out: dict[str, Any] = self.post("tokens", {"name": name, "role": role})
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
    ) -> Iterator[StreamEvent]:
        """Live events, forever (break out of the loop to stop). Resume with ``last_event_id``."""
        params: dict[str, Any] = {"topics": ",".join(topics)}
        if workload:
            params["workload"] = workload
        if correlation_id:
            params["correlation_id"] = correlation_id
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        with self._http.stream(
            "GET", "/api/v1/streams", params=params, headers=headers, timeout=httpx.Timeout(30.0, read=None)
        ) as resp:
            if resp.status_code >= 400:
                resp.read()
                _check(resp)
            for ev in parse_sse(resp.iter_lines()):
                if ev.id is None and not notices:
                    continue
                yield ev
