"""The LLM reasoners (``openai``, ``adk``) against SCRIPTED STAND-IN MODELS.

The stand-ins (tests/agent/standin_models.py) are local HTTP servers speaking
the real wire formats (OpenAI chat completions with tool calls; the Gemini
API that Google ADK uses); they replay scripted turns, they are not models.
What is tested is everything around the model: the requests the reasoners
send, the guardrail that refuses bad tool calls before they run, the trace
that records every call, the plan they hand back, and that a hallucinated
plan is rejected by the control plane with the state left as it was.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlwe.agent.model import CandidatePlan, Finding, Mode
from mlwe.agent.reasoners.base import Situation
from mlwe.agent.reasoners.llm_common import (
    TOOL_NAMES,
    Guardrail,
    LLMNotConfigured,
    situation_prompt,
)
from mlwe.agent.reasoners.llm_openai import OpenAIReasoner
from mlwe.agent.tools import AgentTools
from mlwe.core.actions import Preempt, Start, Started, Submit
from mlwe.core.clock import ManualClock
from mlwe.core.cluster import build_control_plane
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.scheduler import Scheduler, SchedulerConfig
from mlwe.core.spec import ClusterSpec, NodeSpec
from tests.agent.standin_models import Reply, StandInGemini, StandInOpenAI
from tests.core.builders import A100, gpu_job


# =============================================================== situation
def sla_cluster() -> ControlPlane:
    """One 8-GPU node: a low-priority batch job runs; an urgent fine-tune waits."""
    cp = build_control_plane(
        ClusterSpec(nodes=(NodeSpec(name="n1", gpu_model=A100, gpus=8, cpu=64, memory="512Gi"),
                           NodeSpec(name="cpu1", cpu=32, memory="128Gi"))),
        ManualClock(0.0),
    )
    assert cp.apply([Submit(gpu_job("batch", priority=10, estimated_duration=3600))]).accepted
    Scheduler(config=SchedulerConfig(preemption=False)).run_cycle(cp)
    w = cp.get("batch")
    assert cp.apply([Start("batch", w.attempt)]).accepted
    assert cp.apply([Started("batch", w.attempt)]).accepted
    assert cp.apply([Submit(gpu_job("sla-ft", priority=900, estimated_duration=3600))]).accepted
    assert cp.get("batch").state is State.RUNNING and cp.get("sla-ft").state is State.PENDING
    return cp


def situation(cp: ControlPlane) -> tuple[Situation, AgentTools]:
    finding = Finding("deadline-at-risk", "sla-ft", "workload", "sla-ft waits and will miss its"
                      " deadline", severity=0.9, evidence={"waiting_s": 600}, time=cp.now())
    plan = CandidatePlan("p1", "preempt", (finding.id,), (Preempt("batch", "sla-ft"),),
                         "preempt batch (priority 10) for sla-ft (priority 900)",
                         factors={"benefit": 0.9, "cost": 0.2, "risk": 0.1, "confidence": 0.8})
    sit = Situation(cp.now(), cp.version, Mode.AUTONOMOUS, (finding,), (plan,))
    return sit, AgentTools(cp, candidates=[plan], findings=[finding])


HALLUCINATED = [
    # parse, but are wrong: the control plane must refuse every one of them
    {"kind": "preempt", "victim": "sla-ft", "preemptor": "batch"},  # inverted priorities
    {"kind": "set-priority", "workload": "ghost-job", "priority": 5},  # unknown id
    {"kind": "retry", "workload": "batch"},  # retry a running job
]


def assert_refused_by_control_plane(cp: ControlPlane, plan: CandidatePlan) -> None:
    version = cp.version
    states = {w.id: w.state for w in cp.workloads.values()}
    result = cp.apply(list(plan.actions))
    assert not result.accepted
    text = " | ".join(result.reasons())
    assert "priority rule" in text or "not waiting for placement" in text
    assert "unknown workload 'ghost-job'" in text
    assert "only failed workloads are retried" in text
    assert cp.version == version
    assert {w.id: w.state for w in cp.workloads.values()} == states
    assert cp.validate_state() == []


# =============================================================== guardrail
@pytest.mark.parametrize(
    ("tool", "arguments", "why"),
    [
        ("apply", {}, "tool 'apply' is not allowed"),
        ("propose", "{not json", "arguments are not valid JSON"),
        ("propose", "[1, 2]", "arguments must be a JSON object"),
        ("list_workloads", {"state": "exploded"}, "must be one of"),
        ("list_workloads", {"limit": 10_000}, "must be at most 500"),
        ("read_telemetry", {"password": "x"}, "unknown argument 'password'"),
        ("propose", {"plan_id": "p1"}, "missing argument(s) rationale"),
        ("propose", {"rationale": "r", "actions": [{"kind": "place", "workload": "x"}]},
         "actions[0]: action kind 'place' is not one an agent may propose"),
        ("propose", {"rationale": "r", "actions": [{"kind": "set-resources", "workload": "x",
                                                    "resources": {"memory": "-4Gi"}}]},
         "memory: Value error, cannot parse memory quantity '-4Gi'"),
        ("what_if", {"actions": [{"kind": "preempt", "victim": "a"}]},
         "actions[0]: preempt: missing"),
    ],
)
def test_guardrail_refuses_bad_calls(tool: str, arguments: Any, why: str) -> None:
    verdict = Guardrail().check(tool, arguments)
    assert not verdict.ok
    assert why in verdict.reason


def test_guardrail_budgets() -> None:
    g = Guardrail(max_calls=3, max_proposals=1)
    assert g.check("propose", {"rationale": "a", "plan_id": "p1"}).ok
    assert "at most 1 proposals" in g.check("propose", {"rationale": "b", "plan_id": "p1"}).reason
    assert g.check("explain_queue", None).ok
    assert "budget of 3 tool calls is spent" in g.check("explain_queue", {}).reason
    assert g.refused == 2
    with pytest.raises(ValueError, match="unknown tool"):
        Guardrail(["list_workloads", "shell"])


def test_the_prompt_is_the_situation_sanitised() -> None:
    cp = sla_cluster()
    sit, _ = situation(cp)
    leaky = Situation(sit.time, sit.version, sit.mode, (Finding(
        "loss-diverging", "batch", "workload", "loss is NaN",
        evidence={"env": {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz0123"}}),), sit.candidates)
    text = situation_prompt(leaky)
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in text
    assert '"p1"' in text and "loss is NaN" in text


# ================================================================= openai
def openai_reasoner(server: StandInOpenAI, **kw: Any) -> OpenAIReasoner:
    return OpenAIReasoner("standin-model", base_url=server.base_url, max_rounds=kw.pop(
        "max_rounds", 8), **kw)


def test_openai_reads_then_proposes_a_candidate() -> None:
    cp = sla_cluster()
    sit, tools = situation(cp)
    script = [
        Reply(calls=(("list_workloads", {"state": "running"}),)),
        Reply(calls=(("explain_queue", {"workload": "sla-ft"}),)),
        Reply(calls=(("propose", {"plan_id": "p1", "rationale": "sla-ft is urgent; batch"
                                  " checkpoints and loses little"}),)),
        Reply(text="Proposed p1."),
    ]
    with StandInOpenAI(script=script) as server:
        choice = openai_reasoner(server).choose(sit, tools)
    assert choice.plan is not None and choice.plan.id == "p1"
    tr = choice.trace
    assert (tr.reasoner, tr.model, tr.chose) == ("openai", "standin-model", "p1")
    assert [c.tool for c in tr.tool_calls] == ["list_workloads", "explain_queue", "propose"]
    assert all(c.ok for c in tr.tool_calls)
    assert any("sla-ft is urgent" in w for w in tr.why)
    assert any("Proposed p1." in w for w in tr.why)
    assert [c.verdict for c in tr.considered] == ["chosen by the model"]
    # the wire: every request offered exactly the five typed tools and the situation
    first = server.requests[0]
    assert [t["function"]["name"] for t in first["tools"]] == list(TOOL_NAMES)
    assert first["messages"][0]["role"] == "system"
    assert "deadline-at-risk" in first["messages"][1]["content"]
    assert len(server.requests) == 4
    # each tool result went back with the id of the call it answers
    results = server.tool_messages(1)
    assert [m["tool_call_id"] for m in results] == ["call_1_0"]
    listed = json.loads(results[0]["content"])
    assert [w["id"] for w in listed["workloads"]] == ["batch"]
    # nothing changed: the reasoner only chose; the plan is valid when the loop applies it
    assert cp.get("batch").state is State.RUNNING
    assert cp.apply(list(choice.plan.actions)).accepted


def test_openai_hallucinations_are_refused_or_rejected() -> None:
    cp = sla_cluster()
    version = cp.version
    sit, tools = situation(cp)
    script = [
        Reply(calls=(("drop_table", {"name": "workloads"}),
                     ("list_workloads", '{"state": "running"')),),  # unknown tool, broken JSON
        Reply(calls=(("propose", {"rationale": "place it on the CPU node",
                                  "actions": [{"kind": "place", "workload": "sla-ft",
                                               "node": "cpu1"}]}),)),
        Reply(calls=(("propose", {"rationale": "trust me", "actions": HALLUCINATED}),)),
        Reply(text="Done, I fixed everything."),
    ]
    with StandInOpenAI(script=script) as server:
        choice = openai_reasoner(server).choose(sit, tools)
        refusals = [json.loads(m["content"]) for m in server.tool_messages(1)]
    tr = choice.trace
    # the last proposal parses, but the tools' own fork (no forecaster here) rejects it
    assert [(c.tool, c.ok) for c in tr.tool_calls] == [
        ("drop_table", False), ("list_workloads", False), ("propose", False), ("propose", False)]
    assert tr.tool_calls[3].summary.startswith("rejected on a fork of the state these tools read")
    assert "not allowed" in tr.tool_calls[0].summary
    assert "not valid JSON" in tr.tool_calls[1].summary
    assert "'place' is not one an agent may propose" in tr.tool_calls[2].summary
    assert any("guardrail refused 3 tool call(s)" in w for w in tr.why)
    # the model was told why, so it could correct itself
    assert all(r["ok"] is False and r["error"].startswith("refused:") for r in refusals)
    # it did propose something that parses: the reasoner hands it on, never applies it
    assert choice.plan is not None and choice.plan.strategy == "reasoner-proposed"
    assert cp.version == version
    assert_refused_by_control_plane(cp, choice.plan)


def test_openai_that_proposes_nothing_chooses_nothing() -> None:
    cp = sla_cluster()
    sit, tools = situation(cp)
    with StandInOpenAI(script=[Reply(text="Nothing to do: the wait is short.")]) as server:
        choice = openai_reasoner(server).choose(sit, tools)
    assert choice.plan is None and choice.trace.chose == "nothing"
    assert "the model proposed nothing" in choice.trace.why


def test_openai_endpoint_failure_decides_nothing() -> None:
    cp = sla_cluster()
    sit, tools = situation(cp)
    import openai

    with StandInOpenAI(fail_with=500) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        choice = OpenAIReasoner("standin-model", client=client).choose(sit, tools)
    assert choice.plan is None
    assert any("the model endpoint failed: InternalServerError" in w for w in choice.trace.why)


def test_openai_round_budget_stops_a_looping_model() -> None:
    cp = sla_cluster()
    sit, tools = situation(cp)
    script = [Reply(calls=(("propose", {"plan_id": "p1", "rationale": "x"}),))] + [
        Reply(calls=(("explain_queue", {}),)) for _ in range(10)]
    with StandInOpenAI(script=script) as server:
        choice = openai_reasoner(server, max_rounds=3).choose(sit, tools)
        assert len(server.requests) == 3
    assert choice.plan is None  # an unfinished conversation is not a decision
    assert any("still calling tools after 3 rounds" in w for w in choice.trace.why)


def test_openai_not_configured_says_what_to_set() -> None:
    for env in ({}, {"MLWE_OPENAI_MODEL": "m"}, {"MLWE_OPENAI_BASE_URL": "http://127.0.0.1:1/v1"}):
        with pytest.raises(LLMNotConfigured) as err:
            OpenAIReasoner.from_env(env)
        msg = str(err.value)
        assert "MLWE_OPENAI_MODEL" in msg and "MLWE_OPENAI_BASE_URL" in msg
        assert "OPENAI_API_KEY" in msg and "'rules' reasoner" in msg
    r = OpenAIReasoner.from_env({"MLWE_OPENAI_MODEL": "qwen", "OPENAI_BASE_URL": "http://x/v1"})
    assert r.model == "qwen" and r.base_url == "http://x/v1"


# ==================================================================== adk
from mlwe.agent.reasoners.llm_adk import adk_available  # noqa: E402

requires_adk = pytest.mark.skipif(
    not adk_available(), reason="Google ADK (the optional extra mlwe[adk]) is not installed"
)


def adk_reasoner(server: StandInGemini) -> Any:
    from mlwe.agent.reasoners.llm_adk import AdkReasoner

    return AdkReasoner("gemini-2.5-flash", base_url=server.base_url, api_key="standin-key")


@requires_adk
def test_adk_agent_reads_then_proposes_a_candidate() -> None:
    cp = sla_cluster()
    sit, tools = situation(cp)
    script = [
        Reply(calls=(("list_workloads", {"state": "running"}),)),
        Reply(calls=(("propose", {"plan_id": "p1", "rationale": "urgent SLA work"}),)),
        Reply(text="Proposed p1."),
    ]
    with StandInGemini(script=script) as server:
        choice = adk_reasoner(server).choose(sit, tools)
    assert choice.plan is not None and choice.plan.id == "p1", choice.trace.why
    tr = choice.trace
    assert (tr.reasoner, tr.model) == ("adk", "gemini-2.5-flash")
    assert [(c.tool, c.ok) for c in tr.tool_calls] == [("list_workloads", True), ("propose", True)]
    # the wire: Gemini's generateContent, tools declared from the same JSON schemas
    assert server.paths[0] == "/v1beta/models/gemini-2.5-flash:generateContent"
    declared = server.requests[0]["tools"][0]["functionDeclarations"]
    assert sorted(d["name"] for d in declared) == sorted(TOOL_NAMES)
    by_name = {d["name"]: d for d in declared}
    schema = next(v for k, v in by_name["propose"].items()
                  if k in ("parametersJsonSchema", "parameters_json_schema"))
    assert schema["required"] == ["rationale"]  # the very schema the tools check against
    assert "mlwe" in json.dumps(server.requests[0]["systemInstruction"])
    sent = server.function_responses(1)
    assert sent[0]["name"] == "list_workloads"
    assert [w["id"] for w in sent[0]["response"]["workloads"]] == ["batch"]
    assert cp.get("batch").state is State.RUNNING


@requires_adk
def test_adk_guardrail_refuses_and_the_control_plane_rejects() -> None:
    cp = sla_cluster()
    version = cp.version
    sit, tools = situation(cp)
    script = [
        Reply(calls=(("shell", {"cmd": "kubectl delete pods --all"}),)),
        Reply(calls=(("list_workloads", {"state": "exploded"}),)),
        Reply(calls=(("propose", {"rationale": "evict everything",
                                  "actions": [{"kind": "add-node", "spec": {}}]}),)),
        Reply(calls=(("propose", {"rationale": "trust me", "actions": HALLUCINATED}),)),
        Reply(text="All fixed."),
    ]
    with StandInGemini(script=script) as server:
        choice = adk_reasoner(server).choose(sit, tools)
        told = [r["response"] for i in range(1, 4) for r in server.function_responses(i)
                if r["response"].get("ok") is False]
    tr = choice.trace
    # the last proposal parses, but the tools' own fork (no forecaster here) rejects it
    assert [(c.tool, c.ok) for c in tr.tool_calls] == [
        ("shell", False), ("list_workloads", False), ("propose", False), ("propose", False)]
    assert "priority rule" in tr.tool_calls[3].summary
    assert all(c.summary.startswith("refused by the guardrail") for c in tr.tool_calls[:3])
    assert len(told) >= 3 and all("refused" in r["error"] for r in told[:3])
    assert choice.plan is not None
    assert cp.version == version
    assert_refused_by_control_plane(cp, choice.plan)


@requires_adk
def test_adk_endpoint_failure_decides_nothing() -> None:
    cp = sla_cluster()
    sit, tools = situation(cp)
    with StandInGemini(fail_with=503) as server:
        choice = adk_reasoner(server).choose(sit, tools)
    assert choice.plan is None
    assert any(w.startswith("the ADK agent failed") for w in choice.trace.why)


@requires_adk
def test_adk_not_configured_says_what_to_set() -> None:
    from mlwe.agent.reasoners import llm_adk

    with pytest.raises(LLMNotConfigured) as err:
        llm_adk.AdkReasoner.from_env({})
    msg = str(err.value)
    assert "GOOGLE_API_KEY" in msg and "GOOGLE_GENAI_USE_VERTEXAI" in msg
    assert "LiteLLM" in msg and "'rules' reasoner" in msg
    r = llm_adk.AdkReasoner.from_env({"GEMINI_API_KEY": "k", "MLWE_ADK_MODEL": "gemini-2.5-pro"})
    assert r.model == "gemini-2.5-pro"
    try:
        import litellm  # noqa: F401
    except ImportError:
        with pytest.raises(LLMNotConfigured, match="pip install litellm"):
            llm_adk.AdkReasoner.from_env({"MLWE_ADK_MODEL": "ollama_chat/llama3.1"})


def test_selecting_an_llm_reasoner_without_a_model_says_what_to_configure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlwe.agent.reasoners import make_reasoner

    for var in ("MLWE_OPENAI_MODEL", "MLWE_OPENAI_BASE_URL", "OPENAI_BASE_URL",
                "MLWE_OPENAI_API_KEY", "OPENAI_API_KEY", "GOOGLE_API_KEY", "GEMINI_API_KEY",
                "GOOGLE_GENAI_USE_VERTEXAI", "MLWE_ADK_MODEL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(LLMNotConfigured, match="MLWE_OPENAI_MODEL"):
        make_reasoner("openai")
    with pytest.raises(LLMNotConfigured, match=r"GOOGLE_API_KEY|pip install 'mlwe\[adk\]'"):
        make_reasoner("adk")
    monkeypatch.setenv("MLWE_OPENAI_MODEL", "llama")
    monkeypatch.setenv("MLWE_OPENAI_BASE_URL", "http://127.0.0.1:11434/v1")
    assert make_reasoner("openai").name == "openai"


def test_the_agent_loop_with_an_llm_reasoner_survives_a_hallucination() -> None:
    """The whole MAPE loop on the SLA scenario, the reasoner being the openai one
    talking to a stand-in that hallucinates on its first turn, then picks the
    candidate with the best stated benefit (a scripted policy, not a model)."""
    from mlwe.agent.scenarios import run_world, sla_fine_tune

    turns = {"hallucinated": 0}

    def standin(body: dict[str, Any]) -> Reply:
        msgs = body["messages"]
        if msgs[-1]["role"] == "tool":
            return Reply(text="done")
        sit = json.loads(msgs[1]["content"].split("\n")[1])
        if not sit["feedback"] and not turns["hallucinated"]:
            turns["hallucinated"] += 1
            return Reply(calls=(("propose", {"rationale": "trust me", "actions": [
                {"kind": "preempt", "victim": "ft-sla", "preemptor": "train-0"},
                {"kind": "set-priority", "workload": "ghost", "priority": 1}]}),))
        tried = {f["plan_id"] for f in sit["feedback"]}
        open_ = [c for c in sit["candidates"] if c["id"] not in tried]
        if not open_:
            return Reply(text="nothing to do")
        f = [c["factors"] for c in open_]
        best = open_[max(range(len(open_)), key=lambda i: f[i].get("benefit", 0)
                         - f[i].get("cost", 0) - f[i].get("risk", 0))]
        return Reply(calls=(("propose", {"plan_id": best["id"], "rationale": "best benefit"}),))

    sc = sla_fine_tune()
    with StandInOpenAI(script=[standin] * 100) as server:
        world = run_world(sc, with_agent=True, reasoner=OpenAIReasoner(
            "standin-model", base_url=server.base_url))
        asked_again = [json.loads(r["messages"][1]["content"].split("\n")[1])["feedback"]
                       for r in server.requests if r["messages"][-1]["role"] == "user"]
    assert world.agent is not None
    records = list(world.agent.records)
    assert records[0]["outcome"] == "not-verified"
    assert records[0]["trace"]["reasoner"] == "openai"
    assert "unknown workload 'ghost'" in " ".join(records[0]["reasons"])
    assert "priority rule" in " ".join(records[0]["reasons"])
    # the rejection went back to the model with its reasons, and it chose again
    assert asked_again[1][0]["outcome"] == "not-verified"
    assert records[1]["outcome"] == "committed"
    assert world.committed() == [records[1]["trace"]["chose"]]
    assert world.cp.workloads.get("ghost") is None
    checks = sc.expect(world, run_world(sc, with_agent=False))
    assert all(ok for _, ok, _ in checks), checks
