"""What an LLM reasoner does when its model fails to decide (``on_failure``), the tool
schemas it declares, the soak's figures and its independent check, and the local
model's set-up when it is missing. Against SCRIPTED STAND-IN MODELS
(tests/agent/standin_models.py) or no model at all; the real one is in
test_local_llm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlwe.agent.localmodel import Layout, LocalModelMissing, LocalModelServer, model_ok, setup
from mlwe.agent.reasoners.llm_common import (
    Guardrail,
    check_on_failure,
    declared_parameters,
)
from mlwe.agent.reasoners.llm_openai import OpenAIReasoner
from mlwe.agent.soak import independent_check, reason_class, soak
from mlwe.agent.tools import TOOL_SPECS
from mlwe.cli import app
from tests.agent.standin_models import Reply, StandInOpenAI
from tests.agent.test_llm_reasoners import situation, sla_cluster


def test_declared_schemas_leave_out_the_bounds_the_guardrail_enforces() -> None:
    propose = next(s for s in TOOL_SPECS if s["name"] == "propose")
    declared = declared_parameters(propose)
    assert "maxLength" not in json.dumps(declared) and "maxItems" not in json.dumps(declared)
    assert declared["required"] == ["rationale"] and declared["additionalProperties"] is False
    assert "maxLength" in json.dumps(propose["parameters"])  # the checked schema keeps them
    verdict = Guardrail().check("propose", {"plan_id": "p1", "rationale": "x" * 4001})
    assert not verdict.ok and "longer than 4000 characters" in verdict.reason
    limits = declared_parameters(next(s for s in TOOL_SPECS if s["name"] == "list_workloads"))
    assert limits["properties"]["limit"]["maximum"] == 500  # numeric bounds stay declared


def test_on_failure_must_be_nothing_or_rules() -> None:
    assert check_on_failure("rules") == "rules"
    with pytest.raises(ValueError, match="on_failure must be one of nothing, rules"):
        OpenAIReasoner("m", base_url="http://127.0.0.1:1/v1", on_failure="guess")
    r = OpenAIReasoner.from_env({"MLWE_OPENAI_MODEL": "m", "OPENAI_BASE_URL": "http://x/v1",
                                 "MLWE_LLM_ON_FAILURE": "rules"})
    assert r.on_failure == "rules"


def test_an_endpoint_failure_falls_back_to_the_rules_when_configured() -> None:
    import openai

    cp = sla_cluster()
    sit, tools = situation(cp)
    with StandInOpenAI(fail_with=503) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        choice = OpenAIReasoner("standin-model", client=client,
                                on_failure="rules").choose(sit, tools)
    assert choice.plan is not None and choice.plan.id == "p1"
    tr = choice.trace
    assert tr.reasoner == "rules (fallback for openai)" and tr.model == "standin-model"
    assert any("the model endpoint failed: InternalServerError" in w
               or "the model endpoint failed: APIStatusError" in w for w in tr.why), tr.why
    assert any("the rules reasoner decided instead" in w for w in tr.why)
    assert any(w.startswith("rules: ") for w in tr.why)
    assert tr.weights  # the rules' factor weights, as in their own traces


def test_only_refused_calls_fall_back_but_a_deliberate_nothing_stands() -> None:
    cp = sla_cluster()
    sit, tools = situation(cp)
    script = [Reply(calls=(("list_workloads", {"limit": 10**15}),)),
              Reply(text="I give up.")]
    with StandInOpenAI(script=script) as server:
        choice = OpenAIReasoner("standin-model", base_url=server.base_url,
                                on_failure="rules").choose(sit, tools)
    assert choice.trace.reasoner == "rules (fallback for openai)"
    assert choice.trace.tool_calls[0].summary.startswith("refused by the guardrail")
    assert choice.plan is not None and choice.plan.id == "p1"
    sit, tools = situation(sla_cluster())
    with StandInOpenAI(script=[Reply(text="Nothing to do.")]) as server:
        choice = OpenAIReasoner("standin-model", base_url=server.base_url,
                                on_failure="rules").choose(sit, tools)
    assert choice.plan is None and choice.trace.reasoner == "openai"  # its own decision


def test_a_refused_call_with_on_failure_nothing_decides_nothing() -> None:
    sit, tools = situation(sla_cluster())
    script = [Reply(calls=(("propose", '{"rationale": "x", "actions": [{"ty'),)),
              Reply(text="done")]
    with StandInOpenAI(script=script) as server:
        choice = OpenAIReasoner("standin-model", base_url=server.base_url).choose(sit, tools)
        sent = server.requests[0]
    assert choice.plan is None and choice.trace.chose == "nothing"
    assert "not valid JSON" in choice.trace.tool_calls[0].summary
    assert sent["max_tokens"] == 1024  # a rambling model is cut off


def test_the_soak_reports_its_figures() -> None:
    from mlwe.agent.reasoners import make_reasoner

    result = soak(make_reasoner("rules"), 3, scenarios=["oom-crash-loop", "loss-diverges"])
    assert result["deliberations"] == 3
    assert result["proposals"] >= 2 and result["accepted"] >= 2
    assert result["proposals"] == result["accepted"] + result["rejected"]
    assert result["invalid_accepted"] == 0 and result["invariant_violations"] == []
    assert result["accepted_checked"] == result["accepted"]
    assert result["invariant_checks"] > 100  # after every agent round
    kpi = result["kpi_effect"]
    assert kpi["runs"] >= 2 and kpi["expectations_passed"] == kpi["expectations"]
    assert kpi["delta_vs_doing_nothing"]["failed"] < 0  # the OOM loop no longer fails it
    assert result["latency_ms"]["p50"] >= 0


def test_the_independent_check_catches_what_the_control_plane_must_refuse() -> None:
    cp = sla_cluster()
    assert independent_check(cp, [{"kind": "preempt", "victim": "batch",
                                   "preemptor": "sla-ft"}]) == []
    bad = independent_check(cp, [
        {"kind": "preempt", "victim": "sla-ft", "preemptor": "batch"},
        {"kind": "set-priority", "workload": "ghost-job", "priority": 5},
        {"kind": "set-node-status", "node": "n9", "status": "draining"},
    ])
    assert bad == [
        "preempt: victim sla-ft (priority 900) is not below preemptor batch (priority 10)",
        "set-priority: unknown workload 'ghost-job'",
        "set-node-status: unknown node 'n9'",
    ]
    assert reason_class("unknown workload 'ghost-7' at version 12") == (
        "unknown workload '…' at version N")


def test_eval_and_soak_take_an_openai_endpoint() -> None:
    runner = CliRunner()
    with StandInOpenAI(script=[Reply(text="Nothing to do.")] * 200) as server:
        res = runner.invoke(app, ["agent", "eval", "-s", "oom-crash-loop", "--json",
                                  "--reasoner", "openai", "--base-url", server.base_url,
                                  "--model", "standin-model"])
        assert res.exit_code == 1, res.output  # a model that never acts fails the scenario
        ev = json.loads(res.stdout)
        assert (ev["reasoner"], ev["model"]) == ("openai", "standin-model")
        assert ev["scenarios"][0]["agent"]["outcomes"] == {"nothing": ev["scenarios"][0][
            "agent"]["decisions"]}
        res = runner.invoke(app, ["agent", "soak", "-n", "2", "-s", "oom-crash-loop",
                                  "--base-url", server.base_url, "--model", "standin-model",
                                  "--on-failure", "rules"])
        assert res.exit_code == 0, res.output
        assert "soak: 2 deliberations, reasoner openai (standin-model)" in res.stdout
        assert "invalid accepted 0" in res.stdout
    res = runner.invoke(app, ["agent", "eval", "--reasoner", "openai", "--base-url",
                              "http://127.0.0.1:9/v1"])
    assert res.exit_code == 2 and "no model listed at http://127.0.0.1:9/v1" in res.output
    res = runner.invoke(app, ["agent", "eval", "--reasoner", "rules", "--base-url", "http://x"])
    assert res.exit_code == 2 and "--base-url and --model are for the openai and adk" in res.output


def test_a_missing_local_model_says_what_to_run(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    with pytest.raises(LocalModelMissing, match="run `make local-llm`"):
        setup(tmp_path, build=False)
    with pytest.raises(LocalModelMissing, match="run `make local-llm`"):
        LocalModelServer(layout).start()
    layout.model.parent.mkdir(parents=True)
    layout.model.write_bytes(b"GGUF but not the right one")
    assert not model_ok(layout)
    res = CliRunner().invoke(app, ["agent", "eval", "--reasoner", "openai", "--local-model"],
                             env={"MLWE_CACHE": str(tmp_path)})
    assert res.exit_code == 2 and "make local-llm" in res.output
