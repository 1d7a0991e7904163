"""What the agent's rounds yield: the :class:`Outcome` of a finding, a
:class:`PendingPlan` waiting for an operator (approve mode), a deliberation (the
reasoner's choice and its forecast), and whether a rejection was for a stale version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlwe.agent.model import CandidatePlan, Finding, WhatIf, json_dict
from mlwe.agent.reasoners.base import Choice, Situation
from mlwe.core.controlplane import ApplyResult


@dataclass
class Outcome:
    """What became of one finding in one round."""

    correlation_id: str
    finding: str
    # committed | rejected | not-better | pending-approval | observed | nothing | gave-up |
    # stale | approved | operator-rejected
    outcome: str
    plan: str | None = None
    reasons: tuple[str, ...] = ()
    version: int | None = None
    workflow: str | None = None  # the workflow carrying a committed plan through

    def to_dict(self) -> dict[str, Any]:
        return {"correlation_id": self.correlation_id, "finding": self.finding,
                "outcome": self.outcome, "plan": self.plan, "reasons": list(self.reasons),
                "version": self.version, "workflow": self.workflow}


@dataclass
class PendingPlan:
    id: str
    plan: CandidatePlan
    finding: Finding
    whatif: WhatIf | None
    trace: dict[str, Any]
    version: int
    created: float
    correlation_id: str

    def to_dict(self) -> dict[str, Any]:
        return json_dict({
            "id": self.id,
            "plan": self.plan.to_dict(),
            "finding": self.finding.to_dict(),
            "forecast": self.whatif.to_dict() if self.whatif else None,
            "trace": self.trace,
            "version": self.version,
            "created": self.created,
            "correlation_id": self.correlation_id,
        })



@dataclass
class _Deliberation:
    situation: Situation
    choice: Choice
    plan: CandidatePlan | None
    whatif: WhatIf | None


def _stale(result: ApplyResult) -> bool:
    return not result.accepted and any(
        r.action == "batch" and any(x.startswith("stale version") for x in r.reasons)
        for r in result.rejections
    )
