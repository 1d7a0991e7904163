"""A reasoner timed, counted and given a budget of deliberations (the soak, and a
bounded ``mlwe agent eval``): past the budget it decides nothing without asking the
model, and says so in its trace, so a run goes on to its horizon and can still be
compared with the world without the agent."""

from __future__ import annotations

import re
import time
from collections import Counter

from mlwe.agent.reasoners.base import Choice, Reasoner, ReasoningTrace, Situation
from mlwe.agent.tools import AgentTools

BUDGET_SPENT = "deliberation budget spent: the model was not asked"

_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"\b\d+(\.\d+)?\b")


def reason_class(reason: str) -> str:
    """A reason without its ids and numbers: alike reasons add up."""
    text = _QUOTED.sub("'…'", reason)
    text = _NUMBER.sub("N", text)
    return text[:160]


class MeteredReasoner:
    """A reasoner, timed and counted; past ``budget`` deliberations it decides nothing
    without asking the model (the runs then go on to their horizon)."""

    def __init__(self, inner: Reasoner, budget: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.model = getattr(inner, "model", None)
        self.budget = budget
        self.deliberations = 0
        self.latency_ms: list[float] = []
        self.errors: Counter[str] = Counter()

    @property
    def spent(self) -> bool:
        return self.deliberations >= self.budget

    def choose(self, situation: Situation, tools: AgentTools) -> Choice:
        if self.spent:
            return Choice(None, ReasoningTrace(self.name, ("budget spent",), (), "nothing",
                                               (BUDGET_SPENT,)))
        self.deliberations += 1
        t0 = time.perf_counter()
        choice = self.inner.choose(situation, tools)
        self.latency_ms.append((time.perf_counter() - t0) * 1000)
        for w in choice.trace.why:
            if w.startswith(("the model endpoint failed", "the model's answer could not",
                             "the model was still calling", "the ADK agent failed")):
                self.errors[": ".join(x.strip() for x in w.split(":", 2)[:2])] += 1
        return choice


