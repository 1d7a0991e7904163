"""SCRIPTED STAND-IN MODELS: local HTTP servers that speak an LLM wire format.

No hosted model is reachable from the test machines, and the project must not
need one, so the LLM reasoners are tested against these stand-ins. They are
not language models: each replays a script of replies (a reply may be a
function of the request, to answer what the client actually sent) and records
every request, so a test can check what the reasoner sent over the wire.

- :class:`StandInOpenAI` speaks ``POST /v1/chat/completions`` (OpenAI's chat
  completions API with ``tools`` / ``tool_calls``, as vLLM and Ollama do).
- :class:`StandInGemini` speaks ``POST /v1beta/models/{model}:generateContent``
  (the Gemini API with ``functionDeclarations`` / ``functionCall``), which
  Google ADK's Gemini model uses.

Both listen on 127.0.0.1 on a free port and stop when the ``with`` block ends.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """One scripted model turn: tool calls (name, arguments) and/or text."""

    calls: tuple[tuple[str, Any], ...] = ()  # arguments: a dict, or a raw string (OpenAI only)
    text: str = ""


Script = list[Reply | Callable[[dict[str, Any]], Reply]]


@dataclass
class _StandIn:
    script: Script = field(default_factory=list)
    fail_with: int | None = None  # answer every request with this HTTP status
    requests: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    def __enter__(self) -> _StandIn:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                owner.requests.append(body)
                owner.paths.append(self.path)
                if owner.fail_with is not None:
                    self._send(owner.fail_with, {"error": {"message": "stand-in failure",
                                                           "code": owner.fail_with}})
                    return
                status, doc = owner.answer(self.path, body)
                self._send(status, doc)

            def _send(self, status: int, doc: dict[str, Any]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def next_reply(self, body: dict[str, Any]) -> Reply:
        if not self.script:
            return Reply(text="(stand-in script exhausted)")
        item = self.script.pop(0)
        return item(body) if callable(item) else item

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        raise NotImplementedError


class StandInOpenAI(_StandIn):
    """A scripted stand-in for an OpenAI-compatible chat-completions server."""

    model = "standin-model"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not path.endswith("/chat/completions"):
            return 404, {"error": {"message": f"no route {path}"}}
        reply = self.next_reply(body)
        n = len(self.requests)
        calls = [
            {
                "id": f"call_{n}_{i}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
            for i, (name, args) in enumerate(reply.calls)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
        if calls:
            message["tool_calls"] = calls
        return 200, {
            "id": f"chatcmpl-standin-{n}",
            "object": "chat.completion",
            "created": 1_700_000_000 + n,
            "model": body.get("model", self.model),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    def tool_messages(self, request: int) -> list[dict[str, Any]]:
        """The ``tool`` messages (results sent back) in the request numbered ``request``."""
        return [m for m in self.requests[request]["messages"] if m["role"] == "tool"]


class StandInGemini(_StandIn):
    """A scripted stand-in for the Gemini API's generateContent endpoint."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if ":generateContent" not in path:
            return 404, {"error": {"code": 404, "message": f"no route {path}"}}
        reply = self.next_reply(body)
        parts: list[dict[str, Any]] = [
            {"functionCall": {"name": name, "args": args}} for name, args in reply.calls
        ]
        if reply.text:
            parts.append({"text": reply.text})
        return 200, {
            "candidates": [{"content": {"role": "model", "parts": parts},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": 10, "candidatesTokenCount": 5,
                              "totalTokenCount": 15},
            "modelVersion": "standin-gemini",
        }

    def function_responses(self, request: int) -> list[dict[str, Any]]:
        """The ``functionResponse`` parts (tool results) in the request numbered ``request``."""
        out = []
        for content in self.requests[request].get("contents", []):
            for part in content.get("parts", []):
                if "functionResponse" in part:
                    out.append(part["functionResponse"])
        return out
