"""``mlwe agent ...``: the agent's commands (registered in ``mlwe.cli``).

``mlwe agent eval [--json] [--scenario NAME ...] [--reasoner rules]`` runs the
scenario evaluations (with and without the agent, on the simulator) and
prints per-scenario pass/fail, the expectations, and KPIs. Exit status 1 if
any scenario fails.

``mlwe agent soak -n N --reasoner openai --base-url URL`` runs N deliberations
through the loop and reports proposals, rejections by reason, invariant
checks, latency and the KPI effect (:mod:`mlwe.agent.soak`); exit status 1 if
an invalid proposal was accepted or an invariant broke.

An LLM reasoner is configured by ``--base-url``/``--model``/``--on-failure``
(or the environment, see the reasoners); ``--local-model`` starts the local
Gemma 3 270M server for the run instead (:mod:`mlwe.agent.localmodel`; set it
up with ``mlwe agent local-model setup`` or ``make local-llm``).
"""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from mlwe.agent.reasoners.base import Reasoner

agent_app = typer.Typer(help="The autonomic agent: status, mode, approvals (through a server) and scenario evaluations.", no_args_is_help=True)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


ReasonerName = Annotated[str, typer.Option(help="reasoner: rules, openai or adk")]
BaseUrl = Annotated[str | None, typer.Option(
    "--base-url", help="an OpenAI-compatible server's URL (e.g. http://127.0.0.1:8000/v1) for"
    " the openai reasoner, or for adk through LiteLLM")]
ModelName = Annotated[str | None, typer.Option(
    "--model", help="the model's name (default: the first the server at --base-url lists)")]
OnFailure = Annotated[str | None, typer.Option(
    "--on-failure", help="when the model fails to decide: nothing or rules")]
Timeout = Annotated[float | None, typer.Option(
    "--timeout", help="seconds per model request (openai reasoner)")]
MaxRounds = Annotated[int | None, typer.Option(
    "--max-rounds", help="model turns per deliberation, at most (openai reasoner)")]
LocalModel = Annotated[bool, typer.Option(
    "--local-model", help="start the local Gemma 3 270M server for this run (offline; to"
    " exercise the guardrails, not to make decisions)")]


def _served_model(base_url: str) -> str:
    """The first model an OpenAI-compatible server lists."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/models", timeout=10) as r:
            doc = json.loads(r.read())
        return str(doc["data"][0]["id"])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"no model listed at {base_url}/models ({exc}): pass --model") from None


@contextlib.contextmanager
def _reasoner(name: str, base_url: str | None, model: str | None, on_failure: str | None,
              timeout: float | None, max_rounds: int | None,
              local_model: bool) -> Iterator[Reasoner | str]:
    """The reasoner the options describe (a name when there is nothing to configure)."""
    from mlwe.agent.reasoners import make_reasoner

    if name == "rules" and not (base_url or model or local_model):
        yield name
        return
    with contextlib.ExitStack() as stack:
        if local_model:
            from mlwe.agent.localmodel import LocalModelServer

            if base_url:
                raise ValueError("--local-model starts its own server: leave out --base-url")
            server = stack.enter_context(LocalModelServer())
            err.print(f"local model {server.model} served at {server.base_url}"
                      f" (started in {server.started_in_s} s)", soft_wrap=True)
            base_url, model = server.base_url, model or server.model
            # a small model on a busy CPU reads a long prompt for minutes: slow, not failed
            timeout = 600.0 if timeout is None else timeout
        opts: dict[str, Any] = {}
        if on_failure is not None:
            opts["on_failure"] = on_failure
        if name == "openai":
            if base_url is not None:
                opts["base_url"] = base_url
                opts["model"] = model or _served_model(base_url)
            elif model is not None:
                opts["model"] = model
            if timeout is not None:
                opts["timeout_s"] = timeout
            if max_rounds is not None:
                opts["max_rounds"] = max_rounds
        elif name == "adk":
            if base_url is not None:  # through LiteLLM, as an OpenAI-compatible server
                served = model or _served_model(base_url)
                opts["model"] = served if "/" in served else f"openai/{served}"
                opts["base_url"] = base_url
            elif model is not None:
                opts["model"] = model
        elif base_url or model:
            raise ValueError(f"--base-url and --model are for the openai and adk reasoners,"
                             f" not {name!r}")
        yield make_reasoner(name, **opts)


@agent_app.command("eval")
def eval_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    scenario: Annotated[
        list[str] | None, typer.Option("--scenario", "-s", help="run only these (repeatable)")
    ] = None,
    reasoner: ReasonerName = "rules",
    seed: Annotated[int, typer.Option(help="simulator seed")] = 0,
    base_url: BaseUrl = None,
    model: ModelName = None,
    on_failure: OnFailure = None,
    timeout: Timeout = None,
    max_rounds: MaxRounds = None,
    local_model: LocalModel = False,
    max_deliberations: Annotated[int | None, typer.Option(
        "--max-deliberations", help="per scenario, ask the reasoner at most this often"
        " (a slow model's bounded run)")] = None,
) -> None:
    """Run the agent's scenario evaluations on the simulator and print a score."""
    from mlwe.agent.localmodel import LocalModelMissing
    from mlwe.agent.reasoners.llm_common import LLMNotConfigured
    from mlwe.agent.scenarios import evaluate

    try:
        with _reasoner(reasoner, base_url, model, on_failure, timeout, max_rounds,
                       local_model) as r:
            result = evaluate(scenario or None, reasoner=r, seed=seed,
                              max_deliberations=max_deliberations)
    except (ValueError, LLMNotConfigured, LocalModelMissing) as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    if as_json:
        out.print(json.dumps(result, indent=2, sort_keys=True), soft_wrap=True, markup=False)
    else:
        by = result["reasoner"] + (f", model {result['model']}" if result.get("model") else "")
        table = Table(title=f"agent evaluation ({by} reasoner, seed {seed})")
        for col in ("scenario", "result", "score", "committed", "agent KPIs", "baseline KPIs"):
            table.add_column(col)
        for r in result["scenarios"]:
            keys = [k for k in r["kpis"]["agent"] if k not in ("completed", "failed")][:4]
            table.add_row(
                r["scenario"],
                "[green]pass[/green]" if r["passed"] else "[red]FAIL[/red]",
                f"{r['score']:.2f}",
                ", ".join(r["agent"]["committed"]) or "-",
                ", ".join(f"{k}={r['kpis']['agent'][k]}" for k in keys),
                ", ".join(f"{k}={r['kpis']['baseline'][k]}" for k in keys),
            )
        out.print(table)
        for r in result["scenarios"]:
            for e in r["expectations"]:
                mark = "ok " if e["ok"] else "FAIL"
                out.print(f"  {mark} {r['scenario']}: {e['name']} ({e['detail']})", markup=False)
        out.print(f"passed {result['passed']}/{result['total']}, score {result['score']:.2f}")
    if result["passed"] != result["total"]:
        raise typer.Exit(1)


@agent_app.command("soak")
def soak_cmd(
    n: Annotated[int, typer.Option("-n", help="deliberations to run")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    scenario: Annotated[
        list[str] | None, typer.Option("--scenario", "-s", help="only these (repeatable)")
    ] = None,
    reasoner: ReasonerName = "openai",
    seed: Annotated[int, typer.Option(help="first simulator seed (one more per cycle)")] = 0,
    base_url: BaseUrl = None,
    model: ModelName = None,
    on_failure: OnFailure = None,
    timeout: Timeout = None,
    max_rounds: MaxRounds = None,
    local_model: LocalModel = False,
) -> None:
    """N deliberations through the agent loop: proposals, rejections by reason, invariant
    checks, latency and the KPI effect against doing nothing."""
    from mlwe.agent.localmodel import LocalModelMissing
    from mlwe.agent.reasoners import make_reasoner
    from mlwe.agent.reasoners.llm_common import LLMNotConfigured
    from mlwe.agent.soak import soak

    try:
        with _reasoner(reasoner, base_url, model, on_failure, timeout, max_rounds,
                       local_model) as r:
            result = soak(make_reasoner(r) if isinstance(r, str) else r, n,
                          scenarios=scenario or None, seed=seed,
                          progress=lambda line: err.print(line, markup=False, soft_wrap=True))
    except (ValueError, LLMNotConfigured, LocalModelMissing) as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    if as_json:
        out.print(json.dumps(result, indent=2, sort_keys=True), soft_wrap=True, markup=False)
    else:
        lines = [
            f"soak: {result['deliberations']} deliberations, reasoner {result['reasoner']}"
            + (f" ({result['model']})" if result["model"] else ""),
            f"latency ms: p50 {result['latency_ms']['p50']}, p95 {result['latency_ms']['p95']},"
            f" max {result['latency_ms']['max']}",
            f"proposals {result['proposals']}: accepted {result['accepted']},"
            f" rejected {result['rejected']}",
            *(f"  rejected x{c}: {r}" for r, c in result["rejected_by_reason"].items()),
            *(f"  refused call x{c}: {r}" for r, c in
              result["refused_tool_calls_by_reason"].items()),
            *(f"  failed deliberation x{c}: {r}" for r, c in
              result["failed_deliberations"].items()),
            f"outcomes: {result['outcomes']}",
            f"invariant checks {result['invariant_checks']}, violations"
            f" {len(result['invariant_violations'])}; accepted proposals checked"
            f" {result['accepted_checked']}, invalid accepted {result['invalid_accepted']}",
            f"KPI effect vs doing nothing ({result['kpi_effect']['runs']} runs): expectations"
            f" {result['kpi_effect']['expectations_passed']}/"
            f"{result['kpi_effect']['expectations']}, delta"
            f" {result['kpi_effect']['delta_vs_doing_nothing']}",
        ]
        for line in lines:
            out.print(line, markup=False, soft_wrap=True)
    if result["invalid_accepted"] or result["invariant_violations"]:
        raise typer.Exit(1)


local_app = typer.Typer(help="The local language model (offline): set up, status, serve.",
                        no_args_is_help=True)
agent_app.add_typer(local_app, name="local-model")


@local_app.command("setup")
def local_setup_cmd() -> None:
    """Build what is missing (llama-cpp-python wheel, server venv, assembled model)."""
    from mlwe.agent.localmodel import LocalModelMissing, setup, status

    try:
        layout = setup(log=lambda m: err.print(m, markup=False))
    except LocalModelMissing as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(1) from None
    out.print(json.dumps(status(layout), indent=2), markup=False, soft_wrap=True)


@local_app.command("status")
def local_status_cmd() -> None:
    """Where the wheel, the server's venv and the model are (exit 1 if not set up)."""
    from mlwe.agent.localmodel import status

    st = status()
    out.print(json.dumps(st, indent=2), markup=False, soft_wrap=True)
    if not (st["venv"] and st["model"]):
        raise typer.Exit(1)


@local_app.command("serve")
def local_serve_cmd(
    port: Annotated[int | None, typer.Option(help="port on 127.0.0.1 (default: a free one)")] = None,
) -> None:
    """Serve the local model (OpenAI-compatible) until interrupted; prints its URL."""
    import threading

    from mlwe.agent.localmodel import LocalModelMissing, LocalModelServer

    try:
        with LocalModelServer(port=port) as server:
            out.print(f"{server.base_url} (model {server.model}); Ctrl-C stops it", markup=False)
            try:
                while server.proc is not None and server.proc.poll() is None:
                    threading.Event().wait(1.0)
            except KeyboardInterrupt:
                pass
    except LocalModelMissing as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(1) from None
