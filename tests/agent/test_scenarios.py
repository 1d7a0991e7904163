"""Scenario evaluations: the rules reasoner passes every scenario, and the command prints it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mlwe.agent.scenarios import SCENARIOS, evaluate


def test_rules_reasoner_passes_every_scenario() -> None:
    result = evaluate()
    assert result["total"] == len(SCENARIOS) == 5
    failed = {
        r["scenario"]: [e for e in r["expectations"] if not e["ok"]]
        for r in result["scenarios"] if not r["passed"]
    }
    assert failed == {}
    for r in result["scenarios"]:
        assert r["agent"]["committed"], r["scenario"]
        assert set(r["kpis"]["agent"]) == set(r["kpis"]["baseline"])
    # the preemption plan and the OOM plan were carried through by their workflows
    flows = {r["scenario"]: r["agent"]["workflows"] for r in result["scenarios"]}
    (sla,) = flows["sla-fine-tune"]
    assert (sla["kind"], sla["status"]) == ("reschedule", "done")
    assert sla["steps"] == ["checkpoint", "wait_checkpoint", "confirm_release", "place", "start"]
    assert "train-0 saved" in sla["summary"] and "train-1 saved" in sla["summary"]
    (oom,) = flows["oom-crash-loop"]
    assert (oom["kind"], oom["status"]) == ("recover", "done")
    assert oom["summary"].startswith("recovered: ft-oom")


def test_eval_command_prints_json_and_fails_on_unknown_scenarios() -> None:
    from mlwe.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["agent", "eval", "--json", "-s", "oom-crash-loop"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["passed"] == data["total"] == 1
    assert data["scenarios"][0]["kpis"]["agent"]["oom_failures"] <= 2
    bad = runner.invoke(app, ["agent", "eval", "-s", "nope"])
    assert bad.exit_code == 2 and "unknown scenario" in bad.output
