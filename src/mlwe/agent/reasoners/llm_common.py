"""What every LLM reasoner shares: the guardrail, the prompt, and the trace.

An LLM is never trusted. It sees the situation (findings, candidate plans,
feedback on earlier tries) and may call only the typed tools of
:mod:`mlwe.agent.tools`, which read state or propose; nothing it says can
write state. Before any tool runs, the :class:`Guardrail` checks the call:
the tool must be in the allowed set, its arguments must be a JSON object that
matches the tool's schema, every action in it must be one an agent may
propose (and well formed), and the call and proposal budgets must not be
spent. A refused call gets a readable error back (the model may correct
itself) and is recorded like every other call in the reasoning trace. The
plan it proposes is verified by the loop and the control plane like any
other; an invalid one is rejected with reasons.

An LLM reasoner that is not configured raises :class:`LLMNotConfigured`
naming what to set. One that fails to decide (its endpoint down or too slow,
an answer that does not parse, a conversation cut off by its budget, or
only refused or failed calls and no proposal) does what ``on_failure`` says
(:func:`fall_back`): ``"nothing"`` (the default) decides nothing and says why;
``"rules"`` lets the deterministic rules reasoner decide instead, and the
trace says so. Never an exception into the loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlwe.agent.codec import ActionError, action_from_dict
from mlwe.agent.model import CandidatePlan, json_dict
from mlwe.agent.reasoners.base import (
    Choice,
    Consideration,
    Reasoner,
    ReasoningTrace,
    Situation,
    ToolCall,
)
from mlwe.agent.tools import TOOL_SPECS, AgentTools, ToolError, check_arguments
from mlwe.store.sanitize import sanitize, sanitize_text

#: Every tool an LLM may call (the whole typed tool set: they only read or propose).
TOOL_NAMES: tuple[str, ...] = tuple(str(t["name"]) for t in TOOL_SPECS)

SYSTEM_PROMPT = """\
You are the reasoning step of mlwe, the scheduler of a shared ML cluster \
(fine-tuning, training, batch embedding, inference on GPU and CPU nodes).
You cannot change anything yourself. Your tools only read the cluster state \
(list_workloads, read_telemetry, explain_queue), forecast a plan on a simulated \
copy of the cluster (what_if), or propose a plan (propose). Every proposal is \
verified by the control plane and forecast against doing nothing before anything \
happens; invalid proposals are rejected.
You get findings (what the monitors noticed) and candidate plans (what the \
strategies suggest). Read more state if you need it, then call propose ONCE with \
the plan_id of the best candidate, or with your own actions if no candidate fits, \
and a short rationale. If doing nothing is best, propose nothing. Do not choose a \
plan listed under feedback: it was tried already.
Rules the control plane enforces: only a strictly higher priority preempts; \
protected workloads and those under their minimum runtime or progress are never \
victims; capacity, GPU model and VRAM must fit. Prefer plans that meet deadlines \
and lose the least work. When you are done, answer with one short sentence."""


class LLMNotConfigured(RuntimeError):
    """An LLM reasoner was selected but what it needs is missing (key, endpoint, package)."""


#: bounds the guardrail enforces but the declared schemas leave out: a server that
#: constrains its output to the schema with a grammar (llama.cpp's) unrolls each bound
#: into repeated rules, and a 4,000-character string or 64-item array makes it give up
#: on the grammar and crash (measured with llama-cpp-python 0.3.36)
UNDECLARED_BOUNDS = frozenset({"maxLength", "maxItems"})


def declared_parameters(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema as declared to a model: the checked one, less the
    :data:`UNDECLARED_BOUNDS` (still enforced by :class:`Guardrail` on every call)."""

    def strip(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {k: strip(v) for k, v in node.items() if k not in UNDECLARED_BOUNDS}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    out: dict[str, Any] = strip(spec["parameters"])
    return out


# ================================================================ guardrail
@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    arguments: dict[str, Any]
    reason: str = ""


class Guardrail:
    """Checks each tool call of one conversation before the tool runs."""

    def __init__(
        self,
        allowed: Iterable[str] = TOOL_NAMES,
        *,
        max_calls: int = 24,
        max_proposals: int = 3,
    ) -> None:
        self.allowed = tuple(allowed)
        unknown = sorted(set(self.allowed) - set(TOOL_NAMES))
        if unknown:
            raise ValueError(f"guardrail: unknown tool(s) {', '.join(unknown)}")
        self.max_calls = max_calls
        self.max_proposals = max_proposals
        self.calls = 0
        self.proposals = 0
        self.refused = 0

    def check(self, tool: object, raw_arguments: object) -> Verdict:
        """Whether the call may run, with its arguments parsed and checked."""
        self.calls += 1
        args: dict[str, Any] = {}
        reason = ""
        if not isinstance(tool, str) or tool not in self.allowed:
            reason = f"tool {tool!r} is not allowed; allowed: {', '.join(self.allowed)}"
        elif self.calls > self.max_calls:
            reason = f"the budget of {self.max_calls} tool calls is spent"
        else:
            try:
                args = _parse_arguments(raw_arguments)
                args = check_arguments(tool, args)
                for i, action in enumerate(args.get("actions") or ()):
                    try:
                        action_from_dict(action)
                    except ActionError as exc:
                        raise ToolError(f"actions[{i}]: {exc}") from None
            except ToolError as exc:
                reason = str(exc)
            if not reason and tool == "propose":
                if self.proposals >= self.max_proposals:
                    reason = f"at most {self.max_proposals} proposals per decision"
                else:
                    self.proposals += 1
        if reason:
            self.refused += 1
            return Verdict(False, args, reason)
        return Verdict(True, args)


def _parse_arguments(raw: object) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str | bytes):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ToolError(f"arguments are not valid JSON: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ToolError(f"arguments must be a JSON object, got {type(raw).__name__}")
    return {str(k): v for k, v in raw.items()}


def run_tool_call(
    tools: AgentTools, guard: Guardrail, name: object, raw_arguments: object
) -> tuple[dict[str, Any], ToolCall]:
    """Check one call with ``guard`` and run it on ``tools``; the result and its record."""
    verdict = guard.check(name, raw_arguments)
    shown = verdict.arguments or _shown(raw_arguments)
    if not verdict.ok:
        record = ToolCall(str(name)[:100], shown, False,
                          f"refused by the guardrail: {verdict.reason}"[:300])
        return {"ok": False, "error": f"refused: {verdict.reason}"}, record
    assert isinstance(name, str)
    before = len(tools.calls)
    result = tools.call(name, verdict.arguments)
    if len(tools.calls) > before:
        record = tools.calls[-1]
    else:
        record = ToolCall(name, verdict.arguments, bool(result.get("ok", True)), "")
    return result, record


def _shown(raw: object) -> dict[str, Any]:
    """Arguments as far as they can be shown in a trace (refused ones may not parse)."""
    if isinstance(raw, Mapping):
        return {str(k): v for k, v in raw.items()}
    if raw is None:
        return {}
    return {"raw": str(raw)[:200]}


# =================================================================== prompt
def situation_prompt(situation: Situation, *, max_items: int = 20) -> str:
    """The user message: the situation as JSON (bounded), sanitised."""
    doc = situation.to_dict()
    for key in ("findings", "candidates", "feedback"):
        items = doc.get(key) or []
        if len(items) > max_items:
            doc[key] = [*items[:max_items], {"note": f"{len(items) - max_items} more not shown"}]
    excluded = sorted(situation.excluded())
    text = json.dumps(sanitize(doc), sort_keys=True, separators=(",", ":"))
    lines = [
        f"Situation at t={situation.time:g} (state version {situation.version},"
        f" mode {situation.mode.value}):",
        text,
    ]
    if excluded:
        lines.append("Already tried in this round, do not choose again: " + ", ".join(excluded))
    return "\n".join(lines)


def tool_result_text(result: Mapping[str, Any], limit: int = 12_000) -> str:
    """A tool result as the JSON text a model reads (sanitised, bounded)."""
    text = json.dumps(sanitize(json_dict(result)), sort_keys=True, separators=(",", ":"))
    if len(text) > limit:
        text = text[:limit] + '..."(truncated)"'
    return text


# ==================================================================== trace
def make_choice(
    reasoner: str,
    model: str,
    situation: Situation,
    tools: AgentTools,
    calls: Sequence[ToolCall],
    *,
    final_text: str = "",
    error: str | None = None,
) -> Choice:
    """The plan the model proposed last (None if none, or the conversation failed) and a
    readable trace of what it saw, called and chose."""
    plan: CandidatePlan | None = None if error else tools.proposed()
    saw = [f"{f.trigger} on {f.subject}: {f.summary}" for f in situation.findings]
    if situation.feedback:
        saw += [f"feedback: {f.plan_id} {f.outcome}: {'; '.join(f.reasons)}"
                for f in situation.feedback]
    considered = [
        Consideration(
            plan_id=c.id,
            summary=c.summary,
            factors=dict(c.factors),
            verdict="chosen by the model" if plan is not None and plan.id == c.id
            else "not chosen",
        )
        for c in situation.candidates
    ]
    if plan is not None and situation.candidate(plan.id) is None:
        considered.append(Consideration(plan.id, plan.summary, verdict="composed by the model"))
    why: list[str] = []
    if plan is not None:
        rationale = tools.rationales.get(plan.id, "")
        if rationale:
            why.append(f"the model's rationale: {sanitize_text(rationale)[:1000]}")
        last = next((c for c in reversed(calls) if c.tool == "propose" and c.ok is not None), None)
        if last is not None and not last.ok and not last.summary.startswith("refused"):
            why.append(f"the proposal failed verification on a fork: {last.summary}")
        if plan.id in situation.excluded():
            why.append(f"{plan.id} was tried already in this round; the loop will skip it")
    else:
        why.append("the model proposed nothing" if error is None else "no decision was made")
    if final_text:
        why.append(f"the model said: {sanitize_text(final_text)[:1000]}")
    if error:
        why.append(error)
    refused = sum(1 for c in calls if c.summary.startswith("refused by the guardrail"))
    if refused:
        why.append(f"the guardrail refused {refused} tool call(s)")
    trace = ReasoningTrace(
        reasoner=reasoner,
        saw=tuple(saw) or ("no findings",),
        considered=tuple(considered),
        chose=plan.id if plan is not None else "nothing",
        why=tuple(why),
        tool_calls=tuple(calls),
        model=model,
    )
    return Choice(plan, trace)


# ================================================================ failure
#: what an LLM reasoner does when its model fails to decide
ON_FAILURE: tuple[str, ...] = ("nothing", "rules")
ENV_ON_FAILURE = "MLWE_LLM_ON_FAILURE"


def check_on_failure(value: object) -> str:
    if value not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {value!r}")
    return str(value)


def failure(choice: Choice, error: str | None) -> str | None:
    """Why the model failed to decide (None: it decided, possibly to do nothing).

    A model that answered, made no failed call and proposed nothing has decided
    to do nothing; one whose calls were all refused or failed has not."""
    if error is not None:
        return error
    if choice.plan is None:
        bad = [c for c in choice.trace.tool_calls if not c.ok]
        if bad:
            return (f"the model proposed nothing after {len(bad)} refused or failed tool"
                    f" call(s) (last: {bad[-1].tool}: {bad[-1].summary[:200]})")
    return None


def fall_back(
    choice: Choice,
    error: str | None,
    situation: Situation,
    tools: AgentTools,
    on_failure: str,
    rules: Reasoner | None = None,
) -> Choice:
    """``choice`` as is if the model decided; otherwise what ``on_failure`` says."""
    why_failed = failure(choice, error)
    if why_failed is None or on_failure == "nothing":
        return choice
    from mlwe.agent.reasoners.rules import RulesReasoner  # a sibling: no cycle at import

    before = len(tools.calls)
    fb = (rules or RulesReasoner()).choose(situation, tools)
    tr, ft = choice.trace, fb.trace
    trace = ReasoningTrace(
        reasoner=f"{ft.reasoner} (fallback for {tr.reasoner})",
        saw=tr.saw,
        considered=ft.considered,
        chose=ft.chose,
        why=(*tr.why, f"the {tr.reasoner} model failed to decide; the rules reasoner decided"
             " instead (on_failure=rules)", *(f"rules: {w}" for w in ft.why)),
        weights=ft.weights,
        tool_calls=(*tr.tool_calls, *tools.calls[before:]),  # the rules' own calls
        model=tr.model,
    )
    return Choice(fb.plan, trace)
