"""The Reasoner protocol: how a reasoner sees a situation and says what it chose.

A reasoner gets a :class:`Situation` (the findings, the candidate plans the
strategies built, and feedback on earlier attempts in the same round: a plan
the control plane rejected, a plan the what-if found no better, a plan an
operator refused) plus an :class:`~mlwe.agent.tools.AgentTools` object whose
functions only read state or propose. It returns a :class:`Choice`: the plan
it picked (one of the candidates, a plan it composed through
``tools.propose``, or ``None`` for "do nothing") and a
:class:`ReasoningTrace` a person can read: what it saw, what it considered
(with the factors and weights, or the tool calls an LLM made), what it chose
and why. The loop, not the reasoner, runs the what-if and commits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mlwe.agent.model import CandidatePlan, Finding, Mode, json_dict

if TYPE_CHECKING:
    from mlwe.agent.tools import AgentTools


@dataclass(frozen=True, slots=True)
class Feedback:
    """What happened to a plan chosen earlier in the same round."""

    plan_id: str
    outcome: str  # "rejected" (control plane) | "not-better" | "not-verified" | "operator-rejected"
    reasons: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"plan_id": self.plan_id, "outcome": self.outcome, "reasons": list(self.reasons)}


@dataclass(frozen=True, slots=True)
class Situation:
    time: float
    version: int  # the control plane version the findings and plans were made on
    mode: Mode
    findings: tuple[Finding, ...]
    candidates: tuple[CandidatePlan, ...]
    feedback: tuple[Feedback, ...] = ()

    def candidate(self, plan_id: str) -> CandidatePlan | None:
        for c in self.candidates:
            if c.id == plan_id:
                return c
        return None

    def excluded(self) -> frozenset[str]:
        """Plans already tried in this round: a reasoner should not choose them again."""
        return frozenset(f.plan_id for f in self.feedback)

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {
                "time": self.time,
                "version": self.version,
                "mode": self.mode.value,
                "findings": [f.to_dict() for f in self.findings],
                "candidates": [c.to_dict() for c in self.candidates],
                "feedback": [f.to_dict() for f in self.feedback],
            }
        )


@dataclass(frozen=True, slots=True)
class Consideration:
    """One candidate as the reasoner weighed it."""

    plan_id: str
    summary: str
    score: float | None = None  # the reasoner's own score (rules: weighted sum); None for LLMs
    factors: Mapping[str, float] = field(default_factory=dict)
    contributions: Mapping[str, float] = field(default_factory=dict)  # weight x factor
    verdict: str = ""  # "chosen", "lower score", "tried: rejected (...)", ...

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {
                "plan_id": self.plan_id,
                "summary": self.summary,
                "score": self.score,
                "factors": dict(self.factors),
                "contributions": dict(self.contributions),
                "verdict": self.verdict,
            }
        )


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call a reasoner made (recorded by :class:`AgentTools`)."""

    tool: str
    arguments: Mapping[str, Any]
    ok: bool
    summary: str  # a short account of the result (or the error)

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {"tool": self.tool, "arguments": dict(self.arguments), "ok": self.ok,
             "summary": self.summary}
        )


@dataclass(frozen=True, slots=True)
class ReasoningTrace:
    reasoner: str
    saw: tuple[str, ...]  # what it saw: findings and their evidence, in words
    considered: tuple[Consideration, ...]
    chose: str  # a plan id, or "nothing"
    why: tuple[str, ...]
    weights: Mapping[str, float] = field(default_factory=dict)  # rules: the factor weights
    tool_calls: tuple[ToolCall, ...] = ()
    model: str | None = None  # the LLM behind it, if any

    def to_dict(self) -> dict[str, Any]:
        return json_dict(
            {
                "reasoner": self.reasoner,
                "model": self.model,
                "saw": list(self.saw),
                "considered": [c.to_dict() for c in self.considered],
                "chose": self.chose,
                "why": list(self.why),
                "weights": dict(self.weights),
                "tool_calls": [t.to_dict() for t in self.tool_calls],
            }
        )

    def text(self) -> str:
        """The trace as a few readable lines."""
        lines = [f"[{self.reasoner}{'/' + self.model if self.model else ''}]"]
        lines += [f"  saw: {s}" for s in self.saw]
        for c in self.considered:
            score = "" if c.score is None else f" score={c.score:.3f}"
            lines.append(f"  considered {c.plan_id}:{score} {c.summary} ({c.verdict})")
        for t in self.tool_calls:
            lines.append(f"  tool {t.tool}({', '.join(f'{k}={v!r}' for k, v in t.arguments.items())})"
                         f" -> {t.summary}")
        lines.append(f"  chose: {self.chose}")
        lines += [f"  because: {w}" for w in self.why]
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Choice:
    plan: CandidatePlan | None  # None: do nothing
    trace: ReasoningTrace

    @property
    def plan_id(self) -> str | None:
        return None if self.plan is None else self.plan.id


@runtime_checkable
class Reasoner(Protocol):
    """Chooses among candidate plans; never changes state itself."""

    name: str

    def choose(self, situation: Situation, tools: AgentTools) -> Choice:
        """Pick a plan (or nothing) for ``situation``; may call ``tools``."""
        ...
