"""The ``mlwe`` command: parses, calls, prints. No logic of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from mlwe.sim.checkpoint import CheckpointModel
    from mlwe.sim.replay import ReplayResult
    from mlwe.sim.traces import Trace

app = typer.Typer(
    name="mlwe",
    help="ML Workload Engine: verified, deterministic, explainable scheduling for ML clusters.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from mlwe import __version__

        print(f"mlwe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", "-V", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """ML Workload Engine: verified, deterministic, explainable scheduling for ML clusters."""
from mlwe.bench_cli import bench_app  # noqa: E402  (every `mlwe bench` command is registered there)

app.add_typer(bench_app, name="bench")
db_app = typer.Typer(help="The engine's database: schema migrations.", no_args_is_help=True)
app.add_typer(db_app, name="db")
events_app = typer.Typer(help="Event ingress: dead letters and replay.", no_args_is_help=True)
app.add_typer(events_app, name="events")
from mlwe.agent.cli import agent_app  # noqa: E402  (the agent's commands live in mlwe.agent)

app.add_typer(agent_app, name="agent")
from mlwe.store.cli import quarantine_app  # noqa: E402

app.add_typer(quarantine_app, name="quarantine")

DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="data directory of the default SQLite store; default $MLWE_DATA_DIR or ./.mlwe")
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="SQLAlchemy URL; default $MLWE_DATABASE_URL or SQLite"),
]

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


@app.command()
def validate(
    files: Annotated[list[Path], typer.Argument(help="workload spec files (YAML or JSON)")],
) -> None:
    """Validate workload specs; print every error with its field path."""
    from mlwe.specfile import SpecFileError, load_workloads

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


def _load_trace_for_cli(
    trace: str, cluster: str | None, limit: int | None, seed: int, skip_bad_rows: bool
) -> Trace:
    from mlwe.sim.traces import TRACE_CATALOG, TraceError, load_trace, parse_cluster_spec
    from mlwe.specfile import SpecFileError

    spec = None
    if cluster is not None:
        path = Path(cluster)
        if path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
            from mlwe.specfile import load_cluster

            try:
                spec = load_cluster(path, TRACE_CATALOG)
            except SpecFileError as exc:
                err.print(str(exc), markup=False)
                raise typer.Exit(2) from None
        else:
            try:
                spec = parse_cluster_spec(cluster)
            except ValueError as exc:
                err.print(f"--cluster: {exc}", markup=False)
                raise typer.Exit(2) from None
    try:
        return load_trace(trace, limit=limit, seed=seed, skip_bad_rows=skip_bad_rows, cluster=spec)
    except (TraceError, FileNotFoundError, ValueError) as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        if isinstance(exc, TraceError) and not skip_bad_rows:
            err.print("(use --skip-bad-rows to skip malformed rows and count them)")
        raise typer.Exit(2) from None


def _require_reports(out_dir: Path | None) -> None:
    """--out draws plots: say which extra they need before the replay, not after it."""
    if out_dir is None:
        return
    from mlwe.core.extras import MissingExtra
    from mlwe.sim.report import require_plotting

    try:
        require_plotting()
    except MissingExtra as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None


CHECKPOINT_HELP = (
    "what a preemption costs trace jobs: periodic:INTERVAL[,cost=C][,restart=R] (seconds;"
    " default periodic:1800,cost=0,restart=60), none (all work of the attempt lost) or free"
    " (instant, nothing lost); printed in every report"
)


def _checkpoint_model(text: str) -> CheckpointModel:
    from mlwe.sim.checkpoint import parse_checkpoint_model

    try:
        return parse_checkpoint_model(text)
    except ValueError as exc:
        err.print(f"--checkpoint: {exc}", markup=False)
        raise typer.Exit(2) from None


def _run_replays(
    tr: Trace,
    policies: list[str],
    seed: int,
    invariants: bool,
    quiet: bool,
    checkpoint: CheckpointModel | None = None,
) -> list[ReplayResult]:
    import time as _time

    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from mlwe.sim.replay import ReplayConfig, replay

    results = []
    total = len(tr.jobs)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), console=err, disable=quiet, transient=True,
    ) as bar:
        for policy in policies:
            task = bar.add_task(f"{tr.name} / {policy}", total=total, info="")
            last = [0.0]

            def progress(
                t: float, jobs: int, events: int, task: TaskID = task, last: list[float] = last
            ) -> None:
                now = _time.monotonic()
                if now - last[0] > 0.2:
                    last[0] = now
                    bar.update(task, completed=jobs,
                               info=f"sim t={t / 3600:,.1f}h, {events:,} events")

            cfg = ReplayConfig(policy=policy, seed=seed, check_invariants=invariants,
                               progress=None if quiet else progress)
            if checkpoint is not None:
                cfg.checkpoint = checkpoint
            results.append(replay(tr, cfg))
            bar.update(task, completed=total)
    return results


@app.command("replay")
def replay_cmd(
    trace: Annotated[str, typer.Argument(help="philly, itp:NN, alibaba, synthetic, or a CSV path")],
    policy: Annotated[str, typer.Option(help="scheduling policy (see mlwe compare --help)")] = "mlwe",
    cluster: Annotated[str | None, typer.Option(help="pooled:N, nodes:NxG[:MODEL] or a YAML cluster file")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="first N jobs")] = None,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="write metrics.json, report.md and plots here")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    skip_bad_rows: Annotated[bool, typer.Option("--skip-bad-rows")] = False,
    no_invariants: Annotated[bool, typer.Option("--no-invariants", help="profiling only: the report says so")] = False,
    checkpoint: Annotated[str, typer.Option(help=CHECKPOINT_HELP)] = "periodic:1800,cost=0,restart=60",
) -> None:
    """Replay a trace through the real control plane and a policy on simulated time."""
    from mlwe.sim.baselines import POLICIES

    if policy not in POLICIES:
        err.print(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        raise typer.Exit(2)
    _require_reports(out)
    model = _checkpoint_model(checkpoint)
    tr = _load_trace_for_cli(trace, cluster, limit, seed, skip_bad_rows)
    (result,) = _run_replays(tr, [policy], seed, not no_invariants, as_json, model)
    _warn_if_no_contention([result])
    if out is not None:
        from mlwe.sim.report import write_report

        write_report([result], out)
    if as_json:
        print(json.dumps(result.metrics, sort_keys=True))
        return
    _print_metrics([result])


@app.command("compare")
def compare_cmd(
    trace: Annotated[str, typer.Argument(help="philly, itp:NN, alibaba, synthetic, or a CSV path")],
    policies: Annotated[str, typer.Option(help="comma-separated policy names")] = "mlwe,fifo,fifo-backfill",
    cluster: Annotated[str | None, typer.Option(help="pooled:N, nodes:NxG[:MODEL] or a YAML cluster file")] = None,
    limit: Annotated[int | None, typer.Option(min=1)] = None,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="write metrics.json, report.md and plots here")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    skip_bad_rows: Annotated[bool, typer.Option("--skip-bad-rows")] = False,
    checkpoint: Annotated[str, typer.Option(help=CHECKPOINT_HELP)] = "periodic:1800,cost=0,restart=60",
) -> None:
    """Run several policies on the same trace and compare them."""
    from mlwe.sim.baselines import POLICIES

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        err.print(f"unknown policy {', '.join(unknown) or '(none)'}; known: {', '.join(POLICIES)}")
        raise typer.Exit(2)
    _require_reports(out)
    model = _checkpoint_model(checkpoint)
    tr = _load_trace_for_cli(trace, cluster, limit, seed, skip_bad_rows)
    results = _run_replays(tr, names, seed, True, as_json, model)
    _warn_if_no_contention(results)
    if out is not None:
        from mlwe.sim.report import write_report

        write_report(results, out)
    if as_json:
        print(json.dumps({r.policy: r.metrics for r in results}, sort_keys=True))
        return
    _print_metrics(results)


def _warn_if_no_contention(results: list[ReplayResult]) -> None:
    """A replay where nothing waits compares nothing: every policy places every job at once."""
    for r in results:
        m = r.metrics
        util, delay = m.get("gpu_util"), m.get("avg_queue_delay_s")
        if util is not None and util < 0.3 and (delay or 0.0) < 1.0 and not m.get("preemptions"):
            err.print(
                f"warning: {r.trace} / {r.policy}: no contention (GPU utilisation {util * 100:.0f}%,"
                f" average queueing delay {delay or 0:.1f} s, no preemption): jobs never wait, so"
                " policies cannot differ; use a smaller --cluster (e.g. pooled:64) or more jobs",
                markup=False, soft_wrap=True,
            )
            return


def _print_metrics(results: list[ReplayResult]) -> None:
    keys = ["jobs", "completed", "avg_jct_s", "median_jct_s", "p99_jct_s", "avg_queue_delay_s",
            "max_queue_delay_s", "makespan_s", "gpu_util", "deadline_met_ratio", "preemptions",
            "gpu_hours_lost_to_preemption", "queue_fairness_jain", "estimate_p50_rel_error",
            "estimate_p90_rel_error", "estimate_coverage", "checkpoint_model", "wall_s",
            "jobs_per_s", "events_per_s", "invariant_checks", "invariants"]
    table = Table(title=f"replay: {results[0].trace}")
    table.add_column("metric")
    for r in results:
        table.add_column(r.policy, justify="right")
    for k in keys:
        table.add_row(k, *[_fmt(r.metrics.get(k)) for r in results])
    out.print(table)
    for note in results[0].metrics.get("trace_notes", []):
        out.print(f"[dim]note: {note}[/dim]", markup=True, soft_wrap=True)
    for r in results:
        m = r.metrics
        out.print(f"[dim]{r.policy}: checkpoints {m.get('checkpoint_semantics', '-')};"
                  f" placement {m.get('placement', '-')}[/dim]", markup=True, soft_wrap=True)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return "-" if v is None else str(v)


def _store(data_dir: Path | None, database_url: str | None, *, check: bool = True):  # type: ignore[no-untyped-def]
    from mlwe.core.extras import MissingExtra
    from mlwe.store.db import SchemaError, check_schema, make_engine
    from mlwe.store.db import database_url as resolve

    url = resolve(data_dir=data_dir, url=database_url)
    try:
        engine = make_engine(url)
    except (MissingExtra, ValueError) as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if check:
        try:
            check_schema(engine)
        except SchemaError as exc:
            err.print(f"error: {exc}", markup=False, soft_wrap=True)
            raise typer.Exit(2) from None
    return engine


@db_app.command("upgrade")
def db_upgrade(data_dir: DataDir = None, database_url: DatabaseUrl = None) -> None:
    """Create or migrate the schema to the version this mlwe needs."""
    from mlwe.store.db import current_revision, migrate, redact_url

    engine = _store(data_dir, database_url, check=False)
    before = current_revision(engine)
    migrate(engine)
    out.print(f"{redact_url(str(engine.url))}: {before or 'empty'} -> {current_revision(engine)}",
              markup=False)


@events_app.command("dead-letters")
def events_dead_letters(
    as_json: Annotated[bool, typer.Option("--json", help="same as -o json")] = False,
    output: Annotated[str, typer.Option("--output", "-o", help="table, wide, json, yaml or name")] = "table",
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
) -> None:
    """List events that failed every retry."""
    from mlwe.bus.consumer import dead_letters
    from mlwe.output import Column, Format, render, rfc3339

    try:
        fmt = Format.json if as_json else Format(output)
    except ValueError:
        err.print(f"-o {output!r}: use table, wide, json, yaml or name", markup=False)
        raise typer.Exit(2) from None
    rows = [{"event_id": d.event_id, "time": d.time, "subject": d.subject, "error": d.error,
             "attempts": d.attempts, "replayed": d.replayed, "processed": d.processed}
            for d in dead_letters(_store(data_dir, database_url))]
    render(rows, [
        Column("EVENT", lambda d: d["event_id"]), Column("TIME", lambda d: rfc3339(d["time"])),
        Column("SUBJECT", lambda d: d["subject"]), Column("ATTEMPTS", lambda d: d["attempts"]),
        Column("REPLAYED", lambda d: d["replayed"]), Column("PROCESSED", lambda d: d["processed"]),
        Column("ERROR", lambda d: d["error"]),
    ], fmt, raw=rows, name=lambda d: str(d["event_id"]), empty="no dead letters")


@events_app.command("replay")
def events_replay(
    event_id: Annotated[str, typer.Argument(help="id of a dead-lettered event")],
    bus: Annotated[str, typer.Option(help="NATS URL of the engine's bus")] = "nats://127.0.0.1:4222",
    prefix: Annotated[str, typer.Option(help="subject prefix of the engine's stream")] = "mlwe",
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Publish a dead-lettered event again, with its original id and correlation id."""
    import asyncio

    from mlwe.bus.consumer import replay_dead_letter
    from mlwe.bus.nats import NatsBus

    engine = _store(data_dir, database_url)

    async def run() -> str:
        nb = await NatsBus.connect(bus, prefix=prefix)
        try:
            env = await replay_dead_letter(engine, nb, event_id)
        finally:
            await nb.close()
        return env.id

    try:
        replayed = asyncio.run(run())
    except KeyError:
        err.print(f"no dead letter with id {event_id!r}")
        raise typer.Exit(2) from None
    out.print(f"replayed {replayed}")


# the service commands (serve, submit, status, explain, cancel, nodes, watch, token, audit, config)
from mlwe.api.cli import register as _register_service  # noqa: E402
from mlwe.api.cli import register_agent as _register_agent_remote  # noqa: E402

_register_service(app)
_register_agent_remote(agent_app)


# the local backend's workload daemon (its body in mlwe.backends.local)
from mlwe.backends.local.cli import daemon_command  # noqa: E402

app.command("daemon")(daemon_command)

# the Ray backend: how Ray nodes map to mlwe nodes (mlwe ray commands / check)
from mlwe.backends.ray.cli import app as _ray_app  # noqa: E402

app.add_typer(_ray_app, name="ray")


# pipelines: pipeline run/status/validate/models, runs list/show, example ... (mlwe.pipelines)
from mlwe.pipelines.cli import register as _register_pipelines  # noqa: E402

_register_pipelines(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
