"""``mlwe bench``: every benchmark's command, registered here and nowhere else.

``mlwe.cli`` adds :data:`bench_app` as ``mlwe bench``. The bodies stay with what
they measure, and each command imports its body only when it runs (the CLI
starts without the engine loaded: tests/test_cli_startup.py):

- ``mlwe bench kernel``: the discrete-event kernel on a null model
  (:func:`mlwe.sim.kernel.bench_kernel`).
- ``mlwe bench core``: placement and preemption speed of the control plane on a
  synthetic cluster (:mod:`mlwe.sim.bench`).
- ``mlwe bench engine-store``: durable submissions through the runtime
  ``Engine`` (concurrent clients, group commit), and the store's recovery time
  (:mod:`mlwe.runtime.bench`). ``mlwe bench store`` is its old name, kept as a
  hidden alias.
- ``mlwe bench store-direct``: the store without the engine: submissions
  applied to a control plane and flushed by its ``StoreWriter``, and recovery
  (:mod:`mlwe.store.bench`).
- ``mlwe bench api``: HTTP submissions, SSE delivery lag and read latency over
  loopback, the server in its own process (:mod:`mlwe.api.bench`).
- ``mlwe bench backend --backend local|ray|slurm``: eviction latency and
  overhead of a real backend (:mod:`mlwe.backends.bench` picks
  ``mlwe.backends.<name>.bench``).

Every command takes ``--json`` (one JSON document on stdout).
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any

import typer
from rich.console import Console

from mlwe.backends.bench import BACKENDS

bench_app = typer.Typer(help="Benchmarks that print figures (not tests).", no_args_is_help=True)

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

AsJson = Annotated[bool, typer.Option("--json", help="print one JSON document")]


def _nothing() -> Any:
    return contextlib.nullcontext()


@bench_app.command("kernel")
def bench_kernel_cmd(
    events: Annotated[int, typer.Option(min=1000)] = 1_000_000,
    as_json: AsJson = False,
) -> None:
    """Discrete-event kernel speed on a null model."""
    from mlwe.sim.kernel import bench_kernel

    with err.status(f"bench kernel: {events:,} events", spinner="dots") if not as_json else _nothing():
        result = bench_kernel(events)
    print(json.dumps(result) if as_json else result)


@bench_app.command("core")
def bench_core_cmd(
    nodes: Annotated[int, typer.Option(min=1)] = 1000,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, max=64)] = 8,
    pending: Annotated[int, typer.Option(min=0)] = 2000,
    running: Annotated[int, typer.Option(min=0)] = 0,
    seed: int = 0,
    preemptions: Annotated[int, typer.Option(min=0)] = 200,
    as_json: AsJson = False,
    policy: Annotated[str, typer.Option(help="mlwe (learned, size-aware) or classic")] = "mlwe",
) -> None:
    """Placement and preemption speed of the control plane on a synthetic cluster."""
    from rich.table import Table

    from mlwe.sim.bench import bench_core

    if policy not in ("mlwe", "classic"):
        err.print(f"--policy {policy!r}: expected mlwe or classic")
        raise typer.Exit(2)
    with err.status(f"bench core: {nodes:,} nodes, {pending:,} pending", spinner="dots") if not as_json \
            else _nothing():
        result = bench_core(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            pending=pending,
            running=running,
            seed=seed,
            preemptions=preemptions,
            policy=policy,
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


_ENGINE_STORE_HELP = (
    "Durable submissions per second through the engine, and recovery time of the store."
)


def bench_engine_store_cmd(
    backend: Annotated[str, typer.Option(help="sqlite or postgres")] = "sqlite",
    submit: Annotated[int, typer.Option(min=1, help="submissions to time")] = 3000,
    recover: Annotated[int, typer.Option(min=1, help="stored workloads to recover")] = 100_000,
    clients: Annotated[int, typer.Option(min=1, help="concurrent submitting threads")] = 8,
    url: Annotated[str | None, typer.Option(help="database URL (postgres)")] = None,
    as_json: AsJson = False,
) -> None:
    from mlwe.runtime.bench import bench_engine_store

    if backend not in ("sqlite", "postgres"):
        err.print("--backend must be sqlite or postgres")
        raise typer.Exit(2)
    result = bench_engine_store(
        backend, submit, recover, clients=clients, url=url, verbose=not as_json
    )
    print(json.dumps(result, sort_keys=True) if as_json else result)


bench_app.command("engine-store", help=_ENGINE_STORE_HELP)(bench_engine_store_cmd)
# the old name (README figures and scripts before the rename used it): the same command
bench_app.command(
    "store", hidden=True, help=f"{_ENGINE_STORE_HELP} Old name of `mlwe bench engine-store`."
)(bench_engine_store_cmd)


@bench_app.command("store-direct")
def bench_store_direct_cmd(
    backend: Annotated[str, typer.Option(help="sqlite or postgres")] = "sqlite",
    submit: Annotated[int, typer.Option(min=1, help="submissions to time, in batches")] = 5000,
    batch: Annotated[int, typer.Option(min=1, help="submissions per transaction")] = 100,
    single: Annotated[
        int, typer.Option(min=0, help="submissions to time one per transaction (0: skip)")
    ] = 200,
    recover: Annotated[
        int, typer.Option(min=0, help="stored workloads to recover (0: skip)")
    ] = 100_000,
    url: Annotated[str | None, typer.Option(help="database URL (postgres)")] = None,
    as_json: AsJson = False,
) -> None:
    """Durable submissions per second and recovery time of the store alone, no engine.

    Submissions are applied to a control plane and flushed by its StoreWriter,
    ``--batch`` per transaction (``submit_per_s``) and one per transaction
    (``submit_single_per_s``); ``recovery_s`` is ``recover()`` of ``--recover``
    stored workloads."""
    from mlwe.store.bench import bench_store

    if backend not in ("sqlite", "postgres"):
        err.print("--backend must be sqlite or postgres")
        raise typer.Exit(2)
    result = bench_store(backend, submit, recover, batch=batch, n_single=single, url=url,
                         verbose=not as_json)
    print(json.dumps(result, sort_keys=True) if as_json else result)


@bench_app.command("api")
def bench_api_cmd(
    submits: Annotated[int, typer.Option(min=10, help="submissions to time")] = 2000,
    concurrency: Annotated[int, typer.Option(min=1, max=256, help="concurrent HTTP clients")] = 32,
    clients: Annotated[int, typer.Option(min=1, max=2000, help="SSE clients")] = 200,
    rate: Annotated[float, typer.Option(min=1, help="events per second published")] = 20.0,
    seconds: Annotated[float, typer.Option(min=1, help="SSE measurement time")] = 10.0,
    read_clients: Annotated[
        int, typer.Option(min=0, max=2000, help="SSE clients while the workload list is read")
    ] = 300,
    read_seconds: Annotated[float, typer.Option(min=1, help="read measurement time")] = 10.0,
    phase: Annotated[
        list[str] | None,
        typer.Option(help="only these phases (repeat): submit, sse, read-no-sse, read-sse"),
    ] = None,
    as_json: AsJson = False,
) -> None:
    """HTTP submissions per second, SSE delivery lag with many stream clients, and the
    workload list's read latency with many stream clients (``read_p99_ms_with_300_sse``)."""
    from mlwe.api.bench import bench_api

    known = ("submit", "sse", "read-no-sse", "read-sse")
    bad = [p for p in phase or () if p not in known]
    if bad:
        typer.echo(f"error: unknown phase(s) {', '.join(bad)}; known: {', '.join(known)}", err=True)
        raise typer.Exit(2)
    result = bench_api(submits=submits, concurrency=concurrency, sse_clients=clients,
                       events_per_s=rate, sse_seconds=seconds, read_sse_clients=read_clients,
                       read_seconds=read_seconds, phases=tuple(phase or known), verbose=not as_json)
    print(json.dumps(result, sort_keys=True) if as_json else result)


@bench_app.command("backend")
def bench_backend_cmd(
    backend: Annotated[str, typer.Option(help=f"which backend: {', '.join(BACKENDS)}")] = "local",
    trials: Annotated[int, typer.Option(min=1, help="preemptions to time")] = 20,
    workloads: Annotated[int, typer.Option(min=1, help="running workloads for the CPU figure")] = 50,
    measure_s: Annotated[float, typer.Option(min=1, help="seconds to measure CPU over")] = 10.0,
    grace_s: Annotated[float, typer.Option(min=0, help="stop grace period")] = 5.0,
    as_json: AsJson = False,
) -> None:
    """Eviction latency and daemon overhead of a real backend (real processes)."""
    from mlwe.backends.bench import NoBenchmark, run_backend_bench

    if backend not in BACKENDS:
        typer.echo(f"error: --backend must be one of {', '.join(BACKENDS)}", err=True)
        raise typer.Exit(2)
    try:
        result = run_backend_bench(backend, trials=trials, workloads=workloads,
                                   measure_s=measure_s, grace_s=grace_s)
    except NoBenchmark as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(result, sort_keys=True))
        return
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k:<{width}}  {v}")
