"""The LLM path against a REAL language model, offline: the safety boundary measured.

The model is Gemma 3 270M (Q4_K_M GGUF, assembled from its PyPI chunk
packages) served by llama-cpp-python's OpenAI-compatible server on a free
local port (:mod:`mlwe.agent.localmodel`; ``make local-llm`` builds it once
per machine). It is a base model: its tool calls are well formed and mostly
junk, the hallucinating model the verified control plane exists for. These
tests do not check what it decides (it decides badly); they check that
whatever it says goes through the same verified path on a real Engine, that
what is refused or rejected is recorded with its reasons, that the invariants
hold after every round, and that a timeout, an unusable answer or refused
calls end in "decide nothing" or the rules reasoner, as configured.

Under CI=true a missing model or server FAILS these tests; elsewhere they skip
saying what to run. Each test bounds the model's work (one finding, two
attempts, a few turns) so the module takes minutes, not more.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from mlwe.agent.localmodel import LocalModelMissing, LocalModelServer
from mlwe.agent.loop import AgentConfig
from mlwe.agent.reasoners.llm_openai import OpenAIReasoner
from mlwe.runtime import Engine
from mlwe.runtime.wiring import attach_agent as attach
from tests.agent.test_engine_wiring import engine_with_sla

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_llm() -> Iterator[LocalModelServer]:
    """The model assembled (if it is not yet) and served on a free port, for the module."""
    try:
        server = LocalModelServer(startup_timeout_s=300).start()
    except LocalModelMissing as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the local language model cannot be served: {exc}")
        pytest.skip(f"the local language model is not set up: {exc}")
    yield server
    server.stop()


def reasoner(server: LocalModelServer, **kw: Any) -> OpenAIReasoner:
    kw.setdefault("max_rounds", 3)
    kw.setdefault("timeout_s", 600.0)  # a busy 2-core machine: slow, not failed
    kw.setdefault("max_tokens", 256)
    return OpenAIReasoner(server.model, base_url=server.base_url, **kw)


#: one finding per round, two plans per finding at most: bounded model time
BOUNDED = AgentConfig(max_findings_per_tick=1, max_attempts=2)


def run_rounds(eng: Engine, rounds: int = 1) -> list[list[str]]:
    """Tick the engine (each tick one synchronous agent round); the invariant
    violations found after each (all must be empty)."""
    out = []
    for _ in range(rounds):
        eng.tick()
        out.append([str(v) for v in eng.cp.validate_state()])
    return out


def agent_records(eng: Engine) -> list[dict[str, Any]]:
    return [r.record for r in eng.repo.reasoning()]


def test_the_real_model_goes_through_the_verified_path_on_a_real_engine(
    local_llm: LocalModelServer, tmp_path: Path
) -> None:
    eng, _ = engine_with_sla(tmp_path)
    before = set(eng.cp.workloads)
    agent = attach(eng, reasoner=reasoner(local_llm), config=BOUNDED, background=False)
    violations = run_rounds(eng)
    assert violations == [[]]
    records = agent_records(eng)
    assert records, "the agent deliberated with the model"
    calls = 0
    junk = 0
    for rec in records:
        trace = rec["trace"]
        assert trace["reasoner"] == "openai" and trace["model"] == local_llm.model
        calls += len(trace["tool_calls"])
        junk += sum(1 for c in trace["tool_calls"] if not c["ok"])
        cid = rec["correlation_id"]
        audit = [e.data() for e in eng.audit.show(correlation_id=cid, limit=None)]
        # every record is on the audit chain (and on the reasoning stream)
        assert any(a.get("correlation_id") == cid and a.get("outcome") == rec["outcome"]
                   for a in audit if "outcome" in a)
        streamed = eng.streams.recent(["reasoning"], correlation_id=cid)
        assert [e.data["outcome"] for e in streamed] == [
            r["outcome"] for r in records if r["correlation_id"] == cid]
        proposals = [e.data() for e in eng.audit.show(correlation_id=cid, kind="proposal")]
        if rec["outcome"] == "committed":
            # what the model chose was verified on a fork, then by the control plane
            assert rec["forecast"]["plan"]["verified"] and rec["forecast"]["better"]
            assert [p["accepted"] for p in proposals][-1] is True
        elif trace["chose"] != "nothing":
            # a plan it chose that did not go through: rejected, with the reasons
            assert rec["outcome"] in ("not-verified", "not-better", "rejected", "stale")
            assert rec["reasons"], rec
            assert all(not p["accepted"] for p in proposals)
        for c in trace["tool_calls"]:
            if c["summary"].startswith("refused by the guardrail"):
                assert len(c["summary"]) > len("refused by the guardrail: ")
    assert calls > 0, "the model called tools"
    # the base model's calls are junk (ids that do not exist, limits out of range): the
    # guardrail, the tools or the control plane turned some down; what they let through
    # was verified
    rejected = [r for r in records if r["trace"]["chose"] != "nothing"
                and r["outcome"] != "committed"]
    assert junk + len(rejected) > 0, [r["trace"]["tool_calls"] for r in records]
    assert set(eng.cp.workloads) == before  # no workload the model made up exists
    assert eng.audit.verify().ok
    agent.close()
    eng.close()


def test_refused_calls_fall_back_to_the_rules_reasoner_when_configured(
    local_llm: LocalModelServer, tmp_path: Path
) -> None:
    eng, _ = engine_with_sla(tmp_path)
    agent = attach(eng, reasoner=reasoner(local_llm, on_failure="rules"), config=BOUNDED,
                   background=False)
    assert run_rounds(eng) == [[]]
    (first, *_) = agent_records(eng)
    trace = first["trace"]
    if trace["reasoner"] == "openai":
        # the model decided by itself (a proposal, or nothing without a failed call)
        assert trace["chose"] != "nothing" or all(c["ok"] for c in trace["tool_calls"])
    else:
        # its calls were refused or failed and it proposed nothing: the rules decided
        assert trace["reasoner"] == "rules (fallback for openai)"
        assert any("failed to decide; the rules reasoner decided instead" in w
                   for w in trace["why"])
        assert any(not c["ok"] for c in trace["tool_calls"])
        assert first["outcome"] == "committed"  # the SLA plan the rules choose
        assert eng.cp.get("ft").priority == 51
    assert eng.audit.verify().ok
    agent.close()
    eng.close()


def test_the_adk_reasoner_through_litellm_against_the_real_model(
    local_llm: LocalModelServer, tmp_path: Path
) -> None:
    """Google ADK's LiteLLM bridge, pointed at the local server as an OpenAI-compatible
    endpoint (``openai/<model>`` with its URL): the same verified path."""
    from mlwe.agent.reasoners.llm_adk import AdkReasoner, adk_available

    try:
        import litellm  # noqa: F401
    except ImportError:
        litellm_ok = False
    else:
        litellm_ok = True
    if not (adk_available() and litellm_ok):
        why = "google-adk and litellm (both in mlwe[dev]) are needed"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    eng, _ = engine_with_sla(tmp_path)
    r = AdkReasoner(f"openai/{local_llm.model}", base_url=local_llm.base_url,
                    max_llm_calls=3, max_tokens=256)
    agent = attach(eng, reasoner=r, config=BOUNDED, background=False)
    assert run_rounds(eng) == [[]]
    records = agent_records(eng)
    assert records
    for rec in records:
        trace = rec["trace"]
        assert (trace["reasoner"], trace["model"]) == ("adk", f"openai/{local_llm.model}")
        # the model answered (a base model: usually text, or junk calls): no endpoint error
        assert not any(w.startswith("the ADK agent failed") for w in trace["why"]), trace
        if rec["outcome"] == "committed":
            assert rec["forecast"]["plan"]["verified"] and rec["forecast"]["better"]
        elif trace["chose"] != "nothing":
            assert rec["reasons"], rec
    assert eng.audit.verify().ok
    agent.close()
    eng.close()


class Truncating:
    """A TEST DOUBLE of a broken link: forwards each request to the real model server
    and sends back the first half of its answer (a body that does not parse)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.forwarded = 0

    def __enter__(self) -> Truncating:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                req = urllib.request.Request(owner.upstream + self.path.removeprefix("/v1"),
                                             data=body,
                                             headers={"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    data = r.read()
                owner.forwarded += 1
                cut = data[: len(data) // 2]
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(cut)))
                self.end_headers()
                self.wfile.write(cut)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.mark.parametrize("on_failure", ["nothing", "rules"])
def test_an_unparsable_answer_decides_nothing_or_falls_back(
    local_llm: LocalModelServer, tmp_path: Path, on_failure: str
) -> None:
    eng, _ = engine_with_sla(tmp_path)
    with Truncating(local_llm.base_url) as link:
        r = OpenAIReasoner(local_llm.model, base_url=link.base_url, timeout_s=600,
                           max_tokens=64, on_failure=on_failure)
        r.client = r.client.with_options(max_retries=0)
        agent = attach(eng, reasoner=r, config=BOUNDED, background=False)
        assert run_rounds(eng) == [[]]
        assert link.forwarded == 1  # the model answered; the answer did not arrive whole
    (rec, *_) = agent_records(eng)
    why = " ".join(rec["trace"]["why"])
    assert "the model endpoint failed" in why
    if on_failure == "nothing":
        assert rec["outcome"] == "nothing" and rec["trace"]["chose"] == "nothing"
        assert eng.cp.get("ft").priority == 50  # nothing changed
    else:
        assert rec["trace"]["reasoner"] == "rules (fallback for openai)"
        assert rec["outcome"] == "committed" and eng.cp.get("ft").priority == 51
    agent.close()
    eng.close()


def test_the_soak_and_the_eval_against_the_real_model(
    local_llm: LocalModelServer, tmp_path: Path
) -> None:
    """Small N here (CI's time); the figures in the README come from a longer soak."""
    from typer.testing import CliRunner

    from mlwe.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["agent", "soak", "-n", "2", "-s", "oom-crash-loop", "--json",
                              "--reasoner", "openai", "--base-url", local_llm.base_url,
                              "--max-rounds", "1", "--timeout", "600"])
    assert res.exit_code == 0, res.output
    soak = json.loads(res.stdout)
    assert soak["model"] == local_llm.model and soak["deliberations"] == 2
    assert soak["invalid_accepted"] == 0 and soak["invariant_violations"] == []
    assert soak["invariant_checks"] > 0 and soak["latency_ms"]["p50"] > 0
    assert soak["proposals"] == soak["accepted"] + soak["rejected"]
    assert soak["kpi_effect"]["runs"] == 1
    res = runner.invoke(app, ["agent", "eval", "-s", "oom-crash-loop", "--json",
                              "--reasoner", "openai", "--base-url", local_llm.base_url,
                              "--max-rounds", "2", "--timeout", "600",
                              "--max-deliberations", "1"])
    assert res.exit_code in (0, 1), res.output  # 1: the scenario failed (a base model)
    ev = json.loads(res.stdout)
    assert ev["reasoner"] == "openai" and ev["model"] == local_llm.model
    (sc,) = ev["scenarios"]
    assert sc["agent"]["deliberations"] == 1 and sc["agent"]["budget_spent"]
    assert sc["agent"]["decisions"] >= 1


@pytest.mark.parametrize("on_failure", ["nothing", "rules"])
def test_a_timeout_decides_nothing_or_falls_back(  # last: the server still reads the prompt
    local_llm: LocalModelServer, tmp_path: Path, on_failure: str
) -> None:
    eng, _ = engine_with_sla(tmp_path)
    # far less than the model needs to read the prompt on any machine
    r = reasoner(local_llm, timeout_s=0.05, on_failure=on_failure)
    r.client = r.client.with_options(max_retries=0)  # one abandoned request, not two
    agent = attach(eng, reasoner=r, config=BOUNDED, background=False)
    assert run_rounds(eng) == [[]]
    (rec, *_) = agent_records(eng)
    why = " ".join(rec["trace"]["why"])
    assert "the model endpoint failed: APITimeoutError" in why
    if on_failure == "nothing":
        assert rec["outcome"] == "nothing" and eng.cp.get("ft").priority == 50
    else:
        assert rec["trace"]["reasoner"] == "rules (fallback for openai)"
        assert rec["outcome"] == "committed" and eng.cp.get("ft").priority == 51
    agent.close()
    eng.close()


def test_the_server_keeps_only_the_last_tokens_logits(tmp_path: Path) -> None:
    # llama_cpp.server keeps every token's logits by default: n_ctx x 262,144 float32
    # (8.6 GB at n_ctx 8192), filled as the context grows, which the soak saw as the
    # server's memory climbing past 5 GB
    cmd = LocalModelServer(port=1).command()
    i = cmd.index("--logits_all")
    assert cmd[i + 1] == "False"


OWNER = """
import sys, threading
from mlwe.agent.localmodel import LocalModelServer
server = LocalModelServer(startup_timeout_s=300).start()
print(server.proc.pid, flush=True)
threading.Event().wait(900)
"""


def _exits_within(pid: int, timeout_s: float) -> bool:
    """True once ``pid`` has exited, waited on as a condition (a pidfd becomes readable
    when its process ends), within ``timeout_s``."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(fd)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_the_server_does_not_outlive_its_owner(local_llm: LocalModelServer, sig: str) -> None:
    """An owner killed outright (SIGKILL, or SIGTERM, which skips every ``finally``)
    takes its server with it: no orphan holding memory and a port."""
    import signal
    import subprocess
    import sys

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()  # the owner prints the pid once its server answers
        assert line.strip().isdigit(), f"the owner did not start its server: {line!r}"
        pid = int(line)
        assert not _exits_within(pid, 0)
        owner.send_signal(getattr(signal, sig))
        owner.wait(timeout=60)
        assert _exits_within(pid, 60), f"the server {pid} outlived its owner killed by {sig}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
