"""The pipelines' CLI commands, registered on the ``mlwe`` app by ``mlwe.cli``.

- ``mlwe pipeline validate FILE`` / ``run FILE`` / ``resume`` / ``status [RUN]`` /
  ``models [NAME]``;
- ``mlwe runs list`` / ``runs show RUN``: what the store recorded; ``runs
  export-mlflow``: to an MLflow tracking store (optional extra ``mlwe[mlflow]``);
- ``mlwe example drift-retrain`` / ``example inference-scaling``: the case studies,
  run for real on local workload daemons, printing their figures.

``pipeline run`` opens the engine on the data directory (the cluster stored
there, or ``--cluster``, or one node sized to this machine), starts a workload
daemon per node, runs the pipeline to its end (services: ``--serve-for``
seconds), and exits 0 if it succeeded.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

DataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", help="data directory: SQLite store and run artifacts (./.mlwe)"),
]
DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", help="SQLAlchemy URL; default $MLWE_DATABASE_URL or SQLite"),
]
AsJson = Annotated[bool, typer.Option("--json", help="print JSON")]

pipeline_app = typer.Typer(help="ML pipelines: DAGs of steps run as workloads.",
                           no_args_is_help=True)
runs_app = typer.Typer(help="Pipeline runs recorded in the store.", no_args_is_help=True)
example_app = typer.Typer(help="Case studies that run for real and print their figures.",
                          no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(pipeline_app, name="pipeline")
    app.add_typer(runs_app, name="runs")
    app.add_typer(example_app, name="example")


# ================================================================== helpers
def _data_dir(data_dir: Path | None) -> Path:
    from mlwe.store.db import DEFAULT_DATA_DIR

    d = (data_dir or DEFAULT_DATA_DIR).resolve()
    d.mkdir(parents=True, exist_ok=True)
    return d


def _repo(data_dir: Path | None, database_url: str | None) -> Any:
    from mlwe.store.db import SchemaError, StoreUnavailable
    from mlwe.store.repository import Repository

    try:
        return Repository.open(database_url, _data_dir(data_dir))
    except (SchemaError, StoreUnavailable) as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None


def _load(file: Path) -> Any:
    from mlwe.pipelines.spec import PipelineError, load_pipeline

    try:
        return load_pipeline(file)
    except PipelineError as exc:
        for p in exc.problems:
            err.print(f"[red]error[/red] {p}", markup=True, soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None


def _params(pairs: list[str]) -> dict[str, Any]:
    import yaml

    out_: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            err.print(f"error: --param {pair!r}: expected NAME=VALUE", markup=False)
            raise typer.Exit(2)
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, float) and not math.isfinite(value):
            value = raw  # ".inf" / ".nan": kept as the text given, never a non-finite number
        out_[key] = value if isinstance(value, str | int | float | bool) else raw
    return out_


def _fmt_t(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _steps_table(run: Any) -> Table:
    table = Table(title=f"run {run.id} ({run.pipeline}): {run.status}")
    for col in ("step", "kind", "status", "workload(s)", "attempts", "metrics", "error"):
        table.add_column(col, overflow="fold")
    for s in run.steps:
        metrics = ", ".join(
            f"{k}={_num(v)}" for k, v in s.metrics.items() if not isinstance(v, dict | list)
        )
        table.add_row(
            s.step, s.kind, s.status, ", ".join(s.workloads) or "-", str(s.attempts),
            metrics or "-", s.error or "",
        )
    return table


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def _machine_cluster() -> Any:
    """One node the size of this machine (its usable CPUs, 80% of its memory)."""
    from mlwe.backends.local.telemetry import machine_memory_mib, usable_cpus
    from mlwe.core.spec import ClusterSpec, NodeSpec

    return ClusterSpec(
        nodes=(NodeSpec(name="local-0", cpu=str(usable_cpus()),
                        memory=f"{int(machine_memory_mib() * 0.8)}Mi"),)
    )


def _cluster(data_dir: Path, database_url: str | None, cluster_file: Path | None) -> Any:
    """The cluster stored in the data directory, else ``--cluster``, else this machine."""
    from mlwe.core.spec import ClusterSpec
    from mlwe.specfile import SpecFileError, load_cluster
    from mlwe.store import db
    from mlwe.store.repository import Repository

    engine = db.make_engine(db.database_url(data_dir, database_url))
    try:
        if "nodes" in db.table_names(engine):
            repo = Repository(engine)
            nodes = [spec for spec, _ in repo.load_nodes()]
            if nodes:
                if cluster_file is not None:
                    err.print(
                        f"note: the data directory already holds a cluster ({len(nodes)} nodes);"
                        " --cluster is ignored",
                        markup=False,
                    )
                return ClusterSpec(nodes=tuple(nodes), queues=tuple(repo.load_queues()))
    finally:
        engine.dispose()
    if cluster_file is not None:
        try:
            return load_cluster(cluster_file)
        except SpecFileError as exc:
            err.print(str(exc), markup=False)
            raise typer.Exit(2) from None
    return _machine_cluster()


# ================================================================= pipeline
@pipeline_app.command("validate")
def pipeline_validate(
    file: Annotated[Path, typer.Argument(help="pipeline spec (YAML or JSON)")],
) -> None:
    """Check a pipeline: its DAG, steps, placeholders and workload fields."""
    spec = _load(file)
    out.print(
        f"{file}: pipeline {spec.name!r} is valid: {len(spec.steps)} step(s),"
        f" order {' -> '.join(spec.order())}"
    )


Backend = Annotated[str, typer.Option(help="local (workload daemons, real processes) or sim")]
ClusterFile = Annotated[
    Path | None, typer.Option("--cluster", help="cluster spec for a new data directory")
]
ServeFor = Annotated[
    float, typer.Option("--serve-for", help="seconds to keep services up once serving")
]
Timeout = Annotated[float, typer.Option(help="give up after this many seconds")]


#: The backends (:mod:`mlwe.runtime.backends` kinds) a pipeline runs on here.
PIPELINE_BACKENDS = ("local", "sim")


def _open_engine(
    ddir: Path, database_url: str | None, cluster_file: Path | None, backend: str
) -> tuple[Any, Any, Any]:
    """The engine on the data directory, its pipeline runner and the loop that drives both."""
    from mlwe.pipelines.loop import PipelineLoop
    from mlwe.pipelines.runner import PipelineRunner, stream_listener
    from mlwe.runtime.backends import make_backend
    from mlwe.runtime.clock import WallClock
    from mlwe.runtime.engine import Engine, EngineConfig

    if backend not in PIPELINE_BACKENDS:
        err.print("error: --backend must be local or sim", markup=False)
        raise typer.Exit(2)
    cluster = _cluster(ddir, database_url, cluster_file)
    clock = WallClock()
    try:
        # local: a daemon per node, so that a node can fail on its own; sim: a step with
        # no estimate runs 5 s
        be = make_backend(backend, clock, cluster, default_duration_s=5.0,
                          local_nodes_dir=ddir / "local")
    except Exception as exc:  # a daemon refused its node (e.g. larger than the machine)
        if backend != "local":
            raise
        err.print(f"error: cannot start the workload daemons: {exc}", markup=False,
                  soft_wrap=True)
        raise typer.Exit(2) from None
    engine = Engine.open(cluster, be, data_dir=ddir, database_url=database_url, clock=clock,
                         config=EngineConfig(retry_base_s=1.0, tick_s=0.1))
    runner = PipelineRunner(engine, ddir, verify_outputs=backend == "local")
    runner.listeners.append(stream_listener(engine.streams.publish, runner))
    return engine, runner, PipelineLoop(engine, runner, period_s=0.1)


def _narrate(ev: Any) -> None:
    """Print what happens to a run as it happens (text mode)."""
    if ev.kind == "step.waiting":
        out.print(f"  {ev.step}: waiting: {ev.data['reason']}", markup=False, soft_wrap=True)
    elif ev.kind in ("step.running", "step.succeeded", "step.failed", "step.serving",
                     "step.skipped", "model.registered"):
        extra = f": {ev.data['error']}" if ev.kind == "step.failed" else ""
        out.print(f"  {ev.step}: {ev.kind.removeprefix('step.')}{extra}", markup=False,
                  soft_wrap=True)


def _follow(runner: Any, loop: Any, run_ids: list[str], serve_for: float, timeout: float,
            as_json: bool) -> int:
    """Drive ``run_ids`` to their end (services: ``serve_for`` seconds); the exit code."""
    finished = {"succeeded", "failed", "cancelled"}
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    step_done = {"succeeded", "failed", "skipped", "cancelled", "serving"}
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                  TimeElapsedColumn(), console=err, disable=as_json, transient=True) as bar:
        tasks = {r: bar.add_task(f"run {r}", total=len(runner.run(r).steps) or 1) for r in run_ids}

        def done() -> bool:
            for r, task in tasks.items():
                bar.update(task, completed=sum(1 for s in runner.run(r).steps if s.status in step_done))
            return all(runner.status(r) in finished | {"serving"} for r in run_ids)

        ok = loop.run_until(done, timeout)
    serving = [r for r in run_ids if runner.status(r) == "serving"]
    if ok and serving:
        if not as_json:
            out.print(f"serving: {', '.join(serving)}; stopping their services in {serve_for:g}s")
        end = time.monotonic() + serve_for
        loop.run_until(lambda: time.monotonic() >= end, serve_for + 1)
        for r in serving:
            runner.stop(r, actor="cli", reason="--serve-for elapsed")
    elif not ok:
        for r in run_ids:
            if runner.status(r) not in finished:
                err.print(f"run {r}: still {runner.status(r)} after {timeout:g}s; stopping it",
                          markup=False)
                runner.stop(r, actor="cli", reason="timeout")
    loop.run_until(lambda: all(runner.status(r) in finished for r in run_ids), 60)
    runs = [runner.run(r) for r in run_ids]
    for run in runs:
        if as_json:
            print(json.dumps(run.to_dict(), sort_keys=True))
        else:
            out.print(_steps_table(run))
    return 0 if all(run.status == "succeeded" for run in runs) else 1


@pipeline_app.command("run")
def pipeline_run(
    file: Annotated[Path, typer.Argument(help="pipeline spec (YAML or JSON)")],
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="NAME=VALUE (repeatable)")
    ] = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    cluster_file: ClusterFile = None,
    backend: Backend = "local",
    serve_for: ServeFor = 0.0,
    timeout: Timeout = 3600.0,
    as_json: AsJson = False,
) -> None:
    """Run a pipeline on the engine: every step a workload through the control plane."""
    from mlwe.pipelines.spec import PipelineError, resolve_params

    spec = _load(file)
    params = _params(param or [])
    try:
        resolve_params(spec, params)  # refuse a bad parameter before starting anything
    except PipelineError as exc:
        for p in exc.problems:
            err.print(f"[red]error[/red] {p}", markup=True, soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
    ddir = _data_dir(data_dir)
    engine, runner, loop = _open_engine(ddir, database_url, cluster_file, backend)
    code = 0
    try:
        try:
            rec = runner.start(spec, params, actor="cli")
        except PipelineError as exc:
            for p in exc.problems:
                err.print(f"[red]error[/red] {p}", markup=True, soft_wrap=True, highlight=False)
            raise typer.Exit(2) from None
        if not as_json:
            out.print(f"run {rec.id}: started ({len(spec.steps)} steps);"
                      f" data in {ddir / 'runs' / rec.id}")
            runner.listeners.append(_narrate)
        code = _follow(runner, loop, [rec.id], serve_for, timeout, as_json)
    except KeyboardInterrupt:
        err.print("interrupted: stopping the run", markup=False)
        for rid in runner.active_runs():
            runner.stop(rid, actor="cli", reason="interrupted")
        code = 130
    finally:
        engine.close(stop_workloads=True)
    raise typer.Exit(code)


@pipeline_app.command("resume")
def pipeline_resume(
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    backend: Backend = "local",
    serve_for: ServeFor = 0.0,
    timeout: Timeout = 3600.0,
    as_json: AsJson = False,
) -> None:
    """Follow the runs the store holds as unfinished (after ``pipeline run`` was stopped)."""
    ddir = _data_dir(data_dir)
    engine, runner, loop = _open_engine(ddir, database_url, None, backend)
    try:
        resumed = runner.resume()
        if not resumed:
            if not as_json:
                out.print("no unfinished pipeline run to resume")
            code = 0
        else:
            if not as_json:
                out.print(f"resumed: {', '.join(resumed)}")
            code = _follow(runner, loop, resumed, serve_for, timeout, as_json)
    except KeyboardInterrupt:
        for rid in runner.active_runs():
            runner.stop(rid, actor="cli", reason="interrupted")
        code = 130
    finally:
        engine.close(stop_workloads=True)
    raise typer.Exit(code)


@pipeline_app.command("status")
def pipeline_status(
    run_id: Annotated[str | None, typer.Argument(help="a run id; default: the latest runs")] = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    limit: Annotated[int, typer.Option(min=1)] = 20,
    as_json: AsJson = False,
) -> None:
    """Where pipeline runs stand: each run's status and its steps'."""
    from mlwe.store.pipelines import PipelineStore

    store = PipelineStore(_repo(data_dir, database_url))
    if run_id is not None:
        _show(store, run_id, as_json)
        return
    runs = [store.run(r.id) for r in store.runs(limit=limit)]
    if as_json:
        print(json.dumps([r.to_dict() for r in runs if r is not None], sort_keys=True))
        return
    table = Table(title="pipeline runs")
    for col in ("run", "pipeline", "status", "started", "steps"):
        table.add_column(col)
    for r in runs:
        if r is None:
            continue
        table.add_row(r.id, r.pipeline, r.status, _fmt_t(r.created),
                      " ".join(f"{s.step}:{s.status}" for s in r.steps))
    out.print(table)


@pipeline_app.command("models")
def pipeline_models(
    name: Annotated[str | None, typer.Argument(help="a model name; default: all")] = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """The model registry: versions, stages, metrics."""
    from mlwe.store.pipelines import ModelRegistry

    reg = ModelRegistry(_repo(data_dir, database_url), _data_dir(data_dir))
    versions = reg.versions(name)
    if as_json:
        print(json.dumps([v.to_dict() for v in versions], sort_keys=True))
        return
    table = Table(title="models")
    for col in ("model", "version", "stage", "run", "metrics"):
        table.add_column(col, overflow="fold")
    for v in versions:
        table.add_row(v.name, str(v.version), v.stage, v.run_id or "-",
                      ", ".join(f"{k}={_num(x)}" for k, x in v.metrics.items()))
    out.print(table)


# ===================================================================== runs
@runs_app.command("list")
def runs_list(
    pipeline: Annotated[str | None, typer.Option(help="only this pipeline's runs")] = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    limit: Annotated[int, typer.Option(min=1)] = 50,
    as_json: AsJson = False,
) -> None:
    """Recorded runs, newest first."""
    from mlwe.store.pipelines import PipelineStore

    runs = PipelineStore(_repo(data_dir, database_url)).runs(pipeline, limit=limit)
    if as_json:
        print(json.dumps([r.to_dict() for r in runs], sort_keys=True))
        return
    table = Table(title="runs")
    for col in ("run", "pipeline", "status", "started", "updated", "params"):
        table.add_column(col, overflow="fold")
    for r in runs:
        table.add_row(r.id, r.pipeline, r.status, _fmt_t(r.created), _fmt_t(r.updated),
                      ", ".join(f"{k}={v}" for k, v in r.params.items()))
    out.print(table)


@runs_app.command("show")
def runs_show(
    run_id: Annotated[str, typer.Argument(help="the run id")],
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """One run: parameters, metrics, artifacts, steps."""
    from mlwe.store.pipelines import PipelineStore

    _show(PipelineStore(_repo(data_dir, database_url)), run_id, as_json, full=True)


@runs_app.command("export-mlflow")
def runs_export_mlflow(
    run_ids: Annotated[list[str] | None, typer.Argument(help="runs to export; default: latest")] = None,
    tracking_uri: Annotated[
        str, typer.Option("--tracking-uri", help="MLflow tracking URI or a local directory")
    ] = "mlruns",
    experiment: Annotated[
        str | None, typer.Option(help="MLflow experiment; default mlwe/<pipeline>")
    ] = None,
    data_dir: DataDir = None,
    database_url: DatabaseUrl = None,
    as_json: AsJson = False,
) -> None:
    """Export runs, step metrics and artifact paths to MLflow (needs mlwe[mlflow])."""
    from mlwe.pipelines.mlflow_export import MlflowMissing, export_runs
    from mlwe.store.pipelines import PipelineStore

    store = PipelineStore(_repo(data_dir, database_url))
    try:
        done = export_runs(store, tracking_uri, run_ids or None, experiment=experiment)
    except (MlflowMissing, KeyError) as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps([d.__dict__ for d in done], sort_keys=True))
        return
    for d in done:
        what = "already exported" if d.skipped else "exported"
        out.print(f"{d.run_id}: {what} as MLflow run {d.mlflow_run_id}"
                  f" (experiment {d.experiment_id})", markup=False)


def _show(store: Any, run_id: str, as_json: bool, *, full: bool = False) -> None:
    run = store.run(run_id)
    if run is None:
        known = ", ".join(r.id for r in store.runs(limit=10)) or "none"
        err.print(f"error: no run {run_id!r} (latest: {known})", markup=False, soft_wrap=True)
        raise typer.Exit(1)
    if as_json:
        print(json.dumps(run.to_dict(), sort_keys=True))
        return
    out.print(_steps_table(run))
    if full:
        for title, data in (("params", run.params), ("metrics", run.metrics),
                            ("artifacts", run.artifacts)):
            out.print(f"[bold]{title}[/bold]", markup=True)
            for k, v in data.items():
                out.print(f"  {k} = {_num(v)}", markup=False, soft_wrap=True)


# ================================================================= examples
def _print_figures(result: dict[str, Any], keys: list[str], as_json: bool) -> None:
    if as_json:
        slim = {k: v for k, v in result.items() if k != "supervision"}
        if "supervision" in result:
            slim["supervision_records"] = len(result["supervision"])
        print(json.dumps(slim, sort_keys=True, default=str))
        return
    table = Table(title="figures")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k in keys:
        table.add_row(k, _num(result.get(k)))
    out.print(table)


@contextlib.contextmanager
def _extra_or_exit() -> Iterator[None]:
    """The case studies need ``mlwe[pipelines]``: a missing one is a message, not a traceback."""
    from mlwe.core.extras import MissingExtra

    try:
        yield
    except MissingExtra as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None


@example_app.command("drift-retrain")
def example_drift(
    seed: int = 0,
    shift: Annotated[str, typer.Option(help="rotation, noise or occlusion")] = "rotation",
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="keep the run's data here (default: temp)")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Drift -> retrain -> promote on the digits data set, run for real (~30 s)."""
    with _extra_or_exit():
        from mlwe.pipelines import drift_retrain as dr
        from mlwe.pipelines.programs.digitsdata import SHIFTS

    if shift not in SHIFTS:
        err.print(f"error: --shift must be one of {', '.join(SHIFTS)}", markup=False)
        raise typer.Exit(2)
    result = dr.run(data_dir, dr.DriftConfig(seed=seed, shift=shift))
    if not as_json:
        for ev in result["timeline"]:
            out.print(f"  t={ev['t']:7.2f}s  {ev['what']}", markup=False)
    _print_figures(result, [
        "accuracy_before_drift", "accuracy_on_drift", "accuracy_after_retrain", "promoted",
        "seconds_drift_to_detection", "seconds_drift_to_promotion",
        "holdout_accuracy_candidate", "holdout_accuracy_production", "seconds_total",
    ], as_json)
    raise typer.Exit(0 if result["promoted"] else 1)


@example_app.command("inference-scaling")
def example_scaling(
    seed: int = 0,
    duration: Annotated[float, typer.Option(help="seconds of load")] = 40.0,
    peak_rps: Annotated[float, typer.Option("--peak-rps")] = 150.0,
    node_failure: Annotated[bool, typer.Option(help="fail a replica's node midway")] = True,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="keep the run's data here (default: temp)")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """An HTTP inference service scaled by the agent under a rising and falling load (~50 s)."""
    with _extra_or_exit():
        from mlwe.pipelines import inference_scaling as sc

    cfg = sc.ScalingConfig(seed=seed, duration_s=duration, peak_rps=peak_rps,
                           fail_node_at=0.5 if node_failure else -1.0)
    result = sc.run(data_dir, cfg)
    if not as_json:
        for ev in result["scale_events"]:
            out.print(f"  t={ev['t']:6.2f}s  replicas {ev['from']} -> {ev['to']}"
                      f"  ({ev['rate_rps']} req/s, p95 {ev['p95_ms']} ms)", markup=False)
        if result["node_failure"]:
            out.print(f"  node failure: {result['node_failure']}", markup=False, soft_wrap=True)
    _print_figures(result, [
        "p95_latency_ms", "latency_target_ms", "p50_latency_ms", "p99_latency_ms",
        "max_replicas", "min_replicas", "requests", "errors", "retried_requests",
        "seconds_total",
    ], as_json)
