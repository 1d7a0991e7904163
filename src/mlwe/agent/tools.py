"""The typed tools a reasoner may call: they read state or propose, never write.

The same functions serve the rules reasoner (in-process calls) and LLM
reasoners (through :data:`TOOL_SPECS`, JSON-schema descriptions of each tool,
and :meth:`AgentTools.call`, which checks a tool call's name and arguments
before running it and turns every error into a readable result instead of an
exception):

- ``list_workloads(state, queue, limit)``: workloads and what they hold;
- ``read_telemetry(workload, node, metric, last)``: recent samples;
- ``explain_queue(workload)``: the queue order and why each waits, and for one
  workload its deadline verdict;
- ``what_if(plan_id | actions, horizon_s)``: the plan and doing nothing played
  forward on a fork of the state in the simulator;
- ``propose(plan_id | actions, rationale)``: register the plan the reasoner
  wants; it is verified on a fork of the state the tools read (by the
  forecaster, or by the tools themselves when none is attached), and only the
  loop may commit it (through the control plane, which verifies it again).

Nothing here calls ``ControlPlane.apply`` on the live control plane. The
``cp`` the tools read may itself be a private snapshot of the live state (the
agent loop passes one, so a reasoner deliberates without holding the engine's
lock).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from mlwe.agent.codec import ActionError, action_from_dict
from mlwe.agent.model import CandidatePlan, Finding, WhatIf, json_dict
from mlwe.agent.reasoners.base import ToolCall
from mlwe.agent.telemetry import TelemetryWindow
from mlwe.agent.whatif import verify_on_fork
from mlwe.core.actions import Action
from mlwe.core.backend import Telemetry
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload
from mlwe.core.scheduler import Scheduler


class Forecaster(Protocol):
    """What the tools need of the what-if forecaster (:class:`mlwe.agent.whatif.WhatIfForecaster`)."""

    def what_if(self, plan: CandidatePlan, horizon_s: float | None = None) -> WhatIf: ...

    def verify(self, actions: Sequence[Action]) -> tuple[str, ...]:
        """Rejection reasons of ``actions`` on a fork of the live state (empty: accepted)."""
        ...


class TelemetryReader(Protocol):
    """What the tools read telemetry from (a :class:`TelemetryWindow`, or a locked view of one)."""

    def samples(
        self,
        *,
        workload: str | None = None,
        node: str | None = None,
        metric: str | None = None,
        last: int | None = None,
    ) -> list[Telemetry]: ...


class ToolError(ValueError):
    """A tool call that cannot be run (unknown tool, bad argument, budget spent)."""


_ACTIONS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "description": (
        "typed actions, each an object with a 'kind' among preempt, evict, cancel, retry,"
        " set-priority, set-resources, set-node-status, set-queue, submit"
    ),
    "items": {"type": "object"},
    "maxItems": 64,
}

#: JSON-schema descriptions of the tools (the shape OpenAI-compatible and ADK tools take).
TOOL_SPECS: tuple[dict[str, Any], ...] = (
    {
        "name": "list_workloads",
        "description": "List workloads with their state, queue, priority, resources and placement.",
        "parameters": {
            "type": "object",
            "properties": {
                "state": {"type": "string", "enum": [s.value for s in State]},
                "queue": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 500},
            },
            "additionalProperties": False,
        },
    },
    {
        "name": "read_telemetry",
        "description": "Recent telemetry samples (utilisation, memory, loss...) of a workload or a node.",
        "parameters": {
            "type": "object",
            "properties": {
                "workload": {"type": "string"},
                "node": {"type": "string"},
                "metric": {"type": "string"},
                "last": {"type": "integer", "minimum": 1, "maximum": 500},
            },
            "additionalProperties": False,
        },
    },
    {
        "name": "explain_queue",
        "description": "The waiting queue in scheduling order with the reason each waits; with"
        " a workload id, that workload's deadline verdict as well.",
        "parameters": {
            "type": "object",
            "properties": {"workload": {"type": "string"}},
            "additionalProperties": False,
        },
    },
    {
        "name": "what_if",
        "description": "Play a plan and doing nothing forward on a simulated fork of the current"
        " state; returns both forecasts (deadlines, JCT, lost work) and whether the plan is better.",
        "parameters": {
            "type": "object",
            "properties": {
                "plan_id": {"type": "string"},
                "actions": _ACTIONS_SCHEMA,
                "horizon_s": {"type": "number", "minimum": 60, "maximum": 7 * 86400},
            },
            "additionalProperties": False,
        },
    },
    {
        "name": "propose",
        "description": "Propose a plan (a candidate's plan_id, or your own actions) with your"
        " rationale. It is verified and forecast before anything is committed; you cannot"
        " change state directly.",
        "parameters": {
            "type": "object",
            "properties": {
                "plan_id": {"type": "string"},
                "actions": _ACTIONS_SCHEMA,
                "rationale": {"type": "string", "maxLength": 4000},
            },
            "required": ["rationale"],
            "additionalProperties": False,
        },
    },
)

_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
    "array": lambda v: isinstance(v, list | tuple),
    "object": lambda v: isinstance(v, Mapping),
}


def check_arguments(tool: str, arguments: Any) -> dict[str, Any]:
    """``arguments`` checked against the tool's schema; raises ToolError naming the problem."""
    spec = next((t for t in TOOL_SPECS if t["name"] == tool), None)
    if spec is None:
        names = ", ".join(t["name"] for t in TOOL_SPECS)
        raise ToolError(f"unknown tool {tool!r}; tools: {names}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise ToolError(f"{tool}: arguments must be an object, got {type(arguments).__name__}")
    params = spec["parameters"]
    props: Mapping[str, Any] = params["properties"]
    out: dict[str, Any] = {}
    for k, v in arguments.items():
        if k not in props:
            raise ToolError(f"{tool}: unknown argument {k!r}; known: {', '.join(props)}")
        if v is None:
            continue
        p = props[k]
        if not _TYPES[p["type"]](v):
            raise ToolError(f"{tool}: argument {k!r} must be {p['type']}, got {v!r:.80}")
        if "enum" in p and v not in p["enum"]:
            raise ToolError(f"{tool}: argument {k!r} must be one of {', '.join(p['enum'])}")
        if "minimum" in p and v < p["minimum"]:
            raise ToolError(f"{tool}: argument {k!r} must be at least {p['minimum']}")
        if "maximum" in p and v > p["maximum"]:
            raise ToolError(f"{tool}: argument {k!r} must be at most {p['maximum']}")
        if "maxLength" in p and len(v) > p["maxLength"]:
            raise ToolError(f"{tool}: argument {k!r} is longer than {p['maxLength']} characters")
        if "maxItems" in p and len(v) > p["maxItems"]:
            raise ToolError(f"{tool}: argument {k!r} has more than {p['maxItems']} items")
        out[k] = list(v) if p["type"] == "array" else v
    missing = [k for k in params.get("required", ()) if k not in out]
    if missing:
        raise ToolError(f"{tool}: missing argument(s) {', '.join(missing)}")
    return out


def workload_summary(w: Workload, now: float) -> dict[str, Any]:
    r = w.spec.resources
    out: dict[str, Any] = {
        "id": w.id,
        "name": w.spec.name,
        "kind": w.spec.kind.value,
        "state": w.state.value,
        "queue": w.queue,
        "priority": w.priority,
        "replicas": w.spec.replicas,
        "gpu_per_replica": r.gpu / 1000,
        "memory_mib_per_replica": r.memory,
        "gpu_models": list(w.spec.gpu_models),
        "nodes": sorted({a.node for a in w.placement}),
        "progress": round(w.progress, 4),
        "attempt": w.attempt,
        "failures": w.failures,
        "max_retries": w.spec.max_retries,
        "protected": w.spec.protected,
    }
    if w.failure_cause:
        out["failure_cause"] = w.failure_cause
    if w.exit_code is not None:
        out["exit_code"] = w.exit_code
    if w.deadline is not None:
        out["deadline_in_s"] = round(w.deadline - now, 1)
    if w.spec.estimated_duration is not None:
        rem = w.remaining_estimate(now)
        out["remaining_estimate_s"] = None if rem is None else round(rem, 1)
    if w.pending_reason and w.state in (State.PENDING, State.PREEMPTED):
        out["pending_reason"] = w.pending_reason
        out["waiting_s"] = round(now - w.submit_time, 1)
    if w.started_at is not None:
        out["runtime_s"] = round(w.runtime(now), 1)
    return out


class AgentTools:
    """The tool functions over one control plane; records every call for the trace.

    ``candidates``: the plans the strategies built for the situation at hand
    (so ``plan_id`` arguments resolve); ``forecaster``: the what-if forecaster
    (without one, ``what_if`` and ``propose`` report that no forecast is
    available). ``max_calls`` bounds a reasoner that loops.
    """

    def __init__(
        self,
        cp: ControlPlane,
        *,
        telemetry: TelemetryReader | None = None,
        candidates: Sequence[CandidatePlan] = (),
        findings: Sequence[Finding] = (),
        forecaster: Forecaster | None = None,
        scheduler: Scheduler | None = None,
        max_calls: int = 64,
    ) -> None:
        self.cp = cp
        self.telemetry: TelemetryReader = telemetry or TelemetryWindow()
        self.candidates: dict[str, CandidatePlan] = {c.id: c for c in candidates}
        self.findings = tuple(findings)
        self.forecaster = forecaster
        self.scheduler = scheduler or Scheduler()
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self.proposals: list[CandidatePlan] = []
        self.forecasts: dict[str, WhatIf] = {}
        self.rationales: dict[str, str] = {}

    # ------------------------------------------------------------ dispatcher
    def call(self, tool: str, arguments: Any = None) -> dict[str, Any]:
        """Run a tool call by name (as an LLM makes it); errors come back as ``{"error": ...}``."""
        try:
            if len(self.calls) >= self.max_calls:
                raise ToolError(f"tool call budget of {self.max_calls} calls is spent")
            args = check_arguments(tool, arguments)
            fn: Callable[..., dict[str, Any]] = getattr(self, tool)
            result = fn(**args)
        except (ToolError, ActionError, KeyError, ValueError, TypeError) as exc:
            msg = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
            self._log(tool, arguments if isinstance(arguments, Mapping) else {}, False, msg)
            return {"ok": False, "error": msg}
        return result

    def _log(self, tool: str, args: Mapping[str, Any], ok: bool, summary: str) -> None:
        self.calls.append(ToolCall(tool, dict(args), ok, summary[:300]))

    # ----------------------------------------------------------------- tools
    def list_workloads(
        self, state: str | None = None, queue: str | None = None, limit: int = 50
    ) -> dict[str, Any]:
        now = self.cp.now()
        want = State(state) if state is not None else None
        rows = [
            workload_summary(w, now)
            for w in self.cp.workloads.values()
            if (want is None or w.state is want) and (queue is None or w.queue == queue)
        ]
        out = {"ok": True, "count": len(rows), "workloads": rows[:limit]}
        self._log("list_workloads", {"state": state, "queue": queue, "limit": limit}, True,
                  f"{len(rows)} workload(s)")
        return out

    def read_telemetry(
        self,
        workload: str | None = None,
        node: str | None = None,
        metric: str | None = None,
        last: int = 20,
    ) -> dict[str, Any]:
        if workload is not None and workload not in self.cp.workloads:
            raise KeyError(f"unknown workload {workload!r}")
        if node is not None and node not in self.cp.capacity:
            raise KeyError(f"unknown node {node!r}")
        got = self.telemetry.samples(workload=workload, node=node, metric=metric, last=last)
        rows = [
            {
                "time": s.time,
                "node": s.node,
                "workload": s.workload,
                "metrics": {k: v for k, v in s.metrics.items() if metric is None or k == metric},
                **({"declared": list(s.declared)} if s.declared else {}),
            }
            for s in got
        ]
        self._log("read_telemetry", {"workload": workload, "node": node, "metric": metric,
                                     "last": last}, True, f"{len(rows)} sample(s)")
        return json_dict({"ok": True, "count": len(rows), "samples": rows})

    def explain_queue(self, workload: str | None = None) -> dict[str, Any]:
        cp = self.cp
        now = cp.now()
        order = self.scheduler.ordered(cp)
        rows = [
            {
                "rank": i + 1,
                "id": w.id,
                "queue": w.queue,
                "priority": w.priority,
                "state": w.state.value,
                "waiting_s": round(now - w.submit_time, 1),
                "reason": w.pending_reason or "not yet considered by a scheduling cycle",
            }
            for i, w in enumerate(order[:100])
        ]
        out: dict[str, Any] = {"ok": True, "waiting": len(order), "order": rows}
        if workload is not None:
            w = cp.get(workload)
            out["workload"] = workload_summary(w, now)
            if w.state in (State.PENDING, State.PREEMPTED):
                v = self.scheduler.admission(cp, w)
                out["deadline"] = {"status": v.status.value, "reason": v.reason}
        self._log("explain_queue", {"workload": workload}, True, f"{len(order)} waiting")
        return json_dict(out)

    def _plan_from(
        self, plan_id: str | None, actions: list[Any] | None, rationale: str = ""
    ) -> CandidatePlan:
        if (plan_id is None) == (actions is None):
            raise ToolError("give exactly one of plan_id or actions")
        if plan_id is not None:
            plan = self.candidates.get(plan_id) or next(
                (p for p in self.proposals if p.id == plan_id), None
            )
            if plan is None:
                known = ", ".join(self.candidates) or "none"
                raise ToolError(f"unknown plan {plan_id!r}; candidates: {known}")
            return plan
        assert actions is not None
        if not actions:
            raise ToolError("actions is empty; to do nothing, propose nothing")
        typed = tuple(action_from_dict(a) for a in actions)
        n = len(self.proposals) + 1
        return CandidatePlan(
            id=f"proposed-{n}",
            strategy="reasoner-proposed",
            finding_ids=tuple(f.id for f in self.findings),
            actions=typed,
            summary=f"{len(typed)} action(s) composed by the reasoner",
            rationale=(rationale,) if rationale else (),
        )

    def what_if(
        self,
        plan_id: str | None = None,
        actions: list[Any] | None = None,
        horizon_s: float | None = None,
    ) -> dict[str, Any]:
        plan = self._plan_from(plan_id, actions)
        if self.forecaster is None:
            raise ToolError("no what-if forecaster is attached to these tools")
        result = self.forecaster.what_if(plan, horizon_s)
        self.forecasts[plan.id] = result
        self._log("what_if", {"plan_id": plan_id, "actions": actions, "horizon_s": horizon_s},
                  True, result.summary)
        return {"ok": True, **result.to_dict()}

    def propose(
        self,
        rationale: str,
        plan_id: str | None = None,
        actions: list[Any] | None = None,
    ) -> dict[str, Any]:
        plan = self._plan_from(plan_id, actions, rationale)
        if self.forecaster is not None:
            rejections = self.forecaster.verify(plan.actions)
            checked = "the forecaster's fork"
        else:
            rejections = verify_on_fork(self.cp, plan.actions)
            checked = "a fork of the state these tools read (no forecaster attached)"
        # the latest proposal is the reasoner's choice; proposing one again moves it last
        self.proposals = [p for p in self.proposals if p.id != plan.id]
        self.proposals.append(plan)
        self.rationales[plan.id] = rationale
        ok = not rejections
        self._log("propose", {"plan_id": plan_id, "actions": actions, "rationale": rationale},
                  ok, (f"verified on {checked}" if ok
                       else f"rejected on {checked}: " + "; ".join(rejections)))
        return {
            "ok": ok,
            "proposal_id": plan.id,
            "verified": ok,
            "verified_on": checked,
            "rejections": list(rejections),
            "note": "the loop forecasts and commits (or asks an operator); nothing changed yet",
        }

    # ---------------------------------------------------------------- result
    def proposed(self) -> CandidatePlan | None:
        """The last plan proposed through ``propose`` (what an LLM reasoner chose)."""
        return self.proposals[-1] if self.proposals else None

