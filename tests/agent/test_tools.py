"""The tools an LLM may call: read or propose only, checked arguments, readable errors."""

from __future__ import annotations

import pytest

from mlwe.agent.codec import AGENT_ACTION_KINDS, ActionError, action_from_dict, action_to_dict
from mlwe.agent.model import CandidatePlan
from mlwe.agent.telemetry import TelemetryWindow
from mlwe.agent.tools import TOOL_SPECS, AgentTools
from mlwe.agent.whatif import WhatIfForecaster, state_digest
from mlwe.core import (
    Cancel,
    ControlPlane,
    Evict,
    ManualClock,
    NodeStatus,
    Preempt,
    PreemptReason,
    ReplicaResources,
    Retry,
    SetNodeStatus,
    SetPriority,
    SetResources,
)
from mlwe.core.backend import Telemetry


def tools_for(cp: ControlPlane, **kw: object) -> AgentTools:
    plan = CandidatePlan("raise", "reprioritise", ("f",),
                         (SetPriority("ft", 51), Preempt("train-0", "ft"), Preempt("train-1", "ft")),
                         "raise ft and preempt two")
    return AgentTools(cp, candidates=[plan], forecaster=WhatIfForecaster(cp), **kw)  # type: ignore[arg-type]


def test_the_five_tools_are_described() -> None:
    assert [t["name"] for t in TOOL_SPECS] == [
        "list_workloads", "read_telemetry", "explain_queue", "what_if", "propose"]
    for t in TOOL_SPECS:
        assert t["parameters"]["type"] == "object" and t["description"]


def test_reading_and_proposing_change_nothing(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    before = state_digest(cp)
    window = TelemetryWindow()
    window.add([Telemetry(10.0, "g0", "train-0", {"gpu_util": 0.9, "loss": 1.2})])
    tools = tools_for(cp, telemetry=window)
    lw = tools.call("list_workloads", {"state": "running"})
    assert lw["ok"] and lw["count"] == 4
    tel = tools.call("read_telemetry", {"workload": "train-0", "metric": "loss"})
    assert tel["samples"][0]["metrics"] == {"loss": 1.2}
    q = tools.call("explain_queue", {"workload": "ft"})
    assert q["order"][0]["id"] == "ft" and q["deadline"]["status"] in ("infeasible", "at-risk")
    wi = tools.call("what_if", {"plan_id": "raise"})
    assert wi["ok"] and wi["better"] is True
    p = tools.call("propose", {"plan_id": "raise", "rationale": "deadline"})
    assert p["ok"] and p["verified"] and tools.proposed() is not None
    own = tools.call("propose", {"actions": [{"kind": "cancel", "workload": "train-3"}],
                                 "rationale": "free room"})
    assert own["ok"] and tools.proposed().actions == (Cancel("train-3", "cancelled by agent"),)  # type: ignore[union-attr]
    assert state_digest(cp) == before
    assert [c.tool for c in tools.calls] == [
        "list_workloads", "read_telemetry", "explain_queue", "what_if", "propose", "propose"]


@pytest.mark.parametrize(
    "tool,args,expect",
    [
        ("rm_rf", {}, "unknown tool 'rm_rf'"),
        ("list_workloads", {"state": "exploded"}, "must be one of"),
        ("list_workloads", {"limit": 0}, "at least 1"),
        ("list_workloads", {"sql": "drop"}, "unknown argument 'sql'"),
        ("list_workloads", "all of them", "arguments must be an object"),
        ("read_telemetry", {"workload": "ghost"}, "unknown workload 'ghost'"),
        ("read_telemetry", {"last": "ten"}, "must be integer"),
        ("what_if", {}, "exactly one of plan_id or actions"),
        ("what_if", {"plan_id": "nope"}, "unknown plan 'nope'"),
        ("what_if", {"horizon_s": 5, "plan_id": "raise"}, "at least 60"),
        ("propose", {"plan_id": "raise"}, "missing argument(s) rationale"),
        ("propose", {"actions": [{"kind": "place", "workload": "ft"}], "rationale": "x"},
         "not one an agent may propose"),
        ("propose", {"actions": [], "rationale": "x"}, "actions is empty"),
    ],
)
def test_bad_tool_calls_get_clear_errors(
    sla: tuple[ControlPlane, ManualClock], tool: str, args: object, expect: str
) -> None:
    cp, _ = sla
    before = state_digest(cp)
    tools = tools_for(cp)
    r = tools.call(tool, args)
    assert r["ok"] is False and expect in r["error"]
    assert tools.calls[-1].ok is False
    assert state_digest(cp) == before


def test_a_proposal_the_control_plane_would_reject_says_why(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    tools = tools_for(cp)
    r = tools.call("propose", {"actions": [{"kind": "preempt", "victim": "train-0",
                                            "preemptor": "ft"}], "rationale": "x"})
    assert r["ok"] is False and r["verified"] is False
    assert any("priority rule" in x for x in r["rejections"])


def test_the_call_budget_stops_a_looping_reasoner(sla: tuple[ControlPlane, ManualClock]) -> None:
    cp, _ = sla
    tools = AgentTools(cp, max_calls=3)
    for _ in range(3):
        assert tools.call("list_workloads")["ok"]
    assert "budget" in tools.call("list_workloads")["error"]


ROUND_TRIP = [
    Preempt("v", "p", PreemptReason.RECLAIM),
    Evict("w", "node failing"),
    Cancel("w", "stop"),
    Retry("w"),
    SetPriority("w", 70, "deadline"),
    SetResources("w", ReplicaResources.model_validate({"gpu": 2, "memory": "48Gi"}), "oom"),
    SetNodeStatus("n", NodeStatus.CORDONED, "ecc"),
]


@pytest.mark.parametrize("action", ROUND_TRIP, ids=lambda a: a.kind)
def test_codec_round_trips_every_agent_kind(action: object) -> None:
    d = action_to_dict(action)  # type: ignore[arg-type]
    assert d["kind"] in AGENT_ACTION_KINDS
    assert action_from_dict(d) == action


@pytest.mark.parametrize(
    "d,expect",
    [
        ({"kind": "started", "workload": "w", "attempt": 1}, "not one an agent may propose"),
        ({"kind": "set-priority", "workload": "w", "priority": "high"}, "must be an integer"),
        ({"kind": "set-resources", "workload": "w", "resources": {"memory": "lots"}},
         "set-resources: memory: Value error, cannot parse memory quantity 'lots'"),
        ({"kind": "set-node-status", "node": "n", "status": "melted"}, "unknown status 'melted'"),
        ({"kind": "preempt", "victim": "v", "preemptor": "p", "reason": "spite"}, "unknown reason"),
        ({"kind": "cancel"}, "missing field 'workload'"),
        ({"kind": "cancel", "workload": 7}, "must be a string"),
    ],
)
def test_codec_errors_name_the_field(d: dict[str, object], expect: str) -> None:
    with pytest.raises(ActionError, match=None) as exc:
        action_from_dict(d)
    assert expect in str(exc.value)


def test_propose_says_where_it_verified(sla: tuple[ControlPlane, ManualClock]) -> None:
    """Without a forecaster the tools verify on a fork of their own, and say so."""
    cp, _ = sla
    before = state_digest(cp)
    bare = AgentTools(cp, candidates=tools_for(cp).candidates.values())
    r = bare.call("propose", {"plan_id": "raise", "rationale": "deadline"})
    assert r["ok"] and r["verified"]
    assert r["verified_on"] == "a fork of the state these tools read (no forecaster attached)"
    assert bare.calls[-1].summary == f"verified on {r['verified_on']}"
    bad = bare.call("propose", {"actions": [{"kind": "preempt", "victim": "train-0",
                                             "preemptor": "ft"}], "rationale": "x"})
    assert bad["ok"] is False and any("priority rule" in x for x in bad["rejections"])
    assert bare.calls[-1].summary.startswith("rejected on a fork of the state these tools read")
    full = tools_for(cp).call("propose", {"plan_id": "raise", "rationale": "deadline"})
    assert full["verified_on"] == "the forecaster's fork"
    assert state_digest(cp) == before
