"""Reasoners: choose among candidate plans and explain why (see ``base``)."""

from mlwe.agent.reasoners.base import (
    Choice,
    Consideration,
    Feedback,
    Reasoner,
    ReasoningTrace,
    Situation,
    ToolCall,
)

__all__ = [
    "Choice",
    "Consideration",
    "Feedback",
    "Reasoner",
    "ReasoningTrace",
    "Situation",
    "ToolCall",
]
