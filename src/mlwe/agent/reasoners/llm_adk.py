"""The ``adk`` reasoner: a Google ADK ``LlmAgent`` over the same typed tools.

The agent's tools are the five functions of :mod:`mlwe.agent.tools`, declared
to the model from the same JSON schemas (``TOOL_SPECS``), and its
``before_tool_callback`` is the guardrail: a call outside the allowed set or
with bad arguments is answered with a refusal instead of running (the model
may correct itself), and every call, refused or not, is recorded in the
reasoning trace. The model is Gemini when a key is configured (or Vertex AI),
or any model through ADK's LiteLLM bridge (``provider/model`` names, with the
``litellm`` package installed). Like every reasoner it only chooses; the loop
and the control plane verify what it proposes.

Configuration (``AdkReasoner.from_env``): ``MLWE_ADK_MODEL`` (default
``gemini-2.5-flash``; ``openai/...``, ``ollama_chat/...``, ... go through
LiteLLM); for Gemini ``GOOGLE_API_KEY`` (or ``GEMINI_API_KEY``), or
``GOOGLE_GENAI_USE_VERTEXAI=true`` with ``GOOGLE_CLOUD_PROJECT``;
``MLWE_ADK_BASE_URL`` points the Gemini client at another endpoint that speaks
its API, or a LiteLLM model at its server (``openai/<name>`` with an
OpenAI-compatible server's ``.../v1`` URL: vLLM, llama.cpp's server, Ollama);
``MLWE_LLM_ON_FAILURE`` (``nothing`` or ``rules``) as for the ``openai`` reasoner.
Needs Google ADK (``pip install 'mlwe[adk]'``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from mlwe.agent.reasoners.base import Choice, Situation, ToolCall
from mlwe.agent.reasoners.llm_common import (
    ENV_ON_FAILURE,
    SYSTEM_PROMPT,
    TOOL_NAMES,
    Guardrail,
    LLMNotConfigured,
    Verdict,
    check_on_failure,
    declared_parameters,
    fall_back,
    make_choice,
    run_tool_call,
    situation_prompt,
)
from mlwe.agent.tools import TOOL_SPECS, AgentTools
from mlwe.store.sanitize import sanitize_text

log = logging.getLogger("mlwe.agent.adk")
T = TypeVar("T")

ENV_MODEL = "MLWE_ADK_MODEL"
ENV_BASE_URL = "MLWE_ADK_BASE_URL"
ENV_KEYS = ("GOOGLE_API_KEY", "GEMINI_API_KEY")
DEFAULT_MODEL = "gemini-2.5-flash"

HOW_TO_CONFIGURE = (
    "the 'adk' reasoner needs a model: for Gemini set GOOGLE_API_KEY (or GEMINI_API_KEY),"
    " or GOOGLE_GENAI_USE_VERTEXAI=true with GOOGLE_CLOUD_PROJECT (and GOOGLE_CLOUD_LOCATION)"
    f" for Vertex AI; or set {ENV_MODEL}=<provider>/<model> (e.g. openai/gpt-4o-mini,"
    " ollama_chat/llama3.1) to use any model through ADK's LiteLLM bridge"
    " (pip install litellm, plus that provider's own settings)."
    f" {ENV_MODEL} picks the Gemini model (default {DEFAULT_MODEL})."
    " Without one, use the default 'rules' reasoner (no model needed)."
)
NEEDS_ADK = "the 'adk' reasoner needs Google ADK: pip install 'mlwe[adk]'"


def adk_available() -> bool:
    try:
        import google.adk  # noqa: F401
    except ImportError:
        return False
    return True


def _is_litellm(model: str) -> bool:
    return "/" in model and not model.startswith(("projects/", "models/", "gemini"))


def make_model(
    model: str, *, api_key: str | None = None, base_url: str | None = None
) -> Any:
    """The ADK model object for ``model`` (Gemini, or LiteLLM for provider/model names)."""
    if not adk_available():
        raise LLMNotConfigured(NEEDS_ADK)
    if _is_litellm(model):
        # offline-safe: LiteLLM otherwise fetches its model price list from the internet
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        try:
            from google.adk.models.lite_llm import LiteLlm
        except ImportError:
            raise LLMNotConfigured(
                f"model {model!r} goes through ADK's LiteLLM bridge, which needs the litellm"
                " package: pip install litellm"
            ) from None
        extra: dict[str, Any] = {}
        if base_url:  # an OpenAI-compatible server of one's own (local ones take any key)
            extra = {"api_base": base_url, "api_key": api_key or "not-needed"}
        elif api_key:
            extra = {"api_key": api_key}
        return LiteLlm(model=model, **extra)
    from google.adk.models import Gemini

    kwargs: dict[str, Any] = {"model": model}
    if base_url:
        kwargs["base_url"] = base_url
    if api_key:
        kwargs["client_kwargs"] = {"api_key": api_key}
    return Gemini(**kwargs)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end from synchronous code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class AdkReasoner:
    name = "adk"

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        llm: Any | None = None,
        max_calls: int = 24,
        max_llm_calls: int = 10,
        max_tokens: int | None = 1024,
        allowed_tools: tuple[str, ...] = TOOL_NAMES,
        on_failure: str = "nothing",
    ) -> None:
        if not adk_available():
            raise LLMNotConfigured(NEEDS_ADK)
        if max_calls < 1 or max_llm_calls < 1:
            raise ValueError("max_calls and max_llm_calls must be at least 1")
        self.model = model
        self.llm = llm if llm is not None else make_model(model, api_key=api_key,
                                                           base_url=base_url)
        self.max_calls = max_calls
        self.max_llm_calls = max_llm_calls
        self.max_tokens = max_tokens
        self.allowed_tools = allowed_tools
        self.on_failure = check_on_failure(on_failure)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **options: Any) -> AdkReasoner:
        """Built from the environment; raises :class:`LLMNotConfigured` saying what to set."""
        env = os.environ if env is None else env
        if not adk_available():
            raise LLMNotConfigured(NEEDS_ADK)
        model = options.pop("model", None) or env.get(ENV_MODEL, "").strip() or DEFAULT_MODEL
        base_url = options.pop("base_url", None) or env.get(ENV_BASE_URL, "").strip() or None
        api_key = options.pop("api_key", None) or next(
            (env[k].strip() for k in ENV_KEYS if env.get(k, "").strip()), None
        )
        vertex = env.get("GOOGLE_GENAI_USE_VERTEXAI", "").strip().lower() in ("1", "true", "yes")
        options.setdefault("on_failure", env.get(ENV_ON_FAILURE, "").strip() or "nothing")
        if not _is_litellm(model) and not (api_key or vertex):
            raise LLMNotConfigured(HOW_TO_CONFIGURE)
        return cls(model, api_key=api_key, base_url=base_url, **options)

    # --------------------------------------------------------------- choose
    def choose(self, situation: Situation, tools: AgentTools) -> Choice:
        guard = Guardrail(self.allowed_tools, max_calls=self.max_calls)
        calls: list[ToolCall] = []
        try:
            final_text = _run(self._converse(situation, tools, guard, calls))
            error = None
        except Exception as exc:  # model endpoint down, limit hit, ADK error: decide nothing
            log.warning("adk reasoner: %s: %s", type(exc).__name__, exc)
            final_text = ""
            error = f"the ADK agent failed: {type(exc).__name__}: {_short(exc)}"
        choice = make_choice(
            self.name, self.model, situation, tools, calls, final_text=final_text, error=error
        )
        return fall_back(choice, error, situation, tools, self.on_failure)

    async def _converse(
        self, situation: Situation, tools: AgentTools, guard: Guardrail, calls: list[ToolCall]
    ) -> str:
        from google.adk.agents import LlmAgent, RunConfig
        from google.adk.runners import InMemoryRunner
        from google.adk.tools.base_tool import BaseTool
        from google.adk.tools.tool_context import ToolContext
        from google.genai import types

        class TypedTool(BaseTool):
            """One of mlwe's typed tools, declared from its JSON schema."""

            def __init__(self, spec: Mapping[str, Any]) -> None:
                super().__init__(name=str(spec["name"]), description=str(spec["description"]))
                self.spec = spec

            def _get_declaration(self) -> types.FunctionDeclaration:
                return types.FunctionDeclaration(
                    name=self.name,
                    description=self.description,
                    parameters_json_schema=declared_parameters(self.spec),
                )

            async def run_async(self, *, args: dict[str, Any], tool_context: ToolContext) -> Any:
                # the guardrail passed it (before_tool_callback); run it and record the call
                result, record = run_tool_call(tools, _PASS, self.name, args)
                calls.append(record)
                return result

        def before_tool(tool: Any, args: dict[str, Any], tool_context: Any) -> dict[str, Any] | None:
            name = getattr(tool, "name", None)
            verdict = guard.check(name, args)
            if verdict.ok:
                args.clear()
                args.update(verdict.arguments)
                return None
            calls.append(
                ToolCall(str(name)[:100], dict(args), False,
                         f"refused by the guardrail: {verdict.reason}"[:300])
            )
            return {"ok": False, "error": f"refused: {verdict.reason}"}

        agent = LlmAgent(
            name="mlwe_agent",
            model=self.llm,
            instruction=SYSTEM_PROMPT,
            tools=[TypedTool(s) for s in TOOL_SPECS if s["name"] in self.allowed_tools],
            before_tool_callback=before_tool,
            generate_content_config=types.GenerateContentConfig(
                temperature=0.0, max_output_tokens=self.max_tokens),
        )
        runner = InMemoryRunner(agent=agent, app_name="mlwe")
        session = await runner.session_service.create_session(app_name="mlwe", user_id="mlwe")
        message = types.Content(role="user", parts=[types.Part(text=situation_prompt(situation))])
        final = ""
        try:
            async for event in runner.run_async(
                user_id="mlwe",
                session_id=session.id,
                new_message=message,
                run_config=RunConfig(max_llm_calls=self.max_llm_calls),
            ):
                content = getattr(event, "content", None)
                parts = getattr(content, "parts", None) or []
                text = "".join(p.text for p in parts if getattr(p, "text", None))
                if text and not any(getattr(p, "function_call", None) for p in parts):
                    final = text
        finally:
            close = getattr(runner, "close", None)
            if close is not None:
                await close()
        return final


class _PassThrough(Guardrail):
    """The guardrail already ran in ``before_tool_callback``; do not count the call twice."""

    def check(self, tool: object, raw_arguments: object) -> Verdict:
        args = dict(raw_arguments) if isinstance(raw_arguments, Mapping) else {}
        return Verdict(True, args)


_PASS = _PassThrough()


def _short(exc: Exception) -> str:
    return sanitize_text(str(exc)).replace("\n", " ")[:300]
