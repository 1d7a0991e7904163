"""The ``mlwe`` command: parses, calls, prints. No logic of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from mlwe.specfile import SpecFileError, load_workloads

app = typer.Typer(
    name="mlwe",
    help="ML Workload Engine: verified, deterministic, explainable scheduling for ML clusters.",
    no_args_is_help=True,
    add_completion=False,
)
bench_app = typer.Typer(help="Benchmarks that print figures (not tests).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@app.command()
def validate(
    files: Annotated[list[Path], typer.Argument(help="workload spec files (YAML or JSON)")],
) -> None:
    """Validate workload specs; print every error with its field path."""
    bad = 0
    for f in files:
        try:
            specs = load_workloads(f)
        except SpecFileError as exc:
            bad += len(exc.errors)
            for e in exc.errors:
                err.print(f"[red]error[/red] {e}", markup=True, soft_wrap=True)
            continue
        out.print(f"{f}: {len(specs)} workload spec(s) valid")
    if bad:
        err.print(f"{bad} error(s)")
        raise typer.Exit(1)


@app.command()
def demo(
    as_json: Annotated[bool, typer.Option("--json", help="decision log as JSON lines")] = False,
    hours: Annotated[float, typer.Option(help="simulated hours to run")] = 12.0,
) -> None:
    """Run the built-in scenario on a simulated cluster and print the decision log."""
    from mlwe.sim.demo import DEMO_CLUSTER, run_demo

    d = run_demo(hours)
    cp = d.cp
    if as_json:
        for rec in cp.decisions:
            out.print(rec.to_json(), soft_wrap=True, markup=False)
        return
    nodes = DEMO_CLUSTER.all_nodes()
    out.rule("[bold]mlwe demo: an urgent fine-tune arrives into a full cluster")
    out.print(
        f"cluster: {len(nodes)} nodes ("
        + ", ".join(
            f"{n.name}: {n.gpus} x {n.gpu_model}" if n.gpus else f"{n.name}: cpu" for n in nodes
        )
        + ")"
    )
    out.print(
        f"policy: {d.scheduler.name} ({d.scheduler.ordering.name}, {d.scheduler.placement.name},"
        f" {d.scheduler.preemption.name}, backfill={d.scheduler.config.backfill})\n"
    )
    for rec in cp.decisions:
        if rec.kind == "reject":
            continue
        colour = {"preempt": "yellow", "place": "green", "admit-deadline": "cyan"}.get(
            rec.kind, "white"
        )
        out.print(
            f"[dim]t={rec.time / 60:6.1f}m v{rec.version:<3}[/dim] [{colour}]{rec.kind:<14}[/{colour}]"
            f" [bold]{rec.workload}[/bold]",
            markup=True,
        )
        for reason in rec.reasons:
            out.print(f"      - {reason}", markup=False, soft_wrap=True)
    table = Table(title="final state", show_lines=False)
    for col in ("workload", "priority", "state", "attempts", "preempted", "history"):
        table.add_column(col)
    for w in cp.workloads.values():
        table.add_row(
            w.id,
            str(w.priority),
            w.state.value,
            str(w.attempt),
            str(w.preemptions),
            " > ".join(t.target.value for t in w.history),
        )
    out.print(table)
    out.print(f"invariants: ok after {cp.invariant_checks} checks; state version {cp.version}")


@bench_app.command("core")
def bench_core(
    nodes: Annotated[int, typer.Option(min=1)] = 1000,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, max=64)] = 8,
    pending: Annotated[int, typer.Option(min=0)] = 2000,
    running: Annotated[int, typer.Option(min=0)] = 0,
    seed: int = 0,
    preemptions: Annotated[int, typer.Option(min=0)] = 200,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Placement and preemption speed of the control plane on a synthetic cluster."""
    from mlwe.sim.bench import bench_core as run

    result = run(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        pending=pending,
        running=running,
        seed=seed,
        preemptions=preemptions,
    )
    if as_json:
        print(json.dumps(result))
        return
    table = Table(title=f"bench core: {nodes} nodes x {gpus_per_node} GPUs")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, str(v))
    out.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
