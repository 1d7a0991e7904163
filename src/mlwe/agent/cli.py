"""``mlwe agent ...``: the agent's commands (registered in ``mlwe.cli``).

``mlwe agent eval [--json] [--scenario NAME ...] [--reasoner rules]`` runs the
scenario evaluations (with and without the agent, on the simulator) and
prints per-scenario pass/fail, the expectations, and KPIs. Exit status 1 if
any scenario fails.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

agent_app = typer.Typer(help="The autonomic agent: scenario evaluations.", no_args_is_help=True)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@agent_app.command("eval")
def eval_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
    scenario: Annotated[
        list[str] | None, typer.Option("--scenario", "-s", help="run only these (repeatable)")
    ] = None,
    reasoner: Annotated[str, typer.Option(help="reasoner to evaluate")] = "rules",
    seed: Annotated[int, typer.Option(help="simulator seed")] = 0,
) -> None:
    """Run the agent's scenario evaluations on the simulator and print a score."""
    from mlwe.agent.scenarios import evaluate

    try:
        result = evaluate(scenario or None, reasoner=reasoner, seed=seed)
    except ValueError as exc:
        err.print(f"error: {exc}")
        raise typer.Exit(2) from None
    if as_json:
        out.print(json.dumps(result, indent=2, sort_keys=True), soft_wrap=True, markup=False)
    else:
        table = Table(title=f"agent evaluation ({result['reasoner']} reasoner, seed {seed})")
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
