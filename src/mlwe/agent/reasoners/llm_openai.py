"""The ``openai`` reasoner: any OpenAI-compatible chat endpoint with tool calling.

vLLM, Ollama, llama.cpp's server, LiteLLM's proxy, or a hosted API: anything
that speaks ``POST /v1/chat/completions`` with ``tools`` and answers with
``tool_calls``. The model sees the situation and the five typed tools; each
tool call passes the :class:`~mlwe.agent.reasoners.llm_common.Guardrail`
before it runs, its result goes back as a ``tool`` message, and the
conversation ends when the model answers without a tool call (or a round or
call budget is spent). The plan it proposed last is its choice; the loop and
the control plane verify it like any other.

Configuration (``OpenAIReasoner.from_env``): ``MLWE_OPENAI_MODEL`` (required),
``MLWE_OPENAI_BASE_URL`` (or ``OPENAI_BASE_URL``; e.g.
``http://127.0.0.1:8000/v1`` for vLLM, ``http://127.0.0.1:11434/v1`` for
Ollama) and ``MLWE_OPENAI_API_KEY`` (or ``OPENAI_API_KEY``; not needed by a
local server). Needs the ``openai`` package (``pip install 'mlwe[openai]'``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from mlwe.agent.reasoners.base import Choice, Situation, ToolCall
from mlwe.agent.reasoners.llm_common import (
    SYSTEM_PROMPT,
    TOOL_NAMES,
    Guardrail,
    LLMNotConfigured,
    make_choice,
    run_tool_call,
    situation_prompt,
    tool_result_text,
)
from mlwe.agent.tools import TOOL_SPECS, AgentTools
from mlwe.store.sanitize import sanitize_text

ENV_MODEL = "MLWE_OPENAI_MODEL"
ENV_BASE_URL = ("MLWE_OPENAI_BASE_URL", "OPENAI_BASE_URL")
ENV_API_KEY = ("MLWE_OPENAI_API_KEY", "OPENAI_API_KEY")

HOW_TO_CONFIGURE = (
    "the 'openai' reasoner needs an OpenAI-compatible chat endpoint with tool calling:"
    f" set {ENV_MODEL} to the model name, and {ENV_BASE_URL[0]} to the server's URL"
    " (e.g. http://127.0.0.1:8000/v1 for vLLM, http://127.0.0.1:11434/v1 for Ollama)"
    f" and/or {ENV_API_KEY[0]} (or OPENAI_API_KEY) for a hosted API."
    " Without one, use the default 'rules' reasoner (no model needed)."
)


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for n in names:
        v = env.get(n, "").strip()
        if v:
            return v
    return None


class OpenAIReasoner:
    name = "openai"

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        client: Any | None = None,
        max_rounds: int = 8,
        max_calls: int = 24,
        timeout_s: float = 60.0,
        temperature: float = 0.0,
        allowed_tools: tuple[str, ...] = TOOL_NAMES,
    ) -> None:
        if not isinstance(model, str) or not model.strip():
            raise LLMNotConfigured(HOW_TO_CONFIGURE)
        if max_rounds < 1 or max_calls < 1:
            raise ValueError("max_rounds and max_calls must be at least 1")
        self.model = model
        self.base_url = base_url
        self.max_rounds = max_rounds
        self.max_calls = max_calls
        self.temperature = temperature
        self.allowed_tools = allowed_tools
        if client is None:
            try:
                import openai
            except ImportError:  # the optional extra is not installed
                raise LLMNotConfigured(
                    "the 'openai' reasoner needs the openai package: pip install 'mlwe[openai]'"
                ) from None
            if base_url is None and not api_key:
                raise LLMNotConfigured(HOW_TO_CONFIGURE)
            client = openai.OpenAI(
                base_url=base_url,
                # local servers (vLLM, Ollama) take any key; the client insists on one
                api_key=api_key or "not-needed",
                timeout=timeout_s,
                max_retries=1,
            )
        self.client: Any = client  # any object with chat.completions.create (a test stand-in too)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **options: Any) -> OpenAIReasoner:
        """Built from the environment; raises :class:`LLMNotConfigured` saying what to set."""
        env = os.environ if env is None else env
        model = options.pop("model", None) or env.get(ENV_MODEL, "").strip()
        base_url = options.pop("base_url", None) or _first(env, ENV_BASE_URL)
        api_key = options.pop("api_key", None) or _first(env, ENV_API_KEY)
        if not model or (base_url is None and not api_key):
            raise LLMNotConfigured(HOW_TO_CONFIGURE)
        return cls(model, base_url=base_url, api_key=api_key, **options)

    def _tools(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "function",
                "function": {
                    "name": spec["name"],
                    "description": spec["description"],
                    "parameters": spec["parameters"],
                },
            }
            for spec in TOOL_SPECS
            if spec["name"] in self.allowed_tools
        ]

    def choose(self, situation: Situation, tools: AgentTools) -> Choice:
        guard = Guardrail(self.allowed_tools, max_calls=self.max_calls)
        calls: list[ToolCall] = []
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": situation_prompt(situation)},
        ]
        final_text = ""
        error: str | None = None
        spec = self._tools()
        for _round in range(self.max_rounds):
            try:
                resp = self.client.chat.completions.create(
                    model=self.model,
                    messages=messages,
                    tools=spec,
                    tool_choice="auto",
                    temperature=self.temperature,
                )
                msg = resp.choices[0].message
            except Exception as exc:  # an endpoint down or talking nonsense: decide nothing
                error = f"the model endpoint failed: {type(exc).__name__}: {_short(exc)}"
                break
            text = msg.content or ""
            tool_calls = list(msg.tool_calls or ())
            if not tool_calls:
                final_text = text
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [
                        {
                            "id": tc.id,
                            "type": "function",
                            "function": {
                                "name": tc.function.name,
                                "arguments": tc.function.arguments,
                            },
                        }
                        for tc in tool_calls
                    ],
                }
            )
            for tc in tool_calls:
                fn = getattr(tc, "function", None)
                name = getattr(fn, "name", None)
                raw = getattr(fn, "arguments", None)
                result, record = run_tool_call(tools, guard, name, raw)
                calls.append(record)
                messages.append(
                    {"role": "tool", "tool_call_id": tc.id, "content": tool_result_text(result)}
                )
        else:
            error = f"the model was still calling tools after {self.max_rounds} rounds; stopped"
        return make_choice(
            self.name, self.model, situation, tools, calls, final_text=final_text, error=error
        )


def _short(exc: Exception) -> str:
    text = sanitize_text(str(exc)).replace("\n", " ")
    return text[:300]

