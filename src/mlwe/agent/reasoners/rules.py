"""The default reasoner: a transparent multi-factor rule, deterministic, no network.

Each candidate plan gets a score: the weighted sum of its factors (the
finding's severity, the strategy's benefit, cost, risk and confidence) plus
the forecast gain, the relative improvement the what-if finds over doing
nothing (through the same ``what_if`` tool an LLM would call). The weights
are part of the trace. The best plan is chosen if its score reaches
``min_score`` and its forecast is verified; plans already tried in this
round (rejected, not better, refused by an operator) are skipped, so
feedback leads to the next best plan or to doing nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from mlwe.agent.model import CandidatePlan, WhatIf
from mlwe.agent.reasoners.base import Choice, Consideration, ReasoningTrace, Situation

if TYPE_CHECKING:
    from mlwe.agent.tools import AgentTools

DEFAULT_WEIGHTS: Final[Mapping[str, float]] = MappingProxyType(
    {
        "severity": 0.2,
        "benefit": 0.3,
        "confidence": 0.15,
        "forecast_gain": 0.6,
        "cost": -0.25,
        "risk": -0.2,
    }
)


class RulesReasoner:
    name = "rules"

    def __init__(
        self,
        weights: Mapping[str, float] | None = None,
        *,
        min_score: float = 0.2,
        max_forecasts: int = 4,
    ) -> None:
        self.weights = dict(weights or DEFAULT_WEIGHTS)
        unknown = set(self.weights) - set(DEFAULT_WEIGHTS)
        if unknown:
            raise ValueError(f"unknown factor(s) {', '.join(sorted(unknown))};"
                             f" known: {', '.join(DEFAULT_WEIGHTS)}")
        self.min_score = min_score
        self.max_forecasts = max_forecasts

    def _prior(self, c: CandidatePlan, severity: float) -> dict[str, float]:
        f = {k: float(c.factors.get(k, 0.0)) for k in ("benefit", "cost", "risk", "confidence")}
        f["severity"] = severity
        return f

    def _score(self, factors: Mapping[str, float]) -> tuple[float, dict[str, float]]:
        contrib = {k: round(self.weights.get(k, 0.0) * v, 6) for k, v in factors.items()}
        return round(sum(contrib.values()), 6), contrib

    def choose(self, situation: Situation, tools: AgentTools) -> Choice:
        severity = max((f.severity for f in situation.findings), default=0.0)
        saw = [f"{f.id}: {f.summary}" for f in situation.findings]
        saw += [f"earlier in this round: {fb.plan_id} {fb.outcome}"
                + (f" ({'; '.join(fb.reasons[:2])})" if fb.reasons else "")
                for fb in situation.feedback]
        excluded = situation.excluded()
        # rank by the prior (no forecast) first; forecast only the most promising
        ranked = sorted(
            situation.candidates,
            key=lambda c: (-self._score(self._prior(c, severity))[0], c.id),
        )
        considered: list[Consideration] = []
        scored: list[tuple[float, str, CandidatePlan]] = []
        forecasts = 0
        for c in ranked:
            factors = self._prior(c, severity)
            if c.id in excluded:
                fb = next(x for x in situation.feedback if x.plan_id == c.id)
                considered.append(Consideration(c.id, c.summary, None, factors, {},
                                                f"already tried: {fb.outcome}"))
                continue
            wi: WhatIf | None = None
            if tools.forecaster is not None and forecasts < self.max_forecasts:
                forecasts += 1
                res = tools.call("what_if", {"plan_id": c.id})
                wi = tools.forecasts.get(c.id) if res.get("ok") else None
            verdict = ""
            if wi is not None:
                if not wi.plan.verified:
                    considered.append(Consideration(
                        c.id, c.summary, None, factors, {},
                        "not verified on the fork: " + "; ".join(wi.plan.rejections[:2])))
                    continue
                base = max(abs(wi.nothing.score), 1.0)
                factors["forecast_gain"] = max(-1.0, min(1.0, (wi.nothing.score - wi.plan.score) / base))
                verdict = (f"forecast {wi.plan.score:.3f} vs {wi.nothing.score:.3f} doing nothing")
            elif tools.forecaster is not None:
                verdict = "not forecast (lower prior score than the forecast budget allows)"
            total, contrib = self._score(factors)
            considered.append(Consideration(c.id, c.summary, total, factors, contrib, verdict))
            scored.append((total, c.id, c))
        scored.sort(key=lambda x: (-x[0], x[1]))
        why: list[str]
        chosen: CandidatePlan | None = None
        if not situation.candidates:
            why = ["no strategy has a plan for these findings: noted, nothing to do"]
        elif not scored:
            why = ["every candidate was tried, unverifiable or excluded: doing nothing"]
        elif scored[0][0] < self.min_score:
            why = [f"the best candidate {scored[0][1]} scores {scored[0][0]:.3f}, below the"
                   f" threshold {self.min_score}: doing nothing is the better bet"]
        else:
            best_score, _, chosen = scored[0]
            why = [f"{chosen.id} has the highest score {best_score:.3f}"
                   f" (threshold {self.min_score})"]
            if len(scored) > 1:
                why.append(f"next best: {scored[1][1]} at {scored[1][0]:.3f}")
            top = sorted(
                ((k, v) for k, v in next(c for c in considered if c.plan_id == chosen.id)
                 .contributions.items()), key=lambda kv: -abs(kv[1]))[:3]
            why.append("largest factors: " + ", ".join(f"{k} {v:+.3f}" for k, v in top))
            why += list(chosen.rationale)
        marked = tuple(
            Consideration(c.plan_id, c.summary, c.score, c.factors, c.contributions,
                          "chosen" + (f"; {c.verdict}" if c.verdict else ""))
            if chosen is not None and c.plan_id == chosen.id else c
            for c in considered
        )
        trace = ReasoningTrace(
            reasoner=self.name,
            saw=tuple(saw),
            considered=marked,
            chose=chosen.id if chosen else "nothing",
            why=tuple(why),
            weights=dict(self.weights),
            tool_calls=tuple(tools.calls),
        )
        return Choice(chosen, trace)
