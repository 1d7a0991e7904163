"""Reasoners: choose among candidate plans and explain why (see ``base``).

``make_reasoner(name)`` builds one by name. ``rules`` (the default) is
deterministic and needs no network; LLM reasoners register here when their
modules are importable (their optional dependencies are installed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlwe.agent.reasoners.base import (
    Choice,
    Consideration,
    Feedback,
    Reasoner,
    ReasoningTrace,
    Situation,
    ToolCall,
)
from mlwe.agent.reasoners.rules import DEFAULT_WEIGHTS, RulesReasoner


def _openai(**options: Any) -> Reasoner:
    # imported on use: a model client is optional, and configured from the environment
    from mlwe.agent.reasoners.llm_openai import OpenAIReasoner

    return OpenAIReasoner.from_env(**options)


def _adk(**options: Any) -> Reasoner:
    from mlwe.agent.reasoners.llm_adk import AdkReasoner

    return AdkReasoner.from_env(**options)


#: name -> factory; the LLM reasoners raise LLMNotConfigured naming what to set
REASONERS: dict[str, Callable[..., Reasoner]] = {
    "rules": RulesReasoner,
    "openai": _openai,
    "adk": _adk,
}


def register(name: str, factory: Callable[..., Reasoner]) -> None:
    REASONERS[name] = factory


def make_reasoner(name: str = "rules", **options: Any) -> Reasoner:
    try:
        factory = REASONERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoner {name!r}; available: {', '.join(sorted(REASONERS))}"
        ) from None
    return factory(**options)


__all__ = [
    "DEFAULT_WEIGHTS",
    "REASONERS",
    "Choice",
    "Consideration",
    "Feedback",
    "Reasoner",
    "ReasoningTrace",
    "RulesReasoner",
    "Situation",
    "ToolCall",
    "make_reasoner",
    "register",
]
