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
local server); ``MLWE_LLM_ON_FAILURE`` (``nothing``, the default, or ``rules``: what
happens when the model fails to decide, see
:func:`~mlwe.agent.reasoners.llm_common.fall_back`). Needs the ``openai`` package
(``pip install 'mlwe[openai]'``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from mlwe.agent.reasoners.base import Choice, Situation, ToolCall
from mlwe.agent.reasoners.llm_common import (
    ENV_ON_FAILURE,
    SYSTEM_PROMPT,
    TOOL_NAMES,
    Guardrail,
    LLMNotConfigured,
    check_on_failure,
    declared_parameters,
    fall_back,
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
        max_tokens: int | None = 1024,
        allowed_tools: tuple[str, ...] = TOOL_NAMES,
        on_failure: str = "nothing",
    ) -> None:
        if not isinstance(model, str) or not model.strip():
            raise LLMNotConfigured(HOW_TO_CONFIGURE)
        if max_rounds < 1 or max_calls < 1:
            raise ValueError("max_rounds and max_calls must be at least 1")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens must be at least 1 (or None: the server's limit)")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.on_failure = check_on_failure(on_failure)
        self.max_tokens = max_tokens  # a rambling model is cut off, not waited for
        self.timeout_s = timeout_s
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
        options.setdefault("on_failure", env.get(ENV_ON_FAILURE, "").strip() or "nothing")
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
                    "parameters": declared_parameters(spec),
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
                extra: dict[str, Any] = {}
                if self.max_tokens is not None:
                    extra["max_tokens"] = self.max_tokens
                resp = self.client.chat.completions.create(
                    model=self.model,
                    messages=messages,
                    tools=spec,
                    tool_choice="auto",
                    temperature=self.temperature,
                    **extra,
                )
                msg = resp.choices[0].message
            except Exception as exc:  # an endpoint down or talking nonsense: decide nothing
                error = f"the model endpoint failed: {type(exc).__name__}: {_short(exc)}"
                break
            try:
                text = _text(msg)
                tool_calls = list(getattr(msg, "tool_calls", None) or ())
                ids = [str(getattr(tc, "id", None) or f"call_{_round}_{i}")
                       for i, tc in enumerate(tool_calls)]
                fns = [getattr(tc, "function", None) for tc in tool_calls]
                named = [(getattr(fn, "name", None), getattr(fn, "arguments", None))
                         for fn in fns]
            except Exception as exc:  # an answer of the wrong shape: not a decision
                error = f"the model's answer could not be read: {type(exc).__name__}: {_short(exc)}"
                break
            if not tool_calls:
                final_text = text
                break
            messages.append(
                {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [
                        {"id": cid, "type": "function",
                         "function": {"name": str(name), "arguments": _raw_text(raw)}}
                        for cid, (name, raw) in zip(ids, named)
                    ],
                }
            )
            for cid, (name, raw) in zip(ids, named):
                # the guardrail checks the call (a name or arguments that do not parse are
                # refused with the reason, which goes back to the model) before it runs
                result, record = run_tool_call(tools, guard, name, raw)
                calls.append(record)
                messages.append(
                    {"role": "tool", "tool_call_id": cid, "content": tool_result_text(result)}
                )
        else:
            error = f"the model was still calling tools after {self.max_rounds} rounds; stopped"
        choice = make_choice(
            self.name, self.model, situation, tools, calls, final_text=final_text, error=error
        )
        return fall_back(choice, error, situation, tools, self.on_failure)


def _text(msg: Any) -> str:
    content = getattr(msg, "content", None)
    return content if isinstance(content, str) else ""


def _raw_text(raw: object) -> str:
    """Arguments as the text the model sent (echoed back in the conversation)."""
    if isinstance(raw, str):
        return raw
    try:
        return json.dumps(raw)
    except (TypeError, ValueError):
        return str(raw)


def _short(exc: Exception) -> str:
    text = sanitize_text(str(exc)).replace("\n", " ")
    return text[:300]

